//! The committer's view of a write transaction: every insert and removal also goes into the
//! group's `Mutations`, which become its group log record (see `store::group_log`), and the
//! replay that applies such records to redb again at open.
//!
//! `LTable` derefs to redb's table for reading but has its own `insert`/`remove`: redb's
//! mutating methods need `&mut Table`, which `Deref` does not give, so a write that bypasses
//! the log does not compile.

use std::borrow::Borrow;
use std::cell::RefCell;
use std::ops::Deref;

use redb::{AccessGuard, Key, StorageError, Table, TableDefinition, TableHandle, Value};

use super::*;
use crate::store::group_log::{Mutation, Mutations, Record};

/// Every table's number in the group log. Append only: numbers are on disk.
const TABLE_IDS: [&str; 23] = [
    "meta",
    "events",
    "dedup",
    "entries",
    "live",
    "dlq",
    "dlq_by_event",
    "targets",
    "pending_gc",
    "target_state",
    "held_keys",
    "jobs",
    "handler_kv",
    "handler_kv_exp",
    "handler_kv_usage",
    "handler_completed",
    "handler_completed_exp",
    "dedup_log",
    "dedup_run_keys",
    "dedup_runs",
    "dlq_by_target",
    "dedup_kept",
    "held_by",
];

fn table_id(name: &str) -> u8 {
    TABLE_IDS
        .iter()
        .position(|t| *t == name)
        .and_then(|i| u8::try_from(i).ok())
        // Every table is listed (a unit test opens each); an unlisted one would be a bug
        // caught there, not a runtime condition.
        .unwrap_or(u8::MAX)
}

/// A write transaction whose writes are recorded in `log` (when there is one).
pub(super) struct Tx<'a> {
    pub(super) txn: &'a WriteTransaction,
    pub(super) log: Option<&'a RefCell<Mutations>>,
}

impl<'a> Tx<'a> {
    /// A transaction whose writes are not logged (recovery, stores without a group log).
    pub(super) fn unlogged(txn: &'a WriteTransaction) -> Self {
        Self { txn, log: None }
    }

    pub(super) fn open_table<K: Key + 'static, V: Value + 'static>(
        &self,
        def: TableDefinition<'static, K, V>,
    ) -> Result<LTable<'a, K, V>, redb::TableError> {
        Ok(LTable {
            table: self.txn.open_table(def)?,
            id: table_id(def.name()),
            log: self.log,
        })
    }
}

/// A table of a `Tx`: reads go to redb's table, writes are also logged.
pub(super) struct LTable<'a, K: Key + 'static, V: Value + 'static> {
    table: Table<'a, K, V>,
    id: u8,
    log: Option<&'a RefCell<Mutations>>,
}

impl<'a, K: Key + 'static, V: Value + 'static> Deref for LTable<'a, K, V> {
    type Target = Table<'a, K, V>;
    fn deref(&self) -> &Self::Target {
        &self.table
    }
}

impl<K: Key + 'static, V: Value + 'static> LTable<'_, K, V> {
    pub(super) fn insert<'k, 'v>(
        &mut self,
        key: impl Borrow<K::SelfType<'k>>,
        value: impl Borrow<V::SelfType<'v>>,
    ) -> Result<Option<AccessGuard<'_, V>>, StorageError> {
        if let Some(log) = self.log {
            log.borrow_mut().put(
                self.id,
                K::as_bytes(key.borrow()).as_ref(),
                V::as_bytes(value.borrow()).as_ref(),
            );
        }
        self.table.insert(key, value)
    }

    pub(super) fn remove<'k>(
        &mut self,
        key: impl Borrow<K::SelfType<'k>>,
    ) -> Result<Option<AccessGuard<'_, V>>, StorageError> {
        let old = self.table.remove(key.borrow())?;
        // Removing what is not there changes nothing: nothing to log.
        if old.is_some()
            && let Some(log) = self.log
        {
            log.borrow_mut()
                .del(self.id, K::as_bytes(key.borrow()).as_ref());
        }
        Ok(old)
    }
}

