//! The pass over fakes of the runtime and the node (in the spirit of youki's fake netlink
//! client): what it asks, what it does, what it reports.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use aether_cri::{Sandbox, SandboxNetns, SandboxState};

use super::*;

#[derive(Default)]
struct FakeRuntime {
    sandboxes: Vec<Sandbox>,
    netns: HashMap<String, PodNetwork>,
    /// Every call, in order.
    calls: Vec<String>,
    fail_list: Option<String>,
    /// Calls a pass may make, if bounded.
    budget: Option<usize>,
    /// Every call of this runtime and of the node sharing it, in order.
    order: Order,
}

/// The calls of a runtime and a node, in the order they came.
type Order = std::sync::Arc<std::sync::Mutex<Vec<String>>>;

impl Runtime for FakeRuntime {
    type Error = String;
    fn budget_spent(&self) -> bool {
        self.budget.is_some_and(|b| self.calls.len() >= b)
    }
    fn sandboxes(&mut self) -> Result<Vec<Sandbox>, String> {
        self.calls.push("list".into());
        self.order.lock().unwrap().push("list".into());
        match &self.fail_list {
            Some(e) => Err(e.clone()),
            None => Ok(self.sandboxes.clone()),
        }
    }
    fn network(&mut self, id: &str) -> Result<PodNetwork, String> {
        self.calls.push(format!("status {id}"));
        self.netns.get(id).cloned().ok_or_else(|| format!("NotFound: {id}"))
    }
    fn stop(&mut self, id: &str) -> Result<(), String> {
        self.calls.push(format!("stop {id}"));
        let s = self.sandboxes.iter_mut().find(|s| s.id == id).ok_or_else(|| format!("NotFound: {id}"))?;
        s.state = SandboxState::NotReady;
        Ok(())
    }
}

/// A node whose records and netns are a map: drift is a flag, repair clears it.
#[derive(Default)]
struct FakeNode {
    records: BTreeMap<String, (RecordView, Observation)>,
    calls: Vec<String>,
    fail_repair: bool,
    /// A record an ADD writes just after the pass's first read of the records.
    written_after_the_read: Option<(RecordView, Observation)>,
    /// What the next repair answers instead (an error text), if anything.
    repair_answer: Option<String>,
    /// Repairs leave the drift in place (something in the pod undoes them).
    fought: bool,
    /// Repairs of the Service layer leave its drift in place too.
    fought_services: bool,
    /// In-place captures are refused (the netns is another record's).
    refuse_capture: bool,
    /// Shared with the runtime: see [`FakeRuntime::order`].
    order: Order,
}

impl NodeOps for FakeNode {
    type Error = String;
    fn wants(&self, s: &Sandbox) -> Wants {
        if s.namespace == "kube-system" {
            return Wants::Excluded;
        }
        match s.annotations.get("aether.io/capture").map(String::as_str) {
            None | Some("redirect-all") | Some("scoped") => Wants::Capture,
            Some("disabled") => Wants::Disabled,
            Some(v) => Wants::Invalid(format!("pod annotation aether.io/capture={v:?} is invalid")),
        }
    }
    fn records(&mut self) -> Result<Vec<RecordView>, String> {
        let read = self.records.values().map(|(r, _)| r.clone()).collect();
        if let Some((r, o)) = self.written_after_the_read.take() {
            self.records.insert(r.key.clone(), (r, o));
        }
        Ok(read)
    }
    fn observe(&mut self, r: &RecordView) -> Observation {
        self.records[&r.key].1.clone()
    }
    fn outcome_of(&self, e: &String) -> Option<Outcome> {
        if e.starts_with("gone:") {
            Some(Outcome::Moot(e.clone()))
        } else if e.starts_with("owned:") {
            Some(Outcome::Refused(e.clone()))
        } else {
            None
        }
    }
    fn repair(&mut self, r: &RecordView) -> Result<(), String> {
        self.calls.push(format!("repair {}", r.key));
        self.order.lock().unwrap().push(format!("repair {}", r.key));
        if let Some(answer) = self.repair_answer.take() {
            return Err(answer);
        }
        if self.fail_repair {
            return Err("netlink: EPERM".into());
        }
        if !self.fought {
            self.cleared(&r.key, |d| d.capture.clear());
        }
        Ok(())
    }
    fn repair_services(&mut self, r: &RecordView) -> Result<(), String> {
        self.calls.push(format!("repair-services {}", r.key));
        if self.fail_repair {
            return Err("netlink: EPERM".into());
        }
        if !self.fought_services {
            self.cleared(&r.key, |d| d.services.clear());
        }
        Ok(())
    }
    fn migrate(&mut self, r: &RecordView) -> Result<(), String> {
        self.calls.push(format!("migrate {}", r.key));
        if self.fail_repair {
            return Err("netlink: EPERM".into());
        }
        self.records.get_mut(&r.key).unwrap().1 = Observation::Intact;
        Ok(())
    }
    fn collect(&mut self, r: &RecordView, _: &Leftover) -> Result<(), String> {
        self.calls.push(format!("collect {}", r.key));
        self.records.remove(&r.key);
        Ok(())
    }
    fn capture(&mut self, s: &Sandbox, netns: &str, ips: &[String]) -> Result<(), String> {
        self.calls.push(format!("capture {} {netns} {}", s.id, ips.join(",")));
        if self.refuse_capture {
            return Err(format!("owned: the netns {netns} is another record's"));
        }
        let r = RecordView {
            key: format!("net/{}/eth0", s.id),
            sandbox_id: s.id.clone(),
            pod: PodRef::of(s),
            netns: netns.into(),
        };
        self.records.insert(r.key.clone(), (r, Observation::Intact));
        Ok(())
    }
}

