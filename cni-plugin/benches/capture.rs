//! `make bench`, part 1: programming a pod's capture, side by side in one run.
//!
//! - in-process, the parts apart: `aether_rules::install` into a fresh pod netns (the
//!   common ADD), `install` over an intact one (a re-ADD: the table is replaced atomically),
//!   and `aether_rules::remove` (DEL); then fresh install + remove together, as one pod's life
//! - fresh processes, as a runtime runs plugins: ADD, CHECK and DEL of the static release
//!   binary (`AETHER_BENCH_BIN`, else this build's), of an older binary if
//!   `AETHER_BENCH_OLD_BIN` names one (make bench: the previous release's plugin as it
//!   shipped, from `make previous-release-static`), of Debian's
//!   `tuning` plugin (a chained Go plugin that does next to nothing: the cost of being a
//!   plugin at all), and of the same ruleset by exec of `nft -f` + `ip rule` + `ip route`
//!   (CHECK: `nft list table`; DEL: `nft delete table` + `ip rule del` + `ip route del`)
//! - CHECK in-process (`verify`) against `nft list table` by exec
//! - a dual-stack pod: both families' tables in one transaction, plus a rule and a route
//!   each, against the IPv4-only pod above
//!
//! The fresh-process contenders run interleaved: each round runs every contender's ADD,
//! CHECK and DEL in turn (the order rotating from round to round), so a teammate's build
//! that starts or stops mid-run weighs on all of them alike. Beside the wall time each
//! process's CPU time (user + system, from `getrusage(RUSAGE_CHILDREN)`, its children
//! included) is reported: on a busy machine wall time is mostly waiting for a CPU, and CPU
//! time is what the plugin itself costs.
//!
//! Needs root (it makes its own netns, deleted again even on a panic). Prints medians, p90s
//! and ratios; asserts only that each step succeeds. `AETHER_BENCH_ROUNDS` overrides the
//! number of rounds.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use aether_netns::Netns;
use aether_rules::{capture_ruleset, CaptureConfig, CaptureMode, DnsDivert, Ruleset};
use aether_testkit::TestNetns;

const WARM_UP: usize = 5;

fn rounds() -> usize {
    std::env::var("AETHER_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(200)
}

fn sh(args: &[&str]) {
    let st = Command::new(args[0]).args(&args[1..]).stdout(Stdio::null()).status().unwrap();
    assert!(st.success(), "{args:?}");
}

/// Median and p90 of some samples.
#[derive(Clone, Copy)]
struct Stat {
    median: Duration,
    p90: Duration,
}

fn stat(name: &str, samples: Vec<Duration>) -> Stat {
    let s = stat_quiet(samples);
    println!("  {name:<52} median {:>8.3} ms   p90 {:>8.3} ms", ms(s.median), ms(s.p90));
    s
}

fn stat_quiet(mut samples: Vec<Duration>) -> Stat {
    samples.sort();
    Stat { median: samples[samples.len() / 2], p90: samples[samples.len() * 9 / 10] }
}

/// Times `f` `rounds` times after a warm-up (module loads, page cache).
fn measure(name: &str, mut f: impl FnMut()) -> Stat {
    for _ in 0..WARM_UP {
        f();
    }
    let samples = (0..rounds())
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    stat(name, samples)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn ratio(name: &str, num: Stat, den: Stat) {
    println!("  {name:<52} {:>6.2}x", ms(num.median) / ms(den.median));
}

fn main() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("make bench needs root (it creates its own network namespace)");
        std::process::exit(1);
    }
    // Deleted on drop, also when a step panics (the panic unwinds through main).
    let ns = TestNetns::new("bench");
    run(&ns);
}

