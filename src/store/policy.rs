//! Sense policy rows: grants, activations, Bindings, project members, and the Execute-state mirror.
use super::audit::{Actor, Change};

use sea_orm::sea_query::OnConflict;
use sea_orm::{
    ActiveValue::Set, ColumnTrait, Condition, DatabaseTransaction, EntityTrait, QueryFilter,
    QueryOrder, QuerySelect,
};

use super::entity::{
    bindings, execute_states, pack_stimuli, pack_triggers, packs, project_members,
    sense_activations, sense_grants, sense_quotas,
};
use super::{classify, DeliveryTables, PolicyTables, Store};
use crate::domain::decision_log::Note;
use crate::domain::filter::Filter;
use crate::domain::model::{ActivationRow, Binding, ExecuteState, Grant, KeyPage, Member, Record};
use crate::domain::pack::schema::TriggerTypes;
use crate::domain::pack::BindingMode;
use crate::domain::policy::{Activation, BindingRef, BindingState, PackPolicy, PolicyView, Route};
use crate::error::{Error, Result};
use sha2::{Digest, Sha256};
use std::sync::Arc;

/// Rows read per query when loading a pack's policy.
const LOAD_CHUNK: u64 = 5000;

fn corrupt(what: &str) -> Error {
    Error::internal(format!("bad stored {what}"))
}

fn route(s: &str) -> Result<Route> {
    Route::parse(s).ok_or_else(|| corrupt("route"))
}

fn binding(b: bindings::Model) -> Result<Binding> {
    Ok(Binding {
        mode: BindingMode::parse(&b.mode).ok_or_else(|| corrupt("binding mode"))?,
        state: BindingState::parse(&b.state).ok_or_else(|| corrupt("binding state"))?,
        principal: b.principal,
        pack_id: b.pack_id,
        binding_id: b.binding_id,
        update_time: b.update_time,
    })
}

fn activation(a: sense_activations::Model) -> Result<ActivationRow> {
    Ok(ActivationRow {
        route: route(&a.route)?,
        principal: a.principal,
        pack_id: a.pack_id,
        enabled: a.enabled,
        filter: a.filter,
        update_time: a.update_time,
    })
}

fn execute_state(e: execute_states::Model) -> ExecuteState {
    ExecuteState {
        principal: e.principal,
        pack_id: e.pack_id,
        installed: e.installed,
        activated: e.activated,
        connected: e.connected,
        update_time: e.update_time,
    }
}

impl ActivationRow {
    /// The activation, with its filter compiled by `filters`.
    pub fn activation(&self, filters: &mut Filters) -> Activation {
        if self.enabled {
            Activation::On(self.route, filters.get(&self.filter))
        } else {
            Activation::Off
        }
    }
}

/// Compiles stored filters, each distinct text once (many principals share one).
#[derive(Default)]
pub struct Filters(std::collections::HashMap<String, Arc<Filter>>);

impl Filters {
    /// The compiled filter of a stored text; `None` for the empty text. A stored filter that
    /// no longer compiles (its rules tightened since) is kept as one that fails every
    /// trigger: dropped as `filter_error` and said so, never recorded unfiltered.
    pub fn get(&mut self, source: &str) -> Option<Arc<Filter>> {
        if source.is_empty() {
            return None;
        }
        if let Some(f) = self.0.get(source) {
            return Some(f.clone());
        }
        let f = Filter::shared(source).unwrap_or_else(|why| {
            tracing::warn!(
                filter = source,
                why,
                "a stored activation filter does not compile; it drops every trigger"
            );
            Filter::unusable(source, why)
        });
        self.0.insert(source.to_owned(), f.clone());
        Some(f)
    }
}

/// A listing over a two-column key `(a, b)`: filtered by either when given, in key order,
/// after the position `after`.
fn keyset<E: EntityTrait, C: ColumnTrait>(
    q: sea_orm::Select<E>,
    (a, a_is): (C, Option<&str>),
    (b, b_is): (C, Option<&str>),
    after: Option<(&str, &str)>,
) -> sea_orm::Select<E> {
    let mut q = q.order_by_asc(a).order_by_asc(b);
    if let Some(v) = a_is {
        q = q.filter(a.eq(v));
    }
    if let Some(v) = b_is {
        q = q.filter(b.eq(v));
    }
    if let Some((x, y)) = after {
        q = q.filter(
            Condition::any()
                .add(a.gt(x))
                .add(Condition::all().add(a.eq(x)).add(b.gt(y))),
        );
    }
    q
}

