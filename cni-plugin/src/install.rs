//! `aether-cni install`: the installer crate, given what it needs from the plugin (its
//! configuration parser, doctor's kernel checks, the Service layer's node counters).

use std::process::ExitCode;

use aether_installer::{InstallArgs, Plugin};

use crate::{cni, config, services, state};

pub fn run(args: InstallArgs) -> ExitCode {
    let counters_dir = services::ServicesDir::new(&args.state_dir);
    let plugin = Plugin {
        not_ready_marker: state::NOT_READY_MARKER,
        validate_entry: Box::new(|conf| config::parse(conf).map(drop).map_err(|e| e.to_string())),
        kernel_checks: Box::new(|| {
            // A connect-time socket load balancer is said, not a not-ready reason: pods start
            // and are captured, but Service traffic reaches the capture already balanced.
            if let Ok(f @ aether_rules::socket_lb::Finding::Attached(_)) = aether_rules::socket_lb::detect() {
                tracing::warn!("{f}");
            }
            cni::kernel_probe()
        }),
        node_counters: Box::new(move || services::node_counters(&counters_dir).map(|c| c.to_prometheus())),
    };
    match aether_installer::run(args, plugin) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("aether-cni install: {e}");
            ExitCode::FAILURE
        }
    }
}
