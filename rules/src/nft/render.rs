//! Model to netlink: one nftables batch that replaces the whole table atomically.

use std::collections::BTreeMap;
use std::ffi::{c_void, CString};
use std::net::Ipv4Addr;
use std::ptr::NonNull;

use nftnl::nftnl_sys as sys;
use nftnl::{Batch, FinalizedBatch, MsgType, NlMsg, ProtoFamily};

use super::expr::{lower_action, lower_match};
use crate::model::{self, Element, KeyType};

/// Elements per NEWSETELEM/DELSETELEM message: well under the 64 KiB a message can hold
/// (an element with a 12-byte key and an interval end takes under 100 bytes).
const ELEMENTS_PER_MESSAGE: usize = 256;

/// A batch and, for each message in it, what it is (for error messages).
pub(crate) struct Rendered {
    pub batch: FinalizedBatch,
    pub labels: Vec<String>,
}

struct Builder {
    batch: Batch,
    labels: Vec<String>,
}

impl Builder {
    fn add(&mut self, msg: &impl NlMsg, kind: MsgType, label: String) {
        self.batch.add(msg, kind);
        self.labels.push(label);
    }
}

fn cstring(s: &str) -> CString {
    CString::new(s).expect("model names contain no NUL byte")
}

/// What a table batch does about a table of the same name the kernel may already hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Existing {
    /// There is none (the caller looked): the table is created with `NLM_F_EXCL`, so if one
    /// appeared since, the kernel refuses the whole transaction (`EEXIST` on the table, the
    /// first message) and changes nothing. No delete: deleting a table in a transaction, even
    /// one that does not exist yet, costs the kernel an RCU grace period (milliseconds).
    Refuse,
    /// Replace it atomically: create it if missing, delete it (and whatever is in it), then
    /// create it afresh.
    Replace,
}

/// The transaction that makes the kernel hold exactly `table`, with its sets, counters,
/// chains and rules; `existing` says what becomes of a table already there. The kernel
/// applies all of it or none.
pub(crate) fn table_batch(table: &model::Table, existing: Existing) -> Rendered {
    table_batch_keeping(table, &BTreeMap::new(), existing)
}

/// `table_batch`, with the named counters starting from the given (packets, bytes), so a
/// rebuild does not lose what they counted.
pub(crate) fn table_batch_keeping(
    table: &model::Table,
    counters: &BTreeMap<String, (u64, u64)>,
    existing: Existing,
) -> Rendered {
    let mut b = Builder { batch: Batch::new(), labels: Vec::new() };
    let t = nftnl::Table::new(cstring(&table.name), ProtoFamily::Ipv4);
    let label = table_label(&table.name);
    match existing {
        Existing::Refuse => b.add(&NewTableExclusive::new(&table.name), MsgType::Add, label),
        Existing::Replace => {
            b.add(&t, MsgType::Add, label.clone());
            b.add(&t, MsgType::Del, format!("flush of table ip {}", table.name));
            b.add(&t, MsgType::Add, label);
        }
    }
    for name in &table.counters {
        let start = counters.get(name).copied().unwrap_or((0, 0));
        b.add(&NftCounter::new(&table.name, name, start), MsgType::Add, format!("counter {name}"));
    }
    add_contents(&mut b, &t, table);
    Rendered { batch: b.batch.finalize(), labels: b.labels }
}

/// The label of the (first) table message of a table batch.
pub(crate) fn table_label(name: &str) -> String {
    format!("table ip {name}")
}

