//! Authentication and roles over real gRPC: every RPC × every caller, refused calls change nothing,
//! readers read only as themselves, and oversized input is refused.
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use hcp_sense::auth::{AuthConfig, JwtConfig, Role, TokenConfig};
use hcp_sense::grpc::convert::json_to_struct;
use hcp_sense::grpc::pb::{
    self, deliver_trigger_request::PayloadSource, ingest_service_client::IngestServiceClient,
    policy_service_client::PolicyServiceClient, record_service_client::RecordServiceClient,
    BindingState, DeliverTriggerRequest, GrantSenseEnableRequest, ListRecordsRequest,
    PutBindingRequest, Route,
};
use prost::Message;
use sha2::{Digest, Sha256};
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::Code;

use crate::helpers::{spawn_app_with, StoreKind, TestApp};

pub(crate) const ADMIN: &str = "admin-token-9f3c";
pub(crate) const RUNTIME: &str = "runtime-token-71ab";
pub(crate) const READER: &str = "reader-token-alice";
const SECRET: &str = "jwt-shared-secret-for-tests-32-bytes-long";

pub fn token(name: &str, secret: &str, role: Role, principal: Option<&str>) -> TokenConfig {
    TokenConfig {
        name: name.into(),
        sha256: hex::encode(Sha256::digest(secret.as_bytes())),
        role,
        principal: principal.map(str::to_owned),
    }
}

/// Now, in Unix seconds.
pub(crate) fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Now, in Unix seconds with their fraction.
fn now_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn jwt(role: &str, sub: &str, exp_offset: i64) -> String {
    jwt_until(role, sub, now() + exp_offset)
}

/// An HS256 JWT signed with `secret` whose `exp` is `exp` (Unix seconds).
fn jwt_signed(secret: &str, role: &str, sub: &str, exp: i64) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &serde_json::json!({ "sub": sub, "role": role, "exp": exp, "iss": "hcp-tests", "aud": "hcp-sense" }),
        &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()).expect("key"),
    )
    .expect("jwt")
}

/// A JWT the test servers accept until `exp` (Unix seconds) plus the leeway.
pub(crate) fn jwt_until(role: &str, sub: &str, exp: i64) -> String {
    jwt_signed(SECRET, role, sub, exp)
}

async fn secured(kind: StoreKind) -> (TestApp, tempfile::TempDir) {
    secured_with(kind, |_| {}).await
}

/// The tokens and HS256 JWTs of `secured`, then `adjust`.
pub(crate) async fn secured_with(
    kind: StoreKind,
    adjust: impl FnOnce(&mut hcp_sense::config::Config),
) -> (TestApp, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = dir.path().join("hs256.secret");
    std::fs::write(&secret, SECRET).expect("secret");
    let app = spawn_app_with(kind, |c| {
        // These tests make many refused calls on purpose; the per-address limit on failed
        // authentications has a test of its own.
        c.auth_failure_rate_per_sec = 0.0;
        c.auth = AuthConfig {
            tokens: vec![
                token("ops", ADMIN, Role::Admin, None),
                token("harness", RUNTIME, Role::Runtime, None),
                token("alice-reader", READER, Role::Reader, Some("alice")),
            ],
            jwt: Some(JwtConfig {
                hs256_secret_file: Some(secret.clone()),
                issuer: Some("hcp-tests".into()),
                audience: Some("hcp-sense".into()),
                ..Default::default()
            }),
        };
        adjust(c);
    })
    .await;
    (app, dir)
}

pub fn bearer(
    ch: &Channel,
    token: &str,
) -> InterceptedService<
    Channel,
    impl FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Clone,
