//! The node library's reading of its own memory cgroup, from a process started in one the test
//! made with a known limit: cgroup v1 on this machine, v2 in the kernel matrix's VMs (suite
//! `node-memcg`), as on most nodes. The unit tests in `memcg.rs` read files laid out by hand;
//! this one reads what the kernel shows (`/proc/self/cgroup`, mountinfo, the limit files) and
//! measures the bytes an element of the Service layer charges there, which the budget uses.
//!
//! Root: skips loudly without it, fails under AETHER_REQUIRE_ROOT_TESTS=1.

use std::process::Command;

use aether_node::memcg::{Memcg, Version};
use aether_node::services::budget;
use aether_testkit::memcg::ScratchMemcg;
use aether_testkit::root_or_skip;

/// Set in the child: print what the library reads, and nothing else.
const CHILD: &str = "AETHER_NODE_MEMCG_CHILD";
const LIMIT: u64 = 192 << 20;

/// What the library reads in this process: `version limit usage per_element`.
fn reading_here() -> String {
    let memcg = Memcg::own().expect("readable").expect("a memory cgroup");
    let r = memcg.read().expect("its reading");
    let version = match memcg.version {
        Version::V1 => "v1",
        Version::V2 => "v2",
    };
    let limit = r.limit.map_or("none".to_string(), |l| l.to_string());
    format!("{version} {limit} {} {}", r.usage, budget::per_element(&memcg))
}

#[test]
fn the_library_reads_the_memory_cgroup_it_runs_in() {
    if std::env::var_os(CHILD).is_some() {
        println!("\nreading={}", reading_here());
        return;
    }
    if !root_or_skip("the_library_reads_the_memory_cgroup_it_runs_in") {
        return;
    }
    let cg = ScratchMemcg::new("node-memcg", LIMIT);
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["the_library_reads_the_memory_cgroup_it_runs_in", "--exact", "--nocapture", "--test-threads=1"]);
    cmd.env(CHILD, "1");
    cg.enter_on_spawn(&mut cmd);
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the child failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout.lines().find_map(|l| l.strip_prefix("reading=")).unwrap_or_else(|| panic!("{stdout}"));
    let f: Vec<&str> = line.split_whitespace().collect();
    let [version, limit, usage, per] = f[..] else { panic!("{line}") };
    assert_eq!(version, if cg.v2 { "v2" } else { "v1" }, "{line}");
    assert_eq!(limit, LIMIT.to_string(), "the limit the test set, read by the library: {line}");
    let usage: u64 = usage.parse().unwrap();
    assert!(usage > 0 && usage < LIMIT, "{line}");
    // Measured on this kernel (an element is a key and its hash node: tens of bytes, not the
    // fallback the budget assumes when it cannot measure).
    let per: u64 = per.parse().unwrap();
    assert!(per != budget::FALLBACK_PER_ELEMENT && (32..=256).contains(&per), "bytes per element: {line}");
    eprintln!("memory cgroup {version}: limit {limit}, usage {usage}, {per} bytes per Service-layer element");

    // Negative control: the test process itself is not in that cgroup, and the library does
    // not read it there (the check above cannot pass by reading some other cgroup's limit).
    let here = Memcg::own().unwrap().expect("a memory cgroup");
    assert_ne!(here.dir, cg.dir, "the test's own cgroup is not the child's");
    assert_ne!(here.read().unwrap().limit, Some(LIMIT), "another cgroup's limit");
}
