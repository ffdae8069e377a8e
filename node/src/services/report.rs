//! What the node's Service layer holds, for the agent and operators: node counters (with the
//! folded counts of removed pods), demand, `services verify`, and `inspect`'s view of a pod.

use std::collections::BTreeMap;
use std::path::Path;

use aether_netns::Netns;
use aether_rules::services::{self as layer, Applied, COUNTERS};
use serde_json::{json, Value};

use super::apply::describe;
use super::plan::{mark_of, Action};
use super::{flat, ServicesDir, ServicesError, StoredLayer};
use crate::state::{PodNetns, Record, StateDir};
use crate::PodError;
use aether_rules::services::HeldLayer;

pub struct NodeCounters {
    pub generation: Option<u64>,
    pub totals: BTreeMap<String, u64>,
    pub folded: BTreeMap<String, u64>,
    pub pods: Vec<(Record, BTreeMap<String, u64>)>,
    /// Attachment records that cannot be read: their pods are not counted, and say so.
    pub unreadable: Vec<String>,
}

impl NodeCounters {
    pub fn to_json(&self) -> Value {
        let pods: Vec<Value> = self
            .pods
            .iter()
            .map(|(r, c)| {
                json!({
                    "containerID": r.container_id, "ifname": r.ifname, "netns": r.netns,
                    "podNamespace": r.pod_namespace, "podName": r.pod_name, "counters": c,
                })
            })
            .collect();
        let mut v =
            json!({"generation": self.generation, "node": self.totals, "removedPods": self.folded, "pods": pods});
        if !self.unreadable.is_empty() {
            v["unreadableRecords"] = json!(self.unreadable);
        }
        v
    }

    /// Prometheus text: connections by class, refusals by reason, node totals and per pod.
    pub fn to_prometheus(&self) -> String {
        let mut out = String::new();
        out.push_str("# HELP aether_cni_service_connections_total New captured connections by destination class (refusals included as their class).\n");
        out.push_str("# TYPE aether_cni_service_connections_total counter\n");
        let class = |name: &str| match name {
            "mesh" | "service" | "external" => name.to_string(),
            _ => "refused".to_string(),
        };
        let mut by_class: BTreeMap<String, u64> = BTreeMap::new();
        for (k, v) in &self.totals {
            *by_class.entry(class(k)).or_default() += v;
        }
        for (k, v) in &by_class {
            out.push_str(&format!("aether_cni_service_connections_total{{class=\"{k}\"}} {v}\n"));
        }
        out.push_str("# HELP aether_cni_service_refused_total Connections the Service layer refused (or, in count mode, would refuse), by reason.\n");
        out.push_str("# TYPE aether_cni_service_refused_total counter\n");
        for (k, v) in &self.totals {
            if let Some(reason) = k.strip_prefix("refused_") {
                out.push_str(&format!(
                    "aether_cni_service_refused_total{{reason=\"{}\"}} {v}\n",
                    reason.replace('_', "-")
                ));
            }
        }
        out.push_str("# HELP aether_cni_pod_service_connections_total Per-pod counts by counter.\n");
        out.push_str("# TYPE aether_cni_pod_service_connections_total counter\n");
        for (r, c) in &self.pods {
            for (k, v) in c {
                out.push_str(&format!(
                    "aether_cni_pod_service_connections_total{{container_id=\"{}\",namespace=\"{}\",pod=\"{}\",counter=\"{k}\"}} {v}\n",
                    r.container_id,
                    r.pod_namespace.as_deref().unwrap_or(""),
                    r.pod_name.as_deref().unwrap_or("")
                ));
            }
        }
        out.trim_end().to_string()
    }
}

