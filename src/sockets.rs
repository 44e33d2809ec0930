//! Client sockets of a listener, counted per peer and in total: at either cap the socket not serving a request that has waited longest is closed to make room, so slow or silent sockets cannot keep real callers out.
//!
//! A cap alone is a lock an attacker holds: sockets that drip a byte now and then, or never
//! finish a handshake, fill it and every real caller waits behind them. So a cap sheds
//! instead: a new socket is let in and, of the sockets not serving a request, the one that
//! has waited longest — since it was accepted, or since its last request ended — goes. A
//! drip or a half handshake has waited since it connected; a client that keeps a socket
//! alive with a request now and then has waited since its last one; a real sender's new
//! socket has waited least, so it is the last to go. Sockets serving a request are never
//! shed. A socket whose only work is an unauthenticated long-lived stream (reflection, health
//! Watch) is not serving a request: it has waited since it was accepted or its last request
//! ended, and may go with its streams.
//!
//! Closing a socket cannot say GOAWAY, so a socket is never shed within a grace period of
//! being accepted or of its last request's end: a client that has just connected, or just
//! been answered, has its next request on the way. A socket that finds its peer's (or the
//! listener's) every socket serving a request or within its grace waits for room, up to the
//! first-request timeout, instead of being closed; a peer may have at most its cap of sockets
//! waiting so, and further ones are closed.
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{IpAddr, Ipv6Addr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// Who a socket counts against: an IPv4 address, or an IPv6 /64 (one host's share of a
/// network, which a single machine can spread its addresses over).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Peer {
    V4([u8; 4]),
    V6([u8; 8]),
}

impl Peer {
    pub fn of(ip: IpAddr) -> Peer {
        match ip {
            IpAddr::V4(v4) => Peer::V4(v4.octets()),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Peer::V4(v4.octets()),
                None => {
                    let o = v6.octets();
                    let mut net = [0u8; 8];
                    net.copy_from_slice(&o[..8]);
                    Peer::V6(net)
                }
            },
        }
    }

    fn v6_net(net: [u8; 8]) -> Ipv6Addr {
        let mut o = [0u8; 16];
        o[..8].copy_from_slice(&net);
        Ipv6Addr::from(o)
    }
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Peer::V4(o) => write!(f, "{}", std::net::Ipv4Addr::from(o)),
            Peer::V6(net) => write!(f, "{}/64", Peer::v6_net(net)),
        }
    }
}

/// Sockets one peer may have waiting for room at least, whatever its cap: a burst of new
/// connections from one host (a pool starting) waits rather than fails.
pub const MIN_WAITING_PER_PEER: usize = 256;

/// Set in `Slot::busy` when the socket is shed: a request starting after it is on a socket
/// that is closing.
const SHED: usize = 1 << (usize::BITS - 1);

/// One admitted socket: what the listener knows of it, shared with its connection task.
#[derive(Debug)]
pub struct Slot {
    id: u64,
    peer: Peer,
    /// The listener's clock: `waiting_since` counts from it.
    epoch: Instant,
    /// Requests (calls) in flight on the socket, and SHED once it is shed: while any request
    /// is in flight it is never shed.
    busy: AtomicUsize,
    /// Milliseconds from `epoch` to when the socket was accepted or its last request ended.
    waiting_since: AtomicU64,
    /// A request has started on the socket at some time.
    pub served: AtomicBool,
    /// Unauthenticated long-lived streams open on the socket: they keep it open, but do not
    /// keep it from being shed.
    streams: AtomicUsize,
    /// Notified once when the socket is shed; its connection closes.
    pub shed: Arc<Notify>,
}

impl Slot {
    /// A request starts; the socket is busy until the guard is dropped.
    pub fn begin(self: &Arc<Self>) -> Busy {
        self.served.store(true, Ordering::Relaxed);
        self.busy.fetch_add(1, Ordering::AcqRel);
        Busy(self.clone())
    }

