//! How a layer is written into the current netns: created, changed in place where only
//! elements differ, rebuilt with its counters carried over, or removed.

use std::collections::BTreeMap;

use super::{services_tables, Named, ServiceLayer, PROFILE_CHAIN_PREFIX, TABLE};
use crate::error::{Error, Result};
use crate::family::Family;
use crate::model::Table;
use crate::nft;

/// What `apply` did in the current netns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// The tables were created (or rebuilt because their structure changed), counters kept.
    Rebuilt,
    /// Only set elements changed: how many were added and removed.
    Elements { added: usize, removed: usize },
    /// Nothing differed.
    Unchanged,
    /// Mode `off`: the tables were removed (`true`) or already absent.
    Removed(bool),
}

/// Makes the current netns hold the layer for `layer` (`read`, then `Reading::commit`).
pub fn apply(layer: &ServiceLayer) -> Result<Applied> {
    read(layer)?.commit()
}

/// What the current netns's layer needs to become `layer`, from one reading of its tables.
/// When they have the same structure (sets, chains, rules, counters) and only set elements
/// and whole profile chains differ, only those are sent, in one transaction. Otherwise the
/// tables are replaced in one transaction, their counters starting from the values read
/// (a connection counted between that reading and the replace is lost; structure changes
/// are mode changes). Either transaction starts from the layer's name as read, and is
/// refused whole (`Error::LayerMoved`) when the tables name another layer by the time it
/// comes: an apply, which changes a pod's elements without its lock, came first.
pub fn read(layer: &ServiceLayer) -> Result<Reading> {
    let tables = services_tables(layer)?;
    if tables.is_empty() {
        return Ok(Reading { tables, what: Decided::Remove });
    }
    let mut changes = Vec::new();
    for family in Family::ALL {
        let expected = tables.iter().find(|t| t.family == family);
        let rebuild = || Ok(Decided::Rebuild(held_counts()?));
        match (expected, nft::kernel_view(family, TABLE)?) {
            (None, None) => {}
            (Some(t), Some(actual)) => match table_diff(t, &nft::expected_view(t), &actual) {
                Some(c) if c.is_empty() => {}
                Some(c) => changes.push((family, c)),
                None => return Ok(Reading { what: rebuild()?, tables }),
            },
            // A family's table missing, or one the layer no longer has.
            _ => return Ok(Reading { what: rebuild()?, tables }),
        }
    }
    Ok(Reading { tables, what: if changes.is_empty() { Decided::Unchanged } else { Decided::Change(changes) } })
}

/// What `read` found the current netns's layer needs, to be sent by `commit`.
pub struct Reading {
    tables: Vec<Table>,
    what: Decided,
}

enum Decided {
    Unchanged,
    Remove,
    Change(Vec<(Family, nft::TableChange)>),
    /// Replaced, with the counters the tables held by family (read with their names).
    Rebuild(BTreeMap<Family, nft::Counts>),
}

impl Reading {
    /// Sends what the reading decided, in one transaction.
    pub fn commit(self) -> Result<Applied> {
        match self.what {
            Decided::Unchanged => Ok(Applied::Unchanged),
            Decided::Remove => remove().map(Applied::Removed),
            Decided::Rebuild(held) => rebuild_over(&self.tables, held, None),
            Decided::Change(changes) => {
                let added = changes.iter().flat_map(|(_, c)| &c.elements).map(|c| c.add.len()).sum();
                let removed = changes.iter().flat_map(|(_, c)| &c.elements).map(|c| c.delete.len()).sum();
                let asserted: Vec<(Family, &str, &str)> = changes
                    .iter()
                    .flat_map(|(f, c)| c.counters_gone.iter().map(move |n| (*f, TABLE, n.as_str())))
                    .collect();
                nft::change_tables(TABLE, &changes).map_err(|e| moved(e, &asserted))?;
                Ok(Applied::Elements { added, removed })
            }
        }
    }
}

