//! The one lifecycle: every background task and thread is started through a `Lifecycle`, watches its signals, and is waited for at shutdown, in one documented order.
//!
//! Shutdown runs in four steps, each after the one before (docs/running.md):
//!
//! 1. **Stop taking** (`begin_stop`, the `stopping` signal): the gRPC server, the HTTP
//!    listeners and the NATS consumers take nothing new; open streams end (resumable); the
//!    policy listener, the records' tail, readiness and retention stop.
//! 2. **Answer what was taken** (`answered`): every task started with `spawn` ends — the
//!    listeners once the requests and messages they took are answered, and the work those
//!    started (an ingress decision, an admin write run to its end).
//! 3. **Flush the sink and the drop log** (`close`, the `closing` signal): what answering
//!    needed ends — the sink's writer threads commit what is queued and end, the check pool's
//!    threads end, and so do the upkeep tasks (`spawn_upkeep`: the drop log's flusher, quota
//!    returns); every thread is joined. The caller then writes the last drop counts.
//! 4. **Close the store** (`Hub::close`).
//!
//! Nothing is stopped by dropping a handle, and nothing runs detached. The one exception is by
//! design: the tasks tonic and hyper own, and those a call or a connection starts for itself (a
//! stream's feeder, a credential's timer, a connection's admission), end with their call or
//! connection, which step 2 waits for through the server that owns them.
use std::future::Future;
use std::sync::{Arc, Mutex};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The service's tasks and threads, and the signals that end them. Cheap to clone: every clone
/// is the same lifecycle.
#[derive(Clone, Debug)]
pub struct Lifecycle(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    /// Step 1 has begun.
    stop: CancellationToken,
    /// Step 3 has begun.
    close: CancellationToken,
    /// Tasks that take work, follow the outside or answer: waited for in step 2.
    taking: TaskTracker,
    /// Tasks that answering needs: ended and waited for in step 3.
    upkeep: TaskTracker,
    /// Threads started, joined in step 3 once they have ended.
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// Threads not ended yet.
    threads_live: tokio::sync::watch::Sender<usize>,
}

/// How many of a lifecycle's tasks and threads are running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Live {
    pub tasks: usize,
    pub threads: usize,
}

/// A signal a task watches: stopping (step 1) or closing (step 3) has begun.
#[derive(Clone, Debug)]
pub struct Signal(CancellationToken);

impl Signal {
    /// Completes once the signal is given (at once if it was).
    pub async fn wait(&self) {
        self.0.cancelled().await
    }

    /// Whether the signal has been given.
    pub fn is_given(&self) -> bool {
        self.0.is_cancelled()
    }

    /// A token cancelled with the signal, for a library that takes one.
    pub fn child_token(&self) -> CancellationToken {
        self.0.child_token()
    }
}

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle::new()
    }
}

impl Lifecycle {
    pub fn new() -> Lifecycle {
        Lifecycle(Arc::new(Inner {
            stop: CancellationToken::new(),
            close: CancellationToken::new(),
            taking: TaskTracker::new(),
            upkeep: TaskTracker::new(),
            threads: Mutex::new(Vec::new()),
            threads_live: tokio::sync::watch::channel(0).0,
        }))
    }

    /// Given when stopping begins (step 1): take nothing new, answer what was taken, end.
    /// A child of the lifecycle's own token, so a holder cannot stop the others.
    pub fn stopping(&self) -> Signal {
        Signal(self.0.stop.child_token())
    }

    /// Given when closing begins (step 3), after every `spawn`ed task has ended.
    pub fn closing(&self) -> Signal {
        Signal(self.0.close.child_token())
    }

