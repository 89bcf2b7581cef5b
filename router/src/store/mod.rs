//! Durable storage: the seam between the pipeline and its backends.
//!
//! The `Store` trait is shaped around the router's operations (accept an event with its
//! fan-out, lease due entries, finish an attempt with its disposition, dead-letter, read an
//! event's fate), not around keys and values, so a JetStream backend can implement it later.
//! `RedbStore` is the embedded default; with redb's in-memory backend it is also the in-memory
//! store that unit tests use, and with `fault::FaultBackend` it simulates power loss.

pub mod fault;
mod group_log;
pub mod jetstream;
pub mod model;
mod redb_store;
mod sync_behind;
#[cfg(test)]
pub(crate) mod test_events;

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use tokio::sync::Notify;

pub use model::*;
pub use redb_store::check::{CheckError, CheckReport, Verdict, check_dir};
pub use redb_store::{RedbStore, StoreOptions};

/// A storage failure. Clone so one failed group commit can answer every request in it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The backend failed (I/O, corruption, full disk). Ingest answers 503.
    #[error("storage failure: {0}")]
    Backend(String),
    /// The store cannot be reached now or did not take the call: a shared store's server is
    /// down or the connection to it is being made again (nothing was sent: refused at once
    /// instead of waiting out a timeout), or a read or a write not taken timed out, found no
    /// one to answer (a server stopping, a stream electing its leader) or found the stream
    /// too busy. Nothing of the call was applied. Ingest answers 503.
    #[error("storage unavailable: {0}")]
    Unavailable(String),
    /// A write was sent and its answer never came (a timeout, a connection lost after the
    /// send): it may or may not have been applied. Read again to know; a change an operator
    /// asked for may still take effect.
    #[error("storage did not answer, the write may or may not have been applied: {0}")]
    Unanswered(String),
    /// The store was written by another on-disk format version.
    #[error("{}", format_version_refusal(*found, *expected, file.as_deref()))]
    FormatVersion {
        /// Version found on disk.
        found: u32,
        /// Version this build writes.
        expected: u32,
        /// The store file, when known.
        file: Option<String>,
    },
    /// The store is shutting down.
    #[error("store is closed")]
    Closed,
    /// The store is compacting its file (after a large backlog drained): new writes and reads
    /// are refused for its duration rather than left waiting. Ingest answers 503 with a
    /// `Retry-After`; delivery pauses and resumes.
    #[error("the store is compacting its file; retry in a few seconds")]
    Compacting,
    /// A job was written by someone else since this copy was read (its revision moved on):
    /// nothing of the write was applied; read the job again.
    #[error("job {0} was changed since it was read")]
    JobChanged(String),
    /// One event of the call cannot be stored: its record would be larger than the backend
    /// takes in one record (the JetStream store's NATS server `max_payload`; the event's text
    /// is stored JSON-escaped, binary data as base64). Nothing of the call was stored. Ingest
    /// answers 413.
    #[error(
        "event {index} of the request would be stored as a record of {bytes} bytes, over the \
         {max} bytes the store takes in one record"
    )]
    EventTooLarge {
        /// The event's position in the call.
        index: usize,
        /// Its record's size.
        bytes: usize,
        /// The largest record the store takes.
        max: usize,
    },
    /// An event whose fan-out is over what the store commits in one atomic write (the
    /// JetStream store: one atomic batch of at most 1000 messages holds the event and one
    /// entry per target). Nothing of the call was stored; sent again it would fail again.
    /// Ingest answers 422.
    #[error(
        "event {index} of the request needs {writes} writes to be stored with its fan-out, over the {max} the store commits atomically"
    )]
    FanOutTooLarge {
        /// The event's position in the call.
        index: usize,
        /// The writes it needs (its record, dedup key and one entry per matched target).
        writes: usize,
        /// The most one atomic commit takes.
        max: usize,
    },
    /// A record could not be decoded.
    #[error("corrupt record in {table}: {message}")]
    Corrupt {
        /// Table name.
        table: &'static str,
        /// Decoder message.
        message: String,
    },
}

