//! The simulated node: a host netns with a bridge, pods joined by veth, the upstream, the
//! DNS stub and the proxy stand-in.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};

use aether_testkit::{run, try_run, TestNetns};
use serde_json::{json, Value};

use crate::server::{Role, Seen, Server, UdpReply};
use crate::{cni, probe, sa, sock, Probe};

/// The gateway address on the host netns bridge, which is also the node's `hostIP` (where
/// the DNS proxy listens).
pub const HOST_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 1);
const POD_PREFIX: u8 = 16;
/// The IPv6 gateway on the bridge, which is also the node's `hostIPv6`.
pub const HOST_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 1);
const POD_PREFIX6: u8 = 64;
/// A link-local address of the host's bridge (stands for a node-local service on fe80::/10).
pub const HOST_LINK_LOCAL6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
/// Ranges the host netns treats as its own addresses (`local` routes), so that a pod's
/// uncaptured traffic to them lands on the upstream: the Service range, an extra range the
/// exclusion tests configure, and link-local (the metadata-server address).
pub const HOST_LOCAL_RANGES: [&str; 3] = ["10.96.0.0/16", "10.97.0.0/16", "169.254.0.0/16"];
/// The same for IPv6: the Service range and the extra range (link-local is on the bridge).
pub const HOST_LOCAL_RANGES6: [&str; 2] = ["fd00:10:96::/64", "fd00:10:97::/64"];

/// Which address families a pod has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stack {
    Ipv4,
    Ipv6,
    Dual,
}

impl Stack {
    fn v4(self) -> bool {
        self != Stack::Ipv6
    }
    fn v6(self) -> bool {
        self != Stack::Ipv4
    }
}

fn ip_in(ns: &str, args: &[&str]) -> String {
    let mut full = vec!["-n", ns];
    full.extend_from_slice(args);
    run("ip", &full)
}

/// A directory removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One simulated node. Dropping it stops its servers and deletes its namespace (and with it
/// the bridge and the host ends of the veths).
pub struct SimNode {
    upstream: Server,
    dns_stub: Server,
    pub host: TestNetns,
    state_dir: TempDir,
    next_pod: u8,
}

impl SimNode {
    /// Builds the host netns: `br0` with `HOST_IP/16`, `HOST_IP6/64` and `fe80::1/64`,
    /// local routes for [`HOST_LOCAL_RANGES`] and [`HOST_LOCAL_RANGES6`], the upstream on
    /// every port in `UPSTREAM_*_PORTS` (any local address of either family), the DNS stub on
    /// `HOST_IP:18054` and `[HOST_IP6]:18054` (UDP and TCP).
    pub fn new(tag: &str) -> SimNode {
        let host = TestNetns::new(tag);
        let state_dir = TempDir(std::env::temp_dir().join(format!("{}-state", host.name)));
        std::fs::create_dir_all(&state_dir.0).expect("state dir");
        let n = host.name.as_str();
        ip_in(n, &["link", "add", "br0", "type", "bridge"]);
        ip_in(n, &["addr", "add", &format!("{HOST_IP}/{POD_PREFIX}"), "dev", "br0"]);
        for a in [format!("{HOST_IP6}/{POD_PREFIX6}"), format!("{HOST_LINK_LOCAL6}/64")] {
            ip_in(n, &["-6", "addr", "add", &a, "dev", "br0", "nodad"]);
        }
        ip_in(n, &["link", "set", "br0", "up"]);
        for r in HOST_LOCAL_RANGES {
            ip_in(n, &["route", "add", "local", r, "dev", "lo"]);
        }
        for r in HOST_LOCAL_RANGES6 {
            ip_in(n, &["-6", "route", "add", "local", r, "dev", "lo"]);
        }
        let path = host.path();
        let mut upstream = Server::new("upstream", Some(&path));
        let mut dns_stub = Server::new("dns-stub", Some(&path));
        let (tcps, udps, stub_tcps, stub_udps) = sock::in_netns(&path, || {
            let any = [IpAddr::from(Ipv4Addr::UNSPECIFIED), IpAddr::from(Ipv6Addr::UNSPECIFIED)];
            let tcps: Vec<_> = crate::UPSTREAM_TCP_PORTS
                .iter()
                .flat_map(|&p| any.map(|a| sock::tcp_listener(sa(a, p), false).expect("upstream TCP")))
                .collect();
            let udps: Vec<_> = crate::UPSTREAM_UDP_PORTS
                .iter()
                .flat_map(|&p| any.map(|a| sock::udp_server(sa(a, p), false).expect("upstream UDP")))
                .collect();
            let stubs = [sa(HOST_IP, crate::DNS_PROXY_PORT), sa(HOST_IP6, crate::DNS_PROXY_PORT)];
            (
                tcps,
                udps,
                stubs.map(|s| sock::tcp_listener(s, false).expect("stub TCP")),
                stubs.map(|s| sock::udp_server(s, false).expect("stub UDP")),
            )
        });
        for l in tcps {
            upstream.add_tcp(l, Role::Banner);
        }
        for s in udps {
            upstream.add_udp(s, Role::Banner, UdpReply::PktInfo);
        }
        for l in stub_tcps {
            dns_stub.add_tcp(l, Role::Dns);
        }
        for s in stub_udps {
            dns_stub.add_udp(s, Role::Dns, UdpReply::FromSocket);
        }
        SimNode { upstream, dns_stub, host, state_dir, next_pod: 0 }
    }

