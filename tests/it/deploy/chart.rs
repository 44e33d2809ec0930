//! The Helm chart and the image.
use super::*;

/// The Helm chart renders with Helm's own library, lints, and every object validates against
/// Kubernetes' schemas (tests/helm/check_chart.py: the ingress listener and NATS on and off,
/// their ports, Services, NetworkPolicy rules and Secret references, and values of a wrong type
/// refused); the configuration it renders starts the real binary, with the ingress listener
/// and NATS as the chart passes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_chart_renders_validates_and_its_config_starts_the_server() {
    let out = tempfile::tempdir().expect("tempdir");
    let o = Command::new("python3")
        .arg(repo_path("tests/helm/check_chart.py"))
        .arg("--emit-config")
        .arg(out.path())
        .arg("--binary")
        .arg(crate::support::served::BIN)
        .output()
        .expect("python3 with helm-python-sdk and kubernetes-validate (see .ci/run)");
    assert!(
        o.status.success(),
        "check_chart.py failed:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let db = TestDb::create(StoreKind::Postgres).await;
    let config = out.path().join("config-default.toml");
    // Authentication as the chart supplies it: the [auth] table in a file of its own.
    let token = "chart-admin-token";
    let auth = out.path().join("auth.toml");
    std::fs::write(
        &auth,
        format!(
            "[[auth.tokens]]\nname = \"ops\"\nsha256 = \"{}\"\nrole = \"admin\"\n",
            hex::encode(<sha2::Sha256 as sha2::Digest>::digest(token))
        ),
    )
    .expect("auth.toml");
    // As the chart's hook Job runs it, before any server: `migrate up` with the URL from the
    // environment; the servers then start with the rendered `migrate = false`.
    let job = Command::new(crate::support::served::BIN)
        .args(["migrate", "up"])
        .env_remove("DATABASE_URL")
        .env("HCP_SENSE_DATABASE_URL", &db.url)
        .env("HCP_SENSE_LOG_FORMAT", "json")
        .output()
        .expect("migrate up");
    let job_out = String::from_utf8_lossy(&job.stdout);
    assert!(job.status.success(), "migrate up: {job_out}");
    // One stream of JSON lines, the migrations' states among them.
    let events: Vec<serde_json::Value> = job_out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let applied = events
        .iter()
        .filter(|e| e.to_string().contains("\"state\":\"applied\""))
        .count();
    assert!(applied >= 2, "{job_out}");
    let mut cmd = Command::new(crate::support::served::BIN);
    cmd.arg("serve")
        .arg("--config")
        .arg(&config)
        // The rendered config binds every interface; here it stays on loopback.
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .env("HCP_SENSE_DATABASE_URL", &db.url)
        .env("HCP_SENSE_AUTH_FILE", &auth);
    let served = Served::spawn(cmd);
    let ch = connect(&served.addr).await;
    assert_eq!(health(&ch).await, Some(ServingStatus::Serving));
    let live = HealthClient::new(ch.clone())
        .check(tonic_health::pb::HealthCheckRequest {
            service: hcp_sense::app::LIVENESS.into(),
        })
        .await
        .expect("liveness entry")
        .into_inner();
    assert_eq!(live.status, ServingStatus::Serving as i32);
    let mut packs = pb::pack_service_client::PackServiceClient::new(ch.clone());
    let refused = packs
        .list_packs(pb::ListPacksRequest::default())
        .await
        .expect_err("no token");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    let mut req = tonic::Request::new(pb::ListPacksRequest::default());
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("metadata"),
    );
    packs.list_packs(req).await.expect("the auth file's token");
    assert!(served.terminate());

    // The production values' config.toml: TLS with client certificates, JSON logs, retention,
    // rate limits. Only the addresses, the certificate paths and the log format (read here to
    // find the address) are overridden.
    let certs = out.path().join("certs");
    std::fs::create_dir_all(&certs).expect("certs");
    crate::security::make_certs(&certs);
    let mut cmd = Command::new(crate::support::served::BIN);
    cmd.arg("serve")
        .arg("--config")
        .arg(out.path().join("config.toml"))
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .args(["--ingress-listen", "127.0.0.1:0"])
        .args(["--log-format", "compact"])
        .arg("--tls-cert-file")
        .arg(certs.join("server.pem"))
        .arg("--tls-key-file")
        .arg(certs.join("server.key"))
        .arg("--tls-client-ca-file")
        .arg(certs.join("ca.pem"))
        .env("HCP_SENSE_DATABASE_URL", &db.url)
        .env("HCP_SENSE_AUTH_FILE", &auth);
    let served = Served::spawn(cmd);
    let readyz = format!("http://{}/readyz", served.metrics_addr);
    let start = Instant::now();
    while http_status(&readyz) != 200 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "production config: not ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(served.terminate());

    // The ingress listener and NATS as the chart renders them: `ingress_listen` from the
    // ConfigMap (its port moved to loopback here), the NATS URL in the variable the Deployment
    // takes from the Secret.
    let nats_env = std::fs::read_to_string(out.path().join("nats-env")).expect("nats-env");
    let mut cmd = Command::new(crate::support::served::BIN);
    cmd.arg("serve")
        .arg("--config")
        .arg(out.path().join("config-ingress.toml"))
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .args(["--ingress-listen", "127.0.0.1:0"])
        .env("HCP_SENSE_DATABASE_URL", &db.url)
        .env("HCP_SENSE_AUTH_FILE", &auth)
        .env(nats_env.trim(), "nats://127.0.0.1:4222");
    let served = Served::spawn(cmd);
    let log = |served: &Served| served.log.lock().map(|l| l.join("\n")).unwrap_or_default();
    let ingress = log(&served)
        .lines()
        .find(|l| l.contains("hcp-sense listening"))
        .and_then(|l| l.split("ingress_addr=").nth(1))
        .and_then(|v| v.split_whitespace().next())
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("no ingress listener:\n{}", log(&served)));
    let posted = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-X",
            "POST",
            "-d",
            "{}",
        ])
        .arg(format!("http://{ingress}/v1/ingress/no-such-route"))
        .output()
        .expect("curl");
    assert_eq!(
        String::from_utf8_lossy(&posted.stdout),
        "401",
        "the ingress listener answers (an unsigned request to no route)"
    );
    let start = Instant::now();
    while !log(&served).contains("NATS ingress connected") {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "NATS from {nats_env}: not connected:\n{}",
            log(&served)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(served.terminate());
}