> {
    let value: Option<MetadataValue<_>> =
        (!token.is_empty()).then(|| format!("Bearer {token}").parse().expect("metadata"));
    InterceptedService::new(ch.clone(), move |mut req: tonic::Request<()>| {
        if let Some(v) = &value {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    })
}

/// Every method of the hcp.sense.v1 services the server serves.
fn methods() -> Vec<String> {
    let set = prost_types::FileDescriptorSet::decode(pb::FILE_DESCRIPTOR_SET).expect("descriptors");
    let mut out = Vec::new();
    for f in set.file {
        for s in &f.service {
            if s.name() == "BenchService" {
                continue;
            }
            for m in &s.method {
                out.push(format!("/{}.{}/{}", f.package(), s.name(), m.name()));
            }
        }
    }
    out
}

/// Calls a method with an empty request (every field at its default) and returns the status code.
async fn call(ch: &Channel, token: &str, method: &str) -> Code {
    let mut grpc = tonic::client::Grpc::new(bearer(ch, token));
    grpc.ready().await.expect("ready");
    let codec = hcp_sense_api::codec::Codec::<(), ()>::default();
    let path = http::uri::PathAndQuery::try_from(method.to_owned()).expect("path");
    match grpc.unary(tonic::Request::new(()), path, codec).await {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    }
}

fn allowed_for(method: &str, role: Role) -> bool {
    hcp_sense::auth::allowed(method, role)
}

both_stores! {
    async fn every_rpc_by_every_caller_is_authenticated_and_authorized(app) {
        let (app, _dir) = secured(if app.db.get_database_backend() == sea_orm::DbBackend::Sqlite { StoreKind::Sqlite } else { StoreKind::Postgres }).await;
        let ch = &app.channel;
        let methods = methods();
        assert!(methods.len() >= 20, "{methods:?}");
        let expired = jwt("admin", "old-ops", -3600);
        let wrong_sig = {
            let good = jwt("admin", "forger", 3600);
            format!("{}x", &good[..good.len() - 1])
        };
        let before = app.snapshot(true).await;
        for m in &methods {
            for (who, t) in [("no token", ""), ("bad token", "not-a-token"), ("expired JWT", expired.as_str()), ("forged JWT", wrong_sig.as_str())] {
                assert_eq!(call(ch, t, m).await, Code::Unauthenticated, "{who} on {m}");
            }
            for (role, t) in [(Role::Admin, ADMIN), (Role::Runtime, RUNTIME), (Role::Reader, READER)] {
                if !allowed_for(m, role) {
                    assert_eq!(call(ch, t, m).await, Code::PermissionDenied, "{role:?} on {m}");
                }
            }
        }
        assert_eq!(app.snapshot(true).await, before, "a refused call changed something");
        // Allowed calls get past the guard (their empty requests may still be invalid).
        let reader_jwt = jwt("reader", "alice", 3600);
        for m in &methods {
            for (role, t) in [(Role::Admin, ADMIN), (Role::Runtime, RUNTIME), (Role::Reader, READER), (Role::Reader, reader_jwt.as_str())] {
                if allowed_for(m, role) {
                    let code = call(ch, t, m).await;
                    assert!(!matches!(code, Code::Unauthenticated | Code::PermissionDenied), "{role:?} on {m}: {code:?}");
                }
            }
        }
    }

    async fn readers_read_only_their_own_records_and_runtimes_none(app) {
        let (app, _dir) = secured(if app.db.get_database_backend() == sea_orm::DbBackend::Sqlite { StoreKind::Sqlite } else { StoreKind::Postgres }).await;
        let ch = app.channel.clone();
        let mut admin_packs = hcp_sense::grpc::pb::pack_service_client::PackServiceClient::new(bearer(&ch, ADMIN));
        admin_packs.register_pack(crate::packs::register_req(&crate::helpers::example("github.pack.json"))).await.expect("register");
        let mut admin = PolicyServiceClient::new(bearer(&ch, ADMIN));
        for who in ["alice", "bob"] {
            admin.grant_sense_enable(GrantSenseEnableRequest { principal: who.into(), pack_id: "github".into() }).await.expect("grant");
            admin.put_binding(PutBindingRequest { principal: who.into(), pack_id: "github".into(), binding_id: format!("b-{who}"), state: BindingState::Linked as i32 }).await.expect("bind");
            admin.activate_sense(pb::ActivateSenseRequest { principal: who.into(), pack_id: "github".into(), route: Route::Inbox as i32, filter: String::new() }).await.expect("activate");
        }
        let mut runtime = IngestServiceClient::new(bearer(&ch, RUNTIME));
        for who in ["alice", "bob", "bob"] {
            let r = runtime.deliver_trigger(DeliverTriggerRequest {
                pack_id: "github".into(), r#ref: "issue.opened".into(), principal: who.into(), land: "user".into(), ..Default::default()
            }).await.expect("deliver").into_inner();
            assert_eq!(r.disposition, pb::Disposition::RecordedInbox as i32);
        }
        // The audit log shows who granted what, in the change's own transaction.
        let mut audit = hcp_sense::grpc::pb::audit_service_client::AuditServiceClient::new(bearer(&ch, ADMIN));
        let events = audit
            .list_audit_events(pb::ListAuditEventsRequest { principal: "alice".into(), ..Default::default() })
            .await
            .expect("audit")
            .into_inner()
            .audit_events;
        let grant = events.iter().find(|e| e.rpc == "GrantSenseEnable").expect("the grant is audited");
        assert_eq!((grant.actor.as_str(), grant.role.as_str(), grant.pack_id.as_str()), ("ops", "admin", "github"));
        assert!(grant.before.is_empty(), "{grant:?}");
        // Before and after are the rows as JSON objects, not debug text.
        let after: serde_json::Value = serde_json::from_str(&grant.after).expect("the grant as JSON");
        assert_eq!((after["principal"].as_str(), after["pack_id"].as_str()), (Some("alice"), Some("github")), "{after}");
        let bound = events.iter().find(|e| e.rpc == "PutBinding").expect("the binding is audited");
        let after: serde_json::Value = serde_json::from_str(&bound.after).expect("the binding as JSON");
        assert_eq!((after["binding_id"].as_str(), after["state"].as_str(), after["mode"].as_str()), (Some("b-alice"), Some("linked"), Some("user")), "{after}");
        let activated = events.iter().find(|e| e.rpc == "ActivateSense").expect("the activation is audited");
        let after: serde_json::Value = serde_json::from_str(&activated.after).expect("the activation as JSON");
        assert_eq!((after["enabled"].as_bool(), after["route"].as_str()), (Some(true), Some("inbox")), "{after}");
        assert!(events.iter().any(|e| e.rpc == "ActivateSense"));
        let times: Vec<_> = events.iter().map(|e| e.event_time.map(|t| (t.seconds, t.nanos))).collect();
        assert!(times.windows(2).all(|w| w[0] >= w[1]), "newest first");
        let packs = audit
            .list_audit_events(pb::ListAuditEventsRequest { pack_id: "github".into(), page_size: 2, ..Default::default() })
            .await
            .expect("audit page")
            .into_inner();
        assert_eq!(packs.audit_events.len(), 2);
        assert!(!packs.next_page_token.is_empty());
        assert!(!events.iter().any(|e| e.rpc == "DeliverTrigger"), "deliveries are not admin mutations");
        // A reader cannot grant, activate or read bob's records.
        let mut as_reader = PolicyServiceClient::new(bearer(&ch, READER));
        let e = as_reader.grant_sense_enable(GrantSenseEnableRequest { principal: "alice".into(), pack_id: "github".into() }).await.expect_err("grant");
        assert_eq!(e.code(), Code::PermissionDenied);
        let e = as_reader.activate_sense(pb::ActivateSenseRequest { principal: "alice".into(), pack_id: "github".into(), route: 1, filter: String::new() }).await.expect_err("activate");
        assert_eq!(e.code(), Code::PermissionDenied);
        let mut reader = RecordServiceClient::new(bearer(&ch, READER));
        let e = reader.list_records(ListRecordsRequest { principal: "bob".into(), ..Default::default() }).await.expect_err("bob's records");
        assert_eq!(e.code(), Code::PermissionDenied);
        // Naming another viewer is refused as naming another principal is, not quietly read as
        // the reader's own.
        let e = reader.list_records(ListRecordsRequest { viewer: "bob".into(), ..Default::default() }).await.expect_err("bob as viewer");
        assert_eq!(e.code(), Code::PermissionDenied);
        assert!(e.message().contains("bob"), "{}", e.message());
        let mine = reader.list_records(ListRecordsRequest { viewer: "alice".into(), ..Default::default() }).await.expect("own").into_inner().records;
        assert_eq!(mine.len(), 1, "only alice's");
        assert!(mine.iter().all(|r| r.principal == "alice"));
        let unnamed = reader.list_records(ListRecordsRequest::default()).await.expect("own, unnamed").into_inner().records;
        assert_eq!(unnamed.len(), 1);
        let via_jwt = RecordServiceClient::new(bearer(&ch, &jwt("reader", "alice", 3600)))
            .list_records(ListRecordsRequest::default()).await.expect("jwt reader").into_inner().records;
        assert_eq!(via_jwt.len(), 1);
        // A runtime cannot read records.
        let e = RecordServiceClient::new(bearer(&ch, RUNTIME)).list_records(ListRecordsRequest::default()).await.expect_err("runtime");
        assert_eq!(e.code(), Code::PermissionDenied);
        // An expired JWT is refused.
        let e = RecordServiceClient::new(bearer(&ch, &jwt("reader", "alice", -120))).list_records(ListRecordsRequest::default()).await.expect_err("expired");
        assert_eq!(e.code(), Code::Unauthenticated);
        // Which check failed is for the debug log, not for the caller.
        assert_eq!(e.message(), "credentials refused");
        app.stop().await;
    }

    async fn oversized_and_deeply_nested_input_is_refused(app) {
        let kind = if app.db.get_database_backend() == sea_orm::DbBackend::Sqlite { StoreKind::Sqlite } else { StoreKind::Postgres };
        let mut app = spawn_app_with(kind, |c| c.max_json_depth = 10).await;
        crate::packs::register(&mut app, &crate::helpers::example("github.pack.json")).await;
        let big = "x".repeat(10 << 20);
        let e = app.ingest.deliver_trigger(DeliverTriggerRequest {
            pack_id: "github".into(), r#ref: "issue.opened".into(), principal: "alice".into(), land: "user".into(),
            payload_source: Some(PayloadSource::PayloadJson(format!("{{\"blob\":\"{big}\"}}"))), ..Default::default()
        }).await.expect_err("10 MiB");
        assert!(matches!(e.code(), Code::OutOfRange | Code::ResourceExhausted | Code::InvalidArgument), "{e:?}");
        let mut deep = serde_json::json!(1);
        for _ in 0..12 {
            deep = serde_json::json!({ "d": deep });
        }
        let e = app.ingest.deliver_trigger(DeliverTriggerRequest {
            pack_id: "github".into(), r#ref: "issue.opened".into(), principal: "alice".into(), land: "user".into(),
            payload_source: Some(PayloadSource::Payload(json_to_struct(&deep))), ..Default::default()
        }).await.expect_err("deep");
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.message().contains("payload"), "{}", e.message());
        let e = app.ingest.deliver_trigger(DeliverTriggerRequest {
            pack_id: "github".into(), r#ref: "issue.opened".into(), principal: "alice".into(), land: "user".into(),
            payload_source: Some(PayloadSource::PayloadJson(format!("{}1{}", "[".repeat(200), "]".repeat(200)))), ..Default::default()
        }).await.expect_err("deep text");
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.message().contains("payload"), "{}", e.message());
        assert_eq!(app.count("records").await, 0);
    }
}

