//! The Service layer served by the installer on a unix socket (`aether-cni-installer
//! --services-socket`, `POST /services/apply`), in the kernel: the installer is the built
//! binary, run by the test on a simulated node's state directory with simulated pods.
//!
//! | claim | test | control (must fail) |
//! | --- | --- | --- |
//! | whole snapshots and changes through the socket (raw HTTP and `services apply --socket`) leave the same stored files, reports and kernel sets as the same documents applied by the CLI to a second node | `documents_through_the_socket_...` | one more change on the second node only is seen by the same comparisons |
//! | a stale base answers 409 naming the stored generation and changes nothing; an older generation 409; an invalid document 400; 404/405; the CLI's exit codes | `refusals_through_the_socket_...` | a good change afterwards answers 200 and changes the files and the pod's sets |
//! | the in-process CLI and the socket interleaved on one node: every document sees the other's, every pod at the stored generation | `the_cli_and_the_socket_interleaved_...` | a change based on a generation the other one replaced answers 409 |
//! | a body over the cap answers 413 naming the cap (declared length, and a chunked body), nothing changed | `a_body_over_the_cap_...` | the same chunked client with a body under the cap gets 200 |
//! | the applier, idle, lets go of a gone pod's socket (and netns) within seconds, and goes on with the others | `the_applier_lets_go_...` | before the pod goes, the installer holds a socket for each pod (the counts the test watches fall) |
//! | an apply that outlasts the socket's deadlines is still answered (the deadline bounds reading and the wait for the turn, not the apply); a document that gets no turn in time is answered 503 and changes nothing | `an_apply_that_outlasts_...` | a client whose own timeout is shorter than the apply gets no answer, and the document is applied all the same |
//! | the socket is 0600, gone after SIGTERM; a SIGKILLed installer's socket is replaced at restart; something else at the path is refused and left | `the_socket_is_root_only_...` | after SIGKILL the socket file is still there (nobody else removes it) and refuses connections |
//!
//! Root only: without root each test skips with a loud line; with
//! `AETHER_REQUIRE_ROOT_TESTS=1` a skip is a failure. Nothing leaves the namespaces made here.

use std::io::Write;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use aether_conformance::cni::cni_bin;
use aether_conformance::layer::{apply, listing};
use aether_conformance::{control, Pod, SimNode};
use aether_testkit::{http, root_or_skip};
use serde_json::{json, Value};

fn node(test: &str, tag: &str) -> Option<SimNode> {
    root_or_skip(test).then(|| SimNode::new(tag))
}

/// The cap on a document (`MAX_SNAPSHOT_BYTES`, 64 MiB).
const CAP: usize = 64 << 20;

/// `aether-cni-installer` on a simulated node's state directory, its socket at the default
/// place (`<state-dir>/agent/services.sock`) unless given; the reconciler off (this is about
/// the socket), its bin and conf directories its own.
struct Installer {
    child: Child,
    dir: PathBuf,
    log: PathBuf,
    socket: PathBuf,
}

impl Installer {
    fn start(node: &SimNode, tag: &str) -> Installer {
        let inst = Installer::spawn(node, tag, &[]);
        inst.wait_serving();
        inst
    }

    fn spawn(node: &SimNode, tag: &str, extra: &[&str]) -> Installer {
        Installer::spawn_env(node, tag, extra, &[])
    }

