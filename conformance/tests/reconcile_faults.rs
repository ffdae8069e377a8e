//! The installer's reconciler against a runtime that lies, stalls or forgets: the built
//! binary (`aether-cni-installer`) run in the simulated node's netns, its `--cri-socket` a fake
//! runtime (`aether_cri::fake`, tonic's server side of the same proto) that answers what each
//! test scripts, its state directory holding the records of real pods captured by a real ADD.
//! Whatever the runtime says, a live pod keeps its capture, a pass stays bounded and the
//! installer stops when told.
//!
//! Root tests: they skip loudly without root, and fail under AETHER_REQUIRE_ROOT_TESTS=1 (CI).

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use aether_conformance::clients::{assert_captured, capture_state, records};
use aether_conformance::{cni_bin, passes, sock, Pod, SimNode, HOST_IP};
use aether_cri::api::PodSandbox;
use aether_cri::fake::{self, FakeRuntime, Reply, Script};
use aether_testkit::{http, root_or_skip};
use serde_json::{json, Value};

/// The installer's probes and metrics, inside the node's netns.
const LISTEN: &str = "127.0.0.1:18095";

/// A scratch directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!("aether-rcfault-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        for sub in ["bin", "conf"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        let primary = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/install/primaries/10-bridge.conf");
        std::fs::copy(primary, d.join("conf/10-bridge.conf")).unwrap();
        Scratch(d)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A simulated node, its pods captured by ADD, and the fake runtime listing them.
struct Node {
    sim: SimNode,
    pods: Vec<Pod>,
    fake: FakeRuntime,
    scratch: Scratch,
}

impl Node {
    /// `names.len()` pods, each ADDed and listed ready by the fake runtime with its netns.
    fn new(tag: &str, names: &[&str]) -> Node {
        let mut sim = SimNode::new(tag);
        let scratch = Scratch::new(tag);
        let pods: Vec<Pod> = names.iter().map(|n| sim.add_pod(n)).collect();
        for p in &pods {
            p.add(json!({}));
        }
        let fake = FakeRuntime::start(&scratch.0.join("cri.sock"), Script::default()).unwrap();
        let node = Node { sim, pods, fake, scratch };
        let listed = node.listing();
        node.fake.script(|s| {
            for (sb, pod) in listed.iter().zip(&node.pods) {
                s.status
                    .insert(sb.id.clone(), Reply::Answer(fake::status(sb, Some(&pod.path()), &[&pod.ip.to_string()])));
            }
            s.list = Reply::Answer(listed.clone());
        });
        node
    }

    /// The node's pods as the runtime lists them.
    fn listing(&self) -> Vec<PodSandbox> {
        self.pods.iter().map(|p| sandbox_of(p)).collect()
    }

    fn captured(&self, pod: &Pod) {
        assert_captured(&pod.path(), &[]);
    }
}

fn sandbox_of(p: &Pod) -> PodSandbox {
    fake::sandbox(&p.container_id, "sim", &p.name, &format!("uid-{}", p.name), 1)
}

/// `aether-cni-installer` in the node's netns, run by the test.
struct Installer {
    child: Child,
    log: PathBuf,
    host: String,
    state_dir: PathBuf,
}

