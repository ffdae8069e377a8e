//! The capture ruleset and the Service layer as data, and their programming in the current
//! network namespace.
//!
//! This crate knows nftables and policy routing; it knows nothing of CNI or of namespaces:
//! callers enter the pod netns (see `aether-netns`) and call these functions there.

pub mod capture;
pub mod family;
mod error;
pub mod model;
mod netlink;
pub mod nft;
pub mod route;
pub mod services;

pub use capture::{capture_ruleset, CaptureConfig, CaptureMode, DnsDivert};
pub use error::{Error, Result};
pub use family::Family;
pub use model::Ruleset;
pub use route::{PolicyRoute, PolicyRouteState};

/// The steps of `install`, in order; a test can make any of them fail to prove that what
/// the earlier steps made is removed again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Nftables,
    PolicyRule,
    LocalRoute,
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Step::Nftables => "nftables",
            Step::PolicyRule => "policy-rule",
            Step::LocalRoute => "local-route",
        })
    }
}

impl std::str::FromStr for Step {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "nftables" => Ok(Step::Nftables),
            "policy-rule" => Ok(Step::PolicyRule),
            "local-route" => Ok(Step::LocalRoute),
            _ => Err(format!("unknown step {s:?} (nftables, policy-rule, local-route)")),
        }
    }
}

/// Programs `rs` in the current netns: the nftables table in one transaction, then the
/// policy rule, then the local route. All or nothing: if a step fails, what the earlier
/// steps made is removed before the error is returned. `fail_before` injects a failure.
pub fn install(rs: &Ruleset, fail_before: Option<Step>) -> Result<()> {
    let gate = |step: Step| if fail_before == Some(step) { Err(Error::Injected(step)) } else { Ok(()) };
    gate(Step::Nftables)?;
    nft::program(&rs.table)?;
    let rule_created = match gate(Step::PolicyRule).and_then(|()| rs.policy_route.add_rule()) {
        Ok(created) => created,
        Err(e) => {
            let _ = nft::remove(&rs.table.name);
            return Err(e);
        }
    };
    if let Err(e) = gate(Step::LocalRoute).and_then(|()| rs.policy_route.add_route()) {
        if rule_created {
            let _ = rs.policy_route.del_rule();
        }
        let _ = nft::remove(&rs.table.name);
        return Err(e);
    }
    Ok(())
}

/// What `remove` found and deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Removed {
    pub table: bool,
    pub rule: bool,
    pub route: bool,
}

/// Removes everything `install` made, whatever is left of it; absence is not an error.
/// Every part is attempted; the first error is returned.
pub fn remove(table: &str, policy_route: &PolicyRoute) -> Result<Removed> {
    let t = nft::remove(table);
    let r = policy_route.del_rule();
    let o = policy_route.del_route();
    Ok(Removed { table: t?, rule: r?, route: o? })
}

/// Compares what the kernel holds with `rs`; an empty list means intact.
pub fn verify(rs: &Ruleset) -> Result<Vec<String>> {
    let mut diffs = match nft::kernel_view(&rs.table.name)? {
        None => vec![format!("table ip {} is missing", rs.table.name)],
        Some(actual) => nft::read::diff(&nft::expected_view(&rs.table), &actual),
    };
    let pr = &rs.policy_route;
    let state = pr.read_state()?;
    if !state.rule_present {
        diffs.push(format!(
            "policy rule 'fwmark {:#x} lookup {} priority {}' is missing",
            pr.fwmark, pr.table, pr.priority
        ));
    }
    if !state.route_present {
        diffs.push(format!("route 'local 0.0.0.0/0 dev lo table {}' is missing", pr.table));
    }
    diffs.extend(state.notes);
    Ok(diffs)
}
