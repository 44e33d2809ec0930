//! Ingress: routes and the ledger of signed deliveries; its doors (the HTTP listener, NATS) and what turns their messages into triggers (signatures, CloudEvents, mappings), each message delivered through `Delivery::deliver_message`.
pub mod cloudevents;
pub mod http;
pub mod mapping;
mod message;
pub mod nats;
pub mod signature;
mod strict_json;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::domain::ingress::{
    check_route, check_route_id, route_fits_pack, IngressKind, PackMisfit, Route,
};
use crate::domain::model::Retention;
use crate::domain::trigger::Outcome;
use crate::error::{Error, Result, Violation};
use crate::service::deliver::{Delivery, Message};
use crate::store::audit::Actor;
use crate::store::now_micros;
use crate::store::{IngressTables, LedgerKey, LedgerState};
use mapping::{compile, Mappings};
use signature::{verify, Verified};

/// How long a claim on a delivery outlives the call that took it: past that, a copy that
/// finds the claim unanswered (its request's replica stopped) takes it over.
const CLAIM_MARGIN: Duration = Duration::from_secs(5);
/// How soon a copy waiting for another's answer first looks at the ledger again, and how long
/// it waits between looks at most (it doubles in between).
const CLAIM_POLL: Duration = Duration::from_millis(10);
const CLAIM_POLL_MAX: Duration = Duration::from_millis(200);

/// A delivery id the ledger holds for other content: another delivery reusing the id (a
/// sender's bug, or a forgery by someone holding the secret), refused whole.
fn reused(route: &Route, v: &Verified) -> Error {
    let what = match route.kind {
        IngressKind::Github => {
            "this body was received before with another X-GitHub-Event".to_owned()
        }
        _ => format!(
            "webhook-id `{}` was received before with another body",
            v.delivery_id.escape_debug()
        ),
    };
    Error::AlreadyExists(format!(
        "{what}: a delivery id names one delivery, decided once; send new content under a new id (nothing was decided)"
    ))
}

/// The clock skew allowed between replicas (seconds): a ledger row outlives its signature's
/// tolerance by this much, so a replica whose clock is behind still finds it.
pub const LEDGER_SKEW_SECS: i64 = 60;

/// The answer to a signed request: each trigger it became and what became of it, as JSON.
#[derive(Debug, Clone)]
pub struct Receipt {
    /// An array of `{principal, trigger_id, disposition, drop_reason, record_id, duplicate}`.
    pub triggers: Value,
    /// The delivery was decided before; this is the first answer (its records marked
    /// `duplicate`), and nothing was decided again.
    pub replay: bool,
}

impl Receipt {
    fn decided(received: &[Received]) -> Receipt {
        let triggers = received
            .iter()
            .map(|r| {
                let o = &r.outcome;
                serde_json::json!({
                    "principal": r.principal,
                    "trigger_id": r.trigger_id,
                    "disposition": o.disposition(),
                    "drop_reason": o.drop_reason.map(|d| d.as_str()),
                    "record_id": o.record_id,
                    "duplicate": o.duplicate,
                })
            })
            .collect();
        Receipt {
            triggers: Value::Array(triggers),
            replay: false,
        }
    }

    fn replayed(first: &str) -> Result<Receipt> {
        let mut triggers: Value = serde_json::from_str(first)
            .map_err(|e| Error::internal_from("bad stored ingress answer", e))?;
        for t in triggers.as_array_mut().into_iter().flatten() {
            if t.get("record_id").is_some_and(|r| !r.is_null()) {
                t["duplicate"] = Value::Bool(true);
            }
        }
        Ok(Receipt {
            triggers,
            replay: true,
        })
    }
}

/// One trigger a request became, and what became of it.
#[derive(Debug, Clone)]
pub struct Received {
    pub principal: String,
    pub trigger_id: String,
    pub outcome: Outcome,
}

pub(crate) fn invalid(v: Vec<(String, String)>) -> Error {
    Error::InvalidArgument(
        v.into_iter()
            .map(|(field, description)| Violation { field, description })
            .collect(),
    )
}

fn unknown_route(route_id: &str) -> Error {
    Error::NotFound(format!("no ingress route `{}`", route_id.escape_debug()))
}

/// Ingress routes and the messages they take: a route's admin changes, and a signed request
/// or a NATS message turned into triggers that take DeliverTrigger's path. Owns the routes,
/// their compiled mappings and the ledger of deliveries seen.
#[derive(Clone, Debug)]
pub struct Ingress {
    store: IngressTables,
    mappings: Arc<Mappings>,
    /// Where the triggers go; its call timeout and payload limit bound each message.
    pub delivery: Delivery,
    /// The records' retention: a delivery's ledger row is kept as long as its records.
    retention: Retention,
}

impl Ingress {
    pub fn new(store: IngressTables, delivery: Delivery, retention: Retention) -> Ingress {
        Ingress {
            store,
            mappings: Arc::default(),
            delivery,
            retention,
        }
    }

    /// The lifecycle its doors start their tasks through (the delivery's).
    pub fn lifecycle(&self) -> &crate::lifecycle::Lifecycle {
        self.delivery.lifecycle()
    }

