//! The one netlink conversation layer, for both families we speak (nftables over
//! NETLINK_NETFILTER, policy routing over NETLINK_ROUTE): a blocking socket opened by the
//! caller's thread (so it lives in whatever netns that thread is in) that sends requests,
//! waits for acknowledgements, runs dumps (read again when the kernel flags them as
//! interrupted) and collects the verdict of an nftables batch.

use std::io;
use std::os::fd::AsRawFd;

use netlink_packet_core::{
    NetlinkBuffer, NetlinkDeserializable, NetlinkHeader, NetlinkMessage, NetlinkPayload, NetlinkSerializable,
    NLMSG_DONE, NLMSG_ERROR, NLM_F_ACK, NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST,
};
pub(crate) use netlink_sys::protocols::{NETLINK_NETFILTER, NETLINK_ROUTE};

/// How often an interrupted dump is read again before giving up.
const DUMP_ATTEMPTS: usize = 5;
/// Room for one datagram: dumps come in skbs of at most 32 KiB (the kernel's cap on its
/// dump allocations), error replies carry no copy of the request (`NETLINK_CAP_ACK`).
const RECV_BUF: usize = 64 * 1024;
/// Below this, the kernel's default socket buffers already suffice.
const DEFAULT_SOCKET_BUFFER: usize = 208 * 1024;

pub(crate) struct Socket {
    sock: netlink_sys::Socket,
    buf: Vec<u8>,
    next_seq: u32,
}

/// What a batch's fence brought: the errors, as (sequence number, errno), and the fence's own
/// answer (its whole message).
pub type BatchAnswers = (Vec<(u32, i32)>, Vec<u8>);

/// One message as received: header fields and the whole message's bytes.
pub(crate) struct Received<'a> {
    pub kind: u16,
    pub flags: u16,
    pub seq: u32,
    pub bytes: &'a [u8],
}

impl Received<'_> {
    /// The errno of an NLMSG_ERROR or NLMSG_DONE (0 for an ACK or a clean end).
    fn code(&self) -> i32 {
        match self.bytes.get(16..20) {
            Some(b) => -i32::from_ne_bytes([b[0], b[1], b[2], b[3]]),
            None => 0,
        }
    }
}

/// Splits a datagram into its netlink messages.
pub(crate) fn split(mut buf: &[u8]) -> io::Result<Vec<Received<'_>>> {
    let mut out = Vec::new();
    while !buf.is_empty() {
        let hdr = NetlinkBuffer::new_checked(buf).map_err(invalid)?;
        let len = hdr.length() as usize;
        out.push(Received {
            kind: hdr.message_type(),
            flags: hdr.flags(),
            seq: hdr.sequence_number(),
            bytes: &buf[..len],
        });
        buf = buf.get(len.div_ceil(4) * 4..).unwrap_or(&[]);
    }
    Ok(out)
}

fn invalid(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

/// Serializes `payload` as one request message.
pub(crate) fn encode<T: NetlinkSerializable>(payload: T, flags: u16, seq: u32) -> Vec<u8> {
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | flags;
    header.sequence_number = seq;
    let mut msg = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(payload));
    // finalize() has measured the message into the header already: a second buffer_len()
    // walks every nested attribute again (a tenth of a capture ADD's user-space instructions).
    msg.finalize();
    let mut out = vec![0; msg.header.length as usize];
    msg.serialize(&mut out);
    out
}

/// Adds `first` to the sequence number of every message in `buf` (messages encoded from 0):
/// a batch encoded once is sent on many sockets, each numbering its own requests.
pub(crate) fn renumber(buf: &mut [u8], first: u32) {
    let mut at = 0;
    while let Some(header) = buf.get_mut(at..at + 16) {
        let len = u32::from_ne_bytes(header[0..4].try_into().expect("4 bytes")) as usize;
        let seq = u32::from_ne_bytes(header[8..12].try_into().expect("4 bytes"));
        header[8..12].copy_from_slice(&seq.wrapping_add(first).to_ne_bytes());
        if len < 16 {
            return;
        }
        at += len.div_ceil(4) * 4;
    }
}

impl Socket {
    pub fn open(protocol: isize) -> io::Result<Self> {
        let mut sock = netlink_sys::Socket::new(protocol)?;
        sock.bind_auto()?;
        sock.connect(&netlink_sys::SocketAddr::new(0, 0))?;
        // Errors need only the failed message's header (its sequence number), not a copy of it.
        sock.set_cap_ack(true)?;
        Ok(Socket { sock, buf: Vec::with_capacity(RECV_BUF), next_seq: 0 })
    }

