//! The kubelet's own runtime: containerd and its CRI plugin, private to the test
//! (see `aether_conformance::containerd`), starting pod sandboxes through the CRI gRPC API on
//! a network that chains `bridge` + `host-local` + `portmap` + `aether-cni`, checked from the
//! outside: the pod netns as the kernel reports it, `aether-cni inspect`, the plugin's records,
//! host-local's leases, libcni's cache, containerd's netns mounts and runc's containers. And
//! a containerd node that gets aether-cni from the installer's image (run by podman) and
//! loses it again on uninstall.
//!
//! What containerd sends (and the other clients do not): the pod's annotations in
//! `runtimeConfig["io.kubernetes.cri.pod-annotations"]`, `null` for a pod without any;
//! `K8S_POD_*` pairs in `CNI_ARGS` in varying order; two DELs per stop + remove; no CHECK and
//! no GC; on containerd 2 with a list at 1.1.0, STATUS once per CRI `Status` call.
//!
//! Each scenario runs on Debian bookworm's containerd 1.6 (CNI plugins 1.1.1, a list at
//! 1.0.0) and on Debian unstable's containerd 2.1 (CNI plugins 1.9.1, a list at 1.1.0),
//! fetched and unpacked by `make clients-deps` (`Flavor`).
//!
//! Root tests: they skip loudly without root, and fail under AETHER_REQUIRE_ROOT_TESTS=1 (CI),
//! as they also do there when `make clients-deps` has not been run.

use std::process::Command;
use std::time::Instant;

use aether_conformance::clients::{
    assert_captured, assert_clean, capture_state, client, exec, must, records, repo, table_handle, KeptNetns, Podman,
};
use aether_conformance::cni_bin;
use aether_conformance::containerd::{Containerd, Flavor, NodeNet, Sandbox, Traces, CHAINED_CONFLIST};
use aether_testkit::root_or_skip;
use serde_json::json;

const NET: NodeNet = NodeNet { bridge: "aectrd0", subnet: "10.250.9.0/24", gateway: "10.250.9.1" };

/// The test may run on `flavor`: root, and everything `make clients-deps` provides for it.
fn ready(test: &str, flavor: Flavor) -> bool {
    root_or_skip(test) && flavor.requirements().iter().all(|p| client(test, p).is_some())
}

/// A tag for `flavor`'s run of a scenario (its temp dir, netns and network names).
fn tag(base: &str, flavor: Flavor) -> String {
    match flavor {
        Flavor::V1_6 => base.to_string(),
        Flavor::V2 => format!("{base}2"),
    }
}

/// `aether-cni inspect <sandbox id>` against the network's state dir: (exit ok, stdout+stderr).
fn inspect(ctrd: &Containerd, id: &str) -> (bool, String) {
    let out = exec(Command::new(cni_bin()).arg("inspect").arg(id).arg("--state-dir").arg(&ctrd.state_dir));
    (out.ok, format!("{}{}", out.stdout, out.stderr))
}

/// A ready sandbox with an address of the node's subnet.
fn ready_sandbox(ctrd: &Containerd, id: &str) -> Sandbox {
    let sb = ctrd.sandbox(id).unwrap();
    assert!(sb.ready && sb.ip.starts_with("10.250.9."), "sandbox {id} not ready with an address: {sb:#?}");
    sb
}

/// Stop + remove (two DELs, the second without netns or prevResult) take everything away:
/// the capture (seen through a kept handle on the netns), the veth, the record, the lease,
/// libcni's cache, containerd's netns mount and the pause container.
fn stop_and_remove(ctrd: &Containerd, id: &str, sb: &Sandbox, tag: &str) {
    let kept = KeptNetns::attach(tag, sb.pid);
    ctrd.stop_pod(id);
    assert_clean(&kept.path());
    assert!(!std::path::Path::new(&sb.netns).exists(), "containerd kept {} after StopPodSandbox", sb.netns);
    ctrd.remove_pod(id);
    assert!(ctrd.sandbox(id).is_err(), "sandbox {id} still known after RemovePodSandbox");
    let recs = records(&ctrd.state_dir);
    assert!(!recs.iter().any(|r| r.contains(id)), "{id}: attachment record left: {recs:?}");
    assert!(!ctrd.ipam_leases().contains(&sb.ip), "{id}: host-local still holds {}", sb.ip);
    assert!(!ctrd.libcni_cache().iter().any(|c| c.contains(id)), "{id}: libcni cache left: {:?}", ctrd.libcni_cache());
    assert!(!ctrd.runc_containers().contains(&id.to_string()), "{id}: runc still has the sandbox");
}

#[test]
fn containerd_cri_pod_sandboxes_captured_stopped_removed_and_kept_across_a_restart() {
    pod_sandboxes(Flavor::V1_6);
}

/// The same on containerd 2, its chain the CNI plugins 1.9 at cniVersion 1.1.0.
#[test]
fn containerd2_cri_pod_sandboxes_captured_stopped_removed_and_kept_across_a_restart() {
    pod_sandboxes(Flavor::V2);
}

