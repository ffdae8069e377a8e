//! The network configuration and annotations (`aether_node::config`), read as the plugin
//! answers them: through the one mapping to CNI error codes.

use std::path::PathBuf;

use aether_node::config::{
    Capture, NetConf, ANNOTATION_CAPTURE, ANNOTATION_CAPTURE_DNS, ANNOTATION_EXCLUDE_CIDRS, ANNOTATION_EXCLUDE_PORTS,
    POD_ANNOTATIONS_CAPABILITY,
};
use aether_rules::capture::{CaptureConfig, CaptureMode, DnsDivert};
use aether_rules::model::PortRange;
use aether_rules::Family;
use ipnet::IpNet;
use serde_json::{json, Value};

use crate::error::CniError;

fn parse(stdin: &[u8]) -> Result<NetConf, CniError> {
    Ok(aether_node::config::parse(stdin)?)
}

fn effective(conf: &NetConf, pod_namespace: Option<&str>) -> Result<Option<CaptureConfig>, CniError> {
    Ok(aether_node::config::effective(conf, pod_namespace)?)
}

fn conf(extra: Value) -> Result<NetConf, CniError> {
    let mut base = json!({"cniVersion": "1.0.0", "name": "k8s", "type": "aether-cni", "hostIP": "10.0.0.1"});
    for (k, v) in extra.as_object().unwrap() {
        base[k] = v.clone();
    }
    parse(base.to_string().as_bytes())
}

#[test]
fn defaults_match_the_design() {
    let c = conf(json!({})).unwrap();
    assert_eq!(c.capture, Capture::Mode(CaptureMode::RedirectAll));
    assert!(c.capture_dns);
    assert_eq!(c.dns_proxy_port, 18054);
    assert_eq!(c.base, CaptureConfig::new(CaptureMode::RedirectAll));
    assert_eq!(c.exclude_namespaces, ["kube-system"]);
    assert_eq!(c.state_dir, PathBuf::from("/var/run/aether-cni"));
    let cfg = effective(&c, Some("shop")).unwrap().unwrap();
    assert_eq!(cfg.dns, Some(DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 18054 }));
}

#[test]
fn every_field_is_read() {
    let c = conf(json!({
        "captureMode": "scoped", "captureDNS": false, "capturePort": 15001, "meshL4Port": 15082,
        "scopedPorts": [15081, 15082], "dnsProxyPort": 15054, "divertMark": "0x1e71",
        "passthroughMark": 7806, "routeTable": 100, "rulePriority": 1000,
        "excludeOutboundCIDRs": ["10.9.0.0/16", "192.0.2.7", "fd00:9::/48", "2001:db8::7"],
        "excludeOutboundPorts": [22, "9000-9100"], "hostIPv6": "fd00::1",
        "excludeNamespaces": ["infra"], "logFile": "/tmp/a.log", "logLevel": "debug", "logFormat": "json", "stateDir": "/tmp/st",
        "capabilities": {"io.kubernetes.cri.pod-annotations": true}, "args": {"x": 1}, "ipMasq": false
    }))
    .unwrap();
    assert_eq!(c.capture, Capture::Mode(CaptureMode::Scoped));
    assert!(!c.capture_dns);
    assert_eq!((c.base.capture_port, c.base.mesh_l4_port, c.dns_proxy_port), (15001, 15082, 15054));
    assert_eq!(c.base.scoped_ports, [15081, 15082]);
    assert_eq!((c.base.divert_mark, c.base.passthrough_mark), (0x1e71, 7806));
    assert_eq!((c.base.route_table, c.base.rule_priority), (100, 1000));
    let cidrs: Vec<IpNet> =
        ["10.9.0.0/16", "192.0.2.7/32", "fd00:9::/48", "2001:db8::7/128"].map(|n| n.parse().unwrap()).to_vec();
    assert_eq!(c.base.excluded_cidrs, cidrs);
    assert_eq!(c.host_ipv6, Some("fd00::1".parse().unwrap()));
    assert_eq!(c.base.excluded_ports, [PortRange::single(22), PortRange { first: 9000, last: 9100 }]);
    assert_eq!(c.exclude_namespaces, ["infra"]);
    assert_eq!(c.log_file, Some(PathBuf::from("/tmp/a.log")));
    assert_eq!(c.log_level, "debug");
    assert_eq!(c.log_format, crate::log::Format::Json);
    assert_eq!(c.state_dir, PathBuf::from("/tmp/st"));
}

