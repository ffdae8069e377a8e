//! Finishing an uninstall that left the plugin binary for attached pods, where the runtime
//! says enough to know that nothing needs it any more.
//!
//! containerd (1.6 to 2.x) tears a pod down with the CNI chain it holds *now*, and never runs
//! CNI GC: once it reloaded after the conflist went, no DEL or GC of aether-cni ever runs on
//! the node again, so the DEL that would remove the last record (and with it the binary and
//! `<stateDir>/uninstalled`, `aether_node::state::uninstall`) never comes. So the stopping
//! installer asks the runtime itself, for at most `--uninstall-wait-seconds`:
//!
//! - **The chain it holds**: the CRI `Status` call's verbose info. containerd gives the CNI
//!   configuration its CRI plugin holds as JSON (`cniconfig`) and whether its last load
//!   worked (`lastCNILoadStatus`). Only a configuration that loaded, parses as go-cni's, and
//!   names no aether-cni anywhere is taken for "no chain names it" ([`RuntimeChain::Free`]);
//!   no answer, no `cniconfig` (CRI-O, a runtime that keeps each pod's chain), a failed load,
//!   or another runtime handler's configuration it does not show: unknown, nothing removed.
//! - **The binary** goes once the runtime said so and [`RELOAD_GRACE`] passed since it first
//!   said so: a DEL or ADD that took the old chain just before the reload has run aether-cni
//!   by then (it is last in the chain: DEL runs it first). Under the state directory's
//!   exclusive lock, and only the very file `uninstalled` names: an ADD that raced and put it
//!   back, or a re-install, is never undone from under it.
//! - **A record** is collected (as GC collects it: its Service layer retired, its counts
//!   folded) only for a pod that is gone by positive evidence: its recorded network namespace
//!   is gone **and** the runtime's answered pod list does not have its sandbox ready. A list
//!   that did not come is no evidence.
//!
//! Once no record is left, nothing of aether-cni is on the node. What stays when the wait
//! ends is said in the log (and in docs/operating.md).

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_cri::{Client, SandboxState};
use aether_node::attachment;
use aether_node::config;
use aether_node::state::{PodNetns, StateDir, RELOAD_GRACE};
use serde_json::Value;
use tokio::runtime::Runtime;

use crate::chain;
use crate::reconcile::node_lib::NodeFiles;

/// What the runtime says of the CNI chain it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuntimeChain {
    /// It names aether-cni: the runtime may still run it for a teardown.
    Names,
    /// It loaded a configuration, shows all of it, and none of it names aether-cni.
    Free,
    /// No answer yet, or one that may say later (a failed load): why. Asked again.
    Unknown(String),
    /// It answers, and its answers do not show the chain it holds (not containerd: no
    /// `cniconfig`; a runtime handler's own CNI configuration; no `Status` call): why. Not
    /// asked again: it will not say.
    Silent(String),
}

