//! A pod's attachment: the capture ADD programs in the pod's netns, its record, and its Service
//! layer, as operations over (configuration, pod, netns) that know nothing of how they
//! were asked for (a CNI command, or the installer's reconciler):
//!
//! - [`attach`]: program the capture, write the record, apply the stored Service layer; all
//!   or nothing (a pod with rules but no record would escape GC and CHECK);
//! - [`attach_in_place`]: the same in a running pod (the reconciler's `capture` policy), the
//!   TCP connections conntrack already tracks there marked first, so that they stay uncaptured;
//! - [`detach`]: remove exactly what the record says, fold the pod's counts, forget the record
//!   last (a detach killed at any point leaves the record, so a retry finishes the job);
//! - [`verify`]: every difference between the kernel, the record and the expected capture;
//! - [`collect`]: detach every recorded attachment of a network the runtime no longer has, and
//!   clear what is provably stale.
//!
//! Callers hold nothing: each operation takes the state lock it needs (shared for attach and
//! detach, exclusive for collect).

use aether_netns::Netns;
use aether_rules::capture::{self, CaptureConfig, RulesetVersion};
use tracing::{debug, info, warn};

use crate::config::NetConf;
use crate::services::{self, fold::RetireError, ServicesError};
use crate::state::{NetnsIdentity, PodIdentity, PodNetns, Record, Recorded, StateDir, StateError};

/// Which attachment: the network (the configuration's `name`), the container, the interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target<'a> {
    pub network: &'a str,
    pub container_id: &'a str,
    pub ifname: &'a str,
}

impl Target<'_> {
    /// The attachment's key, as people (and the fold marks) read it.
    pub fn key(&self) -> String {
        format!("{}/{}/{}", self.network, self.container_id, self.ifname)
    }
}

/// Why an attachment operation did not complete.
#[derive(Debug, thiserror::Error)]
pub enum AttachmentError {
    /// The pod's netns (at the path given) cannot be opened or entered.
    #[error(transparent)]
    Netns(aether_netns::Error),
    /// The netns a record names cannot be opened for another reason than being gone.
    #[error("cannot open the netns {netns} recorded for {key}")]
    RecordedNetns { netns: String, key: String, source: aether_netns::Error },
    /// The capture configuration cannot make a ruleset, or the kernel refused it.
    #[error(transparent)]
    Rules(aether_rules::Error),
    #[error(transparent)]
    State(StateError),
    /// The stored Service layer could not be applied to the pod.
    #[error("cannot apply the Service layer")]
    ServiceLayer(ServicesError),
    /// A test asked for this step to fail (fault-injection builds only).
    #[error("injected failure at step {0}")]
    Injected(String),
    /// An in-place capture into a netns another attachment record owns (a runtime naming
    /// another pod's netns for this sandbox): refused, as DEL leaves another's netns alone.
    #[error("the netns {netns} is {owner}'s (its attachment record owns it): not captured for {key}")]
    NetnsOwned { netns: String, owner: String, key: String },
    /// `collect` could not remove some stale items; each is named, and kept.
    #[error("GC could not remove {} stale item(s)", .0.len())]
    Collect(Vec<Kept>),
}

/// A stale item `collect` could not remove: an attachment's key or a file's name, and why.
#[derive(Debug)]
pub struct Kept {
    pub item: String,
    pub error: AttachmentError,
}

impl From<aether_netns::Error> for AttachmentError {
    fn from(e: aether_netns::Error) -> Self {
        AttachmentError::Netns(e)
    }
}

impl From<aether_rules::Error> for AttachmentError {
    fn from(e: aether_rules::Error) -> Self {
        AttachmentError::Rules(e)
    }
}

impl From<StateError> for AttachmentError {
    fn from(e: StateError) -> Self {
        AttachmentError::State(e)
    }
}

/// The step of ADD a test asked to fail (`AETHER_CNI_INJECT_FAILURE`): one of the rules
/// crate's steps, or `record`, or `services`, or `panic` (a panic in the pod's netns; DEL's
/// steps: `state::fails_here`). Compiled in only with `fault-injection`.
#[cfg(feature = "fault-injection")]
fn injected_failure() -> Option<String> {
    std::env::var("AETHER_CNI_INJECT_FAILURE").ok()
}

