use super::*;
use crate::state::{Record, StateDir};
use aether_netns::Netns;
use aether_rules::services as layer;
use aether_testkit::{root_or_skip, TestNetns};
use serde_json::json;

/// What `<stateDir>/services` holds, and what an apply's visit checks of a pod's record.
mod state_files;

pub(super) fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("aether-svcu-{tag}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    d
}

/// A stored layer at `generation` holding one Service of `port` (mode `mode`): for the
/// plan's and the engine's tables.
pub(super) fn stored_layer(generation: u64, mode: layer::LayerMode, port: u16) -> StoredLayer {
    let mut l = layer::ServiceLayer::new(mode);
    l.ranges = vec!["10.96.0.0/16".parse().unwrap()];
    l.ports = vec![layer::ServicePort {
        vip: "10.96.1.1".parse().unwrap(),
        proto: aether_rules::model::Proto::Tcp,
        port,
        has_endpoints: true,
    }];
    StoredLayer::new(generation, &l, 0)
}

pub(super) fn rec(cid: &str, netns: &str) -> Record {
    Record::bare(cid, netns)
}

/// A snapshot whose content tells its generation apart (one Service port per generation).
pub(super) fn doc(generation: u64) -> Vec<u8> {
    json!({
        "generation": generation,
        "mode": "count",
        "serviceRanges": ["10.96.0.0/16"],
        "services": [{"namespace": "n", "name": "s", "vip": "10.96.1.1",
                      "ports": [{"protocol": "TCP", "port": 1000 + generation}], "usableEndpoints": true}]
    })
    .to_string()
    .into_bytes()
}

/// The stored document with only its generation changed is taken as the stored content
/// (not read again), and only then: any other difference, a damaged or swapped
/// `snapshot.json`, an unknown member, a generation that is not one, gets a full reading.
#[test]
fn a_new_generation_of_the_stored_document_is_recognised_by_its_bytes_and_nothing_else() {
    let state = tmp("regen");
    let dir = ServicesDir::new(&state);
    let regen = |text: &[u8], from: u64, to: &str| {
        let text = String::from_utf8(text.to_vec()).unwrap();
        let g = format!("\"generation\":{from},");
        assert!(text.contains(&g), "{text}");
        text.replacen(&g, &format!("\"generation\":{to},"), 1).into_bytes()
    };
    let port = |dir: &ServicesDir| dir.stored_layer().unwrap().unwrap().layer.ports[0].port;
    let first = doc(1);
    apply_document(&dir, &first).unwrap();
    // Which reading was used shows when `layer.bin` (which says it was made from `first`)
    // holds another layer than `first` does: the bytes path takes `layer.bin`'s.
    let mut planted = snapshot::parse(&doc(7)).unwrap().layer(0);
    planted.ports[0].port = 4242;
    let source = layer_file::source_digest(&first);
    dir.write_atomic("layer.bin", &StoredLayer::new(1, &planted, source).encode()).unwrap();
    let second = regen(&first, 1, "2");
    assert_eq!(apply_document(&dir, &second).unwrap().generation, 2);
    let stored = dir.stored_layer().unwrap().unwrap();
    assert_eq!((stored.generation, port(&dir)), (2, 4242), "taken by its bytes");
    assert_eq!(fs::read(state.join("services/snapshot.json")).unwrap(), second);
    // Control: another difference besides the generation is read in full.
    let third = String::from_utf8(regen(&second, 2, "3")).unwrap().replace("1001", "1999").into_bytes();
    apply_document(&dir, &third).unwrap();
    assert_eq!(port(&dir), 1999, "read in full");
    // Refused as a full reading refuses them: an unknown member, a generation of 0 or
    // not a whole number.
    let unknown = String::from_utf8(regen(&third, 3, "4")).unwrap().replacen('{', "{\"x\":1,", 1).into_bytes();
    assert!(apply_document(&dir, &unknown).unwrap_err().reasons()[0].contains("x: unknown field"));
    for bad in ["0", "4.0"] {
        let e = apply_document(&dir, &regen(&third, 3, bad)).unwrap_err();
        assert!(e.reasons().iter().any(|e| e.contains("generation")), "{bad}: {e:?}");
    }
    // A leading zero is not JSON: not taken for the stored content by its bytes either.
    let e = apply_document(&dir, &regen(&third, 3, "04")).unwrap_err();
    assert!(e.reasons()[0].contains("invalid number"), "{e:?}");
    assert_eq!(dir.stored_layer().unwrap().unwrap().generation, 3);
    // A `snapshot.json` that is not what `layer.bin` was made from (a crash between the
    // two writes, which comes after `snapshot.source` is removed), even at the same
    // generation, is never trusted: the new generation of it is read in full.
    fs::remove_file(state.join("services/snapshot.source")).unwrap();
    dir.write_atomic("snapshot.json", &doc(3)).unwrap();
    apply_document(&dir, &regen(&doc(3), 3, "6")).unwrap();
    assert_eq!((dir.stored_layer().unwrap().unwrap().generation, port(&dir)), (6, 1003));
    let _ = fs::remove_dir_all(&state);
}