/// `StoreError::FormatVersion`'s message: which file, which versions this build reads (all
/// from `OLDEST_READABLE_FORMAT`, not only the one it writes), and what to do.
fn format_version_refusal(found: u32, expected: u32, file: Option<&str>) -> String {
    let of = file.map(|f| format!(" of {f}")).unwrap_or_default();
    let what = if found > expected {
        "a newer build wrote it: run that build (or a newer one), or restore the copy of the \
         data directory kept from before the upgrade"
    } else {
        "no build writes that version: the file is damaged or not a router store; run `router \
         store check --data-dir DIR`, then restore the data directory from a backup \
         (docs/operations.md, \"A damaged store file\")"
    };
    format!(
        "store format version {found}{of} is not supported: this build reads versions \
         {OLDEST_READABLE_FORMAT} to {expected}; {what}"
    )
}

impl StoreError {
    /// Whether this is one request's refusal that wrote nothing (a job's revision moved on),
    /// as opposed to a failure of the store: a group commit answers the refused request and
    /// commits the others, instead of failing them all and reopening the store.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            StoreError::JobChanged(_)
                | StoreError::EventTooLarge { .. }
                | StoreError::FanOutTooLarge { .. }
        )
    }
}

impl StoreError {
    /// Whether the store could not be reached or did not answer (as opposed to refusing the
    /// call or failing on its own): the same call may succeed once it answers again.
    pub fn is_outage(&self) -> bool {
        matches!(self, StoreError::Unavailable(_) | StoreError::Unanswered(_))
    }
}

/// One compaction of the store file: what `/v1/status` shows and the metrics count.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CompactionReport {
    /// When it ended (ms since the Unix epoch).
    pub finished_at: Millis,
    /// How long new work was refused for it.
    pub took_ms: u64,
    /// File size before.
    pub before_bytes: u64,
    /// File size after.
    pub after_bytes: u64,
    /// Why it failed (`None`: it succeeded).
    pub error: Option<String>,
}

impl<E: Into<redb::Error>> From<E> for StoreError {
    fn from(e: E) -> Self {
        StoreError::Backend(e.into().to_string())
    }
}

/// Why finishing a leased entry was refused.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FinishError {
    /// The lease was taken over (expired and re-leased, or reclaimed): the late worker's
    /// result is discarded. This is the fencing that keeps a slow worker from acking.
    #[error("lease is no longer held (fenced)")]
    Fenced,
    /// The entry does not exist or is not queued.
    #[error("entry not found or not queued")]
    NotFound,
    /// A compare-and-set precondition of the outbox no longer holds: nothing was written;
    /// the delivery must run again.
    #[error("key-value precondition failed for {0:?}")]
    Conflict(String),
    /// The outbox would grow a handler's key-value namespace past its bound: nothing was
    /// written.
    #[error(
        "key-value namespace {namespace:?} would hold {would_hold} bytes, over its limit of {max} bytes"
    )]
    KvQuota {
        /// The handler.
        namespace: String,
        /// Bytes (keys plus values) the namespace would hold after the writes.
        would_hold: u64,
        /// The bound.
        max: u64,
    },
    /// The records the outbox writes (a key-value namespace's usage, say) kept changing under
    /// concurrent finishes until the store gave up: nothing was written and the lease is
    /// still held. The router's contention, not the handler's: the attempt is put back
    /// without counting.
    #[error("the records this finish writes kept changing under concurrent finishes")]
    Contended,
    /// The outbox writes a record larger than the store takes in one record (an emitted
    /// event, a key-value entry or a stored result past the JetStream server's
    /// `max_payload`): nothing was written and the lease is still held. Run again, the
    /// handler would write the same: the caller dead-letters the delivery without its outbox.
    #[error(
        "the handler's output cannot be stored: record {record} would take {bytes} bytes, over \
         the {max} the store takes in one record"
    )]
    TooLarge {
        /// The record's key.
        record: String,
        /// Its size.
        bytes: usize,
        /// The largest record the store takes.
        max: usize,
    },
    /// Storage failure.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Records held per bounded kind: what the age and size bounds act on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecordCounts {
    /// Stored events (kept for the fate retention / archive / dedup window).
    pub events: u64,
    /// Events above the embedded store's entry floor: the recovery at start reads these
    /// events' records for their queued entries (about two seconds' worth; more only while a
    /// backlog crosses the floor). Zero on other backends.
    pub events_above_floor: u64,
    /// Ingest dedup keys held: kept for as long as their events are (the longest of the
    /// fate retention, the archive retention and the dedup window), and on the embedded store
    /// until the sweep drops their whole run (an hour's keys, or `store.dedup_memtable_keys`),
    /// so well past the dedup window.
    pub dedup_keys: u64,
    /// Of them, those that may be inside the dedup window now (an upper bound: a run that
    /// straddles the window's start counts whole). `None` where the backend cannot say.
    pub dedup_keys_in_window: Option<u64>,
    /// Sorted runs of dedup keys on disk (one an hour, or per `store.dedup_memtable_keys`);
    /// each is a Bloom-filter probe per accept while it is inside the window.
    pub dedup_runs: u64,
    /// Memory the runs' Bloom filters hold.
    pub dedup_filter_bytes: u64,
    /// Runs older than the dedup window, whose filters are no longer kept (accept does not
    /// consult them; a fate lookup reads each of them directly).
    pub dedup_cold_runs: u64,
    /// Handler COMPLETED records (kept for `handlers.completed_ttl`).
    pub completed: u64,
    /// Handler key-value entries, all namespaces (bounded by `handlers.kv_max_bytes` each).
    pub kv_keys: u64,
}