/// A change of set elements only: for each set, the raw keys (with their interval-end flag)
/// to delete and to add, in one transaction. Sets are described as the kernel reports them.
pub(crate) fn element_changes(table: &str, changes: &[ElementChange]) -> Rendered {
    let mut b = Builder { batch: Batch::new(), labels: Vec::new() };
    for c in changes {
        // Changes of interval sets are rebuilt whole, so a chunk never splits a range.
        for chunk in c.delete.chunks(ELEMENTS_PER_MESSAGE) {
            let s = NftSet::raw(table, &c.set, chunk);
            b.add(&SetElemsMsg(&s), MsgType::Del, format!("{} element(s) removed from set {}", chunk.len(), c.set));
        }
        for chunk in c.add.chunks(ELEMENTS_PER_MESSAGE) {
            let s = NftSet::raw(table, &c.set, chunk);
            b.add(&SetElemsMsg(&s), MsgType::Add, format!("{} element(s) added to set {}", chunk.len(), c.set));
        }
    }
    Rendered { batch: b.batch.finalize(), labels: b.labels }
}

/// What changes in one set: raw (key, interval end) elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElementChange {
    pub set: String,
    pub delete: Vec<(Vec<u8>, bool)>,
    pub add: Vec<(Vec<u8>, bool)>,
}

/// The transaction that deletes `name` (with everything in it).
pub(crate) fn delete_table(name: &str) -> Rendered {
    let mut b = Builder { batch: Batch::new(), labels: Vec::new() };
    let t = nftnl::Table::new(cstring(name), ProtoFamily::Ipv4);
    b.add(&t, MsgType::Del, format!("delete of table ip {name}"));
    Rendered { batch: b.batch.finalize(), labels: b.labels }
}

fn add_contents(b: &mut Builder, t: &nftnl::Table, table: &model::Table) {
    for (i, set) in table.sets.iter().enumerate() {
        let id = i as u32 + 1;
        let s = NftSet::new(&table.name, set, id, &[]);
        b.add(&SetMsg(&s), MsgType::Add, format!("set {}", set.name));
        // A netlink message holds at most 64 KiB: elements go in chunks.
        for chunk in set.elements.chunks(ELEMENTS_PER_MESSAGE) {
            let s = NftSet::new(&table.name, set, id, chunk);
            b.add(&SetElemsMsg(&s), MsgType::Add, format!("elements of set {}", set.name));
        }
    }
    let chains: Vec<nftnl::Chain> = table.chains.iter().map(|c| chain(t, c)).collect();
    for (c, nc) in table.chains.iter().zip(&chains) {
        b.add(nc, MsgType::Add, format!("chain {}", c.name));
    }
    for (c, nc) in table.chains.iter().zip(&chains) {
        for (i, r) in c.rules.iter().enumerate() {
            b.add(&rule(nc, r), MsgType::Add, format!("rule {} of chain {} ({})", i + 1, c.name, r.comment));
        }
    }
}

fn chain<'a>(t: &'a nftnl::Table, c: &model::Chain) -> nftnl::Chain<'a> {
    let mut nc = nftnl::Chain::new(cstring(&c.name), t);
    if let Some(h) = c.hook {
        let hook = match h.hook {
            model::Hook::Prerouting => nftnl::Hook::PreRouting,
            model::Hook::Output => nftnl::Hook::Out,
        };
        nc.set_hook(hook, h.priority);
        nc.set_type(match h.kind {
            model::ChainKind::Filter => nftnl::ChainType::Filter,
            model::ChainKind::Route => nftnl::ChainType::Route,
            model::ChainKind::Nat => nftnl::ChainType::Nat,
        });
        nc.set_policy(nftnl::Policy::Accept);
    }
    nc
}

pub(crate) fn rule<'a>(chain: &'a nftnl::Chain, r: &model::Rule) -> nftnl::Rule<'a> {
    let mut nr = nftnl::Rule::new(chain);
    for m in &r.matches {
        for e in lower_match(m) {
            nr.add_expr(&e);
        }
    }
    for e in lower_action(&r.action) {
        nr.add_expr(&e);
    }
    nr.set_comment(cstring(&r.comment)).expect("comments are short constants");
    nr
}

/// A named set with its elements, over nftnl-sys (nftnl 0.9 knows no interval sets).
pub(crate) struct NftSet {
    ptr: NonNull<sys::nftnl_set>,
}

