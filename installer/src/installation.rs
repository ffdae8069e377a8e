//! One node's installation: the plugin binary and the chained conflist written, kept in
//! place on every change and resync, the node's readiness published, and all of it undone on
//! stop (unless an upgrade).

use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Instant;

use serde_json::{Map, Value};

use aether_node::state::StateDir;

use crate::checks::{refusal, NodeChecks};
use crate::error::Reason;
use crate::serve::{Metrics, Shared, Status};
use crate::watch::Watcher;
use crate::{chain, files, Error, InstallArgs};

/// The plugin's file name in the CNI bin directory: runtimes find a plugin by its `type`.
pub const BINARY_NAME: &str = chain::PLUGIN_TYPE;
/// While this file exists in the state directory, stopping keeps the binary and the entry.
pub const UPGRADE_FILE: &str = "installer-upgrade";
/// Mode of the installed binary.
const BINARY_MODE: u32 = 0o755;

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
    /// The status as this pass finds it, reason by reason; what `/readyz` serves
    /// (`Shared::status`) becomes it only at `publish`, after the marker.
    status: Status,
    marker_written: Option<String>,
    /// The readiness last told to the cluster as an Event: `Some(None)` ready, `Some(Some(why))`
    /// not ready for these reasons.
    readiness_told: Option<Option<String>>,
    /// The installer's async runtime, for the CRI calls of an uninstall (none in tests).
    runtime: Option<std::sync::Arc<tokio::runtime::Runtime>>,
    /// Why the netns directory does not show pods' netns made after the start (checked once,
    /// at start: a mount's propagation does not change under a running container).
    netns_blind: Option<String>,
}

