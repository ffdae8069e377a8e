//! Just enough DNS: an A query, the stub's answer, and reading the answer back.

use std::net::Ipv4Addr;

/// The name the tests and the demo resolve, and the address the stub gives it.
pub const NAME: &str = "cart.shop.svc.cluster.local";
pub const ANSWER: Ipv4Addr = crate::VIP;

/// An A query for `name` with transaction `id` (RD set).
pub fn query(id: u16, name: &str) -> Vec<u8> {
    let mut q = Vec::with_capacity(64);
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.split('.') {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    q
}

/// The end of the question section, if `msg` is a well-formed one-question message.
fn question_end(msg: &[u8]) -> Option<usize> {
    if msg.len() < 12 || msg[4..6] != [0, 1] {
        return None;
    }
    let mut i = 12;
    loop {
        let n = *msg.get(i)? as usize;
        i += 1;
        if n == 0 {
            break;
        }
        if n > 63 {
            return None;
        }
        i += n;
    }
    (i + 4 <= msg.len()).then_some(i + 4)
}

fn qname(msg: &[u8]) -> Option<String> {
    let end = question_end(msg)?;
    let mut labels = Vec::new();
    let mut i = 12;
    while i < end - 5 {
        let n = msg[i] as usize;
        labels.push(String::from_utf8_lossy(&msg[i + 1..i + 1 + n]).into_owned());
        i += 1 + n;
    }
    Some(labels.join("."))
}

/// The stub's answer to a query: one A record, [`ANSWER`]. `None` when `msg` is not a query.
pub fn answer(msg: &[u8]) -> Option<Vec<u8>> {
    let end = question_end(msg)?;
    if msg[2] & 0x80 != 0 {
        return None;
    }
    let mut a = Vec::with_capacity(end + 16);
    a.extend_from_slice(&msg[0..2]);
    a.extend_from_slice(&[0x81, 0x80, 0, 1, 0, 1, 0, 0, 0, 0]);
    a.extend_from_slice(&msg[12..end]);
    a.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 30, 0, 4]);
    a.extend_from_slice(&ANSWER.octets());
    Some(a)
}

/// Reads an answer to transaction `id`: `"dns <name> A <address>"`, or `None` if `msg` is
/// not one (for example the text banner of a server that is not a DNS server).
pub fn read_answer(id: u16, msg: &[u8]) -> Option<String> {
    let end = question_end(msg)?;
    if msg[0..2] != id.to_be_bytes() || msg[2] & 0x80 == 0 || msg[6..8] != [0, 1] {
        return None;
    }
    let rr = msg.get(end..end + 16)?;
    if rr[2..4] != [0, 1] || rr[10..12] != [0, 4] {
        return None;
    }
    Some(format!("dns {} A {}", qname(msg)?, Ipv4Addr::new(rr[12], rr[13], rr[14], rr[15])))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let q = query(0x1234, NAME);
        let a = answer(&q).unwrap();
        assert_eq!(read_answer(0x1234, &a).unwrap(), format!("dns {NAME} A {ANSWER}"));
        assert!(read_answer(0x1235, &a).is_none());
        assert!(answer(&a).is_none(), "an answer is not a query");
        assert!(read_answer(1, b"upstream tcp dst=10.96.0.10:53").is_none());
    }
}
