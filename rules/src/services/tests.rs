use super::*;
use crate::model::Table;

fn layer() -> ServiceLayer {
    let mut l = ServiceLayer::new(LayerMode::Refuse);
    l.ranges = vec!["10.96.0.0/16".parse().unwrap(), "10.200.0.7/32".parse().unwrap()];
    l.mesh_vips = vec!["10.96.5.5".parse().unwrap()];
    l.ports = vec![
        ServicePort { vip: "10.96.1.1".parse().unwrap(), proto: Proto::Tcp, port: 80, has_endpoints: true },
        ServicePort { vip: "10.96.1.2".parse().unwrap(), proto: Proto::Tcp, port: 80, has_endpoints: false },
    ];
    l
}

/// The one table of a layer of one family.
fn one_table(l: &ServiceLayer) -> Table {
    let mut t = services_tables(l).unwrap();
    assert_eq!(t.len(), 1);
    t.remove(0)
}

/// `layer()` plus IPv6 ranges, a mesh VIP and Service ports.
fn dual() -> ServiceLayer {
    let mut l = layer();
    l.ranges.extend(["fd00:10:96::/108".parse::<IpNet>().unwrap(), "fd00:200::7/128".parse().unwrap()]);
    l.mesh_vips.push("fd00:10:96::5:5".parse().unwrap());
    l.ports.extend([
        ServicePort { vip: "fd00:10:96::1:1".parse().unwrap(), proto: Proto::Tcp, port: 80, has_endpoints: true },
        ServicePort { vip: "fd00:10:96::1:2".parse().unwrap(), proto: Proto::Udp, port: 53, has_endpoints: false },
    ]);
    l
}

#[test]
fn off_has_no_table() {
    assert!(services_tables(&ServiceLayer::new(LayerMode::Off)).unwrap().is_empty());
}

#[test]
fn first_addresses_are_never_refused() {
    let got: Vec<String> = layer().never_refused().iter().map(|a| a.to_string()).collect();
    assert_eq!(got, ["10.96.0.1", "10.200.0.7"]);
}

/// Rules grow with the port profiles, never with the Services: 5,000 Services of two
/// profiles have the rules of the fewest Services that give those profiles chains; and a table never has more
/// than the fixed rules plus `MAX_PROFILE_CHAINS` chains of `MAX_PROFILE_PORTS` + 1.
#[test]
fn rule_count_does_not_grow_with_services() {
    let rules = |t: &Table| t.chains.iter().map(|c| c.rules.len()).sum::<usize>();
    let with = |n: u32, port: fn(u32) -> u16| {
        let mut l = layer();
        for i in 0..n {
            l.ports.push(ServicePort {
                vip: std::net::Ipv4Addr::from(0x0a60_4000 + i).into(),
                proto: Proto::Tcp,
                port: port(i),
                has_endpoints: i % 7 != 0,
            });
        }
        one_table(&l)
    };
    // One Service in 7 lacks endpoints: both profiles have chains from 7 x the minimum on.
    let (small, big) = (with(7 * MIN_SERVICES_PER_PROFILE as u32, |_| 443), with(5000, |_| 443));
    assert_eq!(rules(&small), rules(&big));
    assert!(big.chains.iter().flat_map(|c| &c.rules).all(|r| !r.comment.is_empty()));
    // 5,000 distinct profiles: the most shared get chains, up to the bound; the rest are
    // looked up by key.
    let many = with(5000, |i| 1000 + i as u16);
    let fixed = rules(&one_table(&ServiceLayer { ports: Vec::new(), ..layer() }));
    assert!(rules(&many) <= fixed + MAX_PROFILE_CHAINS * (MAX_PROFILE_PORTS + 1), "{} rules", rules(&many));
    let keyed =
        |t: &Table| t.sets.iter().filter(|s| s.key == KeyType::ServiceKey).map(|s| s.elements.len()).sum::<usize>();
    assert!(keyed(&many) >= 5000 - MAX_PROFILE_CHAINS, "the rest by key: {}", keyed(&many));
}

