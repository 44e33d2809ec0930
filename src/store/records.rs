//! The sink and the drop log: records written and read with keyset pagination, drop counts upserted.
use sea_orm::sea_query::{Expr, ExprTrait, Query};
use sea_orm::{
    ColumnTrait, Condition, ConnectionTrait, DbBackend, EntityTrait, QueryFilter, QueryOrder,
    QuerySelect, Statement,
};
use std::sync::Arc;

use super::audit::{self, Actor};
use super::entity::{drop_reports, project_members, records};
use super::{classify, DeliveryTables, Engine, RecordTables, Store};
use crate::domain::model::{DropReport, Erasure, Position, Record, RecordFilter};
use crate::domain::policy::Route;
use crate::domain::trigger::{DropReason, BRAIN};
use crate::error::{Error, Result};

fn record(m: records::Model) -> Result<Record> {
    let payload = match serde_json::from_str(&m.payload) {
        Ok(serde_json::Value::Object(p)) => p,
        _ => return Err(Error::internal("bad stored payload")),
    };
    Ok(Record {
        route: Route::parse(&m.route).ok_or_else(|| Error::internal("bad stored route"))?,
        record_id: m.record_id,
        principal: m.principal,
        binding_id: m.binding_id,
        land: m.land,
        pack_id: m.pack_id,
        r#ref: m.r#ref,
        payload,
        project: m.project,
        trigger_id: m.producer_trigger_id,
        received_time: m.received_time,
        position: Position {
            txid: m.commit_txid,
            seq: m.seq,
        },
    })
}

/// The highest position below a PostgreSQL horizon: every transaction with a lower id has
/// ended, so every record at or below it is final.
fn below(horizon: i64) -> Position {
    Position {
        txid: horizon - 1,
        seq: i64::MAX,
    }
}

/// A position in a record listing: that of the last record returned.
pub type RecordCursor = Position;

/// A page of records, and whether it is settled: false when writes in flight as the listing
/// began had not ended, so records may still commit at positions after the page's.
#[derive(Debug)]
pub struct Listed {
    pub records: Vec<Record>,
    pub settled: bool,
    /// Ascending: every matching record at or below this position is in the page or before
    /// the cursor (the last record's position when the page is full).
    pub watermark: Position,
}

/// The horizon of this database's writes: the lowest id of a transaction in flight in this
/// database (`lo`, else the next id to be given), and the next id (`hi`). Transactions of other
/// databases on the cluster cannot write records, so a long one there — another application's,
/// a migration elsewhere — never holds listings back. Sessions of other users are not visible
/// (their xids read as NULL); if this database has any, the cluster-wide lower bound is used,
/// which is never too high.
///
/// Autovacuum workers are left out: their ANALYZE takes a transaction id for the statistics
/// it writes, and may run tens of milliseconds on a busy `records` table, but it never writes
/// a record, so no listing or watch should wait for it.
const HORIZON: &str = "WITH a AS (SELECT backend_xid, query FROM pg_stat_activity \
                WHERE datname = current_database() AND backend_type IS DISTINCT FROM 'autovacuum worker') \
     SELECT CASE WHEN EXISTS (SELECT 1 FROM a WHERE query = '<insufficient privilege>') \
                 THEN pg_snapshot_xmin(s)::text::bigint \
                 ELSE COALESCE((SELECT min(x::text::bigint) FROM pg_snapshot_xip(s) AS x \
                                WHERE (x::text::bigint & 4294967295) IN \
                                      (SELECT backend_xid::text::bigint FROM a WHERE backend_xid IS NOT NULL)), \
                               pg_snapshot_xmax(s)::text::bigint) \
            END AS lo, \
            pg_snapshot_xmax(s)::text::bigint AS hi \
     FROM pg_current_snapshot() AS s";

