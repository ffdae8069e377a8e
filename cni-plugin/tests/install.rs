//! `aether-cni-installer`, the binary, with the plugin it installs: the entry it writes goes
//! through the plugin's own parser (CNI STATUS on the very binary), SIGTERM uninstalls, an
//! upgrade keeps the files, and bad input (an unknown flag, a read-only directory) fails
//! naming it, writing nothing. The plugin's old `install` names the installer's program.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_aether-cni");

/// The installer's program (it installs the `aether-cni` beside it).
fn installer() -> &'static Path {
    aether_testkit::installer_bin()
}

fn testdata() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata")
}

struct FakeNode {
    root: PathBuf,
}

impl FakeNode {
    fn new(tag: &str) -> FakeNode {
        let root = std::env::temp_dir().join(format!("aether-cni-install-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        for d in ["bin", "net.d", "state"] {
            fs::create_dir_all(root.join(d)).unwrap();
        }
        FakeNode { root }
    }
    fn dir(&self, d: &str) -> PathBuf {
        self.root.join(d)
    }
    fn flags(&self) -> Vec<String> {
        vec![
            format!("--cni-bin-dir={}", self.dir("bin").display()),
            format!("--cni-conf-dir={}", self.dir("net.d").display()),
            format!("--state-dir={}", self.dir("state").display()),
            "--listen=127.0.0.1:0".into(),
        ]
    }
}

impl Drop for FakeNode {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| (e.file_name().to_string_lossy().into(), fs::read(e.path()).unwrap_or_default()))
        .collect()
}

/// CNI STATUS on the built binary with `conf` on stdin: the error code, if any.
fn status_code(conf: &[u8]) -> Option<u64> {
    let mut child = Command::new(BIN)
        .env("CNI_COMMAND", "STATUS")
        .env("CNI_PATH", "/nonexistent")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(conf).unwrap();
    let out = child.wait_with_output().unwrap();
    if out.status.success() {
        return None;
    }
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    err["code"].as_u64()
}

/// Every chained golden file's entry, passed as a runtime passes it (the list's name and
/// cniVersion injected), is parsed by the plugin itself: with the node marked not ready,
/// STATUS answers 50 only once the configuration parsed. A version the plugin does not
/// speak is refused with code 1, and the installer reports it (see the unit tests).
#[test]
fn every_chained_entry_is_accepted_by_the_plugins_own_parser() {
    let node = FakeNode::new("roundtrip");
    fs::write(node.dir("state").join("node-not-ready"), "test: parse only\n").unwrap();
    let versions = String::from_utf8(Command::new(BIN).arg("versions").output().unwrap().stdout).unwrap();
    let mut seen = 0;
    for e in fs::read_dir(testdata().join("golden/install")).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_none_or(|x| x != "chained") {
            continue;
        }
        let text = fs::read_to_string(&path)
            .unwrap()
            .replace("<node>/run/aether-cni", &node.dir("state").display().to_string());
        let list: Value = serde_json::from_str(&text).unwrap();
        let mut entry = list["plugins"].as_array().unwrap().last().unwrap().clone();
        assert_eq!(entry["type"], "aether-cni");
        entry["name"] = list["name"].clone();
        entry["cniVersion"] = list["cniVersion"].clone();
        let version = list["cniVersion"].as_str().unwrap();
        let got = status_code(entry.to_string().as_bytes());
        if versions.lines().any(|v| v == version) {
            assert_eq!(
                got,
                Some(50),
                "{}: the plugin must parse the entry (then STATUS reports the marker)",
                path.display()
            );
        } else {
            assert_eq!(got, Some(1), "{}: cniVersion {version} is refused as a version", path.display());
        }
        seen += 1;
    }
    assert_eq!(seen, 7);
    // Negative control: a field the plugin does not know is refused before STATUS looks.
    assert_eq!(
        status_code(br#"{"cniVersion":"1.0.0","name":"n","type":"aether-cni","hostIP":"10.0.0.1","captureMod":"x"}"#),
        Some(2)
    );
}

struct Installer {
    child: Child,
    addr: String,
    log: std::sync::mpsc::Receiver<String>,
}

#[allow(clippy::zombie_processes)] // the child is waited for by Installer's Drop, or by sigterm()
fn spawn_installer(node: &FakeNode, env: &[(&str, &str)]) -> Installer {
    let mut child = Command::new(installer())
        .args(node.flags())
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let line = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("the installer says where it serves");
        if let Some(addr) = line.split(" on ").nth(1).filter(|_| line.contains("serving")) {
            return Installer { child, addr: addr.trim().to_string(), log: rx };
        }
    }
}

