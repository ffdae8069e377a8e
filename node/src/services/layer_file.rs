//! `<stateDir>/services/layer.bin`: the accepted snapshot as the layer needs it, in a form
//! cheap to load, so ADD never parses the JSON snapshot (at 10,000 Services that parse was
//! most of a pod's start). Written by `services apply` next to `snapshot.json`, after it;
//! read by ADD, by the next apply (the generation it changes from) and by
//! `counters`/`inspect` (the header only).
//!
//! Layout (version 3), integers big-endian:
//!
//! | bytes | field |
//! | --- | --- |
//! | 8 | magic `AETHSVL\n` |
//! | 4 | format version |
//! | 8 | generation |
//! | 8 | `source_digest` of the JSON document it was made from |
//! | 1 + 3 | mode (0 off, 1 count, 2 refuse), 3 zero bytes |
//! | 4 | dialled timeout, seconds |
//! | 6 x 4 | number of IPv4 ranges, IPv6 ranges, IPv4 mesh VIPs, IPv6 mesh VIPs, IPv4 Service ports, IPv6 Service ports |
//! | 5 / 17 each | ranges: address, prefix length (IPv4 ones, then IPv6 ones) |
//! | 4 / 16 each | mesh VIPs (IPv4, then IPv6) |
//! | 8 / 20 each | Service ports: VIP, protocol number, port, has endpoints (0/1) (IPv4, then IPv6) |
//! | 8 | `quick_digest` of every byte before it |
//!
//! Older versions are still read, so pods start with the layer across an upgrade, and the
//! next apply writes version 3. Version 2 is laid out as version 3, with FNV-1a 64 as its
//! checksum and the four-lane FNV-1a of an earlier `source_digest` as its source digest
//! (which no document's digest now matches: the next apply reads its document in full).
//! Version 1 (IPv4 only) had three counts (ranges, mesh VIPs, ports) and the IPv4 sections
//! alone, and FNV-1a too.
//!
//! Ranges, mesh VIPs and ports are sorted, so equal content gives equal bytes after the
//! generation: that part's digest tells whether a pod already holds a layer.

use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use aether_rules::model::Proto;
use aether_rules::services::{LayerMode, ServiceLayer, ServicePort};
use ipnet::IpNet;

use super::snapshot::{MAX_MESH_VIPS, MAX_SERVICE_PORTS, MAX_SERVICE_RANGES};

const MAGIC: &[u8; 8] = b"AETHSVL\n";
pub const VERSION: u32 = 3;
/// Version 3 with the FNV-1a checksum: read, never written.
const VERSION_2: u32 = 2;
/// The IPv4-only format of the first release with `layer.bin`: read, never written.
const VERSION_1: u32 = 1;
/// Everything up to the counts: magic, version, generation, source digest, mode, timeout.
const FIXED: usize = 8 + 4 + 8 + 8 + 4 + 4;
const HEADER: usize = FIXED + 6 * 4;
/// Where the content starts: after the generation and the source digest (what older shapes'
/// digests covered).
#[cfg(test)]
const CONTENT: usize = 28;
const TRAILER: usize = 8;
/// Bytes per item, by family: (IPv4, IPv6).
const RANGE: (usize, usize) = (5, 17);
const VIP: (usize, usize) = (4, 16);
const PORT: (usize, usize) = (8, 20);
/// The largest file a snapshot within the limits encodes to (every item of the larger,
/// IPv6, size).
pub const MAX_BYTES: usize =
    HEADER + MAX_SERVICE_RANGES * RANGE.1 + MAX_MESH_VIPS * VIP.1 + MAX_SERVICE_PORTS * PORT.1 + TRAILER;

#[derive(Debug, thiserror::Error)]
pub enum LayerFileError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} is larger than any layer within the snapshot limits ({max} bytes)")]
    TooLarge { path: PathBuf, max: usize },
    #[error("{path} is not a Service layer file")]
    NotALayerFile { path: PathBuf },
    #[error("{path} has format version {found}; this plugin reads versions {VERSION_1} to {VERSION}")]
    Version { path: PathBuf, found: u32 },
    #[error("{path} is damaged: {what}")]
    Damaged { path: PathBuf, what: &'static str },
}

/// An accepted snapshot's layer (its divert mark is each pod's own, set by the caller).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredLayer {
    pub generation: u64,
    pub layer: ServiceLayer,
    /// `content_digest` of the encoded content: equal for equal layers of one shape,
    /// whatever the generation. (It was FNV-1a, a byte at a time: a fifth of a millisecond
    /// for 20,000 ports on every change; then the content's alone, before the layer had
    /// shapes. After an upgrade, a pod whose file names an old digest is rebuilt once.)
    pub digest: u64,
    /// `source_digest` of the document it was made from: the same document sent again need
    /// not be parsed again.
    pub source: u64,
}

