//! The plugin's one error type: a CNI error, with the spec's code, that prints as the
//! spec's JSON on stdout; and the one place the node library's errors get their codes.

use aether_node::attachment::AttachmentError;
use aether_node::config::ConfigError;
use aether_node::state::StateError;
use serde_json::json;

/// Well-known CNI error codes (spec §6), plus this plugin's own (100 and up).
#[allow(dead_code)] // the spec's table, whole
pub mod code {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const UNSUPPORTED_FIELD: u32 = 2;
    pub const CONTAINER_UNKNOWN: u32 = 3;
    pub const INVALID_ENV: u32 = 4;
    pub const IO_FAILURE: u32 = 5;
    pub const DECODE_FAILURE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    pub const TRY_AGAIN: u32 = 11;
    pub const NOT_AVAILABLE: u32 = 50;
    /// CHECK found the capture ruleset missing or changed.
    pub const CAPTURE_NOT_INTACT: u32 = 100;
    /// The node's kernel lacks a feature the ruleset needs (named, with the release that has
    /// it): no retry helps until the node's kernel or its modules change.
    pub const KERNEL_LACKS_FEATURE: u32 = 101;
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{msg}{}", if details.is_empty() { String::new() } else { format!(": {details}") })]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

impl CniError {
    pub fn new(code: u32, msg: impl Into<String>) -> Self {
        CniError { code, msg: msg.into(), details: String::new() }
    }

    pub fn with_details(mut self, details: impl Into<String>) -> Self {
        self.details = details.into();
        self
    }

    pub fn invalid_config(msg: impl Into<String>) -> Self {
        Self::new(code::INVALID_CONFIG, msg)
    }

    pub fn invalid_env(var: &str, why: impl std::fmt::Display) -> Self {
        Self::new(code::INVALID_ENV, format!("environment variable {var} {why}"))
    }

    /// The JSON the spec wants on stdout.
    pub fn to_json(&self, cni_version: &str) -> serde_json::Value {
        let mut v = json!({ "cniVersion": cni_version, "code": self.code, "msg": self.msg });
        if !self.details.is_empty() {
            v["details"] = json!(self.details);
        }
        v
    }
}

impl From<aether_netns::Error> for CniError {
    fn from(e: aether_netns::Error) -> Self {
        use aether_netns::Error as E;
        match &e {
            E::NotFound { .. } => {
                CniError::new(code::CONTAINER_UNKNOWN, "the container's network namespace does not exist")
                    .with_details(e.to_string())
            }
            E::HostNamespace { .. } | E::NotANamespace { .. } => CniError::invalid_env("CNI_NETNS", e.to_string()),
            _ => CniError::new(code::IO_FAILURE, "cannot work in the container's network namespace")
                .with_details(e.to_string()),
        }
    }
}

impl From<aether_rules::Error> for CniError {
    fn from(e: aether_rules::Error) -> Self {
        match &e {
            aether_rules::Error::InvalidConfig(m) => CniError::invalid_config(m.clone()),
            aether_rules::Error::MissingFeature { .. } => {
                CniError::new(code::KERNEL_LACKS_FEATURE, "this node's kernel lacks what the pod's capture needs")
                    .with_details(e.to_string())
            }
            _ => CniError::new(code::IO_FAILURE, "programming the pod's capture failed").with_details(e.to_string()),
        }
    }
}

impl From<ConfigError> for CniError {
    fn from(e: ConfigError) -> Self {
        let code = match e {
            ConfigError::UnsupportedVersion { .. } => code::INCOMPATIBLE_VERSION,
            ConfigError::NotJson { .. } | ConfigError::NotAnObject => code::DECODE_FAILURE,
            ConfigError::UnknownField { .. } => code::UNSUPPORTED_FIELD,
            ConfigError::Missing { .. }
            | ConfigError::BadValue { .. }
            | ConfigError::BadAnnotation { .. }
            | ConfigError::Node(_)
            | ConfigError::Pod(_) => code::INVALID_CONFIG,
        };
        CniError::new(code, e.to_string()).with_details(e.details().unwrap_or_default())
    }
}

impl From<StateError> for CniError {
    fn from(e: StateError) -> Self {
        let code = match e {
            StateError::Busy { .. } => code::TRY_AGAIN,
            _ => code::IO_FAILURE,
        };
        let details = e.io_source().map(|s| s.to_string()).unwrap_or_default();
        CniError::new(code, e.to_string()).with_details(details)
    }
}

impl From<AttachmentError> for CniError {
    fn from(e: AttachmentError) -> Self {
        let msg = e.to_string();
        match e {
            AttachmentError::Netns(e) => e.into(),
            AttachmentError::Rules(e) => e.into(),
            AttachmentError::State(e) => e.into(),
            AttachmentError::RecordedNetns { source, .. } => {
                CniError::new(code::IO_FAILURE, msg).with_details(source.to_string())
            }
            AttachmentError::ServiceLayer(s) => CniError::new(code::IO_FAILURE, msg).with_details(s.to_string()),
            AttachmentError::Injected(_) => CniError::new(code::IO_FAILURE, msg),
            // Only an in-place capture asks this (the netns given is another pod's).
            AttachmentError::NetnsOwned { .. } => CniError::new(code::INVALID_ENV, msg),
            AttachmentError::Collect(kept) => {
                let details: Vec<String> =
                    kept.into_iter().map(|k| format!("{} (kept): {}", k.item, CniError::from(k.error))).collect();
                CniError::new(code::IO_FAILURE, msg).with_details(details.join("\n"))
            }
        }
    }
}
