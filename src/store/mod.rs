//! The store: every SQL the service runs, behind one type, on SQLite or PostgreSQL.

/// The PostgreSQL channel on which replicas say that records committed; no payload.
macro_rules! records_channel {
    () => {
        "hcp_sense_records"
    };
}
pub const RECORDS_CHANNEL: &str = records_channel!();

mod answers;
pub mod audit;
pub mod changes;
pub mod decisions;
pub mod entity;
mod ingress;
pub use ingress::{LedgerKey, LedgerState};
mod nodelay;
mod packs;
pub mod partitions;
mod policy;
pub(crate) mod quota;
mod records;
mod resume;
mod sink;
mod sqlite_reader;
mod sqlite_writer;

pub use records::{Lands, Listed, RecordCursor};
pub use sink::{Sink, Stored, Written, MAX_BATCH};

use sea_orm::sqlx;
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DatabaseTransaction, DbBackend,
    DbErr, RuntimeErr, SqlErr, TransactionTrait,
};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::config::StoreConfig;
use crate::domain::pack::schema::TriggerTypes;
use crate::error::Error;
use hcp_sense_migration::{Migrator, MigratorTrait};
use secrecy::ExposeSecret;

/// Longest a PostgreSQL session may sit in a transaction waiting for this service.
const IDLE_IN_TRANSACTION: &str = "10s";

/// A pooled PostgreSQL connection idle for longer is pinged before it is used.
const PING_AFTER_IDLE: Duration = Duration::from_secs(1);

/// Longest an idle PostgreSQL connection may take to answer a ping before it is replaced.
const IDLE_PING: Duration = Duration::from_millis(500);

/// The service's database. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Store {
    db: DatabaseConnection,
    /// PostgreSQL: the listings' pool (LISTING_SETTINGS); None on SQLite.
    listing: Option<DatabaseConnection>,
    /// SQLite allows one writer; a transaction that reads and then writes would
    /// fail with SQLITE_BUSY when another one wrote first. Writers take turns
    /// here instead. PostgreSQL uses row locks and leaves this unused.
    write_turn: Arc<tokio::sync::Mutex<()>>,
    config: StoreConfig,
    commits: Arc<Commits>,
    /// Each pack's trigger types compiled from its manifest, by the manifest's digest: a pack's
    /// payload schemas are compiled once per version, however often its policy is reloaded.
    trigger_types: Arc<std::sync::Mutex<TriggerTypesByPack>>,
    /// SQLite (a file): the logs' own connection (the decision log's entries and the drop
    /// counts), opened at its first write, which writes each flush in one transaction on a
    /// blocking thread (see `sqlite_writer`, `Store::on_log_connection`).
    log_writer: Arc<std::sync::Mutex<Option<sqlite_writer::SqliteWriter>>>,
    /// Whether the URL names a SQLite file, the logs' own connection's: read once, not at
    /// every flush (parsing the URL costs more than a small flush's statements).
    log_file: bool,
    /// SQLite (a file): connections that read a trigger id's first record on the caller's
    /// thread (see `sqlite_reader`).
    readers: Arc<sqlite_reader::SqliteReaders>,
    /// PostgreSQL: first records read lately for their trigger ids, each confirmed by the
    /// ledger before it answers a retry (see `answers`).
    answers: Arc<answers::Answers>,
}

/// By pack: the digest of the manifest its trigger types were compiled from, and them.
type TriggerTypesByPack = std::collections::HashMap<String, ([u8; 32], Arc<TriggerTypes>)>;

/// Wake-ups for the watch tail: records committed through this process, or announced by
/// another replica. Each only says "read again"; what was written is read by position.
#[derive(Debug, Default)]
pub struct Commits {
    pub local: tokio::sync::Notify,
    pub remote: tokio::sync::Notify,
    /// Erasures made here or announced by another replica, for the watch tail to apply to
    /// the records it holds; it takes them on its next wake-up.
    pub erasures: std::sync::Mutex<Vec<crate::domain::model::Erasure>>,
    /// Set when the listener subscribes again: announcements (erasures among them) may have
    /// been missed meanwhile, so the tail starts its ring afresh from the store.
    pub resync: std::sync::atomic::AtomicBool,
}

