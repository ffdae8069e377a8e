//! The published JSON Schema of the Service snapshot (testdata/services/snapshot.schema.json)
//! checked against the examples and against `aether-cni services apply` itself: the agent's
//! authors read the schema, so it must accept and refuse what `apply` does.
//!
//! - The schema is itself a valid draft 2020-12 schema, and the example passes it.
//! - Every malformed document whose rule the schema can express is refused by the schema
//!   *and* by the binary (its validation tests in src/services/snapshot.rs are the source).
//! - Every document the schema accepts in the sample set is accepted by the binary (exit 0,
//!   a fresh `--state-dir`, no pods recorded): the schema is never looser than the plugin on
//!   these, so an agent that validates against it is not surprised.
//! - The rules beyond the schema (cross-field ones) are listed: the schema accepts those
//!   documents, the binary refuses them, and the schema's description names each rule.
//!
//! No root needed: `services apply` with no pods recorded touches no namespace.

mod schema_support;

use schema_support::{apply_in_turn, load, schema_errors};
use serde_json::{json, Value};

fn schema() -> Value {
    load("snapshot.schema.json")
}

fn validator() -> jsonschema::Validator {
    let s = schema();
    jsonschema::meta::validate(&s).unwrap_or_else(|e| panic!("snapshot.schema.json is not a valid JSON Schema: {e}"));
    jsonschema::draft202012::new(&s).unwrap_or_else(|e| panic!("snapshot.schema.json does not compile: {e}"))
}

/// `aether-cni services --state-dir <fresh> apply` with `doc` on stdin: (exit code, output).
fn apply(doc: &[u8]) -> (i32, String) {
    apply_in_turn(&[doc]).remove(0)
}

/// The valid document of the snapshot unit tests (src/services/snapshot.rs `good()`).
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

fn tweaked(f: impl Fn(&mut Value)) -> Value {
    let mut v = good();
    f(&mut v);
    v
}

/// Documents both the schema and the binary must accept.
fn valid_samples() -> Vec<(&'static str, Value)> {
    vec![
        ("testdata/services/example.json", load("example.json")),
        ("the unit tests' good snapshot", good()),
        (
            "minimal: no meshVIPs, no Services, default timeout",
            json!({"generation": 1, "mode": "count", "serviceRanges": ["10.96.0.0/12"], "services": []}),
        ),
        ("mode off with no ranges", json!({"generation": 1, "mode": "off", "serviceRanges": [], "services": []})),
        ("a ClusterSetIP /32 only", tweaked(|v| v["serviceRanges"] = json!(["10.96.0.0/16", "10.255.255.255/32"]))),
        ("the longest timeout", tweaked(|v| v["dialledTimeoutSeconds"] = json!(604800))),
        (
            "dual-stack: IPv6 ranges, a ClusterSetIP /128, IPv6 VIPs and mesh VIPs",
            tweaked(|v| {
                v["serviceRanges"] = json!(["10.96.0.0/16", "fd00:10:96::/108", "fd00:200::7/128"]);
                v["meshVIPs"] = json!(["10.96.5.5", "fd00:10:96::5:5"]);
                v["services"][1]["vip"] = json!("fd00:10:96::1:1");
                v["services"][2]["vip"] = json!("FD00:10:96:0:0:0:1:2");
            }),
        ),
        (
            "IPv6 only",
            json!({"generation": 1, "mode": "refuse", "serviceRanges": ["fd00:10:96::/108"], "meshVIPs": ["fd00:10:96::5"],
                   "services": [{"namespace": "default", "name": "kubernetes", "vip": "fd00:10:96::1",
                                 "ports": [{"protocol": "TCP", "port": 443}], "usableEndpoints": true}]}),
        ),
        ("the largest generation", tweaked(|v| v["generation"] = json!(u64::MAX))),
        (
            "port 1 and port 65535, TCP and UDP on one port",
            tweaked(|v| {
                v["services"][1]["ports"] = json!([
                    {"protocol": "TCP", "port": 1}, {"protocol": "UDP", "port": 1}, {"protocol": "TCP", "port": 65535}
                ])
            }),
        ),
        (
            "octets 0, 9, 10, 99, 100, 199, 200, 249, 250 and 255",
            tweaked(|v| {
                v["serviceRanges"] = json!(["10.0.0.0/8"]);
                v["meshVIPs"] = json!(["10.0.9.255"]);
                v["services"][0]["vip"] = json!("10.99.100.199");
                v["services"][1]["vip"] = json!("10.200.249.250");
                v["services"][2]["vip"] = json!("10.255.0.10");
            }),
        ),
    ]
}

