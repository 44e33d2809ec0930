//! Durable group commit of records: concurrent deliveries are written together, one multi-row INSERT per batch in one transaction, and each caller is answered only after its batch commits.
use std::sync::Arc;

use sea_orm::sea_query::{Expr, ExprTrait};
use sea_orm::{
    ConnectionTrait, DbBackend, EntityTrait, QueryFilter, QuerySelect, QueryTrait, Statement,
};
use tokio::sync::{oneshot, Mutex};

use super::entity::records;
use secrecy::ExposeSecret;

use super::resume::{Reply, Resume};
use super::sqlite_writer::{SqliteWriter, CUT_EVERY};
use super::{classify, DeliveryTables, Engine, Store};
use crate::domain::decision_log::Note;
use crate::domain::model::Record;
use crate::domain::policy::Route;
use crate::domain::trigger::Identity;
use crate::error::{Error, Result};
use crate::fair::FairQueue;
use crate::lifecycle::Lifecycle;
use crate::metrics::Metrics;

/// Records one (pack, principal) lane holds queued; its next callers wait, not answered, until
/// a writer takes one: a flood queues this much and no more, whatever its callers number.
pub const LANE_BOUND: usize = 1024;
/// Records every lane holds together. Each lane's callers wait for a lane permit first, so at
/// most LANE_BOUND of one lane's callers ever wait in the queue beside the others'.
pub const TOTAL_BOUND: usize = 8192;

/// What became of one record in a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stored {
    /// Written under this id.
    Inserted { record_id: String },
    /// Its trigger id was already recorded for the pack, for the same principal, ref and land: the first record.
    Duplicate { record_id: String, route: Route },
    /// Its trigger id was already used for the pack by a different trigger.
    Conflict,
}

struct Job {
    record: Record,
    /// The decision log's entry, written with the record when the log is on.
    note: Option<Note>,
    done: oneshot::Sender<Reply<Result<Written>>>,
}

/// A record written, and how long it waited in the sink's queue for a writer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub stored: Stored,
    pub waited: std::time::Duration,
    /// When its batch committed and its caller was told: how long the caller then waits to
    /// run again is the server runtime's backlog (`Metrics::resumed`).
    pub answered: std::time::Instant,
}

/// The writer side of the sink. Cheap to clone; its writers are threads of the lifecycle it
/// was started with.
#[derive(Clone, Debug)]
pub struct Sink {
    queue: Arc<FairQueue<Job>>,
}

/// A caller waiting on a record taken from the queue: its pack, where its answer goes, and how
/// long the record waited.
type Caller = (
    String,
    oneshot::Sender<Reply<Result<Written>>>,
    std::time::Duration,
);

/// The sink's answers on their way to their callers (see `resume`).
type Answers = Arc<Resume<Result<Written>>>;

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Job")
    }
}

/// Columns every record insert names, in the order of the statements below.
const COLUMNS: &str = "record_id, principal, binding_id, land, pack_id, ref, payload, route, project, producer_trigger_id, received_time";

/// PostgreSQL: the whole batch as one JSON parameter of one fixed statement, prepared once per
/// connection and one round trip. A record with a trigger id first claims it in the ledger
/// (`record_triggers`, whose primary key is the idempotency that the partitioned table cannot
/// hold), and is inserted only when the claim is its own: new, or taking over a ledger row
/// below the floor, whose record's partition retention has dropped or is dropping. A trigger
/// id the ledger already holds above the floor (a retry) is not claimed at all: the claim's
/// ON CONFLICT DO UPDATE would lock its row even when it updates nothing, giving the batch a
/// transaction id (holding back every watch until it commits) and a durable commit for
/// nothing. The look-up is a correlated subquery, one primary-key probe per row whatever the
/// generic plan guesses of the batch's size. Its first record is looked up after, as for any
/// trigger id; one removed meanwhile is UNAVAILABLE, and its retry records anew.
/// `stored_time` is the database's clock (every replica the same partition); `commit_txid`
/// the writing transaction's id, taken once; `seq` comes from the sequence's default.
const INSERT_POSTGRES: &str = "WITH x AS ( \
       SELECT *, (extract(epoch FROM statement_timestamp()) * 1000000)::bigint AS stored_time \
       FROM jsonb_to_recordset($1::jsonb) AS x(record_id text, principal text, binding_id text, land text, pack_id text, \
            ref text, payload text, route text, project text, producer_trigger_id text, received_time bigint)), \
     claimed AS ( \
       INSERT INTO record_triggers AS k (pack_id, producer_trigger_id, record_id, stored_time) \
       SELECT pack_id, producer_trigger_id, record_id, stored_time FROM x WHERE producer_trigger_id IS NOT NULL \
         AND NOT COALESCE((SELECT h.stored_time >= (SELECT floor_time FROM record_floor) FROM record_triggers h \
                           WHERE h.pack_id = x.pack_id AND h.producer_trigger_id = x.producer_trigger_id), false) \
       ON CONFLICT (pack_id, producer_trigger_id) DO UPDATE \
         SET record_id = excluded.record_id, stored_time = excluded.stored_time \
         WHERE k.stored_time < (SELECT floor_time FROM record_floor) \
       RETURNING k.record_id) \
     INSERT INTO records (record_id, principal, binding_id, land, pack_id, ref, payload, route, project, producer_trigger_id, \
            received_time, commit_txid, stored_time) \
     SELECT record_id, principal, binding_id, land, pack_id, ref, payload, route, project, producer_trigger_id, received_time, \
            (SELECT pg_current_xact_id()::text::bigint), stored_time \
     FROM x WHERE producer_trigger_id IS NULL OR record_id IN (SELECT record_id FROM claimed)";

/// INSERT_POSTGRES with the decision log: each record inserted whose row carries a note
/// (`source`) has its entry written by the same statement, at the record's stored time (the
/// partition key of both). Answers the records inserted as `n`.
const INSERT_POSTGRES_LOGGED: &str = "WITH x AS ( \
       SELECT *, (extract(epoch FROM statement_timestamp()) * 1000000)::bigint AS stored_time \
       FROM jsonb_to_recordset($1::jsonb) AS x(record_id text, principal text, binding_id text, land text, pack_id text, \
            ref text, payload text, route text, project text, producer_trigger_id text, received_time bigint, \
            source text, trace_id text)), \
     claimed AS ( \
       INSERT INTO record_triggers AS k (pack_id, producer_trigger_id, record_id, stored_time) \
       SELECT pack_id, producer_trigger_id, record_id, stored_time FROM x WHERE producer_trigger_id IS NOT NULL \
         AND NOT COALESCE((SELECT h.stored_time >= (SELECT floor_time FROM record_floor) FROM record_triggers h \
                           WHERE h.pack_id = x.pack_id AND h.producer_trigger_id = x.producer_trigger_id), false) \
       ON CONFLICT (pack_id, producer_trigger_id) DO UPDATE \
         SET record_id = excluded.record_id, stored_time = excluded.stored_time \
         WHERE k.stored_time < (SELECT floor_time FROM record_floor) \
       RETURNING k.record_id), \
     ins AS ( \
       INSERT INTO records (record_id, principal, binding_id, land, pack_id, ref, payload, route, project, producer_trigger_id, \
              received_time, commit_txid, stored_time) \
       SELECT record_id, principal, binding_id, land, pack_id, ref, payload, route, project, producer_trigger_id, received_time, \
              (SELECT pg_current_xact_id()::text::bigint), stored_time \
       FROM x WHERE producer_trigger_id IS NULL OR record_id IN (SELECT record_id FROM claimed) \
       RETURNING record_id), \
     logged AS ( \
       INSERT INTO decisions (decided_time, pack_id, ref, principal, land, project, binding_id, trigger_id, source, outcome, \
              record_id, trace_id) \
       SELECT stored_time, pack_id, ref, principal, land, project, binding_id, producer_trigger_id, source, route, \
              record_id, trace_id \
       FROM x WHERE source IS NOT NULL AND record_id IN (SELECT record_id FROM ins)) \
     SELECT count(*) AS n FROM ins";

/// Most records in one batch.
pub const MAX_BATCH: usize = 512;