    /// Checks and stores a route: its id, pack (registered; public to fan out), secrets and
    /// mapping. True when the id was new.
    pub async fn put_ingress_route(&self, actor: &Actor, r: &Route) -> Result<bool> {
        let mut bad = check_route(r);
        if let Err(v) = compile(r.kind, &r.mapping, r.fan_out) {
            bad.extend(v.into_iter().map(|(f, d)| (format!("route.{f}"), d)));
        }
        if !bad.is_empty() {
            return Err(invalid(bad));
        }
        match route_fits_pack(&self.delivery.view(), r) {
            Ok(()) => {}
            Err(PackMisfit::Unregistered) => {
                return Err(Error::NotFound(format!(
                    "route.pack_id: pack `{}` is not registered",
                    r.pack_id
                )))
            }
            Err(PackMisfit::NotPublic) => {
                return Err(Error::FailedPrecondition(format!(
                    "route.fan_out: pack `{}` is not public; only a public pack's event goes to every principal activated for it",
                    r.pack_id
                )))
            }
        }
        let created = self.store.put_ingress_route(actor, r, now_micros()).await?;
        tracing::info!(route_id = %r.route_id, pack_id = %r.pack_id, kind = r.kind.as_str(), created, "ingress route stored");
        Ok(created)
    }

    pub async fn get_ingress_route(&self, route_id: &str) -> Result<Route> {
        check_route_id(route_id).map_err(|e| Error::invalid("route_id", e))?;
        self.store
            .ingress_route(route_id)
            .await?
            .ok_or_else(|| unknown_route(route_id))
    }

    /// Routes by id, a page of `limit` after `after`.
    pub async fn list_ingress_routes(&self, after: Option<&str>, limit: u64) -> Result<Vec<Route>> {
        self.store.list_ingress_routes(after, limit).await
    }

    pub async fn delete_ingress_route(&self, actor: &Actor, route_id: &str) -> Result<()> {
        check_route_id(route_id).map_err(|e| Error::invalid("route_id", e))?;
        if !self.store.delete_ingress_route(actor, route_id).await? {
            return Err(unknown_route(route_id));
        }
        tracing::info!(route_id, "ingress route deleted");
        Ok(())
    }

    /// A request to a route: its signature is checked (`Unauthenticated` when it fails: nothing
    /// is counted), its body read as a JSON object, its mapping evaluated, and each trigger it
    /// yields delivered as DeliverTrigger would. `now` is Unix seconds.
    ///
    /// A signed delivery is decided once: its replay, whatever its unsigned headers say,
    /// whatever changed since (a grant, an erasure) and whichever route sharing its secret it
    /// is sent to, gets the first answer; copies arriving together wait for it.
    pub async fn receive(
        &self,
        route_id: &str,
        headers: &BTreeMap<String, String>,
        body: &[u8],
        now: i64,
    ) -> Result<Receipt> {
        let (route, verified) = self.verified(route_id, headers, body, now).await?;
        let key = verified.key();
        let ledger = LedgerKey {
            route_id,
            scopes: &verified.scopes,
            key: &key,
            digest: &verified.content_digest,
        };
        if let Some(first) = self.claim(&route, &verified, &ledger).await? {
            return Ok(first);
        }
        self.decide_claimed(route, verified, key, headers, body)
            .await
    }

    /// The route a request names and its verified signature. An unknown route and a bad
    /// signature read alike to the caller: both say only that the request was not accepted,
    /// so route ids cannot be probed without a secret.
    async fn verified(
        &self,
        route_id: &str,
        headers: &BTreeMap<String, String>,
        body: &[u8],
        now: i64,
    ) -> Result<(Route, Verified)> {
        let refused = || Error::Unauthenticated("the request is not signed for this route".into());
        if check_route_id(route_id).is_err() {
            return Err(refused());
        }
        let Some(route) = self.store.ingress_route(route_id).await? else {
            return Err(refused());
        };
        let verified = verify(route.kind, &route.secrets, headers, body, now).map_err(|u| {
            // Debug, like refused gRPC credentials: a flood of forged requests must not flood
            // the log; hcp_sense_ingress_refused_total counts them.
            tracing::debug!(route_id, why = %u.0, "ingress request refused");
            refused()
        })?;
        Ok((route, verified))
    }

