//! The agent's change documents (docs/agent.md "Change documents"), in the kernel: what a
//! change leaves in the pods' Service layer is exactly what the whole snapshot of the same
//! content leaves; a refused change changes nothing, neither stored nor in any pod; a change
//! killed mid-apply is made good by the next document; and a change's endpoint flip refuses
//! connections at once and lets them through after the flip back.
//!
//! | claim | test | control (must fail) |
//! | --- | --- | --- |
//! | random changes give the pods (one attached before, one after) the sets of the equivalent whole snapshots | `random_changes_...` | a change with one item dropped (a wrong applier) is caught by the same comparison |
//! | every refusal names its reason and changes nothing: stored files, the pod's table, `services verify` intact | `refused_changes_...` | a good change afterwards is accepted and does change the pod's sets |
//! | SIGKILL at random moments of a change: the next document (change, or whole after a stale base) brings every pod to the stored generation | `a_change_killed_...` | a pod whose set is changed by hand is found by the same check |
//! | a pod changed by an apply killed before its file was written gets the old content when it comes back | `a_pod_changed_by_...` | the same steps with the killed apply's mark removed leave the pod wrong |
//! | a flip to no usable endpoints refuses at once in refuse mode; the flip back passes | `an_endpoint_flip_...` | the same connection before the flip reaches the listener |
//!
//! Root only: without root each test skips with a loud line; with
//! `AETHER_REQUIRE_ROOT_TESTS=1` a skip is a failure. Nothing leaves the namespaces made here.

use std::collections::BTreeSet;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use aether_conformance::cni::cni_bin;
use aether_conformance::layer::{apply, listing as layer_listing};
use aether_conformance::{control, sa, Pod, Probe, Proxy, SimNode, VIP};
use aether_testkit::{root_or_skip, Rng};
use serde_json::{json, Value};

fn node(test: &str, tag: &str) -> Option<SimNode> {
    root_or_skip(test).then(|| SimNode::new(tag))
}

/// The agent's view of the cluster: the whole snapshot it would send.
#[derive(Clone)]
struct Cluster {
    generation: u64,
    mode: &'static str,
    mesh_vips: Vec<String>,
    /// In the order the plugin keeps them: a change appends new Services, replaces in place.
    services: Vec<Value>,
    dialled: u64,
    next_name: u64,
}

impl Cluster {
    fn new() -> Cluster {
        let mut c =
            Cluster { generation: 1, mode: "count", mesh_vips: vec![], services: vec![], dialled: 3600, next_name: 0 };
        for _ in 0..6 {
            let s = c.new_service(&mut Rng::new(7 + c.next_name));
            c.services.push(s);
        }
        c.mesh_vips.push("10.96.5.5".into());
        c
    }

    fn whole(&self) -> Vec<u8> {
        json!({"generation": self.generation, "mode": self.mode, "serviceRanges": ["10.96.0.0/16"],
               "meshVIPs": self.mesh_vips, "services": self.services, "dialledTimeoutSeconds": self.dialled})
        .to_string()
        .into_bytes()
    }

    fn used(&self) -> BTreeSet<String> {
        self.services.iter().map(|s| s["vip"].as_str().unwrap().to_string()).chain(self.mesh_vips.clone()).collect()
    }

    fn fresh_vip(&self, rng: &mut Rng) -> String {
        let used = self.used();
        loop {
            let v = format!("10.96.{}.{}", 1 + rng.below(250), 1 + rng.below(250));
            if !used.contains(&v) && v != "10.96.0.1" {
                return v;
            }
        }
    }

    fn ports(rng: &mut Rng) -> Value {
        let mut ports: Vec<Value> = Vec::new();
        for _ in 0..1 + rng.below(3) {
            let p = json!({"protocol": if rng.chance(3) { "UDP" } else { "TCP" }, "port": 1 + rng.below(65535)});
            if !ports.contains(&p) {
                ports.push(p);
            }
        }
        Value::Array(ports)
    }

    fn new_service(&mut self, rng: &mut Rng) -> Value {
        self.next_name += 1;
        json!({"namespace": format!("ns{}", rng.below(3)), "name": format!("svc{}", self.next_name),
               "vip": self.fresh_vip(rng), "ports": Self::ports(rng), "usableEndpoints": !rng.chance(3)})
    }

