//! One test per line of docs/cni-checklist.md, driving the built binary
//! exactly as a runtime does, for each CNI version the line applies to.

mod common;

use aether_testkit::{root_or_skip, TestNetns};
use common::{conf, run_plugin, state_dir, Outcome};
use serde_json::{json, Value};

const VERSIONS: [&str; 3] = ["0.4.0", "1.0.0", "1.1.0"];

fn add_ok(ns: &TestNetns, c: &Value) -> Outcome {
    let out = run_plugin("ADD", Some(&ns.path()), c, &[]);
    assert!(out.ok, "ADD failed: {}\n{}", out.stdout, out.stderr);
    out
}

fn has_capture(ns: &TestNetns) -> bool {
    ns.exec("nft", &["list", "tables"]).contains("aether_capture")
}

#[test]
fn l01_runs_in_the_host_netns_and_changes_only_the_pod_netns() {
    if !root_or_skip("l01") {
        return;
    }
    let host = (
        aether_testkit::run("nft", &["list", "ruleset"]),
        aether_testkit::run("ip", &["rule"]),
        aether_testkit::run("ip", &["route"]),
    );
    let ns = TestNetns::new("l01");
    add_ok(&ns, &conf("1.1.0", json!({})));
    assert!(has_capture(&ns));
    let after = (
        aether_testkit::run("nft", &["list", "ruleset"]),
        aether_testkit::run("ip", &["rule"]),
        aether_testkit::run("ip", &["route"]),
    );
    assert_eq!(host, after, "the host's ruleset, rules or routes changed");
}

#[test]
fn l02_l06_config_is_one_plugin_object_with_args_and_capabilities() {
    if !root_or_skip("l02") {
        return;
    }
    for v in VERSIONS {
        let ns = TestNetns::new("l02");
        let c = conf(
            v,
            json!({"args": {"cni": {"labels": [{"key": "app", "value": "cart"}]}}, "capabilities": {"io.kubernetes.cri.pod-annotations": true, "portMappings": true}}),
        );
        add_ok(&ns, &c);
        assert!(has_capture(&ns), "{v}");
    }
}

#[test]
fn l03_each_missing_environment_variable_is_named_with_code_4() {
    let c = conf("1.1.0", json!({}));
    let cases: [(&str, &[&str]); 5] = [
        ("ADD", &["CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"]),
        ("CHECK", &["CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"]),
        ("DEL", &["CNI_COMMAND", "CNI_CONTAINERID", "CNI_IFNAME"]),
        ("GC", &["CNI_COMMAND", "CNI_PATH"]),
        ("VERSION", &["CNI_COMMAND"]),
    ];
    for (cmd, vars) in cases {
        for var in vars.iter() {
            // An empty value is how a runtime would leave it out; run_plugin sets the rest.
            let mut c = c.clone();
            if cmd == "GC" {
                c["cni.dev/valid-attachments"] = json!([]);
            }
            let netns = if *var == "CNI_NETNS" { None } else { Some("/run/netns/l03-does-not-matter") };
            let out = run_plugin(cmd, netns, &c, &[(var, "")]);
            let (code, text) = out.error();
            assert_eq!(code, 4, "{cmd} without {var}: {text}");
            assert!(text.contains(var), "{cmd} without {var}: {text}");
        }
    }
}

#[test]
fn l04_an_unusable_ifname_is_an_error() {
    for bad in ["a/b", "this-name-is-too-long", ".."] {
        let (code, text) =
            run_plugin("ADD", Some("/run/netns/x"), &conf("1.0.0", json!({})), &[("CNI_IFNAME", bad)]).error();
        assert_eq!(code, 4);
        assert!(text.contains("CNI_IFNAME") && text.contains(bad), "{text}");
    }
}

#[test]
fn l05_kubernetes_cni_args_are_accepted() {
    if !root_or_skip("l05") {
        return;
    }
    let ns = TestNetns::new("l05");
    let args = "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart-0;K8S_POD_INFRA_CONTAINER_ID=0123abcd;K8S_POD_UID=5f0c-11";
    let out = run_plugin("ADD", Some(&ns.path()), &conf("1.0.0", json!({})), &[("CNI_ARGS", args)]);
    assert!(out.ok, "{}", out.stdout);
    let (code, text) =
        run_plugin("ADD", Some(&ns.path()), &conf("1.0.0", json!({})), &[("CNI_ARGS", "K8S_POD_NAME")]).error();
    assert_eq!(code, 4, "{text}");
}

