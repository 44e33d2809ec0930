//! A fair queue of any items: they wait in lanes per pack and, within a pack, per principal, and takers serve the lanes round-robin, so one lane's backlog delays only that lane (the sink's records in store/sink.rs, the payload checks in service/checks.rs).
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// Lanes kept before those idle are swept.
const IDLE_LANES: usize = 4096;

/// Round robin over packs, and within each pack over its principals, one record per turn: deficit
/// round robin where every record costs one. One pack alone takes every turn.
///
/// A pack that had nothing queued when its record came is *sparse* (fq_codel's new flow): its
/// first turn comes before every backlogged pack's, and then it joins the backlog's ring. A
/// pack is sparse again only once its queue has emptied, so a flood gains one turn each time
/// it drains, no more.
#[derive(Debug)]
pub struct Rounds<T> {
    /// Sparse packs, in the order they came; each takes one turn here.
    sparse: VecDeque<String>,
    /// Backlogged packs, in the order their next turns come.
    ring: VecDeque<String>,
    packs: HashMap<String, Principals<T>>,
    len: usize,
}

#[derive(Debug)]
struct Principals<T> {
    ring: VecDeque<String>,
    queues: HashMap<String, VecDeque<T>>,
    len: usize,
}

impl<T> Default for Rounds<T> {
    fn default() -> Self {
        Rounds {
            sparse: VecDeque::new(),
            ring: VecDeque::new(),
            packs: HashMap::new(),
            len: 0,
        }
    }
}

impl<T> Rounds<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Records queued for a pack.
    pub fn queued(&self, pack: &str) -> usize {
        self.packs.get(pack).map_or(0, |p| p.len)
    }

    /// Packs with records queued.
    pub fn packs(&self) -> usize {
        self.sparse.len() + self.ring.len()
    }

    /// Whether a sparse pack waits while backlogged ones are queued: the sparse turns can be
    /// taken apart (`take_sparse`), ahead of the backlog.
    pub fn sparse_beside_backlog(&self) -> bool {
        !self.sparse.is_empty() && !self.ring.is_empty()
    }

    /// Queues `item` last in its (pack, principal) lane. A pack new to the rounds is sparse: its
    /// first turn comes after the sparse packs' waiting now and before the backlog's; a principal
    /// new to its pack takes its first turn after the pack's principals waiting now.
    pub fn push(&mut self, pack: &str, principal: &str, item: T) {
        let p = match self.packs.get_mut(pack) {
            Some(p) => p,
            None => {
                self.sparse.push_back(pack.to_owned());
                self.packs.entry(pack.to_owned()).or_insert(Principals {
                    ring: VecDeque::new(),
                    queues: HashMap::new(),
                    len: 0,
                })
            }
        };
        match p.queues.get_mut(principal) {
            Some(q) => q.push_back(item),
            None => {
                p.ring.push_back(principal.to_owned());
                p.queues
                    .insert(principal.to_owned(), VecDeque::from([item]));
            }
        }
        p.len += 1;
        self.len += 1;
    }

    /// Moves up to `max - out.len()` records into `out`: one from each pack in turn (sparse packs
    /// first), each pack's from its principals in turn.
    pub fn take(&mut self, out: &mut Vec<(String, T)>, max: usize) {
        self.serve(out, max, false);
    }

    /// `take`, of the sparse packs' turns only: each sparse pack's next record.
    pub fn take_sparse(&mut self, out: &mut Vec<(String, T)>, max: usize) {
        self.serve(out, max, true);
    }

    /// Whether a sparse pack other than those of `busy` has a record queued.
    pub fn sparse_except(&self, busy: &[String]) -> bool {
        self.sparse.iter().any(|p| !busy.contains(p))
    }

    /// `take_sparse`, of the sparse packs other than those of `busy`, whose turns stay.
    pub fn take_sparse_except(&mut self, out: &mut Vec<(String, T)>, max: usize, busy: &[String]) {
        let (held, others): (VecDeque<String>, VecDeque<String>) = std::mem::take(&mut self.sparse)
            .into_iter()
            .partition(|p| busy.contains(p));
        self.sparse = others;
        self.serve(out, max, true);
        let mut sparse = held;
        sparse.append(&mut self.sparse);
        self.sparse = sparse;
    }

    fn serve(&mut self, out: &mut Vec<(String, T)>, max: usize, sparse_only: bool) {
        while out.len() < max {
            let pack = match self.sparse.pop_front() {
                Some(pack) => pack,
                None if sparse_only => return,
                None => match self.ring.pop_front() {
                    Some(pack) => pack,
                    None => return,
                },
            };
            let Some(p) = self.packs.get_mut(&pack) else {
                continue;
            };
            if let Some(principal) = p.ring.pop_front() {
                if let Some(q) = p.queues.get_mut(&principal) {
                    if let Some(item) = q.pop_front() {
                        self.len -= 1;
                        p.len -= 1;
                        out.push((pack.clone(), item));
                    }
                    if q.is_empty() {
                        p.queues.remove(&principal);
                    } else {
                        p.ring.push_back(principal);
                    }
                }
            }
            if p.ring.is_empty() {
                self.packs.remove(&pack);
            } else {
                self.ring.push_back(pack);
            }
        }
    }
}

