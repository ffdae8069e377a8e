//! The operator commands: `doctor` and `inspect`, driven as an operator would.

mod common;

use std::process::{Command, Stdio};

use aether_testkit::{root_or_skip, TestNetns};
use common::{bin, conf, run_plugin};
use serde_json::json;

fn cli(args: &[&str]) -> (bool, String) {
    let out = Command::new(bin()).args(args).output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn doctor_proves_the_kernel_can_hold_the_ruleset_without_touching_the_node() {
    if !root_or_skip("doctor") {
        return;
    }
    let host_before = aether_testkit::run("nft", &["list", "ruleset"]);
    let (ok, text) = cli(&["doctor"]);
    assert!(ok, "{text}");
    // This kernel holds all of it (the IPv6 and Service layer tests prove as much), so every
    // check says ok. (The IPv6 line once said "no" here: the probe's netns had `lo` down, and
    // IPv6 refuses a route through a down device; a pod's `lo` is up.)
    // Five kernel checks, and no connect-time socket load balancer beside us.
    assert_eq!(text.matches("\nok ").count(), 6, "{text}");
    assert!(text.contains("\nok    no connect-time socket load balancer"), "{text}");
    assert!(!text.contains("\nno ") && !text.contains("FAIL"), "{text}");
    assert!(
        text.contains("for IPv4 and IPv6 pods") && text.contains("Service layer, for IPv4 and IPv6 Service ranges"),
        "{text}"
    );
    assert_eq!(aether_testkit::run("nft", &["list", "ruleset"]), host_before, "doctor changed the host's ruleset");
}

#[test]
fn inspect_shows_the_pod_and_says_whether_the_kernel_holds_it() {
    if !root_or_skip("inspect") {
        return;
    }
    let ns = TestNetns::new("insp");
    let c = conf("1.0.0", json!({"excludeOutboundPorts": [2222]}));
    let state = c["stateDir"].as_str().unwrap().to_string();
    assert!(run_plugin("ADD", Some(&ns.path()), &c, &[]).ok);
    let (ok, text) = cli(&["inspect", "ctr-0123", "--state-dir", &state]);
    assert!(ok, "{text}");
    for want in [
        "pod shop/cart-0 container ctr-0123",
        "elements = { 2222 }",
        "tproxy to :18001",
        "kernel: intact",
        "no snapshot applied",
    ] {
        assert!(text.contains(want), "inspect should show {want:?}:\n{text}");
    }
    // The same by netns path.
    assert!(cli(&["inspect", &ns.path(), "--state-dir", &state]).0);
    // Tampered: inspect says what differs and exits non-zero.
    ns.exec("nft", &["flush", "set", "ip", "aether_capture", "excluded_ports"]);
    let (ok, text) = cli(&["inspect", "ctr-0123", "--state-dir", &state]);
    assert!(!ok && text.contains("NOT INTACT") && text.contains("element 2222 is missing"), "{text}");
    // Unknown target.
    let (ok, text) = cli(&["inspect", "no-such-container", "--state-dir", &state]);
    assert!(!ok && text.contains("neither a recorded container nor a usable netns"), "{text}");
}

/// The CLI with `stdin` given (never the test runner's own stdin): (exit code, stdout, stderr).
fn cli_with(args: &[&str], stdin: std::process::Stdio) -> (i32, String, String) {
    let out = Command::new(bin())
        .args(args)
        .env_clear()
        .stdin(stdin)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn fresh_state_dir() -> String {
    let d = common::state_dir();
    std::fs::create_dir_all(&d).unwrap();
    d
}

const EXAMPLE_SNAPSHOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/services/example.json");

#[test]
fn help_says_how_the_binary_behaves_as_a_plugin_and_where_the_docs_are() {
    let (ok, text) = cli(&["--help"]);
    assert!(ok, "{text}");
    for want in [
        "With CNI_COMMAND set",
        "reads the network configuration (JSON) on stdin",
        "on stdout",
        "logFile",
        "aether.io/capture",
        "snapshot.schema.json",
        "--state-dir (default /var/run/aether-cni",
    ] {
        assert!(text.contains(want), "--help should say {want:?}:\n{text}");
    }
    // Every page --help sends the reader to is in the repository and has what --help says
    // is there.
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for (page, headings) in [
        ("docs/configuration.md", &["# Configuration", "## Pod annotations"][..]),
        (
            "docs/operating.md",
            &["## Operating it", "**CNI error codes**", "**Reading `inspect`.**", "**Finding a pod's netns.**"][..],
        ),
        ("docs/agent.md", &["## Commands", "## The snapshot"][..]),
        ("testdata/services/snapshot.schema.json", &[][..]),
    ] {
        assert!(text.contains(page), "--help should name {page}:\n{text}");
        let body = std::fs::read_to_string(repo.join(page)).unwrap_or_else(|e| panic!("{page}: {e}"));
        for h in headings {
            assert!(body.lines().any(|l| l.starts_with(h)), "{page} has no line starting {h:?}");
        }
    }
    let (_, text) = cli(&["services", "apply", "--help"]);
    assert!(text.contains("-f, --file <FILE>") && text.contains("`-` is stdin"), "{text}");
}

#[test]
fn services_apply_from_a_terminal_says_how_to_pass_a_snapshot_instead_of_waiting() {
    let state = fresh_state_dir();
    let (mut master, mut slave) = (0, 0);
    // SAFETY: openpty fills the two descriptors; null name, termios and winsize are allowed.
    let rc =
        unsafe { libc::openpty(&mut master, &mut slave, std::ptr::null_mut(), std::ptr::null(), std::ptr::null()) };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors were just opened and are owned here alone.
    let (master, slave) = unsafe {
        use std::os::fd::FromRawFd;
        (std::os::fd::OwnedFd::from_raw_fd(master), std::os::fd::OwnedFd::from_raw_fd(slave))
    };
    let mut child = Command::new(bin())
        .args(["services", "--state-dir", &state, "apply"])
        .env_clear()
        .stdin(std::process::Stdio::from(slave))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // It must answer at once; a process still waiting on the terminal after 20 s fails the test.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("services apply waited on a terminal stdin instead of saying how to pass a snapshot");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    drop(master);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("-f FILE") && stderr.contains("stdin is a terminal"), "{stderr}");
    assert!(!std::path::Path::new(&state).join("services/snapshot.json").exists(), "nothing is stored");
}

#[test]
fn services_apply_takes_a_file_or_dash_for_stdin() {
    let state = fresh_state_dir();
    let (code, out, err) =
        cli_with(&["services", "--state-dir", &state, "apply", "-f", EXAMPLE_SNAPSHOT], Stdio::null());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"generation\": 42"), "{out}");
    let mut snap: serde_json::Value = serde_json::from_slice(&std::fs::read(EXAMPLE_SNAPSHOT).unwrap()).unwrap();
    snap["generation"] = json!(43);
    let file = std::path::Path::new(&state).join("snap-43.json");
    std::fs::write(&file, snap.to_string()).unwrap();
    let (code, out, err) = cli_with(
        &["services", "--state-dir", &state, "apply", "-f", "-"],
        Stdio::from(std::fs::File::open(&file).unwrap()),
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"generation\": 43"), "{out}");
    let (code, _, err) =
        cli_with(&["services", "--state-dir", &state, "apply", "-f", "/nonexistent/snap.json"], Stdio::null());
    assert!(code != 0 && err.contains("cannot read /nonexistent/snap.json"), "{code} {err}");
}

