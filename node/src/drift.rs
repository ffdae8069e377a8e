//! A recorded pod's drift, looked at again and again (the installer's reconciler, every
//! pass): its capture compared with its record (CHECK's comparison), and its Service layer
//! compared with the stored one (`services verify`'s), each difference worded as those print
//! it. Cheap when nothing changed.
//!
//! A full comparison dumps a pod's tables (for a Service layer of 10,000 Services, tens of
//! thousands of set elements) and compares them element by element. Its result holds for as
//! long as nothing is committed in the pod's netns: the kernel's nftables generation
//! (`NFT_MSG_GETGEN`, [`aether_rules::nft::generation`]) moves with every committed
//! transaction there, by any writer, and with nothing else. So once a full comparison found a
//! pod intact, the generation read just before it is remembered, with the record and the
//! stored Service layer it was compared with; a later look that finds the same record, the
//! same stored layer and the same generation in the same netns (the record's netns cookie,
//! checked on opening) skips both table comparisons. The policy rule and route are not
//! nftables: they are read back every time (two small dumps per family).
//!
//! Any doubt is a full comparison: a record without a netns cookie, a generation that cannot
//! be read, a record or stored layer other than remembered, a pod not found intact last time
//! (a repair forgets it: the next look compares in full), a last full comparison older than
//! [`FULL_AT_LEAST_EVERY`] (the kernel raises the generation a few instructions before it
//! switches dumps to a commit's new state: a look whose read and dump both fell in between
//! would take the old state for the new generation's; the periodic comparison bounds that). A pod whose capture differs has its
//! Service layer compared at the next look, after the capture's repair.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use aether_netns::Netns;

use crate::attachment::{self, Target};
use crate::config::NetConf;
use crate::services::{self, LayerHeader, ServicesError};
use crate::state::{PodNetns, Record};

/// How a pod was compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compared {
    /// Both tables dumped and compared.
    Full,
    /// Nothing committed in the netns since a full comparison found the pod intact: the
    /// policy rule and route only.
    Unchanged,
}

/// What a look at one recorded pod found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Look {
    /// The differences of its capture (CHECK's wording) and of its Service layer (`services
    /// verify`'s, prefixed `Service layer:`); both empty: intact.
    Seen { capture: Vec<String>, services: Vec<String>, compared: Compared },
    /// The netns is gone, or is another namespace than the one ADD programmed.
    Gone(String),
    /// It could not be compared (the netns could not be opened, the kernel or the Service
    /// state could not be read): why.
    Unverifiable(String),
}

/// What was true at a pod's last full comparison that found it intact.
#[derive(Debug, Clone)]
struct Intact {
    record: Record,
    generation: u32,
    layer: Option<LayerHeader>,
    /// When the pod is compared in full again whatever its generation says.
    due: Instant,
}

/// How long a pod goes without a full comparison at most (each pod between half of it and all
/// of it, spread by its key so that pods found intact together are not compared again
/// together): the bound on the one window the generation leaves open (see `look`).
pub const FULL_AT_LEAST_EVERY: Duration = Duration::from_secs(6 * 3600);

/// The looks' memory, by record key.
#[derive(Debug, Default)]
pub struct Drift {
    intact: HashMap<String, Intact>,
    /// Every look compares in full (what a pass cost before; the bench's baseline).
    always_full: bool,
    full_every: Option<Duration>,
}

impl Drift {
    pub fn new() -> Self {
        Drift::default()
    }

    /// Every look compares in full (for comparison: `make bench`).
    pub fn always_full(mut self, yes: bool) -> Self {
        self.always_full = yes;
        self
    }

    /// A pod is compared in full at least this often ([`FULL_AT_LEAST_EVERY`] unless set).
    pub fn full_at_least_every(mut self, every: Duration) -> Self {
        self.full_every = Some(every);
        self
    }

    /// When a pod found intact now is due for a full comparison again.
    fn due(&self, key: &str) -> Instant {
        let every = self.full_every.unwrap_or(FULL_AT_LEAST_EVERY);
        // FNV-1a of the key: a stable spread over [every / 2, every).
        let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
        Instant::now() + every / 2 + every.mul_f64((hash % 1024) as f64 / 2048.0)
    }

