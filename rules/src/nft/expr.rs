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
/// nf_nat range flags: the kernel sets both when address and port registers are given and
/// reports them in dumps, so sending them keeps what we send equal to what we read back.
const NAT_RANGE_MAP_IPS: u32 = 1;
const NAT_RANGE_PROTO_SPECIFIED: u32 = 2;
const IP_CT_DIR_REPLY: u8 = 1;
const LOOPBACK_IFINDEX: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Expr {
    /// Load `len` bytes at `offset` of a header into register 1.
    Payload { base: u32, offset: u32, len: u32 },
    /// Load a meta key into register 1.
    Meta(u32),
    /// Set a meta key from register 1.
    MetaSet(u32),
    /// Load the conntrack direction into register 1.
    CtDirection,
    /// Register 1 equals `data`.
    CmpEq(Vec<u8>),
    /// Load `data` into a register.
    Immediate { reg: u32, data: Vec<u8> },
    Accept,
    /// Register 1 is in the named set.
    Lookup(String),
    /// Assign the packet to the transparent socket on the port in register 1.
    Tproxy,
    /// DNAT to the address in register 1 and the port in register 2.
    Dnat,
}

pub(crate) fn lower_match(m: &Match) -> Vec<Expr> {
    let l4proto = |p: crate::model::Proto| vec![Expr::Meta(libc::NFT_META_L4PROTO as u32), Expr::CmpEq(vec![p.number()])];
    let dport = || Expr::Payload { base: libc::NFT_PAYLOAD_TRANSPORT_HEADER as u32, offset: 2, len: 2 };
    match m {
        Match::CtDirectionReply => vec![Expr::CtDirection, Expr::CmpEq(vec![IP_CT_DIR_REPLY])],
        Match::Mark(mark) => vec![Expr::Meta(libc::NFT_META_MARK as u32), Expr::CmpEq(mark.to_ne_bytes().to_vec())],
        Match::InputLoopback => vec![Expr::Meta(libc::NFT_META_IIF as u32), Expr::CmpEq(LOOPBACK_IFINDEX.to_ne_bytes().to_vec())],
        Match::DaddrInSet(set) => vec![
            Expr::Payload { base: libc::NFT_PAYLOAD_NETWORK_HEADER as u32, offset: 16, len: 4 },
            Expr::Lookup(set.clone()),
        ],
        Match::L4Proto(p) => l4proto(*p),
        Match::Dport(p, port) => {
            let mut e = l4proto(*p);
            e.extend([dport(), Expr::CmpEq(port.to_be_bytes().to_vec())]);
            e
        }
        Match::DportInSet(p, set) => {
            let mut e = l4proto(*p);
            e.extend([dport(), Expr::Lookup(set.clone())]);
            e
        }
    }
}

pub(crate) fn lower_action(a: &Action) -> Vec<Expr> {
    match a {
        Action::Accept => vec![Expr::Accept],
        Action::SetMarkAccept(mark) => vec![
            Expr::Immediate { reg: REG_1, data: mark.to_ne_bytes().to_vec() },
            Expr::MetaSet(libc::NFT_META_MARK as u32),
            Expr::Accept,
        ],
        Action::TproxyAccept(port) => vec![
            Expr::Immediate { reg: REG_1, data: port.to_be_bytes().to_vec() },
            Expr::Tproxy,
            Expr::Accept,
        ],
        Action::Dnat(addr, port) => vec![
            Expr::Immediate { reg: REG_1, data: Ipv4Addr::octets(addr).to_vec() },
            Expr::Immediate { reg: REG_2, data: port.to_be_bytes().to_vec() },
            Expr::Dnat,
        ],
    }
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
            Expr::Payload { base, offset, len } => {
                let e = alloc(c"payload");
                set_u32(e, sys::NFTNL_EXPR_PAYLOAD_DREG, REG_1);
                set_u32(e, sys::NFTNL_EXPR_PAYLOAD_BASE, *base);
                set_u32(e, sys::NFTNL_EXPR_PAYLOAD_OFFSET, *offset);
                set_u32(e, sys::NFTNL_EXPR_PAYLOAD_LEN, *len);
                e
            }
            Expr::Meta(key) => {
                let e = alloc(c"meta");
                set_u32(e, sys::NFTNL_EXPR_META_KEY, *key);
                set_u32(e, sys::NFTNL_EXPR_META_DREG, REG_1);
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
            Expr::CmpEq(data) => {
                let e = alloc(c"cmp");
                set_u32(e, sys::NFTNL_EXPR_CMP_SREG, REG_1);
                set_u32(e, sys::NFTNL_EXPR_CMP_OP, libc::NFT_CMP_EQ as u32);
                set_data(e, sys::NFTNL_EXPR_CMP_DATA, data);
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
            Expr::Lookup(set) => {
                let e = alloc(c"lookup");
                let name = CString::new(set.as_str()).expect("set names have no NUL");
                set_u32(e, sys::NFTNL_EXPR_LOOKUP_SREG, REG_1);
                unsafe { sys::nftnl_expr_set_str(e.as_ptr(), sys::NFTNL_EXPR_LOOKUP_SET as u16, name.as_ptr()) };
                // The kernel always reports the flags word; send it so dumps compare equal.
                set_u32(e, sys::NFTNL_EXPR_LOOKUP_FLAGS, 0);
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