/// Malformed documents whose rule the schema expresses: the schema and the binary refuse
/// them. Most come from the unit tests in src/services/snapshot.rs.
fn schema_malformed() -> Vec<(&'static str, Value)> {
    vec![
        ("prefix length 33", tweaked(|v| v["serviceRanges"][0] = json!("10.96.0.0/33"))),
        ("IPv6 prefix length 129", tweaked(|v| v["serviceRanges"][1] = json!("fd00::/129"))),
        ("an IPv6 range with a dotted IPv4 part", tweaked(|v| v["serviceRanges"][1] = json!("::ffff:10.0.0.0/104"))),
        ("an IPv6 range with a leading-zero prefix", tweaked(|v| v["serviceRanges"][1] = json!("fd00::/064"))),
        ("an IPv6 VIP with a group of five digits", tweaked(|v| v["services"][2]["vip"] = json!("fd00::10000"))),
        ("an IPv6 VIP with a zone", tweaked(|v| v["services"][2]["vip"] = json!("fe80::1%eth0"))),
        ("a range without a prefix length", tweaked(|v| v["serviceRanges"][1] = json!("10.200.0.7"))),
        ("a range with a leading-zero prefix", tweaked(|v| v["serviceRanges"][1] = json!("10.200.0.7/032"))),
        ("a range that is not a string", tweaked(|v| v["serviceRanges"][1] = json!(167772160))),
        ("port 0", tweaked(|v| v["services"][1]["ports"][0]["port"] = json!(0))),
        ("port 65536", tweaked(|v| v["services"][1]["ports"][0]["port"] = json!(65536))),
        ("port 70000", tweaked(|v| v["services"][1]["ports"][0]["port"] = json!(70000))),
        ("a port as a string", tweaked(|v| v["services"][1]["ports"][0]["port"] = json!("80"))),
        ("a port declared twice", tweaked(|v| v["services"][1]["ports"][1] = json!({"protocol": "TCP", "port": 80}))),
        (
            "a port declared twice, keys in another order",
            tweaked(|v| v["services"][1]["ports"][1] = json!({"port": 80, "protocol": "TCP"})),
        ),
        ("SCTP", tweaked(|v| v["services"][1]["ports"][0]["protocol"] = json!("SCTP"))),
        ("lower-case protocol", tweaked(|v| v["services"][1]["ports"][0]["protocol"] = json!("tcp"))),
        ("unknown port field", tweaked(|v| v["services"][1]["ports"][0]["targetPort"] = json!(8080))),
        ("no ports", tweaked(|v| v["services"][0]["ports"] = json!([]))),
        ("usableEndpoints not a boolean", tweaked(|v| v["services"][0]["usableEndpoints"] = json!("yes"))),
        (
            "usableEndpoints missing",
            tweaked(|v| {
                v["services"][0].as_object_mut().unwrap().remove("usableEndpoints");
            }),
        ),
        ("an empty name", tweaked(|v| v["services"][0]["name"] = json!(""))),
        ("unknown Service field", tweaked(|v| v["services"][0]["selector"] = json!({}))),
        ("a VIP with an octet over 255", tweaked(|v| v["services"][2]["vip"] = json!("10.96.1.300"))),
        ("a VIP with a leading zero", tweaked(|v| v["services"][2]["vip"] = json!("10.96.01.2"))),
        ("a mesh VIP with a leading zero", tweaked(|v| v["meshVIPs"] = json!(["10.96.05.5"]))),
        ("duplicate mesh VIPs", tweaked(|v| v["meshVIPs"] = json!(["10.96.5.5", "10.96.5.5"]))),
        ("mode enforce", tweaked(|v| v["mode"] = json!("enforce"))),
        (
            "mode missing",
            tweaked(|v| {
                v.as_object_mut().unwrap().remove("mode");
            }),
        ),
        ("generation -1", tweaked(|v| v["generation"] = json!(-1))),
        ("generation 0", tweaked(|v| v["generation"] = json!(0))),
        ("generation 1.5", tweaked(|v| v["generation"] = json!(1.5))),
        ("generation as a string", tweaked(|v| v["generation"] = json!("3"))),
        (
            "generation missing",
            tweaked(|v| {
                v.as_object_mut().unwrap().remove("generation");
            }),
        ),
        ("dialledTimeoutSeconds 0", tweaked(|v| v["dialledTimeoutSeconds"] = json!(0))),
        ("dialledTimeoutSeconds over a week", tweaked(|v| v["dialledTimeoutSeconds"] = json!(604801))),
        ("unknown top-level field", tweaked(|v| v["serviceRange"] = json!([]))),
        (
            "services missing",
            tweaked(|v| {
                v.as_object_mut().unwrap().remove("services");
            }),
        ),
        ("services not an array", tweaked(|v| v["services"] = json!({}))),
        ("no ranges in refuse mode", tweaked(|v| v["serviceRanges"] = json!([]))),
        ("no ranges in count mode", json!({"generation": 1, "mode": "count", "serviceRanges": [], "services": []})),
        ("not an object", json!([1, 2])),
    ]
}

