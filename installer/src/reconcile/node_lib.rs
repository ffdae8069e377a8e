//! [`NodeOps`] over the node library: the very code of the CNI commands. What ADD would make
//! of a pod is `config::effective` on the entry the runtime passes; a record's netns is
//! compared by `aether_node::drift` (CHECK's comparison and `services verify`'s, skipped for a
//! pod whose netns had no nftables commit since it was last found intact), all pods on one
//! tour of their netns; a repair is the node library's (`aether_node::repair`: locked, the
//! record read again, exactly its ruleset programmed in one transaction, or its Service
//! layer rebuilt); a leftover is collected by `attachment::collect` (GC's, counts folded
//! once); an in-place capture is `attachment::attach_in_place` (ADD's, after marking the
//! connections conntrack already tracks).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use aether_cri::Sandbox;
use aether_node::attachment::{self, AttachmentError, Target};
use aether_node::config::{self, NetConf};
use aether_node::drift::{Compared, Drift, Look};
use aether_node::repair;
use aether_node::repair::RepairError;
use aether_node::services::{self, ServicesError};
use aether_node::state::{PodIdentity, Record, Recorded, StateDir, StateError};
use serde_json::{json, Map, Value};

use super::{Comparisons, Differences, Leftover, NodeOps, Observation, PodRef, RecordView, Wants};
use crate::chain;

/// The interface the kubelet asks runtimes for (containerd's and CRI-O's default).
const POD_IFNAME: &str = "eth0";

