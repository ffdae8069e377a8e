//! nftables expressions at the register level, and the one place that turns them into
//! libnftnl objects. nftnl 0.9 lacks `ct direction`, `tproxy`, NAT with a port register and
//! lookups by set name with flags; one enum over nftnl-sys covers them all uniformly.
//!
//! Each model `Match`/`Action` lowers to the same register sequence `nft` itself generates,
//! so `nft list ruleset` prints our rules in its ordinary notation.

use std::ffi::CString;
use std::net::Ipv4Addr;
use std::ptr::NonNull;

use nftnl::expr::Expression;
use nftnl::nftnl_sys as sys;

use crate::model::{Action, Match};

const REG_VERDICT: u32 = libc::NFT_REG_VERDICT as u32;
const REG_1: u32 = libc::NFT_REG_1 as u32;
const REG_2: u32 = libc::NFT_REG_2 as u32;
/// The 32-bit registers after `reg 1`, where nft puts the later parts of a concatenation.
const REG32_01: u32 = 9;
const REG32_02: u32 = 10;
/// `NF_CT_STATE_BIT(IP_CT_NEW)`
const CT_STATE_NEW_BIT: u32 = 1 << 3;
/// `IPS_CONFIRMED`: set once the first packet of a flow has left the stack.
const CT_STATUS_CONFIRMED: u32 = 1 << 3;
const NFT_OBJECT_COUNTER: u32 = 1;
const NFT_DYNSET_OP_UPDATE: u32 = 1;
const NFT_REJECT_ICMP_UNREACH: u32 = 0;
const NFT_REJECT_TCP_RST: u32 = 1;
const ICMP_PORT_UNREACH: u32 = 3;
/// nf_nat range flags: the kernel sets both when address and port registers are given and
/// reports them in dumps, so sending them keeps what we send equal to what we read back.
const NAT_RANGE_MAP_IPS: u32 = 1;
const NAT_RANGE_PROTO_SPECIFIED: u32 = 2;
const IP_CT_DIR_REPLY: u8 = 1;
const LOOPBACK_IFINDEX: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Expr {
    /// Load `len` bytes at `offset` of a header into `dreg`.
    Payload {
        base: u32,
        offset: u32,
        len: u32,
        dreg: u32,
    },
    /// Load a meta key into `dreg`.
    Meta {
        key: u32,
        dreg: u32,
    },
    /// Set a meta key from register 1.
    MetaSet(u32),
    /// Load the conntrack direction into register 1.
    CtDirection,
    /// Register 1 equals `data`.
    CmpEq(Vec<u8>),
    /// Register 1 differs from `data`.
    CmpNeq(Vec<u8>),
    /// Load the conntrack state bits into register 1.
    CtState,
    CtStatus,
    /// Register 1 = (register 1 & mask) ^ xor.
    Bitwise {
        mask: Vec<u8>,
        xor: Vec<u8>,
    },
    /// Jump to a chain.
    Jump(String),
    /// Count in the named counter object.
    Counter(String),
    /// Add the key in register 1 to the named set, or refresh its timeout.
    DynsetUpdate(String),
    /// Reject: (type, ICMP code).
    Reject {
        kind: u32,
        code: u32,
    },
    /// Load `data` into a register.
    Immediate {
        reg: u32,
        data: Vec<u8>,
    },
    Accept,
    /// Register 1 (and the registers after it, for a concatenation) is in the named set, or
    /// with `invert` is not.
    Lookup {
        set: String,
        invert: bool,
    },
    /// Assign the packet to the transparent socket on the port in register 1.
    Tproxy,
    /// DNAT to the address in register 1 and the port in register 2.
    Dnat,
}