impl FakeNode {
    /// A repair: the part it repairs cleared, intact once nothing is left.
    fn cleared(&mut self, key: &str, part: impl FnOnce(&mut Differences)) {
        let obs = &mut self.records.get_mut(key).unwrap().1;
        if let Observation::Drifted(d) = obs {
            part(d);
            if d.is_empty() {
                *obs = Observation::Intact;
            }
        }
    }
}

fn pod_network(netns: &str) -> PodNetwork {
    PodNetwork { netns: SandboxNetns::Pod(netns.into()), ips: vec!["10.1.0.7".into()] }
}

fn sandbox(id: &str, ns: &str, name: &str, annotations: &[(&str, &str)]) -> Sandbox {
    let annotations = annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    Sandbox { annotations, ..super::fixtures::sandbox(id, ns, name) }
}

fn node_with_record(id: &str, name: &str, obs: Observation) -> FakeNode {
    let mut n = FakeNode::default();
    let r = RecordView {
        key: format!("net/{id}/eth0"),
        sandbox_id: id.into(),
        pod: PodRef { namespace: "shop".into(), name: name.into(), uid: format!("uid-{name}") },
        netns: format!("/run/netns/{id}"),
    };
    n.records.insert(r.key.clone(), (r, obs));
    n
}

fn node_pods() -> FakeRuntime {
    let mut rt = FakeRuntime {
        sandboxes: vec![
            sandbox("missed", "shop", "cart", &[]),
            sandbox("system", "kube-system", "dns", &[]),
            sandbox("off", "shop", "legacy", &[("aether.io/capture", "disabled")]),
            sandbox("bad", "shop", "weird", &[("aether.io/capture", "sideways")]),
        ],
        ..Default::default()
    };
    for s in &rt.sandboxes {
        rt.netns.insert(s.id.clone(), pod_network(&format!("/run/netns/{}", s.id)));
    }
    rt
}

#[test]
fn restart_stops_only_the_missed_sandbox_and_asks_its_status_only() {
    let mut r = Reconciler::new(Some(node_pods()), FakeNode::default(), Limits::default());
    let report = r.pass(Ok(()));
    let rt = r.runtime.as_ref().unwrap();
    assert_eq!(rt.calls, ["list", "status missed", "stop missed"], "statuses are asked only for missed pods");
    assert_eq!(report.actions.len(), 1);
    assert_eq!(report.actions[0].1, Outcome::Done);
    assert_eq!(
        (report.count(PodState::Missed), report.count(PodState::Excluded), report.count(PodState::Disabled)),
        (1, 1, 1)
    );
    assert_eq!(report.count(PodState::Invalid), 1);
    assert!(r.node.calls.is_empty(), "nothing programmed: {:?}", r.node.calls);
    // The next pass sees the stopped sandbox not ready: nothing more is done to it.
    let report = r.pass(Ok(()));
    assert!(report.actions.is_empty(), "{:?}", report.actions);
    assert_eq!(r.runtime.as_ref().unwrap().calls.iter().filter(|c| c.starts_with("stop")).count(), 1);
}

