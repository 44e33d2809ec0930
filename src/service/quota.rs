//! Quotas: admin writes of them, and admission — before a delivery is decided it takes a token from its principal's quota and its pack's; over either it is refused with the time to retry, neither decided nor recorded.
//!
//! On PostgreSQL each quota's bucket is the fleet's, kept in its row: a replica leases at least
//! a twentieth of a second's tokens (`Rule::lease`), and whatever else the bucket holds, and
//! spends them locally, so every replica together admits no more than the bucket allows, give
//! or take the tokens leased and not yet spent (at most a burst per replica, for a second).
//! Tokens not spent within LEASE_TTL are no longer this replica's to spend: they go back to
//! the store's bucket — with the allowance's next lease, or within a second by the sweep that
//! `start_returns` runs — which keeps them as far as its burst holds them, as if they had never
//! left. So a pause loses no tokens, and a token given back is spent only through the store.
//! When several quotas refuse a delivery, it is told the longest of their waits. On SQLite
//! one process serves the store and the bucket is kept in memory.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{unknown_pack, valid_id, valid_pack_id, Delivery, Policy};
use crate::domain::model::KeyPage;
use crate::domain::policy::PolicyView;
use crate::domain::quota::{Bucket, Quota, Rule};
use crate::error::{Error, Result};
use crate::lifecycle::Lifecycle;
use crate::store::audit::Actor;
use crate::store::quota::Lease;
use crate::store::{now_micros, DeliveryTables, Engine};

/// Leased tokens not spent within this long go back to the store's bucket: a replica that
/// stopped taking a pack's deliveries holds none of the fleet's tokens for longer (give or take
/// the sweep's period, as long again).
const LEASE_TTL: Duration = Duration::from_secs(1);
/// Quota allowances kept before idle ones are let go.
const MAX_ALLOWANCES: usize = 65_536;

/// The quota allowances of this replica, one per (pack, principal or "" for the pack) with a quota.
#[derive(Debug)]
pub(super) struct Quotas {
    /// By pack, then by principal ("" for the pack-wide quota): looked up by reference, so an
    /// admission allocates nothing.
    allowances: Mutex<HashMap<String, HashMap<String, Arc<Allowance>>>>,
    /// Buckets are the store's, shared by every replica (PostgreSQL).
    fleet: bool,
    /// The connection leases are taken on, of its own: under a flood the pool is busy with
    /// the refused triggers' idempotency reads, and a lease queued behind them lets the
    /// bucket fill past its burst (docs/performance.md). Opened at the first lease, dropped
    /// when the store did not answer.
    leaser: tokio::sync::Mutex<Option<DeliveryTables>>,
}

#[derive(Debug)]
struct Allowance {
    rule: Rule,
    /// Held only to read and change the state, never across a wait: a flood's callers refused
    /// over quota take turns at a plain lock, not an async queue.
    state: Mutex<AllowanceState>,
    /// The one lease from the store in flight for this allowance (fleet).
    leasing: tokio::sync::Mutex<()>,
}

#[derive(Debug)]
struct AllowanceState {
    /// The bucket itself, when it is kept in memory.
    bucket: Bucket,
    /// Tokens leased from the store's bucket and not yet spent, and when they were leased.
    leased: u32,
    leased_at: Instant,
    /// Tokens leased and not spent within LEASE_TTL: owed back to the store's bucket, with
    /// the next lease or the sweep.
    returning: u32,
    /// The store's bucket was found short: no lease is asked for before then.
    short_until: Option<Instant>,
}

/// A delivery refused over the quota of `pack_id` (or of `principal` on it), with how long until
/// it would admit.
fn over_quota(pack_id: &str, principal: Option<&str>, rule: Rule, retry_after: Duration) -> Error {
    let whose = match principal {
        Some(p) => format!("principal `{p}` of pack `{pack_id}`"),
        None => format!("pack `{pack_id}`"),
    };
    Error::Throttled {
        message: format!(
            "the quota of {whose} ({} per second, burst {}) is spent: nothing was recorded; retry in {} ms",
            rule.rate,
            rule.burst,
            retry_after.as_millis().max(1)
        ),
        retry_after,
        reason: "QUOTA_EXCEEDED",
    }
}

/// What ExplainTrigger says of the quotas a trigger meets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaCheck {
    pub pack: Option<Rule>,
    pub principal: Option<Rule>,
    /// How long until both would admit it; zero: now.
    pub retry_after: Duration,
}