/// Times install and remove apart, each round in the netns as ADD and DEL find it. The
/// clock runs inside the netns thread, so the thread's creation and `setns` are not counted
/// (the plugin pays them once per command, as the exec line shows).
fn install_remove(netns: &Netns, rs: &Ruleset, reinstall: bool) -> (Vec<Duration>, Vec<Duration>) {
    netns
        .run(|| {
            let (mut adds, mut dels) = (Vec::new(), Vec::new());
            for i in 0..WARM_UP + rounds() {
                if reinstall {
                    aether_rules::install(rs, None).unwrap();
                }
                let t = Instant::now();
                aether_rules::install(rs, None).unwrap();
                let add = t.elapsed();
                let t = Instant::now();
                let removed = aether_rules::remove(aether_rules::capture::TABLE, &rs.policy_routes()).unwrap();
                let del = t.elapsed();
                assert!(removed.table && removed.rule && removed.route, "{removed:?}");
                if i >= WARM_UP {
                    adds.push(add);
                    dels.push(del);
                }
            }
            (adds, dels)
        })
        .unwrap()
}

fn run(ns: &TestNetns) {
    let mut cfg = CaptureConfig::new(CaptureMode::RedirectAll);
    cfg.dns = Some(DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 18054 });
    let rs = capture_ruleset(&cfg).unwrap();
    let netns = Netns::open_foreign(ns.path()).unwrap();
    println!("capture: {} rounds each, one pod netns, default ruleset with DNS capture\n", rounds());

    println!("in-process (aether_rules), the parts apart:");
    let (adds, dels) = install_remove(&netns, &rs, false);
    let fresh = stat("install, fresh netns (ADD)", adds);
    let remove = stat("remove (DEL)", dels);
    let (readds, _) = install_remove(&netns, &rs, true);
    let readd = stat("install over an intact install (re-ADD)", readds);
    let absent = measure("remove, nothing there (repeated DEL)", || {
        netns.run(|| aether_rules::remove(aether_rules::capture::TABLE, &rs.policy_routes()).unwrap()).unwrap();
    });

    println!("\none pod's life in-process (fresh install + remove):");
    let inproc = measure("in-process install + remove", || {
        netns
            .run(|| {
                aether_rules::install(&rs, None).unwrap();
                aether_rules::remove(aether_rules::capture::TABLE, &rs.policy_routes()).unwrap();
            })
            .unwrap()
    });

    println!("\nCHECK:");
    netns.run(|| aether_rules::install(&rs, None).unwrap()).unwrap();
    let check = measure("in-process CHECK (dump + compare)", || {
        assert!(netns.run(|| aether_rules::verify(&rs).unwrap()).unwrap().is_empty())
    });
    let ns_name = ns.name.as_str();
    let list = measure("exec: nft list table (no comparison)", || {
        sh(&["ip", "netns", "exec", ns_name, "nft", "list", "table", "ip", "aether_capture"]);
    });
    netns.run(|| aether_rules::remove(aether_rules::capture::TABLE, &rs.policy_routes()).unwrap()).unwrap();

    println!("\na dual-stack pod (IPv4 and IPv6 tables, one transaction; a rule and a route each):");
    let mut dual_cfg = cfg.clone();
    dual_cfg.families = aether_rules::Family::ALL.to_vec();
    dual_cfg.dns_ipv6 = Some(DnsDivert { host_ip: "fd00::1".parse().unwrap(), port: 18054 });
    let dual = capture_ruleset(&dual_cfg).unwrap();
    let (adds, _) = install_remove(&netns, &dual, false);
    let dual_fresh = stat("install, fresh netns (ADD)", adds);
    netns.run(|| aether_rules::install(&dual, None).unwrap()).unwrap();
    let dual_check = measure("in-process CHECK (dump + compare)", || {
        assert!(netns.run(|| aether_rules::verify(&dual).unwrap()).unwrap().is_empty())
    });
    netns.run(|| aether_rules::remove(aether_rules::capture::TABLE, &dual.policy_routes()).unwrap()).unwrap();

    println!("\nfresh processes, as a runtime runs a plugin (ADD, CHECK, DEL of one pod; contenders interleaved):");
    let new_bin = std::env::var("AETHER_BENCH_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_aether-cni").to_string());
    let old_bin = std::env::var("AETHER_BENCH_OLD_BIN").ok();
    // The attachment record is written with fsync (durable across a node crash): on this
    // VM's disk that alone costs milliseconds, so the plugin is also measured with its state
    // directory on tmpfs (where the default, /var/run, is on most nodes), where the fsync is
    // free: the plugin's own cost.
    let state_dirs = [std::env::temp_dir(), std::path::PathBuf::from("/dev/shm")];
    let (disk_conf, tmpfs_conf) = (aether_conf(&state_dirs[0]), aether_conf(&state_dirs[1]));
    // tuning needs the interface it is chained for: a veth pair inside the pod netns only.
    sh(&["ip", "-n", ns_name, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0peer"]);
    let tuning_dir = std::env::temp_dir().join(format!("aether-bench-tuning-{}", std::process::id()));
    let tuning_conf = serde_json::json!({
        "cniVersion": "1.0.0", "name": "bench", "type": "tuning", "dataDir": tuning_dir.display().to_string(),
        "prevResult": {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": ns.path()}],
                       "ips": [{"address": "10.244.1.5/24", "interface": 0}]}
    })
    .to_string();
    let shell_steps = ShellSteps::new(ns_name);
    let path = ns.path();
    let commands = |bin: &str, conf: &str, cmds: &[&'static str]| -> Steps {
        cmds.iter()
            .map(|&cmd| {
                let (bin, conf, path) = (bin.to_string(), conf.to_string(), path.clone());
                (cmd, Box::new(move || plugin(&bin, &path, cmd, &conf)) as Box<dyn Fn()>)
            })
            .collect()
    };
    let plugin_steps = |bin: &str, conf: &str| commands(bin, conf, &["ADD", "CHECK", "DEL"]);
    let mut contenders = vec![
        ("aether-cni".to_string(), plugin_steps(&new_bin, &disk_conf)),
        ("aether-cni, stateDir on tmpfs".to_string(), plugin_steps(&new_bin, &tmpfs_conf)),
        ("Debian tuning 1.1.1 (chained, does nothing here)".to_string(), plugin_steps(TUNING, &tuning_conf)),
        ("exec: nft -f + ip rule + ip route".to_string(), shell_steps.steps()),
        // What every command of this binary pays before and after its own work: exec, the
        // static start-up, reading the configuration, the log set-up, the result, exit.
        (
            "aether-cni VERSION (the floor: start, parse, answer, exit)".to_string(),
            commands(&new_bin, &tmpfs_conf, &["VERSION"]),
        ),
    ];
    // Below that, what any static glibc program pays here: exec, glibc's start-up, exit.
    let c_floor = static_c_noop();
    if let Some(exe) = &c_floor {
        let exe = exe.to_str().unwrap();
        contenders.push((
            "static C no-op (any static glibc process: exec, start-up, exit)".to_string(),
            commands(exe, "{}", &["run"]),
        ));
    }
    if let Some(old_bin) = &old_bin {
        contenders.push(("aether-cni before (AETHER_BENCH_OLD_BIN)".to_string(), plugin_steps(old_bin, &disk_conf)));
        contenders.push(("aether-cni before, stateDir on tmpfs".to_string(), plugin_steps(old_bin, &tmpfs_conf)));
    }
    let stats = fresh_rounds(&contenders);
    let (new, new_tmpfs, tuning, shell, floor) = (&stats[0], &stats[1], &stats[2], &stats[3], stats[4][0]);
    let c_floor = c_floor.map(|exe| {
        let _ = std::fs::remove_dir_all(exe.parent().unwrap());
        stats[5][0]
    });
    let first_old = if c_floor.is_some() { 6 } else { 5 };
    let old = (stats.len() > first_old).then(|| (&stats[first_old], &stats[first_old + 1]));
    sh(&["ip", "-n", ns_name, "link", "del", "eth0"]);
    let _ = std::fs::remove_dir_all(&tuning_dir);
    for parent in &state_dirs {
        let _ = std::fs::remove_dir_all(parent.join(format!("aether-bench-state-{}", std::process::id())));
    }

    println!("\nratios (of medians):");
    ratio("remove / fresh install", remove, fresh);
    ratio("re-ADD install / fresh install", readd, fresh);
    ratio("remove / remove with nothing there", remove, absent);
    ratio("nft list exec / in-process CHECK", list, check);
    ratio("dual-stack ADD / IPv4 ADD", dual_fresh, fresh);
    ratio("dual-stack CHECK / IPv4 CHECK", dual_check, check);
    println!("\nratios of fresh processes (of medians: wall time, and CPU time):");
    for (i, what) in ["ADD", "CHECK", "DEL"].iter().enumerate() {
        fresh_ratio(&format!("{what}: aether-cni / tuning"), new[i], tuning[i]);
        fresh_ratio(
            &format!("{what}: aether-cni, stateDir on tmpfs / tuning (goal for ADD, cpu: <= 0.55)"),
            new_tmpfs[i],
            tuning[i],
        );
        fresh_ratio(&format!("{what}: exec of nft + ip / aether-cni, stateDir on tmpfs"), shell[i], new_tmpfs[i]);
        fresh_ratio(&format!("{what}: exec of nft + ip / aether-cni (goal for ADD: >= 5)"), shell[i], new[i]);
        fresh_ratio(&format!("{what}: aether-cni, stateDir on tmpfs / VERSION (the floor)"), new_tmpfs[i], floor);
        if let Some(c_floor) = c_floor {
            fresh_ratio(&format!("{what}: aether-cni, stateDir on tmpfs / static C no-op"), new_tmpfs[i], c_floor);
        }
        if let Some((old, old_tmpfs)) = &old {
            fresh_ratio(&format!("{what}: before / aether-cni (goal, cpu: >= 1)"), old[i], new[i]);
            fresh_ratio(
                &format!("{what}: before / aether-cni, stateDir on tmpfs (goal, cpu: >= 1)"),
                old_tmpfs[i],
                new_tmpfs[i],
            );
        }
    }
    ratio(
        "in-process pod life / fresh-process ADD + DEL (wall)",
        inproc,
        Stat { median: new[0].wall.median + new[2].wall.median, p90: new[0].wall.p90 },
    );
}

/// A fresh-process step's wall time and its process's CPU time (medians), and the wall p90.
#[derive(Clone, Copy)]
struct Fresh {
    wall: Stat,
    cpu: Duration,
}

fn fresh_ratio(name: &str, num: Fresh, den: Fresh) {
    println!(
        "  {name:<72} wall {:>6.2}x   cpu {:>6.2}x",
        ms(num.wall.median) / ms(den.wall.median),
        ms(num.cpu) / ms(den.cpu)
    );
}

/// The CPU time (user + system) of every child process waited for so far.
fn children_cpu() -> Duration {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) }, 0);
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// A static-pie C program that reads its stdin and answers `{}`, built with the system's
/// `cc` (the same toolchain links the plugin); `None`, and no row, without one.
fn static_c_noop() -> Option<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("aether-bench-noop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).ok()?;
    let (src, exe) = (dir.join("noop.c"), dir.join("noop"));
    let text = "#include <unistd.h>\nint main(void) { char b[4096]; while (read(0, b, sizeof b) > 0); \
                return write(1, \"{}\\n\", 3) != 3; }\n";
    std::fs::write(&src, text).ok()?;
    let built = Command::new("cc").args(["-O2", "-static-pie", "-o"]).arg(&exe).arg(&src).status();
    if !built.is_ok_and(|s| s.success()) {
        eprintln!("no static C no-op (cc -static-pie failed): its row is left out");
        let _ = std::fs::remove_dir_all(&dir);
        return None;
    }
    Some(exe)
}

