//! The installer running: its HTTP face (/readyz naming each cause, /metrics parsed by an
//! independent parser), repairs after another CNI rewrites, replaces or renames its file,
//! concurrent readers, and stopping (uninstall, or upgrade keeping the files).

mod common;

use std::fs;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_installer::{start, Running};
use common::{fake_binary, snapshot, FakeNode, Switches};

/// A plain HTTP/1.0 GET (test client): status code and body.
fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    aether_testkit::http::get(addr, path).unwrap_or_else(|| panic!("nothing answers GET {path} on {addr}"))
}

/// Waits (up to 10 s) for `cond`; panics with `what` and the last /readyz body.
fn wait_for(r: &Running, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        if Instant::now() > deadline {
            panic!("timed out waiting for {what}; /readyz says: {:?}", get(r.addr(), "/readyz"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn readyz(r: &Running) -> (u16, String) {
    get(r.addr(), "/readyz")
}

/// The chained file is the current primary plus the entry, as a fresh chain would make it.
fn chained_matches(fake: &FakeNode, primary: &str) -> bool {
    let (Ok(c), Ok(p)) = (fs::read(fake.chained()), fs::read(fake.conf.join(primary))) else { return false };
    let (Ok(c), Ok(p)) =
        (serde_json::from_slice::<serde_json::Value>(&c), serde_json::from_slice::<serde_json::Value>(&p))
    else {
        return false;
    };
    let (Some(plugins), Some(theirs)) = (c["plugins"].as_array(), p["plugins"].as_array()) else { return false };
    plugins.last().is_some_and(|e| e["type"] == "aether-cni")
        && plugins[..plugins.len() - 1] == theirs[..]
        && c["name"] == p["name"]
}

/// Replaces a file the way careful installers do (temp file + rename): one event, no
/// moment where the file is empty.
fn replace(path: &std::path::Path, body: &[u8]) {
    let tmp = path.with_extension("tmp-replace");
    fs::write(&tmp, body).unwrap();
    fs::rename(&tmp, path).unwrap();
}

fn flannel_with(mtu: u32) -> String {
    format!(r#"{{"name":"cbr0","cniVersion":"1.0.0","plugins":[{{"type":"flannel","delegate":{{"mtu":{mtu}}}}}]}}"#)
}

#[test]
fn readyz_names_each_not_ready_cause_and_the_marker_follows() {
    let fake = FakeNode::new("readyz");
    let sw = Switches::default();
    sw.kernel_fails.store(true, Ordering::SeqCst);
    sw.refuse_entry.store(true, Ordering::SeqCst);
    let r = start(fake.args(&["--resync-seconds=1"]), common::plugin(&sw), fake_binary(4096, 1)).unwrap();
    assert_eq!(get(r.addr(), "/healthz"), (200, "ok\n".into()));
    wait_for(&r, "no primary and the kernel named", || {
        let (code, body) = readyz(&r);
        code == 503
            && body.contains("primary: no CNI network configuration")
            && body.contains("kernel: kernel checks failed: programmed, but read back differently: nft_tproxy")
            && fake.marker().is_some_and(|m| m.contains("no CNI network configuration") && m.contains("nft_tproxy"))
    });

    sw.kernel_fails.store(false, Ordering::SeqCst);
    wait_for(&r, "kernel checks retried on resync", || !readyz(&r).1.contains("kernel:"));

    fs::write(fake.conf.join("10-flannel.conflist"), flannel_with(1450)).unwrap();
    wait_for(&r, "the refused entry named", || readyz(&r).1.contains("entry: the aether-cni entry chained onto"));
    assert!(!fake.chained().exists(), "a refused entry is never written");

    sw.refuse_entry.store(false, Ordering::SeqCst);
    fs::write(fake.conf.join("10-flannel.conflist"), flannel_with(1400)).unwrap();
    wait_for(&r, "ready, and the marker gone", || readyz(&r) == (200, "ready\n".into()) && fake.marker().is_none());

    // The binary's place taken by a directory: it cannot be written, and /readyz says so.
    // (The installer may put the file back between the two steps: then try again.)
    loop {
        let _ = fs::remove_file(fake.bin.join("aether-cni"));
        if fs::create_dir(fake.bin.join("aether-cni")).is_ok() {
            break;
        }
    }
    wait_for(&r, "the binary named, in /readyz and the marker", || {
        readyz(&r).1.contains("binary: cannot write")
            && fake.marker().is_some_and(|m| m.contains("binary: cannot write"))
    });
    fs::remove_dir(fake.bin.join("aether-cni")).unwrap();
    wait_for(&r, "ready again", || readyz(&r).0 == 200);

    // The chained file's place taken by a directory: the write fails, /readyz names it.
    loop {
        let _ = fs::remove_file(fake.chained());
        if fs::create_dir(fake.chained()).is_ok() {
            break;
        }
    }
    wait_for(&r, "the chain write named", || {
        readyz(&r).1.contains("chain: cannot write") && readyz(&r).1.contains("00-aether-cni.conflist")
    });
    fs::remove_dir(fake.chained()).unwrap();
    wait_for(&r, "ready once more", || readyz(&r).0 == 200 && fake.marker().is_none());
    r.stop().unwrap();
}

#[test]
fn metrics_parse_as_prometheus_text_and_count_installs_repairs_and_errors() {
    let fake = FakeNode::new("metrics");
    fs::write(fake.conf.join("10-flannel.conflist"), flannel_with(1450)).unwrap();
    let r = start(fake.args(&[]), common::plugin(&Switches::default()), fake_binary(4096, 2)).unwrap();
    wait_for(&r, "ready", || readyz(&r).0 == 200);
    replace(&fake.conf.join("10-flannel.conflist"), flannel_with(1400).as_bytes());
    wait_for(&r, "repaired", || {
        chained_matches(&fake, "10-flannel.conflist") && fs::read_to_string(fake.chained()).unwrap().contains("1400")
    });
    replace(&fake.conf.join("10-flannel.conflist"), b"{ not json");
    wait_for(&r, "invalid primary reported", || readyz(&r).1.contains("is invalid"));

    let (code, body) = get(r.addr(), "/metrics");
    assert_eq!(code, 200);
    let scrape = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).unwrap();
    let value = |name: &str, label: Option<(&str, &str)>| -> f64 {
        let s = scrape
            .samples
            .iter()
            .find(|s| s.metric == name && label.is_none_or(|(k, v)| s.labels.get(k) == Some(v)))
            .unwrap_or_else(|| panic!("{name} {label:?} missing from\n{body}"));
        match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => panic!("{name}: unexpected type"),
        }
    };
    assert_eq!(value("aether_cni_installer_installs_total", Some(("what", "conflist"))), 1.0);
    assert_eq!(value("aether_cni_installer_installs_total", Some(("what", "binary"))), 1.0);
    assert_eq!(value("aether_cni_installer_repairs_total", Some(("what", "conflist"))), 1.0);
    assert_eq!(value("aether_cni_installer_ready", None), 0.0);
    assert_eq!(value("aether_cni_installer_not_ready", Some(("reason", "primary"))), 1.0);
    assert_eq!(value("aether_cni_installer_not_ready", Some(("reason", "kernel"))), 0.0);
    assert_eq!(value("aether_cni_installer_errors_total", Some(("reason", "primary"))), 1.0);
    assert_eq!(value("aether_cni_installer_last_error", Some(("reason", "primary"))), 1.0);
    assert!(value("aether_cni_installer_last_error_timestamp_seconds", None) > 1.7e9);
    assert_eq!(value("aether_cni_service_connections_total", Some(("class", "mesh"))), 7.0, "node counters served");
    assert_eq!(value("aether_cni_installer_node_counters_up", None), 1.0);
    assert!(scrape.docs.contains_key("aether_cni_installer_repairs_total"), "HELP lines present");
    assert_eq!(get(r.addr(), "/nope").0, 404);
    r.stop().unwrap();
}

#[test]
fn another_cni_rewriting_replacing_or_renaming_its_file_is_repaired() {
    let fake = FakeNode::new("repair");
    fs::write(fake.conf.join("10-flannel.conflist"), flannel_with(1450)).unwrap();
    let r = start(fake.args(&[]), common::plugin(&Switches::default()), fake_binary(4096, 3)).unwrap();
    wait_for(&r, "chained", || chained_matches(&fake, "10-flannel.conflist"));

    // Rewritten in place (truncate + write, as many installers do).
    fs::write(fake.conf.join("10-flannel.conflist"), flannel_with(1300)).unwrap();
    wait_for(&r, "in-place rewrite repaired", || {
        fs::read_to_string(fake.chained()).unwrap_or_default().contains("1300")
    });
    // Replaced by a rename over it.
    fs::write(fake.conf.join(".tmp-flannel"), flannel_with(1200)).unwrap();
    fs::rename(fake.conf.join(".tmp-flannel"), fake.conf.join("10-flannel.conflist")).unwrap();
    wait_for(&r, "replacement repaired", || fs::read_to_string(fake.chained()).unwrap_or_default().contains("1200"));
    // Renamed: the primary is now another file.
    fs::rename(fake.conf.join("10-flannel.conflist"), fake.conf.join("20-flannel.conflist")).unwrap();
    wait_for(&r, "rename followed", || chained_matches(&fake, "20-flannel.conflist"));
    // Another CNI taking over with a file of its own that sorts first among the others.
    fs::write(
        fake.conf.join("05-other.conflist"),
        r#"{"name":"other","cniVersion":"1.1.0","plugins":[{"type":"other"}]}"#,
    )
    .unwrap();
    wait_for(&r, "new primary chained", || chained_matches(&fake, "05-other.conflist"));
    // The chained file itself removed or edited.
    fs::remove_file(fake.chained()).unwrap();
    wait_for(&r, "removal repaired", || chained_matches(&fake, "05-other.conflist"));
    fs::write(fake.chained(), b"{}").unwrap();
    wait_for(&r, "edit repaired", || chained_matches(&fake, "05-other.conflist"));
    // The binary replaced by something else.
    fs::write(fake.bin.join("aether-cni"), b"not ours").unwrap();
    wait_for(&r, "binary repaired", || fs::read(fake.bin.join("aether-cni")).unwrap() == fake_binary(4096, 3));
    // The main CNI uninstalled: no primary left, so no chained copy either.
    fs::remove_file(fake.conf.join("05-other.conflist")).unwrap();
    fs::remove_file(fake.conf.join("20-flannel.conflist")).unwrap();
    wait_for(&r, "chained copy withdrawn", || !fake.chained().exists() && readyz(&r).0 == 503);
    let m = &r.shared.metrics;
    // Five rewrites at least (the rename needs none: same content); a truncate-then-write
    // may add one (the copy is withdrawn while the primary is empty, then written back).
    assert!(
        m.repairs.with_label_values(&["conflist"]).get() >= 5,
        "{}",
        m.repairs.with_label_values(&["conflist"]).get()
    );
    assert_eq!(m.repairs.with_label_values(&["binary"]).get(), 1);
    assert!(m.repair_seconds.get_sample_count() >= 6);
    r.stop().unwrap();
}

/// Cilium with `cni.exclusive: true` renames every other configuration to `*.cilium_bak`:
/// the installer chains again and says which setting does it (the error metric, whose label
/// carries the message; a removal without such a file says nothing of the kind).
#[test]
fn the_chained_file_renamed_away_by_cilium_is_chained_again_and_the_setting_named() {
    let fake = FakeNode::new("exclusive");
    fs::write(
        fake.conf.join("05-cilium.conflist"),
        r#"{"name":"cilium","cniVersion":"1.0.0","plugins":[{"type":"cilium-cni"}]}"#,
    )
    .unwrap();
    let r = start(fake.args(&[]), common::plugin(&Switches::default()), fake_binary(4096, 4)).unwrap();
    wait_for(&r, "chained", || chained_matches(&fake, "05-cilium.conflist"));
    let chain_errors = || r.shared.metrics.errors.with_label_values(&["chain"]).get();
    // The control: removed outright, it is repaired and nothing is said of a rename.
    fs::remove_file(fake.chained()).unwrap();
    wait_for(&r, "removal repaired", || chained_matches(&fake, "05-cilium.conflist"));
    assert_eq!(chain_errors(), 0);
    // Renamed away as Cilium does it.
    let renamed = fake.conf.join(format!("{}.cilium_bak", fake.chained().file_name().unwrap().to_string_lossy()));
    fs::rename(fake.chained(), &renamed).unwrap();
    wait_for(&r, "chained again", || chained_matches(&fake, "05-cilium.conflist"));
    assert_eq!(chain_errors(), 1);
    let (_, metrics) = get(r.addr(), "/metrics");
    assert!(
        metrics.contains("cilium_bak by another CNI") && metrics.contains("set cni.exclusive=false"),
        "the setting is named:\n{metrics}"
    );
    r.stop().unwrap();
}

#[test]
fn a_concurrent_reader_never_sees_a_partial_binary_or_conflist() {
    let fake = FakeNode::new("reader");
    fs::write(fake.conf.join("10-flannel.conflist"), flannel_with(1000)).unwrap();
    let ours = fake_binary(1 << 20, 4);
    let r = start(fake.args(&[]), common::plugin(&Switches::default()), ours.clone()).unwrap();
    wait_for(&r, "chained", || chained_matches(&fake, "10-flannel.conflist"));
    let stop = Arc::new(AtomicBool::new(false));
    let (conf_path, bin_path) = (fake.chained(), fake.bin.join("aether-cni"));
    let reader = {
        let stop = stop.clone();
        let foreign = fake_binary(1 << 20, 5);
        std::thread::spawn(move || {
            let mut reads = (0, 0);
            while !stop.load(Ordering::SeqCst) {
                // The conflist: valid JSON with the entry last, or (between the main CNI's own
                // non-atomic writes) briefly absent; never partial.
                if let Ok(b) = fs::read(&conf_path) {
                    let v: serde_json::Value = serde_json::from_slice(&b)
                        .unwrap_or_else(|e| panic!("partial conflist ({e}): {}", String::from_utf8_lossy(&b)));
                    assert_eq!(v["plugins"].as_array().unwrap().last().unwrap()["type"], "aether-cni");
                    reads.0 += 1;
                }
                if let Ok(b) = fs::read(&bin_path) {
                    assert!(b == ours || b == foreign, "partial binary: {} bytes", b.len());
                    reads.1 += 1;
                }
            }
            reads
        })
    };
    for i in 0..15u32 {
        // Another CNI rewrites its file atomically; someone replaces the binary atomically.
        let tmp = fake.conf.join(".flannel.tmp");
        fs::write(&tmp, flannel_with(1001 + i)).unwrap();
        fs::rename(&tmp, fake.conf.join("10-flannel.conflist")).unwrap();
        let tmpb = fake.bin.join(".foreign.tmp");
        fs::write(&tmpb, fake_binary(1 << 20, 5)).unwrap();
        fs::rename(&tmpb, fake.bin.join("aether-cni")).unwrap();
        let want = format!("\"mtu\":{}", 1001 + i);
        wait_for(&r, "repair", || {
            fs::read_to_string(fake.chained()).unwrap_or_default().contains(&want)
                && fs::read(fake.bin.join("aether-cni")).is_ok_and(|b| b == fake_binary(1 << 20, 4))
        });
    }
    stop.store(true, Ordering::SeqCst);
    let (conf_reads, bin_reads) = reader.join().unwrap();
    assert!(
        conf_reads > 15 && bin_reads > 15,
        "the reader raced the writes: {conf_reads} conflist, {bin_reads} binary reads"
    );
    r.stop().unwrap();
}

#[test]
fn stopping_uninstalls_unless_it_is_an_upgrade() {
    for mode in ["uninstall", "flag", "file"] {
        let fake = FakeNode::new(&format!("stop-{mode}"));
        fs::write(fake.conf.join("10-flannel.conflist"), flannel_with(1450)).unwrap();
        let before = snapshot(&fake.conf);
        let extra: &[&str] = if mode == "flag" { &["--upgrade"] } else { &[] };
        let r = start(fake.args(extra), common::plugin(&Switches::default()), fake_binary(4096, 6)).unwrap();
        wait_for(&r, "ready", || readyz(&r).0 == 200);
        let installed = snapshot(&fake.conf);
        if mode == "file" {
            fs::write(fake.state.join(aether_installer::UPGRADE_FILE), b"").unwrap();
        }
        r.stop().unwrap();
        if mode == "uninstall" {
            assert_eq!(snapshot(&fake.conf), before, "the conf dir is byte for byte as before install");
            assert!(snapshot(&fake.bin).is_empty());
            assert!(fake.marker().unwrap().contains("uninstalled"));
        } else {
            assert_eq!(snapshot(&fake.conf), installed, "{mode}: an upgrade keeps the entry");
            assert_eq!(fs::read(fake.bin.join("aether-cni")).unwrap(), fake_binary(4096, 6), "{mode}: and the binary");
            assert_eq!(fake.marker(), None, "{mode}: pods keep working through an upgrade");
        }
    }
}

#[test]
fn a_bad_listen_address_fails_before_anything_is_installed() {
    let fake = FakeNode::new("listen");
    fs::write(fake.conf.join("10-flannel.conflist"), flannel_with(1450)).unwrap();
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = holder.local_addr().unwrap().to_string();
    let e =
        start(fake.args(&[&format!("--listen={taken}")]), common::plugin(&Switches::default()), vec![1]).err().unwrap();
    assert!(e.to_string().contains(&taken), "{e}");
    assert!(!fake.chained().exists() && snapshot(&fake.bin).is_empty());
}

#[test]
fn a_conf_directory_that_appears_later_is_watched_and_chained() {
    let fake = FakeNode::new("late-dir");
    fs::remove_dir(&fake.conf).unwrap();
    let r =
        start(fake.args(&["--resync-seconds=1"]), common::plugin(&Switches::default()), fake_binary(64, 7)).unwrap();
    wait_for(&r, "the missing directory named", || {
        let (code, body) = readyz(&r);
        code == 503 && body.contains("primary: CNI configuration directory") && body.contains("No such file")
    });
    fs::create_dir_all(&fake.conf).unwrap();
    fs::write(fake.conf.join("10-flannel.conflist"), flannel_with(1450)).unwrap();
    wait_for(&r, "chained once the directory exists", || chained_matches(&fake, "10-flannel.conflist"));
    // And kept chained from then on.
    replace(&fake.conf.join("10-flannel.conflist"), flannel_with(1451).as_bytes());
    wait_for(&r, "repaired", || fs::read_to_string(fake.chained()).unwrap_or_default().contains("1451"));
    r.stop().unwrap();
}

#[test]
fn probes_are_answered_while_a_slow_scrape_reads_the_node_counters() {
    let fake = FakeNode::new("slow-scrape");
    fs::write(fake.conf.join("10-flannel.conflist"), flannel_with(1450)).unwrap();
    let release = Arc::new(AtomicBool::new(false));
    let mut plugin = common::plugin(&Switches::default());
    let gate = release.clone();
    plugin.node_counters = Box::new(move || {
        // Held until the test has its /readyz answer (bounded, so a regression fails, not hangs).
        let deadline = Instant::now() + Duration::from_secs(10);
        while !gate.load(Ordering::SeqCst) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(String::new())
    });
    let r = start(fake.args(&[]), plugin, fake_binary(64, 8)).unwrap();
    wait_for(&r, "ready", || readyz(&r).0 == 200);
    let addr = r.addr();
    let scrape = std::thread::spawn(move || get(addr, "/metrics"));
    std::thread::sleep(Duration::from_millis(50)); // let the scrape reach the gate
    assert_eq!(readyz(&r).0, 200);
    assert!(!scrape.is_finished(), "the scrape is still held: /readyz was not queued behind it");
    release.store(true, Ordering::SeqCst);
    assert_eq!(scrape.join().unwrap().0, 200);
    r.stop().unwrap();
}

#[test]
fn concurrent_scrapes_share_one_reading_of_the_node_counters() {
    let fake = FakeNode::new("shared-scrape");
    fs::write(fake.conf.join("10-flannel.conflist"), flannel_with(1450)).unwrap();
    let readings = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut plugin = common::plugin(&Switches::default());
    let count = readings.clone();
    plugin.node_counters = Box::new(move || {
        count.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(300)); // a busy node's pods
        Ok("aether_cni_service_connections_total{class=\"mesh\"} 7\n".into())
    });
    let r = start(fake.args(&["--metrics-listen=127.0.0.1:0"]), plugin, fake_binary(64, 9)).unwrap();
    wait_for(&r, "ready", || readyz(&r).0 == 200);
    let metrics = r.metrics_addr().expect("a metrics listener");
    assert_eq!(get(metrics, "/healthz").0, 404, "the metrics listener serves /metrics only");
    let scrapes: Vec<_> = (0..32).map(|_| std::thread::spawn(move || get(metrics, "/metrics"))).collect();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(readyz(&r).0, 200);
    assert!(scrapes.iter().any(|s| !s.is_finished()), "/readyz answered while the scrapes still wait for the reading");
    for s in scrapes {
        let (code, body) = s.join().unwrap();
        assert_eq!(code, 200);
        assert!(body.contains("aether_cni_installer_node_counters_up 1"), "{body}");
    }
    let n = readings.load(Ordering::SeqCst);
    // The first reading, then at most one more for every scrape that came during it.
    assert!(n <= 2, "32 concurrent scrapes read the node counters {n} times");
    r.stop().unwrap();
}

/// An uninstall with a pod still attached (a record in the state directory): the conflist goes,
/// the binary stays for the pod's teardown, and `uninstalled` names it by device and inode
/// (the plugin's last DEL removes both: conformance/tests/containerd.rs). Control: the same
/// uninstall without a record removes the binary. A new install takes the binary over and
/// clears the word.
#[test]
fn an_uninstall_with_pods_attached_leaves_the_binary_for_their_teardown() {
    let fake = FakeNode::new("stop-pods");
    fs::write(fake.conf.join("10-flannel.conflist"), flannel_with(1450)).unwrap();
    let before = snapshot(&fake.conf);
    let r = start(fake.args(&[]), common::plugin(&Switches::default()), fake_binary(4096, 6)).unwrap();
    wait_for(&r, "ready", || readyz(&r).0 == 200);
    let record = fake.state.join("attachments/k8s-pod-network+ctr-1+eth0.json");
    fs::create_dir_all(record.parent().unwrap()).unwrap();
    fs::write(
        &record,
        br#"{"version":1,"network":"k8s-pod-network","containerId":"ctr-1","ifname":"eth0","netns":"/run/netns/x"}"#,
    )
    .unwrap();
    r.stop().unwrap();
    assert_eq!(snapshot(&fake.conf), before, "the conflist goes first, whatever is attached");
    let binary = fake.bin.join("aether-cni");
    assert_eq!(fs::read(&binary).unwrap(), fake_binary(4096, 6), "the binary went while a pod needs it");
    let word: serde_json::Value =
        serde_json::from_slice(&fs::read(fake.state.join(aether_node::state::UNINSTALLED_FILE)).unwrap()).unwrap();
    let meta = std::os::unix::fs::MetadataExt::ino(&fs::metadata(&binary).unwrap());
    assert_eq!(word["ino"], serde_json::json!(meta), "{word}");

    // Installed again: the binary is the installer's again, not the last DEL's to remove.
    let r = start(fake.args(&[]), common::plugin(&Switches::default()), fake_binary(4096, 6)).unwrap();
    wait_for(&r, "ready", || readyz(&r).0 == 200);
    assert!(!fake.state.join(aether_node::state::UNINSTALLED_FILE).exists(), "a new install kept the word");

    // Control: with no record left, the uninstall removes the binary.
    fs::remove_file(&record).unwrap();
    r.stop().unwrap();
    assert!(snapshot(&fake.bin).is_empty(), "no pod attached, and the binary stayed");
    assert!(!fake.state.join(aether_node::state::UNINSTALLED_FILE).exists());
}
