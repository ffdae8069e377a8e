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
