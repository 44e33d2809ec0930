//! Durable group commit of records: concurrent deliveries are written together, one multi-row INSERT per batch in one transaction, and each caller is answered only after its batch commits.
use std::sync::Arc;

use sea_orm::{
    ColumnTrait, Condition, ConnectionTrait, EntityTrait, QueryFilter, QuerySelect, Statement,
};
use tokio::sync::{mpsc, oneshot, Mutex};

use super::entity::records;
use super::{classify, Engine, Store};
use crate::domain::model::Record;
use crate::domain::policy::Route;
use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// What became of one record in a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stored {
    /// Written under this id.
    Inserted { record_id: String },
    /// Its trigger id was already recorded for the pack, for the same principal, ref and land: the first record.
    Duplicate { record_id: String, route: Route },
    /// Its trigger id was already used for the pack by a different trigger.
    Conflict,
}

struct Job {
    record: Record,
    done: oneshot::Sender<Result<Stored>>,
}

/// The writer side of the sink. Cheap to clone; writers stop when every clone is gone.
#[derive(Clone, Debug)]
pub struct Sink {
    tx: mpsc::Sender<Job>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Job")
    }
}

const INSERT_SQLITE: &str = "INSERT INTO records (record_id, principal, binding_id, land, pack_id, ref, payload, route, project, producer_trigger_id, received_time) \
     SELECT json_extract(value, '$.record_id'), json_extract(value, '$.principal'), json_extract(value, '$.binding_id'), \
            json_extract(value, '$.land'), json_extract(value, '$.pack_id'), json_extract(value, '$.ref'), \
            json_extract(value, '$.payload'), json_extract(value, '$.route'), json_extract(value, '$.project'), \
            json_extract(value, '$.producer_trigger_id'), json_extract(value, '$.received_time') \
     FROM json_each(?) WHERE true \
     ON CONFLICT (pack_id, producer_trigger_id) DO NOTHING";

const INSERT_POSTGRES: &str = "INSERT INTO records (record_id, principal, binding_id, land, pack_id, ref, payload, route, project, producer_trigger_id, received_time) \
     SELECT record_id, principal, binding_id, land, pack_id, ref, payload, route, project, producer_trigger_id, received_time \
     FROM jsonb_to_recordset($1::jsonb) AS x(record_id text, principal text, binding_id text, land text, pack_id text, ref text, \
          payload text, route text, project text, producer_trigger_id text, received_time bigint) \
     ON CONFLICT (pack_id, producer_trigger_id) DO NOTHING";

/// Most records in one batch.
pub const MAX_BATCH: usize = 512;
/// Records waiting for a writer before callers wait to enqueue.
const QUEUE: usize = 16 * MAX_BATCH;

impl Sink {
    /// Starts the writer. There is one: records are stamped with their receive
    /// time and id inside the write, so commit order is key order and a
    /// ListRecords cursor never passes a record that commits later. It runs on
    /// a thread and runtime of its own, with a connection of its own, so a
    /// busy gRPC runtime never delays a commit that a whole batch waits for.
    pub fn start(store: Store, metrics: Arc<Metrics>, batch_timeout: std::time::Duration) -> Sink {
        let (tx, rx) = mpsc::channel::<Job>(QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        let spawned = std::thread::Builder::new()
            .name("hcp-sense-sink".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        tracing::error!(error = %e, "sink runtime did not start");
                        return;
                    }
                };
                rt.block_on(write_batches(&store, rx, metrics, batch_timeout));
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "sink thread did not start");
        }
        Sink { tx }
    }

    /// Writes one record durably; returns once its batch has committed.
    pub async fn write(&self, record: Record) -> Result<Stored> {
        let (done, answer) = oneshot::channel();
        self.tx
            .send(Job { record, done })
            .await
            .map_err(|_| Error::Unavailable("the sink is shutting down".into()))?;
        answer.await.map_err(|_| {
            Error::Unavailable("the sink stopped before the record was written".into())
        })?
    }
}

