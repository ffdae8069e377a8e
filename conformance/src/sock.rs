//! Entering a netns on a thread of our own, and the socket options the rig needs:
//! `IP_TRANSPARENT`, `IP_PKTINFO`, `IP_RECVORIGDSTADDR`, `SO_MARK`.
//!
//! A socket stays in the network namespace it was created in, whichever thread uses it
//! later: that is how the proxy stand-in, living in the host netns, owns listeners inside
//! the pod netns.

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use nix::errno::Errno;
use nix::sched::{setns, CloneFlags};
use nix::sys::socket::{
    bind, connect, listen, recvmsg, sendmsg, setsockopt, socket, sockopt, AddressFamily, Backlog, ControlMessage,
    ControlMessageOwned, MsgFlags, SockFlag, SockType, SockaddrIn,
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

fn inet(ty: SockType) -> io::Result<OwnedFd> {
    Ok(socket(AddressFamily::Inet, ty, SockFlag::SOCK_CLOEXEC, None)?)
}

/// A TCP listener; `transparent` sets `IP_TRANSPARENT` before bind, as a tproxy target needs.
pub fn tcp_listener(addr: SocketAddrV4, transparent: bool) -> io::Result<TcpListener> {
    let fd = inet(SockType::Stream)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    if transparent {
        setsockopt(&fd, sockopt::IpTransparent, &true)?;
    }
    bind(fd.as_raw_fd(), &SockaddrIn::from(addr))?;
    listen(&fd, Backlog::new(64).expect("backlog"))?;
    Ok(TcpListener::from(fd))
}

/// A UDP server socket that reports each datagram's destination (`IP_PKTINFO` for the
/// address, `IP_RECVORIGDSTADDR` for address and port); `transparent` as for TCP.
pub fn udp_server(addr: SocketAddrV4, transparent: bool) -> io::Result<UdpSocket> {
    let fd = inet(SockType::Datagram)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    if transparent {
        setsockopt(&fd, sockopt::IpTransparent, &true)?;
    }
    setsockopt(&fd, sockopt::Ipv4PacketInfo, &true)?;
    setsockopt(&fd, sockopt::Ipv4OrigDstAddr, &true)?;
    bind(fd.as_raw_fd(), &SockaddrIn::from(addr))?;
    Ok(UdpSocket::from(fd))
}

/// A UDP socket bound (transparently: the address need not be local) to `src`, for sending a
/// reply that carries the original destination as its source, as a transparent proxy does.
pub fn transparent_udp_sender(src: SocketAddrV4) -> io::Result<UdpSocket> {
    let fd = inet(SockType::Datagram)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    setsockopt(&fd, sockopt::IpTransparent, &true)?;
    bind(fd.as_raw_fd(), &SockaddrIn::from(src))?;
    Ok(UdpSocket::from(fd))
}

fn v4(sa: &libc::sockaddr_in) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)), u16::from_be(sa.sin_port))
}

/// One datagram as the server saw it.
#[derive(Debug, Clone)]
pub struct Datagram {
    pub len: usize,
    pub peer: SocketAddrV4,
    /// The packet's destination address, from `IP_PKTINFO` (`ipi_addr`).
    pub pktinfo_dst: Option<Ipv4Addr>,
    /// The packet's destination address and port, from `IP_RECVORIGDSTADDR`.
    pub orig_dst: Option<SocketAddrV4>,
}

/// `recvmsg` with the destination control messages. Honours the socket's read timeout.
pub fn recv_with_dst(sock: &UdpSocket, buf: &mut [u8]) -> io::Result<Datagram> {
    let mut iov = [IoSliceMut::new(buf)];
    let mut cmsg = nix::cmsg_space!(libc::in_pktinfo, libc::sockaddr_in);
    let msg = recvmsg::<SockaddrIn>(sock.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::empty())?;
    let mut d = Datagram {
        len: msg.bytes,
        peer: msg.address.map(SocketAddrV4::from).ok_or_else(|| io::Error::other("datagram without a source"))?,
        pktinfo_dst: None,
        orig_dst: None,
    };
    for c in msg.cmsgs()? {
        match c {
            ControlMessageOwned::Ipv4PacketInfo(pi) => {
                d.pktinfo_dst = Some(Ipv4Addr::from(u32::from_be(pi.ipi_addr.s_addr)))
            }
            ControlMessageOwned::Ipv4OrigDstAddr(sa) => d.orig_dst = Some(v4(&sa)),
            _ => {}
        }
    }
    Ok(d)
}

/// `sendmsg` to `peer` with `IP_PKTINFO` choosing the source address `src` (which must be
/// local, or the socket transparent): how a server bound to 0.0.0.0 answers from the
/// address it was asked on.
pub fn send_from(sock: &UdpSocket, data: &[u8], src: Ipv4Addr, peer: SocketAddrV4) -> io::Result<usize> {
    let pi = libc::in_pktinfo {
        ipi_ifindex: 0,
        ipi_spec_dst: libc::in_addr { s_addr: u32::from(src).to_be() },
        ipi_addr: libc::in_addr { s_addr: 0 },
    };
    Ok(sendmsg(
        sock.as_raw_fd(),
        &[IoSlice::new(data)],
        &[ControlMessage::Ipv4PacketInfo(&pi)],
        MsgFlags::empty(),
        Some(&SockaddrIn::from(peer)),
    )?)
}

/// A TCP connection to `dst`, optionally with `SO_MARK`, giving up after `timeout` (the
/// connect timeout is the socket's send timeout, which blocking `connect` honours).
pub fn tcp_connect(dst: SocketAddrV4, mark: Option<u32>, timeout: Duration) -> io::Result<TcpStream> {
    let fd = inet(SockType::Stream)?;
    if let Some(m) = mark {
        setsockopt(&fd, sockopt::Mark, &m)?;
    }
    let stream = TcpStream::from(fd);
    stream.set_write_timeout(Some(timeout))?;
    stream.set_read_timeout(Some(timeout))?;
    match connect(stream.as_raw_fd(), &SockaddrIn::from(dst)) {
        Ok(()) => Ok(stream),
        Err(Errno::EINPROGRESS) | Err(Errno::EAGAIN) => {
            Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))
        }
        Err(e) => Err(e.into()),
    }
}

/// A UDP client socket, connected to `dst`, optionally with `SO_MARK`.
pub fn udp_connected(dst: SocketAddrV4, mark: Option<u32>, timeout: Duration) -> io::Result<UdpSocket> {
    let fd = inet(SockType::Datagram)?;
    if let Some(m) = mark {
        setsockopt(&fd, sockopt::Mark, &m)?;
    }
    let sock = UdpSocket::from(fd);
    sock.set_read_timeout(Some(timeout))?;
    sock.connect(dst)?;
    Ok(sock)
}
