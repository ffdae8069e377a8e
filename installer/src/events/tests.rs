//! The Events' pure parts: what a pass makes, the bodies, the ledger's aggregation and
//! bounds, and the token bucket under a 100-pod drift storm (simulated time: no wall clock).

use std::time::{Duration, Instant, SystemTime};

use super::body::{cut, event_body, NOTE_MAX_BYTES};
use super::ledger::{Ledger, Recorded, TokenBucket, Write, WriteOutcome, MAX_ATTEMPTS};
use super::*;
use crate::reconcile::{Comparisons, Finding, Leftover, Refusal};

fn pod(i: usize) -> PodRef {
    PodRef { namespace: "shop".into(), name: format!("cart-{i}"), uid: format!("uid-{i}") }
}

fn drift(i: usize) -> NodeEvent {
    NodeEvent::DriftRepaired {
        pod: pod(i),
        layer: Layer::Capture,
        differences: vec!["table aether_cni: chain gone".into()],
    }
}

fn report(actions: Vec<(Action, Outcome)>, findings: Vec<Finding>, refusals: Vec<Refusal>) -> PassReport {
    PassReport {
        number: 1,
        finished: SystemTime::now(),
        took: Duration::ZERO,
        runtime_unseen: None,
        records_unread: None,
        findings,
        actions,
        compared: Comparisons::default(),
        refusals,
    }
}

#[test]
fn a_pass_makes_one_event_per_thing_done_and_none_for_what_failed_or_was_collected() {
    let r = report(
        vec![
            (Action::Restart { sandbox_id: "s0".into(), pod: pod(0) }, Outcome::Done),
            (Action::Capture { sandbox_id: "s1".into(), pod: pod(1), netns: "/n".into(), ips: vec![] }, Outcome::Done),
            (Action::Repair { record: "r2".into(), pod: pod(2), differences: vec!["rule gone".into()] }, Outcome::Done),
            (Action::RepairServices { record: "r3".into(), pod: pod(3), differences: vec![] }, Outcome::Done),
            (Action::Migrate { record: "r4".into(), pod: pod(4), from: "ruleset v1".into() }, Outcome::Done),
            (
                Action::Capture { sandbox_id: "s5".into(), pod: pod(5), netns: "/n".into(), ips: vec![] },
                Outcome::Refused("netns of shop/other".into()),
            ),
            // The negative controls: failed, moot, and a collected leftover make no Event.
            (Action::Restart { sandbox_id: "s6".into(), pod: pod(6) }, Outcome::Failed("CRI down".into())),
            (Action::Repair { record: "r7".into(), pod: pod(7), differences: vec![] }, Outcome::Moot("DEL".into())),
            (Action::Collect { record: "r8".into(), pod: pod(8), why: Leftover::SandboxGone }, Outcome::Done),
        ],
        vec![
            Finding { pod: pod(9), sandbox_id: "s9".into(), state: PodState::Missed, held: Some(Held::Reported) },
            Finding { pod: pod(10), sandbox_id: "s10".into(), state: PodState::Missed, held: Some(Held::RateLimited) },
            Finding { pod: pod(2), sandbox_id: "s2".into(), state: PodState::Drifted, held: None },
        ],
        vec![
            Refusal { kind: "drift-fought", subject: "shop/cart-2".into(), why: "repaired 5 times".into(), new: true },
            // Already told: not again.
            Refusal { kind: "drift-fought", subject: "shop/cart-3".into(), why: "repaired 5 times".into(), new: false },
        ],
    );
    let reasons: Vec<(&str, String)> = from_pass(&r)
        .iter()
        .map(|e| (e.reason(), if let Regarding::Pod(p) = e.regarding() { p.uid } else { "node".into() }))
        .collect();
    let want = [
        ("MissedPodRestarted", "uid-0"),
        ("MissedPodCaptured", "uid-1"),
        ("DriftRepaired", "uid-2"),
        ("DriftRepaired", "uid-3"),
        ("CaptureMigrated", "uid-4"),
        ("CaptureRefused", "uid-5"),
        ("MissedPodReported", "uid-9"),
        // The fought pod's uid, found among the pass's pods by its name.
        ("DriftFought", "uid-2"),
    ];
    assert_eq!(reasons, want.iter().map(|(r, u)| (*r, u.to_string())).collect::<Vec<_>>());
}

