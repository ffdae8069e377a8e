//! `aether-cni doctor`: does this node's kernel have what capture needs? Every check runs
//! in a private, throwaway netns (`aether_node::probe`), so it changes nothing on the node.

use std::process::ExitCode;

use aether_node::probe::{Need, ProbeError, KERNEL_CHECKS};

pub fn run() -> ExitCode {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!("kernel {}", release.trim());
    let mut missing = Vec::new();
    let mut lacks: Vec<&'static aether_rules::features::Feature> = Vec::new();
    let code = checks(&mut missing, &mut lacks);
    // The main CNI beside us: a warning, not a failure (pods still start and are captured,
    // but Service traffic reaches the capture already load-balanced).
    match aether_rules::socket_lb::detect() {
        Ok(f @ aether_rules::socket_lb::Finding::Attached(_)) => println!("warn  {f}"),
        Ok(f) => println!("ok    {f}"),
        Err(e) => println!("?     cannot ask the kernel for BPF programs at the root cgroup: {e}"),
    }
    if !lacks.is_empty() {
        println!("this kernel lacks: {}", aether_rules::features::List(&lacks));
    }
    code
}

fn checks(missing: &mut Vec<Need>, lacks: &mut Vec<&'static aether_rules::features::Feature>) -> ExitCode {
    for check in &KERNEL_CHECKS {
        let result = (check.probe)();
        if let Err(ProbeError::Kernel(aether_rules::Error::MissingFeature { missing: features, .. })) = &result {
            for f in features {
                if !lacks.contains(f) {
                    lacks.push(f);
                }
            }
        }
        match result {
            Ok(()) => println!("ok    {}", check.what),
            Err(e) if check.needed_by == Need::EveryPod => {
                missing.push(check.needed_by);
                println!("FAIL  {}: {e}\n      {}", check.what, check.hint);
            }
            Err(e) => {
                missing.push(check.needed_by);
                println!("no    {}: {e}\n      {}", check.what, check.hint);
            }
        }
    }
    if missing.contains(&Need::EveryPod) {
        return ExitCode::FAILURE;
    }
    let families = if missing.contains(&Need::Ipv6Pods) {
        "IPv4 pods only: IPv6 and dual-stack pods would fail ADD"
    } else {
        "IPv4 and IPv6 pods"
    };
    println!(
        "this kernel can hold the capture ruleset, for {families} (programmed, read back and compared in a private netns)"
    );
    let layer = match (missing.contains(&Need::ServiceLayer), missing.contains(&Need::ServiceLayerIpv6)) {
        (false, false) => "for IPv4 and IPv6 Service ranges",
        (false, true) => "for IPv4 Service ranges only: a snapshot with IPv6 ranges would fail ADD",
        (true, _) => "NOT: a node whose agent sends a snapshot would fail ADD",
    };
    println!("and the Service layer, {layer}");
    ExitCode::SUCCESS
}