    /// A pod netns joined to `br0` by a veth pair: `eth0` with `10.244.0.(10+n)/16` and a
    /// default route via `HOST_IP`. Not attached yet: see [`Pod::add`].
    pub fn add_pod(&mut self, name: &str) -> Pod {
        self.add_pod_with(name, Stack::Ipv4)
    }

    /// A pod with the address families of `stack`: `10.244.0.(10+n)/16` and/or
    /// `fd00:10:244::(a+n)/64` (plus `fe80::(a+n)/64`), each added with `nodad`, with a
    /// default route via the bridge per family. An IPv6-only pod has no IPv4 address but
    /// loopback's.
    pub fn add_pod_with(&mut self, name: &str, stack: Stack) -> Pod {
        let idx = self.next_pod;
        self.next_pod += 1;
        let ns = TestNetns::new(&format!("pod{idx}"));
        let ip4 = Ipv4Addr::new(10, 244, 0, 10 + idx);
        let ip6 = Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0xa + u16::from(idx));
        let host_veth = format!("veth{idx}");
        let h = self.host.name.as_str();
        ip_in(h, &["link", "add", &host_veth, "type", "veth", "peer", "name", "eth0", "netns", &ns.name]);
        ip_in(h, &["link", "set", &host_veth, "master", "br0", "up"]);
        let p = ns.name.as_str();
        let mut ips = Vec::new();
        if stack.v4() {
            ip_in(p, &["addr", "add", &format!("{ip4}/{POD_PREFIX}"), "dev", "eth0"]);
            ips.push(IpAddr::from(ip4));
        }
        if stack.v6() {
            let link_local = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0xa + u16::from(idx));
            for a in [format!("{ip6}/{POD_PREFIX6}"), format!("{link_local}/64")] {
                ip_in(p, &["-6", "addr", "add", &a, "dev", "eth0", "nodad"]);
            }
            ips.push(IpAddr::from(ip6));
        }
        ip_in(p, &["link", "set", "eth0", "up"]);
        if stack.v4() {
            ip_in(p, &["route", "add", "default", "via", &HOST_IP.to_string()]);
        }
        if stack.v6() {
            ip_in(p, &["-6", "route", "add", "default", "via", &HOST_IP6.to_string(), "dev", "eth0"]);
        }
        let mac = |ns: &str, dev: &str| {
            ip_in(ns, &["-br", "link", "show", dev]).split_whitespace().nth(2).unwrap_or("").to_string()
        };
        Pod {
            name: name.to_string(),
            ip: ips[0],
            ips,
            container_id: format!("sim-{}", ns.name),
            host_veth_mac: mac(h, &host_veth),
            eth0_mac: mac(p, "eth0"),
            host_veth,
            node_netns: self.host.path(),
            state_dir: self.state_dir.0.display().to_string(),
            ns,
        }
    }

    /// The node state directory the pods' network configuration names (`stateDir`).
    pub fn state_dir(&self) -> &Path {
        &self.state_dir.0
    }

    /// `aether-cni services --state-dir <the node's> <args>` with `stdin`, run from inside
    /// the host netns as the node agent would.
    pub fn services(&self, args: &[&str], stdin: &[u8]) -> cni::Outcome {
        let dir = self.state_dir.0.display().to_string();
        let mut full = vec!["services", "--state-dir", dir.as_str()];
        full.extend_from_slice(args);
        cni::run_cli(&self.host.path(), &full, stdin)
    }

    /// `services` as above, by another build of the plugin (a release before).
    pub fn services_with(&self, bin: &Path, args: &[&str], stdin: &[u8]) -> cni::Outcome {
        let dir = self.state_dir.0.display().to_string();
        let mut full = vec!["services", "--state-dir", dir.as_str()];
        full.extend_from_slice(args);
        cni::run_cli_bin(bin, &self.host.path(), &full, stdin)
    }

    /// A node-level CNI command (STATUS, GC) as the runtime runs it: no pod, no container,
    /// from inside the host netns.
    pub fn cni(&self, command: &str, conf: &Value) -> cni::Outcome {
        cni::run(&self.host.path(), &[("CNI_COMMAND", command), ("CNI_PATH", "/opt/cni/bin")], conf)
    }

    /// What reached the upstream (any host-local address, any `UPSTREAM_*_PORTS` port).
    pub fn upstream_seen(&self) -> Vec<Seen> {
        self.upstream.seen()
    }

    /// What reached the DNS stub on `HOST_IP:18054`.
    pub fn dns_seen(&self) -> Vec<Seen> {
        self.dns_stub.seen()
    }

    /// A TCP probe from the host netns (an inbound connection to a pod).
    pub fn tcp_from_host(&self, dst: SocketAddr) -> Probe {
        sock::in_netns(&self.host.path(), || probe::tcp(dst, None, b"probe from host"))
    }
}

