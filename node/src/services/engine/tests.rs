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

/// A pod link that never reaches the kernel: it sends nothing (a send is accepted, or refused
/// as a kernel refuses a compare-and-swap on a pod that holds something else).
struct FakeLink {
    ns: Netns,
    held: HeldLayer,
    refuse: bool,
    sends: usize,
}

impl PodLink for FakeLink {
    fn netns(&self) -> &Netns {
        &self.ns
    }
    fn held(&mut self, _fresh: bool) -> Result<HeldLayer, PodError> {
        Ok(self.held)
    }
    fn believe(&mut self, _now: Option<HeldLayer>) {}
    fn send(&mut self, _change: &Encoded, _read_before: bool) -> Result<(Option<u32>, Option<u32>), PodError> {
        self.sends += 1;
        match self.refuse {
            true => Err(PodError::Gone("refused: the pod holds another layer".into())),
            false => Ok((None, Some(1))),
        }
    }
}

/// A visit asks whether the pod is still recorded only before what no compare-and-swap
/// guards (a rebuild, a migration, a removal, a decision again after a refusal): an element
/// change or a rename asks no file. Each row's record check answers "gone", so a visit that
/// asks stops there, before the kernel; one that does not ask and should have would reach the
/// kernel (in a namespace of the test's own), and its row fails.
#[test]
fn a_visit_takes_the_pods_lock_and_asks_for_the_record_only_where_no_compare_and_swap_guards() {
    let stored = |generation, port| {
        crate::services::tests::stored_layer(generation, aether_rules::services::LayerMode::Refuse, port)
    };
    const MARK: u32 = 0xae71;
    let (prev, new) = (stored(4, 80), stored(5, 81));
    let renamed_from = stored(3, 81).named(MARK);
    // In a namespace of the test's own, so that a visit that wrongly went on touches
    // nothing of the host's.
    if !aether_testkit::root_or_skip(
        "a_visit_takes_the_pods_lock_and_asks_for_the_record_only_where_no_compare_and_swap_guards",
    ) {
        return;
    }
    let own = aether_testkit::TestNetns::new("visit");
    let path = own.path();
    let state = aether_testkit::ScratchDir::new("visit-record");
    let dir = ServicesDir::new(&state.0);

    use Action::*;
    #[rustfmt::skip]
    let table: Vec<(&str, Action, bool, bool, usize)> = vec![
        // (case, planned, the kernel refuses, the pod locked and its record asked, sends)
        ("nothing to do",                            Nothing,              false, false, 0),
        ("an element change",                        Change,               false, false, 1),
        ("a rename",                                 Rename(renamed_from), false, false, 1),
        ("an element change the kernel refuses",     Change,               true,  true,  1),
        ("a rebuild",                                Rebuild,              false, true,  0),
        ("a migration",                              Migrate,              false, true,  0),
        ("a removal (mode off)",                     Remove,               false, true,  0),
    ];
    for (case, planned, refuse, want_asked, want_sends) in table {
        let mut link =
            FakeLink { ns: Netns::open(&path).unwrap(), held: HeldLayer::Named(prev.named(MARK)), refuse, sends: 0 };
        let asked = std::cell::Cell::new(0);
        let gone = |_: &Netns| {
            asked.set(asked.get() + 1);
            Err(PodError::Gone("the record went".into()))
        };
        let mut pass = Pass::new(&dir, (&new, Some(&prev)), Walker::Pod { charged: false });
        let outcome = pass.visit(&mut link, MARK, Some(planned), &gone);
        assert_eq!(
            asked.get() > 0,
            want_asked,
            "{case}: locked and asked for the record {} time(s): {outcome:?}",
            asked.get()
        );
        assert!(asked.get() <= 1, "{case}: asked once at most, asked {}", asked.get());
        assert_eq!(link.sends, want_sends, "{case}: sends");
        match want_asked {
            true => {
                assert!(matches!(outcome, Err(PodError::Gone(ref m)) if m == "the record went"), "{case}: {outcome:?}")
            }
            false => assert!(outcome.is_ok(), "{case}: {outcome:?}"),
        }
    }
}