/// `l` with `n - 1` more Services of each Service's ports (VIPs 256 apart, IPv6 ones
/// 65,536 apart), so every profile is shared by `n` Services.
fn copies(l: &ServiceLayer, n: u32) -> ServiceLayer {
    let mut out = l.clone();
    for k in 1..n {
        out.ports.extend(l.ports.iter().map(|p| ServicePort {
            vip: match p.vip {
                IpAddr::V4(a) => std::net::Ipv4Addr::from(u32::from(a) + 256 * k).into(),
                IpAddr::V6(a) => std::net::Ipv6Addr::from(u128::from(a) + (u128::from(k) << 16)).into(),
            },
            ..*p
        }));
    }
    out
}

/// Each Service VIP is one element of the data map, to its profile's number, which the
/// small verdict map sends to the profile's chain when `MIN_SERVICES_PER_PROFILE` Services
/// share it, else (0) to `by_key`, its ports then in the keyed sets. A profile chain has a
/// rule per port, then "not declared".
#[test]
fn a_service_is_one_map_element_to_its_profiles_chain() {
    let map_of = |t: &Table| {
        let map = t.sets.iter().find(|s| s.name == SET_VIPS).unwrap().clone();
        let chains = t.sets.iter().find(|s| s.name == SET_PROFILE_CHAINS).unwrap().clone();
        assert_eq!((&map.data, chains.key), (&SetData::Number, KeyType::Mark));
        let chain_of = |n: u32| match chains.elements.iter().find(|e| matches!(e, Element::Goto(k, _) if *k == n)) {
            Some(Element::Goto(_, i)) => chains.data.chains()[usize::from(*i)].clone(),
            e => panic!("number {n} in the verdict map: {e:?}"),
        };
        assert_eq!(chains.elements.len(), chains.data.chains().len(), "a number per chain, no more");
        map.elements
            .iter()
            .map(|e| match e {
                Element::Numbered(a, n) => (a.to_string(), chain_of(*n)),
                e => panic!("{e} in the data map"),
            })
            .collect::<BTreeMap<String, String>>()
    };
    let keyed =
        |t: &Table| t.sets.iter().filter(|s| s.key == KeyType::ServiceKey).map(|s| s.elements.len()).sum::<usize>();
    let few = one_table(&copies(&layer(), MIN_SERVICES_PER_PROFILE as u32 - 1));
    assert!(map_of(&few).values().all(|c| c == CHAIN_BY_KEY));
    assert_eq!(keyed(&few), 2 * (MIN_SERVICES_PER_PROFILE - 1));
    assert!(!few.chains.iter().any(|c| c.name.starts_with(PROFILE_CHAIN_PREFIX)));
    let t = one_table(&copies(&layer(), MIN_SERVICES_PER_PROFILE as u32));
    let map = map_of(&t);
    assert_eq!((map["10.96.1.1"].as_str(), map["10.96.1.2"].as_str()), ("ports_tcp80", "ports_tcp80-noep"));
    assert_eq!(map.len(), 2 * MIN_SERVICES_PER_PROFILE);
    assert_eq!(keyed(&t), 0);
    let chain = t.chains.iter().find(|c| c.name == "ports_tcp80-noep").unwrap();
    assert_eq!(chain.rules[0].action, Action::SetMark(crate::capture::DIVERT_MARK), "the mark set back first");
    assert_eq!(chain.rules[1].matches, [Match::Dport(Proto::Tcp, 80)]);
    assert_eq!(chain.rules[1].action, Action::CountJump("refused_no_endpoints".into(), CHAIN_REFUSE.into()));
    assert_eq!(chain.rules[2].action, Action::CountJump("refused_port_not_declared".into(), CHAIN_REFUSE.into()));
}

