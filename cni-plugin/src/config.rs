//! The network configuration (one plugin entry of the node's conflist) and the pod's
//! annotations, turned into the capture configuration `aether-rules` builds from.
//!
//! Fields are read one by one so every error names the field and the value it found.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;

use aether_rules::capture::{self, CaptureConfig, CaptureMode, DnsDivert};
use aether_rules::model::PortRange;
use aether_rules::Family;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde_json::{Map, Value};

use crate::error::{code, CniError};

/// 0.3.x: flannel, Calico, Cilium and kindnet ship 0.3.1 conflists, and libcni runs every
/// plugin of a list at the list's version (its results have the 0.4.0 shape; libcni sends
/// no CHECK below 0.4.0, and one that comes is answered as at 0.4.0).
pub const SUPPORTED_VERSIONS: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
pub const POD_ANNOTATIONS_CAPABILITY: &str = "io.kubernetes.cri.pod-annotations";
pub const DEFAULT_STATE_DIR: &str = "/var/run/aether-cni";

pub const ANNOTATION_CAPTURE: &str = "aether.io/capture";
pub const ANNOTATION_EXCLUDE_PORTS: &str = "aether.io/exclude-outbound-ports";
pub const ANNOTATION_EXCLUDE_CIDRS: &str = "aether.io/exclude-outbound-cidrs";
pub const ANNOTATION_CAPTURE_DNS: &str = "aether.io/capture-dns";

/// The largest network configuration read from stdin (prevResult and annotations included):
/// a real one is a few kilobytes.
pub const MAX_STDIN_BYTES: usize = 1024 * 1024;
/// The largest value of an `aether.io/` annotation (a few hundred exclusions; Kubernetes
/// allows 256 KiB for all of a pod's annotations together).
pub const MAX_ANNOTATION_BYTES: usize = 4096;
/// How much of a bad value an error message shows.
pub const SHOWN_BYTES: usize = 64;

/// At most [`SHOWN_BYTES`] of a value a stranger sent, for an error message.
pub fn shown(text: &str) -> String {
    crate::error::clip(text, SHOWN_BYTES)
}

/// Keys the CNI spec defines for plugin configurations (the conflist-level `cniVersions`,
/// `disableCheck` and `disableGC` are for the runtime; tolerated and ignored if passed on).
pub(crate) const SPEC_FIELDS: [&str; 13] = [
    "cniVersion",
    "cniVersions",
    "name",
    "type",
    "args",
    "capabilities",
    "runtimeConfig",
    "prevResult",
    "ipMasq",
    "ipam",
    "dns",
    "disableCheck",
    "disableGC",
];
/// This plugin's own keys.
pub(crate) const OWN_FIELDS: [&str; 19] = [
    "captureMode",
    "hostIP",
    "hostIPv6",
    "captureDNS",
    "capturePort",
    "meshL4Port",
    "scopedPorts",
    "dnsProxyPort",
    "divertMark",
    "passthroughMark",
    "routeTable",
    "rulePriority",
    "excludeOutboundCIDRs",
    "excludeOutboundPorts",
    "excludeNamespaces",
    "logFile",
    "logLevel",
    "logFormat",
    "stateDir",
];

/// A pod's capture policy before annotations: the node default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capture {
    Mode(CaptureMode),
    Disabled,
}

