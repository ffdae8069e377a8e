//! ADD's cache of the transaction that creates the stored layer in a pod: `encoded-<mark>`
//! beside `layer.bin`, one per divert mark. A pod start at 10,000 Services spent a sixth of
//! its CPU reading `layer.bin`, building the layer's tables and encoding them, the same for
//! every pod of a layer; the first ADD of a layer writes the bytes it sent, and each later
//! one sends them as they are. A cache in front of the one engine, never a second one: the
//! bytes are the engine's own (`Prepared`), trusted only for the very `layer.bin` (its
//! identity: device, inode, size, times, and its journal's) and the very binary (`/proc/self/exe`'s) that wrote
//! them, checksummed, and anything the kernel refuses falls back to building the layer,
//! which names what it refused. CHECK and `verify` compare the kernel with the model as ever.

use std::path::{Path, PathBuf};

use super::layer_file::{seal, unseal};
use super::{FileId, ServicesDir};

const MAGIC: &[u8; 8] = b"AETHENC1";

/// What the cached bytes are valid for: the stored layer file, the binary, the divert mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Key {
    layer: FileId,
    /// The journal over `layer.bin`, if any: the stored layer is both.
    journal: Option<FileId>,
    binary: FileId,
    mark: u32,
}

impl Key {
    /// The key now (under the services lock, so `layer.bin` cannot change meanwhile); `None`
    /// without `layer.bin` or when the binary cannot be looked at.
    pub(super) fn now(dir: &ServicesDir, mark: u32) -> Option<Key> {
        Some(Key {
            layer: FileId::of(&dir.layer_path())?,
            journal: FileId::of(&dir.journal_path()),
            binary: FileId::of_target(Path::new("/proc/self/exe"))?,
            mark,
        })
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(3 * 56 + 4);
        b.extend_from_slice(&self.layer.bytes());
        b.extend_from_slice(&self.journal.map_or([0; 56], |j| j.bytes()));
        b.extend_from_slice(&self.binary.bytes());
        b.extend_from_slice(&self.mark.to_le_bytes());
        b
    }
}

/// A cached transaction, and the stored layer it creates (what the pod's file names).
pub(super) struct Cached<'a> {
    pub generation: u64,
    pub digest: u64,
    pub seq_count: u32,
    pub bytes: std::borrow::Cow<'a, [u8]>,
}

fn path(dir: &ServicesDir, mark: u32) -> PathBuf {
    dir.root.join(format!("encoded-{mark:08x}"))
}

/// The file's layout: magic, key, generation, digest, sequence numbers, length, the bytes,
/// and a checksum of all before it.
fn encode(key: &Key, c: &Cached) -> Vec<u8> {
    let mut out = Vec::with_capacity(c.bytes.len() + 160);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&key.bytes());
    out.extend_from_slice(&c.generation.to_le_bytes());
    out.extend_from_slice(&c.digest.to_le_bytes());
    out.extend_from_slice(&c.seq_count.to_le_bytes());
    out.extend_from_slice(&(c.bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(&c.bytes);
    seal(&mut out, 0);
    out
}

/// The file `b` as the transaction for `key` (its bytes moved to the front of `b`'s buffer,
/// not copied: a layer's transaction is most of a megabyte).
fn decode(key: &Key, mut b: Vec<u8>) -> Option<Cached<'static>> {
    let body = unseal(&b)?;
    let rest = body.strip_prefix(MAGIC)?.strip_prefix(&key.bytes()[..])?;
    let u64_at = |at: usize| Some(u64::from_le_bytes(rest.get(at..at + 8)?.try_into().ok()?));
    let (generation, digest) = (u64_at(0)?, u64_at(8)?);
    let seq_count = u32::from_le_bytes(rest.get(16..20)?.try_into().ok()?);
    let len = usize::try_from(u64::from_le_bytes(rest.get(20..28)?.try_into().ok()?)).ok()?;
    if rest.len() != 28 + len {
        return None;
    }
    let header = b.len() - 8 - len;
    b.truncate(b.len() - 8);
    b.drain(..header);
    Some(Cached { generation, digest, seq_count, bytes: std::borrow::Cow::Owned(b) })
}

/// The cached transaction for `key`, when the file is there, whole, and made for it.
pub(super) fn read(dir: &ServicesDir, key: &Key) -> Option<Cached<'static>> {
    decode(key, std::fs::read(path(dir, key.mark)).ok()?)
}

/// Keeps `c` for `key` (atomic: ADDs of the same mark may write at once, under the shared
/// lock; each writes the same bytes). A cache: a failure only costs the next ADD the build.
pub(super) fn write(dir: &ServicesDir, key: &Key, c: &Cached) {
    if let Err(e) = dir.write_atomic(&format!("encoded-{:08x}", key.mark), &encode(key, c)) {
        tracing::debug!("the layer's transaction is not kept for the next pod: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u64) -> FileId {
        FileId { dev: n, ino: n + 1, size: n + 2, mtime_ns: i128::from(n + 3), ctime_ns: i128::from(n + 4) }
    }

    fn key() -> Key {
        Key { layer: id(1), journal: None, binary: id(8), mark: 0xae71 }
    }

    fn cached() -> Cached<'static> {
        Cached { generation: 7, digest: 0xdead_beef, seq_count: 12, bytes: (0..=255).collect::<Vec<u8>>().into() }
    }

    #[test]
    fn a_file_reads_back_for_its_key_only() {
        let (k, c) = (key(), cached());
        let b = encode(&k, &c);
        let back = decode(&k, b.clone()).expect("reads back");
        assert_eq!((back.generation, back.digest, back.seq_count, &back.bytes), (7, 0xdead_beef, 12, &c.bytes));
        // Another layer file, another binary, another mark: not this file's.
        for other in [
            Key { layer: FileId { ctime_ns: 99, ..id(1) }, ..k },
            Key { binary: FileId { dev: 0, ..id(8) }, ..k },
            Key { mark: 0x1, ..k },
        ] {
            assert!(decode(&other, b.clone()).is_none(), "{other:?}");
        }
        // Any byte changed, or the file cut short: no file.
        for i in 0..b.len() {
            let mut bad = b.clone();
            bad[i] ^= 0x10;
            assert!(decode(&k, bad).is_none(), "byte {i}");
        }
        assert!(decode(&k, b[..b.len() - 1].to_vec()).is_none());
        assert!(decode(&k, Vec::new()).is_none());
    }
}
