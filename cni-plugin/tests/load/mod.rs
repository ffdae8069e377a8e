//! Hostile load on the installer's HTTP face, from the test process, to 127.0.0.1 only and
//! bounded in count and time: idle connections held open, half-open requests, huge request
//! heads, concurrent scrapes; a probe that must be answered within 1 s; the installer's
//! threads and RSS read from /proc. Shared by install_load.rs and image.rs.
#![allow(dead_code)] // each test file uses part of it

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// The bound on a probe's answer during and after load (a functional timeout: a probe that
/// takes longer fails the kubelet's check).
pub const PROBE_BOUND: Duration = Duration::from_secs(1);

pub fn addr(text: &str) -> SocketAddr {
    text.parse().unwrap_or_else(|_| panic!("{text:?} is not an address"))
}

/// One request, HTTP/1.0, everything within `bound`: (status, body), or what went wrong.
pub fn request(addr: SocketAddr, path: &str, bound: Duration) -> Result<(u16, String), String> {
    let deadline = Instant::now() + bound;
    let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let mut s = TcpStream::connect_timeout(&addr, left()).map_err(|e| format!("connect: {e}"))?;
    s.set_write_timeout(Some(left())).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: test\r\n\r\n").map_err(|e| format!("write: {e}"))?;
    let mut text = Vec::new();
    let mut buf = [0u8; 16384];
    loop {
        s.set_read_timeout(Some(left())).unwrap();
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => text.extend_from_slice(&buf[..n]),
            Err(e) => return Err(format!("read after {} bytes: {e}", text.len())),
        }
        if Instant::now() >= deadline {
            return Err(format!("not answered within {bound:?}"));
        }
    }
    let text = String::from_utf8_lossy(&text).into_owned();
    let code =
        text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or(format!("no status line in {text:?}"))?;
    Ok((code, text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default()))
}

/// `path` answered 200 within `PROBE_BOUND`, or the test fails naming `when`.
pub fn assert_answered(addr: SocketAddr, path: &str, when: &str) -> String {
    let started = Instant::now();
    match request(addr, path, PROBE_BOUND) {
        Ok((200, body)) => body,
        Ok((code, body)) => panic!("{path} {when}: {code} {body}"),
        Err(e) => panic!("{path} {when}: not answered within {PROBE_BOUND:?} ({e}, after {:?})", started.elapsed()),
    }
}

/// Raises this process's soft file-descriptor limit to its hard limit (the floods hold
/// hundreds of sockets); returns the limit now in force.
pub fn raise_own_fd_limit() -> u64 {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        r.rlim_cur = r.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
    }
    r.rlim_cur
}

/// Sets another process's soft file-descriptor limit (its hard limit kept, so the soft one
/// can be raised again).
pub fn set_fd_limit(pid: u32, limit: u64) {
    let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    let pid = pid as libc::pid_t;
    let rc = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) };
    assert_eq!(rc, 0, "prlimit({pid}, NOFILE): {}", std::io::Error::last_os_error());
    let r = libc::rlimit { rlim_cur: limit, rlim_max: old.rlim_max };
    let rc = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &r, std::ptr::null_mut()) };
    assert_eq!(rc, 0, "prlimit({pid}, NOFILE, {limit}): {}", std::io::Error::last_os_error());
}

/// The installer's threads, RSS (KiB) and open descriptors, from /proc.
#[derive(Debug, Clone, Copy)]
pub struct Usage {
    pub threads: u64,
    pub rss_kib: u64,
    pub fds: usize,
}

pub fn usage(pid: u32) -> Usage {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the installer is running");
    let field = |name: &str| -> u64 {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} in {status}"));
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0);
    Usage { threads: field("Threads:"), rss_kib: field("VmRSS:"), fds }
}

/// `n` connections that send nothing, held until dropped. The installer may close any of
/// them at once (its limit): connecting still succeeds, the kernel completes the handshake.
pub fn idle_connections(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    (0..n).filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()).collect()
}

/// `n` connections that send a request head without its end, held until dropped.
pub fn half_open_requests(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    idle_connections(addr, n)
        .into_iter()
        .filter_map(|mut s| s.write_all(b"GET /healthz HTTP/1.1\r\nHost: test\r\nX-Slow: ").ok().map(|_| s))
        .collect()
}

/// How many of `conns` the server has closed: a read that returns end-of-file or a reset,
/// waiting up to `wait` in all.
pub fn closed_by_server(conns: &mut [TcpStream], wait: Duration) -> usize {
    let deadline = Instant::now() + wait;
    let mut closed = 0;
    for s in conns.iter_mut() {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        s.set_read_timeout(Some(left)).unwrap();
        let mut b = [0u8; 512];
        loop {
            match s.read(&mut b) {
                Ok(0) => {
                    closed += 1;
                    break;
                }
                Ok(_) => continue, // an answer (e.g. 408) before the close
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => break,
                Err(_) => {
                    closed += 1;
                    break;
                }
            }
        }
    }
    closed
}

/// Sends a request whose head is `size` bytes of one header, on a thread; what came back:
/// the status code if the server answered, else None (it reset the connection mid-send).
pub fn huge_head(addr: SocketAddr, size: usize) -> std::thread::JoinHandle<Option<u16>> {
    std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).ok()?;
        s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(b"GET /healthz HTTP/1.1\r\nHost: test\r\nX-Huge: ");
        let chunk = vec![b'a'; 64 * 1024];
        let mut sent = 0;
        while sent < size {
            if s.write_all(&chunk).is_err() {
                break;
            }
            sent += chunk.len();
        }
        let _ = s.write_all(b"\r\n\r\n");
        let mut text = Vec::new();
        let _ = s.read_to_end(&mut text);
        String::from_utf8_lossy(&text).split_whitespace().nth(1).and_then(|c| c.parse().ok())
    })
}

/// `n` scrapes of `/metrics` at once; their outcomes.
pub fn concurrent_scrapes(addr: SocketAddr, n: usize) -> Vec<Result<(u16, String), String>> {
    let threads: Vec<_> =
        (0..n).map(|_| std::thread::spawn(move || request(addr, "/metrics", Duration::from_secs(20)))).collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Waits up to `within` for `cond`; false if it never held.
pub fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A sample's value in Prometheus text (`name` with its labels as written, e.g.
/// `aether_cni_installer_http_connections{listener="probes"}`).
pub fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}
