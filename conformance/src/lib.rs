//! A simulated Kubernetes node for datapath tests, built from network namespaces.
//!
//! - [`SimNode`]: a "host" netns standing for the node, with a bridge `br0` holding the
//!   gateway address [`HOST_IP`], local routes that make the Service range ([`VIP`] and
//!   friends) and a few other test ranges addresses of the host, an "upstream" server that
//!   answers on every port the tests use, and a DNS stub on `HOST_IP:18054`.
//! - [`Pod`]: a pod netns joined to the bridge by a veth pair (`eth0`, an address in
//!   10.244.0.0/16 and/or fd00:10:244::/64, default routes via the gateway), attached and
//!   detached by running the
//!   built `aether-cni` binary through the CNI protocol (env + stdin + `prevResult`), from
//!   inside the host netns as a runtime on the node would.
//! - [`Proxy`]: a stand-in for the mesh proxy. Like the real one it runs in the host netns
//!   and binds its transparent listeners *inside* the pod netns (a thread enters the pod
//!   netns, makes the sockets, and leaves): TCP on `127.0.0.1:18001`, UDP on
//!   `127.0.0.1:18082` reading the original destination with `IP_PKTINFO` (and the same on
//!   `[::1]` with the `IPV6_*` options for a pod with an IPv6 address).
//!
//! IPv6 mirrors IPv4 address for address: gateway and `hostIPv6` [`HOST_IP6`], Services in
//! fd00:10:96::/64 ([`VIP6`], [`DNS_VIP6`]), addresses added with `nodad` so nothing waits
//! for duplicate address detection.
//!
//! Everything is torn down on drop, also when a test panics. Traffic only ever goes to
//! addresses inside namespaces made here: the host netns has no default route and does not
//! forward.

pub mod clients;
pub mod cni;
pub mod containerd;
pub mod demo;
pub mod dns;
pub mod layer;
pub mod node;
pub mod passes;
pub mod probe;
pub mod server;
pub mod sock;

pub use cni::{cni_bin, Outcome};
pub use node::{Pod, Proxy, SimNode, Stack, HOST_IP, HOST_IP6};
pub use probe::Probe;
pub use server::{Seen, Server};

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// A ClusterIP-like Service address; it routes to the host netns, where the upstream answers.
pub const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 35, 226);
/// The cluster DNS Service address.
pub const DNS_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// An IPv6 ClusterIP, routed to the host netns like [`VIP`].
pub const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x23e2);
/// The cluster DNS Service's IPv6 address.
pub const DNS_VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0xa);
/// The capture listener's port.
pub const CAPTURE_PORT: u16 = 18001;
/// The L4 mesh port (TCP in scoped mode; UDP always).
pub const MESH_L4_PORT: u16 = 18082;
/// The other scoped port.
pub const SCOPED_PORT: u16 = 18081;
/// The node DNS proxy's port on `HOST_IP`.
pub const DNS_PROXY_PORT: u16 = 18054;
/// The divert and passthrough marks.
pub const DIVERT_MARK: u32 = 0xae71;
pub const PASSTHROUGH_MARK: u32 = 0xae7e;
/// Policy routing of the capture (defaults).
pub const ROUTE_TABLE: u32 = 44657;
pub const RULE_PRIORITY: u32 = 32000;
/// The port the pod's own application listens on.
pub const APP_PORT: u16 = 8000;

/// Every TCP port the upstream (in the host netns) answers on, on any host-local address.
pub const UPSTREAM_TCP_PORTS: [u16; 9] = [53, 80, 81, 8080, 9050, 9101, 18081, 18082, 18083];
/// Every UDP port the upstream answers on.
pub const UPSTREAM_UDP_PORTS: [u16; 3] = [53, 18082, 18083];

/// Shorthand for a socket address, of either family.
pub fn sa(ip: impl Into<IpAddr>, port: u16) -> SocketAddr {
    SocketAddr::new(ip.into(), port)
}

/// Fails the test as a broken rig: a negative control that did not fail, so the positive
/// case it stands beside proves nothing.
#[track_caller]
pub fn control(failed_as_it_must: bool, what: &str, detail: impl std::fmt::Display) {
    if !failed_as_it_must {
        panic!("RIG BROKEN: the negative control `{what}` did not fail, so this test cannot tell; the positive case proves nothing.\n{detail}");
    }
}