/// Which `layer.bin` a journal extends: its generation, source digest and checksum (the
/// file's last eight bytes, over all before them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Base {
    pub generation: u64,
    pub source: u64,
    pub checksum: u64,
}

impl Base {
    /// The base of a file `decode` took (its header and trailer are there).
    fn of(bytes: &[u8]) -> Base {
        let word = |at: usize| u64::from_be_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        Base { generation: word(12), source: word(20), checksum: word(bytes.len() - TRAILER) }
    }
}

/// `StoredLayer::digest`: a sum (wrapping) of one word per item, each Service port and each
/// mesh VIP, and one for everything else (mode, timeout, ranges, and the layer's shape, so
/// a pod whose file names an older shape's layer is rebuilt by the next apply). A sum, so a
/// layer a change makes has the previous digest with the changed items' words taken out and
/// put in (`moved_digest`), at the cost of the change and not of the layer; and equal
/// content gives one digest whatever the order and whatever the way it was reached (a whole
/// snapshot, `layer.bin` and its journal, or the applier's changes in memory).
pub(crate) fn content_digest(l: &ServiceLayer) -> u64 {
    let ports = l.ports.iter().fold(0u64, |sum, p| sum.wrapping_add(port_word(p)));
    let mesh = l.mesh_vips.iter().fold(0u64, |sum, &a| sum.wrapping_add(mesh_word(a)));
    head_word(l).wrapping_add(ports).wrapping_add(mesh)
}

/// `content_digest(next)` from `content_digest(prev)` = `digest`, where `next`'s ports are
/// `prev`'s without those of the VIPs `gone` and with `came` (its head and mesh VIPs, short
/// lists, are taken whole).
pub(crate) fn moved_digest(
    digest: u64,
    prev: &ServiceLayer,
    next: &ServiceLayer,
    gone: &[IpAddr],
    came: &[ServicePort],
) -> u64 {
    let sum = |words: &mut dyn Iterator<Item = u64>| words.fold(0u64, u64::wrapping_add);
    let out = sum(&mut gone
        .iter()
        .flat_map(|&v| prev.ports[aether_rules::services::ports_of(&prev.ports, v)].iter().map(port_word)));
    let mesh_out = sum(&mut prev.mesh_vips.iter().map(|&a| mesh_word(a)));
    let mesh_in = sum(&mut next.mesh_vips.iter().map(|&a| mesh_word(a)));
    digest
        .wrapping_sub(head_word(prev))
        .wrapping_add(head_word(next))
        .wrapping_sub(out)
        .wrapping_add(sum(&mut came.iter().map(port_word)))
        .wrapping_sub(mesh_out)
        .wrapping_add(mesh_in)
}