/// Inserts `row`, or where a row with its key (`key` columns) exists, overwrites `update`
/// columns of it (none: leaves it as it is).
async fn upsert<E: EntityTrait>(
    txn: &DatabaseTransaction,
    row: E::ActiveModel,
    key: [E::Column; 2],
    update: &[E::Column],
) -> Result<()> {
    let mut on = OnConflict::columns(key);
    if update.is_empty() {
        on.do_nothing();
    } else {
        on.update_columns(update.iter().copied());
    }
    E::insert(row)
        .on_conflict(on.to_owned())
        .exec_without_returning(txn)
        .await
        .map_err(classify)?;
    Ok(())
}

impl PolicyTables {
    /// The whole policy view, as loaded at start.
    pub async fn load_policy(&self) -> Result<PolicyView> {
        let ids: Vec<String> = packs::Entity::find()
            .select_only()
            .column(packs::Column::PackId)
            .into_tuple()
            .all(&self.db)
            .await
            .map_err(classify)?;
        // TriggerTypesByPack of packs deleted while this replica was not listening go too.
        {
            let known: std::collections::HashSet<&str> = ids.iter().map(String::as_str).collect();
            self.trigger_types
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|id, _| known.contains(id.as_str()));
        }
        let mut all = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(p) = self.load_pack_policy(&id).await? {
                all.push((id, p));
            }
        }
        Ok(PolicyView::from_packs(all))
    }

    /// The trigger types of a pack's stored manifest, compiled only when the manifest is new to this
    /// process.
    pub fn trigger_types(&self, pack_id: &str, manifest: &str) -> Result<Arc<TriggerTypes>> {
        let digest: [u8; 32] = Sha256::digest(manifest.as_bytes()).into();
        let mut cache = self.trigger_types.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((d, c)) = cache.get(pack_id) {
            if *d == digest {
                return Ok(c.clone());
            }
        }
        let raw: serde_json::Value =
            serde_json::from_str(manifest).map_err(|_| corrupt("manifest"))?;
        let c = Arc::new(TriggerTypes::of_manifest(&raw));
        cache.insert(pack_id.to_owned(), (digest, c.clone()));
        Ok(c)
    }

    /// Drops the compiled trigger types of a pack that is no longer registered, so its memory is
    /// returned once no policy view holds it.
    pub fn forget_trigger_types(&self, pack_id: &str) {
        self.trigger_types
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(pack_id);
    }

    /// Packs whose trigger types are compiled in this process.
    pub fn trigger_types_held(&self) -> usize {
        self.trigger_types
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// One pack's policy with every principal's grant, Binding and activation;
    /// `None` when the pack is not registered.
    pub async fn load_pack_policy(&self, pack_id: &str) -> Result<Option<PackPolicy>> {
        let db = &self.db;
        let Some(pack) = packs::Entity::find_by_id(pack_id.to_owned())
            .one(db)
            .await
            .map_err(classify)?
        else {
            // Deleted (on another replica, when this one hears of it): its trigger types go too.
            self.forget_trigger_types(pack_id);
            return Ok(None);
        };
        let refs: Vec<String> = pack_triggers::Entity::find()
            .filter(pack_triggers::Column::PackId.eq(pack_id))
            .select_only()
            .column(pack_triggers::Column::Ref)
            .into_tuple()
            .all(db)
            .await
            .map_err(classify)?;
        let stimuli = pack_stimuli::Entity::find()
            .filter(pack_stimuli::Column::PackId.eq(pack_id))
            .all(db)
            .await
            .map_err(classify)?;
        let mut policy = PackPolicy::declared(
            BindingMode::parse(&pack.binding_mode).ok_or_else(|| corrupt("binding mode"))?,
            &refs.iter().map(String::as_str).collect::<Vec<_>>(),
            stimuli.into_iter().map(|s| (s.r#ref, s.land)),
        );
        policy.trigger_types = self.trigger_types(pack_id, &pack.manifest)?;
        // Rows come in chunks, so loading a pack with many principals never holds
        // more than a chunk of rows besides the policy itself.
        macro_rules! each_row {
            ($m:ident, |$row:ident| $body:block) => {{
                let mut after: Option<String> = None;
                loop {
                    let mut q = $m::Entity::find()
                        .filter($m::Column::PackId.eq(pack_id))
                        .order_by_asc($m::Column::Principal)
                        .limit(LOAD_CHUNK);
                    if let Some(a) = &after {
                        q = q.filter($m::Column::Principal.gt(a.as_str()));
                    }
                    let rows = q.all(db).await.map_err(classify)?;
                    let n = rows.len() as u64;
                    for $row in rows {
                        after = Some($row.principal.clone());
                        $body
                    }
                    if n < LOAD_CHUNK {
                        break;
                    }
                }
            }};
        }
        each_row!(sense_grants, |g| {
            policy.principals.entry(g.principal).or_default().granted = true;
        });
        each_row!(bindings, |b| {
            let b = binding(b)?;
            policy.principals.entry(b.principal).or_default().binding = Some(BindingRef {
                binding_id: b.binding_id,
                state: b.state,
            });
        });
        let mut filters = Filters::default();
        each_row!(sense_activations, |a| {
            let a = activation(a)?;
            let act = a.activation(&mut filters);
            if a.principal.is_empty() {
                policy.activation = Some(act);
            } else {
                policy.principals.entry(a.principal).or_default().activation = Some(act);
            }
        });
        each_row!(sense_quotas, |q| {
            let q = super::quota::quota(q)?;
            if let Some(p) = &q.principal {
                policy.principals.entry(p.clone()).or_default().quota = Some(q.rule);
            } else {
                policy.quota = Some(q.rule);
            }
        });
        Ok(Some(policy))
    }

    /// Grants `sense.enable`; granting again keeps the first grant's time.
    pub async fn put_grant(
        &self,
        actor: &Actor,
        principal: &str,
        pack_id: &str,
        now: i64,
    ) -> Result<Grant> {
        let change = Change {
            actor,
            pack_id: Some(pack_id),
            principal: Some(principal),
            announce: true,
        };
        let key = (principal.to_owned(), pack_id.to_owned());
        let w = self.begin_write().await?;
        let ((), g) = self
            .audited::<sense_grants::Entity, _>(w, change, key, async |txn, _| {
                use sense_grants::Column as C;
                let row = sense_grants::ActiveModel {
                    principal: Set(principal.to_owned()),
                    pack_id: Set(pack_id.to_owned()),
                    create_time: Set(now),
                };
                upsert::<sense_grants::Entity>(txn, row, [C::Principal, C::PackId], &[]).await
            })
            .await?;
        let g = g.ok_or_else(|| corrupt("grant"))?;
        Ok(Grant {
            principal: g.principal,
            pack_id: g.pack_id,
            create_time: g.create_time,
        })
    }

    pub async fn delete_grant(
        &self,
        actor: &Actor,
        principal: &str,
        pack_id: &str,
    ) -> Result<bool> {
        let change = Change {
            actor,
            pack_id: Some(pack_id),
            principal: Some(principal),
            announce: true,
        };
        let key = (principal.to_owned(), pack_id.to_owned());
        let w = self.begin_write().await?;
        self.audited_delete::<sense_grants::Entity>(w, change, key)
            .await
    }

    /// Grants in (pack_id, principal) order.
    pub async fn list_grants(&self, p: &KeyPage<'_>) -> Result<Vec<Grant>> {
        use sense_grants::Column as C;
        self.key_page::<sense_grants::Entity, _>((C::PackId, C::Principal), p, |g| {
            Ok(Grant {
                principal: g.principal,
                pack_id: g.pack_id,
                create_time: g.create_time,
            })
        })
        .await
    }

    /// Bindings in (pack_id, principal) order.
    pub async fn list_bindings(&self, p: &KeyPage<'_>) -> Result<Vec<Binding>> {
        use bindings::Column as C;
        self.key_page::<bindings::Entity, _>((C::PackId, C::Principal), p, binding)
            .await
    }

    /// Sense activations in (pack_id, principal) order; a pack-wide one has principal "".
    pub async fn list_activations(&self, p: &KeyPage<'_>) -> Result<Vec<ActivationRow>> {
        use sense_activations::Column as C;
        self.key_page::<sense_activations::Entity, _>((C::PackId, C::Principal), p, activation)
            .await
    }

    /// Project members in (project, principal) order.
    pub async fn list_members(&self, p: &KeyPage<'_>) -> Result<Vec<Member>> {
        use project_members::Column as C;
        self.key_page::<project_members::Entity, _>((C::Project, C::Principal), p, |m| {
            Ok(Member {
                project: m.project,
                principal: m.principal,
                create_time: m.create_time,
            })
        })
        .await
    }

    /// Sets an activation (an empty principal is pack-wide).
    pub async fn put_activation(&self, actor: &Actor, a: &ActivationRow) -> Result<()> {
        let change = Change {
            actor,
            pack_id: Some(&a.pack_id),
            principal: Some(&a.principal),
            announce: true,
        };
        let key = (a.principal.clone(), a.pack_id.clone());
        let w = self.begin_write().await?;
        self.audited::<sense_activations::Entity, _>(w, change, key, async |txn, _| {
            use sense_activations::Column as C;
            let row = sense_activations::ActiveModel {
                principal: Set(a.principal.clone()),
                pack_id: Set(a.pack_id.clone()),
                enabled: Set(a.enabled),
                route: Set(a.route.as_str().to_owned()),
                update_time: Set(a.update_time),
                filter: Set(a.filter.clone()),
            };
            let update = [C::Enabled, C::Route, C::UpdateTime, C::Filter];
            upsert::<sense_activations::Entity>(txn, row, [C::Principal, C::PackId], &update).await
        })
        .await?;
        Ok(())
    }

    pub async fn get_activation(
        &self,
        principal: &str,
        pack_id: &str,
    ) -> Result<Option<ActivationRow>> {
        sense_activations::Entity::find_by_id((principal.to_owned(), pack_id.to_owned()))
            .one(&self.db)
            .await
            .map_err(classify)?
            .map(activation)
            .transpose()
    }

    /// Mirrors Execute state; not policy, so nothing is announced.
    pub async fn put_execute_state(&self, actor: &Actor, e: &ExecuteState) -> Result<()> {
        let change = Change {
            actor,
            pack_id: Some(&e.pack_id),
            principal: Some(&e.principal),
            announce: false,
        };
        let key = (e.principal.clone(), e.pack_id.clone());
        let w = self.begin_write().await?;
        self.audited::<execute_states::Entity, _>(w, change, key, async |txn, _| {
            use execute_states::Column as C;
            let row = execute_states::ActiveModel {
                principal: Set(e.principal.clone()),
                pack_id: Set(e.pack_id.clone()),
                installed: Set(e.installed),
                activated: Set(e.activated),
                connected: Set(e.connected),
                update_time: Set(e.update_time),
            };
            let update = [C::Installed, C::Activated, C::Connected, C::UpdateTime];
            upsert::<execute_states::Entity>(txn, row, [C::Principal, C::PackId], &update).await
        })
        .await?;
        Ok(())
    }

    /// Read only by GetPackState: Sense never writes Execute state (§7.2.4).
    pub async fn get_execute_state(
        &self,
        principal: &str,
        pack_id: &str,
    ) -> Result<Option<ExecuteState>> {
        Ok(
            execute_states::Entity::find_by_id((principal.to_owned(), pack_id.to_owned()))
                .one(&self.db)
                .await
                .map_err(classify)?
                .map(execute_state),
        )
    }

    pub async fn get_binding(&self, principal: &str, pack_id: &str) -> Result<Option<Binding>> {
        bindings::Entity::find_by_id((principal.to_owned(), pack_id.to_owned()))
            .one(&self.db)
            .await
            .map_err(classify)?
            .map(binding)
            .transpose()
    }

    pub async fn add_member(
        &self,
        actor: &Actor,
        project: &str,
        principal: &str,
        now: i64,
    ) -> Result<()> {
        let change = Change {
            actor,
            pack_id: None,
            principal: Some(principal),
            announce: false,
        };
        let key = (project.to_owned(), principal.to_owned());
        let w = self.begin_write().await?;
        self.audited::<project_members::Entity, _>(w, change, key, async |txn, _| {
            use project_members::Column as C;
            let row = project_members::ActiveModel {
                project: Set(project.to_owned()),
                principal: Set(principal.to_owned()),
                create_time: Set(now),
            };
            upsert::<project_members::Entity>(txn, row, [C::Project, C::Principal], &[]).await
        })
        .await?;
        Ok(())
    }

    pub async fn remove_member(
        &self,
        actor: &Actor,
        project: &str,
        principal: &str,
    ) -> Result<bool> {
        let change = Change {
            actor,
            pack_id: None,
            principal: Some(principal),
            announce: false,
        };
        let key = (project.to_owned(), principal.to_owned());
        let w = self.begin_write().await?;
        self.audited_delete::<project_members::Entity>(w, change, key)
            .await
    }
}

impl DeliveryTables {
    /// Stores the record a Binding change produced, in the change's transaction.
    async fn write_produced(
        &self,
        txn: &DatabaseTransaction,
        record: Option<&mut Record>,
        note: Option<Note>,
    ) -> Result<()> {
        if let Some(r) = record {
            super::sink::write_records(txn, self, None, std::slice::from_mut(r), &[note]).await?;
        }
        Ok(())
    }

    /// Once a Binding change with a produced record has committed, wakes the watch tail as a
    /// sink commit does.
    fn committed_produced(&self, record: Option<&Record>) {
        if record.is_some() {
            self.commits().local.notify_one();
        }
    }

    /// Creates or replaces a Binding. The Binding as it was is read inside the write's
    /// transaction (locked, and on PostgreSQL under an advisory lock of its key too, so two
    /// replicas changing one Binding take turns), and `produce` turns it into whatever the
    /// change produces: the record of its `binding.degraded` trigger, if any, is stored in the
    /// same transaction, with its decision log entry when `produce` gives a note.
    pub async fn put_binding<T>(
        &self,
        actor: &Actor,
        b: &Binding,
        produce: impl FnOnce(Option<&Binding>) -> (T, Option<Record>, Option<Note>),
    ) -> Result<(T, Option<Record>)> {
        let change = Change {
            actor,
            pack_id: Some(&b.pack_id),
            principal: Some(&b.principal),
            announce: true,
        };
        let key = (b.principal.clone(), b.pack_id.clone());
        let w = self.begin_binding_write(&b.principal, &b.pack_id).await?;
        let (out, _) = self
            .audited::<bindings::Entity, _>(w, change, key, async |txn, before| {
                let before = before.cloned().map(binding).transpose()?;
                let (produced, mut record, note) = produce(before.as_ref());
                use bindings::Column as C;
                let row = bindings::ActiveModel {
                    principal: Set(b.principal.clone()),
                    pack_id: Set(b.pack_id.clone()),
                    binding_id: Set(b.binding_id.clone()),
                    mode: Set(b.mode.as_str().to_owned()),
                    state: Set(b.state.as_str().to_owned()),
                    update_time: Set(b.update_time),
                };
                let update = [C::BindingId, C::Mode, C::State, C::UpdateTime];
                upsert::<bindings::Entity>(txn, row, [C::Principal, C::PackId], &update).await?;
                self.write_produced(txn, record.as_mut(), note).await?;
                Ok((produced, record))
            })
            .await?;
        self.committed_produced(out.1.as_ref());
        Ok(out)
    }

    /// Deletes a Binding, reading it inside the transaction as `put_binding` does; `produce`
    /// gets the Binding deleted (`None`: there was none, and nothing is written).
    pub async fn delete_binding<T>(
        &self,
        actor: &Actor,
        principal: &str,
        pack_id: &str,
        produce: impl FnOnce(Option<&Binding>) -> (T, Option<Record>, Option<Note>),
    ) -> Result<(T, Option<Record>)> {
        let change = Change {
            actor,
            pack_id: Some(pack_id),
            principal: Some(principal),
            announce: true,
        };
        let key = (principal.to_owned(), pack_id.to_owned());
        let w = self.begin_binding_write(principal, pack_id).await?;
        let (out, _) = self
            .audited::<bindings::Entity, _>(w, change, key.clone(), async |txn, before| {
                let before = before.cloned().map(binding).transpose()?;
                let (produced, mut record, note) = produce(before.as_ref());
                if before.is_none() {
                    return Ok((produced, None));
                }
                bindings::Entity::delete_by_id(key)
                    .exec(txn)
                    .await
                    .map_err(classify)?;
                self.write_produced(txn, record.as_mut(), note).await?;
                Ok((produced, record))
            })
            .await?;
        self.committed_produced(out.1.as_ref());
        Ok(out)
    }
}

impl Store {
    /// A page of a table keyed by the two columns `key`, mapped to the domain by `map`.
    pub(super) async fn key_page<E: EntityTrait, T>(
        &self,
        key: (E::Column, E::Column),
        p: &KeyPage<'_>,
        map: impl Fn(E::Model) -> Result<T>,
    ) -> Result<Vec<T>> {
        keyset(E::find(), (key.0, p.first), (key.1, p.second), p.after)
            .limit(p.limit)
            .all(&self.db)
            .await
            .map_err(classify)?
            .into_iter()
            .map(map)
            .collect()
    }
}
