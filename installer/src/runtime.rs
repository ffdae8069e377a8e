//! The installer's async runtime: one tokio current-thread runtime, made only by
//! `aether-cni-installer` (the plugin's commands, fresh processes each, never start one). Its own
//! module so that everything async in the installer (the CRI client today) can share it:
//! callers hold it in an `Arc` and `block_on` from their own thread.

use std::sync::Arc;

/// A current-thread runtime with the IO and time drivers (sockets and timeouts).
pub fn shared() -> std::io::Result<Arc<tokio::runtime::Runtime>> {
    tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build().map(Arc::new)
}
