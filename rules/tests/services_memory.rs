//! Root-gated: the kernel memory one pod's Service layer is charged, measured from a memory
//! cgroup of the test's own (docs/design.md, "The Service-range and refusal-counter layer"):
//! the layer is built by a child process in that cgroup, into a fresh netns.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use aether_rules::model::Proto;
use aether_rules::services::{self, LayerMode, ServiceLayer, ServicePort};
use aether_testkit::memcg::{child_work, ScratchMemcg};
use aether_testkit::root_or_skip;

const SERVICES: u32 = 10_000;
const MIB: f64 = 1024.0 * 1024.0;

/// Service `i` of a family: two TCP ports (80 and one of seven others), one in ten without
/// a usable endpoint, as the scale bench's.
fn ports(vip: IpAddr, i: u32) -> [ServicePort; 2] {
    [80, 8080 + (i % 7) as u16].map(|port| ServicePort { vip, proto: Proto::Tcp, port, has_endpoints: i % 10 != 0 })
}

fn v4(i: u32) -> IpAddr {
    Ipv4Addr::from(0x0a60_0000 + 2 + i).into()
}

fn v6(i: u32) -> IpAddr {
    Ipv6Addr::from(0xfd00_0010_0096_0000_0000_0000_0000_0000u128 + 2 + i as u128).into()
}

fn layer(dual: bool) -> ServiceLayer {
    layer_of(dual, ports)
}

/// Service `i` with ports no other Service declares (80 and 10,000 + `i`): no profile is
/// shared, every Service is looked up by key, as every Service was before profiles.
fn unshared(vip: IpAddr, i: u32) -> [ServicePort; 2] {
    [80, 10_000 + i as u16].map(|port| ServicePort { vip, proto: Proto::Tcp, port, has_endpoints: i % 10 != 0 })
}

fn layer_of(dual: bool, ports: fn(IpAddr, u32) -> [ServicePort; 2]) -> ServiceLayer {
    let mut l = ServiceLayer::new(LayerMode::Refuse);
    l.ranges = vec!["10.96.0.0/15".parse().unwrap()];
    l.ports = (0..SERVICES).flat_map(|i| ports(v4(i), i)).collect();
    if dual {
        l.ranges.push("fd00:10:96::/108".parse().unwrap());
        l.ports.extend((0..SERVICES).flat_map(|i| ports(v6(i), i)));
    }
    l.ports.sort();
    // Named as the node names every pod's layer (a counter in each table).
    l.identity = Some(services::LayerId { generation: 100, digest: 0x0123_4567_89ab_cdef });
    l
}

/// In the child: the layer built into its fresh netns, and what that charged printed.
/// In the parent: what the child reported, in bytes.
fn charged(test: &str, layer: fn() -> ServiceLayer) -> Option<u64> {
    let prepare = || services::Prepared::new(&layer()).unwrap().expect("a layer");
    if child_work(prepare, |p| {
        p.rebuild().unwrap();
    }) {
        return None;
    }
    // A limit far above what one layer charges: the measure, not a squeeze.
    let cg = ScratchMemcg::new("layer", 1 << 30);
    Some(cg.charged_by_child(test))
}

#[test]
fn one_pods_layer_at_10000_ipv4_services_is_charged_at_most_0_9_mib() {
    let name = "one_pods_layer_at_10000_ipv4_services_is_charged_at_most_0_9_mib";
    if !root_or_skip(name) {
        return;
    }
    let Some(bytes) = charged(name, || layer(false)) else { return };
    eprintln!("one pod's layer, {SERVICES} IPv4 Services: {:.0} KiB charged", bytes as f64 / 1024.0);
    assert!(bytes as f64 <= 0.9 * MIB, "{:.2} MiB charged, the goal is 0.9 MiB", bytes as f64 / MIB);
}

#[test]
fn one_pods_dual_stack_layer_at_10000_services_each_is_charged_at_most_1_8_mib() {
    let name = "one_pods_dual_stack_layer_at_10000_services_each_is_charged_at_most_1_8_mib";
    if !root_or_skip(name) {
        return;
    }
    let Some(bytes) = charged(name, || layer(true)) else { return };
    eprintln!("one pod's layer, {SERVICES} + {SERVICES} Services: {:.0} KiB charged", bytes as f64 / 1024.0);
    assert!(bytes as f64 <= 1.8 * MIB, "{:.2} MiB charged, the goal is 1.8 MiB", bytes as f64 / MIB);
}

/// The control: the measurement sees what a layer charges. 10,000 Services that share no
/// profile are each a map element and two keyed ports, three elements as before profiles:
/// about 2 MiB, more than twice the goal the shared profiles meet.
#[test]
fn control_services_that_share_no_profile_cost_three_elements_each() {
    let name = "control_services_that_share_no_profile_cost_three_elements_each";
    if !root_or_skip(name) {
        return;
    }
    let Some(bytes) = charged(name, || layer_of(false, unshared)) else { return };
    eprintln!(
        "one pod's layer, {SERVICES} IPv4 Services of no shared profile: {:.0} KiB charged",
        bytes as f64 / 1024.0
    );
    assert!(bytes as f64 >= 1.8 * MIB, "{:.2} MiB charged for 30,000 elements", bytes as f64 / MIB);
}
