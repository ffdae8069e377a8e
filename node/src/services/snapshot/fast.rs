//! The snapshot in the plain form agents write, read by a scanner of its own: each member at
//! most once, strings of printable ASCII without escapes, whole numbers in plain digits, no
//! `null`. At 10,000 Services the scan costs 19 M instructions where serde's typed reading
//! and the Services it built cost 65 M: no UTF-8 check per string, no identifier visitor per
//! key (keys are compared in place), no list of ports per Service; `read_layer` then builds
//! the layer without any Service's own strings. `apply` reads the whole 1.5 MB document each
//! time its content changes.
//!
//! It only ever answers what the serde reading (`typed`) answers: any byte outside the plain
//! form, valid JSON or not, gives up (`None`) and leaves the document to serde, which decides
//! (tests compare the two on random documents). Members are checked by the same functions.

use std::borrow::Cow;
use std::ops::Range;

use aether_rules::model::Proto;
use aether_rules::services::{ServiceLayer, ServicePort};

use super::{checked, item, port, proto, relations_of, typed_service, Snapshot, MAX_PORTS_PER_SERVICE, MAX_SERVICES};

/// The document, when it is in the plain form and passes the typed checks; `None` otherwise
/// (the caller asks serde).
pub(super) fn read(text: &[u8]) -> Option<Snapshot> {
    let doc = scan(text)?;
    let services = doc
        .services
        .iter()
        .map(|s| {
            let ports = doc.ports[s.ports.clone()].to_vec();
            typed_service(Cow::Borrowed(s.namespace), Cow::Borrowed(s.name), s.vip, ports, s.usable_endpoints)
        })
        .collect::<Option<Vec<_>>>()?;
    checked(doc.generation, doc.mode, &doc.ranges, &doc.mesh, services, doc.timeout)
}

/// `read` and then `relations` and `Snapshot::layer(0)`, without the Services' own strings
/// and lists in between: the generation and the layer, when the document is in the plain
/// form and passes every check; `None` otherwise (the caller asks `parse`).
pub(super) fn read_layer(text: &[u8]) -> Option<(u64, ServiceLayer)> {
    let doc = scan(text)?;
    let items = doc
        .services
        .iter()
        .map(|s| item(s.namespace, s.name, s.vip, &doc.ports[s.ports.clone()]))
        .collect::<Option<Vec<_>>>()?;
    let top = checked(doc.generation, doc.mode, &doc.ranges, &doc.mesh, Vec::new(), doc.timeout)?;
    if !relations_of(&top.service_ranges, &top.mesh_vips, &items).is_empty() {
        return None;
    }
    let mut layer = top.layer(0);
    layer.ports = items
        .iter()
        .zip(&doc.services)
        .flat_map(|(item, s)| {
            item.ports.iter().map(|&(proto, port)| ServicePort {
                vip: item.vip,
                proto,
                port,
                has_endpoints: s.usable_endpoints,
            })
        })
        .collect();
    Some((top.generation, layer))
}

/// A document's members as the scanner found them, borrowing the text.
struct Scanned<'a> {
    generation: u64,
    mode: &'a str,
    ranges: Vec<&'a str>,
    mesh: Vec<&'a str>,
    timeout: u64,
    services: Vec<ScannedService<'a>>,
    /// Every Service's ports, one Service's after another's.
    ports: Vec<(Proto, u16)>,
}

struct ScannedService<'a> {
    namespace: &'a str,
    name: &'a str,
    vip: &'a str,
    /// Where its ports are in `Scanned::ports`.
    ports: Range<usize>,
    usable_endpoints: bool,
}

/// The document's members, when it is in the plain form (each port's protocol and number
/// checked on the way); `None` otherwise.
fn scan(text: &[u8]) -> Option<Scanned<'_>> {
    let mut r = Reader { t: text, i: 0 };
    let (mut generation, mut mode, mut ranges, mut mesh, mut services, mut timeout) =
        (None, None, None, None, None, None);
    let mut ports = Vec::new();
    const KEYS: [&[u8]; 6] =
        [b"generation", b"mode", b"serviceRanges", b"meshVIPs", b"services", b"dialledTimeoutSeconds"];
    r.object(&KEYS, |r, key| match key {
        b"generation" => once(&mut generation, r.number()?),
        b"mode" => once(&mut mode, r.string()?),
        b"serviceRanges" => once(&mut ranges, r.strings()?),
        b"meshVIPs" => once(&mut mesh, r.strings()?),
        b"services" => once(&mut services, r.services(&mut ports)?),
        b"dialledTimeoutSeconds" => once(&mut timeout, r.number()?),
        _ => None,
    })?;
    r.space();
    if r.i != text.len() {
        return None;
    }
    Some(Scanned {
        generation: generation?,
        mode: mode?,
        ranges: ranges?,
        mesh: mesh.unwrap_or_default(),
        timeout: timeout.unwrap_or_else(super::default_timeout),
        services: services?,
        ports,
    })
}