impl Drop for NftSet {
    fn drop(&mut self) {
        unsafe { sys::nftnl_set_free(self.ptr.as_ptr()) }
    }
}

impl NftSet {
    /// The set, carrying `elements` (a part of `set.elements`, for an element message).
    fn new(table: &str, set: &model::Set, id: u32, elements: &[Element]) -> Self {
        let ptr = NonNull::new(unsafe { sys::nftnl_set_alloc() }).expect("nftnl_set_alloc: out of memory");
        let p = ptr.as_ptr();
        let (table, name) = (cstring(table), cstring(&set.name));
        unsafe {
            sys::nftnl_set_set_u32(p, sys::NFTNL_SET_FAMILY as u16, ProtoFamily::Ipv4 as u32);
            sys::nftnl_set_set_str(p, sys::NFTNL_SET_TABLE as u16, table.as_ptr());
            sys::nftnl_set_set_str(p, sys::NFTNL_SET_NAME as u16, name.as_ptr());
            sys::nftnl_set_set_u32(p, sys::NFTNL_SET_ID as u16, id);
            let mut flags = if set.interval { libc::NFT_SET_INTERVAL as u32 } else { 0 };
            if let Some(t) = set.timeout_secs {
                // `flags dynamic,timeout`: the datapath adds elements, which expire.
                flags |= (libc::NFT_SET_TIMEOUT | libc::NFT_SET_EVAL) as u32;
                sys::nftnl_set_set_u64(p, sys::NFTNL_SET_TIMEOUT as u16, u64::from(t) * 1000);
            }
            sys::nftnl_set_set_u32(p, sys::NFTNL_SET_FLAGS as u16, flags);
            sys::nftnl_set_set_u32(p, sys::NFTNL_SET_KEY_TYPE as u16, set.key.nft_type());
            sys::nftnl_set_set_u32(p, sys::NFTNL_SET_KEY_LEN as u16, set.key.byte_len());
        }
        let s = NftSet { ptr };
        for (key, end) in element_keys(set, elements) {
            s.add_element(&key, end);
        }
        s
    }

    /// A set named for an element message only: table, name and raw elements.
    fn raw(table: &str, name: &str, elements: &[(Vec<u8>, bool)]) -> Self {
        let ptr = NonNull::new(unsafe { sys::nftnl_set_alloc() }).expect("nftnl_set_alloc: out of memory");
        let (table, name) = (cstring(table), cstring(name));
        unsafe {
            sys::nftnl_set_set_u32(ptr.as_ptr(), sys::NFTNL_SET_FAMILY as u16, ProtoFamily::Ipv4 as u32);
            sys::nftnl_set_set_str(ptr.as_ptr(), sys::NFTNL_SET_TABLE as u16, table.as_ptr());
            sys::nftnl_set_set_str(ptr.as_ptr(), sys::NFTNL_SET_NAME as u16, name.as_ptr());
        }
        let s = NftSet { ptr };
        for (key, end) in elements {
            s.add_element(key, *end);
        }
        s
    }

    fn add_element(&self, key: &[u8], interval_end: bool) {
        unsafe {
            let e = sys::nftnl_set_elem_alloc();
            assert!(!e.is_null(), "nftnl_set_elem_alloc: out of memory");
            sys::nftnl_set_elem_set(e, sys::NFTNL_SET_ELEM_KEY as u16, key.as_ptr().cast::<c_void>(), key.len() as u32);
            if interval_end {
                sys::nftnl_set_elem_set_u32(
                    e,
                    sys::NFTNL_SET_ELEM_FLAGS as u16,
                    libc::NFT_SET_ELEM_INTERVAL_END as u32,
                );
            }
            sys::nftnl_set_elem_add(self.ptr.as_ptr(), e);
        }
    }
}

