//! The licenses travel with the binaries: THIRD-PARTY-NOTICES (`make notices`, shipped in the
//! image) names every crate linked into the release binaries (the plugin and the installer), each under a license
//! `about.toml` accepts, with that license's text; and the gate works: a crate under a
//! license `about.toml` does not accept fails the notices, naming it.
//!
//! `make test` passes the notices (`AETHER_NOTICES`) and the pinned cargo-about
//! (`AETHER_CARGO_ABOUT`); without them these tests skip loudly, and fail under
//! `AETHER_REQUIRE_ROOT_TESTS=1` (CI).

use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

const TARGET: &str = "x86_64-unknown-linux-gnu";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// `$VAR` as a file that must exist, or None (skipped loudly; a failure in CI).
fn given(var: &str, test: &str, how: &str) -> Option<PathBuf> {
    match std::env::var_os(var) {
        Some(p) => {
            let p = PathBuf::from(p);
            assert!(p.is_file(), "{var}={} is not a file: {how}", p.display());
            Some(p)
        }
        None => {
            assert!(
                std::env::var("AETHER_REQUIRE_ROOT_TESTS").as_deref() != Ok("1"),
                "{test}: {var} is not set: {how}"
            );
            let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {var} is not set ({how})");
            None
        }
    }
}

/// The license ids `about.toml` accepts.
fn accepted() -> BTreeSet<String> {
    let text = std::fs::read_to_string(repo().join("about.toml")).unwrap();
    let list =
        text.split("accepted = [").nth(1).and_then(|t| t.split(']').next()).expect("about.toml: accepted = [...]");
    list.split(',').map(|s| s.trim().trim_matches('"').to_string()).filter(|s| !s.is_empty()).collect()
}

/// The crates (name, version) the notices list, with the license expression of each.
fn listed(notices: &str) -> Vec<(String, String, String)> {
    let crates = notices.split("\nCrates\n------\n").nth(1).expect("a Crates section");
    let crates = crates.split("\nLicenses\n--------\n").next().unwrap();
    crates
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (package, license) = l.split_once(": ").unwrap_or_else(|| panic!("not `name version: license`: {l:?}"));
            let (name, version) = package.split_once(' ').unwrap_or_else(|| panic!("no version: {l:?}"));
            (name.to_string(), version.to_string(), license.to_string())
        })
        .collect()
}

/// The third-party crates linked into `aether-cni` and `aether-cni-installer` for the release
/// target: their normal dependencies, without build scripts' and proc-macros' (which run at
/// build time only).
fn linked() -> BTreeSet<(String, String)> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(repo())
        .args(["tree", "--locked", "-p", "aether-cni", "-p", "aether-installer", "--target", TARGET])
        .args(["-e", "normal,no-proc-macro"])
        .args(["--prefix", "none", "--format", "{p}"])
        .output()
        .unwrap();
    assert!(out.status.success(), "cargo tree: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter(|l| !l.contains('(') || l.ends_with("(*)")) // path crates are ours: "name v0.1.0 (/path)"
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let name = words.next()?;
            let version = words.next()?.trim_start_matches('v');
            Some((name.to_string(), version.to_string()))
        })
        .filter(|(name, _)| !name.starts_with("aether-"))
        .collect()
}

/// The SPDX ids in a license expression (`MIT OR Apache-2.0`, `(MIT OR Apache-2.0) AND
/// Unicode-3.0`, `Apache-2.0 WITH LLVM-exception`).
fn ids(expression: &str) -> Vec<String> {
    let spaced = expression.replace(['(', ')'], " ");
    let words: Vec<&str> = spaced.split_whitespace().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < words.len() {
        match words[i] {
            "OR" | "AND" => i += 1,
            w if words.get(i + 1) == Some(&"WITH") && i + 2 < words.len() => {
                out.push(format!("{w} WITH {}", words[i + 2]));
                i += 3;
            }
            w => {
                out.push(w.to_string());
                i += 1;
            }
        }
    }
    out
}

