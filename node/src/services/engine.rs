//! One apply engine: what each recorded pod gets once a new layer is stored, decided in one
//! place (`decide`, pure) and done in one place (`apply_to_pods`), which also records what the
//! pod then holds (its file under `pods/` for a rebuild, a line of `pods.moves` for an element
//! change, with the run of nftables generations the element changes alone made, which the
//! reconciler's look carries a pod over) and checks every pod's
//! work against the memory budget. A one-shot `services apply` and the installer's long-lived
//! applier differ only in how they reach a pod ([`Pods`], [`PodLink`]): by entering its netns
//! each time ([`Entering`]), or on a socket kept in it (the applier's cache).

use std::collections::BTreeMap;
use std::sync::Arc;

use aether_netns::Netns;
use aether_rules::nft::{Encoded, KeptSocket};
use aether_rules::services::{self as layer, Applied, LayerChange};

use super::apply::{ApplyReport, PodOutcome};
use super::{budget, flat, ServicesDir, ServicesError, StoredLayer};
use crate::state::{self, PodNetns, Record, StateDir, Unreadable};
use crate::PodError;

/// The layer a pod netns holds: `generation digest netns-id divert-mark`, one line, and
/// `first last` when an element change sent it (see `applied_run`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PodHolds {
    pub(super) generation: u64,
    pub(super) digest: u64,
    /// `Netns::id()` of the netns it was written for.
    pub(super) netns: String,
    pub(super) divert_mark: u32,
    /// The netns's nftables generations from `first` to `last` were all made by the Service
    /// layer's element changes, one after another (each transaction's fence read the
    /// generation one past the last), and `last` is where this layer was sent. The
    /// reconciler carries a pod's intact state over them instead of comparing it again.
    pub(super) applied_run: Option<(u32, u32)>,
}

impl PodHolds {
    pub(super) fn new(stored: &StoredLayer, ns: &Netns, divert_mark: u32) -> Self {
        PodHolds::for_key(stored, netns_key(ns), divert_mark)
    }

    /// `new` for the netns whose `netns_key` is `netns`.
    pub(super) fn for_key(stored: &StoredLayer, netns: String, divert_mark: u32) -> Self {
        PodHolds::for_key_of(stored.generation, stored.digest, netns, divert_mark)
    }

    /// `for_key` of the stored layer of `generation` and `digest`.
    pub(super) fn for_key_of(generation: u64, digest: u64, netns: String, divert_mark: u32) -> Self {
        PodHolds { generation, digest, netns, divert_mark, applied_run: None }
    }

    pub(super) fn parse(text: &str) -> Option<Self> {
        // Written in place: a copy torn by a crash lacks the final newline, and is no file.
        let mut f = text.strip_suffix('\n')?.split_whitespace();
        let mut held = PodHolds {
            generation: f.next()?.parse().ok()?,
            digest: u64::from_str_radix(f.next()?, 16).ok()?,
            netns: f.next()?.to_string(),
            divert_mark: u32::from_str_radix(f.next()?.trim_start_matches("0x"), 16).ok()?,
            applied_run: None,
        };
        if let Some(first) = f.next() {
            held.applied_run = Some((first.parse().ok()?, f.next()?.parse().ok()?));
        }
        f.next().is_none().then_some(held)
    }

    /// Whether the pod holds `stored`'s layer for `divert_mark` (whatever the generation).
    pub(super) fn is(&self, stored: &StoredLayer, divert_mark: u32) -> bool {
        self.digest == stored.digest && self.divert_mark == divert_mark
    }
}

/// A netns's identity as one word: `device:inode`.
pub(super) fn netns_key(ns: &Netns) -> String {
    format!("{}:{}", ns.id().dev, ns.id().ino)
}

impl std::fmt::Display for PodHolds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:016x} {} {:#x}", self.generation, self.digest, self.netns, self.divert_mark)?;
        if let Some((first, last)) = self.applied_run {
            write!(f, " {first} {last}")?;
        }
        writeln!(f)
    }
}

