//! `aether-cni-installer` (the built binary) under hostile load on its HTTP face, with a small
//! file-descriptor limit: a connection flood past the limit, accept errors (the limit
//! lowered below what it holds), half-open requests, huge request heads, many concurrent
//! scrapes. `/healthz` answers within 1 s during and after each, the process lives on with
//! its threads and RSS bounded, and back down afterwards. And the other side: if serving
//! ends (a failure injected into the accept loop), the process exits non-zero with the node
//! marked not ready, keeping the files.
//!
//! Traffic only to 127.0.0.1, bounded in count and time. Runs without root (the kernel
//! checks then fail: the node is not ready, which changes nothing here).

mod load;

use std::fs;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use load::{assert_answered, eventually, sample, usage, Usage};

/// Threads of an idle installer: main (waiting for signals), the reconcile loop, inotify,
/// the HTTP runtime, the pod reconciler's and the Service layer's applier (its socket); a
/// scrape adds the one blocking thread that reads the node counters, and its netns tour's
/// thread.
const IDLE_THREADS: u64 = 6;
const MAX_THREADS: u64 = IDLE_THREADS + 2;
/// What the load may add to the installer's RSS (connections are tasks with small buffers).
const MAX_RSS_GROWTH_KIB: u64 = 16 * 1024;

struct Installer {
    child: Child,
    root: PathBuf,
    probes: std::net::SocketAddr,
    metrics: std::net::SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
}

impl Installer {
    /// The installer on a fake node root of its own, its descriptors limited to `nofile`,
    /// probes and metrics on two loopback listeners; waits until it serves.
    fn start(tag: &str, nofile: u64, env: &[(&str, &str)]) -> Installer {
        let root = std::env::temp_dir().join(format!("aether-install-load-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        for d in ["bin", "net.d", "state"] {
            fs::create_dir_all(root.join(d)).unwrap();
        }
        let primaries = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/install/primaries");
        fs::copy(primaries.join("10-bridge.conf"), root.join("net.d/10-bridge.conf")).unwrap();
        let mut cmd = Command::new(aether_testkit::installer_bin());
        cmd.arg(format!("--cni-bin-dir={}", root.join("bin").display()))
            .arg(format!("--cni-conf-dir={}", root.join("net.d").display()))
            .arg(format!("--state-dir={}", root.join("state").display()))
            .args(["--host-ip=10.0.0.11", "--listen=127.0.0.1:0", "--metrics-listen=127.0.0.1:0"])
            // No periodic re-check during the test: it reads the installed binary back (its
            // size in RSS for a moment), which would blur what the load costs.
            .arg("--resync-seconds=3600")
            .envs(env.iter().copied())
            .env_remove("RUST_BACKTRACE")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let limit = libc::rlimit { rlim_cur: nofile, rlim_max: nofile };
        // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let (stderr, lines) = (child.stderr.take().unwrap(), log.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line.clone());
                let _ = tx.send(line);
            }
        });
        let (mut probes, mut metrics) = (None, None);
        let deadline = Instant::now() + Duration::from_secs(20);
        while probes.is_none() || metrics.is_none() {
            let line = rx
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .unwrap_or_else(|_| panic!("the installer says where it serves: {:?}", log.lock().unwrap()));
            let Some(rest) = line.split_once("serving ").map(|(_, r)| r) else { continue };
            let at = rest.split(" on ").nth(1).and_then(|a| a.split_whitespace().next()).map(load::addr);
            if rest.starts_with("/healthz") {
                probes = at;
            } else if rest.starts_with("/metrics") {
                metrics = at;
            }
        }
        let i = Installer { child, root, probes: probes.unwrap(), metrics: metrics.unwrap(), log };
        assert_answered(i.probes, "/healthz", "at start");
        i
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn usage(&self) -> Usage {
        usage(self.pid())
    }

    fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// The idle usage once the start-up's work is over: the first pass and the check its own
    /// writes trigger (which reads the installed binary back), a first scrape and its thread.
    fn settle(&self) -> Usage {
        let _ = self.metrics_text();
        let mut last = self.usage();
        let stable = eventually(Duration::from_secs(15), || {
            std::thread::sleep(Duration::from_millis(300));
            let now = self.usage();
            let settled = now.threads <= IDLE_THREADS && now.rss_kib.abs_diff(last.rss_kib) < 256;
            last = now;
            settled
        });
        assert!(stable, "an idle installer settles at most {IDLE_THREADS} threads and a steady RSS: {last:?}");
        last
    }

    /// Threads within `MAX_THREADS` and RSS within `MAX_RSS_GROWTH_KIB` of `idle`, while it runs.
    fn assert_bounded(&mut self, idle: Usage, when: &str) -> Usage {
        assert!(self.running(), "the installer died {when}:\n{}", self.log());
        let now = self.usage();
        assert!(now.threads <= MAX_THREADS, "{} threads {when} (at most {MAX_THREADS}): {now:?}", now.threads);
        assert!(
            now.rss_kib <= idle.rss_kib + MAX_RSS_GROWTH_KIB,
            "RSS {} KiB {when}, idle {} KiB (at most {} KiB more)",
            now.rss_kib,
            idle.rss_kib,
            MAX_RSS_GROWTH_KIB
        );
        now
    }

    /// After the load: probes answered, threads back to idle, RSS within its bound, every
    /// connection of the load closed.
    fn assert_back_down(&mut self, idle: Usage, what: &str) {
        assert_answered(self.probes, "/healthz", &format!("after {what}"));
        assert!(
            eventually(Duration::from_secs(10), || self.usage().threads <= IDLE_THREADS),
            "threads back to {IDLE_THREADS} after {what}: {:?}",
            self.usage()
        );
        self.assert_bounded(idle, &format!("after {what}"));
        assert!(
            eventually(Duration::from_secs(5), || self.open_connections() <= 1.0),
            "connections closed after {what}"
        );
    }

    fn metrics_text(&self) -> String {
        load::request(self.metrics, "/metrics", Duration::from_secs(10)).expect("a scrape").1
    }

    /// Open connections on both listeners, as the installer counts them (this scrape's own
    /// included).
    fn open_connections(&self) -> f64 {
        let m = self.metrics_text();
        ["probes", "metrics"]
            .iter()
            .map(|l| sample(&m, &format!("aether_cni_installer_http_connections{{listener=\"{l}\"}}")).unwrap())
            .sum()
    }
}

