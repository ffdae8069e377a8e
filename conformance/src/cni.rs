//! Finding the built `aether-cni` binary, and running it as a container runtime does.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use serde_json::Value;

/// The binary under test: `$AETHER_CNI_BIN`, or else `<target>/debug/aether-cni`, built
/// once per test process with `cargo build -p aether-cni --features fault-injection` (the
/// features `make test` uses) so that it is never stale. A crate cannot name another
/// package's binary through `CARGO_BIN_EXE_*`, hence the build.
pub fn cni_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("AETHER_CNI_BIN") {
            let p = PathBuf::from(p);
            assert!(p.is_file(), "AETHER_CNI_BIN={} is not a file", p.display());
            return p;
        }
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace").to_path_buf();
        let target =
            std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace.join("target"));
        let cargo = std::env::var_os("CARGO")
            .or_else(|| option_env!("CARGO").map(Into::into))
            .unwrap_or_else(|| "cargo".into());
        let status = Command::new(&cargo)
            .args(["build", "-q", "-p", "aether-cni", "--features", "aether-cni/fault-injection"])
            .current_dir(&workspace)
            .env("CARGO_TARGET_DIR", &target)
            .status()
            .unwrap_or_else(|e| panic!("running {cargo:?} build -p aether-cni: {e} (or set AETHER_CNI_BIN)"));
        assert!(status.success(), "cargo build -p aether-cni failed ({status}); fix the build or set AETHER_CNI_BIN");
        let bin = target.join("debug").join("aether-cni");
        assert!(bin.is_file(), "{} missing after cargo build -p aether-cni", bin.display());
        bin
    })
}

/// What one plugin run printed and returned.
#[derive(Debug)]
pub struct Outcome {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

impl Outcome {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {:?}", self.stdout))
    }

    /// The CNI error printed on failure: (code, msg + details).
    pub fn error(&self) -> (u64, String) {
        assert!(!self.ok, "expected a failure, got success: {}", self.stdout);
        let v = self.json();
        let text = format!("{} {}", v["msg"].as_str().unwrap_or(""), v["details"].as_str().unwrap_or(""));
        (v["code"].as_u64().expect("error has a code"), text)
    }
}

/// Runs the plugin with a clean environment (`env`) and `conf` on stdin, inside the network
/// namespace at `run_in` (the simulated node's host netns: where a runtime runs plugins).
pub fn run(run_in: &str, env: &[(&str, &str)], conf: &Value) -> Outcome {
    spawn_in(cni_bin(), Some(run_in), &[], env, conf.to_string().as_bytes())
}

/// Like `run`, with another build of the plugin (a release before, built from the history).
pub fn run_bin(bin: &Path, run_in: &str, env: &[(&str, &str)], conf: &Value) -> Outcome {
    spawn_in(bin, Some(run_in), &[], env, conf.to_string().as_bytes())
}

/// Like `run_cli`, with another build of the plugin.
pub fn run_cli_bin(bin: &Path, run_in: &str, args: &[&str], stdin: &[u8]) -> Outcome {
    spawn_in(bin, Some(run_in), args, &[], stdin)
}

/// Like `run`, in the caller's own network namespace (the tests' stand-in for the node).
pub fn run_here(env: &[(&str, &str)], conf: &Value) -> Outcome {
    spawn_in(cni_bin(), None, &[], env, conf.to_string().as_bytes())
}

/// Runs the binary as the operator CLI (`args`, e.g. `["services", "--state-dir", D,
/// "apply"]`) with a clean environment and `stdin`, inside the network namespace at `run_in`
/// (the simulated node's host netns: where the node agent runs it).
pub fn run_cli(run_in: &str, args: &[&str], stdin: &[u8]) -> Outcome {
    spawn_in(cni_bin(), Some(run_in), args, &[], stdin)
}

/// Like `run_cli`, in the caller's own network namespace.
pub fn run_cli_here(args: &[&str], stdin: &[u8]) -> Outcome {
    spawn_in(cni_bin(), None, args, &[], stdin)
}

fn spawn_in(bin: &Path, run_in: Option<&str>, args: &[&str], env: &[(&str, &str)], stdin: &[u8]) -> Outcome {
    let ns = run_in.map(|p| std::fs::File::open(p).unwrap_or_else(|e| panic!("open {p}: {e}")));
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(fd) = ns.as_ref().map(|f| f.as_raw_fd()) {
        // SAFETY: setns is async-signal-safe; the fd stays open in the parent until spawn returns.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
    drop(ns);
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let out = child.wait_with_output().unwrap();
    Outcome {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}
