//! The Service layer served to the node agent: `POST /services/apply` on a unix socket
//! (`--services-socket`), what `aether-cni services apply` does, without a process per
//! document. The installer is long-lived, so `aether_node::services::Applier` keeps between
//! documents what a one-shot apply pays for each time.
//!
//! - The socket: created with mode 0600 in a 0700 directory (root only; the agent runs
//!   privileged), a socket file left at its path (an installer that was killed) replaced,
//!   removed on shutdown if it is still this installer's. Anything else at the path is an
//!   error, never removed.
//! - The HTTP face (`serve`'s listener `services`, HTTP/1.1 on hyper, one request per
//!   connection, the same head limits) reads one body at a time, at most
//!   `MAX_SNAPSHOT_BYTES` (over it: 413 naming the cap), and hands it to the applier thread.
//! - The applier thread owns the `Applier`: documents are applied one at a time, never on the
//!   runtime's thread; between them, about once a second, it lets go of pods that went
//!   (`tidy`). A panic in an apply is answered 500 and the applier is made anew.
//!
//! Answers (the body is what `services apply` prints, or `{"error", "reasons"}`):
//! 200 every pod has the document; 500 with the report when some pod failed (the document
//! was stored); 409 when the agent must send a whole snapshot or a newer one (an older or
//! reused generation, a change whose base is not the stored one, or no base stored; the
//! body adds `storedGeneration`); 400 refused; 413 over the cap; 507 not started because
//! the kernel memory it would charge to the installer's memory cgroup crosses its limit, or
//! not read because holding it would (from the declared length, before the body is kept, or
//! as a chunked body's buffer grows; the body is drained so the client hears it) or not
//! parsed because parsing it would (the reasons name the memory needed, the limit
//! and `resources.limits.memory`; nothing changed; the metrics `..._over_budget_*` say the
//! same); 408 the body did not arrive in
//! time, 503 no turn in time (both within [`WAIT_DEADLINE`] of connecting; nothing changed);
//! 500 any other error; 404/405 for anything but `POST /services/apply`. An apply under way
//! is never cut off by a deadline: its answer comes when it is done ([`Deadline`]).

use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_node::services::snapshot::{too_large, MAX_SNAPSHOT_BYTES};
use aether_node::services::{change, Applier, ServicesError};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry};
use serde_json::{json, Value};

/// The only path served, and how long a document may take to be read and to wait for its
/// turn: shared with the CLI's client.
pub use aether_apply_client::{APPLY_PATH, WAIT_DEADLINE};
/// The socket's file name in the default directory, `<state-dir>/agent/`.
pub const DEFAULT_DIR: &str = "agent";
pub const DEFAULT_NAME: &str = "services.sock";
/// Open connections on the socket: the agent sends one document at a time (a retry may
/// overlap a request it gave up on); only root can connect.
pub const MAX_CONNECTIONS: usize = 16;
/// How long a body may send nothing before it is given up (408): a client that stops
/// sending holds only its own connection and one of the reading slots, never the apply turn.
pub const BODY_IDLE: Duration = Duration::from_secs(10);
/// Bodies read or held at once (each up to the snapshot cap): one being applied, one read
/// meanwhile. A stalled body holds one slot for at most [`BODY_IDLE`].
const READING_SLOTS: usize = 2;
/// How often the idle applier lets go of pods that went.
const TIDY_PERIOD: Duration = Duration::from_secs(1);
/// Once the answer is ready, the client has this long to read it.
pub const ANSWER_DEADLINE: Duration = Duration::from_secs(20);

/// A connection's deadline, which its request moves. It starts [`WAIT_DEADLINE`] away and
/// bounds reading the document and waiting for the apply turn (answered 408 and 503 when it
/// passes); it is lifted while the document is applied (an apply under way is never cut off,
/// so its answer always says what it did: a whole snapshot to every pod of a loaded node can
/// take minutes); once answered, it is now. The connection itself is closed
/// [`ANSWER_DEADLINE`] after it, the time a client has to read its answer.
#[derive(Clone)]
pub struct Deadline(Arc<tokio::sync::watch::Sender<Option<tokio::time::Instant>>>);

