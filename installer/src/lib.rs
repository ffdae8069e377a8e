//! `aether-cni install`: the long-running container of the DaemonSet.
//!
//! It copies the plugin binary into the host's CNI bin directory, writes a chained copy of
//! the node's primary CNI configuration with the aether-cni entry appended (see `chain` for
//! why a copy and not an edit), keeps both in place while another CNI rewrites its files
//! (inotify), marks the node not ready in the state directory until all of that holds and
//! the kernel checks pass, serves `/healthz`, `/readyz` and `/metrics`, and on SIGTERM undoes
//! it all (unless told it is an upgrade).
//!
//! What it asks of the node beyond its files (the plugin's configuration parser, the kernel
//! checks, the Service layer's node counters) it asks the node library, `aether-node`,
//! through [`NodeChecks`] ([`LiveNode`] on a real node; tests stand in for it). It must not
//! know the CNI protocol.

pub mod args;
pub mod chain;
pub mod files;
pub mod reconcile;
pub mod runtime;
pub mod serve;
pub mod services_socket;

use std::fs;
use std::net::SocketAddr;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Instant;

use aether_node::config::ConfigError;
use aether_node::probe::ProbeError;
use aether_node::services::ServicesError;
use serde_json::{Map, Value};

pub use args::InstallArgs;
use serve::{Metrics, Reason, Shared};

/// The plugin's file name in the CNI bin directory: runtimes find a plugin by its `type`.
pub const BINARY_NAME: &str = chain::PLUGIN_TYPE;
/// While this file exists in the state directory, stopping keeps the binary and the entry.
pub const UPGRADE_FILE: &str = "installer-upgrade";
/// Mode of the installed binary.
const BINARY_MODE: u32 = 0o755;

/// What the installer asks of the node library: the answers a real node gives
/// ([`LiveNode`]), or a test's.
pub trait NodeChecks: Send + Sync {
    /// The plugin's own parser, given the entry exactly as the runtime will pass it (with the
    /// list's `name` and `cniVersion`).
    fn validate_entry(&self, entry: &[u8]) -> Result<(), ConfigError>;
    /// doctor's kernel checks (the default capture ruleset, in a private netns).
    fn kernel_checks(&self) -> Result<(), ProbeError>;
    /// The Service layer's node counters as Prometheus text.
    fn node_counters(&self) -> Result<String, ServicesError>;
}

/// The node as it is: `aether-node` on the installer's state directory.
pub struct LiveNode {
    services: aether_node::services::ServicesDir,
}

impl LiveNode {
    pub fn new(state_dir: &Path) -> Self {
        LiveNode { services: aether_node::services::ServicesDir::new(state_dir) }
    }
}

impl NodeChecks for LiveNode {
    fn validate_entry(&self, entry: &[u8]) -> Result<(), ConfigError> {
        aether_node::config::parse(entry).map(drop)
    }

    fn kernel_checks(&self) -> Result<(), ProbeError> {
        // A connect-time socket load balancer is said, not a not-ready reason: pods start
        // and are captured, but Service traffic reaches the capture already balanced.
        if let Ok(f @ aether_node::probe::socket_lb::Finding::Attached(_)) = aether_node::probe::socket_lb::detect() {
            tracing::warn!("{f}");
        }
        aether_node::probe::kernel_probe()
    }

    fn node_counters(&self) -> Result<String, ServicesError> {
        aether_node::services::node_counters(&self.services).map(|c| c.to_prometheus())
    }
}

