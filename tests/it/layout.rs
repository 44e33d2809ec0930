//! The house's structure, checked: where each status is made, what the domain may import, and
//! that the gRPC edge reaches the store only through the service.
use crate::helpers::repo_path;

/// Every `.rs` file under `src/<dir>`, with its text.
fn sources(dir: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![repo_path(&format!("src/{dir}"))];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read src").flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p).expect("read");
                out.push((p.display().to_string(), text));
            }
        }
    }
    assert!(!out.is_empty(), "no sources under src/{dir}");
    out
}

#[test]
fn every_grpc_status_comes_from_the_one_error_table() {
    let constructors = [
        "Status::new(",
        "Status::with_",
        "Status::not_found(",
        "Status::already_exists(",
        "Status::invalid_argument(",
        "Status::failed_precondition(",
        "Status::permission_denied(",
        "Status::unauthenticated(",
        "Status::resource_exhausted(",
        "Status::unavailable(",
        "Status::internal(",
        "Status::cancelled(",
        "Status::unimplemented(",
        "Status::deadline_exceeded(",
    ];
    for (path, text) in sources("") {
        if path.ends_with("src/grpc/status.rs") {
            continue;
        }
        for c in constructors {
            assert!(
                !text.contains(c),
                "{path} builds a status with {c}: map an Error instead"
            );
        }
    }
    let table = std::fs::read_to_string(repo_path("src/grpc/status.rs")).expect("status.rs");
    assert!(table.contains("impl From<Error> for Status"));
}

#[test]
fn the_domain_imports_no_grpc_or_sql_and_the_edge_no_store() {
    for (path, text) in sources("domain") {
        for c in ["tonic", "sea_orm", "sqlx", "crate::store", "crate::grpc"] {
            assert!(!text.contains(c), "{path} uses {c}");
        }
    }
    for (path, text) in sources("grpc") {
        // Types the store defines (Actor, time) are fine; calls on it go through the service.
        assert!(
            !text.contains("service.store") && !text.contains(".store."),
            "{path} calls the store"
        );
    }
}
