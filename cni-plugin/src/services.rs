//! `aether-cni services`: the agent's interface to the Service-range and refusal-counter
//! layer (DESIGN.md), and the hooks ADD and DEL call.
//!
//! State, under `<stateDir>/services/`:
//! - `snapshot.json`: the last accepted snapshot, exactly as the agent sent it (atomic write);
//! - `layer.bin`: the same snapshot as the layer needs it, compact and checksummed
//!   (`layer_file`), written after `snapshot.json`: what ADD loads (never the JSON), and the
//!   generation the next apply computes its element change from;
//! - `pods/<netns>`: the generation (and layer digest) each pod netns holds, so an apply sends
//!   a pod that holds the previous generation only the change, without reading its sets back,
//!   and rebuilds any other (a missed generation, a crash, a new pod);
//! - `accumulator.json`: the final counts of pods DEL has folded in (node totals never go
//!   backwards when pods go);
//! - `divert-mark`: capture's divert mark, recorded by ADD (default 0xae71);
//! - `lock`: `services apply` holds it exclusively while it stores the snapshot and applies
//!   it to every recorded pod; ADD holds it shared while it applies the stored snapshot to
//!   its pod. ADD must call `apply_current_snapshot_in_netns` after its attachment record is
//!   written: then either the apply sees the record, or ADD reads the apply's snapshot, so no
//!   pod misses a generation (a lock, not a generation check). DEL and GC hold it exclusively
//!   while they fold a pod's counts, remove its layer and forget its record
//!   (`retire_layer`), so no apply re-creates the layer of a pod being deleted.

pub mod layer_file;
pub mod snapshot;

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use aether_netns::Netns;
use aether_rules::services::{self as layer, Applied, LayerChange, COUNTERS};
use serde_json::{json, Value};

use crate::error::{code, CniError};
use crate::state::{self, PodNetns, Record, StateDir};
use layer_file::StoredLayer;

#[derive(clap::Args)]
pub struct ServicesArgs {
    /// The node state directory (the `stateDir` of the network configuration).
    #[arg(long, global = true, default_value = crate::config::DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
    #[command(subcommand)]
    command: ServicesCommand,
}