    /// A random change of one to four items, applied to the model; the change document.
    fn random_change(&mut self, rng: &mut Rng) -> Value {
        let base = self.generation;
        self.generation += 1 + rng.below(2);
        let mut doc = json!({"baseGeneration": base, "generation": self.generation});
        let (mut put, mut removed, mut flips, mut added, mut unmeshed) = (vec![], vec![], vec![], vec![], vec![]);
        // Names this change already touched: one item per Service.
        let mut touched: BTreeSet<String> = BTreeSet::new();
        let key = |s: &Value| format!("{}/{}", s["namespace"].as_str().unwrap(), s["name"].as_str().unwrap());
        for _ in 0..1 + rng.below(4) {
            match rng.below(8) {
                0 | 1 => {
                    let s = self.new_service(rng);
                    touched.insert(key(&s));
                    put.push(s.clone());
                    self.services.push(s);
                }
                2 if !self.services.is_empty() => {
                    let i = rng.below(self.services.len() as u64) as usize;
                    if touched.insert(key(&self.services[i])) {
                        let mut s = self.services[i].clone();
                        s["ports"] = Self::ports(rng);
                        if rng.chance(2) {
                            s["vip"] = json!(self.fresh_vip(rng));
                        }
                        put.push(s.clone());
                        self.services[i] = s;
                    }
                }
                3 if self.services.len() > 1 => {
                    let i = rng.below(self.services.len() as u64) as usize;
                    if touched.insert(key(&self.services[i])) {
                        let s = self.services.remove(i);
                        removed.push(json!({"namespace": s["namespace"], "name": s["name"]}));
                    }
                }
                4 | 5 if !self.services.is_empty() => {
                    let i = rng.below(self.services.len() as u64) as usize;
                    if touched.insert(key(&self.services[i])) {
                        let usable = !self.services[i]["usableEndpoints"].as_bool().unwrap();
                        self.services[i]["usableEndpoints"] = json!(usable);
                        let s = &self.services[i];
                        flips.push(json!({"namespace": s["namespace"], "name": s["name"], "usableEndpoints": usable}));
                    }
                }
                6 => {
                    let v = self.fresh_vip(rng);
                    added.push(json!(v));
                    self.mesh_vips.push(v);
                }
                7 if !self.mesh_vips.is_empty() && added.is_empty() => {
                    let v = self.mesh_vips.remove(rng.below(self.mesh_vips.len() as u64) as usize);
                    unmeshed.push(json!(v));
                }
                _ => {
                    self.mode = if self.mode == "count" { "refuse" } else { "count" };
                    doc["mode"] = json!(self.mode);
                }
            }
        }
        // The plugin removes before it puts: a Service put after another's removal in the same
        // change is appended, as the model did.
        for (k, v) in [("servicesPut", put), ("servicesRemoved", removed), ("endpoints", flips)] {
            if !v.is_empty() {
                doc[k] = Value::Array(v);
            }
        }
        for (k, v) in [("meshVIPsAdded", added), ("meshVIPsRemoved", unmeshed)] {
            if !v.is_empty() {
                doc[k] = Value::Array(v);
            }
        }
        if rng.chance(10) {
            self.dialled = 60 + rng.below(7200);
            doc["dialledTimeoutSeconds"] = json!(self.dialled);
        }
        doc
    }
}

