//! The CNI commands: ADD, DEL, CHECK, VERSION (STATUS and GC per CNI 1.1 join them).

use aether_netns::Netns;
use aether_rules::capture::{self, CaptureConfig};
use serde_json::{json, Value};

use crate::config::{self, NetConf, SUPPORTED_VERSIONS};
use crate::env::Env;
use crate::error::{code, CniError};
use crate::services;
use crate::state::{self, Record, StateDir};
use crate::{debug, info, warn};

/// What a command prints on success (nothing for DEL and CHECK).
pub type Output = Option<Value>;

pub fn run(env: &Env, stdin: &[u8]) -> Result<Output, CniError> {
    match env.command.as_str() {
        "VERSION" => version(stdin),
        "ADD" => add(env, &load(stdin)?),
        "DEL" => del(env, &load(stdin)?),
        "CHECK" => check(env, &load(stdin)?),
        "STATUS" => status(&load(stdin)?),
        "GC" => gc(env, &load(stdin)?),
        other => Err(CniError::invalid_env(
            "CNI_COMMAND",
            format!("is {other:?}, expected ADD, DEL, CHECK, STATUS, GC or VERSION"),
        )),
    }
}

fn load(stdin: &[u8]) -> Result<NetConf, CniError> {
    config::parse(stdin)
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
        CniError::invalid_config(
            "prevResult is missing: aether-cni is a chained plugin and must run after the main CNI plugin",
        )
    })?;
    let obj =
        result.as_object_mut().ok_or_else(|| CniError::new(code::DECODE_FAILURE, "prevResult is not a JSON object"))?;
    obj.insert("cniVersion".into(), json!(conf.cni_version));
    Ok(result)
}

/// The step of ADD a test asked to fail (`AETHER_CNI_INJECT_FAILURE`): one of the rules
/// crate's steps, or `record`. Compiled in only with the `fault-injection` feature.
#[cfg(feature = "fault-injection")]
fn injected_failure() -> Option<String> {
    std::env::var("AETHER_CNI_INJECT_FAILURE").ok()
}

#[cfg(not(feature = "fault-injection"))]
fn injected_failure() -> Option<String> {
    None
}

fn add(env: &Env, conf: &NetConf) -> Result<Output, CniError> {
    let id = env.require_container_id()?;
    let netns_path = env.require_netns()?;
    let ifname = env.require_ifname()?;
    let result = pass_through(conf)?;
    let Some(cfg) = config::effective(conf, env.args.pod_namespace.as_deref())? else {
        info!("pod is not managed (disabled, or its namespace is excluded); nothing programmed");
        return Ok(Some(result));
    };
    let ruleset = capture::capture_ruleset(&cfg)?;
    let netns = Netns::open_foreign(netns_path)?;
    let state = StateDir::new(&conf.state_dir);
    let _lock = state.lock(false)?;
    let fail = injected_failure();
    let fail_step = fail.as_deref().and_then(|s| s.parse::<aether_rules::Step>().ok());
    netns.run(|| aether_rules::install(&ruleset, fail_step))??;
    let record = Record {
        network: conf.name.clone(),
        container_id: id.to_string(),
        ifname: ifname.to_string(),
        netns: netns_path.to_string(),
        pod_namespace: env.args.pod_namespace.clone(),
        pod_name: env.args.pod_name.clone(),
        pod_uid: env.args.pod_uid.clone(),
        config_digest: state::digest(&format!("{cfg:?}")),
        capture: Some(cfg.clone()),
    };
    let recorded = if fail.as_deref() == Some("record") {
        Err(CniError::new(code::IO_FAILURE, "injected failure at step record"))
    } else {
        state.write(&record)
    };
    // The Service layer comes after the record: `services apply` either sees the record or
    // ADD reads the snapshot that apply stored (both under the services lock).
    let layered = recorded.and_then(|()| {
        if fail.as_deref() == Some("services") {
            return Err(CniError::new(code::IO_FAILURE, "injected failure at step services"));
        }
        services::apply_current_snapshot_in_netns(&conf.state_dir, &netns, cfg.divert_mark)
    });
    let generation = match layered {
        Ok(generation) => generation,
        Err(e) => {
            // All or nothing: a pod with rules but no record would escape GC and CHECK.
            let pr = ruleset.policy_route;
            let undo = netns.run(|| {
                aether_rules::services::remove()?;
                aether_rules::remove(capture::TABLE, &pr)
            });
            if let Err(undo) = undo.map_err(CniError::from).and_then(|r| r.map_err(CniError::from)) {
                warn!("undoing after a failure also failed: {undo}");
            }
            if let Err(undo) = state.remove(&conf.name, id, ifname) {
                warn!("removing the record after a failure also failed: {undo}");
            }
            return Err(e);
        }
    };
    info!(mode = %cfg.mode, services_generation = %generation.map_or("none".to_string(), |g| g.to_string()), "capture programmed");
    debug!("ruleset: {}", ruleset.table);
    Ok(Some(result))
}

fn del(env: &Env, conf: &NetConf) -> Result<Output, CniError> {
    let id = env.require_container_id()?;
    let ifname = env.require_ifname()?;
    let state = StateDir::new(&conf.state_dir);
    let _lock = state.lock(false)?;
    let record = state.read(&conf.name, id, ifname);
    // Without CNI_NETNS, the record still knows where the pod lived.
    let netns_path = env.netns.clone().or_else(|| record.as_ref().map(|r| r.netns.clone()));
    detach(netns_path.as_deref(), conf, record.as_ref(), id, || state.remove(&conf.name, id, ifname))?;
    Ok(None)
}

