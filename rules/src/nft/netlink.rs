//! A blocking nfnetlink conversation over libmnl: send a batch and collect its verdict, or
//! dump objects. The socket is opened by the caller's thread, so it lives in whatever netns
//! that thread is in.

use std::io;

use nftnl::nftnl_sys as sys;
use nftnl::{FinalizedBatch, ProtoFamily};

use crate::error::{Error, Result};

const NLMSG_HDRLEN: usize = 16;
const NLMSG_ERROR: u16 = libc::NLMSG_ERROR as u16;
const NLMSG_DONE: u16 = libc::NLMSG_DONE as u16;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
/// How often an interrupted dump is read again before giving up.
const DUMP_ATTEMPTS: usize = 5;
/// What one queued ACK costs the receive buffer (the skb's truesize, generously).
const ACK_TRUESIZE: usize = 1024;
/// Below this, the kernel's default socket buffers already suffice.
const DEFAULT_SOCKET_BUFFER: usize = 208 * 1024;

pub(crate) struct NftSocket {
    sock: mnl::Socket,
    buf: Vec<u8>,
    /// Sequence numbers for requests outside batches; batches number from 1.
    next_seq: u32,
}

/// One netlink message: its header fields and the whole message bytes.
pub(crate) struct Msg<'a> {
    pub kind: u16,
    pub flags: u16,
    pub seq: u32,
    pub bytes: &'a [u8],
}

impl Msg<'_> {
    /// The errno of an NLMSG_ERROR (0 for an ACK).
    fn error_code(&self) -> i32 {
        let b = &self.bytes[NLMSG_HDRLEN..NLMSG_HDRLEN + 4];
        -i32::from_ne_bytes([b[0], b[1], b[2], b[3]])
    }

    pub fn header(&self) -> *const libc::nlmsghdr {
        self.bytes.as_ptr().cast()
    }
}

/// Splits a buffer of back-to-back netlink messages.
pub(crate) fn split_messages(mut buf: &[u8]) -> Vec<Msg<'_>> {
    let mut out = Vec::new();
    while buf.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes(buf[0..4].try_into().unwrap()) as usize;
        if len < NLMSG_HDRLEN || len > buf.len() {
            break;
        }
        let kind = u16::from_ne_bytes(buf[4..6].try_into().unwrap());
        let flags = u16::from_ne_bytes(buf[6..8].try_into().unwrap());
        let seq = u32::from_ne_bytes(buf[8..12].try_into().unwrap());
        out.push(Msg { kind, flags, seq, bytes: &buf[..len] });
        let aligned = (len + 3) & !3;
        buf = &buf[aligned.min(buf.len())..];
    }
    out
}

/// Netlink type of an nf_tables message (subsystem in the high byte).
pub(crate) fn nft_type(msg: i32) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | msg as u16
}

impl NftSocket {
    pub fn open() -> Result<Self> {
        let sock =
            mnl::Socket::new(mnl::Bus::Netfilter).map_err(|source| Error::Nftables { op: "open socket", source })?;
        Ok(NftSocket { sock, buf: vec![0; nftnl::nft_nlmsg_maxsize() as usize], next_seq: 0x1000_0000 })
    }

    /// Sends a batch and waits for the kernel's verdict on it. `labels[i]` names the i-th
    /// message (after the batch-begin), so an error says which object the kernel refused.
    pub fn transact(&mut self, batch: &FinalizedBatch, labels: &[String]) -> Result<()> {
        let seqs = batch.sequence_numbers();
        // nftnl numbers the begin/end markers only on kernels that acknowledge them.
        let first_data_seq = if seqs.len() == labels.len() + 2 { seqs.start + 1 } else { seqs.start };
        // The kernel reads a batch from one message only: a batch that spans several pages
        // goes in one send, with a send buffer large enough for it (as nft does).
        let pages: Vec<&[u8]> = batch.iter().collect();
        if pages.len() == 1 {
            self.sock.send_all(pages).map_err(|source| Error::Nftables { op: "send transaction", source })?;
        } else {
            let whole: Vec<u8> = pages.concat();
            self.grow_buffer(libc::SO_SNDBUFFORCE, whole.len() + 4096)?;
            let sent = self.sock.send(&whole).map_err(|source| Error::Nftables { op: "send transaction", source })?;
            if sent < whole.len() {
                return Err(Error::Nftables { op: "send transaction", source: io::Error::other("short send") });
            }
        }
        // Our own messages ask for no ACK (errors are reported anyway); nftnl's tables,
        // chains and rules do, one ACK each. Room for all of them, so a large batch's answers
        // never overflow the socket (ENOBUFS after the kernel has committed).
        self.grow_buffer(libc::SO_RCVBUFFORCE, labels.len() * ACK_TRUESIZE)?;
        // A request after the batch: its answer arrives after every answer to the batch, so
        // it marks the end of the verdict whatever the kernel acknowledges.
        let fence = self.send_request(libc::NFT_MSG_GETGEN, ProtoFamily::Unspec, 0, |_| {})?;
        let mut first_error: Option<(u32, i32)> = None;
        loop {
            let n = self.recv("read transaction verdict")?;
            for msg in split_messages(&self.buf[..n]) {
                if msg.kind == NLMSG_ERROR && msg.error_code() != 0 && msg.seq != fence {
                    first_error.get_or_insert((msg.seq, msg.error_code()));
                }
                if msg.seq == fence && msg.kind != NLMSG_ERROR {
                    return match first_error {
                        None => Ok(()),
                        Some((seq, code)) => {
                            let what = seq
                                .checked_sub(first_data_seq)
                                .and_then(|i| labels.get(i as usize))
                                .map(String::as_str)
                                .unwrap_or("the transaction");
                            Err(Error::Transaction {
                                object: what.to_string(),
                                source: io::Error::from_raw_os_error(code),
                            })
                        }
                    };
                }
                if msg.seq == fence {
                    return Err(Error::Nftables {
                        op: "generation fence",
                        source: io::Error::from_raw_os_error(msg.error_code()),
                    });
                }
            }
        }
    }