/// Totals of one sweep run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepStats {
    /// Dedup keys removed: those of runs whose every event the sweep has removed.
    pub dedup_expired: u64,
    /// Events (with their finished entries) removed.
    pub events_removed: u64,
    /// Events past retention kept because a queue or DLQ entry still refers to them.
    pub pending: u64,
    /// Handler COMPLETED records removed at their expiry.
    pub completed_expired: u64,
    /// Handler key-value entries removed at their expiry (TTL).
    pub kv_expired: u64,
    /// True when the sweep stopped at its batch bound with more left to do.
    pub more: bool,
}

/// What `Store::accept_leased` answers: each event's outcome, and the entries leased at
/// acceptance.
pub type AcceptedLeased = (Vec<AcceptOutcome>, Vec<LeasedAtAccept>);

/// The router's durable operations.
///
/// Everything that may leave the process (a JetStream round trip) is async, so no caller can
/// hold a lock across it without `clippy::await_holding_lock` saying so. The synchronous
/// methods answer from memory (the queue index), except `kv_get` and `kv_usage_of`: the WASM
/// host calls them from inside a handler invocation, which runs on a blocking thread.
pub trait Store: Send + Sync + 'static {
    /// Stores events, each with its dedup key and its queue entries (or its DLQ entry when
    /// quarantined), atomically, and resolves only once that is durable on disk.
    fn accept(
        &self,
        events: Vec<NewEvent>,
    ) -> BoxFuture<'_, Result<Vec<AcceptOutcome>, StoreError>>;

    /// `accept`, and the entries whose `NewEntry::lease_ms` is set are written leased to the
    /// caller with their first attempt started, in the same commit, and returned with their
    /// events (taken from `events`, not read back). An entry is not returned when its event
    /// was a duplicate or its queue was at its depth cap (then it is in the DLQ as
    /// `target_overflow`, as with `accept`).
    fn accept_leased(
        &self,
        events: Vec<NewEvent>,
    ) -> BoxFuture<'_, Result<AcceptedLeased, StoreError>>;

    /// Leases up to `max` entries of `target` due at `now`, records the start of an attempt
    /// on each durably, and returns them with their events. An entry whose event's record
    /// cannot be read (it does not decode, or it is missing) is returned apart, leased, in
    /// [`LeaseBatch::unreadable`], instead of failing the whole lease: one bad record failed
    /// every lease of its target, whose queue then stood still for good.
    fn lease_batch(
        &self,
        target: &str,
        now: Millis,
        max: usize,
        lease_ms: i64,
    ) -> BoxFuture<'_, Result<LeaseBatch, StoreError>>;

    /// [`Store::lease_batch`]'s readable entries. The unreadable ones stay leased until their
    /// lease expires: for callers (tests, benchmarks) that do not set them aside.
    fn lease(
        &self,
        target: &str,
        now: Millis,
        max: usize,
        lease_ms: i64,
    ) -> BoxFuture<'_, Result<Vec<Leased>, StoreError>> {
        let batch = self.lease_batch(target, now, max, lease_ms);
        Box::pin(async move { Ok(batch.await?.leased) })
    }

    /// Records the end of an attempt and moves the entry on (delivered, retry, DLQ),
    /// atomically, if the lease is still held.
    fn finish(
        &self,
        id: EntryId,
        lease: Lease,
        end: AttemptEnd,
        disposition: Disposition,
        now: Millis,
    ) -> BoxFuture<'_, Result<Finished, FinishError>>;

    /// How many of `target`'s entries could be leased at `now` (ordering respected), up to
    /// `max`.
    fn due_count(&self, target: &str, now: Millis, max: usize) -> usize;

    /// Persists a target's runtime state (breaker, pause) as opaque JSON.
    fn put_target_state(
        &self,
        id: &str,
        state: serde_json::Value,
    ) -> BoxFuture<'_, Result<(), StoreError>>;

    /// Every persisted target state.
    fn target_states(&self) -> BoxFuture<'_, Result<Vec<(String, serde_json::Value)>, StoreError>>;

    /// Releases an ordering key held after a dead letter; `false` if it was not held.
    fn release_key(&self, target: &str, key: &str) -> BoxFuture<'_, Result<bool, StoreError>>;

    /// Moves every waiting (not leased) entry of `target` to the DLQ with `reason`, without
    /// an attempt. Returns how many.
    fn dead_letter_queued(
        &self,
        target: &str,
        reason: DlqReason,
        message: &str,
        now: Millis,
    ) -> BoxFuture<'_, Result<usize, StoreError>>;

    /// Moves the waiting (not leased) entries of `target` with ordering key `key` accepted
    /// before `accepted_before` (past their max_age) to the DLQ as `max_age_exceeded`,
    /// without an attempt and without holding the key. Returns how many. Used when a held
    /// key is released: each would be dead-lettered unsent at its turn, holding the key again.
    fn dead_letter_expired_of_key(
        &self,
        target: &str,
        key: &str,
        accepted_before: Millis,
        message: &str,
        now: Millis,
    ) -> BoxFuture<'_, Result<usize, StoreError>>;

    /// Creates or updates a background job, if it is still at `job.rev` (no stored job counts
    /// as revision 0); returns its new revision. [`StoreError::JobChanged`] when it was
    /// written since.
    fn put_job(&self, job: Job) -> BoxFuture<'_, Result<u64, StoreError>>;

    /// Every job.
    fn jobs(&self) -> BoxFuture<'_, Result<Vec<Job>, StoreError>>;

    /// Removes each of `jobs` that is still at its `rev` (finished jobs past their
    /// retention); returns how many went. A job written since is kept.
    fn delete_jobs(&self, jobs: Vec<Job>) -> BoxFuture<'_, Result<u64, StoreError>>;

    /// One job (a read of its record where the backend can; the default filters `jobs`).
    fn job(&self, id: &str) -> BoxFuture<'_, Result<Option<Job>, StoreError>> {
        let id = id.to_string();
        Box::pin(async move { Ok(self.jobs().await?.into_iter().find(|j| j.id == id)) })
    }

    /// Applies redrive actions and the job's new progress atomically, if the job is still at
    /// `job.rev` (as [`Store::put_job`]; on [`StoreError::JobChanged`] nothing is applied);
    /// returns the job's new revision and the actions whose dead letter was gone, which the
    /// stored job counts as skipped instead of moved or failed ([`RedriveGone::apply`]).
    fn redrive_step(
        &self,
        job: Job,
        actions: Vec<RedriveAction>,
        now: Millis,
    ) -> BoxFuture<'_, Result<(u64, RedriveGone), StoreError>>;

    /// The most records one job step ([`Store::redrive_step`], [`Store::replay_step`]) may
    /// write: the job's own record, and what [`RedriveAction::max_writes`] and
    /// [`ReplayItem::max_writes`] count for each action or item. A job's runner stops adding
    /// to a step before it would pass this. The JetStream store commits a step as one atomic
    /// batch, which the server caps (a step over it was refused, and tried again as large for
    /// ever); redb's transactions have no such cap.
    fn max_step_writes(&self) -> usize {
        usize::MAX
    }

    /// Adds replayed deliveries and the job's new progress atomically, if the job is still at
    /// `job.rev` (as [`Store::redrive_step`]); returns the job's new revision, the copies
    /// that went to the DLQ instead (their queue at its depth cap) and the items whose event
    /// was gone, which the stored job counts as [`ReplayStepped::apply`] says (`job` counts
    /// every item as moved).
    fn replay_step(
        &self,
        job: Job,
        items: Vec<ReplayItem>,
        now: Millis,
    ) -> BoxFuture<'_, Result<ReplayStepped, StoreError>>;

    /// Deletes DLQ entries. Returns how many existed.
    fn purge_dlq(&self, ids: Vec<u64>) -> BoxFuture<'_, Result<u64, StoreError>>;

    /// DLQ entries grouped by target × reason, with a histogram over `bucket_ms` buckets.
    fn dlq_summary<'a>(
        &'a self,
        filter: &'a DlqFilter,
        bucket_ms: i64,
    ) -> BoxFuture<'a, Result<Vec<SummaryRow>, StoreError>>;

    /// Archived (not quarantined) events accepted in [`from`, `to`), sequence after
    /// `after_seq`, in sequence order: at most `limit`, and no more than fit in `max_bytes`
    /// of stored event records (always the first one, however large), so that what a caller
    /// holds is bounded whatever the events' size.
    fn events_between(
        &self,
        from: Millis,
        to: Millis,
        after_seq: u64,
        limit: usize,
        max_bytes: usize,
    ) -> BoxFuture<'_, Result<Vec<StoredEvent>, StoreError>>;

    /// How many archived (not quarantined) events were accepted in [`from`, `to`): a replay's
    /// total, counted when it is created.
    fn count_events_between(
        &self,
        from: Millis,
        to: Millis,
    ) -> BoxFuture<'_, Result<u64, StoreError>>;

    /// The stored result of a handler's completed delivery `key`, unless expired.
    fn completed_get<'a>(
        &'a self,
        handler: &'a str,
        key: &'a str,
        now: Millis,
    ) -> BoxFuture<'a, Result<Option<Vec<u8>>, StoreError>>;

    /// A handler's key-value entry (expired entries read as absent).
    fn kv_get(
        &self,
        namespace: &str,
        key: &str,
        now: Millis,
    ) -> Result<Option<Vec<u8>>, StoreError>;

    /// What each handler's key-value namespace holds (namespaces never written are absent).
    fn kv_usage(&self) -> BoxFuture<'_, Result<BTreeMap<String, KvUsage>, StoreError>>;

    /// What one handler's key-value namespace holds.
    fn kv_usage_of(&self, namespace: &str) -> Result<KvUsage, StoreError>;

    /// Removes every key-value entry of `namespace` (a handler whose name is freed for
    /// another team). Returns how many.
    fn kv_clear<'a>(&'a self, namespace: &'a str) -> BoxFuture<'a, Result<u64, StoreError>>;

    /// Removes every COMPLETED record of `handler` (a handler whose name is freed for another
    /// team: a delivery of a key the old handler completed would otherwise get its stored
    /// result, and the new team's handler would never run for it). Returns how many.
    fn completed_clear<'a>(&'a self, handler: &'a str) -> BoxFuture<'a, Result<u64, StoreError>>;

    /// Ordering keys of `target` held after a dead letter.
    fn held_keys(&self, target: &str) -> Vec<String>;

    /// The entry of `target`'s ordering key `key` that goes first (leased, or the first
    /// waiting), from memory: `None` when the key has no live entry.
    fn key_head(&self, target: &str, key: &str) -> Option<KeyHead>;

    /// Whether `target`'s live policy orders its entries by key (`ordering`). Entries keep
    /// the key they were accepted with; with `false` they go as if they had none: none waits
    /// behind another of its key (a retrying or in-flight first one, a held key), and
    /// `key_head` answers `None`. In memory, not stored: the dispatcher sets it from the live
    /// rules whenever it starts a worker (every start, every reload that changes the
    /// target). Until set, a target is ordered, as its entries' keys say.
    fn set_ordered(&self, target: &str, ordered: bool);

    /// Earliest due time among `target`'s waiting entries.
    fn next_due(&self, target: &str) -> Option<Millis>;

    /// A notifier woken whenever `target` gets new or re-queued entries.
    fn notifier(&self, target: &str) -> Arc<Notify>;

    /// Returns in-memory leases that expired before `now` to their queues (the durable lease
    /// record stays, so a late ack is still refused). Returns how many.
    fn reclaim_expired(&self, now: Millis) -> usize;

    /// Saves the last configuration of targets (opaque JSON), so entries of a target that a
    /// later rule set no longer has can still drain under it.
    fn save_targets(
        &self,
        configs: Vec<(String, serde_json::Value)>,
    ) -> BoxFuture<'_, Result<(), StoreError>>;

    /// Every saved target configuration.
    fn saved_targets(&self) -> BoxFuture<'_, Result<Vec<(String, serde_json::Value)>, StoreError>>;

    /// Targets that have live (queued or in-flight) entries.
    fn targets_with_entries(&self) -> Vec<String>;

    /// Everything known about (`source`, `id`).
    fn fate<'a>(
        &'a self,
        source: &'a str,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Fate>, StoreError>>;

    /// DLQ entries matching `filter`, ids greater than `after`, at most `limit`.
    fn dlq_list<'a>(
        &'a self,
        filter: &'a DlqFilter,
        after: Option<u64>,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<DlqEntry>, StoreError>>;

    /// The DLQ as it stands now: its highest id, and the mark that tells the dead letters made
    /// by now from those made after ([`DlqEntry::made`]). A redrive takes only the first: a
    /// dead letter made after its creation (one of its own entries failing again, after a
    /// crash too) is not its to move. Ids alone do not tell them apart on a store shared by
    /// nodes, each of which numbers from a block of its own.
    fn dlq_mark(&self) -> BoxFuture<'_, Result<DlqMark, StoreError>>;

    /// One DLQ entry with its event.
    fn dlq_get(
        &self,
        id: u64,
    ) -> BoxFuture<'_, Result<Option<(DlqEntry, StoredEvent)>, StoreError>>;

    /// Per-target queue numbers.
    fn queue_stats(&self) -> BTreeMap<String, QueueStats>;

    /// How many DLQ entries have no target (events quarantined at ingest): the DLQ's depth
    /// beside the per-target numbers of [`Store::queue_stats`].
    fn dlq_without_target(&self) -> u64;

    /// Expires dedup keys older than `dedup_window_ms` and removes events older than
    /// `retention_ms` that nothing refers to any more. Bounded work per call.
    fn sweep(
        &self,
        now: Millis,
        dedup_window_ms: i64,
        retention_ms: i64,
    ) -> BoxFuture<'_, Result<SweepStats, StoreError>>;

    /// Size of the store on disk, in bytes (0 for in-memory stores); `None` when it cannot be
    /// read now (a shared store's server out of reach): unknown, not empty.
    fn disk_bytes(&self) -> BoxFuture<'_, Option<u64>>;

    /// Whether the store is compacting its file (new writes and reads are refused meanwhile).
    fn compacting(&self) -> bool;

    /// Whether the store takes writes now: false while the embedded store is being reopened
    /// after a write error (a full or failing disk), when every write and read answers 503.
    fn writable(&self) -> bool {
        true
    }

    /// Stops cleanly at shutdown, after the last write: what is written is made durable and
    /// the files are closed (the embedded store's next open then needs no repair). Every
    /// call after it fails. Backends with nothing to close do nothing.
    fn close(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }

    /// The last compaction of the store file since start (`None`: none yet, or a store
    /// without a file).
    fn last_compaction(&self) -> Option<CompactionReport> {
        None
    }

    /// How many records each bounded kind holds (cheap: kept counts, not scans).
    fn record_counts(&self) -> BoxFuture<'_, Result<RecordCounts, StoreError>>;

    /// This node's identity among the nodes sharing the store (`<data_dir>/node-id`, what jobs
    /// name as their `runner`); `None` on a store of one node.
    fn node_id(&self) -> Option<String> {
        None
    }

    /// Whether several router nodes may share this store (then state an operator sets on one
    /// node, such as a paused target, is followed by the others).
    fn shared(&self) -> bool {
        false
    }

    /// Records that this node is alive at `now` and answers how many nodes are (this one
    /// included): those whose announcement changed within the last `NODE_LIVE_MS` as this
    /// node's clock counts. Always 1 on a store of one node.
    fn announce_node(&self, now: Millis) -> BoxFuture<'_, Result<usize, StoreError>> {
        let _ = now;
        Box::pin(async { Ok(1) })
    }

    /// Withdraws this node's announcement (at shutdown), so the others stop counting it.
    fn retire_node(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }

    /// Where the nodes sharing this store keep their uploaded handlers, when several nodes
    /// can share it (`None`: the store has one node, whose handler directory is the truth).
    fn handler_catalog(&self) -> Option<Arc<dyn HandlerCatalog>> {
        None
    }

    /// Where the nodes sharing this store keep the contracts put over the API, when several
    /// nodes can share it (`None`: one node, whose contracts directory is the truth).
    fn contract_catalog(&self) -> Option<Arc<dyn ContractCatalog>> {
        None
    }
}