/// What `services verify` says of each pod (by container ID), and the stored generation.
fn verify(node: &SimNode) -> (Option<u64>, Vec<(String, String)>) {
    let out = node.services(&["verify"], b"");
    assert!(out.ok, "services verify failed:\n{}\n{}", out.stdout, out.stderr);
    let v = out.json();
    let pods = v["pods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["containerID"].as_str().unwrap().to_string(), p["result"].as_str().unwrap().to_string()))
        .collect();
    (v["generation"].as_u64(), pods)
}

/// The stored snapshot's content, order-free (Services by namespace/name, mesh VIPs sorted).
fn stored_content(node: &SimNode) -> Value {
    let text = std::fs::read(node.state_dir().join("services/snapshot.json")).expect("snapshot.json");
    content(&serde_json::from_slice(&text).expect("snapshot.json parses"))
}

fn content(doc: &Value) -> Value {
    // Every document compared here has every member (the canonical form writes them all, and
    // so do the test's whole snapshots): a missing one is a difference, never an empty list.
    let list = |key: &str| doc[key].as_array().cloned().unwrap_or_else(|| panic!("no {key} list in {doc}"));
    let mut services = list("services");
    services.sort_by_key(|s| format!("{}/{}", s["namespace"], s["name"]));
    let mut mesh: Vec<String> = list("meshVIPs").iter().map(|v| v.as_str().unwrap().to_string()).collect();
    mesh.sort();
    json!({"generation": doc["generation"], "mode": doc["mode"], "serviceRanges": doc["serviceRanges"],
           "meshVIPs": mesh, "services": services, "dialledTimeoutSeconds": doc["dialledTimeoutSeconds"]})
}

#[test]
fn random_changes_give_the_pods_the_sets_of_the_equivalent_whole_snapshots() {
    let test = "random_changes_give_the_pods_the_sets_of_the_equivalent_whole_snapshots";
    let Some(mut by_change) = node(test, "chgA") else { return };
    let mut by_whole = SimNode::new("chgB");
    let mut rng = Rng::seeded("AETHER_CHANGE_SEED", test);
    let early = by_change.add_pod("early");
    early.add(json!({}));
    let reference = by_whole.add_pod("ref");
    reference.add(json!({}));
    let mut cluster = Cluster::new();
    apply(&by_change, &cluster.whole());
    apply(&by_whole, &cluster.whole());
    let mut late: Option<Pod> = None;
    let (steps, control_at, late_at) = (24, 12, 8);
    let mut kinds = BTreeSet::new();
    for step in 1..=steps {
        if step == late_at {
            // ADD after changes: the pod is given the layer the changes left in layer.bin.
            let p = by_change.add_pod("late");
            p.add(json!({}));
            late = Some(p);
        }
        let before = cluster.clone();
        let change = cluster.random_change(&mut rng);
        for k in ["servicesPut", "servicesRemoved", "endpoints", "meshVIPsAdded", "meshVIPsRemoved", "mode"] {
            if change.get(k).is_some() {
                kinds.insert(k);
            }
        }
        let when = format!("step {step}: {change}");
        if step == control_at {
            // A wrong applier: the same change with its first list emptied. The comparison
            // below must see it; then both nodes get the whole snapshot and go on.
            let mut wrong = change.clone();
            let dropped = ["servicesPut", "endpoints", "servicesRemoved", "meshVIPsAdded", "meshVIPsRemoved"]
                .into_iter()
                .find(|k| wrong.get(*k).is_some());
            let dropped = match dropped {
                Some(k) => k,
                None => {
                    // A change of mode alone: flip a Service instead, the applier dropping it.
                    let s = before.services[0].clone();
                    cluster.services[0]["usableEndpoints"] = json!(!s["usableEndpoints"].as_bool().unwrap());
                    "endpoints"
                }
            };
            wrong.as_object_mut().unwrap().remove(dropped);
            apply(&by_change, wrong.to_string().as_bytes());
            apply(&by_whole, &cluster.whole());
            let (a, b) = (layer_listing(&early), layer_listing(&reference));
            let stored_differs = stored_content(&by_change) != stored_content(&by_whole);
            control(
                a != b || stored_differs,
                &format!("{when}: a change with {dropped} dropped"),
                format!("{a}\n---\n{b}"),
            );
            cluster.generation += 1;
            apply(&by_change, &cluster.whole());
            apply(&by_whole, &cluster.whole());
        } else {
            apply(&by_change, change.to_string().as_bytes());
            apply(&by_whole, &cluster.whole());
        }
        assert_eq!(stored_content(&by_change), stored_content(&by_whole), "{when}: the stored snapshots differ");
        let want = layer_listing(&reference);
        assert_eq!(layer_listing(&early), want, "{when}: the early pod's layer differs from the whole snapshot's");
        if let Some(p) = &late {
            assert_eq!(layer_listing(p), want, "{when}: the late pod's layer differs from the whole snapshot's");
        }
        let (generation, pods) = verify(&by_change);
        assert_eq!(generation, Some(cluster.generation), "{when}");
        assert!(pods.iter().all(|(_, r)| r == "intact"), "{when}: services verify found drift: {pods:?}");
    }
    println!("{test}: {steps} changes ({kinds:?}) left both pods with the whole snapshots' sets; the wrong applier was caught");
    assert!(kinds.len() >= 4, "too few kinds of change were tried: {kinds:?}");
}

/// `services apply` with `doc`: (exit code, stdout and stderr).
fn try_apply(node: &SimNode, doc: &[u8]) -> (bool, String) {
    let out = node.services(&["apply"], doc);
    (out.ok, format!("{}{}", out.stdout, out.stderr))
}

fn files(node: &SimNode) -> (Vec<u8>, Vec<u8>) {
    let dir = node.state_dir().join("services");
    (std::fs::read(dir.join("snapshot.json")).unwrap(), std::fs::read(dir.join("layer.bin")).unwrap())
}

#[test]
fn refused_changes_name_their_reason_and_change_nothing() {
    let Some(mut node) = node("refused_changes_name_their_reason_and_change_nothing", "chgref") else { return };
    let pod = node.add_pod("a");
    pod.add(json!({}));
    let stored = json!({"generation": 5, "mode": "refuse", "serviceRanges": ["10.96.0.0/16"], "meshVIPs": ["10.96.5.5"],
    "services": [
        {"namespace": "shop", "name": "cart", "vip": "10.96.1.1", "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": true},
        {"namespace": "shop", "name": "legacy", "vip": "10.96.1.2", "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": false}
    ]});
    apply(&node, stored.to_string().as_bytes());
    let (files_before, listing_before) = (files(&node), layer_listing(&pod));
    let svc = |name: &str, vip: &str| json!({"namespace": "shop", "name": name, "vip": vip, "ports": [{"protocol": "TCP", "port": 81}], "usableEndpoints": true});
    let many: Vec<Value> = (0..10_001).map(|i| json!({"namespace": "shop", "name": format!("s{i}")})).collect();
    let huge = format!(
        r#"{{"baseGeneration":5,"generation":6,"servicesRemoved":[{{"namespace":"shop","name":"{}"}}]}}"#,
        "x".repeat(4 << 20)
    );
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("a stale base", json!({"baseGeneration": 4, "generation": 6}).to_string().into(), "baseGeneration: 4 is not the stored generation 5"),
        ("a base from the future", json!({"baseGeneration": 6, "generation": 7}).to_string().into(), "baseGeneration: 6 is not the stored generation 5"),
        ("a generation not newer than its base", json!({"baseGeneration": 5, "generation": 5}).to_string().into(), "generation: 5 is not newer than baseGeneration 5"),
        ("removing a Service that does not exist",
         json!({"baseGeneration": 5, "generation": 6, "servicesRemoved": [{"namespace": "shop", "name": "ghost"}]}).to_string().into(),
         "servicesRemoved[0]: Service shop/ghost is not in the stored generation 5"),
        ("flipping a Service that does not exist",
         json!({"baseGeneration": 5, "generation": 6, "endpoints": [{"namespace": "shop", "name": "ghost", "usableEndpoints": true}]}).to_string().into(),
         "endpoints[0]: Service shop/ghost is not in the result of the change"),
        ("removing a mesh VIP that is not one",
         json!({"baseGeneration": 5, "generation": 6, "meshVIPsRemoved": ["10.96.5.6"]}).to_string().into(),
         "meshVIPsRemoved[0]: 10.96.5.6 is not a mesh VIP"),
        ("adding a mesh VIP twice",
         json!({"baseGeneration": 5, "generation": 6, "meshVIPsAdded": ["10.96.5.5"]}).to_string().into(),
         "meshVIPsAdded[0]: 10.96.5.5 is already a mesh VIP"),
        ("a VIP made a duplicate",
         json!({"baseGeneration": 5, "generation": 6, "servicesPut": [svc("new", "10.96.1.1")]}).to_string().into(),
         "10.96.1.1"),
        ("a VIP outside every range",
         json!({"baseGeneration": 5, "generation": 6, "servicesPut": [svc("new", "10.97.0.1")]}).to_string().into(),
         "10.97.0.1"),
        ("a Service VIP that is a mesh VIP",
         json!({"baseGeneration": 5, "generation": 6, "servicesPut": [svc("new", "10.96.5.5")]}).to_string().into(),
         "10.96.5.5"),
        ("a malformed item, named by its place",
         json!({"baseGeneration": 5, "generation": 6, "servicesPut": [{"namespace": "shop", "name": "x", "vip": "10.96.1.300", "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": true}]}).to_string().into(),
         "servicesPut[0].vip"),
        ("more items than the limit",
         json!({"baseGeneration": 5, "generation": 6, "servicesRemoved": many}).to_string().into(),
         "more than the limit of 10000"),
        ("a document over the limit", huge.into_bytes(), "larger than the limit of 4194304 bytes"),
    ];
    for (what, doc, reason) in &cases {
        let (ok, said) = try_apply(&node, doc);
        assert!(!ok, "{what}: accepted:\n{said}");
        assert!(
            said.contains(reason),
            "{what}: the refusal does not say `{reason}`:\n{}",
            &said[..said.len().min(2000)]
        );
        assert!(said.len() < 8192, "{what}: the refusal echoes too much ({} bytes)", said.len());
        assert!(files(&node) == files_before, "{what}: the stored files changed");
        assert_eq!(layer_listing(&pod), listing_before, "{what}: the pod's Service layer changed");
        let (generation, pods) = verify(&node);
        assert_eq!(generation, Some(5), "{what}");
        assert!(pods.iter().all(|(_, r)| r == "intact"), "{what}: {pods:?}");
    }
    // Control: the same node takes a good change, and it does change the stored files and
    // the pod's sets (so "unchanged" above could have failed).
    let good = json!({"baseGeneration": 5, "generation": 6, "servicesPut": [svc("new", "10.96.1.3")],
                      "endpoints": [{"namespace": "shop", "name": "legacy", "usableEndpoints": true}]});
    let (ok, said) = try_apply(&node, good.to_string().as_bytes());
    assert!(ok, "a good change was refused:\n{said}");
    control(files(&node) != files_before, "a good change leaves the stored files as they were", "");
    let after = layer_listing(&pod);
    control(after != listing_before, "a good change leaves the pod's sets as they were", &after);
    assert!(after.contains("10.96.1.3 . tcp . 81"), "{after}");
    println!("{} refusals, each naming its reason, changed nothing; a good change then did", cases.len());
}

