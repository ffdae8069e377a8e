//! `make demo`: the whole product, end to end, on a simulated node (see
//! `aether_conformance::demo`, which `conformance/tests/demo.rs` also runs, so CI proves
//! every step shown here).
//!
//! Usage (as root): `cargo run -p aether-conformance --example demo -- [path/to/aether-cni]`

fn main() {
    if let Some(bin) = std::env::args().nth(1) {
        std::env::set_var("AETHER_CNI_BIN", bin);
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("make demo needs root: it builds network namespaces for a simulated node");
        std::process::exit(1);
    }
    aether_conformance::demo::run(&mut std::io::stdout());
}
