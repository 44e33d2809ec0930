//! The real `hcp-sense` binary and the real grpcurl and buf binaries, as users run them.
use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use crate::helpers::{repo_path, StoreKind, TestDb};
use crate::support::served::{Served, BIN};

/// Runs a command that must exist on PATH (installed by .ci/run); never skipped.
fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .current_dir(repo_path(""))
        .output()
        .unwrap_or_else(|e| panic!("`{program}` must be installed (see .ci/run): {e}"))
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

async fn grpcurl_session(kind: StoreKind) {
    let db = TestDb::create(kind).await;
    let served = Served::start(&db.url, &[]);
    let addr = served.addr.clone();
    let grpcurl = |args: &[&str]| {
        let mut a = vec!["-plaintext"];
        a.extend_from_slice(args);
        let o = run("grpcurl", &a);
        (o.status.success(), text(&o))
    };

    let (ok, out) = grpcurl(&[&addr, "list"]);
    assert!(ok, "{out}");
    // Exactly the services served: the benchmark baseline is not, without its flag.
    let mut listed: Vec<&str> = out.lines().collect();
    listed.sort_unstable();
    assert_eq!(
        listed,
        [
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
            "hcp.sense.v1.AuditService",
            "hcp.sense.v1.DecisionService",
            "hcp.sense.v1.IngestService",
            "hcp.sense.v1.IngressService",
            "hcp.sense.v1.PackService",
            "hcp.sense.v1.PolicyService",
            "hcp.sense.v1.RecordService",
        ]
    );
    // Every service listed can be described, through the reflection grpcurl speaks.
    for service in &listed {
        let (ok, out) = grpcurl(&[&addr, "describe", service]);
        assert!(ok && out.contains("is a service"), "{service}: {out}");
    }
    {
        let bench_db = TestDb::create(kind).await;
        let with_bench = Served::start(&bench_db.url, &["--bench-baseline", "true"]);
        let (ok, out) = grpcurl(&[&with_bench.addr, "list"]);
        assert!(ok, "{out}");
        assert!(
            out.lines().any(|l| l == "hcp.sense.v1.BenchService"),
            "{out}"
        );
    }
    let (ok, out) = grpcurl(&[&addr, "describe", "hcp.sense.v1.PackService"]);
    assert!(ok, "{out}");
    for rpc in [
        "RegisterPack",
        "LintPack",
        "GetPack",
        "ListPacks",
        "DeletePack",
    ] {
        assert!(
            out.contains(&format!("rpc {rpc}")),
            "{rpc} not described:\n{out}"
        );
    }
    let (ok, out) = grpcurl(&[&addr, "describe", "hcp.sense.v1.Pack"]);
    assert!(ok && out.contains("stimulus_triggers"), "{out}");

    let manifest =
        std::fs::read_to_string(repo_path("examples/github.pack.json")).expect("example");
    let body = format!("{{\"manifest\": {manifest}}}");
    let (ok, out) = grpcurl(&["-d", &body, &addr, "hcp.sense.v1.PackService/RegisterPack"]);
    assert!(ok, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("grpcurl prints JSON");
    assert_eq!(v["pack"]["packId"], "github");
    assert_eq!(v["created"], true);

    // A new Binding's log line says it had no state before; a changed one names the old.
    for state in ["BINDING_STATE_PENDING", "BINDING_STATE_LINKED"] {
        let body = format!(
            "{{\"principal\": \"alice\", \"pack_id\": \"github\", \"binding_id\": \"b-alice\", \"state\": \"{state}\"}}"
        );
        let (ok, out) = grpcurl(&["-d", &body, &addr, "hcp.sense.v1.PolicyService/PutBinding"]);
        assert!(ok, "{out}");
    }
    let stored: Vec<String> = served
        .log
        .lock()
        .map(|l| l.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|l| l.contains("binding stored"))
        .collect();
    assert_eq!(stored.len(), 2, "{stored:?}");
    assert!(stored[0].contains("previous=none"), "{stored:?}");
    assert!(stored[1].contains("previous=pending"), "{stored:?}");

    // A lint failure reaches grpcurl as INVALID_ARGUMENT with decodable details.
    let broken = std::fs::read_to_string(repo_path("examples/broken.pack.json")).expect("example");
    let (ok, out) = grpcurl(&[
        "-d",
        &format!("{{\"manifest\": {broken}}}"),
        &addr,
        "hcp.sense.v1.PackService/RegisterPack",
    ]);
    assert!(!ok);
    assert!(
        out.contains("InvalidArgument") && out.contains("s7_1_4"),
        "{out}"
    );
    assert!(
        out.contains("fieldViolations"),
        "details decoded through reflection:\n{out}"
    );

    let (ok, out) = grpcurl(&["-d", "{}", &addr, "hcp.sense.v1.PackService/ListPacks"]);
    assert!(
        ok && out.contains("\"github\"") && !out.contains("broken"),
        "{out}"
    );
    assert_eq!(
        crate::helpers::http_get(&format!("http://{}/readyz", served.metrics_addr)).trim(),
        "ready"
    );
    let (ok, out) = grpcurl(&[&addr, "grpc.health.v1.Health/Check"]);
    assert!(ok && out.contains("SERVING"), "{out}");

    assert!(served.terminate(), "SIGTERM exits 0");
}

on_both_stores!(grpcurl_lists_describes_and_registers => grpcurl_session);

#[test]
fn lint_command_reports_and_sets_the_exit_code() {
    let o = run(BIN, &["lint", "examples/broken.pack.json"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let out = text(&o);
    for rule in [
        "error[s7_1_2]",
        "error[s7_1_3]",
        "error[s7_1_4]",
        "error[s7_9_2]",
    ] {
        assert!(out.contains(rule), "{rule} missing:\n{out}");
    }
    let o = run(BIN, &["lint", "examples/github.pack.json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let o = run(BIN, &["lint", "examples/weather.pack.yaml"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("weather: 0 error(s), 0 warning(s)"));
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("warn.yaml");
    std::fs::write(&p, "id: crm\nstimulusTriggers: [{ref: deal.won}]\npolicy: {stimuli: [{ref: deal.won, operation: read, land: user}]}\nbinding: {mode: user, hub: crm}\n").expect("write");
    let o = run(BIN, &["lint", p.to_str().expect("path")]);
    assert_eq!(o.status.code(), Some(0), "warnings alone pass");
    assert!(text(&o).contains("warning[s7_7_1]"), "{}", text(&o));
}

#[tokio::test]
async fn migrate_command_and_serve_without_migrations() {
    let db = TestDb::create(StoreKind::Sqlite).await;
    let o = run(BIN, &["migrate", "status", "--database-url", &db.url]);
    assert!(
        o.status.success() && text(&o).contains("pending\tm20261130_000001_init"),
        "{}",
        text(&o)
    );
    // Refuses to serve an unmigrated database when told not to migrate.
    let o = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            &db.url,
            "--migrate",
            "false",
        ])
        .output()
        .expect("run");
    assert!(!o.status.success());
    assert!(text(&o).contains("migrate up"), "{}", text(&o));
    let o = run(BIN, &["migrate", "up", "--database-url", &db.url]);
    assert!(
        o.status.success() && text(&o).contains("applied\tm20261130_000001_init"),
        "{}",
        text(&o)
    );
    let served = Served::start(&db.url, &["--migrate", "false"]);
    assert!(served.terminate());
}

#[tokio::test]
async fn config_file_env_and_flags_layer() {
    let db = TestDb::create(StoreKind::Sqlite).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("hcp-sense.toml");
    // The file asks for a port that the flag overrides; the database comes from the environment.
    std::fs::write(&cfg, "listen = \"127.0.0.1:1\"\nlog_format = \"json\"\n").expect("write");
    let mut child = Command::new(BIN)
        .args([
            "--config",
            cfg.to_str().expect("path"),
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .env("HCP_SENSE_DATABASE_URL", &db.url)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .spawn()
        .expect("start");
    let stdout = child.stdout.take().expect("stdout");
    let line = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find(|l| l.contains("hcp-sense listening"))
        .expect("listening line");
    let _ = child.kill();
    let _ = child.wait();
    let v: serde_json::Value = serde_json::from_str(&line).expect("json log line");
    assert!(
        v["addr"]
            .as_str()
            .is_some_and(|a| a.starts_with("127.0.0.1:") && a != "127.0.0.1:1"),
        "{line}"
    );
    // check-config judges a file as serve would, naming the key, and starts nothing.
    let path = cfg.to_str().expect("path");
    let check = run(BIN, &["check-config", "--config", path]);
    assert!(check.status.success(), "{}", text(&check));
    std::fs::write(
        &cfg,
        "listen = \"127.0.0.1:1\"\nmax_json_depth = \"deep\"\n",
    )
    .expect("write");
    let check = run(BIN, &["check-config", "--config", path]);
    assert_eq!(check.status.code(), Some(1), "{}", text(&check));
    assert!(
        text(&check).contains("`max_json_depth`"),
        "{}",
        text(&check)
    );
    let flag = run(
        BIN,
        &["check-config", "--config", path, "--max-json-depth", "8"],
    );
    assert!(
        !flag.status.success(),
        "a bad file value is refused even under a flag"
    );
}

#[test]
fn help_documents_every_option() {
    let out = text(&run(BIN, &["serve", "--help"]));
    for opt in [
        "--config",
        "--listen",
        "--database-url",
        "--db-max-connections",
        "--migrate",
        "--log-format",
        "--shutdown-grace-secs",
        "HCP_SENSE_LISTEN",
        "HCP_SENSE_DATABASE_URL",
        "DATABASE_URL",
    ] {
        assert!(out.contains(opt), "{opt} undocumented:\n{out}");
    }
    let out = text(&run(BIN, &["--help"]));
    for cmd in ["serve", "migrate", "lint"] {
        assert!(out.contains(cmd), "{cmd}:\n{out}");
    }
}

/// The options table in docs/running.md names every option of `serve --help` with the default
/// the binary really uses: a default is declared once, in the code, and the docs keep up.
#[test]
fn the_docs_name_every_option_with_its_real_default() {
    let help = String::from_utf8(run(BIN, &["serve", "--help"]).stdout).expect("utf-8");
    let docs = std::fs::read_to_string(repo_path("docs/running.md")).expect("docs/running.md");
    let mut checked = 0;
    let mut option: Option<String> = None;
    for line in help.lines() {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("--").or_else(|| t.strip_prefix("-h, --")) {
            let name = rest.split([' ', '=']).next().unwrap_or_default();
            option = Some(format!("`--{name}`")).filter(|_| !matches!(name, "help" | "version"));
            if let Some(o) = &option {
                assert!(
                    docs.contains(o.as_str()),
                    "docs/running.md does not name {o}"
                );
                checked += 1;
            }
        } else if let (Some(o), Some(default)) = (&option, t.strip_prefix("[default: ")) {
            let default = format!("`{}`", default.trim_end_matches(']'));
            let row = docs
                .lines()
                // The option's own row: the one whose first cell names it (others may mention it).
                .find(|l| {
                    l.starts_with('|')
                        && l.split('|').nth(1).is_some_and(|c| c.contains(o.as_str()))
                })
                .unwrap_or_else(|| panic!("no table row for {o}"));
            assert!(
                row.contains(&default),
                "{o}: --help says {default}, docs say: {row}"
            );
        }
    }
    assert!(checked >= 35, "only {checked} options in --help:\n{help}");
}

#[test]
fn protos_are_buf_lint_clean() {
    let o = run("buf", &["lint"]);
    assert!(o.status.success(), "buf lint:\n{}", text(&o));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_grpcio_client_runs_the_sense_flow() {
    let db = TestDb::create(StoreKind::Sqlite).await;
    let served = Served::start(&db.url, &[]);
    let proto = repo_path("proto");
    let o = run(
        "python3",
        &[
            "tests/python/sense_flow.py",
            &served.addr,
            proto.to_str().expect("path"),
        ],
    );
    assert!(o.status.success(), "python client:\n{}", text(&o));
    assert!(text(&o).contains("python flow ok"), "{}", text(&o));
}

/// The `sh` blocks of the "Walkthrough" sections of the README, then of `docs/*.md` in name
/// order.
fn walkthrough_blocks() -> Vec<String> {
    let mut docs: Vec<_> = std::fs::read_dir(repo_path("docs"))
        .expect("docs/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    let mut text = std::fs::read_to_string(repo_path("README.md")).expect("README");
    for d in docs {
        text.push('\n');
        text.push_str(&std::fs::read_to_string(d).expect("doc"));
    }
    let (mut blocks, mut in_walkthrough, mut block) = (Vec::new(), false, None::<String>);
    for line in text.lines() {
        match &mut block {
            Some(b) if line.trim_end() == "```" => {
                blocks.push(std::mem::take(b));
                block = None;
            }
            Some(b) => {
                b.push_str(line);
                b.push('\n');
            }
            // A file's title or a section ends a walkthrough.
            None if line.starts_with("# ") || line.starts_with("## ") => {
                in_walkthrough = line.starts_with("## Walkthrough")
            }
            None if in_walkthrough && line.trim_end() == "```sh" => block = Some(String::new()),
            None => {}
        }
    }
    blocks
}

/// The README's walkthroughs, run verbatim against `hcp-sense` started as
/// `cargo run` starts it: no options, 127.0.0.1:50051, ./hcp-sense.db in a fresh directory.
#[test]
fn readme_walkthroughs_run_verbatim() {
    let blocks = walkthrough_blocks();
    assert!(
        blocks.len() >= 2,
        "walkthrough blocks found: {}",
        blocks.len()
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(BIN);
    cmd.current_dir(dir.path());
    let served = Served::spawn(cmd);
    assert_eq!(served.addr, "127.0.0.1:50051", "the default address");
    let mut out = String::new();
    for block in &blocks {
        let o = Command::new("bash")
            .args(["-euo", "pipefail", "-c", block])
            .env("HCP_SENSE", BIN)
            .current_dir(repo_path(""))
            .output()
            .expect("bash");
        out.push_str(&text(&o));
        assert!(
            o.status.success(),
            "walkthrough block failed:\n{block}\n---\n{}",
            text(&o)
        );
    }
    for want in [
        "hcp.sense.v1.IngestService",
        "\"disposition\": \"DISPOSITION_RECORDED_INBOX\"",
        "\"title\": \"Crash on start\"",
        "\"title\": \"Watched\"",
        "\"resumeToken\"",
        "\"bindingId\": \"gh-alice\"",
        "\"dropReason\": \"DROP_REASON_UNDECLARED_REF\"",
        "\"ref\": \"issue.deleted\"",
        "\"execute\": {",
        "s7_1_4",
        "\"packId\": \"weather\"",
        "SERVING",
        "\"duplicate\":true,\"principal\":\"alice\"",
        "forged: 401",
        // GitHub signs the body alone: its digest is the trigger id.
        "\"trigger_id\":\"sha256:1de5fdc540b71e1bb3d8557c3025acec33882eabb0086fcd737c49fa56cc842d\"",
        // The retry is answered from the ingress ledger, not decided again.
        "pack=\"weather\",ingress=\"standard_webhooks\"} 1",
        "hcp_sense_ingress_replayed_total{ingress=\"standard_webhooks\"} 1",
        "\"replay\":true",
        "\"trigger_id\":\"/sensors/7#1001\"",
        "7 lines: 4 recorded, 1 dropped, 2 refused",
        "\"triggerId\": \"nats-walkthrough-1\"",
        "\"dropReason\": \"DROP_REASON_ACTIVATION_OFF\"",
        "\"source\": \"principal\"",
        "decision: dropped: activation_off",
        "[FAIL] activation",
        "\"dropReason\": \"DROP_REASON_FILTERED\"",
        "uses a comprehension",
        "\"erasedCount\": \"3\"",
        "erased_records",
        "Code: ResourceExhausted",
        "is spent: nothing was recorded",
        // `admits: false` is proto3 JSON's default, left out.
        "\"burst\":2},\"retryDelay\":\"",
        "{\"ref\":\"ticket.created\",\"description\":\"A ticket was opened in the tracker.\",\"receivability\":{\"principal\":\"alice\",\"dropReasons\":[\"no_grant\",\"activation_off\"]}}",
        "payload/priority",
        "fails `pattern` of the payload schema of `ticket.created` at `/key`",
        // The MCP door, with the Python SDK's client.
        "protocol 2026-07-28",
        "heard ResourceUpdated hcp-sense://records",
        "inbox ['github issue.opened']",
        "record alice Seen over MCP",
        "decided DECISION_OUTCOME_INBOX by route",
    ] {
        assert!(
            out.contains(want),
            "{want} not in the walkthrough's output:\n{out}"
        );
    }
    assert!(
        dir.path().join("hcp-sense.db").exists(),
        "the embedded default store"
    );
    assert!(served.terminate());
}

pub async fn connect(addr: &str) -> tonic::transport::Channel {
    tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect")
}

/// Registers the public `weather` pack, grants alice and switches Sense on pack-wide.
pub async fn set_up_weather(ch: &tonic::transport::Channel) {
    set_up_public_pack(ch, "weather.pack.yaml", "weather").await
}

/// Registers the public pack `pack_id` of examples/`file`, grants alice and switches Sense on
/// pack-wide.
pub async fn set_up_public_pack(ch: &tonic::transport::Channel, file: &str, pack_id: &str) {
    use hcp_sense::grpc::pb;
    pb::pack_service_client::PackServiceClient::new(ch.clone())
        .register_pack(crate::packs::register_req(&crate::helpers::example(file)))
        .await
        .expect("register");
    let mut policy = pb::policy_service_client::PolicyServiceClient::new(ch.clone());
    policy
        .grant_sense_enable(pb::GrantSenseEnableRequest {
            principal: "alice".into(),
            pack_id: pack_id.into(),
        })
        .await
        .expect("grant");
    policy
        .activate_sense(pb::ActivateSenseRequest {
            principal: String::new(),
            pack_id: pack_id.into(),
            route: 1,
            filter: String::new(),
        })
        .await
        .expect("activate");
}

pub fn storm_warning(trigger_id: String) -> hcp_sense::grpc::pb::DeliverTriggerRequest {
    hcp_sense::grpc::pb::DeliverTriggerRequest {
        trigger_id,
        ..crate::support::trigger::trigger("weather", "storm.warning", "alice", "user")
    }
}

/// SIGTERM under load: calls in flight are answered, the open batch commits, and the process
/// exits 0 within the configured grace period with every acknowledged record stored.
async fn sigterm_under_load(kind: StoreKind) {
    use hcp_sense::grpc::pb::ingest_service_client::IngestServiceClient;
    let db = TestDb::create(kind).await;
    let served = Served::start(&db.url, &["--shutdown-grace-secs", "3"]);
    let addr = served.addr.clone();
    let ch = connect(&addr).await;
    set_up_weather(&ch).await;
    let mut tasks = Vec::new();
    for w in 0..8 {
        let mut ingest = IngestServiceClient::new(ch.clone());
        tasks.push(tokio::spawn(async move {
            let mut acked = Vec::new();
            for i in 0.. {
                let trigger_id = format!("w{w}-{i}");
                match ingest
                    .deliver_trigger(storm_warning(trigger_id.clone()))
                    .await
                {
                    Ok(r) => acked.push((trigger_id, r.into_inner().record_id)),
                    Err(s) => return (acked, s),
                }
            }
            unreachable!("the loop ends with the server")
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (exited_cleanly, took) = tokio::task::spawn_blocking(move || served.terminate_timed())
        .await
        .expect("join");
    assert!(exited_cleanly, "SIGTERM exits 0");
    assert!(
        took < Duration::from_secs(3),
        "exit took {took:?}, over the 3 s grace period"
    );
    eprintln!("exited {took:?} after SIGTERM");
    let mut acked = Vec::new();
    for t in tasks {
        // Each worker ends at its first refused call: one the server never took (the
        // connection closing, or a stream past its GOAWAY), never an acknowledged one.
        let (a, _refused) = t.await.expect("task");
        acked.extend(a);
    }
    assert!(!acked.is_empty());
    let conn = db.connect().await;
    use sea_orm::EntityTrait;
    let stored: std::collections::HashMap<String, String> =
        hcp_sense::store::entity::records::Entity::find()
            .all(&conn)
            .await
            .expect("records")
            .into_iter()
            .filter_map(|r| Some((r.producer_trigger_id?, r.record_id)))
            .collect();
    for (trigger_id, record_id) in &acked {
        assert_eq!(
            stored.get(trigger_id),
            Some(record_id),
            "acknowledged trigger {trigger_id} was lost at shutdown"
        );
    }
}

on_both_stores!(sigterm_under_load_loses_no_acknowledged_record => sigterm_under_load);

async fn kill_9_five_times(kind: StoreKind) {
    use hcp_sense::grpc::pb::ingest_service_client::IngestServiceClient;
    let db = TestDb::create(kind).await;
    let mut acked: Vec<(String, String)> = Vec::new();
    for round in 0..5 {
        let mut served = Served::start(&db.url, &[]);
        let ch = connect(&served.addr).await;
        if round == 0 {
            set_up_weather(&ch).await;
        }
        let mut tasks = Vec::new();
        for w in 0..8 {
            let mut ingest = IngestServiceClient::new(ch.clone());
            tasks.push(tokio::spawn(async move {
                let mut out = Vec::new();
                for i in 0.. {
                    let trigger_id = format!("r{round}-w{w}-{i}");
                    let r = ingest
                        .deliver_trigger(storm_warning(trigger_id.clone()))
                        .await;
                    match r {
                        Ok(r) => out.push((trigger_id, r.into_inner().record_id)),
                        Err(_) => break,
                    }
                }
                out
            }));
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
        served.kill9();
        for t in tasks {
            acked.extend(t.await.expect("task"));
        }
    }
    assert!(acked.len() > 50, "only {} acknowledged", acked.len());
    let conn = db.connect().await;
    use sea_orm::EntityTrait;
    let rows = hcp_sense::store::entity::records::Entity::find()
        .all(&conn)
        .await
        .expect("records");
    for (trigger_id, record_id) in &acked {
        let matching: Vec<_> = rows
            .iter()
            .filter(|r| r.producer_trigger_id.as_deref() == Some(trigger_id))
            .collect();
        assert_eq!(
            matching.len(),
            1,
            "trigger {trigger_id} is stored exactly once"
        );
        assert_eq!(
            &matching[0].record_id, record_id,
            "under the acknowledged record id"
        );
    }
}

on_both_stores!(kill_9_under_load_keeps_every_acknowledged_record => kill_9_five_times);
