//! Pod start through the runtime, as the kubelet asks for it: RunPodSandbox through
//! containerd 2's CRI until it answers (the sandbox ready: netns made, the CNI chain run,
//! pause started), on three private containerds side by side, each with a node netns of its
//! own (`aether_conformance::containerd`):
//!
//! - the main chain alone: `bridge` + `host-local` + `portmap`, the CNI plugins 1.9.1 at
//!   `cniVersion` 1.1.0;
//! - the same chain with `aether-cni` appended, no Services stored;
//! - the same, 10,000 Services stored (`aether-cni services apply`, the document of
//!   `cni-plugin/benches/pod_storms.rs`): every pod gets the 10,000-Service layer at ADD.
//!
//! 50 pods one after another on each node (p50, p99 of each call's wall time), then bursts of
//! 30 at once (wall until the last is ready). The configurations are interleaved: pod by pod
//! in turn, burst by burst in turn, the order rotated each time, so the machine's load falls
//! on all alike. The plugin's state directory is on tmpfs, as a node's /var/run is. Every pod
//! is stopped and removed, and every process started here ends, also on a failure
//! (`Containerd`'s drop).
//!
//! `AETHER_BENCH_BIN`: the plugin binary (the release's, as shipped); `AETHER_BENCH_ROUNDS`:
//! bursts per configuration (3). Root, and `make clients-deps`'s containerd 2.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use aether_conformance::clients::{records, repo};
use aether_conformance::cni_bin;
use aether_conformance::containerd::{Containerd, Flavor, NodeNet, CHAINED_CONFLIST};
use serde_json::{json, Value};

const SEQUENTIAL: usize = 50;
const BURST: usize = 30;
const SERVICES: u32 = 10_000;
const NAMESPACE: &str = "bench";

const NETS: [NodeNet; 3] = [
    NodeNet { bridge: "aebps0", subnet: "10.250.20.0/24", gateway: "10.250.20.1" },
    NodeNet { bridge: "aebps1", subnet: "10.250.21.0/24", gateway: "10.250.21.1" },
    NodeNet { bridge: "aebps2", subnet: "10.250.22.0/24", gateway: "10.250.22.1" },
];