fn pod_sandboxes(flavor: Flavor) {
    let test = &tag("containerd_cri_pod_sandboxes", flavor);
    if !ready(test, flavor) {
        return;
    }
    let started = Instant::now();
    let keep = |n: u32| tag(&format!("ctrdkeep{n}"), flavor);
    let mut ctrd = Containerd::new_on(flavor, &tag("ctrd", flavor), &NET, true);
    std::os::unix::fs::symlink(cni_bin(), ctrd.bin_dir.join("aether-cni")).unwrap();
    ctrd.start();
    ctrd.import_sandbox_image();

    // --- A pod with no annotations at all: containerd sends the capability as null. The node
    // default applies (redirect-all, DNS to the node proxy).
    let plain = ctrd.run_pod("shop", "plain-0", None).unwrap_or_else(|e| {
        panic!("RunPodSandbox of a pod without annotations failed:\n{e}\n--- aether-cni log\n{}", log(&ctrd))
    });
    let plain_sb = ready_sandbox(&ctrd, &plain);
    let (plain_ip, plain_ns) = (plain_sb.ip.clone(), plain_sb.netns.clone());
    assert!(
        plain_ns.starts_with(&ctrd.dir.0.display().to_string()),
        "pod netns {plain_ns} outside the test's state dir"
    );
    let (_, _, _, addrs) = capture_state(&plain_ns);
    assert!(addrs.contains(&format!("eth0    inet {plain_ip}/24")), "{plain_ip} not on eth0:\n{addrs}");
    let plain_rules = assert_captured(&plain_ns, &["dnat to 10.250.9.1:18054"]);
    assert!(!plain_rules.contains("8443"), "annotations of no pod leaked into the ruleset:\n{plain_rules}");
    let (ok, text) = inspect(&ctrd, &plain);
    assert!(ok && text.contains("pod shop/plain-0"), "aether-cni inspect of {plain}:\n{text}");

    // --- Annotations take effect: exclusions, and scoped mode without DNS.
    let annotations = json!({
        "aether.io/capture": "redirect-all",
        "aether.io/exclude-outbound-ports": "8443,9000-9100",
        "aether.io/exclude-outbound-cidrs": "192.0.2.0/24",
        "kubernetes.io/config.source": "api",
    });
    let annotated = ctrd
        .run_pod("shop", "cart-0", Some(annotations.clone()))
        .unwrap_or_else(|e| panic!("RunPodSandbox (annotated):\n{e}\n{}", log(&ctrd)));
    let annotated_sb = ready_sandbox(&ctrd, &annotated);
    let annotated_ns = annotated_sb.netns.clone();
    let ruleset = assert_captured(&annotated_ns, &["8443", "9000-9100", "192.0.2.0/24", "dnat to 10.250.9.1:18054"]);
    // Exactly what the plugin makes from the same entry and annotations handed to it directly
    // (the CNI protocol, as the golden-file tests drive it): containerd passed them whole.
    assert_eq!(ruleset, direct_add_ruleset(&ctrd, &annotations), "containerd's pod differs from a direct ADD");
    let (ok, text) = inspect(&ctrd, &annotated);
    assert!(ok && text.contains("pod shop/cart-0"), "aether-cni inspect of {annotated}:\n{text}");

    let scoped = ctrd
        .run_pod("shop", "scoped-0", Some(json!({"aether.io/capture": "scoped", "aether.io/capture-dns": "false"})))
        .unwrap_or_else(|e| panic!("RunPodSandbox (scoped):\n{e}\n{}", log(&ctrd)));
    let scoped_sb = ready_sandbox(&ctrd, &scoped);
    let scoped_ns = scoped_sb.netns.clone();
    let scoped_rules = assert_captured(&scoped_ns, &["18081"]);
    assert!(!scoped_rules.contains("dnat to"), "capture-dns: \"false\" still DNATs DNS:\n{scoped_rules}");

    // --- Excluded namespaces are untouched: an address from bridge, nothing from aether-cni.
    let system =
        ctrd.run_pod("kube-system", "coredns-0", None).unwrap_or_else(|e| panic!("RunPodSandbox (kube-system):\n{e}"));
    let system_sb = ready_sandbox(&ctrd, &system);
    let system_ns = system_sb.netns.clone();
    let (ruleset, rules, route, _) = capture_state(&system_ns);
    assert!(
        !ruleset.contains("aether") && !rules.contains("0xae71") && route.trim().is_empty(),
        "a kube-system pod was captured:\n{ruleset}{rules}{route}"
    );
    assert!(!records(&ctrd.state_dir).iter().any(|r| r.contains(&system)), "a record for an unmanaged pod");
    assert!(!ctrd.node.exec("nft", &["list", "ruleset"]).contains("aether"), "aether-cni programmed the node netns");

    // --- A malformed annotation fails the sandbox, with the annotation and value named, and
    // leaves nothing behind: no netns mount, record, lease, cache entry or container.
    let before = ctrd.traces();
    let err = ctrd
        .run_pod("shop", "bad-0", Some(json!({"aether.io/exclude-outbound-ports": "http"})))
        .expect_err("RunPodSandbox with a malformed annotation succeeded");
    assert!(
        err.contains("aether.io/exclude-outbound-ports") && err.contains("http") && err.contains("aether-cni"),
        "containerd's error does not name the plugin, annotation and value:\n{err}"
    );
    assert_eq!(before, ctrd.traces(), "a failed sandbox left something behind");

    // --- Stop and remove take everything away.
    stop_and_remove(&ctrd, &annotated, &annotated_sb, &keep(1));
    stop_and_remove(&ctrd, &system, &system_sb, &keep(2));

    // --- containerd restarts (the pods and shims keep running): the capture still holds, in
    // the same table, and the pods stop and go away cleanly through the new containerd.
    let handle = table_handle(&plain_ns);
    ctrd.stop();
    ctrd.start();
    assert_eq!(ready_sandbox(&ctrd, &plain).ip, plain_ip, "the pod's address changed across the restart");
    assert_captured(&plain_ns, &["dnat to 10.250.9.1:18054"]);
    assert_eq!(handle, table_handle(&plain_ns), "the capture table was re-created across the restart");
    let (ok, text) = inspect(&ctrd, &plain);
    assert!(ok, "aether-cni inspect after the restart:\n{text}");
    stop_and_remove(&ctrd, &plain, &plain_sb, &keep(3));
    stop_and_remove(&ctrd, &scoped, &scoped_sb, &keep(4));

    // Nothing of any pod is left.
    assert_eq!(ctrd.traces(), Traces::default(), "something of a pod is left");

    eprintln!(
        "{test}: {} CRI run/status/stop/remove and a restart, through bridge+host-local+portmap+aether-cni, in {:?}",
        flavor.name(),
        started.elapsed()
    );
}

