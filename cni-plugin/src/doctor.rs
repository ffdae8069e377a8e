//! `aether-cni doctor`: does this node's kernel have what capture needs? Every check runs
//! in a private, throwaway netns, so it changes nothing on the node.

use std::process::ExitCode;

use aether_rules::model::Proto;
use aether_rules::services::{LayerMode, ServiceLayer, ServicePort};
use aether_rules::{capture, CaptureConfig, CaptureMode, DnsDivert};

/// One kernel feature, and a ruleset that needs exactly it on top of the previous ones.
struct Check {
    what: &'static str,
    hint: &'static str,
    probe: fn() -> Result<(), Failure>,
    /// Who cannot do without it.
    needed_by: Need,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Need {
    EveryPod,
    Ipv6Pods,
    /// Pods on a node whose agent sends a Service snapshot (of that family).
    ServiceLayer,
    ServiceLayerIpv6,
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

/// A Service layer in refuse mode with a range, a mesh VIP and ports (one without endpoints)
/// in `range`'s family: every set type, counter, dynamic set and reject the layer uses.
fn service_layer(range: &str, vip: &str, empty: &str) -> ServiceLayer {
    let mut l = ServiceLayer::new(LayerMode::Refuse);
    l.ranges = vec![range.parse().expect("a CIDR")];
    l.mesh_vips = vec![vip.parse().expect("an address")];
    l.ports = vec![ServicePort {
        vip: empty.parse().expect("an address"),
        proto: Proto::Tcp,
        port: 80,
        has_endpoints: false,
    }];
    l
}

const CHECKS: [Check; 5] = [
    Check {
        what: "nf_tables with ct, meta mark, interval sets, tproxy; policy routing to lo",
        hint: "needs CONFIG_NF_TABLES, NFT_CT, NFT_TPROXY (nft_tproxy), NF_TPROXY_IPV4, IP_MULTIPLE_TABLES",
        probe: || probe(&base()),
        needed_by: Need::EveryPod,
    },
    Check {
        what: "the whole default ruleset, with the DNS DNAT",
        hint: "also needs CONFIG_NFT_NAT and NF_NAT (nft_chain_nat)",
        probe: || probe(&with_dns()),
        needed_by: Need::EveryPod,
    },
    Check {
        what: "the IPv6 half (table ip6, tproxy and DNAT for IPv6, IPv6 policy routing), for IPv6 and dual-stack pods",
        hint: "needs CONFIG_IPV6, NF_TABLES_IPV6, NF_TPROXY_IPV6, IPV6_MULTIPLE_TABLES (IPv4-only pods do not)",
        probe: || probe(&ipv6_half()),
        needed_by: Need::Ipv6Pods,
    },
    Check {
        what: "the Service layer (named counters, concatenated and dynamic sets, reject), for IPv4 Service ranges",
        hint: "needs NFT_OBJREF, NFT_DYNSET, NFT_REJECT, NFT_REJECT_IPV4 (only where the agent sends a snapshot)",
        probe: || probe_layer(&service_layer("10.96.0.0/16", "10.96.5.5", "10.96.1.2")),
        needed_by: Need::ServiceLayer,
    },
    Check {
        what: "the Service layer for IPv6 Service ranges (table ip6 aether_services)",
        hint: "also needs NF_TABLES_IPV6, NFT_REJECT_IPV6 (only where the snapshot has IPv6 ranges)",
        probe: || probe_layer(&service_layer("fd00:10:96::/108", "fd00:10:96::5:5", "fd00:10:96::1:2")),
        needed_by: Need::ServiceLayerIpv6,
    },
];

/// Why a probe failed: the kernel's refusal (typed, so a missing feature is collected), or
/// a ruleset held differently, or the private netns.
pub enum Failure {
    Kernel(aether_rules::Error),
    Other(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Kernel(e) => write!(f, "{e}"),
            Failure::Other(s) => f.write_str(s),
        }
    }
}

impl From<aether_rules::Error> for Failure {
    fn from(e: aether_rules::Error) -> Self {
        Failure::Kernel(e)
    }
}

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
    for check in &CHECKS {
        let result = (check.probe)();
        if let Err(Failure::Kernel(aether_rules::Error::MissingFeature { missing: features, .. })) = &result {
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

/// Programs `cfg`'s ruleset in a private netns and checks the kernel holds it exactly.
pub fn probe(cfg: &CaptureConfig) -> Result<(), Failure> {
    let ruleset = capture::capture_ruleset(cfg)?;
    in_private_pod_like_netns(|| {
        aether_rules::install(&ruleset, None)?;
        match aether_rules::verify(&ruleset)? {
            d if d.is_empty() => Ok(()),
            d => Err(Failure::Other(format!("programmed, but read back differently: {}", d.join("; ")))),
        }
    })
}

/// Programs the Service layer `l` in a private netns and checks the kernel holds it exactly.
fn probe_layer(l: &ServiceLayer) -> Result<(), Failure> {
    in_private_pod_like_netns(|| {
        aether_rules::services::rebuild(l)?;
        match aether_rules::services::verify(l)? {
            d if d.is_empty() => Ok(()),
            d => Err(Failure::Other(format!("programmed, but read back differently: {}", d.join("; ")))),
        }
    })
}

/// Runs `work` in a throwaway netns with `lo` up, as a runtime leaves a pod's before the
/// network plugins run (IPv6 routes through a down `lo` are refused).
fn in_private_pod_like_netns(work: impl FnOnce() -> Result<(), Failure> + Send) -> Result<(), Failure> {
    aether_netns::run_in_private(|| {
        aether_rules::route::loopback_up()?;
        work()
    })
    .map_err(|e| Failure::Other(e.to_string()))?
}
