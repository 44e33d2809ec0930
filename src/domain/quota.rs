//! Quotas: a rate and a burst a pack (or one principal of it) may deliver at, kept as token buckets.
use std::time::Duration;

/// The lowest rate a quota may set: one trigger in a little under 17 minutes.
pub const MIN_RATE: f64 = 0.001;
/// The highest rate a quota may set, per second.
pub const MAX_RATE: f64 = 1_000_000.0;
/// The largest burst a quota may set.
pub const MAX_BURST: u32 = 1_000_000;
/// How much of a second's rate a replica leases from the fleet's bucket at a time: small, so
/// tokens leased and not yet spent on one replica are few; large enough that a replica asks
/// the store at most some twenty times a second per quota.
pub const LEASE_SECONDS: f64 = 0.05;

/// A quota's rule: tokens come at `rate` per second, at most `burst` are held.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rule {
    pub rate: f64,
    pub burst: u32,
}

// Rates are finite by construction (`Rule::new`), so equality is total.
impl Eq for Rule {}

impl Rule {
    /// A rule from what an admin sent: `rate` within [MIN_RATE, MAX_RATE]; `burst` 0 means one
    /// second's worth of the rate (at least 1), else at most MAX_BURST. Errors name the field.
    pub fn new(rate: f64, burst: u32) -> Result<Rule, (&'static str, String)> {
        if !rate.is_finite() || !(MIN_RATE..=MAX_RATE).contains(&rate) {
            return Err((
                "rate_per_second",
                format!(
                    "must be between {MIN_RATE} and {MAX_RATE} (got {rate}); to stop a pack's deliveries, deactivate Sense or revoke sense.enable"
                ),
            ));
        }
        if burst > MAX_BURST {
            return Err((
                "burst",
                format!("must be at most {MAX_BURST} (got {burst})"),
            ));
        }
        let burst = if burst == 0 {
            // One second's worth: what an admin who names only a rate expects to be let through.
            (rate.ceil() as u32).clamp(1, MAX_BURST)
        } else {
            burst
        };
        Ok(Rule { rate, burst })
    }

    /// Tokens a replica leases from the fleet's bucket at a time.
    pub fn lease(&self) -> u32 {
        ((self.rate * LEASE_SECONDS).ceil() as u32).clamp(1, self.burst)
    }

    /// How long `deficit` tokens take to come.
    pub fn time_for(&self, deficit: f64) -> Duration {
        if deficit <= 0.0 {
            return Duration::ZERO;
        }
        // Rounded up to the microsecond, and at least one: a retry sooner finds no token.
        let micros = (deficit / self.rate * 1e6).ceil().max(1.0);
        Duration::from_micros(micros.min(u64::MAX as f64) as u64)
    }
}

/// A quota as stored: on a pack, or (`principal`) on one principal's deliveries of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quota {
    pub pack_id: String,
    pub principal: Option<String>,
    pub rule: Rule,
    pub update_time: i64,
}

/// A token bucket's state: the tokens it held at `at` (Unix microseconds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    pub tokens: f64,
    pub at: i64,
}

impl Bucket {
    /// A bucket holding its whole burst.
    pub fn full(rule: &Rule, now: i64) -> Bucket {
        Bucket {
            tokens: f64::from(rule.burst),
            at: now,
        }
    }

    /// Adds the tokens come since `at` (none if the clock went back), at most the burst.
    pub fn refill(&mut self, rule: &Rule, now: i64) {
        if now > self.at {
            let elapsed = (now - self.at) as f64 / 1e6;
            self.tokens += elapsed * rule.rate;
            self.at = now;
        }
        self.tokens = self.tokens.clamp(0.0, f64::from(rule.burst));
    }

    /// Takes as many whole tokens as there are, up to `want`; returns how many.
    pub fn take_up_to(&mut self, rule: &Rule, now: i64, want: u32) -> u32 {
        self.refill(rule, now);
        // A hair under a whole token is one: float sums of refills must not starve a caller.
        let whole = (self.tokens + 1e-9).floor().max(0.0);
        let n = whole.min(f64::from(want)) as u32;
        self.tokens = (self.tokens - f64::from(n)).max(0.0);
        n
    }

    /// Takes `n` tokens, or none and says how long until there are `n`.
    pub fn take(&mut self, rule: &Rule, now: i64, n: u32) -> Result<(), Duration> {
        self.refill(rule, now);
        if self.tokens + 1e-9 >= f64::from(n) {
            self.tokens = (self.tokens - f64::from(n)).max(0.0);
            Ok(())
        } else {
            Err(rule.time_for(f64::from(n) - self.tokens))
        }
    }

