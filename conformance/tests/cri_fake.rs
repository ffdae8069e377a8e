//! The installer's CRI client against a runtime that misbehaves (`aether_cri::fake`: tonic's
//! server side of the same proto, on a unix socket): a pod list over tonic's default 4 MiB is
//! read (the kubelet reads up to 16 MiB) and one over the limit is an error naming it; a hung
//! or slow answer is a timeout naming the call, never a hang; an error is passed on with its
//! code.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use aether_cri::fake::{self, FakeRuntime, Reply, Script};
use aether_cri::{Client, Error, DEFAULT_MAX_MESSAGE_BYTES};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("aether-cri-fake-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `n` sandboxes with `kib` KiB of annotations each.
fn heavy(n: usize, kib: usize) -> Vec<aether_cri::api::PodSandbox> {
    (0..n)
        .map(|i| {
            let mut s = fake::sandbox(&format!("sb-{i}"), "shop", &format!("pod-{i}"), &format!("uid-{i}"), i as i64);
            s.annotations = HashMap::from([("example.com/blob".to_string(), "x".repeat(kib << 10))]);
            s
        })
        .collect()
}

/// 110 sandboxes (the kubelet's default pod limit) with 48 KiB of annotations: a 5.2 MiB
/// list, over tonic's default 4 MiB. Read whole by default; with the limit at 4 MiB (the
/// negative control: the client as it was) an error naming the limit.
#[test]
fn a_pod_list_over_4_mib_is_read_and_one_over_the_limit_is_an_error() {
    let dir = Dir::new("huge");
    let list = heavy(110, 48);
    let fake = FakeRuntime::start(&dir.0.join("cri.sock"), Script { list: Reply::Answer(list), ..Default::default() })
        .unwrap();
    let rt = runtime();
    let got = rt
        .block_on(async { Client::connect(fake.socket(), Duration::from_secs(10)).await?.sandboxes().await })
        .unwrap();
    assert_eq!(got.len(), 110);
    assert_eq!(got[109].annotations["example.com/blob"].len(), 48 << 10);
    assert!(DEFAULT_MAX_MESSAGE_BYTES >= 16 << 20);

    let small = rt.block_on(async {
        Client::connect_with(fake.socket(), Duration::from_secs(10), 4 << 20).await?.sandboxes().await
    });
    let e = small.expect_err("a 5.2 MiB list over a 4 MiB limit");
    assert!(
        matches!(&e, Error::Call { code: aether_cri::Code::OutOfRange, .. })
            && e.to_string().contains("ListPodSandbox"),
        "{e}"
    );
}

/// A runtime that never answers, or answers late: a timeout naming the call and the socket,
/// after the client's own timeout; the same client works again when the runtime answers.
#[test]
fn a_hung_or_slow_runtime_is_a_timeout_not_a_hang() {
    let dir = Dir::new("hung");
    let fake = FakeRuntime::start(&dir.0.join("cri.sock"), Script { list: Reply::Hang, ..Default::default() }).unwrap();
    let rt = runtime();
    let mut c = rt.block_on(Client::connect(fake.socket(), Duration::from_millis(300))).unwrap();
    for reply in [Reply::Hang, Reply::Slow(Duration::from_secs(30), vec![])] {
        fake.script(|s| s.list = reply);
        let e = rt.block_on(c.sandboxes()).expect_err("no answer in time");
        assert!(matches!(e, Error::Timeout { call: "ListPodSandbox", .. }), "{e}");
        assert!(e.to_string().contains(&fake.socket().display().to_string()), "{e}");
    }
    fake.script(|s| s.list = Reply::Fail(aether_cri::Code::Unavailable, "restarting".into()));
    let e = rt.block_on(c.sandboxes()).expect_err("an error");
    assert!(
        matches!(&e, Error::Call { code: aether_cri::Code::Unavailable, message, .. } if message == "restarting"),
        "{e}"
    );
    fake.script(|s| s.list = Reply::Answer(heavy(2, 0)));
    assert_eq!(rt.block_on(c.sandboxes()).unwrap().len(), 2);
    assert_eq!(fake.count("list"), 4);
}
