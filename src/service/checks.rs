//! The check pool: CPU work that grows with a request's input (payload schema checks, lint) runs here, on a few threads at low priority off the runtime's workers, behind a bounded queue and a deadline.
//!
//! A check that is cheap for its input (its schema's reckoned work at the payload's size is
//! under `INLINE_UNITS`) runs where it is asked for: handing it over would cost more. Anything
//! larger is queued; a full queue is UNAVAILABLE at once, and a check not answered by its
//! deadline (shorter than the call's) is UNAVAILABLE too, so a caller never waits into its own
//! deadline. The work of any one check is bounded by lint (`schema::MAX_PATTERN_WORK`,
//! `schema::MAX_COST_PER_NODE`), so a check that outlives its deadline still ends soon.
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::{Error, Result};

/// Units of work (about a nanosecond each; see `schema::SchemaWork::check_work`) below which a
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
    pub queue: usize,
    /// Longest a check may wait and run before its caller is answered UNAVAILABLE.
    pub deadline: Duration,
}

impl CheckLimits {
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

/// The pool's threads and its queue. Its threads end when the last handle is dropped.
#[derive(Debug)]
pub struct Checks {
    tx: SyncSender<Job>,
    limits: CheckLimits,
}

impl Checks {
    pub fn start(limits: CheckLimits) -> Checks {
        let (tx, rx) = sync_channel::<Job>(limits.queue);
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..limits.threads.max(1) {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("hcp-check-{i}"))
                .spawn(move || run_jobs(&rx));
            if let Err(e) = spawned {
                tracing::error!(error = %e, "a check thread could not be started");
            }
        }
        Checks { tx, limits }
    }

    pub fn limits(&self) -> CheckLimits {
        self.limits
    }

    /// `f`'s answer, computed on the pool; `what` names the check in a refusal. UNAVAILABLE
    /// when the queue is full, or when the answer is not there by the deadline.
    pub async fn run<T: Send + 'static>(
        &self,
        what: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T> {
        self.queue(what, f)?.answer().await
    }

    /// `f`, queued for the pool: UNAVAILABLE at once when the queue is full.
    pub fn queue<T: Send + 'static>(
        &self,
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
        match self.tx.try_send(job) {
            Ok(()) => Ok(Pending {
                answer,
                deadline,
                what: what.to_owned(),
                limits: self.limits,
            }),
            Err(TrySendError::Full(_)) => Err(Error::Unavailable(format!(
                "{what}: the check queue is full ({} checks waiting, --check-queue); retry",
                self.limits.queue
            ))),
            Err(TrySendError::Disconnected(_)) => Err(Error::Unavailable(format!(
                "{what}: the check pool is stopped"
            ))),
        }
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

fn run_jobs(rx: &Mutex<Receiver<Job>>) {
    // On Linux the nice value is the calling thread's own.
    if let Err(e) = rustix::process::setpriority_process(None, CHECK_NICE) {
        tracing::debug!(error = %e, "check thread keeps its priority");
    }
    loop {
        let job = {
            let rx = rx.lock().unwrap_or_else(|p| p.into_inner());
            match rx.recv() {
                Ok(job) => job,
                Err(_) => return,
            }
        };
        job();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_full_queue_and_a_missed_deadline_are_unavailable() {
        let checks = Checks::start(CheckLimits {
            threads: 1,
            queue: 1,
            deadline: Duration::from_millis(200),
        });
        let (hold, held) = std::sync::mpsc::channel::<()>();
        let (started, running) = std::sync::mpsc::channel::<()>();
        let checks = Arc::new(checks);
        // One running (until released), one queued: the next is refused at once.
        let first = checks
            .queue("first", move || {
                let _ = started.send(());
                let _ = held.recv();
                1
            })
            .expect("queued");
        tokio::task::spawn_blocking(move || running.recv())
            .await
            .expect("joined")
            .expect("started");
        let second = checks.queue("second", || 2).expect("queued");
        let e = checks.run("third", || 3).await.expect_err("refused");
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
                if let Ok(v) = checks.run("fourth", || 4).await {
                    return v;
                }
                tokio::task::yield_now().await;
            }
        });
        assert_eq!(answered.await.expect("answered"), 4);
    }
}
