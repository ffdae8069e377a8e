//! `make bench`, part 2: the Service layer at scale. At 1,000 and 10,000 Service ports, side
//! by side: the full build into a netns without the layer, a rebuild (a new Service range:
//! the table replaced, counters kept), a mode change (count <-> refuse: one set's elements),
//! one Service more (set elements only), an apply that finds nothing to change, and `verify`
//! (read back and compare).
//!
//! Needs root (it makes its own netns, deleted again even on a panic). Prints medians and
//! ratios; asserts only what each apply reports. `AETHER_BENCH_ROUNDS` overrides the number
//! of rounds.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use aether_netns::Netns;
use aether_rules::model::Proto;
use aether_rules::services::{self, Applied, LayerMode, ServiceLayer, ServicePort};
use aether_testkit::TestNetns;

const SIZES: [u32; 2] = [1_000, 10_000];

fn rounds() -> usize {
    std::env::var("AETHER_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(21)
}

fn layer(n: u32, mode: LayerMode) -> ServiceLayer {
    let mut l = ServiceLayer::new(mode);
    l.ranges = vec!["10.96.0.0/12".parse().unwrap()];
    l.mesh_vips = vec!["10.96.5.5".parse().unwrap()];
    l.ports = (0..n)
        .map(|i| ServicePort {
            vip: Ipv4Addr::from(0x0a60_0000 + 2 + i).into(),
            proto: Proto::Tcp,
            port: 80,
            has_endpoints: i % 10 != 0,
        })
        .collect();
    l
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The medians of each step at one size.
struct Row {
    build: Duration,
    rebuild: Duration,
    mode_change: Duration,
    one_more: Duration,
    unchanged: Duration,
    verify: Duration,
}

/// Times `f` (which must leave the netns as it found it) `rounds()` times.
fn time(mut f: impl FnMut() -> Duration) -> Duration {
    f(); // warm up
    median((0..rounds()).map(|_| f()).collect())
}

fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let v = f();
    (v, t.elapsed())
}

fn measure(netns: &Netns, n: u32) -> Row {
    netns
        .run(|| {
            let l = layer(n, LayerMode::Refuse);
            let count = ServiceLayer { mode: LayerMode::Count, ..l.clone() };
            let mut wider = l.clone();
            wider.ranges.push("10.200.0.0/16".parse().unwrap());
            let mut more = l.clone();
            more.ports.push(ServicePort {
                vip: "10.111.0.1".parse().unwrap(),
                proto: Proto::Tcp,
                port: 443,
                has_endpoints: true,
            });
            services::remove().unwrap();

            let build = time(|| {
                let (what, d) = timed(|| services::apply(&l).unwrap());
                assert_eq!(what, Applied::Rebuilt);
                assert!(services::remove().unwrap());
                d
            });
            assert_eq!(services::apply(&l).unwrap(), Applied::Rebuilt);
            let rebuild = time(|| {
                let (what, d) = timed(|| services::apply(&wider).unwrap());
                assert_eq!(what, Applied::Rebuilt);
                assert_eq!(services::apply(&l).unwrap(), Applied::Rebuilt);
                d
            });
            let mode_change = time(|| {
                let (what, d) = timed(|| services::apply(&count).unwrap());
                assert_eq!(what, Applied::Elements { added: 0, removed: 2 });
                assert_eq!(services::apply(&l).unwrap(), Applied::Elements { added: 2, removed: 0 });
                d
            });
            let one_more = time(|| {
                let (what, d) = timed(|| services::apply(&more).unwrap());
                assert_eq!(what, Applied::Elements { added: 2, removed: 0 });
                assert_eq!(services::apply(&l).unwrap(), Applied::Elements { added: 0, removed: 2 });
                d
            });
            let unchanged = time(|| {
                let (what, d) = timed(|| services::apply(&l).unwrap());
                assert_eq!(what, Applied::Unchanged);
                d
            });
            let verify = time(|| {
                let (diffs, d) = timed(|| services::verify(&l).unwrap());
                assert!(diffs.is_empty(), "{diffs:#?}");
                d
            });
            services::remove().unwrap();
            Row { build, rebuild, mode_change, one_more, unchanged, verify }
        })
        .unwrap()
}

fn main() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("make bench needs root (it creates its own network namespace)");
        std::process::exit(1);
    }
    // Deleted on drop, also when a step panics (the panic unwinds through main).
    let ns = TestNetns::new("bench-svc");
    let netns = Netns::open_foreign(ns.path()).unwrap();
    println!("services: median of {} rounds each, one netns, mode refuse, one port per Service VIP\n", rounds());
    let rows: Vec<Row> = SIZES.iter().map(|&n| measure(&netns, n)).collect();
    let (a, b) = (&rows[0], &rows[1]);
    println!("  {:<48} {:>12} {:>12} {:>8}", "Service ports", "1,000", "10,000", "10k/1k");
    let line = |name: &str, f: fn(&Row) -> Duration| {
        let (x, y) = (ms(f(a)), ms(f(b)));
        println!("  {name:<48} {x:>9.3} ms {y:>9.3} ms {:>7.1}x", y / x);
    };
    line("full build (no layer yet: the table created)", |r| r.build);
    line("rebuild (a new range: replaced, counters kept)", |r| r.rebuild);
    line("mode change (count <-> refuse: 2 elements)", |r| r.mode_change);
    line("one Service more (2 set elements added)", |r| r.one_more);
    line("apply, nothing changed (read back + compare)", |r| r.unchanged);
    line("verify (read back + compare)", |r| r.verify);
    println!("\n  ratios (of medians)");
    let ratio = |name: &str, f: fn(&Row) -> f64| println!("  {name:<48} {:>11.1}x {:>11.1}x", f(a), f(b));
    ratio("full build / one Service more", |r| ms(r.build) / ms(r.one_more));
    ratio("rebuild / full build", |r| ms(r.rebuild) / ms(r.build));
    ratio("full build / verify", |r| ms(r.build) / ms(r.verify));
    ratio("one Service more / verify", |r| ms(r.one_more) / ms(r.verify));
}
