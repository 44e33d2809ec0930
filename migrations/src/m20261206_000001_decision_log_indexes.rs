//! The decision log's indexes: a recorded entry is found by principal through its record, so its own row adds no entry to a per-principal index.
//!
//! A per-principal index puts each principal's newest entries on a page of its own: a batch of
//! entries for many principals dirties a page for each. Records already keep such an index;
//! indexing a recorded entry by principal again doubled the pages a batch wrote. Recorded
//! entries are indexed instead by their record id, which grows with time (UUIDv7), so they are
//! appended at the index's end. Drops, refusals and duplicates keep the principal index.
use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

/// The entries a record holds: the condition both partial indexes and every query name, in
/// the same words (SQLite uses a partial index only when a query repeats its condition).
pub const RECORDED: &str = "outcome IN ('inbox', 'silent')";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    /// One transaction on every engine: its statements then share one connection (on SQLite
    /// a pooled connection that did not see the drop would refuse the create by its name).
    fn use_transaction(&self) -> Option<bool> {
        Some(true)
    }

    async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
        let db = m.get_connection();
        for sql in [
            "DROP INDEX idx_decisions_principal".to_owned(),
            format!(
                "CREATE INDEX idx_decisions_principal ON decisions (principal, decided_time, seq) \
                 WHERE NOT ({RECORDED})"
            ),
            format!("CREATE INDEX idx_decisions_record ON decisions (record_id) WHERE {RECORDED}"),
            // No listing asks for the entries without a trigger id.
            "DROP INDEX idx_decisions_trigger".to_owned(),
            "CREATE INDEX idx_decisions_trigger ON decisions (trigger_id, pack_id) \
             WHERE trigger_id IS NOT NULL"
                .to_owned(),
        ] {
            db.execute_unprepared(&sql).await?;
        }
        Ok(())
    }

    async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
        let db = m.get_connection();
        for sql in [
            "DROP INDEX IF EXISTS idx_decisions_record",
            "DROP INDEX IF EXISTS idx_decisions_principal",
            "DROP INDEX IF EXISTS idx_decisions_trigger",
            "CREATE INDEX IF NOT EXISTS idx_decisions_principal ON decisions (principal, decided_time, seq)",
            "CREATE INDEX IF NOT EXISTS idx_decisions_trigger ON decisions (trigger_id, pack_id)",
        ] {
            db.execute_unprepared(sql).await?;
        }
        Ok(())
    }
}
