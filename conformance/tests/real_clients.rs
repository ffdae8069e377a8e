//! Real CNI clients nobody in this project wrote, driving the built `aether-cni` binary:
//!
//! - libcni 1.1.2 through `cnitool` (built offline from Debian's source package by
//!   `make clients-deps`), with a conflist chaining Debian's `bridge` + `host-local` +
//!   `portmap` + `aether-cni`, pod annotations in `CAP_ARGS`;
//! - podman 4.3 with `network_backend = "cni"`: a container from a local busybox rootfs on a
//!   network whose conflist chains `aether-cni`, then `podman network reload`, then stop.
//!
//! The machine's own network namespace is never touched: `bridge` makes its bridge (and
//! `portmap` its iptables chains) in the namespace the client runs in, so each client runs in
//! a private "node" netns of its own, and the pods are further netns behind that. Everything
//! (netns, temp dirs, containers, libcni's cache files) is removed on drop, also on failure.
//!
//! Root tests: they skip loudly without root, and fail under AETHER_REQUIRE_ROOT_TESTS=1 (CI),
//! as they also do there when `make clients-deps` has not been run.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use aether_conformance::clients::{
    assert_captured, assert_clean, capture_state, client, cnitool_path, exec, must, records, render, table_handle,
    KeptNetns, LibcniCache, Output, Podman, TempDir, ROUTE_TABLE,
};
use aether_conformance::cni_bin;
use aether_testkit::{root_or_skip, TestNetns};
use serde_json::Value;

// ---------------------------------------------------------------------------------------
// libcni: cnitool
// ---------------------------------------------------------------------------------------

/// cnitool, run inside the node netns, with the env a runtime built on libcni provides.
struct Cnitool<'a> {
    tool: PathBuf,
    node: &'a TestNetns,
    net_dir: PathBuf,
    cni_path: String,
    network: String,
}

impl Cnitool<'_> {
    fn run(&self, cmd: &str, pod: &str, cap_args: &Value, cni_args: &str) -> Output {
        exec(
            Command::new("ip")
                .args(["netns", "exec", &self.node.name])
                .arg(&self.tool)
                .args([cmd, &self.network, pod])
                .env("NETCONFPATH", &self.net_dir)
                .env("CNI_PATH", &self.cni_path)
                .env("CAP_ARGS", cap_args.to_string())
                .env("CNI_ARGS", cni_args)
                .env("CNI_IFNAME", "eth0"),
        )
    }
}