impl Sink {
    /// Starts `writers` writers, each on a thread and runtime of its own with a connection of
    /// its own, so a busy gRPC runtime never delays a commit that a whole batch waits for. They
    /// take batches from one fair queue (lanes per pack and principal, served in turn; see
    /// `fair`) and commit independently: the store, not a lock, orders their records (see
    /// `Position`). SQLite has one writer whatever is asked. The writers are threads of `life`:
    /// when closing begins the queue closes, and they commit what is queued and end.
    pub fn start(
        store: DeliveryTables,
        metrics: Arc<Metrics>,
        batch_timeout: std::time::Duration,
        (writers, commit_delay): (usize, std::time::Duration),
        life: &Lifecycle,
    ) -> Sink {
        let queue = Arc::new(FairQueue::<Job>::new(LANE_BOUND, TOTAL_BOUND));
        // Writers take batches in turn, so one waits on the queue at a time; the turn holds
        // the pace they share (the rate counts every writer's records).
        let turn = Arc::new(Mutex::new(Pace::new(commit_delay)));
        let committing = Arc::new(Committing::default());
        let answers: Answers = Resume::new(super::resume::WINDOW);
        let (writers, shared_batch) = match store.engine() {
            Engine::Sqlite => (1, MAX_BATCH),
            Engine::Postgres => (writers.max(1), SHARED_BATCH),
        };
        for n in 0..writers {
            let (store, queue, turn, metrics, committing, answers) = (
                store.clone(),
                queue.clone(),
                turn.clone(),
                metrics.clone(),
                committing.clone(),
                answers.clone(),
            );
            on_thread(life, format!("hcp-sense-sink-{n}"), move || async move {
                let writer = Writer::open(&store, metrics, answers, batch_timeout).await;
                write_batches(writer, (&queue, &turn), (&committing, shared_batch)).await
            });
        }
        if store.engine() == Engine::Postgres {
            let (store, queue) = (store.clone(), queue.clone());
            on_thread(life, "hcp-sense-sink-express".into(), move || async move {
                write_express(
                    Writer::open(&store, metrics, answers, batch_timeout).await,
                    &queue,
                )
                .await
            });
        }
        let closed = queue.clone();
        life.on_close(move || closed.close());
        Sink { queue }
    }

    /// Writes one record durably; returns once its batch has committed. Waits first, not
    /// answered, while its (pack, principal) lane of the queue is full.
    /// `note` is the decision log's entry, written in the same commit.
    pub async fn write(&self, record: Record, note: Option<Note>) -> Result<Written> {
        let (done, answer) = oneshot::channel();
        let (pack, principal) = (record.pack_id.clone(), record.principal.clone());
        self.queue
            .push(&pack, &principal, Job { record, note, done })
            .await
            .map_err(|_| Error::Unavailable("the sink is shutting down".into()))?;
        let (written, ticket) = answer.await.map_err(|_| {
            Error::Unavailable("the sink stopped before the record was written".into())
        })?;
        // Running again: the next answer held goes out (see `resume`).
        drop(ticket);
        written
    }
}

/// Runs `writer` on a thread of `life` with a runtime of its own, so a busy gRPC runtime never
/// delays a commit that a whole batch waits for.
fn on_thread<F: std::future::Future<Output = ()>>(
    life: &Lifecycle,
    name: String,
    writer: impl FnOnce() -> F + Send + 'static,
) {
    let spawned = life.thread(
        name,
        move || match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt.block_on(writer()),
            Err(e) => tracing::error!(error = %e, "sink runtime did not start"),
        },
    );
    if let Err(e) = spawned {
        tracing::error!(error = %e, "sink thread did not start");
    }
}

/// Batches being committed, and a wake-up for a writer waiting on them.
#[derive(Default)]
struct Committing {
    batches: std::sync::atomic::AtomicUsize,
    done: tokio::sync::Notify,
}

/// How long after a batch found more than one pack queued the writers keep batches short.
const SHARED_FOR: std::time::Duration = std::time::Duration::from_millis(250);

/// Most records in one batch while packs share the writers (see `take_batch`), on PostgreSQL.
/// SQLite, which syncs its log at every commit, keeps MAX_BATCH: there a batch of 64 cost a
/// flood a third of its rate (docs/performance.md).
pub const SHARED_BATCH: usize = 64;

/// Records a writer must hold before it commits alongside another writer's batch.
const ENGAGE: usize = 64;

impl Committing {
    fn busy(&self) -> bool {
        self.batches.load(std::sync::atomic::Ordering::SeqCst) > 0
    }
}

/// A record taken from the queue: its pack, the job, and how long it waited.
type Taken<T> = (String, T, std::time::Duration);

/// Takes what is queued (at least one record, at most MAX_BATCH, packs and principals in
/// turn) into `batch`, or the sparse packs' records alone (see `FairQueue::try_take_sparse`);
/// false once the queue is closed and empty.
///
/// While another writer's batch commits, more writers only help once the backlog is deep: a
/// second commit of a handful of records costs a round trip and a WAL flush of its own, where
/// waiting lets them join one larger batch. So a writer holding fewer than ENGAGE records keeps
/// collecting until the other commit ends or it reaches ENGAGE, whichever comes first. A lone
/// writer never waits.
async fn take_batch<T>(
    queue: &FairQueue<T>,
    committing: &Committing,
    shared_batch: usize,
    batch: &mut Vec<Taken<T>>,
    pace: &mut Pace,
) -> bool {
    if !queue.queued_any().await {
        return false;
    }
    // A sparse pack's record (its pack had nothing queued) beside a backlog is committed in a
    // batch of such records alone, at once: it waits for the commit under way and a short one of
    // its own, never for a flood's long batch. Never two such batches in a row, so a flood
    // loses at most one short commit per batch of its own.
    if queue.try_take_sparse(batch, SHARED_BATCH) {
        return true;
    }
    if !queue.take(batch, 1).await {
        return false;
    }
    // While packs share the writers, batches are shorter: a record of a pack arriving during a
    // commit waits for that commit, and a shorter one is a shorter wait.
    let max = if queue.shared_within(SHARED_FOR) {
        shared_batch
    } else {
        MAX_BATCH
    };
    let engage = ENGAGE.min(max);
    if !committing.busy() && batch.len() < engage && !pace.delay.is_zero() {
        // The rate is read again first, so a quiet spell since the last batch counts: the
        // first record after it is not held for a rate that has passed.
        pace.took(0, std::time::Instant::now());
        if pace.lingers() {
            linger(queue, batch, (pace.target().min(engage), max), pace.delay).await;
        }
    }
    loop {
        queue.try_take(batch, max);
        if batch.len() >= engage {
            return true;
        }
        let ended = committing.done.notified();
        tokio::pin!(ended);
        // Registered before the check, so an end between the two is not missed.
        ended.as_mut().enable();
        if !committing.busy() {
            return true;
        }
        tokio::select! {
            open = queue.take(batch, max) => if !open {
                return true;
            },
            () = &mut ended => return true,
        }
    }
}

/// Group commit at a steady rate (`--sink-commit-delay-ms`): how long a lone writer waits for
/// more records before it commits, and the rate records came at lately. At 1,000 records a
/// second every record is otherwise a commit of its own: a sync of the log and a wake-up of
/// every thread it passes, which costs more CPU than the record's whole call
/// (docs/performance.md). Waiting turns several records into one commit, and each record is
/// answered up to the delay later. The writer waits only for the records the rate puts inside
/// the delay (at most ENGAGE), and only while that is at least half of one: at a low rate a wait
/// would gather nothing and only add to the answer's time.
pub(crate) struct Pace {
    delay: std::time::Duration,
    since: std::time::Instant,
    taken: usize,
    rate: f64,
}

/// The span over which the rate is counted.
const PACE_WINDOW: std::time::Duration = std::time::Duration::from_millis(100);

impl Pace {
    pub(crate) fn new(delay: std::time::Duration) -> Pace {
        Pace {
            delay,
            since: std::time::Instant::now(),
            taken: 0,
            rate: 0.0,
        }
    }

    /// `n` records taken at `now`; the rate is read again once a window has passed.
    fn took(&mut self, n: usize, now: std::time::Instant) {
        self.taken += n;
        let elapsed = now.saturating_duration_since(self.since);
        if elapsed >= PACE_WINDOW {
            self.rate = self.taken as f64 / elapsed.as_secs_f64();
            self.taken = 0;
            self.since = now;
        }
    }

    /// How many records a batch waits for: the one it holds and those the rate puts inside
    /// the delay. A writer stops waiting at this many, so a burst of callers that all came at
    /// once (a closed loop of a few dozen) is not held for the rest of the delay.
    fn target(&self) -> usize {
        if self.delay.is_zero() {
            return 1;
        }
        1 + (self.rate * self.delay.as_secs_f64()).round() as usize
    }

    /// Whether a wait of the delay is likely to gather another record.
    fn lingers(&self) -> bool {
        self.target() > 1
    }
}

/// Waits up to `delay` for records to join `batch`, until it holds `enough` (the records due
/// within the delay, at most ENGAGE) or the queue closes.
async fn linger<T>(
    queue: &FairQueue<T>,
    batch: &mut Vec<Taken<T>>,
    (enough, max): (usize, usize),
    delay: std::time::Duration,
) {
    let until = tokio::time::Instant::now() + delay;
    while batch.len() < enough {
        match tokio::time::timeout_at(until, queue.take(batch, max)).await {
            Ok(true) => {}
            Ok(false) | Err(_) => return,
        }
    }
}

