//! `aether-cni install`: the installer crate's daemon (it asks the node library itself for
//! what it needs of the plugin).

use std::process::ExitCode;

use aether_installer::InstallArgs;

pub fn run(args: InstallArgs) -> ExitCode {
    match aether_installer::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("aether-cni install: {e}");
            ExitCode::FAILURE
        }
    }
}
