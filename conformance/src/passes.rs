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

/// Every pass written under `state_dir` since the installer started, in order, if the
/// installer keeps the journal (a fault-injection build run with
/// `AETHER_INSTALLER_PASS_JOURNAL=1`, see [`JOURNAL_ENV`]): a pass that another followed at once
/// is there too, where the last-pass file has only the later one.
pub fn journal(state_dir: &Path) -> Option<Vec<Value>> {
    let text = std::fs::read_to_string(state_dir.join(JOURNAL_FILE)).ok()?;
    // A line being appended may be incomplete: it is read whole by the next look.
    Some(text.lines().map_while(|l| serde_json::from_str(l).ok()).collect())
}

/// The installer's pass journal, in its state directory.
pub const JOURNAL_FILE: &str = "reconciler-passes.jsonl";
/// The environment that makes a fault-injection build of the installer keep its journal.
pub const JOURNAL_ENV: (&str, &str) = ("AETHER_INSTALLER_PASS_JOURNAL", "1");

/// Before an installer starts on `state_dir`: the passes of the one before it are not its own
/// (each installer numbers its passes from 1).
pub fn forget(state_dir: &Path) {
    let _ = std::fs::remove_file(state_dir.join("reconciler-last-pass.json"));
    let _ = std::fs::remove_file(state_dir.join(JOURNAL_FILE));
}

/// The number of the last pass written (0: none yet). Pass `mark + 1` may have started before
/// now; `mark + 2` starts after.
pub fn mark(state_dir: &Path) -> u64 {
    last_pass(state_dir).map_or(0, |p| p["pass"].as_u64().unwrap())
}

/// Waits (up to 30 s) for a pass numbered `from` or later that satisfies `cond`, failing the
/// test at once if `installer` exits; `log` is shown on failure. Every pass is looked at when
/// the installer keeps its journal ([`journal`]); else the last one written, each 100 ms.
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
        if let Some(p) =
            journal(state_dir).into_iter().flatten().find(|p| p["pass"].as_u64().is_some_and(|n| n >= from) && cond(p))
        {
            return p;
        }
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
