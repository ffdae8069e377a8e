//! `aether-cni inspect [container-id | netns path]`: a pod's capture and Service layers,
//! readable on a node that has no `nft` binary; with no argument, every recorded
//! attachment in one line each, with whether its layers are intact.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use aether_netns::Netns;
use aether_rules::capture;

use aether_node::services;
use aether_node::state::{self, PodNetns, Record, Recorded, StateDir};

#[derive(clap::Args)]
pub struct InspectArgs {
    /// A container ID with an attachment record, or a netns path. Without one: every
    /// recorded attachment, one line each, with whether its layers are intact.
    target: Option<String>,
    /// The node state directory (the `stateDir` of the network configuration).
    #[arg(long, default_value = aether_node::config::DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
}

pub fn run(args: InspectArgs) -> ExitCode {
    if let Some(why) = state::unusable_reason(&args.state_dir) {
        eprintln!("aether-cni inspect: state directory {} {why}", args.state_dir.display());
        return ExitCode::FAILURE;
    }
    match &args.target {
        None => list(&args.state_dir),
        Some(target) => one(&args.state_dir, target),
    }
}

/// Every recorded attachment, one line each: the pod, and whether the kernel holds its
/// capture and its Service layer as recorded. Fails when any layer is not intact.
fn list(state_dir: &Path) -> ExitCode {
    let scan = StateDir::new(state_dir).scan();
    for u in &scan.unreadable {
        println!("attachment record {} cannot be read: {}", u.file, u.why);
    }
    let records = scan.records;
    if records.is_empty() && scan.unreadable.is_empty() {
        println!("no attachment records in {} (no pod is attached on this node)", state_dir.display());
        print_reconciler(state_dir);
        return ExitCode::SUCCESS;
    }
    let mut rows = vec![["POD", "CONTAINER", "IFNAME", "NETNS", "CAPTURE", "SERVICE LAYER"].map(String::from)];
    let mut all_intact = true;
    for r in &records {
        let (capture, services) = match r.open_netns() {
            Ok(PodNetns::Gone(_)) => ("netns gone (GC removes the record)".into(), "-".into()),
            Err(e) => (format!("cannot open the netns: {e}"), "-".into()),
            Ok(PodNetns::Live(netns)) => {
                let held = held_ruleset(r, &netns);
                let capture = match r.capture.as_ref().map(|cfg| differences(&netns, cfg, held)) {
                    None => "unknown (the record predates stored configurations)".to_string(),
                    Some(Ok(d)) if d.is_empty() && !held.is_current() => {
                        format!("intact, {held}; migration pending")
                    }
                    Some(Ok(d)) if d.is_empty() => "intact".into(),
                    Some(Ok(d)) => {
                        all_intact = false;
                        format!("NOT INTACT ({})", crate::log::plural(d.len(), "difference"))
                    }
                    Some(Err(e)) => {
                        all_intact = false;
                        format!("unknown ({e})")
                    }
                };
                let mark = r.capture.as_ref().map(|c| c.divert_mark);
                let (_, verdict) = services::describe_pod_layer(state_dir, &netns, mark);
                all_intact &= verdict.is_intact();
                (capture, verdict.to_string())
            }
        };
        let pod = crate::log::pod_name(r.pod_namespace.as_deref(), r.pod_name.as_deref()).unwrap_or("-".into());
        rows.push([pod, r.container_id.clone(), r.ifname.clone(), r.netns.clone(), capture, services]);
    }
    println!("state directory {}: {}", state_dir.display(), crate::log::plural(records.len(), "attachment"));
    let widths: Vec<usize> = (0..6).map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0)).collect();
    for row in &rows {
        let cells: Vec<String> = row.iter().zip(&widths).map(|(c, w)| format!("{c:w$}")).collect();
        println!("{}", cells.join("  ").trim_end());
    }
    print_reconciler(state_dir);
    if all_intact && scan.unreadable.is_empty() {
        ExitCode::SUCCESS
    } else {
        println!("`aether-cni inspect <container>` lists what differs");
        ExitCode::FAILURE
    }
}

