//! The append-only schema migrations of hcp-sense, portable across SQLite and PostgreSQL.
pub use sea_orm_migration::prelude::*;

mod m20261130_000001_init;
mod m20261130_000002_audit;
mod m20261130_000003_record_position;
mod m20261201_000001_ingress_routes;
mod m20261202_000001_filters_and_land_retention;
mod m20261202_000002_ingress_deliveries;
mod m20261202_000003_quotas;
mod m20261203_000001_partitioned_records;
mod m20261204_000001_ingress_ledger;
mod m20261205_000001_decision_log;
mod m20261206_000001_decision_log_indexes;

/// The decision log's recorded entries, in the words its partial indexes use: a query names
/// them so for SQLite to use those indexes.
pub const DECISIONS_RECORDED: &str = m20261206_000001_decision_log_indexes::RECORDED;

/// Every migration, in the order it is applied.
pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(m20261130_000001_init::Migration),
            Box::new(m20261130_000002_audit::Migration),
            Box::new(m20261130_000003_record_position::Migration),
            Box::new(m20261201_000001_ingress_routes::Migration),
            Box::new(m20261202_000001_filters_and_land_retention::Migration),
            Box::new(m20261202_000002_ingress_deliveries::Migration),
            Box::new(m20261202_000003_quotas::Migration),
            Box::new(m20261203_000001_partitioned_records::Migration),
            Box::new(m20261204_000001_ingress_ledger::Migration),
            Box::new(m20261205_000001_decision_log::Migration),
            Box::new(m20261206_000001_decision_log_indexes::Migration),
        ]
    }
}
