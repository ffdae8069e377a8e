//! Can this kernel hold the rulesets? Each check programs a ruleset in a private, throwaway
//! netns and reads it back: the only honest way to know nf_tables, tproxy, NAT and policy
//! routing all work here. Nothing on the node changes. Used by STATUS, `doctor` and the
//! installer's readiness.

use aether_rules::model::Proto;
use aether_rules::services::{LayerMode, ServiceLayer, ServicePort};
/// A connect-time socket load balancer beside us (the main CNI's BPF at the root cgroup).
pub use aether_rules::socket_lb;
use aether_rules::{capture, CaptureConfig, CaptureMode, DnsDivert};

/// Why a probe says no.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The kernel refused (or could not answer) what the probe programmed.
    #[error(transparent)]
    Kernel(aether_rules::Error),
    /// The private netns could not be made or entered.
    #[error(transparent)]
    Netns(aether_netns::Error),
    /// The kernel took the ruleset but holds something else.
    #[error("programmed, but read back differently: {}", .0.join("; "))]
    ReadBack(Vec<String>),
}

/// One kernel feature, and a ruleset that needs exactly it on top of the previous ones.
pub struct KernelCheck {
    pub what: &'static str,
    pub hint: &'static str,
    pub probe: fn() -> Result<(), ProbeError>,
    /// Who cannot do without it.
    pub needed_by: Need,
}

/// Which pods cannot do without a feature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
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

pub const KERNEL_CHECKS: [KernelCheck; 5] = [
    KernelCheck {
        what: "nf_tables with ct, meta mark, interval sets, tproxy; policy routing to lo",
        hint: "needs CONFIG_NF_TABLES, NFT_CT, NFT_TPROXY (nft_tproxy), NF_TPROXY_IPV4, IP_MULTIPLE_TABLES",
        probe: || probe(&base()),
        needed_by: Need::EveryPod,
    },
    KernelCheck {
        what: "the whole default ruleset, with the DNS DNAT",
        hint: "also needs CONFIG_NFT_NAT and NF_NAT (nft_chain_nat)",
        probe: || probe(&with_dns()),
        needed_by: Need::EveryPod,
    },
    KernelCheck {
        what: "the IPv6 half (table ip6, tproxy and DNAT for IPv6, IPv6 policy routing), for IPv6 and dual-stack pods",
        hint: "needs CONFIG_IPV6, NF_TABLES_IPV6, NF_TPROXY_IPV6, IPV6_MULTIPLE_TABLES (IPv4-only pods do not)",
        probe: || probe(&ipv6_half()),
        needed_by: Need::Ipv6Pods,
    },
    KernelCheck {
        what: "the Service layer (named counters, concatenated and dynamic sets, reject), for IPv4 Service ranges",
        hint: "needs NFT_OBJREF, NFT_DYNSET, NFT_REJECT, NFT_REJECT_IPV4 (only where the agent sends a snapshot)",
        probe: || probe_layer(&service_layer("10.96.0.0/16", "10.96.5.5", "10.96.1.2")),
        needed_by: Need::ServiceLayer,
    },
    KernelCheck {
        what: "the Service layer for IPv6 Service ranges (table ip6 aether_services)",
        hint: "also needs NF_TABLES_IPV6, NFT_REJECT_IPV6 (only where the snapshot has IPv6 ranges)",
        probe: || probe_layer(&service_layer("fd00:10:96::/108", "fd00:10:96::5:5", "fd00:10:96::1:2")),
        needed_by: Need::ServiceLayerIpv6,
    },
];

/// The default capture ruleset (DNS DNAT included): what STATUS and readiness require.
pub fn kernel_probe() -> Result<(), ProbeError> {
    probe(&with_dns())
}

/// Programs `cfg`'s ruleset in a private netns and checks the kernel holds it exactly.
pub fn probe(cfg: &CaptureConfig) -> Result<(), ProbeError> {
    let ruleset = capture::capture_ruleset(cfg).map_err(ProbeError::Kernel)?;
    in_private_pod_like_netns(|| {
        aether_rules::install(&ruleset, None).map_err(ProbeError::Kernel)?;
        match aether_rules::verify(&ruleset).map_err(ProbeError::Kernel)? {
            d if d.is_empty() => Ok(()),
            d => Err(ProbeError::ReadBack(d)),
        }
    })
}

/// Programs the Service layer `l` in a private netns and checks the kernel holds it exactly.
pub fn probe_layer(l: &ServiceLayer) -> Result<(), ProbeError> {
    in_private_pod_like_netns(|| {
        aether_rules::services::rebuild(l).map_err(ProbeError::Kernel)?;
        match aether_rules::services::verify(l).map_err(ProbeError::Kernel)? {
            d if d.is_empty() => Ok(()),
            d => Err(ProbeError::ReadBack(d)),
        }
    })
}

/// Runs `work` in a throwaway netns with `lo` up, as a runtime leaves a pod's before the
/// network plugins run (IPv6 routes through a down `lo` are refused).
fn in_private_pod_like_netns(work: impl FnOnce() -> Result<(), ProbeError> + Send) -> Result<(), ProbeError> {
    aether_netns::run_in_private(|| {
        aether_rules::route::loopback_up().map_err(ProbeError::Kernel)?;
        work()
    })
    .map_err(ProbeError::Netns)?
}