#[derive(clap::Subcommand)]
enum ServicesCommand {
    /// Read a snapshot (JSON, see testdata/services/snapshot.schema.json) from -f FILE or
    /// stdin, validate it, store it and apply it to every managed pod.
    Apply {
        /// The snapshot file; `-` is stdin. Without -f, stdin is read unless it is a terminal.
        #[arg(short = 'f', long = "file", value_name = "FILE")]
        file: Option<PathBuf>,
    },
    /// Print node totals and per-pod counters.
    Counters {
        #[arg(long, value_enum, default_value = "json")]
        format: Format,
    },
    /// Print the node's demand: the union of the VIP:port pairs pods dialled.
    Demand {
        #[arg(long, value_enum, default_value = "json")]
        format: DemandFormat,
    },
    /// Read every pod's layer back, compare it with the stored snapshot and repair what
    /// differs (applies send changes without reading back; this is the check).
    Verify,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Format {
    Json,
    Prometheus,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum DemandFormat {
    Json,
    Text,
}

/// The snapshot `apply` reads: `-f FILE`, `-f -` or stdin. An operator who types
/// `services apply` at a terminal is told how to pass one, not left waiting.
fn read_snapshot(file: Option<&Path>) -> Result<Vec<u8>, String> {
    let limit = snapshot::MAX_SNAPSHOT_BYTES as u64 + 1;
    let mut text = Vec::new();
    match file {
        Some(path) if path != Path::new("-") => fs::File::open(path)
            .and_then(|f| f.take(limit).read_to_end(&mut text))
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?,
        // SAFETY: isatty only inspects the descriptor.
        None if unsafe { libc::isatty(0) } == 1 => {
            return Err("reads the snapshot from -f FILE, or from stdin (-f -, or a pipe); stdin is a terminal, so \
                        nothing was read: e.g. `aether-cni services apply -f snapshot.json`"
                .into())
        }
        _ => std::io::stdin().take(limit).read_to_end(&mut text).map_err(|e| format!("cannot read stdin: {e}"))?,
    };
    Ok(text)
}

/// A command's result on stdout, ending in one newline; an empty result prints nothing.
fn print_result(text: &str) {
    if !text.is_empty() {
        println!("{}", text.strip_suffix('\n').unwrap_or(text));
    }
}

pub fn run(args: ServicesArgs) -> ExitCode {
    if let Some(why) = state::unusable_reason(&args.state_dir) {
        eprintln!("aether-cni services: state directory {} {why}", args.state_dir.display());
        return ExitCode::FAILURE;
    }
    let dir = ServicesDir::new(&args.state_dir);
    let out = match args.command {
        ServicesCommand::Apply { file } => {
            let text = match read_snapshot(file.as_deref()) {
                Ok(text) => text,
                Err(e) => {
                    eprintln!("aether-cni services apply: {e}");
                    return ExitCode::from(2);
                }
            };
            match apply_document(&dir, &text) {
                Ok(report) => {
                    println!("{}", serde_json::to_string_pretty(&report.to_json()).unwrap());
                    return if report.failed() { ExitCode::FAILURE } else { ExitCode::SUCCESS };
                }
                Err(errs) => {
                    for e in &errs {
                        eprintln!("aether-cni services apply: {e}");
                    }
                    return ExitCode::from(2);
                }
            }
        }
        ServicesCommand::Counters { format } => node_counters(&dir).map(|c| match format {
            Format::Json => serde_json::to_string_pretty(&c.to_json()).unwrap(),
            Format::Prometheus => c.to_prometheus(),
        }),
        ServicesCommand::Demand { format } => node_demand(&dir).map(|d| match format {
            DemandFormat::Json => serde_json::to_string_pretty(&json!({ "demand": d })).unwrap(),
            DemandFormat::Text => d.join("\n"),
        }),
        ServicesCommand::Verify => match verify_pods(&dir) {
            Ok(report) => {
                println!("{}", serde_json::to_string_pretty(&report.to_json()).unwrap());
                return if report.failed() { ExitCode::FAILURE } else { ExitCode::SUCCESS };
            }
            Err(e) => Err(e),
        },
    };
    match out {
        Ok(text) => {
            print_result(&text);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("aether-cni services: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The services part of the state directory.
pub struct ServicesDir {
    state: PathBuf,
    root: PathBuf,
    /// `pods/`, opened (created) on first need and kept: an apply writes a file in it per pod.
    pods: std::sync::OnceLock<state::Dir>,
}

impl ServicesDir {
    pub fn new(state_dir: &Path) -> Self {
        ServicesDir { state: state_dir.to_path_buf(), root: state_dir.join("services"), pods: Default::default() }
    }

    /// The directory, created (0700) if `create`; `None` when absent and not created.
    fn open(&self, create: bool) -> Result<Option<state::Dir>, String> {
        let Some(root) = state::Dir::open(&self.state, create)
            .map_err(|e| format!("cannot open state directory {}: {e}", self.state.display()))?
        else {
            return Ok(None);
        };
        root.subdir("services", create).map_err(|e| format!("cannot open {}: {e}", self.root.display()))
    }

    fn lock(&self, exclusive: bool) -> Result<state::Lock, String> {
        let dir = self.open(true)?.expect("created");
        dir.lock("lock", exclusive, None).map_err(|e| format!("cannot lock {}: {e}", self.root.join("lock").display()))
    }

    /// For readers (`counters`, `demand`): the shared lock if the directory exists, and
    /// nothing created when it does not (no snapshot was ever applied).
    fn read_lock(&self) -> Result<Option<state::Lock>, String> {
        match self.open(false)? {
            None => Ok(None),
            Some(dir) => dir
                .lock_existing_shared("lock")
                .map_err(|e| format!("cannot lock {}: {e}", self.root.join("lock").display())),
        }
    }

    fn write_atomic(&self, name: &str, body: &[u8]) -> Result<(), String> {
        let dir = self.open(true)?.expect("created");
        dir.write_atomic(name, body).map_err(|e| format!("cannot write {}: {e}", self.root.join(name).display()))
    }

    /// A file of the directory, capped in size; `None` if absent.
    fn read(&self, name: &str) -> Result<Option<Vec<u8>>, String> {
        let path = self.root.join(name);
        state::read_capped(&path, state::MAX_STATE_FILE_BYTES)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))
    }

    fn layer_path(&self) -> PathBuf {
        self.root.join("layer.bin")
    }

    /// The accepted snapshot's layer, from `layer.bin`. A damaged file is reported, never
    /// silently ignored. State from before `layer.bin` existed (an upgrade) has only
    /// `snapshot.json`: it is parsed instead, within the snapshot limits, until the next
    /// apply writes `layer.bin`.
    pub fn stored_layer(&self) -> Result<Option<StoredLayer>, String> {
        if let Some(l) = layer_file::read(&self.layer_path()).map_err(|e| e.to_string())? {
            return Ok(Some(l));
        }
        let path = self.root.join("snapshot.json");
        let mut text = Vec::new();
        match fs::File::open(&path) {
            Ok(f) => f
                .take(snapshot::MAX_SNAPSHOT_BYTES as u64 + 1)
                .read_to_end(&mut text)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        snapshot::parse(&text)
            // No source digest: the next apply, whatever it sends, writes `layer.bin`.
            .map(|s| Some(StoredLayer::new(s.generation, &s.layer(0), 0)))
            .map_err(|errs| format!("stored snapshot {} is invalid: {}", path.display(), errs.join("; ")))
    }

    /// The generation of `text` when `text` is the stored `snapshot.json` byte for byte but
    /// for the value of its top-level `generation`, and that file is the one `layer.bin`
    /// (`stored`: its generation and source digest, from its header) was made from: the same
    /// content, already checked and in force, under a new generation. With the source digest,
    /// for the caller to check under the lock. `None` whenever that is not certain: the
    /// document is then read and checked in full. Costs a skim of the document (the
    /// generation found, the rest skipped) and a comparison, about a fifth of a full reading.
    fn stored_with_new_generation(&self, text: &[u8], stored: (u64, u64)) -> Option<(u64, u64)> {
        let (stored_generation, stored_source) = stored;
        // A generation is at most 20 digits: documents further apart in size differ in more.
        let path = self.root.join("snapshot.json");
        if fs::metadata(&path).ok()?.len().abs_diff(text.len() as u64) > 20 {
            return None;
        }
        let stored = self.read("snapshot.json").ok()??;
        if layer_file::source_digest(&stored) != stored_source {
            return None;
        }
        let (span, generation) = generation_value(text)?;
        // The same bytes up to the generation put the stored document's parser at its own
        // top-level generation value there too; the stored value is canonical digits (a
        // stored document was read as a u64), and everything after it must be the same.
        let stored_value = stored_generation.to_string();
        let stored_end = span.start + stored_value.len();
        let same = text[..span.start] == stored[..span.start.min(stored.len())]
            && stored.get(span.start..stored_end) == Some(stored_value.as_bytes())
            && text[span.end..] == stored[stored_end..];
        same.then_some((generation, stored_source))
    }

    /// The file that says which layer the pod netns at `netns` holds.
    fn pod_path(&self, netns: &Path) -> PathBuf {
        let name: String = netns
            .to_string_lossy()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c } else { '_' })
            .collect();
        self.root.join("pods").join(name)
    }

    /// What the pod netns `ns` holds, if its file is there, readable, and about this very
    /// netns (a path reused by another netns does not count).
    fn pod_holds(&self, ns: &Netns) -> Option<PodHolds> {
        let text = fs::read_to_string(self.pod_path(ns.path())).ok()?;
        let held = PodHolds::parse(&text)?;
        (held.netns == netns_key(ns)).then_some(held)
    }

    /// Records what `ns` holds now. Losing this file costs a rebuild, never a wrong layer.
    fn set_pod_holds(&self, ns: &Netns, held: &PodHolds) -> Result<(), String> {
        let path = self.pod_path(ns.path());
        let pods = match self.pods.get() {
            Some(pods) => pods,
            None => {
                let dir = self.open(true)?.expect("created");
                let pods =
                    dir.subdir("pods", true).map_err(|e| format!("cannot create {}: {e}", self.root.display()))?;
                self.pods.get_or_init(|| pods.expect("created"))
            }
        };
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        pods.write_atomic(&name, held.to_string().as_bytes())
            .map_err(|e| format!("cannot write {}: {e}", path.display()))
    }

    fn forget_pod(&self, netns: &Path) {
        let _ = fs::remove_file(self.pod_path(netns));
    }

    /// Removes the files of pods no record names any more (their DEL found no netns).
    fn prune_pods(&self, records: &[crate::state::Record]) {
        let Ok(dir) = fs::read_dir(self.root.join("pods")) else { return };
        let live: std::collections::BTreeSet<PathBuf> =
            records.iter().map(|r| self.pod_path(Path::new(&r.netns))).collect();
        for e in dir.filter_map(Result::ok) {
            if !live.contains(&e.path()) {
                let _ = fs::remove_file(e.path());
            }
        }
    }

    fn divert_mark(&self) -> u32 {
        self.read("divert-mark")
            .ok()
            .flatten()
            .and_then(|s| u32::from_str_radix(String::from_utf8_lossy(&s).trim().trim_start_matches("0x"), 16).ok())
            .unwrap_or(aether_rules::capture::DIVERT_MARK)
    }

    /// The folded counts of removed layers. Missing means none yet; unreadable is an error,
    /// never "zero": overwriting it would make the node totals go backwards for good.
    fn accumulator(&self) -> Result<Accumulator, String> {
        let path = self.root.join("accumulator.json");
        match self.read("accumulator.json")? {
            Some(d) => Accumulator::parse(&d).map_err(|e| format!("{} is unreadable: {e}", path.display())),
            None => Ok(Accumulator::default()),
        }
    }

    fn store(&self, acc: &Accumulator) -> Result<(), String> {
        self.write_atomic("accumulator.json", &serde_json::to_vec_pretty(acc).expect("counts serialize"))
    }

    /// Folds each pod's current `counts` into the node totals, idempotently: only what grew
    /// since the pod's last fold is added, and the pod stays marked as folding (so readers
    /// subtract what is already in the totals) until [`ServicesDir::end_folding`]. A process
    /// killed after this and before the layer is removed therefore loses and doubles nothing;
    /// run again, it adds only the growth. Returns what was added, per pod.
    fn fold_pods(&self, pods: &[(String, BTreeMap<String, u64>)]) -> Result<Vec<BTreeMap<String, u64>>, String> {
        let mut acc = self.accumulator()?;
        let mut added = Vec::new();
        for (key, counts) in pods {
            let before = acc.folding.get(key).cloned().unwrap_or_default();
            let mut delta = BTreeMap::new();
            for (k, v) in counts {
                let d = v.saturating_sub(before.get(k).copied().unwrap_or(0));
                *acc.totals.entry(k.clone()).or_default() += d;
                delta.insert(k.clone(), d);
            }
            acc.folding.insert(key.clone(), counts.clone());
            added.push(delta);
        }
        self.store(&acc)?;
        Ok(added)
    }

    /// Ends the folding of pods whose layers are gone.
    fn end_folding(&self, keys: &[String]) -> Result<(), String> {
        let mut acc = self.accumulator()?;
        let before = acc.folding.len();
        for k in keys {
            acc.folding.remove(k);
        }
        if acc.folding.len() != before {
            self.store(&acc)?;
        }
        Ok(())
    }
}

/// `accumulator.json`: the node totals of layers that are gone, and the pods being retired.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Accumulator {
    totals: BTreeMap<String, u64>,
    /// Per attachment key: the counts already in `totals` while its layer is being removed.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    folding: BTreeMap<String, BTreeMap<String, u64>>,
}

impl Accumulator {
    /// Reads this format, or the flat `{counter: n}` map of earlier releases.
    fn parse(d: &[u8]) -> Result<Self, serde_json::Error> {
        let v: Value = serde_json::from_slice(d)?;
        if v.get("totals").is_some() {
            serde_json::from_value(v)
        } else {
            Ok(Accumulator { totals: serde_json::from_value(v)?, folding: BTreeMap::new() })
        }
    }

    /// What a live pod adds to the node totals: its counts less what is already folded.
    fn live_part(&self, key: &str, counts: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
        let folded = self.folding.get(key);
        counts
            .iter()
            .map(|(k, v)| (k.clone(), v.saturating_sub(folded.and_then(|f| f.get(k)).copied().unwrap_or(0))))
            .collect()
    }
}

/// The layer a pod netns holds: `generation digest netns-id divert-mark`, one line.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PodHolds {
    generation: u64,
    digest: u64,
    /// `Netns::id()` of the netns it was written for.
    netns: String,
    divert_mark: u32,
}

impl PodHolds {
    fn new(stored: &StoredLayer, ns: &Netns, divert_mark: u32) -> Self {
        PodHolds { generation: stored.generation, digest: stored.digest, netns: netns_key(ns), divert_mark }
    }

