//! The engine's pure decisions, as tables (no root, no kernel).

use super::*;
use aether_rules::services::HeldLayer;
use aether_rules::services::{LayerMode, ServiceLayer, ServicePort};

/// A stored layer at `generation` holding one Service of `port` (mode `mode`).
fn stored(generation: u64, mode: LayerMode, port: u16) -> StoredLayer {
    let mut l = ServiceLayer::new(mode);
    l.ranges = vec!["10.96.0.0/16".parse().unwrap()];
    l.ports = vec![ServicePort {
        vip: "10.96.1.1".parse().unwrap(),
        proto: aether_rules::model::Proto::Tcp,
        port,
        has_endpoints: true,
    }];
    StoredLayer::new(generation, &l, 0)
}

/// What a pod's tables say: the layer `of`, for `mark`.
fn named(of: &StoredLayer, mark: u32) -> HeldLayer {
    HeldLayer::Named(of.named(mark))
}

const MARK: u32 = 0xae71;

/// A case: its name, what the pod's tables say, the previous and the new layer, the pod's
/// mark, and what the pod gets.
type Row<'a> = (&'a str, HeldLayer, Option<&'a StoredLayer>, &'a StoredLayer, u32, Action);
const OTHER_MARK: u32 = 0x1234;

/// Every case of the one decision both the one-shot apply and the applier make (and the
/// budget's estimate counts): what the pod's tables name against the previous and the new
/// layer, and its mark.
#[test]
fn the_decision_table() {
    let prev = stored(4, LayerMode::Refuse, 80);
    let new = stored(5, LayerMode::Refuse, 81);
    let same_content_renamed = StoredLayer { generation: 6, ..new.clone() };
    let older = stored(3, LayerMode::Refuse, 79);
    let off = stored(5, LayerMode::Off, 81);
    let count = stored(5, LayerMode::Count, 81);
    assert_ne!(prev.digest, new.digest, "RIG BROKEN: two contents, one digest");
    assert_ne!(count.digest, new.digest, "RIG BROKEN: the mode is not in the digest");
    let older_shape = HeldLayer::Named(aether_rules::services::Named { shape: 2, ..new.named(MARK) });

    use Action::*;
    #[rustfmt::skip]
    let table: Vec<Row> = vec![
        ("holds the new layer",                         named(&new, MARK),      Some(&prev), &new, MARK, Nothing),
        ("holds the new content under an older generation", named(&new, MARK), Some(&prev), &same_content_renamed, MARK, Rename(new.named(MARK))),
        ("holds the previous layer",                    named(&prev, MARK),     Some(&prev), &new, MARK, Change),
        ("holds an older layer (a missed generation)",  named(&older, MARK),    Some(&prev), &new, MARK, Rebuild),
        ("no layer (a new pod)",                        HeldLayer::Absent,      Some(&prev), &new, MARK, Rebuild),
        ("the previous layer for another mark",         named(&prev, OTHER_MARK), Some(&prev), &new, MARK, Rebuild),
        ("the new layer for another mark",              named(&new, OTHER_MARK), Some(&prev), &new, MARK, Rebuild),
        ("nothing stored before: a first layer",        named(&prev, MARK),     None,        &new, MARK, Rebuild),
        ("first layer, the pod already holds it",       named(&new, MARK),      None,        &new, MARK, Nothing),
        ("the mode changes (count to refuse)",          named(&count, MARK),    Some(&count), &new, MARK, Change),
        ("tables a release before built, unnamed",      HeldLayer::Unnamed { shape: Some(2) }, Some(&prev), &new, MARK, Migrate),
        ("tables of an unknown shape, unnamed",         HeldLayer::Unnamed { shape: None }, Some(&prev), &new, MARK, Migrate),
        ("named, in a shape before this one",           older_shape,            Some(&prev), &new, MARK, Migrate),
        ("mode off, pod holds the previous",            named(&prev, MARK),     Some(&prev), &off, MARK, Remove),
        ("mode off, no layer",                          HeldLayer::Absent,      Some(&prev), &off, MARK, Remove),
        ("mode off, nothing stored before",             HeldLayer::Absent,      None,        &off, MARK, Remove),
    ];
    for (case, held, previous, new, mark, want) in table {
        assert_eq!(decide(&held, previous, new, mark), want, "{case}");
    }
}

/// A pod's layer matches the divert mark its own capture sets, else the node's.
#[test]
fn a_pods_mark_is_its_captures_else_the_nodes() {
    let mut r = crate::state::Record { network: "net".into(), ..crate::state::Record::bare("c1", "/run/netns/x") };
    assert_eq!(mark_of(&r, OTHER_MARK), OTHER_MARK, "no capture recorded: the node's");
    let conf = crate::config::parse(
        serde_json::json!({"cniVersion": "1.0.0", "name": "net", "type": "aether-cni", "hostIP": "10.0.0.1",
               "stateDir": "/nonexistent", "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "10.1.0.5/24"}]}})
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    let mut cfg = crate::config::effective(&conf, None).unwrap().unwrap();
    cfg.divert_mark = 0x77;
    r.capture = Some(cfg);
    assert_eq!(mark_of(&r, OTHER_MARK), 0x77, "its capture's");
}

/// What a pod's `AppliedRun` says of the run of generations the element changes alone made, after
/// each kind of visit (the reconciler carries a pod over that run).
#[test]
fn the_run_of_generations_table() {
    let change = |before, after| Sent::Change { before, after };
    #[rustfmt::skip]
    let table: Vec<(&str, Sent, Option<(u32, u32)>, Option<(u32, u32)>)> = vec![
        ("nothing sent keeps the run",                        Sent::Nothing,              Some((3, 5)), Some((3, 5))),
        ("nothing sent, no run",                              Sent::Nothing,              None,         None),
        ("a change right after the run extends it",           change(None, Some(6)),      Some((3, 5)), Some((3, 6))),
        ("a change after another commit starts anew",         change(None, Some(7)),      Some((3, 5)), Some((7, 7))),
        ("no run: starts at the generation read before",      change(Some(9), Some(10)),  None,         Some((9, 10))),
        ("no run, another commit in between: its own only",   change(Some(9), Some(11)),  None,         Some((11, 11))),
        ("no run, nothing read before: its own only",         change(None, Some(10)),     None,         Some((10, 10))),
        ("the fence unread: no run",                          change(Some(9), None),      Some((3, 9)), None),
        ("a rebuild ends the run",                            Sent::Rebuild,              Some((3, 5)), None),
        ("the generation wraps",                              change(None, Some(0)),      Some((u32::MAX - 1, u32::MAX)), Some((u32::MAX - 1, 0))),
    ];
    for (case, sent, before, want) in table {
        assert_eq!(sent.run(before), want, "{case}");
    }
}