#[test]
fn a_pod_whose_add_finishes_while_the_pass_reads_the_records_is_not_taken_for_missed() {
    // The sandbox is listed ready (its ADD done) after the pass read the records without it.
    let mut node = FakeNode::default();
    node.written_after_the_read =
        node_with_record("missed", "cart", Observation::Intact).records.pop_first().map(|(_, v)| v);
    let mut r = Reconciler::new(Some(node_pods()), node, Limits::default());
    let report = r.pass(Ok(()));
    assert!(report.actions.is_empty(), "a freshly captured pod restarted: {:?}", report.actions);
    assert!(
        !r.runtime.as_ref().unwrap().calls.iter().any(|c| c.contains("missed")),
        "{:?}",
        r.runtime.as_ref().unwrap().calls
    );
    assert_eq!(report.count(PodState::Missed), 0);
    // The next pass reads both: the pod is captured.
    let report = r.pass(Ok(()));
    assert_eq!((report.count(PodState::Captured), report.actions.len()), (1, 0));
    // The control: with no such record, the same sandbox is missed and restarted.
    let mut r = Reconciler::new(Some(node_pods()), FakeNode::default(), Limits::default());
    assert_eq!(r.pass(Ok(())).count(PodState::Missed), 1);
}

#[test]
fn capture_programs_in_place_and_the_next_pass_sees_it_captured() {
    let limits = Limits { missed: MissedPolicy::Capture, ..Limits::default() };
    let mut r = Reconciler::new(Some(node_pods()), FakeNode::default(), limits);
    let report = r.pass(Ok(()));
    assert_eq!(r.node.calls, ["capture missed /run/netns/missed 10.1.0.7"]);
    assert_eq!(report.actions[0].1, Outcome::Done);
    let report = r.pass(Ok(()));
    assert!(report.actions.is_empty());
    assert_eq!(report.count(PodState::Captured), 1);
    assert_eq!(r.memory().attempts(&PodRef::of(&node_pods().sandboxes[0])), 0, "a captured pod's history is forgotten");
}

#[test]
fn report_changes_nothing() {
    let limits = Limits { missed: MissedPolicy::Report, ..Limits::default() };
    let mut r = Reconciler::new(Some(node_pods()), FakeNode::default(), limits);
    let report = r.pass(Ok(()));
    assert!(report.actions.is_empty() && r.node.calls.is_empty());
    assert!(!r.runtime.as_ref().unwrap().calls.iter().any(|c| c.starts_with("stop")));
    let f = report.findings.iter().find(|f| f.sandbox_id == "missed").unwrap();
    assert_eq!((f.state, f.held.clone()), (PodState::Missed, Some(Held::Reported)));
}

#[test]
fn drift_is_repaired_once_and_intact_pods_are_not_touched() {
    let mut node =
        node_with_record("a", "a", Observation::Drifted(Differences::capture(vec!["policy rule removed".into()])));
    let intact = node_with_record("b", "b", Observation::Intact);
    node.records.extend(intact.records);
    let rt = FakeRuntime {
        sandboxes: vec![sandbox("a", "shop", "a", &[]), sandbox("b", "shop", "b", &[])],
        ..Default::default()
    };
    let mut r = Reconciler::new(Some(rt), node, Limits::default());
    let report = r.pass(Ok(()));
    assert_eq!(r.node.calls, ["repair net/a/eth0"]);
    assert_eq!(report.count(PodState::Drifted), 1);
    assert_eq!(r.runtime.as_ref().unwrap().calls, ["list"], "no status for recorded pods");
    r.pass(Ok(()));
    assert_eq!(r.node.calls, ["repair net/a/eth0"], "repaired: nothing more to do");
    // Drift again right away: repaired again (a successful repair starts no backoff).
    r.node.records.get_mut("net/a/eth0").unwrap().1 =
        Observation::Drifted(Differences::capture(vec!["table deleted".into()]));
    r.pass(Ok(()));
    assert_eq!(r.node.calls, ["repair net/a/eth0", "repair net/a/eth0"]);
}

