//! `aether-cni-installer`'s command line. Directory and address flags are the installer's;
//! the node settings become the conflist entry as they are, and the plugin's own parser
//! judges them (the installer refuses to write an entry the plugin would refuse).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Map, Value};

use crate::chain::PLUGIN_TYPE;
use crate::events;
use crate::reconcile::node_lib::NodeFiles;
use crate::reconcile::{self, Limits, MissedPolicy};

#[derive(clap::Args, Debug, Clone)]
pub struct InstallArgs {
    /// The host's CNI bin directory, as mounted in this container.
    #[arg(long, env = "AETHER_CNI_BIN_DIR", default_value = "/host/opt/cni/bin")]
    pub cni_bin_dir: PathBuf,
    /// The plugin to install (copied into --cni-bin-dir as `aether-cni`). Default: the
    /// `aether-cni` file beside this executable (the image holds both).
    #[arg(long, env = "AETHER_CNI_PLUGIN_BINARY", value_name = "PATH")]
    pub plugin_binary: Option<PathBuf>,
    /// The host's CNI configuration directory, as mounted in this container.
    #[arg(long, env = "AETHER_CNI_CONF_DIR", default_value = "/host/etc/cni/net.d")]
    pub cni_conf_dir: PathBuf,
    /// The chained conflist's file name. It must sort before the main CNI's file, so that
    /// runtimes (which load the lexically first file) load it.
    #[arg(long, default_value = "00-aether-cni.conflist")]
    pub conflist_name: String,
    /// The node state directory: mounted at the same path as on the host (it is also the
    /// entry's `stateDir`, which the plugin uses on the host).
    #[arg(long, env = "AETHER_CNI_STATE_DIR", default_value = "/var/run/aether-cni")]
    pub state_dir: PathBuf,
    /// The runtime's netns directory as mounted in this container (the chart's
    /// hostPaths.netnsDir). Checked at start: the mount it is on must be a slave or shared
    /// mount (the chart's mountPropagation: HostToContainer of a shared or slave host path), or
    /// pods' netns made after the start never show up here; if it is not, the node is not
    /// ready and the reconciler takes no record whose netns is under it for gone. Empty (the
    /// default): not checked (an installer in the host's own mount namespace sees them all).
    #[arg(long, env = "AETHER_CNI_NETNS_DIR", default_value = "", value_name = "DIR")]
    pub netns_dir: String,
    /// Address for /healthz, /readyz and /metrics: IP:PORT (an IPv6 address with or without
    /// brackets: the chart passes `$(HOST_IP):PORT` whatever the node's family).
    #[arg(long, env = "AETHER_CNI_LISTEN", default_value = "127.0.0.1:18095", value_parser = parse_listen)]
    pub listen: SocketAddr,
    /// Address for /metrics alone (Prometheus), e.g. the node's `$(HOST_IP):18096`; the
    /// probes stay on --listen, which can then be loopback, out of every pod's reach.
    #[arg(long, env = "AETHER_CNI_METRICS_LISTEN", value_parser = parse_listen)]
    pub metrics_listen: Option<SocketAddr>,
    /// Open HTTP connections per listener; lowered to fit the file-descriptor limit. At the
    /// limit the oldest connection that has not sent its request yet makes room, or else
    /// the new one is closed at once.
    #[arg(long, default_value = "256", value_name = "N")]
    pub http_max_connections: usize,
    /// The Service layer's unix socket for the node agent (`POST /services/apply`: what
    /// `aether-cni services apply` does, without a process per document). Default:
    /// `<state-dir>/agent/services.sock` (the agent's pod mounts `<state-dir>/agent`, not the
    /// state directory). Empty (`--services-socket=`): not served.
    #[arg(long, env = "AETHER_CNI_SERVICES_SOCKET", value_name = "PATH")]
    pub services_socket: Option<String>,
    /// Keep the binary and the entry when stopped (an upgrade: the next installer takes
    /// over). Also honoured when `<state-dir>/installer-upgrade` exists at stop time.
    #[arg(long, env = "AETHER_CNI_UPGRADE", value_parser = clap::builder::BoolishValueParser::new(), default_value = "false", num_args = 0..=1, default_missing_value = "true")]
    pub upgrade: bool,
    /// Print the entry these settings make, as the plugin will receive it (checked by the
    /// plugin's own parser in a cniVersion 1.1.0 list), and exit: nothing is installed.
    #[arg(long)]
    pub print_entry: bool,
    /// Print one Event body of every kind (a JSON list, as they are created and as a series
    /// makes them) and exit: the chart's tests validate them against the Kubernetes schemas.
    #[arg(long, hide = true)]
    pub print_event_examples: bool,
    /// Full re-check period: binary, conflist, kernel checks while they fail.
    #[arg(long, default_value = "10", value_name = "SECONDS")]
    pub resync_seconds: u64,