fn rounds() -> usize {
    std::env::var("AETHER_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(3)
}

/// The plugin as `make bench` ships it; without `AETHER_BENCH_BIN`, the workspace's
/// (`AETHER_CNI_BIN`, or a debug build: figures of no use beside a release's).
fn bin() -> PathBuf {
    std::env::var_os("AETHER_BENCH_BIN").map(PathBuf::from).unwrap_or_else(|| {
        eprintln!("AETHER_BENCH_BIN unset: the workspace's plugin, which may be a debug build");
        cni_bin().to_path_buf()
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The `q`-quantile of `v` (nearest rank): of 50, p50 is the 25th, p99 the 50th (the slowest).
fn quantile(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// `n` Services of two TCP ports each, one in ten without endpoints (as `pod_storms`).
fn snapshot(n: u32) -> Vec<u8> {
    let services: Vec<Value> = (0..n)
        .map(|i| {
            let vip = std::net::Ipv4Addr::from(0x0a60_0000 + 2 + i);
            let ports: Vec<Value> =
                [80, 8080 + (i % 7) as u16].iter().map(|p| json!({"protocol": "TCP", "port": p})).collect();
            json!({"namespace": format!("ns-{}", i % 50), "name": format!("svc-{i}"), "vip": vip.to_string(),
                   "ports": ports, "usableEndpoints": i % 10 != 0})
        })
        .collect();
    serde_json::to_vec(&json!({"generation": 1, "mode": "refuse", "serviceRanges": ["10.96.0.0/15"],
        "meshVIPs": [], "services": services}))
    .unwrap()
}

/// `aether-cni services apply` of `doc` into `state`.
fn services_apply(bin: &Path, state: &Path, doc: &[u8]) {
    let mut child = Command::new(bin)
        .args(["services", "apply", "--state-dir"])
        .arg(state)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(doc).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "services apply: {}", String::from_utf8_lossy(&out.stderr));
}

/// A state directory on tmpfs, removed when dropped (also on a panic).
struct TmpfsDir(PathBuf);

impl TmpfsDir {
    fn new(tag: &str) -> Self {
        let d = PathBuf::from(format!("/dev/shm/aether-bench-pod-start-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TmpfsDir(d)
    }
}

impl Drop for TmpfsDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One node: its containerd and what was measured on it.
struct Node {
    name: &'static str,
    // Dropped before the state dir: the pods' DELs still find their records.
    ctrd: Containerd,
    _state: Option<TmpfsDir>,
    sequential: Vec<f64>,
    bursts: Vec<f64>,
    burst_each: Vec<f64>,
}

impl Node {
    /// A containerd 2 node; with `services` (`Some`), its conflist chains aether-cni, its
    /// state directory on tmpfs holding that many Services.
    fn new(name: &'static str, tag: &str, net: &NodeNet, services: Option<u32>, bin: &Path) -> Node {
        let mut ctrd = Containerd::new_on(Flavor::V2, tag, net, services.is_some());
        let state = services.map(|n| {
            std::os::unix::fs::symlink(bin, ctrd.bin_dir.join("aether-cni")).unwrap();
            let tmpfs = TmpfsDir::new(tag);
            let conflist = ctrd.net_dir.join(CHAINED_CONFLIST);
            let text = std::fs::read_to_string(&conflist).unwrap();
            let moved = text.replace(&ctrd.state_dir.display().to_string(), &tmpfs.0.display().to_string());
            assert_ne!(text, moved, "the conflist names no stateDir");
            std::fs::write(&conflist, moved).unwrap();
            ctrd.state_dir = tmpfs.0.clone();
            if n > 0 {
                services_apply(bin, &tmpfs.0, &snapshot(n));
            }
            tmpfs
        });
        ctrd.start();
        ctrd.import_sandbox_image();
        let node =
            Node { name, ctrd, _state: state, sequential: Vec::new(), bursts: Vec::new(), burst_each: Vec::new() };
        // A first pod, not counted: what the first sandbox alone pays (the shim's binary and
        // the image's snapshot read from disk, the bridge made).
        let (id, _) = node.run("warm-up");
        node.ctrd.remove_pods_at_once(&[id]);
        node
    }

    fn run(&self, pod: &str) -> (String, Duration) {
        self.ctrd.run_pod_timed(NAMESPACE, pod).unwrap_or_else(|e| self.failed(pod, &e))
    }

    fn failed(&self, what: &str, e: &str) -> ! {
        let log = std::fs::read_to_string(&self.ctrd.log_file).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        panic!(
            "{}: {what}: {e}\n--- containerd\n{}\n--- aether-cni log\n{}",
            self.name,
            self.ctrd.containerd_log(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }

    /// Ready with an address of its node's subnet, and (with aether-cni) a record each.
    fn check(&self, ids: &[String], chained: bool) {
        for id in ids {
            let sb = self.ctrd.sandbox(id).unwrap_or_else(|e| self.failed(id, &e));
            assert!(sb.ready && !sb.ip.is_empty(), "{}: sandbox {id} not ready with an address: {sb:#?}", self.name);
        }
        if chained {
            let recs = records(&self.ctrd.state_dir);
            assert_eq!(recs.len(), ids.len(), "{}: aether-cni's records {recs:?} for {} pods", self.name, ids.len());
        }
    }
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn main() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("the pod start bench needs root (its containerds run pods in network namespaces)");
        std::process::exit(1);
    }
    let missing: Vec<PathBuf> = Flavor::V2.requirements().into_iter().filter(|p| !p.exists()).collect();
    if !missing.is_empty() {
        eprintln!("the pod start bench needs `make clients-deps` (as root): {missing:?} missing");
        std::process::exit(1);
    }
    let bin = bin();
    let rounds = rounds();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!("pod start through containerd 2's CRI: RunPodSandbox until it answers (the sandbox ready)");
    println!(
        "  bridge + host-local + portmap (CNI plugins 1.9.1, cniVersion 1.1.0), alone and with aether-cni chained;"
    );
    println!("  {SEQUENTIAL} pods one after another per node, then {rounds} bursts of {BURST} at once per node,");
    println!("  the nodes interleaved pod by pod and burst by burst; kernel {}", kernel.trim());
    // The plugin's path inside the workspace (an absolute path names the machine, not the build).
    let workspace = repo().canonicalize().unwrap();
    let shown = bin.canonicalize().unwrap();
    let shown = shown.strip_prefix(&workspace).unwrap_or(&shown);
    println!("  plugin {}; load average at start {}\n", shown.display(), load());

    let mut nodes = vec![
        Node::new("main chain alone", "bps0", &NETS[0], None, &bin),
        Node::new("+ aether-cni, no Services stored", "bps1", &NETS[1], Some(0), &bin),
        Node::new("+ aether-cni, 10,000 Services stored", "bps2", &NETS[2], Some(SERVICES), &bin),
    ];
    let n = nodes.len();

    let mut ids: Vec<Vec<String>> = vec![Vec::new(); n];
    for i in 0..SEQUENTIAL {
        for k in 0..n {
            let j = (i + k) % n;
            let (id, wall) = nodes[j].run(&format!("seq-{i}"));
            nodes[j].sequential.push(ms(wall));
            ids[j].push(id);
        }
    }
    for (j, node) in nodes.iter().enumerate() {
        node.check(&ids[j], j > 0);
        node.ctrd.remove_pods_at_once(&ids[j]);
    }
    println!("  (after {} pods one after another: load average {})", SEQUENTIAL * n, load());

    for r in 0..rounds {
        for k in 0..n {
            let j = (r + k) % n;
            let names: Vec<String> = (0..BURST).map(|p| format!("burst-{r}-{p}")).collect();
            let (each, wall) = nodes[j].ctrd.run_pods_at_once(NAMESPACE, &names);
            let mut started = Vec::new();
            let mut failure = None;
            for (name, one) in names.iter().zip(each) {
                match one {
                    Ok((id, t)) => {
                        nodes[j].burst_each.push(ms(t));
                        started.push(id);
                    }
                    Err(e) => failure = Some((name.clone(), e)),
                }
            }
            if let Some((name, e)) = failure {
                nodes[j].failed(&name, &e);
            }
            nodes[j].bursts.push(ms(wall));
            nodes[j].check(&started, j > 0);
            nodes[j].ctrd.remove_pods_at_once(&started);
        }
    }
    println!("  (after the bursts: load average {})\n", load());

    let base_p50 = quantile(&nodes[0].sequential, 0.5);
    let base_p99 = quantile(&nodes[0].sequential, 0.99);
    println!("{SEQUENTIAL} pods one after another (each RunPodSandbox):  p50        p99     / main chain alone");
    for (j, node) in nodes.iter().enumerate() {
        let (p50, p99) = (quantile(&node.sequential, 0.5), quantile(&node.sequential, 0.99));
        let goal = match j {
            1 => "  (goal p50 <= 1.03x)",
            2 => "  (goal p50 <= 1.05x, p99 <= 1.10x)",
            _ => "",
        };
        println!(
            "  {:<38} {p50:>7.1} ms {p99:>7.1} ms   {:.3}x / {:.3}x{goal}",
            node.name,
            p50 / base_p50,
            p99 / base_p99
        );
    }
    let base_burst = quantile(&nodes[0].bursts, 0.5);
    println!("\n{BURST} pods at once (wall until the last is ready, median of {rounds}; each call's p50):");
    for (j, node) in nodes.iter().enumerate() {
        let wall = quantile(&node.bursts, 0.5);
        let all: Vec<String> = node.bursts.iter().map(|b| format!("{b:.0}")).collect();
        let goal = if j == 2 { "  (goal <= 1.20x)" } else { "" };
        println!(
            "  {:<38} {wall:>7.0} ms  / main chain alone {:.3}x  (rounds: {} ms; one call's p50 {:.0} ms){goal}",
            node.name,
            wall / base_burst,
            all.join(", "),
            quantile(&node.burst_each, 0.5)
        );
    }
    // The nodes' drops: pods stopped and removed (none are left by now), containerd and its
    // shims ended by PID, the node netns and the temp dirs removed.
    drop(nodes);
}