    /// Raises a socket buffer to at least `len` bytes (the *FORCE options: root may exceed
    /// the system maximum, as nft does for large batches).
    fn grow_buffer(&mut self, option: libc::c_int, len: usize) -> Result<()> {
        use std::os::fd::AsRawFd;
        if len <= DEFAULT_SOCKET_BUFFER {
            return Ok(());
        }
        let size = len.min(i32::MAX as usize) as libc::c_int;
        let r = unsafe {
            libc::setsockopt(
                self.sock.as_raw_fd(),
                libc::SOL_SOCKET,
                option,
                (&size as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(Error::Nftables { op: "size a socket buffer", source: io::Error::last_os_error() });
        }
        Ok(())
    }

    /// Sends a dump request and returns every message of the answer, raw.
    pub fn dump(&mut self, msg: i32, op: &'static str, payload: impl Fn(*mut libc::nlmsghdr)) -> Result<Vec<Vec<u8>>> {
        // A dump that raced with a change of the ruleset comes back flagged as interrupted
        // (possibly inconsistent): read it again.
        for _ in 0..DUMP_ATTEMPTS {
            let (out, interrupted) = self.dump_once(msg, op, &payload)?;
            if !interrupted {
                return Ok(out);
            }
        }
        Err(Error::Nftables { op, source: io::Error::other("the dump kept being interrupted by concurrent changes") })
    }

    fn dump_once(
        &mut self,
        msg: i32,
        op: &'static str,
        payload: &impl Fn(*mut libc::nlmsghdr),
    ) -> Result<(Vec<Vec<u8>>, bool)> {
        let seq = self.send_request(msg, ProtoFamily::Ipv4, libc::NLM_F_DUMP as u16, payload)?;
        let mut out = Vec::new();
        let mut interrupted = false;
        loop {
            let n = self.recv(op)?;
            for m in split_messages(&self.buf[..n]) {
                if m.seq != seq {
                    continue;
                }
                interrupted |= m.flags & libc::NLM_F_DUMP_INTR as u16 != 0;
                match m.kind {
                    NLMSG_DONE => return Ok((out, interrupted)),
                    NLMSG_ERROR if m.error_code() != 0 => {
                        return Err(Error::Nftables { op, source: io::Error::from_raw_os_error(m.error_code()) })
                    }
                    NLMSG_ERROR => {}
                    _ => out.push(m.bytes.to_vec()),
                }
            }
        }
    }

    fn send_request(
        &mut self,
        msg: i32,
        family: ProtoFamily,
        flags: u16,
        payload: impl FnOnce(*mut libc::nlmsghdr),
    ) -> Result<u32> {
        self.next_seq += 1;
        let seq = self.next_seq;
        let mut req = vec![0u8; 4096];
        let len = unsafe {
            let hdr = sys::nftnl_nlmsg_build_hdr(req.as_mut_ptr().cast(), msg as u16, family as u16, flags, seq);
            payload(hdr);
            (*hdr).nlmsg_len as usize
        };
        self.sock.send(&req[..len]).map_err(|source| Error::Nftables { op: "send request", source })?;
        Ok(seq)
    }

    fn recv(&mut self, op: &'static str) -> Result<usize> {
        self.sock.recv(&mut self.buf).map_err(|source| Error::Nftables { op, source })
    }
}