/// Records of one pack a batch may hold for the pack to be light: committed ahead of the rest.
const LIGHT: usize = 2;
/// Records of heavier packs a batch must hold for its light ones to go first.
const HEAVY: usize = 32;

/// Splits a batch into the records of its light packs (at most LIGHT records each) and the
/// rest, when the rest is at least HEAVY records; else nothing is light. A quiet pack's record
/// taken with a flood's batch would wait for the whole batch's insert and commit, several
/// milliseconds on two cores the flood saturates; committed first, on its own, it waits for
/// one short commit (on SQLite a WAL append and sync, about 0.2 ms here) and is answered
/// before the flood's. The flood pays one such commit per batch that holds a light pack, and
/// no pack's order changes: each pack's records all go one way, and packs are not ordered
/// against each other.
fn light_first<T>(batch: Vec<Taken<T>>) -> (Vec<Taken<T>>, Vec<Taken<T>>) {
    if batch.len() <= HEAVY {
        return (Vec::new(), batch);
    }
    let mut per_pack: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for (pack, _, _) in &batch {
        *per_pack.entry(pack.as_str()).or_default() += 1;
    }
    let light: Vec<bool> = batch
        .iter()
        .map(|(p, _, _)| per_pack.get(p.as_str()).is_some_and(|n| *n <= LIGHT))
        .collect();
    let n = light.iter().filter(|l| **l).count();
    if n == 0 || batch.len() - n < HEAVY {
        return (Vec::new(), batch);
    }
    let (mut first, mut rest) = (Vec::with_capacity(n), Vec::with_capacity(batch.len() - n));
    for (taken, light) in batch.into_iter().zip(light) {
        if light {
            first.push(taken);
        } else {
            rest.push(taken);
        }
    }
    (first, rest)
}

/// Takes whatever is queued (see `take_batch`) and writes it.
/// No wait is added: an idle sink writes a batch of one at once, and under load the
/// queue that builds up while a batch commits becomes the next batch.
///
/// A batch not committed within `batch_timeout` is answered UNAVAILABLE. After a batch the
/// store could not take, the writer's connection is abandoned and the next batch opens a new
/// one: a connection to a database that went silent (a partition, a failover) would otherwise
/// hold every later record until the kernel gives up on it.
async fn write_batches(
    mut writer: Writer<'_>,
    (queue, turn): (&FairQueue<Job>, &Mutex<Pace>),
    (committing, shared_batch): (&Committing, usize),
) {
    loop {
        let mut batch = Vec::new();
        {
            let mut pace = turn.lock().await;
            if !take_batch(queue, committing, shared_batch, &mut batch, &mut pace).await {
                break;
            }
            pace.took(batch.len(), std::time::Instant::now());
            // Counted before the next writer may look at the queue.
            committing
                .batches
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        writer.commit(batch, queue).await;
        committing
            .batches
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        committing.done.notify_waiters();
    }
    writer.close().await;
}

/// The express writer (PostgreSQL): with a connection of its own, it commits the records of
/// sparse packs queued beside a backlog (see `FairQueue::try_take_express`) while the other
/// writers commit the backlog's batches, so a quiet pack's record waits for its own short
/// commit, not for a flood's batch to end first. It takes nothing while no pack is backlogged:
/// then the writers are free, and one more thread woken per record would only cost CPU.
async fn write_express(mut writer: Writer<'_>, queue: &FairQueue<Job>) {
    while queue.sparse_beside_backlog().await {
        let mut batch = Vec::new();
        if queue.try_take_express(&mut batch, SHARED_BATCH) && !batch.is_empty() {
            writer.commit(batch, queue).await;
        }
    }
    writer.close().await;
}

/// A writer's connection and what it reports to: opened ahead of the first batch when the
/// store answers, otherwise on first use. On SQLite (a file) the writer's own connection on its
/// own thread (see `sqlite_writer`).
struct Writer<'a> {
    parent: &'a Store,
    conn: Option<DeliveryTables>,
    sqlite: Option<SqliteWriter>,
    metrics: Arc<Metrics>,
    answers: Answers,
    batch_timeout: std::time::Duration,
}

impl<'a> Writer<'a> {
    async fn open(
        parent: &'a Store,
        metrics: Arc<Metrics>,
        answers: Answers,
        batch_timeout: std::time::Duration,
    ) -> Writer<'a> {
        let sqlite = match parent.engine() {
            Engine::Sqlite => SqliteWriter::open(parent.config.url.expose_secret())
                .unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "the sink writer's SQLite connection did not open; it writes through the pool");
                    None
                }),
            Engine::Postgres => None,
        };
        let conn = match sqlite {
            Some(_) => None,
            None => parent.dedicated().await.ok().map(DeliveryTables),
        };
        Writer {
            parent,
            conn,
            sqlite,
            metrics,
            answers,
            batch_timeout,
        }
    }

    /// Writes a batch: on the writer's own SQLite connection, in this thread, under the
    /// store's write turn; else through its pool connection, made anew after a failure.
    /// `cut` may end a batch early on SQLite (see `SqliteWriter::write`); the answer then
    /// holds the records committed, the first of `records`.
    async fn insert(
        &mut self,
        records: &mut [Record],
        notes: &[Option<Note>],
        cut: Option<&mut dyn FnMut() -> bool>,
    ) -> Result<Vec<Stored>> {
        if let Some(w) = &mut self.sqlite {
            let _turn = self.parent.write_turn.clone().lock_owned().await;
            return w.write(records, notes, cut);
        }
        let (parent, conn) = (self.parent, &mut self.conn);
        if conn.is_none() {
            *conn = Some(DeliveryTables(parent.dedicated().await?));
        }
        match conn {
            Some(w) => w.insert_batch(records, notes).await,
            None => Err(Error::Unavailable("the store is unavailable; retry".into())),
        }
    }

    /// Writes a batch taken from `queue` and answers each of its callers: the records of its
    /// light packs first, in a transaction of their own, when the rest is a backlog's (see
    /// `light_first`).
    async fn commit(&mut self, batch: Vec<Taken<Job>>, queue: &FairQueue<Job>) {
        let (light, rest) = light_first(batch);
        if !light.is_empty() {
            self.commit_one(light, queue).await;
        }
        self.commit_one(rest, queue).await;
    }

    /// Writes records taken from `queue` in one transaction and answers each of their callers.
    ///
    /// On SQLite, a backlog's batch (more than CUT_EVERY records) is cut once when a record of
    /// another pack comes sparse while it is written: the rows inserted so far commit, the
    /// sparse packs' records commit next in a transaction of their own, and then the rest. A
    /// quiet pack's record so waits for at most CUT_EVERY of a flood's rows and two short
    /// commits, not for the whole batch; the flood pays two commits more per batch, at most.
    /// PostgreSQL has the express writer for this instead.
    async fn commit_one(&mut self, batch: Vec<Taken<Job>>, queue: &FairQueue<Job>) {
        let (mut records, notes, mut answers) = self.taken(batch, queue);
        let may_cut = self.sqlite.is_some() && records.len() > CUT_EVERY;
        let mut busy: Vec<String> = Vec::new();
        if may_cut {
            for r in &records {
                if !busy.contains(&r.pack_id) {
                    busy.push(r.pack_id.clone());
                }
            }
        }
        let mut cut_once = may_cut;
        let mut from = 0;
        while from < records.len() {
            let mut asked = || queue.sparse_waiting_except(&busy);
            let cut: Option<&mut dyn FnMut() -> bool> =
                if cut_once { Some(&mut asked) } else { None };
            from += self
                .write_answered(&mut records[from..], &notes[from..], &mut answers, cut)
                .await;
            if from < records.len() {
                cut_once = false;
                let mut cut_for = Vec::new();
                queue.try_take_cut(&mut cut_for, SHARED_BATCH, &busy);
                if !cut_for.is_empty() {
                    let (mut records, notes, mut answers) = self.taken(cut_for, queue);
                    self.write_answered(&mut records, &notes, &mut answers, None)
                        .await;
                }
            }
        }
    }

    /// The records of `batch`, their notes and their callers, with the time each waited and
    /// the depth of their packs' queues reported.
    fn taken(
        &self,
        batch: Vec<Taken<Job>>,
        queue: &FairQueue<Job>,
    ) -> (Vec<Record>, Vec<Option<Note>>, Vec<Caller>) {
        let metrics = &self.metrics;
        let mut records = Vec::with_capacity(batch.len());
        let mut notes = Vec::with_capacity(batch.len());
        let mut answers = Vec::with_capacity(batch.len());
        for (pack, job, waited) in batch {
            metrics.queue_waited(&pack, waited);
            records.push(job.record);
            notes.push(job.note);
            answers.push((pack, job.done, waited));
        }
        let packs: std::collections::BTreeSet<&str> =
            records.iter().map(|r| r.pack_id.as_str()).collect();
        for pack in packs {
            metrics.queue_depth(pack, queue.queued(pack));
        }
        (records, notes, answers)
    }

    /// Writes `records` in one transaction (the first of them only, when `cut` ends it early)
    /// and answers their callers, the first of `callers`; how many were answered.
    async fn write_answered(
        &mut self,
        records: &mut [Record],
        notes: &[Option<Note>],
        callers: &mut Vec<Caller>,
        cut: Option<&mut dyn FnMut() -> bool>,
    ) -> usize {
        if records.is_empty() {
            return 0;
        }
        let metrics = self.metrics.clone();
        let started = std::time::Instant::now();
        let batch_timeout = self.batch_timeout;
        let result = tokio::time::timeout(batch_timeout, self.insert(records, notes, cut))
            .await
            .unwrap_or_else(|_| {
                Err(Error::Unavailable(
                    "the store did not answer in time; retry".into(),
                ))
            });
        if matches!(result, Err(Error::Unavailable(_))) {
            if let Some(stuck) = self.conn.take() {
                // Closing may wait on a silent connection too; it must not hold the writer.
                // A task of the writer's own runtime, which ends with the writer's thread.
                tokio::spawn(stuck.0.close());
            }
        }
        // A failed write committed none of them: every caller is told.
        let n = result.as_ref().map_or(records.len(), Vec::len);
        let took = started.elapsed();
        metrics.batch(n, took, result.is_ok());
        tracing::debug!(
            records = n,
            micros = took.as_micros() as u64,
            ok = result.is_ok(),
            "batch written"
        );
        let answered = std::time::Instant::now();
        let callers = callers.drain(..n.min(callers.len()));
        let told = match result {
            Ok(stored) => {
                self.parent.commits().local.notify_one();
                callers
                    .zip(stored)
                    .map(|((pack, to, waited), stored)| {
                        let written = Written {
                            stored,
                            waited,
                            answered,
                        };
                        (pack, to, Ok(written))
                    })
                    .collect()
            }
            Err(e) => {
                tracing::warn!(error = %e, records = n, "batch not committed; every caller in it is told");
                callers
                    .map(|(pack, to, _)| {
                        let told = match &e {
                            Error::Unavailable(m) => Error::Unavailable(m.clone()),
                            _ => {
                                Error::Unavailable("the record could not be written; retry".into())
                            }
                        };
                        (pack, to, Err(told))
                    })
                    .collect()
            }
        };
        self.answers.answer(told);
        n
    }

    async fn close(self) {
        if let Some(w) = self.conn {
            w.0.close().await;
        }
    }
}

