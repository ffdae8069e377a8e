//! make bench: the reconciler's pass over 100 recorded pods (real netns, each with the real
//! capture and the Service layer, programmed by ADD's code), with 10 and with 10,000 Services
//! stored. Side by side in one run:
//!
//! - CPU per pass (getrusage of the thread that runs it: user + sys, the kernel's work on
//!   the netlink dumps included) with nothing changed: the pass as built (a pod whose netns had
//!   no nftables commit since its last full comparison costs its policy rule and route only)
//!   against the full verify pass (every pod's tables dumped and compared: what a pass cost
//!   before), interleaved; goal at most 20 ms whatever the Service count;
//! - CPU per pass after each change of the Service layer (a Service added in every pod): sent
//!   by the installer's long-lived applier and by the one-shot `services apply`, whose runs of
//!   generations (recorded the same way by the one apply engine) the pass carries a pod's
//!   intact state over;
//! - from drift (a capture rule deleted in one pod) to repaired, with the pass looping on a
//!   short period as the installer's thread does (a pass, then the period): goal at most one
//!   period plus 50 ms.
//!
//! Root only (it makes network namespaces); prints one report.

use std::fs;
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use aether_cri::{Sandbox, SandboxState};
use aether_installer::reconcile::node_lib::NodeLib;
use aether_installer::reconcile::{Action, Limits, NodeOps, Outcome, PodNetwork, Reconciler, Runtime};
use aether_installer::InstallArgs;
use aether_node::services::{apply_change, apply_document, Applier, ServicesDir};
use aether_testkit::TestNetns;
use clap::Parser;
use serde_json::{json, Value};

const PODS: usize = 100;
const PASSES: usize = 20;
const DRIFTS: usize = 20;
const PERIOD: Duration = Duration::from_millis(200);

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: InstallArgs,
}

/// No CRI socket: the pass handles the records (drift and leftovers), which is all it
/// measures here.
struct NoRuntime;

impl Runtime for NoRuntime {
    type Error = String;
    fn sandboxes(&mut self) -> Result<Vec<Sandbox>, String> {
        Err("no CRI socket configured".into())
    }
    fn network(&mut self, _: &str) -> Result<PodNetwork, String> {
        Err("no runtime".into())
    }
    fn stop(&mut self, _: &str) -> Result<(), String> {
        Err("no runtime".into())
    }
}

/// `n` Services of two TCP ports each in 10.96.0.0/15, one in ten without endpoints.
fn snapshot(generation: u64, n: u32) -> Vec<u8> {
    let services: Vec<Value> = (0..n)
        .map(|i| {
            json!({"namespace": format!("ns-{}", i % 50), "name": format!("svc-{i}"),
                   "vip": std::net::Ipv4Addr::from(0x0a60_0100 + i).to_string(),
                   "ports": [{"protocol": "TCP", "port": 80}, {"protocol": "TCP", "port": 8443}],
                   "usableEndpoints": i % 10 != 0})
        })
        .collect();
    serde_json::to_vec(&json!({"generation": generation, "mode": "refuse", "serviceRanges": ["10.96.0.0/15"],
        "meshVIPs": [], "services": services}))
    .unwrap()
}