    /// Keep every pod's capture true: each period, the runtime's pod sandboxes (over
    /// --cri-socket) against the node's attachment records: missed pods handled by
    /// --missed-pods, drift repaired to the record, leftovers collected. false: off.
    #[arg(long, env = "AETHER_CNI_RECONCILE", value_parser = clap::builder::BoolishValueParser::new(), default_value = "true", num_args = 0..=1, default_missing_value = "true")]
    pub reconcile: bool,
    /// The runtime's CRI socket, as mounted in this container: a path, or `containerd`
    /// (/run/containerd/containerd.sock) or `crio` (/var/run/crio/crio.sock). Empty (the
    /// default): no runtime is asked, so missed pods cannot be seen; drift and leftovers are
    /// still handled from the records.
    #[arg(long, env = "AETHER_CNI_CRI_SOCKET", default_value = "")]
    pub cri_socket: String,
    /// Seconds each CRI call may take.
    #[arg(long, default_value = "5", value_name = "SECONDS")]
    pub cri_timeout_seconds: u64,
    /// Seconds one reconciler pass may wait on the runtime in all (its calls, each within
    /// --cri-timeout-seconds), and never more than the period (or one call's timeout, if
    /// longer): what is not asked in time is asked by a later pass.
    #[arg(long, default_value = "10", value_name = "SECONDS")]
    pub cri_pass_budget_seconds: u64,
    /// The largest answer read from the runtime, in MiB (the kubelet reads up to 16): a pod
    /// list larger than this cannot be read, and missed pods cannot be seen.
    #[arg(long, default_value = "16", value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub cri_max_message_mib: u64,
    /// Seconds an uninstall that left the plugin binary for attached pods may wait, asking the
    /// runtime (--cri-socket) each second which CNI chain it holds and which pods are gone, to
    /// remove the binary and the records no teardown needs any more (containerd never runs a
    /// DEL or GC of aether-cni after its reload). 0: the runtime is not asked. Within the
    /// chart's terminationGracePeriodSeconds (30).
    #[arg(long, default_value = "20", value_name = "SECONDS")]
    pub uninstall_wait_seconds: u64,
    /// Seconds between reconciler passes.
    #[arg(long, default_value = "10", value_name = "SECONDS")]
    pub reconcile_period_seconds: u64,
    /// What to do with a missed pod (ready, should be captured, no attachment): restart
    /// (stop its sandbox through the CRI: the kubelet recreates it through ADD), capture (in
    /// place, with ADD's code) or report (log and count only).
    #[arg(long, default_value = "restart", value_parser = parse_policy)]
    pub missed_pods: MissedPolicy,
    /// Restarts plus in-place captures per pass, at most.
    #[arg(long, default_value = "5")]
    pub reconcile_max_actions: usize,
    /// Seconds before a pod is acted on again, doubled per attempt (up to ten minutes).
    #[arg(long, default_value = "30", value_name = "SECONDS")]
    pub reconcile_backoff_seconds: u64,
    /// Actions on one pod before it is only reported.
    #[arg(long, default_value = "3")]
    pub reconcile_attempts: u32,
    /// Seconds a record must be old before a missing sandbox makes it a leftover (the runtime
    /// lists a sandbox only after its ADD wrote the record).
    #[arg(long, default_value = "60", value_name = "SECONDS")]
    pub leftover_grace_seconds: u64,

