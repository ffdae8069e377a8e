//! What is done after the answer, by a child the runtime does not wait for: ADD's Service
//! layer built (`attachment::LayerToBuild`), DEL's sockets closed. The answer is written, the
//! process lets go of the runtime's pipes, then forks; the parent ends and the child works.
//!
//! Why a child and not the installer: the kernel charges the layer's memory to whoever
//! builds it, and a child stays where the runtime ran the plugin, as ADD's own work did; and
//! it needs nothing running on the node. The locks ADD took are `flock`s, which belong to
//! the open files: the child's copies hold them after the parent has exited, so the pod is
//! never unlocked between the capture and its layer. The runtime reads the plugin's output
//! until every holder of its pipes closed them, and waits for the plugin's exit: the pipes
//! are let go of before the fork, so the child never holds them, and the answer is whole
//! when the parent ends, however late the child runs (its log lines still reach the logFile).

use aether_node::attachment::LayerToBuild;
use aether_node::services::ServicesError;
use aether_rules::nft::OpenSockets;

use crate::{info, warn};

/// The child's nice level: about a tenth of a CPU's share beside the runtime's own work.
const CHILD_NICE: i32 = 10;

/// Which process this is after [`split`].
pub enum Split {
    /// The runtime's, which has answered: end without releasing the locks (the child's now).
    Parent,
    /// The child: build the layer ([`build`]), then end.
    Child(LayerToBuild),
    /// No child could be made: the layer is built by this process before it ends (the
    /// runtime, which waits for its exit, waits for the layer too).
    Unsplit(LayerToBuild),
}

/// Forks. Called with one thread (every netns visit's thread has been joined), after the
/// answer and [`let_go_of_the_runtime`].
pub fn split(layer: LayerToBuild) -> Split {
    // SAFETY: the process has a single thread here, so the child's copy of its memory has no
    // lock held by a thread that does not exist in it.
    match unsafe { libc::fork() } {
        -1 => {
            warn!(
                "cannot start a process to build the Service layer after the answer ({}): built before this one ends",
                std::io::Error::last_os_error()
            );
            Split::Unsplit(layer)
        }
        0 => {
            // Out of the runtime's session (its signals to the plugin's group are not ours).
            // SAFETY: a plain system call on this process.
            unsafe { libc::setsid() };
            // The sandbox the runtime goes on starting comes first: its containers start after
            // it, and nothing connects before them. Below it on a busy CPU, never starved
            // (a nice level, not an idle class: a DEL of the pod waits for this layer).
            // SAFETY: a plain system call on this process.
            unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, CHILD_NICE) };
            Split::Child(layer)
        }
        _ => {
            // The locks are the child's now: released by the child, not here (the files close
            // with this process, which releases nothing the child still holds open).
            std::mem::forget(layer);
            Split::Parent
        }
    }
}

/// Once the answer is written: stdin, stdout and stderr become `/dev/null`, so the runtime's
/// pipes close when this process ends and no child of it holds them. `false` when
/// `/dev/null` cannot be opened: nothing is changed (closing them instead would let the next
/// socket opened take the number of stderr, where log lines go), and no child is made.
pub fn let_go_of_the_runtime() -> bool {
    // SAFETY: plain system calls on this process's own descriptors.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
        if null < 0 {
            return false;
        }
        for fd in 0..=2 {
            libc::dup2(null, fd);
        }
        libc::close(null);
    }
    true
}

/// DEL's netfilter sockets, once the answer is written: their last close waits for the
/// kernel to free what DEL removed (an RCU grace period, then a Service layer's elements:
/// 10-25 ms), which is out of the ruleset already. A child is made that holds them too and
/// closes them last, once this process has closed its copies (a pipe's end of this process
/// closed says so); this process ends without waiting. Without `/dev/null`, a pipe or a
/// child, they are closed here, as before the answer.
pub fn close_apart(sockets: OpenSockets) {
    let mut ends = [0; 2];
    // SAFETY: plain system calls; `ends` has room for the two descriptors.
    if !let_go_of_the_runtime() || unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return drop(sockets);
    }
    let [parent_gone, parent_here] = ends;
    // SAFETY: one thread here, as in `split`; the child only waits, closes and ends.
    match unsafe { libc::fork() } {
        0 => {
            // SAFETY: plain system calls on this process and its own descriptors.
            unsafe {
                libc::setsid();
                libc::close(parent_here);
                // End of file once the parent's copy of the pipe is closed, after its sockets.
                let mut byte = 0u8;
                while libc::read(parent_gone, (&raw mut byte).cast(), 1) < 0
                    && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
                {}
            }
            aether_node::state::pause_point("del-sockets-closing");
            drop(sockets);
        }
        // (No child: closed here. The parent's copies first, then the pipe that tells the
        // child to close its own, the last.)
        _ => {
            drop(sockets);
            // SAFETY: closing this process's own descriptors.
            unsafe {
                libc::close(parent_gone);
                libc::close(parent_here);
            }
        }
    }
}

/// Builds the layer (in the child, or in the process that answered when no child could be made), logged
/// either way: a failure leaves the pod captured without its layer until the agent's next
/// apply or the reconciler's next look builds it.
pub fn build(layer: LayerToBuild) {
    match aether_netns::tour_here(|| layer.build()).map_err(ServicesError::Tour).and_then(|built| built) {
        Ok(generation) => info!(
            services_generation = %generation.map_or("none".to_string(), |g| g.to_string()),
            "the Service layer is built"
        ),
        Err(e) => warn!("the pod is captured without its Service layer (the next apply or the reconciler's next look builds it): {e}"),
    }
}
