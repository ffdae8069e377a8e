use super::*;
use serde_json::json;

/// The reasons alone, as the tests read them.
fn parse(text: &[u8]) -> Result<Snapshot, Vec<String>> {
    super::parse(text).map_err(|r| r.reasons)
}

fn good() -> Value {
    json!({
        "generation": 3,
        "mode": "refuse",
        "serviceRanges": ["10.96.0.0/16", "10.200.0.7/32"],
        "meshVIPs": ["10.96.5.5"],
        "services": [
            {"namespace": "default", "name": "kubernetes", "vip": "10.96.0.1", "ports": [{"protocol": "TCP", "port": 443}], "usableEndpoints": true},
            {"namespace": "shop", "name": "cart", "vip": "10.96.1.1", "ports": [{"protocol": "TCP", "port": 80}, {"protocol": "UDP", "port": 18082}], "usableEndpoints": true},
            {"namespace": "shop", "name": "empty", "vip": "10.96.1.2", "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": false}
        ],
        "dialledTimeoutSeconds": 600
    })
}

#[test]
fn a_good_snapshot_parses_into_the_layer() {
    let s = parse(good().to_string().as_bytes()).unwrap();
    assert_eq!(s.generation, 3);
    let l = s.layer(0xae71);
    assert_eq!(l.ports.len(), 4);
    assert_eq!(l.dialled_timeout_secs, 600);
    assert_eq!(aether_rules::services::services_tables(&l).unwrap().len(), 1);
}

#[test]
fn the_example_parses() {
    let text = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/services/example.json")).unwrap();
    parse(&text).unwrap();
}

