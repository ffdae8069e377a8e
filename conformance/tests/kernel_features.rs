//! A kernel without a feature the ruleset needs: ADD fails with a CNI error naming the
//! feature, its module and the Linux release that introduced it, and programs nothing;
//! `doctor` names every missing feature the same way.
//!
//! The kernel matrix (`make test-kernels`) boots each kernel a second time with modules
//! withheld (`module_blacklist=nft_tproxy,nft_objref` on its command line, which the kernel
//! enforces however a module is asked for) and runs this suite there. Where nothing is
//! withheld (this machine, the matrix's main boot) the same tests are the contrast: the same
//! ADD succeeds and doctor names nothing missing, so a failure above is the withheld module's.

mod common;

use std::process::Command;

use aether_testkit::{root_or_skip, TestNetns};
use common::{bin, conf, run_plugin};
use serde_json::json;

const TABLE: u32 = 44657;

/// The modules the running kernel refuses to load, from its own command line.
fn withheld() -> Vec<String> {
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap();
    cmdline
        .split_whitespace()
        .filter_map(|a| a.strip_prefix("module_blacklist="))
        .flat_map(|l| l.split(','))
        .map(|m| m.replace('-', "_"))
        .collect()
}

/// Whether `module` is out of reach: withheld, and not built into the kernel (Debian's 6.12
/// builds objref into nf_tables itself, so withholding nft_objref withholds nothing there).
fn lacking(module: &str) -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let modules = format!("/lib/modules/{}/modules.dep", release.trim());
    let dep = std::fs::read_to_string(&modules).unwrap_or_default();
    let has_module_file = dep.lines().any(|l| {
        let file = l.split(':').next().unwrap_or("").rsplit('/').next().unwrap_or("");
        file.split('.').next() == Some(module)
    });
    withheld().iter().any(|m| m == module) && has_module_file
}

#[test]
fn add_names_the_missing_feature_and_the_release_and_programs_nothing() {
    if !root_or_skip("add_names_the_missing_feature_and_the_release_and_programs_nothing") {
        return;
    }
    let c = conf("1.0.0", json!({}));
    let ns = TestNetns::new("kfeat");
    let before = ns.snapshot(TABLE);
    let out = run_plugin("ADD", Some(&ns.path()), &c, &[]);
    if !lacking("nft_tproxy") {
        // The contrast: with the module there, the same ADD programs the pod.
        assert!(out.ok, "ADD failed with nft_tproxy available: {}", out.stdout);
        assert_ne!(ns.snapshot(TABLE), before);
        println!("nft_tproxy is available here: ADD succeeds (the matrix withholds it in a boot of its own)");
        return;
    }
    let (code, text) = out.error();
    println!("ADD's error (code {code}): {text}");
    assert_eq!(code, 101, "{text}");
    for want in
        ["tproxy expression", "CONFIG_NFT_TPROXY", "module nft_tproxy", "Linux 4.19 or later", "loopback_tproxy"]
    {
        assert!(text.contains(want), "ADD's error should name {want:?}: {text}");
    }
    assert!(!text.contains("nft_ct") && !text.contains("nft_nat"), "only what is missing is named: {text}");
    assert_eq!(ns.snapshot(TABLE), before, "a refused ADD left something behind");
    let records = std::path::Path::new(c["stateDir"].as_str().unwrap()).join("attachments");
    assert_eq!(std::fs::read_dir(&records).map(|d| d.count()).unwrap_or(0), 0, "a refused ADD left a record");
}

#[test]
fn doctor_names_every_missing_feature_with_its_module_and_release() {
    if !root_or_skip("doctor_names_every_missing_feature_with_its_module_and_release") {
        return;
    }
    let out = Command::new(bin()).arg("doctor").output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    let tproxy = lacking("nft_tproxy");
    let objref = lacking("nft_objref");
    assert_eq!(out.status.success(), !tproxy, "doctor's exit status (tproxy withheld: {tproxy}):\n{text}");
    let tproxy_named = text.contains("module nft_tproxy; Linux 4.19 or later");
    let objref_named = text.contains("module nft_objref; Linux 4.10 or later");
    assert_eq!(tproxy_named, tproxy, "doctor and nft_tproxy (withheld: {tproxy}):\n{text}");
    assert_eq!(objref_named, objref, "doctor and nft_objref (withheld: {objref}):\n{text}");
    if tproxy || objref {
        // One closing line lists every missing feature.
        let last = text.lines().find(|l| l.starts_with("this kernel lacks: ")).unwrap_or_else(|| panic!("{text}"));
        assert_eq!(last.contains("nft_tproxy"), tproxy, "{text}");
        assert_eq!(last.contains("nft_objref"), objref, "{text}");
    } else {
        assert!(!text.contains("this kernel lacks"), "{text}");
    }
}
