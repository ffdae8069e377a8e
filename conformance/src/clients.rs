//! Support for the tests that drive the built `aether-cni` with real clients (cnitool,
//! podman, containerd): temp dirs, templates in `conformance/clients/`, running commands, and
//! what capture leaves in a netns as the kernel reports it (through `nsenter --net`, so any
//! netns path works, the runtimes' own included).

use std::path::{Path, PathBuf};
use std::process::Command;

use aether_testkit::TestNetns;

pub const CAPTURE_TABLE: &str = "table ip aether_capture";
pub const POLICY_RULE: &str = "fwmark 0xae71 lookup 44657";
pub const ROUTE_TABLE: &str = "44657";

/// The workspace root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Where `make clients-deps` puts what it builds (cnitool, the pause image, the CRI client's
/// generated code): `<target>/clients`.
pub fn clients_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| repo().join("target")).join("clients")
}

/// A client tool installed by `make clients-deps`; `None` (with one loud line) when it is
/// missing and skipping is allowed, a failure when AETHER_REQUIRE_ROOT_TESTS=1.
pub fn client(test: &str, path: &Path) -> Option<PathBuf> {
    if path.exists() {
        return Some(path.to_path_buf());
    }
    let msg = format!("{test}: {} is missing -- run `make clients-deps` (as root)", path.display());
    if std::env::var("AETHER_REQUIRE_ROOT_TESTS").as_deref() == Ok("1") {
        panic!("{msg}; AETHER_REQUIRE_ROOT_TESTS=1 forbids skipping");
    }
    {
        // Straight to stderr: libtest captures eprintln!, and a skip must be seen.
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "SKIPPED (no real client): {msg}");
    }
    None
}

pub fn cnitool_path() -> PathBuf {
    std::env::var_os("AETHER_CNITOOL").map(PathBuf::from).unwrap_or_else(|| clients_dir().join("cnitool"))
}

/// A directory under the system temp dir, removed (after unmounting anything left mounted
/// beneath it) on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("aether-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn join(&self, p: &str) -> PathBuf {
        self.0.join(p)
    }
    pub fn mkdir(&self, p: &str) -> PathBuf {
        let d = self.join(p);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}

