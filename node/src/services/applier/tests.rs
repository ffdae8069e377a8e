use std::path::PathBuf;

use aether_testkit::{root_or_skip, Rng, TestNetns};
use serde_json::{json, Value};

use super::*;
use crate::services::{apply_change, apply_current_snapshot_in_netns, apply_document, layer_file};
use crate::state::NetnsIdentity;
use aether_rules::services as layer;
use std::collections::BTreeMap;

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("aether-applier-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A pod as ADD leaves it: a record naming its netns, and the stored layer applied.
fn add_pod(state: &Path, cid: &str) -> TestNetns {
    let ns = TestNetns::new("applier");
    let opened = Netns::open_foreign(ns.path()).unwrap();
    let r = Record { netns_id: Some(NetnsIdentity::of(&opened)), ..Record::bare(cid, &ns.path()) };
    StateDir::new(state).write(&r).unwrap();
    apply_current_snapshot_in_netns(state, &opened, 0xae71).unwrap();
    ns
}

fn remove_record(state: &Path, cid: &str) {
    StateDir::new(state).remove("k8s-pod-network", cid, "eth0").unwrap();
}

/// The agent's view: Services by name, and the documents it sends.
struct Cluster {
    generation: u64,
    services: BTreeMap<String, Value>,
    next: u32,
}

impl Cluster {
    /// A cluster at generation 1 with `n` Services.
    fn of(n: usize) -> Cluster {
        let mut cluster = Cluster { generation: 1, services: BTreeMap::new(), next: 0 };
        for _ in 0..n {
            let s = cluster.service();
            cluster.services.insert(s["name"].as_str().unwrap().into(), s);
        }
        cluster
    }

    fn service(&mut self) -> Value {
        self.next += 1;
        let n = self.next;
        json!({"namespace": "shop", "name": format!("s{n}"), "vip": format!("10.96.{}.{}", n / 200, n % 200 + 1),
               "ports": [{"protocol": "TCP", "port": 80}, {"protocol": "UDP", "port": 5000 + n}], "usableEndpoints": true})
    }

    fn whole(&self) -> Vec<u8> {
        json!({"generation": self.generation, "mode": "refuse", "serviceRanges": ["10.96.0.0/16"],
               "services": self.services.values().collect::<Vec<_>>()})
        .to_string()
        .into_bytes()
    }

    /// One random step as a change document (the cluster moved to its next generation).
    fn random_change(&mut self, rng: &mut Rng) -> Vec<u8> {
        let base = self.generation;
        self.generation += 1;
        let names: Vec<String> = self.services.keys().cloned().collect();
        let pick = |rng: &mut Rng| names[rng.below(names.len() as u64) as usize].clone();
        let mut doc = json!({"baseGeneration": base, "generation": self.generation});
        match rng.below(4) {
            0 => {
                let s = self.service();
                self.services.insert(s["name"].as_str().unwrap().into(), s.clone());
                doc["servicesPut"] = json!([s]);
            }
            1 if names.len() > 2 => {
                let name = pick(rng);
                self.services.remove(&name);
                doc["servicesRemoved"] = json!([{"namespace": "shop", "name": name}]);
            }
            2 => {
                let name = pick(rng);
                let s = self.services.get_mut(&name).unwrap();
                s["ports"][0]["port"] = json!(80 + rng.below(100));
                doc["servicesPut"] = json!([s.clone()]);
            }
            _ => {
                let name = pick(rng);
                let s = self.services.get_mut(&name).unwrap();
                let usable = !s["usableEndpoints"].as_bool().unwrap();
                s["usableEndpoints"] = json!(usable);
                doc["endpoints"] = json!([{"namespace": "shop", "name": name, "usableEndpoints": usable}]);
            }
        }
        doc.to_string().into_bytes()
    }
}

fn outcomes(report: &ApplyReport) -> Vec<(String, String)> {
    report
        .pods
        .iter()
        .map(|p| {
            (p.container_id.clone(), p.result.as_ref().map_or_else(|e| e.to_string(), super::super::apply::describe))
        })
        .collect()
}

/// The stored state as every reader sees it (the files, with the applier's journal folded
/// in): the document, and the layer's generation, digest and content.
fn files(state: &Path) -> (Vec<u8>, (u64, u64, layer::ServiceLayer)) {
    let dir = ServicesDir::new(state);
    let l = dir.stored_layer().unwrap().unwrap();
    (dir.stored_text().unwrap().unwrap(), (l.generation, l.digest, l.layer))
}

/// `doc` applied by the applier and by the one-shot apply, each to its own node: both answer
/// the same for every pod. Returns the step's name for the caller's messages.
fn through_both(applier: &mut Applier, once_dir: &ServicesDir, doc: &[u8], step: usize) -> String {
    let once = if change::is_change(doc) { apply_change(once_dir, doc) } else { apply_document(once_dir, doc) };
    let (kept, once) = (applier.apply(doc).unwrap(), once.unwrap());
    let when = format!("step {step}: {}", String::from_utf8_lossy(doc));
    assert_eq!(outcomes(&kept), outcomes(&once), "{when}");
    when
}

/// What each pod's tables say they hold: (generation, digest) by container ID; `None` for a
/// pod whose tables name no layer.
fn holds_files(_state: &Path, pods: &BTreeMap<String, TestNetns>) -> Vec<(String, Option<(u64, u64)>)> {
    pods.iter()
        .map(|(cid, ns)| {
            let held = Netns::open_foreign(ns.path()).unwrap().run(layer::held).unwrap().unwrap();
            let named = match held {
                layer::HeldLayer::Named(n) => Some((n.id.generation, n.id.digest)),
                _ => None,
            };
            (cid.clone(), named)
        })
        .collect()
}

/// Every pod's layer read back from the kernel and compared with the stored one.
fn drift(state: &Path, pods: &BTreeMap<String, TestNetns>) -> Vec<String> {
    let stored = ServicesDir::new(state).stored_layer().unwrap().unwrap().for_pod(0xae71);
    pods.iter()
        .filter_map(|(cid, ns)| {
            let diffs = Netns::open_foreign(ns.path()).unwrap().run(|| layer::verify(&stored)).unwrap().unwrap();
            (!diffs.is_empty()).then(|| format!("{cid}: {diffs:?}"))
        })
        .collect()
}

/// Random documents (changes mostly, some whole) to two nodes: one through an `Applier` kept
/// between documents, one by the one-shot functions `services apply` calls. At every step the
/// stored files, each pod's outcome and each pod's kernel sets agree, also when pods come and
/// go and another writer (`services apply`) stores a document between the applier's.
#[test]
fn the_applier_leaves_what_the_one_shot_apply_leaves() {
    if !root_or_skip("the_applier_leaves_what_the_one_shot_apply_leaves") {
        return;
    }
    let (kept_state, once_state) = (tmp("kept"), tmp("once"));
    let (kept_dir, once_dir) = (ServicesDir::new(&kept_state), ServicesDir::new(&once_state));
    let mut rng = Rng::seeded("AETHER_APPLIER_SEED", "the_applier_leaves_what_the_one_shot_apply_leaves");
    let mut cluster = Cluster::of(30);
    let mut applier = Applier::new(&kept_state);
    let (mut kept_pods, mut once_pods) = (BTreeMap::new(), BTreeMap::new());
    for cid in ["a", "b", "c"] {
        kept_pods.insert(cid.to_string(), add_pod(&kept_state, cid));
        once_pods.insert(cid.to_string(), add_pod(&once_state, cid));
    }
    applier.apply(&cluster.whole()).unwrap();
    apply_document(&once_dir, &cluster.whole()).unwrap();
    for step in 1..=40 {
        match step {
            10 => {
                // A pod started meanwhile (ADD) on each node.
                kept_pods.insert("d".into(), add_pod(&kept_state, "d"));
                once_pods.insert("d".into(), add_pod(&once_state, "d"));
            }
            20 => {
                // Another writer between two of the applier's documents.
                cluster.generation += 1;
                apply_document(&kept_dir, &cluster.whole()).unwrap();
                apply_document(&once_dir, &cluster.whole()).unwrap();
            }
            25 => {
                // A re-ADD of a pod (its file replaced, not rewritten in place).
                for (state, pods) in [(&kept_state, &kept_pods), (&once_state, &once_pods)] {
                    let ns = Netns::open_foreign(pods["a"].path()).unwrap();
                    apply_current_snapshot_in_netns(state, &ns, 0xae71).unwrap();
                }
            }
            30 => {
                // A pod gone (its record removed, as DEL does).
                remove_record(&kept_state, "b");
                remove_record(&once_state, "b");
                kept_pods.remove("b");
                once_pods.remove("b");
            }
            _ => {}
        }
        let doc = if rng.chance(4) {
            cluster.generation += 1;
            cluster.whole()
        } else {
            cluster.random_change(&mut rng)
        };
        let when = through_both(&mut applier, &once_dir, &doc, step);
        assert!(files(&kept_state) == files(&once_state), "{when}: the stored files differ");
        assert_eq!(drift(&kept_state, &kept_pods), Vec::<String>::new(), "{when}");
        assert_eq!(applier.kept_pods(), kept_pods.len(), "{when}: a socket per pod is kept");
        let (kept_holds, once_holds) = (holds_files(&kept_state, &kept_pods), holds_files(&once_state, &once_pods));
        assert_eq!(kept_holds, once_holds, "{when}: what the pods' tables name differs");
        // Each holds the stored layer (by its digest: a document of the same content leaves
        // a pod at the generation that brought it).
        let stored = files(&kept_state).1 .1;
        assert!(kept_holds.iter().all(|(_, h)| h.is_some_and(|(_, d)| d == stored)), "{when}: {kept_holds:?}");
    }
    // Control: the same comparison sees a pod whose set was changed by hand.
    let vip = cluster.services.values().next().unwrap()["vip"].as_str().unwrap().to_string();
    kept_pods["a"].exec("nft", &["delete", "element", "ip", "aether_services", "service_vips", "{", &vip, "}"]);
    assert!(!drift(&kept_state, &kept_pods).is_empty(), "RIG BROKEN: a VIP deleted by hand is not seen");
    let _ = (std::fs::remove_dir_all(&kept_state), std::fs::remove_dir_all(&once_state));
}

/// The journal's entries over `layer.bin` (0 without a journal).
fn journal_entries(state: &Path) -> usize {
    let dir = ServicesDir::new(state);
    let base = layer_file::read_base(&dir.layer_path()).unwrap().unwrap();
    dir.journal(&base).unwrap().len()
}

/// The applier stores a change as a journal entry, not by writing `snapshot.json` and
/// `layer.bin` whole; every reader folds the journal in. Random changes (no pods: no root
/// needed) to two nodes, the applier's and the one-shot functions': at every step both read
/// back the same document and layer, whose digest the applier moved by the change alone.
/// Past `MAX_ENTRIES` the applier writes the files whole and starts a new journal; a one-shot
/// change reads a journal and writes the files whole; an append torn by a kill leaves the
/// state of the entry before it, and the next change over the lost one is refused as
/// stale; an apply stopped after writing the document whole leaves the document to be read
/// as it is. Control: `layer.bin` alone is behind the journaled state.
#[test]
fn the_applier_journals_its_changes_and_every_reader_folds_them() {
    let (kept_state, once_state) = (tmp("journal-kept"), tmp("journal-once"));
    let (kept_dir, once_dir) = (ServicesDir::new(&kept_state), ServicesDir::new(&once_state));
    let mut rng = Rng::seeded("AETHER_APPLIER_SEED", "the_applier_journals_its_changes_and_every_reader_folds_them");
    let mut cluster = Cluster::of(30);
    let mut applier = Applier::new(&kept_state);
    applier.apply(&cluster.whole()).unwrap();
    apply_document(&once_dir, &cluster.whole()).unwrap();
    let (mut most, mut compacted, mut behind) = (0, 0, 0);
    for step in 1..=2 * journal::MAX_ENTRIES + 10 {
        let doc = cluster.random_change(&mut rng);
        let before = journal_entries(&kept_state);
        if step == journal::MAX_ENTRIES + 5 {
            // Another writer: a one-shot change reads the journal, writes the files whole.
            apply_change(&kept_dir, &doc).unwrap();
            apply_change(&once_dir, &doc).unwrap();
            assert_eq!(journal_entries(&kept_state), 0, "step {step}: the journal stays after a whole write");
        } else {
            through_both(&mut applier, &once_dir, &doc, step);
        }
        let now = journal_entries(&kept_state);
        most = most.max(now);
        compacted += usize::from(now < before && step != journal::MAX_ENTRIES + 5);
        assert!(files(&kept_state) == files(&once_state), "step {step}: the stored state differs");
        assert_eq!(kept_dir.stored_header().unwrap().unwrap().0, cluster.generation, "step {step}");
        let (alone, _) = layer_file::read_with_base(&kept_dir.layer_path()).unwrap().unwrap();
        behind += usize::from(alone.generation < cluster.generation);
    }
    // The Services the changes touched were found through the kept index, carried from
    // change to change since the one-shot write (the searches: Services added, not stored).
    let index = &applier.kept.stored.as_ref().expect("the applier keeps the document").index;
    assert!(index.found > journal::MAX_ENTRIES as u64 / 2, "found {}", index.found);
    assert!(index.searched < index.found, "searched {}, found {}", index.searched, index.found);
    assert_eq!(most, journal::MAX_ENTRIES, "the journal grows to its bound");
    assert!(compacted >= 1, "the applier never wrote the files whole again");
    assert!(behind > journal::MAX_ENTRIES, "RIG BROKEN: layer.bin alone was never behind ({behind})");
    // An append torn by a kill: the state is the entry before's, and a change over the lost
    // one is refused (the agent then sends a whole snapshot).
    let doc = cluster.random_change(&mut rng);
    applier.apply(&doc).unwrap();
    let path = kept_dir.journal_path();
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len - 3).unwrap();
    assert_eq!(kept_dir.stored_header().unwrap().unwrap().0, cluster.generation - 1);
    let doc = cluster.random_change(&mut rng);
    match applier.apply(&doc) {
        Err(ServicesError::StaleBase { base, stored }) => {
            assert_eq!((base, stored), (cluster.generation - 1, base - 1))
        }
        other => panic!("a change over a lost entry: {other:?}"),
    }
    applier.apply(&cluster.whole()).unwrap();
    apply_document(&once_dir, &cluster.whole()).unwrap();
    assert!(files(&kept_state) == files(&once_state), "after the whole snapshot");
    // An apply stopped between writing `snapshot.json` whole and `layer.bin` (the applier
    // writing the files whole again): the marker gone first, the document newer than
    // `layer.bin` and its journal. Readers take the document as it is, and the next change
    // is made to it.
    // (The first change after a whole snapshot as sent writes the canonical form whole.)
    for step in 0..4 {
        through_both(&mut applier, &once_dir, &cluster.random_change(&mut rng), step);
    }
    assert_eq!(journal_entries(&kept_state), 3);
    apply_change(&once_dir, &cluster.random_change(&mut rng)).unwrap();
    std::fs::remove_file(kept_state.join("services/snapshot.source")).unwrap();
    std::fs::copy(once_state.join("services/snapshot.json"), kept_state.join("services/snapshot.json")).unwrap();
    assert_eq!(kept_dir.stored_text().unwrap(), once_dir.stored_text().unwrap(), "the newer document, as it is");
    let next = cluster.random_change(&mut rng);
    apply_change(&kept_dir, &next).unwrap();
    apply_change(&once_dir, &next).unwrap();
    assert!(files(&kept_state) == files(&once_state), "the change after the stopped apply");
    let _ = (std::fs::remove_dir_all(&kept_state), std::fs::remove_dir_all(&once_state));
}