/// What a pod gets once `new` is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    /// It holds the new layer for its mark already: nothing is sent.
    Nothing,
    /// It holds the previous layer for its mark: the element change from it (rebuilt if the
    /// kernel refuses it: the pod does not hold what its file says).
    Change,
    /// The whole layer: its file names another layer or mark, or there is none, or no file
    /// is trusted.
    Rebuild,
    /// Mode `off`: its tables removed (their counts folded into the node's first).
    Remove,
}

/// The one decision, for every caller: what a pod gets, from what its file under `pods/`
/// says it holds (`held`: `None` when absent, torn, or about another netns), whether the last
/// apply was stopped midway (`interrupted`: a pod may hold a layer its file does not name, so
/// no file is trusted), the previous and the new stored layer, and the pod's divert mark
/// (`mark_of` its record).
pub(super) fn decide(
    held: Option<&PodHolds>,
    interrupted: bool,
    previous: Option<&StoredLayer>,
    new: &StoredLayer,
    mark: u32,
) -> Action {
    if new.layer.mode == layer::LayerMode::Off {
        return Action::Remove;
    }
    match (held.filter(|_| !interrupted), previous) {
        (Some(h), _) if h.is(new, mark) => Action::Nothing,
        (Some(h), Some(prev)) if h.is(prev, mark) => Action::Change,
        _ => Action::Rebuild,
    }
}

/// The divert mark a pod's layer matches: the one its own capture sets, else the node's.
pub(super) fn mark_of(r: &Record, node_mark: u32) -> u32 {
    r.capture.as_ref().map_or(node_mark, |c| c.divert_mark)
}

/// What a visit committed in a pod's netns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Sent {
    /// Nothing (it held the layer, or the change had no element for it): its generation did
    /// not move.
    Nothing,
    /// The element change: the generation read just before it (when read), and the one its
    /// transaction's fence read.
    Change { before: Option<u32>, after: Option<u32> },
    /// A rebuild (its generation is not followed).
    Rebuild,
}

impl Sent {
    /// The pod's run of generations made by element changes alone, after this visit, from
    /// the one before it (`PodHolds::applied_run`). A change whose fence read one past the
    /// run's last extends it, and one past the generation read just before it starts one
    /// there: nothing else was committed in between (any commit moves the generation by one).
    /// Any other change starts a run at its own generation: what came before it (another
    /// commit, even one between the transaction and its fence) is not claimed.
    pub(super) fn run(&self, run: Option<(u32, u32)>) -> Option<(u32, u32)> {
        match (self, run) {
            (Sent::Nothing, run) => run,
            (Sent::Change { after: Some(after), .. }, Some((first, last))) if last.wrapping_add(1) == *after => {
                Some((first, *after))
            }
            (Sent::Change { before: Some(before), after: Some(after) }, _) if before.wrapping_add(1) == *after => {
                Some((*before, *after))
            }
            (Sent::Change { after: Some(after), .. }, _) => Some((*after, *after)),
            (Sent::Change { after: None, .. }, _) | (Sent::Rebuild, _) => None,
        }
    }
}

/// How an apply reaches the recorded pods.
pub(super) trait Pods {
    /// The attachment records (unreadable ones added to `warnings`), and whether they were
    /// read anew since this reach's last apply (always, for a one-shot one): the files of
    /// pods no record names are pruned then.
    fn records(&mut self, dir: &ServicesDir, warnings: &mut Vec<String>) -> (Arc<Vec<Record>>, bool);

    /// The way into a recorded pod's netns (`PodError::Gone`: it is gone): `r`, the `i`th of
    /// the records `records` returned last.
    fn reach(&mut self, i: usize, r: &Record) -> Result<&mut dyn PodLink, PodError>;
}

/// One pod, reached.
pub(super) trait PodLink {
    /// Its netns (entered in place: the apply is on a tour).
    fn netns(&self) -> &Netns;

    /// What its own file under `pods/` says, and what it holds (that file moved on by
    /// `pods.moves`).
    fn held(&mut self, dir: &ServicesDir) -> (Option<PodHolds>, Option<PodHolds>);

