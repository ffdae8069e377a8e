//! The one place for set key byte layouts and set flags: how a model element becomes key
//! bytes, how key bytes read back, and what a set's flags mean.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::expr::Reg;
use crate::model::{Element, KeyType, Proto};

/// A Service key is `ipv4_addr . inet_proto . inet_service`; each part of a concatenation
/// fills a 32-bit register, zero-padded: address at 0..4, protocol at 4, port (big-endian)
/// at 8..10. The datapath loads the parts into these registers (`r1`, `r32.1`, `r32.2`).
pub const SERVICE_KEY_LEN: usize = 12;
pub const SERVICE_KEY_REGISTERS: [Reg; 3] = [1, 9, 10];

/// The 12 key bytes of one Service port.
pub fn service_key(addr: Ipv4Addr, proto: u8, port: u16) -> [u8; SERVICE_KEY_LEN] {
    let mut k = [0; SERVICE_KEY_LEN];
    k[0..4].copy_from_slice(&addr.octets());
    k[4] = proto;
    k[8..10].copy_from_slice(&port.to_be_bytes());
    k
}

/// A Service key read back: (address, protocol number, port); `None` if it is not one.
pub fn parse_service_key(key: &[u8]) -> Option<(Ipv4Addr, u8, u16)> {
    let k: &[u8; SERVICE_KEY_LEN] = key.try_into().ok()?;
    Some((Ipv4Addr::new(k[0], k[1], k[2], k[3]), k[4], u16::from_be_bytes([k[8], k[9]])))
}

fn proto_name(p: u8) -> String {
    match p {
        6 => Proto::Tcp.name().to_string(),
        17 => Proto::Udp.name().to_string(),
        p => p.to_string(),
    }
}

/// The key of one element of a set without intervals.
pub(crate) fn plain_key(key: KeyType, e: &Element) -> Vec<u8> {
    match (key, e) {
        (KeyType::Ipv4Addr, Element::Addr(a)) => a.octets().to_vec(),
        (KeyType::Ipv4Addr, Element::Net(n)) if n.prefix_len() == 32 => n.addr().octets().to_vec(),
        (KeyType::Ipv6Addr, Element::Net6(n)) if n.prefix_len() == 128 => n.addr().octets().to_vec(),
        (KeyType::InetService, Element::Ports(r)) if r.first == r.last => r.first.to_be_bytes().to_vec(),
        (KeyType::ServiceKey, Element::Service(a, proto, port)) => service_key(*a, proto.number(), *port).to_vec(),
        (KeyType::InetProto, Element::Proto(p)) => vec![p.number()],
        (k, e) => panic!("element {e} does not fit a set of type {} without intervals", k.name()),
    }
}

/// Interval sets hold half-open ranges: the first key, then the key after the last with the
/// interval-end flag (omitted when the range runs to the top of the key space).
pub(crate) fn interval_keys(key: KeyType, e: &Element) -> Vec<(Vec<u8>, bool)> {
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

/// The raw elements of a model set: (key, interval end).
pub(crate) fn element_keys(set: &crate::model::Set, elements: &[Element]) -> Vec<(Vec<u8>, bool)> {
    elements
        .iter()
        .flat_map(|e| if set.interval { interval_keys(set.key, e) } else { vec![(plain_key(set.key, e), false)] })
        .collect()
}

/// Prints a set key the way a person reads it: an address, a port, a protocol or a
/// Service key (`10.96.1.1 . tcp . 80`).
pub fn show_key(key: &[u8], end: bool) -> String {
    let k = match key.len() {
        4 => Ipv4Addr::new(key[0], key[1], key[2], key[3]).to_string(),
        16 => Ipv6Addr::from(<[u8; 16]>::try_from(key).expect("16 bytes")).to_string(),
        2 => u16::from_be_bytes([key[0], key[1]]).to_string(),
        1 => proto_name(key[0]),
        SERVICE_KEY_LEN => {
            let (a, p, port) = parse_service_key(key).expect("12 bytes");
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

/// `NFT_SET_*` flags (nf_tables.h) as we use them.
pub mod set_flags {
    pub const INTERVAL: u32 = 0x4;
    pub const TIMEOUT: u32 = 0x10;
    pub const EVAL: u32 = 0x20;

    /// The flags of a model set: `interval`, or `dynamic,timeout` for a set the datapath
    /// fills.
    pub fn of(set: &crate::model::Set) -> u32 {
        let mut flags = if set.interval { INTERVAL } else { 0 };
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