#[test]
fn a_pod_whose_capture_and_service_layer_drifted_gets_both_repairs_in_one_pass() {
    let both = Differences { capture: vec!["route missing".into()], services: vec!["Service layer: x".into()] };
    let node = node_with_record("a", "a", Observation::Drifted(both));
    let mut r = Reconciler::new(None::<FakeRuntime>, node, Limits::default());
    let report = r.pass(Ok(()));
    assert_eq!(r.node.calls, ["repair net/a/eth0", "repair-services net/a/eth0"]);
    let kinds: Vec<&str> = report.actions.iter().map(|(a, _)| action_kind(a)).collect();
    assert_eq!(kinds, ["repair", "repair-services"]);
    let report = r.pass(Ok(()));
    assert!(report.actions.is_empty() && report.count(PodState::Captured) == 1, "{:?}", report.actions);
    // Only the layer again: only its repair.
    r.node.records.get_mut("net/a/eth0").unwrap().1 = Observation::Drifted(Differences::services(vec!["y".into()]));
    r.pass(Ok(()));
    assert_eq!(r.node.calls.last().map(String::as_str), Some("repair-services net/a/eth0"));
    assert_eq!(r.node.calls.len(), 3);
}

#[test]
fn a_repair_that_fails_is_reported_and_backs_off() {
    let mut node = node_with_record("a", "a", Observation::Drifted(Differences::capture(vec!["x".into()])));
    node.fail_repair = true;
    let mut r = Reconciler::new(None::<FakeRuntime>, node, Limits::default());
    let report = r.pass(Ok(()));
    assert_eq!(report.actions[0].1, Outcome::Failed("netlink: EPERM".into()));
    let report = r.pass(Ok(()));
    assert!(report.actions.is_empty());
    assert!(matches!(report.findings[0].held, Some(Held::BackingOff(_))));
}

#[test]
fn without_the_runtime_drift_and_gone_netns_are_still_handled() {
    let mut node = node_with_record("a", "a", Observation::Drifted(Differences::capture(vec!["x".into()])));
    let gone = node_with_record("g", "g", Observation::NetnsGone("no such file".into()));
    let old = node_with_record("o", "o", Observation::Intact);
    node.records.extend(gone.records);
    node.records.extend(old.records);
    let rt = FakeRuntime {
        fail_list: Some("cannot connect to the runtime's CRI socket /run/containerd/containerd.sock".into()),
        ..Default::default()
    };
    let mut r = Reconciler::new(Some(rt), node, Limits::default());
    let report = r.pass(Ok(()));
    assert_eq!(r.node.calls, ["repair net/a/eth0", "collect net/g/eth0"]);
    assert!(report.runtime_unseen.as_deref().unwrap().contains("containerd.sock"));
    // The record of a pod the runtime cannot confirm or deny is kept.
    assert!(r.node.records.contains_key("net/o/eth0"));
    // No socket configured at all: the same.
    let node = node_with_record("a", "a", Observation::Drifted(Differences::capture(vec!["x".into()])));
    let mut r = Reconciler::new(None::<FakeRuntime>, node, Limits::default());
    let report = r.pass(Ok(()));
    assert_eq!(r.node.calls, ["repair net/a/eth0"]);
    assert_eq!(report.runtime_unseen.as_deref(), Some("no CRI socket configured"));
}

#[test]
fn a_record_whose_sandbox_is_gone_is_collected_once() {
    let mut node = node_with_record("old", "old", Observation::Intact);
    let kept = node_with_record("kept", "kept", Observation::Intact).records.pop_first().unwrap();
    node.records.insert(kept.0, kept.1);
    let limits = Limits { leftover_grace: Duration::ZERO, ..Limits::default() };
    let rt = FakeRuntime { sandboxes: vec![sandbox("kept", "shop", "kept", &[])], ..Default::default() };
    let mut r = Reconciler::new(Some(rt), node, limits);
    let report = r.pass(Ok(()));
    assert_eq!(r.node.calls, ["collect net/old/eth0"]);
    assert_eq!(report.count(PodState::Leftover), 1);
    let report = r.pass(Ok(()));
    assert_eq!(r.node.calls, ["collect net/old/eth0"], "collected once");
    assert_eq!(report.count(PodState::Leftover), 0);
}

