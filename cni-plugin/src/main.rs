//! aether-cni: a chained CNI plugin when `CNI_COMMAND` is set, an operator CLI otherwise.
//!
//! This crate is the CNI protocol (the environment, stdin, the result and error JSON, exit
//! codes, logging set-up; `error` gives the node library's errors their CNI codes, in one
//! place) and the CLI (clap definitions and output formats of `services`, `inspect`,
//! `doctor`). What a node does is the node library's (`aether-node`). The installer daemon is
//! a program of its own (`aether-cni-installer`, from `aether-installer`), never linked here:
//! the runtime starts this binary at every pod start, and it must not map an async runtime,
//! an HTTP server, a gRPC client or a metrics registry it never runs. Nothing here is
//! imported by another crate.

mod after_answer;
mod cni;
#[cfg(test)]
mod config_tests;
mod doctor;
mod env;
mod error;
#[cfg(test)]
mod fuzz_tests;
mod inspect;
mod log;
mod services;

use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::{Parser, Subcommand};
// Log call sites write `info!(...)` / `crate::warn!(...)`: tracing's macros.
pub(crate) use tracing::{error, info, warn};

/// What `--help` says after the commands: how the same binary behaves as a CNI plugin,
/// and where the rest is written down.
const AS_A_PLUGIN: &str = "\
As a CNI plugin:
  With CNI_COMMAND set (ADD, DEL, CHECK, STATUS, GC or VERSION) aether-cni is the plugin, not
  this CLI: it ignores its arguments, reads the network configuration (JSON) on stdin and
  writes the CNI result, or a CNI error {code, msg, details}, on stdout. Logs go to stderr
  and to the configuration's logFile, never to stdout. The container runtime runs it that
  way, chained after the cluster's main CNI plugin in /etc/cni/net.d.

Documentation (in the aether-cni repository):
  docs/configuration.md  every network configuration field, its default and its checks;
                         the pod annotations aether.io/capture, aether.io/exclude-outbound-ports,
                         aether.io/exclude-outbound-cidrs, aether.io/capture-dns
  docs/operating.md      logs, CNI error codes, reading `inspect`, finding a pod's netns
  docs/agent.md          the `services` commands and the Service snapshot; its JSON Schema:
                         testdata/services/snapshot.schema.json