/// The raw keys (key, interval end) of `elements` of `set`.
pub(crate) fn element_keys(set: &model::Set, elements: &[Element]) -> Vec<(Vec<u8>, bool)> {
    let mut out = Vec::with_capacity(elements.len());
    for e in elements {
        if set.interval {
            out.extend(interval_keys(set.key, e));
        } else {
            out.push((plain_key(set.key, e), false));
        }
    }
    out
}

/// The key of one element of a set without intervals.
pub(crate) fn plain_key(key: KeyType, e: &Element) -> Vec<u8> {
    match (key, e) {
        (KeyType::Ipv4Addr, Element::Addr(a)) => a.octets().to_vec(),
        (KeyType::Ipv4Addr, Element::Net(n)) if n.prefix_len() == 32 => n.addr().octets().to_vec(),
        (KeyType::InetService, Element::Ports(r)) if r.first == r.last => r.first.to_be_bytes().to_vec(),
        (KeyType::ServiceKey, Element::Service(a, proto, port)) => {
            // Each part of a concatenation fills a 32-bit register, zero-padded.
            let mut k = a.octets().to_vec();
            k.extend([proto.number(), 0, 0, 0]);
            k.extend(port.to_be_bytes());
            k.extend([0, 0]);
            k
        }
        (KeyType::InetProto, Element::Proto(p)) => vec![p.number()],
        (k, e) => panic!("element {e} does not fit a set of type {} without intervals", k.name()),
    }
}

/// Interval sets hold half-open ranges: the first key, then the key after the last with the
/// interval-end flag (omitted when the range runs to the top of the key space).
fn interval_keys(key: KeyType, e: &Element) -> Vec<(Vec<u8>, bool)> {
    match (key, e) {
        (KeyType::Ipv4Addr, Element::Net(n)) => {
            let mut v = vec![(n.network().octets().to_vec(), false)];
            if let Some(next) = u32::from(n.broadcast()).checked_add(1) {
                v.push((Ipv4Addr::from(next).octets().to_vec(), true));
            }
            v
        }
        (KeyType::InetService, Element::Ports(r)) => {
            let mut v = vec![(r.first.to_be_bytes().to_vec(), false)];
            if let Some(next) = r.last.checked_add(1) {
                v.push((next.to_be_bytes().to_vec(), true));
            }
            v
        }
        (k, e) => panic!("element {e} does not fit a set of type {}", k.name()),
    }
}

/// A named counter object (`NFT_MSG_NEWOBJ`), over nftnl-sys.
struct NftCounter {
    ptr: NonNull<sys::nftnl_obj>,
}

impl Drop for NftCounter {
    fn drop(&mut self) {
        unsafe { sys::nftnl_obj_free(self.ptr.as_ptr()) }
    }
}

impl NftCounter {
    fn new(table: &str, name: &str, (packets, bytes): (u64, u64)) -> Self {
        let ptr = NonNull::new(unsafe { sys::nftnl_obj_alloc() }).expect("nftnl_obj_alloc: out of memory");
        let p = ptr.as_ptr();
        let (table, name) = (cstring(table), cstring(name));
        unsafe {
            sys::nftnl_obj_set_u32(p, sys::NFTNL_OBJ_FAMILY as u16, ProtoFamily::Ipv4 as u32);
            sys::nftnl_obj_set_str(p, sys::NFTNL_OBJ_TABLE as u16, table.as_ptr());
            sys::nftnl_obj_set_str(p, sys::NFTNL_OBJ_NAME as u16, name.as_ptr());
            sys::nftnl_obj_set_u32(p, sys::NFTNL_OBJ_TYPE as u16, 1 /* NFT_OBJECT_COUNTER */);
            sys::nftnl_obj_set_u64(p, sys::NFTNL_OBJ_CTR_PKTS as u16, packets);
            sys::nftnl_obj_set_u64(p, sys::NFTNL_OBJ_CTR_BYTES as u16, bytes);
        }
        NftCounter { ptr }
    }
}