/// [`RuntimeChain`] from the verbose `Status` info: fail closed, `Free` only on positive
/// evidence. `plugin` is the plugin's type (its binary's name).
pub fn runtime_chain(info: &BTreeMap<String, String>, plugin: &str) -> RuntimeChain {
    use RuntimeChain::{Silent, Unknown};
    // containerd 2 says each network plugin's load status as `lastCNILoadStatus.<name>`
    // (`default`: the one `cniconfig` shows, also said as `lastCNILoadStatus`); another
    // name is a runtime handler's own CNI configuration, which it does not show.
    if let Some(key) = info.keys().find(|k| k.starts_with("lastCNILoadStatus.") && *k != "lastCNILoadStatus.default") {
        return Silent(format!("the runtime holds another CNI configuration ({key}) it does not show"));
    }
    let Some(text) = info.get("cniconfig") else {
        return Silent(
            "the runtime's verbose Status has no \"cniconfig\" (only containerd's shows the chain it holds)".into(),
        );
    };
    if let Some(failed) = info.get("lastCNILoadStatus.default").filter(|s| *s != "OK") {
        return Unknown(format!("the runtime's last CNI load failed: {failed}"));
    }
    match info.get("lastCNILoadStatus").map(String::as_str) {
        Some("OK") => {}
        Some(failed) => return Unknown(format!("the runtime's last CNI load failed: {failed}")),
        None => return Unknown("the runtime's verbose Status has no \"lastCNILoadStatus\"".into()),
    }
    // Anywhere in it (a plugin's type, its source, a network's name): not free.
    if text.contains(plugin) {
        return RuntimeChain::Names;
    }
    let Ok(v) = serde_json::from_str::<Value>(text) else {
        return Unknown("\"cniconfig\" is not JSON".into());
    };
    let Some(networks) = v.get("Networks").and_then(Value::as_array) else {
        return Unknown("\"cniconfig\" has no Networks list".into());
    };
    for n in networks {
        let Some(plugins) = n.pointer("/Config/Plugins").and_then(Value::as_array) else {
            return Unknown("a network of \"cniconfig\" has no Config.Plugins list".into());
        };
        if plugins.iter().any(|p| p.pointer("/Network/type").and_then(Value::as_str).is_none()) {
            return Unknown("a plugin of \"cniconfig\" has no type".into());
        }
    }
    RuntimeChain::Free
}

/// Where the runtime's answered pod list has a record's sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listed {
    Ready,
    NotReady,
    Absent,
}

/// A pod is gone on positive evidence only: its recorded netns is gone and the runtime, which
/// answered, does not have its sandbox ready (`None`: no answer).
pub fn pod_gone(listed: Option<Listed>, netns_gone: bool) -> bool {
    netns_gone && matches!(listed, Some(Listed::NotReady | Listed::Absent))
}

/// What may be removed now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Decision {
    pub remove_binary: bool,
    /// The records (keys) of pods gone.
    pub collect: Vec<String>,
}

/// The decision: nothing unless the runtime's chain is free and was for [`RELOAD_GRACE`]
/// (`free_for`: since its first such answer); then the binary, and the records of the pods
/// gone (`pods`: each record's key and whether its pod is gone, by [`pod_gone`]).
pub fn decide(runtime: &RuntimeChain, free_for: Option<Duration>, pods: &[(String, bool)]) -> Decision {
    match (runtime, free_for) {
        (RuntimeChain::Free, Some(t)) if t >= RELOAD_GRACE => Decision {
            remove_binary: true,
            collect: pods.iter().filter(|(_, gone)| *gone).map(|(k, _)| k.clone()).collect(),
        },
        _ => Decision::default(),
    }
}

/// How the wait ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Nothing of aether-cni is left: `collected` records, and the binary.
    Finished { collected: usize },
    /// `uninstalled` went by another hand (the last DEL, or a re-install): nothing more to do.
    TakenOver,
    /// The wait ended with these left.
    Left { runtime: RuntimeChain, binary_removed: bool, records: Vec<String>, collected: usize },
}

/// The settings of the wait.
pub struct Finish {
    pub cri_socket: Option<PathBuf>,
    pub cri_timeout: Duration,
    pub wait: Duration,
    pub state_dir: PathBuf,
    pub binary: PathBuf,
    pub files: NodeFiles,
}

/// One question to the runtime, answered within `timeout` in all (the wait's bound holds: the
/// chart fits it in the grace period).
fn ask_runtime(
    rt: &Runtime,
    socket: &Path,
    timeout: Duration,
    list: bool,
) -> (RuntimeChain, Option<BTreeMap<String, SandboxState>>) {
    let within = |r: Result<Result<_, aether_cri::Error>, tokio::time::error::Elapsed>| {
        r.unwrap_or_else(|_| {
            Err(aether_cri::Error::Connect { socket: socket.into(), why: format!("no answer within {timeout:?}") })
        })
    };
    let answer = rt.block_on(async {
        tokio::time::timeout(timeout, async {
            let mut c = Client::connect(socket, timeout).await?;
            let info = c.runtime_info().await?;
            let chain = runtime_chain(&info, chain::PLUGIN_TYPE);
            let sandboxes = if list && chain == RuntimeChain::Free {
                c.sandboxes().await.ok().map(|l| l.into_iter().map(|s| (s.id, s.state)).collect())
            } else {
                None
            };
            Ok::<_, aether_cri::Error>((chain, sandboxes))
        })
        .await
    });
    let answer = within(answer);
    answer.unwrap_or_else(|e| match e {
        aether_cri::Error::Call { code: aether_cri::Code::Unimplemented, .. } => {
            (RuntimeChain::Silent(e.to_string()), None)
        }
        e => (RuntimeChain::Unknown(e.to_string()), None),
    })
}