#[cfg(not(feature = "fault-injection"))]
fn injected_failure() -> Option<String> {
    None
}

/// How long a test asked a layer built after the answer to wait before it starts
/// (`AETHER_CNI_INJECT_LAYER_DELAY_MS`): what a reader meanwhile sees. With `fault-injection`.
#[cfg(feature = "fault-injection")]
fn injected_layer_delay() -> Option<std::time::Duration> {
    let ms = std::env::var("AETHER_CNI_INJECT_LAYER_DELAY_MS").ok()?.parse().ok()?;
    Some(std::time::Duration::from_millis(ms))
}

#[cfg(not(feature = "fault-injection"))]
fn injected_layer_delay() -> Option<std::time::Duration> {
    None
}

/// What [`attach`] did.
#[derive(Debug)]
pub struct Attached {
    /// The Service snapshot generation the pod was given; `None` before any snapshot, or
    /// while its layer is still to be built (`layer_after_answer`).
    pub services_generation: Option<u64>,
    /// The pod's Service layer when it is large enough to be built after ADD's answer
    /// ([`services::built_after_answer`]): the caller answers the runtime, then builds it.
    pub layer_after_answer: Option<LayerToBuild>,
}

/// A recorded pod's Service layer, to be built after ADD has answered the runtime: the
/// kernel's insertion of 10,000 Services' elements is most of an ADD's time, and nothing in
/// the sandbox the runtime is starting connects anywhere before its containers start. It
/// holds what ADD held (the state lock, shared, and the pod's netns lock), so whoever
/// looks at the pod next (a DEL, an apply's visit, a repair, the reconciler, `inspect`)
/// waits until the layer is whole. The locks are its open files' (`flock`): a child process
/// that inherits them holds them after the process that took them is gone.
#[derive(Debug)]
pub struct LayerToBuild {
    state_dir: std::path::PathBuf,
    key: String,
    divert_mark: u32,
    netns: Netns,
    _pod: aether_netns::NetnsLock,
    _state: crate::state::Lock,
}

impl LayerToBuild {
    /// Builds the layer, as ADD does for a smaller one (`end_stale_fold`, then the stored
    /// layer applied), and lets go of the locks. A failure leaves the pod captured without
    /// the layer, as a damaged stored layer does: the agent's next apply or the reconciler's
    /// next look builds it. Returns the generation built.
    pub fn build(self) -> Result<Option<u64>, ServicesError> {
        // One of the node's build slots (after the pod's lock, which this holds already): the
        // builds after a storm of ADDs take turns, and a CPU stays for the pods' starts.
        let _slot = crate::state::BuildSlot::take(&self.state_dir);
        crate::state::pause_point("layer-build-slot");
        if let Some(delay) = injected_layer_delay() {
            std::thread::sleep(delay);
        }
        services::end_stale_fold(&self.state_dir, &self.netns, &self.key)?;
        services::apply_current_snapshot_in_netns(&self.state_dir, &self.netns, self.divert_mark)
    }
}

