//! SQLite (a file): a trigger id's first record read on connections of the store's own, on the caller's thread, instead of a hand-off to the pool's connection thread and back.
//!
//! A retry (a trigger id this replica recorded lately) and a dropped trigger that carries an
//! id are each answered after this read, so it is on the path of every webhook and NATS
//! retry. Through the pool it cost two thread wake-ups (the connection's worker, then the
//! caller again) and sea-orm's statement building; here it is one prepared look-up of the
//! unique (pack, trigger id) index and one row. It runs where the caller is because a WAL
//! reader never waits for the writer: the read takes tens of microseconds. Its connections
//! wait for no lock (busy timeout zero): in the rare moment a reader cannot start (another
//! connection resetting the WAL), or when a connection does not open, the answer is None and
//! the caller reads through the pool, which waits as every other read does.
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use rusqlite::{Connection, OpenFlags, OptionalExtension};

use super::entity::records;

/// Connections kept between reads: as many as threads read at once, which is the runtime's
/// workers. More are opened when needed and closed after their read.
const KEPT: usize = 8;

const FIRST_RECORD: &str = concat!(
    "SELECT ",
    records::columns!(),
    " FROM records WHERE pack_id = ?1 AND producer_trigger_id = ?2"
);

#[derive(Default)]
pub struct SqliteReaders {
    /// The database file; None for PostgreSQL or an in-memory database (the pool reads).
    file: Option<PathBuf>,
    idle: Mutex<Vec<Connection>>,
}

impl std::fmt::Debug for SqliteReaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteReaders")
            .field("file", &self.file)
            .finish_non_exhaustive()
    }
}

impl SqliteReaders {
    /// Readers of the file a SQLite URL names.
    pub fn of_url(url: &str) -> SqliteReaders {
        SqliteReaders {
            file: super::sqlite_writer::file_of(url),
            idle: Mutex::default(),
        }
    }

    fn idle(&self) -> MutexGuard<'_, Vec<Connection>> {
        // A push or a pop: a panic cannot leave it half-done.
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The first record stored for a pack's trigger id (Some(None): there is none), or None
    /// when this read cannot answer and the pool must.
    pub fn record_for_trigger(
        &self,
        pack_id: &str,
        trigger_id: &str,
    ) -> Option<Option<records::Model>> {
        let file = self.file.as_ref()?;
        let idle = self.idle().pop();
        let conn = match idle {
            Some(c) => c,
            None => match open(file) {
                Ok(c) => c,
                Err(e) => {
                    tracing::debug!(error = %e, "a SQLite reader did not open; reading through the pool");
                    return None;
                }
            },
        };
        match first_record(&conn, pack_id, trigger_id) {
            Ok(found) => {
                let mut idle = self.idle();
                if idle.len() < KEPT {
                    idle.push(conn);
                }
                Some(found)
            }
            Err(e) => {
                // The connection is closed; the next read opens another.
                tracing::debug!(error = %e, "a SQLite reader did not answer; reading through the pool");
                None
            }
        }
    }

    /// Closes the connections kept.
    pub fn close(&self) {
        self.idle().clear();
    }
}

