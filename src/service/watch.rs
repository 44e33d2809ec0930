//! WatchRecords: one tail per replica reads committed records by position into a bounded ring, and every watcher is fed from it after catching up from the store.
//!
//! The tail is woken by this process's commits, by other replicas' announcements (PostgreSQL
//! NOTIFY) and by a fallback timer, and always reads the store by position: a wake-up says
//! only "read again". Its ring keeps the last `max_behind` records of every principal; a
//! watcher whose position falls out of the ring is more than `max_behind` records behind and
//! is ended with its position, from which a new watch resumes with nothing lost.
use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};

use super::Records;
use crate::domain::model::{Erasure, Position, Record, RecordFilter};
use crate::domain::trigger::BRAIN;
use crate::error::{Error, Interruption, Result};

/// Records the tail reads from the store at once.
const TAIL_READ: u64 = 512;
/// Records one catch-up read takes from the store.
const CATCH_UP_READ: u64 = 256;
/// Most records in one message to a watcher.
pub const MAX_PER_MESSAGE: usize = 100;
/// The tail reads at least this often, whatever woke it or did not.
const FALLBACK_READ: Duration = Duration::from_secs(1);
/// The pause before the tail reads again after the store failed it.
const RETRY: Duration = Duration::from_millis(200);
/// Longest a read of the store may take before the watches relying on it are ended: a store
/// gone silent (a partition) never says so by itself.
const STORE_READ_TIMEOUT: Duration = Duration::from_secs(3);
/// Least time between two announcements of local commits to other replicas.
const ANNOUNCE_EVERY: Duration = Duration::from_millis(20);
/// Least time between two reads of the tail: under a stream of commits, one read per gap.
const MIN_READ_GAP: Duration = Duration::from_millis(1);
/// Longest a new watch waits for the tail's first read of the store.
const TAIL_START_WAIT: Duration = Duration::from_secs(10);

/// Bounds on watchers.
#[derive(Debug, Clone, Copy)]
pub struct WatchLimits {
    /// Records (of any principal) a watcher may be behind the tail before it is ended.
    pub max_behind: usize,
    /// Longest a watcher may go without catching up with the tail before it is ended.
    pub max_lag: Duration,
    /// A watcher with nothing to send gets a progress message this often.
    pub progress_every: Duration,
    /// Most watches open at once on this replica.
    pub max_watchers: usize,
}

impl Default for WatchLimits {
    fn default() -> Self {
        WatchLimits {
            max_behind: 10_000,
            max_lag: Duration::from_secs(30),
            progress_every: Duration::from_secs(10),
            max_watchers: 10_000,
        }
    }
}

/// What a watcher hands its caller.
#[derive(Debug)]
pub enum WatchEvent {
    /// Records in position order (none: progress), and the position everything sent reaches.
    Sent {
        records: Vec<Arc<Record>>,
        position: Position,
    },
    /// The watch ends; resume from `position`.
    Ended {
        cause: Interruption,
        why: String,
        position: Position,
    },
}

/// The tail's state that watchers wait on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TailStatus {
    /// Every record at or below this position has been read into the ring (or out of it).
    watermark: Position,
    state: TailState,
    /// Counts the times the ring was started afresh; a watcher that joined an earlier one
    /// catches up from the store again.
    epoch: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TailState {
    /// No watches open: the tail reads nothing. The first watch moves it to `Reading`,
    /// starting the ring afresh at the store's position then.
    Idle,
    Reading,
    /// The store failed its last read.
    Failing,
    /// The server is shutting down.
    Stopped,
}

#[derive(Debug, Default)]
struct Ring {
    records: VecDeque<Arc<Record>>,
    /// The position of the last record that left the ring (or where the tail started).
    evicted_upto: Position,
    /// Erasures whose position the tail has not read past yet.
    erased: Vec<Erasure>,
}

