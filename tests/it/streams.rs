//! Long-lived streams and connection shedding at the edge: reflection and every long-lived stream capped per peer and in all, an authenticated stream ending the oldest unauthenticated one to get in, connections holding only open streams shed for a runtime's call, and a burst of new connections from one host waiting for room instead of failing.
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use hcp_sense::grpc::pb::{self, ingest_service_client::IngestServiceClient};
use tonic::transport::{Channel, Endpoint};
use tonic::Code;
use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
use tonic_reflection::pb::v1::{
    server_reflection_client::ServerReflectionClient, server_reflection_request::MessageRequest,
    ServerReflectionRequest, ServerReflectionResponse,
};

use crate::helpers::{spawn_app_with, StoreKind, TestApp};

/// A channel to `app` whose connections come from 127.0.0.`last` (a peer of its own).
async fn from(app: &TestApp, last: u8) -> Channel {
    Endpoint::from_shared(format!("http://{}", app.addr))
        .expect("uri")
        .local_address(Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))))
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("connect")
}

/// Opens a reflection stream that stays open (its request side never ends); the refusal's
/// status otherwise.
async fn reflection(
    ch: &Channel,
) -> Result<
    (
        tokio::sync::mpsc::Sender<ServerReflectionRequest>,
        tonic::Streaming<ServerReflectionResponse>,
    ),
    tonic::Status,
> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    })
    .await
    .expect("queued");
    let mut stream = ServerReflectionClient::new(ch.clone())
        .server_reflection_info(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    // The first answer comes: the stream is open and served.
    stream.message().await?.expect("a listing");
    Ok((tx, stream))
}

async fn health_watch(ch: &Channel) -> Result<tonic::Streaming<pb_health::Resp>, tonic::Status> {
    let mut s = HealthClient::new(ch.clone())
        .watch(HealthCheckRequest::default())
        .await?
        .into_inner();
    s.message().await?.expect("the first status");
    Ok(s)
}

mod pb_health {
    pub type Resp = tonic_health::pb::HealthCheckResponse;
}