#[test]
fn empty_results_print_nothing_or_say_none() {
    let state = fresh_state_dir();
    let (code, out, err) = cli_with(&["services", "--state-dir", &state, "demand", "--format", "text"], Stdio::null());
    assert_eq!((code, out.as_str()), (0, ""), "no demand prints nothing, not an empty line: {err}");
    let (code, out, _) = cli_with(&["services", "--state-dir", &state, "demand"], Stdio::null());
    assert_eq!(code, 0);
    assert_eq!(serde_json::from_str::<serde_json::Value>(&out).unwrap(), json!({"demand": []}));
    let (code, out, _) =
        cli_with(&["services", "--state-dir", &state, "counters", "--format", "prometheus"], Stdio::null());
    assert_eq!(code, 0);
    assert!(out.ends_with("counter\n") && !out.ends_with("\n\n"), "one trailing newline: {out:?}");
    let (code, out, _) = cli_with(&["inspect", "--state-dir", &state], Stdio::null());
    assert_eq!(code, 0);
    assert_eq!(out, format!("no attachment records in {state} (no pod is attached on this node)\n"));
}

#[test]
fn a_state_directory_that_is_a_file_or_a_dangling_symlink_is_named_for_what_it_is() {
    let base = fresh_state_dir();
    let file = format!("{base}/a-file");
    std::fs::write(&file, "x").unwrap();
    let dangling = format!("{base}/dangling");
    std::os::unix::fs::symlink(format!("{base}/nowhere"), &dangling).unwrap();
    for (dir, want) in [(&file, "is a regular file, not a directory"), (&dangling, "is a dangling symlink")] {
        for args in [
            vec!["services", "--state-dir", dir, "counters"],
            vec!["services", "--state-dir", dir, "demand"],
            vec!["services", "--state-dir", dir, "apply", "-f", EXAMPLE_SNAPSHOT],
            vec!["inspect", "--state-dir", dir],
        ] {
            let (code, _, err) = cli_with(&args, Stdio::null());
            assert!(code != 0 && err.contains(dir.as_str()) && err.contains(want), "{args:?}: {err}");
            assert!(!err.contains("File exists"), "{err}");
        }
    }
    assert!(!std::path::Path::new(&format!("{base}/nowhere")).exists(), "nothing was created behind the symlink");
    // The plugin's ADD says the same (an unmanaged pod still needs no state, so a managed one).
    if root_or_skip("state dir for ADD") {
        let ns = TestNetns::new("sdl");
        let c = conf("1.0.0", json!({"stateDir": dangling}));
        let out = run_plugin("ADD", Some(&ns.path()), &c, &[]);
        let (code, msg) = out.error();
        assert!(code == 5 && msg.contains("dangling symlink"), "{code} {msg}");
        assert_eq!(ns.try_exec("nft", &["list", "ruleset"]).1, "", "nothing left in the pod");
    }
}

