//! The ingress delivery ledger: each signed delivery a route decided, kept while its signature could still be replayed.
use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum IngressDeliveries {
    Table,
    RouteId,
    DeliveryKey,
    DecideTime,
    ExpireTime,
    Answer,
}

const EXPIRY_INDEX: &str = "idx_ingress_deliveries_expire_time";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
        m.create_table(
            Table::create()
                .table(IngressDeliveries::Table)
                .col(
                    ColumnDef::new(IngressDeliveries::RouteId)
                        .string_len(128)
                        .not_null(),
                )
                // The SHA-256 (hex) of the signed delivery id: a fixed width whatever the
                // sender's id.
                .col(
                    ColumnDef::new(IngressDeliveries::DeliveryKey)
                        .string_len(64)
                        .not_null(),
                )
                .col(
                    ColumnDef::new(IngressDeliveries::DecideTime)
                        .big_integer()
                        .not_null(),
                )
                // Unix microseconds after which the signature can no longer be replayed;
                // NULL: it always could (GitHub signs no time) and records are kept forever.
                .col(ColumnDef::new(IngressDeliveries::ExpireTime).big_integer())
                // The first answer's triggers, as JSON.
                .col(ColumnDef::new(IngressDeliveries::Answer).text().not_null())
                .primary_key(
                    Index::create()
                        .col(IngressDeliveries::RouteId)
                        .col(IngressDeliveries::DeliveryKey),
                )
                .to_owned(),
        )
        .await?;
        m.create_index(
            Index::create()
                .name(EXPIRY_INDEX)
                .table(IngressDeliveries::Table)
                .col(IngressDeliveries::ExpireTime)
                .to_owned(),
        )
        .await
    }

    async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
        m.drop_table(Table::drop().table(IngressDeliveries::Table).to_owned())
            .await
    }
}
