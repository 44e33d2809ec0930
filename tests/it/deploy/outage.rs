//! The database stopped, silent, failed over or not yet up: fail closed, acknowledge nothing unstored, recover alone.
use super::*;

/// PostgreSQL (reached over TLS) stopped under load: deliveries answer UNAVAILABLE, readiness
/// goes NOT_SERVING,
/// nothing is acknowledged without its record; started again, the same process records again
/// within 5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stopped_under_load_is_unavailable_and_recovers_by_itself() {
    let pg = Arc::new(PrivatePostgres::start());
    // Over TLS, as a production database is reached.
    let url = format!("{}?sslmode=require&application_name=sense-tls", pg.url());
    let served = Served::start(&url, &[]);
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    assert_eq!(health(&ch).await, Some(ServingStatus::Serving));
    {
        use sea_orm::ConnectionTrait;
        let conn = sea_orm::Database::connect(pg.url()).await.expect("connect");
        let row = conn
            .query_one_raw(sea_orm::Statement::from_string(
                conn.get_database_backend(),
                "SELECT count(*) AS n, coalesce(bool_and(s.ssl), false) AS all_tls \
                 FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
                 WHERE a.application_name = 'sense-tls'",
            ))
            .await
            .expect("pg_stat_ssl")
            .expect("row");
        let n: i64 = row.try_get("", "n").expect("n");
        let all_tls: bool = row.try_get("", "all_tls").expect("all_tls");
        assert!(n > 0 && all_tls, "{n} connections, all over TLS: {all_tls}");
    }

    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..6 {
        let mut ingest = IngestServiceClient::new(ch.clone());
        let stop = stop.clone();
        workers.push(tokio::spawn(async move {
            let mut acked = Vec::new();
            let mut codes: HashMap<tonic::Code, usize> = HashMap::new();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let trigger_id = format!("w{w}-{i}");
                match ingest
                    .deliver_trigger(storm_warning(trigger_id.clone()))
                    .await
                {
                    Ok(r) => acked.push((trigger_id, r.into_inner().record_id)),
                    Err(s) => {
                        *codes.entry(s.code()).or_default() += 1;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
            (acked, codes)
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    let down = pg.clone();
    tokio::task::spawn_blocking(move || down.down())
        .await
        .expect("stop PostgreSQL");
    let stopped_at = Instant::now();
    // Readiness follows at once (the policy listener's connection drops), on gRPC and HTTP.
    loop {
        let grpc = health(&ch).await;
        let http = http_status(&format!("http://{}/readyz", served.metrics_addr));
        if grpc == Some(ServingStatus::NotServing) && http == 503 {
            break;
        }
        assert!(
            stopped_at.elapsed() < Duration::from_secs(2),
            "still {grpc:?} / HTTP {http} 2 s after PostgreSQL stopped"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "NOT_SERVING {:?} after PostgreSQL stopped",
        stopped_at.elapsed()
    );
    // While it is down, a delivery is refused as UNAVAILABLE.
    let r = IngestServiceClient::new(ch.clone())
        .deliver_trigger(storm_warning("during-outage".into()))
        .await;
    assert_eq!(
        r.as_ref().map_err(|s| s.code()).err(),
        Some(tonic::Code::Unavailable),
        "{r:?}"
    );
    // So are an admin write and a read; the refused revoke changes nothing, in the store or in
    // the view (alice's triggers are recorded again once PostgreSQL is back).
    let revoke = {
        let ch = ch.clone();
        tokio::spawn(async move {
            PolicyServiceClient::new(ch)
                .revoke_sense_enable(revoke_alice())
                .await
                .map(|_| ())
        })
    };
    let list = RecordServiceClient::new(ch.clone())
        .list_records(pb::ListRecordsRequest {
            principal: "alice".into(),
            ..Default::default()
        })
        .await;
    let revoke = revoke.await.expect("revoke task");
    for (what, code) in [
        ("RevokeSenseEnable", revoke.err().map(|s| s.code())),
        ("ListRecords", list.err().map(|s| s.code())),
    ] {
        assert_eq!(
            code,
            Some(tonic::Code::Unavailable),
            "{what} during the outage"
        );
    }

    let up = pg.clone();
    tokio::task::spawn_blocking(move || up.up())
        .await
        .expect("start PostgreSQL");
    let started_at = Instant::now();
    let mut ingest = IngestServiceClient::new(ch.clone());
    let recovered = loop {
        let r = ingest
            .deliver_trigger(storm_warning(String::new()))
            .await
            .map(|r| r.into_inner());
        if recorded(&r) && health(&ch).await == Some(ServingStatus::Serving) {
            break started_at.elapsed();
        }
        assert!(
            started_at.elapsed() < Duration::from_secs(5),
            "not recovered 5 s after PostgreSQL came back: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    eprintln!("recording and SERVING {recovered:?} after PostgreSQL started");
    assert_eq!(
        http_status(&format!("http://{}/readyz", served.metrics_addr)),
        200
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);

    let mut acked = Vec::new();
    let mut codes: HashMap<tonic::Code, usize> = HashMap::new();
    for w in workers {
        let (a, c) = w.await.expect("worker");
        acked.extend(a);
        for (code, n) in c {
            *codes.entry(code).or_default() += n;
        }
    }
    eprintln!("{} acknowledged; refused: {codes:?}", acked.len());
    assert!(
        codes.keys().all(|c| *c == tonic::Code::Unavailable),
        "only UNAVAILABLE during the outage: {codes:?}"
    );
    assert!(codes.get(&tonic::Code::Unavailable).copied().unwrap_or(0) > 0);
    let conn = sea_orm::Database::connect(pg.url()).await.expect("connect");
    use sea_orm::EntityTrait;
    let rows = hcp_sense::store::entity::records::Entity::find()
        .all(&conn)
        .await
        .expect("records");
    let mut by_trigger: HashMap<String, Vec<String>> = HashMap::new();
    for r in rows {
        if let Some(t) = r.producer_trigger_id {
            by_trigger.entry(t).or_default().push(r.record_id);
        }
    }
    for (trigger_id, record_id) in &acked {
        assert_eq!(
            by_trigger.get(trigger_id),
            Some(&vec![record_id.clone()]),
            "acknowledged trigger {trigger_id} is stored once under its record id"
        );
    }
    assert!(served.terminate(), "exits 0 on SIGTERM");
}

/// The database silently unreachable (its connections neither answer nor close): the policy
/// listener's heartbeat goes unanswered, so the server fails closed — UNAVAILABLE and
/// NOT_SERVING — and when traffic flows again it recovers by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silently_lost_database_fails_closed_and_recovers_postgres() {
    let db = TestDb::create(StoreKind::Postgres).await;
    let (proxy, served) = FreezingProxy::serve(&db, &[]).await;
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    let mut ingest = IngestServiceClient::new(ch.clone());
    let deliver = |ingest: &mut IngestServiceClient<Channel>| {
        let mut req = tonic::Request::new(storm_warning(String::new()));
        req.set_timeout(Duration::from_millis(500));
        let mut ingest = ingest.clone();
        async move { ingest.deliver_trigger(req).await.map(|r| r.into_inner()) }
    };
    assert!(recorded(&deliver(&mut ingest).await));

    proxy.freeze(true);
    let frozen_at = Instant::now();
    let (mut unavailable, mut not_serving) = (false, false);
    while !(unavailable && not_serving) {
        assert!(
            frozen_at.elapsed() < Duration::from_secs(3),
            "still deciding 3 s into a silent outage (UNAVAILABLE seen: {unavailable}, NOT_SERVING seen: {not_serving}); log:\n{}", served.log.lock().map(|l| l.join("\n")).unwrap_or_default()
        );
        match deliver(&mut ingest).await {
            Err(s) if s.code() == tonic::Code::Unavailable => unavailable = true,
            Ok(r) if recorded(&Ok(r.clone())) => {
                panic!("recorded while the database cannot be reached: {r:?}")
            }
            _ => {}
        }
        not_serving |= health(&ch).await == Some(ServingStatus::NotServing);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "failed closed {:?} into a silent outage",
        frozen_at.elapsed()
    );

    proxy.freeze(false);
    let thawed_at = Instant::now();
    loop {
        if recorded(&deliver(&mut ingest).await)
            && health(&ch).await == Some(ServingStatus::Serving)
        {
            break;
        }
        assert!(
            thawed_at.elapsed() < Duration::from_secs(5),
            "not recovered 5 s after the database was reachable again"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "recovered {:?} after traffic flowed again",
        thawed_at.elapsed()
    );
    assert!(served.terminate());
}

/// A failover: every open database connection goes silent for good while new ones reach the
/// database. The server fails closed, then moves its listener, pool and record writer to new
/// connections and records again, with nothing acknowledged that was not stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_silent_failover_the_server_moves_to_new_connections_postgres() {
    let db = TestDb::create(StoreKind::Postgres).await;
    let (proxy, served) = FreezingProxy::serve(&db, &["--request-timeout-secs", "2"]).await;
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    let mut ingest = IngestServiceClient::new(ch.clone());
    let mut acked = Vec::new();
    for i in 0..20 {
        let id = format!("before-{i}");
        let r = ingest
            .deliver_trigger(storm_warning(id.clone()))
            .await
            .expect("deliver")
            .into_inner();
        acked.push((id, r.record_id));
    }
    proxy.fail_over();
    let failed_over = Instant::now();
    let mut i = 0;
    let recovered = loop {
        i += 1;
        let id = format!("after-{i}");
        let mut req = tonic::Request::new(storm_warning(id.clone()));
        req.set_timeout(Duration::from_secs(3));
        if let Ok(r) = ingest.deliver_trigger(req).await {
            acked.push((id, r.into_inner().record_id));
            if health(&ch).await == Some(ServingStatus::Serving) {
                break failed_over.elapsed();
            }
        }
        assert!(
            failed_over.elapsed() < Duration::from_secs(20),
            "still not recording 20 s after a failover; log:\n{}",
            served.log.lock().map(|l| l.join("\n")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("recording again {recovered:?} after the failover");
    for (id, record_id) in &acked {
        assert_eq!(
            records_for(&db, id).await,
            vec![record_id.clone()],
            "acknowledged trigger {id}"
        );
    }
    assert!(served.terminate());
}

/// A replica started while its database is down keeps trying, and serves once the database
/// is up, instead of exiting (where Kubernetes would back off for minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_started_while_postgres_is_down_waits_for_it() {
    let pg = Arc::new(PrivatePostgres::start());
    pg.down();
    let url = pg.url();
    let starting = std::thread::spawn(move || Served::start(&url, &[]));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!starting.is_finished(), "started without a database");
    let up = pg.clone();
    tokio::task::spawn_blocking(move || up.up())
        .await
        .expect("start PostgreSQL");
    let up_at = Instant::now();
    let served = tokio::task::spawn_blocking(move || starting.join().expect("server thread"))
        .await
        .expect("join");
    eprintln!("serving {:?} after PostgreSQL started", up_at.elapsed());
    assert!(up_at.elapsed() < Duration::from_secs(10));
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    assert!(recorded(
        &IngestServiceClient::new(ch.clone())
            .deliver_trigger(storm_warning(String::new()))
            .await
            .map(|r| r.into_inner())
    ));
    assert!(served.terminate());
}

/// The database goes silent under callers: each is answered UNAVAILABLE — which producers
/// retry — before its own deadline or the server's, never CANCELLED or DEADLINE_EXCEEDED; the
/// retries after it comes back leave every trigger recorded exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_database_is_unavailable_before_every_deadline_postgres() {
    use hcp_sense::grpc::pb::ingest_service_client::IngestServiceClient;
    let db = TestDb::create(StoreKind::Postgres).await;
    let (proxy, served) = FreezingProxy::serve(&db, &["--request-timeout-secs", "3"]).await;
    let ch = connect(&served.addr).await;
    set_up_weather(&ch).await;
    let deliver = |id: String, deadline: Option<Duration>| {
        let ch = ch.clone();
        async move {
            let mut req = tonic::Request::new(storm_warning(id));
            if let Some(d) = deadline {
                req.set_timeout(d);
            }
            let started = Instant::now();
            let r = IngestServiceClient::new(ch)
                .deliver_trigger(req)
                .await
                .map(tonic::Response::into_inner);
            (r, started.elapsed())
        }
    };
    assert!(recorded(&deliver("warm-up".into(), None).await.0));
    proxy.freeze(true);
    let mut calls = Vec::new();
    for i in 0..50 {
        // 40 bounded by the server's 3 s, 10 by their own 1 s deadline.
        let deadline = (i >= 40).then_some(Duration::from_secs(1));
        calls.push((
            deadline.unwrap_or(Duration::from_secs(3)),
            tokio::spawn(deliver(format!("silent-{i}"), deadline)),
        ));
    }
    for (bound, call) in calls {
        let (r, took) = call.await.expect("call");
        let code = r.as_ref().err().map(tonic::Status::code);
        assert_eq!(code, Some(tonic::Code::Unavailable), "{r:?} after {took:?}");
        assert!(
            took < bound,
            "answered after {took:?}, its deadline was {bound:?}"
        );
    }
    proxy.freeze(false);
    let thawed = Instant::now();
    for i in 0..50 {
        while !recorded(&deliver(format!("silent-{i}"), None).await.0) {
            assert!(thawed.elapsed() < Duration::from_secs(20), "not recovered");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let conn = db.connect().await;
    use sea_orm::ConnectionTrait;
    let row = conn
        .query_one_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::Postgres,
            "SELECT COUNT(*) AS n, COUNT(DISTINCT producer_trigger_id) AS d FROM records",
        ))
        .await
        .expect("count")
        .expect("row");
    let (n, d): (i64, i64) = (
        row.try_get("", "n").expect("n"),
        row.try_get("", "d").expect("d"),
    );
    assert_eq!((n, d), (51, 51), "every trigger once, the warm-up included");
    assert!(served.terminate());
}