/// The ruleset ADD makes in a fresh netns when the plugin is run directly with the conflist's
/// `aether-cni` entry and these annotations (state in a dir of its own; the netns goes on drop).
fn direct_add_ruleset(ctrd: &Containerd, annotations: &serde_json::Value) -> String {
    let conflist: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ctrd.net_dir.join(CHAINED_CONFLIST)).unwrap()).unwrap();
    let mut entry = conflist["plugins"][2].clone();
    assert_eq!(entry["type"], "aether-cni", "{conflist:#}");
    entry["cniVersion"] = conflist["cniVersion"].clone();
    entry["name"] = conflist["name"].clone();
    entry["stateDir"] = json!(ctrd.dir.mkdir("direct-add-state").display().to_string());
    entry["runtimeConfig"] = json!({ "io.kubernetes.cri.pod-annotations": annotations });
    entry["prevResult"] = json!({"cniVersion": conflist["cniVersion"], "interfaces": [], "ips": []});
    let pod = aether_testkit::TestNetns::new("ctrddirect");
    let path = pod.path();
    let out = aether_conformance::cni::run_here(
        &[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "direct-add"),
            ("CNI_NETNS", &path),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/opt/cni/bin"),
            ("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart-0"),
        ],
        &entry,
    );
    assert!(out.ok, "direct ADD failed: {}\n{}", out.stdout, out.stderr);
    capture_state(&path).0
}

/// The plugin's log, for failure messages.
fn log(ctrd: &Containerd) -> String {
    std::fs::read_to_string(&ctrd.log_file).unwrap_or_default()
}

/// Each entry of a directory: its name and what it holds (a symlink's target, a file's bytes).
fn dir_state(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            let p = e.path();
            let held = match std::fs::read_link(&p) {
                Ok(target) => target.display().to_string().into_bytes(),
                Err(_) => std::fs::read(&p).unwrap_or_default(),
            };
            (e.file_name().to_string_lossy().into_owned(), held)
        })
        .collect();
    v.sort();
    v
}

/// The entries that differ, as text.
fn text_diff(before: &[(String, Vec<u8>)], after: &[(String, Vec<u8>)]) -> String {
    let mut out = String::new();
    for (name, held) in after {
        match before.iter().find(|(n, _)| n == name) {
            Some((_, was)) if was == held => {}
            Some((_, was)) => {
                out += &format!(
                    "{name} changed:\n{}\n-> {}\n",
                    String::from_utf8_lossy(was),
                    String::from_utf8_lossy(held)
                )
            }
            None => out += &format!("{name} appeared ({} bytes)\n", held.len()),
        }
    }
    out
}

fn names(state: &[(String, Vec<u8>)]) -> Vec<&str> {
    state.iter().map(|(n, _)| n.as_str()).collect()
}

/// Stop + remove by a containerd whose chain no longer names aether-cni: the sandbox, its
/// address and its netns go; aether-cni never hears of it, so its record stays.
fn stop_and_remove_without_aether(ctrd: &Containerd, id: &str, sb: &Sandbox) {
    ctrd.stop_pod(id);
    ctrd.remove_pod(id);
    assert!(ctrd.sandbox(id).is_err(), "sandbox {id} still known after RemovePodSandbox");
    assert!(!std::path::Path::new(&sb.netns).exists(), "containerd kept {}", sb.netns);
    assert!(!ctrd.ipam_leases().contains(&sb.ip), "{id}: host-local still holds {}", sb.ip);
    assert!(records(&ctrd.state_dir).iter().any(|r| r.contains(id)), "{id}: aether-cni was run after all");
}