/// ADD's work: programs `cfg`'s capture in the netns at `netns_path`, records it, and applies
/// the stored Service layer (or, when that is large, hands it back to be built after the
/// answer, `Attached::layer_after_answer`). On any failure everything done is undone.
pub fn attach(
    conf: &NetConf,
    target: Target,
    pod: &PodIdentity,
    netns_path: &str,
    cfg: &CaptureConfig,
) -> Result<Attached, AttachmentError> {
    let ruleset = capture::capture_ruleset(cfg)?;
    let netns = Netns::open_foreign(netns_path)?;
    let state = StateDir::new(&conf.state_dir);
    let _lock = state.lock(false)?;
    // This pod's alone (an apply's or a repair's visit of it waits, and nothing else): the
    // record and the layer are whole before anyone looks at the pod.
    let _pod = netns.lock()?;
    let fail = injected_failure();
    let fail_step = fail.as_deref().and_then(|s| s.parse::<aether_rules::Step>().ok());
    // The record's netns cookie is read on this visit: asking `netns` for it would enter the
    // pod's netns a second time.
    let cookie = netns.run(|| {
        // A test's panic in the pod's netns: the plugin still answers with a CNI error.
        if fail.as_deref() == Some("panic") {
            panic!("injected panic inside the pod's network namespace");
        }
        aether_rules::install(&ruleset, fail_step).map(|()| aether_netns::current_cookie().ok())
    })??;
    let netns_id = NetnsIdentity::with_cookie(&netns, cookie);
    let record =
        Record::new(target.network, target.container_id, target.ifname, netns_id, netns_path, pod, cfg.clone());
    let recorded = if fail.as_deref() == Some("record") {
        Err(AttachmentError::Injected("record".into()))
    } else {
        state.write(&record).map_err(AttachmentError::from)
    };
    if recorded.is_ok() {
        // An uninstall that removed the binary while this ADD waited for the lock would leave
        // the pod without the plugin its DEL runs: put back (state::uninstall).
        match crate::state::keep_binary_for_attachment(&state) {
            Ok(Some(path)) => warn!(binary = %path.display(), "the plugin binary was removed by an uninstall during this ADD: put back for the pod's DEL"),
            Ok(None) => {}
            Err(e) => warn!("the plugin binary was removed by an uninstall during this ADD and cannot be put back; this pod's DEL will fail: {e}"),
        }
    }
    // The Service layer comes after the record: an apply either lists the record (and visits
    // the pod after this, under its netns lock) or stored its layer before it is read here.
    // (A test's injected failure is ADD's own to report: never after the answer.)
    if recorded.is_ok() && fail.is_none() && services::built_after_answer(&conf.state_dir) {
        info!(mode = %cfg.mode, "capture programmed; the Service layer is built after the answer");
        let layer = LayerToBuild {
            state_dir: conf.state_dir.clone(),
            key: target.key(),
            divert_mark: cfg.divert_mark,
            netns,
            _pod,
            _state: _lock,
        };
        return Ok(Attached { services_generation: None, layer_after_answer: Some(layer) });
    }
    let layered = recorded.and_then(|()| {
        if fail.as_deref() == Some("services") {
            return Err(AttachmentError::Injected("services".into()));
        }
        services::end_stale_fold(&conf.state_dir, &netns, &target.key()).map_err(AttachmentError::ServiceLayer)?;
        services::apply_current_snapshot_in_netns(&conf.state_dir, &netns, cfg.divert_mark)
            .map_err(AttachmentError::ServiceLayer)
    });
    let generation = match layered {
        Ok(generation) => generation,
        Err(e) => {
            let prs = ruleset.policy_routes();
            let undo = netns.run(|| {
                aether_rules::services::remove()?;
                aether_rules::remove(capture::TABLE, &prs)
            });
            match undo {
                Ok(Ok(_)) => {}
                Ok(Err(undo)) => warn!("undoing after a failure also failed: {undo}"),
                Err(undo) => warn!("undoing after a failure also failed: {undo}"),
            }
            if let Err(undo) = state.remove(target.network, target.container_id, target.ifname) {
                warn!("removing the record after a failure also failed: {undo}");
            }
            return Err(e);
        }
    };
    info!(mode = %cfg.mode, services_generation = %generation.map_or("none".to_string(), |g| g.to_string()), "capture programmed");
    for table in ruleset.tables() {
        debug!("ruleset: {table}");
    }
    Ok(Attached { services_generation: generation, layer_after_answer: None })
}

