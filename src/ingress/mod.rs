//! Ingress: everything that turns outside traffic into triggers — the HTTP listener, the signature schemes, CloudEvents, NATS and route mappings — and the routes' admin changes; every trigger takes DeliverTrigger's one validate → decide → record path.
pub mod cloudevents;
pub mod http;
pub mod mapping;
pub mod nats;
pub mod signature;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::domain::ingress::{
    check_route_id, check_secret, IngressKind, Mapping, Route, MAX_SECRETS,
};
use crate::domain::model::Retention;
use crate::domain::pack::BindingMode;
use crate::domain::policy::{Activation, PolicyView};
use crate::domain::trigger::{Outcome, RawTrigger};
use crate::error::{Error, Result, Violation};
use crate::service::{valid_pack_id, Delivery};
use crate::store::audit::Actor;
use crate::store::now_micros;
use crate::store::{IngressTables, LedgerKey, LedgerState};
use cloudevents::{cloud_event, CloudEvent};
use mapping::{compile, evaluate, Compiled, Mapped};
use signature::{verify, Verified};

/// The land a trigger takes when its mapping gives none and its ref has no Policy entry: such
/// a trigger is dropped as undeclared (or its pack as unknown) before any land is compared.
const LAND_OF_UNDECLARED: &str = "user";

/// A JetStream stream name: 1 to 64 of A-Z a-z 0-9 `-` `_`.
fn check_nats_name(name: &str) -> std::result::Result<(), String> {
    if name.is_empty()
        || name.len() > 64
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(
            "is required: a JetStream stream name, 1 to 64 of A-Z, a-z, 0-9, '-', '_'".into(),
        );
    }
    Ok(())
}

/// Triggers of one fan-out decided at once.
const FAN_OUT_AT_ONCE: usize = 256;

/// Most compiled mappings kept; past it the cache starts afresh.
const MAX_COMPILED: usize = 4096;

/// Compiled mappings by route id, each with the mapping it was compiled from: a route is read
/// from the store on every request (so every replica sees a change at once), and compiled
/// again only when what is stored differs from what was compiled.
#[derive(Debug, Default)]
pub struct Mappings(std::sync::Mutex<HashMap<String, CompiledFrom>>);

/// A compiled mapping, with the mapping and fan-out it was compiled from.
type CompiledFrom = (Mapping, (IngressKind, bool), Arc<Compiled>);

