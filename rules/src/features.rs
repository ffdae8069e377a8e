//! The kernel features the rulesets use, each with the mainline release that introduced it
//! (the README's minimum-kernel table is this list), and the naming of a missing one: when the
//! kernel refuses an object with "no such thing" or "not supported", the error names what the
//! kernel lacks and which Linux has it, not only the errno.

use std::fmt;

use crate::family::Family;
use crate::model;
use crate::nft::expr::Expr;

/// One kernel feature the rulesets use.
#[derive(Debug, PartialEq, Eq)]
pub struct Feature {
    /// What it is, in nft's words.
    pub name: &'static str,
    /// The kernel option that builds it.
    pub config: &'static str,
    /// The module it is in where a distribution builds it as one (Debian does), if it can
    /// be missing on its own: `None` for what is part of `nf_tables` itself.
    pub module: Option<&'static str>,
    /// The mainline release that introduced it.
    pub since: (u32, u32),
}

impl fmt::Display for Feature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}", self.name, self.config)?;
        if let Some(m) = self.module {
            write!(f, ", module {m}")?;
        }
        write!(f, "; Linux {}.{} or later)", self.since.0, self.since.1)
    }
}

const fn core(name: &'static str, since: (u32, u32)) -> Feature {
    Feature { name, config: "CONFIG_NF_TABLES", module: None, since }
}

pub const NF_TABLES: Feature = Feature {
    name: "nf_tables (tables, base chains, payload, meta, cmp, bitwise, hash and interval sets, lookup)",
    config: "CONFIG_NF_TABLES",
    module: Some("nf_tables"),
    since: (3, 13),
};
pub const ROUTE_CHAIN: Feature = core("type route chains (a mark set in OUTPUT routes the packet again)", (3, 13));
pub const META_SET: Feature = core("meta mark set", (3, 14));
pub const RULE_USERDATA: Feature = core("rule comments (rule user data)", (3, 15));
pub const CONCAT: Feature = core("concatenated set keys (32-bit registers)", (4, 1));
pub const DYNSET: Feature = core("the dynset expression (update @set from the datapath)", (4, 1));
pub const SET_TIMEOUT: Feature = core("set element timeouts (dynamic sets)", (4, 1));
pub const LOOKUP_INVERTED: Feature = core("inverted set lookups (!= @set)", (4, 9));
pub const COUNTER_OBJECT: Feature = core("named counter objects (stateful objects)", (4, 10));
pub const CT: Feature = Feature {
    name: "the ct expression (ct state, direction, status)",
    config: "CONFIG_NFT_CT",
    module: Some("nft_ct"),
    since: (3, 13),
};
/// Setting a conntrack key from a register (`ct mark set`), in the same module.
pub const CT_SET: Feature = Feature {
    name: "ct mark set (the ct expression's set form)",
    config: "CONFIG_NFT_CT",
    module: Some("nft_ct"),
    since: (3, 14),
};
pub const NAT_CHAIN: Feature =
    Feature { name: "type nat chains", config: "CONFIG_NFT_NAT", module: Some("nft_chain_nat"), since: (3, 13) };
pub const NAT: Feature =
    Feature { name: "the nat expression (dnat to)", config: "CONFIG_NFT_NAT", module: Some("nft_nat"), since: (3, 13) };
pub const REJECT_IPV4: Feature = Feature {
    name: "the reject expression for IPv4 (ICMP unreachable, TCP reset)",
    config: "CONFIG_NFT_REJECT_IPV4",
    module: Some("nft_reject_ipv4"),
    since: (3, 14),
};
pub const REJECT_IPV6: Feature = Feature {
    name: "the reject expression for IPv6 (ICMPv6 unreachable, TCP reset)",
    config: "CONFIG_NFT_REJECT_IPV6",
    module: Some("nft_reject_ipv6"),
    since: (3, 14),
};
/// A module of its own in Debian's 6.1; part of nf_tables itself in 6.12's.
pub const OBJREF: Feature = Feature {
    name: "the objref expression (counter name \"...\")",
    config: "CONFIG_NFT_OBJREF",
    module: Some("nft_objref"),
    since: (4, 10),
};
pub const TPROXY: Feature = Feature {
    name: "the tproxy expression (tproxy to :port)",
    config: "CONFIG_NFT_TPROXY",
    module: Some("nft_tproxy"),
    since: (4, 19),
};

/// Every feature, in the order of the README's table.
pub const ALL: [&Feature; 17] = [
    &NF_TABLES,
    &ROUTE_CHAIN,
    &META_SET,
    &RULE_USERDATA,
    &CT,
    &CT_SET,
    &NAT_CHAIN,
    &NAT,
    &REJECT_IPV4,
    &REJECT_IPV6,
    &CONCAT,
    &DYNSET,
    &SET_TIMEOUT,
    &LOOKUP_INVERTED,
    &COUNTER_OBJECT,
    &OBJREF,
    &TPROXY,
];

/// The oldest release that has every feature the rulesets use.
pub fn minimum_kernel() -> (u32, u32) {
    ALL.iter().map(|f| f.since).max().expect("features")
}