impl Quotas {
    pub(super) fn new(engine: Engine) -> Quotas {
        Quotas {
            allowances: Mutex::default(),
            fleet: engine == Engine::Postgres,
            leaser: tokio::sync::Mutex::new(None),
        }
    }

    /// The allowance of a quota under `rule`; an allowance made under another rule is started over.
    fn allowance(&self, pack_id: &str, principal: Option<&str>, rule: Rule) -> Arc<Allowance> {
        let who = principal.unwrap_or("");
        let mut allowances = self.allowances.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = allowances
            .get(pack_id)
            .and_then(|p| p.get(who))
            .filter(|l| l.rule == rule)
        {
            return l.clone();
        }
        if allowances.values().map(HashMap::len).sum::<usize>() >= MAX_ALLOWANCES {
            // Allowances nobody else holds are idle; their buckets are refilled by now or the
            // store's (fleet) anyway. A memory bucket let go starts full again: bounded memory
            // is worth one burst.
            for p in allowances.values_mut() {
                p.retain(|_, l| Arc::strong_count(l) > 1);
            }
            allowances.retain(|_, p| !p.is_empty());
        }
        let allowance = Arc::new(Allowance {
            rule,
            state: Mutex::new(AllowanceState {
                bucket: Bucket::full(&rule, now_micros()),
                leased: 0,
                leased_at: Instant::now(),
                returning: 0,
                short_until: None,
            }),
            leasing: tokio::sync::Mutex::new(()),
        });
        allowances
            .entry(pack_id.to_owned())
            .or_default()
            .insert(who.to_owned(), allowance.clone());
        allowance
    }
}

impl Delivery {
    /// Takes one token per trigger from the quotas of `pack_id` and of each principal, all or
    /// none: a fan-out is admitted whole or refused whole.
    pub(super) async fn admit(
        &self,
        view: &PolicyView,
        pack_id: &str,
        principals: &[&str],
    ) -> Result<()> {
        let Some(pack) = view.pack(pack_id) else {
            return Ok(());
        };
        let mut demands: Vec<(Option<&str>, Rule, u32)> = Vec::new();
        for p in principals {
            if let Some(rule) = pack.principals.get(*p).and_then(|pp| pp.quota) {
                match demands.iter_mut().find(|d| d.0 == Some(*p)) {
                    Some(d) => d.2 += 1,
                    None => demands.push((Some(*p), rule, 1)),
                }
            }
        }
        if let Some(rule) = pack.quota {
            // A fan-out wider than the burst could never be admitted whole: it takes the whole
            // burst instead, waiting for a full bucket.
            let n = u32::try_from(principals.len()).unwrap_or(u32::MAX);
            demands.push((None, rule, n.min(rule.burst)));
        }
        if demands.is_empty() {
            return Ok(());
        }
        let mut taken: Vec<(Arc<Allowance>, u32)> = Vec::with_capacity(demands.len());
        for (i, &(principal, rule, n)) in demands.iter().enumerate() {
            let allowance = self.quotas.allowance(pack_id, principal, rule);
            match self.take(&allowance, pack_id, principal, n).await {
                Ok(()) => taken.push((allowance, n)),
                Err(e) => {
                    for (allowance, n) in taken {
                        allowance.give_back(n, self.quotas.fleet);
                    }
                    let Error::Throttled { retry_after, .. } = e else {
                        return Err(e);
                    };
                    // The quotas not yet asked may want longer: a retry told the shorter wait
                    // would only be refused again. The ones taken from (and given back) admit.
                    let mut longest = (principal, rule, retry_after);
                    for &(p, r, n) in &demands[i + 1..] {
                        let allowance = self.quotas.allowance(pack_id, p, r);
                        // A store that does not answer: the wait already known is told.
                        let wait = self
                            .wait_for(&allowance, pack_id, p, n)
                            .await
                            .unwrap_or_default();
                        if wait > longest.2 {
                            longest = (p, r, wait);
                        }
                    }
                    self.metrics
                        .quota_throttled(pack_id, principals.len() as u64);
                    return Err(over_quota(pack_id, longest.0, longest.1, longest.2));
                }
            }
        }
        self.metrics
            .quota_admitted(pack_id, principals.len() as u64);
        Ok(())
    }