pub type DeadlineWatch = tokio::sync::watch::Receiver<Option<tokio::time::Instant>>;

impl Deadline {
    /// A deadline [`WAIT_DEADLINE`] from now.
    pub fn new() -> (Deadline, DeadlineWatch) {
        let (tx, rx) = tokio::sync::watch::channel(Some(tokio::time::Instant::now() + deadlines().0));
        (Deadline(Arc::new(tx)), rx)
    }

    /// When the wait ends (`None`: lifted).
    fn at(&self) -> Option<tokio::time::Instant> {
        *self.0.borrow()
    }

    fn lift(&self) {
        self.0.send_replace(None);
    }

    fn now(&self) {
        self.0.send_replace(Some(tokio::time::Instant::now()));
    }
}

/// Drives `connection` until it ends or [`ANSWER_DEADLINE`] after its deadline, as
/// [`Deadline`] moves it.
pub async fn within_deadline<F: std::future::Future>(connection: F, mut deadline: DeadlineWatch) {
    let closes = |at: Option<tokio::time::Instant>| async move {
        match at {
            Some(at) => tokio::time::sleep_until(at + deadlines().1).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(connection);
    loop {
        let at = *deadline.borrow_and_update();
        tokio::select! {
            _ = &mut connection => return,
            _ = closes(at) => return,
            moved = deadline.changed() => if moved.is_err() {
                // Nobody can move it any more: the last one stands.
                tokio::select! { _ = &mut connection => {}, _ = closes(at) => {} }
                return;
            },
        }
    }
}

/// [`WAIT_DEADLINE`] and [`ANSWER_DEADLINE`]; a test's fault-injection build may shorten
/// both (`AETHER_INSTALLER_SERVICES_DEADLINES_MS`).
fn deadlines() -> (Duration, Duration) {
    #[cfg(feature = "fault-injection")]
    if let Some(ms) = std::env::var("AETHER_INSTALLER_SERVICES_DEADLINES_MS").ok().and_then(|v| v.parse().ok()) {
        return (Duration::from_millis(ms), Duration::from_millis(ms));
    }
    (WAIT_DEADLINE, ANSWER_DEADLINE)
}

/// A test's fault-injection build may make every apply this much longer
/// (`AETHER_INSTALLER_SLOW_APPLY_MS`): an apply that outlasts the connection's wait deadline.
fn injected_apply_delay() {
    #[cfg(feature = "fault-injection")]
    if let Some(ms) = std::env::var("AETHER_INSTALLER_SLOW_APPLY_MS").ok().and_then(|v| v.parse().ok()) {
        std::thread::sleep(Duration::from_millis(ms));
    }
}

/// The socket's identity, to remove on shutdown only the file this installer made.
pub struct Bound {
    pub path: PathBuf,
    /// Device, inode and change time: an inode number freed by an unlink may be reused at once.
    identity: (u64, u64, i64, i64),
}

fn identity(m: &std::fs::Metadata) -> (u64, u64, i64, i64) {
    (m.dev(), m.ino(), m.ctime(), m.ctime_nsec())
}

/// Binds the socket at `path` (non-blocking, for tokio): its directory made 0700 and owned by
/// this process's user (root) whether or not it existed (one that is a symlink or not a
/// directory is refused, naming it), a socket file already there replaced, the new one chmod
/// 0600.
pub fn bind(path: &Path) -> Result<(std::os::unix::net::UnixListener, Bound), String> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("cannot create its directory {}: {e}", dir.display()))?;
    tighten(dir)?;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            // A socket nobody removed: an installer that was killed (or one still running
            // during a surge rollout: the newest takes over; the old one will not remove it).
            std::fs::remove_file(path).map_err(|e| format!("cannot remove the socket left there: {e}"))?;
            tracing::info!(socket = %path.display(), "replaced the socket left by an earlier installer");
        }
        Ok(m) => {
            return Err(format!(
                "something that is not a socket is there ({}); not removed",
                if m.is_dir() { "a directory" } else { "a file" }
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e.to_string()),
    }
    let listener = std::os::unix::net::UnixListener::bind(path).map_err(|e| e.to_string())?;
    // The directory is 0700 already: nobody but root could connect in between.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(|e| e.to_string())?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let m = std::fs::symlink_metadata(path).map_err(|e| e.to_string())?;
    Ok((listener, Bound { path: path.to_path_buf(), identity: identity(&m) }))
}

