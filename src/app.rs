//! Wiring: `App::build` opens the store and binds the listener; `run_until` serves until shutdown.
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::service::Routes;
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
use tonic_health::server::HealthReporter;

use crate::config::Config;
use std::sync::Arc;

use crate::auth::Authenticator;
use crate::grpc::calls::{CallLayer, HealthWatchLimits};
use crate::grpc::conn::{self, effective_max_connections, ConnLimits};
use crate::grpc::guard::GuardLayer;
use crate::grpc::ingest::IngestApi;
use crate::grpc::layer::RpcLayer;
use crate::grpc::packs::PacksApi;
use crate::grpc::paging::PageTokens;
use crate::grpc::pb::{
    self, audit_service_server::AuditServiceServer, bench_service_server::BenchServiceServer,
    decision_service_server::DecisionServiceServer, ingest_service_server::IngestServiceServer,
    ingress_service_server::IngressServiceServer, pack_service_server::PackServiceServer,
    policy_service_server::PolicyServiceServer, record_service_server::RecordServiceServer,
};
use crate::grpc::policy::PolicyApi;
use crate::grpc::records::RecordsApi;
use crate::grpc::routes::IngressApi;
use crate::ingress::Ingress;
use crate::lifecycle::{EndOnDrop, Signal};
use crate::metrics::Metrics;
use crate::service::{Hub, Limits, Policy};
use crate::store::Store;

/// A service with its store open and its port bound, ready to serve.
pub struct App {
    listener: TcpListener,
    addr: SocketAddr,
    metrics_listener: TcpListener,
    metrics_addr: SocketAddr,
    /// The HTTP ingress listener, when one is configured.
    ingress_listener: Option<TcpListener>,
    /// The MCP door's listener, when one is configured.
    mcp_listener: Option<TcpListener>,
    /// The MCP door's caps on live subscriptions.
    mcp_caps: crate::mcp::SubscriptionCaps,
    mcp_sessions: crate::mcp::serve::SessionLimits,
    /// TLS of the door's listener: beside a TLS API, with its certificate.
    mcp_tls: Option<tokio_rustls::TlsAcceptor>,
    /// The JSON door's listener, and how it is served.
    web_listener: Option<TcpListener>,
    web: (bool, crate::mcp::SubscriptionCaps),
    /// The NATS server NATS routes consume from, when one is configured.
    nats_url: Option<String>,
    /// How long a socket of the HTTP listeners may move no byte before it is closed.
    /// The HTTP listeners' limits; the ingress listener's body is a trigger's payload.
    http: crate::http::HttpLimits,
    hub: Hub,
    /// Ingress routes and the messages they take, delivered through the hub's delivery.
    ingress: Ingress,
    shutdown_grace: Duration,
    bench_baseline: bool,
    auth: Arc<Authenticator>,
    limits: ServerLimits,
    tls: Option<ServerTlsConfig>,
    pages: PageTokens,
    /// Built and never run (or its run cancelled), the service still has every task and
    /// thread end.
    end_on_drop: EndOnDrop,
}

/// Transport limits of the gRPC server.
#[derive(Debug, Clone, Copy)]
struct ServerLimits {
    rate_per_sec: f64,
    auth_failures_per_sec: f64,
    max_request_bytes: usize,
    max_concurrent_streams: u32,
    request_timeout: Duration,
    conns: ConnLimits,
    keepalive_interval: Option<Duration>,
    keepalive_timeout: Duration,
    watches: HealthWatchLimits,
    streams: crate::grpc::streams::StreamCaps,
}