/// Applies `records` with a sequence number above `after` in `txn`; returns the last one
/// applied (`after` if none).
pub(super) fn replay(
    txn: &WriteTransaction,
    records: &[Record<'_>],
    after: u64,
) -> Result<u64, StoreError> {
    let mut last = after;
    let mut t = AllTables::open(txn)?;
    for r in records.iter().filter(|r| r.seq > after) {
        // `records` are consecutive; a first one past `after + 1` means groups are missing
        // (the store file is older than the log): refuse rather than lose them silently.
        if r.seq == last && last > after {
            return Err(StoreError::Corrupt {
                table: "group log",
                message: format!("group {last} is in both log files"),
            });
        }
        if r.seq != last + 1 {
            return Err(StoreError::Corrupt {
                table: "group log",
                message: format!(
                    "the store holds groups up to {last} but the log continues at {}",
                    r.seq
                ),
            });
        }
        for m in r.mutations()? {
            t.apply(&m)?;
        }
        last = r.seq;
    }
    Ok(last)
}

/// Every table, open for replay (opening a table per mutation would cost more than the write).
struct AllTables<'a> {
    txn: &'a WriteTransaction,
    meta: Table<'a, &'static str, &'static [u8]>,
    events: Table<'a, u64, &'static [u8]>,
    /// Format 2's dedup table, opened only for a log written by such a build (opening it
    /// would create it, and recovery would then migrate an empty table at every start).
    old_dedup: Option<Table<'a, &'static str, (u64, i64)>>,
    entries: Table<'a, (u64, u32), &'static [u8]>,
    live: Table<'a, (u64, u32), ()>,
    dlq: Table<'a, u64, &'static [u8]>,
    dlq_by_event: Table<'a, (u64, u64), ()>,
    targets: Table<'a, &'static str, &'static [u8]>,
    pending_gc: Table<'a, u64, ()>,
    target_state: Table<'a, &'static str, &'static [u8]>,
    held: Table<'a, (&'static str, &'static str), ()>,
    held_by: Table<'a, (&'static str, &'static str), u64>,
    jobs: Table<'a, &'static str, &'static [u8]>,
    kv: Table<'a, (&'static str, &'static str), (i64, &'static [u8])>,
    kv_exp: Table<'a, (i64, &'static str, &'static str), ()>,
    kv_usage: Table<'a, &'static str, (u64, u64)>,
    completed: Table<'a, (&'static str, &'static str), (i64, &'static [u8])>,
    completed_exp: Table<'a, (i64, &'static str, &'static str), ()>,
    dedup_log: Table<'a, u64, (u128, i64)>,
    dedup_run_keys: Table<'a, (u64, u128, u64), i64>,
    dedup_runs: Table<'a, u64, &'static [u8]>,
    dlq_by_target: Table<'a, (&'static str, u64), ()>,
    dedup_kept: Table<'a, (u128, u64), ()>,
}

fn put<K: Key + 'static, V: Value + 'static>(
    t: &mut Table<'_, K, V>,
    m: &Mutation<'_>,
) -> Result<(), StorageError> {
    match *m {
        Mutation::Put { key, value, .. } => {
            t.insert(K::from_bytes(key), V::from_bytes(value))?;
        }
        Mutation::Del { key, .. } => {
            t.remove(K::from_bytes(key))?;
        }
    }
    Ok(())
}

impl<'a> AllTables<'a> {
    fn open(txn: &'a WriteTransaction) -> Result<Self, StoreError> {
        Ok(Self {
            txn,
            meta: txn.open_table(META)?,
            events: txn.open_table(EVENTS)?,
            old_dedup: None,
            entries: txn.open_table(ENTRIES)?,
            live: txn.open_table(LIVE)?,
            dlq: txn.open_table(DLQ)?,
            dlq_by_event: txn.open_table(DLQ_BY_EVENT)?,
            targets: txn.open_table(TARGETS)?,
            pending_gc: txn.open_table(PENDING_GC)?,
            target_state: txn.open_table(TARGET_STATE)?,
            held: txn.open_table(HELD)?,
            held_by: txn.open_table(HELD_BY)?,
            jobs: txn.open_table(JOBS)?,
            kv: txn.open_table(KV)?,
            kv_exp: txn.open_table(KV_EXP)?,
            kv_usage: txn.open_table(KV_USAGE)?,
            completed: txn.open_table(COMPLETED)?,
            completed_exp: txn.open_table(COMPLETED_EXP)?,
            dedup_log: txn.open_table(DEDUP_LOG)?,
            dedup_run_keys: txn.open_table(DEDUP_RUN_KEYS)?,
            dedup_runs: txn.open_table(DEDUP_RUNS)?,
            dlq_by_target: txn.open_table(DLQ_BY_TARGET)?,
            dedup_kept: txn.open_table(DEDUP_KEPT)?,
        })
    }