/// Removes the binary `uninstalled` names (under the exclusive lock) and that word. `None`:
/// `uninstalled` went meanwhile (taken over); `Some(removed)` otherwise.
fn remove_binary(state: &StateDir, binary: &Path) -> Result<Option<bool>, String> {
    let _lock = state.lock(true).map_err(|e| e.to_string())?;
    let Some(u) = state.uninstalled() else { return Ok(None) };
    let removed = match std::fs::metadata(binary) {
        Ok(m) if (m.dev(), m.ino()) == (u.dev, u.ino) => {
            std::fs::remove_file(binary).map_err(|e| format!("cannot remove {}: {e}", binary.display()))?;
            true
        }
        // Another file there (not the one left): not ours to remove.
        Ok(_) => false,
        Err(_) => false,
    };
    state.clear_uninstalled().map_err(|e| e.to_string())?;
    Ok(Some(removed))
}

/// The entry on a stand-in list, as the plugin parses it: what GC needs to collect a record.
fn collect_conf(files: &NodeFiles) -> Option<config::NetConf> {
    let stand_in = chain::Primary {
        path: PathBuf::from("(uninstall)"),
        bytes: br#"{"cniVersion":"1.1.0","name":"uninstall","plugins":[{"type":"main-cni"}]}"#.to_vec(),
        mode: 0o644,
    };
    let (_, as_passed) = chain::chain(&stand_in, &files.entry).ok()?;
    config::parse(&as_passed).ok()
}

