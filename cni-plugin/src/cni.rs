//! The CNI commands: ADD, DEL, CHECK, VERSION (STATUS and GC per CNI 1.1 join them).

use aether_node::attachment::{self, LayerToBuild, Target};
use aether_node::config::{self, NetConf, SUPPORTED_VERSIONS};
use aether_node::state::StateDir;
use aether_rules::nft::OpenSockets;
use serde_json::{json, Value};

use crate::env::Env;
use crate::error::{code, CniError};
use crate::{info, warn};

/// What a command prints on success (nothing for DEL and CHECK).
pub type Output = Option<Value>;

/// A command's success: what it prints, and the work it leaves for after the answer (`main`
/// answers first).
pub struct Answer {
    pub output: Output,
    pub then: Option<AfterAnswer>,
}

/// What a command's process does once it has answered.
pub enum AfterAnswer {
    /// ADD's large Service layer, built then.
    BuildLayer(LayerToBuild),
    /// DEL's netfilter sockets, closed then: the close waits for the kernel to free what DEL
    /// removed, which is out of the ruleset already.
    CloseSockets(OpenSockets),
}

impl From<Output> for Answer {
    fn from(output: Output) -> Answer {
        Answer { output, then: None }
    }
}

pub fn run(env: &Env, stdin: &[u8]) -> Result<Answer, CniError> {
    match env.command.as_str() {
        "VERSION" => version(stdin).map(Answer::from),
        "ADD" => add(env, &load(stdin)?),
        "DEL" => del(env, &load(stdin)?),
        "CHECK" => check(env, &load(stdin)?).map(Answer::from),
        "STATUS" => status(&load(stdin)?).map(Answer::from),
        "GC" => gc(env, &load(stdin)?).map(Answer::from),
        other => Err(CniError::invalid_env(
            "CNI_COMMAND",
            format!("is {other:?}, expected ADD, DEL, CHECK, STATUS, GC or VERSION"),
        )),
    }
}

/// Reads the network configuration from `input`, at most [`config::MAX_STDIN_BYTES`]: what
/// was read, and whether it was all of it.
pub fn read_stdin(input: impl std::io::Read) -> (Vec<u8>, Result<(), CniError>) {
    let mut buf = Vec::new();
    let limit = config::MAX_STDIN_BYTES;
    let read = std::io::Read::read_to_end(&mut std::io::Read::take(input, limit as u64 + 1), &mut buf);
    let outcome = match read {
        Err(e) => Err(CniError::new(code::IO_FAILURE, "cannot read stdin").with_details(e.to_string())),
        Ok(n) if n > limit => Err(CniError::invalid_config(format!(
            "the network configuration on stdin is over the limit of {limit} bytes (prevResult and annotations included)"
        ))),
        Ok(_) => Ok(()),
    };
    (buf, outcome)
}

fn load(stdin: &[u8]) -> Result<NetConf, CniError> {
    Ok(config::parse(stdin)?)
}

/// The configuration's version if it has a usable one, for error JSON.
pub fn version_of(stdin: &[u8]) -> String {
    serde_json::from_slice::<Value>(stdin)
        .ok()
        .and_then(|v| v.get("cniVersion").and_then(Value::as_str).map(str::to_string))
        .filter(|v| SUPPORTED_VERSIONS.contains(&v.as_str()))
        .unwrap_or_else(|| "1.1.0".to_string())
}

fn version(stdin: &[u8]) -> Result<Output, CniError> {
    // VERSION may come with an empty stdin or just {"cniVersion": ...}.
    let requested = match serde_json::from_slice::<Value>(stdin) {
        Ok(v) => v.get("cniVersion").and_then(Value::as_str).map(str::to_string),
        Err(_) if stdin.iter().all(u8::is_ascii_whitespace) => None,
        Err(e) => {
            return Err(CniError::new(code::DECODE_FAILURE, "stdin is not valid JSON").with_details(e.to_string()))
        }
    };
    let v = match requested {
        Some(v) => {
            config::check_version(&v).map_err(CniError::from)?;
            v
        }
        None => "1.1.0".to_string(),
    };
    Ok(Some(json!({ "cniVersion": v, "supportedVersions": SUPPORTED_VERSIONS })))
}

