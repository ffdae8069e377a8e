//! The kernel's view of a table, and ours: both are parsed from netlink messages by the same
//! code (ours from the very batch ADD sends), so CHECK compares like with like.

use std::collections::BTreeSet;
use std::ffi::CStr;
use std::fmt::Write as _;

use nftnl::nftnl_sys as sys;

use super::netlink::{nft_type, split_messages};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableView {
    /// Table flags: a dormant table (`NFT_TABLE_F_DORMANT`) keeps every rule and hooks none.
    pub flags: u32,
    pub sets: Vec<SetView>,
    pub chains: Vec<ChainView>,
    /// Named counter objects: name -> (packets, bytes).
    pub counters: std::collections::BTreeMap<String, (u64, u64)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainView {
    pub name: String,
    /// (type, hook number, priority, policy) of a base chain.
    pub hook: Option<(String, u32, i32, u32)>,
    pub rules: Vec<RuleView>,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct RuleView {
    /// The expressions in libnftnl's register-level notation.
    pub exprs: String,
    pub comment: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetView {
    pub name: String,
    pub flags: u32,
    pub key_type: u32,
    pub key_len: u32,
    /// Default element timeout in milliseconds (0: none).
    pub timeout_ms: u64,
    /// (key bytes, interval end)
    pub elements: BTreeSet<(Vec<u8>, bool)>,
}

fn cstr(p: *const libc::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

impl TableView {
    /// Builds the view from messages: NEWSET, NEWSETELEM, NEWCHAIN and NEWRULE of `table`,
    /// whether the kernel dumped them or we are about to send them. Others are ignored.
    pub fn from_messages<'a>(table: &str, messages: impl IntoIterator<Item = &'a [u8]>) -> TableView {
        let mut view = TableView::default();
        for buf in messages {
            for msg in split_messages(buf) {
                let hdr = msg.header();
                if msg.kind == nft_type(libc::NFT_MSG_NEWCHAIN) {
                    if let Some(c) = parse_chain(hdr, table) {
                        view.chains.push(c);
                    }
                } else if msg.kind == nft_type(libc::NFT_MSG_NEWRULE) {
                    if let Some((chain, rule)) = parse_rule(hdr, table, &objref_names(msg.bytes)) {
                        match view.chains.iter_mut().find(|c| c.name == chain) {
                            Some(c) => c.rules.push(rule),
                            None => view.chains.push(ChainView { name: chain, hook: None, rules: vec![rule] }),
                        }
                    }
                } else if msg.kind == nft_type(libc::NFT_MSG_NEWOBJ) {
                    if let Some((name, value)) = parse_counter(hdr, table) {
                        view.counters.insert(name, value);
                    }
                } else if msg.kind == nft_type(libc::NFT_MSG_NEWSET) {
                    if let Some(s) = parse_set(hdr, table) {
                        view.sets.push(s);
                    }
                } else if msg.kind == nft_type(libc::NFT_MSG_NEWSETELEM) {
                    if let Some((name, elems)) = parse_elements(msg.bytes, table) {
                        if let Some(s) = view.sets.iter_mut().find(|s| s.name == name) {
                            s.elements.extend(elems);
                        }
                    }
                }
            }
        }
        view
    }
}

/// A named counter object of `table`: (name, (packets, bytes)).
fn parse_counter(hdr: *const libc::nlmsghdr, table: &str) -> Option<(String, (u64, u64))> {
    unsafe {
        let o = sys::nftnl_obj_alloc();
        let ok = sys::nftnl_obj_nlmsg_parse(hdr, o) >= 0
            && cstr(sys::nftnl_obj_get_str(o, sys::NFTNL_OBJ_TABLE as u16)) == table
            && sys::nftnl_obj_get_u32(o, sys::NFTNL_OBJ_TYPE as u16) == 1;
        let out = ok.then(|| {
            let get = |attr: u32| {
                if sys::nftnl_obj_is_set(o, attr as u16) {
                    sys::nftnl_obj_get_u64(o, attr as u16)
                } else {
                    0
                }
            };
            (
                cstr(sys::nftnl_obj_get_str(o, sys::NFTNL_OBJ_NAME as u16)),
                (get(sys::NFTNL_OBJ_CTR_PKTS), get(sys::NFTNL_OBJ_CTR_BYTES)),
            )
        });
        sys::nftnl_obj_free(o);
        out
    }
}

fn parse_chain(hdr: *const libc::nlmsghdr, table: &str) -> Option<ChainView> {
    unsafe {
        let c = sys::nftnl_chain_alloc();
        let ok = sys::nftnl_chain_nlmsg_parse(hdr, c) >= 0
            && cstr(sys::nftnl_chain_get_str(c, sys::NFTNL_CHAIN_TABLE as u16)) == table;
        let view = ok.then(|| ChainView {
            name: cstr(sys::nftnl_chain_get_str(c, sys::NFTNL_CHAIN_NAME as u16)),
            hook: sys::nftnl_chain_is_set(c, sys::NFTNL_CHAIN_HOOKNUM as u16).then(|| {
                (
                    cstr(sys::nftnl_chain_get_str(c, sys::NFTNL_CHAIN_TYPE as u16)),
                    sys::nftnl_chain_get_u32(c, sys::NFTNL_CHAIN_HOOKNUM as u16),
                    sys::nftnl_chain_get_s32(c, sys::NFTNL_CHAIN_PRIO as u16),
                    sys::nftnl_chain_get_u32(c, sys::NFTNL_CHAIN_POLICY as u16),
                )
            }),
            rules: Vec::new(),
        });
        sys::nftnl_chain_free(c);
        view
    }
}

/// The counter names of a rule's `objref` expressions, in order, read from the attributes:
/// libnftnl sends the name without its NUL and parses it back with `strdup`, so its own
/// reading of a message it built runs past the name (the kernel's dumps carry the NUL).
fn objref_names(bytes: &[u8]) -> Vec<String> {
    const RULE_EXPRESSIONS: u16 = 4;
    const LIST_ELEM: u16 = 1;
    const EXPR_NAME: u16 = 1;
    const EXPR_DATA: u16 = 2;
    const OBJREF_IMM_NAME: u16 = 2;
    let text = |v: &[u8]| {
        let end = v.iter().position(|&b| b == 0).unwrap_or(v.len());
        String::from_utf8_lossy(&v[..end]).into_owned()
    };
    let mut out = Vec::new();
    let Some(body) = bytes.get(16 + 4..) else { return out };
    for (_, list) in attributes(body).into_iter().filter(|(k, _)| *k == RULE_EXPRESSIONS) {
        for (_, elem) in attributes(list).into_iter().filter(|(k, _)| *k == LIST_ELEM) {
            let attrs = attributes(elem);
            if attrs.iter().any(|(k, v)| *k == EXPR_NAME && text(v) == "objref") {
                if let Some((_, data)) = attrs.iter().find(|(k, _)| *k == EXPR_DATA) {
                    if let Some((_, name)) = attributes(data).into_iter().find(|(k, _)| *k == OBJREF_IMM_NAME) {
                        out.push(text(name));
                    }
                }
            }
        }
    }
    out
}

fn parse_rule(hdr: *const libc::nlmsghdr, table: &str, objrefs: &[String]) -> Option<(String, RuleView)> {
    unsafe {
        let r = sys::nftnl_rule_alloc();
        let ok = sys::nftnl_rule_nlmsg_parse(hdr, r) >= 0
            && cstr(sys::nftnl_rule_get_str(r, sys::NFTNL_RULE_TABLE as u16)) == table;
        let out = ok.then(|| {
            let chain = cstr(sys::nftnl_rule_get_str(r, sys::NFTNL_RULE_CHAIN as u16));
            let mut exprs = String::new();
            let iter = sys::nftnl_expr_iter_create(r);
            let mut buf = vec![0u8; 1024];
            let mut objrefs = objrefs.iter();
            loop {
                let e = sys::nftnl_expr_iter_next(iter);
                if e.is_null() {
                    break;
                }
                let name = cstr(sys::nftnl_expr_get_str(e, sys::NFTNL_EXPR_NAME as u16));
                sys::nftnl_expr_snprintf(buf.as_mut_ptr().cast(), buf.len(), e, sys::NFTNL_OUTPUT_DEFAULT, 0);
                let mut text = cstr(buf.as_ptr().cast());
                if name == "objref" {
                    if let Some(n) = objrefs.next() {
                        text = format!(
                            "type {} name {n}",
                            sys::nftnl_expr_get_u32(e, sys::NFTNL_EXPR_OBJREF_IMM_TYPE as u16)
                        );
                    }
                }
                let _ = write!(exprs, "[ {name} {} ] ", text.trim());
            }
            sys::nftnl_expr_iter_destroy(iter);
            let mut len = 0u32;
            let data = sys::nftnl_rule_get_data(r, sys::NFTNL_RULE_USERDATA as u16, &mut len);
            let comment = if data.is_null() {
                String::new()
            } else {
                rule_comment(std::slice::from_raw_parts(data.cast::<u8>(), len as usize))
            };
            (chain, RuleView { exprs: exprs.trim_end().to_string(), comment })
        });
        sys::nftnl_rule_free(r);
        out
    }
}

/// The comment in a rule's userdata: TLVs of (type u8, len u8, value), comment is type 0.
fn rule_comment(mut udata: &[u8]) -> String {
    while udata.len() >= 2 {
        let (kind, len) = (udata[0], udata[1] as usize);
        let Some(value) = udata.get(2..2 + len) else { break };
        if kind == sys::NFTNL_UDATA_RULE_COMMENT as u8 {
            return String::from_utf8_lossy(value.strip_suffix(&[0]).unwrap_or(value)).into_owned();
        }
        udata = &udata[2 + len..];
    }
    String::new()
}

fn parse_set(hdr: *const libc::nlmsghdr, table: &str) -> Option<SetView> {
    unsafe {
        let s = sys::nftnl_set_alloc();
        let ok = sys::nftnl_set_nlmsg_parse(hdr, s) >= 0
            && cstr(sys::nftnl_set_get_str(s, sys::NFTNL_SET_TABLE as u16)) == table;
        let get =
            |attr: u32| if sys::nftnl_set_is_set(s, attr as u16) { sys::nftnl_set_get_u32(s, attr as u16) } else { 0 };
        let view = ok.then(|| SetView {
            name: cstr(sys::nftnl_set_get_str(s, sys::NFTNL_SET_NAME as u16)),
            flags: get(sys::NFTNL_SET_FLAGS),
            key_type: get(sys::NFTNL_SET_KEY_TYPE),
            key_len: get(sys::NFTNL_SET_KEY_LEN),
            timeout_ms: if sys::nftnl_set_is_set(s, sys::NFTNL_SET_TIMEOUT as u16) {
                sys::nftnl_set_get_u64(s, sys::NFTNL_SET_TIMEOUT as u16)
            } else {
                0
            },
            elements: BTreeSet::new(),
        });
        sys::nftnl_set_free(s);
        view
    }
}

/// Netlink attributes of a buffer: (type without flag bits, payload).
fn attributes(mut buf: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while buf.len() >= 4 {
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        let kind = u16::from_ne_bytes([buf[2], buf[3]]) & 0x3fff;
        if len < 4 || len > buf.len() {
            break;
        }
        out.push((kind, &buf[4..len]));
        buf = &buf[((len + 3) & !3).min(buf.len())..];
    }
    out
}

/// Set elements, read attribute by attribute: libnftnl numbers the elements it sends 1, 2,
/// 3... (the kernel ignores the numbers) but its own parser accepts only 1, so it cannot
/// read back what it wrote.
/// (key bytes, interval end) of each element.
type Elements = Vec<(Vec<u8>, bool)>;

fn parse_elements(bytes: &[u8], table: &str) -> Option<(String, Elements)> {
    // linux/netfilter/nf_tables.h
    const NFGENMSG_LEN: usize = 4;
    const LIST_TABLE: u16 = 1;
    const LIST_SET: u16 = 2;
    const LIST_ELEMENTS: u16 = 3;
    const ELEM_KEY: u16 = 1;
    const ELEM_FLAGS: u16 = 3;
    const DATA_VALUE: u16 = 1;
    let attrs = attributes(bytes.get(16 + NFGENMSG_LEN..)?);
    let text = |kind: u16| {
        attrs
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, v)| String::from_utf8_lossy(v.strip_suffix(&[0]).unwrap_or(v)).into_owned())
    };
    if text(LIST_TABLE)? != table {
        return None;
    }
    let name = text(LIST_SET)?;
    let mut elems = Vec::new();
    for (_, list) in attrs.iter().filter(|(k, _)| *k == LIST_ELEMENTS) {
        for (_, elem) in attributes(list) {
            let mut key = Vec::new();
            let mut end = false;
            for (k, v) in attributes(elem) {
                if k == ELEM_KEY {
                    if let Some((_, value)) = attributes(v).into_iter().find(|(t, _)| *t == DATA_VALUE) {
                        key = value.to_vec();
                    }
                } else if k == ELEM_FLAGS && v.len() == 4 {
                    end = u32::from_be_bytes([v[0], v[1], v[2], v[3]]) & libc::NFT_SET_ELEM_INTERVAL_END as u32 != 0;
                }
            }
            elems.push((key, end));
        }
    }
    Some((name, elems))
}

/// The elements of set `set` of `table` in element messages (a GETSETELEM dump).
pub(crate) fn set_elements<'a>(table: &str, set: &str, messages: impl IntoIterator<Item = &'a [u8]>) -> Elements {
    let mut out = Vec::new();
    for buf in messages {
        for msg in split_messages(buf) {
            if msg.kind == nft_type(libc::NFT_MSG_NEWSETELEM) {
                if let Some((name, elems)) = parse_elements(msg.bytes, table) {
                    if name == set {
                        out.extend(elems);
                    }
                }
            }
        }
    }
    out
}