/// A contract put over the API, as a [`ContractCatalog`] keeps it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SharedContract {
    /// The event type.
    #[serde(rename = "type")]
    pub ty: String,
    /// The contract version (`v<N>`).
    pub version: u32,
    /// The schema file's text, as uploaded.
    pub text: String,
    /// The record's revision (set when read; later uploads have higher ones).
    #[serde(skip)]
    pub revision: u64,
}

/// The contracts put over the API of a deployment whose nodes share one store: the last
/// upload of each (type, version). Every node writes them into its contracts directory and
/// reloads (`admin::contracts::SharedContracts`).
pub trait ContractCatalog: Send + Sync + 'static {
    /// Every uploaded contract.
    fn contracts(&self) -> BoxFuture<'_, Result<Vec<SharedContract>, StoreError>>;

    /// Records an upload (replacing an earlier one of the same type and version); returns
    /// its revision.
    fn put_contract(&self, contract: SharedContract) -> BoxFuture<'_, Result<u64, StoreError>>;
}

/// How a node's following of a shared catalog goes (handlers, contracts), for `/v1/status`:
/// the last complete read, and while reads fail, why and since when.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct SyncHealth {
    /// The last complete read (RFC 3339).
    pub last_sync_at: Option<String>,
    /// Why reading fails, while it does.
    pub error: Option<String>,
    /// Since when reading has been failing (RFC 3339).
    pub failing_since: Option<String>,
}

