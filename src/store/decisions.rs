//! The decision log's table: entries appended in batches (a recorded trigger's in its record's statement, see `sink`), listed newest first by the viewer rules of records, erased by principal, pruned past retention.
use sea_orm::sea_query::{Alias, Condition, Expr, ExprTrait, Order, Query, SelectStatement};
use std::sync::Arc;

use sea_orm::{ConnectionTrait, DbBackend, QueryResult, Statement};

use hcp_sense_migration::DECISIONS_RECORDED;

use super::{classify, DecisionTables, Engine};
use crate::domain::decision_log::{Entry, Logged};
use crate::domain::trigger::{DropReason, BRAIN};
use crate::error::{Error, Result};

/// What a listing of the log asks for; every filter given must match.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DecisionFilter {
    /// Brain entries need this principal's membership in their project; none are listed
    /// without one.
    pub viewer: Option<String>,
    pub principal: Option<String>,
    pub pack_id: Option<String>,
    pub r#ref: Option<String>,
    pub trigger_id: Option<String>,
    pub outcome: Option<Logged>,
    pub drop_reason: Option<DropReason>,
    /// A door (`grpc`, `http`, `nats`, `hub`) or a whole source (`http:<route id>`).
    pub source: Option<String>,
    pub start_time: Option<i64>,
    pub end_time: Option<i64>,
}

/// Columns an insert names, after `decided_time`, in the order of `values`.
const COLUMNS: [&str; 15] = [
    "pack_id",
    "ref",
    "principal",
    "land",
    "project",
    "binding_id",
    "trigger_id",
    "source",
    "outcome",
    "drop_reason",
    "check_name",
    "detail",
    "record_id",
    "trace_id",
    "folded",
];

/// Entries of the SQLite log one transaction of an erasure reads.
const ERASE_RANGE: i64 = 100_000;

/// Most entries in one SQLite insert statement (16 values each, under SQLite's 32,766).
const SQLITE_CHUNK: usize = 256;

/// An entry as the PostgreSQL insert reads it from the batch's JSON.
#[derive(serde::Serialize)]
struct Row<'a> {
    pack_id: &'a str,
    r#ref: &'a str,
    principal: &'a str,
    land: &'a str,
    project: Option<&'a str>,
    binding_id: &'a str,
    trigger_id: Option<&'a str>,
    source: &'a str,
    outcome: &'a str,
    drop_reason: Option<&'a str>,
    check_name: &'a str,
    detail: &'a str,
    record_id: Option<&'a str>,
    trace_id: Option<&'a str>,
    folded: i64,
}

/// PostgreSQL: the batch as one JSON parameter of one statement; `decided_time` is the
/// database's clock (the partition key), so every replica writes into the same partition.
const INSERT_POSTGRES: &str = "INSERT INTO decisions (pack_id, ref, principal, land, project, binding_id, trigger_id, \
       source, outcome, drop_reason, check_name, detail, record_id, trace_id, folded) \
     SELECT pack_id, ref, principal, land, project, binding_id, trigger_id, source, outcome, drop_reason, \
       check_name, detail, record_id, trace_id, folded \
     FROM jsonb_to_recordset($1::jsonb) AS x(pack_id text, ref text, principal text, land text, project text, \
       binding_id text, trigger_id text, source text, outcome text, drop_reason text, check_name text, detail text, \
       record_id text, trace_id text, folded bigint)";

impl DecisionTables {
    /// Appends `entries` in one transaction (one statement on PostgreSQL). A batch that finds
    /// no partition for now has it made and is written again.
    pub async fn insert_decisions(&self, entries: &Arc<Vec<Entry>>) -> Result<()> {
        if entries.is_empty() {
            return Ok(());
        }
        match self.engine() {
            Engine::Postgres => {
                let rows: Vec<Row<'_>> = entries.iter().map(row).collect();
                let batch = serde_json::to_string(&rows)
                    .map_err(|e| Error::internal_from("decisions not encoded", e))?;
                let insert = || {
                    self.db.execute_raw(Statement::from_sql_and_values(
                        DbBackend::Postgres,
                        INSERT_POSTGRES,
                        [batch.clone().into()],
                    ))
                };
                match insert().await {
                    Err(e)
                        if super::sqlstate(&e).as_deref()
                            == Some(super::partitions::NO_PARTITION) =>
                    {
                        self.repair_partition().await?;
                        insert().await.map_err(classify)?;
                    }
                    done => {
                        done.map_err(classify)?;
                    }
                }
                Ok(())
            }
            Engine::Sqlite => {
                let own = entries.clone();
                if let Some(written) = self
                    .on_log_connection(move |w| w.write_decisions(&own))
                    .await
                {
                    return written;
                }
                let w = self.begin_write().await?;
                insert_sqlite(&w.txn, entries).await?;
                w.commit().await
            }
        }
    }

