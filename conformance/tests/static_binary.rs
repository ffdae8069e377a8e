//! The release binaries (`make build`: the plugin and the installer) are static PIEs that run
//! on any node: no program interpreter, no shared library, read from their ELF headers; the
//! plugin programs a fresh pod netns (ADD, CHECK, DEL) with nothing but the kernel; and the
//! plugin, started at every pod start, links no async runtime, HTTP, gRPC or metrics crate,
//! and is shipped in at most 4 MiB.

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use aether_testkit::{root_or_skip, TestNetns};
use serde_json::json;

const PT_DYNAMIC: u32 = 2;
const PT_INTERP: u32 = 3;
const ET_DYN: u16 = 3;
const DT_NULL: u64 = 0;
const DT_NEEDED: u64 = 1;
const DT_FLAGS_1: u64 = 0x6fff_fffb;
const DF_1_PIE: u64 = 0x0800_0000;

/// What the ELF headers of an x86-64 executable say about how it is loaded.
#[derive(Debug, PartialEq, Eq)]
struct Linkage {
    /// `ET_DYN`: position-independent.
    position_independent: bool,
    /// A `PT_INTERP`: the kernel starts a dynamic loader first.
    interpreter: Option<String>,
    /// `DT_NEEDED` entries: shared libraries the loader must find (offsets into .dynstr).
    needed: usize,
    /// `DF_1_PIE` in `DT_FLAGS_1`.
    pie_flag: bool,
}

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes(b[o..o + 2].try_into().unwrap())
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
}

