//! What the benchmark prints: one table row per phase, and every row again as JSON for `--json`.
use std::collections::HashMap;

use serde_json::json;

use crate::load::Phase;

/// Every result row printed, kept for `--json`.
static RESULTS: std::sync::Mutex<Vec<serde_json::Value>> = std::sync::Mutex::new(Vec::new());

/// Keeps a result for `--json`.
pub fn result(v: serde_json::Value) {
    if let Ok(mut r) = RESULTS.lock() {
        r.push(v);
    }
}

/// Every result kept so far.
pub fn results() -> Vec<serde_json::Value> {
    RESULTS.lock().map(|r| r.clone()).unwrap_or_default()
}

/// Prints (and keeps) one phase, with its ratio to `base` when given.
pub fn row(store: &str, name: &str, p: &Phase, base: Option<&Phase>) {
    let ratio = base.map_or(String::from("-"), |b| format!("{:.2}", p.rate() / b.rate()));
    result(json!({
        "store": store,
        "phase": name,
        "calls_per_sec": p.rate(),
        "p50_ms": p.pct(0.50),
        "p99_ms": p.pct(0.99),
        "p999_ms": p.pct(0.999),
        "errors": p.errors,
        "ratio": base.map(|b| p.rate() / b.rate()),
    }));
    println!(
        "{store:<9} {name:<28} {:>10.0} {:>9.3} {:>9.3} {:>9.3} {:>7} {:>7}",
        p.rate(),
        p.pct(0.50),
        p.pct(0.99),
        p.pct(0.999),
        p.errors,
        ratio
    );
}

pub fn header() {
    println!(
        "{:<9} {:<28} {:>10} {:>9} {:>9} {:>9} {:>7} {:>7}",
        "store", "phase", "calls/s", "p50 ms", "p99 ms", "p99.9 ms", "errors", "ratio"
    );
}

/// What the sink did between two scrapes of the server's metrics.
pub struct Writer {
    pub records: f64,
    pub per_batch: f64,
    pub commit_p99_ms: f64,
    pub us_per_record: f64,
}

impl Writer {
    pub fn between(a: &HashMap<String, f64>, b: &HashMap<String, f64>) -> Writer {
        let d = |k: &str| b.get(k).copied().unwrap_or(0.0) - a.get(k).copied().unwrap_or(0.0);
        let records = d("hcp_sense_sink_batch_records_sum");
        let batches = d("hcp_sense_sink_batch_records_count");
        let secs = d("hcp_sense_sink_commit_duration_seconds_sum");
        // The 99th percentile's bucket bound, from the bucket counts' deltas.
        let mut buckets: Vec<(f64, f64)> = b
            .keys()
            .filter_map(|k| {
                let le = k
                    .strip_prefix("hcp_sense_sink_commit_duration_seconds_bucket{le=\"")?
                    .strip_suffix("\"}")?;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((le, d(k)))
            })
            .collect();
        buckets.sort_by(|x, y| x.0.total_cmp(&y.0));
        let total = buckets.last().map_or(0.0, |x| x.1);
        let p99 = buckets
            .iter()
            .find(|(_, n)| *n >= total * 0.99)
            .map_or(f64::NAN, |(le, _)| *le);
        Writer {
            records,
            per_batch: records / batches.max(1.0),
            commit_p99_ms: p99 * 1000.0,
            us_per_record: secs * 1e6 / records.max(1.0),
        }
    }
}

/// The README's Performance tables, rendered from a `--json` file of an earlier run.
pub fn markdown(json: &serde_json::Value) -> String {
    let r = Report::of(json);
    let mut out = r.sweep_table();
    out += &r.limits_table();
    out += &r.cpu_table();
    out += &r.writers_line();
    out
}

/// The results of a run, the stores it measured and the sweep's concurrencies.
struct Report<'a> {
    results: &'a [serde_json::Value],
    stores: Vec<&'static str>,
    concurrency: Vec<i64>,
}

fn num(v: Option<&serde_json::Value>, key: &str) -> Option<f64> {
    v.and_then(|r| r[key].as_f64())
}

/// A rate with a thousands separator; `-` when absent.
fn rate(x: Option<f64>) -> String {
    x.map_or("-".to_owned(), |v| {
        let n = v.round() as i64;
        let (hi, lo) = (n / 1000, n % 1000);
        if hi > 0 {
            format!("{hi},{lo:03}")
        } else {
            lo.to_string()
        }
    })
}

fn fixed(x: Option<f64>, d: usize) -> String {
    x.map_or("-".to_owned(), |v| format!("{v:.d$}"))
}

fn name(store: &str) -> &'static str {
    if store == "sqlite" {
        "SQLite"
    } else {
        "PostgreSQL"
    }
}

/// The CPU groups of a store's table: SQLite's work is the server's own.
fn groups(store: &str) -> &'static [&'static str] {
    if store == "sqlite" {
        &["server", "client"]
    } else {
        &["server", "client", "postgres"]
    }
}