/// An empty list from a runtime while pods live: nothing collected, one refusal logged and
/// counted while it lasts, and the list believed again once it lists the node's pods.
#[test]
fn an_empty_list_is_refused_once_and_collects_nothing() {
    let node = node_with_record("live", "live", Observation::Intact);
    let limits = Limits { leftover_grace: Duration::ZERO, ..Limits::default() };
    let mut r = Reconciler::new(Some(FakeRuntime::default()), node, limits);
    let first = r.pass(Ok(()));
    assert!(r.node.calls.is_empty(), "{:?}", r.node.calls);
    assert_eq!(first.refusals.len(), 1);
    assert!(first.refusals[0].new && first.refusals[0].kind == "suspect-list", "{:?}", first.refusals);
    assert_eq!(first.count(PodState::Captured), 1);
    let second = r.pass(Ok(()));
    assert!(r.node.calls.is_empty());
    assert!(!second.refusals[0].new, "refused once, not every pass");
    r.runtime.as_mut().unwrap().sandboxes.push(sandbox("live", "shop", "live", &[]));
    let third = r.pass(Ok(()));
    assert!(third.refusals.is_empty() && r.node.calls.is_empty());
}

#[test]
fn a_sandbox_whose_status_fails_is_held_and_asked_again_after_its_backoff() {
    let mut rt = node_pods();
    rt.netns.clear();
    let limits = Limits { backoff: Duration::ZERO, ..Limits::default() };
    let mut r = Reconciler::new(Some(rt), FakeNode::default(), limits);
    let report = r.pass(Ok(()));
    assert!(report.actions.is_empty());
    let f = report.findings.iter().find(|f| f.sandbox_id == "missed").unwrap();
    assert!(matches!(&f.held, Some(Held::NetnsUnknown(w)) if w.contains("NotFound")), "{f:?}");
    r.runtime.as_mut().unwrap().netns.insert("missed".into(), pod_network("/run/netns/missed"));
    let report = r.pass(Ok(()));
    assert_eq!(report.actions.len(), 1);
    // A known netns is not asked again.
    let statuses = r.runtime.as_ref().unwrap().calls.iter().filter(|c| c.starts_with("status")).count();
    r.runtime.as_mut().unwrap().sandboxes[0].state = SandboxState::Ready;
    r.pass(Ok(()));
    assert_eq!(r.runtime.as_ref().unwrap().calls.iter().filter(|c| c.starts_with("status")).count(), statuses);
}

/// A sandbox whose status fails (a runtime hung on it) is not asked again every pass: its
/// failure is remembered, with the pods' backoff, and the held finding says when it is asked
/// again. On main each pass asked it again (12 such pods stretched a pass to 48 s).
#[test]
fn a_failing_status_is_remembered_not_asked_every_pass() {
    let mut rt = node_pods();
    rt.netns.clear();
    let mut r = Reconciler::new(Some(rt), FakeNode::default(), Limits::default());
    for _ in 0..4 {
        let report = r.pass(Ok(()));
        let f = report.findings.iter().find(|f| f.sandbox_id == "missed").unwrap();
        assert!(matches!(&f.held, Some(Held::NetnsUnknown(w)) if w.contains("NotFound")), "{f:?}");
    }
    let asked = r.runtime.as_ref().unwrap().calls.iter().filter(|c| *c == "status missed").count();
    assert_eq!(asked, 1, "asked once in four passes");
    let report = r.pass(Ok(()));
    let f = report.findings.iter().find(|f| f.sandbox_id == "missed").unwrap();
    assert!(matches!(&f.held, Some(Held::NetnsUnknown(w)) if w.contains("asked again in")), "{f:?}");
}

/// A pass whose budget for the runtime is spent asks nothing more: the sandboxes not asked
/// are held, named so, and asked by a later pass.
#[test]
fn a_spent_budget_asks_nothing_more() {
    let mut rt = node_pods();
    rt.budget = Some(1);
    let mut r = Reconciler::new(Some(rt), FakeNode::default(), Limits::default());
    let report = r.pass(Ok(()));
    let f = report.findings.iter().find(|f| f.sandbox_id == "missed").unwrap();
    assert!(matches!(&f.held, Some(Held::NetnsUnknown(w)) if w.contains("time for the runtime is spent")), "{f:?}");
    assert_eq!(r.runtime.as_ref().unwrap().calls, ["list"]);
}

