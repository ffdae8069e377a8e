//! A process measured as a runtime or an agent runs it: wall time, CPU time (user + sys, the
//! kernel's work on its netlink messages included) and max RSS, from a small launcher process
//! (see `launch`); and the calling thread's CPU time. Shared by the benches that start the
//! plugin (`services_scale`, `release_before`).

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::services_doc::{median, ms};

/// A process's wall time, CPU time (user + sys), max RSS (KiB, from `wait4`), success and
/// stdout.
pub struct Ran {
    pub wall: Duration,
    pub cpu: Duration,
    pub max_rss_kib: i64,
    /// Until every process the plugin left behind ended (a Service layer built after the
    /// answer), and the CPU of all of them with the plugin's.
    pub settled: Duration,
    pub settled_cpu: Duration,
    pub ok: bool,
    pub stdout: String,
}

impl Ran {
    pub fn sample(&self) -> Sample {
        Sample {
            wall_ms: ms(self.wall),
            cpu_ms: ms(self.cpu),
            rss_mib: self.max_rss_kib as f64 / 1024.0,
            settled_ms: ms(self.settled),
            settled_cpu_ms: ms(self.settled_cpu),
        }
    }
}

/// One measure: wall and CPU milliseconds, max RSS (0 when not measured).
#[derive(Clone, Copy, Default)]
pub struct Sample {
    pub wall_ms: f64,
    pub cpu_ms: f64,
    pub rss_mib: f64,
    pub settled_ms: f64,
    pub settled_cpu_ms: f64,
}

/// The median of each field.
pub fn medians(v: Vec<Sample>) -> Sample {
    Sample {
        wall_ms: median(v.iter().map(|s| s.wall_ms).collect()),
        cpu_ms: median(v.iter().map(|s| s.cpu_ms).collect()),
        rss_mib: median(v.iter().map(|s| s.rss_mib).collect()),
        settled_ms: median(v.iter().map(|s| s.settled_ms).collect()),
        settled_cpu_ms: median(v.iter().map(|s| s.settled_cpu_ms).collect()),
    }
}

/// The first argument that makes this program a launcher (see `launch`).
pub const LAUNCH: &str = "--launch-measured";

/// Runs `args[0]` (a binary) with `args[1..]` and its stdio inherited, reaps it with `wait4`, and prints its wall time
/// (ns), max RSS (KiB) and exit status as the last line on stderr. A process inherits the
/// peak RSS of the process that spawned it (Linux keeps the high-water mark across exec), so
/// the plugin is started from this small, fresh process, not from the bench, whose peak is
/// tens of MB.
#[allow(clippy::zombie_processes)]
pub fn launch(args: &[String]) -> ! {
    // What the plugin leaves running after its answer (ADD's child building a large Service
    // layer) is reparented here, and its end and CPU are measured too.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let t = Instant::now();
    let child = Command::new(&args[0]).args(&args[1..]).spawn().unwrap();
    let mut status = 0;
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    let wall = t.elapsed();
    assert_eq!(pid, child.id() as i32, "wait4");
    let ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    let tv = |t: libc::timeval| t.tv_sec as u128 * 1_000_000_000 + t.tv_usec as u128 * 1000;
    let cpu = tv(usage.ru_utime) + tv(usage.ru_stime);
    let (mut settled, mut settled_cpu) = (wall, cpu);
    loop {
        let mut left: libc::rusage = unsafe { std::mem::zeroed() };
        if unsafe { libc::wait4(-1, &mut status, 0, &mut left) } <= 0 {
            break;
        }
        (settled, settled_cpu) = (t.elapsed(), settled_cpu + tv(left.ru_utime) + tv(left.ru_stime));
    }
    eprintln!(
        "\n{LAUNCH} {} {} {} {cpu} {} {settled_cpu}",
        wall.as_nanos(),
        usage.ru_maxrss,
        ok as u8,
        settled.as_nanos()
    );
    std::process::exit(0)
}

/// `bin args`, `env` its whole environment and `stdin` its input, started by a launcher (this
/// program again with `LAUNCH`, whose `main` calls `launch`): its wall time, CPU time, max RSS,
/// success and stdout.
pub fn run(bin: &str, args: &[&str], env: &[(&str, &str)], stdin: &[u8]) -> Ran {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .arg(LAUNCH)
        .arg(bin)
        .args(args)
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    let feed = std::thread::scope(|s| {
        let feeder = s.spawn(move || input.write_all(stdin));
        let mut stdout = String::new();
        child.stdout.take().unwrap().read_to_string(&mut stdout).unwrap();
        let mut stderr = String::new();
        child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
        let _ = feeder.join();
        (stdout, stderr)
    });
    assert!(child.wait().unwrap().success(), "the launcher failed: {}", feed.1);
    let last = feed.1.lines().last().unwrap_or_default();
    let f: Vec<&str> =
        last.strip_prefix(LAUNCH).unwrap_or_else(|| panic!("no measure in {last:?}")).split_whitespace().collect();
    let ok = f[2] == "1";
    if !ok {
        eprintln!("{args:?} failed:\n{}\n{}", feed.0, feed.1);
    }
    Ran {
        wall: Duration::from_nanos(f[0].parse().unwrap()),
        cpu: Duration::from_nanos(f[3].parse().unwrap()),
        max_rss_kib: f[1].parse().unwrap(),
        settled: Duration::from_nanos(f[4].parse().unwrap()),
        settled_cpu: Duration::from_nanos(f[5].parse().unwrap()),
        ok,
        stdout: feed.0,
    }
}

/// CPU time of the calling thread.
pub fn thread_cpu() -> Duration {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// The network configuration of the benches' pods, the plugin's state directory `state`.
pub fn conf(state: &Path) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "cniVersion": "1.0.0", "name": "bench-scale", "type": "aether-cni", "stateDir": state,
        "hostIP": "10.0.0.1",
        "prevResult": {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/x"}],
                       "ips": [{"address": "10.244.1.5/24", "interface": 0}]}
    }))
    .unwrap()
}

/// CNI `command` of the plugin `bin` for the pod `id` in `netns`, as a runtime runs it (`conf`
/// on stdin, the CNI environment alone), measured by `run`; its success asserted.
pub fn cni(bin: &str, command: &str, state: &Path, netns: &str, id: &str) -> Ran {
    let env = [
        ("CNI_COMMAND", command),
        ("CNI_CONTAINERID", id),
        ("CNI_NETNS", netns),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/opt/cni/bin"),
        ("CNI_ARGS", "K8S_POD_NAMESPACE=bench;K8S_POD_NAME=pod"),
    ];
    let r = run(bin, &[], &env, &conf(state));
    assert!(r.ok, "CNI {command}");
    r
}
