//! `make soak`: pod churn against the real binary, as a node lives it. PODS pods are ADDed,
//! make CONNS connections each, are CHECKed and DELed, over and over in parallel, while the
//! agent applies a new Service snapshot every round and a reader polls the node counters.
//! Then: no failure, nothing left behind (no table, policy rule or record in any pod), the
//! node totals never went backwards while pods came and went, and they end at exactly
//! PODS x CONNS x rounds. Bounded in rounds and time. Traffic stays inside each pod netns:
//! its default route is `lo`, so a connection is captured, counted and refused locally.
//! Root only.

use std::time::{Duration, Instant};

use aether_conformance::cni::{run_cli, run_here};
use aether_testkit::TestNetns;
use serde_json::{json, Value};

const PODS: usize = 20;
const CONNS: u16 = 3;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn snapshot(generation: u64) -> Vec<u8> {
    // A Service more each round: element-only updates, with a mode change every 10th.
    let services: Vec<Value> = (0..(generation % 50) + 1)
        .map(|i| {
            json!({"namespace": "shop", "name": format!("s{i}"), "vip": format!("10.96.1.{}", i + 1),
            "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": true})
        })
        .collect();
    let mode = if generation.is_multiple_of(10) { "refuse" } else { "count" };
    serde_json::to_vec(&json!({"generation": generation, "mode": mode, "serviceRanges": ["10.96.0.0/16"],
        "meshVIPs": [], "services": services}))
    .unwrap()
}

