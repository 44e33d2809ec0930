//! Packs and their declarations: registered, replaced and removed atomically.
use super::audit::Actor;
use sea_orm::{
    ActiveValue::Set, ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder,
    QuerySelect,
};

use super::entity::{
    pack_commands, pack_stimuli, pack_triggers, packs, sense_activations, sense_grants,
    sense_quotas,
};
use super::{classify, Engine, PolicyTables};
use crate::domain::pack::schema::declared;
use crate::domain::pack::{
    BindingMode, Command, DeclaredTrigger, Manifest, PackKind, RegisteredPack, Stimulus,
    TriggerSource,
};
use crate::error::{Error, Result};

impl PolicyTables {
    /// Stores a linted manifest, replacing any earlier declaration of the same
    /// pack in one transaction. Returns the stored pack and whether it was new.
    pub async fn put_pack(
        &self,
        actor: &Actor,
        m: &Manifest,
        now: i64,
    ) -> Result<(RegisteredPack, bool)> {
        match self.put_pack_once(actor, m, now).await {
            // A concurrent first registration of the same id won the insert: replace it.
            Err(Error::AlreadyExists(_)) => self.put_pack_once(actor, m, now).await,
            other => other,
        }
    }

    async fn put_pack_once(
        &self,
        actor: &Actor,
        m: &Manifest,
        now: i64,
    ) -> Result<(RegisteredPack, bool)> {
        let w = self.begin_write().await?;
        let txn = &w.txn;
        let mut find = packs::Entity::find_by_id(m.pack_id.clone());
        if self.engine() == Engine::Postgres {
            // Concurrent re-registrations of one pack queue on its row.
            find = find.lock_exclusive();
        }
        let existing = find.one(txn).await.map_err(classify)?;
        let (generation, create_time) = existing
            .as_ref()
            .map_or((1, now), |p| (p.generation + 1, p.create_time));
        let row = packs::ActiveModel {
            pack_id: Set(m.pack_id.clone()),
            kind: Set(m.kind.as_str().to_owned()),
            binding_mode: Set(m.binding_mode.as_str().to_owned()),
            binding_hub: Set(m.binding_hub.clone()),
            upstream_requires_registration: Set(m.upstream_requires_registration),
            manifest: Set(m.raw.to_string()),
            generation: Set(generation),
            create_time: Set(create_time),
            update_time: Set(now),
        };
        if existing.is_some() {
            packs::Entity::update(row)
                .exec(txn)
                .await
                .map_err(classify)?;
            delete_declaration(txn, &m.pack_id).await?;
        } else {
            packs::Entity::insert(row)
                .exec_without_returning(txn)
                .await
                .map_err(classify)?;
        }
        insert_declaration(txn, m).await?;
        super::audit::record(
            txn,
            actor,
            Some(&m.pack_id),
            None,
            existing.as_ref().and_then(|p| {
                super::audit::json(&serde_json::json!({
                    "pack_id": p.pack_id,
                    "generation": p.generation,
                    "kind": p.kind,
                    "binding_mode": p.binding_mode,
                }))
            }),
            super::audit::json(&serde_json::json!({
                "pack_id": m.pack_id,
                "generation": generation,
                "kind": m.kind,
                "binding_mode": m.binding_mode,
                "refs": m.triggers.iter().map(|t| t.r#ref.as_str()).collect::<Vec<_>>(),
            })),
        )
        .await?;
        w.commit_announcing(&m.pack_id).await?;
        Ok((
            RegisteredPack {
                manifest: m.clone(),
                generation,
                create_time,
                update_time: now,
            },
            existing.is_none(),
        ))
    }

    pub async fn get_pack(&self, pack_id: &str) -> Result<Option<RegisteredPack>> {
        let Some(row) = packs::Entity::find_by_id(pack_id.to_owned())
            .one(&self.db)
            .await
            .map_err(classify)?
        else {
            return Ok(None);
        };
        Ok(self.assemble(vec![row]).await?.pop())
    }

    /// Packs in pack id order, after `after` when given (keyset pagination).
    pub async fn list_packs(&self, after: Option<&str>, limit: u64) -> Result<Vec<RegisteredPack>> {
        let mut q = packs::Entity::find().order_by_asc(packs::Column::PackId);
        if let Some(after) = after {
            q = q.filter(packs::Column::PackId.gt(after));
        }
        let rows = q.limit(limit).all(&self.db).await.map_err(classify)?;
        self.assemble(rows).await
    }

    /// Removes a pack's declaration and its Sense grants, activations and quotas.
    /// Bindings, Execute state and records are not Sense's to remove.
    pub async fn delete_pack(&self, actor: &Actor, pack_id: &str) -> Result<bool> {
        let w = self.begin_write().await?;
        let txn = &w.txn;
        let res = packs::Entity::delete_by_id(pack_id.to_owned())
            .exec(txn)
            .await
            .map_err(classify)?;
        if res.rows_affected == 0 {
            return Ok(false);
        }
        delete_declaration(txn, pack_id).await?;
        sense_grants::Entity::delete_many()
            .filter(sense_grants::Column::PackId.eq(pack_id))
            .exec(txn)
            .await
            .map_err(classify)?;
        sense_activations::Entity::delete_many()
            .filter(sense_activations::Column::PackId.eq(pack_id))
            .exec(txn)
            .await
            .map_err(classify)?;
        // A quota left behind would meet the pack if it were registered again, unlooked for.
        sense_quotas::Entity::delete_many()
            .filter(sense_quotas::Column::PackId.eq(pack_id))
            .exec(txn)
            .await
            .map_err(classify)?;
        let before =
            super::audit::json(&serde_json::json!({ "pack_id": pack_id, "registered": true }));
        super::audit::record(txn, actor, Some(pack_id), None, before, None).await?;
        w.commit_announcing(pack_id).await?;
        // Its compiled schemas go with it: nothing else holds them once the view lets go.
        self.forget_trigger_types(pack_id);
        Ok(true)
    }

    /// Joins pack rows with their declarations, three queries for any number of packs.
    async fn assemble(&self, rows: Vec<packs::Model>) -> Result<Vec<RegisteredPack>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<String> = rows.iter().map(|r| r.pack_id.clone()).collect();
        let triggers = pack_triggers::Entity::find()
            .filter(pack_triggers::Column::PackId.is_in(ids.clone()))
            .order_by_asc(pack_triggers::Column::PackId)
            .order_by_asc(pack_triggers::Column::Position)
            .all(&self.db)
            .await
            .map_err(classify)?;
        let stimuli = pack_stimuli::Entity::find()
            .filter(pack_stimuli::Column::PackId.is_in(ids.clone()))
            .order_by_asc(pack_stimuli::Column::PackId)
            .order_by_asc(pack_stimuli::Column::Position)
            .all(&self.db)
            .await
            .map_err(classify)?;
        let commands = pack_commands::Entity::find()
            .filter(pack_commands::Column::PackId.is_in(ids))
            .order_by_asc(pack_commands::Column::PackId)
            .order_by_asc(pack_commands::Column::Position)
            .all(&self.db)
            .await
            .map_err(classify)?;
        rows.into_iter()
            .map(|row| {
                let id = row.pack_id.as_str();
                let corrupt =
                    |what: &str| Error::internal(format!("pack `{id}` has a bad stored {what}"));
                let raw: serde_json::Value =
                    serde_json::from_str(&row.manifest).map_err(|_| corrupt("manifest"))?;
                let triggers = triggers
                    .iter()
                    .filter(|t| t.pack_id == id)
                    .map(|t| {
                        // Descriptions and schemas are read from the manifest as registered.
                        let (description, payload_schema) = declared(&raw)
                            .find(|(r, ..)| *r == t.r#ref)
                            .map_or((None, None), |(_, d, s)| (d.map(str::to_owned), s.cloned()));
                        Ok(DeclaredTrigger {
                            r#ref: t.r#ref.clone(),
                            source: TriggerSource::parse(&t.source)
                                .ok_or_else(|| corrupt("source"))?,
                            description,
                            payload_schema,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                let manifest = Manifest {
                    kind: PackKind::parse(&row.kind).ok_or_else(|| corrupt("kind"))?,
                    binding_mode: BindingMode::parse(&row.binding_mode)
                        .ok_or_else(|| corrupt("binding mode"))?,
                    binding_hub: row.binding_hub.clone(),
                    triggers,
                    stimuli: stimuli
                        .iter()
                        .filter(|s| s.pack_id == id)
                        .map(|s| Stimulus {
                            r#ref: s.r#ref.clone(),
                            operation: s.operation.clone(),
                            land: s.land.clone(),
                        })
                        .collect(),
                    commands: commands
                        .iter()
                        .filter(|c| c.pack_id == id)
                        .map(|c| Command {
                            name: c.name.clone(),
                            installs_webhook: c.installs_webhook,
                        })
                        .collect(),
                    upstream_requires_registration: row.upstream_requires_registration,
                    raw,
                    pack_id: row.pack_id.clone(),
                };
                Ok(RegisteredPack {
                    manifest,
                    generation: row.generation,
                    create_time: row.create_time,
                    update_time: row.update_time,
                })
            })
            .collect()
    }
}

async fn delete_declaration(txn: &impl ConnectionTrait, pack_id: &str) -> Result<()> {
    pack_triggers::Entity::delete_many()
        .filter(pack_triggers::Column::PackId.eq(pack_id))
        .exec(txn)
        .await
        .map_err(classify)?;
    pack_stimuli::Entity::delete_many()
        .filter(pack_stimuli::Column::PackId.eq(pack_id))
        .exec(txn)
        .await
        .map_err(classify)?;
    pack_commands::Entity::delete_many()
        .filter(pack_commands::Column::PackId.eq(pack_id))
        .exec(txn)
        .await
        .map_err(classify)?;
    Ok(())
}

async fn insert_declaration(txn: &impl ConnectionTrait, m: &Manifest) -> Result<()> {
    let pos = |i: usize| i32::try_from(i).unwrap_or(i32::MAX);
    if !m.triggers.is_empty() {
        pack_triggers::Entity::insert_many(m.triggers.iter().enumerate().map(|(i, t)| {
            pack_triggers::ActiveModel {
                pack_id: Set(m.pack_id.clone()),
                r#ref: Set(t.r#ref.clone()),
                position: Set(pos(i)),
                source: Set(t.source.as_str().to_owned()),
            }
        }))
        .exec_without_returning(txn)
        .await
        .map_err(classify)?;
    }
    if !m.stimuli.is_empty() {
        pack_stimuli::Entity::insert_many(m.stimuli.iter().enumerate().map(|(i, s)| {
            pack_stimuli::ActiveModel {
                pack_id: Set(m.pack_id.clone()),
                position: Set(pos(i)),
                r#ref: Set(s.r#ref.clone()),
                operation: Set(s.operation.clone()),
                land: Set(s.land.clone()),
            }
        }))
        .exec_without_returning(txn)
        .await
        .map_err(classify)?;
    }
    if !m.commands.is_empty() {
        pack_commands::Entity::insert_many(m.commands.iter().enumerate().map(|(i, c)| {
            pack_commands::ActiveModel {
                pack_id: Set(m.pack_id.clone()),
                position: Set(pos(i)),
                name: Set(c.name.clone()),
                installs_webhook: Set(c.installs_webhook),
            }
        }))
        .exec_without_returning(txn)
        .await
        .map_err(classify)?;
    }
    Ok(())
}
