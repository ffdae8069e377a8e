//! `aether-cni doctor`: does this node's kernel have what capture needs? Every check runs
//! in a private, throwaway netns, so it changes nothing on the node.

use std::process::ExitCode;

use aether_rules::{capture, CaptureConfig, CaptureMode, DnsDivert};

/// One kernel feature, and a ruleset that needs exactly it on top of the previous ones.
struct Check {
    what: &'static str,
    hint: &'static str,
    config: fn() -> CaptureConfig,
    /// Every pod needs it; otherwise only pods with an IPv6 address do.
    required: bool,
}

fn base() -> CaptureConfig {
    CaptureConfig::new(CaptureMode::Scoped)
}

fn with_dns() -> CaptureConfig {
    let mut c = CaptureConfig::new(CaptureMode::RedirectAll);
    c.dns = Some(DnsDivert { host_ip: std::net::Ipv4Addr::new(192, 0, 2, 1).into(), port: capture::DNS_PROXY_PORT });
    c
}

/// An IPv6-only pod's ruleset: the IPv6 half, DNS DNAT included.
fn ipv6_half() -> CaptureConfig {
    let mut c = CaptureConfig::new(CaptureMode::RedirectAll);
    c.families = vec![aether_rules::Family::Ipv6];
    c.dns_ipv6 = Some(DnsDivert {
        host_ip: std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1).into(),
        port: capture::DNS_PROXY_PORT,
    });
    c
}

const CHECKS: [Check; 3] = [
    Check {
        what: "nf_tables with ct, meta mark, interval sets, tproxy; policy routing to lo",
        hint: "needs CONFIG_NF_TABLES, NFT_CT, NFT_TPROXY (nft_tproxy), NF_TPROXY_IPV4, IP_MULTIPLE_TABLES",
        config: base,
        required: true,
    },
    Check {
        what: "the whole default ruleset, with the DNS DNAT",
        hint: "also needs CONFIG_NFT_NAT and NF_NAT (nft_chain_nat)",
        config: with_dns,
        required: true,
    },
    Check {
        what: "the IPv6 half (table ip6, tproxy and DNAT for IPv6, IPv6 policy routing), for IPv6 and dual-stack pods",
        hint: "needs CONFIG_IPV6, NF_TABLES_IPV6, NF_TPROXY_IPV6, IPV6_MULTIPLE_TABLES (IPv4-only pods do not)",
        config: ipv6_half,
        required: false,
    },
];

pub fn run() -> ExitCode {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!("kernel {}", release.trim());
    let (mut ok, mut ipv6) = (true, true);
    for check in &CHECKS {
        match probe(&(check.config)()) {
            Ok(()) => println!("ok    {}", check.what),
            Err(e) if check.required => {
                ok = false;
                println!("FAIL  {}: {e}\n      {}", check.what, check.hint);
            }
            Err(e) => {
                ipv6 = false;
                println!("no    {}: {e}\n      {}", check.what, check.hint);
            }
        }
    }
    if ok {
        let families =
            if ipv6 { "IPv4 and IPv6 pods" } else { "IPv4 pods only: IPv6 and dual-stack pods would fail ADD" };
        println!(
            "this kernel can hold the capture ruleset, for {families} (programmed, read back and compared in a private netns)"
        );
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Programs `cfg`'s ruleset in a private netns and checks the kernel holds it exactly.
pub fn probe(cfg: &CaptureConfig) -> Result<(), String> {
    let ruleset = capture::capture_ruleset(cfg).map_err(|e| e.to_string())?;
    aether_netns::run_in_private(|| -> Result<(), String> {
        aether_rules::install(&ruleset, None).map_err(|e| e.to_string())?;
        match aether_rules::verify(&ruleset).map_err(|e| e.to_string())? {
            d if d.is_empty() => Ok(()),
            d => Err(format!("programmed, but read back differently: {}", d.join("; "))),
        }
    })
    .map_err(|e| e.to_string())?
}
