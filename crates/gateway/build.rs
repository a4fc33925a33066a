//! Compiles Envoy's ext_proc v3 service (`proto/`, vendored from Envoy's API) into Rust,
//! with protox (a protobuf compiler in Rust: no `protoc` on the build machine).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let service = "envoy/service/ext_proc/v3/external_processor.proto";
    println!("cargo:rerun-if-changed=proto");
    let mut files = protox::compile([service], ["proto"])?;
    // Envoy's comments are reStructuredText: rustdoc would run their indented blocks as
    // doctests. Without source info no comment is generated; the .proto files are the
    // documentation.
    for file in &mut files.file {
        file.source_code_info = None;
    }
    tonic_prost_build::configure()
        .build_server(true)
        // The tests drive the server with a real tonic client too.
        .build_client(true)
        .build_transport(false)
        .compile_fds(files)?;
    Ok(())
}