/// The journal stays within what its readers read: once it holds `APPEND_BELOW` bytes, the
/// applier writes the files whole, however few its entries. Large changes (5,000 Services put
/// again, about 1 MB an entry), no pods. Control: that happens before `MAX_ENTRIES`, so only
/// the size bound made it.
#[test]
fn the_journal_stays_within_what_its_readers_read() {
    let state = tmp("journal-bytes");
    let dir = ServicesDir::new(&state);
    let mut cluster = Cluster::of(5_000);
    let mut applier = Applier::new(&state);
    applier.apply(&cluster.whole()).unwrap();
    let (mut largest, mut by_size) = (0, 0);
    for round in 0..14u64 {
        let base = cluster.generation;
        cluster.generation += 1;
        for s in cluster.services.values_mut() {
            s["ports"][0]["port"] = json!(80 + round);
        }
        let doc = json!({"baseGeneration": base, "generation": cluster.generation,
                         "servicesPut": cluster.services.values().collect::<Vec<_>>()});
        let before = journal_entries(&state);
        applier.apply(doc.to_string().as_bytes()).unwrap();
        let size = std::fs::metadata(dir.journal_path()).map_or(0, |m| m.len());
        largest = largest.max(size);
        by_size += usize::from(journal_entries(&state) <= before && before > 0 && before < journal::MAX_ENTRIES);
        assert_eq!(dir.stored_header().unwrap().unwrap().0, cluster.generation, "round {round}");
    }
    assert!(largest <= journal::MAX_BYTES, "the journal grew to {largest} bytes");
    assert!(by_size >= 1, "RIG BROKEN: the journal never reached its size bound (largest {largest} bytes)");
    let _ = std::fs::remove_dir_all(&state);
}

