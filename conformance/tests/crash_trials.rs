//! Crash trials: the real binary is SIGKILLed at random moments of ADD, DEL, GC and
//! `services apply`, as a node losing power or an OOM killer would; then, as a runtime and
//! the agent would, the operation is retried, and every invariant is checked:
//!
//! - CHECK tells the truth right after the kill: it passes only if the table, the policy
//!   rule and route and the record are all there;
//! - node totals never go backwards, at the crash point or after, and after recovery they are
//!   exactly the connections the pods made (nothing lost, nothing counted twice);
//! - a retried DEL (or GC) cleans: no table, no rule, no record;
//! - a new ADD works (CHECK passes), every record parses, and `inspect` finds every layer
//!   intact.
//!
//! At least `AETHER_CRASH_KILLS` (default 100) kills; the counts are printed. The moments
//! are random (seed printed; `AETHER_CRASH_SEED` repeats a run). Root only.

mod common;

use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use aether_testkit::{root_or_skip, Rng, TestNetns};
use common::{bin, conf, run_plugin};
use serde_json::{json, Value};

struct Slot {
    ns: TestNetns,
    /// The container attached here, if any.
    pod: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    Add,
    Del,
    Gc,
    Apply,
}

const OPS: [Op; 4] = [Op::Add, Op::Del, Op::Gc, Op::Apply];

struct Node {
    conf: Value,
    state: String,
    slots: Vec<Slot>,
    generation: u64,
    /// Connections made from pods (each counted once by its Service layer).
    made: u64,
    /// The highest node total read so far.
    high: u64,
    next_port: u16,
    next_id: u64,
}

fn env<'a>(cmd: &'a str, id: &'a str, netns: Option<&'a str>) -> Vec<(&'a str, &'a str)> {
    let mut e = vec![
        ("CNI_COMMAND", cmd),
        ("CNI_CONTAINERID", id),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/opt/cni/bin"),
        ("CNI_ARGS", "K8S_POD_NAMESPACE=shop;K8S_POD_NAME=crash"),
    ];
    if let Some(n) = netns {
        e.push(("CNI_NETNS", n));
    }
    e
}

fn snapshot(generation: u64) -> Vec<u8> {
    let services: Vec<Value> = (0..(generation % 7) + 1)
        .map(|i| {
            json!({"namespace": "shop", "name": format!("s{i}"), "vip": format!("10.96.1.{}", i + 1),
                   "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": true})
        })
        .collect();
    serde_json::to_vec(&json!({"generation": generation, "mode": "count", "serviceRanges": ["10.96.0.0/16"],
        "services": services}))
    .unwrap()
}

impl Node {
    fn spawn(&self, op: Op, id: &str, netns: Option<&str>, valid: &[String]) -> Child {
        let (args, envs, stdin): (Vec<&str>, Vec<(&str, &str)>, Vec<u8>) = match op {
            Op::Apply => (vec!["services", "--state-dir", &self.state, "apply"], vec![], snapshot(self.generation)),
            Op::Gc => {
                let mut c = self.conf.clone();
                c["cni.dev/valid-attachments"] =
                    valid.iter().map(|id| json!({"containerID": id, "ifname": "eth0"})).collect();
                (vec![], env("GC", "", None), c.to_string().into_bytes())
            }
            Op::Add => (vec![], env("ADD", id, netns), self.conf.to_string().into_bytes()),
            Op::Del => (vec![], env("DEL", id, netns), self.conf.to_string().into_bytes()),
        };
        let mut child = Command::new(bin())
            .args(args)
            .env_clear()
            .envs(envs)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Small enough for the pipe: written whole before the plugin reads it.
        child.stdin.take().unwrap().write_all(&stdin).unwrap();
        child
    }

    /// Runs `op` to completion; panics with its output if it fails.
    fn complete(&self, op: Op, id: &str, netns: Option<&str>, valid: &[String]) {
        let out = self.spawn(op, id, netns, valid).wait_with_output().unwrap();
        assert!(out.status.success(), "{op:?} {id}: {}", String::from_utf8_lossy(&out.stdout));
    }