#[test]
fn a_change_killed_mid_apply_is_made_good_by_the_next_document() {
    let test = "a_change_killed_mid_apply_is_made_good_by_the_next_document";
    let Some(mut node) = node(test, "chgkill") else { return };
    let mut rng = Rng::seeded("AETHER_CHANGE_SEED", test);
    let pods: Vec<Pod> = (0..3)
        .map(|i| {
            let p = node.add_pod(&format!("p{i}"));
            p.add(json!({}));
            p
        })
        .collect();
    let mut cluster = Cluster::new();
    for _ in 0..150 {
        let s = cluster.new_service(&mut rng);
        cluster.services.push(s);
    }
    apply(&node, &cluster.whole());
    let state = node.state_dir().display().to_string();
    let spawn = |doc: &[u8]| {
        let mut child = Command::new(cni_bin())
            .args(["services", "--state-dir", &state, "apply"])
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(doc).unwrap();
        child
    };
    // How long a change takes here: kills land anywhere in that span.
    let t = Instant::now();
    let warm = cluster.random_change(&mut rng);
    assert!(spawn(warm.to_string().as_bytes()).wait_with_output().unwrap().status.success());
    let span = t.elapsed().as_micros() as u64 + 1;
    // The cluster as of the agent's last acknowledged generation: its next change is based on it.
    let mut acked = cluster.clone();
    let (mut kills, mut stale, mut trials) = (0u32, 0u32, 0u32);
    while kills < 30 {
        trials += 1;
        assert!(trials < 200, "too few kills landed: {kills} in {trials} trials");
        let _ = cluster.random_change(&mut rng);
        let mut child = spawn(changed_from(&acked, &cluster).to_string().as_bytes());
        std::thread::sleep(Duration::from_micros(rng.below(span)));
        match child.try_wait().unwrap() {
            Some(_) => {
                let out = child.wait_with_output().unwrap();
                assert!(out.status.success(), "trial {trials}: {}", String::from_utf8_lossy(&out.stderr));
                acked = cluster.clone();
                continue;
            }
            None => {
                child.kill().unwrap();
                let _ = child.wait();
                kills += 1;
            }
        }
        // Not acknowledged: the next document carries that change too, from the last
        // acknowledged generation; it is refused as stale when the killed apply had stored
        // its snapshot, and the agent then sends the whole snapshot.
        let _ = cluster.random_change(&mut rng);
        let next =
            if rng.chance(4) { cluster.whole() } else { changed_from(&acked, &cluster).to_string().into_bytes() };
        let (ok, said) = try_apply(&node, &next);
        if !ok {
            assert!(said.contains("is not the stored generation"), "trial {trials}: {said}");
            stale += 1;
            apply(&node, &cluster.whole());
        }
        acked = cluster.clone();
        let when = format!("trial {trials} ({kills} kills)");
        assert_eq!(stored_content(&node), content(&serde_json::from_slice(&cluster.whole()).unwrap()), "{when}");
        let (generation, verified) = verify(&node);
        assert_eq!(generation, Some(cluster.generation), "{when}");
        assert!(
            verified.iter().all(|(_, r)| r == "intact"),
            "{when}: a pod was not at the stored generation: {verified:?}"
        );
    }
    // Control: the same check finds a pod whose set was changed by hand.
    let vip = cluster.services[0]["vip"].as_str().unwrap().to_string();
    pods[1].nft(&["delete", "element", "ip", "aether_services", "service_vips", "{", &vip, "}"]);
    let (_, verified) = verify(&node);
    control(
        verified.iter().any(|(_, r)| r != "intact"),
        "a pod's Service VIP deleted by hand",
        format!("{verified:?}"),
    );
    println!("{test}: {kills} SIGKILLs in {trials} trials ({stale} next changes refused as stale, then whole); every pod at the stored generation after the next document");
}