/// An apply racing with ADDs ends with every pod at the newest generation.
/// Generations 2..=21 applied by 20 threads at once. They race each other too: one older
/// than the stored generation is refused, as it must be.
fn spawn_racing_applies<'s>(s: &'s std::thread::Scope<'s, '_>, state: &Path) {
    for g in 2..=21u64 {
        let dir = ServicesDir::new(state);
        s.spawn(move || {
            if let Err(e) = apply_document(&dir, &doc(g)) {
                assert!(e.reasons()[0].contains("is older than the stored generation"), "{e:?}");
            }
        });
    }
}

/// 50 parallel ADDs (record, then `apply_current_snapshot_in_netns`) against 20 applies.
#[test]
fn parallel_adds_and_applies_leave_every_pod_at_the_newest_generation() {
    if !root_or_skip("parallel_adds_and_applies_leave_every_pod_at_the_newest_generation") {
        return;
    }
    let state = tmp("race");
    let dir = ServicesDir::new(&state);
    apply_document(&dir, &doc(1)).unwrap();
    let netns: Vec<TestNetns> = (0..50).map(|_| TestNetns::new("svc-race")).collect();
    std::thread::scope(|s| {
        for (i, ns) in netns.iter().enumerate() {
            let state = state.clone();
            s.spawn(move || {
                // As ADD does it: the pod's netns lock held over the record and the layer.
                let n = Netns::open_foreign(ns.path()).unwrap();
                let _pod = n.lock().unwrap();
                StateDir::new(&state).write(&rec(&format!("c{i}"), &ns.path())).unwrap();
                apply_current_snapshot_in_netns(&state, &n, 0xae71).unwrap();
            });
        }
        spawn_racing_applies(s, &state);
    });
    let newest = dir.stored_layer().unwrap().unwrap();
    assert_eq!(newest.generation, 21);
    let l = newest.for_pod(0xae71);
    for ns in &netns {
        let diffs = Netns::open_foreign(ns.path()).unwrap().run(|| layer::verify(&l)).unwrap().unwrap();
        assert!(diffs.is_empty(), "{}: {diffs:#?}", ns.name);
    }
    let _ = fs::remove_dir_all(&state);
}

/// 50 parallel DELs (`retire_layer` forgetting the record) against 20 applies: no apply
/// re-creates a layer in a pod that is being deleted.
#[test]
fn parallel_dels_and_applies_leave_no_layer_behind() {
    if !root_or_skip("parallel_dels_and_applies_leave_no_layer_behind") {
        return;
    }
    let state = tmp("delrace");
    let dir = ServicesDir::new(&state);
    apply_document(&dir, &doc(1)).unwrap();
    let netns: Vec<TestNetns> = (0..50).map(|_| TestNetns::new("svc-delrace")).collect();
    for (i, ns) in netns.iter().enumerate() {
        StateDir::new(&state).write(&rec(&format!("c{i}"), &ns.path())).unwrap();
        let n = Netns::open_foreign(ns.path()).unwrap();
        apply_current_snapshot_in_netns(&state, &n, 0xae71).unwrap();
    }
    std::thread::scope(|s| {
        for (i, ns) in netns.iter().enumerate() {
            let state = state.clone();
            s.spawn(move || {
                // As DEL does it: the pod's netns lock held until the record is forgotten.
                let n = Netns::open_foreign(ns.path()).unwrap();
                let _pod = n.lock().unwrap();
                let forget = || StateDir::new(&state).remove("k8s-pod-network", &format!("c{i}"), "eth0");
                let retired = retire_layer(&state, Some(&n), &format!("k8s-pod-network/c{i}/eth0"), forget).unwrap();
                assert!(retired.warnings.is_empty(), "{:?}", retired.warnings);
            });
        }
        spawn_racing_applies(s, &state);
    });
    for ns in &netns {
        let left = Netns::open_foreign(ns.path()).unwrap().run(layer::counters).unwrap().unwrap();
        assert!(left.is_none(), "{}: an apply re-created the layer of a deleted pod", ns.name);
    }
    assert!(StateDir::new(&state).records().is_empty());
    let _ = fs::remove_dir_all(&state);
}

