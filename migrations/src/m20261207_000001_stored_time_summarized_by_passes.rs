//! The records' stored-time BRIN index: its ranges are summarized by vacuum and by retention's pass, not by a work item queued for every full range.
//!
//! With `autosummarize`, each range of pages that fills queues a work item for autovacuum,
//! which takes them only when it next visits the database; its queue holds 256. A flood fills
//! more ranges than that between two visits, and PostgreSQL logs a line for every request it
//! could not queue. Vacuum summarizes every full range anyway, and retention's pass summarizes
//! the new ranges before it trims (`Store::summarize_stored_time`).
//!
//! A partitioned index's options cannot be altered, and a partition attached later is given
//! the parent's: each existing partition's index is altered here, and a partition made later
//! has its index made, with the option off, before it is attached (`store::partitions`).
use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::{ConnectionTrait, DbBackend};

#[derive(DeriveMigrationName)]
pub struct Migration;

/// Sets `autosummarize` on every partition's stored-time index (a statement that takes no lock
/// a write waits for).
fn on_every_partition(value: &str) -> String {
    format!(
        "DO $$ DECLARE leaf regclass; BEGIN \
           FOR leaf IN SELECT inhrelid::regclass FROM pg_inherits \
                       WHERE inhparent = 'idx_records_stored'::regclass LOOP \
             EXECUTE format('ALTER INDEX %s SET (autosummarize = {value})', leaf); \
           END LOOP; \
         END $$"
    )
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
        let db = m.get_connection();
        if db.get_database_backend() != DbBackend::Postgres {
            return Ok(());
        }
        db.execute_unprepared(&on_every_partition("off")).await?;
        Ok(())
    }

    async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
        let db = m.get_connection();
        if db.get_database_backend() != DbBackend::Postgres {
            return Ok(());
        }
        db.execute_unprepared(&on_every_partition("on")).await?;
        Ok(())
    }
}
