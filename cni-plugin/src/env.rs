//! The CNI invocation environment (spec §2 "Parameters").

use aether_node::config::shown;
pub use aether_node::state::PodIdentity;

use crate::error::CniError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Env {
    pub command: String,
    pub container_id: Option<String>,
    pub netns: Option<String>,
    pub ifname: Option<String>,
    pub args: PodIdentity,
    pub path: Option<String>,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

impl Env {
    pub fn from_process() -> Result<Env, CniError> {
        let command = var("CNI_COMMAND").ok_or_else(|| CniError::invalid_env("CNI_COMMAND", "is not set"))?;
        Ok(Env {
            command,
            container_id: var("CNI_CONTAINERID"),
            netns: var("CNI_NETNS"),
            ifname: var("CNI_IFNAME"),
            args: parse_args(&std::env::var("CNI_ARGS").unwrap_or_default())?,
            path: var("CNI_PATH"),
        })
    }

    pub fn require_container_id(&self) -> Result<&str, CniError> {
        let id = self.container_id.as_deref().ok_or_else(|| CniError::invalid_env("CNI_CONTAINERID", "is not set"))?;
        // Spec: alphanumerics plus underscore, dot and hyphen; it also names state files.
        if !id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')) || id.starts_with('.') {
            return Err(CniError::invalid_env(
                "CNI_CONTAINERID",
                format!("{} has characters outside [A-Za-z0-9_.-]", shown(&format!("{id:?}"))),
            ));
        }
        Ok(id)
    }

    pub fn require_netns(&self) -> Result<&str, CniError> {
        self.netns.as_deref().ok_or_else(|| CniError::invalid_env("CNI_NETNS", "is not set"))
    }

    pub fn require_ifname(&self) -> Result<&str, CniError> {
        let name = self.ifname.as_deref().ok_or_else(|| CniError::invalid_env("CNI_IFNAME", "is not set"))?;
        // The kernel's rules for an interface name (dev_valid_name).
        if name.len() > 15
            || name == "."
            || name == ".."
            || name.chars().any(|c| c == '/' || c == ':' || c.is_whitespace())
        {
            return Err(CniError::invalid_env(
                "CNI_IFNAME",
                format!("{} is not a usable interface name", shown(&format!("{name:?}"))),
            ));
        }
        Ok(name)
    }

    pub fn require_path(&self) -> Result<&str, CniError> {
        self.path.as_deref().ok_or_else(|| CniError::invalid_env("CNI_PATH", "is not set"))
    }
}

pub fn parse_args(raw: &str) -> Result<PodIdentity, CniError> {
    let mut args = PodIdentity::default();
    for pair in raw.split(';').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').ok_or_else(|| {
            CniError::invalid_env("CNI_ARGS", format!("has {}, not KEY=VALUE", shown(&format!("{pair:?}"))))
        })?;
        match k {
            "K8S_POD_NAMESPACE" => args.namespace = Some(v.to_string()),
            "K8S_POD_NAME" => args.name = Some(v.to_string()),
            "K8S_POD_UID" => args.uid = Some(v.to_string()),
            // IgnoreUnknown, K8S_POD_INFRA_CONTAINER_ID and anything else: not ours.
            _ => {}
        }
    }
    Ok(args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubernetes_args_are_read_and_others_ignored() {
        let a = parse_args(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u-1",
        )
        .unwrap();
        assert_eq!(a.namespace.as_deref(), Some("shop"));
        assert_eq!(a.name.as_deref(), Some("cart-0"));
        assert_eq!(a.uid.as_deref(), Some("u-1"));
        assert_eq!(parse_args("").unwrap(), PodIdentity::default());
    }

    #[test]
    fn malformed_args_name_the_variable_and_the_pair() {
        let e = parse_args("IgnoreUnknown=1;garbage").unwrap_err();
        assert_eq!(e.code, 4);
        assert!(e.msg.contains("CNI_ARGS") && e.msg.contains("garbage"), "{}", e.msg);
    }

    fn env_with(ifname: &str, id: &str) -> Env {
        Env {
            command: "ADD".into(),
            container_id: Some(id.into()),
            netns: Some("/run/netns/x".into()),
            ifname: Some(ifname.into()),
            args: PodIdentity::default(),
            path: None,
        }
    }

    #[test]
    fn unusable_ifnames_and_container_ids_are_refused() {
        for bad in ["a/b", "..", "sixteen-chars-xx", "with space", "a:b"] {
            let e = env_with(bad, "abc").require_ifname().unwrap_err();
            assert!(e.msg.contains("CNI_IFNAME") && e.msg.contains(bad), "{}", e.msg);
        }
        assert_eq!(env_with("eth0", "abc").require_ifname().unwrap(), "eth0");
        for bad in ["a/b", "../x", "a b", ".hidden"] {
            let e = env_with("eth0", bad).require_container_id().unwrap_err();
            assert!(e.msg.contains("CNI_CONTAINERID"), "{}", e.msg);
        }
    }
}
