//! Metrics: the counters and histograms of the service, exposed as Prometheus text on /metrics.
use std::collections::HashSet;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use opentelemetry::KeyValue;

use crate::domain::trigger::{DropReason, Outcome};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeliveryLabels {
    disposition: &'static str,
    drop_reason: &'static str,
    pack: String,
    ingress: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabels {
    method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PackLabels {
    pack: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct IngressLabels {
    ingress: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShedLabels {
    listener: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabels {
    cause: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BudgetLabels {
    budget: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
}

/// The same measurements as OTel instruments, exported over OTLP when the
/// telemetry setup installed a meter provider (no-ops otherwise).
#[derive(Debug)]
struct Otel {
    deliveries: opentelemetry::metrics::Counter<u64>,
    decision_seconds: opentelemetry::metrics::Histogram<f64>,
    rpc_seconds: opentelemetry::metrics::Histogram<f64>,
    batch_records: opentelemetry::metrics::Histogram<u64>,
    commit_seconds: opentelemetry::metrics::Histogram<f64>,
    records_written: opentelemetry::metrics::Counter<u64>,
    drop_counts_written: opentelemetry::metrics::Counter<u64>,
    ingress_refused: opentelemetry::metrics::Counter<u64>,
    ingress_replayed: opentelemetry::metrics::Counter<u64>,
    queue_wait_seconds: opentelemetry::metrics::Histogram<f64>,
    resume_wait_seconds: opentelemetry::metrics::Histogram<f64>,
    sockets_shed: opentelemetry::metrics::Counter<u64>,
    records_deleted: opentelemetry::metrics::Counter<u64>,
    signature_checks: opentelemetry::metrics::Counter<u64>,
    signature_check_seconds: opentelemetry::metrics::Counter<f64>,
}

impl Otel {
    fn new() -> Otel {
        let m = opentelemetry::global::meter("hcp-sense");
        Otel {
            deliveries: m
                .u64_counter("hcp_sense.deliveries")
                .with_description("Triggers decided")
                .build(),
            decision_seconds: m
                .f64_histogram("hcp_sense.decision.duration")
                .with_unit("s")
                .build(),
            rpc_seconds: m
                .f64_histogram("hcp_sense.rpc.duration")
                .with_unit("s")
                .build(),
            batch_records: m.u64_histogram("hcp_sense.sink.batch.records").build(),
            commit_seconds: m
                .f64_histogram("hcp_sense.sink.commit.duration")
                .with_unit("s")
                .build(),
            records_written: m.u64_counter("hcp_sense.records.written").build(),
            drop_counts_written: m.u64_counter("hcp_sense.drop_counts.written").build(),
            ingress_refused: m.u64_counter("hcp_sense.ingress.refused").build(),
            ingress_replayed: m.u64_counter("hcp_sense.ingress.replayed").build(),
            queue_wait_seconds: m
                .f64_histogram("hcp_sense.sink.queue.wait")
                .with_unit("s")
                .build(),
            resume_wait_seconds: m
                .f64_histogram("hcp_sense.sink.resume.wait")
                .with_unit("s")
                .build(),
            sockets_shed: m.u64_counter("hcp_sense.sockets.shed").build(),
            records_deleted: m.u64_counter("hcp_sense.records.deleted").build(),
            signature_checks: m.u64_counter("hcp_sense.auth.signature_checks").build(),
            signature_check_seconds: m
                .f64_counter("hcp_sense.auth.signature_check.duration")
                .with_unit("s")
                .build(),
        }
    }
}

/// The label used for packs past the cardinality cap, and for unknown packs.
pub const OTHER_PACK: &str = "other";

/// Every metric the service keeps.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    deliveries: Family<DeliveryLabels, Counter>,
    decision_seconds: Histogram,
    rpc_seconds: Family<MethodLabels, Histogram, fn() -> Histogram>,
    batch_records: Histogram,
    commit_seconds: Histogram,
    records_written: Counter,
    drop_counts_written: Counter,
    ingress_refused: Family<IngressLabels, Counter>,
    ingress_replayed: Family<IngressLabels, Counter>,
    queue_wait_seconds: Family<PackLabels, Histogram, fn() -> Histogram>,
    resume_wait_seconds: Family<PackLabels, Histogram, fn() -> Histogram>,
    queued_records: Family<PackLabels, Gauge>,
    quota_admitted: Family<PackLabels, Counter>,
    quota_throttled: Family<PackLabels, Counter>,
    sockets_shed: Family<ShedLabels, Counter>,
    records_deleted: Family<CauseLabels, Counter>,
    bindings: Family<StateLabels, Gauge>,
    signature_checks: Family<BudgetLabels, Counter>,
    signature_check_seconds: Family<BudgetLabels, Counter<f64, AtomicU64>>,
    nats_routes: Family<StateLabels, Gauge>,
    nats_consumer_failures: Counter,
    decision_log_entries: Family<StateLabels, Counter>,
    /// Packs given a label of their own, at most `max_packs`.
    labelled_packs: Mutex<HashSet<String>>,
    max_packs: usize,
    otel: Otel,
}

/// Every metric's name (under the `hcp_sense` prefix) and help text.
const HELP: [(&str, &str); 23] = [
    ("deliveries", "Triggers decided, by disposition, drop reason and pack"),
    ("decision_duration_seconds", "Time to validate and decide one trigger, recording excluded"),
    ("rpc_duration_seconds", "gRPC call latency, by method"),
    ("sink_batch_records", "Records per group-commit batch"),
    ("sink_commit_duration_seconds", "Time to write and commit one batch of records"),
    ("records_written", "Records committed to the sink"),
    ("drop_counts_written", "Drops added to the drop_reports table"),
    ("ingress_refused", "Ingress requests and messages refused before any trigger was decided (a bad signature, a malformed or unmappable message, an HTTP head or body past its limits or deadline)"),
    ("ingress_replayed", "Signed ingress requests whose delivery was decided before, answered with the first outcome and not decided again"),
    ("sink_queue_wait_seconds", "Time a record waited in the sink's queue for a writer, by pack: its lane's backlog, and its turn among the packs"),
    ("sink_resume_wait_seconds", "Time from a record's commit until its caller ran again on the server's runtime, by pack: the runtime's backlog of ready calls that a recorded call waits behind before it is answered"),
    ("sink_queued_records", "Records of a pack waiting in the sink's queue, as the last batch taken from it left them"),
    ("quota_admitted", "Triggers of packs with a quota (the pack's or a principal's) that the quota admitted to the decision"),
    ("quota_throttled", "Triggers refused over a quota: answered RESOURCE_EXHAUSTED (HTTP 429, NATS redelivered later), neither recorded nor dropped"),
    ("sockets_shed", "Client sockets closed to make room at a listener's cap (peer_cap, total_cap: the oldest not serving a request), and new ones refused because every socket of their peer was serving one (peer_busy)"),
    ("records_deleted", "Records deleted from the sink, by cause: erasure (EraseRecords) or retention"),
    ("bindings", "Bindings of registered packs, by health state"),
    ("auth_signature_checks", "JWT signatures checked, by whether the caller's address was within its budget of failed authentications (within) or past it (over: one check at a time in all)"),
    ("auth_signature_check_seconds", "Time spent checking JWT signatures, by the same budget"),
    ("nats_routes", "NATS routes of this replica by the state of their consumer: consuming, or failing (not running, being retried)"),
    ("nats_consumer_failures", "Times a NATS route's consumer could not start or stopped (a stream missing, NATS unreachable)"),
    ("build_info", "The running build"),
    ("decision_log_entries", "Decision log entries that are not records' (drops, refusals, duplicates), by state: taken (after the fold rule), written, lost (given up while the store did not take them); a recorded trigger's entry is written with its record"),
];

/// Registers `metric` under `name` with its help text from HELP, and returns it.
fn registered<M: prometheus_client::registry::Metric + Clone>(
    registry: &mut Registry,
    name: &'static str,
    metric: M,
) -> M {
    let help = HELP.iter().find(|(n, _)| *n == name).map_or("", |(_, h)| h);
    registry.register(name, help, metric.clone());
    metric
}

fn seconds() -> Histogram {
    // 1 µs to about 16 s.
    Histogram::new(exponential_buckets(1e-6, 2.5, 19))
}

impl Metrics {
    /// Metrics with at most `max_packs` distinct pack labels.
    pub fn new(max_packs: usize) -> Metrics {
        let mut r = Registry::with_prefix("hcp_sense");
        let records_deleted = Family::<CauseLabels, Counter>::default();
        for cause in ["erasure", "retention"] {
            // Present from the start, so a dashboard's rate reads 0 rather than nothing.
            let _ = records_deleted.get_or_create(&CauseLabels { cause });
        }
        let signature_checks = Family::<BudgetLabels, Counter>::default();
        let signature_check_seconds = Family::<BudgetLabels, Counter<f64, AtomicU64>>::default();
        for budget in ["within", "over"] {
            let _ = signature_checks.get_or_create(&BudgetLabels { budget });
            let _ = signature_check_seconds.get_or_create(&BudgetLabels { budget });
        }
        let decision_log_entries = Family::<StateLabels, Counter>::default();
        for state in ["taken", "written", "lost"] {
            let _ = decision_log_entries.get_or_create(&StateLabels { state });
        }
        let build = Family::<BuildLabels, Gauge>::default();
        build
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        let per_pack = Family::<PackLabels, Histogram, fn() -> Histogram>::new_with_constructor;
        let per_method = Family::<MethodLabels, Histogram, fn() -> Histogram>::new_with_constructor;
        let batch_sizes = Histogram::new(exponential_buckets(1.0, 2.0, 11));
        Metrics {
            deliveries: registered(&mut r, "deliveries", Family::default()),
            decision_seconds: registered(&mut r, "decision_duration_seconds", seconds()),
            rpc_seconds: registered(&mut r, "rpc_duration_seconds", per_method(seconds)),
            batch_records: registered(&mut r, "sink_batch_records", batch_sizes),
            commit_seconds: registered(&mut r, "sink_commit_duration_seconds", seconds()),
            records_written: registered(&mut r, "records_written", Counter::default()),
            drop_counts_written: registered(&mut r, "drop_counts_written", Counter::default()),
            ingress_refused: registered(&mut r, "ingress_refused", Family::default()),
            ingress_replayed: registered(&mut r, "ingress_replayed", Family::default()),
            queue_wait_seconds: registered(&mut r, "sink_queue_wait_seconds", per_pack(seconds)),
            resume_wait_seconds: registered(&mut r, "sink_resume_wait_seconds", per_pack(seconds)),
            queued_records: registered(&mut r, "sink_queued_records", Family::default()),
            quota_admitted: registered(&mut r, "quota_admitted", Family::default()),
            quota_throttled: registered(&mut r, "quota_throttled", Family::default()),
            sockets_shed: registered(&mut r, "sockets_shed", Family::default()),
            records_deleted: registered(&mut r, "records_deleted", records_deleted),
            bindings: registered(&mut r, "bindings", Family::default()),
            signature_checks: registered(&mut r, "auth_signature_checks", signature_checks),
            signature_check_seconds: registered(
                &mut r,
                "auth_signature_check_seconds",
                signature_check_seconds,
            ),
            nats_routes: registered(&mut r, "nats_routes", Family::default()),
            decision_log_entries: registered(&mut r, "decision_log_entries", decision_log_entries),
            nats_consumer_failures: registered(
                &mut r,
                "nats_consumer_failures",
                Counter::default(),
            ),
            labelled_packs: Mutex::new(HashSet::new()),
            max_packs,
            otel: Otel::new(),
            registry: {
                registered(&mut r, "build_info", build);
                r
            },
        }
    }

    /// A pack's label: its id while under the cap, else `other`. Unknown packs are
    /// always `other`, so producers cannot create labels.
    fn pack_label(&self, pack_id: &str, known: bool) -> String {
        if !known {
            return OTHER_PACK.to_owned();
        }
        let Ok(mut packs) = self.labelled_packs.lock() else {
            return OTHER_PACK.to_owned();
        };
        if packs.contains(pack_id)
            || (packs.len() < self.max_packs && packs.insert(pack_id.to_owned()))
        {
            pack_id.to_owned()
        } else {
            OTHER_PACK.to_owned()
        }
    }

    pub fn delivered(
        &self,
        pack_id: &str,
        o: &Outcome,
        decide_time: Duration,
        ingress: &'static str,
    ) {
        let known = o.drop_reason != Some(DropReason::UnknownPack);
        let labels = DeliveryLabels {
            disposition: o.disposition(),
            drop_reason: o.drop_reason.map_or("", DropReason::as_str),
            pack: self.pack_label(pack_id, known),
            ingress,
        };
        self.otel.deliveries.add(
            1,
            &[
                KeyValue::new("disposition", labels.disposition),
                KeyValue::new("drop_reason", labels.drop_reason),
                KeyValue::new("pack", labels.pack.clone()),
                KeyValue::new("ingress", ingress),
            ],
        );
        self.deliveries.get_or_create(&labels).inc();
        self.decision_seconds.observe(decide_time.as_secs_f64());
        self.otel
            .decision_seconds
            .record(decide_time.as_secs_f64(), &[]);
    }

    /// An ingress request or message refused before any trigger was decided.
    /// A socket of `listener` shed, or refused, at a cap (`reason`: peer_cap, total_cap,
    /// peer_busy).
    pub fn socket_shed(&self, listener: &'static str, reason: &'static str) {
        self.sockets_shed
            .get_or_create(&ShedLabels { listener, reason })
            .inc();
        self.otel.sockets_shed.add(
            1,
            &[
                KeyValue::new("listener", listener),
                KeyValue::new("reason", reason),
            ],
        );
    }

    pub fn ingress_refused(&self, ingress: &'static str) {
        self.ingress_refused
            .get_or_create(&IngressLabels { ingress })
            .inc();
        self.otel
            .ingress_refused
            .add(1, &[KeyValue::new("ingress", ingress)]);
    }

    /// A signed delivery decided before, answered from the ledger; `ingress` is the route's kind.
    pub fn ingress_replayed(&self, ingress: &'static str) {
        self.ingress_replayed
            .get_or_create(&IngressLabels { ingress })
            .inc();
        self.otel
            .ingress_replayed
            .add(1, &[KeyValue::new("ingress", ingress)]);
    }

    /// Records deleted by EraseRecords (`erasure`) or by the retention pruner (`retention`).
    pub fn records_deleted(&self, cause: &'static str, n: u64) {
        if n == 0 {
            return;
        }
        self.records_deleted
            .get_or_create(&CauseLabels { cause })
            .inc_by(n);
        self.otel
            .records_deleted
            .add(n, &[KeyValue::new("cause", cause)]);
    }

    /// A JWT signature checked, for a caller within its failed-authentication budget or over it.
    pub fn signature_checked(&self, budget: &'static str, took: Duration) {
        let labels = BudgetLabels { budget };
        self.signature_checks.get_or_create(&labels).inc();
        self.signature_check_seconds
            .get_or_create(&labels)
            .inc_by(took.as_secs_f64());
        let attrs = [KeyValue::new("budget", budget)];
        self.otel.signature_checks.add(1, &attrs);
        self.otel
            .signature_check_seconds
            .add(took.as_secs_f64(), &attrs);
    }

    pub fn rpc(&self, method: &str, took: Duration) {
        self.otel.rpc_seconds.record(
            took.as_secs_f64(),
            &[KeyValue::new("method", method.to_owned())],
        );
        self.rpc_seconds
            .get_or_create(&MethodLabels {
                method: method.to_owned(),
            })
            .observe(took.as_secs_f64());
    }

    pub fn batch(&self, records: usize, took: Duration, committed: bool) {
        self.batch_records.observe(records as f64);
        self.commit_seconds.observe(took.as_secs_f64());
        self.otel.batch_records.record(records as u64, &[]);
        self.otel.commit_seconds.record(took.as_secs_f64(), &[]);
        if committed {
            self.records_written.inc_by(records as u64);
            self.otel.records_written.add(records as u64, &[]);
        }
    }

    /// A record of `pack_id` taken from the sink's queue after waiting `waited`.
    pub fn queue_waited(&self, pack_id: &str, waited: Duration) {
        let (otel, prom) = (&self.otel.queue_wait_seconds, &self.queue_wait_seconds);
        self.per_pack_seconds(otel, prom, pack_id, waited);
    }

    /// A record of `pack_id` whose caller ran again `waited` after its batch committed.
    pub fn resumed(&self, pack_id: &str, waited: Duration) {
        let (otel, prom) = (&self.otel.resume_wait_seconds, &self.resume_wait_seconds);
        self.per_pack_seconds(otel, prom, pack_id, waited);
    }

    /// One observation of a histogram of seconds by pack, in both exports.
    fn per_pack_seconds(
        &self,
        otel: &opentelemetry::metrics::Histogram<f64>,
        prom: &Family<PackLabels, Histogram, fn() -> Histogram>,
        pack_id: &str,
        took: Duration,
    ) {
        let pack = self.pack_label(pack_id, true);
        otel.record(took.as_secs_f64(), &[KeyValue::new("pack", pack.clone())]);
        prom.get_or_create(&PackLabels { pack })
            .observe(took.as_secs_f64());
    }

    /// Records of `pack_id` left in the sink's queue. Packs past the label cap share `other`,
    /// which no single pack's depth may stand for: it is left unset.
    pub fn queue_depth(&self, pack_id: &str, queued: usize) {
        let pack = self.pack_label(pack_id, true);
        if pack != OTHER_PACK {
            self.queued_records
                .get_or_create(&PackLabels { pack })
                .set(i64::try_from(queued).unwrap_or(i64::MAX));
        }
    }

    /// `n` triggers of `pack_id` admitted by its quotas.
    pub fn quota_admitted(&self, pack_id: &str, n: u64) {
        let pack = self.pack_label(pack_id, true);
        self.quota_admitted
            .get_or_create(&PackLabels { pack })
            .inc_by(n);
    }

    /// `n` triggers of `pack_id` refused over a quota.
    pub fn quota_throttled(&self, pack_id: &str, n: u64) {
        let pack = self.pack_label(pack_id, true);
        self.quota_throttled
            .get_or_create(&PackLabels { pack })
            .inc_by(n);
    }

    /// Decision log entries taken (after the fold rule), written, or given up.
    pub fn decision_log_taken(&self, n: u64) {
        self.decision_log_entry("taken", n);
    }

    pub fn decision_log_written(&self, n: u64) {
        self.decision_log_entry("written", n);
    }

    pub fn decision_log_lost(&self, n: u64) {
        self.decision_log_entry("lost", n);
    }

    fn decision_log_entry(&self, state: &'static str, n: u64) {
        if n > 0 {
            self.decision_log_entries
                .get_or_create(&StateLabels { state })
                .inc_by(n);
        }
    }

    pub fn drop_counts_written(&self, n: u64) {
        self.drop_counts_written.inc_by(n);
        self.otel.drop_counts_written.add(n, &[]);
    }

    /// Sets the Binding gauges: `(state, count)` for every state.
    pub fn set_bindings(&self, counts: &[(&'static str, i64)]) {
        for (state, n) in counts {
            self.bindings.get_or_create(&StateLabels { state }).set(*n);
        }
    }

    /// Sets the NATS route gauges: routes consuming, and routes whose consumer is failing.
    pub fn set_nats_routes(&self, consuming: i64, failing: i64) {
        for (state, n) in [("consuming", consuming), ("failing", failing)] {
            self.nats_routes
                .get_or_create(&StateLabels { state })
                .set(n);
        }
    }

    /// A NATS route's consumer could not start, or stopped.
    pub fn nats_consumer_failed(&self) {
        self.nats_consumer_failures.inc();
    }

    /// The classic Prometheus text format (0.0.4), for clients that do not ask
    /// for OpenMetrics: counter families are named with their `_total` suffix
    /// and the OpenMetrics-only lines are left out.
    pub fn encode_text(&self) -> String {
        let om = self.encode();
        let counters: HashSet<&str> = om
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
            .collect();
        let mut out = String::with_capacity(om.len());
        for line in om.lines() {
            if line == "# EOF" || line.starts_with("# UNIT ") {
                continue;
            }
            let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
                let rest = line.strip_prefix(prefix)?;
                let (name, tail) = rest.split_once(' ')?;
                counters
                    .contains(name)
                    .then(|| format!("{prefix}{name}_total {tail}"))
            });
            out.push_str(renamed.as_deref().unwrap_or(line));
            out.push('\n');
        }
        out
    }

    /// The OpenMetrics exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every metric exposed carries its help text from the one table (families show once
    /// they have a series).
    #[test]
    fn every_metric_has_its_help() {
        let exposed = Metrics::new(4).encode();
        let helped: Vec<&str> = exposed
            .lines()
            .filter_map(|l| l.strip_prefix("# HELP hcp_sense_"))
            .collect();
        assert!(helped.len() >= 5, "{exposed}");
        for line in helped {
            assert!(
                HELP.iter()
                    .any(|(n, h)| !h.is_empty() && line.starts_with(&format!("{n} {h}"))),
                "{line}"
            );
        }
    }
}