#[test]
fn bad_values_name_field_and_value() {
    let cases = [
        (json!({"captureMode": "everything"}), 7, "captureMode", "everything"),
        (json!({"hostIP": "not-an-ip"}), 7, "hostIP", "not-an-ip"),
        (json!({"hostIP": "127.0.0.1"}), 7, "host IP", "127.0.0.1"),
        (json!({"captureDNS": "yes"}), 7, "captureDNS", "yes"),
        (json!({"capturePort": 0}), 7, "capturePort", "0"),
        (json!({"capturePort": 70000}), 7, "capturePort", "70000"),
        (json!({"meshL4Port": "x"}), 7, "meshL4Port", "x"),
        (json!({"scopedPorts": [80, 0]}), 7, "scopedPorts", "0"),
        (json!({"scopedPorts": "80"}), 7, "scopedPorts", "80"),
        (json!({"captureMode": "scoped", "scopedPorts": []}), 7, "scopedPorts", "[]"),
        (json!({"dnsProxyPort": -1}), 7, "dnsProxyPort", "-1"),
        (json!({"divertMark": "0xzz"}), 7, "divertMark", "0xzz"),
        (json!({"divertMark": "0xae7e"}), 7, "divert mark", "0xae7e"),
        (json!({"passthroughMark": 4294967296u64}), 7, "passthroughMark", "4294967296"),
        (json!({"routeTable": 255}), 7, "route table", "255"),
        (json!({"rulePriority": 40000}), 7, "rule priority", "40000"),
        (json!({"excludeOutboundCIDRs": ["10.0.0.0/33"]}), 7, "excludeOutboundCIDRs", "10.0.0.0/33"),
        (json!({"excludeOutboundCIDRs": ["fd00::/129"]}), 7, "excludeOutboundCIDRs", "fd00::/129"),
        (json!({"excludeOutboundCIDRs": ["fd00::g/64"]}), 7, "excludeOutboundCIDRs", "fd00::g/64"),
        (json!({"excludeOutboundCIDRs": ["fd00::/064"]}), 7, "excludeOutboundCIDRs", "fd00::/064"),
        (json!({"excludeOutboundCIDRs": ["fd00::/"]}), 7, "excludeOutboundCIDRs", "fd00::/"),
        (json!({"hostIPv6": "10.0.0.1"}), 7, "hostIPv6", "10.0.0.1"),
        (json!({"hostIPv6": "fd00::1/64"}), 7, "hostIPv6", "fd00::1/64"),
        (json!({"hostIPv6": "::1"}), 7, "host IP", "::1"),
        (json!({"hostIPv6": "ff02::1"}), 7, "host IP", "ff02::1"),
        (json!({"excludeOutboundCIDRs": ["10.96.01.0/24"]}), 7, "excludeOutboundCIDRs", "10.96.01.0/24"),
        (json!({"excludeOutboundCIDRs": ["10.0.0.0/+8"]}), 7, "excludeOutboundCIDRs", "10.0.0.0/+8"),
        (json!({"excludeOutboundPorts": ["90-80"]}), 7, "excludeOutboundPorts", "90-80"),
        (json!({"excludeOutboundPorts": [true]}), 7, "excludeOutboundPorts", "true"),
        (json!({"excludeNamespaces": [1]}), 7, "excludeNamespaces", "1"),
        (json!({"logLevel": "loud"}), 7, "logLevel", "loud"),
        (json!({"logFormat": "logfmt"}), 7, "logFormat", "logfmt"),
        (json!({"logFormat": 1}), 7, "logFormat", "1"),
        (json!({"captureMod": "scoped"}), 2, "captureMod", "scoped"),
        (json!({"cniVersion": "0.2.0"}), 1, "cniVersion", "0.2.0"),
        (json!({"cniVersion": "9.9.9"}), 1, "cniVersion", "9.9.9"),
    ];
    for (extra, want_code, field, value) in cases {
        let e = conf(extra.clone()).unwrap_err();
        assert_eq!(e.code, want_code, "{extra}: {e}");
        assert!(e.msg.contains(field) && e.msg.contains(value), "{extra}: {}", e.msg);
    }
}

