//! nftables expressions at the register level, as one typed enum: the model lowers to it,
//! it encodes to netlink attributes, and the kernel's dumps decode back to it. CHECK compares
//! these values, and prints them in the notation of `Display` (`notation`; see docs/cni.md).
//!
//! The crate's types (`netlink-packet-netfilter`) encode payload, meta, cmp, bitwise,
//! immediate and lookup; `ct`, `tproxy`, `nat`, `objref`, `dynset` and `reject` are small
//! attribute encoders of ours, numbered after `linux/netfilter/nf_tables.h`.
//!
//! Each model `Match`/`Action` lowers to the same register sequence `nft` itself generates,
//! so `nft list ruleset` prints our rules in its ordinary notation.

use netlink_packet_core::{DefaultNla, Nla, NLA_F_NESTED, NLA_TYPE_MASK};
use netlink_packet_netfilter::nftables::{
    Bitwise, Cmp, DataAttribute, ExpressionAttribute, Expressions, Immediate, ListAttribute, Lookup, Meta, Payload,
    VerdictAttribute,
};

use super::key;
use crate::family::Family;
use crate::model::{Action, Match};

pub use super::reg::{Reg, REG_1, REG_2, REG_VERDICT};

/// `NF_CT_STATE_BIT(IP_CT_NEW)`
const CT_STATE_NEW_BIT: u32 = 1 << 3;
/// `IPS_CONFIRMED`: set once the first packet of a flow has left the stack.
const CT_STATUS_CONFIRMED: u32 = 1 << 3;
const IP_CT_DIR_REPLY: u8 = 1;
/// The SYN bit of the TCP flags byte (offset 13 of the TCP header).
const TCP_FLAG_SYN: u8 = 0x02;
pub(super) const TCP_FLAGS_OFFSET: u32 = 13;
const LOOPBACK_IFINDEX: u32 = 1;
pub const NFT_OBJECT_COUNTER: u32 = 1;
pub(super) const NFT_DYNSET_OP_UPDATE: u32 = 1;
pub(super) const NFT_REJECT_ICMP_UNREACH: u32 = 0;
pub(super) const NFT_REJECT_TCP_RST: u32 = 1;
const ICMP_PORT_UNREACH: u8 = 3;
/// ICMPv6 destination unreachable, code 4: port unreachable (what `reject` sends in `ip6`).
const ICMPV6_PORT_UNREACH: u8 = 4;
/// nf_nat range flags: the kernel sets both when address and port registers are given and
/// reports them in dumps, so sending them keeps what we send equal to what we read back.
const NAT_RANGE_MAP_IPS: u32 = 1;
const NAT_RANGE_PROTO_SPECIFIED: u32 = 2;
const NFT_LOOKUP_F_INV: u32 = 1;
pub(super) const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
pub(super) const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;

/// Attribute numbers of the expressions the crate does not know (nf_tables.h).
mod attr {
    pub const CT_DREG: u16 = 1;
    pub const CT_KEY: u16 = 2;
    pub const CT_SREG: u16 = 4;
    pub const TPROXY_FAMILY: u16 = 1;
    pub const TPROXY_REG_ADDR: u16 = 2;
    pub const TPROXY_REG_PORT: u16 = 3;
    pub const NAT_TYPE: u16 = 1;
    pub const NAT_FAMILY: u16 = 2;
    pub const NAT_REG_ADDR_MIN: u16 = 3;
    pub const NAT_REG_ADDR_MAX: u16 = 4;
    pub const NAT_REG_PROTO_MIN: u16 = 5;
    pub const NAT_REG_PROTO_MAX: u16 = 6;
    pub const NAT_FLAGS: u16 = 7;
    pub const OBJREF_IMM_TYPE: u16 = 1;
    pub const OBJREF_IMM_NAME: u16 = 2;
    pub const DYNSET_SET_NAME: u16 = 1;
    pub const DYNSET_OP: u16 = 3;
    pub const DYNSET_SREG_KEY: u16 = 4;
    pub const DYNSET_TIMEOUT: u16 = 6;
    pub const DYNSET_FLAGS: u16 = 9;
    pub const REJECT_TYPE: u16 = 1;
    pub const REJECT_ICMP_CODE: u16 = 2;
    // The expressions the crate knows, for our writer (`Expr::write`).
    pub const PAYLOAD_DREG: u16 = 1;
    pub const PAYLOAD_BASE: u16 = 2;
    pub const PAYLOAD_OFFSET: u16 = 3;
    pub const PAYLOAD_LEN: u16 = 4;
    pub const META_DREG: u16 = 1;
    pub const META_KEY: u16 = 2;
    pub const META_SREG: u16 = 3;
    pub const CMP_SREG: u16 = 1;
    pub const CMP_OP: u16 = 2;
    pub const CMP_DATA: u16 = 3;
    pub const BITWISE_SREG: u16 = 1;
    pub const BITWISE_DREG: u16 = 2;
    pub const BITWISE_LEN: u16 = 3;
    pub const BITWISE_MASK: u16 = 4;
    pub const BITWISE_XOR: u16 = 5;
    pub const IMMEDIATE_DREG: u16 = 1;
    pub const IMMEDIATE_DATA: u16 = 2;
    pub const LOOKUP_SET: u16 = 1;
    pub const LOOKUP_SREG: u16 = 2;
    pub const LOOKUP_DREG: u16 = 3;
    pub const LOOKUP_FLAGS: u16 = 5;
}

