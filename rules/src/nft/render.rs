//! Model to netlink: one nftables batch that replaces the whole table atomically.

use std::ffi::{c_void, CString};
use std::net::Ipv4Addr;
use std::ptr::NonNull;

use nftnl::nftnl_sys as sys;
use nftnl::{Batch, FinalizedBatch, MsgType, NlMsg, ProtoFamily};

use super::expr::{lower_action, lower_match};
use crate::model::{self, Element, KeyType};

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

/// The transaction that makes the kernel hold exactly `table`: create it if missing, delete
/// it (and whatever an earlier attempt left in it), then create it afresh with its sets,
/// chains and rules. The kernel applies all of it or none.
pub(crate) fn replace_table(table: &model::Table) -> Rendered {
    let mut b = Builder { batch: Batch::new(), labels: Vec::new() };
    let t = nftnl::Table::new(cstring(&table.name), ProtoFamily::Ipv4);
    b.add(&t, MsgType::Add, format!("table ip {}", table.name));
    b.add(&t, MsgType::Del, format!("flush of table ip {}", table.name));
    b.add(&t, MsgType::Add, format!("table ip {}", table.name));
    add_contents(&mut b, &t, table);
    Rendered { batch: b.batch.finalize(), labels: b.labels }
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
        let s = NftSet::new(&table.name, set, i as u32 + 1);
        b.add(&SetMsg(&s), MsgType::Add, format!("set {}", set.name));
        if !set.elements.is_empty() {
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
    fn new(table: &str, set: &model::Set, id: u32) -> Self {
        let ptr = NonNull::new(unsafe { sys::nftnl_set_alloc() }).expect("nftnl_set_alloc: out of memory");
        let p = ptr.as_ptr();
        let (table, name) = (cstring(table), cstring(&set.name));
        unsafe {
            sys::nftnl_set_set_u32(p, sys::NFTNL_SET_FAMILY as u16, ProtoFamily::Ipv4 as u32);
            sys::nftnl_set_set_str(p, sys::NFTNL_SET_TABLE as u16, table.as_ptr());
            sys::nftnl_set_set_str(p, sys::NFTNL_SET_NAME as u16, name.as_ptr());
            sys::nftnl_set_set_u32(p, sys::NFTNL_SET_ID as u16, id);
            let flags = if set.interval { libc::NFT_SET_INTERVAL as u32 } else { 0 };
            sys::nftnl_set_set_u32(p, sys::NFTNL_SET_FLAGS as u16, flags);
            sys::nftnl_set_set_u32(p, sys::NFTNL_SET_KEY_TYPE as u16, set.key.nft_type());
            sys::nftnl_set_set_u32(p, sys::NFTNL_SET_KEY_LEN as u16, set.key.len());
        }
        let s = NftSet { ptr };
        for e in &set.elements {
            for (key, end) in interval_keys(set.key, e) {
                s.add_element(&key, end);
            }
        }
        s
    }

    fn add_element(&self, key: &[u8], interval_end: bool) {
        unsafe {
            let e = sys::nftnl_set_elem_alloc();
            assert!(!e.is_null(), "nftnl_set_elem_alloc: out of memory");
            sys::nftnl_set_elem_set(e, sys::NFTNL_SET_ELEM_KEY as u16, key.as_ptr().cast::<c_void>(), key.len() as u32);
            if interval_end {
                sys::nftnl_set_elem_set_u32(e, sys::NFTNL_SET_ELEM_FLAGS as u16, libc::NFT_SET_ELEM_INTERVAL_END as u32);
            }
            sys::nftnl_set_elem_add(self.ptr.as_ptr(), e);
        }
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

struct SetMsg<'a>(&'a NftSet);
struct SetElemsMsg<'a>(&'a NftSet);

unsafe impl NlMsg for SetMsg<'_> {
    unsafe fn write(&self, buf: *mut c_void, seq: u32, kind: MsgType) {
        let (msg, flags) = match kind {
            MsgType::Add => (libc::NFT_MSG_NEWSET, libc::NLM_F_CREATE | libc::NLM_F_ACK),
            MsgType::Del => (libc::NFT_MSG_DELSET, libc::NLM_F_ACK),
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
            MsgType::Add => (libc::NFT_MSG_NEWSETELEM, libc::NLM_F_CREATE | libc::NLM_F_ACK),
            MsgType::Del => (libc::NFT_MSG_DELSETELEM, libc::NLM_F_ACK),
        };
        unsafe {
            let hdr = sys::nftnl_nlmsg_build_hdr(buf.cast(), msg as u16, ProtoFamily::Ipv4 as u16, flags as u16, seq);
            sys::nftnl_set_elems_nlmsg_build_payload(hdr, self.0.ptr.as_ptr());
        }
    }
}