Every command that reads node state takes --state-dir (default /var/run/aether-cni, the
configuration's stateDir).";

#[derive(Parser)]
#[command(
    name = "aether-cni",
    version,
    about = "The Aether mesh capture layer: a chained CNI plugin and its operator tools.",
    after_help = AS_A_PLUGIN
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the CNI versions this plugin supports.
    Versions,
    /// The Service-range and refusal-counter layer: apply a snapshot, read counters, demand.
    Services(services::ServicesArgs),
    /// Show a pod's capture and Service layers (without a pod: every recorded one), and whether the kernel holds them intact.
    Inspect(inspect::InspectArgs),
    /// Check that this kernel can hold the capture ruleset (in a private netns; changes nothing).
    Doctor,
    /// Moved: the installer is its own program, aether-cni-installer (it fails naming it).
    #[command(hide = true, disable_help_flag = true)]
    Install {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
}

fn main() -> ExitCode {
    // Runtimes call plugins with no arguments and CNI_* variables; then a missing
    // CNI_COMMAND is a CNI error naming it, not a CLI usage message. With arguments, this
    // is the operator CLI even if CNI_* variables linger in the environment.
    let cni_env = ["CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS", "CNI_PATH"];
    let no_args = std::env::args_os().len() == 1;
    if std::env::var_os("CNI_COMMAND").is_some() || (no_args && cni_env.iter().any(|v| std::env::var_os(v).is_some())) {
        return run_cni();
    }
    // An operator piping into `head` should see the CLI end quietly, as Unix tools do,
    // not a panic from println! on a closed pipe.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    // The CLI's own output is its result; what goes wrong underneath reaches stderr.
    let cli = Cli::parse();
    log::init(&log::Settings { level: tracing::level_filters::LevelFilter::WARN, ..log::Settings::default() });
    match cli.command {
        Command::Versions => {
            println!("{}", aether_node::config::SUPPORTED_VERSIONS.join("\n"));
            ExitCode::SUCCESS
        }
        Command::Services(args) => services::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Doctor => doctor::run(),
        Command::Install { .. } => {
            // Not an alias: running the installer from here would link it into every pod start.
            eprintln!(
                "aether-cni install: the installer is a program of its own now, aether-cni-installer \
                 (beside aether-cni in the image); run it with the same flags"
            );
            ExitCode::from(2)
        }
    }
}

/// The CNI protocol: configuration on stdin, result or error JSON on stdout, logs elsewhere.
fn run_cni() -> ExitCode {
    let (stdin, read) = cni::read_stdin(std::io::stdin().lock());
    // The log settings are read leniently before anything else, so that a configuration the
    // full parse refuses is still logged to its logFile.
    log::init(&log::Settings::lenient(&stdin));
    let env = env::Env::from_process();
    let command = std::env::var("CNI_COMMAND").unwrap_or_default();
    answer_panics(&command, &stdin);
    let _span = match &env {
        Ok(e) => log::cni_span(
            &e.command,
            log::pod_name(e.args.namespace.as_deref(), e.args.name.as_deref()),
            e.container_id.as_deref(),
            e.netns.as_deref(),
        ),
        Err(_) => log::cni_span(&command, None, None, None),
    }
    .entered();
    // The one thread does the netns work in place (setns there and back): a worker thread
    // per netns visit cost a fresh ADD more than its nftables transaction.
    let outcome = read.and(env).and_then(|env| {
        aether_netns::tour_here(|| cni::run(&env, &stdin)).map_err(error::CniError::from).and_then(|r| r)
    });
    let (outcome, then) = match outcome {
        Ok(cni::Answer { output, then }) => (Ok(output), then),
        Err(e) => (Err(e), None),
    };
    let answered = match outcome {
        // A panic was answered by the hook already (an unwinding build gets here after one).
        _ if PANIC_ANSWERED.load(Ordering::SeqCst) => false,
        Ok(None) => true,
        Ok(Some(result)) => {
            write_answer(&result.to_string());
            true
        }
        Err(e) => {
            // The details (CHECK's every difference, an OS error) apart from the message.
            let details = (!e.details.is_empty()).then(|| tracing::field::display(&e.details));
            error!(code = e.code, details, "{command} failed: {}", e.msg);
            write_answer(&e.to_json(&cni::version_of(&stdin)).to_string());
            false
        }
    };
    match then.filter(|_| answered) {
        // ADD's large Service layer, after the answer: the runtime's pipes let go of, then
        // built by a child (or here, when none can be made) while this process ends.
        Some(cni::AfterAnswer::BuildLayer(layer)) => {
            if !after_answer::let_go_of_the_runtime() {
                after_answer::build(layer);
            } else if let after_answer::Split::Child(layer) | after_answer::Split::Unsplit(layer) =
                after_answer::split(layer)
            {
                after_answer::build(layer);
            }
        }
        // DEL's sockets, whose last close waits for the kernel to free what DEL removed:
        // closed last by a child, so the runtime does not wait for it.
        Some(cni::AfterAnswer::CloseSockets(sockets)) => after_answer::close_apart(sockets),
        None => {}
    }
    if answered {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Writes the one answer on stdout, whole before anything else happens (a layer's child is
/// made after it). A write that fails is logged: the runtime then reads no answer.
fn write_answer(text: &str) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = writeln!(out, "{text}").and_then(|()| out.flush()) {
        error!("cannot write the answer on stdout: {e}");
    }
}

/// Set once a panic's CNI error is on stdout: the runtime reads one answer.
static PANIC_ANSWERED: AtomicBool = AtomicBool::new(false);

/// A panic still answers the runtime with a CNI error on stdout (code 5, the panic's message
/// in its details) and a log line. The shipped plugin aborts on a panic (Cargo.toml's
/// `plugin` profile: no unwinding back to `run_cni`), so the answer is given here, before
/// the abort, wherever the thread is (in the pod's netns too: harmless for a process about
/// to end, whose namespaces end with it). A build that unwinds answers the same way, once.
fn answer_panics(command: &str, stdin: &[u8]) {
    let (command, stdin) = (command.to_string(), stdin.to_vec());
    std::panic::set_hook(Box::new(move |info| {
        let e = error::CniError::new(error::code::IO_FAILURE, "aether-cni stopped on an internal error (a panic)")
            .with_details(info.to_string());
        error!(code = e.code, details = %e.details, "{command} failed: {}", e.msg);
        if !PANIC_ANSWERED.swap(true, Ordering::SeqCst) {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{}", e.to_json(&cni::version_of(&stdin)));
            let _ = out.flush();
        }
    }));
}