impl Mappings {
    fn compiled(&self, route: &Route) -> Result<Arc<Compiled>> {
        let lock = || {
            self.0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        if let Some((m, f, c)) = lock().get(&route.route_id) {
            if *m == route.mapping && *f == (route.kind, route.fan_out) {
                return Ok(c.clone());
            }
        }
        let c = Arc::new(compile(route.kind, &route.mapping, route.fan_out).map_err(invalid)?);
        let mut cache = lock();
        if cache.len() >= MAX_COMPILED {
            cache.clear();
        }
        cache.insert(
            route.route_id.clone(),
            (
                route.mapping.clone(),
                (route.kind, route.fan_out),
                c.clone(),
            ),
        );
        Ok(c)
    }
}

/// Refuses a binary-mode CloudEvent on a signed route whose trigger would take its ref,
/// principal or any mapped field from the event's attributes: in binary mode they are `ce-`
/// headers, which the signature (over the body) does not cover, so a replay could change
/// them. Structured mode signs them; a mapping from `body` (the data) needs none of them.
fn unsigned_attributes(route: &Route, compiled: &Compiled) -> Result<()> {
    let why = "in binary mode the event's attributes are ce- headers, which the signature does \
               not cover; send the event in structured mode (application/cloudevents+json), or \
               map the field from `body`";
    if let Some(field) = compiled.reading_event() {
        return Err(Error::invalid(
            format!("mapping.{field}"),
            format!("reads `event`: {why}"),
        ));
    }
    if !compiled.gives("ref") {
        return Err(Error::invalid(
            "ce-type",
            format!("would be the ref (the route maps none): {why}"),
        ));
    }
    let named = compiled.gives("principal") || compiled.gives("binding_id");
    if !named && !route.fan_out {
        return Err(Error::invalid(
            "ce-subject",
            format!("would be the principal (the route maps none): {why}"),
        ));
    }
    Ok(())
}

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
            .map_err(|e| Error::Internal(format!("bad stored ingress answer: {e}")))?;
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

fn invalid(v: Vec<(String, String)>) -> Error {
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

    /// The store, for the reads that need no rule beyond its own (a page of routes).
    pub fn store(&self) -> &IngressTables {
        &self.store
    }

    /// Checks and stores a route: its id, pack (registered; public to fan out), secrets and
    /// mapping. True when the id was new.
    pub async fn put_ingress_route(&self, actor: &Actor, r: &Route) -> Result<bool> {
        let mut bad: Vec<(String, String)> = Vec::new();
        if let Err(e) = check_route_id(&r.route_id) {
            bad.push(("route.route_id".into(), e));
        }
        if let Err(Error::InvalidArgument(v)) = valid_pack_id(&r.pack_id) {
            bad.extend(
                v.into_iter()
                    .map(|v| ("route.pack_id".into(), v.description)),
            );
        }
        let nats = r.kind == IngressKind::Nats;
        if nats {
            if !r.secrets.is_empty() {
                bad.push((
                    "secrets".into(),
                    "a NATS route takes no secret: the NATS connection (--nats-url) authenticates its messages".into(),
                ));
            }
            if let Err(e) = check_nats_name(&r.nats_stream) {
                bad.push(("route.nats_stream".into(), e));
            }
            if r.nats_subject.is_empty()
                || r.nats_subject.len() > 256
                || r.nats_subject
                    .chars()
                    .any(|c| c.is_whitespace() || c.is_control())
            {
                bad.push((
                    "route.nats_subject".into(),
                    "is required: a subject or wildcard filter (`orders.>`), at most 256 bytes, no whitespace".into(),
                ));
            }
        } else if !r.nats_stream.is_empty() || !r.nats_subject.is_empty() {
            bad.push(("route.nats_stream".into(), "is for NATS routes only".into()));
        }
        if !nats && (r.secrets.is_empty() || r.secrets.len() > MAX_SECRETS) {
            bad.push((
                "secrets".into(),
                format!(
                    "{} given; a route holds 1 to {MAX_SECRETS} signing secrets (the signature is the only credential of an ingress request)",
                    r.secrets.len()
                ),
            ));
        }
        for (i, s) in r.secrets.iter().enumerate() {
            if let Err(e) = check_secret(r.kind, s) {
                bad.push((format!("secrets[{i}]"), e));
            }
        }
        if r.kind != IngressKind::CloudEvents && !r.type_prefix.is_empty() {
            bad.push((
                "route.cloudevents_type_prefix".into(),
                "is for CloudEvents routes only".into(),
            ));
        }
        if let Err(v) = compile(r.kind, &r.mapping, r.fan_out) {
            bad.extend(v.into_iter().map(|(f, d)| (format!("route.{f}"), d)));
        }
        if !bad.is_empty() {
            return Err(invalid(bad));
        }
        match self.delivery.view().pack(&r.pack_id) {
            None => {
                return Err(Error::NotFound(format!(
                    "route.pack_id: pack `{}` is not registered",
                    r.pack_id
                )))
            }
            Some(p) if r.fan_out && p.binding_mode != BindingMode::Public => {
                return Err(Error::FailedPrecondition(format!(
                    "route.fan_out: pack `{}` is not public; only a public pack's event goes to every principal activated for it",
                    r.pack_id
                )))
            }
            Some(_) => {}
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
    pub async fn receive(
        &self,
        route_id: &str,
        headers: &BTreeMap<String, String>,
        body: &[u8],
        now: i64,
    ) -> Result<Receipt> {
        // An unknown route and a bad signature read alike to the caller: both say only that
        // the request was not accepted, so route ids cannot be probed without a secret.
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
        // A signed delivery is decided once: its replay, whatever its unsigned headers say,
        // whatever changed since (a grant, an erasure) and whichever route sharing its secret
        // it is sent to, gets the first answer; copies arriving together wait for it.
        let key = verified.key();
        let until = self.ledger_until(&verified);
        let ledger = LedgerKey {
            route_id,
            scopes: &verified.scopes,
            key: &key,
            digest: &verified.content_digest,
        };
        // Within the call's time, so the waiting copy is answered with why.
        let wait_until = Instant::now() + self.delivery.call_timeout().mul_f32(0.8);
        let mut claim = true;
        let mut poll = CLAIM_POLL;
        loop {
            let now = now_micros();
            let state = if claim {
                let lease =
                    i64::try_from((self.delivery.call_timeout() + CLAIM_MARGIN).as_micros())
                        .unwrap_or(i64::MAX);
                let state = self
                    .store
                    .claim_ingress_delivery(&ledger, now, now.saturating_add(lease), until)
                    .await?;
                if state == LedgerState::Claimed {
                    break;
                }
                state
            } else {
                match self.store.ingress_delivery(&ledger, now).await? {
                    Some(state) => state,
                    None => {
                        claim = true;
                        continue;
                    }
                }
            };
            match state {
                LedgerState::Decided(first) => {
                    self.delivery.metrics.ingress_replayed(route.kind.as_str());
                    tracing::info!(
                        route_id,
                        "signed delivery decided before: answered with its first outcome"
                    );
                    return Receipt::replayed(&first);
                }
                LedgerState::OtherContent => return Err(reused(&route, &verified)),
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
        // Decided and answered in a task of its own: a sender that hangs up (or a call that
        // runs out of time) leaves the decision to finish and its answer kept for the retry.
        let this = self.clone();
        let (headers, body) = (headers.clone(), body.to_vec());
        let (scopes, digest, route_id) = (
            verified.scopes.clone(),
            verified.content_digest.clone(),
            route_id.to_owned(),
        );
        let delivery_id = verified.delivery_id.clone();
        tokio::spawn(async move {
            let ledger = LedgerKey {
                route_id: &route_id,
                scopes: &scopes,
                key: &key,
                digest: &digest,
            };
            match this
                .route_message(&route, &headers, &body, delivery_id)
                .await
            {
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
                    // Refused before any decision: a retry with the same content decides it.
                    if let Err(r) = this.store.release_ingress_delivery(&ledger).await {
                        tracing::warn!(route_id, error = %r, "ingress claim not released; it lapses on its own");
                    }
                    Err(e)
                }
            }
        })
        .await
        .map_err(|e| Error::Internal(format!("ingress delivery failed: {e}")))?
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
    /// its triggers and delivered; `delivery_id` is the trigger id unless the mapping or the
    /// event gives one.
    pub async fn route_message(
        &self,
        route: &Route,
        headers: &BTreeMap<String, String>,
        body: &[u8],
        delivery_id: String,
    ) -> Result<Vec<Received>> {
        let (payload, event) = message(route, headers, body)?;
        let compiled = self.mappings.compiled(route)?;
        let signed = route.kind.signed_headers().is_some();
        let unsigned_event = signed && event.as_ref().is_some_and(|e| !e.structured);
        if unsigned_event {
            unsigned_attributes(route, &compiled)?;
        }
        let mut mapped = evaluate(&compiled, headers, &payload, event.as_ref())
            .map_err(|(f, d)| invalid(vec![(f, d)]))?;
        if unsigned_event {
            // The event's id is an unsigned header here; the signed delivery id is what
            // makes a replay the first record.
            mapped.trigger_id.get_or_insert_with(|| delivery_id.clone());
        }
        match &event {
            Some(e) => named_by_event(route, e, &mut mapped)?,
            None if route.kind == IngressKind::Nats => {
                named_by_headers(route, headers, &mut mapped)?
            }
            None => {}
        }
        let view = self.delivery.view();
        let trigger_id = mapped.trigger_id.clone().unwrap_or(delivery_id);
        if signed && trigger_id.is_empty() {
            return Err(Error::invalid(
                "mapping.trigger_id",
                "yielded an empty trigger id: a signed request's trigger id is what makes its replay the first record",
            ));
        }
        let principals = self.principals_of(&view, route, &mapped)?;
        let triggers = triggers_of(&view, route, &mapped, principals, &trigger_id, &payload);
        // Every trigger of the message carries the one payload under one ref: it conforms to
        // the ref's schema for all or none.
        if let Some(t) = triggers.first() {
            if let Err(e) = self
                .delivery
                .conforms(&view, &t.pack_id, &t.r#ref, &payload)
                .await
            {
                if !self.delivery.all_recorded(&triggers).await? {
                    return Err(e);
                }
            }
        }
        // The message is admitted whole or refused whole: a fan-out takes a token per trigger
        // from the pack's quota (and each principal's), and none is decided when one is short.
        let principals: Vec<&str> = triggers.iter().map(|t| t.principal.as_str()).collect();
        if let Err(e) = self
            .delivery
            .admit(&view, &route.pack_id, &principals)
            .await
        {
            if !self.delivery.all_recorded(&triggers).await? {
                return Err(e);
            }
        }
        self.deliver_message(triggers, route.kind.as_str()).await
    }

    /// Delivers a message's admitted triggers, FAN_OUT_AT_ONCE at a time so the sink commits
    /// a fan-out's together instead of one batch each; the outcomes in the triggers' order.
    async fn deliver_message(
        &self,
        triggers: Vec<RawTrigger>,
        kind: &'static str,
    ) -> Result<Vec<Received>> {
        let mut out = Vec::with_capacity(triggers.len());
        let mut rest = triggers.into_iter().peekable();
        while rest.peek().is_some() {
            let mut set = tokio::task::JoinSet::new();
            for (n, raw) in rest.by_ref().take(FAN_OUT_AT_ONCE).enumerate() {
                let delivery = self.delivery.clone();
                set.spawn(async move {
                    let (principal, trigger_id) = (raw.principal.clone(), raw.trigger_id.clone());
                    let outcome = delivery.deliver_admitted(raw, kind).await;
                    (n, principal, trigger_id, outcome)
                });
            }
            let mut chunk = Vec::with_capacity(set.len());
            while let Some(done) = set.join_next().await {
                let (n, principal, trigger_id, outcome) =
                    done.map_err(|e| Error::Internal(format!("ingress delivery failed: {e}")))?;
                chunk.push((
                    n,
                    Received {
                        principal,
                        trigger_id,
                        outcome: outcome?,
                    },
                ));
            }
            chunk.sort_by_key(|(n, _)| *n);
            out.extend(chunk.into_iter().map(|(_, r)| r));
        }
        Ok(out)
    }

    /// The principals a request goes to: the mapped principal, the holder of the mapped
    /// Binding id, or (fanning out) every principal granted and activated for the pack.
    fn principals_of(&self, view: &PolicyView, route: &Route, m: &Mapped) -> Result<Vec<String>> {
        if let Some(p) = &m.principal {
            return Ok(vec![p.clone()]);
        }
        let pack = view.pack(&route.pack_id);
        if let Some(binding_id) = &m.binding_id {
            let holders: Vec<&String> = pack
                .map(|p| {
                    p.principals
                        .iter()
                        .filter(|(_, pp)| {
                            pp.binding
                                .as_ref()
                                .is_some_and(|b| &b.binding_id == binding_id)
                        })
                        .map(|(name, _)| name)
                        .collect()
                })
                .unwrap_or_default();
            return match holders.as_slice() {
                [one] => Ok(vec![(*one).clone()]),
                [] => Err(Error::invalid(
                    "mapping.binding_id",
                    format!(
                        "no Binding of pack `{}` has id `{}`",
                        route.pack_id,
                        binding_id.escape_debug()
                    ),
                )),
                _ => Err(Error::invalid(
                    "mapping.binding_id",
                    format!(
                        "Binding id `{}` is held by more than one principal of pack `{}`",
                        binding_id.escape_debug(),
                        route.pack_id
                    ),
                )),
            };
        }
        let Some(pack) = pack else {
            return Ok(Vec::new());
        };
        let mut all: Vec<String> = pack
            .principals
            .iter()
            .filter(|(_, pp)| {
                pp.granted && !matches!(pack.activation_for(Some(pp)), Activation::Off)
            })
            .map(|(name, _)| name.clone())
            .collect();
        all.sort();
        Ok(all)
    }
}

/// A message's payload, and its CloudEvent when it is one: a CloudEvents route's always, a
/// NATS message's when it carries `ce-` headers or is a structured-mode event (the CloudEvents
/// NATS binding). Any other body must be a JSON object.
fn message(
    route: &Route,
    headers: &BTreeMap<String, String>,
    body: &[u8],
) -> Result<(Value, Option<CloudEvent>)> {
    let is_event = match route.kind {
        IngressKind::CloudEvents => true,
        IngressKind::Nats => {
            headers.contains_key("ce-specversion")
                || headers
                    .get("content-type")
                    .is_some_and(|c| c.starts_with("application/cloudevents"))
        }
        _ => false,
    };
    if is_event {
        let e = cloud_event(headers, body).map_err(|(f, d)| invalid(vec![(f, d)]))?;
        return Ok((e.data.clone(), Some(e)));
    }
    let payload: Value = serde_json::from_slice(body)
        .map_err(|e| Error::invalid("body", format!("is not JSON: {e}")))?;
    if !payload.is_object() {
        return Err(Error::invalid("body", "must be a JSON object"));
    }
    Ok((payload, None))
}

/// What a CloudEvent names itself, where the mapping does not say otherwise: its type (less
/// the route's prefix) is the ref, its subject the principal, its source and id the trigger id.
fn named_by_event(route: &Route, e: &CloudEvent, mapped: &mut Mapped) -> Result<()> {
    let ty = e.attr("type");
    mapped.r#ref.get_or_insert_with(|| {
        ty.strip_prefix(route.type_prefix.as_str())
            .unwrap_or(ty)
            .to_owned()
    });
    if mapped.binding_id.is_none() && !route.fan_out && mapped.principal.is_none() {
        let subject = e.attr("subject");
        if subject.is_empty() {
            return Err(Error::invalid(
                "subject",
                "is required: the route maps no principal, so the event's subject names it",
            ));
        }
        mapped.principal = Some(subject.to_owned());
    }
    mapped.trigger_id.get_or_insert_with(|| e.trigger_id());
    Ok(())
}

/// A plain NATS message names its trigger in `hcp-*` headers, where the mapping does not.
fn named_by_headers(
    route: &Route,
    headers: &BTreeMap<String, String>,
    mapped: &mut Mapped,
) -> Result<()> {
    let header = |n: &str| headers.get(n).filter(|v| !v.is_empty()).cloned();
    if mapped.r#ref.is_none() {
        mapped.r#ref = Some(header("hcp-ref").ok_or_else(|| {
            Error::invalid(
                "hcp-ref",
                "is required: a message without a CloudEvent names its ref in the hcp-ref header",
            )
        })?);
    }
    if mapped.principal.is_none() && mapped.binding_id.is_none() && !route.fan_out {
        mapped.principal = header("hcp-principal");
        mapped.binding_id = header("hcp-binding-id");
        if mapped.principal.is_none() && mapped.binding_id.is_none() {
            return Err(Error::invalid(
                "hcp-principal",
                "is required (or hcp-binding-id): the route maps no principal",
            ));
        }
    }
    for (slot, name) in [
        (&mut mapped.project, "hcp-project"),
        (&mut mapped.land, "hcp-land"),
    ] {
        if slot.is_none() {
            *slot = header(name);
        }
    }
    Ok(())
}

