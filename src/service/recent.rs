//! The trigger ids this replica recorded or answered lately: a hint that a delivery is a retry, so it is answered from one read of the store instead of a write.
//!
//! A hint, never an answer: a delivery whose (pack, trigger id) is remembered has its first
//! record read from the store, and only that read decides. A remembered id whose record is
//! gone (erased, retention) or was never committed reads as nothing and goes to the sink like
//! any new one; an id recorded through another replica is not remembered here, and the sink
//! answers it as it always has. So the set may forget, collide or go stale without changing an
//! answer: it only spares a retry the writer's transaction.
use std::collections::HashSet;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Mutex;

/// Ids each generation holds. Two generations are kept: an id is remembered for at least the
/// last GENERATION ids seen, and the set never holds more than twice that (16 bytes an id
/// with the table's overhead, about 2 MiB in all).
pub const GENERATION: usize = 65_536;

/// Two generations of hashed (pack, trigger id) keys: the current fills, and when full
/// becomes the older, whose ids are then forgotten at the next turn.
#[derive(Debug)]
pub struct Recent {
    hasher: std::collections::hash_map::RandomState,
    generations: Mutex<Generations>,
    per_generation: usize,
}

#[derive(Debug, Default)]
struct Generations {
    current: HashSet<u64>,
    older: HashSet<u64>,
}

impl Default for Recent {
    fn default() -> Self {
        Recent::new(GENERATION)
    }
}

impl Recent {
    pub fn new(per_generation: usize) -> Recent {
        Recent {
            hasher: std::collections::hash_map::RandomState::new(),
            generations: Mutex::new(Generations::default()),
            per_generation: per_generation.max(1),
        }
    }

    fn key(&self, pack_id: &str, trigger_id: &str) -> u64 {
        let mut h = self.hasher.build_hasher();
        pack_id.hash(&mut h);
        trigger_id.hash(&mut h);
        h.finish()
    }

    fn generations(&self) -> std::sync::MutexGuard<'_, Generations> {
        // Every update is one insert or one swap: a panic cannot leave it half-done.
        self.generations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether `trigger_id` of `pack_id` was noted lately (or one colliding with it).
    pub fn seen(&self, pack_id: &str, trigger_id: &str) -> bool {
        let k = self.key(pack_id, trigger_id);
        let g = self.generations();
        g.current.contains(&k) || g.older.contains(&k)
    }

    /// Notes that `trigger_id` of `pack_id` has a record.
    pub fn note(&self, pack_id: &str, trigger_id: &str) {
        let k = self.key(pack_id, trigger_id);
        let mut g = self.generations();
        if g.current.len() >= self.per_generation {
            let full = std::mem::take(&mut g.current);
            g.older = full;
        }
        g.current.insert(k);
    }

    /// Ids held now, both generations.
    #[cfg(test)]
    fn held(&self) -> usize {
        let g = self.generations();
        g.current.len() + g.older.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_noted_is_seen_for_its_pack_only() {
        let r = Recent::new(4);
        r.note("github", "d-1");
        assert!(r.seen("github", "d-1"));
        assert!(!r.seen("github", "d-2"));
        assert!(!r.seen("gitlab", "d-1"), "another pack's id is another key");
        // (pack, id) pairs that join to the same text are different keys.
        r.note("ab", "c");
        assert!(!r.seen("a", "bc"));
    }

    #[test]
    fn the_last_generation_is_remembered_and_the_set_is_bounded() {
        let r = Recent::new(4);
        for n in 0..4 {
            r.note("p", &n.to_string());
        }
        // The fifth starts a generation: the first four are the older one, still seen.
        r.note("p", "4");
        assert!((0..5).all(|n| r.seen("p", &n.to_string())));
        for n in 5..8 {
            r.note("p", &n.to_string());
        }
        assert_eq!(r.held(), 8, "two generations of four at most");
        // The ninth turns the generations again: 0..4 are forgotten, 4..9 remembered.
        r.note("p", "8");
        assert!((0..4).all(|n| !r.seen("p", &n.to_string())));
        assert!((4..9).all(|n| r.seen("p", &n.to_string())));
        assert!(r.held() <= 8);
    }
}
