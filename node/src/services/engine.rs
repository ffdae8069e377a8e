//! One apply engine: what each recorded pod gets once a new layer is stored, decided in one
//! place (`decide`, pure, from what the pod's own tables say they hold) and done in one place
//! (`apply_to_pods`), which also checks every pod's work against the memory budget. The
//! record of what a pod holds is the pod's table (`layer::Named`, a counter named after the
//! layer, swapped in the same transaction as every element change, so the kernel refuses a
//! change built for a pod that holds anything else): no file mirrors it. A one-shot `services
//! apply` and the installer's long-lived applier differ only in how they reach a pod
//! ([`Pods`], [`PodLink`]): by entering its netns each time ([`Entering`]), or on a socket kept
//! in it (the applier's cache, which also remembers what it last sent each pod: a belief the
//! kernel checks, never trusted past a refusal).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use aether_netns::Netns;
use aether_rules::nft::{Encoded, KeptSocket};
use aether_rules::services::{self as layer, Applied, HeldLayer, LayerChange};

use super::outcome::{ApplyReport, PodOutcome};
use super::plan::{decide, mark_of, Action, Plan};
use super::{budget, flat, ServicesDir, ServicesError, StoredLayer};
use crate::state::{PodNetns, Record, StateDir, Unreadable};
use crate::PodError;

/// What a visit committed in a pod's netns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Sent {
    /// Nothing (it held the layer): its generation did not move.
    Nothing,
    /// The element change: the generation read just before it (when read), and the one its
    /// transaction's fence read.
    Change { before: Option<u32>, after: Option<u32> },
    /// A rebuild, a rename or a removal (its generation is not followed).
    Rebuild,
}

impl Sent {
    /// The pod's run of generations made by element changes alone, after this visit, from
    /// the one before it (`AppliedRun`). A change whose fence read one past the run's last
    /// extends it, and one past the generation read just before it starts one there: nothing
    /// else was committed in between (any commit moves the generation by one). Any other
    /// change starts a run at its own generation: what came before it (another commit, even
    /// one between the transaction and its fence) is not claimed.
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

/// What this process's element changes did to a pod netns since a reconciler compared it:
/// the stored generation they brought it to, for which divert mark, and the run of the
/// netns's nftables generations they alone made (`first` to `last`, where that layer was
/// sent). Kept in memory, by netns: the installer's applier and its reconciler share the
/// process; lost, it costs the reconciler one full comparison of the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppliedRun {
    pub layer_generation: u64,
    pub divert_mark: u32,
    pub first: u32,
    pub last: u32,
}

/// A pod netns among the runs of one state directory: its nsfs (device, inode).
type RunKey = (u64, u64);

/// The runs, by state directory (of `ServicesDir::root`), then by pod netns.
type Runs = HashMap<std::path::PathBuf, HashMap<RunKey, AppliedRun>>;

static RUNS: std::sync::Mutex<Option<Runs>> = std::sync::Mutex::new(None);

/// `f` on the runs of the state directory of `dir`.
fn runs<T>(dir: &ServicesDir, f: impl FnOnce(&mut HashMap<RunKey, AppliedRun>) -> T) -> T {
    let mut all = RUNS.lock().unwrap_or_else(|p| p.into_inner());
    let all = all.get_or_insert_with(HashMap::new);
    // (The directory's path copied once, not at each visit.)
    if !all.contains_key(&dir.root) {
        all.insert(dir.root.clone(), HashMap::new());
    }
    f(all.get_mut(&dir.root).expect("inserted above"))
}

fn run_key(ns: &Netns) -> RunKey {
    (ns.id().dev, ns.id().ino)
}

/// The pod netns's `AppliedRun`, if this process's element changes made one.
pub fn applied_run(state_dir: &std::path::Path, netns: &Netns) -> Option<AppliedRun> {
    runs(&ServicesDir::new(state_dir), |r| r.get(&run_key(netns)).copied())
}