/// One expression of a rule, with everything the kernel reports about it. Attributes the
/// kernel fills in with a default when they are not sent (lookup and dynset flags, dynset
/// timeout) decode to that default, so what we send and what we read back compare equal
/// whatever order or completeness the dump has.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Expr {
    /// Load `len` bytes at `offset` of a header (`base`: 0 link, 1 network, 2 transport).
    Payload { base: u32, offset: u32, len: u32, dreg: Reg },
    /// Load a meta key (`NFT_META_*`).
    Meta { key: u32, dreg: Reg },
    /// Set a meta key from a register.
    MetaSet { key: u32, sreg: Reg },
    /// Load a conntrack key (`NFT_CT_*`).
    Ct { key: u32, dreg: Reg },
    /// Set a conntrack key (`NFT_CT_MARK`) from a register.
    CtSet { key: u32, sreg: Reg },
    /// Compare a register with `data` (`op`: `NFT_CMP_*`).
    Cmp { sreg: Reg, op: u32, data: Vec<u8> },
    /// `dreg = (sreg & mask) ^ xor`
    Bitwise { sreg: Reg, dreg: Reg, mask: Vec<u8>, xor: Vec<u8> },
    /// Load `data` into a register.
    Immediate { dreg: Reg, data: Vec<u8> },
    /// A verdict: accept (1), drop (0), jump (-3) or goto (-4) to `chain`, return (-5)...
    Verdict { code: i32, chain: Option<String> },
    /// The key in `sreg` (and the registers after it, for a concatenation) is in the set,
    /// or with `invert` is not; with `dreg`, the map's value for it goes there (`REG_VERDICT`:
    /// a verdict map's verdict).
    Lookup { set: String, sreg: Reg, dreg: Option<Reg>, invert: bool },
    /// Use a named stateful object (`NFT_OBJECT_COUNTER`: count in it).
    Objref { kind: u32, name: String },
    /// Add the key in `sreg_key` to the set, or refresh it (`op`: `NFT_DYNSET_OP_*`);
    /// `timeout_ms` 0 means the set's own.
    Dynset { set: String, op: u32, sreg_key: Reg, timeout_ms: u64, flags: u32 },
    /// Reject (`kind`: `NFT_REJECT_*`) with an ICMP `code`.
    Reject { kind: u32, code: u8 },
    /// Assign the packet to the transparent socket at the address/port in these registers.
    Tproxy { family: u32, reg_addr: Option<Reg>, reg_port: Option<Reg> },
    /// NAT (`kind`: `NFT_NAT_*`) to the address and port ranges in these registers.
    Nat { kind: u32, family: u32, reg_addr: Option<(Reg, Reg)>, reg_proto: Option<(Reg, Reg)>, flags: u32 },
    /// Anything else: its name and raw attributes (type, bytes).
    Other { name: String, attributes: Vec<(u16, Vec<u8>)> },
}

/// The destination address in the network header: IPv4's at 16 (4 bytes), IPv6's at 24 (16).
fn daddr(family: Family, dreg: Reg) -> Expr {
    let (offset, len) = match family {
        Family::Ipv4 => (16, 4),
        Family::Ipv6 => (24, 16),
    };
    Expr::Payload { base: NFT_PAYLOAD_NETWORK_HEADER, offset, len, dreg }
}

