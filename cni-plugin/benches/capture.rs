//! `make bench`: programming a pod's capture, side by side in one run.
//!
//! - in-process: `aether_rules::install` + `remove` (what ADD and DEL do after start-up)
//! - plugin exec: the `aether-cni` binary driven through the CNI protocol, ADD then DEL
//! - shell-out baseline: the same ruleset by `nft -f` plus `ip rule` and `ip route`, the way
//!   a plugin that execs the tools would do it, then `nft delete table` + `ip rule del`
//! - CHECK in-process (`verify`) against `nft list table` by exec
//!
//! Needs root (it makes its own netns). Prints medians and ratios; asserts nothing.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use aether_netns::Netns;
use aether_rules::{capture_ruleset, CaptureConfig, CaptureMode, DnsDivert};

const ROUNDS: usize = 200;

fn sh(args: &[&str]) {
    let st = Command::new(args[0]).args(&args[1..]).stdout(Stdio::null()).status().unwrap();
    assert!(st.success(), "{args:?}");
}

fn measure(name: &str, mut f: impl FnMut()) -> (String, Duration) {
    for _ in 0..5 {
        f(); // warm up: module loads, page cache
    }
    let mut samples: Vec<Duration> = (0..ROUNDS)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    samples.sort();
    let median = samples[ROUNDS / 2];
    let p90 = samples[ROUNDS * 9 / 10];
    println!("{name:<44} median {:>9.3} ms   p90 {:>9.3} ms", ms(median), ms(p90));
    (name.to_string(), median)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("make bench needs root (it creates its own network namespace)");
        std::process::exit(1);
    }
    let ns_name = format!("aether-bench-{}", std::process::id());
    sh(&["ip", "netns", "add", &ns_name]);
    let path = format!("/run/netns/{ns_name}");
    let result = std::panic::catch_unwind(|| run(&ns_name, &path));
    let _ = Command::new("ip").args(["netns", "del", &ns_name]).status();
    if result.is_err() {
        std::process::exit(1);
    }
}

fn run(ns_name: &str, path: &str) {
    sh(&["ip", "-n", ns_name, "link", "set", "lo", "up"]);
    let mut cfg = CaptureConfig::new(CaptureMode::RedirectAll);
    cfg.dns = Some(DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 18054 });
    let rs = capture_ruleset(&cfg).unwrap();
    let netns = Netns::open_foreign(path).unwrap();
    println!("{ROUNDS} rounds each, one pod netns, default ruleset with DNS capture\n");

    let inproc = measure("in-process install + remove", || {
        netns
            .run(|| {
                aether_rules::install(&rs, None).unwrap();
                aether_rules::remove(&rs.table.name, &rs.policy_route).unwrap();
            })
            .unwrap()
    });

    // The golden listing is valid nft input: the same ruleset, as text.
    let golden =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/golden/redirect-all.txt")).unwrap();
    let nft_text: String =
        golden.lines().skip(1).take_while(|l| !l.starts_with("# ip")).map(|l| format!("{l}\n")).collect();
    let nft_file = std::env::temp_dir().join(format!("aether-bench-{}.nft", std::process::id()));
    std::fs::write(&nft_file, &nft_text).unwrap();
    let nft_file = nft_file.to_str().unwrap().to_string();
    let shell = measure("shell-out: nft -f + ip rule + ip route, and back", || {
        sh(&["ip", "netns", "exec", ns_name, "nft", "-f", &nft_file]);
        sh(&["ip", "-n", ns_name, "rule", "add", "fwmark", "0xae71", "lookup", "44657", "priority", "32000"]);
        sh(&["ip", "-n", ns_name, "route", "add", "local", "0.0.0.0/0", "dev", "lo", "table", "44657"]);
        sh(&["ip", "netns", "exec", ns_name, "nft", "delete", "table", "ip", "aether_capture"]);
        sh(&["ip", "-n", ns_name, "rule", "del", "fwmark", "0xae71", "lookup", "44657", "priority", "32000"]);
        sh(&["ip", "-n", ns_name, "route", "del", "local", "0.0.0.0/0", "dev", "lo", "table", "44657"]);
    });
    let _ = std::fs::remove_file(&nft_file);

    let state = std::env::temp_dir().join(format!("aether-bench-state-{}", std::process::id()));
    let conf = serde_json::json!({
        "cniVersion": "1.0.0", "name": "bench", "type": "aether-cni", "hostIP": "10.0.0.1",
        "stateDir": state.display().to_string(),
        "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "10.244.1.5/24"}]}
    })
    .to_string();
    let plugin = |cmd: &str| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_aether-cni"))
            .env("CNI_COMMAND", cmd)
            .env("CNI_CONTAINERID", "bench")
            .env("CNI_NETNS", path)
            .env("CNI_IFNAME", "eth0")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(conf.as_bytes()).unwrap();
        assert!(child.wait().unwrap().success(), "{cmd}");
    };
    let exec = measure("plugin exec: CNI ADD + DEL (whole process)", || {
        plugin("ADD");
        plugin("DEL");
    });

    netns.run(|| aether_rules::install(&rs, None).unwrap()).unwrap();
    let check = measure("in-process CHECK (dump + compare)", || {
        assert!(netns.run(|| aether_rules::verify(&rs).unwrap()).unwrap().is_empty())
    });
    let list = measure("exec: nft list table (no comparison)", || {
        sh(&["ip", "netns", "exec", ns_name, "nft", "list", "table", "ip", "aether_capture"]);
    });
    let _ = std::fs::remove_dir_all(&state);

    println!();
    println!("ratio shell-out / in-process          {:>6.1}x", ms(shell.1) / ms(inproc.1));
    println!("ratio plugin exec / in-process        {:>6.1}x", ms(exec.1) / ms(inproc.1));
    println!("ratio shell-out / plugin exec         {:>6.1}x", ms(shell.1) / ms(exec.1));
    println!("ratio nft list exec / in-process CHECK {:>5.1}x", ms(list.1) / ms(check.1));
}
