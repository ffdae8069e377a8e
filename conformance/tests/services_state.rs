//! The Service layer's node state when it is damaged: pods keep starting, the agent can
//! always recover, and node totals are never silently reset.

mod common;

use aether_testkit::{root_or_skip, TestNetns};
use common::{conf, run_plugin};
use serde_json::json;

fn services(state: &str, args: &[&str], stdin: &[u8]) -> (bool, String) {
    let args: Vec<&str> = ["services", "--state-dir", state].iter().chain(args).copied().collect();
    let out = aether_conformance::cni::run_cli_here(&args, stdin);
    (out.ok, format!("{}{}", out.stdout, out.stderr))
}

fn snapshot(generation: u64) -> Vec<u8> {
    serde_json::to_vec(&json!({"generation": generation, "mode": "count", "serviceRanges": ["10.96.0.0/16"],
        "services": [{"namespace": "shop", "name": "cart", "vip": "10.96.1.1",
            "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": true}]}))
    .unwrap()
}

fn has_layer(ns: &TestNetns) -> bool {
    ns.exec("nft", &["list", "tables"]).contains("aether_services")
}

#[test]
fn a_damaged_stored_snapshot_neither_blocks_pods_nor_the_agent() {
    if !root_or_skip("a_damaged_stored_snapshot_neither_blocks_pods_nor_the_agent") {
        return;
    }
    let c = conf("1.0.0", json!({}));
    let state = c["stateDir"].as_str().unwrap().to_string();
    assert!(services(&state, &["apply"], &snapshot(5)).0);
    // Both stored forms damaged: the JSON as the agent sent it, and `layer.bin`, the one ADD
    // loads.
    std::fs::write(std::path::Path::new(&state).join("services/snapshot.json"), b"{\"generation\": 5, \"mode\": \"enf")
        .unwrap();
    let bin = std::path::Path::new(&state).join("services/layer.bin");
    let mut bytes = std::fs::read(&bin).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&bin, bytes).unwrap();
    // A pod still starts (without the layer), with the reason in the log.
    let ns = TestNetns::new("dmg");
    let add = run_plugin("ADD", Some(&ns.path()), &c, &[]);
    assert!(add.ok, "{}", add.stdout);
    assert!(add.stderr.contains("starts without the Service layer"), "{}", add.stderr);
    assert!(!has_layer(&ns));
    // The agent's next snapshot replaces the damaged one and reaches the pod.
    let (ok, report) = services(&state, &["apply"], &snapshot(3));
    assert!(ok, "{report}");
    assert!(report.contains("replaced by this snapshot"), "{report}");
    assert!(has_layer(&ns), "the apply reached the pod through its record");
}

#[test]
fn a_damaged_accumulator_is_reported_never_reset() {
    if !root_or_skip("a_damaged_accumulator_is_reported_never_reset") {
        return;
    }
    let c = conf("1.0.0", json!({}));
    let state = c["stateDir"].as_str().unwrap().to_string();
    assert!(services(&state, &["apply"], &snapshot(1)).0);
    let ns = TestNetns::new("acc");
    assert!(run_plugin("ADD", Some(&ns.path()), &c, &[]).ok);
    let acc = std::path::Path::new(&state).join("services/accumulator.json");
    std::fs::write(&acc, b"{\"service\": 12").unwrap();
    let (ok, text) = services(&state, &["counters"], b"");
    assert!(!ok && text.contains("accumulator.json is unreadable"), "{text}");
    // DEL still succeeds, says why the counts were not folded, and leaves the file alone.
    let del = run_plugin("DEL", Some(&ns.path()), &c, &[]);
    assert!(del.ok, "{}", del.stdout);
    assert!(del.stderr.contains("are lost"), "{}", del.stderr);
    assert_eq!(std::fs::read(&acc).unwrap(), b"{\"service\": 12");
    assert!(!has_layer(&ns));
}

/// `n` Services of one TCP port each (one port profile), in 10.96.0.0/16.
fn many(generation: u64, n: usize) -> Vec<u8> {
    let services: Vec<_> = (0..n)
        .map(|i| {
            json!({"namespace": "shop", "name": format!("s{i}"), "vip": format!("10.96.{}.{}", 1 + i / 250, 1 + i % 250),
                "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": true})
        })
        .collect();
    serde_json::to_vec(&json!({"generation": generation, "mode": "refuse", "serviceRanges": ["10.96.0.0/16"],
        "services": services}))
    .unwrap()
}

/// Whether anyone holds the pod's netns lock now (a non-blocking try of the same `flock`).
fn pod_locked(pod: &aether_conformance::node::Pod) -> bool {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(pod.path()).unwrap();
    // SAFETY: flock on a file held open here; released by the close if taken.
    let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    r != 0
}