    fn apply(&mut self, m: &Mutation<'_>) -> Result<(), StoreError> {
        let table = match *m {
            Mutation::Put { table, .. } | Mutation::Del { table, .. } => table,
        };
        match table {
            0 => put(&mut self.meta, m)?,
            1 => put(&mut self.events, m)?,
            2 => {
                let t = match &mut self.old_dedup {
                    Some(t) => t,
                    None => self.old_dedup.insert(self.txn.open_table(OLD_DEDUP)?),
                };
                put(t, m)?;
            }
            3 => put(&mut self.entries, m)?,
            4 => put(&mut self.live, m)?,
            5 => put(&mut self.dlq, m)?,
            6 => put(&mut self.dlq_by_event, m)?,
            7 => put(&mut self.targets, m)?,
            8 => put(&mut self.pending_gc, m)?,
            9 => put(&mut self.target_state, m)?,
            10 => put(&mut self.held, m)?,
            11 => put(&mut self.jobs, m)?,
            12 => put(&mut self.kv, m)?,
            13 => put(&mut self.kv_exp, m)?,
            14 => put(&mut self.kv_usage, m)?,
            15 => put(&mut self.completed, m)?,
            16 => put(&mut self.completed_exp, m)?,
            17 => put(&mut self.dedup_log, m)?,
            18 => put(&mut self.dedup_run_keys, m)?,
            19 => put(&mut self.dedup_runs, m)?,
            20 => put(&mut self.dlq_by_target, m)?,
            21 => put(&mut self.dedup_kept, m)?,
            22 => put(&mut self.held_by, m)?,
            other => {
                return Err(StoreError::Corrupt {
                    table: "group log",
                    message: format!("unknown table number {other}"),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_table_has_a_number_and_replay_opens_it_under_that_number() {
        let names = [
            META.name(),
            EVENTS.name(),
            OLD_DEDUP.name(),
            ENTRIES.name(),
            LIVE.name(),
            DLQ.name(),
            DLQ_BY_EVENT.name(),
            TARGETS.name(),
            PENDING_GC.name(),
            TARGET_STATE.name(),
            HELD.name(),
            JOBS.name(),
            KV.name(),
            KV_EXP.name(),
            KV_USAGE.name(),
            COMPLETED.name(),
            COMPLETED_EXP.name(),
            DEDUP_LOG.name(),
            DEDUP_RUN_KEYS.name(),
            DEDUP_RUNS.name(),
            DLQ_BY_TARGET.name(),
            DEDUP_KEPT.name(),
            HELD_BY.name(),
        ];
        // The order of `AllTables::apply`'s arms.
        for (i, n) in names.iter().enumerate() {
            assert_eq!(usize::from(table_id(n)), i, "{n}");
        }
    }

    #[test]
    fn replayed_writes_reproduce_the_logged_state() {
        let db = redb::Database::builder()
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .expect("db");
        let log = RefCell::new(Mutations::default());
        let txn = db.begin_write().expect("txn");
        {
            let tx = Tx {
                txn: &txn,
                log: Some(&log),
            };
            let mut kv = tx.open_table(KV).expect("kv");
            kv.insert(("ns", "a"), (5i64, b"one".as_slice()))
                .expect("put");
            kv.insert(("ns", "b"), (i64::MAX, b"two".as_slice()))
                .expect("put");
            kv.remove(("ns", "a")).expect("del");
            kv.remove(("ns", "never")).expect("del");
            let mut e = tx.open_table(ENTRIES).expect("entries");
            e.insert((7u64, 2u32), b"entry".as_slice()).expect("put");
        }
        txn.abort().expect("abort");
        let record = log.borrow().record(1);
        let records = crate::store::group_log::records(&record);
        assert_eq!(records.len(), 1);
        // Three puts and one removal: removing an absent key is not logged.
        assert_eq!(records[0].mutations().expect("decode").len(), 4);

        let txn = db.begin_write().expect("txn");
        assert_eq!(replay(&txn, &records, 0).expect("replay"), 1);
        txn.commit().expect("commit");
        let r = db.begin_read().expect("read");
        let kv = r.open_table(KV).expect("kv");
        assert!(kv.get(("ns", "a")).expect("get").is_none());
        let b = kv.get(("ns", "b")).expect("get").expect("b");
        assert_eq!(b.value(), (i64::MAX, b"two".as_slice()));
        let e = r.open_table(ENTRIES).expect("entries");
        assert_eq!(
            e.get((7u64, 2u32)).expect("get").expect("entry").value(),
            b"entry"
        );
        // Records at or below the durable state's sequence number are skipped.
        let txn = db.begin_write().expect("txn");
        assert_eq!(replay(&txn, &records, 1).expect("replay"), 1);
    }
}