#[derive(Debug, thiserror::Error)]
pub enum NodeOpsError {
    #[error("no network configuration to capture with: {0}")]
    Chain(#[from] crate::Error),
    #[error("the plugin refuses the network configuration: {0}")]
    Config(config::ConfigError),
    #[error(transparent)]
    Attachment(#[from] AttachmentError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error("the Service layer of {0} was found as stored when compared again under the locks (an ADD or apply in flight brought it there)")]
    LayerAsStored(String),
    #[error("the record {0} went away before the repair (the pod's DEL came)")]
    RecordGone(String),
    #[error("the plugin refuses the node's network configuration (see /readyz)")]
    NoConfiguration,
    #[error(transparent)]
    Repair(#[from] aether_node::repair::RepairError),
    #[error("the Service layer: {0}")]
    Services(#[from] ServicesError),
}

pub struct NodeLib {
    state_dir: PathBuf,
    conf_dir: PathBuf,
    conflist_name: String,
    entry: Map<String, Value>,
    /// The configuration as the runtime passes it now, read at the start of each pass.
    conf: Option<NetConf>,
    /// The entry alone (on a stand-in list): enough to judge annotations and namespaces
    /// while there is no primary to chain onto yet.
    standalone: Option<NetConf>,
    /// This pass's records, by key.
    records: HashMap<String, Record>,
    /// What each pod's last full comparison found intact.
    drift: Drift,
    /// The stored Service layer's header, read at the start of this pass.
    layer: Result<Option<services::LayerHeader>, ServicesError>,
    compared: Comparisons,
    /// A netns directory that does not show pods' netns made after the installer started.
    blind: Option<crate::netns_mount::Blind>,
}

/// Where the node's CNI files are and the plugin entry the installer chains (from the
/// installer's flags: `InstallArgs::node_files`).
#[derive(Debug, Clone)]
pub struct NodeFiles {
    pub state_dir: PathBuf,
    pub conf_dir: PathBuf,
    pub conflist_name: String,
    pub entry: Map<String, Value>,
}

impl NodeLib {
    pub fn new(files: NodeFiles) -> NodeLib {
        let NodeFiles { state_dir, conf_dir, conflist_name, entry } = files;
        let stand_in = chain::Primary {
            path: PathBuf::from("(reconciler)"),
            bytes: br#"{"cniVersion":"1.1.0","name":"reconciler","plugins":[{"type":"main-cni"}]}"#.to_vec(),
            mode: 0o644,
        };
        let standalone = chain::chain(&stand_in, &entry).ok().and_then(|(_, as_passed)| config::parse(&as_passed).ok());
        NodeLib {
            state_dir,
            conf_dir,
            conflist_name,
            entry,
            conf: None,
            standalone,
            records: HashMap::new(),
            drift: Drift::new(),
            layer: Ok(None),
            compared: Comparisons::default(),
            blind: None,
        }
    }

    /// A record whose netns is under `blind` and not found is unverifiable, never gone: the
    /// directory does not show the netns made after the installer started.
    pub fn blind_to(mut self, blind: Option<crate::netns_mount::Blind>) -> Self {
        self.blind = blind;
        self
    }

    /// Every pass compares every pod in full (what a pass cost before the generation check:
    /// `make bench`'s baseline).
    pub fn always_full(mut self, yes: bool) -> Self {
        self.drift = Drift::new().always_full(yes);
        self
    }

    /// The record behind `view` as this pass read it (the repairs read it again, locked).
    fn seen(&self, view: &RecordView) -> Result<&Record, NodeOpsError> {
        self.records.get(&view.key).ok_or_else(|| NodeOpsError::RecordGone(view.key.clone()))
    }

    /// The entry chained onto the node's primary, as the runtime passes it to the plugin.
    fn chained_conf(&self) -> Result<NetConf, NodeOpsError> {
        let primary = chain::find_primary(&self.conf_dir, &self.conflist_name)?;
        let (_, as_passed) = chain::chain(&primary, &self.entry)?;
        config::parse(&as_passed).map_err(NodeOpsError::Config)
    }

    fn any_conf(&self) -> Option<&NetConf> {
        self.conf.as_ref().or(self.standalone.as_ref())
    }

    /// `conf` for the pod's annotations (as containerd passes them: a map, `null` for none)
    /// and addresses (as a prevResult's `ips`).
    fn pod_conf(conf: &NetConf, sandbox: &Sandbox, ips: &[String]) -> NetConf {
        let mut c = conf.clone();
        c.annotations = if sandbox.annotations.is_empty() {
            Value::Null
        } else {
            Value::Object(sandbox.annotations.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect())
        };
        let ips: Vec<Value> = ips
            .iter()
            .map(|ip| {
                let prefix = if ip.contains(':') { 128 } else { 32 };
                json!({"address": format!("{ip}/{prefix}")})
            })
            .collect();
        c.prev_result = Some(json!({"cniVersion": c.cni_version, "ips": ips}));
        c
    }

    /// A configuration naming the record's network and this state directory (what DEL and GC
    /// of that network would be given).
    fn conf_for(&self, record: &Record) -> Option<NetConf> {
        let mut c = self.any_conf()?.clone();
        c.name = record.network.clone();
        c.state_dir = self.state_dir.clone();
        Some(c)
    }
}

impl NodeOps for NodeLib {
    type Error = NodeOpsError;

    fn outcome_of(&self, e: &NodeOpsError) -> Option<super::Outcome> {
        match e {
            NodeOpsError::RecordGone(_)
            | NodeOpsError::LayerAsStored(_)
            | NodeOpsError::Repair(
                RepairError::RecordGone(_) | RepairError::RecordChanged(_) | RepairError::NetnsGone(_),
            ) => Some(super::Outcome::Moot(e.to_string())),
            NodeOpsError::Attachment(AttachmentError::NetnsOwned { .. }) => {
                Some(super::Outcome::Refused(e.to_string()))
            }
            _ => None,
        }
    }

    fn wants(&self, sandbox: &Sandbox) -> Wants {
        let Some(conf) = self.any_conf() else {
            return Wants::Invalid("the plugin refuses the node's network configuration".into());
        };
        if conf.exclude_namespaces.contains(&sandbox.namespace) {
            return Wants::Excluded;
        }
        match config::effective(&Self::pod_conf(conf, sandbox, &[]), Some(&sandbox.namespace)) {
            Ok(Some(_)) => Wants::Capture,
            Ok(None) => Wants::Disabled,
            Err(e) => Wants::Invalid(e.to_string()),
        }
    }

    fn records(&mut self) -> Result<Vec<RecordView>, NodeOpsError> {
        self.conf = self.chained_conf().ok();
        let scan = StateDir::new(&self.state_dir).scan();
        for u in &scan.unreadable {
            tracing::warn!(file = %u.file, "an attachment record cannot be read: {}", u.why);
        }
        self.records = scan.records.into_iter().map(|r| (r.key(), r)).collect();
        let mut views: Vec<RecordView> = self
            .records
            .values()
            .map(|r| RecordView {
                key: r.key(),
                sandbox_id: r.container_id.clone(),
                pod: PodRef {
                    namespace: r.pod_namespace.clone().unwrap_or_default(),
                    name: r.pod_name.clone().unwrap_or_default(),
                    uid: r.pod_uid.clone().unwrap_or_default(),
                },
                netns: r.netns.clone(),
            })
            .collect();
        views.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(views)
    }

    fn recorded_sandboxes(&mut self) -> Result<HashSet<String>, NodeOpsError> {
        Ok(StateDir::new(&self.state_dir).scan().records.into_iter().map(|r| r.container_id).collect())
    }

    fn observe(&mut self, view: &RecordView) -> Observation {
        let Some(record) = self.records.get(&view.key) else {
            return Observation::Unverifiable("the record is not in this pass's scan".into());
        };
        let Some(conf) = self.conf_for(record) else {
            return Observation::Unverifiable("the plugin refuses the node's network configuration".into());
        };
        match self.drift.look(&conf, record, &self.layer) {
            Look::Gone(why) => match &self.blind {
                Some(b) if b.covers(&record.netns) => Observation::Unverifiable(format!(
                    "{why}; not taken for gone: the netns directory {} does not show netns made after this \
                     installer started (/readyz: netns)",
                    b.dirs[0].display()
                )),
                _ => Observation::NetnsGone(why),
            },
            Look::Unverifiable(why) => Observation::Unverifiable(why),
            Look::Seen { capture, services, compared } => {
                match compared {
                    Compared::Full => self.compared.full += 1,
                    Compared::Unchanged => self.compared.unchanged += 1,
                }
                // The record names the ruleset the pod was compared with: one of an earlier
                // release, found intact, is a migration to come, not drift; a later release's
                // (a rollback) cannot be compared, and is migrated to this release's.
                // So is a Service layer of an earlier release's shape.
                let recorded = record.ruleset();
                let older_layer = !services.is_empty() && capture.is_empty() && repair::holds_older_layer(record);
                let d = Differences { capture, services };
                match recorded {
                    Recorded::Unknown(_) => Observation::MigrationPending { from: recorded.to_string() },
                    _ if older_layer && recorded.is_current() => {
                        Observation::MigrationPending { from: "a Service layer of an earlier release's shape".into() }
                    }
                    _ if older_layer => Observation::MigrationPending { from: recorded.to_string() },
                    _ if !d.is_empty() => Observation::Drifted(d),
                    _ if recorded.is_current() => Observation::Intact,
                    _ => Observation::MigrationPending { from: repair::migrating_from(record) },
                }
            }
        }
    }

    /// All pods on one tour of their netns, on this thread (no thread per pod), against the
    /// stored Service layer as it is at the start of the pass.
    fn observe_all(&mut self, views: &[RecordView]) -> Vec<Observation> {
        self.compared = Comparisons::default();
        self.layer = services::stored_header(&self.state_dir);
        self.drift.retain(views.iter().map(|v| v.key.as_str()));
        match aether_node::tour_here(|| views.iter().map(|v| self.observe(v)).collect()) {
            Ok(all) => all,
            Err(e) => views.iter().map(|_| Observation::Unverifiable(e.to_string())).collect(),
        }
    }

    fn comparisons(&self) -> Comparisons {
        self.compared
    }

    fn repair(&mut self, view: &RecordView) -> Result<(), NodeOpsError> {
        self.drift.forget(&view.key);
        Ok(repair::to_record(&self.state_dir, self.seen(view)?)?)
    }

    fn migrate(&mut self, view: &RecordView) -> Result<(), NodeOpsError> {
        self.drift.forget(&view.key);
        Ok(repair::migrate(&self.state_dir, self.seen(view)?)?)
    }

    fn repair_services(&mut self, view: &RecordView) -> Result<(), NodeOpsError> {
        self.drift.forget(&view.key);
        if !repair::services(&self.state_dir, self.seen(view)?)? {
            return Err(NodeOpsError::LayerAsStored(view.key.clone()));
        }
        Ok(())
    }

    fn collect(&mut self, view: &RecordView, _why: &Leftover) -> Result<(), NodeOpsError> {
        let record = self.records.get(&view.key).ok_or_else(|| NodeOpsError::RecordGone(view.key.clone()))?;
        let conf = self.conf_for(record).ok_or(NodeOpsError::NoConfiguration)?;
        let (id, ifname) = (record.container_id.clone(), record.ifname.clone());
        attachment::collect(&conf, |c, i| !(c == id && i == ifname))?;
        Ok(())
    }

    fn capture(&mut self, sandbox: &Sandbox, netns: &str, ips: &[String]) -> Result<(), NodeOpsError> {
        let conf = match &self.conf {
            Some(c) => c.clone(),
            None => self.chained_conf()?,
        };
        let conf = Self::pod_conf(&conf, sandbox, ips);
        let Some(cfg) = config::effective(&conf, Some(&sandbox.namespace)).map_err(NodeOpsError::Config)? else {
            return Ok(());
        };
        let pod = PodIdentity {
            namespace: Some(sandbox.namespace.clone()),
            name: Some(sandbox.name.clone()),
            uid: Some(sandbox.uid.clone()).filter(|u| !u.is_empty()),
        };
        let target = Target { network: &conf.name, container_id: &sandbox.id, ifname: POD_IFNAME };
        // Its Service layer is charged to the installer: not started over its memory limit.
        services::budget::layers_fit(&services::ServicesDir::new(&self.state_dir), 1)?;
        attachment::attach_in_place(&conf, target, &pod, netns, &cfg)?;
        Ok(())
    }
}
