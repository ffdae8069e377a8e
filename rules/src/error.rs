use std::io;

/// Everything that can go wrong building, programming or reading back a ruleset.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The requested configuration cannot be turned into a safe ruleset.
    #[error("invalid capture configuration: {0}")]
    InvalidConfig(String),
    /// The nftables transaction (or a dump) failed in the kernel.
    #[error("nftables {op} failed: {source}")]
    Nftables { op: &'static str, source: io::Error },
    /// The kernel refused one object of an nftables transaction; nothing of it was applied.
    #[error("nftables refused {object}: {source}")]
    Transaction { object: String, source: io::Error },
    /// The kernel refused objects because it lacks features they need (an expression type,
    /// a chain type, a module not built or not loadable); nothing of the transaction was
    /// applied.
    #[error(
        "nftables refused {object}: this kernel ({release}) lacks {} (the ruleset needs Linux {}.{} or later with these built) [{source}]",
        crate::features::List(missing), crate::features::minimum_kernel().0, crate::features::minimum_kernel().1
    )]
    MissingFeature {
        object: String,
        missing: Vec<&'static crate::features::Feature>,
        release: String,
        source: io::Error,
    },
    /// A transaction built from a reading of a pod's Service layer was refused because the
    /// layer's tables no longer named what they named when read (`named`): another writer
    /// changed the layer first. Nothing of the transaction was applied.
    #[error("the Service layer changed since it was read (its tables no longer name {named}); nothing was applied")]
    LayerMoved { named: String },
    /// A policy-routing request (ip rule / ip route) failed in the kernel.
    #[error("policy routing {op} failed: {source}")]
    Route { op: &'static str, source: io::Error },
    /// Reading or changing conntrack's table (ctnetlink) failed in the kernel.
    #[error("conntrack {op} failed: {source}")]
    Conntrack { op: &'static str, source: io::Error },
    /// A step was made to fail on purpose (tests of ADD's all-or-nothing guarantee).
    #[error("injected failure at step {0}")]
    Injected(Step),
}

pub type Result<T> = std::result::Result<T, Error>;

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
