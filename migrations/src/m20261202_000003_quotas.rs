//! Quotas: the rate and burst a pack (or one principal of it) may deliver at, with the fleet's token bucket beside each rule.
use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum SenseQuotas {
    Table,
    PackId,
    Principal,
    RatePerSecond,
    Burst,
    Tokens,
    RefillTime,
    UpdateTime,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
        m.create_table(
            Table::create()
                .table(SenseQuotas::Table)
                .col(
                    ColumnDef::new(SenseQuotas::PackId)
                        .string_len(128)
                        .not_null(),
                )
                // Empty for the pack-wide quota; a principal's own otherwise. The API never
                // takes an empty principal for one: leaving it out is what names the pack.
                .col(
                    ColumnDef::new(SenseQuotas::Principal)
                        .string_len(256)
                        .not_null(),
                )
                .col(
                    ColumnDef::new(SenseQuotas::RatePerSecond)
                        .double()
                        .not_null(),
                )
                .col(ColumnDef::new(SenseQuotas::Burst).big_integer().not_null())
                // The fleet's bucket: the tokens it held at refill_time (Unix microseconds).
                // Replicas lease from it; on SQLite (one process) the bucket is kept in memory.
                .col(ColumnDef::new(SenseQuotas::Tokens).double().not_null())
                .col(
                    ColumnDef::new(SenseQuotas::RefillTime)
                        .big_integer()
                        .not_null(),
                )
                .col(
                    ColumnDef::new(SenseQuotas::UpdateTime)
                        .big_integer()
                        .not_null(),
                )
                .primary_key(
                    Index::create()
                        .col(SenseQuotas::PackId)
                        .col(SenseQuotas::Principal),
                )
                .to_owned(),
        )
        .await
    }

    async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
        m.drop_table(Table::drop().table(SenseQuotas::Table).to_owned())
            .await
    }
}