/// Whether the interface `name` is still in the netns `ns` (its peer's netns not yet gone).
fn has_link(ns: &TestNetns, name: &str) -> bool {
    ns.try_exec("ip", &["link", "show", name]).0
}

/// Waits up to 5 s for `cond`.
fn eventually(cond: impl Fn() -> bool) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    cond()
}

/// An empty layer (mode count) at `generation`.
fn empty_layer(generation: u64) -> Vec<u8> {
    json!({"generation": generation, "mode": "count", "serviceRanges": ["10.96.0.0/16"], "services": []})
        .to_string()
        .into_bytes()
}

/// A recorded pod with a veth whose peer end, `peer0`, is in `peer`: the peer end goes when
/// the pod's netns is freed.
fn pod_tied_to(state: &Path, cid: &str, peer: &TestNetns) -> TestNetns {
    let pod = add_pod(state, cid);
    pod.exec("ip", &["link", "add", "pod0", "type", "veth", "peer", "name", "peer0", "netns", &peer.name]);
    pod
}

/// A kept socket keeps its pod's netns alive: `tidy` lets go of it once the record is gone, so
/// the netns is freed (seen by the veth peer it takes with it).
#[test]
fn tidy_lets_a_gone_pods_netns_be_freed() {
    if !root_or_skip("tidy_lets_a_gone_pods_netns_be_freed") {
        return;
    }
    let state = tmp("tidy");
    let mut applier = Applier::new(&state);
    // A layer stored first: the pods below get changes, on kept sockets.
    applier.apply(&empty_layer(1)).unwrap();
    let peer = TestNetns::new("applier-peer");
    let pass = |applier: &mut Applier, cid: &str, tidy: bool| -> bool {
        let pod = pod_tied_to(&state, cid, &peer);
        let generation = ServicesDir::new(&state).stored_layer().unwrap().map_or(1, |s| s.generation + 1);
        applier.apply(&empty_layer(generation)).unwrap();
        assert_eq!(applier.kept_pods(), 1);
        remove_record(&state, cid);
        drop(pod);
        if tidy {
            applier.tidy();
        }
        eventually(|| !has_link(&peer, "peer0"))
    };
    // Control: without tidy the socket pins the netns, and its veth stays.
    assert!(
        !pass(&mut applier, "pinned", false),
        "RIG BROKEN: the pod's netns went although the applier holds a socket in it"
    );
    applier.tidy();
    assert_eq!(applier.kept_pods(), 0);
    assert!(eventually(|| !has_link(&peer, "peer0")), "the netns was not freed after tidy");
    assert!(pass(&mut applier, "freed", true), "the pod's netns stayed after tidy");
    assert_eq!(applier.kept_pods(), 0);
    let _ = std::fs::remove_dir_all(&state);
}