    /// Takes `n` tokens from an allowance: from its memory bucket, or from what it leased, leasing
    /// more from the store's bucket when that is short. Over quota: `Throttled`.
    async fn take(
        &self,
        allowance: &Allowance,
        pack_id: &str,
        principal: Option<&str>,
        n: u32,
    ) -> Result<()> {
        let rule = allowance.rule;
        if !self.quotas.fleet {
            return allowance
                .state()
                .bucket
                .take(&rule, now_micros(), n)
                .map_err(throttled);
        }
        if let Some(done) = allowance.state().spend(n, Instant::now()) {
            return done;
        }
        // One lease at a time per allowance; whoever waited for it looks again first, as the lease
        // before may have brought enough.
        let _leasing = allowance.leasing.lock().await;
        if let Some(done) = allowance.state().spend(n, Instant::now()) {
            return done;
        }
        let (want, returned) = {
            let mut s = allowance.state();
            (
                (n - s.leased).max(rule.lease()),
                std::mem::take(&mut s.returning),
            )
        };
        // At least `want`, and whatever else the bucket holds up to its burst: a lease under
        // load takes a while, the bucket fills meanwhile, and what it cannot hold past its
        // burst would be lost to the quota. Tokens only ever come from the bucket, so taking
        // more never admits more than it allows; one left unspent goes back to it.
        let asked = Instant::now();
        // Boxed: the store's futures are large, and this one is on the path of every delivery's
        // future (whose every move copies it) though only a fleet quota's lease reaches it.
        let leased =
            match Box::pin(self.lease(pack_id, principal, returned, want.max(rule.burst))).await {
                Ok(l) => l,
                Err(e) => {
                    // Not given back: still owed.
                    allowance.state().returning += returned;
                    return Err(e);
                }
            };
        let Some(lease) = leased else {
            // The quota was deleted; this replica's view follows shortly.
            return Ok(());
        };
        let now = Instant::now();
        let mut s = allowance.state();
        s.leased_at = now;
        s.leased = s.leased.saturating_add(lease.granted);
        if lease.granted < want {
            // The bucket held less than a lease: its tokens go as fast as they come. What was
            // leased is spent; after it the allowance refuses on its own until a whole lease has
            // come, rather than ask the store for every token (and make its callers wait on
            // each other for them).
            // Less the time the lease took: the next one then ends about when a lease is due,
            // and the bucket, which fills meanwhile, reaches its burst (and loses tokens) only
            // if a lease takes as long as a burst lasts.
            let refill = rule
                .time_for(f64::from(rule.lease()) - lease.left)
                .saturating_sub(now - asked);
            if !refill.is_zero() {
                s.short_until = Some(now + refill);
            }
        }
        if s.leased >= n {
            s.leased -= n;
            return Ok(());
        }
        let wait = rule.time_for(f64::from(n - s.leased) - lease.left);
        let until = now + wait;
        s.short_until = Some(s.short_until.map_or(until, |u| u.max(until)));
        Err(throttled(wait))
    }

    /// How long until an allowance would admit `n` tokens, with nothing taken: its memory bucket, or
    /// what it holds leased, what it owes back and the store's bucket.
    async fn wait_for(
        &self,
        allowance: &Allowance,
        pack_id: &str,
        principal: Option<&str>,
        n: u32,
    ) -> Result<Duration> {
        let rule = allowance.rule;
        let (bucket, held, owed, short_until) = {
            let s = allowance.state();
            let fresh = s.leased_at.elapsed() <= LEASE_TTL;
            let held = if fresh { s.leased } else { 0 };
            let owed = s.returning + if fresh { 0 } else { s.leased };
            (s.bucket, held, owed, s.short_until)
        };
        if !self.quotas.fleet {
            return Ok(bucket
                .peek(&rule, now_micros(), n)
                .err()
                .unwrap_or_default());
        }
        if held >= n {
            return Ok(Duration::ZERO);
        }
        let now = Instant::now();
        if let Some(until) = short_until.filter(|u| *u > now && owed == 0) {
            return Ok(until - now);
        }
        // Boxed, as the lease in `take`: off the size of every delivery's future.
        let Some(mut b) = Box::pin(self.store.get_quota_bucket(pack_id, principal)).await? else {
            return Ok(Duration::ZERO);
        };
        let at = now_micros();
        b.refill(&rule, at);
        b.give_back(&rule, owed);
        Ok(b.peek(&rule, at, n - held).err().unwrap_or_default())
    }

