//! Audit rows, written inside the transaction of the admin change they describe; `Store::audited` is the one way an admin change of a row is made.
use sea_orm::{
    ActiveValue::Set, ColumnTrait, ConnectionTrait, DatabaseTransaction, EntityTrait,
    PrimaryKeyTrait, QueryFilter, QueryOrder, QuerySelect,
};

use super::entity::audit_events;
use super::{classify, now_micros, PolicyTables, Store, WriteTxn};
use crate::error::Result;

/// What an audited change touches, and whether the other replicas must reload its pack.
pub(crate) struct Change<'a> {
    pub actor: &'a Actor,
    pub pack_id: Option<&'a str>,
    pub principal: Option<&'a str>,
    /// The row is policy that decisions read: announce the pack on commit.
    pub announce: bool,
}

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
    /// One audited change of the row of `E` at `key`, in the write `w`: the row as it was is
    /// read (locked, so concurrent changes of it take turns), `apply` changes it given that,
    /// the row as it is now is read back, both go to the audit log as JSON, and `w` commits,
    /// announcing the pack when the change says so. A change that found no row and left none
    /// changed nothing and is neither audited nor announced. Returns what `apply` returned and
    /// the row as it now is.
    pub(crate) async fn audited<E, T>(
        &self,
        w: WriteTxn,
        change: Change<'_>,
        key: <E::PrimaryKey as PrimaryKeyTrait>::ValueType,
        apply: impl AsyncFnOnce(&DatabaseTransaction, Option<&E::Model>) -> Result<T>,
    ) -> Result<(T, Option<E::Model>)>
    where
        E: EntityTrait,
        E::Model: serde::Serialize,
        <E::PrimaryKey as PrimaryKeyTrait>::ValueType: Clone,
    {
        let before = E::find_by_id(key.clone())
            .lock_exclusive()
            .one(&w.txn)
            .await
            .map_err(classify)?;
        let out = apply(&w.txn, before.as_ref()).await?;
        let after = E::find_by_id(key).one(&w.txn).await.map_err(classify)?;
        if before.is_none() && after.is_none() {
            w.commit().await?;
            return Ok((out, None));
        }
        record(
            &w.txn,
            change.actor,
            change.pack_id,
            change.principal,
            before.as_ref().and_then(json),
            after.as_ref().and_then(json),
        )
        .await?;
        match change.pack_id.filter(|_| change.announce) {
            Some(pack_id) => w.commit_announcing(pack_id).await?,
            None => w.commit().await?,
        }
        Ok((out, after))
    }

    /// Deletes the row of `E` at `key` as an audited change; false when there was none.
    pub(crate) async fn audited_delete<E>(
        &self,
        w: WriteTxn,
        change: Change<'_>,
        key: <E::PrimaryKey as PrimaryKeyTrait>::ValueType,
    ) -> Result<bool>
    where
        E: EntityTrait,
        E::Model: serde::Serialize,
        <E::PrimaryKey as PrimaryKeyTrait>::ValueType: Clone,
    {
        let (deleted, _) = self
            .audited::<E, _>(w, change, key.clone(), async |txn, before| {
                if before.is_none() {
                    return Ok(false);
                }
                E::delete_by_id(key).exec(txn).await.map_err(classify)?;
                Ok(true)
            })
            .await?;
        Ok(deleted)
    }
}

impl PolicyTables {
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
