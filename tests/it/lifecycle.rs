//! The one lifecycle, over the real server: shutdown ends every task and thread the service started, the edges' (HTTP listeners, NATS consumers) and the work they took included.
use std::net::SocketAddr;

use hcp_sense::app::App;
use hcp_sense::config::Config;
use hcp_sense::lifecycle::Live;

use crate::cli::{connect, set_up_weather};
use crate::helpers::{StoreKind, TestDb};
use crate::nats::{ids, put_nats_route, python, recorded_exactly, unique, NATS};

/// A server with every door open (gRPC, the HTTP ingress, NATS) takes admin writes and NATS
/// messages, then stops: once `run_until` has returned, no task and no thread of its lifecycle
/// is left running.
async fn shutdown_ends_every_task_and_thread(kind: StoreKind) {
    crate::trace::install();
    let db = TestDb::create(kind).await;
    let mut config = Config::for_database(db.url.clone());
    config.ingress_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    config.nats_url = Some(NATS.into());
    let app = App::build(config).await.expect("build app");
    let life = app.hub().lifecycle().clone();
    let addr = app.local_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(app.run_until(async move {
        let _ = stopped.await;
    }));
    let ch = connect(&addr.to_string()).await;
    // Admin writes run to their end as tasks of the lifecycle.
    set_up_weather(&ch).await;
    // A NATS route whose consumer takes messages, decided through the sink's writer threads.
    let base = unique(kind, "lifecycle");
    let (stream, subject) = (
        format!("HCP_{}", base.to_uppercase()),
        format!("hcp.{base}"),
    );
    python(&[NATS, &stream, &format!("{subject}.>"), "0", "add-stream"]);
    put_nats_route(&ch, "lifecycle", &stream, &subject).await;
    python(&[
        NATS,
        &stream,
        &format!("{subject}.x"),
        "3",
        "publish",
        "life",
    ]);
    let conn = db.connect().await;
    recorded_exactly(&conn, &ids("life", 3), "through NATS").await;

    let running = life.live();
    // At least: the shutdown signal's watcher, readiness, the two HTTP listeners, NATS and its
    // route's consumer, the records' tail, retention; the drop log's flusher and what closes
    // the sink's queue and the check pool.
    assert!(running.tasks >= 11, "tasks running: {running:?}");
    // At least one sink writer and one check thread.
    assert!(running.threads >= 2, "threads running: {running:?}");

    let _ = stop.send(());
    server
        .await
        .expect("server task")
        .expect("server exits cleanly");
    assert_eq!(
        life.live(),
        Live {
            tasks: 0,
            threads: 0
        },
        "every task and thread ended at shutdown"
    );
}
on_both_stores!(shutdown_ends_every_task_and_thread => shutdown_ends_every_task_and_thread);