impl SyncHealth {
    /// Records a read that ended at `now` (RFC 3339) with `result`. Returns true for the first
    /// failure after a success (the one worth a log line).
    pub fn record<T>(&mut self, result: &Result<T, StoreError>, now: String) -> bool {
        match result {
            Ok(_) => {
                self.last_sync_at = Some(now);
                self.error = None;
                self.failing_since = None;
                false
            }
            Err(e) => {
                let first = self.error.is_none();
                if first {
                    self.failing_since = Some(now);
                }
                self.error = Some(e.to_string());
                first
            }
        }
    }
}

/// A node that has not announced itself (`Store::announce_node`) for this long no longer
/// counts as live.
pub const NODE_LIVE_MS: Millis = 15_000;

/// One handler's record in a [`HandlerCatalog`]: its index (the registry's format, opaque
/// here) and the revision that a change must expect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatalogRecord {
    /// The handler name.
    pub name: String,
    /// The record's revision (never 0: 0 stands for "no record" in `put_index`).
    pub revision: u64,
    /// The handler's index, as the registry wrote it.
    pub index: bytes::Bytes,
}

/// The uploaded handlers of a deployment whose nodes share one store: an index record per
/// handler (versions, which one is active), changed by compare-and-set so concurrent uploads
/// on two nodes cannot lose one another, and the components' bytes, keyed by their SHA-256.
/// Every node follows the indexes and installs what they say (`wasm::catalog`).
pub trait HandlerCatalog: Send + Sync + 'static {
    /// Every handler's record.
    fn indexes(&self) -> BoxFuture<'_, Result<Vec<CatalogRecord>, StoreError>>;

    /// One handler's record, if it has one.
    fn index(&self, name: &str) -> BoxFuture<'_, Result<Option<CatalogRecord>, StoreError>>;

    /// Writes `name`'s index if its record is still at revision `expect` (0: no record yet).
    /// `Ok(None)`: it was not (another node changed it first); nothing was written.
    fn put_index(
        &self,
        name: &str,
        index: bytes::Bytes,
        expect: u64,
    ) -> BoxFuture<'_, Result<Option<u64>, StoreError>>;

    /// Stores a component's bytes under (`name`, `sha256`). Storing the same bytes again is
    /// harmless; readers check the hash.
    fn put_component(
        &self,
        name: &str,
        sha256: &str,
        bytes: bytes::Bytes,
    ) -> BoxFuture<'_, Result<(), StoreError>>;

    /// A component's bytes (`size` as its index records it), `None` if they are not stored
    /// in full.
    fn component(
        &self,
        name: &str,
        sha256: &str,
        size: u64,
    ) -> BoxFuture<'_, Result<Option<Vec<u8>>, StoreError>>;

    /// Every component stored, as its records stand now (for sweeping those no index names).
    fn stored_components(&self) -> BoxFuture<'_, Result<Vec<StoredComponent>, StoreError>>;

    /// Removes the records of `components` that are still at the revisions listed: a record
    /// written again since (the same bytes uploaded again) is kept. Returns how many records
    /// went.
    fn remove_components(
        &self,
        components: Vec<StoredComponent>,
    ) -> BoxFuture<'_, Result<usize, StoreError>>;
}

