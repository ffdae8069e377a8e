//! Clients: what a connection or a datagram from some netns got back.

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

use crate::{dns, sock};

/// The client-side timeout: short, so negative controls are quick.
pub const TIMEOUT: Duration = Duration::from_secs(1);

/// The outcome of one probe, comparable across runs (no ephemeral ports in it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// The answer's text: the banner of the server that answered (see `server`), or for DNS
    /// `"dns <name> A <address>"`.
    Answer(String),
    Refused,
    TimedOut,
    Failed(String),
}

impl Probe {
    fn from_err(e: io::Error) -> Probe {
        match e.kind() {
            io::ErrorKind::ConnectionRefused => Probe::Refused,
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Probe::TimedOut,
            _ => Probe::Failed(format!("{:?}: {e}", e.kind())),
        }
    }

    /// The answer's text, or "" for no answer.
    pub fn text(&self) -> &str {
        match self {
            Probe::Answer(s) => s,
            _ => "",
        }
    }

    /// Who answered: the first word of the banner, or None.
    pub fn who(&self) -> Option<&str> {
        match self {
            Probe::Answer(s) => s.split_whitespace().next(),
            _ => None,
        }
    }
}

impl std::fmt::Display for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Probe::Answer(s) => write!(f, "answered: {s}"),
            Probe::Refused => write!(f, "refused"),
            Probe::TimedOut => write!(f, "timed out"),
            Probe::Failed(e) => write!(f, "failed: {e}"),
        }
    }
}

/// TCP from the current netns: connect, send `payload`, half-close, read the answer.
pub fn tcp(dst: SocketAddr, mark: Option<u32>, payload: &[u8]) -> Probe {
    let run = || -> io::Result<String> {
        let mut s = sock::tcp_connect(dst, mark, TIMEOUT)?;
        s.write_all(payload)?;
        s.shutdown(std::net::Shutdown::Write)?;
        let mut out = Vec::new();
        s.read_to_end(&mut out)?;
        if out.is_empty() {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed without an answer"));
        }
        Ok(String::from_utf8_lossy(&out).trim().to_string())
    };
    run().map(Probe::Answer).unwrap_or_else(Probe::from_err)
}

/// UDP from the current netns, on a *connected* socket: the kernel only hands it a reply
/// whose source is exactly `dst`.
pub fn udp(dst: SocketAddr, mark: Option<u32>, payload: &[u8]) -> Probe {
    let run = || -> io::Result<String> {
        let s = sock::udp_connected(dst, mark, TIMEOUT)?;
        s.send(payload)?;
        let mut buf = [0u8; 2048];
        let n = s.recv(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf[..n]).trim().to_string())
    };
    run().map(Probe::Answer).unwrap_or_else(Probe::from_err)
}

static DNS_ID: AtomicU16 = AtomicU16::new(0x4ae0);

fn dns_text(id: u16, msg: &[u8]) -> String {
    dns::read_answer(id, msg).unwrap_or_else(|| format!("not a DNS answer: {}", String::from_utf8_lossy(msg).trim()))
}

/// A DNS A query over (connected) UDP from the current netns.
pub fn dns_udp(server: SocketAddr, name: &str) -> Probe {
    let id = DNS_ID.fetch_add(1, Ordering::SeqCst);
    let run = || -> io::Result<String> {
        let s = sock::udp_connected(server, None, TIMEOUT)?;
        s.send(&dns::query(id, name))?;
        let mut buf = [0u8; 2048];
        let n = s.recv(&mut buf)?;
        Ok(dns_text(id, &buf[..n]))
    };
    run().map(Probe::Answer).unwrap_or_else(Probe::from_err)
}

/// A DNS A query over TCP (length-prefixed) from the current netns.
pub fn dns_tcp(server: SocketAddr, name: &str) -> Probe {
    let id = DNS_ID.fetch_add(1, Ordering::SeqCst);
    let run = || -> io::Result<String> {
        let mut s = sock::tcp_connect(server, None, TIMEOUT)?;
        let q = dns::query(id, name);
        let mut framed = (q.len() as u16).to_be_bytes().to_vec();
        framed.extend_from_slice(&q);
        s.write_all(&framed)?;
        let mut out = Vec::new();
        s.read_to_end(&mut out)?;
        if out.is_empty() {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed without an answer"));
        }
        Ok(if out.len() >= 2 && usize::from(u16::from_be_bytes([out[0], out[1]])) == out.len() - 2 {
            dns_text(id, &out[2..])
        } else {
            dns_text(id, &out)
        })
    };
    run().map(Probe::Answer).unwrap_or_else(Probe::from_err)
}
