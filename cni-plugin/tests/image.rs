//! The OCI image (`make image`, installer/image/build.sh) run with podman against a fake node
//! root: temp directories bind-mounted as the host's CNI bin, conf and state directories.
//! Install, a primary rewritten by "another CNI" and repaired, SIGTERM (podman stop)
//! uninstalling to the original bytes, an upgrade keeping the files. The image is built in a
//! private podman storage (its own --root/--runroot), removed at the end. And the load of
//! install_load.rs against the containerized installer: a flood past its 1,024 descriptors,
//! half-open requests, huge heads, concurrent scrapes, with /healthz answered within 1 s.

mod load;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The plugin the image holds: `AETHER_IMAGE_BIN`, else the static release binary `make test`
/// builds (`AETHER_CNI_STATIC_BIN`, what `make image` ships), else this test build's.
fn binary() -> PathBuf {
    ["AETHER_IMAGE_BIN", "AETHER_CNI_STATIC_BIN"]
        .iter()
        .find_map(|v| std::env::var_os(v).filter(|p| !p.is_empty()))
        .map(PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_aether-cni").into())
}

/// The installer the image holds, its entrypoint: `AETHER_IMAGE_INSTALLER_BIN`, else the
/// static release binary `make test` builds (`AETHER_INSTALLER_STATIC_BIN`), else this test
/// build's.
fn installer_binary() -> PathBuf {
    ["AETHER_IMAGE_INSTALLER_BIN", "AETHER_INSTALLER_STATIC_BIN"]
        .iter()
        .find_map(|v| std::env::var_os(v).filter(|p| !p.is_empty()))
        .map(PathBuf::from)
        .unwrap_or_else(|| aether_testkit::installer_bin().into())
}

/// Whether an ELF file asks for a program interpreter (a dynamic loader): PT_INTERP.
fn is_dynamic(elf: &[u8]) -> bool {
    assert_eq!(&elf[..5], b"\x7fELF\x02", "a 64-bit ELF");
    let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(elf[0x20..0x28].try_into().unwrap()) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    (0..phnum).any(|i| u32::from_le_bytes(elf[phoff + i * phentsize..][..4].try_into().unwrap()) == 3)
}

/// A private podman storage and what was made in it; all removed on drop.
struct Podman {
    dir: PathBuf,
    image: String,
    containers: Vec<String>,
}

impl Podman {
    fn flags(&self) -> Vec<String> {
        let d = self.dir.display();
        // `--tmpdir` too: without it podman keeps its runtime state in the machine-wide
        // /run/libpod, which `system reset` below would clear under any other podman running.
        vec![
            format!("--root={d}/root"),
            format!("--runroot={d}/run"),
            format!("--tmpdir={d}/tmp"),
            "--storage-driver=vfs".into(),
            // runc, as the conformance tests' podman: with crun beside it (Debian's podman
            // pulls crun in when it comes first), crun refuses a host whose cgroup v2 holds
            // controllers beside v1's ("hybrid mode not supported").
            "--runtime=runc".into(),
            "--cgroup-manager=cgroupfs".into(),
        ]
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new("podman");
        c.args(self.flags()).args(args);
        c
    }

    /// Runs podman; (success, stdout, stderr).
    fn run(&self, args: &[&str]) -> (bool, String, String) {
        let out = self.cmd(args).output().expect("podman (make clients-deps installs it)");
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
    }

    fn ok(&self, args: &[&str]) -> String {
        let (ok, out, err) = self.run(args);
        assert!(ok, "podman {args:?}: {err}");
        out
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        for c in &self.containers {
            let _ = self.cmd(&["rm", "-f", "-t", "0", c]).output();
        }
        let _ = self.cmd(&["rmi", "-f", &self.image]).output();
        let _ = self.cmd(&["system", "reset", "-f"]).output();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| (e.file_name().to_string_lossy().into(), fs::read(e.path()).unwrap()))
        .collect()
}

fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    aether_testkit::http::get(addr, path).filter(|(code, _)| *code != 0)
}