    /// Writes its file (`Some`), or removes it (`None`: what it holds is unknown).
    fn record(&mut self, dir: &ServicesDir, held: Option<PodHolds>) -> Result<(), ServicesError>;

    /// It holds `now`, which a line of `pods.moves` says (its own file unchanged).
    fn moved(&mut self, now: &PodHolds);

    /// Sends an element change, encoded once for all pods, in one transaction: the netns's
    /// ruleset generation just before it (when `read_before`, and read) and the one the
    /// transaction's fence read.
    fn send(&mut self, change: &Encoded, read_before: bool) -> Result<(Option<u32>, Option<u32>), PodError>;
}

/// A one-shot process's reach: each pod's netns opened and entered for its visit, a socket
/// opened there for each transaction.
#[derive(Default)]
pub(super) struct Entering {
    pod: Option<Entered>,
}

struct Entered {
    ns: Netns,
}

impl Pods for Entering {
    fn records(&mut self, dir: &ServicesDir, warnings: &mut Vec<String>) -> (Arc<Vec<Record>>, bool) {
        let scan = StateDir::new(&dir.state).scan();
        warnings.extend(scan.unreadable.iter().map(unreadable));
        (Arc::new(scan.records), true)
    }

    fn reach(&mut self, _: usize, r: &Record) -> Result<&mut dyn PodLink, PodError> {
        Ok(self.pod.insert(Entered { ns: open_pod(r)? }))
    }
}

impl PodLink for Entered {
    fn netns(&self) -> &Netns {
        &self.ns
    }

    fn held(&mut self, dir: &ServicesDir) -> (Option<PodHolds>, Option<PodHolds>) {
        let file = dir.pod_file(&self.ns);
        let holds = file.clone().map(|f| dir.moves().fold(f));
        (file, holds)
    }

    fn record(&mut self, dir: &ServicesDir, held: Option<PodHolds>) -> Result<(), ServicesError> {
        match held {
            Some(held) => dir.set_pod_holds(&self.ns, &held),
            None => {
                dir.forget_pod(self.ns.path());
                Ok(())
            }
        }
    }

    fn moved(&mut self, _: &PodHolds) {}

    fn send(&mut self, change: &Encoded, read_before: bool) -> Result<(Option<u32>, Option<u32>), PodError> {
        flat(self.ns.run(|| -> aether_rules::Result<_> {
            let mut sock = KeptSocket::open()?;
            let before = if read_before { sock.generation().ok() } else { None };
            let after = change.send_on(&mut sock);
            // Closed with the others (`CloseLater`): a change that deletes elements makes the
            // kernel wait one grace period at each close.
            sock.close_later();
            Ok((before, after?))
        }))
    }
}

/// The warning for an attachment record that cannot be read.
pub(super) fn unreadable(u: &Unreadable) -> String {
    format!("attachment record {} cannot be read, its pod is not reached: {}", u.file, u.why)
}

/// A record's netns, if it is still the pod's (a path reused by another namespace, a file
/// or a directory is not: the pod is skipped as gone).
pub(super) fn open_pod(r: &Record) -> Result<Netns, PodError> {
    match r.open_netns() {
        Ok(PodNetns::Live(ns)) => Ok(ns),
        Ok(PodNetns::Gone(why)) => Err(PodError::Gone(why)),
        Err(e) => Err(PodError::Netns(e)),
    }
}

