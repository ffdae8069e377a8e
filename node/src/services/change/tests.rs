use std::collections::HashSet;
use std::fs;

use super::*;
use crate::services::{apply_change, apply_document, ServicesDir};

fn tmp(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("aether-svcchange-{tag}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    d
}

/// A small xorshift: the random sequences are reproducible from the seed in a failure.
struct Rng(u64);
impl Rng {
    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn svc(i: u64, usable: bool) -> Value {
    json!({"namespace": "ns", "name": format!("s{i}"), "vip": format!("10.96.{}.{}", i / 250, 1 + i % 250),
           "ports": [{"protocol": "TCP", "port": 80 + (i % 3)}], "usableEndpoints": usable})
}

/// A random change to `model` (the agent's view), applied to the model as the agent would.
fn random_change(rng: &mut Rng, model: &mut Snapshot, next_id: &mut u64) -> Value {
    let base = model.generation;
    let mut c = json!({"baseGeneration": base, "generation": base + 1 + rng.next(3)});
    let mut put = Vec::new();
    let mut removed = Vec::new();
    let mut flips = Vec::new();
    for _ in 0..1 + rng.next(4) {
        match rng.next(3) {
            0 => {
                put.push(svc(*next_id, rng.next(2) == 0));
                *next_id += 1;
            }
            1 if !model.services.is_empty() => {
                let s = model.services.remove(rng.next(model.services.len() as u64) as usize);
                removed.push(json!({"namespace": s.namespace, "name": s.name}));
                flips.retain(|f: &Value| f["name"] != json!(s.name));
            }
            _ if !model.services.is_empty() => {
                let s = &model.services[rng.next(model.services.len() as u64) as usize];
                if flips.iter().all(|f: &Value| f["name"] != json!(s.name))
                    && removed.iter().all(|r| r["name"] != json!(s.name))
                {
                    flips.push(json!({"namespace": s.namespace, "name": s.name,
                                      "usableEndpoints": !s.usable_endpoints}));
                }
            }
            _ => {}
        }
    }
    c["servicesPut"] = json!(put);
    c["servicesRemoved"] = json!(removed);
    c["endpoints"] = json!(flips);
    c
}

/// Random sequences of changes give, generation by generation, the stored snapshot and
/// `layer.bin` the equivalent whole snapshot gives.
fn changes_equal_whole_snapshots(wrong: bool) -> Result<(), String> {
    let (a, b) = (tmp(&format!("a{wrong}")), tmp(&format!("b{wrong}")));
    let (da, db) = (ServicesDir::new(&a), ServicesDir::new(&b));
    let first = json!({"generation": 1, "mode": "refuse", "serviceRanges": ["10.96.0.0/16"],
                       "services": (0..20).map(|i| svc(i, i % 2 == 0)).collect::<Vec<_>>()});
    let text = render(&snapshot::parse(first.to_string().as_bytes()).unwrap());
    apply_document(&da, &text).unwrap();
    apply_document(&db, &text).unwrap();
    let mut rng = Rng(0x5eed_1234);
    let mut next_id = 20;
    for step in 0..40 {
        let stored = snapshot::parse(&fs::read(a.join("services/snapshot.json")).unwrap()).unwrap();
        let mut model = stored.clone();
        let c = random_change(&mut rng, &mut model, &mut next_id);
        let mut sent = c.clone();
        if wrong {
            // The deliberately wrong applier: endpoint flips lost.
            sent["endpoints"] = json!([]);
        }
        apply_change(&da, sent.to_string().as_bytes()).map_err(|e| format!("step {step}: {e}"))?;
        // The whole snapshot the agent would have sent: the change applied to its view.
        let whole = apply(stored.clone(), &parse(c.to_string().as_bytes()).unwrap()).unwrap();
        let whole_text = render(&whole);
        apply_document(&db, &whole_text).unwrap();
        for f in ["snapshot.json", "layer.bin"] {
            if fs::read(a.join("services").join(f)).unwrap() != fs::read(b.join("services").join(f)).unwrap() {
                return Err(format!("step {step}: {f} differs"));
            }
        }
        // Every change after the first takes the splice: the stored document is marked
        // canonical, naming the source `layer.bin` was made from.
        let source = da.stored_layer().unwrap().unwrap().source;
        assert_eq!(
            fs::read_to_string(a.join("services/snapshot.source")).unwrap(),
            format!("{source:016x} canonical\n")
        );
    }
    Ok(())
}

#[test]
fn random_changes_store_what_the_equivalent_whole_snapshots_store() {
    changes_equal_whole_snapshots(false).unwrap();
}

#[test]
fn refusals_name_their_reason_and_change_nothing() {
    let state = tmp("refuse");
    let dir = ServicesDir::new(&state);
    let first = json!({"generation": 5, "mode": "count", "serviceRanges": ["10.96.0.0/16"], "meshVIPs": ["10.96.9.9"],
                       "services": [svc(1, true), svc(2, false)]});
    apply_document(&dir, first.to_string().as_bytes()).unwrap();
    let before = |f: &str| fs::read(state.join("services").join(f)).unwrap();
    let (snap, layer) = (before("snapshot.json"), before("layer.bin"));
    let mut dup = svc(7, true);
    dup["vip"] = json!("10.96.0.2");
    let cases = [
        (json!({"baseGeneration": 4, "generation": 6}), "baseGeneration: 4 is not the stored generation 5"),
        (
            json!({"baseGeneration": 5, "generation": 6, "servicesRemoved": [{"namespace": "ns", "name": "nope"}]}),
            "servicesRemoved[0]: Service ns/nope is not in the stored generation 5",
        ),
        (json!({"baseGeneration": 5, "generation": 6, "servicesPut": [dup]}), "is also the VIP of services[0]"),
        (
            json!({"baseGeneration": 5, "generation": 6, "meshVIPsAdded": ["10.97.0.1"]}),
            "10.97.0.1 is outside every Service range",
        ),
        (
            json!({"baseGeneration": 5, "generation": 6, "meshVIPsAdded": ["10.96.9.9"]}),
            "meshVIPsAdded[0]: 10.96.9.9 is already a mesh VIP",
        ),
        (
            json!({"baseGeneration": 5, "generation": 6,
                "servicesRemoved": (0..MAX_CHANGED_ITEMS + 1).map(|i| json!({"namespace": "n", "name": format!("x{i}")})).collect::<Vec<_>>()}),
            "more than the limit of 10000",
        ),
    ];
    for (c, why) in cases {
        let e = apply_change(&dir, c.to_string().as_bytes()).unwrap_err();
        assert!(e.reasons().iter().any(|r| r.contains(why)), "{why}: {:?}", e.reasons());
        assert_eq!(before("snapshot.json"), snap, "{why}");
        assert_eq!(before("layer.bin"), layer, "{why}");
    }
    assert!(is_change(json!({"baseGeneration": 5}).to_string().as_bytes()));
    assert!(!is_change(&snap));
}

/// The negative control: an applier that loses endpoint flips is caught by the comparison.
#[test]
fn the_comparison_catches_a_wrong_change_applier() {
    assert!(changes_equal_whole_snapshots(true).is_err());
}

/// The canonical form, as a reviewed string: what `snapshot.json` holds after a change.
#[test]
fn the_canonical_form_is_compact_and_in_the_schema_order() {
    let s = snapshot::parse(
        json!({"generation": 3, "mode": "count", "serviceRanges": ["10.96.0.0/16", "fd00:10:96::/108"],
               "meshVIPs": ["10.96.9.9"], "services": [
                 {"namespace": "a\"b", "name": "s", "vip": "fd00:10:96::1", "usableEndpoints": false,
                  "ports": [{"protocol": "UDP", "port": 53}, {"port": 80, "protocol": "TCP"}]}]})
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    assert_eq!(
        String::from_utf8(render(&s)).unwrap(),
        "{\"generation\":3,\"mode\":\"count\",\"serviceRanges\":[\"10.96.0.0/16\",\"fd00:10:96::/108\"],\
         \"meshVIPs\":[\"10.96.9.9\"],\"dialledTimeoutSeconds\":3600,\"services\":[{\"namespace\":\"a\\\"b\",\
         \"name\":\"s\",\"vip\":\"fd00:10:96::1\",\"ports\":[{\"port\":53,\"protocol\":\"UDP\"},\
         {\"port\":80,\"protocol\":\"TCP\"}],\"usableEndpoints\":false}]}\n"
    );
}

/// A random change that may well be refused: names that are not there, VIPs taken or out of
/// range, ports twice, mesh VIPs that clash.
fn wild_change(rng: &mut Rng, base: &Snapshot) -> Value {
    let name = |rng: &mut Rng| match base.services.len() as u64 {
        n if n > 0 && rng.next(4) != 0 => base.services[rng.next(n) as usize].name.clone(),
        _ => format!("s{}", rng.next(60)),
    };
    let vip = |rng: &mut Rng| match rng.next(12) {
        0 => "10.97.0.1".to_string(),
        _ => format!("10.96.0.{}", 1 + rng.next(200)),
    };
    let mut c = json!({"baseGeneration": base.generation, "generation": base.generation + 1});
    for _ in 0..1 + rng.next(2) {
        let (key, item) = match rng.next(6) {
            0 | 1 => {
                let port = 80 + rng.next(2);
                let second = if rng.next(6) == 0 { port } else { 443 };
                let s = json!({"namespace": "ns", "name": name(rng), "vip": vip(rng), "usableEndpoints": rng.next(2) == 0,
                               "ports": [{"protocol": "TCP", "port": port}, {"protocol": "TCP", "port": second}]});
                ("servicesPut", s)
            }
            2 => ("servicesRemoved", json!({"namespace": "ns", "name": name(rng)})),
            3 => ("endpoints", json!({"namespace": "ns", "name": name(rng), "usableEndpoints": rng.next(2) == 0})),
            4 => ("meshVIPsAdded", json!(vip(rng))),
            _ => match base.mesh_vips.first() {
                Some(a) if rng.next(2) == 0 => ("meshVIPsRemoved", json!(a.to_string())),
                _ => ("meshVIPsRemoved", json!(vip(rng))),
            },
        };
        match c.get_mut(key).and_then(Value::as_array_mut) {
            Some(list) => list.push(item),
            None => c[key] = json!([item]),
        }
    }
    if rng.next(8) == 0 {
        c["mode"] = json!(["count", "refuse", "off"][rng.next(3) as usize]);
    }
    if rng.next(8) == 0 {
        c["dialledTimeoutSeconds"] = json!(1 + rng.next(100));
    }
    c
}

/// What the splice made against what the full reading makes of the same change.
fn same_as_full(s: &splice::Spliced, full: &Snapshot) -> Result<(), String> {
    if s.text != render(full) {
        return Err("the documents differ".into());
    }
    if !s.layer.ports.is_sorted() {
        return Err("the spliced layer's ports are not sorted".into());
    }
    let layer = |l| crate::services::StoredLayer::new(full.generation, l, 0);
    if layer(&s.layer) != layer(&full.layer(0)) {
        return Err("the layers differ".into());
    }
    Ok(())
}

/// The splice accepts exactly what the full reading accepts (but new ranges, which it leaves
/// to the full reading), and then stores the same bytes and the same layer; a change the
/// full reading refuses it never accepts.
fn splice_agrees_with_the_full_reading(wrong: bool) -> Result<(usize, usize), String> {
    let mut base = snapshot::parse(
        json!({"generation": 1, "mode": "refuse", "serviceRanges": ["10.96.0.0/24"], "meshVIPs": ["10.96.0.50"],
               "services": (0..30).map(|i| svc(i, i % 3 == 0)).collect::<Vec<_>>()})
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    let mut rng = Rng(0x0dd_5eed);
    let (mut accepted, mut refused) = (0, 0);
    for step in 0..600 {
        let c = parse(wild_change(&mut rng, &base).to_string().as_bytes()).map_err(|e| format!("{e:?}"))?;
        let text = render(&base);
        let stored = crate::services::StoredLayer::new(base.generation, &base.layer(0), 0);
        let spliced = splice::splice(std::borrow::Cow::Borrowed(&text), &stored.layer, base.generation, &c, None);
        let full = apply(base.clone(), &c).ok().and_then(|n| snapshot::parse(&render(&n)).ok());
        match (spliced, full) {
            (Some(s), Some(mut full)) => {
                if wrong {
                    // The deliberately wrong expectation: one Service's endpoints flipped.
                    if let Some(x) = full.services.first_mut() {
                        x.usable_endpoints = !x.usable_endpoints;
                    }
                }
                same_as_full(&s, &full).map_err(|e| format!("step {step}: {e}: {c:?}"))?;
                accepted += 1;
                base = full;
            }
            (None, None) => refused += 1,
            (Some(_), None) => return Err(format!("step {step}: the splice accepts what is refused: {c:?}")),
            (None, Some(_)) => return Err(format!("step {step}: the splice left an acceptable change: {c:?}")),
        }
    }
    Ok((accepted, refused))
}

#[test]
fn the_splice_stores_what_the_full_reading_stores_and_accepts_nothing_it_refuses() {
    let (accepted, refused) = splice_agrees_with_the_full_reading(false).unwrap();
    // Both kinds were tried, many times.
    assert!(accepted > 50 && refused > 50, "accepted {accepted}, refused {refused}");
}

/// The negative control: a wrong expectation is caught by the comparison.
#[test]
fn the_splice_comparison_catches_a_difference() {
    assert!(splice_agrees_with_the_full_reading(true).is_err());
}

/// Where a chain of splices stands: the canonical text and its layer (lists sorted, as
/// stored).
fn chain_start(services: u64) -> (Vec<u8>, aether_rules::services::ServiceLayer, u64) {
    let base = snapshot::parse(
        json!({"generation": 1, "mode": "refuse", "serviceRanges": ["10.96.0.0/16"], "meshVIPs": ["10.96.200.1"],
               "services": (0..services).map(|i| svc(i, i % 3 == 0)).collect::<Vec<_>>()})
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    (render(&base), crate::services::StoredLayer::new(1, &base.layer(0), 0).layer, 1)
}

/// Whether `index`, carried across splices, says what a scan of `text` would: every Service
/// where it starts, and nothing else.
fn exact(index: &splice::ServiceIndex, text: &[u8]) -> Result<(), String> {
    let body = &text[memchr::memmem::find(text, b"\"services\":[").unwrap() + 12..];
    let services = snapshot::parse(text).map_err(|e| format!("{e:?}"))?.services;
    for s in &services {
        let key = splice::key(&s.namespace, &s.name);
        let at = memchr::memmem::find(body, key.as_bytes());
        if index.start(index.hash(key.as_bytes())) != at {
            return Err(format!("the index has {}/{} elsewhere", s.namespace, s.name));
        }
    }
    if index.len() != Some(services.len()) {
        return Err(format!("the index holds {:?} Services, the document {}", index.len(), services.len()));
    }
    Ok(())
}

/// Makes `index` wrong, and plausibly so: each Service of `text` where the next one starts.
fn misplace(index: &mut splice::ServiceIndex, text: &[u8]) {
    let body = &text[memchr::memmem::find(text, b"\"services\":[").unwrap() + 12..];
    let keys: Vec<String> =
        snapshot::parse(text).unwrap().services.iter().map(|s| splice::key(&s.namespace, &s.name)).collect();
    let starts: Vec<usize> = keys.iter().map(|k| memchr::memmem::find(body, k.as_bytes()).unwrap()).collect();
    index.clear();
    for (k, &at) in keys.iter().zip(starts.iter().cycle().skip(1)) {
        index.note(index.hash(k.as_bytes()), at);
    }
}

/// A chain of splices started (`chain_start`) with a change that builds the index (by the
/// first Service looked up through it); the index's counts zero.
fn chain_with_index(services: u64) -> (Vec<u8>, aether_rules::services::ServiceLayer, u64, splice::ServiceIndex) {
    let (text, layer, generation) = chain_start(services);
    let mut index = splice::ServiceIndex::default();
    let c = json!({"baseGeneration": generation, "generation": generation + 1,
                   "endpoints": [{"namespace": "ns", "name": "s1", "usableEndpoints": true}]});
    let c = parse(c.to_string().as_bytes()).unwrap();
    let (text, layer, generation) = spliced_both_ways(&text, &layer, generation, &c, &mut index).unwrap().unwrap();
    assert!(index.len().is_some(), "the index is not built");
    (index.found, index.searched) = (0, 0);
    (text, layer, generation, index)
}

/// `c` spliced into `text` twice, by searching and through `index`: both must give the same
/// answer; the next text, layer and generation when accepted.
fn spliced_both_ways(
    text: &[u8],
    layer: &aether_rules::services::ServiceLayer,
    generation: u64,
    c: &Change,
    index: &mut splice::ServiceIndex,
) -> Result<Option<(Vec<u8>, aether_rules::services::ServiceLayer, u64)>, String> {
    let searched = splice::splice(std::borrow::Cow::Borrowed(text), layer, generation, c, None);
    let indexed = splice::splice(std::borrow::Cow::Borrowed(text), layer, generation, c, Some(index));
    match (searched, indexed) {
        (None, None) => Ok(None),
        (Some(a), Some(b)) => {
            if a.text != b.text {
                return Err("the documents differ".into());
            }
            if (&a.layer, &a.gone, &a.came) != (&b.layer, &b.gone, &b.came) {
                return Err("the layers differ".into());
            }
            // The next link of the chain, its lists sorted as stored.
            let next = snapshot::parse(&a.text).map_err(|e| format!("{e:?}"))?;
            let layer = crate::services::StoredLayer::new(next.generation, &next.layer(0), 0).layer;
            Ok(Some((a.text, layer, next.generation)))
        }
        (a, b) => Err(format!("accepted by searching: {}, through the index: {}", a.is_some(), b.is_some())),
    }
}

/// Random changes (the valid kind and the wild kind, refused often) spliced through an index
/// carried from change to change and by searching give byte-identical documents and layers;
/// the carried index stays exact.
/// `wrong`: before each change the index is made wrong (`misplace`). Returns the changes accepted and the index's counts (found, searched).
fn indexed_and_searched(wrong: bool) -> Result<(usize, u64, u64), String> {
    let (mut text, mut layer, mut generation, mut index) = chain_with_index(150);
    let mut rng = Rng(0x1dec_5eed);
    let mut next_id = 150;
    let mut accepted = 0;
    for step in 0..400 {
        let base = snapshot::parse(&text).map_err(|e| format!("{e:?}"))?;
        let c = if rng.next(2) == 0 {
            random_change(&mut rng, &mut base.clone(), &mut next_id)
        } else {
            wild_change(&mut rng, &base)
        };
        let c = parse(c.to_string().as_bytes()).map_err(|e| format!("{e:?}"))?;
        if wrong {
            misplace(&mut index, &text);
        }
        if let Some(next) = spliced_both_ways(&text, &layer, generation, &c, &mut index)
            .map_err(|e| format!("step {step}: {e}: {c:?}"))?
        {
            (text, layer, generation) = next;
            accepted += 1;
            if !wrong {
                exact(&index, &text).map_err(|e| format!("step {step}: {e}: {c:?}"))?;
            }
        }
    }
    Ok((accepted, index.found, index.searched))
}

#[test]
fn splices_through_the_index_and_by_searching_are_byte_identical() {
    let (accepted, found, _) = indexed_and_searched(false).unwrap();
    assert!(accepted > 100, "accepted {accepted}");
    assert!(found > 300, "the index found {found} Services");
}

/// A wrong index (every offset another Service's) changes nothing but that each Service is searched for:
/// no hint is used before it is checked.
#[test]
fn a_wrong_index_falls_back_to_the_search() {
    let (text, _, _, mut index) = chain_with_index(30);
    exact(&index, &text).unwrap();
    misplace(&mut index, &text);
    assert!(exact(&index, &text).is_err(), "RIG BROKEN: a misplaced index passes as exact");
    let (accepted, found, searched) = indexed_and_searched(true).unwrap();
    assert!(accepted > 100, "accepted {accepted}");
    assert_eq!(found, 0, "a wrong offset was taken");
    assert!(searched > 300, "searched {searched}");
}

/// Changes that touch only stored Services (flips, replacements, removals) and add new ones:
/// through the index, every stored Service is found at its offset (the Services appended by
/// earlier changes too) and the new ones are known absent, as the index holds every Service:
/// nothing is searched for. The index stays exact, also scanned again once it has logged
/// `MAX_MOVES` edits. Control: with the index's offsets wrong (and so not known to hold every
/// Service), every lookup is a search.
fn touched_found_and_searched(wrong: bool) -> ((u64, u64), (u64, u64, u64)) {
    let (mut text, mut layer, mut generation, mut index) = chain_with_index(150);
    let mut rng = Rng(0x0ff5_e7ed);
    let mut next_id = 300;
    let (mut stored, mut new, mut rescans) = (0, 0, 0);
    for step in 0..400 {
        let base = snapshot::parse(&text).unwrap();
        let mut c = json!({"baseGeneration": generation, "generation": generation + 1});
        let (mut put, mut removed, mut flips) = (Vec::new(), Vec::new(), Vec::new());
        let mut names = HashSet::new();
        for _ in 0..1 + rng.next(8) {
            let s = &base.services[rng.next(base.services.len() as u64) as usize];
            if !names.insert(s.name.clone()) {
                continue;
            }
            stored += 1;
            match rng.next(4) {
                0 => {
                    put.push(svc(next_id, true));
                    names.insert(format!("s{next_id}"));
                    next_id += 1;
                    new += 1;
                    stored -= 1;
                }
                1 if base.services.len() > 100 => removed.push(json!({"namespace": s.namespace, "name": s.name})),
                2 => {
                    put.push(json!({"namespace": s.namespace, "name": s.name, "vip": s.vip.to_string(),
                                    "ports": [{"protocol": "TCP", "port": 9000 + rng.next(100)}],
                                    "usableEndpoints": s.usable_endpoints}));
                }
                _ => flips
                    .push(json!({"namespace": s.namespace, "name": s.name, "usableEndpoints": !s.usable_endpoints})),
            }
        }
        c["servicesPut"] = json!(put);
        c["servicesRemoved"] = json!(removed);
        c["endpoints"] = json!(flips);
        let c = parse(c.to_string().as_bytes()).unwrap();
        if wrong {
            misplace(&mut index, &text);
        }
        let moves = index.moves();
        let next = spliced_both_ways(&text, &layer, generation, &c, &mut index).unwrap();
        (text, layer, generation) = next.unwrap_or_else(|| panic!("step {step}: refused: {c:?}"));
        if !wrong {
            exact(&index, &text).unwrap_or_else(|e| panic!("step {step}: {e}: {c:?}"));
            rescans += usize::from(index.moves() < moves);
        }
    }
    assert!(wrong || rescans > 0, "the index was never scanned again");
    ((stored, new), (index.found, index.searched, index.absent))
}

#[test]
fn the_index_spares_every_search() {
    let ((stored, new), counts) = touched_found_and_searched(false);
    assert!(stored > 600 && new > 100, "stored {stored}, new {new}");
    assert_eq!(counts, (stored, 0, new));
    // The control: the counts are of what was done.
    let ((stored, new), counts) = touched_found_and_searched(true);
    assert_eq!(counts, (0, stored + new, 0));
}

/// An index that stopped making sense midway through a document holds only the Services before
/// that place: a Service it lacks is searched for, never taken as absent.
#[test]
fn an_index_of_part_of_the_document_searches_for_what_it_lacks() {
    let (text, layer, generation) = chain_start(30);
    // The comma before the tenth Service spoiled, in a copy scanned by the index only.
    let body_at = memchr::memmem::find(&text, b"\"services\":[").unwrap() + 12;
    let tenth = snapshot::parse(&text).unwrap().services[10].clone();
    let key = splice::key(&tenth.namespace, &tenth.name);
    let at = body_at + memchr::memmem::find(&text[body_at..], key.as_bytes()).unwrap();
    let mut spoiled = text.clone();
    assert_eq!(spoiled[at - 1], b',');
    spoiled[at - 1] = b' ';
    let mut index = splice::ServiceIndex::default();
    index.build(&spoiled[body_at..spoiled.len() - super::SERVICES_END.len()]);
    assert_eq!(index.len(), Some(10));
    // The last Service, flipped: not in the index, found by the search.
    let last = snapshot::parse(&text).unwrap().services.last().unwrap().clone();
    let c = json!({"baseGeneration": generation, "generation": generation + 1,
                   "endpoints": [{"namespace": last.namespace, "name": last.name, "usableEndpoints": !last.usable_endpoints}]});
    let c = parse(c.to_string().as_bytes()).unwrap();
    let spliced = splice::splice(std::borrow::Cow::Borrowed(&text), &layer, generation, &c, Some(&mut index));
    assert!(spliced.is_some(), "the flip of a Service the partial index lacks was refused");
    assert_eq!((index.absent, index.searched), (0, 1));
}