#[test]
fn inspect_without_a_pod_lists_every_attachment_and_whether_it_is_intact() {
    if !root_or_skip("inspect list") {
        return;
    }
    let state = fresh_state_dir();
    let (a, b) = (TestNetns::new("insa"), TestNetns::new("insb"));
    let c = conf("1.0.0", json!({"stateDir": state}));
    let pod = |ctr: &str, name: &str| {
        [("CNI_CONTAINERID", ctr.to_string()), ("CNI_ARGS", format!("K8S_POD_NAMESPACE=shop;K8S_POD_NAME={name}"))]
    };
    for (ns, ctr, name) in [(&a, "ctr-a", "cart-0"), (&b, "ctr-b", "web-1")] {
        let env = pod(ctr, name);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert!(run_plugin("ADD", Some(&ns.path()), &c, &env).ok);
    }
    let (code, _, err) = cli_with(&["services", "--state-dir", &state, "apply", "-f", EXAMPLE_SNAPSHOT], Stdio::null());
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = cli_with(&["inspect", "--state-dir", &state], Stdio::null());
    assert_eq!(code, 0, "{out}{err}");
    fn row<'a>(out: &'a str, ctr: &str) -> &'a str {
        out.lines().find(|l| l.contains(ctr)).unwrap_or_else(|| panic!("no row for {ctr}:\n{out}"))
    }
    assert!(out.contains("2 attachments") && out.contains("POD") && out.contains("SERVICE LAYER"), "{out}");
    for (ctr, ns, pod) in [("ctr-a", &a, "shop/cart-0"), ("ctr-b", &b, "shop/web-1")] {
        let r = row(&out, ctr);
        assert!(r.starts_with(pod) && r.contains(&ns.path()), "{r}");
        assert!(r.contains(" intact ") && r.ends_with("intact (generation 42)"), "{r}");
    }
    // Tamper with one pod's capture and another's Service layer: named, exit non-zero.
    a.exec("nft", &["flush", "set", "ip", "aether_capture", "excluded_nets"]);
    b.exec("nft", &["flush", "set", "ip", "aether_services", "mesh_vips"]);
    let (code, out, _) = cli_with(&["inspect", "--state-dir", &state], Stdio::null());
    assert_ne!(code, 0, "{out}");
    let (ra, rb) = (row(&out, "ctr-a"), row(&out, "ctr-b"));
    assert!(ra.contains("NOT INTACT (") && ra.ends_with("intact (generation 42)"), "{ra}");
    assert!(rb.contains(" intact ") && rb.contains("NOT INTACT (") && rb.contains("generation 42"), "{rb}");
    // A pod whose netns is gone (the runtime never ran DEL): listed as such for GC.
    let gone = b.path();
    drop(b);
    let (_, out, _) = cli_with(&["inspect", "--state-dir", &state], Stdio::null());
    assert!(row(&out, "ctr-b").contains(&gone) && row(&out, "ctr-b").contains("netns gone"), "{out}");
}