/// Once `new` is stored (`previous`: what was stored before): every recorded pod brought to
/// it, as `decide` says, reached through `pods`; run on a tour (`aether_netns::tour` or
/// `tour_here`: one thread entering each pod's netns in turn, as a thread per pod cost more
/// than the change it sends).
pub(super) fn apply_to_pods(
    dir: &ServicesDir,
    new: &StoredLayer,
    previous: Option<&StoredLayer>,
    mut warnings: Vec<String>,
    pods: &mut dyn Pods,
) -> Result<ApplyReport, ServicesError> {
    let (records, rescanned) = pods.records(dir, &mut warnings);
    if rescanned {
        dir.prune_pods(&records);
    }
    // A pod still marked as folding whose layer is gone (a DEL or apply killed after removing
    // it): the mark ends before a new layer starts counting from zero.
    let folding = match dir.accumulator() {
        Ok(acc) => acc.folding,
        Err(e) => {
            warnings
                .push(format!("the node's Service totals cannot be read, stale fold marks are left as they are: {e}"));
            Default::default()
        }
    };
    // (No key made for each record when no pod is folding, as none usually is.)
    let ended: Vec<String> = records
        .iter()
        .enumerate()
        .filter(|(_, r)| !folding.is_empty() && folding.contains_key(&r.key()))
        .filter(|&(i, r)| pods.reach(i, r).is_ok_and(|p| matches!(p.netns().run(layer::counters), Ok(Ok(None)))))
        .map(|(_, r)| r.key())
        .collect();
    if !ended.is_empty() {
        dir.end_folding(&ended)?;
    }
    // Mode `off` removes each pod's table: its counts join the node totals first (as at
    // DEL), idempotently, so they never go backwards, also when this apply is killed.
    let off = new.layer.mode == layer::LayerMode::Off;
    let mut folded_keys = Vec::new();
    if off {
        let counts: Vec<(String, BTreeMap<String, u64>)> = records
            .iter()
            .enumerate()
            .filter_map(|(i, r)| Some((r.key(), flat(pods.reach(i, r).ok()?.netns().run(layer::counters)).ok()??)))
            .collect();
        dir.fold_pods(&counts)?;
        folded_keys = counts.into_iter().map(|(k, _)| k).collect();
    }
    let interrupted = dir.begin_pods(&mut warnings)?;
    let mut pass = Pass {
        dir,
        new,
        previous,
        node_mark: dir.divert_mark(),
        interrupted,
        marks: BTreeMap::new(),
        cut: None,
        warnings,
        removed_keys: Vec::new(),
    };
    let mut outcomes = Vec::with_capacity(records.len());
    // Every pod's transaction first, then what they hold: the sends one after another (a
    // pod's file written between two sends made each send cost more). A crash in between is
    // what `applying` is for: the next apply trusts no file.
    let mut to_record = Vec::with_capacity(records.len());
    for (i, r) in records.iter().enumerate() {
        let result = pods.reach(i, r).and_then(|pod| pass.visit(r, pod)).map(|(applied, record)| {
            if let Some(record) = record {
                to_record.push((i, record));
            }
            applied
        });
        outcomes.push(PodOutcome {
            container_id: r.container_id.clone(),
            ifname: r.ifname.clone(),
            netns: r.netns.clone(),
            result,
        });
    }
    // The pods rebuilt get their own files; those an element change moved (or that hold
    // what an earlier one moved them to) a line each of `pods.moves`, written once.
    let mut moves = Vec::new();
    for (i, recorded) in to_record {
        match recorded {
            Recorded::Own(held) => {
                if let Ok(Err(e)) = pods.reach(i, &records[i]).map(|pod| pod.record(dir, held)) {
                    pass.warnings.push(e.to_string());
                }
            }
            Recorded::Moved { file, now } => {
                if let Ok(pod) = pods.reach(i, &records[i]) {
                    pod.moved(&now);
                }
                moves.push((file, now));
            }
        }
    }
    // Not written: these pods' files name older layers, so each is rebuilt or compared in
    // full later, never taken for what it does not hold.
    if let Err(e) = dir.write_moves(&moves) {
        pass.warnings.push(e.to_string());
    }
    let Pass { warnings, mut removed_keys, .. } = pass;
    dir.end_pods()?;
    if off {
        removed_keys.retain(|k| folded_keys.contains(k));
        dir.end_folding(&removed_keys)?;
    }
    Ok(ApplyReport { generation: new.generation, pods: outcomes, warnings })
}

/// What a pod holds after its visit, to be recorded once every pod is sent its transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Recorded {
    /// In its own file (`None`: removed, what it holds is unknown).
    Own(Option<PodHolds>),
    /// In a line of `pods.moves`: its own file says `file`, and it holds `now`.
    Moved { file: PodHolds, now: PodHolds },
}