/// What one rule needs beyond nf_tables' core.
pub fn of_rule(exprs: &[Expr], family: Family) -> Vec<&'static Feature> {
    let mut out: Vec<&'static Feature> = vec![&RULE_USERDATA];
    for e in exprs {
        let f: &'static Feature = match e {
            Expr::Ct { .. } => &CT,
            Expr::CtSet { .. } => &CT_SET,
            Expr::MetaSet { .. } => &META_SET,
            Expr::Lookup { invert: true, .. } => &LOOKUP_INVERTED,
            Expr::Objref { .. } => &OBJREF,
            Expr::Dynset { .. } => &DYNSET,
            Expr::Reject { .. } if family == Family::Ipv4 => &REJECT_IPV4,
            Expr::Reject { .. } => &REJECT_IPV6,
            Expr::Tproxy { .. } => &TPROXY,
            Expr::Nat { .. } => &NAT,
            _ => continue,
        };
        if !out.contains(&f) {
            out.push(f);
        }
    }
    out
}

/// What a set needs: timeouts, concatenated keys.
pub fn of_set(set: &model::Set) -> Vec<&'static Feature> {
    let mut out = Vec::new();
    if set.timeout_secs.is_some() {
        out.push(&SET_TIMEOUT);
    }
    if matches!(set.key, model::KeyType::ServiceKey | model::KeyType::ServiceKey6) {
        out.push(&CONCAT);
    }
    out
}

/// What a chain needs: its type.
pub fn of_chain(chain: &model::Chain) -> Vec<&'static Feature> {
    match chain.hook.map(|h| h.kind) {
        Some(model::ChainKind::Nat) => vec![&NAT_CHAIN],
        Some(model::ChainKind::Route) => vec![&ROUTE_CHAIN],
        _ => Vec::new(),
    }
}

/// The running kernel, as the features see it: its release and the modules it has.
pub struct Kernel {
    pub release: String,
    version: (u32, u32),
    /// Loaded modules (`/proc/modules`) and those built in (`modules.builtin`).
    modules: Vec<String>,
}

impl Kernel {
    pub fn running() -> Kernel {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_string();
        let mut modules: Vec<String> = std::fs::read_to_string("/proc/modules")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split_whitespace().next().map(str::to_string))
            .collect();
        let builtin = std::fs::read_to_string(format!("/lib/modules/{release}/modules.builtin")).unwrap_or_default();
        modules.extend(builtin.lines().filter_map(|l| {
            let file = l.rsplit('/').next()?;
            Some(file.split('.').next()?.replace('-', "_"))
        }));
        Kernel { version: parse_version(&release), release, modules }
    }

    /// Whether the kernel visibly lacks `f`: older than the release that introduced it, or
    /// its module neither loaded nor built in (nf_tables asked for it while it handled the
    /// refused object, so a module the kernel could load is loaded by now).
    pub fn lacks(&self, f: &Feature) -> bool {
        if self.version < f.since {
            return true;
        }
        match f.module {
            Some(m) => !self.modules.iter().any(|have| have == m),
            None => false,
        }
    }
}

fn parse_version(release: &str) -> (u32, u32) {
    let mut parts = release.split(|c: char| !c.is_ascii_digit()).filter(|s| !s.is_empty());
    let major = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let minor = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    (major, minor)
}

/// The features, among those a refused object needs, that the kernel lacks. Only a refusal
/// that means "no such thing" (`ENOENT`: an expression or chain type the kernel does not
/// know) or "not supported" can be a missing feature.
pub fn missing(kernel: &Kernel, needs: &[&'static Feature], errno: i32) -> Vec<&'static Feature> {
    if errno != libc::ENOENT && errno != libc::EOPNOTSUPP {
        return Vec::new();
    }
    needs.iter().copied().filter(|f| kernel.lacks(f)).collect()
}

/// "nft_tproxy (...; Linux 4.19 or later), nft_objref (...)".
pub struct List<'a>(pub &'a [&'static Feature]);

impl fmt::Display for List<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, feature) in self.0.iter().enumerate() {
            write!(f, "{}{feature}", if i > 0 { "; " } else { "" })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(release: &str, modules: &[&str]) -> Kernel {
        Kernel {
            release: release.into(),
            version: parse_version(release),
            modules: modules.iter().map(|m| m.to_string()).collect(),
        }
    }

    #[test]
    fn the_minimum_is_the_newest_feature_tproxy() {
        assert_eq!(minimum_kernel(), (4, 19));
        assert_eq!(ALL.iter().filter(|f| f.since == (4, 19)).count(), 1);
    }

    #[test]
    fn a_feature_is_missing_when_its_module_is_absent_or_the_kernel_older() {
        let k = kernel("6.1.0-57-amd64", &["nf_tables", "nft_ct"]);
        assert!(k.lacks(&TPROXY) && !k.lacks(&CT) && !k.lacks(&DYNSET));
        assert!(kernel("4.14.0", &["nf_tables"]).lacks(&DYNSET) == false);
        assert!(kernel("4.0.9", &["nf_tables"]).lacks(&DYNSET));
        assert_eq!(missing(&k, &[&CT, &TPROXY], libc::ENOENT), vec![&TPROXY]);
        // Another refusal (a bad value, a clash) is never a missing feature.
        assert!(missing(&k, &[&CT, &TPROXY], libc::EINVAL).is_empty());
        assert!(missing(&k, &[&CT, &TPROXY], libc::EEXIST).is_empty());
    }

    #[test]
    fn the_text_names_the_feature_the_option_the_module_and_the_release() {
        assert_eq!(
            TPROXY.to_string(),
            "the tproxy expression (tproxy to :port) (CONFIG_NFT_TPROXY, module nft_tproxy; Linux 4.19 or later)"
        );
        assert_eq!(parse_version("6.12.117+deb12-amd64"), (6, 12));
        assert_eq!(parse_version("4.19"), (4, 19));
    }
}