#[test]
fn a_public_address_without_auth_is_refused() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("rt");
    rt.block_on(async {
        let db = crate::helpers::TestDb::create(StoreKind::Sqlite).await;
        let mut cfg = hcp_sense::config::Config::for_database(db.url.clone());
        cfg.listen = "0.0.0.0:0".parse().expect("addr");
        let err = hcp_sense::app::App::build(cfg.clone())
            .await
            .err()
            .expect("refused");
        assert!(err.to_string().contains("--insecure-no-auth"), "{err}");
        cfg.insecure_no_auth = true;
        assert!(hcp_sense::app::App::build(cfg).await.is_ok());

        // The MCP door too: without authentication it would read every principal's records.
        let mut cfg = hcp_sense::config::Config::for_database(db.url.clone());
        cfg.mcp_listen = Some("127.0.0.1:0".parse().expect("addr"));
        assert!(
            hcp_sense::app::App::build(cfg.clone()).await.is_ok(),
            "loopback is served"
        );
        cfg.mcp_listen = Some("0.0.0.0:0".parse().expect("addr"));
        let err = hcp_sense::app::App::build(cfg.clone())
            .await
            .err()
            .expect("refused");
        assert!(
            err.to_string().contains("MCP door") && err.to_string().contains("--insecure-no-auth"),
            "{err}"
        );
        cfg.insecure_no_auth = true;
        assert!(hcp_sense::app::App::build(cfg).await.is_ok());
    });
}

/// A CA, a server certificate for localhost and 127.0.0.1, and a client certificate for `alice`, by openssl.
pub fn make_certs(dir: &std::path::Path) {
    let script = r#"
set -e
ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
openssl req -x509 $ec -keyout ca.key -out ca.pem -days 2 -subj /CN=hcp-test-ca 2>/dev/null
openssl req $ec -keyout server.key -out server.csr -subj /CN=localhost 2>/dev/null
printf "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n" > server.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile server.ext 2>/dev/null
openssl req $ec -keyout client.key -out client.csr -subj /CN=alice 2>/dev/null
printf "extendedKeyUsage=clientAuth\n" > client.ext
openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 2 -extfile client.ext 2>/dev/null
"#;
    let ok = std::process::Command::new("bash")
        .args(["-c", script])
        .current_dir(dir)
        .status()
        .expect("openssl must be installed (see .ci/run)");
    assert!(ok.success(), "making test certificates");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_names_the_reader_by_its_certificate() {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let dir = tempfile::tempdir().expect("tempdir");
    make_certs(dir.path());
    let p = |f: &str| dir.path().join(f);
    let app = spawn_app_with(StoreKind::Sqlite, |c| {
        c.auth = AuthConfig {
            tokens: vec![
                token("ops", ADMIN, Role::Admin, None),
                token("harness", RUNTIME, Role::Runtime, None),
            ],
            jwt: None,
        };
        c.tls = hcp_sense::config::TlsOptions {
            cert_file: Some(p("server.pem")),
            key_file: Some(p("server.key")),
            client_ca_file: Some(p("ca.pem")),
            client_role: Role::Reader,
            client_identity: Default::default(),
        };
    })
    .await;
    let read = |f: &str| std::fs::read(p(f)).expect("pem");
    let tls = |with_cert: bool| {
        let mut c = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read("ca.pem")))
            .domain_name("localhost");
        if with_cert {
            c = c.identity(Identity::from_pem(read("client.pem"), read("client.key")));
        }
        c
    };
    let url = format!("https://127.0.0.1:{}", app.addr.port());
    let with_cert = Channel::from_shared(url.clone())
        .expect("uri")
        .tls_config(tls(true))
        .expect("tls")
        .connect()
        .await
        .expect("mTLS connect");
    let no_cert = Channel::from_shared(url)
        .expect("uri")
        .tls_config(tls(false))
        .expect("tls")
        .connect()
        .await
        .expect("TLS connect");

    let mut packs =
        hcp_sense::grpc::pb::pack_service_client::PackServiceClient::new(bearer(&no_cert, ADMIN));
    packs
        .register_pack(crate::packs::register_req(&crate::helpers::example(
            "github.pack.json",
        )))
        .await
        .expect("register over TLS");
    let mut admin = PolicyServiceClient::new(bearer(&no_cert, ADMIN));
    for who in ["alice", "bob"] {
        admin
            .grant_sense_enable(GrantSenseEnableRequest {
                principal: who.into(),
                pack_id: "github".into(),
            })
            .await
            .expect("grant");
        admin
            .put_binding(PutBindingRequest {
                principal: who.into(),
                pack_id: "github".into(),
                binding_id: format!("b-{who}"),
                state: 1,
            })
            .await
            .expect("bind");
        admin
            .activate_sense(pb::ActivateSenseRequest {
                principal: who.into(),
                pack_id: "github".into(),
                route: 1,
                filter: String::new(),
            })
            .await
            .expect("activate");
        IngestServiceClient::new(bearer(&no_cert, RUNTIME))
            .deliver_trigger(DeliverTriggerRequest {
                pack_id: "github".into(),
                r#ref: "issue.opened".into(),
                principal: who.into(),
                land: "user".into(),
                ..Default::default()
            })
            .await
            .expect("deliver");
    }
    // The certificate's CN is the reader's principal.
    let mine = RecordServiceClient::new(with_cert.clone())
        .list_records(ListRecordsRequest::default())
        .await
        .expect("list by certificate")
        .into_inner()
        .records;
    assert_eq!(mine.len(), 1);
    assert_eq!(mine[0].principal, "alice");
    let e = PolicyServiceClient::new(with_cert)
        .grant_sense_enable(GrantSenseEnableRequest {
            principal: "alice".into(),
            pack_id: "github".into(),
        })
        .await
        .expect_err("reader");
    assert_eq!(e.code(), Code::PermissionDenied);
    // Neither certificate nor token.
    let e = RecordServiceClient::new(no_cert)
        .list_records(ListRecordsRequest::default())
        .await
        .expect_err("anonymous");
    assert_eq!(e.code(), Code::Unauthenticated);
    // Plain text does not get an answer.
    let plain = Channel::from_shared(format!("http://127.0.0.1:{}", app.addr.port()))
        .expect("uri")
        .connect_lazy();
    assert!(RecordServiceClient::new(plain)
        .list_records(ListRecordsRequest::default())
        .await
        .is_err());
}