/// A pod whose netns path went while its record stayed (the runtime removed the netns and
/// no DEL came): `tidy` sees the path no longer names the kept netns and lets go of it.
#[test]
fn tidy_lets_go_of_a_pod_whose_netns_path_is_gone() {
    if !root_or_skip("tidy_lets_go_of_a_pod_whose_netns_path_is_gone") {
        return;
    }
    let state = tmp("tidy-path");
    let mut applier = Applier::new(&state);
    applier.apply(&empty_layer(1)).unwrap();
    let peer = TestNetns::new("applier-peer2");
    let pod = pod_tied_to(&state, "kept", &peer);
    applier.apply(&empty_layer(2)).unwrap();
    assert_eq!(applier.kept_pods(), 1);
    // Still there: tidy keeps it.
    applier.tidy();
    assert_eq!(applier.kept_pods(), 1, "tidy let go of a pod whose netns path still names it");
    drop(pod);
    assert!(has_link(&peer, "peer0"), "RIG BROKEN: the pod's netns went although the applier holds a socket in it");
    applier.tidy();
    assert_eq!(applier.kept_pods(), 0, "tidy kept a pod whose netns path is gone");
    assert!(eventually(|| !has_link(&peer, "peer0")), "the netns was not freed after tidy");
    let _ = std::fs::remove_dir_all(&state);
}

