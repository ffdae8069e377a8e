//! The reconciler's decisions, as pure code: what the runtime reports (its sandboxes, each
//! with what ADD would make of it), what the node holds (its attachment records, each with
//! what its netns shows), the node's readiness and the pods' history in, actions and each
//! pod's state out. Nothing here touches a socket, a file or the kernel: `super` gathers the
//! inputs and carries the actions out, and the unit tests drive every rule with plain values.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

use aether_cri::{Sandbox, SandboxNetns, SandboxState};

/// What to do with a missed pod: a ready sandbox that should be captured and has no
/// attachment record (it started before the plugin was chained, or ADD never ran).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissedPolicy {
    /// Stop the sandbox through the CRI: the kubelet makes a new one, through a real ADD.
    Restart,
    /// Program the capture in place, with ADD's code, from the pod's netns.
    Capture,
    /// Change nothing; log and count it.
    Report,
}

impl MissedPolicy {
    pub const NAMES: [&'static str; 3] = ["restart", "capture", "report"];

    pub fn name(self) -> &'static str {
        match self {
            MissedPolicy::Restart => "restart",
            MissedPolicy::Capture => "capture",
            MissedPolicy::Report => "report",
        }
    }
}

impl std::str::FromStr for MissedPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "restart" => Ok(MissedPolicy::Restart),
            "capture" => Ok(MissedPolicy::Capture),
            "report" => Ok(MissedPolicy::Report),
            _ => Err(format!("{s:?} is not a missed-pod policy: expected restart, capture or report")),
        }
    }
}

/// How much one pass may do, and how often one pod may be acted on.
#[derive(Debug, Clone)]
pub struct Limits {
    pub missed: MissedPolicy,
    /// Restarts plus in-place captures per pass (a node reboot with a hundred missed pods is
    /// then no restart storm).
    pub actions_per_pass: usize,
    /// The wait after a pod's first action; doubled after each further one, up to
    /// `backoff_max`.
    pub backoff: Duration,
    pub backoff_max: Duration,
    /// Actions on one pod (restarts, captures, failed repairs) before it is only reported.
    pub attempts: u32,
    /// A record whose sandbox the runtime does not list is collected only once it has been
    /// missing this long: a sandbox being created is listed only after its ADD wrote the
    /// record.
    pub leftover_grace: Duration,
    /// Pods migrated to the current capture ruleset per pass: an upgraded node rebuilds its
    /// pods' tables a few at a time, never all at once.
    pub migrations_per_pass: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            missed: MissedPolicy::Restart,
            actions_per_pass: 5,
            backoff: Duration::from_secs(30),
            backoff_max: Duration::from_secs(600),
            attempts: 3,
            leftover_grace: Duration::from_secs(60),
            migrations_per_pass: 10,
        }
    }
}

/// A pod as people name it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl PodRef {
    pub fn of(s: &Sandbox) -> PodRef {
        PodRef { namespace: s.namespace.clone(), name: s.name.clone(), uid: s.uid.clone() }
    }

    /// The key of the pod's history: its uid (a restarted pod keeps it, its sandbox ID does
    /// not), or its name where the uid is unknown.
    pub(crate) fn history_key(&self) -> String {
        if self.uid.is_empty() {
            format!("{}/{}", self.namespace, self.name)
        } else {
            self.uid.clone()
        }
    }
}

impl fmt::Display for PodRef {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match (self.namespace.is_empty(), self.name.is_empty()) {
            (true, true) => f.write_str("(unnamed pod)"),
            _ => write!(f, "{}/{}", self.namespace, self.name),
        }
    }
}

/// What ADD would make of a sandbox's pod, judged by the node's configuration and the pod's
/// annotations exactly as ADD judges them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wants {
    Capture,
    /// The pod's namespace is in `excludeNamespaces`.
    Excluded,
    /// `captureMode: disabled` on the node or `aether.io/capture: disabled` on the pod.
    Disabled,
    /// ADD would refuse it (a malformed annotation): reported, never programmed.
    Invalid(String),
}

/// One attachment record, as the reconciler needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordView {
    /// network/container/ifname.
    pub key: String,
    /// `CNI_CONTAINERID`: the runtime's sandbox ID.
    pub sandbox_id: String,
    pub pod: PodRef,
    pub netns: String,
}