/// The chained result: `prevResult` untouched (once it proves to be a result of the
/// configuration's version), labelled with that version when it had no label.
fn pass_through(conf: &NetConf) -> Result<Value, CniError> {
    let mut result = conf.prev_result.clone().ok_or_else(|| {
        CniError::invalid_config(
            "prevResult is missing: aether-cni is a chained plugin and must run after the main CNI plugin",
        )
    })?;
    check_prev_result(&conf.cni_version, &result)?;
    let obj = result.as_object_mut().expect("checked to be an object");
    obj.entry("cniVersion").or_insert_with(|| json!(conf.cni_version));
    Ok(result)
}

/// Checks that `prev` is a CNI result of `version` (the configuration's), as the reference
/// plugins do (libcni's `ParsePrevResult`): the version must match (a result of another
/// version is not converted, code 1), and every field the result type defines has its type,
/// addresses and CIDRs parse (code 6, naming the field and a short prefix of the value).
/// Fields the type does not define are tolerated and passed through. A prevResult without a
/// `cniVersion` is read at the configuration's version (CNI spec).
pub fn check_prev_result(version: &str, prev: &Value) -> Result<(), CniError> {
    let bad = |field: &str, v: &Value, want: &str| {
        CniError::new(
            code::DECODE_FAILURE,
            format!("prevResult.{field} has {}: expected {want}", config::shown(&v.to_string())),
        )
    };
    let obj = prev.as_object().ok_or_else(|| bad("", prev, "a CNI result object"))?;
    match obj.get("cniVersion") {
        None => {}
        Some(Value::String(v)) if v == version => {}
        Some(Value::String(v)) => {
            return Err(CniError::new(
                code::INCOMPATIBLE_VERSION,
                format!(
                    "prevResult is a {} result but the configuration's cniVersion is {version}; the runtime must pass the previous plugin's result at the configuration's version",
                    config::shown(v)
                ),
            ))
        }
        Some(v) => return Err(bad("cniVersion", v, "a version string")),
    }
    let list = |field: &str| -> Result<&[Value], CniError> {
        match obj.get(field) {
            None | Some(Value::Null) => Ok(&[]),
            Some(Value::Array(a)) => Ok(a),
            Some(v) => Err(bad(field, v, "a list")),
        }
    };
    let member = |path: &str, item: &Value| -> Result<serde_json::Map<String, Value>, CniError> {
        item.as_object().cloned().ok_or_else(|| bad(path, item, "an object"))
    };
    let string = |path: String, v: Option<&Value>| match v {
        None | Some(Value::Null) | Some(Value::String(_)) => Ok(()),
        Some(v) => Err(bad(&path, v, "a string")),
    };
    let number = |path: String, v: Option<&Value>| match v {
        None | Some(Value::Null) => Ok(()),
        Some(v) if v.as_i64().is_some() => Ok(()),
        Some(v) => Err(bad(&path, v, "an integer")),
    };
    let address = |path: String, v: Option<&Value>, cidr: bool, required: bool| match v {
        None | Some(Value::Null) if !required => Ok(()),
        Some(Value::String(s)) if cidr && parse_cidr(s).is_some() => Ok(()),
        Some(Value::String(s)) if !cidr && s.parse::<std::net::IpAddr>().is_ok() => Ok(()),
        Some(v) => Err(bad(&path, v, if cidr { "an address with a prefix length (CIDR)" } else { "an IP address" })),
        None => Err(CniError::new(code::DECODE_FAILURE, format!("prevResult.{path} is missing"))),
    };
    for (i, item) in list("interfaces")?.iter().enumerate() {
        let m = member(&format!("interfaces[{i}]"), item)?;
        for f in ["name", "mac", "sandbox", "socketPath", "pciID"] {
            string(format!("interfaces[{i}].{f}"), m.get(f))?;
        }
        number(format!("interfaces[{i}].mtu"), m.get("mtu"))?;
    }
    for (i, item) in list("ips")?.iter().enumerate() {
        let m = member(&format!("ips[{i}]"), item)?;
        address(format!("ips[{i}].address"), m.get("address"), true, true)?;
        address(format!("ips[{i}].gateway"), m.get("gateway"), false, false)?;
        number(format!("ips[{i}].interface"), m.get("interface"))?;
        if version.starts_with("0.") {
            // 0.3.x/0.4.0 results say each address's family ("4" or "6"); 1.0.0 dropped it.
            let family = m.get("address").and_then(Value::as_str).and_then(parse_cidr).map(|ip| match ip {
                std::net::IpAddr::V4(_) => "4",
                std::net::IpAddr::V6(_) => "6",
            });
            match m.get("version") {
                None => {}
                Some(Value::String(v)) if Some(v.as_str()) == family => {}
                Some(v) => return Err(bad(&format!("ips[{i}].version"), v, "\"4\" or \"6\", the address's family")),
            }
        }
    }
    for (i, item) in list("routes")?.iter().enumerate() {
        let m = member(&format!("routes[{i}]"), item)?;
        address(format!("routes[{i}].dst"), m.get("dst"), true, true)?;
        address(format!("routes[{i}].gw"), m.get("gw"), false, false)?;
        for f in ["mtu", "advmss", "priority", "table", "scope"] {
            number(format!("routes[{i}].{f}"), m.get(f))?;
        }
    }
    match obj.get("dns") {
        None | Some(Value::Null) => {}
        Some(Value::Object(d)) => {
            string("dns.domain".into(), d.get("domain"))?;
            for f in ["nameservers", "search", "options"] {
                match d.get(f) {
                    None | Some(Value::Null) => {}
                    Some(Value::Array(a)) => {
                        for (i, x) in a.iter().enumerate() {
                            string(format!("dns.{f}[{i}]"), Some(x))?;
                        }
                    }
                    Some(v) => return Err(bad(&format!("dns.{f}"), v, "a list of strings")),
                }
            }
        }
        Some(v) => return Err(bad("dns", v, "an object")),
    }
    Ok(())
}