/// Makes `dir` 0700 and owned by this process's user: anyone else able to write there could
/// replace the socket. An existing directory is tightened too (and said so).
fn tighten(dir: &Path) -> Result<(), String> {
    let m = std::fs::symlink_metadata(dir).map_err(|e| format!("cannot read its directory {}: {e}", dir.display()))?;
    if !m.is_dir() {
        return Err(format!("its directory {} is not a directory (a symlink or a file): refused", dir.display()));
    }
    // SAFETY: geteuid and getegid cannot fail.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    if m.uid() != uid || m.gid() != gid {
        std::os::unix::fs::lchown(dir, Some(uid), Some(gid))
            .map_err(|e| format!("cannot make its directory {} owned by uid {uid}: {e}", dir.display()))?;
        tracing::info!(dir = %dir.display(), "the socket's directory was owned by uid {}: now by uid {uid}", m.uid());
    }
    if m.permissions().mode() & 0o7777 != 0o700 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| format!("cannot make its directory {} 0700: {e}", dir.display()))?;
        tracing::info!(dir = %dir.display(), "the socket's directory was mode {:o}: now 0700", m.permissions().mode() & 0o7777);
    }
    Ok(())
}

impl Bound {
    /// Removes the socket file if it is still the one bound here (a newer installer may have
    /// replaced it).
    pub fn remove(&self) {
        match std::fs::symlink_metadata(&self.path) {
            Ok(m) if identity(&m) == self.identity => {
                if let Err(e) = std::fs::remove_file(&self.path) {
                    tracing::warn!(socket = %self.path.display(), "cannot remove the Service layer's socket: {e}");
                }
            }
            _ => {}
        }
    }
}

/// Applies by kind (`change`, `whole`; `unread` for one that never reached the applier) and
/// outcome, and
/// their duration on the applier thread.
pub struct ServicesMetrics {
    pub applies: IntCounterVec,
    pub apply_seconds: HistogramVec,
    /// Pods whose netfilter socket the applier keeps (each pins its pod's netns until `tidy`).
    pub kept_pods: IntGauge,
    /// The last apply refused for the installer's memory limit: the kernel memory it would
    /// have charged, and the limit then (0 before any).
    pub over_budget_needed: IntGauge,
    pub over_budget_limit: IntGauge,
}

/// Every outcome an apply through the socket can have, as its metric label.
pub const OUTCOMES: [&str; 8] =
    ["applied", "pods-failed", "conflict", "refused", "over-budget", "error", "too-large", "stalled"];