impl DeliveryTables {
    /// Writes a batch atomically (see `write_records`). On PostgreSQL the batch is one
    /// statement in its own transaction: one round trip, committed when it answers.
    /// `notes` are the records' decision log entries (none when the log is off), by index.
    pub async fn insert_batch(
        &self,
        rs: &mut [Record],
        notes: &[Option<Note>],
    ) -> Result<Vec<Stored>> {
        match self.engine() {
            Engine::Postgres => write_records(&self.db, self, Some(Retry), rs, notes).await,
            Engine::Sqlite => {
                let w = self.begin_write().await?;
                let stored = write_records(&w.txn, self, None, rs, notes).await?;
                w.commit().await?;
                Ok(stored)
            }
        }
    }
}

/// Writes records, stamping each one's receive time and id: in the caller's transaction, or
/// on PostgreSQL also as one statement of its own. Records whose (pack, trigger id) is already
/// stored, or repeated earlier in the batch, are not inserted and come back as the first
/// record (or as a conflict when that was a different trigger). The first records are looked
/// up only when the insert skipped a row. Each record inserted whose note (by index in
/// `notes`) is given has its decision log entry written with it: on PostgreSQL in the same
/// statement, on SQLite in the caller's transaction.
pub(crate) async fn write_records(
    db: &impl ConnectionTrait,
    store: &Store,
    retry: Option<Retry>,
    rs: &mut [Record],
    notes: &[Option<Note>],
) -> Result<Vec<Stored>> {
    let engine = store.engine();
    if rs.is_empty() {
        return Ok(Vec::new());
    }
    for r in rs.iter_mut() {
        super::stamp(r);
    }
    let inserted = match engine {
        Engine::Postgres => insert_postgres(db, store, retry, rs, notes).await?,
        Engine::Sqlite => insert_sqlite(db, rs).await?,
    };
    // None: every row was inserted and nothing was looked up.
    let firsts = if inserted == rs.len() as u64 {
        None
    } else {
        Some(firsts(db, engine, rs).await?)
    };
    if let (Engine::Postgres, Some(firsts)) = (engine, &firsts) {
        forget_orphans(db, rs, firsts).await?;
    }
    let stored = stored_as(rs, firsts.as_deref())?;
    if engine == Engine::Sqlite && notes.iter().any(Option::is_some) {
        super::decisions::insert_sqlite(db, &logged(rs, notes, &stored)).await?;
    }
    Ok(stored)
}

/// The decision log's entries of the records of a batch that were inserted and carry a note
/// (by index in `notes`), each at its record's receive time.
pub(super) fn logged(
    rs: &[Record],
    notes: &[Option<Note>],
    stored: &[Stored],
) -> Vec<crate::domain::decision_log::Entry> {
    rs.iter()
        .zip(notes)
        .zip(stored)
        .filter_map(|((r, note), s)| match (note, s) {
            (Some(n), Stored::Inserted { .. }) => Some(n.entry(r, r.received_time)),
            _ => None,
        })
        .collect()
}

/// What became of each record of a batch, from the first records of the trigger ids the
/// insert skipped (`None`: it skipped none).
pub(super) fn stored_as(rs: &[Record], firsts: Option<&[FirstRecord]>) -> Result<Vec<Stored>> {
    rs.iter()
        .map(|r| {
            let inserted = Stored::Inserted {
                record_id: r.record_id.clone(),
            };
            let (Some(t), Some(firsts)) = (r.trigger_id.as_deref(), firsts) else {
                return Ok(inserted);
            };
            match firsts
                .iter()
                .find(|f| f.pack_id == r.pack_id && f.producer_trigger_id == t)
            {
                Some(f) if f.record_id == r.record_id => Ok(inserted),
                Some(f) if !f.retried_by(r) => Ok(Stored::Conflict),
                Some(f) => Ok(Stored::Duplicate {
                    record_id: f.record_id.clone(),
                    route: Route::parse(&f.route)
                        .ok_or_else(|| Error::internal("bad stored route"))?,
                }),
                // The first record went (retention, or its partition dropped) between the
                // insert and the lookup; its ledger row was forgotten above, so a retry records.
                None => Err(Error::Unavailable(
                    "the trigger's first record was removed as it was looked up; retry".into(),
                )),
            }
        })
        .collect()
}

/// Whether a write stands alone, so that it may be written again after a missing partition
/// is made; within a caller's transaction it may not (the transaction is spent).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Retry;

/// A record as the PostgreSQL insert reads it from the batch's JSON.
#[derive(serde::Serialize)]
struct Row<'a> {
    record_id: &'a str,
    principal: &'a str,
    binding_id: &'a str,
    land: &'a str,
    pack_id: &'a str,
    r#ref: &'a str,
    payload: String,
    route: &'a str,
    project: Option<&'a str>,
    producer_trigger_id: Option<&'a str>,
    received_time: i64,
    /// The decision log's note, when the record has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    source: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    trace_id: Option<&'a str>,
}

