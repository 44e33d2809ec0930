//! Compiles proto/ with protox (no system protoc) into tonic code, a descriptor set for reflection, and the benchmark's client.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/hcp/sense/v1/types.proto",
        "proto/hcp/sense/v1/pack.proto",
        "proto/hcp/sense/v1/policy.proto",
        "proto/hcp/sense/v1/ingest.proto",
        "proto/hcp/sense/v1/records.proto",
        "proto/hcp/sense/v1/bench.proto",
        "proto/hcp/sense/v1/audit.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    println!("cargo:rerun-if-changed=proto");
    let mut compiler = protox::Compiler::new(["proto"])?;
    compiler.include_imports(true).include_source_info(true);
    compiler.open_files(files)?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("hcp_sense_descriptor.bin"),
        compiler.encode_file_descriptor_set(),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Undecodable requests are INVALID_ARGUMENT naming the field (src/grpc/codec.rs).
        .codec_path("crate::grpc::codec::Codec")
        .compile_fds(compiler.file_descriptor_set())?;
    // A client-only copy with tonic's own codec for the benchmark binary, which reaches the
    // server through the public API alone and shares no code with the library.
    let client = out.join("client");
    std::fs::create_dir_all(&client)?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .out_dir(&client)
        .compile_fds(compiler.file_descriptor_set())?;
    Ok(())
}