/// Reads the program headers and the dynamic section of a little-endian ELF64 file.
fn linkage(elf: &[u8]) -> Linkage {
    assert_eq!(&elf[..4], b"\x7fELF", "not an ELF file");
    assert_eq!((elf[4], elf[5]), (2, 1), "not ELF64 little-endian");
    let (phoff, phentsize, phnum) = (u64_at(elf, 0x20) as usize, u16_at(elf, 0x36) as usize, u16_at(elf, 0x38));
    let mut out =
        Linkage { position_independent: u16_at(elf, 0x10) == ET_DYN, interpreter: None, needed: 0, pie_flag: false };
    for i in 0..phnum as usize {
        let ph = phoff + i * phentsize;
        let (kind, offset, size) = (u32_at(elf, ph), u64_at(elf, ph + 8) as usize, u64_at(elf, ph + 32) as usize);
        match kind {
            PT_INTERP => {
                out.interpreter =
                    Some(String::from_utf8_lossy(&elf[offset..offset + size]).trim_end_matches('\0').into())
            }
            PT_DYNAMIC => {
                for entry in elf[offset..offset + size].chunks_exact(16) {
                    let (tag, val) = (u64_at(entry, 0), u64_at(entry, 8));
                    match tag {
                        DT_NULL => break,
                        DT_NEEDED => out.needed += 1,
                        DT_FLAGS_1 => out.pie_flag = val & DF_1_PIE != 0,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// The plugin's and the installer's release binaries: the variable `make test` sets to what
/// `make build` made, and the file under `target/release/`.
const PLUGIN: (&str, &str) = ("AETHER_CNI_STATIC_BIN", "aether-cni");
const INSTALLER: (&str, &str) = ("AETHER_INSTALLER_STATIC_BIN", "aether-cni-installer");

/// `$VAR` (`make test` sets it to what `make build` made), else `target/release/<name>` if
/// present.
fn release_bin((var, name): (&str, &str)) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(var) {
        let p = PathBuf::from(p);
        assert!(p.is_file(), "{var}={} is not a file: run `make build`", p.display());
        return Some(p);
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release").join(name);
    p.is_file().then_some(p)
}

fn release_bin_or_skip(test: &str, which: (&str, &str)) -> Option<PathBuf> {
    let bin = release_bin(which);
    if bin.is_none() {
        let (var, name) = which;
        assert!(
            std::env::var("AETHER_REQUIRE_ROOT_TESTS").as_deref() != Ok("1"),
            "{test}: no release binary: run `make build` (or set {var})"
        );
        let _ = writeln!(std::io::stderr(), "SKIPPED {test}: no target/release/{name} (run `make build`)");
    }
    bin
}

#[test]
fn the_release_binaries_are_static_pies() {
    // The control: a dynamically linked program reads as one.
    let ls = linkage(&std::fs::read("/bin/ls").unwrap());
    assert!(ls.interpreter.is_some() && ls.needed > 0, "the ELF reader misses a dynamic binary: {ls:?}");

    for which in [PLUGIN, INSTALLER] {
        let Some(bin) = release_bin_or_skip("the_release_binaries_are_static_pies", which) else { continue };
        let l = linkage(&std::fs::read(&bin).unwrap());
        assert_eq!(
            l,
            Linkage { position_independent: true, interpreter: None, needed: 0, pie_flag: true },
            "{} is not a static PIE",
            bin.display()
        );
        let size = std::fs::metadata(&bin).unwrap().len();
        println!("{}: static-pie, {size} bytes ({:.1} MiB)", bin.display(), size as f64 / (1 << 20) as f64);
    }
}

/// The crates a package links for the release target (its normal dependencies, build
/// scripts' and proc-macros' left out), by name.
fn linked_crates(package: &str) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".."))
        .args(["tree", "--locked", "-p", package, "-e", "normal,no-proc-macro", "--prefix", "none", "--format", "{p}"])
        .output()
        .unwrap();
    assert!(out.status.success(), "cargo tree: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    text.lines().filter_map(|l| l.split_whitespace().next()).map(String::from).collect()
}

/// The names of an ELF64 file's sections (from its section headers and their string table).
fn section_names(elf: &[u8]) -> Vec<String> {
    let (shoff, shentsize, shnum, shstrndx) = (
        u64_at(elf, 0x28) as usize,
        u16_at(elf, 0x3a) as usize,
        u16_at(elf, 0x3c) as usize,
        u16_at(elf, 0x3e) as usize,
    );
    let header = |i: usize| shoff + i * shentsize;
    let strtab = u64_at(elf, header(shstrndx) + 0x18) as usize;
    (0..shnum)
        .map(|i| {
            let name = strtab + u32_at(elf, header(i)) as usize;
            let end = elf[name..].iter().position(|&b| b == 0).map_or(elf.len(), |n| name + n);
            String::from_utf8_lossy(&elf[name..end]).into_owned()
        })
        .collect()
}

/// The most the plugin's file may weigh as shipped: it is copied to every node and mapped at
/// every pod start.
const PLUGIN_MAX_BYTES: u64 = 4 << 20;

/// The plugin runs at every pod start: what only the installer's daemon runs (an async
/// runtime, an HTTP server, gRPC, a metrics registry) must not be linked into it, and the file
/// `make build` ships is at most 4 MiB: stripped, its symbols in `aether-cni.debug` beside it
/// (named by its debug link, where a debugger finds them for a crash's analysis).
#[test]
fn the_plugin_links_no_async_runtime_http_grpc_or_metrics() {
    if let Some(bin) = release_bin_or_skip("the_plugin_links_no_async_runtime_http_grpc_or_metrics", PLUGIN) {
        let size = std::fs::metadata(&bin).unwrap().len();
        assert!(
            size <= PLUGIN_MAX_BYTES,
            "{} is {size} bytes ({:.2} MiB), over the 4 MiB the plugin may weigh as shipped",
            bin.display(),
            size as f64 / (1 << 20) as f64
        );
        let sections = section_names(&std::fs::read(&bin).unwrap());
        assert!(sections.iter().any(|s| s == ".text"), "the section reader misses .text: {sections:?}");
        assert!(!sections.iter().any(|s| s == ".symtab"), "{} is not stripped", bin.display());
        assert!(sections.iter().any(|s| s == ".gnu_debuglink"), "{} names no debug file", bin.display());
        let debug = bin.with_file_name("aether-cni.debug");
        let debug_sections =
            section_names(&std::fs::read(&debug).unwrap_or_else(|e| panic!("{}: {e}", debug.display())));
        assert!(debug_sections.iter().any(|s| s == ".symtab"), "{} holds no symbols", debug.display());
        // The control: the installer's file, read the same way, is over the bound and keeps its
        // symbols.
        if let Some(installer) = release_bin(INSTALLER) {
            assert!(std::fs::metadata(&installer).unwrap().len() > PLUGIN_MAX_BYTES, "is the size read at all?");
            assert!(section_names(&std::fs::read(&installer).unwrap()).iter().any(|s| s == ".symtab"));
        }
    }
    let daemon_only = ["tokio", "hyper", "h2", "tonic", "prost", "prometheus", "aether-installer", "aether-cri"];
    let plugin = linked_crates("aether-cni");
    let found: Vec<&str> = daemon_only.into_iter().filter(|c| plugin.iter().any(|p| p == c)).collect();
    assert!(found.is_empty(), "the plugin links {found:?}");
    // Control: the installer links every one of them, and the reading finds them there.
    let installer = linked_crates("aether-installer");
    let missing: Vec<&str> = daemon_only[..6].iter().copied().filter(|c| !installer.iter().any(|p| p == c)).collect();
    assert!(missing.is_empty(), "the installer's tree lacks {missing:?}: is the reading broken?");
}

#[test]
fn the_release_binary_programs_a_fresh_pod_netns() {
    if !root_or_skip("the_release_binary_programs_a_fresh_pod_netns") {
        return;
    }
    let Some(bin) = release_bin_or_skip("the_release_binary_programs_a_fresh_pod_netns", PLUGIN) else { return };
    let ns = TestNetns::new("static");
    let conf = common::conf("1.0.0", json!({}));
    let run = |command: &str| {
        let mut child = Command::new(&bin)
            .env_clear()
            .envs([
                ("CNI_COMMAND", command),
                ("CNI_CONTAINERID", "ctr-static"),
                ("CNI_IFNAME", "eth0"),
                ("CNI_PATH", "/opt/cni/bin"),
                ("CNI_NETNS", &ns.path()),
                ("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart-0"),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(conf.to_string().as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{command} by {}: {}{}",
            bin.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run("ADD");
    let listing = ns.exec("nft", &["list", "table", "ip", "aether_capture"]);
    assert!(listing.contains("tproxy to :18001"), "{listing}");
    run("CHECK");
    run("DEL");
    let (present, _, _) = ns.try_exec("nft", &["list", "table", "ip", "aether_capture"]);
    assert!(!present, "DEL left the table");
}