    fn spawn_env(node: &SimNode, tag: &str, extra: &[&str], env: &[(&str, &str)]) -> Installer {
        let dir = std::env::temp_dir().join(format!("aether-sock-{tag}-{}", std::process::id()));
        for d in ["bin", "conf"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        let log = dir.join("installer.log");
        let child = Command::new(aether_testkit::installer_bin())
            .arg(format!("--plugin-binary={}", cni_bin().display()))
            .arg(format!("--cni-bin-dir={}", dir.join("bin").display()))
            .arg(format!("--cni-conf-dir={}", dir.join("conf").display()))
            .arg(format!("--state-dir={}", node.state_dir().display()))
            .args(["--listen=127.0.0.1:0", "--host-ip=10.244.0.1", "--reconcile=false"])
            .args(extra)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn aether-cni-installer");
        Installer { child, dir, log, socket: node.state_dir().join("agent/services.sock") }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (up to 20 s) until the socket answers.
    fn wait_serving(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while post_raw(&self.socket, "GET", "/services/apply", None).is_err() {
            assert!(Instant::now() < deadline, "the installer never served its socket:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The probes' address, from the log line that ends with it.
    fn probes(&self) -> String {
        let log = self.log();
        let line = log.lines().find(|l| l.contains("serving /healthz")).expect("the serving line");
        line.rsplit(' ').next().unwrap().to_string()
    }

    fn metric(&self, series: &str) -> f64 {
        let (_, text) = http::get(self.probes(), "/metrics").expect("the probes answer");
        http::metric(&text, series).unwrap_or_else(|| panic!("no {series} in /metrics:\n{text}"))
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: a signal to the child this test spawned, by its PID.
        assert_eq!(unsafe { libc::kill(self.child.id() as libc::pid_t, sig) }, 0);
    }

    /// SIGTERM, then its exit status (up to 20 s).
    fn stop(&mut self) -> std::process::ExitStatus {
        self.signal(libc::SIGTERM);
        self.wait_exit()
    }

    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < deadline, "the installer did not exit:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Installer {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One HTTP/1.1 request on the socket, spoken by hand: (status, body).
fn post_raw(socket: &Path, method: &str, path: &str, body: Option<&[u8]>) -> std::io::Result<(u16, String)> {
    let s = UnixStream::connect(socket)?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    // A request with a length even when empty: the socket's server speaks HTTP/1.1 only.
    http::exchange(s, method, path, Some(body.unwrap_or_default()))
}

fn post(socket: &Path, doc: &[u8]) -> (u16, String) {
    post_raw(socket, "POST", "/services/apply", Some(doc)).expect("the socket answers")
}

/// `services apply --socket PATH` with `doc` on stdin: (exit code, stdout, stderr).
fn cli_socket(socket: &Path, doc: &[u8]) -> (i32, String, String) {
    cli(&["services", "apply", "--socket", socket.to_str().unwrap()], doc)
}

/// `services --state-dir DIR apply` in this process's netns: (exit code, stdout, stderr).
fn cli_here(node: &SimNode, doc: &[u8]) -> (i32, String, String) {
    cli(&["services", "--state-dir", node.state_dir().to_str().unwrap(), "apply"], doc)
}

/// `services apply --socket PATH --timeout-seconds N`: (exit code, stdout, stderr).
fn cli_socket_within(socket: &Path, doc: &[u8], seconds: u64) -> (i32, String, String) {
    cli(&["services", "apply", "--socket", socket.to_str().unwrap(), "--timeout-seconds", &seconds.to_string()], doc)
}

fn cli(args: &[&str], doc: &[u8]) -> (i32, String, String) {
    let mut child = Command::new(cni_bin())
        .args(args)
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(doc).unwrap();
    let out = child.wait_with_output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
}

/// The stored snapshot as the node's readers see it (`services snapshot`: the installer's
/// applier keeps its changes in a journal beside the files, the CLI writes them whole).
fn files(node: &SimNode) -> String {
    let out = node.services(&["snapshot"], b"");
    assert!(out.ok, "services snapshot failed:\n{}\n{}", out.stdout, out.stderr);
    out.stdout
}

/// Each pod's result in a report, sorted (pods differ by name between nodes).
fn results(report: &Value) -> Vec<String> {
    let mut r: Vec<String> =
        report["pods"].as_array().unwrap().iter().map(|p| p["result"].as_str().unwrap().to_string()).collect();
    r.sort();
    r
}

/// What `services verify` says: the stored generation, and whether every pod is intact.
fn verify(node: &SimNode) -> (Option<u64>, bool, String) {
    let out = node.services(&["verify"], b"");
    assert!(out.ok, "services verify failed:\n{}\n{}", out.stdout, out.stderr);
    let v = out.json();
    let intact = v["pods"].as_array().unwrap().iter().all(|p| p["result"] == "intact");
    (v["generation"].as_u64(), intact, out.stdout)
}

fn service(name: &str, vip: &str, port: u16, usable: bool) -> Value {
    json!({"namespace": "shop", "name": name, "vip": vip, "ports": [{"protocol": "TCP", "port": port}], "usableEndpoints": usable})
}

fn whole(generation: u64, services: &[Value], mesh: &[&str], mode: &str) -> Vec<u8> {
    json!({"generation": generation, "mode": mode, "serviceRanges": ["10.96.0.0/16"], "meshVIPs": mesh,
           "services": services, "dialledTimeoutSeconds": 3600})
    .to_string()
    .into_bytes()
}

/// The documents an agent would send: a whole snapshot, changes of every kind, a second
/// whole snapshot (a reset), and changes after it.
fn documents() -> Vec<Vec<u8>> {
    let mut docs = vec![whole(
        1,
        &[service("cart", "10.96.1.1", 80, true), service("legacy", "10.96.1.2", 80, false)],
        &["10.96.5.5"],
        "count",
    )];
    let change = |base: u64, rest: Value| {
        let mut d = json!({"baseGeneration": base, "generation": base + 1});
        d.as_object_mut().unwrap().extend(rest.as_object().unwrap().clone());
        d.to_string().into_bytes()
    };
    docs.push(change(
        1,
        json!({"servicesPut": [service("new", "10.96.1.3", 8080, true)],
                               "endpoints": [{"namespace": "shop", "name": "legacy", "usableEndpoints": true}]}),
    ));
    docs.push(change(
        2,
        json!({"servicesRemoved": [{"namespace": "shop", "name": "cart"}], "meshVIPsAdded": ["10.96.5.6"]}),
    ));
    docs.push(change(3, json!({"mode": "refuse", "meshVIPsRemoved": ["10.96.5.5"]})));
    docs.push(change(
        4,
        json!({"servicesPut": [service("legacy", "10.96.1.9", 81, false)], "dialledTimeoutSeconds": 60}),
    ));
    docs.push(whole(
        9,
        &[
            service("a", "10.96.2.1", 80, true),
            service("b", "10.96.2.2", 443, true),
            service("c", "10.96.2.3", 80, false),
        ],
        &[],
        "refuse",
    ));
    for i in 0..5u64 {
        let vip = format!("10.96.3.{}", i + 1);
        docs.push(change(9 + i, json!({"servicesPut": [service(&format!("d{i}"), &vip, 80 + i as u16, i % 2 == 0)]})));
    }
    docs
}

#[test]
fn documents_through_the_socket_leave_what_the_cli_leaves() {
    let test = "documents_through_the_socket_leave_what_the_cli_leaves";
    let Some(mut by_socket) = node(test, "sockA") else { return };
    let mut by_cli = SimNode::new("sockB");
    let pods_a: Vec<Pod> = ["a0", "a1"].iter().map(|n| by_socket.add_pod(n)).collect();
    let pods_b: Vec<Pod> = ["b0", "b1"].iter().map(|n| by_cli.add_pod(n)).collect();
    for p in pods_a.iter().chain(&pods_b) {
        p.add(json!({}));
    }
    let inst = Installer::start(&by_socket, "docs");
    let docs = documents();
    let (mut changes, mut wholes) = (0, 0);
    for (i, doc) in docs.iter().enumerate() {
        let when = format!("document {i}: {}", String::from_utf8_lossy(doc));
        // Raw HTTP and the CLI's client in turn: both reach the same endpoint.
        let (status, body) = if i % 2 == 0 {
            post(&inst.socket, doc)
        } else {
            let (code, out, err) = cli_socket(&inst.socket, doc);
            assert_eq!(code, 0, "{when}: services apply --socket exited {code}: {err}");
            (200, out)
        };
        assert_eq!(status, 200, "{when}: {body}\n{}", inst.log());
        let (code, cli_out, err) = cli_here(&by_cli, doc);
        assert_eq!(code, 0, "{when}: the in-process apply failed: {err}");
        let (got, want): (Value, Value) =
            (serde_json::from_str(&body).unwrap(), serde_json::from_str(&cli_out).unwrap());
        assert_eq!(got["generation"], want["generation"], "{when}");
        assert_eq!(results(&got), results(&want), "{when}: the pods' results differ");
        assert!(files(&by_socket) == files(&by_cli), "{when}: the stored snapshots differ");
        let want = listing(&pods_b[0]);
        assert!(want.contains("aether_services"), "{when}: no layer in the CLI's pod");
        for p in &pods_a {
            assert_eq!(listing(p), want, "{when}: pod {} differs from the CLI's node", p.name);
        }
        if String::from_utf8_lossy(doc).contains("baseGeneration") {
            changes += 1;
        } else {
            wholes += 1;
        }
    }
    assert_eq!(
        inst.metric(r#"aether_cni_installer_services_applies_total{kind="change",outcome="applied"}"#),
        changes as f64
    );
    assert_eq!(
        inst.metric(r#"aether_cni_installer_services_applies_total{kind="whole",outcome="applied"}"#),
        wholes as f64
    );
    assert_eq!(inst.metric(r#"aether_cni_installer_services_apply_seconds_count{kind="change"}"#), changes as f64);
    assert!(inst.log().contains("applied in"), "no log line for a whole snapshot:\n{}", inst.log());
    // Control: one more change on the CLI's node only; the same comparisons see it.
    let last: Value = serde_json::from_slice(docs.last().unwrap()).unwrap();
    let last = last["generation"].as_u64().unwrap() + 1;
    let more =
        json!({"baseGeneration": last - 1, "generation": last, "servicesPut": [service("e", "10.96.4.1", 80, true)]});
    assert_eq!(cli_here(&by_cli, more.to_string().as_bytes()).0, 0);
    control(files(&by_socket) != files(&by_cli), "one more change on one node leaves the stored files equal", "");
    control(listing(&pods_a[0]) != listing(&pods_b[0]), "one more change on one node leaves the sets equal", "");
    println!(
        "{test}: {} documents ({wholes} whole, {changes} changes) through the socket left what the CLI left",
        docs.len()
    );
}

#[test]
fn refusals_through_the_socket_answer_their_status_and_change_nothing() {
    let test = "refusals_through_the_socket_answer_their_status_and_change_nothing";
    let Some(mut node) = node(test, "sockref") else { return };
    let pod = node.add_pod("a");
    pod.add(json!({}));
    let inst = Installer::start(&node, "refusals");
    // Before anything is stored: a change has no base.
    let (status, body) = post(&inst.socket, json!({"baseGeneration": 1, "generation": 2}).to_string().as_bytes());
    assert_eq!(status, 409, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(v["error"].as_str().unwrap().contains("no snapshot is stored"), "{body}");
    assert_eq!(v["storedGeneration"], Value::Null, "{body}");
    apply(&node, &whole(5, &[service("cart", "10.96.1.1", 80, true)], &["10.96.5.5"], "count"));
    let before = (files(&node), listing(&pod));
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "a stale base",
            json!({"baseGeneration": 4, "generation": 6}).to_string().into(),
            409,
            "baseGeneration: 4 is not the stored generation 5",
        ),
        (
            "a base from the future",
            json!({"baseGeneration": 6, "generation": 7}).to_string().into(),
            409,
            "baseGeneration: 6 is not the stored generation 5",
        ),
        (
            "an older generation",
            whole(3, &[], &[], "count"),
            409,
            "generation: 3 is older than the stored generation 5",
        ),
        ("a generation reused with other content", whole(5, &[], &[], "count"), 409, "generation: 5 is already stored"),
        ("an invalid document", whole(6, &[service("x", "10.97.0.1", 80, true)], &[], "count"), 400, "10.97.0.1"),
        (
            "a change the stored generation refuses",
            json!({"baseGeneration": 5, "generation": 6, "servicesRemoved": [{"namespace": "shop", "name": "ghost"}]})
                .to_string()
                .into(),
            400,
            "servicesRemoved[0]: Service shop/ghost is not in the stored generation 5",
        ),
        ("not JSON", b"{".to_vec(), 400, "the snapshot is not JSON"),
    ];
    for (what, doc, want, reason) in &cases {
        let (status, body) = post(&inst.socket, doc);
        assert_eq!(status, *want, "{what}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {body}"));
        assert!(v["error"].as_str().is_some_and(|e| !e.contains('\n')), "{what}: {body}");
        let reasons: Vec<&str> = v["reasons"].as_array().unwrap().iter().map(|r| r.as_str().unwrap()).collect();
        assert!(reasons.iter().any(|r| r.contains(reason)), "{what}: no reason says `{reason}`: {body}");
        if *want == 409 {
            assert_eq!(v["storedGeneration"], 5, "{what}: the stored generation is not named: {body}");
        }
        assert!((files(&node), listing(&pod)) == before, "{what}: something changed");
        // The CLI's client: the in-process apply's exit code and message.
        let (code, out, err) = cli_socket(&inst.socket, doc);
        assert_eq!((code, out.as_str()), (2, ""), "{what}: {err}");
        assert!(err.contains(reason) && err.starts_with("aether-cni services apply: "), "{what}: {err}");
    }
    let (generation, intact, said) = verify(&node);
    assert!(generation == Some(5) && intact, "{said}");
    // Anything but POST /services/apply.
    assert_eq!(post_raw(&inst.socket, "GET", "/services/apply", None).unwrap().0, 405);
    assert_eq!(post_raw(&inst.socket, "POST", "/healthz", Some(b"{}")).unwrap().0, 404);
    assert_eq!(
        inst.metric(r#"aether_cni_installer_services_applies_total{kind="change",outcome="conflict"}"#),
        5.0,
        "the no-base change, and two stale ones twice each (raw and the CLI)"
    );
    // Control: a good change through the same socket is applied.
    let good = json!({"baseGeneration": 5, "generation": 6, "servicesPut": [service("new", "10.96.1.3", 81, true)]});
    let (status, body) = post(&inst.socket, good.to_string().as_bytes());
    assert_eq!(status, 200, "{body}");
    control(files(&node) != before.0, "a good change leaves the stored files as they were", &body);
    let after = listing(&pod);
    control(after != before.1, "a good change leaves the pod's sets as they were", &after);
    assert!(after.contains("10.96.1.3 . tcp . 81"), "{after}");
}

#[test]
fn the_cli_and_the_socket_interleaved_stay_consistent() {
    let test = "the_cli_and_the_socket_interleaved_stay_consistent";
    let Some(mut node) = node(test, "sockmix") else { return };
    let pods: Vec<Pod> = ["a", "b"].iter().map(|n| node.add_pod(n)).collect();
    pods[0].add(json!({}));
    let inst = Installer::start(&node, "interleaved");
    let mut late = None;
    let mut services = vec![service("s0", "10.96.1.1", 80, true)];
    assert_eq!(post(&inst.socket, &whole(1, &services, &[], "count")).0, 200);
    for g in 2..=12u64 {
        if g == 6 {
            // A pod attached between documents gets the layer the last one stored.
            pods[1].add(json!({}));
            late = Some(&pods[1]);
        }
        let s = service(&format!("s{g}"), &format!("10.96.1.{g}"), 80, g % 4 != 0);
        services.push(s.clone());
        let doc = if g % 3 == 0 {
            whole(g, &services, &[], "count")
        } else {
            json!({"baseGeneration": g - 1, "generation": g, "servicesPut": [s]}).to_string().into_bytes()
        };
        let by = if g % 2 == 0 { "socket" } else { "cli" };
        if by == "socket" {
            let (status, body) = post(&inst.socket, &doc);
            assert_eq!(status, 200, "generation {g} through the socket: {body}");
        } else {
            let (code, _, err) = cli_here(&node, &doc);
            assert_eq!(code, 0, "generation {g} by the CLI: {err}");
        }
        let (generation, intact, said) = verify(&node);
        assert_eq!(generation, Some(g), "after generation {g} ({by})");
        assert!(intact, "after generation {g} ({by}), a pod is not at the stored generation:\n{said}");
        // Its VIP, in the map (and, while fewer than eight Services share its profile, its
        // port by key).
        let want = format!("10.96.1.{g} ");
        for p in std::iter::once(&pods[0]).chain(late) {
            assert!(listing(p).contains(&want), "after generation {g} ({by}), pod {} lacks {want}", p.name);
        }
    }
    // Control: the socket's applier does not go by a generation it saw last; a change based
    // on one the CLI replaced is refused as stale.
    let next = json!({"baseGeneration": 12, "generation": 13, "servicesPut": [service("t", "10.96.2.1", 80, true)]});
    let (code, _, err) = cli_here(&node, next.to_string().as_bytes());
    assert_eq!(code, 0, "{err}");
    let (status, body) = post(&inst.socket, json!({"baseGeneration": 12, "generation": 14}).to_string().as_bytes());
    control(status == 409, "a change based on a generation the CLI replaced", &body);
    assert!(body.contains("is not the stored generation 13"), "{body}");
}

#[test]
fn a_body_over_the_cap_is_refused_with_413_and_changes_nothing() {
    let test = "a_body_over_the_cap_is_refused_with_413_and_changes_nothing";
    let Some(mut node) = node(test, "sockcap") else { return };
    let pod = node.add_pod("a");
    pod.add(json!({}));
    let inst = Installer::start(&node, "cap");
    apply(&node, &whole(1, &[service("cart", "10.96.1.1", 80, true)], &[], "count"));
    let before = (files(&node), listing(&pod));
    // Declared over the cap: answered at once, before the body.
    let mut s = UnixStream::connect(&inst.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "POST /services/apply HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{{", CAP + 1).unwrap();
    let (status, body) = http::read_answer(s).unwrap();
    assert_eq!(status, 413, "{body}");
    assert!(body.contains("larger than the limit of 67108864 bytes (64 MiB)"), "{body}");
    // Chunked, no length declared: read up to the cap, then refused.
    let chunked = |doc: &[u8]| {
        let mut s = UnixStream::connect(&inst.socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(s, "POST /services/apply HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n").unwrap();
        // The installer may answer and close before it has read every chunk.
        for piece in doc.chunks(1 << 20) {
            if write!(s, "{:x}\r\n", piece.len())
                .and_then(|_| s.write_all(piece))
                .and_then(|_| s.write_all(b"\r\n"))
                .is_err()
            {
                break;
            }
        }
        let _ = s.write_all(b"0\r\n\r\n");
        http::read_answer(s).unwrap()
    };
    let mut huge = whole(2, &[], &[], "count");
    huge.truncate(huge.len() - 1);
    huge.extend(std::iter::repeat_n(b' ', CAP));
    huge.push(b'}');
    let (status, body) = chunked(&huge);
    assert_eq!(status, 413, "{}", &body[..body.len().min(2000)]);
    assert!(body.contains("67108864"), "{body}");
    assert!((files(&node), listing(&pod)) == before, "a body over the cap changed something");
    assert_eq!(inst.metric(r#"aether_cni_installer_services_applies_total{kind="unread",outcome="too-large"}"#), 2.0);
    // The installer goes on serving. Control: the same chunked client under the cap is applied.
    let (status, body) = chunked(&whole(2, &[service("cart", "10.96.1.1", 81, true)], &[], "count"));
    control(status == 200, "a chunked body under the cap", &body);
    assert!(listing(&pod).contains("10.96.1.1 . tcp . 81"), "{}", listing(&pod));
}

#[test]
fn the_socket_is_root_only_removed_on_sigterm_and_replaced_after_sigkill() {
    let test = "the_socket_is_root_only_removed_on_sigterm_and_replaced_after_sigkill";
    let Some(mut node) = node(test, "socklife") else { return };
    let pod = node.add_pod("a");
    pod.add(json!({}));
    let doc = |g: u64| whole(g, &[service("cart", "10.96.1.1", 80 + g as u16, true)], &[], "count");
    let mut inst = Installer::start(&node, "life1");
    let meta = std::fs::symlink_metadata(&inst.socket).unwrap();
    assert!(meta.file_type().is_socket(), "{meta:?}");
    assert_eq!(meta.permissions().mode() & 0o7777, 0o600, "the socket's mode");
    let dir = std::fs::metadata(inst.socket.parent().unwrap()).unwrap();
    assert_eq!(dir.permissions().mode() & 0o7777, 0o700, "the socket's directory's mode");
    assert_eq!(post(&inst.socket, &doc(1)).0, 200);
    let status = inst.stop();
    assert!(status.success(), "the installer exited with {status}:\n{}", inst.log());
    assert!(!inst.socket.exists(), "the socket is still there after SIGTERM:\n{}", inst.log());
    // SIGKILL: nothing removes the socket (the control: it stays, and answers nobody).
    let mut inst = Installer::start(&node, "life2");
    assert_eq!(post(&inst.socket, &doc(2)).0, 200);
    // (An inode number may be reused at once: the change time tells the files apart.)
    let identity = |m: std::fs::Metadata| (m.ino(), m.ctime(), m.ctime_nsec());
    let killed = identity(std::fs::symlink_metadata(&inst.socket).unwrap());
    inst.signal(libc::SIGKILL);
    inst.wait_exit();
    let stale = std::fs::symlink_metadata(&inst.socket);
    control(stale.as_ref().is_ok_and(|m| m.file_type().is_socket()), "a SIGKILLed installer's socket is gone", "");
    let refused = UnixStream::connect(&inst.socket).map(drop);
    assert!(refused.is_err(), "a dead installer's socket accepted a connection");
    // The next installer replaces it and serves.
    let mut inst = Installer::start(&node, "life3");
    assert_ne!(identity(std::fs::symlink_metadata(&inst.socket).unwrap()), killed, "not a new socket");
    let (status, body) = post(&inst.socket, &doc(3));
    assert_eq!(status, 200, "{body}");
    assert!(listing(&pod).contains("10.96.1.1 . tcp . 83"), "{}", listing(&pod));
    assert!(inst.log().contains("replaced the socket left by an earlier installer"), "{}", inst.log());
    assert!(inst.stop().success());
    // Something that is not a socket at the path: refused, named, left alone.
    std::fs::write(&inst.socket, b"not a socket").unwrap();
    let mut refused = Installer::spawn(&node, "life4", &[]);
    let status = refused.wait_exit();
    assert!(!status.success(), "the installer started over a file at its socket's path");
    assert!(refused.log().contains(&inst.socket.display().to_string()), "{}", refused.log());
    assert_eq!(std::fs::read(&inst.socket).unwrap(), b"not a socket", "the file was touched");
    std::fs::remove_file(&inst.socket).unwrap();
    // Turned off: no socket.
    let mut off = Installer::spawn(&node, "life5", &["--services-socket="]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !off.log().contains("serving /healthz") {
        assert!(Instant::now() < deadline, "{}", off.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!off.socket.exists(), "--services-socket= made a socket");
    assert!(off.stop().success());
}

/// The installer's open sockets (netlink, HTTP, its listeners).
fn open_sockets(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy().starts_with("socket:"))
        .count()
}

#[test]
fn the_applier_lets_go_of_a_gone_pod_when_idle() {
    let test = "the_applier_lets_go_of_a_gone_pod_when_idle";
    let Some(mut node) = node(test, "socktidy") else { return };
    let gone = node.add_pod("gone");
    let conf = gone.add(json!({}));
    let stays = node.add_pod("stays");
    stays.add(json!({}));
    let inst = Installer::start(&node, "tidy");
    let pid = inst.child.id();
    let kept = r#"aether_cni_installer_services_kept_pods"#;
    assert_eq!(post(&inst.socket, &whole(1, &[service("cart", "10.96.1.1", 80, true)], &[], "count")).0, 200);
    let flip = |g: u64, usable: bool| {
        json!({"baseGeneration": g, "generation": g + 1,
               "endpoints": [{"namespace": "shop", "name": "cart", "usableEndpoints": usable}]})
        .to_string()
    };
    assert_eq!(post(&inst.socket, flip(1, false).as_bytes()).0, 200);
    std::thread::sleep(Duration::from_millis(200));
    let sockets = open_sockets(pid);
    // Control: the applier keeps a socket per pod (what the rest of the test sees go).
    let held = inst.metric(kept);
    control(held == 2.0, "the applier keeps a socket for each pod", held);
    // The pod goes: DEL forgets its record, then its netns is deleted.
    gone.del(&conf);
    drop(gone);
    let deadline = Instant::now() + Duration::from_secs(10);
    while inst.metric(kept) != 1.0 {
        assert!(Instant::now() < deadline, "the applier still keeps the gone pod after 10 s idle:\n{}", inst.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(200));
    let now = open_sockets(pid);
    assert!(now < sockets, "the installer holds {now} sockets, {sockets} before the pod went");
    let (status, body) = post(&inst.socket, flip(2, true).as_bytes());
    assert_eq!(status, 200, "{body}");
    let report: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(report["pods"].as_array().unwrap().len(), 1, "{body}");
    assert!(listing(&stays).contains("10.96.1.1 . tcp . 80"), "{}", listing(&stays));
    println!("{test}: {sockets} sockets with both pods kept, {now} after the gone pod was let go");
}

#[test]
fn an_apply_that_outlasts_the_deadlines_is_answered_and_a_document_without_a_turn_gets_503() {
    let test = "an_apply_that_outlasts_the_deadlines_is_answered_and_a_document_without_a_turn_gets_503";
    let Some(mut node) = node(test, "sockslow") else { return };
    let pod = node.add_pod("a");
    pod.add(json!({}));
    // Fault-injection build: the socket's deadlines (the wait for the turn, the answer's
    // write) are 1 s, and every apply takes 4 s more.
    let env = [("AETHER_INSTALLER_SERVICES_DEADLINES_MS", "1000"), ("AETHER_INSTALLER_SLOW_APPLY_MS", "4000")];
    let inst = Installer::spawn_env(&node, "slow", &[], &env);
    inst.wait_serving();
    let first = whole(1, &[service("cart", "10.96.1.1", 80, true)], &[], "count");
    let second =
        whole(2, &[service("cart", "10.96.1.1", 80, true), service("shop", "10.96.1.2", 81, true)], &[], "count");
    std::thread::scope(|s| {
        let socket = &inst.socket;
        let slow = s.spawn(|| cli_socket_within(socket, &first, 30));
        // The second document arrives while the first is applied, and waits for its turn
        // longer than the socket lets it.
        std::thread::sleep(Duration::from_millis(1500));
        let (status, body) = post(socket, &second);
        assert_eq!(status, 503, "{body}\n{}", inst.log());
        assert!(body.contains("send it again") && body.contains("nothing changed"), "{body}");
        let (code, out, err) = slow.join().unwrap();
        assert_eq!(code, 0, "the apply that outlasted the deadlines was not answered: {out}\n{err}\n{}", inst.log());
        let report: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(report["generation"], 1, "{out}");
        assert_eq!(results(&report), ["rebuilt"], "{out}");
    });
    let (generation, intact, said) = verify(&node);
    assert_eq!(generation, Some(1), "the refused document changed the stored generation:\n{said}");
    assert!(intact, "{said}");
    assert!(!listing(&pod).contains("10.96.1.2 "), "the refused document reached the pod");
    assert_eq!(inst.metric(r#"aether_cni_installer_services_applies_total{kind="unread",outcome="busy"}"#), 1.0);
    // Control: a client that gives up before the apply ends gets no answer, and the document
    // is applied all the same: the answer of the first was no accident of timing.
    let (code, _, err) = cli_socket_within(&inst.socket, &second, 1);
    control(code == 2 && err.contains("no answer"), "a client that waits less than the apply", &err);
    let deadline = Instant::now() + Duration::from_secs(20);
    while verify(&node).0 != Some(2) {
        assert!(Instant::now() < deadline, "the document the client gave up on was not applied:\n{}", inst.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(listing(&pod).contains("10.96.1.2 "), "the pod lacks the document the client gave up on");
}
