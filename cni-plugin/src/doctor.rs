//! `aether-cni doctor`: does this node's kernel have what capture needs? Every check runs
//! in a private, throwaway netns, so it changes nothing on the node.

use std::process::ExitCode;

use aether_node::probe::{Need, KERNEL_CHECKS};

pub fn run() -> ExitCode {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!("kernel {}", release.trim());
    let mut missing = Vec::new();
    for check in &KERNEL_CHECKS {
        match (check.probe)() {
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