/// A match's expressions in a table of `family`.
pub(crate) fn lower_match(m: &Match, family: Family) -> Vec<Expr> {
    let meta = |key: i32| Expr::Meta { key: key as u32, dreg: REG_1 };
    let eq = |data: Vec<u8>| Expr::Cmp { sreg: REG_1, op: libc::NFT_CMP_EQ as u32, data };
    let l4proto = |p: crate::model::Proto| vec![meta(libc::NFT_META_L4PROTO), eq(vec![p.number()])];
    let dport = || Expr::Payload { base: NFT_PAYLOAD_TRANSPORT_HEADER, offset: 2, len: 2, dreg: REG_1 };
    let daddr = || daddr(family, REG_1);
    let lookup = |set: &String, invert: bool| Expr::Lookup { set: set.clone(), sreg: REG_1, dreg: None, invert };
    let ct = |key: i32| Expr::Ct { key: key as u32, dreg: REG_1 };
    let bits =
        |mask: u32| Expr::Bitwise { sreg: REG_1, dreg: REG_1, mask: mask.to_ne_bytes().to_vec(), xor: vec![0; 4] };
    match m {
        Match::CtDirectionReply => vec![ct(libc::NFT_CT_DIRECTION), eq(vec![IP_CT_DIR_REPLY])],
        Match::Mark(mark) => vec![meta(libc::NFT_META_MARK), eq(mark.to_ne_bytes().to_vec())],
        Match::InputLoopback => vec![meta(libc::NFT_META_IIF), eq(LOOPBACK_IFINDEX.to_ne_bytes().to_vec())],
        Match::DaddrInSet(set) => vec![daddr(), lookup(set, false)],
        Match::DaddrNotInSet(set) => vec![daddr(), lookup(set, true)],
        Match::L4ProtoNotInSet(set) => vec![meta(libc::NFT_META_L4PROTO), lookup(set, true)],
        // Only the very first packet of a flow sees its conntrack entry unconfirmed: later
        // packets of a UDP flow stay `new` until a reply, but are confirmed.
        Match::CtUnconfirmed => vec![ct(libc::NFT_CT_STATUS), bits(CT_STATUS_CONFIRMED), eq(vec![0; 4])],
        Match::CtStateNew => vec![
            ct(libc::NFT_CT_STATE),
            bits(CT_STATE_NEW_BIT),
            Expr::Cmp { sreg: REG_1, op: libc::NFT_CMP_NEQ as u32, data: vec![0; 4] },
        ],
        Match::CtMark(mark) => vec![ct(libc::NFT_CT_MARK), eq(mark.to_ne_bytes().to_vec())],
        // What nft generates for `tcp flags ! syn`: the flags byte, masked, compared with 0.
        Match::TcpWithoutSyn => {
            let mut e = l4proto(crate::model::Proto::Tcp);
            e.extend([
                Expr::Payload { base: NFT_PAYLOAD_TRANSPORT_HEADER, offset: TCP_FLAGS_OFFSET, len: 1, dreg: REG_1 },
                Expr::Bitwise { sreg: REG_1, dreg: REG_1, mask: vec![TCP_FLAG_SYN], xor: vec![0] },
                eq(vec![0]),
            ]);
            e
        }
        Match::ServiceKeyInSet(set) => {
            let mut e = service_key(family);
            e.push(lookup(set, false));
            e
        }
        Match::L4Proto(p) => l4proto(*p),
        Match::Dport(p, port) => {
            let mut e = l4proto(*p);
            e.extend([dport(), eq(port.to_be_bytes().to_vec())]);
            e
        }
        Match::DportInSet(p, set) => {
            let mut e = l4proto(*p);
            e.extend([dport(), lookup(set, false)]);
            e
        }
    }
}

/// `ip daddr . meta l4proto . th dport` (`ip6 daddr` in an IPv6 table) into the registers
/// of `key::service_key_registers`.
fn service_key(family: Family) -> Vec<Expr> {
    let [addr, proto, port] = key::service_key_registers(family);
    vec![
        daddr(family, addr),
        Expr::Meta { key: libc::NFT_META_L4PROTO as u32, dreg: proto },
        Expr::Payload { base: NFT_PAYLOAD_TRANSPORT_HEADER, offset: 2, len: 2, dreg: port },
    ]
}

/// An action's expressions in a table of `family` (tproxy and NAT name the family).
pub(crate) fn lower_action(a: &Action, family: Family) -> Vec<Expr> {
    let nfproto = u32::from(family.nfproto());
    let accept = || Expr::Verdict { code: libc::NF_ACCEPT, chain: None };
    let jump = |c: &String| Expr::Verdict { code: libc::NFT_JUMP, chain: Some(c.clone()) };
    let counter = |c: &String| Expr::Objref { kind: NFT_OBJECT_COUNTER, name: c.clone() };
    match a {
        Action::Accept => vec![accept()],
        Action::SetMarkAccept(mark) => vec![
            Expr::Immediate { dreg: REG_1, data: mark.to_ne_bytes().to_vec() },
            Expr::MetaSet { key: libc::NFT_META_MARK as u32, sreg: REG_1 },
            accept(),
        ],
        Action::SetCtMarkAccept(mark) => vec![
            Expr::Immediate { dreg: REG_1, data: mark.to_ne_bytes().to_vec() },
            Expr::CtSet { key: libc::NFT_CT_MARK as u32, sreg: REG_1 },
            accept(),
        ],
        Action::TproxyAccept(port) => vec![
            Expr::Immediate { dreg: REG_1, data: port.to_be_bytes().to_vec() },
            Expr::Tproxy { family: nfproto, reg_addr: None, reg_port: Some(REG_1) },
            accept(),
        ],
        Action::Dnat(addr, port) => vec![
            Expr::Immediate {
                dreg: REG_1,
                data: match addr {
                    std::net::IpAddr::V4(a) => a.octets().to_vec(),
                    std::net::IpAddr::V6(a) => a.octets().to_vec(),
                },
            },
            Expr::Immediate { dreg: REG_2, data: port.to_be_bytes().to_vec() },
            // The kernel fills the range maxima from the minima and reports them.
            Expr::Nat {
                kind: libc::NFT_NAT_DNAT as u32,
                family: nfproto,
                reg_addr: Some((REG_1, REG_1)),
                reg_proto: Some((REG_2, REG_2)),
                flags: NAT_RANGE_MAP_IPS | NAT_RANGE_PROTO_SPECIFIED,
            },
        ],
        Action::Jump(chain) => vec![jump(chain)],
        Action::CountAccept(c) => vec![counter(c), accept()],
        Action::CountJump(c, chain) => vec![counter(c), jump(chain)],
        // The number the data map gives the address, into the mark and loaded back as the
        // verdict map's key: what nft itself makes of the rule (see the action).
        Action::DaddrMapVmap { map, vmap } => vec![
            daddr(family, REG_1),
            Expr::Lookup { set: map.clone(), sreg: REG_1, dreg: Some(REG_1), invert: false },
            Expr::MetaSet { key: libc::NFT_META_MARK as u32, sreg: REG_1 },
            Expr::Meta { key: libc::NFT_META_MARK as u32, dreg: REG_1 },
            Expr::Lookup { set: vmap.clone(), sreg: REG_1, dreg: Some(REG_VERDICT), invert: false },
        ],
        Action::SetMark(mark) => vec![
            Expr::Immediate { dreg: REG_1, data: mark.to_ne_bytes().to_vec() },
            Expr::MetaSet { key: libc::NFT_META_MARK as u32, sreg: REG_1 },
        ],
        Action::UpdateServiceKeySet(set) => {
            let mut e = service_key(family);
            e.push(Expr::Dynset {
                set: set.clone(),
                op: NFT_DYNSET_OP_UPDATE,
                sreg_key: key::service_key_registers(family)[0],
                timeout_ms: 0,
                flags: 0,
            });
            e
        }
        Action::RejectTcpReset => vec![Expr::Reject { kind: NFT_REJECT_TCP_RST, code: 0 }],
        Action::RejectIcmpPortUnreachable => vec![Expr::Reject {
            kind: NFT_REJECT_ICMP_UNREACH,
            code: match family {
                Family::Ipv4 => ICMP_PORT_UNREACH,
                Family::Ipv6 => ICMPV6_PORT_UNREACH,
            },
        }],
    }
}

