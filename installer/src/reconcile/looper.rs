//! The reconciler's thread: a pass each period and on cheap triggers (the installer's start,
//! the node turning ready), its metrics, and the last pass written to the state directory for
//! `aether-cni inspect`.

use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use super::{action_kind, NodeOps, Outcome, PassReport, Reconciler, Runtime};
use crate::serve::Shared;

/// The last pass, in the state directory (read by `aether-cni inspect` with no argument).
pub const LAST_PASS_FILE: &str = "reconciler-last-pass.json";

enum Msg {
    Pass(&'static str),
    Stop,
}

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
}

impl Looper {
    pub fn trigger(&self) -> Trigger {
        self.trigger.clone()
    }

    /// Ends the thread after its current pass.
    pub fn stop(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        let _ = self.trigger.0.send(Msg::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
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
) -> std::io::Result<Looper>
where
    R: Runtime + Send + 'static,
    N: NodeOps + Send + 'static,
{
    let (tx, rx) = mpsc::channel();
    let thread = std::thread::Builder::new().name("installer-reconcile".into()).spawn(move || {
        let mut trigger = "start";
        loop {
            let node_ready = {
                let status = shared.status.lock().unwrap();
                if status.not_ready.is_empty() {
                    Ok(())
                } else {
                    Err(status.describe().trim_end().replace('\n', "; "))
                }
            };
            let report = reconciler.pass(node_ready);
            shared.metrics.reconcile.observe(&report, trigger);
            write_last_pass(&state_dir, &report);
            match next(&rx, period, &shared) {
                Some(t) => trigger = t,
                None => return,
            }
        }
    })?;
    Ok(Looper { trigger: Trigger(tx), thread: Some(thread) })
}

/// How often the thread looks whether the node turned ready (a mutex read).
const READY_POLL: Duration = Duration::from_millis(200);

fn is_ready(shared: &Shared) -> bool {
    shared.status.lock().unwrap().not_ready.is_empty()
}

/// The next pass's trigger, or `None` to stop: the period, a poke, or the node turning ready
/// (missed pods were held while it was not).
fn next(rx: &Receiver<Msg>, period: Duration, shared: &Shared) -> Option<&'static str> {
    let deadline = std::time::Instant::now() + period;
    let was_ready = is_ready(shared);
    let first = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Some("period");
        }
        match rx.recv_timeout(left.min(READY_POLL)) {
            Ok(m) => break m,
            Err(RecvTimeoutError::Timeout) => {
                if !was_ready && is_ready(shared) {
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
            match o {
                Outcome::Done => v["outcome"] = "done".into(),
                Outcome::Failed(e) => {
                    v["outcome"] = "failed".into();
                    v["error"] = e.clone().into();
                }
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
}
