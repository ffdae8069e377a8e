use super::*;
use record::fnv1a;
use std::fs;
use std::fs::File;
use std::os::unix::fs::symlink;
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::Ordering;
use std::time::SystemTime;

fn rec(id: &str) -> Record {
    let mut capture = aether_rules::CaptureConfig::new(aether_rules::CaptureMode::Scoped);
    capture.rule_priority = 31000;
    Record {
        netns_id: Some(NetnsIdentity { dev: 4, ino: 4026532177, cookie: Some(4103) }),
        pod_name: Some("cart-0".into()),
        config_digest: config_digest(&capture),
        capture: Some(capture),
        ..Record::bare(id, "/run/netns/x")
    }
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("aether-state-{tag}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    d
}

#[test]
fn records_round_trip_and_removal_is_idempotent() {
    let d = tmpdir("rt");
    let s = StateDir::new(&d);
    s.write(&rec("a")).unwrap();
    s.write(&rec("b")).unwrap();
    assert_eq!(s.read("k8s-pod-network", "a", "eth0"), Ok(Some(rec("a"))));
    assert_eq!(s.records().len(), 2);
    s.remove("k8s-pod-network", "a", "eth0").unwrap();
    s.remove("k8s-pod-network", "a", "eth0").unwrap();
    assert_eq!(s.records(), vec![rec("b")]);
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn unreadable_records_are_reported_by_name_and_temp_files_ignored() {
    let d = tmpdir("torn");
    let s = StateDir::new(&d);
    s.write(&rec("a")).unwrap();
    fs::write(d.join("attachments/k8s+torn+eth0.json"), b"{\"network\": \"k8s\", \"contai").unwrap();
    fs::write(d.join("attachments/.k8s+b+eth0.json.tmp.123"), b"partial").unwrap();
    let scan = s.scan();
    assert_eq!(scan.records, vec![rec("a")]);
    assert_eq!(scan.unreadable.len(), 1, "{:?}", scan.unreadable);
    assert_eq!(scan.unreadable[0].file, "k8s+torn+eth0.json");
    assert!(scan.unreadable[0].why.contains("not JSON"), "{:?}", scan.unreadable);
    assert!(s.read("k8s", "torn", "eth0").is_err());
    fs::remove_dir_all(&d).unwrap();
}

/// A record an older plugin wrote (no version, no netns identity, a
/// capture field missing, an unknown field) is still read, the missing field defaulted
/// and named.
#[test]
fn an_older_record_is_read_with_defaults_and_a_newer_ones_extra_fields_ignored() {
    let mut v = serde_json::to_value(rec("a")).unwrap();
    let o = v.as_object_mut().unwrap();
    o.remove("version");
    o.remove("netnsId");
    o["capture"].as_object_mut().unwrap().remove("rulePriority");
    o.insert("addedByANewerRelease".into(), serde_json::json!({"x": 1}));
    let r = parse_record(v.to_string().as_bytes()).unwrap();
    assert_eq!(r.version, 0);
    assert_eq!(r.defaulted, ["rulePriority"]);
    assert_eq!(r.capture.as_ref().unwrap().rule_priority, aether_rules::capture::RULE_PRIORITY);
    assert_eq!(r.capture.as_ref().unwrap().mode, aether_rules::CaptureMode::Scoped);
    assert_eq!(r.container_id, "a");
    // What cannot be a record says why.
    for (bad, why) in [(&b"[1]"[..], "not a JSON object"), (b"{\"network\": 1}", "version 0 record")] {
        assert!(parse_record(bad).unwrap_err().to_string().contains(why), "{}", String::from_utf8_lossy(bad));
    }
}

#[test]
fn the_config_digest_is_stable_and_independent_of_debug_output() {
    let c = aether_rules::CaptureConfig::new(aether_rules::CaptureMode::RedirectAll);
    // Pinned: a release that changes it makes every pod's digest change.
    assert_eq!(config_digest(&c), config_digest(&c.clone()));
    // Before versioned records the digest was FNV-1a of the `Debug` text.
    assert_ne!(config_digest(&c), fnv1a(&format!("{c:?}")));
    let mut other = c.clone();
    other.rule_priority += 1;
    assert_ne!(config_digest(&c), config_digest(&other));
}

#[test]
fn parallel_writers_never_tear_a_record() {
    let d = tmpdir("par");
    let s = std::sync::Arc::new(StateDir::new(&d));
    let handles: Vec<_> = (0..16)
        .map(|i| {
            let s = s.clone();
            std::thread::spawn(move || {
                for _ in 0..20 {
                    s.write(&rec(&format!("c{i}"))).unwrap();
                    assert!(s.read("k8s-pod-network", &format!("c{i}"), "eth0").unwrap().is_some());
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(s.records().len(), 16);
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_state_directory_that_is_not_one_is_named_for_what_it_is() {
    let d = tmpdir("unusable");
    fs::create_dir_all(&d).unwrap();
    assert_eq!(unusable_reason(&d.join("missing")), None);
    assert_eq!(unusable_reason(&d), None);
    fs::write(d.join("file"), b"x").unwrap();
    assert_eq!(unusable_reason(&d.join("file")).unwrap(), "is a regular file, not a directory");
    std::os::unix::fs::symlink(d.join("nowhere"), d.join("dangling")).unwrap();
    let why = unusable_reason(&d.join("dangling")).unwrap();
    assert!(why.starts_with("is a dangling symlink") && why.contains("nowhere"), "{why}");
    std::os::unix::fs::symlink(d.join("file"), d.join("to-file")).unwrap();
    assert!(unusable_reason(&d.join("to-file")).unwrap().contains("which is a regular file"));
    std::os::unix::fs::symlink(&d, d.join("to-dir")).unwrap();
    assert_eq!(unusable_reason(&d.join("to-dir")), None);
    assert!(unusable_reason(&d.join("file/below")).unwrap().contains("parent directory on its path is a file"));
    // ADD's error names it too, not "File exists".
    let e = StateDir::new(&d.join("dangling")).ensure().unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("dangling symlink") && msg.contains("dangling"), "{msg}");
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn the_not_ready_marker_carries_its_reason() {
    let d = tmpdir("nr");
    let s = StateDir::new(&d);
    s.ensure().unwrap();
    assert_eq!(s.not_ready_reason(), None);
    fs::write(d.join(NOT_READY_MARKER), "installer: CNI config not chained yet\n").unwrap();
    assert_eq!(s.not_ready_reason().as_deref(), Some("installer: CNI config not chained yet"));
    fs::remove_dir_all(&d).unwrap();
}

/// Symlinks planted at every name the plugin creates are never written
/// through, and what it creates is 0700/0600.
#[test]
fn planted_symlinks_are_never_followed_and_modes_are_private() {
    let d = tmpdir("sym");
    let s = StateDir::new(&d);
    s.ensure().unwrap();
    let target = d.with_extension("target");
    let _ = fs::remove_file(&target);
    let pid = std::process::id();
    // The names the plugin used to write to, predictable from the PID.
    for name in [
        format!("attachments/.k8s-pod-network+a+eth0.json.tmp.{pid}"),
        format!(".probe.{pid}"),
        "lock".into(),
        "lock.turnstile".into(),
        super::BUILD_SLOTS_FILE.into(),
    ] {
        symlink(&target, d.join(&name)).unwrap();
    }
    s.write(&rec("a")).unwrap();
    // (No slot through a symlink: logged, and the build goes on without one.)
    drop(super::BuildSlot::take(&d));
    assert!(s.probe_writable().is_ok());
    assert!(s.lock(false).is_err(), "a symlink at the lock's name is refused, not followed");
    assert!(!target.exists(), "something was written through a planted symlink");
    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&d), 0o700);
    assert_eq!(mode(&d.join("attachments")), 0o700);
    assert_eq!(mode(&d.join("attachments/k8s-pod-network+a+eth0.json")), 0o600);
    // An older release's 0755 directory is tightened.
    fs::set_permissions(&d, fs::Permissions::from_mode(0o755)).unwrap();
    s.ensure().unwrap();
    assert_eq!(mode(&d), 0o700);
    // A record that is a symlink (to a record elsewhere) is unreadable, not followed.
    let elsewhere = d.with_extension("rec");
    fs::write(&elsewhere, serde_json::to_vec(&rec("b")).unwrap()).unwrap();
    symlink(&elsewhere, d.join("attachments/k8s-pod-network+b+eth0.json")).unwrap();
    let scan = s.scan();
    assert_eq!(scan.records, vec![rec("a")]);
    assert_eq!(scan.unreadable.len(), 1);
    let _ = fs::remove_file(&elsewhere);
    fs::remove_dir_all(&d).unwrap();
}

/// Records are read up to a documented size, and the error names it.
#[test]
fn an_oversized_record_is_unreadable_naming_the_limit() {
    let d = tmpdir("big");
    let s = StateDir::new(&d);
    s.ensure().unwrap();
    let big = vec![b' '; MAX_RECORD_BYTES as usize + 1];
    fs::write(d.join("attachments/k8s-pod-network+big+eth0.json"), &big).unwrap();
    let scan = s.scan();
    assert!(scan.unreadable[0].why.contains(&format!("limit of {MAX_RECORD_BYTES} bytes")), "{:?}", scan.unreadable);
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn temp_files_of_dead_writers_are_stale_once_old() {
    let d = tmpdir("stale");
    let s = StateDir::new(&d);
    s.ensure().unwrap();
    let dead = format!(".k8s+x+eth0.json.tmp.{}.1", i32::MAX - 1); // no such PID
    let alive = format!(".k8s+y+eth0.json.tmp.{}.1", std::process::id());
    let young = format!(".k8s+z+eth0.json.tmp.{}", i32::MAX - 1);
    for n in [&dead, &alive, &young] {
        fs::write(d.join("attachments").join(n), b"partial").unwrap();
    }
    let old = SystemTime::now() - STALE_TEMP_AGE - Duration::from_secs(5);
    for n in [&dead, &alive] {
        File::options().write(true).open(d.join("attachments").join(n)).unwrap().set_modified(old).unwrap();
    }
    assert_eq!(s.scan().stale_temps, vec![dead]);
    fs::remove_dir_all(&d).unwrap();
}

/// GC gets its exclusive lock although ADDs and DELs keep overlapping
/// (some shared holder at every instant), and gives up with code 11 when one never ends.
#[test]
fn gc_is_not_starved_by_overlapping_shared_holders_and_its_wait_is_bounded() {
    let d = tmpdir("fair");
    let s = std::sync::Arc::new(StateDir::new(&d));
    s.ensure().unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let holders: Vec<_> = (0..4)
        .map(|i| {
            let (s, stop) = (s.clone(), stop.clone());
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(5 * i));
                while !stop.load(Ordering::SeqCst) {
                    let _l = s.lock(false).unwrap();
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    let got = s.lock_within(true, Some(Duration::from_secs(5)));
    assert!(got.is_ok(), "GC starved: {got:?}");
    drop(got);
    stop.store(true, Ordering::SeqCst);
    for h in holders {
        h.join().unwrap();
    }
    let stuck = s.lock(false).unwrap();
    let e = s.lock_within(true, Some(Duration::from_millis(100))).unwrap_err();
    assert!(matches!(e, StateError::Busy { .. }), "{e}");
    assert!(e.to_string().contains("busy"), "{e}");
    drop(stuck);
    fs::remove_dir_all(&d).unwrap();
}