/// A record that went during the pass (its DEL came): the repair finds nothing to do. Not a
/// failure (no WARN, outcome `moot`), no attempt, no backoff. On main it was "repair failed".
#[test]
fn a_record_gone_during_the_pass_is_no_failed_repair() {
    let mut node = node_with_record("a", "a", Observation::Drifted(Differences::capture(vec!["x".into()])));
    node.repair_answer = Some("gone: the record net/a/eth0 went away before the repair".into());
    let rt = FakeRuntime { sandboxes: vec![sandbox("a", "shop", "a", &[])], ..Default::default() };
    let mut r = Reconciler::new(Some(rt), node, Limits::default());
    let report = r.pass(Ok(()));
    assert!(matches!(&report.actions[..], [(Action::Repair { .. }, Outcome::Moot(_))]), "{:?}", report.actions);
    let pod = report.actions[0].0.pod().clone();
    assert_eq!(r.memory().attempts(&pod), 0, "no attempt, no backoff");
}

/// A sandbox whose in-place capture the node refuses (its netns is another record's) is
/// refused once: one refusal (logged and counted once), never tried again while listed.
/// A sandbox naming a recorded netns path is refused without trying. On main it was captured
/// into the other pod's netns.
#[test]
fn a_capture_into_another_record_s_netns_is_refused_once() {
    let mut rt = node_pods();
    rt.sandboxes.truncate(1);
    let node = FakeNode { refuse_capture: true, ..Default::default() };
    let mut r = Reconciler::new(Some(rt), node, Limits { missed: MissedPolicy::Capture, ..Limits::default() });
    let first = r.pass(Ok(()));
    assert!(matches!(&first.actions[..], [(Action::Capture { .. }, Outcome::Refused(_))]), "{:?}", first.actions);
    assert!(first.refusals.len() == 1 && first.refusals[0].new, "{:?}", first.refusals);
    let second = r.pass(Ok(()));
    assert!(second.actions.is_empty(), "{:?}", second.actions);
    let refusals: Vec<_> = second.refusals.iter().filter(|x| x.kind == "netns-owned").collect();
    assert!(refusals.len() == 1 && !refusals[0].new, "{:?}", second.refusals);
    let third = r.pass(Ok(()));
    assert!(third.actions.is_empty() && third.refusals.len() == 1 && !third.refusals[0].new);

    // A sandbox naming a netns path a record names: refused by the plan, nothing asked.
    let mut node = node_with_record("a", "a", Observation::Intact);
    node.refuse_capture = false;
    let mut rt = FakeRuntime {
        sandboxes: vec![sandbox("a", "shop", "a", &[]), sandbox("intruder", "shop", "x", &[])],
        ..Default::default()
    };
    rt.netns.insert("intruder".into(), pod_network("/run/netns/a"));
    let mut r = Reconciler::new(Some(rt), node, Limits { missed: MissedPolicy::Capture, ..Limits::default() });
    let report = r.pass(Ok(()));
    assert!(report.actions.is_empty(), "{:?}", report.actions);
    assert!(report.refusals.iter().any(|x| x.kind == "netns-owned" && x.new), "{:?}", report.refusals);
}

/// Six sandboxes of one pod (one uid): one restart per pass, and --reconcile-attempts in all.
/// On main five were restarted in one pass with attempts 3.
#[test]
fn duplicate_uids_share_one_pod_s_attempts() {
    let mut rt = FakeRuntime::default();
    for i in 0..6 {
        let id = format!("dup-{i}");
        rt.sandboxes.push(sandbox(&id, "shop", "cart", &[]));
        rt.netns.insert(id.clone(), pod_network(&format!("/run/netns/{id}")));
    }
    let limits = Limits { backoff: Duration::ZERO, attempts: 3, ..Limits::default() };
    let mut r = Reconciler::new(Some(rt), FakeNode::default(), limits);
    for _ in 0..6 {
        let report = r.pass(Ok(()));
        assert!(report.actions.len() <= 1, "{:?}", report.actions);
        // The stopped sandboxes come back ready (the kubelet makes them again).
        for s in &mut r.runtime.as_mut().unwrap().sandboxes {
            s.state = SandboxState::Ready;
        }
    }
    let stops = r.runtime.as_ref().unwrap().calls.iter().filter(|c| c.starts_with("stop")).count();
    assert_eq!(stops, 3, "--reconcile-attempts restarts of the pod in all");
}

