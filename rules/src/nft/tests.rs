use super::*;

fn table() -> Table {
    let mut cfg = crate::CaptureConfig::new(crate::CaptureMode::RedirectAll);
    cfg.dns = Some(crate::DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 18054 });
    crate::capture_ruleset(&cfg).unwrap().halves.remove(0).table
}

/// A dual-stack pod's two tables.
fn dual() -> Vec<Table> {
    let mut cfg = crate::CaptureConfig::new(crate::CaptureMode::RedirectAll);
    cfg.families = Family::ALL.to_vec();
    cfg.dns = Some(crate::DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 18054 });
    cfg.dns_ipv6 = Some(crate::DnsDivert { host_ip: "fd00::1".parse().unwrap(), port: 18054 });
    crate::capture_ruleset(&cfg).unwrap().halves.into_iter().map(|h| h.table).collect()
}

fn intact(t: &Table) {
    let actual = kernel_view(t.family, &t.name).unwrap().expect("the table is there");
    assert_eq!(read::diff(&expected_view(t), &actual), Vec::<String>::new());
    let rules = |v: &TableView| v.chains.iter().map(|c| c.rules.len()).sum::<usize>();
    assert_eq!(rules(&actual), t.chains.iter().map(|c| c.rules.len()).sum::<usize>());
}

/// The tables of every capture mode and exclusion mix, and the Service layer in count
/// and refuse mode.
pub(super) fn all_tables() -> Vec<Table> {
    use crate::services::{services_tables, LayerMode, ServiceLayer, ServicePort};
    let mut out = Vec::new();
    for mode in [crate::CaptureMode::RedirectAll, crate::CaptureMode::Scoped] {
        for (dns, exclusions) in [(false, false), (true, false), (true, true)] {
            let mut cfg = crate::CaptureConfig::new(mode);
            cfg.families = Family::ALL.to_vec();
            if dns {
                cfg.dns = Some(crate::DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 18054 });
                cfg.dns_ipv6 = Some(crate::DnsDivert { host_ip: "fd00::1".parse().unwrap(), port: 18054 });
            }
            if exclusions {
                cfg.excluded_cidrs = ["10.1.0.0/16", "240.0.0.0/4", "fd00:1::/32", "2001:db8::7/128"]
                    .map(|n| n.parse::<ipnet::IpNet>().unwrap().trunc())
                    .to_vec();
                cfg.excluded_ports = vec!["8080".parse().unwrap(), "65000-65535".parse().unwrap()];
            }
            out.extend(crate::capture_ruleset(&cfg).unwrap().halves.into_iter().map(|h| h.table));
        }
    }
    for mode in [LayerMode::Count, LayerMode::Refuse] {
        let mut l = ServiceLayer::new(mode);
        l.ranges = vec!["10.96.0.0/16".parse().unwrap(), "fd00:10:96::/108".parse().unwrap()];
        l.mesh_vips = vec!["10.96.5.5".parse().unwrap(), "fd00:10:96::5:5".parse().unwrap()];
        // More ports than one element message holds: the elements go in chunks.
        l.ports = (0..600u32)
            .flat_map(|i| {
                [
                    std::net::IpAddr::from(std::net::Ipv4Addr::from(0x0a60_0100 + i)),
                    std::net::IpAddr::from(std::net::Ipv6Addr::from(
                        0xfd00_0010_0096_0000_0000_0000_0001_0000 + i as u128,
                    )),
                ]
            })
            .enumerate()
            .map(|(i, vip)| ServicePort { vip, proto: crate::model::Proto::Tcp, port: 80, has_endpoints: i % 3 != 0 })
            .collect();
        let tables = services_tables(&l).unwrap();
        assert_eq!(tables.len(), 2, "one table per family");
        out.extend(tables);
    }
    out
}

/// The crate's own reading of a raw nftables message.
fn crate_read(bytes: &[u8]) -> NfTablesMessage {
    match NetlinkMessage::<NetfilterMessage>::deserialize(bytes).unwrap().payload {
        NetlinkPayload::InnerMessage(NetfilterMessage { inner: NetfilterMessageInner::NfTables(m), .. }) => m,
        other => panic!("not an nftables message: {other:?}"),
    }
}