    /// The bare socket, its receive buffer freed: for closing later (`nft::CloseLater`),
    /// when nothing more is read from it.
    pub fn into_bare(self) -> netlink_sys::Socket {
        self.sock
    }

    /// A fresh sequence number (a run of `n` of them, for a batch): the first one.
    pub fn take_seqs(&mut self, n: u32) -> u32 {
        let first = self.next_seq + 1;
        self.next_seq += n;
        first
    }

    /// Sends bytes holding one or more messages in one datagram: the kernel reads an
    /// nftables batch from one datagram only.
    pub fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.grow_buffer(libc::SO_SNDBUFFORCE, bytes.len() + 4096)?;
        let sent = self.sock.send(bytes, 0)?;
        if sent < bytes.len() {
            return Err(io::Error::other(format!("short send: {sent} of {} bytes", bytes.len())));
        }
        Ok(())
    }

    /// Raises a socket buffer to at least `len` bytes (the *FORCE options: root may exceed
    /// the system maximum, as nft does for large batches).
    pub fn grow_buffer(&mut self, option: libc::c_int, len: usize) -> io::Result<()> {
        if len <= DEFAULT_SOCKET_BUFFER {
            return Ok(());
        }
        let size = len.min(i32::MAX as usize) as libc::c_int;
        // SAFETY: setsockopt on our own fd with a pointer to a live c_int of the right size.
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
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Sends one request; returns its sequence number.
    pub fn request<T: NetlinkSerializable>(&mut self, payload: T, flags: u16) -> io::Result<u32> {
        let seq = self.take_seqs(1);
        let bytes = encode(payload, flags, seq);
        self.sock.send(&bytes, 0)?;
        Ok(seq)
    }

    /// Reads one datagram; `each` sees every message in it and says whether it was the last
    /// one wanted.
    fn receive(&mut self, mut each: impl FnMut(&Received) -> io::Result<bool>) -> io::Result<()> {
        loop {
            self.buf.clear();
            // MSG_TRUNC makes recv report the datagram's real size, so truncation is detectable.
            let n = self.sock.recv(&mut self.buf, libc::MSG_TRUNC)?;
            if n > self.buf.capacity() {
                return Err(invalid(format!("netlink reply of {n} bytes truncated")));
            }
            for m in split(&self.buf[..n])? {
                if each(&m)? {
                    return Ok(());
                }
            }
        }
    }

    /// The answers to a guarded batch (`Batch::encode_guarded`) whose begin marker is
    /// `first` and whose last message, `last`, asks for an ACK: the errors, as (sequence
    /// number, errno), read until that ACK (sent after the commit, or after the errors of a
    /// refused batch), or until the begin marker itself is refused (a stale generation: no
    /// message of the batch was read).
    pub fn batch_errors_until_ack(&mut self, first: u32, last: u32) -> io::Result<Vec<(u32, i32)>> {
        let mut errors = Vec::new();
        self.receive(|m| {
            if m.kind != NLMSG_ERROR {
                return Ok(false);
            }
            if m.code() != 0 {
                errors.push((m.seq, m.code()));
            }
            Ok(m.seq == last || (m.seq == first && m.code() != 0))
        })?;
        Ok(errors)
    }

    /// Sends a request asking for an acknowledgement and waits for it; the kernel's refusal
    /// becomes the matching `io::Error`.
    pub fn transact<T: NetlinkSerializable>(&mut self, payload: T, flags: u16) -> io::Result<()> {
        let seq = self.request(payload, flags | NLM_F_ACK)?;
        self.receive(|m| {
            if m.seq != seq || m.kind != NLMSG_ERROR {
                return Ok(false);
            }
            match m.code() {
                0 => Ok(true),
                code => Err(io::Error::from_raw_os_error(code)),
            }
        })
    }

    /// Sends a request that the kernel answers with one message (a GET that is no dump) and
    /// returns that message, raw; the kernel's refusal becomes the matching `io::Error`.
    pub fn ask_raw<T: NetlinkSerializable>(&mut self, request: T) -> io::Result<Vec<u8>> {
        let seq = self.request(request, 0)?;
        let mut answer = None;
        self.receive(|m| {
            if m.seq != seq {
                return Ok(false);
            }
            match m.kind {
                NLMSG_ERROR | NLMSG_DONE if m.code() != 0 => Err(io::Error::from_raw_os_error(m.code())),
                NLMSG_ERROR | NLMSG_DONE => Ok(false),
                _ => {
                    answer = Some(m.bytes.to_vec());
                    Ok(true)
                }
            }
        })?;
        answer.ok_or_else(|| invalid("no answer"))
    }

    /// Runs a dump and returns every message of the answer, raw; a dump that raced with a
    /// change (flagged `NLM_F_DUMP_INTR`, possibly inconsistent) is read again.
    pub fn dump_raw<T: NetlinkSerializable + Clone>(&mut self, request: T) -> io::Result<Vec<Vec<u8>>> {
        for _ in 0..DUMP_ATTEMPTS {
            let seq = self.request(request.clone(), NLM_F_DUMP)?;
            let (mut out, mut interrupted) = (Vec::new(), false);
            self.receive(|m| {
                if m.seq != seq {
                    return Ok(false);
                }
                interrupted |= m.flags & NLM_F_DUMP_INTR != 0;
                match m.kind {
                    NLMSG_DONE | NLMSG_ERROR if m.code() != 0 => Err(io::Error::from_raw_os_error(m.code())),
                    NLMSG_DONE => Ok(true),
                    NLMSG_ERROR => Ok(false),
                    _ => {
                        out.push(m.bytes.to_vec());
                        Ok(false)
                    }
                }
            })?;
            if !interrupted {
                return Ok(out);
            }
        }
        Err(io::Error::other("the dump kept being interrupted by concurrent changes"))
    }

    /// `dump_raw`, each message parsed; one this crate cannot parse (an attribute newer than
    /// it) only costs that one entry.
    pub fn dump<T>(&mut self, request: T) -> io::Result<Vec<T>>
    where
        T: NetlinkSerializable + NetlinkDeserializable + Clone,
    {
        let raw = self.dump_raw(request)?;
        Ok(raw
            .iter()
            .filter_map(|b| match NetlinkMessage::<T>::deserialize(b).ok()?.payload {
                NetlinkPayload::InnerMessage(m) => Some(m),
                _ => None,
            })
            .collect())
    }

    /// After a batch was sent without per-message ACKs and a `fence` request after it: every
    /// error the kernel reported for the batch, as (sequence number, errno), in order, once
    /// the fence's answer (which comes after every answer to the batch) has arrived. The
    /// kernel goes on through a batch after an error, so each refused message is answered.
    /// And the fence's answer itself (its whole message: a GETGEN fence's says the ruleset
    /// generation the batch left).
    pub fn batch_errors_and_fence(&mut self, fence: u32) -> io::Result<BatchAnswers> {
        let mut errors = Vec::new();
        let mut answer = Vec::new();
        self.receive(|m| {
            if m.seq == fence {
                return match m.kind {
                    NLMSG_ERROR if m.code() != 0 => Err(io::Error::from_raw_os_error(m.code())),
                    NLMSG_ERROR => Ok(false),
                    _ => {
                        answer = m.bytes.to_vec();
                        Ok(true)
                    }
                };
            }
            if m.kind == NLMSG_ERROR && m.code() != 0 {
                errors.push((m.seq, m.code()));
            }
            Ok(false)
        })?;
        Ok((errors, answer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_netfilter::nftables::{GenMessage, NfTablesMessage};
    use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterProtoFamily};

    /// Messages encoded from 0 and renumbered read back with their new numbers, one after
    /// another, and nothing else changed.
    #[test]
    fn renumber_shifts_every_message_s_sequence_number_and_nothing_else() {
        let gen = || {
            NetfilterMessage::new(
                NetfilterHeader::new(NetfilterProtoFamily::Unspec, 0, 0),
                NfTablesMessage::GetGen(GenMessage { attributes: vec![] }),
            )
        };
        let mut at_zero = encode(gen(), 0, 0);
        at_zero.extend(encode(gen(), 0, 1));
        at_zero.extend(encode(gen(), 0, 2));
        let mut want = encode(gen(), 0, 40);
        want.extend(encode(gen(), 0, 41));
        want.extend(encode(gen(), 0, 42));
        let mut got = at_zero.clone();
        renumber(&mut got, 40);
        assert_eq!(got, want);
        let seqs: Vec<u32> = split(&got).unwrap().iter().map(|m| m.seq).collect();
        assert_eq!(seqs, [40, 41, 42]);
    }
}
