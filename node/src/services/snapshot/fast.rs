//! The snapshot in the plain form agents write, read by a scanner of its own: each member at
//! most once, strings of printable ASCII without escapes, whole numbers in plain digits, no
//! `null`. At 10,000 Services it costs about half of serde's instructions, the Services
//! built included (35 M against 65 M): no UTF-8 check per string, no identifier visitor per
//! key, no list of ports per Service to copy; `apply` reads the whole 1.5 MB document each
//! time its content changes.
//!
//! It only ever answers what the serde reading (`typed`) answers: any byte outside the plain
//! form, valid JSON or not, gives up (`None`) and leaves the document to serde, which decides
//! (tests compare the two on random documents). Members are checked by the same functions.

use std::borrow::Cow;

use aether_rules::model::Proto;

use super::{checked, port, proto, typed_service, Service, Snapshot, MAX_PORTS_PER_SERVICE, MAX_SERVICES};

/// The document, when it is in the plain form and passes the typed checks; `None` otherwise
/// (the caller asks serde).
pub(super) fn read(text: &[u8]) -> Option<Snapshot> {
    let mut r = Reader { t: text, i: 0 };
    let (mut generation, mut mode, mut ranges, mut mesh, mut services, mut timeout) =
        (None, None, None, None, None, None);
    r.object(|r, key| match key {
        b"generation" => once(&mut generation, r.number()?),
        b"mode" => once(&mut mode, r.string()?),
        b"serviceRanges" => once(&mut ranges, r.strings()?),
        b"meshVIPs" => once(&mut mesh, r.strings()?),
        b"services" => once(&mut services, r.services()?),
        b"dialledTimeoutSeconds" => once(&mut timeout, r.number()?),
        _ => None,
    })?;
    r.space();
    if r.i != text.len() {
        return None;
    }
    checked(
        generation?,
        mode?,
        &ranges?,
        &mesh.unwrap_or_default(),
        services?,
        timeout.unwrap_or_else(super::default_timeout),
    )
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

    /// A string's bytes, when all are `PLAIN`: its text is then its bytes. Not inlined: its
    /// loop, alone, keeps what it counts in registers (inlined in the readers of objects it
    /// took three times the instructions per byte).
    #[inline(never)]
    fn plain(&mut self) -> Option<&'a [u8]> {
        if !self.take(b'"') {
            return None;
        }
        let rest = &self.t[self.i..];
        let mut len = 0;
        while PLAIN[usize::from(*rest.get(len)?)] {
            len += 1;
        }
        if rest[len] != b'"' {
            return None;
        }
        self.i += len + 1;
        Some(&rest[..len])
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

    /// `{"key": value, ...}`, each member read by `member` from its key's bytes.
    fn object(&mut self, mut member: impl FnMut(&mut Self, &'a [u8]) -> Option<()>) -> Option<()> {
        if !self.take(b'{') {
            return None;
        }
        if self.take(b'}') {
            return Some(());
        }
        loop {
            let key = self.plain()?;
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

    fn services(&mut self) -> Option<Vec<Service>> {
        let mut out = Vec::new();
        self.array(|r| {
            if out.len() == MAX_SERVICES {
                return None;
            }
            out.push(r.service()?);
            Some(())
        })?;
        Some(out)
    }

    fn service(&mut self) -> Option<Service> {
        let (mut namespace, mut name, mut vip, mut ports, mut usable) = (None, None, None, None, None);
        self.object(|r, key| match key {
            b"namespace" => once(&mut namespace, r.string()?),
            b"name" => once(&mut name, r.string()?),
            b"vip" => once(&mut vip, r.string()?),
            b"ports" => once(&mut ports, r.ports()?),
            b"usableEndpoints" => once(&mut usable, r.boolean()?),
            _ => None,
        })?;
        typed_service(Cow::Borrowed(namespace?), Cow::Borrowed(name?), vip?, ports?, usable?)
    }

    fn ports(&mut self) -> Option<Vec<(Proto, u16)>> {
        let mut out = Vec::new();
        self.array(|r| {
            if out.len() == MAX_PORTS_PER_SERVICE {
                return None;
            }
            let (mut protocol, mut number) = (None, None);
            r.object(|r, key| match key {
                b"protocol" => once(&mut protocol, r.string()?),
                b"port" => once(&mut number, r.number()?),
                _ => None,
            })?;
            out.push((proto(protocol?)?, port(number?)?));
            Some(())
        })?;
        Some(out)
    }
}
