//! The published JSON Schema of the change document (testdata/services/change.schema.json),
//! checked against its example and against `aether-cni services apply` itself, as the
//! snapshot's schema is (tests/schema.rs): the agent's authors read it, so it must accept and
//! refuse what `apply` does.
//!
//! - The schema is a valid draft 2020-12 schema; its references into the snapshot schema
//!   resolve (the snapshot schema registered under its `$id`, nothing fetched); the example
//!   passes it, and `apply` takes it after the snapshot example.
//! - Every malformed change whose rule the schema can express is refused by both.
//! - Every change the schema accepts in the sample set is taken by `apply` (after the
//!   snapshot example, in a fresh `--state-dir`, no pods recorded).
//! - The rules beyond the schema: the schema accepts those changes, `apply` refuses them, and
//!   the schema's description names each rule.
//!
//! No root needed: `services apply` with no pods recorded touches no namespace.

mod schema_support;

use schema_support::{apply_in_turn, load, schema_errors, testdata};
use serde_json::{json, Value};

fn validator() -> jsonschema::Validator {
    let change = load("change.schema.json");
    let snapshot = load("snapshot.schema.json");
    jsonschema::meta::validate(&change)
        .unwrap_or_else(|e| panic!("change.schema.json is not a valid JSON Schema: {e}"));
    let id = snapshot["$id"].as_str().expect("the snapshot schema has an $id").to_string();
    // The registry borrows for the validator's build only; the validator owns what it needs.
    let registry = jsonschema::Registry::new()
        .add(id, snapshot)
        .and_then(|r| r.prepare())
        .unwrap_or_else(|e| panic!("snapshot.schema.json cannot be registered: {e}"));
    jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .with_registry(&registry)
        .build(&change)
        .unwrap_or_else(|e| panic!("change.schema.json does not compile: {e}"))
}

/// In a fresh `--state-dir`: `services apply` of the snapshot example, then of `change`:
/// (exit code of the change, its output).
fn apply_after_example(change: &[u8]) -> (i32, String) {
    let example = std::fs::read(testdata("example.json")).unwrap();
    let mut outcomes = apply_in_turn(&[&example, change]);
    assert_eq!(outcomes[0].0, 0, "the snapshot example is refused: {}", outcomes[0].1);
    outcomes.remove(1)
}

fn example() -> Value {
    load("change-example.json")
}

fn tweaked(f: impl Fn(&mut Value)) -> Value {
    let mut v = example();
    f(&mut v);
    v
}

/// Changes the schema accepts and `apply` takes, after the snapshot example (generation 42).
fn valid_samples() -> Vec<(&'static str, Value)> {
    vec![
        ("the example", example()),
        ("the least change: generations only", json!({"baseGeneration": 42, "generation": 43})),
        ("a mode change", json!({"baseGeneration": 42, "generation": 50, "mode": "refuse"})),
        (
            "ranges replaced",
            json!({"baseGeneration": 42, "generation": 43, "serviceRanges": ["10.96.0.0/16", "10.200.0.7/32", "fd00:10:96::/108"]}),
        ),
        ("a timeout", json!({"baseGeneration": 42, "generation": 43, "dialledTimeoutSeconds": 60})),
        (
            "a Service replaced whole",
            json!({"baseGeneration": 42, "generation": 43, "servicesPut": [
            {"namespace": "shop", "name": "cart", "vip": "10.96.1.9", "ports": [{"protocol": "UDP", "port": 53}], "usableEndpoints": false}]}),
        ),
        (
            "an IPv6 Service with its range",
            json!({"baseGeneration": 42, "generation": 43,
            "serviceRanges": ["10.96.0.0/16", "10.200.0.7/32", "fd00:10:96::/108"],
            "servicesPut": [{"namespace": "shop", "name": "cart6", "vip": "fd00:10:96::1:1", "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": true}]}),
        ),
        (
            "a flip of a Service put in the same change",
            json!({"baseGeneration": 42, "generation": 43,
            "servicesPut": [{"namespace": "a", "name": "b", "vip": "10.96.2.2", "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": true}],
            "endpoints": [{"namespace": "a", "name": "b", "usableEndpoints": false}]}),
        ),
        (
            "a mesh VIP moved",
            json!({"baseGeneration": 42, "generation": 43, "meshVIPsRemoved": ["10.96.5.5"], "meshVIPsAdded": ["10.96.5.7"]}),
        ),
    ]
}