/// Malformed documents whose rule is beyond the schema (cross-field, or JSON's number
/// model): the schema accepts them, the binary refuses them, and the schema's description
/// names the rule (`keyword`).
fn beyond_schema() -> Vec<(&'static str, &'static str, Value)> {
    vec![
        ("host bits", "host bits in a range", tweaked(|v| v["serviceRanges"][0] = json!("10.96.0.5/16"))),
        ("overlapping ranges", "overlapping ranges", tweaked(|v| v["serviceRanges"][1] = json!("10.96.3.0/24"))),
        ("loopback range", "127/8", tweaked(|v| v["serviceRanges"][1] = json!("127.0.0.0/8"))),
        ("link-local range", "169.254/16", tweaked(|v| v["serviceRanges"][1] = json!("169.254.0.0/16"))),
        (
            "a Service VIP outside every range",
            "Service VIPs outside every range",
            tweaked(|v| v["services"][2]["vip"] = json!("192.168.1.1")),
        ),
        (
            "a mesh VIP outside every range",
            "mesh VIPs and Service VIPs outside",
            tweaked(|v| v["meshVIPs"] = json!(["8.8.8.8"])),
        ),
        (
            "duplicate Service",
            "duplicate Services (namespace/name)",
            tweaked(|v| v["services"][2]["name"] = json!("cart")),
        ),
        ("duplicate VIP", "or Service VIPs", tweaked(|v| v["services"][2]["vip"] = json!("10.96.1.1"))),
        (
            "a Service VIP that is a mesh VIP",
            "a Service VIP that is also a mesh VIP",
            tweaked(|v| v["services"][2]["vip"] = json!("10.96.5.5")),
        ),
        ("generation 3.0", "1.0 or 1e0 for 1", tweaked(|v| v["generation"] = json!(3.0))),
        ("IPv6 link-local range", "fe80::/10", tweaked(|v| v["serviceRanges"][1] = json!("fe80::/64"))),
        ("IPv6 host bits", "host bits in a range", tweaked(|v| v["serviceRanges"][1] = json!("fd00::5/108"))),
        (
            "one IPv6 mesh VIP written two ways",
            "compared as addresses",
            tweaked(|v| {
                v["serviceRanges"][1] = json!("fd00::/108");
                v["meshVIPs"] = json!(["fd00::5", "fd00:0::5"]);
            }),
        ),
    ]
}

#[test]
fn the_schema_is_valid_and_the_example_passes_it() {
    let v = validator();
    let example = load("example.json");
    let errs = schema_errors(&v, &example);
    assert!(errs.is_empty(), "testdata/services/example.json fails the schema: {errs:#?}");
    assert_eq!(schema()["$schema"], "https://json-schema.org/draft/2020-12/schema");
}

#[test]
fn every_valid_sample_passes_the_schema_and_services_apply() {
    let v = validator();
    for (what, doc) in valid_samples() {
        let errs = schema_errors(&v, &doc);
        assert!(errs.is_empty(), "{what}: the schema refuses a valid snapshot: {errs:#?}\n{doc}");
        let (code, stderr) = apply(doc.to_string().as_bytes());
        assert_eq!(code, 0, "{what}: the schema accepts it, but services apply refuses it:\n{stderr}\n{doc}");
    }
}

#[test]
fn malformed_snapshots_the_schema_can_express_are_refused_by_both() {
    let v = validator();
    let cases = schema_malformed();
    assert!(cases.len() >= 15);
    for (what, doc) in cases {
        let errs = schema_errors(&v, &doc);
        assert!(!errs.is_empty(), "{what}: the schema accepts it:\n{doc}");
        let (code, stderr) = apply(doc.to_string().as_bytes());
        assert_eq!(
            code, 2,
            "{what}: services apply must refuse it as invalid (exit 2); schema said {errs:?}\n{stderr}"
        );
    }
}

#[test]
fn rules_beyond_the_schema_are_named_in_its_description_and_enforced_by_services_apply() {
    let v = validator();
    let description = schema()["description"].as_str().unwrap().to_string();
    for (what, keyword, doc) in beyond_schema() {
        assert!(description.contains(keyword), "{what}: the schema's description does not name {keyword:?}");
        let errs = schema_errors(&v, &doc);
        assert!(
            errs.is_empty(),
            "{what}: the schema now refuses it ({errs:?}); move it to schema_malformed and out of the description"
        );
        let (code, stderr) = apply(doc.to_string().as_bytes());
        assert_eq!(code, 2, "{what}: services apply accepted it:\n{stderr}\n{doc}");
    }
}