impl ServicesMetrics {
    pub fn new() -> Self {
        let applies = IntCounterVec::new(
            Opts::new(
                "aether_cni_installer_services_applies_total",
                "Documents the agent sent over the Service layer's socket, by kind (change, whole; unread: over the size cap, its body stopped arriving, or it waited too long for its turn) and outcome (applied: every pod has it; pods-failed: stored, some pod failed; conflict: an older or reused generation, or a change whose base is not stored; refused: invalid; over-budget: not started, the kernel memory it would charge crosses the installer's memory limit, or, unread, the memory to parse and apply it does; error; too-large; stalled: nothing sent for 10 s, or not all of it within 120 s, 408; busy: no turn within 120 s of connecting, 503).",
            ),
            &["kind", "outcome"],
        )
        .unwrap();
        let apply_seconds = HistogramVec::new(
            HistogramOpts::new(
                "aether_cni_installer_services_apply_seconds",
                "Wall time of one apply through the socket on the applier thread (from the document read to its report), by kind.",
            )
            .buckets(vec![0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0]),
            &["kind"],
        )
        .unwrap();
        for kind in ["change", "whole"] {
            for outcome in &OUTCOMES[..6] {
                applies.with_label_values(&[kind, outcome]);
            }
            apply_seconds.with_label_values(&[kind]);
        }
        applies.with_label_values(&["unread", "too-large"]);
        applies.with_label_values(&["unread", "stalled"]);
        applies.with_label_values(&["unread", "busy"]);
        applies.with_label_values(&["unread", "over-budget"]);
        let kept_pods = IntGauge::new(
            "aether_cni_installer_services_kept_pods",
            "Pods whose netfilter socket the Service layer's applier keeps between documents (each keeps its pod's netns until the applier, idle, sees the pod's record gone: about a second).",
        )
        .unwrap();
        let over_budget_needed = IntGauge::new(
            "aether_cni_installer_services_over_budget_needed_bytes",
            "The kernel memory (bytes) the last document refused for the installer's memory limit would have charged to the installer's memory cgroup (the Service layer of every pod it would have rebuilt or changed); 0 before any. Raise resources.limits.memory past the installer's usage plus this.",
        )
        .unwrap();
        let over_budget_limit = IntGauge::new(
            "aether_cni_installer_services_over_budget_limit_bytes",
            "The installer's memory limit (bytes) when the last document was refused for it; 0 before any.",
        )
        .unwrap();
        ServicesMetrics { applies, apply_seconds, kept_pods, over_budget_needed, over_budget_limit }
    }

    /// The last document refused for the memory limit: what it needed, the limit then.
    fn over_budget(&self, over: &aether_node::memcg::OverBudget) {
        self.over_budget_needed.set(over.needed as i64);
        self.over_budget_limit.set(over.limit as i64);
    }

    pub fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.applies.clone()))?;
        registry.register(Box::new(self.apply_seconds.clone()))?;
        registry.register(Box::new(self.over_budget_needed.clone()))?;
        registry.register(Box::new(self.over_budget_limit.clone()))?;
        registry.register(Box::new(self.kept_pods.clone()))
    }
}

impl Default for ServicesMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// An HTTP answer: status and JSON body.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: String,
}

struct Job {
    body: Bytes,
    reply: tokio::sync::oneshot::Sender<Answer>,
}

/// The applier thread, and the way to it.
pub struct Applying {
    jobs: mpsc::Sender<Job>,
    /// One document applied at a time, taken once its body is read.
    turn: Arc<tokio::sync::Semaphore>,
    /// Bodies read or held at once ([`READING_SLOTS`]): the installer's memory holds at most
    /// that many documents.
    reading: Arc<tokio::sync::Semaphore>,
    /// For the documents refused before they reach the thread (over the cap, over the
    /// memory limit, stalled, busy).
    metrics: Arc<ServicesMetrics>,
}

pub struct ApplierThread(Option<std::thread::JoinHandle<()>>);

impl ApplierThread {
    /// Waits for the applier to end (its document finished): call after every `Applying` is
    /// dropped.
    pub fn join(mut self) {
        if let Some(t) = self.0.take() {
            let _ = t.join();
        }
    }
}

/// Starts the applier thread on `state_dir`, counting in `metrics` (the HTTP face's registry
/// holds them: this module knows nothing of the face that serves it).
pub fn start_applier(state_dir: &Path, metrics: Arc<ServicesMetrics>) -> std::io::Result<(Applying, ApplierThread)> {
    let (tx, rx) = mpsc::channel::<Job>();
    let state_dir = state_dir.to_path_buf();
    let thread_metrics = metrics.clone();
    let thread = std::thread::Builder::new()
        .name("installer-services".into())
        .spawn(move || applier_loop(&state_dir, rx, &thread_metrics))?;
    let applying = Applying {
        jobs: tx,
        turn: Arc::new(tokio::sync::Semaphore::new(1)),
        reading: Arc::new(tokio::sync::Semaphore::new(READING_SLOTS)),
        metrics,
    };
    Ok((applying, ApplierThread(Some(thread))))
}

