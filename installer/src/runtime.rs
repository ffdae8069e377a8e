//! The installer's one async runtime: a tokio current-thread runtime made by `daemon::start`
//! (the plugin, a fresh process per CNI command, never starts one) and shared by all that is
//! async in the installer: the HTTP face and the agent's socket (`serve`, whose thread drives
//! the runtime's I/O and timers) and the reconciler's CRI calls (`block_on` from the
//! reconciler's own thread: its sockets are driven by the serving thread, or by its own
//! `block_on` once serving has ended).

use std::sync::Arc;
use std::time::Duration;

use tokio::runtime::Runtime;

/// A current-thread runtime with the I/O and time drivers (sockets and timeouts), and one
/// blocking thread: the node counters a scrape reads, one read at a time (`serve`'s
/// `Scrapes`).
pub fn new() -> std::io::Result<Arc<Runtime>> {
    tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .max_blocking_threads(1)
        .thread_keep_alive(Duration::from_secs(2))
        .thread_name("installer-scrape")
        .build()
        .map(Arc::new)
}

/// Ends the runtime if `runtime` is its last holder, waiting at most a second for a scrape
/// still reading on the blocking thread; otherwise only lets go of it.
pub fn shut_down(runtime: Arc<Runtime>) {
    if let Ok(rt) = Arc::try_unwrap(runtime) {
        rt.shutdown_timeout(Duration::from_secs(1));
    }
}
