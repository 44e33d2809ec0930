//! Long-lived streams (reflection, health Watch, WatchRecords, DeliverTriggers), counted per peer and in total: past a cap an unauthenticated stream is refused, and an authenticated one ends the oldest unauthenticated stream to make room.
//!
//! A stream holds memory and a task for as long as its caller keeps it, and the open ones
//! (reflection, health Watch) need no credentials, so without a bound any host could hold the
//! server's every stream. Each kind counts against the caps of its peer (an IPv4 address, an
//! IPv6 /64) and of the process; reflection has caps of its own as well, as it is only a
//! debugging aid. An unauthenticated stream past a cap is refused RESOURCE_EXHAUSTED, naming
//! the cap; an authenticated stream (a runtime's DeliverTriggers, a WatchRecords) past one
//! first ends, UNAVAILABLE, the oldest unauthenticated stream under the same cap — of the peer
//! at the peer's cap, of anyone at the total — and is refused only when there is none: a
//! caller without credentials can never keep a runtime out. The server's own MCP door opens
//! its WatchRecords in process, crossing no socket: those count in the total alone, the door
//! capping them per caller itself (crate::mcp).
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use tonic::Status;

use super::lifetime::Ender;
use crate::error::Error;
use crate::sockets::Peer;

/// The kinds of long-lived stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// grpc.health.v1.Health/Watch: open to all.
    HealthWatch,
    /// grpc.reflection.*/ServerReflectionInfo: open to all.
    Reflection,
    /// A stream opened with credentials (WatchRecords, DeliverTriggers).
    Authenticated,
}

impl Kind {
    /// The kind of the stream a method opens, if it opens one.
    pub fn of(path: &str) -> Option<Kind> {
        if path == "/grpc.health.v1.Health/Watch" {
            return Some(Kind::HealthWatch);
        }
        if path.starts_with("/grpc.reflection.") && path.ends_with("/ServerReflectionInfo") {
            return Some(Kind::Reflection);
        }
        None
    }

    fn open(self) -> bool {
        self != Kind::Authenticated
    }
}

/// The caps (each at least 1).
#[derive(Debug, Clone, Copy)]
pub struct StreamCaps {
    /// Long-lived streams of every kind, in all.
    pub total: usize,
    /// Long-lived streams of every kind, per peer.
    pub per_peer: usize,
    /// Reflection streams, in all.
    pub reflection: usize,
    /// Reflection streams, per peer.
    pub reflection_per_peer: usize,
}

/// What a stream ended to make room is told.
pub const SHED: &str =
    "stream ended to make room for an authenticated stream (a stream cap was reached); open it again";

struct Entry {
    /// `None` for the server's own door (counted in the total alone).
    peer: Option<Option<Peer>>,
    kind: Kind,
    ender: Option<Ender>,
}

#[derive(Default)]
struct Open {
    /// By id: ids grow with time, so the first is the oldest.
    streams: BTreeMap<u64, Entry>,
    per_peer: HashMap<Option<Peer>, usize>,
    reflection_per_peer: HashMap<Option<Peer>, usize>,
    reflection: usize,
    next_id: u64,
}

/// The long-lived streams of one server.
pub struct Streams {
    caps: StreamCaps,
    open: Mutex<Open>,
}

impl std::fmt::Debug for Streams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streams").field("caps", &self.caps).finish()
    }
}

/// An admitted stream's place, given back when dropped.
pub struct StreamSlot {
    id: u64,
    streams: Arc<Streams>,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut open = self.streams.lock();
        remove(&mut open, self.id);
    }
}

fn dec(map: &mut HashMap<Option<Peer>, usize>, peer: Option<Option<Peer>>) {
    let Some(peer) = peer else { return };
    if let Some(n) = map.get_mut(&peer) {
        *n -= 1;
        if *n == 0 {
            map.remove(&peer);
        }
    }
}

fn remove(open: &mut Open, id: u64) -> Option<Entry> {
    let e = open.streams.remove(&id)?;
    dec(&mut open.per_peer, e.peer);
    if e.kind == Kind::Reflection {
        open.reflection -= 1;
        dec(&mut open.reflection_per_peer, e.peer);
    }
    Some(e)
}