/// `profile_chains` (the count over sorted ports a node makes on every change) decides as
/// the table builder does, on random layers of both families with ports listed twice.
#[test]
fn profile_chains_decide_as_the_builder_does() {
    let mut seed = 0x9e37_79b9_u64;
    let mut next = move |m: u64| {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % m
    };
    for round in 0..100 {
        let mut l = ServiceLayer { ports: Vec::new(), ..dual() };
        for i in 0..(50 + next(200)) {
            let vip: IpAddr = if i % 3 == 0 {
                std::net::Ipv6Addr::from(0xfd00_0010_0096_0000_0000_0000_0001_0000u128 + u128::from(i)).into()
            } else {
                std::net::Ipv4Addr::from(0x0a60_1000 + i as u32).into()
            };
            for _ in 0..1 + next(3) {
                let proto = if next(4) == 0 { Proto::Udp } else { Proto::Tcp };
                l.ports.push(ServicePort { vip, proto, port: 80 + next(3) as u16, has_endpoints: next(5) != 0 });
            }
        }
        if round % 2 == 0 {
            l.ports.sort();
        }
        let builder: ProfileChains = l
            .families()
            .into_iter()
            .map(|f| (f, chained_profiles(&service_profiles(&l, f))))
            .filter(|(_, c)| !c.is_empty())
            .collect();
        let mut counted = l.profile_chains();
        counted.retain(|_, c| !c.is_empty());
        assert_eq!(counted, builder, "round {round}");
    }
}

/// Counts moved by the Services a change touches decide as counts made over the new layer,
/// change after change (here 300 of them, each a few Services added, removed, re-ported or
/// flipped, in both families); and counts moved by the wrong Services do not.
#[test]
fn counts_moved_by_a_change_decide_as_counts_made_anew() {
    let mut rng = aether_testkit::Rng::new(0x51ed_2701);
    let vip = |i: u64| -> IpAddr {
        if i.is_multiple_of(3) {
            std::net::Ipv6Addr::from(0xfd00_0010_0096_0000_0000_0000_0001_0000u128 + u128::from(i)).into()
        } else {
            std::net::Ipv4Addr::from(0x0a60_1000 + i as u32).into()
        }
    };
    let next_ports = |v: IpAddr, rng: &mut aether_testkit::Rng| -> Vec<ServicePort> {
        (0..1 + rng.below(2))
            .map(|_| ServicePort {
                vip: v,
                proto: Proto::Tcp,
                port: 80 + rng.below(2) as u16,
                has_endpoints: !rng.chance(4),
            })
            .collect()
    };
    let mut ports: Vec<ServicePort> = (0..400).flat_map(|i| next_ports(vip(i), &mut rng)).collect();
    ports.sort();
    let mut counts = ProfileCounts::of(&ports);
    let touched_ports = |ports: &[ServicePort], touched: &[IpAddr]| -> Vec<ServicePort> {
        ports.iter().filter(|p| touched.binary_search(&p.vip).is_ok()).copied().collect()
    };
    for round in 0..300 {
        let mut touched: Vec<IpAddr> = (0..1 + rng.below(4)).map(|_| vip(rng.below(500))).collect();
        touched.sort();
        touched.dedup();
        let gone = touched_ports(&ports, &touched);
        let mut new: Vec<ServicePort> =
            ports.iter().filter(|p| touched.binary_search(&p.vip).is_err()).copied().collect();
        // Each touched VIP: removed (one in four), or given ports anew.
        for &v in &touched {
            if !rng.chance(4) {
                new.extend(next_ports(v, &mut rng));
            }
        }
        new.sort();
        let came = touched_ports(&new, &touched);
        counts = counts.moved(&gone, &came);
        assert_eq!(counts.chains(), ProfileCounts::of(&new).chains(), "round {round}");
        ports = new;
    }
    assert!(!counts.chains().is_empty(), "the rounds never gave a profile a chain: the test proves nothing");
    // Control: counts never moved for the Services removed decide otherwise, somewhere.
    let wrong = ProfileCounts::of(&ports);
    let mut differed = false;
    for _ in 0..200 {
        let v = vip(rng.below(400));
        ports.retain(|p| p.vip != v);
        differed |= wrong.chains() != ProfileCounts::of(&ports).chains();
    }
    assert!(differed, "counts that never took a removed Service out decided as the right ones");
}