/// Node totals (folded counts of removed pods + live pods) and per-pod rows. A pod whose
/// netns is gone or has no layer has no row.
pub fn node_counters(dir: &ServicesDir) -> Result<NodeCounters, ServicesError> {
    let _lock = dir.read_lock()?;
    // A pod is counted either in the accumulator or in its own row, never in neither (totals
    // never dip): a DEL folds it in before removing its layer, and a fold replaces
    // `accumulator.json`, so a reading during which it was replaced is made again. DELs wait
    // for no reading, but for the last of a few tries, made holding the lock of the folds
    // (a DEL per try is a drain: its DELs then wait one reading, not the totals dipping).
    let mut tries = 0;
    let (acc, pods, unreadable) = loop {
        tries += 1;
        let _folds = if tries == COUNTER_READINGS { Some(dir.counts_lock()?) } else { None };
        let before = dir.accumulator_id();
        let acc = dir.accumulator()?;
        let scan = StateDir::new(&dir.state).scan();
        let live = |records: Vec<Record>| {
            let mut pods = Vec::new();
            for r in records {
                let Ok(PodNetns::Live(ns)) = r.open_netns() else { continue };
                if let Ok(Ok(Some(c))) = ns.run(layer::counters) {
                    pods.push((r, c));
                }
            }
            pods
        };
        let pods = aether_netns::tour(|| live(scan.records)).map_err(ServicesError::Tour)?;
        if dir.accumulator_id() == before || tries == COUNTER_READINGS {
            break (acc, pods, scan.unreadable);
        }
    };
    let folded = acc.totals.clone();
    let mut totals: BTreeMap<String, u64> =
        COUNTERS.iter().map(|c| (c.to_string(), folded.get(*c).copied().unwrap_or(0))).collect();
    for (r, c) in &pods {
        // A pod a killed DEL already folded counts only its growth since.
        for (k, v) in acc.live_part(&r.key(), c) {
            *totals.entry(k).or_default() += v;
        }
    }
    let unreadable = unreadable.into_iter().map(|u| format!("{}: {}", u.file, u.why)).collect();
    let generation = dir.stored_header().ok().flatten().map(|(generation, _)| generation);
    Ok(NodeCounters { generation, totals, folded, pods, unreadable })
}

/// How many times `node_counters` reads the node while folds keep replacing the accumulator.
const COUNTER_READINGS: usize = 4;

/// The union of what the node's pods dialled, as `VIP:port/proto` (`[VIP]:port/proto` for
/// an IPv6 VIP).
pub fn node_demand(dir: &ServicesDir) -> Result<Vec<String>, ServicesError> {
    let _lock = dir.read_lock()?;
    let mut all = std::collections::BTreeSet::new();
    let scan = StateDir::new(&dir.state).scan();
    for u in &scan.unreadable {
        tracing::warn!(file = %u.file, why = %u.why, "an attachment record cannot be read; its pod is not included");
    }
    aether_netns::tour(|| {
        for r in scan.records {
            let Ok(PodNetns::Live(ns)) = r.open_netns() else { continue };
            if let Ok(Ok(d)) = ns.run(layer::demand) {
                all.extend(d);
            }
        }
    })
    .map_err(ServicesError::Tour)?;
    // `[fd00::1]:80/tcp` for an IPv6 VIP, as a socket address is written.
    Ok(all.into_iter().map(|(a, p, port)| format!("{}/{}", std::net::SocketAddr::new(a, port), p.name())).collect())
}

/// One pod's outcome in `services verify`.
pub struct PodVerified {
    pub container_id: String,
    pub netns: String,
    /// The differences found (empty: intact) and whether they were repaired.
    pub result: Result<(Vec<String>, Option<Applied>), PodError>,
    /// The pod held a layer a release before built (`Some(shape)`, `None` when its tables
    /// name none): rebuilt in this release's shape, counters kept, a migration, not drift.
    pub migrated: Option<Option<u64>>,
}

/// How a layer a release before built is named: its shape, or that its tables name none.
fn older_shape(shape: Option<u64>) -> String {
    match shape {
        Some(shape) => format!("shape {shape}"),
        None => "an unnamed layer".into(),
    }
}

/// Whether the pod's tables were built by a release before this one (a shape before this
/// one's, or tables that name nothing): `Some(shape)`.
fn built_before(held: &HeldLayer) -> Option<Option<u64>> {
    match held {
        HeldLayer::Unnamed { shape } => Some(*shape),
        HeldLayer::Named(n) if n.shape != layer::SHAPE => Some(Some(n.shape)),
        _ => None,
    }
}

pub struct VerifyReport {
    pub generation: Option<u64>,
    pub pods: Vec<PodVerified>,
}

impl VerifyReport {
    pub fn failed(&self) -> bool {
        self.pods.iter().any(|p| p.result.is_err())
    }