#[test]
fn l07_runtime_data_comes_from_runtime_config() {
    if !root_or_skip("l07") {
        return;
    }
    let ns = TestNetns::new("l07");
    let c = conf(
        "1.1.0",
        json!({"runtimeConfig": {"io.kubernetes.cri.pod-annotations": {"aether.io/exclude-outbound-ports": "6379"}}}),
    );
    add_ok(&ns, &c);
    assert!(ns.exec("nft", &["list", "set", "ip", "aether_capture", "excluded_ports"]).contains("6379"));
    // The control: without it, the port is not excluded.
    let ns2 = TestNetns::new("l07");
    add_ok(&ns2, &conf("1.1.0", json!({})));
    assert!(!ns2.exec("nft", &["list", "set", "ip", "aether_capture", "excluded_ports"]).contains("6379"));
}

#[test]
fn l08_l09_add_returns_prev_result_unchanged_at_the_input_version() {
    if !root_or_skip("l08") {
        return;
    }
    // Every 1.1.0 result field.
    let full = json!({
        "cniVersion": "1.1.0",
        "interfaces": [
            {"name": "eth0", "mac": "0a:58:0a:f4:01:05", "mtu": 1450, "sandbox": "/var/run/netns/cni-1", "socketPath": "/run/vhost.sock", "pciID": "0000:00:1f.6"}
        ],
        "ips": [{"address": "10.244.1.5/24", "gateway": "10.244.1.1", "interface": 0}],
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.244.1.1", "mtu": 1400, "advmss": 1360, "priority": 100, "table": 5, "scope": 0}],
        "dns": {"nameservers": ["10.96.0.10"], "domain": "cluster.local", "search": ["svc.cluster.local"], "options": ["ndots:5"]}
    });
    for v in VERSIONS {
        let ns = TestNetns::new("l08");
        let mut prev = if v == "1.1.0" { full.clone() } else { common::prev_result(v) };
        prev["cniVersion"] = json!(v);
        let out = add_ok(&ns, &conf(v, json!({"prevResult": prev.clone()})));
        assert_eq!(out.json(), prev, "{v}: the result must be prevResult unchanged");
    }
}

#[test]
fn l10_no_prev_result_is_refused_clearly() {
    let (code, text) =
        run_plugin("ADD", Some("/run/netns/x"), &conf("1.0.0", json!({"prevResult": null})), &[]).error();
    assert_eq!(code, 7);
    assert!(text.contains("prevResult") && text.contains("chained"), "{text}");
}

#[test]
fn l11_a_prev_result_without_version_is_read_at_the_config_version() {
    if !root_or_skip("l11") {
        return;
    }
    let ns = TestNetns::new("l11");
    let mut prev = common::prev_result("1.0.0");
    prev.as_object_mut().unwrap().remove("cniVersion");
    let out = add_ok(&ns, &conf("1.0.0", json!({"prevResult": prev.clone()})));
    prev["cniVersion"] = json!("1.0.0");
    assert_eq!(out.json(), prev);
}

#[test]
fn l12_to_l15_del_is_idempotent_silent_and_needs_neither_netns_nor_prev_result() {
    if !root_or_skip("l12") {
        return;
    }
    for v in VERSIONS {
        let ns = TestNetns::new("l12");
        let c = conf(v, json!({}));
        // DEL with no prior ADD.
        let out = run_plugin("DEL", Some(&ns.path()), &c, &[]);
        assert!(out.ok && out.stdout.is_empty(), "{v}: {}", out.stdout);
        add_ok(&ns, &c);
        for _ in 0..2 {
            let out = run_plugin(
                "DEL",
                Some(&ns.path()),
                &conf(v, json!({"prevResult": null, "stateDir": c["stateDir"].clone()})),
                &[],
            );
            assert!(out.ok && out.stdout.is_empty(), "{v}: {}", out.stdout);
            assert!(!has_capture(&ns));
        }
        // DEL without CNI_NETNS, and with a netns already gone.
        assert!(run_plugin("DEL", None, &c, &[]).ok);
        let gone = ns.path();
        drop(ns);
        assert!(run_plugin("DEL", Some(&gone), &c, &[]).ok);
    }
}

