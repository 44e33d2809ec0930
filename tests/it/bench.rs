//! The benchmark binary: a client of the public gRPC API that runs every phase and reports JSON.
use std::process::Command;

use serde_json::{json, Value};

use crate::helpers::repo_path;

const BENCH: &str = env!("CARGO_BIN_EXE_hcp-sense-bench");

#[test]
fn the_benchmark_reaches_the_server_only_through_its_public_api() {
    let dir = repo_path("src/bin/hcp-sense-bench");
    let mut files = 0;
    let mut uses_the_api_crate = false;
    for entry in std::fs::read_dir(&dir).expect("bench sources") {
        let path = entry.expect("entry").path();
        let text = std::fs::read_to_string(&path).expect("read");
        files += 1;
        // The wire contract's crate is the one way in; nothing of the server's library.
        uses_the_api_crate |= text.contains("hcp_sense_api::v1");
        let text = text.replace("hcp_sense_api::", "");
        // The library's paths, as code uses them (the server's log target is a string).
        for forbidden in [
            "use hcp_sense",
            " hcp_sense::",
            "(hcp_sense::",
            "crate::store",
            "crate::grpc",
            "crate::domain",
        ] {
            assert!(
                !text.contains(forbidden),
                "{} uses {forbidden}",
                path.display()
            );
        }
    }
    assert!(
        uses_the_api_crate,
        "the benchmark's client comes from hcp-sense-api"
    );
    assert!(
        files >= 5,
        "the benchmark's modules are in {}",
        dir.display()
    );
}