/// The watch tail's read: the records after a position and below this database's horizon,
/// with the horizon, in one statement. Statement and snapshot are one, so the horizon is taken
/// from the very snapshot the records are read in: every transaction below it that the
/// snapshot does not show as in flight has ended, and its records are in the result. A
/// transaction in flight counts unless pg_stat_activity places it in another database or in
/// an autovacuum worker (see `HORIZON`); one hidden from this user, or ended since the
/// snapshot, counts: never too high, at worst one read late. With no record, one row carries
/// the horizon alone.
const TAIL_POSTGRES: &str = "WITH s AS (SELECT pg_current_snapshot() AS s), \
     elsewhere AS (SELECT backend_xid::text::bigint AS x FROM pg_stat_activity \
                   WHERE backend_xid IS NOT NULL AND (datname IS DISTINCT FROM current_database() \
                                                     OR backend_type = 'autovacuum worker')), \
     h AS (SELECT COALESCE((SELECT min(x::text::bigint) FROM pg_snapshot_xip(s.s) AS x \
                            WHERE (x::text::bigint & 4294967295) NOT IN (SELECT x FROM elsewhere)), \
                           pg_snapshot_xmax(s.s)::text::bigint) AS lo FROM s) \
     SELECT h.lo, r.* FROM h LEFT JOIN LATERAL \
       (SELECT * FROM records WHERE (commit_txid, seq) > ($1, $2) AND commit_txid < h.lo \
        ORDER BY commit_txid, seq LIMIT $3) AS r ON true";

/// How long a PostgreSQL listing waits for writes in flight when it starts to commit or end,
/// so that a record acknowledged before the call is listed (see `horizon`).
const SETTLE: std::time::Duration = std::time::Duration::from_millis(250);

/// PostgreSQL: deletes the records `chosen` selects (their `record_id, stored_time`) and,
/// in the same statement, their trigger ids' ledger rows, so a trigger id is kept exactly as
/// long as its record. Returns the records deleted.
async fn delete_with_ledger(
    db: &impl ConnectionTrait,
    chosen: &str,
    values: Vec<sea_orm::Value>,
) -> Result<u64> {
    let sql = format!(
        "WITH gone AS ( \
           DELETE FROM records r USING ({chosen}) AS o \
           WHERE r.record_id = o.record_id AND r.stored_time = o.stored_time \
           RETURNING r.pack_id, r.producer_trigger_id, r.record_id), \
         unclaimed AS ( \
           DELETE FROM record_triggers k USING gone g \
           WHERE k.pack_id = g.pack_id AND k.producer_trigger_id = g.producer_trigger_id \
             AND k.record_id = g.record_id) \
         SELECT count(*) AS n FROM gone"
    );
    let n = db
        .query_one_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            sql,
            values,
        ))
        .await
        .map_err(classify)?
        .map(|r| r.try_get::<i64>("", "n"))
        .transpose()
        .map_err(classify)?
        .unwrap_or(0);
    Ok(u64::try_from(n).unwrap_or(0))
}

impl RecordTables {
    /// Deletes, of the first `limit` records of `lands` in position order, those received before
    /// `cutoff`; returns how many. The scan is a range of the position index, never the
    /// table: records come in position order about as they were received, and one whose
    /// clock ran ahead only stays until its own time comes (the rest of the range goes).
    pub async fn prune_records(&self, cutoff: i64, lands: Lands<'_>, limit: u64) -> Result<u64> {
        use records::Column as C;
        if self.partitioned() {
            // By the database's clock, in the partitions retention has not dropped whole.
            let (land, values): (&str, Vec<sea_orm::Value>) = match lands {
                Lands::Only(land) => ("AND land = $3", vec![land.into()]),
                Lands::Except(listed) if !listed.is_empty() => (
                    "AND land NOT IN (SELECT jsonb_array_elements_text($3::jsonb))",
                    vec![serde_json::to_string(listed).unwrap_or_default().into()],
                ),
                Lands::Except(_) => ("", vec![]),
            };
            // In no order: any rows below the cutoff, found by the stored-time BRIN index in
            // the partition straddling it (ordered by position, a pass that finds none would
            // read that whole partition's position index to learn so).
            let oldest = format!(
                "SELECT record_id, stored_time FROM records WHERE stored_time < $1 {land} LIMIT $2"
            );
            let mut all = vec![
                cutoff.into(),
                i64::try_from(limit).unwrap_or(i64::MAX).into(),
            ];
            all.extend(values);
            return delete_with_ledger(&self.db, &oldest, all).await;
        }
        let mut oldest = Query::select();
        oldest
            .column(C::RecordId)
            .from(records::Entity)
            .order_by(C::CommitTxid, sea_orm::Order::Asc)
            .order_by(C::Seq, sea_orm::Order::Asc)
            .limit(limit);
        match lands {
            Lands::Only(land) => {
                oldest.and_where(Expr::col(C::Land).eq(land));
            }
            Lands::Except(listed) if !listed.is_empty() => {
                oldest.and_where(Expr::col(C::Land).is_not_in(listed.iter().map(String::as_str)));
            }
            Lands::Except(_) => {}
        }
        let w = self.begin_write().await?;
        let r = records::Entity::delete_many()
            .filter(C::RecordId.in_subquery(oldest.to_owned()))
            .filter(C::ReceivedTime.lt(cutoff))
            .exec(&w.txn)
            .await
            .map_err(classify)?;
        w.commit().await?;
        Ok(r.rows_affected)
    }

