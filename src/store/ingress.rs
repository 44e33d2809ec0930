//! Ingress routes as stored: written as audited admin changes (their secrets kept out of the audit log) and read by id per request.
use sea_orm::sea_query::{Expr, ExprTrait, OnConflict};
use sea_orm::{ActiveValue::Set, ColumnTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect};

use super::audit::{Actor, Change};
use super::entity::{ingress_ledger, ingress_routes};
use super::{classify, IngressTables};
use crate::domain::ingress::{IngressKind, Mapping, Route};
use crate::error::{Error, Result};

fn route(m: ingress_routes::Model) -> Result<Route> {
    let bad = |what: &str| Error::internal(format!("bad stored ingress route {what}"));
    Ok(Route {
        kind: IngressKind::parse(&m.kind).ok_or_else(|| bad("kind"))?,
        mapping: serde_json::from_str::<Mapping>(&m.mapping).map_err(|_| bad("mapping"))?,
        secrets: serde_json::from_str(&m.secrets).map_err(|_| bad("secrets"))?,
        route_id: m.route_id,
        pack_id: m.pack_id,
        fan_out: m.fan_out,
        type_prefix: m.type_prefix,
        nats_stream: m.nats_stream,
        nats_subject: m.nats_subject,
    })
}

impl IngressTables {
    /// Creates or replaces a route; true when its id was new.
    pub async fn put_ingress_route(&self, actor: &Actor, r: &Route, now: i64) -> Result<bool> {
        use ingress_routes::Column as C;
        let change = Change {
            actor,
            pack_id: Some(&r.pack_id),
            principal: None,
            announce: false,
        };
        let row = ingress_routes::ActiveModel {
            route_id: Set(r.route_id.clone()),
            pack_id: Set(r.pack_id.clone()),
            kind: Set(r.kind.as_str().to_owned()),
            mapping: Set(serde_json::to_string(&r.mapping)
                .map_err(|e| Error::internal_from("mapping not stored", e))?),
            secrets: Set(serde_json::to_string(&r.secrets)
                .map_err(|e| Error::internal_from("secrets not stored", e))?),
            fan_out: Set(r.fan_out),
            type_prefix: Set(r.type_prefix.clone()),
            nats_stream: Set(r.nats_stream.clone()),
            nats_subject: Set(r.nats_subject.clone()),
            update_time: Set(now),
        };
        let w = self.begin_write().await?;
        let (created, _) = self
            .audited::<ingress_routes::Entity, _>(
                w,
                change,
                r.route_id.clone(),
                async |txn, before| {
                    ingress_routes::Entity::insert(row)
                        .on_conflict(
                            OnConflict::column(C::RouteId)
                                .update_columns([
                                    C::PackId,
                                    C::Kind,
                                    C::Mapping,
                                    C::Secrets,
                                    C::FanOut,
                                    C::TypePrefix,
                                    C::NatsStream,
                                    C::NatsSubject,
                                    C::UpdateTime,
                                ])
                                .to_owned(),
                        )
                        .exec_without_returning(txn)
                        .await
                        .map_err(classify)?;
                    Ok(before.is_none())
                },
            )
            .await?;
        Ok(created)
    }

    pub async fn ingress_route(&self, route_id: &str) -> Result<Option<Route>> {
        ingress_routes::Entity::find_by_id(route_id.to_owned())
            .one(&self.db)
            .await
            .map_err(classify)?
            .map(route)
            .transpose()
    }

    /// Routes in id order after `after`, at most `limit`.
    pub async fn list_ingress_routes(&self, after: Option<&str>, limit: u64) -> Result<Vec<Route>> {
        let mut q = ingress_routes::Entity::find().order_by_asc(ingress_routes::Column::RouteId);
        if let Some(after) = after {
            q = q.filter(ingress_routes::Column::RouteId.gt(after));
        }
        q.limit(limit)
            .all(&self.db)
            .await
            .map_err(classify)?
            .into_iter()
            .map(route)
            .collect()
    }

    /// Deletes a route; false when there was none.
    pub async fn delete_ingress_route(&self, actor: &Actor, route_id: &str) -> Result<bool> {
        let Some(existing) = self.ingress_route(route_id).await? else {
            return Ok(false);
        };
        let change = Change {
            actor,
            pack_id: Some(&existing.pack_id),
            principal: None,
            announce: false,
        };
        let w = self.begin_write().await?;
        self.audited_delete::<ingress_routes::Entity>(w, change, route_id.to_owned())
            .await
    }
}