/// Every phase at a small size on both stores: the JSON names each, and nothing failed.
#[test]
fn the_benchmark_runs_every_phase_as_a_client_and_writes_json() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("bench.json");
    let out = Command::new(BENCH)
        .args([
            "--duration-secs",
            "1",
            "--concurrency",
            "4,8",
            "--channels",
            "2",
            "--packs",
            "2",
            "--principals",
            "20",
            "--api-seed-limit",
            "20",
            "--scaling",
            "10,21",
            "--telemetry",
            "true",
            "--list-records",
            "2500",
            "--scale-records",
            "3000",
            "--retention-records",
            "500",
            "--writers-compare",
            "1,2",
            "--stream-in-flight",
            "16",
            "--watch-rate",
            "200",
            "--watch-idle",
            "50",
            "--flood-callers",
            "16",
            "--decision-entries",
            "5000",
            "--json",
            json.to_str().expect("path"),
        ])
        .env("TMPDIR", dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run hcp-sense-bench");
    let pid = out.id();
    let out = out.wait_with_output().expect("wait");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // 20 principals through the admin API; 21 (over --api-seed-limit) through the bulk path.
    assert!(stdout.contains("seeded 20 principals on 2 packs through the admin API"));
    assert!(stdout.contains("seeded 21 principals through the bulk path"));
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("parse");
    let results = report["results"].as_array().expect("results");
    let find = |store: &str, phase: &str| -> &Value {
        results
            .iter()
            .find(|r| r["store"] == store && r["phase"] == phase)
            .unwrap_or_else(|| panic!("no {store} {phase} in {report}"))
    };
    let check = results
        .iter()
        .find(|r| r["phase"] == "schema check")
        .unwrap_or_else(|| panic!("no schema check in {report}"));
    assert!(check["check_us"].as_f64() > Some(0.0), "{check}");
    // The cold check and the floor it is read against.
    assert!(check["cold_check_us"].as_f64() > Some(0.0), "{check}");
    assert!(check["cold_empty_check_us"].as_f64() > Some(0.0), "{check}");
    // The cost phase: every kind of call answered, each beside its floors and the store's own.
    let cost = |store: &str, call: &str| -> &Value {
        results
            .iter()
            .find(|r| r["store"] == store && r["phase"] == "cost" && r["call"] == call)
            .unwrap_or_else(|| panic!("no {store} cost of {call} in {report}"))
    };
    for store in ["sqlite", "postgres"] {
        for call in [
            "Health/Check (the transport's floor)",
            "no-op DeliverTrigger (the message's floor)",
            "recorded, no trigger id",
            "recorded, a new trigger id each call",
            "the same trigger id every call",
            "dropped (undeclared ref)",
        ] {
            let row = cost(store, call);
            assert_eq!(row["errors"], 0, "{row}");
            assert!(row["server_us"].as_f64() > Some(0.0), "{row}");
        }
    }
    let floor = cost("sqlite", "prepared single-row insert (SQLite alone)");
    assert_eq!(floor["errors"], 0, "{floor}");
    assert!(floor["client_us"].as_f64() > Some(0.0), "{floor}");
    let floor = cost("postgres", "prepared single-row insert (PostgreSQL alone)");
    assert_eq!(floor["errors"], 0, "{floor}");
    assert!(floor["postgres_us"].as_f64() > Some(0.0), "{floor}");
    let lookup = find("postgres", "decisions-lookup");
    assert_eq!(lookup["errors"], 0, "{lookup}");
    assert!(lookup["get_p99_ms"].as_f64() > Some(0.0), "{lookup}");
    for store in ["sqlite", "postgres"] {
        assert!(find(store, "store limit")["rows_per_sec"].as_f64() > Some(0.0));
        for c in [4, 8] {
            for phase in [
                format!("baseline (no-op), C={c}"),
                format!("recorded, C={c}"),
            ] {
                let r = find(store, &phase);
                assert_eq!(r["errors"], 0, "{store} {phase}: {r}");
                assert!(r["calls_per_sec"].as_f64() > Some(0.0), "{r}");
            }
        }
        // Every acknowledged record reached the watcher; idle watches were opened.
        let w = find(store, "watch");
        assert_eq!(w["missing"], 0, "{w}");
        assert!(w["records"].as_u64() > Some(0), "{w}");
        assert!(w["p99_ms"].as_f64().is_some(), "{w}");
        // The decision log: on against off, measured, and its account exact.
        for load in ["recorded, 1000/s", "dropped, 1000/s", "recorded, C=8"] {
            let d = results
                .iter()
                .find(|r| r["store"] == store && r["phase"] == "decisions" && r["load"] == load)
                .unwrap_or_else(|| panic!("no {store} decisions at {load} in {report}"));
            assert_eq!(d["errors"], 0, "{d}");
            assert!(d["on_server_cpu_us"].as_f64() > Some(0.0), "{d}");
            assert!(d["off_server_cpu_us"].as_f64() > Some(0.0), "{d}");
        }
        let a = find(store, "decisions-account");
        assert_eq!(a["logged_inbox"], a["answered_inbox"], "{a}");
        assert_eq!(a["logged_dropped"], a["answered_dropped"], "{a}");
        assert!(a["answered_dropped"].as_i64() > Some(0), "{a}");
        for log in ["on", "off"] {
            let f = results
                .iter()
                .find(|r| r["store"] == store && r["phase"] == "decisions-flood" && r["log"] == log)
                .unwrap_or_else(|| panic!("no {store} decisions-flood {log} in {report}"));
            assert_eq!(f["errors"], 0, "{f}");
        }
        assert!(find(store, "idle watchers")["idle_rss_mib"]
            .as_f64()
            .is_some());
        // Dropped triggers are answered, not errors.
        assert_eq!(find(store, "dropped, C=4")["errors"], 0);
        let streamed = find(store, "DeliverTriggers, 2 streams");
        assert_eq!(streamed["errors"], 0, "{streamed}");
        assert!(streamed["calls_per_sec"].as_f64() > Some(0.0));
        assert!(find(store, "peak")["ratio"].as_f64() > Some(0.0));
        // Where the CPU went: the server worked for every recorded call.
        let cpu = find(store, "cpu");
        assert!(
            cpu["recorded_us_per_call"]["server"].as_f64() > Some(0.0),
            "{cpu}"
        );
        assert!(
            cpu["noop_us_per_call"]["client"].as_f64() > Some(0.0),
            "{cpu}"
        );
        // The filter phase, at full load and at a steady rate: filtered and unfiltered phases
        // both recorded, with the server's decision time and CPU per call read for each.
        // The schema phase likewise, with and without a typical payload schema.
        for (name, load, kinds) in [
            ("filter", "C=4", ["no filter", "filtered"]),
            ("filter", "1000/s", ["no filter", "filtered"]),
            ("schema", "C=4", ["no schema", "schema"]),
            ("schema", "1000/s", ["no schema", "schema"]),
        ] {
            let r = results
                .iter()
                .find(|r| r["store"] == store && r["phase"] == name && r["load"] == load)
                .unwrap_or_else(|| panic!("no {store} {name} phase at {load} in {report}"));
            for k in [
                "plain_per_s",
                "filtered_per_s",
                "plain_decision_us",
                "filtered_decision_us",
                "plain_server_cpu_us",
                "filtered_server_cpu_us",
            ] {
                assert!(r[k].as_f64() > Some(0.0), "{store} {load} {k}: {r}");
            }
            // Four pairs of adjacent A and B phases, their changes summarised.
            assert_eq!(r["pairs"], 4, "{r}");
            for k in [
                "pair_change_mean",
                "pair_change_standard_error",
                "pair_change_median",
            ] {
                assert!(
                    r[k].as_f64().is_some_and(f64::is_finite),
                    "{store} {load} {k}: {r}"
                );
            }
            for kind in kinds {
                let phase = find(store, &format!("recorded, {load}, {kind}"));
                assert_eq!(phase["errors"], 0, "{store} {load} {kind}: {phase}");
            }
        }
        // The hostile phase: the costliest pattern lint accepts found by bisection (far below
        // what the size limit alone let in), its worst payload refused or shed, never
        // recorded, and Health and the quiet pack answered throughout.
        let h = find(store, "hostile");
        let n = h["pattern_repeat"].as_u64().unwrap_or(0);
        assert!(n > 0 && n < 100, "{h}");
        assert_eq!(
            (&h["health_errors"], &h["quiet_errors"]),
            (&json!(0), &json!(0)),
            "{h}"
        );
        assert!(
            h["health_p99_ms"].as_f64().is_some_and(f64::is_finite),
            "{h}"
        );
        assert!(
            h["quiet_p99_ms"].as_f64().is_some_and(f64::is_finite),
            "{h}"
        );
        let codes = h["hostile_codes"].as_object().expect("codes");
        assert!(!codes.is_empty(), "{h}");
        assert!(
            codes
                .keys()
                .all(|c| c == "InvalidArgument" || c == "Unavailable"),
            "{h}"
        );
        // The flood phase: the quiet pack and Health measured beside a flood, the flood's rate
        // alone and beside it, and every pack of the spread recorded.
        let f = find(store, "flood");
        assert_eq!(f["errors"], 0, "{f}");
        assert_eq!(f["quiet_errors"], 0, "{f}");
        for k in [
            "calm_quiet_p50_ms",
            "quiet_p50_ms",
            "quiet_p99_ms",
            "health_p99_ms",
            "flood_alone_per_sec",
            "flood_beside_quiet_per_sec",
            "spread_share_min",
            // Where the quiet pack's time goes: the same call to the no-op, the sink's batches.
            "quiet_noop_p50_ms",
            "batch_records_mean",
            "commit_ms_mean",
            // The transport's answer alone, the floor under a refusal and a drop.
            "noop_per_sec",
            "noop_server_cpu_us",
        ] {
            assert!(f[k].as_f64() > Some(0.0), "{store} flood {k}: {f}");
        }
        assert_eq!(f["noop_errors"].as_f64(), Some(0.0), "{f}");
        assert!(f["quiet_queue_wait_ms"].as_f64().is_some(), "{f}");
        assert_eq!(f["spread_packs"], 2, "{f}");
        // With a quota on the flooding pack: refusals carried RetryInfo, and the server
        // recorded exactly what it answered as recorded and dropped none of pack 0.
        for k in [
            "refused_per_sec",
            "dropped_per_sec",
            "quota_recorded_per_sec",
            "quota_refused_per_sec",
        ] {
            assert!(f[k].as_f64() > Some(0.0), "{store} flood {k}: {f}");
        }
        assert_eq!(f["quota_counted_dropped"], 0.0, "{f}");
        assert_eq!(
            f["quota_counted_recorded"].as_f64(),
            f["quota_answered_recorded"].as_f64(),
            "{f}"
        );
        if store == "postgres" {
            // Two replicas: the quiet pack measured on the flooded one and on the other.
            let r = find(store, "flood replicas");
            assert_eq!(r["errors"], 0, "{r}");
            assert_eq!(r["quiet_errors"], 0, "{r}");
            for k in [
                "flooded_quiet_p99_ms",
                "other_quiet_p99_ms",
                "other_health_p99_ms",
                "flood_per_sec",
            ] {
                assert!(r[k].as_f64() > Some(0.0), "{k}: {r}");
            }
        }
        // Reached by paging 2,000 records down, a page of 100 is still full.
        for page in ["ListRecords first page", "ListRecords deep page"] {
            let r = find(store, page);
            assert_eq!(r["errors"], 0, "{store} {page}: {r}");
        }
    }
    for phase in [
        "recorded, 10 principals",
        "recorded, 21 principals",
        "recorded, telemetry on",
        "recorded while pruning",
    ] {
        assert_eq!(find("sqlite", phase)["errors"], 0, "{phase}");
    }
    let writers = results
        .iter()
        .find(|r| r["phase"] == "writers compare")
        .expect("writers compare");
    assert_eq!(writers["rates"].as_array().map(Vec::len), Some(2));
    let retention = results
        .iter()
        .find(|r| r["phase"] == "retention")
        .expect("retention");
    assert_eq!(retention["expired_seeded"], 500);
    assert!(
        retention["expired_left"].as_i64() < Some(500),
        "{retention}"
    );
    // The README's tables come from the JSON file.
    let md = Command::new(BENCH)
        .args(["--markdown", json.to_str().expect("path")])
        .output()
        .expect("markdown");
    let md = String::from_utf8_lossy(&md.stdout);
    assert!(
        md.contains("| callers | SQLite no-op/s | SQLite recorded/s |"),
        "{md}"
    );
    for c in ["| 4 |", "| 8 |", "| PostgreSQL |", "2 writer(s)"] {
        assert!(md.contains(c), "{c} in {md}");
    }
    // The benchmark dropped the PostgreSQL databases it made.
    let pid_prefix = format!("hcp_sense_bench_{pid}_");
    let left = Command::new("psql")
        .args([
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
            "-Atc",
            &format!("SELECT count(*) FROM pg_database WHERE datname LIKE '{pid_prefix}%'"),
        ])
        .output()
        .expect("psql");
    assert_eq!(String::from_utf8_lossy(&left.stdout).trim(), "0");
}
