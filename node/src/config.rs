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

use crate::text::clip;

/// Why a network configuration or a pod's annotations are refused. Each says the field (or
/// annotation) and a bounded part of the value; the binary maps them to CNI codes.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A `cniVersion` this plugin does not speak.
    #[error("cniVersion {version} is not supported; supported: {}", SUPPORTED_VERSIONS.join(", "))]
    UnsupportedVersion { version: String },
    /// Stdin is not JSON (the parser's reason apart).
    #[error("the network configuration on stdin is not valid JSON")]
    NotJson { why: String },
    #[error("the network configuration on stdin is not a JSON object")]
    NotAnObject,
    /// A field this plugin does not know.
    #[error("network configuration field {field} (value {value}) is not supported by aether-cni")]
    UnknownField { field: String, value: String },
    /// A required field is absent; `why` says what needs it (empty: the spec does).
    #[error("network configuration field {field:?} is missing{why}")]
    Missing { field: &'static str, why: &'static str },
    /// A field's value is refused.
    #[error("network configuration field {field} has {value}: {why}")]
    BadValue { field: String, value: String, why: String },
    /// A pod annotation's value is refused.
    #[error("pod annotation {name}={value} is invalid: {why}")]
    BadAnnotation { name: String, value: String, why: String },
    /// The node-wide settings together cannot make a ruleset.
    #[error("network configuration: {0}")]
    Node(aether_rules::Error),
    /// The pod's settings (node settings refined by its annotations) cannot make a ruleset.
    #[error("{0}")]
    Pod(aether_rules::Error),
}

impl ConfigError {
    /// What lies under the message, for the CNI error's details: the JSON parser's reason,
    /// or the supported fields.
    pub fn details(&self) -> Option<String> {
        match self {
            ConfigError::NotJson { why } => Some(why.clone()),
            ConfigError::UnknownField { .. } => Some(supported_fields()),
            _ => None,
        }
    }
}

/// The supported fields, for an unknown field's message.
pub fn supported_fields() -> String {
    format!("supported fields: {}", OWN_FIELDS.join(", "))
}

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
    clip(text, SHOWN_BYTES)
}

/// Keys the CNI spec defines for plugin configurations (the conflist-level `cniVersions`,
/// `disableCheck` and `disableGC` are for the runtime; tolerated and ignored if passed on).
pub const SPEC_FIELDS: [&str; 13] = [
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
pub const OWN_FIELDS: [&str; 19] = [
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

/// `logLevel`'s values, most severe first.
pub const LOG_LEVELS: [&str; 4] = ["error", "warn", "info", "debug"];

/// `logFormat`: one line per event as text or as JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            _ => Err(()),
        }
    }
}

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
    pub log_format: LogFormat,
    pub state_dir: PathBuf,
    /// GC: the attachments the runtime still has, as (container ID, ifname).
    pub valid_attachments: Option<Vec<(String, String)>>,
}

fn invalid(field: &str, value: &Value, why: &str) -> ConfigError {
    ConfigError::BadValue {
        // Field paths are ours plus, for annotations, the runtime's key: longer, still bounded.
        field: clip(&format!("{field:?}"), 4 * SHOWN_BYTES),
        value: shown(&value.to_string()),
        why: clip(why, 4 * SHOWN_BYTES),
    }
}

struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn str(&self, f: &str) -> Result<Option<String>, ConfigError> {
        match self.0.get(f) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(invalid(f, v, "expected a string")),
        }
    }

    fn bool(&self, f: &str) -> Result<Option<bool>, ConfigError> {
        match self.0.get(f) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(invalid(f, v, "expected true or false")),
        }
    }

    /// A number, or a string in decimal or 0x-hex (marks are written in hex).
    fn u32(&self, f: &str) -> Result<Option<u32>, ConfigError> {
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

    fn port(&self, f: &str) -> Result<Option<u16>, ConfigError> {
        let Some(v) = self.0.get(f).filter(|v| !v.is_null()) else { return Ok(None) };
        match v.as_u64() {
            Some(n @ 1..=65535) => Ok(Some(n as u16)),
            _ => Err(invalid(f, v, "expected a port number 1-65535")),
        }
    }

    fn list(&self, f: &str) -> Result<Vec<Value>, ConfigError> {
        match self.0.get(f) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(a)) => Ok(a.clone()),
            Some(v) => Err(invalid(f, v, "expected a list")),
        }
    }
}

