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

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::Error;

/// The file extensions libcni loads (`ConfFiles(dir, [".conf", ".conflist", ".json"])`).
pub const EXTENSIONS: [&str; 3] = ["conf", "conflist", "json"];
/// The `type` of the entry the installer adds.
pub const PLUGIN_TYPE: &str = "aether-cni";

/// Suffixes another CNI gives the configuration files it renames away, and the setting that
/// makes it do so.
const RENAMED_AWAY: [(&str, &str); 1] = [(
    ".cilium_bak",
    "Cilium renames every other CNI configuration with cni.exclusive: true (its default); set cni.exclusive=false",
)];

/// Our chained file as another CNI renamed it away (`00-aether-cni.conflist.cilium_bak`),
/// and the setting that causes it, if such a file is in `dir`.
pub fn renamed_away(dir: &Path, own_name: &str) -> Option<(PathBuf, &'static str)> {
    RENAMED_AWAY.iter().find_map(|(suffix, why)| {
        let renamed = dir.join(format!("{own_name}{suffix}"));
        renamed.exists().then_some((renamed, *why))
    })
}

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

/// A JSON object's members in their order, each value as its original text.
struct Members(Vec<(String, Box<RawValue>)>);

impl<'de> Deserialize<'de> for Members {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members, A::Error> {
                let mut out = Vec::new();
                while let Some(member) = map.next_entry::<String, Box<RawValue>>()? {
                    out.push(member);
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(V)
    }
}

impl Members {
    fn get(&self, key: &str) -> Option<&RawValue> {
        // Go's encoding/json (libcni) takes the last of duplicated keys.
        self.0.iter().rev().find(|(k, _)| k == key).map(|(_, v)| &**v)
    }

    fn value(&self, key: &str) -> Option<Value> {
        self.get(key).and_then(|raw| serde_json::from_str(raw.get()).ok())
    }
}

/// The chained conflist: the primary's plugins (a `.conf` becomes the one plugin of a list,
/// as libcni's `ConfListFromConf` does), any earlier `aether-cni` entry dropped, `entry`
/// appended. Every other member is copied as its original text, in its order. Also returns
/// `entry` as the runtime will pass it to the plugin (with the list's `name` and
/// `cniVersion`), for validation.
pub fn chain(primary: &Primary, entry: &Map<String, Value>) -> Result<(Vec<u8>, Vec<u8>), Error> {
    let invalid = |why: String| Error::InvalidPrimary { path: primary.path.clone(), why };
    let text = std::str::from_utf8(&primary.bytes).map_err(|e| invalid(format!("not UTF-8: {e}")))?;
    let top: Members = serde_json::from_str(text).map_err(|e| invalid(format!("not a JSON object: {e}")))?;
    let (members, plugins): (Vec<(String, String)>, Vec<String>) = match top.get("plugins") {
        Some(list) => {
            let plugins: Vec<Box<RawValue>> = serde_json::from_str(list.get())
                .map_err(|e| invalid(format!("field \"plugins\" is not a list: {e}")))?;
            let members = top.0.iter().map(|(k, v)| (k.clone(), v.get().to_string())).collect();
            (members, plugins.iter().map(|p| p.get().to_string()).collect())
        }
        None => {
            // A single-plugin configuration (.conf): the whole object is the list's plugin.
            if !top.value("type").is_some_and(|t| t.is_string()) {
                return Err(invalid("neither a \"plugins\" list nor a plugin \"type\"".into()));
            }
            let members = top.0.iter().filter(|(k, _)| k == "cniVersion" || k == "name");
            (members.map(|(k, v)| (k.clone(), v.get().to_string())).collect(), vec![text.trim().to_string()])
        }
    };
    let name = match top.value("name") {
        Some(Value::String(s)) if !s.is_empty() => s,
        other => return Err(invalid(format!("field \"name\" is {}, expected a network name", shown(other.as_ref())))),
    };
    let version = match top.value("cniVersion") {
        Some(Value::String(s)) => s,
        other => {
            return Err(invalid(format!(
                "field \"cniVersion\" is {}, expected a version string",
                shown(other.as_ref())
            )))
        }
    };
    let mut kept = Vec::new();
    for (i, p) in plugins.iter().enumerate() {
        let plugin: Value = serde_json::from_str(p).expect("parsed as JSON above");
        match plugin.get("type").and_then(Value::as_str) {
            None => return Err(invalid(format!("plugins[{i}] has no \"type\""))),
            Some(PLUGIN_TYPE) => {}
            Some(_) => kept.push(p.as_str()),
        }
    }
    if kept.is_empty() {
        return Err(invalid("it has no plugin besides aether-cni (aether-cni is chained, not a main plugin)".into()));
    }
    let ours = serde_json::to_string_pretty(entry).expect("JSON values serialize").replace('\n', "\n    ");
    let list = format!("[\n    {},\n    {ours}\n  ]", kept.join(",\n    "));
    let mut body = String::from("{\n");
    let mut wrote_plugins = false;
    let mut lines: Vec<String> = Vec::new();
    for (k, raw) in &members {
        let key = serde_json::to_string(k).expect("strings serialize");
        if k == "plugins" {
            if wrote_plugins {
                continue; // a duplicated key: the list is written once, where it first was
            }
            wrote_plugins = true;
            lines.push(format!("  {key}: {list}"));
        } else {
            lines.push(format!("  {key}: {raw}"));
        }
    }
    if !wrote_plugins {
        lines.push(format!("  \"plugins\": {list}"));
    }
    body.push_str(&lines.join(",\n"));
    body.push_str("\n}\n");
    // What was built must read back as the list it claims to be.
    debug_assert!(serde_json::from_str::<Value>(&body).is_ok());

    let mut as_passed = entry.clone();
    as_passed.insert("name".into(), Value::String(name));
    as_passed.insert("cniVersion".into(), Value::String(version));
    Ok((body.into_bytes(), serde_json::to_vec(&as_passed).expect("JSON values serialize")))
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