// ---- encoding ----

pub(crate) fn u32_attr(kind: u16, v: u32) -> DefaultNla {
    DefaultNla::new(kind, v.to_be_bytes().to_vec())
}

pub(crate) fn u64_attr(kind: u16, v: u64) -> DefaultNla {
    DefaultNla::new(kind, v.to_be_bytes().to_vec())
}

pub(crate) fn str_attr(kind: u16, s: &str) -> DefaultNla {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    DefaultNla::new(kind, v)
}

impl Expr {
    /// The expression's type, as nf_tables names it.
    fn name(&self) -> &str {
        match self {
            Expr::Payload { .. } => "payload",
            Expr::Meta { .. } | Expr::MetaSet { .. } => "meta",
            Expr::Ct { .. } | Expr::CtSet { .. } => "ct",
            Expr::Cmp { .. } => "cmp",
            Expr::Bitwise { .. } => "bitwise",
            Expr::Immediate { .. } | Expr::Verdict { .. } => "immediate",
            Expr::Lookup { .. } => "lookup",
            Expr::Objref { .. } => "objref",
            Expr::Dynset { .. } => "dynset",
            Expr::Reject { .. } => "reject",
            Expr::Tproxy { .. } => "tproxy",
            Expr::Nat { .. } => "nat",
            Expr::Other { name, .. } => name,
        }
    }

    /// The expression as one element of `NFTA_RULE_EXPRESSIONS`, written into `out`: the
    /// bytes the crate's generic encoder writes of [`Expr::encode`] (a test holds them equal),
    /// each written once, where the generic encoder measures every nested attribute again at
    /// each level above it.
    pub(crate) fn write(&self, out: &mut Vec<u8>) {
        use super::abi::{EXPR_DATA, EXPR_NAME, LIST_ELEM};
        use super::wire::{nla, text, NESTED};
        nla(out, LIST_ELEM | NESTED, |o| {
            text(o, EXPR_NAME, self.name());
            nla(o, EXPR_DATA | NESTED, |o| self.write_data(o));
        })
    }

