//! The installer (`aether-cni-installer`) as the benches run it on their node: started on a
//! state directory of theirs, serving the agent's socket, its CPU time and memory read from
//! /proc, change documents POSTed to it, and the memory limit the chart computes for it.
//! Shared by `services_scale` and `release_before`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use aether_testkit::memcg::ScratchMemcg;
use serde_json::{json, Value};

use crate::process::Sample;
use crate::services_doc::ms;

/// `aether-cni-installer` on the bench's node (reconciler off; CNI directories of its own),
/// stopped (SIGTERM) when dropped.
pub struct InstallerProcess {
    pub child: std::process::Child,
    pub socket: PathBuf,
    dir: PathBuf,
    /// Each thread's CPU time when `cpu` last saw it, by thread ID: a thread that ended
    /// (a blocking pool's, idle) still counts what it had used.
    seen: std::cell::RefCell<BTreeMap<u64, u64>>,
}

impl InstallerProcess {
    pub fn start(state: &Path) -> InstallerProcess {
        InstallerProcess::start_in(state, None)
    }

    /// Started inside the memory cgroup `cg`, as a node runs it in its container's: this
    /// release's installer (`aether_testkit::installer_bin`, `AETHER_INSTALLER_BIN` in make
    /// bench) with the plugin `cargo bench` built.
    pub fn start_in(state: &Path, cg: Option<&ScratchMemcg>) -> InstallerProcess {
        let plugin = Path::new(env!("CARGO_BIN_EXE_aether-cni"));
        InstallerProcess::start_release(aether_testkit::installer_bin(), plugin, state, cg)
    }

    /// The installer `installer` installing the plugin `plugin`, either of this release or of
    /// a release before (`release_before`). The one place that knows how each release's
    /// installer is started: the flags below and the socket at `<state>/agent/services.sock`
    /// are those of every release since 3499904 (its installer/src/args.rs: the same names,
    /// the same default socket); a release that takes others is adapted here.
    pub fn start_release(installer: &Path, plugin: &Path, state: &Path, cg: Option<&ScratchMemcg>) -> InstallerProcess {
        let dir = state.with_extension("installer");
        for d in ["bin", "conf"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        let mut cmd = Command::new(installer);
        cmd.arg(format!("--plugin-binary={}", plugin.display()))
            .arg(format!("--cni-bin-dir={}", dir.join("bin").display()))
            .arg(format!("--cni-conf-dir={}", dir.join("conf").display()))
            .arg(format!("--state-dir={}", state.display()))
            .args(["--listen=127.0.0.1:0", "--host-ip=10.250.0.1", "--reconcile=false"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("installer.log")).unwrap());
        if let Some(cg) = cg {
            cg.enter_on_spawn(&mut cmd);
        }
        let child = cmd.spawn().expect("spawn aether-cni-installer");
        let inst = InstallerProcess { child, socket: state.join("agent/services.sock"), dir, seen: Default::default() };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(&inst.socket).is_err() {
            assert!(Instant::now() < deadline, "the installer never served its socket:\n{}", inst.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        inst
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("installer.log")).unwrap_or_default()
    }

    /// The process's CPU time so far, all threads (each task's schedstat: nanoseconds on a
    /// CPU, finer than the clock ticks of /proc/PID/stat), those that ended as last seen.
    pub fn cpu(&self) -> Duration {
        let mut seen = self.seen.borrow_mut();
        for t in std::fs::read_dir(format!("/proc/{}/task", self.child.id())).unwrap().flatten() {
            let Some(tid) = t.file_name().to_str().and_then(|n| n.parse().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(t.path().join("schedstat")) else { continue };
            if let Some(ns) = stat.split_whitespace().next().and_then(|v| v.parse().ok()) {
                seen.insert(tid, ns);
            }
        }
        Duration::from_nanos(seen.values().sum())
    }
}

impl InstallerProcess {
    /// The process's CPU time so far (user + sys of /proc/PID/stat: threads that ended
    /// included, in clock ticks): for a long run.
    pub fn cpu_ticks(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap();
        // The fields after the command name (which is in parentheses and may hold spaces).
        let rest: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
        let ticks: u64 = rest[11].parse::<u64>().unwrap() + rest[12].parse::<u64>().unwrap();
        let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
        Duration::from_nanos(ticks * 1_000_000_000 / per_second)
    }
}

impl InstallerProcess {
    /// The process's peak resident memory so far (VmHWM), MiB.
    pub fn peak_rss_mib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kib: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmHWM in /proc/PID/status");
        kib / 1024.0
    }
}

impl Drop for InstallerProcess {
    fn drop(&mut self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `doc` POSTed to `installer` as the change from generation `g` (moved on by one): the
/// sample (wall time of the round trip; CPU time of the installer process, all threads) and
/// the answer's body (status 200 asserted).
pub fn post_change(installer: &InstallerProcess, g: &mut u64, mut doc: Value) -> (Sample, String) {
    (doc["baseGeneration"], doc["generation"]) = (json!(*g), json!(*g + 1));
    *g += 1;
    let text = serde_json::to_vec(&doc).unwrap();
    // The CPU time read first: the round trip holds no reading of /proc.
    let c = installer.cpu();
    let t = Instant::now();
    let (status, body) = aether_apply_client::post_apply(&installer.socket, &text, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}\n{}", installer.log()));
    let sample =
        Sample { wall_ms: ms(t.elapsed()), cpu_ms: ms(installer.cpu() - c), rss_mib: 0.0, ..Sample::default() };
    let body = String::from_utf8_lossy(&body).into_owned();
    assert_eq!(status, 200, "{body}");
    (sample, body)
}

pub const MIB: u64 = 1 << 20;

/// The chart's numbers for the installer's memory limit (`serviceLayerMemory` in
/// charts/aether-cni/values.yaml).
pub struct ChartMemory {
    pub base_mib: u64,
    pub bytes_per_service: u64,
}

impl ChartMemory {
    pub fn read() -> ChartMemory {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/aether-cni/values.yaml");
        let text = std::fs::read_to_string(&path).unwrap();
        // The `key: value` lines indented under `serviceLayerMemory:` (comments among them).
        let value = |key: &str| -> u64 {
            text.lines()
                .skip_while(|l| !l.starts_with("serviceLayerMemory:"))
                .skip(1)
                .take_while(|l| l.starts_with(' ') || l.is_empty())
                .find_map(|l| l.trim().strip_prefix(key)?.strip_prefix(':')?.trim().parse().ok())
                .unwrap_or_else(|| panic!("{}: no serviceLayerMemory.{key}", path.display()))
        };
        ChartMemory { base_mib: value("baseMiB"), bytes_per_service: value("bytesPerService") }
    }

    /// The limit the chart computes (charts/aether-cni/templates/_helpers.tpl,
    /// docs/operating.md "Memory"): (baseMiB x 1 MiB + pods x Services x families x
    /// bytesPerService) x 10/9, rounded up to a MiB.
    pub fn limit(&self, services: u64, pods: u64, families: u64) -> u64 {
        let bytes = self.base_mib * MIB + pods * services * families * self.bytes_per_service;
        (bytes * 10).div_ceil(9).div_ceil(MIB) * MIB
    }
}
