//! The embedded store: redb, one file, one committer thread doing group commit.
//!
//! redb allows one writer at a time, so every write (ingest accepts, leases, acks, retries,
//! sweeps) is an `Op` sent to a single committer thread, which takes everything pending,
//! applies it in one write transaction and commits it with `Durability::Immediate` (a real
//! fsync). Callers wait on a oneshot for their commit: many requests share one flush.
//!
//! What is due when lives in an in-memory index rebuilt from the `live` table at open; the
//! durable records stay the truth. Leases are recorded durably (with a fencing token and an
//! expiry) as part of starting an attempt; leases held by a dead process are reclaimed at open.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::BoxFuture;
use redb::{
    Database, Durability, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition,
    TableHandle, WriteTransaction,
};
use rustc_hash::FxHashMap;
use tokio::sync::{Notify, mpsc, oneshot};

use super::*;

const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");
/// The dedup index of format 2 and older (dedup key → (seq, accepted_at)): migrated into
/// `dedup_log` at open (see `dedup`).
const OLD_DEDUP: TableDefinition<&str, (u64, i64)> = TableDefinition::new("dedup");
/// seq → (fingerprint, accepted_at): the dedup keys not yet in a registered run (`dedup`).
const DEDUP_LOG: TableDefinition<u64, (u128, i64)> = TableDefinition::new("dedup_log");
/// (run, fingerprint, seq) → accepted_at: the dedup runs' keys.
const DEDUP_RUN_KEYS: TableDefinition<(u64, u128, u64), i64> =
    TableDefinition::new("dedup_run_keys");
/// run → `dedup::Run` record (range, key count, Bloom filter): the registered runs.
const DEDUP_RUNS: TableDefinition<u64, &[u8]> = TableDefinition::new("dedup_runs");
/// (fingerprint, seq): the dedup keys of events the sweep kept (`pending_gc`), so their fate
/// stays visible after their run is dropped. Without it one kept event (a dead letter, a
/// long-dead target's entry) held its whole run, up to a million keys, past the window.
const DEDUP_KEPT: TableDefinition<(u128, u64), ()> = TableDefinition::new("dedup_kept");
const ENTRIES: TableDefinition<(u64, u32), &[u8]> = TableDefinition::new("entries");
const LIVE: TableDefinition<(u64, u32), ()> = TableDefinition::new("live");
const DLQ: TableDefinition<u64, &[u8]> = TableDefinition::new("dlq");
const DLQ_BY_EVENT: TableDefinition<(u64, u64), ()> = TableDefinition::new("dlq_by_event");
/// (target id, or "" for an event quarantined before routing; DLQ id): the DLQ by target, so
/// listing or summarising one target's dead letters reads only theirs. Built at open when it
/// does not match the DLQ (a file from before it, or one written meanwhile by an older build).
const DLQ_BY_TARGET: TableDefinition<(&str, u64), ()> = TableDefinition::new("dlq_by_target");

/// A DLQ entry's key in `DLQ_BY_TARGET`.
fn dlq_target_key(target: Option<&str>) -> &str {
    target.unwrap_or("")
}
const TARGETS: TableDefinition<&str, &[u8]> = TableDefinition::new("targets");
const PENDING_GC: TableDefinition<u64, ()> = TableDefinition::new("pending_gc");
const TARGET_STATE: TableDefinition<&str, &[u8]> = TableDefinition::new("target_state");
const HELD: TableDefinition<(&str, &str), ()> = TableDefinition::new("held_keys");
/// (target, key) → the DLQ id of the dead letter that holds the key (the latest to hold it).
/// A redrive releases the key only with that dead letter (or once it has left the DLQ):
/// redriving an older dead letter of the key released a hold a later one had put, and the
/// key's entries overtook it. Keys held by older builds have no row here; any redrive of
/// theirs releases them, as before.
const HELD_BY: TableDefinition<(&str, &str), u64> = TableDefinition::new("held_by");
const JOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("jobs");
/// (handler, key) → (expires_at or i64::MAX, value).
const KV: TableDefinition<(&str, &str), (i64, &[u8])> = TableDefinition::new("handler_kv");
/// (expires_at, handler, key): KV entries with a TTL in expiry order, for the sweeper.
const KV_EXP: TableDefinition<(i64, &str, &str), ()> = TableDefinition::new("handler_kv_exp");
/// handler → (bytes of keys plus values, keys): each namespace's size, kept with every write,
/// which its bound (`handlers.kv_max_bytes`) is checked against, with the per-entry overhead
/// added from the key count (`KvUsage::from_counters`).
const KV_USAGE: TableDefinition<&str, (u64, u64)> = TableDefinition::new("handler_kv_usage");
/// (handler, delivery idempotency key) → (expires_at, stored result): the COMPLETED table.
const COMPLETED: TableDefinition<(&str, &str), (i64, &[u8])> =
    TableDefinition::new("handler_completed");
/// (expires_at, handler, key): COMPLETED in expiry order, for the sweeper.
const COMPLETED_EXP: TableDefinition<(i64, &str, &str), ()> =
    TableDefinition::new("handler_completed_exp");

/// Most ops applied in one transaction; more wait for the next commit.
const MAX_GROUP: usize = 4096;
/// A commit at least this slow is logged (every request in its group waited for it).
const SLOW_COMMIT: Duration = Duration::from_secs(1);
/// Most weight ([`Op::group_weight`]: accepted events, and a handler's emitted events and
/// key-value writes) in one transaction. Past it, heavy ops wait for the next commit while the
/// light ones (leases, plain acks) still join this one: a flood of large ingest batches, or of
/// handler acks each carrying a thousand key-value writes, must not stretch every commit and
/// starve delivery, whose every attempt needs two commits (eight such acks in one group made
/// a commit of 1.6 s in a debug build, every ingest request of the group waiting for it).
const MAX_GROUP_WEIGHT: usize = 1024;
/// Most weight held back by `MAX_GROUP_WEIGHT` before the committer stops draining its channel
/// (then everyone waits in the channel, which is bounded, and ingest feels the back-pressure).
const MAX_DEFERRED_WEIGHT: usize = 8 * MAX_GROUP_WEIGHT;
/// How often a database closed by a write error is reopened while nothing else is written.
const REOPEN_RETRY: Duration = Duration::from_millis(200);
/// Files smaller than this are never compacted.
const COMPACT_MIN_BYTES: u64 = 64 << 20;
/// Shortest time between two compaction checks (see `Committer::compact_next_check`).
const COMPACT_CHECK_GAP: Duration = Duration::from_secs(1);
/// Events examined per sweep call, so a sweep never holds the committer for long: a batch is
/// one commit that every ingest request of its group waits for. 2,000 made that commit take
/// hundreds of milliseconds (random dedup-key pages); 256 takes 10-17 ms here
/// (docs/BENCHMARKS.md, eleventh session).
const SWEEP_BATCH: usize = 256;
/// Key-value entries one commit removes when a handler's namespace is cleared.
const KV_CLEAR_BATCH: usize = 4096;

/// Called after every commit with its duration and the number of ops it carried.
pub type CommitObserver = Arc<dyn Fn(Duration, usize) + Send + Sync>;

/// Called after every compaction of the store file.
pub type CompactObserver = Arc<dyn Fn(&CompactionReport) + Send + Sync>;

/// Opens the database again (same file or backend): after a write error redb refuses every
/// later write until the database is reopened.
type Reopen = Arc<dyn Fn() -> Result<Database, redb::DatabaseError> + Send + Sync>;

/// The database handle, shared by readers and the committer. `None` only while the committer
/// reopens it after a write error (and stays so while reopening fails).
type DbSlot = Arc<RwLock<Option<Database>>>;

/// A read handle on the database slot, or why there is none.
enum DbRead<'a> {
    Open(std::sync::RwLockReadGuard<'a, Option<Database>>),
    /// The file is being compacted.
    Compacting,
    /// A group log write failed and the store has not reopened since: the database holds
    /// groups that were never made durable (and were answered with an error), which a reader
    /// must not see as if they were stored.
    LogFailed,
}

impl DbRead<'_> {
    fn begin_read(&self) -> Result<redb::ReadTransaction, StoreError> {
        match self {
            DbRead::Open(g) => match g.as_ref() {
                Some(db) => Ok(db.begin_read()?),
                None => Err(unavailable()),
            },
            DbRead::Compacting => Err(StoreError::Compacting),
            DbRead::LogFailed => Err(StoreError::Backend(
                "a group log write failed; the store is being reopened".into(),
            )),
        }
    }
}

/// Bytes of live data (keys, values and tree metadata) in every table, from a read
/// transaction: what a compaction would keep.
fn live_bytes(db: &DbSlot) -> Result<u64, StoreError> {
    let txn = {
        let slot = db.read().unwrap_or_else(|p| p.into_inner());
        slot.as_ref().ok_or_else(unavailable)?.begin_read()?
    };
    let mut used = 0;
    for handle in txn.list_tables()? {
        let stats = txn.open_untyped_table(handle)?.stats()?;
        used += stats.stored_bytes() + stats.metadata_bytes();
    }
    Ok(used)
}

fn unavailable() -> StoreError {
    StoreError::Backend(
        "the store is being reopened after a write error (full or failing disk)".into(),
    )
}

/// Options for opening a store.
#[derive(Clone, Default)]
pub struct StoreOptions {
    /// Observer for commit latency and group size (metrics).
    pub on_commit: Option<CommitObserver>,
    /// redb page cache size in bytes (default: redb's).
    pub cache_bytes: Option<usize>,
    /// Files smaller than this are never compacted (default 64 MiB).
    pub compact_min_bytes: Option<u64>,
    /// Observer for compactions (metrics).
    pub on_compact: Option<CompactObserver>,
    /// Make groups durable through the group log (`router.log`, see `store::group_log`)
    /// instead of a synced redb commit each. Only `open_dir` and `with_backends` have a log.
    pub group_log: bool,
    /// Longest time between checkpoints with a group log (`store.checkpoint_interval`; default
    /// `CHECKPOINT_EVERY`; tests set it long to keep groups in the log only).
    pub checkpoint_every: Option<Duration>,
    /// How often the entry floor moves (default `FLOOR_EVERY`; tests set zero, which moves it
    /// at every group over the previous group's events).
    pub floor_every: Option<Duration>,
    /// Events examined per sweep call (default `SWEEP_BATCH`; `router bench sweep --batch`
    /// compares sizes).
    pub sweep_batch: Option<usize>,
    /// Shortest time between the starts of two commits (`store.commit_delay`; zero: none).
    pub commit_delay: Duration,
    /// Keys in the dedup memtable past which it is written as a run (default
    /// `dedup::MEMTABLE_KEYS`; tests set it small to make runs).
    pub dedup_memtable_keys: Option<usize>,
    /// Memtables of fewer keys are sorted on the committer itself, larger ones on a thread of
    /// their own (default `dedup::FREEZE_INLINE_KEYS`; tests set 0 to use the thread).
    pub dedup_freeze_inline_keys: Option<usize>,
    /// The ingest dedup window (`ingest.dedup_window`). Runs of the dedup index older than it
    /// are opened without their Bloom filter, which accept no longer needs (each sweep drops
    /// the filters of runs that have aged out since). `None`: every filter is loaded at open,
    /// and only sweeps drop them.
    pub dedup_window: Option<Duration>,
}

/// The group log's files and the store file's syncs (which run behind the committer when a
/// group log makes groups durable).
struct Logged {
    files: LogFiles,
    sync: SyncHandle,
}
/// Log bytes written since the last checkpoint past which the next group is a checkpoint:
/// bounds the log file and the replay at start.
const CHECKPOINT_BYTES: u64 = 16 << 20;
/// Time since the last checkpoint past which the next group is one (the default of
/// `store.checkpoint_interval`). redb keeps the pages of unsynced commits in its write buffer
/// and writes them all at the checkpoint, which holds the committer meanwhile (the sync that
/// follows runs behind it, `store::sync_behind`): the pause grows with the interval (measured
/// with `router bench store`, syncs included: ~65 ms at 500 ms, ~14 ms at 100 ms, ~7 ms at
/// 50 ms). End to end, 50 ms doubled the p99 at half of the peak, and 10 ms did not
/// (docs/BENCHMARKS.md, twenty-sixth session).
const CHECKPOINT_EVERY: Duration = Duration::from_millis(10);

/// How often the committer moves the entry floor (`Committer::floor`) up to where the last
/// move left the newest event. Entries live that long, or longer, are written to `entries`
/// and `live`; the rest never are. The recovery at start reads the records of the events
/// above the floor: at most about two intervals' worth.
const FLOOR_EVERY: Duration = Duration::from_secs(1);

/// Most entries one group writes while moving the floor (`Committer::advance_floor`): a
/// backlog that crosses it is written a batch per group.
const FLOOR_BATCH: usize = 2048;

/// Most ready entries examined per lease (entries blocked behind their ordering key are
/// skipped; this bounds the cost of a long blocked key).
const SCAN_LIMIT: usize = 10_000;

fn enc<T: serde::Serialize>(v: &T) -> Vec<u8> {
    // Serialising our own plain structs to JSON cannot fail (no non-string map keys).
    serde_json::to_vec(v).unwrap_or_default()
}

fn dec<T: serde::de::DeserializeOwned>(table: &'static str, b: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(b).map_err(|e| StoreError::Corrupt {
        table,
        message: e.to_string(),
    })
}

/// Decodes an `entries` record (either layout, `entry_codec`); its id is the record's key.
fn dec_entry(key: (u64, u32), b: &[u8]) -> Result<QueueEntry, StoreError> {
    entry_codec::decode(key, b)
}

/// Entry `id` as it stands: its row in `entries`, or, for an event at or above `floor` whose
/// entry has not changed since acceptance, its event's fan-out (`event_record`). The flag says
/// whether it has a row of its own.
fn stored_entry(
    entries: &impl ReadableTable<(u64, u32), &'static [u8]>,
    events: &impl ReadableTable<u64, &'static [u8]>,
    floor: u64,
    id: EntryId,
) -> Result<Option<(QueueEntry, bool)>, StoreError> {
    let key = (id.event, id.idx);
    if let Some(raw) = entries.get(key)? {
        return Ok(Some((dec_entry(key, raw.value())?, true)));
    }
    if id.event < floor {
        return Ok(None);
    }
    let Some(raw) = events.get(id.event)? else {
        return Ok(None);
    };
    let rec = EventRecord::split(id.event, raw.value())?;
    rec.entry(id.idx)
        .map(|r| Ok((dec_entry(key, r)?, false)))
        .transpose()
}

/// Encodes an `entries` record in the current layout (`entry_codec`).
fn enc_entry(e: &QueueEntry) -> Vec<u8> {
    entry_codec::encode(e)
}

/// Decodes an `events` record; its sequence number is the record's key.
fn dec_event(seq: u64, b: &[u8]) -> Result<StoredEvent, StoreError> {
    let mut ev: StoredEvent = dec("events", EventRecord::split(seq, b)?.json)?;
    ev.seq = seq;
    Ok(ev)
}

/// The id, source and type a DLQ entry copies from event `seq`: empty when the event is gone
/// or its record cannot be read. The entry is written all the same (and listed: listings do
/// not read events), an unreadable event being what sends one there as `corrupt_record`.
/// The events of dedup fingerprint `fp` from sequence number `from` on that the dedup
/// index's runs `runs` hold (in the order given), each run's newest first: candidates to be
/// confirmed against the event (a fingerprint is not the key).
fn run_candidates(
    run_keys: &impl ReadableTable<(u64, u128, u64), i64>,
    runs: &[u64],
    fp: u128,
    from: u64,
) -> Result<Vec<u64>, StoreError> {
    let mut seqs = Vec::new();
    for &run in runs {
        let start = seqs.len();
        for row in run_keys.range((run, fp, from)..=(run, fp, u64::MAX))? {
            seqs.push(row?.0.value().2);
        }
        seqs[start..].reverse();
    }
    Ok(seqs)
}

/// The events of dedup fingerprint `fp` from sequence number `from` on that were kept past
/// their run (`DEDUP_KEPT`: older than every run's), newest first.
fn kept_candidates(
    kept: &impl ReadableTable<(u128, u64), ()>,
    fp: u128,
    from: u64,
) -> Result<Vec<u64>, StoreError> {
    let mut seqs = Vec::new();
    for row in kept.range((fp, from)..=(fp, u64::MAX))? {
        seqs.push(row?.0.value().1);
    }
    seqs.reverse();
    Ok(seqs)
}

fn dlq_names(
    events: &impl ReadableTable<u64, &'static [u8]>,
    seq: u64,
) -> Result<(String, String, String), StoreError> {
    Ok(match events.get(seq)? {
        Some(raw) => dec_event(seq, raw.value())
            .map(|ev| (ev.event.id, ev.event.source, ev.event.ty))
            .unwrap_or_default(),
        None => Default::default(),
    })
}

/// Whether event `seq` was quarantined at acceptance (and so never routed). Read only for a
/// duplicate: an event with a fan-out was routed, and its JSON is not decoded.
fn was_quarantined(
    events: &impl ReadableTable<u64, &'static [u8]>,
    seq: u64,
) -> Result<bool, StoreError> {
    #[derive(serde::Deserialize)]
    struct Flag {
        #[serde(default)]
        quarantined: bool,
    }
    let Some(v) = events.get(seq)? else {
        return Ok(false);
    };
    let rec = EventRecord::split(seq, v.value())?;
    if rec.entries().next().is_some() {
        return Ok(false);
    }
    Ok(dec::<Flag>("events", rec.json)?.quarantined)
}

/// How far acceptance times may step back against sequence order (a clock stepped back):
/// scans by time start this much early and end this much late.
const ACCEPT_SLACK_MS: Millis = 60_000;

/// The lowest sequence whose event was accepted at or after `at`, found by bisecting the
/// sequence space (sequences follow acceptance order, up to `ACCEPT_SLACK_MS`), so a replay of
/// last hour's events does not read the whole archive before it to find where they start.
/// Past the last event: one past its sequence.
fn first_seq_from(
    t: &impl ReadableTable<u64, &'static [u8]>,
    at: Millis,
) -> Result<u64, StoreError> {
    let (Some(first), Some(last)) = (t.first()?, t.last()?) else {
        return Ok(0);
    };
    let (mut lo, mut hi) = (first.0.value(), last.0.value().saturating_add(1));
    // Invariant: every event below `lo` was accepted before `at`; the first event at or past
    // `hi` (if any) was accepted at or after it.
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let Some(row) = t.range(mid..)?.next() else {
            hi = mid;
            continue;
        };
        let (k, v) = row?;
        let seq = k.value();
        // The first event at or past `mid` is `seq`: before `at`, everything up to it is too.
        if dec_event(seq, v.value())?.accepted_at < at {
            lo = seq.saturating_add(1);
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

/// An event to accept, reduced by the caller to what the committer writes: the `events` record
/// and each target's queue entry record already encoded (an entry record does not contain its
/// id, which the committer assigns), and the dedup key. The parsed event itself stays (and is
/// freed) on the caller's thread, so the single committer thread spends its time on the B-tree
/// and the flush, not on JSON, hashing, or freeing another thread's allocations (all three
/// measured on its profile with batched ingest).
struct Prepared {
    /// The `events` record: the event's JSON, with the fan-out of its entries that are not
    /// leased at acceptance (`event_record`).
    record: Vec<u8>,
    /// The dedup key's fingerprint (hashed here, off the committer thread).
    fp: dedup::Fp,
    accepted_at: Millis,
    dedup_window_ms: i64,
    /// `id`, `source`, `type`: what a DLQ entry names.
    names: (String, String, String),
    /// Each target with its queue entry record when leased at acceptance (written as a row of
    /// its own; empty otherwise: the event's record holds the entry), and that lease.
    targets: Vec<(NewEntry, Vec<u8>, Option<Lease>)>,
    quarantine: Option<Quarantine>,
}

/// What `accept_leased` hands back for one event with entries leased at acceptance: the event
/// (kept from what the caller gave, so the lease needs no read back) and those entries.
struct Handoff {
    /// `seq` is set once the committer has assigned it.
    event: StoredEvent,
    /// The leased entries as written (`id.event` set with `seq`).
    entries: Vec<QueueEntry>,
}

impl Prepared {
    /// The records of `ne`, its entries all queued (`lease_ms` is not looked at).
    fn new(ne: NewEvent) -> Self {
        Self::leasing(ne, None).0
    }

    /// The records of `ne`; with `tokens`, the entries whose `lease_ms` is set are leased at
    /// acceptance, each under a fresh token from `tokens`, and returned with the event.
    fn leasing(ne: NewEvent, tokens: Option<&dyn Fn() -> u64>) -> (Self, Option<Handoff>) {
        let hops = ne.event.hops();
        let at = ne.accepted_at;
        let mut handed = Vec::new();
        let (source, id) = (&ne.event.source, &ne.event.id);
        let targets = ne
            .targets
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                let key = idempotency_key(source, id, &t.target_id);
                let id = EntryId {
                    event: 0,
                    idx: u32::try_from(i).unwrap_or(u32::MAX),
                };
                let mut entry = QueueEntry::queued(id, t.clone(), key, at, at, hops);
                let lease = match (tokens, t.lease_ms) {
                    (Some(token), Some(ms)) => {
                        let lease = Lease {
                            token: token(),
                            until: at.saturating_add(ms),
                        };
                        entry.start_attempt(lease, at);
                        Some(lease)
                    }
                    _ => None,
                };
                let record = enc_entry(&entry);
                if lease.is_some() {
                    handed.push(entry);
                }
                (t, record, lease)
            })
            .collect::<Vec<_>>();
        // A quarantined event is never queued: no fan-out.
        let fanout: Vec<(u32, &[u8])> = if ne.quarantine.is_some() {
            Vec::new()
        } else {
            targets
                .iter()
                .enumerate()
                .filter(|(_, (_, _, lease))| lease.is_none())
                .map(|(i, (_, r, _))| (u32::try_from(i).unwrap_or(u32::MAX), r.as_slice()))
                .collect()
        };
        let stored = StoredEventRef {
            event: &ne.event,
            accepted_at: at,
            ruleset_version: &ne.ruleset_version,
            matched_rules: &ne.matched_rules,
            quarantined: ne.quarantine.is_some(),
        };
        let hint = 512
            + ne.event.data.as_ref().map_or(0, |d| d.text().len())
            + ne.event.data_base64.as_ref().map_or(0, String::len);
        // Serialising our own plain structs to JSON cannot fail (no non-string map keys).
        let record = event_record::encode_with(&fanout, hint, |out| {
            let _ = serde_json::to_writer(out, &stored);
        });
        drop(fanout);
        // The record holds the queued entries now: their own copies are freed here, not on
        // the committer.
        let targets: Vec<_> = targets
            .into_iter()
            .map(|(t, r, lease)| (t, if lease.is_some() { r } else { Vec::new() }, lease))
            .collect();
        let ev = ne.event;
        let fp = dedup::fingerprint(&ev.dedup_key());
        let (names, handoff) = if handed.is_empty() {
            ((ev.id, ev.source, ev.ty), None)
        } else {
            let names = (ev.id.clone(), ev.source.clone(), ev.ty.clone());
            let event = StoredEvent {
                seq: 0,
                event: ev,
                accepted_at: at,
                ruleset_version: ne.ruleset_version,
                matched_rules: ne.matched_rules,
                quarantined: false,
            };
            (
                names,
                Some(Handoff {
                    event,
                    entries: handed,
                }),
            )
        };
        (
            Self {
                record,
                fp,
                accepted_at: at,
                dedup_window_ms: ne.dedup_window_ms,
                names,
                targets,
                quarantine: ne.quarantine,
            },
            handoff,
        )
    }

    /// A DLQ entry for this event, stored as `seq`, dead-lettered at acceptance (quarantined,
    /// or one target's copy refused by its queue's depth cap).
    fn dead_letter(
        &self,
        seq: u64,
        target: Option<&NewEntry>,
        reason: DlqReason,
        errors: Vec<crate::event::FieldError>,
    ) -> DlqEntry {
        DlqEntry::at_acceptance(
            seq,
            self.names.clone(),
            target,
            reason,
            errors,
            self.accepted_at,
        )
    }
}

// ---------------------------------------------------------------------------------------------
// In-memory index

#[derive(Default)]
struct TargetIndex {
    /// Waiting entries by due time.
    ready: BTreeSet<(Millis, EntryId)>,
    /// Leased entries.
    in_flight: FxHashMap<EntryId, Lease>,
    /// Acceptance time of every live entry (ready or in flight), for oldest-age.
    live: BTreeMap<EntryId, Millis>,
    /// DLQ entries for this target.
    dlq: u64,
    /// Live entries per ordering key, in acceptance order: only the first may be leased.
    /// B-trees, like the maps above, not hash maps: these grow with a backlog, on the
    /// committer under the index lock, and a hash map doubles its table in one go (the dedup
    /// memtable's one took 75–280 ms at 917,504 keys).
    /// A key's text is one allocation shared (`Arc<str>`) by this map, `entry_keys`, `flying`
    /// and `held`: a copy per entry in each cost over twice the key's size per queued entry.
    keys: BTreeMap<Arc<str>, BTreeSet<EntryId>>,
    /// Ordering key of each live keyed entry.
    entry_keys: BTreeMap<EntryId, Arc<str>>,
    /// Keys held after a dead letter (`on_dead_letter: hold`) until an operator releases them.
    held: BTreeSet<Arc<str>>,
    /// Waiting keyed entries that ordering does not let go yet (behind their key's first
    /// entry, or of a held key), with their due times. Kept out of `ready`: there, a key with
    /// thousands of entries behind a retrying first one filled every lease's scan (other keys
    /// and unkeyed entries starved), and its past due times had the worker poll every
    /// millisecond. A key's next entry moves to `ready` when the one before it leaves.
    parked: BTreeMap<EntryId, Millis>,
    /// The entry of each ordering key that is leased (in flight). A redriven or replayed
    /// entry sorts before the key's later ones, so being first is not enough: without this
    /// it was leased while a later entry of its key was still being delivered.
    flying: BTreeMap<Arc<str>, EntryId>,
    /// The target's live policy has no `ordering` (`Store::set_ordered`): its entries go as
    /// if they had no key, whatever key they were accepted with. The keys above are still
    /// kept, so that ordering turned on again applies to the entries still waiting.
    unordered: bool,
}

impl TargetIndex {
    /// Entry `id` is leased.
    fn fly(&mut self, id: EntryId, lease: Lease) {
        self.in_flight.insert(id, lease);
        if let Some(k) = self.entry_keys.get(&id) {
            self.flying.insert(k.clone(), id);
        }
    }