/// A pod sent a change and the apply killed right after: the pod's table names the new layer
/// it holds (the name moved in the same transaction). The next document bringing the old
/// content back must not find the pod "already there".
#[test]
fn a_pod_changed_by_an_apply_killed_before_its_file_gets_the_content_that_comes_back() {
    let test = "a_pod_changed_by_an_apply_killed_before_its_file_gets_the_content_that_comes_back";
    let Some(mut node) = node(test, "chgback") else { return };
    let pods: Vec<Pod> = (0..2)
        .map(|i| {
            let p = node.add_pod(&format!("p{i}"));
            p.add(json!({}));
            p
        })
        .collect();
    let state = node.state_dir().display().to_string();
    let mut cluster = Cluster::new();
    let flip = |c: &mut Cluster, usable: bool| {
        c.generation += 1;
        c.services[0]["usableEndpoints"] = json!(usable);
    };
    // Returns what `services verify` says of each pod after: A, then B killed after its first
    // pod's send, then A again under a new generation; `lie` makes the first pod's table name
    // what the second's names (layer A) while it holds B, as a record kept apart from the
    // kernel could after a kill.
    let name_in = |pod: &Pod| -> String {
        let listing = pod.nft(&["list", "table", "ip", "aether_services"]);
        let line = listing.lines().find(|l| l.trim_start().starts_with("counter layer_s")).expect("a named layer");
        line.trim().trim_start_matches("counter ").trim_end_matches(" {").to_string()
    };
    let mut trial = |lie: bool| -> Vec<(String, String)> {
        flip(&mut cluster, true);
        apply(&node, &cluster.whole());
        let before = cluster.clone();
        flip(&mut cluster, false);
        let out = Command::new(cni_bin())
            .args(["services", "--state-dir", &state, "apply", "-f", "-"])
            .env_clear()
            .env("AETHER_CNI_CRASH_AT", "services-pod-sent")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                child.stdin.take().unwrap().write_all(&cluster.whole())?;
                child.wait_with_output()
            })
            .unwrap();
        assert!(!out.status.success(), "the apply was not killed: {}", String::from_utf8_lossy(&out.stdout));
        assert_ne!(layer_listing(&pods[0]), layer_listing(&pods[1]), "the killed apply changed no pod, or both");
        assert!(!node.state_dir().join("services/applying").exists(), "a mark mirrors what the kernel holds");
        if lie {
            let (holds, claims) = (name_in(&pods[0]), name_in(&pods[1]));
            assert_ne!(holds, claims, "the killed apply left both pods named alike");
            pods[0].nft(&["delete", "counter", "ip", "aether_services", &holds]);
            pods[0].nft(&["add", "counter", "ip", "aether_services", &claims]);
        }
        cluster = Cluster { generation: cluster.generation + 1, ..before };
        apply(&node, &cluster.whole());
        verify(&node).1
    };
    let verified = trial(false);
    assert!(verified.iter().all(|(_, r)| r == "intact"), "a pod was left with the killed apply's layer: {verified:?}");
    // Control: the same steps with the first pod's name lying leave it wrong, and verify sees
    // it: what the pod's table names is what the next apply goes by.
    let verified = trial(true);
    control(verified.iter().any(|(_, r)| r != "intact"), "the first pod's name made to lie", format!("{verified:?}"));
}