    /// Entries matching `f`, newest first, after the cursor `(decided_time, seq)`, at most `limit`.
    /// By principal, two reads merged: the entries its index holds (drops, refusals,
    /// duplicates) and the recorded ones, found through the principal's records (see the
    /// migration `decision_log_indexes`).
    pub async fn list_decisions(
        &self,
        f: &DecisionFilter,
        after: Option<(i64, i64)>,
        limit: u64,
    ) -> Result<Vec<Entry>> {
        let recorded = f.outcome.map(Logged::is_recorded);
        let parts = match (&f.principal, recorded) {
            (None, _) => vec![Part::Log(select(f))],
            (Some(p), Some(true)) => vec![Part::Recorded(recorded_only(f), p.clone())],
            (Some(_), Some(false)) => vec![Part::Log(not_recorded(f))],
            (Some(p), None) => vec![
                Part::Log(not_recorded(f)),
                Part::Recorded(recorded_only(f), p.clone()),
            ],
        };
        let mut found = Vec::new();
        for part in parts {
            let statement = match part {
                Part::Log(mut q) => {
                    after_cursor(&mut q, after);
                    newest_first(&mut q, limit);
                    self.db.get_database_backend().build(&q)
                }
                Part::Recorded(q, principal) => {
                    through_records(self.engine(), q, &principal, after, limit)
                }
            };
            let rows = self.db.query_all_raw(statement).await.map_err(classify)?;
            for r in &rows {
                found.push(entry(r)?);
            }
        }
        found.sort_by_key(|e| std::cmp::Reverse((e.decided_time, e.seq)));
        found.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        Ok(found)
    }

    /// Deletes every entry of `principal` (of one pack, when given); answers how many. No
    /// index holds all of a principal's entries (recorded ones are indexed by record, and a
    /// record may be gone before its entry), so this reads the whole log: on SQLite in ranges
    /// of `ERASE_RANGE` entries, one transaction each, so deliveries take their turns.
    pub async fn erase_decisions(&self, principal: &str, pack_id: Option<&str>) -> Result<u64> {
        let of = |q: &mut sea_orm::sea_query::DeleteStatement| {
            q.from_table(Alias::new("decisions"))
                .and_where(Expr::col(Alias::new("principal")).eq(principal));
            if let Some(p) = pack_id {
                q.and_where(Expr::col(Alias::new("pack_id")).eq(p));
            }
        };
        if self.engine() == Engine::Postgres {
            let mut q = Query::delete();
            of(&mut q);
            let done = self
                .db
                .execute_raw(self.db.get_database_backend().build(&q))
                .await
                .map_err(classify)?;
            return Ok(done.rows_affected());
        }
        let bounds = self
            .db
            .query_one_raw(Statement::from_string(
                DbBackend::Sqlite,
                "SELECT coalesce(min(seq), 0) AS lo, coalesce(max(seq), -1) AS hi FROM decisions",
            ))
            .await
            .map_err(classify)?
            .ok_or_else(|| Error::internal("no bounds of the decision log"))?;
        let lo: i64 = bounds.try_get("", "lo").map_err(classify)?;
        let hi: i64 = bounds.try_get("", "hi").map_err(classify)?;
        let mut erased = 0;
        let mut from = lo;
        // Entries written after `hi` were decided after the erasure began (the caller flushed
        // what it had taken first), as records stored after an erasure's position stay.
        while from <= hi {
            let to = Ord::min(from.saturating_add(ERASE_RANGE), hi.saturating_add(1));
            let mut q = Query::delete();
            of(&mut q);
            q.and_where(Expr::col(Alias::new("seq")).gte(from))
                .and_where(Expr::col(Alias::new("seq")).lt(to));
            let w = self.begin_write().await?;
            let done = w
                .txn
                .execute_raw(DbBackend::Sqlite.build(&q))
                .await
                .map_err(classify)?;
            w.commit().await?;
            erased += done.rows_affected();
            from = to;
        }
        Ok(erased)
    }

