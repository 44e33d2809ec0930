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
