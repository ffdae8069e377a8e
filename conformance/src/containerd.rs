//! A containerd private to one test, and a CRI client for it: the kubelet's own runtime,
//! calling the built `aether-cni` through go-cni and libcni. Debian bookworm's 1.6 (with its
//! CRI plugin and CNI plugins 1.1.1), or unstable's 2.x with the CNI plugins 1.9.1, unpacked
//! by `make clients-deps` ([`Flavor`]).
//!
//! - Everything is the test's own: root, state, sockets and config under one temp dir; the
//!   CNI conf and bin dirs (`bridge`, `host-local`, `portmap`, `loopback` from Debian, plus
//!   `aether-cni`); runc's state; the pods' cgroup parent. The machine's containerd service
//!   and its `/var/lib/containerd` are never used.
//! - containerd runs in a private "node" netns (`nsenter --net`: the bridge and portmap's
//!   rules never touch the machine) and in the machine's mount namespace, so its pod netns
//!   mounts (under its own state dir) stay visible to the test and to a restarted containerd
//!   (`ip netns exec` would give each process a mount namespace of its own).
//! - The sandbox (pause) image is `make clients-deps`'s static pause binary packed as an OCI
//!   archive and imported with `ctr images import`: there is no registry.
//! - CRI calls go through `conformance/clients/cri/cri.py` (Debian's python3-grpcio, with code
//!   protoc generated from the `aether-cri` crate's `cri/proto/runtime_v1.proto`): crictl cannot be built here.
//!
//! Drop stops and removes what is left (sandboxes through the CRI, then containerd by PID,
//! then runc containers and shims of this instance only), removes libcni's cache entries of
//! the test's network and sandboxes, the cgroup parent, the node netns and the temp dir.

use std::cell::RefCell;
use std::io::{BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use aether_testkit::TestNetns;
use serde_json::{json, Value};

use crate::clients::{
    clients_dir, exec, must, pids_mentioning, records, render, repo, terminate, LibcniCache, TempDir,
};

/// The sandbox image's name, as `make clients-deps` packs it.
pub const SANDBOX_IMAGE: &str = "localhost/aether-pause:test";
/// The node's conflist: chaining aether-cni, or the main CNI alone.
pub const CHAINED_CONFLIST: &str = "10-aether.conflist";
pub const MAIN_CONFLIST: &str = "10-bridge.conflist";
/// Debian's CNI plugins.
const DEBIAN_CNI_DIR: &str = "/usr/lib/cni";

/// Which containerd a test runs: bookworm's 1.6 (installed by `make clients-deps`), or
/// unstable's 2.x with the CNI plugins 1.9 (unpacked by it into `target/clients/containerd2`,
/// nothing installed; bookworm's runc either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    V1_6,
    V2,
}

impl Flavor {
    pub const ALL: [Flavor; 2] = [Flavor::V1_6, Flavor::V2];

    pub fn name(self) -> &'static str {
        match self {
            Flavor::V1_6 => "containerd 1.6",
            Flavor::V2 => "containerd 2",
        }
    }

    /// Where its binaries and CNI plugins are: `/` or the unpacked packages.
    fn root(self) -> PathBuf {
        match self {
            Flavor::V1_6 => PathBuf::from("/"),
            Flavor::V2 => clients_dir().join("containerd2/root"),
        }
    }

    pub fn containerd(self) -> PathBuf {
        self.root().join("usr/bin/containerd")
    }

    pub fn ctr(self) -> PathBuf {
        self.root().join("usr/bin/ctr")
    }

    /// Its CNI plugins (`bridge`, `host-local`, `portmap`, `loopback`): Debian's 1.1.1 for 1.6,
    /// 1.9.1 for 2.x.
    pub fn cni_dir(self) -> PathBuf {
        self.root().join(DEBIAN_CNI_DIR.trim_start_matches('/'))
    }

    /// The node conflist's `cniVersion`: 1.0.0 (the newest bookworm's plugins speak), 1.1.0
    /// on 2.x (STATUS is only called for a 1.1.0 list).
    pub fn cni_version(self) -> &'static str {
        match self {
            Flavor::V1_6 => "1.0.0",
            Flavor::V2 => "1.1.0",
        }
    }

    /// Its configuration's template: version 2 for 1.6, version 3 (the CRI plugin split in
    /// three) for 2.x.
    fn config_template(self) -> &'static str {
        match self {
            Flavor::V1_6 => "containerd.toml.in",
            Flavor::V2 => "containerd2.toml.in",
        }
    }

    /// What the tests on it need that `make clients-deps` provides.
    pub fn requirements(self) -> Vec<PathBuf> {
        let mut v = vec![
            self.containerd(),
            self.ctr(),
            PathBuf::from("/usr/sbin/runc"),
            self.cni_dir().join("loopback"),
            clients_dir().join("pause-oci.tar"),
            clients_dir().join("cri/runtime_v1_pb2.py"),
        ];
        if self == Flavor::V2 {
            v.push(self.root().join("usr/bin/containerd-shim-runc-v2"));
        }
        v
    }
}

