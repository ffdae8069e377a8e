//! The CNI commands: ADD, DEL, CHECK, VERSION (STATUS and GC per CNI 1.1 join them).

use aether_netns::Netns;
use aether_rules::capture::{self, CaptureConfig};
use serde_json::{json, Value};

use crate::config::{self, NetConf, SUPPORTED_VERSIONS};
use crate::env::Env;
use crate::error::{code, CniError};
use crate::{debug, info};

/// What a command prints on success (nothing for DEL and CHECK).
pub type Output = Option<Value>;

pub fn run(env: &Env, stdin: &[u8]) -> Result<Output, CniError> {
    match env.command.as_str() {
        "VERSION" => version(stdin),
        "ADD" => add(env, &load(stdin)?),
        "DEL" => del(env, &load(stdin)?),
        "CHECK" => check(env, &load(stdin)?),
        other => Err(CniError::invalid_env("CNI_COMMAND", format!("is {other:?}, expected ADD, DEL, CHECK or VERSION"))),
    }
}

fn load(stdin: &[u8]) -> Result<NetConf, CniError> {
    let conf = config::parse(stdin)?;
    crate::log::init(conf.log_file.as_deref(), &conf.log_level);
    Ok(conf)
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
        Err(e) => return Err(CniError::new(code::DECODE_FAILURE, "stdin is not valid JSON").with_details(e.to_string())),
    };
    let v = match requested {
        Some(v) => {
            config::check_version(&v)?;
            v
        }
        None => "1.1.0".to_string(),
    };
    Ok(Some(json!({ "cniVersion": v, "supportedVersions": SUPPORTED_VERSIONS })))
}

/// The chained result: `prevResult` untouched, at the configuration's version.
fn pass_through(conf: &NetConf) -> Result<Value, CniError> {
    let mut result = conf.prev_result.clone().ok_or_else(|| {
        CniError::invalid_config("prevResult is missing: aether-cni is a chained plugin and must run after the main CNI plugin")
    })?;
    let obj = result
        .as_object_mut()
        .ok_or_else(|| CniError::new(code::DECODE_FAILURE, "prevResult is not a JSON object"))?;
    obj.insert("cniVersion".into(), json!(conf.cni_version));
    Ok(result)
}

#[cfg(feature = "fault-injection")]
fn injected_failure() -> Option<aether_rules::Step> {
    std::env::var("AETHER_CNI_INJECT_FAILURE").ok().and_then(|s| s.parse().ok())
}

#[cfg(not(feature = "fault-injection"))]
fn injected_failure() -> Option<aether_rules::Step> {
    None
}

fn add(env: &Env, conf: &NetConf) -> Result<Output, CniError> {
    let id = env.require_container_id()?;
    let netns_path = env.require_netns()?;
    env.require_ifname()?;
    let result = pass_through(conf)?;
    let Some(cfg) = config::effective(conf, env.args.pod_namespace.as_deref())? else {
        info!("ADD {id}: pod {:?}/{:?} is not managed; nothing programmed", env.args.pod_namespace, env.args.pod_name);
        return Ok(Some(result));
    };
    let ruleset = capture::capture_ruleset(&cfg)?;
    let netns = Netns::open_foreign(netns_path)?;
    let fail = injected_failure();
    netns.run(|| aether_rules::install(&ruleset, fail))??;
    info!("ADD {id}: capture programmed in {} ({}, mode {:?})", netns_path, netns.id(), cfg.mode);
    debug!("ADD {id}: ruleset\n{}", ruleset.table);
    Ok(Some(result))
}

fn del(env: &Env, conf: &NetConf) -> Result<Output, CniError> {
    let id = env.require_container_id()?;
    env.require_ifname()?;
    let Some(netns_path) = env.netns.as_deref() else {
        info!("DEL {id}: no CNI_NETNS; nothing left to remove in a namespace");
        return Ok(None);
    };
    let netns = match Netns::open_foreign(netns_path) {
        Ok(ns) => ns,
        Err(aether_netns::Error::NotFound { .. }) => {
            info!("DEL {id}: netns {netns_path} is already gone");
            return Ok(None);
        }
        Err(e) => return Err(e.into()),
    };
    // Table and policy route are node-wide settings: DEL needs no record to find them.
    let policy_route = conf.base.policy_route();
    let removed = netns.run(|| aether_rules::remove(capture::TABLE, &policy_route))??;
    info!("DEL {id}: removed {removed:?} from {netns_path}");
    Ok(None)
}

fn check(env: &Env, conf: &NetConf) -> Result<Output, CniError> {
    let id = env.require_container_id()?;
    let netns_path = env.require_netns()?;
    env.require_ifname()?;
    if conf.prev_result.is_none() {
        return Err(CniError::invalid_config("prevResult is missing: the runtime must pass the result of ADD to CHECK"));
    }
    let netns = Netns::open_foreign(netns_path)?;
    let expected: Option<CaptureConfig> = config::effective(conf, env.args.pod_namespace.as_deref())?;
    let diffs = match expected {
        Some(cfg) => {
            let ruleset = capture::capture_ruleset(&cfg)?;
            netns.run(|| aether_rules::verify(&ruleset))??
        }
        None => match netns.run(|| aether_rules::nft::kernel_view(capture::TABLE))?? {
            Some(_) => vec![format!("pod is not managed but table ip {} exists", capture::TABLE)],
            None => vec![],
        },
    };
    if diffs.is_empty() {
        info!("CHECK {id}: capture intact in {netns_path}");
        return Ok(None);
    }
    Err(CniError::new(code::CAPTURE_NOT_INTACT, format!("the capture ruleset in {netns_path} is not intact: {}", diffs[0]))
        .with_details(diffs.join("\n")))
}