/// A pod: its netns, its address, and the CNI identity it is attached under.
pub struct Pod {
    pub name: String,
    /// The pod's first address: IPv4 if it has one.
    pub ip: IpAddr,
    /// Every address of the pod, IPv4 first.
    pub ips: Vec<IpAddr>,
    pub container_id: String,
    pub host_veth: String,
    host_veth_mac: String,
    eth0_mac: String,
    node_netns: String,
    state_dir: String,
    pub ns: TestNetns,
}

impl Pod {
    pub fn path(&self) -> String {
        self.ns.path()
    }

    /// The pod's address in `dst`'s family: the source of its connections to `dst`.
    pub fn ip_for(&self, dst: SocketAddr) -> IpAddr {
        *self.ips.iter().find(|a| a.is_ipv4() == dst.is_ipv4()).unwrap_or(&self.ip)
    }

    fn has_ipv6(&self) -> bool {
        self.ips.iter().any(IpAddr::is_ipv6)
    }

    /// The network configuration the installer would write for this node, with the main
    /// plugin's `prevResult` for this pod, plus `extra` fields (a null removes a field).
    pub fn conf(&self, extra: Value) -> Value {
        let mut c = json!({
            "cniVersion": "1.0.0",
            "name": "aether-sim",
            "type": "aether-cni",
            "hostIP": HOST_IP.to_string(),
            "stateDir": self.state_dir,
            "logFile": format!("{}/aether-cni.log", self.state_dir),
            "capabilities": {"io.kubernetes.cri.pod-annotations": true},
            "prevResult": {
                "cniVersion": "1.0.0",
                "interfaces": [
                    {"name": "br0"},
                    {"name": self.host_veth, "mac": self.host_veth_mac},
                    {"name": "eth0", "mac": self.eth0_mac, "sandbox": self.path()}
                ],
                "ips": self.ips.iter().map(|a| match a {
                    IpAddr::V4(a) => json!({"address": format!("{a}/{POD_PREFIX}"), "gateway": HOST_IP.to_string(), "interface": 2}),
                    IpAddr::V6(a) => json!({"address": format!("{a}/{POD_PREFIX6}"), "gateway": HOST_IP6.to_string(), "interface": 2}),
                }).collect::<Vec<_>>(),
                "routes": self.ips.iter().map(|a| match a {
                    IpAddr::V4(_) => json!({"dst": "0.0.0.0/0", "gw": HOST_IP.to_string()}),
                    IpAddr::V6(_) => json!({"dst": "::/0", "gw": HOST_IP6.to_string()}),
                }).collect::<Vec<_>>()
            }
        });
        if self.has_ipv6() {
            c["hostIPv6"] = json!(HOST_IP6.to_string());
        }
        for (k, v) in extra.as_object().expect("extra is an object") {
            if v.is_null() {
                c.as_object_mut().unwrap().remove(k);
            } else {
                c[k] = v.clone();
            }
        }
        c
    }

