//! `<stateDir>/services/layer.bin`: the accepted snapshot as the layer needs it, in a form
//! cheap to load, so ADD never parses the JSON snapshot (issue 11). Written by `services
//! apply` next to `snapshot.json`, after it; read by ADD, by the next apply (the generation it
//! changes from) and by `counters`/`inspect` (the header only).
//!
//! Layout (version 1), integers big-endian:
//!
//! | bytes | field |
//! | --- | --- |
//! | 8 | magic `AETHSVL\n` |
//! | 4 | format version |
//! | 8 | generation |
//! | 8 | FNV-1a 64 of the JSON document it was made from |
//! | 1 + 3 | mode (0 off, 1 count, 2 refuse), 3 zero bytes |
//! | 4 | dialled timeout, seconds |
//! | 4 + 4 + 4 | number of ranges, mesh VIPs, Service ports |
//! | 5 each | ranges: address, prefix length |
//! | 4 each | mesh VIPs |
//! | 8 each | Service ports: VIP, protocol number, port, has endpoints (0/1) |
//! | 8 | FNV-1a 64 of every byte before it |
//!
//! Ranges, mesh VIPs and ports are sorted, so equal content gives equal bytes after the
//! generation: that part's digest tells whether a pod already holds a layer.

use std::io::Read;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use aether_rules::model::Proto;
use aether_rules::services::{LayerMode, ServiceLayer, ServicePort};
use ipnet::Ipv4Net;

use super::snapshot::{MAX_MESH_VIPS, MAX_SERVICE_PORTS, MAX_SERVICE_RANGES};

const MAGIC: &[u8; 8] = b"AETHSVL\n";
pub const VERSION: u32 = 1;
const HEADER: usize = 8 + 4 + 8 + 8 + 4 + 4 + 12;
/// Where the content (everything the digest covers) starts: after the generation and the
/// source digest.
const CONTENT: usize = 28;
const RANGE: usize = 5;
const VIP: usize = 4;
const PORT: usize = 8;
const TRAILER: usize = 8;
/// The largest file a snapshot within the limits encodes to.
pub const MAX_BYTES: usize =
    HEADER + MAX_SERVICE_RANGES * RANGE + MAX_MESH_VIPS * VIP + MAX_SERVICE_PORTS * PORT + TRAILER;

#[derive(Debug, thiserror::Error)]
pub enum LayerFileError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} is larger than any layer within the snapshot limits ({max} bytes)")]
    TooLarge { path: PathBuf, max: usize },
    #[error("{path} is not a Service layer file")]
    NotALayerFile { path: PathBuf },
    #[error("{path} has format version {found}; this plugin reads version {VERSION}")]
    Version { path: PathBuf, found: u32 },
    #[error("{path} is damaged: {what}")]
    Damaged { path: PathBuf, what: &'static str },
}

/// An accepted snapshot's layer (its divert mark is each pod's own, set by the caller).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredLayer {
    pub generation: u64,
    pub layer: ServiceLayer,
    /// FNV-1a 64 of the encoded content: equal for equal layers, whatever the generation.
    pub digest: u64,
    /// `source_digest` of the document it was made from: the same document sent again need
    /// not be parsed again.
    pub source: u64,
}

/// The digest `StoredLayer::source` holds for a document.
pub fn source_digest(text: &[u8]) -> u64 {
    fnv1a(text)
}

impl StoredLayer {
    /// The stored form of `layer` at `generation` (lists sorted, the mark dropped).
    pub fn new(generation: u64, layer: &ServiceLayer, source: u64) -> StoredLayer {
        let mut layer = layer.clone();
        layer.ranges.sort();
        layer.mesh_vips.sort();
        layer.ports.sort();
        layer.divert_mark = 0;
        let bytes = encode_parts(generation, source, &layer);
        StoredLayer { generation, digest: fnv1a(&bytes[CONTENT..bytes.len() - TRAILER]), source, layer }
    }

    /// The layer for a pod whose capture diverts with `divert_mark`.
    pub fn for_pod(&self, divert_mark: u32) -> ServiceLayer {
        ServiceLayer { divert_mark, ..self.layer.clone() }
    }

    pub fn encode(&self) -> Vec<u8> {
        encode_parts(self.generation, self.source, &self.layer)
    }
}