impl<'a> Report<'a> {
    fn of(json: &'a serde_json::Value) -> Report<'a> {
        let results = json["results"].as_array().map_or(&[][..], Vec::as_slice);
        let mut r = Report {
            results,
            stores: Vec::new(),
            concurrency: Vec::new(),
        };
        r.stores = ["sqlite", "postgres"]
            .into_iter()
            .filter(|s| r.find(s, "peak").is_some())
            .collect();
        r.concurrency = results
            .iter()
            .filter(|r| r["phase"] == "sink")
            .filter_map(|r| r["concurrency"].as_i64())
            .collect();
        r.concurrency.sort_unstable();
        r.concurrency.dedup();
        r
    }

    fn find(&self, store: &str, phase: &str) -> Option<&'a serde_json::Value> {
        self.results
            .iter()
            .find(|r| r["store"] == store && r["phase"] == phase)
    }

    /// A store's result of `phase` at concurrency `c`.
    fn at(&self, store: &str, phase: &str, c: i64) -> Option<&'a serde_json::Value> {
        self.results
            .iter()
            .find(|r| r["store"] == store && r["phase"] == phase && r["concurrency"] == c)
    }

    /// No-op and recorded rates, their ratio, p99 and its bound, the writer against the raw
    /// insert, per concurrency.
    fn sweep_table(&self) -> String {
        let mut out = String::from("| callers |");
        let mut rule = String::from("|---|");
        for s in &self.stores {
            out += &format!(
                " {0} no-op/s | {0} recorded/s | ratio | p99 ms (bound) | writer / raw insert: time, CPU |",
                name(s)
            );
            rule += "---|---|---|---|---|";
        }
        out += &format!("\n{rule}\n");
        for c in &self.concurrency {
            out += &format!("| {c} |");
            for s in &self.stores {
                let base = self.find(s, &format!("baseline (no-op), C={c}"));
                let rec = self.find(s, &format!("recorded, C={c}"));
                let sink = self.at(s, "sink", *c);
                out += &format!(
                    " {} | {} | {} | {} ({}) | {}, {} |",
                    rate(num(base, "calls_per_sec")),
                    rate(num(rec, "calls_per_sec")),
                    fixed(num(rec, "ratio"), 2),
                    fixed(num(rec, "p99_ms"), 1),
                    fixed(num(sink, "p99_bound_ms"), 1),
                    fixed(num(sink, "writer_over_raw_insert"), 2),
                    fixed(num(sink, "writer_cpu_over_raw_insert"), 2),
                );
            }
            out += "\n";
        }
        out
    }

    /// The raw insert, the peak ratio and DeliverTriggers against the raw insert, per store.
    fn limits_table(&self) -> String {
        let mut out = String::from("\n| store | raw insert rows/s | peak recorded / peak no-op | DeliverTriggers/s | over raw insert |\n|---|---|---|---|---|\n");
        for s in &self.stores {
            let streamed = self.results.iter().find(|r| {
                r["store"] == *s
                    && r["phase"]
                        .as_str()
                        .is_some_and(|p| p.starts_with("DeliverTriggers"))
            });
            out += &format!(
                "| {} | {} | {} | {} | {} |\n",
                name(s),
                rate(num(self.find(s, "store limit"), "rows_per_sec")),
                fixed(num(self.find(s, "peak"), "ratio"), 2),
                rate(num(streamed, "calls_per_sec")),
                fixed(num(self.find(s, "stream over store limit"), "ratio"), 2),
            );
        }
        out
    }

    /// CPU per call, no-op against recorded, per concurrency and store.
    fn cpu_table(&self) -> String {
        let mut out = String::from("\nCPU µs per call, no-op → recorded (server, benchmark client, PostgreSQL's processes):\n\n| callers |");
        let mut rule = String::from("|---|");
        for s in &self.stores {
            for g in groups(s) {
                out += &format!(" {} {g} |", name(s));
                rule += "---|";
            }
        }
        out += &format!("\n{rule}\n");
        for c in &self.concurrency {
            out += &format!("| {c} |");
            for s in &self.stores {
                let cpu = self.at(s, "cpu", *c);
                for group in groups(s) {
                    let at = |k: &str| cpu.and_then(|r| r[k][group].as_f64());
                    out += &format!(
                        " {} → {} |",
                        fixed(at("noop_us_per_call"), 0),
                        fixed(at("recorded_us_per_call"), 0)
                    );
                }
            }
            out += "\n";
        }
        out
    }

    /// Recorded rates by sink writer count behind a delaying proxy, when measured.
    fn writers_line(&self) -> String {
        let Some(w) = self
            .results
            .iter()
            .find(|r| r["phase"] == "writers compare")
        else {
            return String::new();
        };
        let rates: Vec<String> = w["rates"]
            .as_array()
            .map_or(&[][..], Vec::as_slice)
            .iter()
            .map(|r| format!("{} writer(s) {}/s", r[0], rate(r[1].as_f64())))
            .collect();
        format!(
            "\nPostgreSQL behind {} ms per round trip, {} callers: {}\n",
            w["delay_ms"],
            w["concurrency"],
            rates.join(", ")
        )
    }
}
