//! `doctor` detects a connect-time socket load balancer (BPF programs at the root cgroup's
//! connect/sendmsg hooks, as Cilium's socket LB and Calico's eBPF dataplane attach them) and
//! says what it breaks and how to configure it; a warning, not a failure.
//!
//! Attaching at the root cgroup changes every process of the machine, so the attaching part
//! runs only inside the kernel matrix's VM (`make test-kernels`: the VM's root cgroup is its
//! own), with the program built by the matrix (`tests/bpf/connect4.c`, Debian's clang) and
//! attached with bpftool. Negative control first: doctor says there is none; then attached:
//! doctor warns; then detached: none again.

mod common;

use std::process::Command;

use aether_testkit::root_or_skip;
use common::bin;

const PIN: &str = "/sys/fs/bpf/aether_test_connect4";

/// Inside the matrix's VM: its runner says so, and the kernel was booted by virtme-ng.
fn in_matrix_vm() -> bool {
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    std::env::var("AETHER_KERNEL_MATRIX_VM").as_deref() == Ok("1") && cmdline.contains("virtme_link_mods=")
}

fn doctor() -> String {
    let out = Command::new(bin()).arg("doctor").output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "a socket LB is a warning, never a failure:\n{text}");
    text
}

fn sh(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Detaches and unpins on every exit, failure included.
struct Attached(String);

impl Drop for Attached {
    fn drop(&mut self) {
        let _ = Command::new("bpftool").args(["cgroup", "detach", &self.0, "connect4", "pinned", PIN]).status();
        let _ = std::fs::remove_file(PIN);
    }
}

#[test]
fn doctor_warns_of_a_connect_time_socket_load_balancer_and_says_how_to_configure_it() {
    if !root_or_skip("doctor_warns_of_a_connect_time_socket_load_balancer_and_says_how_to_configure_it") {
        return;
    }
    if !in_matrix_vm() {
        eprintln!("SKIPPED doctor_warns_of_a_connect_time_socket_load_balancer: it attaches a BPF program to the root cgroup, so it runs only inside the kernel matrix's VM (make test-kernels)");
        return;
    }
    let object = std::env::var("AETHER_TEST_CONNECT4_OBJ").expect("the matrix passes the built program");
    // The VM's own cgroup2 and bpf filesystems, mounted if its init did not.
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let mounted = |fstype: &str| {
        mounts.lines().find(|l| l.split(' ').nth(2) == Some(fstype)).map(|l| l.split(' ').nth(1).unwrap().to_string())
    };
    let root = match mounted("cgroup2") {
        Some(r) => r,
        None => {
            sh("mount", &["-t", "cgroup2", "cgroup2", "/sys/fs/cgroup"]);
            "/sys/fs/cgroup".to_string()
        }
    };
    if mounted("bpf").is_none() {
        sh("mount", &["-t", "bpf", "bpf", "/sys/fs/bpf"]);
    }

    let before = doctor();
    assert!(before.contains("ok    no connect-time socket load balancer"), "the negative control:\n{before}");

    sh("bpftool", &["prog", "load", &object, PIN, "type", "cgroup/connect4"]);
    let attached = Attached(root.clone());
    sh("bpftool", &["cgroup", "attach", &root, "connect4", "pinned", PIN]);
    let during = doctor();
    println!("doctor with a connect4 program at the root cgroup:\n{during}");
    for want in [
        "warn  a connect-time socket load balancer",
        "connect4 (1)",
        "socketLB.hostNamespaceOnly=true",
        "bpfConnectTimeLoadBalancing",
    ] {
        assert!(during.contains(want), "doctor should say {want:?}:\n{during}");
    }
    assert!(!during.contains("no connect-time socket load balancer"), "{during}");

    drop(attached);
    let after = doctor();
    assert!(after.contains("ok    no connect-time socket load balancer"), "detached, it is gone:\n{after}");
}