/// How an apply reaches the recorded pods.
pub(super) trait Pods {
    /// The attachment records (unreadable ones added to `warnings`).
    fn records(&mut self, dir: &ServicesDir, warnings: &mut Vec<String>) -> Arc<Vec<Record>>;

    /// The way into a recorded pod's netns (`PodError::Gone`: it is gone): `r`, the `i`th of
    /// the records `records` returned last.
    fn reach(&mut self, i: usize, r: &Record) -> Result<&mut dyn PodLink, PodError>;
}

/// One pod, reached.
pub(super) trait PodLink {
    /// Its netns (entered in place: the apply is on a tour).
    fn netns(&self) -> &Netns;

    /// What its tables say they hold: read from the kernel, or (unless `fresh`) what this
    /// link last sent or read, which a change's compare-and-swap checks anyway.
    fn held(&mut self, fresh: bool) -> Result<HeldLayer, PodError>;

    /// What it holds after a visit (`None`: unknown, read from the kernel next time).
    fn believe(&mut self, now: Option<HeldLayer>);

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
    fn records(&mut self, dir: &ServicesDir, warnings: &mut Vec<String>) -> Arc<Vec<Record>> {
        let scan = StateDir::new(&dir.state).scan();
        warnings.extend(scan.unreadable.iter().map(unreadable));
        Arc::new(scan.records)
    }

    fn reach(&mut self, _: usize, r: &Record) -> Result<&mut dyn PodLink, PodError> {
        Ok(self.pod.insert(Entered { ns: open_pod(r)? }))
    }
}

impl PodLink for Entered {
    fn netns(&self) -> &Netns {
        &self.ns
    }

    fn held(&mut self, _fresh: bool) -> Result<HeldLayer, PodError> {
        InPlace(&self.ns).held(true)
    }

    fn believe(&mut self, _: Option<HeldLayer>) {}

    fn send(&mut self, change: &Encoded, read_before: bool) -> Result<(Option<u32>, Option<u32>), PodError> {
        InPlace(&self.ns).send(change, read_before)
    }
}

/// A pod netns the caller opened: its tables read each time, a socket opened for each
/// transaction (`bring_pod`'s).
struct InPlace<'a>(&'a Netns);

