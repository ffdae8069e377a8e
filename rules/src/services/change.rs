//! The change between two Service layers: what an apply sends a pod that holds the previous
//! generation, computed from the models alone. Set elements, and profile chains added or
//! removed whole (a chain's name is its profile, so a chain of one name is the same chain).

use super::{services_tables, Applied, ServiceLayer, CHAIN_BY_KEY, PROFILE_CHAIN_PREFIX, TABLE};
use crate::error::Result;
use crate::family::Family;
use crate::model::{Chain, Element, Set, SetData, Table};
use crate::nft;

fn is_identity(counter: &str) -> bool {
    super::Named::parse(counter).is_some()
}

/// The name of the identity counter of a table, if it has one.
fn identity_of(t: &Table) -> Option<&String> {
    t.counters.iter().find(|c| is_identity(c))
}

/// Whether a chain of the layer is a profile chain (which a change may add or remove).
fn is_profile_chain(c: &Chain) -> bool {
    c.name.starts_with(PROFILE_CHAIN_PREFIX) && c.name != CHAIN_BY_KEY
}

/// The set elements and profile chains that turn the layer for `old` into the layer for
/// `new`, computed from the models alone (no kernel involved), once per apply for every pod
/// that holds `old`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LayerChange {
    pub(super) changes: Vec<(Family, nft::TableChange)>,
}

impl LayerChange {
    /// The change between two layers, or `None` when more than the elements of hash sets and
    /// the profile chains differ (a new range, family, timeout or mark, a mode `off`): those
    /// pods are rebuilt.
    pub fn between(old: &ServiceLayer, new: &ServiceLayer) -> Result<Option<LayerChange>> {
        let (old, new) = (services_tables(old)?, services_tables(new)?);
        let families = |t: &[Table]| t.iter().map(|t| t.family).collect::<Vec<_>>();
        if old.is_empty() || families(&old) != families(&new) {
            return Ok(None);
        }
        // The tables alike but for their elements, the verdict map's chain list and the profile
        // chains (compared without copying the chains: a cut layer keeps every profile chain
        // of its whole layer's decision).
        let bare_sets = |t: &Table| -> Vec<Set> {
            t.sets
                .iter()
                .map(|s| {
                    let mut s = Set { elements: Vec::new(), ..s.clone() };
                    if let SetData::Goto(chains) = &mut s.data {
                        chains.clear();
                    }
                    s
                })
                .collect()
        };
        fn fixed(t: &Table) -> impl Iterator<Item = &Chain> {
            t.chains.iter().filter(|c| !is_profile_chain(c))
        }
        fn profiles(t: &Table) -> Vec<&Chain> {
            t.chains.iter().filter(|c| is_profile_chain(c)).collect()
        }
        // The class counters (the identity's name is the one counter a change swaps).
        let classes = |t: &Table| -> Vec<String> { t.counters.iter().filter(|c| !is_identity(c)).cloned().collect() };
        let alike = |a: &Table, b: &Table| {
            (a.family, &a.name, classes(a)) == (b.family, &b.name, classes(b))
                && fixed(a).eq(fixed(b))
                && bare_sets(a) == bare_sets(b)
        };
        let mut out = Vec::new();
        for (old, new) in old.iter().zip(&new) {
            if !alike(old, new) {
                return Ok(None);
            }
            let (was, will) = (profiles(old), profiles(new));
            let mut change = nft::TableChange {
                add_chains: will.iter().filter(|c| !was.iter().any(|o| o.name == c.name)).map(|&c| c.clone()).collect(),
                delete_chains: was
                    .iter()
                    .filter(|c| !will.iter().any(|n| n.name == c.name))
                    .map(|c| c.name.clone())
                    .collect(),
                elements: Vec::new(),
                ..Default::default()
            };
            // What the table says it holds, swapped: refused by the kernel, whole, when the
            // pod's table names anything but `old` (both named: a layer without a name, as the
            // rules' own tests build, is changed as it always was).
            let (was_named, will_named) = (identity_of(old), identity_of(new));
            if let (Some(was), Some(will)) = (was_named, will_named) {
                if was != will {
                    change.counters_gone.push(was.clone());
                    change.counters_new.push(will.clone());
                }
            }
            let changes = &mut change.elements;
            for (o, n) in old.sets.iter().zip(&new.sets) {
                // A verdict map's elements compare by number and chain name (their chain
                // indices are of each layer's own list); a data map's by address and number.
                if o.timeout_secs.is_some() || (o.elements == n.elements && o.data == n.data) {
                    continue;
                }
                if o.interval {
                    return Ok(None);
                }
                // Both sorted and without duplicates (built from ordered sets).
                let (delete, add) = sorted_difference(&o.elements, &n.elements, |a, b| match (a, b) {
                    (Element::Goto(x, i), Element::Goto(y, j)) => {
                        x.cmp(y).then_with(|| o.data.chains()[usize::from(*i)].cmp(&n.data.chains()[usize::from(*j)]))
                    }
                    _ => a.cmp(b),
                });
                changes.push(nft::ElementChange {
                    set: o.name.clone(),
                    delete: nft::set_keys(o, &delete),
                    add: nft::set_keys(n, &add),
                });
            }
            if !change.is_empty() {
                out.push((old.family, change));
            }
        }
        Ok(Some(LayerChange { changes: out }))
    }

