//! The decision log: one row per decision the service answered (recorded, dropped, refused before the decision, a duplicate), kept for a retention and readable by the viewer rules of records.
//!
//! A dropped trigger's payload is never kept (it was not consented to, §7.3). On PostgreSQL the
//! table is partitioned by the database's clock when the row was written, like `records`, so
//! retention drops whole partitions; the server makes them ahead. SQLite keeps one table.
use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::{ConnectionTrait, DbBackend};

#[derive(DeriveMigrationName)]
pub struct Migration;

/// Columns both engines share, after the key and the time.
const COLUMNS: &str = "pack_id text NOT NULL, \
     ref text NOT NULL, \
     principal text NOT NULL, \
     land text NOT NULL, \
     project text, \
     binding_id text NOT NULL DEFAULT '', \
     trigger_id text, \
     source text NOT NULL, \
     outcome text NOT NULL, \
     drop_reason text, \
     check_name text NOT NULL DEFAULT '', \
     detail text NOT NULL DEFAULT '', \
     record_id text, \
     trace_id text, \
     folded bigint NOT NULL DEFAULT 0";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
        let db = m.get_connection();
        let statements: Vec<String> = match db.get_database_backend() {
            DbBackend::Postgres => vec![
                // `decided_time`: the database's clock, so every replica writes into the same
                // partition and none into one retention already dropped.
                format!(
                    "CREATE TABLE decisions ( \
                       seq bigserial NOT NULL, \
                       decided_time bigint NOT NULL \
                         DEFAULT (extract(epoch FROM statement_timestamp()) * 1000000)::bigint, \
                       {COLUMNS}, \
                       PRIMARY KEY (decided_time, seq) \
                     ) PARTITION BY RANGE (decided_time)"
                ),
            ],
            _ => vec![format!(
                "CREATE TABLE decisions ( \
                   seq integer PRIMARY KEY, \
                   decided_time bigint NOT NULL, \
                   {COLUMNS})"
            )],
        };
        for sql in statements {
            db.execute_unprepared(&sql).await?;
        }
        // A look-up by trigger id (and pack); a principal's decisions newest first; the
        // listing of everyone's newest first, which on PostgreSQL the primary key serves.
        // Each index is written with every entry: no more than these.
        let mut indexes = vec![
            "CREATE INDEX idx_decisions_trigger ON decisions (trigger_id, pack_id)",
            "CREATE INDEX idx_decisions_principal ON decisions (principal, decided_time, seq)",
        ];
        if db.get_database_backend() != DbBackend::Postgres {
            indexes.push("CREATE INDEX idx_decisions_time ON decisions (decided_time, seq)");
        }
        for sql in indexes {
            db.execute_unprepared(sql).await?;
        }
        Ok(())
    }

    async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
        m.get_connection()
            .execute_unprepared("DROP TABLE IF EXISTS decisions")
            .await?;
        Ok(())
    }
}