impl App {
    /// Connects the store, applies migrations unless disabled, and binds the listener.
    pub async fn build(config: Config) -> anyhow::Result<App> {
        crate::grpc::codec::install();
        let store = connect_waiting(&config.database, config.db_startup_wait).await?;
        store.warm();
        schema_ready(&store, config.migrate).await?;
        // Partitions for now and ahead before the first write (retention's passes keep them
        // coming; a write that finds none has its own made).
        if let Err(e) = store.make_partitions_ahead().await {
            tracing::warn!(error = %e, "records partitions not made ahead at start");
        }
        let pages = PageTokens::new(config.page_token_secret());
        let mut auth = Authenticator::from_config(&config.auth)?;
        let tls_files = config.tls.files()?;
        if tls_files.is_some() && config.tls.client_ca_file.is_some() {
            auth =
                auth.with_client_certificates(config.tls.client_role, config.tls.client_identity);
        }
        let auth = Arc::new(auth);
        // The MCP door speaks TLS beside a TLS API, with the same certificate.
        let mcp_tls = match (config.mcp_listen.or(config.http_listen), &tls_files) {
            (Some(_), Some((cert, key))) => Some(crate::http::tls_acceptor(cert, key)?),
            _ => None,
        };
        let tls = match tls_files {
            None => None,
            Some((cert, key)) => Some(tls_config(&config, cert, key)?),
        };
        if !auth.is_enabled() {
            if !config.listen.ip().is_loopback() && !config.insecure_no_auth {
                anyhow::bail!(
                    "refusing to serve {} without authentication: configure [auth] in the config file, or pass --insecure-no-auth",
                    config.listen
                );
            }
            tracing::warn!(listen = %config.listen, "authentication is not configured: every caller may call every RPC");
        }
        let listener = bind(config.listen).await?;
        let addr = listener.local_addr()?;
        let metrics_listener = bind(config.metrics_listen).await?;
        let metrics_addr = metrics_listener.local_addr()?;
        let ingress_listener = match config.ingress_listen {
            Some(a) => Some(bind(a).await?),
            None => None,
        };
        // Without authentication a door is every role's (every principal's records, every
        // change): loopback only.
        let open = !auth.is_enabled() && !config.insecure_no_auth;
        let web_listener = door_listener(config.http_listen, "the JSON door", open).await?;
        let mcp_listener = door_listener(config.mcp_listen, "the MCP door", open).await?;
        let metrics = Arc::new(Metrics::new(config.metrics_max_packs));
        let hub = Hub::start(store.clone(), service_limits(&config), metrics).await?;
        let end_on_drop = hub.lifecycle().ends_on_drop();
        let ingress = Ingress::new(
            store.ingress_tables(),
            hub.delivery.clone(),
            config.retention(),
        );
        Ok(App {
            listener,
            addr,
            metrics_listener,
            metrics_addr,
            ingress_listener,
            mcp_listener,
            mcp_caps: crate::mcp::SubscriptionCaps {
                total: config.mcp_max_subscriptions,
                per_caller: config.mcp_max_subscriptions_per_caller,
            },
            mcp_sessions: crate::mcp::serve::SessionLimits {
                total: config.mcp_max_sessions,
                per_caller: config.mcp_max_sessions_per_caller,
                idle: config.mcp_session_idle_timeout,
            },
            mcp_tls,
            web_listener,
            web: (
                config.console,
                crate::mcp::SubscriptionCaps {
                    total: config.http_max_streams,
                    per_caller: config.http_max_streams_per_caller,
                },
            ),
            nats_url: config.nats_url.clone(),
            http: http_limits(&config),
            hub,
            ingress,
            shutdown_grace: config.shutdown_grace,
            bench_baseline: config.bench_baseline,
            auth,
            tls,
            limits: server_limits(&config),
            pages,
            end_on_drop,
        })
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address of /metrics, /healthz and /readyz.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics_addr
    }

    /// The HTTP ingress listener's address, when one is configured.
    pub fn ingress_addr(&self) -> Option<SocketAddr> {
        self.ingress_listener
            .as_ref()
            .and_then(|l| l.local_addr().ok())
    }