impl Recorded {
    /// Once a pod whose file says `file` holds `now`: a rebuild (`rebuilt`) or a pod without a
    /// file gets its own file, any other a line of `pods.moves` (none when its file says it).
    pub(super) fn of(file: Option<PodHolds>, now: PodHolds, rebuilt: bool) -> Option<Recorded> {
        match file {
            Some(file) if file == now => None,
            Some(file) if !rebuilt => Some(Recorded::Moved { file, now }),
            _ => Some(Recorded::Own(Some(now))),
        }
    }
}

/// One apply's walk over the pods.
struct Pass<'a> {
    dir: &'a ServicesDir,
    new: &'a StoredLayer,
    previous: Option<&'a StoredLayer>,
    node_mark: u32,
    /// The last apply was stopped midway: no pod's file is trusted, every pod is rebuilt.
    interrupted: bool,
    /// What is made once per divert mark in use (in practice one).
    marks: BTreeMap<u32, ForMark<'a>>,
    /// The previous and the new layer cut down to where they differ (`narrowed`), on first need.
    cut: Option<(layer::ServiceLayer, layer::ServiceLayer)>,
    warnings: Vec<String>,
    /// The attachments whose layer mode `off` removed.
    removed_keys: Vec<String>,
}

impl Pass<'_> {
    /// Brings one pod to the new layer as `decide` says; what it then holds, recorded once
    /// every pod is sent its transaction (`None`: nothing to record).
    fn visit(&mut self, r: &Record, pod: &mut dyn PodLink) -> Result<(Applied, Option<Recorded>), PodError> {
        let (dir, new) = (self.dir, self.new);
        let mark = mark_of(r, self.node_mark);
        let (file, held) = if self.interrupted { (None, None) } else { pod.held(dir) };
        let action = decide(held.as_ref(), self.interrupted, self.previous, new, mark);
        let m = self.marks.entry(mark).or_insert_with(|| ForMark::new(new, mark));
        let (outcome, sent) = match (action, self.previous) {
            (Action::Remove, _) => {
                // The file goes first: killed after the removal, it must not name a layer.
                let _ = pod.record(dir, None);
                let outcome = flat(pod.netns().run(|| layer::apply(m.layer())));
                if matches!(outcome, Ok(Applied::Removed(_))) {
                    self.removed_keys.push(r.key());
                }
                return outcome.map(|a| (a, None));
            }
            (Action::Nothing, _) => (Ok(Applied::Unchanged), Sent::Nothing),
            (Action::Change, Some(prev)) => {
                let (from, to) = self.cut.get_or_insert_with(|| narrowed(prev, new));
                // Without a run to extend, the generation just before the change, so that one
                // can start at it (one more request, only then).
                let read_before = held.as_ref().is_none_or(|h| h.applied_run.is_none());
                let tried = match m.change(from, to) {
                    None => None,
                    // What it adds must fit what this process may still charge (else the pod
                    // keeps the whole layer it has).
                    Some((c, encoded)) => match budget::pod_fits(c.added() as u64) {
                        Err(over) => Some((Err(PodError::OverBudget(over)), Sent::Nothing)),
                        Ok(()) if c.is_empty() => Some((Ok(Applied::Unchanged), Sent::Nothing)),
                        Ok(()) => {
                            let applied = Applied::Elements { added: c.added(), removed: c.removed() };
                            // `None` when refused: the pod's layer is not what its file says.
                            pod.send(encoded, read_before)
                                .ok()
                                .map(|(before, after)| (Ok(applied), Sent::Change { before, after }))
                        }
                    },
                };
                // No element change between these layers, or the kernel refused it: rebuilt.
                tried.unwrap_or_else(|| (m.rebuild(pod.netns()), Sent::Rebuild))
            }
            (Action::Change | Action::Rebuild, _) => (m.rebuild(pod.netns()), Sent::Rebuild),
        };
        crate::state::crash_point("services-pod-sent");
        match outcome {
            // It holds the new layer already: what says so says so again (a line of
            // `pods.moves` is written anew by each apply).
            Ok(a) if held.as_ref().is_some_and(|h| h.is(new, mark)) => {
                Ok((a, Recorded::of(file, held.expect("checked"), false)))
            }
            Ok(a) => {
                let run = sent.run(held.as_ref().and_then(|h| h.applied_run));
                let key = netns_key(pod.netns());
                let now = PodHolds { applied_run: run, ..PodHolds::for_key(new, key, mark) };
                Ok((a, Recorded::of(file, now, sent == Sent::Rebuild)))
            }
            Err(e) => {
                // What it holds is unknown: its file goes now, not after the others' sends.
                let _ = pod.record(dir, None);
                Err(e)
            }
        }
    }
}

