//! Compiles ../proto with protox (no system protoc) into prost types, tonic clients and service traits, and a descriptor set for reflection.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../proto");
    println!("cargo:rerun-if-changed={}", root.display());
    let files = [
        "hcp/sense/v1/types.proto",
        "hcp/sense/v1/pack.proto",
        "hcp/sense/v1/policy.proto",
        "hcp/sense/v1/ingest.proto",
        "hcp/sense/v1/records.proto",
        "hcp/sense/v1/bench.proto",
        "hcp/sense/v1/audit.proto",
        "hcp/sense/v1/ingress.proto",
        "hcp/sense/v1/decisions.proto",
        "hcp/sense/v1/caller.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={}", root.join(f).display());
    }
    let mut compiler = protox::Compiler::new([&root])?;
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
        // A server decides how an undecodable request is answered (crate::codec).
        .codec_path("crate::codec::Codec")
        .compile_fds(compiler.file_descriptor_set())?;
    Ok(())
}