    fn write_data(&self, o: &mut Vec<u8>) {
        use super::abi::{DATA_VALUE, DATA_VERDICT, VERDICT_CHAIN, VERDICT_CODE};
        use super::wire::{be32, be64, bytes, nla, text, NESTED};
        use attr::*;
        let value = |o: &mut Vec<u8>, kind: u16, d: &[u8]| nla(o, kind | NESTED, |o| bytes(o, DATA_VALUE, d));
        match self {
            Expr::Payload { base, offset, len, dreg } => {
                be32(o, PAYLOAD_DREG, *dreg);
                be32(o, PAYLOAD_BASE, *base);
                be32(o, PAYLOAD_OFFSET, *offset);
                be32(o, PAYLOAD_LEN, *len);
            }
            Expr::Meta { key, dreg } => {
                be32(o, META_KEY, *key);
                be32(o, META_DREG, *dreg);
            }
            Expr::MetaSet { key, sreg } => {
                be32(o, META_KEY, *key);
                be32(o, META_SREG, *sreg);
            }
            Expr::Cmp { sreg, op, data } => {
                be32(o, CMP_SREG, *sreg);
                be32(o, CMP_OP, *op);
                value(o, CMP_DATA, data);
            }
            Expr::Bitwise { sreg, dreg, mask, xor } => {
                be32(o, BITWISE_SREG, *sreg);
                be32(o, BITWISE_DREG, *dreg);
                be32(o, BITWISE_LEN, mask.len() as u32);
                value(o, BITWISE_MASK, mask);
                value(o, BITWISE_XOR, xor);
            }
            Expr::Immediate { dreg, data } => {
                be32(o, IMMEDIATE_DREG, *dreg);
                value(o, IMMEDIATE_DATA, data);
            }
            Expr::Verdict { code, chain } => {
                be32(o, IMMEDIATE_DREG, REG_VERDICT);
                nla(o, IMMEDIATE_DATA | NESTED, |o| {
                    nla(o, DATA_VERDICT | NESTED, |o| {
                        be32(o, VERDICT_CODE, *code as u32);
                        if let Some(c) = chain {
                            text(o, VERDICT_CHAIN, c);
                        }
                    })
                });
            }
            Expr::Lookup { set, sreg, dreg, invert } => {
                be32(o, LOOKUP_SREG, *sreg);
                text(o, LOOKUP_SET, set);
                if let Some(d) = dreg {
                    be32(o, LOOKUP_DREG, *d);
                }
                // The kernel always reports the flags word.
                be32(o, LOOKUP_FLAGS, if *invert { NFT_LOOKUP_F_INV } else { 0 });
            }
            Expr::Ct { key, dreg } => {
                be32(o, CT_KEY, *key);
                be32(o, CT_DREG, *dreg);
            }
            Expr::CtSet { key, sreg } => {
                be32(o, CT_KEY, *key);
                be32(o, CT_SREG, *sreg);
            }
            Expr::Objref { kind, name } => {
                be32(o, OBJREF_IMM_TYPE, *kind);
                text(o, OBJREF_IMM_NAME, name);
            }
            Expr::Dynset { set, op, sreg_key, timeout_ms, flags } => {
                be32(o, DYNSET_SREG_KEY, *sreg_key);
                be32(o, DYNSET_OP, *op);
                text(o, DYNSET_SET_NAME, set);
                be32(o, DYNSET_FLAGS, *flags);
                be64(o, DYNSET_TIMEOUT, *timeout_ms);
            }
            Expr::Reject { kind, code } => {
                be32(o, REJECT_TYPE, *kind);
                bytes(o, REJECT_ICMP_CODE, &[*code]);
            }
            Expr::Tproxy { family, reg_addr, reg_port } => {
                be32(o, TPROXY_FAMILY, *family);
                if let Some(r) = reg_addr {
                    be32(o, TPROXY_REG_ADDR, *r);
                }
                if let Some(r) = reg_port {
                    be32(o, TPROXY_REG_PORT, *r);
                }
            }
            Expr::Nat { kind, family, reg_addr, reg_proto, flags } => {
                be32(o, NAT_TYPE, *kind);
                be32(o, NAT_FAMILY, *family);
                if let Some((min, max)) = reg_addr {
                    be32(o, NAT_REG_ADDR_MIN, *min);
                    be32(o, NAT_REG_ADDR_MAX, *max);
                }
                if let Some((min, max)) = reg_proto {
                    be32(o, NAT_REG_PROTO_MIN, *min);
                    be32(o, NAT_REG_PROTO_MAX, *max);
                }
                be32(o, NAT_FLAGS, *flags);
            }
            Expr::Other { attributes, .. } => {
                for (kind, v) in attributes {
                    bytes(o, *kind, v);
                }
            }
        }
    }