impl std::str::FromStr for Capture {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "redirect-all" => Ok(Capture::Mode(CaptureMode::RedirectAll)),
            "scoped" => Ok(Capture::Mode(CaptureMode::Scoped)),
            "disabled" => Ok(Capture::Disabled),
            _ => Err(()),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct NetConf {
    pub cni_version: String,
    pub name: String,
    pub prev_result: Option<Value>,
    pub capture: Capture,
    pub host_ip: Option<Ipv4Addr>,
    /// The node's IPv6 address for the DNS proxy, for pods with IPv6 addresses.
    pub host_ipv6: Option<Ipv6Addr>,
    pub capture_dns: bool,
    pub dns_proxy_port: u16,
    /// Everything but mode, DNS and exclusions, which the pod may refine.
    pub base: CaptureConfig,
    pub exclude_namespaces: Vec<String>,
    /// `runtimeConfig["io.kubernetes.cri.pod-annotations"]` as the runtime sent it, read by
    /// ADD and CHECK only (`effective`): DEL undoes what the record says and needs none of
    /// it, so a value ADD would refuse never keeps a pod from being deleted.
    pub annotations: Value,
    pub log_file: Option<PathBuf>,
    pub log_level: String,
    pub log_format: crate::log::Format,
    pub state_dir: PathBuf,
    /// GC: the attachments the runtime still has, as (container ID, ifname).
    pub valid_attachments: Option<Vec<(String, String)>>,
}

fn invalid(field: &str, value: &Value, why: &str) -> CniError {
    CniError::invalid_config(format!(
        "network configuration field {} has {}: {}",
        // Field paths are ours plus, for annotations, the runtime's key: longer, still bounded.
        crate::error::clip(&format!("{field:?}"), 4 * SHOWN_BYTES),
        shown(&value.to_string()),
        crate::error::clip(why, 4 * SHOWN_BYTES)
    ))
}

struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn str(&self, f: &str) -> Result<Option<String>, CniError> {
        match self.0.get(f) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(invalid(f, v, "expected a string")),
        }
    }

    fn bool(&self, f: &str) -> Result<Option<bool>, CniError> {
        match self.0.get(f) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(invalid(f, v, "expected true or false")),
        }
    }

    /// A number, or a string in decimal or 0x-hex (marks are written in hex).
    fn u32(&self, f: &str) -> Result<Option<u32>, CniError> {
        let Some(v) = self.0.get(f).filter(|v| !v.is_null()) else { return Ok(None) };
        let parsed = match v {
            Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
            Value::String(s) => match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
                Some(hex) => u32::from_str_radix(hex, 16).ok(),
                None => s.parse().ok(),
            },
            _ => None,
        };
        parsed
            .map(Some)
            .ok_or_else(|| invalid(f, v, "expected an unsigned 32-bit number (decimal, or a \"0x...\" string)"))
    }

    fn port(&self, f: &str) -> Result<Option<u16>, CniError> {
        let Some(v) = self.0.get(f).filter(|v| !v.is_null()) else { return Ok(None) };
        match v.as_u64() {
            Some(n @ 1..=65535) => Ok(Some(n as u16)),
            _ => Err(invalid(f, v, "expected a port number 1-65535")),
        }
    }

    fn list(&self, f: &str) -> Result<Vec<Value>, CniError> {
        match self.0.get(f) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(a)) => Ok(a.clone()),
            Some(v) => Err(invalid(f, v, "expected a list")),
        }
    }
}

/// Checks the configuration's `cniVersion` before anything else is read (code 1).
pub fn check_version(version: &str) -> Result<(), CniError> {
    if SUPPORTED_VERSIONS.contains(&version) {
        return Ok(());
    }
    Err(CniError::new(
        code::INCOMPATIBLE_VERSION,
        format!(
            "cniVersion {} is not supported; supported: {}",
            shown(&format!("{version:?}")),
            SUPPORTED_VERSIONS.join(", ")
        ),
    ))
}