/// One statement, one round trip; returns how many rows it inserted. Rows go in (pack,
/// trigger id) order, so concurrent writers take the ledger's key locks in one order and never
/// deadlock on them; a trigger id repeated in the batch is sent once (its first record), as
/// one statement may claim a ledger key only once. A row that finds no partition (none was
/// made ahead for the database's clock) has it made, and the batch is written again.
async fn insert_postgres(
    db: &impl ConnectionTrait,
    store: &Store,
    retry: Option<Retry>,
    rs: &[Record],
    notes: &[Option<Note>],
) -> Result<u64> {
    let mut order: Vec<(&Record, Option<&Note>)> = rs
        .iter()
        .enumerate()
        .map(|(i, r)| (r, notes.get(i).and_then(Option::as_ref)))
        .collect();
    order.sort_by(|(a, _), (b, _)| (&a.pack_id, &a.trigger_id).cmp(&(&b.pack_id, &b.trigger_id)));
    order.dedup_by(|(b, _), (a, _)| {
        a.trigger_id.is_some() && (&a.pack_id, &a.trigger_id) == (&b.pack_id, &b.trigger_id)
    });
    let logged = order.iter().any(|(_, n)| n.is_some());
    let rows: Vec<Row<'_>> = order
        .iter()
        .map(|&(r, note)| Row {
            record_id: &r.record_id,
            principal: &r.principal,
            binding_id: &r.binding_id,
            land: &r.land,
            pack_id: &r.pack_id,
            r#ref: &r.r#ref,
            payload: payload_text(r),
            route: r.route.as_str(),
            project: r.project.as_deref(),
            producer_trigger_id: r.trigger_id.as_deref(),
            received_time: r.received_time,
            source: note.map(|n| n.source.as_str()),
            trace_id: note.and_then(|n| n.trace_id.as_deref()),
        })
        .collect();
    let batch =
        serde_json::to_string(&rows).map_err(|e| Error::internal_from("batch not encoded", e))?;
    let insert = || async {
        if retry.is_some() {
            return insert_on_pool(store, logged, &batch).await;
        }
        let statement = |sql: &str| {
            Statement::from_sql_and_values(DbBackend::Postgres, sql, [batch.clone().into()])
        };
        if !logged {
            return db
                .execute_raw(statement(INSERT_POSTGRES))
                .await
                .map(|d| d.rows_affected());
        }
        let row = db.query_one_raw(statement(INSERT_POSTGRES_LOGGED)).await?;
        let n: i64 = match row {
            Some(r) => r.try_get("", "n")?,
            None => 0,
        };
        Ok(u64::try_from(n).unwrap_or(0))
    };
    let done = match insert().await {
        Err(e) if super::sqlstate(&e).as_deref() == Some(super::partitions::NO_PARTITION) => {
            store.repair_partition().await?;
            if retry.is_none() {
                // The caller's transaction is spent; it is retried whole.
                return Err(Error::Unavailable(
                    "no records partition for now had been made; it is now: retry".into(),
                ));
            }
            insert().await
        }
        done => done,
    }
    .map_err(classify)?;
    Ok(done)
}

/// The batch's one statement on the store's pool (a write that stands alone, `Retry`, is
/// only ever given the store's own pool), through sqlx itself rather than sea-orm: sea-orm's
/// query future holds the states of every backend it may run on and is copied whole as it is
/// awaited, which under callgrind cost more instructions of `memcpy` than the statement's own
/// work (see `DeliveryTables::record_for_trigger_partitioned`).
async fn insert_on_pool(
    store: &Store,
    logged: bool,
    batch: &str,
) -> std::result::Result<u64, sea_orm::DbErr> {
    use sea_orm::sqlx::{self, Row};
    let pool = store.db.get_postgres_connection_pool();
    let as_db = |e| sea_orm::DbErr::Exec(sea_orm::RuntimeErr::SqlxError(Arc::new(e)));
    if !logged {
        return sqlx::query(INSERT_POSTGRES)
            .bind(batch)
            .execute(pool)
            .await
            .map(|d| d.rows_affected())
            .map_err(as_db);
    }
    let row = sqlx::query(INSERT_POSTGRES_LOGGED)
        .bind(batch)
        .fetch_optional(pool)
        .await
        .map_err(as_db)?;
    let n: i64 = match row {
        Some(r) => r.try_get("n").map_err(as_db)?,
        None => 0,
    };
    Ok(u64::try_from(n).unwrap_or(0))
}

/// SQLite: its one writer takes `seq` numbers from a counter inside the transaction, then
/// inserts with bound values in chunks of power-of-two sizes, so a handful of prepared
/// statements serve every batch size.
async fn insert_sqlite(txn: &impl ConnectionTrait, rs: &[Record]) -> Result<u64> {
    let n = rs.len() as i64;
    let row = txn
        .query_one_raw(Statement::from_sql_and_values(
            DbBackend::Sqlite,
            "UPDATE record_sequence SET next = next + ? WHERE name = 'records' RETURNING next",
            [n.into()],
        ))
        .await
        .map_err(classify)?
        .ok_or_else(|| Error::internal("the record sequence is missing"))?;
    let next: i64 = row.try_get("", "next").map_err(classify)?;
    let mut seq = next - n;
    let mut inserted = 0;
    let mut rest = rs;
    while !rest.is_empty() {
        let inserts = sqlite_inserts();
        let take = inserts.chunk(rest.len());
        let (chunk, tail) = rest.split_at(take);
        rest = tail;
        let values = sqlite_values(chunk, &mut seq);
        let done = txn
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Sqlite,
                inserts.statement(take),
                values,
            ))
            .await
            .map_err(classify)?;
        inserted += done.rows_affected();
    }
    Ok(inserted)
}

/// A record's values in the order of `sqlite_inserts`' columns, borrowed from it, `payload`
/// its JSON text (`payload_text`) and `seq` its number: the writer's connection binds them as
/// they are (`sqlite_writer`).
pub(super) fn sqlite_row<'a>(
    r: &'a Record,
    payload: &'a str,
    seq: i64,
) -> [rusqlite::types::ValueRef<'a>; 12] {
    use rusqlite::types::ValueRef as V;
    fn text(s: &str) -> V<'_> {
        V::Text(s.as_bytes())
    }
    [
        text(&r.record_id),
        text(&r.principal),
        text(&r.binding_id),
        text(&r.land),
        text(&r.pack_id),
        text(&r.r#ref),
        text(payload),
        text(r.route.as_str()),
        r.project.as_deref().map_or(V::Null, text),
        r.trigger_id.as_deref().map_or(V::Null, text),
        V::Integer(r.received_time),
        V::Integer(seq),
    ]
}

/// The values of SQLite's insert of `chunk` through the pool (an in-memory database),
/// numbered from `seq` on: `sqlite_row`'s, owned.
pub(super) fn sqlite_values(chunk: &[Record], seq: &mut i64) -> Vec<sea_orm::Value> {
    let mut values = Vec::with_capacity(chunk.len() * 12);
    for r in chunk {
        let payload = payload_text(r);
        values.extend(sqlite_row(r, &payload, *seq).map(super::owned_value));
        *seq += 1;
    }
    values
}

/// The payload as stored: JSON text.
pub(super) fn payload_text(r: &Record) -> String {
    // A map of JSON values always serializes.
    serde_json::to_string(&r.payload).unwrap_or_default()
}

/// Most rows in one SQLite insert statement (12 values each, well under SQLite's 32,766).
const SQLITE_CHUNK: usize = 256;

/// The SQLite inserts of records, built once.
pub(super) fn sqlite_inserts() -> &'static super::SqliteInserts {
    static INSERTS: std::sync::OnceLock<super::SqliteInserts> = std::sync::OnceLock::new();
    INSERTS.get_or_init(|| {
        super::SqliteInserts::new(
            &format!("INSERT INTO records ({COLUMNS}, seq)"),
            12,
            "ON CONFLICT (pack_id, producer_trigger_id) DO NOTHING",
            SQLITE_CHUNK,
        )
    })
}

/// The first record stored under a (pack, trigger id): what a later record with the same id
/// is answered with, or refused against.
#[derive(Debug, sea_orm::FromQueryResult)]
pub(super) struct FirstRecord {
    pub(super) pack_id: String,
    pub(super) producer_trigger_id: String,
    pub(super) record_id: String,
    pub(super) route: String,
    pub(super) principal: String,
    pub(super) r#ref: String,
    pub(super) land: String,
    /// As stored: JSON text, read only when a batch meets an id already used.
    pub(super) payload: String,
}

impl FirstRecord {
    /// Whether `r`, which reuses this record's trigger id, is a retry of its trigger.
    fn retried_by(&self, r: &Record) -> bool {
        let Ok(payload) =
            serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(&self.payload)
        else {
            return false;
        };
        r.same_trigger(Identity {
            principal: &self.principal,
            r#ref: &self.r#ref,
            land: &self.land,
            payload: &payload,
        })
    }
}

/// PostgreSQL: the ledger rows, of the batch's trigger ids, that name a record gone without
/// them (its partition dropped by hand, or retention's floor not yet past it): deleted, so
/// that the caller's retry records the trigger anew instead of being told to retry for ever.
/// The ledger row and its record commit together, so a row seen without its record is one.
async fn forget_orphans(
    db: &impl ConnectionTrait,
    rs: &[Record],
    firsts: &[FirstRecord],
) -> Result<()> {
    let orphans: Vec<serde_json::Value> = rs
        .iter()
        .filter_map(|r| Some((r.pack_id.as_str(), r.trigger_id.as_deref()?)))
        .filter(|(p, t)| {
            !firsts
                .iter()
                .any(|f| f.pack_id == *p && f.producer_trigger_id == *t)
        })
        .map(|(p, t)| serde_json::json!({ "pack_id": p, "producer_trigger_id": t }))
        .collect();
    if orphans.is_empty() {
        return Ok(());
    }
    let gone = db
        .execute_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "DELETE FROM record_triggers k \
             USING jsonb_to_recordset($1::jsonb) AS q(pack_id text, producer_trigger_id text) \
             WHERE k.pack_id = q.pack_id AND k.producer_trigger_id = q.producer_trigger_id \
               AND NOT EXISTS (SELECT 1 FROM records r \
                               WHERE r.record_id = k.record_id AND r.stored_time = k.stored_time)",
            [serde_json::Value::Array(orphans).into()],
        ))
        .await
        .map_err(classify)?;
    if gone.rows_affected() > 0 {
        tracing::warn!(
            trigger_ids = gone.rows_affected(),
            "trigger ids named records no longer stored; they are forgotten and may be recorded anew"
        );
    }
    Ok(())
}

