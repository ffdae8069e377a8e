//! The Service layer's work held to the memory limit of the process that does it, in the
//! kernel: the kernel charges every nftables object to the memory cgroup of the process that
//! sends it, so the installer (and an agent's `services apply`) pays for every pod's layer it
//! programs. Each test runs the built binary inside a memory cgroup of its own (v1 or v2,
//! whichever the machine has; `aether_testkit::memcg`), the pods ADDed outside it, as on a
//! node where the runtime runs ADD.
//!
//! | claim | test | control (must fail) |
//! | --- | --- | --- |
//! | the installer, its limit too small for a snapshot to every pod, answers 507 naming the memory needed, the limit and `resources.limits.memory`, changes nothing (every pod keeps its whole layer, the stored files), stays alive and ready, the metrics say so; with a limit large enough the same document applies to every pod | `the_installer_refuses_...` | with the check skipped (a fault-injection switch) the same document at the same limit gets the installer OOM-killed |
//! | the installer's image run by podman as the chart runs it (`--memory` the chart's default limit, capabilities NET_ADMIN and SYS_ADMIN only, read-only root), at the node's scale (100 pods ADDed outside it, 10,000 Services sharing no port profile): the snapshot and then two change documents apply, every pod verified intact, the container never restarted nor OOM-killed; its limit then lowered, a snapshot of twice the Services is refused (507) with the container alive and ready and every pod verified whole at the generation before | `the_installer_image_under_podman_...` | the same refusal's control is the first test's (the check switched off, OOM-killed) |
//! | an apply under way that no longer fits (the estimate before it skipped by fault injection, so the checks made pod by pod stop it) leaves every pod with a whole layer, the old or the new, some of each, the others failed naming the memory; raised, the next apply brings every pod to the new one | `work_under_way_...` | the pods' listings are compared with both whole layers: a pod holding neither fails it |
//! | a one-shot `services apply` inside a small memory cgroup exits 2 with the same reason, nothing changed, not killed; raised, it applies | `a_one_shot_apply_refuses_...` | with the check skipped it is OOM-killed |
//!
//! The podman test runs at the node's scale; the others fit test time (a few thousand
//! Services to a dozen pods, limits in proportion). Root only: without
//! root each test skips with a loud line; with `AETHER_REQUIRE_ROOT_TESTS=1` a skip is a
//! failure.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use aether_conformance::clients::{exec, must, repo, Podman, TempDir};
use aether_conformance::cni::cni_bin;
use aether_conformance::layer::{apply, listing};
use aether_conformance::{Pod, SimNode};
use aether_testkit::memcg::ScratchMemcg;
use aether_testkit::{http, root_or_skip};
use serde_json::{json, Value};

const MIB: u64 = 1 << 20;
/// Pods ADDed (outside the cgroup) before the documents.
const PODS: usize = 12;
/// Services of the big snapshot, two TCP ports each: about 1.1 MiB of kernel memory per pod
/// on the kernels we test (three elements a Service), 13 MiB for the twelve.
const BIG: usize = 5000;
/// Above the process's working set at rest: less than the big snapshot's charge, so that
/// without the check it would be killed; more than the memory to parse it (about 4 MiB by the
/// installer's estimate, 6 times its 0.8 MiB at most), so that the refusal is the kernel
/// memory's.
const TIGHT: u64 = 10 * MIB;
/// Above the process's usage at rest: the big snapshot's charge and the headroom fit.
const ROOMY: u64 = 64 * MIB;

/// The tests here set memory limits from what a process holds at a moment and wait on its log:
/// each runs alone, so one test's load (the podman test's 100 pods) never moves another's
/// usage, limits or deadlines.
static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn alone() -> std::sync::MutexGuard<'static, ()> {
    ALONE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A snapshot of `n` Services in 10.96.0.0/16, two TCP ports each, all with endpoints. Each
/// Service's ports are its own (no two share a port profile), so each costs a pod the layer's
/// most: its VIP and both ports as elements, whatever the layer makes of shared profiles.
fn snapshot(generation: u64, n: usize) -> Vec<u8> {
    snapshot_in(generation, n, "refuse")
}

/// `snapshot` in `mode` (up to 62,500 Services; ports repeat from 30,000 on).
fn snapshot_in(generation: u64, n: usize, mode: &str) -> Vec<u8> {
    let services: Vec<Value> = (0..n)
        .map(|i| {
            json!({"namespace": "shop", "name": format!("s{i}"), "vip": format!("10.96.{}.{}", i / 250, 1 + i % 250),
                   "ports": [{"protocol": "TCP", "port": 1024 + i % 30_000}, {"protocol": "TCP", "port": 30000 + i % 30_000}],
                   "usableEndpoints": true})
        })
        .collect();
    json!({"generation": generation, "mode": mode, "serviceRanges": ["10.96.0.0/16"], "meshVIPs": [],
           "services": services, "dialledTimeoutSeconds": 3600})
    .to_string()
    .into_bytes()
}