/// Decodes stdin. Errors carry codes 6 (not JSON), 1 (version), 2 (unknown field), 7 (value).
pub fn parse(stdin: &[u8]) -> Result<NetConf, CniError> {
    let root: Value = serde_json::from_slice(stdin).map_err(|e| {
        CniError::new(code::DECODE_FAILURE, "the network configuration on stdin is not valid JSON")
            .with_details(e.to_string())
    })?;
    let Value::Object(map) = root else {
        return Err(CniError::new(code::DECODE_FAILURE, "the network configuration on stdin is not a JSON object"));
    };
    let f = Fields(&map);
    let cni_version = f
        .str("cniVersion")?
        .ok_or_else(|| CniError::invalid_config("network configuration field \"cniVersion\" is missing"))?;
    check_version(&cni_version)?;
    for (k, v) in &map {
        // `cni.dev/` is reserved for the runtime (e.g. GC's valid attachments).
        if !SPEC_FIELDS.contains(&k.as_str()) && !OWN_FIELDS.contains(&k.as_str()) && !k.starts_with("cni.dev/") {
            return Err(CniError::new(
                code::UNSUPPORTED_FIELD,
                format!(
                    "network configuration field {} (value {}) is not supported by aether-cni",
                    shown(&format!("{k:?}")),
                    shown(&v.to_string())
                ),
            )
            .with_details(format!("supported fields: {}", OWN_FIELDS.join(", "))));
        }
    }
    let name =
        f.str("name")?.ok_or_else(|| CniError::invalid_config("network configuration field \"name\" is missing"))?;

    let capture = match f.str("captureMode")? {
        None => Capture::Mode(CaptureMode::RedirectAll),
        Some(s) => s.parse().map_err(|()| {
            invalid("captureMode", &Value::String(s.clone()), "expected redirect-all, scoped or disabled")
        })?,
    };
    let host_ip = match f.str("hostIP")? {
        None => None,
        Some(s) => Some(
            s.parse::<Ipv4Addr>()
                .map_err(|_| invalid("hostIP", &Value::String(s.clone()), "expected an IPv4 address"))?,
        ),
    };
    let host_ipv6 = match f.str("hostIPv6")? {
        None => None,
        Some(s) => Some(
            s.parse::<Ipv6Addr>()
                .map_err(|_| invalid("hostIPv6", &Value::String(s.clone()), "expected an IPv6 address"))?,
        ),
    };
    let capture_dns = f.bool("captureDNS")?.unwrap_or(true);
    if capture_dns && host_ip.is_none() && host_ipv6.is_none() {
        return Err(CniError::invalid_config(
            "network configuration field \"hostIP\" is missing: DNS capture (captureDNS, on by default) needs the node's address (hostIP, and hostIPv6 for IPv6 pods)",
        ));
    }

    let mut base = CaptureConfig::new(CaptureMode::RedirectAll);
    if let Some(p) = f.port("capturePort")? {
        base.capture_port = p;
    }
    if let Some(p) = f.port("meshL4Port")? {
        base.mesh_l4_port = p;
    }
    let scoped = f.list("scopedPorts")?;
    if f.0.contains_key("scopedPorts") && scoped.is_empty() {
        // Scoped mode is always reachable (the node default or a pod's annotation).
        return Err(invalid(
            "scopedPorts",
            &Value::Array(scoped),
            "scoped mode would capture nothing; list at least one port",
        ));
    }
    if f.0.contains_key("scopedPorts") {
        base.scoped_ports = scoped
            .iter()
            .map(|v| match v.as_u64() {
                Some(n @ 1..=65535) => Ok(n as u16),
                _ => Err(invalid("scopedPorts", v, "expected port numbers 1-65535")),
            })
            .collect::<Result<_, _>>()?;
    }
    let dns_proxy_port = f.port("dnsProxyPort")?.unwrap_or(capture::DNS_PROXY_PORT);
    if let Some(m) = f.u32("divertMark")? {
        base.divert_mark = m;
    }
    if let Some(m) = f.u32("passthroughMark")? {
        base.passthrough_mark = m;
    }
    if let Some(t) = f.u32("routeTable")? {
        base.route_table = t;
    }
    if let Some(p) = f.u32("rulePriority")? {
        base.rule_priority = p;
    }
    for v in f.list("excludeOutboundCIDRs")? {
        base.excluded_cidrs.push(parse_cidr(&v).map_err(|why| invalid("excludeOutboundCIDRs", &v, &why))?);
    }
    for v in f.list("excludeOutboundPorts")? {
        let s = match &v {
            Value::Number(n) => n.to_string(),
            Value::String(s) => s.clone(),
            _ => String::new(),
        };
        base.excluded_ports.push(s.parse::<PortRange>().map_err(|why| invalid("excludeOutboundPorts", &v, &why))?);
    }
    let exclude_namespaces = match map.get("excludeNamespaces") {
        None => vec!["kube-system".to_string()],
        Some(_) => f
            .list("excludeNamespaces")?
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| invalid("excludeNamespaces", v, "expected namespace names"))
            })
            .collect::<Result<_, _>>()?,
    };
    let log_level = f.str("logLevel")?.unwrap_or_else(|| "info".into());
    if crate::log::parse_level(&log_level).is_none() {
        return Err(invalid("logLevel", &Value::String(log_level), "expected error, warn, info or debug"));
    }
    let log_format = match f.str("logFormat")? {
        None => crate::log::Format::Text,
        Some(s) => s.parse().map_err(|()| invalid("logFormat", &Value::String(s.clone()), "expected text or json"))?,
    };

    let conf = NetConf {
        cni_version,
        name,
        prev_result: map.get("prevResult").filter(|v| !v.is_null()).cloned(),
        capture,
        host_ip,
        host_ipv6,
        capture_dns,
        dns_proxy_port,
        base,
        exclude_namespaces,
        annotations: map
            .get("runtimeConfig")
            .and_then(|rc| rc.get(POD_ANNOTATIONS_CAPABILITY))
            .cloned()
            .unwrap_or(Value::Null),
        log_file: f.str("logFile")?.map(PathBuf::from),
        log_level,
        log_format,
        state_dir: f.str("stateDir")?.map(PathBuf::from).unwrap_or_else(|| DEFAULT_STATE_DIR.into()),
        valid_attachments: valid_attachments(&map)?,
    };
    // Node-wide numbers are checked now, so a bad node configuration fails every pod
    // the same way, with the configuration named rather than the pod.
    let mut probe = conf.base.clone();
    if let Capture::Mode(mode) = conf.capture {
        probe.mode = mode;
    }
    if conf.capture_dns {
        // The families the node has a DNS address for: each is checked as a pod's would be.
        probe.dns = conf.dns_divert(Family::Ipv4);
        probe.dns_ipv6 = conf.dns_divert(Family::Ipv6);
        probe.families = Family::ALL.into_iter().filter(|f| conf.dns_divert(*f).is_some()).collect();
    }
    probe.validate().map_err(|e| CniError::invalid_config(format!("network configuration: {e}")))?;
    Ok(conf)
}