/// ADD and DEL of a pod take no lock of the node's: with an apply holding the services lock
/// (as for the whole of its tour of the pods), a pod's ADD and then its DEL still finish.
/// Made to wait (each on a thread of its own), the test fails instead of hanging.
#[test]
fn add_and_del_finish_while_an_apply_holds_the_services_lock() {
    if !root_or_skip("add_and_del_finish_while_an_apply_holds_the_services_lock") {
        return;
    }
    let state = tmp("nowait");
    let dir = ServicesDir::new(&state);
    apply_document(&dir, &doc(1)).unwrap();
    let ns = TestNetns::new("svc-nowait");
    let apply_lock = dir.lock(true).unwrap();
    let path = ns.path();
    let finished = |work: Box<dyn FnOnce() + Send>| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            work();
            let _ = tx.send(());
        });
        // Not a timing: a bound on a wait that, were it a lock's, would never end.
        rx.recv_timeout(std::time::Duration::from_secs(60)).is_ok()
    };
    let (s, p) = (state.clone(), path.clone());
    let added = finished(Box::new(move || {
        let n = Netns::open_foreign(&p).unwrap();
        let _pod = n.lock().unwrap();
        StateDir::new(&s).write(&rec("c0", &p)).unwrap();
        assert_eq!(apply_current_snapshot_in_netns(&s, &n, 0xae71).unwrap(), Some(1));
    }));
    assert!(added, "ADD waited for the apply's lock");
    let (s, p) = (state.clone(), path.clone());
    let deleted = finished(Box::new(move || {
        let n = Netns::open_foreign(&p).unwrap();
        let _pod = n.lock().unwrap();
        let forget = || StateDir::new(&s).remove("k8s-pod-network", "c0", "eth0");
        let retired = retire_layer(&s, Some(&n), "k8s-pod-network/c0/eth0", forget).unwrap();
        assert!(retired.warnings.is_empty(), "{:?}", retired.warnings);
    }));
    assert!(deleted, "DEL waited for the apply's lock");
    drop(apply_lock);
    let left = Netns::open_foreign(&path).unwrap().run(layer::counters).unwrap().unwrap();
    assert!(left.is_none(), "DEL removed the layer ADD made");
    let _ = fs::remove_dir_all(&state);
}

/// Node totals read while pods are deleted one after another never dip: a pod is counted
/// in its own row or in the accumulator, never in neither.
#[test]
fn node_totals_never_dip_while_pods_are_deleted() {
    if !root_or_skip("node_totals_never_dip_while_pods_are_deleted") {
        return;
    }
    let state = tmp("dip");
    let dir = ServicesDir::new(&state);
    apply_document(&dir, &doc(1)).unwrap();
    let pods: Vec<TestNetns> = (0..8).map(|_| TestNetns::new("svc-dip")).collect();
    for (i, ns) in pods.iter().enumerate() {
        StateDir::new(&state).write(&rec(&format!("d{i}"), &ns.path())).unwrap();
        let n = Netns::open_foreign(ns.path()).unwrap();
        apply_current_snapshot_in_netns(&state, &n, 0xae71).unwrap();
        // Every packet leaves through lo, marked as capture would mark it: each
        // connection to an external address counts once.
        ns.exec("ip", &["route", "add", "default", "dev", "lo"]);
        let path = std::env::temp_dir().join(format!("{}.nft", ns.name));
        fs::write(&path, "table ip standin {\n\tchain out {\n\t\ttype route hook output priority -150; policy accept;\n\t\tmeta l4proto tcp meta mark set 0xae71\n\t}\n}\n").unwrap();
        ns.exec("nft", &["-f", path.to_str().unwrap()]);
        let _ = fs::remove_file(&path);
        n.run(|| {
            for port in 1..=5 {
                let addr = std::net::SocketAddr::from(([192, 0, 2, 1], port));
                let _ = std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_millis(50));
            }
        })
        .unwrap();
    }
    let full = node_counters(&dir).unwrap().totals["external"];
    assert_eq!(full, 40, "8 pods x 5 connections");
    let done = std::sync::atomic::AtomicBool::new(false);
    let samples = std::thread::scope(|s| {
        let poller = s.spawn(|| {
            let mut seen = Vec::new();
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                seen.push(node_counters(&ServicesDir::new(&state)).unwrap().totals["external"]);
            }
            seen
        });
        for (i, ns) in pods.iter().enumerate() {
            let n = Netns::open_foreign(ns.path()).unwrap();
            retire_layer(&state, Some(&n), &format!("k8s-pod-network/d{i}/eth0"), || {
                StateDir::new(&state).remove("k8s-pod-network", &format!("d{i}"), "eth0")
            })
            .unwrap();
        }
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        poller.join().unwrap()
    });
    assert!(!samples.is_empty());
    assert!(samples.iter().all(|&v| v == full), "node totals dipped while pods were deleted: {samples:?}");
    assert_eq!(node_counters(&dir).unwrap().totals["external"], full);
    let _ = fs::remove_dir_all(&state);
}