    fn total(&self) -> u64 {
        let out = Command::new(bin()).args(["services", "--state-dir", &self.state, "counters"]).output().unwrap();
        assert!(out.status.success(), "counters: {}", String::from_utf8_lossy(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["node"].as_object().unwrap().values().filter_map(Value::as_u64).sum()
    }

    /// Node totals never go backwards, and never exceed what was made.
    fn totals_hold(&mut self, when: &str) -> u64 {
        let t = self.total();
        assert!(t >= self.high, "{when}: node totals went backwards: {} -> {t}", self.high);
        assert!(t <= self.made, "{when}: node totals count {t} connections, only {} were made", self.made);
        self.high = t;
        t
    }

    fn traffic(&mut self, slot: usize) {
        let first = self.next_port;
        self.next_port += 3;
        aether_conformance::sock::in_netns(&self.slots[slot].ns.path(), || {
            for port in first..first + 3 {
                let to = std::net::SocketAddr::from(([192, 0, 2, 1], port));
                let _ = std::net::TcpStream::connect_timeout(&to, Duration::from_millis(200));
            }
        });
        self.made += 3;
    }

    fn has_record(&self, id: &str) -> bool {
        std::path::Path::new(&self.state).join(format!("attachments/k8s-pod-network+{id}+eth0.json")).exists()
    }

    /// CHECK passes exactly when everything ADD makes is there.
    fn check_tells_the_truth(&self, slot: usize, id: &str, when: &str) {
        let ns = &self.slots[slot].ns;
        let table = ns.exec("nft", &["list", "tables"]).contains("aether_capture");
        let rule = ns.exec("ip", &["rule"]).contains("0xae71");
        // (No route ever in the table: "FIB table does not exist", an error.)
        let route = ns.try_exec("ip", &["route", "show", "table", "44657"]).1.contains("local");
        let whole = table && rule && route && self.has_record(id);
        let out = run_plugin("CHECK", Some(&ns.path()), &self.conf, &[("CNI_CONTAINERID", id)]);
        assert_eq!(
            out.ok,
            whole,
            "{when}: CHECK says {} but table {table}, rule {rule}, route {route}, record {}: {}",
            out.ok,
            self.has_record(id),
            out.stdout
        );
    }

    fn is_clean(&self, slot: usize, id: &str, when: &str) {
        let ns = &self.slots[slot].ns;
        let tables = ns.exec("nft", &["list", "tables"]);
        assert!(tables.trim().is_empty(), "{when}: left in {}: {tables}", ns.name);
        assert!(!ns.exec("ip", &["rule"]).contains("0xae71"), "{when}: policy rule left in {}", ns.name);
        assert!(!self.has_record(id), "{when}: record of {id} left");
    }

    /// After recovery: every record parses, every layer is intact (`inspect`), every live
    /// pod's CHECK passes, every free slot is clean, and the totals are exact.
    fn settled(&mut self, when: &str) {
        for e in std::fs::read_dir(std::path::Path::new(&self.state).join("attachments")).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue; // a killed writer's temp file: GC's once its writer is gone a while
            }
            let v: Value = serde_json::from_slice(&std::fs::read(e.path()).unwrap())
                .unwrap_or_else(|err| panic!("{when}: record {name} does not parse: {err}"));
            assert_eq!(v["version"], 1, "{when}: {name}");
        }
        let out = Command::new(bin()).args(["inspect", "--state-dir", &self.state]).output().unwrap();
        assert!(out.status.success(), "{when}: inspect: {}", String::from_utf8_lossy(&out.stdout));
        // (inspect compared every live pod's capture and layer with its record.)
        for (i, s) in self.slots.iter().enumerate() {
            if s.pod.is_none() {
                self.is_clean(i, "-", when);
            }
        }
        let t = self.totals_hold(when);
        assert_eq!(t, self.made, "{when}: node totals {t}, connections made {}", self.made);
    }
}