#[test]
fn dns_on_needs_host_ip_and_garbage_is_a_decode_error() {
    let e = parse(br#"{"cniVersion":"1.0.0","name":"n","type":"aether-cni"}"#).unwrap_err();
    assert_eq!(e.code, 7);
    assert!(e.msg.contains("hostIP"));
    assert!(parse(br#"{"cniVersion":"1.0.0","name":"n","type":"aether-cni","captureDNS":false}"#).is_ok());
    assert_eq!(parse(b"{not json").unwrap_err().code, 6);
    assert_eq!(parse(b"[1]").unwrap_err().code, 6);
}

fn with_annotations(a: Value) -> NetConf {
    conf(json!({"runtimeConfig": {POD_ANNOTATIONS_CAPABILITY: a}})).unwrap()
}

#[test]
fn annotations_refine_the_node_defaults() {
    let c = with_annotations(json!({
        ANNOTATION_CAPTURE: "scoped", ANNOTATION_CAPTURE_DNS: "false",
        ANNOTATION_EXCLUDE_PORTS: "8080, 9000-9100", ANNOTATION_EXCLUDE_CIDRS: "10.20.0.0/16,192.0.2.1",
        "unrelated.io/thing": "x"
    }));
    let cfg = effective(&c, Some("shop")).unwrap().unwrap();
    assert_eq!(cfg.mode, CaptureMode::Scoped);
    assert_eq!(cfg.dns, None);
    assert_eq!(cfg.excluded_ports, [PortRange::single(8080), PortRange { first: 9000, last: 9100 }]);
    assert_eq!(cfg.excluded_cidrs.len(), 2);
    let off = with_annotations(json!({ANNOTATION_CAPTURE: "disabled"}));
    assert_eq!(effective(&off, Some("shop")).unwrap(), None);
}

#[test]
fn excluded_namespaces_are_not_managed() {
    let c = conf(json!({})).unwrap();
    assert_eq!(effective(&c, Some("kube-system")).unwrap(), None);
    assert!(effective(&c, None).unwrap().is_some());
}

#[test]
fn malformed_annotations_fail_with_code_7_naming_them() {
    for (name, value) in [
        (ANNOTATION_CAPTURE, "sometimes"),
        (ANNOTATION_CAPTURE_DNS, "yes"),
        (ANNOTATION_EXCLUDE_PORTS, "80,http"),
        (ANNOTATION_EXCLUDE_PORTS, "0"),
        (ANNOTATION_EXCLUDE_CIDRS, "10.0.0.0/99"),
    ] {
        let c = with_annotations(json!({ name: value }));
        let e = effective(&c, Some("shop")).unwrap_err();
        assert_eq!(e.code, 7);
        assert!(e.msg.contains(name) && e.msg.contains(value), "{}", e.msg);
    }
    let c = with_annotations(json!({ANNOTATION_CAPTURE: 1}));
    let e = effective(&c, Some("shop")).unwrap_err();
    assert!(e.msg.contains(ANNOTATION_CAPTURE), "{}", e.msg);
    let e = effective(&with_annotations(json!("aether.io/capture=scoped")), Some("shop")).unwrap_err();
    assert!(e.msg.contains(POD_ANNOTATIONS_CAPABILITY) && e.msg.contains("aether.io/capture=scoped"), "{}", e.msg);
}

/// containerd 1.6 sends `null` for a pod sandbox without annotations: the node defaults,
/// as when the capability is absent. Only ADD and CHECK read annotations (`effective`);
/// parsing, which every command does, accepts any value.
#[test]
fn null_annotations_are_none_and_only_effective_reads_them() {
    let absent = effective(&conf(json!({})).unwrap(), Some("shop")).unwrap();
    assert_eq!(effective(&with_annotations(Value::Null), Some("shop")).unwrap(), absent);
    let null_rc = conf(json!({"runtimeConfig": null})).unwrap();
    assert_eq!(effective(&null_rc, Some("shop")).unwrap(), absent);
    for bad in [json!(1), json!([]), json!({ANNOTATION_CAPTURE: null}), json!({ANNOTATION_CAPTURE: "bogus"})] {
        let c = with_annotations(bad.clone());
        assert_eq!(effective(&c, Some("shop")).unwrap_err().code, 7, "{bad}");
    }
}

fn with_prev_ips(extra: Value, ips: &[&str]) -> NetConf {
    let ips: Vec<Value> = ips.iter().map(|a| json!({"address": a})).collect();
    let mut e = extra;
    e["prevResult"] = json!({"cniVersion": "1.0.0", "ips": ips});
    conf(e).unwrap()
}

/// The families come from prevResult's addresses; each family's table DNATs DNS to the
/// node address of that family.
#[test]
fn families_follow_the_pods_addresses() {
    let v6 = json!({"hostIPv6": "fd00::1"});
    let f = |c: &NetConf| effective(c, Some("shop")).unwrap().unwrap();
    let v4_only = f(&with_prev_ips(v6.clone(), &["10.1.0.5/16"]));
    assert_eq!(v4_only.families, [Family::Ipv4]);
    assert_eq!((v4_only.dns.map(|d| d.host_ip.to_string()), v4_only.dns_ipv6), (Some("10.0.0.1".into()), None));
    let v6_only = f(&with_prev_ips(v6.clone(), &["fd00:10:244::5/64"]));
    assert_eq!(v6_only.families, [Family::Ipv6]);
    assert_eq!(v6_only.dns, None);
    assert_eq!(v6_only.dns_ipv6.unwrap().host_ip.to_string(), "fd00::1");
    let dual = f(&with_prev_ips(v6.clone(), &["fd00:10:244::5/64", "10.1.0.5/16"]));
    assert_eq!(dual.families, [Family::Ipv4, Family::Ipv6], "IPv4 first, whatever the order in prevResult");
    assert!(dual.dns.is_some() && dual.dns_ipv6.is_some());
    // No addresses (or no prevResult): IPv4, as before IPv6.
    assert_eq!(f(&with_prev_ips(v6.clone(), &[])).families, [Family::Ipv4]);
    assert_eq!(f(&conf(json!({})).unwrap()).families, [Family::Ipv4]);
    // DNS off: no node address needed for either family.
    let off = f(&with_prev_ips(json!({"captureDNS": false}), &["fd00:10:244::5/64"]));
    assert_eq!((off.dns, off.dns_ipv6), (None, None));
    // An IPv6-only node: hostIPv6 alone satisfies DNS capture.
    let only6 = parse(
        br#"{"cniVersion":"1.0.0","name":"n","type":"aether-cni","hostIPv6":"fd00::1",
            "prevResult":{"cniVersion":"1.0.0","ips":[{"address":"fd00:10:244::5/64"}]}}"#,
    )
    .unwrap();
    assert_eq!(f(&only6).families, [Family::Ipv6]);
}

#[test]
fn a_family_without_its_dns_address_or_a_bad_address_is_refused_naming_it() {
    // IPv6 pod, DNS on, no hostIPv6.
    let e = effective(&with_prev_ips(json!({}), &["fd00:10:244::5/64"]), Some("shop")).unwrap_err();
    assert_eq!(e.code, 7);
    assert!(e.msg.contains("hostIPv6") && e.msg.contains("IPv6"), "{}", e.msg);
    // IPv4 pod on an IPv6-only node.
    let c = parse(
        br#"{"cniVersion":"1.0.0","name":"n","type":"aether-cni","hostIPv6":"fd00::1",
            "prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.1.0.5/16"}]}}"#,
    )
    .unwrap();
    let e = effective(&c, Some("shop")).unwrap_err();
    assert!(e.msg.contains("\"hostIP\"") && e.msg.contains("IPv4"), "{}", e.msg);
    // The annotation that turned DNS on is named.
    let mut a =
        json!({"runtimeConfig": {POD_ANNOTATIONS_CAPABILITY: {ANNOTATION_CAPTURE_DNS: "true"}}, "captureDNS": false});
    a["prevResult"] = json!({"ips": [{"address": "fd00:10:244::5/64"}]});
    let e = effective(&conf(a).unwrap(), Some("shop")).unwrap_err();
    assert!(e.msg.contains(ANNOTATION_CAPTURE_DNS) && e.msg.contains("hostIPv6"), "{}", e.msg);
    // A prevResult address that is not one.
    for bad in ["fd00::zz/64", "", "10.1.0/16"] {
        let c = with_prev_ips(json!({}), &[bad]);
        let e = effective(&c, Some("shop")).unwrap_err();
        assert_eq!(e.code, 7);
        assert!(e.msg.contains("prevResult.ips[0].address") && e.msg.contains(bad), "{}", e.msg);
    }
}