    fn parse(text: &str) -> Option<Self> {
        let mut f = text.split_whitespace();
        let held = PodHolds {
            generation: f.next()?.parse().ok()?,
            digest: u64::from_str_radix(f.next()?, 16).ok()?,
            netns: f.next()?.to_string(),
            divert_mark: u32::from_str_radix(f.next()?.trim_start_matches("0x"), 16).ok()?,
        };
        f.next().is_none().then_some(held)
    }

    /// Whether the pod holds `stored`'s layer for `divert_mark` (whatever the generation).
    fn is(&self, stored: &StoredLayer, divert_mark: u32) -> bool {
        self.digest == stored.digest && self.divert_mark == divert_mark
    }
}

/// A netns's identity as one word: `device:inode`.
fn netns_key(ns: &Netns) -> String {
    format!("{}:{}", ns.id().dev, ns.id().ino)
}

impl std::fmt::Display for PodHolds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{} {:016x} {} {:#x}", self.generation, self.digest, self.netns, self.divert_mark)
    }
}

/// One pod's outcome in an apply.
#[derive(Debug)]
pub struct PodOutcome {
    pub container_id: String,
    pub ifname: String,
    pub netns: String,
    pub result: Result<Applied, String>,
    /// The netns is gone: the pod was skipped, which is not a failure.
    pub vanished: bool,
}

#[derive(Debug)]
pub struct ApplyReport {
    pub generation: u64,
    pub pods: Vec<PodOutcome>,
    /// What was wrong but did not stop the apply (e.g. a stored snapshot that no longer
    /// parses, replaced by this one).
    pub warnings: Vec<String>,
}

impl ApplyReport {
    pub fn failed(&self) -> bool {
        self.pods.iter().any(|p| p.result.is_err() && !p.vanished)
    }

    pub fn to_json(&self) -> Value {
        let pods: Vec<Value> = self
            .pods
            .iter()
            .map(|p| {
                let mut v = json!({"containerID": p.container_id, "ifname": p.ifname, "netns": p.netns});
                match &p.result {
                    Ok(a) => v["result"] = json!(describe(a)),
                    Err(e) if p.vanished => {
                        v["result"] = json!("skipped");
                        v["reason"] = json!(e);
                    }
                    Err(e) => {
                        v["result"] = json!("failed");
                        v["error"] = json!(e);
                    }
                }
                v
            })
            .collect();
        let mut v = json!({"generation": self.generation, "pods": pods});
        if !self.warnings.is_empty() {
            v["warnings"] = json!(self.warnings);
        }
        v
    }
}

fn describe(a: &Applied) -> String {
    match a {
        Applied::Rebuilt => "rebuilt".into(),
        Applied::Elements { added, removed } => format!("elements +{added} -{removed}"),
        Applied::Unchanged => "unchanged".into(),
        Applied::Removed(true) => "removed".into(),
        Applied::Removed(false) => "off".into(),
    }
}

/// `services apply`: validate the whole document, refuse an older generation, store it
/// (`snapshot.json`, then `layer.bin`), apply it to every recorded pod. Validation errors
/// change nothing.
///
/// The element change from the previous stored generation is computed once; a pod whose
/// file says it holds that generation gets only the change, sent without reading its sets
/// back; a pod that already holds this content is not touched; any other pod (new, behind by
/// more than one generation, or whose change the kernel refused) is rebuilt.
pub fn apply_document(dir: &ServicesDir, text: &[u8]) -> Result<ApplyReport, Vec<String>> {
    // The very document already stored (the agent sending it again) is not parsed again:
    // `layer.bin` records which document it was made from. Nor is the stored document with
    // only its generation changed (an agent resyncing without news).
    let source = layer_file::source_digest(text);
    let made_from_it = |stored: Option<StoredLayer>| stored.filter(|s| s.source == source);
    let stored_header = layer_file::read_header(&dir.layer_path()).ok().flatten();
    let stored_source = stored_header.map(|(_, source)| source);
    let regenerated = match stored_header {
        Some(header @ (_, stored_source)) if stored_source != source => dir.stored_with_new_generation(text, header),
        _ => None,
    };
    let mut parsed =
        if stored_source == Some(source) || regenerated.is_some() { None } else { Some(snapshot::parse(text)?) };
    let _lock = dir.lock(true).map_err(|e| vec![e])?;
    let mut warnings = Vec::new();
    // A stored layer that no longer reads (a damaged file, another format) must not lock the
    // agent out: the new, valid one replaces it.
    let previous = dir.stored_layer().unwrap_or_else(|e| {
        warnings.push(format!("{e}; replaced by this snapshot"));
        None
    });
    // The stored content under a new generation: still what `layer.bin` holds (an apply
    // may have stored another document since the look above, without the lock).
    let renamed = regenerated.and_then(|(generation, from)| {
        let prev = previous.as_ref().filter(|p| p.source == from)?;
        Some(StoredLayer { generation, source, ..prev.clone() })
    });
    let new = match made_from_it(previous.clone()).or(renamed) {
        Some(same) => same,
        None => {
            let snap = match parsed.take() {
                Some(s) => s,
                // Stored by a racing apply and replaced since the look above.
                None => snapshot::parse(text)?,
            };
            StoredLayer::new(snap.generation, &snap.layer(0), source)
        }
    };
    if let Some(old) = &previous {
        if new.generation < old.generation {
            return Err(vec![format!(
                "generation: {} is older than the stored generation {}; nothing changed",
                new.generation, old.generation
            )]);
        }
        if new.generation == old.generation && old.digest != new.digest {
            return Err(vec![format!(
                "generation: {} is already stored with different content; a new snapshot needs a new generation",
                new.generation
            )]);
        }
    }
    if previous.as_ref().is_none_or(|old| old.source != source) {
        dir.write_atomic("snapshot.json", text).map_err(|e| vec![e])?;
        dir.write_atomic("layer.bin", &new.encode()).map_err(|e| vec![e])?;
    }
    aether_netns::tour(|| apply_to_pods(dir, &new, previous.as_ref(), warnings))
        .map_err(|e| vec![format!("cannot visit the pods' network namespaces: {e}")])?
}