    /// Entry `id`'s lease ended (it stays live, or leaves with `remove_live`): its key's
    /// first entry may go.
    fn land(&mut self, id: EntryId) {
        if self.in_flight.remove(&id).is_none() {
            return;
        }
        if let Some(k) = self.entry_keys.get(&id).cloned()
            && self.flying.get(&k) == Some(&id)
        {
            self.flying.remove(&k);
            self.unpark_first(&k);
        }
    }

    fn insert_live(&mut self, id: EntryId, accepted_at: Millis, key: Option<String>) {
        self.live.insert(id, accepted_at);
        if let Some(k) = key {
            let k = self.shared_key(&k);
            self.keys.entry(k.clone()).or_default().insert(id);
            self.entry_keys.insert(id, k);
        }
    }

    /// The index's one copy of key `k`'s text (a new one if the key has no entry or hold).
    fn shared_key(&self, k: &str) -> Arc<str> {
        match self.keys.get_key_value(k) {
            Some((shared, _)) => shared.clone(),
            None => match self.held.get(k) {
                Some(shared) => shared.clone(),
                None => Arc::from(k),
            },
        }
    }

    /// Entry `id` (live) waits from `due`: in `ready` when ordering lets it go, else parked.
    fn enqueue(&mut self, id: EntryId, due: Millis) {
        if self.ordering_allows(id) {
            self.ready.insert((due, id));
        } else {
            self.parked.insert(id, due);
        }
    }

    /// Moves the first entry of `key` to `ready` if it is parked and the key is not held.
    fn unpark_first(&mut self, key: &str) {
        if self.held.contains(key) {
            return;
        }
        if let Some(&first) = self.keys.get(key).and_then(|s| s.first())
            && self.flying.get(key).is_none_or(|f| *f == first)
            && let Some(due) = self.parked.remove(&first)
        {
            self.ready.insert((due, first));
        }
    }

    /// Holds `key`: its first entry, if waiting in `ready`, is parked (the later ones are).
    /// On an unordered target the key is only noted as held (a hold made by an acceptance
    /// under the previous rules): nothing is parked, and the next start or reload releases it.
    fn hold(&mut self, key: &str) {
        let key = self.shared_key(key);
        if self.unordered {
            self.held.insert(key);
            return;
        }
        let Some(&first) = self.keys.get(&key).and_then(|s| s.first()) else {
            self.held.insert(key);
            return;
        };
        if !self.held.insert(key) || self.parked.contains_key(&first) {
            return;
        }
        // `ready` is ordered by due time, so finding the entry is a scan; it runs once per
        // key newly held at acceptance (an overflow), not per event, and left in `ready` the
        // entry would be passed over by every lease scan until a release.
        if let Some(&(due, id)) = self.ready.iter().find(|(_, id)| *id == first) {
            self.ready.remove(&(due, id));
            self.parked.insert(id, due);
        }
    }

    /// Parks every entry in `ready` that ordering does not let go (after a rebuild that
    /// filled `ready` before the keys and holds were known).
    fn park_blocked(&mut self) {
        let blocked: Vec<(Millis, EntryId)> = self
            .ready
            .iter()
            .filter(|(_, id)| !self.ordering_allows(*id))
            .copied()
            .collect();
        for (due, id) in blocked {
            self.ready.remove(&(due, id));
            self.parked.insert(id, due);
        }
    }

    fn remove_live(&mut self, id: EntryId) {
        self.live.remove(&id);
        self.parked.remove(&id);
        if let Some(k) = self.entry_keys.remove(&id)
            && let Some(set) = self.keys.get_mut(&k)
        {
            set.remove(&id);
            if set.is_empty() {
                self.keys.remove(&k);
            } else {
                self.unpark_first(&k);
            }
        }
    }

    /// Whether ordering lets the target's entries go as their keys say (its live policy
    /// orders them), or every entry goes as if unkeyed. Turned off, every parked entry is let
    /// go; turned on again, those that ordering holds back are parked.
    fn set_ordered(&mut self, ordered: bool) {
        if self.unordered != ordered {
            return;
        }
        self.unordered = !ordered;
        if ordered {
            self.park_blocked();
        } else {
            for (id, due) in std::mem::take(&mut self.parked) {
                self.ready.insert((due, id));
            }
        }
    }

    /// Whether `id` may be leased now as far as ordering goes: unkeyed, the target's policy
    /// without ordering, or the first live entry of a key that is not held.
    fn ordering_allows(&self, id: EntryId) -> bool {
        if self.unordered {
            return true;
        }
        match self.entry_keys.get(&id) {
            None => true,
            Some(k) => {
                !self.held.contains(k)
                    && self.keys.get(k).and_then(|s| s.first()) == Some(&id)
                    && self.flying.get(k).is_none_or(|f| *f == id)
            }
        }
    }

    /// Up to `max` due entries that ordering allows, scanning at most `SCAN_LIMIT` entries.
    /// (Blocked entries are parked, not in `ready`; the check stays for a key whose first
    /// entry changed under one already there: a redriven entry sorts before later ones.)
    fn due(&self, now: Millis, max: usize) -> Vec<(Millis, EntryId)> {
        let mut out = Vec::new();
        for &(due, id) in self.ready.iter().take(SCAN_LIMIT) {
            if due > now || out.len() >= max {
                break;
            }
            if self.ordering_allows(id) {
                out.push((due, id));
            }
        }
        out
    }
}

/// The lease (token 0) under which `Store::dead_letter_queued` and
/// `Store::dead_letter_expired_of_key` keep the entries they move out of workers' reach.
const PSEUDO_LEASE: Lease = Lease {
    token: 0,
    until: i64::MAX,
};

/// Maps keyed by target ids and entry ids use FxHash: the committer looks them up once per
/// queue entry of every group, the keys are the router's own (rule files, sequence numbers),
/// not an attacker's, and SipHash showed on its profile.
#[derive(Default)]
struct Index {
    targets: FxHashMap<String, TargetIndex>,
    notifiers: FxHashMap<String, Arc<Notify>>,
    /// DLQ entries of no target (events quarantined at ingest).
    dlq_without_target: u64,
    /// Targets whose live policy has no `ordering` (`Store::set_ordered`). Kept apart from
    /// `targets`: a target's index is made on its first entry, and the index is rebuilt from
    /// the tables when the store reopens after a write error; both take the flag from here.
    unordered: BTreeSet<String>,
}

impl Index {
    fn target(&mut self, t: &str) -> &mut TargetIndex {
        // Looked up first: `entry` would allocate the key on every call, and the committer
        // calls this once per queue entry of every group while holding the index lock.
        if !self.targets.contains_key(t) {
            let index = TargetIndex {
                unordered: self.unordered.contains(t),
                ..TargetIndex::default()
            };
            self.targets.insert(t.to_string(), index);
        }
        self.targets.get_mut(t).expect("inserted above")
    }

    /// `Store::set_ordered`: notes the flag and applies it to the target's entries.
    fn set_ordered(&mut self, t: &str, ordered: bool) {
        let changed = if ordered {
            self.unordered.remove(t)
        } else {
            self.unordered.insert(t.to_string())
        };
        if let Some(index) = self.targets.get_mut(t) {
            index.set_ordered(ordered);
        }
        if changed {
            // Entries let go by the change are due now, maybe before the worker's next wake.
            self.notify(t);
        }
    }

    fn notify(&mut self, t: &str) {
        match self.notifiers.get(t) {
            Some(n) => n.notify_one(),
            None => {
                let n = Arc::new(Notify::new());
                n.notify_one();
                self.notifiers.insert(t.to_string(), n);
            }
        }
    }

    fn apply(&mut self, effect: Effect) {
        match effect {
            Effect::Enqueue {
                target,
                id,
                due,
                accepted_at,
                key,
                lease,
            } => {
                let t = self.target(&target);
                t.insert_live(id, accepted_at, key);
                match lease {
                    Some(lease) => {
                        t.fly(id, lease);
                    }
                    None => {
                        t.enqueue(id, due);
                        self.notify(&target);
                    }
                }
            }
            Effect::Requeue { target, id, due } => {
                let t = self.target(&target);
                t.land(id);
                t.enqueue(id, due);
                self.notify(&target);
            }
            Effect::Remove { target, id, hold } => {
                let t = self.target(&target);
                t.land(id);
                if hold && let Some(k) = t.entry_keys.get(&id).cloned() {
                    t.held.insert(k);
                }
                t.remove_live(id);
                // The key's next entry may be leasable now.
                self.notify(&target);
            }
            Effect::Release { target, key } => {
                let t = self.target(&target);
                t.held.remove(key.as_str());
                t.unpark_first(&key);
                self.notify(&target);
            }
            Effect::Hold { target, key } => self.target(&target).hold(&key),
            Effect::DlqAdded { target } => match target {
                Some(target) => self.target(&target).dlq += 1,
                None => self.dlq_without_target += 1,
            },
            Effect::DlqRemoved { target } => match target {
                Some(target) => {
                    let t = self.target(&target);
                    t.dlq = t.dlq.saturating_sub(1);
                }
                None => self.dlq_without_target = self.dlq_without_target.saturating_sub(1),
            },
        }
    }
}

/// An in-memory consequence of a write, applied only once its commit succeeded.
enum Effect {
    Enqueue {
        target: String,
        id: EntryId,
        due: Millis,
        accepted_at: Millis,
        key: Option<String>,
        /// Leased at acceptance: in flight at once, and no worker is woken for it.
        lease: Option<Lease>,
    },
    Requeue {
        target: String,
        id: EntryId,
        due: Millis,
    },
    Remove {
        target: String,
        id: EntryId,
        /// Hold the entry's ordering key (dead letter under `on_dead_letter: hold`).
        hold: bool,
    },
    Release {
        target: String,
        key: String,
    },
    /// Hold an ordering key with no live entry of its own to dead-letter: a copy refused at
    /// acceptance by the depth cap (`target_overflow`) under `on_dead_letter: hold`.
    Hold {
        target: String,
        key: String,
    },
    DlqAdded {
        target: Option<String>,
    },
    DlqRemoved {
        target: Option<String>,
    },
}

// ---------------------------------------------------------------------------------------------
// Ops

type Reply<T> = oneshot::Sender<T>;

enum Op {
    Accept {
        events: Vec<Prepared>,
        reply: AcceptReply,
    },
    Lease {
        target: String,
        ids: Vec<EntryId>,
        lease: Lease,
        now: Millis,
        reply: Reply<Result<Vec<QueueEntry>, StoreError>>,
    },
    Finish {
        id: EntryId,
        lease: Lease,
        end: AttemptEnd,
        disposition: Disposition,
        now: Millis,
        reply: Reply<Result<Finished, FinishError>>,
    },
    SaveTargets {
        configs: Vec<(String, serde_json::Value)>,
        reply: Reply<Result<(), StoreError>>,
    },
    PutTargetState {
        id: String,
        state: serde_json::Value,
        reply: Reply<Result<(), StoreError>>,
    },
    ReleaseKey {
        target: String,
        key: String,
        reply: Reply<Result<bool, StoreError>>,
    },
    PutJob {
        job: Job,
        reply: Reply<Result<u64, StoreError>>,
    },
    DeleteJobs {
        jobs: Vec<Job>,
        reply: Reply<Result<u64, StoreError>>,
    },
    RedriveStep {
        job: Job,
        actions: Vec<RedriveAction>,
        now: Millis,
        reply: Reply<Result<(u64, RedriveGone), StoreError>>,
    },
    ReplayStep {
        job: Job,
        items: Vec<ReplayItem>,
        now: Millis,
        reply: Reply<Result<ReplayStepped, StoreError>>,
    },
    PurgeDlq {
        ids: Vec<u64>,
        reply: Reply<Result<u64, StoreError>>,
    },
    /// Removes at most `max` key-value entries of `namespace`.
    KvClear {
        namespace: String,
        max: usize,
        reply: Reply<Result<u64, StoreError>>,
    },
    /// Removes at most `max` COMPLETED records of `handler`.
    CompletedClear {
        handler: String,
        max: usize,
        reply: Reply<Result<u64, StoreError>>,
    },
    DeadLetterQueued {
        ids: Vec<EntryId>,
        reason: DlqReason,
        message: String,
        now: Millis,
        reply: Reply<Result<usize, StoreError>>,
    },
    Sweep {
        now: Millis,
        dedup_window_ms: i64,
        retention_ms: i64,
        reply: Reply<Result<SweepStats, StoreError>>,
    },
    /// Nothing to write: sent by the group log writer after a failed write, so that the
    /// committer, idle or not, starts a group and reopens the store.
    Wake,
    /// A clean stop (`Store::close`): the groups before it are committed, a last durable one
    /// follows, and the database file is closed; the committer then ends.
    Close {
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
}

impl Op {
    /// Answers the op with `e`: its group failed before reaching it (a panic of redb while
    /// the group was read). Dropped unanswered, its caller was told the store is closed.
    fn fail(self, e: &StoreError) {
        let e = e.clone();
        match self {
            Op::Accept { reply, .. } => drop(reply.send(Err(e))),
            Op::Lease { reply, .. } => drop(reply.send(Err(e))),
            Op::Finish { reply, .. } => drop(reply.send(Err(FinishError::Store(e)))),
            Op::SaveTargets { reply, .. } | Op::PutTargetState { reply, .. } => {
                drop(reply.send(Err(e)))
            }
            Op::ReleaseKey { reply, .. } => drop(reply.send(Err(e))),
            Op::PutJob { reply, .. }
            | Op::DeleteJobs { reply, .. }
            | Op::PurgeDlq { reply, .. }
            | Op::KvClear { reply, .. }
            | Op::CompletedClear { reply, .. } => drop(reply.send(Err(e))),
            Op::RedriveStep { reply, .. } => drop(reply.send(Err(e))),
            Op::ReplayStep { reply, .. } => drop(reply.send(Err(e))),
            Op::DeadLetterQueued { reply, .. } => drop(reply.send(Err(e))),
            Op::Sweep { reply, .. } => drop(reply.send(Err(e))),
            Op::Close { reply } => drop(reply.send(Err(e))),
            Op::Wake => {}
        }
    }

    /// What this op weighs against `MAX_GROUP_WEIGHT`: the events it accepts, or for a
    /// handler's ack the events it emits and its key-value writes and checks (each costs the
    /// commit a few B-tree writes, as an accepted event does). Other ops weigh nothing: they
    /// write a bounded few rows each.
    fn group_weight(&self) -> usize {
        match self {
            Op::Accept { events, .. } => events.len(),
            Op::Finish { end, .. } => end
                .outbox
                .as_ref()
                .map_or(0, |o| o.emitted.len() + o.kv.len() + o.cas.len()),
            _ => 0,
        }
    }
}

use super::group_log::{Done, FILE_NAMES, FileLog, LogFiles, LogMsg, LogWriter, Mutations, Wake};
use super::sync_behind::{SyncBehind, SyncHandle};

/// Queues `r` as the op's answer (sent once the group commits) and hands a storage error back
/// to abort the group.
/// Queues `r` as the answer to `reply`, and returns the error that must fail the whole group:
/// a refusal (which wrote nothing, see [`StoreError::is_refusal`]) is that request's answer
/// alone. A job write that lost a race used to fail every request committed with it, and the
/// reopen that follows a failed group gave up the leases of deliveries in flight, which were
/// then sent again.
fn answer<T: Send + 'static>(
    dones: &mut Vec<Done>,
    reply: Reply<Result<T, StoreError>>,
    r: Result<T, StoreError>,
) -> Result<(), StoreError> {
    let err = r.as_ref().err().filter(|e| !e.is_refusal()).cloned();
    dones.push(done(reply, r));
    err.map_or(Ok(()), Err)
}

fn done<T: Send + 'static>(reply: Reply<Result<T, StoreError>>, r: Result<T, StoreError>) -> Done {
    Box::new(move |commit_err| {
        let _ = reply.send(match commit_err {
            Some(e) => Err(e.clone()),
            None => r,
        });
    })
}

/// What the store says when redb checks every page of its file before opening it: at start, a
/// file not closed cleanly (a crash, a kill); when the committer reopens it after a failed
/// write, that write (a full or failing disk), not a crash, which the first said wrongly.
fn repair_notice(reopening: bool) -> &'static str {
    if reopening {
        "reopening the store after a write error (a full or failing disk): the failed write left the file not closed cleanly, so every page is checked before it opens; on a large file this takes a while"
    } else {
        "the store file was not closed cleanly (a crash or a kill): checking every page before it opens; on a large file this takes a while"
    }
}

/// Why the store file at `path` did not open, with what to do: redb's own words ("File
/// truncated below stored layout", "All roots are corrupted") said nothing of it.
fn open_refused(path: &Path, e: &redb::DatabaseError) -> StoreError {
    let damaged = matches!(
        e,
        redb::DatabaseError::Storage(redb::StorageError::Corrupted(_))
    ) || matches!(
        e,
        redb::DatabaseError::Storage(redb::StorageError::Io(io))
            if io.kind() == std::io::ErrorKind::InvalidData
    );
    let hint = if damaged {
        format!(
            "; the file is damaged: stop here, keep a copy of the data directory, run `router \
             store check --data-dir {}`, then restore the data directory from a backup or move \
             router.redb aside to start with an empty store (docs/operations.md, \"A damaged \
             store file\")",
            path.parent().unwrap_or(path).display()
        )
    } else if matches!(e, redb::DatabaseError::DatabaseAlreadyOpen) {
        "; another process has it open (a router already running on this data directory, or \
         `router store check`)"
            .to_string()
    } else {
        String::new()
    };
    StoreError::Backend(format!("open the store file {}: {e}{hint}", path.display()))
}

// ---------------------------------------------------------------------------------------------
// The store

/// The redb-backed store.
pub struct RedbStore {
    /// Readers and the committer take the read side; compaction (which needs no transaction
    /// open anywhere) and reopening after a write error take the write side.
    db: DbSlot,
    tx: mpsc::Sender<Op>,
    index: Arc<Mutex<Index>>,
    /// The dedup index's in-memory side (memtable, runs and their filters). Lock order: the
    /// database slot first, then this.
    dedup: Arc<RwLock<dedup::DedupState>>,
    boot: u64,
    token_counter: AtomicU64,
    path: Option<std::path::PathBuf>,
    /// Set while the committer compacts the file (which holds the database exclusively): new
    /// accepts, leases and reads are refused at once with `StoreError::Compacting` instead of
    /// waiting — reads would block the tokio threads they run on.
    compacting: Arc<AtomicBool>,
    /// The last compaction since start, written by the committer.
    last_compaction: Arc<Mutex<Option<CompactionReport>>>,
    /// The group log's failure flag (with a log): set from a failed log write until the
    /// committer has reopened the store; reads are refused meanwhile.
    log_failed: Option<Arc<AtomicBool>>,
    /// The ingest dedup window (`StoreOptions::dedup_window`), for the count of dedup keys
    /// inside it.
    dedup_window: Option<Duration>,
    /// Reads of every target-state record, for tests that a batch of worker starts reads
    /// them once.
    #[cfg(test)]
    target_state_reads: AtomicU64,
}

impl RedbStore {
    /// Opens (or creates) the store in `dir` (file `router.redb`). A file damaged outside redb
    /// can make the open, or the recovery's reads, panic: that is an error naming the file and
    /// the check to run, not a crash with a backtrace (exit 101).
    pub fn open_dir(dir: &Path, opts: StoreOptions) -> Result<Arc<Self>, StoreError> {
        catching(|| Self::open_dir_inner(dir, opts)).unwrap_or_else(|p| {
            let what = format!("the store file {}", dir.join("router.redb").display());
            Err(read_panicked(&what, p.as_ref()))
        })
    }

    fn open_dir_inner(dir: &Path, opts: StoreOptions) -> Result<Arc<Self>, StoreError> {
        if dir.exists() && !dir.is_dir() {
            return Err(StoreError::Backend(format!(
                "the data directory {} is not a directory (it is a file): set data_dir to a \
                 directory, or move the file aside",
                dir.display()
            )));
        }
        std::fs::create_dir_all(dir)
            .map_err(|e| StoreError::Backend(format!("create {}: {e}", dir.display())))?;
        let path = dir.join("router.redb");
        let found = std::fs::metadata(&path).ok().map(|m| m.len());
        let store = Self::open_file(dir, &path, opts).map_err(|e| match e {
            StoreError::FormatVersion {
                found, expected, ..
            } => StoreError::FormatVersion {
                found,
                expected,
                file: Some(path.display().to_string()),
            },
            e => e,
        })?;
        // Said at every start, so that an empty store where one was expected shows (a
        // zero-length file is a new store to redb). The count is kept by redb: no scan.
        let file = path.display().to_string();
        let events = store.record_counts().map_or(0, |c| c.events);
        match found {
            None => tracing::info!(file, "store created"),
            Some(0) => tracing::warn!(
                file,
                "the store file was empty (0 bytes): a new store was created in it; if it held events (a file truncated by a bad copy or a full disk), stop the router and restore the data directory from a backup"
            ),
            Some(bytes) => tracing::info!(file, bytes, events, "store opened"),
        }
        Ok(store)
    }

    /// `open_dir` past the directory's checks.
    fn open_file(dir: &Path, path: &Path, opts: StoreOptions) -> Result<Arc<Self>, StoreError> {
        let path = path.to_path_buf();
        let paths = FILE_NAMES.map(|n| dir.join(n));
        let open_logs = || -> Result<LogFiles, StoreError> {
            let open = |p: &Path| -> Result<Box<dyn redb::StorageBackend>, StoreError> {
                Ok(Box::new(FileLog::open(p).map_err(|e| {
                    StoreError::Backend(format!("open {}: {e}", p.display()))
                })?))
            };
            Ok([open(&paths[0])?, open(&paths[1])?])
        };
        let cache = opts.cache_bytes;
        // Set once the first open is done: every later open is the committer's reopen after a
        // failed write, whose check is no sign of a crash.
        let opened = Arc::new(AtomicBool::new(false));
        let opened_b = opened.clone();
        // The committer tries again every 200 ms while the disk stays full: said once a
        // minute, not at each try.
        let last_reopen_notice: Arc<Mutex<Option<Instant>>> = Arc::default();
        let builder = move || {
            let mut b = Database::builder();
            if let Some(c) = cache {
                b.set_cache_size(c);
            }
            // Said once per open: a file not closed cleanly (a crash, kill -9, power loss, or
            // a write that failed) is checked page by page before it opens, which takes a
            // while on a large one.
            let said = std::sync::atomic::AtomicBool::new(false);
            let reopening = opened_b.load(Ordering::Acquire);
            let last = last_reopen_notice.clone();
            b.set_repair_callback(move |_| {
                if said.swap(true, Ordering::Relaxed) {
                    return;
                }
                if reopening {
                    let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
                    if last.is_some_and(|t| t.elapsed() < Duration::from_secs(60)) {
                        return;
                    }
                    *last = Some(Instant::now());
                }
                tracing::warn!("{}", repair_notice(reopening));
            });
            b
        };
        let (db, log, reopen): (Database, Option<Logged>, Reopen) = if opts.group_log {
            let sync = SyncHandle::default();
            let (p2, s2) = (path.clone(), sync.clone());
            // The store file with its syncs behind the committer (see `Logged`).
            let open_db = move || -> Result<Database, redb::DatabaseError> {
                let file = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(&p2)?;
                let backend = SyncBehind::new(redb::backends::FileBackend::new(file)?, &s2)?;
                builder().create_with_backend(backend)
            };
            let db = open_db().map_err(|e| open_refused(&path, &e))?;
            let files = open_logs()?;
            (db, Some(Logged { files, sync }), Arc::new(open_db))
        } else {
            let db = builder()
                .create(&path)
                .map_err(|e| open_refused(&path, &e))?;
            if paths.iter().any(|p| p.exists()) {
                // Left by a run with the log on: what it holds is applied before the log is
                // given up, or the groups only it made durable would be lost.
                let images = super::group_log::read_images(&open_logs()?)
                    .map_err(|e| StoreError::Backend(format!("read the group log: {e}")))?;
                replay_log(&db, &images, Some(dir))?;
                for p in paths.iter().filter(|p| p.exists()) {
                    std::fs::remove_file(p)
                        .map_err(|e| StoreError::Backend(format!("remove {}: {e}", p.display())))?;
                }
            }
            let p2 = path.clone();
            (db, None, Arc::new(move || builder().create(&p2)))
        };
        opened.store(true, Ordering::Release);
        Self::start(db, log, opts, Some(path), Some(reopen))
    }

    /// Writes `json` over the event's JSON in event `seq`'s record (its fan-out kept), as
    /// damage outside the router would: for tests of what an unreadable event does.
    #[cfg(test)]
    pub(crate) fn damage_event(&self, seq: u64, json: &[u8]) {
        let slot = self.db.read().expect("slot");
        let db = slot.as_ref().expect("open");
        let txn = db.begin_write().expect("write");
        {
            let mut t = txn.open_table(EVENTS).expect("events");
            let mut record = t.get(seq).expect("get").expect("stored").value().to_vec();
            let json_len = EventRecord::split(seq, &record).expect("split").json.len();
            record.truncate(record.len() - json_len);
            record.extend_from_slice(json);
            t.insert(seq, record.as_slice()).expect("insert");
        }
        txn.commit().expect("commit");
    }

    /// An in-memory store (nothing survives the process): for unit tests.
    pub fn in_memory() -> Result<Arc<Self>, StoreError> {
        let db = Database::builder().create_with_backend(redb::backends::InMemoryBackend::new())?;
        Self::start(db, None, StoreOptions::default(), None, None)
    }

    /// A store on any redb backend (e.g. `fault::FaultBackend`).
    pub fn with_backend(
        backend: impl redb::StorageBackend,
        opts: StoreOptions,
    ) -> Result<Arc<Self>, StoreError> {
        let db = Database::builder().create_with_backend(backend)?;
        Self::start(db, None, opts, None, None)
    }

    /// A store on backends made by `make` (e.g. handles on one `fault::SimulatedDisk`), which
    /// the committer calls again to reopen the database after a write error.
    pub fn with_backend_factory<B: redb::StorageBackend>(
        make: impl Fn() -> B + Send + Sync + 'static,
        opts: StoreOptions,
    ) -> Result<Arc<Self>, StoreError> {
        let db = Database::builder().create_with_backend(make())?;
        let reopen: Reopen = Arc::new(move || Database::builder().create_with_backend(make()));
        Self::start(db, None, opts, None, Some(reopen))
    }

    /// Like `with_backend_factory`, with the group log on `logs` (e.g. two more
    /// `fault::SimulatedDisk`s), for power-cut tests of the log. The store file's syncs run
    /// behind the committer, as `open_dir` has them with a log.
    pub fn with_backends<B: redb::StorageBackend, L: redb::StorageBackend>(
        make: impl Fn() -> B + Send + Sync + 'static,
        logs: [L; 2],
        opts: StoreOptions,
    ) -> Result<Arc<Self>, StoreError> {
        let sync = SyncHandle::default();
        let s2 = sync.clone();
        let open_db = move || -> Result<Database, redb::DatabaseError> {
            Database::builder().create_with_backend(SyncBehind::new(make(), &s2)?)
        };
        let db = open_db()?;
        let files = logs.map(|l| Box::new(l) as Box<dyn redb::StorageBackend>);
        Self::start(
            db,
            Some(Logged { files, sync }),
            opts,
            None,
            Some(Arc::new(open_db)),
        )
    }