    /// Deletes up to `limit` entries decided before `cutoff` (SQLite; PostgreSQL drops
    /// partitions instead); answers how many.
    pub async fn prune_decisions(&self, cutoff: i64, limit: u64) -> Result<u64> {
        let w = self.begin_write().await?;
        let done = w
            .txn
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Sqlite,
                "DELETE FROM decisions WHERE seq IN \
                 (SELECT seq FROM decisions WHERE decided_time < ? ORDER BY decided_time LIMIT ?)",
                [
                    cutoff.into(),
                    i64::try_from(limit).unwrap_or(i64::MAX).into(),
                ],
            ))
            .await
            .map_err(classify)?;
        w.commit().await?;
        Ok(done.rows_affected())
    }
}

impl DecisionTables {
    /// Deletes up to `limit` of the oldest entries while more than `max` are kept (SQLite;
    /// PostgreSQL drops partitions instead); answers how many.
    pub async fn prune_decisions_over(&self, max: u64, limit: u64) -> Result<u64> {
        let w = self.begin_write().await?;
        let done = w
            .txn
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Sqlite,
                "DELETE FROM decisions WHERE seq IN (SELECT seq FROM decisions ORDER BY seq \
                 LIMIT max(0, min(?, (SELECT count(*) FROM decisions) - ?)))",
                [
                    i64::try_from(limit).unwrap_or(i64::MAX).into(),
                    i64::try_from(max).unwrap_or(i64::MAX).into(),
                ],
            ))
            .await
            .map_err(classify)?;
        w.commit().await?;
        Ok(done.rows_affected())
    }
}