/// A record queued with the permits that hold its place, and when its caller came.
struct Queued<T> {
    item: T,
    since: Instant,
    _lane: OwnedSemaphorePermit,
    _total: OwnedSemaphorePermit,
}

/// The async queue between callers and writers: `push` waits while the caller's lane (or the
/// whole queue) is full; `take` hands writers records in `Rounds` order.
pub struct FairQueue<T> {
    inner: Mutex<Inner<T>>,
    ready: Notify,
    /// Told when a record leaves a sparse pack queued beside a backlog (see `express`).
    express: Notify,
    total: Arc<Semaphore>,
    closed: AtomicBool,
    lane_bound: usize,
    /// When a take last found more than one pack queued.
    mixed_at: Mutex<Option<Instant>>,
}

struct Inner<T> {
    rounds: Rounds<Queued<T>>,
    /// Each lane's places, by pack and principal.
    lanes: HashMap<String, HashMap<String, Arc<Semaphore>>>,
    /// Lanes in `lanes`, and the count at which idle ones are next swept.
    count: usize,
    sweep_at: usize,
    /// Whether the last turns taken were the sparse packs' alone: the next are the backlog's.
    sparse_last: bool,
}

impl<T> std::fmt::Debug for FairQueue<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FairQueue").finish_non_exhaustive()
    }
}

/// Records taken from the rounds, into `out` with the time each waited since its caller came;
/// their places go to the callers waiting as the permits drop, outside the lock.
fn handed<T>(out: &mut Vec<(String, T, std::time::Duration)>, taken: Vec<(String, Queued<T>)>) {
    out.extend(
        taken
            .into_iter()
            .map(|(pack, q)| (pack, q.item, q.since.elapsed())),
    );
}

/// The queue was closed: the sink is shutting down.
#[derive(Debug, PartialEq, Eq)]
pub struct Closed;