/// A member's value, unless the member was given before (serde refuses a member twice).
fn once<T>(slot: &mut Option<T>, value: T) -> Option<()> {
    if slot.is_some() {
        return None;
    }
    *slot = Some(value);
    Some(())
}

struct Reader<'a> {
    t: &'a [u8],
    i: usize,
}

/// The bytes a plain string holds as they are: printable ASCII but `"` and `\`.
const PLAIN: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0x20;
    while b < 0x80 {
        t[b] = b != b'"' as usize && b != b'\\' as usize;
        b += 1;
    }
    t
};

const ONES: u64 = 0x0101_0101_0101_0101;

/// Eight bytes (the first in the low bits) as the high bits of those that are not `PLAIN`:
/// exact up to the first of them, which is what `plain` needs (a borrow only carries upwards,
/// past a byte that sets it). Each test is the classic "has a zero byte" trick.
fn stops(w: u64) -> u64 {
    let zero = |x: u64| x.wrapping_sub(ONES) & !x;
    let below_space = w.wrapping_sub(ONES * 0x20) & !w;
    (w | below_space | zero(w ^ (ONES * u64::from(b'"'))) | zero(w ^ (ONES * u64::from(b'\\')))) & (ONES * 0x80)
}

impl<'a> Reader<'a> {
    /// JSON's whitespace.
    fn space(&mut self) {
        self.peek();
    }