/// What the installer's reconciler last saw (its last pass, in the state directory): when,
/// the pods by state, the ones that needed something and why they got nothing, and what it
/// did.
fn print_reconciler(state_dir: &Path) {
    use aether_node::state::LAST_PASS_FILE;
    use serde_json::Value;
    // No file: no reconciler on this node (or not yet): nothing to say.
    let Ok(text) = std::fs::read_to_string(state_dir.join(LAST_PASS_FILE)) else { return };
    let Ok(pass) = serde_json::from_str::<Value>(&text) else {
        println!("\nreconciler: {LAST_PASS_FILE} cannot be read");
        return;
    };
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let ago = now.saturating_sub(pass["finished"].as_u64().unwrap_or(0));
    let pods = pass["pods"].as_array().cloned().unwrap_or_default();
    let mut by_state = std::collections::BTreeMap::<String, usize>::new();
    for p in &pods {
        *by_state.entry(p["state"].as_str().unwrap_or("?").to_string()).or_default() += 1;
    }
    let states: Vec<String> = by_state.iter().map(|(s, n)| format!("{n} {s}")).collect();
    println!(
        "\nreconciler: last pass {ago} s ago (pass {}, {} µs): {}",
        pass["pass"],
        pass["tookMicros"],
        if states.is_empty() { "no pods".to_string() } else { states.join(", ") }
    );
    if let Some(why) = pass["runtimeUnseen"].as_str() {
        println!("  missed pods cannot be seen: {why}");
    }
    for r in pass["refusals"].as_array().into_iter().flatten() {
        println!(
            "  refused ({}): {}: {}",
            r["kind"].as_str().unwrap_or("?"),
            r["subject"].as_str().unwrap_or("-"),
            r["why"].as_str().unwrap_or("")
        );
    }
    if let (Some(full), Some(unchanged)) = (pass["compared"]["full"].as_u64(), pass["compared"]["unchanged"].as_u64()) {
        println!(
            "  compared: {full} in full, {unchanged} unchanged since their last full comparison (nftables generation)"
        );
    }
    for p in pods.iter().filter(|p| p["held"].is_string()) {
        println!(
            "  {}  {}: {}",
            p["pod"].as_str().unwrap_or("-"),
            p["state"].as_str().unwrap_or("?"),
            p["held"].as_str().unwrap_or("")
        );
    }
    for a in pass["actions"].as_array().into_iter().flatten() {
        let error = a["error"].as_str().map(|e| format!(": {e}")).unwrap_or_default();
        println!(
            "  {}  {} {}{error}",
            a["pod"].as_str().unwrap_or("-"),
            a["kind"].as_str().unwrap_or("?"),
            a["outcome"].as_str().unwrap_or("?")
        );
    }
}