/// The change from `from` to `to` as the agent sends it: Services that differ put whole,
/// those gone removed, mesh VIPs added and removed, mode and timeout.
fn changed_from(from: &Cluster, to: &Cluster) -> Value {
    let key = |s: &Value| (s["namespace"].as_str().unwrap().to_string(), s["name"].as_str().unwrap().to_string());
    let old: std::collections::BTreeMap<_, _> = from.services.iter().map(|s| (key(s), s)).collect();
    let new: std::collections::BTreeMap<_, _> = to.services.iter().map(|s| (key(s), s)).collect();
    let put: Vec<Value> = to.services.iter().filter(|s| old.get(&key(s)) != Some(s)).cloned().collect();
    let removed: Vec<Value> =
        old.keys().filter(|k| !new.contains_key(*k)).map(|(ns, n)| json!({"namespace": ns, "name": n})).collect();
    let added: Vec<&String> = to.mesh_vips.iter().filter(|v| !from.mesh_vips.contains(v)).collect();
    let unmeshed: Vec<&String> = from.mesh_vips.iter().filter(|v| !to.mesh_vips.contains(v)).collect();
    json!({"baseGeneration": from.generation, "generation": to.generation, "mode": to.mode, "dialledTimeoutSeconds": to.dialled,
           "servicesPut": put, "servicesRemoved": removed, "meshVIPsAdded": added, "meshVIPsRemoved": unmeshed})
}