/// The server's peak resident set size in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_10_mib_payload_is_refused_without_the_server_growing() {
    let db = crate::helpers::TestDb::create(StoreKind::Sqlite).await;
    let served = crate::support::served::Served::start(&db.url, &[]);
    let ch = Channel::from_shared(format!("http://{}", served.addr))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let mut ingest = IngestServiceClient::new(ch);
    // Warm up, then measure the peak before and after ten oversized calls.
    let _ = ingest
        .deliver_trigger(DeliverTriggerRequest {
            pack_id: "p".into(),
            r#ref: "a.b".into(),
            principal: "x".into(),
            land: "user".into(),
            ..Default::default()
        })
        .await;
    let pid = served.pid();
    let before = peak_rss_kib(pid);
    let blob = "x".repeat(10 << 20);
    for _ in 0..10 {
        let e = ingest
            .deliver_trigger(DeliverTriggerRequest {
                pack_id: "p".into(),
                r#ref: "a.b".into(),
                principal: "x".into(),
                land: "user".into(),
                payload_source: Some(PayloadSource::PayloadJson(blob.clone())),
                ..Default::default()
            })
            .await
            .expect_err("10 MiB");
        assert_eq!(e.code(), Code::OutOfRange, "{e:?}");
        assert!(e.message().contains("too large"), "{}", e.message());
    }
    let after = peak_rss_kib(pid);
    assert!(before > 0);
    assert!(
        after.saturating_sub(before) < 4 * 1024,
        "the server's peak RSS grew from {before} KiB to {after} KiB"
    );
    assert!(served.terminate());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn es256_jwts_from_a_jwks_file_with_issuer_and_audience_checked() {
    use jsonwebtoken::{jwk, Algorithm, EncodingKey, Header};
    let dir = tempfile::tempdir().expect("tempdir");
    let (key, public) = es256_key(dir.path(), "es", "k1");
    let pem = std::fs::read(dir.path().join("es.key")).expect("key");
    let jwks = dir.path().join("jwks.json");
    std::fs::write(
        &jwks,
        serde_json::to_string(&jwk::JwkSet { keys: vec![public] }).expect("json"),
    )
    .expect("write");
    let app = spawn_app_with(StoreKind::Sqlite, |c| {
        c.auth = AuthConfig {
            tokens: vec![],
            jwt: Some(JwtConfig {
                jwks_file: Some(jwks.clone()),
                issuer: Some("https://id.example".into()),
                audience: Some("hcp-sense".into()),
                ..Default::default()
            }),
        };
    })
    .await;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let sign = |claims: serde_json::Value| {
        let mut h = Header::new(Algorithm::ES256);
        h.kid = Some("k1".into());
        jsonwebtoken::encode(&h, &claims, &key).expect("sign")
    };
    let good = sign(
        serde_json::json!({ "sub": "ops", "role": "admin", "iss": "https://id.example", "aud": "hcp-sense", "exp": now + 600 }),
    );
    let wrong_aud = sign(
        serde_json::json!({ "sub": "ops", "role": "admin", "iss": "https://id.example", "aud": "other", "exp": now + 600 }),
    );
    let wrong_iss = sign(
        serde_json::json!({ "sub": "ops", "role": "admin", "iss": "https://evil.example", "aud": "hcp-sense", "exp": now + 600 }),
    );
    let not_yet = sign(
        serde_json::json!({ "sub": "ops", "role": "admin", "iss": "https://id.example", "aud": "hcp-sense", "exp": now + 600, "nbf": now + 300 }),
    );
    let no_role = sign(
        serde_json::json!({ "sub": "ops", "iss": "https://id.example", "aud": "hcp-sense", "exp": now + 600 }),
    );
    let list = "/hcp.sense.v1.PackService/ListPacks";
    assert_eq!(call(&app.channel, &good, list).await, Code::Ok);
    for (why, t) in [
        ("audience", &wrong_aud),
        ("issuer", &wrong_iss),
        ("not before", &not_yet),
        ("role claim", &no_role),
    ] {
        assert_eq!(
            call(&app.channel, t, list).await,
            Code::Unauthenticated,
            "{why}"
        );
    }
    // An HS256 token signed with the public key's bytes is not accepted (no algorithm confusion).
    let hs = jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &serde_json::json!({ "sub": "x", "role": "admin", "iss": "https://id.example", "aud": "hcp-sense", "exp": now + 600 }),
        &EncodingKey::from_secret(&pem).expect("hs"),
    )
    .expect("hs256");
    assert_eq!(call(&app.channel, &hs, list).await, Code::Unauthenticated);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_over_their_rate_get_resource_exhausted() {
    let app = spawn_app_with(StoreKind::Sqlite, |c| c.rate_limit_per_sec = 5.0).await;
    let mut codes = Vec::new();
    for _ in 0..30 {
        codes.push(call(&app.channel, "", "/hcp.sense.v1.PackService/ListPacks").await);
    }
    let limited = codes
        .iter()
        .filter(|c| **c == Code::ResourceExhausted)
        .count();
    assert!(
        codes[..10].iter().all(|c| *c == Code::Ok),
        "the burst passes: {codes:?}"
    );
    assert!(limited >= 15, "{codes:?}");
    // The refusal says when to come back: RetryInfo with the bucket's wait (a token every
    // 200 ms at 5 a second) and ErrorInfo RATE_LIMITED; a call made after that wait passes.
    use tonic_types::StatusExt;
    let mut packs =
        hcp_sense::grpc::pb::pack_service_client::PackServiceClient::new(app.channel.clone());
    let refused = loop {
        match packs.list_packs(pb::ListPacksRequest::default()).await {
            Ok(_) => continue,
            Err(s) => break s,
        }
    };
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    let wait = refused
        .get_details_retry_info()
        .and_then(|r| r.retry_delay)
        .expect("RetryInfo with a delay");
    assert!(
        wait > Duration::ZERO && wait <= Duration::from_millis(200),
        "{wait:?}"
    );
    assert_eq!(
        refused.get_details_error_info().map(|i| i.reason),
        Some("RATE_LIMITED".to_owned())
    );
    tokio::time::sleep(wait + Duration::from_millis(20)).await;
    packs
        .list_packs(pb::ListPacksRequest::default())
        .await
        .expect("a call after the wait it was told passes");
    // Health checks are never limited.
    assert_eq!(
        call(&app.channel, "", "/grpc.health.v1.Health/Check").await,
        Code::Ok
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_jwts_and_payloads_never_reach_the_logs() {
    let db = crate::helpers::TestDb::create(StoreKind::Sqlite).await;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("jwt.secret"), SECRET).expect("secret");
    let config = dir.path().join("hcp-sense.toml");
    std::fs::write(
        &config,
        format!(
            "[[auth.tokens]]\nname = \"ops\"\nsha256 = \"{}\"\nrole = \"admin\"\n\n[[auth.tokens]]\nname = \"harness\"\nsha256 = \"{}\"\nrole = \"runtime\"\n\n[auth.jwt]\nhs256_secret_file = \"{}\"\n",
            hex::encode(Sha256::digest(ADMIN.as_bytes())),
            hex::encode(Sha256::digest(RUNTIME.as_bytes())),
            dir.path().join("jwt.secret").display()
        ),
    )
    .expect("config");
    let mut cmd = crate::support::served::serve_command(&db.url);
    cmd.arg("--config").arg(&config).env("RUST_LOG", "debug");
    let served = crate::support::served::Served::spawn(cmd);
    let ch = Channel::from_shared(format!("http://{}", served.addr))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let admin_jwt = jwt("admin", "ops-jwt", 600);
    hcp_sense::grpc::pb::pack_service_client::PackServiceClient::new(bearer(&ch, &admin_jwt))
        .register_pack(crate::packs::register_req(&crate::helpers::example(
            "github.pack.json",
        )))
        .await
        .expect("register with a JWT");
    let mut admin = PolicyServiceClient::new(bearer(&ch, ADMIN));
    admin
        .grant_sense_enable(GrantSenseEnableRequest {
            principal: "alice".into(),
            pack_id: "github".into(),
        })
        .await
        .expect("grant");
    let marker = "payload-marker-7f3a9c";
    for t in [RUNTIME, "wrong-token-value-55"] {
        let _ = IngestServiceClient::new(bearer(&ch, t))
            .deliver_trigger(DeliverTriggerRequest {
                pack_id: "github".into(),
                r#ref: "issue.opened".into(),
                principal: "alice".into(),
                land: "user".into(),
                payload_source: Some(PayloadSource::PayloadJson(format!(
                    "{{\"secret\":\"{marker}\"}}"
                ))),
                ..Default::default()
            })
            .await;
    }
    let log = served.log.clone();
    assert!(served.terminate());
    let text = log.lock().map(|l| l.join("\n")).unwrap_or_default();
    assert!(
        text.contains("sense.enable granted"),
        "the log is captured:\n{text}"
    );
    for secret in [
        ADMIN,
        RUNTIME,
        admin_jwt.as_str(),
        "wrong-token-value-55",
        marker,
        SECRET,
    ] {
        assert!(
            !text.contains(secret),
            "`{secret}` appears in the log:\n{text}"
        );
    }
}

/// A DeliverTriggers stream opened with a JWT ends when the JWT expires (its `exp` plus the
/// 5 s leeway): UNAUTHENTICATED, never a trigger decided on a credential that is no longer
/// accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_ends_when_its_jwt_expires() {
    use hcp_sense::grpc::pb::{ingest_service_client::IngestServiceClient, DeliverTriggersRequest};
    let (app, _dir) = secured(StoreKind::Sqlite).await;
    // Expired 2 s ago: still inside the leeway for two to three more seconds (`exp` is whole
    // seconds), room enough to open the stream on a loaded machine.
    let exp = now() - 2;
    let short = jwt_until("runtime", "relay", exp);
    let refused_from = std::time::UNIX_EPOCH
        + std::time::Duration::from_secs((exp + JWT_LEEWAY_SECS as i64 + 1) as u64);
    let (tx, rx) = tokio::sync::mpsc::channel::<DeliverTriggersRequest>(4);
    let trigger = || DeliverTriggersRequest {
        trigger: Some(pb::DeliverTriggerRequest {
            pack_id: "weather".into(),
            r#ref: "storm.warning".into(),
            principal: "alice".into(),
            land: "user".into(),
            ..Default::default()
        }),
    };
    tx.send(trigger()).await.expect("send");
    let mut answers = IngestServiceClient::new(bearer(&app.channel, &short))
        .deliver_triggers(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("the stream opens while the JWT is accepted")
        .into_inner();
    let first = answers.message().await.expect("first answer").expect("one");
    assert_eq!(first.index, 0);
    // Past the leeway by most of a second.
    let wait = refused_from
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_default();
    tokio::time::sleep(wait + std::time::Duration::from_millis(700)).await;
    // The stream has ended by now, so the client may already have let go of its sending side.
    let _ = tx.send(trigger()).await;
    let end = answers.message().await.expect_err("the stream ends");
    assert_eq!(end.code(), Code::Unauthenticated, "{end:?}");
    assert!(end.message().contains("expired"), "{}", end.message());
}

// --- Credentials end streams ---

use hcp_sense::auth::JWT_LEEWAY_SECS;
use std::time::Duration;

/// alice's records as they commit, from now, watched with `token`.
async fn watch_as(ch: &Channel, token: &str) -> tonic::Streaming<pb::WatchRecordsResponse> {
    RecordServiceClient::new(bearer(ch, token))
        .watch_records(pb::WatchRecordsRequest {
            principal: "alice".into(),
            start: Some(pb::watch_records_request::Start::FromNow(true)),
            ..Default::default()
        })
        .await
        .expect("the watch opens while its credential is accepted")
        .into_inner()
}

/// Reads a stream until it ends with a status: the messages with when each came (Unix
/// seconds), then the status and when it came. Panics if the stream ends without one or
/// goes on past `within`.
pub async fn until_status<T>(
    stream: &mut tonic::Streaming<T>,
    within: Duration,
) -> (Vec<(T, f64)>, tonic::Status, f64) {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.message()).await {
            Err(_) => panic!("the stream did not end within {within:?}"),
            Ok(Ok(Some(m))) => got.push((m, now_f64())),
            Ok(Ok(None)) => panic!("the stream ended without a status"),
            Ok(Err(status)) => return (got, status, now_f64()),
        }
    }
}

