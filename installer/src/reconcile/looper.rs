//! The reconciler's thread: a pass each period and on cheap triggers (the installer's start,
//! the node turning ready), its metrics, and the last pass written to the state directory for
//! `aether-cni inspect`; `start`, from the installer's settings, wires the CRI runtime and the
//! node library into it.

use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use super::cri::CriRuntime;
use super::{action_kind, Held, Limits, NodeOps, Outcome, PassReport, Reconciler, Runtime, Stopping};
use crate::serve::Shared;

/// The last pass, in the state directory (read by `aether-cni inspect` with no argument).
pub use aether_node::state::LAST_PASS_FILE;

enum Msg {
    Pass(&'static str),
    Stop,
}

/// The longest the installer's stop waits for a pass to end: a runtime call in flight is
/// cancelled at once, and no action starts once the stop is asked, so a pass ends within
/// its current node operation. Well inside the chart's `terminationGracePeriodSeconds` (30),
/// with the uninstall still to come after it.
pub const STOP_WAIT: Duration = Duration::from_secs(3);

/// Pokes the reconciler's thread (a pass now) and stops it.
#[derive(Clone)]
pub struct Trigger(Sender<Msg>);

impl Trigger {
    /// A pass as soon as the current one (if any) ends; bursts fold into one.
    pub fn poke(&self, why: &'static str) {
        let _ = self.0.send(Msg::Pass(why));
    }
}

pub struct Looper {
    trigger: Trigger,
    thread: Option<std::thread::JoinHandle<()>>,
    stopping: Stopping,
    /// Closed when the thread ends.
    ended: Receiver<()>,
}

impl Looper {
    pub fn trigger(&self) -> Trigger {
        self.trigger.clone()
    }