impl PodLink for InPlace<'_> {
    fn netns(&self) -> &Netns {
        self.0
    }

    fn held(&mut self, _fresh: bool) -> Result<HeldLayer, PodError> {
        flat(self.0.run(layer::held))
    }

    fn believe(&mut self, _: Option<HeldLayer>) {}

    fn send(&mut self, change: &Encoded, read_before: bool) -> Result<(Option<u32>, Option<u32>), PodError> {
        flat(self.0.run(|| -> aether_rules::Result<_> {
            let mut sock = KeptSocket::open()?;
            let before = if read_before { sock.generation().ok() } else { None };
            // (Closed with the others, when dropped, while a `CloseLater` is alive.)
            Ok((before, change.send_on(&mut sock)?))
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

/// When a visitor listed the records, and the attachments directory as it was then, held
/// open: every record written, renamed or removed since changes the directory, so a directory
/// unchanged since the listing vouches for every listed record with one `fstat` (no path looked
/// up: a stat of each record by its path was a third of a change's extra system time at 100
/// pods).
pub(super) struct Listed {
    at: std::time::SystemTime,
    dir: Option<std::fs::File>,
}

/// The coarse clock of file times (a tick of up to 10 ms): a time this close to the listing
/// vouches for nothing.
const FILE_CLOCK_MARGIN: std::time::Duration = std::time::Duration::from_millis(50);

impl Listed {
    /// Taken just before the records are listed: every record the listing holds was written
    /// before this.
    pub(super) fn now(state: &StateDir) -> Listed {
        let dir = std::fs::File::open(state.root().join("attachments")).ok();
        Listed { at: std::time::SystemTime::now(), dir }
    }

    /// The same listing without the directory's word (tests: each record's own is asked).
    #[cfg(test)]
    pub(super) fn without_directory(&self) -> Listed {
        Listed { at: self.at, dir: None }
    }

    /// Whether the attachments directory is as it was at the listing (`false` when unknown).
    fn unchanged(&self) -> bool {
        use std::os::unix::fs::MetadataExt;
        let Some(m) = self.dir.as_ref().and_then(|d| d.metadata().ok()) else { return false };
        let changed = std::time::Duration::new(m.ctime().max(0) as u64, m.ctime_nsec().clamp(0, 999_999_999) as u32);
        std::time::UNIX_EPOCH + changed + FILE_CLOCK_MARGIN < self.at
    }
}

/// The pod's netns lock (`Netns::lock`), taken for a visit, when its record is still there
/// once it is held (`recorded`); `PodError::Gone` when not. Only this pod waits.
pub(super) fn still_recorded(
    state: &StateDir,
    r: &Record,
    ns: &Netns,
    listed: &Listed,
) -> Result<aether_netns::NetnsLock, PodError> {
    let lock = ns.lock().map_err(PodError::Netns)?;
    recorded(state, r, listed)?;
    Ok(lock)
}

/// Whether the record `r` is still there, asked while the pod's netns lock is held. ADD,
/// DEL and repairs hold the same lock for their pod, and a DEL removes the pod's layer and
/// then its record before letting go: a visit that checked never re-creates the layer of a
/// pod being deleted, nor meets an ADD's half-made one. `listed`: when `r` was read. A
/// directory unchanged since, or a record not written since (by its change time), is `r`
/// itself: one `fstat` or one `stat`, not a reading (an apply visits every pod on every
/// change: 100 readings were a millisecond).
pub(super) fn recorded(state: &StateDir, r: &Record, listed: &Listed) -> Result<(), PodError> {
    if listed.unchanged() {
        return Ok(());
    }
    let went = || PodError::Gone(format!("the record {} went (the pod's DEL)", r.key()));
    match state.record_changed_at(&r.network, &r.container_id, &r.ifname) {
        Ok(None) => return Err(went()),
        Ok(Some(at)) if at + FILE_CLOCK_MARGIN < listed.at => return Ok(()),
        _ => {}
    }
    match state.read(&r.network, &r.container_id, &r.ifname) {
        Ok(Some(now)) if now.netns_id == r.netns_id => Ok(()),
        Ok(Some(_)) => Err(PodError::Gone(format!("the record {} now names another netns (a new ADD)", r.key()))),
        Ok(None) => Err(went()),
        Err(u) => Err(PodError::Gone(format!("the record {} cannot be read: {}", r.key(), u.why))),
    }
}

/// Once `new` is stored (`previous`: what was stored before): every recorded pod brought to
/// it as `plan` says (a pod recorded since the plan was made: as `decide` says when it is
/// visited), reached through `pods`; run on a tour (`aether_netns::tour` or
/// `tour_here`: one thread entering each pod's netns in turn, as a thread per pod cost more
/// than the change it sends). Nothing is recorded in files: each pod's tables say what they
/// hold, and a visit killed midway leaves every pod with a whole layer, old or new.
pub(super) fn apply_to_pods(
    dir: &ServicesDir,
    (new, previous): (&StoredLayer, Option<&StoredLayer>),
    plan: &Plan,
    mut warnings: Vec<String>,
    pods: &mut dyn Pods,
) -> Result<ApplyReport, ServicesError> {
    let state = StateDir::new(&dir.state);
    let listed = Listed::now(&state);
    let records = pods.records(dir, &mut warnings);
    dir.sweep_legacy_files();
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
    let mut pass = Pass::new(dir, (new, previous), Walker::Apply);
    let node_mark = dir.divert_mark();
    let mut removed_keys = Vec::new();
    let mut outcomes = Vec::with_capacity(records.len());
    for (i, r) in records.iter().enumerate() {
        // The pod's lock is taken only before what no compare-and-swap guards (`visit`): an
        // element change or a rename waits for no ADD, DEL or repair of the pod.
        let locked = |ns: &Netns| still_recorded(&state, r, ns, &listed).map(Some);
        let result = pods.reach(i, r).and_then(|pod| pass.visit(pod, mark_of(r, node_mark), plan.get(r), &locked));
        if matches!(result, Ok(Applied::Removed(_))) {
            removed_keys.push(r.key());
        }
        outcomes.push(PodOutcome {
            container_id: r.container_id.clone(),
            ifname: r.ifname.clone(),
            netns: r.netns.clone(),
            result,
        });
    }
    let Pass { migrated, visited, .. } = pass;
    // The runs of pods no longer visited (gone) are let go.
    runs(dir, |r| r.retain(|k, _| visited.contains_key(k)));
    if migrated > 0 {
        warnings.push(format!(
            "{migrated} pod(s) held a Service layer a release before built: rebuilt in this release's shape, counters kept (a migration, once)"
        ));
    }
    if off {
        removed_keys.retain(|k| folded_keys.contains(k));
        dir.end_folding(&removed_keys)?;
    }
    Ok(ApplyReport { generation: new.generation, pods: outcomes, warnings })
}

/// Who walks: an apply over the node's pods, or one pod's own visit (`bring_pod`).
#[derive(Clone, Copy)]
enum Walker {
    /// Every rebuild and change checked against this process's memory limit first, and every
    /// rebuild after one of the node's build slots.
    Apply,
    /// No slot (ADD builds its own pod's layer without waiting for one, and after its answer
    /// holds one already); the memory check only when `charged` (not ADD's: it runs in the
    /// runtime's process, which no budget of ours covers).
    Pod { charged: bool },
}

impl Walker {
    /// Whether a rebuild or a change is checked against this process's memory limit first.
    fn charged(self) -> bool {
        matches!(self, Walker::Apply | Walker::Pod { charged: true })
    }

    /// Whether a rebuild takes one of the node's build slots first.
    fn slotted(self) -> bool {
        matches!(self, Walker::Apply)
    }
}

/// One apply's walk over the pods, or one pod's visit outside an apply (`bring_pod`).
struct Pass<'a> {
    new: &'a StoredLayer,
    previous: Option<&'a StoredLayer>,
    /// Who walks: whether the memory limit is checked and a build slot taken.
    walker: Walker,
    /// What is made once per divert mark in use (in practice one).
    marks: BTreeMap<u32, ForMark<'a>>,
    /// The previous and the new layer cut down to where they differ (`narrowed`), on first need.
    cut: Option<(layer::ServiceLayer, layer::ServiceLayer)>,
    /// Pods whose layer a release before built, rebuilt.
    migrated: usize,
    /// The run keys of the pods visited, with the mark each was brought to the new layer for
    /// (`None`: not brought).
    visited: HashMap<RunKey, Option<u32>>,
    dir: &'a ServicesDir,
}

impl<'a> Pass<'a> {
    fn new(dir: &'a ServicesDir, (new, previous): (&'a StoredLayer, Option<&'a StoredLayer>), walker: Walker) -> Self {
        let (marks, visited) = (BTreeMap::new(), HashMap::new());
        Pass { new, previous, walker, marks, cut: None, migrated: 0, visited, dir }
    }

    /// Brings one pod (its layer for `mark`) to the new layer as `planned` says (not
    /// planned: as `decide` says from what the link believes it holds); a transaction the
    /// kernel refuses (the pod holds something else) is decided again from what the kernel
    /// says, once. What the plan read is not read again: an element change or a rename is a
    /// compare-and-swap in the kernel, a rebuild takes whatever the pod holds, and a pod
    /// planned to hold the new layer already held the stored one (a new generation is stored
    /// only after the plan).
    ///
    /// `locked`: the pod's netns lock taken (`None`: the caller holds it), and whether the
    /// pod's record is still there once it is; asked once, and only before what no
    /// compare-and-swap guards: a rebuild, a removal, or a decision again after a refusal.
    /// The lock is then held to the visit's end. An element change or a rename is sent
    /// without it: the kernel refuses it whole when the pod holds anything else (a DEL
    /// removed the layer with the name it compares, an ADD has not made it yet), and a
    /// repair that holds the lock starts its own transaction from the name it read (the
    /// kernel refuses it when this change came first): the common visit waits for no one.
    fn visit(
        &mut self,
        pod: &mut dyn PodLink,
        mark: u32,
        planned: Option<Action>,
        locked: &dyn Fn(&Netns) -> Result<Option<aether_netns::NetnsLock>, PodError>,
    ) -> Result<Applied, PodError> {
        let mut lock = None;
        let mut asked = false;
        let mut lock_recorded = |ns: &Netns| -> Result<(), PodError> {
            if !asked {
                lock = locked(ns)?;
                asked = true;
            }
            Ok(())
        };
        let new = self.new;
        let key = run_key(pod.netns());
        // A netns that two attachments share (two networks' records) holds one layer: brought
        // once a pass. Its second visit would send the change the first one made already,
        // be refused, and wait for the pod's lock to decide again (an ADD of it may hold it).
        if *self.visited.entry(key).or_insert(None) == Some(mark) {
            return Ok(Applied::Unchanged);
        }
        let mut action = match planned {
            Some(planned) => planned,
            None => decide(&pod.held(false)?, self.previous, new, mark),
        };
        let mut fresh = false;
        let m = self.marks.entry(mark).or_insert_with(|| ForMark::new(new, mark));
        let named = HeldLayer::Named(new.named(mark));
        // Whether `elements` more fit what this process may still charge (always, uncharged).
        let charged = self.walker.charged();
        let charge = |elements| if charged { budget::pod_fits(elements) } else { Ok(()) };
        loop {
            let done: Option<(Result<Applied, PodError>, Sent)> = match (action, self.previous) {
                (Action::Remove, _) => {
                    lock_recorded(pod.netns())?;
                    let outcome = flat(pod.netns().run(|| layer::apply(m.layer())));
                    pod.believe(outcome.is_ok().then_some(HeldLayer::Absent));
                    runs(self.dir, |runs| runs.remove(&key));
                    return outcome;
                }
                (Action::Nothing, _) => Some((Ok(Applied::Unchanged), Sent::Nothing)),
                (Action::Rename(from), _) => {
                    let renamed = LayerChange::renamed(&new.layer.families(), &from, &new.named(mark)).encode();
                    pod.send(&renamed, false).ok().map(|_| (Ok(Applied::Unchanged), Sent::Rebuild))
                }
                (Action::Change, Some(prev)) => {
                    let (from, to) = self.cut.get_or_insert_with(|| narrowed(prev, new));
                    // Without a run to extend, the generation just before the change, so that one
                    // can start at it (one more request, only then).
                    let run = runs(self.dir, |runs| runs.get(&key).copied())
                        .filter(|run| Some(run.layer_generation) == self.previous.map(|p| p.generation));
                    match m.change(from, to) {
                        None => None,
                        // What it adds must fit what this process may still charge (else the pod
                        // keeps the whole layer it has).
                        Some((c, encoded)) => match charge(c.added() as u64) {
                            Err(over) => return Err(PodError::OverBudget(over)),
                            Ok(()) => {
                                let applied = Applied::Elements { added: c.added(), removed: c.removed() };
                                // `None` when refused: the pod does not hold what it was believed to.
                                pod.send(encoded, run.is_none())
                                    .ok()
                                    .map(|(before, after)| (Ok(applied), Sent::Change { before, after }))
                            }
                        },
                    }
                }
                (Action::Change | Action::Rebuild | Action::Migrate, _) => {
                    // The whole layer must fit what this process may still charge (else the
                    // pod keeps what it has).
                    lock_recorded(pod.netns())?;
                    let elements = budget::layer_elements(m.layer());
                    charge(elements).map_err(PodError::OverBudget)?;
                    if action == Action::Migrate {
                        self.migrated += 1;
                    }
                    // An apply's rebuilds take their turn with the builds after ADDs' answers
                    // (after the pod's lock, taken above); one pod's (`bring_pod`) is its caller's.
                    let _slot = self.walker.slotted().then(|| crate::state::BuildSlot::take(&self.dir.state));
                    Some((m.rebuild(pod.netns()), Sent::Rebuild))
                }
            };
            crate::state::crash_point("services-pod-sent");
            match done {
                Some((outcome, sent)) => {
                    match &outcome {
                        Ok(_) => {
                            pod.believe(Some(named));
                            self.visited.insert(key, Some(mark));
                            let before = runs(self.dir, |runs| runs.get(&key).map(|r| (r.first, r.last)));
                            match sent.run(before) {
                                Some((first, last)) if sent != Sent::Nothing => runs(self.dir, |runs| {
                                    let run =
                                        AppliedRun { layer_generation: new.generation, divert_mark: mark, first, last };
                                    runs.insert(key, run)
                                }),
                                Some(_) => None,
                                None => runs(self.dir, |runs| runs.remove(&key)),
                            };
                        }
                        Err(_) => pod.believe(None),
                    }
                    return outcome;
                }
                // Refused by the kernel (or no element change between these layers): decided
                // again from what the kernel says, once; then rebuilt.
                None if !fresh => {
                    lock_recorded(pod.netns())?;
                    fresh = true;
                    pod.believe(None);
                    let again = decide(&pod.held(true)?, self.previous, new, mark);
                    // The same refused transaction again would be refused again.
                    action = if again == action { Action::Rebuild } else { again };
                }
                None => action = Action::Rebuild,
            }
        }
    }
}

/// One pod outside an apply: what `bring_pod` is asked to do.
pub(super) struct OnePod<'a> {
    /// The stored layer the pod is brought to (mode `off` when none is stored: the pod then
    /// holds none).
    pub stored: &'a StoredLayer,
    pub mark: u32,
    /// What its tables hold, when known without reading them (ADD's new pod: `Absent`).
    pub held: Option<HeldLayer>,
    /// `services verify` and the reconciler's repairs: its elements compared with the stored
    /// layer, and brought there only when they differ (drift keeps a layer's name); the
    /// differences are returned. Else (ADD) what the decision says is done without a reading.
    pub check: bool,
    /// The layer for `mark`, when the caller has it made (ADD takes it from the stored one
    /// rather than copy 20,000 ports).
    pub layer: Option<layer::ServiceLayer>,
    /// Checked against this process's memory limit before a rebuild (see `Walker::charged`).
    pub charged: bool,
}

/// What `bring_pod` did to a pod.
pub(super) struct Brought {
    /// What its tables said they held, and what it got.
    pub held: HeldLayer,
    pub action: Action,
    /// The differences found before (only when checked).
    pub differences: Vec<String>,
    /// What was sent (`None`: nothing, it held the layer).
    pub applied: Option<Applied>,
    /// The bytes of the layer's creation, as sent to a pod that holds none, and the number of
    /// sequence numbers they use (when a rebuild made them): what ADD keeps for the next pod.
    pub created: Option<(Vec<u8>, u32)>,
}

/// One pod brought to the stored layer outside an apply (ADD, `services verify`, a
/// reconciler's repair), in its netns `ns`: the one decision (`plan::decide`, no layer before
/// the stored one), carried out by an apply's own visit (`Pass::visit`). With `check`, a pod
/// whose tables name the stored layer (or its content under another generation) is compared
/// element by element and repaired in place where it differs; a layer a release before built
/// is rebuilt, counted as a migration, its differences not drift. The caller holds the pod's
/// netns lock.
pub(super) fn bring_pod(dir: &ServicesDir, ns: &Netns, one: OnePod) -> Result<Brought, PodError> {
    let OnePod { stored, mark, held, check, layer: made, charged } = one;
    let held = match held {
        Some(h) => h,
        None => flat(ns.run(layer::held))?,
    };
    let action = decide(&held, None, stored, mark);
    let mut pass = Pass::new(dir, (stored, None), Walker::Pod { charged });
    let m = pass.marks.entry(mark).or_insert_with(|| ForMark::new(stored, mark));
    if let Some(l) = made {
        m.layer = Some(l);
    }
    let mut differences = Vec::new();
    if check && action != Action::Migrate {
        differences = flat(ns.run(|| layer::verify(m.layer())))?;
        if differences.is_empty() {
            return Ok(Brought { held, action: Action::Nothing, differences, applied: None, created: None });
        }
        if matches!(action, Action::Nothing | Action::Rename(_)) {
            // Named as the stored layer, its elements not: repaired where they differ.
            let applied = flat(ns.run(|| layer::apply(m.layer())))?;
            return Ok(Brought { held, action, differences, applied: Some(applied), created: None });
        }
    }
    // The caller holds the pod's lock and knows it recorded (or, ADD, is recording it).
    let applied = pass.visit(&mut InPlace(ns), mark, Some(action), &|_| Ok(None))?;
    let created = pass.marks.get_mut(&mark).and_then(ForMark::created);
    let applied = (action != Action::Nothing).then_some(applied);
    Ok(Brought { held, action, differences, applied, created })
}

/// `attempt` (a `bring_pod` to the layer stored when it runs; told its try, 0 first), again
/// while an apply's change (no pod lock) moved the pod's layer between the reading and the
/// transaction (`LayerMoved`), `MOVED_TRIES` more times at most (each move is an apply
/// storing a newer layer: more in a row is one every few ms): ADD's and a repair's rule.
pub(super) fn bring_while_moved<T>(
    mut attempt: impl FnMut(usize) -> Result<Result<T, PodError>, ServicesError>,
) -> Result<T, ServicesError> {
    let mut tries = 0;
    loop {
        match attempt(tries)? {
            Err(PodError::Kernel(aether_rules::Error::LayerMoved { named })) if tries < MOVED_TRIES => {
                tracing::info!(%named, "the pod's Service layer changed since it was read (an apply came first): brought again from what it holds now");
                tries += 1
            }
            done => return Ok(done?),
        }
    }
}

const MOVED_TRIES: usize = 3;

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

    /// The pod's layer rebuilt, in its netns, its counters carried over.
    fn rebuild(&mut self, ns: &Netns) -> Result<Applied, PodError> {
        self.layer();
        let l = self.layer.as_ref().expect("made above");
        match self.prepared.get_or_insert_with(|| layer::Prepared::new(l).ok().flatten()) {
            Some(p) => flat(ns.run(|| {
                let held = layer::Held::read()?;
                crate::state::pause_point("services-rebuild-read");
                p.rebuild_from(held)
            })),
            None => flat(ns.run(|| layer::rebuild(l))),
        }
    }

    /// The bytes of the layer's creation (as a rebuild sends them to a pod that holds none)
    /// and the sequence numbers they use, once a rebuild prepared them.
    fn created(&mut self) -> Option<(Vec<u8>, u32)> {
        let (bytes, seq_count) = self.prepared.as_ref()?.as_ref()?.create().bytes_at_zero();
        Some((bytes.to_vec(), seq_count))
    }
}

mod narrow;
pub(super) use narrow::{narrowed, note_touched};

#[cfg(test)]
mod tests;
