//! The partitions of PostgreSQL's `records` and `decisions`: made ahead, made at once when a write finds none, dropped whole when retention passes them, and the trigger ledger's rows swept after records'.
//!
//! A partition `records_<lower>_<upper>` holds the records the database stored in
//! [lower, upper), microseconds of its own clock (`stored_time`); `decisions_<lower>_<upper>`
//! the decision log's entries written then (`decided_time`). docs/partitions.md says why.
use sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};

use super::{classify, Engine, RecordTables, Store};
use crate::error::Result;

/// Partitions made ahead of the database's clock, besides the one it is in.
pub const AHEAD: i64 = 2;

/// Longest a partition's DDL waits for a lock before giving up until the next pass: making one
/// queues behind a long listing, and every write would queue behind it.
const DDL_LOCK_TIMEOUT: &str = "2s";

/// Longest the summary of the stored-time index waits for a partition's lock: vacuum holds
/// it while it runs (and summarizes as well), and is cancelled by a waiter held past
/// `deadlock_timeout` (1 s by default).
const SUMMARY_LOCK_TIMEOUT: &str = "200ms";

/// What a pass did to the records' stored-time index (see `Store::summarize_stored_time`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Summarized {
    /// Ranges of pages summarized.
    pub ranges: u64,
    /// Partitions whose index had `autosummarize` on and now has it off.
    pub set_off: u64,
    /// Steps that gave way to a lock held, left to the next pass.
    pub deferred: u64,
}

/// A step of the pass that did not run now: giving way to a lock is the design (debug); any
/// other failure is worth an operator's eye.
fn gave_way(leaf: &str, e: &sea_orm::DbErr) {
    if super::sqlstate(e).as_deref() == Some(LOCK_NOT_AVAILABLE) {
        tracing::debug!(index = %leaf, "a stored-time index step gave way to a lock; next pass");
    } else {
        tracing::warn!(index = %leaf, error = %e, "a stored-time index step failed; next pass");
    }
}

/// SQLSTATE of a lock not taken within `lock_timeout`.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// Longest setting an index's option waits for its lock, which excludes every write to the
/// partition while it waits: a moment, once per partition made before this release.
const ALTER_LOCK_TIMEOUT: &str = "100ms";

/// The database's clock, in microseconds: the one `stored_time` is written in.
const DB_NOW: &str = "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS now";

/// SQLSTATE of a row that fits no partition.
pub(crate) const NO_PARTITION: &str = "23514";

/// A table partitioned by the database's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parted {
    Records,
    Decisions,
}

impl Parted {
    pub const ALL: [Parted; 2] = [Parted::Records, Parted::Decisions];

    pub fn table(self) -> &'static str {
        match self {
            Parted::Records => "records",
            Parted::Decisions => "decisions",
        }
    }
}

/// An attached partition's range, in microseconds of the database's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Partition {
    pub lower: i64,
    pub upper: i64,
}

impl Partition {
    fn name(&self, of: Parted) -> String {
        format!("{}_{}_{}", of.table(), self.lower, self.upper)
    }

    /// The range a table named by `name` holds, when it is one of `of`'s.
    fn parse(of: Parted, name: &str) -> Option<Partition> {
        let (lower, upper) = name
            .strip_prefix(of.table())?
            .strip_prefix('_')?
            .split_once('_')?;
        let (lower, upper) = (lower.parse().ok()?, upper.parse().ok()?);
        (lower < upper).then_some(Partition { lower, upper })
    }
}

/// The range to make so that `t` has a partition: the width-aligned one around it, cut back
/// where it would overlap a partition that exists. None when `t` already has one.
pub fn range_for(t: i64, width: i64, existing: &[Partition]) -> Option<Partition> {
    if existing.iter().any(|p| p.lower <= t && t < p.upper) {
        return None;
    }
    let lower = t.div_euclid(width) * width;
    let upper = lower.saturating_add(width);
    let lower = existing
        .iter()
        .map(|p| p.upper)
        .filter(|u| *u <= t)
        .fold(lower, i64::max);
    let upper = existing
        .iter()
        .map(|p| p.lower)
        .filter(|l| *l > t)
        .fold(upper, i64::min);
    Some(Partition { lower, upper })
}

/// What one retention pass did to the partitions.
#[derive(Debug, Default, Clone, Copy)]
pub struct Dropped {
    pub partitions: u64,
    pub records: u64,
    /// SQL statements the drops took.
    pub statements: u64,
}

impl Store {
    /// True when records are partitioned: PostgreSQL.
    pub fn partitioned(&self) -> bool {
        self.engine() == Engine::Postgres
    }

