//! make bench: how long a node runs without the aether-cni entry after another CNI rewrites
//! its configuration, from the overwrite to the chained copy written back (goal: < 100 ms).
//! Three ways the entry gets lost, side by side, with one atomic write of the same file
//! (temp file, fsync, rename, fsync of the directory) for scale. Medians and ratios.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use aether_installer::{files, start, InstallArgs, NodeChecks};
use clap::Parser;

const ROUNDS: u32 = 200;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: InstallArgs,
}

fn flannel(mtu: u32) -> String {
    format!(
        r#"{{"name":"cbr0","cniVersion":"1.0.0","plugins":[{{"type":"flannel","delegate":{{"mtu":{mtu}}}}},{{"type":"portmap","capabilities":{{"portMappings":true}}}}]}}"#
    )
}

/// Waits until the chained file holds `needle`, woken by inotify (no polling delay).
fn wait_repaired(inotify: &mut inotify::Inotify, chained: &Path, needle: &str) -> Instant {
    let mut buf = [0u8; 4096];
    loop {
        if fs::read_to_string(chained).is_ok_and(|t| t.contains(needle) && t.contains("aether-cni")) {
            return Instant::now();
        }
        let _ = inotify.read_events_blocking(&mut buf);
    }
}

fn stats(mut v: Vec<Duration>) -> (f64, f64, f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let at = |q: f64| ms(v[((v.len() as f64 - 1.0) * q).round() as usize]);
    (at(0.5), at(0.9), at(0.99), ms(*v.last().unwrap()))
}

struct QuietNode;

impl NodeChecks for QuietNode {
    fn validate_entry(&self, entry: &[u8]) -> Result<(), aether_node::config::ConfigError> {
        serde_json::from_slice::<serde_json::Value>(entry)
            .map(drop)
            .map_err(|e| aether_node::config::ConfigError::NotJson { why: e.to_string() })
    }
    fn kernel_checks(&self) -> Result<(), aether_node::probe::ProbeError> {
        Ok(())
    }
    fn node_counters(&self) -> Result<String, aether_node::services::ServicesError> {
        Ok(String::new())
    }
}

fn main() {
    let root = std::env::temp_dir().join(format!("aether-repair-bench-{}", std::process::id()));
    let _ = fs::remove_dir_all(&root);
    let (bin, conf, state) = (root.join("bin"), root.join("net.d"), root.join("state"));
    for d in [&bin, &conf, &state] {
        fs::create_dir_all(d).unwrap();
    }
    let primary = conf.join("10-flannel.conflist");
    fs::write(&primary, flannel(1000)).unwrap();
    let args = Cli::parse_from([
        "install".to_string(),
        format!("--cni-bin-dir={}", bin.display()),
        format!("--cni-conf-dir={}", conf.display()),
        format!("--state-dir={}", state.display()),
        "--listen=127.0.0.1:0".into(),
        "--host-ip=10.0.0.1".into(),
    ])
    .args;
    // The plugin's parser costs microseconds; the bench keeps the installer crate alone.
    let plugin = QuietNode;
    // (No log subscriber here: the installer's 600 "repaired" lines go nowhere.)
    let running = start(args, plugin, vec![0u8; 1 << 20]).unwrap();
    let chained = conf.join("00-aether-cni.conflist");
    let mut inotify = inotify::Inotify::init().unwrap();
    inotify.watches().add(&conf, inotify::WatchMask::MOVED_TO | inotify::WatchMask::CLOSE_WRITE).unwrap();
    wait_repaired(&mut inotify, &chained, "1000");

    let mut mtu = 1000;
    let mut measure = |change: &dyn Fn(u32)| -> Vec<Duration> {
        (0..ROUNDS)
            .map(|_| {
                mtu += 1;
                let t0 = Instant::now();
                change(mtu);
                wait_repaired(&mut inotify, &chained, &format!("\"mtu\":{mtu}")) - t0
            })
            .collect()
    };
    let replaced = measure(&|m| {
        let tmp = conf.join(".flannel.tmp");
        fs::write(&tmp, flannel(m)).unwrap();
        fs::rename(&tmp, &primary).unwrap();
    });
    let in_place = measure(&|m| fs::write(&primary, flannel(m)).unwrap());
    let renamed = measure(&|m| {
        // The main CNI renames its file (e.g. a new priority prefix) with new content.
        let from = fs::read_dir(&conf)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.to_string_lossy().contains("-flannel."))
            .unwrap();
        fs::write(&from, flannel(m)).unwrap_or(());
        let to = conf.join(if from.to_string_lossy().contains("10-") {
            "20-flannel.conflist"
        } else {
            "10-flannel.conflist"
        });
        fs::rename(&from, &to).unwrap();
    });
    let floor: Vec<Duration> = (0..ROUNDS)
        .map(|i| {
            let p = root.join("floor.conflist");
            let body = flannel(i);
            let t0 = Instant::now();
            files::write_atomic(&p, body.as_bytes(), 0o644).unwrap();
            t0.elapsed()
        })
        .collect();
    let repairs = running.shared.metrics.repairs.with_label_values(&["conflist"]).get();
    running.stop().unwrap();
    let _ = fs::remove_dir_all(&root);

    println!("installer repair latency: overwrite of the primary -> chained copy written back ({ROUNDS} rounds each; goal < 100 ms)");
    println!("{:<58} {:>9} {:>9} {:>9} {:>9} {:>12}", "", "median", "p90", "p99", "max", "goal/median");
    for (what, v) in [
        ("primary replaced by rename (atomic writer)", replaced),
        ("primary rewritten in place (truncate + write)", in_place),
        ("primary renamed to another name", renamed),
        ("for scale: one atomic write (fsync, rename, fsync of dir)", floor),
    ] {
        let (p50, p90, p99, max) = stats(v);
        println!("{what:<58} {p50:>7.2}ms {p90:>7.2}ms {p99:>7.2}ms {max:>7.2}ms {:>11.0}x", 100.0 / p50);
    }
    println!(
        "(the installer counted {repairs} repairs; a repair is visible at its rename, before the directory fsync)"
    );
}
