//! Ingress routes as stored: written as audited admin changes (their secrets kept out of the audit log) and read by id per request.
use sea_orm::sea_query::{Expr, ExprTrait, OnConflict};
use sea_orm::{ActiveValue::Set, ColumnTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect};

use super::audit::{Actor, Change};
use super::entity::{ingress_deliveries, ingress_routes};
use super::{classify, IngressTables};
use crate::domain::ingress::{IngressKind, Mapping, Route};
use crate::error::{Error, Result};

fn route(m: ingress_routes::Model) -> Result<Route> {
    let bad = |what: &str| Error::Internal(format!("bad stored ingress route {what}"));
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
                .map_err(|e| Error::Internal(format!("mapping not stored: {e}")))?),
            secrets: Set(serde_json::to_string(&r.secrets)
                .map_err(|e| Error::Internal(format!("secrets not stored: {e}")))?),
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

impl IngressTables {
    /// The first answer to a route's signed delivery (`key`: the digest of its delivery id),
    /// while the row has not expired at `now` (Unix microseconds).
    pub async fn ingress_delivery(
        &self,
        route_id: &str,
        key: &str,
        now: i64,
    ) -> Result<Option<String>> {
        use ingress_deliveries::Column as C;
        Ok(
            ingress_deliveries::Entity::find_by_id((route_id.to_owned(), key.to_owned()))
                .filter(C::ExpireTime.is_null().or(C::ExpireTime.gt(now)))
                .one(&self.db)
                .await
                .map_err(classify)?
                .map(|m| m.answer),
        )
    }

    /// Keeps a decided delivery's answer until `expire_time` (`None`: for ever). A row another
    /// replica kept first stays as it is (its answer was the first); an expired one is replaced.
    pub async fn keep_ingress_delivery(
        &self,
        route_id: &str,
        key: &str,
        now: i64,
        expire_time: Option<i64>,
        answer: &str,
    ) -> Result<()> {
        use ingress_deliveries::Column as C;
        let row = ingress_deliveries::ActiveModel {
            route_id: Set(route_id.to_owned()),
            delivery_key: Set(key.to_owned()),
            decide_time: Set(now),
            expire_time: Set(expire_time),
            answer: Set(answer.to_owned()),
        };
        let expired = Expr::col((ingress_deliveries::Entity, C::ExpireTime)).lte(now);
        let w = self.begin_write().await?;
        ingress_deliveries::Entity::insert(row)
            .on_conflict(
                OnConflict::columns([C::RouteId, C::DeliveryKey])
                    .update_columns([C::DecideTime, C::ExpireTime, C::Answer])
                    .action_and_where(expired)
                    .to_owned(),
            )
            .exec_without_returning(&w.txn)
            .await
            .map_err(classify)?;
        w.commit().await
    }

    /// Deletes ledger rows expired at `now`, the earliest first, about `limit` of them (rows
    /// expiring at the same microsecond go together); returns how many.
    pub async fn prune_ingress_deliveries(&self, now: i64, limit: u64) -> Result<u64> {
        use ingress_deliveries::Column as C;
        let w = self.begin_write().await?;
        // The batch's last expiry: one portable bound, where deleting by a subquery of
        // composite keys is not.
        let last: Option<Option<i64>> = ingress_deliveries::Entity::find()
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
        let r = ingress_deliveries::Entity::delete_many()
            .filter(C::ExpireTime.lte(cutoff))
            .exec(&w.txn)
            .await
            .map_err(classify)?;
        w.commit().await?;
        Ok(r.rows_affected)
    }
}