impl Commits {
    /// Hands an erasure to the watch tail and wakes it.
    pub fn erased(&self, e: crate::domain::model::Erasure) {
        self.erasures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(e);
        self.remote.notify_one();
    }

    /// The erasures not yet applied.
    pub fn take_erasures(&self) -> Vec<crate::domain::model::Erasure> {
        std::mem::take(
            &mut *self
                .erasures
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

/// A SQLite store in a file, with its schema, and the file's path (the store's tests).
#[cfg(test)]
pub(crate) async fn sqlite_file() -> (tempfile::TempDir, Store, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("a directory");
    let path = dir.path().join("store.db");
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let config = crate::config::Config::for_database(url);
    let store = Store::connect(&config.database).await.expect("a store");
    store.migrate_up().await.expect("the schema");
    (dir, store, path)
}

/// Declares a part of the store's surface: the one connection, with the statements on one
/// capability's tables as its methods. `Deref` reaches what the connection itself answers
/// (its engine, the write turn, commits, audit rows), never another part's statements.
macro_rules! part {
    ($(#[$doc:meta])* $name:ident, $make:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug)]
        pub struct $name(Store);

        impl std::ops::Deref for $name {
            type Target = Store;
            fn deref(&self) -> &Store {
                &self.0
            }
        }

        impl Store {
            pub fn $make(&self) -> $name {
                $name(self.clone())
            }
        }
    };
}

part!(
    /// Delivery's part: records written by the sink, a trigger id's first record, drop
    /// counts, quota leases, and Binding changes (which may write a `binding.degraded` record
    /// in the same transaction).
    DeliveryTables,
    delivery_tables
);
part!(
    /// Policy's part: packs, grants, activation, Bindings as policy reads them, project
    /// members, the Execute-state mirror, quotas, the audit log, and the changes other
    /// replicas announce.
    PolicyTables,
    policy_tables
);
part!(
    /// Records' part: listing, tailing, erasing and pruning records, and the drop reports.
    RecordTables,
    record_tables
);
part!(
    /// The decision log's part: its entries appended, listed, erased and pruned.
    DecisionTables,
    decision_tables
);
part!(
    /// Ingress's part: routes and the ledger of deliveries seen.
    IngressTables,
    ingress_tables
);

/// Which engine a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Sqlite,
    Postgres,
}

impl Engine {
    pub fn of_url(url: &str) -> Option<Engine> {
        if url.starts_with("sqlite:") {
            Some(Engine::Sqlite)
        } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            Some(Engine::Postgres)
        } else {
            None
        }
    }
}

/// The migrations applied by a newer release (this binary does not know them), by name.
fn newer_migrations(status: &[MigrationState]) -> Vec<&str> {
    status
        .iter()
        .filter(|m| !m.known)
        .map(|m| m.name.as_str())
        .collect()
}

/// A migration and whether it has been applied.
#[derive(Debug, Clone)]
pub struct MigrationState {
    pub name: String,
    pub applied: bool,
    /// False for a migration applied by a newer release that this binary does not have.
    pub known: bool,
}

impl Store {
    /// Opens a pool. SQLite files are created when missing and run in WAL mode
    /// with full fsync, so an acknowledged write survives a crash.
    pub async fn connect(cfg: &StoreConfig) -> Result<Store, Error> {
        let engine = Engine::of_url(cfg.url.expose_secret()).ok_or_else(|| {
            Error::invalid(
                "database_url",
                "must start with sqlite:// or postgres:// (postgresql://)",
            )
        })?;
        let mut url = cfg.url.expose_secret().to_owned();
        if engine == Engine::Sqlite && !url.contains("mode=") {
            url.push(if url.contains('?') { '&' } else { '?' });
            url.push_str("mode=rwc");
        }
        let mut opts = ConnectOptions::new(url.clone());
        opts.sqlx_logging(false)
            .connect_timeout(Duration::from_secs(5))
            .acquire_timeout(Duration::from_secs(2));
        match engine {
            Engine::Sqlite => {
                opts.max_connections(cfg.max_connections.unwrap_or(4))
                    .map_sqlx_sqlite_opts(|o| {
                        o.journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                            .synchronous(sqlx::sqlite::SqliteSynchronous::Full)
                            .busy_timeout(Duration::from_secs(5))
                    });
            }
            Engine::Postgres => {
                opts = postgres_options(&url, cfg.max_connections.unwrap_or(8), None);
            }
        }
        let db = Database::connect(opts).await.map_err(classify)?;
        // Listings and the watch tail on PostgreSQL: a pool of their own whose sessions read
        // partitions in position order on each statement's generic plan (see `listing`),
        // opened as it is first used, or ahead by `warm`.
        let listing = match engine {
            Engine::Sqlite => None,
            Engine::Postgres => {
                let max = (cfg.max_connections.unwrap_or(8) / 2).max(2);
                let mut o = postgres_options(&url, max, Some(LISTING_SETTINGS));
                o.connect_lazy(true);
                Some(Database::connect(o).await.map_err(classify)?)
            }
        };
        Ok(Store {
            db,
            listing,
            write_turn: Arc::default(),
            config: cfg.clone(),
            commits: Arc::default(),
            trigger_types: Arc::default(),
            log_writer: Arc::default(),
            log_file: engine == Engine::Sqlite && sqlite_writer::SqliteWriter::has_file(&url),
            readers: Arc::new(match engine {
                Engine::Sqlite => sqlite_reader::SqliteReaders::of_url(&url),
                Engine::Postgres => sqlite_reader::SqliteReaders::default(),
            }),
            answers: Arc::default(),
        })
    }

    /// SQLite (a file): runs `write` on the logs' own connection, on a blocking thread, under
    /// the store's write turn: one hand-off for a flush, its statements prepared once, where
    /// the pool hands each statement (BEGIN, each insert, COMMIT) to its connection's thread
    /// and back. None for an in-memory database (the pool's alone) or when the connection does
    /// not open (the pool writes instead). After a failure the connection is closed; the next
    /// flush opens another.
    pub(super) async fn on_log_connection<F>(&self, write: F) -> Option<crate::error::Result<()>>
    where
        F: FnOnce(&mut sqlite_writer::SqliteWriter) -> crate::error::Result<()> + Send + 'static,
    {
        use secrecy::ExposeSecret;
        if !self.log_file {
            return None;
        }
        let url = self.config.url.clone();
        let slot = self.log_writer.clone();
        let turn = self.write_turn.clone().lock_owned().await;
        let written = tokio::task::spawn_blocking(move || {
            let _turn = turn;
            let mut w = slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if w.is_none() {
                match sqlite_writer::SqliteWriter::open(url.expose_secret()) {
                    Ok(Some(opened)) => *w = Some(opened),
                    Ok(None) => return None,
                    Err(e) => {
                        tracing::debug!(error = %e, "the logs' SQLite connection did not open; they write through the pool");
                        return None;
                    }
                }
            }
            let written = write(w.as_mut()?);
            if written.is_err() {
                *w = None;
            }
            Some(written)
        })
        .await;
        match written {
            Ok(w) => w,
            Err(e) => Some(Err(Error::internal_from("a log's write did not finish", e))),
        }
    }

    pub fn engine(&self) -> Engine {
        match self.db.get_database_backend() {
            DbBackend::Sqlite => Engine::Sqlite,
            _ => Engine::Postgres,
        }
    }

    /// Applies every pending migration. Migrations a newer release applied are left alone
    /// (they are additive), so a previous release can still migrate and serve during a rollout
    /// or after a rollback, as long as it has every migration of its own applied or to apply.
    pub async fn migrate_up(&self) -> Result<(), Error> {
        let status = self.migration_status().await?;
        let newer = newer_migrations(&status);
        if newer.is_empty() {
            return Migrator::up(&self.db, None).await.map_err(classify);
        }
        let pending: Vec<&str> = status
            .iter()
            .filter(|m| m.known && !m.applied)
            .map(|m| m.name.as_str())
            .collect();
        if pending.is_empty() {
            tracing::warn!(newer = ?newer, "the database has migrations of a newer release; nothing to apply");
            Ok(())
        } else {
            Err(Error::FailedPrecondition(format!(
                "the database has migrations of a newer release ({}) but lacks {}: it was not migrated by a release of this line",
                newer.join(", "),
                pending.join(", ")
            )))
        }
    }

    /// Reverts the latest applied migration, one step. Refused when a newer release applied
    /// migrations this binary does not know: its own down steps cannot undo theirs.
    pub async fn migrate_down_one(&self) -> Result<Option<String>, Error> {
        let status = self.migration_status().await?;
        let newer = newer_migrations(&status);
        if !newer.is_empty() {
            return Err(Error::FailedPrecondition(format!(
                "the database has migrations of a newer release ({}): revert them with that release",
                newer.join(", ")
            )));
        }
        let latest = status
            .iter()
            .rev()
            .find(|m| m.applied)
            .map(|m| m.name.clone());
        if latest.is_some() {
            Migrator::down(&self.db, Some(1)).await.map_err(classify)?;
        }
        Ok(latest)
    }

    /// Every migration this binary knows and whether it is applied, then those applied that
    /// it does not know (from a newer release).
    pub async fn migration_status(&self) -> Result<Vec<MigrationState>, Error> {
        let applied = self.applied_migrations().await?;
        let mut out: Vec<MigrationState> = Migrator::migrations()
            .iter()
            .map(|m| MigrationState {
                name: m.name().to_owned(),
                applied: applied.iter().any(|a| a == m.name()),
                known: true,
            })
            .collect();
        for name in applied {
            if !out.iter().any(|m| m.name == name) {
                out.push(MigrationState {
                    name,
                    applied: true,
                    known: false,
                });
            }
        }
        Ok(out)
    }

    /// The versions recorded in sea-orm's migration table (none before the first migration).
    async fn applied_migrations(&self) -> Result<Vec<String>, Error> {
        let manager = hcp_sense_migration::SchemaManager::new(&self.db);
        if !manager
            .has_table("seaql_migrations")
            .await
            .map_err(classify)?
        {
            return Ok(Vec::new());
        }
        let rows = self
            .db
            .query_all_raw(sea_orm::Statement::from_string(
                self.db.get_database_backend(),
                "SELECT version FROM seaql_migrations ORDER BY version",
            ))
            .await
            .map_err(classify)?;
        rows.iter()
            .map(|r| r.try_get::<String>("", "version").map_err(classify))
            .collect()
    }

    /// Checks that the database answers.
    pub async fn ping(&self) -> Result<(), Error> {
        self.db.ping().await.map_err(classify)
    }

    pub async fn close(self) {
        self.readers.close();
        if let Some(listing) = self.listing {
            let _ = listing.close().await;
        }
        let _ = self.db.close().await;
    }

    /// The connection listings and the watch tail read through: on PostgreSQL the listing
    /// pool, whose sessions merge the partitions' position indexes on a generic plan kept
    /// with each prepared statement; on SQLite the one pool.
    pub(crate) fn listing(&self) -> &DatabaseConnection {
        self.listing.as_ref().unwrap_or(&self.db)
    }

    /// A store on a pool of its own with one connection, sharing this store's
    /// writer turn: for a writer that runs on a runtime of its own.
    pub async fn dedicated(&self) -> Result<Store, Error> {
        let mut s = Store::connect(&StoreConfig {
            max_connections: Some(1),
            ..self.config.clone()
        })
        .await?;
        s.write_turn = self.write_turn.clone();
        s.commits = self.commits.clone();
        Ok(s)
    }

    /// PostgreSQL: opens every session of the listing pool now, in the background, at once;
    /// they are kept open after (see `postgres_options`). A read that finds its pool's sessions
    /// busy otherwise waits while a new one is opened — a TCP connect, a TLS handshake when the
    /// server offers TLS (sslmode `prefer`, the default), authentication and the session's
    /// settings: on a busy two-core machine about 100 ms with TLS and 10 ms without. The watch
    /// tail reads through this pool, and waited that long, with every record committed
    /// meanwhile, each time a watch's catch-up read held the one session open. (The main pool
    /// grows as calls need it and keeps what it grew to.)
    pub fn warm(&self) {
        let Some(listing) = &self.listing else {
            return;
        };
        let pool = listing.get_postgres_connection_pool().clone();
        tokio::spawn(async move {
            let n = pool.options().get_max_connections();
            let opened = futures_util::future::join_all((0..n).map(|_| pool.acquire())).await;
            if let Some(Err(e)) = opened.into_iter().find(Result::is_err) {
                tracing::debug!(error = %e, "a listing session could not be opened ahead");
            }
        });
    }

    /// Begins a write transaction; on SQLite it first waits its turn among writers.
    pub(crate) async fn begin_write(&self) -> Result<WriteTxn, Error> {
        let turn = match self.engine() {
            Engine::Sqlite => Some(self.write_turn.clone().lock_owned().await),
            Engine::Postgres => None,
        };
        let txn = self.db.begin().await.map_err(classify)?;
        Ok(WriteTxn { txn, _turn: turn })
    }

    /// Begins a write that reads a Binding and then writes it: on PostgreSQL it first takes a
    /// transaction-scoped advisory lock on the (principal, pack) key, so two replicas writing
    /// the same Binding take turns even when no row exists yet to lock. (Ids hold no control
    /// characters, so the newline joining the two keys is unambiguous.)
    pub(crate) async fn begin_binding_write(
        &self,
        principal: &str,
        pack_id: &str,
    ) -> Result<WriteTxn, Error> {
        let w = self.begin_write().await?;
        if self.engine() == Engine::Postgres {
            w.txn
                .execute_raw(sea_orm::Statement::from_sql_and_values(
                    DbBackend::Postgres,
                    "SELECT pg_advisory_xact_lock($1, hashtext($2))",
                    [
                        BINDING_LOCK.into(),
                        format!("{principal}\n{pack_id}").into(),
                    ],
                ))
                .await
                .map_err(classify)?;
        }
        Ok(w)
    }

    pub fn connection(&self) -> &DatabaseConnection {
        &self.db
    }

    /// The wake-ups of record commits, shared by every clone of this store.
    pub fn commits(&self) -> &Commits {
        &self.commits
    }

    /// Tells the other replicas' watch tails that records committed here (PostgreSQL).
    pub async fn announce_records(&self) -> Result<(), Error> {
        if self.engine() == Engine::Postgres {
            // The channel as a literal: a pool connection's announcement reads apart, in
            // pg_stat_activity, from the listener's heartbeat. Through sqlx itself, as the
            // record look-up (`records::from_sqlx`): sea-orm's future cost an announcement
            // about 70,000 instructions, most of them copying the future, up to 50 a second.
            sea_orm::sqlx::query(concat!("SELECT pg_notify('", records_channel!(), "', '')"))
                .execute(self.db.get_postgres_connection_pool())
                .await
                .map_err(records::from_sqlx)?;
        }
        Ok(())
    }
}

/// A write transaction, holding the SQLite writer's turn until it ends.
pub(crate) struct WriteTxn {
    pub txn: DatabaseTransaction,
    _turn: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl WriteTxn {
    pub async fn commit(self) -> Result<(), Error> {
        self.txn.commit().await.map_err(classify)
    }

    /// Commits, telling the other replicas that a pack's policy changed: on
    /// PostgreSQL a NOTIFY in this transaction, delivered only if it commits.
    pub async fn commit_announcing(self, pack_id: &str) -> Result<(), Error> {
        if self.txn.get_database_backend() == DbBackend::Postgres {
            self.txn
                .execute_raw(sea_orm::Statement::from_sql_and_values(
                    DbBackend::Postgres,
                    "SELECT pg_notify($1, $2)",
                    [POLICY_CHANNEL.into(), pack_id.into()],
                ))
                .await
                .map_err(classify)?;
        }
        self.commit().await
    }
}

/// The PostgreSQL channel of policy changes; the payload is the pack id.
pub const POLICY_CHANNEL: &str = "hcp_sense_policy";

/// The advisory lock class of Binding writes ("hcpb"); the second key is the Binding's hash.
const BINDING_LOCK: i32 = 0x6863_7062;

/// SQLite multi-row inserts go in chunks of a power of two rows, at most `max`: a table then
/// has a handful of statements, each prepared once and kept in the connection's statement
/// cache, where a statement per batch size would be prepared afresh on most batches.
pub(crate) struct SqliteInserts {
    /// The insert of 1, 2, 4, ... `max` rows.
    statements: Vec<String>,
}

impl SqliteInserts {
    /// `{head} VALUES (?, ...), ... {tail}` with `columns` placeholders a row.
    pub(crate) fn new(head: &str, columns: usize, tail: &str, max: usize) -> SqliteInserts {
        debug_assert!(max.is_power_of_two());
        let row = format!("({})", vec!["?"; columns].join(","));
        let statements = (0..=max.trailing_zeros())
            .map(|k| {
                format!(
                    "{head} VALUES {} {tail}",
                    vec![row.as_str(); 1 << k].join(",")
                )
            })
            .collect();
        SqliteInserts { statements }
    }

    /// The rows the next chunk of `rest` takes: the largest power of two not over `rest` or
    /// the most a statement holds.
    pub(crate) fn chunk(&self, rest: usize) -> usize {
        let max = 1usize << (self.statements.len() - 1);
        1usize << (usize::BITS - 1 - rest.clamp(1, max).leading_zeros())
    }

    /// The insert of `rows` rows, a size `chunk` gave.
    pub(crate) fn statement(&self, rows: usize) -> &str {
        &self.statements[rows.trailing_zeros() as usize]
    }
}

/// A value a row lends SQLite's writer connection (`sqlite_writer`), owned for the pool's
/// path (an in-memory database), which binds the same columns in the same order.
pub(crate) fn owned_value(v: rusqlite::types::ValueRef<'_>) -> sea_orm::Value {
    use rusqlite::types::ValueRef as V;
    match v {
        V::Integer(n) => n.into(),
        V::Text(t) => String::from_utf8_lossy(t).into_owned().into(),
        // The rows lend only integers, text and NULL.
        _ => sea_orm::Value::String(None),
    }
}

/// Gives a record its receive time and id as it is written. The time is data, not order:
/// a record's place in listings is its position, which the store assigns in commit order.
pub(crate) fn stamp(r: &mut crate::domain::model::Record) {
    r.received_time = now_micros();
    r.record_id = uuid::Uuid::now_v7().to_string();
}

/// Microseconds since the Unix epoch, the unit of every time column.
pub fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Sorts a database error into the service's errors: an unreachable database is
/// `Unavailable` (retry), a unique violation `AlreadyExists`, the rest `Internal`.
pub(crate) fn classify(e: DbErr) -> Error {
    if let Some(SqlErr::UniqueConstraintViolation(m)) = e.sql_err() {
        return Error::AlreadyExists(m);
    }
    let unavailable = match &e {
        DbErr::ConnectionAcquire(_) | DbErr::Conn(_) => true,
        DbErr::Exec(RuntimeErr::SqlxError(s)) | DbErr::Query(RuntimeErr::SqlxError(s)) => {
            is_unavailable(s)
        }
        _ => false,
    };
    if unavailable {
        tracing::warn!(error = %e, "store unavailable");
        Error::Unavailable("the store is unavailable; retry later".into())
    } else {
        tracing::error!(error = %e, "store error");
        Error::internal_from("store error", e)
    }
}

/// The SQLSTATE of a database error, when it is one.
pub(crate) fn sqlstate(e: &DbErr) -> Option<String> {
    match e {
        DbErr::Exec(RuntimeErr::SqlxError(s)) | DbErr::Query(RuntimeErr::SqlxError(s)) => {
            match s.as_ref() {
                sqlx::Error::Database(d) => d.code().map(|c| c.into_owned()),
                _ => None,
            }
        }
        _ => None,
    }
}

fn is_unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(d) => {
            // PostgreSQL: class 08 (connection), 57P0x (shutdown), 53 (resources);
            // SQLite: BUSY (5) and LOCKED (6) after the busy timeout.
            let code = d.code().unwrap_or_default();
            code.starts_with("08")
                || code.starts_with("57P")
                || code.starts_with("53")
                || code == "5"
                || code == "6"
        }
        _ => false,
    }
}

/// The settings of the listing pool's sessions. The planner reads partitions in position
/// order, each partition's position index merged: left to its estimates it may append every
/// partition's rows after a cursor and sort them (cheap on paper when positions it cannot tell
/// apart, records from before positions all at transaction 0, make it expect a handful; seconds
/// a page on millions of them). And each statement runs on its generic plan, made once per
/// session and kept with the prepared statement until the partitions change: planning a page
/// over every partition cost 6–8 ms against about 1 ms to read it at 30 partitions.
/// Set with SET on each new session (not in the startup packet's `options`, which a pooler
/// such as PgBouncer drops), so they hold behind a session-mode pool too.
const LISTING_SETTINGS: &str = "SET enable_sort = off; SET plan_cache_mode = force_generic_plan";

/// A PostgreSQL pool's options: `max` connections, each new session running `session` first.
fn postgres_options(url: &str, max: u32, session: Option<&'static str>) -> ConnectOptions {
    let mut opts = ConnectOptions::new(url.to_owned());
    opts.sqlx_logging(false)
        .connect_timeout(Duration::from_secs(5))
        .acquire_timeout(Duration::from_secs(2));
    // A session left in a transaction by a client gone silent holds its locks and,
    // for listings, the visibility horizon; PostgreSQL ends it after this long.
    opts.map_sqlx_postgres_opts(|o| {
        o.options([("idle_in_transaction_session_timeout", IDLE_IN_TRANSACTION)])
    });
    let port = <sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(url)
        .map(|o| o.get_port())
        .unwrap_or(5432);
    // Every session is kept once opened (see `Store::warm`): the pool's reaper opens a new
    // one in the background for each it retires past its lifetime.
    opts.max_connections(max)
        .min_connections(max)
        .map_sqlx_postgres_pool_opts(move |o| {
            let o = o.after_connect(move |conn, _| {
                Box::pin(async move {
                    // A scan of every descriptor: off the async workers.
                    let _ =
                        tokio::task::spawn_blocking(move || nodelay::set_on_sockets_to(port)).await;
                    if let Some(sql) = session {
                        sqlx::Executor::execute(&mut *conn, sql).await?;
                    }
                    Ok(())
                })
            });
            // Ping an idle connection before use, as sqlx does by default, but give
            // up on it after IDLE_PING rather than at the acquire timeout: after a
            // failover every idle connection is silent, and each would otherwise
            // cost a whole acquire timeout before a new one is opened.
            // A connection used within the last PING_AFTER_IDLE is taken as is: the
            // sink's writers reuse theirs hundreds of times a second, and a ping
            // would add a round trip to every batch.
            o.test_before_acquire(false).before_acquire(|conn, meta| {
                Box::pin(async move {
                    use sqlx::Connection;
                    if meta.idle_for < PING_AFTER_IDLE {
                        return Ok(true);
                    }
                    // An error (not `false`) has sqlx drop the connection at once
                    // instead of closing it politely over the silent socket.
                    match tokio::time::timeout(IDLE_PING, conn.ping()).await {
                        Ok(r) => r.map(|()| true),
                        Err(_) => Err(sqlx::Error::PoolTimedOut),
                    }
                })
            })
        });
    opts
}