/// Each malformed document is refused with a message naming the place.
#[test]
fn malformed_snapshots_are_refused_naming_the_place() {
    type Tweak = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(Tweak, &str)> = vec![
        (
            Box::new(|v| v["serviceRanges"][0] = json!("10.96.0.0/33")),
            "serviceRanges[0]: \"10.96.0.0/33\" is not an IPv4 CIDR",
        ),
        (
            Box::new(|v| v["serviceRanges"][0] = json!("10.96.01.0/24")),
            "serviceRanges[0]: \"10.96.01.0/24\" is not an IPv4 CIDR",
        ),
        (
            Box::new(|v| v["serviceRanges"][0] = json!("10.96.0.5/16")),
            "serviceRanges[0]: \"10.96.0.5/16\" has host bits set",
        ),
        (
            Box::new(|v| v["serviceRanges"][1] = json!("fd00::/129")),
            "serviceRanges[1]: \"fd00::/129\" is not an IPv6 CIDR",
        ),
        (
            Box::new(|v| v["serviceRanges"][1] = json!("fd00::5/108")),
            "serviceRanges[1]: \"fd00::5/108\" has host bits set (the network is fd00::/108)",
        ),
        (
            Box::new(|v| v["serviceRanges"][1] = json!("fd00::7")),
            "serviceRanges[1]: \"fd00::7\" has no prefix length (write fd00::7/128",
        ),
        (
            Box::new(|v| v["serviceRanges"][1] = json!("fe80::/64")),
            "serviceRanges[1]: \"fe80::/64\" overlaps fe80::/10, which is never a Service range",
        ),
        (Box::new(|v| v["serviceRanges"][1] = json!("::/0")), "serviceRanges[1]: \"::/0\" overlaps ::/128"),
        (
            Box::new(|v| v["serviceRanges"][1] = json!("::ffff:10.96.0.0/112")),
            "serviceRanges[1]: \"::ffff:10.96.0.0/112\" is not an IPv6 CIDR",
        ),
        (
            Box::new(|v| v["services"][2]["vip"] = json!("fd00::g")),
            "services[2].vip: \"fd00::g\" is not an IPv6 address",
        ),
        (
            Box::new(|v| v["serviceRanges"][1] = json!("10.96.3.0/24")),
            "serviceRanges[1]: \"10.96.3.0/24\" overlaps serviceRanges[0]",
        ),
        (
            Box::new(|v| v["serviceRanges"][1] = json!("10.200.0.7")),
            "serviceRanges[1]: \"10.200.0.7\" has no prefix length",
        ),
        (
            Box::new(|v| v["serviceRanges"][1] = json!("127.0.0.0/8")),
            "serviceRanges[1]: \"127.0.0.0/8\" overlaps loopback",
        ),
        (Box::new(|v| v["services"][1]["ports"][0]["port"] = json!(0)), "services[1].ports[0].port: 0 is not a port"),
        (
            Box::new(|v| v["services"][1]["ports"][0]["port"] = json!(70000)),
            "services[1].ports[0].port: 70000 is not a port",
        ),
        (
            Box::new(|v| v["services"][1]["ports"][1] = json!({"protocol": "TCP", "port": 80})),
            "services[1].ports[1]: tcp/80 is declared twice",
        ),
        (
            Box::new(|v| v["services"][1]["ports"][0]["protocol"] = json!("SCTP")),
            "services[1].ports[0].protocol: SCTP is not supported",
        ),
        (
            Box::new(|v| v["services"][2]["name"] = json!("cart")),
            "services[2]: Service shop/cart duplicates services[1]",
        ),
        (
            Box::new(|v| v["services"][2]["vip"] = json!("10.96.1.1")),
            "services[2].vip: 10.96.1.1 is also the VIP of services[1]",
        ),
        (
            Box::new(|v| v["services"][2]["vip"] = json!("192.168.1.1")),
            "services[2].vip: 192.168.1.1 is outside every Service range",
        ),
        (
            Box::new(|v| v["services"][2]["vip"] = json!("10.96.1.300")),
            "services[2].vip: \"10.96.1.300\" is not an IPv4 address",
        ),
        (Box::new(|v| v["services"][2]["vip"] = json!("10.96.5.5")), "services[2].vip: 10.96.5.5 is also a mesh VIP"),
        (Box::new(|v| v["services"][0]["ports"] = json!([])), "services[0].ports: empty"),
        (
            Box::new(|v| v["services"][0]["usableEndpoints"] = json!("yes")),
            "services[0].usableEndpoints: \"yes\" is not true or false",
        ),
        (Box::new(|v| v["services"][0]["selector"] = json!({})), "services[0].selector: unknown field"),
        (
            Box::new(|v| v["meshVIPs"] = json!(["10.96.5.5", "10.96.5.5"])),
            "meshVIPs[1]: 10.96.5.5 duplicates meshVIPs[0]",
        ),
        (Box::new(|v| v["meshVIPs"] = json!(["8.8.8.8"])), "meshVIPs[0]: 8.8.8.8 is outside every Service range"),
        (Box::new(|v| v["mode"] = json!("enforce")), "mode: \"enforce\" is not one of off, count, refuse"),
        (Box::new(|v| v["generation"] = json!(-1)), "generation: -1 is not a positive integer"),
        (
            Box::new(|v| {
                v.as_object_mut().unwrap().remove("generation");
            }),
            "generation: missing",
        ),
        (Box::new(|v| v["dialledTimeoutSeconds"] = json!(0)), "dialledTimeoutSeconds: 0 is not a number of seconds"),
        (Box::new(|v| v["serviceRange"] = json!([])), "serviceRange: unknown field"),
        (Box::new(|v| v["serviceRanges"] = json!([])), "serviceRanges: empty, but mode is not off"),
        (Box::new(|v| *v = json!([1, 2])), "the snapshot must be a JSON object"),
    ];
    assert!(cases.len() >= 15);
    for (tweak, want) in cases {
        let mut v = good();
        tweak(&mut v);
        let errs = parse(v.to_string().as_bytes()).expect_err(want);
        assert!(errs.iter().any(|e| e.starts_with(want)), "want {want:?}, got {errs:#?}");
    }
    let errs = parse(b"{\"generation\": 1,").unwrap_err();
    assert!(errs[0].starts_with("the snapshot is not JSON"), "{errs:?}");
}

/// The typed reading (the fast one) takes a valid document, and reads it exactly as the
/// thorough one does.
#[test]
fn both_readings_agree_on_a_valid_document() {
    for text in [
        good().to_string(),
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/services/example.json")).unwrap(),
    ] {
        let fast = well_formed(text.as_bytes()).expect("the typed reading takes it");
        assert_eq!(Ok(fast), parse_reporting(text.as_bytes()));
    }
}