    /// Runs the plugin for this pod through the CNI protocol, from inside the node's netns.
    pub fn cni(&self, command: &str, conf: &Value) -> cni::Outcome {
        self.cni_with(cni::cni_bin(), command, conf)
    }

    /// `cni` by another build of the plugin (a release before, built from the history).
    pub fn cni_with(&self, bin: &Path, command: &str, conf: &Value) -> cni::Outcome {
        let out = self.cni_unsettled(bin, command, conf, &[]);
        if command == "ADD" && out.ok {
            self.settled();
        }
        out
    }

    /// `cni_with` with `more` in the environment, answered as soon as the plugin answers (a
    /// layer built after the answer may still be under way: `settled` waits for it).
    pub fn cni_unsettled(&self, bin: &Path, command: &str, conf: &Value, more: &[(&str, &str)]) -> cni::Outcome {
        let netns = self.path();
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=sim;K8S_POD_NAME={}", self.name);
        let env = [
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", self.container_id.as_str()),
            ("CNI_NETNS", netns.as_str()),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/opt/cni/bin"),
            ("CNI_ARGS", args.as_str()),
        ];
        let env: Vec<(&str, &str)> = env.iter().chain(more).copied().collect();
        cni::run_bin(bin, &self.node_netns, &env, conf)
    }

    /// Waits until nothing holds the pod's netns lock: a large Service layer is built after
    /// ADD's answer, under that lock, and what a test reads with `nft` must not race it (the
    /// plugin's own readers wait the same way).
    pub fn settled(&self) {
        let ns = aether_netns::Netns::open(self.path()).expect("the pod's netns opens");
        ns.wait_unlocked().expect("the pod's netns lock");
    }

    /// ADD with `conf(extra)`; panics unless it succeeds and passes `prevResult` through.
    /// Returns the configuration, for DEL.
    pub fn add(&self, extra: Value) -> Value {
        let conf = self.conf(extra);
        let out = self.cni("ADD", &conf);
        assert!(out.ok, "ADD of pod {} failed: {}\n{}", self.name, out.stdout, out.stderr);
        let result = out.json();
        assert_eq!(result["ips"], conf["prevResult"]["ips"], "ADD must pass prevResult through");
        conf
    }

    /// DEL; panics unless it succeeds.
    pub fn del(&self, conf: &Value) {
        let out = self.cni("DEL", conf);
        assert!(out.ok, "DEL of pod {} failed: {}\n{}", self.name, out.stdout, out.stderr);
    }

    /// `ip <args>` in the pod netns.
    pub fn ip(&self, args: &[&str]) -> String {
        ip_in(&self.ns.name, args)
    }

    /// `nft <args>` in the pod netns (the test may use nft; the product may not).
    pub fn nft(&self, args: &[&str]) -> String {
        self.ns.exec("nft", args)
    }

    /// The whole capture state as text (for messages).
    pub fn ruleset(&self) -> String {
        let (_, out, _) = try_run("ip", &["netns", "exec", &self.ns.name, "nft", "list", "ruleset"]);
        out
    }

    /// Deletes the one rule of `table ip aether_capture` chain `chain` whose text contains
    /// `needle`; panics unless exactly one rule matches. Returns the rule's text.
    pub fn delete_rule(&self, chain: &str, needle: &str) -> String {
        self.delete_rule_in("ip", chain, needle)
    }

    /// [`Pod::delete_rule`] in the capture table of family `family` (`ip` or `ip6`).
    pub fn delete_rule_in(&self, family: &str, chain: &str, needle: &str) -> String {
        self.delete_rule_of(family, "aether_capture", chain, needle)
    }

    /// [`Pod::delete_rule`] in table `table` of family `family` (the Service layer's, say).
    pub fn delete_rule_of(&self, family: &str, table: &str, chain: &str, needle: &str) -> String {
        let listing = self.nft(&["-a", "list", "chain", family, table, chain]);
        let hits: Vec<&str> = listing.lines().filter(|l| l.contains(needle) && l.contains("# handle ")).collect();
        assert_eq!(
            hits.len(),
            1,
            "want exactly one rule matching {needle:?} in chain {family} {table} {chain}:\n{listing}"
        );
        let handle = hits[0].rsplit("# handle ").next().unwrap().trim();
        self.nft(&["delete", "rule", family, table, chain, "handle", handle]);
        hits[0].split(" # handle").next().unwrap().trim().to_string()
    }

