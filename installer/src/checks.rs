//! What the installer asks of the node library, `aether-node`: the plugin's own parser, the
//! kernel checks and the Service layer's node counters.

use std::path::Path;

use aether_node::config::ConfigError;
use aether_node::probe::ProbeError;
use aether_node::services::ServicesError;

/// What the installer asks of the node library: the answers a real node gives
/// ([`LiveNode`]), or a test's.
pub trait NodeChecks: Send + Sync {
    /// The plugin's own parser, given the entry exactly as the runtime will pass it (with the
    /// list's `name` and `cniVersion`).
    fn validate_entry(&self, entry: &[u8]) -> Result<(), ConfigError>;
    /// doctor's kernel checks (the default capture ruleset, in a private netns).
    fn kernel_checks(&self) -> Result<(), ProbeError>;
    /// The Service layer's node counters as Prometheus text.
    fn node_counters(&self) -> Result<String, ServicesError>;
}

/// The node as it is: `aether-node` on the installer's state directory.
pub struct LiveNode {
    services: aether_node::services::ServicesDir,
}

impl LiveNode {
    pub fn new(state_dir: &Path) -> Self {
        LiveNode { services: aether_node::services::ServicesDir::new(state_dir) }
    }
}

impl NodeChecks for LiveNode {
    fn validate_entry(&self, entry: &[u8]) -> Result<(), ConfigError> {
        aether_node::config::parse(entry).map(drop)
    }

    fn kernel_checks(&self) -> Result<(), ProbeError> {
        // A connect-time socket load balancer is said, not a not-ready reason: pods start
        // and are captured, but Service traffic reaches the capture already balanced.
        if let Ok(f @ aether_node::probe::socket_lb::Finding::Attached(_)) = aether_node::probe::socket_lb::detect() {
            tracing::warn!("{f}");
        }
        aether_node::probe::kernel_probe()
    }

    fn node_counters(&self) -> Result<String, ServicesError> {
        aether_node::services::node_counters(&self.services).map(|c| c.to_prometheus())
    }
}

/// A refused entry in one line: the parser's message and what lies under it.
pub(crate) fn refusal(e: &ConfigError) -> String {
    match e.details() {
        Some(d) => format!("{e}: {d}"),
        None => e.to_string(),
    }
}