/// The machine's architecture as Go (and OCI platforms) name it.
fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// What the tests on containerd 1.6 need that `make clients-deps` provides.
pub fn requirements() -> Vec<PathBuf> {
    Flavor::V1_6.requirements()
}

/// The node's addressing: the bridge and its subnet exist only in the node netns.
pub struct NodeNet {
    pub bridge: &'static str,
    pub subnet: &'static str,
    pub gateway: &'static str,
}

/// What pods leave on the node, each list sorted: containerd's netns mounts, aether-cni's
/// attachment records, host-local's leases, libcni's cache entries, runc's containers.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Traces {
    pub netns_mounts: Vec<String>,
    pub records: Vec<String>,
    pub leases: Vec<String>,
    pub libcni_cache: Vec<String>,
    pub containers: Vec<String>,
}

/// A pod sandbox as the CRI and containerd report it.
#[derive(Debug)]
pub struct Sandbox {
    pub ready: bool,
    pub ip: String,
    pub netns: String,
    /// The pause process.
    pub pid: u64,
    /// The CRI's PodSandboxStatus, as JSON.
    pub status: Value,
}

pub struct Containerd {
    pub flavor: Flavor,
    pub dir: TempDir,
    pub node: TestNetns,
    pub network: String,
    pub net_dir: PathBuf,
    pub bin_dir: PathBuf,
    /// aether-cni's `stateDir` and `logFile`.
    pub state_dir: PathBuf,
    pub log_file: PathBuf,
    pub ipam_dir: PathBuf,
    socket: PathBuf,
    cgroup_parent: String,
    child: Option<Child>,
    cri: RefCell<Option<CriClient>>,
    sandboxes: RefCell<Vec<String>>,
}

/// `cri.py --serve`: one JSON line per call each way.
struct CriClient {
    child: Child,
    stdout: BufReader<ChildStdout>,
}

impl Containerd {
    /// Dirs, configuration, the node's conflist and the node netns; containerd is not started
    /// yet. With `chained`, the conflist (`conformance/clients/containerd.conflist.in`)
    /// chains `aether-cni` after `bridge` and `portmap` (`10-aether.conflist`); without, it is
    /// the node's main CNI alone (`10-bridge.conflist`), for an installer to chain.
    pub fn new(tag: &str, net: &NodeNet, chained: bool) -> Self {
        Containerd::new_on(Flavor::V1_6, tag, net, chained)
    }