/// Malformed changes the schema can express: (what, change, what `apply`'s refusal names).
fn schema_malformed() -> Vec<(&'static str, Value, &'static str)> {
    vec![
        ("no baseGeneration is a snapshot, not a change: no services", json!({"generation": 43}), "services"),
        ("no generation", json!({"baseGeneration": 42}), "generation: missing"),
        (
            "baseGeneration 0",
            json!({"baseGeneration": 0, "generation": 43}),
            "baseGeneration: 0 is not a positive integer",
        ),
        ("baseGeneration a string", json!({"baseGeneration": "42", "generation": 43}), "baseGeneration"),
        ("an unknown field", tweaked(|v| v["services"] = json!([])), "services: unknown field"),
        ("a mode that is not one", tweaked(|v| v["mode"] = json!("block")), "mode"),
        (
            "servicesRemoved without a name",
            tweaked(|v| v["servicesRemoved"] = json!([{"namespace": "shop"}])),
            "servicesRemoved[0].name",
        ),
        (
            "servicesRemoved with an extra field",
            tweaked(|v| v["servicesRemoved"][0]["vip"] = json!("10.96.1.1")),
            "servicesRemoved[0].vip: unknown field",
        ),
        (
            "an endpoint flip without usableEndpoints",
            tweaked(|v| v["endpoints"] = json!([{"namespace": "shop", "name": "legacy"}])),
            "endpoints[0].usableEndpoints",
        ),
        (
            "an endpoint flip that is not a boolean",
            tweaked(|v| v["endpoints"][0]["usableEndpoints"] = json!("yes")),
            "endpoints[0].usableEndpoints",
        ),
        (
            "a put Service with a bad VIP",
            tweaked(|v| v["servicesPut"][0]["vip"] = json!("10.96.1.300")),
            "servicesPut[0].vip",
        ),
        ("a put Service without ports", tweaked(|v| v["servicesPut"][0]["ports"] = json!([])), "servicesPut[0].ports"),
        (
            "a put Service with port 0",
            tweaked(|v| v["servicesPut"][0]["ports"][0]["port"] = json!(0)),
            "servicesPut[0].ports[0].port",
        ),
        ("a mesh VIP that is not an address", tweaked(|v| v["meshVIPsAdded"] = json!(["10.96.5"])), "meshVIPsAdded[0]"),
        (
            "a range with a prefix too long",
            json!({"baseGeneration": 42, "generation": 43, "serviceRanges": ["10.96.0.0/33"]}),
            "serviceRanges[0]",
        ),
        (
            "a timeout of 0",
            json!({"baseGeneration": 42, "generation": 43, "dialledTimeoutSeconds": 0}),
            "dialledTimeoutSeconds",
        ),
        (
            "a list that is not a list",
            tweaked(|v| v["servicesRemoved"] = json!({"namespace": "shop", "name": "legacy"})),
            "servicesRemoved: ",
        ),
    ]
}