/// `cni.dev/valid-attachments` (CNI 1.1 GC), or the older `cni.dev/attachments` libcni sends.
fn valid_attachments(map: &Map<String, Value>) -> Result<Option<Vec<(String, String)>>, CniError> {
    let Some((key, v)) =
        ["cni.dev/valid-attachments", "cni.dev/attachments"].iter().find_map(|k| map.get(*k).map(|v| (*k, v)))
    else {
        return Ok(None);
    };
    let list = v.as_array().ok_or_else(|| invalid(key, v, "expected a list of {containerID, ifname}"))?;
    list.iter()
        .map(|a| match (a.get("containerID").and_then(Value::as_str), a.get("ifname").and_then(Value::as_str)) {
            (Some(c), Some(i)) => Ok((c.to_string(), i.to_string())),
            _ => Err(invalid(key, a, "each attachment needs string fields containerID and ifname")),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn parse_cidr(v: &Value) -> Result<IpNet, String> {
    let s = v.as_str().ok_or("expected a CIDR string such as 10.0.0.0/8 or fd00::/8")?;
    parse_ip_net(s.trim(), true).ok_or_else(|| {
        format!(
            "{} is not an IPv4 or IPv6 CIDR (such as 10.0.0.0/8 or fd00::/8) or address",
            shown(&format!("{:?}", s.trim()))
        )
    })
}

/// An IPv4 CIDR (or, with `bare_address_ok`, an address as a /32). The address goes
/// through std's parser, which refuses leading zeros ("010.0.0.1" reads as octal to some
/// tools and decimal to others; ipnet alone would accept it), and the prefix must be plain
/// digits without a leading zero.
pub fn parse_ipv4_net(s: &str, bare_address_ok: bool) -> Option<Ipv4Net> {
    let (addr, prefix) = match s.split_once('/') {
        Some((a, p)) => (a, plain_prefix(p)?),
        None if bare_address_ok => (s, 32),
        None => return None,
    };
    Ipv4Net::new(addr.parse::<Ipv4Addr>().ok()?, prefix).ok()
}

/// An IPv4 or IPv6 CIDR (or, with `bare_address_ok`, an address as a /32 or /128), by
/// the same rules as [`parse_ipv4_net`]; an IPv6 address is anything with a colon.
pub fn parse_ip_net(s: &str, bare_address_ok: bool) -> Option<IpNet> {
    if !s.contains(':') {
        return parse_ipv4_net(s, bare_address_ok).map(IpNet::V4);
    }
    let (addr, prefix) = match s.split_once('/') {
        Some((a, p)) => (a, plain_prefix(p)?),
        None if bare_address_ok => (s, 128),
        None => return None,
    };
    Ipv6Net::new(addr.parse::<Ipv6Addr>().ok()?, prefix).ok().map(IpNet::V6)
}

/// A prefix length as plain digits, without a sign or a leading zero.
fn plain_prefix(p: &str) -> Option<u8> {
    (!p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) && (p == "0" || !p.starts_with('0')))
        .then(|| p.parse().ok())
        .flatten()
}

/// The pod's annotations, inserted by the runtime because the configuration declares the
/// capability. Absent and `null` both mean none: containerd 1.6 sends `null` for a pod
/// sandbox without annotations.
fn pod_annotations(v: &Value) -> Result<BTreeMap<String, String>, CniError> {
    let obj = match v {
        Value::Null => return Ok(BTreeMap::new()),
        Value::Object(obj) => obj,
        _ => {
            return Err(invalid(
                &format!("runtimeConfig.{POD_ANNOTATIONS_CAPABILITY}"),
                v,
                "expected a map of annotations",
            ))
        }
    };
    obj.iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k.clone(), s.clone())),
            other => Err(invalid(
                &format!("runtimeConfig.{POD_ANNOTATIONS_CAPABILITY}.{k}"),
                other,
                "annotation values are strings",
            )),
        })
        .collect()
}