/// One trigger per principal of the message, each with an id of its own: idempotency is per
/// (pack, trigger id), so a redelivered fan-out records each principal's once. Without a
/// mapped land a trigger takes its ref's Policy land.
fn triggers_of(
    view: &PolicyView,
    route: &Route,
    mapped: &Mapped,
    principals: Vec<String>,
    trigger_id: &str,
    payload: &Value,
) -> Vec<RawTrigger> {
    let r#ref = mapped.r#ref.clone().unwrap_or_default();
    let land = mapped.land.clone().unwrap_or_else(|| {
        view.pack(&route.pack_id)
            .and_then(|p| p.lands.get(&r#ref).cloned())
            .unwrap_or_else(|| LAND_OF_UNDECLARED.to_owned())
    });
    principals
        .into_iter()
        .map(|principal| RawTrigger {
            pack_id: route.pack_id.clone(),
            r#ref: r#ref.clone(),
            land: land.clone(),
            payload: Some(payload.clone()),
            project: mapped.project.clone().unwrap_or_default(),
            trigger_id: match (trigger_id, route.fan_out) {
                ("", _) => String::new(),
                (id, true) => format!("{id}:{principal}"),
                (id, false) => id.to_owned(),
            },
            principal,
            source: None,
        })
        .collect()
}