/// What a pod's tables say they hold (the identity counter's name), and the run of
/// generations this process's element changes made in it, but for the generations
/// themselves (each node's own): whether there is one.
fn pod_file(state: &Path, ns: &TestNetns) -> Option<String> {
    let netns = Netns::open_foreign(ns.path()).unwrap();
    let held = netns.run(layer::held).unwrap().unwrap();
    let run = crate::services::applied_run(state, &netns).map(|r| (r.layer_generation, r.divert_mark));
    match held {
        layer::HeldLayer::Absent => None,
        held => Some(format!("{held:?} run {run:?}")),
    }
}

/// The pod's nftables ruleset as `nft` lists it (the Service layer's tables, sets and
/// elements, counters at zero: no traffic).
fn kernel_sets(ns: &TestNetns) -> String {
    ns.exec("nft", &["list", "ruleset"])
}

/// `doc` with its top-level `mode` replaced.
fn with_mode(doc: Vec<u8>, mode: &str) -> Vec<u8> {
    let mut v: Value = serde_json::from_slice(&doc).unwrap();
    v["mode"] = json!(mode);
    v.to_string().into_bytes()
}

/// The one engine, reached two ways: random documents (changes mostly; whole snapshots, some
/// turning the layer `count`, `off` and back) sent to two nodes
/// of three pods each, one through an `Applier` (kept sockets, its cache), one by the one-shot
/// functions `services apply` calls (netns entered each time). At every step both nodes hold
/// the same stored files, every pod the same name in its tables (generation, digest, mark),
/// the same run of generations the reconciler carries a pod over, and the same kernel sets,
/// which are the stored layer's.
#[test]
fn the_one_shot_and_kept_paths_leave_the_same_pods_files_and_kernel_sets() {
    if !root_or_skip("the_one_shot_and_kept_paths_leave_the_same_pods_files_and_kernel_sets") {
        return;
    }
    let (kept_state, once_state) = (tmp("prop-kept"), tmp("prop-once"));
    let once_dir = ServicesDir::new(&once_state);
    let mut rng =
        Rng::seeded("AETHER_ENGINE_SEED", "the_one_shot_and_kept_paths_leave_the_same_pods_files_and_kernel_sets");
    let mut cluster = Cluster::of(12);
    let mut applier = Applier::new(&kept_state);
    applier.apply(&cluster.whole()).unwrap();
    apply_document(&once_dir, &cluster.whole()).unwrap();
    let (mut kept_pods, mut once_pods) = (BTreeMap::new(), BTreeMap::new());
    for cid in ["a", "b", "c"] {
        kept_pods.insert(cid.to_string(), add_pod(&kept_state, cid));
        once_pods.insert(cid.to_string(), add_pod(&once_state, cid));
    }
    let mut runs = 0;
    for step in 1..=36 {
        let doc = match rng.below(8) {
            0 | 1 => {
                cluster.generation += 1;
                let mode = ["refuse", "count", "off"][rng.below(3) as usize];
                with_mode(cluster.whole(), mode)
            }
            _ => cluster.random_change(&mut rng),
        };
        let when = through_both(&mut applier, &once_dir, &doc, step);
        assert!(files(&kept_state) == files(&once_state), "{when}: the stored files differ");
        for (cid, kept_ns) in &kept_pods {
            let once_ns = &once_pods[cid];
            let (kept_file, once_file) = (pod_file(&kept_state, kept_ns), pod_file(&once_state, once_ns));
            assert_eq!(kept_file, once_file, "{when}: pod {cid}'s file");
            runs += usize::from(kept_file.as_ref().is_some_and(|f| !f.ends_with("run None")));
            assert_eq!(kernel_sets(kept_ns), kernel_sets(once_ns), "{when}: pod {cid}'s kernel sets");
        }
        assert_eq!(drift(&kept_state, &kept_pods), Vec::<String>::new(), "{when}");
        assert_eq!(drift(&once_state, &once_pods), Vec::<String>::new(), "{when}");
        for state in [&kept_state, &once_state] {
            let kinds = ["pods", "pods.moves", "applying", ".applying.spare"];
            let left: Vec<&str> = kinds.into_iter().filter(|k| state.join("services").join(k).exists()).collect();
            assert!(left.is_empty(), "{when}: files that mirrored the kernel: {left:?}");
        }
    }
    assert!(runs > 0, "RIG BROKEN: no element change recorded a run of generations (no change was sent)");
    // Control: the comparisons see a difference made on one node only (a second name in one
    // pod's table, whatever the last step left: mode `off` leaves no table on either node).
    once_pods["a"].exec("nft", &["add", "table", "ip", "aether_services"]);
    once_pods["a"].exec("nft", &["add", "counter", "ip", "aether_services", "layer_s3_g1_mae71_d0000000000000000"]);
    assert_ne!(pod_file(&kept_state, &kept_pods["a"]), pod_file(&once_state, &once_pods["a"]), "RIG BROKEN: names");
    once_pods["b"].exec("nft", &["add", "table", "ip", "someone_else"]);
    assert_ne!(kernel_sets(&kept_pods["b"]), kernel_sets(&once_pods["b"]), "RIG BROKEN: a table added is not seen");
    let _ = (std::fs::remove_dir_all(&kept_state), std::fs::remove_dir_all(&once_state));
}

