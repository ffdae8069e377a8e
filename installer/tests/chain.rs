//! Chaining onto realistic primary configurations: each result a golden file (reviewed by
//! hand), installing twice changes nothing, uninstall restores the directory byte for byte,
//! bad input names what is wrong and leaves nothing half-written.

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::sync::Arc;

use aether_installer::error::Reason;
use aether_installer::serve::Shared;
use aether_installer::Node;
use common::{snapshot, FakeNode, Switches};

const CASES: [&str; 8] = [
    "10-flannel.conflist",
    "10-calico.conflist",
    "05-cilium.conflist",
    "10-kindnet.conflist",
    "10-aws.conflist",
    "10-bridge.conf",
    "20-unknown-fields.conflist",
    "10-truncated.conflist",
];

fn node(fake: &FakeNode, extra: &[&str]) -> (Node, Arc<Shared>) {
    let shared = Arc::new(Shared::new());
    let n = Node::new(
        fake.args(extra),
        Arc::new(common::plugin(&Switches::default())),
        shared.clone(),
        b"#!aether\n".to_vec(),
    );
    n.preflight().unwrap();
    (n, shared)
}

fn reasons(shared: &Shared) -> String {
    shared.status.lock().unwrap().describe()
}

#[test]
fn each_primary_chains_to_its_golden_file_and_uninstall_restores_the_directory() {
    for name in CASES {
        let fake = FakeNode::new(&format!("golden-{name}"));
        let primary = fake.put_primary(name);
        let before = snapshot(&fake.conf);
        let (mut node, shared) = node(
            &fake,
            &["--capture-mode=scoped", "--exclude-outbound-cidrs=10.0.0.0/24", "--exclude-outbound-ports=22,9000-9100"],
        );
        node.reconcile_all();
        let golden = format!("install/{name}.chained");
        match fs::read_to_string(fake.chained()) {
            Ok(text) => {
                aether_testkit::assert_golden(&golden, &text.replace(&fake.root.display().to_string(), "<node>"));
                assert!(reasons(&shared).is_empty(), "{name}: {}", reasons(&shared));
                assert_eq!(fake.marker(), None, "{name}: ready, so no marker");
            }
            Err(_) => {
                let why = reasons(&shared).replace(&fake.root.display().to_string(), "<node>");
                aether_testkit::assert_golden(&format!("install/{name}.refused"), &why);
                assert!(fake.marker().is_some_and(|m| m.contains(name)), "{name}: the marker names the file");
            }
        }
        assert_eq!(
            fs::read(&primary).unwrap(),
            fs::read(common::primaries().join(name)).unwrap(),
            "{name}: primary untouched"
        );

        // Twice: nothing is rewritten (same inode, same mtime), metrics count one install.
        let first = fs::metadata(fake.chained()).ok().map(|m| (m.ino(), m.mtime_nsec(), m.mtime()));
        node.reconcile_all();
        assert_eq!(fs::metadata(fake.chained()).ok().map(|m| (m.ino(), m.mtime_nsec(), m.mtime())), first, "{name}");
        let installs = shared.metrics.installs.with_label_values(&["conflist"]).get();
        assert_eq!(installs, u64::from(first.is_some()), "{name}");
        assert_eq!(shared.metrics.repairs.with_label_values(&["conflist"]).get(), 0, "{name}");

        node.uninstall().unwrap();
        assert_eq!(snapshot(&fake.conf), before, "{name}: uninstall restores the conf directory byte for byte");
        assert!(snapshot(&fake.bin).is_empty(), "{name}: binary removed");
        assert!(fake.marker().unwrap().contains("uninstalled"));
    }
}

#[test]
fn a_second_run_over_an_existing_install_changes_nothing() {
    let fake = FakeNode::new("twice");
    fake.put_primary("10-calico.conflist");
    let (mut a, _) = node(&fake, &[]);
    a.reconcile_all();
    let conf = snapshot(&fake.conf);
    let bin_meta = fs::metadata(fake.bin.join("aether-cni")).unwrap();
    // A new installer process (a restarted pod) over the same node.
    let (mut b, shared) = node(&fake, &[]);
    b.reconcile_all();
    assert_eq!(snapshot(&fake.conf), conf);
    let again = fs::metadata(fake.bin.join("aether-cni")).unwrap();
    assert_eq!((again.ino(), again.mtime_nsec()), (bin_meta.ino(), bin_meta.mtime_nsec()), "binary not rewritten");
    assert_eq!(shared.metrics.installs.with_label_values(&["binary"]).get(), 0);
    assert_eq!(shared.metrics.installs.with_label_values(&["conflist"]).get(), 0);
}

#[test]
fn the_primary_mode_is_kept_and_the_binary_is_executable() {
    let fake = FakeNode::new("mode");
    let p = fake.put_primary("10-flannel.conflist");
    fs::set_permissions(&p, fs::Permissions::from_mode(0o600)).unwrap();
    let (mut n, _) = node(&fake, &[]);
    n.reconcile_all();
    assert_eq!(fs::metadata(fake.chained()).unwrap().permissions().mode() & 0o7777, 0o600);
    assert_eq!(fs::metadata(fake.bin.join("aether-cni")).unwrap().permissions().mode() & 0o7777, 0o755);
}

#[test]
fn a_conf_is_chained_as_a_list_with_the_plugin_unchanged() {
    let fake = FakeNode::new("conf");
    fake.put_primary("10-bridge.conf");
    let (mut n, _) = node(&fake, &[]);
    n.reconcile_all();
    let list: serde_json::Value = serde_json::from_slice(&fs::read(fake.chained()).unwrap()).unwrap();
    let conf: serde_json::Value =
        serde_json::from_slice(&fs::read(common::primaries().join("10-bridge.conf")).unwrap()).unwrap();
    assert_eq!(list["plugins"][0], conf, "the .conf is the list's first plugin, as libcni's ConfListFromConf makes it");
    assert_eq!((&list["name"], &list["cniVersion"]), (&conf["name"], &conf["cniVersion"]));
    assert_eq!(list["plugins"][1]["type"], "aether-cni");
}