/// Processes whose command line names a path under `dir`: those a test started with paths
/// in its own temp dir (runtimes, shims, conmon, containers given its dirs), never another's.
pub fn pids_mentioning(dir: &Path) -> Vec<i32> {
    let needle = format!("{}/", dir.display());
    let me = std::process::id() as i32;
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| *pid != me)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| String::from_utf8_lossy(&c).contains(&needle))
        })
        .collect()
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // After a failure midway, whatever the test started with these dirs and did not stop
        // (e.g. a container podman could not remove) is ended by PID before its dirs go.
        for pid in pids_mentioning(&self.0) {
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        // Read with the installer's own parser (mount points unescaped), deepest first.
        if let Ok(mounts) = aether_netns::mountinfo::read() {
            let mut points: Vec<&std::path::Path> = mounts
                .iter()
                .map(|m| m.mount_point.as_path())
                .filter(|m| m.starts_with(&self.0) && *m != self.0)
                .collect();
            points.sort_by_key(|m| std::cmp::Reverse(m.as_os_str().len()));
            for m in points {
                let _ = Command::new("umount").arg("-l").arg(m).status();
            }
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Fills `@KEY@` placeholders of a template in conformance/clients/.
pub fn render(template: &str, vars: &[(&str, String)]) -> String {
    let path = repo().join("conformance/clients").join(template);
    let mut text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    for (k, v) in vars {
        text = text.replace(&format!("@{k}@"), v);
    }
    assert!(!text.contains('@'), "{template}: unfilled placeholder in\n{text}");
    text
}

pub struct Output {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

pub fn exec(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    Output {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

pub fn must(what: &str, out: Output) -> String {
    assert!(out.ok, "{what} failed\n--- stdout\n{}\n--- stderr\n{}", out.stdout, out.stderr);
    out.stdout
}

/// What capture touches in a netns given by path, as the kernel reports it (nsenter, not
/// `ip netns exec`, so it works on any netns path, podman's included).
pub fn capture_state(netns: &str) -> (String, String, String, String) {
    let ns = format!("--net={netns}");
    let run = |args: &[&str]| {
        must(&format!("nsenter {ns} {}", args.join(" ")), exec(Command::new("nsenter").arg(&ns).args(args)))
    };
    let route = exec(Command::new("nsenter").arg(&ns).args(["ip", "-4", "route", "show", "table", ROUTE_TABLE]));
    let route = if route.ok || route.stderr.contains("FIB table does not exist") {
        route.stdout
    } else {
        panic!("{}", route.stderr)
    };
    (run(&["nft", "list", "ruleset"]), run(&["ip", "-4", "rule"]), route, run(&["ip", "-4", "-o", "addr", "show"]))
}

pub fn assert_captured(netns: &str, expect_in_ruleset: &[&str]) -> String {
    let (ruleset, rules, route, _) = capture_state(netns);
    assert!(ruleset.contains(CAPTURE_TABLE), "no capture table in {netns}:\n{ruleset}");
    for e in expect_in_ruleset {
        assert!(ruleset.contains(e), "{e:?} missing from the ruleset in {netns}:\n{ruleset}");
    }
    assert!(rules.contains(POLICY_RULE), "no policy rule in {netns}:\n{rules}");
    assert!(route.contains("local default dev lo"), "no divert route in table {ROUTE_TABLE} of {netns}:\n{route}");
    ruleset
}

pub fn assert_clean(netns: &str) {
    let (ruleset, rules, route, addrs) = capture_state(netns);
    assert!(!ruleset.contains("aether"), "capture left in {netns}:\n{ruleset}");
    assert!(!rules.contains("0xae71"), "policy rule left in {netns}:\n{rules}");
    assert!(route.trim().is_empty(), "route left in table {ROUTE_TABLE} of {netns}:\n{route}");
    assert!(!addrs.contains("eth0"), "eth0 left in {netns}:\n{addrs}");
}

/// The kernel's handle of the capture table: a table deleted and made again gets a new one.
pub fn table_handle(netns: &str) -> String {
    let out = must(
        "nft -a list table",
        exec(Command::new("nsenter").arg(format!("--net={netns}")).args([
            "nft",
            "-a",
            "list",
            "table",
            "ip",
            "aether_capture",
        ])),
    );
    out.lines()
        .next()
        .and_then(|l| l.split("# handle ").nth(1))
        .unwrap_or_else(|| panic!("no table handle in\n{out}"))
        .trim()
        .to_string()
}

/// The attachment records the plugin keeps in its state directory (`attachments/*.json`).
pub fn records(state_dir: &Path) -> Vec<String> {
    fn walk(d: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "json") {
                out.push(p.display().to_string());
            }
        }
    }
    let mut v = Vec::new();
    walk(&state_dir.join("attachments"), &mut v);
    v
}

/// libcni's result cache (`/var/lib/cni/results/<network>-<containerID>-<ifname>`, fixed by
/// libcni) is the one file outside the temp dir: DEL removes it; this removes the entries
/// whose name starts with `<prefix>-` (a network of the test's own) if DEL never ran.
pub struct LibcniCache(pub String);

impl Drop for LibcniCache {
    fn drop(&mut self) {
        for e in std::fs::read_dir("/var/lib/cni/results").into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with(&format!("{}-", self.0)) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// A second handle on a netns a runtime made (`ip netns attach` to a process in it), so the
/// namespace can still be inspected after the runtime has released it; deleted on drop.
pub struct KeptNetns(String);

impl KeptNetns {
    pub fn attach(tag: &str, pid: u64) -> Self {
        let name = format!("aeth-{tag}-{}", std::process::id());
        aether_testkit::run("ip", &["netns", "attach", &name, &pid.to_string()]);
        KeptNetns(name)
    }

    pub fn path(&self) -> String {
        format!("/run/netns/{}", self.0)
    }
}

impl Drop for KeptNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// Ends a process the test started: SIGTERM to its PID, SIGKILL after `grace`.
pub fn terminate(child: &mut std::process::Child, grace: std::time::Duration) -> std::process::ExitStatus {
    if let Ok(Some(status)) = child.try_wait() {
        return status;
    }
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let deadline = std::time::Instant::now() + grace;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            return child.wait().unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// podman with every path under the temp dir (root, run root, tmp dir, `containers.conf` from
/// `containers.conf.in`: CNI backend, runc, cgroupfs, file locks), run in the node netns by
/// `nsenter --net` (`ip netns exec` remounts /sys and breaks the runtime's cgroup mounts).
/// Removes its containers on drop, even when an assertion failed midway.
pub struct Podman<'a> {
    node: &'a TestNetns,
    dir: &'a TempDir,
    net_dir: PathBuf,
}

impl<'a> Podman<'a> {
    /// `bin_dir` and `net_dir`: the CNI plugins and configuration podman's networks use.
    pub fn new(node: &'a TestNetns, dir: &'a TempDir, bin_dir: &Path, net_dir: &Path) -> Self {
        for d in ["root", "runroot", "tmp"] {
            dir.mkdir(d);
        }
        let conf = render(
            "containers.conf.in",
            &[
                ("BIN_DIR", bin_dir.display().to_string()),
                ("NET_DIR", net_dir.display().to_string()),
                ("TMP_DIR", dir.join("tmp").display().to_string()),
            ],
        );
        std::fs::write(dir.join("containers.conf"), conf).unwrap();
        Podman { node, dir, net_dir: net_dir.to_path_buf() }
    }

    /// The flags that keep podman's storage and state under the temp dir (as
    /// `installer/image/build.sh` takes them in `PODMAN_FLAGS`). `--tmpdir` too: podman's
    /// default, `/run/libpod`, is shared with every other podman on the machine.
    pub fn storage_flags(&self) -> Vec<String> {
        let d = |p: &str| self.dir.join(p).display().to_string();
        [("--root", d("root")), ("--runroot", d("runroot")), ("--tmpdir", d("tmp")), ("--storage-driver", "vfs".into())]
            .into_iter()
            .flat_map(|(flag, value)| [flag.to_string(), value])
            .collect()
    }

    pub fn run(&self, args: &[&str]) -> Output {
        exec(
            Command::new("nsenter")
                .arg(format!("--net={}", self.node.path()))
                .arg("podman")
                .args(self.storage_flags())
                .arg("--network-config-dir")
                .arg(&self.net_dir)
                .args(["--runtime", "runc", "--cgroup-manager", "cgroupfs", "--events-backend", "none"])
                .args(args)
                .env("CONTAINERS_CONF", self.dir.join("containers.conf"))
                .env_remove("CONTAINERS_STORAGE_CONF")
                .env_remove("CONTAINERS_REGISTRIES_CONF"),
        )
    }
}

impl Drop for Podman<'_> {
    fn drop(&mut self) {
        let out = self.run(&["rm", "--force", "--all", "--time", "0"]);
        if !out.ok {
            eprintln!("podman rm --all: {}", out.stderr);
        }
    }
}
