//! The installer's readiness and its metrics, and the HTTP face that serves them:
//! `/healthz` (the process runs), `/readyz` (200, or 503 naming each not-ready reason),
//! `/metrics` (Prometheus text 0.0.4: the installer's own metrics, then the Service layer's
//! node counters rendered by the plugin).
//!
//! The face is a node daemon's: anything that can reach its address may flood it. It is
//! served by hyper (HTTP/1.1) on the installer's one current-thread tokio runtime (`runtime`),
//! driven by the serving thread, so an open connection costs a task and a buffer, never a
//! thread. Every bound is here:
//! connections per listener (below the file-descriptor limit; at the limit the oldest
//! connection that has not sent its request is closed for the newcomer, else the newcomer
//! is closed at once), the request head (size and time to arrive), a connection's whole life,
//! one scrape of the node counters at a time (concurrent scrapes share its result) bounded
//! in time, on one blocking thread. Accept errors are logged at a bounded rate and retried
//! after a backoff. If serving ends anyway, `start`'s `on_end` is told, and the installer
//! marks the node not ready and exits (never half-alive).

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::rt::{TokioIo, TokioTimer};

use crate::{Error, NodeChecks};

mod status;
pub use status::{Face, Metrics, Shared, Status};

/// Requests whose head (request line and headers) is larger are answered 431 and closed.
pub const MAX_HEAD_BYTES: usize = 8 * 1024;
/// A request head must arrive within this time of the connection's first read.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection's whole life (one request: keep-alive is off), a client that reads its
/// answer slowly included.
pub const CONNECTION_DEADLINE: Duration = Duration::from_secs(20);
/// A scrape waits this long for the node counters (which read every pod's), then answers
/// without them (`aether_cni_installer_node_counters_up 0`); under Prometheus' default 10 s.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(8);
/// A connection younger than this is never evicted for a newcomer: it has had no time to
/// send its request yet.
const EVICTION_GRACE: Duration = Duration::from_millis(250);
/// File descriptors kept out of the connection limits, for the installer's own files,
/// watches, and the netns a scrape opens.
const RESERVED_FDS: u64 = 64;
/// The Service layer's socket's connection limit (root only, one agent).
const SOCKET_CONNECTIONS: usize = crate::services_socket::MAX_CONNECTIONS;
/// No listener's limit is set below this, whatever the file-descriptor limit.
const MIN_CONNECTIONS: usize = 8;
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// At most one log line per this period for each kind of repeated event.
const LOG_PERIOD: Duration = Duration::from_secs(10);

/// Where the HTTP face listens, and its connection limit per listener.
#[derive(Debug, Clone)]
pub struct Config {
    /// `/healthz`, `/readyz`, `/metrics`.
    pub probes: SocketAddr,
    /// `/metrics` only, if given.
    pub metrics: Option<SocketAddr>,
    /// Open connections per listener (lowered to fit the file-descriptor limit).
    pub max_connections: usize,
    /// The Service layer's unix socket for the agent, if it is served.
    pub services_socket: Option<std::path::PathBuf>,
    /// The node state directory the socket's applies work on.
    pub state_dir: std::path::PathBuf,
}

impl Config {
    /// `max_connections`, lowered so that every listener at its limit still leaves
    /// `RESERVED_FDS` of the soft file-descriptor limit free (never below `MIN_CONNECTIONS`).
    pub fn connection_limit(&self) -> usize {
        let listeners = 1 + u64::from(self.metrics.is_some());
        let reserved = RESERVED_FDS + if self.services_socket.is_some() { SOCKET_CONNECTIONS as u64 } else { 0 };
        let fit = open_files_limit().map_or(u64::MAX, |n| n.saturating_sub(reserved) / listeners);
        self.max_connections.min(usize::try_from(fit).unwrap_or(usize::MAX)).max(MIN_CONNECTIONS)
    }
}