/// What a record's netns holds, compared with the record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    Intact,
    /// Intact, holding the capture ruleset of an earlier release (`from`, as people read it),
    /// exactly as its record says: to be migrated to the current one. Not drift.
    MigrationPending {
        from: String,
    },
    /// What differs (not both empty).
    Drifted(Differences),
    /// The netns is gone, or is another namespace than the one ADD programmed.
    NetnsGone(String),
    /// It could not be compared (e.g. the netns could not be opened): nothing is done.
    Unverifiable(String),
}

/// A drifted pod's differences, each as CHECK (the capture: ruleset, policy rule and route,
/// record) or `services verify` (the Service layer, against the stored snapshot) prints it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Differences {
    pub capture: Vec<String>,
    pub services: Vec<String>,
}

impl Differences {
    /// Differences of the capture only.
    pub fn capture(capture: Vec<String>) -> Self {
        Differences { capture, services: Vec::new() }
    }

    /// Differences of the Service layer only.
    pub fn services(services: Vec<String>) -> Self {
        Differences { capture: Vec::new(), services }
    }

    pub fn is_empty(&self) -> bool {
        self.capture.is_empty() && self.services.is_empty()
    }
}

/// A sandbox's network as the runtime reports it (its verbose status).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodNetwork {
    pub netns: SandboxNetns,
    /// The pod's addresses (what its CNI result gave it).
    pub ips: Vec<String>,
}

/// A sandbox of the runtime's list, with what ADD would make of it and, for a pod that may
/// be missed, its network (looked up only for those: it takes a verbose status).
#[derive(Debug, Clone)]
pub struct SandboxView {
    pub sandbox: Sandbox,
    pub wants: Wants,
    pub network: Option<Result<PodNetwork, String>>,
}

impl SandboxView {
    /// Whether the plan needs this sandbox's network: ready, wanting capture, not recorded.
    pub fn needs_network(sandbox: &Sandbox, wants: &Wants, recorded: &HashSet<&str>) -> bool {
        sandbox.state == SandboxState::Ready && *wants == Wants::Capture && !recorded.contains(sandbox.id.as_str())
    }
}

/// Everything one pass decides from.
pub struct Input<'a> {
    /// The runtime's sandboxes, or why they cannot be seen (no socket, errors): then missed
    /// pods cannot be seen, and records are judged by their netns alone.
    pub runtime: Result<&'a [SandboxView], &'a str>,
    pub records: &'a [(RecordView, Observation)],
    /// `Err(why)` while the node is not ready (the plugin not chained yet): a restarted pod
    /// would come back uncaptured, so missed pods wait.
    pub node_ready: Result<(), &'a str>,
    pub now: Instant,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leftover {
    /// The runtime no longer has the record's sandbox.
    SandboxGone,
    /// The record's netns is gone (or another namespace now).
    NetnsGone(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// StopPodSandbox: the kubelet recreates the pod through a real ADD.
    Restart { sandbox_id: String, pod: PodRef },
    /// ADD's capture in place, in `netns`, for the pod's addresses `ips`.
    Capture { sandbox_id: String, pod: PodRef, netns: String, ips: Vec<String> },
    /// Re-apply exactly the record's ruleset.
    Repair { record: String, pod: PodRef, differences: Vec<String> },
    /// Rebuild the pod's Service layer to exactly the stored one (ADD's code).
    RepairServices { record: String, pod: PodRef, differences: Vec<String> },
    /// Replace an intact pod's capture ruleset of an earlier release (`from`) with the
    /// current one, and record that.
    Migrate { record: String, pod: PodRef, from: String },
    /// Collect the record as GC does.
    Collect { record: String, pod: PodRef, why: Leftover },
}

impl Action {
    pub fn pod(&self) -> &PodRef {
        match self {
            Action::Restart { pod, .. }
            | Action::Capture { pod, .. }
            | Action::Repair { pod, .. }
            | Action::RepairServices { pod, .. }
            | Action::Migrate { pod, .. }
            | Action::Collect { pod, .. } => pod,
        }
    }

    /// Restarts, captures, repairs and migrations count toward a pod's attempts (collecting
    /// a leftover is final).
    pub fn counts_as_attempt(&self) -> bool {
        !matches!(self, Action::Collect { .. })
    }
}

/// A pod's state in this pass (the `/metrics` "pods by state").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PodState {
    Captured,
    Missed,
    Drifted,
    Excluded,
    Disabled,
    /// ADD would refuse its annotations.
    Invalid,
    /// No netns of its own (hostNetwork): never captured.
    HostNetwork,
    /// The runtime reports the sandbox not ready: left alone.
    NotReady,
    /// Its record could not be compared with its netns.
    Unverifiable,
    /// A record without a sandbox or netns.
    Leftover,
}