/// One per replica: the ring and the status watchers follow.
#[derive(Debug)]
pub struct Tail {
    ring: Mutex<Ring>,
    status: watch::Sender<TailStatus>,
    limits: WatchLimits,
    watchers: AtomicUsize,
    /// Woken when a watch opens, so an idle tail starts at once.
    opened: tokio::sync::Notify,
    /// Erasures of the last `keep_erasures()`, checked as messages go out.
    recent: Mutex<Vec<(Instant, Erasure)>>,
    recent_count: AtomicUsize,
}

impl Tail {
    pub fn new(limits: WatchLimits) -> Tail {
        Tail {
            ring: Mutex::default(),
            status: watch::channel(TailStatus {
                watermark: Position::default(),
                state: TailState::Idle,
                epoch: 0,
            })
            .0,
            limits,
            watchers: AtomicUsize::new(0),
            opened: tokio::sync::Notify::new(),
            recent: Mutex::default(),
            recent_count: AtomicUsize::new(0),
        }
    }

    fn ring(&self) -> MutexGuard<'_, Ring> {
        // Every update of the ring is a few statements that cannot panic half-way.
        self.ring
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set(&self, f: impl FnOnce(&mut TailStatus)) {
        self.status.send_if_modified(|s| {
            let before = *s;
            f(s);
            *s != before
        });
    }

    /// Adds records read from the store, evicting the oldest past `max_behind`.
    fn push(&self, records: Vec<Record>, reach: Position) {
        {
            let mut ring = self.ring();
            for r in records {
                if !ring.erased.iter().any(|e| e.covers(&r)) {
                    ring.records.push_back(Arc::new(r));
                }
            }
            // Past an erasure's position the store holds none of its records to read.
            ring.erased.retain(|e| e.upto() > reach);
            while ring.records.len() > self.limits.max_behind {
                if let Some(old) = ring.records.pop_front() {
                    ring.evicted_upto = old.position;
                }
            }
        }
        self.set(|s| {
            s.watermark = s.watermark.max(reach);
            if s.state != TailState::Stopped {
                s.state = TailState::Reading;
            }
        });
    }

    /// Takes erased records out of the ring, and keeps each erasure to hold back its records
    /// from reads still in flight until the tail has read past it.
    pub(super) fn erase(&self, erasures: Vec<Erasure>) {
        if erasures.is_empty() {
            return;
        }
        {
            let mut recent = self.recent();
            let now = Instant::now();
            recent.retain(|(at, _)| now.duration_since(*at) < self.keep_erasures());
            recent.extend(erasures.iter().map(|e| (now, e.clone())));
            self.recent_count.store(recent.len(), Ordering::Release);
        }
        let mut ring = self.ring();
        ring.records
            .retain(|r| !erasures.iter().any(|e| e.covers(r)));
        ring.erased.extend(erasures);
    }

    /// How long an erasure is checked at send time: longer than a watcher may hold records
    /// it took before the erasure (a send waits at most `max_lag`; a catch-up read, less).
    fn keep_erasures(&self) -> Duration {
        self.limits.max_lag * 2 + Duration::from_secs(10)
    }

    fn recent(&self) -> MutexGuard<'_, Vec<(Instant, Erasure)>> {
        self.recent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a record a watcher is about to send was erased since it was read: checked as
    /// the message goes out, so records taken from the ring or the store before an erasure
    /// are not sent after it.
    fn erased(&self, r: &Record) -> bool {
        if self.recent_count.load(Ordering::Acquire) == 0 {
            return false;
        }
        let mut recent = self.recent();
        let now = Instant::now();
        recent.retain(|(at, _)| now.duration_since(*at) < self.keep_erasures());
        self.recent_count.store(recent.len(), Ordering::Release);
        recent.iter().any(|(_, e)| e.covers(r))
    }