/// The first records of every record in the batch that carries a trigger id. On PostgreSQL
/// through the ledger, which names each record's partition, so each is one partition's read.
async fn firsts(
    txn: &impl ConnectionTrait,
    engine: Engine,
    rs: &[Record],
) -> Result<Vec<FirstRecord>> {
    use sea_orm::FromQueryResult;
    if engine == Engine::Postgres {
        let keys: Vec<serde_json::Value> = rs
            .iter()
            .filter_map(|r| {
                let t = r.trigger_id.as_deref()?;
                Some(serde_json::json!({ "pack_id": r.pack_id, "producer_trigger_id": t }))
            })
            .collect();
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        return FirstRecord::find_by_statement(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "SELECT q.pack_id, q.producer_trigger_id, r.record_id, r.route, r.principal, r.ref, r.land, r.payload \
             FROM jsonb_to_recordset($1::jsonb) AS q(pack_id text, producer_trigger_id text) \
             JOIN record_triggers k ON k.pack_id = q.pack_id AND k.producer_trigger_id = q.producer_trigger_id \
             JOIN records r ON r.record_id = k.record_id AND r.stored_time = k.stored_time",
            [serde_json::Value::Array(keys).into()],
        ))
        .all(txn)
        .await
        .map_err(classify);
    }
    let Some(statement) = sqlite_firsts(rs) else {
        return Ok(Vec::new());
    };
    FirstRecord::find_by_statement(statement)
        .all(txn)
        .await
        .map_err(classify)
}

