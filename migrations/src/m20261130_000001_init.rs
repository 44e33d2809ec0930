//! The first schema: packs and their declarations, Sense policy, Execute state kept apart, and the sink.
//!
//! Times are microseconds since the Unix epoch in BIGINT columns, so that ordering and
//! comparison behave the same on SQLite and PostgreSQL. This file carries its own identifiers
//! so that it never changes when an entity does.
use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum Packs {
    Table,
    PackId,
    Kind,
    BindingMode,
    BindingHub,
    UpstreamRequiresRegistration,
    Manifest,
    Generation,
    CreateTime,
    UpdateTime,
}

#[derive(DeriveIden)]
enum PackTriggers {
    Table,
    PackId,
    Position,
    Ref,
    Source,
}

#[derive(DeriveIden)]
enum PackStimuli {
    Table,
    PackId,
    Position,
    Ref,
    Operation,
    Land,
}

#[derive(DeriveIden)]
enum PackCommands {
    Table,
    PackId,
    Position,
    Name,
    InstallsWebhook,
}

#[derive(DeriveIden)]
enum SenseGrants {
    Table,
    Principal,
    PackId,
    CreateTime,
}

#[derive(DeriveIden)]
enum Bindings {
    Table,
    Principal,
    PackId,
    BindingId,
    Mode,
    State,
    UpdateTime,
}

#[derive(DeriveIden)]
enum SenseActivations {
    Table,
    Principal,
    PackId,
    Enabled,
    Route,
    UpdateTime,
}

/// Owned by the Execute side; kept in its own table so that Sense can be shown never to touch it.
#[derive(DeriveIden)]
enum ExecuteStates {
    Table,
    Principal,
    PackId,
    Installed,
    Activated,
    Connected,
    UpdateTime,
}

#[derive(DeriveIden)]
enum ProjectMembers {
    Table,
    Project,
    Principal,
    CreateTime,
}

/// The sink.
#[derive(DeriveIden)]
enum Records {
    Table,
    RecordId,
    Principal,
    BindingId,
    Land,
    PackId,
    Ref,
    Payload,
    Route,
    Project,
    ProducerTriggerId,
    ReceivedTime,
}

#[derive(DeriveIden)]
enum DropReports {
    Table,
    PackId,
    Ref,
    Reason,
    Count,
    FirstSeen,
    LastSeen,
}

fn s(col: impl IntoIden, len: u32) -> ColumnDef {
    ColumnDef::new(col).string_len(len).not_null().to_owned()
}

fn big(col: impl IntoIden) -> ColumnDef {
    ColumnDef::new(col).big_integer().not_null().to_owned()
}

fn flag(col: impl IntoIden) -> ColumnDef {
    ColumnDef::new(col).boolean().not_null().to_owned()
}