    /// Erases a principal's records (of one pack, when given) in transactions of at most
    /// `batch` rows, pausing `pause` between full ones so deliveries take their turns, until
    /// one finds none; that last one writes the audit row with the count (never the records) and, on PostgreSQL,
    /// tells the other replicas' watches. Returns the erasure: every record of the principal
    /// at or below its position is gone. Called again after a failure, it erases the rest.
    pub async fn erase_records(
        &self,
        actor: &Actor,
        principal: &str,
        pack_id: Option<&str>,
        batch: u64,
        pause: std::time::Duration,
    ) -> Result<(u64, Erasure)> {
        let mut total = 0u64;
        loop {
            // Every record at or below this position has committed before the delete below
            // reads: if the delete then leaves none of the principal's, none up to here remain.
            let upto = match self.engine() {
                Engine::Postgres => self.watermark().await?,
                Engine::Sqlite => Position::default(),
            };
            let w = self.begin_write().await?;
            let n = self.erase_batch(&w, principal, pack_id, batch).await?;
            total += n;
            // Done only when a batch finds none: on PostgreSQL a batch short of `batch` may
            // have skipped rows another deleter (retention, an erasure retried) held meanwhile.
            if n == 0 {
                let erasure = self
                    .close_erasure(w, actor, principal, pack_id, upto, total)
                    .await?;
                self.answers.forget_erased(&erasure);
                return Ok((total, erasure));
            }
            w.commit().await?;
            if n == batch {
                tokio::time::sleep(pause).await;
            }
        }
    }

    /// Deletes at most `batch` of a principal's records (of one pack, when given), with
    /// their ledger rows on a partitioned table; answers how many.
    async fn erase_batch(
        &self,
        w: &super::WriteTxn,
        principal: &str,
        pack_id: Option<&str>,
        batch: u64,
    ) -> Result<u64> {
        use records::Column as C;
        if self.partitioned() {
            let (pack, mut values): (&str, Vec<sea_orm::Value>) = match pack_id {
                Some(p) => ("AND pack_id = $3", vec![p.into()]),
                None => ("", vec![]),
            };
            values.insert(0, principal.into());
            values.insert(1, i64::try_from(batch).unwrap_or(i64::MAX).into());
            let theirs = format!(
                "SELECT record_id, stored_time FROM records WHERE principal = $1 {pack} LIMIT $2"
            );
            return delete_with_ledger(&w.txn, &theirs, values).await;
        }
        let mut theirs = Query::select();
        theirs
            .column(C::RecordId)
            .from(records::Entity)
            .and_where(Expr::col(C::Principal).eq(principal))
            .limit(batch);
        if let Some(p) = pack_id {
            theirs.and_where(Expr::col(C::PackId).eq(p));
        }
        Ok(records::Entity::delete_many()
            .filter(C::RecordId.in_subquery(theirs.to_owned()))
            .exec(&w.txn)
            .await
            .map_err(classify)?
            .rows_affected)
    }