/// SQLite: the look-up of the first records of a batch's trigger ids (columns in
/// `FirstRecord`'s order), as both SQLite paths run it; None when no record carries an id.
pub(super) fn sqlite_firsts(rs: &[Record]) -> Option<Statement> {
    use records::Column as C;
    let keys: Vec<(String, String)> = rs
        .iter()
        .filter_map(|r| r.trigger_id.clone().map(|t| (r.pack_id.clone(), t)))
        .collect();
    if keys.is_empty() {
        return None;
    }
    Some(
        records::Entity::find()
            .select_only()
            .columns([
                C::PackId,
                C::ProducerTriggerId,
                C::RecordId,
                C::Route,
                C::Principal,
                C::Ref,
                C::Land,
                C::Payload,
            ])
            .filter(
                Expr::tuple([Expr::col(C::PackId), Expr::col(C::ProducerTriggerId)])
                    .in_tuples(keys),
            )
            .build(DbBackend::Sqlite),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering::SeqCst;
    use std::time::Duration;

    async fn sent(n: usize) -> (Arc<FairQueue<usize>>, Arc<FairQueue<usize>>) {
        let q = Arc::new(FairQueue::new(LANE_BOUND, TOTAL_BOUND));
        for i in 0..n {
            q.push("p", "a", i).await.expect("send");
        }
        (q.clone(), q)
    }

    fn taken(packs: &[(&str, usize)]) -> Vec<Taken<usize>> {
        let mut n = 0;
        let mut batch = Vec::new();
        for (pack, count) in packs {
            for _ in 0..*count {
                batch.push(((*pack).to_owned(), n, Duration::ZERO));
                n += 1;
            }
        }
        batch
    }

    fn items(batch: &[Taken<usize>]) -> Vec<usize> {
        batch.iter().map(|(_, n, _)| *n).collect()
    }

    fn off() -> Pace {
        Pace::new(Duration::ZERO)
    }

    /// A pace of `delay` that has counted `rate` records a second over a window.
    fn paced(delay: Duration, rate: f64) -> Pace {
        Pace {
            rate,
            ..Pace::new(delay)
        }
    }

    /// Takes a batch as a writer would; it must come within 5 s.
    async fn take_soon(
        rx: &FairQueue<usize>,
        committing: &Committing,
        max: usize,
        pace: &mut Pace,
    ) -> Vec<Taken<usize>> {
        let mut batch = Vec::new();
        let taken = tokio::time::timeout(
            Duration::from_secs(5),
            take_batch(rx, committing, max, &mut batch, pace),
        )
        .await;
        assert_eq!(taken.ok(), Some(true), "a batch within 5 s");
        batch
    }

    #[test]
    fn a_writer_lingers_from_half_a_record_due_within_the_delay() {
        let delay = Duration::from_millis(10);
        // 50 a second: 0.5 of a record in 10 ms.
        assert!(paced(delay, 50.0).lingers());
        assert_eq!(paced(delay, 50.0).target(), 2);
        assert!(!paced(delay, 40.0).lingers());
        assert_eq!(paced(delay, 40.0).target(), 1);
        assert!(!paced(Duration::ZERO, 1000000.0).lingers(), "0: never");
        assert!(!Pace::new(delay).lingers(), "no rate counted yet");
        // A window with nothing taken reads the rate as zero again.
        let mut pace = paced(delay, 1000.0);
        let since = pace.since;
        pace.took(0, since + 10 * PACE_WINDOW);
        assert!(!pace.lingers());
    }

    #[tokio::test]
    async fn at_a_steady_rate_a_lone_writer_waits_the_commit_delay_and_commits_what_came() {
        let delay = Duration::from_millis(200);
        let committing = Committing::default();
        let (tx, rx) = sent(1).await;
        let late = tokio::spawn(async move {
            for n in 1..4 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                tx.push("p", "a", n).await.expect("send");
            }
        });
        let started = std::time::Instant::now();
        let mut batch = Vec::new();
        assert!(
            take_batch(
                &rx,
                &committing,
                MAX_BATCH,
                &mut batch,
                &mut paced(delay, 1000.0)
            )
            .await
        );
        let took = started.elapsed();
        late.await.expect("late");
        assert_eq!(items(&batch), vec![0, 1, 2, 3], "one commit for the four");
        assert!(took >= delay, "waited the delay: {took:?}");
        assert!(took < delay * 5, "and not much more: {took:?}");
        // Without a delay the same rate commits the first record alone, at once.
        let (tx, rx) = sent(1).await;
        let mut batch = Vec::new();
        assert!(take_batch(&rx, &committing, MAX_BATCH, &mut batch, &mut off()).await);
        assert_eq!(items(&batch), vec![0]);
        drop(tx);
    }

    #[tokio::test]
    async fn a_lingering_writer_commits_once_it_holds_the_records_due_within_the_delay() {
        // 0.2 a second over 10 s: two records due, so a batch waits for three.
        let mut pace = paced(Duration::from_secs(10), 0.2);
        assert_eq!(pace.target(), 3);
        let committing = Committing::default();
        let (tx, rx) = sent(1).await;
        let late = tokio::spawn(async move {
            for n in 1..3 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                tx.push("p", "a", n).await.expect("send");
            }
            tx
        });
        let batch = take_soon(&rx, &committing, MAX_BATCH, &mut pace).await;
        assert_eq!(items(&batch), vec![0, 1, 2]);
        late.await.expect("late");
    }

    #[tokio::test]
    async fn a_lingering_writer_commits_once_it_holds_engage_records() {
        let committing = Committing::default();
        let (tx, rx) = sent(ENGAGE - 1).await;
        let last = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            tx.push("p", "a", ENGAGE - 1).await.expect("send");
        });
        let mut pace = paced(Duration::from_secs(30), 1000.0);
        let batch = take_soon(&rx, &committing, MAX_BATCH, &mut pace).await;
        assert_eq!(batch.len(), ENGAGE);
        last.await.expect("last");
    }

    #[tokio::test]
    async fn a_rate_counted_before_a_quiet_spell_is_read_again_before_a_wait() {
        // 1,000 a second counted, then a second with nothing taken.
        let mut pace = paced(Duration::from_secs(30), 1000.0);
        pace.since = std::time::Instant::now() - 10 * PACE_WINDOW;
        assert!(pace.lingers(), "the rate as last counted");
        let (_tx, rx) = sent(1).await;
        let batch = take_soon(&rx, &Committing::default(), MAX_BATCH, &mut pace).await;
        assert_eq!(items(&batch), vec![0], "committed at once");
        assert!(!pace.lingers());
    }

    #[tokio::test]
    async fn a_slow_rate_or_another_commit_under_way_is_not_lingered_for() {
        let delay = Duration::from_secs(30);
        let committing = Committing::default();
        let (_tx, rx) = sent(2).await;
        let batch = take_soon(&rx, &committing, MAX_BATCH, &mut paced(delay, 0.0)).await;
        assert_eq!(batch.len(), 2);
        // Beside another writer's commit the ENGAGE rule applies, not the delay: it goes when
        // that commit ends.
        let committing = Arc::new(Committing::default());
        committing.batches.store(1, SeqCst);
        let (_tx, rx) = sent(2).await;
        let other = committing.clone();
        let end = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            other.batches.fetch_sub(1, SeqCst);
            other.done.notify_waiters();
        });
        let batch = take_soon(&rx, &committing, MAX_BATCH, &mut paced(delay, 1000.0)).await;
        assert_eq!(batch.len(), 2);
        end.await.expect("end");
    }

    #[test]
    fn the_light_packs_of_a_backlogs_batch_are_committed_first_and_each_pack_goes_one_way() {
        // A flood's HEAVY records, one quiet pack's record among them, two of another's.
        let mut batch = taken(&[("flood", 20), ("quiet", 1), ("flood", 12), ("two", LIGHT)]);
        batch.swap(5, 20);
        let (first, rest) = light_first(batch);
        let packs = |b: &[Taken<usize>]| b.iter().map(|(p, _, _)| p.clone()).collect::<Vec<_>>();
        assert_eq!(packs(&first), vec!["quiet", "two", "two"]);
        assert_eq!(items(&first), vec![20, 33, 34]);
        assert!(rest.iter().all(|(p, _, _)| p == "flood"));
        // The rest keeps its order: the flood's as they were taken, 5 where the quiet one was.
        let mut order: Vec<usize> = (0..20).chain(21..33).collect();
        order.remove(5);
        order.insert(19, 5);
        assert_eq!(items(&rest), order);
    }

    #[test]
    fn nothing_is_split_below_the_bounds() {
        // A pack with LIGHT + 1 records is not light.
        let (first, rest) = light_first(taken(&[("flood", 40), ("three", LIGHT + 1)]));
        assert!(first.is_empty());
        assert_eq!(items(&rest), (0..40 + LIGHT + 1).collect::<Vec<_>>());
        // The rest one short of HEAVY: one commit, in order.
        let (first, rest) = light_first(taken(&[("flood", HEAVY - 1), ("quiet", 1)]));
        assert!(first.is_empty());
        assert_eq!(rest.len(), HEAVY);
        // Exactly HEAVY: split.
        let (first, rest) = light_first(taken(&[("flood", HEAVY), ("quiet", 1)]));
        assert_eq!((first.len(), rest.len()), (1, HEAVY));
        // Every pack light (many quiet packs, no backlog): one commit.
        let many: Vec<(String, usize)> = (0..64).map(|p| (format!("p{p}"), 1)).collect();
        let many: Vec<(&str, usize)> = many.iter().map(|(p, n)| (p.as_str(), *n)).collect();
        let (first, rest) = light_first(taken(&many));
        assert!(first.is_empty());
        assert_eq!(rest.len(), 64);
    }

    #[tokio::test]
    async fn a_lone_writer_takes_what_is_queued_at_once_up_to_max_batch() {
        let committing = Committing::default();
        let (_tx, rx) = sent(1).await;
        let mut batch = Vec::new();
        assert!(take_batch(&rx, &committing, SHARED_BATCH, &mut batch, &mut off()).await);
        assert_eq!(batch.len(), 1);
        let (_tx, rx) = sent(MAX_BATCH + 1).await;
        let mut batch = Vec::new();
        assert!(take_batch(&rx, &committing, SHARED_BATCH, &mut batch, &mut off()).await);
        assert_eq!(batch.len(), MAX_BATCH);
    }

    #[tokio::test]
    async fn while_packs_share_the_writer_batches_are_short() {
        let committing = Committing::default();
        let (_tx, rx) = sent(MAX_BATCH).await;
        rx.push("quiet", "b", 0).await.expect("send");
        let mut batch = Vec::new();
        assert!(take_batch(&rx, &committing, SHARED_BATCH, &mut batch, &mut off()).await);
        assert_eq!(batch.len(), SHARED_BATCH, "two packs queued: a short batch");
        assert!(
            batch.iter().any(|(pack, _, _)| pack == "quiet"),
            "in its turn"
        );
        // Only the flood is left, but it shared the writer a moment ago: still short.
        let mut batch = Vec::new();
        assert!(take_batch(&rx, &committing, SHARED_BATCH, &mut batch, &mut off()).await);
        assert_eq!(batch.len(), SHARED_BATCH);
    }

    #[tokio::test]
    async fn a_sparse_packs_record_beside_a_backlog_is_a_batch_of_its_own_at_once() {
        let committing = Committing::default();
        let (_tx, rx) = sent(2 * MAX_BATCH).await;
        let mut batch = Vec::new();
        assert!(take_batch(&rx, &committing, MAX_BATCH, &mut batch, &mut off()).await);
        assert_eq!(batch.len(), MAX_BATCH, "one pack alone: the whole batch");
        // The flood is a backlog now; two quiet packs' records arrive while another writer's
        // batch commits: they go at once, alone, without waiting for ENGAGE records.
        committing.batches.store(1, SeqCst);
        rx.push("quiet", "b", 7).await.expect("send");
        rx.push("calm", "c", 8).await.expect("send");
        rx.push("quiet", "b", 9).await.expect("send");
        let mut batch = Vec::new();
        let taken = tokio::time::timeout(
            Duration::from_millis(100),
            take_batch(&rx, &committing, MAX_BATCH, &mut batch, &mut off()),
        )
        .await;
        assert_eq!(taken.ok(), Some(true));
        let got: Vec<(&str, usize)> = batch.iter().map(|(p, n, _)| (p.as_str(), *n)).collect();
        assert_eq!(
            got,
            vec![("quiet", 7), ("calm", 8)],
            "one turn each, no flood"
        );
        // Their next records wait their turn with the backlog's.
        committing.batches.store(0, SeqCst);
        let mut batch = Vec::new();
        assert!(take_batch(&rx, &committing, MAX_BATCH, &mut batch, &mut off()).await);
        assert_eq!(batch.len(), MAX_BATCH);
        let firsts: Vec<(&str, usize)> = batch
            .iter()
            .take(3)
            .map(|(p, n, _)| (p.as_str(), *n))
            .collect();
        assert_eq!(
            firsts,
            vec![("p", MAX_BATCH), ("quiet", 9), ("p", MAX_BATCH + 1)]
        );
    }

    #[tokio::test]
    async fn a_lone_pack_draining_and_refilling_is_never_split_from_itself() {
        let committing = Committing::default();
        let (tx, rx) = sent(2).await;
        let mut batch = Vec::new();
        assert!(take_batch(&rx, &committing, MAX_BATCH, &mut batch, &mut off()).await);
        assert_eq!(batch.len(), 2);
        // Sparse again, but with no backlog beside it: an ordinary batch of all it holds.
        for n in 0..5 {
            tx.push("p", "a", n).await.expect("send");
        }
        let mut batch = Vec::new();
        assert!(take_batch(&rx, &committing, MAX_BATCH, &mut batch, &mut off()).await);
        assert_eq!(batch.len(), 5);
    }

    #[tokio::test]
    async fn beside_a_commit_a_writer_waits_for_engage_records() {
        let committing = Committing::default();
        committing.batches.store(1, SeqCst);
        let (tx, rx) = sent(ENGAGE - 1).await;
        let mut batch = Vec::new();
        let taken = tokio::time::timeout(
            Duration::from_millis(100),
            take_batch(&rx, &committing, SHARED_BATCH, &mut batch, &mut off()),
        )
        .await;
        assert!(taken.is_err(), "{} records do not engage", ENGAGE - 1);
        assert_eq!(batch.len(), ENGAGE - 1);
        // One more engages it: the 64th record arrives while the other commit still runs.
        tx.push("p", "a", ENGAGE).await.expect("send");
        let taken = tokio::time::timeout(
            Duration::from_millis(100),
            take_batch(&rx, &committing, SHARED_BATCH, &mut batch, &mut off()),
        )
        .await;
        assert_eq!(taken.ok(), Some(true));
        assert_eq!(batch.len(), ENGAGE);
    }

    #[tokio::test]
    async fn a_waiting_writer_goes_when_the_other_commit_ends() {
        let committing = Arc::new(Committing::default());
        committing.batches.store(1, SeqCst);
        let (_tx, rx) = sent(3).await;
        let other = committing.clone();
        let end = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            other.batches.fetch_sub(1, SeqCst);
            other.done.notify_waiters();
        });
        let batch = take_soon(&rx, &committing, SHARED_BATCH, &mut off()).await;
        assert_eq!(batch.len(), 3);
        end.await.expect("end");
    }

    use crate::store::sqlite_file;

    /// The first records of a batch's trigger ids are read through the trigger-id index, one
    /// search per id: this look-up runs inside the writer's transaction whenever a batch meets
    /// an id stored before, and a scan of every record there would hold every writer behind it.
    #[tokio::test]
    async fn on_sqlite_a_batchs_first_records_are_searched_by_the_trigger_id_index() {
        let (_dir, store, path) = sqlite_file().await;
        store.close().await;
        let keyed: Vec<Record> = (0..3)
            .map(|n| Record {
                trigger_id: Some(format!("t-{n}")),
                ..rec("p", n)
            })
            .collect();
        let statement = sqlite_firsts(&keyed).expect("a look-up for records with ids");
        let conn = rusqlite::Connection::open(&path).expect("the file");
        let values = statement.values.map(|v| v.0).unwrap_or_default();
        assert_eq!(values.len(), 6, "two values for each of three ids");
        let params: Vec<String> = values
            .into_iter()
            .map(|v| match v {
                sea_orm::Value::String(Some(s)) => s,
                other => panic!("a text value, not {other:?}"),
            })
            .collect();
        let mut plan = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {}", statement.sql))
            .expect("the plan");
        let steps: Vec<String> = plan
            .query_map(rusqlite::params_from_iter(params), |row| {
                row.get::<_, String>(3)
            })
            .expect("its steps")
            .collect::<std::result::Result<_, _>>()
            .expect("each step");
        assert!(
            steps
                .iter()
                .any(|s| s.contains("records USING INDEX uq_records_producer_trigger")),
            "{steps:?}"
        );
        assert!(
            !steps.iter().any(|s| s.trim() == "SCAN records"),
            "a scan of every record: {steps:?}"
        );
    }

    /// A record of `pack`, `n` in its payload.
    fn rec(pack: &str, n: usize) -> Record {
        Record {
            record_id: String::new(),
            principal: "u".into(),
            binding_id: "b".into(),
            land: "inbox".into(),
            pack_id: pack.into(),
            r#ref: "r".into(),
            payload: serde_json::json!({ "n": n })
                .as_object()
                .cloned()
                .unwrap_or_default(),
            route: Route::Inbox,
            project: None,
            trigger_id: None,
            received_time: 0,
            position: Default::default(),
        }
    }

    /// The records of the file in commit order (`seq`): pack, `n`, seq.
    fn committed(path: &std::path::Path) -> Vec<(String, i64, i64)> {
        let c = rusqlite::Connection::open(path).expect("open");
        let mut s = c
            .prepare("SELECT pack_id, json_extract(payload, '$.n'), seq FROM records ORDER BY seq")
            .expect("prepare");
        let rows = s
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .expect("query");
        rows.map(|r| r.expect("row")).collect()
    }

    fn next_seq(path: &std::path::Path) -> i64 {
        rusqlite::Connection::open(path)
            .expect("open")
            .query_row(
                "SELECT next FROM record_sequence WHERE name = 'records'",
                [],
                |r| r.get(0),
            )
            .expect("the sequence")
    }

    #[tokio::test]
    async fn a_sqlite_batch_cut_commits_the_rows_before_it_and_gives_back_the_rest_numbers() {
        let (_dir, store, path) = sqlite_file().await;
        let mut w = SqliteWriter::open(store.config.url.expose_secret())
            .expect("open")
            .expect("a file");
        let start = next_seq(&path);
        // At the boundary: CUT_EVERY rows are one statement, never cut.
        let mut rs: Vec<Record> = (0..CUT_EVERY).map(|n| rec("flood", n)).collect();
        let notes = vec![None; rs.len()];
        let mut always = || true;
        let stored = w
            .write(&mut rs, &notes, Some(&mut always))
            .expect("written");
        assert_eq!(stored.len(), CUT_EVERY);
        // One more is cut after the first CUT_EVERY: those commit, the last is left.
        let mut rs: Vec<Record> = (0..=CUT_EVERY).map(|n| rec("more", n)).collect();
        let notes = vec![None; rs.len()];
        let stored = w
            .write(&mut rs, &notes, Some(&mut always))
            .expect("written");
        assert_eq!(stored.len(), CUT_EVERY);
        for (s, r) in stored.iter().zip(&rs) {
            assert_eq!(
                s,
                &Stored::Inserted {
                    record_id: r.record_id.clone()
                }
            );
        }
        // A cut never asked for is not made.
        let mut never = || false;
        let mut rs: Vec<Record> = (0..3 * CUT_EVERY).map(|n| rec("whole", n)).collect();
        let notes = vec![None; rs.len()];
        let stored = w.write(&mut rs, &notes, Some(&mut never)).expect("written");
        assert_eq!(stored.len(), 3 * CUT_EVERY);
        let rows = committed(&path);
        assert_eq!(rows.len(), 5 * CUT_EVERY);
        let seqs: Vec<i64> = rows.iter().map(|(_, _, s)| *s).collect();
        let want: Vec<i64> = (start..start + 5 * CUT_EVERY as i64).collect();
        assert_eq!(seqs, want, "no number lost to the row left out");
        assert_eq!(next_seq(&path), start + 5 * CUT_EVERY as i64);
        assert!(!rows
            .iter()
            .any(|(p, n, _)| p == "more" && *n == CUT_EVERY as i64));
    }

    #[tokio::test]
    async fn on_sqlite_a_quiet_packs_record_cuts_a_floods_batch_and_commits_between_its_parts() {
        let (_dir, store, path) = sqlite_file().await;
        let queue = FairQueue::<Job>::new(LANE_BOUND, TOTAL_BOUND);
        /// Queues a record of `pack` (`n` in its payload); where its answer comes.
        async fn queued(
            queue: &FairQueue<Job>,
            pack: &str,
            n: usize,
        ) -> oneshot::Receiver<Reply<Result<Written>>> {
            let (done, answer) = oneshot::channel();
            let job = Job {
                record: rec(pack, n),
                note: None,
                done,
            };
            queue.push(pack, "u", job).await.expect("queued");
            answer
        }
        let mut writer = Writer::open(
            &store,
            Arc::new(Metrics::new(16)),
            Resume::new(super::super::resume::WINDOW),
            Duration::from_secs(5),
        )
        .await;
        let mut answers = Vec::new();
        /// The flood's records `ns` taken as one batch, then `late` queued as it is written.
        async fn flood_and_late(
            queue: &FairQueue<Job>,
            writer: &mut Writer<'_>,
            answers: &mut Vec<oneshot::Receiver<Reply<Result<Written>>>>,
            ns: std::ops::Range<usize>,
            (pack, n): (&str, usize),
        ) {
            for n in ns {
                answers.push(queued(queue, "flood", n).await);
            }
            let mut batch = Vec::new();
            queue.try_take(&mut batch, MAX_BATCH);
            answers.push(queued(queue, pack, n).await);
            writer.commit(batch, queue).await;
        }
        // The flood's own next record, queued while its batch is written, cuts nothing.
        flood_and_late(&queue, &mut writer, &mut answers, 0..100, ("flood", 100)).await;
        let rows = committed(&path);
        assert_eq!(
            rows.len(),
            100,
            "the batch whole, its pack's next record left queued"
        );
        assert_eq!(queue.queued("flood"), 1);
        let mut batch = Vec::new();
        queue.try_take(&mut batch, MAX_BATCH);
        writer.commit(batch, &queue).await;
        // A quiet pack's record comes while the next batch is written: the batch is cut after
        // its first CUT_EVERY rows and the quiet record commits before the rest.
        flood_and_late(&queue, &mut writer, &mut answers, 101..201, ("quiet", 0)).await;
        for a in answers {
            let (written, ticket) = tokio::time::timeout(Duration::from_secs(5), a)
                .await
                .expect("answered")
                .expect("an answer");
            drop(ticket);
            assert!(matches!(
                written,
                Ok(Written {
                    stored: Stored::Inserted { .. },
                    ..
                })
            ));
        }
        let rows = committed(&path);
        let order: Vec<(&str, i64)> = rows.iter().map(|(p, n, _)| (p.as_str(), *n)).collect();
        let mut want: Vec<(&str, i64)> = (0..=100).map(|n| ("flood", n)).collect();
        want.extend((101..101 + CUT_EVERY as i64).map(|n| ("flood", n)));
        want.push(("quiet", 0));
        want.extend((101 + CUT_EVERY as i64..201).map(|n| ("flood", n)));
        assert_eq!(order, want);
        let seqs: Vec<i64> = rows.iter().map(|(_, _, s)| *s).collect();
        assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
        writer.close().await;
    }

    #[tokio::test]
    async fn a_closed_queue_ends_the_writer_after_its_last_batch() {
        let committing = Committing::default();
        let (tx, rx) = sent(2).await;
        tx.close();
        let mut batch = Vec::new();
        assert!(take_batch(&rx, &committing, SHARED_BATCH, &mut batch, &mut off()).await);
        assert_eq!(batch.len(), 2);
        let mut batch = Vec::new();
        assert!(!take_batch(&rx, &committing, SHARED_BATCH, &mut batch, &mut off()).await);
        assert!(batch.is_empty());
    }
}
