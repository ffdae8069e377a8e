use super::*;

fn base() -> Base {
    Base { generation: 7, source: 0x1234, checksum: 0xfeed }
}

fn port(vip: &str, port: u16) -> ServicePort {
    ServicePort { vip: vip.parse().unwrap(), proto: Proto::Tcp, port, has_endpoints: true }
}

fn entry(from: u64, generation: u64) -> Entry<'static> {
    Entry {
        from,
        generation,
        mode: LayerMode::Refuse,
        dialled_timeout_secs: 600,
        mesh_vips: vec!["10.96.9.9".parse().unwrap(), "fd00:10:96::9".parse().unwrap()],
        gone: vec!["10.96.0.1".parse().unwrap()],
        came: vec![port("10.96.0.2", 80), port("fd00:10:96::2", 443)],
        change: Cow::Owned(format!("{{\"baseGeneration\":{from},\"generation\":{generation}}}").into_bytes()),
    }
}

fn journal(entries: &[Entry]) -> Vec<u8> {
    let mut b = header(&base());
    for e in entries {
        b.extend_from_slice(&e.encode());
    }
    b
}

/// Entries read back as written; a journal cut anywhere (an append torn by a kill) reads as
/// the entries whole before the cut; a damaged byte ends it at the entry it is in; a journal
/// over another `layer.bin`, and an entry that does not follow the one before, are not read.
#[test]
fn entries_read_back_up_to_the_first_torn_damaged_or_unchained_one() {
    let entries = [entry(7, 8), entry(8, 9), entry(9, 12)];
    let b = journal(&entries);
    assert_eq!(decode(&b, &base()), entries);
    let ends: Vec<usize> = entries
        .iter()
        .scan(HEADER, |at, e| Some(std::mem::replace(at, *at + e.encode().len()) + e.encode().len()))
        .collect();
    for cut in 0..b.len() {
        let whole = ends.iter().filter(|&&end| end <= cut).count();
        assert_eq!(decode(&b[..cut], &base()), entries[..whole], "cut at {cut}");
    }
    let mut damaged = b.clone();
    damaged[ends[0] + 20] ^= 1;
    assert_eq!(decode(&damaged, &base()), entries[..1], "a damaged second entry");
    let other = Base { checksum: 1, ..base() };
    assert_eq!(decode(&b, &other), Vec::<Entry>::new(), "a journal over another layer.bin");
    let unchained = journal(&[entry(7, 8), entry(9, 10)]);
    assert_eq!(decode(&unchained, &base()), entries[..1], "an entry from another generation");
    let backwards = journal(&[entry(7, 8), entry(8, 8)]);
    assert_eq!(decode(&backwards, &base()), entries[..1], "an entry that does not move the generation");
}

/// Folded in one pass, the entries leave each VIP's ports as the last entry that touched it
/// left them: the same layer (and digest) as the entries made one after another.
#[test]
fn a_fold_is_the_entries_applied_in_turn() {
    let mut l = ServiceLayer::new(LayerMode::Refuse);
    l.ranges = vec!["10.96.0.0/16".parse().unwrap()];
    l.ports = vec![port("10.96.0.1", 80), port("10.96.0.1", 81), port("10.96.0.3", 80), port("10.96.0.5", 80)];
    let base = StoredLayer::new(1, &l, 9);
    let step = |from: u64, gone: &[&str], came: Vec<ServicePort>| Entry {
        from,
        generation: from + 1,
        mode: LayerMode::Refuse,
        dialled_timeout_secs: 3600,
        mesh_vips: Vec::new(),
        gone: gone.iter().map(|v| v.parse().unwrap()).collect(),
        came,
        change: Cow::Borrowed(b"{}"),
    };
    let entries = [
        // A Service removed, another added.
        step(1, &["10.96.0.1"], vec![port("10.96.0.2", 80)]),
        // The added one replaced, one stored flipped.
        step(
            2,
            &["10.96.0.2", "10.96.0.3"],
            vec![port("10.96.0.2", 90), ServicePort { has_endpoints: false, ..port("10.96.0.3", 80) }],
        ),
        // The first VIP back, the added one gone again.
        step(3, &["10.96.0.2"], vec![port("10.96.0.1", 7)]),
    ];
    let mut by_turns = base.layer.clone();
    for e in &entries {
        by_turns.ports.retain(|p| !e.gone.contains(&p.vip));
        by_turns.ports.extend(&e.came);
        by_turns.ports.sort();
    }
    let folded = fold(base.clone(), &entries);
    assert_eq!(folded.layer, by_turns);
    assert_eq!(folded.generation, 4);
    assert_eq!(folded.digest, StoredLayer::new(4, &by_turns, 0).digest);
    assert_eq!(folded.source, 0, "no document is known whole by its digest");
    assert_eq!(fold(base.clone(), &[]), base, "no entry: the base as it is");
}
