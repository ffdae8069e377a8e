//! `aether-cni install`'s command line. Directory and address flags are the installer's;
//! the node settings become the conflist entry as they are, and the plugin's own parser
//! judges them (the installer refuses to write an entry the plugin would refuse).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Map, Value};

use crate::chain::PLUGIN_TYPE;

#[derive(clap::Args, Debug, Clone)]
pub struct InstallArgs {
    /// The host's CNI bin directory, as mounted in this container.
    #[arg(long, env = "AETHER_CNI_BIN_DIR", default_value = "/host/opt/cni/bin")]
    pub cni_bin_dir: PathBuf,
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
    /// Address for /healthz, /readyz and /metrics.
    #[arg(long, env = "AETHER_CNI_LISTEN", default_value = "127.0.0.1:18095")]
    pub listen: SocketAddr,
    /// Keep the binary and the entry when stopped (an upgrade: the next installer takes
    /// over). Also honoured when `<state-dir>/installer-upgrade` exists at stop time.
    #[arg(long, env = "AETHER_CNI_UPGRADE", value_parser = clap::builder::BoolishValueParser::new(), default_value = "false", num_args = 0..=1, default_missing_value = "true")]
    pub upgrade: bool,
    /// Print the entry these settings make, as the plugin will receive it (checked by the
    /// plugin's own parser in a cniVersion 1.1.0 list), and exit: nothing is installed.
    #[arg(long)]
    pub print_entry: bool,
    /// Full re-check period: binary, conflist, kernel checks while they fail.
    #[arg(long, default_value = "10", value_name = "SECONDS")]
    pub resync_seconds: u64,

    /// Entry `hostIP`: the node address of the DNS proxy (the chart passes status.hostIP).
    #[arg(long, env = "HOST_IP")]
    pub host_ip: Option<String>,
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

impl InstallArgs {
    pub fn resync(&self) -> Duration {
        Duration::from_secs(self.resync_seconds.max(1))
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
        put("hostIP", self.host_ip.clone().filter(|s| !s.is_empty()).map(Value::from));
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