    /// Ends the thread: its pass's runtime call (if any) is cancelled, no further action
    /// starts, and the pass is waited for at most [`STOP_WAIT`]; one still running then (in a
    /// node operation) is left to the process's exit, as a crash would leave it.
    pub fn stop(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        self.stopping.set();
        let _ = self.trigger.0.send(Msg::Stop);
        let Some(t) = self.thread.take() else { return };
        match self.ended.recv_timeout(STOP_WAIT) {
            Err(RecvTimeoutError::Timeout) => {
                tracing::warn!("the reconciler's pass did not end within {STOP_WAIT:?} of the stop: not waited for")
            }
            _ => {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Looper {
    fn drop(&mut self) {
        self.stop_now();
    }
}

/// Starts the thread; its first pass runs at once.
pub fn spawn<R, N>(
    mut reconciler: Reconciler<R, N>,
    period: Duration,
    shared: Arc<Shared>,
    state_dir: PathBuf,
    stopping: Stopping,
) -> std::io::Result<Looper>
where
    R: Runtime + Send + 'static,
    N: NodeOps + Send + 'static,
{
    let (tx, rx) = mpsc::channel();
    let (ended_tx, ended) = mpsc::channel::<()>();
    reconciler.stopping = stopping.clone();
    let thread = std::thread::Builder::new().name("installer-reconcile".into()).spawn(move || {
        // Dropped when the thread ends, however: the stop's wait ends with it.
        let _ended = ended_tx;
        let mut trigger = "start";
        loop {
            let started = Instant::now();
            let node_ready = {
                let status = shared.status.lock().unwrap();
                if status.not_ready.is_empty() {
                    Ok(())
                } else {
                    Err(status.describe().trim_end().replace('\n', "; "))
                }
            };
            let report = reconciler.pass(node_ready);
            if reconciler.stopping.is_set() {
                return;
            }
            shared.metrics.reconcile.observe(&report, trigger);
            shared.events.pass(&report);
            write_last_pass(&state_dir, &report);
            match next(&rx, started + period, &shared, waits_for_ready(&report)) {
                Some(t) => trigger = t,
                None => return,
            }
        }
    })?;
    Ok(Looper { trigger: Trigger(tx), thread: Some(thread), stopping, ended })
}

/// How often the thread looks whether the node turned ready (a mutex read).
const READY_POLL: Duration = Duration::from_millis(200);

fn is_ready(shared: &Shared) -> bool {
    shared.status.lock().unwrap().not_ready.is_empty()
}

/// Whether the pass held a pod only because the node was not ready (a missed pod while the
/// plugin is not chained yet): the pass once the node is ready is for it.
fn waits_for_ready(report: &PassReport) -> bool {
    report.findings.iter().any(|f| matches!(f.held, Some(Held::NodeNotReady(_))))
}

/// The next pass's trigger, or `None` to stop: the period (counted from the last pass's
/// start, so that a long pass does not stretch the time between two looks at a pod), a poke,
/// or the node being ready when the last pass held pods for it (`held_for_ready`): at once
/// if the node turned ready while that pass ran (the first pass itself clears `starting`),
/// else when it does. Decided on what the last pass held, not on the node's readiness when it
/// ended, which missed a node that turned ready during the pass (the period then); and no
/// extra pass when nothing waits for it (it would only redo the last one's work at once).
fn next(rx: &Receiver<Msg>, deadline: Instant, shared: &Shared, held_for_ready: bool) -> Option<&'static str> {
    if held_for_ready && is_ready(shared) {
        return Some("ready");
    }
    let first = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Some("period");
        }
        match rx.recv_timeout(left.min(READY_POLL)) {
            Ok(m) => break m,
            Err(RecvTimeoutError::Timeout) => {
                if held_for_ready && is_ready(shared) {
                    return Some("ready");
                }
            }
            Err(RecvTimeoutError::Disconnected) => return None,
        }
    };
    let mut why = None;
    for m in std::iter::once(first).chain(rx.try_iter()) {
        match m {
            Msg::Stop => return None,
            Msg::Pass(w) => why = why.or(Some(w)),
        }
    }
    why
}

/// The pass as JSON: when, how long, whether the runtime was seen, each pod's state (and why
/// nothing was done, where something was needed), each action with its outcome, and how the
/// recorded pods were compared (in full, or unchanged since their last full comparison).
pub fn last_pass_json(report: &PassReport) -> serde_json::Value {
    let at = report.finished.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let pods: Vec<_> = report
        .findings
        .iter()
        .map(|f| {
            let mut p =
                json!({"pod": f.pod.to_string(), "uid": f.pod.uid, "sandbox": f.sandbox_id, "state": f.state.name()});
            if let Some(h) = &f.held {
                p["held"] = h.to_string().into();
            }
            p
        })
        .collect();
    let actions: Vec<_> = report
        .actions
        .iter()
        .map(|(a, o)| {
            let mut v = json!({"kind": action_kind(a), "pod": a.pod().to_string()});
            v["outcome"] = o.name().into();
            match o {
                Outcome::Done => {}
                Outcome::Failed(e) => v["error"] = e.clone().into(),
                Outcome::Moot(why) | Outcome::Refused(why) => v["why"] = why.clone().into(),
            }
            v
        })
        .collect();
    json!({
        "pass": report.number,
        "finished": at,
        "tookMicros": report.took.as_micros() as u64,
        "runtimeUnseen": report.runtime_unseen,
        "recordsUnread": report.records_unread,
        "pods": pods,
        "actions": actions,
        "refusals": report.refusals.iter().map(|r| json!({"kind": r.kind, "subject": r.subject, "why": r.why})).collect::<Vec<_>>(),
        "compared": {"full": report.compared.full, "unchanged": report.compared.unchanged},
    })
}

fn write_last_pass(state_dir: &std::path::Path, report: &PassReport) {
    let mut body = serde_json::to_vec_pretty(&last_pass_json(report)).expect("JSON values serialize");
    body.push(b'\n');
    let path = state_dir.join(LAST_PASS_FILE);
    if let Err(e) = crate::files::write_atomic(&path, &body, 0o600) {
        tracing::warn!(file = %path.display(), "cannot write the reconciler's last pass: {e}");
    }
    #[cfg(feature = "fault-injection")]
    journal(state_dir, report);
}

/// A test's fault-injection build, with `AETHER_INSTALLER_PASS_JOURNAL=1`, also appends every
/// pass, one JSON line each, to [`PASS_JOURNAL_FILE`] in the state directory: the last-pass
/// file is replaced by each pass, so a test reading it could miss a pass that another
/// followed at once (the "ready" pass, a poke); the journal misses none.
#[cfg(feature = "fault-injection")]
fn journal(state_dir: &std::path::Path, report: &PassReport) {
    use std::io::Write as _;
    if std::env::var_os("AETHER_INSTALLER_PASS_JOURNAL").is_none_or(|v| v != "1") {
        return;
    }
    let mut line = serde_json::to_vec(&last_pass_json(report)).expect("JSON values serialize");
    line.push(b'\n');
    let path = state_dir.join(PASS_JOURNAL_FILE);
    let written =
        std::fs::OpenOptions::new().create(true).append(true).open(&path).and_then(|mut f| f.write_all(&line));
    if let Err(e) = written {
        tracing::warn!(file = %path.display(), "cannot append to the pass journal: {e}");
    }
}

/// Every pass, one JSON line each: written only by a test's fault-injection build (see
/// `journal`).
pub const PASS_JOURNAL_FILE: &str = "reconciler-passes.jsonl";

/// The reconciler's settings, from the installer's flags (`InstallArgs::reconciler`): the
/// flags know the reconciler, never the other way round.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `--reconcile`: whether the reconciler runs at all.
    pub enabled: bool,
    /// The runtime's CRI socket, if one is given.
    pub cri_socket: Option<std::path::PathBuf>,
    pub cri_timeout: Duration,
    pub cri_max_message_bytes: usize,
    pub cri_pass_budget: Duration,
    pub period: Duration,
    pub limits: Limits,
    pub state_dir: std::path::PathBuf,
}

/// The time a pass may wait on the runtime in all: `--cri-pass-budget-seconds`, but no more
/// than the period, or one call's timeout if that is longer (a slow list is still read
/// whole). The records' repairs are done at a pass's start, before the runtime is asked, so
/// drift waits at most for the pass under way: a runtime that stalls holds it up no longer
/// than the period (or one call), and drift is repaired within about a period of being made
/// whatever the runtime does. What is not asked in time is asked by a later pass.
pub fn pass_budget(budget: Duration, period: Duration, call_timeout: Duration) -> Duration {
    budget.min(period.max(call_timeout))
}

/// Starts the reconciler's thread for the installer (unless `--reconcile=false`): the
/// runtime's CRI socket if one is given (on the installer's shared async runtime), the node
/// library's operations in `node`.
pub fn start<N>(
    settings: Settings,
    shared: Arc<Shared>,
    node: N,
    rt: Arc<tokio::runtime::Runtime>,
) -> std::io::Result<Option<Looper>>
where
    N: NodeOps + Send + 'static,
{
    if !settings.enabled {
        tracing::info!("the reconciler is off (--reconcile=false)");
        return Ok(None);
    }
    let stopping = Stopping::new();
    let runtime = match settings.cri_socket {
        Some(socket) => {
            tracing::info!(socket = %socket.display(), policy = settings.limits.missed.name(), "reconciling the runtime's pods every {} s", settings.period.as_secs());
            Some(CriRuntime::new(
                socket,
                settings.cri_timeout,
                settings.cri_max_message_bytes,
                pass_budget(settings.cri_pass_budget, settings.period, settings.cri_timeout),
                stopping.clone(),
                rt,
            ))
        }
        None => None,
    };
    let reconciler = Reconciler::new(runtime, node, settings.limits);
    spawn(reconciler, settings.period, shared, settings.state_dir, stopping).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pass waits on the runtime no longer than the period (so the next pass's repairs are
    /// not held up by a runtime that stalls), except that one call always gets its timeout.
    #[test]
    fn a_pass_waits_on_the_runtime_at_most_a_period_or_one_call() {
        let s = Duration::from_secs;
        // The node: period 1 s, CRI timeout 2 s, the default budget.
        assert_eq!(pass_budget(s(10), s(1), s(2)), s(2));
        // The defaults: unchanged.
        assert_eq!(pass_budget(s(10), s(10), s(5)), s(10));
        assert_eq!(pass_budget(s(3), s(10), s(5)), s(3));
        assert_eq!(pass_budget(s(60), s(30), s(5)), s(30));
    }
}