    /// The partition width, in microseconds.
    pub fn partition_width(&self) -> i64 {
        i64::try_from(self.config.partition_width.as_micros())
            .unwrap_or(i64::MAX)
            .max(1_000_000)
    }

    /// The database's clock, in microseconds.
    pub async fn db_now(&self) -> Result<i64> {
        let row = self
            .db
            .query_one_raw(Statement::from_string(DbBackend::Postgres, DB_NOW))
            .await
            .map_err(classify)?;
        row.map(|r| r.try_get::<i64>("", "now"))
            .transpose()
            .map_err(classify)?
            .ok_or_else(|| crate::error::Error::internal("no clock"))
    }

    /// The partitions attached to `records`, oldest first.
    pub async fn partitions(&self) -> Result<Vec<Partition>> {
        self.partitions_of(Parted::Records).await
    }

    /// The partitions attached to `of`, oldest first.
    pub async fn partitions_of(&self, of: Parted) -> Result<Vec<Partition>> {
        let rows = self
            .db
            .query_all_raw(Statement::from_string(
                DbBackend::Postgres,
                format!(
                    "SELECT c.relname::text AS name FROM pg_inherits i \
                     JOIN pg_class c ON c.oid = i.inhrelid \
                     WHERE i.inhparent = '{}'::regclass AND NOT i.inhdetachpending",
                    of.table()
                ),
            ))
            .await
            .map_err(classify)?;
        let mut out: Vec<Partition> = rows
            .iter()
            .filter_map(|r| r.try_get::<String>("", "name").ok())
            .filter_map(|n| Partition::parse(of, &n))
            .collect();
        out.sort_by_key(|p| p.lower);
        Ok(out)
    }

    /// Makes the partition that `t` (the database's clock) falls in, when it has none. Made
    /// apart and then attached: attaching locks `records` only against other DDL, where
    /// `CREATE … PARTITION OF` would lock out every write while it waited.
    async fn cover(&self, of: Parted, t: i64, existing: &mut Vec<Partition>) -> Result<bool> {
        let Some(p) = range_for(t, self.partition_width(), existing) else {
            return Ok(false);
        };
        let name = p.name(of);
        let table = of.table();
        let made = async {
            let txn = self.db.begin().await?;
            let mut ddl = vec![
                format!("SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'"),
                format!("CREATE TABLE IF NOT EXISTS {name} (LIKE {table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"),
            ];
            if of == Parted::Records {
                // Attaching adopts this index as the partition's own of `idx_records_stored`;
                // left to the attach, it would take the parent's `autosummarize = on`
                // (`Store::summarize_stored_time` says why it is off).
                ddl.push(format!(
                    "CREATE INDEX IF NOT EXISTS {name}_stored_time_idx ON {name} \
                     USING brin (stored_time) WITH (autosummarize = off)"
                ));
            }
            ddl.push(format!(
                "ALTER TABLE {table} ATTACH PARTITION {name} FOR VALUES FROM ({}) TO ({})",
                p.lower, p.upper
            ));
            for sql in ddl {
                txn.execute_unprepared(&sql).await?;
            }
            txn.commit().await
        };
        if let Err(e) = made.await {
            // Another replica may have made it (or an overlapping one) first.
            *existing = self.partitions_of(of).await?;
            if range_for(t, self.partition_width(), existing).is_none() {
                return Ok(false);
            }
            return Err(classify(e));
        }
        tracing::info!(partition = %name, "made a partition");
        existing.push(p);
        existing.sort_by_key(|p| p.lower);
        Ok(true)
    }

    /// Makes the partitions of every partitioned table for now and AHEAD widths after,
    /// where missing. Returns how many.
    pub async fn make_partitions_ahead(&self) -> Result<u64> {
        if !self.partitioned() {
            return Ok(0);
        }
        let now = self.db_now().await?;
        let mut made = 0;
        for of in Parted::ALL {
            let mut existing = self.partitions_of(of).await?;
            for k in 0..=AHEAD {
                let t = now.saturating_add(k.saturating_mul(self.partition_width()));
                made += u64::from(self.cover(of, t, &mut existing).await?);
            }
        }
        Ok(made)
    }