    /// Post Kubernetes Events (events.k8s.io/v1) for what the node did to each pod and for
    /// the node's readiness, with the service-account token in --events-token-file. Never a
    /// dependency: an API server that is slow, refuses or is gone loses Events (counted in
    /// aether_cni_installer_events_dropped_total), nothing else.
    #[arg(long, env = "AETHER_CNI_EVENTS", value_parser = clap::builder::BoolishValueParser::new(), default_value = "false", num_args = 0..=1, default_missing_value = "true")]
    pub events: bool,
    /// The API server, e.g. https://10.96.0.1:443. Default: the in-cluster address,
    /// https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT.
    #[arg(long, env = "AETHER_CNI_EVENTS_API_SERVER", value_name = "URL")]
    pub events_api_server: Option<String>,
    /// The service-account token (a projected volume the kubelet rotates; re-read as it does).
    #[arg(long, default_value = "/var/run/secrets/kubernetes.io/serviceaccount/token", value_name = "PATH")]
    pub events_token_file: PathBuf,
    /// The cluster's CA bundle (PEM). Empty: none (a plain-http API server, for tests).
    #[arg(long, default_value = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt", value_name = "PATH")]
    pub events_ca_file: String,
    /// The node's name (the chart passes spec.nodeName): the Events' reportingInstance and
    /// the Node the readiness Events are about.
    #[arg(long, env = "NODE_NAME", default_value = "")]
    pub node_name: String,
    /// API writes per second for Events, at most (a token bucket with a burst of one).
    #[arg(long, default_value = "1", value_name = "N")]
    pub events_writes_per_second: f64,

    /// The node address of the DNS proxy (the chart passes status.hostIP): entry `hostIP`, or
    /// `hostIPv6` when it is an IPv6 address (an IPv6-only node).
    #[arg(long, env = "HOST_IP")]
    pub host_ip: Option<String>,
    /// Entry `hostIPv6`: the node's IPv6 address, for IPv6 pods' DNS.
    #[arg(long, env = "HOST_IPV6")]
    pub host_ipv6: Option<String>,
    /// The node's addresses, comma-separated (status.hostIPs): the first IPv4 one fills
    /// `hostIP` and the first IPv6 one `hostIPv6` where --host-ip/--host-ipv6 did not.
    #[arg(long, env = "HOST_IPS", value_delimiter = ',')]
    pub host_ips: Option<Vec<String>>,
    /// Entry `captureMode`: redirect-all, scoped or disabled.
    #[arg(long)]
    pub capture_mode: Option<String>,
    /// Entry `captureDNS`.
    #[arg(long)]
    pub capture_dns: Option<bool>,
    /// Entry `capturePort`.
    #[arg(long)]
    pub capture_port: Option<u16>,
    /// Entry `meshL4Port`.
    #[arg(long)]
    pub mesh_l4_port: Option<u16>,
    /// Entry `scopedPorts` (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub scoped_ports: Option<Vec<u16>>,
    /// Entry `dnsProxyPort`.
    #[arg(long)]
    pub dns_proxy_port: Option<u16>,
    /// Entry `divertMark` (decimal or 0x-hex).
    #[arg(long)]
    pub divert_mark: Option<String>,
    /// Entry `passthroughMark` (decimal or 0x-hex).
    #[arg(long)]
    pub passthrough_mark: Option<String>,
    /// Entry `routeTable`.
    #[arg(long)]
    pub route_table: Option<u32>,
    /// Entry `rulePriority`.
    #[arg(long)]
    pub rule_priority: Option<u32>,
    /// Entry `excludeOutboundCIDRs` (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub exclude_outbound_cidrs: Option<Vec<String>>,
    /// Entry `excludeOutboundPorts` (comma-separated ports or ranges such as 9000-9100).
    #[arg(long, value_delimiter = ',')]
    pub exclude_outbound_ports: Option<Vec<String>>,
    /// Entry `excludeNamespaces` (comma-separated; an empty value manages every namespace).
    #[arg(long, value_delimiter = ',')]
    pub exclude_namespaces: Option<Vec<String>>,
    /// Entry `logFile` (a host path).
    #[arg(long)]
    pub log_file: Option<String>,
    /// Entry `logLevel`: error, warn, info or debug.
    #[arg(long)]
    pub log_level: Option<String>,
}