/// A stream's end: UNAUTHENTICATED saying the credentials expired, within a second of `due`.
pub fn ended_at_expiry(what: &str, status: &tonic::Status, at: f64, due: f64) {
    assert_eq!(status.code(), Code::Unauthenticated, "{what}: {status:?}");
    assert!(
        status.message().contains("expired"),
        "{what}: {}",
        status.message()
    );
    assert!(
        at >= due - 0.1 && at <= due + 1.0,
        "{what} ended at {at:.3}, {:+.3} s from its credential's expiry",
        at - due
    );
}

/// A watch opened with a JWT streams records until the JWT's `exp` plus the leeway, then
/// ends UNAUTHENTICATED on time while records go on committing: none committed after it is
/// streamed, and the JWT opens nothing new.
async fn a_watch_ends_when_its_jwt_expires(kind: StoreKind) {
    let (app, _dir) = secured(kind).await;
    let ch = app.channel.clone();
    crate::identity::set_up(&ch, ADMIN, &["alice"]).await;
    let exp = now() + 2;
    let due = (exp + JWT_LEEWAY_SECS as i64) as f64;
    let reader = jwt_until("reader", "alice", exp);
    let mut watch = watch_as(&ch, &reader).await;
    // A record every 200 ms, from before the expiry to 2 s after it, each with when it was sent.
    let producer = {
        let ch = ch.clone();
        tokio::spawn(async move {
            let mut runtime = IngestServiceClient::new(bearer(&ch, RUNTIME));
            let mut sent = Vec::new();
            for i in 0.. {
                let at = now_f64();
                if at > due + 2.0 {
                    break;
                }
                let r = runtime
                    .deliver_trigger(DeliverTriggerRequest {
                        trigger_id: format!("t-{i}"),
                        ..crate::identity::opened("alice")
                    })
                    .await
                    .expect("deliver")
                    .into_inner();
                assert_eq!(r.disposition, pb::Disposition::RecordedInbox as i32);
                sent.push((r.record_id, at, now_f64()));
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            sent
        })
    };
    let (got, end, ended) = until_status(&mut watch, Duration::from_secs(30)).await;
    ended_at_expiry("the watch", &end, ended, due);
    assert!(
        !matches!(watch.message().await, Ok(Some(_))),
        "nothing after the status"
    );
    let sent = producer.await.expect("producer");
    let streamed: std::collections::HashSet<String> = got
        .iter()
        .flat_map(|(m, _)| m.records.iter().map(|r| r.record_id.clone()))
        .collect();
    assert!(
        got.iter().all(|(_, at)| *at <= due + 0.1),
        "a message came after the expiry"
    );
    // Every record acknowledged a second before the expiry was streamed.
    let before: Vec<&String> = sent
        .iter()
        .filter(|(_, _, acked)| *acked < due - 1.0)
        .map(|(id, _, _)| id)
        .collect();
    assert!(before.len() >= 5, "{sent:?}");
    assert!(
        before.iter().all(|id| streamed.contains(*id)),
        "{before:?} / {streamed:?}"
    );
    // No record sent after the expiry was.
    let after: Vec<&String> = sent
        .iter()
        .filter(|(_, at, _)| *at > due)
        .map(|(id, _, _)| id)
        .collect();
    assert!(after.len() >= 5, "{sent:?}");
    assert!(
        after.iter().all(|id| !streamed.contains(*id)),
        "{after:?} streamed"
    );
    let e = RecordServiceClient::new(bearer(&ch, &reader))
        .list_records(ListRecordsRequest::default())
        .await
        .expect_err("the expired JWT");
    assert_eq!(e.code(), Code::Unauthenticated);
}
on_both_stores!(a_watch_ends_when_its_jwt_expires => a_watch_ends_when_its_jwt_expires);

/// Streams that carry nothing end at their JWT's expiry too: a timer ends them, not the next
/// message. Here a watch with no records and a DeliverTriggers with no triggers; the watch's
/// slot (`--max-watches 1`) is free again for a watch with a fresh JWT.
async fn idle_streams_end_when_their_jwts_expire(kind: StoreKind) {
    use hcp_sense::grpc::pb::DeliverTriggersRequest;
    let (app, _dir) = secured_with(kind, |c| c.max_watches = 1).await;
    let ch = app.channel.clone();
    let exp = now() + 1;
    let due = (exp + JWT_LEEWAY_SECS as i64) as f64;
    let mut watch = watch_as(&ch, &jwt_until("reader", "alice", exp)).await;
    // The request side stays open, and empty, until the end.
    let (_open, rx) = tokio::sync::mpsc::channel::<DeliverTriggersRequest>(1);
    let mut triggers = IngestServiceClient::new(bearer(&ch, &jwt_until("runtime", "relay", exp)))
        .deliver_triggers(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("the stream opens while the JWT is accepted")
        .into_inner();
    let within = Duration::from_secs(30);
    let ((seen, w_end, w_at), (answers, t_end, t_at)) = tokio::join!(
        until_status(&mut watch, within),
        until_status(&mut triggers, within)
    );
    assert!(seen.iter().all(|(m, _)| m.records.is_empty()), "no records");
    assert!(answers.is_empty(), "no triggers, no answers");
    ended_at_expiry("the idle watch", &w_end, w_at, due);
    ended_at_expiry("the idle DeliverTriggers", &t_end, t_at, due);
    let fresh = jwt("reader", "alice", 600);
    let mut again = None;
    for _ in 0..20 {
        match RecordServiceClient::new(bearer(&ch, &fresh))
            .watch_records(pb::WatchRecordsRequest {
                start: Some(pb::watch_records_request::Start::FromNow(true)),
                ..Default::default()
            })
            .await
        {
            Ok(w) => {
                again = Some(w);
                break;
            }
            Err(e) => {
                assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    assert!(
        again.is_some(),
        "the expired watch's slot was not given back within 2 s"
    );
}
on_both_stores!(idle_streams_end_when_their_jwts_expire => idle_streams_end_when_their_jwts_expire);

/// A channel whose receive windows are HTTP/2's smallest: a stream it does not read stops
/// the server's sending after 64 KiB.
async fn small_window(app: &TestApp) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{}", app.addr))
        .expect("uri")
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(65_535)
        .connect()
        .await
        .expect("connect")
}

/// Delivers alice's triggers until `until` (Unix seconds) or `most` of them: each record's id
/// and when its delivery was answered.
async fn deliver_until(ch: &Channel, until: f64, most: usize, tag: &str) -> Vec<(String, f64)> {
    let mut runtime = IngestServiceClient::new(bearer(ch, RUNTIME));
    let mut sent = Vec::new();
    for i in 0..most {
        if now_f64() > until {
            break;
        }
        let r = runtime
            .deliver_trigger(DeliverTriggerRequest {
                trigger_id: format!("{tag}-{i}"),
                ..crate::identity::opened("alice")
            })
            .await
            .expect("deliver")
            .into_inner();
        sent.push((r.record_id, now_f64()));
    }
    sent
}

/// Tries to open a watch with a fresh JWT every 100 ms until `until` (Unix seconds): when one
/// opened, if any.
async fn opens_by(ch: &Channel, until: f64) -> Option<f64> {
    let fresh = jwt("reader", "alice", 600);
    loop {
        match RecordServiceClient::new(bearer(ch, &fresh))
            .watch_records(pb::WatchRecordsRequest {
                principal: "alice".into(),
                start: Some(pb::watch_records_request::Start::FromNow(true)),
                ..Default::default()
            })
            .await
        {
            Ok(_) => return Some(now_f64()),
            Err(e) => assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}"),
        }
        if now_f64() > until {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A watch whose reader never reads (its window full) is still ended at its JWT's expiry: its
/// slot (`--max-watches 1`) is free again by then, and reading afterwards yields only records
/// committed before the expiry, then UNAUTHENTICATED.
async fn a_watch_that_never_reads_ends_at_its_jwts_expiry(kind: StoreKind) {
    let (app, _dir) = secured_with(kind, |c| c.max_watches = 1).await;
    let ch = app.channel.clone();
    crate::identity::set_up(&ch, ADMIN, &["alice"]).await;
    let exp = now() + 5;
    let due = (exp + JWT_LEEWAY_SECS as i64) as f64;
    let slow = small_window(&app).await;
    let mut watch = watch_as(&slow, &jwt_until("reader", "alice", exp)).await;
    // Far more than 64 KiB of records, none read: four producers at once.
    let producers: Vec<_> = (0..4)
        .map(|p| {
            let ch = ch.clone();
            tokio::spawn(
                async move { deliver_until(&ch, due - 2.0, 200, &format!("before{p}")).await },
            )
        })
        .collect();
    let mut before = Vec::new();
    for p in producers {
        before.extend(p.await.expect("producer"));
    }
    assert!(before.len() >= 300, "{} delivered", before.len());
    assert!(now_f64() < due - 0.5);
    assert_eq!(
        opens_by(&ch, 0.0).await,
        None,
        "the unread watch holds the only slot before its expiry"
    );
    let opened = opens_by(&ch, due + 3.0).await.expect("the slot given back");
    assert!(
        opened >= due - 0.5 && opened <= due + 1.5,
        "the slot came back {:+.3} s from the expiry",
        opened - due
    );
    let after = deliver_until(&ch, f64::MAX, 5, "after").await;
    let (got, end, _) = until_status(&mut watch, Duration::from_secs(30)).await;
    assert_eq!(end.code(), Code::Unauthenticated, "{end:?}");
    assert!(end.message().contains("expired"), "{}", end.message());
    let ok: std::collections::HashSet<&String> = before.iter().map(|(id, _)| id).collect();
    let streamed: Vec<String> = got
        .iter()
        .flat_map(|(m, _)| m.records.iter().map(|r| r.record_id.clone()))
        .collect();
    assert!(
        !streamed.is_empty(),
        "what was sent before the expiry is read"
    );
    assert!(
        streamed.len() < before.len(),
        "not everything: the window held"
    );
    assert!(
        streamed.iter().all(|id| ok.contains(id)),
        "only records committed before the expiry"
    );
    assert!(after
        .iter()
        .all(|(id, _)| !streamed.iter().any(|s| s == id)));
}
on_both_stores!(s7_5_a_watch_that_never_reads_ends_at_its_jwts_expiry => a_watch_that_never_reads_ends_at_its_jwts_expiry);

/// A watch whose reader never reads gives its slot back at `--watch-max-lag-secs`, without
/// waiting for the reader to take its end: with `--max-watches 1` another opens then.
async fn a_watch_that_never_reads_gives_its_slot_back_at_the_lag_bound(kind: StoreKind) {
    let (app, _dir) = secured_with(kind, |c| {
        c.max_watches = 1;
        c.watch_max_lag = Duration::from_secs(1);
    })
    .await;
    let ch = app.channel.clone();
    crate::identity::set_up(&ch, ADMIN, &["alice"]).await;
    let slow = small_window(&app).await;
    let mut watch = watch_as(&slow, READER).await;
    let before = deliver_until(&ch, f64::MAX, 400, "lag").await;
    let delivered = now_f64();
    let opened = opens_by(&ch, delivered + 6.0)
        .await
        .expect("the slot given back after the lag bound");
    assert!(opened - delivered < 5.0, "{:.3} s", opened - delivered);
    let (got, end, _) = until_status(&mut watch, Duration::from_secs(30)).await;
    assert_ne!(end.code(), Code::Ok, "{end:?}");
    assert!(end.message().contains("resume"), "{}", end.message());
    let streamed = got.iter().map(|(m, _)| m.records.len()).sum::<usize>();
    assert!(streamed < before.len(), "{streamed} of {}", before.len());
}
on_both_stores!(s7_5_a_watch_that_never_reads_gives_its_slot_back_at_the_lag_bound => a_watch_that_never_reads_gives_its_slot_back_at_the_lag_bound);

// --- Failed authentications from others never lock out valid callers ---

/// JWT signature checks so far, `(checks, seconds)` for callers within their address's budget
/// of failed authentications and for those over it, from /metrics.
async fn signature_checks(metrics_addr: impl std::fmt::Display) -> [(f64, f64); 2] {
    let url = format!("http://{metrics_addr}/metrics");
    let text = tokio::task::spawn_blocking(move || crate::helpers::http_get(&url))
        .await
        .expect("scrape");
    let sample = |name: &str, budget: &str| {
        let prefix = format!("hcp_sense_{name}_total{{budget=\"{budget}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {prefix} in /metrics:\n{text}"))
    };
    ["within", "over"].map(|b| {
        (
            sample("auth_signature_checks", b),
            sample("auth_signature_check_seconds", b),
        )
    })
}

/// `--auth-failure-rate-per-sec 1` (bursts of 2): an address's first two failed signatures
/// are checked at once, the third in turn with every other over-budget check — and still
/// heard. A valid JWT first seen then is accepted and remembered, static tokens are never
/// checked, and refusals that need no cryptography (malformed, an algorithm no key has,
/// expired) spend no signature check at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_failure_budget_an_address_is_checked_in_turn_never_refused_unheard() {
    let (app, _dir) = secured_with(StoreKind::Sqlite, |c| c.auth_failure_rate_per_sec = 1.0).await;
    let list = "/hcp.sense.v1.PackService/ListPacks";
    let forged = |i: usize| {
        jwt_signed(
            "not-the-secret-but-as-long-as-it-32",
            "admin",
            &format!("guess-{i}"),
            now() + 600,
        )
    };
    let start = signature_checks(app.metrics_addr).await;
    for i in 0..2 {
        assert_eq!(
            call(&app.channel, &forged(i), list).await,
            Code::Unauthenticated
        );
    }
    let at_budget = signature_checks(app.metrics_addr).await;
    assert_eq!(
        at_budget[0].0 - start[0].0,
        2.0,
        "two checked within the budget"
    );
    assert_eq!(at_budget[1].0 - start[1].0, 0.0, "none over it");
    // The third is past the budget: refused as itself, not as its address.
    assert_eq!(
        call(&app.channel, &forged(2), list).await,
        Code::Unauthenticated
    );
    let late = jwt("admin", "ops-late", 600);
    assert_eq!(
        call(&app.channel, &late, list).await,
        Code::Ok,
        "a valid JWT first seen over budget"
    );
    assert_eq!(call(&app.channel, &late, list).await, Code::Ok, "and again");
    assert_eq!(
        call(&app.channel, ADMIN, list).await,
        Code::Ok,
        "a static token"
    );
    let hs384 = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS384),
        &serde_json::json!({ "sub": "x", "role": "admin", "exp": now() + 600, "iss": "hcp-tests", "aud": "hcp-sense" }),
        &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()).expect("key"),
    )
    .expect("hs384");
    let expired = jwt("admin", "old-ops", -3600);
    for (why, t) in [
        ("malformed", "a.b.c"),
        ("HS384", hs384.as_str()),
        ("expired", expired.as_str()),
    ] {
        assert_eq!(
            call(&app.channel, t, list).await,
            Code::Unauthenticated,
            "{why}"
        );
    }
    let end = signature_checks(app.metrics_addr).await;
    assert_eq!(end[0].0 - start[0].0, 2.0, "within: the first two guesses");
    assert_eq!(
        end[1].0 - start[1].0,
        2.0,
        "over: the third guess and the valid JWT's first call; nothing else was checked"
    );
}

/// A P-256 key made by openssl, for signing, and its public JWK named `kid`.
fn es256_key(
    dir: &std::path::Path,
    name: &str,
    kid: &str,
) -> (jsonwebtoken::EncodingKey, jsonwebtoken::jwk::Jwk) {
    use jsonwebtoken::{jwk, Algorithm, EncodingKey};
    let path = dir.join(format!("{name}.key"));
    let ok = std::process::Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
        ])
        .arg(&path)
        .status()
        .expect("openssl");
    assert!(ok.success());
    let key = EncodingKey::from_ec_pem(&std::fs::read(&path).expect("key")).expect("ec key");
    let mut public = jwk::Jwk::from_encoding_key(&key, Algorithm::ES256).expect("jwk");
    public.common.key_id = Some(kid.into());
    (key, public)
}

