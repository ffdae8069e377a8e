//! `make bench`, part 3b: the Service layer beside the release before, side by side in one
//! run. The release before (`AETHER_BENCH_BEFORE_DIR`: its plugin and installer as it shipped
//! them, built from the history by `scripts/previous-release.sh COMMIT shipped`) and this one
//! each get a node of their own: 100 pods ADDed by its plugin, its installer serving its
//! socket in a memory cgroup of the chart's limit, and the agent's first snapshot of 10,000
//! Services (20,000 ports) POSTed to it. Then, round by round, the two nodes in turn (the
//! order swapped each round, the other node idle meanwhile):
//!
//! - (a) a change document through the installer's socket (a Service added, its endpoints
//!   flipped to none, removed), each after `AETHER_BENCH_CHANGE_GAP_MS` (50) as changes meet
//!   a node: the round trip, and the installer's CPU time (all threads, schedstat); here the
//!   two nodes take turns change by change, each pair a few milliseconds apart, so that what
//!   else the machine does falls on both alike;
//! - (c) one ADD of a fresh pod with those 10,000 Services stored (a fresh process as a
//!   runtime runs it: wall, CPU, max RSS), then its DEL, not measured;
//! - (b) churn at 10 changes a second through the socket for `AETHER_BENCH_CHURN_SECS` (10)
//!   seconds: every change's round trip (p50, p99 over all rounds) and the installer's CPU
//!   time over the whole stretch, idle time included, as a share of one core.
//!
//! Each figure of this release beside the release before's, and the ratio against the goal
//! (at most 1.1x the release before). Wall-time figures swing with a shared machine's load:
//! each round's ratio is printed too, so the spread shows. Root: it makes its own network
//! namespaces and memory cgroups, deleted on drop, also when a step panics.
//!
//! `AETHER_BENCH_BIN`: this plugin (make bench: the static one as shipped, copied aside);
//! `AETHER_INSTALLER_BIN`: this installer; `AETHER_BENCH_ROUNDS`: rounds (5).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use aether_testkit::memcg::ScratchMemcg;
use aether_testkit::TestNetns;
use serde_json::Value;

#[path = "common/installer.rs"]
#[allow(dead_code)] // services_scale uses the rest
mod installer;
#[path = "common/process.rs"]
#[allow(dead_code)] // (thread_cpu: services_scale's)
mod process;
#[path = "common/services_doc.rs"]
#[allow(dead_code)] // the layer's model is services_scale's and pod_storms'
mod services_doc;
use installer::{post_change, ChartMemory, InstallerProcess};
use process::{launch, medians, Sample, LAUNCH};
use services_doc::{churn_docs, ms, snapshot};

const SERVICES: u32 = 10_000;
const PODS: usize = 100;
/// The goal: each figure at most this many times the release before's.
const GOAL: f64 = 1.1;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A release's binaries, and what it is called in the output.
struct Release {
    name: String,
    plugin: String,
    installer: PathBuf,
}

/// This release: `AETHER_BENCH_BIN` (or the plugin `cargo bench` built) and the installer
/// `aether_testkit::installer_bin` names.
fn this_release() -> Release {
    let head = std::process::Command::new("git").args(["rev-parse", "--short=7", "HEAD"]).output().ok();
    let head = head.filter(|o| o.status.success()).map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    Release {
        name: format!("this ({})", head.unwrap_or_else(|| "working tree".into())),
        plugin: std::env::var("AETHER_BENCH_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_aether-cni").to_string()),
        installer: aether_testkit::installer_bin().to_path_buf(),
    }
}

/// The release before, from `AETHER_BENCH_BEFORE_DIR` (its `aether-cni`,
/// `aether-cni-installer` and `commit`).
fn release_before() -> Release {
    let dir = PathBuf::from(std::env::var("AETHER_BENCH_BEFORE_DIR").unwrap_or_else(|_| {
        eprintln!(
            "AETHER_BENCH_BEFORE_DIR names no release before (make bench builds one: make previous-release-static)"
        );
        std::process::exit(2)
    }));
    let commit = std::fs::read_to_string(dir.join("commit")).unwrap_or_default();
    let (plugin, installer) = (dir.join("aether-cni"), dir.join("aether-cni-installer"));
    assert!(plugin.is_file() && installer.is_file(), "no aether-cni and aether-cni-installer in {}", dir.display());
    Release { name: commit.trim().chars().take(7).collect(), plugin: plugin.display().to_string(), installer }
}

