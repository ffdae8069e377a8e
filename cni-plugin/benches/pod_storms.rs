//! Pod start and stop as a node meets them: many at once (a node's reboot, a drain), and one
//! while the installer rebuilds every pod's Service layer (the agent's first snapshot). Each
//! beside what it is compared with, in the same run: Debian's `tuning` plugin the same way
//! (a chained plugin that does next to nothing: the cost of being a chained plugin), the
//! plugin with no Services stored, and the kernel's own element work (the floor).
//!
//! `AETHER_BENCH_BIN`: the plugin binary (the release's, as shipped); `AETHER_BENCH_ROUNDS`:
//! rounds per row (3). Root: it makes its own network namespaces.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use aether_netns::Netns;
use aether_rules::services;
use aether_testkit::TestNetns;
use serde_json::json;

#[path = "common/services_doc.rs"]
#[allow(dead_code)] // (the churn's documents: the installer benches')
mod services_doc;
use services_doc::{layer, median, ms, snapshot};

/// A node's pods at once: the kubelet's default maximum (110).
const STORM: usize = 110;
/// The pods whose layers the installer rebuilds while one more starts.
const REBUILT: usize = 100;
const SERVICES: u32 = 10_000;
const TUNING: &str = "/usr/lib/cni/tuning";

fn rounds() -> usize {
    std::env::var("AETHER_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(3)
}

fn bin() -> String {
    std::env::var("AETHER_BENCH_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_aether-cni").to_string())
}

/// A state directory on tmpfs, as the node's /var/run/aether-cni is.
fn state_dir(tag: &str) -> PathBuf {
    let d = PathBuf::from(format!("/dev/shm/aether-bench-storms-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Removes the state directories when dropped (also on a panic).
struct Cleanup(Vec<PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for d in &self.0 {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// One plugin run: `conf` on stdin, the CNI environment for `netns`/`id`; its wall time.
/// A failure stops the bench (a storm that fails is no figure).
fn plugin(bin: &str, cmd: &str, netns: &str, id: &str, conf: &[u8]) -> Duration {
    let t = Instant::now();
    let mut child = Command::new(bin)
        .env_clear()
        .env("CNI_COMMAND", cmd)
        .env("CNI_CONTAINERID", id)
        .env("CNI_NETNS", netns)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/opt/cni/bin:/usr/lib/cni")
        .env("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAMESPACE=bench;K8S_POD_NAME=pod")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // (A plugin may answer without reading all of it: VERSION needs none.)
    match child.stdin.take().unwrap().write_all(conf) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        written => written.unwrap(),
    }
    let out = child.wait_with_output().unwrap();
    let wall = t.elapsed();
    assert!(
        out.status.success(),
        "{bin} {cmd} {id}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    wall
}

/// `cmd` for every pod at once (a thread each, released together): the wall time until the
/// last is done, and each one's.
fn storm(bin: &str, cmd: &str, pods: &[TestNetns], conf: &[u8]) -> (Duration, Vec<Duration>) {
    storm_settled(bin, cmd, pods, conf, &|_| {}).0
}

/// Settles an ADD storm: a large Service layer is built after ADD's answer, under the pod's
/// netns lock.
fn layer_built(p: &TestNetns) {
    Netns::open(p.path()).unwrap().wait_unlocked().unwrap();
}

/// Settles a DEL storm: what DEL removed is out of the ruleset at its answer, and the kernel
/// frees it after an RCU grace period (DEL's child closes its sockets then, after the
/// answer). A netfilter socket's close waits for what is pending: one here, in each pod.
fn freed(p: &TestNetns) {
    assert!(!Netns::open_foreign(p.path()).unwrap().run(services::remove).unwrap().unwrap());
}

/// `storm`, and the wall time until `settle` is done for every pod (`layer_built`, `freed`: the
/// storm's whole work). Both from the first start: each thread notes when it starts its run,
/// as the one releasing them all may get a core back only after many have run (2 cores, 110
/// threads).
fn storm_settled(
    bin: &str,
    cmd: &str,
    pods: &[TestNetns],
    conf: &[u8],
    settle: &dyn Fn(&TestNetns),
) -> ((Duration, Vec<Duration>), Duration) {
    let go = std::sync::Barrier::new(pods.len() + 1);
    std::thread::scope(|s| {
        let each: Vec<_> = pods
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let go = &go;
                s.spawn(move || {
                    go.wait();
                    let start = Instant::now();
                    (start, plugin(bin, cmd, &p.path(), &format!("storm-{i}"), conf))
                })
            })
            .collect();
        go.wait();
        let runs: Vec<(Instant, Duration)> = each.into_iter().map(|h| h.join().unwrap()).collect();
        let (first, answered) = span(&runs);
        for p in pods {
            settle(p);
        }
        ((answered, runs.into_iter().map(|(_, d)| d).collect()), first.elapsed())
    })
}

/// The first start of `runs` (each a start and how long it ran), and the wall time from it to
/// the last end.
fn span(runs: &[(Instant, Duration)]) -> (Instant, Duration) {
    let first = runs.iter().map(|r| r.0).min().expect("a run");
    let last = runs.iter().map(|(start, d)| *start + *d).max().expect("a run");
    (first, last - first)
}

fn aether_conf(state: &Path) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "cniVersion": "1.0.0", "name": "bench-storms", "type": "aether-cni", "stateDir": state,
        "hostIP": "10.0.0.1",
        "prevResult": {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/x"}],
                       "ips": [{"address": "10.244.1.5/24", "interface": 0}]}
    }))
    .unwrap()
}