/// The reconciler's capture of a running pod (`capture` policy): ADD's work, after the TCP
/// connections conntrack already tracks in the netns are marked as established before the
/// capture, so that it never diverts them (a pod whose conntrack was off has none: the
/// ruleset marks its connections when it first sees them). Only in a netns that holds no
/// capture yet: a connection opened under a capture stays captured. Marking is best effort:
/// when it fails, the pod is captured all the same (a missed pod is the larger harm) and the
/// failure is logged.
pub fn attach_in_place(
    conf: &NetConf,
    target: Target,
    pod: &PodIdentity,
    netns_path: &str,
    cfg: &CaptureConfig,
) -> Result<Attached, AttachmentError> {
    let netns = Netns::open_foreign(netns_path)?;
    // The same check DEL makes: a namespace another record owns is that pod's, whatever
    // path names it (a runtime that lies, or two sandboxes given one netns).
    let key = target.key();
    let owner = StateDir::new(&conf.state_dir).records().into_iter().find(|o| {
        o.key() != key
            && (o.netns_id.is_some_and(|i| i.matches(&netns)) || (o.netns_id.is_none() && o.netns == netns_path))
    });
    if let Some(owner) = owner {
        return Err(AttachmentError::NetnsOwned { netns: netns_path.into(), owner: owner.key(), key });
    }
    let marked = netns.run(|| -> aether_rules::Result<Option<usize>> {
        for family in aether_rules::Family::ALL {
            if aether_rules::nft::table_exists(family, capture::TABLE)? {
                return Ok(None);
            }
        }
        if crate::state::fails_here("mark-connections") {
            return Err(aether_rules::Error::Conntrack {
                op: "mark",
                source: std::io::Error::other("injected failure at step mark-connections"),
            });
        }
        aether_rules::conntrack::mark_tcp_flows(capture::PREEXISTING_CT_MARK).map(Some)
    })?;
    match marked {
        Ok(Some(0)) | Ok(None) => {}
        Ok(Some(n)) => info!(connections = n, "TCP connections conntrack tracked before the capture marked uncaptured"),
        Err(e) => warn!("connections open before the capture are not marked, and will be reset: {e}"),
    }
    attach(conf, target, pod, netns_path, cfg)
}

/// DEL's work: undoes the attachment `target`, in the netns at `netns_path` when given (the
/// runtime's), else in the one its record names. A namespace at the path that is not the one
/// ADD programmed (a reused path or PID) is another pod's and left alone. A damaged record
/// is removed: DEL forgets the attachment whatever its record says. What was removed is out
/// of the kernel's ruleset on return; the sockets that removed it are returned open, since
/// closing them waits for the kernel to free it (see [`undo`]).
pub fn detach(
    conf: &NetConf,
    target: Target,
    netns_path: Option<&str>,
) -> Result<aether_rules::nft::OpenSockets, AttachmentError> {
    let Target { network, container_id: id, ifname } = target;
    let state = StateDir::new(&conf.state_dir);
    let _lock = state.lock(false)?;
    let record = state.read(network, id, ifname).unwrap_or_else(|u| {
        warn!(file = %u.file, why = %u.why, "the attachment record cannot be read; removing it");
        None
    });
    let netns = match (netns_path, &record) {
        // Without CNI_NETNS, the record still knows where the pod lived.
        (None, Some(r)) => live(r.open_netns().map_err(|e| record_netns_error(r, e))?, id),
        (None, None) => None,
        (Some(path), _) => match Netns::open_foreign(path) {
            Err(aether_netns::Error::NotFound { .. }) => {
                info!(netns = %path, "netns is already gone; nothing to remove there");
                None
            }
            Err(e) => return Err(e.into()),
            // The namespace at CNI_NETNS must be the one ADD programmed: a path (or PID) reused
            // by another pod is that pod's, and is left alone.
            Ok(ns) => match &record {
                Some(r) if !r.owns(&ns) => {
                    info!(netns = %path, found = %ns.id(), "another namespace than ADD programmed is at the path; left alone");
                    None
                }
                Some(_) => Some(ns),
                None => match state.records().into_iter().find(|o| o.netns_id.is_some_and(|i| i.matches(&ns))) {
                    Some(owner) => {
                        info!(netns = %path, owner = %owner.key(), "no record, and the namespace is another attachment's; left alone");
                        None
                    }
                    None => Some(ns),
                },
            },
        },
    };
    undo(netns, conf, record.as_ref(), &target.key(), || state.remove(network, id, ifname))
}

/// The pod's netns if it is still there, logging why not.
fn live(found: PodNetns, id: &str) -> Option<Netns> {
    match found {
        PodNetns::Live(ns) => Some(ns),
        PodNetns::Gone(why) => {
            info!(attachment = %id, why = %why, "the pod's netns is gone; nothing to remove there");
            None
        }
    }
}

/// A recorded netns that cannot be opened for another reason than being gone. It names the
/// record, not `CNI_NETNS` (which the runtime may not have set).
fn record_netns_error(r: &Record, source: aether_netns::Error) -> AttachmentError {
    AttachmentError::RecordedNetns { netns: r.netns.clone(), key: r.key(), source }
}