    /// The MCP door's address, when one is configured.
    pub fn mcp_addr(&self) -> Option<SocketAddr> {
        self.mcp_listener.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The JSON door's address, when it is served.
    pub fn web_addr(&self) -> Option<SocketAddr> {
        self.web_listener.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The service's capabilities, as started.
    pub fn hub(&self) -> &Hub {
        &self.hub
    }

    /// Serves until `shutdown` completes, then shuts down in the lifecycle's order
    /// (`crate::lifecycle`): stops taking (gRPC, HTTP, NATS), answers what was taken within
    /// the grace period, flushes the sink and the drop log, and closes the store. The edges'
    /// tasks are started here, through the hub's lifecycle, as the gRPC server starts.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let _bindings = bindings_gauge(self.hub.policy.clone());
        let (health, health_service) = tonic_health::server::health_reporter();
        health
            .set_service_status(LIVENESS, tonic_health::ServingStatus::Serving)
            .await;
        let routes = self.grpc_routes()?.add_service(health_service);
        let life = self.hub.lifecycle().clone();
        let ready_rx = self.start_following(&health).await;
        let stopping = life.stopping();
        life.spawn({
            let (life, stopping) = (life.clone(), stopping.clone());
            async move {
                tokio::select! {
                    () = shutdown => life.begin_stop(),
                    // Stopped otherwise (the server failed): nothing left to watch for.
                    () = stopping.wait() => {}
                }
            }
        });
        let ingress_addr = self.ingress_addr();
        let App {
            listener,
            addr,
            metrics_listener,
            metrics_addr,
            ingress_listener,
            mcp_listener,
            mcp_caps,
            mcp_sessions,
            mcp_tls,
            web_listener,
            web: (console, web_streams),
            bench_baseline,
            nats_url,
            http,
            hub,
            ingress,
            shutdown_grace,
            auth,
            limits: l,
            tls,
            end_on_drop: _ends,
            ..
        } = self;
        spawn_probes(&hub, http, metrics_listener, ready_rx);
        spawn_ingress(&hub, &ingress, http, ingress_listener, nats_url);
        let metrics = hub.metrics.clone();
        // One set of layers for the listener and the MCP door's in-process calls: the same
        // authentication, roles, rate limits, stream caps and deadlines.
        let calls = CallLayer::new(l.watches, l.request_timeout);
        let rpc = RpcLayer::new(metrics.clone());
        let guard = GuardLayer::new(
            auth.clone(),
            l.rate_per_sec,
            l.auth_failures_per_sec,
            metrics.clone(),
            crate::grpc::streams::Streams::new(l.streams),
        );
        // The doors' calls, in process through those same layers.
        let api = crate::mcp::call::in_process(
            tower::ServiceBuilder::new()
                .layer(calls.clone())
                .layer(rpc.clone())
                .layer(guard.clone())
                .service(routes.clone()),
        );
        if let Some(listener) = web_listener {
            let life = hub.lifecycle();
            let door = crate::web::Door::new(
                api.clone(),
                auth.clone(),
                crate::web::Options {
                    console,
                    bench: bench_baseline,
                    idle: http.idle,
                    streams: web_streams,
                },
                life.stopping(),
            )?;
            life.spawn(crate::http::serve(
                "http",
                listener,
                door.routes(),
                // The door's bodies carry the API's requests: the API's own bound.
                crate::http::HttpLimits {
                    max_body_bytes: l.max_request_bytes,
                    ..http
                },
                hub.metrics.clone(),
                life.clone(),
                mcp_tls.clone(),
            ));
        }
        if let Some(door) = mcp_listener {
            spawn_mcp(
                &hub,
                &auth,
                http,
                door,
                api,
                l.max_request_bytes,
                (mcp_caps, mcp_sessions, mcp_tls),
            )?;
        }
        let mut builder = Server::builder();
        if let Some(tls) = tls {
            builder = builder.tls_config(tls)?;
        }
        let windows = crate::grpc::flow::Windows::for_streams(l.max_concurrent_streams);
        let serve = builder
            .max_concurrent_streams(l.max_concurrent_streams)
            // Chosen with h2's DATA-frame budget (grpc/flow.rs); a fixed window, so the
            // budget that follows from it stays put.
            .initial_stream_window_size(windows.stream)
            .initial_connection_window_size(windows.connection)
            .http2_adaptive_window(Some(false))
            // A backstop: CallLayer answers UNAVAILABLE before this fires.
            .timeout(l.request_timeout)
            .http2_keepalive_interval(l.keepalive_interval)
            .http2_keepalive_timeout(Some(l.keepalive_timeout))
            .layer(calls)
            .layer(rpc)
            .layer(guard)
            .add_routes(routes)
            .serve_with_incoming_shutdown(
                conn::incoming(listener, l.conns, metrics),
                stopped_taking(stopping.clone(), health),
            );
        match ingress_addr {
            Some(ingress_addr) => {
                tracing::info!(addr = %addr, %metrics_addr, %ingress_addr, "hcp-sense listening")
            }
            None => tracing::info!(addr = %addr, %metrics_addr, "hcp-sense listening"),
        }
        // What was taken is answered: the gRPC calls in flight, and the lifecycle's tasks (the
        // HTTP requests, NATS messages and the work they started), alongside, in the grace.
        let answered = async {
            let served = serve.await;
            life.answered().await;
            served
        };
        let (result, deadline) = within_grace(answered, stopping, shutdown_grace).await;
        // An unreachable store must not keep the process from exiting.
        hub.close(deadline.min(tokio::time::Instant::now() + FINAL_WRITES))
            .await;
        tracing::info!("stopped");
        result
    }

    /// The API's gRPC services and reflection, each refusing a request over the size limit.
    fn grpc_routes(&self) -> anyhow::Result<Routes> {
        let max = self.limits.max_request_bytes;
        let (hub, pages) = (&self.hub, &self.pages);
        let bench = self.bench_baseline;
        // Each version describes the other's service too, as both are listed.
        let mut routes = Routes::new(
            reflection(bench)
                .register_encoded_file_descriptor_set(
                    tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
                )
                .build_v1()?,
        )
        .add_service(
            reflection(bench)
                .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
                .build_v1alpha()?,
        )
        .add_service(
            PackServiceServer::new(PacksApi {
                policy: hub.policy.clone(),
                pages: pages.clone(),
            })
            .max_decoding_message_size(max),
        )
        .add_service(
            IngressServiceServer::new(IngressApi {
                ingress: self.ingress.clone(),
                pages: pages.clone(),
            })
            .max_decoding_message_size(max),
        )
        .add_service(
            PolicyServiceServer::new(PolicyApi {
                policy: hub.policy.clone(),
                pages: pages.clone(),
            })
            .max_decoding_message_size(max),
        )
        .add_service(
            IngestServiceServer::new(IngestApi::new(
                hub.delivery.clone(),
                self.limits.conns.idle_timeout,
                hub.lifecycle().stopping(),
            ))
            .max_decoding_message_size(max),
        )
        .add_service(
            RecordServiceServer::new(RecordsApi {
                records: hub.records.clone(),
                pages: pages.clone(),
            })
            .max_decoding_message_size(max),
        )
        .add_service(
            DecisionServiceServer::new(crate::grpc::decisions::DecisionsApi {
                decisions: hub.decisions.clone(),
                pages: pages.clone(),
            })
            .max_decoding_message_size(max),
        )
        .add_service(
            pb::caller_service_server::CallerServiceServer::new(crate::grpc::caller::CallerApi)
                .max_decoding_message_size(max),
        )
        .add_service(
            AuditServiceServer::new(crate::grpc::audit::AuditApi {
                policy: hub.policy.clone(),
                pages: pages.clone(),
            })
            .max_decoding_message_size(max),
        );
        if self.bench_baseline {
            routes = routes.add_service(BenchServiceServer::new(crate::grpc::bench::Baseline));
        }
        Ok(routes)
    }

    /// Starts following other replicas' policy changes and the records' tail, waits (a
    /// while) for the first, and reports readiness from then on; the receiver reads it.
    async fn start_following(&self, health: &HealthReporter) -> watch::Receiver<bool> {
        // Serve once the listener has subscribed and reloaded (PostgreSQL), so a fresh replica
        // is not unready for its first calls; if that takes long, serve NOT_SERVING meanwhile.
        let mut current = self.hub.policy.watch_current();
        let _ = tokio::time::timeout(STARTUP_LISTEN_WAIT, current.wait_for(|c| *c)).await;
        let ready_now = self.hub.ready().await;
        let (ready_tx, ready_rx) = watch::channel(ready_now);
        set_serving(health, ready_now).await;
        let life = self.hub.lifecycle();
        life.spawn(follow_readiness(
            self.hub.clone(),
            health.clone(),
            ready_tx,
            life.stopping(),
        ));
        ready_rx
    }
}

/// Binding health for OTLP metrics (a no-op without a meter provider), kept while the
/// returned gauge lives.
fn bindings_gauge(policy: Policy) -> opentelemetry::metrics::ObservableGauge<i64> {
    opentelemetry::global::meter("hcp-sense")
        .i64_observable_gauge("hcp_sense.bindings")
        .with_callback(move |g| {
            for (state, n) in policy.binding_states() {
                g.observe(n, &[opentelemetry::KeyValue::new("state", state)]);
            }
        })
        .build()
}

/// Serves /metrics and the probes until stopping, a task of the hub's lifecycle.
fn spawn_probes(
    hub: &Hub,
    http: crate::http::HttpLimits,
    metrics_listener: TcpListener,
    ready_rx: watch::Receiver<bool>,
) {
    hub.lifecycle().spawn(crate::http::serve(
        "metrics",
        metrics_listener,
        http_routes(hub, ready_rx),
        crate::http::HttpLimits {
            // Scrapes and probes carry no body.
            max_body_bytes: 64 << 10,
            ..http
        },
        hub.metrics.clone(),
        hub.lifecycle().clone(),
        None,
    ));
}

/// Serves the HTTP ingress when it has a listener, and consumes NATS when configured, each
/// a task of the hub's lifecycle until stopping.
fn spawn_ingress(
    hub: &Hub,
    ingress: &Ingress,
    http: crate::http::HttpLimits,
    ingress_listener: Option<TcpListener>,
    nats_url: Option<String>,
) {
    let life = hub.lifecycle();
    if let Some(l) = ingress_listener {
        life.spawn(crate::http::serve(
            "ingress",
            l,
            crate::ingress::http::routes(ingress.clone(), hub.delivery.max_payload_bytes()),
            http,
            hub.metrics.clone(),
            life.clone(),
            None,
        ));
    }
    if let Some(url) = nats_url {
        life.spawn(crate::ingress::nats::run(ingress.clone(), url));
    }
}

/// Serves the MCP door on `listener`: its calls go to `api`, this server's own services.
fn spawn_mcp(
    hub: &Hub,
    auth: &Arc<Authenticator>,
    http: crate::http::HttpLimits,
    listener: TcpListener,
    api: crate::mcp::call::Api,
    max_body_bytes: usize,
    (caps, sessions, tls): (
        crate::mcp::SubscriptionCaps,
        crate::mcp::serve::SessionLimits,
        Option<tokio_rustls::TlsAcceptor>,
    ),
) -> anyhow::Result<()> {
    let door = crate::mcp::Door::new(api, None, caps)?.with_session_ping(sessions.idle / 3);
    let life = hub.lifecycle();
    let routes = crate::mcp::serve::routes(
        door,
        auth.clone(),
        max_body_bytes,
        sessions,
        &life.stopping(),
    );
    life.spawn(crate::http::serve(
        "mcp",
        listener,
        routes,
        // The door's bodies are JSON-RPC messages carrying the API's requests: the API's
        // own bound, not the ingress payload's.
        crate::http::HttpLimits {
            max_body_bytes,
            ..http
        },
        hub.metrics.clone(),
        life.clone(),
        tls,
    ));
    Ok(())
}

/// Completes when stopping begins, after reporting NOT_SERVING: the gRPC server then stops
/// accepting.
async fn stopped_taking(stopping: Signal, health: HealthReporter) {
    stopping.wait().await;
    tracing::info!("shutting down: no new calls accepted");
    set_serving(&health, false).await;
    health
        .set_service_status(LIVENESS, tonic_health::ServingStatus::NotServing)
        .await;
}

/// Runs `serve` to its end, or until the grace period after shutdown began is over but its
/// last EXIT_RESERVE, which is for the last drop counts and closing the store, so that the
/// process is gone within the grace period. Returns the server's result and when the grace
/// period ends.
async fn within_grace(
    serve: impl Future<Output = Result<(), tonic::transport::Error>>,
    stopping: Signal,
    grace: Duration,
) -> (anyhow::Result<()>, tokio::time::Instant) {
    let reserve = EXIT_RESERVE.min(grace / 2);
    let mut deadline = None;
    let result = tokio::select! {
        r = serve => r.map_err(anyhow::Error::from),
        _ = async {
            stopping.wait().await;
            deadline = Some(tokio::time::Instant::now() + grace);
            tokio::time::sleep(grace - reserve).await;
        } => {
            tracing::warn!(grace_secs = grace.as_secs_f64(), "grace period over; closing calls still in flight");
            Ok(())
        }
    };
    let deadline = deadline.unwrap_or_else(|| tokio::time::Instant::now() + grace);
    (result, deadline)
}

/// Readiness: SERVING while the store answers and the policy view is current. A lost policy
/// listener is reported at once; otherwise readiness is asked every READINESS_PROBE. Ends at
/// shutdown, which has its own say (NOT_SERVING).
async fn follow_readiness(
    hub: Hub,
    health: tonic_health::server::HealthReporter,
    ready_tx: watch::Sender<bool>,
    stopping: Signal,
) {
    let mut current = hub.policy.watch_current();
    let mut serving = None;
    let mut tick = tokio::time::interval(READINESS_PROBE);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            changed = current.changed() => {
                if changed.is_err() {
                    return;
                }
                current.borrow_and_update();
            }
            _ = tick.tick() => {}
            () = stopping.wait() => return,
        }
        let now = hub.ready().await;
        if stopping.is_given() {
            return;
        }
        if serving != Some(now) {
            if serving.is_some() {
                if now {
                    tracing::info!("ready: store answers and policy is current");
                } else {
                    tracing::warn!("not ready: store unreachable or policy not current");
                }
            }
            serving = Some(now);
            let _ = ready_tx.send(now);
            set_serving(&health, now).await;
        }
    }
}

