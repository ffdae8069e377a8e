//! aether-cni-installer: the DaemonSet's container, a long-lived daemon apart from the plugin.
//!
//! The plugin (`aether-cni`) is started by the runtime at every pod start and must start
//! quickly; this program runs for the node's life with an HTTP face, the agent's socket and
//! the reconciler's CRI client on one async runtime. Two binaries keep each of those out of
//! the other's process. What it does is the library's (`aether_installer::run`); here are
//! only its command line and its log set-up.

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::Layer;

#[derive(Parser)]
#[command(
    name = "aether-cni-installer",
    version,
    about = "The DaemonSet's container: install the aether-cni plugin, chain it into the node's CNI \
             configuration and keep it there; undo it all on SIGTERM (unless an upgrade)."
)]
struct Cli {
    #[command(flatten)]
    args: aether_installer::InstallArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_log();
    match aether_installer::run(cli.args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("aether-cni-installer: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The plugin's line format (RFC 3339 UTC, level, message and fields; no colour, no target),
/// at info and up, to stderr: a long-running service's log is its output.
fn init_log() {
    let layer = tracing_subscriber::fmt::layer()
        .with_ansi(false)
        .with_target(false)
        .with_writer(|| OneLine)
        .with_filter(tracing::level_filters::LevelFilter::INFO);
    let _ = tracing::subscriber::set_global_default(tracing_subscriber::Registry::default().with(layer));
}

/// Writes each event as one line on stderr: a message's inner newlines become `\n`.
struct OneLine;

impl Write for OneLine {
    fn write(&mut self, event: &[u8]) -> std::io::Result<usize> {
        let body = event.strip_suffix(b"\n").unwrap_or(event);
        let mut line = Vec::with_capacity(event.len() + 16);
        for &b in body {
            if b == b'\n' {
                line.extend_from_slice(b"\\n");
            } else {
                line.push(b);
            }
        }
        line.push(b'\n');
        // Logging never fails the installer: a closed stderr loses the line.
        let _ = std::io::stderr().write_all(&line);
        Ok(event.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
