//! Finding the node's primary CNI configuration the way libcni does, and the chained copy
//! of it the installer writes.
//!
//! The primary file is never modified. The installer writes a separate conflist, named so
//! that it sorts first (default `00-aether-cni.conflist`): runtimes load the lexically first
//! `.conf`/`.conflist`/`.json` of the directory (libcni `ConfFiles` + sort), so they load the
//! chained copy, and uninstall is removing one file: the directory is then byte for byte what
//! it was, whatever the main CNI did to its own file meanwhile. When the main CNI rewrites,
//! replaces or renames its file, the copy is regenerated from the new primary.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::Error;

/// The file extensions libcni loads (`ConfFiles(dir, [".conf", ".conflist", ".json"])`).
pub const EXTENSIONS: [&str; 3] = ["conf", "conflist", "json"];
/// The `type` of the entry the installer adds.
pub const PLUGIN_TYPE: &str = "aether-cni";

/// The configuration runtimes would load if the installer's own file were not there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Primary {
    pub path: PathBuf,
    pub bytes: Vec<u8>,
    /// Permission bits, given to the chained copy too.
    pub mode: u32,
}

/// The lexically first configuration file of `dir` other than `own_name`. A first candidate
/// that is a directory or a dangling symlink is an error naming it (a runtime would skip or
/// fail on it; chaining something else would hide that).
pub fn find_primary(dir: &Path, own_name: &str) -> Result<Primary, Error> {
    let entries = fs::read_dir(dir).map_err(|source| Error::ConfDir { path: dir.into(), source })?;
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != own_name)
        .filter(|n| Path::new(n).extension().is_some_and(|x| EXTENSIONS.iter().any(|e| x == *e)))
        .collect();
    // Go's sort.Strings: byte order.
    names.sort();
    let Some(first) = names.into_iter().next() else { return Err(Error::NoPrimary { dir: dir.into() }) };
    let path = dir.join(&first);
    if first.as_str() < own_name {
        return Err(Error::Outranked { path, own: own_name.into() });
    }
    let link = fs::symlink_metadata(&path).map_err(|source| Error::ReadPrimary { path: path.clone(), source })?;
    let meta = match fs::metadata(&path) {
        Ok(m) => m,
        Err(e) if link.file_type().is_symlink() && e.kind() == std::io::ErrorKind::NotFound => {
            let target = fs::read_link(&path).unwrap_or_default();
            return Err(Error::DanglingSymlink { path, target });
        }
        Err(source) => return Err(Error::ReadPrimary { path, source }),
    };
    if meta.is_dir() {
        return Err(Error::PrimaryIsDirectory { path });
    }
    let bytes = fs::read(&path).map_err(|source| Error::ReadPrimary { path: path.clone(), source })?;
    Ok(Primary { path, bytes, mode: meta.permissions().mode() & 0o7777 })
}

/// The chained conflist: the primary's plugins (a `.conf` becomes the one plugin of a list,
/// as libcni's `ConfListFromConf` does), any earlier `aether-cni` entry dropped, `entry`
/// appended. Every other field is kept as it was. Also returns `entry` as the runtime will
/// pass it to the plugin (with the list's `name` and `cniVersion`), for validation.
pub fn chain(primary: &Primary, entry: &Map<String, Value>) -> Result<(Vec<u8>, Vec<u8>), Error> {
    let invalid = |why: String| Error::InvalidPrimary { path: primary.path.clone(), why };
    let root: Value = serde_json::from_slice(&primary.bytes).map_err(|e| invalid(format!("not JSON: {e}")))?;
    let Value::Object(mut list) = root else { return Err(invalid("not a JSON object".into())) };
    if !list.contains_key("plugins") {
        // A single-plugin configuration (.conf): the whole object becomes the list's plugin.
        if !list.get("type").is_some_and(Value::is_string) {
            return Err(invalid("neither a \"plugins\" list nor a plugin \"type\"".into()));
        }
        let plugin = Value::Object(list.clone());
        list.retain(|k, _| k == "cniVersion" || k == "name");
        list.insert("plugins".into(), Value::Array(vec![plugin]));
    }
    let name = match list.get("name") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        other => return Err(invalid(format!("field \"name\" is {}, expected a network name", shown(other)))),
    };
    let version = match list.get("cniVersion") {
        Some(Value::String(s)) => s.clone(),
        other => return Err(invalid(format!("field \"cniVersion\" is {}, expected a version string", shown(other)))),
    };
    let Some(Value::Array(plugins)) = list.get_mut("plugins") else {
        return Err(invalid("field \"plugins\" is not a list".into()));
    };
    for (i, p) in plugins.iter().enumerate() {
        if !p.get("type").is_some_and(Value::is_string) {
            return Err(invalid(format!("plugins[{i}] has no \"type\"")));
        }
    }
    plugins.retain(|p| p.get("type").and_then(Value::as_str) != Some(PLUGIN_TYPE));
    if plugins.is_empty() {
        return Err(invalid("it has no plugin besides aether-cni (aether-cni is chained, not a main plugin)".into()));
    }
    plugins.push(Value::Object(entry.clone()));
    let mut body = serde_json::to_vec_pretty(&list).expect("JSON values serialize");
    body.push(b'\n');

    let mut as_passed = entry.clone();
    as_passed.insert("name".into(), Value::String(name));
    as_passed.insert("cniVersion".into(), Value::String(version));
    Ok((body, serde_json::to_vec(&as_passed).expect("JSON values serialize")))
}

/// A value for an error message, cut short: never the whole of a huge value.
fn shown(v: Option<&Value>) -> String {
    let Some(v) = v else { return "missing".into() };
    let s = v.to_string();
    if s.len() <= 80 {
        return s;
    }
    let cut = (0..=77).rev().find(|i| s.is_char_boundary(*i)).unwrap_or(0);
    format!("{}...", &s[..cut])
}