/// A release's node: its pods, its installer serving its socket in a memory cgroup of the
/// chart's limit, the Services stored, the generation the next change follows.
struct Node {
    state: PathBuf,
    /// Kept for the node's life (their netns deleted on drop).
    _pods: Vec<TestNetns>,
    // Dropped before the cgroup it runs in.
    installer: Option<InstallerProcess>,
    _cg: ScratchMemcg,
    generation: u64,
    /// The next churn Service's number.
    next: u32,
}

impl Node {
    fn new(release: &Release, tag: &str) -> Node {
        let state = PathBuf::from(format!("/dev/shm/aether-bench-before-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state);
        std::fs::create_dir_all(&state).unwrap();
        let pods: Vec<TestNetns> = (0..PODS).map(|_| TestNetns::new("bbefore")).collect();
        for (i, p) in pods.iter().enumerate() {
            process::cni(&release.plugin, "ADD", &state, &p.path(), &format!("pod-{i}"));
        }
        let cg =
            ScratchMemcg::new(&format!("bbefore-{tag}"), ChartMemory::read().limit(SERVICES as u64, PODS as u64, 1));
        let installer =
            InstallerProcess::start_release(&release.installer, Path::new(&release.plugin), &state, Some(&cg));
        let t = Instant::now();
        let (status, body) =
            aether_apply_client::post_apply(&installer.socket, &snapshot(1, SERVICES), Duration::from_secs(600))
                .unwrap_or_else(|e| panic!("{e}\n{}", installer.log()));
        let body = String::from_utf8_lossy(&body);
        assert_eq!(status, 200, "{body}");
        assert_eq!(body.matches("\"rebuilt\"").count(), PODS, "{body}");
        println!("  {}: {PODS} pods ADDed, the first snapshot applied in {:.0} ms", release.name, ms(t.elapsed()));
        let mut node = Node { state, _pods: pods, installer: Some(installer), _cg: cg, generation: 1, next: 0 };
        // The first change after a whole document reads it in full (not the form a change
        // leaves): not one of the measures.
        for (doc, result) in churn_docs(node.next) {
            node.change(doc, result);
        }
        node.next += 1;
        node
    }

    fn installer(&self) -> &InstallerProcess {
        self.installer.as_ref().unwrap()
    }

    /// `doc` through the socket; every pod's result checked (`result`, or for churn, none
    /// failed nor rebuilt).
    fn change(&mut self, doc: Value, result: &str) -> Sample {
        let installer = self.installer.as_ref().unwrap();
        let (sample, body) = post_change(installer, &mut self.generation, doc);
        if result.is_empty() {
            assert!(!body.contains("\"failed\"") && !body.contains("\"rebuilt\""), "{body}");
        } else {
            assert_eq!(body.matches(&format!("\"{result}\"")).count(), PODS, "{body}");
        }
        sample
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        drop(self.installer.take());
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

/// What one node gave in one round.
#[derive(Default)]
struct Round {
    /// By change (`churn_docs`' order).
    changes: [Vec<Sample>; 3],
    adds: Vec<Sample>,
    /// Every churn change's round trip, ms.
    churn: Vec<f64>,
    /// The installer's CPU time over the churn, and the churn's length.
    churn_cpu: Duration,
    churn_wall: Duration,
}

/// The gap before a measured change or ADD (see services_scale's `wait_for_quiet`): the
/// kernel's deferred work of the change before is done, as on a node.
fn wait_for_quiet() {
    std::thread::sleep(Duration::from_millis(env_or("AETHER_BENCH_CHANGE_GAP_MS", 50)));
}

/// One round's changes on both nodes, node by node change by change (in `order`): each
/// change of one node measured a few milliseconds from the same change of the other, so
/// what else the machine does falls on both alike.
fn changes_in_turn(nodes: &mut [Node], rounds: &mut [Round], order: [usize; 2], changes: usize) {
    for _ in 0..changes {
        for op in 0..3 {
            for i in order {
                let (doc, result) = churn_docs(nodes[i].next).into_iter().nth(op).unwrap();
                wait_for_quiet();
                rounds[i].changes[op].push(nodes[i].change(doc, result));
            }
        }
        nodes.iter_mut().for_each(|n| n.next += 1);
    }
}

/// The rest of a round on `node` (its changes made in turn with the other's): the ADDs, the
/// churn.
fn round(release: &Release, node: &mut Node, mut r: Round, adds: usize, churn_secs: u64) -> Round {
    for i in 0..adds {
        let pod = TestNetns::new("bbefore-add");
        let id = format!("add-{}-{i}", node.next);
        wait_for_quiet();
        r.adds.push(process::cni(&release.plugin, "ADD", &node.state, &pod.path(), &id).sample());
        process::cni(&release.plugin, "DEL", &node.state, &pod.path(), &id);
    }
    // Churn: 10 changes a second (add, flip, remove in turn), each sent at its time.
    let (start, cpu) = (Instant::now(), node.installer().cpu_ticks());
    let mut sent = 0u32;
    while start.elapsed() < Duration::from_secs(churn_secs) {
        let due = start + Duration::from_millis(100 * u64::from(sent));
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let (doc, _) = churn_docs(node.next).into_iter().nth(sent as usize % 3).unwrap();
        r.churn.push(node.change(doc, "").wall_ms);
        sent += 1;
        if sent.is_multiple_of(3) {
            node.next += 1;
        }
    }
    // A churn ends on a removal: the next round starts from the same Services.
    while !sent.is_multiple_of(3) {
        let (doc, _) = churn_docs(node.next).into_iter().nth(sent as usize % 3).unwrap();
        node.change(doc, "");
        sent += 1;
    }
    node.next += 1;
    (r.churn_cpu, r.churn_wall) = (node.installer().cpu_ticks() - cpu, start.elapsed());
    r
}

/// The `p`th percentile of `v` (the value below which `p`% of them lie).
fn percentile(mut v: Vec<f64>, p: usize) -> f64 {
    v.sort_by(f64::total_cmp);
    v[(v.len() * p / 100).min(v.len() - 1)]
}

/// One row: this release's figure, the release before's, the ratio, the goal met or not, and
/// the ratio of each round's figures (min-max).
fn row(what: &str, unit: &str, this: f64, before: f64, per_round: &[f64]) -> String {
    let ratio = this / before;
    let (lo, hi) = per_round.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &r| (lo.min(r), hi.max(r)));
    let met = if ratio <= GOAL { "met" } else { "NOT met" };
    format!(
        "  {what:<42} {this:>9.2} {unit:<3} {before:>9.2} {unit:<3} {ratio:>6.2}x  {met:<8} rounds {lo:.2}-{hi:.2}x"
    )
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(LAUNCH) {
        launch(&args[2..]);
    }
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("the release-before bench needs root (it makes its own network namespaces)");
        std::process::exit(1);
    }
    let (rounds, churn_secs) = (env_or("AETHER_BENCH_ROUNDS", 5usize), env_or("AETHER_BENCH_CHURN_SECS", 10u64));
    let (changes, adds) = (4usize, 3usize);
    let releases = [this_release(), release_before()];
    let date = std::process::Command::new("date").args(["-u", "+%Y-%m-%dT%H:%M:%SZ"]).output().unwrap();
    let load = || {
        std::fs::read_to_string("/proc/loadavg").unwrap_or_default().split(' ').take(3).collect::<Vec<_>>().join(" ")
    };
    println!(
        "the Service layer beside the release before: {SERVICES} Services, {PODS} pods, {rounds} rounds, the two nodes in turn"
    );
    println!(
        "  {}, load average at start {}; this release against {} (static, as shipped, built from the history)",
        String::from_utf8_lossy(&date.stdout).trim(),
        load(),
        releases[1].name
    );
    let mut nodes: Vec<Node> = releases.iter().zip(["this", "before"]).map(|(r, tag)| Node::new(r, tag)).collect();
    let mut results: [Vec<Round>; 2] = Default::default();
    for k in 0..rounds {
        let order = if k % 2 == 0 { [0, 1] } else { [1, 0] };
        let mut these: [Round; 2] = Default::default();
        changes_in_turn(&mut nodes, &mut these, order, changes);
        for i in order {
            let r = std::mem::take(&mut these[i]);
            results[i].push(round(&releases[i], &mut nodes[i], r, adds, churn_secs));
        }
    }
    let load_after = load();
    drop(nodes);

    // Figures: over all rounds, and each round's for the spread of the ratio.
    let all = |i: usize, f: &dyn Fn(&Round) -> Vec<Sample>| medians(results[i].iter().flat_map(f).collect());
    let by_round = |f: &dyn Fn(&Round) -> f64| -> Vec<f64> {
        results[0].iter().zip(&results[1]).map(|(a, b)| f(a) / f(b)).collect()
    };
    let (this, before) = (&releases[0].name, &releases[1].name);
    println!("\n  {:<42} {this:>13} {before:>13} {:>7}  goal <= {GOAL}x", "", "ratio");
    println!(
        "(a) a change through the installer's socket, {PODS} pods, {SERVICES} Services ({} each, medians; wall: the round trip, cpu: the installer's):",
        rounds * changes
    );
    let mut lines = Vec::new();
    for (op, what) in ["a Service added", "its endpoints flipped", "removed"].into_iter().enumerate() {
        let (a, b) = (all(0, &|r| r.changes[op].clone()), all(1, &|r| r.changes[op].clone()));
        let wall = by_round(&|r| medians(r.changes[op].clone()).wall_ms);
        let cpu = by_round(&|r| medians(r.changes[op].clone()).cpu_ms);
        lines.push(row(&format!("{what}, wall"), "ms", a.wall_ms, b.wall_ms, &wall));
        lines.push(row(&format!("{what}, cpu"), "ms", a.cpu_ms, b.cpu_ms, &cpu));
    }
    let every = |r: &Round| r.changes.iter().flatten().copied().collect::<Vec<_>>();
    let (a, b) = (all(0, &every), all(1, &every));
    lines.push(row("every change, wall", "ms", a.wall_ms, b.wall_ms, &by_round(&|r| medians(every(r)).wall_ms)));
    lines.push(row("every change, cpu", "ms", a.cpu_ms, b.cpu_ms, &by_round(&|r| medians(every(r)).cpu_ms)));
    lines.iter().for_each(|l| println!("{l}"));

    let churn = |i: usize| results[i].iter().flat_map(|r| r.churn.clone()).collect::<Vec<f64>>();
    let share = |r: &Round| r.churn_cpu.as_secs_f64() / r.churn_wall.as_secs_f64() * 100.0;
    let total_share = |i: usize| {
        let (cpu, wall) = results[i]
            .iter()
            .fold((0.0, 0.0), |(c, w), r| (c + r.churn_cpu.as_secs_f64(), w + r.churn_wall.as_secs_f64()));
        cpu / wall * 100.0
    };
    // (AETHER_BENCH_CHURN_SECS=0: none, for the changes and ADDs alone.)
    if churn_secs > 0 {
        println!(
            "(b) churn through the socket, 10 changes/s, {churn_secs} s a round ({} and {} changes; round trips, and the installer's CPU over the stretch):",
            churn(0).len(),
            churn(1).len()
        );
        for (what, p) in [("round trip p50", 50), ("round trip p99", 99)] {
            let per = by_round(&|r| percentile(r.churn.clone(), p));
            println!("{}", row(what, "ms", percentile(churn(0), p), percentile(churn(1), p), &per));
        }
        println!("{}", row("installer CPU, % of one core", "%", total_share(0), total_share(1), &by_round(&share)));
    }
    println!("(c) one ADD, {SERVICES} Services stored ({} each, medians; a fresh process):", rounds * adds);
    let (a, b) = (all(0, &|r| r.adds.clone()), all(1, &|r| r.adds.clone()));
    println!("{}", row("wall", "ms", a.wall_ms, b.wall_ms, &by_round(&|r| medians(r.adds.clone()).wall_ms)));
    println!("{}", row("cpu", "ms", a.cpu_ms, b.cpu_ms, &by_round(&|r| medians(r.adds.clone()).cpu_ms)));
    // A large layer is built after the answer by a child of the plugin: the answer above, the
    // whole of the work here.
    let settled = |r: &Round| medians(r.adds.clone()).settled_ms;
    println!("{}", row("wall until the layer is built", "ms", a.settled_ms, b.settled_ms, &by_round(&settled)));
    let settled_cpu = |r: &Round| medians(r.adds.clone()).settled_cpu_ms;
    println!(
        "{}",
        row("cpu, the layer's child with it", "ms", a.settled_cpu_ms, b.settled_cpu_ms, &by_round(&settled_cpu))
    );
    println!("{}", row("max RSS", "MiB", a.rss_mib, b.rss_mib, &by_round(&|r| medians(r.adds.clone()).rss_mib)));
    println!("\n  load average at the end {load_after}");
}