    /// The expression as the crate's generic encoder takes it: the reference the tests hold
    /// [`Expr::write`]'s bytes against.
    #[cfg(test)]
    pub(crate) fn encode(&self) -> ListAttribute<ExpressionAttribute> {
        use netlink_packet_netfilter::nftables::{MetaKey, Operator, Register, Verdict};
        fn other(name: &str, attributes: Vec<DefaultNla>) -> Expressions {
            Expressions::Other { expression_type: name.to_string(), attributes }
        }
        let reg = Register::from;
        let value = |d: &[u8]| DataAttribute::Value(d.to_vec());
        let data = match self {
            Expr::Payload { base, offset, len, dreg } => Expressions::Payload(vec![
                Payload::DestinationRegister(reg(*dreg)),
                Payload::Base(*base),
                Payload::Offset(*offset),
                Payload::Len(*len),
            ]),
            Expr::Meta { key, dreg } => {
                Expressions::Meta(vec![Meta::Key(MetaKey::from(*key)), Meta::DestinationRegister(reg(*dreg))])
            }
            Expr::MetaSet { key, sreg } => {
                Expressions::Meta(vec![Meta::Key(MetaKey::from(*key)), Meta::SourceRegister(reg(*sreg))])
            }
            Expr::Cmp { sreg, op, data } => Expressions::Cmp(vec![
                Cmp::SourceRegister(reg(*sreg)),
                Cmp::Op(Operator::from(*op)),
                Cmp::Data(value(data)),
            ]),
            Expr::Bitwise { sreg, dreg, mask, xor } => Expressions::Bitwise(vec![
                Bitwise::SourceRegister(reg(*sreg)),
                Bitwise::DestinationRegister(reg(*dreg)),
                Bitwise::Length(mask.len() as u32),
                Bitwise::Mask(value(mask)),
                Bitwise::Xor(value(xor)),
            ]),
            Expr::Immediate { dreg, data } => {
                Expressions::Immediate(vec![Immediate::DestinationRegister(reg(*dreg)), Immediate::Data(value(data))])
            }
            Expr::Verdict { code, chain } => {
                let mut v = vec![VerdictAttribute::Code(Verdict::from(*code as u32))];
                v.extend(chain.iter().map(|c| VerdictAttribute::Chain(c.clone())));
                Expressions::Immediate(vec![
                    Immediate::DestinationRegister(Register::Verdict),
                    Immediate::Data(DataAttribute::Verdict(v)),
                ])
            }
            Expr::Lookup { set, sreg, dreg, invert } => {
                let mut attrs = vec![Lookup::SourceRegister(reg(*sreg)), Lookup::Set(set.clone())];
                attrs.extend(dreg.map(|d| Lookup::DestinationRegister(reg(d))));
                // The kernel always reports the flags word.
                attrs.push(Lookup::Flags(if *invert { NFT_LOOKUP_F_INV } else { 0 }));
                Expressions::Lookup(attrs)
            }
            Expr::Ct { key, dreg } => other("ct", vec![u32_attr(attr::CT_KEY, *key), u32_attr(attr::CT_DREG, *dreg)]),
            Expr::CtSet { key, sreg } => {
                other("ct", vec![u32_attr(attr::CT_KEY, *key), u32_attr(attr::CT_SREG, *sreg)])
            }
            Expr::Objref { kind, name } => {
                other("objref", vec![u32_attr(attr::OBJREF_IMM_TYPE, *kind), str_attr(attr::OBJREF_IMM_NAME, name)])
            }
            Expr::Dynset { set, op, sreg_key, timeout_ms, flags } => other(
                "dynset",
                vec![
                    u32_attr(attr::DYNSET_SREG_KEY, *sreg_key),
                    u32_attr(attr::DYNSET_OP, *op),
                    str_attr(attr::DYNSET_SET_NAME, set),
                    u32_attr(attr::DYNSET_FLAGS, *flags),
                    u64_attr(attr::DYNSET_TIMEOUT, *timeout_ms),
                ],
            ),
            Expr::Reject { kind, code } => other(
                "reject",
                vec![u32_attr(attr::REJECT_TYPE, *kind), DefaultNla::new(attr::REJECT_ICMP_CODE, vec![*code])],
            ),
            Expr::Tproxy { family, reg_addr, reg_port } => {
                let mut a = vec![u32_attr(attr::TPROXY_FAMILY, *family)];
                a.extend(reg_addr.map(|r| u32_attr(attr::TPROXY_REG_ADDR, r)));
                a.extend(reg_port.map(|r| u32_attr(attr::TPROXY_REG_PORT, r)));
                other("tproxy", a)
            }
            Expr::Nat { kind, family, reg_addr, reg_proto, flags } => {
                let mut a = vec![u32_attr(attr::NAT_TYPE, *kind), u32_attr(attr::NAT_FAMILY, *family)];
                if let Some((min, max)) = reg_addr {
                    a.extend([u32_attr(attr::NAT_REG_ADDR_MIN, *min), u32_attr(attr::NAT_REG_ADDR_MAX, *max)]);
                }
                if let Some((min, max)) = reg_proto {
                    a.extend([u32_attr(attr::NAT_REG_PROTO_MIN, *min), u32_attr(attr::NAT_REG_PROTO_MAX, *max)]);
                }
                a.push(u32_attr(attr::NAT_FLAGS, *flags));
                other("nat", a)
            }
            Expr::Other { name, attributes } => {
                other(name, attributes.iter().map(|(k, v)| DefaultNla::new(*k, v.clone())).collect())
            }
        };
        ListAttribute::from(data)
    }

    /// The expression an element of a dumped (or built) rule holds.
    pub(crate) fn decode(element: &ListAttribute<ExpressionAttribute>) -> Option<Expr> {
        let ListAttribute::Element(attrs) = element else { return None };
        let name = attrs.iter().find_map(|a| match a {
            ExpressionAttribute::Name(n) => Some(n.clone()),
            _ => None,
        })?;
        let data = attrs.iter().find_map(|a| match a {
            ExpressionAttribute::Data(d) => Some(d),
            _ => None,
        });
        Some(match data {
            Some(Expressions::Payload(a)) => decode_payload(a).unwrap_or_else(|| unparsed(&name, data)),
            Some(Expressions::Meta(a)) => decode_meta(a).unwrap_or_else(|| unparsed(&name, data)),
            Some(Expressions::Cmp(a)) => decode_cmp(a).unwrap_or_else(|| unparsed(&name, data)),
            Some(Expressions::Bitwise(a)) => decode_bitwise(a).unwrap_or_else(|| unparsed(&name, data)),
            Some(Expressions::Immediate(a)) => decode_immediate(a).unwrap_or_else(|| unparsed(&name, data)),
            Some(Expressions::Lookup(a)) => decode_lookup(a).unwrap_or_else(|| unparsed(&name, data)),
            Some(Expressions::Other { attributes, .. }) | Some(Expressions::Unknown(attributes)) => {
                let raw: Vec<(u16, Vec<u8>)> =
                    attributes.iter().map(|n| (n.kind() & NLA_TYPE_MASK, nla_value(n))).collect();
                decode_ours(&name, &raw).unwrap_or(Expr::Other { name, attributes: raw })
            }
            _ => unparsed(&name, data),
        })
    }
}

