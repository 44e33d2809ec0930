//! Authentication and roles over real gRPC: every RPC × every caller, refused calls change nothing,
//! readers read only as themselves, and oversized input is refused.
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

const ADMIN: &str = "admin-token-9f3c";
const RUNTIME: &str = "runtime-token-71ab";
const READER: &str = "reader-token-alice";
const SECRET: &str = "jwt-shared-secret-for-tests-32-bytes-long";

pub fn token(name: &str, secret: &str, role: Role, principal: Option<&str>) -> TokenConfig {
    TokenConfig {
        name: name.into(),
        sha256: hex::encode(Sha256::digest(secret.as_bytes())),
        role,
        principal: principal.map(str::to_owned),
    }
}

fn jwt(role: &str, sub: &str, exp_offset: i64) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &serde_json::json!({ "sub": sub, "role": role, "exp": now + exp_offset, "iss": "hcp-tests", "aud": "hcp-sense" }),
        &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()).expect("key"),
    )
    .expect("jwt")
}

async fn secured(kind: StoreKind) -> (TestApp, tempfile::TempDir) {
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
        let mine = reader.list_records(ListRecordsRequest { viewer: "bob".into(), ..Default::default() }).await.expect("own").into_inner().records;
        assert_eq!(mine.len(), 1, "only alice's, whatever `viewer` says");
        assert!(mine.iter().all(|r| r.principal == "alice"));
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
    let ok = std::process::Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
        ])
        .arg(dir.path().join("es.key"))
        .status()
        .expect("openssl");
    assert!(ok.success());
    let pem = std::fs::read(dir.path().join("es.key")).expect("key");
    let key = EncodingKey::from_ec_pem(&pem).expect("ec key");
    let mut public = jwk::Jwk::from_encoding_key(&key, Algorithm::ES256).expect("jwk");
    public.common.key_id = Some("k1".into());
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
/// 5 s leeway): UNAUTHENTICATED in place of the first trigger after it, never a trigger
/// decided on a credential that is no longer accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_ends_when_its_jwt_expires() {
    use hcp_sense::grpc::pb::{ingest_service_client::IngestServiceClient, DeliverTriggersRequest};
    let (app, _dir) = secured(StoreKind::Sqlite).await;
    // Expired 4 s ago: still inside the leeway for about one more second.
    let short = jwt("runtime", "relay", -4);
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
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    tx.send(trigger()).await.expect("send");
    let end = answers.message().await.expect_err("the stream ends");
    assert_eq!(end.code(), Code::Unauthenticated, "{end:?}");
    assert!(end.message().contains("expired"), "{}", end.message());
}
