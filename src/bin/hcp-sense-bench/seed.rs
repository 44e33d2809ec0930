//! What the servers are measured on: a database of the benchmark's own, policy seeded through the
//! admin API, and the bulk path — rows written straight into the migrated schema — for sizes the
//! API would take minutes to seed (old records, 100,000-principal policy) and for the store's own
//! insert limit.
use std::path::PathBuf;
use std::time::{Duration, Instant};

use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement, TransactionTrait};
use serde_json::json;
use tonic::transport::Channel;

use crate::load::Population;
use crate::pb::{
    pack_service_client::PackServiceClient, policy_service_client::PolicyServiceClient,
    register_pack_request, ActivateSenseRequest, BindingState, GrantSenseEnableRequest,
    PutBindingRequest, RegisterPackRequest, Route,
};
use crate::server::Server;
use crate::{bin, server, Options};

pub fn now_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// A database of the benchmark's own, dropped (PostgreSQL) or removed (SQLite) afterwards.
pub struct BenchDb {
    pub url: String,
    pg: Option<(String, String)>,
    dir: Option<PathBuf>,
}

impl BenchDb {
    pub async fn create(kind: &str, postgres_url: &str, tag: &str) -> anyhow::Result<BenchDb> {
        let name = format!("hcp_sense_bench_{}_{tag}", std::process::id());
        match kind {
            "sqlite" => {
                let dir = std::env::temp_dir().join(&name);
                std::fs::create_dir_all(&dir)?;
                Ok(BenchDb {
                    url: format!("sqlite://{}", dir.join("bench.db").display()),
                    pg: None,
                    dir: Some(dir),
                })
            }
            "postgres" => {
                let admin = sea_orm::Database::connect(postgres_url).await?;
                admin
                    .execute_unprepared(&format!("DROP DATABASE IF EXISTS {name}"))
                    .await?;
                admin
                    .execute_unprepared(&format!("CREATE DATABASE {name}"))
                    .await?;
                let _ = admin.close().await;
                let root = postgres_url
                    .rsplit_once('/')
                    .map_or(postgres_url, |(r, _)| r);
                Ok(BenchDb {
                    url: format!("{root}/{name}"),
                    pg: Some((postgres_url.to_owned(), name)),
                    dir: None,
                })
            }
            other => anyhow::bail!("unknown store `{other}`: use sqlite or postgres"),
        }
    }

    /// A connection for the bulk path and the store limit; the schema must be migrated first.
    /// Its PostgreSQL sockets get TCP_NODELAY, as the server's do.
    pub async fn connect(&self) -> anyhow::Result<DatabaseConnection> {
        let mut opts = sea_orm::ConnectOptions::new(self.url.as_str());
        opts.sqlx_logging(false);
        if self.pg.is_some() {
            let port = self
                .url
                .rsplit_once('@')
                .and_then(|(_, host)| host.split('/').next())
                .and_then(|h| h.rsplit_once(':'))
                .and_then(|(_, p)| p.parse().ok())
                .unwrap_or(5432);
            opts.map_sqlx_postgres_pool_opts(move |o| {
                o.after_connect(move |_, _| {
                    Box::pin(async move {
                        let _ = tokio::task::spawn_blocking(move || {
                            crate::nodelay::set_on_sockets_to(port)
                        })
                        .await;
                        Ok(())
                    })
                })
            });
        }
        Ok(sea_orm::Database::connect(opts).await?)
    }