fn int(col: impl IntoIden) -> ColumnDef {
    ColumnDef::new(col).integer().not_null().to_owned()
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, m: &SchemaManager) -> Result<(), DbErr> {
        m.create_table(
            Table::create()
                .table(Packs::Table)
                .col(s(Packs::PackId, 128).primary_key())
                .col(s(Packs::Kind, 16))
                .col(s(Packs::BindingMode, 16))
                .col(ColumnDef::new(Packs::BindingHub).string_len(128).null())
                .col(flag(Packs::UpstreamRequiresRegistration))
                .col(ColumnDef::new(Packs::Manifest).text().not_null())
                .col(big(Packs::Generation))
                .col(big(Packs::CreateTime))
                .col(big(Packs::UpdateTime))
                .to_owned(),
        )
        .await?;

        m.create_table(
            Table::create()
                .table(PackTriggers::Table)
                .col(s(PackTriggers::PackId, 128))
                .col(int(PackTriggers::Position))
                .col(s(PackTriggers::Ref, 256))
                .col(s(PackTriggers::Source, 16))
                .primary_key(
                    Index::create()
                        .col(PackTriggers::PackId)
                        .col(PackTriggers::Ref),
                )
                .to_owned(),
        )
        .await?;

        m.create_table(
            Table::create()
                .table(PackStimuli::Table)
                .col(s(PackStimuli::PackId, 128))
                .col(int(PackStimuli::Position))
                .col(s(PackStimuli::Ref, 256))
                .col(s(PackStimuli::Operation, 32))
                .col(s(PackStimuli::Land, 64))
                .primary_key(
                    Index::create()
                        .col(PackStimuli::PackId)
                        .col(PackStimuli::Position),
                )
                .to_owned(),
        )
        .await?;

        m.create_table(
            Table::create()
                .table(PackCommands::Table)
                .col(s(PackCommands::PackId, 128))
                .col(int(PackCommands::Position))
                .col(s(PackCommands::Name, 256))
                .col(flag(PackCommands::InstallsWebhook))
                .primary_key(
                    Index::create()
                        .col(PackCommands::PackId)
                        .col(PackCommands::Position),
                )
                .to_owned(),
        )
        .await?;

        m.create_table(
            Table::create()
                .table(SenseGrants::Table)
                .col(s(SenseGrants::Principal, 256))
                .col(s(SenseGrants::PackId, 128))
                .col(big(SenseGrants::CreateTime))
                .primary_key(
                    Index::create()
                        .col(SenseGrants::Principal)
                        .col(SenseGrants::PackId),
                )
                .to_owned(),
        )
        .await?;
        m.create_index(
            Index::create()
                .name("idx_sense_grants_pack")
                .table(SenseGrants::Table)
                .col(SenseGrants::PackId)
                .to_owned(),
        )
        .await?;

        m.create_table(
            Table::create()
                .table(Bindings::Table)
                .col(s(Bindings::Principal, 256))
                .col(s(Bindings::PackId, 128))
                .col(s(Bindings::BindingId, 256))
                .col(s(Bindings::Mode, 16))
                .col(s(Bindings::State, 16))
                .col(big(Bindings::UpdateTime))
                .primary_key(
                    Index::create()
                        .col(Bindings::Principal)
                        .col(Bindings::PackId),
                )
                .to_owned(),
        )
        .await?;
        m.create_index(
            Index::create()
                .name("idx_bindings_pack")
                .table(Bindings::Table)
                .col(Bindings::PackId)
                .to_owned(),
        )
        .await?;

        m.create_table(
            Table::create()
                .table(SenseActivations::Table)
                .col(s(SenseActivations::Principal, 256))
                .col(s(SenseActivations::PackId, 128))
                .col(flag(SenseActivations::Enabled))
                .col(s(SenseActivations::Route, 16))
                .col(big(SenseActivations::UpdateTime))
                .primary_key(
                    Index::create()
                        .col(SenseActivations::Principal)
                        .col(SenseActivations::PackId),
                )
                .to_owned(),
        )
        .await?;

        m.create_table(
            Table::create()
                .table(ExecuteStates::Table)
                .col(s(ExecuteStates::Principal, 256))
                .col(s(ExecuteStates::PackId, 128))
                .col(flag(ExecuteStates::Installed))
                .col(flag(ExecuteStates::Activated))
                .col(flag(ExecuteStates::Connected))
                .col(big(ExecuteStates::UpdateTime))
                .primary_key(
                    Index::create()
                        .col(ExecuteStates::Principal)
                        .col(ExecuteStates::PackId),
                )
                .to_owned(),
        )
        .await?;

        m.create_table(
            Table::create()
                .table(ProjectMembers::Table)
                .col(s(ProjectMembers::Project, 256))
                .col(s(ProjectMembers::Principal, 256))
                .col(big(ProjectMembers::CreateTime))
                .primary_key(
                    Index::create()
                        .col(ProjectMembers::Project)
                        .col(ProjectMembers::Principal),
                )
                .to_owned(),
        )
        .await?;
        m.create_index(
            Index::create()
                .name("idx_project_members_principal")
                .table(ProjectMembers::Table)
                .col(ProjectMembers::Principal)
                .to_owned(),
        )
        .await?;

        m.create_table(
            Table::create()
                .table(Records::Table)
                .col(s(Records::RecordId, 64).primary_key())
                .col(s(Records::Principal, 256))
                .col(s(Records::BindingId, 256))
                .col(s(Records::Land, 64))
                .col(s(Records::PackId, 128))
                .col(s(Records::Ref, 256))
                .col(ColumnDef::new(Records::Payload).text().not_null())
                .col(s(Records::Route, 16))
                .col(ColumnDef::new(Records::Project).string_len(256).null())
                .col(
                    ColumnDef::new(Records::ProducerTriggerId)
                        .string_len(256)
                        .null(),
                )
                .col(big(Records::ReceivedTime))
                .to_owned(),
        )
        .await?;
        // ListRecords pages by (received_time, record_id), usually for one principal.
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
        // Idempotency: one record per producer trigger id and pack (NULLs never collide).
        m.create_index(
            Index::create()
                .name("uq_records_producer_trigger")
                .table(Records::Table)
                .col(Records::PackId)
                .col(Records::ProducerTriggerId)
                .unique()
                .to_owned(),
        )
        .await?;

        m.create_table(
            Table::create()
                .table(DropReports::Table)
                .col(s(DropReports::PackId, 128))
                .col(s(DropReports::Ref, 256))
                .col(s(DropReports::Reason, 32))
                .col(big(DropReports::Count))
                .col(big(DropReports::FirstSeen))
                .col(big(DropReports::LastSeen))
                .primary_key(
                    Index::create()
                        .col(DropReports::PackId)
                        .col(DropReports::Ref)
                        .col(DropReports::Reason),
                )
                .to_owned(),
        )
        .await?;
        Ok(())
    }

    async fn down(&self, m: &SchemaManager) -> Result<(), DbErr> {
        for t in [
            DropReports::Table.into_iden(),
            Records::Table.into_iden(),
            ProjectMembers::Table.into_iden(),
            ExecuteStates::Table.into_iden(),
            SenseActivations::Table.into_iden(),
            Bindings::Table.into_iden(),
            SenseGrants::Table.into_iden(),
            PackCommands::Table.into_iden(),
            PackStimuli::Table.into_iden(),
            PackTriggers::Table.into_iden(),
            Packs::Table.into_iden(),
        ] {
            m.drop_table(Table::drop().table(t).to_owned()).await?;
        }
        Ok(())
    }
}