/// Waits (at most `wait`, asking each second) until nothing of aether-cni is left, removing
/// what the runtime's answers allow (see the module's text).
pub fn finish(s: &Finish, rt: &Arc<Runtime>) -> Outcome {
    let state = StateDir::new(&s.state_dir);
    let deadline = Instant::now() + s.wait;
    if s.cri_socket.is_none() {
        let records = state.scan().records.iter().map(|r| r.key()).collect();
        let runtime = RuntimeChain::Unknown("no --cri-socket: the runtime is not asked".into());
        return Outcome::Left { runtime, binary_removed: false, records, collected: 0 };
    }
    let mut free_since: Option<Instant> = None;
    let mut last: Option<RuntimeChain> = None;
    let (mut binary_removed, mut collected) = (false, 0);
    loop {
        // Each question within what is left of the wait (a second at least).
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
        let (runtime, listed) = match &s.cri_socket {
            Some(socket) => ask_runtime(rt, socket, s.cri_timeout.min(left), true),
            None => (RuntimeChain::Unknown("no --cri-socket: the runtime is not asked".into()), None),
        };
        if last.as_ref() != Some(&runtime) {
            match &runtime {
                RuntimeChain::Free => tracing::info!("the runtime's CNI chain names no aether-cni"),
                RuntimeChain::Names => tracing::info!("the runtime's CNI chain still names aether-cni"),
                RuntimeChain::Unknown(why) | RuntimeChain::Silent(why) => {
                    tracing::info!("the runtime does not say which CNI chain it holds: {why}")
                }
            }
            last = Some(runtime.clone());
        }
        if runtime == RuntimeChain::Free {
            free_since.get_or_insert_with(Instant::now);
        } else {
            free_since = None;
        }
        let scan = state.scan();
        let pods: Vec<(String, bool)> = scan
            .records
            .iter()
            .map(|r| {
                let netns_gone = matches!(r.open_netns(), Ok(PodNetns::Gone(_)));
                let on_list = listed.as_ref().map(|l| match l.get(&r.container_id) {
                    Some(SandboxState::Ready) => Listed::Ready,
                    Some(SandboxState::NotReady) => Listed::NotReady,
                    None => Listed::Absent,
                });
                (r.key(), pod_gone(on_list, netns_gone))
            })
            .collect();
        let decision = decide(&runtime, free_since.map(|t| t.elapsed()), &pods);
        // Before the binary went, `uninstalled` gone is another's hand (the last DEL, a
        // re-install); after, it is back only if an ADD that raced put the binary back.
        if !binary_removed && state.uninstalled().is_none() {
            return Outcome::TakenOver;
        }
        if decision.remove_binary && state.uninstalled().is_some() {
            match remove_binary(&state, &s.binary) {
                Ok(None) => {}
                Ok(Some(removed)) => {
                    if removed {
                        tracing::info!(file = %s.binary.display(), "removed: the runtime's CNI chain names no aether-cni any more");
                    }
                    binary_removed = true;
                }
                Err(e) => tracing::warn!("the plugin binary stays: {e}"),
            }
        }
        if let Some(conf) = collect_conf(&s.files) {
            for r in scan.records.iter().filter(|r| decision.collect.contains(&r.key())) {
                let mut c = conf.clone();
                c.name = r.network.clone();
                c.state_dir = s.state_dir.clone();
                let (id, ifname) = (r.container_id.clone(), r.ifname.clone());
                match attachment::collect(&c, |ci, i| !(ci == id && i == ifname)) {
                    Ok(()) => {
                        collected += 1;
                        tracing::info!(record = %r.key(), "collected: its pod is gone (netns gone, the runtime has no ready sandbox)");
                    }
                    Err(e) => tracing::warn!(record = %r.key(), "the record stays: {e}"),
                }
            }
        }
        let left = state.scan();
        let records: Vec<String> =
            left.records.iter().map(|r| r.key()).chain(left.unreadable.iter().map(|u| u.file.clone())).collect();
        if binary_removed && records.is_empty() && state.uninstalled().is_none() {
            return Outcome::Finished { collected };
        }
        if Instant::now() >= deadline || matches!(runtime, RuntimeChain::Silent(_)) {
            return Outcome::Left { runtime, binary_removed, records, collected };
        }
        std::thread::sleep(Duration::from_secs(1).min(deadline.saturating_duration_since(Instant::now())));
    }
}

/// The log line for `outcome`: what was removed, what stays on the node, and how each thing
/// that stays goes (true to what runtimes do: containerd, 1.6 to 2.x, runs no DEL of
/// aether-cni after its reload and never CNI GC).
pub fn say(outcome: &Outcome, s: &Finish) {
    match outcome {
        Outcome::Finished { collected } => tracing::info!(
            "uninstall finished: the runtime's CNI chain names no aether-cni and the pods it captured are gone \
             ({collected} records collected), the plugin binary and {}/uninstalled removed: nothing of \
             aether-cni is left on this node",
            s.state_dir.display()
        ),
        Outcome::TakenOver => tracing::info!(
            "{}/uninstalled went meanwhile (the last DEL, or an installer again): the uninstall is theirs to finish",
            s.state_dir.display()
        ),
        Outcome::Left { .. } => tracing::warn!("{}", left_text(outcome, s)),
    }
}

