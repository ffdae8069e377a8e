//! The CRI v1 messages and the RuntimeService client, generated from proto/runtime_v1.proto
//! with protoc (PATH, or $PROTOC). With the `fake` feature (tests only) the server side too,
//! for the tests' fake runtime; the shipped binary never enables it.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/runtime_v1.proto");
    let fake = std::env::var_os("CARGO_FEATURE_FAKE").is_some();
    tonic_prost_build::configure()
        .build_server(fake)
        .build_transport(false)
        .compile_protos(&["proto/runtime_v1.proto"], &["proto"])?;
    Ok(())
}
