//! The ingress ledger keyed by signing secret: a signed delivery is decided once by every route that shares the secret it verifies with, its content pinned, a copy in flight claimed.
//!
//! The route path is not signed, so a captured request verifies at every route holding the
//! secret that signed it; a ledger per route let each of them decide it again. Rows are now
//! keyed by a digest of that secret (the scope) and the delivery id's digest. The previous
//! table's rows are carried over under the scope `route:<route_id>`, which the service still
//! reads for the route, until they expire.
use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum IngressLedger {
    Table,
    Scope,
    DeliveryKey,
    RouteId,
    ContentDigest,
    ClaimUntil,
    DecideTime,
    ExpireTime,
    Answer,
}

#[derive(DeriveIden)]
enum IngressDeliveries {
    Table,
    RouteId,
    DeliveryKey,
    DecideTime,
    ExpireTime,
    Answer,
}

const EXPIRY_INDEX: &str = "idx_ingress_ledger_expire_time";
const OLD_EXPIRY_INDEX: &str = "idx_ingress_deliveries_expire_time";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
        m.create_table(
            Table::create()
                .table(IngressLedger::Table)
                // SHA-256 (hex) of the signing key that verified the delivery, or
                // `route:<route_id>` for a row carried over from the per-route ledger.
                .col(
                    ColumnDef::new(IngressLedger::Scope)
                        .string_len(140)
                        .not_null(),
                )
                // SHA-256 (hex) of the signed delivery id.
                .col(
                    ColumnDef::new(IngressLedger::DeliveryKey)
                        .string_len(64)
                        .not_null(),
                )
                // The route the delivery was first decided at.
                .col(
                    ColumnDef::new(IngressLedger::RouteId)
                        .string_len(128)
                        .not_null(),
                )
                // SHA-256 (hex) of the signed content the id names; NULL for a carried-over row.
                .col(ColumnDef::new(IngressLedger::ContentDigest).string_len(64))
                // Unix microseconds until which a request deciding the delivery holds it;
                // NULL once decided, or when that request was refused before any decision.
                .col(ColumnDef::new(IngressLedger::ClaimUntil).big_integer())
                .col(
                    ColumnDef::new(IngressLedger::DecideTime)
                        .big_integer()
                        .not_null(),
                )
                .col(ColumnDef::new(IngressLedger::ExpireTime).big_integer())
                // The first answer's triggers, as JSON; empty while none was given.
                .col(ColumnDef::new(IngressLedger::Answer).text().not_null())
                .primary_key(
                    Index::create()
                        .col(IngressLedger::Scope)
                        .col(IngressLedger::DeliveryKey),
                )
                .to_owned(),
        )
        .await?;
        m.create_index(
            Index::create()
                .name(EXPIRY_INDEX)
                .table(IngressLedger::Table)
                .col(IngressLedger::ExpireTime)
                .to_owned(),
        )
        .await?;
        // `||` concatenates on both SQLite and PostgreSQL.
        m.get_connection()
            .execute_unprepared(
                "INSERT INTO ingress_ledger (scope, delivery_key, route_id, content_digest, \
                 claim_until, decide_time, expire_time, answer) \
                 SELECT 'route:' || route_id, delivery_key, route_id, NULL, NULL, decide_time, \
                 expire_time, answer FROM ingress_deliveries",
            )
            .await?;
        m.drop_table(Table::drop().table(IngressDeliveries::Table).to_owned())
            .await
    }

    async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
        m.create_table(
            Table::create()
                .table(IngressDeliveries::Table)
                .col(
                    ColumnDef::new(IngressDeliveries::RouteId)
                        .string_len(128)
                        .not_null(),
                )
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
                .col(ColumnDef::new(IngressDeliveries::ExpireTime).big_integer())
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
                .name(OLD_EXPIRY_INDEX)
                .table(IngressDeliveries::Table)
                .col(IngressDeliveries::ExpireTime)
                .to_owned(),
        )
        .await?;
        // A decided delivery goes back to the route that first decided it (one row per
        // route and key); claims in flight and refusals are not carried back.
        m.get_connection()
            .execute_unprepared(
                "INSERT INTO ingress_deliveries (route_id, delivery_key, decide_time, expire_time, answer) \
                 SELECT route_id, delivery_key, MIN(decide_time), MAX(expire_time), MIN(answer) \
                 FROM ingress_ledger WHERE answer <> '' GROUP BY route_id, delivery_key",
            )
            .await?;
        m.drop_table(Table::drop().table(IngressLedger::Table).to_owned())
            .await
    }
}