/// An address with a prefix length, as Go's `net.ParseCIDR` reads it (host bits allowed).
fn parse_cidr(s: &str) -> Option<std::net::IpAddr> {
    let (addr, prefix) = s.split_once('/')?;
    let ip: std::net::IpAddr = addr.parse().ok()?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    (!prefix.is_empty() && prefix.len() <= 3 && prefix.bytes().all(|b| b.is_ascii_digit()))
        .then(|| prefix.parse::<u8>().ok())
        .flatten()
        .filter(|p| *p <= max)
        .map(|_| ip)
}

fn add(env: &Env, conf: &NetConf) -> Result<Answer, CniError> {
    let id = env.require_container_id()?;
    let netns_path = env.require_netns()?;
    let ifname = env.require_ifname()?;
    let result = pass_through(conf)?;
    let Some(cfg) = config::effective(conf, env.args.namespace.as_deref())? else {
        info!("pod is not managed (disabled, or its namespace is excluded); nothing programmed");
        return Ok(Some(result).into());
    };
    let target = Target { network: &conf.name, container_id: id, ifname };
    let attached = attachment::attach(conf, target, &env.args, netns_path, &cfg)?;
    Ok(Answer { output: Some(result), then: attached.layer_after_answer.map(AfterAnswer::BuildLayer) })
}

fn del(env: &Env, conf: &NetConf) -> Result<Answer, CniError> {
    let id = env.require_container_id()?;
    let ifname = env.require_ifname()?;
    let target = Target { network: &conf.name, container_id: id, ifname };
    let sockets = attachment::detach(conf, target, env.netns.as_deref())?;
    finish_uninstall(conf);
    Ok(Answer { output: None, then: (!sockets.is_empty()).then_some(AfterAnswer::CloseSockets(sockets)) })
}

