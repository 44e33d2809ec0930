//! Quota rows: each rule with the fleet's token bucket beside it, which replicas lease tokens from.
use sea_orm::{
    ActiveModelTrait, ActiveValue::Set, EntityTrait, IntoActiveModel, QuerySelect, TransactionTrait,
};

use super::audit::{Actor, Change};
use super::entity::sense_quotas;
use super::{classify, DeliveryTables, PolicyTables};
use crate::domain::model::KeyPage;
use crate::domain::quota::{Bucket, Quota, Rule};
use crate::error::{Error, Result};

/// A stored row as a quota; a stored rule the rules no longer allow is a fault.
pub(super) fn quota(q: sense_quotas::Model) -> Result<Quota> {
    let burst = u32::try_from(q.burst).map_err(|_| Error::internal("bad stored quota"))?;
    let rule =
        Rule::new(q.rate_per_second, burst).map_err(|_| Error::internal("bad stored quota"))?;
    Ok(Quota {
        pack_id: q.pack_id,
        principal: (!q.principal.is_empty()).then_some(q.principal),
        rule,
        update_time: q.update_time,
    })
}

/// The stored key of a quota: the pack, and the principal or "" for the pack-wide one.
fn key(pack_id: &str, principal: Option<&str>) -> (String, String) {
    (pack_id.to_owned(), principal.unwrap_or("").to_owned())
}

/// What a lease from the fleet's bucket got: whole tokens, and what the bucket has left.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lease {
    pub granted: u32,
    pub left: f64,
}

impl PolicyTables {
    /// Sets a quota; its bucket starts full, and a changed rule keeps the tokens the bucket
    /// held (refilled at the rule they came under, at most the new burst).
    pub async fn put_quota(&self, actor: &Actor, q: &Quota, now: i64) -> Result<Quota> {
        let change = Change {
            actor,
            pack_id: Some(&q.pack_id),
            principal: q.principal.as_deref(),
            announce: true,
        };
        let k = key(&q.pack_id, q.principal.as_deref());
        let w = self.begin_write().await?;
        let ((), row) = self
            .audited::<sense_quotas::Entity, _>(w, change, k.clone(), async |txn, before| {
                let rule = q.rule;
                let bucket = match before.and_then(|b| quota(b.clone()).ok().map(|o| (b, o))) {
                    Some((b, old)) => {
                        let mut kept = Bucket {
                            tokens: b.tokens,
                            at: b.refill_time,
                        };
                        kept.refill(&old.rule, now);
                        kept.refill(&rule, now);
                        kept
                    }
                    None => Bucket::full(&rule, now),
                };
                let row = sense_quotas::ActiveModel {
                    pack_id: Set(k.0.clone()),
                    principal: Set(k.1.clone()),
                    rate_per_second: Set(rule.rate),
                    burst: Set(i64::from(rule.burst)),
                    tokens: Set(bucket.tokens),
                    refill_time: Set(bucket.at),
                    update_time: Set(now),
                };
                if before.is_some() {
                    row.update(txn).await.map_err(classify)?;
                } else {
                    sense_quotas::Entity::insert(row)
                        .exec_without_returning(txn)
                        .await
                        .map_err(classify)?;
                }
                Ok(())
            })
            .await?;
        quota(row.ok_or_else(|| Error::internal("a quota was not stored"))?)
    }

    pub async fn get_quota(&self, pack_id: &str, principal: Option<&str>) -> Result<Option<Quota>> {
        sense_quotas::Entity::find_by_id(key(pack_id, principal))
            .one(&self.db)
            .await
            .map_err(classify)?
            .map(quota)
            .transpose()
    }

    /// Quotas in (pack_id, principal) order, the pack-wide one first; `second` filters by
    /// principal.
    pub async fn list_quotas(&self, p: &KeyPage<'_>) -> Result<Vec<Quota>> {
        use sense_quotas::Column as C;
        self.key_page::<sense_quotas::Entity, _>((C::PackId, C::Principal), p, quota)
            .await
    }

    /// Deletes a quota; false when there was none.
    pub async fn delete_quota(
        &self,
        actor: &Actor,
        pack_id: &str,
        principal: Option<&str>,
    ) -> Result<bool> {
        let change = Change {
            actor,
            pack_id: Some(pack_id),
            principal,
            announce: true,
        };
        let w = self.begin_write().await?;
        self.audited_delete::<sense_quotas::Entity>(w, change, key(pack_id, principal))
            .await
    }
}

impl DeliveryTables {
    /// A quota's bucket in the store as it was last written, unlocked: what ExplainTrigger reads.
    pub async fn get_quota_bucket(
        &self,
        pack_id: &str,
        principal: Option<&str>,
    ) -> Result<Option<Bucket>> {
        Ok(sense_quotas::Entity::find_by_id(key(pack_id, principal))
            .one(&self.db)
            .await
            .map_err(classify)?
            .map(|q| Bucket {
                tokens: q.tokens,
                at: q.refill_time,
            }))
    }

    /// Gives back `returned` tokens leased and not spent in time, then leases up to `want`
    /// whole tokens from a quota's bucket in the store, shared by every replica: the row is
    /// locked while the bucket is refilled, given back to and taken from, so two replicas
    /// never lease the same token, and a bucket given back to holds at most its burst (as if
    /// the tokens had never left it). `None` when the quota is gone.
    pub async fn lease_quota(
        &self,
        pack_id: &str,
        principal: Option<&str>,
        returned: u32,
        want: u32,
        now: i64,
    ) -> Result<Option<Lease>> {
        let txn = self.db.begin().await.map_err(classify)?;
        let Some(row) = sense_quotas::Entity::find_by_id(key(pack_id, principal))
            .lock_exclusive()
            .one(&txn)
            .await
            .map_err(classify)?
        else {
            return Ok(None);
        };
        let rule = quota(row.clone())?.rule;
        let mut bucket = Bucket {
            tokens: row.tokens,
            at: row.refill_time,
        };
        bucket.refill(&rule, now);
        bucket.give_back(&rule, returned);
        let granted = bucket.take_up_to(&rule, now, want);
        let mut active = row.into_active_model();
        active.tokens = Set(bucket.tokens);
        active.refill_time = Set(bucket.at);
        active.update(&txn).await.map_err(classify)?;
        txn.commit().await.map_err(classify)?;
        Ok(Some(Lease {
            granted,
            left: bucket.tokens,
        }))
    }
}