/// A node with `PODS` pods ADDed, and a small snapshot applied by a one-shot `services
/// apply` outside any test cgroup: every pod holds generation 1.
fn node_with_pods(tag: &str) -> (SimNode, Vec<Pod>) {
    node_with(tag, PODS)
}

fn node_with(tag: &str, count: usize) -> (SimNode, Vec<Pod>) {
    let mut node = SimNode::new(tag);
    let pods: Vec<Pod> = (0..count)
        .map(|i| {
            let p = node.add_pod(&format!("p{i}"));
            p.add(json!({}));
            p
        })
        .collect();
    apply(&node, &snapshot(1, 20));
    (node, pods)
}

/// Every pod's layer as the kernel lists it is `expected` (whole: the old one or the new
/// one, never a part).
fn every_pod_holds(pods: &[Pod], expected: &str, what: &str) {
    for p in pods {
        let l = listing(p);
        assert!(l == expected, "{} does not hold {what}:\n{}", p.name, l.chars().take(2000).collect::<String>());
    }
}

/// The stored snapshot as it stands (`services snapshot`: the installer's journal of changes
/// folded in).
fn stored(node: &SimNode) -> Vec<u8> {
    let out = node.services(&["snapshot"], b"");
    assert!(out.ok, "services snapshot failed:\n{}\n{}", out.stdout, out.stderr);
    out.stdout.into_bytes()
}

/// `aether-cni-installer` on the node's state directory inside `cg`, the reconciler off.
struct Installer {
    child: Child,
    dir: PathBuf,
    log: PathBuf,
    socket: PathBuf,
}