#[test]
fn l12_del_after_a_failed_add_succeeds() {
    if !root_or_skip("l12b") {
        return;
    }
    let ns = TestNetns::new("l12b");
    let bad =
        conf("1.0.0", json!({"runtimeConfig": {"io.kubernetes.cri.pod-annotations": {"aether.io/capture": "bogus"}}}));
    assert!(!run_plugin("ADD", Some(&ns.path()), &bad, &[]).ok);
    let out = run_plugin("DEL", Some(&ns.path()), &bad, &[]);
    assert!(out.ok, "{}", out.stdout);
}

#[test]
fn l13_del_without_netns_uses_the_record_to_clean_up() {
    if !root_or_skip("l13") {
        return;
    }
    let ns = TestNetns::new("l13");
    let c = conf("1.0.0", json!({}));
    add_ok(&ns, &c);
    assert!(run_plugin("DEL", None, &c, &[]).ok);
    assert!(!has_capture(&ns), "DEL without CNI_NETNS should still clean the netns the record names");
}

#[test]
fn l16_l18_check_fails_when_missing_passes_when_intact_and_prints_nothing() {
    if !root_or_skip("l16") {
        return;
    }
    for v in ["0.4.0", "1.0.0", "1.1.0"] {
        let ns = TestNetns::new("l16");
        let c = conf(v, json!({}));
        add_ok(&ns, &c);
        let ok = run_plugin("CHECK", Some(&ns.path()), &c, &[]);
        assert!(ok.ok && ok.stdout.is_empty(), "{v}: {}", ok.stdout);
        ns.exec("nft", &["delete", "table", "ip", "aether_capture"]);
        let (code, text) = run_plugin("CHECK", Some(&ns.path()), &c, &[]).error();
        assert_eq!(code, 100, "{v}: {text}");
    }
}

#[test]
fn l17_check_tolerates_what_later_plugins_add() {
    if !root_or_skip("l17") {
        return;
    }
    let ns = TestNetns::new("l17");
    let c = conf("1.0.0", json!({}));
    add_ok(&ns, &c);
    // A later plugin (portmap, bandwidth, firewall) adds its own table, rule and route.
    ns.exec("nft", &["add", "table", "ip", "portmap"]);
    ns.exec("nft", &["add", "chain", "ip", "portmap", "pre", "{ type nat hook prerouting priority -100 ; }"]);
    ns.exec("ip", &["rule", "add", "fwmark", "0x1", "lookup", "200", "priority", "500"]);
    let out = run_plugin("CHECK", Some(&ns.path()), &c, &[]);
    assert!(out.ok, "{}", out.stdout);
}

#[test]
fn l19_old_versions_and_check_without_prev_result_are_refused() {
    // 0.3.x is accepted (the main CNIs ship 0.3.1 conflists; see l19_0_3_x_chains_work).
    for old in ["0.2.0", "0.1.0"] {
        for cmd in ["ADD", "CHECK", "DEL"] {
            let (code, text) = run_plugin(cmd, Some("/run/netns/x"), &conf(old, json!({})), &[]).error();
            assert_eq!(code, 1, "{cmd} {old}: {text}");
            assert!(text.contains(old));
        }
    }
    let (code, text) =
        run_plugin("CHECK", Some("/run/netns/x"), &conf("1.0.0", json!({"prevResult": null})), &[]).error();
    assert_eq!(code, 7);
    assert!(text.contains("prevResult"), "{text}");
}

/// flannel, Calico, Cilium and kindnet ship 0.3.1 conflists; libcni runs the chain at 0.3.x
/// with 0.4.0-shaped results (ips[].version).
#[test]
fn l19_0_3_x_chains_work() {
    if !root_or_skip("l19_0_3_x_chains_work") {
        return;
    }
    for v in ["0.3.0", "0.3.1"] {
        let ns = TestNetns::new("l19");
        let mut c = conf("0.4.0", json!({}));
        c["cniVersion"] = json!(v);
        c["prevResult"]["cniVersion"] = json!(v);
        let out = add_ok(&ns, &c);
        assert_eq!(out.json(), c["prevResult"], "{v}");
        assert!(has_capture(&ns), "{v}");
        assert!(run_plugin("CHECK", Some(&ns.path()), &c, &[]).ok, "{v}");
        assert!(run_plugin("DEL", Some(&ns.path()), &c, &[]).ok, "{v}");
        assert!(!has_capture(&ns), "{v}");
    }
}