/// Undoes an attachment: the pod's Service layer (its counts folded into the node totals)
/// and its record go together under the services lock, then the capture. A netns that is
/// already gone is fine.
fn detach(
    path: Option<&str>,
    conf: &NetConf,
    record: Option<&Record>,
    id: &str,
    forget: impl FnOnce() -> Result<(), CniError>,
) -> Result<(), CniError> {
    let netns = match path.map(Netns::open_foreign) {
        None => None,
        Some(Ok(ns)) => Some(ns),
        Some(Err(aether_netns::Error::NotFound { .. })) => {
            info!(container = %id, netns = %path.unwrap_or_default(), "netns is already gone; nothing to remove there");
            None
        }
        Some(Err(e)) => return Err(e.into()),
    };
    let retired = services::retire_layer(&conf.state_dir, netns.as_ref(), forget)?;
    for w in &retired.warnings {
        warn!(container = %id, "{w}");
    }
    if let Some(netns) = netns {
        // The policy route ADD installed is in the record; without one (a record lost, or an
        // ADD that failed before writing it) the node's settings name it.
        let policy_route =
            record.and_then(|r| r.capture.as_ref()).map_or_else(|| conf.base.policy_route(), |c| c.policy_route());
        let removed = netns.run(|| aether_rules::remove(capture::TABLE, &policy_route))??;
        info!(
            container = %id,
            netns = %netns.path().display(),
            table = removed.table,
            rule = removed.rule,
            route = removed.route,
            services_folded = %crate::log::counts(&retired.folded),
            "capture removed"
        );
    }
    Ok(())
}

fn check(env: &Env, conf: &NetConf) -> Result<Output, CniError> {
    let id = env.require_container_id()?;
    let netns_path = env.require_netns()?;
    if conf.prev_result.is_none() {
        return Err(CniError::invalid_config(
            "prevResult is missing: the runtime must pass the result of ADD to CHECK",
        ));
    }
    let ifname = env.require_ifname()?;
    let netns = Netns::open_foreign(netns_path)?;
    let expected: Option<CaptureConfig> = config::effective(conf, env.args.pod_namespace.as_deref())?;
    let diffs = match expected {
        Some(cfg) => {
            let ruleset = capture::capture_ruleset(&cfg)?;
            let mut diffs = netns.run(|| aether_rules::verify(&ruleset))??;
            match StateDir::new(&conf.state_dir).read(&conf.name, id, ifname) {
                None => diffs.push(format!("no attachment record for {id}/{ifname} in {}", conf.state_dir.display())),
                Some(r) if r.config_digest != state::digest(&format!("{cfg:?}")) => diffs.push(
                    "the pod's capture configuration changed since ADD (annotations or network configuration)".into(),
                ),
                Some(_) => {}
            }
            diffs
        }
        None => match netns.run(|| aether_rules::nft::kernel_view(capture::TABLE))?? {
            Some(_) => vec![format!("pod is not managed but table ip {} exists", capture::TABLE)],
            None => vec![],
        },
    };
    if diffs.is_empty() {
        info!("capture intact");
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
    state.probe_writable().map_err(|e| not_available(e.to_string()))?;
    kernel_probe().map_err(|e| not_available(format!("the kernel cannot hold the capture ruleset: {e}")))?;
    Ok(None)
}

/// Programs and verifies the default capture ruleset in a private, throwaway netns: the
/// only honest way to know nf_tables, tproxy, NAT and policy routing all work here.
pub fn kernel_probe() -> Result<(), String> {
    let mut cfg = CaptureConfig::new(aether_rules::CaptureMode::RedirectAll);
    cfg.dns =
        Some(aether_rules::DnsDivert { host_ip: std::net::Ipv4Addr::new(192, 0, 2, 1).into(), port: capture::DNS_PROXY_PORT });
    crate::doctor::probe(&cfg)
}

/// GC (CNI 1.1): forget attachments of this network the runtime no longer has, removing
/// what is left of their capture where their netns still exists. Keeps going past errors.
fn gc(env: &Env, conf: &NetConf) -> Result<Output, CniError> {
    env.require_path()?;
    let valid = conf.valid_attachments.clone().ok_or_else(|| {
        CniError::invalid_config("GC needs cni.dev/valid-attachments (or cni.dev/attachments) in the configuration")
    })?;
    let state = StateDir::new(&conf.state_dir);
    let _lock = state.lock(true)?;
    let mut failures = Vec::new();
    for rec in state.records().into_iter().filter(|r| r.network == conf.name) {
        if valid.iter().any(|(c, i)| *c == rec.container_id && *i == rec.ifname) {
            continue;
        }
        let outcome = detach(Some(&rec.netns), conf, Some(&rec), &rec.container_id, || {
            state.remove(&rec.network, &rec.container_id, &rec.ifname)
        });
        match outcome {
            Ok(()) => info!(container = %rec.container_id, ifname = %rec.ifname, "stale attachment removed"),
            Err(e) => failures.push(format!("{}/{}: {e}", rec.container_id, rec.ifname)),
        }
    }
    if failures.is_empty() {
        return Ok(None);
    }
    Err(CniError::new(code::IO_FAILURE, format!("GC could not remove {} stale attachment(s)", failures.len()))
        .with_details(failures.join("\n")))
}
