//! The audit log: every admin mutation, written in the transaction of the change it records.
use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum AuditEvents {
    Table,
    EventId,
    EventTime,
    Actor,
    Role,
    Rpc,
    PackId,
    Principal,
    Before,
    After,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
        m.create_table(
            Table::create()
                .table(AuditEvents::Table)
                .col(
                    ColumnDef::new(AuditEvents::EventId)
                        .string_len(64)
                        .not_null()
                        .primary_key(),
                )
                .col(
                    ColumnDef::new(AuditEvents::EventTime)
                        .big_integer()
                        .not_null(),
                )
                .col(
                    ColumnDef::new(AuditEvents::Actor)
                        .string_len(256)
                        .not_null(),
                )
                .col(ColumnDef::new(AuditEvents::Role).string_len(16).not_null())
                .col(ColumnDef::new(AuditEvents::Rpc).string_len(128).not_null())
                .col(ColumnDef::new(AuditEvents::PackId).string_len(128).null())
                .col(
                    ColumnDef::new(AuditEvents::Principal)
                        .string_len(256)
                        .null(),
                )
                .col(ColumnDef::new(AuditEvents::Before).text().null())
                .col(ColumnDef::new(AuditEvents::After).text().null())
                .to_owned(),
        )
        .await?;
        m.create_index(
            Index::create()
                .name("idx_audit_events_time")
                .table(AuditEvents::Table)
                .col(AuditEvents::EventTime)
                .col(AuditEvents::EventId)
                .to_owned(),
        )
        .await
    }

    async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
        m.drop_table(Table::drop().table(AuditEvents::Table).to_owned())
            .await
    }
}
