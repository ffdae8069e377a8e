//! Our notation of register-level expressions, for CHECK's differences: loads as
//! `r1 = <source>`, tests as `r1 == <bytes>`, bytes in hex as they sit in the register, except
//! a mark, which reads as the number the configuration writes (`0xae7e`, not its host-order
//! bytes `0x7eae0000`) (docs/cni.md, "Reading CHECK's differences"). Display only: what an
//! expression is lives in `expr`.

use std::fmt;

use super::expr::{
    Expr, Exprs, Reg, NFT_DYNSET_OP_UPDATE, NFT_OBJECT_COUNTER, NFT_PAYLOAD_NETWORK_HEADER,
    NFT_PAYLOAD_TRANSPORT_HEADER, NFT_REJECT_ICMP_UNREACH, NFT_REJECT_TCP_RST, TCP_FLAGS_OFFSET,
};
use crate::family::Family;

/// `r1`..`r4` (128-bit registers), `r32.0`..`r32.15` (their 32-bit quarters), `verdict`.
struct RegName(Reg);

impl fmt::Display for RegName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            0 => write!(f, "verdict"),
            r @ 1..=4 => write!(f, "r{r}"),
            r @ 8..=23 => write!(f, "r32.{}", r - 8),
            r => write!(f, "reg{r}"),
        }
    }
}

struct Hex<'a>(&'a [u8]);

impl fmt::Display for Hex<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "0x")?;
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

fn meta_name(key: u32) -> String {
    match key as i32 {
        libc::NFT_META_MARK => "mark".into(),
        libc::NFT_META_IIF => "iif".into(),
        libc::NFT_META_OIF => "oif".into(),
        libc::NFT_META_L4PROTO => "l4proto".into(),
        libc::NFT_META_NFPROTO => "nfproto".into(),
        k => format!("key {k}"),
    }
}

fn ct_name(key: u32) -> String {
    match key as i32 {
        libc::NFT_CT_STATE => "state".into(),
        libc::NFT_CT_DIRECTION => "direction".into(),
        libc::NFT_CT_STATUS => "status".into(),
        libc::NFT_CT_MARK => "mark".into(),
        k => format!("key {k}"),
    }
}

/// `ip`, `ip6`, or the number of another family.
fn family_name(family: u32) -> String {
    match Family::ALL.into_iter().find(|f| u32::from(f.nfproto()) == family) {
        Some(f) => f.nft_name().to_string(),
        None => format!("family {family}"),
    }
}

fn payload_name(base: u32, offset: u32, len: u32) -> String {
    match (base, offset, len) {
        (NFT_PAYLOAD_NETWORK_HEADER, 12, 4) => "ip saddr".into(),
        (NFT_PAYLOAD_NETWORK_HEADER, 16, 4) => "ip daddr".into(),
        (NFT_PAYLOAD_NETWORK_HEADER, 8, 16) => "ip6 saddr".into(),
        (NFT_PAYLOAD_NETWORK_HEADER, 24, 16) => "ip6 daddr".into(),
        (NFT_PAYLOAD_TRANSPORT_HEADER, 0, 2) => "th sport".into(),
        (NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2) => "th dport".into(),
        (NFT_PAYLOAD_TRANSPORT_HEADER, TCP_FLAGS_OFFSET, 1) => "tcp flags".into(),
        (b, o, l) => {
            let base = match b {
                0 => "ll",
                NFT_PAYLOAD_NETWORK_HEADER => "nh",
                NFT_PAYLOAD_TRANSPORT_HEADER => "th",
                _ => "base?",
            };
            format!("@{base},{},{}", o * 8, l * 8)
        }
    }
}

fn verdict_name(code: i32) -> &'static str {
    match code {
        libc::NF_DROP => "drop",
        libc::NF_ACCEPT => "accept",
        libc::NFT_CONTINUE => "continue",
        libc::NFT_BREAK => "break",
        libc::NFT_JUMP => "jump",
        libc::NFT_GOTO => "goto",
        libc::NFT_RETURN => "return",
        _ => "verdict?",
    }
}

/// A packet or conntrack mark, a host-order u32, as the configuration writes it: `0xae7e`.
struct Mark<'a>(&'a [u8]);

impl fmt::Display for Mark<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match <[u8; 4]>::try_from(self.0) {
            Ok(b) => write!(f, "{:#x}", u32::from_ne_bytes(b)),
            Err(_) => write!(f, "{}", Hex(self.0)),
        }
    }
}

fn is_mark_key_meta(key: u32) -> bool {
    key as i32 == libc::NFT_META_MARK
}

fn is_mark_key_ct(key: u32) -> bool {
    key as i32 == libc::NFT_CT_MARK
}

/// One expression in our notation: loads as `r1 = <source>`, tests as `r1 == <bytes>`,
/// bytes in hex as they sit in the register (docs/cni.md, "Reading CHECK's differences").
/// Alone, an expression cannot know that a register holds a mark; [`Exprs`] can.
impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_expr(self, false, f)
    }
}

