//! The plan: what each recorded pod gets once a layer is stored, decided once per apply, in
//! one place (`decide`, pure), from what each pod's tables say they hold. The apply makes it
//! before it stores anything, checks the budget on it (`Plan::tally`), and the engine carries
//! it out; no caller decides a pod's layer another way. Nothing here reads the kernel or a file.

use std::collections::HashMap;

use aether_rules::services::{self as layer, HeldLayer, Named};

use super::StoredLayer;
use crate::state::Record;

/// What a pod gets once `new` is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    /// It holds the new layer for its mark already: nothing is sent.
    Nothing,
    /// It holds the new content under another generation (`from`): only the name swapped.
    Rename(Named),
    /// It holds the previous layer for its mark: the element change from it, the name
    /// swapped with it (rebuilt if the kernel refuses it: the pod holds something else).
    Change,
    /// The whole layer, counters carried over: it holds another layer or mark, or none.
    Rebuild,
    /// The whole layer in place of one a release before built (a shape, or tables that name
    /// nothing): an upgrade's work, counted as a migration.
    Migrate,
    /// Mode `off`: its tables removed (their counts folded into the node's first).
    Remove,
}

/// The one decision, for every caller: what a pod gets, from what its tables say they hold
/// (`held`), the previous and the new stored layer, and the pod's divert mark (`mark_of` its
/// record).
pub(super) fn decide(held: &HeldLayer, previous: Option<&StoredLayer>, new: &StoredLayer, mark: u32) -> Action {
    if new.layer.mode == layer::LayerMode::Off {
        return Action::Remove;
    }
    let n = match held {
        HeldLayer::Absent => return Action::Rebuild,
        HeldLayer::Unnamed { .. } => return Action::Migrate,
        HeldLayer::Named(n) if n.shape != layer::SHAPE => return Action::Migrate,
        HeldLayer::Named(n) => n,
    };
    if *n == new.named(mark) {
        Action::Nothing
    } else if n.divert_mark == mark && n.id.digest == new.digest {
        Action::Rename(*n)
    } else if previous.is_some_and(|p| *n == p.named(mark)) {
        Action::Change
    } else {
        Action::Rebuild
    }
}

/// The divert mark a pod's layer matches: the one its own capture sets, else the node's.
pub(super) fn mark_of(r: &Record, node_mark: u32) -> u32 {
    r.capture.as_ref().map_or(node_mark, |c| c.divert_mark)
}

/// A recorded netns's identity (device, inode, cookie), as a key.
type NetnsKey = (u64, u64, Option<u64>);

/// An apply's plan, by attachment (its record's key and netns): made before the layer is
/// stored, from the records listed then. A pod recorded since (an ADD meanwhile) is not in
/// it and is decided when visited, by the same `decide`.
#[derive(Debug, Default)]
pub(super) struct Plan {
    /// By netns, then by record key (`Record::key`): found again without a key made per
    /// visit.
    pods: HashMap<Option<NetnsKey>, Vec<(String, Action)>>,
}

/// How many pods get each action.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Tally {
    pub nothing: usize,
    pub renamed: usize,
    pub changed: usize,
    pub rebuilt: usize,
    pub migrated: usize,
    pub removed: usize,
}

impl Plan {
    /// The plan for `records`: each pod's action from what `held_of` says its tables hold
    /// (`None`: gone or unreadable, left out: its visit says so).
    pub fn make(
        records: &[Record],
        node_mark: u32,
        previous: Option<&StoredLayer>,
        new: &StoredLayer,
        mut held_of: impl FnMut(usize, &Record) -> Option<HeldLayer>,
    ) -> Plan {
        let mut pods: HashMap<Option<NetnsKey>, Vec<(String, Action)>> = HashMap::new();
        for (i, r) in records.iter().enumerate() {
            if let Some(held) = held_of(i, r) {
                let action = decide(&held, previous, new, mark_of(r, node_mark));
                pods.entry(Self::netns(r)).or_default().push((r.key(), action));
            }
        }
        Plan { pods }
    }

    fn netns(r: &Record) -> Option<NetnsKey> {
        r.netns_id.map(|id| (id.dev, id.ino, id.cookie))
    }

    /// Whether `key` is `r.key()` (compared in place, not made again).
    fn is_key_of(key: &str, r: &Record) -> bool {
        let rest = key.strip_prefix(r.network.as_str()).and_then(|k| k.strip_prefix('/'));
        let rest = rest.and_then(|k| k.strip_prefix(r.container_id.as_str())).and_then(|k| k.strip_prefix('/'));
        rest == Some(r.ifname.as_str())
    }

    /// What the pod of `r` gets, if it was planned (the same attachment in the same netns).
    pub fn get(&self, r: &Record) -> Option<Action> {
        let planned = self.pods.get(&Self::netns(r))?;
        planned.iter().find(|(key, _)| Self::is_key_of(key, r)).map(|&(_, action)| action)
    }

    pub fn tally(&self) -> Tally {
        let mut t = Tally::default();
        for (_, action) in self.pods.values().flatten() {
            *match action {
                Action::Nothing => &mut t.nothing,
                Action::Rename(_) => &mut t.renamed,
                Action::Change => &mut t.changed,
                Action::Rebuild => &mut t.rebuilt,
                Action::Migrate => &mut t.migrated,
                Action::Remove => &mut t.removed,
            } += 1;
        }
        t
    }
}

impl Tally {
    /// The elements the plan adds to the kernel: `change` for each pod that gets the element
    /// change, `whole` for each rebuilt or migrated (each asked only when some pod needs it).
    pub fn elements(&self, change: impl FnOnce() -> u64, whole: impl FnOnce() -> u64) -> u64 {
        let c = if self.changed > 0 { self.changed as u64 * change() } else { 0 };
        let rebuilt = (self.rebuilt + self.migrated) as u64;
        c + if rebuilt > 0 { rebuilt * whole() } else { 0 }
    }
}

#[cfg(test)]
mod tests;