/// An HTTP listener (metrics and health, or ingress), until shutdown; its sockets are capped
/// and closed when idle (`crate::http`).
/// Opens the store, retrying while it is unreachable (a replica may start while its database
/// restarts) for up to `wait`; any other error ends at once.
async fn connect_waiting(
    database: &crate::config::StoreConfig,
    wait: Duration,
) -> anyhow::Result<Store> {
    use backon::{ConstantBuilder, Retryable};
    let deadline = tokio::time::Instant::now() + wait;
    let connect = || Store::connect(database);
    let store = connect
        .retry(
            ConstantBuilder::new()
                .with_delay(Duration::from_secs(1))
                .without_max_times(),
        )
        .when(|e| {
            matches!(e, crate::error::Error::Unavailable(_))
                && tokio::time::Instant::now() < deadline
        })
        .notify(|e, _| tracing::warn!(error = %e, "the store is unreachable; retrying"))
        .await?;
    Ok(store)
}

/// /metrics (Prometheus text), /healthz (the process answers) and /readyz (the store answers
/// and the policy view is current).
fn http_routes(hub: &Hub, ready: watch::Receiver<bool>) -> axum::Router {
    use axum::http::{header, StatusCode};
    use axum::routing::get;
    let (metrics, policy) = (hub.metrics.clone(), hub.policy.clone());
    let scrape = {
        let policy = policy.clone();
        move |headers: axum::http::HeaderMap| {
            let (metrics, policy) = (metrics.clone(), policy.clone());
            async move {
                metrics.set_bindings(&policy.binding_states());
                let openmetrics = headers
                    .get(header::ACCEPT)
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|v| v.contains("application/openmetrics-text"));
                if openmetrics {
                    (
                        [(
                            header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        metrics.encode(),
                    )
                } else {
                    (
                        [(
                            header::CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8",
                        )],
                        metrics.encode_text(),
                    )
                }
            }
        }
    };
    // The last readiness probe's answer, and a lost policy listener at once: a probe that
    // hangs on an unreachable store would itself time out.
    let ready = move || {
        let ok = *ready.borrow() && policy.current();
        async move {
            if ok {
                (StatusCode::OK, "ready\n")
            } else {
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "not ready: store unreachable or policy not current\n",
                )
            }
        }
    };
    axum::Router::new()
        .route("/metrics", get(scrape))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
}

