//! Answers of committed records on their way to their callers: a window of them at a time handed to the server's runtime, the rest held in turns by pack.
//!
//! A writer answers a batch from its own thread, and each answer queues its caller on the
//! server's runtime behind every caller answered before it and not yet run: under a flood,
//! hundreds of the flood's calls, about 10 ms of the runtime's work on two cores, ahead of a
//! quiet pack's one answer whatever order the sink committed them in. So at most `window`
//! answers are out at a time; the others wait here, served round-robin by pack (fq_codel's
//! new flows first, as in `fair::Rounds`), and each caller that runs again hands the next one
//! on from the runtime's own thread. A quiet pack's answer then waits behind at most a
//! window of a flood's, and the flood loses nothing: while answers are held the window is
//! full, so the runtime always has one to run.
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

use crate::fair::Rounds;

/// Answers handed out and not yet taken by their callers: the runtime's queue of callers ready
/// to run again holds no more than this of the sink's.
pub const WINDOW: usize = 64;

/// What a caller receives: the answer, and the ticket that hands the next one on when dropped.
pub type Reply<T> = (T, Ticket<T>);

/// One answer: its caller's pack, the caller, and what it is told.
pub type Answer<T> = (String, oneshot::Sender<Reply<T>>, T);

/// The answers between the sink's writers and their callers. Cheap to share.
pub struct Resume<T> {
    inner: Mutex<Held<T>>,
    window: usize,
}

struct Held<T> {
    /// Answers handed out whose tickets are still alive.
    out: usize,
    held: Rounds<(oneshot::Sender<Reply<T>>, T)>,
}

impl<T> std::fmt::Debug for Resume<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resume").finish_non_exhaustive()
    }
}

/// Held by a caller while it takes its answer: dropping it (once the caller runs again, or
/// with the answer of a caller that went away) frees its place in the window for the next.
pub struct Ticket<T> {
    resume: Option<Arc<Resume<T>>>,
}

impl<T> std::fmt::Debug for Ticket<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ticket")
    }
}

impl<T> Drop for Ticket<T> {
    fn drop(&mut self) {
        if let Some(r) = self.resume.take() {
            r.hand_on(1);
        }
    }
}

