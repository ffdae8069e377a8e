//! The reconciler: every pass, the runtime's own pod list against the node's attachment
//! records, pod by pod.
//!
//! - missed pods (ready, wanting capture, no record) are restarted through the CRI, captured
//!   in place, or reported, by policy, within the pass's limit and each pod's backoff;
//! - drifted pods (their netns no longer holds what their record says, or their Service layer
//!   is not the stored one) are repaired to exactly the record's ruleset, and the stored
//!   layer, with ADD's code; a pod whose netns had nothing committed since it was last found
//!   intact costs no table comparison (see `aether_node::drift`);
//! - pods holding an earlier release's capture ruleset, intact as their record says, are
//!   migrated to the current one, a few per pass (an upgrade, never called drift);
//! - leftovers (a record whose sandbox or netns is gone) are collected as GC collects them.
//!
//! The decisions are `plan`'s pure code. This module gathers their inputs through two small
//! traits, [`Runtime`] (the CRI) and [`NodeOps`] (the node's records and a pod's attachment),
//! carries the actions out one by one, and reports the pass. What the records alone decide
//! (drift, migrations, a gone netns) is done before the runtime is asked anything, so a
//! runtime that stalls never delays it. Without the runtime (no socket,
//! errors) the pass still handles drift and leftovers from the records alone, and says that
//! missed pods cannot be seen.

pub mod cri;
#[cfg(test)]
mod fixtures;
pub mod looper;
pub mod metrics;
pub mod node_lib;
pub mod plan;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use aether_cri::Sandbox;
pub use plan::{
    Action, Differences, Finding, Held, Leftover, Limits, Memory, MissedPolicy, Observation, PodNetwork, PodRef,
    PodState, RecordView, Wants,
};
use plan::{Input, SandboxView};

/// The runtime's side: its sandboxes, a sandbox's network, StopPodSandbox.
pub trait Runtime {
    type Error: fmt::Display;
    /// A pass begins: its budget for the runtime starts now.
    fn begin_pass(&mut self) {}
    /// Whether this pass may ask the runtime nothing more (its budget spent, or stopping).
    fn budget_spent(&self) -> bool {
        false
    }
    fn sandboxes(&mut self) -> Result<Vec<Sandbox>, Self::Error>;
    fn network(&mut self, sandbox_id: &str) -> Result<PodNetwork, Self::Error>;
    fn stop(&mut self, sandbox_id: &str) -> Result<(), Self::Error>;
}

/// What the node library does for the reconciler. Each operation that changes something takes
/// the state lock itself and re-reads the record under it, so that it never races an ADD or
/// DEL of the same pod.
pub trait NodeOps {
    type Error: fmt::Display;
    /// What ADD would make of this sandbox's pod (namespace exclusions, annotations).
    fn wants(&self, sandbox: &Sandbox) -> Wants;
    fn records(&mut self) -> Result<Vec<RecordView>, Self::Error>;
    /// The sandboxes that have a record now: read again, apart from this pass's `records`
    /// (which the pass's actions go by).
    fn recorded_sandboxes(&mut self) -> Result<HashSet<String>, Self::Error> {
        Ok(self.records()?.into_iter().map(|r| r.sandbox_id).collect())
    }
    /// The record's netns compared with the record (CHECK's comparison) and with the stored
    /// Service layer.
    fn observe(&mut self, record: &RecordView) -> Observation;
    /// `observe` of each of this pass's records, in order.
    fn observe_all(&mut self, records: &[RecordView]) -> Vec<Observation> {
        records.iter().map(|r| self.observe(r)).collect()
    }
    /// How the last `observe_all` compared the pods.
    fn comparisons(&self) -> Comparisons {
        Comparisons::default()
    }
    /// Re-applies exactly the record's ruleset (ADD's code).
    fn repair(&mut self, record: &RecordView) -> Result<(), Self::Error>;
    /// Rebuilds the pod's Service layer to exactly the stored one (ADD's code).
    fn repair_services(&mut self, record: &RecordView) -> Result<(), Self::Error>;
    /// Replaces the pod's capture ruleset of an earlier release with the current one, and
    /// records that.
    fn migrate(&mut self, record: &RecordView) -> Result<(), Self::Error>;
    /// Collects the record as GC does (its Service counts folded once).
    fn collect(&mut self, record: &RecordView, why: &Leftover) -> Result<(), Self::Error>;
    /// Captures a missed pod in place, in its netns (ADD's code, for the pod's addresses).
    fn capture(&mut self, sandbox: &Sandbox, netns: &str, ips: &[String]) -> Result<(), Self::Error>;
    /// What an action's error says beyond failure, if anything: [`Outcome::Moot`] or
    /// [`Outcome::Refused`].
    fn outcome_of(&self, _error: &Self::Error) -> Option<Outcome> {
        None
    }
}