/// The soft RLIMIT_NOFILE (None: unlimited or unknown).
fn open_files_limit() -> Option<u64> {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct it is given.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0;
    (ok && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
}

/// Told why serving ended (called once, on the serving thread), unless it was stopped.
pub type OnEnd = Box<dyn FnOnce(String) + Send>;

/// Binds every listener now (so a bad address fails before anything is installed) and
/// serves on a thread of its own, which drives the installer's `runtime`, until the returned
/// handle is dropped. If serving ends otherwise (a panic, a loop that returns), `on_end` is
/// called with the reason.
pub fn start(
    config: &Config,
    shared: Arc<Shared>,
    hooks: Arc<dyn NodeChecks>,
    on_end: OnEnd,
    runtime: Arc<tokio::runtime::Runtime>,
) -> Result<Server, Error> {
    let listen_err = |addr: SocketAddr| move |e: std::io::Error| Error::Listen { addr, why: e.to_string() };
    let limit = config.connection_limit();
    let mut listeners = Vec::new();
    let mut addrs = Vec::new();
    let mut socket = None;
    {
        let _entered = runtime.enter();
        for (face, addr) in
            std::iter::once((Face::Probes, config.probes)).chain(config.metrics.map(|a| (Face::Metrics, a)))
        {
            let tcp = bind(addr).map_err(listen_err(addr))?;
            let addr = tcp.local_addr().map_err(listen_err(addr))?;
            addrs.push(addr);
            listeners.push(Listener { face, socket: Socket::Tcp(tcp), name: addr.to_string(), limit });
        }
        if let Some(path) = &config.services_socket {
            let socket_err = |why: String| Error::ServicesSocket { path: path.clone(), why };
            let (unix, bound) = crate::services_socket::bind(path).map_err(socket_err)?;
            let unix = tokio::net::UnixListener::from_std(unix).map_err(|e| socket_err(e.to_string()))?;
            let name = path.display().to_string();
            listeners.push(Listener {
                face: Face::Services,
                socket: Socket::Unix(unix),
                name,
                limit: SOCKET_CONNECTIONS,
            });
            socket = Some(bound);
        }
    }
    let (addr, metrics_addr) = (addrs[0], addrs.get(1).copied());
    let (services, applier) = match &socket {
        Some(bound) => {
            let started = crate::services_socket::start_applier(&config.state_dir, shared.metrics.services.clone());
            let (applying, thread) =
                started.map_err(|e| Error::ServicesSocket { path: bound.path.clone(), why: e.to_string() })?;
            (Some(applying), Some(thread))
        }
        None => (None, None),
    };
    let app = Arc::new(App { shared, hooks, scrapes: Scrapes::default(), services });
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let driven = runtime.clone();
    let thread = std::thread::Builder::new()
        .name("installer-http".into())
        .spawn(move || {
            let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                driven.block_on(serve(listeners, app, stop_rx))
            }));
            drop(driven);
            let why = match served {
                Ok(Ok(())) => return,
                Ok(Err(why)) => why,
                Err(panic) => format!("the serving thread panicked: {}", panic_message(&*panic)),
            };
            tracing::error!("HTTP serving ended: {why}");
            on_end(why);
        })
        .map_err(listen_err(config.probes))?;
    Ok(Server {
        stop: stop_tx,
        thread: Some(thread),
        runtime: Some(runtime),
        addr,
        metrics_addr,
        connection_limit: limit,
        socket,
        applier,
    })
}

/// A listening socket with SO_REUSEADDR (a restarted installer binds at once while the old
/// one's connections linger in TIME_WAIT) and a backlog that takes a burst.
fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

struct Listener {
    face: Face,
    socket: Socket,
    /// Its address or path, for log lines.
    name: String,
    limit: usize,
}