fn applier_loop(state_dir: &Path, rx: mpsc::Receiver<Job>, metrics: &ServicesMetrics) {
    // The kernel memory an element costs, measured before the first document (while the
    // installer's usage is low) when a memory limit binds it.
    aether_node::services::budget::prepare();
    let mut applier = Applier::new(state_dir);
    let mut next_tidy = Instant::now() + TIDY_PERIOD;
    loop {
        match rx.recv_timeout(next_tidy.saturating_duration_since(Instant::now())) {
            Ok(job) => {
                injected_apply_delay();
                let answer = apply_one(&mut applier, state_dir, &job.body, metrics);
                metrics.kept_pods.set(applier.kept_pods() as i64);
                // The client may have gone (hung up, evicted): the document stays applied.
                let _ = job.reply.send(answer);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        // Also under a steady stream of documents, between two of them.
        if Instant::now() >= next_tidy {
            if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| applier.tidy())) {
                tracing::error!(
                    "the Service layer's applier panicked while tidying: {}; made anew",
                    panic_text(&*panic)
                );
                applier = Applier::new(state_dir);
            }
            metrics.kept_pods.set(applier.kept_pods() as i64);
            next_tidy = Instant::now() + TIDY_PERIOD;
        }
    }
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// One document through the applier: the answer, the metrics and the log line.
fn apply_one(applier: &mut Applier, state_dir: &Path, body: &[u8], metrics: &ServicesMetrics) -> Answer {
    let kind = if change::is_change(body) { "change" } else { "whole" };
    let started = Instant::now();
    let applied = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| applier.apply(body)));
    let took = started.elapsed();
    metrics.apply_seconds.with_label_values(&[kind]).observe(took.as_secs_f64());
    let ms = took.as_secs_f64() * 1e3;
    let (outcome, answer) = match applied {
        Ok(Ok(report)) => {
            let pods = report.pods_by_result();
            let failed = report.failed();
            if failed {
                tracing::warn!(generation = report.generation, kind, %pods, "applied with some pod failed in {ms:.1} ms");
            } else if kind == "change" {
                // Up to several a second: at info, every endpoint flip would be a line.
                tracing::debug!(generation = report.generation, kind, %pods, "applied in {ms:.1} ms");
            } else {
                tracing::info!(generation = report.generation, kind, %pods, "applied in {ms:.1} ms");
            }
            let mut text = report.to_pretty_text();
            text.push('\n');
            if failed {
                ("pods-failed", Answer { status: 500, body: text })
            } else {
                ("applied", Answer { status: 200, body: text })
            }
        }
        Ok(Err(e)) => {
            let (outcome, status) = match &e {
                ServicesError::OlderGeneration { .. }
                | ServicesError::StaleBase { .. }
                | ServicesError::NoBase { .. }
                | ServicesError::GenerationReused(_) => ("conflict", 409),
                ServicesError::Refused { .. } => ("refused", 400),
                ServicesError::OverBudget(over) => {
                    metrics.over_budget(over);
                    ("over-budget", 507)
                }
                _ => ("error", 500),
            };
            let line = one_line(&e.to_string());
            tracing::warn!(kind, status, "not applied in {ms:.1} ms: {line}");
            let mut v = json!({"error": line, "reasons": e.reasons()});
            if status == 409 {
                v["storedGeneration"] = stored_generation(&e);
            }
            (outcome, Answer { status, body: json_text(&v) })
        }
        Err(panic) => {
            let why = format!("the applier panicked: {}", panic_text(&*panic));
            tracing::error!(kind, "{why}; made anew (the stored files are the truth)");
            *applier = Applier::new(state_dir);
            ("error", Answer { status: 500, body: json_text(&json!({"error": why, "reasons": [why]})) })
        }
    };
    metrics.applies.with_label_values(&[kind, outcome]).inc();
    answer
}