/// A component as a [`HandlerCatalog`] stores it: whose it is, its records and when the
/// newest of them was written. Components are never removed when a handler or version is
/// deleted (a re-upload of the same bytes racing the delete would lose them); they are swept
/// once no index has named them for a while (`wasm::catalog`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredComponent {
    /// The handler name.
    pub name: String,
    /// The component's SHA-256 (hex), as the handler's index names it.
    pub sha256: String,
    /// Its records, each as (key, revision): the backend's own, handed back to remove them.
    pub records: Vec<(String, u64)>,
    /// When its newest record was written (ms since the epoch, the store's clock).
    pub written_ms: Millis,
}

#[cfg(test)]
mod sync_health_tests {
    use super::{StoreError, SyncHealth};

    #[test]
    fn failures_are_reported_once_and_cleared_by_a_good_read() {
        let mut h = SyncHealth::default();
        let down: Result<(), StoreError> = Err(StoreError::Backend("down".into()));
        assert!(
            h.record(&down, "t1".into()),
            "the first failure is worth a log line"
        );
        assert!(!h.record(&down, "t2".into()), "the next ones are not");
        assert_eq!(
            (h.failing_since.as_deref(), h.error.as_deref()),
            (Some("t1"), Some("storage failure: down"))
        );
        assert_eq!(h.last_sync_at, None);
        assert!(!h.record(&Ok::<(), StoreError>(()), "t3".into()));
        assert_eq!(
            h,
            SyncHealth {
                last_sync_at: Some("t3".into()),
                error: None,
                failing_since: None,
            }
        );
        assert!(
            h.record(&down, "t4".into()),
            "a new outage is reported again"
        );
    }
}
