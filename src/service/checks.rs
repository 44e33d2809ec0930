//! The check pool: CPU work that grows with a request's input (payload schema checks, lint) runs here, on a few threads at low priority off the runtime's workers, behind a bounded queue and a deadline.
//!
//! A check that is cheap for its input (its schema's reckoned work at the payload's size is
//! under `INLINE_UNITS`) runs where it is asked for: handing it over would cost more. Anything
//! larger is queued in its pack's lane, and the threads take the lanes in turn (the sink's round
//! robin, `Rounds`), so one pack's flood of costly payloads delays another pack's check by a
//! check or so, not by the flood's backlog. A lane holds at most a quarter of the queue and the
//! queue at most `--check-queue`; past either the check is UNAVAILABLE at once, and a check not
//! answered by its deadline (shorter than the call's) is UNAVAILABLE too, so a caller never
//! waits into its own deadline. The work of any one check is bounded by lint (`schema::cost::MAX_PATTERN_WORK`,
//! `schema::cost::MAX_COST_PER_NODE`), so a check that outlives its deadline still ends soon.
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::fair::Rounds;
use crate::lifecycle::Lifecycle;

/// Units of work (about a nanosecond each; see `schema::cost::SchemaWork::check_work`) below which a
/// check runs inline on the caller's thread: about a tenth of a millisecond.
pub const INLINE_UNITS: u64 = 100_000;
/// Longest a check may wait and run, whatever the call's timeout.
pub const MAX_CHECK_DEADLINE: Duration = Duration::from_secs(5);
/// The nice value the pool's threads run at: the runtime's workers (and so Health/Check and
/// every other call) come first when the cores are contended.
pub const CHECK_NICE: i32 = 10;

type Job = Box<dyn FnOnce() + Send>;

/// Settings of the check pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckLimits {
    /// Threads running checks (`--check-threads`).
    pub threads: usize,
    /// Checks that may wait for a thread (`--check-queue`); one more is UNAVAILABLE at once.
    /// One pack's lane holds at most a quarter of them (`lane_bound`).
    pub queue: usize,
    /// Longest a check may wait and run before its caller is answered UNAVAILABLE.
    pub deadline: Duration,
}

impl CheckLimits {
    /// Checks one lane (a pack's payloads, or lint) may hold waiting: a quarter of the queue,
    /// so three other packs always find room.
    pub fn lane_bound(&self) -> usize {
        self.queue.div_ceil(4).max(1)
    }

    /// The deadline of a check for calls that time out after `request_timeout`: half of it,
    /// at most MAX_CHECK_DEADLINE.
    pub fn deadline_for(request_timeout: Duration) -> Duration {
        (request_timeout / 2).min(MAX_CHECK_DEADLINE)
    }
}

impl Default for CheckLimits {
    fn default() -> Self {
        CheckLimits {
            threads: 1,
            queue: 64,
            deadline: MAX_CHECK_DEADLINE,
        }
    }
}

/// The lanes of checks waiting, and whether the pool is stopped.
#[derive(Default)]
struct Lanes {
    rounds: Rounds<Job>,
    stopped: bool,
}

/// The queue the pool's threads take from.
#[derive(Default)]
struct Queue {
    lanes: Mutex<Lanes>,
    ready: Condvar,
}

impl Queue {
    fn lanes(&self) -> MutexGuard<'_, Lanes> {
        self.lanes.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The pool's threads and its queue. Its threads are threads of the lifecycle it was started
/// with, and end when closing begins: after every check asked for has been answered.
pub struct Checks {
    queue: Arc<Queue>,
    limits: CheckLimits,
}

impl std::fmt::Debug for Checks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checks")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl Checks {
    /// Starts the pool's threads as threads of `life`; closing stops the pool (a check asked
    /// for then is UNAVAILABLE) and its threads end once they have run what was queued.
    pub fn start(limits: CheckLimits, life: &Lifecycle) -> Checks {
        let queue = Arc::new(Queue::default());
        for i in 0..limits.threads.max(1) {
            let queue = queue.clone();
            let spawned = life.thread(format!("hcp-check-{i}"), move || run_jobs(&queue));
            if let Err(e) = spawned {
                tracing::error!(error = %e, "a check thread could not be started");
            }
        }
        let closed = queue.clone();
        life.on_close(move || {
            closed.lanes().stopped = true;
            closed.ready.notify_all();
        });
        Checks { queue, limits }
    }

