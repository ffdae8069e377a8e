//! Servers that record what reached them and answer with who they are.
//!
//! Every server answers a probe with one line, `"<who> <proto> dst=<addr:port> from=<ip>
//! got=<payload>"`: `dst` is the destination the connection or datagram carried as the
//! server saw it (`getsockname()` of an accepted TCP socket; `IP_RECVORIGDSTADDR` for UDP),
//! so the client learns who answered and what the server saw. A server in the DNS role
//! answers DNS queries with a real DNS answer instead.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::{dns, sock};

/// One connection or datagram that reached a server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub who: String,
    pub proto: &'static str,
    /// The destination as the server saw it: `getsockname()` (TCP), `IP_RECVORIGDSTADDR` (UDP).
    pub dst: SocketAddr,
    /// UDP only: the destination address `IP(V6)_PKTINFO` reported.
    pub pktinfo_dst: Option<IpAddr>,
    pub peer: SocketAddr,
    pub payload: Vec<u8>,
}

/// What a server says back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The one-line banner.
    Banner,
    /// DNS answers to DNS queries (length-prefixed over TCP); the banner to anything else.
    Dns,
}

/// How a UDP server sends its reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UdpReply {
    /// From the receiving socket as bound.
    FromSocket,
    /// From the receiving socket, with `IP_PKTINFO` setting the source to the address the
    /// datagram was sent to (a server bound to 0.0.0.0 answering for many addresses).
    PktInfo,
    /// From a second, transparent socket bound to the original destination (address and
    /// port), as a transparent proxy answers: the client sees the reply come from where it
    /// sent.
    TransparentFromOrigDst,
}

/// A set of sockets served by threads of their own; stopped and closed on drop.
pub struct Server {
    who: String,
    netns: Option<String>,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

const POLL: Duration = Duration::from_millis(20);
const IO_TIMEOUT: Duration = Duration::from_secs(1);

/// The payload as one line of text if it is text, else its length (binary payloads such as DNS queries
/// carry random ids, and answers must be comparable across runs).
fn shown(payload: &[u8]) -> String {
    match std::str::from_utf8(payload) {
        Ok(s) if s.chars().all(|c| !c.is_control() || c.is_whitespace()) => {
            s.split_whitespace().collect::<Vec<_>>().join(" ")
        }
        _ => format!("<{} bytes>", payload.len()),
    }
}

fn banner(who: &str, proto: &str, dst: SocketAddr, peer: SocketAddr, payload: &[u8]) -> Vec<u8> {
    format!("{who} {proto} dst={dst} from={} got={}\n", peer.ip(), shown(payload)).into_bytes()
}

impl Server {
    /// A server named `who`. With `netns`, its threads run inside that namespace, so any
    /// socket they make (the transparent UDP reply socket) is made there too.
    pub fn new(who: &str, netns: Option<&str>) -> Self {
        Server {
            who: who.to_string(),
            netns: netns.map(str::to_string),
            seen: Arc::default(),
            stop: Arc::default(),
            threads: Vec::new(),
        }
    }

    pub fn who(&self) -> &str {
        &self.who
    }

    /// Everything that reached this server so far, in order.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn spawn(&mut self, body: impl FnOnce() + Send + 'static) {
        let netns = self.netns.clone();
        self.threads.push(std::thread::spawn(move || match netns {
            Some(path) => sock::in_netns(&path, body),
            None => body(),
        }));
    }

    pub fn add_tcp(&mut self, listener: TcpListener, role: Role) {
        let (who, seen, stop) = (self.who.clone(), self.seen.clone(), self.stop.clone());
        listener.set_nonblocking(true).expect("nonblocking listener");
        self.spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let mut pfd = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid pollfd.
                if unsafe { libc::poll(&mut pfd, 1, POLL.as_millis() as i32) } <= 0 {
                    continue;
                }
                let Ok((mut stream, peer)) = listener.accept() else { continue };
                let Ok(dst) = stream.local_addr() else { continue };
                let _ = stream.set_nonblocking(false);
                let _ = stream.set_read_timeout(Some(IO_TIMEOUT));
                let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
                let mut buf = vec![0u8; 4096];
                let n = stream.read(&mut buf).unwrap_or(0);
                let payload = buf[..n].to_vec();
                let reply = match role {
                    Role::Dns if n >= 2 => dns::answer(&payload[2..]).map(|a| {
                        let mut framed = (a.len() as u16).to_be_bytes().to_vec();
                        framed.extend_from_slice(&a);
                        framed
                    }),
                    _ => None,
                }
                .unwrap_or_else(|| banner(&who, "tcp", dst, peer, &payload));
                seen.lock().unwrap().push(Seen {
                    who: who.clone(),
                    proto: "tcp",
                    dst,
                    pktinfo_dst: None,
                    peer,
                    payload,
                });
                let _ = stream.write_all(&reply);
            }
        });
    }

    pub fn add_udp(&mut self, socket: UdpSocket, role: Role, reply_mode: UdpReply) {
        let (who, seen, stop) = (self.who.clone(), self.seen.clone(), self.stop.clone());
        socket.set_read_timeout(Some(POLL)).expect("read timeout");
        let local = socket.local_addr().expect("UDP server address");
        self.spawn(move || {
            let mut buf = vec![0u8; 4096];
            while !stop.load(Ordering::SeqCst) {
                let d = match sock::recv_with_dst(&socket, &mut buf) {
                    Ok(d) => d,
                    Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => continue,
                    Err(_) => continue,
                };
                let payload = buf[..d.len].to_vec();
                let dst = d.orig_dst.unwrap_or(local);
                let reply = match role {
                    Role::Dns => dns::answer(&payload),
                    Role::Banner => None,
                }
                .unwrap_or_else(|| banner(&who, "udp", dst, d.peer, &payload));
                seen.lock().unwrap().push(Seen {
                    who: who.clone(),
                    proto: "udp",
                    dst,
                    pktinfo_dst: d.pktinfo_dst,
                    peer: d.peer,
                    payload,
                });
                let sent = match reply_mode {
                    UdpReply::FromSocket => socket.send_to(&reply, d.peer),
                    UdpReply::PktInfo => sock::send_from(&socket, &reply, dst.ip(), d.peer),
                    UdpReply::TransparentFromOrigDst => {
                        sock::transparent_udp_sender(dst).and_then(|s| s.send_to(&reply, d.peer))
                    }
                };
                if let Err(e) = sent {
                    eprintln!("{who}: UDP reply to {} from {dst} failed: {e}", d.peer);
                }
            }
        });
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
