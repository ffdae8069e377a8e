//! Kubernetes Events (`events.k8s.io/v1`) for what the node did: on a pod the reconciler
//! acted on (or refused to), and on the Node when aether-cni turns not ready or ready again.
//!
//! The callers (the reconciler's loop, the installation's readiness) hand a typed
//! [`NodeEvent`] to [`Events::emit`], which never blocks and never fails: it puts the event in
//! a bounded channel, or drops it with a metric when the channel is full. A sender task on the
//! installer's async runtime (`sender`) folds repeats into one Event per (pod, reason) with a
//! series count (`ledger`), spends at most one API write per token of a bucket, and gives up on
//! what the API refuses; nothing it does can hold up a pass, the capture or the agent's socket.
//! Off (`--events=false`, the default outside a cluster) it is a no-op with no task at all.

mod body;
mod ledger;
pub mod metrics;
mod sender;
#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::mpsc;

pub use body::{event_body, NODE_EVENTS_NAMESPACE, NOTE_MAX_BYTES, REPORTING_CONTROLLER};
pub use ledger::{Ledger, TokenBucket, Write, WriteOutcome};
pub use metrics::EventMetrics;

use crate::reconcile::{Action, Held, Outcome, PassReport, PodRef, PodState};

/// What the node did, to which pod (or to itself). One Event per distinct variant and pod;
/// repeats become that Event's series.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeEvent {
    /// A missed pod's sandbox was stopped through the CRI (the kubelet recreates it through ADD).
    MissedPodRestarted { pod: PodRef },
    /// A missed pod was captured in place, in its netns.
    MissedPodCaptured { pod: PodRef },
    /// A missed pod was left as it is: why (the `report` policy, or attempts used up).
    MissedPodReported { pod: PodRef, why: String },
    /// A pod's netns no longer held what its record says; it was repaired to the record.
    DriftRepaired { pod: PodRef, layer: Layer, differences: Vec<String> },
    /// A pod's drift came back too often: backed off.
    DriftFought { pod: PodRef, why: String },
    /// A missed pod's in-place capture was refused: its netns is another record's.
    CaptureRefused { pod: PodRef, why: String },
    /// A pod's capture ruleset of an earlier release was replaced with the current one.
    CaptureMigrated { pod: PodRef, from: String },
    /// aether-cni is not ready on the node: the not-ready reasons, as STATUS says them.
    NodeNotReady { why: String },
    /// aether-cni is ready on the node again.
    NodeReady,
}

/// Which of a pod's layers drifted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layer {
    Capture,
    Services,
}

/// What an Event is about: a pod, or the node.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Regarding {
    Pod(PodRef),
    Node,
}