#[test]
fn limits_are_named_and_huge_values_never_echoed() {
    let mut v = good();
    v["services"][0]["ports"] = json!((1..=101).map(|p| json!({"protocol": "TCP", "port": p})).collect::<Vec<_>>());
    let errs = parse(v.to_string().as_bytes()).unwrap_err();
    assert_eq!(errs, ["services[0].ports: 101 ports, more than the limit of 100"]);
    let mut v = good();
    v["serviceRanges"] = json!((0..257).map(|i| format!("10.{i}.0.0/16")).collect::<Vec<_>>());
    let errs = parse(v.to_string().as_bytes()).unwrap_err();
    assert!(errs.iter().any(|e| e == "serviceRanges: 257 ranges, more than the limit of 256"), "{errs:?}");
    let mut v = good();
    v["services"][1]["vip"] = json!("x".repeat(1 << 20));
    v["mode"] = json!("y".repeat(1 << 20));
    for e in parse(v.to_string().as_bytes()).unwrap_err() {
        assert!(e.len() < 200, "{} bytes echoed", e.len());
        assert!(
            e.ends_with("(1048578 bytes) is not an IPv4 address") || e.contains("(1048578 bytes) is not one of"),
            "{e}"
        );
    }
    let huge = vec![b' '; MAX_SNAPSHOT_BYTES + 1];
    assert_eq!(parse(&huge).unwrap_err(), [too_large()]);
}

#[test]
fn all_problems_are_reported_at_once() {
    let mut v = good();
    v["services"][1]["ports"][0]["port"] = json!(0);
    v["mode"] = json!("x");
    assert_eq!(parse(v.to_string().as_bytes()).unwrap_err().len(), 2);
}

/// A dual-stack snapshot: IPv6 ranges, VIPs and mesh VIPs, checked by the same rules
/// (inside a range, no duplicates, compared as addresses), read the same by both readings.
fn dual() -> Value {
    let mut v = good();
    v["serviceRanges"] = json!(["10.96.0.0/16", "10.200.0.7/32", "fd00:10:96::/108", "fd00:200::7/128"]);
    v["meshVIPs"] = json!(["10.96.5.5", "fd00:10:96::5:5"]);
    v["services"].as_array_mut().unwrap().extend([
        json!({"namespace": "default", "name": "kubernetes-v6", "vip": "fd00:10:96::1", "ports": [{"protocol": "TCP", "port": 443}], "usableEndpoints": true}),
        json!({"namespace": "shop", "name": "cart-v6", "vip": "fd00:10:96::1:1", "ports": [{"protocol": "UDP", "port": 18082}], "usableEndpoints": false}),
    ]);
    v
}

#[test]
fn ipv6_ranges_vips_and_mesh_vips_are_accepted_and_checked_the_same_way() {
    let text = dual().to_string();
    let s = parse(text.as_bytes()).unwrap();
    assert_eq!(s.service_ranges.len(), 4);
    let l = s.layer(0xae71);
    assert_eq!(l.families(), [aether_rules::Family::Ipv4, aether_rules::Family::Ipv6]);
    assert_eq!(l.ports.iter().filter(|p| p.vip.is_ipv6()).count(), 2);
    assert_eq!(Ok(well_formed(text.as_bytes()).expect("the typed reading takes it")), parse_reporting(text.as_bytes()));
    type Tweak = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(Tweak, &str)> = vec![
        (
            Box::new(|v| v["services"][4]["vip"] = json!("fd00:11::1")),
            "services[4].vip: fd00:11::1 is outside every Service range",
        ),
        (
            Box::new(|v| v["meshVIPs"] = json!(["fd00:10:96::5:5", "fd00:10:96:0::5:5"])),
            "meshVIPs[1]: fd00:10:96::5:5 duplicates meshVIPs[0]",
        ),
        (
            Box::new(|v| v["services"][4]["vip"] = json!("fd00:10:96:0:0::1")),
            "services[4].vip: fd00:10:96::1 is also the VIP of services[3]",
        ),
        (
            Box::new(|v| v["services"][4]["vip"] = json!("fd00:10:96::5:5")),
            "services[4].vip: fd00:10:96::5:5 is also a mesh VIP",
        ),
        (
            Box::new(|v| v["serviceRanges"][3] = json!("fd00:10:96::100/120")),
            "serviceRanges[3]: \"fd00:10:96::100/120\" overlaps serviceRanges[2] (fd00:10:96::/108)",
        ),
        (
            Box::new(|v| v["meshVIPs"][1] = json!("::ffff:10.96.5.5")),
            "meshVIPs[1]: \"::ffff:10.96.5.5\" is not an IPv6 address",
        ),
    ];
    for (tweak, want) in cases {
        let mut v = dual();
        tweak(&mut v);
        let errs = parse(v.to_string().as_bytes()).expect_err(want);
        assert!(errs.iter().any(|e| e.starts_with(want)), "want {want:?}, got {errs:#?}");
    }
    // An IPv6-only cluster: IPv6 ranges alone are enough for a layer.
    let mut v6 = dual();
    v6["serviceRanges"] = json!(["fd00:10:96::/108"]);
    v6["meshVIPs"] = json!(["fd00:10:96::5:5"]);
    let keep: Vec<Value> = v6["services"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["vip"].as_str().unwrap().contains(':'))
        .cloned()
        .collect();
    v6["services"] = json!(keep);
    let l = parse(v6.to_string().as_bytes()).unwrap().layer(0xae71);
    assert_eq!(l.families(), [aether_rules::Family::Ipv6]);
}