/// What stays after a wait that ended with records left, and how it goes.
pub fn left_text(outcome: &Outcome, s: &Finish) -> String {
    let Outcome::Left { runtime, binary_removed, records, collected } = outcome else { return String::new() };
    let state = s.state_dir.display();
    let pods = format!(
        "the records of {} pods not known to be gone, in {state}/attachments ({})",
        records.len(),
        records.join(", ")
    );
    let capture = "and those pods' capture in their own netns (the uninstall touches no running pod: it goes \
                   with the pod)";
    let see = "docs/operating.md, \"Uninstall with pods running\"";
    if *runtime == RuntimeChain::Free && *binary_removed {
        return format!(
            "after {:?}: the plugin binary and {state}/uninstalled are removed (the runtime's CNI chain names no \
             aether-cni; {collected} records collected). What stays on this node: {pods}, {capture}. No teardown needs \
             those records, and no runtime removes them (containerd never runs aether-cni's DEL after its reload, \
             nor CNI GC): a later install adopts them and its reconciler collects each once its pod is gone; a \
             state directory on a tmpfs goes at reboot; or by hand once `aether-cni inspect` shows their netns \
             gone: rm -r {state}/attachments/* ({see})",
            s.wait
        );
    }
    let why = match runtime {
        RuntimeChain::Names => "the runtime's CNI chain still names aether-cni".to_string(),
        RuntimeChain::Unknown(why) | RuntimeChain::Silent(why) => why.clone(),
        RuntimeChain::Free => format!("the runtime's CNI chain named no aether-cni for less than {RELOAD_GRACE:?}"),
    };
    format!(
        "after {:?}: what stays on this node: the plugin binary {}{}, {state}/uninstalled, {pods} ({collected} \
         collected), {capture}; it cannot be known that no teardown needs the binary ({why}). On a runtime whose \
         teardowns still run aether-cni (its chain, or the pod's own, names it), the DEL that removes the last \
         record removes the binary and uninstalled. On containerd (1.6 to 2.x), which runs no DEL of aether-cni \
         after its reload and never CNI GC, nothing removes them but a later install (it takes the binary over, \
         removes uninstalled, adopts the records and its reconciler collects each once its pod is gone) or a hand, \
         once `aether-cni inspect` shows no record whose netns is alive: rm -r {state}/attachments/* \
         {state}/uninstalled {} ({see})",
        s.wait,
        s.binary.display(),
        if *binary_removed { " (removed, then put back by an ADD that raced the uninstall)" } else { "" },
        s.binary.display(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// As containerd 2.1.9 gives it (trimmed): loopback, then the node's bridge list.
    const BRIDGE: &str = r#"{"PluginDirs":["/opt/cni/bin"],"PluginConfDir":"/etc/cni/net.d","PluginMaxConfNum":1,"Prefix":"eth","Networks":[{"Config":{"Name":"cni-loopback","CNIVersion":"0.3.1","Plugins":[{"Network":{"type":"loopback","ipam":{},"dns":{}},"Source":"{\"type\":\"loopback\"}"}],"Source":"{}"},"IFName":"lo"},{"Config":{"Name":"node","CNIVersion":"1.1.0","Plugins":[{"Network":{"type":"bridge","ipam":{},"dns":{}},"Source":"{}"},{"Network":{"type":"portmap","ipam":{},"dns":{}},"Source":"{}"}],"Source":"{}"},"IFName":"eth0"}]}"#;

    #[test]
    fn a_loaded_chain_without_the_plugin_is_free() {
        assert_eq!(
            runtime_chain(&info(&[("cniconfig", BRIDGE), ("lastCNILoadStatus", "OK")]), "aether-cni"),
            RuntimeChain::Free
        );
        // containerd 2: the default network plugin's status said twice.
        let two = info(&[("cniconfig", BRIDGE), ("lastCNILoadStatus", "OK"), ("lastCNILoadStatus.default", "OK")]);
        assert_eq!(runtime_chain(&two, "aether-cni"), RuntimeChain::Free);
    }

    #[test]
    fn a_chain_naming_the_plugin_anywhere_is_not_free() {
        let chained = BRIDGE.replace(r#"{"Network":{"type":"portmap""#, r#"{"Network":{"type":"aether-cni""#);
        assert_eq!(
            runtime_chain(&info(&[("cniconfig", &chained), ("lastCNILoadStatus", "OK")]), "aether-cni"),
            RuntimeChain::Names
        );
    }

    /// Fail closed: every answer that does not say is unknown, never free.
    #[test]
    fn answers_that_do_not_say_are_unknown() {
        let unknown = |i: &[(&str, &str)]| {
            matches!(runtime_chain(&info(i), "aether-cni"), RuntimeChain::Unknown(_) | RuntimeChain::Silent(_))
        };
        assert!(unknown(&[]), "no verbose info (CRI-O, or a runtime that gives none)");
        assert!(unknown(&[("lastCNILoadStatus", "OK")]), "no cniconfig");
        assert!(unknown(&[("cniconfig", BRIDGE)]), "no load status");
        assert!(unknown(&[("cniconfig", BRIDGE), ("lastCNILoadStatus", "cni config load failed: no network config")]));
        assert!(
            unknown(&[("cniconfig", BRIDGE), ("lastCNILoadStatus", "OK"), ("lastCNILoadStatus.kata", "OK")]),
            "another handler's chain, not shown"
        );
        assert!(
            unknown(&[("cniconfig", BRIDGE), ("lastCNILoadStatus", "OK"), ("lastCNILoadStatus.default", "failed")]),
            "as the default's status"
        );
        assert!(unknown(&[("cniconfig", "{"), ("lastCNILoadStatus", "OK")]), "not JSON");
        assert!(unknown(&[("cniconfig", "{}"), ("lastCNILoadStatus", "OK")]), "no Networks");
        assert!(unknown(&[("cniconfig", r#"{"Networks":[{"Config":{}}]}"#), ("lastCNILoadStatus", "OK")]));
        assert!(unknown(&[
            ("cniconfig", r#"{"Networks":[{"Config":{"Plugins":[{"Network":{}}]}}]}"#),
            ("lastCNILoadStatus", "OK")
        ]));
    }

    #[test]
    fn a_pod_is_gone_only_on_positive_evidence() {
        assert!(pod_gone(Some(Listed::Absent), true));
        assert!(pod_gone(Some(Listed::NotReady), true));
        assert!(!pod_gone(None, true), "no list: no evidence");
        assert!(!pod_gone(Some(Listed::Ready), true), "the runtime has it ready");
        assert!(!pod_gone(Some(Listed::Absent), false), "its netns is still there");
        assert!(!pod_gone(None, false));
    }

    /// The wait itself, fail closed: a runtime that does not answer (or none given) removes
    /// neither the binary nor `uninstalled`, and the wait ends at its bound.
    #[test]
    fn without_the_runtime_s_answer_the_wait_removes_nothing() {
        let dir = aether_testkit::ScratchDir::new("uninstall-withheld");
        let (state_dir, binary) = (dir.0.join("state"), dir.0.join("aether-cni"));
        std::fs::write(&binary, b"plugin").unwrap();
        let state = StateDir::new(&state_dir);
        state.mark_uninstalled(&binary).unwrap();
        let files = NodeFiles {
            state_dir: state_dir.clone(),
            conf_dir: dir.0.join("net"),
            conflist_name: "00-aether-cni.conflist".into(),
            entry: serde_json::Map::new(),
        };
        let rt = crate::runtime::new().unwrap();
        for socket in [Some(dir.0.join("nobody.sock")), None] {
            let s = Finish {
                cri_socket: socket.clone(),
                cri_timeout: Duration::from_secs(1),
                wait: Duration::from_millis(1500),
                state_dir: state_dir.clone(),
                binary: binary.clone(),
                files: files.clone(),
            };
            let started = Instant::now();
            let outcome = finish(&s, &rt);
            let Outcome::Left { runtime: RuntimeChain::Unknown(why), binary_removed: false, .. } = &outcome else {
                panic!("{outcome:?}")
            };
            match &socket {
                Some(p) => {
                    assert!(why.contains(&p.display().to_string()), "{why}");
                    assert!(started.elapsed() >= s.wait, "the wait ended early: {:?}", started.elapsed());
                }
                None => assert!(why.contains("--cri-socket"), "{why}"),
            }
            assert!(binary.exists() && state.uninstalled().is_some(), "removed without the runtime's word");
        }
    }

    /// What the log says stays, and how it goes: the binary, `uninstalled`, the records and
    /// the pods' capture each named; on containerd no DEL or GC is promised.
    #[test]
    fn the_log_names_what_stays_and_how_it_goes() {
        let s = Finish {
            cri_socket: None,
            cri_timeout: Duration::from_secs(1),
            wait: Duration::from_secs(20),
            state_dir: "/var/run/aether-cni".into(),
            binary: "/host/opt/cni/bin/aether-cni".into(),
            files: NodeFiles {
                state_dir: "/var/run/aether-cni".into(),
                conf_dir: "/host/etc/cni/net.d".into(),
                conflist_name: "00-aether-cni.conflist".into(),
                entry: serde_json::Map::new(),
            },
        };
        let records = vec!["net/a/eth0".to_string(), "net/b/eth0".to_string()];
        let free = left_text(
            &Outcome::Left {
                runtime: RuntimeChain::Free,
                binary_removed: true,
                records: records.clone(),
                collected: 1,
            },
            &s,
        );
        for needle in [
            "the plugin binary and /var/run/aether-cni/uninstalled are removed",
            "the records of 2 pods not known to be gone, in /var/run/aether-cni/attachments (net/a/eth0, net/b/eth0)",
            "capture in their own netns",
            "containerd never runs aether-cni's DEL after its reload",
            "a later install adopts them",
            "rm -r /var/run/aether-cni/attachments/*",
        ] {
            assert!(free.contains(needle), "{needle:?} not in: {free}");
        }
        assert!(!free.contains("the DEL that removes the last"), "no DEL comes on containerd: {free}");
        let unknown = left_text(
            &Outcome::Left {
                runtime: RuntimeChain::Unknown("no answer from /run/x.sock".into()),
                binary_removed: false,
                records,
                collected: 0,
            },
            &s,
        );
        for needle in [
            "the plugin binary /host/opt/cni/bin/aether-cni, /var/run/aether-cni/uninstalled, the records of 2 pods",
            "(no answer from /run/x.sock)",
            "On a runtime whose teardowns still run aether-cni",
            "On containerd (1.6 to 2.x), which runs no DEL of aether-cni after its reload and never CNI GC, nothing \
             removes them but a later install",
            "rm -r /var/run/aether-cni/attachments/* /var/run/aether-cni/uninstalled /host/opt/cni/bin/aether-cni",
        ] {
            assert!(unknown.contains(needle), "{needle:?} not in: {unknown}");
        }
    }

    #[test]
    fn nothing_goes_unless_the_runtime_is_free_for_the_grace() {
        let pods = vec![("net/a/eth0".to_string(), true), ("net/b/eth0".to_string(), false)];
        let nothing = Decision::default();
        assert_eq!(decide(&RuntimeChain::Unknown("no answer".into()), Some(RELOAD_GRACE * 10), &pods), nothing);
        assert_eq!(decide(&RuntimeChain::Names, Some(RELOAD_GRACE * 10), &pods), nothing);
        assert_eq!(decide(&RuntimeChain::Silent("no cniconfig".into()), Some(RELOAD_GRACE * 10), &pods), nothing);
        assert_eq!(decide(&RuntimeChain::Free, None, &pods), nothing);
        assert_eq!(
            decide(&RuntimeChain::Free, Some(RELOAD_GRACE / 2), &pods),
            nothing,
            "a DEL that took the old chain may run"
        );
        let d = decide(&RuntimeChain::Free, Some(RELOAD_GRACE), &pods);
        assert_eq!(
            d,
            Decision { remove_binary: true, collect: vec!["net/a/eth0".into()] },
            "the pod still there keeps its record"
        );
        assert_eq!(
            decide(&RuntimeChain::Free, Some(RELOAD_GRACE), &[]),
            Decision { remove_binary: true, collect: vec![] }
        );
    }
}