    /// Matching records after `cursor`, at most `max`, and the position the scan reached; or
    /// `None` when records after `cursor` have left the ring (the watcher is too far behind).
    fn after(
        &self,
        cursor: Position,
        filter: &RecordFilter,
        max: usize,
        watermark: Position,
    ) -> Option<(Vec<Arc<Record>>, Position)> {
        let ring = self.ring();
        if ring.evicted_upto > cursor {
            return None;
        }
        let start = ring.records.partition_point(|r| r.position <= cursor);
        let mut out = Vec::new();
        let mut reached = cursor;
        for r in ring.records.range(start..) {
            if filter.matches(r) {
                if out.len() == max {
                    return Some((out, reached));
                }
                out.push(r.clone());
            }
            reached = r.position;
        }
        // Scanned to the end of the ring: everything up to the watermark is covered.
        Some((out, reached.max(watermark)))
    }
}

/// A slot among `max_watchers`, given back when the watch ends.
struct Slot(Arc<Tail>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.watchers.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Records {
    /// Starts this replica's tail, a task of `life`; it stops, ending every watch with
    /// UNAVAILABLE, when stopping begins.
    pub(super) fn start_tail(&self, life: &crate::lifecycle::Lifecycle) {
        let (svc, stopping) = (self.clone(), life.stopping());
        life.spawn(async move {
            tokio::select! {
                _ = svc.run_tail() => {}
                _ = stopping.wait() => {}
            }
            svc.tail.set(|s| s.state = TailState::Stopped);
        });
    }

    async fn run_tail(&self) {
        let tail = &self.tail;
        let commits = self.store.commits();
        // Local commits are announced to other replicas (whose watches may wait on them) at
        // most every ANNOUNCE_EVERY; one held back is sent when that time comes.
        let mut announced = Instant::now() - ANNOUNCE_EVERY;
        let mut unannounced = false;
        let mut last_read = Instant::now() - MIN_READ_GAP;
        loop {
            let watched = tail.watchers.load(Ordering::Acquire) > 0;
            let next = match (unannounced, watched) {
                (true, _) => announced + ANNOUNCE_EVERY,
                (false, true) => Instant::now() + FALLBACK_READ,
                (false, false) => Instant::now() + Duration::from_secs(3600),
            };
            let local = tokio::select! {
                _ = commits.local.notified() => true,
                _ = commits.remote.notified() => false,
                _ = tail.opened.notified() => false,
                _ = tokio::time::sleep_until(next) => false,
            };
            tail.erase(commits.take_erasures());
            if commits.resync.swap(false, Ordering::AcqRel) {
                // Watchers join the new ring from the store, which holds no erased record.
                tail.set(|s| {
                    if s.state == TailState::Reading {
                        s.state = TailState::Idle;
                    }
                });
            }
            unannounced |= local && self.store.engine() == crate::store::Engine::Postgres;
            if unannounced && announced.elapsed() >= ANNOUNCE_EVERY {
                // Other replicas' tails read by position; this only wakes them.
                // Bounded like every read: a store gone silent must not stop the tail here.
                if let Err(e) = self.store_read(self.store.announce_records()).await {
                    tracing::debug!(error = %e, "records not announced");
                }
                announced = Instant::now();
                unannounced = false;
            }
            if tail.watchers.load(Ordering::Acquire) == 0 {
                // Nobody to feed: read nothing, and start afresh when a watch opens.
                tail.set(|s| {
                    if s.state != TailState::Stopped {
                        s.state = TailState::Idle;
                    }
                });
                continue;
            }
            // Reads are coalesced: a burst of commits costs one read per MIN_READ_GAP.
            let since = last_read.elapsed();
            if since < MIN_READ_GAP {
                tokio::time::sleep(MIN_READ_GAP - since).await;
            }
            last_read = Instant::now();
            if tail.status.borrow().state == TailState::Idle && !self.restart_ring().await {
                tokio::time::sleep(RETRY).await;
                continue;
            }
            self.read_ahead().await;
        }
    }

    /// Starts the ring afresh at the store's position now: history is each watch's to read
    /// from the store. False when the store could not be read.
    async fn restart_ring(&self) -> bool {
        let tail = &self.tail;
        match self.store_read(self.store.watermark()).await {
            Ok(now) => {
                {
                    let mut ring = tail.ring();
                    ring.records.clear();
                    ring.evicted_upto = now;
                    // What is read from here on was read after every erasure so far.
                    ring.erased.clear();
                }
                tail.set(|s| {
                    s.watermark = now;
                    s.epoch += 1;
                });
                tail.push(Vec::new(), now);
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "watch tail cannot read the store");
                false
            }
        }
    }

    /// Reads the records committed past the ring's watermark, TAIL_READ at a time, until a
    /// read comes back short; a failing store ends the watches (Failing) for a while.
    async fn read_ahead(&self) {
        let tail = &self.tail;
        loop {
            let from = tail.status.borrow().watermark;
            match self
                .store_read(self.store.tail_records(from, TAIL_READ))
                .await
            {
                Ok((records, reach)) => {
                    let full = records.len() as u64 >= TAIL_READ;
                    tail.push(records, reach);
                    if !full {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "watch tail cannot read the store; watches end");
                    tail.set(|s| s.state = TailState::Failing);
                    tokio::time::sleep(RETRY).await;
                    break;
                }
            }
        }
    }

    /// A read of the store for the tail, bounded: a store gone silent never says so itself.
    async fn store_read<T>(&self, read: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        tokio::time::timeout(STORE_READ_TIMEOUT, read)
            .await
            .unwrap_or_else(|_| Err(Error::Unavailable("no answer in time".into())))
    }

    /// The position "now": every record committed so far is at or below it.
    pub async fn now_position(&self) -> Result<Position> {
        self.store.watermark().await
    }

    /// A record's position, for a watch that starts after it; `principal` when given must be
    /// the record's (a reader's own), else it is as unknown as a missing one.
    pub async fn position_of(&self, record_id: &str, principal: Option<&str>) -> Result<Position> {
        super::valid_id("after_record_id", record_id)?;
        match self.store.record_position(record_id).await? {
            Some((p, owner)) if principal.is_none_or(|want| want == owner) => Ok(p),
            _ => Err(Error::NotFound(format!("no record `{record_id}`"))),
        }
    }

    /// Takes a watcher slot; RESOURCE_EXHAUSTED when `max_watchers` are open.
    fn watcher_slot(&self) -> Result<Slot> {
        let tail = self.tail.clone();
        let max = tail.limits.max_watchers;
        tail.watchers
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1))
            .map_err(|_| {
                Error::ResourceExhausted(format!(
                    "{max} watches are open on this server (--max-watches); retry later or on another replica"
                ))
            })?;
        tail.opened.notify_one();
        Ok(Slot(tail))
    }

    /// Checks a watch's filters and takes its slot; the watch itself runs in `watch`.
    pub fn open_watch(&self, filter: &RecordFilter) -> Result<Watch> {
        self.check_record_filter(filter)?;
        Ok(Watch {
            svc: self.clone(),
            _slot: self.watcher_slot()?,
        })
    }
}