impl PodState {
    pub const ALL: [PodState; 10] = [
        PodState::Captured,
        PodState::Missed,
        PodState::Drifted,
        PodState::Excluded,
        PodState::Disabled,
        PodState::Invalid,
        PodState::HostNetwork,
        PodState::NotReady,
        PodState::Unverifiable,
        PodState::Leftover,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PodState::Captured => "captured",
            PodState::Missed => "missed",
            PodState::Drifted => "drifted",
            PodState::Excluded => "excluded",
            PodState::Disabled => "disabled",
            PodState::Invalid => "invalid",
            PodState::HostNetwork => "host-network",
            PodState::NotReady => "not-ready",
            PodState::Unverifiable => "unverifiable",
            PodState::Leftover => "leftover",
        }
    }
}

/// Why a pod that needs something got nothing this pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held {
    /// The `report` policy.
    Reported,
    /// This pass's restarts and captures are used up.
    RateLimited,
    /// Acted on lately: not before this long.
    BackingOff(Duration),
    /// Acted on this many times and still not right: only reported from now on.
    GaveUp(u32),
    NodeNotReady(String),
    /// Its netns could not be learnt from the runtime.
    NetnsUnknown(String),
    /// ADD would refuse it: why.
    Invalid(String),
    /// Its record could not be compared: why.
    Unverifiable(String),
    /// Captured and intact with an earlier release's ruleset (named); this pass's migrations
    /// are used up.
    MigrationPending(String),
    /// Its netns is another record's (the runtime names another pod's netns for it): never
    /// captured into it.
    NetnsOwned(String),
    /// Another sandbox of the same pod (the same uid) was acted on this pass.
    SamePod(String),
}

impl fmt::Display for Held {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Held::Reported => f.write_str("reported only (policy report)"),
            Held::RateLimited => f.write_str("held: this pass's limit of restarts and captures is reached"),
            Held::BackingOff(d) => write!(f, "held: acted on recently, next attempt in {} s", d.as_secs()),
            Held::GaveUp(n) => write!(f, "given up after {n} attempts: reported only"),
            Held::NodeNotReady(why) => write!(f, "held while the node is not ready ({why})"),
            Held::NetnsUnknown(why) => write!(f, "its network namespace is unknown: {why}"),
            Held::Invalid(why) => write!(f, "ADD would refuse it, nothing programmed: {why}"),
            Held::Unverifiable(why) => write!(f, "cannot be compared with its record: {why}"),
            Held::MigrationPending(from) => write!(f, "{from}; migration pending"),
            Held::NetnsOwned(why) => write!(f, "refused: {why}"),
            Held::SamePod(other) => write!(f, "held: sandbox {other} of the same pod was acted on this pass"),
        }
    }
}

/// One pod (a sandbox, a record, or both) as the pass saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub pod: PodRef,
    pub sandbox_id: String,
    pub state: PodState,
    pub held: Option<Held>,
}

#[derive(Debug, Default)]
pub struct Plan {
    /// Why the runtime's list was not believed this pass (see [`suspect_list`]): nothing was
    /// done from it, as if the runtime could not be seen.
    pub suspect: Option<String>,
    pub actions: Vec<Action>,
    pub findings: Vec<Finding>,
    /// Pods seen right (captured and intact): their history is forgotten.
    pub settled: Vec<PodRef>,
    /// Records whose sandbox the runtime does not list, this pass (not yet collected).
    pub orphans: Vec<String>,
}

/// A pod's actions so far, across passes.
#[derive(Debug, Clone)]
struct History {
    attempts: u32,
    next: Instant,
}

/// What the reconciler remembers between passes: each pod's attempts, and since when each
/// record's sandbox has been missing from the runtime's list.
#[derive(Debug, Default, Clone)]
pub struct Memory {
    pods: HashMap<String, History>,
    orphans: HashMap<String, Instant>,
    /// Sandboxes whose in-place capture the node refused (their netns is another record's).
    refused: HashMap<String, String>,
    /// Each pod's successful repairs within [`FOUGHT_WINDOW`], oldest first.
    repairs: HashMap<String, VecDeque<Instant>>,
    /// Pods whose drift is fought: by history key, the pod as people name it and why.
    fights: HashMap<String, (String, String)>,
}

