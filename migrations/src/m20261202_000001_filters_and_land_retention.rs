//! Activation filters (a CEL expression kept with each activation) and an index for retention by land.
use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum SenseActivations {
    Table,
    Filter,
}

#[derive(DeriveIden)]
enum Records {
    Table,
    Land,
    CommitTxid,
    Seq,
}

const LAND_INDEX: &str = "idx_records_land_position";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
        // Empty: no filter. Existing activations keep recording everything they did.
        m.alter_table(
            Table::alter()
                .table(SenseActivations::Table)
                .add_column(
                    ColumnDef::new(SenseActivations::Filter)
                        .text()
                        .not_null()
                        .default(""),
                )
                .to_owned(),
        )
        .await?;
        // Retention by land deletes each land's oldest records first.
        m.create_index(
            Index::create()
                .name(LAND_INDEX)
                .table(Records::Table)
                .col(Records::Land)
                .col(Records::CommitTxid)
                .col(Records::Seq)
                .to_owned(),
        )
        .await
    }

    async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
        m.drop_index(
            Index::drop()
                .name(LAND_INDEX)
                .table(Records::Table)
                .to_owned(),
        )
        .await?;
        m.alter_table(
            Table::alter()
                .table(SenseActivations::Table)
                .drop_column(SenseActivations::Filter)
                .to_owned(),
        )
        .await
    }
}
