//! The kernel's view of a table, and ours: both are built from nftables messages by the same
//! code (ours from the very batch ADD sends, the kernel's from its dumps), down to typed
//! expressions, so CHECK compares like with like.

use std::collections::BTreeSet;

use netlink_packet_core::{NlaBuffer, NlasIterator, Parseable, ParseableParametrized};
use netlink_packet_netfilter::nftables::{
    ChainAttribute, ExpressionAttribute, Expressions, Hook, ListAttribute, NfTablesMessage, RuleAttribute,
    SetAttribute, SetElementAttribute, SetElementFlags, SetElementList, TableAttribute,
};

use super::expr::{Expr, Exprs};
use super::key::{set_flags, show_element, RawElement};

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
    /// The expressions, typed; printed in our notation.
    pub exprs: Exprs,
    pub comment: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetView {
    pub name: String,
    pub flags: u32,
    pub key_type: u32,
    pub key_len: u32,
    /// A map's data type (`NFT_DATA_VERDICT` for a verdict map, nft's type number for a data
    /// map; 0: a plain set) and its length (0 where the kernel reports none).
    pub data_type: u32,
    pub data_len: u32,
    /// Default element timeout in milliseconds (0: none).
    pub timeout_ms: u64,
    pub elements: BTreeSet<RawElement>,
}

impl SetView {
    /// The datapath fills the set (`flags dynamic,timeout`): its elements are the kernel's.
    pub fn is_dynamic(&self) -> bool {
        set_flags::is_dynamic(self.flags)
    }

    /// The set holds ranges: its elements change as a whole.
    pub fn is_interval(&self) -> bool {
        set_flags::is_interval(self.flags)
    }
}

impl TableView {
    /// Builds the view from messages: NEWSET, NEWSETELEM, NEWOBJ, NEWCHAIN and NEWRULE of
    /// `table`, whether the kernel dumped them or we are about to send them. Others are
    /// ignored.
    pub(crate) fn from_messages<'a>(table: &str, messages: impl IntoIterator<Item = &'a NfTablesMessage>) -> TableView {
        let mut view = TableView::default();
        for msg in messages {
            match msg {
                NfTablesMessage::NewTable(t) => {
                    if t.attributes.iter().any(|a| matches!(a, TableAttribute::Name(n) if n == table)) {
                        view.flags = t
                            .attributes
                            .iter()
                            .find_map(|a| match a {
                                TableAttribute::Flags(f) => Some(f.bits()),
                                _ => None,
                            })
                            .unwrap_or(0);
                    }
                }
                NfTablesMessage::NewChain(c) => {
                    if let Some(c) = parse_chain(&c.attributes, table) {
                        view.chains.push(c);
                    }
                }
                NfTablesMessage::NewRule(r) => {
                    if let Some((chain, rule)) = parse_rule(&r.attributes, table) {
                        view.append_rule(chain, rule);
                    }
                }
                NfTablesMessage::NewObject(attrs) => {
                    if let Some((name, value)) = parse_counter(attrs, table) {
                        view.counters.insert(name, value);
                    }
                }
                NfTablesMessage::NewSet(s) => {
                    if let Some(s) = parse_set(&s.attributes, table) {
                        view.sets.push(s);
                    }
                }
                NfTablesMessage::NewSetElement(e) => {
                    if let Some((name, elems)) = parse_elements(&e.attributes, table) {
                        if let Some(s) = view.sets.iter_mut().find(|s| s.name == name) {
                            s.elements.extend(elems);
                        }
                    }
                }
                _ => {}
            }
        }
        view
    }

    /// Appends `rule` to `chain` (a chain of that name, made if there is none yet).
    pub(crate) fn append_rule(&mut self, chain: String, rule: RuleView) {
        match self.chains.iter_mut().find(|c| c.name == chain) {
            Some(c) => c.rules.push(rule),
            None => self.chains.push(ChainView { name: chain, hook: None, rules: vec![rule] }),
        }
    }
}