#[test]
fn an_endpoint_flip_refuses_at_once_and_the_flip_back_passes() {
    let Some(mut node) = node("an_endpoint_flip_refuses_at_once_and_the_flip_back_passes", "chgflip") else { return };
    let a = node.add_pod("a");
    a.add(json!({}));
    let proxy = Proxy::start(&a);
    let dst = sa(VIP, 80);
    let reached = Probe::Answer(format!("capture[{}] tcp dst={dst} from={} got=probe", a.name, a.ip));
    apply(
        &node,
        json!({"generation": 1, "mode": "refuse", "serviceRanges": ["10.96.0.0/16"],
               "services": [{"namespace": "shop", "name": "cart", "vip": VIP.to_string(),
                             "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": true}]})
        .to_string()
        .as_bytes(),
    );
    // Control: with endpoints, the connection reaches the capture listener.
    let got = a.tcp(dst);
    control(got != Probe::Refused, "a Service with endpoints, before the flip", &got);
    assert_eq!(got, reached);
    let flip = |base: u64, usable: bool| {
        json!({"baseGeneration": base, "generation": base + 1,
               "endpoints": [{"namespace": "shop", "name": "cart", "usableEndpoints": usable}]})
        .to_string()
    };
    let report = apply(&node, flip(1, false).as_bytes());
    assert_eq!(report["generation"], 2, "{report}");
    let seen = proxy.seen().len();
    assert_eq!(a.tcp(dst), Probe::Refused, "after the flip to no endpoints:\n{}", a.ruleset());
    assert_eq!(proxy.seen().len(), seen, "a refused connection reached the listener");
    apply(&node, flip(2, true).as_bytes());
    assert_eq!(a.tcp(dst), reached, "after the flip back:\n{}", a.ruleset());
}