/// A contender's steps (ADD, CHECK, DEL; or one command), named.
type Steps = Vec<(&'static str, Box<dyn Fn()>)>;

/// Every contender's steps, `rounds` times, interleaved: round `i` starts with contender
/// `i mod n`. Returns each contender's steps' figures, in their order.
fn fresh_rounds(contenders: &[(String, Steps)]) -> Vec<Vec<Fresh>> {
    let n = contenders.len();
    let mut samples: Vec<Vec<Vec<(Duration, Duration)>>> =
        contenders.iter().map(|(_, steps)| steps.iter().map(|_| Vec::new()).collect()).collect();
    for i in 0..WARM_UP + rounds() {
        for c in (0..n).map(|k| (i + k) % n) {
            for (k, (_, step)) in contenders[c].1.iter().enumerate() {
                let (t, cpu) = (Instant::now(), children_cpu());
                step();
                let (wall, cpu) = (t.elapsed(), children_cpu() - cpu);
                if i >= WARM_UP {
                    samples[c][k].push((wall, cpu));
                }
            }
        }
    }
    contenders
        .iter()
        .zip(samples)
        .map(|((name, steps), per_step)| {
            let whats = steps.iter().map(|(what, _)| *what);
            per_step
                .into_iter()
                .zip(whats)
                .map(|(s, what)| {
                    let mut cpus: Vec<Duration> = s.iter().map(|x| x.1).collect();
                    cpus.sort();
                    let cpu = cpus[cpus.len() / 2];
                    let wall = stat_quiet(s.into_iter().map(|x| x.0).collect());
                    println!(
                        "  {:<58} median {:>8.3} ms   p90 {:>8.3} ms   cpu {:>7.3} ms",
                        format!("{name}: {what}"),
                        ms(wall.median),
                        ms(wall.p90),
                        ms(cpu)
                    );
                    Fresh { wall, cpu }
                })
                .collect()
        })
        .collect()
}

const TUNING: &str = "/usr/lib/cni/tuning";

fn aether_conf(parent: &std::path::Path) -> String {
    let state = parent.join(format!("aether-bench-state-{}", std::process::id()));
    serde_json::json!({
        "cniVersion": "1.0.0", "name": "bench", "type": "aether-cni", "hostIP": "10.0.0.1",
        "stateDir": state.display().to_string(),
        "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "10.244.1.5/24"}]}
    })
    .to_string()
}

/// Runs one plugin command as a runtime does: a fresh process, CNI_* in its environment,
/// the configuration on stdin.
fn plugin(bin: &str, netns: &str, cmd: &str, conf: &str) {
    let mut child = Command::new(bin)
        .env_clear()
        .env("CNI_COMMAND", cmd)
        .env("CNI_CONTAINERID", format!("bench-{}", std::process::id()))
        .env("CNI_NETNS", netns)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/usr/lib/cni")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{bin}: {e}"));
    child.stdin.take().unwrap().write_all(conf.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{bin} {cmd}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The same ruleset by exec of the tools, as a plugin that shells out would (CHECK: `nft
/// list table`; DEL: the deletes).
struct ShellSteps {
    ns: String,
    nft_file: std::path::PathBuf,
}

impl ShellSteps {
    fn new(ns: &str) -> Self {
        // The golden listing is valid nft input: the same ruleset, as text.
        let golden =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/golden/redirect-all.txt"))
                .unwrap();
        let nft_text: String =
            golden.lines().skip(1).take_while(|l| !l.starts_with("# ip")).map(|l| format!("{l}\n")).collect();
        let nft_file = std::env::temp_dir().join(format!("aether-bench-{}.nft", std::process::id()));
        std::fs::write(&nft_file, &nft_text).unwrap();
        ShellSteps { ns: ns.to_string(), nft_file }
    }

    fn steps(&self) -> Steps {
        let (n, f) = (self.ns.clone(), self.nft_file.to_str().unwrap().to_string());
        let (n2, n3) = (n.clone(), n.clone());
        let steps: [(&'static str, Box<dyn Fn()>); 3] = [
            (
                "ADD",
                Box::new(move || {
                    sh(&["ip", "netns", "exec", &n, "nft", "-f", &f]);
                    sh(&["ip", "-n", &n, "rule", "add", "fwmark", "0xae71", "lookup", "44657", "priority", "32000"]);
                    sh(&["ip", "-n", &n, "route", "add", "local", "0.0.0.0/0", "dev", "lo", "table", "44657"]);
                }),
            ),
            (
                "CHECK (nft list)",
                Box::new(move || sh(&["ip", "netns", "exec", &n2, "nft", "list", "table", "ip", "aether_capture"])),
            ),
            (
                "DEL",
                Box::new(move || {
                    sh(&["ip", "netns", "exec", &n3, "nft", "delete", "table", "ip", "aether_capture"]);
                    sh(&["ip", "-n", &n3, "rule", "del", "fwmark", "0xae71", "lookup", "44657", "priority", "32000"]);
                    sh(&["ip", "-n", &n3, "route", "del", "local", "0.0.0.0/0", "dev", "lo", "table", "44657"]);
                }),
            ),
        ];
        steps.into_iter().collect()
    }
}

impl Drop for ShellSteps {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.nft_file);
    }
}