    /// [`Containerd::new`] on `flavor`.
    pub fn new_on(flavor: Flavor, tag: &str, net: &NodeNet, chained: bool) -> Self {
        let dir = TempDir::new(tag);
        let pid = std::process::id();
        let network = format!("aether-{tag}-{pid}");
        let (net_dir, bin_dir, state_dir, ipam_dir) =
            (dir.mkdir("net"), dir.mkdir("bin"), dir.mkdir("aether-state"), dir.mkdir("ipam"));
        for plugin in ["bridge", "host-local", "portmap", "loopback"] {
            std::os::unix::fs::symlink(flavor.cni_dir().join(plugin), bin_dir.join(plugin)).unwrap();
        }
        let log_file = dir.join("aether-cni.log");
        let conflist = render(
            "containerd.conflist.in",
            &[
                ("CNI_VERSION", flavor.cni_version().into()),
                ("NAME", network.clone()),
                ("BRIDGE", net.bridge.into()),
                ("SUBNET", net.subnet.into()),
                ("GATEWAY", net.gateway.into()),
                ("IPAM_DIR", ipam_dir.display().to_string()),
                ("STATE_DIR", state_dir.display().to_string()),
                ("LOG_FILE", log_file.display().to_string()),
            ],
        );
        if chained {
            std::fs::write(net_dir.join(CHAINED_CONFLIST), conflist).unwrap();
        } else {
            let mut main: Value = serde_json::from_str(&conflist).unwrap();
            main["plugins"].as_array_mut().unwrap().retain(|p| p["type"] != "aether-cni");
            std::fs::write(net_dir.join(MAIN_CONFLIST), serde_json::to_string_pretty(&main).unwrap()).unwrap();
        }
        let config = render(
            flavor.config_template(),
            &[
                ("DIR", dir.0.display().to_string()),
                ("SANDBOX_IMAGE", SANDBOX_IMAGE.into()),
                ("BIN_DIR", bin_dir.display().to_string()),
                ("NET_DIR", net_dir.display().to_string()),
                ("PLATFORM", format!("linux/{}", go_arch())),
            ],
        );
        std::fs::write(dir.join("config.toml"), config).unwrap();
        let socket = dir.join("containerd.sock");
        let node = TestNetns::new(&format!("{tag}node"));
        Containerd {
            flavor,
            network,
            net_dir,
            bin_dir,
            state_dir,
            log_file,
            ipam_dir,
            socket,
            cgroup_parent: format!("/aether-{tag}-{pid}"),
            child: None,
            cri: RefCell::new(None),
            sandboxes: RefCell::new(Vec::new()),
            node,
            dir,
        }
    }

    /// Starts containerd in the node netns and waits until its CRI answers.
    pub fn start(&mut self) {
        self.start_with_env(&[]);
    }