    /// Ends an erasure in the transaction of the batch that found none: the position it
    /// reaches (`upto` on PostgreSQL), the audit row with the count, and on PostgreSQL the
    /// note that tells the other replicas' watches.
    async fn close_erasure(
        &self,
        w: super::WriteTxn,
        actor: &Actor,
        principal: &str,
        pack_id: Option<&str>,
        upto: Position,
        total: u64,
    ) -> Result<Erasure> {
        let upto = match self.engine() {
            Engine::Postgres => upto,
            // The table's last position goes when the records erased were the last
            // ones; the sequence, read under the writer's turn, never goes back.
            Engine::Sqlite => {
                let next = w
                    .txn
                    .query_one_raw(Statement::from_string(
                        DbBackend::Sqlite,
                        "SELECT next FROM record_sequence WHERE name = 'records'",
                    ))
                    .await
                    .map_err(classify)?
                    .map(|row| row.try_get::<i64>("", "next"))
                    .transpose()
                    .map_err(classify)?
                    .unwrap_or(1);
                Position {
                    txid: 0,
                    seq: next - 1,
                }
            }
        };
        let erasure = Erasure {
            principal: principal.to_owned(),
            pack_id: pack_id.map(str::to_owned),
            upto_txid: upto.txid,
            upto_seq: upto.seq,
        };
        let count = serde_json::json!({ "erased_records": total, "pack_id": pack_id });
        audit::record(
            &w.txn,
            actor,
            pack_id,
            Some(principal),
            None,
            audit::json(&count),
        )
        .await?;
        if self.engine() == Engine::Postgres {
            let note = serde_json::to_string(&erasure).unwrap_or_default();
            w.txn
                .execute_raw(Statement::from_sql_and_values(
                    DbBackend::Postgres,
                    "SELECT pg_notify($1, $2)",
                    [super::RECORDS_CHANNEL.into(), note.into()],
                ))
                .await
                .map_err(classify)?;
        }
        w.commit().await?;
        Ok(erasure)
    }