/// After a DEL or GC that may have removed the node's last record: the binary an uninstall
/// left for the attached pods goes with the last of them (aether_node::state::uninstall).
/// The teardown itself succeeded whatever this does.
fn finish_uninstall(conf: &NetConf) {
    match aether_node::state::finish_uninstall(&StateDir::new(&conf.state_dir)) {
        Ok(Some(path)) => {
            info!(binary = %path.display(), "the last attached pod is gone: the plugin binary the uninstall left is removed")
        }
        Ok(None) => {}
        Err(e) => warn!("the plugin binary the uninstall left cannot be removed: {e}"),
    }
}

fn check(env: &Env, conf: &NetConf) -> Result<Output, CniError> {
    let id = env.require_container_id()?;
    let netns_path = env.require_netns()?;
    let Some(prev) = &conf.prev_result else {
        return Err(CniError::invalid_config(
            "prevResult is missing: the runtime must pass the result of ADD to CHECK",
        ));
    };
    check_prev_result(&conf.cni_version, prev)?;
    let ifname = env.require_ifname()?;
    // The netns first: a missing one is "container unknown" before any configuration error.
    let netns = aether_netns::Netns::open_foreign(netns_path)?;
    let expected = config::effective(conf, env.args.namespace.as_deref())?;
    let target = Target { network: &conf.name, container_id: id, ifname };
    let diffs = attachment::verify(conf, target, &netns, expected.as_ref())?;
    if diffs.is_empty() {
        // Intact as its record says: a pod of an earlier release's ruleset is said to be one.
        match StateDir::new(&conf.state_dir).read(&conf.name, id, ifname) {
            Ok(Some(r)) if !r.ruleset().is_current() => {
                info!("capture intact: {}; migration pending", r.ruleset())
            }
            _ => info!("capture intact"),
        }
        return Ok(None);
    }
    Err(CniError::new(
        code::CAPTURE_NOT_INTACT,
        format!("the capture ruleset in {netns_path} is not intact: {}", diffs[0]),
    )
    .with_details(diffs.join("\n")))
}

/// STATUS (CNI 1.1): ready when the state directory is usable, the kernel can hold the
/// capture ruleset, and the installer has not marked the node not ready.
fn status(conf: &NetConf) -> Result<Output, CniError> {
    let not_available = |why: String| CniError::new(code::NOT_AVAILABLE, why);
    let state = StateDir::new(&conf.state_dir);
    if let Some(reason) = state.not_ready_reason() {
        return Err(not_available(format!("the node is marked not ready: {reason}")));
    }
    state.probe_writable().map_err(|e| not_available(CniError::from(e).to_string()))?;
    aether_node::probe::kernel_probe()
        .map_err(|e| not_available(format!("the kernel cannot hold the capture ruleset: {e}")))?;
    Ok(None)
}

