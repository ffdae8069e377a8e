//! Model to netlink: the nftables messages of one transaction (a batch), each with a label
//! saying what it is, so an error names the object the kernel refused.

use std::collections::BTreeMap;

use netlink_packet_core::{Emitable, NetlinkSerializable, NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_EXCL};
use netlink_packet_netfilter::nftables::{
    ChainAttribute, ChainMessage, DataAttribute, Hook, HookNumber, InetHookNumber, ListAttribute, NfTablesMessage,
    SetAttribute, SetElementAttribute, SetElementFlags, SetElementList, SetElementMessage, SetFlags, SetMessage,
    TableAttribute, TableMessage, Verdict, VerdictAttribute,
};
use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterProtoFamily};

use super::expr::{self, lower_action, lower_match, Expr, NFT_OBJECT_COUNTER};
use super::key::{self, RawElement};
use super::wire;
use crate::family::Family;
use crate::features::{self, Feature};
use crate::model;

/// Elements per NEWSETELEM/DELSETELEM message: well under the 64 KiB a message can hold
/// (an element with a 12-byte key and an interval end takes under 100 bytes).
const ELEMENTS_PER_MESSAGE: usize = 256;
// (The batch delimiters name the subsystem in `res_id`; a guarded batch's begin marker
// carries NFNL_BATCH_GENID at GUARD_AT.)
use super::abi::{
    COUNTER_BYTES, COUNTER_PACKETS, GUARD_AT, NFNL_BATCH_GENID, NFNL_SUBSYS_NFTABLES, OBJ_DATA, OBJ_NAME, OBJ_TABLE,
    OBJ_TYPE, UDATA_RULE_COMMENT,
};

mod change;
pub(crate) use change::counter_removed;
pub(crate) use change::{delete_counter, table_change};
pub use change::{ElementChange, TableChange};

/// The messages of one transaction, each with its netlink flags and what it is.
#[derive(Default)]
pub(crate) struct Batch {
    pub messages: Vec<(Part, u16)>,
    pub labels: Vec<String>,
    /// The kernel features each message's object needs beyond nf_tables' core (to name the
    /// one the kernel lacks when it refuses the object).
    pub needs: Vec<Vec<&'static Feature>>,
    /// The family of each message's table.
    pub families: Vec<Family>,
    /// Set IDs name sets created in this transaction: unique across its tables.
    next_set_id: u32,
}

/// One message of a batch. A set's elements are kept as their raw keys, packed, and made
/// into a message only while the batch is encoded: as built messages (a list of attributes
/// per element, each key in an allocation of its own) they cost several times the keys, the
/// largest part of what a pod start at 10,000 Services held in memory.
pub(crate) enum Part {
    Message(NfTablesMessage),
    Elements {
        table: String,
        set: String,
        set_id: Option<u32>,
        keys: PackedKeys,
    },
    /// A rule, its expressions typed: written straight into the batch's bytes (`Rule::write`).
    Rule(Rule),
}

/// A NEWRULE message: appended to `chain` of `family`'s table `table`.
pub(crate) struct Rule {
    family: Family,
    table: String,
    chain: String,
    exprs: Vec<Expr>,
    comment: String,
}

impl Rule {
    /// The NEWRULE message, written into `out`: byte for byte what the generic encoder
    /// writes of the same rule built of the crate's attributes (a test holds them equal).
    fn write(&self, out: &mut Vec<u8>, flags: u16, seq: u32) {
        use super::abi::{NEWRULE, RULE_CHAIN, RULE_EXPRESSIONS, RULE_TABLE, RULE_USERDATA};
        wire::message(out, NEWRULE, flags, seq, self.family, |o| {
            wire::text(o, RULE_TABLE, &self.table);
            wire::text(o, RULE_CHAIN, &self.chain);
            wire::nla(o, RULE_EXPRESSIONS | wire::NESTED, |o| self.exprs.iter().for_each(|e| e.write(o)));
            wire::nla(o, RULE_USERDATA, |o| comment_udata(o, &self.comment));
        })
    }
}

impl Rule {
    pub fn chain(&self) -> &str {
        &self.chain
    }

    /// What a dump of this rule reads as (`read::RuleView`).
    pub fn view(&self) -> super::read::RuleView {
        super::read::RuleView { exprs: super::expr::Exprs(self.exprs.clone()), comment: self.comment.clone() }
    }
}