enum Socket {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

enum Stream {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

impl Socket {
    async fn accept(&self) -> std::io::Result<Stream> {
        match self {
            Socket::Tcp(l) => l.accept().await.map(|(s, _)| Stream::Tcp(s)),
            Socket::Unix(l) => l.accept().await.map(|(s, _)| Stream::Unix(s)),
        }
    }
}

/// What every connection's task shares.
struct App {
    shared: Arc<Shared>,
    hooks: Arc<dyn NodeChecks>,
    scrapes: Scrapes,
    /// The Service layer's applier, when its socket is served.
    services: Option<crate::services_socket::Applying>,
}

/// Every accept loop, until `stop` changes (Ok) or a loop ends (Err: why).
async fn serve(
    listeners: Vec<Listener>,
    app: Arc<App>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), String> {
    let mut loops = tokio::task::JoinSet::new();
    let mut names = BTreeMap::new();
    for l in listeners {
        let name = format!("the accept loop of {} ({})", l.name, l.face.name());
        names.insert(loops.spawn(accept_loop(l, app.clone())).id(), name);
    }
    tokio::select! {
        _ = stop.changed() => Ok(()),
        ended = loops.join_next_with_id() => Err(match ended {
            Some(Ok((id, why))) => format!("{} ended: {why}", names[&id]),
            Some(Err(e)) if e.is_panic() => {
                let name = names[&e.id()].clone();
                format!("{name} panicked: {}", panic_message(&*e.into_panic()))
            }
            Some(Err(e)) => format!("{} was cancelled", names[&e.id()]),
            None => "no listener".into(),
        }),
    }
}

/// One open connection, as its accept loop tracks it.
struct Conn {
    since: Instant,
    /// Set once its request head has been read: it is being answered, never evicted.
    head_read: Arc<AtomicBool>,
    task: tokio::task::AbortHandle,
}

/// At most one line per `LOG_PERIOD`, saying how many were held back.
#[derive(Default)]
struct RateLimited {
    last: Option<Instant>,
    held_back: u64,
}

impl RateLimited {
    fn log(&mut self, line: impl FnOnce(u64)) {
        if self.last.is_some_and(|t| t.elapsed() < LOG_PERIOD) {
            self.held_back += 1;
            return;
        }
        line(self.held_back);
        (self.last, self.held_back) = (Some(Instant::now()), 0);
    }
}

/// The AETHER_INSTALLER_INJECT_SERVE_FAILURE=N of a test: the probes' accept loop panics at
/// its Nth connection. Compiled in only with the `fault-injection` feature.
#[cfg(feature = "fault-injection")]
fn injected_failure() -> Option<u64> {
    std::env::var("AETHER_INSTALLER_INJECT_SERVE_FAILURE").ok()?.parse().ok()
}

#[cfg(not(feature = "fault-injection"))]
fn injected_failure() -> Option<u64> {
    None
}

/// Accepts until the runtime stops; returns only if it cannot go on (never, so far).
async fn accept_loop(l: Listener, app: Arc<App>) -> String {
    let metrics = &app.shared.metrics;
    let name = l.face.name();
    let fail_at = if l.face == Face::Probes { injected_failure() } else { None };
    let mut accepted = 0u64;
    let mut open: VecDeque<Conn> = VecDeque::new();
    let (mut accept_log, mut limit_log) = (RateLimited::default(), RateLimited::default());
    let mut backoff = ACCEPT_BACKOFF_MIN;
    loop {
        let stream = match l.socket.accept().await {
            Ok(stream) => {
                backoff = ACCEPT_BACKOFF_MIN;
                stream
            }
            Err(e) => {
                metrics.http_accept_errors.with_label_values(&[name]).inc();
                let out_of_resources =
                    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM));
                // Out of descriptors: free one held by a connection that sent nothing yet and
                // retry once it is closed; with none to free, back off.
                let evicted = out_of_resources && evict_idle(&mut open, Duration::ZERO);
                let wait = if out_of_resources && !evicted { backoff } else { Duration::ZERO };
                accept_log.log(|held_back| {
                    tracing::warn!(
                        listener = %l.name,
                        held_back,
                        "cannot accept an HTTP connection: {e}; retrying in {} ms{}",
                        wait.as_millis(),
                        if evicted { " (an idle connection closed to make room)" } else { "" }
                    )
                });
                if wait.is_zero() {
                    // The evicted task runs (and closes its socket) before the next accept.
                    tokio::task::yield_now().await;
                    tokio::task::yield_now().await;
                } else {
                    tokio::time::sleep(wait).await;
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                }
                continue;
            }
        };
        accepted += 1;
        if fail_at.is_some_and(|n| accepted >= n) {
            panic!("AETHER_INSTALLER_INJECT_SERVE_FAILURE: the accept loop fails at connection {accepted}");
        }
        open.retain(|c| !c.task.is_finished());
        if open.len() >= l.limit {
            if evict_idle(&mut open, EVICTION_GRACE) {
                metrics.http_limited.with_label_values(&[name, "evicted"]).inc();
            } else {
                drop(stream);
                metrics.http_limited.with_label_values(&[name, "refused"]).inc();
                limit_log.log(|held_back| {
                    tracing::warn!(
                        listener = %l.name,
                        limit = l.limit,
                        held_back,
                        "HTTP connection limit reached and every connection is answering or just arrived: a new one closed"
                    )
                });
                continue;
            }
        }
        let head_read = Arc::new(AtomicBool::new(false));
        let task = match stream {
            Stream::Tcp(tcp) => {
                let _ = tcp.set_nodelay(true);
                tokio::spawn(serve_connection(tcp, l.face, app.clone(), head_read.clone()))
            }
            Stream::Unix(unix) => tokio::spawn(serve_connection(unix, l.face, app.clone(), head_read.clone())),
        };
        open.push_back(Conn { since: Instant::now(), head_read, task: task.abort_handle() });
        // Let the new connection read what it has sent before the next one is accepted.
        tokio::task::yield_now().await;
    }
}