/// An open watch, holding its slot.
pub struct Watch {
    svc: Records,
    _slot: Slot,
}

/// A watch's messages as its caller takes them, then how it ended.
pub type WatchEvents = Pin<Box<dyn Stream<Item = WatchEvent> + Send + 'static>>;

impl Watch {
    /// Starts the watch (see `run`) and hands over its messages: every record matching
    /// `filter` committed after `from`, then new ones as they commit, and last why it ended.
    /// A record erased since it was read is left out as its message is taken — the last look
    /// before it goes out, however long the message waited for its reader.
    pub fn start(self, filter: RecordFilter, from: Position) -> WatchEvents {
        let tail = self.svc.tail.clone();
        let (tx, rx) = mpsc::channel(1);
        let (ended_tx, ended) = oneshot::channel();
        // The call's own task, not the lifecycle's: it ends with the call (its reader gone) or,
        // at stopping, with a resume token.
        tokio::spawn(self.run(filter, from, tx, ended_tx));
        let events =
            ReceiverStream::new(rx)
                .chain(Ended(Some(ended)))
                .map(move |event| match event {
                    WatchEvent::Sent { records, position } => WatchEvent::Sent {
                        records: records.into_iter().filter(|r| !tail.erased(r)).collect(),
                        position,
                    },
                    ended @ WatchEvent::Ended { .. } => ended,
                });
        Box::pin(events)
    }