/// The image is built by the commands CI runs, in a build stage of its own, and runs as the
/// non-root user the chart expects.
#[test]
fn dockerfile_builds_with_the_commands_ci_runs_and_runs_as_non_root() {
    let dockerfile = std::fs::read_to_string(repo_path("Dockerfile")).expect("Dockerfile");
    let ci = std::fs::read_to_string(repo_path(".ci/run")).expect(".ci/run");
    let ci_lines: Vec<&str> = ci.lines().map(str::trim).collect();
    // Instructions, with continuation lines joined.
    let joined = dockerfile.replace("\\\n", " ");
    let instructions: Vec<&str> = joined
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let stages = instructions
        .iter()
        .filter(|l| l.starts_with("FROM "))
        .count();
    assert!(stages >= 2, "multi-stage: {stages} FROM");
    let cargo: Vec<String> = instructions
        .iter()
        .filter(|l| l.starts_with("RUN "))
        .filter_map(|l| l.find("cargo ").map(|i| l[i..].trim().to_owned()))
        .collect();
    for want in ["cargo fmt", "cargo clippy", "cargo build --release"] {
        assert!(
            cargo.iter().any(|c| c.starts_with(want)),
            "the Dockerfile runs `{want}`: {cargo:?}"
        );
    }
    for c in &cargo {
        assert!(
            ci_lines.contains(&c.as_str()),
            "the Dockerfile's `{c}` is not a command of .ci/run"
        );
    }
    // Every workspace crate is copied into the build stage.
    let manifest: toml::Table = std::fs::read_to_string(repo_path("Cargo.toml"))
        .expect("Cargo.toml")
        .parse()
        .expect("Cargo.toml parses");
    let members = manifest["workspace"]["members"]
        .as_array()
        .expect("members");
    for m in members
        .iter()
        .filter_map(|m| m.as_str())
        .filter(|m| *m != ".")
    {
        assert!(
            instructions.contains(&format!("COPY {m}/ {m}/").as_str()),
            "the Dockerfile copies workspace member {m}/"
        );
    }
    let last_stage = &instructions[instructions
        .iter()
        .rposition(|l| l.starts_with("FROM "))
        .expect("FROM")..];
    let user = last_stage
        .iter()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("the runtime stage sets USER");
    let uid = user.split(':').next().unwrap_or_default();
    assert_eq!(uid, "65532", "the chart's runAsUser");
    assert!(
        last_stage
            .iter()
            .any(|l| l.starts_with("ENTRYPOINT") && l.contains("hcp-sense")),
        "the entrypoint is the binary (the chart passes only arguments)"
    );
    let values = std::fs::read_to_string(repo_path("helm/hcp-sense/values.yaml")).expect("values");
    assert!(values.contains("runAsUser: 65532"));
}