/// Closes the oldest connection older than `grace` that has not sent its request head.
fn evict_idle(open: &mut VecDeque<Conn>, grace: Duration) -> bool {
    let Some(i) = open.iter().position(|c| !c.head_read.load(Ordering::Relaxed) && c.since.elapsed() >= grace) else {
        return false;
    };
    open.remove(i).expect("an index from position").task.abort();
    true
}

/// Counts an open connection while it lives (also when its task is aborted).
struct Counted(prometheus::IntGauge);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// One request (keep-alive is off: a probe, a scrape or a document, then close), within the
/// head's size and time limits and the connection's deadline.
async fn serve_connection<S>(stream: S, face: Face, app: Arc<App>, head_read: Arc<AtomicBool>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let gauge = app.shared.metrics.http_connections.with_label_values(&[face.name()]);
    gauge.inc();
    let _counted = Counted(gauge);
    let (deadline, moved) = crate::services_socket::Deadline::new();
    let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
        head_read.store(true, Ordering::Relaxed);
        let (app, deadline) = (app.clone(), deadline.clone());
        async move {
            Ok::<_, Infallible>(match (face, &app.services) {
                (Face::Services, Some(services)) => services.respond(request, &deadline).await,
                _ => app.respond(face, request.uri().path()).await,
            })
        }
    });
    // A document's body is read through it: larger reads (the head's limit stays).
    let buffer = if face == Face::Services { 64 * 1024 } else { MAX_HEAD_BYTES };
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .max_buf_size(buffer)
        .max_header_size(MAX_HEAD_BYTES)
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), service);
    match face {
        // Its deadline moves with the document (read, wait for the turn, applied, answered).
        Face::Services => crate::services_socket::within_deadline(connection, moved).await,
        _ => drop(tokio::time::timeout(CONNECTION_DEADLINE, connection).await),
    }
}

const TEXT: &str = "text/plain; charset=utf-8";

fn answer(code: u16, content_type: &'static str, body: String) -> hyper::Response<Full<Bytes>> {
    hyper::Response::builder()
        .status(code)
        .header(hyper::header::CONTENT_TYPE, content_type)
        .body(Full::new(Bytes::from(body)))
        .expect("a valid status and header")
}

impl App {
    async fn respond(&self, face: Face, path: &str) -> hyper::Response<Full<Bytes>> {
        match (face, path) {
            (Face::Probes, "/healthz") => answer(200, TEXT, "ok\n".into()),
            (Face::Probes, "/readyz") => {
                let status = self.shared.status.lock().unwrap();
                if status.not_ready.is_empty() {
                    answer(200, TEXT, "ready\n".into())
                } else {
                    answer(503, TEXT, status.describe())
                }
            }
            (_, "/metrics") => answer(200, "text/plain; version=0.0.4; charset=utf-8", self.metrics().await),
            (Face::Probes, _) => answer(404, TEXT, "not found: try /healthz, /readyz or /metrics\n".into()),
            (Face::Metrics, _) => {
                answer(404, TEXT, "not found: this address serves /metrics (the probes listen on loopback)\n".into())
            }
            (Face::Services, _) => answer(500, TEXT, "the Service layer's applier is not running\n".into()),
        }
    }

