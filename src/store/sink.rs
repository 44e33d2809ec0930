//! Durable group commit of records: concurrent deliveries are written together, one multi-row INSERT per batch in one transaction, and each caller is answered only after its batch commits.
use std::sync::Arc;

use sea_orm::sea_query::OnConflict;
use sea_orm::{ColumnTrait, Condition, EntityTrait, QueryFilter, QuerySelect};
use tokio::sync::{mpsc, oneshot, Mutex};

use super::entity::records;
use super::{classify, Engine, Store};
use crate::domain::model::Record;
use crate::domain::policy::Route;
use crate::error::{Error, Result};

/// What became of one record in a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stored {
    Inserted,
    /// Its trigger id was already recorded for the pack: the first record.
    Duplicate { record_id: String, route: Route },
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

/// Most records in one batch.
pub const MAX_BATCH: usize = 512;
/// Records waiting for a writer before callers wait to enqueue.
const QUEUE: usize = 16 * MAX_BATCH;

impl Sink {
    /// Starts the writers: one on SQLite (it has one writer), `pg_writers` on PostgreSQL.
    pub fn start(store: Store, pg_writers: usize) -> Sink {
        let (tx, rx) = mpsc::channel::<Job>(QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        let writers = match store.engine() {
            Engine::Sqlite => 1,
            Engine::Postgres => pg_writers.max(1),
        };
        for _ in 0..writers {
            let (store, rx) = (store.clone(), rx.clone());
            tokio::spawn(async move { write_batches(store, rx).await });
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
        answer
            .await
            .map_err(|_| Error::Unavailable("the sink stopped before the record was written".into()))?
    }
}

/// Takes whatever is queued (at least one record, at most MAX_BATCH) and writes it.
/// No wait is added: an idle sink writes a batch of one at once, and under load the
/// queue that builds up while a batch commits becomes the next batch.
async fn write_batches(store: Store, rx: Arc<Mutex<mpsc::Receiver<Job>>>) {
    loop {
        let mut batch = Vec::new();
        {
            let mut rx = rx.lock().await;
            match rx.recv().await {
                Some(job) => batch.push(job),
                None => return,
            }
            while batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(job) => batch.push(job),
                    Err(_) => break,
                }
            }
        }
        let (records, answers): (Vec<Record>, Vec<_>) =
            batch.into_iter().map(|j| (j.record, j.done)).unzip();
        match store.insert_batch(&records).await {
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
}

impl Store {
    /// Inserts a batch in one transaction. Records whose (pack, trigger id) is
    /// already stored, or repeated earlier in the batch, are not inserted and
    /// come back as the first record.
    pub async fn insert_batch(&self, rs: &[Record]) -> Result<Vec<Stored>> {
        use records::Column as C;
        let w = self.begin_write().await?;
        records::Entity::insert_many(rs.iter().map(super::records::active))
            .on_conflict(
                OnConflict::columns([C::PackId, C::ProducerTriggerId])
                    .do_nothing()
                    .to_owned(),
            )
            .exec_without_returning(&w.txn)
            .await
            .map_err(classify)?;
        let keyed: Vec<(&str, &str)> = rs
            .iter()
            .filter_map(|r| r.trigger_id.as_deref().map(|t| (r.pack_id.as_str(), t)))
            .collect();
        let mut firsts: Vec<(String, String, String, String)> = Vec::new();
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
                .columns([C::PackId, C::ProducerTriggerId, C::RecordId, C::Route])
                .filter(any)
                .into_tuple()
                .all(&w.txn)
                .await
                .map_err(classify)?;
        }
        w.commit().await?;
        rs.iter()
            .map(|r| {
                let Some(t) = r.trigger_id.as_deref() else {
                    return Ok(Stored::Inserted);
                };
                match firsts.iter().find(|(p, tid, _, _)| p == &r.pack_id && tid == t) {
                    Some((_, _, id, _)) if *id == r.record_id => Ok(Stored::Inserted),
                    Some((_, _, id, route)) => Ok(Stored::Duplicate {
                        record_id: id.clone(),
                        route: Route::parse(route)
                            .ok_or_else(|| Error::Internal("bad stored route".into()))?,
                    }),
                    None => Err(Error::Internal("a batched record is missing".into())),
                }
            })
            .collect()
    }
}