/// Counters survive pod churn: ADD, traffic, DEL; the node total still includes it, and a
/// repeated DEL does not count it twice.
#[test]
fn del_folds_final_counts_into_the_node_total() {
    if !root_or_skip("del_folds_final_counts_into_the_node_total") {
        return;
    }
    let state = tmp("fold");
    let dir = ServicesDir::new(&state);
    apply_document(&dir, &doc(1)).unwrap();
    let ns = TestNetns::new("svc-fold");
    StateDir::new(&state).write(&rec("f", &ns.path())).unwrap();
    let n = Netns::open_foreign(ns.path()).unwrap();
    assert_eq!(apply_current_snapshot_in_netns(&state, &n, 0xae71).unwrap(), Some(1));
    ns.exec("ip", &["link", "add", "d0", "type", "veth", "peer", "name", "d1"]);
    ns.exec("ip", &["link", "set", "d1", "up"]);
    ns.exec("ip", &["addr", "add", "10.244.9.2/24", "dev", "d0"]);
    ns.exec("ip", &["link", "set", "d0", "up"]);
    ns.exec("ip", &["route", "add", "default", "dev", "d0"]);
    // Stand-in for capture's divert decision (marks TCP; no policy route).
    let path = std::env::temp_dir().join(format!("{}.nft", ns.name));
    fs::write(&path, "table ip standin {\n\tchain out {\n\t\ttype route hook output priority -150; policy accept;\n\t\tmeta l4proto tcp meta mark set 0xae71\n\t}\n}\n").unwrap();
    ns.exec("nft", &["-f", path.to_str().unwrap()]);
    let _ = fs::remove_file(&path);
    n.run(|| {
        for addr in ["10.96.1.1:1001", "10.96.7.7:80", "192.0.2.1:80"] {
            let _ = std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), std::time::Duration::from_millis(50));
        }
    })
    .unwrap();
    let before = node_counters(&dir).unwrap().totals;
    assert_eq!((before["service"], before["refused_no_service"], before["external"]), (1, 1, 1), "{before:?}");
    let forget = || StateDir::new(&state).remove("k8s-pod-network", "f", "eth0");
    let retired = retire_layer(&state, Some(&n), "k8s-pod-network/f/eth0", forget).unwrap();
    assert_eq!(retired.folded["service"], 1);
    assert!(retired.warnings.is_empty(), "{:?}", retired.warnings);
    assert!(StateDir::new(&state).records().is_empty(), "the record is forgotten under the lock");
    assert_eq!(node_counters(&dir).unwrap().totals, before, "node totals went backwards");
    // DEL again (and DEL after the netns is gone): nothing counted twice.
    assert!(retire_layer(&state, Some(&n), "k8s-pod-network/f/eth0", || Ok::<(), crate::state::StateError>(()))
        .unwrap()
        .folded
        .is_empty());
    drop(n);
    drop(ns);
    assert!(retire_layer(&state, None, "k8s-pod-network/f/eth0", || Ok::<(), crate::state::StateError>(()))
        .unwrap()
        .folded
        .is_empty());
    assert_eq!(node_counters(&dir).unwrap().totals, before);
    let _ = fs::remove_dir_all(&state);
}

