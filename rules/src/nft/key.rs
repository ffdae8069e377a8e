//! The one place for set key byte layouts and set flags: how a model element becomes key
//! bytes, how key bytes read back, and what a set's flags mean.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::reg::Reg;
use crate::family::Family;
use crate::model::{Element, KeyType, Proto};

/// A Service key is `address . inet_proto . inet_service`; each part of a concatenation
/// fills whole 32-bit registers, zero-padded. IPv4: address at 0..4, protocol at 4, port
/// (big-endian) at 8..10, 12 bytes. IPv6: the address fills four registers (0..16), protocol
/// at 16, port at 20..22, 24 bytes. The datapath loads the parts into these registers.
pub const SERVICE_KEY_LEN: usize = 12;
pub const SERVICE_KEY6_LEN: usize = 24;

/// The registers the datapath loads a Service key's parts into (address, protocol, port):
/// `r1` (the first 16-byte register) for the address, then the next free 32-bit registers.
pub fn service_key_registers(family: Family) -> [Reg; 3] {
    match family {
        // r1 = r32.0; protocol in r32.1 (9), port in r32.2 (10).
        Family::Ipv4 => [1, 9, 10],
        // The address takes r32.0..r32.3; protocol in r32.4, port in r32.5 (13). r32.4 is
        // where the second 16-byte register `r2` starts, and the kernel reports it as `r2`
        // when it dumps the rule: named so, what we send reads back the same.
        Family::Ipv6 => [1, 2, 13],
    }
}

/// The key bytes of one Service port, in its address's family.
pub fn service_key(addr: IpAddr, proto: u8, port: u16) -> Vec<u8> {
    let octets = match addr {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    let at = octets.len();
    let mut k = vec![0; at + 8];
    k[..at].copy_from_slice(&octets);
    k[at] = proto;
    k[at + 4..at + 6].copy_from_slice(&port.to_be_bytes());
    k
}

/// A Service key read back: (address, protocol number, port); `None` if it is not one.
pub fn parse_service_key(key: &[u8]) -> Option<(IpAddr, u8, u16)> {
    let at = match key.len() {
        SERVICE_KEY_LEN => 4,
        SERVICE_KEY6_LEN => 16,
        _ => return None,
    };
    let addr = match at {
        4 => IpAddr::V4(Ipv4Addr::new(key[0], key[1], key[2], key[3])),
        _ => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&key[..16]).ok()?)),
    };
    Some((addr, key[at], u16::from_be_bytes([key[at + 4], key[at + 5]])))
}

fn proto_name(p: u8) -> String {
    match p {
        6 => Proto::Tcp.name().to_string(),
        17 => Proto::Udp.name().to_string(),
        p => p.to_string(),
    }
}

/// One set element as the kernel holds it: its key bytes, whether it ends an interval (the
/// key after a range's last), in a data map its number, and in a verdict map the chain it
/// goes to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RawElement {
    pub key: Vec<u8>,
    pub end: bool,
    pub value: Option<u32>,
    pub goto: Option<String>,
}

impl RawElement {
    pub fn key(key: Vec<u8>) -> RawElement {
        RawElement { key, end: false, value: None, goto: None }
    }
}

/// A number as a `mark` key or data: 32 bits, big-endian. nft reads (and writes, for `nft
/// add element`) a mark in a set that carries no byte-order note of its own, as ours do, as
/// big-endian; the kernel only compares the bytes, and carries them from the data map to
/// the verdict map's key unchanged (through the mark, which holds them swapped meanwhile).
pub fn number_bytes(n: u32) -> [u8; 4] {
    n.to_be_bytes()
}

/// `number_bytes` read back.
pub fn number_of(bytes: [u8; 4]) -> u32 {
    u32::from_be_bytes(bytes)
}

/// The key of one element of a set without intervals.
pub(crate) fn plain_key(key: KeyType, e: &Element) -> Vec<u8> {
    match (key, e) {
        (KeyType::Ipv4Addr, Element::Addr(a)) => a.octets().to_vec(),
        (KeyType::Ipv6Addr, Element::Addr6(a)) => a.octets().to_vec(),
        (KeyType::Ipv4Addr, Element::Net(n)) if n.prefix_len() == 32 => n.addr().octets().to_vec(),
        (KeyType::Ipv6Addr, Element::Net6(n)) if n.prefix_len() == 128 => n.addr().octets().to_vec(),
        (KeyType::InetService, Element::Ports(r)) if r.first == r.last => r.first.to_be_bytes().to_vec(),
        (KeyType::ServiceKey, Element::Service(a, proto, port)) => service_key((*a).into(), proto.number(), *port),
        (KeyType::ServiceKey6, Element::Service6(a, proto, port)) => service_key((*a).into(), proto.number(), *port),
        (KeyType::InetProto, Element::Proto(p)) => vec![p.number()],
        (KeyType::Ipv4Addr, Element::Numbered(IpAddr::V4(a), _)) => a.octets().to_vec(),
        (KeyType::Ipv6Addr, Element::Numbered(IpAddr::V6(a), _)) => a.octets().to_vec(),
        (KeyType::Mark, Element::Goto(n, _)) => number_bytes(*n).to_vec(),
        (k, e) => panic!("element {e} does not fit a set of type {} without intervals", k.name()),
    }
}

