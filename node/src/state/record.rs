//! Attachment records: what ADD programmed in which namespace, for DEL, GC, CHECK, `inspect`
//! and the reconciler; read back whatever release wrote them.

use aether_netns::Netns;
use aether_rules::RulesetVersion;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::RECORD_VERSION;

/// Who a pod is, as the runtime names it (`K8S_POD_*` in CNI_ARGS, or the CRI's metadata).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodIdentity {
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub uid: Option<String>,
}

/// Why a stored record cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("not JSON: {0}")]
    NotJson(serde_json::Error),
    #[error("not a JSON object")]
    NotAnObject,
    #[error("\"version\" is not a number")]
    VersionNotANumber,
    #[error("capture.mode: {0}")]
    CaptureMode(serde_json::Error),
    #[error("version {version} record: {source}")]
    Fields { version: u64, source: serde_json::Error },
}

/// The identity of the network namespace ADD programmed: its nsfs device and inode, and its
/// cookie (the inode alone is handed to the next namespace once this one is freed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetnsIdentity {
    pub dev: u64,
    pub ino: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cookie: Option<u64>,
}

impl NetnsIdentity {
    pub fn of(ns: &Netns) -> Self {
        Self::with_cookie(ns, ns.cookie().ok())
    }

    /// `ns`'s identity with its cookie read already, on a visit made for other work
    /// (`aether_netns::current_cookie`): ADD reads it while it programs the pod.
    pub fn with_cookie(ns: &Netns, cookie: Option<u64>) -> Self {
        let id = ns.id();
        NetnsIdentity { dev: id.dev, ino: id.ino, cookie }
    }

    /// Whether `ns` is this namespace (the cookie compared when both sides have one).
    pub fn matches(&self, ns: &Netns) -> bool {
        let id = ns.id();
        if (id.dev, id.ino) != (self.dev, self.ino) {
            return false;
        }
        match (self.cookie, ns.cookie().ok()) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    /// [`RECORD_VERSION`] when written; 0 for records written before versioning.
    #[serde(default)]
    pub version: u32,
    pub network: String,
    pub container_id: String,
    pub ifname: String,
    pub netns: String,
    /// The namespace ADD programmed (absent in version 0 records).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns_id: Option<NetnsIdentity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// [`config_digest`] of `capture`: for people and logs; CHECK compares `capture` itself.
    #[serde(default)]
    pub config_digest: String,
    /// The capture configuration ADD programmed, so DEL, GC, CHECK and `inspect` know it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capture: Option<aether_rules::CaptureConfig>,
    /// The shape of the capture ruleset ADD (or the reconciler's migration) programmed, an
    /// [`aether_rules::RulesetVersion`] number: CHECK compares the pod with that shape. Absent
    /// in the records of the releases before it was written, which all programmed the first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ruleset: Option<u32>,
    /// The ruleset the pod held before the reconciler migrated it to `ruleset` (for
    /// `inspect`); absent for a pod that holds what its ADD programmed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrated_from: Option<u32>,
    /// Capture fields the stored record lacked (an older plugin's), read as their defaults.
    #[serde(skip)]
    pub defaulted: Vec<String>,
}

/// The capture ruleset a record says its pod holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// A shape this build can make and compare with.
    Known(RulesetVersion),
    /// A later release's shape (the node was rolled back): this build cannot make it.
    Unknown(u32),
}

impl Recorded {
    /// Whether the pod holds the shape this build's ADD programs (if not, its migration to it
    /// is pending).
    pub fn is_current(self) -> bool {
        self == Recorded::Known(RulesetVersion::CURRENT)
    }
}

impl std::fmt::Display for Recorded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Recorded::Known(v) => write!(f, "{v}"),
            Recorded::Unknown(n) => write!(f, "capture ruleset {n} (a later release's, unknown to this one)"),
        }
    }
}

/// Where a record's pod netns stands now.
#[derive(Debug)]
pub enum PodNetns {
    /// The namespace ADD programmed, still at the recorded path.
    Live(Netns),
    /// Gone: the path names nothing, something that is not a namespace, or another namespace
    /// than the one ADD programmed (a path reused, a PID reused). Nothing may act on it.
    Gone(String),
}

