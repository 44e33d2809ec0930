//! Record positions assigned by the store in commit order: (commit_txid, seq), replacing clock order for listings.
use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::{ConnectionTrait, DbBackend};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum Records {
    Table,
    Principal,
    ReceivedTime,
    RecordId,
    CommitTxid,
    Seq,
}

#[derive(DeriveIden)]
enum RecordSequence {
    Table,
    Name,
    Next,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
        for col in [Records::CommitTxid, Records::Seq] {
            m.alter_table(
                Table::alter()
                    .table(Records::Table)
                    .add_column(ColumnDef::new(col).big_integer().not_null().default(0))
                    .to_owned(),
            )
            .await?;
        }
        let db = m.get_connection();
        // Records written before positions existed keep their receive order, ahead of every new one.
        db.execute_unprepared(
            "UPDATE records SET seq = x.n FROM \
             (SELECT record_id, row_number() OVER (ORDER BY received_time, record_id) AS n FROM records) AS x \
             WHERE x.record_id = records.record_id",
        )
        .await?;
        match db.get_database_backend() {
            DbBackend::Postgres => {
                // A sequence hands out numbers without a lock; the writing transaction's id,
                // read back through the snapshot horizon, orders commits across writers.
                db.execute_unprepared(
                    "CREATE SEQUENCE records_seq AS bigint; \
                     SELECT setval('records_seq', (SELECT coalesce(max(seq), 0) + 1 FROM records), false); \
                     ALTER TABLE records ALTER COLUMN seq SET DEFAULT nextval('records_seq'); \
                     ALTER TABLE records ALTER COLUMN commit_txid SET DEFAULT (pg_current_xact_id()::text::bigint)",
                )
                .await?;
            }
            _ => {
                // SQLite has one writer: a counter taken inside each write transaction is commit order.
                m.create_table(
                    Table::create()
                        .table(RecordSequence::Table)
                        .col(
                            ColumnDef::new(RecordSequence::Name)
                                .string_len(32)
                                .not_null()
                                .primary_key(),
                        )
                        .col(
                            ColumnDef::new(RecordSequence::Next)
                                .big_integer()
                                .not_null(),
                        )
                        .to_owned(),
                )
                .await?;
                db.execute_unprepared(
                    "INSERT INTO record_sequence (name, next) SELECT 'records', coalesce(max(seq), 0) + 1 FROM records",
                )
                .await?;
                // A release from before positions, still serving during a rollout or after a
                // rollback, inserts without `seq`: such a row takes the next number here.
                db.execute_unprepared(
                    "CREATE TRIGGER records_seq_default AFTER INSERT ON records WHEN NEW.seq = 0 BEGIN \
                       UPDATE records SET seq = (SELECT next FROM record_sequence WHERE name = 'records') WHERE rowid = NEW.rowid; \
                       UPDATE record_sequence SET next = next + 1 WHERE name = 'records'; \
                     END",
                )
                .await?;
            }
        }
        // Listings page by position; retention scans by position too, so the clock index goes.
        m.drop_index(
            Index::drop()
                .name("idx_records_time")
                .table(Records::Table)
                .to_owned(),
        )
        .await?;
        m.drop_index(
            Index::drop()
                .name("idx_records_principal_time")
                .table(Records::Table)
                .to_owned(),
        )
        .await?;
        m.create_index(
            Index::create()
                .name("idx_records_position")
                .table(Records::Table)
                .col(Records::CommitTxid)
                .col(Records::Seq)
                .to_owned(),
        )
        .await?;
        m.create_index(
            Index::create()
                .name("idx_records_principal_position")
                .table(Records::Table)
                .col(Records::Principal)
                .col(Records::CommitTxid)
                .col(Records::Seq)
                .to_owned(),
        )
        .await?;
        Ok(())
    }

    async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
        for name in ["idx_records_position", "idx_records_principal_position"] {
            m.drop_index(Index::drop().name(name).table(Records::Table).to_owned())
                .await?;
        }
        m.create_index(
            Index::create()
                .name("idx_records_principal_time")
                .table(Records::Table)
                .col(Records::Principal)
                .col(Records::ReceivedTime)
                .col(Records::RecordId)
                .to_owned(),
        )
        .await?;
        m.create_index(
            Index::create()
                .name("idx_records_time")
                .table(Records::Table)
                .col(Records::ReceivedTime)
                .col(Records::RecordId)
                .to_owned(),
        )
        .await?;
        let db = m.get_connection();
        if db.get_database_backend() == DbBackend::Postgres {
            db.execute_unprepared(
                "ALTER TABLE records ALTER COLUMN seq DROP DEFAULT; DROP SEQUENCE records_seq",
            )
            .await?;
        } else {
            db.execute_unprepared("DROP TRIGGER records_seq_default")
                .await?;
            m.drop_table(Table::drop().table(RecordSequence::Table).to_owned())
                .await?;
        }
        for col in [Records::CommitTxid, Records::Seq] {
            m.alter_table(
                Table::alter()
                    .table(Records::Table)
                    .drop_column(col)
                    .to_owned(),
            )
            .await?;
        }
        Ok(())
    }
}