/// Undoes an attachment: the capture in `netns` (the pod's, or `None` when it is gone),
/// then, under the services lock, the pod's Service layer (its counts folded into the node
/// totals first) and its record, last: a DEL killed at any point leaves the record, so a
/// retried DEL (or GC) finishes the job.
fn undo(
    netns: Option<Netns>,
    conf: &NetConf,
    record: Option<&Record>,
    key: &str,
    forget: impl FnOnce() -> Result<(), StateError>,
) -> Result<aether_rules::nft::OpenSockets, AttachmentError> {
    // Every netfilter socket of the DEL kept open to its end and returned, the pod's lock let
    // go: closing one waits for the kernel's destruction of what was deleted (an RCU grace
    // period, then the layer's elements freed), once for both tables instead of once each,
    // holding no lock, and by whoever closes them last (after a DEL's answer, its child).
    let later = aether_rules::nft::CloseLater::new();
    // The pod's alone, until its record is gone: an apply never re-creates its layer.
    let pod_lock = netns.as_ref().map(Netns::lock).transpose()?;
    let removed = match &netns {
        Some(netns) => {
            // The policy routes ADD installed are in the record (one per family); without one
            // (a record lost, or an ADD that failed before writing it) the node's settings
            // name them, in both families.
            let policy_routes = record.and_then(|r| r.capture.as_ref()).map_or_else(
                || aether_rules::Family::ALL.map(|f| conf.base.policy_route(f)).to_vec(),
                |c| c.policy_routes(),
            );
            Some(netns.run(|| aether_rules::remove(capture::TABLE, &policy_routes))??)
        }
        None => None,
    };
    let retired = services::retire_layer(&conf.state_dir, netns.as_ref(), key, forget).map_err(|e| match e {
        RetireError::Forget(e) => AttachmentError::State(e),
        RetireError::Injected(step) => AttachmentError::Injected(step.into()),
    })?;
    let container = key.split('/').nth(1).unwrap_or(key);
    for w in &retired.warnings {
        warn!(container = %container, "{w}");
    }
    if let (Some(netns), Some(removed)) = (&netns, removed) {
        info!(
            container = %container,
            netns = %netns.path().display(),
            table = removed.table,
            rule = removed.rule,
            route = removed.route,
            services_folded = %crate::text::counts(&retired.folded),
            "capture removed"
        );
    }
    drop(pod_lock);
    Ok(later.into_open())
}

/// CHECK's work: every way the attachment `target` in `netns` differs from `expected` (the
/// pod's capture now, `None` for a pod that is not managed): the kernel's ruleset, the
/// record, the namespace identity. Empty when intact. The ruleset is compared with the shape
/// the record says ADD programmed: a pod an earlier release attached, holding exactly that
/// release's ruleset, is intact (its migration to the current shape is the reconciler's,
/// [`Record::ruleset`] says it is pending).
pub fn verify(
    conf: &NetConf,
    target: Target,
    netns: &Netns,
    expected: Option<&CaptureConfig>,
) -> Result<Vec<String>, AttachmentError> {
    let Target { network, container_id: id, ifname } = target;
    let netns_path = netns.path().display();
    let Some(cfg) = expected else {
        let mut found = Vec::new();
        for family in aether_rules::Family::ALL {
            if netns.run(|| aether_rules::nft::kernel_view(family, capture::TABLE))??.is_some() {
                found.push(format!("pod is not managed but table {} {} exists", family.nft_name(), capture::TABLE));
            }
        }
        return Ok(found);
    };
    let mut diffs = Vec::new();
    let mut version = RulesetVersion::CURRENT;
    match StateDir::new(&conf.state_dir).read(network, id, ifname) {
        Ok(None) => diffs.push(format!("no attachment record for {id}/{ifname} in {}", conf.state_dir.display())),
        Err(u) => diffs.push(format!("the attachment record {} cannot be read: {}", u.file, u.why)),
        Ok(Some(r)) => {
            if !r.owns(netns) {
                diffs.push(format!(
                    "{netns_path} is another network namespace ({}) than the one ADD programmed",
                    netns.id()
                ));
            }
            match &r.capture {
                Some(recorded) if recorded != cfg => diffs.push(
                    "the pod's capture configuration changed since ADD (annotations or network configuration)".into(),
                ),
                Some(_) => {}
                None => diffs.push("the attachment record does not say what ADD programmed".into()),
            }
            match held_ruleset(&r, netns)? {
                Recorded::Known(v) => version = v,
                // Nothing this build makes is what the pod holds: said as such, never as a
                // rule missing or changed.
                unknown @ Recorded::Unknown(_) => {
                    diffs.insert(0, format!("the record says the pod holds {unknown}; it cannot be compared"));
                    return Ok(diffs);
                }
            }
        }
    }
    let ruleset = capture::capture_ruleset_of(cfg, version)?;
    let mut kernel = netns.run(|| aether_rules::verify(&ruleset))??;
    kernel.append(&mut diffs);
    Ok(kernel)
}