    pub fn limits(&self) -> CheckLimits {
        self.limits
    }

    /// `f`'s answer, computed on the pool in `lane` (a pack's id; lint's is empty); `what`
    /// names the check in a refusal. UNAVAILABLE when the queue or the lane is full, or when
    /// the answer is not there by the deadline.
    pub async fn run<T: Send + 'static>(
        &self,
        lane: &str,
        what: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T> {
        self.queue(lane, what, f)?.answer().await
    }

    /// `f`, queued for the pool in `lane`: UNAVAILABLE at once when the queue or the lane is
    /// full.
    pub fn queue<T: Send + 'static>(
        &self,
        lane: &str,
        what: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<Pending<T>> {
        let (done, answer) = tokio::sync::oneshot::channel();
        let deadline = tokio::time::Instant::now() + self.limits.deadline;
        let until = deadline.into_std();
        let job: Job = Box::new(move || {
            // Nobody waits for an answer past the deadline: a check that waited that long is
            // not started.
            if std::time::Instant::now() < until && !done.is_closed() {
                let _ = done.send(f());
            }
        });
        let mut lanes = self.queue.lanes();
        if lanes.stopped {
            return Err(Error::Unavailable(format!(
                "{what}: the check pool is stopped"
            )));
        }
        if lanes.rounds.len() >= self.limits.queue {
            return Err(Error::Unavailable(format!(
                "{what}: the check queue is full ({} checks waiting, --check-queue); retry",
                self.limits.queue
            )));
        }
        if lanes.rounds.queued(lane) >= self.limits.lane_bound() {
            return Err(Error::Unavailable(format!(
                "{what}: this pack's checks fill its share of the check queue ({} waiting, a quarter of --check-queue); retry",
                self.limits.lane_bound()
            )));
        }
        lanes.rounds.push(lane, "", job);
        drop(lanes);
        self.queue.ready.notify_one();
        Ok(Pending {
            answer,
            deadline,
            what: what.to_owned(),
            limits: self.limits,
        })
    }
}

/// A queued check's answer to come.
pub struct Pending<T> {
    answer: tokio::sync::oneshot::Receiver<T>,
    deadline: tokio::time::Instant,
    what: String,
    limits: CheckLimits,
}

impl<T> Pending<T> {
    /// The answer, or UNAVAILABLE once the deadline passes without one.
    pub async fn answer(self) -> Result<T> {
        match tokio::time::timeout_at(self.deadline, self.answer).await {
            Ok(Ok(v)) => Ok(v),
            _ => Err(Error::Unavailable(format!(
                "{}: not checked within {} ms (the check deadline: half of --request-timeout-secs, at most {} s; {} check threads, --check-threads); retry",
                self.what,
                self.limits.deadline.as_millis(),
                MAX_CHECK_DEADLINE.as_secs(),
                self.limits.threads.max(1)
            ))),
        }
    }
}