fn parse_policy(s: &str) -> Result<MissedPolicy, String> {
    s.parse()
}

/// `IP:PORT`, `[IPv6]:PORT`, or an unbracketed `IPv6:PORT` (the port after the last colon).
fn parse_listen(s: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = s.parse() {
        return Ok(a);
    }
    let bad = || format!("{s:?} is not an address and port such as 127.0.0.1:18095 or [fd00::1]:18095");
    let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
    Ok(SocketAddr::new(host.parse().map_err(|_| bad())?, port.parse().map_err(|_| bad())?))
}

impl InstallArgs {
    /// The entry's (`hostIP`, `hostIPv6`): explicit flags first, then the node's addresses by
    /// family. Text that is no address at all goes to `hostIP` as given, for the plugin's
    /// parser to name.
    fn host_addresses(&self) -> (Option<String>, Option<String>) {
        let is_v6 = |s: &str| s.parse::<std::net::Ipv6Addr>().is_ok();
        let given = |o: &Option<String>| o.as_deref().map(str::trim).filter(|s| !s.is_empty()).map(str::to_string);
        let (mut v4, mut v6) = (None, given(&self.host_ipv6));
        match given(&self.host_ip) {
            Some(ip) if is_v6(&ip) => v6 = v6.or(Some(ip)),
            other => v4 = other,
        }
        for ip in self.host_ips.iter().flatten().map(|s| s.trim()).filter(|s| !s.is_empty()) {
            if is_v6(ip) {
                v6 = v6.or_else(|| Some(ip.to_string()));
            } else if ip.parse::<std::net::Ipv4Addr>().is_ok() {
                v4 = v4.or_else(|| Some(ip.to_string()));
            }
        }
        (v4, v6)
    }

    /// The plugin binary to install: --plugin-binary, or `aether-cni` beside this executable.
    pub fn plugin_binary(&self) -> std::io::Result<PathBuf> {
        match &self.plugin_binary {
            Some(p) => Ok(p.clone()),
            None => {
                let exe = std::env::current_exe()?;
                Ok(exe.with_file_name(PLUGIN_TYPE))
            }
        }
    }

    /// Where and how the HTTP face serves.
    pub fn http(&self) -> crate::serve::Config {
        crate::serve::Config {
            probes: self.listen,
            metrics: self.metrics_listen,
            max_connections: self.http_max_connections,
            services_socket: self.services_socket(),
            state_dir: self.state_dir.clone(),
        }
    }

    /// The Service layer's socket, unless turned off with an empty path.
    pub fn services_socket(&self) -> Option<PathBuf> {
        match &self.services_socket {
            None => Some(
                self.state_dir.join(crate::services_socket::DEFAULT_DIR).join(crate::services_socket::DEFAULT_NAME),
            ),
            Some(p) if p.trim().is_empty() => None,
            Some(p) => Some(PathBuf::from(p)),
        }
    }

    /// The netns directory to check, if one is given.
    pub fn netns_dir(&self) -> Option<PathBuf> {
        Some(self.netns_dir.trim()).filter(|d| !d.is_empty()).map(PathBuf::from)
    }

    pub fn resync(&self) -> Duration {
        Duration::from_secs(self.resync_seconds.max(1))
    }

    /// The CRI socket, if one is given (the runtimes' names stand for their defaults).
    pub fn cri_socket(&self) -> Option<PathBuf> {
        match self.cri_socket.trim() {
            "" => None,
            "containerd" => Some(PathBuf::from(aether_cri::CONTAINERD_SOCKET)),
            "crio" | "cri-o" => Some(PathBuf::from(aether_cri::CRIO_SOCKET)),
            path => Some(PathBuf::from(path)),
        }
    }

    pub fn cri_timeout(&self) -> Duration {
        Duration::from_secs(self.cri_timeout_seconds.max(1))
    }

    pub fn uninstall_wait(&self) -> Duration {
        Duration::from_secs(self.uninstall_wait_seconds)
    }