#[test]
fn a_large_service_layer_is_built_after_adds_answer_under_the_pods_lock() {
    if !root_or_skip("a_large_service_layer_is_built_after_adds_answer_under_the_pods_lock") {
        return;
    }
    let bin = aether_conformance::cni::cni_bin();
    let slow = [("AETHER_CNI_INJECT_LAYER_DELAY_MS", "2000")];
    let mut node = aether_conformance::node::SimNode::new("after");
    let (small, large, gone) = (node.add_pod("small"), node.add_pod("large"), node.add_pod("gone"));
    let layer = |p: &aether_conformance::node::Pod| p.nft(&["list", "tables"]).contains("aether_services");
    let layer_bin = node.state_dir().join("services/layer.bin");

    // Control: a small stored layer is built before the answer, so the delay asked for is
    // never taken, and the pod holds its layer and no lock when ADD answers.
    assert!(node.services(&["apply"], &many(1, 100)).ok);
    assert!(std::fs::metadata(&layer_bin).unwrap().len() < 16 * 1024, "the control's layer is below the size");
    let out = small.cni_unsettled(bin, "ADD", &small.conf(json!({})), &slow);
    assert!(out.ok, "{}{}", out.stdout, out.stderr);
    assert!(layer(&small) && !pod_locked(&small), "a small layer is whole when ADD answers");

    // At the size: ADD answers with the capture in and the layer still to come, the pod's lock
    // held by the process building it (the runtime's pipes released: the answer came first).
    assert!(node.services(&["apply"], &many(2, 4000)).ok);
    assert!(std::fs::metadata(&layer_bin).unwrap().len() >= 16 * 1024, "the stored layer is at the size");
    let conf = large.conf(json!({}));
    let out = large.cni_unsettled(bin, "ADD", &conf, &slow);
    assert!(out.ok, "{}{}", out.stdout, out.stderr);
    assert_eq!(out.json()["ips"], conf["prevResult"]["ips"], "the answer passes prevResult through");
    assert!(large.nft(&["list", "tables"]).contains("aether_capture"), "the capture is in before the answer");
    assert!(!layer(&large), "the layer is built after the answer");
    assert!(pod_locked(&large), "the pod's lock is held while its layer is built");
    // `services verify` waits for it, then finds it whole.
    let verify = node.services(&["verify"], b"");
    assert!(verify.ok, "{}{}", verify.stdout, verify.stderr);
    assert!(!pod_locked(&large) && layer(&large));
    assert!(
        !verify.stdout.contains("repaired"),
        "verify waited for the layer, found nothing to repair: {}",
        verify.stdout
    );
    // The ADD's line, and the child's own once the layer is whole.
    let log = std::fs::read_to_string(node.state_dir().join("aether-cni.log")).unwrap();
    let built = log.lines().filter(|l| l.contains("the Service layer is built") && !l.contains("after the answer"));
    assert!(log.contains("the Service layer is built after the answer") && built.count() == 1, "{log}");
    let vips = large.nft(&["list", "map", "ip", "aether_services", "service_vips"]);
    assert!(vips.contains("10.96.16.250") && vips.contains("10.96.1.1"), "every Service's element");

    // A DEL that comes while the layer is being built waits for it, then removes all of it.
    let conf = gone.conf(json!({}));
    assert!(gone.cni_unsettled(bin, "ADD", &conf, &slow).ok);
    assert!(pod_locked(&gone));
    // `inspect` meanwhile waits for the layer, then finds every pod's whole.
    let dir = node.state_dir().display().to_string();
    let inspect = aether_conformance::cni::run_cli_here(&["inspect", "--state-dir", &dir], b"");
    assert!(inspect.ok && !pod_locked(&gone), "{}{}", inspect.stdout, inspect.stderr);
    assert_eq!(inspect.stdout.matches("intact (generation 2)").count(), 3, "{}", inspect.stdout);
    let del = gone.cni_unsettled(bin, "DEL", &conf, &[]);
    assert!(del.ok, "{}{}", del.stdout, del.stderr);
    let tables = gone.nft(&["list", "tables"]);
    assert!(!tables.contains("aether_capture") && !tables.contains("aether_services"), "nothing left: {tables}");
}

