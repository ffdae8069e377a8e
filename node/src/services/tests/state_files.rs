//! What `<stateDir>/services` holds after a node's sequence, and what an apply's visit
//! checks of a pod's record before it goes ahead.

use super::*;

/// The kinds of files under `<stateDir>/services` (`encoded-<mark>` one kind whatever the
/// mark), locks apart.
fn file_kinds(state: &Path) -> (std::collections::BTreeSet<String>, std::collections::BTreeSet<String>) {
    let kinds: std::collections::BTreeSet<String> = fs::read_dir(state.join("services"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .map(|n| if n.starts_with("encoded-") { "encoded-<mark>".to_string() } else { n })
        .collect();
    kinds.into_iter().partition(|k| k != "lock" && k != "counts.lock")
}

/// After the sequence a node goes through (pods added, three snapshots, three change
/// documents through the installer's applier, a DEL, an ADD), `<stateDir>/services` holds
/// six kinds of files besides its locks, each one design.md's state list names.
#[test]
fn the_service_state_is_six_kinds_of_files_besides_the_locks() {
    if !root_or_skip("the_service_state_is_six_kinds_of_files_besides_the_locks") {
        return;
    }
    use std::collections::BTreeSet;
    let state = tmp("kinds");
    let dir = ServicesDir::new(&state);
    let pods: Vec<TestNetns> = (0..4).map(|_| TestNetns::new("svc-kinds")).collect();
    for (i, ns) in pods.iter().enumerate() {
        let n = Netns::open_foreign(ns.path()).unwrap();
        let _pod = n.lock().unwrap();
        StateDir::new(&state).write(&rec(&format!("c{i}"), &ns.path())).unwrap();
        apply_current_snapshot_in_netns(&state, &n, 0xae71).unwrap();
    }
    for g in 1..=3 {
        apply_document(&dir, &doc(g)).unwrap();
    }
    let mut applier = Applier::new(&state);
    for g in 4..=6u64 {
        let change = json!({"baseGeneration": g - 1, "generation": g, "servicesPut": [
            {"namespace": "n", "name": format!("s{g}"), "vip": format!("10.96.2.{g}"),
             "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": true}]});
        applier.apply(change.to_string().as_bytes()).unwrap();
    }
    let n = Netns::open_foreign(pods[0].path()).unwrap();
    {
        let _pod = n.lock().unwrap();
        let forget = || StateDir::new(&state).remove("k8s-pod-network", "c0", "eth0");
        retire_layer(&state, Some(&n), "k8s-pod-network/c0/eth0", forget).unwrap();
        StateDir::new(&state).write(&rec("c9", &pods[0].path())).unwrap();
        assert_eq!(apply_current_snapshot_in_netns(&state, &n, 0xae71).unwrap(), Some(6));
    }
    let (kinds, locks) = file_kinds(&state);
    let named: BTreeSet<String> =
        ["snapshot.json", "snapshot.source", "layer.bin", "layer.journal", "accumulator.json", "encoded-<mark>"]
            .map(String::from)
            .into();
    assert_eq!(kinds, named, "the kinds of files (locks apart: {locks:?})");
    // Control: a file of another kind (a release before's mirror of a pod) is seen.
    fs::write(state.join("services/pods.moves"), b"").unwrap();
    assert!(file_kinds(&state).0.contains("pods.moves"), "RIG BROKEN: a stray file is not seen");
    let _ = fs::remove_dir_all(&state);
}

/// A visit's check that the pod's record is still the one listed: a record unchanged since
/// the listing is taken by its change time alone; one removed is gone; one written again
/// since, naming another netns (a new ADD of the same attachment elsewhere), is read and
/// found to be another pod's.
#[test]
fn a_visit_goes_ahead_only_while_the_listed_record_is_there() {
    if !root_or_skip("a_visit_goes_ahead_only_while_the_listed_record_is_there") {
        return;
    }
    let state = tmp("recorded");
    let dirs = StateDir::new(&state);
    let ns = TestNetns::new("svc-recorded");
    let n = Netns::open_foreign(ns.path()).unwrap();
    let listed_record = Record { netns_id: Some(crate::state::NetnsIdentity::of(&n)), ..rec("c0", &ns.path()) };
    dirs.write(&listed_record).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100));
    let listed = engine::Listed::now(&dirs);
    assert!(engine::still_recorded(&dirs, &listed_record, &n, &listed).is_ok(), "the listed record, unchanged");
    // The directory alone vouches while it is unchanged: a record overwritten in place (no
    // writer of ours does that: every write is a rename, which changes the directory) is not
    // looked at. (Without the directory's word, its new change time would have it read.)
    let path = state.join("attachments").join(StateDir::record_name("k8s-pod-network", "c0", "eth0"));
    let kept = fs::read(&path).unwrap();
    fs::write(&path, b"not a record").unwrap();
    assert!(engine::still_recorded(&dirs, &listed_record, &n, &listed).is_ok(), "vouched for by the directory");
    let listed_without_dir = engine::Listed::without_directory(&listed);
    assert!(
        engine::still_recorded(&dirs, &listed_record, &n, &listed_without_dir).is_err(),
        "the control: without the directory's word, the record written since is read"
    );
    fs::write(&path, kept).unwrap();
    // Written again after the listing, naming another netns: read, and refused.
    let elsewhere = TestNetns::new("svc-recorded2");
    let other = Netns::open_foreign(elsewhere.path()).unwrap();
    dirs.write(&Record { netns_id: Some(crate::state::NetnsIdentity::of(&other)), ..rec("c0", &elsewhere.path()) })
        .unwrap();
    match engine::still_recorded(&dirs, &listed_record, &n, &listed) {
        Err(PodError::Gone(why)) => assert!(why.contains("another netns"), "{why}"),
        other => panic!("a record written since for another netns: {other:?}"),
    }
    // Control: listed after that write (by more than the margin), the change time alone
    // vouches for it, so the check is the listing's time, not chance.
    std::thread::sleep(std::time::Duration::from_millis(100));
    let later = engine::Listed::now(&dirs);
    assert!(
        engine::still_recorded(&dirs, &listed_record, &n, &later).is_ok(),
        "listed after the write, the change time alone vouches (the listing would hold the new record)"
    );
    dirs.remove("k8s-pod-network", "c0", "eth0").unwrap();
    match engine::still_recorded(&dirs, &listed_record, &n, &later) {
        Err(PodError::Gone(why)) => assert!(why.contains("went"), "{why}"),
        other => panic!("a removed record: {other:?}"),
    }
    let _ = fs::remove_dir_all(&state);
}
