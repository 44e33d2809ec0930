//! Who a caller is, under attack: certificates parsed as X.509 (subject CN or URI SAN only), principals never empty,
//! JWT claims required, secrets read as bytes, refusals that say nothing, and limits keyed by credential.
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hcp_sense::auth::{AuthConfig, CertIdentity, JwtConfig, Role};
use hcp_sense::config::Config;
use hcp_sense::grpc::pb::{
    self, ingest_service_client::IngestServiceClient, policy_service_client::PolicyServiceClient,
    record_service_client::RecordServiceClient, DeliverTriggerRequest, ListRecordsRequest,
};
use rcgen::{
    BasicConstraints, CertificateParams, CustomExtension, DistinguishedName, DnType, DnValue,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, SanType,
};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
use tonic::Code;

use crate::helpers::{example, spawn_app_with, StoreKind, TestApp};
use crate::packs::register_req;
use crate::security::{bearer, token};

const ADMIN: &str = "admin-token-identity";
const RUNTIME: &str = "runtime-token-identity";
/// Exactly the shortest secret accepted.
const SECRET32: &[u8; 32] = b"0123456789abcdef0123456789abcdef";

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

fn sign(secret: &[u8], claims: serde_json::Value) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(secret).expect("key"),
    )
    .expect("jwt")
}

/// Registers `github`, and grants, links and activates (inbox) each principal.
pub async fn set_up(ch: &Channel, admin: &str, principals: &[&str]) {
    set_up_pack(ch, admin, &example("github.pack.json"), principals).await;
}

/// Registers the pack of `manifest` as `admin`, then grants, links and activates (inbox) it
/// for each of `principals`.
pub async fn set_up_pack(
    ch: &Channel,
    admin: &str,
    manifest: &serde_json::Value,
    principals: &[&str],
) {
    let pack = manifest["id"]
        .as_str()
        .expect("the manifest's id")
        .to_owned();
    pb::pack_service_client::PackServiceClient::new(bearer(ch, admin))
        .register_pack(register_req(manifest))
        .await
        .expect("register");
    let mut policy = PolicyServiceClient::new(bearer(ch, admin));
    for who in principals {
        policy
            .grant_sense_enable(pb::GrantSenseEnableRequest {
                principal: (*who).into(),
                pack_id: pack.clone(),
            })
            .await
            .expect("grant");
        policy
            .put_binding(pb::PutBindingRequest {
                principal: (*who).into(),
                pack_id: pack.clone(),
                binding_id: format!("b-{}", who.len()),
                state: pb::BindingState::Linked as i32,
            })
            .await
            .expect("bind");
        policy
            .activate_sense(pb::ActivateSenseRequest {
                principal: (*who).into(),
                pack_id: pack.clone(),
                route: pb::Route::Inbox as i32,
                filter: String::new(),
            })
            .await
            .expect("activate");
    }
}

pub fn opened(principal: &str) -> DeliverTriggerRequest {
    crate::support::trigger::trigger("github", "issue.opened", principal, "user")
}

// --- DER by hand, for the extensions a hostile CA writes ---

fn tlv(tag: u8, content: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    let n = content.len();
    if n < 0x80 {
        out.push(n as u8);
    } else {
        let bytes: Vec<u8> = n
            .to_be_bytes()
            .into_iter()
            .skip_while(|b| *b == 0)
            .collect();
        out.push(0x80 | bytes.len() as u8);
        out.extend(bytes);
    }
    out.extend_from_slice(content);
    out
}

/// `Name ::= SEQUENCE { SET { SEQUENCE { id-at-commonName, UTF8String } } }`.
fn name_with_cn(cn: &str) -> Vec<u8> {
    let mut atv = tlv(0x06, &[0x55, 0x04, 0x03]);
    atv.extend(tlv(0x0c, cn.as_bytes()));
    tlv(0x30, &tlv(0x31, &tlv(0x30, &atv)))
}