fn run_jobs(queue: &Queue) {
    // On Linux the nice value is the calling thread's own.
    if let Err(e) = rustix::process::setpriority_process(None, CHECK_NICE) {
        tracing::debug!(error = %e, "check thread keeps its priority");
    }
    let mut next = Vec::with_capacity(1);
    loop {
        {
            let mut lanes = queue.lanes();
            while lanes.rounds.is_empty() && !lanes.stopped {
                lanes = queue.ready.wait(lanes).unwrap_or_else(|p| p.into_inner());
            }
            if lanes.rounds.is_empty() {
                return;
            }
            lanes.rounds.take(&mut next, 1);
        }
        for (_, job) in next.drain(..) {
            job();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_full_queue_and_a_missed_deadline_are_unavailable() {
        let life = Lifecycle::new();
        let checks = Checks::start(
            CheckLimits {
                threads: 1,
                queue: 1,
                deadline: Duration::from_millis(200),
            },
            &life,
        );
        let (hold, held) = std::sync::mpsc::channel::<()>();
        let (started, running) = std::sync::mpsc::channel::<()>();
        let checks = Arc::new(checks);
        // One running (until released), one queued: the next is refused at once.
        let first = checks
            .queue("pack-a", "first", move || {
                let _ = started.send(());
                let _ = held.recv();
                1
            })
            .expect("queued");
        tokio::task::spawn_blocking(move || running.recv())
            .await
            .expect("joined")
            .expect("started");
        let second = checks.queue("pack-a", "second", || 2).expect("queued");
        let e = checks
            .run("pack-b", "third", || 3)
            .await
            .expect_err("refused");
        assert!(
            matches!(&e, Error::Unavailable(m) if m.contains("--check-queue")),
            "{e:?}"
        );
        // The first is held past its deadline: its caller is told, and the queued second,
        // past its deadline too by then, is never run.
        let e = first.answer().await.expect_err("deadline");
        assert!(
            matches!(&e, Error::Unavailable(m) if m.contains("deadline")),
            "{e:?}"
        );
        assert!(second.answer().await.is_err());
        let _ = hold.send(());
        // Free again once the thread has passed over the second: answered.
        let answered = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Ok(v) = checks.run("pack-a", "fourth", || 4).await {
                    return v;
                }
                tokio::task::yield_now().await;
            }
        });
        assert_eq!(answered.await.expect("answered"), 4);
        tokio::time::timeout(Duration::from_secs(10), life.close())
            .await
            .expect("the pool's thread ends when closing");
    }
    #[tokio::test]
    async fn a_packs_lane_holds_a_quarter_of_the_queue_and_lanes_take_turns() {
        let life = Lifecycle::new();
        let checks = Arc::new(Checks::start(
            CheckLimits {
                threads: 1,
                queue: 8,
                deadline: Duration::from_secs(30),
            },
            &life,
        ));
        assert_eq!(checks.limits().lane_bound(), 2);
        let (hold, held) = std::sync::mpsc::channel::<()>();
        let (started, running) = std::sync::mpsc::channel::<()>();
        let order = Arc::new(Mutex::new(Vec::new()));
        let first = checks
            .queue("flood", "held", move || {
                let _ = started.send(());
                let _ = held.recv();
            })
            .expect("queued");
        tokio::task::spawn_blocking(move || running.recv())
            .await
            .expect("joined")
            .expect("started");
        let mut pending = Vec::new();
        for (lane, n) in [("flood", 1), ("flood", 2)] {
            let order = order.clone();
            pending.push(
                checks
                    .queue(lane, "flood", move || order.lock().expect("order").push(n))
                    .expect("within the lane's share"),
            );
        }
        // The lane's share is full: its next check is refused at once, naming why.
        let e = checks
            .run("flood", "third", || ())
            .await
            .expect_err("over the lane's share");
        assert!(
            matches!(&e, Error::Unavailable(m) if m.contains("share") && m.contains("--check-queue")),
            "{e:?}"
        );
        // Another pack still finds room, and its turn comes before the flood's backlog.
        let quiet = {
            let order = order.clone();
            checks
                .queue("quiet", "quiet", move || {
                    order.lock().expect("order").push(0)
                })
                .expect("another lane")
        };
        let _ = hold.send(());
        first.answer().await.expect("held one");
        quiet.answer().await.expect("quiet");
        for p in pending {
            p.answer().await.expect("flood");
        }
        assert_eq!(*order.lock().expect("order"), vec![1, 0, 2]);
        tokio::time::timeout(Duration::from_secs(10), life.close())
            .await
            .expect("the pool's thread ends when closing");
    }
}