    pub fn to_json(&self) -> Value {
        let pods: Vec<Value> = self
            .pods
            .iter()
            .map(|p| {
                let mut v = json!({"containerID": p.container_id, "netns": p.netns});
                match (&p.result, p.migrated) {
                    (Ok(_), Some(shape)) => {
                        v["result"] = json!(format!("migrated (from {})", older_shape(shape)));
                        return v;
                    }
                    _ => {}
                }
                match &p.result {
                    Ok((d, _)) if d.is_empty() => v["result"] = json!("intact"),
                    Ok((d, repaired)) => {
                        v["result"] = json!(format!("repaired ({})", repaired.as_ref().map_or("-".into(), describe)));
                        v["differences"] = json!(d);
                    }
                    Err(e) => {
                        v["result"] = json!("failed");
                        v["error"] = json!(e.to_string());
                    }
                }
                v
            })
            .collect();
        json!({"generation": self.generation, "pods": pods})
    }
}

/// `services verify`: reads every recorded pod's layer back, compares it with the stored
/// snapshot, and repairs what differs (the engine's `bring_pod`, checked). Pods whose netns
/// is gone are left out. Exclusive of applies (the services lock), and of ADD, DEL and repairs
/// of each pod while it is visited (its netns lock).
pub fn verify_pods(dir: &ServicesDir) -> Result<VerifyReport, ServicesError> {
    let _lock = dir.lock(true)?;
    let stored = dir.stored_layer()?;
    let mut pods = Vec::new();
    let state = StateDir::new(&dir.state);
    let listed = super::engine::Listed::now(&state);
    let records = state.records();
    aether_netns::tour(|| verify_each(dir, (&state, &listed), records, stored.as_ref(), &mut pods))
        .map_err(ServicesError::Tour)?;
    Ok(VerifyReport { generation: stored.map(|s| s.generation), pods })
}

/// `verify_pods`' visit of each pod: the engine's, checked (`engine::bring_pod`).
fn verify_each(
    dir: &ServicesDir,
    (state, listed): (&StateDir, &super::engine::Listed),
    records: Vec<Record>,
    stored: Option<&StoredLayer>,
    pods: &mut Vec<PodVerified>,
) {
    let node_mark = dir.divert_mark();
    let off = none_stored();
    for r in records {
        let Ok(PodNetns::Live(ns)) = r.open_netns() else { continue };
        // A pod whose DEL came meanwhile is left out, as one already gone.
        let Ok(_pod) = super::engine::still_recorded(state, &r, &ns, listed) else { continue };
        let one = checked(stored.unwrap_or(&off), mark_of(&r, node_mark));
        let (result, migrated) = match super::engine::bring_pod(dir, &ns, one) {
            // A layer a release before built is rebuilt in this one's shape, counted as a
            // migration: its differences are the shape's, not drift.
            Ok(b) if b.action == Action::Migrate => (Ok((Vec::new(), b.applied)), built_before(&b.held)),
            Ok(b) => (Ok((b.differences, b.applied)), None),
            Err(e) => (Err(e), None),
        };
        pods.push(PodVerified { container_id: r.container_id, netns: r.netns, result, migrated });
    }
}

/// The layer a pod holds when no snapshot is stored: none (mode `off`).
fn none_stored() -> StoredLayer {
    StoredLayer::new(0, &layer::ServiceLayer::new(layer::LayerMode::Off), 0)
}

/// `services verify`'s and a repair's visit of one pod (its layer for `mark`): compared with
/// `stored`, brought there where it differs.
fn checked(stored: &StoredLayer, mark: u32) -> super::engine::OnePod<'_> {
    super::engine::OnePod { stored, mark, held: None, check: true, layer: None, charged: true }
}

/// `layer.bin`'s (generation, source digest): which stored layer is in force.
pub type LayerHeader = (u64, u64);

/// Which stored layer is in force: its (generation, source digest), from `layer.bin`'s
/// header and its journal, `None` when there is none. Every apply that stores another layer changes it; reading it costs one
/// small read, never the layer itself (the reconciler's signal that the stored layer is the
/// one it last compared a pod with).
pub fn stored_header(state_dir: &Path) -> Result<Option<LayerHeader>, ServicesError> {
    ServicesDir::new(state_dir).stored_header()
}

/// One pod's layer compared with the stored one (`services verify`'s comparison of one pod,
/// nothing repaired): its differences (empty: intact), prefixed `Service layer:`, and the
/// stored layer they were compared with ([`stored_header`]). Under the shared services lock:
/// never halfway through an apply's tour, so a pod the tour has not reached yet is not taken
/// for drift (the reconciler's look; never called holding a pod's netns lock, which an apply
/// holding the services lock may be waiting for). `divert_mark`: the pod's capture's (else
/// the node's).
pub fn verify_pod_layer(
    state_dir: &Path,
    netns: &Netns,
    divert_mark: Option<u32>,
) -> Result<(Vec<String>, Option<LayerHeader>), ServicesError> {
    let dir = ServicesDir::new(state_dir);
    // A layer ADD is still building (under the pod's lock) is not taken for drift; waited
    // for before the services lock, which an apply waiting for this pod may hold.
    netns.wait_unlocked().map_err(PodError::Netns)?;
    let _lock = dir.read_lock()?;
    compare_pod_layer(&dir, netns, divert_mark)
}