/// Rule user data holding `comment`.
fn comment_udata(out: &mut Vec<u8>, comment: &str) {
    let len = u8::try_from(comment.len() + 1).expect("comments are short constants");
    out.extend_from_slice(&[UDATA_RULE_COMMENT, len]);
    out.extend_from_slice(comment.as_bytes());
    out.push(0);
}

impl Part {
    /// The rule, if this is one.
    pub fn rule(&self) -> Option<&Rule> {
        match self {
            Part::Rule(r) => Some(r),
            _ => None,
        }
    }

    /// The message, built (a rule: read back from the bytes the batch sends of it).
    pub fn message(&self) -> NfTablesMessage {
        match self {
            Part::Message(m) => m.clone(),
            Part::Rule(r) => {
                let mut bytes = Vec::new();
                r.write(&mut bytes, 0, 0);
                super::read::fast_rule(&bytes).expect("a rule we wrote reads back")
            }
            Part::Elements { table, set, set_id, keys } => {
                NfTablesMessage::NewSetElement(elements(table, set, *set_id, &keys.unpack(), true))
            }
        }
    }
}

/// Raw set elements, the keys back to back (a set's keys are all as long: its key type's
/// length), a data map's numbers, a verdict map's chains named once each.
pub(crate) struct PackedKeys {
    key_len: usize,
    bytes: Vec<u8>,
    ends: Vec<bool>,
    /// Per element, its number (a data map's elements).
    values: Vec<Option<u32>>,
    /// Per element, its chain's index in `chains` (a verdict map's elements).
    gotos: Vec<Option<u16>>,
    chains: Vec<String>,
}

impl PackedKeys {
    fn pack(keys: &[RawElement]) -> PackedKeys {
        let key_len = keys.first().map_or(0, |e| e.key.len());
        let mut bytes = Vec::with_capacity(key_len * keys.len());
        let mut chains: Vec<String> = Vec::new();
        let mut gotos = Vec::with_capacity(keys.len());
        for e in keys {
            assert_eq!(e.key.len(), key_len, "the keys of one set have one length");
            bytes.extend_from_slice(&e.key);
            gotos.push(e.goto.as_ref().map(|c| match chains.iter().position(|x| x == c) {
                Some(i) => i as u16,
                None => {
                    chains.push(c.clone());
                    (chains.len() - 1) as u16
                }
            }));
        }
        let values = keys.iter().map(|e| e.value).collect();
        PackedKeys { key_len, bytes, ends: keys.iter().map(|e| e.end).collect(), values, gotos, chains }
    }

    fn unpack(&self) -> Vec<RawElement> {
        let keys = self.bytes.chunks(self.key_len.max(1)).map(<[u8]>::to_vec);
        keys.zip(self.ends.iter().copied())
            .zip(&self.values)
            .zip(&self.gotos)
            .map(|(((key, end), value), goto)| RawElement {
                key,
                end,
                value: *value,
                goto: goto.map(|i| self.chains[usize::from(i)].clone()),
            })
            .collect()
    }
}

impl Batch {
    fn add(&mut self, family: Family, msg: NfTablesMessage, flags: u16, label: String) {
        self.add_part(family, Part::Message(msg), flags, label);
    }

    fn add_part(&mut self, family: Family, part: Part, flags: u16, label: String) {
        self.messages.push((part, flags));
        self.labels.push(label);
        self.needs.push(Vec::new());
        self.families.push(family);
    }

    /// The last message's object needs `features`.
    fn needing(&mut self, features: Vec<&'static Feature>) {
        *self.needs.last_mut().expect("a message") = features;
    }

    /// The wire form: batch begin, the messages, batch end, numbered from `first_seq`
    /// (the begin marker); message `i` gets `first_seq + 1 + i`. No message asks for an
    /// ACK: the kernel reports errors anyway, and a request after the batch fences it.
    pub fn encode(&self, first_seq: u32) -> Vec<u8> {
        self.encode_with(first_seq, false)
    }