    /// Starts a task that takes work or follows the outside: it watches `stopping`, answers
    /// what it took, and ends; step 2 waits for it.
    pub fn spawn<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.0.taking.spawn(task)
    }

    /// Starts upkeep that answering needs (a flusher, a sweep): it watches `closing`;
    /// step 3 waits for it.
    pub fn spawn_upkeep<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.0.upkeep.spawn(task)
    }

    /// Runs `f` as closing begins: what tells a thread to end (closing the queue it takes from).
    pub fn on_close(&self, f: impl FnOnce() + Send + 'static) {
        let closing = self.closing();
        self.spawn_upkeep(async move {
            closing.wait().await;
            f();
        });
    }

    /// Starts an OS thread named `name`, joined in step 3: it must end once an `on_close`
    /// has told it to.
    pub fn thread(&self, name: String, f: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
        self.0.threads_live.send_modify(|n| *n += 1);
        let inner = self.0.clone();
        let spawned = std::thread::Builder::new().name(name).spawn(move || {
            // Counted as ended even when `f` panics.
            let _ended = ThreadEnded(inner);
            f();
        });
        match spawned {
            Ok(handle) => {
                self.threads().push(handle);
                Ok(())
            }
            Err(e) => {
                self.0.threads_live.send_modify(|n| *n -= 1);
                Err(e)
            }
        }
    }

    /// Step 1: stopping begins. Idempotent.
    pub fn begin_stop(&self) {
        self.0.stop.cancel();
    }

    /// Step 2: stopping begun (if it was not), completes once every `spawn`ed task has ended.
    /// Tasks started meanwhile (work a listener took before it stopped) are waited for too.
    pub async fn answered(&self) {
        self.begin_stop();
        self.0.taking.close();
        self.0.taking.wait().await;
    }

    /// Step 3: closing begins; completes once every upkeep task and every thread has ended,
    /// the threads joined.
    pub async fn close(&self) {
        self.begin_stop();
        self.0.close.cancel();
        self.0.upkeep.close();
        self.0.upkeep.wait().await;
        let mut live = self.0.threads_live.subscribe();
        let _ = live.wait_for(|n| *n == 0).await;
        // Every thread has left its work; joining reaps each as it exits, off the runtime's
        // workers.
        let ended = std::mem::take(&mut *self.threads());
        let _ = tokio::task::spawn_blocking(move || {
            for t in ended {
                let _ = t.join();
            }
        })
        .await;
    }

    /// The tasks and threads running now; both 0 once `close` has completed.
    pub fn live(&self) -> Live {
        Live {
            tasks: self.0.taking.len() + self.0.upkeep.len(),
            threads: *self.0.threads_live.borrow(),
        }
    }

    /// A guard that, when dropped, gives both signals at once: a service dropped without a
    /// shutdown (built and never run, or its run cancelled) still has every task and thread end.
    pub fn ends_on_drop(&self) -> EndOnDrop {
        EndOnDrop(self.clone())
    }

    fn threads(&self) -> std::sync::MutexGuard<'_, Vec<std::thread::JoinHandle<()>>> {
        self.0.threads.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Counts its thread ended when dropped.
struct ThreadEnded(Arc<Inner>);

impl Drop for ThreadEnded {
    fn drop(&mut self) {
        self.0
            .threads_live
            .send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// See `Lifecycle::ends_on_drop`.
#[derive(Debug)]
pub struct EndOnDrop(Lifecycle);

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        self.0 .0.stop.cancel();
        self.0 .0.close.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn each_step_ends_its_own_and_waits_for_them() {
        let life = Lifecycle::new();
        let (stopping, closing) = (life.stopping(), life.closing());
        let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        life.spawn(async move { stopping.wait().await });
        life.spawn_upkeep(async move { closing.wait().await });
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        life.on_close(move || drop(tx));
        let seen = closed.clone();
        life.thread("t".into(), move || {
            let _ = rx.recv();
            seen.store(true, std::sync::atomic::Ordering::SeqCst);
        })
        .expect("thread");
        assert_eq!(
            life.live(),
            Live {
                tasks: 3,
                threads: 1
            }
        );
        tokio::time::timeout(Duration::from_secs(5), life.answered())
            .await
            .expect("step 2");
        assert_eq!(life.live().tasks, 2, "upkeep runs on through step 2");
        assert!(!closed.load(std::sync::atomic::Ordering::SeqCst));
        tokio::time::timeout(Duration::from_secs(5), life.close())
            .await
            .expect("step 3");
        assert_eq!(
            life.live(),
            Live {
                tasks: 0,
                threads: 0
            }
        );
        assert!(closed.load(std::sync::atomic::Ordering::SeqCst));
    }
}