/// A pod's file reads back as written, with and without the applier's run of generations;
/// a torn or extended line is no file (a rebuild).
#[test]
fn narrowed_cuts_every_port_of_a_differing_vip_and_nothing_else() {
    use aether_rules::model::Proto;
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move |m: u64| {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % m
    };
    let vip = |i: u64| -> IpAddr {
        if i.is_multiple_of(2) {
            IpAddr::V4(Ipv4Addr::from(0x0a60_0000 + i as u32))
        } else {
            IpAddr::V6(Ipv6Addr::from(0xfd00_0000_0000_0000_0000_0000_0000_0000u128 + u128::from(i)))
        }
    };
    let (mut flips, mut hinted) = (0, 0);
    for round in 0..200 {
        let mut old = Vec::new();
        for i in 0..40 {
            for k in 0..1 + next(4) {
                let proto = if k % 2 == 0 { Proto::Tcp } else { Proto::Udp };
                old.push(layer::ServicePort { vip: vip(i), proto, port: 80 + k as u16, has_endpoints: true });
            }
        }
        let mut new = old.clone();
        for _ in 0..1 + next(3) {
            match next(4) {
                0 => {
                    let at = next(new.len() as u64) as usize;
                    new.remove(at);
                }
                1 => {
                    let at = next(new.len() as u64) as usize;
                    new[at].has_endpoints = !new[at].has_endpoints;
                }
                2 => {
                    let v = vip(next(40));
                    new.retain(|p| p.vip != v);
                }
                _ => new.push(layer::ServicePort {
                    vip: vip(next(60)),
                    proto: Proto::Tcp,
                    port: 1000 + next(3) as u16,
                    has_endpoints: true,
                }),
            }
        }
        old.sort();
        new.sort();
        new.dedup();
        let of = |l: &[layer::ServicePort], v: IpAddr| l.iter().filter(|p| p.vip == v).copied().collect::<Vec<_>>();
        let differ: Vec<IpAddr> =
            old.iter().chain(&new).map(|p| p.vip).filter(|&v| of(&old, v) != of(&new, v)).collect();
        let want = |l: &[layer::ServicePort]| l.iter().filter(|p| differ.contains(&p.vip)).copied().collect::<Vec<_>>();
        let at = |ports: Vec<layer::ServicePort>| {
            let mut l = layer::ServiceLayer::new(layer::LayerMode::Count);
            l.ranges = vec!["10.96.0.0/16".parse().unwrap(), "fd00::/64".parse().unwrap()];
            l.ports = ports;
            l
        };
        let stored = |ports: &[layer::ServicePort]| StoredLayer::new(round, &at(ports.to_vec()), 0);
        let (s_old, s_new) = (stored(&old), stored(&new));
        let (mut a, mut b) = engine::narrowed(&s_old, &s_new);
        // The same cut when the change's touched VIPs are known (a superset of those that
        // differ: every VIP the change named); control: a hint that leaves out one that
        // differs gives another cut, so the hint is what the cut was made from (in a round
        // where no profile gains or loses its chain, which would bring its VIPs back in).
        let mut touched = differ.clone();
        touched.extend((0..next(4)).map(|_| vip(next(60))));
        engine::note_touched(&s_old, &s_new, touched);
        assert_eq!(engine::narrowed(&s_old, &s_new), (a.clone(), b.clone()), "round {round}: the cut with the hint");
        if let Some(&left_out) = differ.first().filter(|_| a.profile_chains() == b.profile_chains()) {
            let short: Vec<IpAddr> = differ.iter().copied().filter(|&v| v != left_out).collect();
            engine::note_touched(&s_old, &s_new, short);
            assert_ne!(
                engine::narrowed(&s_old, &s_new),
                (a.clone(), b.clone()),
                "round {round}: RIG BROKEN: the hint is not used"
            );
            hinted += 1;
        }
        // Stored layers hold no mark; each pod's is set on the way to it.
        (a.divert_mark, b.divert_mark) = (at(vec![]).divert_mark, at(vec![]).divert_mark);
        let kept = |cut: &[layer::ServicePort], all: &[layer::ServicePort]| {
            want(all).iter().all(|p| cut.contains(p)) && cut.iter().all(|p| all.contains(p))
        };
        assert!(kept(&a.ports, &old), "round {round}: the old layer's cut");
        assert!(kept(&b.ports, &new), "round {round}: the new layer's cut");
        // The whole layers under the cut's names (each cut names its stored layer).
        let named = |l: layer::ServiceLayer, id| layer::ServiceLayer { identity: id, ..l };
        let whole =
            layer::LayerChange::between(&named(at(old.clone()), a.identity), &named(at(new.clone()), b.identity))
                .unwrap();
        assert_eq!(layer::LayerChange::between(&a, &b).unwrap(), whole, "round {round}: the change");
        if a.profile_chains() != b.profile_chains() {
            flips += 1;
        }
    }
    assert!(flips > 10, "only {flips} rounds moved a profile across the chain threshold");
    assert!(hinted > 100, "the hint's control ran {hinted} times");
}

/// The report's text, written straight from the report, is byte for byte the pretty text of
/// its JSON value (members by name, as a JSON object keeps them), for every kind of outcome.
#[test]
fn a_report_s_text_is_its_json_value_s_text() {
    use aether_rules::services::Applied;
    let pod = |cid: &str, result| apply::PodOutcome {
        container_id: cid.into(),
        ifname: "eth0".into(),
        netns: format!("/var/run/netns/{cid}"),
        result,
    };
    let gone = || Err(crate::PodError::Gone("the netns \"x\" is gone".into()));
    let failed = || {
        Err(crate::PodError::Netns(aether_netns::Error::NotFound { path: std::path::PathBuf::from("/run/netns/y") }))
    };
    for warnings in [vec![], vec!["a stored snapshot no longer reads; replaced".to_string()]] {
        let report = apply::ApplyReport {
            generation: 42,
            pods: vec![
                pod("a", Ok(Applied::Elements { added: 2, removed: 1 })),
                pod("b", Ok(Applied::Rebuilt)),
                pod("c", Ok(Applied::Unchanged)),
                pod("d", Ok(Applied::Removed(true))),
                pod("e", Ok(Applied::Removed(false))),
                pod("f", gone()),
                pod("g", failed()),
            ],
            warnings,
        };
        assert_eq!(report.to_pretty_text(), serde_json::to_string_pretty(&report.to_json()).unwrap());
        assert_eq!(report.pods_by_result(), "elements=1 failed=1 off=1 rebuilt=1 removed=1 skipped=1 unchanged=1");
    }
    let empty = apply::ApplyReport { generation: 1, pods: vec![], warnings: vec![] };
    assert_eq!(empty.to_pretty_text(), "{\n  \"generation\": 1,\n  \"pods\": []\n}");
    assert_eq!(empty.pods_by_result(), "none");
}