/// A refused entry in one line: the parser's message and what lies under it.
fn refusal(e: &ConfigError) -> String {
    match e.details() {
        Some(d) => format!("{e}: {d}"),
        None => e.to_string(),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("CNI configuration directory {path}: {source}")]
    ConfDir { path: PathBuf, source: std::io::Error },
    #[error("no CNI network configuration (.conflist, .conf or .json) in {dir} yet: waiting for the main CNI")]
    NoPrimary { dir: PathBuf },
    #[error("primary CNI configuration {path} is a directory, not a file")]
    PrimaryIsDirectory { path: PathBuf },
    #[error("primary CNI configuration {path} is a symlink to {target}, which does not exist")]
    DanglingSymlink { path: PathBuf, target: PathBuf },
    #[error("cannot read primary CNI configuration {path}: {source}")]
    ReadPrimary { path: PathBuf, source: std::io::Error },
    #[error("primary CNI configuration {path} is invalid (left untouched): {why}")]
    InvalidPrimary { path: PathBuf, why: String },
    #[error("{path} sorts before {own}: runtimes would load it and not the chained copy (choose a --conflist-name that sorts first)")]
    Outranked { path: PathBuf, own: String },
    #[error("the aether-cni entry chained onto {path} is refused by the plugin: {why}")]
    EntryRefused { path: PathBuf, why: String },
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("cannot remove {path}: {source}")]
    Remove { path: PathBuf, source: std::io::Error },
    #[error("directory {path} is not usable: {source}")]
    Unusable { path: PathBuf, source: std::io::Error },
    #[error("cannot read the installer's own binary {path}: {source}")]
    ReadSelf { path: PathBuf, source: std::io::Error },
    #[error("cannot serve HTTP on {addr}: {why}")]
    Listen { addr: SocketAddr, why: String },
    #[error("cannot serve the Service layer on the socket {}: {why}", path.display())]
    ServicesSocket { path: PathBuf, why: String },
    #[error("cannot watch for changes: {0}")]
    Watch(std::io::Error),
    #[error("cannot handle signals: {0}")]
    Signals(std::io::Error),
    #[error("kernel checks failed: {0}")]
    Kernel(String),
    #[error("cannot start the reconciler: {0}")]
    Reconciler(std::io::Error),
    #[error("HTTP serving ended ({0}): exiting to be restarted")]
    ServingEnded(String),
}

impl Error {
    /// The not-ready reason this error stands for.
    pub fn reason(&self) -> Reason {
        match self {
            Error::ConfDir { .. }
            | Error::NoPrimary { .. }
            | Error::PrimaryIsDirectory { .. }
            | Error::DanglingSymlink { .. }
            | Error::ReadPrimary { .. }
            | Error::InvalidPrimary { .. }
            | Error::Outranked { .. } => Reason::Primary,
            Error::EntryRefused { .. } => Reason::Entry,
            Error::Kernel(_) => Reason::Kernel,
            _ => Reason::Chain,
        }
    }
}

/// Messages to the reconcile loop.
#[derive(Debug)]
pub enum Msg {
    /// Something changed in a watched directory (`name`: the file, if the kernel said).
    Changed { name: Option<std::ffi::OsString>, at: Instant },
    /// Stop: uninstall (unless an upgrade), then end the loop.
    Stop,
    /// The HTTP face stopped serving (why): mark the node not ready and end the loop,
    /// keeping the files (pods keep their capture; the restarted installer takes over).
    ServingEnded(String),
}

/// One node's installation: the desired files and what is known of them.
pub struct Node {
    args: InstallArgs,
    entry: Map<String, Value>,
    node: Arc<dyn NodeChecks>,
    shared: Arc<Shared>,
    binary: Vec<u8>,
    binary_installed: bool,
    conflist_installed: bool,
    kernel_ok: bool,
    marker_written: Option<String>,
}

impl Node {
    pub fn new(args: InstallArgs, node: Arc<dyn NodeChecks>, shared: Arc<Shared>, binary: Vec<u8>) -> Node {
        let entry = args.entry();
        Node {
            args,
            entry,
            node,
            shared,
            binary,
            binary_installed: false,
            conflist_installed: false,
            kernel_ok: false,
            marker_written: None,
        }
    }

    fn conflist_path(&self) -> PathBuf {
        self.args.cni_conf_dir.join(&self.args.conflist_name)
    }

    fn binary_path(&self) -> PathBuf {
        self.args.cni_bin_dir.join(BINARY_NAME)
    }

    fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// Before anything is written: the bin and state directories (and the conf directory,
    /// if it exists yet) must take a file. A failure names the directory; nothing is left.
    pub fn preflight(&self) -> Result<(), Error> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.args.state_dir)
            .map_err(|source| Error::Unusable { path: self.args.state_dir.clone(), source })?;
        let mut dirs = vec![&self.args.cni_bin_dir, &self.args.state_dir];
        if self.args.cni_conf_dir.exists() {
            dirs.push(&self.args.cni_conf_dir);
        }
        for dir in dirs {
            let probe = files::temp_path(&dir.join(".aether-cni-probe"));
            let made = fs::OpenOptions::new().write(true).create_new(true).open(&probe);
            made.map_err(|source| Error::Unusable { path: dir.clone(), source })?;
            fs::remove_file(&probe).map_err(|source| Error::Unusable { path: dir.clone(), source })?;
        }
        files::remove_stale_temps(&self.conflist_path());
        files::remove_stale_temps(&self.binary_path());
        Ok(())
    }

    fn set(&self, reason: Reason, outcome: Result<(), String>) {
        let mut status = self.shared.status.lock().unwrap();
        match outcome {
            Ok(()) => {
                status.not_ready.remove(&reason);
            }
            Err(why) => {
                if status.not_ready.get(&reason) != Some(&why) {
                    tracing::warn!(reason = reason.name(), "not ready: {why}");
                    self.metrics().record_error(reason, &why);
                }
                status.not_ready.insert(reason, why);
            }
        }
    }

    /// The binary in the CNI bin directory, byte for byte this one; rewritten (atomically)
    /// only when it differs.
    pub fn reconcile_binary(&mut self, since: Option<Instant>) {
        let path = self.binary_path();
        let outcome = if files::holds(&path, &self.binary, BINARY_MODE) {
            Ok(())
        } else {
            match files::write_atomic(&path, &self.binary, BINARY_MODE) {
                Ok(()) => {
                    self.count_write("binary", &path, self.binary_installed, since);
                    Ok(())
                }
                Err(source) => Err(Error::Write { path, source }.to_string()),
            }
        };
        self.binary_installed |= outcome.is_ok();
        self.set(Reason::Binary, outcome);
    }

    fn count_write(&self, what: &str, path: &Path, installed_before: bool, since: Option<Instant>) {
        if installed_before {
            self.metrics().repairs.with_label_values(&[what]).inc();
            if let Some(t) = since {
                self.metrics().repair_seconds.observe(t.elapsed().as_secs_f64());
            }
            tracing::info!(file = %path.display(), "repaired");
        } else {
            self.metrics().installs.with_label_values(&[what]).inc();
            tracing::info!(file = %path.display(), "installed");
        }
    }

    /// The chained conflist, regenerated from the current primary. Without a usable primary
    /// (or with an entry the plugin refuses) the chained copy is removed: runtimes then see
    /// exactly what the main CNI wrote, never a stale copy, and the node is not ready.
    pub fn reconcile_conflist(&mut self, since: Option<Instant>) {
        let own = self.conflist_path();
        let outcome = self.chain_once(&own, since);
        if let Err(e) = &outcome {
            if !matches!(e, Error::Write { .. }) {
                if let Err(source) = files::remove(&own) {
                    tracing::warn!("{}", Error::Remove { path: own.clone(), source });
                }
            }
        }
        self.conflist_installed |= outcome.is_ok();
        let reason = outcome.as_ref().err().map(Error::reason);
        for r in [Reason::Primary, Reason::Entry, Reason::Chain] {
            match (&outcome, reason) {
                (Err(e), Some(x)) if x == r => self.set(r, Err(e.to_string())),
                _ => self.set(r, Ok(())),
            }
        }
    }

    fn chain_once(&self, own: &Path, since: Option<Instant>) -> Result<(), Error> {
        let primary = chain::find_primary(&self.args.cni_conf_dir, &self.args.conflist_name)?;
        let (body, as_passed) = chain::chain(&primary, &self.entry)?;
        self.node
            .validate_entry(&as_passed)
            .map_err(|e| Error::EntryRefused { path: primary.path.clone(), why: refusal(&e) })?;
        if files::holds(own, &body, primary.mode) {
            return Ok(());
        }
        if !own.exists() {
            if let Some((renamed, why)) = chain::renamed_away(&self.args.cni_conf_dir, &self.args.conflist_name) {
                // Said, not a not-ready reason: chained again below, the node works until the
                // other CNI renames it once more (Cilium does so when its agent starts).
                let name = |p: &Path| p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                let what = format!("{} was renamed to {} by another CNI: {why}", name(own), name(&renamed));
                tracing::warn!("{what}; chaining again");
                self.metrics().record_error(Reason::Chain, &what);
            }
        }
        files::write_atomic(own, &body, primary.mode).map_err(|source| Error::Write { path: own.into(), source })?;
        self.count_write("conflist", own, self.conflist_installed, since);
        Ok(())
    }

    /// doctor's kernel checks, until they pass once (the kernel does not lose features).
    pub fn check_kernel(&mut self) {
        if self.kernel_ok {
            return;
        }
        let outcome = self.node.kernel_checks().map_err(|e| Error::Kernel(e.to_string()).to_string());
        self.kernel_ok = outcome.is_ok();
        self.set(Reason::Kernel, outcome);
    }

    /// Mirrors the status into the metrics and the state directory's marker: present (with
    /// every reason) while not ready, absent once ready.
    pub fn publish(&mut self) {
        let (text, ready) = {
            let status = self.shared.status.lock().unwrap();
            self.metrics().set_status(&status);
            let reasons: Vec<String> = status.not_ready.iter().map(|(r, w)| format!("{}: {w}", r.name())).collect();
            (format!("aether-cni installer: {}\n", reasons.join("; ")), reasons.is_empty())
        };
        let marker = self.args.state_dir.join(aether_node::state::NOT_READY_MARKER);
        let want = if ready { None } else { Some(text) };
        if want == self.marker_written && (want.is_some() == marker.exists()) {
            return;
        }
        let written = match &want {
            Some(t) => files::write_atomic(&marker, t.as_bytes(), 0o600),
            None => files::remove(&marker).map(|_| ()),
        };
        match written {
            Ok(()) => self.marker_written = want,
            Err(e) => tracing::warn!(file = %marker.display(), "cannot update the not-ready marker: {e}"),
        }
    }

    /// One full pass: binary first (the entry must never name a missing plugin), then the
    /// kernel checks and the conflist.
    pub fn reconcile_all(&mut self) {
        self.reconcile_binary(None);
        self.check_kernel();
        self.reconcile_conflist(None);
        self.set(Reason::Starting, Ok(()));
        self.publish();
    }

    /// Removes the entry, then the binary, after marking the node not ready; or, for an
    /// upgrade, leaves both for the next installer.
    pub fn uninstall(&mut self) -> Result<(), Error> {
        if self.args.upgrade || self.args.state_dir.join(UPGRADE_FILE).exists() {
            tracing::info!("stopping for an upgrade: the binary and the entry stay");
            return Ok(());
        }
        {
            let mut status = self.shared.status.lock().unwrap();
            status.not_ready.clear();
            status
                .not_ready
                .insert(Reason::Uninstalled, "the installer stopped and removed aether-cni from this node".into());
        }
        self.publish();
        for path in [self.conflist_path(), self.binary_path()] {
            files::remove_stale_temps(&path);
            match files::remove(&path) {
                Ok(true) => tracing::info!(file = %path.display(), "removed"),
                Ok(false) => {}
                Err(source) => return Err(Error::Remove { path, source }),
            }
        }
        Ok(())
    }

    /// Reconciles on every change and every resync period until `Stop`, then uninstalls.
    pub fn run(mut self, rx: Receiver<Msg>, watcher: Watcher) -> Result<(), Error> {
        self.reconcile_all();
        loop {
            let first = match rx.recv_timeout(self.args.resync()) {
                Ok(m) => m,
                Err(RecvTimeoutError::Timeout) => {
                    watcher.rewatch(&[&self.args.cni_conf_dir, &self.args.cni_bin_dir]);
                    self.reconcile_all();
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => break,
            };
            // Coalesce a burst (a rename is several events) into one pass, timed from its start.
            let (mut since, mut conf, mut bin, mut stop) = (None, false, false, false);
            let mut serving_ended = None;
            for m in std::iter::once(first).chain(rx.try_iter()) {
                match m {
                    Msg::Stop => stop = true,
                    Msg::ServingEnded(why) => serving_ended = Some(why),
                    Msg::Changed { name, at } => {
                        since = Some(since.map_or(at, |s: Instant| s.min(at)));
                        match name {
                            Some(n) if n == BINARY_NAME => bin = true,
                            Some(n) if n.to_string_lossy().contains(".aether-tmp.") => {}
                            Some(_) => conf = true,
                            None => (conf, bin) = (true, true),
                        }
                    }
                }
            }
            if let Some(why) = serving_ended {
                self.set(Reason::Http, Err(why.clone()));
                self.publish();
                return Err(Error::ServingEnded(why));
            }
            if stop {
                break;
            }
            if bin {
                self.reconcile_binary(since);
            }
            if conf {
                self.reconcile_conflist(since);
            }
            self.publish();
        }
        drop(watcher);
        self.uninstall()
    }
}