/// An element change moves the name in the pod's own table, in the same transaction, and
/// the run of generations the reconciler carries a pod over follows it, by the applier and by
/// the one-shot apply alike; a pod that misses a generation is rebuilt (its name read from
/// its table) and has no run. Control: a change
/// built for what the pod no longer holds is refused whole by the kernel (nothing of it lands).
#[test]
fn an_element_change_moves_the_name_in_the_pods_table_and_the_kernel_refuses_a_stale_one() {
    if !root_or_skip("an_element_change_moves_the_name_in_the_pods_table_and_the_kernel_refuses_a_stale_one") {
        return;
    }
    let state = tmp("moves");
    let dir = ServicesDir::new(&state);
    let mut cluster = Cluster::of(4);
    let mut applier = Applier::new(&state);
    applier.apply(&cluster.whole()).unwrap();
    let ns = add_pod(&state, "a");
    let netns = Netns::open_foreign(ns.path()).unwrap();
    let named = || match netns.run(layer::held).unwrap().unwrap() {
        layer::HeldLayer::Named(n) => n.id.generation,
        other => panic!("the pod's tables name no layer: {other:?}"),
    };
    assert_eq!(named(), 1, "ADD named the layer in the pod's table");
    let mut rng = Rng::new(7);
    let mut stale = None;
    for (step, one_shot) in [(2, false), (3, true), (4, false)] {
        let doc = loop {
            // An endpoint flip or a Service added: an element change in every case.
            let doc = cluster.random_change(&mut rng);
            if !String::from_utf8_lossy(&doc).contains("servicesRemoved") {
                break doc;
            }
            cluster.generation -= 1;
        };
        let before = dir.stored_layer().unwrap().unwrap();
        let report = if one_shot { apply_change(&dir, &doc) } else { applier.apply(&doc) }.unwrap();
        assert!(outcomes(&report)[0].1.starts_with("elements"), "step {step}: {:?}", outcomes(&report));
        assert_eq!(named(), cluster.generation, "step {step}: the name did not move with the elements");
        let run = crate::services::applied_run(&state, &netns).unwrap_or_else(|| panic!("step {step}: no run read"));
        assert_eq!(run.layer_generation, cluster.generation, "step {step}: {run:?}");
        let after = dir.stored_layer().unwrap().unwrap();
        stale.get_or_insert((before, after));
    }
    // Control: the first step's change again, built for the layer the pod held then: refused
    // whole, the pod's table as it was.
    let (from, to) = stale.unwrap();
    let change = layer::LayerChange::between(&from.for_pod(0xae71), &to.for_pod(0xae71)).unwrap().unwrap();
    let listing = || ns.exec("nft", &["list", "table", "ip", "aether_services"]);
    let was = listing();
    assert!(netns.run(|| change.send()).unwrap().is_err(), "the kernel took a change built for another layer");
    assert_eq!(listing(), was, "a refused change left something behind");
    // The pod misses a generation (applied to the stored files only, as by a process that
    // saw no pod): the pod's name, read from its table, is of neither layer: rebuilt.
    remove_record(&state, "a");
    apply_change(&dir, &cluster.random_change(&mut rng)).unwrap();
    StateDir::new(&state)
        .write(&Record { netns_id: Some(NetnsIdentity::of(&netns)), ..Record::bare("a", &ns.path()) })
        .unwrap();
    let report = applier.apply(&cluster.random_change(&mut rng)).unwrap();
    assert_eq!(outcomes(&report)[0].1, "rebuilt", "{:?}", outcomes(&report));
    assert_eq!(named(), cluster.generation, "the rebuild named its layer");
    assert!(crate::services::applied_run(&state, &netns).is_none(), "a rebuilt pod has no run");
    drop(ns);
    let _ = std::fs::remove_dir_all(&state);
}