    /// Starts containerd with these variables added to its environment, which the CNI plugins
    /// it runs inherit (libcni passes its own environment on): how a test makes the plugin
    /// fail a step of DEL (`AETHER_CNI_INJECT_FAILURE`) when containerd runs it.
    pub fn start_with_env(&mut self, env: &[(&str, &str)]) {
        assert!(self.child.is_none(), "containerd already started");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("containerd.log")).unwrap();
        let child = Command::new("nsenter")
            .arg(format!("--net={}", self.node.path()))
            .arg(self.flavor.containerd())
            .arg("--config")
            .arg(self.dir.join("config.toml"))
            // Its own shim first (containerd finds `containerd-shim-runc-v2` in its PATH).
            .env("PATH", self.path_env())
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn containerd");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self.socket.exists() && self.cri("Version", &json!({})).is_ok() {
                return;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("containerd exited ({status}) at start:\n{}", self.containerd_log());
            }
            assert!(Instant::now() < deadline, "containerd's CRI did not answer in 30 s:\n{}", self.containerd_log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// containerd's PATH: its own binaries (the shim) first.
    fn path_env(&self) -> String {
        let system = std::env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into());
        format!("{}:{system}", self.flavor.root().join("usr/bin").display())
    }

    /// Stops containerd (SIGTERM to its PID, SIGKILL after 10 s). Its shims and the pods
    /// keep running, as on a node where containerd restarts.
    pub fn stop(&mut self) {
        // nsenter execs containerd: the child's PID is containerd's.
        if let Some(mut child) = self.child.take() {
            terminate(&mut child, Duration::from_secs(10));
        }
    }

    /// containerd's socket: its CRI (gRPC) and its own API.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    pub fn containerd_log(&self) -> String {
        let text = std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// The sandbox image, imported into the CRI's namespace, then visible to the CRI.
    pub fn import_sandbox_image(&self) {
        must(
            "ctr images import",
            exec(
                Command::new(self.flavor.ctr())
                    .arg("--address")
                    .arg(&self.socket)
                    .args(["-n", "k8s.io", "images", "import", "--snapshotter", "native"])
                    .arg(clients_dir().join("pause-oci.tar")),
            ),
        );
        // The CRI learns of the image from containerd's event: wait until it does.
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.cri("ImageStatus", &json!({"image": {"image": SANDBOX_IMAGE}})).unwrap()["image"]["id"].is_null() {
            assert!(Instant::now() < deadline, "the CRI never saw {SANDBOX_IMAGE}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// One CRI call: `Ok(response)`, or `Err(the gRPC status and message)`. Calls go to one
    /// `cri.py --serve` process, started on first use (Python's start-up paid once).
    pub fn cri(&self, call: &str, request: &Value) -> Result<Value, String> {
        self.cri_timed(call, request).0
    }

    /// [`Containerd::cri`], with the call's own wall time as the client measured it (from the
    /// request sent on a connected channel to the answer).
    pub fn cri_timed(&self, call: &str, request: &Value) -> (Result<Value, String>, Duration) {
        outcome(&self.exchange(&json!({"call": call, "request": request})))
    }

    /// Every call at the same moment (a client thread and connection each, released
    /// together): each one's outcome and wall time, in order, and the wall time from the
    /// release until the last answered.
    pub fn cri_at_once(&self, calls: &[(&str, Value)]) -> (Vec<(Result<Value, String>, Duration)>, Duration) {
        let calls: Vec<Value> = calls.iter().map(|(call, request)| json!({"call": call, "request": request})).collect();
        let answer = self.exchange(&json!({"at_once": calls}));
        let answers = answer["answers"].as_array().unwrap_or_else(|| panic!("cri.py said {answer}"));
        (answers.iter().map(outcome).collect(), seconds(&answer))
    }

    /// One line to `cri.py --serve` and its answer.
    fn exchange(&self, line: &Value) -> Value {
        let mut cri = self.cri.borrow_mut();
        let client = cri.get_or_insert_with(|| {
            let mut child = Command::new("/usr/bin/python3")
                .arg(repo().join("conformance/clients/cri/cri.py"))
                .arg("--socket")
                .arg(&self.socket)
                .arg("--gen")
                .arg(clients_dir().join("cri"))
                .arg("--serve")
                .env("PYTHONDONTWRITEBYTECODE", "1")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn cri.py");
            let stdout = BufReader::new(child.stdout.take().unwrap());
            CriClient { child, stdout }
        });
        writeln!(client.child.stdin.as_mut().unwrap(), "{line}").expect("write to cri.py");
        let mut answer = String::new();
        client.stdout.read_line(&mut answer).expect("read from cri.py");
        serde_json::from_str(&answer).unwrap_or_else(|e| panic!("cri.py said {answer:?}: {e}"))
    }

    /// RunPodSandbox for pod `namespace/name`, with these annotations (none: the field is
    /// left out, as crictl and critest do). The sandbox ID, or the runtime's error message.
    pub fn run_pod(&self, namespace: &str, name: &str, annotations: Option<Value>) -> Result<String, String> {
        self.run_pod_attempt(namespace, name, annotations, 0)
    }

    /// RunPodSandbox as the kubelet recreates a pod whose sandbox stopped: the same pod (name,
    /// uid) with the next `attempt`.
    pub fn run_pod_attempt(
        &self,
        namespace: &str,
        name: &str,
        annotations: Option<Value>,
        attempt: u32,
    ) -> Result<String, String> {
        let (result, _) = self.cri_timed("RunPodSandbox", &self.pod_request(namespace, name, annotations, attempt));
        self.sandbox_started(result)
    }

    /// RunPodSandbox of pod `namespace/name` (no annotations): the sandbox ID and the call's
    /// wall time (it answers once the sandbox is ready: network set up, pause started).
    pub fn run_pod_timed(&self, namespace: &str, name: &str) -> Result<(String, Duration), String> {
        let (result, wall) = self.cri_timed("RunPodSandbox", &self.pod_request(namespace, name, None, 0));
        self.sandbox_started(result).map(|id| (id, wall))
    }

    /// RunPodSandbox of every pod `namespace/name` of `names` at the same moment: each one's
    /// sandbox ID and wall time, and the wall time until the last was ready.
    pub fn run_pods_at_once(
        &self,
        namespace: &str,
        names: &[String],
    ) -> (Vec<Result<(String, Duration), String>>, Duration) {
        let calls: Vec<(&str, Value)> =
            names.iter().map(|n| ("RunPodSandbox", self.pod_request(namespace, n, None, 0))).collect();
        let (answers, wall) = self.cri_at_once(&calls);
        let each = answers.into_iter().map(|(result, t)| self.sandbox_started(result).map(|id| (id, t))).collect();
        (each, wall)
    }

    fn pod_request(&self, namespace: &str, name: &str, annotations: Option<Value>, attempt: u32) -> Value {
        let mut config = json!({
            "metadata": {"name": name, "namespace": namespace, "uid": format!("uid-{name}"), "attempt": attempt},
            "hostname": name,
            "linux": {"cgroup_parent": self.cgroup_parent},
        });
        if let Some(a) = annotations {
            config["annotations"] = a;
        }
        json!({"config": config})
    }

    /// A RunPodSandbox's answer: its sandbox, kept for the drop's clean-up.
    fn sandbox_started(&self, result: Result<Value, String>) -> Result<String, String> {
        let id = result?["pod_sandbox_id"].as_str().expect("pod_sandbox_id").to_string();
        self.sandboxes.borrow_mut().push(id.clone());
        Ok(id)
    }

    /// PodSandboxStatus, verbose: what the CRI reports, and from containerd's `info` the
    /// sandbox's netns path (its runtime spec) and pause process.
    pub fn sandbox(&self, id: &str) -> Result<Sandbox, String> {
        let r = self.cri("PodSandboxStatus", &json!({"pod_sandbox_id": id, "verbose": true}))?;
        let info: Value = r["info"]["info"].as_str().map(|s| serde_json::from_str(s).unwrap()).unwrap_or(Value::Null);
        let netns = info["runtimeSpec"]["linux"]["namespaces"]
            .as_array()
            .and_then(|ns| ns.iter().find(|n| n["type"] == "network"))
            .and_then(|n| n["path"].as_str())
            .unwrap_or_else(|| panic!("no network namespace in the sandbox's spec: {info:#}"))
            .to_string();
        Ok(Sandbox {
            ready: r["status"]["state"] == "SANDBOX_READY",
            ip: r["status"]["network"]["ip"].as_str().unwrap_or_default().to_string(),
            netns,
            pid: info["pid"].as_u64().expect("pid in the sandbox info"),
            status: r["status"].clone(),
        })
    }

    /// The CNI configuration containerd's CRI plugin has loaded (verbose Status,
    /// `cniconfig`): it reloads on changes in the conf dir, a moment after they happen.
    pub fn cni_config(&self) -> String {
        let r = self.cri("Status", &json!({"verbose": true})).unwrap_or_else(|e| panic!("Status: {e}"));
        r["info"]["cniconfig"].as_str().unwrap_or_default().to_string()
    }

    /// Waits (up to 20 s) until the loaded CNI configuration satisfies `cond`.
    pub fn wait_cni_config(&self, what: &str, cond: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let config = self.cni_config();
            if cond(&config) {
                return;
            }
            assert!(Instant::now() < deadline, "containerd never loaded {what}; it has:\n{config}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn stop_pod(&self, id: &str) {
        self.cri("StopPodSandbox", &json!({"pod_sandbox_id": id})).unwrap_or_else(|e| panic!("StopPodSandbox: {e}"));
    }

    pub fn remove_pod(&self, id: &str) {
        self.cri("RemovePodSandbox", &json!({"pod_sandbox_id": id}))
            .unwrap_or_else(|e| panic!("RemovePodSandbox: {e}"));
        self.sandboxes.borrow_mut().retain(|s| s != id);
    }

    /// StopPodSandbox of every sandbox of `ids` at once, then RemovePodSandbox of each at once.
    pub fn remove_pods_at_once(&self, ids: &[String]) {
        for call in ["StopPodSandbox", "RemovePodSandbox"] {
            let calls: Vec<(&str, Value)> = ids.iter().map(|id| (call, json!({"pod_sandbox_id": id}))).collect();
            for (id, (result, _)) in ids.iter().zip(self.cri_at_once(&calls).0) {
                result.unwrap_or_else(|e| panic!("{call} {id}: {e}"));
            }
        }
        self.sandboxes.borrow_mut().retain(|s| !ids.contains(s));
    }

    pub fn traces(&self) -> Traces {
        let sorted = |mut v: Vec<String>| {
            v.sort();
            v
        };
        Traces {
            netns_mounts: self.netns_mounts(),
            records: sorted(records(&self.state_dir)),
            leases: sorted(self.ipam_leases()),
            libcni_cache: sorted(self.libcni_cache()),
            containers: sorted(self.runc_containers()),
        }
    }

    /// The pod netns mounts containerd holds (`netns_mounts_under_state_dir`).
    pub fn netns_mounts(&self) -> Vec<String> {
        let dir = self.dir.join(match self.flavor {
            Flavor::V1_6 => "state/io.containerd.grpc.v1.cri/netns",
            Flavor::V2 => "state/io.containerd.cri.v1.runtime/netns",
        });
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// The containers runc holds for this containerd.
    pub fn runc_containers(&self) -> Vec<String> {
        let out = exec(Command::new("runc").arg("--root").arg(self.dir.join("runc/k8s.io")).args(["list", "-q"]));
        out.stdout.lines().map(str::to_string).collect()
    }

    /// Addresses host-local holds in this network.
    pub fn ipam_leases(&self) -> Vec<String> {
        std::fs::read_dir(self.ipam_dir.join(&self.network))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.parse::<std::net::Ipv4Addr>().is_ok())
            .collect()
    }

    /// libcni's cache entries of this network (`/var/lib/cni/results/<network>-...`).
    pub fn libcni_cache(&self) -> Vec<String> {
        std::fs::read_dir("/var/lib/cni/results")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&format!("{}-", self.network)))
            .collect()
    }
}

/// One answer of `cri.py --serve`: the outcome and the call's wall time.
fn outcome(answer: &Value) -> (Result<Value, String>, Duration) {
    let result = match answer.get("error").and_then(Value::as_str) {
        Some(e) => Err(e.to_string()),
        None => Ok(answer["response"].clone()),
    };
    (result, seconds(answer))
}

fn seconds(answer: &Value) -> Duration {
    Duration::from_secs_f64(
        answer["seconds"].as_f64().unwrap_or_else(|| panic!("no timing in the CRI client's answer: {answer}")),
    )
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if self.child.is_some() {
            for id in self.sandboxes.borrow().clone() {
                let _ = self.cri("StopPodSandbox", &json!({"pod_sandbox_id": id}));
                let _ = self.cri("RemovePodSandbox", &json!({"pod_sandbox_id": id}));
            }
        }
        if let Some(mut cri) = self.cri.take() {
            drop(cri.child.stdin.take());
            let _ = cri.child.wait();
        }
        self.stop();
        // After a failure midway: what the CRI could not remove, removed directly.
        for id in self.runc_containers() {
            let _ = Command::new("runc")
                .arg("--root")
                .arg(self.dir.join("runc/k8s.io"))
                .args(["delete", "--force", &id])
                .status();
        }
        // Shims of this containerd (their command line names its socket), by PID.
        for pid in pids_mentioning(&self.dir.0) {
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        for id in self.sandboxes.borrow().iter() {
            drop(LibcniCache(format!("cni-loopback-{id}")));
        }
        drop(LibcniCache(self.network.clone()));
        for e in std::fs::read_dir("/sys/fs/cgroup").into_iter().flatten().flatten() {
            let _ = std::fs::remove_dir(e.path().join(self.cgroup_parent.trim_start_matches('/')));
        }
        // Then the fields: the node netns, and the temp dir (its mounts unmounted first).
    }
}
