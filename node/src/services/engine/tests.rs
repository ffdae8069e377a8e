//! The engine's pure bookkeeping, as tables (no root, no kernel).

use super::*;

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