#[test]
fn an_element_change_waits_for_no_pod_lock_and_a_rebuild_waits_for_its_own() {
    if !root_or_skip("an_element_change_waits_for_no_pod_lock_and_a_rebuild_waits_for_its_own") {
        return;
    }
    let state = tmp("lockfree");
    let mut cluster = Cluster::of(4);
    let mut applier = Applier::new(&state);
    applier.apply(&cluster.whole()).unwrap();
    let (a, b) = (add_pod(&state, "a"), add_pod(&state, "b"));
    let named = |ns: &TestNetns| match Netns::open_foreign(ns.path()).unwrap().run(layer::held).unwrap().unwrap() {
        layer::HeldLayer::Named(n) => Some(n.id.generation),
        _ => None,
    };
    // Each pod's lock held as an ADD, DEL or repair of it would hold it (another open of its
    // netns, as another process's). Pod b has lost its layer: it needs a rebuild.
    let (a_open, b_open) = (Netns::open_foreign(a.path()).unwrap(), Netns::open_foreign(b.path()).unwrap());
    let a_lock = a_open.lock().unwrap();
    let b_lock = b_open.lock().unwrap();
    b.exec("nft", &["delete", "table", "ip", layer::TABLE]);
    let doc = cluster.random_change(&mut Rng::new(11));
    let generation = cluster.generation;
    let (a_changed, b_untouched, outcomes) = std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        let applier = &mut applier;
        s.spawn(move || tx.send(applier.apply(&doc).map(|r| outcomes(&r))).unwrap());
        // Pod a takes the element change while its lock is held; pod b is not rebuilt
        // behind its lock's holder. (Both locks let go before anything is asserted.)
        let a_changed = eventually(|| named(&a) == Some(generation));
        let b_untouched = named(&b).is_none();
        drop((a_lock, b_lock));
        (a_changed, b_untouched, rx.recv_timeout(std::time::Duration::from_secs(60)))
    });
    assert!(a_changed, "the element change waited for pod a's lock");
    assert!(b_untouched, "pod b was rebuilt while another held its lock");
    let outcomes = outcomes.expect("the apply ended").unwrap();
    assert!(outcomes.len() == 2 && outcomes[0].1.starts_with("elements") && outcomes[1].1 == "rebuilt", "{outcomes:?}");
    assert_eq!(named(&b), Some(generation), "pod b was rebuilt once its lock was let go");
    let _ = std::fs::remove_dir_all(&state);
}