    fn start(
        db: Database,
        log: Option<Logged>,
        opts: StoreOptions,
        path: Option<std::path::PathBuf>,
        reopen: Option<Reopen>,
    ) -> Result<Arc<Self>, StoreError> {
        let log_seq = match &log {
            Some(l) => {
                let images = super::group_log::read_images(&l.files)
                    .map_err(|e| StoreError::Backend(format!("read the group log: {e}")))?;
                let seq = replay_log(&db, &images, path.as_deref().and_then(Path::parent))?;
                // The writer starts over the records just replayed: their replay must be
                // durable first.
                l.sync
                    .wait_all()
                    .map_err(|e| StoreError::Backend(format!("sync the store file: {e}")))?;
                seq
            }
            None => 0,
        };
        let dedup_window = opts.dedup_window;
        let cold_before = cold_before(opts.dedup_window);
        let Recovered {
            boot,
            counters,
            index,
            dedup,
            floor,
        } = recover(&db, cold_before)?;
        let dedup = Arc::new(RwLock::new(dedup));
        let (tx, rx) = mpsc::channel(65_536);
        // A failed log write, or a failed sync of the store file, wakes the committer, which
        // reopens the store at once instead of at the next write (an idle router's readers
        // would wait for one). Weak: the committer stops when the store's own sender is
        // dropped.
        let waker = || -> Wake {
            let waker = tx.downgrade();
            Box::new(move || {
                if let Some(tx) = waker.upgrade() {
                    let _ = tx.try_send(Op::Wake);
                }
            })
        };
        let (log, sync) = match log {
            Some(Logged { files, sync }) => {
                sync.set_wake(waker());
                (Some(LogWriter::start(files, waker())?), sync)
            }
            None => (None, SyncHandle::default()),
        };
        let log_failed = log.as_ref().map(LogWriter::failed_flag);
        let db: DbSlot = Arc::new(RwLock::new(Some(db)));
        let index = Arc::new(Mutex::new(index));
        let compacting = Arc::new(AtomicBool::new(false));
        let last_compaction = Arc::new(Mutex::new(None));
        let committer = Committer {
            last_compaction: last_compaction.clone(),
            on_compact: opts.on_compact,
            group_depth: FxHashMap::default(),
            db: db.clone(),
            compacting: compacting.clone(),
            check_compaction: false,
            compact_checking: Arc::new(AtomicBool::new(false)),
            compact_next_check: Arc::new(Mutex::new(Instant::now())),
            compact_wanted: Arc::new(AtomicBool::new(false)),
            compact_peak_live: Arc::new(AtomicU64::new(0)),
            compact_wake: tx.downgrade(),
            path: path.clone(),
            compact_due: false,
            closing: false,
            compact_min_bytes: opts.compact_min_bytes.unwrap_or(COMPACT_MIN_BYTES),
            sweep_batch: opts.sweep_batch.unwrap_or(SWEEP_BATCH).max(1),
            commit_delay: opts.commit_delay,
            compact_floor: 0,
            index: index.clone(),
            dedup: dedup.clone(),
            dedup_group: HashMap::default(),
            dedup_rows: Vec::new(),
            dedup_fx: DedupFx::default(),
            frozen_written: 0,
            freezing: None,
            dedup_window: opts.dedup_window,
            freeze_inline_keys: opts
                .dedup_freeze_inline_keys
                .unwrap_or(dedup::FREEZE_INLINE_KEYS),
            memtable_keys: opts
                .dedup_memtable_keys
                .unwrap_or(dedup::MEMTABLE_KEYS)
                .max(1),
            last_group_failed: false,
            next_seq: counters.0,
            next_dlq: counters.1,
            floor,
            floor_next: counters.0,
            floor_goal: floor,
            floor_moved: Instant::now(),
            floor_every: opts.floor_every.unwrap_or(FLOOR_EVERY),
            meta_counters: counters,
            on_commit: opts.on_commit,
            reopen,
            poisoned: false,
            log,
            log_seq,
            log_bytes: 0,
            sync,
            checkpoint_ticket: 0,
            last_checkpoint: Instant::now(),
            checkpoint_every: opts.checkpoint_every.unwrap_or(CHECKPOINT_EVERY),
            mutations: Mutations::default(),
            split: GroupSplit::default(),
        };
        std::thread::Builder::new()
            .name("store-committer".into())
            .spawn(move || committer.run(rx))
            .map_err(|e| StoreError::Backend(format!("spawn committer: {e}")))?;
        Ok(Arc::new(Self {
            db,
            tx,
            index,
            dedup,
            boot,
            token_counter: AtomicU64::new(1),
            path,
            compacting,
            last_compaction,
            log_failed,
            dedup_window,
            #[cfg(test)]
            target_state_reads: AtomicU64::new(0),
        }))
    }

    /// Every row of a name → JSON table.
    fn read_named_json(
        &self,
        def: TableDefinition<'static, &'static str, &'static [u8]>,
        name: &'static str,
    ) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
        let db = self.read_db();
        let r = db.begin_read()?;
        let t = r.open_table(def)?;
        let mut out = Vec::new();
        for row in t.iter()? {
            let (k, v) = row?;
            out.push((k.value().to_string(), dec(name, v.value())?));
        }
        Ok(out)
    }

    /// A read handle, or one that refuses to begin transactions while the file is being
    /// compacted (the slot's write side is held for the whole compaction, seconds on a large
    /// file, and waiting for it would block a tokio worker thread).
    fn read_db(&self) -> DbRead<'_> {
        if self
            .log_failed
            .as_ref()
            .is_some_and(|f| f.load(Ordering::SeqCst))
        {
            return DbRead::LogFailed;
        }
        // Never a blocking `read()` first: a reader that checked the flag just before a
        // compaction took the slot would wait out the whole compaction on a tokio thread (two
        // such readers froze the runtime for 20 s in a benchmark).
        for _ in 0..1000 {
            match self.db.try_read() {
                Ok(g) => return DbRead::Open(g),
                Err(std::sync::TryLockError::Poisoned(p)) => return DbRead::Open(p.into_inner()),
                // The flag is set before the compaction asks for the slot.
                Err(std::sync::TryLockError::WouldBlock)
                    if self.compacting.load(Ordering::Acquire) =>
                {
                    return DbRead::Compacting;
                }
                // A reopen after a write error holds the slot briefly.
                Err(std::sync::TryLockError::WouldBlock) => std::thread::yield_now(),
            }
        }
        DbRead::Open(self.db.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Refuses new work while the file is being compacted.
    fn not_compacting(&self) -> Result<(), StoreError> {
        if self.compacting.load(Ordering::Acquire) {
            Err(StoreError::Compacting)
        } else {
            Ok(())
        }
    }

    fn index(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn dedup_state(&self) -> std::sync::RwLockReadGuard<'_, dedup::DedupState> {
        self.dedup.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs the removal `op` makes (at most `max` rows each) until one removes fewer: in
    /// bounded groups, so one large namespace does not make one huge commit. Returns how many
    /// rows went.
    async fn clear_in_groups(
        &self,
        op: impl Fn(usize, Reply<Result<u64, StoreError>>) -> Op,
    ) -> Result<u64, StoreError> {
        let mut removed = 0;
        loop {
            let max = KV_CLEAR_BATCH;
            let n = self.call(|reply| op(max, reply)).await??;
            removed += n;
            if n < max as u64 {
                return Ok(removed);
            }
        }
    }

    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Op) -> Result<T, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(make(reply))
            .await
            .map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| {
            // Unanswered by a committer still running: its group failed part-way (a panic
            // of redb on a damaged page) and nothing of it was committed.
            if self.tx.is_closed() {
                StoreError::Closed
            } else {
                StoreError::Backend(
                    "the store's commit failed before it answered this request (see the log); \
                     nothing of it was stored"
                        .into(),
                )
            }
        })
    }

    fn new_token(&self) -> u64 {
        (self.boot << 40) | (self.token_counter.fetch_add(1, Ordering::Relaxed) & ((1 << 40) - 1))
    }

    /// Reads the events of freshly leased entries, here on the caller's thread rather than on
    /// the committer (decoding them is most of a lease's CPU). An entry whose event does not
    /// decode, or is missing, is returned apart as unreadable (its lease is recorded): failing
    /// the whole lease for it stopped the target's queue for good, each new lease meeting the
    /// same record. A panic of redb reading the file (a page damaged outside redb, which a
    /// cleanly closed file is not checked for) fails the lease like a failing store: it killed
    /// the delivery task with the entries held in flight, and every later lease met it again.
    fn with_events(
        &self,
        entries: Vec<QueueEntry>,
        lease: Lease,
    ) -> Result<LeaseBatch, StoreError> {
        if entries.is_empty() {
            return Ok(LeaseBatch::default());
        }
        catching(|| self.read_events(entries, lease))
            .unwrap_or_else(|p| Err(read_panicked("the events of a lease", p.as_ref())))
    }

    /// `with_events`' reads.
    fn read_events(
        &self,
        entries: Vec<QueueEntry>,
        lease: Lease,
    ) -> Result<LeaseBatch, StoreError> {
        let db = self.read_db();
        let r = db.begin_read()?;
        let t = r.open_table(EVENTS)?;
        let mut cache: FxHashMap<u64, Result<Arc<StoredEvent>, String>> = FxHashMap::default();
        let mut out = LeaseBatch {
            leased: Vec::with_capacity(entries.len()),
            unreadable: Vec::new(),
        };
        for entry in entries {
            let seq = entry.id.event;
            let event = match cache.get(&seq) {
                Some(ev) => ev.clone(),
                None => {
                    // A storage error (I/O) fails the lease: it is not this record's fault.
                    let ev = match t.get(seq)? {
                        Some(raw) => dec_event(seq, raw.value())
                            .map(Arc::new)
                            .map_err(|e| e.to_string()),
                        None => Err(format!(
                            "entry {} refers to event {seq}, which is missing",
                            entry.id
                        )),
                    };
                    cache.insert(seq, ev.clone());
                    ev
                }
            };
            match event {
                Ok(event) => out.leased.push(Leased {
                    entry,
                    event,
                    lease,
                }),
                Err(error) => out.unreadable.push(Unreadable {
                    entry,
                    lease,
                    error,
                }),
            }
        }
        Ok(out)
    }

    /// Moves the waiting entries `taken` (id, due), which the caller took out of the index
    /// under `PSEUDO_LEASE` so that no worker leases them meanwhile, to the DLQ without an
    /// attempt; whatever the op does not move goes back, due as it was.
    fn dead_letter_taken(
        &self,
        target: &str,
        taken: Vec<(EntryId, Millis)>,
        reason: DlqReason,
        message: &str,
        now: Millis,
    ) -> BoxFuture<'_, Result<usize, StoreError>> {
        let message = message.to_string();
        let target = target.to_string();
        async move {
            let r = self
                .call(|reply| Op::DeadLetterQueued {
                    ids: taken.iter().map(|(id, _)| *id).collect(),
                    reason,
                    message,
                    now,
                    reply,
                })
                .await
                .and_then(|r| r);
            let mut idx = self.index();
            let t = idx.target(&target);
            for (id, due) in taken {
                if t.in_flight.get(&id) == Some(&PSEUDO_LEASE) {
                    t.in_flight.remove(&id);
                    t.enqueue(id, due);
                }
            }
            r
        }
        .boxed()
    }

    async fn lease_impl(
        &self,
        target: &str,
        now: Millis,
        max: usize,
        lease_ms: i64,
    ) -> Result<LeaseBatch, StoreError> {
        self.not_compacting()?;
        let lease = Lease {
            token: self.new_token(),
            until: now + lease_ms,
        };
        let ids: Vec<EntryId> = {
            let mut idx = self.index();
            let t = idx.target(target);
            let mut ids = Vec::new();
            for (due, id) in t.due(now, max) {
                t.ready.remove(&(due, id));
                t.fly(id, lease);
                ids.push(id);
            }
            ids
        };
        if ids.is_empty() {
            return Ok(LeaseBatch::default());
        }
        let target_s = target.to_string();
        let res = self
            .call(|reply| Op::Lease {
                target: target_s,
                ids: ids.clone(),
                lease,
                now,
                reply,
            })
            .await
            .and_then(|r| r);
        match res.and_then(|entries| self.with_events(entries, lease)) {
            Ok(leased) => {
                // Entries the committer skipped (no longer queued) leave the index.
                if leased.leased.len() + leased.unreadable.len() != ids.len() {
                    let got: BTreeSet<EntryId> = leased
                        .leased
                        .iter()
                        .map(|l| l.entry.id)
                        .chain(leased.unreadable.iter().map(|u| u.entry.id))
                        .collect();
                    let mut idx = self.index();
                    let t = idx.target(target);
                    for id in ids.iter().filter(|id| !got.contains(id)) {
                        t.land(*id);
                        t.remove_live(*id);
                    }
                }
                Ok(leased)
            }
            Err(e) => {
                let mut idx = self.index();
                let t = idx.target(target);
                for id in ids {
                    t.land(id);
                    t.enqueue(id, now);
                }
                Err(e)
            }
        }
    }
}