/// `apply_document` once `new` is stored: the layer to every recorded pod, each given the
/// change from `previous` if its file says it holds that, nothing if it holds `new`, a
/// rebuild otherwise. Runs on a tour (`aether_netns::tour`: one thread entering each pod's
/// netns in turn), as a thread per pod cost more than the change it sends.
fn apply_to_pods(
    dir: &ServicesDir,
    new: &StoredLayer,
    previous: Option<&StoredLayer>,
    mut warnings: Vec<String>,
) -> Result<ApplyReport, Vec<String>> {
    let node_mark = dir.divert_mark();
    let scan = StateDir::new(&dir.state).scan();
    for u in &scan.unreadable {
        warnings.push(format!("attachment record {} cannot be read, its pod is not reached: {}", u.file, u.why));
    }
    let records = scan.records;
    // A pod still marked as folding whose layer is gone (a DEL or apply killed after removing
    // it): the mark ends before a new layer starts counting from zero.
    let folding = match dir.accumulator() {
        Ok(acc) => acc.folding,
        Err(e) => {
            warnings
                .push(format!("the node's Service totals cannot be read, stale fold marks are left as they are: {e}"));
            Default::default()
        }
    };
    let ended: Vec<String> = records
        .iter()
        .filter(|r| folding.contains_key(&r.key()))
        .filter(|r| open_pod(r).is_ok_and(|ns| matches!(ns.run(layer::counters), Ok(Ok(None)))))
        .map(Record::key)
        .collect();
    if !ended.is_empty() {
        dir.end_folding(&ended).map_err(|e| vec![e])?;
    }
    // Mode `off` removes each pod's table: its counts join the node totals first (as at
    // DEL), idempotently, so they never go backwards, also when this apply is killed.
    let off = new.layer.mode == layer::LayerMode::Off;
    let mut folded_keys = Vec::new();
    if off {
        let counts: Vec<(String, BTreeMap<String, u64>)> = records
            .iter()
            .filter_map(|r| Some((r.key(), flat(open_pod(r).ok()?.run(layer::counters)).ok()??)))
            .collect();
        dir.fold_pods(&counts).map_err(|e| vec![e])?;
        folded_keys = counts.into_iter().map(|(k, _)| k).collect();
    }
    // Each pod's layer matches the divert mark its own capture sets.
    let mark_of = |r: &Record| r.capture.as_ref().map_or(node_mark, |c| c.divert_mark);
    let mut marks: BTreeMap<u32, ForMark> = BTreeMap::new();
    for r in &records {
        marks.entry(mark_of(r)).or_insert_with(|| ForMark::new(new, mark_of(r)));
    }
    let pass = Pass { dir, new, previous, marks: &marks };
    let mut out = Visited::default();
    let pods = records.iter().map(|r| pass.visit(r, mark_of(r), &mut out)).collect();
    let Visited { warnings: more, mut removed_keys } = out;
    warnings.extend(more);
    dir.prune_pods(&records);
    if off {
        removed_keys.retain(|k| folded_keys.contains(k));
        dir.end_folding(&removed_keys).map_err(|e| vec![e])?;
    }
    Ok(ApplyReport { generation: new.generation, pods, warnings })
}

/// A record's netns, if it is still the pod's (a path reused by another namespace, a file
/// or a directory is not: the pod is skipped as gone, `true`).
fn open_pod(r: &Record) -> Result<Netns, (String, bool)> {
    match r.open_netns() {
        Ok(PodNetns::Live(ns)) => Ok(ns),
        Ok(PodNetns::Gone(why)) => Err((why, true)),
        Err(e) => Err((e.to_string(), false)),
    }
}

/// What an apply makes once per divert mark in use (in practice one): the layer, and, on
/// first need, the change from the previous generation and the encoded layer.
struct ForMark {
    layer: layer::ServiceLayer,
    change: std::sync::OnceLock<Option<LayerChange>>,
    prepared: std::sync::OnceLock<Option<layer::Prepared>>,
}

impl ForMark {
    fn new(stored: &StoredLayer, mark: u32) -> Self {
        ForMark { layer: stored.for_pod(mark), change: Default::default(), prepared: Default::default() }
    }
}

/// One apply's walk over the pods.
struct Pass<'a> {
    dir: &'a ServicesDir,
    new: &'a StoredLayer,
    previous: Option<&'a StoredLayer>,
    marks: &'a BTreeMap<u32, ForMark>,
}

/// What the pods' visits gathered besides their outcomes: warnings, and the attachments
/// whose layer mode `off` removed.
#[derive(Default)]
struct Visited {
    warnings: Vec<String>,
    removed_keys: Vec<String>,
}

impl Pass<'_> {
    /// Brings one pod to the new layer: nothing if its file says it holds it, the change if
    /// it holds the previous one, a rebuild otherwise.
    fn visit(&self, r: &Record, mark: u32, out: &mut Visited) -> PodOutcome {
        let (dir, new) = (self.dir, self.new);
        let m = &self.marks[&mark];
        let l = &m.layer;
        let (result, vanished) = match open_pod(r) {
            Err((why, vanished)) => (Err(why), vanished),
            Ok(ns) if l.mode == layer::LayerMode::Off => {
                dir.forget_pod(ns.path());
                let outcome = flat(ns.run(|| layer::apply(l)));
                if matches!(outcome, Ok(Applied::Removed(_))) {
                    out.removed_keys.push(r.key());
                }
                (outcome, false)
            }
            Ok(ns) => {
                let held = dir.pod_holds(&ns);
                let change = match (&held, self.previous) {
                    (Some(h), _) if h.is(new, mark) => None,
                    (Some(h), Some(prev)) if h.is(prev, mark) => Some(
                        m.change.get_or_init(|| LayerChange::between(&prev.for_pod(mark), l).ok().flatten()).as_ref(),
                    ),
                    _ => Some(None),
                };
                let outcome = match change {
                    None => Ok(Applied::Unchanged),
                    // Refused (the pod's layer is not what its file says): rebuilt.
                    Some(Some(c)) => flat(ns.run(|| c.send().or_else(|_| layer::rebuild(l)))),
                    Some(None) => match m.prepared.get_or_init(|| layer::Prepared::new(l).ok().flatten()) {
                        Some(p) => flat(ns.run(|| p.rebuild())),
                        None => flat(ns.run(|| layer::rebuild(l))),
                    },
                };
                if outcome.is_ok() && held.is_none_or(|h| !h.is(new, mark)) {
                    if let Err(e) = dir.set_pod_holds(&ns, &PodHolds::new(new, &ns, mark)) {
                        out.warnings.push(e);
                    }
                }
                if outcome.is_err() {
                    dir.forget_pod(ns.path());
                }
                (outcome, false)
            }
        };
        PodOutcome {
            container_id: r.container_id.clone(),
            ifname: r.ifname.clone(),
            netns: r.netns.clone(),
            result,
            vanished,
        }
    }
}

/// For ADD, in the host netns, after the attachment record is written: applies the stored
/// layer (if any) to the pod netns `netns`, under the shared services lock, and records
/// capture's divert mark for later applies. Loads `layer.bin`, never the JSON snapshot, and
/// reads nothing back from the kernel. Returns the generation applied, `None` when the agent
/// has sent no snapshot yet (the pod then has no layer until the first apply).
pub fn apply_current_snapshot_in_netns(
    state_dir: &Path,
    netns: &Netns,
    divert_mark: u32,
) -> Result<Option<u64>, CniError> {
    let dir = ServicesDir::new(state_dir);
    let fail = |what: String| CniError::new(code::IO_FAILURE, "cannot apply the Service layer").with_details(what);
    let _lock = dir.lock(false).map_err(fail)?;
    if dir.divert_mark() != divert_mark {
        dir.write_atomic("divert-mark", format!("{divert_mark:#x}\n").as_bytes()).map_err(fail)?;
    }
    // A stored layer that cannot be read must not keep pods from starting: the pod starts
    // without the layer (fail open, as before any snapshot), and the agent's next apply, which
    // replaces the damaged file, reaches it through its record.
    let stored = match dir.stored_layer() {
        Ok(Some(stored)) => stored,
        Ok(None) => return Ok(None),
        Err(e) => {
            crate::warn!("the pod starts without the Service layer: {e}");
            return Ok(None);
        }
    };
    let l = stored.for_pod(divert_mark);
    netns.run(|| layer::rebuild(&l)).map_err(|e| fail(e.to_string()))?.map_err(|e| fail(e.to_string()))?;
    if let Err(e) = dir.set_pod_holds(netns, &PodHolds::new(&stored, netns, divert_mark)) {
        // Costs the pod a rebuild at the next apply instead of a change; nothing more.
        crate::warn!("{e}");
    }
    Ok(Some(stored.generation))
}