/// The health entry that stays SERVING while the process runs (a liveness probe's target);
/// the others follow readiness.
pub const LIVENESS: &str = "liveness";

/// The end of the grace period kept for writing the last drop counts and closing the store.
const EXIT_RESERVE: Duration = Duration::from_millis(300);
/// Longest the last drop counts and closing the store may take at shutdown.
const FINAL_WRITES: Duration = Duration::from_secs(2);

/// How long serving waits at start for the policy listener's first reload.
const STARTUP_LISTEN_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// How often readiness asks the store whether it answers.
const READINESS_PROBE: std::time::Duration = std::time::Duration::from_millis(500);

/// Every service whose health follows readiness; "" is the server as a whole.
pub const SERVICES: [&str; 7] = [
    "hcp.sense.v1.AuditService",
    "",
    "hcp.sense.v1.DecisionService",
    "hcp.sense.v1.PackService",
    "hcp.sense.v1.PolicyService",
    "hcp.sense.v1.IngestService",
    "hcp.sense.v1.RecordService",
];

/// The services reflection lists: those always served.
const LISTED: [&str; 10] = [
    "hcp.sense.v1.AuditService",
    "hcp.sense.v1.DecisionService",
    "hcp.sense.v1.IngestService",
    "hcp.sense.v1.IngressService",
    "hcp.sense.v1.PackService",
    "hcp.sense.v1.PolicyService",
    "hcp.sense.v1.RecordService",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
];

