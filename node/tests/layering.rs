//! The node library stays what docs/layout.md says: below the installer and the binary
//! (its manifest names neither), and in files a reader can hold (none over 800 lines).

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_source_file_of_the_library_is_over_800_lines() {
    let mut files = Vec::new();
    rust_files(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut files);
    assert!(files.len() > 10, "the walk found the sources: {files:?}");
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let n = std::fs::read_to_string(f).unwrap().lines().count();
            (n > 800).then(|| format!("{} ({n} lines)", f.display()))
        })
        .collect();
    assert!(long.is_empty(), "split these by job: {long:?}");
}

#[test]
fn the_library_depends_on_nothing_above_it() {
    let manifest = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml")).unwrap();
    for upward in ["aether-cni", "aether-installer", "aether-cri", "aether-conformance"] {
        let named = manifest.lines().any(|l| l.trim_start().starts_with(upward));
        assert!(!named, "aether-node must not depend on {upward}");
    }
    // The control: the manifest is the one read, and it does name what it may depend on.
    assert!(manifest.lines().any(|l| l.trim_start().starts_with("aether-rules")));
    let sources = std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("src")).unwrap().count();
    assert!(sources > 3);
    for f in ["aether_installer", "aether_cni"] {
        let mut files = Vec::new();
        rust_files(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut files);
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            assert!(!text.contains(&format!("{f}::")), "{} uses {f}", file.display());
        }
    }
}

/// The modules of `services` a module's source names (`super::x`, `super::{x, y}`; a
/// sub-module's own `super::` is its parent's, and counted as the parent's).
fn services_edges(dir: &Path) -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    let modules: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            let stem = p.file_stem()?.to_str()?.to_string();
            (p.extension().is_some_and(|x| x == "rs") && stem != "mod" && stem != "tests").then_some(stem)
        })
        .collect();
    let mut edges = std::collections::BTreeMap::new();
    for m in &modules {
        let text = std::fs::read_to_string(dir.join(format!("{m}.rs"))).unwrap();
        // Only the module's own code: its tests may use anything.
        let code = text.split("#[cfg(test)]\nmod tests").next().unwrap();
        let named: std::collections::BTreeSet<String> = modules
            .iter()
            .filter(|other| *other != m)
            .filter(|other| {
                let direct = code.contains(&format!("super::{other}::")) || code.contains(&format!("super::{other};"));
                let grouped = code.split("super::{").skip(1).any(|g| {
                    let group = g.split('}').next().unwrap_or("");
                    group.split(',').any(|w| w.trim() == other.as_str() || w.trim().starts_with(&format!("{other}::")))
                });
                direct || grouped
            })
            .cloned()
            .collect();
        edges.insert(m.clone(), named);
    }
    edges
}

/// A cycle among `edges`, if there is one (the modules on it).
fn cycle(edges: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        edges: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut std::collections::BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            return Some(path[at..].to_vec());
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for next in edges.get(m).into_iter().flatten() {
            if let Some(c) = visit(next, edges, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = std::collections::BTreeSet::new();
    edges.keys().find_map(|m| visit(m, edges, &mut Vec::new(), &mut done))
}

/// The Service layer's modules import one another in one direction only (the plan below the
/// engine, the engine below the applies, the reports and the applier above them): no
/// circle, so each can be read without the ones above it.
#[test]
fn no_import_circle_among_the_service_layers_modules() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/services");
    let edges = services_edges(&dir);
    assert!(edges["apply"].contains("engine") && edges["engine"].contains("plan"), "the walk reads imports: {edges:?}");
    assert_eq!(cycle(&edges), None, "modules in a circle: {edges:?}");
    // The control: the check finds a circle when there is one.
    let mut circled = edges.clone();
    circled.get_mut("plan").unwrap().insert("apply".into());
    assert!(cycle(&circled).is_some(), "a circle made by hand is found");
}