/// A message of a batch encoded where it is (`render::ByRef`) has the bytes of the crate's
/// own message; `read::fast_rule` reads every rule of every table as the crate's parser does, typed
/// expression for typed expression (meta, cmp, payload, immediate, lookup, bitwise and the
/// others as raw attributes). The control: the bytes of a rule with one expression's name
/// changed read as something else, and still as the crate reads them.
#[test]
fn fast_rule_reads_as_the_crate_does() {
    const NEWRULE: u16 = (10 << 8) | 6;
    let mut rules = Vec::new();
    for t in all_tables() {
        let batch = render::table_batch(&t, Existing::Refuse);
        for ((part, _), family) in batch.messages.iter().zip(&batch.families) {
            let bytes = crate::netlink::encode(render::message(*family, part.message()), 0, 1);
            if let render::Part::Message(m) = part {
                let by_ref = crate::netlink::encode(render::ByRef::new(*family, m), 0, 1);
                assert_eq!(by_ref, bytes, "a message encoded where it is differs from its copy's bytes");
            }
            if u16::from_ne_bytes([bytes[4], bytes[5]]) == NEWRULE {
                assert_eq!(read::fast_rule(&bytes), Some(crate_read(&bytes)));
                rules.push(bytes);
            }
        }
    }
    assert!(rules.len() > 100, "only {} rules read", rules.len());
    let mut renamed = rules.into_iter().find(|b| b.windows(4).any(|w| w == b"cmp\0")).expect("a rule with cmp");
    let at = renamed.windows(4).position(|w| w == b"cmp\0").unwrap();
    let original = crate_read(&renamed);
    renamed[at + 2] = b'q';
    assert_ne!(read::fast_rule(&renamed), Some(original), "a renamed expression reads the same");
    assert_eq!(read::fast_rule(&renamed), Some(crate_read(&renamed)));
}

/// What we send survives the wire: each batch, serialized and parsed back as bytes (as
/// the kernel's dumps are), reads as the same view, expression for expression.
#[test]
fn every_batch_parses_back_from_its_bytes_to_the_same_view() {
    for t in all_tables() {
        let batch = render::table_batch(&t, Existing::Refuse);
        let bytes = batch.encode(1);
        let mut parsed = Vec::new();
        let mut rest = &bytes[..];
        while !rest.is_empty() {
            let len = u32::from_ne_bytes(rest[..4].try_into().unwrap()) as usize;
            parsed.extend(parse(&rest[..len]).unwrap());
            rest = &rest[len.div_ceil(4) * 4..];
        }
        assert_eq!(parsed.len(), batch.messages.len(), "{}: begin and end delimit the messages", t.name);
        let back = TableView::from_messages(&t.name, &parsed);
        assert_eq!(back, expected_view(&t), "{}", t.name);
        assert!(back.chains.iter().flat_map(|c| &c.rules).all(|r| !r
            .exprs
            .0
            .iter()
            .any(|e| matches!(e, Expr::Other { .. }))));
    }
}

/// A guarded batch is the plain one but for the begin marker's generation attribute (at
/// `GUARD_AT`, in a marker grown by it) and the ACK its last message asks for: the same
/// messages, numbered alike, each other flag as it was.
#[test]
fn a_guarded_batch_differs_only_in_its_guard_and_its_last_acknowledgement() {
    let batch = render::table_batch(&table(), Existing::Refuse);
    let (plain, guarded) = (batch.encode(5), batch.encode_guarded(5));
    let split = |bytes| crate::netlink::split(bytes).unwrap();
    let (plain, guarded) = (split(&plain), split(&guarded));
    assert_eq!(plain.len(), guarded.len());
    let (begin, rest) = guarded.split_first().unwrap();
    let plain_begin = plain[0].bytes;
    assert_eq!(begin.bytes.len(), plain_begin.len() + 8, "the marker grows by the attribute");
    assert_eq!(begin.bytes[4..plain_begin.len()], plain_begin[4..], "the marker's header and nfgenmsg are unchanged");
    let header = [8u16.to_ne_bytes(), abi::NFNL_BATCH_GENID.to_ne_bytes()].concat();
    assert_eq!(begin.bytes[abi::GUARD_AT - 4..abi::GUARD_AT], header[..], "length 8, type NFNL_BATCH_GENID");
    let last = rest.len() - 2;
    for (i, (g, p)) in rest.iter().zip(&plain[1..]).enumerate() {
        let ack = if i == last { netlink_packet_core::NLM_F_ACK } else { 0 };
        assert_eq!(g.flags, p.flags | ack, "message {i}'s flags");
        assert_eq!(
            (&g.bytes[..6], &g.bytes[8..]),
            (&p.bytes[..6], &p.bytes[8..]),
            "message {i} is otherwise unchanged"
        );
    }
}