thread_local! {
    /// Set while `catching` runs a call: a panic in it is reported by its caller as an error.
    static CATCHING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Where the last panic caught by `catching` on this thread was raised.
    static CAUGHT_AT: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f`, a call into redb, catching a panic of it (see `read_panicked`). Such a panic is
/// not printed with its backtrace by the default hook: its caller reports it as an error, once
/// (a lease that met a damaged page every second printed a backtrace every second).
fn catching<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if CATCHING.with(std::cell::Cell::get) {
                let at = info.location().map(ToString::to_string);
                CAUGHT_AT.with(|c| *c.borrow_mut() = at);
            } else {
                previous(info);
            }
        }));
    });
    let was = CATCHING.with(|c| c.replace(true));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    CATCHING.with(|c| c.set(was));
    r
}

/// The error of a redb call that panicked (`what` it was doing): redb trusts the pages of a
/// cleanly closed file, and one damaged outside it (a bad disk, a stray write) can make it
/// index out of a page's bounds. Said as a damaged file, with what to run.
pub(crate) fn read_panicked(what: &str, payload: &(dyn std::any::Any + Send)) -> StoreError {
    let mut msg = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".into());
    if let Some(at) = CAUGHT_AT.with(|c| c.borrow_mut().take()) {
        msg = format!("{msg}, at {at}");
    }
    StoreError::Corrupt {
        table: "file",
        message: format!(
            "redb panicked reading {what} ({msg}): a page of the store file may be damaged; stop \
             the router and run `router store check --data-dir DIR` (docs/operations.md, \"A \
             damaged store file\")"
        ),
    }
}

/// The `Store` trait's reads, synchronous: a read transaction on the local file. Tests and
/// tools call them directly; the trait wraps them in futures.
impl RedbStore {
    /// See [`Store::target_states`] (answered here synchronously, from the file).
    pub fn target_states(&self) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
        #[cfg(test)]
        self.target_state_reads.fetch_add(1, Ordering::Relaxed);
        self.read_named_json(TARGET_STATE, "target_state")
    }

    /// How many times [`Self::target_states`] read the table.
    #[cfg(test)]
    pub(crate) fn target_state_reads(&self) -> u64 {
        self.target_state_reads.load(Ordering::Relaxed)
    }

    /// See [`Store::jobs`] (answered here synchronously, from the file).
    pub fn jobs(&self) -> Result<Vec<Job>, StoreError> {
        let db = self.read_db();
        let r = db.begin_read()?;
        let t = r.open_table(JOBS)?;
        let mut out = Vec::new();
        for row in t.iter()? {
            out.push(dec("jobs", row?.1.value())?);
        }
        Ok(out)
    }

    /// See [`Store::dlq_summary`] (answered here synchronously, from the file).
    pub fn dlq_summary(
        &self,
        filter: &DlqFilter,
        bucket_ms: i64,
    ) -> Result<Vec<SummaryRow>, StoreError> {
        let db = self.read_db();
        let r = db.begin_read()?;
        let mut summary = DlqSummary::new(bucket_ms);
        scan_dlq(&r, filter, 0, |_, head| {
            summary.add(&head);
            Ok(true)
        })?;
        Ok(summary.rows())
    }

    /// See [`Store::events_between`] (answered here synchronously, from the file).
    pub fn events_between(
        &self,
        from: Millis,
        to: Millis,
        after_seq: u64,
        limit: usize,
        max_bytes: usize,
    ) -> Result<Vec<StoredEvent>, StoreError> {
        let mut out = Vec::new();
        let mut bytes = 0usize;
        self.scan_archived_sized(from, to, after_seq, |ev, size| {
            // The event past the budget is not taken (the next page starts with it), unless
            // it is the first: a page always moves the caller on.
            if !out.is_empty() && bytes.saturating_add(size) > max_bytes {
                return false;
            }
            bytes = bytes.saturating_add(size);
            out.push(ev);
            out.len() < limit
        })?;
        Ok(out)
    }

    /// See [`Store::count_events_between`] (answered here synchronously, from the file).
    pub fn count_events_between(&self, from: Millis, to: Millis) -> Result<u64, StoreError> {
        let mut n = 0;
        self.scan_archived(from, to, 0, |_| {
            n += 1;
            true
        })?;
        Ok(n)
    }

    /// Visits the archived (not quarantined) events accepted in [`from`, `to`) with a sequence
    /// after `after_seq`, in sequence order, while `visit` says to go on. The read starts where
    /// the range starts (`first_seq_from`) and ends at the first event accepted at or after
    /// `to`: sequence numbers follow acceptance order, clock steps back tolerated by the slack.
    fn scan_archived(
        &self,
        from: Millis,
        to: Millis,
        after_seq: u64,
        mut visit: impl FnMut(StoredEvent) -> bool,
    ) -> Result<(), StoreError> {
        self.scan_archived_sized(from, to, after_seq, |ev, _| visit(ev))
    }

    /// [`Self::scan_archived`], with each event's stored size in bytes.
    fn scan_archived_sized(
        &self,
        from: Millis,
        to: Millis,
        after_seq: u64,
        mut visit: impl FnMut(StoredEvent, usize) -> bool,
    ) -> Result<(), StoreError> {
        let db = self.read_db();
        let r = db.begin_read()?;
        let t = r.open_table(EVENTS)?;
        let start = first_seq_from(&t, from.saturating_sub(ACCEPT_SLACK_MS))?
            .max(after_seq.saturating_add(1));
        for row in t.range(start..)? {
            let (k, v) = row?;
            let size = v.value().len();
            let ev = dec_event(k.value(), v.value())?;
            if ev.accepted_at >= to.saturating_add(ACCEPT_SLACK_MS) {
                break;
            }
            if ev.accepted_at >= from && ev.accepted_at < to && !ev.quarantined && !visit(ev, size)
            {
                break;
            }
        }
        Ok(())
    }

    /// The value under `key` in a table of (expiry, value) records, unless expired at `now`
    /// (COMPLETED records, handler key-value entries).
    fn unexpired(
        &self,
        table: TableDefinition<(&str, &str), (i64, &[u8])>,
        key: (&str, &str),
        now: Millis,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let db = self.read_db();
        let r = db.begin_read()?;
        let t = r.open_table(table)?;
        Ok(t.get(key)?.and_then(|v| {
            let (exp, val) = v.value();
            (exp > now).then(|| val.to_vec())
        }))
    }

    /// See [`Store::completed_get`] (answered here synchronously, from the file).
    pub fn completed_get(
        &self,
        handler: &str,
        key: &str,
        now: Millis,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        self.unexpired(COMPLETED, (handler, key), now)
    }

    /// See [`Store::kv_usage`] (answered here synchronously, from the file).
    pub fn kv_usage(&self) -> Result<BTreeMap<String, KvUsage>, StoreError> {
        let db = self.read_db();
        let r = db.begin_read()?;
        let t = r.open_table(KV_USAGE)?;
        t.iter()?
            .map(|row| {
                let (k, v) = row?;
                let (bytes, keys) = v.value();
                Ok((k.value().to_string(), KvUsage::from_counters(bytes, keys)))
            })
            .collect()
    }

    /// See [`Store::saved_targets`] (answered here synchronously, from the file).
    pub fn saved_targets(&self) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
        self.read_named_json(TARGETS, "targets")
    }

    /// See [`Store::fate`] (answered here synchronously, from the file).
    pub fn fate(&self, source: &str, id: &str) -> Result<Option<Fate>, StoreError> {
        let fp = dedup::fingerprint(&crate::event::dedup_key(source, id));
        let db = self.read_db();
        // The transaction begins under the index's lock: a run the committer registers (and
        // whose frozen memtable it drops) after this point is not in it, and one registered
        // before is in the snapshot.
        let (r, (mut seqs, runs)) = {
            let st = self.dedup_state();
            (db.begin_read()?, st.candidates(fp))
        };
        if !runs.is_empty() {
            let keys = r.open_table(DEDUP_RUN_KEYS)?;
            seqs.extend(run_candidates(&keys, &runs, fp, 0)?);
        }
        seqs.extend(kept_candidates(&r.open_table(DEDUP_KEPT)?, fp, 0)?);
        // Newest first; each candidate is confirmed against the event (a fingerprint is
        // not the key), and one whose event the sweep removed is skipped.
        let events = r.open_table(EVENTS)?;
        let mut found = None;
        // A candidate whose record does not decode cannot be confirmed; it is the event
        // asked for unless a later candidate is (fingerprints of 128 bits do not collide).
        let mut unreadable = None;
        // Older copies that were quarantined: a fixed copy took their place.
        let mut previous = Vec::new();
        let mut seen = BTreeSet::new();
        for seq in seqs {
            // A key may be in two layers of the index for a while (a run being written).
            if !seen.insert(seq) {
                continue;
            }
            if let Some(raw) = events.get(seq)? {
                let ev = match dec_event(seq, raw.value()) {
                    Ok(ev) => ev,
                    Err(e) => {
                        if found.is_none() {
                            unreadable.get_or_insert((seq, e));
                        }
                        continue;
                    }
                };
                if ev.event.source != source || ev.event.id != id {
                    continue;
                }
                if found.is_some() {
                    if ev.quarantined {
                        previous.push(ev);
                    }
                    continue;
                }
                // Entries queued at acceptance and unchanged since are its fan-out.
                let fanout: Vec<QueueEntry> = EventRecord::split(seq, raw.value())?
                    .entries()
                    .map(|(idx, record)| dec_entry((seq, idx), record))
                    .collect::<Result<_, _>>()?;
                found = Some((ev, fanout));
            }
        }
        let Some((event, fanout)) = found else {
            let Some((seq, e)) = unreadable else {
                return Ok(None);
            };
            // Answered as what it is, with where its deliveries went (their DLQ entries
            // are read without the event).
            let mut dlq = Vec::new();
            for row in r
                .open_table(DLQ_BY_EVENT)?
                .range((seq, 0)..=(seq, u64::MAX))?
            {
                dlq.push(row?.0.value().1.to_string());
            }
            let set_aside = if dlq.is_empty() {
                "none of its deliveries is in the DLQ yet (each goes there as corrupt_record when \
                 its target leases it)"
                    .to_string()
            } else {
                format!("its DLQ entries: {}", dlq.join(", "))
            };
            return Err(StoreError::Corrupt {
                table: "events",
                message: format!(
                    "the stored record of this event (sequence {seq}) cannot be read: {e}; {set_aside}"
                ),
            });
        };
        let seq = event.seq;
        let entries_t = r.open_table(ENTRIES)?;
        let mut entries = Vec::new();
        for row in entries_t.range((seq, 0)..=(seq, u32::MAX))? {
            let (k, v) = row?;
            entries.push(dec_entry(k.value(), v.value())?);
        }
        // A row takes precedence (below the floor every entry has one).
        let rows = entries.len();
        for e in fanout {
            if !entries[..rows].iter().any(|r| r.id == e.id) {
                entries.push(e);
            }
        }
        entries.sort_by_key(|e| e.id.idx);
        let by_ev = r.open_table(DLQ_BY_EVENT)?;
        let dlq_t = r.open_table(DLQ)?;
        let dlq_of = |seq: u64| -> Result<Vec<DlqEntry>, StoreError> {
            let mut dlq = Vec::new();
            for row in by_ev.range((seq, 0)..=(seq, u64::MAX))? {
                let (k, _) = row?;
                if let Some(d) = dlq_t.get(k.value().1)? {
                    dlq.push(dec("dlq", d.value())?);
                }
            }
            Ok(dlq)
        };
        let dlq = dlq_of(seq)?;
        // Newest first, as the fate's own copy is the newest.
        previous.sort_by_key(|p: &StoredEvent| std::cmp::Reverse(p.seq));
        let previous = previous
            .into_iter()
            .map(|event| {
                Ok(PreviousCopy {
                    dlq: dlq_of(event.seq)?,
                    event,
                })
            })
            .collect::<Result<_, StoreError>>()?;
        Ok(Some(Fate {
            event,
            entries,
            dlq,
            previous,
        }))
    }

    /// See [`Store::dlq_list`] (answered here synchronously, from the file).
    pub fn dlq_list(
        &self,
        filter: &DlqFilter,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<DlqEntry>, StoreError> {
        let db = self.read_db();
        let r = db.begin_read()?;
        let start = after.map_or(0, |a| a.saturating_add(1));
        let mut out = Vec::new();
        for_each_dlq(&r, filter, start, |e| {
            out.push(e);
            out.len() < limit
        })?;
        Ok(out)
    }

    /// See [`Store::dlq_mark`] (answered here synchronously, from the file). One writer
    /// numbers dead letters in the order it commits them (after a crash it goes on from the
    /// number committed last), so the highest id is the mark too.
    pub fn dlq_mark(&self) -> Result<DlqMark, StoreError> {
        let db = self.read_db();
        let r = db.begin_read()?;
        let t = r.open_table(DLQ)?;
        let max_id = t.last()?.map_or(0, |(k, _)| k.value());
        Ok(DlqMark {
            max_id,
            made: max_id,
        })
    }

    /// See [`Store::dlq_get`] (answered here synchronously, from the file).
    pub fn dlq_get(&self, id: u64) -> Result<Option<(DlqEntry, StoredEvent)>, StoreError> {
        let db = self.read_db();
        let r = db.begin_read()?;
        let t = r.open_table(DLQ)?;
        let Some(v) = t.get(id)? else { return Ok(None) };
        let e: DlqEntry = dec("dlq", v.value())?;
        let events = r.open_table(EVENTS)?;
        let Some(ev) = events.get(e.event_seq)? else {
            return Err(StoreError::Corrupt {
                table: "dlq",
                message: format!("entry {id} refers to missing event {}", e.event_seq),
            });
        };
        let ev = dec_event(e.event_seq, ev.value())?;
        Ok(Some((e, ev)))
    }

    /// See [`Store::disk_bytes`] (answered here synchronously, from the file).
    pub fn disk_bytes(&self) -> u64 {
        let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
        self.path.as_ref().map_or(0, |p| {
            let logs = p
                .parent()
                .map_or(0, |d| FILE_NAMES.iter().map(|n| size(&d.join(n))).sum());
            size(p) + logs
        })
    }

    /// See [`Store::record_counts`] (answered here synchronously, from the file).
    pub fn record_counts(&self) -> Result<RecordCounts, StoreError> {
        let db = self.read_db();
        let r = db.begin_read()?;
        // One look at the index, not held while the tables are read.
        let window_start = cold_before(self.dedup_window);
        let (dedup_keys, dedup_keys_in_window, dedup_runs, dedup_filter_bytes, dedup_cold_runs) = {
            let d = self.dedup_state();
            (
                d.keys(),
                window_start.map(|at| d.keys_since(at)),
                d.runs.len() as u64,
                d.filter_bytes() as u64,
                d.cold_runs() as u64,
            )
        };
        // Sequence numbers above the floor are all taken by events the sweep cannot reach yet.
        let meta = r.open_table(META)?;
        let above = match (
            read_u64(&meta, "next_seq")?,
            read_u64(&meta, "entry_floor")?,
        ) {
            (Some(next), Some(floor)) => next.saturating_sub(floor),
            _ => 0,
        };
        Ok(RecordCounts {
            events: r.open_table(EVENTS)?.len()?,
            events_above_floor: above,
            // Keys of the memtable and the runs: a kept event's key may be in both a run and
            // `DEDUP_KEPT` until its run is dropped, and is counted with its event.
            dedup_keys,
            dedup_keys_in_window,
            dedup_runs,
            dedup_filter_bytes,
            dedup_cold_runs,
            completed: r.open_table(COMPLETED)?.len()?,
            kv_keys: r.open_table(KV)?.len()?,
        })
    }
}

impl Store for RedbStore {
    fn accept(
        &self,
        events: Vec<NewEvent>,
    ) -> BoxFuture<'_, Result<Vec<AcceptOutcome>, StoreError>> {
        async move {
            self.not_compacting()?;
            let events = events.into_iter().map(Prepared::new).collect();
            let out = self.call(|reply| Op::Accept { events, reply }).await??;
            Ok(out.into_iter().map(|(outcome, _)| outcome).collect())
        }
        .boxed()
    }

    fn accept_leased(
        &self,
        events: Vec<NewEvent>,
    ) -> BoxFuture<'_, Result<AcceptedLeased, StoreError>> {
        async move {
            self.not_compacting()?;
            let token = || self.new_token();
            let mut handoffs = Vec::with_capacity(events.len());
            let events = events
                .into_iter()
                .map(|ne| {
                    let (p, h) = Prepared::leasing(ne, Some(&token));
                    handoffs.push(h);
                    p
                })
                .collect();
            let out = self.call(|reply| Op::Accept { events, reply }).await??;
            let mut outcomes = Vec::with_capacity(out.len());
            let mut leased = Vec::new();
            for (i, ((outcome, written), handoff)) in out.into_iter().zip(handoffs).enumerate() {
                let seq = match &outcome {
                    AcceptOutcome::Accepted { seq, .. } => Some(*seq),
                    AcceptOutcome::Duplicate { .. } => None,
                };
                outcomes.push(outcome);
                let (Some(seq), Some(h)) = (seq, handoff) else {
                    continue;
                };
                if written.is_empty() {
                    continue;
                }
                let mut event = h.event;
                event.seq = seq;
                let event = Arc::new(event);
                for mut entry in h.entries {
                    let Some(lease) = entry.lease else { continue };
                    if !written.contains(&entry.id.idx) {
                        continue;
                    }
                    entry.id.event = seq;
                    leased.push(LeasedAtAccept {
                        event: i,
                        leased: Leased {
                            entry,
                            event: event.clone(),
                            lease,
                        },
                    });
                }
            }
            Ok((outcomes, leased))
        }
        .boxed()
    }

    fn lease_batch(
        &self,
        target: &str,
        now: Millis,
        max: usize,
        lease_ms: i64,
    ) -> BoxFuture<'_, Result<LeaseBatch, StoreError>> {
        let target = target.to_string();
        async move { self.lease_impl(&target, now, max, lease_ms).await }.boxed()
    }

    fn finish(
        &self,
        id: EntryId,
        lease: Lease,
        end: AttemptEnd,
        disposition: Disposition,
        now: Millis,
    ) -> BoxFuture<'_, Result<Finished, FinishError>> {
        async move {
            self.call(|reply| Op::Finish {
                id,
                lease,
                end,
                disposition,
                now,
                reply,
            })
            .await
            .map_err(FinishError::Store)?
        }
        .boxed()
    }

    fn due_count(&self, target: &str, now: Millis, max: usize) -> usize {
        self.index().target(target).due(now, max).len()
    }

    fn put_target_state(
        &self,
        id: &str,
        state: serde_json::Value,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        let id = id.to_string();
        async move {
            self.call(|reply| Op::PutTargetState { id, state, reply })
                .await?
        }
        .boxed()
    }

    fn target_states(&self) -> BoxFuture<'_, Result<Vec<(String, serde_json::Value)>, StoreError>> {
        async move { RedbStore::target_states(self) }.boxed()
    }

    fn release_key(&self, target: &str, key: &str) -> BoxFuture<'_, Result<bool, StoreError>> {
        let (target, key) = (target.to_string(), key.to_string());
        async move {
            self.call(|reply| Op::ReleaseKey { target, key, reply })
                .await?
        }
        .boxed()
    }

    fn dead_letter_queued(
        &self,
        target: &str,
        reason: DlqReason,
        message: &str,
        now: Millis,
    ) -> BoxFuture<'_, Result<usize, StoreError>> {
        let taken: Vec<(EntryId, Millis)> = {
            let mut idx = self.index();
            let t = idx.target(target);
            let mut taken: Vec<(EntryId, Millis)> = std::mem::take(&mut t.ready)
                .into_iter()
                .map(|(due, id)| (id, due))
                .collect();
            taken.extend(std::mem::take(&mut t.parked));
            for (id, _) in &taken {
                t.in_flight.insert(*id, PSEUDO_LEASE);
            }
            taken
        };
        self.dead_letter_taken(target, taken, reason, message, now)
    }

    fn dead_letter_expired_of_key(
        &self,
        target: &str,
        key: &str,
        accepted_before: Millis,
        message: &str,
        now: Millis,
    ) -> BoxFuture<'_, Result<usize, StoreError>> {
        let taken: Vec<(EntryId, Millis)> = {
            let mut idx = self.index();
            let t = idx.target(target);
            let expired: Vec<EntryId> = t.keys.get(key).map_or_else(Vec::new, |ids| {
                ids.iter()
                    .copied()
                    .filter(|id| {
                        !t.in_flight.contains_key(id)
                            && t.live.get(id).is_some_and(|at| *at < accepted_before)
                    })
                    .collect()
            });
            let mut taken = Vec::with_capacity(expired.len());
            for id in expired {
                // A held key's entries are parked; one in `ready` (the key's first, held since)
                // is found by a scan, as `TargetIndex::hold` does.
                let due = match t.parked.remove(&id) {
                    Some(due) => Some(due),
                    None => t
                        .ready
                        .iter()
                        .find(|(_, r)| *r == id)
                        .map(|&(due, _)| due)
                        .inspect(|due| {
                            t.ready.remove(&(*due, id));
                        }),
                };
                if let Some(due) = due {
                    t.in_flight.insert(id, PSEUDO_LEASE);
                    taken.push((id, due));
                }
            }
            taken
        };
        self.dead_letter_taken(target, taken, DlqReason::MaxAgeExceeded, message, now)
    }

    fn put_job(&self, job: Job) -> BoxFuture<'_, Result<u64, StoreError>> {
        async move { self.call(|reply| Op::PutJob { job, reply }).await? }.boxed()
    }

    fn jobs(&self) -> BoxFuture<'_, Result<Vec<Job>, StoreError>> {
        async move { RedbStore::jobs(self) }.boxed()
    }

    fn delete_jobs(&self, jobs: Vec<Job>) -> BoxFuture<'_, Result<u64, StoreError>> {
        async move { self.call(|reply| Op::DeleteJobs { jobs, reply }).await? }.boxed()
    }

    fn redrive_step(
        &self,
        job: Job,
        actions: Vec<RedriveAction>,
        now: Millis,
    ) -> BoxFuture<'_, Result<(u64, RedriveGone), StoreError>> {
        async move {
            self.call(|reply| Op::RedriveStep {
                job,
                actions,
                now,
                reply,
            })
            .await?
        }
        .boxed()
    }

    fn replay_step(
        &self,
        job: Job,
        items: Vec<ReplayItem>,
        now: Millis,
    ) -> BoxFuture<'_, Result<ReplayStepped, StoreError>> {
        async move {
            self.call(|reply| Op::ReplayStep {
                job,
                items,
                now,
                reply,
            })
            .await?
        }
        .boxed()
    }

    fn purge_dlq(&self, ids: Vec<u64>) -> BoxFuture<'_, Result<u64, StoreError>> {
        async move { self.call(|reply| Op::PurgeDlq { ids, reply }).await? }.boxed()
    }

    fn kv_clear<'a>(&'a self, namespace: &'a str) -> BoxFuture<'a, Result<u64, StoreError>> {
        self.clear_in_groups(move |max, reply| Op::KvClear {
            namespace: namespace.to_owned(),
            max,
            reply,
        })
        .boxed()
    }

    fn completed_clear<'a>(&'a self, handler: &'a str) -> BoxFuture<'a, Result<u64, StoreError>> {
        self.clear_in_groups(move |max, reply| Op::CompletedClear {
            handler: handler.to_owned(),
            max,
            reply,
        })
        .boxed()
    }

    fn dlq_summary<'a>(
        &'a self,
        filter: &'a DlqFilter,
        bucket_ms: i64,
    ) -> BoxFuture<'a, Result<Vec<SummaryRow>, StoreError>> {
        async move { crate::blocking::off_reactor(|| RedbStore::dlq_summary(self, filter, bucket_ms)) }.boxed()
    }

    fn events_between(
        &self,
        from: Millis,
        to: Millis,
        after_seq: u64,
        limit: usize,
        max_bytes: usize,
    ) -> BoxFuture<'_, Result<Vec<StoredEvent>, StoreError>> {
        async move {
            crate::blocking::off_reactor(|| {
                RedbStore::events_between(self, from, to, after_seq, limit, max_bytes)
            })
        }
        .boxed()
    }

    fn count_events_between(
        &self,
        from: Millis,
        to: Millis,
    ) -> BoxFuture<'_, Result<u64, StoreError>> {
        async move { crate::blocking::off_reactor(|| RedbStore::count_events_between(self, from, to)) }.boxed()
    }

    fn completed_get<'a>(
        &'a self,
        handler: &'a str,
        key: &'a str,
        now: Millis,
    ) -> BoxFuture<'a, Result<Option<Vec<u8>>, StoreError>> {
        async move { RedbStore::completed_get(self, handler, key, now) }.boxed()
    }

    fn kv_get(
        &self,
        namespace: &str,
        key: &str,
        now: Millis,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        self.unexpired(KV, (namespace, key), now)
    }

    fn record_counts(&self) -> BoxFuture<'_, Result<RecordCounts, StoreError>> {
        async move { RedbStore::record_counts(self) }.boxed()
    }

    fn kv_usage(&self) -> BoxFuture<'_, Result<BTreeMap<String, KvUsage>, StoreError>> {
        async move { RedbStore::kv_usage(self) }.boxed()
    }

    fn kv_usage_of(&self, namespace: &str) -> Result<KvUsage, StoreError> {
        let db = self.read_db();
        let r = db.begin_read()?;
        let t = r.open_table(KV_USAGE)?;
        Ok(t.get(namespace)?.map_or_else(KvUsage::default, |v| {
            let (bytes, keys) = v.value();
            KvUsage::from_counters(bytes, keys)
        }))
    }

    fn held_keys(&self, target: &str) -> Vec<String> {
        self.index()
            .target(target)
            .held
            .iter()
            .map(|k| k.to_string())
            .collect()
    }

    fn key_head(&self, target: &str, key: &str) -> Option<KeyHead> {
        let mut idx = self.index();
        let t = idx.target(target);
        if t.unordered {
            // No entry waits for another of its key.
            return None;
        }
        match t.flying.get(key) {
            Some(&entry) => Some(KeyHead {
                entry,
                in_flight: true,
            }),
            None => t.keys.get(key)?.first().map(|&entry| KeyHead {
                entry,
                in_flight: t.in_flight.contains_key(&entry),
            }),
        }
    }

    fn set_ordered(&self, target: &str, ordered: bool) {
        self.index().set_ordered(target, ordered);
    }

    fn next_due(&self, target: &str) -> Option<Millis> {
        // Blocked entries are parked; one can be in `ready` only when a redriven entry took
        // the front of its key (`TargetIndex::due`), so the first is nearly always the answer.
        let mut idx = self.index();
        let t = idx.target(target);
        t.ready
            .iter()
            .find(|(_, id)| t.ordering_allows(*id))
            .map(|(d, _)| *d)
    }

    fn notifier(&self, target: &str) -> Arc<Notify> {
        self.index()
            .notifiers
            .entry(target.to_string())
            .or_insert_with(|| Arc::new(Notify::new()))
            .clone()
    }

    fn reclaim_expired(&self, now: Millis) -> usize {
        let mut idx = self.index();
        let mut woken = Vec::new();
        let mut n = 0;
        for (name, t) in idx.targets.iter_mut() {
            let expired: Vec<EntryId> = t
                .in_flight
                .iter()
                .filter(|(_, l)| l.until < now)
                .map(|(id, _)| *id)
                .collect();
            for id in &expired {
                t.land(*id);
                t.enqueue(*id, now);
            }
            if !expired.is_empty() {
                n += expired.len();
                woken.push(name.clone());
            }
        }
        for name in woken {
            idx.notify(&name);
        }
        n
    }

    fn save_targets(
        &self,
        configs: Vec<(String, serde_json::Value)>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        async move {
            self.call(|reply| Op::SaveTargets { configs, reply })
                .await?
        }
        .boxed()
    }

    fn saved_targets(&self) -> BoxFuture<'_, Result<Vec<(String, serde_json::Value)>, StoreError>> {
        async move { RedbStore::saved_targets(self) }.boxed()
    }

    fn targets_with_entries(&self) -> Vec<String> {
        self.index()
            .targets
            .iter()
            .filter(|(_, t)| !t.live.is_empty())
            .map(|(k, _)| k.clone())
            .collect()
    }

    fn fate<'a>(
        &'a self,
        source: &'a str,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Fate>, StoreError>> {
        async move { RedbStore::fate(self, source, id) }.boxed()
    }

    fn dlq_list<'a>(
        &'a self,
        filter: &'a DlqFilter,
        after: Option<u64>,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<DlqEntry>, StoreError>> {
        async move { crate::blocking::off_reactor(|| RedbStore::dlq_list(self, filter, after, limit)) }.boxed()
    }

    fn dlq_mark(&self) -> BoxFuture<'_, Result<DlqMark, StoreError>> {
        async move { RedbStore::dlq_mark(self) }.boxed()
    }

    fn dlq_get(
        &self,
        id: u64,
    ) -> BoxFuture<'_, Result<Option<(DlqEntry, StoredEvent)>, StoreError>> {
        async move { RedbStore::dlq_get(self, id) }.boxed()
    }

    fn dlq_without_target(&self) -> u64 {
        self.index().dlq_without_target
    }

    fn queue_stats(&self) -> BTreeMap<String, QueueStats> {
        self.index()
            .targets
            .iter()
            .map(|(k, t)| {
                (
                    k.clone(),
                    QueueStats {
                        queued: (t.ready.len() + t.parked.len()) as u64,
                        in_flight: t.in_flight.len() as u64,
                        oldest_accepted_at: t.live.values().min().copied(),
                        dlq: t.dlq,
                        queued_behind_keys: t.parked.len() as u64,
                    },
                )
            })
            .collect()
    }

    fn sweep(
        &self,
        now: Millis,
        dedup_window_ms: i64,
        retention_ms: i64,
    ) -> BoxFuture<'_, Result<SweepStats, StoreError>> {
        async move {
            self.call(|reply| Op::Sweep {
                now,
                dedup_window_ms,
                retention_ms,
                reply,
            })
            .await?
        }
        .boxed()
    }

    fn close(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        async move { self.call(|reply| Op::Close { reply }).await? }.boxed()
    }

    fn compacting(&self) -> bool {
        self.compacting.load(Ordering::Acquire)
    }

    fn writable(&self) -> bool {
        // Never waits: /readyz, /v1/status and /metrics ask, and a compaction holds the
        // database's write side for seconds (a probe that waited it out would time out, and
        // health checks would hang). A compaction is planned and reported on its own; the
        // write side held otherwise is a reopen after a write error.
        let open = match self.db.try_read() {
            Ok(slot) => slot.is_some(),
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().is_some(),
            Err(std::sync::TryLockError::WouldBlock) => self.compacting(),
        };
        open && !self
            .log_failed
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Acquire))
    }

    fn last_compaction(&self) -> Option<CompactionReport> {
        self.last_compaction
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn disk_bytes(&self) -> BoxFuture<'_, Option<u64>> {
        async move { Some(RedbStore::disk_bytes(self)) }.boxed()
    }
}

// ---------------------------------------------------------------------------------------------
// Open and recover

fn read_u64(
    meta: &impl ReadableTable<&'static str, &'static [u8]>,
    key: &str,
) -> Result<Option<u64>, StoreError> {
    Ok(match meta.get(key)? {
        Some(v) => {
            let b: [u8; 8] = v.value().try_into().map_err(|_| StoreError::Corrupt {
                table: "meta",
                message: format!("{key} is not 8 bytes"),
            })?;
            Some(u64::from_le_bytes(b))
        }
        None => None,
    })
}

/// Applies the group log's records that the durable state does not hold yet, in one durable
/// commit; returns the sequence number of the last group the store now holds.
///
/// A log file whose records stop at a record that does not check, with records of later
/// groups past it, is damage, not a torn tail: refused (nothing applied), naming the file and
/// the offset, since applying the groups before it and dropping the rest lost acknowledged
/// groups without a word (and the writer then wrote over them). `dir` names the files.
fn replay_log(
    db: &Database,
    images: &super::group_log::Images,
    dir: Option<&Path>,
) -> Result<u64, StoreError> {
    let held = {
        let r = db.begin_read()?;
        match r.open_table(META) {
            Ok(meta) => read_u64(&meta, "log_seq")?.unwrap_or(0),
            Err(redb::TableError::TableDoesNotExist(_)) => 0,
            Err(e) => return Err(e.into()),
        }
    };
    if let Some(d) = super::group_log::damage(images, held) {
        let name = FILE_NAMES[d.file];
        let file = dir.map_or_else(
            || name.to_string(),
            |dir| dir.join(name).display().to_string(),
        );
        let (first, last) = d.seqs;
        return Err(StoreError::Corrupt {
            table: "group log",
            message: format!(
                "{file} is damaged at offset {offset}: the record there does not check, and \
                 {n} groups written after it follow (sequence numbers {first} to {last}), \
                 acknowledged unless a power cut tore the last write before its sync. Opening \
                 would apply only the groups before the damage and lose those, so the store \
                 refuses to open. Keep a copy of the data directory, then restore it from a \
                 backup, or accept the loss of the groups past the damage by cutting the file \
                 there: truncate -s {offset} {file} (docs/operations.md, \"A damaged group \
                 log\")",
                offset = d.offset,
                n = d.later_groups,
            ),
        });
    }
    let records = super::group_log::records_of(images);
    let mut txn = db.begin_write()?;
    txn.set_durability(Durability::Immediate)?;
    // A layout this build does not know is refused before anything is written into it (the
    // check in `recover` comes after the log is applied).
    let version = read_u64(&txn.open_table(META)?, "format_version")?;
    if let Some(v) = version
        && v > u64::from(FORMAT_VERSION)
    {
        txn.abort()?;
        return Err(StoreError::FormatVersion {
            found: u32::try_from(v).unwrap_or(u32::MAX),
            expected: FORMAT_VERSION,
            file: None,
        });
    }
    let after = read_u64(&txn.open_table(META)?, "log_seq")?.unwrap_or(0);
    let last = logged::replay(&txn, &records, after)?;
    if last > after {
        txn.commit()?;
        tracing::info!(
            groups = last - after,
            last_group = last,
            "replayed the group log"
        );
    } else {
        txn.abort()?;
    }
    Ok(last)
}

/// What the recovery at open rebuilds from the file.
struct Recovered {
    /// This process's boot epoch (leases carry it).
    boot: u64,
    /// `next_seq`, `next_dlq`.
    counters: (u64, u64),
    index: Index,
    dedup: dedup::DedupState,
    /// The entry floor (`Committer::floor`).
    floor: u64,
}

/// Checks the format version, bumps the boot epoch, reclaims leases of the dead process and
/// rebuilds the in-memory indexes.
/// The acceptance time before which a dedup run is opened cold (without its filter): the
/// start of the dedup window now.
fn cold_before(window: Option<Duration>) -> Option<i64> {
    let window = i64::try_from(window?.as_millis()).unwrap_or(i64::MAX);
    Some(crate::clock::Clock::now_ms(&crate::clock::SystemClock).saturating_sub(window))
}

fn recover(db: &Database, cold_before: Option<i64>) -> Result<Recovered, StoreError> {
    let mut txn = db.begin_write()?;
    txn.set_durability(Durability::Immediate)?;
    let boot;
    let counters;
    let floor;
    let mut index = Index::default();
    // Format 6 added the DLQ's index by target, format 7 the dedup keys of kept events:
    // older stores have them built below.
    let before_dlq_index;
    let before_dedup_kept;
    {
        let mut meta = txn.open_table(META)?;
        let found = read_u64(&meta, "format_version")?;
        before_dlq_index = found.is_some_and(|v| v < 6);
        before_dedup_kept = found.is_some_and(|v| v < 7);
        match found {
            None => {
                meta.insert(
                    "format_version",
                    u64::from(FORMAT_VERSION).to_le_bytes().as_slice(),
                )?;
            }
            Some(v) if v == u64::from(FORMAT_VERSION) => {}
            // Older layouts this build reads as they are: mark the store as the current one
            // (records written from now on have its layout).
            Some(v)
                if (u64::from(OLDEST_READABLE_FORMAT)..u64::from(FORMAT_VERSION)).contains(&v) =>
            {
                tracing::info!(from = v, to = FORMAT_VERSION, "store format upgraded");
                meta.insert(
                    "format_version",
                    u64::from(FORMAT_VERSION).to_le_bytes().as_slice(),
                )?;
            }
            Some(v) => {
                return Err(StoreError::FormatVersion {
                    found: u32::try_from(v).unwrap_or(u32::MAX),
                    expected: FORMAT_VERSION,
                    file: None,
                });
            }
        }
        boot = read_u64(&meta, "boot")?.unwrap_or(0) + 1;
        meta.insert("boot", boot.to_le_bytes().as_slice())?;
        counters = (
            read_u64(&meta, "next_seq")?.unwrap_or(1),
            read_u64(&meta, "next_dlq")?.unwrap_or(1),
        );
        // A store of format 4 or older has every entry in `entries` and every live one in
        // `live`: its floor is past its last event.
        floor = match read_u64(&meta, "entry_floor")? {
            Some(f) => f,
            None => {
                meta.insert("entry_floor", counters.0.to_le_bytes().as_slice())?;
                counters.0
            }
        };
        // Create every table so readers never see "table does not exist".
        let events = txn.open_table(EVENTS)?;
        txn.open_table(TARGETS)?;
        let live = txn.open_table(LIVE)?;
        let mut entries = txn.open_table(ENTRIES)?;
        // Live entries: below the floor, those `live` lists; above it, every row of
        // `entries` still queued and every fan-out entry without a row.
        let mut ids: Vec<EntryId> = live
            .iter()?
            .map(|r| {
                r.map(|(k, _)| {
                    let (event, idx) = k.value();
                    EntryId { event, idx }
                })
            })
            .collect::<Result<_, _>>()?;
        let mut rows_above = BTreeSet::new();
        for row in entries.range((floor, 0)..)? {
            let (event, idx) = row?.0.value();
            rows_above.insert(EntryId { event, idx });
        }
        let mut fanout = Vec::new();
        for row in events.range(floor..)? {
            let (k, v) = row?;
            let seq = k.value();
            for (idx, record) in EventRecord::split(seq, v.value())?.entries() {
                if !rows_above.contains(&EntryId { event: seq, idx }) {
                    fanout.push(dec_entry((seq, idx), record)?);
                }
            }
        }
        drop(events);
        ids.extend(rows_above);
        let now = chrono::Utc::now().timestamp_millis();
        let mut reclaimed: BTreeMap<String, u64> = BTreeMap::new();
        let from_rows = ids.into_iter().map(|id| (id, None));
        let from_fanout = fanout.into_iter().map(|e| (e.id, Some(e)));
        for (id, fanout) in from_rows.chain(from_fanout) {
            let mut e = match fanout {
                Some(e) => e,
                None => {
                    let Some(raw) = entries.get((id.event, id.idx))? else {
                        continue;
                    };
                    dec_entry((id.event, id.idx), raw.value())?
                }
            };
            if e.state != EntryState::Queued {
                continue;
            }
            if e.lease.take().is_some() {
                if let Some(a) = e.attempts.last_mut().filter(|a| a.result.is_none()) {
                    a.finished_at = Some(now);
                    a.result = Some(AttemptResult::Interrupted);
                    a.error = Some(
                        "the router stopped during this attempt; lease reclaimed at start".into(),
                    );
                }
                entries.insert((id.event, id.idx), enc_entry(&e).as_slice())?;
                *reclaimed.entry(e.target_id.clone()).or_default() += 1;
            }
            let t = index.target(&e.target_id);
            t.ready.insert((e.due_at, id));
            t.insert_live(id, e.accepted_at, e.ordering_key.clone());
        }
        for (target, n) in &reclaimed {
            tracing::warn!(
                target_id = %target,
                entries = n,
                "leases held when the router stopped were reclaimed; their attempts count as interrupted"
            );
        }
        let dlq = txn.open_table(DLQ)?;
        let mut by_target = txn.open_table(DLQ_BY_TARGET)?;
        let rebuild = before_dlq_index || by_target.len()? != dlq.len()?;
        if rebuild {
            tracing::info!(entries = dlq.len()?, "building the DLQ's index by target");
            by_target.retain(|_, ()| false)?;
        }
        for row in dlq.iter()? {
            let (k, v) = row?;
            let e: DlqEntry = dec("dlq", v.value())?;
            if rebuild {
                by_target.insert((dlq_target_key(e.target_id.as_deref()), k.value()), ())?;
            }
            match e.target_id {
                Some(t) => index.target(&t).dlq += 1,
                None => index.dlq_without_target += 1,
            }
        }
        drop(by_target);
        txn.open_table(DLQ_BY_EVENT)?;
        let pending = txn.open_table(PENDING_GC)?;
        let mut kept = txn.open_table(DEDUP_KEPT)?;
        if before_dedup_kept {
            // Older builds left a kept event's key in its run (which it held): copy them out,
            // so the sweep may drop those runs.
            let events = txn.open_table(EVENTS)?;
            let mut n = 0u64;
            for row in pending.iter()? {
                let seq = row?.0.value();
                if let Some(raw) = events.get(seq)? {
                    kept.insert((record_fp(seq, raw.value())?, seq), ())?;
                    n += 1;
                }
            }
            if n > 0 {
                tracing::info!(events = n, "dedup keys of kept events indexed on their own");
            }
        }
        drop((pending, kept));
        txn.open_table(TARGET_STATE)?;
        txn.open_table(JOBS)?;
        txn.open_table(KV)?;
        txn.open_table(KV_EXP)?;
        txn.open_table(KV_USAGE)?;
        txn.open_table(COMPLETED)?;
        txn.open_table(COMPLETED_EXP)?;

        for row in txn.open_table(HELD)?.iter()? {
            let (k, _) = row?;
            let (t, key) = k.value();
            index.target(t).held.insert(Arc::from(key));
        }
        // Every entry went to `ready` above, before its key's order and holds were known.
        for t in index.targets.values_mut() {
            t.park_blocked();
        }
    }
    // Stores written before the KV sizes and expiry index were kept get them built once.
    if read_u64(&txn.open_table(META)?, "kv_accounting")?.is_none() {
        rebuild_kv_accounting(&Tx::unlogged(&txn))?;
        txn.open_table(META)?
            .insert("kv_accounting", 1u64.to_le_bytes().as_slice())?;
    }
    let dedup = recover_dedup(&txn, cold_before)?;
    txn.commit()?;
    Ok(Recovered {
        boot,
        counters,
        index,
        dedup,
        floor,
    })
}

/// Rebuilds the dedup index's memory from its tables: the registered runs with their
/// filters, the run tables' rows that no registered run owns (to be removed), and the
/// `dedup_log` rows above the newest run. A store of format 2 or older has its `dedup` table
/// moved into `dedup_log` first (its keys become the memtable, written as a run later).
fn recover_dedup(
    txn: &WriteTransaction,
    cold_before: Option<i64>,
) -> Result<dedup::DedupState, StoreError> {
    let mut log = txn.open_table(DEDUP_LOG)?;
    let has_old = txn.list_tables()?.any(|t| t.name() == OLD_DEDUP.name());
    if has_old {
        let started = Instant::now();
        let mut rows: Vec<(u64, dedup::Fp, i64)> = Vec::new();
        for row in txn.open_table(OLD_DEDUP)?.iter()? {
            let (k, v) = row?;
            let (seq, at) = v.value();
            rows.push((seq, dedup::fingerprint(k.value()), at));
        }
        rows.sort_unstable();
        for (seq, fp, at) in &rows {
            log.insert(*seq, (*fp, *at))?;
        }
        txn.delete_table(OLD_DEDUP)?;
        tracing::info!(
            keys = rows.len(),
            took_ms = started.elapsed().as_millis() as u64,
            "dedup keys moved to the run-based index (store format 3)"
        );
    }
    let mut runs = Vec::new();
    for row in txn.open_table(DEDUP_RUNS)?.iter()? {
        let (k, v) = row?;
        // A run wholly before the window is opened cold: accept never consults it, and its
        // filter (about 1.25 bytes a key) is not kept for the fate lookup's sake.
        let run = dedup::Run::decode(k.value(), v.value(), cold_before).map_err(|message| {
            StoreError::Corrupt {
                table: "dedup_runs",
                message,
            }
        })?;
        runs.push(run);
    }
    // The run ids that have rows: one seek per run, not a scan.
    let keys = txn.open_table(DEDUP_RUN_KEYS)?;
    let mut with_rows = Vec::new();
    let mut from = 0u64;
    while let Some(row) = keys.range((from, 0u128, 0u64)..)?.next() {
        let id = row?.0.value().0;
        with_rows.push(id);
        match id.checked_add(1) {
            Some(next) => from = next,
            None => break,
        }
    }
    let next_run = with_rows
        .iter()
        .chain(runs.iter().map(|r| &r.id))
        .max()
        .map_or(0, |id| id + 1);
    let orphans: Vec<u64> = with_rows
        .into_iter()
        .filter(|id| !runs.iter().any(|r| r.id == *id))
        .collect();
    let floor = runs.iter().map(|r| r.seq_hi).max().unwrap_or(0);
    let mut rows = Vec::new();
    for row in log.range(floor.saturating_add(1)..)? {
        let (k, v) = row?;
        let (fp, at) = v.value();
        rows.push((fp, k.value(), at));
    }
    drop(log);
    Ok(dedup::DedupState::rebuilt(runs, orphans, rows, next_run))
}

// ---------------------------------------------------------------------------------------------
// The committer

struct Committer {
    /// Entries enqueued per target by the group being built (not yet in the index).
    group_depth: FxHashMap<String, u64>,
    db: DbSlot,
    /// Shared with `RedbStore`: set for the duration of a compaction.
    compacting: Arc<AtomicBool>,
    /// The last group swept: check whether the file is worth compacting.
    check_compaction: bool,
    /// A compaction check is running.
    compact_checking: Arc<AtomicBool>,
    /// No compaction check starts before this: each one reads every page of the file, so
    /// checks are spaced by twenty times the last one's duration (at least
    /// `COMPACT_CHECK_GAP`). Checked after every sweep call, a 400 MB file was walked back to
    /// back while a steady load was swept, taking a core from ingest.
    compact_next_check: Arc<Mutex<Instant>>,
    /// A compaction check found the file worth compacting.
    compact_wanted: Arc<AtomicBool>,
    /// The most live data any check has seen since the last compaction.
    compact_peak_live: Arc<AtomicU64>,
    /// Wakes the committer when a check finds a compaction worthwhile: the compaction runs
    /// after the next group, and a router with nothing to commit (its ingest refused past the
    /// disk's high-water mark, its queues drained) would otherwise start one only at the next
    /// sweep, a `sweep_interval` later, with ingest refused all that time.
    compact_wake: mpsc::WeakSender<Op>,
    path: Option<std::path::PathBuf>,
    compact_due: bool,
    /// Set by a `Close`: the group that follows is a checkpoint (durable in the file).
    closing: bool,
    compact_min_bytes: u64,
    /// Events examined per sweep call.
    sweep_batch: usize,
    /// Shortest time between the starts of two commits.
    commit_delay: Duration,
    /// No compaction check below this file size: three times what the last compaction left
    /// (0 when its passes ran out with more to give back).
    compact_floor: u64,
    /// Shared with `RedbStore`: the last compaction's report.
    last_compaction: Arc<Mutex<Option<CompactionReport>>>,
    on_compact: Option<CompactObserver>,
    index: Arc<Mutex<Index>>,
    /// Shared with `RedbStore`: the dedup index's memory, changed only after a commit.
    dedup: Arc<RwLock<dedup::DedupState>>,
    /// The newest key of each fingerprint the group being built accepted (not in `dedup`
    /// until the group commits).
    dedup_group: rustc_hash::FxHashMap<dedup::Fp, (u64, i64)>,
    /// The same keys as rows, in acceptance order.
    dedup_rows: Vec<dedup::Row>,
    /// What the group did to the dedup tables, applied to `dedup` once it commits.
    dedup_fx: DedupFx,
    /// Rows of the frozen memtable written to its run by committed groups.
    frozen_written: usize,
    /// The sealed memtable and the thread sorting it into the frozen one.
    freezing: Option<(Arc<dedup::Sealed>, std::thread::JoinHandle<dedup::Frozen>)>,
    /// Memtables below this many keys are sorted inline (a thread is not worth it).
    freeze_inline_keys: usize,
    /// `StoreOptions::dedup_window`, for the recovery after a reopen.
    dedup_window: Option<Duration>,
    /// The memtable's bound in keys.
    memtable_keys: usize,
    /// The last group failed: no group of background work alone until one succeeds (a
    /// store that cannot reopen would otherwise retry it in a loop).
    last_group_failed: bool,
    next_seq: u64,
    next_dlq: u64,
    /// The entry floor (`meta`'s `entry_floor`): every entry of an event below it has a row in
    /// `entries`, and every live one a row in `live`. Above it, an entry queued at acceptance
    /// and unchanged since is only in its event's record (`event_record`), and `live` has
    /// none of them: the recovery reads the events above the floor instead.
    floor: u64,
    /// Where the next periodic move takes the floor: `next_seq` at the last one.
    floor_next: u64,
    /// Where the floor is on its way to (`advance_floor` moves it a batch per group).
    floor_goal: u64,
    /// When the floor last moved periodically.
    floor_moved: Instant,
    /// `StoreOptions::floor_every`.
    floor_every: Duration,
    /// (`next_seq`, `next_dlq`) as `meta` holds them: a group that changes neither (leases and
    /// acks only, most groups while delivery runs) leaves the table alone, one page fewer to
    /// write and sync.
    meta_counters: (u64, u64),
    on_commit: Option<CommitObserver>,
    /// How to reopen the database after a failed commit (`None`: in-memory, cannot).
    reopen: Option<Reopen>,
    /// A commit failed: reopen before the next one.
    poisoned: bool,
    /// The group log's writer (`None`: every group is a synced redb commit).
    log: Option<LogWriter>,
    /// Sequence number of the last group committed (kept in `meta` as `log_seq`).
    log_seq: u64,
    /// Log bytes written since the last checkpoint.
    log_bytes: u64,
    /// The store file's syncs (with a log, they run behind the committer).
    sync: SyncHandle,
    /// `sync.asked()` after the last checkpoint's commit: the sync that makes it durable,
    /// which the log must see completed before it switches files again.
    checkpoint_ticket: u64,
    last_checkpoint: Instant,
    checkpoint_every: Duration,
    /// The group's writes as they are made (one buffer for every group).
    mutations: Mutations,
    /// The group split into its accepts and other ops (buffers kept for every group).
    split: GroupSplit,
}

/// What a group did to the dedup index's tables (`Committer::dedup_maintenance`, the sweep),
/// applied to its memory once the group commits.
#[derive(Default)]
struct DedupFx {
    /// Rows of the frozen memtable written so far (this group wrote some).
    written: Option<usize>,
    /// This group wrote the frozen memtable's last rows and registered its run.
    registered: bool,
    /// This group removed the last rows of this orphan run.
    orphan_done: Option<u64>,
    /// This group removed the last `dedup_log` rows up to this sequence number.
    log_cleaned: Option<u64>,
    /// Runs this group's sweep unregistered.
    dropped: Vec<u64>,
    /// This group swept: runs wholly accepted before this time (the dedup window's start)
    /// lose their filter.
    cool_before: Option<i64>,
    /// Latest acceptance time among the group's keys (when the memtable's hour is over).
    latest_at: Option<i64>,
}

/// Where an accept's outcomes go.
type AcceptReply = Reply<Result<Vec<AcceptedOne>, StoreError>>;

/// One event's outcome, and the indices of its entries that were written leased (those asked
/// for, less any refused by a queue's depth cap).
type AcceptedOne = (AcceptOutcome, Vec<u32>);

/// A group's ops, split for `commit_group`: its accepts, applied in one call, and the rest.
/// The buffers are kept from one group to the next: allocated per group, they were freed and
/// returned to the OS between commits and faulted in (and zeroed) again by the next one —
/// measured at ≈ 4 % of the router's CPU, on the committer thread that bounds throughput.
#[derive(Default)]
struct GroupSplit {
    /// Each accept's reply and how many events it brought.
    accepts: Vec<(AcceptReply, usize)>,
    /// The accepts' events, in order.
    events: Vec<Prepared>,
    /// Finishes without an outbox that do not dead-letter (`PlainFinish`).
    finishes: Vec<PlainFinish>,
    /// Every other op, in order.
    others: Vec<Op>,
}

/// A finish that writes only its entry and the live index: no outbox, no dead letter. A
/// group's plain finishes are applied together with those two tables opened once
/// (`Committer::finish_plain`): a batching webhook finishes a hundred entries per request,
/// and each table open costs about what the entry's own write does.
struct PlainFinish {
    id: EntryId,
    lease: Lease,
    end: AttemptEnd,
    settle: Settle,
    now: Millis,
    reply: Reply<Result<Finished, FinishError>>,
}

/// What a finish that neither dead-letters nor has an outbox does to its entry.
#[derive(Debug, Clone, Copy)]
enum Settle {
    /// Delivered: final.
    Delivered,
    /// Back to the queue, due at `due_at`; `uncount` drops the attempt's record (a release).
    Requeue { due_at: Millis, uncount: bool },
}

impl Settle {
    fn of(d: &Disposition) -> Option<Self> {
        match *d {
            Disposition::Delivered => Some(Self::Delivered),
            Disposition::Retry { due_at } => Some(Self::Requeue {
                due_at,
                uncount: false,
            }),
            Disposition::Release { due_at } => Some(Self::Requeue {
                due_at,
                uncount: true,
            }),
            Disposition::DeadLetter { .. } => None,
        }
    }

    /// Applies this to `e` (whose attempt is closed) and the live index (which holds entries
    /// of events below `floor` only); returns the effect on the in-memory queue index.
    fn apply(
        self,
        e: &mut QueueEntry,
        id: EntryId,
        now: Millis,
        live: &mut LTable<'_, (u64, u32), ()>,
        floor: u64,
    ) -> Result<Effect, StoreError> {
        let target = e.target_id.clone();
        Ok(match self {
            Self::Delivered => {
                e.state = EntryState::Delivered;
                e.finished_at = Some(now);
                if id.event < floor {
                    live.remove((id.event, id.idx))?;
                }
                Effect::Remove {
                    target,
                    id,
                    hold: false,
                }
            }
            Self::Requeue { due_at, uncount } => {
                if uncount {
                    e.attempts.pop();
                }
                e.due_at = due_at;
                Effect::Requeue {
                    target,
                    id,
                    due: due_at,
                }
            }
        })
    }
}

/// The entry `lease` holds at `now`, refused as fenced when the lease is gone: expired,
/// taken over (and perhaps finished by the new holder), or the entry no longer queued.
fn leased_entry(
    raw: Option<&[u8]>,
    id: EntryId,
    lease: Lease,
    now: Millis,
) -> Result<QueueEntry, FinishError> {
    let Some(raw) = raw else {
        return Err(FinishError::NotFound);
    };
    let e = dec_entry((id.event, id.idx), raw)?;
    match e.lease {
        Some(l) if l.token == lease.token && l.until >= now && e.state == EntryState::Queued => {
            Ok(e)
        }
        _ => Err(FinishError::Fenced),
    }
}

impl Committer {
    /// Reopens the database after a failed commit: redb refuses every write after an I/O
    /// error until then. What is durable is the truth, so the in-memory index and counters
    /// are rebuilt from it (a commit that failed late may have landed after all); leases held
    /// by this process's workers are reclaimed like a restart's, so their late acks are
    /// fenced and the entries delivered again (at least once, never lost).
    fn try_reopen(&mut self) {
        let Some(reopen) = self.reopen.clone() else {
            return;
        };
        // The log's records as written so far (the writer handles everything sent before
        // first): groups it synced are durable and must be applied to what redb reopens on.
        let images = match &self.log {
            Some(log) => match log.read() {
                Ok(images) => Some(images),
                Err(e) => {
                    tracing::error!(error = %e, "reading the group log to reopen the store failed; writes are refused (503) until it succeeds");
                    return;
                }
            },
            None => None,
        };
        let mut slot = self.db.write().unwrap_or_else(|p| p.into_inner());
        // The failed handle holds the file lock: drop it before opening again.
        *slot = None;
        let sync = self.sync.clone();
        // A damaged page can make the reopen's recovery panic, as at start: an error, the
        // store staying closed, not a dead committer.
        let reopened = catching(|| {
            reopen().map_err(StoreError::from).and_then(|db| {
                let log_seq = match &images {
                    Some(images) => {
                        let seq = replay_log(&db, images, None)?;
                        // The log starts over its records below: their replay must be durable.
                        sync.wait_all().map_err(|e| {
                            StoreError::Backend(format!("sync the store file: {e}"))
                        })?;
                        seq
                    }
                    None => 0,
                };
                recover(&db, cold_before(self.dedup_window)).map(|r| (db, log_seq, r))
            })
        })
        .unwrap_or_else(|p| Err(read_panicked("the store file, reopening it", p.as_ref())));
        match reopened {
            Ok((
                db,
                log_seq,
                Recovered {
                    counters: (next_seq, next_dlq),
                    index,
                    dedup,
                    floor,
                    ..
                },
            )) => {
                *slot = Some(db);
                *self.dedup.write().unwrap_or_else(|p| p.into_inner()) = dedup;
                self.frozen_written = 0;
                // A memtable being sorted belongs to the state just replaced.
                self.freezing = None;
                self.poisoned = false;
                (self.next_seq, self.next_dlq) = (next_seq, next_dlq);
                self.meta_counters = (next_seq, next_dlq);
                self.floor = floor;
                self.floor_next = next_seq;
                self.floor_goal = floor;
                if let Some(log) = &self.log {
                    // Everything is durable in redb now: the log starts again.
                    self.log_seq = log_seq;
                    self.log_bytes = 0;
                    self.last_checkpoint = Instant::now();
                    self.checkpoint_ticket = self.sync.asked();
                    log.send(LogMsg::Restart);
                }
                let mut idx = self.index.lock().unwrap_or_else(|p| p.into_inner());
                // Workers keep their wake-up handles, and targets their live ordering (the
                // tables know only the keys entries were accepted with).
                let notifiers = std::mem::take(&mut idx.notifiers);
                let unordered = std::mem::take(&mut idx.unordered);
                *idx = index;
                idx.notifiers = notifiers;
                for t in &unordered {
                    if let Some(index) = idx.targets.get_mut(t) {
                        index.set_ordered(false);
                    }
                }
                idx.unordered = unordered;
                for t in idx.targets.keys().cloned().collect::<Vec<_>>() {
                    idx.notify(&t);
                }
                tracing::warn!("store reopened after a write error; writes resume");
            }
            Err(e) => {
                tracing::error!(error = %e, "reopening the store after a write error failed; writes are refused (503) until it succeeds");
            }
        }
    }

    /// Waits for the next op. While the database is closed after a write error, it keeps
    /// trying to reopen it even with nothing to write: readers (fates, the DLQ, /metrics)
    /// need it back as soon as the disk heals, not at the next write.
    fn next_op(&mut self, rx: &mut mpsc::Receiver<Op>) -> Option<Op> {
        loop {
            if !self.poisoned {
                return rx.blocking_recv();
            }
            match rx.try_recv() {
                Ok(op) => return Some(op),
                Err(mpsc::error::TryRecvError::Disconnected) => return None,
                Err(mpsc::error::TryRecvError::Empty) => {
                    std::thread::sleep(REOPEN_RETRY);
                    self.try_reopen();
                }
            }
        }
    }

    fn run(mut self, mut rx: mpsc::Receiver<Op>) {
        let mut deferred: std::collections::VecDeque<Op> = std::collections::VecDeque::new();
        let mut deferred_weight = 0usize;
        // One buffer for every group: a fresh vector per group grew by reallocation into
        // freshly faulted memory each time (measured ~7 % of the committer's CPU).
        let mut ops: Vec<Op> = Vec::with_capacity(MAX_GROUP);
        let mut effects: Vec<Effect> = Vec::new();
        let mut last_start: Option<Instant> = None;
        let mut closing: Option<oneshot::Sender<Result<(), StoreError>>> = None;
        loop {
            let first = match deferred.pop_front() {
                Some(op) => {
                    deferred_weight -= op.group_weight();
                    op
                }
                None => match rx.try_recv() {
                    Ok(op) => op,
                    // Quiet: the dedup index's pending work gets a group of its own.
                    Err(mpsc::error::TryRecvError::Empty)
                        if !self.poisoned && !self.last_group_failed && self.dedup_has_work() =>
                    {
                        self.commit_group(&mut ops, &mut effects);
                        continue;
                    }
                    // A memtable is being sorted: polled (like the compaction below), so that
                    // its run is written as soon as it is ready even if nothing else arrives.
                    Err(mpsc::error::TryRecvError::Empty)
                        if !self.poisoned && self.freezing.is_some() =>
                    {
                        match self.finished_freeze() {
                            Some((sealed, frozen)) => {
                                self.dedup
                                    .write()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .install(&sealed, frozen);
                            }
                            None => std::thread::sleep(Duration::from_millis(1)),
                        }
                        continue;
                    }
                    Err(_) => match self.next_op(&mut rx) {
                        Some(op) => op,
                        None => break,
                    },
                },
            };
            if let Op::Close { reply } = first {
                let _ = reply.send(self.close());
                return;
            }
            // The commit delay: whatever arrives while it runs joins this group. A first op
            // after a quiet spell (the last commit started longer ago) goes at once.
            if let Some(wait) = last_start
                .map(|t| self.commit_delay.saturating_sub(t.elapsed()))
                .filter(|w| !w.is_zero())
            {
                std::thread::sleep(wait);
            }
            last_start = Some(Instant::now());
            let mut weight = first.group_weight();
            ops.push(first);
            // Ops held back last time go first, in arrival order.
            while ops.len() < MAX_GROUP
                && let Some(op) = deferred.front()
                && weight + op.group_weight() <= MAX_GROUP_WEIGHT
            {
                let n = op.group_weight();
                weight += n;
                deferred_weight -= n;
                ops.extend(deferred.pop_front());
            }
            while ops.len() < MAX_GROUP && deferred_weight < MAX_DEFERRED_WEIGHT {
                let Ok(op) = rx.try_recv() else { break };
                if let Op::Close { reply } = op {
                    closing = Some(reply);
                    break;
                }
                let n = op.group_weight();
                if n > 0 && weight + n > MAX_GROUP_WEIGHT {
                    deferred_weight += n;
                    deferred.push_back(op);
                } else {
                    weight += n;
                    ops.push(op);
                }
            }
            // A compaction found worthwhile runs after this group, which is then a checkpoint.
            if self.compact_wanted.swap(false, Ordering::AcqRel) {
                self.compact_due = true;
            }
            self.commit_group(&mut ops, &mut effects);
            // Not while a compaction is due: the check's read transaction, open across the
            // compaction, made redb refuse it ("a transaction is still in progress").
            if std::mem::take(&mut self.check_compaction) && !self.compact_due {
                self.start_compaction_check();
            }
            if self.compact_due {
                self.compact_due = false;
                self.compact(&mut rx, &mut deferred);
                // The accepts it held back were refused.
                deferred_weight = deferred.iter().map(Op::group_weight).sum();
            }
            if let Some(reply) = closing.take() {
                let _ = reply.send(self.close());
                return;
            }
        }
    }

    /// Whether `target`'s queue is at its depth cap: its live entries and those this group
    /// adds.
    fn at_depth_cap(&self, target: &str, cap: u64) -> bool {
        let live = {
            let mut idx = self.index.lock().unwrap_or_else(|p| p.into_inner());
            idx.target(target).live.len() as u64
        };
        live + self.group_depth.get(target).copied().unwrap_or(0) >= cap
    }

    /// A clean stop: a last, durable group (with the group log, a checkpoint: the log's
    /// records are all in the file), then the file is closed, so the next open finds it
    /// clean. A process that exits with the file open leaves it marked for repair, and redb's
    /// repair at the next start walks and checksums every page: time that grows with the file,
    /// and a store that does not open at all over one bad page nothing reads.
    fn close(&mut self) -> Result<(), StoreError> {
        self.closing = true;
        let (mut ops, mut effects) = (Vec::new(), Vec::new());
        self.commit_group(&mut ops, &mut effects);
        if self.last_group_failed || self.poisoned {
            return Err(StoreError::Backend(
                "the last commit before closing failed; the file is repaired at the next start"
                    .into(),
            ));
        }
        let db = self.db.write().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(db) = db {
            db.close()
                .map_err(|e| StoreError::Backend(format!("closing the store file: {e}")))?;
        }
        self.sync
            .wait_all()
            .map_err(|e| StoreError::Backend(format!("sync the store file: {e}")))
    }

    /// The store file's size (`None`: in memory, or unreadable).
    fn file_len(&self) -> Option<u64> {
        self.path
            .as_ref()
            .and_then(|p| std::fs::metadata(p).ok())
            .map(|m| m.len())
    }

    /// Starts, on a thread of its own, the check whether the file is worth compacting:
    /// large, and mostly free pages (e.g. after a backlog drained). redb reuses free pages, so
    /// steady churn stays flat without compaction; it only gives space back to the file system
    /// after a peak. Counting live data walks every tree (2 s on a 4 GB file), which on the
    /// committer stalled every request for as long; a read transaction does not. The result
    /// is picked up by the committer before its next group.
    fn start_compaction_check(&self) {
        let Some(file_len) = self.file_len() else {
            return;
        };
        let not_yet = || {
            Instant::now()
                < *self
                    .compact_next_check
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
        };
        if file_len <= self.compact_min_bytes.max(self.compact_floor)
            || not_yet()
            || self.compact_checking.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let (db, wanted, checking, peak, next_check, wake) = (
            self.db.clone(),
            self.compact_wanted.clone(),
            self.compact_checking.clone(),
            self.compact_peak_live.clone(),
            self.compact_next_check.clone(),
            self.compact_wake.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name("store-compact-check".into())
            .spawn(move || {
                let started = Instant::now();
                let live = live_bytes(&db);
                let gap = (started.elapsed() * 20).max(COMPACT_CHECK_GAP);
                *next_check.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now() + gap;
                match live {
                    // Worthwhile once live data has at least halved from the most any check saw
                    // since the last compaction (a backlog drained), or the file is eight times
                    // the live data (a backlog that came and went between two checks). Not
                    // "the file is twice the live data" alone: while a queue grows, redb
                    // allocates ahead and the file is often 2-4x its live data, which is not
                    // space to give back; measured, that compacted again at every growth step.
                    // The read transaction is over: a compaction may start.
                    Ok(used) => {
                        let peak = peak.fetch_max(used, Ordering::AcqRel).max(used);
                        let drained = used.saturating_mul(2) <= peak;
                        let very_free = file_len > used.saturating_mul(8);
                        if file_len > used.saturating_mul(2) && (drained || very_free) {
                            wanted.store(true, Ordering::Release);
                            // This thread's read transaction has ended (live_bytes), so the
                            // compaction the woken committer starts is not refused by it.
                            if let Some(tx) = wake.upgrade() {
                                let _ = tx.try_send(Op::Wake);
                            }
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "could not size the store's live data"),
                }
                checking.store(false, Ordering::Release);
            });
        if spawned.is_err() {
            self.compact_checking.store(false, Ordering::Release);
        }
    }

    /// Compacts the file on a thread of its own (it holds the database exclusively: seconds on
    /// a large file) while this thread keeps answering: accepts and leases — those already
    /// queued, and any that raced past the callers' `not_compacting` check — are refused at
    /// once with `StoreError::Compacting`; every other op (acks, sweeps, jobs) waits in
    /// `deferred` and runs right after.
    fn compact(
        &mut self,
        rx: &mut mpsc::Receiver<Op>,
        deferred: &mut std::collections::VecDeque<Op>,
    ) {
        let before = self.file_len().unwrap_or(0);
        let started = Instant::now();
        self.compacting.store(true, Ordering::Release);
        let db = self.db.clone();
        let worker = std::thread::Builder::new()
            .name("store-compact".into())
            .spawn(move || {
                let mut slot = db.write().unwrap_or_else(|p| p.into_inner());
                // `None`: being reopened after a write error, nothing to compact.
                let Some(db) = slot.as_mut() else {
                    return Ok::<bool, String>(false);
                };
                if let Some(d) = crate::failpoint::delay_point("compaction") {
                    std::thread::sleep(d);
                }
                // Compaction moves pages towards the start; a few passes give back the tail.
                // `Ok(true)`: the passes ran out with more to do.
                for pass in 1..=8 {
                    if !db.compact().map_err(|e| e.to_string())? {
                        return Ok(false);
                    }
                    // A crash between passes leaves a file whose allocator state redb skipped
                    // recording (it compacts that way): the next open must repair it.
                    crate::failpoint::crash_point("compaction", &format!("pass_{pass}"));
                }
                Ok(true)
            });
        let worker = match worker {
            Ok(w) => w,
            Err(e) => {
                self.compacting.store(false, Ordering::Release);
                tracing::warn!(error = %e, "could not start the store compaction");
                return;
            }
        };
        // Held ops keep their order; accepts already held back by the group limit are refused
        // like new ones.
        let mut held = std::collections::VecDeque::new();
        let refuse = |op: Op, held: &mut std::collections::VecDeque<Op>| match op {
            Op::Accept { reply, .. } => {
                let _ = reply.send(Err(StoreError::Compacting));
            }
            Op::Lease { reply, .. } => {
                let _ = reply.send(Err(StoreError::Compacting));
            }
            other => held.push_back(other),
        };
        for op in deferred.drain(..) {
            refuse(op, &mut held);
        }
        while !worker.is_finished() {
            match rx.try_recv() {
                Ok(op) => refuse(op, &mut held),
                // Polled: this thread must not sleep in `recv` past the compaction's end.
                Err(_) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
        let result = worker
            .join()
            .unwrap_or_else(|_| Err("the compaction thread panicked".to_string()));
        self.compacting.store(false, Ordering::Release);
        *deferred = held;
        let took_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let after = self.file_len().unwrap_or(0);
        // The next write after a compaction grows the file again (redb allocates a region of
        // about the file's size), so right after a compaction the file is "half free" by the
        // check's measure while nothing can be gained: measured in the end-to-end test, every
        // sweep compacted again, refusing leases each time, so the backlog that would have
        // freed the space never drained. No new check until the file is three times what the
        // compaction left, unless its passes ran out with more to give back.
        // A compaction that gave much back (at least half the file) sets no floor, and the
        // next "drained" is measured from what it left (the file holds about the live data
        // now): a backlog compacted half-way through its drain left the file at half its
        // peak for good, the floor at three times that never reached again.
        let gave_back = after.saturating_mul(2) <= before;
        self.compact_floor = match &result {
            Ok(true) => 0,
            Ok(false) if gave_back => 0,
            _ => after.saturating_mul(3),
        };
        self.compact_peak_live
            .store(if gave_back { after } else { 0 }, Ordering::Release);
        let error = match result {
            Ok(_) => {
                tracing::info!(
                    before_bytes = before,
                    after_bytes = after,
                    took_ms,
                    "store compacted"
                );
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, took_ms, "store compaction failed; will try again after the next sweep");
                Some(e.to_string())
            }
        };
        let report = CompactionReport {
            finished_at: crate::clock::Clock::now_ms(&crate::clock::SystemClock),
            took_ms,
            before_bytes: before,
            after_bytes: after,
            error,
        };
        if let Some(obs) = &self.on_compact {
            obs(&report);
        }
        *self
            .last_compaction
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(report);
    }

    /// Applies and commits `ops` (drained) in one transaction; `effects` is scratch space.
    fn commit_group(&mut self, ops: &mut Vec<Op>, effects: &mut Vec<Effect>) {
        let started = Instant::now();
        let n = ops.len();
        if self.log.as_ref().is_some_and(LogWriter::failed) || self.sync.failed() {
            // Groups committed to redb after the failed write were not made durable by the
            // log: start again from what is. After a failed sync of the store file, its state
            // on disk is unknown, and the log still holds every group since the checkpoint
            // before: the same reopen replays them. (Closing the failed handle, redb makes its
            // pending unsynced commits durable if the store file can still be written; those
            // groups are then kept, which their error answer allows: it says "not known to
            // be stored", and a retry is answered as a duplicate.)
            self.poisoned = true;
        }
        if self.poisoned {
            self.try_reopen();
        }
        let saved = (self.next_seq, self.next_dlq, self.floor);
        self.group_depth.clear();
        let mut dones: Vec<Done> = Vec::with_capacity(n);
        // Ops not reached (the transaction could not start) are dropped below with the rest,
        // which answers their callers `Closed`, as dropping the group's vector did.
        let mut batch = std::mem::take(ops);
        let seq = self.log_seq + 1;
        let logged = self.log.is_some();
        let mut mutations = std::cell::RefCell::new(std::mem::take(&mut self.mutations));
        mutations.get_mut().clear();
        let mut durable = true;
        // A panic of redb inside the group (a page damaged outside it) fails the group like a
        // failing disk, and the store is reopened: it killed the committer, after which every
        // call answered "store is closed" for good.
        let result = catching(|| -> Result<(), StoreError> {
            let db_lock = self.db.clone();
            let slot = db_lock.read().unwrap_or_else(|p| p.into_inner());
            let db = slot.as_ref().ok_or_else(unavailable)?;
            let mut txn = db.begin_write()?;
            let tx = Tx {
                txn: &txn,
                log: logged.then_some(&mutations),
            };
            // The floor moves before any op: the in-memory index then holds exactly the live
            // entries of what is committed (plus leases being taken, which are live too).
            if self.floor_moved.elapsed() >= self.floor_every {
                self.floor_goal = self.floor_goal.max(self.floor_next);
                self.floor_next = self.next_seq;
                self.floor_moved = Instant::now();
            }
            for op in &batch {
                if let Op::Sweep {
                    now,
                    dedup_window_ms,
                    retention_ms,
                    ..
                } = op
                {
                    let cut = sweep_cut(*now, *dedup_window_ms, *retention_ms);
                    self.floor_goal = self.floor_goal.max(self.sweep_floor(&tx, cut)?);
                }
            }
            self.advance_floor(&tx)?;
            let mut failed = None;
            // The group's accepts go first, in one call: the four tables they write are then
            // opened once per group instead of once per request (measured: table opens were
            // ≈ 8 % of the committer's time with single-event requests). Any order of a
            // group's ops is a valid one: none of them has been answered yet, so they are
            // concurrent, and a caller that depends on an earlier write waits for its answer.
            let mut split = std::mem::take(&mut self.split);
            for op in batch.drain(..) {
                match op {
                    Op::Accept { events, reply } => {
                        split.accepts.push((reply, events.len()));
                        split.events.extend(events);
                    }
                    Op::Finish {
                        id,
                        lease,
                        end,
                        disposition,
                        now,
                        reply,
                    } if end.outbox.is_none() => match Settle::of(&disposition) {
                        Some(settle) => split.finishes.push(PlainFinish {
                            id,
                            lease,
                            end,
                            settle,
                            now,
                            reply,
                        }),
                        // A dead letter: the general path.
                        None => split.others.push(Op::Finish {
                            id,
                            lease,
                            end,
                            disposition,
                            now,
                            reply,
                        }),
                    },
                    op => split.others.push(op),
                }
            }
            if !split.accepts.is_empty() {
                match self.accept(&tx, split.events.drain(..), effects) {
                    Ok(outcomes) => {
                        let mut outcomes = outcomes.into_iter();
                        for (reply, n) in split.accepts.drain(..) {
                            dones.push(done(reply, Ok(outcomes.by_ref().take(n).collect())));
                        }
                    }
                    Err(e) => {
                        for (reply, _) in split.accepts.drain(..) {
                            dones.push(done(reply, Err(e.clone())));
                        }
                        failed.get_or_insert(e);
                    }
                }
            }
            if !split.finishes.is_empty()
                && let Err(e) = finish_plain(
                    &tx,
                    self.floor,
                    split.finishes.drain(..),
                    &mut dones,
                    effects,
                )
            {
                failed.get_or_insert(e);
            }
            for op in split.others.drain(..) {
                if let Err(e) = self.apply(&tx, op, &mut dones, effects) {
                    failed.get_or_insert(e);
                }
            }
            // Emptied above, even on an error (`drain` drops what it did not yield).
            self.split = split;
            if failed.is_none()
                && let Err(e) = self.dedup_maintenance(&tx)
            {
                failed = Some(e);
            }
            let counters = (self.next_seq, self.next_dlq);
            if counters != self.meta_counters || logged {
                let mut meta = tx.open_table(META)?;
                meta.insert("next_seq", self.next_seq.to_le_bytes().as_slice())?;
                meta.insert("next_dlq", self.next_dlq.to_le_bytes().as_slice())?;
                if logged {
                    meta.insert("log_seq", seq.to_le_bytes().as_slice())?;
                }
            }
            if let Some(e) = failed {
                txn.abort()?;
                return Err(e);
            }
            // A checkpoint also comes before a compaction, which wants nothing unsynced, and
            // before the file is closed.
            durable = !logged
                || self.compact_due
                || self.closing
                || self.log_bytes >= CHECKPOINT_BYTES
                || self.last_checkpoint.elapsed() >= self.checkpoint_every;
            txn.set_durability(if durable {
                Durability::Immediate
            } else {
                Durability::None
            })?;
            txn.commit()?;
            Ok(())
        })
        .unwrap_or_else(|p| Err(read_panicked("a commit group", p.as_ref())));
        match &result {
            Ok(()) => {
                self.meta_counters = (self.next_seq, self.next_dlq);
                let mut idx = self.index.lock().unwrap_or_else(|p| p.into_inner());
                for e in effects.drain(..) {
                    idx.apply(e);
                }
                drop(idx);
                self.dedup_committed();
                self.last_group_failed = false;
                if logged {
                    self.log_seq = seq;
                }
            }
            Err(e) => {
                tracing::error!(error = %e, ops = n, "store commit failed; every request in the group gets the error");
                (self.next_seq, self.next_dlq, self.floor) = saved;
                self.dedup_group.clear();
                self.dedup_rows.clear();
                self.dedup_fx = DedupFx::default();
                self.last_group_failed = true;
                self.poisoned = self.reopen.is_some();
            }
        }
        // Both buffers go back empty (a failed group leaves ops it did not reach, and effects
        // it did not apply). Those it did not reach get its error.
        if let Err(e) = &result {
            for op in batch.drain(..) {
                op.fail(e);
            }
        }
        batch.clear();
        *ops = batch;
        effects.clear();
        let took = started.elapsed();
        if took >= SLOW_COMMIT {
            // Every request of the group waited this long: worth a line of its own.
            tracing::warn!(
                took_ms = took.as_millis() as u64,
                ops = n,
                "slow store commit"
            );
        }
        if let Some(obs) = &self.on_commit {
            obs(took, n);
        }
        let mutations = mutations.into_inner();
        match (&self.log, &result) {
            (Some(log), Ok(())) => {
                // Answered once the log has synced the group (and so every earlier one): an
                // answer that depends on an earlier group (a duplicate) must not come before
                // that group is durable, so even a group that wrote nothing goes through. A
                // checkpoint too: its own sync runs behind (`store::sync_behind`), and until
                // it is done the log is what holds the group.
                let record = mutations.record(seq);
                self.log_bytes += record.len() as u64;
                log.send(LogMsg::Group { record, dones });
            }
            _ => {
                for d in dones {
                    d(result.as_ref().err());
                }
            }
        }
        self.mutations = mutations;
        if durable && result.is_ok() {
            self.checkpointed();
        }
    }

    /// After a checkpoint's commit: the log goes on in its other file, whose records the
    /// checkpoint before covers, once that one's sync is known to be done. (It is, in practice:
    /// this commit's writes waited for it. A failed one poisons the store instead, and the
    /// log keeps both files for the reopen.)
    fn checkpointed(&mut self) {
        let Some(log) = &self.log else { return };
        self.log_bytes = 0;
        self.last_checkpoint = Instant::now();
        if let Err(e) = self.sync.wait(self.checkpoint_ticket) {
            tracing::error!(error = %e, "a checkpoint's sync of the store file failed; the store is reopened");
            self.poisoned = self.reopen.is_some();
            return;
        }
        log.send(LogMsg::Switch);
        self.checkpoint_ticket = self.sync.asked();
    }

    /// The dedup index's background work, a bounded amount per group (`dedup::CHUNK` rows
    /// each): write the next rows of the frozen memtable's run (and register it with the last
    /// ones), remove `dedup_log` rows that registered runs cover, and remove the rows of one
    /// orphan run. Recorded in `dedup_fx`; the memory follows once the group commits.
    fn dedup_maintenance(&mut self, txn: &Tx<'_>) -> Result<(), StoreError> {
        let state = self.dedup.clone();
        let state = state.read().unwrap_or_else(|p| p.into_inner());
        if let Some(frozen) = &state.frozen {
            let from = self.frozen_written.min(frozen.rows.len());
            let to = (from + dedup::CHUNK).min(frozen.rows.len());
            let id = frozen.run.id;
            let mut keys = txn.open_table(DEDUP_RUN_KEYS)?;
            for &(fp, seq, at) in &frozen.rows[from..to] {
                keys.insert((id, fp, seq), at)?;
            }
            self.dedup_fx.written = Some(to);
            if to == frozen.rows.len() {
                txn.open_table(DEDUP_RUNS)?
                    .insert(id, frozen.run.encode().as_slice())?;
                self.dedup_fx.registered = true;
            }
        }
        if state.log_cleaned < state.log_floor {
            let mut log = txn.open_table(DEDUP_LOG)?;
            let covered: Vec<u64> = log
                .range(..=state.log_floor)?
                .take(dedup::CHUNK)
                .map(|r| r.map(|(k, _)| k.value()))
                .collect::<Result<_, _>>()?;
            if covered.len() < dedup::CHUNK {
                self.dedup_fx.log_cleaned = Some(state.log_floor);
            }
            for seq in covered {
                log.remove(seq)?;
            }
        }
        if let Some(&id) = state.orphans.first() {
            let mut keys = txn.open_table(DEDUP_RUN_KEYS)?;
            let rows: Vec<(u64, dedup::Fp, u64)> = keys
                .range((id, 0u128, 0u64)..=(id, u128::MAX, u64::MAX))?
                .take(dedup::CHUNK)
                .map(|r| r.map(|(k, _)| k.value()))
                .collect::<Result<_, _>>()?;
            if rows.len() < dedup::CHUNK {
                self.dedup_fx.orphan_done = Some(id);
            }
            for key in rows {
                keys.remove(key)?;
            }
        }
        Ok(())
    }

    /// Whether the dedup index has work for `dedup_maintenance` (a group with no ops is then
    /// worth committing while the channel is quiet).
    fn dedup_has_work(&self) -> bool {
        !self
            .dedup
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .settled()
    }

    /// The sealed memtable and its frozen form, once the thread sorting it has finished (for
    /// `DedupState::install`).
    fn finished_freeze(&mut self) -> Option<(Arc<dedup::Sealed>, dedup::Frozen)> {
        if !self.freezing.as_ref()?.1.is_finished() {
            return None;
        }
        let (sealed, thread) = self.freezing.take()?;
        // A panic while sorting (not expected) leaves the work to this thread.
        let frozen = thread.join().unwrap_or_else(|_| sealed.freeze());
        Some((sealed, frozen))
    }

    /// The group committed: its keys join the memtable, its maintenance is recorded, and the
    /// memtable is frozen as the next run when its hour is over or it is full.
    fn dedup_committed(&mut self) {
        let fx = std::mem::take(&mut self.dedup_fx);
        let finished = self.finished_freeze();
        let mut state = self.dedup.write().unwrap_or_else(|p| p.into_inner());
        if let Some((sealed, frozen)) = finished {
            state.install(&sealed, frozen);
        }
        for (fp, seq, at) in self.dedup_rows.drain(..) {
            state.insert(fp, seq, at);
        }
        self.dedup_group.clear();
        if let Some(n) = fx.written {
            self.frozen_written = n;
        }
        if fx.registered {
            state.registered();
            self.frozen_written = 0;
        }
        if let Some(id) = fx.orphan_done {
            state.orphans.retain(|o| *o != id);
        }
        if let Some(to) = fx.log_cleaned {
            state.log_cleaned = state.log_cleaned.max(to);
        }
        if !fx.dropped.is_empty() {
            state.dropped(&fx.dropped);
        }
        if let Some(at) = fx.cool_before {
            let freed = state.cool(at);
            if freed > 0 {
                tracing::debug!(
                    freed_bytes = freed,
                    cold_runs = state.cold_runs(),
                    "dedup runs older than the window dropped their filters"
                );
            }
        }
        if let Some(now) = fx.latest_at
            && state.should_freeze(now, self.memtable_keys)
            && let Some(sealed) = state.seal()
        {
            // A large memtable is sorted on a thread of its own: the commits behind this one
            // do not wait for it (a million keys take about 0.2 s). A small one, or one no
            // thread could be started for, is sorted here.
            let thread = (sealed.keys() >= self.freeze_inline_keys)
                .then(|| {
                    let job = sealed.clone();
                    std::thread::Builder::new()
                        .name("dedup-freeze".into())
                        .spawn(move || {
                            let started = Instant::now();
                            let frozen = job.freeze();
                            tracing::debug!(
                                run = frozen.run.id,
                                keys = frozen.run.keys,
                                took_ms = started.elapsed().as_millis() as u64,
                                "dedup memtable frozen; writing it as a run"
                            );
                            frozen
                        })
                        .inspect_err(|e| {
                            tracing::warn!(error = %e, "no thread to sort the dedup memtable; sorting it in the committer");
                        })
                        .ok()
                })
                .flatten();
            match thread {
                Some(thread) => self.freezing = Some((sealed, thread)),
                None => {
                    state.install(&sealed, sealed.freeze());
                }
            }
        }
    }

    /// After a sweep in this group: unregisters the runs the sweep has passed (every sequence
    /// number below its cursor): each of their events is removed, or kept with its key in
    /// `DEDUP_KEPT`. Their rows are removed by later groups.
    fn drop_swept_runs(&mut self, txn: &Tx<'_>, stats: &mut SweepStats) -> Result<(), StoreError> {
        let cursor = read_u64(&*txn.open_table(META)?, "sweep_cursor")?.unwrap_or(0);
        let state = self.dedup.clone();
        let state = state.read().unwrap_or_else(|p| p.into_inner());
        let mut runs = txn.open_table(DEDUP_RUNS)?;
        for run in &state.runs {
            if run.seq_hi >= cursor {
                break;
            }
            if self.dedup_fx.dropped.contains(&run.id) {
                continue;
            }
            runs.remove(run.id)?;
            self.dedup_fx.dropped.push(run.id);
            stats.dedup_expired += run.keys;
        }
        Ok(())
    }

    /// Applies one op inside `txn`. A storage error aborts the whole group (returned);
    /// logical refusals (fenced, duplicate) are the op's own answer.
    fn apply(
        &mut self,
        txn: &Tx<'_>,
        op: Op,
        dones: &mut Vec<Done>,
        effects: &mut Vec<Effect>,
    ) -> Result<(), StoreError> {
        match op {
            Op::Wake => Ok(()),
            // Taken out before grouping (`Committer::run`).
            Op::Close { reply } => {
                let _ = reply.send(Ok(()));
                Ok(())
            }
            Op::Accept { events, reply } => {
                let r = self.accept(txn, events.into_iter(), effects);
                answer(dones, reply, r)
            }
            Op::Lease {
                target,
                ids,
                lease,
                now,
                reply,
            } => {
                let r = self.lease(txn, &target, &ids, lease, now);
                answer(dones, reply, r)
            }
            Op::Finish {
                id,
                lease,
                end,
                disposition,
                now,
                reply,
            } => {
                let r = self.finish(txn, id, lease, end, disposition, now, effects);
                let err = match &r {
                    Err(FinishError::Store(e)) => Some(e.clone()),
                    _ => None,
                };
                dones.push(finish_done(reply, r));
                err.map_or(Ok(()), Err)
            }
            Op::SaveTargets { configs, reply } => {
                let r = (|| -> Result<(), StoreError> {
                    let mut t = txn.open_table(TARGETS)?;
                    for (id, cfg) in configs {
                        t.insert(id.as_str(), enc(&cfg).as_slice())?;
                    }
                    Ok(())
                })();
                answer(dones, reply, r)
            }
            Op::PutTargetState { id, state, reply } => {
                let r = (|| -> Result<(), StoreError> {
                    txn.open_table(TARGET_STATE)?
                        .insert(id.as_str(), enc(&state).as_slice())?;
                    Ok(())
                })();
                answer(dones, reply, r)
            }
            Op::ReleaseKey { target, key, reply } => {
                let r = (|| -> Result<bool, StoreError> {
                    let k = (target.as_str(), key.as_str());
                    let was = txn.open_table(HELD)?.remove(k)?.is_some();
                    txn.open_table(HELD_BY)?.remove(k)?;
                    if was {
                        effects.push(Effect::Release { target, key });
                    }
                    Ok(was)
                })();
                answer(dones, reply, r)
            }
            Op::PutJob { job, reply } => {
                let r = put_job(txn, &job);
                answer(dones, reply, r)
            }
            Op::DeleteJobs { jobs, reply } => {
                let r = delete_jobs(txn, &jobs);
                answer(dones, reply, r)
            }
            Op::RedriveStep {
                job,
                actions,
                now,
                reply,
            } => {
                let r = self.redrive_step(txn, &job, actions, now, effects);
                answer(dones, reply, r)
            }
            Op::ReplayStep {
                job,
                items,
                now,
                reply,
            } => {
                let r = self.replay_step(txn, &job, items, now, effects);
                answer(dones, reply, r)
            }
            Op::PurgeDlq { ids, reply } => {
                let r = (|| -> Result<u64, StoreError> {
                    let mut n = 0;
                    for id in ids {
                        if let Some(d) = take_dlq(txn, id)? {
                            effects.push(Effect::DlqRemoved {
                                target: d.target_id,
                            });
                            n += 1;
                        }
                    }
                    Ok(n)
                })();
                answer(dones, reply, r)
            }
            Op::KvClear {
                namespace,
                max,
                reply,
            } => {
                let r = (|| -> Result<u64, StoreError> {
                    let keys = txn
                        .open_table(KV)?
                        .range((namespace.as_str(), "")..)?
                        .map(|r| {
                            r.map(|(k, _)| {
                                let (ns, key) = k.value();
                                (ns.to_owned(), key.to_owned())
                            })
                        })
                        .take_while(|r| r.as_ref().map_or(true, |(ns, _)| *ns == namespace))
                        .take(max)
                        .collect::<Result<Vec<_>, _>>()?;
                    for (_, key) in &keys {
                        kv_put(txn, &namespace, key, None, i64::MAX)?;
                    }
                    Ok(keys.len() as u64)
                })();
                answer(dones, reply, r)
            }
            Op::CompletedClear {
                handler,
                max,
                reply,
            } => {
                let r = (|| -> Result<u64, StoreError> {
                    let rows = txn
                        .open_table(COMPLETED)?
                        .range((handler.as_str(), "")..)?
                        .map(|r| {
                            r.map(|(k, v)| {
                                let (h, key) = k.value();
                                (h.to_owned(), key.to_owned(), v.value().0)
                            })
                        })
                        .take_while(|r| r.as_ref().map_or(true, |(h, _, _)| *h == handler))
                        .take(max)
                        .collect::<Result<Vec<_>, _>>()?;
                    let mut completed = txn.open_table(COMPLETED)?;
                    let mut exp = txn.open_table(COMPLETED_EXP)?;
                    for (_, key, expires_at) in &rows {
                        completed.remove((handler.as_str(), key.as_str()))?;
                        exp.remove((*expires_at, handler.as_str(), key.as_str()))?;
                    }
                    Ok(rows.len() as u64)
                })();
                answer(dones, reply, r)
            }
            Op::DeadLetterQueued {
                ids,
                reason,
                message,
                now,
                reply,
            } => {
                let r = self.dead_letter_queued(txn, &ids, reason, &message, now, effects);
                answer(dones, reply, r)
            }
            Op::Sweep {
                now,
                dedup_window_ms,
                retention_ms,
                reply,
            } => {
                let r = sweep(
                    txn,
                    now,
                    dedup_window_ms,
                    retention_ms,
                    self.sweep_batch,
                    self.floor,
                )
                .and_then(|mut stats| {
                    self.drop_swept_runs(txn, &mut stats)?;
                    Ok(stats)
                });
                self.dedup_fx.cool_before = Some(now.saturating_sub(dedup_window_ms));
                // An idle router's memtable is frozen once its hour is over, too.
                let latest = &mut self.dedup_fx.latest_at;
                *latest = Some(latest.map_or(now, |l| l.max(now)));
                if r.is_ok() {
                    self.check_compaction = true;
                }
                answer(dones, reply, r)
            }
        }
    }

    fn accept(
        &mut self,
        txn: &Tx<'_>,
        events: impl ExactSizeIterator<Item = Prepared>,
        effects: &mut Vec<Effect>,
    ) -> Result<Vec<AcceptedOne>, StoreError> {
        let mut dedup_log = txn.open_table(DEDUP_LOG)?;
        let mut run_keys = None;
        let mut ev_t = txn.open_table(EVENTS)?;
        let mut entries_t = txn.open_table(ENTRIES)?;
        let mut out = Vec::with_capacity(events.len());
        let state = self.dedup.clone();
        let state = state.read().unwrap_or_else(|p| p.into_inner());
        for mut p in events {
            let min_at = p.accepted_at - p.dedup_window_ms;
            let seen = match self.dedup_group.get(&p.fp) {
                Some(&hit) => Some(hit).filter(|(_, at)| *at >= min_at),
                None => state.newest(p.fp, min_at, |run, fp| {
                    let t = match &mut run_keys {
                        Some(t) => t,
                        None => run_keys.insert(txn.open_table(DEDUP_RUN_KEYS)?),
                    };
                    let newest = t.range((run, fp, 0)..=(run, fp, u64::MAX))?.next_back();
                    Ok::<_, StoreError>(match newest {
                        Some(row) => {
                            let (k, v) = row?;
                            Some((k.value().2, v.value()))
                        }
                        None => None,
                    })
                })?,
            };
            // A copy whose data passes its contract now is not a duplicate of a quarantined
            // one (never routed): the producer fixed it and sent it again, with the same id,
            // as producers do. It is accepted and routed, and its key is the newest for the
            // fate. A copy that fails again stays a duplicate.
            if let Some((seq, _)) = seen
                && (p.quarantine.is_some() || !was_quarantined(&*ev_t, seq)?)
            {
                out.push((AcceptOutcome::Duplicate { seq }, Vec::new()));
                continue;
            }
            let seq = self.next_seq;
            self.next_seq += 1;
            dedup_log.insert(seq, (p.fp, p.accepted_at))?;
            self.dedup_group.insert(p.fp, (seq, p.accepted_at));
            self.dedup_rows.push((p.fp, seq, p.accepted_at));
            let latest = &mut self.dedup_fx.latest_at;
            *latest = Some(latest.map_or(p.accepted_at, |l| l.max(p.accepted_at)));
            let mut leased = Vec::new();
            // Targets whose copy the depth cap refused: out of the record's fan-out.
            let mut refused = Vec::new();
            let mut overflowed = Vec::new();
            if let Some(q) = p.quarantine.take() {
                let d = DlqEntry {
                    emitted_by: q.emitted_by,
                    ..p.dead_letter(seq, None, q.reason, q.errors)
                };
                self.add_dlq(txn, d, effects)?;
            } else {
                for (i, (t, record, lease)) in
                    std::mem::take(&mut p.targets).into_iter().enumerate()
                {
                    let id = EntryId {
                        event: seq,
                        idx: u32::try_from(i).unwrap_or(u32::MAX),
                    };
                    if let Some(cap) = t.max_depth
                        && self.at_depth_cap(&t.target_id, cap)
                    {
                        let error = crate::event::FieldError::new(
                            "",
                            format!("queue of {} is at its depth cap ({cap})", t.target_id),
                        );
                        let d =
                            p.dead_letter(seq, Some(&t), DlqReason::TargetOverflow, vec![error]);
                        let dlq_id = self.add_dlq(txn, d, effects)?;
                        hold_overflowed_key(txn, &t, dlq_id, effects)?;
                        refused.push(id.idx);
                        overflowed.push(t.target_id.clone());
                        continue;
                    }
                    match self.group_depth.get_mut(&t.target_id) {
                        Some(n) => *n += 1,
                        None => {
                            self.group_depth.insert(t.target_id.clone(), 1);
                        }
                    }
                    // A queued entry is the event's fan-out until it changes; one leased here
                    // has changed already. Neither is in `live` while above the floor.
                    if lease.is_some() {
                        entries_t.insert((id.event, id.idx), record.as_slice())?;
                        leased.push(id.idx);
                    }
                    effects.push(Effect::Enqueue {
                        target: t.target_id,
                        id,
                        due: p.accepted_at,
                        accepted_at: p.accepted_at,
                        key: t.ordering_key,
                        lease,
                    });
                }
            }
            if refused.is_empty() {
                ev_t.insert(seq, p.record.as_slice())?;
            } else {
                let rec = EventRecord::split(seq, &p.record)?;
                ev_t.insert(seq, rec.without(&refused, rec.json).as_slice())?;
            }
            out.push((AcceptOutcome::Accepted { seq, overflowed }, leased));
        }
        Ok(out)
    }

    /// Checks the outbox's compare-and-set preconditions and its namespaces' size bound, then
    /// writes its key-value changes and accepts its emitted events, in the transaction of the
    /// ack. Refusals come before any write, so a refused outbox leaves nothing behind. Returns
    /// the emitted events' copies that overflowed their target's queue (`Finished`).
    fn apply_outbox(
        &mut self,
        txn: &Tx<'_>,
        outbox: &Outbox,
        now: Millis,
        effects: &mut Vec<Effect>,
    ) -> Result<Vec<(usize, String)>, FinishError> {
        {
            let kv = txn.open_table(KV).map_err(StoreError::from)?;
            for (ns, key, expected) in &outbox.cas {
                let current = kv
                    .get((ns.as_str(), key.as_str()))
                    .map_err(StoreError::from)?
                    .and_then(|v| {
                        let (exp, val) = v.value();
                        (exp > now).then(|| val.to_vec())
                    });
                if &current != expected {
                    return Err(FinishError::Conflict(format!("{ns}/{key}")));
                }
            }
            if let Some(max) = outbox.kv_max_bytes {
                let mut growth: BTreeMap<&str, i64> = BTreeMap::new();
                let mut seen = BTreeSet::new();
                // Ops are applied in order, so only the last op on a key decides its size.
                for op in outbox.kv.iter().rev() {
                    if !seen.insert((op.namespace.as_str(), op.key.as_str())) {
                        continue;
                    }
                    let old = kv
                        .get((op.namespace.as_str(), op.key.as_str()))
                        .map_err(StoreError::from)?
                        .map_or(0, |v| kv_counted(&op.key, v.value().1));
                    let new = op.value.as_deref().map_or(0, |v| kv_counted(&op.key, v));
                    *growth.entry(op.namespace.as_str()).or_default() += new - old;
                }
                let usage = txn.open_table(KV_USAGE).map_err(StoreError::from)?;
                for (ns, grow) in growth.into_iter().filter(|(_, g)| *g > 0) {
                    let held = usage.get(ns).map_err(StoreError::from)?.map_or(0, |v| {
                        let (bytes, keys) = v.value();
                        KvUsage::from_counters(bytes, keys).bytes
                    });
                    let would_hold = held.saturating_add(grow.unsigned_abs());
                    if would_hold > max {
                        return Err(FinishError::KvQuota {
                            namespace: ns.to_string(),
                            would_hold,
                            max,
                        });
                    }
                }
            }
        }
        for op in &outbox.kv {
            let expires_at = op.expires_at.unwrap_or(i64::MAX);
            kv_put(txn, &op.namespace, &op.key, op.value.as_deref(), expires_at)?;
        }
        if let Some(c) = &outbox.completed {
            let mut t = txn.open_table(COMPLETED).map_err(StoreError::from)?;
            let mut exp = txn.open_table(COMPLETED_EXP).map_err(StoreError::from)?;
            let old = t
                .insert(
                    (c.handler.as_str(), c.key.as_str()),
                    (c.expires_at, c.result.as_slice()),
                )
                .map_err(StoreError::from)?
                .map(|v| v.value().0);
            if let Some(old) = old {
                exp.remove((old, c.handler.as_str(), c.key.as_str()))
                    .map_err(StoreError::from)?;
            }
            exp.insert((c.expires_at, c.handler.as_str(), c.key.as_str()), ())
                .map_err(StoreError::from)?;
        }
        let mut overflowed = Vec::new();
        if !outbox.emitted.is_empty() {
            let emitted = outbox.emitted.iter().cloned().map(Prepared::new);
            for (i, (outcome, _)) in self.accept(txn, emitted, effects)?.into_iter().enumerate() {
                if let AcceptOutcome::Accepted { overflowed: o, .. } = outcome {
                    overflowed.extend(o.into_iter().map(|t| (i, t)));
                }
            }
        }
        Ok(overflowed)
    }

    /// Inserts a new queue entry (accept, redrive of a quarantined event, replay).
    fn insert_entry(
        &mut self,
        txn: &Tx<'_>,
        entry: &QueueEntry,
        effects: &mut Vec<Effect>,
    ) -> Result<(), StoreError> {
        let id = entry.id;
        txn.open_table(ENTRIES)?
            .insert((id.event, id.idx), enc_entry(entry).as_slice())?;
        if id.event < self.floor {
            txn.open_table(LIVE)?.insert((id.event, id.idx), ())?;
        }
        effects.push(Effect::Enqueue {
            target: entry.target_id.clone(),
            id,
            due: entry.due_at,
            accepted_at: entry.accepted_at,
            key: entry.ordering_key.clone(),
            lease: None,
        });
        Ok(())
    }

    /// Moves the entry floor towards `self.floor_goal`: each live entry of the events passed
    /// gets its row in `live`, and one still only in its event's fan-out its row in
    /// `entries`. Which entries are live comes from the in-memory index, checked against
    /// their rows. At most `FLOOR_BATCH` entries per group (a backlog crossing the floor is
    /// written over several groups, not in one long commit that every request of its group
    /// would wait for); the floor stops at an event boundary.
    fn advance_floor(&mut self, txn: &Tx<'_>) -> Result<(), StoreError> {
        let goal = self.floor_goal;
        if goal <= self.floor {
            return Ok(());
        }
        let lo = EntryId {
            event: self.floor,
            idx: 0,
        };
        let hi = EntryId {
            event: goal,
            idx: 0,
        };
        // The first `FLOOR_BATCH` + 1 of each target hold the first ones overall.
        let mut ids: Vec<EntryId> = {
            let idx = self.index.lock().unwrap_or_else(|p| p.into_inner());
            idx.targets
                .values()
                .flat_map(|t| {
                    t.live
                        .range(lo..hi)
                        .take(FLOOR_BATCH + 1)
                        .map(|(id, _)| *id)
                })
                .collect()
        };
        ids.sort_unstable();
        let mut to = goal;
        if ids.len() > FLOOR_BATCH {
            let first = ids[0].event;
            let cut = ids[FLOOR_BATCH].event;
            if cut > first {
                // Up to the event of the first entry left out.
                to = cut;
                ids.retain(|id| id.event < to);
            } else {
                // One event with more live entries than a batch: all of them, so that the
                // floor moves.
                to = first + 1;
                let (lo, hi) = (
                    EntryId {
                        event: first,
                        idx: 0,
                    },
                    EntryId { event: to, idx: 0 },
                );
                let idx = self.index.lock().unwrap_or_else(|p| p.into_inner());
                ids = idx
                    .targets
                    .values()
                    .flat_map(|t| t.live.range(lo..hi).map(|(id, _)| *id))
                    .collect();
            }
        }
        let mut entries = txn.open_table(ENTRIES)?;
        let mut live = txn.open_table(LIVE)?;
        let events = txn.open_table(EVENTS)?;
        for id in ids {
            let key = (id.event, id.idx);
            match stored_entry(&*entries, &*events, self.floor, id)? {
                Some((e, _)) if e.state != EntryState::Queued => continue,
                Some((_, true)) => {}
                Some((e, false)) => {
                    entries.insert(key, enc_entry(&e).as_slice())?;
                }
                None => continue,
            }
            live.insert(key, ())?;
        }
        txn.open_table(META)?
            .insert("entry_floor", to.to_le_bytes().as_slice())?;
        self.floor = to;
        Ok(())
    }

    /// Where the floor must be for a sweep with this cut to see the events it may remove:
    /// past the events above the floor accepted before `cut` (sequence numbers follow
    /// acceptance; the first one accepted at or after the cut ends them), at most a sweep
    /// batch of them (all one sweep call looks at).
    fn sweep_floor(&self, txn: &Tx<'_>, cut: Millis) -> Result<u64, StoreError> {
        let events = txn.open_table(EVENTS)?;
        let mut last = None;
        for row in events.range(self.floor..)?.take(self.sweep_batch) {
            let (k, v) = row?;
            if sweep_view(k.value(), v.value()).is_some_and(|at| at >= cut) {
                return Ok(k.value());
            }
            last = Some(k.value());
        }
        Ok(match last {
            Some(seq) if seq + 1 < self.next_seq => seq + 1,
            _ => self.next_seq,
        })
    }

    /// The next free fan-out index of an event (entries are never renumbered).
    fn next_idx(&self, txn: &Tx<'_>, seq: u64) -> Result<u32, StoreError> {
        let t = txn.open_table(ENTRIES)?;
        let last = t
            .range((seq, 0)..=(seq, u32::MAX))?
            .next_back()
            .transpose()?;
        let rows = last.map_or(0, |(k, _)| k.value().1.saturating_add(1));
        drop(t);
        if seq < self.floor {
            return Ok(rows);
        }
        // Above the floor, queued entries may have no row yet.
        let raw = txn
            .open_table(EVENTS)?
            .get(seq)?
            .map(|v| v.value().to_vec());
        let fanout = match raw {
            Some(raw) => EventRecord::split(seq, &raw)?.next_idx(),
            None => 0,
        };
        Ok(rows.max(fanout))
    }

    /// Entry `id` as it stands in this transaction: its row, or, for an event at or above
    /// the floor whose entry has not changed since acceptance, the event's fan-out.
    /// Puts dead letter `dlq_id`'s entry back into a queue for a redrive: its own target's,
    /// or `to`'s (another target, with the entry's ordering key under that target's
    /// ordering). Nothing when the dead letter or its entry is gone.
    fn requeue(
        &mut self,
        txn: &Tx<'_>,
        dlq_id: u64,
        to: Option<(String, Option<String>)>,
        now: Millis,
        effects: &mut Vec<Effect>,
    ) -> Result<(), StoreError> {
        let Some(d) = take_dlq(txn, dlq_id)? else {
            return Ok(());
        };
        effects.push(Effect::DlqRemoved {
            target: d.target_id.clone(),
        });
        let Some(id) = d.entry else { return Ok(()) };
        let Some(mut e) = self.load_entry(txn, id)? else {
            return Ok(());
        };
        e.requeue_for_redrive(now);
        let held = (e.target_id.clone(), e.ordering_key.clone());
        if let Some((target, key)) = to {
            e.target_id = target;
            e.ordering_key = key;
        }
        self.insert_entry(txn, &e, effects)?;
        // The dead letter that held its key goes back at the head of the key (it sorts
        // first): the hold has done its work. Left held, the job said "done" while the key,
        // this entry included, stayed stopped. The hold is the dead letter's own target's.
        if let (target, Some(key)) = held {
            release_hold_of(txn, &target, key, dlq_id, effects)?;
        }
        Ok(())
    }

    fn load_entry(&self, txn: &Tx<'_>, id: EntryId) -> Result<Option<QueueEntry>, StoreError> {
        let (entries, events) = (txn.open_table(ENTRIES)?, txn.open_table(EVENTS)?);
        Ok(stored_entry(&*entries, &*events, self.floor, id)?.map(|(e, _)| e))
    }

    /// The latest copy of `ev`'s (source, id) stored after it, as this transaction has it
    /// (this group's accepts included): what replaced a quarantined copy when its producer
    /// sent the event again. The candidates are found as the fate finds them.
    fn later_copy(
        &self,
        txn: &Tx<'_>,
        ev: &StoredEvent,
    ) -> Result<Option<StoredEvent>, StoreError> {
        let fp = dedup::fingerprint(&crate::event::dedup_key(&ev.event.source, &ev.event.id));
        let (mut seqs, runs) = {
            let state = self.dedup.read().unwrap_or_else(|p| p.into_inner());
            state.candidates(fp)
        };
        seqs.extend(self.dedup_group.get(&fp).map(|&(seq, _)| seq));
        if !runs.is_empty() {
            let keys = txn.open_table(DEDUP_RUN_KEYS)?;
            seqs.extend(run_candidates(&*keys, &runs, fp, ev.seq + 1)?);
        }
        seqs.extend(kept_candidates(
            &*txn.open_table(DEDUP_KEPT)?,
            fp,
            ev.seq + 1,
        )?);
        seqs.retain(|&s| s > ev.seq);
        seqs.sort_unstable_by(|a, b| b.cmp(a));
        seqs.dedup();
        let events = txn.open_table(EVENTS)?;
        for seq in seqs {
            let Some(raw) = events.get(seq)? else {
                continue;
            };
            // One that does not decode cannot be confirmed (and is not routed either).
            if let Ok(later) = dec_event(seq, raw.value())
                && later.event.source == ev.event.source
                && later.event.id == ev.event.id
            {
                return Ok(Some(later));
            }
        }
        Ok(None)
    }

    fn redrive_step(
        &mut self,
        txn: &Tx<'_>,
        job: &Job,
        actions: Vec<RedriveAction>,
        now: Millis,
        effects: &mut Vec<Effect>,
    ) -> Result<(u64, RedriveGone), StoreError> {
        // Checked before any action: a refused step changes nothing.
        check_job_rev(txn, job)?;
        let mut gone = RedriveGone::default();
        for action in actions {
            if txn.open_table(DLQ)?.get(action.dlq_id())?.is_none() {
                gone.add(&action);
                continue;
            }
            match action {
                RedriveAction::Requeue { dlq_id } => {
                    self.requeue(txn, dlq_id, None, now, effects)?;
                }
                RedriveAction::RequeueTo {
                    dlq_id,
                    target,
                    ordering_key,
                } => {
                    self.requeue(txn, dlq_id, Some((target, ordering_key)), now, effects)?;
                }
                RedriveAction::Route {
                    dlq_id,
                    matched_rules,
                    targets,
                } => {
                    let event_seq = {
                        let t = txn.open_table(DLQ)?;
                        let raw = t.get(dlq_id)?.map(|v| v.value().to_vec());
                        let Some(raw) = raw else { continue };
                        dec::<DlqEntry>("dlq", &raw)?.event_seq
                    };
                    let raw = txn
                        .open_table(EVENTS)?
                        .get(event_seq)?
                        .map(|v| v.value().to_vec());
                    let ev = raw
                        .as_deref()
                        .map(|raw| dec_event(event_seq, raw))
                        .transpose()?;
                    // A quarantined copy whose producer has since sent the event again: the
                    // later copy took its place (accepted and routed, or quarantined in its
                    // turn). Checked here, in the step's commit, as a copy accepted after
                    // the job read the entry is as much a later copy.
                    if let Some(ev) = ev.as_ref().filter(|ev| ev.quarantined)
                        && let Some(later) = self.later_copy(txn, ev)?
                    {
                        let note = superseded_note(later.accepted_at, later.quarantined);
                        keep_dlq(txn, dlq_id, &job.id, now, &note, None)?;
                        gone.superseded += 1;
                        continue;
                    }
                    let Some(d) = take_dlq(txn, dlq_id)? else {
                        continue;
                    };
                    effects.push(Effect::DlqRemoved {
                        target: d.target_id.clone(),
                    });
                    let (Some(raw), Some(mut ev)) = (raw, ev) else {
                        continue;
                    };
                    let mut ev_t = txn.open_table(EVENTS)?;
                    if ev.quarantined {
                        ev.quarantined = false;
                        ev.matched_rules = matched_rules;
                    }
                    // The record keeps its fan-out (entries queued at acceptance for targets
                    // whose copy was not refused).
                    let record = EventRecord::split(d.event_seq, &raw)?.with_json(&enc(&ev));
                    ev_t.insert(d.event_seq, record.as_slice())?;
                    drop(ev_t);
                    let first = self.next_idx(txn, d.event_seq)?;
                    for (idx, t) in (first..).zip(targets) {
                        // A replay's copy stays one, with the replay's key.
                        let key = delivery_key(
                            &ev.event.source,
                            &ev.event.id,
                            &t.target_id,
                            d.replay.as_deref(),
                        );
                        let id = EntryId {
                            event: d.event_seq,
                            idx,
                        };
                        // Its max_age counts from the redrive, as for a requeued entry.
                        let entry = QueueEntry {
                            redrive_count: d.redrive_count + 1,
                            replay: d.replay.clone(),
                            ..QueueEntry::queued(id, t, key, now, now, ev.event.hops())
                        };
                        self.insert_entry(txn, &entry, effects)?;
                        // A copy refused at acceptance (`target_overflow`) held its key like
                        // any dead letter; back in the queue, it sorts by its event (before
                        // the key's later events), so the hold has done its work, as for a
                        // requeued one.
                        if let Some(key) = entry.ordering_key {
                            release_hold_of(txn, &entry.target_id, key, dlq_id, effects)?;
                        }
                    }
                }
                RedriveAction::Keep {
                    dlq_id,
                    note,
                    errors,
                } => keep_dlq(txn, dlq_id, &job.id, now, &note, errors.as_ref())?,
            }
        }
        let mut job = job.clone();
        gone.apply(&mut job);
        Ok((write_job(txn, &job)?, gone))
    }

    fn replay_step(
        &mut self,
        txn: &Tx<'_>,
        job: &Job,
        items: Vec<ReplayItem>,
        now: Millis,
        effects: &mut Vec<Effect>,
    ) -> Result<ReplayStepped, StoreError> {
        check_job_rev(txn, job)?;
        let mut overflowed = Vec::new();
        let mut gone = Vec::new();
        for item in items {
            let raw = txn
                .open_table(EVENTS)?
                .get(item.seq)?
                .map(|v| v.value().to_vec());
            let Some(raw) = raw else {
                gone.push(item.seq);
                continue;
            };
            let ev = dec_event(item.seq, &raw)?;
            let first = self.next_idx(txn, item.seq)?;
            for (idx, t) in (first..).zip(item.targets) {
                // The depth cap holds for replayed entries as for accepted ones: past it, the
                // copy goes to the DLQ as target_overflow (a replay into a dead target's full
                // queue grew it without bound).
                if let Some(cap) = t.max_depth
                    && self.at_depth_cap(&t.target_id, cap)
                {
                    let names = (
                        ev.event.id.clone(),
                        ev.event.source.clone(),
                        ev.event.ty.clone(),
                    );
                    let d = DlqEntry::replay_overflow(item.seq, names, &t, &job.id, cap, now);
                    let dlq_id = self.add_dlq(txn, d, effects)?;
                    hold_overflowed_key(txn, &t, dlq_id, effects)?;
                    overflowed.push((item.seq, t.target_id));
                    continue;
                }
                *self.group_depth.entry(t.target_id.clone()).or_insert(0) += 1;
                let id = EntryId {
                    event: item.seq,
                    idx,
                };
                let key = delivery_key(&ev.event.source, &ev.event.id, &t.target_id, Some(&job.id));
                let entry = QueueEntry {
                    replay: Some(job.id.clone()),
                    ..QueueEntry::queued(id, t, key, now, now, ev.event.hops())
                };
                self.insert_entry(txn, &entry, effects)?;
            }
        }
        let mut stepped = ReplayStepped {
            rev: 0,
            overflowed,
            gone,
        };
        let mut job = job.clone();
        stepped.apply(&mut job);
        stepped.rev = write_job(txn, &job)?;
        Ok(stepped)
    }

    /// Moves waiting (not leased) entries to the DLQ without an attempt.
    fn dead_letter_queued(
        &mut self,
        txn: &Tx<'_>,
        ids: &[EntryId],
        reason: DlqReason,
        message: &str,
        now: Millis,
        effects: &mut Vec<Effect>,
    ) -> Result<usize, StoreError> {
        let mut n = 0;
        for &id in ids {
            let Some(mut e) = self.load_entry(txn, id)? else {
                continue;
            };
            if e.state != EntryState::Queued || e.lease.is_some_and(|l| l.until >= now) {
                continue;
            }
            e.lease = None;
            e.state = EntryState::Dead;
            e.finished_at = Some(now);
            let (eid, esrc, ety) = dlq_names(&*txn.open_table(EVENTS)?, id.event)?;
            let d = DlqEntry {
                id: 0,
                event_seq: id.event,
                event_id: eid,
                event_source: esrc,
                event_type: ety,
                entry: Some(id),
                target_id: Some(e.target_id.clone()),
                rule: Some(e.rule.clone()),
                reason,
                errors: vec![crate::event::FieldError::new("", message)],
                attempts: e.history.iter().chain(&e.attempts).cloned().collect(),
                attempt_count: u32::try_from(e.attempts.len()).unwrap_or(u32::MAX),
                first_failure_at: now,
                last_failure_at: now,
                redrive_count: e.redrive_count,
                replay: e.replay.clone(),
                ordering_key: e.ordering_key.clone(),
                not_redriven: None,
                made: None,
                emitted_by: None,
            };
            self.add_dlq(txn, d, effects)?;
            if id.event < self.floor {
                txn.open_table(LIVE)?.remove((id.event, id.idx))?;
            }
            txn.open_table(ENTRIES)?
                .insert((id.event, id.idx), enc_entry(&e).as_slice())?;
            effects.push(Effect::Remove {
                target: e.target_id,
                id,
                hold: false,
            });
            n += 1;
        }
        Ok(n)
    }

    fn add_dlq(
        &mut self,
        txn: &Tx<'_>,
        mut d: DlqEntry,
        effects: &mut Vec<Effect>,
    ) -> Result<u64, StoreError> {
        let id = self.next_dlq;
        self.next_dlq += 1;
        d.id = id;
        txn.open_table(DLQ)?.insert(id, enc(&d).as_slice())?;
        txn.open_table(DLQ_BY_EVENT)?
            .insert((d.event_seq, id), ())?;
        txn.open_table(DLQ_BY_TARGET)?
            .insert((dlq_target_key(d.target_id.as_deref()), id), ())?;
        effects.push(Effect::DlqAdded {
            target: d.target_id.clone(),
        });
        Ok(id)
    }

    fn lease(
        &mut self,
        txn: &Tx<'_>,
        target: &str,
        ids: &[EntryId],
        lease: Lease,
        now: Millis,
    ) -> Result<Vec<QueueEntry>, StoreError> {
        let mut entries_t = txn.open_table(ENTRIES)?;
        let ev_t = txn.open_table(EVENTS)?;
        let mut out = Vec::with_capacity(ids.len());
        for &id in ids {
            let Some((mut e, _)) = stored_entry(&*entries_t, &*ev_t, self.floor, id)? else {
                continue;
            };
            if e.state != EntryState::Queued || e.target_id != target {
                continue;
            }
            // Leased again under a lease that expired while its attempt ran (the live reclaim
            // re-queues it in memory only): that attempt is closed here as interrupted, as a
            // restart's reclaim and JetStream's take-over close it. It stayed open for good,
            // even in the entry's dead letter, with no result and no error.
            if let Some(old) = e.lease
                && let Some(a) = e.attempts.last_mut().filter(|a| a.result.is_none())
            {
                a.finished_at = Some(old.until.min(now));
                a.result = Some(AttemptResult::Interrupted);
                a.error = Some("the lease expired during this attempt; taken over".into());
            }
            e.start_attempt(lease, now);
            entries_t.insert((id.event, id.idx), enc_entry(&e).as_slice())?;
            out.push(e);
        }
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn finish(
        &mut self,
        txn: &Tx<'_>,
        id: EntryId,
        lease: Lease,
        end: AttemptEnd,
        disposition: Disposition,
        now: Millis,
        effects: &mut Vec<Effect>,
    ) -> Result<Finished, FinishError> {
        // The entries table is opened only around reads and the final write: the outbox
        // accepts events, which writes entries itself.
        let raw = txn
            .open_table(ENTRIES)
            .map_err(StoreError::from)?
            .get((id.event, id.idx))
            .map_err(StoreError::from)?
            .map(|v| v.value().to_vec());
        let mut e = leased_entry(raw.as_deref(), id, lease, now)?;
        let mut finished = Finished::default();
        if let Some(outbox) = end.outbox.as_deref() {
            finished.overflowed = self.apply_outbox(txn, outbox, now, effects)?;
        }
        e.close_attempt(&end);
        if let Some(settle) = Settle::of(&disposition) {
            let mut live = txn.open_table(LIVE).map_err(StoreError::from)?;
            effects.push(settle.apply(&mut e, id, now, &mut live, self.floor)?);
        } else if let Disposition::DeadLetter { reason, hold } = disposition {
            let target = e.target_id.clone();
            e.state = EntryState::Dead;
            e.finished_at = Some(now);
            if id.event < self.floor {
                txn.open_table(LIVE)
                    .map_err(StoreError::from)?
                    .remove((id.event, id.idx))
                    .map_err(StoreError::from)?;
            }
            let ev_t = txn.open_table(EVENTS).map_err(StoreError::from)?;
            let (eid, esrc, ety) = dlq_names(&*ev_t, id.event)?;
            drop(ev_t);
            let d = DlqEntry::of_given_up(&e, (eid, esrc, ety), reason, &end, now);
            finished.dlq_id = Some(self.add_dlq(txn, d, effects)?);
            let hold = hold && e.ordering_key.is_some();
            if hold && let (Some(k), Some(dlq_id)) = (&e.ordering_key, finished.dlq_id) {
                hold_key(txn, &target, k, dlq_id)?;
            }
            effects.push(Effect::Remove { target, id, hold });
        }
        txn.open_table(ENTRIES)
            .map_err(StoreError::from)?
            .insert((id.event, id.idx), enc_entry(&e).as_slice())
            .map_err(StoreError::from)?;
        Ok(finished)
    }
}

/// Holds `key` of `target` for dead letter `dlq_id`, which becomes its holder (the latest
/// dead letter of a key is the one whose redrive releases it).
fn hold_key(txn: &Tx<'_>, target: &str, key: &str, dlq_id: u64) -> Result<(), StoreError> {
    txn.open_table(HELD)?.insert((target, key), ())?;
    txn.open_table(HELD_BY)?.insert((target, key), dlq_id)?;
    Ok(())
}

/// A redrive of dead letter `dlq_id` (already out of the DLQ) releases `key` of `target`
/// if it holds it: the dead letter is the key's holder, or the holder has left the DLQ, or
/// the hold predates holders. Redriving another dead letter of a held key leaves the hold,
/// so the key's later entries still wait for its holder. Returns whether it released.
fn release_hold_of(
    txn: &Tx<'_>,
    target: &str,
    key: String,
    dlq_id: u64,
    effects: &mut Vec<Effect>,
) -> Result<bool, StoreError> {
    let k = (target, key.as_str());
    if txn.open_table(HELD)?.get(k)?.is_none() {
        return Ok(false);
    }
    let holder = txn.open_table(HELD_BY)?.get(k)?.map(|v| v.value());
    if let Some(h) = holder
        && h != dlq_id
        && txn.open_table(DLQ)?.get(h)?.is_some()
    {
        return Ok(false);
    }
    txn.open_table(HELD)?.remove(k)?;
    txn.open_table(HELD_BY)?.remove(k)?;
    effects.push(Effect::Release {
        target: target.to_string(),
        key,
    });
    Ok(true)
}

/// Under `on_dead_letter: hold`, holds the ordering key of `t`, a copy the depth cap refused
/// (`target_overflow`): a dead letter like any other, which later events of the key must not
/// overtake. The key's entries accepted before it wait too: the hold is per key.
fn hold_overflowed_key(
    txn: &Tx<'_>,
    t: &NewEntry,
    dlq_id: u64,
    effects: &mut Vec<Effect>,
) -> Result<(), StoreError> {
    let Some(key) = t.ordering_key.as_ref().filter(|_| t.hold_key) else {
        return Ok(());
    };
    hold_key(txn, &t.target_id, key, dlq_id)?;
    effects.push(Effect::Hold {
        target: t.target_id.clone(),
        key: key.clone(),
    });
    Ok(())
}

/// Applies a group's plain finishes (`PlainFinish`) with the entries table and the live index
/// opened once. Each finish's own refusal (fenced, not found) is its answer; a storage error
/// is also returned, to abort the group.
fn finish_plain(
    txn: &Tx<'_>,
    floor: u64,
    finishes: impl Iterator<Item = PlainFinish>,
    dones: &mut Vec<Done>,
    effects: &mut Vec<Effect>,
) -> Result<(), StoreError> {
    let mut entries = txn.open_table(ENTRIES)?;
    let mut live = txn.open_table(LIVE)?;
    let mut failed = None;
    for f in finishes {
        let key = (f.id.event, f.id.idx);
        let r = (|| -> Result<Finished, FinishError> {
            let mut e = {
                let raw = entries.get(key).map_err(StoreError::from)?;
                leased_entry(raw.as_ref().map(|v| v.value()), f.id, f.lease, f.now)?
            };
            e.close_attempt(&f.end);
            effects.push(f.settle.apply(&mut e, f.id, f.now, &mut live, floor)?);
            entries
                .insert(key, enc_entry(&e).as_slice())
                .map_err(StoreError::from)?;
            Ok(Finished::default())
        })();
        if let Err(FinishError::Store(e)) = &r {
            failed.get_or_insert(e.clone());
        }
        dones.push(finish_done(f.reply, r));
    }
    failed.map_or(Ok(()), Err)
}

/// A finish's answer, sent once its group's commit is known: its own result, or the
/// commit's error.
fn finish_done(
    reply: Reply<Result<Finished, FinishError>>,
    r: Result<Finished, FinishError>,
) -> Done {
    Box::new(move |commit_err| {
        let _ = reply.send(match commit_err {
            Some(e) => Err(FinishError::Store(e.clone())),
            None => r,
        });
    })
}

/// The `Idempotency-Key` of one (event, target), or of its copy made by replay job `replay`
/// (derived from the original's key and the job, so receivers process it again): what a
/// replay step and a redrive of a replayed copy both give it, on every backend.
pub fn delivery_key(source: &str, id: &str, target: &str, replay: Option<&str>) -> String {
    let original = idempotency_key(source, id, target);
    match replay {
        Some(job) => idempotency_key(&original, job, "replay"),
        None => original,
    }
}

/// The `Idempotency-Key` of one (event, target): stable across retries, restarts and
/// redrives, and the same on every backend.
pub fn idempotency_key(source: &str, id: &str, target: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for part in [source, id, target] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    hex::encode(&h.finalize()[..16])
}

/// [`StoreError::JobChanged`] unless the stored job is at `job.rev` (no job: 0).
fn check_job_rev(txn: &Tx<'_>, job: &Job) -> Result<(), StoreError> {
    let stored = match txn.open_table(JOBS)?.get(job.id.as_str())? {
        Some(v) => dec::<Job>("jobs", v.value())?.rev,
        None => 0,
    };
    if stored == job.rev {
        Ok(())
    } else {
        Err(StoreError::JobChanged(job.id.clone()))
    }
}

/// Writes `job` at its next revision if it is still at `job.rev`; returns that revision.
fn put_job(txn: &Tx<'_>, job: &Job) -> Result<u64, StoreError> {
    check_job_rev(txn, job)?;
    write_job(txn, job)
}

/// Removes each of `jobs` still at its revision; returns how many went.
fn delete_jobs(txn: &Tx<'_>, jobs: &[Job]) -> Result<u64, StoreError> {
    let mut removed = 0;
    for job in jobs {
        match check_job_rev(txn, job) {
            Ok(()) => {}
            Err(StoreError::JobChanged(_)) => continue,
            Err(e) => return Err(e),
        }
        if txn.open_table(JOBS)?.remove(job.id.as_str())?.is_some() {
            removed += 1;
        }
    }
    Ok(removed)
}

/// Writes `job` at its next revision (checked by the caller); returns that revision.
fn write_job(txn: &Tx<'_>, job: &Job) -> Result<u64, StoreError> {
    let rev = job.rev + 1;
    let job = Job { rev, ..job.clone() };
    txn.open_table(JOBS)?
        .insert(job.id.as_str(), enc(&job).as_slice())?;
    Ok(rev)
}

/// Visits the DLQ entries matching `filter` with ids from `start` up, in id order, until
/// `visit` answers false. A filter naming a target reads only that target's entries (through
/// `DLQ_BY_TARGET`); any other reads the whole DLQ from `start`.
fn for_each_dlq(
    r: &redb::ReadTransaction,
    filter: &DlqFilter,
    start: u64,
    mut visit: impl FnMut(DlqEntry) -> bool,
) -> Result<(), StoreError> {
    scan_dlq(r, filter, start, |raw, _| Ok(visit(dec("dlq", raw)?)))
}

/// Visits the DLQ's records from id `start` on that pass `filter` (each with its head, the
/// only part decoded to decide) until `visit` answers false: through the by-target index
/// when the filter names a target.
fn scan_dlq(
    r: &redb::ReadTransaction,
    filter: &DlqFilter,
    start: u64,
    mut visit: impl FnMut(&[u8], DlqHead<'_>) -> Result<bool, StoreError>,
) -> Result<(), StoreError> {
    let mut offer = |raw: &[u8]| -> Result<bool, StoreError> {
        let head: DlqHead<'_> = serde_json::from_slice(raw).map_err(|e| StoreError::Corrupt {
            table: "dlq",
            message: e.to_string(),
        })?;
        if !filter.matches_head(&head) {
            return Ok(true);
        }
        visit(raw, head)
    };
    let t = r.open_table(DLQ)?;
    let Some(target) = filter.target.as_deref() else {
        for row in t.range(start..)? {
            if !offer(row?.1.value())? {
                break;
            }
        }
        return Ok(());
    };
    let target = match target {
        NO_TARGET => dlq_target_key(None),
        t => t,
    };
    let by_target = r.open_table(DLQ_BY_TARGET)?;
    for row in by_target.range((target, start)..=(target, u64::MAX))? {
        let id = row?.0.value().1;
        // The index and the DLQ change in the same commits; a missing entry is skipped all the
        // same rather than failing a read.
        let Some(raw) = t.get(id)? else { continue };
        if !offer(raw.value())? {
            break;
        }
    }
    Ok(())
}

/// Redrive job `job`'s keep of DLQ entry `id` at `now` ([`DlqEntry::kept_by_redrive`]).
fn keep_dlq(
    txn: &Tx<'_>,
    id: u64,
    job: &str,
    now: Millis,
    note: &str,
    errors: Option<&Vec<crate::event::FieldError>>,
) -> Result<(), StoreError> {
    let mut t = txn.open_table(DLQ)?;
    let raw = t.get(id)?.map(|v| v.value().to_vec());
    if let Some(raw) = raw {
        let mut d: DlqEntry = dec("dlq", &raw)?;
        // Not a new failure: the time of the last one stays (the summary's histogram and
        // `until` filters go by it).
        d.kept_by_redrive(job, now, note, errors);
        t.insert(id, enc(&d).as_slice())?;
    }
    Ok(())
}

/// Removes a DLQ entry (and its index rows); returns it.
fn take_dlq(txn: &Tx<'_>, id: u64) -> Result<Option<DlqEntry>, StoreError> {
    let raw = txn.open_table(DLQ)?.remove(id)?.map(|v| v.value().to_vec());
    let Some(raw) = raw else { return Ok(None) };
    let d: DlqEntry = dec("dlq", &raw)?;
    txn.open_table(DLQ_BY_EVENT)?.remove((d.event_seq, id))?;
    txn.open_table(DLQ_BY_TARGET)?
        .remove((dlq_target_key(d.target_id.as_deref()), id))?;
    Ok(Some(d))
}

/// What the sweep reads of an `events` record: when it was accepted. The rest of the record
/// (the data above all) is skipped, not decoded.
#[derive(serde::Deserialize)]
struct SweepView {
    accepted_at: Millis,
}

/// What the sweep reads of a kept event: its dedup key (`DEDUP_KEPT`).
#[derive(serde::Deserialize)]
struct KeyView<'a> {
    #[serde(borrow)]
    event: KeyFields<'a>,
}

#[derive(serde::Deserialize)]
struct KeyFields<'a> {
    #[serde(borrow)]
    source: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    id: std::borrow::Cow<'a, str>,
}

/// The dedup key's fingerprint of the `events` record `b`.
fn record_fp(seq: u64, b: &[u8]) -> Result<dedup::Fp, StoreError> {
    let v: KeyView<'_> = serde_json::from_slice(EventRecord::split(seq, b)?.json).map_err(|e| {
        StoreError::Corrupt {
            table: "events",
            message: format!("event {seq}: {e}"),
        }
    })?;
    Ok(dedup::fingerprint(&crate::event::dedup_key(
        &v.event.source,
        &v.event.id,
    )))
}

/// Event `seq`'s acceptance time, for the sweep; `None` when its record does not decode. The
/// sweep then takes it for as old as its neighbours in sequence order: failing on it failed
/// every sweep from then on (the file grew without bound), and with it every request of the
/// commit group the sweep was in.
fn sweep_view(seq: u64, b: &[u8]) -> Option<Millis> {
    let json = EventRecord::split(seq, b).ok()?.json;
    serde_json::from_slice::<SweepView>(json)
        .ok()
        .map(|v| v.accepted_at)
}

/// The tables a sweep writes, opened once per sweep call: opening a table and closing it
/// again writes its root back into the table of tables, which per removed event cost more
/// than the removal itself.
struct SweepTables<'a> {
    events: LTable<'a, u64, &'static [u8]>,
    entries: LTable<'a, (u64, u32), &'static [u8]>,
    live: LTable<'a, (u64, u32), ()>,
    dlq_by_event: LTable<'a, (u64, u64), ()>,
    pending_gc: LTable<'a, u64, ()>,
    dedup_kept: LTable<'a, (u128, u64), ()>,
}

impl<'a> SweepTables<'a> {
    fn open(txn: &Tx<'a>) -> Result<Self, StoreError> {
        Ok(Self {
            events: txn.open_table(EVENTS)?,
            entries: txn.open_table(ENTRIES)?,
            live: txn.open_table(LIVE)?,
            dlq_by_event: txn.open_table(DLQ_BY_EVENT)?,
            pending_gc: txn.open_table(PENDING_GC)?,
            dedup_kept: txn.open_table(DEDUP_KEPT)?,
        })
    }

    /// Event `seq` is kept past the sweep: its dedup key moves out of its run (which can then
    /// be dropped) into `DEDUP_KEPT`, for its fate.
    fn keep(&mut self, seq: u64) -> Result<(), StoreError> {
        self.pending_gc.insert(seq, ())?;
        // An unreadable record's key is unknown: it cannot be asked for by key anyway.
        let fp = match self.events.get(seq)? {
            Some(raw) => record_fp(seq, raw.value()).ok(),
            None => None,
        };
        if let Some(fp) = fp {
            self.dedup_kept.insert((fp, seq), ())?;
        }
        Ok(())
    }

    /// Whether a live queue entry or a DLQ entry still refers to event `seq`.
    fn referenced(&self, seq: u64) -> Result<bool, StoreError> {
        Ok(!self.referenced_in(seq, seq)?.is_empty())
    }

    /// Of the events `lo..=hi`, those a live queue entry or a DLQ entry refers to: one range
    /// read per index for the whole batch instead of two lookups per event.
    fn referenced_in(&self, lo: u64, hi: u64) -> Result<BTreeSet<u64>, StoreError> {
        let mut seqs = BTreeSet::new();
        for row in self.live.range((lo, 0)..=(hi, u32::MAX))? {
            seqs.insert(row?.0.value().0);
        }
        for row in self.dlq_by_event.range((lo, 0)..=(hi, u64::MAX))? {
            seqs.insert(row?.0.value().0);
        }
        Ok(seqs)
    }

    /// Removes the events `gone` with their finished queue entries. Their dedup keys go with
    /// their run once the sweep has passed it (`Committer::drop_swept_runs`), or, for events
    /// kept earlier, from `DEDUP_KEPT` (the caller).
    fn remove(&mut self, gone: &[u64], stats: &mut SweepStats) -> Result<(), StoreError> {
        for seq in gone {
            self.events.remove(*seq)?;
        }
        // Each event's entry rows (keys start with its sequence number), with the table
        // already open: one short range read each.
        let mut rows = Vec::new();
        for seq in gone {
            for row in self.entries.range((*seq, 0)..=(*seq, u32::MAX))? {
                rows.push(row?.0.value());
            }
        }
        for key in rows {
            self.entries.remove(key)?;
        }
        stats.events_removed += gone.len() as u64;
        Ok(())
    }
}

/// The acceptance time before which a sweep removes events.
fn sweep_cut(now: Millis, dedup_window_ms: i64, retention_ms: i64) -> Millis {
    now - retention_ms.max(dedup_window_ms)
}

/// Bounded garbage collection. Events past the retention (at least the dedup window) are
/// removed with their finished entries and dedup key unless something still refers to them (a
/// live queue entry or a DLQ entry); those wait in `pending_gc`, which is revisited a batch at
/// a time. Dedup keys inside the window are never removed; keys of kept events move to
/// `DEDUP_KEPT` (so their fate remains visible) and no longer count as duplicates: they are
/// older than the window.
///
/// Only events below `floor` are looked at: above it, `live` does not hold every live entry
/// (the committer moves the floor past the sweep's cut first, `Committer::sweep_floor`).
fn sweep(
    txn: &Tx<'_>,
    now: Millis,
    dedup_window_ms: i64,
    retention_ms: i64,
    batch: usize,
    floor: u64,
) -> Result<SweepStats, StoreError> {
    let mut stats = SweepStats::default();
    let cut = sweep_cut(now, dedup_window_ms, retention_ms);
    let mut meta = txn.open_table(META)?;
    let cursor = read_u64(&*meta, "sweep_cursor")?.unwrap_or(0);
    let gc_cursor = read_u64(&*meta, "gc_cursor")?.unwrap_or(0);
    let mut t = SweepTables::open(txn)?;

    // The oldest events past the cut, in acceptance order.
    let mut candidates = Vec::new();
    for row in t.events.range(cursor..floor.max(cursor))?.take(batch) {
        let (k, v) = row?;
        if sweep_view(k.value(), v.value()).is_some_and(|at| at >= cut) {
            break;
        }
        candidates.push(k.value());
    }
    stats.more = candidates.len() >= batch;
    let next_cursor = candidates.last().map_or(cursor, |seq| seq + 1);
    if let (Some(&lo), Some(&hi)) = (candidates.first(), candidates.last()) {
        let kept = t.referenced_in(lo, hi)?;
        for seq in &kept {
            t.keep(*seq)?;
        }
        stats.pending += kept.len() as u64;
        candidates.retain(|seq| !kept.contains(seq));
        t.remove(&candidates, &mut stats)?;
    }
    meta.insert("sweep_cursor", next_cursor.to_le_bytes().as_slice())?;

    // Revisit events kept earlier, a batch at a time, wrapping around (a batch that reaches
    // the end goes on from the start).
    let read = |range: std::ops::Range<u64>, n: usize| -> Result<Vec<u64>, StoreError> {
        Ok(t.pending_gc
            .range(range)?
            .take(n)
            .map(|r| r.map(|(k, _)| k.value()))
            .collect::<Result<_, _>>()?)
    };
    let mut pending = read(gc_cursor..u64::MAX, batch)?;
    if pending.len() < batch && gc_cursor > 0 {
        let more = read(0..gc_cursor, batch - pending.len())?;
        pending.extend(more);
    }
    let next_gc = pending.last().map_or(0, |seq| seq + 1);
    let mut gone = Vec::new();
    for seq in pending {
        if t.referenced(seq)? {
            continue;
        }
        t.pending_gc.remove(seq)?;
        // Only the sweep removes events, and it drops them from `pending_gc` in the same
        // transaction; a missing record would still be nothing to remove.
        // An unreadable record goes too, without the key it was kept under (unknown).
        let fp = t
            .events
            .get(seq)?
            .map(|raw| record_fp(seq, raw.value()).ok());
        if let Some(fp) = fp {
            if let Some(fp) = fp {
                t.dedup_kept.remove((fp, seq))?;
            }
            gone.push(seq);
        }
    }
    t.remove(&gone, &mut stats)?;
    // A drained backlog leaves many kept events free at once: go on through them now rather
    // than a batch per sweep interval (with 256 a minute, a million took 65 hours while
    // their space stayed taken). A batch that frees nothing stops it, so a long-dead target's
    // kept events are not rescanned back to back; every batch that goes on removes some.
    stats.more |= !gone.is_empty();
    meta.insert("gc_cursor", next_gc.to_le_bytes().as_slice())?;
    drop(t);

    // COMPLETED records past their expiry, oldest first, a batch at a time.
    let expired = expired_batch(txn, COMPLETED_EXP, now, batch)?;
    stats.more |= expired.len() >= batch;
    let mut completed = txn.open_table(COMPLETED)?;
    let mut exp = txn.open_table(COMPLETED_EXP)?;
    for (at, h, key) in expired {
        exp.remove((at, h.as_str(), key.as_str()))?;
        completed.remove((h.as_str(), key.as_str()))?;
        stats.completed_expired += 1;
    }
    drop((completed, exp));

    // Handler KV entries past their TTL (reads already treat them as absent; this gives their
    // space back and keeps the namespace's size honest).
    let expired = expired_batch(txn, KV_EXP, now, batch)?;
    stats.more |= expired.len() >= batch;
    for (at, ns, key) in expired {
        let current = txn
            .open_table(KV)?
            .get((ns.as_str(), key.as_str()))?
            .map(|v| v.value().0);
        if current == Some(at) {
            kv_put(txn, &ns, &key, None, i64::MAX)?;
            stats.kv_expired += 1;
        } else {
            // Rewritten since (kv_put keeps the index in step; this is only a stale row).
            txn.open_table(KV_EXP)?
                .remove((at, ns.as_str(), key.as_str()))?;
        }
    }
    Ok(stats)
}

/// The oldest rows of an expiry index `(expires_at, handler, key)` due before `now`, at most a
/// sweep batch.
fn expired_batch(
    txn: &Tx<'_>,
    index: TableDefinition<'static, (i64, &'static str, &'static str), ()>,
    now: Millis,
    batch: usize,
) -> Result<Vec<(i64, String, String)>, StoreError> {
    let rows = txn
        .open_table(index)?
        .range(..(now, "", ""))?
        .take(batch)
        .map(|r| {
            r.map(|(k, _)| {
                let (at, h, key) = k.value();
                (at, h.to_string(), key.to_string())
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(rows)
}

/// What one key-value entry adds to its namespace's counter of key and value bytes
/// (`KV_USAGE`; the per-entry overhead is added from the key count when read).
fn kv_size(key: &str, value: &[u8]) -> i64 {
    i64::try_from(KvUsage::data_bytes(key, value)).unwrap_or(i64::MAX)
}

/// What one key-value entry counts against its namespace's bound (`handlers.kv_max_bytes`).
fn kv_counted(key: &str, value: &[u8]) -> i64 {
    i64::try_from(KvUsage::entry_bytes(key, value)).unwrap_or(i64::MAX)
}

/// Writes (or, with `value: None`, deletes) one handler key-value entry, keeping the expiry
/// index and the namespace's size in step.
fn kv_put(
    txn: &Tx<'_>,
    ns: &str,
    key: &str,
    value: Option<&[u8]>,
    expires_at: i64,
) -> Result<(), StoreError> {
    let mut kv = txn.open_table(KV)?;
    let old = match value {
        Some(v) => kv.insert((ns, key), (expires_at, v))?,
        None => kv.remove((ns, key))?,
    }
    .map(|g| {
        let (exp, val) = g.value();
        (exp, kv_size(key, val))
    });
    drop(kv);
    let mut exp = txn.open_table(KV_EXP)?;
    if let Some((old_exp, _)) = old.filter(|(e, _)| *e != i64::MAX) {
        exp.remove((old_exp, ns, key))?;
    }
    if value.is_some() && expires_at != i64::MAX {
        exp.insert((expires_at, ns, key), ())?;
    }
    drop(exp);
    let (old_bytes, old_keys) = old.map_or((0, 0), |(_, b)| (b, 1));
    let (new_bytes, new_keys) = value.map_or((0, 0), |v| (kv_size(key, v), 1));
    if (old_bytes, old_keys) == (new_bytes, new_keys) {
        return Ok(());
    }
    let mut usage = txn.open_table(KV_USAGE)?;
    let (bytes, keys) = usage.get(ns)?.map_or((0, 0), |v| v.value());
    let bytes =
        u64::try_from((i64::try_from(bytes).unwrap_or(i64::MAX) + new_bytes - old_bytes).max(0))
            .unwrap_or(0);
    let keys = (keys + new_keys).saturating_sub(old_keys);
    if keys == 0 {
        usage.remove(ns)?;
    } else {
        usage.insert(ns, (bytes, keys))?;
    }
    Ok(())
}

/// Builds the expiry index and the per-namespace sizes from the KV table (stores written
/// before they existed).
fn rebuild_kv_accounting(txn: &Tx<'_>) -> Result<(), StoreError> {
    let mut usage: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut exp = txn.open_table(KV_EXP)?;
    for row in txn.open_table(KV)?.iter()? {
        let (k, v) = row?;
        let (ns, key) = k.value();
        let (at, val) = v.value();
        let u = usage.entry(ns.to_string()).or_default();
        u.0 += u64::try_from(kv_size(key, val)).unwrap_or(0);
        u.1 += 1;
        if at != i64::MAX {
            exp.insert((at, ns, key), ())?;
        }
    }
    let mut t = txn.open_table(KV_USAGE)?;
    for (ns, u) in usage {
        t.insert(ns.as_str(), u)?;
    }
    Ok(())
}

pub mod check;
mod dedup;
mod logged;
use logged::{LTable, Tx};
mod entry_codec;
mod event_record;
use event_record::EventRecord;

#[cfg(test)]
mod crash_model;
#[cfg(test)]
mod tests;
