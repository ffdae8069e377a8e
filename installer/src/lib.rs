//! `aether-cni-installer`: the long-running container of the DaemonSet (main.rs is the program).
//!
//! It copies the plugin binary into the host's CNI bin directory, writes a chained copy of
//! the node's primary CNI configuration with the aether-cni entry appended (see `chain` for
//! why a copy and not an edit), keeps both in place while another CNI rewrites its files
//! (inotify), marks the node not ready in the state directory until all of that holds and
//! the kernel checks pass, serves `/healthz`, `/readyz` and `/metrics`, and on SIGTERM undoes
//! it all (unless told it is an upgrade).
//!
//! What it asks of the node beyond its files (the plugin's configuration parser, the kernel
//! checks, the Service layer's node counters) it asks the node library, `aether-node`,
//! through [`NodeChecks`] ([`LiveNode`] on a real node; tests stand in for it). It must not
//! know the CNI protocol.
//!
//! By job: `installation` the files (binary, chained conflist) kept in place and undone, on
//! `chain` and `files`; `watch` the inotify watcher; `serve` the HTTP face and what it
//! reports; `services_socket` the agent's socket; `reconcile` the reconciler; `daemon` what
//! starts and stops them all; `checks` what is asked of the node library; `netns_mount` whether
//! the runtime's netns directory shows new pods' netns here; `error` what goes wrong.

pub mod args;
pub mod chain;
pub mod checks;
pub mod daemon;
pub mod error;
pub mod events;
pub mod files;
pub mod installation;
pub mod netns_mount;
pub mod reconcile;
pub mod runtime;
pub mod serve;
pub mod services_socket;
pub mod uninstall;
pub mod watch;

pub use args::InstallArgs;
pub use checks::{LiveNode, NodeChecks};
pub use daemon::{entry_for_display, run, start, Running};
pub use error::Error;
pub use installation::{Msg, Node, BINARY_NAME, UPGRADE_FILE};
pub use watch::Watcher;