/// An ADD that comes to a netns already holding a layer (the runtime's ADD again, after it
/// lost the first one's answer) reads the names its tables carry, then rebuilds from them. An
/// apply that changes the pod between the two (it sends an element change without the pod's
/// lock, which ADD holds) makes the kernel refuse the rebuild whole, and ADD brings the pod
/// again from what it holds now. The apply waits for nothing of ADD's.
#[test]
fn an_add_whose_reading_an_apply_moved_brings_the_pod_from_what_it_holds_now() {
    if !root_or_skip("an_add_whose_reading_an_apply_moved_brings_the_pod_from_what_it_holds_now") {
        return;
    }
    let bin = aether_conformance::cni::cni_bin();
    let mut node = aether_conformance::node::SimNode::new("moved");
    let pod = node.add_pod("again");
    assert!(node.services(&["apply"], &many(1, 10)).ok);
    let conf = pod.add(json!({}));
    let vips = || pod.nft(&["list", "map", "ip", "aether_services", "service_vips"]);
    assert!(vips().contains("10.96.1.10") && !vips().contains("10.96.1.11"));

    // ADD again, held between its reading of the layer there and its rebuild.
    let pause = node.state_dir().join("add-paused");
    let pause_str = pause.display().to_string();
    let held = [("AETHER_CNI_PAUSE_AT", "services-rebuild-read"), ("AETHER_CNI_PAUSE_FILE", pause_str.as_str())];
    let (add, applied, add_waited) = std::thread::scope(|s| {
        let add = s.spawn(|| pod.cni_unsettled(bin, "ADD", &conf, &held));
        wait_for("ADD never reached its reading", &|| {
            assert!(!add.is_finished(), "ADD never reached its reading");
            pause.exists()
        });
        // Generation 2 (a Service added) meanwhile.
        let applied = node.services(&["apply"], &many(2, 11));
        // ADD is still held where it was (until the file goes): the apply did not wait for it.
        let add_waited = !add.is_finished() && pause.exists();
        std::fs::remove_file(&pause).unwrap();
        (add.join().unwrap(), applied, add_waited)
    });
    assert!(applied.ok, "{}{}", applied.stdout, applied.stderr);
    assert!(add_waited, "the apply waited for the ADD it raced: {}", applied.stdout);
    assert!(add.ok, "ADD again: {}{}", add.stdout, add.stderr);
    let log = std::fs::read_to_string(node.state_dir().join("aether-cni.log")).unwrap();
    let refused = "changed since it was read (an apply came first): brought again from what it holds now";
    assert_eq!(log.matches(refused).count(), 1, "ADD's rebuild was refused once: {log}");
    assert!(log.contains("named=generation 1 "), "{log}");

    // The pod holds generation 2, whole (ADD found it so: nothing sent again).
    assert!(vips().contains("10.96.1.11"));
    let dir = node.state_dir().display().to_string();
    let inspect = aether_conformance::cni::run_cli_here(&["inspect", "--state-dir", &dir], b"");
    assert!(inspect.ok, "{}{}", inspect.stdout, inspect.stderr);
    assert_eq!(inspect.stdout.matches("intact (generation 2)").count(), 1, "{}", inspect.stdout);
    let verify = node.services(&["verify"], b"");
    assert!(verify.ok && !verify.stdout.contains("repaired"), "{}{}", verify.stdout, verify.stderr);
    pod.del(&conf);
}