/// For ADD, before `apply_current_snapshot_in_netns`: ends the folding mark of attachment
/// `key` if a DEL killed after removing its layer left one and no layer is there now. The
/// layer ADD makes counts from zero; with the old mark still there, readers would subtract
/// the old pod's folded counts from the new one's (a runtime re-ADDs the same container, e.g.
/// podman's network reload: DEL then ADD). Costs one small read when there is no mark.
pub fn end_stale_fold(state_dir: &Path, netns: &Netns, key: &str) -> Result<(), CniError> {
    let dir = ServicesDir::new(state_dir);
    let marked = |dir: &ServicesDir| dir.accumulator().is_ok_and(|a| a.folding.contains_key(key));
    if !marked(&dir) {
        return Ok(());
    }
    let fail = |what: String| CniError::new(code::IO_FAILURE, "cannot apply the Service layer").with_details(what);
    let _lock = dir.lock(true).map_err(fail)?;
    if marked(&dir) && matches!(netns.run(layer::counters), Ok(Ok(None))) {
        dir.end_folding(&[key.to_string()]).map_err(fail)?;
    }
    Ok(())
}

/// Where the value of a JSON document's top-level `generation` is, and that value, when the
/// document is well-formed JSON with exactly one such member holding a whole number of at
/// least 1 (as the snapshot requires); the rest of the document is skipped, not read.
fn generation_value(text: &[u8]) -> Option<(std::ops::Range<usize>, u64)> {
    #[derive(serde::Deserialize)]
    struct Generation<'a> {
        #[serde(borrow)]
        generation: &'a serde_json::value::RawValue,
    }
    let g: Generation = serde_json::from_slice(text).ok()?;
    let raw = g.generation.get();
    let start = (raw.as_ptr() as usize).checked_sub(text.as_ptr() as usize)?;
    let value = raw.parse::<u64>().ok().filter(|&v| v >= 1 && raw.bytes().all(|b| b.is_ascii_digit()))?;
    (start + raw.len() <= text.len()).then_some((start..start + raw.len(), value))
}

/// The outcome of work done inside a netns, as one message.
fn flat<T>(r: Result<aether_rules::Result<T>, aether_netns::Error>) -> Result<T, String> {
    r.map_err(|e| e.to_string()).and_then(|r| r.map_err(|e| e.to_string()))
}

/// What DEL (or GC) did to a pod's Service layer.
#[derive(Debug, Default)]
pub struct Retired {
    /// The pod's final counts, now in the node accumulator.
    pub folded: BTreeMap<String, u64>,
    /// What went wrong without stopping the pod's deletion (logged by the caller).
    pub warnings: Vec<String>,
}

/// For DEL and GC, in the host netns: under the services lock (exclusive), folds the pod's
/// final counts into the node totals, removes its layer, and runs `forget` (which removes
/// the attachment record). `services apply` holds the same lock while it walks the records,
/// so it either ran before (and its layer is removed here) or runs after (and no longer sees
/// the pod): it never re-creates a layer in a pod being deleted.
///
/// Fold first, idempotently ([`ServicesDir::fold_pods`], keyed by the attachment `key`),
/// then remove: killed at any point, no count is lost or counted twice, and a retried DEL
/// finishes the job. `netns` is `None` when the pod's netns is already gone: nothing to fold.
/// Only `forget` and the lock can fail the call; a count or a layer that cannot be read or
/// removed must not keep a pod from being deleted, so it is reported in `warnings`.
pub fn retire_layer(
    state_dir: &Path,
    netns: Option<&Netns>,
    key: &str,
    forget: impl FnOnce() -> Result<(), CniError>,
) -> Result<Retired, CniError> {
    let dir = ServicesDir::new(state_dir);
    let _lock =
        dir.lock(true).map_err(|e| CniError::new(code::IO_FAILURE, "cannot lock the Service state").with_details(e))?;
    let mut out = Retired::default();
    if let Some(ns) = netns {
        dir.forget_pod(ns.path());
        match flat(ns.run(layer::counters)) {
            Ok(Some(counts)) => match dir.fold_pods(&[(key.to_string(), counts.clone())]) {
                Ok(mut added) => out.folded = added.pop().unwrap_or_default(),
                Err(e) => out
                    .warnings
                    .push(format!("the pod's Service counts ({}) are lost: {e}", crate::log::counts(&counts))),
            },
            Ok(None) => {}
            Err(e) => out.warnings.push(format!("cannot read the pod's Service counters: {e}")),
        }
        state::crash_point("del-folded");
        if let Err(e) = flat(ns.run(layer::remove)) {
            out.warnings.push(format!("cannot remove the pod's Service layer: {e}"));
        }
        state::crash_point("del-layer-removed");
    }
    if let Err(e) = dir.end_folding(&[key.to_string()]) {
        out.warnings.push(format!("the pod's folded counts stay marked: {e}"));
    }
    forget()?;
    Ok(out)
}

pub struct NodeCounters {
    pub generation: Option<u64>,
    pub totals: BTreeMap<String, u64>,
    pub folded: BTreeMap<String, u64>,
    pub pods: Vec<(crate::state::Record, BTreeMap<String, u64>)>,
    /// Attachment records that cannot be read: their pods are not counted, and say so.
    pub unreadable: Vec<String>,
}

impl NodeCounters {
    fn to_json(&self) -> Value {
        let pods: Vec<Value> = self
            .pods
            .iter()
            .map(|(r, c)| {
                json!({
                    "containerID": r.container_id, "ifname": r.ifname, "netns": r.netns,
                    "podNamespace": r.pod_namespace, "podName": r.pod_name, "counters": c,
                })
            })
            .collect();
        let mut v =
            json!({"generation": self.generation, "node": self.totals, "removedPods": self.folded, "pods": pods});
        if !self.unreadable.is_empty() {
            v["unreadableRecords"] = json!(self.unreadable);
        }
        v
    }

    /// Prometheus text: connections by class, refusals by reason, node totals and per pod.
    pub(crate) fn to_prometheus(&self) -> String {
        let mut out = String::new();
        out.push_str("# HELP aether_cni_service_connections_total New captured connections by destination class (refusals included as their class).\n");
        out.push_str("# TYPE aether_cni_service_connections_total counter\n");
        let class = |name: &str| match name {
            "mesh" | "service" | "external" => name.to_string(),
            _ => "refused".to_string(),
        };
        let mut by_class: BTreeMap<String, u64> = BTreeMap::new();
        for (k, v) in &self.totals {
            *by_class.entry(class(k)).or_default() += v;
        }
        for (k, v) in &by_class {
            out.push_str(&format!("aether_cni_service_connections_total{{class=\"{k}\"}} {v}\n"));
        }
        out.push_str("# HELP aether_cni_service_refused_total Connections the Service layer refused (or, in count mode, would refuse), by reason.\n");
        out.push_str("# TYPE aether_cni_service_refused_total counter\n");
        for (k, v) in &self.totals {
            if let Some(reason) = k.strip_prefix("refused_") {
                out.push_str(&format!(
                    "aether_cni_service_refused_total{{reason=\"{}\"}} {v}\n",
                    reason.replace('_', "-")
                ));
            }
        }
        out.push_str("# HELP aether_cni_pod_service_connections_total Per-pod counts by counter.\n");
        out.push_str("# TYPE aether_cni_pod_service_connections_total counter\n");
        for (r, c) in &self.pods {
            for (k, v) in c {
                out.push_str(&format!(
                    "aether_cni_pod_service_connections_total{{container_id=\"{}\",namespace=\"{}\",pod=\"{}\",counter=\"{k}\"}} {v}\n",
                    r.container_id,
                    r.pod_namespace.as_deref().unwrap_or(""),
                    r.pod_name.as_deref().unwrap_or("")
                ));
            }
        }
        out.trim_end().to_string()
    }
}