/// The CPU time a process has used so far, in seconds (user and system, from /proc).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name; 100 ticks a second.
    (ticks(11) + ticks(12)) / 100.0
}

/// One address (every connection here comes from 127.0.0.1) floods a served hcp-sense with
/// JWTs that fail their ES256 signature check, far past `--auth-failure-rate-per-sec` 5:
/// every one is refused UNAUTHENTICATED, while callers behind the same address are never
/// refused — a JWT verified before, a static token, and valid JWTs first seen during the
/// flood. The over-budget checks run one at a time: their time adds up to no more than the
/// flood's wall time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_jwts_from_a_shared_address_never_lock_out_its_valid_callers() {
    use hcp_sense::grpc::guard::OVER_BUDGET_CHECKS;
    use jsonwebtoken::{Algorithm, EncodingKey, Header};
    let db = crate::helpers::TestDb::create(StoreKind::Sqlite).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (key, public) = es256_key(dir.path(), "issuer", "k1");
    // Another key under the same kid: its tokens get as far as a real signature check.
    let (forger, _) = es256_key(dir.path(), "forger", "k1");
    let jwks = dir.path().join("jwks.json");
    std::fs::write(
        &jwks,
        serde_json::to_string(&jsonwebtoken::jwk::JwkSet { keys: vec![public] }).expect("json"),
    )
    .expect("write");
    let config = dir.path().join("hcp-sense.toml");
    std::fs::write(
        &config,
        format!(
            "[[auth.tokens]]\nname = \"ops\"\nsha256 = \"{}\"\nrole = \"admin\"\n\n[auth.jwt]\njwks_file = \"{}\"\nissuer = \"hcp-tests\"\naudience = \"hcp-sense\"\n",
            hex::encode(Sha256::digest(ADMIN.as_bytes())),
            jwks.display()
        ),
    )
    .expect("config");
    let mut cmd = crate::support::served::serve_command(&db.url);
    cmd.arg("--config")
        .arg(&config)
        .args(["--auth-failure-rate-per-sec", "5"]);
    let served = crate::support::served::Served::spawn(cmd);
    let sign = |k: &EncodingKey, sub: &str| {
        let mut h = Header::new(Algorithm::ES256);
        h.kid = Some("k1".into());
        jsonwebtoken::encode(
            &h,
            &serde_json::json!({ "sub": sub, "role": "admin", "iss": "hcp-tests", "aud": "hcp-sense", "exp": now() + 600 }),
            k,
        )
        .expect("sign")
    };
    let list = "/hcp.sense.v1.PackService/ListPacks";
    let connect = || {
        Channel::from_shared(format!("http://{}", served.addr))
            .expect("uri")
            .connect_lazy()
    };
    let steady = sign(&key, "steady");
    assert_eq!(call(&connect(), &steady, list).await, Code::Ok);
    let forged: Arc<Vec<String>> = Arc::new(
        (0..64)
            .map(|i| sign(&forger, &format!("guess-{i}")))
            .collect(),
    );
    let fresh: Vec<String> = (0..5).map(|i| sign(&key, &format!("late-{i}"))).collect();
    let before = signature_checks(&served.metrics_addr).await;
    let cpu_before = cpu_seconds(served.pid());
    let flood_for = Duration::from_secs(3);
    let started = std::time::Instant::now();
    let flooders: Vec<_> = (0..8)
        .map(|f| {
            let (ch, forged) = (connect(), forged.clone());
            tokio::spawn(async move {
                let mut codes = Vec::new();
                while started.elapsed() < flood_for {
                    let t = &forged[(f * 8 + codes.len()) % forged.len()];
                    codes.push(call(&ch, t, list).await);
                }
                codes
            })
        })
        .collect();
    let valid = {
        let (ch, steady) = (connect(), steady.clone());
        tokio::spawn(async move {
            let mut codes = Vec::new();
            while started.elapsed() < flood_for {
                codes.push(call(&ch, &steady, list).await);
                codes.push(call(&ch, ADMIN, list).await);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            codes
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let late = connect();
    let mut waits = Vec::new();
    for t in &fresh {
        let t0 = std::time::Instant::now();
        assert_eq!(
            call(&late, t, list).await,
            Code::Ok,
            "a valid JWT first seen during the flood"
        );
        waits.push(t0.elapsed());
    }
    let mut refused = Vec::new();
    for f in flooders {
        refused.extend(f.await.expect("flooder"));
    }
    let wall = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds(served.pid()) - cpu_before;
    let valid = valid.await.expect("valid caller");
    let after = signature_checks(&served.metrics_addr).await;
    assert!(refused.len() > 100, "a flood: {} calls", refused.len());
    assert!(
        refused.iter().all(|c| *c == Code::Unauthenticated),
        "every bad JWT is refused as such: {refused:?}"
    );
    assert!(valid.len() > 20, "{valid:?}");
    assert!(valid.iter().all(|c| *c == Code::Ok), "{valid:?}");
    let (over, over_secs) = (after[1].0 - before[1].0, after[1].1 - before[1].1);
    let within = after[0].0 - before[0].0;
    eprintln!(
        "flood: {} bad JWTs in {wall:.2} s; signature checks within budget {within}, over {over} ({:.1}/s, {over_secs:.3} s of checking, {:.0}% of the wall time); server CPU {cpu:.2} s ({:.0}% of one core); first calls of fresh JWTs waited {waits:?}",
        refused.len(),
        over / wall,
        100.0 * over_secs / wall,
        100.0 * cpu / wall,
    );
    assert!(over > 0.0, "the address went over its budget");
    assert!(
        over_secs <= OVER_BUDGET_CHECKS as f64 * wall + 0.05,
        "over-budget checks took {over_secs:.3} s in {wall:.3} s: more than {OVER_BUDGET_CHECKS} at a time"
    );
    assert!(served.terminate());
}