impl Drop for Installer {
    /// A test that fails midway still ends its installer (its own child, by PID).
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn get(addr: &str, path: &str) -> (u16, String) {
    aether_testkit::http::get(addr, path).unwrap_or_else(|| panic!("nothing answers GET {path} on {addr}"))
}

fn wait(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn sigterm(mut i: Installer) -> (bool, String) {
    unsafe { libc::kill(i.child.id() as i32, libc::SIGTERM) };
    let ok = i.child.wait().unwrap().success();
    let log: Vec<String> = i.log.try_iter().collect();
    (ok, log.join("\n"))
}

/// The real thing on a fake node root: installed, chained, ready (the kernel checks run for
/// real, hence root), the entry parsed by the very binary it installed, then SIGTERM.
#[test]
fn sigterm_uninstalls_and_an_upgrade_keeps_the_files() {
    if !aether_testkit::root_or_skip("sigterm_uninstalls_and_an_upgrade_keeps_the_files") {
        return;
    }
    for upgrade in [false, true] {
        let node = FakeNode::new(&format!("sigterm-{upgrade}"));
        fs::copy(testdata().join("install/primaries/10-bridge.conf"), node.dir("net.d/10-bridge.conf")).unwrap();
        let before = snapshot(&node.dir("net.d"));
        let env: Vec<(&str, &str)> = if upgrade {
            vec![("HOST_IP", "10.0.0.12"), ("AETHER_CNI_UPGRADE", "1")]
        } else {
            vec![("HOST_IP", "10.0.0.12")]
        };
        let i = spawn_installer(&node, &env);
        wait("ready", || get(&i.addr, "/readyz").0 == 200);
        let installed = node.dir("bin/aether-cni");
        let plugin = installer().with_file_name("aether-cni");
        assert_eq!(fs::read(&installed).unwrap(), fs::read(plugin).unwrap(), "the plugin beside it, byte for byte");
        let list: Value = serde_json::from_slice(&fs::read(node.dir("net.d/00-aether-cni.conflist")).unwrap()).unwrap();
        let mut entry = list["plugins"][1].clone();
        assert_eq!(entry["hostIP"], "10.0.0.12", "host IP from the environment");
        entry["name"] = list["name"].clone();
        entry["cniVersion"] = list["cniVersion"].clone();
        // The installed binary answers STATUS for the entry: ready (no marker, kernel fine).
        let mut child = Command::new(&installed)
            .env("CNI_COMMAND", "STATUS")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(entry.to_string().as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "STATUS: {}", String::from_utf8_lossy(&out.stdout));

        let (ok, log) = sigterm(i);
        assert!(ok, "clean exit on SIGTERM:\n{log}");
        if upgrade {
            assert!(
                installed.exists() && node.dir("net.d/00-aether-cni.conflist").exists(),
                "an upgrade keeps both:\n{log}"
            );
            assert!(!node.dir("state/node-not-ready").exists());
        } else {
            assert_eq!(snapshot(&node.dir("net.d")), before, "the conf dir byte for byte as before:\n{log}");
            assert!(!installed.exists());
            let marker = fs::read_to_string(node.dir("state/node-not-ready")).unwrap();
            assert!(marker.contains("uninstalled"), "{marker}");
        }
    }
}

#[test]
fn an_unknown_flag_is_named_and_nothing_is_written() {
    let node = FakeNode::new("flag");
    let out = Command::new(installer()).args(node.flags()).arg("--capture-everything").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--capture-everything"), "{err}");
    for d in ["bin", "net.d", "state"] {
        assert!(snapshot(&node.dir(d)).is_empty(), "{d}");
    }
}

/// The plugin is not the installer: its old `install` command fails naming the program that
/// is, and writes nothing (a DaemonSet left on the old command fails loudly, not quietly).
#[test]
fn the_plugin_names_the_installer_and_installs_nothing() {
    let node = FakeNode::new("moved");
    let out = Command::new(BIN).arg("install").args(node.flags()).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("aether-cni-installer"), "{err}");
    for d in ["bin", "net.d", "state"] {
        assert!(snapshot(&node.dir(d)).is_empty(), "{d}");
    }
    // Control: the installer itself takes the same flags (it prints the entry and exits).
    let out =
        Command::new(installer()).args(node.flags()).args(["--host-ip=10.0.0.1", "--print-entry"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"type\": \"aether-cni\""));
}

/// Read-only bind mounts in a private mount namespace (root ignores permission bits).
#[test]
fn a_read_only_directory_is_named_and_nothing_is_written() {
    if !aether_testkit::root_or_skip("a_read_only_directory_is_named_and_nothing_is_written") {
        return;
    }
    for ro in ["bin", "net.d", "state"] {
        let node = FakeNode::new(&format!("ro-{ro}"));
        fs::copy(testdata().join("install/primaries/10-bridge.conf"), node.dir("net.d/10-bridge.conf")).unwrap();
        let before: Vec<_> = ["bin", "net.d", "state"].iter().map(|d| snapshot(&node.dir(d))).collect();
        let dir = node.dir(ro).display().to_string();
        let script = format!("mount --bind -o ro {dir} {dir} && exec {} \"$@\"", installer().display());
        let mut argv = vec!["-m".to_string(), "sh".into(), "-c".into(), script, "sh".into()];
        argv.extend(node.flags());
        let out = Command::new("unshare").args(&argv).env("HOST_IP", "10.0.0.13").output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{ro}: {}", String::from_utf8_lossy(&out.stderr));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!("directory {dir} is not usable")) && err.contains("Read-only file system"),
            "{ro}: {err}"
        );
        let after: Vec<_> = ["bin", "net.d", "state"].iter().map(|d| snapshot(&node.dir(d))).collect();
        assert_eq!(after, before, "{ro}: nothing written anywhere");
    }
}