    /// `encode`, guarded by the netns's ruleset generation: the begin marker carries the
    /// generation the netns must still be at (NFNL_BATCH_GENID, its value at `GUARD_AT`,
    /// written for each send; the kernel refuses the whole batch with ERESTART when anything
    /// committed there since), and the last message asks for an ACK, which the kernel sends
    /// after the commit: that is the fence, and the generation after it is the guard's next.
    pub fn encode_guarded(&self, first_seq: u32) -> Vec<u8> {
        self.encode_with(first_seq, true)
    }

    fn encode_with(&self, first_seq: u32, guarded: bool) -> Vec<u8> {
        let delimiter =
            |m| NetfilterMessage::new(NetfilterHeader::new(NetfilterProtoFamily::Unspec, 0, NFNL_SUBSYS_NFTABLES), m);
        // Room for a typical message each (a capture rule is 100-250 bytes): growing the
        // buffer message by message copied it a dozen times.
        let mut out = Vec::with_capacity(256 * (self.messages.len() + 2));
        out.extend(crate::netlink::encode(
            delimiter(netlink_packet_netfilter::none::ControlMessage::BatchBegin),
            0,
            first_seq,
        ));
        if guarded {
            // The attribute (length 8, type NFNL_BATCH_GENID) ends the begin marker, whose
            // length grows by it; its value, big-endian, is written at each send.
            debug_assert_eq!(out.len(), GUARD_AT - 4);
            out.extend_from_slice(&8u16.to_ne_bytes());
            out.extend_from_slice(&NFNL_BATCH_GENID.to_ne_bytes());
            out.extend_from_slice(&[0; 4]);
            let len = out.len() as u32;
            out[..4].copy_from_slice(&len.to_ne_bytes());
        }
        let last = self.messages.len().saturating_sub(1);
        for (i, ((part, flags), family)) in self.messages.iter().zip(&self.families).enumerate() {
            let seq = first_seq + 1 + i as u32;
            let flags = if guarded && i == last { *flags | NLM_F_ACK } else { *flags };
            match part {
                Part::Elements { table, set, set_id, keys } => {
                    encode_elements(&mut out, *family, table, set, *set_id, keys, flags, seq)
                }
                Part::Rule(r) => r.write(&mut out, flags, seq),
                // Encoded where it is: a copy made to be encoded was a sixth of a fresh ADD's
                // instructions, with its freeing.
                Part::Message(m) => out.extend(crate::netlink::encode(ByRef::new(*family, m), flags, seq)),
            }
        }
        let end = first_seq + 1 + self.messages.len() as u32;
        out.extend(crate::netlink::encode(delimiter(netlink_packet_netfilter::none::ControlMessage::BatchEnd), 0, end));
        out
    }

    /// Adds the messages of `other` after this batch's own (one transaction of both).
    pub fn append(&mut self, other: Batch) {
        self.messages.extend(other.messages);
        self.labels.extend(other.labels);
        self.needs.extend(other.needs);
        self.families.extend(other.families);
    }

    /// Sequence numbers the batch uses (begin, messages, end).
    /// A batch of `messages` kept only as bytes (`nft::send_bytes`): each is labelled as
    /// such, for the error that names one.
    pub fn unlabelled(messages: usize) -> Batch {
        Batch {
            messages: Vec::new(),
            labels: vec!["a transaction kept as bytes".to_string(); messages],
            needs: vec![Vec::new(); messages],
            families: Vec::new(),
            next_set_id: 0,
        }
    }

    pub fn seq_count(&self) -> u32 {
        self.messages.len() as u32 + 2
    }
}

