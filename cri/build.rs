//! The CRI v1 messages and the RuntimeService client, generated from proto/runtime_v1.proto
//! with protoc (PATH, or $PROTOC).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/runtime_v1.proto");
    tonic_prost_build::configure()
        .build_server(false)
        .build_transport(false)
        .compile_protos(&["proto/runtime_v1.proto"], &["proto"])?;
    Ok(())
}