impl Installer {
    fn start(node: &Node, extra: &[&str]) -> Installer {
        let log = node.scratch.0.join(format!("installer-{}.log", std::process::id()));
        passes::forget(node.sim.state_dir());
        let host = node.sim.host.path();
        let ns = std::fs::File::open(&host).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&ns);
        let mut cmd = Command::new(aether_testkit::installer_bin());
        cmd.arg(format!("--plugin-binary={}", cni_bin().display()))
            .arg(format!("--cni-bin-dir={}", node.scratch.0.join("bin").display()))
            .arg(format!("--cni-conf-dir={}", node.scratch.0.join("conf").display()))
            .arg(format!("--state-dir={}", node.sim.state_dir().display()))
            .arg(format!("--listen={LISTEN}"))
            .arg(format!("--host-ip={HOST_IP}"))
            .arg(format!("--cri-socket={}", node.fake.socket().display()))
            .arg("--services-socket=")
            .arg("--reconcile-period-seconds=1")
            .args(extra)
            .env(passes::JOURNAL_ENV.0, passes::JOURNAL_ENV.1)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        // SAFETY: setns is async-signal-safe; the fd stays open in the parent until spawn returns.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("spawn aether-cni-installer");
        drop(ns);
        let inst = Installer { child, log, host, state_dir: node.sim.state_dir().to_path_buf() };
        let deadline = Instant::now() + Duration::from_secs(20);
        while inst.get("/healthz").is_none() {
            assert!(Instant::now() < deadline, "the installer never served /healthz:\n{}", inst.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        inst
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// GET `path` inside the node's netns: (status code, body).
    fn get(&self, path: &str) -> Option<(u16, String)> {
        let stream = sock::in_netns(&self.host, || {
            std::net::TcpStream::connect_timeout(&LISTEN.parse().unwrap(), Duration::from_secs(2)).ok()
        });
        let s = stream?;
        s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        http::exchange(s, "GET", path, None).ok()
    }

    fn metric(&self, series: &str) -> f64 {
        let (_, body) = self.get("/metrics").expect("/metrics");
        http::metric(&body, series).unwrap_or_else(|| panic!("no {series} in /metrics:\n{body}"))
    }

    fn last_pass(&self) -> Option<Value> {
        passes::last_pass(&self.state_dir)
    }

    fn mark(&self) -> u64 {
        passes::mark(&self.state_dir)
    }

    fn wait_pass(&mut self, from: u64, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
        let log = self.log.clone();
        let read_log = move || std::fs::read_to_string(&log).unwrap_or_default();
        passes::wait_pass(&self.state_dir, &mut self.child, read_log, from, what, cond)
    }

    /// SIGTERM, then waits up to `patience` (SIGKILL after): the exit and how long it took.
    fn terminate(&mut self, patience: Duration) -> (ExitStatus, Duration, bool) {
        let started = Instant::now();
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return (status, started.elapsed(), false);
            }
            if started.elapsed() > patience {
                let _ = self.child.kill();
                return (self.child.wait().unwrap(), started.elapsed(), true);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Installer {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            self.terminate(Duration::from_secs(10));
        }
    }
}

fn state_of(pass: &Value, pod: &str) -> String {
    pass["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["pod"] == pod)
        .map(|p| p["state"].as_str().unwrap().to_string())
        .unwrap_or_default()
}

fn refusals(pass: &Value, kind: &str) -> Vec<Value> {
    pass["refusals"].as_array().into_iter().flatten().filter(|r| r["kind"] == kind).cloned().collect()
}

/// A runtime whose list is empty (a restart, lost state), or another runtime's (a
/// misdirected socket), or lacks most of the node's live pods, for longer than the leftover
/// grace: no live pod loses its capture, nothing is restarted, the refusal is logged once and
/// counted once. A pod whose netns really went is still collected, by that evidence. Negative
/// control: on the code before this rule, the empty list collected both live pods.
#[test]
fn a_list_that_forgets_the_node_s_pods_uncaptures_nothing() {
    if !root_or_skip("a_list_that_forgets_the_node_s_pods_uncaptures_nothing") {
        return;
    }
    let mut node = Node::new("rcforget", &["shop-a", "shop-b", "shop-c"]);
    let mut inst = Installer::start(&node, &["--leftover-grace-seconds=0", "--missed-pods=restart"]);
    inst.wait_pass(1, "the three pods captured", |p| {
        ["sim/shop-a", "sim/shop-b", "sim/shop-c"].iter().all(|pod| state_of(p, pod) == "captured")
    });

    // The runtime forgets everything.
    node.fake.script(|s| s.list = Reply::Answer(vec![]));
    let from = inst.mark() + 3;
    let pass = inst.wait_pass(from, "three passes of an empty list", |_| true);
    for pod in &node.pods {
        node.captured(pod);
    }
    assert_eq!(records(&inst.state_dir).len(), 3, "{pass:#}");
    assert_eq!(refusals(&pass, "suspect-list").len(), 1, "{pass:#}");
    // Meanwhile one pod really goes: its netns is deleted, its DEL never came.
    let gone = node.pods.pop().unwrap();
    drop(gone);
    let from = inst.mark() + 1;
    let pass = inst.wait_pass(from + 2, "the gone pod collected, three passes on", |p| {
        p["pass"].as_u64().unwrap() >= from + 2 && state_of(p, "sim/shop-c").is_empty()
    });
    for pod in &node.pods {
        node.captured(pod);
    }
    assert_eq!(records(&inst.state_dir).len(), 2, "{pass:#}");
    assert_eq!(state_of(&pass, "sim/shop-a"), "captured", "{pass:#}");

    // Another runtime's socket: its own sandboxes, none of the node's (one looks missed).
    let foreign = fake::sandbox("foreign-1", "ci", "runner", "uid-runner", 1);
    let foreign_ns = aether_testkit::TestNetns::new("rcforeign");
    let foreign_status = fake::status(&foreign, Some(&foreign_ns.path()), &["10.244.9.9"]);
    node.fake.script(|s| {
        s.status.insert(foreign.id.clone(), Reply::Answer(foreign_status));
        s.list = Reply::Answer(vec![foreign.clone()]);
    });
    let from = inst.mark() + 3;
    let pass =
        inst.wait_pass(from, "three passes of another runtime's list", |p| refusals(p, "suspect-list").len() == 1);
    for pod in &node.pods {
        node.captured(pod);
    }
    assert_eq!(records(&inst.state_dir).len(), 2, "{pass:#}");
    assert_eq!(node.fake.count("stop"), 0, "nothing restarted from another runtime's list");
    let log = inst.log();
    assert_eq!(log.matches("refused: the runtime's pod list").count(), 1, "logged once:\n{log}");
    assert_eq!(inst.metric(r#"aether_cni_reconciler_refusals_total{kind="suspect-list"}"#), 1.0);
    assert_eq!(inst.metric("aether_cni_reconciler_runtime_list_suspect"), 1.0);
    let shown = Command::new(cni_bin()).arg("inspect").arg("--state-dir").arg(&inst.state_dir).output().unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(shown.contains("refused (suspect-list)"), "aether-cni inspect:\n{shown}");

    // The runtime back with the node's pods: believed again, nothing left to collect.
    let listed = node.listing();
    node.fake.script(|s| s.list = Reply::Answer(listed));
    let from = inst.mark() + 1;
    inst.wait_pass(from, "the list believed again", |p| refusals(p, "suspect-list").is_empty());
    assert_eq!(inst.metric("aether_cni_reconciler_runtime_list_suspect"), 0.0);
    assert_eq!(inst.metric(r#"aether_cni_reconciler_actions_total{kind="collect",outcome="done"}"#), 1.0);
    for pod in &node.pods {
        node.captured(pod);
    }
    let (status, _, killed) = inst.terminate(Duration::from_secs(10));
    assert!(status.success() && !killed, "{status}\n{}", inst.log());
}

/// A runtime that names a FIFO as a missed pod's netns: the in-place capture is refused (not a
/// network namespace) without blocking, the passes go on, and the installer stops when told.
/// Negative control: opening the path blocked for good, the passes stopped and SIGTERM never
/// completed.
#[test]
fn a_fifo_named_as_a_netns_wedges_nothing() {
    if !root_or_skip("a_fifo_named_as_a_netns_wedges_nothing") {
        return;
    }
    let node = Node::new("rcfifo", &["shop-a"]);
    let fifo = node.scratch.0.join("not-a-netns");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let liar = fake::sandbox("liar-1", "sim", "liar", "uid-liar", 2);
    let status = fake::status(&liar, Some(&fifo.display().to_string()), &["10.244.9.9"]);
    let mut listed = node.listing();
    listed.push(liar.clone());
    node.fake.script(|s| {
        s.status.insert(liar.id.clone(), Reply::Answer(status));
        s.list = Reply::Answer(listed);
    });
    let mut inst = Installer::start(&node, &["--missed-pods=capture"]);
    let pass = inst.wait_pass(1, "the capture into the FIFO refused", |p| {
        p["actions"].as_array().into_iter().flatten().any(|a| a["pod"] == "sim/liar" && a["outcome"] == "failed")
    });
    let failed = pass["actions"].as_array().unwrap().iter().find(|a| a["pod"] == "sim/liar").unwrap();
    assert!(failed["error"].as_str().unwrap().contains("not a network namespace"), "{pass:#}");
    let from = inst.mark() + 2;
    inst.wait_pass(from, "two passes more", |_| true);
    node.captured(&node.pods[0]);
    let (status, _, killed) = inst.terminate(Duration::from_secs(10));
    assert!(status.success() && !killed, "{status}\n{}", inst.log());
}

/// A pod list over tonic's default 4 MiB (110 sandboxes with 48 KiB of annotations each, 5.2
/// MiB; the kubelet reads up to 16 MiB) is read whole: the runtime is seen and every sandbox
/// judged. With `--cri-max-message-mib=4` (the control: the limit the client had) the same
/// list is unreadable, named, and `aether_cni_reconciler_runtime_up` is 0.
#[test]
fn a_pod_list_over_4_mib_is_seen() {
    if !root_or_skip("a_pod_list_over_4_mib_is_seen") {
        return;
    }
    let node = Node::new("rchuge", &["shop-a"]);
    let mut listed = node.listing();
    for i in 0..110 {
        let mut s = fake::sandbox(&format!("heavy-{i}"), "kube-system", &format!("heavy-{i}"), &format!("uid-h{i}"), 3);
        s.annotations.insert("example.com/blob".into(), "x".repeat(48 << 10));
        listed.push(s);
    }
    node.fake.script(|s| s.list = Reply::Answer(listed));
    let mut inst = Installer::start(&node, &["--missed-pods=report", "--exclude-namespaces=kube-system"]);
    let pass = inst.wait_pass(1, "the list read", |p| p["pods"].as_array().is_some_and(|a| a.len() == 111));
    assert!(pass["runtimeUnseen"].is_null(), "{pass:#}");
    assert_eq!(state_of(&pass, "kube-system/heavy-7"), "excluded");
    assert_eq!(inst.metric("aether_cni_reconciler_runtime_up"), 1.0);
    drop(inst);

    let mut inst = Installer::start(&node, &["--missed-pods=report", "--cri-max-message-mib=4"]);
    let pass = inst.wait_pass(1, "the list unreadable", |p| p["runtimeUnseen"].is_string());
    assert!(pass["runtimeUnseen"].as_str().unwrap().contains("OutOfRange"), "{pass:#}");
    assert_eq!(inst.metric("aether_cni_reconciler_runtime_up"), 0.0);
}

/// The node's listing plus `n` sandboxes `hung-<i>` (would-be missed pods) whose status
/// the fake runtime never answers.
fn list_hung_sandboxes(node: &Node, n: usize) {
    let mut listed = node.listing();
    let hung: Vec<PodSandbox> = (0..n)
        .map(|i| fake::sandbox(&format!("hung-{i}"), "sim", &format!("hung-{i}"), &format!("uid-h{i}"), 5))
        .collect();
    listed.extend(hung.iter().cloned());
    node.fake.script(|s| {
        for h in &hung {
            s.status.insert(h.id.clone(), Reply::Hang);
        }
        s.list = Reply::Answer(listed);
    });
}

/// A runtime that hangs on the verbose status of twelve would-be missed pods: each is asked
/// once, its failure remembered with a backoff instead of asked again every pass, so the
/// passes stay short and a drifted pod is still repaired. Negative control: before, every pass
/// asked all twelve again, each for its whole timeout.
#[test]
fn a_runtime_hung_on_statuses_is_asked_once_per_backoff() {
    if !root_or_skip("a_runtime_hung_on_statuses_is_asked_once_per_backoff") {
        return;
    }
    let node = Node::new("rchung", &["shop-a"]);
    list_hung_sandboxes(&node, 12);
    let mut inst = Installer::start(
        &node,
        &[
            "--missed-pods=report",
            "--cri-timeout-seconds=1",
            "--cri-pass-budget-seconds=5",
            "--reconcile-backoff-seconds=120",
        ],
    );
    // Every hung sandbox asked once: one per pass here (a pass waits on the runtime no longer
    // than the 1 s period), so within the wait's 30 s.
    let asked = |i: usize| node.fake.calls().iter().filter(|c| **c == format!("status hung-{i}")).count();
    inst.wait_pass(1, "every hung sandbox asked", |_| (0..12).all(|i| asked(i) >= 1));
    // Drift in the intact pod: its capture table deleted by hand.
    node.pods[0].nft(&["delete", "table", "ip", "aether_capture"]);
    let from = inst.mark() + 1;
    let pass = inst.wait_pass(from, "the drift repaired", |p| {
        p["actions"].as_array().into_iter().flatten().any(|a| a["kind"] == "repair" && a["outcome"] == "done")
    });
    node.captured(&node.pods[0]);
    let from = inst.mark() + 3;
    inst.wait_pass(from, "three passes more", |_| true);
    for i in 0..12 {
        assert_eq!(asked(i), 1, "hung-{i} asked once within its backoff: {:?}\n{pass:#}", node.fake.calls());
    }
    let last = inst.last_pass().unwrap();
    let held = last["pods"].as_array().unwrap().iter().find(|p| p["pod"] == "sim/hung-3").unwrap();
    assert!(held["held"].as_str().unwrap().contains("asked again in"), "{last:#}");
}

/// A runtime that stalls never delays a repair that needs no answer from it: twelve would-be
/// missed sandboxes whose verbose status never answers, a 2 s call timeout, the default pass
/// budget (10 s) and a 1 s period. Drift made in the recorded pod while the first pass waits
/// on the runtime is repaired within 5 periods (the pass under way waits on it at most a period
/// or one call, 2 s here; the next pass repairs before it asks anything). Negative control: before, a pass asked the
/// runtime for up to its whole budget before acting: the repair came after 18 s.
#[test]
fn a_stalled_runtime_never_delays_a_repair_that_needs_no_answer_from_it() {
    if !root_or_skip("a_stalled_runtime_never_delays_a_repair_that_needs_no_answer_from_it") {
        return;
    }
    let node = Node::new("rcstall", &["shop-a"]);
    let intact = capture_state(&node.pods[0].path());
    list_hung_sandboxes(&node, 12);
    let mut inst = Installer::start(&node, &["--missed-pods=report", "--cri-timeout-seconds=2"]);
    // The first pass is waiting on a hung status: the drift is made now.
    let deadline = Instant::now() + Duration::from_secs(20);
    while node.fake.count("status hung-") == 0 {
        assert!(Instant::now() < deadline, "the runtime was never asked a status:\n{}", inst.log());
        std::thread::sleep(Duration::from_millis(10));
    }
    node.pods[0].nft(&["delete", "table", "ip", "aether_capture"]);
    let tampered = Instant::now();
    assert_ne!(capture_state(&node.pods[0].path()), intact, "the tamper changed nothing");
    let period = Duration::from_secs(1);
    while capture_state(&node.pods[0].path()) != intact {
        assert!(
            tampered.elapsed() < 5 * period,
            "the drift was not repaired within 5 periods of the runtime stalling; calls: {:?}\n{}",
            node.fake.calls(),
            inst.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("repaired {:?} after the tamper", tampered.elapsed());
    node.captured(&node.pods[0]);
    let pass = inst.wait_pass(1, "the repair", |p| {
        p["actions"].as_array().into_iter().flatten().any(|a| a["kind"] == "repair" && a["outcome"] == "done")
    });
    // The pass that repaired is the one after the stalled first pass, which still read the
    // runtime's list (the stalled sandboxes are in it).
    assert_eq!(pass["pass"], 2, "{pass:#}");
    assert!(pass["pods"].as_array().unwrap().iter().any(|p| p["pod"] == "sim/hung-0"), "the list was read: {pass:#}");
}

/// SIGTERM while a pass waits on a runtime that never answers (a call timeout of 60 s): the
/// call is cancelled, the installer uninstalls and exits, well inside the chart's 30 s grace
/// (the test waits 20 s before it would SIGKILL). Negative control: the stop waited for the
/// pass, and the pass for the call's timeout.
#[test]
fn sigterm_during_a_hung_runtime_call_exits_and_uninstalls() {
    if !root_or_skip("sigterm_during_a_hung_runtime_call_exits_and_uninstalls") {
        return;
    }
    let node = Node::new("rcstop", &["shop-a"]);
    let mut inst = Installer::start(&node, &["--cri-timeout-seconds=60", "--cri-pass-budget-seconds=60"]);
    inst.wait_pass(1, "a first pass", |p| state_of(p, "sim/shop-a") == "captured");
    let conflist = node.scratch.0.join("conf/00-aether-cni.conflist");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !conflist.exists() {
        assert!(Instant::now() < deadline, "the installer never chained:\n{}", inst.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    node.fake.script(|s| s.list = Reply::Hang);
    let lists = node.fake.count("list");
    let deadline = Instant::now() + Duration::from_secs(20);
    while node.fake.count("list") == lists {
        assert!(Instant::now() < deadline, "no pass asked the runtime:\n{}", inst.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    // The pass is now waiting on the hung list.
    let (status, took, killed) = inst.terminate(Duration::from_secs(20));
    assert!(!killed && status.success(), "{status} after {took:?} (killed: {killed}):\n{}", inst.log());
    eprintln!("SIGTERM to exit during a hung ListPodSandbox: {took:?}");
    assert!(!conflist.exists(), "the installer uninstalled its conflist:\n{}", inst.log());
    node.captured(&node.pods[0]);
}

/// A runtime that names a live pod's netns for another sandbox (through another path: a
/// symlink to it): the in-place capture is refused as DEL would refuse it (the netns is the
/// other record's), once, and never tried again; no second record, and the pod keeps its own
/// capture. Negative control: before, it was captured into the pod's netns and the two
/// records' rulesets were repaired against each other every pass.
#[test]
fn a_sandbox_naming_another_pod_s_netns_is_refused_once() {
    if !root_or_skip("a_sandbox_naming_another_pod_s_netns_is_refused_once") {
        return;
    }
    let node = Node::new("rcowned", &["shop-a"]);
    let alias = node.scratch.0.join("alias-of-shop-a");
    std::os::unix::fs::symlink(node.pods[0].path(), &alias).unwrap();
    let intruder = fake::sandbox("intruder-1", "sim", "intruder", "uid-intruder", 2);
    let status = fake::status(&intruder, Some(&alias.display().to_string()), &["10.244.9.9"]);
    let mut listed = node.listing();
    listed.push(intruder.clone());
    node.fake.script(|s| {
        s.status.insert(intruder.id.clone(), Reply::Answer(status));
        s.list = Reply::Answer(listed);
    });
    let mut inst = Installer::start(&node, &["--missed-pods=capture", "--reconcile-backoff-seconds=0"]);
    let pass = inst.wait_pass(1, "the capture refused", |p| {
        p["actions"].as_array().into_iter().flatten().any(|a| a["pod"] == "sim/intruder" && a["outcome"] == "refused")
    });
    assert_eq!(records(&inst.state_dir).len(), 1, "no second record: {pass:#}");
    let from = inst.mark() + 3;
    let pass = inst.wait_pass(from, "three passes more", |_| true);
    assert!(pass["actions"].as_array().unwrap().is_empty(), "not tried again: {pass:#}");
    assert_eq!(refusals(&pass, "netns-owned").len(), 1, "{pass:#}");
    assert_eq!(inst.metric(r#"aether_cni_reconciler_refusals_total{kind="netns-owned"}"#), 1.0);
    assert_eq!(inst.metric(r#"aether_cni_reconciler_actions_total{kind="capture",outcome="refused"}"#), 1.0);
    assert_eq!(inst.log().matches("refused: sim/intruder").count(), 1, "logged once:\n{}", inst.log());
    node.captured(&node.pods[0]);
    assert_eq!(records(&inst.state_dir).len(), 1);
}