/// Drift undone after every repair: after FOUGHT_REPAIRS repairs within the window it is
/// reported once (refusal drift-fought) and backed off instead of repaired every pass. On
/// main it was repaired every pass without end.
#[test]
fn drift_that_is_fought_is_reported_and_backed_off() {
    let mut node = node_with_record("a", "a", Observation::Drifted(Differences::capture(vec!["x".into()])));
    node.fought = true;
    let rt = FakeRuntime { sandboxes: vec![sandbox("a", "shop", "a", &[])], ..Default::default() };
    let mut r = Reconciler::new(Some(rt), node, Limits::default());
    let mut new_refusals = 0;
    for _ in 0..12 {
        let report = r.pass(Ok(()));
        new_refusals += report.refusals.iter().filter(|x| x.kind == "drift-fought" && x.new).count();
    }
    let repairs = r.node.calls.iter().filter(|c| c.starts_with("repair ")).count();
    assert_eq!(repairs, plan::FOUGHT_REPAIRS, "repaired until fought, then backed off: {:?}", r.node.calls);
    assert_eq!(new_refusals, 1, "reported once");
}

/// A pod whose capture and Service layer are both undone after every repair gets two repairs a
/// pass, but is undone once a pass: it is fought after FOUGHT_REPAIRS passes, as a pod with one
/// drift is. Counting each repair (as before) backed it off after three passes.
#[test]
fn a_pass_that_repairs_capture_and_layer_counts_once_toward_fought() {
    let drift = Differences { capture: vec!["x".into()], services: vec!["y".into()] };
    let mut node = node_with_record("a", "a", Observation::Drifted(drift));
    node.fought = true;
    node.fought_services = true;
    let rt = FakeRuntime { sandboxes: vec![sandbox("a", "shop", "a", &[])], ..Default::default() };
    let mut r = Reconciler::new(Some(rt), node, Limits::default());
    let mut fought_at = None;
    for pass in 1..=12 {
        let report = r.pass(Ok(()));
        if fought_at.is_none() && report.refusals.iter().any(|x| x.kind == "drift-fought") {
            fought_at = Some(pass);
        }
    }
    assert_eq!(fought_at, Some(plan::FOUGHT_REPAIRS), "{:?}", r.node.calls);
    let repairs = r.node.calls.iter().filter(|c| c.starts_with("repair ")).count();
    let layer_repairs = r.node.calls.iter().filter(|c| c.starts_with("repair-services ")).count();
    assert_eq!((repairs, layer_repairs), (plan::FOUGHT_REPAIRS, plan::FOUGHT_REPAIRS), "{:?}", r.node.calls);
}

/// A runtime whose listing is the moment the node turns ready (the installer's first install
/// ending while the reconciler's first pass runs), and which tells the test each pass.
struct TurnsReadyDuringThePass {
    inner: FakeRuntime,
    shared: std::sync::Arc<crate::serve::Shared>,
    calls: std::sync::mpsc::Sender<String>,
}

impl Runtime for TurnsReadyDuringThePass {
    type Error = String;
    fn sandboxes(&mut self) -> Result<Vec<Sandbox>, String> {
        self.shared.status.lock().unwrap().not_ready.clear();
        let _ = self.calls.send("list".into());
        self.inner.sandboxes()
    }
    fn network(&mut self, id: &str) -> Result<PodNetwork, String> {
        self.inner.network(id)
    }
    fn stop(&mut self, id: &str) -> Result<(), String> {
        let _ = self.calls.send(format!("stop {id}"));
        self.inner.stop(id)
    }
}

/// The reconciler's thread with a period of an hour over `runtime` and `node`, its node
/// `starting` (not ready) when the first pass begins; the calls its runtime saw within
/// `within` of the start, or its first `enough` (the thread is stopped then).
fn calls_within(tag: &str, runtime: FakeRuntime, node: FakeNode, within: Duration, enough: usize) -> Vec<String> {
    let shared = std::sync::Arc::new(crate::serve::Shared::new());
    let (tx, rx) = std::sync::mpsc::channel();
    let dir = aether_testkit::ScratchDir::new(&format!("ready-pass-{tag}"));
    let rt = TurnsReadyDuringThePass { inner: runtime, shared: shared.clone(), calls: tx };
    let looper = looper::spawn(
        Reconciler::new(Some(rt), node, Limits::default()),
        Duration::from_secs(3600),
        shared,
        dir.0.clone(),
        Stopping::new(),
    )
    .unwrap();
    let deadline = std::time::Instant::now() + within;
    let mut calls = Vec::new();
    while calls.len() < enough {
        let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) else { break };
        match rx.recv_timeout(left) {
            Ok(c) => calls.push(c),
            Err(_) => break,
        }
    }
    looper.stop();
    calls
}