    /// An unauthenticated long-lived stream starts: the socket has served, and stays open
    /// while it lasts, but may be shed (see the module's opening).
    pub fn begin_stream(self: &Arc<Self>) -> Streaming {
        self.served.store(true, Ordering::Relaxed);
        self.streams.fetch_add(1, Ordering::AcqRel);
        Streaming(self.clone())
    }

    /// Unauthenticated long-lived streams open now.
    pub fn streams(&self) -> usize {
        self.streams.load(Ordering::Acquire)
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.busy.load(Ordering::Acquire) & !SHED
    }

    pub fn peer(&self) -> Peer {
        self.peer
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// A request in flight on a socket.
#[derive(Debug)]
pub struct Busy(Arc<Slot>);

impl Drop for Busy {
    fn drop(&mut self) {
        // Waiting again from now: stored before the request counts as ended, so a socket is
        // never seen idle with the time it was last busy.
        self.0
            .waiting_since
            .store(self.0.now_ms(), Ordering::Relaxed);
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An unauthenticated long-lived stream open on a socket.
#[derive(Debug)]
pub struct Streaming(Arc<Slot>);

impl Drop for Streaming {
    fn drop(&mut self) {
        self.0.streams.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Which cap a shed socket made room under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cap {
    Peer,
    Total,
}

impl Cap {
    pub fn as_str(self) -> &'static str {
        match self {
            Cap::Peer => "peer_cap",
            Cap::Total => "total_cap",
        }
    }
}

/// The caps of one listener.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    pub total: usize,
    pub per_peer: usize,
    /// A socket is not shed within this of being accepted or of its last request's end.
    pub grace: Duration,
}

#[derive(Debug)]
struct Open {
    /// By id: ids grow with time, so the first is the oldest.
    slots: BTreeMap<u64, Arc<Slot>>,
    per_peer: HashMap<Peer, usize>,
    /// Sockets of each peer waiting for room, oldest first: its id and how it is told to go.
    waiting: HashMap<Peer, VecDeque<(u64, Arc<Notify>)>>,
    next_id: u64,
}

/// What became of a socket asked to be admitted.
#[derive(Debug)]
pub enum Admission {
    /// In, holding `Held` until it closes; `shed` names the peer of a socket closed to make
    /// room, and the cap that was reached.
    In {
        held: Held,
        shed: Option<(Peer, Cap)>,
    },
    /// The peer is at its cap and every socket of its is serving a request.
    PeerBusy,
    /// The listener is at its cap and every socket is serving a request: wait for one to close.
    Full,
}

/// The sockets of one listener.
#[derive(Debug)]
pub struct Sockets {
    caps: Caps,
    epoch: Instant,
    open: Mutex<Open>,
    /// Notified whenever a socket closes.
    pub closed: Notify,
}

impl Sockets {
    pub fn new(caps: Caps) -> Arc<Sockets> {
        Arc::new(Sockets {
            caps: Caps {
                total: caps.total.max(1),
                per_peer: caps.per_peer.max(1),
                grace: caps.grace,
            },
            epoch: Instant::now(),
            open: Mutex::new(Open {
                slots: BTreeMap::new(),
                per_peer: HashMap::new(),
                waiting: HashMap::new(),
                next_id: 0,
            }),
            closed: Notify::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Open> {
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Lets a socket from `ip` in, shedding another at a cap (see the module's opening).
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Admission {
        let peer = Peer::of(ip);
        let mut open = self.lock();
        let of_peer = open.per_peer.get(&peer).copied().unwrap_or(0);
        let mut shed = None;
        let grace = self.grace_ms();
        if of_peer >= self.caps.per_peer {
            match victim(&open, Some(peer), grace) {
                Some(v) => shed = Some((remove(&mut open, v), Cap::Peer)),
                None => return Admission::PeerBusy,
            }
        } else if open.slots.len() >= self.caps.total {
            match victim(&open, None, grace) {
                Some(v) => shed = Some((remove(&mut open, v), Cap::Total)),
                None => return Admission::Full,
            }
        }
        let id = open.next_id;
        open.next_id += 1;
        let slot = Arc::new(Slot {
            id,
            peer,
            epoch: self.epoch,
            busy: AtomicUsize::new(0),
            waiting_since: AtomicU64::new(0),
            served: AtomicBool::new(false),
            streams: AtomicUsize::new(0),
            shed: Arc::new(Notify::new()),
        });
        slot.waiting_since.store(slot.now_ms(), Ordering::Relaxed);
        open.slots.insert(id, slot.clone());
        *open.per_peer.entry(peer).or_insert(0) += 1;
        drop(open);
        let shed = shed.map(|(s, cap)| {
            // A permit is stored if the connection is not waiting yet: it closes when it does.
            s.shed.notify_one();
            (s.peer, cap)
        });
        Admission::In {
            held: Held {
                slot,
                sockets: self.clone(),
            },
            shed,
        }
    }

    /// Milliseconds from the listener's epoch before which a socket must have started waiting
    /// to be shed now; `None` when none can have (the listener is younger than the grace).
    fn grace_ms(&self) -> Option<u64> {
        let now = self.epoch.elapsed().checked_sub(self.caps.grace)?;
        Some(u64::try_from(now.as_millis()).unwrap_or(u64::MAX))
    }

    /// Sockets one peer may have waiting for room: past it, its oldest waiting goes.
    pub fn waiting_per_peer(&self) -> usize {
        self.caps.per_peer.max(MIN_WAITING_PER_PEER)
    }

    /// A place among the sockets of `ip`'s peer waiting for room, and whether another had to
    /// go for it. A peer has at most `waiting_per_peer` of them: past it, the one that has
    /// waited longest is told to go (`Waiting::gone`), as a socket shed at a cap would be.
    /// The listener has at most its cap of them in all: past it, `None` (the socket closes).
    pub fn wait_turn(self: &Arc<Self>, ip: IpAddr) -> Option<(Waiting, bool)> {
        let peer = Peer::of(ip);
        let per_peer = self.waiting_per_peer();
        let mut open = self.lock();
        let id = open.next_id;
        open.next_id += 1;
        let in_all: usize = open.waiting.values().map(VecDeque::len).sum();
        let queue = open.waiting.entry(peer).or_default();
        let mut dropped = false;
        if queue.len() >= per_peer {
            if let Some((_, gone)) = queue.pop_front() {
                gone.notify_one();
                dropped = true;
            }
        } else if in_all >= self.caps.total {
            if queue.is_empty() {
                open.waiting.remove(&peer);
            }
            return None;
        }
        let gone = Arc::new(Notify::new());
        queue.push_back((id, gone.clone()));
        Some((
            Waiting {
                peer,
                id,
                gone,
                sockets: self.clone(),
            },
            dropped,
        ))
    }

    /// Sockets of `ip`'s peer waiting for room now.
    pub fn waiting(&self, ip: IpAddr) -> usize {
        self.lock()
            .waiting
            .get(&Peer::of(ip))
            .map_or(0, VecDeque::len)
    }

    /// Sockets open now.
    pub fn len(&self) -> usize {
        self.lock().slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A socket waiting for room, counted against its peer's cap of them until dropped.
#[derive(Debug)]
pub struct Waiting {
    peer: Peer,
    id: u64,
    /// Notified when a newer socket of the peer took its place.
    pub gone: Arc<Notify>,
    sockets: Arc<Sockets>,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let mut open = self.sockets.lock();
        if let Some(q) = open.waiting.get_mut(&self.peer) {
            q.retain(|(id, _)| *id != self.id);
            if q.is_empty() {
                open.waiting.remove(&self.peer);
            }
        }
    }
}

/// The socket to shed, marked SHED: of those not serving a request (of `peer`, when given)
/// and waiting since before `before` (ms from the epoch: past their grace), the one waiting
/// longest. A socket whose request starts meanwhile is passed over.
fn victim(open: &Open, peer: Option<Peer>, before: Option<u64>) -> Option<u64> {
    let before = before?;
    let idle = || {
        open.slots
            .values()
            .filter(move |s| peer.is_none_or(|p| s.peer == p))
            .filter(|s| s.busy.load(Ordering::Acquire) == 0)
            .filter(move |s| s.waiting_since.load(Ordering::Relaxed) <= before)
    };
    let shed = |s: &Arc<Slot>| {
        s.busy
            .compare_exchange(0, SHED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    };
    let longest = |s: &&Arc<Slot>| (s.waiting_since.load(Ordering::Relaxed), s.id);
    // One pass finds it; only when its request starts meanwhile are the rest put in order.
    let first = idle().min_by_key(longest)?;
    if shed(first) {
        return Some(first.id);
    }
    let mut rest: Vec<&Arc<Slot>> = idle().collect();
    rest.sort_by_key(longest);
    rest.into_iter().find(|s| shed(s)).map(|s| s.id)
}

fn remove(open: &mut Open, id: u64) -> Arc<Slot> {
    let slot = open.slots.remove(&id);
    let slot = slot.unwrap_or_else(|| unreachable!("a victim is an open slot"));
    if let Some(n) = open.per_peer.get_mut(&slot.peer) {
        *n -= 1;
        if *n == 0 {
            open.per_peer.remove(&slot.peer);
        }
    }
    slot
}

/// An admitted socket's place; given back when dropped (the socket closed).
#[derive(Debug)]
pub struct Held {
    pub slot: Arc<Slot>,
    sockets: Arc<Sockets>,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut open = self.sockets.lock();
        // A shed socket was taken out when it was shed.
        if open
            .slots
            .get(&self.slot.id)
            .is_some_and(|s| Arc::ptr_eq(s, &self.slot))
        {
            remove(&mut open, self.slot.id);
        }
        drop(open);
        self.sockets.closed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("address")
    }

    fn admitted(a: Admission) -> (Held, Option<(Peer, Cap)>) {
        match a {
            Admission::In { held, shed } => (held, shed),
            other => panic!("refused: {other:?}"),
        }
    }

    #[test]
    fn a_peer_at_its_cap_sheds_its_socket_waiting_longest_never_a_busy_one() {
        let s = Sockets::new(Caps {
            total: 100,
            per_peer: 3,
            grace: Duration::ZERO,
        });
        let held: Vec<Held> = (0..3)
            .map(|_| admitted(s.admit(ip("10.0.0.1"))).0)
            .collect();
        assert_eq!(s.len(), 3);
        // Another peer is not affected by this one's cap.
        let (_other, shed) = admitted(s.admit(ip("10.0.0.2")));
        assert_eq!(shed, None);
        // The fourth from 10.0.0.1 (n + 1) sheds the one waiting longest: the first.
        let busy = held[1].slot.begin();
        let (fourth, shed) = admitted(s.admit(ip("10.0.0.1")));
        assert_eq!(shed, Some((Peer::of(ip("10.0.0.1")), Cap::Peer)));
        assert!(!s.lock().slots.contains_key(&held[0].slot.id));
        assert_eq!(s.len(), 4);
        // A request that has just ended makes its socket the freshest: the third goes next,
        // not the second (busy until now), and never the busy one.
        std::thread::sleep(std::time::Duration::from_millis(5));
        drop(busy);
        let (_fifth, _) = admitted(s.admit(ip("10.0.0.1")));
        assert!(
            s.lock().slots.contains_key(&held[1].slot.id),
            "just served: kept"
        );
        assert!(!s.lock().slots.contains_key(&held[2].slot.id));
        let _busy = fourth.slot.begin();
        let _busy5 = _fifth.slot.begin();
        let _busy1 = held[1].slot.begin();
        assert!(
            matches!(s.admit(ip("10.0.0.1")), Admission::PeerBusy),
            "every socket of the peer busy"
        );
        drop(held);
        assert_eq!(s.len(), 3, "a shed socket's place is given back once");
    }

    #[test]
    fn at_the_total_cap_the_oldest_idle_socket_goes_and_with_all_busy_the_listener_is_full() {
        let s = Sockets::new(Caps {
            total: 2,
            per_peer: 10,
            grace: Duration::ZERO,
        });
        let (a, _) = admitted(s.admit(ip("10.0.0.1")));
        let (b, _) = admitted(s.admit(ip("10.0.0.2")));
        let (_c, shed) = admitted(s.admit(ip("10.0.0.3")));
        assert_eq!(shed, Some((Peer::of(ip("10.0.0.1")), Cap::Total)));
        let _busy_b = b.slot.begin();
        let _busy_c = _c.slot.begin();
        assert!(matches!(s.admit(ip("10.0.0.4")), Admission::Full));
        drop(a);
        assert_eq!(s.len(), 2);
        let p = Sockets::new(Caps {
            total: 10,
            per_peer: 1,
            grace: Duration::ZERO,
        });
        let (only, _) = admitted(p.admit(ip("10.0.0.1")));
        let _busy = only.slot.begin();
        assert!(matches!(p.admit(ip("10.0.0.1")), Admission::PeerBusy));
    }

    #[test]
    fn a_socket_within_its_grace_is_not_shed_and_one_with_only_open_streams_is() {
        let s = Sockets::new(Caps {
            total: 1000,
            per_peer: 2,
            grace: Duration::from_millis(300),
        });
        let (a, _) = admitted(s.admit(ip("10.0.0.1")));
        let (b, _) = admitted(s.admit(ip("10.0.0.1")));
        // Both just accepted: within their grace, neither goes; the third waits its turn.
        assert!(matches!(s.admit(ip("10.0.0.1")), Admission::PeerBusy));
        let n = s.waiting_per_peer();
        assert_eq!(n, MIN_WAITING_PER_PEER);
        let turns: Vec<Waiting> = (0..n)
            .map(|_| {
                let (w, dropped) = s.wait_turn(ip("10.0.0.1")).expect("a turn");
                assert!(!dropped, "n wait");
                w
            })
            .collect();
        let (newest, dropped) = s.wait_turn(ip("10.0.0.1")).expect("a turn");
        assert!(dropped, "n + 1 waiting: the oldest goes");
        assert_eq!(s.waiting(ip("10.0.0.1")), n);
        let (_other, dropped) = s.wait_turn(ip("10.0.0.2")).expect("a turn");
        assert!(!dropped, "another peer has its own");
        drop(turns);
        drop(newest);
        assert_eq!(s.waiting(ip("10.0.0.1")), 0, "given back");
        // At most the listener's cap wait in all.
        let small = Sockets::new(Caps {
            total: 2,
            per_peer: 1,
            grace: Duration::ZERO,
        });
        let _w1 = small.wait_turn(ip("10.0.0.1")).expect("1 of 2");
        let _w2 = small.wait_turn(ip("10.0.0.2")).expect("2 of 2");
        assert!(small.wait_turn(ip("10.0.0.3")).is_none(), "n + 1 in all");
        // Past the grace: `a` only holds an open stream, so it may go; `b` serves a call.
        let _stream = a.slot.begin_stream();
        let _busy = b.slot.begin();
        std::thread::sleep(Duration::from_millis(350));
        let (_c, shed) = admitted(s.admit(ip("10.0.0.1")));
        assert_eq!(shed, Some((Peer::of(ip("10.0.0.1")), Cap::Peer)));
        assert!(!s.lock().slots.contains_key(&a.slot.id));
        assert!(s.lock().slots.contains_key(&b.slot.id));
    }

    #[test]
    fn an_ipv6_peer_is_its_64_and_a_mapped_ipv4_is_the_ipv4() {
        assert_eq!(
            Peer::of(ip("2001:db8::1")),
            Peer::of(ip("2001:db8::ffff:1"))
        );
        assert_ne!(Peer::of(ip("2001:db8::1")), Peer::of(ip("2001:db8:0:1::1")));
        assert_eq!(Peer::of(ip("::ffff:10.0.0.1")), Peer::of(ip("10.0.0.1")));
        assert_eq!(Peer::of(ip("2001:db8::1")).to_string(), "2001:db8::/64");
    }
}
