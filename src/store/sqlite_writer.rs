//! SQLite: the sink writer's and the logs' own connections, used on the thread that writes, so a batch's or a flush's statements run where it is instead of one hand-off each to a driver's worker thread.
//!
//! The store's pool (sqlx) runs each SQLite connection on a thread of its own and every
//! statement is a message to it and an answer back: a batch of one record (BEGIN, the sequence,
//! the insert, the decision log's entry, COMMIT) cost five round trips between threads, two
//! wake-ups each. This connection is opened by the writer, on the same file with the same
//! settings (WAL, full sync, the busy timeout), keeps its statements prepared, and runs the
//! whole batch in one transaction on the thread that took it. It writes only while holding the
//! store's write turn, like every other writer of this process; readers see its commits as
//! any WAL reader does. An in-memory database has no file to share: it keeps the pool's path.
use std::time::Duration;

use rusqlite::types::Value as Sql;
use rusqlite::{Connection, OpenFlags, TransactionBehavior};

use super::sink::{self, FirstRecord, Stored};
use crate::domain::decision_log::{Entry, Note};
use crate::domain::model::{DropReport, Record};
use crate::error::{Error, Result};

/// How long a write waits for another process's lock on the file (the pool's is the same).
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Rows a batch that may be cut inserts per statement (see `SqliteWriter::write`): about a
/// millisecond of inserts on this kind of machine, the longest a quiet pack's record waits
/// for a flood's batch to be cut.
pub const CUT_EVERY: usize = 32;

/// Prepared statements kept: the inserts of each power-of-two size, records' and the decision
/// log's, the sequence and the look-ups.
const STATEMENTS: usize = 64;

pub struct SqliteWriter {
    conn: Connection,
}

impl std::fmt::Debug for SqliteWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SqliteWriter")
    }
}

/// The file a sqlx SQLite URL names; None for an in-memory database.
pub(super) fn file_of(url: &str) -> Option<std::path::PathBuf> {
    use std::str::FromStr;
    let opts = sea_orm::sqlx::sqlite::SqliteConnectOptions::from_str(url).ok()?;
    let path = opts.get_filename();
    let name = path.to_string_lossy();
    if name.is_empty()
        || name == ":memory:"
        || name.starts_with("file:")
        || url.contains("mode=memory")
    {
        return None;
    }
    Some(path.to_path_buf())
}

impl SqliteWriter {
    /// Whether `url` names a file this connection can share with the pool.
    pub fn has_file(url: &str) -> bool {
        file_of(url).is_some()
    }

    /// Opens the writer's connection to the file `url` names (which the pool has made);
    /// None for an in-memory database, whose writes stay on the pool.
    pub fn open(url: &str) -> Result<Option<SqliteWriter>> {
        let Some(path) = file_of(url) else {
            return Ok(None);
        };
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(unavailable)?;
        conn.busy_timeout(BUSY_TIMEOUT).map_err(unavailable)?;
        // The pool set WAL on the file; synchronous is a setting of each connection.
        conn.execute_batch("PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON;")
            .map_err(unavailable)?;
        conn.set_prepared_statement_cache_capacity(STATEMENTS);
        Ok(Some(SqliteWriter { conn }))
    }

