//! The log an operator greps: one line per event, an RFC 3339 UTC timestamp, the level, the
//! command and the pod, what happened in words and `key=value` fields; `logFormat` text or
//! json; never Rust `Debug` output; a refused configuration reaches `logFile`.

mod common;

use aether_testkit::{root_or_skip, TestNetns};
use common::{conf, run_plugin, state_dir};
use serde_json::{json, Value};

/// A log file of the test's own, under its own state directory.
fn log_conf(extra: Value) -> (Value, std::path::PathBuf) {
    let dir = state_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let log = std::path::Path::new(&dir).join("aether-cni.log");
    let mut c = conf("1.0.0", json!({"stateDir": dir, "logFile": log.display().to_string()}));
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    (c, log)
}

fn lines(log: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(log).unwrap_or_default().lines().map(str::to_string).collect()
}

/// `2026-11-30T19:40:53.758140Z`: RFC 3339, UTC.
fn is_rfc3339_utc(ts: &str) -> bool {
    let b = ts.as_bytes();
    let digits = |r: std::ops::Range<usize>| b.get(r).is_some_and(|s| s.iter().all(u8::is_ascii_digit));
    ts.len() >= 20
        && digits(0..4)
        && b[4] == b'-'
        && digits(5..7)
        && b[7] == b'-'
        && digits(8..10)
        && b[10] == b'T'
        && digits(11..13)
        && b[13] == b':'
        && digits(14..16)
        && b[16] == b':'
        && digits(17..19)
        && ts.ends_with('Z')
        && (ts.len() == 20 || (b[19] == b'.' && digits(20..ts.len() - 1)))
}

/// The shapes Rust's `Debug` leaves in text: `Some("x")`, `None`, `Ok(..)`, escaped quotes,
/// and struct dumps such as `Removed { table: true, ... }`.
fn debug_shapes(line: &str) -> Vec<String> {
    let mut found: Vec<String> =
        ["Some(", "None", "Ok(", "Err(", "\\\""].iter().filter(|s| line.contains(*s)).map(|s| s.to_string()).collect();
    let words: Vec<&str> = line.split_whitespace().collect();
    for w in words.windows(3) {
        if w[1] == "{" && w[0].starts_with(|c: char| c.is_ascii_uppercase()) && w[2].ends_with(':') {
            found.push(w.join(" "));
        }
    }
    found
}

#[test]
fn the_debug_shape_detector_can_fail() {
    // Negative controls: what the old logger wrote is caught.
    assert!(!debug_shapes(r#"ADD c: pod Some("kube-system")/Some("pc") is not managed"#).is_empty());
    assert!(!debug_shapes("removed Removed { table: true, rule: true, route: true } from /x").is_empty());
    assert!(!debug_shapes("mode None").is_empty());
    assert!(debug_shapes("capture removed table=true rule=true route=true").is_empty());
    assert!(is_rfc3339_utc("2026-11-30T19:40:53.758140Z") && is_rfc3339_utc("2026-11-30T19:40:53Z"));
    assert!(
        !is_rfc3339_utc("1796064025.084")
            && !is_rfc3339_utc("2026-11-30 19:40:53")
            && !is_rfc3339_utc("2026-11-30T19:40:53+01:00")
    );
}

/// Checks one text line: timestamp, level, the command's span, no Debug; returns the part
/// after the span (the message and its fields).
fn text_line<'a>(line: &'a str, command: &str) -> &'a str {
    let (ts, rest) = line.split_once(' ').unwrap_or_else(|| panic!("no timestamp: {line}"));
    assert!(is_rfc3339_utc(ts), "timestamp {ts:?} is not RFC 3339 UTC: {line}");
    let rest = rest.trim_start();
    let level = rest.split_whitespace().next().unwrap();
    assert!(["ERROR", "WARN", "INFO", "DEBUG"].contains(&level), "level {level:?}: {line}");
    let span = format!("cni{{command={command} ");
    assert!(rest.contains(&span), "line should carry {span:?}: {line}");
    assert!(debug_shapes(line).is_empty(), "Debug output in the log: {:?} in {line}", debug_shapes(line));
    rest.split_once("}: ").map(|(_, msg)| msg).unwrap_or_else(|| panic!("no message after the span: {line}"))
}

#[test]
fn a_refused_configuration_reaches_the_log_file() {
    // Each refused for a different field, logLevel and logFormat themselves included: the
    // log settings are read leniently first, so the refusal is still written.
    let cases = [
        (json!({"captureMode": "everything"}), 7, "captureMode"),
        (json!({"captureMod": "scoped"}), 2, "captureMod"),
        (json!({"logLevel": "loud"}), 7, "logLevel"),
        (json!({"logFormat": "xml"}), 7, "logFormat"),
        (json!({"cniVersion": "9.9.9"}), 1, "9.9.9"),
    ];
    for (extra, code, field) in cases {
        let (c, log) = log_conf(extra.clone());
        let out = run_plugin("ADD", Some("/var/run/netns/never-opened"), &c, &[]);
        assert_eq!(out.error().0, code, "{extra}");
        let lines = lines(&log);
        assert_eq!(lines.len(), 1, "one line for the refusal ({extra}):\n{}", lines.join("\n"));
        let msg = text_line(&lines[0], "ADD");
        assert!(lines[0].contains(" ERROR "), "{}", lines[0]);
        assert!(
            lines[0].contains("pod=shop/cart-0 container=ctr-0123 netns=/var/run/netns/never-opened"),
            "the pod is named: {}",
            lines[0]
        );
        assert!(
            msg.starts_with("ADD failed: ") && msg.contains(field) && msg.contains(&format!(" code={code}")),
            "{msg}"
        );
        // The same line went to stderr.
        assert!(out.stderr.contains(msg), "stderr: {}", out.stderr);
    }
    // JSON, when that is what the configuration asks for, even as it is refused.
    let (c, log) = log_conf(json!({"logFormat": "json", "captureMode": "everything"}));
    assert!(!run_plugin("ADD", Some("/var/run/netns/never-opened"), &c, &[]).ok);
    let lines = lines(&log);
    assert_eq!(lines.len(), 1, "{lines:?}");
    let v: Value = serde_json::from_str(&lines[0]).unwrap();
    assert_eq!(v["level"], "ERROR");
    assert_eq!(v["code"], 7);
    assert!(v["message"].as_str().unwrap().contains("captureMode"), "{v}");
    assert_eq!(v["span"]["pod"], "shop/cart-0");
}

