//! The plan's pure decisions, as tables (no root, no kernel).

use super::*;
use aether_rules::services::HeldLayer;
use aether_rules::services::LayerMode;

/// A stored layer at `generation` holding one Service of `port` (mode `mode`).
fn stored(generation: u64, mode: LayerMode, port: u16) -> StoredLayer {
    crate::services::tests::stored_layer(generation, mode, port)
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

/// A record of container `id` in the netns of inode `ino`.
fn record(id: &str, ino: u64) -> crate::state::Record {
    let mut r = crate::state::Record { network: "net".into(), ..crate::state::Record::bare(id, "/run/netns/x") };
    r.netns_id = Some(crate::state::NetnsIdentity { dev: 4, ino, cookie: Some(ino * 10) });
    r
}

/// The plan is made once from what each pod holds: each pod's action is `decide`'s, a pod
/// that cannot be read is left out (its visit says why), and a record of the same
/// attachment in another netns (an ADD since) is not the planned pod.
#[test]
fn a_plan_is_each_pods_decision_made_once() {
    let prev = stored(4, LayerMode::Refuse, 80);
    let new = stored(5, LayerMode::Refuse, 81);
    let records = vec![record("a", 1), record("b", 2), record("c", 3), record("d", 4), record("gone", 5)];
    let mut asked = Vec::new();
    let plan = Plan::make(&records, MARK, Some(&prev), &new, |_, r| {
        asked.push(r.container_id.clone());
        match r.container_id.as_str() {
            "a" => Some(named(&prev, MARK)),
            "b" => Some(named(&new, MARK)),
            "c" => Some(HeldLayer::Absent),
            "d" => Some(HeldLayer::Unnamed { shape: Some(2) }),
            _ => None,
        }
    });
    assert_eq!(asked, ["a", "b", "c", "d", "gone"], "each pod asked once, in order");
    assert_eq!(plan.get(&records[0]), Some(Action::Change));
    assert_eq!(plan.get(&records[1]), Some(Action::Nothing));
    assert_eq!(plan.get(&records[2]), Some(Action::Rebuild));
    assert_eq!(plan.get(&records[3]), Some(Action::Migrate));
    assert_eq!(plan.get(&records[4]), None, "unreadable: not planned");
    assert_eq!(plan.get(&record("a", 9)), None, "the same attachment in another netns: not the planned pod");
    let mut other_cookie = record("a", 1);
    other_cookie.netns_id.as_mut().unwrap().cookie = Some(7);
    assert_eq!(plan.get(&other_cookie), None, "the inode reused by another netns: not the planned pod");
    // Another attachment in a planned pod's netns (another interface, or a container whose
    // name only begins alike) is not the planned one.
    let mut other_if = record("a", 1);
    other_if.ifname = "net1".into();
    assert_eq!(plan.get(&other_if), None, "another interface of the same netns: not the planned pod");
    let mut longer = record("a", 1);
    longer.container_id = "a2".into();
    assert_eq!(plan.get(&longer), None, "another container of the same netns: not the planned pod");
    let t = plan.tally();
    assert_eq!((t.nothing, t.changed, t.rebuilt, t.migrated, t.renamed, t.removed), (1, 1, 1, 1, 0, 0));
    // The budget's elements: the change once per changed pod, the whole layer per rebuilt or
    // migrated one.
    assert_eq!(t.elements(|| 10, || 1000), 10 + 2 * 1000);
}

/// The budget's count asks for the change's or the whole layer's elements only when some
/// pod gets it (each costs a layer's worth of work at 10,000 Services).
#[test]
fn the_plans_elements_are_counted_only_where_needed() {
    let nothing_to_do = Tally { nothing: 3, renamed: 1, removed: 2, ..Tally::default() };
    assert_eq!(nothing_to_do.elements(|| panic!("no pod changes"), || panic!("no pod is rebuilt")), 0);
    let changes_only = Tally { changed: 4, ..Tally::default() };
    assert_eq!(changes_only.elements(|| 7, || panic!("no pod is rebuilt")), 28);
}

/// With mode `off`, every planned pod's tables are removed, whatever they hold.
#[test]
fn mode_off_plans_a_removal_for_every_pod() {
    let prev = stored(4, LayerMode::Refuse, 80);
    let off = stored(5, LayerMode::Off, 81);
    let records = vec![record("a", 1), record("b", 2)];
    let plan = Plan::make(&records, MARK, Some(&prev), &off, |_, r| {
        Some(if r.container_id == "a" { named(&prev, MARK) } else { HeldLayer::Absent })
    });
    assert_eq!(plan.tally(), Tally { removed: 2, ..Tally::default() });
}
