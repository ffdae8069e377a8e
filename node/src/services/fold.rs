//! Counts of removed layers: `accumulator.json` keeps the node totals from going backwards
//! when pods go, folded idempotently so a process killed mid-way loses and doubles nothing.

use std::collections::BTreeMap;
use std::path::Path;

use aether_netns::Netns;
use aether_rules::services as layer;
use serde_json::Value;

use super::{flat, ServicesDir, ServicesError};
use crate::state;

/// Why retiring a pod's layer failed: the caller's `forget`.
#[derive(Debug, thiserror::Error)]
pub enum RetireError<E> {
    #[error(transparent)]
    Forget(E),
    /// A test asked this step to fail (fault-injection builds only).
    #[error("injected failure at step {0}")]
    Injected(&'static str),
}

impl ServicesDir {
    /// The folded counts of removed layers. Missing means none yet; unreadable is an error,
    /// never "zero": overwriting it would make the node totals go backwards for good.
    pub(super) fn accumulator(&self) -> Result<Accumulator, ServicesError> {
        let path = self.root.join("accumulator.json");
        match self.read("accumulator.json")? {
            Some(d) => Accumulator::parse(&d).map_err(|source| ServicesError::Accumulator { path, source }),
            None => Ok(Accumulator::default()),
        }
    }

    fn store(&self, acc: &Accumulator) -> Result<(), ServicesError> {
        self.write_atomic("accumulator.json", &serde_json::to_vec_pretty(acc).expect("counts serialize"))
    }

    /// The lock of `accumulator.json`'s read-modify-writes (`counts.lock`), held only around
    /// them: never across a kernel's work, never the apply's lock, so a DEL folding its pod
    /// waits for no apply and no other pod's removal, only another fold's file write.
    pub(super) fn counts_lock(&self) -> Result<state::Lock, ServicesError> {
        let dir = self.open(true)?.expect("created");
        dir.lock(COUNTS_LOCK, true, None)
            .map_err(|source| ServicesError::Lock { path: self.root.join(COUNTS_LOCK), source })
    }

    /// `accumulator.json`'s identity: readers that add live pods to it read it again after,
    /// and start over when a fold replaced it meanwhile (`report::node_counters`).
    pub(super) fn accumulator_id(&self) -> Option<super::FileId> {
        super::FileId::of(&self.root.join("accumulator.json"))
    }

    /// Folds each pod's current `counts` into the node totals, idempotently: only what grew
    /// since the pod's last fold is added, and the pod stays marked as folding (so readers
    /// subtract what is already in the totals) until [`ServicesDir::end_folding`]. A process
    /// killed after this and before the layer is removed therefore loses and doubles nothing;
    /// run again, it adds only the growth. Returns what was added, per pod.
    pub(super) fn fold_pods(
        &self,
        pods: &[(String, BTreeMap<String, u64>)],
    ) -> Result<Vec<BTreeMap<String, u64>>, ServicesError> {
        let _lock = self.counts_lock()?;
        let mut acc = self.accumulator()?;
        let mut added = Vec::new();
        for (key, counts) in pods {
            let before = acc.folding.get(key).cloned().unwrap_or_default();
            let mut delta = BTreeMap::new();
            for (k, v) in counts {
                let d = v.saturating_sub(before.get(k).copied().unwrap_or(0));
                *acc.totals.entry(k.clone()).or_default() += d;
                delta.insert(k.clone(), d);
            }
            acc.folding.insert(key.clone(), counts.clone());
            added.push(delta);
        }
        self.store(&acc)?;
        Ok(added)
    }

    /// Ends the folding of pods whose layers are gone.
    pub(super) fn end_folding(&self, keys: &[String]) -> Result<(), ServicesError> {
        let _lock = self.counts_lock()?;
        let mut acc = self.accumulator()?;
        let before = acc.folding.len();
        for k in keys {
            acc.folding.remove(k);
        }
        if acc.folding.len() != before {
            self.store(&acc)?;
        }
        Ok(())
    }
}

/// The lock file of `accumulator.json`'s updates.
const COUNTS_LOCK: &str = "counts.lock";

/// `accumulator.json`: the node totals of layers that are gone, and the pods being retired.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub(super) struct Accumulator {
    pub(super) totals: BTreeMap<String, u64>,
    /// Per attachment key: the counts already in `totals` while its layer is being removed.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(super) folding: BTreeMap<String, BTreeMap<String, u64>>,
}

