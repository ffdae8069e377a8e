use super::*;

fn sandbox(id: &str, ns: &str, name: &str, created_at: i64) -> Sandbox {
    Sandbox { created_at, ..crate::reconcile::fixtures::sandbox(id, ns, name) }
}

fn view(s: Sandbox, wants: Wants) -> SandboxView {
    let network =
        Some(Ok(PodNetwork { netns: SandboxNetns::Pod(format!("/run/netns/{}", s.id)), ips: vec!["10.1.0.5".into()] }));
    SandboxView { sandbox: s, wants, network }
}

fn record(id: &str, name: &str) -> RecordView {
    RecordView {
        key: format!("net/{id}/eth0"),
        sandbox_id: id.into(),
        pod: PodRef { namespace: "shop".into(), name: name.into(), uid: format!("uid-{name}") },
        netns: format!("/run/netns/{id}"),
    }
}

struct World {
    sandboxes: Vec<SandboxView>,
    records: Vec<(RecordView, Observation)>,
    runtime_error: Option<String>,
    node_not_ready: Option<String>,
    now: Instant,
}

impl World {
    fn new() -> World {
        World { sandboxes: vec![], records: vec![], runtime_error: None, node_not_ready: None, now: Instant::now() }
    }
    fn plan(&self, limits: &Limits, memory: &Memory) -> Plan {
        let input = Input {
            runtime: match &self.runtime_error {
                Some(e) => Err(e.as_str()),
                None => Ok(&self.sandboxes),
            },
            records: &self.records,
            node_ready: match &self.node_not_ready {
                Some(e) => Err(e.as_str()),
                None => Ok(()),
            },
            now: self.now,
        };
        plan(&input, limits, memory)
    }
    fn state_of(plan: &Plan, id: &str) -> (PodState, Option<Held>) {
        let f = plan.findings.iter().find(|f| f.sandbox_id == id).unwrap_or_else(|| panic!("no finding for {id}"));
        (f.state, f.held.clone())
    }
}

fn limits(missed: MissedPolicy) -> Limits {
    Limits { missed, ..Limits::default() }
}

#[test]
fn a_missed_pod_is_handled_by_policy() {
    let mut w = World::new();
    w.sandboxes.push(view(sandbox("a", "shop", "cart", 1), Wants::Capture));
    let p = w.plan(&limits(MissedPolicy::Restart), &Memory::default());
    assert_eq!(p.actions, vec![Action::Restart { sandbox_id: "a".into(), pod: PodRef::of(&w.sandboxes[0].sandbox) }]);
    assert_eq!(World::state_of(&p, "a"), (PodState::Missed, None));

    let p = w.plan(&limits(MissedPolicy::Capture), &Memory::default());
    assert_eq!(
        p.actions,
        vec![Action::Capture {
            sandbox_id: "a".into(),
            pod: PodRef::of(&w.sandboxes[0].sandbox),
            netns: "/run/netns/a".into(),
            ips: vec!["10.1.0.5".into()],
        }]
    );

    let p = w.plan(&limits(MissedPolicy::Report), &Memory::default());
    assert!(p.actions.is_empty());
    assert_eq!(World::state_of(&p, "a"), (PodState::Missed, Some(Held::Reported)));
}

#[test]
fn excluded_disabled_invalid_host_network_and_not_ready_sandboxes_are_never_acted_on() {
    let mut w = World::new();
    w.sandboxes.push(view(sandbox("k", "kube-system", "dns", 1), Wants::Excluded));
    w.sandboxes.push(view(sandbox("d", "shop", "off", 2), Wants::Disabled));
    w.sandboxes.push(view(sandbox("i", "shop", "bad", 3), Wants::Invalid("pod annotation x is invalid".into())));
    let mut host = view(sandbox("h", "shop", "host", 4), Wants::Capture);
    host.network = Some(Ok(PodNetwork { netns: SandboxNetns::Node, ips: vec![] }));
    w.sandboxes.push(host);
    let mut creating = sandbox("n", "shop", "creating", 5);
    creating.state = SandboxState::NotReady;
    w.sandboxes.push(view(creating, Wants::Capture));
    let mut unknown = view(sandbox("u", "shop", "unknown", 6), Wants::Capture);
    unknown.network = Some(Err("PodSandboxStatus failed".into()));
    w.sandboxes.push(unknown);
    for policy in [MissedPolicy::Restart, MissedPolicy::Capture] {
        let p = w.plan(&limits(policy), &Memory::default());
        assert!(p.actions.is_empty(), "{policy:?}: {:?}", p.actions);
        assert_eq!(World::state_of(&p, "k").0, PodState::Excluded);
        assert_eq!(World::state_of(&p, "d").0, PodState::Disabled);
        assert_eq!(
            World::state_of(&p, "i"),
            (PodState::Invalid, Some(Held::Invalid("pod annotation x is invalid".into())))
        );
        assert_eq!(World::state_of(&p, "h").0, PodState::HostNetwork);
        assert_eq!(World::state_of(&p, "n").0, PodState::NotReady);
        assert_eq!(World::state_of(&p, "u").1, Some(Held::NetnsUnknown("PodSandboxStatus failed".into())));
    }
    // Negative control: the same sandboxes wanting capture are acted on.
    for v in &mut w.sandboxes {
        v.wants = Wants::Capture;
        v.network = Some(Ok(PodNetwork { netns: SandboxNetns::Pod("/run/netns/x".into()), ips: vec![] }));
    }
    let p = w.plan(&limits(MissedPolicy::Restart), &Memory::default());
    assert_eq!(p.actions.len(), 5, "all ready ones but the not-ready one: {:?}", p.actions);
}