/// The lookup before the transaction is a window: whatever happens to the table in it,
/// the netns ends with exactly one intact table.
#[test]
fn a_stale_lookup_still_leaves_one_intact_table() {
    if !aether_testkit::root_or_skip("a_stale_lookup_still_leaves_one_intact_table") {
        return;
    }
    let t = table();
    aether_netns::run_in_private(|| {
        let mut sock = open().unwrap();
        // Created after a lookup that found none: the exclusive create is refused and
        // the table replaced, not merged into (which would double every rule).
        program(&t).unwrap();
        program_on(&mut sock, &t, &BTreeMap::new(), false).unwrap();
        intact(&t);
        // Deleted after a lookup that found it: the replace creates it first.
        assert!(remove(t.family, &t.name).unwrap());
        program_on(&mut sock, &t, &BTreeMap::new(), true).unwrap();
        intact(&t);
        // A re-program replaces; removing twice finds nothing the second time.
        program(&t).unwrap();
        intact(&t);
        assert!(remove(t.family, &t.name).unwrap());
        assert!(!remove(t.family, &t.name).unwrap());
        assert!(kernel_view(t.family, &t.name).unwrap().is_none());
    })
    .unwrap();
}

/// The generation moves with every committed transaction in the netns, whatever table or
/// family it changed, and with nothing that only reads; each netns has its own.
#[test]
fn the_generation_moves_with_each_commit_and_never_with_a_read() {
    if !aether_testkit::root_or_skip("the_generation_moves_with_each_commit_and_never_with_a_read") {
        return;
    }
    let tables = dual();
    aether_netns::run_in_private(|| {
        let start = generation().unwrap();
        assert_eq!(generation().unwrap(), start, "asking again changes nothing");
        program(&tables[0]).unwrap();
        let programmed = generation().unwrap();
        assert_ne!(programmed, start, "a commit moves it");
        // Reads of every kind: the table, its counters, its sets' elements.
        kernel_view(Family::Ipv4, &tables[0].name).unwrap().unwrap();
        counters(Family::Ipv4, &tables[0].name).unwrap();
        set_elements(Family::Ipv4, &tables[0].name, crate::capture::SET_EXCLUDED_NETS).unwrap();
        assert_eq!(generation().unwrap(), programmed, "reads leave it");
        // Another family's table, then a removal: each a commit.
        program(&tables[1]).unwrap();
        let both = generation().unwrap();
        assert_ne!(both, programmed);
        assert!(remove(Family::Ipv6, &tables[1].name).unwrap());
        assert_ne!(generation().unwrap(), both);
        // Another netns has a generation of its own, untouched by these commits.
        let elsewhere = aether_netns::run_in_private(|| generation().unwrap()).unwrap();
        let again = aether_netns::run_in_private(|| generation().unwrap()).unwrap();
        assert_eq!(elsewhere, again, "two fresh netns start alike: the value alone names no netns");
    })
    .unwrap();
}

/// A dual-stack pod's tables go in one transaction: both, or (when the kernel refuses
/// one) neither; same-named tables of the two families are two tables, read, replaced
/// and removed each on its own.
#[test]
fn both_families_go_in_one_transaction() {
    if !aether_testkit::root_or_skip("both_families_go_in_one_transaction") {
        return;
    }
    let tables = dual();
    let refs: Vec<&Table> = tables.iter().collect();
    assert_eq!((tables[0].family, tables[1].family), (Family::Ipv4, Family::Ipv6));
    aether_netns::run_in_private(|| {
        program_tables(&refs).unwrap();
        tables.iter().for_each(intact);
        // Again: both replaced, still one of each.
        program_tables(&refs).unwrap();
        tables.iter().for_each(intact);
        assert!(remove(Family::Ipv6, &tables[1].name).unwrap());
        assert!(kernel_view(Family::Ipv6, &tables[1].name).unwrap().is_none());
        intact(&tables[0]);
        // One there, one not: the missing one is created, the other replaced.
        program_tables(&refs).unwrap();
        tables.iter().for_each(intact);
        for t in &tables {
            assert!(remove(t.family, &t.name).unwrap());
        }
        // All or nothing: a broken IPv6 table (a rule naming a set it lacks) takes the
        // IPv4 one down with it.
        let mut broken = tables[1].clone();
        broken.sets.clear();
        let err = program_tables(&[&tables[0], &broken]).unwrap_err().to_string();
        assert!(err.contains("table ip6 aether_capture"), "{err}");
        for t in &tables {
            assert!(kernel_view(t.family, &t.name).unwrap().is_none(), "{} left behind", t.family);
        }
    })
    .unwrap();
}