impl Streams {
    pub fn new(caps: StreamCaps) -> Arc<Streams> {
        Arc::new(Streams {
            caps: StreamCaps {
                total: caps.total.max(1),
                per_peer: caps.per_peer.max(1),
                reflection: caps.reflection.max(1),
                reflection_per_peer: caps.reflection_per_peer.max(1),
            },
            open: Mutex::new(Open::default()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Open> {
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Long-lived streams open now.
    pub fn len(&self) -> usize {
        self.lock().streams.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Admits a stream of `kind` from `peer`, ending another to make room when `kind` is
    /// authenticated (see the module's opening); RESOURCE_EXHAUSTED naming the cap otherwise.
    /// The slot's ender is set with [`StreamSlot::set_ender`] once the answer's body exists.
    pub fn admit(self: &Arc<Self>, peer: Option<Peer>, kind: Kind) -> Result<StreamSlot, Error> {
        self.admit_from(Some(peer), kind)
    }

    /// Admits an authenticated stream the server's own MCP door opened in process: under the
    /// total alone, as `admit` does there (the door caps its callers' subscriptions itself).
    pub fn admit_own(self: &Arc<Self>) -> Result<StreamSlot, Error> {
        self.admit_from(None, Kind::Authenticated)
    }

    fn admit_from(
        self: &Arc<Self>,
        from: Option<Option<Peer>>,
        kind: Kind,
    ) -> Result<StreamSlot, Error> {
        let caps = self.caps;
        let mut open = self.lock();
        let mut shed = Vec::new();
        if let (Kind::Reflection, Some(peer)) = (kind, from) {
            if open.reflection_per_peer.get(&peer).copied().unwrap_or(0) >= caps.reflection_per_peer
            {
                return Err(refused(
                    "--max-reflection-streams-per-peer",
                    caps.reflection_per_peer,
                    "reflection streams per peer",
                ));
            }
            if open.reflection >= caps.reflection {
                return Err(refused(
                    "--max-reflection-streams",
                    caps.reflection,
                    "reflection streams in all",
                ));
            }
        }
        let peer_full =
            from.is_some_and(|p| open.per_peer.get(&p).copied().unwrap_or(0) >= caps.per_peer);
        if let (true, Some(peer)) = (peer_full, from) {
            match (kind.open(), oldest_open(&open, Some(peer))) {
                (false, Some(id)) => shed.extend(remove(&mut open, id)),
                _ => {
                    return Err(refused(
                        "--max-streams-per-peer",
                        caps.per_peer,
                        "long-lived streams per peer",
                    ))
                }
            }
        }
        if open.streams.len() >= caps.total {
            match (kind.open(), oldest_open(&open, None)) {
                (false, Some(id)) => shed.extend(remove(&mut open, id)),
                _ => {
                    return Err(refused(
                        "--max-streams",
                        caps.total,
                        "long-lived streams in all",
                    ))
                }
            }
        }
        let id = open.next_id;
        open.next_id += 1;
        open.streams.insert(
            id,
            Entry {
                peer: from,
                kind,
                ender: None,
            },
        );
        if let Some(peer) = from {
            *open.per_peer.entry(peer).or_insert(0) += 1;
        }
        if kind == Kind::Reflection {
            open.reflection += 1;
            if let Some(peer) = from {
                *open.reflection_per_peer.entry(peer).or_insert(0) += 1;
            }
        }
        drop(open);
        for e in shed {
            tracing::debug!(peer = ?e.peer, kind = ?e.kind, "stream ended to make room");
            if let Some(ender) = e.ender {
                ender.end(Status::from(Error::Unavailable(SHED.into())));
            }
        }
        Ok(StreamSlot {
            id,
            streams: self.clone(),
        })
    }
}

impl StreamSlot {
    /// How the stream is ended when it is shed; until it is set (while its answer is being
    /// made) the stream is not shed.
    pub fn set_ender(&self, ender: Ender) {
        if let Some(e) = self.streams.lock().streams.get_mut(&self.id) {
            e.ender = Some(ender);
        }
    }
}

/// The oldest unauthenticated stream (of `peer`, when given) with a way to end it.
fn oldest_open(open: &Open, peer: Option<Option<Peer>>) -> Option<u64> {
    open.streams
        .iter()
        .find(|(_, e)| e.kind.open() && e.ender.is_some() && peer.is_none_or(|p| e.peer == Some(p)))
        .map(|(id, _)| *id)
}

fn refused(flag: &str, n: usize, what: &str) -> Error {
    Error::ResourceExhausted(format!(
        "at most {n} {what} ({flag}); retry later or close another"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpc::lifetime::Endable;

    fn peer(s: &str) -> Option<Peer> {
        Some(Peer::of(s.parse().expect("address")))
    }

    fn caps() -> StreamCaps {
        StreamCaps {
            total: 4,
            per_peer: 3,
            reflection: 2,
            reflection_per_peer: 1,
        }
    }

    /// An admitted stream with a body, as the guard makes it.
    fn stream(s: &Arc<Streams>, p: Option<Peer>, kind: Kind) -> Result<Endable, Error> {
        let slot = s.admit(p, kind)?;
        // A body that never ends by itself, as a stream's.
        let (tx, rx) = tokio::sync::mpsc::channel::<
            Result<http_body::Frame<tonic::codegen::Bytes>, Status>,
        >(1);
        std::mem::forget(tx);
        let inner = tonic::body::Body::new(http_body_util::StreamBody::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ));
        let (body, ender) = Endable::new(inner, None);
        slot.set_ender(ender);
        body.hold(Box::new(slot));
        Ok(body)
    }

    #[tokio::test]
    async fn reflection_has_its_own_caps_per_peer_and_in_all() {
        let s = Streams::new(caps());
        let _a = stream(&s, peer("10.0.0.1"), Kind::Reflection).expect("1 of 1 for the peer");
        let e = s
            .admit(peer("10.0.0.1"), Kind::Reflection)
            .err()
            .expect("n + 1");
        assert!(
            e.to_string().contains("--max-reflection-streams-per-peer"),
            "{e}"
        );
        let _b = stream(&s, peer("10.0.0.2"), Kind::Reflection).expect("2 of 2 in all");
        let e = s
            .admit(peer("10.0.0.3"), Kind::Reflection)
            .err()
            .expect("n + 1");
        assert!(e.to_string().contains("(--max-reflection-streams)"), "{e}");
        drop(_a);
        assert_eq!(s.len(), 1, "a dropped stream gives its place back");
        stream(&s, peer("10.0.0.3"), Kind::Reflection).expect("room again");
    }

    #[tokio::test]
    async fn an_open_stream_past_a_cap_is_refused_and_an_authenticated_one_ends_the_oldest_open() {
        let s = Streams::new(caps());
        let p = peer("10.0.0.1");
        let mut held = Vec::new();
        for i in 0..3 {
            held.push(stream(&s, p, Kind::HealthWatch).unwrap_or_else(|e| panic!("{i}: {e}")));
        }
        let e = s
            .admit(p, Kind::HealthWatch)
            .err()
            .expect("n + 1 of the peer");
        assert!(e.to_string().contains("--max-streams-per-peer"), "{e}");
        // An authenticated stream of the same peer ends the peer's oldest open stream.
        let _auth = stream(&s, p, Kind::Authenticated).expect("room made");
        assert_eq!(s.len(), 3);
        use http_body_util::BodyExt;
        let t = held[0]
            .frame()
            .await
            .expect("a frame")
            .expect("trailers")
            .into_trailers()
            .expect("trailers");
        assert_eq!(t.get("grpc-status").map(|v| v.as_bytes()), Some(&b"14"[..]));
        // The total: 4 in all; a fifth open stream is refused, an authenticated one gets in.
        let _q = stream(&s, peer("10.0.0.2"), Kind::HealthWatch).expect("4 of 4");
        let e = s
            .admit(peer("10.0.0.3"), Kind::HealthWatch)
            .err()
            .expect("n + 1 in all");
        assert!(e.to_string().contains("(--max-streams)"), "{e}");
        let _r = stream(&s, peer("10.0.0.3"), Kind::Authenticated).expect("room made in all");
        assert_eq!(s.len(), 4);
        // With only authenticated streams of the peer, another is refused.
        let _t = stream(&s, p, Kind::Authenticated);
        let mut auth = Vec::new();
        while let Ok(b) = stream(&s, p, Kind::Authenticated) {
            auth.push(b);
        }
        let e = s
            .admit(p, Kind::Authenticated)
            .err()
            .expect("nothing to end");
        assert!(e.to_string().contains("--max-streams"), "{e}");
    }

    #[tokio::test]
    async fn the_doors_own_streams_count_in_the_total_alone() {
        let s = Streams::new(caps());
        let p = peer("127.0.0.1");
        let mut held = Vec::new();
        for i in 0..3 {
            held.push(stream(&s, p, Kind::Authenticated).unwrap_or_else(|e| panic!("{i}: {e}")));
        }
        // The loopback peer is at its cap of 3; the door's own stream is not that peer's.
        let own = s.admit_own().expect("the fourth in all");
        let e = s.admit_own().err().expect("n + 1 in all");
        assert!(e.to_string().contains("(--max-streams)"), "{e}");
        drop(own);
        s.admit_own().expect("room again");
        drop(held);
        assert_eq!(s.len(), 0, "every place given back");
    }
}
