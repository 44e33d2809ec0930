//! Running it for real: replicas sharing one PostgreSQL, a database that goes away, shutdown,
//! and the image and chart. The helpers here are shared by the files below.
mod chart;
mod outage;
mod pooler;
mod replicas;
mod shutdown;

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hcp_sense::grpc::pb::{
    self, ingest_service_client::IngestServiceClient, policy_service_client::PolicyServiceClient,
    record_service_client::RecordServiceClient,
};
use tonic::transport::Channel;
use tonic_health::pb::{health_check_response::ServingStatus, health_client::HealthClient};

use crate::cli::{connect, set_up_weather, storm_warning};
use crate::helpers::{http_status, postgres_admin_url, repo_path, StoreKind, TestDb};
use crate::support::postgres::PrivatePostgres;
use crate::support::proxy::FreezingProxy;
use crate::support::served::Served;

/// The server's overall grpc.health.v1 status ("" service), or None if it does not answer.
async fn health(ch: &Channel) -> Option<ServingStatus> {
    let r = HealthClient::new(ch.clone())
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .ok()?;
    ServingStatus::try_from(r.into_inner().status).ok()
}

fn revoke_alice() -> pb::RevokeSenseEnableRequest {
    pb::RevokeSenseEnableRequest {
        principal: "alice".into(),
        pack_id: "weather".into(),
    }
}

fn grant_alice() -> pb::GrantSenseEnableRequest {
    pb::GrantSenseEnableRequest {
        principal: "alice".into(),
        pack_id: "weather".into(),
    }
}

fn recorded(r: &Result<pb::DeliverTriggerResponse, tonic::Status>) -> bool {
    r.as_ref()
        .is_ok_and(|r| r.disposition == pb::Disposition::RecordedInbox as i32)
}

/// Kills the connection of one replica (by its application_name) that LISTENs: the one whose
/// last statement was its LISTEN or its heartbeat.
async fn terminate_listener(db_name: &str, application_name: &str) -> usize {
    use sea_orm::ConnectionTrait;
    let admin = sea_orm::Database::connect(postgres_admin_url())
        .await
        .expect("admin");
    let killed = admin
        .query_all_raw(sea_orm::Statement::from_string(
            admin.get_database_backend(),
            format!(
                "SELECT pg_terminate_backend(pid) AS t FROM pg_stat_activity \
                 WHERE datname = '{db_name}' AND application_name = '{application_name}' \
                 AND (query ILIKE 'LISTEN%' OR query ILIKE 'SELECT pg_notify($1, %')"
            ),
        ))
        .await
        .expect("terminate");
    let _ = admin.close().await;
    killed.len()
}

fn with_app_name(url: &str, name: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={name}")
}

/// The records stored for one producer trigger id.
async fn records_for(db: &TestDb, trigger_id: &str) -> Vec<String> {
    use hcp_sense::store::entity::records;
    use sea_orm::{ColumnTrait, EntityTrait, QueryFilter};
    records::Entity::find()
        .filter(records::Column::ProducerTriggerId.eq(trigger_id))
        .all(&db.connect().await)
        .await
        .expect("records")
        .into_iter()
        .map(|r| r.record_id)
        .collect()
}

async fn deliver_once(ch: &Channel, trigger_id: &str) -> pb::DeliverTriggerResponse {
    IngestServiceClient::new(ch.clone())
        .deliver_trigger(storm_warning(trigger_id.into()))
        .await
        .expect("deliver")
        .into_inner()
}