/// Writes `e`; `mark` says that the data it compares or loads is a mark (a register loaded
/// by `meta mark`/`ct mark`, or an immediate the next expression sets as one).
fn write_expr(e: &Expr, mark: bool, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let data = |d: &[u8]| -> String {
        if mark {
            Mark(d).to_string()
        } else {
            Hex(d).to_string()
        }
    };
    match e {
        Expr::Payload { base, offset, len, dreg } => {
            write!(f, "{} = {}", RegName(*dreg), payload_name(*base, *offset, *len))
        }
        Expr::Meta { key, dreg } => write!(f, "{} = meta {}", RegName(*dreg), meta_name(*key)),
        Expr::MetaSet { key, sreg } => write!(f, "meta {} set {}", meta_name(*key), RegName(*sreg)),
        Expr::Ct { key, dreg } => write!(f, "{} = ct {}", RegName(*dreg), ct_name(*key)),
        Expr::CtSet { key, sreg } => write!(f, "ct {} set {}", ct_name(*key), RegName(*sreg)),
        Expr::Cmp { sreg, op, data: data_bytes } => {
            let op = match *op as i32 {
                libc::NFT_CMP_EQ => "==",
                libc::NFT_CMP_NEQ => "!=",
                libc::NFT_CMP_LT => "<",
                libc::NFT_CMP_LTE => "<=",
                libc::NFT_CMP_GT => ">",
                libc::NFT_CMP_GTE => ">=",
                _ => "cmp?",
            };
            write!(f, "{} {op} {}", RegName(*sreg), data(data_bytes))
        }
        Expr::Bitwise { sreg, dreg, mask, xor } => {
            write!(f, "{} = ({} & {}) ^ {}", RegName(*dreg), RegName(*sreg), Hex(mask), Hex(xor))
        }
        Expr::Immediate { dreg, data: d } => write!(f, "{} = {}", RegName(*dreg), data(d)),
        Expr::Verdict { code, chain: Some(c) } => write!(f, "{} {c}", verdict_name(*code)),
        Expr::Verdict { code, chain: None } => write!(f, "{}", verdict_name(*code)),
        Expr::Lookup { set, sreg, dreg: None, invert } => {
            write!(f, "{} {}in @{set}", RegName(*sreg), if *invert { "not " } else { "" })
        }
        Expr::Lookup { set, sreg, dreg: Some(dreg), invert } => {
            write!(f, "{} = {} {}in map @{set}", RegName(*dreg), RegName(*sreg), if *invert { "not " } else { "" })
        }
        Expr::Objref { kind: NFT_OBJECT_COUNTER, name } => write!(f, "counter name {name:?}"),
        Expr::Objref { kind, name } => write!(f, "objref type {kind} name {name:?}"),
        Expr::Dynset { set, op, sreg_key, timeout_ms, flags } => {
            let op = match *op {
                0 => "add",
                NFT_DYNSET_OP_UPDATE => "update",
                2 => "delete",
                _ => "op?",
            };
            write!(f, "{op} @{set} {{ {} }}", RegName(*sreg_key))?;
            if *timeout_ms != 0 {
                write!(f, " timeout {timeout_ms}ms")?;
            }
            if *flags != 0 {
                write!(f, " flags {flags:#x}")?;
            }
            Ok(())
        }
        Expr::Reject { kind: NFT_REJECT_TCP_RST, code: 0 } => write!(f, "reject with tcp reset"),
        Expr::Reject { kind: NFT_REJECT_ICMP_UNREACH, code } => write!(f, "reject with icmp code {code}"),
        Expr::Reject { kind, code } => write!(f, "reject type {kind} code {code}"),
        Expr::Tproxy { family, reg_addr, reg_port } => {
            let fam = family_name(*family);
            write!(f, "tproxy {fam} to")?;
            if let Some(r) = reg_addr {
                write!(f, " addr {}", RegName(*r))?;
            }
            if let Some(r) = reg_port {
                write!(f, " port {}", RegName(*r))?;
            }
            Ok(())
        }
        Expr::Nat { kind, family, reg_addr, reg_proto, flags } => {
            let kind = match *kind as i32 {
                libc::NFT_NAT_SNAT => "snat",
                libc::NFT_NAT_DNAT => "dnat",
                _ => "nat?",
            };
            let fam = family_name(*family);
            write!(f, "{kind} {fam} to")?;
            if let Some((a, b)) = reg_addr {
                write!(f, " addr {}-{}", RegName(*a), RegName(*b))?;
            }
            if let Some((a, b)) = reg_proto {
                write!(f, " port {}-{}", RegName(*a), RegName(*b))?;
            }
            write!(f, " flags {flags:#x}")
        }
        Expr::Other { name, attributes } => {
            write!(f, "{name}(")?;
            for (i, (k, v)) in attributes.iter().enumerate() {
                write!(f, "{}{k}={}", if i > 0 { " " } else { "" }, Hex(v))?;
            }
            write!(f, ")")
        }
    }
}

/// A rule's expressions, each as [`Expr`] prints it, with marks as numbers: a register
/// loaded by `meta mark` or `ct mark` holds a mark until something else loads it.
impl fmt::Display for Exprs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut mark_regs: Vec<Reg> = Vec::new();
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, "; ")?;
            }
            let mark = match e {
                Expr::Cmp { sreg, .. } => mark_regs.contains(sreg),
                Expr::Immediate { dreg, .. } => matches!(
                    self.0.get(i + 1),
                    Some(Expr::MetaSet { key, sreg } | Expr::CtSet { key, sreg })
                        if sreg == dreg && (is_mark_key_meta(*key) || is_mark_key_ct(*key))
                ),
                _ => false,
            };
            write_expr(e, mark, f)?;
            match e {
                Expr::Meta { key, dreg } if is_mark_key_meta(*key) => mark_regs.push(*dreg),
                Expr::Ct { key, dreg } if is_mark_key_ct(*key) => mark_regs.push(*dreg),
                Expr::Payload { dreg, .. }
                | Expr::Meta { dreg, .. }
                | Expr::Ct { dreg, .. }
                | Expr::Immediate { dreg, .. }
                | Expr::Bitwise { dreg, .. } => mark_regs.retain(|r| r != dreg),
                _ => {}
            }
        }
        Ok(())
    }
}