#[test]
fn the_notices_name_every_crate_linked_into_the_release_binary_under_an_accepted_license() {
    let test = "the_notices_name_every_crate_linked_into_the_release_binary_under_an_accepted_license";
    let Some(path) = given("AETHER_NOTICES", test, "run `make notices`") else { return };
    let notices = std::fs::read_to_string(&path).unwrap();
    let listed = listed(&notices);
    let names: BTreeSet<(String, String)> = listed.iter().map(|(n, v, _)| (n.clone(), v.clone())).collect();

    let linked = linked();
    assert!(linked.len() > 30, "only {} crates from cargo tree: is the reading broken?", linked.len());
    let missing: Vec<_> = linked.difference(&names).collect();
    assert!(missing.is_empty(), "linked into the release binary but not in {}: {missing:?}", path.display());

    // Every crate's license is accepted: of a choice (`A OR B`) one is enough; where an AND
    // is involved, this reading asks for every license named (stricter than SPDX, never
    // looser).
    let accepted = accepted();
    for (name, version, license) in &listed {
        let ok = if license.contains(" AND ") {
            ids(license).iter().all(|id| accepted.contains(id))
        } else {
            license.split(" OR ").any(|choice| ids(choice).iter().all(|id| accepted.contains(id)))
        };
        assert!(ok, "{name} {version}: {license} is not accepted by about.toml ({accepted:?})");
    }
    // Each accepted license that is used has its text, naming the crates it covers.
    for id in ["MIT", "Apache-2.0"] {
        assert!(notices.contains(&format!("({id})\nused by:\n")), "no {id} text");
    }
    assert!(notices.contains("Permission is hereby granted, free of charge"), "the MIT text");
    assert!(notices.contains("TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION"), "the Apache-2.0 text");
    // What the static link adds besides crates.
    assert!(notices.contains("Rust's standard library (rustc "), "the standard library");
    assert!(notices.contains("GNU LESSER GENERAL PUBLIC LICENSE") && notices.contains("Version 2.1"), "glibc's LGPL");
}

#[test]
fn a_crate_whose_license_is_not_accepted_fails_the_notices() {
    let test = "a_crate_whose_license_is_not_accepted_fails_the_notices";
    let Some(about) = given("AETHER_CARGO_ABOUT", test, "make test passes the pinned cargo-about") else { return };
    let tmp = repo().join("target/tmp").join(format!("notices-gate-{}", std::process::id()));
    // A one-crate workspace of its own under `license`, through the very config, template
    // and flags `make notices` uses.
    let run = |license: &str| {
        let dir = tmp.join(license);
        std::fs::create_dir_all(dir.join("src")).unwrap();
        std::fs::write(
            dir.join("Cargo.toml"),
            format!("[package]\nname = \"gate-probe\"\nversion = \"0.1.0\"\nedition = \"2021\"\nlicense = \"{license}\"\n\n[workspace]\n"),
        )
        .unwrap();
        std::fs::write(dir.join("src/lib.rs"), "").unwrap();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let lock =
            Command::new(cargo).current_dir(&dir).args(["generate-lockfile", "--offline", "-q"]).status().unwrap();
        assert!(lock.success(), "cargo generate-lockfile in {}", dir.display());
        let out = Command::new(&about)
            .current_dir(repo())
            .args(["generate", "--frozen", "--fail", "-c", "about.toml", "-m"])
            .arg(dir.join("Cargo.toml"))
            .args(["--target", TARGET, "installer/image/THIRD-PARTY-NOTICES.hbs", "-o"])
            .arg(dir.join("notices"))
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned(), dir)
    };
    // The control: an accepted license passes, and the crate is in the notices.
    let (ok, stderr, dir) = run("MIT");
    assert!(ok, "an MIT crate was refused:\n{stderr}");
    let notices = std::fs::read_to_string(dir.join("notices")).unwrap();
    assert!(notices.contains("MIT License (MIT)"), "{notices}");
    // A license about.toml does not accept fails, naming the crate's manifest and license.
    let (ok, stderr, dir) = run("GPL-3.0-only");
    assert!(!ok, "a GPL-3.0-only crate passed the gate:\n{stderr}");
    assert!(stderr.contains("failed to satisfy license requirements"), "{stderr}");
    assert!(
        stderr.contains(&dir.join("Cargo.toml").display().to_string()) && stderr.contains("GPL-3.0-only"),
        "{stderr}"
    );
    assert!(!dir.join("notices").exists(), "notices written although a license was refused");
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn license_expressions_are_read_as_spdx_says() {
    assert_eq!(ids("MIT OR Apache-2.0"), ["MIT", "Apache-2.0"]);
    assert_eq!(ids("(MIT OR Apache-2.0) AND Unicode-3.0"), ["MIT", "Apache-2.0", "Unicode-3.0"]);
    assert_eq!(ids("Apache-2.0 WITH LLVM-exception OR MIT"), ["Apache-2.0 WITH LLVM-exception", "MIT"]);
    let notices =
        "x\nCrates\n------\nserde 1.0.0: MIT OR Apache-2.0\nring 0.17.1: Apache-2.0 AND ISC\n\nLicenses\n--------\n";
    let got = listed(notices);
    assert_eq!(got[1], ("ring".into(), "0.17.1".into(), "Apache-2.0 AND ISC".into()));
}