/// The select of `f`'s entries, with the viewer rule of brain entries (§7.5.2).
fn select(f: &DecisionFilter) -> SelectStatement {
    let col = |c: &str| Expr::col(Alias::new(c));
    let mut q = Query::select();
    q.columns(
        ["seq", "decided_time"]
            .into_iter()
            .chain(COLUMNS)
            .map(Alias::new),
    )
    .from(Alias::new("decisions"));
    let eq = |q: &mut SelectStatement, c: &str, v: &Option<String>| {
        if let Some(v) = v {
            q.and_where(Expr::col(Alias::new(c)).eq(v.as_str()));
        }
    };
    eq(&mut q, "principal", &f.principal);
    eq(&mut q, "pack_id", &f.pack_id);
    eq(&mut q, "ref", &f.r#ref);
    eq(&mut q, "trigger_id", &f.trigger_id);
    if let Some(o) = f.outcome {
        q.and_where(col("outcome").eq(o.as_str()));
    }
    if let Some(r) = f.drop_reason {
        q.and_where(col("drop_reason").eq(r.as_str()));
    }
    if let Some(s) = &f.source {
        if s.contains(':') {
            q.and_where(col("source").eq(s.as_str()));
        } else {
            q.cond_where(
                Condition::any()
                    .add(col("source").eq(s.as_str()))
                    // The kind's sources (`grpc` → `grpc:…`); `%` and `_` in it are
                    // themselves, not wildcards.
                    .add(
                        col("source").like(
                            sea_orm::sea_query::LikeExpr::new(format!(
                                "{}:%",
                                s.replace('\\', "\\\\")
                                    .replace('%', "\\%")
                                    .replace('_', "\\_")
                            ))
                            .escape('\\'),
                        ),
                    ),
            );
        }
    }
    if let Some(t) = f.start_time {
        q.and_where(col("decided_time").gte(t));
    }
    if let Some(t) = f.end_time {
        q.and_where(col("decided_time").lt(t));
    }
    let member_of = |viewer: &str| {
        Query::select()
            .column(Alias::new("project"))
            .from(Alias::new("project_members"))
            .and_where(Expr::col(Alias::new("principal")).eq(viewer))
            .to_owned()
    };
    q.cond_where(match &f.viewer {
        None => Condition::all().add(col("land").ne(BRAIN)),
        Some(v) => Condition::any()
            .add(col("land").ne(BRAIN))
            .add(col("project").in_subquery(member_of(v))),
    });
    q
}

/// `f`'s entries that are not records, from the principal index.
fn not_recorded(f: &DecisionFilter) -> SelectStatement {
    let mut q = select(f);
    q.and_where(Expr::cust(format!("NOT ({DECISIONS_RECORDED})")));
    q
}

/// How one part of a listing is read.
enum Part {
    /// A select of the log.
    Log(SelectStatement),
    /// The recorded entries of a principal, through its records.
    Recorded(SelectStatement, String),
}

/// `f`'s recorded entries (of any principal: `through_records` joins the principal's).
fn recorded_only(f: &DecisionFilter) -> SelectStatement {
    let mut q = select(f);
    q.and_where(Expr::cust(DECISIONS_RECORDED));
    q
}

/// Entries after the cursor `(decided_time, seq)`, when there is one.
fn after_cursor(q: &mut SelectStatement, after: Option<(i64, i64)>) {
    if let Some((t, seq)) = after {
        let key = Expr::tuple([
            Expr::col(Alias::new("decided_time")),
            Expr::col(Alias::new("seq")),
        ]);
        q.and_where(key.lt(Expr::tuple([Expr::val(t), Expr::val(seq)])));
    }
}

fn newest_first(q: &mut SelectStatement, limit: u64) {
    q.order_by(Alias::new("decided_time"), Order::Desc)
        .order_by(Alias::new("seq"), Order::Desc)
        .limit(limit);
}

/// The entries `q` selects whose records are `principal`'s: the records index names the
/// principal's record ids, the log's record index finds each one's entry. The work is the
/// principal's records, whatever else the log holds. On PostgreSQL the entry is looked up
/// record by record (a lateral select the planner may not merge, `OFFSET 0`): a plan
/// prepared once and kept for every principal then never reads the log's recorded entries
/// whole, as a semi-join planned for one principal would for the next.
fn through_records(
    engine: Engine,
    mut q: SelectStatement,
    principal: &str,
    after: Option<(i64, i64)>,
    limit: u64,
) -> Statement {
    after_cursor(&mut q, after);
    if engine == Engine::Sqlite {
        q.and_where(
            Expr::col(Alias::new("record_id")).in_subquery(
                Query::select()
                    .column(Alias::new("record_id"))
                    .from(Alias::new("records"))
                    .and_where(Expr::col(Alias::new("principal")).eq(principal))
                    .to_owned(),
            ),
        );
        newest_first(&mut q, limit);
        return DbBackend::Sqlite.build(&q);
    }
    q.and_where(Expr::cust("record_id = r.record_id")).offset(0);
    let (inner, mut values) = q.build(sea_orm::sea_query::PostgresQueryBuilder);
    values.0.push(principal.into());
    let sql = format!(
        "SELECT x.* FROM records r CROSS JOIN LATERAL ({inner}) AS x \
         WHERE r.principal = ${} ORDER BY x.decided_time DESC, x.seq DESC LIMIT {limit}",
        values.0.len()
    );
    Statement::from_sql_and_values(DbBackend::Postgres, sql, values)
}

fn row(e: &Entry) -> Row<'_> {
    Row {
        pack_id: &e.pack_id,
        r#ref: &e.r#ref,
        principal: &e.principal,
        land: &e.land,
        project: e.project.as_deref(),
        binding_id: &e.binding_id,
        trigger_id: e.trigger_id.as_deref(),
        source: &e.source,
        outcome: e.outcome.as_str(),
        drop_reason: e.drop_reason.map(DropReason::as_str),
        check_name: &e.check,
        detail: &e.detail,
        record_id: e.record_id.as_deref(),
        trace_id: e.trace_id.as_deref(),
        folded: e.folded,
    }
}

/// SQLite: in the caller's transaction, `decided_time` from the entry (the service's clock).
pub(crate) async fn insert_sqlite(txn: &impl ConnectionTrait, entries: &[Entry]) -> Result<()> {
    let inserts = sqlite_inserts();
    let mut rest = entries;
    while !rest.is_empty() {
        let (chunk, tail) = rest.split_at(inserts.chunk(rest.len()));
        rest = tail;
        let values = sqlite_values(chunk);
        txn.execute_raw(Statement::from_sql_and_values(
            DbBackend::Sqlite,
            inserts.statement(chunk.len()),
            values,
        ))
        .await
        .map_err(classify)?;
    }
    Ok(())
}