/// The tables a node of the layer's first shape built for `doc(1)` in count mode (as its
/// golden file showed them), with counts: `service_vips` a plain set of VIPs, each Service
/// port a `VIP . proto . port` element.
const FIRST_SHAPE: &str = r#"table ip aether_services {
	counter mesh { packets 0 bytes 0 }
	counter service { packets 5 bytes 300 }
	counter external { packets 0 bytes 0 }
	counter refused_no_endpoints { packets 0 bytes 0 }
	counter refused_port_not_declared { packets 0 bytes 0 }
	counter refused_no_service { packets 2 bytes 120 }
	set service_ranges { type ipv4_addr; flags interval; elements = { 10.96.0.0/16 } }
	set mesh_vips { type ipv4_addr; }
	set service_ports { type ipv4_addr . inet_proto . inet_service; elements = { 10.96.1.1 . tcp . 1001 } }
	set empty_services { type ipv4_addr . inet_proto . inet_service; }
	set service_vips { type ipv4_addr; elements = { 10.96.1.1 } }
	set never_refused { type ipv4_addr; elements = { 10.96.0.1 } }
	set dialled { type ipv4_addr . inet_proto . inet_service; size 65535; flags dynamic,timeout; timeout 1h; }
	set refusing { type inet_proto; }
	chain egress_classify {
		type filter hook output priority mangle + 10; policy accept;
		meta mark 0x0000ae71 ct state new ct status ! confirmed jump classify
	}
	chain classify {
		udp dport 53 accept
		tcp dport 53 accept
		ip daddr @mesh_vips counter name "mesh" accept
		ip daddr != @service_ranges counter name "external" accept
		update @dialled { ip daddr . meta l4proto . th dport }
		ip daddr . meta l4proto . th dport @service_ports counter name "service" accept
		ip daddr @never_refused counter name "service" accept
		ip daddr . meta l4proto . th dport @empty_services counter name "refused_no_endpoints" jump refuse
		ip daddr @service_vips counter name "refused_port_not_declared" jump refuse
		counter name "refused_no_service" jump refuse
	}
	chain refuse {
		meta l4proto != @refusing accept
		reject with tcp reset
		reject
	}
}
"#;

/// The tables a node of the layer's second shape built for `doc(1)` in count mode (as its
/// golden file showed them), with counts: `service_vips` a verdict map, each Service an
/// element to its profile's chain (here `by_key`, the one Service's profile being unshared).
const SECOND_SHAPE: &str = r#"table ip aether_services {
	counter mesh { packets 0 bytes 0 }
	counter service { packets 5 bytes 300 }
	counter external { packets 0 bytes 0 }
	counter refused_no_endpoints { packets 0 bytes 0 }
	counter refused_port_not_declared { packets 0 bytes 0 }
	counter refused_no_service { packets 2 bytes 120 }
	set service_ranges { type ipv4_addr; flags interval; elements = { 10.96.0.0/16 } }
	set mesh_vips { type ipv4_addr; }
	set service_ports { type ipv4_addr . inet_proto . inet_service; elements = { 10.96.1.1 . tcp . 1001 } }
	set empty_services { type ipv4_addr . inet_proto . inet_service; }
	set never_refused { type ipv4_addr; elements = { 10.96.0.1 } }
	set dialled { type ipv4_addr . inet_proto . inet_service; size 65535; flags dynamic,timeout; timeout 1h; }
	set refusing { type inet_proto; }
	chain egress_classify {
		type filter hook output priority mangle + 10; policy accept;
		meta mark 0x0000ae71 ct state new ct status ! confirmed jump classify
	}
	chain by_key {
		ip daddr . meta l4proto . th dport @service_ports counter name "service" accept
		ip daddr . meta l4proto . th dport @empty_services counter name "refused_no_endpoints" jump refuse
		counter name "refused_port_not_declared" jump refuse
	}
	chain refuse {
		meta l4proto != @refusing accept
		reject with tcp reset
		reject
	}
	map service_vips { type ipv4_addr : verdict; elements = { 10.96.1.1 : goto by_key } }
	chain classify {
		udp dport 53 accept
		tcp dport 53 accept
		ip daddr @mesh_vips counter name "mesh" accept
		ip daddr != @service_ranges counter name "external" accept
		update @dialled { ip daddr . meta l4proto . th dport }
		ip daddr @never_refused counter name "service" accept
		ip daddr vmap @service_vips
		counter name "refused_no_service" jump refuse
	}
}
"#;

