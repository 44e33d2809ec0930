//! Client sockets of a listener, counted per peer and in total: at either cap the oldest socket that is not serving a request is closed to make room, so slow or silent sockets cannot keep real callers out.
//!
//! A cap alone is a lock an attacker holds: sockets that drip a byte now and then, or never
//! finish a handshake, fill it and every real caller waits behind them. So a cap sheds
//! instead: a new socket is let in and the socket that has waited longest without a request in
//! flight goes — first one that never started a request (a drip, a half handshake), else an
//! idle keep-alive one, whose client reconnects on its next call. Sockets serving a request
//! are never shed; a peer whose every socket is serving one is refused another.
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv6Addr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

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

/// One admitted socket: what the listener knows of it, shared with its connection task.
#[derive(Debug)]
pub struct Slot {
    id: u64,
    peer: Peer,
    /// Requests (calls) in flight on the socket: while any is, it is never shed.
    pub busy: AtomicUsize,
    /// A request has started on the socket at some time.
    pub served: AtomicBool,
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

    pub fn peer(&self) -> Peer {
        self.peer
    }
}

/// A request in flight on a socket.
#[derive(Debug)]
pub struct Busy(Arc<Slot>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The caps of one listener.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    pub total: usize,
    pub per_peer: usize,
}

#[derive(Debug, Default)]
struct Open {
    /// By id: ids grow with time, so the first is the oldest.
    slots: BTreeMap<u64, Arc<Slot>>,
    per_peer: HashMap<Peer, usize>,
    next_id: u64,
}

/// What became of a socket asked to be admitted.
#[derive(Debug)]
pub enum Admission {
    /// In, holding `Held` until it closes; `shed` is the peer of a socket closed to make room.
    In { held: Held, shed: Option<Peer> },
    /// The peer is at its cap and every socket of its is serving a request.
    PeerBusy,
    /// The listener is at its cap and every socket is serving a request: wait for one to close.
    Full,
}

/// The sockets of one listener.
#[derive(Debug)]
pub struct Sockets {
    caps: Caps,
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
            },
            open: Mutex::new(Open::default()),
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
        if of_peer >= self.caps.per_peer {
            match victim(&open, Some(peer)) {
                Some(v) => shed = Some(remove(&mut open, v)),
                None => return Admission::PeerBusy,
            }
        } else if open.slots.len() >= self.caps.total {
            match victim(&open, None) {
                Some(v) => shed = Some(remove(&mut open, v)),
                None => return Admission::Full,
            }
        }
        let id = open.next_id;
        open.next_id += 1;
        let slot = Arc::new(Slot {
            id,
            peer,
            busy: AtomicUsize::new(0),
            served: AtomicBool::new(false),
            shed: Arc::new(Notify::new()),
        });
        open.slots.insert(id, slot.clone());
        *open.per_peer.entry(peer).or_insert(0) += 1;
        drop(open);
        let shed = shed.map(|s| {
            // A permit is stored if the connection is not waiting yet: it closes when it does.
            s.shed.notify_one();
            s.peer
        });
        Admission::In {
            held: Held {
                slot,
                sockets: self.clone(),
            },
            shed,
        }
    }

    /// Sockets open now.
    pub fn len(&self) -> usize {
        self.lock().slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The socket to shed: the oldest not serving a request (of `peer`, when given) that never
/// started one, else the oldest idle one.
fn victim(open: &Open, peer: Option<Peer>) -> Option<u64> {
    let candidates = || {
        open.slots
            .values()
            .filter(|s| peer.is_none_or(|p| s.peer == p))
            .filter(|s| s.busy.load(Ordering::Acquire) == 0)
    };
    candidates()
        .find(|s| !s.served.load(Ordering::Relaxed))
        .or_else(|| candidates().next())
        .map(|s| s.id)
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

    fn admitted(a: Admission) -> (Held, Option<Peer>) {
        match a {
            Admission::In { held, shed } => (held, shed),
            other => panic!("refused: {other:?}"),
        }
    }

    #[test]
    fn a_peer_at_its_cap_sheds_its_own_oldest_idle_socket_never_a_busy_one() {
        let s = Sockets::new(Caps {
            total: 100,
            per_peer: 3,
        });
        let held: Vec<Held> = (0..3)
            .map(|_| admitted(s.admit(ip("10.0.0.1"))).0)
            .collect();
        assert_eq!(s.len(), 3);
        // Another peer is not affected by this one's cap.
        let (_other, shed) = admitted(s.admit(ip("10.0.0.2")));
        assert_eq!(shed, None);
        // The fourth from 10.0.0.1 (n + 1) sheds its oldest: the first.
        let _busy = held[1].slot.begin();
        let (fourth, shed) = admitted(s.admit(ip("10.0.0.1")));
        assert_eq!(shed, Some(Peer::of(ip("10.0.0.1"))));
        assert!(!s.lock().slots.contains_key(&held[0].slot.id));
        assert_eq!(s.len(), 4);
        // The next sheds the oldest never served, skipping the busy one: the third.
        let _b = fourth.slot.begin();
        drop(_b);
        let (_fifth, _) = admitted(s.admit(ip("10.0.0.1")));
        assert!(s.lock().slots.contains_key(&held[1].slot.id), "busy: kept");
        assert!(!s.lock().slots.contains_key(&held[2].slot.id));
        assert!(
            s.lock().slots.contains_key(&fourth.slot.id),
            "served and idle: kept while one never served is there"
        );
        drop(held);
        assert_eq!(s.len(), 3, "a shed socket's place is given back once");
    }

    #[test]
    fn at_the_total_cap_the_oldest_idle_socket_goes_and_with_all_busy_the_listener_is_full() {
        let s = Sockets::new(Caps {
            total: 2,
            per_peer: 10,
        });
        let (a, _) = admitted(s.admit(ip("10.0.0.1")));
        let (b, _) = admitted(s.admit(ip("10.0.0.2")));
        let (_c, shed) = admitted(s.admit(ip("10.0.0.3")));
        assert_eq!(shed, Some(Peer::of(ip("10.0.0.1"))));
        let _busy_b = b.slot.begin();
        let _busy_c = _c.slot.begin();
        assert!(matches!(s.admit(ip("10.0.0.4")), Admission::Full));
        drop(a);
        assert_eq!(s.len(), 2);
        let p = Sockets::new(Caps {
            total: 10,
            per_peer: 1,
        });
        let (only, _) = admitted(p.admit(ip("10.0.0.1")));
        let _busy = only.slot.begin();
        assert!(matches!(p.admit(ip("10.0.0.1")), Admission::PeerBusy));
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