/// Repairs of one pod within [`FOUGHT_WINDOW`] that make its drift "fought": something in the
/// pod keeps undoing the capture, and repairing it every pass would only loop.
pub const FOUGHT_REPAIRS: usize = 5;
pub const FOUGHT_WINDOW: Duration = Duration::from_secs(600);

impl Memory {
    /// The node refused to capture `sandbox_id` in place: it is not tried again (while the
    /// runtime lists it).
    pub fn refuse(&mut self, sandbox_id: &str, why: &str) {
        self.refused.insert(sandbox_id.to_string(), why.to_string());
    }

    /// Forgets the refusals of sandboxes no longer listed.
    pub fn refused_listed<'a>(&mut self, listed: impl IntoIterator<Item = &'a str>) {
        let keep: HashSet<&str> = listed.into_iter().collect();
        self.refused.retain(|id, _| keep.contains(id.as_str()));
    }

    /// A repair of `pod` done at `now`: the number of its repairs within the window, when that
    /// reaches [`FOUGHT_REPAIRS`].
    pub fn repaired(&mut self, pod: &PodRef, now: Instant) -> Option<usize> {
        let times = self.repairs.entry(pod.history_key()).or_default();
        times.push_back(now);
        while times.front().is_some_and(|t| now.saturating_duration_since(*t) > FOUGHT_WINDOW) {
            times.pop_front();
        }
        (times.len() >= FOUGHT_REPAIRS).then_some(times.len())
    }

    /// `pod`'s drift is fought: reported (see [`Memory::fights`]) until its repairs within the
    /// window fall below [`FOUGHT_REPAIRS`].
    pub fn fought(&mut self, pod: &PodRef, why: String) {
        self.fights.insert(pod.history_key(), (pod.to_string(), why));
    }

    /// The pods whose drift is fought now: (the pod, why).
    pub fn fights(&mut self) -> Vec<(String, String)> {
        let now = Instant::now();
        let repairs = &mut self.repairs;
        repairs.retain(|_, times| {
            while times.front().is_some_and(|t| now.saturating_duration_since(*t) > FOUGHT_WINDOW) {
                times.pop_front();
            }
            !times.is_empty()
        });
        self.fights.retain(|k, _| repairs.get(k).is_some_and(|t| t.len() >= FOUGHT_REPAIRS));
        let mut out: Vec<(String, String)> = self.fights.values().cloned().collect();
        out.sort();
        out
    }

    /// After an action on `pod` (whatever its outcome): one attempt more, and the next not
    /// before the backoff, doubled per attempt.
    pub fn acted(&mut self, pod: &PodRef, now: Instant, limits: &Limits) {
        let h = self.pods.entry(pod.history_key()).or_insert(History { attempts: 0, next: now });
        h.attempts += 1;
        let factor = 1u32.checked_shl(h.attempts - 1).unwrap_or(u32::MAX);
        h.next = now + limits.backoff.saturating_mul(factor).min(limits.backoff_max);
    }

    pub fn forget(&mut self, pod: &PodRef) {
        self.pods.remove(&pod.history_key());
    }

    /// The records whose sandbox is missing this pass: new ones start their grace now, the
    /// others (listed again, or collected) are forgotten.
    pub fn orphans_seen(&mut self, keys: &[String], now: Instant) {
        self.orphans.retain(|k, _| keys.contains(k));
        for k in keys {
            self.orphans.entry(k.clone()).or_insert(now);
        }
    }

    /// How long the record's sandbox has been missing (zero the first time).
    fn orphaned_for(&self, key: &str, now: Instant) -> Duration {
        self.orphans.get(key).map_or(Duration::ZERO, |since| now.saturating_duration_since(*since))
    }

    pub fn attempts(&self, pod: &PodRef) -> u32 {
        self.pods.get(&pod.history_key()).map_or(0, |h| h.attempts)
    }

    fn held(&self, pod: &PodRef, now: Instant, limits: &Limits) -> Option<Held> {
        let h = self.pods.get(&pod.history_key())?;
        if h.attempts >= limits.attempts {
            Some(Held::GaveUp(h.attempts))
        } else if now < h.next {
            Some(Held::BackingOff(h.next - now))
        } else {
            None
        }
    }
}

