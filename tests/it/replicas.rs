//! Two replicas on one PostgreSQL: admin writes on one reach the other's decisions through
//! LISTEN/NOTIFY, and a replica that loses its listener catches up by itself.
use std::time::{Duration, Instant};

use hcp_sense::app::App;
use hcp_sense::config::Config;
use hcp_sense::grpc::pb::{self, ingest_service_client::IngestServiceClient};
use sea_orm::ConnectionTrait;
use tonic::transport::Channel;

use crate::helpers::{example, postgres_admin_url, spawn_app, StoreKind};

fn trigger() -> pb::DeliverTriggerRequest {
    pb::DeliverTriggerRequest {
        pack_id: "github".into(),
        r#ref: "issue.opened".into(),
        principal: "alice".into(),
        land: "user".into(),
        ..Default::default()
    }
}

/// Delivers on `ingest` until `done` says yes about an outcome, or the time runs out.
async fn until(
    ingest: &mut IngestServiceClient<Channel>,
    limit: Duration,
    done: impl Fn(&Result<pb::DeliverTriggerResponse, tonic::Status>) -> bool,
) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        let r = ingest
            .deliver_trigger(trigger())
            .await
            .map(tonic::Response::into_inner);
        if done(&r) {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoke_on_one_replica_reaches_the_other_and_a_lost_listener_recovers_postgres() {
    let mut a = spawn_app(StoreKind::Postgres).await;
    crate::packs::register(&mut a, &example("github.pack.json")).await;
    let grant = || pb::GrantSenseEnableRequest {
        principal: "alice".into(),
        pack_id: "github".into(),
    };
    a.policy.grant_sense_enable(grant()).await.expect("grant");
    a.policy
        .put_binding(pb::PutBindingRequest {
            principal: "alice".into(),
            pack_id: "github".into(),
            binding_id: "b".into(),
            state: 1,
        })
        .await
        .expect("bind");
    a.policy
        .activate_sense(pb::ActivateSenseRequest {
            principal: "alice".into(),
            pack_id: "github".into(),
            route: 1,
        })
        .await
        .expect("activate");

    // Replica B: another server on the same database.
    let b = App::build(Config::for_database(a.test_db.url.clone()))
        .await
        .expect("replica");
    let b_addr = b.local_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let b_task = tokio::spawn(b.run_until(async move {
        let _ = stopped.await;
    }));
    let ch = Channel::from_shared(format!("http://{b_addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let mut on_b = IngestServiceClient::new(ch);
    let recorded = |r: &Result<pb::DeliverTriggerResponse, tonic::Status>| {
        r.as_ref()
            .is_ok_and(|r| r.disposition == pb::Disposition::RecordedInbox as i32)
    };
    let no_grant = |r: &Result<pb::DeliverTriggerResponse, tonic::Status>| {
        r.as_ref()
            .is_ok_and(|r| r.drop_reason == pb::DropReason::NoGrant as i32)
    };
    assert!(
        until(&mut on_b, Duration::from_secs(5), recorded)
            .await
            .is_some(),
        "B records with A's policy"
    );

    // Revoke on A; B drops within the bound.
    a.policy
        .revoke_sense_enable(pb::RevokeSenseEnableRequest {
            principal: "alice".into(),
            pack_id: "github".into(),
        })
        .await
        .expect("revoke");
    let took = until(&mut on_b, Duration::from_secs(1), no_grant).await;
    assert!(
        took.is_some(),
        "B still records a second after the revoke on A"
    );
    eprintln!("revoke on A reached B in {:?}", took);

    // Cut B's listening connection, and change policy on A right away: the NOTIFY may be lost,
    // so B must fail closed, reload by itself and then record again.
    let name = a
        .test_db
        .url
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_owned();
    let admin = sea_orm::Database::connect(postgres_admin_url())
        .await
        .expect("admin");
    let killed = admin
        .query_all_raw(sea_orm::Statement::from_string(
            admin.get_database_backend(),
            format!("SELECT pg_terminate_backend(pid) AS t FROM pg_stat_activity WHERE datname = '{name}' AND query ILIKE 'LISTEN%'"),
        ))
        .await
        .expect("terminate");
    assert!(!killed.is_empty(), "a listening connection exists");
    a.policy
        .grant_sense_enable(grant())
        .await
        .expect("grant again");
    let mut saw_unavailable = false;
    let start = Instant::now();
    let recovered = loop {
        if start.elapsed() > Duration::from_secs(10) {
            break false;
        }
        match on_b.deliver_trigger(trigger()).await {
            Err(s) if s.code() == tonic::Code::Unavailable => saw_unavailable = true,
            Ok(r) if r.get_ref().disposition == pb::Disposition::RecordedInbox as i32 => {
                break true
            }
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert!(recovered, "B never caught up after losing its listener");
    eprintln!(
        "B recovered in {:?} (saw UNAVAILABLE meanwhile: {saw_unavailable})",
        start.elapsed()
    );
    let _ = admin.close().await;
    let _ = stop.send(());
    let _ = b_task.await;
}