    /// The stored-time index of every records partition, one partition at a time: sets
    /// `autosummarize` off where it is on (a partition made before this release, or by an
    /// older replica, which takes the parent's option), then summarizes its new ranges of
    /// pages, so that retention's trim reads a few pages, not every page written since the
    /// last vacuum. Each step is a short transaction of its own that waits briefly for its
    /// lock and gives way (to a vacuum, which summarizes too, or to a long read): what it
    /// could not reach now is counted in `deferred` and tried again by the next pass.
    ///
    /// Why off: with it on, each filled range queues an autovacuum work item; the queue holds
    /// 256 and is taken once per `autovacuum_naptime`, and PostgreSQL logs a line for every
    /// request it cannot queue, which a flood makes by the hundred.
    pub async fn summarize_stored_time(&self) -> Result<Summarized> {
        let mut done = Summarized::default();
        if !self.partitioned() {
            return Ok(done);
        }
        let leaves = self
            .db
            .query_all_raw(Statement::from_string(
                DbBackend::Postgres,
                "SELECT i.inhrelid::regclass::text AS leaf, \
                        coalesce('autosummarize=off' = ANY (c.reloptions), false) AS off \
                 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
                 WHERE i.inhparent = 'idx_records_stored'::regclass",
            ))
            .await
            .map_err(classify)?;
        for row in leaves {
            let leaf: String = row.try_get("", "leaf").map_err(classify)?;
            let off: bool = row.try_get("", "off").map_err(classify)?;
            // Apart from the summary: the option's lock keeps writes out of the partition
            // while it is held, the summary's does not.
            if !off {
                // `leaf` is regclass's own text, quoted as an identifier where it needs it.
                let alter = format!("ALTER INDEX {leaf} SET (autosummarize = off)");
                match self.briefly(ALTER_LOCK_TIMEOUT, &alter, None).await {
                    Ok(_) => done.set_off += 1,
                    Err(e) => {
                        done.deferred += 1;
                        gave_way(&leaf, &e);
                        continue;
                    }
                }
            }
            let summarize = "SELECT brin_summarize_new_values($1::regclass)::bigint AS n";
            match self
                .briefly(SUMMARY_LOCK_TIMEOUT, summarize, Some(leaf.clone()))
                .await
            {
                Ok(n) => done.ranges += u64::try_from(n).unwrap_or(0),
                Err(e) => {
                    done.deferred += 1;
                    gave_way(&leaf, &e);
                }
            }
        }
        Ok(done)
    }

    /// Runs `sql` (with `leaf` as `$1` when given) in a transaction of its own that waits at
    /// most `timeout` for a lock; its `n` when it answers one.
    async fn briefly(
        &self,
        timeout: &str,
        sql: &str,
        leaf: Option<String>,
    ) -> std::result::Result<i64, sea_orm::DbErr> {
        let txn = self.db.begin().await?;
        txn.execute_unprepared(&format!("SET LOCAL lock_timeout = '{timeout}'"))
            .await?;
        let n = match leaf {
            Some(leaf) => txn
                .query_one_raw(Statement::from_sql_and_values(
                    DbBackend::Postgres,
                    sql,
                    [leaf.into()],
                ))
                .await?
                .map(|r| r.try_get::<i64>("", "n"))
                .transpose()?
                .unwrap_or(0),
            None => {
                txn.execute_unprepared(sql).await?;
                0
            }
        };
        txn.commit().await?;
        Ok(n)
    }

    /// After a write found no partition for its row: makes the one for the database's clock
    /// now (the row's time, or a moment after it, which is where the retry goes).
    pub(crate) async fn repair_partition(&self) -> Result<()> {
        let now = self.db_now().await?;
        for of in Parted::ALL {
            let mut existing = self.partitions_of(of).await?;
            if self.cover(of, now, &mut existing).await? {
                tracing::warn!(
                    table = of.table(),
                    "a write found no partition for now; made it"
                );
            }
        }
        Ok(())
    }
}

impl RecordTables {
    /// Drops every partition whose records are all older than `cutoff` (the database's
    /// clock): raises the ledger's floor past it (its trigger ids may be taken again), detaches
    /// it concurrently (writers never wait) and drops it. Also finishes a detach a crash
    /// interrupted. O(partitions) statements, whatever the records in them.
    pub async fn drop_partitions_before(&self, cutoff: i64) -> Result<Dropped> {
        let mut done = Dropped::default();
        for name in self.detached_leftovers(Parted::Records).await? {
            self.finish_detached(Parted::Records, &name, &mut done)
                .await?;
        }
        for p in self.partitions().await? {
            if p.upper > cutoff {
                break;
            }
            let name = p.name(Parted::Records);
            self.db
                .execute_raw(Statement::from_sql_and_values(
                    DbBackend::Postgres,
                    "UPDATE record_floor SET floor_time = greatest(floor_time, $1)",
                    [p.upper.into()],
                ))
                .await
                .map_err(classify)?;
            self.db
                .execute_unprepared(&format!(
                    "ALTER TABLE records DETACH PARTITION {name} CONCURRENTLY"
                ))
                .await
                .map_err(classify)?;
            done.statements += 2;
            self.finish_detached(Parted::Records, &name, &mut done)
                .await?;
            tracing::info!(partition = %name, "dropped a records partition past retention");
        }
        Ok(done)
    }

