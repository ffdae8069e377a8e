//! What a pod's layer says it holds: the stored layer's name (`Named`), written as a counter
//! object in each of the layer's tables and swapped by every change in the same transaction
//! as its elements, and read back from the kernel (`held`).

use super::{held_shape, ServiceLayer, SHAPE, TABLE};
use crate::error::Result;
use crate::family::Family;
use crate::nft;

/// The node's name for a stored layer's content: its generation and content digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LayerId {
    pub generation: u64,
    pub digest: u64,
}

/// What a layer's tables say they hold: the shape they were built in, the stored layer, and
/// the divert mark they classify. Written as the name of a counter object in each table
/// (`layer_s3_g100_mae71_d0123456789abcdef`), so the record of what a pod holds is the pod's
/// own table, changed in the same transaction as every element it holds: an element change
/// deletes the name it starts from and adds the one it ends at, and the kernel aborts the
/// whole transaction when the pod holds anything else (a compare-and-swap).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Named {
    pub shape: u64,
    pub id: LayerId,
    pub divert_mark: u32,
}

/// The identity counter's name starts so (the layer's counters are class names).
const IDENTITY_PREFIX: &str = "layer_s";

impl Named {
    pub fn counter_name(&self) -> String {
        format!(
            "{IDENTITY_PREFIX}{}_g{}_m{:x}_d{:016x}",
            self.shape, self.id.generation, self.divert_mark, self.id.digest
        )
    }

    /// The name `counter_name` wrote; `None` for any other counter.
    pub fn parse(name: &str) -> Option<Named> {
        let mut f = name.strip_prefix(IDENTITY_PREFIX)?.split('_');
        let shape = f.next()?.parse().ok()?;
        let generation = f.next()?.strip_prefix('g')?.parse().ok()?;
        let divert_mark = u32::from_str_radix(f.next()?.strip_prefix('m')?, 16).ok()?;
        let digest = f.next()?.strip_prefix('d')?;
        let digest = (digest.len() == 16).then(|| u64::from_str_radix(digest, 16).ok()).flatten()?;
        f.next().is_none().then_some(Named { shape, id: LayerId { generation, digest }, divert_mark })
    }
}

impl std::fmt::Display for Named {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "generation {} (digest {:016x}, shape {}, mark {:#x})",
            self.id.generation, self.id.digest, self.shape, self.divert_mark
        )
    }
}

/// What the Service layer of a netns says it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeldLayer {
    /// No layer table.
    Absent,
    /// Tables that name what they hold, alike in every family.
    Named(Named),
    /// Tables that name nothing (built by a release before names, in `shape`; `None` when
    /// the shape is not one this release knows), or whose families name different layers.
    Unnamed { shape: Option<u64> },
}

impl HeldLayer {
    /// From the counter names of each family's table (empty: no table): what they hold, and
    /// the older names an applier's change left beside it in every table (`left_behind`).
    /// `None` when a table names nothing, names two layers of its newest generation, or the
    /// families' newest names differ.
    fn of<'a>(tables: impl IntoIterator<Item = Vec<&'a str>>) -> Option<(HeldLayer, Vec<Named>)> {
        let mut held = HeldLayer::Absent;
        let mut older: Option<Vec<Named>> = None;
        for names in tables {
            if names.is_empty() {
                continue;
            }
            let mut named: Vec<Named> = names.iter().filter_map(|n| Named::parse(n)).collect();
            named.sort_by_key(|n| n.id.generation);
            let newest = named.pop()?;
            if named.last().is_some_and(|n| n.id.generation == newest.id.generation) {
                return None;
            }
            match held {
                HeldLayer::Absent => held = HeldLayer::Named(newest),
                h if h == HeldLayer::Named(newest) => {}
                _ => return None,
            }
            older = Some(match older {
                None => named,
                Some(o) => o.into_iter().filter(|n| named.contains(n)).collect(),
            });
        }
        Some((held, older.unwrap_or_default()))
    }
}

/// The names a change left beside the one it made: a change that deletes nothing else, sent
/// guarded by the netns's ruleset generation (which is then the whole compare), creates the
/// new name without deleting the one it starts from, so that its transaction deletes nothing
/// and wakes no kernel worker (nf_tables frees what a commit deleted in a work item on the
/// committing core). The table's newest name is what it holds; an older one is deleted by the
/// pod's next transaction that deletes anything, and is never taken for drift.
pub const LEFT_BEHIND_AT_MOST: usize = 1;

/// What the current netns's Service layer says it holds: one dump of each family's counter
/// objects (read anyway by a rebuild, which carries the counts over).
pub fn held() -> Result<HeldLayer> {
    let counts = nft::counters_each(&Family::ALL, TABLE)?;
    Ok(held_of(&counts, held_shape)?.0)
}