/// inotify on the conf and bin directories; each event becomes a `Msg::Changed`.
pub struct Watcher {
    watches: inotify::Watches,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

const WATCH_MASK: inotify::WatchMask = inotify::WatchMask::CREATE
    .union(inotify::WatchMask::CLOSE_WRITE)
    .union(inotify::WatchMask::MODIFY)
    .union(inotify::WatchMask::MOVED_TO)
    .union(inotify::WatchMask::MOVED_FROM)
    .union(inotify::WatchMask::DELETE)
    .union(inotify::WatchMask::ATTRIB)
    .union(inotify::WatchMask::DELETE_SELF)
    .union(inotify::WatchMask::MOVE_SELF);

impl Watcher {
    pub fn start(tx: Sender<Msg>, dirs: &[&Path]) -> Result<Watcher, Error> {
        let mut inotify = inotify::Inotify::init().map_err(Error::Watch)?;
        let watches = inotify.watches();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("installer-inotify".into())
            .spawn(move || {
                // poll with a timeout rather than a blocking read, so that stopping needs no
                // event to wake the thread (a read-only root has nowhere to make one).
                let fd = std::os::fd::AsRawFd::as_raw_fd(&inotify);
                let mut buf = [0u8; 8192];
                while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
                    let ready = unsafe { libc::poll(&mut pfd, 1, 200) };
                    if ready < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                        break;
                    }
                    if ready <= 0 {
                        continue;
                    }
                    let events = match inotify.read_events(&mut buf) {
                        Ok(events) => events,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                        Err(_) => break,
                    };
                    let at = Instant::now();
                    for e in events {
                        if tx.send(Msg::Changed { name: e.name.map(|n| n.to_os_string()), at }).is_err() {
                            return;
                        }
                    }
                }
            })
            .map_err(Error::Watch)?;
        let w = Watcher { watches, stop, thread: Some(thread) };
        w.rewatch(dirs);
        Ok(w)
    }

    /// (Re)adds the watches: a directory created or replaced after start is picked up.
    pub fn rewatch(&self, dirs: &[&Path]) {
        let mut watches = self.watches.clone();
        for d in dirs {
            let _ = watches.add(d, WATCH_MASK);
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A running installer: its HTTP face, watcher and reconcile loop.
pub struct Running {
    tx: Sender<Msg>,
    thread: std::thread::JoinHandle<Result<(), Error>>,
    server: serve::Server,
    pub shared: Arc<Shared>,
    /// The reconciler's thread, when `run` started one.
    reconciler: Option<reconcile::looper::Looper>,
    serving_end: Arc<std::sync::Mutex<ServingEnd>>,
}

/// Whether the HTTP face still serves, and whom to wake when it stops.
enum ServingEnd {
    Running { wake: Option<Box<dyn FnOnce() + Send>> },
    Ended,
}

impl Running {
    pub fn addr(&self) -> SocketAddr {
        self.server.addr
    }

    /// The Service layer's socket, if it is served.
    pub fn services_socket(&self) -> Option<&Path> {
        self.server.services_socket()
    }

    /// The metrics-only listener's address, if there is one.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.server.metrics_addr
    }

    /// Calls `wake` once serving has ended (at once if it already has): the caller then
    /// `stop`s, which returns `Error::ServingEnded`.
    pub fn when_serving_ends(&self, wake: impl FnOnce() + Send + 'static) {
        let mut end = self.serving_end.lock().unwrap();
        match &mut *end {
            ServingEnd::Running { wake: slot } => *slot = Some(Box::new(wake)),
            ServingEnd::Ended => wake(),
        }
    }

    /// Stops the loop (uninstalling unless an upgrade) and returns its outcome.
    pub fn stop(self) -> Result<(), Error> {
        // The reconciler first: no pass may act while the node is uninstalled.
        if let Some(r) = self.reconciler {
            r.stop();
        }
        let _ = self.tx.send(Msg::Stop);
        let out = self.thread.join().expect("the installer loop does not panic");
        drop(self.server);
        out
    }
}

/// Checks the directories, binds the HTTP address and starts watching, then reconciles on
/// a thread of its own. Any error here comes before anything is installed.
pub fn start(args: InstallArgs, node: impl NodeChecks + 'static, binary: Vec<u8>) -> Result<Running, Error> {
    let plugin: Arc<dyn NodeChecks> = Arc::new(node);
    let shared = Arc::new(Shared::new());
    let node = Node::new(args.clone(), plugin.clone(), shared.clone(), binary);
    node.preflight()?;
    let (tx, rx) = mpsc::channel();
    let serving_end = Arc::new(std::sync::Mutex::new(ServingEnd::Running { wake: None }));
    let on_end: serve::OnEnd = {
        let (tx, serving_end) = (tx.clone(), serving_end.clone());
        Box::new(move |why| {
            let _ = tx.send(Msg::ServingEnded(why));
            let end = std::mem::replace(&mut *serving_end.lock().unwrap(), ServingEnd::Ended);
            if let ServingEnd::Running { wake: Some(wake) } = end {
                wake();
            }
        })
    };
    let server = serve::start(&args.http(), shared.clone(), plugin, on_end)?;
    let watcher = Watcher::start(tx.clone(), &[&args.cni_conf_dir, &args.cni_bin_dir])?;
    let thread = std::thread::Builder::new()
        .name("installer".into())
        .spawn(move || node.run(rx, watcher))
        .map_err(Error::Watch)?;
    Ok(Running { tx, thread, server, shared, serving_end, reconciler: None })
}

/// `--print-entry`: the entry as the plugin will receive it, chained onto a stand-in list
/// (the same code path as a node's primary), checked by the plugin's parser.
pub fn entry_for_display(args: &InstallArgs, node: &dyn NodeChecks) -> Result<String, Error> {
    let stand_in = chain::Primary {
        path: PathBuf::from("(--print-entry)"),
        bytes: br#"{"cniVersion":"1.1.0","name":"print-entry","plugins":[{"type":"main-cni"}]}"#.to_vec(),
        mode: 0o644,
    };
    let (_, as_passed) = chain::chain(&stand_in, &args.entry())?;
    node.validate_entry(&as_passed)
        .map_err(|e| Error::EntryRefused { path: stand_in.path.clone(), why: refusal(&e) })?;
    let v: Value = serde_json::from_slice(&as_passed).expect("chain returns JSON");
    Ok(serde_json::to_string_pretty(&v).expect("JSON values serialize"))
}

/// `aether-cni install`: runs until SIGTERM or SIGINT, then uninstalls (or keeps the files
/// for an upgrade). The binary installed is this process's own executable.
pub fn run(args: InstallArgs) -> Result<(), Error> {
    // A long-running service: a peer that hangs up (the CRI socket, an HTTP client of
    // /metrics) is an error on that connection, never the end of the process. (The binary's
    // CLI restores SIGPIPE's default for the commands that print.)
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    let node = LiveNode::new(&args.state_dir);
    if args.print_entry {
        println!("{}", entry_for_display(&args, &node)?);
        return Ok(());
    }
    let self_exe = PathBuf::from("/proc/self/exe");
    let binary = fs::read(&self_exe).map_err(|source| Error::ReadSelf { path: self_exe, source })?;
    let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT])
        .map_err(Error::Signals)?;
    let mut running = start(args.clone(), node, binary)?;
    // The address ends the line: tests and operators read it from there.
    tracing::info!(
        "serving /healthz, /readyz, /metrics (at most {} connections per listener) on {}",
        running.server.connection_limit,
        running.addr()
    );
    if let Some(addr) = running.metrics_addr() {
        tracing::info!("serving /metrics on {addr}");
    }
    if let Some(path) = running.services_socket() {
        tracing::info!("serving POST {} on {}", services_socket::APPLY_PATH, path.display());
    }
    // The signal iterator ends without a signal when serving ends: `stop` then says why.
    let signals_handle = signals.handle();
    running.when_serving_ends(move || signals_handle.close());
    let ops = reconcile::node_lib::NodeLib::new(&args);
    running.reconciler = reconcile::start(&args, running.shared.clone(), ops).map_err(Error::Reconciler)?;
    if let Some(sig) = signals.forever().next() {
        tracing::info!(signal = sig, "stopping");
    }
    running.stop()
}