fn wait(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

struct Node {
    root: PathBuf,
}

impl Node {
    fn dir(&self, d: &str) -> PathBuf {
        self.root.join(d)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// Starts the image's installer as the chart does (caps NET_ADMIN and SYS_ADMIN only,
/// read-only root, host network); returns the container name and its HTTP address.
fn start(p: &mut Podman, node: &Node, libs: &[String], tag: &str, env: &[&str]) -> (String, String) {
    let name = format!("aether-image-test-{}-{tag}", std::process::id());
    let mut args: Vec<String> = vec![
        "run".into(),
        "-d".into(),
        format!("--name={name}"),
        "--network=host".into(),
        "--read-only".into(),
        // As Kubernetes' readOnlyRootFilesystem: no writable /tmp either (podman adds tmpfs by default).
        "--read-only-tmpfs=false".into(),
        "--cap-drop=ALL".into(),
        "--cap-add=NET_ADMIN,SYS_ADMIN".into(),
        // Root lacks CAP_SYS_RESOURCE here: podman's default rlimits cannot be set.
        "--ulimit=nofile=1024:1024".into(),
        "--ulimit=nproc=4096:4096".into(),
        format!("--volume={}:/host/opt/cni/bin", node.dir("bin").display()),
        format!("--volume={}:/host/etc/cni/net.d", node.dir("net.d").display()),
        format!("--volume={}:/var/run/aether-cni", node.dir("state").display()),
        "--env=HOST_IP=10.0.0.14".into(),
    ];
    args.extend(libs.iter().cloned());
    args.extend(env.iter().map(|e| format!("--env={e}")));
    args.extend([p.image.clone(), "--listen=127.0.0.1:0".into()]);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    p.ok(&argv);
    p.containers.push(name.clone());
    let mut addr = String::new();
    wait("the installer's address in its log", || {
        let (_, out, err) = p.run(&["logs", &name]);
        let log = out + &err;
        match log.lines().find(|l| l.contains("serving")).and_then(|l| l.split(" on ").nth(1)) {
            Some(a) => {
                addr = a.trim().to_string();
                true
            }
            None => false,
        }
    });
    wait("ready", || get(&addr, "/readyz").is_some_and(|(c, _)| c == 200));
    (name, addr)
}

/// `podman stop` (SIGTERM, the image's STOPSIGNAL); returns the exit code and the log.
fn stop(p: &Podman, name: &str) -> (String, String) {
    p.ok(&["stop", "-t", "30", name]);
    let state = p.ok(&["inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name]);
    let (status, code) = state.trim().split_once(' ').unwrap();
    assert_ne!(status, "running", "podman stop left {name} running");
    let code = code.to_string();
    let (_, out, err) = p.run(&["logs", name]);
    (code, out + &err)
}

#[test]
fn the_image_installs_repairs_uninstalls_and_upgrades_on_a_fake_node() {
    if !aether_testkit::root_or_skip("the_image_installs_repairs_uninstalls_and_upgrades_on_a_fake_node") {
        return;
    }
    let pid = std::process::id();
    let bin = binary();
    let bin_bytes = fs::read(&bin).unwrap();
    let installer = installer_binary();
    let installer_bytes = fs::read(&installer).unwrap();
    let mut p = Podman {
        dir: std::env::temp_dir().join(format!("aether-image-test-{pid}")),
        image: format!("localhost/aether-cni-test-{pid}:latest"),
        containers: vec![],
    };
    // The notices `make notices` wrote (make test passes them), else build.sh's default:
    // THIRD-PARTY-NOTICES beside the binary.
    let notices = std::env::var_os("AETHER_NOTICES")
        .map(PathBuf::from)
        .unwrap_or_else(|| bin.parent().unwrap().join("THIRD-PARTY-NOTICES"));
    let built = Command::new(repo().join("installer/image/build.sh"))
        .arg(&bin)
        .arg(&installer)
        .arg(&p.image)
        .env("PODMAN_FLAGS", p.flags().join(" "))
        .env("NOTICES", &notices)
        .output()
        .unwrap();
    assert!(built.status.success(), "build.sh: {}", String::from_utf8_lossy(&built.stderr));

    // The image's only content: the two binaries, their license and the third-party notices.
    let probe = format!("aether-image-test-{pid}-content");
    p.ok(&["create", "--name", &probe, &p.image]);
    p.containers.push(probe.clone());
    let tar = p.dir.join("content.tar");
    p.ok(&["export", "-o", &tar.display().to_string(), &probe]);
    let listing = aether_testkit::run("tar", &["-tvf", &tar.display().to_string()]);
    let files: Vec<&str> =
        listing.lines().filter(|l| l.starts_with('-')).map(|l| l.rsplit(' ').next().unwrap()).collect();
    assert_eq!(files, ["LICENSE", "THIRD-PARTY-NOTICES", "aether-cni", "aether-cni-installer"], "{listing}");
    let extracted = p.dir.join("extracted");
    fs::create_dir_all(&extracted).unwrap();
    aether_testkit::run(
        "tar",
        &[
            "-xf",
            &tar.display().to_string(),
            "-C",
            &extracted.display().to_string(),
            "aether-cni",
            "aether-cni-installer",
            "LICENSE",
            "THIRD-PARTY-NOTICES",
        ],
    );
    assert_eq!(fs::read(extracted.join("aether-cni")).unwrap(), bin_bytes, "the very binary");
    assert_eq!(fs::read(extracted.join("aether-cni-installer")).unwrap(), installer_bytes, "the very installer");
    assert_eq!(fs::read(extracted.join("LICENSE")).unwrap(), fs::read(repo().join("LICENSE")).unwrap());
    assert_eq!(fs::read(extracted.join("THIRD-PARTY-NOTICES")).unwrap(), fs::read(&notices).unwrap(), "the notices");

    // The scratch image runs the binaries alone if and only if they are static (the plugin
    // is checked; the installer's run below is the other).
    let ulimits = ["--ulimit=nofile=1024:1024", "--ulimit=nproc=4096:4096"];
    let mut alone = vec!["run", "--rm", "--network=none", "--entrypoint=/aether-cni"];
    alone.extend(ulimits);
    alone.extend([p.image.as_str(), "versions"]);
    let (ran, out, err) = p.run(&alone);
    if is_dynamic(&bin_bytes) {
        assert!(
            !ran && err.contains("no such file or directory"),
            "a dynamic binary cannot run in scratch: {out}{err}"
        );
    } else {
        assert!(ran && out.lines().any(|l| l == "1.1.0"), "the static binary runs in the scratch image: {out}{err}");
    }
    let libs: Vec<String> = if is_dynamic(&bin_bytes) || is_dynamic(&installer_bytes) {
        eprintln!(
            "NOTE: {} or {} is dynamically linked, so the scratch image cannot run it; the behaviour below \
             runs them with the host's library directories mounted read-only",
            bin.display(),
            installer.display()
        );
        ["/lib", "/lib64", "/usr/lib"].iter().map(|d| format!("--volume={d}:{d}:ro")).collect()
    } else {
        vec![]
    };

    let node = Node { root: std::env::temp_dir().join(format!("aether-image-node-{pid}")) };
    let _ = fs::remove_dir_all(&node.root);
    for d in ["bin", "net.d", "state"] {
        fs::create_dir_all(node.dir(d)).unwrap();
    }
    fs::copy(repo().join("testdata/install/primaries/10-bridge.conf"), node.dir("net.d/10-bridge.conf")).unwrap();
    let original = snapshot(&node.dir("net.d"));
    let chained = node.dir("net.d/00-aether-cni.conflist");

    // Install.
    let (name, addr) = start(&mut p, &node, &libs, "a", &[]);
    assert_eq!(fs::read(node.dir("bin/aether-cni")).unwrap(), bin_bytes);
    hostile_load(&p, &name, load::addr(&addr));
    let list: serde_json::Value = serde_json::from_slice(&fs::read(&chained).unwrap()).unwrap();
    assert_eq!(list["plugins"][1]["hostIP"], "10.0.0.14");
    assert_eq!(list["plugins"][1]["stateDir"], "/var/run/aether-cni");
    // Another CNI rewrites its file (a rename over it): repaired.
    let tmp = node.dir("net.d/.other-cni.tmp");
    fs::write(&tmp, br#"{"cniVersion":"1.0.0","name":"mynet","type":"bridge","bridge":"cni9"}"#).unwrap();
    fs::rename(&tmp, node.dir("net.d/10-bridge.conf")).unwrap();
    wait("the repair", || fs::read_to_string(&chained).is_ok_and(|t| t.contains("cni9") && t.contains("aether-cni")));
    let rewritten = snapshot(&node.dir("net.d"));
    // SIGTERM: uninstalled, the conf directory exactly as the other CNI left it.
    let (code, log) = stop(&p, &name);
    assert_eq!(code, "0", "{log}");
    let mut expected = rewritten.clone();
    expected.remove("00-aether-cni.conflist");
    assert_eq!(snapshot(&node.dir("net.d")), expected, "{log}");
    assert!(snapshot(&node.dir("bin")).is_empty(), "{log}");
    assert!(fs::read_to_string(node.dir("state/node-not-ready")).unwrap().contains("uninstalled"));

    // An upgrade: the old installer stops keeping both files; the new one takes over.
    fs::write(node.dir("net.d/10-bridge.conf"), &original["10-bridge.conf"]).unwrap();
    let (old, _) = start(&mut p, &node, &libs, "old", &["AETHER_CNI_UPGRADE=1"]);
    let installed = (snapshot(&node.dir("net.d")), snapshot(&node.dir("bin")));
    let (code, log) = stop(&p, &old);
    assert_eq!(code, "0", "{log}");
    assert_eq!((snapshot(&node.dir("net.d")), snapshot(&node.dir("bin"))), installed, "kept for the upgrade: {log}");
    assert!(!node.dir("state/node-not-ready").exists(), "pods keep working through the upgrade");
    let (new, addr) = start(&mut p, &node, &libs, "new", &[]);
    let metrics = get(&addr, "/metrics").unwrap().1;
    assert!(
        metrics.contains("aether_cni_installer_installs_total{what=\"conflist\"} 0"),
        "nothing to redo:\n{metrics}"
    );
    let (code, log) = stop(&p, &new);
    assert_eq!(code, "0", "{log}");
    assert_eq!(snapshot(&node.dir("net.d")), original, "byte for byte as before install: {log}");
}

/// The containerized installer (1,024 descriptors, as `start` runs it) under the load of
/// install_load.rs: /healthz within 1 s during and after each part, threads bounded, the
/// container still running and ready at the end.
fn hostile_load(p: &Podman, name: &str, addr: std::net::SocketAddr) {
    let own = load::raise_own_fd_limit();
    let pid: u32 = p.ok(&["inspect", "--format", "{{.State.Pid}}", name]).trim().parse().unwrap();
    // A scrape first, so its thread is part of "idle" once gone.
    load::assert_answered(addr, "/metrics", "before the load");
    // Idle: main, the reconcile loop, inotify, the HTTP runtime, the pod reconciler, the
    // Service layer's applier.
    assert!(load::eventually(Duration::from_secs(10), || load::usage(pid).threads <= 6), "{:?}", load::usage(pid));
    let idle = load::usage(pid);
    let bounded = |when: &str| {
        let now = load::usage(pid);
        assert!(now.threads <= 8, "{} threads {when}: {now:?}", now.threads);
        assert!(now.rss_kib <= idle.rss_kib + 16 * 1024, "RSS {when}: {now:?}, idle {idle:?}");
        assert!(now.fds < 1024, "descriptors {when}: {now:?}");
    };

    let flood = load::idle_connections(addr, 1500.min((own as usize).saturating_sub(300)));
    assert!(flood.len() > 1024, "a flood past the container's descriptor limit: {}", flood.len());
    std::thread::sleep(Duration::from_millis(300));
    load::assert_answered(addr, "/healthz", "during a flood past the descriptor limit");
    bounded("during the flood");
    drop(flood);
    load::assert_answered(addr, "/healthz", "after the flood");

    let half_open = load::half_open_requests(addr, 200);
    std::thread::sleep(Duration::from_millis(300));
    load::assert_answered(addr, "/healthz", "during 200 half-open requests");
    bounded("during half-open requests");
    drop(half_open);

    let huge: Vec<_> = (0..2).map(|_| load::huge_head(addr, 20 << 20)).collect();
    load::assert_answered(addr, "/healthz", "while 20 MiB heads arrive");
    for h in huge {
        let code = h.join().unwrap();
        assert!(code.is_none() || code == Some(431), "a 20 MiB head: {code:?}");
    }

    let scrapes = std::thread::spawn(move || load::concurrent_scrapes(addr, 64));
    while !scrapes.is_finished() {
        load::assert_answered(addr, "/healthz", "during 64 concurrent scrapes");
        bounded("during concurrent scrapes");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(scrapes.join().unwrap().iter().all(|s| s.as_ref().is_ok_and(|(c, _)| *c == 200)), "every scrape answered");

    load::assert_answered(addr, "/healthz", "after the load");
    assert!(load::eventually(Duration::from_secs(10), || load::usage(pid).threads <= 6), "threads back down");
    bounded("after the load");
    let state = p.ok(&["inspect", "--format", "{{.State.Status}}", name]);
    assert_eq!(state.trim(), "running", "the containerized installer lives on");
    assert_eq!(load::request(addr, "/readyz", load::PROBE_BOUND).map(|r| r.0), Ok(200));
}