    /// The change that only renames the tables of `families` (`ServiceLayer::families`) from
    /// `from` to `to`: for a pod that holds the content of `to` under another generation.
    /// Refused whole when a table does not name `from`.
    pub fn renamed(families: &[Family], from: &super::Named, to: &super::Named) -> LayerChange {
        let changes = families
            .iter()
            .map(|&f| {
                let change = nft::TableChange {
                    counters_gone: vec![from.counter_name()],
                    counters_new: vec![to.counter_name()],
                    ..Default::default()
                };
                (f, change)
            })
            .collect();
        LayerChange { changes }
    }

    pub fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }

    /// Set elements added.
    pub fn added(&self) -> usize {
        self.changes.iter().flat_map(|(_, c)| &c.elements).map(|c| c.add.len()).sum()
    }

    /// Set elements removed.
    pub fn removed(&self) -> usize {
        self.changes.iter().flat_map(|(_, c)| &c.elements).map(|c| c.delete.len()).sum()
    }

    /// The change's transaction, encoded once: what a minimal sender (the bench's floor)
    /// sends to each netns.
    pub fn encode(&self) -> nft::Encoded {
        nft::encode_table_changes(TABLE, &self.changes)
    }

    /// `send`, already encoded (`encode`), on a socket kept in the pod's netns; with the
    /// netns's ruleset generation right after the transaction, when read (`None` too when
    /// nothing was sent).
    pub fn send_encoded_on(
        &self,
        encoded: &nft::Encoded,
        sock: &mut nft::KeptSocket,
    ) -> Result<(Applied, Option<u32>)> {
        if self.is_empty() {
            return Ok((Applied::Unchanged, None));
        }
        let generation = encoded.send_on(sock)?;
        Ok((Applied::Elements { added: self.added(), removed: self.removed() }, generation))
    }

    /// Sends the change to the layer in the current netns, in one transaction, without
    /// reading anything back. The kernel refuses all of it if the layer does not hold what
    /// the change starts from where it matters (a table or a deleted element missing): the
    /// caller then rebuilds.
    pub fn send(&self) -> Result<Applied> {
        if self.is_empty() {
            return Ok(Applied::Unchanged);
        }
        nft::change_tables(TABLE, &self.changes)?;
        Ok(Applied::Elements { added: self.added(), removed: self.removed() })
    }
}

/// (in `a` only, in `b` only) of two sorted lists without duplicates, `cmp` comparing an
/// element of `a` with one of `b`.
fn sorted_difference<T: Clone>(a: &[T], b: &[T], cmp: impl Fn(&T, &T) -> std::cmp::Ordering) -> (Vec<T>, Vec<T>) {
    let (mut only_a, mut only_b) = (Vec::new(), Vec::new());
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        match (a.get(i), b.get(j)) {
            (Some(x), Some(y)) if cmp(x, y).is_eq() => {
                i += 1;
                j += 1;
            }
            (Some(x), Some(y)) if cmp(x, y).is_lt() => {
                only_a.push(x.clone());
                i += 1;
            }
            (Some(_), Some(y)) => {
                only_b.push(y.clone());
                j += 1;
            }
            (Some(x), None) => {
                only_a.push(x.clone());
                i += 1;
            }
            (None, Some(y)) => {
                only_b.push(y.clone());
                j += 1;
            }
            (None, None) => unreachable!(),
        }
    }
    (only_a, only_b)
}
