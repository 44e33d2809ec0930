//! Shutdown with a call still in flight.
use super::*;

/// A call that outlives the grace period (its record write waiting on a database gone silent)
/// does not hold up shutdown: after SIGTERM no new connection is accepted, and the process
/// exits 0 once the grace period is over, without acknowledging that call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_at_the_grace_period_with_a_call_still_in_flight_postgres() {
    let db = TestDb::create(StoreKind::Postgres).await;
    let (proxy, served) = FreezingProxy::serve(&db, &["--shutdown-grace-secs", "1"]).await;
    let addr = served.addr.clone();
    let ch = connect(&addr).await;
    set_up_weather(&ch).await;
    proxy.freeze(true);
    let stuck = {
        let mut ingest = IngestServiceClient::new(ch.clone());
        tokio::spawn(async move {
            ingest
                .deliver_trigger(storm_warning("in-flight".into()))
                .await
                .map(|r| r.into_inner())
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stopping = tokio::task::spawn_blocking(move || served.terminate_timed());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let refused = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await;
    assert!(
        refused.is_err(),
        "a new connection was accepted during the grace period"
    );
    let (exited_cleanly, took) = stopping.await.expect("join");
    eprintln!("exited {took:?} after SIGTERM with a call in flight");
    assert!(exited_cleanly, "exit 0 after the grace period");
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_millis(1300),
        "exit {took:?} after SIGTERM; the grace period is 1 s"
    );
    let r = stuck.await.expect("call");
    assert!(r.is_err(), "acknowledged without a record: {r:?}");
    proxy.freeze(false);
    assert!(
        records_for(&db, "in-flight").await.is_empty(),
        "the call's record was written after all"
    );
}