/// Takes whatever is queued (at least one record, at most MAX_BATCH) and writes it.
/// No wait is added: an idle sink writes a batch of one at once, and under load the
/// queue that builds up while a batch commits becomes the next batch.
///
/// A batch not committed within `batch_timeout` is answered UNAVAILABLE. After a batch the
/// store could not take, the writer's connection is abandoned and the next batch opens a new
/// one: a connection to a database that went silent (a partition, a failover) would otherwise
/// hold every later record until the kernel gives up on it.
async fn write_batches(
    parent: &Store,
    rx: Arc<Mutex<mpsc::Receiver<Job>>>,
    metrics: Arc<Metrics>,
    batch_timeout: std::time::Duration,
) {
    // Connected ahead of the first record when the store answers; otherwise on first use.
    let mut writer: Option<Store> = parent.dedicated().await.ok();
    loop {
        let mut batch = Vec::new();
        {
            let mut rx = rx.lock().await;
            match rx.recv().await {
                Some(job) => batch.push(job),
                None => break,
            }
            while batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(job) => batch.push(job),
                    Err(_) => break,
                }
            }
        }
        let (mut records, answers): (Vec<Record>, Vec<_>) =
            batch.into_iter().map(|j| (j.record, j.done)).unzip();
        let started = std::time::Instant::now();
        let result = tokio::time::timeout(batch_timeout, async {
            if writer.is_none() {
                writer = Some(parent.dedicated().await?);
            }
            match &writer {
                Some(w) => w.insert_batch(&mut records).await,
                None => Err(Error::Unavailable("the store is unavailable; retry".into())),
            }
        })
        .await
        .unwrap_or_else(|_| {
            Err(Error::Unavailable(
                "the store did not answer in time; retry".into(),
            ))
        });
        if matches!(result, Err(Error::Unavailable(_))) {
            if let Some(stuck) = writer.take() {
                // Closing may wait on a silent connection too; it must not hold the writer.
                tokio::spawn(stuck.close());
            }
        }
        let took = started.elapsed();
        metrics.batch(records.len(), took, result.is_ok());
        tracing::debug!(
            records = records.len(),
            micros = took.as_micros() as u64,
            ok = result.is_ok(),
            "batch written"
        );
        match result {
            Ok(stored) => {
                for (answer, s) in answers.into_iter().zip(stored) {
                    let _ = answer.send(Ok(s));
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, records = records.len(), "batch not committed; every caller in it is told");
                for answer in answers {
                    let _ = answer.send(Err(match &e {
                        Error::Unavailable(m) => Error::Unavailable(m.clone()),
                        _ => Error::Unavailable("the record could not be written; retry".into()),
                    }));
                }
            }
        }
    }
    if let Some(w) = writer {
        w.close().await;
    }
}

impl Store {
    /// Inserts a batch in one transaction, stamping each record's receive time
    /// and id inside it. Records whose (pack, trigger id) is already stored, or
    /// repeated earlier in the batch, are not inserted and come back as the
    /// first record (or as a conflict when that was a different trigger).
    pub async fn insert_batch(&self, rs: &mut [Record]) -> Result<Vec<Stored>> {
        use records::Column as C;
        let w = self.begin_sink_write().await?;
        for r in rs.iter_mut() {
            super::stamp(r);
        }
        // The whole batch travels as one JSON parameter of one fixed statement:
        // prepared once per connection, parsed by the database, one round trip.
        let rows: Vec<serde_json::Value> = rs
            .iter()
            .map(|r| {
                serde_json::json!({
                    "record_id": r.record_id,
                    "principal": r.principal,
                    "binding_id": r.binding_id,
                    "land": r.land,
                    "pack_id": r.pack_id,
                    "ref": r.r#ref,
                    "payload": serde_json::Value::Object(r.payload.clone()).to_string(),
                    "route": r.route.as_str(),
                    "project": r.project,
                    "producer_trigger_id": r.trigger_id,
                    "received_time": r.received_time,
                })
            })
            .collect();
        let batch = serde_json::Value::Array(rows).to_string();
        let backend = w.txn.get_database_backend();
        let sql = match self.engine() {
            Engine::Sqlite => INSERT_SQLITE,
            Engine::Postgres => INSERT_POSTGRES,
        };
        w.txn
            .execute_raw(Statement::from_sql_and_values(backend, sql, [batch.into()]))
            .await
            .map_err(classify)?;
        let keyed: Vec<(&str, &str)> = rs
            .iter()
            .filter_map(|r| r.trigger_id.as_deref().map(|t| (r.pack_id.as_str(), t)))
            .collect();
        type First = (String, String, String, String, String, String, String);
        let mut firsts: Vec<First> = Vec::new();
        if !keyed.is_empty() {
            let mut any = Condition::any();
            for (pack, trigger) in &keyed {
                any = any.add(
                    Condition::all()
                        .add(C::PackId.eq(*pack))
                        .add(C::ProducerTriggerId.eq(*trigger)),
                );
            }
            firsts = records::Entity::find()
                .select_only()
                .columns([
                    C::PackId,
                    C::ProducerTriggerId,
                    C::RecordId,
                    C::Route,
                    C::Principal,
                    C::Ref,
                    C::Land,
                ])
                .filter(any)
                .into_tuple()
                .all(&w.txn)
                .await
                .map_err(classify)?;
        }
        w.commit().await?;
        rs.iter()
            .map(|r| {
                let inserted = Stored::Inserted {
                    record_id: r.record_id.clone(),
                };
                let Some(t) = r.trigger_id.as_deref() else {
                    return Ok(inserted);
                };
                match firsts.iter().find(|f| f.0 == r.pack_id && f.1 == t) {
                    Some(f) if f.2 == r.record_id => Ok(inserted),
                    Some(f) if f.4 != r.principal || f.5 != r.r#ref || f.6 != r.land => {
                        Ok(Stored::Conflict)
                    }
                    Some(f) => Ok(Stored::Duplicate {
                        record_id: f.2.clone(),
                        route: Route::parse(&f.3)
                            .ok_or_else(|| Error::Internal("bad stored route".into()))?,
                    }),
                    None => Err(Error::Internal("a batched record is missing".into())),
                }
            })
            .collect()
    }
}