    /// Records matching the filter, in position order (or reverse), after the cursor.
    /// Brain records need the viewer's membership in their project, checked in the same query.
    /// On PostgreSQL only records below the horizon are listed: every transaction that could
    /// still commit a record at a lower position has ended, so a cursor never passes one.
    pub async fn list_records(
        &self,
        f: &RecordFilter,
        after: Option<&RecordCursor>,
        limit: u64,
    ) -> Result<Listed> {
        use records::Column as C;
        let mut q = records::Entity::find();
        if let Some(v) = &f.principal {
            q = q.filter(C::Principal.eq(v.as_str()));
        }
        if let Some(v) = &f.record_id {
            q = q.filter(C::RecordId.eq(v.as_str()));
        }
        if let Some(v) = &f.pack_id {
            q = q.filter(C::PackId.eq(v.as_str()));
        }
        if let Some(v) = &f.r#ref {
            q = q.filter(C::Ref.eq(v.as_str()));
        }
        if let Some(v) = &f.land {
            q = q.filter(C::Land.eq(v.as_str()));
        }
        if let Some(v) = f.route {
            q = q.filter(C::Route.eq(v.as_str()));
        }
        if let Some(t) = f.start_time {
            q = q.filter(C::ReceivedTime.gte(t));
        }
        if let Some(t) = f.end_time {
            q = q.filter(C::ReceivedTime.lt(t));
        }
        // §7.5.2: a brain record only for a member of its project, at read time.
        let visible = match &f.viewer {
            None => Condition::all().add(C::Land.ne(BRAIN)),
            Some(viewer) => Condition::any().add(C::Land.ne(BRAIN)).add(
                C::Project.in_subquery(
                    Query::select()
                        .column(project_members::Column::Project)
                        .from(project_members::Entity)
                        .and_where(
                            Expr::col(project_members::Column::Principal).eq(viewer.as_str()),
                        )
                        .to_owned(),
                ),
            ),
        };
        q = q.filter(visible);
        let (horizon, settled) = self.horizon().await?;
        let mut watermark = match horizon {
            Some(horizon) => {
                q = q.filter(C::CommitTxid.lt(horizon));
                below(horizon)
            }
            None => self.last_position().await?,
        };
        if let Some(p) = after {
            // A row-value comparison, which both engines answer with an index range scan.
            let key = Expr::tuple([Expr::col(C::CommitTxid), Expr::col(C::Seq)]);
            let cursor = Expr::tuple([Expr::val(p.txid), Expr::val(p.seq)]);
            q = q.filter(if f.descending {
                key.lt(cursor)
            } else {
                key.gt(cursor)
            });
        }
        q = if f.descending {
            q.order_by_desc(C::CommitTxid).order_by_desc(C::Seq)
        } else {
            q.order_by_asc(C::CommitTxid).order_by_asc(C::Seq)
        };
        let records;
        (records, watermark) = self.page(q, limit, watermark).await?;
        if let Some(p) = after {
            watermark = watermark.max(*p);
        }
        Ok(Listed {
            records,
            settled,
            watermark,
        })
    }

    /// Every record committed after `after`, of any principal, in position order, at most
    /// `limit`, and the position they reach: what the watch tail reads. It does not wait for
    /// writes in flight; what they commit comes on a later read.
    pub async fn tail_records(
        &self,
        after: Position,
        limit: u64,
    ) -> Result<(Vec<Record>, Position)> {
        use records::Column as C;
        if self.engine() == Engine::Postgres {
            return self.tail_records_postgres(after, limit).await;
        }
        // SQLite: one writer, committing in position order, so what a read sees is final and
        // it reaches as far as the last record it returns.
        let key = Expr::tuple([Expr::col(C::CommitTxid), Expr::col(C::Seq)]);
        let q = records::Entity::find()
            .filter(key.gt(Expr::tuple([Expr::val(after.txid), Expr::val(after.seq)])))
            .order_by_asc(C::CommitTxid)
            .order_by_asc(C::Seq);
        let (records, _) = self.page(q, limit, after).await?;
        let reach = records.last().map_or(after, |r| r.position);
        Ok((records, reach.max(after)))
    }

    /// The tail's read on PostgreSQL: the horizon and the records below it in one statement,
    /// one round trip (see `TAIL_POSTGRES`).
    async fn tail_records_postgres(
        &self,
        after: Position,
        limit: u64,
    ) -> Result<(Vec<Record>, Position)> {
        use sea_orm::FromQueryResult;
        let rows = self
            .listing()
            .query_all_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                TAIL_POSTGRES,
                [after.txid.into(), after.seq.into(), (limit as i64).into()],
            ))
            .await
            .map_err(classify)?;
        let mut lo = None;
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            lo = Some(row.try_get::<i64>("", "lo").map_err(classify)?);
            if row
                .try_get::<Option<String>>("", "record_id")
                .map_err(classify)?
                .is_some()
            {
                out.push(record(
                    records::Model::from_query_result(&row, "").map_err(classify)?,
                )?);
            }
        }
        let lo = lo.ok_or_else(|| Error::internal("no snapshot"))?;
        let reach = match out.last() {
            Some(last) if out.len() as u64 >= limit => last.position,
            _ => below(lo),
        };
        Ok((out, reach.max(after)))
    }

    /// At most `limit` records of `q`, and the position they cover: `reach` when they are all
    /// there are, else the last one's.
    async fn page(
        &self,
        q: sea_orm::Select<records::Entity>,
        limit: u64,
        reach: Position,
    ) -> Result<(Vec<Record>, Position)> {
        // On PostgreSQL through the listing pool, whose sessions read the partitions in
        // position order on a generic plan (`LISTING_SETTINGS`).
        let rows = q.limit(limit).all(self.listing()).await.map_err(classify)?;
        let records: Vec<Record> = rows.into_iter().map(record).collect::<Result<_>>()?;
        let reach = match records.last() {
            Some(last) if records.len() as u64 >= limit => last.position,
            _ => reach,
        };
        Ok((records, reach))
    }

    /// The position every record committed so far is at or below: where "now" is.
    pub async fn watermark(&self) -> Result<Position> {
        match self.engine() {
            Engine::Postgres => Ok(below(self.read_horizon().await?.0)),
            Engine::Sqlite => self.last_position().await,
        }
    }

    /// The highest position stored (zero when there is none).
    async fn last_position(&self) -> Result<Position> {
        use records::Column as C;
        let last: Option<(i64, i64)> = records::Entity::find()
            .select_only()
            .columns([C::CommitTxid, C::Seq])
            .order_by_desc(C::CommitTxid)
            .order_by_desc(C::Seq)
            .into_tuple()
            .one(&self.db)
            .await
            .map_err(classify)?;
        Ok(last.map_or(Position::default(), |(txid, seq)| Position { txid, seq }))
    }

    /// A record's position and principal, by id.
    pub async fn record_position(&self, record_id: &str) -> Result<Option<(Position, String)>> {
        Ok(records::Entity::find_by_id(record_id.to_owned())
            .one(&self.db)
            .await
            .map_err(classify)?
            .map(|m| {
                (
                    Position {
                        txid: m.commit_txid,
                        seq: m.seq,
                    },
                    m.principal,
                )
            }))
    }

    /// The projects a principal is a member of now.
    pub async fn projects_of(&self, principal: &str) -> Result<std::collections::BTreeSet<String>> {
        let rows: Vec<String> = project_members::Entity::find()
            .select_only()
            .column(project_members::Column::Project)
            .filter(project_members::Column::Principal.eq(principal))
            .into_tuple()
            .all(&self.db)
            .await
            .map_err(classify)?;
        Ok(rows.into_iter().collect())
    }

    /// PostgreSQL's visibility horizon as a transaction id: every transaction with a lower id
    /// has ended, and every one still to commit has this id or higher (`None` on SQLite, whose
    /// one writer commits in position order). Writes in flight when the call starts are given
    /// up to `SETTLE` to end first, so a record acknowledged before the call is not held back
    /// by a concurrent batch; past it the listing returns what is settled and the rest follows
    /// on later pages. The flag tells whether every write in flight at the start had ended.
    async fn horizon(&self) -> Result<(Option<i64>, bool)> {
        if self.engine() != Engine::Postgres {
            return Ok((None, true));
        }
        let (mut lo, target) = self.read_horizon().await?;
        let deadline = tokio::time::Instant::now() + SETTLE;
        let mut pause = std::time::Duration::from_micros(500);
        while lo < target && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(std::time::Duration::from_millis(20));
            lo = self.read_horizon().await?.0;
        }
        Ok((Some(lo), lo >= target))
    }

    /// This database's horizon now, without waiting: (lowest id in flight, next id).
    async fn read_horizon(&self) -> Result<(i64, i64)> {
        let row = self
            .db
            .query_one_raw(Statement::from_string(DbBackend::Postgres, HORIZON))
            .await
            .map_err(classify)?
            .ok_or_else(|| Error::internal("no snapshot"))?;
        let lo: i64 = row.try_get("", "lo").map_err(classify)?;
        let hi: i64 = row.try_get("", "hi").map_err(classify)?;
        Ok((lo, hi))
    }

    /// Drop reports in (pack_id, ref, reason) order after the given position.
    pub async fn list_drop_reports(
        &self,
        pack_id: Option<&str>,
        reason: Option<DropReason>,
        after: Option<(&str, &str, &str)>,
        limit: u64,
    ) -> Result<Vec<DropReport>> {
        use drop_reports::Column as C;
        let mut q = drop_reports::Entity::find()
            .order_by_asc(C::PackId)
            .order_by_asc(C::Ref)
            .order_by_asc(C::Reason);
        if let Some(p) = pack_id {
            q = q.filter(C::PackId.eq(p));
        }
        if let Some(r) = reason {
            q = q.filter(C::Reason.eq(r.as_str()));
        }
        if let Some((p, r, why)) = after {
            q = q.filter(
                Condition::any()
                    .add(C::PackId.gt(p))
                    .add(Condition::all().add(C::PackId.eq(p)).add(C::Ref.gt(r)))
                    .add(
                        Condition::all()
                            .add(C::PackId.eq(p))
                            .add(C::Ref.eq(r))
                            .add(C::Reason.gt(why)),
                    ),
            );
        }
        q.limit(limit)
            .all(&self.db)
            .await
            .map_err(classify)?
            .into_iter()
            .map(|d| {
                Ok(DropReport {
                    reason: DropReason::parse(&d.reason)
                        .ok_or_else(|| Error::internal("bad stored drop reason"))?,
                    pack_id: d.pack_id,
                    r#ref: d.r#ref,
                    count: d.count,
                    first_seen: d.first_seen,
                    last_seen: d.last_seen,
                })
            })
            .collect()
    }
}