/// An upgrade from a node that built an older shape of the layer (the first, or the second):
/// the pod's netns holds those tables, counts and all, and its file names the digest of that
/// time. The next apply rebuilds it into this shape with its counts, once. The control: a
/// pod whose file names this shape's digest over the same old tables is sent just the
/// change, and is left in the old shape (what a digest without the shape would do to all).
#[test]
fn a_pod_holding_an_older_shape_is_rebuilt_once_with_its_counts() {
    if !root_or_skip("a_pod_holding_an_older_shape_is_rebuilt_once_with_its_counts") {
        return;
    }
    for (shape, tables) in [(1, Some(FIRST_SHAPE)), (2, Some(SECOND_SHAPE)), (layer::SHAPE, None)] {
        older_shape_rebuilt_once(shape, tables);
    }
}

fn older_shape_rebuilt_once(shape: u64, tables: Option<&str>) {
    let state = tmp(&format!("shape{shape}"));
    let dir = ServicesDir::new(&state);
    apply_document(&dir, &doc(1)).unwrap();
    let stored = dir.stored_layer().unwrap().unwrap();
    let (old, named) = (TestNetns::new(&format!("svc-shape{shape}")), TestNetns::new(&format!("svc-named{shape}")));
    // The pod of a release before: its tables as that release built them (the shape before
    // this one's, or this shape without the name, as the release just before built it).
    match tables {
        Some(tables) => {
            let path = std::env::temp_dir().join(format!("{}.nft", old.name));
            fs::write(&path, tables).unwrap();
            old.exec("nft", &["-f", path.to_str().unwrap()]);
            let _ = fs::remove_file(&path);
        }
        None => {
            let unnamed = layer::ServiceLayer { identity: None, ..stored.for_pod(0xae71) };
            Netns::open_foreign(old.path()).unwrap().run(|| layer::rebuild(&unnamed)).unwrap().unwrap();
        }
    }
    // The control: a pod that holds this release's layer, named.
    Netns::open_foreign(named.path()).unwrap().run(|| layer::rebuild(&stored.for_pod(0xae71))).unwrap().unwrap();
    for (cid, ns) in [("old", &old), ("named", &named)] {
        StateDir::new(&state).write(&rec(cid, &ns.path())).unwrap();
    }
    let in_old = Netns::open_foreign(old.path()).unwrap();
    assert_eq!(in_old.run(layer::held_shape).unwrap().unwrap(), Some(shape), "the old tables read as their shape");
    assert_eq!(
        in_old.run(layer::held).unwrap().unwrap(),
        layer::HeldLayer::Unnamed { shape: Some(shape) },
        "the old tables name nothing"
    );
    let before = in_old.run(layer::counters).unwrap().unwrap();
    let result = |report: &ApplyReport, cid: &str| {
        report.pods.iter().find(|p| p.container_id == cid).unwrap().result.as_ref().unwrap().clone()
    };
    let report = apply_document(&dir, &doc(2)).unwrap();
    assert_eq!(result(&report, "old"), layer::Applied::Rebuilt, "shape {shape}");
    assert!(
        report.warnings.iter().any(|w| w.contains("1 pod(s) held a Service layer a release before built")),
        "{:?}",
        report.warnings
    );
    let two = dir.stored_layer().unwrap().unwrap();
    assert_eq!(in_old.run(|| layer::verify(&two.for_pod(0xae71))).unwrap().unwrap(), Vec::<String>::new());
    assert_eq!(in_old.run(layer::held_shape).unwrap().unwrap(), Some(layer::SHAPE));
    assert_eq!(in_old.run(layer::held).unwrap().unwrap(), layer::HeldLayer::Named(two.named(0xae71)));
    let counts = in_old.run(layer::counters).unwrap().unwrap();
    assert_eq!(counts, before, "counts carried over");
    // The control: the pod that held this release's named layer is sent only the change.
    assert!(matches!(result(&report, "named"), layer::Applied::Elements { .. }), "shape {shape}");
    // Once: the rebuilt pod is sent only the next change.
    let report = apply_document(&dir, &doc(3)).unwrap();
    assert!(matches!(result(&report, "old"), layer::Applied::Elements { .. }));
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);
    let _ = fs::remove_dir_all(&state);
}