    pub fn cri_pass_budget(&self) -> Duration {
        Duration::from_secs(self.cri_pass_budget_seconds.max(1))
    }

    pub fn cri_max_message_bytes(&self) -> usize {
        (self.cri_max_message_mib as usize) << 20
    }

    pub fn reconcile_period(&self) -> Duration {
        Duration::from_secs(self.reconcile_period_seconds.max(1))
    }

    /// The reconciler's settings from these flags.
    pub fn reconciler(&self) -> reconcile::looper::Settings {
        reconcile::looper::Settings {
            enabled: self.reconcile,
            cri_socket: self.cri_socket(),
            cri_timeout: self.cri_timeout(),
            cri_max_message_bytes: self.cri_max_message_bytes(),
            cri_pass_budget: self.cri_pass_budget(),
            period: self.reconcile_period(),
            limits: self.reconcile_limits(),
            state_dir: self.state_dir.clone(),
        }
    }

    /// The Events' settings from these flags and the in-cluster environment: `None` when
    /// Events are off.
    pub fn events(&self) -> Result<Option<events::Settings>, events::SettingsError> {
        self.events_in(|name| std::env::var(name).ok())
    }

    /// `events` with the environment read through `env`.
    fn events_in(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<events::Settings>, events::SettingsError> {
        if !self.events {
            return Ok(None);
        }
        let api_server = match self.events_api_server.as_deref().map(str::trim).filter(|s| !s.is_empty()) {
            Some(url) => url.to_string(),
            None => {
                let var = |name: &'static str| {
                    env(name).filter(|v| !v.is_empty()).ok_or(events::SettingsError::NoApiServer(name))
                };
                let host = var("KUBERNETES_SERVICE_HOST")?;
                let port = var("KUBERNETES_SERVICE_PORT")?;
                // An IPv6 service address goes in brackets.
                let host = if host.contains(':') { format!("[{host}]") } else { host };
                format!("https://{host}:{port}")
            }
        };
        if self.node_name.trim().is_empty() {
            return Err(events::SettingsError::NoNodeName);
        }
        if !(self.events_writes_per_second.is_finite() && self.events_writes_per_second > 0.0) {
            return Err(events::SettingsError::Rate(self.events_writes_per_second));
        }
        Ok(Some(events::Settings {
            api_server,
            token_file: Some(self.events_token_file.clone()).filter(|p| !p.as_os_str().is_empty()),
            ca_file: Some(PathBuf::from(&self.events_ca_file)).filter(|p| !p.as_os_str().is_empty()),
            node_name: self.node_name.trim().to_string(),
            writes_per_second: self.events_writes_per_second,
            request_timeout: Duration::from_secs(5),
            queue: events::Settings::DEFAULT_QUEUE,
            ledger: events::Settings::DEFAULT_LEDGER,
            series_refresh: events::Settings::DEFAULT_SERIES_REFRESH,
            series_window: events::Settings::DEFAULT_SERIES_WINDOW,
        }))
    }

    /// Where the reconciler's node library finds the node's files, and the entry it chains.
    pub fn node_files(&self) -> NodeFiles {
        NodeFiles {
            state_dir: self.state_dir.clone(),
            conf_dir: self.cni_conf_dir.clone(),
            conflist_name: self.conflist_name.clone(),
            entry: self.entry(),
        }
    }

    pub fn reconcile_limits(&self) -> Limits {
        let backoff = Duration::from_secs(self.reconcile_backoff_seconds);
        Limits {
            missed: self.missed_pods,
            actions_per_pass: self.reconcile_max_actions,
            backoff,
            backoff_max: backoff.max(Duration::from_secs(600)),
            attempts: self.reconcile_attempts.max(1),
            leftover_grace: Duration::from_secs(self.leftover_grace_seconds),
            ..Limits::default()
        }
    }

