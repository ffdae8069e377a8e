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
    /// From the counter names of each family's table (empty: no table).
    fn of<'a>(tables: impl IntoIterator<Item = Vec<&'a str>>) -> Option<HeldLayer> {
        let mut held = HeldLayer::Absent;
        for names in tables {
            if names.is_empty() {
                continue;
            }
            let mut named = names.iter().filter_map(|n| Named::parse(n));
            let this = match (named.next(), named.next()) {
                (Some(n), None) => HeldLayer::Named(n),
                _ => return None,
            };
            match held {
                HeldLayer::Absent => held = this,
                h if h == this => {}
                _ => return None,
            }
        }
        Some(held)
    }
}

/// What the current netns's Service layer says it holds: one dump of each family's counter
/// objects (read anyway by a rebuild, which carries the counts over).
pub fn held() -> Result<HeldLayer> {
    let counts = nft::counters_each(&Family::ALL, TABLE)?;
    held_of(&counts, held_shape)
}

/// `held`, read on a socket kept in the netns (the shape of tables that name nothing is not
/// read: `Unnamed { shape: None }`).
pub fn held_on(sock: &mut nft::KeptSocket) -> Result<HeldLayer> {
    let counts = sock.counters_each(&Family::ALL, TABLE)?;
    held_of(&counts, || Ok(None))
}

fn held_of(counts: &[nft::Counts], shape: impl FnOnce() -> Result<Option<u64>>) -> Result<HeldLayer> {
    match HeldLayer::of(counts.iter().map(|c| c.keys().map(String::as_str).collect())) {
        Some(h) => Ok(h),
        // Tables that name nothing: their shape, from their sets (a second small dump, only
        // for a layer an earlier release built).
        None => Ok(HeldLayer::Unnamed { shape: shape()? }),
    }
}

/// The name of the counter that says which layer the tables hold, when the layer has one.
pub fn identity_counter(layer: &ServiceLayer) -> Option<String> {
    let id = layer.identity?;
    Some(Named { shape: SHAPE, id, divert_mark: layer.divert_mark }.counter_name())
}