    /// Claims a verified delivery in the ledger: `None` once this request holds the claim
    /// (it decides), the first answer when the delivery was decided before, or a refusal
    /// (other content under its id; a copy still undecided when the wait runs out). A copy
    /// that finds another's claim waits for its answer within the call's time.
    async fn claim(
        &self,
        route: &Route,
        verified: &Verified,
        ledger: &LedgerKey<'_>,
    ) -> Result<Option<Receipt>> {
        let until = self.ledger_until(verified);
        // Within the call's time, so the waiting copy is answered with why.
        let wait_until = Instant::now() + self.delivery.call_timeout().mul_f32(0.8);
        let lease = i64::try_from((self.delivery.call_timeout() + CLAIM_MARGIN).as_micros())
            .unwrap_or(i64::MAX);
        let mut claim = true;
        let mut poll = CLAIM_POLL;
        loop {
            let now = now_micros();
            let state = if claim {
                self.store
                    .claim_ingress_delivery(ledger, now, now.saturating_add(lease), until)
                    .await?
            } else {
                match self.store.ingress_delivery(ledger, now).await? {
                    Some(state) => state,
                    None => {
                        claim = true;
                        continue;
                    }
                }
            };
            match state {
                LedgerState::Claimed if claim => return Ok(None),
                LedgerState::Decided(first) => {
                    self.delivery.metrics.ingress_replayed(route.kind.as_str());
                    tracing::info!(
                        route_id = %route.route_id,
                        "signed delivery decided before: answered with its first outcome"
                    );
                    return Receipt::replayed(&first).map(Some);
                }
                LedgerState::OtherContent => return Err(reused(route, verified)),
                LedgerState::Pending if Instant::now() < wait_until => {
                    claim = false;
                    tokio::time::sleep(poll).await;
                    // A burst of copies waiting on one delivery reads the ledger less and less
                    // often, not the store flat out.
                    poll = (poll * 2).min(CLAIM_POLL_MAX);
                }
                LedgerState::Pending | LedgerState::Claimed => {
                    return Err(Error::Unavailable(
                        "a copy of this delivery is being decided and has no answer yet; retry"
                            .into(),
                    ))
                }
            }
        }
    }

    /// Decides a claimed delivery and settles its ledger row with the answer, in a task of its
    /// own (of the service's lifecycle, so shutdown waits for it): a sender that hangs up (or a
    /// call that runs out of time) leaves the decision to finish and its answer kept for the
    /// retry. Refused before any decision, the claim is released: a retry with the same content
    /// decides it.
    async fn decide_claimed(
        &self,
        route: Route,
        verified: Verified,
        key: String,
        headers: &BTreeMap<String, String>,
        body: &[u8],
    ) -> Result<Receipt> {
        let this = self.clone();
        let (headers, body) = (headers.clone(), body.to_vec());
        self.delivery.lifecycle().spawn(async move {
            let ledger = LedgerKey {
                route_id: &route.route_id,
                scopes: &verified.scopes,
                key: &key,
                digest: &verified.content_digest,
            };
            let decided = this
                .route_message(&route, &headers, &body, verified.delivery_id.clone())
                .await;
            match decided {
                Ok(received) => {
                    let receipt = Receipt::decided(&received);
                    this.store
                        .settle_ingress_delivery(
                            &ledger,
                            now_micros(),
                            &receipt.triggers.to_string(),
                        )
                        .await?;
                    Ok(receipt)
                }
                Err(e) => {
                    if let Err(r) = this.store.release_ingress_delivery(&ledger).await {
                        tracing::warn!(route_id = %route.route_id, error = %r, "ingress claim not released; it lapses on its own");
                    }
                    Err(e)
                }
            }
        })
        .await
        .map_err(|e| Error::internal_from("ingress delivery failed", e))?
    }

    /// Until when (Unix microseconds) a delivery's ledger row is kept: past the time its
    /// signature stops verifying (SW, CloudEvents), or, for a kind that signs no time, past
    /// the longest any record is kept (`None`: for ever, as records are).
    fn ledger_until(&self, v: &Verified) -> Option<i64> {
        let micros = |s: i64| s.saturating_mul(1_000_000);
        if v.signed_at.is_some() {
            return v.replayable_until(LEDGER_SKEW_SECS).map(micros);
        }
        let longest = self.retention.longest()?;
        let age = i64::try_from(longest.as_micros()).unwrap_or(i64::MAX);
        Some(
            now_micros()
                .saturating_add(age)
                .saturating_add(micros(LEDGER_SKEW_SECS)),
        )
    }

    /// A message taken by a route (a verified HTTP request, or a NATS message), turned into
    /// its triggers and delivered as one message; `delivery_id` is the trigger id unless the
    /// mapping or the event gives one.
    pub async fn route_message(
        &self,
        route: &Route,
        headers: &BTreeMap<String, String>,
        body: &[u8],
        delivery_id: String,
    ) -> Result<Vec<Received>> {
        let compiled = self.mappings.compiled(route).map_err(invalid)?;
        let view = self.delivery.view();
        let triggers = message::triggers(&view, route, &compiled, headers, body, delivery_id)?;
        let named: Vec<(String, String)> = triggers
            .iter()
            .map(|t| (t.principal.clone(), t.trigger_id.clone()))
            .collect();
        // Every trigger of the message carries the one payload under one ref.
        let ingress = route.kind.as_str();
        let outcomes = self
            .delivery
            .deliver_message(
                Message::fanned(triggers, ingress)
                    .from_source(format!("{ingress}:{}", route.route_id)),
            )
            .await?;
        Ok(named
            .into_iter()
            .zip(outcomes)
            .map(|((principal, trigger_id), outcome)| Received {
                principal,
                trigger_id,
                outcome,
            })
            .collect())
    }
}