    /// Deletes `element` from set `set` of the capture table.
    pub fn delete_element(&self, set: &str, element: &str) {
        self.delete_element_in("ip", set, element)
    }

    /// [`Pod::delete_element`] in the capture table of family `family` (`ip` or `ip6`).
    pub fn delete_element_in(&self, family: &str, set: &str, element: &str) {
        self.nft(&["delete", "element", family, "aether_capture", set, "{", element, "}"]);
    }

    /// A TCP probe from the pod (payload `probe`), optionally from a socket with `SO_MARK`.
    pub fn tcp(&self, dst: SocketAddr) -> Probe {
        sock::in_netns(&self.path(), || probe::tcp(dst, None, b"probe"))
    }

    pub fn tcp_marked(&self, dst: SocketAddr, mark: u32) -> Probe {
        sock::in_netns(&self.path(), || probe::tcp(dst, Some(mark), b"probe"))
    }

    /// A UDP probe from a connected socket in the pod.
    pub fn udp(&self, dst: SocketAddr) -> Probe {
        sock::in_netns(&self.path(), || probe::udp(dst, None, b"probe"))
    }

    pub fn udp_marked(&self, dst: SocketAddr, mark: u32) -> Probe {
        sock::in_netns(&self.path(), || probe::udp(dst, Some(mark), b"probe"))
    }

    pub fn dns_udp(&self, server: SocketAddr) -> Probe {
        sock::in_netns(&self.path(), || probe::dns_udp(server, crate::dns::NAME))
    }

    pub fn dns_tcp(&self, server: SocketAddr) -> Probe {
        sock::in_netns(&self.path(), || probe::dns_tcp(server, crate::dns::NAME))
    }

    /// The pod's own application: a plain listener on `0.0.0.0:8000` (and `[::]:8000` in a
    /// pod with IPv6) in the pod netns.
    pub fn start_app(&self) -> Server {
        let path = self.path();
        let mut app = Server::new(&format!("app[{}]", self.name), Some(&path));
        let mut any = vec![IpAddr::from(Ipv4Addr::UNSPECIFIED)];
        if self.has_ipv6() {
            any.push(Ipv6Addr::UNSPECIFIED.into());
        }
        for a in any {
            let l = sock::in_netns(&path, || sock::tcp_listener(sa(a, crate::APP_PORT), false)).expect("app listener");
            app.add_tcp(l, Role::Banner);
        }
        app
    }
}

/// The mesh proxy stand-in for one pod: runs in the host netns (the test process), and binds
/// its listeners inside the pod netns with `IP_TRANSPARENT`: TCP `127.0.0.1:18001`, UDP
/// `127.0.0.1:18082` (bound to loopback, not 0.0.0.0, so that only the tproxy rule can
/// deliver a datagram for another address to it); in a pod with IPv6 also `[::1]:18001` and
/// `[::1]:18082` with `IPV6_TRANSPARENT` (`tproxy ip6 to :port` looks the listener up at
/// the first address of `lo`, `::1`). It answers UDP from a transparent socket bound to the
/// original destination.
pub struct Proxy {
    server: Server,
}

impl Proxy {
    pub fn start(pod: &Pod) -> Proxy {
        let path = pod.path();
        let mut server = Server::new(&format!("capture[{}]", pod.name), Some(&path));
        let mut loopbacks = vec![IpAddr::from(Ipv4Addr::LOCALHOST)];
        if pod.has_ipv6() {
            loopbacks.push(Ipv6Addr::LOCALHOST.into());
        }
        for lo in loopbacks {
            let (tcp, udp) = sock::in_netns(&path, || {
                (
                    sock::tcp_listener(sa(lo, crate::CAPTURE_PORT), true).expect("capture listener"),
                    sock::udp_server(sa(lo, crate::MESH_L4_PORT), true).expect("UDP mesh listener"),
                )
            });
            server.add_tcp(tcp, Role::Banner);
            server.add_udp(udp, Role::Banner, UdpReply::TransparentFromOrigDst);
        }
        Proxy { server }
    }

    pub fn who(&self) -> &str {
        self.server.who()
    }

    /// Everything the proxy's listeners received.
    pub fn seen(&self) -> Vec<Seen> {
        self.server.seen()
    }
}