pub(crate) fn lower_match(m: &Match) -> Vec<Expr> {
    let meta = |key: i32| Expr::Meta { key: key as u32, dreg: REG_1 };
    let l4proto = |p: crate::model::Proto| vec![meta(libc::NFT_META_L4PROTO), Expr::CmpEq(vec![p.number()])];
    let dport = || Expr::Payload { base: libc::NFT_PAYLOAD_TRANSPORT_HEADER as u32, offset: 2, len: 2, dreg: REG_1 };
    let daddr = || Expr::Payload { base: libc::NFT_PAYLOAD_NETWORK_HEADER as u32, offset: 16, len: 4, dreg: REG_1 };
    let lookup = |set: &String, invert: bool| Expr::Lookup { set: set.clone(), invert };
    match m {
        Match::CtDirectionReply => vec![Expr::CtDirection, Expr::CmpEq(vec![IP_CT_DIR_REPLY])],
        Match::Mark(mark) => vec![meta(libc::NFT_META_MARK), Expr::CmpEq(mark.to_ne_bytes().to_vec())],
        Match::InputLoopback => vec![meta(libc::NFT_META_IIF), Expr::CmpEq(LOOPBACK_IFINDEX.to_ne_bytes().to_vec())],
        Match::DaddrInSet(set) => vec![daddr(), lookup(set, false)],
        Match::DaddrNotInSet(set) => vec![daddr(), lookup(set, true)],
        Match::L4ProtoNotInSet(set) => vec![meta(libc::NFT_META_L4PROTO), lookup(set, true)],
        // Only the very first packet of a flow sees its conntrack entry unconfirmed: later
        // packets of a UDP flow stay `new` until a reply, but are confirmed.
        Match::CtUnconfirmed => vec![
            Expr::CtStatus,
            Expr::Bitwise { mask: CT_STATUS_CONFIRMED.to_ne_bytes().to_vec(), xor: vec![0; 4] },
            Expr::CmpEq(vec![0; 4]),
        ],
        Match::CtStateNew => vec![
            Expr::CtState,
            Expr::Bitwise { mask: CT_STATE_NEW_BIT.to_ne_bytes().to_vec(), xor: vec![0; 4] },
            Expr::CmpNeq(vec![0; 4]),
        ],
        Match::ServiceKeyInSet(set) => {
            let mut e = service_key();
            e.push(lookup(set, false));
            e
        }
        Match::L4Proto(p) => l4proto(*p),
        Match::Dport(p, port) => {
            let mut e = l4proto(*p);
            e.extend([dport(), Expr::CmpEq(port.to_be_bytes().to_vec())]);
            e
        }
        Match::DportInSet(p, set) => {
            let mut e = l4proto(*p);
            e.extend([dport(), lookup(set, false)]);
            e
        }
    }
}

/// `ip daddr . meta l4proto . th dport` into registers 1, 9 and 10, as nft lays it out.
fn service_key() -> Vec<Expr> {
    vec![
        Expr::Payload { base: libc::NFT_PAYLOAD_NETWORK_HEADER as u32, offset: 16, len: 4, dreg: REG_1 },
        Expr::Meta { key: libc::NFT_META_L4PROTO as u32, dreg: REG32_01 },
        Expr::Payload { base: libc::NFT_PAYLOAD_TRANSPORT_HEADER as u32, offset: 2, len: 2, dreg: REG32_02 },
    ]
}

pub(crate) fn lower_action(a: &Action) -> Vec<Expr> {
    match a {
        Action::Accept => vec![Expr::Accept],
        Action::SetMarkAccept(mark) => vec![
            Expr::Immediate { reg: REG_1, data: mark.to_ne_bytes().to_vec() },
            Expr::MetaSet(libc::NFT_META_MARK as u32),
            Expr::Accept,
        ],
        Action::TproxyAccept(port) => {
            vec![Expr::Immediate { reg: REG_1, data: port.to_be_bytes().to_vec() }, Expr::Tproxy, Expr::Accept]
        }
        Action::Dnat(addr, port) => vec![
            Expr::Immediate { reg: REG_1, data: Ipv4Addr::octets(addr).to_vec() },
            Expr::Immediate { reg: REG_2, data: port.to_be_bytes().to_vec() },
            Expr::Dnat,
        ],
        Action::Jump(chain) => vec![Expr::Jump(chain.clone())],
        Action::CountAccept(counter) => vec![Expr::Counter(counter.clone()), Expr::Accept],
        Action::CountJump(counter, chain) => vec![Expr::Counter(counter.clone()), Expr::Jump(chain.clone())],
        Action::UpdateServiceKeySet(set) => {
            let mut e = service_key();
            e.push(Expr::DynsetUpdate(set.clone()));
            e
        }
        Action::RejectTcpReset => vec![Expr::Reject { kind: NFT_REJECT_TCP_RST, code: 0 }],
        Action::RejectIcmpPortUnreachable => {
            vec![Expr::Reject { kind: NFT_REJECT_ICMP_UNREACH, code: ICMP_PORT_UNREACH }]
        }
    }
}