/// Which lands a retention pass prunes.
#[derive(Debug, Clone, Copy)]
pub enum Lands<'a> {
    Only(&'a str),
    /// Every land but these (the ones with an age of their own).
    Except(&'a [String]),
}

impl std::fmt::Display for Lands<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lands::Only(l) => f.write_str(l),
            Lands::Except([]) => f.write_str("all"),
            Lands::Except(ls) => write!(f, "all but {}", ls.join(", ")),
        }
    }
}

/// PostgreSQL: a flush's drop counts in one statement, whatever their number (the keys of a
/// flush are distinct, so no row is updated twice): one round trip, prepared once.
const ADD_DROP_COUNTS_POSTGRES: &str = "INSERT INTO drop_reports (pack_id, ref, reason, count, first_seen, last_seen) \
     SELECT pack_id, ref, reason, count, first_seen, last_seen \
     FROM jsonb_to_recordset($1::jsonb) AS x(pack_id text, ref text, reason text, count bigint, first_seen bigint, last_seen bigint) \
     ON CONFLICT (pack_id, ref, reason) \
     DO UPDATE SET count = drop_reports.count + excluded.count, last_seen = excluded.last_seen";

impl DeliveryTables {
    /// Adds counts to the drop log in one transaction: `count` is added, `first_seen` kept, `last_seen` advanced.
    /// On SQLite (a file) on the logs' own connection, as the decision log's flush is.
    pub async fn add_drop_counts(&self, deltas: &[DropReport]) -> Result<()> {
        if deltas.is_empty() {
            return Ok(());
        }
        match self.engine() {
            Engine::Postgres => {
                let rows: Vec<serde_json::Value> = deltas
                    .iter()
                    .map(|d| {
                        serde_json::json!({
                            "pack_id": d.pack_id, "ref": d.r#ref, "reason": d.reason.as_str(),
                            "count": d.count, "first_seen": d.first_seen, "last_seen": d.last_seen,
                        })
                    })
                    .collect();
                self.db
                    .execute_raw(Statement::from_sql_and_values(
                        DbBackend::Postgres,
                        ADD_DROP_COUNTS_POSTGRES,
                        [serde_json::Value::Array(rows).into()],
                    ))
                    .await
                    .map_err(classify)?;
                Ok(())
            }
            Engine::Sqlite => {
                let own = deltas.to_vec();
                if let Some(written) = self
                    .on_log_connection(move |w| w.write_drop_counts(&own))
                    .await
                {
                    return written;
                }
                // An in-memory database (or a file whose own connection did not open): the
                // same upsert, through the pool.
                let w = self.begin_write().await?;
                for d in deltas {
                    w.txn
                        .execute_raw(Statement::from_sql_and_values(
                            DbBackend::Sqlite,
                            super::sqlite_writer::ADD_DROP_COUNT,
                            [
                                d.pack_id.as_str().into(),
                                d.r#ref.as_str().into(),
                                d.reason.as_str().into(),
                                d.count.into(),
                                d.first_seen.into(),
                                d.last_seen.into(),
                            ],
                        ))
                        .await
                        .map_err(classify)?;
                }
                w.commit().await
            }
        }
    }