pub(crate) struct Pki {
    dir: tempfile::TempDir,
    issuer: Issuer<'static, KeyPair>,
}

impl Pki {
    pub(crate) fn new() -> Pki {
        let dir = tempfile::tempdir().expect("tempdir");
        let key = KeyPair::generate().expect("key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name = DistinguishedName::new();
        ca.distinguished_name.push(DnType::CommonName, "ops-ca");
        let cert = ca.self_signed(&key).expect("ca");
        std::fs::write(dir.path().join("ca.pem"), cert.pem()).expect("ca.pem");
        std::fs::write(dir.path().join("ca.key"), key.serialize_pem()).expect("ca.key");
        let issuer = Issuer::new(ca, key);
        let pki = Pki { dir, issuer };
        let mut server = CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
        server
            .subject_alt_names
            .push(SanType::IpAddress([127, 0, 0, 1].into()));
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        pki.write("server", server);
        pki
    }

    pub(crate) fn path(&self, f: &str) -> std::path::PathBuf {
        self.dir.path().join(f)
    }

    fn write(&self, name: &str, params: CertificateParams) {
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        std::fs::write(self.path(&format!("{name}.pem")), cert.pem()).expect("pem");
        std::fs::write(self.path(&format!("{name}.key")), key.serialize_pem()).expect("key");
    }

    /// A client certificate with these subject attributes and extra extensions.
    fn client(&self, name: &str, subject: &[(DnType, DnValue)], extra: Vec<CustomExtension>) {
        let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
        p.distinguished_name = DistinguishedName::new();
        for (t, v) in subject {
            p.distinguished_name.push(t.clone(), v.clone());
        }
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        p.custom_extensions = extra;
        self.write(name, p);
    }

    /// A client certificate made by openssl's own tools, for subjects rcgen cannot write
    /// (two common names).
    fn openssl_client(&self, name: &str, subject: &str) {
        let script = format!(
            "set -e\nopenssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout {name}.key -out {name}.csr -subj '{subject}' 2>/dev/null\nprintf 'extendedKeyUsage=clientAuth\\n' > {name}.ext\nopenssl x509 -req -in {name}.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out {name}.pem -days 2 -extfile {name}.ext 2>/dev/null\n"
        );
        let ok = std::process::Command::new("bash")
            .args(["-c", &script])
            .current_dir(self.dir.path())
            .status()
            .expect("openssl must be installed (see .ci/run)");
        assert!(ok.success(), "openssl made {name}");
    }

    fn tls(&self, client: Option<&str>) -> ClientTlsConfig {
        let read = |f: &str| std::fs::read(self.path(f)).expect("pem");
        let mut c = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read("ca.pem")))
            .domain_name("localhost");
        if let Some(n) = client {
            c = c.identity(Identity::from_pem(
                read(&format!("{n}.pem")),
                read(&format!("{n}.key")),
            ));
        }
        c
    }

    async fn channel(&self, app: &TestApp, client: Option<&str>) -> Channel {
        Channel::from_shared(format!("https://127.0.0.1:{}", app.addr.port()))
            .expect("uri")
            .tls_config(self.tls(client))
            .expect("tls")
            .connect()
            .await
            .expect("TLS connect")
    }

    fn configure(&self, c: &mut Config, by: CertIdentity) {
        c.auth = AuthConfig {
            tokens: vec![
                token("ops", ADMIN, Role::Admin, None),
                token("harness", RUNTIME, Role::Runtime, None),
            ],
            jwt: None,
        };
        c.auth_failure_rate_per_sec = 0.0;
        c.tls = hcp_sense::config::TlsOptions {
            cert_file: Some(self.path("server.pem")),
            key_file: Some(self.path("server.key")),
            client_ca_file: Some(self.path("ca.pem")),
            client_role: Role::Reader,
            client_identity: by,
        };
    }
}

