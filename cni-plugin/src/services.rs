//! `aether-cni services`: the agent's interface to the Service-range and refusal-counter
//! layer. The work is the node library's (`aether_node::services`); this is its CLI: the
//! arguments, where the snapshot is read from, the output formats and exit codes.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use aether_node::services::{self, snapshot, ServicesDir};
use aether_node::state;
use serde_json::json;

#[derive(clap::Args)]
pub struct ServicesArgs {
    /// The node state directory (the `stateDir` of the network configuration).
    #[arg(long, global = true, default_value = aether_node::config::DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
    #[command(subcommand)]
    command: ServicesCommand,
}

#[derive(clap::Subcommand)]
enum ServicesCommand {
    /// Read a snapshot (JSON, see testdata/services/snapshot.schema.json) or a change to the
    /// stored one (testdata/services/change.schema.json) from -f FILE or stdin, validate it,
    /// store the result and apply it to every managed pod.
    Apply {
        /// The snapshot file; `-` is stdin. Without -f, stdin is read unless it is a terminal.
        #[arg(short = 'f', long = "file", value_name = "FILE")]
        file: Option<PathBuf>,
        /// Send the document to the installer's Service-layer socket (`aether-cni-installer
        /// --services-socket`, by default <state-dir>/agent/services.sock) instead of
        /// applying it in this process: the same checks, output and exit codes.
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// With --socket: how long to wait for the installer's answer. It comes when the
        /// document is applied (a whole snapshot to every pod of a loaded node can take
        /// minutes), or, when the document got no turn within 120 s, as a refusal.
        #[arg(long = "timeout-seconds", value_name = "SECONDS", default_value_t = 600, requires = "socket",
              value_parser = clap::value_parser!(u64).range(1..))]
        timeout_seconds: u64,
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
    /// Print the stored snapshot as it stands: the document as the agent sent it, or in
    /// canonical form once a change document was applied to it. Exits 1 when none is stored.
    Snapshot,
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

/// `services apply --socket`: the document sent to the installer; its answer printed as the
/// in-process apply prints its outcome (the report on stdout; each reason on stderr) with the
/// same exit codes (0; 1 some pod failed, the document stored; 2 not applied).
fn apply_through(socket: &Path, text: &[u8], timeout: std::time::Duration) -> ExitCode {
    let fail = |why: &str| {
        eprintln!("aether-cni services apply: {why}");
        ExitCode::from(2)
    };
    let (status, body) = match aether_apply_client::post_apply(socket, text, timeout) {
        Ok(answer) => answer,
        Err(e) => return fail(&e),
    };
    let parsed: Option<serde_json::Value> = serde_json::from_slice(&body).ok();
    let is_report = parsed.as_ref().is_some_and(|v| v.get("pods").is_some() && v.get("generation").is_some());
    match (status, parsed) {
        (200 | 500, Some(_)) if is_report => {
            print!("{}", String::from_utf8_lossy(&body));
            if status == 200 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        (_, Some(v)) if v["reasons"].is_array() => {
            for r in v["reasons"].as_array().into_iter().flatten() {
                eprintln!("aether-cni services apply: {}", r.as_str().unwrap_or_default());
            }
            ExitCode::from(2)
        }
        _ => {
            let text = String::from_utf8_lossy(&body);
            let shown: String = text.chars().take(500).collect();
            fail(&format!("the installer answered {status}: {shown}"))
        }
    }
}

pub fn run(args: ServicesArgs) -> ExitCode {
    // Through the socket the installer works on its state directory: the agent's pod need
    // not mount it.
    if let ServicesCommand::Apply { file, socket: Some(socket), timeout_seconds } = &args.command {
        return match read_snapshot(file.as_deref()) {
            Ok(text) => apply_through(socket, &text, std::time::Duration::from_secs(*timeout_seconds)),
            Err(e) => {
                eprintln!("aether-cni services apply: {e}");
                ExitCode::from(2)
            }
        };
    }
    if let Some(why) = state::unusable_reason(&args.state_dir) {
        eprintln!("aether-cni services: state directory {} {why}", args.state_dir.display());
        return ExitCode::FAILURE;
    }
    let dir = ServicesDir::new(&args.state_dir);
    let out = match args.command {
        ServicesCommand::Apply { file, .. } => {
            let text = match read_snapshot(file.as_deref()) {
                Ok(text) => text,
                Err(e) => {
                    eprintln!("aether-cni services apply: {e}");
                    return ExitCode::from(2);
                }
            };
            // A change document (a top-level baseGeneration) or a whole snapshot.
            let applied = if services::change::is_change(&text) {
                services::apply_change(&dir, &text)
            } else {
                services::apply_document(&dir, &text)
            };
            match applied {
                Ok(report) => {
                    println!("{}", report.to_pretty_text());
                    return if report.failed() { ExitCode::FAILURE } else { ExitCode::SUCCESS };
                }
                Err(refused) => {
                    for e in refused.reasons() {
                        eprintln!("aether-cni services apply: {e}");
                    }
                    return ExitCode::from(2);
                }
            }
        }
        ServicesCommand::Counters { format } => services::node_counters(&dir).map(|c| match format {
            Format::Json => serde_json::to_string_pretty(&c.to_json()).unwrap(),
            Format::Prometheus => c.to_prometheus(),
        }),
        ServicesCommand::Demand { format } => services::node_demand(&dir).map(|d| match format {
            DemandFormat::Json => serde_json::to_string_pretty(&json!({ "demand": d })).unwrap(),
            DemandFormat::Text => d.join("\n"),
        }),
        ServicesCommand::Snapshot => match dir.current_snapshot() {
            Ok(Some(text)) => {
                use std::io::Write;
                return match std::io::stdout().lock().write_all(&text) {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        eprintln!("aether-cni services snapshot: {e}");
                        ExitCode::FAILURE
                    }
                };
            }
            Ok(None) => Err(services::ServicesError::NoSnapshot),
            Err(e) => Err(e),
        },
        ServicesCommand::Verify => match services::verify_pods(&dir) {
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