/// `Part::Elements` as its NEWSETELEM message, written straight into `out`: byte for byte
/// what `netlink::encode` writes of `part.message()` (a test holds them equal), without an
/// attribute list built per element, whose nested lengths the generic encoder measures again
/// at every level above them: that was a fifth of a pod start's CPU at 10,000 Services.
#[allow(clippy::too_many_arguments)]
fn encode_elements(
    out: &mut Vec<u8>,
    family: Family,
    table: &str,
    set: &str,
    set_id: Option<u32>,
    keys: &PackedKeys,
    flags: u16,
    seq: u32,
) {
    use super::abi::{
        DATA_VALUE, DATA_VERDICT, ELEM_DATA, ELEM_FLAGS, ELEM_KEY, LIST_ELEM, NEWSETELEM, SET_ELEM_LIST_ELEMENTS,
        SET_ELEM_LIST_SET, SET_ELEM_LIST_SET_ID, SET_ELEM_LIST_TABLE, VERDICT_CHAIN, VERDICT_CODE,
    };
    use wire::{nla, NESTED};
    let text = |o: &mut Vec<u8>, t: &str| {
        o.extend_from_slice(t.as_bytes());
        o.push(0);
    };
    wire::message(out, NEWSETELEM, flags, seq, family, |out| {
        nla(out, SET_ELEM_LIST_TABLE, |o| text(o, table));
        nla(out, SET_ELEM_LIST_SET, |o| text(o, set));
        if let Some(id) = set_id {
            nla(out, SET_ELEM_LIST_SET_ID, |o| o.extend_from_slice(&id.to_be_bytes()));
        }
        nla(out, SET_ELEM_LIST_ELEMENTS | NESTED, |o| {
            let key_len = keys.key_len.max(1);
            for (i, key) in keys.bytes.chunks(key_len).enumerate() {
                nla(o, LIST_ELEM | NESTED, |o| {
                    nla(o, ELEM_KEY | NESTED, |o| nla(o, DATA_VALUE, |o| o.extend_from_slice(key)));
                    if keys.ends[i] {
                        nla(o, ELEM_FLAGS, |o| {
                            o.extend_from_slice(&(libc::NFT_SET_ELEM_INTERVAL_END as u32).to_be_bytes())
                        });
                    }
                    if let Some(n) = keys.values[i] {
                        nla(o, ELEM_DATA | NESTED, |o| {
                            nla(o, DATA_VALUE, |o| o.extend_from_slice(&key::number_bytes(n)))
                        });
                    }
                    if let Some(chain) = keys.gotos[i] {
                        nla(o, ELEM_DATA | NESTED, |o| {
                            nla(o, DATA_VERDICT | NESTED, |o| {
                                nla(o, VERDICT_CODE, |o| o.extend_from_slice(&(libc::NFT_GOTO as u32).to_be_bytes()));
                                nla(o, VERDICT_CHAIN, |o| text(o, &keys.chains[usize::from(chain)]));
                            })
                        });
                    }
                });
            }
        });
    })
}

/// An nftables message about a table of `family` (`ip` or `ip6`; a dump of that family).
pub(crate) fn message(family: Family, m: NfTablesMessage) -> NetfilterMessage {
    NetfilterMessage::new(header(family), m)
}

fn header(family: Family) -> NetfilterHeader {
    let f = match family {
        Family::Ipv4 => NetfilterProtoFamily::IPv4,
        Family::Ipv6 => NetfilterProtoFamily::IPv6,
    };
    NetfilterHeader::new(f, 0, 0)
}

/// [`message`] of a message the caller keeps: the same bytes as the crate's
/// `NetfilterMessage` (the header, then the message), which would own it.
pub(crate) struct ByRef<'a> {
    header: NetfilterHeader,
    message: &'a NfTablesMessage,
}

impl<'a> ByRef<'a> {
    pub fn new(family: Family, message: &'a NfTablesMessage) -> Self {
        ByRef { header: header(family), message }
    }
}

impl NetlinkSerializable for ByRef<'_> {
    fn message_type(&self) -> u16 {
        (NFNL_SUBSYS_NFTABLES << 8) | u16::from(u8::from(self.message.message_type()))
    }

    fn buffer_len(&self) -> usize {
        self.header.buffer_len() + self.message.buffer_len()
    }

    fn serialize(&self, buffer: &mut [u8]) {
        self.header.emit(buffer);
        self.message.emit(&mut buffer[self.header.buffer_len()..]);
    }
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

fn table_message(name: &str) -> TableMessage {
    TableMessage { attributes: vec![TableAttribute::Name(name.to_string())] }
}

/// The transaction that makes the kernel hold exactly `table`, with its sets, counters,
/// chains and rules; `existing` says what becomes of a table already there. The kernel
/// applies all of it or none.
pub(crate) fn table_batch(table: &model::Table, existing: Existing) -> Batch {
    table_batch_keeping(table, &BTreeMap::new(), existing)
}

/// Several tables in one transaction (a dual-stack pod's two halves), each with the values
/// its named counters start from and what becomes of a table of its family and name the
/// kernel may already hold.
pub(crate) fn tables_batch(tables: &[(&model::Table, &super::Counts, Existing)]) -> Batch {
    let mut b = Batch::default();
    for (table, counters, existing) in tables {
        add_table(&mut b, table, counters, *existing);
    }
    b
}