/// ADD's and a repair's one rule after an apply moved the pod's layer meanwhile: tried again,
/// each time told which try it is, `MOVED_TRIES` more times at most; any other outcome (a
/// success, another error) ends it at once.
#[test]
fn a_moved_layer_is_tried_again_three_times_at_most() {
    let moved = || PodError::Kernel(aether_rules::Error::LayerMoved { named: "generation 7".into() });
    for (moves, want_ok) in [(0, true), (1, true), (MOVED_TRIES, true), (MOVED_TRIES + 1, false)] {
        let mut seen = Vec::new();
        let got = bring_while_moved(|tries| {
            seen.push(tries);
            Ok(if tries < moves { Err(moved()) } else { Ok(tries) })
        });
        let tried = moves.min(MOVED_TRIES) + 1;
        assert_eq!(seen, (0..tried).collect::<Vec<_>>(), "{moves} moves");
        match got {
            Ok(t) => assert!(want_ok && t == moves, "{moves} moves: {t}"),
            Err(e) => assert!(!want_ok && e.to_string().contains("changed since it was read"), "{moves} moves: {e}"),
        }
    }
    // Another refusal is not tried again.
    let mut calls = 0;
    let other = bring_while_moved(|_| {
        calls += 1;
        Ok::<Result<(), _>, _>(Err(PodError::Kernel(aether_rules::Error::InvalidConfig("refused".into()))))
    });
    assert!(other.is_err() && calls == 1, "{other:?} after {calls} calls");
}

/// A netns that two attachments share (two networks' records) holds one layer, brought once
/// a pass: the second record's visit sends nothing and waits for no lock (it would send the
/// change again, be refused, and lock the pod to decide again). Another mark is its own visit.
#[test]
fn a_netns_of_two_records_is_brought_once_a_pass() {
    if !aether_testkit::root_or_skip("a_netns_of_two_records_is_brought_once_a_pass") {
        return;
    }
    let stored = |generation, port| {
        crate::services::tests::stored_layer(generation, aether_rules::services::LayerMode::Refuse, port)
    };
    const MARK: u32 = 0xae71;
    let (prev, new) = (stored(4, 80), stored(5, 81));
    let own = aether_testkit::TestNetns::new("twice");
    let state = aether_testkit::ScratchDir::new("visit-twice");
    let dir = ServicesDir::new(&state.0);
    let link = |refuse| FakeLink {
        ns: Netns::open(own.path()).unwrap(),
        held: HeldLayer::Named(prev.named(MARK)),
        refuse,
        sends: 0,
    };
    let asked = std::cell::Cell::new(0);
    let gone = |_: &Netns| {
        asked.set(asked.get() + 1);
        Err(PodError::Gone("the record went".into()))
    };
    let mut pass = Pass::new(&dir, (&new, Some(&prev)), Walker::Pod { charged: false });
    let (mut first, mut second) = (link(false), link(true));
    assert!(pass.visit(&mut first, MARK, Some(Action::Change), &gone).is_ok());
    let outcome = pass.visit(&mut second, MARK, Some(Action::Change), &gone);
    assert!(matches!(outcome, Ok(Applied::Unchanged)), "{outcome:?}");
    assert_eq!((first.sends, second.sends, asked.get()), (1, 0, 0), "the second visit sent or asked");
    // Under another mark the netns was not brought yet: visited (and here refused, so asked).
    let mut other = link(true);
    let outcome = pass.visit(&mut other, MARK + 1, Some(Action::Change), &gone);
    assert!(matches!(outcome, Err(PodError::Gone(_))) && other.sends == 1 && asked.get() == 1, "{outcome:?}");
}