/// CNI GC of the network with no valid attachment, by the plugin binary at `binary` (the one
/// installed, as a runtime runs it).
fn gc_nothing_valid(ctrd: &Containerd, binary: &std::path::Path) -> std::process::Output {
    let conf = json!({
        "cniVersion": "1.1.0",
        "name": ctrd.network,
        "type": "aether-cni",
        "hostIP": NET.gateway,
        "stateDir": ctrd.state_dir,
        "cni.dev/valid-attachments": [],
    });
    let mut child = Command::new(binary)
        .env_clear()
        .env("CNI_COMMAND", "GC")
        .env("CNI_PATH", &ctrd.bin_dir)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    child.stdin.take().unwrap().write_all(conf.to_string().as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

/// The installer's image (`installer/image/build.sh`, what `make image` runs) built from the
/// plugin binary under test in the test's private podman storage, and run as the chart runs
/// it (host network: the node netns here; capabilities NET_ADMIN and SYS_ADMIN only; read-only
/// root; the node's CNI bin, conf and state dirs mounted) by podman in the node netns.
struct ImageInstaller<'a> {
    podman: Podman<'a>,
    name: String,
}

impl<'a> ImageInstaller<'a> {
    fn start(ctrd: &'a Containerd) -> Self {
        // podman's own network config dir is not the node's (it keeps a cni.lock there).
        let podman = Podman::new(&ctrd.node, &ctrd.dir, &ctrd.bin_dir, &ctrd.dir.mkdir("podman-net"));
        let image = format!("localhost/aether-cni:{}", ctrd.network);
        let binary = cni_bin();
        let installer = aether_testkit::installer_bin();
        must(
            "installer/image/build.sh",
            exec(
                Command::new("bash")
                    .arg(repo().join("installer/image/build.sh"))
                    .arg(binary)
                    .arg(installer)
                    .arg(&image)
                    .env("PODMAN_FLAGS", podman.storage_flags().join(" "))
                    .env("CONTAINERS_CONF", ctrd.dir.join("containers.conf"))
                    // The image carries the notices `make notices` wrote (make test passes
                    // them); the test binary links the same crates as the release one.
                    .env(
                        "NOTICES",
                        std::env::var_os("AETHER_NOTICES")
                            .map(std::path::PathBuf::from)
                            .unwrap_or_else(|| repo().join("target/release/THIRD-PARTY-NOTICES")),
                    ),
            ),
        );
        let name = format!("aether-installer-{}", ctrd.network);
        let state = ctrd.state_dir.display().to_string();
        let mut args: Vec<String> = vec![
            "run".into(),
            "--detach".into(),
            format!("--name={name}"),
            "--network=host".into(),
            "--read-only".into(),
            "--cap-drop=ALL".into(),
            "--cap-add=NET_ADMIN,SYS_ADMIN".into(),
            format!("--volume={}:/host/opt/cni/bin", ctrd.bin_dir.display()),
            format!("--volume={}:/host/etc/cni/net.d", ctrd.net_dir.display()),
            format!("--volume={state}:{state}"),
            format!("--env=HOST_IP={}", NET.gateway),
        ];
        // A test build of the binary is dynamic (the release build is static): it gets the
        // host's libraries, read-only (as cni-plugin/tests/image.rs does).
        if exec(Command::new("ldd").arg(binary)).ok || exec(Command::new("ldd").arg(installer)).ok {
            args.extend(["/lib", "/lib64", "/usr/lib"].iter().map(|d| format!("--volume={d}:{d}:ro")));
        }
        args.extend([image, format!("--state-dir={state}")]);
        args.extend(["--listen=127.0.0.1:0".into(), "--resync-seconds=1".into()]);
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        must("podman run (the installer's image)", podman.run(&argv));
        ImageInstaller { podman, name }
    }

    fn log(&self) -> String {
        let out = self.podman.run(&["logs", &self.name]);
        out.stdout + &out.stderr
    }

    /// `podman stop` (SIGTERM, the image's STOPSIGNAL: uninstall); the container's exit code.
    fn stop(&self) -> String {
        must("podman stop", self.podman.run(&["stop", "--time", "30", &self.name]));
        must("podman inspect", self.podman.run(&["inspect", "--format", "{{.State.ExitCode}}", &self.name]))
            .trim()
            .to_string()
    }
}

#[test]
fn containerd_node_installer_chains_captures_and_uninstall_restores() {
    node_installer(Flavor::V1_6);
}

/// The same on containerd 2, the node's CNI the plugins 1.9 at cniVersion 1.1.0.
#[test]
fn containerd2_node_installer_chains_captures_and_uninstall_restores() {
    node_installer(Flavor::V2);
}

fn node_installer(flavor: Flavor) {
    let test = &tag("containerd_node_installer", flavor);
    if !ready(test, flavor) || client(test, std::path::Path::new("/usr/bin/podman")).is_none() {
        return;
    }
    let started = Instant::now();
    // A node whose CNI is bridge + host-local + portmap alone, and nothing of aether-cni.
    let mut ctrd = Containerd::new_on(flavor, &tag("ctrdinst", flavor), &NET, false);
    let (conf_before, bin_before) = (dir_state(&ctrd.net_dir), dir_state(&ctrd.bin_dir));
    ctrd.start();
    ctrd.import_sandbox_image();
    let before = ctrd.run_pod("shop", "before-0", None).unwrap_or_else(|e| panic!("RunPodSandbox before install: {e}"));
    let sb = ready_sandbox(&ctrd, &before);
    assert!(!capture_state(&sb.netns).0.contains("aether"), "a pod was captured before the installer ran");
    stop_and_remove(&ctrd, &before, &sb, &tag("ctrdinstkeep0", flavor));

    // The installer's image: it copies the binary and chains the entry onto the node's
    // conflist; containerd picks the chained file up by itself.
    let installer = ImageInstaller::start(&ctrd);
    ctrd.wait_cni_config("the chained conflist", |c| c.contains("aether-cni"));
    let conf = dir_state(&ctrd.net_dir);
    let bin = dir_state(&ctrd.bin_dir);
    assert!(names(&bin).contains(&"aether-cni"), "the installer did not install the binary: {:?}", names(&bin));
    assert!(names(&conf).len() == names(&conf_before).len() + 1, "one chained conflist expected: {:?}", names(&conf));

    // Pods start captured, with no other setup: no annotations, and annotated.
    let pod = ctrd
        .run_pod("shop", "cart-0", None)
        .unwrap_or_else(|e| panic!("RunPodSandbox after install: {e}\n--- installer\n{}", installer.log()));
    let sb = ready_sandbox(&ctrd, &pod);
    assert_captured(&sb.netns, &["dnat to 10.250.9.1:18054"]);
    let (ok, text) = inspect(&ctrd, &pod);
    assert!(ok && text.contains("pod shop/cart-0"), "aether-cni inspect after install:\n{text}");
    let annotated = ctrd
        .run_pod("shop", "cart-1", Some(json!({"aether.io/exclude-outbound-ports": "8443"})))
        .unwrap_or_else(|e| panic!("RunPodSandbox (annotated) after install: {e}"));
    let annotated_sb = ready_sandbox(&ctrd, &annotated);
    assert_captured(&annotated_sb.netns, &["8443"]);
    let third = ctrd.run_pod("shop", "cart-2", None).unwrap_or_else(|e| panic!("RunPodSandbox (third): {e}"));
    let third_sb = ready_sandbox(&ctrd, &third);
    let chained_name = names(&conf).into_iter().find(|n| !names(&conf_before).contains(n)).unwrap().to_string();
    let chained = std::fs::read(ctrd.net_dir.join(&chained_name)).unwrap();

    // Uninstall (SIGTERM) with three pods running: the conflist goes, the binary stays for
    // their teardown, and says so.
    let code = installer.stop();
    assert_eq!(code, "0", "the installer's uninstall failed:\n{}", installer.log());
    let conf_after = dir_state(&ctrd.net_dir);
    assert!(
        conf_after == conf_before,
        "the conf dir differs after uninstall:\n{}",
        text_diff(&conf_before, &conf_after)
    );
    let binary = ctrd.bin_dir.join("aether-cni");
    let uninstalled = ctrd.state_dir.join("uninstalled");
    assert!(binary.exists(), "the binary went while pods still need it:\n{}", installer.log());
    assert!(uninstalled.exists(), "no word of the binary left");
    assert!(installer.log().contains("the plugin binary stays while 3 pods"), "{}", installer.log());

    // A runtime that still runs the chain the pod was set up with (containerd before its
    // reload; runtimes that keep each pod's chain): the chained list loaded again stands for
    // it. Control, the failure this prevents: without the binary the teardown fails and the
    // address stays taken. With it, the teardown runs aether-cni's DEL and succeeds.
    std::fs::write(ctrd.net_dir.join(&chained_name), &chained).unwrap();
    ctrd.wait_cni_config("the chained conflist again", |c| c.contains("aether-cni"));
    let aside = ctrd.dir.join("aether-cni.aside");
    std::fs::rename(&binary, &aside).unwrap();
    let failed = ctrd.cri("StopPodSandbox", &json!({"pod_sandbox_id": third}));
    std::fs::rename(&aside, &binary).unwrap();
    let err = failed.expect_err("StopPodSandbox succeeded without the plugin its chain names: the test cannot fail");
    assert!(err.contains("aether-cni"), "{err}");
    assert!(ctrd.ipam_leases().contains(&third_sb.ip), "the failed teardown released the address");
    // (Its pause process went with the failed stop: the teardown is checked from the outside.)
    ctrd.stop_pod(&third);
    ctrd.remove_pod(&third);
    assert!(!ctrd.ipam_leases().contains(&third_sb.ip), "host-local still holds {}", third_sb.ip);
    assert!(!records(&ctrd.state_dir).iter().any(|r| r.contains(&third)), "its DEL left the record");
    assert!(binary.exists() && uninstalled.exists(), "the binary went before the last pod did");
    std::fs::remove_file(ctrd.net_dir.join(&chained_name)).unwrap();
    ctrd.wait_cni_config("the node's own conflist again", |c| c.contains("bridge") && !c.contains("aether-cni"));

    // containerd (1.6 and 2 alike) tears the others down with the chain it holds now, without aether-cni:
    // their teardown succeeds and releases their addresses; their records (their netns gone)
    // and the binary stay.
    for (id, sb) in [(&annotated, &annotated_sb), (&pod, &sb)] {
        stop_and_remove_without_aether(&ctrd, id, sb);
    }
    assert!(binary.exists() && uninstalled.exists(), "the binary went while records remain");
    // CNI GC (which no containerd runs, 2.x included: by hand here) collects them, and the
    // last record takes the binary and the word with it.
    let gc = gc_nothing_valid(&ctrd, &binary);
    assert!(gc.status.success(), "GC: {}", String::from_utf8_lossy(&gc.stdout));
    assert!(records(&ctrd.state_dir).is_empty(), "GC left records: {:?}", records(&ctrd.state_dir));
    assert!(!uninstalled.exists(), "the word of the binary left outlived it");
    for (what, dir, before) in [("conf", &ctrd.net_dir, &conf_before), ("bin", &ctrd.bin_dir, &bin_before)] {
        let after = dir_state(dir);
        assert!(
            after == *before,
            "the {what} dir differs after uninstall: {:?} before, {:?} after\n{}\n--- installer\n{}",
            names(before),
            names(&after),
            text_diff(before, &after),
            installer.log()
        );
    }
    let after = ctrd.run_pod("shop", "after-0", None).unwrap_or_else(|e| panic!("RunPodSandbox after uninstall: {e}"));
    let sb = ready_sandbox(&ctrd, &after);
    let (ruleset, rules, _, _) = capture_state(&sb.netns);
    assert!(
        !ruleset.contains("aether") && !rules.contains("0xae71"),
        "a pod was captured after uninstall:\n{ruleset}{rules}"
    );
    stop_and_remove(&ctrd, &after, &sb, &tag("ctrdinstkeep3", flavor));

    eprintln!(
        "{test}: aether-cni-installer on a {} node, pods captured, uninstall restored it, in {:?}",
        flavor.name(),
        started.elapsed()
    );
}

/// The CNI configuration containerd 2 holds names aether-cni and says `cniVersion` `version`.
fn loaded_at(config: &str, version: &str) -> bool {
    config.contains("aether-cni") && config.contains(&format!("\"CNIVersion\":\"{version}\""))
}

/// The runtime's `NetworkReady` condition, from the CRI `Status` call: (status, message).
fn network_ready(ctrd: &Containerd) -> (bool, String) {
    let r = ctrd.cri("Status", &json!({})).unwrap_or_else(|e| panic!("Status: {e}"));
    let conditions = r["status"]["conditions"].as_array().cloned().unwrap_or_default();
    let c =
        conditions.iter().find(|c| c["type"] == "NetworkReady").unwrap_or_else(|| panic!("no NetworkReady in {r:#}"));
    let ready = c["status"].as_bool().unwrap_or_else(|| panic!("NetworkReady without a status: {r:#}"));
    (ready, c["message"].as_str().unwrap_or_default().to_string())
}

/// containerd 2 calls STATUS once per CRI `Status` call when the chained list says
/// `cniVersion` 1.1.0: the installer's not-ready mark (`<stateDir>/node-not-ready`) makes the
/// runtime report `NetworkReady=false` with its reason, and clearing it makes it ready again;
/// pods still start meanwhile. The plugin binary missing while the list names it: not ready
/// either, naming it, and no sandbox starts. Control: the same list at 1.0.0 is never asked
/// STATUS, so the mark changes nothing the runtime reports.
#[test]
fn containerd2_status_reports_the_installer_s_not_ready_mark_only_for_a_1_1_0_list() {
    let flavor = Flavor::V2;
    let test = "containerd2_status";
    if !ready(test, flavor) {
        return;
    }
    let mut ctrd = Containerd::new_on(flavor, "ctrdstat2", &NET, true);
    std::os::unix::fs::symlink(cni_bin(), ctrd.bin_dir.join("aether-cni")).unwrap();
    ctrd.start();
    ctrd.import_sandbox_image();
    ctrd.wait_cni_config("the chained conflist at 1.1.0", |c| loaded_at(c, "1.1.0"));
    let (ready_now, why) = network_ready(&ctrd);
    assert!(ready_now, "the network is not ready with nothing marked: {why}\n{}", log(&ctrd));

    let marker = ctrd.state_dir.join("node-not-ready");
    std::fs::write(&marker, "installer: the test marked the node\n").unwrap();
    let (ready_now, why) = network_ready(&ctrd);
    assert!(!ready_now, "the runtime reports the network ready while the node is marked not ready");
    assert!(why.contains("the test marked the node"), "the runtime's message does not carry the reason: {why}");
    // containerd itself still starts sandboxes (the kubelet is what holds pods).
    let pod = ctrd.run_pod("shop", "marked-0", None).unwrap_or_else(|e| panic!("RunPodSandbox while marked: {e}"));
    let sb = ready_sandbox(&ctrd, &pod);
    assert_captured(&sb.netns, &[]);
    std::fs::remove_file(&marker).unwrap();
    let (ready_now, why) = network_ready(&ctrd);
    assert!(ready_now, "still not ready once the mark is cleared: {why}");
    stop_and_remove(&ctrd, &pod, &sb, "ctrdstatkeep");

    // The plugin binary missing while the conflist names it: STATUS cannot run it, so the
    // network is not ready, naming it, and a sandbox cannot start; back, ready again.
    let binary = ctrd.bin_dir.join("aether-cni");
    let aside = ctrd.dir.join("aether-cni.aside");
    std::fs::rename(&binary, &aside).unwrap();
    let (ready_now, why) = network_ready(&ctrd);
    assert!(!ready_now && why.contains("aether-cni"), "the binary missing: ready {ready_now}: {why}");
    let err = ctrd.run_pod("shop", "nobinary-0", None).expect_err("a sandbox started without the plugin");
    assert!(err.contains("aether-cni"), "{err}");
    std::fs::rename(&aside, &binary).unwrap();
    let (ready_now, why) = network_ready(&ctrd);
    assert!(ready_now, "the binary back, still not ready: {why}");

    // Control: the same chain at 1.0.0: no STATUS, whatever the mark says.
    let path = ctrd.net_dir.join(CHAINED_CONFLIST);
    let list = std::fs::read_to_string(&path).unwrap().replace("\"1.1.0\"", "\"1.0.0\"");
    std::fs::write(&path, list).unwrap();
    ctrd.wait_cni_config("the chained conflist at 1.0.0", |c| loaded_at(c, "1.0.0"));
    std::fs::write(&marker, "installer: the test marked the node\n").unwrap();
    let (ready_now, why) = network_ready(&ctrd);
    assert!(ready_now, "a 1.0.0 list was asked STATUS: {why}");
    std::fs::remove_file(&marker).unwrap();
}

/// `aether-cni` in the node's bin dir as a wrapper that writes each command it is run with
/// (`CNI_COMMAND`) to a file, then runs the plugin under test; the file's path.
fn counting_plugin(ctrd: &Containerd) -> std::path::PathBuf {
    let commands = ctrd.dir.join("commands");
    let wrapper =
        format!("#!/bin/sh\necho \"$CNI_COMMAND\" >>'{}'\nexec '{}' \"$@\"\n", commands.display(), cni_bin().display());
    let path = ctrd.bin_dir.join("aether-cni");
    std::fs::write(&path, wrapper).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    commands
}

/// How many times the runtime ran aether-cni with each command.
fn commands(file: &std::path::Path) -> std::collections::BTreeMap<String, usize> {
    let mut m = std::collections::BTreeMap::new();
    for c in std::fs::read_to_string(file).unwrap_or_default().lines() {
        *m.entry(c.to_string()).or_insert(0) += 1;
    }
    m
}

fn count(file: &std::path::Path, command: &str) -> usize {
    commands(file).get(command).copied().unwrap_or(0)
}

/// What each containerd runs aether-cni with, counted by a wrapper around the plugin: ADD at
/// RunPodSandbox, two DELs per stop + remove, never CHECK or GC (across a containerd restart
/// too); STATUS never on 1.6 (its list at 1.0.0, the newest bookworm's plugins speak), and on
/// 2.x (its list at 1.1.0) once per CRI `Status` call (not at start, not before ADD). Also timed, not asserted: how soon a conflist change is loaded; and what the runtime
/// says with an empty conf dir.
fn commands_per_runtime(flavor: Flavor) {
    let test = &tag("containerd_commands", flavor);
    if !ready(test, flavor) {
        return;
    }
    let mut ctrd = Containerd::new_on(flavor, &tag("ctrdcmd", flavor), &NET, true);
    let file = counting_plugin(&ctrd);
    ctrd.start();
    ctrd.import_sandbox_image();
    let pod = ctrd.run_pod("shop", "count-0", None).unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", log(&ctrd)));
    let sb = ready_sandbox(&ctrd, &pod);
    assert_captured(&sb.netns, &[]);
    assert_eq!(commands(&file), [("ADD".to_string(), 1)].into(), "{}: at start and the first ADD", flavor.name());
    for _ in 0..5 {
        ctrd.cri("Status", &json!({})).unwrap();
    }
    let statuses = match flavor {
        Flavor::V1_6 => 0,
        Flavor::V2 => 5,
    };
    assert_eq!(count(&file, "STATUS"), statuses, "{}: STATUS per CRI Status call", flavor.name());
    ctrd.stop();
    ctrd.start();
    ctrd.stop_pod(&pod);
    ctrd.remove_pod(&pod);
    let seen = commands(&file);
    assert_eq!(seen.get("ADD"), Some(&1), "{seen:?}");
    assert_eq!(seen.get("DEL"), Some(&2), "two DELs per stop + remove: {seen:?}");
    assert!(!seen.contains_key("CHECK") && !seen.contains_key("GC"), "{}: {seen:?}", flavor.name());

    // A conflist change, timed until the runtime shows it loaded.
    let path = ctrd.net_dir.join(CHAINED_CONFLIST);
    let mut list: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    list["plugins"][2]["logLevel"] = json!("debug");
    let changed = Instant::now();
    std::fs::write(&path, serde_json::to_string_pretty(&list).unwrap()).unwrap();
    ctrd.wait_cni_config("the changed conflist", |c| c.contains("logLevel"));
    eprintln!("{test}: {} loaded a conflist change within {:?}", flavor.name(), changed.elapsed());
    // An empty conf dir.
    std::fs::remove_file(&path).unwrap();
    let deadline = Instant::now() + std::time::Duration::from_secs(20);
    let why = loop {
        let (ready_now, why) = network_ready(&ctrd);
        if !ready_now {
            break why;
        }
        assert!(Instant::now() < deadline, "{}: still network-ready with an empty conf dir", flavor.name());
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(why.contains("cni plugin not initialized"), "{}: {why}", flavor.name());
    eprintln!("{test}: {} with an empty conf dir: NetworkReady=false: {why}", flavor.name());
}

#[test]
fn containerd_runs_add_and_two_dels_and_never_check_gc_or_status() {
    commands_per_runtime(Flavor::V1_6);
}

#[test]
fn containerd2_runs_status_per_cri_status_call_and_never_check_or_gc() {
    commands_per_runtime(Flavor::V2);
}

/// `aether-cni-installer` run by the test on the node (as the chart runs it: `--cri-socket`
/// given), chaining itself onto the node's own conflist; its stderr in `log`.
struct DirectInstaller {
    child: std::process::Child,
    log: std::path::PathBuf,
}

impl DirectInstaller {
    fn start(ctrd: &Containerd, cri_socket: &std::path::Path, wait_seconds: u64) -> Self {
        let log = ctrd.dir.join("installer.log");
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(aether_testkit::installer_bin())
            .arg(format!("--plugin-binary={}", cni_bin().display()))
            .arg(format!("--cni-bin-dir={}", ctrd.bin_dir.display()))
            .arg(format!("--cni-conf-dir={}", ctrd.net_dir.display()))
            .arg(format!("--state-dir={}", ctrd.state_dir.display()))
            .arg("--listen=127.0.0.1:0")
            .arg(format!("--host-ip={}", NET.gateway))
            .arg("--reconcile=false")
            .arg(format!("--cri-socket={}", cri_socket.display()))
            .arg(format!("--uninstall-wait-seconds={wait_seconds}"))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(file)
            .spawn()
            .expect("spawn aether-cni-installer");
        DirectInstaller { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn sigterm(&self) {
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
    }

    /// Waits (up to `within`) for the installer to exit; its exit status.
    fn wait(&mut self, within: std::time::Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("the installer did not exit within {within:?}:\n{}", self.log());
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}

impl Drop for DirectInstaller {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// On containerd 2 (which tears pods down with the chain it holds now and never runs GC, so
/// no DEL or GC of aether-cni comes after the conflist went): the stopping installer asks
/// the runtime which chain it holds. While that names aether-cni (the chained list loaded
/// again, for a runtime that has not reloaded yet) nothing goes and a pod's teardown runs
/// aether-cni's DEL; once it names no aether-cni the binary goes, the record of the pod
/// still running stays, and once its teardown took its netns and
/// sandboxes away the installer collects their records and ends: the node holds nothing of
/// aether-cni, with no re-install and no GC run by hand.
#[test]
fn containerd2_uninstall_finishes_once_the_runtime_drops_the_chain_and_the_pods_are_gone() {
    uninstall_finishes(Flavor::V2, false);
}

/// Control: the runtime's answer withheld (the CRI socket answers nothing): nothing is
/// removed, neither the binary, nor `uninstalled`, nor the records of the pods torn down, and
/// the log says what stays and why.
#[test]
fn containerd2_uninstall_without_the_runtime_s_answer_removes_nothing() {
    uninstall_finishes(Flavor::V2, true);
}

/// The same on containerd 1.6, whose verbose `Status` shows the chain it holds as 2.x's does.
#[test]
fn containerd_uninstall_finishes_once_the_runtime_drops_the_chain_and_the_pods_are_gone() {
    uninstall_finishes(Flavor::V1_6, false);
}

fn uninstall_finishes(flavor: Flavor, withheld: bool) {
    let test = &tag(if withheld { "containerd_uninstall_withheld" } else { "containerd_uninstall_finishes" }, flavor);
    if !ready(test, flavor) {
        return;
    }
    let started = Instant::now();
    let mut ctrd = Containerd::new_on(flavor, &tag(if withheld { "ctrdunw" } else { "ctrdunf" }, flavor), &NET, false);
    let (conf_before, bin_before) = (dir_state(&ctrd.net_dir), dir_state(&ctrd.bin_dir));
    ctrd.start();
    ctrd.import_sandbox_image();
    let socket = if withheld { ctrd.dir.join("withheld.sock") } else { ctrd.socket().to_path_buf() };
    let mut installer = DirectInstaller::start(&ctrd, &socket, if withheld { 12 } else { 40 });
    ctrd.wait_cni_config("the chained conflist", |c| c.contains("aether-cni"));
    let mut pods = Vec::new();
    for name in ["cart-0", "cart-1"] {
        let id = ctrd
            .run_pod("shop", name, None)
            .unwrap_or_else(|e| panic!("RunPodSandbox {name}: {e}\n--- installer\n{}", installer.log()));
        let sb = ready_sandbox(&ctrd, &id);
        assert_captured(&sb.netns, &["dnat to 10.250.9.1:18054"]);
        pods.push((id, sb));
    }
    let binary = ctrd.bin_dir.join("aether-cni");
    let uninstalled = ctrd.state_dir.join("uninstalled");
    let chained_name = names(&dir_state(&ctrd.net_dir))
        .into_iter()
        .find(|n| !names(&conf_before).contains(n))
        .expect("the chained conflist")
        .to_string();
    let chained = std::fs::read(ctrd.net_dir.join(&chained_name)).unwrap();

    // Uninstall with both pods running.
    installer.sigterm();
    ctrd.wait_cni_config("the node's own conflist again", |c| c.contains("bridge") && !c.contains("aether-cni"));
    let mut torn_down = 0;
    if !withheld {
        // A runtime that still runs the chain the pods were set up with (containerd before
        // its reload): the chained list loaded again stands for it. While the runtime's chain
        // names aether-cni nothing goes, and a teardown through it runs aether-cni's DEL: the
        // DEL race stays closed.
        std::fs::write(ctrd.net_dir.join(&chained_name), &chained).unwrap();
        ctrd.wait_cni_config("the chained conflist again", |c| c.contains("aether-cni"));
        std::thread::sleep(std::time::Duration::from_secs(3));
        assert!(binary.exists() && uninstalled.exists(), "the binary went while the runtime's chain names it");
        let (id, sb) = &pods[0];
        ctrd.stop_pod(id);
        ctrd.remove_pod(id);
        assert!(!ctrd.ipam_leases().contains(&sb.ip), "{id}: host-local still holds {}", sb.ip);
        assert!(
            !records(&ctrd.state_dir).iter().any(|r| r.contains(id.as_str())),
            "{id}: aether-cni's DEL did not run"
        );
        assert!(binary.exists(), "the binary went with a pod still attached and the chain naming it");
        torn_down = 1;
        std::fs::remove_file(ctrd.net_dir.join(&chained_name)).unwrap();
        ctrd.wait_cni_config("the node's own conflist again", |c| c.contains("bridge") && !c.contains("aether-cni"));
        // The runtime holds no chain naming aether-cni: the binary goes (after the reload
        // grace), the record of the pod still running stays.
        let deadline = Instant::now() + std::time::Duration::from_secs(20);
        while binary.exists() {
            assert!(Instant::now() < deadline, "the binary stayed:\n{}", installer.log());
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        assert_eq!(records(&ctrd.state_dir).len(), 1, "a running pod's record went:\n{}", installer.log());
        assert!(installer.child.try_wait().unwrap().is_none(), "the installer ended with pods running");
    }
    // The pods' teardown, by the chain the runtime holds now (without aether-cni): it
    // succeeds, releases their addresses; their netns and sandboxes go.
    for (id, sb) in &pods[torn_down..] {
        ctrd.stop_pod(id);
        ctrd.remove_pod(id);
        assert!(ctrd.sandbox(id).is_err(), "sandbox {id} still known after RemovePodSandbox");
        assert!(!std::path::Path::new(&sb.netns).exists(), "containerd kept {}", sb.netns);
        assert!(!ctrd.ipam_leases().contains(&sb.ip), "{id}: host-local still holds {}", sb.ip);
    }
    let status = installer.wait(std::time::Duration::from_secs(if withheld { 30 } else { 45 }));
    let log = installer.log();
    assert!(status.success(), "the installer's uninstall failed ({status}):\n{log}");
    let conf_after = dir_state(&ctrd.net_dir);
    assert!(conf_after == conf_before, "the conf dir differs:\n{}", text_diff(&conf_before, &conf_after));
    let bin_after = dir_state(&ctrd.bin_dir);
    if withheld {
        assert!(binary.exists(), "the binary went without the runtime's word:\n{log}");
        assert!(uninstalled.exists(), "`uninstalled` went without the runtime's word:\n{log}");
        let left = records(&ctrd.state_dir);
        assert_eq!(left.len(), 2, "records went without the runtime's word: {left:?}\n{log}");
        assert!(
            log.contains("/uninstalled, the records of 2 pods")
                && log.contains("withheld.sock")
                && log.contains("nothing removes them but a later install"),
            "the log does not say what stays and why:\n{log}"
        );
    } else {
        assert!(bin_after == bin_before, "the bin dir differs:\n{}\n{log}", text_diff(&bin_before, &bin_after));
        assert!(!uninstalled.exists(), "`uninstalled` stayed:\n{log}");
        assert!(records(&ctrd.state_dir).is_empty(), "records stayed: {:?}\n{log}", records(&ctrd.state_dir));
        assert!(log.contains("nothing of aether-cni is left on this node"), "{log}");
        let state: Vec<String> = std::fs::read_dir(&ctrd.state_dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        eprintln!("{test}: the state dir holds {state:?}");
    }
    eprintln!("{test}: {} in {:?}", if withheld { "nothing removed" } else { "nothing left" }, started.elapsed());
}