impl<T> FairQueue<T> {
    pub fn new(lane_bound: usize, total_bound: usize) -> FairQueue<T> {
        FairQueue {
            inner: Mutex::new(Inner {
                rounds: Rounds::default(),
                lanes: HashMap::new(),
                count: 0,
                sweep_at: IDLE_LANES,
                sparse_last: false,
            }),
            ready: Notify::new(),
            express: Notify::new(),
            total: Arc::new(Semaphore::new(total_bound)),
            closed: AtomicBool::new(false),
            lane_bound,
            mixed_at: Mutex::new(None),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner<T>> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `item` in its lane, waiting first (callers of a lane in arrival order) while
    /// the lane holds `lane_bound` records or the queue its total.
    pub async fn push(&self, pack: &str, principal: &str, item: T) -> Result<(), Closed> {
        let since = Instant::now();
        let lane = {
            let mut inner = self.lock();
            if inner.count >= inner.sweep_at {
                let bound = self.lane_bound;
                let busy =
                    |s: &Arc<Semaphore>| s.available_permits() < bound || Arc::strong_count(s) > 1;
                for principals in inner.lanes.values_mut() {
                    principals.retain(|_, s| busy(s));
                }
                inner.lanes.retain(|_, p| !p.is_empty());
                inner.count = inner.lanes.values().map(HashMap::len).sum();
                // Lanes still busy are not swept again until as many more are made.
                inner.sweep_at = IDLE_LANES.max(2 * inner.count);
            }
            // Looked up by reference: a lane's names are copied only when it is new.
            match inner.lanes.get(pack).and_then(|p| p.get(principal)) {
                Some(lane) => lane.clone(),
                None => {
                    inner.count += 1;
                    let lane = Arc::new(Semaphore::new(self.lane_bound));
                    inner
                        .lanes
                        .entry(pack.to_owned())
                        .or_default()
                        .insert(principal.to_owned(), lane.clone());
                    lane
                }
            }
        };
        let lane = lane.acquire_owned().await.map_err(|_| Closed)?;
        let total = self
            .total
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Closed)?;
        if self.closed.load(Ordering::SeqCst) {
            return Err(Closed);
        }
        let beside_backlog = {
            let mut inner = self.lock();
            inner.rounds.push(
                pack,
                principal,
                Queued {
                    item,
                    since,
                    _lane: lane,
                    _total: total,
                },
            );
            inner.rounds.sparse_beside_backlog()
        };
        if beside_backlog {
            self.express.notify_one();
        }
        self.ready.notify_one();
        Ok(())
    }

    /// Waits until a record is queued in a sparse pack beside a backlog (true; see `express`),
    /// or the queue is closed (false). Takes nothing.
    pub async fn sparse_beside_backlog(&self) -> bool {
        loop {
            if self.closed.load(Ordering::SeqCst) {
                return false;
            }
            let told = self.express.notified();
            tokio::pin!(told);
            told.as_mut().enable();
            if self.lock().rounds.sparse_beside_backlog() {
                return true;
            }
            if self.closed.load(Ordering::SeqCst) {
                return false;
            }
            told.await;
        }
    }

    /// The express taker's turn: the sparse packs' next records (up to `max - out.len()`), when
    /// they are queued beside a backlog; whether it took any. A taker of its own (the sink's
    /// express writer, with its own connection) commits them while the backlog's batches
    /// commit, so unlike `try_take_sparse` it takes no turn from the backlog's takers.
    pub fn try_take_express(
        &self,
        out: &mut Vec<(String, T, std::time::Duration)>,
        max: usize,
    ) -> bool {
        let mut taken = Vec::new();
        {
            let mut inner = self.lock();
            if !inner.rounds.sparse_beside_backlog() {
                return false;
            }
            inner
                .rounds
                .take_sparse(&mut taken, max.saturating_sub(out.len()));
        }
        handed(out, taken);
        true
    }

    /// Moves up to `max - out.len()` queued records into `out` with the time each waited
    /// since its caller came; their places go to the callers waiting.
    pub fn try_take(&self, out: &mut Vec<(String, T, std::time::Duration)>, max: usize) {
        self.take_turns(out, max, false);
    }

    /// Moves the sparse packs' turns (see `Rounds`), up to `max - out.len()` records, into `out`
    /// when backlogged packs are queued beside them, and says whether it did: a batch of these
    /// alone commits in a fraction of a backlog's batch, so a quiet pack's record waits for
    /// that, not for hundreds of a flood's. Never twice in a row: after a sparse batch the next
    /// is the backlog's (sparse packs still first in it), so however many packs are sparse a
    /// backlog loses at most one short commit per batch of its own.
    pub fn try_take_sparse(
        &self,
        out: &mut Vec<(String, T, std::time::Duration)>,
        max: usize,
    ) -> bool {
        self.take_turns(out, max, true)
    }

    /// Whether a pack other than those of `busy` is sparse with a record queued: a record that
    /// a batch of `busy`'s records under way would keep waiting (see `sink::Writer::commit`).
    pub fn sparse_waiting_except(&self, busy: &[String]) -> bool {
        self.lock().rounds.sparse_except(busy)
    }

    /// Moves the turns of the sparse packs other than those of `busy` (up to `max - out.len()`
    /// records) into `out`: the records a batch of `busy`'s was cut for, committed before its
    /// rest. The next turns taken are the backlog's, as after `try_take_sparse`; a pack of the
    /// batch keeps its turn, so its records stay in their order.
    pub fn try_take_cut(
        &self,
        out: &mut Vec<(String, T, std::time::Duration)>,
        max: usize,
        busy: &[String],
    ) {
        let mut taken = Vec::new();
        {
            let mut inner = self.lock();
            inner
                .rounds
                .take_sparse_except(&mut taken, max.saturating_sub(out.len()), busy);
            if !taken.is_empty() {
                inner.sparse_last = true;
            }
        }
        handed(out, taken);
    }

    /// `try_take` (`sparse` false, always taken) or `try_take_sparse`; whether it took turns.
    fn take_turns(
        &self,
        out: &mut Vec<(String, T, std::time::Duration)>,
        max: usize,
        sparse: bool,
    ) -> bool {
        let mut taken = Vec::new();
        let mixed = {
            let mut inner = self.lock();
            let max = max.saturating_sub(out.len());
            let mixed = inner.rounds.packs() > 1;
            if sparse {
                if inner.sparse_last || !inner.rounds.sparse_beside_backlog() {
                    return false;
                }
                inner.rounds.take_sparse(&mut taken, max);
            } else {
                inner.rounds.take(&mut taken, max);
            }
            if !taken.is_empty() {
                inner.sparse_last = sparse;
            }
            mixed
        };
        if mixed {
            *self.mixed_at.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
        }
        // The permits are released here, outside the lock.
        handed(out, taken);
        true
    }

    /// `try_take`, first waiting until a record is queued; false once the queue is closed and
    /// empty. Cancel-safe: nothing is taken unless it returns.
    pub async fn take(&self, out: &mut Vec<(String, T, std::time::Duration)>, max: usize) -> bool {
        loop {
            let before = out.len();
            self.try_take(out, max);
            if out.len() > before || out.len() >= max {
                return true;
            }
            if !self.queued_any().await {
                return false;
            }
        }
    }

    /// Waits until a record is queued (true) or the queue is closed and empty (false); takes
    /// nothing, so it is cancel-safe.
    pub async fn queued_any(&self) -> bool {
        loop {
            if !self.lock().rounds.is_empty() {
                return true;
            }
            if self.closed.load(Ordering::SeqCst) {
                return false;
            }
            let ready = self.ready.notified();
            tokio::pin!(ready);
            ready.as_mut().enable();
            if !self.lock().rounds.is_empty() || self.closed.load(Ordering::SeqCst) {
                continue;
            }
            ready.await;
        }
    }

    /// Records queued for a pack now.
    pub fn queued(&self, pack: &str) -> usize {
        self.lock().rounds.queued(pack)
    }

    /// Whether a take found more than one pack queued within `within`: packs are sharing the
    /// writers, and a long batch of one of them is a wait for the others.
    pub fn shared_within(&self, within: std::time::Duration) -> bool {
        self.mixed_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some_and(|t| t.elapsed() <= within)
    }

    /// Refuses new records; writers take what is queued, then stop.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.total.close();
        for lane in self.lock().lanes.values().flat_map(HashMap::values) {
            lane.close();
        }
        self.ready.notify_waiters();
        self.ready.notify_one();
        self.express.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(r: &mut Rounds<u32>, max: usize) -> Vec<(String, u32)> {
        let mut out = Vec::new();
        r.take(&mut out, max);
        out
    }

    #[test]
    fn packs_take_turns_one_record_each_and_a_lone_pack_takes_them_all() {
        let mut r = Rounds::default();
        for n in 0..5 {
            r.push("flood", "alice", n);
        }
        r.push("quiet", "bob", 100);
        r.push("quiet", "bob", 101);
        let got: Vec<u32> = order(&mut r, 4).into_iter().map(|(_, n)| n).collect();
        assert_eq!(
            got,
            vec![0, 100, 1, 101],
            "the quiet pack waits one turn, not five"
        );
        let got: Vec<u32> = order(&mut r, 10).into_iter().map(|(_, n)| n).collect();
        assert_eq!(got, vec![2, 3, 4], "alone, the flood takes every turn");
        assert!(r.is_empty());
        assert_eq!(r.queued("flood"), 0);
    }

    #[test]
    fn a_sparse_pack_takes_one_turn_ahead_of_the_backlog_then_joins_it() {
        let mut r = Rounds::default();
        for n in 0..6 {
            r.push("flood", "alice", n);
        }
        assert!(!r.sparse_beside_backlog(), "a pack alone is no backlog");
        assert_eq!(order(&mut r, 1), vec![("flood".to_string(), 0)]);
        r.push("quiet", "bob", 100);
        r.push("quiet", "bob", 101);
        r.push("calm", "carol", 200);
        assert!(r.sparse_beside_backlog());
        let mut out = Vec::new();
        r.take_sparse(&mut out, 10);
        let got: Vec<u32> = out.into_iter().map(|(_, n)| n).collect();
        assert_eq!(
            got,
            vec![100, 200],
            "one turn each, and none of the backlog's"
        );
        assert!(
            !r.sparse_beside_backlog(),
            "quiet's second record is backlog now"
        );
        let got: Vec<u32> = order(&mut r, 10).into_iter().map(|(_, n)| n).collect();
        assert_eq!(got, vec![1, 101, 2, 3, 4, 5]);
        // Emptied, a pack is sparse again: the flood draining gains it one turn, no more.
        r.push("other", "dan", 300);
        r.push("other", "dan", 301);
        let _ = order(&mut r, 1);
        r.push("flood", "alice", 6);
        assert!(r.sparse_beside_backlog());
        let mut out = Vec::new();
        r.take_sparse(&mut out, 10);
        assert_eq!(out, vec![("flood".to_string(), 6)]);
    }

    #[test]
    fn within_a_pack_principals_take_turns() {
        let mut r = Rounds::default();
        for n in 0..3 {
            r.push("public", "alice", n);
        }
        r.push("public", "bob", 10);
        r.push("other", "carol", 20);
        let got: Vec<(String, u32)> = order(&mut r, 10);
        let ids: Vec<u32> = got.iter().map(|(_, n)| *n).collect();
        assert_eq!(ids, vec![0, 20, 10, 1, 2]);
        assert_eq!(got[1].0, "other");
    }

    #[test]
    fn ten_packs_flooding_share_the_turns_evenly() {
        let mut r = Rounds::default();
        for pack in 0..10 {
            for n in 0..1000 {
                r.push(&format!("p{pack}"), "x", n);
            }
        }
        let got = order(&mut r, 5000);
        let mut per: HashMap<String, usize> = HashMap::new();
        for (pack, _) in got {
            *per.entry(pack).or_default() += 1;
        }
        assert_eq!(per.len(), 10);
        assert!(per.values().all(|&n| n == 500), "{per:?}");
    }

    #[tokio::test]
    async fn a_cut_takes_the_sparse_packs_outside_the_batch_and_leaves_the_batchs_own() {
        let q = FairQueue::<u32>::new(1024, 8192);
        for n in 0..40 {
            q.push("flood", "a", n).await.expect("queued");
        }
        let mut batch = Vec::new();
        q.try_take(&mut batch, 512);
        assert_eq!(batch.len(), 40, "the flood, drained into a batch");
        let busy = vec!["flood".to_string()];
        // The flood's next record makes it sparse again; it is the batch's own pack, so
        // nothing waits that a cut would serve.
        q.push("flood", "a", 40).await.expect("queued");
        assert!(!q.sparse_waiting_except(&busy));
        q.push("quiet", "b", 100).await.expect("queued");
        q.push("quiet", "b", 101).await.expect("queued");
        q.push("calm", "c", 200).await.expect("queued");
        assert!(q.sparse_waiting_except(&busy));
        let mut cut = Vec::new();
        q.try_take_cut(&mut cut, 64, &busy);
        let got: Vec<(&str, u32)> = cut.iter().map(|(p, n, _)| (p.as_str(), *n)).collect();
        assert_eq!(got, vec![("quiet", 100), ("calm", 200)], "one turn each");
        assert!(
            !q.sparse_waiting_except(&busy),
            "quiet is backlogged now, not sparse"
        );
        // The turns after a cut are the backlog's: no sparse batch next.
        let mut next = Vec::new();
        assert!(!q.try_take_sparse(&mut next, 64));
        q.try_take(&mut next, 64);
        let got: Vec<(&str, u32)> = next.iter().map(|(p, n, _)| (p.as_str(), *n)).collect();
        assert_eq!(
            got,
            vec![("flood", 40), ("quiet", 101)],
            "the flood kept its turn"
        );
    }

    #[tokio::test]
    async fn a_full_lane_holds_its_next_caller_and_no_other_lanes() {
        let q = Arc::new(FairQueue::<u32>::new(3, 5));
        for n in 0..3 {
            q.push("flood", "a", n).await.expect("queued");
        }
        // The fourth of the lane is held: not queued until a record of it is taken.
        let held = {
            let q = q.clone();
            tokio::spawn(async move { q.push("flood", "a", 3).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!held.is_finished(), "n+1 is held");
        assert_eq!(q.queued("flood"), 3, "n queued");
        // Another lane is not held by it.
        tokio::time::timeout(std::time::Duration::from_secs(1), q.push("quiet", "b", 9))
            .await
            .expect("another lane queues at once")
            .expect("queued");
        let mut out = Vec::new();
        q.try_take(&mut out, 2);
        let ids: Vec<u32> = out.iter().map(|(_, n, _)| *n).collect();
        assert_eq!(ids, vec![0, 9]);
        held.await
            .expect("join")
            .expect("queued once a place is free");
        assert_eq!(q.queued("flood"), 3);
        // The total: 3 queued of 5; two more fit, the next waits whatever its lane.
        q.push("third", "c", 20).await.expect("fits the total");
        q.push("fourth", "d", 30).await.expect("fits the total");
        let over = {
            let q = q.clone();
            tokio::spawn(async move { q.push("fifth", "e", 40).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!over.is_finished(), "past the total, held");
        let mut out = Vec::new();
        q.try_take(&mut out, 1);
        over.await.expect("join").expect("queued");
        q.close();
        let mut rest = Vec::new();
        while q.take(&mut rest, 100).await {}
        assert_eq!(rest.len(), 5, "what was queued is taken after close");
        assert_eq!(q.push("late", "e", 1).await, Err(Closed));
    }

    #[tokio::test]
    async fn idle_lanes_are_swept_and_busy_ones_kept() {
        let q = FairQueue::<u32>::new(4, 100_000);
        q.push("busy", "a", 1).await.expect("queued");
        for n in 0..IDLE_LANES as u32 {
            q.push("many", &format!("p{n}"), n).await.expect("queued");
            let mut out = Vec::new();
            if n > 0 {
                q.try_take(&mut out, 1);
            }
        }
        // The push that reached the count swept: left are the lanes that still have records.
        q.push("late", "z", 0).await.expect("queued");
        let inner = q.lock();
        assert_eq!(inner.rounds.len(), 3, "nothing queued is lost");
        assert!(inner.count <= 4, "{} lanes kept", inner.count);
        let kept: usize = inner.lanes.values().map(HashMap::len).sum();
        assert_eq!(kept, inner.count);
    }

    #[tokio::test]
    async fn a_take_finding_two_packs_marks_the_queue_shared_and_one_pack_does_not() {
        let q = FairQueue::<u32>::new(8, 64);
        let within = std::time::Duration::from_secs(60);
        q.push("flood", "a", 1).await.expect("queued");
        q.push("flood", "b", 2).await.expect("queued");
        let mut out = Vec::new();
        q.try_take(&mut out, 1);
        assert!(!q.shared_within(within), "one pack alone is not sharing");
        q.push("quiet", "c", 3).await.expect("queued");
        q.try_take(&mut out, 2);
        assert!(q.shared_within(within));
        assert_eq!(out.len(), 2);
    }

    #[tokio::test]
    async fn never_two_sparse_batches_in_a_row() {
        let q = FairQueue::<u32>::new(64, 256);
        let ids = |out: &[(String, u32, std::time::Duration)]| -> Vec<u32> {
            out.iter().map(|(_, n, _)| *n).collect()
        };
        for n in 0..10 {
            q.push("flood", "a", n).await.expect("queued");
        }
        let mut out = Vec::new();
        q.try_take(&mut out, 1);
        assert!(!q.try_take_sparse(&mut out, 64), "no sparse pack");
        q.push("quiet", "b", 100).await.expect("queued");
        let mut out = Vec::new();
        assert!(q.try_take_sparse(&mut out, 64));
        assert_eq!(ids(&out), vec![100]);
        q.push("calm", "c", 200).await.expect("queued");
        let mut out = Vec::new();
        assert!(!q.try_take_sparse(&mut out, 64), "the backlog's turn next");
        q.try_take(&mut out, 3);
        assert_eq!(ids(&out), vec![200, 1, 2], "sparse packs still first in it");
        q.push("other", "d", 300).await.expect("queued");
        let mut out = Vec::new();
        assert!(q.try_take_sparse(&mut out, 64));
        assert_eq!(ids(&out), vec![300]);
    }

    #[tokio::test]
    async fn a_waiting_taker_wakes_for_the_next_record() {
        let q = Arc::new(FairQueue::<u32>::new(8, 8));
        let taker = {
            let q = q.clone();
            tokio::spawn(async move {
                let mut out = Vec::new();
                let open = q.take(&mut out, 8).await;
                (open, out.len())
            })
        };
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        q.push("p", "a", 1).await.expect("queued");
        assert_eq!(taker.await.expect("join"), (true, 1));
    }

    #[tokio::test]
    async fn the_express_taker_takes_a_sparse_packs_record_beside_a_backlog_and_nothing_else() {
        let q = FairQueue::<u32>::new(64, 256);
        let ids = |out: &[(String, u32, std::time::Duration)]| -> Vec<u32> {
            out.iter().map(|(_, n, _)| *n).collect()
        };
        let mut out = Vec::new();
        // A pack alone is no backlog: its records are the writers'.
        q.push("quiet", "b", 100).await.expect("queued");
        assert!(!q.try_take_express(&mut out, 64));
        q.try_take(&mut out, 64);
        for n in 0..10 {
            q.push("flood", "a", n).await.expect("queued");
        }
        let mut out = Vec::new();
        q.try_take(&mut out, 1);
        assert!(
            !q.try_take_express(&mut out, 64),
            "a backlog alone: nothing express"
        );
        q.push("quiet", "b", 101).await.expect("queued");
        q.push("calm", "c", 200).await.expect("queued");
        q.push("quiet", "b", 102).await.expect("queued");
        let mut out = Vec::new();
        assert!(q.try_take_express(&mut out, 64));
        assert_eq!(
            ids(&out),
            vec![101, 200],
            "each sparse pack's next record, no flood"
        );
        // Taking express takes no turn from the backlog's takers: a sparse batch may follow.
        q.push("other", "d", 300).await.expect("queued");
        let mut out = Vec::new();
        assert!(q.try_take_sparse(&mut out, 64));
        assert_eq!(ids(&out), vec![300]);
        let mut out = Vec::new();
        q.try_take(&mut out, 3);
        assert_eq!(ids(&out), vec![1, 102, 2]);
    }

    #[tokio::test]
    async fn the_express_taker_wakes_for_a_sparse_record_beside_a_backlog_and_at_close() {
        let q = Arc::new(FairQueue::<u32>::new(64, 256));
        for n in 0..4 {
            q.push("flood", "a", n).await.expect("queued");
        }
        let mut out = Vec::new();
        q.try_take(&mut out, 1);
        let waiting = {
            let q = q.clone();
            tokio::spawn(async move { q.sparse_beside_backlog().await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(
            !waiting.is_finished(),
            "the flood's own records wake no express taker"
        );
        q.push("flood", "a", 9).await.expect("queued");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(!waiting.is_finished());
        q.push("quiet", "b", 100).await.expect("queued");
        let woken = tokio::time::timeout(std::time::Duration::from_secs(5), waiting).await;
        assert!(matches!(woken, Ok(Ok(true))), "{woken:?}");
        let waiting = {
            let q = q.clone();
            tokio::spawn(async move {
                let mut out = Vec::new();
                q.try_take_express(&mut out, 64);
                q.sparse_beside_backlog().await
            })
        };
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        q.close();
        let closed = tokio::time::timeout(std::time::Duration::from_secs(5), waiting).await;
        assert!(matches!(closed, Ok(Ok(false))), "{closed:?}");
    }
}
