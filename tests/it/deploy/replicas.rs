//! Replicas on one database: policy followed across processes, idempotency across replicas and restarts.
use super::*;

/// Two `hcp-sense` processes on one database: a revoke on A stops B's recording within the
/// bound; B's listening connection cut makes B refuse (UNAVAILABLE, NOT_SERVING) until it has
/// reloaded by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_server_processes_follow_each_other_and_fail_closed_without_a_listener_postgres() {
    let db = TestDb::create(StoreKind::Postgres).await;
    let a = Served::start(&with_app_name(&db.url, "replica-a"), &[]);
    let b = Served::start(&with_app_name(&db.url, "replica-b"), &[]);
    let (ch_a, ch_b) = (connect(&a.addr).await, connect(&b.addr).await);
    set_up_weather(&ch_a).await;
    let mut policy_a = PolicyServiceClient::new(ch_a.clone());
    let mut ingest_b = IngestServiceClient::new(ch_b.clone());

    // B hears A's setup.
    let start = Instant::now();
    while !recorded(
        &ingest_b
            .deliver_trigger(storm_warning(String::new()))
            .await
            .map(|r| r.into_inner()),
    ) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "B never saw A's setup"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }

    // Revoke on A: B drops within 1 s, and keeps dropping after.
    policy_a
        .revoke_sense_enable(revoke_alice())
        .await
        .expect("revoke");
    let revoked_at = Instant::now();
    loop {
        let r = ingest_b
            .deliver_trigger(storm_warning(String::new()))
            .await
            .expect("deliver on B")
            .into_inner();
        if r.drop_reason == pb::DropReason::NoGrant as i32 {
            break;
        }
        assert!(
            revoked_at.elapsed() < Duration::from_secs(1),
            "B still records {:?} after the revoke on A",
            revoked_at.elapsed()
        );
    }
    eprintln!("revoke on A reached B in {:?}", revoked_at.elapsed());
    // Past the bound, B keeps dropping.
    tokio::time::sleep_until((revoked_at + Duration::from_secs(1)).into()).await;
    for _ in 0..20 {
        let r = ingest_b
            .deliver_trigger(storm_warning(String::new()))
            .await
            .expect("deliver on B")
            .into_inner();
        assert_eq!(
            r.drop_reason,
            pb::DropReason::NoGrant as i32,
            "after the bound"
        );
    }
    assert_eq!(health(&ch_b).await, Some(ServingStatus::Serving));

    // Cut B's listener and grant again on A at once: that NOTIFY may never reach B.
    let db_name = db.url.rsplit('/').next().unwrap_or_default().to_owned();
    assert_eq!(
        terminate_listener(&db_name, "replica-b").await,
        1,
        "B listens"
    );
    policy_a
        .grant_sense_enable(grant_alice())
        .await
        .expect("grant again");
    let cut_at = Instant::now();
    let (mut unavailable, mut not_serving, mut not_ready) = (0, 0, 0);
    let recovered = loop {
        let r = ingest_b.deliver_trigger(storm_warning(String::new())).await;
        match &r {
            Err(s) if s.code() == tonic::Code::Unavailable => unavailable += 1,
            Err(s) => panic!("B answered {s:?} while catching up"),
            Ok(_) => {}
        }
        let h = health(&ch_b).await;
        if h == Some(ServingStatus::NotServing) {
            not_serving += 1;
            if not_ready == 0 && http_status(&format!("http://{}/readyz", b.metrics_addr)) == 503 {
                not_ready += 1;
            }
        }
        if recorded(&r.map(|r| r.into_inner())) && h == Some(ServingStatus::Serving) {
            break cut_at.elapsed();
        }
        assert!(
            cut_at.elapsed() < Duration::from_secs(5),
            "B did not recover within 5 s of losing its listener"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    eprintln!(
        "B without a listener: {unavailable} UNAVAILABLE, {not_serving} NOT_SERVING; recovered in {recovered:?}"
    );
    assert!(
        unavailable > 0,
        "B kept deciding while its listener was gone"
    );
    assert!(not_serving > 0, "B's health never said NOT_SERVING");
    assert!(not_ready > 0, "B's /readyz never said 503");
    assert_eq!(
        http_status(&format!("http://{}/readyz", b.metrics_addr)),
        200
    );

    // A burst of admin writes on A, ending revoked: a second later B is revoked too.
    for i in 0..60 {
        if i % 2 == 0 {
            policy_a
                .grant_sense_enable(grant_alice())
                .await
                .expect("grant");
        } else {
            policy_a
                .revoke_sense_enable(revoke_alice())
                .await
                .expect("revoke");
        }
    }
    let burst_end = Instant::now();
    tokio::time::sleep_until((burst_end + Duration::from_secs(1)).into()).await;
    for _ in 0..20 {
        let r = ingest_b
            .deliver_trigger(storm_warning(String::new()))
            .await
            .expect("deliver on B after the burst")
            .into_inner();
        assert_eq!(
            r.drop_reason,
            pb::DropReason::NoGrant as i32,
            "B records a second after a burst on A that ended revoked"
        );
    }
    assert!(a.terminate() && b.terminate(), "both exit 0 on SIGTERM");
}

/// A producer trigger id seen again for the same pack returns the first record and stores
/// nothing new: on another replica, and after the server is killed and started again.
async fn idempotent_across_replicas_and_restarts(kind: StoreKind) {
    let db = TestDb::create(kind).await;
    let mut first = Served::start(&db.url, &[]);
    let ch = connect(&first.addr).await;
    set_up_weather(&ch).await;
    let original = deliver_once(&ch, "storm-42").await;
    assert_eq!(original.disposition, pb::Disposition::RecordedInbox as i32);
    assert_eq!(
        records_for(&db, "storm-42").await,
        vec![original.record_id.clone()]
    );

    let mut others = Vec::new();
    if kind == StoreKind::Postgres {
        // A second replica, concurrently with the first.
        let other = Served::start(&db.url, &[]);
        let ch_other = connect(&other.addr).await;
        let again = deliver_once(&ch_other, "storm-42").await;
        assert_eq!(
            again.record_id, original.record_id,
            "the other replica returns the first record"
        );
        // A new id sent to both replicas at once, many times: one record, one answer.
        let mut calls = Vec::new();
        for i in 0..20 {
            let ch = if i % 2 == 0 {
                ch.clone()
            } else {
                ch_other.clone()
            };
            calls.push(tokio::spawn(async move {
                deliver_once(&ch, "storm-77").await.record_id
            }));
        }
        let mut ids = std::collections::BTreeSet::new();
        for c in calls {
            ids.insert(c.await.expect("call"));
        }
        assert_eq!(
            ids.len(),
            1,
            "concurrent duplicates on two replicas: {ids:?}"
        );
        assert_eq!(
            records_for(&db, "storm-77").await,
            ids.into_iter().collect::<Vec<_>>()
        );
        others.push(other);
    }
    first.kill9();
    let restarted = Served::start(&db.url, &[]);
    let again = deliver_once(&connect(&restarted.addr).await, "storm-42").await;
    assert_eq!(
        again.record_id, original.record_id,
        "after kill -9 and restart"
    );
    assert_eq!(again.disposition, original.disposition);
    assert_eq!(
        records_for(&db, "storm-42").await,
        vec![original.record_id.clone()],
        "stored once"
    );
    // A new id is a new record.
    let fresh = deliver_once(&connect(&restarted.addr).await, "storm-43").await;
    assert_ne!(fresh.record_id, original.record_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_trigger_ids_across_replicas_and_restarts_postgres() {
    idempotent_across_replicas_and_restarts(StoreKind::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_trigger_ids_across_restarts_sqlite() {
    idempotent_across_replicas_and_restarts(StoreKind::Sqlite).await;
}
