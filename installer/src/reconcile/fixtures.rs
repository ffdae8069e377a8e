//! What the reconciler's unit tests (the planner's and the pass's) build their inputs from.

use aether_cri::{Sandbox, SandboxState};

/// A ready sandbox of pod `ns/name` (uid `uid-<name>`), created at 0, without annotations.
pub(crate) fn sandbox(id: &str, ns: &str, name: &str) -> Sandbox {
    Sandbox {
        id: id.into(),
        namespace: ns.into(),
        name: name.into(),
        uid: format!("uid-{name}"),
        attempt: 0,
        state: SandboxState::Ready,
        created_at: 0,
        annotations: Default::default(),
    }
}