/// How a pass compared the recorded pods with what they should hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Comparisons {
    /// Tables dumped and compared in full.
    pub full: usize,
    /// Nothing committed in the netns since a full comparison found the pod intact: only
    /// the policy rule and route read back.
    pub unchanged: usize,
}

/// How an action went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Done,
    Failed(String),
    /// Nothing was left to do when it came to it: the record went (the pod's DEL came
    /// during the pass) or changed (a new ADD), or the layer was found as stored when compared
    /// again under the locks (an ADD or apply in flight brought it there). Neither done nor
    /// failed, and no attempt.
    Moot(String),
    /// The node refused it: the netns is another record's. Not tried again for this sandbox.
    Refused(String),
}

impl Outcome {
    pub fn name(&self) -> &'static str {
        match self {
            Outcome::Done => "done",
            Outcome::Failed(_) => "failed",
            Outcome::Moot(_) => "moot",
            Outcome::Refused(_) => "refused",
        }
    }

    pub const NAMES: [&'static str; 4] = ["done", "failed", "moot", "refused"];
}

/// Something the reconciler would have done and refused, for want of evidence or because it
/// would fight someone else: logged once when it starts, counted once
/// (`aether_cni_reconciler_refusals_total{kind}`), and listed in every pass while it lasts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// `suspect-list`, ...
    pub kind: &'static str,
    /// What it is about: a pod, or the runtime.
    pub subject: String,
    pub why: String,
    /// First seen this pass (logged and counted now).
    pub new: bool,
}

/// One pass, as `/metrics`, the log and `inspect` show it.
#[derive(Debug, Clone)]
pub struct PassReport {
    /// Passes since the installer started, this one included.
    pub number: u64,
    pub finished: SystemTime,
    pub took: Duration,
    /// Why the runtime's sandboxes could not be seen, if so: missed pods are then unseen.
    pub runtime_unseen: Option<String>,
    /// Why the records could not be read, if so.
    pub records_unread: Option<String>,
    pub findings: Vec<Finding>,
    pub actions: Vec<(Action, Outcome)>,
    pub compared: Comparisons,
    pub refusals: Vec<Refusal>,
}

impl PassReport {
    pub fn count(&self, state: PodState) -> usize {
        self.findings.iter().filter(|f| f.state == state).count()
    }
}

/// Every kind of [`Refusal`], for the metric's series.
pub const REFUSAL_KINDS: [&str; 3] = ["suspect-list", "netns-owned", "drift-fought"];

/// The kind of an action, for its metric and its log line.
pub fn action_kind(a: &Action) -> &'static str {
    match a {
        Action::Restart { .. } => "restart",
        Action::Capture { .. } => "capture",
        Action::Repair { .. } => "repair",
        Action::RepairServices { .. } => "repair-services",
        Action::Migrate { .. } => "migrate",
        Action::Collect { .. } => "collect",
    }
}

/// A sandbox whose verbose status failed: why, how often, and not before when again.
#[derive(Debug, Clone)]
struct StatusFailure {
    why: String,
    failures: u32,
    next: Instant,
}

