//! The MCP door's live subscriptions, counted per caller (its credentials) and in all: past a cap a new one is refused RESOURCE_EXHAUSTED naming the cap, as a gRPC stream past its cap is.
//!
//! Every subscription is a WatchRecords of the API opened from this server's own loopback
//! address, so the API's per-peer stream cap sees the door's subscriptions as one peer's: the
//! door's own caps keep one caller from taking the others' share.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use crate::error::Error;

/// Who a caller is, for the door's caps: the identity its credentials authenticate as (kind
/// and name), hashed; every caller of a server without authentication is one. Not the header's
/// text, which one identity can spell many ways (`Bearer  t`, `Bearer t `).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CallerKey(pub [u8; 32]);

impl CallerKey {
    /// The key of an authenticated identity (`Identity::bucket`), or of everyone (`None`).
    pub fn of(identity: Option<&str>) -> CallerKey {
        CallerKey(Sha256::digest(identity.unwrap_or_default()).into())
    }
}

/// The caps (each at least 1).
#[derive(Debug, Clone, Copy)]
pub struct SubscriptionCaps {
    /// Open subscriptions in all.
    pub total: usize,
    /// Open subscriptions of one caller (one authenticated identity).
    pub per_caller: usize,
}

/// What a door's refusals call its streams and their caps' options.
#[derive(Debug, Clone, Copy)]
pub struct Names {
    /// What one is (`live subscriptions`).
    pub what: &'static str,
    /// The door (`the MCP door`).
    pub door: &'static str,
    pub per_caller_option: &'static str,
    pub total_option: &'static str,
}

/// The MCP door's names.
const MCP: Names = Names {
    what: "live subscriptions",
    door: "the MCP door",
    per_caller_option: "--mcp-max-subscriptions-per-caller",
    total_option: "--mcp-max-subscriptions",
};

/// The subscriptions open now.
#[derive(Debug)]
pub struct Subscriptions {
    caps: SubscriptionCaps,
    names: Names,
    open: Mutex<Open>,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    per_caller: HashMap<[u8; 32], usize>,
}

/// One open subscription; dropping it closes it.
#[derive(Debug)]
pub struct Held {
    of: Arc<Subscriptions>,
    caller: [u8; 32],
}

impl Subscriptions {
    pub fn new(caps: SubscriptionCaps) -> Arc<Subscriptions> {
        Subscriptions::named(caps, MCP)
    }

    /// Caps whose refusals use `names` (another door's streams).
    pub fn named(caps: SubscriptionCaps, names: Names) -> Arc<Subscriptions> {
        Arc::new(Subscriptions {
            names,
            caps: SubscriptionCaps {
                total: caps.total.max(1),
                per_caller: caps.per_caller.max(1),
            },
            open: Mutex::new(Open::default()),
        })
    }

    /// Opens a subscription for `caller` (its [`CallerKey`]), or refuses it past a cap.
    pub fn open(self: &Arc<Self>, caller: CallerKey) -> Result<Held, Error> {
        let CallerKey(caller) = caller;
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mine = open.per_caller.get(&caller).copied().unwrap_or(0);
        if mine >= self.caps.per_caller {
            return Err(Error::ResourceExhausted(format!(
                "this caller has {mine} {} open, the most one caller may hold ({} {}): end one first",
                self.names.what, self.names.per_caller_option, self.caps.per_caller
            )));
        }
        if open.total >= self.caps.total {
            return Err(Error::ResourceExhausted(format!(
                "{} holds {} {}, its most ({} {}): try again later",
                self.names.door,
                open.total,
                self.names.what,
                self.names.total_option,
                self.caps.total
            )));
        }
        open.total += 1;
        *open.per_caller.entry(caller).or_insert(0) += 1;
        Ok(Held {
            of: self.clone(),
            caller,
        })
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut open = self
            .of
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.per_caller.get_mut(&self.caller) {
            *n -= 1;
            if *n == 0 {
                open.per_caller.remove(&self.caller);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cap_takes_n_and_refuses_the_next_and_a_closed_one_makes_room() {
        let subs = Subscriptions::new(SubscriptionCaps {
            total: 3,
            per_caller: 2,
        });
        let (a, b) = (
            CallerKey::of(Some("token:a")),
            CallerKey::of(Some("token:b")),
        );
        let a1 = subs.open(a).expect("a 1");
        let _a2 = subs.open(a).expect("a 2");
        let e = subs.open(a).expect_err("a 3");
        assert!(
            e.to_string()
                .contains("--mcp-max-subscriptions-per-caller 2"),
            "{e}"
        );
        let _b1 = subs.open(b).expect("b 1: the third in all");
        let e = subs.open(b).expect_err("b 2: a fourth in all");
        assert!(e.to_string().contains("--mcp-max-subscriptions 3"), "{e}");
        drop(a1);
        subs.open(b).expect("room again");
    }
}
