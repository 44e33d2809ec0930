//! PostgreSQL: copies of the first records this replica read lately for a trigger id, so a retry of one is answered after one statement that confirms the copy instead of two round trips that read the record.
//!
//! A copy is never the answer alone. One statement confirms it: the ledger row of its (pack,
//! trigger id) still names the copy's record, and that record is still in its partition
//! (found by its primary key, the stored time pruning to the one partition). That is what the
//! full read finds: the ledger's row, then the record it names. An erasure or a trim deletes
//! the record with its ledger row; another record that took the id over is named instead; a
//! partition retention detached or someone dropped holds the record no more. A record never
//! changes once written (its id, route, binding and what a retry is compared with), so a
//! confirmed copy answers exactly what reading the record would, whichever replica erased,
//! pruned or recorded meanwhile. A copy not confirmed is forgotten and the record read in full.
//!
//! Held: records read through the ledger (a retry, a dropped trigger whose id was recorded),
//! never the records this replica writes, so the record path pays nothing for it. Bounded by
//! count and by the payloads' bytes, in two generations like `service::recent`. An erasure,
//! made here or announced by another replica, drops the copies of the records it took.
use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::domain::model::{Erasure, Record};
use crate::domain::trigger::json_len;

/// Copies each generation holds at most.
pub const PER_GENERATION: usize = 4_096;
/// Bytes of copies (their payloads' JSON text and their strings) each generation holds at most.
pub const BYTES_PER_GENERATION: usize = 4 << 20;
/// A record larger than this is not copied: its retries read it in full.
pub const LARGEST: usize = 8 << 10;

#[derive(Debug)]
pub struct Answers {
    hasher: RandomState,
    generations: Mutex<Generations>,
    per_generation: usize,
    bytes_per_generation: usize,
}

/// A first record as read, and its stored time (with its id, the key of its row).
#[derive(Debug, Clone)]
pub struct Kept {
    pub record: Arc<Record>,
    pub stored_time: i64,
}

#[derive(Debug, Default)]
struct Generations {
    current: HashMap<u64, Kept>,
    current_bytes: usize,
    older: HashMap<u64, Kept>,
}

impl Default for Answers {
    fn default() -> Self {
        Answers::new(PER_GENERATION, BYTES_PER_GENERATION)
    }
}

impl Answers {
    pub fn new(per_generation: usize, bytes_per_generation: usize) -> Answers {
        Answers {
            hasher: RandomState::new(),
            generations: Mutex::default(),
            per_generation: per_generation.max(1),
            bytes_per_generation,
        }
    }

    fn key(&self, pack_id: &str, trigger_id: &str) -> u64 {
        let mut h = self.hasher.build_hasher();
        pack_id.hash(&mut h);
        trigger_id.hash(&mut h);
        h.finish()
    }

    fn generations(&self) -> MutexGuard<'_, Generations> {
        // Every update is one insert, one removal or one swap: a panic leaves none half-done.
        self.generations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The copy held for a pack's trigger id, if any (another key hashing alike is not it).
    pub fn get(&self, pack_id: &str, trigger_id: &str) -> Option<Kept> {
        let k = self.key(pack_id, trigger_id);
        let g = self.generations();
        g.current
            .get(&k)
            .or_else(|| g.older.get(&k))
            .filter(|c| {
                c.record.pack_id == pack_id && c.record.trigger_id.as_deref() == Some(trigger_id)
            })
            .cloned()
    }

    /// Holds a copy of a record read for its trigger id (one without an id, or too large, is
    /// not held).
    pub fn keep(&self, r: &Arc<Record>, stored_time: i64) {
        let Some(trigger_id) = r.trigger_id.as_deref() else {
            return;
        };
        let bytes = bytes_of(r);
        if bytes > LARGEST {
            return;
        }
        let k = self.key(&r.pack_id, trigger_id);
        let mut g = self.generations();
        if g.current.len() >= self.per_generation
            || g.current_bytes + bytes > self.bytes_per_generation
        {
            g.older = std::mem::take(&mut g.current);
            g.current_bytes = 0;
        }
        g.current_bytes += bytes;
        let copy = Kept {
            record: r.clone(),
            stored_time,
        };
        g.current.insert(k, copy);
    }

    /// Forgets the copy held for a pack's trigger id: the ledger no longer confirms it.
    pub fn forget(&self, pack_id: &str, trigger_id: &str) {
        let k = self.key(pack_id, trigger_id);
        let mut g = self.generations();
        g.current.remove(&k);
        g.older.remove(&k);
    }

    /// Forgets the copies of the records an erasure took (made here or announced by another
    /// replica). They could no longer answer (the ledger would not confirm them), but an
    /// erased record's payload is not kept in memory either until its generation turns.
    pub fn forget_erased(&self, e: &Erasure) {
        let mut g = self.generations();
        g.current.retain(|_, c| !e.covers(&c.record));
        g.older.retain(|_, c| !e.covers(&c.record));
    }

    /// Copies held now, both generations.
    #[cfg(test)]
    fn held(&self) -> usize {
        let g = self.generations();
        g.current.len() + g.older.len()
    }
}