#[test]
fn bodies_name_the_pod_the_node_and_the_rule_and_cut_the_note_to_the_api_limit() {
    let e = NodeEvent::DriftRepaired {
        pod: pod(1),
        layer: Layer::Services,
        differences: vec!["map svc: 2 elements".into()],
    };
    let b = event_body(&e, "node-a", "cart-1.1", SystemTime::UNIX_EPOCH, None);
    let v = serde_json::to_value(&b).unwrap();
    assert_eq!(
        v["regarding"],
        serde_json::json!({"apiVersion": "v1", "kind": "Pod", "namespace": "shop", "name": "cart-1", "uid": "uid-1"})
    );
    assert_eq!(v["metadata"]["namespace"], "shop");
    assert_eq!(v["reportingController"], REPORTING_CONTROLLER);
    assert_eq!(v["reportingInstance"], "node-a");
    assert_eq!(v["type"], "Normal");
    assert!(v["note"].as_str().unwrap().contains("map svc: 2 elements"), "{v}");
    assert!(v.get("series").is_none());

    let n = event_body(
        &NodeEvent::NodeNotReady { why: "kernel: nft_tproxy".into() },
        "node-a",
        "x",
        SystemTime::now(),
        None,
    );
    let v = serde_json::to_value(&n).unwrap();
    assert_eq!((v["regarding"]["kind"].as_str(), v["metadata"]["namespace"].as_str()), (Some("Node"), Some("default")));
    assert_eq!(v["type"], "Warning");
    assert!(v["note"].as_str().unwrap().contains("nft_tproxy"));

    let long = NodeEvent::CaptureRefused { pod: pod(1), why: "é".repeat(2000) };
    let note = event_body(&long, "n", "x", SystemTime::now(), None).note.unwrap();
    assert!(note.len() <= NOTE_MAX_BYTES && note.len() > NOTE_MAX_BYTES - 4, "{}", note.len());
    assert_eq!(cut("abc", 2), "ab");
}

fn ledger(cap: usize) -> Ledger {
    Ledger::new("node-a", cap, Duration::from_secs(300), Duration::from_secs(360))
}

/// Runs the ledger's writes due at `now`, all answered Done; returns them.
fn write_all(l: &mut Ledger, now: Instant) -> Vec<Write> {
    let mut out = Vec::new();
    while let Some(w) = l.next_write(now, SystemTime::now()) {
        assert_eq!(l.finish(&w, WriteOutcome::Done, now), None);
        out.push(w);
    }
    out
}

#[test]
fn repeats_are_one_create_then_one_series_patch_then_one_per_refresh() {
    let t0 = Instant::now();
    let mut l = ledger(16);
    assert_eq!(l.record(drift(1), t0, SystemTime::now()), Recorded::New);
    let w = write_all(&mut l, t0);
    assert_eq!(w.iter().map(Write::verb).collect::<Vec<_>>(), ["create"]);
    for _ in 0..50 {
        assert_eq!(l.record(drift(1), t0, SystemTime::now()), Recorded::Repeat);
    }
    // The second occurrence is written at once, with every repeat since (count 51).
    let w = write_all(&mut l, t0);
    assert!(matches!(&w[..], [Write::Patch { count: 51, patch, .. }] if patch["series"]["count"] == 51), "{w:?}");
    // More repeats: nothing before the refresh period, one patch after it.
    l.record(drift(1), t0, SystemTime::now());
    assert!(write_all(&mut l, t0 + Duration::from_secs(299)).is_empty());
    assert_eq!(write_all(&mut l, t0 + Duration::from_secs(300)).len(), 1);
    // The negative control: another pod, or another reason for the same pod, is an Event of its own.
    l.record(drift(2), t0, SystemTime::now());
    l.record(NodeEvent::DriftFought { pod: pod(1), why: "x".into() }, t0, SystemTime::now());
    assert_eq!(write_all(&mut l, t0 + Duration::from_secs(300)).iter().filter(|w| w.verb() == "create").count(), 2);
}

#[test]
fn a_quiet_event_is_forgotten_after_the_window_and_a_later_one_is_new() {
    let t0 = Instant::now();
    let mut l = ledger(16);
    l.record(drift(1), t0, SystemTime::now());
    write_all(&mut l, t0);
    l.expire(t0 + Duration::from_secs(359));
    assert_eq!(l.len(), 1);
    l.expire(t0 + Duration::from_secs(360));
    assert_eq!(l.len(), 0);
    assert_eq!(l.record(drift(1), t0, SystemTime::now()), Recorded::New);
}