#[test]
fn log_level_and_format_apply_to_every_line() {
    // A pod in an excluded namespace: ADD succeeds and logs one info line, no kernel needed.
    let unmanaged = [("CNI_ARGS", "K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=coredns-0")];
    let netns = Some("/var/run/netns/never-opened");

    let (c, log) = log_conf(json!({}));
    assert!(run_plugin("ADD", netns, &c, &unmanaged).ok);
    let lines_text = lines(&log);
    assert_eq!(lines_text.len(), 1, "{lines_text:?}");
    let msg = text_line(&lines_text[0], "ADD");
    assert!(lines_text[0].contains(" INFO ") && lines_text[0].contains("pod=kube-system/coredns-0"), "{lines_text:?}");
    assert!(msg.starts_with("pod is not managed"), "{msg}");

    let (c, log) = log_conf(json!({"logFormat": "json"}));
    assert!(run_plugin("ADD", netns, &c, &unmanaged).ok);
    let lines_json = lines(&log);
    assert_eq!(lines_json.len(), 1, "{lines_json:?}");
    let v: Value = serde_json::from_str(&lines_json[0]).unwrap_or_else(|e| panic!("{e}: {}", lines_json[0]));
    assert!(is_rfc3339_utc(v["timestamp"].as_str().unwrap()), "{v}");
    assert_eq!(v["level"], "INFO");
    assert_eq!(v["span"]["command"], "ADD");
    assert_eq!(v["span"]["pod"], "kube-system/coredns-0");
    assert_eq!(v["span"]["container"], "ctr-0123");
    assert_eq!(v["span"]["netns"], "/var/run/netns/never-opened");
    assert!(v["message"].as_str().unwrap().starts_with("pod is not managed"), "{v}");

    // logLevel error: the success is not logged, a failure still is.
    let (c, log) = log_conf(json!({"logLevel": "error"}));
    assert!(run_plugin("ADD", netns, &c, &unmanaged).ok);
    assert_eq!(lines(&log), Vec::<String>::new());
    assert!(!run_plugin("ADD", netns, &c, &[("CNI_IFNAME", "")]).ok);
    let l = lines(&log);
    assert!(l.len() == 1 && l[0].contains(" ERROR ") && l[0].contains("CNI_IFNAME"), "{l:?}");
}

#[test]
fn a_pod_s_life_reads_as_one_line_per_event() {
    if !root_or_skip("a_pod_s_life_reads_as_one_line_per_event") {
        return;
    }
    let ns = TestNetns::new("logs");
    let (c, log) = log_conf(json!({}));
    let netns = ns.path();
    assert!(run_plugin("ADD", Some(&netns), &c, &[]).ok);
    assert!(run_plugin("CHECK", Some(&netns), &c, &[]).ok);
    ns.exec("nft", &["flush", "chain", "ip", "aether_capture", "egress_divert"]);
    assert!(!run_plugin("CHECK", Some(&netns), &c, &[]).ok);
    assert!(run_plugin("DEL", Some(&netns), &c, &[]).ok);
    assert!(run_plugin("DEL", Some("/var/run/netns/gone-already"), &c, &[]).ok);
    let mut gc = c.clone();
    gc["cni.dev/valid-attachments"] = json!([]);
    assert!(run_plugin("ADD", Some(&netns), &c, &[("CNI_CONTAINERID", "ctr-stale")]).ok);
    assert!(run_plugin("GC", None, &gc, &[("CNI_CONTAINERID", ""), ("CNI_ARGS", ""), ("CNI_IFNAME", "")]).ok);

    let all = lines(&log);
    let want = [
        ("ADD", "capture programmed mode=redirect-all services_generation=none"),
        ("CHECK", "capture intact"),
        ("CHECK", "CHECK failed: the capture ruleset in"),
        ("CHECK", " code=100 details=chain egress_divert: "),
        ("DEL", "capture removed container=ctr-0123"),
        ("DEL", "netns is already gone"),
        ("ADD", "capture programmed"),
        ("GC", "stale attachment removed container=ctr-stale ifname=eth0"),
    ];
    assert!(all.len() >= want.len(), "{}", all.join("\n"));
    for (command, start) in want {
        let hit = all.iter().find(|l| l.contains(&format!("cni{{command={command} ")) && l.contains(start));
        assert!(hit.is_some(), "no {command} line with {start:?}:\n{}", all.join("\n"));
    }
    for line in &all {
        let command = line.split("cni{command=").nth(1).and_then(|r| r.split([' ', '}']).next()).unwrap_or("?");
        text_line(line, command);
        if command != "GC" {
            assert!(
                line.contains(&format!(
                    "netns={}",
                    if line.contains("gone-already") { "/var/run/netns/gone-already" } else { netns.as_str() }
                )),
                "{line}"
            );
            assert!(line.contains("pod=shop/cart-0 container=ctr-"), "{line}");
        }
    }
    let removed = all.iter().find(|l| l.contains("capture removed")).unwrap();
    assert!(removed.contains("table=true rule=true route=true services_folded=none"), "{removed}");
}