impl Accumulator {
    /// Reads this format, or the flat `{counter: n}` map of earlier releases.
    fn parse(d: &[u8]) -> Result<Self, serde_json::Error> {
        let v: Value = serde_json::from_slice(d)?;
        if v.get("totals").is_some() {
            serde_json::from_value(v)
        } else {
            Ok(Accumulator { totals: serde_json::from_value(v)?, folding: BTreeMap::new() })
        }
    }

    /// What a live pod adds to the node totals: its counts less what is already folded.
    pub(super) fn live_part(&self, key: &str, counts: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
        let folded = self.folding.get(key);
        counts
            .iter()
            .map(|(k, v)| (k.clone(), v.saturating_sub(folded.and_then(|f| f.get(k)).copied().unwrap_or(0))))
            .collect()
    }
}

/// For ADD, before `apply_current_snapshot_in_netns`, holding the pod's netns lock: ends the
/// folding mark of attachment `key` if a DEL killed after removing its layer left one and no
/// layer is there now. The
/// layer ADD makes counts from zero; with the old mark still there, readers would subtract
/// the old pod's folded counts from the new one's (a runtime re-ADDs the same container, e.g.
/// podman's network reload: DEL then ADD). Costs one small read when there is no mark.
pub fn end_stale_fold(state_dir: &Path, netns: &Netns, key: &str) -> Result<(), ServicesError> {
    let dir = ServicesDir::new(state_dir);
    if !dir.accumulator().is_ok_and(|a| a.folding.contains_key(key)) {
        return Ok(());
    }
    if matches!(netns.run(layer::counters), Ok(Ok(None))) {
        dir.end_folding(&[key.to_string()])?;
    }
    Ok(())
}

/// What DEL (or GC) did to a pod's Service layer.
#[derive(Debug, Default)]
pub struct Retired {
    /// The pod's final counts, now in the node accumulator.
    pub folded: BTreeMap<String, u64>,
    /// What went wrong without stopping the pod's deletion (logged by the caller).
    pub warnings: Vec<String>,
}

/// For DEL and GC, in the host netns, holding the pod's netns lock (`Netns::lock`): folds
/// the pod's final counts into the node totals, removes its layer, and runs `forget` (which
/// removes the attachment record). An apply visits a pod only holding the same lock, and only
/// while its record is still there (`engine`), so it either visited before (and its layer is
/// removed here) or after (and finds no record): it never re-creates a layer in a pod being
/// deleted. No lock of the whole node is held: a drain's DELs run side by side, and none
/// waits for an apply.
///
/// Fold first, idempotently ([`ServicesDir::fold_pods`], keyed by the attachment `key`),
/// then remove: killed at any point, no count is lost or counted twice, and a retried DEL
/// finishes the job. `netns` is `None` when the pod's netns is already gone: nothing to fold.
/// Only `forget` can fail the call (and, in a fault-injection build, a test's
/// `AETHER_CNI_INJECT_FAILURE=del-folded`: after the fold, before the layer is removed); a count or a layer that cannot be read or
/// removed must not keep a pod from being deleted, so it is reported in `warnings`.
pub fn retire_layer<E>(
    state_dir: &Path,
    netns: Option<&Netns>,
    key: &str,
    forget: impl FnOnce() -> Result<(), E>,
) -> Result<Retired, RetireError<E>> {
    let dir = ServicesDir::new(state_dir);
    let mut out = Retired::default();
    if let Some(ns) = netns {
        match flat(ns.run(layer::counters)) {
            Ok(Some(counts)) => match dir.fold_pods(&[(key.to_string(), counts.clone())]) {
                Ok(mut added) => out.folded = added.pop().unwrap_or_default(),
                Err(e) => out
                    .warnings
                    .push(format!("the pod's Service counts ({}) are lost: {e}", crate::text::counts(&counts))),
            },
            Ok(None) => {}
            Err(e) => out.warnings.push(format!("cannot read the pod's Service counters: {e}")),
        }
        state::crash_point("del-folded");
        if state::fails_here("del-folded") {
            return Err(RetireError::Injected("del-folded"));
        }
        if let Err(e) = flat(ns.run(layer::remove)) {
            out.warnings.push(format!("cannot remove the pod's Service layer: {e}"));
        }
        state::crash_point("del-layer-removed");
    }
    if let Err(e) = dir.end_folding(&[key.to_string()]) {
        out.warnings.push(format!("the pod's folded counts stay marked: {e}"));
    }
    forget().map_err(RetireError::Forget)?;
    Ok(out)
}