    /// Drops every partition of the decision log whose entries are all older than `cutoff`
    /// (the database's clock), and then, when the rest hold more than `max_entries` by the
    /// planner's count, the oldest of them until they do not — never the partition of `now`
    /// or one ahead of it. Detached concurrently; finishes a detach a crash interrupted.
    /// `records` counts the entries dropped.
    pub async fn drop_decision_partitions(
        &self,
        cutoff: Option<i64>,
        max_entries: Option<u64>,
        now: i64,
    ) -> Result<Dropped> {
        let of = Parted::Decisions;
        let mut done = Dropped::default();
        for name in self.detached_leftovers(of).await? {
            self.finish_detached(of, &name, &mut done).await?;
        }
        let parts = self.partitions_of(of).await?;
        let mut kept = Vec::new();
        for p in parts {
            if cutoff.is_some_and(|c| p.upper <= c) {
                self.drop_decision_partition(p, &mut done).await?;
            } else {
                kept.push(p);
            }
        }
        let Some(max) = max_entries else {
            return Ok(done);
        };
        // Newest first: what fits under the bound stays, the older rest goes.
        let mut held = 0u64;
        let mut over = false;
        for p in kept.into_iter().rev() {
            if over && p.upper <= now {
                self.drop_decision_partition(p, &mut done).await?;
                continue;
            }
            held = held.saturating_add(self.planned_rows(&p.name(of)).await?);
            over = held > max;
        }
        Ok(done)
    }

    async fn drop_decision_partition(&self, p: Partition, done: &mut Dropped) -> Result<()> {
        let name = p.name(Parted::Decisions);
        self.db
            .execute_unprepared(&format!(
                "ALTER TABLE decisions DETACH PARTITION {name} CONCURRENTLY"
            ))
            .await
            .map_err(classify)?;
        done.statements += 1;
        self.finish_detached(Parted::Decisions, &name, done).await?;
        tracing::info!(partition = %name, "dropped a decision log partition");
        Ok(())
    }

