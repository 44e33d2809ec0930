//! PostgreSQL records partitioned by the time the database stored them, with a trigger ledger that keeps idempotency exact across partitions; SQLite keeps one table.
//!
//! The layout, and why, is in docs/partitions.md. Converting copies every record in this
//! migration's transaction: a maintenance window, measured per million records there.
use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::{ConnectionTrait, DbBackend};

#[derive(DeriveMigrationName)]
pub struct Migration;

/// The width of the partitions this migration creates: one UTC day, in microseconds. The
/// server makes later ones at its own `--record-partition-secs`.
const DAY: i64 = 86_400_000_000;

/// The columns a record had before, in order.
const COLUMNS: &str =
    "record_id, principal, binding_id, land, pack_id, ref, payload, route, project, \
                       producer_trigger_id, received_time, commit_txid, seq";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
        let db = m.get_connection();
        if db.get_database_backend() != DbBackend::Postgres {
            return Ok(());
        }
        // The new table takes the old one's columns, defaults (the sequence, the writing
        // transaction's id) and NOT NULLs, plus the partition key: the database's clock when
        // the record was stored, so every replica, whatever its own clock, writes into the same
        // partition and never into one retention already dropped.
        db.execute_unprepared(
            "CREATE TABLE records_partitioned ( \
               LIKE records INCLUDING DEFAULTS INCLUDING CONSTRAINTS, \
               stored_time bigint NOT NULL \
                 DEFAULT (extract(epoch FROM statement_timestamp()) * 1000000)::bigint, \
               PRIMARY KEY (record_id, stored_time) \
             ) PARTITION BY RANGE (stored_time)",
        )
        .await?;
        // One partition per UTC day that holds records (a record keeps its receive time as
        // its stored time). Those for now and ahead are the server's to make, at its width.
        db.execute_unprepared(&format!(
            "DO $$ \
             DECLARE d bigint; \
             BEGIN \
               FOR d IN \
                 SELECT DISTINCT div(received_time, {DAY}) FROM records \
               LOOP \
                 EXECUTE format('CREATE TABLE records_%s_%s PARTITION OF records_partitioned FOR VALUES FROM (%s) TO (%s)', \
                                d * {DAY}, (d + 1) * {DAY}, d * {DAY}, (d + 1) * {DAY}); \
               END LOOP; \
             END $$"
        ))
        .await?;
        db.execute_unprepared(&format!(
            "INSERT INTO records_partitioned ({COLUMNS}, stored_time) \
             SELECT {COLUMNS}, received_time FROM records"
        ))
        .await?;
        // The trigger ledger: one row per (pack, producer trigger id) kept, naming its record
        // and that record's partition. Its primary key is the uniqueness a partitioned table
        // cannot hold (a unique index there must include the partition key).
        db.execute_unprepared(
            "CREATE TABLE record_triggers ( \
               pack_id varchar(128) NOT NULL, \
               producer_trigger_id varchar(256) NOT NULL, \
               record_id varchar(64) NOT NULL, \
               stored_time bigint NOT NULL, \
               PRIMARY KEY (pack_id, producer_trigger_id))",
        )
        .await?;
        db.execute_unprepared(
            "INSERT INTO record_triggers (pack_id, producer_trigger_id, record_id, stored_time) \
             SELECT pack_id, producer_trigger_id, record_id, stored_time FROM records_partitioned \
             WHERE producer_trigger_id IS NOT NULL",
        )
        .await?;
        // No index on its stored time: an index entry on every keyed insert would cost more
        // than the sweep it serves, which reads the ledger in page ranges once a retention
        // pass has dropped partitions (docs/partitions.md).
        // Below the floor, partitions are being or have been dropped: a ledger row there names
        // a record no longer kept, and a new record may take its trigger id.
        db.execute_unprepared(
            "CREATE TABLE record_floor ( \
               one smallint PRIMARY KEY CHECK (one = 1), \
               floor_time bigint NOT NULL); \
             INSERT INTO record_floor (one, floor_time) VALUES (1, 0)",
        )
        .await?;
        db.execute_unprepared(
            "DROP TABLE records; \
             ALTER TABLE records_partitioned RENAME TO records; \
             ALTER INDEX records_partitioned_pkey RENAME TO records_pkey; \
             CREATE INDEX idx_records_position ON records (commit_txid, seq); \
             CREATE INDEX idx_records_principal_position ON records (principal, commit_txid, seq); \
             CREATE INDEX idx_records_land_position ON records (land, commit_txid, seq)",
        )
        .await?;
        // Retention trims the partition straddling its cutoff by stored time, which rises with
        // each partition's pages: a BRIN index finds the rows below the cutoff (or that there
        // are none) in a few pages, where the position index would be read through the whole
        // partition to learn that none is left. Appended rows cost it nothing: each range of
        // pages is summarized once it is full (autosummarize), and every partition made later
        // takes the index with its options.
        db.execute_unprepared(
            "CREATE INDEX idx_records_stored ON records USING brin (stored_time) \
             WITH (autosummarize = on)",
        )
        .await?;
        Ok(())
    }

    async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
        let db = m.get_connection();
        if db.get_database_backend() != DbBackend::Postgres {
            return Ok(());
        }
        // Back to one table: the ledger's uniqueness becomes the unique index again.
        db.execute_unprepared(&format!(
            "CREATE TABLE records_single (LIKE records INCLUDING DEFAULTS INCLUDING CONSTRAINTS); \
             ALTER TABLE records_single DROP COLUMN stored_time; \
             INSERT INTO records_single ({COLUMNS}) SELECT {COLUMNS} FROM records; \
             DROP TABLE records, record_triggers, record_floor; \
             ALTER TABLE records_single RENAME TO records; \
             ALTER TABLE records ADD PRIMARY KEY (record_id); \
             CREATE INDEX idx_records_position ON records (commit_txid, seq); \
             CREATE INDEX idx_records_principal_position ON records (principal, commit_txid, seq); \
             CREATE INDEX idx_records_land_position ON records (land, commit_txid, seq); \
             CREATE UNIQUE INDEX uq_records_producer_trigger ON records (pack_id, producer_trigger_id)"
        ))
        .await?;
        Ok(())
    }
}