impl NodeEvent {
    /// The Event's `reason`: CamelCase, as Kubernetes' own.
    pub fn reason(&self) -> &'static str {
        match self {
            NodeEvent::MissedPodRestarted { .. } => "MissedPodRestarted",
            NodeEvent::MissedPodCaptured { .. } => "MissedPodCaptured",
            NodeEvent::MissedPodReported { .. } => "MissedPodReported",
            NodeEvent::DriftRepaired { .. } => "DriftRepaired",
            NodeEvent::DriftFought { .. } => "DriftFought",
            NodeEvent::CaptureRefused { .. } => "CaptureRefused",
            NodeEvent::CaptureMigrated { .. } => "CaptureMigrated",
            NodeEvent::NodeNotReady { .. } => "AetherCNINotReady",
            NodeEvent::NodeReady => "AetherCNIReady",
        }
    }

    /// The Event's `action`: what the node did about it.
    pub fn action(&self) -> &'static str {
        match self {
            NodeEvent::MissedPodRestarted { .. } => "StopPodSandbox",
            NodeEvent::MissedPodCaptured { .. } => "Capture",
            NodeEvent::MissedPodReported { .. } => "Report",
            NodeEvent::DriftRepaired { .. } => "Repair",
            NodeEvent::DriftFought { .. } => "BackOff",
            NodeEvent::CaptureRefused { .. } => "Refuse",
            NodeEvent::CaptureMigrated { .. } => "Migrate",
            NodeEvent::NodeNotReady { .. } => "MarkNotReady",
            NodeEvent::NodeReady => "MarkReady",
        }
    }

    /// `Normal`, or `Warning` where someone should look.
    pub fn event_type(&self) -> &'static str {
        match self {
            NodeEvent::MissedPodReported { .. }
            | NodeEvent::DriftFought { .. }
            | NodeEvent::CaptureRefused { .. }
            | NodeEvent::NodeNotReady { .. } => "Warning",
            _ => "Normal",
        }
    }

    pub fn regarding(&self) -> Regarding {
        match self {
            NodeEvent::MissedPodRestarted { pod }
            | NodeEvent::MissedPodCaptured { pod }
            | NodeEvent::MissedPodReported { pod, .. }
            | NodeEvent::DriftRepaired { pod, .. }
            | NodeEvent::DriftFought { pod, .. }
            | NodeEvent::CaptureRefused { pod, .. }
            | NodeEvent::CaptureMigrated { pod, .. } => Regarding::Pod(pod.clone()),
            NodeEvent::NodeNotReady { .. } | NodeEvent::NodeReady => Regarding::Node,
        }
    }

    /// The Event's `note`: what happened, naming the rule or value (cut to the API's limit
    /// by `body`).
    pub fn note(&self) -> String {
        match self {
            NodeEvent::MissedPodRestarted { .. } => {
                "started before aether-cni was chained (no capture): its sandbox was stopped \
                 through the CRI (--missed-pods=restart); the kubelet recreates it through ADD"
                    .into()
            }
            NodeEvent::MissedPodCaptured { .. } => {
                "started before aether-cni was chained (no capture): captured in place in its \
                 network namespace (--missed-pods=capture)"
                    .into()
            }
            NodeEvent::MissedPodReported { why, .. } => format!("not captured, left as it is: {why}"),
            NodeEvent::DriftRepaired { layer, differences, .. } => {
                let what = match layer {
                    Layer::Capture => "its capture ruleset",
                    Layer::Services => "its Service layer",
                };
                if differences.is_empty() {
                    format!("{what} differed from its record: repaired to the record")
                } else {
                    format!("{what} differed from its record ({}): repaired to the record", differences.join("; "))
                }
            }
            NodeEvent::DriftFought { why, .. } => why.clone(),
            NodeEvent::CaptureRefused { why, .. } => format!("not captured in place: {why}"),
            NodeEvent::CaptureMigrated { from, .. } => {
                format!("capture ruleset of an earlier release ({from}) replaced with this release's")
            }
            NodeEvent::NodeNotReady { why } => format!("aether-cni is not ready on this node: {why}"),
            NodeEvent::NodeReady => "aether-cni is installed, chained and ready on this node".into(),
        }
    }

    /// The ledger's key: one Event per (what it is about, reason).
    pub fn key(&self) -> (String, &'static str) {
        let about = match self.regarding() {
            Regarding::Pod(pod) => format!("pod:{}", pod_key(&pod)),
            Regarding::Node => "node".to_string(),
        };
        (about, self.reason())
    }
}

/// A pod's identity for the ledger: its uid, or its name where the uid is unknown.
fn pod_key(pod: &PodRef) -> String {
    if pod.uid.is_empty() {
        format!("{}/{}", pod.namespace, pod.name)
    } else {
        pod.uid.clone()
    }
}

