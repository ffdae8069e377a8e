//! Entering a netns on a thread of our own, and the socket options the rig needs, for
//! both families: `IP_TRANSPARENT`/`IPV6_TRANSPARENT`, `IP_PKTINFO`/`IPV6_RECVPKTINFO`,
//! `IP_RECVORIGDSTADDR`/`IPV6_RECVORIGDSTADDR`, `SO_MARK`. IPv6 sockets are `IPV6_V6ONLY`,
//! so `[::]:80` and `0.0.0.0:80` are two sockets, as on a dual-stack node.
//!
//! A socket stays in the network namespace it was created in, whichever thread uses it
//! later: that is how the proxy stand-in, living in the host netns, owns listeners inside
//! the pod netns.

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use nix::errno::Errno;
use nix::sched::{setns, CloneFlags};
use nix::sys::socket::{
    bind, connect, listen, recvmsg, sendmsg, setsockopt, socket, sockopt, AddressFamily, Backlog, ControlMessage,
    ControlMessageOwned, MsgFlags, SockFlag, SockType, SockaddrLike, SockaddrStorage,
};

/// Runs `f` on a fresh thread that has entered the network namespace at `path`; the thread
/// ends with `f`, so no other code ever runs in the wrong namespace.
pub fn in_netns<T: Send>(path: &str, f: impl FnOnce() -> T + Send) -> T {
    let file = File::open(path).unwrap_or_else(|e| panic!("open netns {path}: {e}"));
    std::thread::scope(|s| {
        s.spawn(move || {
            setns(&file, CloneFlags::CLONE_NEWNET).unwrap_or_else(|e| panic!("setns {path}: {e}"));
            f()
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// A socket of `addr`'s family; IPv6 ones only ever speak IPv6.
fn socket_for(addr: &SocketAddr, ty: SockType) -> io::Result<OwnedFd> {
    let family = if addr.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    let fd = socket(family, ty, SockFlag::SOCK_CLOEXEC, None)?;
    if addr.is_ipv6() {
        setsockopt(&fd, sockopt::Ipv6V6Only, &true)?;
    }
    Ok(fd)
}

/// An integer socket option nix does not name (`IPV6_TRANSPARENT`).
fn set_int(fd: &OwnedFd, level: libc::c_int, name: libc::c_int, value: libc::c_int) -> io::Result<()> {
    // SAFETY: a valid fd and a c_int the size we pass.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `IP_TRANSPARENT` or `IPV6_TRANSPARENT`: the socket may be a tproxy target and bind an
/// address that is not local.
fn set_transparent(fd: &OwnedFd, addr: &SocketAddr) -> io::Result<()> {
    match addr {
        SocketAddr::V4(_) => Ok(setsockopt(fd, sockopt::IpTransparent, &true)?),
        SocketAddr::V6(_) => set_int(fd, libc::IPPROTO_IPV6, libc::IPV6_TRANSPARENT, 1),
    }
}

fn bind_to(fd: &OwnedFd, addr: SocketAddr) -> io::Result<()> {
    Ok(bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))?)
}

/// A TCP listener; `transparent` sets `IP(V6)_TRANSPARENT` before bind, as a tproxy target
/// needs.
pub fn tcp_listener(addr: impl Into<SocketAddr>, transparent: bool) -> io::Result<TcpListener> {
    let addr = addr.into();
    let fd = socket_for(&addr, SockType::Stream)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    if transparent {
        set_transparent(&fd, &addr)?;
    }
    bind_to(&fd, addr)?;
    listen(&fd, Backlog::new(64).expect("backlog"))?;
    Ok(TcpListener::from(fd))
}

/// A UDP server socket that reports each datagram's destination (`IP_PKTINFO` /
/// `IPV6_RECVPKTINFO` for the address, `IP(V6)_RECVORIGDSTADDR` for address and port);
/// `transparent` as for TCP.
pub fn udp_server(addr: impl Into<SocketAddr>, transparent: bool) -> io::Result<UdpSocket> {
    let addr = addr.into();
    let fd = socket_for(&addr, SockType::Datagram)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    if transparent {
        set_transparent(&fd, &addr)?;
    }
    if addr.is_ipv4() {
        setsockopt(&fd, sockopt::Ipv4PacketInfo, &true)?;
        setsockopt(&fd, sockopt::Ipv4OrigDstAddr, &true)?;
    } else {
        setsockopt(&fd, sockopt::Ipv6RecvPacketInfo, &true)?;
        setsockopt(&fd, sockopt::Ipv6OrigDstAddr, &true)?;
        // IPv6 refuses an IPV6_PKTINFO source that is not an interface address, and the
        // addresses a `local` route makes ours are not: freebind lets the server answer
        // from them, as IPv4's IP_PKTINFO does without it.
        set_int(&fd, libc::IPPROTO_IPV6, libc::IPV6_FREEBIND, 1)?;
    }
    bind_to(&fd, addr)?;
    Ok(UdpSocket::from(fd))
}

/// A UDP socket bound (transparently: the address need not be local) to `src`, for sending a
/// reply that carries the original destination as its source, as a transparent proxy does.
pub fn transparent_udp_sender(src: SocketAddr) -> io::Result<UdpSocket> {
    let fd = socket_for(&src, SockType::Datagram)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    set_transparent(&fd, &src)?;
    bind_to(&fd, src)?;
    Ok(UdpSocket::from(fd))
}

fn v4(sa: &libc::sockaddr_in) -> SocketAddr {
    SocketAddrV4::new(Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)), u16::from_be(sa.sin_port)).into()
}

fn v6(sa: &libc::sockaddr_in6) -> SocketAddr {
    SocketAddrV6::new(Ipv6Addr::from(sa.sin6_addr.s6_addr), u16::from_be(sa.sin6_port), 0, 0).into()
}

/// One datagram as the server saw it.
#[derive(Debug, Clone)]
pub struct Datagram {
    pub len: usize,
    pub peer: SocketAddr,
    /// The packet's destination address, from `IP_PKTINFO` (`ipi_addr`) or `IPV6_PKTINFO`.
    pub pktinfo_dst: Option<IpAddr>,
    /// The packet's destination address and port, from `IP(V6)_RECVORIGDSTADDR`.
    pub orig_dst: Option<SocketAddr>,
}

/// `recvmsg` with the destination control messages. Honours the socket's read timeout.
pub fn recv_with_dst(sock: &UdpSocket, buf: &mut [u8]) -> io::Result<Datagram> {
    let mut iov = [IoSliceMut::new(buf)];
    let mut cmsg = nix::cmsg_space!(libc::in6_pktinfo, libc::sockaddr_in6);
    let msg = recvmsg::<SockaddrStorage>(sock.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::empty())?;
    let peer = msg
        .address
        .and_then(|a| match a.family() {
            Some(AddressFamily::Inet) => a.as_sockaddr_in().map(|s| SocketAddr::from(SocketAddrV4::from(*s))),
            Some(AddressFamily::Inet6) => a.as_sockaddr_in6().map(|s| SocketAddr::from(SocketAddrV6::from(*s))),
            _ => None,
        })
        .ok_or_else(|| io::Error::other("datagram without a source"))?;
    let mut d = Datagram { len: msg.bytes, peer, pktinfo_dst: None, orig_dst: None };
    for c in msg.cmsgs()? {
        match c {
            ControlMessageOwned::Ipv4PacketInfo(pi) => {
                d.pktinfo_dst = Some(Ipv4Addr::from(u32::from_be(pi.ipi_addr.s_addr)).into())
            }
            ControlMessageOwned::Ipv6PacketInfo(pi) => {
                d.pktinfo_dst = Some(Ipv6Addr::from(pi.ipi6_addr.s6_addr).into())
            }
            ControlMessageOwned::Ipv4OrigDstAddr(sa) => d.orig_dst = Some(v4(&sa)),
            ControlMessageOwned::Ipv6OrigDstAddr(sa) => d.orig_dst = Some(v6(&sa)),
            _ => {}
        }
    }
    Ok(d)
}

/// `sendmsg` to `peer` with `IP(V6)_PKTINFO` choosing the source address `src` (which must
/// be local, or the socket transparent): how a server bound to the wildcard answers from
/// the address it was asked on.
pub fn send_from(sock: &UdpSocket, data: &[u8], src: IpAddr, peer: SocketAddr) -> io::Result<usize> {
    let iov = [IoSlice::new(data)];
    let to = SockaddrStorage::from(peer);
    let sent = match src {
        IpAddr::V4(src) => {
            let pi = libc::in_pktinfo {
                ipi_ifindex: 0,
                ipi_spec_dst: libc::in_addr { s_addr: u32::from(src).to_be() },
                ipi_addr: libc::in_addr { s_addr: 0 },
            };
            sendmsg(sock.as_raw_fd(), &iov, &[ControlMessage::Ipv4PacketInfo(&pi)], MsgFlags::empty(), Some(&to))
        }
        IpAddr::V6(src) => {
            let pi = libc::in6_pktinfo { ipi6_addr: libc::in6_addr { s6_addr: src.octets() }, ipi6_ifindex: 0 };
            sendmsg(sock.as_raw_fd(), &iov, &[ControlMessage::Ipv6PacketInfo(&pi)], MsgFlags::empty(), Some(&to))
        }
    };
    Ok(sent?)
}

/// A TCP connection to `dst`, optionally with `SO_MARK`, giving up after `timeout` (the
/// connect timeout is the socket's send timeout, which blocking `connect` honours).
pub fn tcp_connect(dst: SocketAddr, mark: Option<u32>, timeout: Duration) -> io::Result<TcpStream> {
    let fd = socket_for(&dst, SockType::Stream)?;
    if let Some(m) = mark {
        setsockopt(&fd, sockopt::Mark, &m)?;
    }
    let stream = TcpStream::from(fd);
    stream.set_write_timeout(Some(timeout))?;
    stream.set_read_timeout(Some(timeout))?;
    match connect(stream.as_raw_fd(), &SockaddrStorage::from(dst)) {
        Ok(()) => Ok(stream),
        Err(Errno::EINPROGRESS) | Err(Errno::EAGAIN) => {
            Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))
        }
        Err(e) => Err(e.into()),
    }
}

