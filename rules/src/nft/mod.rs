//! nftables over netlink: program a table in one transaction, delete it, read it back.

mod expr;
mod netlink;
pub mod read;
mod render;

pub use render::ElementChange;

use std::collections::BTreeMap;
use std::ffi::CString;

use nftnl::nftnl_sys as sys;

use crate::error::{Error, Result};
use crate::model::Table;
use netlink::NftSocket;
use read::TableView;
use render::Existing;

/// Makes the current netns hold exactly `table` (creating it, or replacing one already
/// there), in one transaction.
pub(crate) fn program(table: &Table) -> Result<()> {
    program_keeping(table, &BTreeMap::new())
}

/// Like `program`, with the named counters starting from the given values.
///
/// The common case, a fresh pod netns, has no such table: one lookup (a GETTABLE dump on the
/// same socket, tens of microseconds) lets the transaction simply create it. Only when the
/// table is there is it replaced by add/delete/add, atomically; that delete costs the kernel
/// an RCU grace period (milliseconds), which a fresh ADD thus never pays.
///
/// Between the lookup and the commit another writer could create the table (the runtime
/// never runs two operations for one container at once, so this is some other program). The
/// create is exclusive (`NLM_F_EXCL`), so then the kernel refuses the whole transaction and
/// changes nothing, and the table is replaced instead: never two rulesets merged into one.
/// A table deleted in that window is harmless: the replace creates it first.
pub(crate) fn program_keeping(table: &Table, counters: &BTreeMap<String, (u64, u64)>) -> Result<()> {
    let mut sock = NftSocket::open()?;
    let exists = table_exists(&mut sock, &cname(&table.name)?)?;
    program_on(&mut sock, table, counters, exists)
}

/// `program_keeping` once the lookup said whether the table `exists` (which may no longer
/// be true when the transaction commits).
fn program_on(
    sock: &mut NftSocket,
    table: &Table,
    counters: &BTreeMap<String, (u64, u64)>,
    exists: bool,
) -> Result<()> {
    if exists {
        let r = render::table_batch_keeping(table, counters, Existing::Replace);
        return sock.transact(&r.batch, &r.labels);
    }
    let r = render::table_batch_keeping(table, counters, Existing::Refuse);
    match sock.transact(&r.batch, &r.labels) {
        Err(Error::Transaction { object, source })
            if source.raw_os_error() == Some(libc::EEXIST) && object == render::table_label(&table.name) =>
        {
            let r = render::table_batch_keeping(table, counters, Existing::Replace);
            sock.transact(&r.batch, &r.labels)
        }
        other => other,
    }
}

/// The transaction that creates `table` (which must not exist yet), encoded once, so that a
/// benchmark can time the kernel's own work alone: the floor any ADD of it pays.
pub struct Encoded(render::Rendered);

pub fn encode(table: &Table) -> Encoded {
    Encoded(render::table_batch(table, Existing::Refuse))
}

impl Encoded {
    /// Sends the transaction in the current netns and waits for the kernel's verdict.
    pub fn send(&self) -> Result<()> {
        NftSocket::open()?.transact(&self.0.batch, &self.0.labels)
    }
}

/// Deletes and adds set elements of `table` in one transaction; nothing else changes.
pub(crate) fn change_elements(table: &str, changes: &[ElementChange]) -> Result<()> {
    if changes.is_empty() {
        return Ok(());
    }
    let r = render::element_changes(table, changes);
    NftSocket::open()?.transact(&r.batch, &r.labels)
}