    /// Forgets a pod's last full comparison (after a repair, or when its record goes).
    pub fn forget(&mut self, key: &str) {
        self.intact.remove(key);
    }

    /// Forgets every pod but those of `keys` (the records of this pass).
    pub fn retain<'a>(&mut self, keys: impl IntoIterator<Item = &'a str>) {
        let keep: std::collections::HashSet<&str> = keys.into_iter().collect();
        self.intact.retain(|k, _| keep.contains(k.as_str()));
    }

    /// Looks at `record`'s pod. `conf` names the record's network and the state directory;
    /// `layer` is [`services::stored_header`] as read at the start of this pass (an `Err`:
    /// compared in full). Run on a tour ([`aether_netns::tour_here`]), a look enters the
    /// pod's netns in place.
    pub fn look(
        &mut self,
        conf: &NetConf,
        record: &Record,
        layer: &Result<Option<LayerHeader>, ServicesError>,
    ) -> Look {
        let key = record.key();
        let ns = match record.open_netns() {
            Ok(PodNetns::Live(ns)) => ns,
            Ok(PodNetns::Gone(why)) => {
                self.forget(&key);
                // A path whose directory this process cannot see says nothing of the pod: an
                // installer without the runtime's netns directory mounted would otherwise
                // collect every live pod's record as a leftover.
                if let Some(dir) = std::path::Path::new(&record.netns).parent().filter(|d| !d.is_dir()) {
                    return Look::Unverifiable(format!(
                        "{why}; its directory {} is not visible to this process (the installer needs the \
                         runtime's netns directory mounted: the chart's hostPaths.netnsDir)",
                        dir.display()
                    ));
                }
                return Look::Gone(why);
            }
            Err(e) => return Look::Unverifiable(e.to_string()),
        };
        let cheap = match (&record.capture, record.netns_id.and_then(|id| id.cookie)) {
            (Some(cfg), Some(_)) if !self.always_full => Some(cfg),
            _ => None,
        };
        // The generation before anything is compared: a change committed during the
        // comparison shows at the next look.
        let unchanged = cheap.and_then(|cfg| {
            let prs = cfg.policy_routes();
            let (generation, routes) =
                ns.run(|| (aether_rules::nft::generation(), aether_rules::verify_policy_routes(&prs))).ok()?;
            let generation = generation.ok()?;
            let Some(i) = self.intact.get_mut(&key).filter(|i| i.record == *record && Instant::now() < i.due) else {
                return Some((generation, None));
            };
            let same = i.generation == generation && layer.as_ref().is_ok_and(|l| *l == i.layer);
            // Moved only by the applier's element changes since that comparison, and brought
            // to the stored layer by them: still intact (its capture untouched, its Service
            // layer changed exactly as the stored one did).
            let carried = !same
                && match (layer, services::applied_run(&conf.state_dir, &ns)) {
                    (Ok(Some((stored, _))), Some(run)) => {
                        run.layer_generation == *stored
                            && run.divert_mark == cfg.divert_mark
                            && run.first <= i.generation
                            && i.generation <= run.last
                            && run.last == generation
                    }
                    _ => false,
                };
            if carried {
                (i.generation, i.layer) = (generation, layer.as_ref().ok().cloned().flatten());
            }
            Some((generation, (same || carried).then_some(routes)))
        });
        match unchanged {
            Some((_, Some(Ok(routes)))) => {
                if !routes.is_empty() {
                    // Drift: the next look compares in full (a repair changes the netns anyway).
                    self.forget(&key);
                }
                Look::Seen { capture: routes, services: Vec::new(), compared: Compared::Unchanged }
            }
            Some((_, Some(Err(e)))) => Look::Unverifiable(e.to_string()),
            Some((generation, None)) => self.full(conf, record, &ns, Some(generation)),
            None => self.full(conf, record, &ns, None),
        }
    }

    fn full(&mut self, conf: &NetConf, record: &Record, ns: &Netns, generation: Option<u32>) -> Look {
        let key = record.key();
        self.forget(&key);
        let target = Target { network: &record.network, container_id: &record.container_id, ifname: &record.ifname };
        let capture = match attachment::verify(conf, target, ns, record.capture.as_ref()) {
            Ok(d) => d,
            Err(e) => return Look::Unverifiable(e.to_string()),
        };
        if !capture.is_empty() {
            // The capture first (a pod without it leaks): repaired this pass, without waiting for
            // a comparison of a Service layer of perhaps 10,000 Services; the layer is compared
            // at the next look (in full: nothing is remembered, and the repair commits).
            return Look::Seen { capture, services: Vec::new(), compared: Compared::Full };
        }
        let mark = record.capture.as_ref().map(|c| c.divert_mark);
        let (services, layer) = match services::verify_pod_layer(&conf.state_dir, ns, mark) {
            Ok(found) => found,
            Err(e) => return Look::Unverifiable(format!("the Service layer cannot be compared: {e}")),
        };
        if let Some(generation) = generation.filter(|_| capture.is_empty() && services.is_empty()) {
            let due = self.due(&key);
            self.intact.insert(key, Intact { record: record.clone(), generation, layer, due });
        }
        Look::Seen { capture, services, compared: Compared::Full }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::services::{apply_document, repair_pod_layer, ServicesDir};
    use crate::state::{PodIdentity, Recorded};
    use aether_rules::RulesetVersion;
    use aether_testkit::{root_or_skip, TestNetns};
    use serde_json::json;

    fn snapshot(generation: u64, port: u16) -> Vec<u8> {
        json!({
            "generation": generation, "mode": "refuse", "serviceRanges": ["10.96.0.0/16"],
            "services": [{"namespace": "n", "name": "s", "vip": "10.96.1.1",
                          "ports": [{"protocol": "TCP", "port": port}], "usableEndpoints": true}]
        })
        .to_string()
        .into_bytes()
    }

    /// The tests' network configuration, its state directory `state`.
    fn node_conf(state: &std::path::Path) -> NetConf {
        crate::config::parse(
            json!({"cniVersion": "1.0.0", "name": "net", "type": "aether-cni", "hostIP": "10.0.0.1",
                   "stateDir": state, "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "10.1.0.5/24"}]}})
            .to_string()
            .as_bytes(),
        )
        .unwrap()
    }

    /// A pod attached by ADD's code in a netns of its own, on a node whose state (a fresh
    /// directory named after `tag`) holds one Service: the state, the netns, the network
    /// configuration, the pod's capture and its record.
    fn attached(tag: &str) -> (std::path::PathBuf, TestNetns, NetConf, aether_rules::CaptureConfig, Record) {
        let state = std::env::temp_dir().join(format!("aether-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state);
        let ns = TestNetns::new(tag);
        let conf = node_conf(&state);
        let cfg = crate::config::effective(&conf, Some("shop")).unwrap().unwrap();
        apply_document(&ServicesDir::new(&state), &snapshot(1, 80)).unwrap();
        let target = Target { network: "net", container_id: "c1", ifname: "eth0" };
        attachment::attach(&conf, target, &PodIdentity::default(), &ns.path(), &cfg).unwrap();
        let record = crate::state::StateDir::new(&state).records().pop().unwrap();
        (state, ns, conf, cfg, record)
    }

    fn seen(look: &Look) -> (usize, usize, Compared) {
        match look {
            Look::Seen { capture, services, compared } => (capture.len(), services.len(), *compared),
            other => panic!("not compared: {other:?}"),
        }
    }

    /// Element changes sent by the long-lived applier or by a one-shot apply move the pod's
    /// generation, and the stored layer with them: the look carries the pod's intact state
    /// over them instead of comparing its tables again, as long as nothing else was committed
    /// in its netns and the pod got the stored layer. Anything else (another commit before or
    /// after a change, a tamper after the applier's change) is compared in full.
    #[test]
    fn a_look_carries_a_pod_intact_over_element_changes_and_nothing_else() {
        if !root_or_skip("a_look_carries_a_pod_intact_over_element_changes_and_nothing_else") {
            return;
        }
        let (state, ns, conf, _, record) = attached("drift-run");
        let mut applier = crate::services::Applier::new(&state);
        let mut drift = Drift::new();
        let look = |d: &mut Drift| d.look(&conf, &record, &services::stored_header(&state));
        let port = std::cell::Cell::new(80u16);
        // The next generation, one Service port more each (an element change in the pod).
        let doc = || {
            port.set(port.get() + 1);
            snapshot(u64::from(port.get()) - 79, port.get())
        };
        let next = |applier: &mut crate::services::Applier| {
            applier.apply(&doc()).unwrap();
        };

        next(&mut applier);
        assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Full), "first: in full");
        for round in 0..3 {
            next(&mut applier);
            assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Unchanged), "the applier's change {round}: carried");
        }
        // Two changes of the applier's between looks: carried too.
        next(&mut applier);
        next(&mut applier);
        assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Unchanged), "two changes: carried");

        // Another commit before the applier's change: in full.
        ns.exec("nft", &["add", "table", "ip", "someone_else"]);
        next(&mut applier);
        assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Full), "another commit before: in full");
        next(&mut applier);
        assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Unchanged), "and carried again after");

        // The one-shot apply's change: carried too (the one apply engine records the run
        // whichever way it reaches the pod), and the applier's after it.
        let once = |doc: Vec<u8>| apply_document(&ServicesDir::new(&state), &doc).unwrap();
        once(doc());
        assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Unchanged), "the one-shot apply: carried");
        once(doc());
        once(doc());
        assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Unchanged), "two one-shot applies: carried");
        next(&mut applier);
        assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Unchanged), "the applier's after them: carried");
        // Another commit before the one-shot apply's change: in full.
        ns.exec("nft", &["add", "table", "ip", "someone_else_again"]);
        once(doc());
        assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Full), "another commit before the one-shot's: in full");
        once(doc());
        assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Unchanged), "and carried again after");

        // A tamper right after the applier's change: in full, and found.
        next(&mut applier);
        ns.exec("nft", &["delete", "element", "ip", "aether_services", "service_vips", "{ 10.96.1.1 }"]);
        let found = look(&mut drift);
        let Look::Seen { services: ref diffs, compared, .. } = found else { panic!("{found:?}") };
        assert_eq!(compared, Compared::Full, "a tamper after the applier's change: in full");
        assert!(!diffs.is_empty(), "the tamper is found: {found:?}");
        drop(ns);
        let _ = std::fs::remove_dir_all(&state);
    }

    /// A record whose netns file is gone from a directory this process sees is gone; one
    /// whose netns directory it cannot see at all (an installer without the runtime's netns
    /// directory mounted) cannot be judged, and is never taken for gone.
    #[test]
    fn a_netns_is_gone_only_where_its_directory_is_visible() {
        let dir = std::env::temp_dir().join(format!("aether-drift-gone-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let conf = node_conf(&dir);
        let record = |netns: &std::path::Path| Record {
            network: "net".into(),
            ..Record::bare("c1", &netns.display().to_string())
        };
        let mut drift = Drift::new();
        let gone = drift.look(&conf, &record(&dir.join("cni-1234")), &Ok(None));
        assert!(matches!(gone, Look::Gone(_)), "a missing netns file in a visible directory: {gone:?}");
        let unseen = drift.look(&conf, &record(&dir.join("not-mounted/cni-1234")), &Ok(None));
        let Look::Unverifiable(why) = unseen else { panic!("a netns directory not visible here: {unseen:?}") };
        assert!(why.contains("not-mounted") && why.contains("hostPaths.netnsDir"), "{why}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A pod attached by ADD's code with the stored layer: compared in full once, then by its
    /// generation only while nothing is committed; every commit in its netns (a tamper of the
    /// layer, an unrelated table), a repair, and a new stored layer mean a full comparison
    /// again; the policy route is read back every time, generation or not.
    #[test]
    fn a_look_compares_in_full_only_when_the_netns_or_the_stored_layer_changed() {
        if !root_or_skip("a_look_compares_in_full_only_when_the_netns_or_the_stored_layer_changed") {
            return;
        }
        let (state, ns, conf, cfg, record) = attached("drift");
        assert!(record.netns_id.and_then(|i| i.cookie).is_some(), "the record has the netns cookie");
        let header = || services::stored_header(&state);
        let mut drift = Drift::new();
        let look = |d: &mut Drift| d.look(&conf, &record, &header());

        assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Full), "first: in full");
        assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Unchanged));
        assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Unchanged));

        // A deleted Service-layer element: a commit, so compared in full and found.
        ns.exec("nft", &["delete", "element", "ip", "aether_services", "service_ports", "{ 10.96.1.1 . tcp . 80 }"]);
        let found = look(&mut drift);
        let Look::Seen { services: ref diffs, .. } = found else { panic!("{found:?}") };
        assert!(diffs.iter().any(|d| d.starts_with("Service layer:") && d.contains("service_ports")), "{diffs:?}");
        assert_eq!(seen(&found), (0, diffs.len(), Compared::Full));
        assert_eq!(seen(&look(&mut drift)).1, diffs.len(), "drift is not remembered as intact");
        let netns = Netns::open_foreign(ns.path()).unwrap();
        assert_eq!(&repair_pod_layer(&state, &netns, Some(cfg.divert_mark)).unwrap(), diffs);
        assert!(repair_pod_layer(&state, &netns, Some(cfg.divert_mark)).unwrap().is_empty(), "nothing left");
        assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Full), "repaired: its commit moved the generation");
        assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Unchanged));

        // Any commit in the netns, even to another table: in full.
        ns.exec("nft", &["add", "table", "ip", "someone_else"]);
        assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Full));
        // The route is no nftables: read back while the generation stands still.
        ns.exec("ip", &["-4", "route", "flush", "table", &cfg.route_table.to_string()]);
        let (routes, _, how) = seen(&look(&mut drift));
        assert_eq!((routes, how), (1, Compared::Unchanged), "the flushed route is found without a full comparison");
        assert_eq!(seen(&look(&mut drift)), (1, 0, Compared::Full), "and then compared in full");
        netns.run(|| aether_rules::install(&aether_rules::capture_ruleset(&cfg).unwrap(), None)).unwrap().unwrap();
        assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Full));

        // The same content stored under a new generation: no pod is touched, but the stored
        // layer is another: in full, once.
        apply_document(&ServicesDir::new(&state), &snapshot(2, 80)).unwrap();
        assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Full));
        assert_eq!(seen(&look(&mut drift)), (0, 0, Compared::Unchanged));

        // A record without its netns cookie is a doubt: always in full.
        let mut old = record.clone();
        old.netns_id.as_mut().unwrap().cookie = None;
        for _ in 0..2 {
            assert_eq!(seen(&drift.look(&conf, &old, &header())), (0, 0, Compared::Full));
        }
        // A pod is compared in full again once its last full comparison is old enough.
        let mut soon = Drift::new().full_at_least_every(Duration::from_millis(200));
        assert_eq!(seen(&look(&mut soon)), (0, 0, Compared::Full));
        assert_eq!(seen(&look(&mut soon)), (0, 0, Compared::Unchanged));
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(seen(&look(&mut soon)), (0, 0, Compared::Full), "due again");
        assert_eq!(seen(&look(&mut soon)), (0, 0, Compared::Unchanged));

        // The baseline: always in full.
        let mut full = Drift::new().always_full(true);
        for _ in 0..2 {
            assert_eq!(seen(&look(&mut full)), (0, 0, Compared::Full));
        }
        drop(ns);
        let _ = std::fs::remove_dir_all(&state);
    }
    /// CHECK compares a pod with the ruleset its record says it holds: an earlier release's
    /// pod (its record without `ruleset`) holding exactly that release's ruleset is intact,
    /// and the same pod under a record naming the current ruleset is not (the two rules it
    /// lacks); a ruleset of a later release is said to be one, never "missing or changed".
    #[test]
    fn a_pod_is_compared_with_the_ruleset_its_record_names() {
        if !root_or_skip("a_pod_is_compared_with_the_ruleset_its_record_names") {
            return;
        }
        let (state, ns, conf, cfg, record) = attached("drift-ruleset");
        let netns = aether_netns::Netns::open_foreign(&ns.path()).unwrap();
        let first = aether_rules::capture_ruleset_of(&cfg, aether_rules::RulesetVersion::FIRST).unwrap();
        netns.run(|| aether_rules::install(&first, None)).unwrap().unwrap();
        let dir = crate::state::StateDir::new(&state);
        let target = Target { network: "net", container_id: "c1", ifname: "eth0" };
        let check = || attachment::verify(&conf, target, &netns, Some(&cfg)).unwrap();

        // As the earlier release wrote it: no ruleset named.
        dir.write(&Record { ruleset: None, ..record.clone() }).unwrap();
        assert_eq!(check(), Vec::<String>::new(), "the earlier release's pod holds its ruleset: intact");
        let mut drift = Drift::new();
        let found = drift.look(&conf, &dir.records()[0], &services::stored_header(&state));
        assert_eq!(seen(&found), (0, 0, Compared::Full), "{found:?}");

        // Negative control: the same pod under a record naming the current ruleset.
        dir.write(&record).unwrap();
        let diffs = check();
        assert_eq!(diffs.len(), 2, "{diffs:?}");
        assert!(diffs.iter().all(|d| d.contains("is missing or changed") && d.contains("0xae7c")), "{diffs:?}");

        // A later release's ruleset: named, not compared.
        let later = aether_rules::RulesetVersion::CURRENT.number() + 1;
        dir.write(&Record { ruleset: Some(later), ..record.clone() }).unwrap();
        let diffs = check();
        assert!(
            diffs[0].contains(&format!("capture ruleset {later}")) && diffs[0].contains("a later release"),
            "{diffs:?}"
        );
        assert!(!diffs.iter().any(|d| d.contains("missing or changed")), "{diffs:?}");

        // The current ruleset under a record that names it (ADD's): intact.
        netns.run(|| aether_rules::install(&aether_rules::capture_ruleset(&cfg).unwrap(), None)).unwrap().unwrap();
        dir.write(&record.migrated()).unwrap();
        assert_eq!(check(), Vec::<String>::new());

        // A record that names no ruleset over a pod that holds the current one (a build from
        // before records named it, the same record format): intact, the kernel telling which.
        let unstated = Record { ruleset: None, ..record.clone() };
        dir.write(&unstated).unwrap();
        assert_eq!(check(), Vec::<String>::new(), "the current ruleset under a record naming none: intact");
        assert_eq!(attachment::held_ruleset(&unstated, &netns).unwrap(), Recorded::Known(RulesetVersion::CURRENT));
        let from = crate::repair::migrating_from(&unstated);
        assert!(
            from.starts_with("capture ruleset 2 (") && from.ends_with("under a record that names no ruleset"),
            "{from}"
        );
        // Its migration only writes the record: the tables are not programmed again.
        let before = netns.run(aether_rules::nft::generation).unwrap().unwrap();
        crate::repair::migrate(&state, &unstated).unwrap();
        assert_eq!(netns.run(aether_rules::nft::generation).unwrap().unwrap(), before, "nothing committed");
        let now = &dir.records()[0];
        assert_eq!((now.ruleset, now.migrated_from), (Some(RulesetVersion::CURRENT.number()), None));
        // Control: holding neither shape, it is compared with the
        // first and found drifted (a chain of both removed).
        dir.write(&unstated).unwrap();
        let mut broken = aether_rules::capture_ruleset(&cfg).unwrap();
        broken.halves[0].table.chains.pop();
        netns.run(|| aether_rules::install(&broken, None)).unwrap().unwrap();
        assert_eq!(attachment::held_ruleset(&unstated, &netns).unwrap(), Recorded::Known(RulesetVersion::FIRST));
        assert!(crate::repair::migrating_from(&unstated).starts_with("capture ruleset 1 ("), "what the record names");
        assert!(!check().is_empty(), "a pod holding neither shape is not intact");
        drop(ns);
        let _ = std::fs::remove_dir_all(&state);
    }
}