/// Bad primaries: each named in the not-ready reason, nothing written in the conf dir.
#[test]
fn a_primary_that_is_a_directory_or_a_dangling_symlink_is_named_and_nothing_is_written() {
    type Setup = fn(&FakeNode) -> &'static str;
    let cases: [(Setup, &str); 4] = [
        (
            |f| {
                fs::create_dir(f.conf.join("10-dir.conflist")).unwrap();
                "10-dir.conflist is a directory"
            },
            "dir",
        ),
        (
            |f| {
                std::os::unix::fs::symlink(f.root.join("nowhere.conflist"), f.conf.join("10-link.conflist")).unwrap();
                "10-link.conflist is a symlink to"
            },
            "dangling",
        ),
        (|_| "no CNI network configuration", "empty"),
        (
            |f| {
                fs::write(f.conf.join("00-aaa.conflist"), b"{}").unwrap();
                "00-aaa.conflist sorts before 00-aether-cni.conflist"
            },
            "outranked",
        ),
    ];
    for (setup, tag) in cases {
        let fake = FakeNode::new(&format!("bad-{tag}"));
        let want = setup(&fake);
        let before = snapshot(&fake.conf);
        let (mut n, shared) = node(&fake, &[]);
        n.reconcile_all();
        let status = reasons(&shared);
        assert!(status.starts_with("primary: ") && status.contains(want), "{tag}: {status}");
        assert!(shared.status.lock().unwrap().not_ready.contains_key(&Reason::Primary));
        assert_eq!(snapshot(&fake.conf), before, "{tag}: nothing written in the conf dir");
        assert!(fake.marker().unwrap().contains(want), "{tag}: the marker names it");
    }
}

#[test]
fn an_entry_the_plugin_refuses_is_not_written_and_the_reason_says_why() {
    let fake = FakeNode::new("refused");
    fake.put_primary("10-flannel.conflist");
    let sw = Switches::default();
    sw.refuse_entry.store(true, std::sync::atomic::Ordering::SeqCst);
    let shared = Arc::new(Shared::new());
    let mut n = Node::new(fake.args(&[]), Arc::new(common::plugin(&sw)), shared.clone(), b"x".to_vec());
    n.reconcile_all();
    let status = reasons(&shared);
    assert!(
        status.starts_with("entry: ") && status.contains("10-flannel.conflist") && status.contains("0.3.1"),
        "{status}"
    );
    assert!(!fake.chained().exists());
}

// Unwritable directories: cni-plugin/tests/install.rs mounts them read-only (root ignores
// permission bits, so only a read-only mount makes a directory unwritable for the installer).

#[test]
fn the_main_cnis_members_and_plugins_are_copied_as_written() {
    let fake = FakeNode::new("verbatim");
    // Numbers no f64/u64 holds exactly, a spelling of 1.5, key order, odd spacing.
    let plugin = r#"{ "type": "vendor",  "big": 18446744073709551616, "ratio": 1.50, "z": 1, "a": 2 }"#;
    let text = format!(
        "{{\"zeta\": [1,  2], \"cniVersion\": \"1.0.0\", \"name\": \"v\",\n \"plugins\": [{plugin}], \"alpha\": 1e3}}"
    );
    fs::write(fake.conf.join("10-vendor.conflist"), &text).unwrap();
    let (mut n, _) = node(&fake, &[]);
    n.reconcile_all();
    let out = fs::read_to_string(fake.chained()).unwrap();
    assert!(out.contains(plugin), "the plugin byte for byte:\n{out}");
    let order: Vec<usize> = ["\"zeta\": [1,  2]", "\"cniVersion\"", "\"name\"", "\"plugins\"", "\"alpha\": 1e3"]
        .iter()
        .map(|k| out.find(k).unwrap())
        .collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "members in their order:\n{out}");
}

/// `/readyz` (the shared status) serves what was published, after the marker CNI STATUS
/// reads: a pass that finds the node changed says nothing of it until it publishes, and then
/// says the same in both places.
#[test]
fn readyz_says_what_the_marker_says_between_publishes() {
    let fake = FakeNode::new("published");
    let (mut n, shared) = node(&fake, &[]);
    // No primary yet: not ready, in both places.
    n.reconcile_all();
    assert!(fake.marker().is_some_and(|m| m.contains("primary")), "{:?}", fake.marker());
    assert!(reasons(&shared).contains("primary"), "{}", reasons(&shared));
    // The primary comes: the pass finds the node ready, and neither place says so before it
    // publishes.
    fake.put_primary("10-flannel.conflist");
    n.reconcile_conflist(None);
    assert!(fake.marker().is_some(), "the marker went before the publish");
    assert!(reasons(&shared).contains("primary"), "/readyz went ready before the marker: {}", reasons(&shared));
    n.publish();
    assert_eq!((fake.marker(), reasons(&shared)), (None, String::new()));
    // The primary goes: not ready, again in both places at the publish only.
    fs::remove_file(fake.conf.join("10-flannel.conflist")).unwrap();
    n.reconcile_conflist(None);
    assert_eq!(fake.marker(), None, "the marker came before the publish");
    assert_eq!(reasons(&shared), "", "/readyz said not ready while CNI STATUS (the marker) said ready");
    n.publish();
    assert!(fake.marker().is_some_and(|m| m.contains("primary")), "{:?}", fake.marker());
    assert!(reasons(&shared).contains("primary"), "{}", reasons(&shared));
}