/// The named counters of `table` in the current netns (empty when there is no such table).
pub fn counters(table: &str) -> Result<BTreeMap<String, (u64, u64)>> {
    let mut sock = NftSocket::open()?;
    let cname = cname(table)?;
    let objs = match sock.dump(libc::NFT_MSG_GETOBJ, "dump counters", |hdr| unsafe { obj_filter(hdr, &cname) }) {
        Ok(o) => o,
        Err(Error::Nftables { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => Vec::new(),
        Err(e) => return Err(e),
    };
    Ok(TableView::from_messages(table, objs.iter().map(Vec::as_slice)).counters)
}

unsafe fn obj_filter(hdr: *mut libc::nlmsghdr, table: &CString) {
    unsafe {
        let o = sys::nftnl_obj_alloc();
        sys::nftnl_obj_set_str(o, sys::NFTNL_OBJ_TABLE as u16, table.as_ptr());
        sys::nftnl_obj_set_u32(o, sys::NFTNL_OBJ_TYPE as u16, 1);
        sys::nftnl_obj_nlmsg_build_payload(hdr, o);
        sys::nftnl_obj_free(o);
    }
}

/// The raw elements of one set of `table`: (key, interval end). Dumps that set's elements
/// only (empty when the table or the set is missing), so reading a small set of a large
/// table costs what the small set holds.
pub fn set_elements(table: &str, set: &str) -> Result<Vec<(Vec<u8>, bool)>> {
    let mut sock = NftSocket::open()?;
    let (cname, set_name) = (cname(table)?, cname(set)?);
    let messages = match sock.dump(libc::NFT_MSG_GETSETELEM, "dump set elements", |hdr| unsafe {
        let s = sys::nftnl_set_alloc();
        sys::nftnl_set_set_str(s, sys::NFTNL_SET_TABLE as u16, cname.as_ptr());
        sys::nftnl_set_set_str(s, sys::NFTNL_SET_NAME as u16, set_name.as_ptr());
        sys::nftnl_set_elems_nlmsg_build_payload(hdr, s);
        sys::nftnl_set_free(s);
    }) {
        Ok(m) => m,
        Err(Error::Nftables { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    Ok(read::set_elements(table, set, messages.iter().map(Vec::as_slice)))
}

/// The raw keys (key, interval end) `elements` of the model set `set` are sent as: what
/// `ElementChange` carries.
pub fn set_keys(set: &crate::model::Set, elements: &[crate::model::Element]) -> Vec<(Vec<u8>, bool)> {
    render::element_keys(set, elements)
}

/// Deletes the table; `Ok(false)` when it was not there.
///
/// Looked up first: a transaction the kernel refuses (deleting a missing table) is aborted,
/// and an abort costs an RCU grace period, so a DEL of nothing cost more (~15 ms) than a DEL
/// of the table; now it costs the lookup (~0.1 ms). Deleting a table costs a grace period
/// too (~8 ms, measured on 6.18); that one is the kernel's: `NFT_MSG_DESTROYTABLE` (which
/// would also spare the lookup) measured the same, and is not in kernels before 6.3.
pub(crate) fn remove(name: &str) -> Result<bool> {
    let mut sock = NftSocket::open()?;
    if !table_exists(&mut sock, &cname(name)?)? {
        return Ok(false);
    }
    let r = render::delete_table(name);
    match sock.transact(&r.batch, &r.labels) {
        Ok(()) => Ok(true),
        // Deleted by someone else since the lookup.
        Err(Error::Transaction { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// What the kernel will hold after `program(table)`, parsed from the very messages sent.
pub fn expected_view(table: &Table) -> TableView {
    let r = render::table_batch(table, Existing::Refuse);
    TableView::from_messages(&table.name, r.batch.iter())
}

fn cname(name: &str) -> Result<CString> {
    CString::new(name).map_err(|_| Error::InvalidConfig(format!("table name {name:?}")))
}

/// Whether the current netns has table ip `name`.
fn table_exists(sock: &mut NftSocket, name: &CString) -> Result<bool> {
    Ok(table_flags(sock, name)?.is_some())
}

/// The flags of table `name` (e.g. dormant), or `None` when there is no such table.
fn table_flags(sock: &mut NftSocket, name: &CString) -> Result<Option<u32>> {
    let tables = sock.dump(libc::NFT_MSG_GETTABLE, "dump tables", |_| {})?;
    Ok(tables.iter().find_map(|m| unsafe {
        let t = sys::nftnl_table_alloc();
        let found = sys::nftnl_table_nlmsg_parse(m.as_ptr().cast(), t) >= 0
            && std::ffi::CStr::from_ptr(sys::nftnl_table_get_str(t, sys::NFTNL_TABLE_NAME as u16)) == name.as_c_str();
        let flags = found.then(|| {
            if sys::nftnl_table_is_set(t, sys::NFTNL_TABLE_FLAGS as u16) {
                sys::nftnl_table_get_u32(t, sys::NFTNL_TABLE_FLAGS as u16)
            } else {
                0
            }
        });
        sys::nftnl_table_free(t);
        flags
    }))
}

/// What the kernel holds of table `name` in the current netns, or `None` if it has no such
/// table.
pub fn kernel_view(name: &str) -> Result<Option<TableView>> {
    let mut sock = NftSocket::open()?;
    let cname = cname(name)?;
    let Some(flags) = table_flags(&mut sock, &cname)? else {
        return Ok(None);
    };
    let sets = sock.dump(libc::NFT_MSG_GETSET, "dump sets", |hdr| unsafe {
        let s = sys::nftnl_set_alloc();
        sys::nftnl_set_set_str(s, sys::NFTNL_SET_TABLE as u16, cname.as_ptr());
        sys::nftnl_set_nlmsg_build_payload(hdr, s);
        sys::nftnl_set_free(s);
    })?;
    let mut messages = sets.clone();
    let set_view = TableView::from_messages(name, sets.iter().map(Vec::as_slice));
    for set in &set_view.sets {
        let set_name = CString::new(set.name.as_str()).expect("kernel names have no NUL");
        messages.extend(sock.dump(libc::NFT_MSG_GETSETELEM, "dump set elements", |hdr| unsafe {
            let s = sys::nftnl_set_alloc();
            sys::nftnl_set_set_str(s, sys::NFTNL_SET_TABLE as u16, cname.as_ptr());
            sys::nftnl_set_set_str(s, sys::NFTNL_SET_NAME as u16, set_name.as_ptr());
            sys::nftnl_set_elems_nlmsg_build_payload(hdr, s);
            sys::nftnl_set_free(s);
        })?);
    }
    messages.extend(sock.dump(libc::NFT_MSG_GETOBJ, "dump counters", |hdr| unsafe { obj_filter(hdr, &cname) })?);
    messages.extend(sock.dump(libc::NFT_MSG_GETCHAIN, "dump chains", |_| {})?);
    messages.extend(sock.dump(libc::NFT_MSG_GETRULE, "dump rules", |hdr| unsafe {
        let r = sys::nftnl_rule_alloc();
        sys::nftnl_rule_set_str(r, sys::NFTNL_RULE_TABLE as u16, cname.as_ptr());
        sys::nftnl_rule_nlmsg_build_payload(hdr, r);
        sys::nftnl_rule_free(r);
    })?);
    let mut view = TableView::from_messages(name, messages.iter().map(Vec::as_slice));
    view.flags = flags;
    Ok(Some(view))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Table {
        let mut cfg = crate::CaptureConfig::new(crate::CaptureMode::RedirectAll);
        cfg.dns = Some(crate::DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 18054 });
        crate::capture_ruleset(&cfg).unwrap().table
    }

    fn intact(t: &Table) {
        let actual = kernel_view(&t.name).unwrap().expect("the table is there");
        assert_eq!(read::diff(&expected_view(t), &actual), Vec::<String>::new());
        let rules = |v: &TableView| v.chains.iter().map(|c| c.rules.len()).sum::<usize>();
        assert_eq!(rules(&actual), t.chains.iter().map(|c| c.rules.len()).sum::<usize>());
    }

    /// The lookup before the transaction is a window: whatever happens to the table in it,
    /// the netns ends with exactly one intact table.
    #[test]
    fn a_stale_lookup_still_leaves_one_intact_table() {
        if !aether_testkit::root_or_skip("a_stale_lookup_still_leaves_one_intact_table") {
            return;
        }
        let t = table();
        aether_netns::run_in_private(|| {
            let mut sock = NftSocket::open().unwrap();
            // Created after a lookup that found none: the exclusive create is refused and
            // the table replaced, not merged into (which would double every rule).
            program(&t).unwrap();
            program_on(&mut sock, &t, &BTreeMap::new(), false).unwrap();
            intact(&t);
            // Deleted after a lookup that found it: the replace creates it first.
            assert!(remove(&t.name).unwrap());
            program_on(&mut sock, &t, &BTreeMap::new(), true).unwrap();
            intact(&t);
            // A re-program replaces; removing twice finds nothing the second time.
            program(&t).unwrap();
            intact(&t);
            assert!(remove(&t.name).unwrap());
            assert!(!remove(&t.name).unwrap());
            assert!(kernel_view(&t.name).unwrap().is_none());
        })
        .unwrap();
    }
}