/// What a copy counts against the bounds: its payload's JSON text and its strings.
fn bytes_of(r: &Record) -> usize {
    let strings = [
        &r.record_id,
        &r.principal,
        &r.binding_id,
        &r.land,
        &r.pack_id,
        &r.r#ref,
    ];
    strings
        .iter()
        .map(|s| s.len())
        .sum::<usize>()
        .saturating_add(r.trigger_id.as_deref().map_or(0, str::len))
        .saturating_add(json_len(&r.payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::trigger::Route;

    impl Answers {
        fn keep_at(&self, r: &Arc<Record>) {
            self.keep(r, 7);
        }
    }

    fn record(pack: &str, id: Option<&str>, payload_chars: usize) -> Arc<Record> {
        let mut payload = serde_json::Map::new();
        payload.insert("text".into(), "x".repeat(payload_chars).into());
        Arc::new(Record {
            record_id: format!("r-{}", id.unwrap_or("none")),
            principal: "alice".into(),
            binding_id: "b".into(),
            land: "user".into(),
            pack_id: pack.into(),
            r#ref: "issue.opened".into(),
            payload,
            route: Route::Inbox,
            project: None,
            trigger_id: id.map(str::to_owned),
            received_time: 0,
            position: Default::default(),
        })
    }

    #[test]
    fn a_copy_is_found_under_its_own_pack_and_id_only() {
        let a = Answers::default();
        a.keep_at(&record("github", Some("t-1"), 10));
        a.keep_at(&record("github", None, 10));
        assert_eq!(
            a.get("github", "t-1").map(|c| c.record.record_id.clone()),
            Some("r-t-1".into())
        );
        assert!(a.get("github", "t-2").is_none());
        assert!(a.get("gitlab", "t-1").is_none(), "another pack's id");
        assert_eq!(a.held(), 1, "a record without a trigger id is not held");
        a.forget("github", "t-1");
        assert!(a.get("github", "t-1").is_none());
    }

    #[test]
    fn an_erasure_forgets_the_copies_of_the_records_it_took() {
        let a = Answers::default();
        let at = |pack: &str, id: &str, principal: &str, seq: i64| {
            let mut r = (*record(pack, Some(id), 10)).clone();
            r.principal = principal.into();
            r.position.seq = seq;
            Arc::new(r)
        };
        a.keep_at(&at("github", "t-1", "alice", 1));
        a.keep_at(&at("gitlab", "t-2", "alice", 2));
        a.keep_at(&at("github", "t-3", "alice", 9));
        a.keep_at(&at("github", "t-4", "bob", 3));
        a.forget_erased(&Erasure {
            principal: "alice".into(),
            pack_id: Some("github".into()),
            upto_txid: 0,
            upto_seq: 5,
        });
        assert!(
            a.get("github", "t-1").is_none(),
            "alice's github record up to 5"
        );
        assert!(a.get("gitlab", "t-2").is_some(), "another pack's");
        assert!(
            a.get("github", "t-3").is_some(),
            "a record past the erasure's position"
        );
        assert!(a.get("github", "t-4").is_some(), "another principal's");
        a.forget_erased(&Erasure {
            principal: "alice".into(),
            pack_id: None,
            upto_txid: 0,
            upto_seq: 9,
        });
        assert_eq!(a.held(), 1, "only bob's is left");
    }

    #[test]
    fn a_record_past_the_largest_is_not_held() {
        let a = Answers::default();
        let fixed = bytes_of(&record("github", Some("t-1"), 0));
        assert_eq!(fixed, 36 + r#"{"text":""}"#.len());
        a.keep_at(&record("github", Some("t-1"), LARGEST - fixed));
        assert!(
            a.get("github", "t-1").is_some(),
            "exactly the largest is held"
        );
        a.keep_at(&record("github", Some("t-2"), LARGEST - fixed + 1));
        assert!(a.get("github", "t-2").is_none(), "one byte more is not");
    }

    #[test]
    fn two_generations_are_held_by_count_and_by_bytes() {
        let a = Answers::new(4, usize::MAX);
        for n in 0..5 {
            a.keep_at(&record("p", Some(&n.to_string()), 1));
        }
        assert!((0..5).all(|n| a.get("p", &n.to_string()).is_some()));
        for n in 5..9 {
            a.keep_at(&record("p", Some(&n.to_string()), 1));
        }
        assert!((0..4).all(|n| a.get("p", &n.to_string()).is_none()));
        assert!((4..9).all(|n| a.get("p", &n.to_string()).is_some()));
        assert!(a.held() <= 8);

        // By bytes: each copy here is 1,000 bytes or so; a generation holds two.
        let a = Answers::new(usize::MAX, 2_100);
        for n in 0..5 {
            a.keep_at(&record("p", Some(&n.to_string()), 950));
        }
        assert_eq!(
            a.held(),
            3,
            "the current generation's one and the older's two"
        );
        assert!(a.get("p", "4").is_some() && a.get("p", "1").is_none());
    }
}