fn encode_parts(generation: u64, source: u64, l: &ServiceLayer) -> Vec<u8> {
    let mut b =
        Vec::with_capacity(HEADER + l.ranges.len() * RANGE + l.mesh_vips.len() * VIP + l.ports.len() * PORT + TRAILER);
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&VERSION.to_be_bytes());
    b.extend_from_slice(&generation.to_be_bytes());
    b.extend_from_slice(&source.to_be_bytes());
    b.extend_from_slice(&[mode_byte(l.mode), 0, 0, 0]);
    b.extend_from_slice(&l.dialled_timeout_secs.to_be_bytes());
    for n in [l.ranges.len(), l.mesh_vips.len(), l.ports.len()] {
        b.extend_from_slice(&(n as u32).to_be_bytes());
    }
    for r in &l.ranges {
        b.extend_from_slice(&r.addr().octets());
        b.push(r.prefix_len());
    }
    for v in &l.mesh_vips {
        b.extend_from_slice(&v.octets());
    }
    for p in &l.ports {
        b.extend_from_slice(&p.vip.octets());
        b.push(p.proto.number());
        b.extend_from_slice(&p.port.to_be_bytes());
        b.push(p.has_endpoints as u8);
    }
    let sum = fnv1a(&b);
    b.extend_from_slice(&sum.to_be_bytes());
    b
}

fn mode_byte(m: LayerMode) -> u8 {
    match m {
        LayerMode::Off => 0,
        LayerMode::Count => 1,
        LayerMode::Refuse => 2,
    }
}

/// FNV-1a, 64 bits: a checksum against torn or damaged files, not against tampering (the
/// state directory is root's alone).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}

/// Decodes and checks a whole file: magic, version, sizes, checksum, every field's range.
pub fn decode(path: &Path, b: &[u8]) -> Result<StoredLayer, LayerFileError> {
    let damaged = |what| LayerFileError::Damaged { path: path.to_path_buf(), what };
    if b.len() < 12 || &b[..8] != MAGIC {
        return Err(LayerFileError::NotALayerFile { path: path.to_path_buf() });
    }
    if be32(b, 8) != VERSION {
        return Err(LayerFileError::Version { path: path.to_path_buf(), found: be32(b, 8) });
    }
    if b.len() < HEADER + TRAILER {
        return Err(damaged("shorter than its header"));
    }
    let (nr, nm, np) = (be32(b, 36) as usize, be32(b, 40) as usize, be32(b, 44) as usize);
    if nr > MAX_SERVICE_RANGES || nm > MAX_MESH_VIPS || np > MAX_SERVICE_PORTS {
        return Err(damaged("counts beyond the snapshot limits"));
    }
    let end = HEADER + nr * RANGE + nm * VIP + np * PORT;
    if b.len() != end + TRAILER {
        return Err(damaged("its length does not match its counts"));
    }
    if fnv1a(&b[..end]).to_be_bytes() != b[end..] {
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
    let addr = |at: usize| Ipv4Addr::new(b[at], b[at + 1], b[at + 2], b[at + 3]);
    let mut at = HEADER;
    for _ in 0..nr {
        l.ranges.push(Ipv4Net::new(addr(at), b[at + 4]).map_err(|_| damaged("a range's prefix is over 32"))?);
        at += RANGE;
    }
    for _ in 0..nm {
        l.mesh_vips.push(addr(at));
        at += VIP;
    }
    l.ports.reserve_exact(np);
    for _ in 0..np {
        let proto = match b[at + 4] {
            6 => Proto::Tcp,
            17 => Proto::Udp,
            _ => return Err(damaged("a port's protocol is not TCP or UDP")),
        };
        l.ports.push(ServicePort {
            vip: addr(at),
            proto,
            port: u16::from_be_bytes([b[at + 5], b[at + 6]]),
            has_endpoints: b[at + 7] != 0,
        });
        at += PORT;
    }
    Ok(StoredLayer { generation, digest: fnv1a(&b[CONTENT..end]), source, layer: l })
}

/// Reads the file; `Ok(None)` when there is none. Memory: the file, bounded by `MAX_BYTES`.
pub fn read(path: &Path) -> Result<Option<StoredLayer>, LayerFileError> {
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
    decode(path, &bytes).map(Some)
}

/// The generation and the source digest in the file's header, reading the header only
/// (for `counters`, and for `apply` to tell the stored document sent again).
pub fn read_header(path: &Path) -> Result<Option<(u64, u64)>, LayerFileError> {
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
    if be32(&head, 8) != VERSION {
        return Err(LayerFileError::Version { path: path.to_path_buf(), found: be32(&head, 8) });
    }
    let word = |at: usize| u64::from_be_bytes(head[at..at + 8].try_into().unwrap());
    Ok(Some((word(12), word(20))))
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
        let mut v2 = good.clone();
        v2[11] = 2;
        assert_eq!(msg(&v2), "layer.bin has format version 2; this plugin reads version 1");
        let mut huge = good.clone();
        huge[44..48].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(msg(&huge), "layer.bin is damaged: counts beyond the snapshot limits");
    }
}
