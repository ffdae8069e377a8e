//! A reused netns path, a killed DEL, planted symlinks and huge inputs must not hurt a pod or
//! the node, and records written by an older plugin are still read: each reproduced as a
//! user would, with the real binary and real namespaces.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};

use aether_testkit::{root_or_skip, TestNetns};
use common::{bin, conf, run_plugin, Outcome};
use serde_json::{json, Value};

/// A named netns whose path (`/run/netns/<name>`) can be freed and made anew, as a runtime
/// reusing a path (or a PID, for `/proc/<pid>/ns/net`) does.
struct ReusedPath {
    name: String,
}

impl ReusedPath {
    fn new(tag: &str) -> Self {
        let p = ReusedPath { name: format!("aeth-{tag}-{}", std::process::id()) };
        aether_testkit::run("ip", &["netns", "add", &p.name]);
        p
    }

    fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }

    /// The namespace goes away without DEL, and a new one appears at the same path.
    fn replace(&self) {
        aether_testkit::run("ip", &["netns", "del", &self.name]);
        aether_testkit::run("ip", &["netns", "add", &self.name]);
    }

    fn tables(&self) -> String {
        aether_testkit::run("ip", &["netns", "exec", &self.name, "nft", "list", "tables"])
    }
}

impl Drop for ReusedPath {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

fn cli(args: &[&str], stdin: &[u8]) -> Outcome {
    aether_conformance::cni::run_cli_here(args, stdin)
}

fn snapshot(generation: u64) -> Vec<u8> {
    serde_json::to_vec(&json!({"generation": generation, "mode": "count", "serviceRanges": ["10.96.0.0/16"],
        "services": [{"namespace": "shop", "name": "cart", "vip": "10.96.1.1",
            "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": true}]}))
    .unwrap()
}

fn state_of(c: &Value) -> String {
    c["stateDir"].as_str().unwrap().to_string()
}

fn apply(state: &str, generation: u64) -> Outcome {
    cli(&["services", "--state-dir", state, "apply"], &snapshot(generation))
}

fn gc(c: &Value, valid: &[&str]) -> Outcome {
    let mut c = c.clone();
    c["cni.dev/valid-attachments"] = valid.iter().map(|id| json!({"containerID": id, "ifname": "eth0"})).collect();
    run_plugin("GC", None, &c, &[])
}

fn as_ctr(id: &str) -> [(&str, &str); 1] {
    [("CNI_CONTAINERID", id)]
}

/// Pod `a` at a path, its namespace freed without DEL, pod `b` at the same path: `b` is ADDed
/// and programmed. The kernel gives the new namespace the freed inode number back (seen on
/// 6.18), so only the namespace cookie tells them apart.
fn two_pods_one_path(tag: &str) -> (ReusedPath, Value) {
    let c = conf("1.1.0", json!({}));
    assert!(apply(&state_of(&c), 1).ok);
    let p = ReusedPath::new(tag);
    let a = run_plugin("ADD", Some(&p.path()), &c, &as_ctr("ctr-a"));
    assert!(a.ok, "{}", a.stdout);
    p.replace();
    let b = run_plugin("ADD", Some(&p.path()), &c, &as_ctr("ctr-b"));
    assert!(b.ok, "{}", b.stdout);
    assert!(run_plugin("CHECK", Some(&p.path()), &c, &as_ctr("ctr-b")).ok);
    (p, c)
}

fn assert_b_intact(p: &ReusedPath, c: &Value, after: &str) {
    let check = run_plugin("CHECK", Some(&p.path()), c, &as_ctr("ctr-b"));
    assert!(check.ok, "after {after}, CHECK of b: {}", check.stdout);
    let tables = p.tables();
    assert!(tables.contains("aether_capture") && tables.contains("aether_services"), "after {after}: {tables}");
}

#[test]
fn gc_of_a_pod_whose_path_was_reused_leaves_the_new_pod_alone() {
    if !root_or_skip("gc_of_a_pod_whose_path_was_reused_leaves_the_new_pod_alone") {
        return;
    }
    let (p, c) = two_pods_one_path("reuse-gc");
    // CHECK of a names the namespace as another one.
    let (code, text) = run_plugin("CHECK", Some(&p.path()), &c, &as_ctr("ctr-a")).error();
    assert_eq!(code, 100, "{text}");
    assert!(text.contains("another network namespace"), "{text}");
    // An apply skips a (its namespace is gone) and keeps b's layer.
    let out = apply(&state_of(&c), 2);
    assert!(out.ok, "{}{}", out.stdout, out.stderr);
    let report: Value = serde_json::from_str(&out.stdout).unwrap();
    let result = |id: &str| {
        report["pods"].as_array().unwrap().iter().find(|p| p["containerID"] == id).unwrap()["result"].clone()
    };
    assert_eq!(result("ctr-a"), "skipped", "{report}");
    assert_ne!(result("ctr-b"), "skipped", "{report}");
    let out = gc(&c, &["ctr-b"]);
    assert!(out.ok, "{}", out.stdout);
    assert_b_intact(&p, &c, "GC");
    let records = std::fs::read_dir(Path::new(&state_of(&c)).join("attachments")).unwrap().count();
    assert_eq!(records, 1, "a's record is removed, b's kept");
}

#[test]
fn del_of_a_pod_whose_path_was_reused_leaves_the_new_pod_alone() {
    if !root_or_skip("del_of_a_pod_whose_path_was_reused_leaves_the_new_pod_alone") {
        return;
    }
    // Without CNI_NETNS (the record's path), and with it (a runtime passing the reused path).
    for netns in [false, true] {
        let (p, c) = two_pods_one_path("reuse-del");
        let path = p.path();
        let del = run_plugin("DEL", netns.then_some(path.as_str()), &c, &as_ctr("ctr-a"));
        assert!(del.ok, "{}", del.stdout);
        assert_b_intact(&p, &c, &format!("DEL a (CNI_NETNS set: {netns})"));
        // No record for a any more: a DEL naming the path again still leaves b alone.
        assert!(run_plugin("DEL", Some(&path), &c, &as_ctr("ctr-a")).ok);
        assert_b_intact(&p, &c, "a second DEL of a");
        // b's own DEL cleans.
        assert!(run_plugin("DEL", Some(&path), &c, &as_ctr("ctr-b")).ok);
        let tables = p.tables();
        assert!(!tables.contains("aether_capture") && !tables.contains("aether_services"), "{tables}");
    }
}

#[test]
fn read_commands_never_create_the_state_directory() {
    let dir = std::env::temp_dir().join(format!("aether-ro-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.display().to_string();
    let counters = cli(&["services", "--state-dir", &d, "counters"], b"");
    assert!(counters.ok, "{}", counters.stderr);
    let v: Value = serde_json::from_str(&counters.stdout).unwrap();
    assert_eq!(v["node"]["service"], 0, "{v}");
    assert!(cli(&["services", "--state-dir", &d, "demand"], b"").ok);
    let _ = cli(&["inspect", "--state-dir", &d, "ctr-x"], b"");
    assert!(!dir.exists(), "a read command created {d}");
}

/// Writes a copy of `id`'s record with `change` applied, as another container's.
fn forge_record(state: &str, id: &str, new_id: &str, change: impl FnOnce(&mut Value)) {
    let dir = Path::new(state).join("attachments");
    let mut v: Value =
        serde_json::from_slice(&std::fs::read(dir.join(format!("k8s-pod-network+{id}+eth0.json"))).unwrap()).unwrap();
    v["containerId"] = json!(new_id);
    change(&mut v);
    std::fs::write(dir.join(format!("k8s-pod-network+{new_id}+eth0.json")), v.to_string()).unwrap();
}

#[test]
fn gc_clears_what_is_provably_stale_and_keeps_the_rest() {
    if !root_or_skip("gc_clears_what_is_provably_stale_and_keeps_the_rest") {
        return;
    }
    let c = conf("1.1.0", json!({}));
    let state = state_of(&c);
    assert!(apply(&state, 1).ok);
    let ns = TestNetns::new("stale");
    assert!(run_plugin("ADD", Some(&ns.path()), &c, &as_ctr("live")).ok);
    let att = Path::new(&state).join("attachments");
    // Records whose netns path is a plain file and a directory.
    let plain = att.with_file_name("not-a-netns");
    std::fs::write(&plain, b"").unwrap();
    forge_record(&state, "live", "on-a-file", |v| v["netns"] = json!(plain));
    forge_record(&state, "live", "on-a-dir", |v| v["netns"] = json!(att));
    // An unparseable record of a stale attachment, one of a valid attachment, a file that
    // is no record at all, and a temp file a killed writer left a while ago.
    std::fs::write(att.join("k8s-pod-network+torn+eth0.json"), b"{\"network\": \"k8s-pod").unwrap();
    std::fs::write(att.join("k8s-pod-network+valid-torn+eth0.json"), b"{\"net").unwrap();
    std::fs::write(att.join("stray.json"), b"[]").unwrap();
    let temp = att.join(format!(".k8s-pod-network+x+eth0.json.tmp.{}.1", i32::MAX - 1));
    std::fs::write(&temp, b"partial").unwrap();
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    std::fs::File::options().write(true).open(&temp).unwrap().set_modified(old).unwrap();
    // The apply reaches the live pod, skips the two whose netns is not one, and names the
    // unreadable files; it does not fail.
    let out = apply(&state, 2);
    assert!(out.ok, "{}{}", out.stdout, out.stderr);
    for name in ["k8s-pod-network+torn+eth0.json", "stray.json", "\"skipped\""] {
        assert!(out.stdout.contains(name), "{name} not in {}", out.stdout);
    }
    let out = gc(&c, &["live", "valid-torn"]);
    assert!(out.ok, "GC: {}\n{}", out.stdout, out.stderr);
    assert!(!out.stdout.contains("CNI_NETNS"), "{}", out.stdout);
    assert!(
        out.stderr.contains(
            "kept: the record of a valid attachment cannot be read file=k8s-pod-network+valid-torn+eth0.json"
        ),
        "{}",
        out.stderr
    );
    let mut left: Vec<String> =
        std::fs::read_dir(&att).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    left.sort();
    assert_eq!(left, ["k8s-pod-network+live+eth0.json", "k8s-pod-network+valid-torn+eth0.json"]);
    assert!(run_plugin("CHECK", Some(&ns.path()), &c, &as_ctr("live")).ok);
    let _ = std::fs::remove_file(&plain);
}

#[test]
fn inspect_exits_non_zero_when_the_service_layer_is_not_intact() {
    if !root_or_skip("inspect_exits_non_zero_when_the_service_layer_is_not_intact") {
        return;
    }
    let c = conf("1.1.0", json!({}));
    let state = state_of(&c);
    assert!(apply(&state, 1).ok);
    let ns = TestNetns::new("insp");
    assert!(run_plugin("ADD", Some(&ns.path()), &c, &as_ctr("ctr-i")).ok);
    let inspect = || cli(&["inspect", "--state-dir", &state, "ctr-i"], b"");
    let out = inspect();
    assert!(out.ok, "{}{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("name generation 1 (the stored layer)"), "{}", out.stdout);
    assert!(!Path::new(&state).join("services/pods").exists(), "a file mirrors what the pod holds");
    ns.exec("nft", &["delete", "element", "ip", "aether_services", "service_ports", "{ 10.96.1.1 . tcp . 80 }"]);
    let out = inspect();
    assert!(!out.ok && out.stdout.contains("NOT as the snapshot says"), "{}", out.stdout);
    // The table still names the stored layer: drift, not an older layer.
    assert!(out.stdout.contains("(the stored layer)"), "{}", out.stdout);
    ns.exec("nft", &["delete", "table", "ip", "aether_services"]);
    let out = inspect();
    assert!(!out.ok, "{}", out.stdout);
}

/// A record without `rulePriority` in its capture (as an older plugin might
/// have written) is still the pod's: `inspect`, `services apply` and GC know it.
#[test]
fn a_record_missing_a_capture_field_still_names_its_pod() {
    if !root_or_skip("a_record_missing_a_capture_field_still_names_its_pod") {
        return;
    }
    let c = conf("1.1.0", json!({}));
    let state = state_of(&c);
    assert!(apply(&state, 1).ok);
    let ns = TestNetns::new("oldrec");
    assert!(run_plugin("ADD", Some(&ns.path()), &c, &as_ctr("ctr-old")).ok);
    let file = Path::new(&state).join("attachments/k8s-pod-network+ctr-old+eth0.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    v["capture"].as_object_mut().unwrap().remove("rulePriority");
    v.as_object_mut().unwrap().remove("version");
    std::fs::write(&file, v.to_string()).unwrap();
    let out = cli(&["inspect", "--state-dir", &state, "ctr-old"], b"");
    assert!(out.ok, "{}{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("container ctr-old") && out.stdout.contains("defaults: rulePriority"),
        "{}",
        out.stdout
    );
    let out = apply(&state, 2);
    assert!(out.ok && out.stdout.contains("ctr-old"), "{}", out.stdout);
    let counters = cli(&["services", "--state-dir", &state, "counters"], b"");
    assert!(counters.stdout.contains("ctr-old"), "{}", counters.stdout);
    assert!(run_plugin("CHECK", Some(&ns.path()), &c, &as_ctr("ctr-old")).ok);
    let out = gc(&c, &[]);
    assert!(out.ok, "{}", out.stdout);
    assert!(!file.exists());
    assert!(!ns.exec("nft", &["list", "tables"]).contains("aether_capture"), "GC removed the old pod's capture");
}

/// Runs the plugin with raw `stdin` (the writer's error ignored: the plugin may stop reading).
fn plugin_raw(command: &str, netns: &str, stdin: &[u8]) -> Outcome {
    let mut child = Command::new(bin())
        .env_clear()
        .envs([
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", "ctr-big"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_NETNS", netns),
            ("CNI_PATH", "/opt/cni/bin"),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    let body = stdin.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = std::io::Write::write_all(&mut input, &body);
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    Outcome {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

#[test]
fn huge_inputs_are_refused_naming_the_limit_and_never_echoed() {
    if !root_or_skip("huge_inputs_are_refused_naming_the_limit_and_never_echoed") {
        return;
    }
    let ns = TestNetns::new("huge");
    // A 100 MB prevResult.
    let mut c = conf("1.0.0", json!({}));
    c["prevResult"]["interfaces"][0]["name"] = json!("x".repeat(100 << 20));
    let out = plugin_raw("ADD", &ns.path(), c.to_string().as_bytes());
    let (code, text) = out.error();
    assert_eq!(code, 7, "{text}");
    assert!(text.contains("limit of 1048576 bytes"), "{text}");
    assert!(out.stdout.len() < 1000, "stdout echoes {} bytes", out.stdout.len());
    // A 100 KB annotation value: refused by name and limit, a short prefix shown.
    let c = conf(
        "1.0.0",
        json!({"runtimeConfig": {"io.kubernetes.cri.pod-annotations": {"aether.io/exclude-outbound-cidrs": "10.1.1.1,".repeat(10_000)}}}),
    );
    let out = plugin_raw("ADD", &ns.path(), c.to_string().as_bytes());
    let (code, text) = out.error();
    assert_eq!(code, 7, "{text}");
    assert!(text.contains("aether.io/exclude-outbound-cidrs") && text.contains("limit of 4096 bytes"), "{text}");
    assert!(out.stdout.len() < 1000, "stdout echoes {} bytes", out.stdout.len());
    assert!(!ns.exec("nft", &["list", "tables"]).contains("aether_capture"), "nothing programmed");
}

#[test]
fn prev_result_is_refused_unless_it_is_a_result_of_the_configurations_version() {
    if !root_or_skip("prev_result_is_refused_unless_it_is_a_result_of_the_configurations_version") {
        return;
    }
    let ns = TestNetns::new("prev");
    let cases = [
        (json!({"cniVersion": "1.0.0", "ips": [{"address": "300.1.1.1/24"}]}), 6, "ips[0].address"),
        (json!({"cniVersion": "1.0.0", "interfaces": {"name": "eth0"}}), 6, "interfaces"),
        (json!({"cniVersion": "0.4.0", "ips": [{"version": "4", "address": "10.1.0.5/16"}]}), 1, "0.4.0"),
    ];
    for (prev, want, needle) in cases {
        let c = conf("1.0.0", json!({"prevResult": prev}));
        for cmd in ["ADD", "CHECK"] {
            let (code, text) = run_plugin(cmd, Some(&ns.path()), &c, &[]).error();
            assert_eq!(code, want, "{cmd} {prev}: {text}");
            assert!(text.contains(needle), "{cmd}: {text}");
        }
        assert!(!ns.exec("nft", &["list", "tables"]).contains("aether_capture"), "nothing programmed");
    }
}

/// A DEL killed after the pod's counts are folded, or after its layer is removed,
/// loses no count and counts none twice: node totals never go backwards, and once the DEL
/// is retried they are exactly what the pod made.
#[test]
fn a_del_killed_at_any_point_keeps_the_node_totals() {
    if !root_or_skip("a_del_killed_at_any_point_keeps_the_node_totals") {
        return;
    }
    let total = |state: &str| -> u64 {
        let out = cli(&["services", "--state-dir", state, "counters"], b"");
        let v: Value = serde_json::from_str(&out.stdout).unwrap();
        v["node"].as_object().unwrap().values().filter_map(Value::as_u64).sum()
    };
    for point in ["del-folded", "del-layer-removed"] {
        let c = conf("1.1.0", json!({}));
        let state = state_of(&c);
        assert!(apply(&state, 1).ok);
        let ns = TestNetns::new("killdel");
        ns.exec("ip", &["route", "add", "default", "dev", "lo"]);
        assert!(run_plugin("ADD", Some(&ns.path()), &c, &as_ctr("ctr-k")).ok);
        aether_conformance::sock::in_netns(&ns.path(), || {
            for port in 20_001..=20_004 {
                let to = std::net::SocketAddr::from(([192, 0, 2, 1], port));
                let _ = std::net::TcpStream::connect_timeout(&to, std::time::Duration::from_millis(200));
            }
        });
        assert_eq!(total(&state), 4, "four connections counted");
        let killed =
            run_plugin("DEL", Some(&ns.path()), &c, &[("CNI_CONTAINERID", "ctr-k"), ("AETHER_CNI_CRASH_AT", point)]);
        assert!(!killed.ok && killed.stdout.is_empty(), "{point}: the DEL was not killed: {}", killed.stdout);
        assert_eq!(total(&state), 4, "{point}: after the killed DEL");
        assert!(run_plugin("DEL", Some(&ns.path()), &c, &as_ctr("ctr-k")).ok);
        assert_eq!(total(&state), 4, "{point}: after the retried DEL");
        assert!(ns.exec("nft", &["list", "tables"]).trim().is_empty());
    }
}

/// A DEL killed as above, then a re-ADD of the same container (podman's network reload is DEL then ADD):
/// the DEL killed after removing the layer left the pod's counts folded and marked; the new
/// layer counts from zero and every new connection reaches the node totals.
#[test]
fn a_re_add_after_a_killed_del_counts_from_zero() {
    if !root_or_skip("a_re_add_after_a_killed_del_counts_from_zero") {
        return;
    }
    let total = |state: &str| -> u64 {
        let out = cli(&["services", "--state-dir", state, "counters"], b"");
        let v: Value = serde_json::from_str(&out.stdout).unwrap();
        v["node"].as_object().unwrap().values().filter_map(Value::as_u64).sum()
    };
    let connect = |ns: &TestNetns, ports: std::ops::RangeInclusive<u16>| {
        aether_conformance::sock::in_netns(&ns.path(), || {
            for port in ports {
                let to = std::net::SocketAddr::from(([192, 0, 2, 1], port));
                let _ = std::net::TcpStream::connect_timeout(&to, std::time::Duration::from_millis(200));
            }
        })
    };
    let c = conf("1.1.0", json!({}));
    let state = state_of(&c);
    assert!(apply(&state, 1).ok);
    let ns = TestNetns::new("readd");
    ns.exec("ip", &["route", "add", "default", "dev", "lo"]);
    assert!(run_plugin("ADD", Some(&ns.path()), &c, &as_ctr("ctr-r")).ok);
    connect(&ns, 21_001..=21_004);
    let killed = run_plugin(
        "DEL",
        Some(&ns.path()),
        &c,
        &[("CNI_CONTAINERID", "ctr-r"), ("AETHER_CNI_CRASH_AT", "del-layer-removed")],
    );
    assert!(!killed.ok && killed.stdout.is_empty(), "the DEL was not killed: {}", killed.stdout);
    assert_eq!(total(&state), 4);
    assert!(run_plugin("ADD", Some(&ns.path()), &c, &as_ctr("ctr-r")).ok);
    connect(&ns, 21_005..=21_006);
    assert_eq!(total(&state), 6, "the re-ADDed pod's two connections reach the node totals");
    assert!(run_plugin("DEL", Some(&ns.path()), &c, &as_ctr("ctr-r")).ok);
    assert_eq!(total(&state), 6);
}

/// Runs the plugin binary at `binary` (a copy: this test removes it) with `command`.
fn run_copy(binary: &Path, command: &str, netns: &str, c: &Value) -> std::process::Child {
    let spawn = || {
        Command::new(binary)
            .env_clear()
            .envs([
                ("CNI_COMMAND", command),
                ("CNI_CONTAINERID", "ctr-race"),
                ("CNI_IFNAME", "eth0"),
                ("CNI_NETNS", netns),
                ("CNI_PATH", "/opt/cni/bin"),
                ("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=race-0"),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
    };
    // A copy just written can be "busy" for an instant: a process another test forks in this
    // one inherits the copy's write descriptor until it execs (ETXTBSY, seen in CI).
    let mut tries = 0;
    let mut child = loop {
        match spawn() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 100 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            spawned => break spawned.unwrap(),
        }
    };
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), c.to_string().as_bytes()).unwrap();
    child
}

/// An ADD that raced an uninstall: it started from the plugin binary, waited for the state
/// lock while the uninstall's last DEL removed the binary, then wrote its record. It puts the
/// binary back (from its own executable) and says so in `uninstalled`, so the pod's DEL finds
/// the plugin; that DEL, the last, removes it again. Control: a binary removed after an ADD
/// finished (no uninstall under way) stays removed: only an ADD that finds its own binary
/// gone once its record is written puts it back.
#[test]
fn an_add_that_raced_the_uninstall_puts_the_binary_back_for_its_del() {
    if !root_or_skip("an_add_that_raced_the_uninstall_puts_the_binary_back_for_its_del") {
        return;
    }
    let c = conf("1.0.0", json!({}));
    let state = state_of(&c);
    std::fs::create_dir_all(&state).unwrap();
    let dir = std::env::temp_dir().join(format!("aether-race-bin-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let binary = dir.join("aether-cni");
    std::fs::copy(bin(), &binary).unwrap();
    let ns = TestNetns::new("uninstrace");

    // The uninstall's last DEL holds the exclusive lock while it removes the binary.
    let lock =
        std::fs::OpenOptions::new().read(true).write(true).create(true).open(Path::new(&state).join("lock")).unwrap();
    assert_eq!(unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) }, 0);
    let add = run_copy(&binary, "ADD", &ns.path(), &c);
    std::thread::sleep(std::time::Duration::from_millis(300)); // the ADD is waiting for the lock
    std::fs::remove_file(&binary).unwrap();
    drop(lock);
    let out = add.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "ADD: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(binary.exists(), "the ADD left its pod without the plugin its DEL runs");
    let uninstalled = Path::new(&state).join("uninstalled");
    assert!(uninstalled.exists(), "the binary put back without the word that the last DEL removes it");

    // The pod's DEL, the last: the binary goes with it.
    let del = run_copy(&binary, "DEL", &ns.path(), &c).wait_with_output().unwrap();
    assert!(del.status.success(), "DEL: {}", String::from_utf8_lossy(&del.stdout));
    assert!(!binary.exists() && !uninstalled.exists(), "the last DEL left the binary or the word");

    // Control: no uninstall under way, an ADD from a binary removed after it finished puts
    // nothing back.
    std::fs::copy(bin(), &binary).unwrap();
    let out = run_copy(&binary, "ADD", &ns.path(), &c).wait_with_output().unwrap();
    assert!(out.status.success());
    std::fs::remove_file(&binary).unwrap();
    assert!(!binary.exists() && !uninstalled.exists());
    let del = run_plugin("DEL", Some(&ns.path()), &c, &as_ctr("ctr-race"));
    assert!(del.ok, "{}", del.stdout);
    let _ = std::fs::remove_dir_all(&dir);
}