impl<T> Resume<T> {
    pub fn new(window: usize) -> Arc<Resume<T>> {
        Arc::new(Resume {
            inner: Mutex::new(Held {
                out: 0,
                held: Rounds::default(),
            }),
            window: window.max(1),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Held<T>> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Answers held now.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.lock().held.len()
    }

    /// Queues a batch's answers in turns by pack and hands out what the window allows. While
    /// nothing is held and the whole batch fits the window (a hub below saturation), the
    /// answers go out as they are, with no turns to take.
    pub fn answer(self: &Arc<Self>, mut answers: Vec<Answer<T>>) {
        let direct = {
            let mut h = self.lock();
            if h.held.is_empty() && h.out + answers.len() <= self.window {
                h.out += answers.len();
                true
            } else {
                for (pack, to, what) in answers.drain(..) {
                    h.held.push(&pack, "", (to, what));
                }
                false
            }
        };
        let mut freed = 0;
        if direct {
            for (_, to, what) in answers {
                if !self.deliver(to, what) {
                    freed += 1;
                }
            }
        }
        if !direct || freed > 0 {
            self.hand_on(freed);
        }
    }

    /// Hands one answer out with its ticket; false when its caller is gone (its place is then
    /// the caller's of this function to free).
    fn deliver(self: &Arc<Self>, to: oneshot::Sender<Reply<T>>, what: T) -> bool {
        let ticket = Ticket {
            resume: Some(self.clone()),
        };
        match to.send((what, ticket)) {
            Ok(()) => true,
            Err((_, mut ticket)) => {
                ticket.resume = None;
                false
            }
        }
    }

    /// Frees `freed` places of the window and fills the window from the held answers. The
    /// answer of a caller already gone frees its place at once, here, in a loop rather than
    /// through its ticket's drop: a crowd of callers gone at once (a client closing its
    /// connection) must not nest one drop inside another.
    fn hand_on(self: &Arc<Self>, mut freed: usize) {
        loop {
            let next = {
                let mut h = self.lock();
                h.out = h.out.saturating_sub(freed);
                let room = self.window.saturating_sub(h.out);
                let mut next = Vec::new();
                if room > 0 {
                    h.held.take(&mut next, room);
                }
                h.out += next.len();
                next
            };
            freed = 0;
            for (_, (to, what)) in next {
                if !self.deliver(to, what) {
                    freed += 1;
                }
            }
            if freed == 0 {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Rx = oneshot::Receiver<Reply<u32>>;

    fn answers(r: &Arc<Resume<u32>>, pack: &str, from: u32, n: u32) -> Vec<Rx> {
        let (rxs, batch): (Vec<_>, Vec<_>) = (from..from + n)
            .map(|i| {
                let (tx, rx) = oneshot::channel();
                (rx, (pack.to_owned(), tx, i))
            })
            .unzip();
        r.answer(batch);
        rxs
    }

    /// The values answered so far, tickets kept.
    fn taken(rxs: &mut [Rx], tickets: &mut Vec<Ticket<u32>>) -> Vec<u32> {
        let mut got = Vec::new();
        for rx in rxs.iter_mut() {
            if let Ok((v, t)) = rx.try_recv() {
                got.push(v);
                tickets.push(t);
            }
        }
        got
    }

    #[test]
    fn no_more_than_the_window_is_out_and_each_ticket_dropped_hands_on_one() {
        let r = Resume::new(4);
        let mut rxs = answers(&r, "flood", 0, 10);
        let mut tickets = Vec::new();
        assert_eq!(taken(&mut rxs, &mut tickets), vec![0, 1, 2, 3]);
        assert_eq!(r.held(), 6);
        tickets.pop();
        assert_eq!(taken(&mut rxs, &mut tickets), vec![4]);
        tickets.clear();
        assert_eq!(taken(&mut rxs, &mut tickets), vec![5, 6, 7, 8]);
        tickets.clear();
        assert_eq!(taken(&mut rxs, &mut tickets), vec![9]);
        assert_eq!(r.held(), 0);
        tickets.clear();
        // Every place free again: a window's worth goes out at once.
        let mut rxs = answers(&r, "flood", 10, 5);
        assert_eq!(taken(&mut rxs, &mut tickets), vec![10, 11, 12, 13]);
    }

    #[test]
    fn a_batch_that_fits_the_window_goes_out_whole_and_one_that_does_not_takes_turns() {
        let r = Resume::new(4);
        let mut tickets = Vec::new();
        let mut first = answers(&r, "a", 0, 3);
        assert_eq!(taken(&mut first, &mut tickets), vec![0, 1, 2]);
        // One place left: one of the next two goes out, the other waits its turn.
        let mut next = answers(&r, "b", 10, 2);
        assert_eq!(taken(&mut next, &mut tickets), vec![10]);
        assert_eq!(r.held(), 1);
        // The callers run again: the one held goes out, and the window has room again.
        tickets.clear();
        let mut later = answers(&r, "c", 20, 1);
        assert_eq!(taken(&mut next, &mut tickets), vec![11]);
        assert_eq!(taken(&mut later, &mut tickets), vec![20]);
    }

    #[test]
    fn a_quiet_pack_answered_after_a_flood_is_next_out_not_behind_the_flood() {
        let r = Resume::new(2);
        let mut flood = answers(&r, "flood", 0, 100);
        let mut quiet = answers(&r, "quiet", 1000, 1);
        let mut tickets = Vec::new();
        assert_eq!(taken(&mut flood, &mut tickets), vec![0, 1]);
        // One caller runs again: the next out is the quiet pack's, though 98 of the flood's
        // were held before it.
        tickets.pop();
        assert_eq!(taken(&mut quiet, &mut tickets), vec![1000]);
        assert_eq!(taken(&mut flood, &mut tickets), Vec::<u32>::new());
    }

    #[test]
    fn answers_of_callers_gone_free_their_places_without_a_ticket() {
        let r = Resume::new(1);
        let mut rxs = answers(&r, "p", 0, 3);
        // The first is out; its caller goes away with it unread, and so does the next one's,
        // handed out in its place.
        drop(rxs.remove(0));
        drop(rxs.remove(0));
        let mut tickets = Vec::new();
        assert_eq!(taken(&mut rxs, &mut tickets), vec![2]);
        assert_eq!(r.held(), 0);
        tickets.clear();
        // One out, and 10,000 held whose callers all went away before their answers: when the
        // one out runs again, the dead are passed over in a loop (no chain of drops) and the
        // one after them answered.
        let mut first = answers(&r, "p", 10, 1);
        assert_eq!(taken(&mut first, &mut tickets), vec![10]);
        drop(answers(&r, "p", 11, 10_000));
        let mut last = answers(&r, "p", 20_000, 1);
        assert_eq!(r.held(), 10_001);
        tickets.clear();
        assert_eq!(taken(&mut last, &mut tickets), vec![20_000]);
        assert_eq!(r.held(), 0);
    }
}