/// The raw bytes of any attribute.
fn nla_value(n: &impl Nla) -> Vec<u8> {
    let mut v = vec![0; n.value_len()];
    n.emit_value(&mut v);
    v
}

/// An expression whose attributes did not fit the type: kept whole, so it compares unequal
/// to anything we lower and still prints.
fn unparsed(name: &str, data: Option<&Expressions>) -> Expr {
    use netlink_packet_core::Emitable;
    let raw = data.map(|d| {
        let mut v = vec![0; d.buffer_len()];
        d.emit(&mut v);
        v
    });
    Expr::Other { name: name.to_string(), attributes: raw.map(|v| vec![(0, v)]).unwrap_or_default() }
}

fn decode_payload(attrs: &[Payload]) -> Option<Expr> {
    let (mut base, mut offset, mut len, mut dreg) = (None, None, None, None);
    for a in attrs {
        match a {
            Payload::DestinationRegister(r) => dreg = Some(u32::from(*r)),
            Payload::Base(b) => base = Some(*b),
            Payload::Offset(o) => offset = Some(*o),
            Payload::Len(l) => len = Some(*l),
            _ => return None,
        }
    }
    Some(Expr::Payload { base: base?, offset: offset?, len: len?, dreg: dreg? })
}

fn decode_meta(attrs: &[Meta]) -> Option<Expr> {
    let (mut key, mut dreg, mut sreg) = (None, None, None);
    for a in attrs {
        match a {
            Meta::Key(k) => key = Some(u32::from(*k)),
            Meta::DestinationRegister(r) => dreg = Some(u32::from(*r)),
            Meta::SourceRegister(r) => sreg = Some(u32::from(*r)),
            _ => return None,
        }
    }
    match (key?, dreg, sreg) {
        (key, Some(dreg), None) => Some(Expr::Meta { key, dreg }),
        (key, None, Some(sreg)) => Some(Expr::MetaSet { key, sreg }),
        _ => None,
    }
}

fn data_value(d: &DataAttribute) -> Option<Vec<u8>> {
    match d {
        DataAttribute::Value(v) => Some(v.clone()),
        _ => None,
    }
}

fn decode_cmp(attrs: &[Cmp]) -> Option<Expr> {
    let (mut sreg, mut op, mut data) = (None, None, None);
    for a in attrs {
        match a {
            Cmp::SourceRegister(r) => sreg = Some(u32::from(*r)),
            Cmp::Op(o) => op = Some(u32::from(*o)),
            Cmp::Data(d) => data = Some(data_value(d)?),
            _ => return None,
        }
    }
    Some(Expr::Cmp { sreg: sreg?, op: op?, data: data? })
}

fn decode_bitwise(attrs: &[Bitwise]) -> Option<Expr> {
    let (mut sreg, mut dreg, mut len, mut mask, mut xor) = (None, None, None, None, None);
    for a in attrs {
        match a {
            Bitwise::SourceRegister(r) => sreg = Some(u32::from(*r)),
            Bitwise::DestinationRegister(r) => dreg = Some(u32::from(*r)),
            Bitwise::Length(l) => len = Some(*l as usize),
            Bitwise::Mask(d) => mask = Some(data_value(d)?),
            Bitwise::Xor(d) => xor = Some(data_value(d)?),
            // NFT_BITWISE_BOOL (0), the only operation we use, is what an absent op means.
            Bitwise::Op(0) => {}
            _ => return None,
        }
    }
    let (mask, xor) = (mask?, xor?);
    (len? == mask.len()).then_some(Expr::Bitwise { sreg: sreg?, dreg: dreg?, mask, xor })
}

fn decode_immediate(attrs: &[Immediate]) -> Option<Expr> {
    let (mut dreg, mut data) = (None, None);
    for a in attrs {
        match a {
            Immediate::DestinationRegister(r) => dreg = Some(u32::from(*r)),
            Immediate::Data(d) => data = Some(d),
            _ => return None,
        }
    }
    match (dreg?, data?) {
        (REG_VERDICT, DataAttribute::Verdict(v)) => {
            let (mut code, mut chain) = (None, None);
            for a in v {
                match a {
                    VerdictAttribute::Code(c) => code = Some(u32::from(*c) as i32),
                    VerdictAttribute::Chain(c) => chain = Some(c.clone()),
                    _ => return None,
                }
            }
            Some(Expr::Verdict { code: code?, chain })
        }
        (dreg, DataAttribute::Value(v)) => Some(Expr::Immediate { dreg, data: v.clone() }),
        _ => None,
    }
}