fn set_str(e: NonNull<sys::nftnl_expr>, attr: u32, s: &str) {
    let s = CString::new(s).expect("names have no NUL");
    // libnftnl copies the string.
    unsafe { sys::nftnl_expr_set_str(e.as_ptr(), attr as u16, s.as_ptr()) };
}

fn alloc(name: &std::ffi::CStr) -> NonNull<sys::nftnl_expr> {
    // libnftnl returns NULL only when out of memory.
    NonNull::new(unsafe { sys::nftnl_expr_alloc(name.as_ptr()) }).expect("nftnl_expr_alloc: out of memory")
}

fn set_u32(e: NonNull<sys::nftnl_expr>, attr: u32, v: u32) {
    unsafe { sys::nftnl_expr_set_u32(e.as_ptr(), attr as u16, v) };
}

fn set_data(e: NonNull<sys::nftnl_expr>, attr: u32, data: &[u8]) {
    unsafe { sys::nftnl_expr_set(e.as_ptr(), attr as u16, data.as_ptr().cast(), data.len() as u32) };
}

impl Expression for Expr {
    fn to_expr(&self, _rule: &nftnl::Rule) -> NonNull<sys::nftnl_expr> {
        match self {
            Expr::Payload { base, offset, len, dreg } => {
                let e = alloc(c"payload");
                set_u32(e, sys::NFTNL_EXPR_PAYLOAD_DREG, *dreg);
                set_u32(e, sys::NFTNL_EXPR_PAYLOAD_BASE, *base);
                set_u32(e, sys::NFTNL_EXPR_PAYLOAD_OFFSET, *offset);
                set_u32(e, sys::NFTNL_EXPR_PAYLOAD_LEN, *len);
                e
            }
            Expr::Meta { key, dreg } => {
                let e = alloc(c"meta");
                set_u32(e, sys::NFTNL_EXPR_META_KEY, *key);
                set_u32(e, sys::NFTNL_EXPR_META_DREG, *dreg);
                e
            }
            Expr::MetaSet(key) => {
                let e = alloc(c"meta");
                set_u32(e, sys::NFTNL_EXPR_META_KEY, *key);
                set_u32(e, sys::NFTNL_EXPR_META_SREG, REG_1);
                e
            }
            Expr::CtDirection => {
                let e = alloc(c"ct");
                set_u32(e, sys::NFTNL_EXPR_CT_KEY, libc::NFT_CT_DIRECTION as u32);
                set_u32(e, sys::NFTNL_EXPR_CT_DREG, REG_1);
                e
            }
            Expr::CmpEq(data) | Expr::CmpNeq(data) => {
                let op = if matches!(self, Expr::CmpEq(_)) { libc::NFT_CMP_EQ } else { libc::NFT_CMP_NEQ };
                let e = alloc(c"cmp");
                set_u32(e, sys::NFTNL_EXPR_CMP_SREG, REG_1);
                set_u32(e, sys::NFTNL_EXPR_CMP_OP, op as u32);
                set_data(e, sys::NFTNL_EXPR_CMP_DATA, data);
                e
            }
            Expr::CtState | Expr::CtStatus => {
                let key = if matches!(self, Expr::CtState) { libc::NFT_CT_STATE } else { libc::NFT_CT_STATUS };
                let e = alloc(c"ct");
                set_u32(e, sys::NFTNL_EXPR_CT_KEY, key as u32);
                set_u32(e, sys::NFTNL_EXPR_CT_DREG, REG_1);
                e
            }
            Expr::Bitwise { mask, xor } => {
                let e = alloc(c"bitwise");
                set_u32(e, sys::NFTNL_EXPR_BITWISE_SREG, REG_1);
                set_u32(e, sys::NFTNL_EXPR_BITWISE_DREG, REG_1);
                set_u32(e, sys::NFTNL_EXPR_BITWISE_LEN, mask.len() as u32);
                set_data(e, sys::NFTNL_EXPR_BITWISE_MASK, mask);
                set_data(e, sys::NFTNL_EXPR_BITWISE_XOR, xor);
                e
            }
            Expr::Jump(chain) => {
                let e = alloc(c"immediate");
                set_u32(e, sys::NFTNL_EXPR_IMM_DREG, REG_VERDICT);
                set_u32(e, sys::NFTNL_EXPR_IMM_VERDICT, libc::NFT_JUMP as u32);
                set_str(e, sys::NFTNL_EXPR_IMM_CHAIN, chain);
                e
            }
            Expr::Counter(name) => {
                let e = alloc(c"objref");
                set_u32(e, sys::NFTNL_EXPR_OBJREF_IMM_TYPE, NFT_OBJECT_COUNTER);
                set_str(e, sys::NFTNL_EXPR_OBJREF_IMM_NAME, name);
                e
            }
            Expr::DynsetUpdate(set) => {
                let e = alloc(c"dynset");
                set_u32(e, sys::NFTNL_EXPR_DYNSET_SREG_KEY, REG_1);
                set_u32(e, sys::NFTNL_EXPR_DYNSET_OP, NFT_DYNSET_OP_UPDATE);
                set_str(e, sys::NFTNL_EXPR_DYNSET_SET_NAME, set);
                // The kernel reports the flags word; send it so dumps compare equal.
                set_u32(e, sys::NFTNL_EXPR_DYNSET_FLAGS, 0);
                // Likewise the timeout: 0 means the set's own.
                unsafe { sys::nftnl_expr_set_u64(e.as_ptr(), sys::NFTNL_EXPR_DYNSET_TIMEOUT as u16, 0) };
                e
            }
            Expr::Reject { kind, code } => {
                let e = alloc(c"reject");
                set_u32(e, sys::NFTNL_EXPR_REJECT_TYPE, *kind);
                unsafe { sys::nftnl_expr_set_u8(e.as_ptr(), sys::NFTNL_EXPR_REJECT_CODE as u16, *code as u8) };
                e
            }
            Expr::Immediate { reg, data } => {
                let e = alloc(c"immediate");
                set_u32(e, sys::NFTNL_EXPR_IMM_DREG, *reg);
                set_data(e, sys::NFTNL_EXPR_IMM_DATA, data);
                e
            }
            Expr::Accept => {
                let e = alloc(c"immediate");
                set_u32(e, sys::NFTNL_EXPR_IMM_DREG, REG_VERDICT);
                set_u32(e, sys::NFTNL_EXPR_IMM_VERDICT, libc::NF_ACCEPT as u32);
                e
            }
            Expr::Lookup { set, invert } => {
                let e = alloc(c"lookup");
                set_u32(e, sys::NFTNL_EXPR_LOOKUP_SREG, REG_1);
                set_str(e, sys::NFTNL_EXPR_LOOKUP_SET, set);
                // The kernel always reports the flags word; send it so dumps compare equal.
                set_u32(e, sys::NFTNL_EXPR_LOOKUP_FLAGS, if *invert { libc::NFT_LOOKUP_F_INV as u32 } else { 0 });
                e
            }
            Expr::Tproxy => {
                let e = alloc(c"tproxy");
                set_u32(e, sys::NFTNL_EXPR_TPROXY_FAMILY, libc::NFPROTO_IPV4 as u32);
                set_u32(e, sys::NFTNL_EXPR_TPROXY_REG_PORT, REG_1);
                e
            }
            Expr::Dnat => {
                let e = alloc(c"nat");
                set_u32(e, sys::NFTNL_EXPR_NAT_TYPE, libc::NFT_NAT_DNAT as u32);
                set_u32(e, sys::NFTNL_EXPR_NAT_FAMILY, libc::NFPROTO_IPV4 as u32);
                set_u32(e, sys::NFTNL_EXPR_NAT_REG_ADDR_MIN, REG_1);
                set_u32(e, sys::NFTNL_EXPR_NAT_REG_PROTO_MIN, REG_2);
                // The kernel fills the range maxima from the minima and reports them.
                set_u32(e, sys::NFTNL_EXPR_NAT_REG_ADDR_MAX, REG_1);
                set_u32(e, sys::NFTNL_EXPR_NAT_REG_PROTO_MAX, REG_2);
                set_u32(e, sys::NFTNL_EXPR_NAT_FLAGS, NAT_RANGE_MAP_IPS | NAT_RANGE_PROTO_SPECIFIED);
                e
            }
        }
    }
}
