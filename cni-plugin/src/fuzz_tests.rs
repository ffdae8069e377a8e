//! Fuzzing, on the stable toolchain, of every parser a stranger controls: the network
//! configuration (stdin, from the runtime and whoever wrote the conflist), `prevResult` (the
//! previous plugin's output), pod annotations (anyone who can create a pod), the Service
//! snapshot (the agent), and stored records and `layer.bin` (the state directory). Property-based: random
//! documents built from the fields each parser knows, with hostile values, plus raw bytes.
//!
//! Properties: never a panic; every refusal carries a code the CNI spec gives for it; no
//! error message grows with the input (a huge value is never echoed). The run is bounded
//! (`PROPTEST_CASES`, default 256 per property; `make test` runs it); findings are kept as
//! the named regression tests at the end.

use proptest::prelude::*;
use serde_json::{json, Map, Value};

use aether_node::{config, state};

use crate::cni;
use crate::error::CniError;

/// The parsers as the plugin answers them: through the one mapping to CNI codes.
fn parse(stdin: &[u8]) -> Result<config::NetConf, CniError> {
    Ok(config::parse(stdin)?)
}

fn effective(
    conf: &config::NetConf,
    pod_namespace: Option<&str>,
) -> Result<Option<aether_rules::CaptureConfig>, CniError> {
    Ok(config::effective(conf, pod_namespace)?)
}

/// Strings a stranger might send: empty, numbers as text, hex, CIDRs good and bad, very
/// long, control characters and non-ASCII.
fn hostile_string() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("0x".into()),
        Just("0xae71".into()),
        Just("10.0.0.0/8".into()),
        Just("300.1.1.1/24".into()),
        Just("10.0.0.1/33".into()),
        Just("010.0.0.1".into()),
        Just("::1/128".into()),
        Just("fd00::/129".into()),
        Just("fd00:10:96::/108".into()),
        Just("fd00:10:96::1".into()),
        Just("::ffff:10.96.0.1".into()),
        Just("fe80::1%eth0".into()),
        Just("fd00::5/108".into()),
        Just("1-65535".into()),
        Just("9000-80".into()),
        Just("80,http, ,".into()),
        Just("redirect-all".into()),
        Just("scoped".into()),
        Just("disabled".into()),
        Just("true".into()),
        Just("1.1.0".into()),
        Just("0.4.0".into()),
        Just("\u{0}\u{7f}\n\"\\".into()),
        Just("é😀\u{202e}".into()),
        (1usize..20_000).prop_map(|n| "9".repeat(n)),
        (1usize..2_000).prop_map(|n| "10.1.1.1,".repeat(n)),
        any::<String>(),
    ]
}

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(|f| json!(f)),
        (0u64..70_000).prop_map(|n| json!(n)),
    ]
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number(),
        hostile_string().prop_map(Value::String)
    ]
}