/// `verify_pod_layer` without the lock: the stored layer read as ADD reads it.
fn compare_pod_layer(
    dir: &ServicesDir,
    netns: &Netns,
    divert_mark: Option<u32>,
) -> Result<(Vec<String>, Option<LayerHeader>), ServicesError> {
    let stored = dir.stored_layer()?;
    let header = stored.as_ref().map(|s| (s.generation, s.source));
    let mark = divert_mark.unwrap_or_else(|| dir.divert_mark());
    let l = stored.as_ref().map_or_else(|| layer::ServiceLayer::new(layer::LayerMode::Off), |s| s.for_pod(mark));
    let diffs = flat(netns.run(|| layer::verify(&l)))?;
    Ok((diffs.into_iter().map(|d| format!("Service layer: {d}")).collect(), header))
}

/// Repairs one pod's layer to exactly the stored one, as `services verify` does (the engine's
/// `bring_pod`, checked: elements repaired in place, or the layer rebuilt, counters carried
/// over), if it still differs when compared again (an apply or ADD may have brought it there
/// since it was found different). With no snapshot stored, a layer the pod holds is removed.
/// A layer a release before built is migrated. Returns the differences it repaired (empty:
/// none were left; a migration is named as one). The caller holds the pod's netns lock, so no ADD, DEL or apply visit of
/// the pod runs meanwhile.
/// `divert_mark`: the pod's capture's (else the node's).
pub fn repair_pod_layer(
    state_dir: &Path,
    netns: &Netns,
    divert_mark: Option<u32>,
) -> Result<Vec<String>, ServicesError> {
    // Compared again without the services lock: the caller holds the pod's netns lock.
    let dir = ServicesDir::new(state_dir);
    let off = none_stored();
    let mark = divert_mark.unwrap_or_else(|| dir.divert_mark());
    let b = super::engine::bring_while_moved(|_| {
        let stored = dir.stored_layer()?;
        Ok(super::engine::bring_pod(&dir, netns, checked(stored.as_ref().unwrap_or(&off), mark)))
    })?;
    if b.action == Action::Migrate {
        let shape = built_before(&b.held).flatten();
        return Ok(vec![format!(
            "Service layer: {} built by an earlier release, rebuilt in shape {} (a migration, counters kept)",
            older_shape(shape),
            layer::SHAPE
        )]);
    }
    Ok(b.differences.into_iter().map(|d| format!("Service layer: {d}")).collect())
}

/// In a word, whether a pod's Service layer is what the stored snapshot says (`inspect`'s list).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerVerdict {
    /// No snapshot stored yet: the pod rightly has no layer.
    NoSnapshot,
    Intact {
        generation: u64,
    },
    Differs {
        generation: u64,
        differences: usize,
    },
    /// The pod holds a layer a release before built (`shape`: `None` when its tables name
    /// none): the next apply, `services verify` or the reconciler rebuilds it in this
    /// release's shape, counters kept. An upgrade's work, not drift.
    MigrationPending {
        generation: u64,
        shape: Option<u64>,
    },
    /// The stored snapshot or the kernel could not be read.
    Unknown,
}

impl LayerVerdict {
    pub fn is_intact(&self) -> bool {
        matches!(self, LayerVerdict::NoSnapshot | LayerVerdict::Intact { .. } | LayerVerdict::MigrationPending { .. })
    }
}

impl std::fmt::Display for LayerVerdict {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            LayerVerdict::NoSnapshot => write!(f, "none (no snapshot yet)"),
            LayerVerdict::Intact { generation } => write!(f, "intact (generation {generation})"),
            LayerVerdict::Differs { generation, differences } => {
                write!(
                    f,
                    "NOT INTACT ({} from generation {generation})",
                    crate::text::plural(*differences, "difference")
                )
            }
            LayerVerdict::MigrationPending { generation, shape } => write!(
                f,
                "migration pending ({} built by an earlier release, to generation {generation} in shape {})",
                older_shape(*shape),
                layer::SHAPE
            ),
            LayerVerdict::Unknown => write!(f, "unknown (cannot read)"),
        }
    }
}