#[test]
fn missed_pods_wait_while_the_node_is_not_ready() {
    let mut w = World::new();
    w.sandboxes.push(view(sandbox("a", "shop", "cart", 1), Wants::Capture));
    w.node_not_ready = Some("primary: no CNI configuration yet".into());
    let p = w.plan(&limits(MissedPolicy::Restart), &Memory::default());
    assert!(p.actions.is_empty());
    assert_eq!(World::state_of(&p, "a").1, Some(Held::NodeNotReady("primary: no CNI configuration yet".into())));
}

#[test]
fn restarts_are_limited_per_pass_oldest_first() {
    let mut w = World::new();
    for i in (0..100).rev() {
        w.sandboxes.push(view(sandbox(&format!("s{i:03}"), "shop", &format!("p{i}"), i), Wants::Capture));
    }
    let l = Limits { actions_per_pass: 5, ..limits(MissedPolicy::Restart) };
    let p = w.plan(&l, &Memory::default());
    let ids: Vec<&str> = p
        .actions
        .iter()
        .map(|a| match a {
            Action::Restart { sandbox_id, .. } => sandbox_id.as_str(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(ids, ["s000", "s001", "s002", "s003", "s004"]);
    assert_eq!(p.findings.iter().filter(|f| f.held == Some(Held::RateLimited)).count(), 95);
}

#[test]
fn a_pod_acted_on_backs_off_and_is_given_up_after_its_attempts() {
    let mut w = World::new();
    w.sandboxes.push(view(sandbox("a", "shop", "cart", 1), Wants::Capture));
    let l = Limits {
        backoff: Duration::from_secs(10),
        backoff_max: Duration::from_secs(25),
        attempts: 3,
        ..limits(MissedPolicy::Restart)
    };
    let pod = PodRef::of(&w.sandboxes[0].sandbox);
    let mut m = Memory::default();
    let t0 = w.now;
    m.acted(&pod, t0, &l);
    // The restarted pod comes back under a new sandbox ID, still uncaptured.
    w.sandboxes[0].sandbox.id = "a2".into();
    w.now = t0 + Duration::from_secs(5);
    let p = w.plan(&l, &m);
    assert!(p.actions.is_empty());
    assert_eq!(World::state_of(&p, "a2").1, Some(Held::BackingOff(Duration::from_secs(5))));
    w.now = t0 + Duration::from_secs(10);
    assert_eq!(w.plan(&l, &m).actions.len(), 1, "backoff over");
    m.acted(&pod, w.now, &l);
    // Doubled: 20 s.
    w.now = t0 + Duration::from_secs(29);
    assert!(w.plan(&l, &m).actions.is_empty());
    w.now = t0 + Duration::from_secs(30);
    assert_eq!(w.plan(&l, &m).actions.len(), 1);
    m.acted(&pod, w.now, &l);
    w.now = t0 + Duration::from_secs(3600);
    let p = w.plan(&l, &m);
    assert!(p.actions.is_empty(), "never restarted in a loop");
    assert_eq!(World::state_of(&p, "a2").1, Some(Held::GaveUp(3)));
    // Seen captured at last: forgotten.
    m.forget(&pod);
    assert_eq!(w.plan(&l, &m).actions.len(), 1);
}

#[test]
fn drift_is_repaired_intact_pods_are_left_alone() {
    let mut w = World::new();
    w.sandboxes.push(view(sandbox("a", "shop", "a", 1), Wants::Capture));
    w.sandboxes.push(view(sandbox("b", "shop", "b", 2), Wants::Capture));
    w.records.push((record("a", "a"), Observation::Intact));
    w.records.push((record("b", "b"), Observation::Drifted(Differences::capture(vec!["rule removed: ...".into()]))));
    let p = w.plan(&limits(MissedPolicy::Restart), &Memory::default());
    assert_eq!(
        p.actions,
        vec![Action::Repair {
            record: "net/b/eth0".into(),
            pod: PodRef::of(&w.sandboxes[1].sandbox),
            differences: vec!["rule removed: ...".into()]
        }]
    );
    assert_eq!(World::state_of(&p, "a").0, PodState::Captured);
    assert_eq!(World::state_of(&p, "b").0, PodState::Drifted);
    assert_eq!(p.settled, vec![PodRef::of(&w.sandboxes[0].sandbox)]);
    // Without the runtime the same holds: drift needs only the record and its netns.
    w.runtime_error = Some("no socket".into());
    let q = w.plan(&limits(MissedPolicy::Restart), &Memory::default());
    assert_eq!(q.actions.len(), 1);
    assert!(matches!(q.actions[0], Action::Repair { .. }));
}

/// A Service layer that differs from the stored one is its own repair (ADD's layer code), and
/// a pod whose capture and layer both differ gets both, capture first; a pod backing off gets
/// neither.
#[test]
fn service_layer_drift_is_its_own_repair_and_comes_after_the_captures() {
    let mut w = World::new();
    w.sandboxes.push(view(sandbox("a", "shop", "a", 1), Wants::Capture));
    w.sandboxes.push(view(sandbox("b", "shop", "b", 2), Wants::Capture));
    let layer = vec!["Service layer: set service_ports: element missing".to_string()];
    w.records.push((record("a", "a"), Observation::Drifted(Differences::services(layer.clone()))));
    let both = Differences { capture: vec!["table ip aether_capture is missing".into()], services: layer.clone() };
    w.records.push((record("b", "b"), Observation::Drifted(both)));
    let l = limits(MissedPolicy::Restart);
    let p = w.plan(&l, &Memory::default());
    let kinds: Vec<(&str, &str)> = p
        .actions
        .iter()
        .map(|a| match a {
            Action::Repair { record, .. } => ("repair", record.as_str()),
            Action::RepairServices { record, differences, .. } => {
                assert_eq!(differences, &layer);
                ("repair-services", record.as_str())
            }
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        kinds,
        vec![("repair-services", "net/a/eth0"), ("repair", "net/b/eth0"), ("repair-services", "net/b/eth0")]
    );
    assert_eq!(World::state_of(&p, "a").0, PodState::Drifted);
    let mut m = Memory::default();
    m.acted(&PodRef::of(&w.sandboxes[0].sandbox), w.now, &l);
    let q = w.plan(&l, &m);
    assert!(q.actions.iter().all(|a| a.pod().name != "a"), "a pod backing off gets nothing: {:?}", q.actions);
}

#[test]
fn leftovers_are_collected_but_not_a_sandbox_being_created() {
    let mut w = World::new();
    let l = Limits { leftover_grace: Duration::from_secs(60), ..limits(MissedPolicy::Restart) };
    let mut m = Memory::default();
    // A pod the runtime lists beside them: the list is this node's runtime's (see
    // `a_list_that_lacks_the_node_s_live_pods_removes_nothing`).
    w.sandboxes.push(view(sandbox("kept", "shop", "kept", 1), Wants::Capture));
    w.records.push((record("kept", "kept"), Observation::Intact));
    w.records.push((record("gone", "gone"), Observation::Intact));
    w.records.push((record("nons", "nons"), Observation::NetnsGone("no such file".into())));
    let collected = |p: &Plan| -> Vec<(String, Leftover)> {
        p.actions
            .iter()
            .map(|a| match a {
                Action::Collect { record, why, .. } => (record.clone(), why.clone()),
                other => panic!("{other:?}"),
            })
            .collect()
    };
    // First seen without its sandbox: it may be one being created (listed only after its
    // ADD); a gone netns is a leftover at once.
    let p = w.plan(&l, &m);
    assert_eq!(collected(&p), vec![("net/nons/eth0".into(), Leftover::NetnsGone("no such file".into()))]);
    assert_eq!(World::state_of(&p, "gone").0, PodState::Captured);
    assert_eq!(p.orphans, vec!["net/gone/eth0".to_string()]);
    m.orphans_seen(&p.orphans, w.now);
    w.records.remove(2);
    w.now += Duration::from_secs(59);
    assert!(w.plan(&l, &m).actions.is_empty(), "within the grace");
    w.now += Duration::from_secs(1);
    let p = w.plan(&l, &m);
    assert_eq!(collected(&p), vec![("net/gone/eth0".into(), Leftover::SandboxGone)]);
    assert_eq!(World::state_of(&p, "gone").0, PodState::Leftover);
    // Listed again meanwhile (it was being created): forgotten, its grace starts anew.
    w.sandboxes.push(view(sandbox("gone", "shop", "gone", 1), Wants::Capture));
    let p = w.plan(&l, &m);
    assert!(p.orphans.is_empty() && p.actions.is_empty());
    m.orphans_seen(&p.orphans, w.now);
    w.sandboxes.pop();
    assert!(w.plan(&l, &m).actions.is_empty(), "a new grace");
    // Without the runtime, a record without sandbox cannot be told: only a gone netns is
    // a leftover.
    w.runtime_error = Some("connection refused".into());
    w.records.push((record("nons", "nons"), Observation::NetnsGone("no such file".into())));
    let q = w.plan(&l, &m);
    assert_eq!(q.actions.len(), 1);
    assert!(matches!(&q.actions[0], Action::Collect { why: Leftover::NetnsGone(_), .. }));
    assert!(q.orphans.is_empty());
}

/// Absence from a list removes a capture only when the list is otherwise consistent with the
/// node: an empty list, another runtime's list, or one that lost most of the node's live pods
/// collects nothing and restarts nothing; a netns that is gone is still collected, drift still
/// repaired. On main an empty list collected every live pod.
#[test]
fn a_list_that_lacks_the_node_s_live_pods_removes_nothing() {
    let l = Limits { leftover_grace: Duration::ZERO, ..limits(MissedPolicy::Restart) };
    let mut w = World::new();
    for id in ["a", "b", "c"] {
        w.records.push((record(id, id), Observation::Intact));
    }
    w.records.push((record("d", "d"), Observation::Drifted(Differences::capture(vec!["x".into()]))));
    w.records.push((record("nons", "nons"), Observation::NetnsGone("no such file".into())));
    let mut m = Memory::default();
    let kinds = |p: &Plan| -> Vec<(&'static str, String)> {
        p.actions
            .iter()
            .map(|a| match a {
                Action::Collect { record, .. } => ("collect", record.clone()),
                Action::Repair { record, .. } => ("repair", record.clone()),
                Action::Restart { sandbox_id, .. } => ("restart", sandbox_id.clone()),
                other => panic!("{other:?}"),
            })
            .collect()
    };
    let only_evidence = vec![("repair", "net/d/eth0".to_string()), ("collect", "net/nons/eth0".to_string())];
    // Empty: a runtime restarting, or one that lost its state.
    for _ in 0..3 {
        let p = w.plan(&l, &m);
        assert!(p.suspect.as_deref().is_some_and(|w| w.contains("lists no sandbox, yet 4 pods")), "{:?}", p.suspect);
        assert_eq!(kinds(&p), only_evidence);
        assert!(p.orphans.is_empty(), "absence from a suspect list starts no grace");
        m.orphans_seen(&p.orphans, w.now);
    }
    assert_eq!(World::state_of(&w.plan(&l, &m), "a").0, PodState::Captured);
    // Another runtime's socket: its own pods, none of the node's. Not missed pods either.
    w.sandboxes.push(view(sandbox("other-1", "ci", "runner", 1), Wants::Capture));
    let p = w.plan(&l, &m);
    assert!(p.suspect.as_deref().is_some_and(|w| w.contains("lacks 4 of the 4")), "{:?}", p.suspect);
    assert_eq!(kinds(&p), only_evidence, "nothing restarted from another runtime's list");
    // Shrunk below half of the node's live pods: still suspect.
    w.sandboxes.push(view(sandbox("a", "shop", "a", 1), Wants::Capture));
    let p = w.plan(&l, &m);
    assert!(p.suspect.is_some() && kinds(&p) == only_evidence, "{:?} {:?}", p.suspect, p.actions);
    // Half or more listed: the list is believed, the missing ones are leftovers and the
    // unrecorded ready sandbox is a missed pod.
    w.sandboxes.push(view(sandbox("b", "shop", "b", 1), Wants::Capture));
    let p = w.plan(&l, &m);
    assert_eq!(p.suspect, None);
    let k = kinds(&p);
    for want in [("collect", "net/c/eth0"), ("collect", "net/d/eth0"), ("restart", "other-1")] {
        assert!(k.contains(&(want.0, want.1.to_string())), "{want:?} in {k:?}");
    }
    // No live pod recorded: nothing a list could remove, any list is believed.
    w.records.retain(|(_, o)| matches!(o, Observation::NetnsGone(_)));
    w.sandboxes.clear();
    assert_eq!(w.plan(&l, &m).suspect, None);
}

#[test]
fn a_not_ready_sandbox_with_a_record_is_left_to_the_runtime() {
    let mut w = World::new();
    let mut s = sandbox("a", "shop", "a", 1);
    s.state = SandboxState::NotReady;
    w.sandboxes.push(view(s, Wants::Capture));
    w.records.push((record("a", "a"), Observation::Drifted(Differences::capture(vec!["x".into()]))));
    let p = w.plan(&limits(MissedPolicy::Restart), &Memory::default());
    assert!(p.actions.is_empty(), "{:?}", p.actions);
    assert_eq!(World::state_of(&p, "a").0, PodState::NotReady);
}

#[test]
fn recorded_sandboxes_are_not_missed_and_unverifiable_records_are_kept() {
    let mut w = World::new();
    w.sandboxes.push(view(sandbox("a", "shop", "a", 1), Wants::Capture));
    w.records.push((record("a", "a"), Observation::Unverifiable("EACCES".into())));
    let p = w.plan(&limits(MissedPolicy::Restart), &Memory::default());
    assert!(p.actions.is_empty());
    assert_eq!(World::state_of(&p, "a"), (PodState::Unverifiable, Some(Held::Unverifiable("EACCES".into()))));
}

#[test]
fn a_repair_that_keeps_failing_backs_off() {
    let mut w = World::new();
    w.sandboxes.push(view(sandbox("a", "shop", "a", 1), Wants::Capture));
    w.records.push((record("a", "a"), Observation::Drifted(Differences::capture(vec!["x".into()]))));
    let l = limits(MissedPolicy::Restart);
    let mut m = Memory::default();
    m.acted(&w.records[0].0.pod, w.now, &l);
    let p = w.plan(&l, &m);
    assert!(p.actions.is_empty());
    assert!(matches!(World::state_of(&p, "a"), (PodState::Drifted, Some(Held::BackingOff(_)))));
}

#[test]
fn policies_parse_by_name() {
    for n in MissedPolicy::NAMES {
        assert_eq!(n.parse::<MissedPolicy>().unwrap().name(), n);
    }
    assert!("delete".parse::<MissedPolicy>().unwrap_err().contains("\"delete\""));
}

/// A pod holding an earlier release's ruleset exactly is captured, counted as such, and
/// migrated, a few per pass (the rest said to be pending, by the ruleset they hold); never
/// drifted, never repaired.
#[test]
fn pods_of_an_earlier_ruleset_are_captured_and_migrated_a_few_per_pass() {
    let mut w = World::new();
    let from = "capture ruleset 1 (an earlier release's)".to_string();
    for (i, id) in ["a", "b", "c"].into_iter().enumerate() {
        w.sandboxes.push(view(sandbox(id, "shop", id, i as i64), Wants::Capture));
        w.records.push((record(id, id), Observation::MigrationPending { from: from.clone() }));
    }
    let lim = Limits { migrations_per_pass: 2, ..limits(MissedPolicy::Restart) };
    let p = w.plan(&lim, &Memory::default());
    let migrated: Vec<&str> = p
        .actions
        .iter()
        .map(|a| match a {
            Action::Migrate { record, from: f, .. } => {
                assert_eq!(*f, from);
                record.as_str()
            }
            other => panic!("only migrations: {other:?}"),
        })
        .collect();
    assert_eq!(migrated, ["net/a/eth0", "net/b/eth0"], "two per pass");
    for id in ["a", "b"] {
        assert_eq!(World::state_of(&p, id), (PodState::Captured, None));
    }
    let (state, held) = World::state_of(&p, "c");
    assert_eq!(state, PodState::Captured, "counted as captured while it waits");
    assert_eq!(held.map(|h| h.to_string()), Some(format!("{from}; migration pending")));
    assert!(p.findings.iter().all(|f| f.state != PodState::Drifted));
    // No migration budget: every one pending, nothing done.
    let none = w.plan(&Limits { migrations_per_pass: 0, ..lim }, &Memory::default());
    assert!(none.actions.is_empty());
}