/// Reflection over the services served (the benchmark baseline only when it is), and over
/// google.rpc error details so that clients such as grpcurl can decode them.
fn reflection(bench: bool) -> tonic_reflection::server::Builder<'static> {
    let mut b = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET);
    for name in LISTED {
        b = b.with_service_name(name);
    }
    if bench {
        b = b.with_service_name("hcp.sense.v1.BenchService");
    }
    b
}

async fn set_serving(health: &HealthReporter, serving: bool) {
    use tonic_health::ServingStatus;
    let status = if serving {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    for service in SERVICES {
        health.set_service_status(service, status).await;
    }
}

/// Completes on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => tracing::info!("SIGINT received"),
        _ = term => tracing::info!("SIGTERM received"),
    }
}

/// Applies migrations when `migrate`; otherwise refuses a database that lacks one of this
/// release's (a newer release's extra migrations are additive and fine).
async fn schema_ready(store: &Store, migrate: bool) -> anyhow::Result<()> {
    if migrate {
        store.migrate_up().await?;
        let moved = store.adopt_copied_positions().await?;
        if moved > 0 {
            tracing::warn!(
                records = moved,
                "records carried transaction ids of another PostgreSQL cluster; they now list ahead of every record written here"
            );
        }
        return Ok(());
    }
    let status = store.migration_status().await?;
    let newer: Vec<_> = status
        .iter()
        .filter(|m| !m.known)
        .map(|m| &m.name)
        .collect();
    if !newer.is_empty() {
        // Additive: a previous release serves on a newer schema during a rollout.
        tracing::info!(newer = ?newer, "the database has migrations of a newer release");
    }
    let pending: Vec<_> = status
        .iter()
        .filter(|m| !m.applied)
        .map(|m| m.name.as_str())
        .collect();
    if !pending.is_empty() {
        anyhow::bail!(
            "the database lacks migrations {}: run `hcp-sense migrate up` or start with --migrate true",
            pending.join(", ")
        );
    }
    Ok(())
}