fn open(file: &std::path::Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open_with_flags(
        file,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    // rusqlite's default waits five seconds for a lock; a reader on the caller's thread must
    // not, so it gives the read to the pool instead.
    conn.busy_timeout(Duration::ZERO)?;
    conn.execute_batch("PRAGMA query_only = ON")?;
    conn.set_prepared_statement_cache_capacity(2);
    Ok(conn)
}

fn first_record(
    conn: &Connection,
    pack_id: &str,
    trigger_id: &str,
) -> rusqlite::Result<Option<records::Model>> {
    conn.prepare_cached(FIRST_RECORD)?
        .query_row([pack_id, trigger_id], |r| Ok(records::from_row!(r.get)))
        .optional()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(trigger_id: &str, project: Option<&str>) -> records::Model {
        records::Model {
            record_id: format!("rec-{trigger_id}"),
            principal: "alice".into(),
            binding_id: "b-1".into(),
            land: "inbox".into(),
            pack_id: "github".into(),
            r#ref: "issue.opened".into(),
            payload: r#"{"n":1}"#.into(),
            route: "inbox".into(),
            project: project.map(str::to_owned),
            producer_trigger_id: Some(trigger_id.into()),
            received_time: 7,
            commit_txid: 0,
            seq: 3,
        }
    }

    fn insert(w: &Connection, m: &records::Model) {
        w.execute(
            "INSERT INTO records VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
            rusqlite::params![
                m.record_id,
                m.principal,
                m.binding_id,
                m.land,
                m.pack_id,
                m.r#ref,
                m.payload,
                m.route,
                m.project,
                m.producer_trigger_id,
                m.received_time,
                m.commit_txid,
                m.seq
            ],
        )
        .expect("insert");
    }

    /// A WAL file with the records table's columns, and a writer connection on it.
    fn file() -> (tempfile::TempDir, String, Connection) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("hcp-sense.db");
        let w = Connection::open(&path).expect("open");
        w.execute_batch(
            "PRAGMA journal_mode = WAL;
             CREATE TABLE records (record_id TEXT PRIMARY KEY, principal TEXT, binding_id TEXT,
               land TEXT, pack_id TEXT, \"ref\" TEXT, payload TEXT, route TEXT, project TEXT,
               producer_trigger_id TEXT, received_time INTEGER, commit_txid INTEGER, seq INTEGER);
             CREATE UNIQUE INDEX uq ON records (pack_id, producer_trigger_id);",
        )
        .expect("schema");
        let url = format!("sqlite://{}?mode=rwc", path.display());
        (dir, url, w)
    }

    #[test]
    fn a_trigger_ids_first_record_is_read_on_a_connection_kept_for_the_next_read() {
        let (_dir, url, w) = file();
        let readers = SqliteReaders::of_url(&url);
        insert(&w, &model("t-1", Some("p")));
        assert_eq!(
            readers.record_for_trigger("github", "t-1"),
            Some(Some(model("t-1", Some("p"))))
        );
        assert_eq!(readers.record_for_trigger("github", "t-2"), Some(None));
        assert_eq!(readers.record_for_trigger("gitlab", "t-1"), Some(None));
        assert_eq!(readers.idle().len(), 1, "one connection, kept");
        // A commit of another connection is seen by the next read on the kept one.
        insert(&w, &model("t-2", None));
        assert_eq!(
            readers.record_for_trigger("github", "t-2"),
            Some(Some(model("t-2", None)))
        );
        // The reader never writes.
        let kept = readers.idle().pop().expect("kept");
        assert!(kept.execute("DELETE FROM records", []).is_err());
    }

    #[test]
    fn a_writer_holding_the_file_does_not_hold_a_read() {
        let (_dir, url, w) = file();
        insert(&w, &model("t-1", None));
        let readers = SqliteReaders::of_url(&url);
        w.execute_batch("BEGIN IMMEDIATE; DELETE FROM records;")
            .expect("a write under way");
        assert_eq!(
            readers.record_for_trigger("github", "t-1"),
            Some(Some(model("t-1", None))),
            "the last commit, read at once"
        );
        w.execute_batch("COMMIT").expect("commit");
        assert_eq!(readers.record_for_trigger("github", "t-1"), Some(None));
    }

    #[test]
    fn a_read_this_side_cannot_answer_goes_to_the_pool() {
        assert_eq!(
            SqliteReaders::of_url("sqlite::memory:").record_for_trigger("github", "t-1"),
            None
        );
        assert_eq!(
            SqliteReaders::default().record_for_trigger("github", "t-1"),
            None
        );
        // A file without the table: the statement fails, and the connection is not kept.
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("sqlite://{}/empty.db?mode=rwc", dir.path().display());
        Connection::open(dir.path().join("empty.db")).expect("create");
        let readers = SqliteReaders::of_url(&url);
        assert_eq!(readers.record_for_trigger("github", "t-1"), None);
        assert!(readers.idle().is_empty());
        // A file that is not there is not made.
        let gone = SqliteReaders::of_url(&format!("sqlite://{}/gone.db", dir.path().display()));
        assert_eq!(gone.record_for_trigger("github", "t-1"), None);
        assert!(!dir.path().join("gone.db").exists());
    }
}