/// What a pass makes once per divert mark, each piece on first need: the whole layer for
/// this mark (a copy of 20,000 ports at 10,000 Services: a rebuild's), the element change
/// from the previous layer encoded once for every pod, and the rebuild's prepared batch.
struct ForMark<'a> {
    stored: &'a StoredLayer,
    mark: u32,
    layer: Option<layer::ServiceLayer>,
    change: Option<Option<(LayerChange, Encoded)>>,
    prepared: Option<Option<layer::Prepared>>,
}

impl<'a> ForMark<'a> {
    fn new(stored: &'a StoredLayer, mark: u32) -> Self {
        ForMark { stored, mark, layer: None, change: None, prepared: None }
    }

    fn layer(&mut self) -> &layer::ServiceLayer {
        let (stored, mark) = (self.stored, self.mark);
        self.layer.get_or_insert_with(|| stored.for_pod(mark))
    }

    /// The element change between the cut layers for this mark, encoded once.
    fn change(&mut self, from: &layer::ServiceLayer, to: &layer::ServiceLayer) -> Option<&(LayerChange, Encoded)> {
        let mark = self.mark;
        self.change
            .get_or_insert_with(|| {
                let at = |l: &layer::ServiceLayer| layer::ServiceLayer { divert_mark: mark, ..l.clone() };
                let c = LayerChange::between(&at(from), &at(to)).ok().flatten()?;
                let encoded = c.encode();
                Some((c, encoded))
            })
            .as_ref()
    }

    /// The pod's layer rebuilt, in its netns, if it fits what this process may still charge
    /// (else the pod keeps what it has).
    fn rebuild(&mut self, ns: &Netns) -> Result<Applied, PodError> {
        budget::pod_fits(budget::layer_elements(self.layer())).map_err(PodError::OverBudget)?;
        let l = self.layer.as_ref().expect("made above");
        match self.prepared.get_or_insert_with(|| layer::Prepared::new(l).ok().flatten()) {
            Some(p) => flat(ns.run(|| p.rebuild())),
            None => flat(ns.run(|| layer::rebuild(l))),
        }
    }
}