fn decode_lookup(attrs: &[Lookup]) -> Option<Expr> {
    let (mut set, mut sreg, mut dreg, mut flags) = (None, None, None, 0);
    for a in attrs {
        match a {
            Lookup::Set(s) => set = Some(s.clone()),
            Lookup::SourceRegister(r) => sreg = Some(u32::from(*r)),
            Lookup::DestinationRegister(r) => dreg = Some(u32::from(*r)),
            Lookup::Flags(f) => flags = *f,
            _ => return None,
        }
    }
    (flags & !NFT_LOOKUP_F_INV == 0).then_some(())?;
    Some(Expr::Lookup { set: set?, sreg: sreg?, dreg, invert: flags & NFT_LOOKUP_F_INV != 0 })
}

/// Decodes the expressions we encode ourselves from their raw attributes; any attribute we
/// do not model makes it `None` (then it is kept raw).
fn decode_ours(name: &str, raw: &[(u16, Vec<u8>)]) -> Option<Expr> {
    let get = |k: u16| raw.iter().find(|(t, _)| *t == k).map(|(_, v)| v.as_slice());
    let u32_of = |k: u16| get(k).and_then(|v| Some(u32::from_be_bytes(v.try_into().ok()?)));
    let str_of = |k: u16| get(k).map(|v| String::from_utf8_lossy(v.strip_suffix(&[0]).unwrap_or(v)).into_owned());
    let only = |known: &[u16]| raw.iter().all(|(k, _)| known.contains(k));
    match name {
        "ct" if only(&[attr::CT_KEY, attr::CT_DREG]) => {
            Some(Expr::Ct { key: u32_of(attr::CT_KEY)?, dreg: u32_of(attr::CT_DREG)? })
        }
        "ct" if only(&[attr::CT_KEY, attr::CT_SREG]) => {
            Some(Expr::CtSet { key: u32_of(attr::CT_KEY)?, sreg: u32_of(attr::CT_SREG)? })
        }
        "objref" if only(&[attr::OBJREF_IMM_TYPE, attr::OBJREF_IMM_NAME]) => {
            Some(Expr::Objref { kind: u32_of(attr::OBJREF_IMM_TYPE)?, name: str_of(attr::OBJREF_IMM_NAME)? })
        }
        "dynset"
            if only(&[
                attr::DYNSET_SET_NAME,
                attr::DYNSET_OP,
                attr::DYNSET_SREG_KEY,
                attr::DYNSET_TIMEOUT,
                attr::DYNSET_FLAGS,
            ]) =>
        {
            Some(Expr::Dynset {
                set: str_of(attr::DYNSET_SET_NAME)?,
                op: u32_of(attr::DYNSET_OP)?,
                sreg_key: u32_of(attr::DYNSET_SREG_KEY)?,
                timeout_ms: match get(attr::DYNSET_TIMEOUT) {
                    Some(v) => u64::from_be_bytes(v.try_into().ok()?),
                    None => 0,
                },
                flags: match get(attr::DYNSET_FLAGS) {
                    Some(_) => u32_of(attr::DYNSET_FLAGS)?,
                    None => 0,
                },
            })
        }
        "reject" if only(&[attr::REJECT_TYPE, attr::REJECT_ICMP_CODE]) => Some(Expr::Reject {
            kind: u32_of(attr::REJECT_TYPE)?,
            code: match get(attr::REJECT_ICMP_CODE) {
                Some([c]) => *c,
                Some(_) => return None,
                None => 0,
            },
        }),
        "tproxy" if only(&[attr::TPROXY_FAMILY, attr::TPROXY_REG_ADDR, attr::TPROXY_REG_PORT]) => Some(Expr::Tproxy {
            family: u32_of(attr::TPROXY_FAMILY)?,
            reg_addr: u32_of(attr::TPROXY_REG_ADDR),
            reg_port: u32_of(attr::TPROXY_REG_PORT),
        }),
        "nat"
            if only(&[
                attr::NAT_TYPE,
                attr::NAT_FAMILY,
                attr::NAT_REG_ADDR_MIN,
                attr::NAT_REG_ADDR_MAX,
                attr::NAT_REG_PROTO_MIN,
                attr::NAT_REG_PROTO_MAX,
                attr::NAT_FLAGS,
            ]) =>
        {
            let pair = |min: u16, max: u16| Some((u32_of(min)?, u32_of(max).or(u32_of(min))?));
            Some(Expr::Nat {
                kind: u32_of(attr::NAT_TYPE)?,
                family: u32_of(attr::NAT_FAMILY)?,
                reg_addr: pair(attr::NAT_REG_ADDR_MIN, attr::NAT_REG_ADDR_MAX),
                reg_proto: pair(attr::NAT_REG_PROTO_MIN, attr::NAT_REG_PROTO_MAX),
                flags: u32_of(attr::NAT_FLAGS).unwrap_or(0),
            })
        }
        _ => None,
    }
}

/// A rule's expressions (printed `e1; e2; ...`, see `notation`).
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Exprs(pub Vec<Expr>);

/// A nested attribute of ours holding `attrs`.
pub(crate) fn nested(kind: u16, attrs: &[DefaultNla]) -> DefaultNla {
    use netlink_packet_core::Emitable;
    let mut v = vec![0; attrs.buffer_len()];
    attrs.emit(&mut v);
    DefaultNla::new(kind | NLA_F_NESTED, v)
}