/// The capture ruleset a pod holds, as its record says. A record that names none was written
/// by a release of the first shape, or by a build of the current shape from before records
/// named it (the record's format is the same): the pod's kernel tells which, by holding one
/// of them exactly. Holding neither (drift), it is taken for the first, what such records
/// were first written for.
pub fn held_ruleset(record: &Record, netns: &Netns) -> Result<Recorded, AttachmentError> {
    let (None, Some(cfg)) = (record.ruleset, record.capture.as_ref()) else {
        return Ok(record.ruleset());
    };
    for version in [RulesetVersion::FIRST, RulesetVersion::CURRENT] {
        let ruleset = capture::capture_ruleset_of(cfg, version)?;
        if netns.run(|| aether_rules::verify(&ruleset))??.is_empty() {
            return Ok(Recorded::Known(version));
        }
    }
    Ok(record.ruleset())
}

/// GC's work: forgets the attachments of `conf`'s network for which `is_valid(container,
/// ifname)` says no, removing what is left of their capture where their netns still exists,
/// and clears what is provably stale: records of this network that cannot be read and are not
/// valid attachments, files that are not records at all, temp files of dead writers. Keeps
/// going past errors, then reports them; logs by name what it keeps.
pub fn collect(conf: &NetConf, is_valid: impl Fn(&str, &str) -> bool) -> Result<(), AttachmentError> {
    let state = StateDir::new(&conf.state_dir);
    let _lock = state.lock(true)?;
    let mut failures = Vec::new();
    let scan = state.scan();
    for rec in scan.records.iter().filter(|r| r.network == conf.name) {
        if is_valid(&rec.container_id, &rec.ifname) {
            continue;
        }
        let key = rec.key();
        let outcome =
            rec.open_netns().map_err(|e| record_netns_error(rec, e)).map(|found| live(found, &key)).and_then(|netns| {
                undo(netns, conf, Some(rec), &key, || state.remove(&rec.network, &rec.container_id, &rec.ifname))
            });
        match outcome {
            // (Its sockets closed here, one pod after another: GC answers once all are gone.)
            Ok(_closed_here) => info!(container = %rec.container_id, ifname = %rec.ifname, "stale attachment removed"),
            Err(error) => failures.push(Kept { item: key, error }),
        }
    }
    for u in &scan.unreadable {
        // Record files are named network+containerID+ifname.json (see StateDir).
        let parts: Vec<&str> = u.file.strip_suffix(".json").map(|n| n.split('+').collect()).unwrap_or_default();
        let stale = match parts.as_slice() {
            [network, c, i] if *network == conf.name => !is_valid(c, i),
            [_, _, _] => {
                info!(file = %u.file, why = %u.why, "kept: another network's record, unreadable");
                continue;
            }
            _ => true, // not a record's name: nobody's record
        };
        if !stale {
            warn!(file = %u.file, why = %u.why, "kept: the record of a valid attachment cannot be read");
            continue;
        }
        match state.remove_file(&u.file) {
            Ok(()) => info!(file = %u.file, why = %u.why, "removed an unreadable record"),
            Err(e) => failures.push(Kept { item: u.file.clone(), error: e.into() }),
        }
    }
    for t in &scan.stale_temps {
        match state.remove_file(t) {
            Ok(()) => info!(file = %t, "removed a temp file its writer left"),
            Err(e) => failures.push(Kept { item: t.clone(), error: e.into() }),
        }
    }
    if failures.is_empty() {
        return Ok(());
    }
    Err(AttachmentError::Collect(failures))
}