/// Checks the configuration's `cniVersion` before anything else is read (code 1).
pub fn check_version(version: &str) -> Result<(), ConfigError> {
    if SUPPORTED_VERSIONS.contains(&version) {
        return Ok(());
    }
    Err(ConfigError::UnsupportedVersion { version: shown(&format!("{version:?}")) })
}

/// Decodes stdin. Errors carry codes 6 (not JSON), 1 (version), 2 (unknown field), 7 (value).
pub fn parse(stdin: &[u8]) -> Result<NetConf, ConfigError> {
    let root: Value = serde_json::from_slice(stdin).map_err(|e| ConfigError::NotJson { why: e.to_string() })?;
    let Value::Object(map) = root else {
        return Err(ConfigError::NotAnObject);
    };
    let f = Fields(&map);
    let cni_version = f.str("cniVersion")?.ok_or(ConfigError::Missing { field: "cniVersion", why: "" })?;
    check_version(&cni_version)?;
    for (k, v) in &map {
        // `cni.dev/` is reserved for the runtime (e.g. GC's valid attachments).
        if !SPEC_FIELDS.contains(&k.as_str()) && !OWN_FIELDS.contains(&k.as_str()) && !k.starts_with("cni.dev/") {
            return Err(ConfigError::UnknownField { field: shown(&format!("{k:?}")), value: shown(&v.to_string()) });
        }
    }
    let name = f.str("name")?.ok_or(ConfigError::Missing { field: "name", why: "" })?;

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
        return Err(ConfigError::Missing {
            field: "hostIP",
            why: ": DNS capture (captureDNS, on by default) needs the node's address (hostIP, and hostIPv6 for IPv6 pods)",
        });
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
    if !LOG_LEVELS.contains(&log_level.as_str()) {
        return Err(invalid("logLevel", &Value::String(log_level), "expected error, warn, info or debug"));
    }
    let log_format = match f.str("logFormat")? {
        None => LogFormat::Text,
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
    probe.validate().map_err(ConfigError::Node)?;
    Ok(conf)
}

/// `cni.dev/valid-attachments` (CNI 1.1 GC), or the older `cni.dev/attachments` libcni sends.
fn valid_attachments(map: &Map<String, Value>) -> Result<Option<Vec<(String, String)>>, ConfigError> {
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
fn pod_annotations(v: &Value) -> Result<BTreeMap<String, String>, ConfigError> {
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

fn bad_annotation(name: &str, value: &str, why: impl std::fmt::Display) -> ConfigError {
    // `why` may quote the bad item (e.g. a port range's own parser does): bounded too.
    ConfigError::BadAnnotation {
        name: name.to_string(),
        value: shown(&format!("{value:?}")),
        why: clip(&why.to_string(), 4 * SHOWN_BYTES),
    }
}

/// The pod's capture configuration, or `None` when the pod is not managed.
/// A malformed annotation fails: a pod must never start half-captured.
pub fn effective(conf: &NetConf, pod_namespace: Option<&str>) -> Result<Option<CaptureConfig>, ConfigError> {
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
                    None => ConfigError::Missing {
                        field,
                        why: match family {
                            Family::Ipv4 => {
                                ": DNS capture (captureDNS, on by default) of a pod with an IPv4 address needs it"
                            }
                            Family::Ipv6 => {
                                ": DNS capture (captureDNS, on by default) of a pod with an IPv6 address needs it"
                            }
                        },
                    },
                }
            })?;
            match family {
                Family::Ipv4 => cfg.dns = Some(divert),
                Family::Ipv6 => cfg.dns_ipv6 = Some(divert),
            }
        }
    }
    cfg.validate().map_err(ConfigError::Pod)?;
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
pub fn pod_families(prev_result: Option<&Value>) -> Result<Vec<Family>, ConfigError> {
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