impl Record {
    /// A record for what ADD just programmed in the netns `netns_id` (at `netns_path`).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        network: &str,
        container_id: &str,
        ifname: &str,
        netns_id: NetnsIdentity,
        netns_path: &str,
        pod: &PodIdentity,
        capture: aether_rules::CaptureConfig,
    ) -> Record {
        Record {
            version: RECORD_VERSION,
            network: network.into(),
            container_id: container_id.into(),
            ifname: ifname.into(),
            netns: netns_path.into(),
            netns_id: Some(netns_id),
            pod_namespace: pod.namespace.clone(),
            pod_name: pod.name.clone(),
            pod_uid: pod.uid.clone(),
            config_digest: config_digest(&capture),
            capture: Some(capture),
            ruleset: Some(RulesetVersion::CURRENT.number()),
            migrated_from: None,
            defaulted: Vec::new(),
        }
    }

    /// A record for tests: pod `container_id` of namespace `shop` in network
    /// `k8s-pod-network`, its netns at `netns` with no identity, no capture, the current
    /// ruleset. Tests set what they need over it.
    #[cfg(test)]
    pub(crate) fn bare(container_id: &str, netns: &str) -> Record {
        Record {
            version: RECORD_VERSION,
            network: "k8s-pod-network".into(),
            container_id: container_id.into(),
            ifname: "eth0".into(),
            netns: netns.into(),
            netns_id: None,
            pod_namespace: Some("shop".into()),
            pod_name: Some(container_id.into()),
            pod_uid: None,
            config_digest: "0".into(),
            capture: None,
            ruleset: Some(RulesetVersion::CURRENT.number()),
            migrated_from: None,
            defaulted: Vec::new(),
        }
    }

    /// This record once its pod holds the current ruleset in place of the one it names.
    pub fn migrated(&self) -> Record {
        Record {
            ruleset: Some(RulesetVersion::CURRENT.number()),
            migrated_from: Some(self.ruleset.unwrap_or(RulesetVersion::FIRST.number())),
            ..self.clone()
        }
    }

    /// The shape of capture ruleset the pod holds, as the record says: a record without one
    /// is of a release that programmed the first.
    pub fn ruleset(&self) -> Recorded {
        let n = self.ruleset.unwrap_or(RulesetVersion::FIRST.number());
        RulesetVersion::known(n).map_or(Recorded::Unknown(n), Recorded::Known)
    }

    /// Whether `ns` is the namespace this record's ADD programmed. A version 0 record has no
    /// identity: then any namespace at its path is taken for the pod's.
    pub fn owns(&self, ns: &Netns) -> bool {
        self.netns_id.is_none_or(|id| id.matches(ns))
    }

    /// Opens the recorded netns if it is still the pod's (see [`PodNetns`]). Errors other
    /// than "not there" (e.g. permission) are returned: the record must then be kept.
    pub fn open_netns(&self) -> Result<PodNetns, aether_netns::Error> {
        self.open_netns_at(&self.netns)
    }

    /// Like [`Record::open_netns`], at `path` (a DEL's `CNI_NETNS`).
    pub fn open_netns_at(&self, path: &str) -> Result<PodNetns, aether_netns::Error> {
        use aether_netns::Error as E;
        match Netns::open_foreign(path) {
            Ok(ns) if self.owns(&ns) => Ok(PodNetns::Live(ns)),
            Ok(ns) => Ok(PodNetns::Gone(format!(
                "{path} is now another network namespace ({}) than the one ADD programmed",
                ns.id()
            ))),
            Err(e @ (E::NotFound { .. } | E::NotANamespace { .. } | E::HostNamespace { .. })) => {
                Ok(PodNetns::Gone(e.to_string()))
            }
            Err(e) => Err(e),
        }
    }

    /// The key of this attachment, as people read it.
    pub fn key(&self) -> String {
        format!("{}/{}/{}", self.network, self.container_id, self.ifname)
    }
}

/// Parses a stored record of any version: unknown fields are ignored, missing capture
/// fields take the defaults the capture configuration has always had (named in
/// `defaulted`), and what cannot be read is an error saying why.
pub fn parse_record(bytes: &[u8]) -> Result<Record, RecordError> {
    let mut v: Value = serde_json::from_slice(bytes).map_err(RecordError::NotJson)?;
    let obj = v.as_object_mut().ok_or(RecordError::NotAnObject)?;
    let version = obj.get("version").map_or(Some(0), Value::as_u64).ok_or(RecordError::VersionNotANumber)?;
    let mut defaulted = Vec::new();
    if let Some(Value::Object(capture)) = obj.get_mut("capture") {
        let mode = capture.get("mode").cloned().map(serde_json::from_value).transpose();
        let mode = mode.map_err(RecordError::CaptureMode)?.unwrap_or(aether_rules::CaptureMode::RedirectAll);
        let Value::Object(defaults) =
            serde_json::to_value(aether_rules::CaptureConfig::new(mode)).expect("capture config serializes")
        else {
            unreachable!("a struct serializes to an object")
        };
        for (k, d) in defaults {
            if !capture.contains_key(&k) {
                defaulted.push(k.clone());
                capture.insert(k, d);
            }
        }
    }
    let mut rec: Record = serde_json::from_value(v).map_err(|source| RecordError::Fields { version, source })?;
    rec.defaulted = defaulted;
    Ok(rec)
}

/// A stable digest of a capture configuration: FNV-1a of its JSON with keys sorted, so it
/// depends on the values alone (not on field order, nor on `Debug` formatting).
pub fn config_digest(cfg: &aether_rules::CaptureConfig) -> String {
    fn canonical(v: &Value, out: &mut String) {
        match v {
            Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                out.push('{');
                for (i, k) in keys.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&Value::String(k.clone()).to_string());
                    out.push(':');
                    canonical(&m[k], out);
                }
                out.push('}');
            }
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    canonical(x, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut text = String::new();
    canonical(&serde_json::to_value(cfg).expect("capture config serializes"), &mut text);
    fnv1a(&text)
}

pub(super) fn fnv1a(text: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}
