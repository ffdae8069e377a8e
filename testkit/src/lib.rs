//! Shared test support. Tests may shell out to `ip` and `nft` to set up and observe; the
//! product never does.

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

pub mod http;
pub mod memcg;

/// A number unique in this process, for names.
fn next() -> u32 {
    COUNTER.fetch_add(1, Ordering::SeqCst)
}

/// Whether root tests may run. Without root they skip with one loud line, unless
/// `AETHER_REQUIRE_ROOT_TESTS=1`, where a skip is a failure.
#[must_use]
pub fn root_or_skip(test: &str) -> bool {
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    if std::env::var("AETHER_REQUIRE_ROOT_TESTS").as_deref() == Ok("1") {
        panic!("{test}: needs root, and AETHER_REQUIRE_ROOT_TESTS=1 forbids skipping it");
    }
    {
        // Straight to stderr: libtest captures eprintln!, and a skip must be seen.
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED (needs root): {test} -- run as root, or set AETHER_REQUIRE_ROOT_TESTS=1 to make this a failure"
        );
    }
    false
}

/// Runs a command and returns its stdout; panics with its stderr if it fails.
pub fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(out.status.success(), "{cmd} {}: {}\n{}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Like `run`, but returns the exit status and output instead of panicking.
pub fn try_run(cmd: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("{cmd}: {e}"));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A directory of one test's own under the temp dir (`aether-<tag>-<pid>`), made empty;
/// removed on drop, also when the test panics.
pub struct ScratchDir(pub std::path::PathBuf);

impl ScratchDir {
    pub fn new(tag: &str) -> ScratchDir {
        let d = std::env::temp_dir().join(format!("aether-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        ScratchDir(d)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A network namespace made for one test (`ip netns add`), with `lo` up; deleted on drop,
/// also when the test panics.
pub struct TestNetns {
    pub name: String,
}

impl TestNetns {
    pub fn new(tag: &str) -> Self {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let name = format!("aeth-{tag}-{}-{n}", std::process::id());
        run("ip", &["netns", "add", &name]);
        let ns = TestNetns { name };
        ns.exec("ip", &["link", "set", "lo", "up"]);
        ns
    }

    pub fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }

    /// Runs a command inside the namespace and returns its stdout.
    pub fn exec(&self, cmd: &str, args: &[&str]) -> String {
        let mut full = vec!["netns", "exec", &self.name, cmd];
        full.extend_from_slice(args);
        run("ip", &full)
    }

    pub fn try_exec(&self, cmd: &str, args: &[&str]) -> (bool, String, String) {
        let mut full = vec!["netns", "exec", &self.name, cmd];
        full.extend_from_slice(args);
        try_run("ip", &full)
    }

    /// `nft list ruleset`, `ip rule` and `ip route show table <table>` of the namespace:
    /// everything capture touches, as the kernel reports it.
    pub fn snapshot(&self, table: u32) -> String {
        format!(
            "# nft list ruleset\n{}# ip -4 rule\n{}# ip -4 route show table {table}\n{}",
            self.exec("nft", &["list", "ruleset"]),
            self.exec("ip", &["-4", "rule"]),
            match self.try_exec("ip", &["-4", "route", "show", "table", &table.to_string()]) {
                (true, out, _) => out,
                // The kernel creates a FIB table with its first route and keeps it, empty,
                // after the last one goes: no table and an empty one hold the same routes.
                (false, _, err) if err.contains("FIB table does not exist") => String::new(),
                (false, _, err) => panic!("ip route show table {table}: {err}"),
            },
        )
    }
}

impl TestNetns {
    /// [`TestNetns::snapshot`] plus `ip -6 rule` and `ip -6 route show table <table>`: the
    /// state of a pod with IPv6 addresses.
    pub fn snapshot_with_ipv6(&self, table: u32) -> String {
        format!(
            "{}# ip -6 rule\n{}# ip -6 route show table {table}\n{}",
            self.snapshot(table),
            self.exec("ip", &["-6", "rule"]),
            match self.try_exec("ip", &["-6", "route", "show", "table", &table.to_string()]) {
                (true, out, _) => out,
                (false, _, err) if err.contains("FIB table does not exist") => String::new(),
                (false, _, err) => panic!("ip -6 route show table {table}: {err}"),
            },
        )
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

/// Compares `actual` with the golden file `testdata/golden/<name>`. With
/// `AETHER_BLESS=1` the file is (re)written instead, for a person to review with `git diff`.
pub fn assert_golden(name: &str, actual: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/golden").join(name);
    if std::env::var("AETHER_BLESS").as_deref() == Ok("1") {
        std::fs::write(&path, actual).unwrap();
        eprintln!("blessed {} -- review it with git diff before committing", path.display());
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("golden file {}: {e} (write it with AETHER_BLESS=1 and review it)", path.display()));
    if expected != actual {
        panic!("{} differs from the kernel's output.\n--- expected\n{expected}\n--- actual\n{actual}", path.display());
    }
}

/// xorshift64*: randomness for tests that a printed seed replays (kill moments, random
/// documents). Not for anything but tests.
pub struct Rng {
    state: u64,
    seed: u64,
}

impl Rng {
    /// Seeded from `$env_var` when set (to replay a run), else from the clock; the seed is
    /// printed with `label`, with the variable that repeats it.
    pub fn seeded(env_var: &str, label: &str) -> Rng {
        let seed = std::env::var(env_var).ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1
        });
        println!("{label}: seed {seed} ({env_var}={seed} repeats it)");
        Rng::new(seed)
    }

    /// From `seed` (0 would stay 0: it is made 1).
    pub fn new(seed: u64) -> Rng {
        Rng { state: seed.max(1), seed }
    }

    /// The seed it started from (for failure messages).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn next(&mut self) -> u64 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        self.state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform enough below `n` (0 for `n` 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// True once in `one_in`, on average.
    pub fn chance(&mut self, one_in: u64) -> bool {
        self.below(one_in) == 0
    }
}

/// The installer's binary, `aether-cni-installer`: `$AETHER_INSTALLER_BIN` (`make test` passes
/// it), or else `<target>/debug/aether-cni-installer`, built once per test process with
/// `cargo build -p aether-installer --features fault-injection` so that it is never stale (a
/// crate cannot name another package's binary through `CARGO_BIN_EXE_*`, hence the build).
pub fn installer_bin() -> &'static std::path::Path {
    use std::path::{Path, PathBuf};
    static BIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("AETHER_INSTALLER_BIN") {
            let p = PathBuf::from(p);
            assert!(p.is_file(), "AETHER_INSTALLER_BIN={} is not a file", p.display());
            return p;
        }
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace").to_path_buf();
        let target =
            std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace.join("target"));
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = std::process::Command::new(&cargo)
            .args(["build", "-q", "-p", "aether-installer", "--features", "aether-installer/fault-injection"])
            .current_dir(&workspace)
            .env("CARGO_TARGET_DIR", &target)
            .status()
            .unwrap_or_else(|e| {
                panic!("running {cargo:?} build -p aether-installer: {e} (or set AETHER_INSTALLER_BIN)")
            });
        assert!(
            status.success(),
            "cargo build -p aether-installer failed ({status}); fix it or set AETHER_INSTALLER_BIN"
        );
        let bin = target.join("debug").join("aether-cni-installer");
        assert!(bin.is_file(), "{} missing after cargo build -p aether-installer", bin.display());
        bin
    })
}
