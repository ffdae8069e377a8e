//! `aether-cni inspect <container-id | netns path>`: a pod's capture and Service layers,
//! readable on a node that has no `nft` binary.

use std::path::PathBuf;
use std::process::ExitCode;

use aether_netns::Netns;
use aether_rules::capture;

use crate::services;
use crate::state::{PodNetns, Record, StateDir};

#[derive(clap::Args)]
pub struct InspectArgs {
    /// A container ID with an attachment record, or a netns path.
    target: String,
    /// The node state directory (the `stateDir` of the network configuration).
    #[arg(long, default_value = crate::config::DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
}

pub fn run(args: InspectArgs) -> ExitCode {
    let state = StateDir::new(&args.state_dir);
    let scan = state.scan();
    let records: Vec<Record> =
        scan.records.into_iter().filter(|r| r.container_id == args.target || r.netns == args.target).collect();
    // A record that cannot be read is named, never passed over: it may be this pod's.
    let unreadable: Vec<_> = scan.unreadable.iter().filter(|u| u.file.contains(&args.target)).collect();
    for u in &unreadable {
        println!("attachment record {} cannot be read: {}", u.file, u.why);
    }
    let netns_path = records.first().map(|r| r.netns.clone()).unwrap_or_else(|| args.target.clone());
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
            eprintln!("aether-cni inspect: {} is neither a recorded container nor a usable netns: {e}", args.target);
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!("aether-cni inspect: cannot open the netns of {}: {e}", args.target);
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
            if r.version < crate::state::RECORD_VERSION || !r.defaulted.is_empty() {
                println!(
                    "record version {} (this plugin writes {}); fields read as their defaults: {}",
                    r.version,
                    crate::state::RECORD_VERSION,
                    if r.defaulted.is_empty() { "none".to_string() } else { r.defaulted.join(", ") }
                );
            }
            match &r.capture {
                Some(cfg) => intact &= describe_capture(&netns, cfg),
                None => println!("capture: the record predates stored configurations; showing the kernel only"),
            }
        }
        None => println!("no attachment record names this netns: showing what the kernel holds"),
    }
    if records.first().and_then(|r| r.capture.as_ref()).is_none() {
        match netns.run(|| aether_rules::nft::kernel_view(capture::TABLE)) {
            Ok(Ok(Some(view))) => {
                for c in &view.chains {
                    println!("chain {} {:?}", c.name, c.hook);
                    for r in &c.rules {
                        println!("  {}  # {}", r.exprs, r.comment);
                    }
                }
            }
            Ok(Ok(None)) => println!("capture: table ip {} is absent", capture::TABLE),
            Ok(Err(e)) => println!("capture: cannot read: {e}"),
            Err(e) => println!("capture: cannot enter the netns: {e}"),
        }
    }
    println!("\nService layer:");
    let mark = records.first().and_then(|r| r.capture.as_ref()).map(|c| c.divert_mark);
    let (lines, layer_intact) = services::describe_pod_layer(&args.state_dir, &netns, mark);
    for line in lines {
        println!("  {line}");
    }
    // Any layer that differs from what it should be is a failure a script can see.
    if intact && layer_intact && unreadable.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Prints the capture as ADD built it, then whether the kernel holds exactly that.
fn describe_capture(netns: &Netns, cfg: &aether_rules::CaptureConfig) -> bool {
    let ruleset = match capture::capture_ruleset(cfg) {
        Ok(rs) => rs,
        Err(e) => {
            println!("capture: the recorded configuration no longer builds: {e}");
            return false;
        }
    };
    let pr = ruleset.policy_route;
    println!(
        "capture: mode {:?}, DNS {}",
        cfg.mode,
        cfg.dns.map(|d| format!("to {}:{}", d.host_ip, d.port)).unwrap_or("off".into())
    );
    print!("{}", ruleset.table);
    println!("ip rule: fwmark {:#x} lookup {} priority {}", pr.fwmark, pr.table, pr.priority);
    println!("ip route: local 0.0.0.0/0 dev lo table {}", pr.table);
    match netns.run(|| aether_rules::verify(&ruleset)) {
        Ok(Ok(d)) if d.is_empty() => {
            println!("kernel: intact (every set, chain, rule, the policy rule and the route as above)");
            true
        }
        Ok(Ok(d)) => {
            println!("kernel: NOT INTACT:");
            for x in d {
                println!("  - {x}");
            }
            false
        }
        Ok(Err(e)) => {
            println!("kernel: cannot read: {e}");
            false
        }
        Err(e) => {
            println!("kernel: cannot enter the netns: {e}");
            false
        }
    }
}