fn cnitool_chain(cni_version: &str) {
    let test = format!("cnitool_chain_{cni_version}");
    if !root_or_skip(&test) {
        return;
    }
    let Some(tool) = client(&test, &cnitool_path()) else { return };
    let plugin = cni_bin();
    let started = Instant::now();

    let tag = format!("cni{}", cni_version.replace('.', ""));
    let dir = TempDir::new(&tag);
    let network = format!("aether-cnitool-{tag}-{}", std::process::id());
    let _cache = LibcniCache(network.clone());
    let (net_dir, bin_dir, state_dir, ipam_dir) =
        (dir.mkdir("net"), dir.mkdir("bin"), dir.mkdir("state"), dir.mkdir("ipam"));
    std::os::unix::fs::symlink(&plugin, bin_dir.join("aether-cni")).unwrap();
    let conflist = render(
        "cnitool.conflist.in",
        &[
            ("CNI_VERSION", cni_version.to_string()),
            ("NAME", network.clone()),
            ("BRIDGE", "aecni0".into()),
            ("SUBNET", "10.250.7.0/24".into()),
            ("GATEWAY", "10.250.7.1".into()),
            ("IPAM_DIR", ipam_dir.display().to_string()),
            ("STATE_DIR", state_dir.display().to_string()),
        ],
    );
    std::fs::write(net_dir.join(format!("{network}.conflist")), conflist).unwrap();

    let node = TestNetns::new(&format!("{tag}node"));
    let cni = Cnitool {
        tool,
        node: &node,
        net_dir,
        cni_path: format!("/usr/lib/cni:{}", bin_dir.display()),
        network: network.clone(),
    };
    let cni_args =
        "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart-0;K8S_POD_INFRA_CONTAINER_ID=0123;K8S_POD_UID=u-1";

    // --- a managed pod: annotations excluding ports and a CIDR.
    let pod = TestNetns::new(&format!("{tag}pod"));
    let pod_path = pod.path();
    let caps = serde_json::json!({
        "io.kubernetes.cri.pod-annotations": {
            "aether.io/capture": "redirect-all",
            "aether.io/exclude-outbound-ports": "8443,9000-9100",
            "aether.io/exclude-outbound-cidrs": "192.0.2.0/24",
        },
    });
    let out = cni.run("add", &pod_path, &caps, cni_args);
    let result: Value = serde_json::from_str(&must("cnitool add", out)).unwrap();
    assert_eq!(result["cniVersion"], cni_version, "{result:#}");
    let address = result["ips"][0]["address"].as_str().unwrap_or_else(|| panic!("no address in {result:#}"));
    assert!(address.starts_with("10.250.7."), "{result:#}");
    let eth0 =
        result["interfaces"].as_array().unwrap().iter().find(|i| i["name"] == "eth0").expect("eth0 in the result");
    assert_eq!(eth0["sandbox"], pod_path.as_str(), "{result:#}");
    // The pod got its address, from bridge + host-local, through the whole chain.
    let (_, _, _, addrs) = capture_state(&pod_path);
    assert!(addrs.contains(&format!("eth0    inet {address}")), "{address} not on eth0:\n{addrs}");
    // The capture is in place, with the annotations' effect and the node DNS proxy.
    let ruleset = assert_captured(&pod_path, &["8443", "9000-9100", "192.0.2.0/24", "dnat to 10.250.7.1:18054"]);
    assert!(!node.exec("nft", &["list", "ruleset"]).contains("aether"), "aether-cni programmed the node netns");
    let recs = records(&state_dir);
    assert!(recs.len() == 1 && recs[0].contains(&network), "one attachment record expected after ADD: {recs:?}");

    // CHECK through libcni (it replays the cached result as prevResult) passes...
    must("cnitool check", cni.run("check", &pod_path, &caps, cni_args));
    // ...and really reaches the plugin: a missing policy rule is caught.
    pod.exec("ip", &["rule", "del", "fwmark", "0xae71", "lookup", ROUTE_TABLE]);
    let out = cni.run("check", &pod_path, &caps, cni_args);
    assert!(!out.ok, "cnitool check passed with the policy rule removed:\n{}", out.stderr);
    pod.exec("ip", &["rule", "add", "fwmark", "0xae71", "lookup", ROUTE_TABLE, "priority", "32000"]);
    must("cnitool check (rule restored)", cni.run("check", &pod_path, &caps, cni_args));
    assert_eq!(ruleset, capture_state(&pod_path).0, "CHECK changed the ruleset");

    // DEL leaves the pod netns clean, releases the address, and is idempotent.
    must("cnitool del", cni.run("del", &pod_path, &caps, cni_args));
    assert_clean(&pod_path);
    assert!(
        !ipam_dir.join(&network).join(address.split('/').next().unwrap()).exists(),
        "host-local still holds {address}"
    );
    assert!(
        records(&state_dir).is_empty(),
        "attachment records left after DEL: {:?} (after ADD: {recs:?})",
        records(&state_dir)
    );
    must("cnitool del (again)", cni.run("del", &pod_path, &caps, cni_args));

    // --- a pod with a host port: portmap does its part in the node netns (never on the
    // machine), aether-cni its part in the pod. (No CHECK here: portmap 1.1.1's CHECK wrongly
    // looks for IPv6 rules of an IPv4-only pod, containernetworking/plugins#819.)
    let hp = TestNetns::new(&format!("{tag}hp"));
    let hp_caps = serde_json::json!({
        "io.kubernetes.cri.pod-annotations": { "aether.io/capture": "scoped" },
        "portMappings": [{ "hostPort": 18080, "containerPort": 80, "protocol": "tcp" }],
    });
    must("cnitool add (host port)", cni.run("add", &hp.path(), &hp_caps, cni_args));
    let node_rules = node.exec("iptables-save", &["-t", "nat"]);
    assert!(node_rules.contains("--dport 18080"), "portmap's DNAT missing in the node netns:\n{node_rules}");
    assert_captured(&hp.path(), &["18081"]);
    must("cnitool del (host port)", cni.run("del", &hp.path(), &hp_caps, cni_args));
    assert_clean(&hp.path());
    let node_rules = node.exec("iptables-save", &["-t", "nat"]);
    assert!(!node_rules.contains("--dport 18080"), "portmap's DNAT left in the node netns:\n{node_rules}");

    // --- a pod that opts out: it gets its address, and nothing from aether-cni.
    let optout = TestNetns::new(&format!("{tag}off"));
    let off_caps = serde_json::json!({ "io.kubernetes.cri.pod-annotations": { "aether.io/capture": "disabled" } });
    let result: Value =
        serde_json::from_str(&must("cnitool add (disabled)", cni.run("add", &optout.path(), &off_caps, cni_args)))
            .unwrap();
    assert!(result["ips"][0]["address"].as_str().is_some_and(|a| a.starts_with("10.250.7.")), "{result:#}");
    let (ruleset, rules, _, _) = capture_state(&optout.path());
    assert!(!ruleset.contains("aether") && !rules.contains("0xae71"), "a disabled pod was captured:\n{ruleset}{rules}");
    must("cnitool check (disabled)", cni.run("check", &optout.path(), &off_caps, cni_args));
    must("cnitool del (disabled)", cni.run("del", &optout.path(), &off_caps, cni_args));
    assert_clean(&optout.path());

    // --- a malformed annotation: ADD fails through libcni with the annotation named, and
    // leaves no capture behind (bridge's part is undone by the runtime's DEL).
    let bad = TestNetns::new(&format!("{tag}bad"));
    let bad_caps =
        serde_json::json!({ "io.kubernetes.cri.pod-annotations": { "aether.io/exclude-outbound-ports": "http" } });
    let out = cni.run("add", &bad.path(), &bad_caps, cni_args);
    assert!(!out.ok, "ADD with a malformed annotation succeeded:\n{}", out.stdout);
    assert!(
        out.stderr.contains("aether.io/exclude-outbound-ports") && out.stderr.contains("http"),
        "libcni's error does not name the annotation and value:\n{}",
        out.stderr
    );
    let (ruleset, rules, _, _) = capture_state(&bad.path());
    assert!(!ruleset.contains("aether") && !rules.contains("0xae71"), "failed ADD left capture:\n{ruleset}{rules}");
    must("cnitool del (after failed add)", cni.run("del", &bad.path(), &bad_caps, cni_args));
    assert_clean(&bad.path());
    assert!(records(&state_dir).is_empty(), "records left: {:?}", records(&state_dir));

    eprintln!(
        "{test}: libcni (cnitool) add/check/del through bridge+host-local+portmap+aether-cni in {:?}",
        started.elapsed()
    );
}

