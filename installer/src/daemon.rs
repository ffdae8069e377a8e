//! The installer as a whole: starts the HTTP face, the watcher and the installation's loop
//! (and, in `run`, the reconciler), and stops them in order.

use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Sender};
use std::sync::Arc;

use serde_json::Value;

use crate::checks::{refusal, LiveNode, NodeChecks};
use crate::installation::{Msg, Node};
use crate::serve::Shared;
use crate::watch::Watcher;
use crate::{chain, netns_mount, reconcile, runtime, serve, services_socket, Error, InstallArgs};

/// A running installer: its HTTP face, watcher and reconcile loop.
pub struct Running {
    tx: Sender<Msg>,
    thread: std::thread::JoinHandle<Result<(), Error>>,
    server: serve::Server,
    pub shared: Arc<Shared>,
    /// The reconciler's thread, when `run` started one.
    reconciler: Option<reconcile::looper::Looper>,
    /// The netns directory, when it does not show pods' netns made after the start.
    pub netns_blind: Option<netns_mount::Blind>,
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
    let mut node = Node::new(args.clone(), plugin.clone(), shared.clone(), binary);
    node.preflight()?;
    let netns_blind = args.netns_dir().and_then(|dir| match netns_mount::check(&dir) {
        Ok(()) => {
            tracing::info!(dir = %dir.display(), "the netns directory receives the host's mounts: new pods' netns show up here");
            None
        }
        Err(e) => {
            tracing::error!("{e}");
            Some(netns_mount::Blind::new(&dir, &e))
        }
    });
    node.set_netns_blind(netns_blind.as_ref().map(|b| b.why.clone()));
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
    let rt = runtime::new().map_err(|e| Error::Listen { addr: args.listen, why: e.to_string() })?;
    // Events before the first pass, which tells the node's readiness; never an error here:
    // the installer does its work without them.
    match args.events() {
        Ok(Some(settings)) => shared.events.start(settings, &rt),
        Ok(None) => {}
        Err(e) => tracing::warn!("Kubernetes Events are off: {e}"),
    }
    node.set_runtime(rt.clone());
    let server = serve::start(&args.http(), shared.clone(), plugin, on_end, rt)?;
    let changes = tx.clone();
    let on_change = move |name, at| changes.send(Msg::Changed { name, at }).is_ok();
    let watcher = Watcher::start(on_change, &[&args.cni_conf_dir, &args.cni_bin_dir])?;
    let thread = std::thread::Builder::new()
        .name("installer".into())
        .spawn(move || node.run(rx, watcher))
        .map_err(Error::Watch)?;
    Ok(Running { tx, thread, server, shared, serving_end, reconciler: None, netns_blind })
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

/// `aether-cni-installer`: runs until SIGTERM or SIGINT, then uninstalls (or keeps the files
/// for an upgrade). The binary installed is the plugin's (`--plugin-binary`, by default the
/// `aether-cni` beside this executable).
pub fn run(args: InstallArgs) -> Result<(), Error> {
    // A long-running service: a peer that hangs up (the CRI socket, an HTTP client of
    // /metrics) is an error on that connection, never the end of the process. (The binary's
    // CLI restores SIGPIPE's default for the commands that print.)
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    let node = LiveNode::new(&args.state_dir);
    if args.print_event_examples {
        println!("{}", crate::events::examples_json(args.node_name.trim()));
        return Ok(());
    }
    if args.print_entry {
        println!("{}", entry_for_display(&args, &node)?);
        return Ok(());
    }
    let plugin = args.plugin_binary().map_err(|source| Error::ReadPlugin { path: "/proc/self/exe".into(), source })?;
    let binary = fs::read(&plugin).map_err(|source| Error::ReadPlugin { path: plugin, source })?;
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
    let rt = running.server.runtime();
    let ops = reconcile::node_lib::NodeLib::new(args.node_files()).blind_to(running.netns_blind.clone());
    running.reconciler =
        reconcile::looper::start(args.reconciler(), running.shared.clone(), ops, rt).map_err(Error::Reconciler)?;
    if let Some(sig) = signals.forever().next() {
        tracing::info!(signal = sig, "stopping");
    }
    running.stop()
}