    /// Gives back `returned` tokens and leases up to `want` from a quota's bucket in the
    /// store, on the leases' own connection.
    async fn lease(
        &self,
        pack_id: &str,
        principal: Option<&str>,
        returned: u32,
        want: u32,
    ) -> Result<Option<Lease>> {
        let store = {
            let mut leaser = self.quotas.leaser.lock().await;
            match leaser.as_ref() {
                Some(s) => s.clone(),
                None => {
                    let s = self.store.dedicated().await?.delivery_tables();
                    *leaser = Some(s.clone());
                    s
                }
            }
        };
        // Bounded: the allowance's callers wait behind this lease, and a store gone silent must
        // not hold them past their deadline.
        let leased = tokio::time::timeout(
            self.call_timeout(),
            store.lease_quota(pack_id, principal, returned, want, now_micros()),
        )
        .await
        .unwrap_or_else(|_| {
            Err(Error::Unavailable(
                "the store did not answer in time; retry".into(),
            ))
        });
        if matches!(leased, Err(Error::Unavailable(_))) {
            // A connection to a database gone silent would hold every later lease.
            self.quotas.leaser.lock().await.take();
        }
        leased
    }

    /// Whether the quotas of a trigger would admit it now, with nothing taken.
    pub(super) async fn quota_check(
        &self,
        view: &PolicyView,
        pack_id: &str,
        principal: &str,
    ) -> Result<QuotaCheck> {
        let (own, pack) = view.quotas(pack_id, principal);
        let mut retry_after = Duration::ZERO;
        for (who, rule) in [(Some(principal), own), (None, pack)] {
            let Some(rule) = rule else { continue };
            let allowance = self.quotas.allowance(pack_id, who, rule);
            let (bucket, leased) = {
                let s = allowance.state();
                (s.bucket, s.leased > 0 && s.leased_at.elapsed() <= LEASE_TTL)
            };
            let wait = if !self.quotas.fleet {
                bucket.peek(&rule, now_micros(), 1).err()
            } else if leased {
                None
            } else {
                match self.store.get_quota_bucket(pack_id, who).await? {
                    Some(b) => b.peek(&rule, now_micros(), 1).err(),
                    None => None,
                }
            };
            retry_after = retry_after.max(wait.unwrap_or_default());
        }
        Ok(QuotaCheck {
            pack,
            principal: own,
            retry_after,
        })
    }
}

impl Policy {
    /// Sets a quota on a pack, or on one principal's deliveries of it.
    pub async fn put_quota(
        &self,
        actor: &Actor,
        pack_id: &str,
        principal: Option<&str>,
        rate: f64,
        burst: u32,
    ) -> Result<Quota> {
        valid_quota_key(pack_id, principal)?;
        let rule = Rule::new(rate, burst).map_err(|(f, d)| Error::invalid(f, d))?;
        let _turn = self.policy.writer.lock().await;
        let view = self.policy.view.load_full();
        if view.pack(pack_id).is_none() {
            return Err(unknown_pack(pack_id));
        }
        let q = Quota {
            pack_id: pack_id.to_owned(),
            principal: principal.map(str::to_owned),
            rule,
            update_time: 0,
        };
        let q = self.store.put_quota(actor, &q, now_micros()).await?;
        self.policy
            .publish(with_quota(&view, pack_id, principal, Some(rule)));
        tracing::info!(
            pack_id,
            principal,
            rate = rule.rate,
            burst = rule.burst,
            "quota set"
        );
        Ok(q)
    }

    pub async fn get_quota(&self, pack_id: &str, principal: Option<&str>) -> Result<Quota> {
        valid_quota_key(pack_id, principal)?;
        self.store
            .get_quota(pack_id, principal)
            .await?
            .ok_or_else(|| no_quota(pack_id, principal))
    }

    /// Quotas; `first` filters by pack, `second` by principal.
    pub async fn list_quotas(&self, p: &KeyPage<'_>) -> Result<Vec<Quota>> {
        p.first.map(valid_pack_id).transpose()?;
        p.second.map(|v| valid_id("principal", v)).transpose()?;
        self.store.list_quotas(p).await
    }

    pub async fn delete_quota(
        &self,
        actor: &Actor,
        pack_id: &str,
        principal: Option<&str>,
    ) -> Result<()> {
        valid_quota_key(pack_id, principal)?;
        let _turn = self.policy.writer.lock().await;
        if !self.store.delete_quota(actor, pack_id, principal).await? {
            return Err(no_quota(pack_id, principal));
        }
        let view = self.policy.view.load_full();
        self.policy
            .publish(with_quota(&view, pack_id, principal, None));
        tracing::info!(pack_id, principal, "quota deleted");
        Ok(())
    }
}

