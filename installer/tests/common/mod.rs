//! Test support: a fake node root (bin, conf and state directories in a temp dir), the
//! installer's arguments for it, and a stand-in for what the plugin passes in.
#![allow(dead_code)] // each test file uses part of it

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use aether_installer::{InstallArgs, NodeChecks};
use aether_node::config::ConfigError;
use aether_node::probe::ProbeError;
use aether_node::services::ServicesError;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: InstallArgs,
}

pub fn primaries() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/install/primaries")
}

/// A fake node root, removed on drop.
pub struct FakeNode {
    pub root: PathBuf,
    pub bin: PathBuf,
    pub conf: PathBuf,
    pub state: PathBuf,
}

impl FakeNode {
    pub fn new(tag: &str) -> FakeNode {
        let root = std::env::temp_dir().join(format!("aether-installer-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let node = FakeNode {
            bin: root.join("opt/cni/bin"),
            conf: root.join("etc/cni/net.d"),
            state: root.join("run/aether-cni"),
            root,
        };
        fs::create_dir_all(&node.bin).unwrap();
        fs::create_dir_all(&node.conf).unwrap();
        node
    }

    /// The installer's arguments for this node, plus `extra` flags.
    pub fn args(&self, extra: &[&str]) -> InstallArgs {
        let mut argv = vec![
            "install".to_string(),
            format!("--cni-bin-dir={}", self.bin.display()),
            format!("--cni-conf-dir={}", self.conf.display()),
            format!("--state-dir={}", self.state.display()),
            "--host-ip=10.0.0.11".into(),
        ];
        if !extra.iter().any(|a| a.starts_with("--listen")) {
            argv.push("--listen=127.0.0.1:0".into());
        }
        argv.extend(extra.iter().map(|s| s.to_string()));
        Cli::try_parse_from(argv).unwrap().args
    }

    /// Copies a test primary into the conf directory under its own name.
    pub fn put_primary(&self, name: &str) -> PathBuf {
        let to = self.conf.join(name);
        fs::copy(primaries().join(name), &to).unwrap();
        to
    }

    pub fn chained(&self) -> PathBuf {
        self.conf.join("00-aether-cni.conflist")
    }

    pub fn marker(&self) -> Option<String> {
        fs::read_to_string(self.state.join("node-not-ready")).ok()
    }
}

impl Drop for FakeNode {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// Every file of `dir`: name -> (bytes, mode).
pub fn snapshot(dir: &Path) -> BTreeMap<String, (Vec<u8>, u32)> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| {
            let meta = fs::symlink_metadata(e.path()).unwrap();
            let bytes = if meta.is_file() { fs::read(e.path()).unwrap() } else { Vec::new() };
            (e.file_name().to_string_lossy().into_owned(), (bytes, meta.permissions().mode() & 0o7777))
        })
        .collect()
}

/// Switches for the stand-in plugin.
#[derive(Clone, Default)]
pub struct Switches {
    pub refuse_entry: Arc<AtomicBool>,
    pub kernel_fails: Arc<AtomicBool>,
}

/// A stand-in for the node: accepts entries unless told, kernel checks pass unless told,
/// fixed node counters unless replaced. (The real parser is exercised through the binary in
/// cni-plugin/tests/install.rs.)
pub struct StandIn {
    refuse: Arc<AtomicBool>,
    kernel: Arc<AtomicBool>,
    pub node_counters: Box<dyn Fn() -> Result<String, ServicesError> + Send + Sync>,
}

impl NodeChecks for StandIn {
    fn validate_entry(&self, conf: &[u8]) -> Result<(), ConfigError> {
        serde_json::from_slice::<serde_json::Value>(conf).map_err(|e| ConfigError::NotJson { why: e.to_string() })?;
        if self.refuse.load(Ordering::SeqCst) {
            return Err(ConfigError::UnsupportedVersion { version: "\"0.3.1\" (stand-in)".into() });
        }
        Ok(())
    }

    fn kernel_checks(&self) -> Result<(), ProbeError> {
        if self.kernel.load(Ordering::SeqCst) {
            return Err(ProbeError::ReadBack(vec!["nft_tproxy is missing (stand-in)".into()]));
        }
        Ok(())
    }

    fn node_counters(&self) -> Result<String, ServicesError> {
        (self.node_counters)()
    }
}

pub fn plugin(sw: &Switches) -> StandIn {
    StandIn {
        refuse: sw.refuse_entry.clone(),
        kernel: sw.kernel_fails.clone(),
        node_counters: Box::new(|| {
            Ok("# HELP aether_cni_service_connections_total New captured connections by destination class.\n\
                # TYPE aether_cni_service_connections_total counter\n\
                aether_cni_service_connections_total{class=\"mesh\"} 7\n"
                .into())
        }),
    }
}

/// A binary to install (any bytes: the installer copies, it does not run them).
pub fn fake_binary(size: usize, seed: u8) -> Vec<u8> {
    (0..size).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}