fn tuning_conf(data: &Path) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "cniVersion": "1.0.0", "name": "bench-storms", "type": "tuning", "dataDir": data,
        "prevResult": {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/x"}],
                       "ips": [{"address": "10.244.1.5/24", "interface": 0}]}
    }))
    .unwrap()
}

/// `aether-cni services apply` of `doc` into `state`.
fn services_apply(bin: &str, state: &Path, doc: &[u8]) {
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

/// The kernel's floor of a storm with `n` Services: every pod's layer, encoded once, created
/// by a thread per pod at once, then removed the same way (no process, no file, no capture):
/// the element work alone. (create, remove) wall times.
fn floor(pods: &[TestNetns], n: u32) -> (Duration, Duration) {
    let prepared = services::Prepared::new(&layer(n)).unwrap().expect("a layer");
    let at_once = |work: &(dyn Fn() + Sync)| {
        let go = std::sync::Barrier::new(pods.len() + 1);
        std::thread::scope(|s| {
            let each: Vec<_> = pods
                .iter()
                .map(|p| {
                    let go = &go;
                    s.spawn(move || {
                        let ns = Netns::open_foreign(p.path()).unwrap();
                        go.wait();
                        let start = Instant::now();
                        ns.run(work).unwrap();
                        (start, start.elapsed())
                    })
                })
                .collect();
            go.wait();
            span(&each.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()).1
        })
    };
    let create = at_once(&|| prepared.create().send().unwrap());
    let remove = at_once(&|| assert!(services::remove().unwrap()));
    (create, remove)
}

/// One ADD while `bin`'s one-shot apply brings `rebuilt`'s pods their first layer, and the
/// same ADD on the idle node (into `extra`), and that pod's DEL there: medians (idle ADD,
/// during, the apply, idle DEL) in ms.
fn add_during_rebuild(bin: &str, state: &Path, rebuilt: &[TestNetns], extra: &TestNetns) -> (f64, f64, f64, f64) {
    let conf = aether_conf(state);
    for (i, p) in rebuilt.iter().enumerate() {
        plugin(bin, "ADD", &p.path(), &format!("pod-{i}"), &conf);
    }
    let doc = snapshot(1, SERVICES);
    let (mut idle, mut during, mut applies, mut del_idle) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds() {
        // The node as before the agent's first snapshot: no snapshot, no layer in any pod.
        let _ = std::fs::remove_dir_all(state.join("services"));
        for p in rebuilt {
            Netns::open_foreign(p.path()).unwrap().run(services::remove).unwrap().unwrap();
        }
        let (wall, apply_wall) = std::thread::scope(|s| {
            let apply = s.spawn(|| {
                let t = Instant::now();
                services_apply(bin, state, &doc);
                t.elapsed()
            });
            // Started once the apply has stored the layer (it then tours the pods at once).
            while !state.join("services/layer.bin").exists() {
                assert!(!apply.is_finished(), "the apply ended before it stored a layer");
                std::thread::sleep(Duration::from_millis(1));
            }
            assert!(!apply.is_finished(), "the apply ended before the ADD started: not an ADD during a rebuild");
            let wall = plugin(bin, "ADD", &extra.path(), &format!("extra-{round}"), &conf);
            (wall, apply.join().unwrap())
        });
        during.push(ms(wall));
        applies.push(ms(apply_wall));
        // An idle node: nothing of the DEL before is left for the kernel to free in the netns
        // (DEL answers before it is freed, and the next netfilter socket closed there waits).
        plugin(bin, "DEL", &extra.path(), &format!("extra-{round}"), &conf);
        freed(extra);
        idle.push(ms(plugin(bin, "ADD", &extra.path(), &format!("idle-{round}"), &conf)));
        // One DEL of a pod whose whole layer is built, on the idle node.
        layer_built(extra);
        del_idle.push(ms(plugin(bin, "DEL", &extra.path(), &format!("idle-{round}"), &conf)));
        freed(extra);
    }
    for (i, p) in rebuilt.iter().enumerate() {
        plugin(bin, "DEL", &p.path(), &format!("pod-{i}"), &conf);
    }
    (median(idle), median(during), median(applies), median(del_idle))
}

/// Each round's ratio of `ours` to `tuning`'s storm of the same round (the two a few hundred
/// milliseconds apart, so that what else the machine does weighs on both alike): their
/// median and spread, printed after the ratio of the medians (nothing for a single round).
fn per_round(ours: &[f64], tuning: &[f64]) -> String {
    if ours.len() < 2 {
        return String::new();
    }
    let mut r: Vec<f64> = ours.iter().zip(tuning).map(|(o, t)| o / t).collect();
    r.sort_by(f64::total_cmp);
    format!("  (rounds: median {:.2}x, {:.2}-{:.2}x)", median(r.clone()), r[0], r[r.len() - 1])
}

fn main() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("the storm bench needs root (it makes its own network namespaces)");
        std::process::exit(1);
    }
    let bin = bin();
    // `AETHER_BENCH_OLD_BIN`: a release before, measured the same way beside this one.
    let old = std::env::var("AETHER_BENCH_OLD_BIN").ok().filter(|b| Path::new(b).exists());
    let tags = ["none", "services", "rebuild", "tuning", "old-services", "old-rebuild"];
    let dirs = Cleanup(tags.into_iter().map(state_dir).collect());
    let [none, with_services, rebuild, tuning_data, old_services, old_rebuild] =
        [0, 1, 2, 3, 4, 5].map(|i| dirs.0[i].as_path());
    println!(
        "pod storms and an ADD during a rebuild: {SERVICES} Services, {STORM} pods at once, medians of {} rounds",
        rounds()
    );
    println!("  (wall time from the first start to the last exit; the machine may be shared)\n");

    let pods: Vec<TestNetns> = (0..STORM).map(|_| TestNetns::new("bstorm")).collect();
    for p in &pods {
        // tuning needs the interface it is chained for: a veth pair inside the pod netns.
        let ok = Command::new("ip")
            .args(["-n", &p.name, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0peer"])
            .status()
            .unwrap();
        assert!(ok.success());
    }
    services_apply(&bin, with_services, &snapshot(1, SERVICES));
    // (The contender whose DEL storm has the goal: ours with the Services stored.)
    const WITH_SERVICES: usize = 2;
    let mut contenders: Vec<(String, Vec<u8>, String)> = vec![
        ("Debian tuning (chained, does next to nothing)".into(), tuning_conf(tuning_data), TUNING.into()),
        ("aether-cni, no Services stored".into(), aether_conf(none), bin.clone()),
        ("aether-cni, 10,000 Services stored".into(), aether_conf(with_services), bin.clone()),
    ];
    if let Some(old) = &old {
        services_apply(old, old_services, &snapshot(1, SERVICES));
        contenders.push(("the release before, 10,000 Services stored".into(), aether_conf(old_services), old.clone()));
    }
    let n = contenders.len();
    let (mut adds, mut add_p99, mut dels) = (vec![Vec::new(); n], vec![Vec::new(); n], vec![Vec::new(); n]);
    let (mut built, mut freed_all) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    let (mut floors, mut del_floors) = (Vec::new(), Vec::new());
    // The process alone: VERSION answered by each binary, a storm of them (tuning's and ours).
    let mut starts = [Vec::new(), Vec::new()];
    for _ in 0..rounds() {
        let (create, remove) = floor(&pods, SERVICES);
        floors.push(ms(create));
        del_floors.push(ms(remove));
        for (i, (_, conf, b)) in contenders.iter().take(2).enumerate() {
            starts[i].push(ms(storm(b, "VERSION", &pods, conf).0));
        }
        for (i, (_, conf, b)) in contenders.iter().enumerate() {
            let ((wall, mut each), settled) = storm_settled(b, "ADD", &pods, conf, &layer_built);
            each.sort();
            adds[i].push(ms(wall));
            built[i].push(ms(settled));
            add_p99[i].push(ms(each[each.len() * 99 / 100]));
            let ((wall, _), settled) = storm_settled(b, "DEL", &pods, conf, &freed);
            dels[i].push(ms(wall));
            freed_all[i].push(ms(settled));
        }
    }
    let (floor, del_floor) = (median(floors.clone()), median(del_floors.clone()));
    println!("{STORM} ADDs at once (a node's reboot):");
    let tuning_add = median(adds[0].clone());
    for (i, (name, _, _)) in contenders.iter().enumerate() {
        let (wall, p99) = (median(adds[i].clone()), median(add_p99[i].clone()));
        // (Tuning's own row: no ratio to itself.)
        let rounds = if i == 0 { String::new() } else { per_round(&adds[i], &adds[0]) };
        println!(
            "  {name:<48} {wall:>9.1} ms  (p99 of one ADD {p99:>7.1} ms)  / tuning {:.2}x{rounds}",
            wall / tuning_add
        );
    }
    println!("  until every pod's Service layer is built (a large one is built after ADD's answer):");
    for (i, (name, _, _)) in contenders.iter().enumerate().skip(1) {
        println!("    {name:<46} {:>9.1} ms", median(built[i].clone()));
    }
    let what = "floor: the 10,000-Service layer in every pod";
    println!("  {what:<48} {floor:>9.1} ms  (the kernel's element work alone: threads, no process)");
    println!("\n{STORM} DELs at once (a node's drain):");
    let tuning_del = median(dels[0].clone());
    for (i, (name, _, _)) in contenders.iter().enumerate() {
        let wall = median(dels[i].clone());
        let goal = if i == WITH_SERVICES { "  (goal <= 1.5x)" } else { "" };
        let rounds = if i == 0 { String::new() } else { per_round(&dels[i], &dels[0]) };
        println!("  {name:<48} {wall:>9.1} ms  / tuning {:.2}x{goal}{rounds}", wall / tuning_del);
    }
    println!("  until the kernel has freed what every DEL removed (after an RCU grace period; DEL answers before):");
    for (i, (name, _, _)) in contenders.iter().enumerate().skip(1) {
        println!("    {name:<46} {:>9.1} ms", median(freed_all[i].clone()));
    }
    let what = "floor: the 10,000-Service layer removed in every pod";
    println!("  {what:<48} {del_floor:>9.1} ms  (the kernel's element work alone: threads, no process)");
    // What the kernel's own removal is beside tuning's whole storm: a goal below it cannot be met.
    println!(
        "  {:<48} {:>9.2}x{}",
        "the floor / tuning's storm",
        del_floor / tuning_del,
        per_round(&del_floors, &dels[0])
    );
    // A DEL is a process: what starting one costs, tuning's and ours, and the least a storm of
    // our DELs can take (the kernel's removal and our processes' start, added: two cores are
    // busy with both at once).
    let [tuning_start, our_start] = [0, 1].map(|i| median(starts[i].clone()));
    println!(
        "  {:<48} {tuning_start:>9.1} ms  / tuning {:.2}x",
        "the process alone: tuning's VERSION",
        tuning_start / tuning_del
    );
    println!(
        "  {:<48} {our_start:>9.1} ms  / tuning {:.2}x",
        "the process alone: aether-cni's VERSION",
        our_start / tuning_del
    );
    println!(
        "  {:<48} {:>9.1} ms  / tuning {:.2}x",
        "the two floors together (removal + our start)",
        del_floor + our_start,
        (del_floor + our_start) / tuning_del
    );
    // How far our storm is above the least it can take, round by round (the goal is against
    // tuning's storm; this is what is ours to cut).
    let both_floors: Vec<f64> = del_floors.iter().zip(&starts[1]).map(|(removal, start)| removal + start).collect();
    println!(
        "  {:<48} {:>9.2}x{}",
        "aether-cni, 10,000 Services / the two floors",
        median(dels[WITH_SERVICES].clone()) / (del_floor + our_start),
        per_round(&dels[WITH_SERVICES], &both_floors)
    );
    let (rebuilt, extra) = (&pods[..REBUILT], &pods[REBUILT]);
    let mut runs = vec![("aether-cni", add_during_rebuild(&bin, rebuild, rebuilt, extra))];
    if let Some(old) = &old {
        runs.push(("the release before", add_during_rebuild(old, old_rebuild, rebuilt, extra)));
    }
    for (name, (idle, during, apply, _)) in &runs {
        println!("\n{name}: one ADD while {REBUILT} pods get their first {SERVICES}-Service layer (the apply: {apply:.0} ms):");
        println!("  {:<48} {idle:>9.1} ms", "ADD, idle node");
        println!("  {:<48} {during:>9.1} ms  / idle {:.2}x  (goal <= 2x)", "ADD during the rebuild", during / idle);
    }
    println!("\none DEL of a pod with its whole {SERVICES}-Service layer, idle node:");
    for (name, (_, _, _, del)) in &runs {
        let ratio = if runs.len() > 1 {
            format!("  / the release before {:.2}x", del / runs[runs.len() - 1].1 .3)
        } else {
            String::new()
        };
        println!("  {name:<48} {del:>9.1} ms{ratio}");
    }
}