/// Two stored layers (lists sorted) cut down to the Service VIPs and mesh VIPs whose
/// elements differ, everything else kept: the change between the cut layers is the whole
/// ones' and costs what changed. A VIP's elements depend on its ports and on which profiles
/// have chains, decided over the whole layer: each cut keeps its whole layer's decision, and
/// the VIPs of a profile that gained or lost its chain.
pub(super) fn narrowed(old: &StoredLayer, new: &StoredLayer) -> (layer::ServiceLayer, layer::ServiceLayer) {
    let mut vips: Vec<std::net::IpAddr> = match touched_between(old, new) {
        // Only the VIPs the change touched can differ: each compared, not the 20,000 ports.
        Some(touched) => touched
            .into_iter()
            .filter(|&v| {
                let (o, n) = (&old.layer.ports, &new.layer.ports);
                o[layer::ports_of(o, v)] != n[layer::ports_of(n, v)]
            })
            .collect(),
        None => {
            let (gone, came) = sorted_difference(&old.layer.ports, &new.layer.ports);
            gone.iter().chain(&came).map(|p| p.vip).collect()
        }
    };
    vips.sort_unstable();
    vips.dedup();
    let (old_chains, new_chains) = decisions(old, new, &vips);
    let (old, new) = (&old.layer, &new.layer);
    vips.extend(layer::rechained_vips([old, new], &old_chains, &new_chains));
    vips.sort_unstable();
    vips.dedup();
    let (mesh_gone, mesh_came) = sorted_difference(&old.mesh_vips, &new.mesh_vips);
    let mut mesh: Vec<std::net::IpAddr> = mesh_gone.into_iter().chain(mesh_came).collect();
    mesh.sort_unstable();
    let cut = |l: &layer::ServiceLayer, chained: layer::ProfileChains| layer::ServiceLayer {
        mode: l.mode,
        ranges: l.ranges.clone(),
        mesh_vips: l.mesh_vips.iter().filter(|a| mesh.binary_search(a).is_ok()).copied().collect(),
        ports: vips.iter().flat_map(|&v| l.ports[layer::ports_of(&l.ports, v)].iter().copied()).collect(),
        dialled_timeout_secs: l.dialled_timeout_secs,
        divert_mark: l.divert_mark,
        chained: Some(chained),
    };
    (cut(old, old_chains), cut(new, new_chains))
}

/// The VIPs whose ports a change may have changed, recorded by the apply that made the
/// layer of digest `.1` from the one of digest `.0` (`note_touched`): a cache in front of
/// `narrowed`'s comparison of every port, which then compares only these. Process-wide (the
/// apply's tour may run on another thread), the last few changes.
type Touched = (u64, u64, Vec<std::net::IpAddr>);
static TOUCHED: std::sync::Mutex<Vec<Touched>> = std::sync::Mutex::new(Vec::new());
const TOUCHED_KEPT: usize = 4;

/// Records that every VIP whose ports differ between `old` and `new` is among `touched`.
pub(super) fn note_touched(old: &StoredLayer, new: &StoredLayer, touched: Vec<std::net::IpAddr>) {
    let mut kept = TOUCHED.lock().unwrap_or_else(|p| p.into_inner());
    kept.retain(|(o, n, _)| (*o, *n) != (old.digest, new.digest));
    kept.push((old.digest, new.digest, touched));
    let excess = kept.len().saturating_sub(TOUCHED_KEPT);
    kept.drain(..excess);
}

fn touched_between(old: &StoredLayer, new: &StoredLayer) -> Option<Vec<std::net::IpAddr>> {
    let kept = TOUCHED.lock().unwrap_or_else(|p| p.into_inner());
    kept.iter().find(|(o, n, _)| (*o, *n) == (old.digest, new.digest)).map(|(_, _, t)| t.clone())
}

/// The profile counts of the stored layers last decided over, by content digest: a cache in
/// front of the one decision (`ProfileCounts::chains`). The long-lived applier decides over
/// two whole layers on every change (a fifth of its CPU for a change at 10,000 Services, in
/// every pod's place), and the budget's estimate asks for the same two as the apply: a layer
/// is counted in full once, and one that a change makes from a counted layer is counted by
/// the Services the change touches. Process-wide: a one-shot process applies one document.
static COUNTED: std::sync::Mutex<Vec<(u64, Arc<layer::ProfileCounts>)>> = std::sync::Mutex::new(Vec::new());
/// Layers remembered: the two of a change, and the two before.
const COUNTED_KEPT: usize = 4;