/// A signed delivery as the ledger keys it.
#[derive(Debug, Clone)]
pub struct LedgerKey<'a> {
    /// The route the request came to.
    pub route_id: &'a str,
    /// Digests of the route's signing keys the request verifies with: every route holding
    /// one of them shares the delivery's row. Sorted, so replicas claim them in one order.
    pub scopes: &'a [String],
    /// Digest of the signed delivery id.
    pub key: &'a str,
    /// Digest of the signed content the id names.
    pub digest: &'a str,
}

impl LedgerKey<'_> {
    /// The scopes read: the signing keys', and the route's own for rows carried over from
    /// the per-route ledger.
    fn read_scopes(&self) -> Vec<String> {
        let mut s = self.scopes.to_vec();
        s.push(format!("route:{}", self.route_id));
        s
    }
}

/// What the ledger says of a delivery when a request for it arrives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LedgerState {
    /// This request decides the delivery; others wait for its answer.
    Claimed,
    /// Decided before: the first answer, as JSON.
    Decided(String),
    /// A copy is being decided by another request now.
    Pending,
    /// The id was received before with other content.
    OtherContent,
}

/// The state `rows` (one delivery's, in its scopes) give at `now`; `None`: nothing live
/// stands in the way of a claim.
fn state_of(rows: &[ingress_ledger::Model], digest: &str, now: i64) -> Option<LedgerState> {
    let live: Vec<_> = rows
        .iter()
        .filter(|r| r.expire_time.is_none_or(|e| e > now))
        .collect();
    if live
        .iter()
        .any(|r| r.content_digest.as_deref().is_some_and(|d| d != digest))
    {
        return Some(LedgerState::OtherContent);
    }
    if let Some(r) = live.iter().find(|r| !r.answer.is_empty()) {
        return Some(LedgerState::Decided(r.answer.clone()));
    }
    if live.iter().any(|r| r.claim_until.is_some_and(|c| c > now)) {
        return Some(LedgerState::Pending);
    }
    None
}

/// An update of a delivery's rows in the scopes it claimed, while they hold no answer.
fn unanswered(d: &LedgerKey<'_>) -> sea_orm::UpdateMany<ingress_ledger::Entity> {
    use ingress_ledger::Column as C;
    ingress_ledger::Entity::update_many()
        .filter(C::DeliveryKey.eq(d.key))
        .filter(C::Scope.is_in(d.scopes.iter().cloned()))
        .filter(C::Answer.eq(""))
}

impl IngressTables {
    async fn ledger_rows<C: sea_orm::ConnectionTrait>(
        conn: &C,
        d: &LedgerKey<'_>,
    ) -> Result<Vec<ingress_ledger::Model>> {
        use ingress_ledger::Column as C;
        ingress_ledger::Entity::find()
            .filter(C::DeliveryKey.eq(d.key))
            .filter(C::Scope.is_in(d.read_scopes()))
            .all(conn)
            .await
            .map_err(classify)
    }

    /// What the ledger holds for a delivery at `now` (Unix microseconds), without claiming it;
    /// `None`: nothing, or nothing that stands in the way of a claim.
    pub async fn ingress_delivery(
        &self,
        d: &LedgerKey<'_>,
        now: i64,
    ) -> Result<Option<LedgerState>> {
        let rows = Self::ledger_rows(&self.db, d).await?;
        Ok(state_of(&rows, d.digest, now))
    }

