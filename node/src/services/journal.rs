//! `<stateDir>/services/layer.journal`: the changes the installer's applier stored since
//! `snapshot.json` and `layer.bin` were last written whole. Writing both whole on every change
//! cost the applier more than sending the change to a hundred pods (1.7 MB and 0.2 MB at
//! 10,000 Services, encoded and hashed each time); an entry costs what the change is. Every
//! reader of the stored state folds the journal in (`ServicesDir::stored_layer`,
//! `stored_text`, `stored_header`), so the stored files with their journal are the truth as
//! the two files alone were.
//!
//! Only the long-lived applier appends, and only to a journal it wrote itself (the file's
//! identity unchanged since), over a canonical `snapshot.json`; any other writer writes the
//! files whole and removes the journal, and so does the applier after `MAX_ENTRIES`
//! entries (what every reader folds stays bounded).
//!
//! Layout, integers big-endian: a header (magic `AETHSVJ\n`, version, then the generation,
//! source digest and checksum of the `layer.bin` it extends), then entries, each its body's
//! length (4 bytes), the body and the body's `quick_digest` (8 bytes). A body: the generation
//! it changes from and the one it makes (8 + 8), mode (1), dialled timeout (4), the mesh VIPs
//! after it, the VIPs whose ports it takes out, the ports it puts in (each list a 4-byte
//! count then its items; an address is its family, 4 or 6, then its octets; a port is its
//! address, protocol number, port (2) and has-endpoints (1)), and the change document as the
//! agent sent it (a 4-byte length, then its bytes), which `snapshot.json` is folded with.
//!
//! A journal whose header names another `layer.bin` is stale (a whole write was stopped
//! before removing it) and is ignored. Entries are read up to the first that is torn (an
//! applier killed while appending), damaged or not chained to the one before: the state is
//! then the last whole entry's, as if the apply had been stopped just before.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

use aether_rules::model::Proto;
use aether_rules::services::{LayerMode, ServiceLayer, ServicePort};

use super::change::{self, splice};
use super::layer_file::{self, Base, StoredLayer};

/// The file's name under `services/`.
pub(super) const JOURNAL: &str = "layer.journal";
const MAGIC: &[u8; 8] = b"AETHSVJ\n";
const VERSION: u32 = 1;
const HEADER: usize = 8 + 4 + 3 * 8;
/// Entries the applier appends before it writes the files whole again: what a reader folds
/// (ADD's build path, a one-shot apply) stays a small part of reading the files.
pub(super) const MAX_ENTRIES: usize = 64;
/// The largest journal read.
pub(super) const MAX_BYTES: u64 = 24 << 20;
/// The applier appends only to a journal smaller than this, so one more entry stays within
/// `MAX_BYTES`: an entry is at most about twice its change document (at most 4 MiB), whose
/// layer delta is no larger than the text that names it.
pub(super) const APPEND_BELOW: u64 = 8 << 20;

/// One stored change, as the layer needs it and as the agent sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Entry<'a> {
    pub from: u64,
    pub generation: u64,
    pub mode: LayerMode,
    pub dialled_timeout_secs: u32,
    /// The layer's mesh VIPs after the change (a short list, taken whole).
    pub mesh_vips: Vec<IpAddr>,
    /// Every port of these VIPs taken out (sorted)...
    pub gone: Vec<IpAddr>,
    /// ...then these put in (sorted).
    pub came: Vec<ServicePort>,
    /// The change document.
    pub change: Cow<'a, [u8]>,
}

/// The header of a journal extending `base`.
pub(super) fn header(base: &Base) -> Vec<u8> {
    let mut b = Vec::with_capacity(HEADER);
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&VERSION.to_be_bytes());
    for v in [base.generation, base.source, base.checksum] {
        b.extend_from_slice(&v.to_be_bytes());
    }
    b
}

fn put_addr(b: &mut Vec<u8>, a: IpAddr) {
    match a {
        IpAddr::V4(a) => {
            b.push(4);
            b.extend_from_slice(&a.octets());
        }
        IpAddr::V6(a) => {
            b.push(6);
            b.extend_from_slice(&a.octets());
        }
    }
}

fn put_count(b: &mut Vec<u8>, n: usize) {
    b.extend_from_slice(&(n as u32).to_be_bytes());
}

impl Entry<'_> {
    /// The entry as appended: length, body, checksum.
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(64 + self.change.len() + 24 * (self.came.len() + self.mesh_vips.len()));
        body.extend_from_slice(&self.from.to_be_bytes());
        body.extend_from_slice(&self.generation.to_be_bytes());
        body.push(match self.mode {
            LayerMode::Off => 0,
            LayerMode::Count => 1,
            LayerMode::Refuse => 2,
        });
        body.extend_from_slice(&self.dialled_timeout_secs.to_be_bytes());
        for list in [&self.mesh_vips, &self.gone] {
            put_count(&mut body, list.len());
            list.iter().for_each(|&a| put_addr(&mut body, a));
        }
        put_count(&mut body, self.came.len());
        for p in &self.came {
            put_addr(&mut body, p.vip);
            body.extend_from_slice(&[p.proto.number(), (p.port >> 8) as u8, p.port as u8, p.has_endpoints as u8]);
        }
        put_count(&mut body, self.change.len());
        body.extend_from_slice(&self.change);
        let mut out = Vec::with_capacity(body.len() + 12);
        put_count(&mut out, body.len());
        out.extend_from_slice(&body);
        layer_file::seal(&mut out, 4);
        out
    }
}

