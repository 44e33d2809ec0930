//! Ingress routes: how a signed HTTP request becomes a trigger of a pack (its kind, mapping and signing secrets).
use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum IngressRoutes {
    Table,
    RouteId,
    PackId,
    Kind,
    Mapping,
    Secrets,
    FanOut,
    TypePrefix,
    NatsStream,
    NatsSubject,
    UpdateTime,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
        m.create_table(
            Table::create()
                .table(IngressRoutes::Table)
                .col(
                    ColumnDef::new(IngressRoutes::RouteId)
                        .string_len(128)
                        .not_null()
                        .primary_key(),
                )
                .col(
                    ColumnDef::new(IngressRoutes::PackId)
                        .string_len(128)
                        .not_null(),
                )
                .col(
                    ColumnDef::new(IngressRoutes::Kind)
                        .string_len(32)
                        .not_null(),
                )
                // The mapping's expressions as a JSON object.
                .col(ColumnDef::new(IngressRoutes::Mapping).text().not_null())
                // The signing secrets as a JSON array; never returned, never audited.
                .col(ColumnDef::new(IngressRoutes::Secrets).text().not_null())
                .col(ColumnDef::new(IngressRoutes::FanOut).boolean().not_null())
                // CloudEvents: stripped from an event's type to make its ref.
                .col(
                    ColumnDef::new(IngressRoutes::TypePrefix)
                        .string_len(256)
                        .not_null()
                        .default(""),
                )
                // NATS: the JetStream stream and the subject filter of the route's consumer.
                .col(
                    ColumnDef::new(IngressRoutes::NatsStream)
                        .string_len(64)
                        .not_null()
                        .default(""),
                )
                .col(
                    ColumnDef::new(IngressRoutes::NatsSubject)
                        .string_len(256)
                        .not_null()
                        .default(""),
                )
                .col(
                    ColumnDef::new(IngressRoutes::UpdateTime)
                        .big_integer()
                        .not_null(),
                )
                .to_owned(),
        )
        .await
    }

    async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
        m.drop_table(Table::drop().table(IngressRoutes::Table).to_owned())
            .await
    }
}