/// A missed pod held by the first pass because the node was not ready yet, the node turning
/// ready while that pass runs: the "ready" pass follows at once and restarts the pod, not
/// the period's end (an hour here; the readiness was looked at only after the pass, so it was
/// never seen to change). Control: a first pass that held nothing for the node's readiness
/// (a drifted record, repaired whatever the readiness) gets no extra pass: it would only
/// redo that pass's work at once, and hid that pass from whoever reads the last pass.
#[test]
fn a_pod_held_for_readiness_gets_the_ready_pass_at_once_and_nothing_else_does() {
    let mut runtime = FakeRuntime { sandboxes: vec![sandbox("missed", "shop", "cart", &[])], ..Default::default() };
    runtime.netns.insert("missed".into(), pod_network("/run/netns/missed"));
    let calls = calls_within("held", runtime, FakeNode::default(), Duration::from_secs(60), 3);
    assert_eq!(calls, ["list", "list", "stop missed"], "the ready pass, long before the period's end");

    let drifted = Observation::Drifted(Differences { capture: vec!["table gone".into()], ..Default::default() });
    let runtime = FakeRuntime { sandboxes: vec![sandbox("web", "shop", "web", &[])], ..Default::default() };
    let calls = calls_within("drift", runtime, node_with_record("web", "web", drifted), Duration::from_secs(2), 2);
    assert_eq!(calls, ["list"], "one pass, then the period: nothing waited for the node to be ready");
}

/// Drift in a recorded pod is repaired before the runtime is asked anything, so a runtime
/// that stalls (each call up to its timeout, a pass up to its budget) never delays it; the
/// pass's plan with the runtime's list does not repair it again, and reports it as before.
/// Negative control: the order (the pass asked the runtime first, then repaired).
#[test]
fn drift_is_repaired_before_the_runtime_is_asked_and_once() {
    let drifted = Observation::Drifted(Differences::capture(vec!["table gone".into()]));
    let mut node = node_with_record("web", "web", drifted);
    let mut listed = sandbox("web", "shop", "web", &[]);
    listed.uid = "uid-web".into();
    let runtime = FakeRuntime { sandboxes: vec![listed], order: node.order.clone(), ..Default::default() };
    node.order = runtime.order.clone();
    let order = runtime.order.clone();
    let mut r = Reconciler::new(Some(runtime), node, Limits::default());
    let report = r.pass(Ok(()));
    assert_eq!(*order.lock().unwrap(), ["repair net/web/eth0", "list"], "the repair waited on the runtime");
    assert_eq!(r.node.calls, ["repair net/web/eth0"], "repaired once");
    assert_eq!(report.actions.len(), 1, "{:?}", report.actions);
    assert!(matches!(&report.actions[0], (Action::Repair { .. }, Outcome::Done)), "{:?}", report.actions);
    assert_eq!(report.count(PodState::Drifted), 1);
    assert!(report.findings.iter().all(|f| f.held.is_none()), "{:?}", report.findings);
    // The next pass finds it intact and does nothing.
    let report = r.pass(Ok(()));
    assert!(report.actions.is_empty(), "{:?}", report.actions);
    assert_eq!(report.count(PodState::Captured), 1);
}

/// Records repaired first never make the pass act on less evidence: with the runtime's list
/// failing, a record whose sandbox the runtime may or may not have is neither collected nor
/// restarted, while the drift of another is repaired (fail-closed, as without the runtime).
#[test]
fn what_needs_the_runtime_s_answer_still_waits_for_it() {
    let drifted = Observation::Drifted(Differences::capture(vec!["table gone".into()]));
    let mut node = node_with_record("web", "web", drifted);
    let other = node_with_record("db", "db", Observation::Intact);
    node.records.extend(other.records);
    let runtime = FakeRuntime { fail_list: Some("deadline exceeded".into()), ..Default::default() };
    let limits = Limits { leftover_grace: Duration::ZERO, ..Default::default() };
    let mut r = Reconciler::new(Some(runtime), node, limits);
    for _ in 0..2 {
        r.pass(Ok(()));
    }
    assert_eq!(r.node.calls, ["repair net/web/eth0"], "only the repair: nothing collected by absence");
    assert_eq!(r.node.records.len(), 2);
}