/// For `inspect`: the pod's Service layer in a few readable lines (what the stored snapshot
/// says it should be, whether the kernel holds exactly that, and its counters), and the
/// verdict in a word.
pub fn describe_pod_layer(state_dir: &Path, netns: &Netns, divert_mark: Option<u32>) -> (Vec<String>, LayerVerdict) {
    let dir = ServicesDir::new(state_dir);
    let mut out = Vec::new();
    // Not halfway through a layer ADD is still building.
    if let Err(e) = netns.wait_unlocked() {
        return (vec![format!("the pod's netns cannot be locked: {e}")], LayerVerdict::Unknown);
    }
    let stored = match dir.stored_layer() {
        Ok(s) => s,
        Err(e) => return (vec![format!("stored snapshot: {e}")], LayerVerdict::Unknown),
    };
    let mut verdict = LayerVerdict::NoSnapshot;
    match &stored {
        None => out.push("no snapshot applied on this node yet (the agent has not run `services apply`)".into()),
        Some(stored) => {
            let l = stored.for_pod(divert_mark.unwrap_or_else(|| dir.divert_mark()));
            let tables: Vec<String> =
                l.families().iter().map(|f| format!("table {} {}", f.nft_name(), layer::TABLE)).collect();
            out.push(format!(
                "snapshot generation {}, mode {}: {} ranges, {} mesh VIPs, {} Service ports{}",
                stored.generation,
                l.mode,
                l.ranges.len(),
                l.mesh_vips.len(),
                l.ports.len(),
                if tables.is_empty() { String::new() } else { format!(" ({})", tables.join(" and ")) }
            ));
            let mark = l.divert_mark;
            let held = flat(netns.run(layer::held));
            match &held {
                Ok(HeldLayer::Named(n)) if *n == stored.named(mark) => {
                    out.push(format!("the pod's tables name generation {} (the stored layer)", n.id.generation))
                }
                Ok(HeldLayer::Named(n)) if n.shape == layer::SHAPE => out
                    .push(format!("the pod's tables name {n} (not the stored layer: the next apply brings it there)")),
                Ok(h) => match built_before(h) {
                    Some(shape) => out.push(format!(
                        "the pod holds {} built by an earlier release: its migration to shape {} is pending \
                         (the next apply, `services verify` or the reconciler rebuilds it, counters kept)",
                        older_shape(shape),
                        layer::SHAPE
                    )),
                    None => out.push("the pod holds no Service layer (the next apply builds it)".into()),
                },
                Err(e) => out.push(format!("what the pod's tables name cannot be read: {e}")),
            }
            let generation = stored.generation;
            verdict = LayerVerdict::Unknown;
            if let Some(shape) = held.as_ref().ok().and_then(built_before) {
                verdict = LayerVerdict::MigrationPending { generation, shape };
            }
            match netns.run(|| layer::verify(&l)) {
                _ if matches!(verdict, LayerVerdict::MigrationPending { .. }) => {}
                Ok(Ok(d)) if d.is_empty() => {
                    verdict = LayerVerdict::Intact { generation };
                    out.push("kernel: intact (matches the snapshot)".into())
                }
                Ok(Ok(d)) => {
                    verdict = LayerVerdict::Differs { generation, differences: d.len() };
                    out.push("kernel: NOT as the snapshot says:".into());
                    out.extend(d.into_iter().map(|x| format!("  - {x}")));
                }
                Ok(Err(e)) => out.push(format!("kernel: cannot read the layer: {e}")),
                Err(e) => out.push(format!("kernel: cannot enter the netns: {e}")),
            }
        }
    }
    match netns.run(layer::counters) {
        Ok(Ok(Some(c))) => {
            let text: Vec<String> = c.iter().map(|(k, v)| format!("{k}={v}")).collect();
            out.push(format!("counters: {}", text.join(" ")));
        }
        Ok(Ok(None)) => out.push(format!("no {} table (ip or ip6) is present", layer::TABLE)),
        Ok(Err(e)) => out.push(format!("counters: {e}")),
        Err(e) => out.push(format!("counters: {e}")),
    }
    match netns.run(layer::demand) {
        Ok(Ok(d)) if !d.is_empty() => {
            let text: Vec<String> =
                d.iter().map(|(vip, proto, port)| format!("{vip} {} {port}", proto.name())).collect();
            out.push(format!("dialled: {}", text.join(", ")));
        }
        _ => {}
    }
    (out, verdict)
}