/// Node totals (folded counts of removed pods + live pods) and per-pod rows. A pod whose
/// netns is gone or has no layer has no row.
pub fn node_counters(dir: &ServicesDir) -> Result<NodeCounters, String> {
    // Shared with other readers, exclusive of DEL/GC folding a pod: a pod is then counted
    // either in the accumulator or in its own row, never in neither (totals never dip).
    let _lock = dir.read_lock()?;
    let acc = dir.accumulator()?;
    let folded = acc.totals.clone();
    let mut totals: BTreeMap<String, u64> =
        COUNTERS.iter().map(|c| (c.to_string(), folded.get(*c).copied().unwrap_or(0))).collect();
    let scan = StateDir::new(&dir.state).scan();
    let live = |records: Vec<Record>| {
        let mut pods = Vec::new();
        for r in records {
            let Ok(PodNetns::Live(ns)) = r.open_netns() else { continue };
            if let Ok(Ok(Some(c))) = ns.run(layer::counters) {
                pods.push((r, c));
            }
        }
        pods
    };
    let pods = aether_netns::tour(|| live(scan.records)).map_err(|e| e.to_string())?;
    for (r, c) in &pods {
        // A pod a killed DEL already folded counts only its growth since.
        for (k, v) in acc.live_part(&r.key(), c) {
            *totals.entry(k).or_default() += v;
        }
    }
    let unreadable = scan.unreadable.into_iter().map(|u| format!("{}: {}", u.file, u.why)).collect();
    let generation = layer_file::read_header(&dir.layer_path()).ok().flatten().map(|(generation, _)| generation);
    Ok(NodeCounters { generation, totals, folded, pods, unreadable })
}

/// The union of what the node's pods dialled, as `VIP:port/proto` (`[VIP]:port/proto` for
/// an IPv6 VIP).
pub fn node_demand(dir: &ServicesDir) -> Result<Vec<String>, String> {
    let _lock = dir.read_lock()?;
    let mut all = std::collections::BTreeSet::new();
    let scan = StateDir::new(&dir.state).scan();
    for u in &scan.unreadable {
        crate::warn!(file = %u.file, why = %u.why, "an attachment record cannot be read; its pod is not included");
    }
    aether_netns::tour(|| {
        for r in scan.records {
            let Ok(PodNetns::Live(ns)) = r.open_netns() else { continue };
            if let Ok(Ok(d)) = ns.run(layer::demand) {
                all.extend(d);
            }
        }
    })
    .map_err(|e| e.to_string())?;
    // `[fd00::1]:80/tcp` for an IPv6 VIP, as a socket address is written.
    Ok(all.into_iter().map(|(a, p, port)| format!("{}/{}", std::net::SocketAddr::new(a, port), p.name())).collect())
}

/// One pod's outcome in `services verify`.
pub struct PodVerified {
    pub container_id: String,
    pub netns: String,
    /// The differences found (empty: intact) and whether they were repaired.
    pub result: Result<(Vec<String>, Option<Applied>), String>,
}

pub struct VerifyReport {
    pub generation: Option<u64>,
    pub pods: Vec<PodVerified>,
}

impl VerifyReport {
    pub fn failed(&self) -> bool {
        self.pods.iter().any(|p| p.result.is_err())
    }

    fn to_json(&self) -> Value {
        let pods: Vec<Value> = self
            .pods
            .iter()
            .map(|p| {
                let mut v = json!({"containerID": p.container_id, "netns": p.netns});
                match &p.result {
                    Ok((d, _)) if d.is_empty() => v["result"] = json!("intact"),
                    Ok((d, repaired)) => {
                        v["result"] = json!(format!("repaired ({})", repaired.as_ref().map_or("-".into(), describe)));
                        v["differences"] = json!(d);
                    }
                    Err(e) => {
                        v["result"] = json!("failed");
                        v["error"] = json!(e);
                    }
                }
                v
            })
            .collect();
        json!({"generation": self.generation, "pods": pods})
    }
}

/// `services verify`: reads every recorded pod's layer back, compares it with the stored
/// snapshot, and repairs what differs (the element change, or a rebuild). Pods whose netns
/// is gone are left out. Exclusive of applies, ADD and DEL (the services lock).
pub fn verify_pods(dir: &ServicesDir) -> Result<VerifyReport, String> {
    let _lock = dir.lock(true)?;
    let stored = dir.stored_layer()?;
    let node_mark = dir.divert_mark();
    let mut pods = Vec::new();
    let records = StateDir::new(&dir.state).records();
    aether_netns::tour(|| verify_each(dir, records, stored.as_ref(), node_mark, &mut pods))
        .map_err(|e| e.to_string())?;
    Ok(VerifyReport { generation: stored.map(|s| s.generation), pods })
}

/// `verify_pods`' visit of each pod.
fn verify_each(
    dir: &ServicesDir,
    records: Vec<Record>,
    stored: Option<&StoredLayer>,
    node_mark: u32,
    pods: &mut Vec<PodVerified>,
) {
    for r in records {
        let Ok(PodNetns::Live(ns)) = r.open_netns() else { continue };
        let mark = r.capture.as_ref().map_or(node_mark, |c| c.divert_mark);
        let l = stored.map_or_else(|| layer::ServiceLayer::new(layer::LayerMode::Off), |s| s.for_pod(mark));
        let result = flat(ns.run(|| {
            let diffs = layer::verify(&l)?;
            let repaired = if diffs.is_empty() { None } else { Some(layer::apply(&l)?) };
            Ok((diffs, repaired))
        }));
        match (&result, stored) {
            (Ok(_), Some(s)) if l.mode != layer::LayerMode::Off => {
                let _ = dir.set_pod_holds(&ns, &PodHolds::new(s, &ns, mark));
            }
            _ => dir.forget_pod(ns.path()),
        }
        pods.push(PodVerified { container_id: r.container_id, netns: r.netns, result });
    }
}

/// In a word, whether a pod's Service layer is what the stored snapshot says (`inspect`'s list).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerVerdict {
    /// No snapshot stored yet: the pod rightly has no layer.
    NoSnapshot,
    Intact {
        generation: u64,
    },
    Differs {
        generation: u64,
        differences: usize,
    },
    /// The stored snapshot or the kernel could not be read.
    Unknown,
}

impl LayerVerdict {
    pub fn is_intact(&self) -> bool {
        matches!(self, LayerVerdict::NoSnapshot | LayerVerdict::Intact { .. })
    }
}

impl std::fmt::Display for LayerVerdict {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            LayerVerdict::NoSnapshot => write!(f, "none (no snapshot yet)"),
            LayerVerdict::Intact { generation } => write!(f, "intact (generation {generation})"),
            LayerVerdict::Differs { generation, differences } => {
                write!(
                    f,
                    "NOT INTACT ({} from generation {generation})",
                    crate::log::plural(*differences, "difference")
                )
            }
            LayerVerdict::Unknown => write!(f, "unknown (cannot read)"),
        }
    }
}