/// Which profiles get chains in `old` and in `new`, whose Services differ only at `touched`
/// (sorted VIPs).
fn decisions(
    old: &StoredLayer,
    new: &StoredLayer,
    touched: &[std::net::IpAddr],
) -> (layer::ProfileChains, layer::ProfileChains) {
    // (A stored layer's lists are sorted, `StoredLayer::with_file`; `narrowed` relies on it.)
    if old.layer.chained.is_some() || new.layer.chained.is_some() {
        return (old.layer.profile_chains(), new.layer.profile_chains());
    }
    let mut counted = COUNTED.lock().unwrap_or_else(|p| p.into_inner());
    let find = |counted: &[(u64, Arc<layer::ProfileCounts>)], l: &StoredLayer| {
        counted.iter().find(|(d, _)| *d == l.digest).map(|(_, c)| c.clone())
    };
    let old_counts = find(&counted, old).unwrap_or_else(|| Arc::new(layer::ProfileCounts::of(&old.layer.ports)));
    let new_counts = find(&counted, new).unwrap_or_else(|| {
        let of = |l: &layer::ServiceLayer| -> Vec<layer::ServicePort> {
            touched.iter().flat_map(|&v| l.ports[layer::ports_of(&l.ports, v)].iter().copied()).collect()
        };
        Arc::new(old_counts.moved(&of(&old.layer), &of(&new.layer)))
    });
    for (l, c) in [(old, &old_counts), (new, &new_counts)] {
        counted.retain(|(d, _)| *d != l.digest);
        counted.push((l.digest, c.clone()));
    }
    let excess = counted.len().saturating_sub(COUNTED_KEPT);
    counted.drain(..excess);
    (old_counts.chains(), new_counts.chains())
}

/// (in `a` only, in `b` only) of two sorted lists.
fn sorted_difference<T: Ord + Copy>(a: &[T], b: &[T]) -> (Vec<T>, Vec<T>) {
    let (mut only_a, mut only_b) = (Vec::new(), Vec::new());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Equal => (i, j) = (i + 1, j + 1),
            std::cmp::Ordering::Less => {
                only_a.push(a[i]);
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                only_b.push(b[j]);
                j += 1;
            }
        }
    }
    only_a.extend_from_slice(&a[i..]);
    only_b.extend_from_slice(&b[j..]);
    (only_a, only_b)
}

/// Present while an apply changes pods: put in place before the first pod is visited and
/// taken away after the last. Found by the next apply, it says one was stopped midway, when a
/// pod may hold a layer its `pods/` file does not name (sent, then killed before the file was
/// written); trusting that file could leave the pod wrong for good (a later document with
/// the file's content would find nothing to do), so that apply trusts no file and rebuilds
/// every pod. One file per apply instead of a second write per pod. Only its presence says
/// anything (releases before this one wrote the generation in it, and read only that it is
/// there).
pub(super) const APPLYING: &str = "applying";

/// The mark's file between applies: renamed to [`APPLYING`] and back, not made and removed by
/// each apply. A file made and unlinked for each change (an inode allocated, then evicted)
/// cost a change to a node without pods 0.03 ms of the applier's 0.45 ms on tmpfs, 0.07 ms
/// on ext4, more than the two renames.
const APPLYING_SPARE: &str = ".applying.spare";

impl ServicesDir {
    /// Marks an apply's visit of the pods as begun; whether the last one was stopped midway.
    pub(super) fn begin_pods(&self, warnings: &mut Vec<String>) -> Result<bool, ServicesError> {
        // One opening of the directory for the look and the mark.
        let dir = self.open(true)?.expect("created");
        let interrupted = !matches!(dir.read(APPLYING, state::MAX_STATE_FILE_BYTES), Ok(None));
        if interrupted {
            warnings.push(
                "the last apply was stopped before it reached every pod: every pod's layer is rebuilt".to_string(),
            );
        }
        let write = |source| ServicesError::Write { path: self.root.join(APPLYING), source };
        // The spare renamed in (over a mark left standing, if any); without a spare (the
        // first apply, or the one after an apply stopped midway) a mark left standing stays,
        // and otherwise one is made.
        match dir.rename(APPLYING_SPARE, APPLYING) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !interrupted => {
                dir.overwrite(APPLYING, b"").map_err(write)?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            done => done.map_err(write)?,
        }
        Ok(interrupted)
    }

    /// Marks an apply's visit of the pods as finished: the mark becomes the spare.
    pub(super) fn end_pods(&self) -> Result<(), ServicesError> {
        let dir = self.open(true)?.expect("created");
        match dir.rename(APPLYING, APPLYING_SPARE) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(ServicesError::Write { path: self.root.join(APPLYING), source: e })
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests;