/// `table_batch`, with the named counters starting from the given (packets, bytes), so a
/// rebuild does not lose what they counted.
pub(crate) fn table_batch_keeping(
    table: &model::Table,
    counters: &BTreeMap<String, (u64, u64)>,
    existing: Existing,
) -> Batch {
    let mut b = Batch::default();
    add_table(&mut b, table, counters, existing);
    b
}

fn add_table(b: &mut Batch, table: &model::Table, counters: &BTreeMap<String, (u64, u64)>, existing: Existing) {
    let family = table.family;
    let label = table_label(family, &table.name);
    let new_table = || NfTablesMessage::NewTable(table_message(&table.name));
    // An error names the object the kernel refused; in the IPv6 table, the table too.
    let named = |what: String| if family == Family::Ipv4 { what } else { format!("{what} of {label}") };
    match existing {
        Existing::Refuse => b.add(family, new_table(), NLM_F_CREATE | NLM_F_EXCL, label.clone()),
        Existing::Replace => {
            b.add(family, new_table(), NLM_F_CREATE, label.clone());
            b.add(family, NfTablesMessage::DeleteTable(table_message(&table.name)), 0, format!("flush of {label}"));
            b.add(family, new_table(), NLM_F_CREATE, label.clone());
        }
    }
    for name in &table.counters {
        let start = counters.get(name).copied().unwrap_or((0, 0));
        b.add(family, counter(&table.name, name, start), NLM_F_CREATE, named(format!("counter {name}")));
        b.needing(vec![&features::COUNTER_OBJECT]);
    }
    let mut ids = Vec::new();
    for set in &table.sets {
        b.next_set_id += 1;
        let id = b.next_set_id;
        ids.push(id);
        b.add(family, set_message(&table.name, set, id), NLM_F_CREATE, named(format!("set {}", set.name)));
        b.needing(features::of_set(set));
    }
    let add_elements = |b: &mut Batch, set: &model::Set, id: u32| {
        // A netlink message holds at most 64 KiB: elements go in chunks.
        for chunk in set.elements.chunks(ELEMENTS_PER_MESSAGE) {
            let keys = PackedKeys::pack(&key::element_keys(set, chunk));
            let part = Part::Elements { table: table.name.clone(), set: set.name.clone(), set_id: Some(id), keys };
            b.add_part(family, part, NLM_F_CREATE, named(format!("elements of set {}", set.name)));
        }
    };
    // A verdict map's elements name chains, so they go after the chains. A data map's go
    // after the rules: a rule that looks a map up binds it, and binding a map walks every
    // element it holds already (`nf_tables_bind_set`; 4% of an ADD's CPU at 10,000 Services,
    // by perf), while an element added to a bound data map is only checked against the
    // binding's register.
    let verdicts = |s: &model::Set| matches!(s.data, model::SetData::Goto(_));
    let numbers = |s: &model::Set| matches!(s.data, model::SetData::Number);
    for (set, id) in table.sets.iter().zip(&ids).filter(|(s, _)| !verdicts(s) && !numbers(s)) {
        add_elements(b, set, *id);
    }
    for c in &table.chains {
        b.add(
            family,
            NfTablesMessage::NewChain(chain(&table.name, c)),
            NLM_F_CREATE,
            named(format!("chain {}", c.name)),
        );
        b.needing(features::of_chain(c));
    }
    for (set, id) in table.sets.iter().zip(&ids).filter(|(s, _)| verdicts(s)) {
        add_elements(b, set, *id);
    }
    for c in &table.chains {
        for (i, r) in c.rules.iter().enumerate() {
            let exprs = rule_exprs(r, family);
            let needs = features::of_rule(&exprs, family);
            b.add_part(
                family,
                rule(family, &table.name, &c.name, r, exprs),
                NLM_F_CREATE | NLM_F_APPEND,
                named(format!("rule {} of chain {} ({})", i + 1, c.name, r.comment)),
            );
            b.needing(needs);
        }
    }
    for (set, id) in table.sets.iter().zip(&ids).filter(|(s, _)| numbers(s)) {
        add_elements(b, set, *id);
    }
}

