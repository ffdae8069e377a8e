//! The installer's reconciler as the tests watch it: its last pass, written after every pass
//! to `<stateDir>/reconciler-last-pass.json` (numbered from 1), read back and waited for.

use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use serde_json::Value;

/// The last pass written under `state_dir`, if any is there and whole.
pub fn last_pass(state_dir: &Path) -> Option<Value> {
    let text = std::fs::read_to_string(state_dir.join("reconciler-last-pass.json")).ok()?;
    serde_json::from_str(&text).ok()
}

/// The number of the last pass written (0: none yet). Pass `mark + 1` may have started before
/// now; `mark + 2` starts after.
pub fn mark(state_dir: &Path) -> u64 {
    last_pass(state_dir).map_or(0, |p| p["pass"].as_u64().unwrap())
}

/// Waits (up to 30 s) for a pass numbered `from` or later that satisfies `cond`, failing the
/// test at once if `installer` exits; `log` is shown on failure.
pub fn wait_pass(
    state_dir: &Path,
    installer: &mut Child,
    log: impl Fn() -> String,
    from: u64,
    what: &str,
    cond: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(p) = last_pass(state_dir) {
            if p["pass"].as_u64().unwrap() >= from && cond(&p) {
                return p;
            }
        }
        let exited = installer.try_wait().unwrap();
        assert!(
            Instant::now() < deadline && exited.is_none(),
            "no reconciler pass with {what} in 30 s (installer exited: {exited:?}); the last:\n{:#}\n--- installer\n{}",
            last_pass(state_dir).unwrap_or(Value::Null),
            log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