impl Node {
    pub fn new(args: InstallArgs, node: Arc<dyn NodeChecks>, shared: Arc<Shared>, binary: Vec<u8>) -> Node {
        let entry = args.entry();
        let status = shared.status.lock().unwrap().clone();
        Node {
            args,
            entry,
            node,
            shared,
            binary,
            binary_installed: false,
            conflist_installed: false,
            kernel_ok: false,
            status,
            marker_written: None,
            readiness_told: None,
            runtime: None,
            netns_blind: None,
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
        // Installed again: the binary is this installer's to keep, no longer the last DEL's
        // to remove.
        StateDir::new(&self.args.state_dir).clear_uninstalled()?;
        Ok(())
    }

    fn set(&mut self, reason: Reason, outcome: Result<(), String>) {
        match outcome {
            Ok(()) => {
                self.status.not_ready.remove(&reason);
            }
            Err(why) => {
                if self.status.not_ready.get(&reason) != Some(&why) {
                    tracing::warn!(reason = reason.name(), "not ready: {why}");
                    self.metrics().record_error(reason, &why);
                }
                self.status.not_ready.insert(reason, why);
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

    /// Publishes the status, in this order: the state directory's marker (present, with
    /// every reason, while not ready; absent once ready), which CNI STATUS reads; then what
    /// `/readyz`, the metrics and the reconciler see; then the readiness Event. A node turning
    /// not ready is so for STATUS first (fail closed), and `/readyz` never says other than
    /// the marker but for a marker that cannot be written (warned).
    pub fn publish(&mut self) {
        let reasons: Vec<String> = self.status.not_ready.iter().map(|(r, w)| format!("{}: {w}", r.name())).collect();
        let (text, ready) = (format!("aether-cni installer: {}\n", reasons.join("; ")), reasons.is_empty());
        let marker = self.args.state_dir.join(aether_node::state::NOT_READY_MARKER);
        let want = if ready { None } else { Some(text.clone()) };
        if want != self.marker_written || (want.is_some() != marker.exists()) {
            let written = match &want {
                Some(t) => files::write_atomic(&marker, t.as_bytes(), 0o600),
                None => files::remove(&marker).map(|_| ()),
            };
            match written {
                Ok(()) => self.marker_written = want,
                Err(e) => tracing::warn!(file = %marker.display(), "cannot update the not-ready marker: {e}"),
            }
        }
        {
            let mut published = self.shared.status.lock().unwrap();
            *published = self.status.clone();
            self.metrics().set_status(&published);
        }
        self.tell_readiness(if ready { None } else { Some(text.trim_end().to_string()) });
    }

    /// A Node Event when the readiness (or a not-ready reason) changes.
    fn tell_readiness(&mut self, now: Option<String>) {
        if self.readiness_told.as_ref() == Some(&now) {
            return;
        }
        self.shared.events.emit(match &now {
            None => crate::events::NodeEvent::NodeReady,
            Some(why) => crate::events::NodeEvent::NodeNotReady { why: why.clone() },
        });
        self.readiness_told = Some(now);
    }

    /// The netns directory does not show new pods' netns (why): the node stays not ready for
    /// as long as this installer runs. Fail closed, but not by refusing to start: the binary
    /// and the chained entry are still written, so every pod the runtime starts is captured by
    /// ADD (which runs on the host, whatever this container sees); what is lost is the
    /// reconciler's view of those pods, and a node whose repairs cannot reach its new pods is
    /// not one to report ready (docs/operating.md).
    pub fn set_netns_blind(&mut self, why: Option<String>) {
        self.netns_blind = why;
    }

    /// One full pass: binary first (the entry must never name a missing plugin), then the
    /// kernel checks and the conflist.
    pub fn reconcile_all(&mut self) {
        self.reconcile_binary(None);
        self.check_kernel();
        self.reconcile_conflist(None);
        self.set(Reason::Netns, self.netns_blind.clone().map_or(Ok(()), Err));
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
        self.status.not_ready.clear();
        self.status
            .not_ready
            .insert(Reason::Uninstalled, "the installer stopped and removed aether-cni from this node".into());
        self.publish();
        let remove = |path: PathBuf| {
            files::remove_stale_temps(&path);
            match files::remove(&path) {
                Ok(true) => tracing::info!(file = %path.display(), "removed"),
                Ok(false) => {}
                Err(source) => return Err(Error::Remove { path, source }),
            }
            Ok(())
        };
        // The conflist first: no new pod is chained to the plugin from now on.
        remove(self.conflist_path())?;
        // The binary only once no pod needs it: every attached pod's DEL runs it (the runtime
        // tears a pod down with the chain it holds), and an ADD the runtime started with the
        // chain it held until it reloaded may still run (state::uninstall).
        let binary = self.binary_path();
        let state = StateDir::new(&self.args.state_dir);
        if state.attachment_count() == 0 {
            std::thread::sleep(aether_node::state::RELOAD_GRACE);
        }
        // Counted and said under the exclusive lock: a DEL that removes the last record after
        // this finds the word and removes the binary, one before it is counted.
        let _lock = state.lock(true).map_err(aether_node::state::UninstallError::from)?;
        let pods = state.attachment_count();
        if pods == 0 || !binary.exists() {
            return remove(binary);
        }
        state.mark_uninstalled(&binary)?;
        drop(_lock);
        let finish = crate::uninstall::Finish {
            cri_socket: self.args.cri_socket(),
            cri_timeout: self.args.cri_timeout(),
            wait: self.args.uninstall_wait(),
            state_dir: self.args.state_dir.clone(),
            binary: binary.clone(),
            files: self.args.node_files(),
        };
        tracing::info!(
            binary = %binary.display(),
            "the plugin binary stays while {pods} pods attached on this node may still be torn down: on a runtime \
             whose teardowns still run aether-cni, the DEL that removes the last of their records removes it; \
             containerd (1.6 to 2.x) tears pods down after its reload without aether-cni and never runs CNI GC, so \
             for up to {:?} this installer asks the runtime (--cri-socket) which CNI chain it holds and which pods \
             are gone, and removes what no teardown needs any more; what stays then is said when the wait ends \
             (docs/operating.md, \"Uninstall with pods running\")",
            finish.wait
        );
        match &self.runtime {
            Some(rt) if !finish.wait.is_zero() => {
                let outcome = crate::uninstall::finish(&finish, rt);
                crate::uninstall::say(&outcome, &finish);
            }
            _ => crate::uninstall::say(
                &crate::uninstall::Outcome::Left {
                    runtime: crate::uninstall::RuntimeChain::Unknown(
                        "--uninstall-wait-seconds=0: the runtime is not asked".into(),
                    ),
                    binary_removed: false,
                    records: state.scan().records.iter().map(|r| r.key()).collect(),
                    collected: 0,
                },
                &finish,
            ),
        }
        Ok(())
    }

    /// The async runtime the uninstall asks the CRI through (the installer's one).
    pub fn set_runtime(&mut self, rt: std::sync::Arc<tokio::runtime::Runtime>) {
        self.runtime = Some(rt);
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