/// For `inspect`: the pod's Service layer in a few readable lines (what the stored snapshot
/// says it should be, whether the kernel holds exactly that, and its counters), and the
/// verdict in a word.
pub fn describe_pod_layer(state_dir: &Path, netns: &Netns, divert_mark: Option<u32>) -> (Vec<String>, LayerVerdict) {
    let dir = ServicesDir::new(state_dir);
    let mut out = Vec::new();
    let stored = match dir.stored_layer() {
        Ok(s) => s,
        Err(e) => return (vec![format!("stored snapshot: {e}")], LayerVerdict::Unknown),
    };
    let mut verdict = LayerVerdict::NoSnapshot;
    match &stored {
        None => out.push("no snapshot applied on this node yet (the agent has not run `services apply`)".into()),
        Some(stored) => {
            let l = stored.for_pod(divert_mark.unwrap_or_else(|| dir.divert_mark()));
            let tables: Vec<String> =
                l.families().iter().map(|f| format!("table {} {}", f.nft_name(), layer::TABLE)).collect();
            out.push(format!(
                "snapshot generation {}, mode {}: {} ranges, {} mesh VIPs, {} Service ports{}",
                stored.generation,
                l.mode,
                l.ranges.len(),
                l.mesh_vips.len(),
                l.ports.len(),
                if tables.is_empty() { String::new() } else { format!(" ({})", tables.join(" and ")) }
            ));
            match dir.pod_holds(netns) {
                Some(h) if h.is(stored, l.divert_mark) => {
                    out.push(format!("the pod was last given generation {} (the same layer)", h.generation))
                }
                Some(h) => out.push(format!("the pod was last given generation {} (an older layer)", h.generation)),
                None => out.push("no record of the generation the pod holds (the next apply rebuilds it)".into()),
            }
            let generation = stored.generation;
            verdict = LayerVerdict::Unknown;
            match netns.run(|| layer::verify(&l)) {
                Ok(Ok(d)) if d.is_empty() => {
                    verdict = LayerVerdict::Intact { generation };
                    out.push("kernel: intact (matches the snapshot)".into())
                }
                Ok(Ok(d)) => {
                    verdict = LayerVerdict::Differs { generation, differences: d.len() };
                    out.push("kernel: NOT as the snapshot says:".into());
                    out.extend(d.into_iter().map(|x| format!("  - {x}")));
                }
                Ok(Err(e)) => out.push(format!("kernel: cannot read the layer: {e}")),
                Err(e) => out.push(format!("kernel: cannot enter the netns: {e}")),
            }
        }
    }
    match netns.run(layer::counters) {
        Ok(Ok(Some(c))) => {
            let text: Vec<String> = c.iter().map(|(k, v)| format!("{k}={v}")).collect();
            out.push(format!("counters: {}", text.join(" ")));
        }
        Ok(Ok(None)) => out.push(format!("no {} table (ip or ip6) is present", layer::TABLE)),
        Ok(Err(e)) => out.push(format!("counters: {e}")),
        Err(e) => out.push(format!("counters: {e}")),
    }
    match netns.run(layer::demand) {
        Ok(Ok(d)) if !d.is_empty() => {
            let text: Vec<String> =
                d.iter().map(|(vip, proto, port)| format!("{vip} {} {port}", proto.name())).collect();
            out.push(format!("dialled: {}", text.join(", ")));
        }
        _ => {}
    }
    (out, verdict)
}

#[cfg(test)]
mod tests {
    use super::*;
    use aether_testkit::{root_or_skip, TestNetns};

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("aether-svcu-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    fn rec(cid: &str, netns: &str) -> Record {
        Record {
            version: crate::state::RECORD_VERSION,
            network: "k8s-pod-network".into(),
            container_id: cid.into(),
            ifname: "eth0".into(),
            netns: netns.into(),
            netns_id: None,
            pod_namespace: Some("shop".into()),
            pod_name: Some(cid.into()),
            pod_uid: None,
            config_digest: "0".into(),
            capture: None,
            defaulted: Vec::new(),
        }
    }

    /// A snapshot whose content tells its generation apart (one Service port per generation).
    fn doc(generation: u64) -> Vec<u8> {
        json!({
            "generation": generation,
            "mode": "count",
            "serviceRanges": ["10.96.0.0/16"],
            "services": [{"namespace": "n", "name": "s", "vip": "10.96.1.1",
                          "ports": [{"protocol": "TCP", "port": 1000 + generation}], "usableEndpoints": true}]
        })
        .to_string()
        .into_bytes()
    }

    /// The stored document with only its generation changed is taken as the stored content
    /// (not read again), and only then: any other difference, a damaged or swapped
    /// `snapshot.json`, an unknown member, a generation that is not one, gets a full reading.
    #[test]
    fn a_new_generation_of_the_stored_document_is_recognised_by_its_bytes_and_nothing_else() {
        let state = tmp("regen");
        let dir = ServicesDir::new(&state);
        let regen = |text: &[u8], from: u64, to: &str| {
            let text = String::from_utf8(text.to_vec()).unwrap();
            let g = format!("\"generation\":{from},");
            assert!(text.contains(&g), "{text}");
            text.replacen(&g, &format!("\"generation\":{to},"), 1).into_bytes()
        };
        let port = |dir: &ServicesDir| dir.stored_layer().unwrap().unwrap().layer.ports[0].port;
        let first = doc(1);
        apply_document(&dir, &first).unwrap();
        // Which reading was used shows when `layer.bin` (which says it was made from `first`)
        // holds another layer than `first` does: the bytes path takes `layer.bin`'s.
        let mut planted = snapshot::parse(&doc(7)).unwrap().layer(0);
        planted.ports[0].port = 4242;
        let source = layer_file::source_digest(&first);
        dir.write_atomic("layer.bin", &StoredLayer::new(1, &planted, source).encode()).unwrap();
        let second = regen(&first, 1, "2");
        assert_eq!(apply_document(&dir, &second).unwrap().generation, 2);
        let stored = dir.stored_layer().unwrap().unwrap();
        assert_eq!((stored.generation, port(&dir)), (2, 4242), "taken by its bytes");
        assert_eq!(fs::read(state.join("services/snapshot.json")).unwrap(), second);
        // Control: another difference besides the generation is read in full.
        let third = String::from_utf8(regen(&second, 2, "3")).unwrap().replace("1001", "1999").into_bytes();
        apply_document(&dir, &third).unwrap();
        assert_eq!(port(&dir), 1999, "read in full");
        // Refused as a full reading refuses them: an unknown member, a generation of 0 or
        // not a whole number.
        let unknown = String::from_utf8(regen(&third, 3, "4")).unwrap().replacen('{', "{\"x\":1,", 1).into_bytes();
        assert!(apply_document(&dir, &unknown).unwrap_err()[0].contains("x: unknown field"));
        for bad in ["0", "4.0"] {
            let e = apply_document(&dir, &regen(&third, 3, bad)).unwrap_err();
            assert!(e.iter().any(|e| e.contains("generation")), "{bad}: {e:?}");
        }
        assert_eq!(dir.stored_layer().unwrap().unwrap().generation, 3);
        // A `snapshot.json` that is not what `layer.bin` was made from (a crash between the
        // two writes), even at the same generation, is never trusted: the new generation of
        // it is read in full.
        dir.write_atomic("snapshot.json", &doc(3)).unwrap();
        apply_document(&dir, &regen(&doc(3), 3, "6")).unwrap();
        assert_eq!((dir.stored_layer().unwrap().unwrap().generation, port(&dir)), (6, 1003));
        let _ = fs::remove_dir_all(&state);
    }

