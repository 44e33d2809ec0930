//! Slow clients on every listener: sockets that drip a byte every two seconds into their headers or body never keep a signed webhook, a health check or a scrape out, and each is closed by its deadline or shed at a cap.
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use hcp_sense::config::Config;
use hmac::{KeyInit, Mac};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tonic::transport::Channel;

use crate::cli::set_up_weather;
use crate::helpers::{spawn_app_with, StoreKind, TestApp};
use crate::transport::health_ok;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
/// Sockets in each attack: past every cap of one listener.
const ATTACKERS: usize = 1100;
/// How often an attacker sends its next byte.
const DRIP: Duration = Duration::from_secs(2);

/// Attacking sockets that each send `head`, then the next byte of `drip` (cycling) every DRIP;
/// `closed` counts those the server has closed.
struct Drip {
    closed: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drip {
    async fn start(addr: SocketAddr, head: &'static [u8], drip: &'static [u8]) -> Drip {
        let mut socks = Vec::with_capacity(ATTACKERS);
        for _ in 0..ATTACKERS {
            let s = tokio::time::timeout(Duration::from_secs(3), TcpStream::connect(addr)).await;
            if let Ok(Ok(mut s)) = s {
                let _ = s.write_all(head).await;
                socks.push(Some(s));
            }
        }
        assert!(
            socks.len() >= ATTACKERS - 10,
            "only {} attacking sockets connected",
            socks.len()
        );
        let closed = Arc::new(AtomicUsize::new(ATTACKERS - socks.len()));
        let counted = closed.clone();
        let task = tokio::spawn(async move {
            let mut buf = [0u8; 512];
            for tick in 0.. {
                let byte = [drip[tick % drip.len()]];
                for slot in socks.iter_mut() {
                    let Some(s) = slot else { continue };
                    // Whatever the server answered (a 408), then its close.
                    let eof = loop {
                        match s.try_read(&mut buf) {
                            Ok(0) => break true,
                            Ok(_) => continue,
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break false,
                            Err(_) => break true,
                        }
                    };
                    if eof || s.try_write(&byte).is_err() {
                        *slot = None;
                        counted.fetch_add(1, Ordering::Relaxed);
                    }
                }
                tokio::time::sleep(DRIP).await;
            }
        });
        Drip { closed, task }
    }

    fn closed(&self) -> usize {
        self.closed.load(Ordering::Relaxed)
    }
}

impl Drop for Drip {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn limits(c: &mut Config) {
    c.ingress_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    c.http_header_timeout = Duration::from_secs(3);
    c.http_body_timeout = Duration::from_secs(3);
    c.first_request_timeout = Duration::from_secs(3);
}

/// A request of `body` to the ingress route `route`, signed as Standard Webhooks with SECRET.
fn signed(route: &str, id: &str, body: &str) -> Vec<u8> {
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let b64 = base64::engine::general_purpose::STANDARD;
    let key = b64
        .decode(SECRET.trim_start_matches("whsec_"))
        .expect("secret");
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&key).expect("key");
    mac.update(format!("{id}.{ts}.{body}").as_bytes());
    let sig = b64.encode(mac.finalize().into_bytes());
    format!(
        "POST /v1/ingress/{route} HTTP/1.1\r\nHost: hcp\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nwebhook-id: {id}\r\nwebhook-timestamp: {ts}\r\n\
         webhook-signature: v1,{sig}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Sends `request` on a new connection; the answer's status and how long it took.
async fn exchange(addr: SocketAddr, request: &[u8]) -> (u16, Duration) {
    let start = Instant::now();
    let answer = tokio::time::timeout(Duration::from_secs(10), async {
        let mut s = TcpStream::connect(addr).await.ok()?;
        s.write_all(request).await.ok()?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.ok()?;
        let text = String::from_utf8_lossy(&out).into_owned();
        text.split(' ').nth(1)?.parse::<u16>().ok()
    })
    .await;
    (answer.ok().flatten().unwrap_or(0), start.elapsed())
}

/// For `secs`, every 400 ms: a signed webhook on a fresh connection, answered 202 within 2 s;
/// throughout, health checks on one channel, their p99 under 50 ms.
async fn real_callers_are_served(app: &TestApp, secs: u64, what: &str) {
    let ingress = app.ingress_addr.expect("ingress listener");
    let ch = Channel::from_shared(format!("http://{}", app.addr))
        .expect("uri")
        .connect()
        .await
        .expect("connect during the attack");
    let until = Instant::now() + Duration::from_secs(secs);
    let checks = tokio::spawn({
        let ch = ch.clone();
        async move {
            let mut took = Vec::new();
            while Instant::now() < until {
                took.push(health_ok(&ch).await);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            took
        }
    });
    let mut n = 0;
    while Instant::now() < until {
        let body = format!(r#"{{"level": "warning", "user": "alice", "n": {n}}}"#);
        let (status, took) =
            exchange(ingress, &signed("alerts", &format!("{what}-{n}"), &body)).await;
        assert_eq!(
            status, 202,
            "{what}: webhook {n} answered {status} after {took:?}"
        );
        assert!(
            took < Duration::from_secs(2),
            "{what}: webhook {n} took {took:?}"
        );
        n += 1;
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let mut took = checks.await.expect("health checks");
    took.sort();
    let p99 = took[took.len() * 99 / 100];
    assert!(
        p99 < Duration::from_millis(50),
        "{what}: health p99 {p99:?} over {} checks",
        took.len()
    );
}

async fn app_with_route() -> TestApp {
    let app = spawn_app_with(StoreKind::Sqlite, limits).await;
    set_up_weather(&app.channel).await;
    let route = crate::ingress::weather_route("alerts", &[SECRET]);
    hcp_sense::grpc::pb::ingress_service_client::IngressServiceClient::new(app.channel.clone())
        .put_ingress_route(route)
        .await
        .expect("put route");
    app
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sockets_dripping_headers_or_a_body_never_keep_a_signed_webhook_or_health_out() {
    let app = app_with_route().await;
    let ingress = app.ingress_addr.expect("ingress listener");
    for (what, head) in [
        (
            "headers",
            &b"POST /v1/ingress/alerts HTTP/1.1\r\nHost: hcp\r\nX-Slow: "[..],
        ),
        (
            "body",
            &b"POST /v1/ingress/alerts HTTP/1.1\r\nHost: hcp\r\nContent-Type: application/json\r\nContent-Length: 10000\r\n\r\n{\"a\": \""[..],
        ),
    ] {
        let started = Instant::now();
        let drip = Drip::start(ingress, head, b"a").await;
        real_callers_are_served(&app, 6, what).await;
        // Each attacker is shed at the cap, or closed by its 3 s deadline however it drips.
        let left = Duration::from_secs(9).saturating_sub(started.elapsed());
        tokio::time::sleep(left).await;
        assert_eq!(drip.closed(), ATTACKERS, "{what}: attackers left open");
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_and_metrics_listeners_hold_against_the_same_attack() {
    let app = app_with_route().await;
    // Half the HTTP/2 preface, then the rest of it a byte every two seconds.
    let drip = Drip::start(app.addr, b"PRI * HTTP/2", b".0\r\n\r\nSM\r\n\r\n").await;
    let scrapes = Drip::start(
        app.metrics_addr,
        b"GET /metrics HTTP/1.1\r\nHost: hcp\r\nX-Slow: ",
        b"a",
    )
    .await;
    let started = Instant::now();
    real_callers_are_served(&app, 5, "grpc").await;
    for _ in 0..5 {
        let (status, took) = exchange(
            app.metrics_addr,
            b"GET /metrics HTTP/1.1\r\nHost: hcp\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert_eq!(status, 200, "a scrape during the attack");
        assert!(took < Duration::from_secs(2), "a scrape took {took:?}");
    }
    tokio::time::sleep(Duration::from_secs(9).saturating_sub(started.elapsed())).await;
    assert_eq!(drip.closed(), ATTACKERS, "gRPC attackers left open");
    assert_eq!(scrapes.closed(), ATTACKERS, "metrics attackers left open");
    app.stop().await;
}

/// A socket from `ip` to `addr` that sends nothing.
async fn from(ip: [u8; 4], addr: SocketAddr) -> TcpStream {
    let s = TcpSocket::new_v4().expect("socket");
    s.bind(SocketAddr::from((ip, 0)))
        .expect("bind a loopback address");
    s.connect(addr).await.expect("connect")
}

/// Whether the server closes `s` within 300 ms (whatever it writes first, as an HTTP/2
/// server's SETTINGS).
async fn is_closed(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 256];
    let deadline = tokio::time::Instant::now() + Duration::from_millis(300);
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_at_its_socket_cap_sheds_its_own_oldest_and_no_other_peers() {
    let app = spawn_app_with(StoreKind::Sqlite, |c| {
        limits(c);
        // Longer than the test: only shedding closes a socket here.
        c.http_header_timeout = Duration::from_secs(30);
        c.first_request_timeout = Duration::from_secs(30);
        c.http_max_connections_per_peer = 4;
        c.max_connections_per_peer = 4;
        // The order of shedding, not the grace a new socket has (tests/it/streams.rs).
        c.shed_grace = Duration::ZERO;
    })
    .await;
    for (listener, addr) in [
        ("ingress", app.ingress_addr.expect("ingress")),
        ("metrics", app.metrics_addr),
        ("grpc", app.addr),
    ] {
        let other = from([127, 0, 0, 2], addr).await;
        let mut four = Vec::new();
        for _ in 0..4 {
            four.push(from([127, 0, 0, 1], addr).await);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut all = vec![other];
        all.extend(four);
        for s in all.iter_mut() {
            assert!(
                !is_closed(s).await,
                "{listener}: n = 4 sockets of one peer stay open"
            );
        }
        // The fifth (n + 1) of 127.0.0.1 sheds that peer's oldest; 127.0.0.2's stays.
        let fifth = from([127, 0, 0, 1], addr).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            is_closed(&mut all[1]).await,
            "{listener}: the oldest of the peer is shed"
        );
        for (i, s) in all.iter_mut().enumerate().skip(2) {
            assert!(
                !is_closed(s).await,
                "{listener}: socket {i} of the peer stays"
            );
        }
        assert!(
            !is_closed(&mut all[0]).await,
            "{listener}: another peer's socket stays"
        );
        drop(fifth);
    }
    let url = format!("http://{}/metrics", app.metrics_addr);
    let text = tokio::task::spawn_blocking(move || crate::helpers::http_get(&url))
        .await
        .expect("scrape");
    // The gRPC listener also holds the test's own channel, which an idle peer socket is too.
    for listener in ["ingress", "metrics", "grpc"] {
        let key =
            format!(r#"hcp_sense_sockets_shed_total{{listener="{listener}",reason="peer_cap"}} "#);
        let shed: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix(&key))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0);
        assert!(shed >= 1, "{key}{shed} in:\n{text}");
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_past_64_kib_is_431_and_a_body_past_the_payload_limit_413() {
    let app = app_with_route().await;
    let ingress = app.ingress_addr.expect("ingress listener");
    let head = |pad: usize| {
        format!(
            "POST /v1/ingress/alerts HTTP/1.1\r\nHost: hcp\r\nX-Pad: {}\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}",
            "p".repeat(pad)
        )
    };
    // Each refusal counts in hcp_sense_ingress_refused_total, whether the route refused it
    // or the listener did before any route saw it.
    let metrics_url = format!("http://{}/metrics", app.metrics_addr);
    let refused = || {
        crate::nats::sample(
            &crate::helpers::http_get(&metrics_url),
            r#"hcp_sense_ingress_refused_total{ingress="http"}"#,
        )
    };
    // Within the head's bound the request reaches the route (unsigned: 401); past it, 431.
    let (status, _) = exchange(ingress, head(60 << 10).as_bytes()).await;
    assert_eq!(status, 401);
    assert_eq!(refused(), 1.0);
    let (status, _) = exchange(ingress, head(hcp_sense::http::MAX_HEAD_BYTES).as_bytes()).await;
    assert_eq!(status, 431);
    let big = 64 << 10 | 1;
    let body = format!(
        "POST /v1/ingress/alerts HTTP/1.1\r\nHost: hcp\r\nContent-Length: {big}\r\nConnection: close\r\n\r\n{}",
        "a".repeat(big)
    );
    let (status, _) = exchange(ingress, body.as_bytes()).await;
    assert_eq!(status, 413);
    // A declared length over the limit is refused at once, without a 100 Continue inviting
    // the body (none is sent here: a 408 would come only after the body timeout).
    let started = Instant::now();
    let (status, _) = exchange(
        ingress,
        b"POST /v1/ingress/alerts HTTP/1.1\r\nHost: hcp\r\nExpect: 100-continue\r\nContent-Length: 999999999\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 413);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // A head that is not HTTP is answered 400 by the listener.
    let (status, _) = exchange(ingress, b"NOT HTTP AT ALL\r\n\r\n").await;
    assert_eq!(status, 400);
    // The 431 and 400 are counted when hyper closes their connections: a moment after.
    let deadline = Instant::now() + Duration::from_secs(5);
    while refused() < 5.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(refused(), 5.0);
    // The metrics listener's own refusals are not the ingress's.
    let (status, _) = exchange(
        app.metrics_addr,
        head(hcp_sense::http::MAX_HEAD_BYTES).as_bytes(),
    )
    .await;
    assert_eq!(status, 431);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(refused(), 5.0);
    app.stop().await;
}