#[test]
fn sigkill_at_random_moments_of_add_del_gc_and_apply_breaks_no_invariant() {
    if !root_or_skip("sigkill_at_random_moments_of_add_del_gc_and_apply_breaks_no_invariant") {
        return;
    }
    let want_kills: u64 = std::env::var("AETHER_CRASH_KILLS").ok().and_then(|v| v.parse().ok()).unwrap_or(100);
    let mut rng = Rng::seeded("AETHER_CRASH_SEED", "crash trials");
    let seed = rng.seed();
    let conf = conf("1.1.0", json!({}));
    let state = conf["stateDir"].as_str().unwrap().to_string();
    let slots: Vec<Slot> = (0..3)
        .map(|_| {
            let ns = TestNetns::new("crash");
            // Every connection leaves through lo: captured and counted inside the pod.
            ns.exec("ip", &["route", "add", "default", "dev", "lo"]);
            Slot { ns, pod: None }
        })
        .collect();
    let mut node = Node { conf, state, slots, generation: 1, made: 0, high: 0, next_port: 10_000, next_id: 0 };
    node.complete(Op::Apply, "", None, &[]);

    // How long each operation takes here: kills land anywhere in that span.
    let mut span = std::collections::BTreeMap::new();
    for op in OPS {
        let t = Instant::now();
        match op {
            Op::Add => node.complete(Op::Add, "warm", Some(&node.slots[0].ns.path()), &[]),
            Op::Del => node.complete(Op::Del, "warm", Some(&node.slots[0].ns.path()), &[]),
            Op::Gc => node.complete(Op::Gc, "", None, &[]),
            Op::Apply => {
                node.generation += 1;
                node.complete(Op::Apply, "", None, &[]);
            }
        }
        span.insert(format!("{op:?}"), t.elapsed().as_micros() as u64 + 1);
    }

    let (mut kills, mut finished, mut trials) =
        (std::collections::BTreeMap::new(), std::collections::BTreeMap::new(), 0u64);
    let started = Instant::now();
    while kills.values().sum::<u64>() < want_kills {
        trials += 1;
        assert!(trials < want_kills * 4, "too few kills landed: {kills:?} in {trials} trials");
        let live: Vec<usize> = (0..node.slots.len()).filter(|&i| node.slots[i].pod.is_some()).collect();
        let free: Vec<usize> = (0..node.slots.len()).filter(|&i| node.slots[i].pod.is_none()).collect();
        // DEL and ADD most often: their kills are the ones that can cost counts or leak.
        let weights = [Op::Add, Op::Add, Op::Add, Op::Del, Op::Del, Op::Del, Op::Del, Op::Gc, Op::Apply, Op::Apply];
        let op = match weights[rng.below(weights.len() as u64) as usize] {
            Op::Del | Op::Gc if live.is_empty() => Op::Add,
            Op::Add if free.is_empty() => Op::Del,
            other => other,
        };
        let when = format!("trial {trials} ({op:?}, seed {seed})");
        let slot = match op {
            Op::Add => free[rng.below(free.len() as u64) as usize],
            Op::Del | Op::Gc => live[rng.below(live.len() as u64) as usize],
            Op::Apply => 0,
        };
        let id = match op {
            Op::Add => {
                node.next_id += 1;
                format!("crash-{}", node.next_id)
            }
            _ => node.slots[slot].pod.clone().unwrap_or_default(),
        };
        if op == Op::Apply {
            node.generation += 1;
        }
        let path = node.slots[slot].ns.path();
        // GC: every live pod is valid but the victim.
        let valid: Vec<String> =
            node.slots.iter().filter_map(|s| s.pod.clone()).filter(|p| op != Op::Gc || *p != id).collect();
        let mut child = node.spawn(op, &id, Some(&path), &valid);
        std::thread::sleep(Duration::from_micros(rng.below(span[&format!("{op:?}")])));
        if child.try_wait().unwrap().is_some() {
            *finished.entry(format!("{op:?}")).or_insert(0u64) += 1;
        } else {
            child.kill().unwrap();
            *kills.entry(format!("{op:?}")).or_insert(0u64) += 1;
        }
        let _ = child.wait();

        // At the crash point.
        node.totals_hold(&format!("{when}, right after the kill"));
        if op == Op::Add || op == Op::Del {
            node.check_tells_the_truth(slot, &id, &format!("{when}, right after the kill"));
        }
        // Recovery, as a runtime or the agent does it.
        match op {
            Op::Add if rng.below(4) != 0 => {
                // The runtime retries the ADD: it works, and the pod gets traffic.
                node.complete(Op::Add, &id, Some(&path), &[]);
                node.slots[slot].pod = Some(id.clone());
                node.traffic(slot);
            }
            Op::Add | Op::Del => {
                // A failed ADD is cleaned with DEL; a killed DEL is retried.
                node.complete(Op::Del, &id, Some(&path), &[]);
                node.is_clean(slot, &id, &when);
                node.slots[slot].pod = None;
            }
            Op::Gc => {
                node.complete(Op::Gc, "", None, &valid);
                node.is_clean(slot, &id, &when);
                node.slots[slot].pod = None;
            }
            Op::Apply => node.complete(Op::Apply, "", None, &[]),
        }
        node.settled(&when);
    }
    let total_kills: u64 = kills.values().sum();
    println!(
        "crash trials: {trials} trials in {:.1} s (seed {seed}): {total_kills} SIGKILLs {kills:?}, finished before their kill {finished:?}; {} connections made and counted exactly, node totals never went backwards; every CHECK told the truth, every retried DEL/GC cleaned, every new ADD worked, every record parsed",
        started.elapsed().as_secs_f64(),
        node.made
    );
    for (i, s) in node.slots.iter().enumerate() {
        if let Some(id) = s.pod.clone() {
            node.complete(Op::Del, &id, Some(&s.ns.path()), &[]);
            node.is_clean(i, &id, "the end");
        }
    }
    let _ = std::fs::remove_dir_all(&node.state);
}