    /// Sends every record matching `filter` committed after `from`, then new ones as they
    /// commit, until the receiver goes or the watch is ended: why goes to `ended`, not after
    /// the records in `out`, so a reader that takes nothing does not hold the watch (its slot
    /// and this task) past the lag bound. Its reader reads `ended` once `out` is empty.
    async fn run(
        self,
        filter: RecordFilter,
        from: Position,
        out: mpsc::Sender<WatchEvent>,
        ended: tokio::sync::oneshot::Sender<WatchEvent>,
    ) {
        let mut w = Watcher {
            svc: &self.svc,
            filter,
            cursor: from,
            out,
            last_sent: Instant::now(),
            behind_since: None,
            epoch: 0,
        };
        // A ring started afresh (the tail went idle and woke) is joined again from the store.
        let end = loop {
            if let Err(end) = w.catch_up().await {
                break end;
            }
            if let Some(end) = w.follow().await {
                break end;
            }
        };
        let position = w.cursor;
        // Told before `out` is dropped (with `w`): the reader finds it when `out` ends.
        let _ = ended.send(WatchEvent::Ended {
            cause: end.0,
            why: end.1,
            position,
        });
    }
}

/// The end of a watch, told once its messages are read.
struct Ended(Option<oneshot::Receiver<WatchEvent>>);

impl Stream for Ended {
    type Item = WatchEvent;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<WatchEvent>> {
        let Some(rx) = self.0.as_mut() else {
            return Poll::Ready(None);
        };
        let out = std::task::ready!(Pin::new(rx).poll(cx)).ok();
        self.0 = None;
        Poll::Ready(out)
    }
}

type End = (Interruption, String);

struct Watcher<'a> {
    svc: &'a Records,
    filter: RecordFilter,
    /// Everything matching up to here has been sent.
    cursor: Position,
    out: mpsc::Sender<WatchEvent>,
    last_sent: Instant,
    /// Since when the watcher has not been caught up with the tail.
    behind_since: Option<Instant>,
    /// The ring this watcher joined (see `TailStatus::epoch`).
    epoch: u64,
}

fn unavailable(e: &Error) -> End {
    (
        Interruption::Unavailable,
        format!("the store is unavailable ({e}); resume from resume_token"),
    )
}

