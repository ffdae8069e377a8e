//! The Service layer's socket without pods (no root needed): the socket file's life (0600 in
//! a 0700 directory, a stale socket replaced, anything else refused and left, removed on
//! stop, off with an empty path), the statuses a document gets on a node with no pods, and
//! the CLI's client when the installer gives no answer or half of one. The kernel side (pods,
//! the same results as the in-process CLI) is conformance/tests/services_socket.rs.

mod common;

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use aether_apply_client::post_apply;
use aether_installer::{start, Error};
use common::{fake_binary, FakeNode, Switches};
use serde_json::{json, Value};

const TIMEOUT: Duration = Duration::from_secs(30);

fn socket_of(fake: &FakeNode) -> PathBuf {
    fake.state.join("agent/services.sock")
}

fn apply(socket: &Path, doc: &Value) -> (u16, Value) {
    let (status, body) = post_apply(socket, doc.to_string().as_bytes(), TIMEOUT).unwrap();
    (status, serde_json::from_slice(&body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}")))
}

/// A request by hand: (status, body).
fn raw(socket: &Path, request: &str) -> (u16, String) {
    let mut s = UnixStream::connect(socket).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    aether_testkit::http::read_answer(s).unwrap()
}

#[test]
fn the_socket_answers_each_status_and_goes_when_the_installer_stops() {
    let fake = FakeNode::new("sock-statuses");
    let r = start(fake.args(&[]), common::plugin(&Switches::default()), fake_binary(4096, 1)).unwrap();
    let socket = socket_of(&fake);
    assert_eq!(r.services_socket(), Some(socket.as_path()));
    let meta = fs::symlink_metadata(&socket).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o7777, 0o600);
    assert_eq!(fs::metadata(socket.parent().unwrap()).unwrap().permissions().mode() & 0o7777, 0o700);

    let doc = json!({"generation": 7, "mode": "count", "serviceRanges": ["10.96.0.0/16"], "services": []});
    let (status, report) = apply(&socket, &doc);
    assert_eq!((status, &report), (200, &json!({"generation": 7, "pods": []})));
    assert!(fake.state.join("services/snapshot.json").exists(), "the document was not stored");
    let (status, v) = apply(&socket, &json!({"baseGeneration": 6, "generation": 8}));
    assert_eq!((status, &v["storedGeneration"]), (409, &json!(7)), "{v}");
    assert!(v["error"].as_str().unwrap().contains("baseGeneration: 6 is not the stored generation 7"), "{v}");
    let (status, v) = apply(&socket, &json!({"generation": 8, "mode": "count", "serviceRanges": ["10.96.0.0/33"]}));
    assert_eq!(status, 400, "{v}");
    assert!(!v["reasons"].as_array().unwrap().is_empty(), "{v}");
    let (status, body) = raw(&socket, "GET /services/apply HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n");
    assert_eq!(status, 405, "{body}");
    let (status, body) = raw(&socket, "POST /apply HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n");
    assert_eq!(status, 404, "{body}");
    let (status, body) = raw(&socket, "POST /services/apply HTTP/1.1\r\nHost: t\r\nContent-Length: 67108865\r\n\r\n");
    assert_eq!(status, 413, "{body}");
    assert!(body.contains("larger than the limit of 67108864 bytes"), "{body}");
    let metrics = r.shared.metrics.encode();
    for series in [
        r#"aether_cni_installer_services_applies_total{kind="whole",outcome="applied"} 1"#,
        r#"aether_cni_installer_services_applies_total{kind="change",outcome="conflict"} 1"#,
        r#"aether_cni_installer_services_applies_total{kind="whole",outcome="refused"} 1"#,
        r#"aether_cni_installer_services_applies_total{kind="unread",outcome="too-large"} 1"#,
        r#"aether_cni_installer_services_apply_seconds_count{kind="whole"} 2"#,
    ] {
        assert!(metrics.contains(series), "no `{series}` in:\n{metrics}");
    }
    r.stop().unwrap();
    assert!(!socket.exists(), "the socket outlived the installer");
    // Control: the client names a socket nobody serves.
    let e = post_apply(&socket, b"{}", TIMEOUT).unwrap_err();
    assert!(e.contains("cannot connect to the installer's socket"), "{e}");
}

#[test]
fn a_socket_left_there_is_replaced_and_anything_else_is_refused_and_left() {
    let fake = FakeNode::new("sock-stale");
    let socket = socket_of(&fake);
    fs::create_dir_all(socket.parent().unwrap()).unwrap();
    // What a killed installer leaves: a socket file nobody listens on.
    drop(UnixListener::bind(&socket).unwrap());
    assert!(UnixStream::connect(&socket).is_err());
    let r = start(fake.args(&[]), common::plugin(&Switches::default()), fake_binary(4096, 1)).unwrap();
    let doc = json!({"generation": 1, "mode": "count", "serviceRanges": ["10.96.0.0/16"], "services": []});
    assert_eq!(apply(&socket, &doc).0, 200);
    r.stop().unwrap();

    for (what, make) in [
        ("a file", Box::new(|p: &Path| fs::write(p, b"keep me").unwrap()) as Box<dyn Fn(&Path)>),
        ("a directory", Box::new(|p: &Path| fs::create_dir(p).unwrap())),
    ] {
        make(&socket);
        let e = start(fake.args(&[]), common::plugin(&Switches::default()), fake_binary(4096, 1)).err();
        let Some(e @ Error::ServicesSocket { .. }) = e else { panic!("{what} at the socket's path: {e:?}") };
        let said = e.to_string();
        assert!(said.contains(&socket.display().to_string()) && said.contains("not a socket"), "{what}: {said}");
        assert!(!fake.bin.join("aether-cni").exists(), "{what}: something was installed");
        if what == "a file" {
            assert_eq!(fs::read(&socket).unwrap(), b"keep me", "the file was touched");
            fs::remove_file(&socket).unwrap();
        } else {
            fs::remove_dir(&socket).unwrap();
        }
    }
}