/// Pretty JSON and a newline: what `services apply` prints for its report.
fn json_text(v: &Value) -> String {
    let mut s = serde_json::to_string_pretty(v).expect("JSON values serialize");
    s.push('\n');
    s
}

fn one_line(s: &str) -> String {
    s.replace('\n', " ")
}

/// The stored generation a conflict names (null: none stored).
fn stored_generation(e: &ServicesError) -> Value {
    match e {
        ServicesError::OlderGeneration { stored, .. } | ServicesError::StaleBase { stored, .. } => json!(stored),
        ServicesError::GenerationReused(g) => json!(g),
        _ => Value::Null,
    }
}

/// The body in one buffer, at most the snapshot cap, sized by its declared length when there
/// is one: gathered in chunks and then copied into one buffer, a 64 MiB document would be
/// held twice at once. Without one (chunked), the buffer doubles as it fills, each growth
/// asked of the memory budget first; refused, the rest is drained (the client hears why).
async fn read_body(
    body: hyper::body::Incoming,
    declared: Option<u64>,
) -> Result<Vec<u8>, Box<dyn std::error::Error + Send + Sync>> {
    let mut body = Limited::new(body, MAX_SNAPSHOT_BYTES);
    let mut out = Vec::with_capacity(declared.map_or(0, |n| n as usize));
    loop {
        let frame = match tokio::time::timeout(BODY_IDLE, body.frame()).await {
            Ok(Some(frame)) => frame?,
            Ok(None) => return Ok(out),
            Err(_) => return Err(Box::new(Stalled { after: BODY_IDLE, read: out.len() })),
        };
        if let Ok(data) = frame.into_data() {
            let len = out.len() + data.len();
            if len > out.capacity() {
                let grown = len.max(out.capacity() * 2);
                if let Err(over) = aether_node::services::budget::body_grows(len as u64, grown as u64) {
                    drop(out);
                    drain_body(body).await;
                    return Err(Box::new(over));
                }
                out.reserve_exact(grown - out.len());
            }
            out.extend_from_slice(&data);
        }
    }
}

/// The body read to its end (the cap, or [`BODY_IDLE`] without a frame) and let go of.
async fn drain_body(mut body: Limited<hyper::body::Incoming>) {
    while let Ok(Some(Ok(_))) = tokio::time::timeout(BODY_IDLE, body.frame()).await {}
}

/// A body that sent nothing for [`BODY_IDLE`].
#[derive(Debug, thiserror::Error)]
#[error("the document stopped arriving: nothing for {after:?} after {read} bytes")]
struct Stalled {
    after: Duration,
    read: usize,
}

fn answer(status: u16, body: String) -> hyper::Response<Full<Bytes>> {
    let mut r = hyper::Response::builder().status(status).header(hyper::header::CONTENT_TYPE, "application/json");
    if status == 405 {
        r = r.header(hyper::header::ALLOW, "POST");
    }
    r.body(Full::new(Bytes::from(body))).expect("a valid status and header")
}

fn error_answer(status: u16, why: &str) -> hyper::Response<Full<Bytes>> {
    answer(status, json_text(&json!({"error": why, "reasons": [why]})))
}