    /// The plugin entry: `type`, the pod-annotations capability, `stateDir`, and each node
    /// setting that was given (the plugin's defaults apply to the others).
    pub fn entry(&self) -> Map<String, Value> {
        let mut e = Map::new();
        e.insert("type".into(), PLUGIN_TYPE.into());
        e.insert("capabilities".into(), serde_json::json!({ "io.kubernetes.cri.pod-annotations": true }));
        e.insert("stateDir".into(), self.state_dir.to_string_lossy().into_owned().into());
        let mut put = |k: &str, v: Option<Value>| {
            if let Some(v) = v {
                e.insert(k.into(), v);
            }
        };
        let strings = |v: &Option<Vec<String>>| {
            v.as_ref().map(|l| l.iter().filter(|s| !s.is_empty()).map(|s| Value::from(s.trim())).collect())
        };
        let (v4, v6) = self.host_addresses();
        put("hostIP", v4.map(Value::from));
        put("hostIPv6", v6.map(Value::from));
        put("captureMode", self.capture_mode.clone().map(Value::from));
        put("captureDNS", self.capture_dns.map(Value::from));
        put("capturePort", self.capture_port.map(Value::from));
        put("meshL4Port", self.mesh_l4_port.map(Value::from));
        put("scopedPorts", self.scoped_ports.as_ref().map(|p| p.iter().map(|n| Value::from(*n)).collect()));
        put("dnsProxyPort", self.dns_proxy_port.map(Value::from));
        put("divertMark", self.divert_mark.clone().map(Value::from));
        put("passthroughMark", self.passthrough_mark.clone().map(Value::from));
        put("routeTable", self.route_table.map(Value::from));
        put("rulePriority", self.rule_priority.map(Value::from));
        put("excludeOutboundCIDRs", strings(&self.exclude_outbound_cidrs));
        // A bare port as a number, a range as a string: both are what the plugin reads.
        put(
            "excludeOutboundPorts",
            self.exclude_outbound_ports.as_ref().map(|l| {
                l.iter()
                    .map(|s| s.trim())
                    .filter(|s| !s.is_empty())
                    .map(|s| s.parse::<u64>().map(Value::from).unwrap_or_else(|_| Value::from(s)))
                    .collect()
            }),
        );
        put("excludeNamespaces", strings(&self.exclude_namespaces));
        put("logFile", self.log_file.clone().map(Value::from));
        put("logLevel", self.log_level.clone().map(Value::from));
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: InstallArgs,
    }

    fn entry(flags: &[&str]) -> Map<String, Value> {
        Cli::try_parse_from(std::iter::once("install").chain(flags.iter().copied())).unwrap().args.entry()
    }

    #[test]
    fn node_addresses_go_to_the_field_of_their_family() {
        let e = entry(&["--host-ip=10.0.0.1"]);
        assert_eq!((e.get("hostIP"), e.get("hostIPv6")), (Some(&"10.0.0.1".into()), None));
        let e = entry(&["--host-ip=fd00::1"]);
        assert_eq!((e.get("hostIP"), e.get("hostIPv6")), (None, Some(&"fd00::1".into())), "an IPv6-only node");
        let e = entry(&["--host-ip=10.0.0.1", "--host-ips=10.0.0.1,fd00::1"]);
        assert_eq!((e.get("hostIP"), e.get("hostIPv6")), (Some(&"10.0.0.1".into()), Some(&"fd00::1".into())));
        let e = entry(&["--host-ips=fd00::2,10.0.0.2", "--host-ipv6=fd00::9"]);
        assert_eq!((e.get("hostIP"), e.get("hostIPv6")), (Some(&"10.0.0.2".into()), Some(&"fd00::9".into())));
        let e = entry(&["--host-ip=not-an-ip"]);
        assert_eq!(e.get("hostIP"), Some(&"not-an-ip".into()), "left for the plugin's parser to name");
    }

