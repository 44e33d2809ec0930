//! Schema migrations on an empty database of each kind: up, status, down, up again.
use hcp_sense::config::StoreConfig;
use hcp_sense::store::Store;
use hcp_sense_migration::{Migrator, MigratorTrait, SchemaManager};

use crate::helpers::{StoreKind, TestDb};

async fn up_down_up(kind: StoreKind) {
    let db = TestDb::create(kind).await;
    let store = Store::connect(&StoreConfig {
        url: db.url.clone(),
        max_connections: Some(2),
    })
    .await
    .expect("connect");
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

#[tokio::test]
async fn migrations_up_down_up_sqlite() {
    up_down_up(StoreKind::Sqlite).await;
}

#[tokio::test]
async fn migrations_up_down_up_postgres() {
    up_down_up(StoreKind::Postgres).await;
}
