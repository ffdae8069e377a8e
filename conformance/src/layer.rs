//! The Service layer's side of the simulated node, shared by the datapath tests of both
//! families: the snapshot applied and the counters read through `aether-cni services` (as
//! the node agent runs it), and per-class counts compared.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::{Pod, SimNode};

/// Connections per counter.
pub type Counts = BTreeMap<String, u64>;

/// The layer's counters, as `services counters` names them.
pub const CLASSES: [&str; 6] =
    ["mesh", "service", "external", "refused_no_endpoints", "refused_port_not_declared", "refused_no_service"];

/// `services apply` with `doc`; panics unless it succeeds. Returns its report.
pub fn apply(node: &SimNode, doc: &[u8]) -> Value {
    let out = node.services(&["apply"], doc);
    assert!(out.ok, "services apply failed:\n{}\n{}", out.stdout, out.stderr);
    out.json()
}

/// `services counters --format json`.
pub fn counters(node: &SimNode) -> Value {
    let out = node.services(&["counters", "--format", "json"], b"");
    assert!(out.ok, "services counters failed:\n{}\n{}", out.stdout, out.stderr);
    out.json()
}

pub fn as_counts(v: &Value) -> Counts {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("not a counter map ({e}): {v}"))
}

/// The pod's row of `counters`, or None when it has no row (no layer in its netns).
pub fn pod_counts(c: &Value, pod: &Pod) -> Option<Counts> {
    let rows = c["pods"].as_array().unwrap_or_else(|| panic!("no pods array: {c}"));
    let mut mine = rows.iter().filter(|r| r["containerID"] == pod.container_id.as_str());
    let row = mine.next()?;
    assert!(mine.next().is_none(), "two rows for {}: {c}", pod.container_id);
    Some(as_counts(&row["counters"]))
}

pub fn node_totals(c: &Value) -> Counts {
    as_counts(&c["node"])
}

/// Counts with `class` at `n` and every other class at 0.
pub fn only(class: Option<&str>, n: u64) -> Counts {
    CLASSES.iter().map(|c| (c.to_string(), if Some(*c) == class { n } else { 0 })).collect()
}

/// What grew from `before` to `after`; panics if a counter went backwards.
pub fn delta(before: &Counts, after: &Counts) -> Counts {
    CLASSES
        .iter()
        .map(|c| {
            let (b, a) = (before.get(*c).copied().unwrap_or(0), after.get(*c).copied().unwrap_or(0));
            assert!(a >= b, "counter {c} went backwards: {before:?} -> {after:?}");
            (c.to_string(), a - b)
        })
        .collect()
}

pub fn sum(a: &Counts, b: &Counts) -> Counts {
    CLASSES.iter().map(|c| (c.to_string(), a.get(*c).copied().unwrap_or(0) + b.get(*c).copied().unwrap_or(0))).collect()
}

/// The pod's Service layer as the kernel lists it, made comparable: counter values dropped,
/// each set's elements sorted. Empty when the pod has no layer.
pub fn listing(pod: &Pod) -> String {
    if !pod.nft(&["list", "tables"]).contains("aether_services") {
        return String::new();
    }
    let text = pod.nft(&["list", "table", "ip", "aether_services"]);
    let mut out = Vec::new();
    let mut elements: Option<String> = None;
    for line in text.lines() {
        let line = line.trim();
        if let Some(acc) = elements.as_mut() {
            acc.push_str(line);
        } else if let Some(rest) = line.strip_prefix("elements = {") {
            elements = Some(rest.to_string());
        } else {
            let words: Vec<&str> = line.split_whitespace().collect();
            let mut kept = Vec::new();
            let mut i = 0;
            while i < words.len() {
                // `packets N bytes M`: what traffic did, not what was written.
                if (words[i] == "packets" || words[i] == "bytes") && i + 1 < words.len() {
                    i += 2;
                    continue;
                }
                kept.push(words[i]);
                i += 1;
            }
            out.push(kept.join(" "));
            continue;
        }
        let acc = elements.as_ref().unwrap();
        if acc.trim_end().ends_with('}') {
            let inner = acc.trim_end().trim_end_matches('}');
            let mut items: Vec<String> =
                inner.split(',').map(|e| e.trim().to_string()).filter(|e| !e.is_empty()).collect();
            items.sort();
            out.push(format!("elements = {{ {} }}", items.join(", ")));
            elements = None;
        }
    }
    out.join("\n")
}