#[test]
fn an_empty_path_serves_no_socket() {
    let fake = FakeNode::new("sock-off");
    let r =
        start(fake.args(&["--services-socket="]), common::plugin(&Switches::default()), fake_binary(4096, 1)).unwrap();
    assert_eq!(r.services_socket(), None);
    assert!(!socket_of(&fake).exists() && !fake.state.join("agent").exists());
    r.stop().unwrap();
}

/// A stand-in installer that reads the request and answers `answer` (or nothing), then closes.
fn answering(path: &Path, answer: &'static [u8]) -> std::thread::JoinHandle<()> {
    let l = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = [0u8; 4096];
        let _ = s.read(&mut buf);
        let _ = s.write_all(answer);
    })
}

#[test]
fn the_client_says_when_the_answer_is_missing_or_cut() {
    let dir = std::env::temp_dir().join(format!("aether-sock-client-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    for (name, answer, said) in [
        ("none.sock", &b""[..], "no answer"),
        ("cut.sock", &b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"generation\": 1"[..], "a truncated answer"),
        ("garbage.sock", &b"hello\r\n\r\n"[..], "an answer that is not HTTP"),
    ] {
        let path = dir.join(name);
        let t = answering(&path, answer);
        let e = post_apply(&path, b"{}", TIMEOUT).unwrap_err();
        assert!(e.contains(said) && e.contains("may or may not have been applied"), "{name}: {e}");
        t.join().unwrap();
    }
    // Control: the same stand-in with a whole answer is read as one.
    let path = dir.join("whole.sock");
    let t = answering(&path, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}");
    assert_eq!(post_apply(&path, b"{}", TIMEOUT).unwrap(), (200, b"{}".to_vec()));
    t.join().unwrap();
    fs::remove_dir_all(&dir).unwrap();
}

/// A client that stops sending its body holds no one else's document: a valid document sent
/// meanwhile is applied and answered while the stalled one still waits, and the stalled one
/// is answered 408 once its body sent nothing for the idle deadline. Negative control: the
/// apply turn was taken before the body was read, and the valid document waited behind the
/// stalled one for the connection's whole deadline (120 s).
#[test]
fn a_stalled_body_holds_no_other_document() {
    let fake = FakeNode::new("sock-stalled");
    let r = start(fake.args(&[]), common::plugin(&Switches::default()), fake_binary(4096, 1)).unwrap();
    let socket = socket_of(&fake);
    let mut stalled = UnixStream::connect(&socket).unwrap();
    stalled
        .write_all(b"POST /services/apply HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"generation\":")
        .unwrap();
    // Its head is read (and the turn, on the code before, taken) before the other document.
    std::thread::sleep(Duration::from_millis(300));
    let doc = json!({"generation": 3, "mode": "count", "serviceRanges": ["10.96.0.0/16"], "services": []});
    let (status, report) = apply(&socket, &doc);
    assert_eq!((status, &report), (200, &json!({"generation": 3, "pods": []})));
    // The stalled one is still unanswered: nothing to read yet.
    stalled.set_nonblocking(true).unwrap();
    let mut probe = [0u8; 1];
    assert!(
        matches!(stalled.read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the stalled document was answered before the other"
    );
    stalled.set_nonblocking(false).unwrap();
    stalled.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut text = String::new();
    let _ = stalled.read_to_string(&mut text);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("stopped arriving"), "{text}");
    let metrics = r.shared.metrics.encode();
    let series = r#"aether_cni_installer_services_applies_total{kind="unread",outcome="stalled"} 1"#;
    assert!(metrics.contains(series), "no `{series}` in:\n{metrics}");
    r.stop().unwrap();
}

/// The socket's directory is made 0700 and owned by the installer's user even when it already
/// existed, world-writable: a local user could otherwise replace the socket. Negative control:
/// an existing directory was left as it was.
#[test]
fn an_existing_socket_directory_is_tightened() {
    let fake = FakeNode::new("sock-tighten");
    let dir = fake.state.join("agent");
    fs::create_dir_all(&dir).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
    let r = start(fake.args(&[]), common::plugin(&Switches::default()), fake_binary(4096, 1)).unwrap();
    assert_eq!(fs::metadata(&dir).unwrap().permissions().mode() & 0o7777, 0o700);
    r.stop().unwrap();
    // A symlink where the directory should be is refused, naming it.
    let fake = FakeNode::new("sock-symlink");
    let elsewhere = fake.root.join("elsewhere");
    fs::create_dir_all(&elsewhere).unwrap();
    fs::create_dir_all(&fake.state).unwrap();
    std::os::unix::fs::symlink(&elsewhere, fake.state.join("agent")).unwrap();
    let out = start(fake.args(&[]), common::plugin(&Switches::default()), fake_binary(4096, 1));
    let e = out.err().expect("a symlinked socket directory is refused");
    assert!(e.to_string().contains("agent") && e.to_string().contains("not a directory"), "{e}");
}