fn throttled(retry_after: Duration) -> Error {
    Error::Throttled {
        message: String::new(),
        retry_after,
        reason: "QUOTA_EXCEEDED",
    }
}

impl Allowance {
    fn state(&self) -> std::sync::MutexGuard<'_, AllowanceState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Gives back `n` tokens taken for a delivery another quota then refused: to the memory
    /// bucket, or (`fleet`) to what this replica holds leased.
    fn give_back(&self, n: u32, fleet: bool) {
        let rule = self.rule;
        let mut s = self.state();
        if fleet {
            s.leased = s.leased.saturating_add(n);
        } else {
            s.bucket.give_back(&rule, n);
        }
    }
}

impl AllowanceState {
    /// Spends `n` leased tokens if there are so many (`Some(Ok)`), or refuses while the store's
    /// bucket is known short (`Some(Err)`); `None`: a lease is needed. Leases unspent for
    /// LEASE_TTL are let go.
    fn spend(&mut self, n: u32, now: Instant) -> Option<Result<()>> {
        self.expire(now);
        if self.leased >= n {
            self.leased -= n;
            return Some(Ok(()));
        }
        match self.short_until {
            // Tokens owed back may be enough: the store is asked, with them.
            Some(until) if now < until && self.returning == 0 => Some(Err(throttled(until - now))),
            _ => {
                self.short_until = None;
                None
            }
        }
    }

    /// Leased tokens held past LEASE_TTL become owed back to the store's bucket.
    fn expire(&mut self, now: Instant) {
        if self.leased > 0 && now.duration_since(self.leased_at) > LEASE_TTL {
            self.returning = self.returning.saturating_add(self.leased);
            self.leased = 0;
        }
    }
}

/// Gives back, about every LEASE_TTL, the tokens this replica's allowances leased and did not
/// spend in time, so that an allowance no delivery comes to holds none of the fleet's tokens (PostgreSQL;
/// on SQLite there is nothing to give back). Upkeep of `life`: ends when closing begins.
pub(super) fn start_returns(q: Arc<Quotas>, store: DeliveryTables, life: &Lifecycle) {
    let closing = life.closing();
    life.spawn_upkeep(async move {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(LEASE_TTL) => {}
                _ = closing.wait() => return,
            }
            if !q.fleet {
                return;
            }
            let now = Instant::now();
            let mut owed: Vec<(String, String, Arc<Allowance>, u32)> = Vec::new();
            {
                let allowances = q.allowances.lock().unwrap_or_else(|p| p.into_inner());
                for (pack_id, by) in allowances.iter() {
                    for (who, allowance) in by {
                        let mut s = allowance.state();
                        s.expire(now);
                        let n = std::mem::take(&mut s.returning);
                        if n > 0 {
                            owed.push((pack_id.clone(), who.clone(), allowance.clone(), n));
                        }
                    }
                }
            }
            for (pack_id, who, allowance, n) in owed {
                let principal = (!who.is_empty()).then_some(who.as_str());
                let given = tokio::time::timeout(
                    LEASE_TTL,
                    store.lease_quota(&pack_id, principal, n, 0, now_micros()),
                )
                .await;
                if !matches!(given, Ok(Ok(_))) {
                    // Still owed: the next lease or sweep gives them back.
                    allowance.state().returning += n;
                }
            }
        }
    });
}

fn with_quota(
    view: &PolicyView,
    pack_id: &str,
    principal: Option<&str>,
    rule: Option<Rule>,
) -> PolicyView {
    match principal {
        Some(p) => view.with_principal(pack_id, p, |pp| pp.quota = rule),
        None => view.with_pack_quota(pack_id, rule),
    }
}

/// A quota's key: a pack id, and a principal that, when given, is a principal's id (never
/// empty: leaving it out is what names the pack-wide quota).
fn valid_quota_key(pack_id: &str, principal: Option<&str>) -> Result<()> {
    valid_pack_id(pack_id)?;
    if let Some(p) = principal {
        if p.is_empty() {
            return Err(Error::invalid(
                "principal",
                "is empty: leave it out for the pack-wide quota, or name a principal",
            ));
        }
        valid_id("principal", p)?;
    }
    Ok(())
}

fn no_quota(pack_id: &str, principal: Option<&str>) -> Error {
    Error::NotFound(match principal {
        Some(p) => format!("principal `{p}` has no quota of its own on pack `{pack_id}`"),
        None => format!("pack `{pack_id}` has no pack-wide quota"),
    })
}