impl Installer {
    fn start(node: &SimNode, cg: &ScratchMemcg, tag: &str, env: &[(&str, &str)]) -> Installer {
        let dir = std::env::temp_dir().join(format!("aether-budget-{tag}-{}", std::process::id()));
        for d in ["bin", "conf"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        // A main CNI to chain onto: the installer is then ready.
        let primary = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/install/primaries/10-flannel.conflist");
        std::fs::copy(primary, dir.join("conf/10-flannel.conflist")).unwrap();
        let log = dir.join("installer.log");
        let mut cmd = Command::new(aether_testkit::installer_bin());
        cmd.arg(format!("--plugin-binary={}", cni_bin().display()))
            .arg(format!("--cni-bin-dir={}", dir.join("bin").display()))
            .arg(format!("--cni-conf-dir={}", dir.join("conf").display()))
            .arg(format!("--state-dir={}", node.state_dir().display()))
            .args(["--listen=127.0.0.1:0", "--host-ip=10.244.0.1", "--reconcile=false"])
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        cg.enter_on_spawn(&mut cmd);
        let child = cmd.spawn().expect("spawn aether-cni-installer");
        let inst = Installer { child, dir, log, socket: node.state_dir().join("agent/services.sock") };
        let deadline = Instant::now() + Duration::from_secs(30);
        while UnixStream::connect(&inst.socket).is_err() || !inst.log().contains("serving /healthz") {
            assert!(Instant::now() < deadline, "the installer never served its socket:\n{}", inst.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        while inst.get("/readyz").0 != 200 {
            assert!(Instant::now() < deadline, "the installer never got ready:\n{}", inst.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        inst
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// GET on the probes' listener: (status, body).
    fn get(&self, path: &str) -> (u16, String) {
        let log = self.log();
        let line = log.lines().find(|l| l.contains("serving /healthz")).expect("the serving line");
        http::get(line.rsplit(' ').next().unwrap(), path).expect("the probes answer")
    }

    fn metric(&self, series: &str) -> f64 {
        let (_, text) = self.get("/metrics");
        http::metric(&text, series).unwrap_or_else(|| panic!("no {series} in /metrics:\n{text}"))
    }

    /// The document POSTed to the socket: (status, body), or `None` when the connection
    /// closed with no answer (the installer died).
    fn post(&self, doc: &[u8]) -> Option<(u16, String)> {
        let s = UnixStream::connect(&self.socket).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        http::exchange(s, "POST", "/services/apply", Some(doc)).ok().filter(|(code, _)| *code != 0)
    }

    /// `doc` POSTed without its length (chunked, 64 KiB a chunk): the status and body.
    fn post_chunked(&self, doc: &[u8]) -> Option<(u16, String)> {
        use std::io::Read;
        let mut s = UnixStream::connect(&self.socket).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let head = "POST /services/apply HTTP/1.1\r\nHost: aether-cni\r\nContent-Type: application/json\r\n\
                    Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
        s.write_all(head.as_bytes()).ok()?;
        for chunk in doc.chunks(64 << 10) {
            s.write_all(format!("{:x}\r\n", chunk.len()).as_bytes()).ok()?;
            s.write_all(chunk).ok()?;
            s.write_all(b"\r\n").ok()?;
        }
        s.write_all(b"0\r\n\r\n").ok()?;
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).ok()?;
        let answer = String::from_utf8_lossy(&answer).into_owned();
        let (head, body) = answer.split_once("\r\n\r\n")?;
        Some((head.split(' ').nth(1)?.parse().ok()?, body.to_string()))
    }

    /// Its exit status, waited for up to 20 s.
    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < deadline, "the installer did not exit:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Installer {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The refusal's reason names the memory needed, the limit and what to raise.
fn names_the_budget(text: &str) {
    for needle in ["would charge about", "MiB limit", "resources.limits.memory", "nothing was changed"] {
        assert!(text.contains(needle), "the reason lacks {needle:?}:\n{text}");
    }
}

#[test]
fn the_installer_refuses_a_snapshot_over_its_memory_limit_and_applies_it_when_raised() {
    if !root_or_skip("the_installer_refuses_a_snapshot_over_its_memory_limit_and_applies_it_when_raised") {
        return;
    }
    let _alone = alone();
    let (node, pods) = node_with_pods("bdgi");
    let old = listing(&pods[0]);
    every_pod_holds(&pods, &old, "generation 1");
    let before = stored(&node);
    // Started with room (it measures an element's cost then), the limit lowered once it rests.
    let cg = ScratchMemcg::new("installer", 512 * MIB);
    let mut inst = Installer::start(&node, &cg, "refuse", &[]);
    cg.settled_usage();
    // Above the working set, as the installer counts what it holds (active file pages too:
    // above the page cache alone, the room left could be less than parsing the document
    // takes, and the refusal would be the parse's, not the kernel memory's).
    let rest = cg.working_set();
    cg.set_limit(rest + TIGHT);
    let big = snapshot(2, BIG);
    // The cost of an element, measured on this kernel at the start: a key and its hash
    // node, well under the fallback.
    let measured: u64 = inst
        .log()
        .lines()
        .find_map(|l| l.contains("measured on this kernel").then(|| l.rsplit("bytes=").next()?.trim().parse().ok())?)
        .unwrap_or_else(|| panic!("no measure in the log:\n{}", inst.log()));
    assert!((32..256).contains(&measured), "{measured} bytes an element");
    let (status, body) = inst.post(&big).expect("an answer");
    assert_eq!(status, 507, "{body}\n{}", inst.log());
    names_the_budget(&body);
    assert!(inst.alive(), "the installer died:\n{}", inst.log());
    assert_eq!(inst.get("/readyz").0, 200, "the node stays ready");
    assert_eq!(inst.metric("aether_cni_installer_services_applies_total{kind=\"whole\",outcome=\"over-budget\"}"), 1.0);
    let needed = inst.metric("aether_cni_installer_services_over_budget_needed_bytes");
    assert!(needed > TIGHT as f64, "the need named ({needed}) is more than the room left: {body}");
    assert!(body.contains("of kernel memory"), "refused for the kernel memory: {body}");
    assert_eq!(inst.metric("aether_cni_installer_services_over_budget_limit_bytes"), (rest + TIGHT) as f64);
    assert!(inst.log().contains("resources.limits.memory"), "the log line says it:\n{}", inst.log());
    every_pod_holds(&pods, &old, "generation 1 after the refusal");
    assert_eq!(stored(&node), before, "the stored snapshot is unchanged");
    assert_eq!(cg.oom_kills(), 0);

    // Raised: the same document applies to every pod, nothing killed.
    cg.set_limit(rest + ROOMY);
    let (status, body) = inst.post(&big).expect("an answer");
    assert_eq!(status, 200, "{body}\n{}", inst.log());
    let new = listing(&pods[0]);
    assert_ne!(new, old);
    every_pod_holds(&pods, &new, "generation 2");
    assert!(inst.alive());
    assert_eq!(cg.oom_kills(), 0);
    drop(inst);

    // The control: the check skipped, the same document at the same tight limit gets the
    // installer killed by the OOM killer (what the check prevents).
    let (node, _pods) = node_with_pods("bdgc");
    let cg = ScratchMemcg::new("control", 512 * MIB);
    let mut inst = Installer::start(&node, &cg, "control", &[("AETHER_CNI_INJECT_FAILURE", "memory-budget")]);
    cg.settled_usage();
    let rest = cg.working_set();
    cg.set_limit(rest + TIGHT);
    let answer = inst.post(&big);
    let status = inst.wait_exit();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "answer {answer:?}; {status}:\n{}", inst.log());
    assert!(cg.oom_kills() >= 1);
}

/// `services --state-dir DIR apply` with `doc` on stdin, inside `cg`: (exit status, stderr).
fn one_shot(node: &SimNode, cg: &ScratchMemcg, doc: &[u8], env: &[(&str, &str)]) -> (std::process::ExitStatus, String) {
    let mut cmd = Command::new(cni_bin());
    cmd.args(["services", "--state-dir", node.state_dir().to_str().unwrap(), "apply"])
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cg.enter_on_spawn(&mut cmd);
    let mut child = cmd.spawn().unwrap();
    let _ = child.stdin.take().unwrap().write_all(doc);
    let out = child.wait_with_output().unwrap();
    (out.status, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The limit for a one-shot apply: its own usage is a few MiB, and it measures an element's
/// cost (a sample of about 5 MiB) before the estimate.
const ONE_SHOT_TIGHT: u64 = 28 * MIB;
/// Services for the one-shot: about 2 MiB a pod, more than `ONE_SHOT_TIGHT` for the dozen.
const ONE_SHOT_BIG: usize = 9000;

#[test]
fn a_one_shot_apply_refuses_a_snapshot_over_its_memory_limit_and_is_never_killed() {
    if !root_or_skip("a_one_shot_apply_refuses_a_snapshot_over_its_memory_limit_and_is_never_killed") {
        return;
    }
    let _alone = alone();
    let (node, pods) = node_with_pods("bdgo");
    let old = listing(&pods[0]);
    let before = stored(&node);
    let big = snapshot(2, ONE_SHOT_BIG);
    let cg = ScratchMemcg::new("oneshot", ONE_SHOT_TIGHT);
    let (status, stderr) = one_shot(&node, &cg, &big, &[]);
    assert_eq!(status.code(), Some(2), "{status}: {stderr}");
    names_the_budget(&stderr);
    every_pod_holds(&pods, &old, "generation 1 after the refusal");
    assert_eq!(stored(&node), before, "the stored snapshot is unchanged");
    assert_eq!(cg.oom_kills(), 0);

    // The control: the check skipped, it is killed at the same limit.
    let (status, stderr) = one_shot(&node, &cg, &big, &[("AETHER_CNI_INJECT_FAILURE", "memory-budget")]);
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}: {stderr}");
    assert!(cg.oom_kills() >= 1);

    // Raised: it applies (the pods the killed run left half-way are rebuilt: it stopped
    // midway, so no pod's file is trusted).
    cg.set_limit(ONE_SHOT_TIGHT + 96 * MIB);
    let (status, stderr) = one_shot(&node, &cg, &big, &[]);
    assert!(status.success(), "{status}: {stderr}");
    let new = listing(&pods[0]);
    assert_ne!(new, old);
    every_pod_holds(&pods, &new, "generation 2");
}

/// Services of a document the one-shot cannot parse under `DOCUMENT_LIMIT`: 8.8 MiB of text,
/// 180,001 JSON objects, about 46 MiB more to parse and apply by the estimate.
const DOCUMENT_SERVICES: usize = 60_000;
/// The one-shot's limit: room to read the document (at most 16 MiB of buffer) and no more.
const DOCUMENT_LIMIT: u64 = 24 * MIB;

#[test]
fn a_document_too_large_to_parse_under_the_limit_is_not_parsed_and_never_killed() {
    if !root_or_skip("a_document_too_large_to_parse_under_the_limit_is_not_parsed_and_never_killed") {
        return;
    }
    let _alone = alone();
    let (node, pods) = node_with_pods("bdgd");
    let old = listing(&pods[0]);
    let before = stored(&node);
    // Mode off: no kernel work asked (every pod's layer would go), so what is refused, or
    // what kills, is the document's own memory.
    let doc = snapshot_in(2, DOCUMENT_SERVICES, "off");
    let cg = ScratchMemcg::new("document", DOCUMENT_LIMIT);
    let named = format!("not parsed: a document of {:.1} MiB", doc.len() as f64 / MIB as f64);
    refused_and_killed_without_the_check(&node, &cg, &doc, &named);
    assert_eq!(stored(&node), before, "the stored snapshot is unchanged");
    every_pod_holds(&pods, &old, "generation 1 after the refusal and the kill");
}

/// A one-shot apply of `doc` inside `cg`, as its own memory would get it killed: refused
/// (exit code 2, the reason naming the budget and `why`), nothing stored, nothing killed;
/// then the control, the checks skipped: SIGKILLed at the same limit, nothing stored.
fn refused_and_killed_without_the_check(node: &SimNode, cg: &ScratchMemcg, doc: &[u8], why: &str) {
    let before = stored(node);
    let (status, stderr) = one_shot(node, cg, doc, &[]);
    assert_eq!(status.code(), Some(2), "{status}: {stderr}");
    names_the_budget(&stderr);
    assert!(stderr.contains(why), "{why:?} in {stderr}");
    assert!(stderr.contains("of this process's own memory"), "{stderr}");
    assert_eq!(stored(node), before, "the stored snapshot is unchanged");
    assert_eq!(cg.oom_kills(), 0);

    let (status, stderr) = one_shot(node, cg, doc, &[("AETHER_CNI_INJECT_FAILURE", "memory-budget")]);
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}: {stderr}");
    assert!(cg.oom_kills() >= 1);
    assert_eq!(stored(node), before, "the stored snapshot is unchanged");
}

/// A one-shot's limit under which a change cannot read a stored `DOCUMENT_SERVICES` snapshot
/// (8.8 MiB; about 44 MiB to read and change by the estimate, more than 16 in fact).
const STORED_LIMIT: u64 = 16 * MIB;

#[test]
fn a_change_to_a_stored_document_too_large_to_read_is_refused_and_never_killed() {
    if !root_or_skip("a_change_to_a_stored_document_too_large_to_read_is_refused_and_never_killed") {
        return;
    }
    let _alone = alone();
    let (node, _pods) = node_with_pods("bdgs");
    // Stored outside any limit, in mode off: the change asks no kernel work, so what is
    // refused, or what kills, is reading the stored document.
    apply(&node, &snapshot_in(2, DOCUMENT_SERVICES, "off"));
    let before = stored(&node);
    let change = json!({"baseGeneration": 2, "generation": 3, "servicesPut": [{"namespace": "shop", "name": "extra",
        "vip": "10.96.250.1", "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": true}]})
    .to_string()
    .into_bytes();
    let cg = ScratchMemcg::new("stored", STORED_LIMIT);
    refused_and_killed_without_the_check(&node, &cg, &change, "not read: the stored document of");

    // Raised past the estimate: the change applies.
    cg.set_limit(STORED_LIMIT + 64 * MIB);
    let (status, stderr) = one_shot(&node, &cg, &change, &[]);
    assert!(status.success(), "{status}: {stderr}");
    assert_ne!(stored(&node), before, "the change is stored");
}

/// Room above the installer's usage at rest that the body of `DOCUMENT_SERVICES` (8.8 MiB)
/// does not fit.
const BODY_ROOM: u64 = 4 * MIB;

#[test]
fn the_installer_does_not_read_a_body_it_cannot_hold() {
    if !root_or_skip("the_installer_does_not_read_a_body_it_cannot_hold") {
        return;
    }
    let _alone = alone();
    let (node, pods) = node_with_pods("bdgb");
    let old = listing(&pods[0]);
    let before = stored(&node);
    let doc = snapshot_in(2, DOCUMENT_SERVICES, "off");
    let cg = ScratchMemcg::new("body", 512 * MIB);
    let mut inst = Installer::start(&node, &cg, "body", &[]);
    cg.settled_usage();
    let rest = cg.unreclaimable();
    cg.set_limit(rest + BODY_ROOM);
    // Refused from its declared length; the body is read to its end and let go of, so the
    // client, which sends it all before it reads, hears why.
    let (status, body) = inst.post(&doc).expect("an answer");
    assert_eq!(status, 507, "{body}\n{}", inst.log());
    names_the_budget(&body);
    let named = format!("not read: a document of {:.1} MiB", doc.len() as f64 / MIB as f64);
    assert!(body.contains(&named), "{named:?} in {body}");
    assert!(inst.alive(), "the installer died:\n{}", inst.log());
    assert_eq!(inst.get("/readyz").0, 200, "the node stays ready");
    assert_eq!(
        inst.metric("aether_cni_installer_services_applies_total{kind=\"unread\",outcome=\"over-budget\"}"),
        1.0
    );
    assert_eq!(inst.metric("aether_cni_installer_services_over_budget_needed_bytes"), doc.len() as f64);
    // Sent without its length: refused as its buffer would grow past the room, the rest
    // drained.
    let (status, body) = inst.post_chunked(&doc).expect("an answer");
    assert_eq!(status, 507, "{body}\n{}", inst.log());
    names_the_budget(&body);
    assert!(body.contains("so far (sent without its length)"), "{body}");
    assert!(inst.alive(), "the installer died:\n{}", inst.log());
    assert_eq!(
        inst.metric("aether_cni_installer_services_applies_total{kind=\"unread\",outcome=\"over-budget\"}"),
        2.0
    );
    every_pod_holds(&pods, &old, "generation 1 after the refusal");
    assert_eq!(stored(&node), before, "the stored snapshot is unchanged");
    assert_eq!(cg.oom_kills(), 0);
    drop(inst);

    // The control: the check skipped, reading the same body at the same room gets the
    // installer killed.
    let cg = ScratchMemcg::new("body-control", 512 * MIB);
    let mut inst = Installer::start(&node, &cg, "body-control", &[("AETHER_CNI_INJECT_FAILURE", "memory-budget")]);
    cg.settled_usage();
    cg.set_limit(cg.unreclaimable() + BODY_ROOM);
    let answer = inst.post(&doc);
    let status = inst.wait_exit();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "answer {answer:?}; {status}:\n{}", inst.log());
    assert!(cg.oom_kills() >= 1);
    assert_eq!(stored(&node), before, "the stored snapshot is unchanged");
}

/// The node's scale the docs claim, for the image under the chart's limit: pods ADDed outside
/// the container, Services that share no port profile (each pod's costliest layer).
const NODE_PODS: usize = 100;
const NODE_SERVICES: usize = 10_000;

/// A change document on `base`: Service `s{n}` (the next `snapshot` would make) added.
fn one_service_more(base: u64, n: usize) -> Vec<u8> {
    let whole: Value = serde_json::from_slice(&snapshot(base, n + 1)).unwrap();
    json!({"baseGeneration": base, "generation": base + 1, "servicesPut": [whole["services"][n].clone()]})
        .to_string()
        .into_bytes()
}

/// A change document on `base`: Service `s{i}` has no usable endpoint any more.
fn endpoints_gone(base: u64, i: usize) -> Vec<u8> {
    json!({"baseGeneration": base, "generation": base + 1,
           "endpoints": [{"namespace": "shop", "name": format!("s{i}"), "usableEndpoints": false}]})
    .to_string()
    .into_bytes()
}

/// `services verify`: the stored layer is `generation` and every pod holds it, intact.
fn every_pod_verified(node: &SimNode, generation: u64, what: &str) {
    let out = node.services(&["verify"], b"");
    assert!(out.ok, "{what}: services verify failed:\n{}\n{}", out.stdout, out.stderr);
    let v = out.json();
    assert_eq!(v["generation"].as_u64(), Some(generation), "{what}");
    let pods = v["pods"].as_array().unwrap();
    assert_eq!(pods.len(), NODE_PODS, "{what}: {}", out.stdout.chars().take(2000).collect::<String>());
    let broken: Vec<&Value> = pods.iter().filter(|p| p["result"] != "intact").collect();
    assert!(broken.is_empty(), "{what}: pods not intact: {broken:?}");
}

/// The chart's default `resources.limits.memory` (computed from `serviceLayerMemory`; the
/// chart test holds it at 658Mi).
const CHART_LIMIT: &str = "658m";
/// Room above the container's usage for parsing a snapshot of twice the node's Services
/// (about 20 MiB by the estimate, 15 MiB in fact), far from the kernel memory it asks.
const PODMAN_PARSE_ROOM: u64 = 40 * MIB;
/// Room above the container's usage that parsing that snapshot does not fit.
const PODMAN_TIGHT: u64 = 6 * MIB;

/// `GET path` on 127.0.0.1:`port` inside the node's netns (where the container's host
/// network is): the status.
fn get_in(node: &SimNode, addr: &str, path: &str) -> u16 {
    let addr = addr.to_string();
    let path = path.to_string();
    aether_conformance::sock::in_netns(&node.host.path(), move || http::get(&addr, &path).map_or(0, |(code, _)| code))
}

fn post_socket(socket: &std::path::Path, doc: &[u8]) -> (u16, String) {
    let s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    http::exchange(s, "POST", "/services/apply", Some(doc)).unwrap()
}

#[test]
fn the_installer_image_under_podman_applies_within_the_charts_limit_and_refuses_when_lowered() {
    let test = "the_installer_image_under_podman_applies_within_the_charts_limit_and_refuses_when_lowered";
    if !root_or_skip(test) {
        return;
    }
    let _alone = alone();
    let (node, pods) = node_with("bdgp", NODE_PODS);
    let dir = TempDir::new("budget-podman");
    let podman = Podman::new(&node.host, &dir, &dir.mkdir("cni-bin"), &dir.mkdir("podman-net"));
    let image = format!("localhost/aether-cni:budget-{}", std::process::id());
    let notices = std::env::var_os("AETHER_NOTICES")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("target/release/THIRD-PARTY-NOTICES"));
    must(
        "installer/image/build.sh",
        exec(
            Command::new("bash")
                .arg(repo().join("installer/image/build.sh"))
                .arg(cni_bin())
                .arg(aether_testkit::installer_bin())
                .arg(&image)
                .env("PODMAN_FLAGS", podman.storage_flags().join(" "))
                .env("CONTAINERS_CONF", dir.join("containers.conf"))
                .env("NOTICES", notices),
        ),
    );
    for d in ["bin", "conf"] {
        dir.mkdir(d);
    }
    std::fs::copy(repo().join("testdata/install/primaries/10-flannel.conflist"), dir.join("conf/10-flannel.conflist"))
        .unwrap();
    let state = node.state_dir().display().to_string();
    let name = format!("aether-budget-{}", std::process::id());
    let mut args: Vec<String> = vec![
        "run".into(),
        "--detach".into(),
        format!("--name={name}"),
        "--network=host".into(),
        // The chart's resources and security context.
        format!("--memory={CHART_LIMIT}"),
        "--read-only".into(),
        "--read-only-tmpfs=false".into(),
        "--cap-drop=ALL".into(),
        "--cap-add=NET_ADMIN,SYS_ADMIN".into(),
        // Root lacks CAP_SYS_RESOURCE here: podman's default rlimits cannot be set.
        "--ulimit=nofile=1024:1024".into(),
        "--ulimit=nproc=4096:4096".into(),
        format!("--volume={}:/host/opt/cni/bin", dir.join("bin").display()),
        format!("--volume={}:/host/etc/cni/net.d", dir.join("conf").display()),
        format!("--volume={state}:{state}"),
        // The pods' netns, read-only as the chart mounts hostPaths.netnsDir.
        "--volume=/run/netns:/run/netns:ro".into(),
        "--env=HOST_IP=10.244.0.1".into(),
    ];
    // A test build of the binary is dynamic (the release build is static): the host's
    // libraries, read-only.
    if exec(Command::new("ldd").arg(cni_bin())).ok || exec(Command::new("ldd").arg(aether_testkit::installer_bin())).ok
    {
        args.extend(["/lib", "/lib64", "/usr/lib"].iter().map(|d| format!("--volume={d}:{d}:ro")));
    }
    args.extend([image, format!("--state-dir={state}")]);
    args.extend(["--listen=127.0.0.1:0".into(), "--reconcile=false".into()]);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    must("podman run (the installer's image)", podman.run(&argv));
    let log = || podman.run(&["logs", &name]).stderr;
    let socket = node.state_dir().join("agent/services.sock");
    let deadline = Instant::now() + Duration::from_secs(60);
    let addr = loop {
        let l = log();
        if let Some(line) = l.lines().find(|l| l.contains("serving /healthz")) {
            if UnixStream::connect(&socket).is_ok() {
                break line.rsplit(' ').next().unwrap().to_string();
            }
        }
        assert!(Instant::now() < deadline, "the installer never served:\n{l}");
        std::thread::sleep(Duration::from_millis(100));
    };
    while get_in(&node, &addr, "/readyz") != 200 {
        assert!(Instant::now() < deadline, "the installer never got ready:\n{}", log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let pid: u32 =
        must("podman inspect", podman.run(&["inspect", "--format", "{{.State.Pid}}", &name])).trim().parse().unwrap();
    let cg = ScratchMemcg::of_process(pid);
    assert_eq!(cg.limit(), 658 << 20, "podman set the chart's limit on the container's memory cgroup");
    // The container's cgroup as the installer itself found it (through its mountinfo): a
    // limit binds it, so it measured an element's cost.
    while !log().contains("measured on this kernel") {
        assert!(Instant::now() < deadline, "no measure in the log:\n{}", log());
        std::thread::sleep(Duration::from_millis(100));
    }

    // On v1 a container's cgroup goes with it: how it ended is podman's to tell.
    let state = || {
        let format =
            "{{.State.Status}} {{.RestartCount}} exit code {{.State.ExitCode}} oom killed {{.State.OOMKilled}}";
        podman.run(&["inspect", "--format", format, &name]).stdout.trim().to_string()
    };
    let running = |when: &str| {
        let now = state();
        assert!(now.starts_with("running 0 "), "{when}: the container never restarts: {now}\n{}", log());
        assert_eq!(cg.oom_kills(), 0, "{when}");
    };

    // At the chart's limit, the node's scale: the snapshot to every pod, then changes.
    let old = listing(&pods[0]);
    let (status, body) = post_socket(&socket, &snapshot(2, NODE_SERVICES));
    assert_eq!(status, 200, "{body}\n{}", log());
    assert_ne!(listing(&pods[0]), old);
    every_pod_verified(&node, 2, "the snapshot");
    running("the snapshot");
    let (status, body) = post_socket(&socket, &one_service_more(2, NODE_SERVICES));
    assert_eq!(status, 200, "{body}\n{}", log());
    let (status, body) = post_socket(&socket, &endpoints_gone(3, 0));
    assert_eq!(status, 200, "{body}\n{}", log());
    every_pod_verified(&node, 4, "the changes");
    running("the changes");

    // Lowered to what the container holds plus room to parse a snapshot of twice the Services
    // (3.3 MiB of text, about 20 MiB to parse by the estimate) but not to program it: refused
    // whole for the kernel memory, the container alive and ready, every pod as it was.
    let before = stored(&node);
    let big = snapshot(5, 2 * NODE_SERVICES);
    cg.settled_usage();
    // Above the working set, as the installer counts what it holds (active file pages too).
    cg.set_limit(cg.working_set() + PODMAN_PARSE_ROOM);
    let (status, body) = post_socket(&socket, &big);
    assert_eq!(status, 507, "{body}\n{}\n{} oom kills {}", log(), state(), cg.oom_kills());
    names_the_budget(&body);
    assert!(body.contains("of kernel memory"), "{body}");
    assert_eq!(stored(&node), before);
    every_pod_verified(&node, 4, "generation 4 after the refusal");
    assert_eq!(get_in(&node, &addr, "/readyz"), 200, "the node stays ready");
    running("the refusal");

    // Lowered to a few MiB above what it holds: the same document is not even read (its
    // parse alone could get the container killed: CI saw it once at this limit, before the
    // check).
    cg.settled_usage();
    cg.set_limit(cg.working_set() + PODMAN_TIGHT);
    let (status, body) = post_socket(&socket, &big);
    assert_eq!(status, 507, "{body}\n{}\n{} oom kills {}", log(), state(), cg.oom_kills());
    names_the_budget(&body);
    let named = format!("not parsed: a document of {:.1} MiB", big.len() as f64 / MIB as f64);
    assert!(body.contains(&named), "{named:?} in {body}");
    assert_eq!(stored(&node), before);
    every_pod_verified(&node, 4, "generation 4 after the document's refusal");
    assert_eq!(get_in(&node, &addr, "/readyz"), 200, "the node stays ready");
    running("the document's refusal");
    must("podman rm", podman.run(&["rm", "--force", "--time", "0", &name]));
}

/// The node-scale figure, by hand (minutes, so not in `make test`):
/// `cargo test -p aether-conformance --test services_budget -- --ignored --nocapture`.
/// 100 pods ADDed outside the installer, the installer in a cgroup with the chart's former
/// 128 MiB limit, a 10,000-Service snapshot: refused (507) naming the memory it needs, the
/// installer alive; the limit raised to what the refusal names, it applies to every pod.
#[test]
#[ignore = "the node-scale figure, run by hand (docs/operating.md, \"Memory\")"]
fn node_scale_100_pods_10000_services_in_128_mib() {
    if !root_or_skip("node_scale_100_pods_10000_services_in_128_mib") {
        return;
    }
    let _alone = alone();
    let (node, pods) = node_with("bdgn", 100);
    let old = listing(&pods[0]);
    let cg = ScratchMemcg::new("nodescale", 128 * MIB);
    let mut inst = Installer::start(&node, &cg, "nodescale", &[]);
    let big = snapshot(2, 10_000);
    let (status, body) = inst.post(&big).expect("an answer");
    eprintln!("128 MiB: {status}\n{body}");
    assert_eq!(status, 507, "{body}\n{}", inst.log());
    assert!(inst.alive());
    every_pod_holds(&pods, &old, "generation 1 after the refusal");
    let needed = inst.metric("aether_cni_installer_services_over_budget_needed_bytes") as u64;
    let suggested: u64 = body
        .split("at least ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("the suggested limit");
    eprintln!("needed {} MiB, suggested {suggested} MiB", needed >> 20);
    cg.set_limit(suggested * MIB);
    let (status, body) = inst.post(&big).expect("an answer");
    assert_eq!(status, 200, "{body}\n{}", inst.log());
    let new = listing(&pods[0]);
    every_pod_holds(&pods, &new, "generation 2");
    eprintln!("applied at {suggested} MiB: usage now {} MiB, oom kills {}", cg.usage() >> 20, cg.oom_kills());
    assert!(inst.alive());
    assert_eq!(cg.oom_kills(), 0);
}

#[test]
fn work_under_way_that_no_longer_fits_leaves_every_pod_a_whole_layer() {
    if !root_or_skip("work_under_way_that_no_longer_fits_leaves_every_pod_a_whole_layer") {
        return;
    }
    let _alone = alone();
    let (node, pods) = node_with_pods("bdgw");
    let old = listing(&pods[0]);
    let cg = ScratchMemcg::new("underway", 512 * MIB);
    let mut inst = Installer::start(&node, &cg, "underway", &[("AETHER_CNI_INJECT_FAILURE", "memory-budget-estimate")]);
    cg.settled_usage();
    // Room for the installer's own memory as it reads the document (about 9 MiB), the
    // headroom (8 MiB) and a few pods' 1.1 MiB, not for twelve.
    cg.set_limit(cg.unreclaimable() + 24 * MIB);
    let big = snapshot(2, BIG);
    let (status, body) = match inst.post(&big) {
        Some(answer) => answer,
        // Seen once in CI (2026-12-04), never since: what the cgroup and the installer say.
        None => panic!(
            "no answer: installer alive {}, OOM kills {}, usage {} KiB of {} KiB (unreclaimable {} KiB)\n{}",
            inst.alive(),
            cg.oom_kills(),
            cg.usage() >> 10,
            cg.limit() >> 10,
            cg.unreclaimable() >> 10,
            inst.log()
        ),
    };
    assert_eq!(status, 500, "some pods failed, the document stored: {body}\n{}", inst.log());
    assert!(inst.alive(), "{}", inst.log());
    assert_eq!(cg.oom_kills(), 0);
    let report: Value = serde_json::from_str(&body).unwrap();
    let failed: Vec<&Value> = report["pods"].as_array().unwrap().iter().filter(|p| p["result"] == "failed").collect();
    assert!(!failed.is_empty() && failed.len() < PODS, "some pods, not all, stopped: {body}");
    for p in &failed {
        names_the_budget(p["error"].as_str().unwrap());
    }
    // Each pod holds a whole layer: the new one where it was sent, the old one elsewhere.
    let mut new = None;
    let (mut olds, mut news) = (0, 0);
    for p in &pods {
        let l = listing(p);
        if l == old {
            olds += 1;
            continue;
        }
        let reference = new.get_or_insert_with(|| l.clone());
        assert!(&l == reference, "{} holds neither the old nor the new layer", p.name);
        news += 1;
    }
    assert_eq!((olds, news), (failed.len(), PODS - failed.len()), "{body}");
    // Raised: the next apply of the same document brings the pods it stopped to the new one.
    cg.set_limit(cg.unreclaimable() + ROOMY);
    let (status, body) = inst.post(&big).expect("an answer");
    assert_eq!(status, 200, "{body}\n{}", inst.log());
    every_pod_holds(&pods, new.as_ref().unwrap(), "generation 2");
    assert!(inst.alive());
}
