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

/// One table (src/reply.rs) says what each error tells a caller; the doors render it: no
/// door picks an HTTP status for an error, and only grpc/status.rs builds a stream item's error.
#[test]
fn every_reply_to_an_error_comes_from_the_one_table() {
    let error_statuses = [
        "StatusCode::BAD_REQUEST",
        "StatusCode::UNAUTHORIZED",
        "StatusCode::NOT_FOUND",
        "StatusCode::CONFLICT",
        "StatusCode::UNPROCESSABLE_ENTITY",
        "StatusCode::TOO_MANY_REQUESTS",
        "StatusCode::INTERNAL_SERVER_ERROR",
    ];
    for (path, text) in sources("ingress") {
        for c in error_statuses {
            assert!(
                !text.contains(c),
                "{path} answers an error with {c}: render crate::reply::Reply instead"
            );
        }
    }
    for (path, text) in sources("") {
        if path.ends_with("src/grpc/status.rs") {
            continue;
        }
        assert!(
            !text.contains("TriggerError {"),
            "{path} builds a stream item's error: use grpc::status::trigger_error"
        );
    }
    let table = std::fs::read_to_string(repo_path("src/reply.rs")).expect("reply.rs");
    assert!(table.contains("impl From<Error> for Reply"));
}

#[test]
fn the_domain_imports_no_grpc_or_sql_and_the_edge_no_store() {
    for (path, text) in sources("domain") {
        for c in ["tonic", "sea_orm", "sqlx", "crate::store", "crate::grpc"] {
            assert!(!text.contains(c), "{path} uses {c}");
        }
    }
    // The doors that adapt a protocol: gRPC's handlers, and the ingress listeners.
    let mut doors = sources("grpc");
    doors.extend(
        sources("ingress")
            .into_iter()
            .filter(|(path, _)| path.ends_with("/http.rs") || path.ends_with("/nats.rs")),
    );
    for (path, text) in doors {
        // Types the store defines (Actor, time) are fine; calls on it go through the service.
        if let Some(how) = store_call(&text) {
            panic!("{path} calls the store ({how}): give the service handle the read");
        }
    }
    // No handle hands its store out: a read a door needs is a method of the handle.
    for dir in ["service", "ingress"] {
        for (path, text) in sources(dir) {
            assert!(
                !text.contains("pub fn store(") && !text.contains("pub(crate) fn store("),
                "{path} hands its store out"
            );
        }
    }
}

/// How `text` reaches a store, if it does: a field (`.store.`) or an accessor (`.store()`,
/// `Policy::store(`). Whitespace is taken out first, so a call split across lines is seen too.
fn store_call(text: &str) -> Option<&'static str> {
    let text: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    ["service.store", ".store.", ".store()", "::store("]
        .into_iter()
        .find(|c| text.contains(c))
}

#[test]
fn a_handler_reading_the_store_through_an_accessor_is_caught() {
    let accessor = "let mut packs = self\n    .policy\n    .store()\n    .list_packs(after, 10)";
    assert_eq!(store_call(accessor), Some(".store()"));
    let field = "self.policy\n    .store\n    .list_packs(after, 10)";
    assert_eq!(store_call(field), Some(".store."));
    assert_eq!(store_call("Policy::store(&self.policy)"), Some("::store("));
    // An atomic's store, and a read through the handle, are not the store.
    assert_eq!(store_call("self.0.store(true, Ordering::SeqCst)"), None);
    assert_eq!(store_call("self.policy.list_packs(after, 10)"), None);
}

/// The store owns every SQL statement: no other layer names sea-orm or sqlx.
#[test]
fn only_the_store_speaks_sql() {
    for dir in ["service", "grpc", "domain"] {
        for (path, text) in sources(dir) {
            for c in ["sea_orm", "sqlx", "pg_notify", "LISTEN "] {
                assert!(
                    !text.contains(c),
                    "{path} uses {c}: SQL belongs in src/store/"
                );
            }
        }
    }
    for file in [
        "app.rs",
        "main.rs",
        "auth.rs",
        "config.rs",
        "metrics.rs",
        "telemetry.rs",
    ] {
        let text = std::fs::read_to_string(repo_path(&format!("src/{file}"))).expect("read");
        assert!(
            !text.contains("sea_orm") && !text.contains("sqlx"),
            "src/{file} speaks SQL"
        );
    }
}

/// A Rust runtime can depend on the wire contract (`hcp-sense-api`) without the server: the
/// crate's dependencies, followed through Cargo.lock, include no store and no hcp-sense.
#[test]
fn the_api_crate_carries_no_server_and_no_store() {
    let lock: toml::Table = std::fs::read_to_string(repo_path("Cargo.lock"))
        .expect("Cargo.lock")
        .parse()
        .expect("Cargo.lock parses");
    let packages = lock["package"].as_array().expect("packages");
    let deps_of = |name: &str| -> Vec<String> {
        packages
            .iter()
            .filter(|p| p["name"].as_str() == Some(name))
            .flat_map(|p| {
                p.get("dependencies")
                    .and_then(|d| d.as_array())
                    .cloned()
                    .unwrap_or_default()
            })
            .filter_map(|d| {
                d.as_str()
                    .map(|s| s.split(' ').next().unwrap_or_default().to_owned())
            })
            .collect()
    };
    let mut seen = std::collections::BTreeSet::new();
    let mut stack = vec!["hcp-sense-api".to_owned()];
    while let Some(name) = stack.pop() {
        if seen.insert(name.clone()) {
            stack.extend(deps_of(&name));
        }
    }
    assert!(seen.contains("tonic") && seen.contains("prost"), "{seen:?}");
    for forbidden in ["hcp-sense", "hcp-sense-migration", "sea-orm", "sqlx-core"] {
        assert!(
            !seen.contains(forbidden),
            "hcp-sense-api pulls in {forbidden}"
        );
    }
}