/// The label of the (first) table message of a table batch.
pub(crate) fn table_label(family: Family, name: &str) -> String {
    format!("table {} {name}", family.nft_name())
}

/// The transaction that deletes `name` (with everything in it).
pub(crate) fn delete_table(family: Family, name: &str) -> Batch {
    let mut b = Batch::default();
    b.add(
        family,
        NfTablesMessage::DeleteTable(table_message(name)),
        0,
        format!("delete of {}", table_label(family, name)),
    );
    b
}

fn counter(table: &str, name: &str, (packets, bytes): (u64, u64)) -> NfTablesMessage {
    NfTablesMessage::NewObject(vec![
        expr::str_attr(OBJ_TABLE, table),
        expr::str_attr(OBJ_NAME, name),
        expr::u32_attr(OBJ_TYPE, NFT_OBJECT_COUNTER),
        expr::nested(OBJ_DATA, &[expr::u64_attr(COUNTER_BYTES, bytes), expr::u64_attr(COUNTER_PACKETS, packets)]),
    ])
}

fn set_message(table: &str, set: &model::Set, id: u32) -> NfTablesMessage {
    let mut attrs = vec![
        SetAttribute::Table(table.to_string()),
        SetAttribute::Name(set.name.clone()),
        SetAttribute::Flags(SetFlags::from_bits_retain(key::set_flags::of(set))),
        SetAttribute::KeyType(set.key.nft_type()),
        SetAttribute::KeyLen(set.key.byte_len()),
        SetAttribute::Id(id),
    ];
    if let Some(t) = set.timeout_secs {
        attrs.push(SetAttribute::Timeout(u64::from(t) * 1000));
    }
    match set.data {
        model::SetData::None => {}
        model::SetData::Number => {
            attrs.push(SetAttribute::DataType(model::KeyType::Mark.nft_type()));
            attrs.push(SetAttribute::DataLen(model::KeyType::Mark.byte_len()));
        }
        model::SetData::Goto(_) => attrs.push(SetAttribute::DataType(key::DATA_VERDICT)),
    }
    NfTablesMessage::NewSet(SetMessage { attributes: attrs })
}

/// A NEWSETELEM or DELSETELEM message; `with_data`: a map's elements carry their numbers or
/// verdicts.
fn elements(table: &str, set: &str, set_id: Option<u32>, keys: &[RawElement], with_data: bool) -> SetElementMessage {
    let mut attrs = vec![SetElementList::Table(table.to_string()), SetElementList::Set(set.to_string())];
    attrs.extend(set_id.map(SetElementList::SetId));
    let elems = keys
        .iter()
        .map(|k| {
            let mut e = vec![SetElementAttribute::Key(DataAttribute::Value(k.key.clone()))];
            if k.end {
                e.push(SetElementAttribute::Flags(SetElementFlags::IntervalEnd));
            }
            if let Some(n) = k.value.filter(|_| with_data) {
                e.push(SetElementAttribute::Data(DataAttribute::Value(key::number_bytes(n).to_vec())));
            }
            if let Some(chain) = k.goto.as_ref().filter(|_| with_data) {
                e.push(SetElementAttribute::Data(DataAttribute::Verdict(vec![
                    VerdictAttribute::Code(Verdict::from(libc::NFT_GOTO as u32)),
                    VerdictAttribute::Chain(chain.clone()),
                ])));
            }
            ListAttribute::Element(e)
        })
        .collect();
    attrs.push(SetElementList::Elements(elems));
    SetElementMessage { attributes: attrs }
}

fn chain(table: &str, c: &model::Chain) -> ChainMessage {
    let mut attrs = vec![ChainAttribute::Table(table.to_string()), ChainAttribute::Name(c.name.clone())];
    if let Some(h) = c.hook {
        attrs.push(ChainAttribute::Hook(vec![
            Hook::Number(HookNumber::Inet(InetHookNumber::from(h.hook.number()))),
            Hook::Priority(h.priority as u32),
        ]));
        attrs.push(ChainAttribute::Policy(libc::NF_ACCEPT as u32));
        attrs.push(ChainAttribute::Type(h.kind.name().to_string()));
    }
    ChainMessage { attributes: attrs }
}