impl Drop for Installer {
    /// Ends its own child (by PID, through the handle) and removes the fake node.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// 128 descriptors: each listener's connection limit is then 32 (64 kept for the rest).
const NOFILE: u64 = 128;

#[test]
fn a_connection_flood_past_the_fd_limit_leaves_the_probes_answering() {
    let own = load::raise_own_fd_limit();
    let per_listener = 400.min((own as usize).saturating_sub(200) / 2);
    assert!(per_listener as u64 > NOFILE, "this process can hold more connections than the installer's limit");
    let mut i = Installer::start("flood", NOFILE, &[]);
    let idle = i.settle();

    // Past the descriptor limit on both listeners, held open.
    let flood_probes = load::idle_connections(i.probes, per_listener);
    let flood_metrics = load::idle_connections(i.metrics, per_listener);
    assert!(flood_probes.len() + flood_metrics.len() > NOFILE as usize, "the flood exceeds the limit");
    std::thread::sleep(Duration::from_millis(300)); // older than the eviction grace
    assert_answered(i.probes, "/healthz", "during a flood of idle connections");
    let ready = load::request(i.probes, "/readyz", load::PROBE_BOUND).expect("/readyz answered during the flood");
    assert!(ready.0 == 200 || ready.0 == 503, "{ready:?}");
    let scrape = assert_answered(i.metrics, "/metrics", "during the flood (metrics listener)");
    assert!(
        sample(&scrape, "aether_cni_installer_http_connections_limited_total{how=\"refused\",listener=\"metrics\"}")
            .is_some_and(|n| n > 0.0),
        "the excess was refused at once:\n{scrape}"
    );
    let during = i.assert_bounded(idle, "during the flood");
    assert!(during.fds < NOFILE as usize, "descriptors stay under the limit: {during:?}");
    // Every idle connection is closed by the installer: at once (the limit), to make room, or
    // when no request head has come within 5 s.
    let mut flood_probes = flood_probes;
    let closed = load::closed_by_server(&mut flood_probes, Duration::from_secs(10));
    assert_eq!(closed, flood_probes.len(), "idle connections closed by the installer");
    drop(flood_probes);
    drop(flood_metrics);
    i.assert_back_down(idle, "the flood");

    // Accept errors: the limit lowered under the installer's feet to just above what it holds
    // (as when the node runs out of descriptors): EMFILE on accept, logged at a bounded rate,
    // retried, and the oldest idle connection closed to make room for the probe.
    let held = i.usage().fds as u64;
    load::set_fd_limit(i.pid(), held + 3);
    let flood = load::idle_connections(i.probes, 200);
    std::thread::sleep(Duration::from_millis(300));
    for round in 0..3 {
        assert_answered(i.probes, "/healthz", &format!("while out of descriptors (round {round})"));
    }
    i.assert_bounded(idle, "while out of descriptors");
    drop(flood);
    load::set_fd_limit(i.pid(), NOFILE);
    i.assert_back_down(idle, "running out of descriptors");
    let m = i.metrics_text();
    assert!(
        sample(&m, "aether_cni_installer_http_accept_errors_total{listener=\"probes\"}").is_some_and(|n| n > 0.0),
        "accepts failed (EMFILE) and were counted:\n{m}"
    );
    let log = i.log();
    let lines = log.lines().filter(|l| l.contains("cannot accept an HTTP connection")).count();
    assert!((1..=2).contains(&lines), "accept errors logged once per 10 s, not once each ({lines} lines):\n{log}");
    assert!(log.contains("Too many open files"), "{log}");
}

#[test]
fn half_open_requests_and_huge_heads_are_cut_off() {
    load::raise_own_fd_limit();
    let mut i = Installer::start("half-open", NOFILE, &[]);
    let idle = i.settle();

    let mut half_open = load::half_open_requests(i.probes, 200);
    assert!(half_open.len() > 100, "{} half-open requests sent", half_open.len());
    std::thread::sleep(Duration::from_millis(300));
    assert_answered(i.probes, "/healthz", "during 200 half-open requests");
    i.assert_bounded(idle, "during 200 half-open requests");
    // Every one of them is closed by the server: at once (the limit), or when its head has
    // not arrived within 5 s.
    let closed = load::closed_by_server(&mut half_open, Duration::from_secs(10));
    assert_eq!(closed, half_open.len(), "half-open requests closed by the installer");
    drop(half_open);
    i.assert_back_down(idle, "the half-open requests");

    // 20 MiB heads, four at once: refused after the first 8 KiB (431), never read whole.
    let huge: Vec<_> = (0..4).map(|_| load::huge_head(i.probes, 20 << 20)).collect();
    std::thread::sleep(Duration::from_millis(100));
    assert_answered(i.probes, "/healthz", "while 20 MiB request heads arrive");
    i.assert_bounded(idle, "while 20 MiB request heads arrive");
    for h in huge {
        let code = h.join().unwrap();
        assert!(code.is_none() || code == Some(431), "a 20 MiB head: {code:?}");
    }
    i.assert_back_down(idle, "the huge heads");
}

#[test]
fn many_concurrent_scrapes_are_answered_and_never_hold_the_probes() {
    load::raise_own_fd_limit();
    let mut i = Installer::start("scrapes", 1024, &[]);
    let idle = i.settle();
    let metrics = i.metrics;
    let scrapes =
        std::thread::spawn(move || (0..5).flat_map(|_| load::concurrent_scrapes(metrics, 64)).collect::<Vec<_>>());
    while !scrapes.is_finished() {
        assert_answered(i.probes, "/healthz", "during 64 concurrent scrapes");
        i.assert_bounded(idle, "during 64 concurrent scrapes");
        std::thread::sleep(Duration::from_millis(10));
    }
    let outcomes = scrapes.join().unwrap();
    let answered = outcomes
        .iter()
        .filter(|o| o.as_ref().is_ok_and(|(c, b)| *c == 200 && b.contains("node_counters_up 1")))
        .count();
    assert_eq!(answered, outcomes.len(), "every scrape answered in full: {:?}", outcomes.iter().find(|o| o.is_err()));
    i.assert_back_down(idle, "the scrapes");
}

/// The negative control for "never half-alive": the accept loop fails (injected at its 3rd
/// connection), and the installer exits non-zero with the node marked not ready, the files
/// kept for the restarted installer. Without the injection, the same requests leave it
/// running (the exit is the fault's doing).
#[test]
fn serving_that_ends_makes_the_installer_exit_with_the_node_not_ready() {
    let mut control = Installer::start("serve-ok", NOFILE, &[]);
    for _ in 0..3 {
        assert_answered(control.probes, "/healthz", "control");
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(control.running(), "without the fault the installer keeps running:\n{}", control.log());
    drop(control);

    let mut i = Installer::start("serve-fails", NOFILE, &[("AETHER_INSTALLER_INJECT_SERVE_FAILURE", "3")]);
    assert_answered(i.probes, "/healthz", "before the fault"); // the 2nd connection
    let _ = load::request(i.probes, "/healthz", load::PROBE_BOUND); // the 3rd: the loop fails
    let mut status = None;
    assert!(
        eventually(Duration::from_secs(10), || {
            status = i.child.try_wait().unwrap();
            status.is_some()
        }),
        "the installer exits once serving ended (was the binary built with --features fault-injection? \
         make test builds it so):\n{}",
        i.log()
    );
    let status = status.unwrap();
    let log = i.log();
    assert!(!status.success(), "a non-zero exit: {status:?}\n{log}");
    assert!(log.contains("HTTP serving ended"), "{log}");
    let marker = fs::read_to_string(i.root.join("state/node-not-ready")).expect("the node is marked not ready");
    assert!(marker.contains("http: ") && marker.contains("accept loop"), "{marker}");
    assert!(i.root.join("net.d/00-aether-cni.conflist").exists(), "the chained file kept: pods keep their capture");
    assert!(i.root.join("bin/aether-cni").exists(), "the binary kept");
}