/// ADD's kept transaction (`encoded`): the first pod of a layer and mark keeps what it was
/// sent; the next is sent those bytes, without a rewrite of the file, and holds the very same
/// tables; a new layer is built and kept anew; a pod that has a layer already is built as
/// before. Control: bytes of another layer planted under this layer's key reach the pod (the
/// hit path sends what is kept) and `verify` finds that pod wrong.
#[test]
fn add_sends_the_kept_transaction_of_the_stored_layer() {
    use std::os::unix::fs::MetadataExt;
    if !root_or_skip("add_sends_the_kept_transaction_of_the_stored_layer") {
        return;
    }
    let state = tmp("kept");
    let dir = ServicesDir::new(&state);
    apply_document(&dir, &doc(1)).unwrap();
    let add = |tag: &str, generation: u64| -> TestNetns {
        let ns = TestNetns::new(tag);
        StateDir::new(&state).write(&rec(tag, &ns.path())).unwrap();
        let n = Netns::open_foreign(ns.path()).unwrap();
        assert_eq!(apply_current_snapshot_in_netns(&state, &n, 0xae71).unwrap(), Some(generation), "{tag}");
        ns
    };
    let list = |ns: &TestNetns| ns.exec("nft", &["list", "table", "ip", layer::TABLE]);
    let kept = state.join("services/encoded-0000ae71");
    let inode = || fs::metadata(&kept).map(|m| m.ino()).ok();
    let intact = |what: &str| {
        let report = verify_pods(&dir).unwrap();
        let wrong: Vec<String> = report
            .pods
            .iter()
            .filter(|p| !matches!(&p.result, Ok((d, _)) if d.is_empty()))
            .map(|p| format!("{}: {:?}", p.container_id, p.result.as_ref().map(|r| &r.0)))
            .collect();
        assert!(wrong.is_empty(), "{what}: {wrong:?}");
    };
    let a = add("kept-a", 1);
    let first = inode().expect("the first pod of the layer keeps its transaction");
    let b = add("kept-b", 1);
    assert_eq!(inode(), Some(first), "the second pod was built (the kept file was written again), not sent it");
    assert_eq!(list(&a), list(&b), "the kept transaction made other tables than the build");
    assert!(list(&b).contains("1001"), "{}", list(&b));
    intact("two pods of generation 1");
    // A new layer: the kept file no longer answers for it; the next pod is built and kept anew.
    apply_document(&dir, &doc(2)).unwrap();
    let c = add("kept-c", 2);
    assert_ne!(inode(), Some(first), "the kept transaction of generation 1 was sent for generation 2");
    assert!(list(&c).contains("1002"), "{}", list(&c));
    intact("after generation 2");
    // A pod holding a layer already: the kept transaction (an exclusive create) is refused,
    // and the layer is built over it.
    let d = TestNetns::new("kept-d");
    let stored = dir.stored_layer().unwrap().unwrap();
    Netns::open_foreign(d.path()).unwrap().run(|| layer::rebuild(&stored.for_pod(0xae71))).unwrap().unwrap();
    StateDir::new(&state).write(&rec("kept-d", &d.path())).unwrap();
    let n = Netns::open_foreign(d.path()).unwrap();
    assert_eq!(apply_current_snapshot_in_netns(&state, &n, 0xae71).unwrap(), Some(2));
    assert_eq!(list(&d), list(&c));
    intact("a pod that held a layer");
    // Control: another layer's transaction kept under this layer's key is what the next pod
    // gets, and verify sees it.
    let mut other = snapshot::parse(&doc(7)).unwrap().layer(0xae71);
    other.identity = Some(layer::LayerId { generation: 7, digest: 7 });
    let planted = layer::Prepared::new(&other).unwrap().unwrap();
    let (bytes, seq_count) = planted.create().bytes_at_zero();
    let key = encoded::Key::now(&dir, 0xae71).unwrap();
    let c2 = encoded::Cached { generation: 2, digest: stored.digest, seq_count, bytes: bytes.into() };
    encoded::write(&dir, &key, &c2);
    let e = add("kept-e", 2);
    assert!(list(&e).contains("1007"), "the planted transaction was not sent: {}", list(&e));
    let report = verify_pods(&dir).unwrap();
    let flagged =
        report.pods.iter().any(|p| p.container_id == "kept-e" && !matches!(&p.result, Ok((d, _)) if d.is_empty()));
    assert!(flagged, "RIG BROKEN: verify does not see a pod sent another layer's kept transaction");
    drop((a, b, c, d, e));
    let _ = fs::remove_dir_all(&state);
}