/// The reconciler's state between passes.
pub struct Reconciler<R, N> {
    pub runtime: Option<R>,
    pub node: N,
    pub limits: Limits,
    memory: Memory,
    /// Verbose statuses are asked once per sandbox: a sandbox's network does not change.
    network_cache: HashMap<String, PodNetwork>,
    /// Sandboxes whose status failed: not asked again before their backoff ends (a runtime
    /// that hangs on a few sandboxes would otherwise stretch every pass).
    network_failed: HashMap<String, StatusFailure>,
    /// Set when the installer stops: no action starts after it.
    pub stopping: Stopping,
    /// Why each held pod got nothing, as last logged (one line per change, not per pass).
    held_logged: HashMap<String, String>,
    runtime_was_unseen: bool,
    /// The refusals of the last pass, by (kind, subject): one log line when one starts.
    refusing: HashSet<(&'static str, String)>,
    passes: u64,
}

impl<R: Runtime, N: NodeOps> Reconciler<R, N> {
    pub fn new(runtime: Option<R>, node: N, limits: Limits) -> Self {
        Reconciler {
            runtime,
            node,
            limits,
            memory: Memory::default(),
            network_cache: HashMap::new(),
            network_failed: HashMap::new(),
            stopping: Stopping::new(),
            held_logged: HashMap::new(),
            runtime_was_unseen: false,
            refusing: HashSet::new(),
            passes: 0,
        }
    }

    pub fn memory(&self) -> &Memory {
        &self.memory
    }