fn main() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("make soak needs root (it creates its own network namespaces)");
        std::process::exit(1);
    }
    let rounds = env_u64("AETHER_SOAK_ROUNDS", 50);
    let budget = Duration::from_secs(env_u64("AETHER_SOAK_SECONDS", 300));
    let state = std::env::temp_dir().join(format!("aether-soak-{}", std::process::id()));
    let state_s = state.display().to_string();
    let pods: Vec<TestNetns> = (0..PODS).map(|_| TestNetns::new("soak")).collect();
    for ns in &pods {
        ns.exec("ip", &["route", "add", "default", "dev", "lo"]);
    }
    let stop_polling = std::sync::atomic::AtomicBool::new(false);
    // The agent has a snapshot before the first pod: every ADD then gets a layer, so every
    // connection is counted.
    let first = run_cli("/proc/self/ns/net", &["services", "--state-dir", &state_s, "apply"], &snapshot(1));
    assert!(first.ok, "first apply: {}", first.stderr);
    let conf = json!({
        "cniVersion": "1.1.0", "name": "soak", "type": "aether-cni", "hostIP": "10.0.0.1", "stateDir": state_s,
        "capabilities": {"io.kubernetes.cri.pod-annotations": true},
        "prevResult": {"cniVersion": "1.1.0", "ips": [{"address": "10.244.1.5/24"}]}
    });
    let started = Instant::now();
    let (mut ops, mut failures, mut latencies) = (0u64, Vec::<String>::new(), Vec::<Duration>::new());
    let mut done_rounds = 0;
    let total = |out: &aether_conformance::Outcome| -> Option<u64> {
        let v: Value = serde_json::from_str(&out.stdout).ok()?;
        v["node"].as_object().map(|m| m.values().filter_map(Value::as_u64).sum())
    };
    let polled: Vec<u64> = std::thread::scope(|outer| {
        let poller = outer.spawn(|| {
            let mut seen = Vec::new();
            while !stop_polling.load(std::sync::atomic::Ordering::SeqCst) {
                let out = run_cli("/proc/self/ns/net", &["services", "--state-dir", &state_s, "counters"], b"");
                if let Some(t) = total(&out) {
                    seen.push(t);
                }
            }
            seen
        });
        for round in 1..=rounds {
            if started.elapsed() > budget {
                break;
            }
            let results: Vec<(Vec<Duration>, Vec<String>)> = std::thread::scope(|s| {
                let agent = s.spawn(|| {
                    let t = Instant::now();
                    let out = run_cli(
                        "/proc/self/ns/net",
                        &["services", "--state-dir", &state_s, "apply"],
                        &snapshot(round + 1),
                    );
                    (vec![t.elapsed()], if out.ok { vec![] } else { vec![format!("apply {round}: {}", out.stderr)] })
                });
                let workers: Vec<_> = pods
                    .iter()
                    .enumerate()
                    .map(|(i, ns)| {
                        let conf = &conf;
                        s.spawn(move || {
                            let id = format!("soak-{i}");
                            let path = ns.path();
                            let (mut lat, mut errs) = (Vec::new(), Vec::new());
                            for cmd in ["ADD", "traffic", "CHECK", "DEL"] {
                                if cmd == "traffic" {
                                    aether_conformance::sock::in_netns(&path, || {
                                        // A destination port new in every round: a new
                                        // socket reusing the 4-tuple of an unanswered SYN
                                        // conntrack still tracks is the same flow to the
                                        // kernel, and is (rightly) not counted again.
                                        for k in 1..=CONNS {
                                            // (From 10000: port 53 is DNS, never counted.)
                                            let port = 10_000 + (round as u16 - 1) * CONNS + k;
                                            let to = std::net::SocketAddr::from(([192, 0, 2, 1], port));
                                            let _ =
                                                std::net::TcpStream::connect_timeout(&to, Duration::from_millis(200));
                                        }
                                    });
                                    continue;
                                }
                                let env = [
                                    ("CNI_COMMAND", cmd),
                                    ("CNI_CONTAINERID", id.as_str()),
                                    ("CNI_NETNS", path.as_str()),
                                    ("CNI_IFNAME", "eth0"),
                                    ("CNI_ARGS", "K8S_POD_NAMESPACE=shop;K8S_POD_NAME=soak"),
                                ];
                                let t = Instant::now();
                                let out = run_here(&env, conf);
                                lat.push(t.elapsed());
                                if !out.ok {
                                    errs.push(format!("round {round} {cmd} {id}: {}", out.stdout.trim()));
                                }
                            }
                            (lat, errs)
                        })
                    })
                    .collect();
                let mut all: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
                all.push(agent.join().unwrap());
                all
            });
            for (lat, errs) in results {
                ops += lat.len() as u64;
                latencies.extend(lat);
                failures.extend(errs);
            }
            done_rounds = round;
        }
        stop_polling.store(true, std::sync::atomic::Ordering::SeqCst);
        poller.join().unwrap()
    });
    let elapsed = started.elapsed();
    // The node must be clean.
    let mut leaks = Vec::new();
    for ns in &pods {
        let tables = ns.exec("nft", &["list", "tables"]);
        if !tables.trim().is_empty() {
            leaks.push(format!("{}: {}", ns.name, tables.trim()));
        }
        if ns.exec("ip", &["rule"]).contains("0xae71") {
            leaks.push(format!("{}: policy rule left", ns.name));
        }
    }
    let records = std::fs::read_dir(state.join("attachments")).map(|d| d.count()).unwrap_or(0);
    if records != 0 {
        leaks.push(format!("{records} attachment records left"));
    }
    let counters = run_cli("/proc/self/ns/net", &["services", "--state-dir", &state_s, "counters"], b"");
    let final_total = total(&counters);
    let expected_total = (PODS as u64) * u64::from(CONNS) * done_rounds;
    let dips = polled.windows(2).filter(|w| w[1] < w[0]).count();
    let _ = std::fs::remove_dir_all(&state);

    latencies.sort();
    let pct = |p: usize| latencies.get(latencies.len() * p / 100).copied().unwrap_or_default().as_secs_f64() * 1e3;
    println!("churn: {PODS} pods x {done_rounds} rounds of ADD + CHECK + DEL, one services apply per round");
    println!(
        "  operations       {ops} in {:.1} s ({:.0}/s)",
        elapsed.as_secs_f64(),
        ops as f64 / elapsed.as_secs_f64()
    );
    println!(
        "  latency          p50 {:.1} ms  p90 {:.1} ms  p99 {:.1} ms  max {:.1} ms",
        pct(50),
        pct(90),
        pct(99),
        latencies.last().copied().unwrap_or_default().as_secs_f64() * 1e3
    );
    println!("  failures         {}", failures.len());
    for f in failures.iter().take(10) {
        println!("    {f}");
    }
    println!("  left behind      {}", if leaks.is_empty() { "nothing".to_string() } else { leaks.join("; ") });
    println!(
        "  node totals      {} read while churning, {dips} went backwards; final {}, expected {expected_total}",
        polled.len(),
        final_total.map_or_else(|| "unreadable".to_string(), |t| t.to_string())
    );
    let ok = failures.is_empty() && leaks.is_empty() && dips == 0 && final_total == Some(expected_total);
    // exit() skips destructors: the pods' namespaces go first.
    drop(pods);
    if !ok {
        std::process::exit(1);
    }
}