    /// The next byte after whitespace, not taken.
    fn peek(&mut self) -> Option<u8> {
        loop {
            let b = *self.t.get(self.i)?;
            if !matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
                return Some(b);
            }
            self.i += 1;
        }
    }

    /// The next byte after whitespace, taken if it is `b`.
    fn take(&mut self, b: u8) -> bool {
        let here = self.peek() == Some(b);
        self.i += usize::from(here);
        here
    }

    /// After a member or an item: whether another follows (`,`) or the object or array ends
    /// (`end`).
    fn more(&mut self, end: u8) -> Option<bool> {
        let b = self.peek()?;
        self.i += 1;
        match b {
            b',' => Some(true),
            _ if b == end => Some(false),
            _ => None,
        }
    }

    /// A member's key, when it is one of `keys` (names of plain bytes), written as is: the
    /// bytes `"name"`. Compared in place, not scanned first (nine keys in each Service).
    fn key(&mut self, keys: &[&'static [u8]]) -> Option<&'static [u8]> {
        if self.peek()? != b'"' {
            return None;
        }
        let rest = &self.t[self.i + 1..];
        let key = *keys.iter().find(|k| rest.get(k.len()) == Some(&b'"') && rest.starts_with(k))?;
        self.i += key.len() + 2;
        Some(key)
    }

    /// A string's bytes, when all are `PLAIN`: its text is then its bytes. Eight bytes at a
    /// time (`stops`), the last few one by one. Not inlined: its loop, alone, keeps what it
    /// counts in registers (inlined in the readers of objects it took three times the
    /// instructions).
    #[inline(never)]
    fn plain(&mut self) -> Option<&'a [u8]> {
        if !self.take(b'"') {
            return None;
        }
        let rest = &self.t[self.i..];
        let mut len = 0;
        let end = loop {
            let Some(word) = rest.get(len..len + 8) else {
                while PLAIN[usize::from(*rest.get(len)?)] {
                    len += 1;
                }
                break len;
            };
            let stop = stops(u64::from_le_bytes(word.try_into().expect("8 bytes")));
            if stop != 0 {
                break len + (stop.trailing_zeros() / 8) as usize;
            }
            len += 8;
        };
        if rest[end] != b'"' {
            return None;
        }
        self.i += end + 1;
        Some(&rest[..end])
    }

    fn string(&mut self) -> Option<&'a str> {
        let bytes = self.plain()?;
        // SAFETY: `plain` bytes are ASCII (below 0x80), which is UTF-8.
        Some(unsafe { std::str::from_utf8_unchecked(bytes) })
    }

    /// A whole number in digits, no leading zero, within u64 (what serde reads as a u64). A
    /// sign, fraction or exponent stops the digits, and the byte after them is then not the
    /// `,`, `}` or `]` the caller requires.
    fn number(&mut self) -> Option<u64> {
        self.space();
        let start = self.i;
        let mut n: u64 = 0;
        while let Some(d) = self.t.get(self.i).filter(|b| b.is_ascii_digit()) {
            n = n.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
            self.i += 1;
        }
        let digits = &self.t[start..self.i];
        (digits.len() == 1 || digits.len() > 1 && digits[0] != b'0').then_some(n)
    }

    fn boolean(&mut self) -> Option<bool> {
        self.space();
        for (word, value) in [(&b"true"[..], true), (b"false", false)] {
            if self.t[self.i..].starts_with(word) {
                self.i += word.len();
                return Some(value);
            }
        }
        None
    }

    /// `{"key": value, ...}` whose keys are among `keys`, each read by `member` from its key.
    fn object(
        &mut self,
        keys: &[&'static [u8]],
        mut member: impl FnMut(&mut Self, &'static [u8]) -> Option<()>,
    ) -> Option<()> {
        if !self.take(b'{') {
            return None;
        }
        if self.take(b'}') {
            return Some(());
        }
        loop {
            let key = self.key(keys)?;
            if !self.take(b':') {
                return None;
            }
            member(self, key)?;
            if !self.more(b'}')? {
                return Some(());
            }
        }
    }

    /// `[item, ...]`, each read by `item`.
    fn array(&mut self, mut item: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        if !self.take(b'[') {
            return None;
        }
        if self.take(b']') {
            return Some(());
        }
        loop {
            item(self)?;
            if !self.more(b']')? {
                return Some(());
            }
        }
    }

    fn strings(&mut self) -> Option<Vec<&'a str>> {
        let mut out = Vec::new();
        self.array(|r| {
            out.push(r.string()?);
            Some(())
        })?;
        Some(out)
    }

    /// The Services, their ports appended to `ports`.
    fn services(&mut self, ports: &mut Vec<(Proto, u16)>) -> Option<Vec<ScannedService<'a>>> {
        let mut out = Vec::new();
        self.array(|r| {
            if out.len() == MAX_SERVICES {
                return None;
            }
            out.push(r.service(ports)?);
            Some(())
        })?;
        Some(out)
    }

    fn service(&mut self, ports: &mut Vec<(Proto, u16)>) -> Option<ScannedService<'a>> {
        let (mut namespace, mut name, mut vip, mut at, mut usable) = (None, None, None, None, None);
        const KEYS: [&[u8]; 5] = [b"name", b"namespace", b"ports", b"usableEndpoints", b"vip"];
        self.object(&KEYS, |r, key| match key {
            b"namespace" => once(&mut namespace, r.string()?),
            b"name" => once(&mut name, r.string()?),
            b"vip" => once(&mut vip, r.string()?),
            b"ports" => once(&mut at, r.ports(ports)?),
            b"usableEndpoints" => once(&mut usable, r.boolean()?),
            _ => None,
        })?;
        Some(ScannedService { namespace: namespace?, name: name?, vip: vip?, ports: at?, usable_endpoints: usable? })
    }

    /// A Service's ports, appended to `out`: where they are.
    fn ports(&mut self, out: &mut Vec<(Proto, u16)>) -> Option<Range<usize>> {
        let start = out.len();
        self.array(|r| {
            if out.len() - start == MAX_PORTS_PER_SERVICE {
                return None;
            }
            let (mut protocol, mut number) = (None, None);
            r.object(&[b"port", b"protocol"], |r, key| match key {
                b"protocol" => once(&mut protocol, r.string()?),
                b"port" => once(&mut number, r.number()?),
                _ => None,
            })?;
            out.push((proto(protocol?)?, port(number?)?));
            Some(())
        })?;
        Some(start..out.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `stops` finds the first byte that is not `PLAIN` wherever it is and whatever it is,
    /// with any byte after it; and none in a word of plain bytes.
    #[test]
    fn stops_finds_the_first_byte_a_plain_string_cannot_hold() {
        for at in 0..8 {
            for b in 0..=255u8 {
                for after in [b'a', 0, b'"', 0xff, b'\\', 0x1f, 0x80] {
                    let mut word = [b'~'; 8];
                    word[at] = b;
                    word[at + 1..].fill(after);
                    let stop = stops(u64::from_le_bytes(word));
                    let first = (stop != 0).then(|| stop.trailing_zeros() as usize / 8);
                    let want = word.iter().position(|&c| !PLAIN[usize::from(c)]);
                    assert_eq!(first, want, "{word:?}");
                }
            }
        }
    }
}
