//! Repairing a pod to its record, for the installer's reconciler: the pod's capture ruleset as
//! its record says (`to_record`), the current ruleset for a pod of an earlier release
//! (`migrate`), or the stored Service layer (`services`). Each takes the record as a pass read
//! it and, holding the pod's netns lock (no ADD, DEL or apply visit of that pod runs
//! meanwhile; other pods' ADDs and DELs run on) and the state lock shared (no GC), reads it
//! again: a record that went or changed since is left to whoever changed it. Then the pod's netns is opened and the ruleset programmed in one transaction (the table
//! replaced: conntrack, and so every open connection and its ct mark, is untouched).

use std::path::Path;

use aether_rules::capture;

use crate::services::{self, ServicesError};
use crate::state::{Lock, PodNetns, Record, Recorded, StateDir, StateError};

#[derive(Debug, thiserror::Error)]
pub enum RepairError {
    #[error("the record {0} went away before the repair (the pod's DEL came)")]
    RecordGone(String),
    #[error("the record {0} changed before the repair (a new ADD): left to it")]
    RecordChanged(String),
    #[error("the record {key} cannot be read: {why}")]
    RecordUnreadable { key: String, why: String },
    #[error("the record {0} does not say what ADD programmed")]
    NoCapture(String),
    #[error("the pod's netns is gone: {0}")]
    NetnsGone(String),
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    Netns(#[from] aether_netns::Error),
    #[error(transparent)]
    Rules(#[from] aether_rules::Error),
    #[error("the Service layer: {0}")]
    Services(#[from] ServicesError),
}

/// The pod's netns, open, and what holds it still: the state lock (shared) and the pod's netns
/// lock, held as long as the returned guards live.
struct Locked {
    netns: aether_netns::Netns,
    _pod: aether_netns::NetnsLock,
    _state: Lock,
}

/// `seen` as it is now, with its pod's netns open and locked (`Locked`).
fn locked(state_dir: &Path, seen: &Record) -> Result<(Record, Locked), RepairError> {
    let state = StateDir::new(state_dir);
    let lock = state.lock(false)?;
    let netns = match seen.open_netns()? {
        PodNetns::Live(ns) => ns,
        PodNetns::Gone(why) => return Err(RepairError::NetnsGone(why)),
    };
    let pod = netns.lock()?;
    let now = state
        .read(&seen.network, &seen.container_id, &seen.ifname)
        .map_err(|u| RepairError::RecordUnreadable { key: seen.key(), why: u.why })?
        .ok_or_else(|| RepairError::RecordGone(seen.key()))?;
    if now != *seen {
        return Err(RepairError::RecordChanged(seen.key()));
    }
    Ok((now, Locked { netns, _pod: pod, _state: lock }))
}

/// The pod's capture ruleset as its record holds it: an earlier release's pod is repaired to
/// what it holds (and migrated after, by `migrate`).
pub fn to_record(state_dir: &Path, seen: &Record) -> Result<(), RepairError> {
    let (now, Locked { netns, _pod, _state }) = locked(state_dir, seen)?;
    let cfg = now.capture.as_ref().ok_or_else(|| RepairError::NoCapture(seen.key()))?;
    let ruleset = match now.ruleset() {
        Recorded::Known(v) => capture::capture_ruleset_of(cfg, v)?,
        Recorded::Unknown(_) => capture::capture_ruleset(cfg)?,
    };
    netns.run(|| aether_rules::install(&ruleset, None))??;
    Ok(())
}

/// The current capture ruleset, then the record says so. Killed in between, the record still
/// names the earlier ruleset and the pod is found drifted from it: repaired to it, then
/// migrated again.
pub fn migrate(state_dir: &Path, seen: &Record) -> Result<(), RepairError> {
    let (now, Locked { netns, _pod, _state }) = locked(state_dir, seen)?;
    let cfg = now.capture.as_ref().ok_or_else(|| RepairError::NoCapture(seen.key()))?;
    // A record that names no ruleset, over a pod that holds the current one (a build from
    // before records named it): nothing to program, only the record to bring up to date.
    if now.ruleset.is_none() && matches!(crate::attachment::held_ruleset(&now, &netns), Ok(r) if r.is_current()) {
        if older_shape(&netns) {
            services::repair_pod_layer(state_dir, &netns, Some(cfg.divert_mark))?;
        }
        StateDir::new(state_dir).write(&Record { ruleset: Some(capture::RulesetVersion::CURRENT.number()), ..now })?;
        return Ok(());
    }
    let ruleset = capture::capture_ruleset(cfg)?;
    netns.run(|| aether_rules::install(&ruleset, None))??;
    // A Service layer of an earlier release's shape is rebuilt to the stored one, counts kept.
    if older_shape(&netns) {
        services::repair_pod_layer(state_dir, &netns, Some(cfg.divert_mark))?;
    }
    StateDir::new(state_dir).write(&now.migrated())?;
    Ok(())
}

/// The ruleset a pod awaiting migration holds, as people should read it: the one its record
/// names, or, for a record that names none, the one its kernel holds (see
/// [`crate::attachment::held_ruleset`]), said to be held under such a record.
pub fn migrating_from(record: &Record) -> String {
    let named = record.ruleset();
    if record.ruleset.is_none() {
        if let Ok(PodNetns::Live(ns)) = record.open_netns() {
            if let Ok(held) = crate::attachment::held_ruleset(record, &ns) {
                if held != named {
                    return format!("{held} under a record that names no ruleset");
                }
            }
        }
    }
    named.to_string()
}

/// Whether `netns` holds a Service layer of an earlier release's shape (`services::SHAPE`).
fn older_shape(netns: &aether_netns::Netns) -> bool {
    use aether_rules::services::{held_shape, SHAPE};
    matches!(netns.run(held_shape), Ok(Ok(Some(s))) if s < SHAPE)
}

/// Whether the pod's netns holds a Service layer of an earlier release's shape: its
/// differences from the stored layer are an upgrade's, for `migrate`, never drift.
pub fn holds_older_layer(record: &Record) -> bool {
    match record.open_netns() {
        Ok(PodNetns::Live(ns)) => older_shape(&ns),
        _ => false,
    }
}

/// The stored Service layer rebuilt in the pod's netns; false when it was found as stored
/// when compared again (an apply or ADD had brought it there).
pub fn services(state_dir: &Path, seen: &Record) -> Result<bool, RepairError> {
    let (now, Locked { netns, _pod, _state }) = locked(state_dir, seen)?;
    let mark = now.capture.as_ref().map(|c| c.divert_mark);
    Ok(!services::repair_pod_layer(state_dir, &netns, mark)?.is_empty())
}