fn bad_annotation(name: &str, value: &str, why: impl std::fmt::Display) -> CniError {
    // `why` may quote the bad item (e.g. a port range's own parser does): bounded too.
    CniError::invalid_config(format!(
        "pod annotation {name}={} is invalid: {}",
        shown(&format!("{value:?}")),
        crate::error::clip(&why.to_string(), 4 * SHOWN_BYTES)
    ))
}

/// The pod's capture configuration, or `None` when the pod is not managed.
/// A malformed annotation fails: a pod must never start half-captured.
pub fn effective(conf: &NetConf, pod_namespace: Option<&str>) -> Result<Option<CaptureConfig>, CniError> {
    if pod_namespace.is_some_and(|ns| conf.exclude_namespaces.iter().any(|e| e == ns)) {
        return Ok(None);
    }
    let a = &pod_annotations(&conf.annotations)?;
    for (name, value) in a.iter().filter(|(k, _)| k.starts_with("aether.io/")) {
        if value.len() > MAX_ANNOTATION_BYTES {
            return Err(bad_annotation(
                name,
                value,
                format!(
                    "{} bytes, over the limit of {MAX_ANNOTATION_BYTES} bytes for an aether.io/ annotation",
                    value.len()
                ),
            ));
        }
    }
    let capture = match a.get(ANNOTATION_CAPTURE) {
        None => conf.capture,
        Some(v) => v
            .parse()
            .map_err(|()| bad_annotation(ANNOTATION_CAPTURE, v, "expected redirect-all, scoped or disabled"))?,
    };
    let dns = match a.get(ANNOTATION_CAPTURE_DNS).map(String::as_str) {
        None => conf.capture_dns,
        Some("true") => true,
        Some("false") => false,
        Some(v) => return Err(bad_annotation(ANNOTATION_CAPTURE_DNS, v, "expected \"true\" or \"false\"")),
    };
    let mut cfg = conf.base.clone();
    if let Some(v) = a.get(ANNOTATION_EXCLUDE_PORTS) {
        for item in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            cfg.excluded_ports.push(item.parse().map_err(|why| bad_annotation(ANNOTATION_EXCLUDE_PORTS, v, why))?);
        }
    }
    if let Some(v) = a.get(ANNOTATION_EXCLUDE_CIDRS) {
        for item in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            cfg.excluded_cidrs.push(
                parse_cidr(&Value::String(item.into()))
                    .map_err(|why| bad_annotation(ANNOTATION_EXCLUDE_CIDRS, v, why))?,
            );
        }
    }
    let Capture::Mode(mode) = capture else { return Ok(None) };
    cfg.mode = mode;
    cfg.families = pod_families(conf.prev_result.as_ref())?;
    if dns {
        for &family in &cfg.families {
            let divert = conf.dns_divert(family).ok_or_else(|| {
                let (field, what) = match family {
                    Family::Ipv4 => ("hostIP", "an IPv4 address"),
                    Family::Ipv6 => ("hostIPv6", "an IPv6 address"),
                };
                let why = format!("the network configuration has no {field} for the DNS proxy, and the pod has {what}");
                match a.get(ANNOTATION_CAPTURE_DNS) {
                    Some(v) => bad_annotation(ANNOTATION_CAPTURE_DNS, v, why),
                    None => CniError::invalid_config(format!(
                        "network configuration field {field:?} is missing: DNS capture (captureDNS, on by default) of a pod with {what} needs it"
                    )),
                }
            })?;
            match family {
                Family::Ipv4 => cfg.dns = Some(divert),
                Family::Ipv6 => cfg.dns_ipv6 = Some(divert),
            }
        }
    }
    cfg.validate().map_err(|e| CniError::invalid_config(e.to_string()))?;
    Ok(Some(cfg))
}