impl Applying {
    /// Answers one request of the socket.
    pub async fn respond(
        &self,
        request: hyper::Request<hyper::body::Incoming>,
        deadline: &Deadline,
    ) -> hyper::Response<Full<Bytes>> {
        if request.uri().path() != APPLY_PATH {
            return error_answer(404, &format!("not found: this socket serves POST {APPLY_PATH}"));
        }
        if request.method() != hyper::Method::POST {
            return error_answer(
                405,
                &format!("{} is not allowed: POST the document to {APPLY_PATH}", request.method()),
            );
        }
        let declared = request
            .headers()
            .get(hyper::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > MAX_SNAPSHOT_BYTES as u64) {
            return self.too_large();
        }
        // The body is read before the apply turn is taken (a client that stops sending holds
        // no one else's document), in one of the reading slots (at most that many documents
        // in memory), each frame within BODY_IDLE.
        let Ok(reading_slot) = self.reading.acquire().await else {
            return error_answer(500, "the Service layer's applier is stopping");
        };
        let wait_until = deadline.at().unwrap_or_else(|| tokio::time::Instant::now() + WAIT_DEADLINE);
        // A body this process cannot hold under its memory limit is not kept: killed midway,
        // the installer would help no pod (the applier asks the same of the parse once the
        // body is read). It is read and dropped, frame by frame, so that a client that sends
        // it all before it reads hears why.
        if let Some(Err(over)) = declared.map(aether_node::services::budget::body_fits) {
            drop(reading_slot);
            let body = Limited::new(request.into_body(), MAX_SNAPSHOT_BYTES);
            let _ = tokio::time::timeout_at(wait_until, drain_body(body)).await;
            return self.over_budget(over);
        }
        let waited = || format!("{} s", deadlines().0.as_secs_f64());
        let Ok(read) = tokio::time::timeout_at(wait_until, read_body(request.into_body(), declared)).await else {
            tracing::warn!("a document did not arrive on the socket within {}: 408", waited());
            self.metrics.applies.with_label_values(&["unread", "stalled"]).inc();
            return error_answer(408, &format!("the document did not arrive within {}", waited()));
        };
        let body = match read {
            Ok(b) => Bytes::from(b),
            Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => return self.too_large(),
            Err(e) if e.is::<aether_node::memcg::OverBudget>() => {
                let over = e.downcast::<aether_node::memcg::OverBudget>().expect("checked");
                return self.over_budget(*over);
            }
            Err(e) if e.downcast_ref::<Stalled>().is_some() => {
                tracing::warn!("a document stopped arriving on the socket: {e}; 408");
                self.metrics.applies.with_label_values(&["unread", "stalled"]).inc();
                return error_answer(408, &e.to_string());
            }
            Err(e) => return error_answer(400, &format!("cannot read the document: {e}")),
        };
        let _turn = match tokio::time::timeout_at(wait_until, self.turn.acquire()).await {
            Ok(Ok(turn)) => turn,
            Ok(Err(_)) => return error_answer(500, "the Service layer's applier is stopping"),
            Err(_) => {
                tracing::warn!("a document waited {} for its turn behind another being applied: 503", waited());
                self.metrics.applies.with_label_values(&["unread", "busy"]).inc();
                return error_answer(
                    503,
                    &format!(
                        "another document has been applying for the whole {} this one waited; nothing changed: send it again",
                        waited()
                    ),
                );
            }
        };
        let (reply, answered) = tokio::sync::oneshot::channel();
        // The turn is this document's: the applier thread takes it now. From here the
        // connection waits for the apply, however long it takes.
        deadline.lift();
        if self.jobs.send(Job { body, reply }).is_err() {
            return error_answer(500, "the Service layer's applier has stopped");
        }
        let answered = answered.await;
        deadline.now();
        match answered {
            Ok(a) => answer(a.status, a.body),
            Err(_) => error_answer(500, "the Service layer's applier stopped before it answered"),
        }
    }

    fn over_budget(&self, over: aether_node::memcg::OverBudget) -> hyper::Response<Full<Bytes>> {
        self.metrics.over_budget(&over);
        self.metrics.applies.with_label_values(&["unread", "over-budget"]).inc();
        let e = ServicesError::OverBudget(over);
        let line = one_line(&e.to_string());
        tracing::warn!(kind = "unread", status = 507, "not applied: {line}");
        answer(507, json_text(&json!({"error": line, "reasons": e.reasons()})))
    }

    fn too_large(&self) -> hyper::Response<Full<Bytes>> {
        tracing::warn!("a document over the limit of {MAX_SNAPSHOT_BYTES} bytes was sent to the socket: 413");
        self.metrics.applies.with_label_values(&["unread", "too-large"]).inc();
        error_answer(413, &too_large())
    }
}