/// A UDP client socket, connected to `dst`, optionally with `SO_MARK`.
pub fn udp_connected(dst: SocketAddr, mark: Option<u32>, timeout: Duration) -> io::Result<UdpSocket> {
    let fd = socket_for(&dst, SockType::Datagram)?;
    if let Some(m) = mark {
        setsockopt(&fd, sockopt::Mark, &m)?;
    }
    let sock = UdpSocket::from(fd);
    sock.set_read_timeout(Some(timeout))?;
    sock.connect(dst)?;
    Ok(sock)
}

/// A TCP connection opened from inside the netns at `netns` to `listener` (in another netns):
/// (the inside end, the listener's end), each reading with a 3 s timeout. How the tests hold
/// a connection open across a change to the inside netns' rules.
pub fn connection_from(netns: &str, listener: &TcpListener) -> (TcpStream, TcpStream) {
    let dst = listener.local_addr().expect("listener address");
    let inside = in_netns(netns, move || tcp_connect(dst, None, Duration::from_secs(2))).expect("connect");
    let (outside, _) = listener.accept().expect("accept");
    for s in [&inside, &outside] {
        s.set_read_timeout(Some(Duration::from_secs(3))).expect("read timeout");
    }
    (inside, outside)
}

/// `first` sends, `second` answers, each reading exactly what the other sent: `Err` names
/// what broke (a reset, a timeout, other bytes).
pub fn exchange(first: &TcpStream, second: &TcpStream, round: &str) -> Result<(), String> {
    use std::io::{Read as _, Write as _};
    fn one_way(mut from: &TcpStream, mut to: &TcpStream, text: &str) -> Result<(), String> {
        from.write_all(text.as_bytes()).map_err(|e| format!("writing {text:?}: {e}"))?;
        let mut got = vec![0; text.len()];
        to.read_exact(&mut got).map_err(|e| format!("reading {text:?}: {e}"))?;
        if got != text.as_bytes() {
            return Err(format!("sent {text:?}, got {:?}", String::from_utf8_lossy(&got)));
        }
        Ok(())
    }
    one_way(first, second, &format!("ask {round}"))?;
    one_way(second, first, &format!("answer {round}"))
}