    /// Writes a batch in one transaction, as `sink::write_records` does on SQLite: the
    /// records' sequence numbers, the rows (a trigger id already stored, or earlier in the
    /// batch, is skipped and answered with its first record), and each inserted record's
    /// decision log entry when its note is given. The caller holds the store's write turn.
    ///
    /// With `cut`, the rows go in CUT_EVERY at a time and `cut` is asked after each: when it
    /// answers true, the rows inserted so far are committed alone and the rest is left to the
    /// caller. Answers what became of the records committed, the first of `rs` in order.
    pub fn write(
        &mut self,
        rs: &mut [Record],
        notes: &[Option<Note>],
        mut cut: Option<&mut dyn FnMut() -> bool>,
    ) -> Result<Vec<Stored>> {
        if rs.is_empty() {
            return Ok(Vec::new());
        }
        let txn = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(unavailable)?;
        let n = rs.len() as i64;
        let next: i64 = txn
            .prepare_cached(
                "UPDATE record_sequence SET next = next + ?1 WHERE name = 'records' RETURNING next",
            )
            .and_then(|mut s| s.query_row([n], |row| row.get(0)))
            .map_err(unavailable)?;
        let mut seq = next - n;
        let inserts = sink::sqlite_inserts();
        let most = if cut.is_some() { CUT_EVERY } else { rs.len() };
        let mut inserted = 0usize;
        let mut done = 0usize;
        while done < rs.len() {
            let size = inserts.chunk((rs.len() - done).min(most));
            // Stamped as they are inserted: rows a cut leaves out are stamped by their own write.
            for r in &mut rs[done..done + size] {
                super::stamp(r);
            }
            let chunk = &rs[done..done + size];
            let payloads: Vec<String> = chunk.iter().map(sink::payload_text).collect();
            let values = chunk
                .iter()
                .zip(&payloads)
                .enumerate()
                .flat_map(|(n, (r, p))| sink::sqlite_row(r, p, seq + n as i64));
            inserted += run_bound(&txn, inserts.statement(size), values)?;
            seq += size as i64;
            done += size;
            if done < rs.len() && cut.as_mut().is_some_and(|cut| cut()) {
                break;
            }
        }
        if done < rs.len() {
            // The numbers of the rows left out go back: the next batch's follow these.
            txn.prepare_cached(
                "UPDATE record_sequence SET next = next - ?1 WHERE name = 'records'",
            )
            .and_then(|mut s| s.execute([rs.len() as i64 - done as i64]))
            .map_err(unavailable)?;
        }
        let rs = &rs[..done];
        let firsts = if inserted == rs.len() {
            None
        } else {
            Some(firsts(&txn, rs)?)
        };
        let stored = sink::stored_as(rs, firsts.as_deref())?;
        let entries = sink::logged(rs, &notes[..done], &stored);
        insert_entries(&txn, &entries)?;
        txn.commit().map_err(unavailable)?;
        Ok(stored)
    }

    /// Writes decision log entries that are not records' (the log's flush) in one
    /// transaction. The caller holds the store's write turn.
    pub fn write_decisions(&mut self, entries: &[Entry]) -> Result<()> {
        let not_written = |e: Error| match e {
            Error::Unavailable(m) => Error::Unavailable(m.replace(
                "the record batch was not written",
                "the decision log's entries were not written",
            )),
            other => other,
        };
        let txn = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(unavailable)
            .map_err(not_written)?;
        insert_entries(&txn, entries).map_err(not_written)?;
        txn.commit().map_err(unavailable).map_err(not_written)
    }

    /// Adds drop counts (the drop log's flush) in one transaction, one prepared upsert a key:
    /// `count` added, `first_seen` kept, `last_seen` the delta's. The caller holds the store's
    /// write turn.
    pub fn write_drop_counts(&mut self, deltas: &[DropReport]) -> Result<()> {
        let not_written = |e: rusqlite::Error| {
            Error::Unavailable(format!("the drop counts were not written: {e}; retry"))
        };
        let txn = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(not_written)?;
        {
            let mut add = txn.prepare_cached(ADD_DROP_COUNT).map_err(not_written)?;
            for d in deltas {
                add.execute(rusqlite::params![
                    d.pack_id,
                    d.r#ref,
                    d.reason.as_str(),
                    d.count,
                    d.first_seen,
                    d.last_seen
                ])
                .map_err(not_written)?;
            }
        }
        txn.commit().map_err(not_written)
    }
}

/// One key's drop count added: `count` summed, `first_seen` kept, `last_seen` the delta's. Run
/// here, prepared once, and by the pool's path for an in-memory database
/// (`DeliveryTables::add_drop_counts`).
pub(super) const ADD_DROP_COUNT: &str =
    "INSERT INTO drop_reports (pack_id, \"ref\", reason, count, first_seen, last_seen) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6) \
     ON CONFLICT (pack_id, \"ref\", reason) \
     DO UPDATE SET count = drop_reports.count + excluded.count, last_seen = excluded.last_seen";

/// Inserts decision log entries in the transaction, by the prepared inserts of
/// `decisions::sqlite_inserts`.
fn insert_entries(txn: &rusqlite::Transaction<'_>, entries: &[Entry]) -> Result<()> {
    let decisions = super::decisions::sqlite_inserts();
    let mut rest = entries;
    while !rest.is_empty() {
        let (chunk, tail) = rest.split_at(decisions.chunk(rest.len()));
        rest = tail;
        let values = chunk.iter().flat_map(super::decisions::sqlite_row);
        run_bound(txn, decisions.statement(chunk.len()), values)?;
    }
    Ok(())
}