/// CPU time (user + sys) of the calling thread.
fn thread_cpu() -> Duration {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage fills the struct we own.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

fn stats(mut v: Vec<Duration>) -> (f64, f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let at = |q: f64| ms(v[((v.len() as f64 - 1.0) * q).round() as usize]);
    (at(0.5), at(0.9), ms(*v.last().unwrap()))
}

/// One pass, its CPU time and wall time; every pod must be found intact.
fn measured<R: Runtime, N: NodeOps>(r: &mut Reconciler<R, N>) -> (Duration, Duration, usize) {
    let (cpu, t0) = (thread_cpu(), Instant::now());
    let report = r.pass(Ok(()));
    let (cpu, wall) = (thread_cpu() - cpu, t0.elapsed());
    assert!(report.actions.is_empty(), "nothing changed, yet: {:?}", report.actions);
    assert_eq!(report.count(aether_installer::reconcile::PodState::Captured), PODS, "every pod intact");
    (cpu, wall, report.compared.full)
}

/// From drift to repaired, `DRIFTS` times: the pass looping every `PERIOD` on its own thread (a
/// pass, then the period, as the installer's thread), a capture rule deleted in one pod at a
/// random point of the period, each on a quiet node (after the pass that compares the
/// repaired pod again).
fn drift_to_repaired(args: InstallArgs, pods: &[TestNetns]) -> (Vec<Duration>, Vec<Duration>, Vec<Duration>) {
    let (tx, rx) = mpsc::channel::<Option<(Instant, Duration, Duration)>>();
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    let looping = std::thread::spawn(move || {
        let mut r = Reconciler::new(None::<NoRuntime>, NodeLib::new(args.node_files()), Limits::default());
        // The first pass (all in full) done: the drifts may begin.
        r.pass(Ok(()));
        tx.send(None).unwrap();
        loop {
            let cpu = thread_cpu();
            let report = r.pass(Ok(()));
            let cpu = thread_cpu() - cpu;
            for (a, o) in &report.actions {
                if matches!(a, Action::Repair { .. }) && *o == Outcome::Done {
                    tx.send(Some((Instant::now(), report.took, cpu))).unwrap();
                }
            }
            match stop_rx.recv_timeout(PERIOD) {
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                _ => return,
            }
        }
    });
    assert_eq!(rx.recv_timeout(Duration::from_secs(300)).unwrap(), None, "the first pass");
    let (mut latencies, mut passes, mut cpus) = (Vec::new(), Vec::new(), Vec::new());
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    for k in 0..DRIFTS {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        std::thread::sleep(PERIOD * 3 + Duration::from_millis(seed % PERIOD.as_millis() as u64));
        let ns = &pods[k * 7 % PODS];
        let listing = ns.exec("nft", &["-a", "list", "chain", "ip", "aether_capture", "egress_divert"]);
        let handle = listing
            .lines()
            .filter(|l| !l.trim_start().starts_with("chain "))
            .filter_map(|l| l.split("# handle ").nth(1))
            .next()
            .expect("a rule in egress_divert")
            .trim()
            .to_string();
        let delete = [
            "netns",
            "exec",
            &ns.name,
            "nft",
            "delete",
            "rule",
            "ip",
            "aether_capture",
            "egress_divert",
            "handle",
            &handle,
        ];
        let status = Command::new("ip").args(delete).status().unwrap();
        // The drift: the moment the deleting process is done (its commit is a little earlier).
        let drifted = Instant::now();
        assert!(status.success());
        let (repaired, took, cpu) = rx.recv_timeout(Duration::from_secs(10)).expect("repaired").expect("a repair");
        latencies.push(repaired.saturating_duration_since(drifted));
        passes.push(took);
        cpus.push(cpu);
    }
    stop_tx.send(()).unwrap();
    looping.join().unwrap();
    (latencies, passes, cpus)
}

fn main() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED (needs root): the reconciler pass bench makes network namespaces");
        return;
    }
    let root = std::env::temp_dir().join(format!("aether-pass-bench-{}", std::process::id()));
    let _ = fs::remove_dir_all(&root);
    let (bin, conf, state) = (root.join("bin"), root.join("net.d"), root.join("state"));
    for d in [&bin, &conf, &state] {
        fs::create_dir_all(d).unwrap();
    }
    fs::write(
        conf.join("10-bridge.conflist"),
        r#"{"cniVersion":"1.0.0","name":"podnet","plugins":[{"type":"bridge"}]}"#,
    )
    .unwrap();
    let args = || {
        Cli::parse_from([
            "install".to_string(),
            format!("--cni-bin-dir={}", bin.display()),
            format!("--cni-conf-dir={}", conf.display()),
            format!("--state-dir={}", state.display()),
            "--listen=127.0.0.1:0".into(),
            "--host-ip=10.0.0.1".into(),
        ])
        .args
    };
    // The pods, each captured by ADD's code (the reconciler's in-place capture) in its own netns.
    let pods: Vec<TestNetns> = (0..PODS).map(|_| TestNetns::new("pass")).collect();
    let mut adder = NodeLib::new(args().node_files());
    adder.records().unwrap();
    for (i, ns) in pods.iter().enumerate() {
        let sandbox = Sandbox {
            id: format!("pod{i:03}"),
            namespace: "bench".into(),
            name: format!("pod-{i}"),
            uid: format!("uid-{i}"),
            attempt: 0,
            state: SandboxState::Ready,
            created_at: 0,
            annotations: Default::default(),
        };
        adder.capture(&sandbox, &ns.path(), &[format!("10.1.{}.{}", i / 200, i % 200 + 2)]).unwrap();
    }
    let services = ServicesDir::new(&state);
    let mut report = String::new();
    let mut line = |s: String| {
        println!("{s}");
        report.push_str(&s);
        report.push('\n');
    };
    line(format!(
        "reconciler pass: {PODS} recorded pods (real netns, capture + Service layer), nothing changed; CPU of the passing thread (user + sys), {PASSES} passes each, interleaved"
    ));
    line(format!("{:<62} {:>9} {:>9} {:>9} {:>9} {:>8}", "", "cpu med", "cpu p90", "cpu max", "wall med", "full/pass"));
    let mut goal_cpu = Vec::new();
    for (generation, n) in [(1, 10), (2, 10_000)] {
        let applied = apply_document(&services, &snapshot(generation, n)).unwrap();
        assert!(!applied.failed(), "the apply failed: {:?}", applied.to_json());
        let mut cheap = Reconciler::new(None::<NoRuntime>, NodeLib::new(args().node_files()), Limits::default());
        let mut full =
            Reconciler::new(None::<NoRuntime>, NodeLib::new(args().node_files()).always_full(true), Limits::default());
        // The first pass compares everything in full (nothing remembered yet): not counted.
        let first = measured(&mut cheap);
        assert_eq!(first.2, PODS);
        let (mut c_cpu, mut c_wall, mut f_cpu, mut f_wall) = (vec![], vec![], vec![], vec![]);
        let (mut c_full, mut f_full) = (0, 0);
        for _ in 0..PASSES {
            let (cpu, wall, compared) = measured(&mut cheap);
            c_cpu.push(cpu);
            c_wall.push(wall);
            c_full += compared;
            let (cpu, wall, compared) = measured(&mut full);
            f_cpu.push(cpu);
            f_wall.push(wall);
            f_full += compared;
        }
        let (cm, cp, cx) = stats(c_cpu);
        let (fm, fp, fx) = stats(f_cpu);
        let (cw, _, _) = stats(c_wall);
        let (fw, _, _) = stats(f_wall);
        let label = format!("{n} Services");
        line(format!(
            "{:<62} {cm:>7.2}ms {cp:>7.2}ms {cx:>7.2}ms {cw:>7.2}ms {:>8}",
            format!("{label}: the pass (generation unchanged: rule + route only)"),
            c_full as f64 / PASSES as f64
        ));
        line(format!(
            "{:<62} {fm:>7.2}ms {fp:>7.2}ms {fx:>7.2}ms {fw:>7.2}ms {:>8}",
            format!("{label}: full verify pass (every table dumped, compared)"),
            f_full as f64 / PASSES as f64
        ));
        line(format!(
            "{:<62} {:>8.1}x less CPU (median); goal <= 20 ms: {}",
            format!("{label}: ratio"),
            fm / cm,
            if cm <= 20.0 { "met" } else { "NOT met" }
        ));
        goal_cpu.push(cm);
        // The first (full) pass of the pass as built, for scale.
        line(format!(
            "{:<62} {:>7.2}ms (its first pass, all in full)",
            format!("{label}: first pass"),
            first.0.as_secs_f64() * 1e3
        ));
        let (latencies, passes, cpus) = drift_to_repaired(args(), &pods);
        let (m, p, x) = stats(latencies);
        let (pm, _, px) = stats(passes);
        let (qm, _, qx) = stats(cpus);
        let goal = (PERIOD + Duration::from_millis(50)).as_secs_f64() * 1e3;
        line(format!(
            "{label}: drift (a capture rule deleted in one pod) to repaired, passes every {} ms, {DRIFTS} drifts: median {m:.1} ms, p90 {p:.1} ms, max {x:.1} ms; goal <= period + 50 ms = {goal:.0} ms: {}",
            PERIOD.as_millis(),
            if x <= goal { "met" } else { "NOT met" }
        ));
        line(format!(
            "{label}: the pass that found and repaired it: wall median {pm:.1} ms, max {px:.1} ms; its CPU median {qm:.1} ms, max {qx:.1} ms (the rest of its wall time is waiting for a CPU; the rest of the latency, for the next pass)"
        ));
    }

    // After changes (10,000 Services stored): each a Service added in every pod, by the
    // installer's long-lived applier and by the one-shot `services apply` (both record the
    // runs of generations a pass carries a pod's intact state over; before they shared one
    // engine, every pod was compared in full after a one-shot apply, 4.5 s a pass).
    let mut generation = 2u64;
    let mut change = |k: u32| {
        generation += 1;
        json!({"baseGeneration": generation - 1, "generation": generation, "servicesPut": [
            {"namespace": "churn", "name": format!("c-{k}"), "vip": std::net::Ipv4Addr::from(0x0a61_8000 + k).to_string(),
             "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": true}]})
        .to_string()
        .into_bytes()
    };
    let mut applier = Applier::new(&state);
    let mut cheap = Reconciler::new(None::<NoRuntime>, NodeLib::new(args().node_files()), Limits::default());
    // Not counted: the first change (it reads the stored document in full, opens the pods'
    // sockets and starts their runs) and the first pass (all in full).
    assert!(!applier.apply(&change(0)).unwrap().failed());
    measured(&mut cheap);
    let (mut a_cpu, mut a_full) = (vec![], 0);
    for k in 1..=PASSES as u32 {
        assert!(!applier.apply(&change(k)).unwrap().failed());
        let (cpu, _, compared) = measured(&mut cheap);
        a_cpu.push(cpu);
        a_full += compared;
    }
    drop(applier);
    let (mut o_cpu, mut o_full) = (vec![], 0);
    for k in 0..PASSES as u32 {
        assert!(!apply_change(&services, &change(100 + k)).unwrap().failed());
        let (cpu, _, compared) = measured(&mut cheap);
        o_cpu.push(cpu);
        o_full += compared;
    }
    let (am, ap, ax) = stats(a_cpu);
    let (om, op, ox) = stats(o_cpu);
    line(format!(
        "{:<62} {am:>7.2}ms {ap:>7.2}ms {ax:>7.2}ms {:>9} {:>8}",
        "10000 Services: the pass after each change by the applier",
        "",
        a_full as f64 / PASSES as f64
    ));
    line(format!(
        "{:<62} {om:>7.2}ms {op:>7.2}ms {ox:>7.2}ms {:>9} {:>8}",
        "10000 Services: the pass after each one-shot services apply",
        "",
        o_full as f64 / PASSES as f64
    ));
    line(format!(
        "{:<62} {:>8.2}x (median CPU of the pass after each)",
        "10000 Services: after changes, one-shot apply / applier",
        om / am
    ));

    drop(pods);
    let _ = fs::remove_dir_all(&root);
    let _ = goal_cpu;
    // The run as printed, with when and where, into bench/results (not edited by hand).
    let uname = Command::new("uname").arg("-r").output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let load = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let date = Command::new("date")
        .args(["-u", "+%Y-%m-%dT%H:%M:%SZ"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let header = format!(
        "Written by installer/benches/reconcile_pass.rs (make bench); not edited by hand.\n{}, Linux {}, {} cores, load average {}\n\n",
        date.unwrap_or_default(),
        uname.unwrap_or_default(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/results/reconcile-pass.txt");
    fs::write(&out, header + &report).unwrap();
    println!("(written to bench/results/reconcile-pass.txt)");
}