    /// Claims a delivery for this request unless it was decided, is being decided, or was
    /// named with other content: a row in each of its scopes, held until `claim_until`, kept
    /// until `expire_time` (`None`: for ever). Copies racing on other replicas find the row
    /// (on PostgreSQL the second insert waits for the first to commit).
    pub async fn claim_ingress_delivery(
        &self,
        d: &LedgerKey<'_>,
        now: i64,
        claim_until: i64,
        expire_time: Option<i64>,
    ) -> Result<LedgerState> {
        use ingress_ledger::Column as C;
        let w = self.begin_write().await?;
        let rows = Self::ledger_rows(&w.txn, d).await?;
        if let Some(state) = state_of(&rows, d.digest, now) {
            return Ok(state);
        }
        let t = ingress_ledger::Entity;
        // An expired row is taken over; so is one whose request was refused before deciding,
        // or whose claim lapsed, for the same content.
        let takeable = Expr::col((t, C::ExpireTime))
            .lte(now)
            .or(Expr::col((t, C::Answer))
                .eq("")
                .and(
                    Expr::col((t, C::ClaimUntil))
                        .is_null()
                        .or(Expr::col((t, C::ClaimUntil)).lte(now)),
                )
                .and(
                    Expr::col((t, C::ContentDigest))
                        .is_null()
                        .or(Expr::col((t, C::ContentDigest)).eq(d.digest)),
                ));
        let mut claimed = 0;
        for scope in d.scopes {
            let row = ingress_ledger::ActiveModel {
                scope: Set(scope.clone()),
                delivery_key: Set(d.key.to_owned()),
                route_id: Set(d.route_id.to_owned()),
                content_digest: Set(Some(d.digest.to_owned())),
                claim_until: Set(Some(claim_until)),
                decide_time: Set(now),
                expire_time: Set(expire_time),
                answer: Set(String::new()),
            };
            claimed += ingress_ledger::Entity::insert(row)
                .on_conflict(
                    OnConflict::columns([C::Scope, C::DeliveryKey])
                        .update_columns([
                            C::RouteId,
                            C::ContentDigest,
                            C::ClaimUntil,
                            C::DecideTime,
                            C::ExpireTime,
                            C::Answer,
                        ])
                        .action_and_where(takeable.clone())
                        .to_owned(),
                )
                .exec_without_returning(&w.txn)
                .await
                .map_err(classify)?;
        }
        if claimed as usize == d.scopes.len() {
            w.commit().await?;
            return Ok(LedgerState::Claimed);
        }
        // Another request took one of the rows between the read and the insert.
        drop(w);
        let rows = Self::ledger_rows(&self.db, d).await?;
        Ok(state_of(&rows, d.digest, now).unwrap_or(LedgerState::Pending))
    }

    /// Keeps the answer of a delivery this request claimed: every later copy gets it.
    pub async fn settle_ingress_delivery(
        &self,
        d: &LedgerKey<'_>,
        now: i64,
        answer: &str,
    ) -> Result<()> {
        use ingress_ledger::Column as C;
        let w = self.begin_write().await?;
        unanswered(d)
            .col_expr(C::Answer, Expr::value(answer))
            .col_expr(C::ClaimUntil, Expr::value(Option::<i64>::None))
            .col_expr(C::DecideTime, Expr::value(now))
            .exec(&w.txn)
            .await
            .map_err(classify)?;
        w.commit().await
    }

    /// Lets go of a claimed delivery whose request was refused before any decision: a retry
    /// with the same content may claim it at once; other content is still refused.
    pub async fn release_ingress_delivery(&self, d: &LedgerKey<'_>) -> Result<()> {
        let w = self.begin_write().await?;
        unanswered(d)
            .col_expr(
                ingress_ledger::Column::ClaimUntil,
                Expr::value(Option::<i64>::None),
            )
            .exec(&w.txn)
            .await
            .map_err(classify)?;
        w.commit().await
    }

    /// Deletes ledger rows expired at `now`, the earliest first, about `limit` of them (rows
    /// expiring at the same microsecond go together); returns how many.
    pub async fn prune_ingress_ledger(&self, now: i64, limit: u64) -> Result<u64> {
        use ingress_ledger::Column as C;
        let w = self.begin_write().await?;
        // The batch's last expiry: one portable bound, where deleting by a subquery of
        // composite keys is not.
        let last: Option<Option<i64>> = ingress_ledger::Entity::find()
            .select_only()
            .column(C::ExpireTime)
            .filter(C::ExpireTime.lte(now))
            .order_by_asc(C::ExpireTime)
            .offset(limit.saturating_sub(1))
            .limit(1)
            .into_tuple()
            .one(&w.txn)
            .await
            .map_err(classify)?;
        let cutoff = last.flatten().unwrap_or(now);
        let r = ingress_ledger::Entity::delete_many()
            .filter(C::ExpireTime.lte(cutoff))
            .exec(&w.txn)
            .await
            .map_err(classify)?;
        w.commit().await?;
        Ok(r.rows_affected)
    }
}