#[test]
fn the_ledger_is_bounded_and_drops_what_it_cannot_hold() {
    let t0 = Instant::now();
    let mut l = ledger(16);
    let recorded: Vec<Recorded> = (0..1000).map(|i| l.record(drift(i), t0, SystemTime::now())).collect();
    assert_eq!(l.len(), 16);
    assert_eq!(recorded.iter().filter(|r| **r == Recorded::Full).count(), 1000 - 16);
    // Once written, the oldest make room for new ones.
    write_all(&mut l, t0);
    assert_eq!(l.record(drift(5000), t0, SystemTime::now()), Recorded::New);
    assert_eq!(l.len(), 16);
}

#[test]
fn failures_are_retried_a_bounded_number_of_times_then_dropped() {
    let t0 = Instant::now();
    let mut l = ledger(16);
    l.record(drift(1), t0, SystemTime::now());
    let mut now = t0;
    let mut dropped = None;
    let mut attempts = 0;
    while dropped.is_none() {
        let w = l.next_write(now, SystemTime::now()).expect("retried after its backoff");
        attempts += 1;
        dropped = l.finish(&w, WriteOutcome::Retry, now);
        // The backoff holds it back.
        assert!(dropped.is_some() || l.next_write(now, SystemTime::now()).is_none());
        now += Duration::from_secs(60);
    }
    assert_eq!((attempts, dropped, l.len()), (MAX_ATTEMPTS, Some("unanswered"), 0));
    l.record(drift(2), t0, SystemTime::now());
    let w = l.next_write(t0, SystemTime::now()).unwrap();
    assert_eq!(l.finish(&w, WriteOutcome::Refused("forbidden"), t0), Some("forbidden"));
    // An expired Event (404 on its patch) is created again, its series carried.
    l.record(drift(3), t0, SystemTime::now());
    write_all(&mut l, t0);
    l.record(drift(3), t0, SystemTime::now());
    let w = l.next_write(t0, SystemTime::now()).unwrap();
    assert_eq!(w.verb(), "patch");
    l.finish(&w, WriteOutcome::Gone, t0);
    match l.next_write(t0, SystemTime::now()).unwrap() {
        Write::Create { body, .. } => assert_eq!(body.series.map(|s| s.count), Some(2)),
        w => panic!("{w:?}"),
    }
}

/// The goal's figure: a drift storm of 100 pods, each repaired every 10 s pass for 10 min,
/// costs at most one API write in any second, and all 100 pods get their Event.
#[test]
fn a_drift_storm_of_100_pods_costs_at_most_one_write_per_second() {
    let t0 = Instant::now();
    let mut l = ledger(Settings::DEFAULT_LEDGER);
    let mut bucket = TokenBucket::new(1.0, t0);
    let mut writes: Vec<(Duration, Write)> = Vec::new();
    let step = Duration::from_millis(100);
    let mut at = Duration::ZERO;
    while at < Duration::from_secs(600) {
        let now = t0 + at;
        if at.as_millis().is_multiple_of(10_000) {
            for i in 0..100 {
                l.record(drift(i), now, SystemTime::now());
            }
        }
        l.expire(now);
        if l.next_due().is_some_and(|d| d <= now) && bucket.try_take(now) {
            let w = l.next_write(now, SystemTime::now()).unwrap();
            l.finish(&w, WriteOutcome::Done, now);
            writes.push((at, w));
        }
        at += step;
    }
    for pair in writes.windows(2) {
        assert!(
            pair[1].0 - pair[0].0 >= Duration::from_secs(1),
            "two writes within a second: {:?} {:?}",
            pair[0].0,
            pair[1].0
        );
    }
    let creates = writes.iter().filter(|(_, w)| w.verb() == "create").count();
    assert_eq!(creates, 100, "one Event per pod");
    // 6000 occurrences (100 pods x 60 passes) in at most 600 writes; print the figure.
    let occurrences = 100 * 60;
    eprintln!("drift storm: {occurrences} occurrences, {} writes in 600 s ({creates} creates)", writes.len());
    assert!(writes.len() <= 600);

    // The negative control: without the bucket, the same storm writes many times a second.
    let mut l = ledger(Settings::DEFAULT_LEDGER);
    for i in 0..100 {
        l.record(drift(i), t0, SystemTime::now());
    }
    assert_eq!(write_all(&mut l, t0).len(), 100);
}

#[test]
fn events_off_is_a_no_op_that_counts_nothing() {
    let events = Events::new(std::sync::Arc::new(EventMetrics::new()));
    for i in 0..10_000 {
        events.emit(drift(i));
    }
    assert!(!events.is_on());
    assert_eq!(events.metrics.dropped_total(), 0);
}