/// Why a successful list from the runtime cannot be believed, if so. Absence from a list is
/// evidence that a pod is gone only when the list is otherwise consistent with the node: it
/// lists at least one of the sandboxes whose netns is alive here (it is this node's runtime,
/// and it has its state), and no more of them are missing from it than are listed (it is
/// not a runtime that lost part of its state, or one restarting). A list that is empty, names
/// none of the node's live pods (the socket of another runtime) or has shrunk below half of
/// them is suspect: nothing is done from it, as if the runtime could not be seen. With no
/// live pod recorded there is nothing a list could remove, and it is believed.
pub fn suspect_list(list: &[SandboxView], records: &[(RecordView, Observation)]) -> Option<String> {
    let listed: HashSet<&str> = list.iter().map(|v| v.sandbox.id.as_str()).collect();
    let live: HashSet<&str> = records
        .iter()
        .filter(|(_, o)| {
            matches!(o, Observation::Intact | Observation::MigrationPending { .. } | Observation::Drifted(_))
        })
        .map(|(r, _)| r.sandbox_id.as_str())
        .collect();
    let missing = live.iter().filter(|id| !listed.contains(*id)).count();
    let present = live.len() - missing;
    if live.is_empty() || (present > 0 && missing <= present) {
        return None;
    }
    Some(if list.is_empty() {
        format!("the runtime lists no sandbox, yet {} pods recorded here have a live network namespace", live.len())
    } else {
        format!(
            "the runtime's list ({} sandboxes) lacks {missing} of the {} pods recorded here with a live \
             network namespace (another runtime's socket, or one that lost its state)",
            list.len(),
            live.len()
        )
    })
}