/// Changes the schema accepts and `apply` refuses, with the phrase of the schema's
/// description that names each rule, and what the refusal says.
fn beyond_schema() -> Vec<(&'static str, &'static str, Value, &'static str)> {
    vec![
        (
            "a stale base",
            "a baseGeneration other than the stored generation",
            json!({"baseGeneration": 41, "generation": 43}),
            "baseGeneration: 41 is not the stored generation 42",
        ),
        (
            "a generation not newer than the base",
            "a generation not newer than baseGeneration",
            json!({"baseGeneration": 42, "generation": 42}),
            "generation: 42 is not newer than baseGeneration 42",
        ),
        (
            "removing a Service the stored generation lacks",
            "removing or flipping a Service the stored generation does not have",
            json!({"baseGeneration": 42, "generation": 43, "servicesRemoved": [{"namespace": "shop", "name": "ghost"}]}),
            "servicesRemoved[0]: Service shop/ghost is not in the stored generation 42",
        ),
        (
            "flipping a Service the result lacks",
            "removing or flipping a Service the stored generation does not have",
            json!({"baseGeneration": 42, "generation": 43, "endpoints": [{"namespace": "shop", "name": "ghost", "usableEndpoints": true}]}),
            "endpoints[0]: Service shop/ghost is not in the result of the change",
        ),
        (
            "removing a mesh VIP that is not one",
            "removing a mesh VIP that is not one",
            json!({"baseGeneration": 42, "generation": 43, "meshVIPsRemoved": ["10.96.5.9"]}),
            "meshVIPsRemoved[0]: 10.96.5.9 is not a mesh VIP",
        ),
        (
            "adding a mesh VIP that is one",
            "adding a mesh VIP that already is one",
            json!({"baseGeneration": 42, "generation": 43, "meshVIPsAdded": ["10.96.5.5"]}),
            "meshVIPsAdded[0]: 10.96.5.5 is already a mesh VIP",
        ),
        (
            "a duplicate VIP in the result",
            "a duplicate VIP",
            json!({"baseGeneration": 42, "generation": 43, "servicesPut": [{"namespace": "a", "name": "b", "vip": "10.96.1.1", "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": true}]}),
            "10.96.1.1",
        ),
        (
            "a VIP outside every range",
            "a VIP outside every range",
            json!({"baseGeneration": 42, "generation": 43, "servicesPut": [{"namespace": "a", "name": "b", "vip": "10.97.0.1", "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": true}]}),
            "10.97.0.1",
        ),
        (
            "a Service VIP that is a mesh VIP",
            "a Service VIP that is also a mesh VIP",
            json!({"baseGeneration": 42, "generation": 43, "meshVIPsAdded": ["10.96.1.1"]}),
            "10.96.1.1",
        ),
        (
            "ranges that leave a VIP outside",
            "a VIP outside every range",
            json!({"baseGeneration": 42, "generation": 43, "serviceRanges": ["10.96.0.0/16"]}),
            "10.200.0.7",
        ),
        (
            "more than 10,000 items",
            "more than 10,000 items",
            json!({"baseGeneration": 42, "generation": 43, "servicesRemoved":
             (0..10_001).map(|i| json!({"namespace": "a", "name": format!("s{i}")})).collect::<Vec<_>>()}),
            "more than the limit of 10000",
        ),
    ]
}

#[test]
fn the_change_schema_is_valid_and_its_example_passes_it_and_apply() {
    let v = validator();
    let errors = schema_errors(&v, &example());
    assert!(errors.is_empty(), "the change example fails the schema: {errors:?}");
    let (code, said) = apply_after_example(&std::fs::read(testdata("change-example.json")).unwrap());
    assert_eq!(code, 0, "apply refuses the change example: {said}");
    assert!(said.contains("\"generation\": 43"), "{said}");
}

#[test]
fn every_valid_change_sample_passes_the_schema_and_apply() {
    let v = validator();
    for (what, doc) in valid_samples() {
        let errors = schema_errors(&v, &doc);
        assert!(errors.is_empty(), "{what}: the schema refuses it: {errors:?}");
        let (code, said) = apply_after_example(doc.to_string().as_bytes());
        assert_eq!(code, 0, "{what}: apply refuses it: {said}");
    }
}

#[test]
fn malformed_changes_the_schema_can_express_are_refused_by_both() {
    let v = validator();
    for (what, doc, named) in schema_malformed() {
        let errors = schema_errors(&v, &doc);
        assert!(!errors.is_empty(), "{what}: the schema accepts it: {doc}");
        let (code, said) = apply_after_example(doc.to_string().as_bytes());
        assert_eq!(code, 2, "{what}: apply's exit code ({said})");
        assert!(said.contains(named), "{what}: apply's refusal does not name `{named}`: {said}");
    }
}

#[test]
fn rules_beyond_the_change_schema_are_named_in_its_description_and_enforced_by_apply() {
    let v = validator();
    let description = load("change.schema.json")["description"].as_str().unwrap().to_string();
    for (what, phrase, doc, refusal) in beyond_schema() {
        let errors = schema_errors(&v, &doc);
        assert!(errors.is_empty(), "{what}: the schema itself refuses it ({errors:?}); it belongs in schema_malformed");
        assert!(description.contains(phrase), "{what}: the schema's description does not name `{phrase}`");
        let (code, said) = apply_after_example(doc.to_string().as_bytes());
        assert_eq!(code, 2, "{what}: apply's exit code ({said})");
        assert!(said.contains(refusal), "{what}: apply's refusal does not say `{refusal}`: {said}");
    }
}