/// A rule's expressions, as lowered from the model.
pub(crate) fn rule_exprs(r: &model::Rule, family: Family) -> Vec<Expr> {
    let mut out: Vec<Expr> = r.matches.iter().flat_map(|m| lower_match(m, family)).collect();
    out.extend(lower_action(&r.action, family));
    out
}

fn rule(family: Family, table: &str, chain: &str, r: &model::Rule, exprs: Vec<Expr>) -> Part {
    Part::Rule(Rule { family, table: table.to_string(), chain: chain.to_string(), exprs, comment: r.comment.clone() })
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Rule {
        /// The rule as the crate's generic encoder writes it, of the crate's attributes.
        fn generic(&self, flags: u16, seq: u32) -> Vec<u8> {
            use netlink_packet_netfilter::nftables::{RuleAttribute, RuleMessage};
            let mut udata = Vec::new();
            comment_udata(&mut udata, &self.comment);
            let m = RuleMessage {
                attributes: vec![
                    RuleAttribute::Table(self.table.clone()),
                    RuleAttribute::Chain(self.chain.clone()),
                    RuleAttribute::Expressions(self.exprs.iter().map(Expr::encode).collect()),
                    RuleAttribute::UserData(udata),
                ],
            };
            crate::netlink::encode(message(self.family, NfTablesMessage::NewRule(m)), flags, seq)
        }

        fn written(&self, flags: u16, seq: u32) -> Vec<u8> {
            let mut out = vec![9; 3];
            self.write(&mut out, flags, seq);
            assert_eq!(out[..3], [9; 3], "what was in the buffer before is kept");
            out.split_off(3)
        }
    }

    /// Every expression type with every optional part, data that needs padding and data
    /// that does not: what `lower_*` makes today and what it could (a lookup whose value goes
    /// to a data register, keying the next lookup).
    fn every_expression() -> Vec<Expr> {
        vec![
            Expr::Payload { base: 1, offset: 16, len: 4, dreg: 1 },
            Expr::Meta { key: 3, dreg: 9 },
            Expr::MetaSet { key: 3, sreg: 1 },
            Expr::Ct { key: 0, dreg: 1 },
            Expr::CtSet { key: 3, sreg: 2 },
            Expr::Cmp { sreg: 1, op: 0, data: vec![6] },
            Expr::Cmp { sreg: 1, op: 1, data: vec![1, 2, 3, 4, 5] },
            Expr::Bitwise { sreg: 1, dreg: 2, mask: vec![2], xor: vec![0] },
            Expr::Bitwise { sreg: 1, dreg: 1, mask: vec![0xff; 16], xor: vec![0; 16] },
            Expr::Immediate { dreg: 2, data: vec![0x1f, 0x90] },
            Expr::Immediate { dreg: 1, data: (0..16).collect() },
            Expr::Verdict { code: libc::NF_ACCEPT, chain: None },
            Expr::Verdict { code: libc::NFT_JUMP, chain: Some("egress_divert".into()) },
            Expr::Verdict { code: libc::NFT_GOTO, chain: Some("ab".into()) },
            Expr::Lookup { set: "excluded_v4".into(), sreg: 1, dreg: None, invert: true },
            Expr::Lookup { set: "service_vips".into(), sreg: 1, dreg: Some(9), invert: false },
            Expr::Lookup { set: "profile_chains".into(), sreg: 9, dreg: Some(expr::REG_VERDICT), invert: false },
            Expr::Objref { kind: NFT_OBJECT_COUNTER, name: "refused".into() },
            Expr::Dynset { set: "seen".into(), op: 1, sreg_key: 9, timeout_ms: 60_000, flags: 0 },
            Expr::Reject { kind: 1, code: 0 },
            Expr::Reject { kind: 0, code: 3 },
            Expr::Tproxy { family: 2, reg_addr: Some(1), reg_port: Some(2) },
            Expr::Tproxy { family: 10, reg_addr: None, reg_port: Some(1) },
            Expr::Nat { kind: 1, family: 2, reg_addr: Some((1, 1)), reg_proto: Some((2, 2)), flags: 3 },
            Expr::Nat { kind: 0, family: 10, reg_addr: None, reg_proto: None, flags: 0 },
            Expr::Other { name: "quota".into(), attributes: vec![(1, vec![0; 8]), (2, vec![7])] },
        ]
    }

    /// The rule writer writes what the generic encoder writes of the same rule: every rule
    /// of every capture mode and of the Service layer, in both families, and one of every
    /// expression type. The control: one expression changed on one side only is seen.
    #[test]
    fn rules_written_directly_are_the_generic_encoders_bytes() {
        let mut rules = Vec::new();
        for t in crate::nft::tests::all_tables() {
            for part in table_batch(&t, Existing::Refuse).messages.into_iter().map(|(p, _)| p) {
                if let Part::Rule(r) = part {
                    rules.push(r);
                }
            }
        }
        assert!(rules.len() > 100, "only {} rules", rules.len());
        let every = every_expression();
        for family in Family::ALL {
            for n in [0, 1, every.len()] {
                let (table, chain) = ("aether_capture", "egress");
                let comment = "every expression".chars().take(n).collect();
                rules.push(Rule {
                    family,
                    table: table.into(),
                    chain: chain.into(),
                    exprs: every[..n].to_vec(),
                    comment,
                });
            }
        }
        for (i, r) in rules.iter().enumerate() {
            let flags = NLM_F_CREATE | NLM_F_APPEND;
            assert_eq!(r.written(flags, 42 + i as u32), r.generic(flags, 42 + i as u32), "rule {i}: {:?}", r.exprs);
        }
        let last = rules.last_mut().unwrap();
        let generic = last.generic(0, 1);
        last.exprs[15] = Expr::Lookup { set: "service_vips".into(), sreg: 1, dreg: Some(10), invert: false };
        assert_ne!(last.written(0, 1), generic, "a lookup's other register changes the bytes");
    }

    /// The direct encoder writes what the generic one writes of the same elements: keys
    /// that need padding and keys that do not, interval ends, a data map's numbers, verdicts
    /// to several chains, with and without a set ID, both families, none at all.
    #[test]
    fn elements_encoded_directly_are_the_generic_encoders_bytes() {
        let element = |i: usize, len: usize, end: bool, value: Option<u32>, goto: Option<&str>| RawElement {
            key: (0..len).map(|b| (b ^ i) as u8).collect(),
            end,
            value,
            goto: goto.map(String::from),
        };
        let chains = ["ports_tcp80", "ports_tcp80_tcp8081-noep", "by_key"];
        let cases: Vec<Vec<RawElement>> = vec![
            (0..256).map(|i| element(i, 4, false, None, None)).collect(),
            (0..40).map(|i| element(i, 13, i % 2 == 1, None, None)).collect(),
            (0..50).map(|i| element(i, 12, false, None, Some(chains[i % 3]))).collect(),
            (0..7).map(|i| element(i, 20, false, None, Some("c"))).collect(),
            (0..256).map(|i| element(i, 4, false, Some((i % 5) as u32), None)).collect(),
            (0..30).map(|i| element(i, 16, false, Some(u32::MAX - i as u32), None)).collect(),
            vec![],
        ];
        let (table, set) = ("aether_services", "service_vips");
        let both = |keys: &[RawElement], family, set_id| {
            let part = Part::Elements { table: table.into(), set: set.into(), set_id, keys: PackedKeys::pack(keys) };
            let generic = crate::netlink::encode(message(family, part.message()), NLM_F_CREATE, 42);
            let Part::Elements { keys, .. } = &part else { unreachable!() };
            let mut direct = vec![1, 2, 3, 4];
            encode_elements(&mut direct, family, table, set, set_id, keys, NLM_F_CREATE, 42);
            assert_eq!(&direct[..4], &[1, 2, 3, 4], "what was in the buffer before is kept");
            (direct[4..].to_vec(), generic)
        };
        for keys in &cases {
            for family in [Family::Ipv4, Family::Ipv6] {
                for set_id in [None, Some(7)] {
                    let (direct, generic) = both(keys, family, set_id);
                    assert_eq!(direct, generic, "{family:?}, set id {set_id:?}, {} elements", keys.len());
                }
            }
        }
        // The control: one element's number changed on one side only is seen.
        let mut other = cases[4].clone();
        other[100].value = Some(99);
        let (direct, _) = both(&cases[4], Family::Ipv4, None);
        let (_, generic) = both(&other, Family::Ipv4, None);
        assert_ne!(direct, generic, "a changed number changes the bytes");
    }
}
