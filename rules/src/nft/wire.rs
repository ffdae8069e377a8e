//! Our own netlink writer for the messages a pod start sends most of (rules, set elements):
//! the bytes the crates' generic encoder writes, written once in order, where the generic
//! encoder builds a value per attribute and measures each nested attribute again at every
//! level above it. Unit tests hold each writer's bytes equal to the generic encoder's.

use crate::family::Family;

/// `NLA_F_NESTED`: the flag the generic encoder sets on every nested attribute's type.
pub const NESTED: u16 = netlink_packet_core::NLA_F_NESTED;

/// One nftables message: the netlink header (its length filled in at the end), the
/// `nfgenmsg` (the table's family, version 0, `res_id` 0), then what `body` writes.
pub fn message(out: &mut Vec<u8>, kind: u16, flags: u16, seq: u32, family: Family, body: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(&(netlink_packet_core::NLM_F_REQUEST | flags).to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.extend_from_slice(&[family.nfproto(), 0, 0, 0]);
    body(out);
    let len = u32::try_from(out.len() - start).expect("a message within 4 GiB");
    out[start..start + 4].copy_from_slice(&len.to_ne_bytes());
}

/// One netlink attribute: its header, what `value` writes, then padding to 4 bytes (the
/// length counts the value, not the padding).
pub fn nla(out: &mut Vec<u8>, kind: u16, value: impl FnOnce(&mut Vec<u8>)) {
    let at = out.len();
    out.extend_from_slice(&[0; 4]);
    value(out);
    let len = u16::try_from(out.len() - at).expect("an attribute within 64 KiB");
    out[at..at + 2].copy_from_slice(&len.to_ne_bytes());
    out[at + 2..at + 4].copy_from_slice(&kind.to_ne_bytes());
    out.resize(at + usize::from(len).next_multiple_of(4), 0);
}

/// An attribute holding a NUL-terminated string.
pub fn text(out: &mut Vec<u8>, kind: u16, s: &str) {
    nla(out, kind, |o| {
        o.extend_from_slice(s.as_bytes());
        o.push(0);
    })
}

/// An attribute holding a big-endian `u32` (nf_tables' numbers and registers).
pub fn be32(out: &mut Vec<u8>, kind: u16, v: u32) {
    nla(out, kind, |o| o.extend_from_slice(&v.to_be_bytes()))
}

/// An attribute holding a big-endian `u64`.
pub fn be64(out: &mut Vec<u8>, kind: u16, v: u64) {
    nla(out, kind, |o| o.extend_from_slice(&v.to_be_bytes()))
}

/// An attribute holding raw bytes.
pub fn bytes(out: &mut Vec<u8>, kind: u16, v: &[u8]) {
    nla(out, kind, |o| o.extend_from_slice(v))
}