/// GC (CNI 1.1): forget attachments of this network the runtime no longer has (see
/// `attachment::collect`).
fn gc(env: &Env, conf: &NetConf) -> Result<Output, CniError> {
    env.require_path()?;
    let valid = conf.valid_attachments.clone().ok_or_else(|| {
        CniError::invalid_config("GC needs cni.dev/valid-attachments (or cni.dev/attachments) in the configuration")
    })?;
    attachment::collect(conf, |c, i| valid.iter().any(|(vc, vi)| vc == c && vi == i))?;
    finish_uninstall(conf);
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v1(extra: Value) -> Value {
        let mut r = json!({
            "cniVersion": "1.0.0",
            "interfaces": [{"name": "eth0", "mac": "0a:58:0a:f4:01:05", "sandbox": "/var/run/netns/x", "mtu": 1500}],
            "ips": [{"address": "10.244.1.5/24", "gateway": "10.244.1.1", "interface": 0}, {"address": "fd00::5/64"}],
            "routes": [{"dst": "0.0.0.0/0", "gw": "10.244.1.1", "mtu": 1400, "table": 100}],
            "dns": {"nameservers": ["10.96.0.10"], "search": ["svc.cluster.local"], "options": ["ndots:5"]}
        });
        for (k, v) in extra.as_object().unwrap() {
            r[k] = v.clone();
        }
        r
    }

    /// What Debian's Go plugins (libcni 1.1 `ParsePrevResult`, tried with
    /// /usr/lib/cni/tuning) refuse is refused, with the spec's code and the field named.
    #[test]
    fn prev_result_is_read_as_its_versions_result_type() {
        assert!(check_prev_result("1.0.0", &v1(json!({}))).is_ok());
        assert!(check_prev_result("1.1.0", &v1(json!({"cniVersion": "1.1.0", "unknownKey": 1}))).is_ok());
        assert!(check_prev_result("1.0.0", &json!({"ips": [{"address": "10.1.0.5/16"}]})).is_ok(), "no cniVersion");
        let v040 = json!({"cniVersion": "0.4.0", "ips": [{"version": "4", "address": "10.1.0.5/16"}]});
        assert!(check_prev_result("0.4.0", &v040).is_ok());
        let v031 = json!({"cniVersion": "0.3.1", "ips": [{"version": "4", "address": "10.1.0.5/16"}]});
        assert!(check_prev_result("0.3.1", &v031).is_ok());
        let cases: [(&str, Value, u32, &str); 13] = [
            ("1.0.0", v040.clone(), 1, "0.4.0"),
            ("0.4.0", v1(json!({})), 1, "1.0.0"),
            ("1.0.0", v1(json!({"ips": [{"address": "300.1.1.1/24"}]})), 6, "ips[0].address"),
            ("1.0.0", v1(json!({"ips": [{"address": "10.1.0.5"}]})), 6, "ips[0].address"),
            ("1.0.0", v1(json!({"ips": [{"gateway": "10.1.0.1"}]})), 6, "ips[0].address is missing"),
            ("1.0.0", v1(json!({"ips": [{"address": "10.1.0.5/16", "gateway": "1.2.3"}]})), 6, "ips[0].gateway"),
            ("1.0.0", v1(json!({"interfaces": {"name": "eth0"}})), 6, "interfaces"),
            ("1.0.0", v1(json!({"interfaces": [{"name": 7}]})), 6, "interfaces[0].name"),
            ("1.0.0", v1(json!({"routes": [{"dst": "0.0.0.0/99"}]})), 6, "routes[0].dst"),
            ("1.0.0", v1(json!({"dns": {"nameservers": "x"}})), 6, "dns.nameservers"),
            ("1.0.0", json!([1]), 6, "CNI result object"),
            (
                "0.4.0",
                json!({"cniVersion": "0.4.0", "ips": [{"version": "6", "address": "10.1.0.5/16"}]}),
                6,
                "ips[0].version",
            ),
            ("1.0.0", v1(json!({"ips": [{"address": format!("{}/24", "9".repeat(100_000))}]})), 6, "bytes in all"),
        ];
        for (version, prev, want, needle) in cases {
            let e = check_prev_result(version, &prev).unwrap_err();
            assert_eq!(e.code, want, "{version} {prev}: {e}");
            assert!(e.msg.contains(needle), "{version}: {}", e.msg);
            assert!(e.msg.len() < 400, "the message echoes too much: {} bytes", e.msg.len());
        }
    }

    /// Stdin is read up to a documented size, and the error names it.
    #[test]
    fn stdin_is_capped_naming_the_limit() {
        let (read, ok) = read_stdin(&b"{}"[..]);
        assert!(ok.is_ok() && read == b"{}");
        let big = vec![b' '; config::MAX_STDIN_BYTES + 10];
        let (read, e) = read_stdin(&big[..]);
        let e = e.unwrap_err();
        assert_eq!(e.code, code::INVALID_CONFIG);
        assert!(e.msg.contains(&format!("limit of {} bytes", config::MAX_STDIN_BYTES)), "{}", e.msg);
        assert_eq!(read.len(), config::MAX_STDIN_BYTES + 1, "reading stops past the limit");
    }
}