/// Makes the current netns hold the layer for `layer` without reading its sets back: the
/// tables are created, or replaced with their counters carried over (one read of the counter
/// objects only). What ADD does, and what an apply does to a pod whose generation it cannot
/// vouch for.
pub fn rebuild(layer: &ServiceLayer) -> Result<Applied> {
    match Prepared::new(layer)? {
        Some(p) => p.rebuild(),
        None => remove().map(Applied::Removed),
    }
}

/// The named counters of the layer's tables, by family (a family without a table left out).
fn held_counts() -> Result<BTreeMap<Family, nft::Counts>> {
    // A layer table always has counters: none means no table (one small dump per family).
    let mut held = BTreeMap::new();
    for (family, counts) in Family::ALL.into_iter().zip(nft::counters_each(&Family::ALL, TABLE)?) {
        if !counts.is_empty() {
            held.insert(family, counts);
        }
    }
    Ok(held)
}

/// Replaces whatever layer the current netns holds with `tables` (not empty), in one
/// transaction, counters carried over: each family's from its own table, and a table of a
/// family the layer no longer has deleted with its counts added to the first new table's,
/// so the pod's totals never go backwards; `held`: the counters the tables held, as read
/// (`held_counts`). With no layer there yet, `create` (the tables' creation, encoded once)
/// is sent if given.
fn rebuild_over(
    tables: &[Table],
    held: BTreeMap<Family, nft::Counts>,
    create: Option<&nft::Encoded>,
) -> Result<Applied> {
    if held.is_empty() {
        if let Some(create) = create {
            match create.send() {
                Ok(()) => return Ok(Applied::Rebuilt),
                // Created since the look (the create is exclusive): replaced below.
                Err(Error::Transaction { source, .. }) if source.raw_os_error() == Some(libc::EEXIST) => {}
                Err(e) => return Err(e),
            }
        }
    }
    // The names the tables held, deleted first: a layer another writer changed since this
    // reading (a name gone) refuses the rebuild, which would put back what was read.
    let asserted: Vec<(Family, &str, &str)> = held
        .iter()
        .flat_map(|(f, counts)| {
            counts.keys().filter(|n| Named::parse(n).is_some()).map(move |n| (*f, TABLE, n.as_str()))
        })
        .collect();
    let mut start: BTreeMap<Family, nft::Counts> = BTreeMap::new();
    let mut retired = Vec::new();
    for (family, counts) in &held {
        let into = if tables.iter().any(|t| t.family == *family) {
            *family
        } else {
            retired.push((*family, TABLE));
            tables[0].family
        };
        let sum = start.entry(into).or_default();
        for (name, &(packets, bytes)) in counts {
            let c = sum.entry(name.clone()).or_default();
            *c = (c.0 + packets, c.1 + bytes);
        }
    }
    let refs: Vec<&Table> = tables.iter().collect();
    nft::program_tables_keeping(&refs, &start, &retired, &asserted).map_err(|e| moved(e, &asserted))?;
    Ok(Applied::Rebuilt)
}

/// `e`, or `Error::LayerMoved` when it is the kernel's refusal to delete one of the
/// `asserted` names (family, table, counter) a transaction started from: the tables no longer
/// held it.
fn moved(e: Error, asserted: &[(Family, &str, &str)]) -> Error {
    let Error::Transaction { object, source } = &e else { return e };
    let gone = asserted.iter().map(|a| a.2).find(|n| *object == nft::counter_removed(n));
    match gone {
        Some(n) if source.raw_os_error() == Some(libc::ENOENT) => {
            Error::LayerMoved { named: Named::parse(n).map_or_else(|| n.to_string(), |n| n.to_string()) }
        }
        _ => e,
    }
}

/// A layer made ready for many pod netns: the transaction that creates its tables encoded
/// once, so an apply that rebuilds many pods pays the encoding once, and each pod without the
/// layer costs what the kernel takes to create it.
pub struct Prepared {
    tables: Vec<Table>,
    create: nft::Encoded,
}

