//! Audit rows, written inside the transaction of the admin change they describe.
use sea_orm::{
    ActiveValue::Set, ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder,
    QuerySelect,
};

use super::entity::audit_events;
use super::{classify, now_micros, Store};
use crate::error::Result;

/// Who made the change being written: every audited write is passed one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    pub subject: String,
    pub role: String,
    pub rpc: String,
}

/// One audit row as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditEvent {
    pub event_id: String,
    pub time: i64,
    pub actor: String,
    pub role: String,
    pub rpc: String,
    pub pack_id: Option<String>,
    pub principal: Option<String>,
    pub before: Option<String>,
    pub after: Option<String>,
}

/// A row as the audit log keeps it before and after a change: JSON text.
pub(crate) fn json<T: serde::Serialize + ?Sized>(row: &T) -> Option<String> {
    serde_json::to_string(row).ok()
}

/// Appends an audit row for a change by `actor` in the current transaction.
pub(crate) async fn record(
    txn: &impl ConnectionTrait,
    actor: &Actor,
    pack_id: Option<&str>,
    principal: Option<&str>,
    before: Option<String>,
    after: Option<String>,
) -> Result<()> {
    audit_events::Entity::insert(audit_events::ActiveModel {
        event_id: Set(uuid::Uuid::now_v7().to_string()),
        event_time: Set(now_micros()),
        actor: Set(actor.subject.clone()),
        role: Set(actor.role.clone()),
        rpc: Set(actor.rpc.clone()),
        pack_id: Set(pack_id.map(str::to_owned)),
        principal: Set(principal.map(str::to_owned)),
        before: Set(before),
        after: Set(after),
    })
    .exec_without_returning(txn)
    .await
    .map_err(classify)?;
    Ok(())
}

impl Store {
    /// Audit events, newest first, before the given (time, id) position.
    pub async fn list_audit_events(
        &self,
        pack_id: Option<&str>,
        principal: Option<&str>,
        before: Option<(i64, &str)>,
        limit: u64,
    ) -> Result<Vec<AuditEvent>> {
        use audit_events::Column as C;
        let mut q = audit_events::Entity::find()
            .order_by_desc(C::EventTime)
            .order_by_desc(C::EventId);
        if let Some(p) = pack_id {
            q = q.filter(C::PackId.eq(p));
        }
        if let Some(p) = principal {
            q = q.filter(C::Principal.eq(p));
        }
        if let Some((t, id)) = before {
            use sea_orm::sea_query::{Expr, ExprTrait};
            q = q.filter(
                Expr::tuple([Expr::col(C::EventTime), Expr::col(C::EventId)])
                    .lt(Expr::tuple([Expr::val(t), Expr::val(id)])),
            );
        }
        Ok(q.limit(limit)
            .all(&self.db)
            .await
            .map_err(classify)?
            .into_iter()
            .map(|e| AuditEvent {
                event_id: e.event_id,
                time: e.event_time,
                actor: e.actor,
                role: e.role,
                rpc: e.rpc,
                pack_id: e.pack_id,
                principal: e.principal,
                before: e.before,
                after: e.after,
            })
            .collect())
    }
}
