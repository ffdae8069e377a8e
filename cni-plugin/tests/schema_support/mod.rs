//! What the two schema suites (schema.rs, change_schema.rs) share: the published documents
//! under testdata/services/, a validator's errors, and `services apply` in a fresh state
//! directory. No root needed: with no pods recorded, apply touches no namespace.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

pub fn testdata(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/services").join(name)
}

pub fn load(name: &str) -> Value {
    let path = testdata(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The schema's errors for `doc` (empty: valid).
pub fn schema_errors(v: &jsonschema::Validator, doc: &Value) -> Vec<String> {
    v.iter_errors(doc).map(|e| format!("{}: {e}", e.instance_path())).collect()
}

/// `aether-cni services --state-dir <fresh> apply` of each document in turn, on stdin, in
/// one fresh state directory: (exit code, stdout and stderr) of each.
pub fn apply_in_turn(docs: &[&[u8]]) -> Vec<(i32, String)> {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!("aether-schema-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let outcomes = docs
        .iter()
        .map(|doc| {
            let mut child = Command::new(env!("CARGO_BIN_EXE_aether-cni"))
                .args(["services", "--state-dir"])
                .arg(&dir)
                .arg("apply")
                .env_remove("CNI_COMMAND")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn aether-cni");
            std::io::Write::write_all(&mut child.stdin.take().unwrap(), doc).unwrap();
            let out = child.wait_with_output().unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            (out.status.code().unwrap_or(-1), text)
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    outcomes
}