unsafe impl NlMsg for NftCounter {
    unsafe fn write(&self, buf: *mut c_void, seq: u32, kind: MsgType) {
        let (msg, flags) = match kind {
            MsgType::Add => (libc::NFT_MSG_NEWOBJ, libc::NLM_F_CREATE),
            MsgType::Del => (libc::NFT_MSG_DELOBJ, 0),
        };
        unsafe {
            let hdr = sys::nftnl_nlmsg_build_hdr(buf.cast(), msg as u16, ProtoFamily::Ipv4 as u16, flags as u16, seq);
            sys::nftnl_obj_nlmsg_build_payload(hdr, self.ptr.as_ptr());
        }
    }
}

struct SetMsg<'a>(&'a NftSet);
struct SetElemsMsg<'a>(&'a NftSet);

unsafe impl NlMsg for SetMsg<'_> {
    unsafe fn write(&self, buf: *mut c_void, seq: u32, kind: MsgType) {
        let (msg, flags) = match kind {
            MsgType::Add => (libc::NFT_MSG_NEWSET, libc::NLM_F_CREATE),
            MsgType::Del => (libc::NFT_MSG_DELSET, 0),
        };
        unsafe {
            let hdr = sys::nftnl_nlmsg_build_hdr(buf.cast(), msg as u16, ProtoFamily::Ipv4 as u16, flags as u16, seq);
            sys::nftnl_set_nlmsg_build_payload(hdr, self.0.ptr.as_ptr());
        }
    }
}

unsafe impl NlMsg for SetElemsMsg<'_> {
    unsafe fn write(&self, buf: *mut c_void, seq: u32, kind: MsgType) {
        let (msg, flags) = match kind {
            MsgType::Add => (libc::NFT_MSG_NEWSETELEM, libc::NLM_F_CREATE),
            MsgType::Del => (libc::NFT_MSG_DELSETELEM, 0),
        };
        unsafe {
            let hdr = sys::nftnl_nlmsg_build_hdr(buf.cast(), msg as u16, ProtoFamily::Ipv4 as u16, flags as u16, seq);
            sys::nftnl_set_elems_nlmsg_build_payload(hdr, self.0.ptr.as_ptr());
        }
    }
}

/// `NFT_MSG_NEWTABLE` with `NLM_F_CREATE | NLM_F_EXCL` (nftnl's `Table` sends neither flag):
/// creation only, `EEXIST` if the table is there.
struct NewTableExclusive {
    ptr: NonNull<sys::nftnl_table>,
}

impl Drop for NewTableExclusive {
    fn drop(&mut self) {
        unsafe { sys::nftnl_table_free(self.ptr.as_ptr()) }
    }
}

impl NewTableExclusive {
    fn new(name: &str) -> Self {
        let ptr = NonNull::new(unsafe { sys::nftnl_table_alloc() }).expect("nftnl_table_alloc: out of memory");
        let name = cstring(name);
        unsafe {
            sys::nftnl_table_set_u32(ptr.as_ptr(), sys::NFTNL_TABLE_FAMILY as u16, ProtoFamily::Ipv4 as u32);
            sys::nftnl_table_set_str(ptr.as_ptr(), sys::NFTNL_TABLE_NAME as u16, name.as_ptr());
        }
        NewTableExclusive { ptr }
    }
}

unsafe impl NlMsg for NewTableExclusive {
    unsafe fn write(&self, buf: *mut c_void, seq: u32, kind: MsgType) {
        assert!(kind == MsgType::Add, "an exclusive create has no delete");
        let flags = libc::NLM_F_CREATE | libc::NLM_F_EXCL;
        unsafe {
            let hdr = sys::nftnl_nlmsg_build_hdr(
                buf.cast(),
                libc::NFT_MSG_NEWTABLE as u16,
                ProtoFamily::Ipv4 as u16,
                flags as u16,
                seq,
            );
            sys::nftnl_table_nlmsg_build_payload(hdr, self.ptr.as_ptr());
        }
    }
}