    /// The planner's count of a table's rows (0 when it was never analyzed).
    async fn planned_rows(&self, name: &str) -> Result<u64> {
        let n = self
            .db
            .query_one_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "SELECT greatest(c.reltuples, 0)::bigint AS n FROM pg_class c \
                 WHERE c.relname = $1 AND pg_table_is_visible(c.oid)",
                [name.into()],
            ))
            .await
            .map_err(classify)?
            .map(|r| r.try_get::<i64>("", "n"))
            .transpose()
            .map_err(classify)?
            .unwrap_or(0);
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// Our partitions no longer attached (a drop interrupted after its detach), or whose
    /// concurrent detach was interrupted.
    async fn detached_leftovers(&self, of: Parted) -> Result<Vec<String>> {
        let rows = self
            .db
            .query_all_raw(Statement::from_string(
                DbBackend::Postgres,
                format!(
                    "SELECT c.relname::text AS name FROM pg_class c \
                     LEFT JOIN pg_inherits i ON i.inhrelid = c.oid \
                     WHERE c.relkind = 'r' AND c.relname ~ '^{}_[0-9]+_[0-9]+$' \
                       AND pg_table_is_visible(c.oid) \
                       AND (i.inhrelid IS NULL OR i.inhdetachpending)",
                    of.table()
                ),
            ))
            .await
            .map_err(classify)?;
        Ok(rows
            .iter()
            .filter_map(|r| r.try_get::<String>("", "name").ok())
            .filter(|n| Partition::parse(of, n).is_some())
            .collect())
    }

    /// Counts a detached partition's records and drops it; finalizes the detach first when
    /// a crash left it pending.
    async fn finish_detached(&self, of: Parted, name: &str, done: &mut Dropped) -> Result<()> {
        let pending = self
            .db
            .query_one_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "SELECT EXISTS (SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
                 WHERE c.relname = $1 AND i.inhdetachpending) AS pending",
                [name.into()],
            ))
            .await
            .map_err(classify)?
            .map(|r| r.try_get::<bool>("", "pending"))
            .transpose()
            .map_err(classify)?
            .unwrap_or(false);
        if pending {
            self.db
                .execute_unprepared(&format!(
                    "ALTER TABLE {} DETACH PARTITION {name} FINALIZE",
                    of.table()
                ))
                .await
                .map_err(classify)?;
            done.statements += 1;
        }
        // The planner's count of its rows, kept by autovacuum's ANALYZE (exact after VACUUM
        // and close otherwise): counting them would read the partition whole, and with nine
        // of a million rows that read cost the writers a tenth of their rate. Counted exactly
        // only when the partition was never analyzed.
        let count = self
            .db
            .query_one_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                format!(
                    "SELECT CASE WHEN c.reltuples >= 0 THEN c.reltuples::bigint \
                            ELSE (SELECT count(*) FROM {name}) END AS n \
                     FROM pg_class c WHERE c.relname = $1 AND pg_table_is_visible(c.oid)"
                ),
                [name.into()],
            ))
            .await
            .map_err(classify)?
            .map(|r| r.try_get::<i64>("", "n"))
            .transpose()
            .map_err(classify)?
            .unwrap_or(0);
        self.db
            .execute_unprepared(&format!("DROP TABLE {name}"))
            .await
            .map_err(classify)?;
        done.statements += 2;
        done.partitions += 1;
        done.records += u64::try_from(count).unwrap_or(0);
        Ok(())
    }

    /// The ledger's size in pages (the last one may still be filling).
    pub async fn ledger_pages(&self) -> Result<i64> {
        let row = self
            .db
            .query_one_raw(Statement::from_string(
                DbBackend::Postgres,
                "SELECT (pg_relation_size('record_triggers') / current_setting('block_size')::bigint)::bigint AS pages",
            ))
            .await
            .map_err(classify)?;
        row.map(|r| r.try_get::<i64>("", "pages"))
            .transpose()
            .map_err(classify)
            .map(Option::unwrap_or_default)
    }

    /// Deletes the ledger rows below the floor (their records' partitions are gone) on pages
    /// [from, to); returns how many. A TID range scan reads those pages and nothing else, so
    /// the ledger needs no index on stored time, which every keyed insert would pay for.
    pub async fn sweep_ledger_pages(&self, from: i64, to: i64) -> Result<u64> {
        let done = self
            .db
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "DELETE FROM record_triggers \
                 WHERE ctid >= ('(' || $1::bigint || ',0)')::tid \
                   AND ctid < ('(' || $2::bigint || ',0)')::tid \
                   AND stored_time < (SELECT floor_time FROM record_floor)",
                [from.into(), to.into()],
            ))
            .await
            .map_err(classify)?;
        Ok(done.rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: i64 = 100;

    fn p(lower: i64, upper: i64) -> Partition {
        Partition { lower, upper }
    }

    #[test]
    fn a_time_with_a_partition_needs_none() {
        assert_eq!(range_for(150, W, &[p(100, 200)]), None);
        assert_eq!(range_for(100, W, &[p(100, 200)]), None);
    }

    #[test]
    fn a_missing_partition_is_the_aligned_one() {
        assert_eq!(range_for(250, W, &[p(100, 200)]), Some(p(200, 300)));
        assert_eq!(range_for(200, W, &[]), Some(p(200, 300)));
        assert_eq!(range_for(-1, W, &[]), Some(p(-100, 0)));
    }

    #[test]
    fn a_missing_partition_is_cut_back_to_its_neighbours() {
        // A partition of another width ends mid-way: the new one starts where it ends.
        assert_eq!(range_for(270, W, &[p(100, 250)]), Some(p(250, 300)));
        // And one starting mid-way ends the new one there.
        assert_eq!(range_for(210, W, &[p(240, 400)]), Some(p(200, 240)));
        assert_eq!(
            range_for(245, W, &[p(0, 240), p(260, 400)]),
            Some(p(240, 260))
        );
    }

    #[test]
    fn only_our_names_parse() {
        let r = Parted::Records;
        assert_eq!(Partition::parse(r, "records_100_200"), Some(p(100, 200)));
        assert_eq!(Partition::parse(r, "records_200_100"), None);
        assert_eq!(Partition::parse(r, "records_unpartitioned"), None);
        assert_eq!(Partition::parse(r, "record_triggers"), None);
        assert_eq!(Partition::parse(r, "decisions_100_200"), None);
        let d = Parted::Decisions;
        assert_eq!(Partition::parse(d, "decisions_100_200"), Some(p(100, 200)));
        assert_eq!(Partition::parse(d, "records_100_200"), None);
    }
}
