//! nftables over netlink: program a table in one transaction, delete it, read it back.

mod expr;
mod netlink;
pub mod read;
mod render;

pub use render::ElementChange;

use std::ffi::CString;

use nftnl::nftnl_sys as sys;

use crate::error::{Error, Result};
use crate::model::Table;
use netlink::NftSocket;
use read::TableView;

/// Replaces `table` (creating it if missing) in one transaction in the current netns.
pub(crate) fn program(table: &Table) -> Result<()> {
    let r = render::replace_table(table);
    NftSocket::open()?.transact(&r.batch, &r.labels)
}

/// Like `program`, with the named counters starting from the given values.
pub(crate) fn program_keeping(table: &Table, counters: &std::collections::BTreeMap<String, (u64, u64)>) -> Result<()> {
    let r = render::replace_table_keeping(table, counters);
    NftSocket::open()?.transact(&r.batch, &r.labels)
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
pub fn counters(table: &str) -> Result<std::collections::BTreeMap<String, (u64, u64)>> {
    let mut sock = NftSocket::open()?;
    let cname = CString::new(table).map_err(|_| Error::InvalidConfig(format!("table name {table:?}")))?;
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

/// The raw elements of one set of `table`: (key, interval end).
pub fn set_elements(table: &str, set: &str) -> Result<Vec<(Vec<u8>, bool)>> {
    let Some(view) = kernel_view(table)? else { return Ok(Vec::new()) };
    Ok(view.sets.into_iter().find(|s| s.name == set).map(|s| s.elements.into_iter().collect()).unwrap_or_default())
}

/// Deletes the table; `Ok(false)` when it was not there.
pub(crate) fn remove(name: &str) -> Result<bool> {
    let r = render::delete_table(name);
    match NftSocket::open()?.transact(&r.batch, &r.labels) {
        Ok(()) => Ok(true),
        Err(Error::Transaction { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// What the kernel will hold after `program(table)`, parsed from the very messages sent.
pub fn expected_view(table: &Table) -> TableView {
    let r = render::replace_table(table);
    TableView::from_messages(&table.name, r.batch.iter())
}

/// What the kernel holds of table `name` in the current netns, or `None` if it has no such
/// table.
pub fn kernel_view(name: &str) -> Result<Option<TableView>> {
    let mut sock = NftSocket::open()?;
    let cname = CString::new(name).map_err(|_| Error::InvalidConfig(format!("table name {name:?}")))?;
    let tables = sock.dump(libc::NFT_MSG_GETTABLE, "dump tables", |_| {})?;
    let exists = tables.iter().any(|m| unsafe {
        let t = sys::nftnl_table_alloc();
        let found = sys::nftnl_table_nlmsg_parse(m.as_ptr().cast(), t) >= 0
            && std::ffi::CStr::from_ptr(sys::nftnl_table_get_str(t, sys::NFTNL_TABLE_NAME as u16)) == cname.as_c_str();
        sys::nftnl_table_free(t);
        found
    });
    if !exists {
        return Ok(None);
    }
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
    Ok(Some(TableView::from_messages(name, messages.iter().map(Vec::as_slice))))
}
