//! aether-node: what an aether-cni node does, shared by the CNI plugin (the binary) and the
//! installer's daemon.
//!
//! - `config`: the network configuration (one conflist entry) and a pod's annotations, turned
//!   into the capture configuration `aether-rules` builds from;
//! - `state`: the node state directory (attachment records, the lock, the readiness marker);
//! - `attachment`: a pod's capture as operations over (configuration, pod, netns): attach
//!   (what ADD does), detach (DEL), verify (CHECK), collect (GC);
//! - `drift`: a recorded pod's capture and Service layer compared again and again (the
//!   installer's reconciler), cheaply while its netns's nftables generation stands still;
//! - `repair`: a recorded pod repaired to its record (its ruleset, the current one for a pod
//!   of an earlier release, its Service layer): locked, read again, programmed;
//! - `services`: the Service layer's node side (the stored snapshot, `layer.bin`, apply to
//!   every pod, the folded counts, counters/demand/verify reports);
//! - `memcg`: this process's memory cgroup (v1 or v2), its limit and usage, and whether
//!   more kernel memory fits (what the Service layer's work checks before it starts);
//! - `probe`: whether this kernel can hold the rulesets (STATUS, `doctor`, readiness).
//!
//! It must not know the CNI protocol: no `CNI_*` variables, stdin, stdout, result JSON or
//! error codes (the binary maps these errors to codes in one place), nor the installer's
//! files, HTTP or metrics. It depends on `aether-rules` and `aether-netns` only, never upward.

pub mod attachment;
pub mod config;
pub mod drift;
pub mod memcg;
pub mod probe;
pub mod repair;
pub mod services;
pub mod state;
pub mod text;

/// Visits many pods' netns in turn on this thread (entering each and back; see
/// `aether_netns`), as the reconciler's pass and the CNI commands do.
pub use aether_netns::tour_here;

/// Work in one pod's network namespace that did not happen.
#[derive(Debug, thiserror::Error)]
pub enum PodError {
    /// The namespace is gone (or its path now names another one): nothing may act there.
    #[error("{0}")]
    Gone(String),
    /// It could not be entered.
    #[error(transparent)]
    Netns(aether_netns::Error),
    /// The kernel refused (or could not answer) what was asked there.
    #[error(transparent)]
    Kernel(aether_rules::Error),
    /// Not started: what it would charge does not fit under this process's memory limit
    /// (the pod keeps the whole layer it had).
    #[error(transparent)]
    OverBudget(memcg::OverBudget),
}