/// A JSON value whose objects use `keys` (the parser's own field names) and random ones.
fn value_with_keys(keys: &'static [&'static str]) -> impl Strategy<Value = Value> {
    leaf().prop_recursive(4, 64, 8, move |inner| {
        let key = prop_oneof![4 => proptest::sample::select(keys).prop_map(str::to_string), 1 => hostile_string()];
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::vec((key, inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// The annotations the plugin reads.
const ANNOTATION_KEYS: &[&str] = &[
    "aether.io/capture",
    "aether.io/exclude-outbound-ports",
    "aether.io/exclude-outbound-cidrs",
    "aether.io/capture-dns",
];

/// Every key a network configuration may carry: the spec's and this plugin's own fields, taken
/// from the parser's own lists (a field added there is fuzzed here too), plus the keys of the
/// nested objects and the annotations.
fn conf_keys() -> &'static [&'static str] {
    static KEYS: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
    KEYS.get_or_init(|| {
        let nested = ["cni.dev/valid-attachments", "cni.dev/attachments", "containerID", "ifname"];
        let mut keys: Vec<&'static str> = config::SPEC_FIELDS.iter().chain(&config::OWN_FIELDS).copied().collect();
        keys.extend(nested);
        keys.push("io.kubernetes.cri.pod-annotations");
        keys.extend(ANNOTATION_KEYS);
        keys
    })
}

const RESULT_KEYS: &[&str] = &[
    "cniVersion",
    "interfaces",
    "ips",
    "routes",
    "dns",
    "name",
    "mac",
    "sandbox",
    "mtu",
    "socketPath",
    "pciID",
    "address",
    "gateway",
    "interface",
    "version",
    "dst",
    "gw",
    "advmss",
    "priority",
    "table",
    "scope",
    "nameservers",
    "domain",
    "search",
    "options",
];

const SNAPSHOT_KEYS: &[&str] = &[
    "generation",
    "mode",
    "serviceRanges",
    "meshVIPs",
    "services",
    "dialledTimeoutSeconds",
    "namespace",
    "name",
    "vip",
    "ports",
    "protocol",
    "port",
    "usableEndpoints",
];

const RECORD_KEYS: &[&str] = &[
    "version",
    "network",
    "containerId",
    "ifname",
    "netns",
    "netnsId",
    "dev",
    "ino",
    "cookie",
    "podNamespace",
    "podName",
    "configDigest",
    "capture",
    "mode",
    "capturePort",
    "meshL4Port",
    "scopedPorts",
    "dns",
    "hostIp",
    "port",
    "excludedCidrs",
    "excludedPorts",
    "divertMark",
    "passthroughMark",
    "routeTable",
    "rulePriority",
];

/// A valid base configuration with `extra`'s fields laid over it: deep enough to reach the
/// checks after the first field.
fn conf_over(extra: &Value) -> Vec<u8> {
    let mut base = json!({"cniVersion": "1.0.0", "name": "k8s", "type": "aether-cni", "hostIP": "10.0.0.1",
        "stateDir": "/nonexistent/aether-fuzz"});
    if let Value::Object(m) = extra {
        for (k, v) in m {
            if k != "stateDir" && k != "logFile" {
                base[k] = v.clone();
            }
        }
    }
    base.to_string().into_bytes()
}

/// The longest message an error may carry whatever the input: field names, a 64-character
/// prefix of the value, and the explanation.
const MESSAGE_BOUND: usize = 1200;

fn cases() -> ProptestConfig {
    ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn network_configuration_never_panics_and_refuses_with_a_spec_code(extra in value_with_keys(conf_keys())) {
        let stdin = conf_over(&extra);
        match parse(&stdin) {
            Ok(conf) => {
                // What ADD and CHECK then read from it must not panic either.
                if let Err(e) = effective(&conf, Some("shop")) {
                    prop_assert_eq!(e.code, 7, "{}", e.msg);
                    prop_assert!(e.msg.len() < MESSAGE_BOUND, "{} bytes", e.msg.len());
                }
                if let Some(prev) = &conf.prev_result {
                    if let Err(e) = cni::check_prev_result(&conf.cni_version, prev) {
                        prop_assert!([1, 6].contains(&e.code), "{}", e.msg);
                    }
                }
            }
            Err(e) => {
                prop_assert!([1, 2, 6, 7].contains(&e.code), "code {}: {}", e.code, e.msg);
                prop_assert!(e.msg.len() < MESSAGE_BOUND, "{} bytes: {}", e.msg.len(), aether_node::text::clip(&e.msg, 200));
            }
        }
    }

    #[test]
    fn raw_bytes_on_stdin_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Err(e) = parse(&bytes) {
            prop_assert!([1, 2, 6, 7].contains(&e.code), "code {}: {}", e.code, e.msg);
        }
        let _ = cni::version_of(&bytes);
    }

    #[test]
    fn prev_result_never_panics_and_refuses_with_code_1_or_6(
        prev in value_with_keys(RESULT_KEYS),
        version in proptest::sample::select(&config::SUPPORTED_VERSIONS[..]),
    ) {
        if let Err(e) = cni::check_prev_result(version, &prev) {
            prop_assert!([1, 6].contains(&e.code), "code {}: {}", e.code, e.msg);
            prop_assert!(e.msg.len() < MESSAGE_BOUND, "{} bytes", e.msg.len());
        }
    }

    #[test]
    fn a_well_shaped_prev_result_with_hostile_addresses_is_checked_not_trusted(
        address in hostile_string(), gateway in hostile_string(), dst in hostile_string(),
    ) {
        let prev = json!({"cniVersion": "1.0.0", "ips": [{"address": address, "gateway": gateway}],
            "routes": [{"dst": dst}]});
        let parsed_cidr = |s: &str| s.split_once('/').is_some_and(|(a, p)| {
            a.parse::<std::net::IpAddr>().is_ok_and(|ip| p.parse::<u8>().is_ok_and(|p| p <= if ip.is_ipv4() { 32 } else { 128 }) && p.len() <= 3 && p.bytes().all(|b| b.is_ascii_digit()))
        });
        let valid = parsed_cidr(&address) && gateway.parse::<std::net::IpAddr>().is_ok() && parsed_cidr(&dst);
        prop_assert_eq!(cni::check_prev_result("1.0.0", &prev).is_ok(), valid, "{}", prev);
    }

    #[test]
    fn annotations_never_panic_and_refuse_with_code_7(
        annotations in proptest::collection::btree_map(
            proptest::sample::select(ANNOTATION_KEYS.to_vec()).prop_map(str::to_string),
            prop_oneof![4 => hostile_string().prop_map(Value::String), 1 => leaf()],
            0..5,
        ),
    ) {
        let extra = json!({"runtimeConfig": {config::POD_ANNOTATIONS_CAPABILITY: annotations}});
        let conf = parse(&conf_over(&extra)).expect("annotations are read by ADD and CHECK only");
        if let Err(e) = effective(&conf, Some("shop")) {
            prop_assert_eq!(e.code, 7, "{}", e.msg);
            prop_assert!(e.msg.len() < MESSAGE_BOUND, "{} bytes", e.msg.len());
        }
    }

    #[test]
    fn a_service_snapshot_never_panics(doc in value_with_keys(SNAPSHOT_KEYS)) {
        let text = doc.to_string();
        if let Err(aether_node::services::snapshot::Refused { reasons: errs }) = aether_node::services::snapshot::parse(text.as_bytes()) {
            prop_assert!(!errs.is_empty());
        }
    }

    /// `layer.bin` holds what it was given, whatever the mix of families, and a damaged copy
    /// (any byte changed, any length cut) is refused as such, never a panic nor a wrong layer.
    #[test]
    fn a_layer_file_round_trips_and_damage_is_refused(
        ranges in proptest::collection::vec((any::<bool>(), any::<u128>(), 0u8..=128), 0..6),
        vips in proptest::collection::vec((any::<u128>(), any::<bool>(), 1u16.., any::<bool>(), any::<bool>()), 0..40),
        flip in (any::<usize>(), 1u8..),
        cut in any::<usize>(),
    ) {
        use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
        use aether_rules::services::{LayerMode, ServiceLayer, ServicePort};
        use aether_node::services::layer_file::{decode, StoredLayer};
        let addr = |v6: bool, bits: u128| if v6 { IpAddr::V6(Ipv6Addr::from(bits)) } else { IpAddr::V4(Ipv4Addr::from(bits as u32)) };
        let mut l = ServiceLayer::new(LayerMode::Refuse);
        l.ranges = ranges.iter().map(|&(v6, bits, p)| ipnet::IpNet::new(addr(v6, bits), if v6 { p } else { p % 33 }).unwrap().trunc()).collect();
        l.mesh_vips = vips.iter().filter(|v| v.4).map(|v| addr(v.1, v.0)).collect();
        l.ports = vips.iter().map(|&(bits, v6, port, udp, ends)| ServicePort {
            vip: addr(v6, bits),
            proto: if udp { aether_rules::model::Proto::Udp } else { aether_rules::model::Proto::Tcp },
            port,
            has_endpoints: ends,
        }).collect();
        let stored = StoredLayer::new(7, &l, 9);
        let bytes = stored.encode();
        let path = std::path::Path::new("layer.bin");
        prop_assert_eq!(decode(path, &bytes).unwrap(), stored.clone());
        let mut damaged = bytes.clone();
        let at = flip.0 % damaged.len();
        damaged[at] ^= flip.1;
        prop_assert!(decode(path, &damaged).is_err(), "byte {} changed, still read", at);
        prop_assert!(decode(path, &bytes[..cut % bytes.len()]).is_err());
    }

    #[test]
    fn a_stored_record_never_panics(doc in value_with_keys(RECORD_KEYS), bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        let _ = state::parse_record(doc.to_string().as_bytes());
        let _ = state::parse_record(&bytes);
    }
}

// Findings, kept as regression tests.

/// A prefix length with a sign or leading spaces is not one (Go's ParseCIDR refuses "+24").
#[test]
fn finding_a_signed_prefix_is_not_a_cidr() {
    for bad in ["10.0.0.1/+24", "10.0.0.1/ 24", "10.0.0.1/", "10.0.0.1/0024"] {
        let prev = json!({"cniVersion": "1.0.0", "ips": [{"address": bad}]});
        assert_eq!(cni::check_prev_result("1.0.0", &prev).unwrap_err().code, 6, "{bad}");
    }
}

/// An unknown field whose name is a megabyte long is refused naming a prefix of it only.
#[test]
fn finding_a_huge_unknown_field_name_is_not_echoed() {
    let stdin = conf_over(&json!({ "x".repeat(1 << 20): 1 }));
    let e = parse(&stdin).unwrap_err();
    assert_eq!(e.code, 2);
    assert!(e.msg.len() < MESSAGE_BOUND, "{} bytes", e.msg.len());
}

/// Found by `annotations_never_panic_and_refuse_with_code_7`: a port item thousands of digits
/// long was echoed whole through the port-range parser's own message.
#[test]
fn finding_a_huge_port_item_is_not_echoed_through_the_parsers_reason() {
    let extra = json!({"runtimeConfig": {config::POD_ANNOTATIONS_CAPABILITY: {"aether.io/exclude-outbound-ports": "9".repeat(3000)}}});
    let conf = parse(&conf_over(&extra)).unwrap();
    let e = effective(&conf, Some("shop")).unwrap_err();
    assert_eq!(e.code, 7);
    assert!(e.msg.len() < MESSAGE_BOUND, "{} bytes", e.msg.len());
    let e = parse(&conf_over(&json!({"excludeOutboundPorts": ["9".repeat(3000)]}))).unwrap_err();
    assert!(e.msg.len() < MESSAGE_BOUND, "{} bytes", e.msg.len());
}