/// Prints a set key the way a person reads it: an address or a port.
pub fn show_key(key: &[u8], end: bool) -> String {
    let k = match key.len() {
        4 => std::net::Ipv4Addr::new(key[0], key[1], key[2], key[3]).to_string(),
        2 => u16::from_be_bytes([key[0], key[1]]).to_string(),
        1 => match key[0] {
            6 => "tcp".to_string(),
            17 => "udp".to_string(),
            p => p.to_string(),
        },
        12 => format!(
            "{} . {} . {}",
            std::net::Ipv4Addr::new(key[0], key[1], key[2], key[3]),
            match key[4] {
                6 => "tcp".to_string(),
                17 => "udp".to_string(),
                p => p.to_string(),
            },
            u16::from_be_bytes([key[8], key[9]])
        ),
        _ => format!("{key:02x?}"),
    };
    if end {
        format!("{k} (interval end)")
    } else {
        k
    }
}

/// What differs between what we expect and what the kernel holds, one line per difference.
pub fn diff(expected: &TableView, actual: &TableView) -> Vec<String> {
    let mut out = Vec::new();
    if actual.flags != expected.flags {
        // NFT_TABLE_F_DORMANT (linux/netfilter/nf_tables.h)
        let dormant = if actual.flags & 0x1 != 0 { " (dormant: no chain is hooked)" } else { "" };
        out.push(format!("table flags are {:#x}{dormant}, expected {:#x}", actual.flags, expected.flags));
    }
    for e in &expected.sets {
        let Some(a) = actual.sets.iter().find(|a| a.name == e.name) else {
            out.push(format!("set {} is missing", e.name));
            continue;
        };
        if (a.flags, a.key_type, a.key_len) != (e.flags, e.key_type, e.key_len) {
            out.push(format!(
                "set {}: flags/key type/key length are {:#x}/{}/{}, expected {:#x}/{}/{}",
                e.name, a.flags, a.key_type, a.key_len, e.flags, e.key_type, e.key_len
            ));
        }
        if a.timeout_ms != e.timeout_ms {
            out.push(format!("set {}: element timeout is {} ms, expected {} ms", e.name, a.timeout_ms, e.timeout_ms));
        }
        if e.flags & libc::NFT_SET_TIMEOUT as u32 != 0 {
            // Filled by the datapath: its contents are the kernel's own.
            continue;
        }
        for (k, end) in e.elements.difference(&a.elements) {
            out.push(format!("set {}: element {} is missing", e.name, show_key(k, *end)));
        }
        for (k, end) in a.elements.difference(&e.elements) {
            out.push(format!("set {}: unexpected element {}", e.name, show_key(k, *end)));
        }
    }
    for a in &actual.sets {
        if !expected.sets.iter().any(|e| e.name == a.name) {
            out.push(format!("unexpected set {}", a.name));
        }
    }
    for name in expected.counters.keys() {
        if !actual.counters.contains_key(name) {
            out.push(format!("counter {name} is missing"));
        }
    }
    for name in actual.counters.keys() {
        if !expected.counters.contains_key(name) {
            out.push(format!("unexpected counter {name}"));
        }
    }
    for e in &expected.chains {
        let Some(a) = actual.chains.iter().find(|a| a.name == e.name) else {
            out.push(format!("chain {} is missing", e.name));
            continue;
        };
        if a.hook != e.hook {
            out.push(format!(
                "chain {}: hook (type, hook, priority, policy) is {:?}, expected {:?}",
                e.name, a.hook, e.hook
            ));
        }
        if a.rules.len() == e.rules.len() {
            for (i, (er, ar)) in e.rules.iter().zip(&a.rules).enumerate() {
                if er != ar {
                    out.push(format!(
                        "chain {} rule {} ({}) differs: expected {} found {} (comment {:?})",
                        e.name,
                        i + 1,
                        er.comment,
                        er.exprs,
                        ar.exprs,
                        ar.comment
                    ));
                }
            }
        } else {
            for er in &e.rules {
                if !a.rules.contains(er) {
                    out.push(format!("chain {}: rule ({}) is missing or changed: {}", e.name, er.comment, er.exprs));
                }
            }
            for ar in &a.rules {
                if !e.rules.contains(ar) {
                    out.push(format!("chain {}: unexpected rule ({:?}): {}", e.name, ar.comment, ar.exprs));
                }
            }
            if out.is_empty() {
                out.push(format!("chain {} holds {} rules, expected {}", e.name, a.rules.len(), e.rules.len()));
            }
        }
    }
    for a in &actual.chains {
        if !expected.chains.iter().any(|e| e.name == a.name) {
            out.push(format!("unexpected chain {}", a.name));
        }
    }
    out
}
