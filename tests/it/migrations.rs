//! Schema migrations on an empty database of each kind: up, status, down, up again.
use hcp_sense_migration::{Migrator, MigratorTrait, SchemaManager};

use crate::helpers::{StoreKind, TestDb};

async fn up_down_up(kind: StoreKind) {
    let db = TestDb::create(kind).await;
    let store = db.store(2).await;
    assert!(store
        .migration_status()
        .await
        .expect("status")
        .iter()
        .all(|m| !m.applied));
    store.migrate_up().await.expect("up");
    assert!(store
        .migration_status()
        .await
        .expect("status")
        .iter()
        .all(|m| m.applied));
    // Running up again is a no-op.
    store.migrate_up().await.expect("up again");
    let tables = [
        "packs",
        "pack_triggers",
        "pack_stimuli",
        "pack_commands",
        "sense_grants",
        "bindings",
        "sense_activations",
        "execute_states",
        "project_members",
        "records",
        "drop_reports",
        "audit_events",
        "ingress_routes",
        "ingress_ledger",
    ];
    let conn = db.connect().await;
    let has = |t: &'static str| {
        let conn = &conn;
        async move {
            SchemaManager::new(conn)
                .has_table(t)
                .await
                .expect("has_table")
        }
    };
    for t in tables {
        assert!(has(t).await, "{t} exists after up");
    }
    Migrator::down(&conn, None).await.expect("down");
    for t in tables {
        assert!(!has(t).await, "{t} gone after down");
    }
    store.migrate_up().await.expect("up after down");
    assert!(has("records").await);
    store.close().await;
}

on_both_stores!(migrations_up_down_up => up_down_up);

/// A database a newer release has migrated: this binary still migrates (nothing to do) and
/// serves with `--migrate false`, as a previous release does during a rollout or after a
/// rollback; but it refuses one that lacks its own migrations beside a newer one.
async fn a_newer_release_s_migrations(kind: StoreKind) {
    use sea_orm::ConnectionTrait;
    let db = TestDb::create(kind).await;
    let store = db.store(2).await;
    store.migrate_up().await.expect("up");
    let conn = db.connect().await;
    let future = "m20991231_000001_from_a_newer_release";
    conn.execute_unprepared(&format!(
        "INSERT INTO seaql_migrations (version, applied_at) VALUES ('{future}', 0)"
    ))
    .await
    .expect("insert");
    let status = store.migration_status().await.expect("status");
    assert!(status.iter().filter(|m| m.known).all(|m| m.applied));
    assert!(status
        .iter()
        .any(|m| m.name == future && m.applied && !m.known));
    store.migrate_up().await.expect("nothing to apply");

    let mut config = hcp_sense::config::Config::for_database(db.url.clone());
    config.migrate = false;
    let app = hcp_sense::app::App::build(config)
        .await
        .expect("serves on the newer schema");
    drop(app);

    // Its own latest migration missing beside a newer one: refused, naming both.
    let own = Migrator::migrations()
        .last()
        .map(|m| m.name().to_owned())
        .expect("a migration");
    conn.execute_unprepared(&format!(
        "DELETE FROM seaql_migrations WHERE version = '{own}'"
    ))
    .await
    .expect("delete");
    let err = store.migrate_up().await.expect_err("mixed lines");
    let msg = err.to_string();
    assert!(msg.contains(future) && msg.contains(&own), "{msg}");
    store.close().await;
}

on_both_stores!(migrations_of_a_newer_release_are_left_alone => a_newer_release_s_migrations);

/// The ingress ledger's migration carries the per-route ledger's rows over (under the scope
/// `route:<route_id>`, where the service still reads them for their route), and its `down`
/// brings every decided row back to the per-route table, one per route and delivery.
async fn the_ingress_ledger_migration_keeps_its_rows_both_ways(kind: StoreKind) {
    use sea_orm::{ConnectionTrait, Statement};
    let db = TestDb::create(kind).await;
    let store = db.store(2).await;
    let ledger = Migrator::migrations()
        .iter()
        .position(|m| m.name() == "m20261204_000001_ingress_ledger")
        .expect("the ledger migration") as u32;
    Migrator::up(store.connection(), Some(ledger))
        .await
        .expect("the migrations before the ledger");
    let conn = db.connect().await;
    conn.execute_unprepared(
        "INSERT INTO ingress_deliveries (route_id, delivery_key, decide_time, expire_time, answer) \
         VALUES ('sw', 'k1', 10, 2000, '[1]'), ('gh', 'k2', 20, NULL, '[2]')",
    )
    .await
    .expect("rows of the per-route ledger");
    Migrator::up(store.connection(), Some(1))
        .await
        .expect("the ledger migration");
    let rows = |sql: &'static str| {
        let conn = &conn;
        async move {
            conn.query_all_raw(Statement::from_string(conn.get_database_backend(), sql))
                .await
                .expect("query")
                .iter()
                .map(|r| {
                    (0..6)
                        .map(|i| {
                            r.try_get_by_index::<Option<String>>(i)
                                .ok()
                                .flatten()
                                .or_else(|| {
                                    r.try_get_by_index::<Option<i64>>(i)
                                        .ok()
                                        .flatten()
                                        .map(|n| n.to_string())
                                })
                                .unwrap_or_else(|| "NULL".into())
                        })
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(
        rows("SELECT scope, delivery_key, route_id, answer, expire_time, content_digest FROM ingress_ledger ORDER BY scope")
            .await,
        [
            "route:gh k2 gh [2] NULL NULL",
            "route:sw k1 sw [1] 2000 NULL"
        ]
    );
    // A claim in flight is not carried back; a decided row is.
    conn.execute_unprepared(
        "INSERT INTO ingress_ledger (scope, delivery_key, route_id, content_digest, claim_until, decide_time, expire_time, answer) \
         VALUES ('abc', 'k3', 'sw', 'd', 99, 30, 3000, '')",
    )
    .await
    .expect("a claim");
    Migrator::down(store.connection(), Some(1))
        .await
        .expect("down");
    assert_eq!(
        rows("SELECT route_id, delivery_key, answer, expire_time, route_id, delivery_key FROM ingress_deliveries ORDER BY route_id")
            .await,
        ["gh k2 [2] NULL gh k2", "sw k1 [1] 2000 sw k1"]
    );
    store.close().await;
}

on_both_stores!(the_ingress_ledger_migration_keeps_its_rows => the_ingress_ledger_migration_keeps_its_rows_both_ways);