    #[test]
    fn reconciler_flags() {
        let parse = |flags: &[&str]| Cli::try_parse_from(std::iter::once("install").chain(flags.iter().copied()));
        let a = parse(&[]).unwrap().args;
        assert!(a.reconcile);
        assert_eq!(a.cri_socket(), None, "no runtime is asked unless told where");
        assert_eq!(a.reconcile_limits().missed, MissedPolicy::Restart);
        let a = parse(&["--cri-socket=containerd", "--missed-pods=capture", "--reconcile=false"]).unwrap().args;
        assert_eq!(a.cri_socket(), Some(PathBuf::from("/run/containerd/containerd.sock")));
        assert_eq!((a.reconcile, a.reconcile_limits().missed), (false, MissedPolicy::Capture));
        assert_eq!(
            parse(&["--cri-socket=crio"]).unwrap().args.cri_socket(),
            Some(PathBuf::from("/var/run/crio/crio.sock"))
        );
        assert_eq!(parse(&["--cri-socket=/x/y.sock"]).unwrap().args.cri_socket(), Some(PathBuf::from("/x/y.sock")));
        let e = parse(&["--missed-pods=delete"]).err().unwrap().to_string();
        assert!(e.contains("\"delete\" is not a missed-pod policy"), "{e}");
    }

    #[test]
    fn services_socket_is_in_the_state_directory_unless_told() {
        let parse = |flags: &[&str]| Cli::try_parse_from(std::iter::once("install").chain(flags.iter().copied()));
        let a = parse(&["--state-dir=/s"]).unwrap().args;
        assert_eq!(a.services_socket(), Some(PathBuf::from("/s/agent/services.sock")));
        assert_eq!(a.http().services_socket, a.services_socket());
        assert_eq!(parse(&["--services-socket="]).unwrap().args.services_socket(), None, "empty: off");
        assert_eq!(
            parse(&["--services-socket=/run/x.sock"]).unwrap().args.services_socket(),
            Some(PathBuf::from("/run/x.sock"))
        );
    }

    #[test]
    fn listen_takes_either_family_with_or_without_brackets() {
        for (text, want) in [
            ("127.0.0.1:18095", "127.0.0.1:18095"),
            ("[fd00::1]:18095", "[fd00::1]:18095"),
            ("fd00::1:18095", "[fd00::1]:18095"),
        ] {
            assert_eq!(parse_listen(text).unwrap().to_string(), want);
        }
        for bad in ["localhost:18095", "10.0.0.1", "10.0.0.1:http"] {
            assert!(parse_listen(bad).unwrap_err().contains(bad));
        }
    }

    #[test]
    fn events_find_the_api_server_in_the_cluster_and_need_the_node_name() {
        let parse =
            |flags: &[&str]| Cli::try_parse_from(std::iter::once("install").chain(flags.iter().copied())).unwrap().args;
        let env = |host: &'static str| {
            move |name: &str| match name {
                "KUBERNETES_SERVICE_HOST" => Some(host.to_string()),
                "KUBERNETES_SERVICE_PORT" => Some("443".to_string()),
                _ => None,
            }
        };
        assert!(parse(&[]).events_in(env("10.96.0.1")).unwrap().is_none(), "off by default");
        let on = parse(&["--events", "--node-name=node-a"]);
        let s = on.events_in(env("10.96.0.1")).unwrap().unwrap();
        assert_eq!((s.api_server.as_str(), s.node_name.as_str()), ("https://10.96.0.1:443", "node-a"));
        assert_eq!(s.token_file.unwrap(), PathBuf::from("/var/run/secrets/kubernetes.io/serviceaccount/token"));
        assert_eq!(on.events_in(env("fd00:10:96::1")).unwrap().unwrap().api_server, "https://[fd00:10:96::1]:443");
        // Named where they are missing: the address, the node's name, a rate.
        assert!(matches!(on.events_in(|_| None), Err(events::SettingsError::NoApiServer("KUBERNETES_SERVICE_HOST"))));
        assert!(matches!(parse(&["--events"]).events_in(env("10.96.0.1")), Err(events::SettingsError::NoNodeName)));
        let zero = parse(&["--events", "--node-name=n", "--events-writes-per-second=0"]);
        assert!(matches!(zero.events_in(env("10.96.0.1")), Err(events::SettingsError::Rate(_))));
        let given =
            parse(&["--events", "--node-name=n", "--events-api-server=http://127.0.0.1:8080", "--events-ca-file="]);
        let s = given.events_in(|_| None).unwrap().unwrap();
        assert_eq!((s.api_server.as_str(), s.ca_file), ("http://127.0.0.1:8080", None));
    }
}