/// A member given twice (at the top or in a Service) is refused with the typed reading's
/// reason, never read as its last value by the JSON tree of the thorough reading.
#[test]
fn a_member_given_twice_is_refused_not_read_as_the_last() {
    let text = good().to_string();
    let twice = text.replacen("\"generation\":3", "\"generation\":4,\"generation\":5", 1);
    assert_ne!(twice, text);
    let errs = parse(twice.as_bytes()).unwrap_err();
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(errs[0].starts_with("the snapshot is not well formed: duplicate field `generation`"), "{errs:?}");
    let vip_twice = text.replacen("\"vip\":\"10.96.1.2\"", "\"vip\":\"10.96.1.2\",\"vip\":\"10.96.1.3\"", 1);
    assert_ne!(vip_twice, text);
    let errs = parse(vip_twice.as_bytes()).unwrap_err();
    assert!(errs[0].contains("duplicate field `vip`"), "{errs:?}");
    // Control: the document itself is accepted.
    assert!(parse(text.as_bytes()).is_ok());
}

/// `relations`' maps index by a hash's low bits: the VIPs of one range, which differ only in
/// their last octets, must spread over them (the multiply alone left their low 16 bits
/// equal, and 10,000 VIPs in one chain). Control: the same VIPs before the final fold.
#[test]
fn the_quick_hash_spreads_the_vips_of_one_range_over_its_low_bits() {
    use std::hash::{BuildHasher, Hash, Hasher};
    let vips = (0..4096u32).map(|i| IpAddr::from(std::net::Ipv4Addr::from(0x0a60_0000 + i)));
    let (mut folded, mut unfolded) = (std::collections::BTreeSet::new(), std::collections::BTreeSet::new());
    for vip in vips {
        let mut h = Quick.build_hasher();
        vip.hash(&mut h);
        folded.insert(h.finish() & 0xfff);
        unfolded.insert(h.0 & 0xfff);
    }
    // 4096 keys in 4096 buckets: a random hash fills about 63% of them.
    assert!(folded.len() > 2400, "{} of 4096 buckets used", folded.len());
    assert!(unfolded.len() < 16, "control: {} of 4096 buckets used", unfolded.len());
}