/// One element per Service where profiles are shared; three where none is.
#[test]
fn the_layers_size_counts_one_element_per_service_where_profiles_are_shared() {
    let fixed = ServiceLayer { ports: Vec::new(), ..layer() }.size().unwrap();
    let shared = copies(&layer(), 100).size().unwrap();
    // layer(): 10.96.1.1 (two ports) and 10.96.1.2, each now shared by 100 Services; and
    // the two profiles' numbers in the verdict map.
    assert_eq!(shared.elements, fixed.elements + 200 + 2);
    assert_eq!(shared.chains, fixed.chains + 2);
    let mut unshared = ServiceLayer { ports: Vec::new(), ..layer() };
    for i in 0..100u32 {
        for port in [80, 1000 + i as u16] {
            let vip = std::net::Ipv4Addr::from(0x0a60_4000 + i).into();
            unshared.ports.push(ServicePort { vip, proto: Proto::Tcp, port, has_endpoints: true });
        }
    }
    assert_eq!(unshared.element_count().unwrap(), fixed.elements + 300);
    for l in [layer(), dual(), copies(&dual(), 20), unshared, ServiceLayer { mode: LayerMode::Count, ..dual() }] {
        assert_eq!(l.element_count().unwrap(), l.size().unwrap().elements, "counted as built: {l:?}");
    }
    assert_eq!(ServiceLayer::new(LayerMode::Off).size().unwrap(), LayerSize::default());
}

/// A profile that comes to be shared by `MIN_SERVICES_PER_PROFILE` Services gets its
/// chain by a change (no rebuild): the chain added with its number in the verdict map, its
/// Services' map elements given that number, their keyed ports removed; and back.
#[test]
fn a_profile_chain_comes_and_goes_by_a_change() {
    let mut one = ServiceLayer { ports: Vec::new(), ..layer() };
    one.ports.push(ServicePort {
        vip: "10.96.7.1".parse().unwrap(),
        proto: Proto::Tcp,
        port: 443,
        has_endpoints: true,
    });
    let below = copies(&one, MIN_SERVICES_PER_PROFILE as u32 - 1);
    let at = copies(&one, MIN_SERVICES_PER_PROFILE as u32);
    let n = MIN_SERVICES_PER_PROFILE;
    let up = LayerChange::between(&below, &at).unwrap().expect("a change, not a rebuild");
    assert_eq!(up.changes[0].1.add_chains.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["ports_tcp443"]);
    // n map elements added (n - 1 of them again, with the new number) and the number's
    // chain, n - 1 deleted and n - 1 keyed ports deleted.
    assert_eq!((up.added(), up.removed()), (n + 1, 2 * (n - 1)));
    let down = LayerChange::between(&at, &below).unwrap().unwrap();
    assert_eq!(down.changes[0].1.delete_chains, ["ports_tcp443"]);
    assert_eq!((down.added(), down.removed()), (2 * (n - 1), n + 1));
}

#[test]
fn count_and_refuse_differ_only_in_the_refusing_set() {
    let mut l = layer();
    l.mode = LayerMode::Count;
    let count = one_table(&l);
    l.mode = LayerMode::Refuse;
    let refuse = one_table(&l);
    assert_eq!(count.chains, refuse.chains, "a mode change must not change rules (it would rebuild the table)");
    let refusing = |t: &Table| t.sets.iter().find(|s| s.name == SET_REFUSING).unwrap().elements.clone();
    assert_eq!(refusing(&count), vec![]);
    assert_eq!(refusing(&refuse), vec![Element::Proto(Proto::Tcp), Element::Proto(Proto::Udp)]);
    // In count mode the refuse chain lets everything pass first.
    let chain = count.chains.iter().find(|c| c.name == CHAIN_REFUSE).unwrap();
    assert_eq!(chain.rules[0].matches, vec![Match::L4ProtoNotInSet(SET_REFUSING.into())]);
    assert_eq!(chain.rules[0].action, Action::Accept);
}