/// The principals whose records a certificate's holder reads, or the refusal's code.
async fn reads(pki: &Pki, app: &TestApp, client: &str) -> Result<Vec<String>, Code> {
    let ch = pki.channel(app, Some(client)).await;
    match RecordServiceClient::new(ch)
        .list_records(ListRecordsRequest::default())
        .await
    {
        Ok(r) => {
            let mut who: Vec<String> = r
                .into_inner()
                .records
                .into_iter()
                .map(|r| r.principal)
                .collect();
            who.dedup();
            Ok(who)
        }
        Err(s) => Err(s.code()),
    }
}

/// A stream opened with a client certificate ends at the certificate's notAfter with
/// UNAUTHENTICATED, and the connection — verified by TLS while the certificate was valid —
/// carries no call on it afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_opened_with_a_client_certificate_ends_at_its_not_after() {
    let pki = Pki::new();
    let app = spawn_app_with(StoreKind::Sqlite, |c| {
        pki.configure(c, CertIdentity::CommonName)
    })
    .await;
    let admin = pki.channel(&app, None).await;
    set_up(&admin, ADMIN, &["alice"]).await;
    // Issued now, so that its few seconds are left for the stream.
    let not_after = now() + 4;
    let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
    p.distinguished_name = DistinguishedName::new();
    p.distinguished_name.push(DnType::CommonName, "alice");
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    p.not_after = rcgen::date_time_ymd(1970, 1, 1) + Duration::from_secs(not_after as u64);
    pki.write("short", p);
    let mine = pki.channel(&app, Some("short")).await;
    let mut watch = RecordServiceClient::new(mine.clone())
        .watch_records(pb::WatchRecordsRequest {
            start: Some(pb::watch_records_request::Start::FromNow(true)),
            ..Default::default()
        })
        .await
        .expect("watch by certificate")
        .into_inner();
    IngestServiceClient::new(bearer(&admin, RUNTIME))
        .deliver_trigger(opened("alice"))
        .await
        .expect("deliver");
    let (got, end, at) = crate::security::until_status(&mut watch, Duration::from_secs(30)).await;
    let records: usize = got.iter().map(|(m, _)| m.records.len()).sum();
    assert_eq!(records, 1, "the record before notAfter is streamed");
    crate::security::ended_at_expiry("the certificate's watch", &end, at, not_after as f64);
    let e = RecordServiceClient::new(mine)
        .list_records(ListRecordsRequest::default())
        .await
        .expect_err("a call after notAfter on the same connection");
    assert_eq!(e.code(), Code::Unauthenticated);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_names_its_holder_by_the_subject_common_name_only() {
    let pki = Pki::new();
    let cn = |s: &str| (DnType::CommonName, DnValue::Utf8String(s.into()));
    // CN=mallory, with a SAN directoryName CN=alice.
    let mut san = Vec::new();
    san.extend(tlv(0xa4, &name_with_cn("alice")));
    pki.client(
        "san-dirname",
        &[cn("mallory")],
        vec![CustomExtension::from_oid_content(
            &[2, 5, 29, 17],
            tlv(0x30, &san),
        )],
    );
    // CN=mallory, with an OU whose text holds the encoded bytes of CN=alice.
    pki.client(
        "ou-bytes",
        &[
            (
                DnType::OrganizationalUnitName,
                DnValue::Utf8String("\u{6}\u{3}U\u{4}\u{3}\u{c}\u{5}alice".into()),
            ),
            cn("mallory"),
        ],
        vec![],
    );
    // CN=alice, whose authority key identifier names the CA's issuer (CN=ops-ca) after it.
    let aki = tlv(0x30, &tlv(0xa1, &tlv(0xa4, &name_with_cn("ops-ca"))));
    pki.client(
        "aki-issuer",
        &[cn("alice")],
        vec![CustomExtension::from_oid_content(&[2, 5, 29, 35], aki)],
    );
    // Refused: no CN, two CNs, a CN that is not a valid id.
    pki.client(
        "no-cn",
        &[(DnType::OrganizationName, DnValue::Utf8String("corp".into()))],
        vec![],
    );
    pki.openssl_client("two-cn", "/CN=alice/CN=mallory");
    pki.client("spaced-cn", &[cn("alice admin")], vec![]);
    pki.client("eq-cn", &[cn("alice=admin")], vec![]);

    let app = spawn_app_with(StoreKind::Sqlite, |c| {
        pki.configure(c, CertIdentity::CommonName)
    })
    .await;
    let plain = pki.channel(&app, None).await;
    set_up(&plain, ADMIN, &["alice", "mallory", "ops-ca"]).await;
    let mut runtime = IngestServiceClient::new(bearer(&plain, RUNTIME));
    for who in ["alice", "mallory", "ops-ca"] {
        runtime.deliver_trigger(opened(who)).await.expect("deliver");
    }
    assert_eq!(
        reads(&pki, &app, "san-dirname").await,
        Ok(vec!["mallory".to_owned()])
    );
    assert_eq!(
        reads(&pki, &app, "ou-bytes").await,
        Ok(vec!["mallory".to_owned()])
    );
    assert_eq!(
        reads(&pki, &app, "aki-issuer").await,
        Ok(vec!["alice".to_owned()])
    );
    for refused in ["no-cn", "two-cn", "spaced-cn", "eq-cn"] {
        assert_eq!(
            reads(&pki, &app, refused).await,
            Err(Code::Unauthenticated),
            "{refused}"
        );
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_names_its_holder_by_its_uri_san_when_told_to() {
    let pki = Pki::new();
    let spiffe = "spiffe://corp/ns/alice";
    let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
    p.distinguished_name = DistinguishedName::new();
    p.distinguished_name.push(DnType::CommonName, "mallory");
    p.subject_alt_names = vec![SanType::URI(spiffe.try_into().expect("ia5"))];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    pki.write("spiffe", p);
    let mut two = CertificateParams::new(Vec::<String>::new()).expect("params");
    two.subject_alt_names = vec![
        SanType::URI(spiffe.try_into().expect("ia5")),
        SanType::URI("spiffe://corp/ns/bob".try_into().expect("ia5")),
    ];
    two.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    pki.write("two-uris", two);
    pki.client(
        "cn-only",
        &[(DnType::CommonName, DnValue::Utf8String(spiffe.into()))],
        vec![],
    );
    let app = spawn_app_with(StoreKind::Sqlite, |c| {
        pki.configure(c, CertIdentity::UriSan)
    })
    .await;
    let plain = pki.channel(&app, None).await;
    set_up(&plain, ADMIN, &[spiffe, "mallory"]).await;
    let mut runtime = IngestServiceClient::new(bearer(&plain, RUNTIME));
    for who in [spiffe, "mallory"] {
        runtime.deliver_trigger(opened(who)).await.expect("deliver");
    }
    assert_eq!(
        reads(&pki, &app, "spiffe").await,
        Ok(vec![spiffe.to_owned()])
    );
    // A CN is not a URI SAN, and two URIs are ambiguous.
    assert_eq!(
        reads(&pki, &app, "cn-only").await,
        Err(Code::Unauthenticated)
    );
    assert_eq!(
        reads(&pki, &app, "two-uris").await,
        Err(Code::Unauthenticated)
    );
    app.stop().await;
}

fn jwt_config(dir: &std::path::Path, secret: &[u8]) -> JwtConfig {
    let path = dir.join("hs256.secret");
    std::fs::write(&path, secret).expect("secret");
    JwtConfig {
        hs256_secret_file: Some(path),
        issuer: Some("https://id.example".into()),
        audience: Some("hcp-sense".into()),
        ..Default::default()
    }
}

/// A change to a test server's configuration.
type Adjust = Box<dyn FnOnce(&mut Config)>;

async fn build(adjust: impl FnOnce(&mut Config)) -> anyhow::Result<()> {
    let db = crate::helpers::TestDb::create(StoreKind::Sqlite).await;
    let mut config = Config::for_database(db.url.clone());
    adjust(&mut config);
    hcp_sense::app::App::build(config).await.map(drop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_at_start_empty_principals_short_secrets_duplicate_tokens_and_orphan_client_ca() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cases: Vec<(&str, Adjust, &str)> = vec![
        (
            "reader with an empty principal",
            Box::new(|c: &mut Config| {
                c.auth.tokens = vec![token("r", "reader-secret", Role::Reader, Some(""))]
            }),
            "principal must be non-empty",
        ),
        (
            "reader with a spaced principal",
            Box::new(|c: &mut Config| {
                c.auth.tokens = vec![token("r", "reader-secret", Role::Reader, Some("a b"))]
            }),
            "whitespace",
        ),
        (
            "two tokens, one secret",
            Box::new(|c: &mut Config| {
                c.auth.tokens = vec![
                    token("ops", "same-secret", Role::Admin, None),
                    token("rt", "same-secret", Role::Runtime, None),
                ]
            }),
            "same sha256",
        ),
        (
            "two tokens, one name",
            Box::new(|c: &mut Config| {
                c.auth.tokens = vec![
                    token("ops", "secret-1", Role::Admin, None),
                    token("ops", "secret-2", Role::Runtime, None),
                ]
            }),
            "configured twice",
        ),
        (
            "a 31-byte HS256 secret",
            Box::new({
                let j = jwt_config(dir.path(), &SECRET32[..31]);
                move |c: &mut Config| c.auth.jwt = Some(j)
            }),
            "at least 32 bytes, not 31",
        ),
    ];
    for (what, adjust, want) in cases {
        let e = build(adjust).await.expect_err(what);
        assert!(e.to_string().contains(want), "{what}: {e}");
    }
    // The boundary: 32 bytes are accepted.
    let j = jwt_config(dir.path(), SECRET32);
    build(move |c| c.auth.jwt = Some(j))
        .await
        .expect("a 32-byte secret");
    // A client CA without a server certificate would be ignored silently: refused.
    let e = hcp_sense::config::Config::from_args(["hcp-sense", "--tls-client-ca-file", "ca.pem"])
        .expect_err("client CA alone");
    assert!(e.to_string().contains("--tls-client-ca-file needs"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwts_need_their_claims_and_refusals_say_nothing_more() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A binary secret, ending in a newline and a byte that is not UTF-8: used as is.
    let mut secret = SECRET32.to_vec();
    secret.extend_from_slice(b"\xff\n");
    let jwt = jwt_config(dir.path(), &secret);
    let app = spawn_app_with(StoreKind::Sqlite, |c| {
        c.auth_failure_rate_per_sec = 0.0;
        c.auth = AuthConfig {
            tokens: vec![token("ops", ADMIN, Role::Admin, None)],
            jwt: Some(jwt),
        };
    })
    .await;
    let full = |extra: serde_json::Value| {
        let mut c = serde_json::json!({ "sub": "alice", "role": "reader", "iss": "https://id.example", "aud": "hcp-sense", "exp": now() + 600 });
        for (k, v) in extra.as_object().expect("object") {
            if v.is_null() {
                c.as_object_mut().expect("object").remove(k);
            } else {
                c[k] = v.clone();
            }
        }
        c
    };
    let list = |t: String| {
        let ch = app.channel.clone();
        async move {
            RecordServiceClient::new(bearer(&ch, &t))
                .list_records(ListRecordsRequest::default())
                .await
        }
    };
    list(sign(&secret, full(serde_json::json!({}))))
        .await
        .expect("a complete token signed with the exact bytes");
    let refused = [
        (
            "no iss",
            sign(&secret, full(serde_json::json!({ "iss": null }))),
        ),
        (
            "no aud",
            sign(&secret, full(serde_json::json!({ "aud": null }))),
        ),
        (
            "no sub",
            sign(&secret, full(serde_json::json!({ "sub": null }))),
        ),
        (
            "empty sub",
            sign(&secret, full(serde_json::json!({ "sub": "" }))),
        ),
        (
            "sub with =",
            sign(&secret, full(serde_json::json!({ "sub": "alice=x" }))),
        ),
        (
            "numeric sub",
            sign(&secret, full(serde_json::json!({ "sub": 7 }))),
        ),
        (
            "expired",
            sign(&secret, full(serde_json::json!({ "exp": now() - 600 }))),
        ),
        (
            "trimmed secret",
            sign(&secret[..33], full(serde_json::json!({}))),
        ),
        (
            "lossy secret",
            sign(&SECRET32[..], full(serde_json::json!({}))),
        ),
    ];
    for (why, t) in refused {
        let e = list(t).await.expect_err(why);
        assert_eq!(e.code(), Code::Unauthenticated, "{why}");
        assert_eq!(e.message(), "credentials refused", "{why}");
    }
    let e = RecordServiceClient::new(app.channel.clone())
        .list_records(ListRecordsRequest::default())
        .await
        .expect_err("no credentials");
    assert_eq!(e.code(), Code::Unauthenticated);
    assert!(
        e.message().starts_with("credentials required"),
        "{}",
        e.message()
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_jwt_with_an_empty_principal_claim_reads_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut jwt = jwt_config(dir.path(), SECRET32);
    jwt.principal_claim = Some("principal".into());
    let app = spawn_app_with(StoreKind::Sqlite, |c| {
        c.auth_failure_rate_per_sec = 0.0;
        c.auth = AuthConfig {
            tokens: vec![
                token("ops", ADMIN, Role::Admin, None),
                token("harness", RUNTIME, Role::Runtime, None),
            ],
            jwt: Some(jwt),
        };
    })
    .await;
    set_up(&app.channel, ADMIN, &["alice", "bob"]).await;
    let mut rt = IngestServiceClient::new(bearer(&app.channel, RUNTIME));
    rt.deliver_trigger(opened("alice")).await.expect("alice");
    rt.deliver_trigger(opened("bob")).await.expect("bob");
    let claims = |p: serde_json::Value| serde_json::json!({ "sub": "svc", "role": "reader", "principal": p, "iss": "https://id.example", "aud": "hcp-sense", "exp": now() + 600 });
    for p in [
        serde_json::json!(""),
        serde_json::json!(" "),
        serde_json::Value::Null,
        serde_json::json!(["alice"]),
    ] {
        let e = RecordServiceClient::new(bearer(&app.channel, &sign(SECRET32, claims(p.clone()))))
            .list_records(ListRecordsRequest::default())
            .await
            .expect_err("an empty principal is not everyone");
        assert_eq!(e.code(), Code::Unauthenticated, "{p}");
    }
    let mine =
        RecordServiceClient::new(bearer(&app.channel, &sign(SECRET32, claims("bob".into()))))
            .list_records(ListRecordsRequest::default())
            .await
            .expect("bob")
            .into_inner()
            .records;
    assert_eq!(mine.len(), 1);
    assert_eq!(mine[0].principal, "bob");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_are_per_credential_kind_and_failures_per_address() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jwt = jwt_config(dir.path(), SECRET32);
    let app = spawn_app_with(StoreKind::Sqlite, |c| {
        c.rate_limit_per_sec = 2.0;
        c.auth_failure_rate_per_sec = 2.0;
        c.auth = AuthConfig {
            tokens: vec![token("rt1", ADMIN, Role::Admin, None)],
            jwt: Some(jwt),
        };
    })
    .await;
    let as_jwt = sign(
        SECRET32,
        serde_json::json!({ "sub": "rt1", "role": "admin", "iss": "https://id.example", "aud": "hcp-sense", "exp": now() + 600 }),
    );
    let list = |t: String| {
        let ch = app.channel.clone();
        async move {
            pb::pack_service_client::PackServiceClient::new(bearer(&ch, &t))
                .list_packs(pb::ListPacksRequest::default())
                .await
                .map(drop)
                .map_err(|s| s.code())
        }
    };
    // The JWT whose subject is `rt1` spends its own bucket (burst 4), not the token `rt1`'s.
    let mut jwt_codes = Vec::new();
    for _ in 0..8 {
        jwt_codes.push(list(as_jwt.clone()).await);
    }
    assert!(
        jwt_codes.contains(&Err(Code::ResourceExhausted)),
        "{jwt_codes:?}"
    );
    assert_eq!(
        list(ADMIN.to_owned()).await,
        Ok(()),
        "the static token rt1 is untouched"
    );
    // Failed authentications from one address, twice its budget (burst 4): every one refused
    // as such, and the address is never locked out — valid credentials from it pass at once.
    let mut codes = Vec::new();
    for i in 0..8 {
        codes.push(list(format!("wrong-{i}")).await);
    }
    assert_eq!(codes, [Err(Code::Unauthenticated); 8], "{codes:?}");
    assert_eq!(
        list(ADMIN.to_owned()).await,
        Ok(()),
        "valid credentials from the same address"
    );
    // Health is never limited.
    let mut health = tonic_health::pb::health_client::HealthClient::new(app.channel.clone());
    for _ in 0..10 {
        health
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
            .expect("health");
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_tokens_are_signed_by_the_server_that_issued_them() {
    let with = |secret: Option<&'static str>| {
        move |c: &mut Config| c.page_token_secret = secret.map(|s| s.to_owned().into())
    };
    let a = spawn_app_with(StoreKind::Sqlite, with(Some("shared-key"))).await;
    let b = spawn_app_with(StoreKind::Sqlite, with(Some("other-key"))).await;
    let c = spawn_app_with(StoreKind::Sqlite, with(Some("shared-key"))).await;
    let d = spawn_app_with(StoreKind::Sqlite, with(None)).await;
    for app in [&a, &b, &c, &d] {
        let mut packs = app.packs.clone();
        for id in ["p1", "p2", "p3"] {
            let mut m = example("github.pack.json");
            m["id"] = id.into();
            packs
                .register_pack(register_req(&m))
                .await
                .expect("register");
        }
    }
    let first = |app: &TestApp| {
        let mut packs = app.packs.clone();
        async move {
            packs
                .list_packs(pb::ListPacksRequest {
                    page_size: 1,
                    ..Default::default()
                })
                .await
                .expect("first page")
                .into_inner()
                .next_page_token
        }
    };
    let next = |app: &TestApp, token: String| {
        let mut packs = app.packs.clone();
        async move {
            packs
                .list_packs(pb::ListPacksRequest {
                    page_size: 1,
                    page_token: token,
                })
                .await
                .map(|r| r.into_inner().packs[0].pack_id.clone())
                .map_err(|s| s.code())
        }
    };
    let token = first(&a).await;
    assert_eq!(
        next(&c, token.clone()).await,
        Ok("p2".to_owned()),
        "same key"
    );
    assert_eq!(
        next(&b, token.clone()).await,
        Err(Code::InvalidArgument),
        "other key"
    );
    assert_eq!(
        next(&d, token).await,
        Err(Code::InvalidArgument),
        "a key of its own"
    );
    let own = first(&d).await;
    assert_eq!(next(&d, own.clone()).await, Ok("p2".to_owned()));
    assert_eq!(next(&a, own).await, Err(Code::InvalidArgument));
    for app in [a, b, c, d] {
        app.stop().await;
    }
}
