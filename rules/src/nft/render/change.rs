//! A change of a table already there: chains added and removed whole, set elements deleted
//! and added, and counter objects swapped (what a Service layer names itself by).

use super::*;

/// A change of one table: chains added (with their rules), set elements deleted and added,
/// chains deleted, in that order (an added element may go to an added chain; a deleted chain
/// is no longer the target of a deleted element). Sets are described as the kernel reports
/// them.
pub(crate) fn table_change(family: Family, table: &str, change: &TableChange) -> Batch {
    let mut b = Batch::default();
    // First, so that a table that does not hold what the change starts from refuses it at
    // its first message (the kernel aborts the whole transaction on any refusal).
    for name in &change.counters_gone {
        delete_counter(&mut b, family, table, name);
    }
    for c in &change.add_chains {
        b.add(family, NfTablesMessage::NewChain(chain(table, c)), NLM_F_CREATE, format!("chain {} added", c.name));
        for (i, r) in c.rules.iter().enumerate() {
            let exprs = rule_exprs(r, family);
            let needs = features::of_rule(&exprs, family);
            b.add_part(
                family,
                rule(family, table, &c.name, r, exprs),
                NLM_F_CREATE | NLM_F_APPEND,
                format!("rule {} of chain {} added ({})", i + 1, c.name, r.comment),
            );
            b.needing(needs);
        }
    }
    element_changes(&mut b, family, table, &change.elements);
    for name in &change.delete_chains {
        let msg = ChainMessage {
            attributes: vec![ChainAttribute::Table(table.to_string()), ChainAttribute::Name(name.clone())],
        };
        b.add(family, NfTablesMessage::DeleteChain(msg), 0, format!("chain {name} removed"));
    }
    for name in &change.counters_new {
        b.add(family, counter(table, name, (0, 0)), NLM_F_CREATE | NLM_F_EXCL, format!("counter {name} added"));
    }
    b
}

/// Deletes the counter object `name` (refused, `ENOENT`, when the table has none of that
/// name), labelled [`counter_removed`].
pub(crate) fn delete_counter(b: &mut Batch, family: Family, table: &str, name: &str) {
    let attrs = vec![
        expr::str_attr(OBJ_TABLE, table),
        expr::str_attr(OBJ_NAME, name),
        expr::u32_attr(OBJ_TYPE, NFT_OBJECT_COUNTER),
    ];
    b.add(family, NfTablesMessage::DeleteObject(attrs), 0, counter_removed(name));
}

/// What a refusal of [`delete_counter`]'s message names.
pub(crate) fn counter_removed(name: &str) -> String {
    format!("counter {name} removed")
}

/// What changes in one table: chains that come and go whole, and set elements.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TableChange {
    pub add_chains: Vec<model::Chain>,
    pub elements: Vec<ElementChange>,
    pub delete_chains: Vec<String>,
    /// Counter objects deleted first (the kernel refuses the whole transaction when one is
    /// not there: what a change that must start from a named layer deletes) and created last
    /// (exclusively).
    pub counters_gone: Vec<String>,
    pub counters_new: Vec<String>,
}

impl TableChange {
    pub fn is_empty(&self) -> bool {
        self.add_chains.is_empty()
            && self.elements.is_empty()
            && self.delete_chains.is_empty()
            && self.counters_gone.is_empty()
            && self.counters_new.is_empty()
    }
}

/// Set elements deleted and added: for each set, the raw elements to delete and to add.
fn element_changes(b: &mut Batch, family: Family, table: &str, changes: &[ElementChange]) {
    for c in changes {
        // Changes of interval sets are rebuilt whole, so a chunk never splits a range.
        for chunk in c.delete.chunks(ELEMENTS_PER_MESSAGE) {
            b.add(
                family,
                // A map's element is deleted by its key alone.
                NfTablesMessage::DeleteSetElement(elements(table, &c.set, None, chunk, false)),
                0,
                format!("{} element(s) removed from set {}", chunk.len(), c.set),
            );
        }
        for chunk in c.add.chunks(ELEMENTS_PER_MESSAGE) {
            b.add(
                family,
                NfTablesMessage::NewSetElement(elements(table, &c.set, None, chunk, true)),
                NLM_F_CREATE,
                format!("{} element(s) added to set {}", chunk.len(), c.set),
            );
        }
    }
}

/// What changes in one set: raw elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElementChange {
    pub set: String,
    pub delete: Vec<RawElement>,
    pub add: Vec<RawElement>,
}