#[test]
fn l20_version_reports_the_supported_versions() {
    for v in VERSIONS {
        let out = run_plugin("VERSION", None, &json!({"cniVersion": v}), &[]);
        assert!(out.ok);
        assert_eq!(
            out.json(),
            json!({"cniVersion": v, "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]})
        );
    }
}

#[test]
fn l21_an_unsupported_version_is_code_1_for_every_command() {
    for cmd in ["ADD", "DEL", "CHECK", "VERSION", "STATUS", "GC"] {
        let (code, text) = run_plugin(cmd, Some("/run/netns/x"), &conf("9.9.9", json!({})), &[]).error();
        assert_eq!(code, 1, "{cmd}: {text}");
        assert!(text.contains("9.9.9"), "{text}");
    }
}

#[test]
fn l22_status_is_ready_or_says_why_not_with_code_50() {
    if !root_or_skip("l22") {
        return;
    }
    let c = conf("1.1.0", json!({}));
    let out = run_plugin("STATUS", None, &c, &[]);
    assert!(out.ok && out.stdout.is_empty(), "{}\n{}", out.stdout, out.stderr);
    // The installer marks the node not ready.
    let dir = std::path::PathBuf::from(c["stateDir"].as_str().unwrap());
    std::fs::write(dir.join("node-not-ready"), "installer: uninstalling\n").unwrap();
    let (code, text) = run_plugin("STATUS", None, &c, &[]).error();
    assert_eq!(code, 50);
    assert!(text.contains("installer: uninstalling"), "{text}");
    std::fs::remove_file(dir.join("node-not-ready")).unwrap();
    assert!(run_plugin("STATUS", None, &c, &[]).ok);
    // An unusable state directory (a file stands where it should be).
    let file = std::path::PathBuf::from(state_dir());
    std::fs::write(&file, "not a directory").unwrap();
    let (code, text) =
        run_plugin("STATUS", None, &conf("1.1.0", json!({"stateDir": file.display().to_string()})), &[]).error();
    assert_eq!(code, 50, "{text}");
    let _ = std::fs::remove_file(&file);
}

#[test]
fn l23_l24_gc_removes_only_stale_attachments_of_this_network() {
    if !root_or_skip("l23") {
        return;
    }
    let dir = state_dir();
    let mine = |extra: Value| {
        let mut c = conf("1.1.0", extra);
        c["stateDir"] = json!(dir);
        c
    };
    let keep = TestNetns::new("l23");
    let stale = TestNetns::new("l23");
    let other = TestNetns::new("l23");
    let with_id = |id: &str| [("CNI_CONTAINERID", id.to_string())];
    let add = |ns: &TestNetns, c: &Value, id: &str| {
        let env = with_id(id);
        let out = run_plugin("ADD", Some(&ns.path()), c, &[(env[0].0, env[0].1.as_str())]);
        assert!(out.ok, "{}", out.stdout);
    };
    add(&keep, &mine(json!({})), "keep-1");
    add(&stale, &mine(json!({})), "stale-1");
    add(&other, &mine(json!({"name": "other-network"})), "other-1");
    // A stale record whose netns is already gone must not stop GC.
    let gone = TestNetns::new("l23");
    add(&gone, &mine(json!({})), "gone-1");
    drop(gone);

    let gc_conf =
        mine(json!({"prevResult": null, "cni.dev/valid-attachments": [{"containerID": "keep-1", "ifname": "eth0"}]}));
    let out = run_plugin("GC", None, &gc_conf, &[("CNI_CONTAINERID", ""), ("CNI_IFNAME", ""), ("CNI_NETNS", "")]);
    assert!(out.ok && out.stdout.is_empty(), "{}\n{}", out.stdout, out.stderr);
    assert!(has_capture(&keep), "GC removed a valid attachment");
    assert!(!has_capture(&stale), "GC left a stale attachment's capture");
    assert!(has_capture(&other), "GC touched another network's attachment");
    let records: Vec<String> = std::fs::read_dir(std::path::Path::new(&dir).join("attachments"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(records.len(), 2, "{records:?}");
    // The older key libcni sends works too.
    let old_key = mine(json!({"prevResult": null, "cni.dev/attachments": []}));
    assert!(run_plugin("GC", None, &old_key, &[]).ok);
    assert!(!has_capture(&keep));
    assert!(has_capture(&other));
}

#[test]
fn l25_failures_print_the_spec_error_on_stdout_and_logs_elsewhere() {
    let out = run_plugin("ADD", Some("/run/netns/x"), &conf("1.0.0", json!({"captureMode": "everything"})), &[]);
    assert!(!out.ok);
    let v = out.json();
    assert_eq!(v["cniVersion"], "1.0.0");
    assert_eq!(v["code"], 7);
    assert!(v["msg"].as_str().unwrap().contains("captureMode"));
    assert!(out.stderr.contains("ADD failed"), "the log line goes to stderr: {}", out.stderr);
    assert_eq!(out.stdout.lines().count(), 1, "stdout carries only the error");
    // Code 2 names the unsupported key and its value.
    let (code, text) =
        run_plugin("ADD", Some("/run/netns/x"), &conf("1.0.0", json!({"captureMod": "scoped"})), &[]).error();
    assert_eq!(code, 2);
    assert!(text.contains("captureMod") && text.contains("scoped"));
    // Code 6: not JSON at all.
    let out = run_plugin("ADD", Some("/run/netns/x"), &json!("just a string"), &[]);
    assert_eq!(out.error().0, 6);
}

#[test]
fn l26_fifty_pods_add_and_del_in_parallel() {
    if !root_or_skip("l26") {
        return;
    }
    let dir = state_dir();
    let mut c = conf("1.1.0", json!({}));
    c["stateDir"] = json!(dir);
    let pods: Vec<TestNetns> = (0..50).map(|_| TestNetns::new("l26")).collect();
    let run_all = |cmd: &'static str| {
        std::thread::scope(|s| {
            let handles: Vec<_> = pods
                .iter()
                .enumerate()
                .map(|(i, ns)| {
                    let c = &c;
                    s.spawn(move || {
                        let id = format!("pod-{i}");
                        run_plugin(cmd, Some(&ns.path()), c, &[("CNI_CONTAINERID", &id)])
                    })
                })
                .collect();
            for h in handles {
                let out = h.join().unwrap();
                assert!(out.ok, "{cmd}: {}\n{}", out.stdout, out.stderr);
            }
        })
    };
    run_all("ADD");
    assert!(pods.iter().all(has_capture));
    let count = || std::fs::read_dir(std::path::Path::new(&dir).join("attachments")).unwrap().count();
    assert_eq!(count(), 50);
    run_all("CHECK");
    run_all("DEL");
    assert!(pods.iter().all(|ns| !has_capture(ns)));
    assert_eq!(count(), 0);
}

#[test]
fn l27_runtime_only_keys_are_tolerated() {
    if !root_or_skip("l27") {
        return;
    }
    let ns = TestNetns::new("l27");
    add_ok(&ns, &conf("1.1.0", json!({"cniVersions": ["1.0.0", "1.1.0"], "disableCheck": false, "disableGC": false})));
}

#[test]
fn l25_logs_go_to_the_configured_file_and_stderr_never_stdout() {
    if !root_or_skip("l25b") {
        return;
    }
    let ns = TestNetns::new("l25b");
    let log = std::path::Path::new(&state_dir()).with_extension("log");
    let c = conf("1.0.0", json!({"logFile": log.display().to_string(), "logLevel": "debug"}));
    let out = add_ok(&ns, &c);
    assert_eq!(out.json(), c["prevResult"], "stdout carries only the result");
    let text = std::fs::read_to_string(&log).expect("the log file was written");
    let programmed = "cni{command=ADD pod=shop/cart-0 container=ctr-0123";
    assert!(text.contains(programmed) && text.contains("capture programmed"), "{text}");
    assert!(text.contains("table ip aether_capture {"), "debug level logs the ruleset: {text}");
    assert!(out.stderr.contains(programmed) && out.stderr.contains("capture programmed"), "{}", out.stderr);
    let _ = std::fs::remove_file(&log);
}

/// containerd 1.6's CRI plugin, for a pod sandbox without annotations, sends the declared
/// capability as `null`: that is "no annotations" on every command. Its sequence is ADD,
/// then (stop + remove) two DELs, the second without CNI_NETNS and without prevResult, with
/// CNI_ARGS pairs in another order each time; it never calls CHECK, libcni-based clients do.
#[test]
fn l07_a_null_capability_is_no_annotations_on_every_command() {
    if !root_or_skip("l07null") {
        return;
    }
    for v in VERSIONS {
        let ns = TestNetns::new("l07null");
        let c = conf(v, json!({"runtimeConfig": {"io.kubernetes.cri.pod-annotations": null, "portMappings": null}}));
        let args = [
            "K8S_POD_INFRA_CONTAINER_ID=ctr-0123;K8S_POD_UID=9e1c;IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart-0",
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart-0;K8S_POD_INFRA_CONTAINER_ID=ctr-0123;K8S_POD_UID=9e1c",
        ];
        let out = run_plugin("ADD", Some(&ns.path()), &c, &[("CNI_ARGS", args[0])]);
        assert!(out.ok, "{v}: ADD with a null annotations capability failed: {}", out.stdout);
        assert!(has_capture(&ns), "{v}: a pod without annotations gets the node default (captured)");
        let out = run_plugin("CHECK", Some(&ns.path()), &c, &[("CNI_ARGS", args[1])]);
        assert!(out.ok, "{v}: CHECK with a null annotations capability failed: {}", out.stdout);
        let out = run_plugin("DEL", Some(&ns.path()), &c, &[("CNI_ARGS", args[1])]);
        assert!(out.ok, "{v}: DEL with a null annotations capability failed: {}", out.stdout);
        assert!(!has_capture(&ns), "{v}: DEL left the capture");
        let second = conf(
            v,
            json!({"prevResult": null, "stateDir": c["stateDir"].clone(), "runtimeConfig": c["runtimeConfig"].clone()}),
        );
        let out = run_plugin("DEL", None, &second, &[("CNI_ARGS", args[0])]);
        assert!(out.ok, "{v}: the second DEL (no netns, no prevResult) failed: {}", out.stdout);
    }
}

/// DEL needs none of the pod's annotations to undo what ADD did (the record says what was
/// programmed): whatever the runtime puts in the capability, DEL removes the capture.
#[test]
fn l12_del_never_fails_on_annotations_it_does_not_need() {
    if !root_or_skip("l12ann") {
        return;
    }
    for bad in [
        json!("aether.io/capture=scoped"),
        json!(["x"]),
        json!({"aether.io/capture": 1}),
        json!({"aether.io/capture": "bogus"}),
    ] {
        let ns = TestNetns::new("l12ann");
        let c = conf("1.0.0", json!({}));
        add_ok(&ns, &c);
        let mut del = c.clone();
        del["runtimeConfig"] = json!({"io.kubernetes.cri.pod-annotations": bad.clone()});
        let out = run_plugin("DEL", Some(&ns.path()), &del, &[]);
        assert!(out.ok, "DEL with annotations {bad} failed: {}", out.stdout);
        assert!(!has_capture(&ns), "DEL with annotations {bad} left the capture");
        // ADD and CHECK do read them: a malformed value is an error naming the capability.
        let (code, text) = run_plugin("ADD", Some(&ns.path()), &del, &[]).error();
        assert_eq!(code, 7, "{bad}: {text}");
        assert!(
            text.contains("io.kubernetes.cri.pod-annotations") || text.contains("aether.io/capture"),
            "{bad}: {text}"
        );
        assert!(!has_capture(&ns), "a failed ADD with annotations {bad} left capture");
    }
}

/// Nor on a `prevResult` it cannot read: DEL does not need ADD's result (the record says what
/// was made), and a runtime that cached a damaged one must still be able to delete the pod.
#[test]
fn l12_del_never_fails_on_a_prev_result_it_does_not_need() {
    if !root_or_skip("l12prev") {
        return;
    }
    for bad in [json!("not a result"), json!([1]), json!({"ips": 5, "interfaces": "eth0"})] {
        let ns = TestNetns::new("l12prev");
        let c = conf("1.0.0", json!({}));
        add_ok(&ns, &c);
        let mut del = c.clone();
        del["prevResult"] = bad.clone();
        let out = run_plugin("DEL", Some(&ns.path()), &del, &[]);
        assert!(out.ok, "DEL with prevResult {bad} failed: {}", out.stdout);
        assert!(!has_capture(&ns), "DEL with prevResult {bad} left the capture");
    }
}