/// The pass's decisions. Records first (drift and leftovers need no runtime), then the
/// runtime's sandboxes without a record, oldest first. A suspect list (see
/// [`suspect_list`]) is treated as no list.
pub fn plan(input: &Input, limits: &Limits, memory: &Memory) -> Plan {
    let mut out = Plan::default();
    let mut migrations = limits.migrations_per_pass;
    let mut runtime = input.runtime;
    if let Ok(list) = runtime {
        if let Some(why) = suspect_list(list, input.records) {
            out.suspect = Some(why);
            runtime = Err("the runtime's list is suspect");
        }
    }
    let sandboxes: Option<HashMap<&str, &SandboxView>> =
        runtime.ok().map(|list| list.iter().map(|v| (v.sandbox.id.as_str(), v)).collect());

    for (record, observation) in input.records {
        let listed = sandboxes.as_ref().map(|m| m.get(record.sandbox_id.as_str()).copied());
        let pod = match listed {
            Some(Some(v)) => PodRef::of(&v.sandbox),
            _ => record.pod.clone(),
        };
        let finding = |state, held| Finding { pod: pod.clone(), sandbox_id: record.sandbox_id.clone(), state, held };
        if matches!(listed, Some(None)) && !matches!(observation, Observation::NetnsGone(_)) {
            out.orphans.push(record.key.clone());
        }
        let orphaned = memory.orphaned_for(&record.key, input.now);
        match (observation, listed) {
            (Observation::NetnsGone(why), _) => {
                out.actions.push(Action::Collect {
                    record: record.key.clone(),
                    pod: pod.clone(),
                    why: Leftover::NetnsGone(why.clone()),
                });
                out.findings.push(finding(PodState::Leftover, None));
            }
            (_, Some(None)) if orphaned >= limits.leftover_grace => {
                out.actions.push(Action::Collect {
                    record: record.key.clone(),
                    pod: pod.clone(),
                    why: Leftover::SandboxGone,
                });
                out.findings.push(finding(PodState::Leftover, None));
            }
            // The runtime is tearing it down (or will retry its DEL): its DEL owns it.
            (_, Some(Some(v))) if v.sandbox.state == SandboxState::NotReady => {
                out.findings.push(finding(PodState::NotReady, None));
            }
            (Observation::Intact, _) => {
                out.findings.push(finding(PodState::Captured, None));
                out.settled.push(pod.clone());
            }
            // Captured and counted as such all along: a migration is an upgrade's, not a repair.
            (Observation::MigrationPending { from }, _) => {
                let held = memory
                    .held(&pod, input.now, limits)
                    .or_else(|| (migrations == 0).then(|| Held::MigrationPending(from.clone())));
                if held.is_none() {
                    migrations -= 1;
                    out.actions.push(Action::Migrate {
                        record: record.key.clone(),
                        pod: pod.clone(),
                        from: from.clone(),
                    });
                }
                out.findings.push(finding(PodState::Captured, held));
            }
            (Observation::Drifted(differences), _) => {
                let held = memory.held(&pod, input.now, limits);
                if held.is_none() && !differences.capture.is_empty() {
                    out.actions.push(Action::Repair {
                        record: record.key.clone(),
                        pod: pod.clone(),
                        differences: differences.capture.clone(),
                    });
                }
                if held.is_none() && !differences.services.is_empty() {
                    out.actions.push(Action::RepairServices {
                        record: record.key.clone(),
                        pod: pod.clone(),
                        differences: differences.services.clone(),
                    });
                }
                out.findings.push(finding(PodState::Drifted, held));
            }
            (Observation::Unverifiable(why), _) => {
                out.findings.push(finding(PodState::Unverifiable, Some(Held::Unverifiable(why.clone()))));
            }
        }
    }

    let Ok(list) = runtime else { return out };
    let recorded: HashSet<&str> = input.records.iter().map(|(r, _)| r.sandbox_id.as_str()).collect();
    let mut unrecorded: Vec<&SandboxView> = list.iter().filter(|v| !recorded.contains(v.sandbox.id.as_str())).collect();
    unrecorded.sort_by(|a, b| (a.sandbox.created_at, &a.sandbox.id).cmp(&(b.sandbox.created_at, &b.sandbox.id)));
    let mut budget = limits.actions_per_pass;
    // The netns paths the records name: a sandbox naming one of them is another pod's.
    let owned: HashMap<&str, &str> = input.records.iter().map(|(r, _)| (r.netns.as_str(), r.key.as_str())).collect();
    // One action per pod (history key) per pass: sandboxes sharing a uid share its attempts.
    let mut acted: HashMap<String, &str> = HashMap::new();
    for v in unrecorded {
        let pod = PodRef::of(&v.sandbox);
        let mut finding = |state, held| {
            out.findings.push(Finding { pod: pod.clone(), sandbox_id: v.sandbox.id.clone(), state, held })
        };
        if v.sandbox.state != SandboxState::Ready {
            finding(PodState::NotReady, None);
            continue;
        }
        match &v.wants {
            Wants::Excluded => finding(PodState::Excluded, None),
            Wants::Disabled => finding(PodState::Disabled, None),
            Wants::Invalid(why) => finding(PodState::Invalid, Some(Held::Invalid(why.clone()))),
            Wants::Capture => match &v.network {
                Some(Ok(PodNetwork { netns: SandboxNetns::Node, .. })) => finding(PodState::HostNetwork, None),
                None => finding(PodState::Missed, Some(Held::NetnsUnknown("not looked up".into()))),
                Some(Err(why)) => finding(PodState::Missed, Some(Held::NetnsUnknown(why.clone()))),
                Some(Ok(PodNetwork { netns: SandboxNetns::Pod(netns), ips })) => {
                    let held = if let Some(owner) = owned.get(netns.as_str()) {
                        Some(Held::NetnsOwned(format!("its netns {netns} is the one record {owner} names")))
                    } else if let Some(why) = memory.refused.get(&v.sandbox.id) {
                        Some(Held::NetnsOwned(why.clone()))
                    } else if let Err(why) = input.node_ready {
                        Some(Held::NodeNotReady(why.to_string()))
                    } else if limits.missed == MissedPolicy::Report {
                        Some(Held::Reported)
                    } else if let Some(h) = memory.held(&pod, input.now, limits) {
                        Some(h)
                    } else if let Some(other) = acted.get(&pod.history_key()) {
                        Some(Held::SamePod(other.to_string()))
                    } else if budget == 0 {
                        Some(Held::RateLimited)
                    } else {
                        None
                    };
                    if held.is_none() {
                        budget -= 1;
                        acted.insert(pod.history_key(), v.sandbox.id.as_str());
                        let (sandbox_id, pod) = (v.sandbox.id.clone(), pod.clone());
                        out.actions.push(match limits.missed {
                            MissedPolicy::Restart => Action::Restart { sandbox_id, pod },
                            _ => Action::Capture { sandbox_id, pod, netns: netns.clone(), ips: ips.clone() },
                        });
                    }
                    finding(PodState::Missed, held);
                }
            },
        }
    }
    out
}

#[cfg(test)]
mod tests;
