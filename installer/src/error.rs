//! What can go wrong installing, keeping and serving, and the not-ready reason each stands for
//! (the reasons are defined here, below everything that reports them: the HTTP face shows them).

use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("CNI configuration directory {path}: {source}")]
    ConfDir { path: PathBuf, source: std::io::Error },
    #[error("no CNI network configuration (.conflist, .conf or .json) in {dir} yet: waiting for the main CNI")]
    NoPrimary { dir: PathBuf },
    #[error("primary CNI configuration {path} is a directory, not a file")]
    PrimaryIsDirectory { path: PathBuf },
    #[error("primary CNI configuration {path} is a symlink to {target}, which does not exist")]
    DanglingSymlink { path: PathBuf, target: PathBuf },
    #[error("cannot read primary CNI configuration {path}: {source}")]
    ReadPrimary { path: PathBuf, source: std::io::Error },
    #[error("primary CNI configuration {path} is invalid (left untouched): {why}")]
    InvalidPrimary { path: PathBuf, why: String },
    #[error("{path} sorts before {own}: runtimes would load it and not the chained copy (choose a --conflist-name that sorts first)")]
    Outranked { path: PathBuf, own: String },
    #[error("the aether-cni entry chained onto {path} is refused by the plugin: {why}")]
    EntryRefused { path: PathBuf, why: String },
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("cannot remove {path}: {source}")]
    Remove { path: PathBuf, source: std::io::Error },
    /// The uninstall's word to the plugin (`<stateDir>/uninstalled`) cannot be written or read.
    #[error("the plugin binary left for the attached pods: {0}")]
    LeftBinary(#[from] aether_node::state::UninstallError),
    #[error("directory {path} is not usable: {source}")]
    Unusable { path: PathBuf, source: std::io::Error },
    #[error("cannot read the plugin binary to install, {path} (--plugin-binary): {source}")]
    ReadPlugin { path: PathBuf, source: std::io::Error },
    #[error("cannot serve HTTP on {addr}: {why}")]
    Listen { addr: SocketAddr, why: String },
    #[error("cannot serve the Service layer on the socket {}: {why}", path.display())]
    ServicesSocket { path: PathBuf, why: String },
    #[error("cannot watch for changes: {0}")]
    Watch(std::io::Error),
    #[error("cannot handle signals: {0}")]
    Signals(std::io::Error),
    #[error("kernel checks failed: {0}")]
    Kernel(String),
    #[error("cannot start the reconciler: {0}")]
    Reconciler(std::io::Error),
    #[error("HTTP serving ended ({0}): exiting to be restarted")]
    ServingEnded(String),
}

impl Error {
    /// The not-ready reason this error stands for.
    pub fn reason(&self) -> Reason {
        match self {
            Error::ConfDir { .. }
            | Error::NoPrimary { .. }
            | Error::PrimaryIsDirectory { .. }
            | Error::DanglingSymlink { .. }
            | Error::ReadPrimary { .. }
            | Error::InvalidPrimary { .. }
            | Error::Outranked { .. } => Reason::Primary,
            Error::EntryRefused { .. } => Reason::Entry,
            Error::Kernel(_) => Reason::Kernel,
            _ => Reason::Chain,
        }
    }
}

/// Why the node is not ready, one per part of the installation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reason {
    /// The installer has not finished its first pass.
    Starting,
    /// The binary is not (yet) in the CNI bin directory.
    Binary,
    /// No usable primary configuration to chain onto (missing, invalid, outranked...).
    Primary,
    /// The plugin's parser refuses the entry (a node setting, or the list's cniVersion).
    Entry,
    /// The chained conflist could not be written.
    Chain,
    /// doctor's kernel checks fail.
    Kernel,
    /// Stopped: the entry and binary were removed.
    Uninstalled,
    /// The HTTP face stopped serving: the installer exits to be restarted.
    Http,
    /// The netns directory (--netns-dir) does not receive the host's mounts: pods' netns made
    /// after the start are invisible here.
    Netns,
}

impl Reason {
    pub const ALL: [Reason; 9] = [
        Reason::Starting,
        Reason::Binary,
        Reason::Primary,
        Reason::Entry,
        Reason::Chain,
        Reason::Kernel,
        Reason::Uninstalled,
        Reason::Http,
        Reason::Netns,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Reason::Starting => "starting",
            Reason::Binary => "binary",
            Reason::Primary => "primary",
            Reason::Entry => "entry",
            Reason::Chain => "chain",
            Reason::Kernel => "kernel",
            Reason::Uninstalled => "uninstalled",
            Reason::Http => "http",
            Reason::Netns => "netns",
        }
    }
}