impl Watcher<'_> {
    fn limits(&self) -> WatchLimits {
        self.svc.tail.limits
    }

    /// Sends a message, waiting at most until the lag bound for a reader that does not read.
    async fn send(&mut self, records: Vec<Arc<Record>>, position: Position) -> Result<(), End> {
        let event = WatchEvent::Sent { records, position };
        let max_lag = self.limits().max_lag;
        match tokio::time::timeout(max_lag, self.out.send(event)).await {
            Ok(Ok(())) => {
                self.cursor = self.cursor.max(position);
                self.last_sent = Instant::now();
                Ok(())
            }
            // The caller went away: nothing to say to anyone.
            Ok(Err(_)) => Err((Interruption::Unavailable, String::new())),
            Err(_) => Err((
                Interruption::Behind,
                format!(
                    "the reader took more than {} s to take a message; resume from resume_token",
                    max_lag.as_secs()
                ),
            )),
        }
    }

    /// Reads from the store what the ring no longer (or not yet) holds, until the ring covers
    /// everything after the cursor.
    async fn catch_up(&mut self) -> Result<(), End> {
        // The ring's start is only known once the tail has read the store.
        let mut status = self.svc.tail.status.subscribe();
        let started = tokio::time::timeout(TAIL_START_WAIT, async {
            status
                .wait_for(|s| s.state != TailState::Idle)
                .await
                .is_ok()
        })
        .await;
        if started != Ok(true) {
            return Err(unavailable(&Error::Unavailable(
                "the watch tail has not read it yet".into(),
            )));
        }
        let mut filter = self.filter.clone();
        filter.descending = false;
        loop {
            // Read before the store is: anything the ring drops after this is in the read.
            self.epoch = self.svc.tail.status.borrow().epoch;
            let evicted = self.svc.tail.ring().evicted_upto;
            let listed = tokio::time::timeout(
                STORE_READ_TIMEOUT,
                self.svc
                    .store
                    .list_records(&filter, Some(&self.cursor), CATCH_UP_READ),
            )
            .await
            .unwrap_or_else(|_| Err(Error::Unavailable("no answer in time".into())))
            .map_err(|e| unavailable(&e))?;
            let full = listed.records.len() as u64 >= CATCH_UP_READ;
            if !listed.records.is_empty() || listed.watermark > self.cursor {
                let records: Vec<Arc<Record>> = listed.records.into_iter().map(Arc::new).collect();
                for chunk in records.chunks(MAX_PER_MESSAGE) {
                    let reach = chunk.last().map_or(self.cursor, |r| r.position);
                    self.send(chunk.to_vec(), reach).await?;
                }
                if !full {
                    // Everything matching up to the read's watermark has been sent.
                    self.cursor = self.cursor.max(listed.watermark);
                }
            }
            if !full && self.cursor >= evicted {
                return Ok(());
            }
        }
    }

    /// Sends from the ring as the tail fills it; `None` when the ring was started afresh.
    async fn follow(&mut self) -> Option<End> {
        let mut status = self.svc.tail.status.subscribe();
        loop {
            let st = *status.borrow_and_update();
            if st.epoch != self.epoch {
                return None;
            }
            match st.state {
                TailState::Stopped => {
                    return Some((
                        Interruption::Unavailable,
                        "the server is shutting down; resume from resume_token on another replica"
                            .into(),
                    ))
                }
                TailState::Failing => {
                    return Some(unavailable(&Error::Unavailable(
                        "the watch tail cannot read it".into(),
                    )))
                }
                TailState::Idle | TailState::Reading => {}
            }
            if st.state == TailState::Reading {
                match self.svc.tail.after(self.cursor, &self.filter, MAX_PER_MESSAGE, st.watermark) {
                    None => {
                        return Some((
                            Interruption::Behind,
                            format!(
                                "more than {} records behind (--watch-max-behind); resume from resume_token",
                                self.limits().max_behind
                            ),
                        ))
                    }
                    Some((records, reach)) => {
                        let caught_up = reach >= st.watermark;
                        if !records.is_empty() {
                            let records = match self.visible(records).await {
                                Ok(r) => r,
                                Err(e) => return Some(unavailable(&e)),
                            };
                            if let Err(end) = self.send(records, reach).await {
                                return Some(end);
                            }
                        } else {
                            // Nothing for this watcher up to `reach`: progress, sent when due.
                            self.cursor = self.cursor.max(reach);
                        }
                        if !caught_up {
                            let since = *self.behind_since.get_or_insert_with(Instant::now);
                            if since.elapsed() > self.limits().max_lag {
                                return Some((
                                    Interruption::Behind,
                                    format!(
                                        "not caught up for {} s (--watch-max-lag-secs); resume from resume_token",
                                        self.limits().max_lag.as_secs()
                                    ),
                                ));
                            }
                            continue;
                        }
                        self.behind_since = None;
                    }
                }
            }
            let progress_at = self.last_sent + self.limits().progress_every;
            tokio::select! {
                changed = status.changed() => {
                    if changed.is_err() {
                        return Some((Interruption::Unavailable, "the server is shutting down".into()));
                    }
                }
                _ = tokio::time::sleep_until(progress_at) => {
                    let cursor = self.cursor;
                    if let Err(end) = self.send(Vec::new(), cursor).await {
                        return Some(end);
                    }
                }
                _ = self.out.closed() => return Some((Interruption::Unavailable, String::new())),
            }
        }
    }

    /// §7.5.2 as each message is sent: brain records only while the viewer is a member.
    async fn visible(&self, records: Vec<Arc<Record>>) -> Result<Vec<Arc<Record>>> {
        let projects = match (&self.filter.viewer, records.iter().any(|r| r.land == BRAIN)) {
            (Some(viewer), true) => self.svc.store.projects_of(viewer).await?,
            _ => BTreeSet::new(),
        };
        Ok(records
            .into_iter()
            .filter(|r| self.filter.visible(r, &projects))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::policy::Route;

    fn rec(seq: i64, principal: &str) -> Record {
        Record {
            record_id: format!("r{seq}"),
            principal: principal.into(),
            binding_id: String::new(),
            land: "user".into(),
            pack_id: "p".into(),
            r#ref: "x.y".into(),
            payload: Default::default(),
            route: Route::Inbox,
            project: None,
            trigger_id: None,
            received_time: 0,
            position: Position { txid: 0, seq },
        }
    }

    fn tail(max_behind: usize) -> Tail {
        Tail::new(WatchLimits {
            max_behind,
            ..WatchLimits::default()
        })
    }

    fn at(seq: i64) -> Position {
        Position { txid: 0, seq }
    }

    #[test]
    fn a_watcher_exactly_max_behind_is_served_and_one_more_is_not() {
        let t = tail(3);
        t.push((1..=3).map(|i| rec(i, "a")).collect(), at(3));
        let all = RecordFilter::default();
        // Behind by 3 (cursor 0, records 1..3 in the ring): served.
        let (got, reach) = t.after(at(0), &all, 10, at(3)).expect("in the ring");
        assert_eq!(got.len(), 3);
        assert_eq!(reach, at(3));
        // A fourth record evicts the first: a watcher at 0 is now 4 behind.
        t.push(vec![rec(4, "a")], at(4));
        assert!(
            t.after(at(0), &all, 10, at(4)).is_none(),
            "4 behind with a ring of 3"
        );
        let (got, _) = t.after(at(1), &all, 10, at(4)).expect("3 behind");
        assert_eq!(
            got.iter().map(|r| r.position.seq).collect::<Vec<_>>(),
            [2, 3, 4]
        );
    }

    #[test]
    fn the_ring_filters_and_advances_past_what_does_not_match() {
        let t = tail(10);
        t.push(
            vec![rec(1, "a"), rec(2, "b"), rec(3, "b"), rec(4, "a")],
            at(4),
        );
        let only_a = RecordFilter {
            principal: Some("a".into()),
            ..Default::default()
        };
        let (got, reach) = t.after(at(0), &only_a, 10, at(4)).expect("ring");
        assert_eq!(
            got.iter().map(|r| r.position.seq).collect::<Vec<_>>(),
            [1, 4]
        );
        assert_eq!(reach, at(4));
        // A message full after one record stops the scan there.
        let (got, reach) = t.after(at(0), &only_a, 1, at(4)).expect("ring");
        assert_eq!(got.len(), 1);
        assert_eq!(
            reach,
            at(3),
            "scanned up to the record before the next match"
        );
        // Nothing for b after 3, but the scan still reaches the watermark.
        let only_b = RecordFilter {
            principal: Some("b".into()),
            ..Default::default()
        };
        let (got, reach) = t.after(at(3), &only_b, 10, at(9)).expect("ring");
        assert!(got.is_empty());
        assert_eq!(reach, at(9));
    }
}