/// Runs a prepared statement with `values` bound as they are, borrowed from the rows they
/// come from (no owned copy of each value on the way); the rows it changed.
fn run_bound<'a>(
    txn: &rusqlite::Transaction<'_>,
    sql: &str,
    values: impl Iterator<Item = rusqlite::types::ValueRef<'a>>,
) -> Result<usize> {
    let mut statement = txn.prepare_cached(sql).map_err(unavailable)?;
    let mut bound = 0;
    for v in values {
        bound += 1;
        statement
            .raw_bind_parameter(bound, rusqlite::types::ToSqlOutput::Borrowed(v))
            .map_err(unavailable)?;
    }
    // A cached statement keeps its last values: every one is bound again, or none is run.
    if bound != statement.parameter_count() {
        return Err(Error::internal(format!(
            "{bound} values for a statement of {} parameters",
            statement.parameter_count()
        )));
    }
    statement.raw_execute().map_err(unavailable)
}

/// The first records of the batch's trigger ids (the records stored under them), by the
/// look-up the pool's path runs too (`sink::sqlite_firsts`).
fn firsts(txn: &rusqlite::Transaction<'_>, rs: &[Record]) -> Result<Vec<FirstRecord>> {
    let Some(statement) = sink::sqlite_firsts(rs) else {
        return Ok(Vec::new());
    };
    let values = statement
        .values
        .map(|v| v.0)
        .unwrap_or_default()
        .into_iter()
        .map(sql_value)
        .collect::<Result<Vec<_>>>()?;
    let mut prepared = txn.prepare(&statement.sql).map_err(unavailable)?;
    let rows = prepared
        .query_map(rusqlite::params_from_iter(values), |row| {
            Ok(FirstRecord {
                pack_id: row.get(0)?,
                producer_trigger_id: row.get(1)?,
                record_id: row.get(2)?,
                route: row.get(3)?,
                principal: row.get(4)?,
                r#ref: row.get(5)?,
                land: row.get(6)?,
                payload: row.get(7)?,
            })
        })
        .map_err(unavailable)?;
    rows.collect::<std::result::Result<Vec<_>, _>>()
        .map_err(unavailable)
}

/// A value of the pool's statements, as this connection binds it.
fn sql_value(v: sea_orm::Value) -> Result<Sql> {
    use sea_orm::Value as V;
    Ok(match v {
        V::String(Some(s)) => Sql::Text(s),
        V::BigInt(Some(n)) => Sql::Integer(n),
        V::Int(Some(n)) => Sql::Integer(n.into()),
        V::String(None) | V::BigInt(None) | V::Int(None) => Sql::Null,
        other => {
            return Err(Error::internal(format!(
                "a value of a kind the SQLite writer does not bind: {other:?}"
            )))
        }
    })
}