fn one(state_dir: &Path, target: &str) -> ExitCode {
    let state = StateDir::new(state_dir);
    let scan = state.scan();
    let records: Vec<Record> =
        scan.records.into_iter().filter(|r| r.container_id == target || r.netns == target).collect();
    // A record that cannot be read is named, never passed over: it may be this pod's.
    let unreadable: Vec<_> = scan.unreadable.iter().filter(|u| u.file.contains(target)).collect();
    for u in &unreadable {
        println!("attachment record {} cannot be read: {}", u.file, u.why);
    }
    let netns_path = records.first().map(|r| r.netns.clone()).unwrap_or_else(|| target.to_string());
    let opened = match records.first() {
        Some(r) => r.open_netns().map(|found| match found {
            PodNetns::Live(ns) => Ok(ns),
            PodNetns::Gone(why) => Err(why),
        }),
        None => Ok(Netns::open_foreign(&netns_path).map_err(|e| e.to_string())),
    };
    let netns = match opened {
        Ok(Ok(ns)) => ns,
        Ok(Err(why)) if !records.is_empty() => {
            let r = &records[0];
            println!("pod {} container {}: its network namespace is gone: {why}", r.key(), r.container_id);
            return ExitCode::FAILURE;
        }
        Ok(Err(e)) => {
            eprintln!("aether-cni inspect: {} is neither a recorded container nor a usable netns: {e}", target);
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!("aether-cni inspect: cannot open the netns of {}: {e}", target);
            return ExitCode::FAILURE;
        }
    };
    println!("netns {netns_path} ({})", netns.id());
    let mut intact = true;
    match records.first() {
        Some(r) => {
            println!(
                "pod {}/{} container {} ifname {} network {}",
                r.pod_namespace.as_deref().unwrap_or("?"),
                r.pod_name.as_deref().unwrap_or("?"),
                r.container_id,
                r.ifname,
                r.network
            );
            if r.version < state::RECORD_VERSION || !r.defaulted.is_empty() {
                println!(
                    "record version {} (this plugin writes {}); fields read as their defaults: {}",
                    r.version,
                    state::RECORD_VERSION,
                    if r.defaulted.is_empty() { "none".to_string() } else { r.defaulted.join(", ") }
                );
            }
            let held = held_ruleset(r, &netns);
            println!("{}", ruleset_line(r, held));
            match &r.capture {
                Some(cfg) => intact &= describe_capture(&netns, cfg, held),
                None => println!("capture: the record predates stored configurations; showing the kernel only"),
            }
        }
        None => println!("no attachment record names this netns: showing what the kernel holds"),
    }
    if records.first().and_then(|r| r.capture.as_ref()).is_none() {
        for family in aether_rules::Family::ALL {
            let table = format!("table {} {}", family.nft_name(), capture::TABLE);
            match netns.run(|| aether_rules::nft::kernel_view(family, capture::TABLE)) {
                Ok(Ok(Some(view))) => {
                    println!("{table}:");
                    for c in &view.chains {
                        println!("chain {} {:?}", c.name, c.hook);
                        for r in &c.rules {
                            println!("  {}  # {}", r.exprs, r.comment);
                        }
                    }
                }
                Ok(Ok(None)) => println!("capture: {table} is absent"),
                Ok(Err(e)) => println!("capture: cannot read {table}: {e}"),
                Err(e) => println!("capture: cannot enter the netns: {e}"),
            }
        }
    }
    println!("\nService layer:");
    let mark = records.first().and_then(|r| r.capture.as_ref()).map(|c| c.divert_mark);
    let (lines, verdict) = services::describe_pod_layer(state_dir, &netns, mark);
    for line in lines {
        println!("  {line}");
    }
    // Any layer that differs from what it should be is a failure a script can see.
    if intact && verdict.is_intact() && unreadable.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Which capture ruleset the record says the pod holds, and whether it is to be migrated
/// (an upgrade's, never drift) or was.
fn ruleset_line(r: &Record, recorded: Recorded) -> String {
    match (recorded, r.migrated_from.and_then(capture::RulesetVersion::known)) {
        (Recorded::Known(_), _) if !recorded.is_current() => format!(
            "ruleset: {recorded}; migration pending (the installer's reconciler replaces it with {}; \
             CHECK compares the pod with the ruleset it holds)",
            capture::RulesetVersion::CURRENT
        ),
        (Recorded::Unknown(_), _) => {
            format!(
                "ruleset: {recorded}; migration pending (the installer's reconciler replaces it with this release's)"
            )
        }
        (_, Some(from)) => format!("ruleset: {recorded}; migrated from {from}"),
        _ => format!("ruleset: {recorded}"),
    }
}

/// The ruleset the record says the pod holds (for a record that names none, the kernel tells
/// which of the shapes such records were written for), or the record's word if that cannot be
/// read: the comparison then says why.
fn held_ruleset(r: &Record, netns: &Netns) -> Recorded {
    aether_node::attachment::held_ruleset(r, netns).unwrap_or_else(|_| r.ruleset())
}

/// The ruleset of shape `recorded` for `cfg`, or why there is none.
fn recorded_ruleset(cfg: &aether_rules::CaptureConfig, recorded: Recorded) -> Result<aether_rules::Ruleset, String> {
    match recorded {
        Recorded::Known(v) => {
            capture::capture_ruleset_of(cfg, v).map_err(|e| format!("the recorded configuration no longer builds: {e}"))
        }
        Recorded::Unknown(_) => Err(format!("the record names {recorded}, which this release cannot compare")),
    }
}

/// Prints the capture as ADD built it, then whether the kernel holds exactly that.
fn describe_capture(netns: &Netns, cfg: &aether_rules::CaptureConfig, recorded: Recorded) -> bool {
    let ruleset = match recorded_ruleset(cfg, recorded) {
        Ok(rs) => rs,
        Err(e) => {
            println!("capture: {e}");
            return false;
        }
    };
    let dns: Vec<String> = cfg
        .families
        .iter()
        .filter_map(|f| cfg.dns_for(*f))
        .map(|d| format!("{}", std::net::SocketAddr::new(d.host_ip, d.port)))
        .collect();
    println!(
        "capture: mode {}, DNS {}",
        cfg.mode,
        if dns.is_empty() { "off".into() } else { format!("to {}", dns.join(" and ")) }
    );
    for half in &ruleset.halves {
        let (pr, ip) = match half.table.family {
            aether_rules::Family::Ipv4 => (&half.policy_route, "ip"),
            aether_rules::Family::Ipv6 => (&half.policy_route, "ip -6"),
        };
        print!("{}", half.table);
        println!("{ip} rule: {}", pr.describe_policy_rule());
        println!("{ip} route: {}", pr.describe_route());
    }
    match verify(netns, &ruleset) {
        Ok(d) if d.is_empty() => {
            println!("kernel: intact (every set, chain, rule, the policy rule and the route as above)");
            true
        }
        Ok(d) => {
            println!("kernel: NOT INTACT:");
            for x in d {
                println!("  - {x}");
            }
            false
        }
        Err(e) => {
            println!("kernel: {e}");
            false
        }
    }
}

/// How the kernel's capture in `netns` differs from what ADD built from `cfg`, of shape
/// `recorded`.
fn differences(netns: &Netns, cfg: &aether_rules::CaptureConfig, recorded: Recorded) -> Result<Vec<String>, String> {
    verify(netns, &recorded_ruleset(cfg, recorded)?)
}

fn verify(netns: &Netns, ruleset: &aether_rules::Ruleset) -> Result<Vec<String>, String> {
    match netns.run(|| aether_rules::verify(ruleset)) {
        Ok(Ok(d)) => Ok(d),
        Ok(Err(e)) => Err(format!("cannot read: {e}")),
        Err(e) => Err(format!("cannot enter the netns: {e}")),
    }
}
