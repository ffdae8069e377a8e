//! The installer's CRI client (`aether-cri`: tonic + prost over the runtime's unix socket)
//! against the private containerd, 1.6 and 2.1 (see `aether_conformance::containerd`), read side by
//! side with the tests' independent Python client (`cri.py`, Debian's grpcio): the same
//! sandboxes, namespaces, names, uids, annotations, states, addresses and network namespace
//! paths; StopPodSandbox through the Rust client seen by the Python one; a sandbox removed
//! behind its back is an error naming it, not a hang.
//!
//! Root test: it skips loudly without root, and fails under AETHER_REQUIRE_ROOT_TESTS=1 (CI),
//! as it also does there when `make clients-deps` has not been run.

use std::collections::BTreeMap;
use std::time::Duration;

use aether_conformance::clients::client;
use aether_conformance::containerd::{Containerd, Flavor, NodeNet};
use aether_cri::{Client, SandboxNetns, SandboxState};
use aether_testkit::root_or_skip;
use serde_json::{json, Value};

const NET: NodeNet = NodeNet { bridge: "aecri0", subnet: "10.250.12.0/24", gateway: "10.250.12.1" };

fn ready(test: &str, flavor: Flavor) -> bool {
    root_or_skip(test) && flavor.requirements().iter().all(|p| client(test, p).is_some())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

#[test]
fn cri_client_lists_sandboxes_as_containerd_reports_them_and_stops_one() {
    lists_sandboxes(Flavor::V1_6);
}

/// The same against containerd 2.
#[test]
fn cri_client_lists_sandboxes_as_containerd2_reports_them_and_stops_one() {
    lists_sandboxes(Flavor::V2);
}

fn lists_sandboxes(flavor: Flavor) {
    let test = match flavor {
        Flavor::V1_6 => "cri_client_lists_sandboxes",
        Flavor::V2 => "cri_client_lists_sandboxes2",
    };
    if !ready(test, flavor) {
        return;
    }
    // The main CNI alone: the client is what is tested, not the capture.
    let tag = if flavor == Flavor::V2 { "cricl2" } else { "cricl" };
    let mut ctrd = Containerd::new_on(flavor, tag, &NET, false);
    ctrd.start();
    ctrd.import_sandbox_image();
    let annotated =
        ctrd.run_pod("shop", "cart-0", Some(json!({"aether.io/capture": "scoped", "team": "checkout"}))).unwrap();
    let plain = ctrd.run_pod("shop", "plain-0", None).unwrap();
    let system = ctrd.run_pod("kube-system", "dns-0", Some(json!({"aether.io/capture": "bogus"}))).unwrap();

    let rt = runtime();
    let mut cri = rt.block_on(Client::connect(ctrd.socket(), Duration::from_secs(10))).unwrap();
    let version = rt.block_on(cri.version()).unwrap();
    assert_eq!(version.runtime_name, "containerd", "{version:?}");
    assert_eq!(version.runtime_api_version, "v1", "{version:?}");

    let listed = rt.block_on(cri.sandboxes()).unwrap();
    let mut ids: Vec<&str> = listed.iter().map(|s| s.id.as_str()).collect();
    ids.sort();
    let mut want = vec![annotated.as_str(), plain.as_str(), system.as_str()];
    want.sort();
    assert_eq!(ids, want, "ListPodSandbox: {listed:#?}");

    for id in [&annotated, &plain, &system] {
        // The independent client's view of the same sandbox.
        let theirs = ctrd.sandbox(id).unwrap();
        let meta = &theirs.status["metadata"];
        let their_annotations: BTreeMap<String, String> = theirs.status["annotations"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
            .collect();
        let ours = listed.iter().find(|s| &s.id == id).unwrap();
        assert_eq!(
            (ours.namespace.as_str(), ours.name.as_str(), ours.uid.as_str()),
            (meta["namespace"].as_str().unwrap(), meta["name"].as_str().unwrap(), meta["uid"].as_str().unwrap()),
            "{id}"
        );
        assert_eq!(ours.state, SandboxState::Ready, "{id}");
        assert_eq!(ours.annotations, their_annotations, "{id}: ListPodSandbox's annotations");
        assert_eq!(ours.created_at.to_string(), theirs.status["created_at"].as_str().unwrap_or_default(), "{id}");

        let status = rt.block_on(cri.status(id)).unwrap();
        assert_eq!(&status.sandbox, ours, "{id}: PodSandboxStatus's sandbox = ListPodSandbox's");
        assert_eq!(status.netns, SandboxNetns::Pod(theirs.netns.clone()), "{id}");
        assert_eq!(status.ips, vec![theirs.ip.clone()], "{id}");
        assert_eq!(status.pid, Some(theirs.pid as u32), "{id}");
    }
    let cart = listed.iter().find(|s| s.id == annotated).unwrap();
    assert_eq!(cart.annotations.get("aether.io/capture").map(String::as_str), Some("scoped"));
    assert_eq!((cart.namespace.as_str(), cart.name.as_str(), cart.uid.as_str()), ("shop", "cart-0", "uid-cart-0"));
    // Negative control: the comparison above can fail (another sandbox's view differs).
    let other = ctrd.sandbox(&plain).unwrap();
    let cart_status = rt.block_on(cri.status(&annotated)).unwrap();
    assert_ne!(cart_status.netns, SandboxNetns::Pod(other.netns.clone()), "two sandboxes with one netns?");

    // StopPodSandbox through this client: containerd tears the network down (its netns goes
    // away) and both clients see the sandbox not ready.
    let netns_before = ctrd.sandbox(&plain).unwrap().netns;
    rt.block_on(cri.stop(&plain)).unwrap();
    let theirs: Value = ctrd.cri("PodSandboxStatus", &json!({"pod_sandbox_id": plain})).unwrap();
    assert_eq!(theirs["status"]["state"], "SANDBOX_NOTREADY", "{theirs:#}");
    let listed = rt.block_on(cri.sandboxes()).unwrap();
    assert_eq!(listed.iter().find(|s| s.id == plain).unwrap().state, SandboxState::NotReady);
    assert_eq!(listed.iter().filter(|s| s.state == SandboxState::Ready).count(), 2, "{listed:#?}");
    assert!(!std::path::Path::new(&netns_before).exists(), "{netns_before} kept after StopPodSandbox");
    // Stopping twice is what a kubelet may do: the runtime accepts it.
    rt.block_on(cri.stop(&plain)).unwrap();

    // A sandbox removed behind the client's back: an error naming the call, not a hang.
    ctrd.remove_pod(&plain);
    let e = rt.block_on(cri.status(&plain)).unwrap_err();
    let text = e.to_string();
    assert!(text.contains("PodSandboxStatus") && text.contains("NotFound"), "{text}");
    // Stopping a sandbox the runtime does not know: containerd 1.6 says so, naming the call;
    // containerd 2 answers OK (StopPodSandbox is idempotent in the CRI's words).
    let stopped = rt.block_on(cri.stop("no-such-sandbox"));
    match flavor {
        Flavor::V1_6 => {
            assert!(stopped.as_ref().is_err_and(|e| e.to_string().contains("StopPodSandbox")), "{stopped:?}")
        }
        Flavor::V2 => assert!(stopped.is_ok(), "{stopped:?}"),
    }

    // containerd gone: the next connection names the socket.
    drop(cri);
    for id in [&annotated, &system] {
        ctrd.stop_pod(id);
        ctrd.remove_pod(id);
    }
    ctrd.stop();
    let e = rt.block_on(Client::connect(ctrd.socket(), Duration::from_secs(5))).err().expect("containerd is stopped");
    assert!(e.to_string().contains(&ctrd.socket().display().to_string()), "{e}");
}