/// The netfilter sockets open in this thread's netns (the tests' private ones: no other test's).
fn netfilter_sockets_here() -> usize {
    let list = std::fs::read_to_string("/proc/thread-self/net/netlink").unwrap();
    list.lines().skip(1).filter(|l| l.split_whitespace().nth(1) == Some("12")).count()
}

/// While a `CloseLater` lives, every netfilter socket the thread lets go of (a removal's, a
/// dump's) stays open, so that the kernel's wait at a close comes once, at its end.
#[test]
fn a_close_later_keeps_every_netfilter_socket_until_it_ends() {
    if !aether_testkit::root_or_skip("a_close_later_keeps_every_netfilter_socket_until_it_ends") {
        return;
    }
    let t = table();
    aether_netns::run_in_private(|| {
        program(&t).unwrap();
        let before = netfilter_sockets_here();
        {
            let _later = CloseLater::new();
            assert!(remove(t.family, &t.name).unwrap());
            assert!(counters(t.family, &t.name).unwrap().is_empty());
            assert_eq!(
                netfilter_sockets_here(),
                before + 2,
                "the removal's and the dump's sockets were closed at once"
            );
        }
        assert_eq!(netfilter_sockets_here(), before, "the sockets were not closed when the CloseLater ended");
        // Control: without one, each is closed when let go.
        program(&t).unwrap();
        assert!(remove(t.family, &t.name).unwrap());
        assert_eq!(netfilter_sockets_here(), before);
    })
    .unwrap();
}

/// A put-off ended by `into_open` hands its sockets over open, closed when they are dropped,
/// and leaves an outer put-off as it was.
#[test]
fn a_close_later_hands_its_sockets_over_open() {
    if !aether_testkit::root_or_skip("a_close_later_hands_its_sockets_over_open") {
        return;
    }
    let t = table();
    aether_netns::run_in_private(|| {
        program(&t).unwrap();
        let before = netfilter_sockets_here();
        let outer = CloseLater::new();
        let inner = CloseLater::new();
        assert!(remove(t.family, &t.name).unwrap());
        let open = inner.into_open();
        assert!(!open.is_empty());
        assert_eq!(netfilter_sockets_here(), before + 1, "the removal's socket was closed when handed over");
        drop(open);
        assert_eq!(netfilter_sockets_here(), before, "the handed-over socket was not closed when dropped");
        // The outer put-off still holds what is let go of after the inner ended.
        assert!(counters(t.family, &t.name).unwrap().is_empty());
        assert_eq!(netfilter_sockets_here(), before + 1, "the outer put-off was lost when the inner was handed over");
        drop(outer);
        assert_eq!(netfilter_sockets_here(), before);
    })
    .unwrap();
}

/// A set's dump read across a resize of its hash table names some element twice (and misses
/// as many); one read whole names each once. An interval's end may share the next start's key.
#[test]
fn a_dump_that_names_an_element_twice_is_told_apart() {
    use netlink_packet_netfilter::nftables::{DataAttribute, ListAttribute, SetElementAttribute, SetElementFlags};
    let chunk = |elems: &[(u8, bool)]| {
        NfTablesMessage::NewSetElement(SetElementMessage {
            attributes: vec![
                SetElementList::Table("aether_svc".into()),
                SetElementList::Set("service_vips".into()),
                SetElementList::Elements(
                    elems
                        .iter()
                        .map(|&(k, end)| {
                            let mut e = vec![SetElementAttribute::Key(DataAttribute::Value(vec![10, 64, 0, k]))];
                            if end {
                                e.push(SetElementAttribute::Flags(SetElementFlags::IntervalEnd));
                            }
                            ListAttribute::Element(e)
                        })
                        .collect(),
                ),
            ],
        })
    };
    let whole = [chunk(&[(1, false), (2, false)]), chunk(&[(3, false), (4, false)])];
    assert!(!read::names_an_element_twice(&whole, "aether_svc"));
    let across_a_resize = [chunk(&[(1, false), (2, false)]), chunk(&[(2, false), (4, false)])];
    assert!(read::names_an_element_twice(&across_a_resize, "aether_svc"));
    let adjacent_intervals = [chunk(&[(1, false), (2, true)]), chunk(&[(2, false), (3, true)])];
    assert!(!read::names_an_element_twice(&adjacent_intervals, "aether_svc"));
}