/// `held`, read on a socket kept in the netns (the shape of tables that name nothing is not
/// read: `Unnamed { shape: None }`), with the older names left beside the newest in every
/// table (`LEFT_BEHIND_AT_MOST`).
pub fn held_on(sock: &mut nft::KeptSocket) -> Result<(HeldLayer, Vec<Named>)> {
    let counts = sock.counters_each(&Family::ALL, TABLE)?;
    held_of(&counts, || Ok(None))
}

fn held_of(counts: &[nft::Counts], shape: impl FnOnce() -> Result<Option<u64>>) -> Result<(HeldLayer, Vec<Named>)> {
    match HeldLayer::of(counts.iter().map(|c| c.keys().map(String::as_str).collect())) {
        Some(h) => Ok(h),
        // Tables that name nothing: their shape, from their sets (a second small dump, only
        // for a layer an earlier release built).
        None => Ok((HeldLayer::Unnamed { shape: shape()? }, Vec::new())),
    }
}

/// The view of a layer's table without the older names left beside `named` (when the table
/// holds `named`): what is compared with the stored layer, where they are not drift.
pub(super) fn without_left_behind(view: &mut nft::read::TableView, named: &str) {
    if view.counters.contains_key(named) {
        view.counters.retain(|n, _| !left_behind_by(n, named));
    }
}

/// Whether a table whose identity names are `names` holds `named` and at most older names
/// left beside it.
pub(super) fn holds(names: &[String], named: &str) -> bool {
    names.iter().any(|n| n == named) && names.iter().all(|n| n == named || left_behind_by(n, named))
}

/// Whether `name` is an identity name older than `named`'s.
fn left_behind_by(name: &str, named: &str) -> bool {
    match (Named::parse(name), Named::parse(named)) {
        (Some(o), Some(n)) => o.id.generation < n.id.generation,
        _ => false,
    }
}

/// The name of the counter that says which layer the tables hold, when the layer has one.
pub fn identity_counter(layer: &ServiceLayer) -> Option<String> {
    let id = layer.identity?;
    Some(Named { shape: SHAPE, id, divert_mark: layer.divert_mark }.counter_name())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(generation: u64, digest: u64) -> String {
        Named { shape: SHAPE, id: LayerId { generation, digest }, divert_mark: 0xae71 }.counter_name()
    }

    /// What a layer's tables hold, and the names left behind, from their counter names: the
    /// newest name is what they hold; older names left in every table are the left-behind.
    #[test]
    fn the_newest_name_is_what_the_tables_hold() {
        let (g7, g8, g8b, g9) = (name(7, 1), name(8, 2), name(8, 3), name(9, 4));
        let held = |g, d| {
            HeldLayer::Named(Named { shape: SHAPE, id: LayerId { generation: g, digest: d }, divert_mark: 0xae71 })
        };
        let older = |n: &[(u64, u64)]| -> Vec<Named> {
            n.iter()
                .map(|&(g, d)| Named { shape: SHAPE, id: LayerId { generation: g, digest: d }, divert_mark: 0xae71 })
                .collect()
        };
        #[rustfmt::skip]
        let table: Vec<(&str, Vec<Vec<&str>>, Option<(HeldLayer, Vec<Named>)>)> = vec![
            ("no table",                           vec![vec![], vec![]],                             Some((HeldLayer::Absent, vec![]))),
            ("one name",                           vec![vec!["mesh", &g7]],                          Some((held(7, 1), vec![]))),
            ("a name left behind",                 vec![vec![&g8, "mesh", &g7]],                     Some((held(8, 2), older(&[(7, 1)])))),
            ("two names of the newest generation", vec![vec![&g8, &g8b, &g7]],                       None),
            ("no name",                            vec![vec!["mesh", "service"]],                    None),
            ("both families, the same",            vec![vec![&g7, &g8], vec![&g8, &g7]],             Some((held(8, 2), older(&[(7, 1)])))),
            ("left in one family only",            vec![vec![&g7, &g8], vec![&g8]],                  Some((held(8, 2), vec![]))),
            ("families naming different layers",   vec![vec![&g8], vec![&g9]],                       None),
        ];
        for (case, tables, want) in table {
            let got = HeldLayer::of(tables.iter().map(|t| t.iter().map(|s| s as &str).collect::<Vec<&str>>()));
            assert_eq!(got, want, "{case}");
        }
        // What a comparison leaves out: names older than the held one, never a newer one.
        assert!(holds(&[g7.clone(), g8.clone()], &g8));
        assert!(!holds(&[g8.clone(), g9.clone()], &g8), "a newer name is not left behind");
        assert!(!holds(&[g7.clone()], &g8), "the held name itself must be there");
    }
}