/// SQLite's inserts of entries, built once.
pub(super) fn sqlite_inserts() -> &'static super::SqliteInserts {
    static INSERTS: std::sync::OnceLock<super::SqliteInserts> = std::sync::OnceLock::new();
    INSERTS.get_or_init(|| {
        let head = format!(
            "INSERT INTO decisions (decided_time, {})",
            COLUMNS.join(", ")
        );
        super::SqliteInserts::new(&head, COLUMNS.len() + 1, "", SQLITE_CHUNK)
    })
}

/// An entry's values in the order of `sqlite_inserts`' columns, borrowed from it: the
/// writer's connection binds them as they are (`sqlite_writer::insert_entries`).
pub(super) fn sqlite_row(e: &Entry) -> [rusqlite::types::ValueRef<'_>; 16] {
    use rusqlite::types::ValueRef as V;
    fn text(s: &str) -> V<'_> {
        V::Text(s.as_bytes())
    }
    fn maybe(s: Option<&str>) -> V<'_> {
        s.map_or(V::Null, text)
    }
    [
        V::Integer(e.decided_time),
        text(&e.pack_id),
        text(&e.r#ref),
        text(&e.principal),
        text(&e.land),
        maybe(e.project.as_deref()),
        text(&e.binding_id),
        maybe(e.trigger_id.as_deref()),
        text(&e.source),
        text(e.outcome.as_str()),
        maybe(e.drop_reason.map(|r| r.as_str())),
        text(&e.check),
        text(&e.detail),
        maybe(e.record_id.as_deref()),
        maybe(e.trace_id.as_deref()),
        V::Integer(e.folded),
    ]
}

/// The values of SQLite's insert of `chunk` through the pool (an in-memory database):
/// `sqlite_row`'s, owned.
pub(super) fn sqlite_values(chunk: &[Entry]) -> Vec<sea_orm::Value> {
    chunk
        .iter()
        .flat_map(sqlite_row)
        .map(super::owned_value)
        .collect()
}

fn entry(r: &QueryResult) -> Result<Entry> {
    let s = |c: &str| r.try_get::<String>("", c).map_err(classify);
    let o = |c: &str| r.try_get::<Option<String>>("", c).map_err(classify);
    let outcome = s("outcome")?;
    Ok(Entry {
        seq: r.try_get("", "seq").map_err(classify)?,
        decided_time: r.try_get("", "decided_time").map_err(classify)?,
        pack_id: s("pack_id")?,
        r#ref: s("ref")?,
        principal: s("principal")?,
        land: s("land")?,
        project: o("project")?,
        binding_id: s("binding_id")?,
        trigger_id: o("trigger_id")?,
        source: s("source")?,
        outcome: Logged::parse(&outcome)
            .ok_or_else(|| Error::internal(format!("a stored outcome `{outcome}` is unknown")))?,
        drop_reason: o("drop_reason")?.and_then(|d| DropReason::parse(&d)),
        check: s("check_name")?,
        detail: s("detail")?,
        record_id: o("record_id")?,
        trace_id: o("trace_id")?,
        folded: r.try_get("", "folded").map_err(classify)?,
    }
    .told())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_principals_recorded_entries_are_looked_up_record_by_record_on_postgres() {
        let f = DecisionFilter {
            principal: Some("alice".into()),
            pack_id: Some("github".into()),
            ..DecisionFilter::default()
        };
        let s = through_records(
            Engine::Postgres,
            recorded_only(&f),
            "alice",
            Some((7, 3)),
            11,
        );
        let sql = s.sql.as_str();
        assert!(sql.contains("CROSS JOIN LATERAL"), "{sql}");
        // The fence that keeps the planner from merging the lookup into a semi-join.
        assert!(
            sql.contains("OFFSET $") || sql.contains("OFFSET 0"),
            "{sql}"
        );
        assert!(sql.contains("record_id = r.record_id"), "{sql}");
        let values = s.values.expect("values").0;
        assert_eq!(
            values.last(),
            Some(&sea_orm::Value::from("alice")),
            "the records' principal is the last parameter: {sql}"
        );
        assert!(
            sql.contains(&format!("r.principal = ${}", values.len())),
            "{sql}"
        );
        assert!(sql.ends_with("LIMIT 11"), "{sql}");
        let lite = through_records(Engine::Sqlite, recorded_only(&f), "alice", None, 11);
        assert!(
            lite.sql
                .contains("IN (SELECT \"record_id\" FROM \"records\""),
            "{}",
            lite.sql
        );
    }
}