/// The Events a pass makes: each action done (or refused), each pod only reported, and each
/// fought drift as it starts.
pub fn from_pass(report: &PassReport) -> Vec<NodeEvent> {
    let mut out = Vec::new();
    for (action, outcome) in &report.actions {
        let event = match (action, outcome) {
            (Action::Restart { pod, .. }, Outcome::Done) => NodeEvent::MissedPodRestarted { pod: pod.clone() },
            (Action::Capture { pod, .. }, Outcome::Done) => NodeEvent::MissedPodCaptured { pod: pod.clone() },
            (Action::Capture { pod, .. }, Outcome::Refused(why)) => {
                NodeEvent::CaptureRefused { pod: pod.clone(), why: why.clone() }
            }
            (Action::Repair { pod, differences, .. }, Outcome::Done) => {
                NodeEvent::DriftRepaired { pod: pod.clone(), layer: Layer::Capture, differences: differences.clone() }
            }
            (Action::RepairServices { pod, differences, .. }, Outcome::Done) => {
                NodeEvent::DriftRepaired { pod: pod.clone(), layer: Layer::Services, differences: differences.clone() }
            }
            (Action::Migrate { pod, from, .. }, Outcome::Done) => {
                NodeEvent::CaptureMigrated { pod: pod.clone(), from: from.clone() }
            }
            _ => continue,
        };
        out.push(event);
    }
    for f in &report.findings {
        match (&f.held, f.state) {
            (Some(held @ (Held::Reported | Held::GaveUp(_))), PodState::Missed) => {
                out.push(NodeEvent::MissedPodReported { pod: f.pod.clone(), why: held.to_string() })
            }
            (Some(Held::NetnsOwned(why)), _) => {
                out.push(NodeEvent::CaptureRefused { pod: f.pod.clone(), why: why.clone() })
            }
            _ => {}
        }
    }
    // A fought drift is a refusal named by the pod's display name: its uid is found among
    // the pass's pods (the pod was just repaired, or is held backing off).
    for r in report.refusals.iter().filter(|r| r.kind == "drift-fought" && r.new) {
        let known = report.actions.iter().map(|(a, _)| a.pod()).chain(report.findings.iter().map(|f| &f.pod));
        let pod = known.into_iter().find(|p| p.to_string() == r.subject).cloned().unwrap_or_else(|| {
            let (namespace, name) = r.subject.split_once('/').unwrap_or(("", &r.subject));
            PodRef { namespace: namespace.into(), name: name.into(), uid: String::new() }
        });
        out.push(NodeEvent::DriftFought { pod, why: r.why.clone() });
    }
    out
}

/// One body of every kind of Event, as created and (the second of each) with a series: what
/// `--print-event-examples` prints for the chart's schema tests.
pub fn examples_json(node: &str) -> String {
    let node = if node.is_empty() { "node-a" } else { node };
    let pod = PodRef {
        namespace: "shop".into(),
        name: "cart-7d9f".into(),
        uid: "0b5e1c8e-3f7e-4b8e-9c1d-2a6f1e0c9d41".into(),
    };
    let all = [
        NodeEvent::MissedPodRestarted { pod: pod.clone() },
        NodeEvent::MissedPodCaptured { pod: pod.clone() },
        NodeEvent::MissedPodReported { pod: pod.clone(), why: Held::Reported.to_string() },
        NodeEvent::DriftRepaired {
            pod: pod.clone(),
            layer: Layer::Capture,
            differences: vec!["chain prerouting: rule 2 missing".into()],
        },
        NodeEvent::DriftRepaired { pod: pod.clone(), layer: Layer::Services, differences: vec![] },
        NodeEvent::DriftFought { pod: pod.clone(), why: "its drift was repaired 5 times within 10 min".into() },
        NodeEvent::CaptureRefused { pod: pod.clone(), why: "its netns is shop/other's".into() },
        NodeEvent::CaptureMigrated { pod, from: "capture ruleset of release 0.0.9".into() },
        NodeEvent::NodeNotReady { why: "kernel: kernel checks failed: nft_tproxy".into() },
        NodeEvent::NodeReady,
    ];
    let now = std::time::SystemTime::now();
    let bodies: Vec<serde_json::Value> = all
        .iter()
        .flat_map(|e| {
            let name = body::event_name(e, node, now);
            [None, Some((2, now))]
                .map(|series| serde_json::to_value(event_body(e, node, &name, now, series)).expect("Events serialize"))
        })
        .collect();
    serde_json::to_string_pretty(&bodies).expect("JSON values serialize")
}