/// The gRPC listener's TLS: the server's certificate and key, and client certificates as one
/// optional way in when a client CA is configured.
fn tls_config(
    config: &Config,
    cert_file: &std::path::Path,
    key_file: &std::path::Path,
) -> anyhow::Result<ServerTlsConfig> {
    let read = |p: &std::path::Path| {
        std::fs::read(p).map_err(|e| anyhow::anyhow!("reading {}: {e}", p.display()))
    };
    let mut c = ServerTlsConfig::new()
        .identity(Identity::from_pem(read(cert_file)?, read(key_file)?))
        .timeout(config.first_request_timeout);
    if let Some(ca) = &config.tls.client_ca_file {
        // Certificates are one way in; callers without one may still send a token.
        c = c
            .client_ca_root(Certificate::from_pem(read(ca)?))
            .client_auth_optional(true);
    }
    Ok(c)
}

/// A door's listener on `addr`, if one is asked for; refused off loopback when the door would
/// be `open` (no authentication, and no --insecure-no-auth).
async fn door_listener(
    addr: Option<SocketAddr>,
    door: &str,
    open: bool,
) -> anyhow::Result<Option<TcpListener>> {
    match addr {
        Some(a) if open && !a.ip().is_loopback() => anyhow::bail!(
            "refusing to serve {door} on {a} without authentication: configure [auth] in the config file, or pass --insecure-no-auth"
        ),
        Some(a) => Ok(Some(bind(a).await?)),
        None => Ok(None),
    }
}