fn names(status: &tonic::Status, flag: &str) {
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains(flag),
        "{flag}: {}",
        status.message()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_streams_are_capped_per_peer_and_in_all() {
    let app = spawn_app_with(StoreKind::Sqlite, |c| {
        c.max_reflection_streams_per_peer = 2;
        c.max_reflection_streams = 3;
    })
    .await;
    let a = from(&app, 2).await;
    let b = from(&app, 3).await;
    let c = from(&app, 4).await;
    let mut held = Vec::new();
    for i in 0..2 {
        held.push(
            reflection(&a)
                .await
                .unwrap_or_else(|e| panic!("{i} of the peer's 2: {e:?}")),
        );
    }
    let e = reflection(&a).await.expect_err("the peer's third (n + 1)");
    names(&e, "(--max-reflection-streams-per-peer)");
    held.push(reflection(&b).await.expect("3 of 3 in all"));
    let e = reflection(&c).await.expect_err("a fourth in all (n + 1)");
    names(&e, "(--max-reflection-streams)");
    // A stream that ends gives its place back.
    let (tx, mut stream) = held.remove(0);
    drop(tx);
    while let Ok(Some(_)) = stream.message().await {}
    let mut again = None;
    for _ in 0..50 {
        match reflection(&c).await {
            Ok(s) => {
                again = Some(s);
                break;
            }
            Err(e) => {
                names(&e, "(--max-reflection-streams)");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    assert!(
        again.is_some(),
        "the ended stream's place was not given back"
    );
    app.stop().await;
}

/// At `--max-streams-per-peer` an unauthenticated stream is refused and an authenticated one
/// (here a WatchRecords on a server without credentials configured) ends the peer's oldest
/// unauthenticated stream, UNAVAILABLE; at `--max-streams` the same across peers.
async fn an_authenticated_stream_ends_the_oldest_open_one_at_a_stream_cap(kind: StoreKind) {
    let app = spawn_app_with(kind, |c| {
        c.max_streams_per_peer = 3;
        c.max_streams = 5;
    })
    .await;
    let a = from(&app, 2).await;
    let mut watches = Vec::new();
    for i in 0..3 {
        watches.push(
            health_watch(&a)
                .await
                .unwrap_or_else(|e| panic!("{i} of 3: {e:?}")),
        );
    }
    let e = health_watch(&a).await.expect_err("n + 1 of the peer");
    names(&e, "(--max-streams-per-peer)");
    let watch_records = |ch: Channel| async move {
        pb::record_service_client::RecordServiceClient::new(ch)
            .watch_records(pb::WatchRecordsRequest {
                start: Some(pb::watch_records_request::Start::FromNow(true)),
                ..Default::default()
            })
            .await
    };
    let _records = watch_records(a.clone()).await.expect("room made for it");
    let end = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match watches[0].message().await {
                Ok(Some(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the oldest open stream ends")
    .expect_err("with a status");
    assert_eq!(end.code(), Code::Unavailable, "{end:?}");
    assert!(end.message().contains("make room"), "{}", end.message());
    // The total: 3 of 127.0.0.2 and 2 of 127.0.0.3 fill 5.
    let b = from(&app, 3).await;
    let mut more = Vec::new();
    for _ in 0..2 {
        more.push(health_watch(&b).await.expect("within 5 in all"));
    }
    let c = from(&app, 4).await;
    let e = health_watch(&c).await.expect_err("n + 1 in all");
    names(&e, "(--max-streams)");
    let _other = watch_records(c.clone()).await.expect("room made in all");
    // With every stream of a peer authenticated, nothing is ended for another of its own.
    let _r2 = watch_records(a.clone())
        .await
        .expect("ends 127.0.0.2's second health watch");
    let _r3 = watch_records(a.clone()).await.expect("ends its third");
    let e = watch_records(a.clone())
        .await
        .expect_err("nothing left to end");
    names(&e, "(--max-streams-per-peer)");
    app.stop().await;
}
on_both_stores!(s7_6_an_authenticated_stream_ends_the_oldest_open_one_at_a_stream_cap => an_authenticated_stream_ends_the_oldest_open_one_at_a_stream_cap);

/// Four peers fill `--max-connections` with connections that each hold only a health Watch:
/// a runtime's DeliverTrigger on its existing connection and on a new one are answered, as
/// such connections are shed to make room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_holding_only_open_streams_are_shed_for_a_runtimes_call() {
    let app = spawn_app_with(StoreKind::Sqlite, |c| {
        c.max_connections = 16;
        c.max_connections_per_peer = 4;
    })
    .await;
    let existing = app.channel.clone();
    health_ok(&existing).await;
    let mut watches = Vec::new();
    for peer in 2..6 {
        for _ in 0..4 {
            let ch = from(&app, peer).await;
            if let Ok(w) = health_watch(&ch).await {
                watches.push((ch, w));
            }
        }
    }
    assert!(watches.len() >= 15, "{} watches held", watches.len());
    for (what, ch) in [("existing", existing), ("new", from(&app, 1).await)] {
        let mut client = IngestServiceClient::new(ch);
        let mut req = tonic::Request::new(crate::identity::opened("alice"));
        req.set_timeout(Duration::from_secs(8));
        match client.deliver_trigger(req).await {
            Ok(_) => {}
            Err(e) => assert!(
                !matches!(
                    e.code(),
                    Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled
                ),
                "{what} connection: {e:?}"
            ),
        }
    }
    app.stop().await;
}

/// 200 channels from one address, one call each, 50 at a time, at `--max-connections-per-peer
/// 8`: a new connection is neither shed before its first call (the grace) nor refused (it
/// waits for room), so every call is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_new_connections_from_one_host_waits_for_room_and_no_call_fails() {
    let app = spawn_app_with(StoreKind::Sqlite, |c| {
        c.max_connections_per_peer = 8;
    })
    .await;
    let addr = app.addr;
    let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(50));
    let mut calls = Vec::new();
    for i in 0..200 {
        let permit = sem.clone().acquire_owned().await.expect("permit");
        calls.push(tokio::spawn(async move {
            let _permit = permit;
            let ch = Endpoint::from_shared(format!("http://{addr}"))
                .expect("uri")
                .connect_timeout(Duration::from_secs(15))
                .connect()
                .await
                .map_err(|e| format!("{i}: connect: {e}"))?;
            let mut req = tonic::Request::new(HealthCheckRequest::default());
            req.set_timeout(Duration::from_secs(15));
            HealthClient::new(ch)
                .check(req)
                .await
                .map(|_| ())
                .map_err(|e| format!("{i}: {e:?}"))
        }));
    }
    let mut failed = Vec::new();
    for c in calls {
        if let Err(e) = c.await.expect("join") {
            failed.push(e);
        }
    }
    assert!(
        failed.is_empty(),
        "{} of 200 failed: {failed:?}",
        failed.len()
    );
    app.stop().await;
}

async fn health_ok(ch: &Channel) {
    HealthClient::new(ch.clone())
        .check(HealthCheckRequest::default())
        .await
        .expect("health");
}