/// One item's word: its words folded in turn by a bijective step (a xor, a multiply, a
/// rotate: items that differ in one word never share the state after it), then finished by
/// MurmurHash3's mix, so that a sum of words does not cancel by structure.
fn item_word(tag: u64, words: &[u64]) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let h = words.iter().fold(tag.wrapping_mul(0xff51_afd7_ed55_8ccd), |h, &w| (h ^ w).wrapping_mul(K).rotate_left(29));
    let h = (h ^ (h >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    let h = (h ^ (h >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// An address as two words and its family.
fn addr_words(a: IpAddr) -> (u64, u64, u64) {
    match a {
        IpAddr::V4(a) => (4, 0, u64::from(u32::from(a))),
        IpAddr::V6(a) => {
            let v = u128::from(a);
            (6, (v >> 64) as u64, v as u64)
        }
    }
}

fn port_word(p: &ServicePort) -> u64 {
    let (family, hi, lo) = addr_words(p.vip);
    let rest = u64::from(p.proto.number()) << 24 | u64::from(p.port) << 8 | u64::from(p.has_endpoints);
    item_word(1, &[family, hi, lo, rest])
}

fn mesh_word(a: IpAddr) -> u64 {
    let (family, hi, lo) = addr_words(a);
    item_word(2, &[family, hi, lo])
}

fn head_word(l: &ServiceLayer) -> u64 {
    let mut words =
        vec![aether_rules::services::SHAPE, u64::from(mode_byte(l.mode)), u64::from(l.dialled_timeout_secs)];
    let mut ranges = l.ranges.clone();
    ranges.sort();
    for r in &ranges {
        let (family, hi, lo) = addr_words(r.addr());
        words.extend([family, hi, lo, u64::from(r.prefix_len())]);
    }
    item_word(0, &words)
}

/// The digest a release building the older `shape` (1 or 2) gave a layer: its encoded
/// content's `quick_digest` (shape 1), mixed with the shape (shape 2). What an upgraded
/// node's pods' files name.
#[cfg(test)]
pub(crate) fn shape_digest(content: &[u8], shape: u64) -> u64 {
    match shape {
        1 => quick_digest(content),
        _ => quick_digest(content) ^ shape.wrapping_mul(0x9e37_79b9_7f4a_7c15),
    }
}

/// The digest `StoredLayer::source` holds for a document: `quick_digest`. Every apply
/// hashes the whole document, 1.5 MB at 10,000 Services.
pub fn source_digest(text: &[u8]) -> u64 {
    quick_digest(text)
}

/// A 64-bit digest, eight bytes at a time in four interleaved lanes (word `i` to lane
/// `i % 4`, the last 0-31 bytes zero-padded), each word mixed in by a xor, a multiply and a
/// rotate; the lanes then folded into the length the same way, and finished by MurmurHash3's
/// mix. Each step is a bijection of its lane, so two inputs of one length that differ within
/// one word never get one digest. About 0.6 instructions a byte, against 3.4 for FNV-1a in
/// four lanes (each byte its own multiply). A checksum against torn or damaged files and a
/// name for a document, not a defence against tampering (the state directory is root's).
pub fn quick_digest(bytes: &[u8]) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mix = |lane: u64, word: u64| (lane ^ word).wrapping_mul(K).rotate_left(29);
    let mut lanes = [FNV_OFFSET, FNV_OFFSET ^ 1, FNV_OFFSET ^ 2, FNV_OFFSET ^ 3];
    let mut blocks = bytes.chunks_exact(32);
    let mut tail = [0u8; 32];
    tail[..blocks.remainder().len()].copy_from_slice(blocks.remainder());
    let mut add = |block: &[u8]| {
        let word = |i: usize| u64::from_le_bytes(block[8 * i..8 * i + 8].try_into().expect("8 bytes"));
        lanes = [mix(lanes[0], word(0)), mix(lanes[1], word(1)), mix(lanes[2], word(2)), mix(lanes[3], word(3))];
    };
    for block in &mut blocks {
        add(block);
    }
    add(&tail);
    let h = lanes.into_iter().fold(bytes.len() as u64, mix);
    let h = (h ^ (h >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    let h = (h ^ (h >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// The one rule for a torn or damaged file under `<stateDir>/services`: a file is written whole
/// under a temporary name and renamed into place (`ServicesDir::write_atomic`), and every
/// byte format of ours ends what it writes (a whole file, or each entry of the one file
/// appended to, the journal) with the `quick_digest` of the bytes it covers, big-endian
/// (`seal`); a reader takes only what `unseal` vouches for. (`snapshot.json` is the agent's
/// text, named by `layer.bin`'s source digest; `accumulator.json` is whole by the rename.)
pub(super) fn seal(out: &mut Vec<u8>, from: usize) {
    let sum = quick_digest(&out[from..]);
    out.extend_from_slice(&sum.to_be_bytes());
}

/// The bytes `sealed` covers, when its last eight bytes are their `quick_digest` (`seal`).
pub(super) fn unseal(sealed: &[u8]) -> Option<&[u8]> {
    let (body, sum) = sealed.split_at_checked(sealed.len().checked_sub(TRAILER)?)?;
    (quick_digest(body).to_be_bytes()[..] == *sum).then_some(body)
}

impl StoredLayer {
    /// The stored form of `layer` at `generation` (lists sorted, IPv4 before IPv6, the mark
    /// dropped).
    pub fn new(generation: u64, layer: &ServiceLayer, source: u64) -> StoredLayer {
        StoredLayer::with_file(generation, layer.clone(), source).0
    }

    /// `new` of a layer handed over, and the bytes `layer.bin` holds for it (`encode`):
    /// encoded once for both.
    pub fn with_file(generation: u64, mut layer: ServiceLayer, source: u64) -> (StoredLayer, Vec<u8>) {
        layer.ranges.sort();
        layer.mesh_vips.sort();
        layer.ports.sort();
        layer.divert_mark = 0;
        let bytes = encode_parts(generation, source, &layer);
        let digest = content_digest(&layer);
        (StoredLayer { generation, digest, source, layer }, bytes)
    }

    /// The layer for a pod whose capture diverts with `divert_mark`.
    pub fn for_pod(&self, divert_mark: u32) -> ServiceLayer {
        ServiceLayer { divert_mark, identity: Some(self.id()), ..self.layer.clone() }
    }

    /// `for_pod`, its ports taken rather than copied (20,000 at 10,000 Services: ADD's
    /// memory); the rest of the layer is left as it was.
    pub fn take_for_pod(&mut self, divert_mark: u32) -> ServiceLayer {
        let ports = std::mem::take(&mut self.layer.ports);
        ServiceLayer { divert_mark, identity: Some(self.id()), ports, ..self.layer.clone() }
    }

    /// The name its tables carry (`ServiceLayer::identity`).
    pub fn id(&self) -> aether_rules::services::LayerId {
        aether_rules::services::LayerId { generation: self.generation, digest: self.digest }
    }

    /// What the tables of this layer for `divert_mark` say they hold.
    pub fn named(&self, divert_mark: u32) -> aether_rules::services::Named {
        aether_rules::services::Named { shape: aether_rules::services::SHAPE, id: self.id(), divert_mark }
    }

    pub fn encode(&self) -> Vec<u8> {
        encode_parts(self.generation, self.source, &self.layer)
    }
}

/// Appends an address's bytes (without a `Vec` per address: 20,000 of them at 10,000
/// Services).
fn put_octets(b: &mut Vec<u8>, a: IpAddr) {
    match a {
        IpAddr::V4(a) => b.extend_from_slice(&a.octets()),
        IpAddr::V6(a) => b.extend_from_slice(&a.octets()),
    }
}

/// `l`'s lists are sorted, so each family's items are together, IPv4 first.
fn encode_parts(generation: u64, source: u64, l: &ServiceLayer) -> Vec<u8> {
    let v4_ranges = l.ranges.iter().filter(|r| matches!(r, IpNet::V4(_))).count();
    let v4_mesh = l.mesh_vips.iter().filter(|a| a.is_ipv4()).count();
    let v4_ports = l.ports.iter().filter(|p| p.vip.is_ipv4()).count();
    let (v6_ranges, v6_mesh, v6_ports) =
        (l.ranges.len() - v4_ranges, l.mesh_vips.len() - v4_mesh, l.ports.len() - v4_ports);
    let size = HEADER
        + v4_ranges * RANGE.0
        + v6_ranges * RANGE.1
        + v4_mesh * VIP.0
        + v6_mesh * VIP.1
        + v4_ports * PORT.0
        + v6_ports * PORT.1
        + TRAILER;
    let mut b = Vec::with_capacity(size);
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&VERSION.to_be_bytes());
    b.extend_from_slice(&generation.to_be_bytes());
    b.extend_from_slice(&source.to_be_bytes());
    b.extend_from_slice(&[mode_byte(l.mode), 0, 0, 0]);
    b.extend_from_slice(&l.dialled_timeout_secs.to_be_bytes());
    for n in [v4_ranges, v6_ranges, v4_mesh, v6_mesh, v4_ports, v6_ports] {
        b.extend_from_slice(&(n as u32).to_be_bytes());
    }
    // Each family's items together, IPv4 first, in the lists' order: two passes, no copy.
    for v6 in [false, true] {
        for r in l.ranges.iter().filter(|r| r.addr().is_ipv6() == v6) {
            put_octets(&mut b, r.addr());
            b.push(r.prefix_len());
        }
    }
    for v6 in [false, true] {
        for &v in l.mesh_vips.iter().filter(|a| a.is_ipv6() == v6) {
            put_octets(&mut b, v);
        }
    }
    for v6 in [false, true] {
        for p in l.ports.iter().filter(|p| p.vip.is_ipv6() == v6) {
            put_octets(&mut b, p.vip);
            b.extend_from_slice(&[p.proto.number(), (p.port >> 8) as u8, p.port as u8, p.has_endpoints as u8]);
        }
    }
    debug_assert_eq!(b.len() + TRAILER, size);
    seal(&mut b, 0);
    b
}

fn mode_byte(m: LayerMode) -> u8 {
    match m {
        LayerMode::Off => 0,
        LayerMode::Count => 1,
        LayerMode::Refuse => 2,
    }
}

/// FNV-1a, 64 bits: the content's digest (`StoredLayer::digest`, which the pods' files
/// record, so it stays across format versions) and the checksum of versions 1 and 2.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h = FNV_OFFSET;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0100_0000_01b3;

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}

/// An address of `len` (4 or 16) bytes at `at`.
fn addr(b: &[u8], at: usize, len: usize) -> IpAddr {
    match len {
        4 => IpAddr::V4(Ipv4Addr::new(b[at], b[at + 1], b[at + 2], b[at + 3])),
        _ => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&b[at..at + 16]).expect("16 bytes"))),
    }
}

/// Decodes and checks a whole file: magic, version, sizes, checksum, every field's range.
pub fn decode(path: &Path, b: &[u8]) -> Result<StoredLayer, LayerFileError> {
    let damaged = |what| LayerFileError::Damaged { path: path.to_path_buf(), what };
    if b.len() < 12 || &b[..8] != MAGIC {
        return Err(LayerFileError::NotALayerFile { path: path.to_path_buf() });
    }
    let version = be32(b, 8);
    // (IPv4, IPv6) counts of ranges, mesh VIPs and ports; version 1 has IPv4 ones only.
    let header = match version {
        VERSION | VERSION_2 => HEADER,
        VERSION_1 => FIXED + 3 * 4,
        found => return Err(LayerFileError::Version { path: path.to_path_buf(), found }),
    };
    if b.len() < header + TRAILER {
        return Err(damaged("shorter than its header"));
    }
    let count = |i: usize| be32(b, FIXED + 4 * i) as usize;
    let [(r4, r6), (m4, m6), (p4, p6)] = match version {
        VERSION | VERSION_2 => [(count(0), count(1)), (count(2), count(3)), (count(4), count(5))],
        _ => [(count(0), 0), (count(1), 0), (count(2), 0)],
    };
    if r4 + r6 > MAX_SERVICE_RANGES || m4 + m6 > MAX_MESH_VIPS || p4 + p6 > MAX_SERVICE_PORTS {
        return Err(damaged("counts beyond the snapshot limits"));
    }
    let end = header + r4 * RANGE.0 + r6 * RANGE.1 + m4 * VIP.0 + m6 * VIP.1 + p4 * PORT.0 + p6 * PORT.1;
    if b.len() != end + TRAILER {
        return Err(damaged("its length does not match its counts"));
    }
    let whole = match version {
        VERSION => unseal(b).is_some(),
        _ => fnv1a(&b[..end]).to_be_bytes() == b[end..],
    };
    if !whole {
        return Err(damaged("checksum mismatch"));
    }
    let generation = u64::from_be_bytes(b[12..20].try_into().unwrap());
    let source = u64::from_be_bytes(b[20..28].try_into().unwrap());
    let mode = match b[28] {
        0 => LayerMode::Off,
        1 => LayerMode::Count,
        2 => LayerMode::Refuse,
        _ => return Err(damaged("unknown mode")),
    };
    let mut l = ServiceLayer::new(mode);
    l.divert_mark = 0;
    l.dialled_timeout_secs = be32(b, 32);
    let mut at = header;
    for (n, len) in [(r4, 4), (r6, 16)] {
        for _ in 0..n {
            let net = IpNet::new(addr(b, at, len), b[at + len]).map_err(|_| damaged("a range's prefix is too long"))?;
            l.ranges.push(net);
            at += len + 1;
        }
    }
    for (n, len) in [(m4, 4), (m6, 16)] {
        for _ in 0..n {
            l.mesh_vips.push(addr(b, at, len));
            at += len;
        }
    }
    l.ports.reserve_exact(p4 + p6);
    for (n, len) in [(p4, 4), (p6, 16)] {
        for _ in 0..n {
            let proto = match b[at + len] {
                6 => Proto::Tcp,
                17 => Proto::Udp,
                _ => return Err(damaged("a port's protocol is not TCP or UDP")),
            };
            l.ports.push(ServicePort {
                vip: addr(b, at, len),
                proto,
                port: u16::from_be_bytes([b[at + len + 1], b[at + len + 2]]),
                has_endpoints: b[at + len + 3] != 0,
            });
            at += len + 4;
        }
    }
    if version == VERSION_1 {
        // Sorted as the current encoding sorts, so a pod's record compares the same before
        // and after the next apply rewrites the file.
        return Ok(StoredLayer::new(generation, &l, source));
    }
    Ok(StoredLayer { generation, digest: content_digest(&l), source, layer: l })
}

/// Reads the file, and which file it was (what a journal over it names); `Ok(None)` when
/// there is none. Memory: the file, bounded by `MAX_BYTES`.
pub fn read_with_base(path: &Path) -> Result<Option<(StoredLayer, Base)>, LayerFileError> {
    let io = |source| LayerFileError::Io { path: path.to_path_buf(), source };
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(e)),
    };
    let mut bytes = Vec::new();
    f.take(MAX_BYTES as u64 + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() > MAX_BYTES {
        return Err(LayerFileError::TooLarge { path: path.to_path_buf(), max: MAX_BYTES });
    }
    let layer = decode(path, &bytes)?;
    Ok(Some((layer, Base::of(&bytes))))
}

/// The file's header and its checksum, without the rest: which file it is (`Base`), its
/// generation and source digest (for `counters`, and for `apply` to tell the stored document
/// sent again).
pub fn read_base(path: &Path) -> Result<Option<Base>, LayerFileError> {
    let io = |source| LayerFileError::Io { path: path.to_path_buf(), source };
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(e)),
    };
    let mut head = [0u8; 28];
    f.read_exact(&mut head).map_err(|_| LayerFileError::Damaged { path: path.to_path_buf(), what: "no header" })?;
    if &head[..8] != MAGIC {
        return Err(LayerFileError::NotALayerFile { path: path.to_path_buf() });
    }
    if ![VERSION, VERSION_2, VERSION_1].contains(&be32(&head, 8)) {
        return Err(LayerFileError::Version { path: path.to_path_buf(), found: be32(&head, 8) });
    }
    let word = |at: usize| u64::from_be_bytes(head[at..at + 8].try_into().unwrap());
    let mut sum = [0u8; TRAILER];
    let len = f.metadata().map_err(io)?.len();
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut sum, len.saturating_sub(TRAILER as u64))
        .map_err(|_| LayerFileError::Damaged { path: path.to_path_buf(), what: "no checksum" })?;
    Ok(Some(Base { generation: word(12), source: word(20), checksum: u64::from_be_bytes(sum) }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer() -> ServiceLayer {
        let mut l = ServiceLayer::new(LayerMode::Refuse);
        l.ranges = vec!["10.200.0.7/32".parse().unwrap(), "10.96.0.0/16".parse().unwrap()];
        l.mesh_vips = vec!["10.96.5.5".parse().unwrap()];
        l.dialled_timeout_secs = 600;
        l.ports = vec![
            ServicePort { vip: "10.96.1.2".parse().unwrap(), proto: Proto::Tcp, port: 80, has_endpoints: false },
            ServicePort { vip: "10.96.1.1".parse().unwrap(), proto: Proto::Udp, port: 18082, has_endpoints: true },
        ];
        l
    }

    #[test]
    fn the_source_digest_tells_documents_apart_by_any_byte_and_their_length() {
        let doc = br#"{"generation": 7, "mode": "count", "serviceRanges": ["10.96.0.0/16"], "services": []}"#.to_vec();
        let d = source_digest(&doc);
        assert_eq!(d, source_digest(&doc.clone()), "a digest is stable");
        let mut seen = std::collections::BTreeSet::from([d]);
        for i in 0..doc.len() {
            for bit in [0x01u8, 0x80] {
                let mut other = doc.clone();
                other[i] ^= bit;
                assert!(seen.insert(source_digest(&other)), "byte {i} bit {bit:#x}");
            }
        }
        // Lanes hold bytes by position: moving bytes between positions is a change too.
        let mut swapped = doc.clone();
        swapped.swap(1, 5);
        assert_ne!(source_digest(&swapped), d);
        for cut in 0..doc.len() {
            assert!(seen.insert(source_digest(&doc[..cut])), "cut at {cut}");
        }
        let mut longer = doc.clone();
        longer.push(0);
        assert_ne!(source_digest(&longer), d);
    }

    #[test]
    fn round_trips_and_the_digest_ignores_order_generation_and_mark() {
        let p = Path::new("layer.bin");
        let a = StoredLayer::new(7, &layer(), 1);
        let back = decode(p, &a.encode()).unwrap();
        assert_eq!(back, a);
        assert_eq!(back.for_pod(0xae71).ports.len(), 2);
        let mut shuffled = layer();
        shuffled.ports.reverse();
        shuffled.ranges.reverse();
        shuffled.divert_mark = 0x1234;
        let b = StoredLayer::new(8, &shuffled, 2);
        assert_eq!(a.digest, b.digest);
        assert_eq!(a.layer, b.layer);
        let mut other = layer();
        other.mode = LayerMode::Count;
        assert_ne!(StoredLayer::new(7, &other, 1).digest, a.digest);
    }

    #[test]
    fn damage_is_detected_and_named() {
        let p = Path::new("layer.bin");
        let good = StoredLayer::new(7, &layer(), 1).encode();
        let msg = |b: &[u8]| decode(p, b).unwrap_err().to_string();
        let mut flipped = good.clone();
        flipped[HEADER + 2] ^= 1;
        assert_eq!(msg(&flipped), "layer.bin is damaged: checksum mismatch");
        assert_eq!(msg(&good[..good.len() - 1]), "layer.bin is damaged: its length does not match its counts");
        assert_eq!(msg(b"{\"generation\": 1}"), "layer.bin is not a Service layer file");
        let mut v4 = good.clone();
        v4[11] = 4;
        assert_eq!(msg(&v4), "layer.bin has format version 4; this plugin reads versions 1 to 3");
        let mut huge = good.clone();
        huge[44..48].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(msg(&huge), "layer.bin is damaged: counts beyond the snapshot limits");
    }

    fn dual() -> ServiceLayer {
        let mut l = layer();
        l.ranges.extend(["fd00:10:96::/108".parse::<IpNet>().unwrap(), "fd00:200::7/128".parse().unwrap()]);
        l.mesh_vips.insert(0, "fd00:10:96::5:5".parse().unwrap());
        l.ports.insert(
            0,
            ServicePort { vip: "fd00:10:96::1:1".parse().unwrap(), proto: Proto::Udp, port: 53, has_endpoints: false },
        );
        l
    }

    /// IPv6 ranges, mesh VIPs and ports survive the file, each family in its own section.
    #[test]
    fn both_families_round_trip() {
        let p = Path::new("layer.bin");
        let a = StoredLayer::new(9, &dual(), 3);
        let bytes = a.encode();
        assert_eq!(decode(p, &bytes).unwrap(), a);
        let counts: Vec<u32> = (0..6).map(|i| be32(&bytes, FIXED + 4 * i)).collect();
        assert_eq!(counts, [2, 2, 1, 1, 2, 1]);
        assert_eq!(bytes.len(), HEADER + 2 * 5 + 2 * 17 + 4 + 16 + 2 * 8 + 20 + TRAILER);
        assert_ne!(a.digest, StoredLayer::new(9, &layer(), 3).digest);
    }

    /// A version 2 file (version 3 with FNV-1a's checksum) still loads, with the same
    /// content digest; its checksum is FNV-1a's (control: version 3's in it is damage).
    #[test]
    fn a_version_2_file_still_loads() {
        let p = Path::new("layer.bin");
        let v3 = StoredLayer::new(7, &dual(), 1);
        let mut b = v3.encode();
        b[8..12].copy_from_slice(&2u32.to_be_bytes());
        let end = b.len() - TRAILER;
        let fnv = fnv1a(&b[..end]);
        b[end..].copy_from_slice(&fnv.to_be_bytes());
        assert_eq!(decode(p, &b).unwrap(), v3);
        assert_eq!(read_header_of(&b), Some((7, 1)));
        let quick = quick_digest(&b[..end]);
        b[end..].copy_from_slice(&quick.to_be_bytes());
        assert_eq!(decode(p, &b).unwrap_err().to_string(), "layer.bin is damaged: checksum mismatch");
    }

    /// The digest a pod's file records names the layer's shape: it is not what a node of an
    /// older shape recorded for the same content, so a pod holding the older shape is not
    /// taken for one holding this layer.
    #[test]
    fn the_digest_names_the_layers_shape() {
        let s = StoredLayer::new(7, &dual(), 1);
        let b = s.encode();
        let content = &b[CONTENT..b.len() - TRAILER];
        for shape in [1, 2] {
            assert_ne!(s.digest, shape_digest(content, shape), "shape {shape}'s digest");
        }
        assert_eq!(decode(Path::new("layer.bin"), &b).unwrap().digest, s.digest, "the same read back");
    }

    /// Every field of the content moves the digest; the mark and the order do not (above).
    #[test]
    fn every_field_of_the_content_moves_the_digest() {
        let base = dual();
        let d = content_digest(&base);
        let mut edits: Vec<Box<dyn Fn(&mut ServiceLayer)>> = vec![
            Box::new(|l| l.mode = LayerMode::Count),
            Box::new(|l| l.dialled_timeout_secs += 1),
            Box::new(|l| l.ranges[0] = "10.96.0.0/17".parse().unwrap()),
            Box::new(|l| l.mesh_vips.truncate(l.mesh_vips.len() - 1)),
            Box::new(|l| l.ports[0].port += 1),
            Box::new(|l| l.ports[0].proto = if l.ports[0].proto == Proto::Udp { Proto::Tcp } else { Proto::Udp }),
            Box::new(|l| l.ports[0].has_endpoints = !l.ports[0].has_endpoints),
            Box::new(|l| l.ports[0].vip = "10.96.9.9".parse().unwrap()),
            Box::new(|l| l.ports.truncate(l.ports.len() - 1)),
        ];
        for (i, edit) in edits.iter_mut().enumerate() {
            let mut l = base.clone();
            edit(&mut l);
            assert_ne!(content_digest(&l), d, "edit {i}");
        }
    }

    /// The digest of a layer a change makes, moved by the change alone, is the digest of the
    /// layer made anew, over random changes of both families. Control: leaving out the words
    /// of the ports a change takes out gives another digest.
    #[test]
    fn the_moved_digest_is_the_digest_of_the_new_layer() {
        let mut rng = aether_testkit::Rng::new(0x5eed_d16e);
        let vip = |rng: &mut aether_testkit::Rng| -> IpAddr {
            if rng.below(4) == 0 {
                IpAddr::V6(Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, rng.below(200) as u16))
            } else {
                IpAddr::V4(Ipv4Addr::new(10, 96, 0, rng.below(200) as u8))
            }
        };
        let port = |rng: &mut aether_testkit::Rng, v: IpAddr| ServicePort {
            vip: v,
            proto: if rng.below(2) == 0 { Proto::Tcp } else { Proto::Udp },
            port: 1 + rng.below(3) as u16,
            has_endpoints: rng.below(3) != 0,
        };
        let mut l = StoredLayer::new(1, &dual(), 1);
        let mut controls = 0;
        for round in 0..300 {
            let mut gone: Vec<IpAddr> = (0..rng.below(3)).map(|_| vip(&mut rng)).collect();
            gone.sort();
            gone.dedup();
            let mut came: Vec<ServicePort> = Vec::new();
            for _ in 0..rng.below(3) {
                let v = vip(&mut rng);
                let free = l.layer.ports.iter().all(|p| p.vip != v || gone.contains(&v));
                if free && came.iter().all(|p| p.vip != v) {
                    came.extend((0..1 + rng.below(2)).map(|_| port(&mut rng, v)));
                }
            }
            came.sort();
            came.dedup_by(|a, b| (a.vip, a.proto, a.port) == (b.vip, b.proto, b.port));
            let mut next = l.layer.clone();
            next.ports.retain(|p| !gone.contains(&p.vip));
            next.ports.extend(&came);
            if rng.below(10) == 0 {
                next.mode = LayerMode::Count;
            }
            if rng.below(10) == 0 {
                next.mesh_vips.push(vip(&mut rng));
            }
            let made = StoredLayer::new(round + 2, &next, 1);
            let moved = moved_digest(l.digest, &l.layer, &made.layer, &gone, &came);
            assert_eq!(moved, made.digest, "round {round}");
            if gone.iter().any(|&v| l.layer.ports.iter().any(|p| p.vip == v)) {
                assert_ne!(moved_digest(l.digest, &l.layer, &made.layer, &[], &came), made.digest, "the control");
                controls += 1;
            }
            l = made;
        }
        assert!(controls > 20, "the control ran {controls} times");
    }

    fn read_header_of(bytes: &[u8]) -> Option<(u64, u64)> {
        let path = std::env::temp_dir().join(format!("aether-layer-header-{}", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        let header = read_base(&path).unwrap().map(|b| (b.generation, b.source));
        std::fs::remove_file(&path).unwrap();
        header
    }

    /// A version 1 file (the IPv4-only format of the release before) still loads, with the
    /// digest of the current encoding of the same layer.
    #[test]
    fn a_version_1_file_still_loads() {
        let l = StoredLayer::new(7, &layer(), 1).layer;
        let mut b = Vec::new();
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&1u32.to_be_bytes());
        b.extend_from_slice(&7u64.to_be_bytes());
        b.extend_from_slice(&1u64.to_be_bytes());
        b.extend_from_slice(&[2, 0, 0, 0]);
        b.extend_from_slice(&600u32.to_be_bytes());
        for n in [l.ranges.len(), l.mesh_vips.len(), l.ports.len()] {
            b.extend_from_slice(&(n as u32).to_be_bytes());
        }
        for r in &l.ranges {
            put_octets(&mut b, r.addr());
            b.push(r.prefix_len());
        }
        for v in &l.mesh_vips {
            put_octets(&mut b, *v);
        }
        for p in &l.ports {
            put_octets(&mut b, p.vip);
            b.extend_from_slice(&[p.proto.number(), (p.port >> 8) as u8, p.port as u8, p.has_endpoints as u8]);
        }
        let sum = fnv1a(&b);
        b.extend_from_slice(&sum.to_be_bytes());
        let back = decode(Path::new("layer.bin"), &b).unwrap();
        assert_eq!(back, StoredLayer::new(7, &layer(), 1));
    }
}