/// An IPv4 snapshot gives one `ip` table; IPv6 ranges add an `ip6` table with the same
/// chains and rules, holding only the IPv6 elements (and the IPv4 table only the IPv4 ones).
#[test]
fn each_family_with_ranges_gets_its_table_with_its_own_elements() {
    assert_eq!(layer().families(), [Family::Ipv4]);
    let v4_only = one_table(&layer());
    let tables = services_tables(&dual()).unwrap();
    assert_eq!(tables.iter().map(|t| t.family).collect::<Vec<_>>(), [Family::Ipv4, Family::Ipv6]);
    assert_eq!(tables[0], v4_only, "IPv6 ranges leave the IPv4 table as it was");
    let (v4, v6) = (&tables[0], &tables[1]);
    let fixed =
        |t: &Table| t.chains.iter().filter(|c| !c.name.starts_with(PROFILE_CHAIN_PREFIX)).cloned().collect::<Vec<_>>();
    assert_eq!(fixed(v4), fixed(v6), "the same rules in both families, beside each family's profile chains");
    assert_eq!(v4.counters, v6.counters);
    let elements = |t: &Table, set: &str| {
        t.sets.iter().find(|s| s.name == set).unwrap().elements.iter().map(|e| e.to_string()).collect::<Vec<_>>()
    };
    assert_eq!(elements(v6, SET_RANGES), ["fd00:10:96::/108", "fd00:200::7/128"]);
    assert_eq!(elements(v6, SET_MESH_VIPS), ["fd00:10:96::5:5"]);
    assert_eq!(elements(v6, SET_SERVICE_PORTS), ["fd00:10:96::1:1 . tcp . 80"]);
    assert_eq!(elements(v6, SET_EMPTY), ["fd00:10:96::1:2 . udp . 53"]);
    assert_eq!(elements(v6, SET_VIPS), ["fd00:10:96::1:1 : 0x00000000", "fd00:10:96::1:2 : 0x00000000"]);
    assert_eq!(elements(v6, SET_PROFILE_CHAINS), ["0x00000000 : goto #0"]);
    let map = v6.sets.iter().find(|s| s.name == SET_PROFILE_CHAINS).unwrap();
    assert_eq!(map.data.chains(), [CHAIN_BY_KEY]);
    assert_eq!(elements(v6, SET_NEVER_REFUSED), ["fd00:10:96::1", "fd00:200::7"]);
    assert_eq!(elements(v6, SET_REFUSING), ["tcp", "udp"]);
    let key = |t: &Table, set: &str| t.sets.iter().find(|s| s.name == set).unwrap().key;
    assert_eq!(key(v6, SET_SERVICE_PORTS), KeyType::ServiceKey6);
    assert_eq!(key(v6, SET_DIALLED), KeyType::ServiceKey6);
    assert_eq!(key(v6, SET_RANGES), KeyType::Ipv6Addr);
    // An IPv6-only snapshot: the ip6 table alone.
    let mut v6_only = dual();
    v6_only.ranges.retain(|r| matches!(r, IpNet::V6(_)));
    assert_eq!(services_tables(&v6_only).unwrap().iter().map(|t| t.family).collect::<Vec<_>>(), [Family::Ipv6]);
}

/// The never-refused first address, per family, in each family's own arithmetic.
#[test]
fn first_addresses_are_never_refused_in_both_families() {
    let got: Vec<String> = dual().never_refused().iter().map(|a| a.to_string()).collect();
    assert_eq!(got, ["10.96.0.1", "10.200.0.7", "fd00:10:96::1", "fd00:200::7"]);
}

/// A change of IPv6 ports is an element change of the ip6 table alone; a new family is a
/// rebuild.
#[test]
fn a_change_stays_in_its_family() {
    let mut more = dual();
    more.ports.push(ServicePort {
        vip: "fd00:10:96::1:3".parse().unwrap(),
        proto: Proto::Tcp,
        port: 443,
        has_endpoints: true,
    });
    let change = LayerChange::between(&dual(), &more).unwrap().expect("an element change");
    assert_eq!((change.added(), change.removed()), (2, 0), "service_vips and service_ports");
    assert_eq!(change.changes.iter().map(|(f, _)| *f).collect::<Vec<_>>(), [Family::Ipv6]);
    assert!(LayerChange::between(&layer(), &dual()).unwrap().is_none(), "a new family rebuilds");
}
