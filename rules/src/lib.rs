//! The capture ruleset and the Service layer as data, and their programming in the current
//! network namespace.
//!
//! This crate knows nftables and policy routing; it knows nothing of CNI or of namespaces:
//! callers enter the pod netns (see `aether-netns`) and call these functions there.
//!
//! Its files are layered, each importing only from the layers below it: `family`; the model
//! (`model`: a ruleset and its policy routes as data); the expressions (`nft::expr`); the
//! feature table (`features`: what each expression needs of the kernel); the errors
//! (`error`, which name missing features); then what programs and reads the kernel
//! (`netlink`, `route`, `nft`, `conntrack`) and the builders (`capture`, `services`).

pub mod capture;
pub mod conntrack;
mod error;
pub mod family;
pub mod features;
pub mod model;
mod netlink;
pub mod nft;
pub mod route;
pub mod services;
pub mod socket_lb;

pub use capture::{capture_ruleset, capture_ruleset_of, CaptureConfig, CaptureMode, DnsDivert, RulesetVersion};
pub use error::{Error, Result, Step};
pub use family::Family;
pub use model::{Half, PolicyRoute, Ruleset};
pub use route::PolicyRouteState;

/// Programs `rs` in the current netns: every family's table in one nftables transaction,
/// then each family's policy rule and local route. All or nothing: if a step fails, what the
/// earlier steps made is removed before the error is returned. `fail_before` injects a
/// failure (at the step's first family).
pub fn install(rs: &Ruleset, fail_before: Option<Step>) -> Result<()> {
    let gate = |step: Step| if fail_before == Some(step) { Err(Error::Injected(step)) } else { Ok(()) };
    gate(Step::Nftables)?;
    let tables: Vec<&model::Table> = rs.tables().collect();
    nft::program_tables(&tables)?;
    // What this call created, undone in reverse on a failure.
    let mut made: Vec<(&PolicyRoute, bool, bool)> = Vec::new();
    // One rtnetlink socket for every rule and route.
    let result = route::open().and_then(|mut sock| {
        for half in &rs.halves {
            let pr = &half.policy_route;
            gate(Step::PolicyRule)?;
            let rule = pr.add_rule_on(&mut sock)?;
            made.push((pr, rule, false));
            gate(Step::LocalRoute)?;
            made.last_mut().expect("pushed").2 = pr.add_route_on(&mut sock)?;
        }
        Ok(())
    });
    if result.is_err() {
        for (pr, rule, route) in made.into_iter().rev() {
            if route {
                let _ = pr.del_route();
            }
            if rule {
                let _ = pr.del_rule();
            }
        }
        for t in &tables {
            let _ = nft::remove(t.family, &t.name);
        }
    }
    result
}

/// What `remove` found and deleted (in any family).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Removed {
    pub table: bool,
    pub rule: bool,
    pub route: bool,
}

/// Removes everything `install` made, whatever is left of it: for each of `policy_routes`,
/// the table `table` of its family, its rule and its route. Absence is not an error, nor is
/// a family the netns has no support for. Every part is attempted; the first error is
/// returned.
pub fn remove(table: &str, policy_routes: &[PolicyRoute]) -> Result<Removed> {
    let mut removed = Removed::default();
    let mut first_err = None;
    let mut note = |r: Result<bool>, flag: &mut bool| match r {
        Ok(b) => *flag |= b,
        Err(e) if unsupported(&e) => {}
        Err(e) => {
            first_err.get_or_insert(e);
        }
    };
    // One rtnetlink socket for every rule and route.
    let mut sock = route::open().map_err(|e| note(Err(e), &mut removed.rule)).ok();
    for pr in policy_routes {
        note(nft::remove(pr.family, table), &mut removed.table);
        if let Some(sock) = &mut sock {
            note(pr.del_rule_on(sock), &mut removed.rule);
            note(pr.del_route_on(sock), &mut removed.route);
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(removed),
    }
}

/// The kernel has no such family here (IPv6 disabled, say): nothing of it can exist.
fn unsupported(e: &Error) -> bool {
    let source = match e {
        Error::Nftables { source, .. }
        | Error::Transaction { source, .. }
        | Error::MissingFeature { source, .. }
        | Error::Route { source, .. } => source,
        _ => return false,
    };
    source.raw_os_error() == Some(libc::EAFNOSUPPORT)
}

/// Compares what the kernel holds with `rs`; an empty list means intact. Differences in the
/// IPv6 half say so; the IPv4 half's read as they always have.
pub fn verify(rs: &Ruleset) -> Result<Vec<String>> {
    let mut diffs = Vec::new();
    for half in &rs.halves {
        let (t, pr) = (&half.table, &half.policy_route);
        let prefix = match t.family {
            Family::Ipv4 => String::new(),
            Family::Ipv6 => format!("{} half: ", t.family),
        };
        let mut found = match nft::kernel_view(t.family, &t.name)? {
            None => vec![format!("table {} {} is missing", t.family.nft_name(), t.name)],
            Some(actual) => nft::read::diff(&nft::expected_view(t), &actual),
        };
        found.extend(route_differences(pr)?);
        diffs.extend(found.into_iter().map(|d| format!("{prefix}{d}")));
    }
    Ok(diffs)
}

/// The policy-routing part of [`verify`] alone, for each of `policy_routes` (a record's),
/// worded as `verify` words it: the rule and the route are not nftables, so no nftables
/// generation says they are unchanged; reading them back is two small dumps per family.
pub fn verify_policy_routes(policy_routes: &[PolicyRoute]) -> Result<Vec<String>> {
    let mut diffs = Vec::new();
    for pr in policy_routes {
        let prefix = match pr.family {
            Family::Ipv4 => String::new(),
            Family::Ipv6 => format!("{} half: ", pr.family),
        };
        diffs.extend(route_differences(pr)?.into_iter().map(|d| format!("{prefix}{d}")));
    }
    Ok(diffs)
}

fn route_differences(pr: &PolicyRoute) -> Result<Vec<String>> {
    let state = pr.read_state()?;
    let mut found = Vec::new();
    if !state.rule_present {
        found.push(format!("policy rule '{}' is missing", pr.describe_policy_rule()));
    }
    if !state.route_present {
        found.push(format!("route '{}' is missing", pr.describe_route()));
    }
    found.extend(state.notes);
    Ok(found)
}