fn parse_chain(attrs: &[ChainAttribute], table: &str) -> Option<ChainView> {
    let mut t = None;
    let mut name = None;
    let (mut kind, mut hooknum, mut prio, mut policy) = (None, None, None, None);
    for a in attrs {
        match a {
            ChainAttribute::Table(x) => t = Some(x.as_str()),
            ChainAttribute::Name(x) => name = Some(x.clone()),
            ChainAttribute::Type(x) => kind = Some(x.clone()),
            ChainAttribute::Policy(p) => policy = Some(*p),
            ChainAttribute::Hook(h) => {
                for x in h {
                    match x {
                        Hook::Number(n) => hooknum = Some(u32::from(*n)),
                        Hook::Priority(p) => prio = Some(*p as i32),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    (t? == table).then_some(())?;
    let hook = hooknum.map(|n| (kind.unwrap_or_default(), n, prio.unwrap_or(0), policy.unwrap_or(0)));
    Some(ChainView { name: name?, hook, rules: Vec::new() })
}

fn parse_rule(attrs: &[RuleAttribute], table: &str) -> Option<(String, RuleView)> {
    let (mut t, mut chain, mut exprs, mut comment) = (None, None, Vec::new(), String::new());
    for a in attrs {
        match a {
            RuleAttribute::Table(x) => t = Some(x.as_str()),
            RuleAttribute::Chain(x) => chain = Some(x.clone()),
            RuleAttribute::Expressions(list) => exprs = list.iter().filter_map(Expr::decode).collect(),
            RuleAttribute::UserData(u) => comment = rule_comment(u),
            _ => {}
        }
    }
    (t? == table).then_some(())?;
    Some((chain?, RuleView { exprs: Exprs(exprs), comment }))
}

/// A counter object's (name, (packets, bytes)) in `table`, from a NEWOBJ message.
fn parse_counter(attrs: &[netlink_packet_core::DefaultNla], table: &str) -> Option<(String, (u64, u64))> {
    use super::abi::{COUNTER_BYTES, COUNTER_PACKETS, OBJ_DATA, OBJ_NAME, OBJ_TABLE, OBJ_TYPE};
    use super::expr::NFT_OBJECT_COUNTER;
    use netlink_packet_core::{Nla, NLA_TYPE_MASK};
    let value = |n: &netlink_packet_core::DefaultNla| {
        let mut v = vec![0; n.value_len()];
        n.emit_value(&mut v);
        v
    };
    let find = |k: u16| attrs.iter().find(|n| n.kind() & NLA_TYPE_MASK == k).map(value);
    let text = |v: Vec<u8>| String::from_utf8_lossy(v.strip_suffix(&[0]).unwrap_or(&v)).into_owned();
    if find(OBJ_TABLE).map(text)? != table || find(OBJ_TYPE)? != NFT_OBJECT_COUNTER.to_be_bytes() {
        return None;
    }
    let name = find(OBJ_NAME).map(text)?;
    let (mut packets, mut bytes) = (0, 0);
    if let Some(data) = find(OBJ_DATA) {
        for nla in NlasIterator::new(&data[..]).flatten() {
            let v = u64::from_be_bytes(nla.value().try_into().unwrap_or([0; 8]));
            match nla.kind() {
                COUNTER_BYTES => bytes = v,
                COUNTER_PACKETS => packets = v,
                _ => {}
            }
        }
    }
    Some((name, (packets, bytes)))
}

/// The comment in a rule's user data, if any.
fn rule_comment(mut udata: &[u8]) -> String {
    while udata.len() >= 2 {
        let (kind, len) = (udata[0], udata[1] as usize);
        let Some(value) = udata.get(2..2 + len) else { break };
        if kind == super::abi::UDATA_RULE_COMMENT {
            return String::from_utf8_lossy(value.strip_suffix(&[0]).unwrap_or(value)).into_owned();
        }
        udata = &udata[2 + len..];
    }
    String::new()
}

fn parse_set(attrs: &[SetAttribute], table: &str) -> Option<SetView> {
    let mut t = None;
    let mut v = SetView {
        name: String::new(),
        flags: 0,
        key_type: 0,
        key_len: 0,
        data_type: 0,
        data_len: 0,
        timeout_ms: 0,
        elements: BTreeSet::new(),
    };
    for a in attrs {
        match a {
            SetAttribute::Table(x) => t = Some(x.as_str()),
            SetAttribute::Name(x) => v.name = x.clone(),
            SetAttribute::Flags(f) => v.flags = f.bits(),
            SetAttribute::KeyType(k) => v.key_type = *k,
            SetAttribute::KeyLen(k) => v.key_len = *k,
            SetAttribute::Timeout(ms) => v.timeout_ms = *ms,
            SetAttribute::DataType(d) => v.data_type = *d,
            SetAttribute::DataLen(d) => v.data_len = *d,
            _ => {}
        }
    }
    // A verdict's length is the kernel's own (its struct's size, which differs by
    // architecture), not what we asked for: compared by data type alone.
    if v.data_type == super::key::DATA_VERDICT {
        v.data_len = 0;
    }
    (t? == table).then_some(v)
}

type Elements = Vec<RawElement>;

pub(crate) fn parse_elements(attrs: &[SetElementList], table: &str) -> Option<(String, Elements)> {
    let (mut t, mut set, mut elems) = (None, None, Vec::new());
    for a in attrs {
        match a {
            SetElementList::Table(x) => t = Some(x.as_str()),
            SetElementList::Set(x) => set = Some(x.clone()),
            SetElementList::Elements(list) => {
                for e in list {
                    let netlink_packet_netfilter::nftables::ListAttribute::Element(e) = e else { continue };
                    let mut raw = RawElement::key(Vec::new());
                    for x in e {
                        match x {
                            SetElementAttribute::Key(netlink_packet_netfilter::nftables::DataAttribute::Value(k)) => {
                                raw.key = k.clone()
                            }
                            SetElementAttribute::Flags(f) => raw.end = f.contains(SetElementFlags::IntervalEnd),
                            SetElementAttribute::Data(netlink_packet_netfilter::nftables::DataAttribute::Verdict(
                                v,
                            )) => raw.goto = goto_chain(v),
                            // A data map's number (any other length is not one of ours: kept
                            // as no number, so it differs from what we expect).
                            SetElementAttribute::Data(netlink_packet_netfilter::nftables::DataAttribute::Value(v)) => {
                                raw.value = <[u8; 4]>::try_from(&v[..]).ok().map(super::key::number_of)
                            }
                            _ => {}
                        }
                    }
                    elems.push(raw);
                }
            }
            _ => {}
        }
    }
    (t? == table).then_some(())?;
    Some((set?, elems))
}

/// Whether the element messages of one set's dump name an element (a key, as a start or an
/// end of an interval) twice: the dump was read across a resize of the set's table.
pub(crate) fn names_an_element_twice(messages: &[NfTablesMessage], table: &str) -> bool {
    let mut seen = std::collections::HashSet::new();
    messages
        .iter()
        .filter_map(|m| match m {
            NfTablesMessage::NewSetElement(e) => parse_elements(&e.attributes, table),
            _ => None,
        })
        .flat_map(|(_, elems)| elems)
        .any(|e| !seen.insert((e.key, e.end)))
}

/// The chain of a `goto` verdict (what a verdict map's elements hold); `None` for another.
fn goto_chain(v: &[netlink_packet_netfilter::nftables::VerdictAttribute]) -> Option<String> {
    use netlink_packet_netfilter::nftables::VerdictAttribute;
    let code = v.iter().find_map(|a| match a {
        VerdictAttribute::Code(c) => Some(u32::from(*c) as i32),
        _ => None,
    });
    (code? == libc::NFT_GOTO).then_some(())?;
    v.iter().find_map(|a| match a {
        VerdictAttribute::Chain(c) => Some(c.clone()),
        _ => None,
    })
}

/// A NEWRULE message read attribute by attribute, each expression too (`expression`): the
/// crate's parser of the expression list formats the whole list into an error context once
/// per expression (quadratic in a rule's expressions; it doubled CHECK's time). Same result.
pub(crate) fn fast_rule(bytes: &[u8]) -> Option<NfTablesMessage> {
    use super::abi::{NEWRULE, RULE_CHAIN, RULE_EXPRESSIONS, RULE_TABLE, RULE_USERDATA};
    use netlink_packet_netfilter::nftables::RuleMessage;
    if u16::from_ne_bytes(bytes.get(4..6)?.try_into().ok()?) != NEWRULE {
        return None;
    }
    let text = |v: &[u8]| String::from_utf8_lossy(v.strip_suffix(&[0]).unwrap_or(v)).into_owned();
    let mut attrs = Vec::new();
    for a in NlasIterator::new(bytes.get(16 + 4..)?) {
        let a = a.ok()?;
        match a.kind() {
            RULE_TABLE => attrs.push(RuleAttribute::Table(text(a.value()))),
            RULE_CHAIN => attrs.push(RuleAttribute::Chain(text(a.value()))),
            RULE_USERDATA => attrs.push(RuleAttribute::UserData(a.value().to_vec())),
            RULE_EXPRESSIONS => {
                let mut list = Vec::new();
                for e in NlasIterator::new(a.value()) {
                    list.push(expression(&e.ok()?)?);
                }
                attrs.push(RuleAttribute::Expressions(list));
            }
            _ => {}
        }
    }
    Some(NfTablesMessage::NewRule(RuleMessage { attributes: attrs }))
}

/// One expression of a rule (its name, then its data), read as the crate's
/// `ListAttribute::<ExpressionAttribute>::parse` reads it, but for the data: the crate's parser
/// of an expression's data formats all of its bytes into an error context once per attribute
/// it reads, thrown away unless it fails (over half of a fresh CHECK's instructions). Each
/// attribute of the data is parsed by the crate's parser of that expression type. Same result
/// (`fast_rule_reads_as_the_crate_does`).
fn expression(e: &NlaBuffer<&[u8]>) -> Option<ListAttribute<ExpressionAttribute>> {
    use super::abi::{EXPR_DATA, EXPR_NAME, LIST_ELEM};
    if e.kind() != LIST_ELEM {
        return ListAttribute::<ExpressionAttribute>::parse(e).ok();
    }
    fn all<T: for<'b> Parseable<NlaBuffer<&'b [u8]>>>(data: &[u8]) -> Option<Vec<T>> {
        NlasIterator::new(data).map(|a| T::parse(&a.ok()?).ok()).collect()
    }
    let mut attrs = Vec::new();
    // The name given to the attribute that follows it, as the crate does.
    let mut name: Option<String> = None;
    for a in NlasIterator::new(e.value()) {
        let a = a.ok()?;
        let named = name.take();
        match a.kind() {
            EXPR_NAME => {
                let n = String::from_utf8_lossy(a.value().strip_suffix(&[0]).unwrap_or(a.value())).into_owned();
                name = Some(n.clone());
                attrs.push(ExpressionAttribute::Name(n));
            }
            EXPR_DATA => {
                let data = a.value();
                attrs.push(ExpressionAttribute::Data(match named.as_deref() {
                    None => Expressions::Unknown(all(data)?),
                    Some("bitwise") => Expressions::Bitwise(all(data)?),
                    Some("cmp") => Expressions::Cmp(all(data)?),
                    Some("immediate") => Expressions::Immediate(all(data)?),
                    Some("lookup") => Expressions::Lookup(all(data)?),
                    Some("meta") => Expressions::Meta(all(data)?),
                    Some("payload") => Expressions::Payload(all(data)?),
                    Some(other) => Expressions::Other { expression_type: other.to_string(), attributes: all(data)? },
                }));
            }
            _ => attrs.push(ExpressionAttribute::parse_with_param(&a, named).ok()?),
        }
    }
    Some(ListAttribute::Element(attrs))
}

/// A NEWSETELEM message read attribute by attribute: the crate's parser formats the whole
/// message into an error context for every element it reads (quadratic in the elements of
/// a message), which makes a 100,000-element dump take minutes. Same result, linear.
pub(crate) fn fast_elements(bytes: &[u8]) -> Option<NfTablesMessage> {
    use super::abi::{
        DATA_VALUE, DATA_VERDICT, ELEM_DATA, ELEM_FLAGS, ELEM_KEY, NEWSETELEM, SET_ELEM_LIST_ELEMENTS,
        SET_ELEM_LIST_SET, SET_ELEM_LIST_TABLE, VERDICT_CHAIN, VERDICT_CODE,
    };
    use netlink_packet_netfilter::nftables::{DataAttribute, ListAttribute, SetElementMessage};
    if u16::from_ne_bytes(bytes.get(4..6)?.try_into().ok()?) != NEWSETELEM {
        return None;
    }
    let text = |v: &[u8]| String::from_utf8_lossy(v.strip_suffix(&[0]).unwrap_or(v)).into_owned();
    let mut attrs = Vec::new();
    for a in NlasIterator::new(bytes.get(16 + 4..)?) {
        let a = a.ok()?;
        match a.kind() {
            SET_ELEM_LIST_TABLE => attrs.push(SetElementList::Table(text(a.value()))),
            SET_ELEM_LIST_SET => attrs.push(SetElementList::Set(text(a.value()))),
            SET_ELEM_LIST_ELEMENTS => {
                let mut elems = Vec::new();
                for e in NlasIterator::new(a.value()) {
                    let mut elem = Vec::new();
                    for x in NlasIterator::new(e.ok()?.value()) {
                        let x = x.ok()?;
                        match x.kind() {
                            ELEM_KEY => {
                                for v in NlasIterator::new(x.value()) {
                                    let v = v.ok()?;
                                    if v.kind() == DATA_VALUE {
                                        elem.push(SetElementAttribute::Key(DataAttribute::Value(v.value().to_vec())));
                                    }
                                }
                            }
                            ELEM_FLAGS => {
                                let f = u32::from_be_bytes(x.value().try_into().ok()?);
                                elem.push(SetElementAttribute::Flags(SetElementFlags::from_bits_retain(f)));
                            }
                            ELEM_DATA => {
                                use netlink_packet_netfilter::nftables::{Verdict, VerdictAttribute};
                                for d in NlasIterator::new(x.value()) {
                                    let d = d.ok()?;
                                    if d.kind() & 0x3fff == DATA_VALUE {
                                        elem.push(SetElementAttribute::Data(DataAttribute::Value(d.value().to_vec())));
                                        continue;
                                    }
                                    if d.kind() & 0x3fff != DATA_VERDICT {
                                        continue;
                                    }
                                    let mut verdict = Vec::new();
                                    for v in NlasIterator::new(d.value()) {
                                        let v = v.ok()?;
                                        match v.kind() {
                                            VERDICT_CODE => verdict.push(VerdictAttribute::Code(Verdict::from(
                                                u32::from_be_bytes(v.value().try_into().ok()?),
                                            ))),
                                            VERDICT_CHAIN => verdict.push(VerdictAttribute::Chain(text(v.value()))),
                                            _ => {}
                                        }
                                    }
                                    elem.push(SetElementAttribute::Data(DataAttribute::Verdict(verdict)));
                                }
                            }
                            _ => {}
                        }
                    }
                    elems.push(ListAttribute::Element(elem));
                }
                attrs.push(SetElementList::Elements(elems));
            }
            _ => {}
        }
    }
    Some(NfTablesMessage::NewSetElement(SetElementMessage { attributes: attrs }))
}

/// A base chain's hook in nft's words: `type nat hook output priority -100 policy accept`.
fn show_hook(h: &Option<(String, u32, i32, u32)>) -> String {
    match h {
        None => "none (a regular chain)".to_string(),
        Some((kind, hook, prio, policy)) => {
            let hook = match *hook {
                0 => "prerouting".to_string(),
                1 => "input".to_string(),
                2 => "forward".to_string(),
                3 => "output".to_string(),
                4 => "postrouting".to_string(),
                n => format!("#{n}"),
            };
            let policy = match *policy as i32 {
                libc::NF_ACCEPT => "accept".to_string(),
                libc::NF_DROP => "drop".to_string(),
                p => p.to_string(),
            };
            format!("type {kind} hook {hook} priority {prio} policy {policy}")
        }
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
        let kind = |s: &SetView| (s.flags, s.key_type, s.key_len, s.data_type, s.data_len);
        if kind(a) != kind(e) {
            out.push(format!(
                "set {}: flags/key type/key length/data type/data length are {:#x}/{}/{}/{:#x}/{}, \
                 expected {:#x}/{}/{}/{:#x}/{}",
                e.name,
                a.flags,
                a.key_type,
                a.key_len,
                a.data_type,
                a.data_len,
                e.flags,
                e.key_type,
                e.key_len,
                e.data_type,
                e.data_len
            ));
        }
        if a.timeout_ms != e.timeout_ms {
            out.push(format!("set {}: element timeout is {} ms, expected {} ms", e.name, a.timeout_ms, e.timeout_ms));
        }
        if e.is_dynamic() {
            // Filled by the datapath: its contents are the kernel's own.
            continue;
        }
        for k in e.elements.difference(&a.elements) {
            out.push(format!("set {}: element {} is missing", e.name, show_element(e.key_type, k)));
        }
        for k in a.elements.difference(&e.elements) {
            out.push(format!("set {}: unexpected element {}", e.name, show_element(e.key_type, k)));
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
            out.push(format!("chain {}: hook is {}, expected {}", e.name, show_hook(&a.hook), show_hook(&e.hook)));
        }
        if a.rules.len() == e.rules.len() {
            for (i, (er, ar)) in e.rules.iter().zip(&a.rules).enumerate() {
                if er != ar {
                    out.push(format!(
                        "chain {} rule {} ({}) differs: expected `{}` found `{}` (comment {:?})",
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
                    out.push(format!("chain {}: rule ({}) is missing or changed: `{}`", e.name, er.comment, er.exprs));
                }
            }
            for ar in &a.rules {
                if !e.rules.contains(ar) {
                    out.push(format!("chain {}: unexpected rule ({:?}): `{}`", e.name, ar.comment, ar.exprs));
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