/// A reader over one entry's body: `None` at anything out of place.
struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.b.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_be_bytes(self.take(8)?.try_into().ok()?))
    }
    /// A count of items of at least `min` bytes each, within what is left.
    fn count(&mut self, min: usize) -> Option<usize> {
        let n = self.u32()? as usize;
        (n.checked_mul(min)? <= self.b.len() - self.at).then_some(n)
    }
    fn addr(&mut self) -> Option<IpAddr> {
        match self.u8()? {
            4 => Some(IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(self.take(4)?).ok()?))),
            6 => Some(IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(self.take(16)?).ok()?))),
            _ => None,
        }
    }
    fn addrs(&mut self) -> Option<Vec<IpAddr>> {
        let n = self.count(5)?;
        (0..n).map(|_| self.addr()).collect()
    }
}

fn decode_body(body: &[u8]) -> Option<Entry<'static>> {
    let mut c = Cursor { b: body, at: 0 };
    let (from, generation) = (c.u64()?, c.u64()?);
    let mode = match c.u8()? {
        0 => LayerMode::Off,
        1 => LayerMode::Count,
        2 => LayerMode::Refuse,
        _ => return None,
    };
    let dialled_timeout_secs = c.u32()?;
    let mesh_vips = c.addrs()?;
    let gone = c.addrs()?;
    let n = c.count(9)?;
    let came = (0..n)
        .map(|_| {
            let vip = c.addr()?;
            let proto = match c.u8()? {
                6 => Proto::Tcp,
                17 => Proto::Udp,
                _ => return None,
            };
            let port = u16::from_be_bytes(c.take(2)?.try_into().ok()?);
            Some(ServicePort { vip, proto, port, has_endpoints: c.u8()? != 0 })
        })
        .collect::<Option<Vec<_>>>()?;
    let len = c.u32()? as usize;
    let change = c.take(len)?.to_vec().into();
    (c.at == body.len()).then_some(Entry {
        from,
        generation,
        mode,
        dialled_timeout_secs,
        mesh_vips,
        gone,
        came,
        change,
    })
}

/// The entries of the journal `bytes` that extend `base`, chained from its generation, up to
/// the first torn, damaged or unchained one; none when the header names another base.
pub(super) fn decode(bytes: &[u8], base: &Base) -> Vec<Entry<'static>> {
    if bytes.len() < HEADER || bytes[..HEADER] != header(base)[..] {
        return Vec::new();
    }
    let mut entries: Vec<Entry> = Vec::new();
    let mut at = HEADER;
    let mut generation = base.generation;
    while let Some(len) = bytes.get(at..at + 4).map(|b| u32::from_be_bytes(b.try_into().expect("4 bytes")) as usize) {
        let Some(body) = bytes.get(at + 4..at + 12 + len).and_then(layer_file::unseal) else {
            break;
        };
        match decode_body(body) {
            Some(e) if e.from == generation && e.generation > generation => {
                generation = e.generation;
                entries.push(e);
            }
            _ => break,
        }
        at += 12 + len;
    }
    entries
}

/// The journal at `path` over `base` (none when there is no file). An unreadable file is an
/// error: the state it holds is not silently older.
pub(super) fn read(path: &Path, base: &Base) -> std::io::Result<Vec<Entry<'static>>> {
    Ok(crate::state::read_capped(path, MAX_BYTES)?.map_or_else(Vec::new, |bytes| decode(&bytes, base)))
}

/// `base` with the `entries` folded in, in one pass over its ports: each VIP's ports as the
/// last entry that touched it left them. Source digest 0: no document is known whole by its
/// digest (one sent again is read in full).
pub(super) fn fold(base: StoredLayer, entries: &[Entry]) -> StoredLayer {
    let Some(last) = entries.last() else { return base };
    let mut gone: BTreeSet<IpAddr> = BTreeSet::new();
    let mut came: BTreeMap<IpAddr, Vec<ServicePort>> = BTreeMap::new();
    for e in entries {
        for v in &e.gone {
            came.remove(v);
            gone.insert(*v);
        }
        for p in &e.came {
            came.entry(p.vip).or_default().push(*p);
        }
    }
    let gone: Vec<IpAddr> = gone.into_iter().collect();
    let mut came: Vec<ServicePort> = came.into_values().flatten().collect();
    came.sort_unstable();
    let mut mesh_vips = last.mesh_vips.clone();
    mesh_vips.sort_unstable();
    let layer = ServiceLayer {
        mode: last.mode,
        dialled_timeout_secs: last.dialled_timeout_secs,
        mesh_vips,
        ports: splice::spliced_ports(&base.layer.ports, &gone, &came),
        ..base.layer
    };
    StoredLayer { generation: last.generation, digest: layer_file::content_digest(&layer), source: 0, layer }
}

/// The canonical document `text` (the one `base` was made from) with the entries' change
/// documents applied in turn, as the applier applied them; `None` if one no longer applies
/// (the journal is then not the one those files were written with).
pub(super) fn fold_text(mut text: Vec<u8>, base: &StoredLayer, entries: &[Entry]) -> Option<Vec<u8>> {
    let mut layer = base.layer.clone();
    let mut generation = base.generation;
    for e in entries {
        let c = change::parse(&e.change).ok()?;
        if c.base_generation != generation || c.generation != e.generation {
            return None;
        }
        let s = splice::splice(Cow::Owned(text), &layer, generation, &c, None)?;
        (text, layer, generation) = (s.text, s.layer, c.generation);
    }
    Some(text)
}

#[cfg(test)]
mod tests;