/// Where Events go and what they may cost.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The API server, e.g. `https://10.96.0.1:443` (from KUBERNETES_SERVICE_HOST/PORT).
    pub api_server: String,
    /// The projected service-account token (re-read as the kubelet rotates it).
    pub token_file: Option<PathBuf>,
    /// The cluster's CA bundle (PEM); none for a plain-http server (tests).
    pub ca_file: Option<PathBuf>,
    /// The node's name: the Events' `reportingInstance` and the Node they are about.
    pub node_name: String,
    /// API writes per second, at most (the token bucket's rate; its burst is one).
    pub writes_per_second: f64,
    /// The longest one API call may take.
    pub request_timeout: Duration,
    /// Events waiting for the sender task, at most: more are dropped (counted).
    pub queue: usize,
    /// Distinct Events remembered for aggregation, at most.
    pub ledger: usize,
    /// A repeat's count is written at most this often per Event (the second occurrence at
    /// once, as Kubernetes' own recorder does).
    pub series_refresh: Duration,
    /// An Event not repeated for this long is forgotten (a later repeat makes a new Event).
    pub series_window: Duration,
}

impl Settings {
    pub const DEFAULT_QUEUE: usize = 256;
    pub const DEFAULT_LEDGER: usize = 1024;
    /// Kubernetes' recorder refreshes a series every 30 min; a node's repeats are worth
    /// seeing sooner, and at one patch per Event per 5 min they stay cheap.
    pub const DEFAULT_SERIES_REFRESH: Duration = Duration::from_secs(300);
    /// As Kubernetes' recorder: a series ends after 6 min without a repeat.
    pub const DEFAULT_SERIES_WINDOW: Duration = Duration::from_secs(360);
}

/// Why Events cannot be posted with the flags given (the installer then runs without them).
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("--events needs the API server: --events-api-server, or {0} (set in every pod by the kubelet)")]
    NoApiServer(&'static str),
    #[error("--events needs the node's name (--node-name or NODE_NAME, the chart passes spec.nodeName)")]
    NoNodeName,
    #[error("--events-writes-per-second must be a positive number, not {0}")]
    Rate(f64),
}

/// The installer's handle on Events: off until [`Events::start`], and a no-op then too when
/// Events are off.
pub struct Events {
    tx: OnceLock<mpsc::Sender<NodeEvent>>,
    pub metrics: Arc<EventMetrics>,
}

impl Events {
    /// Off, counting into `metrics` once started.
    pub fn new(metrics: Arc<EventMetrics>) -> Events {
        Events { tx: OnceLock::new(), metrics }
    }

    pub fn is_on(&self) -> bool {
        self.tx.get().is_some()
    }

    /// Starts the sender task on `rt` (once; later calls are ignored).
    pub fn start(&self, settings: Settings, rt: &tokio::runtime::Runtime) {
        let (tx, rx) = mpsc::channel(settings.queue.max(1));
        if self.tx.set(tx).is_err() {
            return;
        }
        tracing::info!(
            api = %settings.api_server,
            node = %settings.node_name,
            "posting Kubernetes Events (at most {} API writes per second)",
            settings.writes_per_second
        );
        rt.spawn(sender::run(rx, settings, self.metrics.clone()));
    }

    /// Hands `event` to the sender task without waiting: dropped (and counted) when its queue
    /// is full or it has ended.
    pub fn emit(&self, event: NodeEvent) {
        let Some(tx) = self.tx.get() else { return };
        match tx.try_send(event) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => self.metrics.dropped("queue-full"),
            Err(mpsc::error::TrySendError::Closed(_)) => self.metrics.dropped("stopped"),
        }
    }

    /// The Events of a reconciler pass (nothing is computed while Events are off).
    pub fn pass(&self, report: &PassReport) {
        if !self.is_on() {
            return;
        }
        for e in from_pass(report) {
            self.emit(e);
        }
    }
}