impl NetConf {
    /// The node's DNS proxy for `family`'s table, if the configuration has its address.
    pub fn dns_divert(&self, family: Family) -> Option<DnsDivert> {
        let host_ip = match family {
            Family::Ipv4 => self.host_ip.map(IpAddr::from),
            Family::Ipv6 => self.host_ipv6.map(IpAddr::from),
        }?;
        Some(DnsDivert { host_ip, port: self.dns_proxy_port })
    }
}

/// The address families of the pod: those of `prevResult`'s `ips` (IPv4 first). A
/// result without addresses keeps the IPv4-only capture of earlier versions.
pub fn pod_families(prev_result: Option<&Value>) -> Result<Vec<Family>, CniError> {
    let ips = prev_result.and_then(|p| p.get("ips")).and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]);
    let mut found = Vec::new();
    for (i, ip) in ips.iter().enumerate() {
        let field = format!("prevResult.ips[{i}].address");
        let v = ip.get("address").unwrap_or(&Value::Null);
        let addr = v
            .as_str()
            .and_then(|s| s.split_once('/').map_or(Some(s), |(a, _)| Some(a)))
            .and_then(|a| a.parse::<IpAddr>().ok())
            .ok_or_else(|| invalid(&field, v, "expected an address with its prefix, such as 10.1.0.5/16"))?;
        found.push(Family::of(addr));
    }
    let families: Vec<Family> = Family::ALL.into_iter().filter(|f| found.contains(f)).collect();
    Ok(if families.is_empty() { vec![Family::Ipv4] } else { families })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
        let mut a = json!({"runtimeConfig": {POD_ANNOTATIONS_CAPABILITY: {ANNOTATION_CAPTURE_DNS: "true"}}, "captureDNS": false});
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

    /// Issue 12 item 6: an aether.io/ annotation value is capped, and no error echoes more
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
}