    /// Issue 5: "an apply racing with ADDs ends with every pod at the newest generation";
    /// Generations 2..=21 applied by 20 threads at once. They race each other too: one older
    /// than the stored generation is refused, as it must be.
    fn spawn_racing_applies<'s>(s: &'s std::thread::Scope<'s, '_>, state: &Path) {
        for g in 2..=21u64 {
            let dir = ServicesDir::new(state);
            s.spawn(move || {
                if let Err(e) = apply_document(&dir, &doc(g)) {
                    assert!(e[0].contains("is older than the stored generation"), "{e:?}");
                }
            });
        }
    }

    /// 50 parallel ADDs (record, then `apply_current_snapshot_in_netns`) against 20 applies.
    #[test]
    fn parallel_adds_and_applies_leave_every_pod_at_the_newest_generation() {
        if !root_or_skip("parallel_adds_and_applies_leave_every_pod_at_the_newest_generation") {
            return;
        }
        let state = tmp("race");
        let dir = ServicesDir::new(&state);
        apply_document(&dir, &doc(1)).unwrap();
        let netns: Vec<TestNetns> = (0..50).map(|_| TestNetns::new("svc-race")).collect();
        std::thread::scope(|s| {
            for (i, ns) in netns.iter().enumerate() {
                let state = state.clone();
                s.spawn(move || {
                    StateDir::new(&state).write(&rec(&format!("c{i}"), &ns.path())).unwrap();
                    let n = Netns::open_foreign(ns.path()).unwrap();
                    apply_current_snapshot_in_netns(&state, &n, 0xae71).unwrap();
                });
            }
            spawn_racing_applies(s, &state);
        });
        let newest = dir.stored_layer().unwrap().unwrap();
        assert_eq!(newest.generation, 21);
        let l = newest.for_pod(0xae71);
        for ns in &netns {
            let diffs = Netns::open_foreign(ns.path()).unwrap().run(|| layer::verify(&l)).unwrap().unwrap();
            assert!(diffs.is_empty(), "{}: {diffs:#?}", ns.name);
        }
        let _ = fs::remove_dir_all(&state);
    }

    /// 50 parallel DELs (`retire_layer` forgetting the record) against 20 applies: no apply
    /// re-creates a layer in a pod that is being deleted.
    #[test]
    fn parallel_dels_and_applies_leave_no_layer_behind() {
        if !root_or_skip("parallel_dels_and_applies_leave_no_layer_behind") {
            return;
        }
        let state = tmp("delrace");
        let dir = ServicesDir::new(&state);
        apply_document(&dir, &doc(1)).unwrap();
        let netns: Vec<TestNetns> = (0..50).map(|_| TestNetns::new("svc-delrace")).collect();
        for (i, ns) in netns.iter().enumerate() {
            StateDir::new(&state).write(&rec(&format!("c{i}"), &ns.path())).unwrap();
            let n = Netns::open_foreign(ns.path()).unwrap();
            apply_current_snapshot_in_netns(&state, &n, 0xae71).unwrap();
        }
        std::thread::scope(|s| {
            for (i, ns) in netns.iter().enumerate() {
                let state = state.clone();
                s.spawn(move || {
                    let n = Netns::open_foreign(ns.path()).unwrap();
                    let forget = || StateDir::new(&state).remove("k8s-pod-network", &format!("c{i}"), "eth0");
                    let retired =
                        retire_layer(&state, Some(&n), &format!("k8s-pod-network/c{i}/eth0"), forget).unwrap();
                    assert!(retired.warnings.is_empty(), "{:?}", retired.warnings);
                });
            }
            spawn_racing_applies(s, &state);
        });
        for ns in &netns {
            let left = Netns::open_foreign(ns.path()).unwrap().run(layer::counters).unwrap().unwrap();
            assert!(left.is_none(), "{}: an apply re-created the layer of a deleted pod", ns.name);
        }
        assert!(StateDir::new(&state).records().is_empty());
        let _ = fs::remove_dir_all(&state);
    }

    /// Node totals read while pods are deleted one after another never dip: a pod is counted
    /// in its own row or in the accumulator, never in neither.
    #[test]
    fn node_totals_never_dip_while_pods_are_deleted() {
        if !root_or_skip("node_totals_never_dip_while_pods_are_deleted") {
            return;
        }
        let state = tmp("dip");
        let dir = ServicesDir::new(&state);
        apply_document(&dir, &doc(1)).unwrap();
        let pods: Vec<TestNetns> = (0..8).map(|_| TestNetns::new("svc-dip")).collect();
        for (i, ns) in pods.iter().enumerate() {
            StateDir::new(&state).write(&rec(&format!("d{i}"), &ns.path())).unwrap();
            let n = Netns::open_foreign(ns.path()).unwrap();
            apply_current_snapshot_in_netns(&state, &n, 0xae71).unwrap();
            // Every packet leaves through lo, marked as capture would mark it: each
            // connection to an external address counts once.
            ns.exec("ip", &["route", "add", "default", "dev", "lo"]);
            let path = std::env::temp_dir().join(format!("{}.nft", ns.name));
            fs::write(&path, "table ip standin {\n\tchain out {\n\t\ttype route hook output priority -150; policy accept;\n\t\tmeta l4proto tcp meta mark set 0xae71\n\t}\n}\n").unwrap();
            ns.exec("nft", &["-f", path.to_str().unwrap()]);
            let _ = fs::remove_file(&path);
            n.run(|| {
                for port in 1..=5 {
                    let addr = std::net::SocketAddr::from(([192, 0, 2, 1], port));
                    let _ = std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_millis(50));
                }
            })
            .unwrap();
        }
        let full = node_counters(&dir).unwrap().totals["external"];
        assert_eq!(full, 40, "8 pods x 5 connections");
        let done = std::sync::atomic::AtomicBool::new(false);
        let samples = std::thread::scope(|s| {
            let poller = s.spawn(|| {
                let mut seen = Vec::new();
                while !done.load(std::sync::atomic::Ordering::SeqCst) {
                    seen.push(node_counters(&ServicesDir::new(&state)).unwrap().totals["external"]);
                }
                seen
            });
            for (i, ns) in pods.iter().enumerate() {
                let n = Netns::open_foreign(ns.path()).unwrap();
                retire_layer(&state, Some(&n), &format!("k8s-pod-network/d{i}/eth0"), || {
                    StateDir::new(&state).remove("k8s-pod-network", &format!("d{i}"), "eth0")
                })
                .unwrap();
            }
            done.store(true, std::sync::atomic::Ordering::SeqCst);
            poller.join().unwrap()
        });
        assert!(!samples.is_empty());
        assert!(samples.iter().all(|&v| v == full), "node totals dipped while pods were deleted: {samples:?}");
        assert_eq!(node_counters(&dir).unwrap().totals["external"], full);
        let _ = fs::remove_dir_all(&state);
    }

    /// Counters survive pod churn: ADD, traffic, DEL; the node total still includes it, and a
    /// repeated DEL does not count it twice.
    #[test]
    fn del_folds_final_counts_into_the_node_total() {
        if !root_or_skip("del_folds_final_counts_into_the_node_total") {
            return;
        }
        let state = tmp("fold");
        let dir = ServicesDir::new(&state);
        apply_document(&dir, &doc(1)).unwrap();
        let ns = TestNetns::new("svc-fold");
        StateDir::new(&state).write(&rec("f", &ns.path())).unwrap();
        let n = Netns::open_foreign(ns.path()).unwrap();
        assert_eq!(apply_current_snapshot_in_netns(&state, &n, 0xae71).unwrap(), Some(1));
        ns.exec("ip", &["link", "add", "d0", "type", "veth", "peer", "name", "d1"]);
        ns.exec("ip", &["link", "set", "d1", "up"]);
        ns.exec("ip", &["addr", "add", "10.244.9.2/24", "dev", "d0"]);
        ns.exec("ip", &["link", "set", "d0", "up"]);
        ns.exec("ip", &["route", "add", "default", "dev", "d0"]);
        // Stand-in for capture's divert decision (marks TCP; no policy route).
        let path = std::env::temp_dir().join(format!("{}.nft", ns.name));
        fs::write(&path, "table ip standin {\n\tchain out {\n\t\ttype route hook output priority -150; policy accept;\n\t\tmeta l4proto tcp meta mark set 0xae71\n\t}\n}\n").unwrap();
        ns.exec("nft", &["-f", path.to_str().unwrap()]);
        let _ = fs::remove_file(&path);
        n.run(|| {
            for addr in ["10.96.1.1:1001", "10.96.7.7:80", "192.0.2.1:80"] {
                let _ =
                    std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), std::time::Duration::from_millis(50));
            }
        })
        .unwrap();
        let before = node_counters(&dir).unwrap().totals;
        assert_eq!((before["service"], before["refused_no_service"], before["external"]), (1, 1, 1), "{before:?}");
        let forget = || StateDir::new(&state).remove("k8s-pod-network", "f", "eth0");
        let retired = retire_layer(&state, Some(&n), "k8s-pod-network/f/eth0", forget).unwrap();
        assert_eq!(retired.folded["service"], 1);
        assert!(retired.warnings.is_empty(), "{:?}", retired.warnings);
        assert!(StateDir::new(&state).records().is_empty(), "the record is forgotten under the lock");
        assert_eq!(node_counters(&dir).unwrap().totals, before, "node totals went backwards");
        // DEL again (and DEL after the netns is gone): nothing counted twice.
        assert!(retire_layer(&state, Some(&n), "k8s-pod-network/f/eth0", || Ok(())).unwrap().folded.is_empty());
        drop(n);
        drop(ns);
        assert!(retire_layer(&state, None, "k8s-pod-network/f/eth0", || Ok(())).unwrap().folded.is_empty());
        assert_eq!(node_counters(&dir).unwrap().totals, before);
        let _ = fs::remove_dir_all(&state);
    }
}