/// A failed write: the batch is not committed (the transaction rolls back as it is dropped),
/// and every caller in it is told to retry.
fn unavailable(e: rusqlite::Error) -> Error {
    Error::Unavailable(format!("the record batch was not written: {e}; retry"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SQLite file's drop counts are added on the logs' own connection, not the pool's: they
    /// are written while a transaction holds each of the pool's connections (on the pool's
    /// path the flush would wait out the acquire timeout and fail), and they add up as the
    /// pool's upsert does: counts summed, the first sighting kept, the last one the delta's.
    #[tokio::test]
    async fn a_sqlite_files_drop_counts_are_added_on_the_logs_own_connection() {
        use crate::domain::trigger::DropReason;
        use sea_orm::TransactionTrait;
        let (_dir, store, path) = crate::store::sqlite_file().await;
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(
                store
                    .connection()
                    .begin()
                    .await
                    .expect("a pooled connection"),
            );
        }
        assert!(
            store.connection().begin().await.is_err(),
            "every connection of the pool is held"
        );
        let report = |r: &str, count: i64, first_seen: i64, last_seen: i64| DropReport {
            pack_id: "p".into(),
            r#ref: r.into(),
            reason: DropReason::UndeclaredRef,
            count,
            first_seen,
            last_seen,
        };
        let tables = store.delivery_tables();
        tables
            .add_drop_counts(&[report("a", 2, 10, 20)])
            .await
            .expect("written beside a pool with no connection free");
        tables
            .add_drop_counts(&[report("a", 3, 15, 30), report("b", 1, 40, 40)])
            .await
            .expect("added");
        drop(held);
        let conn = Connection::open(&path).expect("the file");
        let mut read = conn
            .prepare("SELECT \"ref\", reason, count, first_seen, last_seen FROM drop_reports ORDER BY \"ref\"")
            .expect("a read");
        let rows: Vec<(String, String, i64, i64, i64)> = read
            .query_map([], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
            })
            .expect("rows")
            .collect::<std::result::Result<_, _>>()
            .expect("each row");
        let why = DropReason::UndeclaredRef.as_str().to_owned();
        assert_eq!(
            rows,
            vec![
                ("a".into(), why.clone(), 5, 10, 30),
                ("b".into(), why, 1, 40, 40)
            ]
        );
        // An in-memory database has no file to share: the pool runs the same upsert.
        let memory = crate::store::Store::connect(
            &crate::config::Config::for_database("sqlite::memory:").database,
        )
        .await
        .expect("an in-memory store");
        memory.migrate_up().await.expect("the schema");
        let tables = memory.delivery_tables();
        tables
            .add_drop_counts(&[report("a", 2, 10, 20)])
            .await
            .expect("added");
        tables
            .add_drop_counts(&[report("a", 3, 15, 30), report("b", 1, 40, 40)])
            .await
            .expect("added");
        let listed: Vec<(String, i64, i64, i64)> = memory
            .record_tables()
            .list_drop_reports(None, None, None, 10)
            .await
            .expect("listed")
            .into_iter()
            .map(|d| (d.r#ref, d.count, d.first_seen, d.last_seen))
            .collect();
        assert_eq!(
            listed,
            vec![("a".into(), 5, 10, 30), ("b".into(), 1, 40, 40)]
        );
    }

    #[test]
    fn a_file_url_names_its_file_and_memory_has_none() {
        assert_eq!(
            file_of("sqlite:///var/lib/hcp/sense.db?mode=rwc"),
            Some(std::path::PathBuf::from("/var/lib/hcp/sense.db"))
        );
        assert_eq!(
            file_of("sqlite://sense.db"),
            Some(std::path::PathBuf::from("sense.db"))
        );
        assert_eq!(file_of("sqlite::memory:"), None);
        assert_eq!(file_of("sqlite://x.db?mode=memory"), None);
    }

    /// Runs a prepared look-up with a bound LIMIT (as the pool's `.one()` makes), a bound LIKE
    /// pattern and a partial index's key ten times with new values; how often SQLite re-planned it.
    fn re_plans(conn: &Connection) -> i32 {
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS records (pack_id TEXT NOT NULL, trigger_id TEXT, v TEXT);
             CREATE UNIQUE INDEX IF NOT EXISTS records_trigger ON records (pack_id, trigger_id)
               WHERE trigger_id IS NOT NULL;",
        )
        .expect("schema");
        let mut s = conn
            .prepare(
                "SELECT v FROM records WHERE pack_id = ?1 AND trigger_id = ?2 \
                 AND v LIKE ?3 LIMIT ?4",
            )
            .expect("prepared");
        for i in 0..10 {
            let found = s
                .query_map(
                    rusqlite::params!["pack", format!("t{i}"), format!("{i}%"), i + 1],
                    |row| row.get::<_, String>(0),
                )
                .expect("ran")
                .count();
            assert_eq!(found, 0);
        }
        s.get_status(rusqlite::StatementStatus::RePrepare)
    }

    /// The build's SQLite keeps a statement's plan whatever is bound (`.cargo/config.toml`):
    /// without the guarantee every run of such a look-up is a new parse and plan.
    #[test]
    fn a_prepared_statement_is_not_re_planned_for_new_values() {
        use rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG as QPSG;
        let conn = Connection::open_in_memory().expect("in-memory SQLite");
        assert!(
            conn.db_config(QPSG).expect("read"),
            "the query planner stability guarantee is off: is SQLITE_ENABLE_QPSG in LIBSQLITE3_FLAGS?"
        );
        assert_eq!(re_plans(&conn), 0, "re-planned for new bound values");
        // The check can see a re-plan: with the guarantee off for this connection, it does.
        let off = Connection::open_in_memory().expect("in-memory SQLite");
        off.set_db_config(QPSG, false).expect("set");
        assert!(
            re_plans(&off) >= 9,
            "without the guarantee each new LIMIT re-plans"
        );
    }
}