#[test]
fn cnitool_chain_bridge_hostlocal_portmap_aether_1_0_0() {
    cnitool_chain("1.0.0");
}

#[test]
fn cnitool_chain_bridge_hostlocal_portmap_aether_0_4_0() {
    cnitool_chain("0.4.0");
}

// ---------------------------------------------------------------------------------------
// podman 4.3, CNI backend
// ---------------------------------------------------------------------------------------

#[test]
fn podman_cni_backend_start_reload_stop() {
    let test = "podman_cni_backend_start_reload_stop";
    if !root_or_skip(test) {
        return;
    }
    let Some(_) = client(test, Path::new("/usr/bin/podman")) else { return };
    let Some(busybox) = client(test, Path::new("/bin/busybox")) else { return };
    let plugin = cni_bin();
    let started = Instant::now();

    let dir = TempDir::new("podman");
    let network = format!("aether-podman-{}", std::process::id());
    let (net_dir, bin_dir, state_dir, ipam_dir) =
        (dir.mkdir("net"), dir.mkdir("bin"), dir.mkdir("state"), dir.mkdir("ipam"));
    std::os::unix::fs::symlink(&plugin, bin_dir.join("aether-cni")).unwrap();
    std::fs::write(
        net_dir.join(format!("{network}.conflist")),
        render(
            "podman.conflist.in",
            &[
                ("NAME", network.clone()),
                ("BRIDGE", "aepodman0".into()),
                ("SUBNET", "10.250.8.0/24".into()),
                ("GATEWAY", "10.250.8.1".into()),
                ("IPAM_DIR", ipam_dir.display().to_string()),
                ("STATE_DIR", state_dir.display().to_string()),
            ],
        ),
    )
    .unwrap();
    // The container's rootfs: busybox-static and a few links, no image, no registry.
    let rootfs = dir.mkdir("rootfs");
    for d in ["bin", "proc", "sys", "dev", "etc", "tmp"] {
        std::fs::create_dir_all(rootfs.join(d)).unwrap();
    }
    std::fs::copy(busybox, rootfs.join("bin/busybox")).unwrap();
    for applet in ["sh", "sleep"] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
    }

    let node = TestNetns::new("pmnode");
    let podman = Podman::new(&node, &dir, &bin_dir, &net_dir);
    let name = format!("aether-ctr-{}", std::process::id());
    let rootfs_arg = rootfs.display().to_string();

    // Start: podman runs VERSION, then ADD through bridge + host-local + aether-cni.
    let rootfs_flag = ["--rootfs", rootfs_arg.as_str()];
    let mut args = vec!["run", "--detach", "--name", &name, "--network", &network];
    args.extend_from_slice(&rootfs_flag);
    args.extend_from_slice(&["/bin/sleep", "600"]);
    must("podman run", podman.run(&args));
    let inspect = must("podman inspect", podman.run(&["inspect", &name]));
    let inspect: Value = serde_json::from_str(&inspect).unwrap();
    let sandbox = inspect[0]["NetworkSettings"]["SandboxKey"].as_str().expect("SandboxKey").to_string();
    let pid = inspect[0]["State"]["Pid"].as_u64().expect("State.Pid");
    let address = inspect[0]["NetworkSettings"]["Networks"][&network]["IPAddress"].as_str().unwrap_or("").to_string();
    assert!(address.starts_with("10.250.8."), "container address {address:?}:\n{inspect:#}");
    let kept = KeptNetns::attach("pmkeep", pid);
    let kept_path = kept.path();

    let (_, _, _, addrs) = capture_state(&sandbox);
    assert!(addrs.contains(&format!("eth0    inet {address}/24")), "{address} not on eth0:\n{addrs}");
    let before = assert_captured(&sandbox, &["9443", "dnat to 10.250.8.1:18054"]);
    let recs = records(&state_dir);
    let id = inspect[0]["Id"].as_str().expect("Id");
    assert!(recs.len() == 1 && recs[0].contains(id), "one attachment record for {id} expected: {recs:?}");
    assert!(!node.exec("nft", &["list", "ruleset"]).contains("aether"), "aether-cni programmed the node netns");

    // Reload: podman tears the container's network down and sets it up again (DEL, ADD): the
    // same ruleset, in a table the kernel made anew (a new table handle).
    let handle_before = table_handle(&sandbox);
    must("podman network reload", podman.run(&["network", "reload", &name]));
    let after = assert_captured(&sandbox, &["9443"]);
    assert_eq!(before, after, "the ruleset after podman network reload differs");
    assert_ne!(handle_before, table_handle(&sandbox), "podman network reload did not re-create the capture");
    assert_eq!(records(&state_dir).len(), recs.len(), "attachment records after reload: {:?}", records(&state_dir));

    // Stop: DEL. Podman releases its netns; the kept handle shows what DEL left in it.
    must("podman stop", podman.run(&["stop", "--time", "0", &name]));
    assert!(!Path::new(&sandbox).exists(), "podman kept {sandbox}");
    assert_clean(&kept_path);
    assert!(records(&state_dir).is_empty(), "attachment records left after stop: {:?}", records(&state_dir));
    let ipam = std::fs::read_dir(ipam_dir.join(&network))
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect::<Vec<_>>());
    assert!(!ipam.unwrap_or_default().contains(&address), "host-local still holds {address}");
    must("podman rm", podman.run(&["rm", &name]));

    eprintln!(
        "{test}: podman 4.3 (CNI backend) run/reload/stop through bridge+host-local+aether-cni in {:?}",
        started.elapsed()
    );
}