#[test]
fn ipv6_exclusions_in_the_annotation_are_read_and_checked() {
    let c = with_annotations(json!({ANNOTATION_EXCLUDE_CIDRS: "fd00:20::/32, 10.20.0.0/16,2001:db8::1"}));
    let cfg = effective(&c, Some("shop")).unwrap().unwrap();
    let want: Vec<IpNet> = ["fd00:20::/32", "10.20.0.0/16", "2001:db8::1/128"].map(|n| n.parse().unwrap()).to_vec();
    assert_eq!(cfg.excluded_cidrs, want);
    for bad in ["fd00::/200", "fd00:::1", "fd00::/-1"] {
        let e = effective(&with_annotations(json!({ANNOTATION_EXCLUDE_CIDRS: bad})), Some("shop")).unwrap_err();
        assert_eq!(e.code, 7);
        assert!(e.msg.contains(ANNOTATION_EXCLUDE_CIDRS) && e.msg.contains(bad), "{}", e.msg);
    }
}

/// An aether.io/ annotation value is capped, and no error echoes more
/// than a short prefix of a bad value.
#[test]
fn huge_values_are_refused_naming_the_limit_and_never_echoed_whole() {
    let huge = format!("10.0.0.0/8,{}", "192.0.2.1,".repeat(100_000));
    let e = effective(&with_annotations(json!({ANNOTATION_EXCLUDE_CIDRS: huge})), Some("shop")).unwrap_err();
    assert_eq!(e.code, 7);
    assert!(e.msg.contains(ANNOTATION_EXCLUDE_CIDRS) && e.msg.contains("limit of 4096 bytes"), "{}", e.msg);
    assert!(e.msg.len() < 400, "{} bytes", e.msg.len());
    // Not ours: any size (the stdin cap bounds it).
    assert!(effective(&with_annotations(json!({"other.io/x": "y".repeat(100_000)})), Some("shop")).is_ok());
    let long = "z".repeat(1_000_000);
    for extra in [
        json!({"captureMode": long}),
        json!({ &long: 1 }),
        json!({"cniVersion": long}),
        json!({"excludeOutboundCIDRs": [long]}),
    ] {
        let e = conf(extra).unwrap_err();
        assert!(e.msg.len() < 400 && e.msg.contains("bytes in all"), "{} bytes: {}", e.msg.len(), &e.msg[..100]);
    }
    let e = effective(&with_annotations(json!({ANNOTATION_CAPTURE: "q".repeat(4000)})), Some("shop")).unwrap_err();
    assert!(e.msg.len() < 400, "{} bytes", e.msg.len());
}