    async fn metrics(&self) -> String {
        let mut body = self.shared.metrics.encode();
        let up = match self.scrapes.node_counters(&self.hooks).await {
            Ok(text) => {
                body.push_str(text.trim_end());
                body.push('\n');
                1
            }
            Err(e) => {
                body.push_str(&format!(
                    "# the Service layer's node counters are unavailable: {}\n",
                    e.replace('\n', " ")
                ));
                0
            }
        };
        body.push_str(
            "# HELP aether_cni_installer_node_counters_up 1 when the Service layer's node counters could be read.\n",
        );
        body.push_str("# TYPE aether_cni_installer_node_counters_up gauge\n");
        body.push_str(&format!("aether_cni_installer_node_counters_up {up}\n"));
        body
    }
}

/// A reading of the node counters, and when it ended.
type Reading = (Instant, Result<String, String>);

/// The node counters, read by one scrape at a time on the runtime's one blocking thread; a
/// scrape that waited for another's reading takes its result (it is no older than the wait).
#[derive(Default)]
struct Scrapes {
    turn: Arc<tokio::sync::Mutex<()>>,
    last: Arc<Mutex<Option<Reading>>>,
}

impl Scrapes {
    async fn node_counters(&self, hooks: &Arc<dyn NodeChecks>) -> Result<String, String> {
        let asked = Instant::now();
        let read = async {
            let turn = self.turn.clone().lock_owned().await;
            if let Some((at, result)) = self.last.lock().unwrap().as_ref() {
                if *at >= asked {
                    return result.clone();
                }
            }
            let (hooks, last) = (hooks.clone(), self.last.clone());
            // The turn goes with the reading: a reading that outlives its scrape's timeout
            // still keeps the next one waiting, so at most one runs.
            let reading = tokio::task::spawn_blocking(move || {
                // Kept as text: a waiting scrape takes a copy of it.
                let result = hooks.node_counters().map_err(|e| e.to_string());
                *last.lock().unwrap() = Some((Instant::now(), result.clone()));
                drop(turn);
                result
            });
            reading.await.unwrap_or_else(|e| Err(format!("reading them failed: {e}")))
        };
        tokio::time::timeout(SCRAPE_TIMEOUT, read).await.unwrap_or_else(|_| {
            Err(format!("reading them took longer than {} s (every pod's are read)", SCRAPE_TIMEOUT.as_secs()))
        })
    }
}

pub struct Server {
    stop: tokio::sync::watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The installer's runtime, ended when serving stops if nothing else holds it.
    runtime: Option<Arc<tokio::runtime::Runtime>>,
    /// The probes' listener (`/healthz`, `/readyz`, `/metrics`).
    pub addr: SocketAddr,
    /// The metrics-only listener, if any.
    pub metrics_addr: Option<SocketAddr>,
    /// Open connections allowed per listener.
    pub connection_limit: usize,
    /// The Service layer's socket, removed when serving stops.
    socket: Option<crate::services_socket::Bound>,
    applier: Option<crate::services_socket::ApplierThread>,
}

impl Server {
    /// The Service layer's socket, when it is served.
    pub fn services_socket(&self) -> Option<&std::path::Path> {
        self.socket.as_ref().map(|b| b.path.as_path())
    }

    /// The runtime this server drives, for the installer's other async work.
    pub fn runtime(&self) -> Arc<tokio::runtime::Runtime> {
        self.runtime.clone().expect("held until dropped")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(rt) = self.runtime.take() {
            crate::runtime::shut_down(rt);
        }
        // No new document can come: the socket goes, then the applier ends its document.
        if let Some(b) = self.socket.take() {
            b.remove();
        }
        if let Some(a) = self.applier.take() {
            a.join();
        }
    }
}