    /// Gives back `n` tokens taken for a delivery that another quota then refused.
    pub fn give_back(&mut self, rule: &Rule, n: u32) {
        self.tokens = (self.tokens + f64::from(n)).min(f64::from(rule.burst));
    }

    /// Whether `n` tokens are there at `now`, and if not how long until they are; nothing taken.
    pub fn peek(&self, rule: &Rule, now: i64, n: u32) -> Result<(), Duration> {
        let mut b = *self;
        b.take(rule, now, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: i64 = 1_000_000;

    #[test]
    fn a_full_bucket_admits_its_burst_then_refuses_until_a_token_comes() {
        let rule = Rule::new(10.0, 5).expect("rule");
        let mut b = Bucket::full(&rule, 0);
        for _ in 0..5 {
            assert_eq!(b.take(&rule, 0, 1), Ok(()));
        }
        // n accepted, n+1 refused, told a tenth of a second.
        assert_eq!(b.take(&rule, 0, 1), Err(Duration::from_millis(100)));
        assert_eq!(
            b.take(&rule, SEC / 10 - 1, 1),
            Err(Duration::from_micros(1))
        );
        assert_eq!(b.take(&rule, SEC / 10, 1), Ok(()));
        assert!(b.take(&rule, SEC / 10, 1).is_err());
    }

    #[test]
    fn refills_stop_at_the_burst_and_a_clock_going_back_adds_nothing() {
        let rule = Rule::new(100.0, 3).expect("rule");
        let mut b = Bucket {
            tokens: 0.0,
            at: 10 * SEC,
        };
        b.refill(&rule, 20 * SEC);
        assert_eq!(b.tokens, 3.0);
        assert_eq!(b.take_up_to(&rule, 5 * SEC, 10), 3);
        assert_eq!(b.take_up_to(&rule, 5 * SEC, 10), 0);
        assert_eq!(b.at, 20 * SEC);
    }

    #[test]
    fn many_small_refills_add_up_to_whole_tokens() {
        let rule = Rule::new(3.0, 1).expect("rule");
        let mut b = Bucket { tokens: 0.0, at: 0 };
        let mut taken = 0;
        // Asked every microsecond: five tokens just before two seconds, six just after (a
        // full bucket loses what comes over its burst, at most the microsecond it was asked).
        let mut now = 0;
        while now <= 2 * SEC + 100 {
            taken += b.take_up_to(&rule, now, 1);
            if now == 2 * SEC - 100 {
                assert_eq!(taken, 5);
            }
            now += 1;
        }
        assert_eq!(taken, 6);
    }

    #[test]
    fn a_rule_names_the_field_it_refuses_and_defaults_the_burst_to_a_seconds_worth() {
        assert_eq!(Rule::new(2.5, 0).map(|r| r.burst), Ok(3));
        assert_eq!(Rule::new(0.01, 0).map(|r| r.burst), Ok(1));
        for bad in [
            0.0,
            -1.0,
            f64::NAN,
            f64::INFINITY,
            MAX_RATE * 2.0,
            MIN_RATE / 2.0,
        ] {
            assert_eq!(Rule::new(bad, 1).map_err(|e| e.0), Err("rate_per_second"));
        }
        assert_eq!(
            Rule::new(MAX_RATE, MAX_BURST).map(|r| r.burst),
            Ok(MAX_BURST)
        );
        assert_eq!(Rule::new(1.0, MAX_BURST + 1).map_err(|e| e.0), Err("burst"));
    }

    #[test]
    fn leases_are_a_twentieth_of_the_rate_within_one_and_the_burst() {
        assert_eq!(Rule::new(1000.0, 0).expect("rule").lease(), 50);
        assert_eq!(Rule::new(1000.0, 10).expect("rule").lease(), 10);
        assert_eq!(Rule::new(1.0, 0).expect("rule").lease(), 1);
    }

    #[test]
    fn a_token_given_back_is_there_for_the_next_and_peeking_takes_nothing() {
        let rule = Rule::new(1.0, 1).expect("rule");
        let mut b = Bucket::full(&rule, 0);
        assert_eq!(b.peek(&rule, 0, 1), Ok(()));
        assert_eq!(b.take(&rule, 0, 1), Ok(()));
        assert_eq!(b.peek(&rule, 0, 1), Err(Duration::from_secs(1)));
        b.give_back(&rule, 5);
        assert_eq!(b.tokens, 1.0);
        assert_eq!(b.take(&rule, 0, 2), Err(Duration::from_secs(1)));
    }
}
