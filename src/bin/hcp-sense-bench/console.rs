//! The console phase: how long each page of the operator console takes to load on a server holding --console-records records, measured as the page loads it: its files, then the JSON calls its script makes, one after another, from a client as small as a browser's (HTTP/1.1, one keep-alive connection).
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::load::{trigger, Load};
use crate::pb::ingest_service_client::IngestServiceClient;
use crate::report::result;
use crate::seed::{now_micros, policy_via_api, records_bulk, BenchDb};
use crate::Options;

/// Triggers delivered before the pages are loaded, half of them dropped: the decision log's.
const DECIDED: usize = 4000;

/// Loads of each page measured (after one unmeasured).
const LOADS: usize = 20;

/// One keep-alive HTTP/1.1 connection to the door.
struct Conn {
    io: BufReader<TcpStream>,
    addr: String,
}

impl Conn {
    async fn open(addr: &str) -> anyhow::Result<Conn> {
        let io = TcpStream::connect(addr).await?;
        io.set_nodelay(true)?;
        Ok(Conn {
            io: BufReader::new(io),
            addr: addr.to_owned(),
        })
    }

    /// One request; answers its status once the whole body is read.
    async fn call(&mut self, method: &str, path: &str, body: Option<&str>) -> anyhow::Result<u16> {
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\n", self.addr);
        if let Some(b) = body {
            head.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            ));
        }
        head.push_str("\r\n");
        head.push_str(body.unwrap_or(""));
        self.io.get_mut().write_all(head.as_bytes()).await?;
        let mut line = String::new();
        self.io.read_line(&mut line).await?;
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("no status line: {line:?}"))?;
        let (mut length, mut chunked) = (0usize, false);
        loop {
            line.clear();
            self.io.read_line(&mut line).await?;
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((n, v)) = l.split_once(':') {
                if n.eq_ignore_ascii_case("content-length") {
                    length = v.trim().parse()?;
                } else if n.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked") {
                    chunked = true;
                }
            }
        }
        if chunked {
            loop {
                line.clear();
                self.io.read_line(&mut line).await?;
                let n = usize::from_str_radix(line.trim(), 16)?;
                let mut chunk = vec![0; n + 2];
                self.io.read_exact(&mut chunk).await?;
                if n == 0 {
                    break;
                }
            }
        } else {
            let mut b = vec![0; length];
            self.io.read_exact(&mut b).await?;
        }
        Ok(status)
    }
}

/// A page: its name and the requests it makes, in order (method, path, body).
type Page = (&'static str, Vec<(&'static str, String, Option<String>)>);

fn pages() -> Vec<Page> {
    let get = |p: &str| ("GET", p.to_owned(), None);
    let mut principal = vec![
        get("/v1/grants?principal=principal-0&page_size=100"),
        get("/v1/activations?principal=principal-0&page_size=100"),
        get("/v1/bindings?principal=principal-0&page_size=100"),
    ];
    let pack = "pack-0";
    principal.push(get(&format!("/v1/packs/{pack}/states/principal-0")));
    principal.push(get(&format!(
        "/v1/triggerTypes?pack_id={pack}&principal=principal-0&page_size=100"
    )));
    let since = "2000-01-01T00:00:00Z";
    vec![
        (
            "shell (HTML, script, style, GetCaller)",
            vec![
                get("/console/"),
                get("/console/console.js"),
                get("/console/console.css"),
                get("/v1/caller"),
            ],
        ),
        (
            "packs and a catalog",
            vec![
                get("/v1/packs?page_size=100"),
                get(&format!("/v1/triggerTypes?pack_id={pack}&page_size=100")),
            ],
        ),
        ("principal", principal),
        (
            "inbox: a principal's recent records",
            vec![get(
                "/v1/records?principal=principal-0&order_by=receive_time%20desc&page_size=20",
            )],
        ),
        (
            "inbox: every principal's recent records",
            vec![get("/v1/records?order_by=receive_time%20desc&page_size=20")],
        ),
        (
            "drops and drops over time",
            vec![
                get("/v1/dropReports?page_size=200"),
                get(&format!(
                    "/v1/decisions?outcome=DECISION_OUTCOME_DROPPED&start_time={since}&page_size=500"
                )),
            ],
        ),
        (
            "decisions of a principal",
            vec![get("/v1/decisions?principal=principal-0&page_size=100")],
        ),
        (
            "explain a trigger",
            vec![(
                "POST",
                "/v1/triggers:explain".to_owned(),
                Some(format!(
                    "{{\"trigger\":{{\"packId\":\"{pack}\",\"ref\":\"issue.opened\",\"principal\":\"principal-0\",\"land\":\"user\",\"payload\":{{}}}}}}"
                )),
            )],
        ),
        ("quotas", vec![get("/v1/quotas?page_size=200")]),
    ]
}

/// The percentile `q` of sorted durations, in milliseconds.
fn pct(sorted: &[Duration], q: f64) -> f64 {
    sorted
        .get(((sorted.len() as f64 * q) as usize).min(sorted.len().saturating_sub(1)))
        .map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0)
}

/// The console's pages on one store holding `n` records.
pub async fn console_phase(o: &Options, kind: &str, n: usize) -> anyhow::Result<()> {
    let pop = o.population(o.principals);
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let door = format!("127.0.0.1:{port}");
    // Records first, on the migrated store, before a server makes its partitions.
    let db = BenchDb::create(kind, &o.postgres_url, "console").await?;
    crate::server::migrate(crate::bin(o), &db.url)?;
    let conn = db.connect().await?;
    let t0 = Instant::now();
    records_bulk(&conn, pop, n, now_micros() - 3_600_000_000).await?;
    let _ = conn.close().await;
    println!(
        "{kind:<9} console: seeded {n} records through the bulk path in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let server = crate::server::Server::start(
        crate::bin(o),
        &db.url,
        &["--http-listen", &door, "--console"],
    )?;
    let chs = server.channels(1).await?;
    policy_via_api(&chs[0], pop).await?;
    // Decisions for the decision log's pages: recorded and dropped triggers.
    let mut ingest = IngestServiceClient::new(chs[0].clone());
    for i in 0..DECIDED {
        let load = if i % 2 == 0 {
            Load::Recorded
        } else {
            Load::Dropped
        };
        ingest.deliver_trigger(trigger(i, pop, load)).await?;
    }
    println!("{kind:<9} console: {DECIDED} triggers delivered (half dropped) for the decision log");
    let mut c = Conn::open(&door).await?;
    for (name, requests) in pages() {
        let mut took = Vec::with_capacity(LOADS);
        for i in 0..=LOADS {
            let start = Instant::now();
            for (method, path, body) in &requests {
                let status = c.call(method, path, body.as_deref()).await?;
                if status != 200 {
                    anyhow::bail!("{method} {path}: {status}");
                }
            }
            if i > 0 {
                took.push(start.elapsed());
            }
        }
        took.sort();
        let (p50, p95, max) = (pct(&took, 0.5), pct(&took, 0.95), pct(&took, 1.0));
        println!(
            "{kind:<9} console page {name:<42} ({} calls) load p50 {p50:>7.2} ms  p95 {p95:>7.2} ms  max {max:>7.2} ms",
            requests.len(),
        );
        result(serde_json::json!({
            "phase": "console", "store": kind, "records": n, "page": name,
            "calls": requests.len(), "p50_ms": p50, "p95_ms": p95, "max_ms": max,
        }));
    }
    server.stop();
    db.drop_db().await;
    println!();
    Ok(())
}