    /// The (pack, ref, reason) keys of the drop reports stored, at most `limit`.
    pub async fn drop_report_keys(&self, limit: u64) -> Result<Vec<(String, String, DropReason)>> {
        use drop_reports::Column as C;
        let rows: Vec<(String, String, String)> = drop_reports::Entity::find()
            .select_only()
            .columns([C::PackId, C::Ref, C::Reason])
            .limit(limit)
            .into_tuple()
            .all(&self.db)
            .await
            .map_err(classify)?;
        Ok(rows
            .into_iter()
            .filter_map(|(p, r, why)| DropReason::parse(&why).map(|why| (p, r, why)))
            .collect())
    }

    /// The first record stored for a pack's trigger id: what a retried delivery is answered.
    ///
    /// The reads through a driver are boxed: their futures (a pool's acquire, a query's
    /// states) are thousands of bytes, and unboxed they would be part of every delivery's
    /// future, copied on every call whether it looks a trigger id up or not.
    pub async fn record_for_trigger(
        &self,
        pack_id: &str,
        trigger_id: &str,
    ) -> Result<Option<Arc<Record>>> {
        if self.partitioned() {
            return Box::pin(self.record_for_trigger_partitioned(pack_id, trigger_id)).await;
        }
        if let Some(found) = self.readers.record_for_trigger(pack_id, trigger_id) {
            return found.map(|m| record(m).map(Arc::new)).transpose();
        }
        Box::pin(
            records::Entity::find()
                .filter(records::Column::PackId.eq(pack_id))
                .filter(records::Column::ProducerTriggerId.eq(trigger_id))
                .one(&self.db),
        )
        .await
        .map_err(classify)?
        .map(|m| record(m).map(Arc::new))
        .transpose()
    }
}