/// Interval sets hold half-open ranges: the first key, then the key after the last with the
/// interval-end flag (omitted when the range runs to the top of the key space).
pub(crate) fn interval_keys(key: KeyType, e: &Element) -> Vec<RawElement> {
    interval_bounds(key, e).into_iter().map(|(key, end)| RawElement { key, end, value: None, goto: None }).collect()
}

fn interval_bounds(key: KeyType, e: &Element) -> Vec<(Vec<u8>, bool)> {
    match (key, e) {
        (KeyType::Ipv4Addr, Element::Net(n)) => {
            let mut v = vec![(n.network().octets().to_vec(), false)];
            if let Some(next) = u32::from(n.broadcast()).checked_add(1) {
                v.push((Ipv4Addr::from(next).octets().to_vec(), true));
            }
            v
        }
        (KeyType::Ipv6Addr, Element::Net6(n)) => {
            let mut v = vec![(n.network().octets().to_vec(), false)];
            if let Some(next) = u128::from(n.broadcast()).checked_add(1) {
                v.push((Ipv6Addr::from(next).octets().to_vec(), true));
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

/// The raw elements of a model set.
pub(crate) fn element_keys(set: &crate::model::Set, elements: &[Element]) -> Vec<RawElement> {
    let goto = |e: &Element| match e {
        Element::Goto(_, i) => Some(set.data.chains()[usize::from(*i)].clone()),
        _ => None,
    };
    let value = |e: &Element| match e {
        Element::Numbered(_, n) => Some(*n),
        _ => None,
    };
    elements
        .iter()
        .flat_map(|e| {
            if set.interval {
                interval_keys(set.key, e)
            } else {
                vec![RawElement { key: plain_key(set.key, e), end: false, value: value(e), goto: goto(e) }]
            }
        })
        .collect()
}

/// Prints a raw element of a set of nft type `key_type` the way a person reads it
/// (`show_key`; a `mark` key as a number), with a data map's ` : number` or a verdict map's
/// ` : goto chain`.
pub fn show_element(key_type: u32, e: &RawElement) -> String {
    let key = match <[u8; 4]>::try_from(&e.key[..]) {
        Ok(n) if key_type == KeyType::Mark.nft_type() => format!("{:#010x}", number_of(n)),
        _ => show_key(&e.key, e.end),
    };
    match (&e.goto, e.value) {
        (Some(chain), _) => format!("{key} : goto {chain}"),
        (None, Some(n)) => format!("{key} : {n:#010x}"),
        (None, None) => key,
    }
}

/// Prints a set key the way a person reads it: an address, a port, a protocol or a
/// Service key (`10.96.1.1 . tcp . 80`).
pub fn show_key(key: &[u8], end: bool) -> String {
    let k = match key.len() {
        4 => Ipv4Addr::new(key[0], key[1], key[2], key[3]).to_string(),
        16 => Ipv6Addr::from(<[u8; 16]>::try_from(key).expect("16 bytes")).to_string(),
        2 => u16::from_be_bytes([key[0], key[1]]).to_string(),
        1 => proto_name(key[0]),
        SERVICE_KEY_LEN | SERVICE_KEY6_LEN => {
            let (a, p, port) = parse_service_key(key).expect("a Service key's length");
            format!("{a} . {} . {port}", proto_name(p))
        }
        _ => format!("{key:02x?}"),
    };
    if end {
        format!("{k} (interval end)")
    } else {
        k
    }
}

/// `NFT_DATA_VERDICT`: a map's values are verdicts.
pub const DATA_VERDICT: u32 = 0xffff_ff00;

/// `NFT_SET_*` flags (nf_tables.h) as we use them.
pub mod set_flags {
    pub const INTERVAL: u32 = 0x4;
    pub const MAP: u32 = 0x8;
    pub const TIMEOUT: u32 = 0x10;
    pub const EVAL: u32 = 0x20;

    /// The flags of a model set: `interval`, `map` for a data or verdict map, or
    /// `dynamic,timeout` for a set the datapath fills.
    pub fn of(set: &crate::model::Set) -> u32 {
        let mut flags = if set.interval { INTERVAL } else { 0 };
        if set.data != crate::model::SetData::None {
            flags |= MAP;
        }
        if set.timeout_secs.is_some() {
            flags |= TIMEOUT | EVAL;
        }
        flags
    }

    /// Elements expire and the datapath adds them: the contents are the kernel's own.
    pub fn is_dynamic(flags: u32) -> bool {
        flags & TIMEOUT != 0
    }

    /// Elements are ranges (start, end pairs): changed as a whole, never element by element.
    pub fn is_interval(flags: u32) -> bool {
        flags & INTERVAL != 0
    }
}