    /// One pass. `node_ready`: `Err(why)` while the plugin is not chained (missed pods wait).
    pub fn pass(&mut self, node_ready: Result<(), String>) -> PassReport {
        let started = Instant::now();
        let (records, records_unread) = match self.node.records() {
            Ok(r) => (r, None),
            Err(e) => (Vec::new(), Some(format!("cannot read the attachment records: {e}"))),
        };
        let observations = self.node.observe_all(&records);
        let observed: Vec<(RecordView, Observation)> = records.into_iter().zip(observations).collect();
        let records: BTreeMap<&str, &RecordView> = observed.iter().map(|(r, _)| (r.key.as_str(), r)).collect();
        let node_ready = node_ready.as_ref().map(|_| ()).map_err(String::as_str);
        let mut actions = Vec::new();
        let mut refusals = Vec::new();
        // Pods whose drift this pass already counted toward "fought": a pod whose capture and
        // Service layer both drifted gets two repairs in one pass, but was undone once.
        let mut counted_repairs: HashSet<String> = HashSet::new();
        // What the records alone decide (drift repaired, migrations, records whose netns is
        // gone) is done before the runtime is asked, so that a runtime that stalls never
        // delays it; the plan with the runtime's list then decides the rest (missed pods,
        // records whose sandbox is gone, which need its positive answer) on the memory as it
        // was before, and does not do again what was done.
        let memory = self.memory.clone();
        let records_only = Input { runtime: Err("not asked yet"), records: &observed, node_ready, now: Instant::now() };
        let early = plan::plan(&records_only, &self.limits, &self.memory);
        let no_sandboxes = BTreeMap::new();
        for action in early.actions {
            if self.stopping.is_set() {
                break;
            }
            let outcome = self.act(&action, &no_sandboxes, &records, &mut counted_repairs, &mut refusals);
            actions.push((action, outcome));
        }
        let done_early: HashSet<(&'static str, String)> = actions.iter().map(|(a, _)| record_action(a)).collect();
        let listed = match self.runtime.as_mut() {
            None => Err("no CRI socket configured".to_string()),
            Some(rt) => {
                rt.begin_pass();
                rt.sandboxes().map_err(|e| e.to_string())
            }
        };
        let views = match listed {
            Ok(sandboxes) => Ok(self.views(sandboxes, &observed)),
            Err(e) => Err(e),
        };
        match (&views, self.runtime_was_unseen) {
            (Err(why), false) => {
                tracing::warn!("missed pods cannot be seen (drift and leftovers are still handled): {why}");
                self.runtime_was_unseen = true;
            }
            (Ok(_), true) => {
                tracing::info!("the runtime's pod list is readable again");
                self.runtime_was_unseen = false;
            }
            _ => {}
        }
        let input = Input {
            runtime: views.as_ref().map(Vec::as_slice).map_err(String::as_str),
            records: &observed,
            node_ready,
            now: Instant::now(),
        };
        let plan = plan::plan(&input, &self.limits, &memory);
        if let Some(why) = &plan.suspect {
            refusals.push((
                "suspect-list",
                "the runtime's pod list".to_string(),
                format!("{why}: nothing is collected or restarted from it, drift is still repaired"),
            ));
        }
        for pod in &plan.settled {
            self.memory.forget(pod);
        }
        self.memory.orphans_seen(&plan.orphans, input.now);
        let sandboxes: BTreeMap<&str, &Sandbox> = match &views {
            Ok(v) => v.iter().map(|v| (v.sandbox.id.as_str(), &v.sandbox)).collect(),
            Err(_) => BTreeMap::new(),
        };
        for action in plan.actions {
            // The installer is stopping: nothing more starts (what was not done is found again
            // by the next installer's first pass).
            if self.stopping.is_set() {
                break;
            }
            if done_early.contains(&record_action(&action)) {
                continue;
            }
            let outcome = self.act(&action, &sandboxes, &records, &mut counted_repairs, &mut refusals);
            actions.push((action, outcome));
        }
        // Why a pod needing something got nothing: one line when it starts, not per pass
        // (backoff and the pass limit are transient and not logged).
        for f in &plan.findings {
            let Some(held) = &f.held else { continue };
            let kind = match held {
                Held::Reported => "reported",
                Held::GaveUp(_) => "gave-up",
                Held::NodeNotReady(_) => "node-not-ready",
                Held::NetnsUnknown(_) => "netns-unknown",
                Held::Invalid(_) => "invalid",
                Held::Unverifiable(_) => "unverifiable",
                // Logged once as a refusal.
                Held::NetnsOwned(_) => continue,
                Held::RateLimited | Held::BackingOff(_) | Held::MigrationPending(_) | Held::SamePod(_) => continue,
            };
            if self.held_logged.get(&f.sandbox_id).map(String::as_str) != Some(kind) {
                let what = match f.state {
                    PodState::Missed => "missed pod (no capture)",
                    PodState::Drifted => "drifted pod",
                    _ => "pod",
                };
                tracing::warn!(pod = %f.pod, sandbox = %f.sandbox_id, "{what}: {held}");
                self.held_logged.insert(f.sandbox_id.clone(), kind.to_string());
            }
        }
        let seen: HashSet<&str> = plan.findings.iter().map(|f| f.sandbox_id.as_str()).collect();
        self.held_logged.retain(|id, _| seen.contains(id.as_str()));
        if let Ok(v) = &views {
            let live: HashSet<&str> = v.iter().map(|v| v.sandbox.id.as_str()).collect();
            self.network_cache.retain(|id, _| live.contains(id.as_str()));
            self.network_failed.retain(|id, _| live.contains(id.as_str()));
            self.memory.refused_listed(live.iter().copied());
        }
        for f in &plan.findings {
            if let Some(Held::NetnsOwned(why)) = &f.held {
                refusals.push(("netns-owned", format!("{} (sandbox {})", f.pod, f.sandbox_id), why.clone()));
            }
        }
        for (pod, why) in self.memory.fights() {
            refusals.push(("drift-fought", pod, why));
        }
        let refusals = self.refusals(refusals);
        self.passes += 1;
        PassReport {
            number: self.passes,
            finished: SystemTime::now(),
            took: started.elapsed(),
            runtime_unseen: views.err(),
            records_unread,
            findings: plan.findings,
            actions,
            compared: self.node.comparisons(),
            refusals,
        }
    }

    /// Carries out one action, and remembers what it says of the pod.
    fn act(
        &mut self,
        action: &Action,
        sandboxes: &BTreeMap<&str, &Sandbox>,
        records: &BTreeMap<&str, &RecordView>,
        counted_repairs: &mut HashSet<String>,
        refusals: &mut Vec<(&'static str, String, String)>,
    ) -> Outcome {
        let outcome = self.execute(action, sandboxes, records);
        // A restart or capture counts whatever its outcome (the pod may come back
        // uncaptured); a repair or migration only when it failed (drift again later is
        // repaired again), or, for a repair of drift, when it is the latest of too many in a
        // window (drift that is fought). A migration is no drift: it never counts as fought.
        let repair = matches!(action, Action::Repair { .. } | Action::RepairServices { .. } | Action::Migrate { .. });
        let drift = matches!(action, Action::Repair { .. } | Action::RepairServices { .. });
        let now = Instant::now();
        match &outcome {
            // The record went (its DEL) or changed (a new ADD): the pod's history goes with it.
            Outcome::Moot(_) if !matches!(action, Action::Capture { .. } | Action::Restart { .. }) => {
                self.memory.forget(action.pod());
            }
            Outcome::Refused(why) => {
                if let Action::Capture { sandbox_id, pod, .. } = action {
                    self.memory.refuse(sandbox_id, why);
                    refusals.push(("netns-owned", format!("{pod} (sandbox {sandbox_id})"), why.clone()));
                }
            }
            Outcome::Failed(_) if action.counts_as_attempt() => self.memory.acted(action.pod(), now, &self.limits),
            Outcome::Done if action.counts_as_attempt() && !repair => {
                self.memory.acted(action.pod(), now, &self.limits)
            }
            Outcome::Done if drift && !counted_repairs.insert(action.pod().history_key()) => {}
            Outcome::Done if drift => {
                if let Some(n) = self.memory.repaired(action.pod(), now) {
                    self.memory.acted(action.pod(), now, &self.limits);
                    self.memory.fought(
                        action.pod(),
                        format!(
                            "its drift was repaired {n} times within {} min: something in the pod keeps \
                             undoing the capture; backed off (then only reported after --reconcile-attempts)",
                            plan::FOUGHT_WINDOW.as_secs() / 60
                        ),
                    );
                }
            }
            _ => {}
        }
        log_action(action, &outcome);
        outcome
    }

    /// This pass's refusals, each logged once when it starts (and once when it ends).
    fn refusals(&mut self, now: Vec<(&'static str, String, String)>) -> Vec<Refusal> {
        let keys: HashSet<(&'static str, String)> = now.iter().map(|(k, s, _)| (*k, s.clone())).collect();
        for (kind, subject) in self.refusing.difference(&keys) {
            tracing::info!(kind = *kind, "no longer refused: {subject}");
        }
        let out = now
            .into_iter()
            .map(|(kind, subject, why)| {
                let new = !self.refusing.contains(&(kind, subject.clone()));
                if new {
                    tracing::warn!(kind, "refused: {subject}: {why}");
                }
                Refusal { kind, subject, why, new }
            })
            .collect();
        self.refusing = keys;
        out
    }

    fn views(&mut self, sandboxes: Vec<Sandbox>, observed: &[(RecordView, Observation)]) -> Vec<SandboxView> {
        let recorded: HashSet<&str> = observed.iter().map(|(r, _)| r.sandbox_id.as_str()).collect();
        let wanted: Vec<(Sandbox, Wants)> = sandboxes
            .into_iter()
            .map(|s| {
                let w = self.node.wants(&s);
                (s, w)
            })
            .collect();
        let late = self.added_during_the_pass(&wanted, &recorded);
        let mut views = Vec::with_capacity(wanted.len());
        for (sandbox, wants) in wanted.into_iter().filter(|(s, _)| !late.contains(&s.id)) {
            let network = if SandboxView::needs_network(&sandbox, &wants, &recorded) {
                Some(self.network(&sandbox.id))
            } else {
                None
            };
            views.push(SandboxView { sandbox, wants, network });
        }
        views
    }

    /// A would-be missed sandbox's network: known, or asked (unless its last failure's backoff
    /// runs, or the pass may ask the runtime nothing more).
    fn network(&mut self, id: &str) -> Result<PodNetwork, String> {
        if let Some(n) = self.network_cache.get(id) {
            return Ok(n.clone());
        }
        let now = Instant::now();
        if let Some(f) = self.network_failed.get(id).filter(|f| now < f.next) {
            return Err(format!("{} (asked again in {} s)", f.why, f.next.duration_since(now).as_secs().max(1)));
        }
        let Some(rt) = self.runtime.as_mut() else { return Err("no runtime".to_string()) };
        if rt.budget_spent() {
            return Err("not asked: this pass's time for the runtime is spent".to_string());
        }
        match rt.network(id) {
            Ok(n) => {
                self.network_failed.remove(id);
                self.network_cache.insert(id.to_string(), n.clone());
                Ok(n)
            }
            Err(e) => {
                let why = e.to_string();
                let failures = self.network_failed.get(id).map_or(0, |f| f.failures) + 1;
                let factor = 1u32.checked_shl(failures - 1).unwrap_or(u32::MAX);
                let wait = self.limits.backoff.saturating_mul(factor).min(self.limits.backoff_max);
                self.network_failed
                    .insert(id.to_string(), StatusFailure { why: why.clone(), failures, next: Instant::now() + wait });
                Err(why)
            }
        }
    }

    /// The sandboxes whose ADD finished while this pass read the records: listed ready after
    /// the read, with a record the pass did not see, they would pass for missed pods (and be
    /// restarted). They are left out of this pass; the next one reads both. The records are
    /// read again only when a listed sandbox looks missed, which is rare.
    fn added_during_the_pass(&mut self, wanted: &[(Sandbox, Wants)], recorded: &HashSet<&str>) -> HashSet<String> {
        if !wanted.iter().any(|(s, w)| SandboxView::needs_network(s, w, recorded)) {
            return HashSet::new();
        }
        let Ok(now) = self.node.recorded_sandboxes() else { return HashSet::new() };
        let late: HashSet<String> = now.into_iter().filter(|id| !recorded.contains(id.as_str())).collect();
        for id in &late {
            tracing::debug!(sandbox = %id, "recorded while the pass read the records: left to the next pass");
        }
        late
    }

    fn execute(
        &mut self,
        action: &Action,
        sandboxes: &BTreeMap<&str, &Sandbox>,
        records: &BTreeMap<&str, &RecordView>,
    ) -> Outcome {
        let missing = |what: &str| Outcome::Failed(format!("{what} is not in this pass's list"));
        let result = match action {
            Action::Restart { sandbox_id, .. } => {
                return match self.runtime.as_mut().map(|rt| rt.stop(sandbox_id)) {
                    Some(Ok(())) => Outcome::Done,
                    Some(Err(e)) => Outcome::Failed(e.to_string()),
                    None => Outcome::Failed("no runtime".into()),
                }
            }
            Action::Capture { sandbox_id, netns, ips, .. } => match sandboxes.get(sandbox_id.as_str()) {
                Some(sb) => self.node.capture(sb, netns, ips),
                None => return missing(&format!("sandbox {sandbox_id}")),
            },
            Action::Repair { record, .. }
            | Action::RepairServices { record, .. }
            | Action::Migrate { record, .. }
            | Action::Collect { record, .. } => {
                let Some(r) = records.get(record.as_str()) else { return missing(&format!("record {record}")) };
                match action {
                    Action::Repair { .. } => self.node.repair(r),
                    Action::RepairServices { .. } => self.node.repair_services(r),
                    Action::Migrate { .. } => self.node.migrate(r),
                    Action::Collect { why, .. } => self.node.collect(r, why),
                    _ => unreachable!("matched above"),
                }
            }
        };
        match result {
            Ok(()) => Outcome::Done,
            Err(e) => self.node.outcome_of(&e).unwrap_or_else(|| Outcome::Failed(e.to_string())),
        }
    }
}

/// A record's action (its kind and the record), to know one the pass already did before it
/// asked the runtime; an action on a sandbox (restart, capture) is none.
fn record_action(a: &Action) -> (&'static str, String) {
    match a {
        Action::Repair { record, .. }
        | Action::RepairServices { record, .. }
        | Action::Migrate { record, .. }
        | Action::Collect { record, .. } => (action_kind(a), record.clone()),
        Action::Restart { sandbox_id, .. } | Action::Capture { sandbox_id, .. } => ("", sandbox_id.clone()),
    }
}

/// One line per action: the pod and what was done.
fn log_action(action: &Action, outcome: &Outcome) {
    let pod = action.pod();
    let failed = match outcome {
        Outcome::Done => None,
        Outcome::Failed(e) => Some(e),
        Outcome::Moot(why) => {
            tracing::info!(pod = %pod, "{}: nothing to do when it came to it: {why}", action_kind(action));
            return;
        }
        // Logged once, as a refusal, by the pass.
        Outcome::Refused(_) => return,
    };
    match (action, failed) {
        (Action::Restart { sandbox_id, .. }, None) => tracing::info!(
            pod = %pod, sandbox = %sandbox_id,
            "missed pod (no capture): sandbox stopped through the CRI, the kubelet recreates it through ADD"
        ),
        (Action::Capture { sandbox_id, netns, .. }, None) => tracing::info!(
            pod = %pod, sandbox = %sandbox_id,
            "missed pod (no capture): captured in place in {netns}; connections opened before stay uncaptured"
        ),
        (Action::Repair { record, differences, .. }, None) => tracing::info!(
            pod = %pod, record = %record,
            "drift repaired to the record's ruleset: {}", differences.join("; ")
        ),
        (Action::RepairServices { record, differences, .. }, None) => tracing::info!(
            pod = %pod, record = %record,
            "Service layer drift repaired to the stored snapshot: {}", differences.join("; ")
        ),
        (Action::Migrate { record, from, .. }, None) => tracing::info!(
            pod = %pod, record = %record,
            "migrated from {from} to the current {}", aether_node::state::RulesetVersion::CURRENT
        ),
        (Action::Collect { record, why, .. }, None) => tracing::info!(
            pod = %pod, record = %record, "leftover collected: {}", leftover_text(why)
        ),
        (a, Some(e)) => tracing::warn!(pod = %pod, "{} failed: {e}", action_kind(a)),
    }
}

pub fn leftover_text(why: &Leftover) -> String {
    match why {
        Leftover::SandboxGone => "the runtime no longer has its sandbox".into(),
        Leftover::NetnsGone(w) => format!("its network namespace is gone ({w})"),
    }
}

/// The installer is stopping: set once, seen by the pass (no action starts) and by the CRI
/// calls (one in flight is cancelled).
#[derive(Clone)]
pub struct Stopping {
    flag: Arc<AtomicBool>,
    tx: Arc<tokio::sync::watch::Sender<bool>>,
}

impl Stopping {
    pub fn new() -> Stopping {
        Stopping { flag: Arc::new(AtomicBool::new(false)), tx: Arc::new(tokio::sync::watch::channel(false).0) }
    }

    pub fn set(&self) {
        self.flag.store(true, Ordering::SeqCst);
        self.tx.send_replace(true);
    }

    pub fn is_set(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    /// For an async wait on the stop.
    pub fn watch(&self) -> tokio::sync::watch::Receiver<bool> {
        self.tx.subscribe()
    }
}

impl Default for Stopping {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests;