impl DeliveryTables {
    /// PostgreSQL: the ledger first (a trigger never recorded, the usual dropped one, costs one
    /// key read of one narrow table), then the one partition the ledger names, which the plan
    /// prunes to, where a join would plan every partition. A record read this way is copied
    /// (`answers`): its next retry is answered from the copy once one statement finds the
    /// ledger's row still naming it and the record still in its partition (both by their
    /// keys): what the two statements would read, in one round trip.
    ///
    /// Through sqlx itself, not sea-orm: sea-orm's query future holds the states of every
    /// backend it may run on and is copied whole as it is awaited; under callgrind that was
    /// 45,000 instructions of `memcpy` a look-up, more than the look-up's own work. Both
    /// statements run on one connection taken from the pool once: each taking and giving back
    /// costs a task of sqlx's and the pool's bookkeeping.
    async fn record_for_trigger_partitioned(
        &self,
        pack_id: &str,
        trigger_id: &str,
    ) -> Result<Option<Arc<Record>>> {
        use sea_orm::sqlx::{self, Row};
        let mut conn = self
            .db
            .get_postgres_connection_pool()
            .acquire()
            .await
            .map_err(from_sqlx)?;
        if let Some(copy) = self.answers.get(pack_id, trigger_id) {
            let held = sqlx::query(
                "SELECT 1 FROM record_triggers \
                 WHERE pack_id = $1 AND producer_trigger_id = $2 AND record_id = $3 \
                   AND EXISTS (SELECT 1 FROM records WHERE record_id = $3 AND stored_time = $4)",
            )
            .bind(pack_id)
            .bind(trigger_id)
            .bind(copy.record.record_id.as_str())
            .bind(copy.stored_time)
            .fetch_optional(&mut *conn)
            .await
            .map_err(from_sqlx)?;
            if held.is_some() {
                return Ok(Some(copy.record));
            }
            self.answers.forget(pack_id, trigger_id);
        }
        let claim = sqlx::query(
            "SELECT record_id, stored_time FROM record_triggers \
             WHERE pack_id = $1 AND producer_trigger_id = $2",
        )
        .bind(pack_id)
        .bind(trigger_id)
        .fetch_optional(&mut *conn)
        .await
        .map_err(from_sqlx)?;
        let Some(claim) = claim else {
            return Ok(None);
        };
        let record_id: String = claim.try_get(0).map_err(from_sqlx)?;
        let stored_time: i64 = claim.try_get(1).map_err(from_sqlx)?;
        let row = sqlx::query(concat!(
            "SELECT ",
            records::columns!(),
            " FROM records WHERE record_id = $1 AND stored_time = $2"
        ))
        .bind(record_id)
        .bind(stored_time)
        .fetch_optional(&mut *conn)
        .await
        .map_err(from_sqlx)?;
        let Some(r) = row else {
            return Ok(None);
        };
        let m = (|| Ok::<_, sqlx::Error>(records::from_row!(r.try_get)))().map_err(from_sqlx)?;
        let first = Arc::new(record(m)?);
        self.answers.keep(&first, stored_time);
        Ok(Some(first))
    }
}

/// A driver error sorted as the store's errors are (`classify`).
pub(super) fn from_sqlx(e: sea_orm::sqlx::Error) -> Error {
    classify(sea_orm::DbErr::Query(sea_orm::RuntimeErr::SqlxError(
        std::sync::Arc::new(e),
    )))
}

impl Store {
    /// Records copied from another PostgreSQL cluster (a restore, a logical replica promoted)
    /// carry that cluster's transaction ids; those at or past this cluster's next id would
    /// stay behind the horizon until its counter caught up. They are moved to transaction 0,
    /// ahead of every record written here, keeping their sequence order. No record written on
    /// this cluster can be touched: its id is below the next one. Returns how many moved.
    pub async fn adopt_copied_positions(&self) -> Result<u64> {
        if self.engine() != Engine::Postgres {
            return Ok(0);
        }
        let done = self
            .db
            .execute_unprepared(
                "UPDATE records SET commit_txid = 0 \
                 WHERE commit_txid >= pg_snapshot_xmax(pg_current_snapshot())::text::bigint",
            )
            .await
            .map_err(classify)?;
        Ok(done.rows_affected())
    }
}