    pub async fn drop_db(mut self) {
        if let Some((admin, name)) = self.pg.take() {
            if let Ok(a) = sea_orm::Database::connect(admin.as_str()).await {
                let _ = a
                    .execute_unprepared(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .await;
                let _ = a.close().await;
            }
        }
    }
}

impl Drop for BenchDb {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A typical payload schema for the benchmark triggers' payload: 14 properties, two patterns
/// and an enum, nested once.
pub fn typical_schema() -> serde_json::Value {
    let text = |n: u32| json!({ "type": "string", "maxLength": n });
    json!({
        "type": "object",
        "required": ["issue", "title", "repository"],
        "properties": {
            "issue": { "type": "integer", "minimum": 0 },
            "title": { "enum": ["benchmark", "triage", "ops", "security", "release"] },
            "repository": {
                "type": "object",
                "required": ["private", "full_name"],
                "properties": {
                    "private": { "type": "boolean" },
                    "full_name": { "type": "string", "pattern": "^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$" }
                }
            },
            "state": { "enum": ["open", "closed"] },
            "labels": { "type": "array", "items": text(64), "maxItems": 32 },
            "assignee": { "type": ["string", "null"], "maxLength": 128 },
            "url": text(2048),
            "body": text(65536),
            "milestone": text(128),
            "author": { "type": "string", "pattern": "^[A-Za-z0-9-]{1,39}$" },
            "comments": { "type": "integer", "minimum": 0 },
            "locked": { "type": "boolean" },
            "created_at": { "type": "string", "format": "date-time" },
            "updated_at": { "type": "string", "format": "date-time" }
        }
    })
}

/// The manifest of benchmark pack `k`: a user-bound pack declaring `issue.opened`, with
/// `schema` as its payload schema when given.
fn manifest_with(k: usize, schema: Option<&serde_json::Value>) -> String {
    let mut opened = json!({ "ref": "issue.opened" });
    if let Some(s) = schema {
        opened["payloadSchema"] = s.clone();
    }
    json!({
        "id": format!("pack-{k}"),
        "stimulusTriggers": [opened, { "ref": "binding.degraded" }],
        "policy": { "stimuli": [
            { "ref": "issue.opened", "operation": "read", "land": "user" },
            { "ref": "binding.degraded", "operation": "read", "land": "user" }
        ]},
        "binding": { "mode": "user", "hub": "bench" }
    })
    .to_string()
}

/// RegisterPack for every pack of the population.
pub async fn packs(ch: &Channel, pop: Population) -> anyhow::Result<()> {
    packs_with(ch, pop, None).await
}

/// RegisterPack for every pack of the population, with `schema` on `issue.opened` when given
/// (registered again: the same packs, a new version).
pub async fn packs_with(
    ch: &Channel,
    pop: Population,
    schema: Option<&serde_json::Value>,
) -> anyhow::Result<()> {
    let mut client = PackServiceClient::new(ch.clone());
    for k in 0..pop.packs.max(1) {
        client
            .register_pack(RegisterPackRequest {
                source: Some(register_pack_request::Source::ManifestText(manifest_with(
                    k, schema,
                ))),
            })
            .await?;
    }
    Ok(())
}

/// Callers seeding through the API at once.
const SEED_CALLERS: usize = 32;

/// Through the admin API, as an operator would: the packs, then for each principal
/// GrantSenseEnable, PutBinding (linked) and ActivateSense (inbox) on its pack. Returns the
/// seconds it took.
pub async fn policy_via_api(ch: &Channel, pop: Population) -> anyhow::Result<f64> {
    let start = Instant::now();
    packs(ch, pop).await?;
    let mut tasks = Vec::new();
    for w in 0..SEED_CALLERS {
        let mut policy = PolicyServiceClient::new(ch.clone());
        tasks.push(tokio::spawn(async move {
            let mut p = w;
            while p < pop.principals {
                let principal = format!("principal-{p}");
                let pack_id = format!("pack-{}", p % pop.packs.max(1));
                policy
                    .grant_sense_enable(GrantSenseEnableRequest {
                        principal: principal.clone(),
                        pack_id: pack_id.clone(),
                    })
                    .await?;
                policy
                    .put_binding(PutBindingRequest {
                        principal: principal.clone(),
                        pack_id: pack_id.clone(),
                        binding_id: format!("b-{principal}"),
                        state: BindingState::Linked as i32,
                    })
                    .await?;
                policy
                    .activate_sense(ActivateSenseRequest {
                        principal,
                        pack_id,
                        route: Route::Inbox as i32,
                        filter: String::new(),
                    })
                    .await?;
                p += SEED_CALLERS;
            }
            Ok::<(), tonic::Status>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(start.elapsed().as_secs_f64())
}

/// The bulk path for policy: the grant, linked Binding and inbox activation rows of each
/// principal, written straight into the schema (the packs themselves go through RegisterPack).
/// A server reads them when it starts.
pub async fn policy_bulk(db: &DatabaseConnection, pop: Population) -> anyhow::Result<()> {
    let now = now_micros();
    let ids: Vec<usize> = (0..pop.principals).collect();
    for chunk in ids.chunks(2000) {
        let who = |p: usize| {
            (
                format!("principal-{p}"),
                format!("pack-{}", p % pop.packs.max(1)),
            )
        };
        let rows = |f: &dyn Fn(String, String) -> String| {
            chunk
                .iter()
                .map(|p| {
                    let (principal, pack) = who(*p);
                    f(principal, pack)
                })
                .collect::<Vec<_>>()
                .join(",")
        };
        let txn = db.begin().await?;
        txn.execute_unprepared(&format!(
            "INSERT INTO sense_grants (principal, pack_id, create_time) VALUES {}",
            rows(&|p, k| format!("('{p}','{k}',{now})"))
        ))
        .await?;
        txn.execute_unprepared(&format!(
            "INSERT INTO bindings (binding_id, principal, pack_id, mode, state, update_time) VALUES {}",
            rows(&|p, k| format!("('b-{p}','{p}','{k}','user','linked',{now})"))
        ))
        .await?;
        txn.execute_unprepared(&format!(
            "INSERT INTO sense_activations (principal, pack_id, enabled, route, update_time) VALUES {}",
            rows(&|p, k| format!("('{p}','{k}',true,'inbox',{now})"))
        ))
        .await?;
        txn.commit().await?;
    }
    Ok(())
}

/// The columns of a record row as the sink writes it.
const RECORD_COLUMNS: &str = "record_id, principal, binding_id, land, pack_id, ref, payload, route, project, producer_trigger_id, received_time";

/// The bulk path for records: `n` records received at `base` + i microseconds, at positions
/// (0, i + 1), as records written by a release before store positions have. New records number
/// on after them.
pub async fn records_bulk(
    db: &DatabaseConnection,
    pop: Population,
    n: usize,
    base: i64,
) -> anyhow::Result<()> {
    // PostgreSQL: records partitioned by stored time; these keep their receive time as it, in
    // a partition of their own (the server makes those for now and ahead around it).
    let postgres = db.get_database_backend() == DbBackend::Postgres;
    if postgres {
        db.execute_unprepared(&format!(
            "CREATE TABLE IF NOT EXISTS records_{base}_{end} PARTITION OF records FOR VALUES FROM ({base}) TO ({end})",
            end = base + n as i64
        ))
        .await?;
    }
    let (stored_col, stored_val) = if postgres {
        (", stored_time", true)
    } else {
        ("", false)
    };
    let mut i = 0;
    while i < n {
        let txn = db.begin().await?;
        for _ in 0..50 {
            if i >= n {
                break;
            }
            let end = (i + 1000).min(n);
            let values: Vec<String> = (i..end)
                .map(|j| {
                    let p = j % pop.principals.max(1);
                    let stored = if stored_val {
                        format!(",{}", base + j as i64)
                    } else {
                        String::new()
                    };
                    format!(
                        "('{:08x}-0000-7000-8000-{j:012x}','principal-{p}','b-principal-{p}','user','pack-{}','issue.opened','{{\"issue\":{j}}}','inbox',NULL,NULL,{},0,{}{stored})",
                        j / 65536,
                        p % pop.packs.max(1),
                        base + j as i64,
                        j + 1
                    )
                })
                .collect();
            txn.execute_unprepared(&format!(
                "INSERT INTO records ({RECORD_COLUMNS}, commit_txid, seq{stored_col}) VALUES {}",
                values.join(",")
            ))
            .await?;
            i = end;
        }
        txn.commit().await?;
    }
    db.execute_unprepared(match db.get_database_backend() {
        DbBackend::Postgres => {
            "SELECT setval('records_seq', (SELECT max(seq) + 1 FROM records), false)"
        }
        _ => "UPDATE record_sequence SET next = (SELECT max(seq) + 1 FROM records)",
    })
    .await?;
    Ok(())
}

/// Records received before `cutoff` (microseconds).
pub async fn count_before(db: &DatabaseConnection, cutoff: i64) -> anyhow::Result<i64> {
    let row = db
        .query_one_raw(Statement::from_string(
            db.get_database_backend(),
            format!("SELECT COUNT(*) AS n FROM records WHERE received_time < {cutoff}"),
        ))
        .await?;
    Ok(row
        .and_then(|r| r.try_get::<i64>("", "n").ok())
        .unwrap_or(-1))
}

/// Rows per multi-row INSERT in the store-limit phase.
const LIMIT_ROWS: usize = 256;

/// The store's own limit: rows like the sink's inserted into the same schema from this process,
/// 256 to a multi-row INSERT with bound values, one INSERT to a transaction, on one connection
/// (with TCP_NODELAY, as the server's). Returns the rows written and the seconds it took.
pub async fn store_limit(
    db: &DatabaseConnection,
    pop: Population,
    duration: Duration,
) -> anyhow::Result<(usize, f64)> {
    let backend = db.get_database_backend();
    let pg = backend == DbBackend::Postgres;
    // PostgreSQL fills commit_txid and seq from their defaults, as the sink's insert does; on
    // SQLite the single writer numbers rows itself, as the sink does.
    let per_row = if pg { 11 } else { 13 };
    if pg {
        // The rows take the database's clock as their stored time: today's partition and
        // tomorrow's, as the server would make them.
        const DAY: i64 = 86_400_000_000;
        let now = db
            .query_one_raw(Statement::from_string(
                backend,
                "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS now",
            ))
            .await?
            .and_then(|r| r.try_get::<i64>("", "now").ok())
            .unwrap_or_default();
        let lower = now.div_euclid(DAY) * DAY;
        db.execute_unprepared(&format!(
            "CREATE TABLE IF NOT EXISTS records_{lower}_{upper} PARTITION OF records FOR VALUES FROM ({lower}) TO ({upper})",
            upper = lower + 2 * DAY
        ))
        .await?;
    }
    let mut param = 0usize;
    let placeholders: Vec<String> = (0..LIMIT_ROWS)
        .map(|_| {
            let cols: Vec<String> = (0..per_row)
                .map(|_| {
                    param += 1;
                    if pg {
                        format!("${param}")
                    } else {
                        "?".to_owned()
                    }
                })
                .collect();
            format!("({})", cols.join(","))
        })
        .collect();
    let sql = format!(
        "INSERT INTO records ({RECORD_COLUMNS}{}) VALUES {}",
        if pg { "" } else { ", commit_txid, seq" },
        placeholders.join(",")
    );
    let mut n = 0usize;
    let start = Instant::now();
    while start.elapsed() < duration {
        let now = now_micros();
        let mut values: Vec<sea_orm::Value> = Vec::with_capacity(LIMIT_ROWS * per_row);
        for j in n..n + LIMIT_ROWS {
            let p = j % pop.principals.max(1);
            values.push(uuid::Uuid::now_v7().to_string().into());
            values.push(format!("principal-{p}").into());
            values.push(format!("b-principal-{p}").into());
            values.push("user".into());
            values.push(format!("pack-{}", p % pop.packs.max(1)).into());
            values.push("issue.opened".into());
            values.push(format!("{{\"issue\":{j},\"title\":\"benchmark\"}}").into());
            values.push("inbox".into());
            values.push(Option::<String>::None.into());
            values.push(Option::<String>::None.into());
            values.push(now.into());
            if !pg {
                values.push(0i64.into());
                values.push((j as i64 + 1).into());
            }
        }
        let txn = db.begin().await?;
        txn.execute_raw(Statement::from_sql_and_values(backend, &sql, values))
            .await?;
        txn.commit().await?;
        n += LIMIT_ROWS;
    }
    Ok((n, start.elapsed().as_secs_f64()))
}

/// A migrated database seeded with `pop`, and a server on it started with `extra`.
pub async fn prepare(
    o: &Options,
    kind: &str,
    tag: &str,
    pop: Population,
    extra: &[&str],
) -> anyhow::Result<(BenchDb, Server)> {
    let bin = bin(o);
    let db = BenchDb::create(kind, &o.postgres_url, tag).await?;
    server::migrate(bin, &db.url)?;
    let server = Server::start(bin, &db.url, extra)?;
    let ch = server.channels(1).await?;
    if pop.principals <= o.api_seed_limit {
        let secs = policy_via_api(&ch[0], pop).await?;
        println!(
            "{kind:<9} seeded {} principals on {} packs through the admin API in {secs:.1} s",
            pop.principals, pop.packs
        );
        return Ok((db, server));
    }
    packs(&ch[0], pop).await?;
    server.stop();
    let conn = db.connect().await?;
    let t0 = Instant::now();
    policy_bulk(&conn, pop).await?;
    let _ = conn.close().await;
    println!(
        "{kind:<9} seeded {} principals through the bulk path in {:.1} s",
        pop.principals,
        t0.elapsed().as_secs_f64()
    );
    // A server reads the policy when it starts.
    let server = Server::start(bin, &db.url, extra)?;
    Ok((db, server))
}