async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("binding {addr}: {e}"))
}

fn http_limits(config: &Config) -> crate::http::HttpLimits {
    crate::http::HttpLimits {
        caps: crate::sockets::Caps {
            total: crate::http::MAX_CONNECTIONS,
            per_peer: config.http_max_connections_per_peer,
            grace: std::time::Duration::ZERO,
        },
        idle: config.http_idle_timeout,
        header_timeout: config.http_header_timeout,
        body_timeout: config.http_body_timeout,
        max_body_bytes: config.max_payload_bytes,
    }
}

fn service_limits(config: &Config) -> Limits {
    Limits {
        max_payload_bytes: config.max_payload_bytes,
        retention: config.retention(),
        prune_every: config.prune_interval,
        log_flush_every: config.log_flush_interval,
        hash_principals: config.hash_principals,
        max_json_depth: config.max_json_depth,
        // A batch past the call's own deadline can no longer answer anyone.
        batch_timeout: config.request_timeout,
        sink_writers: config.sink_writers,
        sink_commit_delay: config.sink_commit_delay,
        checks: crate::service::checks::CheckLimits {
            threads: config.check_threads,
            queue: config.check_queue,
            deadline: crate::service::checks::CheckLimits::deadline_for(config.request_timeout),
        },
        watch: crate::service::WatchLimits {
            max_behind: config.watch_max_behind,
            max_lag: config.watch_max_lag,
            progress_every: config.watch_progress,
            max_watchers: config.max_watches,
        },
        decision_log: config.decision_log,
        decision_bounds: crate::service::retention::DecisionBounds {
            age: (!config.decision_retention.is_zero()).then_some(config.decision_retention),
            max_entries: (config.decision_max_entries > 0).then_some(config.decision_max_entries),
        },
        decision_fold: crate::domain::decision_log::FoldRule {
            per_key: config.decision_fold_per_key,
            in_all: config.decision_fold_in_all,
            ..Default::default()
        },
    }
}

fn server_limits(config: &Config) -> ServerLimits {
    ServerLimits {
        rate_per_sec: config.rate_limit_per_sec,
        auth_failures_per_sec: config.auth_failure_rate_per_sec,
        max_request_bytes: config.max_request_bytes,
        max_concurrent_streams: config.max_concurrent_streams,
        request_timeout: config.request_timeout,
        conns: ConnLimits {
            max_connections: effective_max_connections(config.max_connections),
            max_per_peer: config.max_connections_per_peer,
            first_request_timeout: config.first_request_timeout,
            idle_timeout: config.idle_timeout,
            shed_grace: config.shed_grace,
        },
        keepalive_interval: config.http2_keepalive_interval,
        keepalive_timeout: config.http2_keepalive_timeout,
        watches: HealthWatchLimits {
            per_connection: config.max_health_watches_per_connection,
            total: config.max_health_watches,
        },
        streams: crate::grpc::streams::StreamCaps {
            total: config.max_streams,
            per_peer: config.max_streams_per_peer,
            reflection: config.max_reflection_streams,
            reflection_per_peer: config.max_reflection_streams_per_peer,
        },
    }
}
