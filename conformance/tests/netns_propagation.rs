//! The installer's start-up check of its netns directory's mount propagation, with the real
//! binary (`aether-cni-installer`) in a mount namespace the test makes for it.
//!
//! The child, before it executes the installer, enters a network namespace of the test's,
//! unshares its mount namespace, makes every mount in it private (nothing it does reaches the
//! host's mounts, nor the host's reach it), makes a "host" netns directory shared there and
//! binds it onto the directory given as `--netns-dir`: as a slave of it (what the chart's
//! `mountPropagation: HostToContainer` makes of a shared host path) or private (a host path
//! that is neither shared nor slave). The mounts go with the process. The directory's name
//! has a space, which mountinfo escapes (`\040`).
//!
//! Root tests: they skip loudly without root, and fail under AETHER_REQUIRE_ROOT_TESTS=1 (CI).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use aether_conformance::{cni_bin, sock, HOST_IP};
use aether_testkit::{http, root_or_skip, ScratchDir, TestNetns};

const LISTEN: &str = "127.0.0.1:18095";

/// The installer in its own mount namespace, stopped (SIGTERM, then SIGKILL) on drop.
struct Installer {
    child: Child,
    log: PathBuf,
    netns: String,
}

impl Installer {
    fn start(scratch: &Path, net: &TestNetns, slave: bool) -> Installer {
        let (host_dir, dir) = (scratch.join("host netns"), scratch.join("run netns"));
        for d in [&host_dir, &dir, &scratch.join("bin"), &scratch.join("conf")] {
            std::fs::create_dir_all(d).unwrap();
        }
        let primary = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/install/primaries/10-bridge.conf");
        std::fs::copy(primary, scratch.join("conf/10-bridge.conf")).unwrap();
        let log = scratch.join("installer.log");
        let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).unwrap();
        let (root, host_c, dir_c) = (CString::new("/").unwrap(), c(&host_dir), c(&dir));
        let ns = std::fs::File::open(net.path()).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&ns);
        let mut cmd = Command::new(aether_testkit::installer_bin());
        cmd.arg(format!("--plugin-binary={}", cni_bin().display()))
            .arg(format!("--cni-bin-dir={}", scratch.join("bin").display()))
            .arg(format!("--cni-conf-dir={}", scratch.join("conf").display()))
            .arg(format!("--state-dir={}", scratch.join("state").display()))
            .arg(format!("--netns-dir={}", dir.display()))
            .arg(format!("--listen={LISTEN}"))
            .arg(format!("--host-ip={HOST_IP}"))
            .arg("--services-socket=")
            .arg("--reconcile=false")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        // SAFETY: only async-signal-safe calls (setns, unshare, mount) on memory prepared
        // before the fork; the netns fd stays open in the parent until spawn returns.
        unsafe {
            cmd.pre_exec(move || {
                let ok = |rc: libc::c_int| if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) };
                let mount = |src: &CString, dst: &CString, flags: libc::c_ulong| {
                    let src = if flags & libc::MS_BIND != 0 { src.as_ptr() } else { std::ptr::null() };
                    ok(libc::mount(src, dst.as_ptr(), std::ptr::null(), flags, std::ptr::null()))
                };
                ok(libc::setns(fd, libc::CLONE_NEWNET))?;
                ok(libc::unshare(libc::CLONE_NEWNS))?;
                // Cut off from the host's mounts, both ways, before anything is mounted.
                mount(&root, &root, libc::MS_REC | libc::MS_PRIVATE)?;
                // The "host's" directory, shared (as systemd mounts `/`, or `ip netns` its own).
                mount(&host_c, &host_c, libc::MS_BIND)?;
                mount(&host_c, &host_c, libc::MS_SHARED)?;
                // The container's view of it: a peer of it, then a slave, or private.
                mount(&host_c, &dir_c, libc::MS_BIND)?;
                mount(&dir_c, &dir_c, if slave { libc::MS_SLAVE } else { libc::MS_PRIVATE })
            });
        }
        let child = cmd.spawn().expect("spawn aether-cni-installer");
        drop(ns);
        let inst = Installer { child, log, netns: net.path() };
        let deadline = Instant::now() + Duration::from_secs(20);
        while inst.get("/healthz").is_none() {
            assert!(Instant::now() < deadline, "the installer never served /healthz:\n{}", inst.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        inst
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn get(&self, path: &str) -> Option<(u16, String)> {
        let stream = sock::in_netns(&self.netns, || {
            std::net::TcpStream::connect_timeout(&LISTEN.parse().unwrap(), Duration::from_secs(2)).ok()
        });
        let s = stream?;
        s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        http::exchange(s, "GET", path, None).ok()
    }

    /// `/readyz` once the first pass is done (no `starting:` reason left).
    fn readyz_settled(&self) -> (u16, String) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let answer = self.get("/readyz").unwrap_or((0, String::new()));
            if answer.0 != 0 && !answer.1.contains("starting:") {
                return answer;
            }
            assert!(Instant::now() < deadline, "never past starting: {answer:?}\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM (the uninstall), then SIGKILL after 10 s.
    fn stop(&mut self) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.child.try_wait().ok().flatten().is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Installer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The mount points of this process's (the host's) mount table under `dir`.
fn host_mounts_under(dir: &Path) -> Vec<PathBuf> {
    let mounts = aether_netns::mountinfo::read().unwrap();
    mounts.into_iter().map(|m| m.mount_point).filter(|m| m.starts_with(dir)).collect()
}

/// Runs the installer with its netns directory bound slave or private; returns its log, its
/// settled `/readyz`, and the not-ready marker's text.
fn run(tag: &str, slave: bool) -> (String, (u16, String), Option<String>, bool) {
    let scratch = ScratchDir::new(tag);
    let net = TestNetns::new(tag);
    let mut inst = Installer::start(&scratch.0, &net, slave);
    let readyz = inst.readyz_settled();
    // The marker is written before `/readyz` serves the status it mirrors (`publish`): read
    // once, after the settled answer.
    let marker = std::fs::read_to_string(scratch.0.join("state/node-not-ready")).ok();
    let chained = scratch.0.join("conf/00-aether-cni.conflist").exists() && scratch.0.join("bin/aether-cni").exists();
    let leaked = host_mounts_under(&scratch.0);
    assert!(leaked.is_empty(), "the test's mounts reached the host's mount table: {leaked:?}");
    inst.stop();
    let log = inst.log();
    drop(inst);
    assert!(
        !scratch.0.join("conf/00-aether-cni.conflist").exists(),
        "the uninstall did not remove the chained conflist:\n{log}"
    );
    (log, readyz, marker, chained)
}

#[test]
fn a_private_netns_directory_is_named_and_keeps_the_node_not_ready() {
    if !root_or_skip("a_private_netns_directory_is_named_and_keeps_the_node_not_ready") {
        return;
    }
    let (log, (code, body), marker, chained) = run("netnsprop-private", false);
    // The message names the mount point (escaped in mountinfo, named as it is), its
    // propagation, and what the chart needs.
    let named = log.lines().find(|l| l.contains(" ERROR ") && l.contains("(--netns-dir)")).unwrap_or_else(|| {
        panic!("no error line naming the netns directory:\n{log}");
    });
    for needle in [
        "run netns (--netns-dir) is on the mount ",
        "run netns, which is private",
        "mountPropagation: HostToContainer",
        "a shared or slave mount",
    ] {
        assert!(named.contains(needle), "{needle:?} not in: {named}");
    }
    // Fail closed: not ready (and CNI STATUS fails, by the marker), the reason in both.
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("netns: the netns directory"), "{body}");
    assert!(marker.as_deref().is_some_and(|m| m.contains("netns: ")), "{marker:?}");
    // But chained: every pod the runtime starts is still captured by ADD.
    assert!(chained, "the binary and the chained conflist must be written:\n{log}");
}

/// The control: the same directory as a slave of the "host's" (HostToContainer) passes.
#[test]
fn a_slave_netns_directory_passes() {
    if !root_or_skip("a_slave_netns_directory_passes") {
        return;
    }
    let (log, (code, body), marker, chained) = run("netnsprop-slave", true);
    assert!(log.contains("the netns directory receives the host's mounts"), "{log}");
    assert!(!log.contains("(--netns-dir) is on the mount"), "{log}");
    assert_eq!(code, 200, "{body}\n{log}");
    assert_eq!(marker, None);
    assert!(chained);
}