/// Waits until `done`, 30 s at most, then fails saying `what`.
fn wait_for(what: &str, done: &dyn Fn() -> bool) {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !done() {
        assert!(std::time::Instant::now() < until, "{what}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Whether a lock request on the file at `path` waits now (`/proc/locks` marks a blocked
/// request with `->`, and names the file by device and inode).
fn lock_waited_on(path: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let ino = std::fs::metadata(path).unwrap().ino().to_string();
    std::fs::read_to_string("/proc/locks").unwrap().lines().any(|l| {
        l.contains("->")
            && l.split_whitespace().any(|f| f.matches(':').count() == 2 && f.rsplit(':').next() == Some(&ino))
    })
}

/// Layers built after ADDs' answers take turns for the node's build slots (one here, as on a
/// node of 2 CPUs): while the first pod's build holds the slot, a second pod's ADD answers
/// with its capture in, and its build waits (a blocked lock request, seen in /proc/locks);
/// once the first lets go, the second is built, and both are whole.
#[test]
fn layers_built_after_adds_answers_take_turns_for_the_nodes_build_slots() {
    if !root_or_skip("layers_built_after_adds_answers_take_turns_for_the_nodes_build_slots") {
        return;
    }
    let bin = aether_conformance::cni::cni_bin();
    let mut node = aether_conformance::node::SimNode::new("slots");
    let (first, second) = (node.add_pod("first"), node.add_pod("second"));
    let layer = |p: &aether_conformance::node::Pod| p.nft(&["list", "tables"]).contains("aether_services");
    // At the size that is built after the answer.
    assert!(node.services(&["apply"], &many(1, 4000)).ok);
    let pause = node.state_dir().join("slot-held");
    let pause_str = pause.display().to_string();
    let one = ("AETHER_CNI_LAYER_BUILD_SLOTS", "1");
    let held = [one, ("AETHER_CNI_PAUSE_AT", "layer-build-slot"), ("AETHER_CNI_PAUSE_FILE", pause_str.as_str())];
    let (first_conf, second_conf) = (first.conf(json!({})), second.conf(json!({})));

    let out = first.cni_unsettled(bin, "ADD", &first_conf, &held);
    assert!(out.ok, "{}{}", out.stdout, out.stderr);
    wait_for("the first pod's build never took the slot", &|| pause.exists());
    let out = second.cni_unsettled(bin, "ADD", &second_conf, &[one]);
    assert!(out.ok, "{}{}", out.stdout, out.stderr);
    assert!(second.nft(&["list", "tables"]).contains("aether_capture"), "the second pod's start waited for no build");
    // (The slots' file, as the node library names it: `BUILD_SLOTS_FILE`.)
    let slots = node.state_dir().join("layer-builds");
    wait_for("the second pod's build never waited for the slot", &|| lock_waited_on(&slots));
    assert!(!layer(&second) && pod_locked(&second), "the second layer waits, under its pod's lock");
    assert!(!layer(&first) && pod_locked(&first), "the first holds the slot, paused before its build");

    std::fs::remove_file(&pause).unwrap();
    wait_for("the builds never ended", &|| !pod_locked(&first) && !pod_locked(&second));
    assert!(layer(&first) && layer(&second), "both layers built");
    let dir = node.state_dir().display().to_string();
    let inspect = aether_conformance::cni::run_cli_here(&["inspect", "--state-dir", &dir], b"");
    assert!(inspect.ok, "{}{}", inspect.stdout, inspect.stderr);
    assert_eq!(inspect.stdout.matches("intact (generation 1)").count(), 2, "{}", inspect.stdout);
    for (pod, conf) in [(&first, &first_conf), (&second, &second_conf)] {
        let del = pod.cni_unsettled(bin, "DEL", conf, &[]);
        assert!(del.ok, "{}{}", del.stdout, del.stderr);
    }
}

/// DEL answers once the capture and the layer are out of the pod's ruleset, without waiting
/// for the kernel to free them (the last close of the sockets that deleted them waits for
/// that): a child of the plugin holds those sockets after the answer, and closes them last.
#[test]
fn dels_answer_does_not_wait_for_the_kernel_to_free_what_it_removed() {
    if !root_or_skip("dels_answer_does_not_wait_for_the_kernel_to_free_what_it_removed") {
        return;
    }
    let bin = aether_conformance::cni::cni_bin();
    let mut node = aether_conformance::node::SimNode::new("delclose");
    let pod = node.add_pod("leaving");
    // (A layer this small is built before ADD's answer.)
    assert!(node.services(&["apply"], &many(1, 200)).ok);
    let conf = pod.add(json!({}));
    assert!(pod.nft(&["list", "tables"]).contains("aether_services"), "the pod has its layer");
    // The processes' netfilter sockets open in the pod's netns (`/proc/net/netlink`: protocol
    // 12, a port id other than the kernel's own 0).
    let netfilter_sockets = || {
        let list = pod.ns.exec("cat", &["/proc/net/netlink"]);
        list.lines()
            .skip(1)
            .filter(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.get(1) == Some(&"12") && f.get(2) != Some(&"0")
            })
            .count()
    };
    assert_eq!(netfilter_sockets(), 0, "a netfilter socket is open in the pod before its DEL");

    let pause = node.state_dir().join("closing-held");
    let pause_str = pause.display().to_string();
    let held = [("AETHER_CNI_PAUSE_AT", "del-sockets-closing"), ("AETHER_CNI_PAUSE_FILE", pause_str.as_str())];
    let out = pod.cni_unsettled(bin, "DEL", &conf, &held);
    assert!(out.ok, "{}{}", out.stdout, out.stderr);
    let tables = pod.nft(&["list", "tables"]);
    assert!(!tables.contains("aether_"), "DEL answered with its tables still in the ruleset:\n{tables}");
    wait_for("no child held DEL's sockets after its answer", &|| pause.exists());
    assert!(netfilter_sockets() > 0, "DEL's sockets were closed before its answer");

    std::fs::remove_file(&pause).unwrap();
    wait_for("DEL's child never closed its sockets", &|| netfilter_sockets() == 0);
}