/// A small xorshift: a failure's documents are reproducible from the seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// `fast`'s scanner answers only what serde's typed reading answers: on 8,000 random edits
/// of good documents (whitespace, escapes, non-ASCII text, numbers written otherwise, members
/// twice or unknown, cut or doubled bytes), whenever it reads a document, serde reads the same
/// snapshot from it. Controls: it does read the plain ones (the comparison is not empty), and
/// leaves to serde what it does not read (serde reads escapes it gives up on). The same for
/// the layer it reads straight from the text: `parse`'s, only where `parse` accepts (control:
/// documents it scans but refuses between their items, a VIP twice, say).
#[test]
fn the_fast_reading_answers_only_what_the_typed_reading_answers() {
    const EDITS: [&str; 24] = [
        " ",
        "\n",
        "\t",
        "\r",
        ",",
        ":",
        "\"",
        "\\",
        "\\u0061",
        "\u{e9}",
        "\u{7f}",
        "\u{1}",
        "0",
        "00",
        "-",
        ".0",
        "e1",
        "null",
        "true",
        "{}",
        "[]",
        "\"x\":1",
        "\"generation\":9,",
        "18446744073709551616",
    ];
    let docs: Vec<String> =
        [good(), dual()].iter().flat_map(|v| [v.to_string(), serde_json::to_string_pretty(v).unwrap()]).collect();
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let (mut read_fast, mut left_to_serde_and_read, mut layered, mut refused_between_items) = (0, 0, 0, 0);
    for round in 0..8000 {
        let mut text = docs[rng.next(docs.len())].clone().into_bytes();
        for _ in 0..1 + rng.next(3) {
            let at = rng.next(text.len() + 1);
            match rng.next(7) {
                0 => drop(text.splice(at..at, EDITS[rng.next(EDITS.len())].bytes())),
                // Still the plain form, often refused between items: a VIP twice or outside
                // the ranges, a port declared twice, a Service twice.
                6 if text.get(at).is_some_and(u8::is_ascii_digit) => text[at] = b'0' + rng.next(10) as u8,
                // Valid JSON kept: a letter as an escape (the same string, or no longer a
                // keyword), whitespace after punctuation.
                4 if text.get(at).is_some_and(u8::is_ascii_lowercase) => {
                    let escape = format!("\\u{:04x}", text[at]);
                    drop(text.splice(at..=at, escape.bytes()));
                }
                5 if text.get(at).is_some_and(|b| b",:[{".contains(b)) => {
                    drop(text.splice(at + 1..at + 1, [b' ', b'\n', b'\t', b'\r'][rng.next(4)..].iter().copied()))
                }
                1 if at < text.len() => drop(text.remove(at)),
                2 if at + 1 < text.len() => text.swap(at, at + 1),
                _ => {
                    let end = (at + 1 + rng.next(12)).min(text.len());
                    let copy = text[at..end].to_vec();
                    drop(text.splice(at..at, copy));
                }
            }
        }
        let (fast, typed) = (fast::read(&text), typed(&text));
        if fast.is_some() {
            read_fast += 1;
            assert_eq!(fast, typed, "round {round}: {}", String::from_utf8_lossy(&text));
        } else if typed.is_some() {
            left_to_serde_and_read += 1;
        }
        // The layer read straight from the text is `parse`'s, and only ever when `parse`
        // accepts.
        let parsed = parse(&text).ok().map(|s| (s.generation, s.layer(0)));
        match fast::read_layer(&text) {
            Some(layer) => {
                layered += 1;
                assert_eq!(Some(layer), parsed, "round {round}: {}", String::from_utf8_lossy(&text));
            }
            None if fast.is_some() && parsed.is_none() => refused_between_items += 1,
            None => {}
        }
    }
    assert!(layered > 300 && refused_between_items > 40, "{layered} layers, {refused_between_items} refused");
    for text in &docs {
        assert_eq!(fast::read(text.as_bytes()), typed(text.as_bytes()));
        assert!(fast::read(text.as_bytes()).is_some(), "control: the plain form is read by the scanner");
    }
    assert!(
        read_fast > 500 && left_to_serde_and_read > 200,
        "{read_fast} read fast, {left_to_serde_and_read} by serde"
    );
    // A name with an escape: left to serde, which reads it as the name it spells.
    let escaped = good().to_string().replace("\"cart\"", "\"c\\u0061rt\"");
    assert_eq!(fast::read(escaped.as_bytes()), None);
    assert_eq!(parse(escaped.as_bytes()), parse(good().to_string().as_bytes()));
}

/// `parse_layer` is `parse` and its layer: for the plain form (read by the scanner), for a
/// document the scanner leaves to serde (an escape), and in a refusal's every reason (one
/// between items, one of an item).
#[test]
fn parse_layer_is_parse_and_its_layer() {
    let plain = good().to_string();
    let escaped = plain.replace("\"cart\"", "\"c\\u0061rt\"");
    assert!(fast::read_layer(plain.as_bytes()).is_some() && fast::read_layer(escaped.as_bytes()).is_none());
    for text in [&plain, &escaped] {
        let s = super::parse(text.as_bytes()).unwrap();
        assert_eq!(parse_layer(text.as_bytes()).unwrap(), (s.generation, s.layer(0)));
    }
    let mut vip_twice = good();
    vip_twice["services"][1]["vip"] = json!("10.96.0.1");
    let mut bad_mode = good();
    bad_mode["mode"] = json!("x");
    for v in [vip_twice, bad_mode] {
        let text = v.to_string();
        let refused = parse_layer(text.as_bytes()).unwrap_err();
        assert!(!refused.reasons.is_empty());
        assert_eq!(refused, super::parse(text.as_bytes()).unwrap_err());
    }
}