impl Prepared {
    /// `None` in mode `off` (no layer).
    pub fn new(layer: &ServiceLayer) -> Result<Option<Prepared>> {
        let tables = services_tables(layer)?;
        if tables.is_empty() {
            return Ok(None);
        }
        let create = nft::encode_tables(&tables.iter().collect::<Vec<_>>());
        Ok(Some(Prepared { tables, create }))
    }

    /// The transaction that creates the layer's tables where there is none.
    pub fn create(&self) -> &nft::Encoded {
        &self.create
    }

    /// `rebuild` in the current netns: the encoded transaction where there is no layer yet,
    /// otherwise the tables replaced with their counters carried over.
    pub fn rebuild(&self) -> Result<Applied> {
        self.rebuild_from(Held::read()?)
    }

    /// `rebuild` from what the current netns's tables held when `held` was read: refused
    /// whole (`Error::LayerMoved`) when they name another layer by the time it comes.
    pub fn rebuild_from(&self, held: Held) -> Result<Applied> {
        rebuild_over(&self.tables, held.0, Some(&self.create))
    }
}

/// What the current netns's layer tables held, as a rebuild reads them first: their named
/// counters by family, the identity among them (a rebuild's transaction starts from it).
pub struct Held(BTreeMap<Family, nft::Counts>);

impl Held {
    pub fn read() -> Result<Held> {
        held_counts().map(Held)
    }
}

/// The changes that turn `actual` into `expected` (the model table `model`'s view): set
/// elements, and profile chains the one has and the other lacks; `None` when more differs
/// (or an interval set changed: its elements are ranges, rebuilt whole).
fn table_diff(
    model: &Table,
    expected: &nft::read::TableView,
    actual: &nft::read::TableView,
) -> Option<nft::TableChange> {
    let is_profile = |name: &str| name.starts_with(PROFILE_CHAIN_PREFIX);
    let has = |v: &nft::read::TableView, name: &str| v.chains.iter().any(|c| c.name == name);
    let mut change = nft::TableChange::default();
    for c in model.chains.iter().filter(|c| is_profile(&c.name) && !has(actual, &c.name)) {
        change.add_chains.push(c.clone());
    }
    for c in actual.chains.iter().filter(|c| is_profile(&c.name) && !has(expected, &c.name)) {
        change.delete_chains.push(c.name.clone());
    }
    // The rest compared without elements, counts, the identity, and the profile chains only
    // one side has.
    let strip = |v: &nft::read::TableView| {
        let mut v = v.clone();
        for s in &mut v.sets {
            s.elements.clear();
        }
        v.counters.retain(|n, _| Named::parse(n).is_none());
        v.counters.values_mut().for_each(|c| *c = (0, 0));
        v.chains
            .retain(|c| !change.add_chains.iter().any(|a| a.name == c.name) && !change.delete_chains.contains(&c.name));
        v
    };
    let structural = nft::read::diff(&strip(expected), &strip(actual));
    if !structural.is_empty() {
        return None;
    }
    for e in &expected.sets {
        if e.is_dynamic() {
            continue;
        }
        let a = actual.sets.iter().find(|a| a.name == e.name)?;
        if e.elements == a.elements {
            continue;
        }
        if e.is_interval() {
            return None;
        }
        change.elements.push(nft::ElementChange {
            set: e.name.clone(),
            delete: a.elements.difference(&e.elements).cloned().collect(),
            add: e.elements.difference(&a.elements).cloned().collect(),
        });
    }
    // What the table says it holds, in the same transaction as the elements: the name read
    // deleted first (and made again when it stays), so that the kernel refuses the change
    // whole when the table names another layer by then.
    let identities = |v: &nft::read::TableView| -> Vec<String> {
        v.counters.keys().filter(|n| Named::parse(n).is_some()).cloned().collect()
    };
    let (want, have) = (identities(expected), identities(actual));
    if want != have || !change.is_empty() {
        change.counters_gone = have;
        change.counters_new = want;
    }
    Some(change)
}

/// Removes the layer (the tables of both families) from the current netns; `Ok(false)` when
/// it was absent.
pub fn remove() -> Result<bool> {
    nft::remove_each(&Family::ALL, TABLE)
}
