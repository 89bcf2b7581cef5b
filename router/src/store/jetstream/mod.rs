//! The NATS JetStream store backend: the router's records on a JetStream stream, so several
//! router nodes can share one store (SPEC "Storage and scale"; `store.backend = "jetstream"`).
//!
//! It implements the whole `Store` trait: durable acceptance with cluster-wide dedup
//! (`accept`), leasing and finishing deliveries with fencing (this module), redrive, replay and
//! sweeps (`jobs`), target state, saved targets, DLQ listing and handler key-value reads
//! (`ops`). Each node follows the queue entries, held keys and DLQ records into an in-memory
//! view (`view`) that proposes lease candidates and indexes the DLQ; compare-and-set on the
//! records decides. `docs/jetstream-backend.md` has the design, its differences from the
//! embedded store and the measurements.
//!
//! Record keys (subjects under the records prefix), each holding one JSON record:
//! - `ctr.<name>`: a sequence counter; nodes reserve blocks of numbers from it.
//! - `ev.<seq>`: an accepted event (`EventRecord`), written once.
//! - `dd.<fingerprint>`: the dedup key of (source, id) (`DedupRecord`).
//! - `en.<seq>.<idx>`: one target's queue entry of event `seq` (`EntryRecord`).
//! - `dl.<id>`: a DLQ entry.
//! - `hk.<fingerprint>`: an ordering key held after a dead letter (`HeldRecord`);
//!   `kl.<fingerprint>`: which entry of an ordering key is in flight (`KeyLock`).
//! - `ts.`, `tc.`, `job.<fingerprint>`: a target's runtime state, a target's saved
//!   configuration, a redrive or replay job.
//! - `kv.<fingerprint>`, `ku.<fingerprint>.<shard>`, `cd.<fingerprint>`: a handler's key-value
//!   entry, its namespace's usage shards, a handler's COMPLETED record.
//!
//! An event, its dedup key, its entries and its DLQ entry are one atomic batch whose dedup
//! write expects the revision the node read: two nodes accepting the same (source, id) at
//! once cannot both store it.

mod catalog;
mod jobs;
mod ops;
pub mod records;
pub use catalog::JetStreamCatalog;
mod store_impl;
mod view;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use futures::future::try_join_all;
use serde::{Deserialize, Serialize};

use self::records::{Expect, Records, RecordsConfig, RecordsError, Versioned, Write};
use super::redb_store::idempotency_key;
use super::{
    AcceptOutcome, AttemptEnd, AttemptResult, Disposition, DlqEntry, DlqReason, EntryId,
    EntryState, Fate, FinishError, Finished, KvOp, KvUsage, Lease, LeaseBatch, Leased,
    LeasedAtAccept, Millis, NewEntry, NewEvent, Outbox, PreviousCopy, QueueEntry, StoreError,
    StoredEvent, Unreadable,
};

/// How long a read from the view waits for the view to have this node's writes before it
/// asks the view to follow again with a new consumer (`JetStreamStore::caught_up`).
const VIEW_PATIENCE: std::time::Duration = std::time::Duration::from_secs(3);

/// How often the leases whose commit went unanswered are looked at again
/// (`settle_unanswered_leases`).
const UNANSWERED_LEASE_CHECK: std::time::Duration = std::time::Duration::from_millis(250);

/// First wait before a finish the store did not take (unreachable, unanswered) is tried
/// again; it doubles up to `FINISH_RETRY_MAX`, for as long as the lease lasts.
const FINISH_RETRY_START: std::time::Duration = std::time::Duration::from_millis(100);

/// Longest wait between two tries of a finish the store did not take.
const FINISH_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(1);

/// How many sequence numbers a node reserves from a counter at a time. Numbers of a block a
/// node does not use (it stops) are never used: sequences have gaps, never repeats.
const SEQ_BLOCK: u64 = 256;

/// How often an accept re-reads and retries after losing a race to another node before it
/// gives up with an error (each retry means another node changed one of its records).
const MAX_RETRIES: usize = 16;

impl From<RecordsError> for StoreError {
    /// Every transient failure of the server is an outage (`StoreError::is_outage`), so the
    /// callers that wait one out (a finish, for as long as its lease lasts) do: a read or
    /// commit that timed out or found no one to answer (`Server`), or a commit refused as
    /// busy for a whole request timeout, applied nothing and is `Unavailable`; a commit whose
    /// fate is unknown stays `Unanswered`. Taken as a backend failure, a finish that met a
    /// server stopping ("no responders") or not answering gave up at once, and its delivery,
    /// which had succeeded, was sent again once its lease expired.
    fn from(e: RecordsError) -> Self {
        match e {
            RecordsError::Unavailable(why) => StoreError::Unavailable(why),
            RecordsError::Unanswered(why) => StoreError::Unanswered(why),
            e @ (RecordsError::Server(_) | RecordsError::Busy(_)) => {
                StoreError::Unavailable(e.to_string())
            }
            e @ (RecordsError::Conflict
            | RecordsError::Unsupported(_)
            | RecordsError::TooLarge(_)
            | RecordsError::SameRecordTwice(_)
            | RecordsError::RecordTooLarge { .. }
            | RecordsError::Refused { .. }
            // Credentials or TLS the server refuses: the configuration, not an outage.
            | RecordsError::Connect(_)) => StoreError::Backend(e.to_string()),
        }
    }
}

/// An accepted event as stored: the event, and what its fate needs to find the rest.
#[derive(Debug, Serialize, Deserialize)]
struct EventRecord {
    stored: StoredEvent,
    /// Fan-out indexes used so far (`en.<seq>.0` ..; an index whose target was at its depth
    /// cap has no entry).
    entries: u32,
    /// DLQ entries made at acceptance (quarantine, depth caps).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    dlq: Vec<u64>,
}

/// The dedup key of (source, id): which event holds it, since when.
#[derive(Debug, Serialize, Deserialize)]
struct DedupRecord {
    seq: u64,
    accepted_at: Millis,
    /// Kept so a fingerprint is confirmed without reading the event.
    source: String,
    id: String,
    /// The event was quarantined (never routed): a copy that passes its contract is accepted
    /// in its place. A redrive that routes it clears this, as a copy sent after that is a
    /// duplicate like any other.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    quarantined: bool,
    /// Older quarantined copies of (source, id) whose place a later copy took, newest first
    /// (at most `MAX_PREVIOUS_COPIES`): the fate lists them, as only this record leads from
    /// (source, id) to its events.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    previous: Vec<u64>,
}

/// Most older copies a dedup record names: each is a quarantined copy its producer sent again,
/// so a handful at most in practice; the bound keeps a record small whatever a producer does.
const MAX_PREVIOUS_COPIES: usize = 16;

/// A queue entry as stored, with the DLQ entry it became (if it did).
#[derive(Debug, Serialize, Deserialize)]
struct EntryRecord {
    entry: QueueEntry,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dlq: Option<u64>,
    /// The node holding the entry's lease: at its next start it reclaims its own leases at
    /// once (its process died holding them) instead of waiting for them to expire.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    node: Option<String>,
    /// Where the entry stands among its ordering key's entries when that is not its
    /// `accepted_at`: the acceptance time it had before a redrive, which restarts `max_age`
    /// from the redrive but must not send the entry behind the entries that waited for it
    /// (redb orders a key by entry id, which a redrive does not change either).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    key_at: Option<Millis>,
}

/// An ordering key held after a dead letter (`hk.<fingerprint>`), until an operator
/// releases it.
#[derive(Debug, Serialize, Deserialize)]
struct HeldRecord {
    target: String,
    key: String,
    /// The DLQ id of the dead letter that holds the key (the latest to hold it): a redrive
    /// releases the key only with it, or once it has left the DLQ. None in records of older
    /// builds, which any redrive of the key releases.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    holder: Option<u64>,
}

/// Which entry of an ordering key is being delivered (`kl.<fingerprint>`): leases of the
/// key's entries compare-and-set it, so two nodes cannot deliver two entries of one key at
/// once even while their views lag.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct KeyLock {
    pub(super) entry: EntryId,
}

/// A sequence counter's record.
#[derive(Debug, Serialize, Deserialize)]
struct CounterRecord {
    /// The first number not yet handed out.
    next: u64,
}

/// Where the store lives.
#[derive(Debug, Clone)]
pub struct JetStreamOptions {
    /// The records' stream and server.
    pub records: RecordsConfig,
    /// This node's identity, stable across its restarts (the router keeps it in its data
    /// dir): leases it held when it died are reclaimed when it starts again.
    pub node: String,
}

/// The router's store on NATS JetStream (see the module docs).
pub struct JetStreamStore {
    records: Arc<Records>,
    /// Reserved, unused numbers per counter: (next, end).
    blocks: Mutex<HashMap<&'static str, (u64, u64)>>,
    /// Held by the one task that reserves a new block.
    refill: tokio::sync::Mutex<()>,
    /// This node's view of the live queue entries.
    view: Arc<view::View>,
    /// The task that keeps `view` up to date; stopped with the store.
    follower: tokio::task::JoinHandle<()>,
    /// The newest revision this node wrote of a record its view follows.
    written: Arc<std::sync::atomic::AtomicU64>,
    /// Leases whose commit was sent but never answered (`UnansweredLease`): the worker was
    /// told the lease failed, so if the server applied it after all, the entry is given back
    /// with that attempt not counted.
    unanswered: Unanswered,
    /// The task that settles `unanswered`; stopped with the store.
    settler: tokio::task::JoinHandle<()>,
    /// This node's identity (`JetStreamOptions::node`).
    node: String,
    /// The runtime the store was opened on: synchronous reads from plain threads run there.
    runtime: tokio::runtime::Handle,
    /// Record counts and when they were taken (`Store::record_counts`).
    counts: Mutex<Option<(std::time::Instant, super::RecordCounts)>>,
    /// The other nodes' announcements as this node saw them (`announce_node`): each node's
    /// last `at` and when, by this node's clock, it last changed.
    announced: Mutex<HashMap<String, (Millis, Millis)>>,
    /// Where the sweep's next pass over the event records goes on (a revision; 0: from the
    /// start). Events it keeps (still referred to) are passed over until the pass reaches
    /// the young records and starts again.
    sweep_from: std::sync::atomic::AtomicU64,
    /// Where the sweep's next pass over the COMPLETED records goes on (as `sweep_from`).
    completed_from: std::sync::atomic::AtomicU64,
    /// Where the sweep's next pass over the key-value records goes on (as `sweep_from`).
    kv_from: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for JetStreamStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStreamStore")
            .field("records", &self.records)
            .finish()
    }
}

impl Drop for JetStreamStore {
    fn drop(&mut self) {
        self.follower.abort();
        self.settler.abort();
    }
}

/// A lease whose commit the server may have applied without its answer reaching this node:
/// the entry record as this node wrote it, and the revision that write expected.
#[derive(Debug, Clone)]
struct UnansweredLease {
    key: String,
    expected: u64,
    written: bytes::Bytes,
    /// For an entry leased in an unanswered accept, which creates it: until when a record
    /// still absent may yet land (the client may hold the batch until it reconnects). Past
    /// it, the lease it would carry has expired and the entry is taken over as usual.
    absent_until: Option<std::time::Instant>,
}

/// The leases this node could not tell the outcome of, by entry.
type Unanswered = Arc<Mutex<HashMap<EntryId, UnansweredLease>>>;

/// Settles the leases of `unanswered` whenever the server can be reached: a lease the server
/// applied is given back (its attempt dropped, as a lease released unsent: the worker never
/// sent it), and one it has not is made impossible by writing its record again unchanged,
/// so that a copy still held by the client and sent once it reconnects finds its expected
/// revision gone. Without this the entry stayed leased to nobody for a whole lease period
/// and then counted an attempt that was never made ("interrupted").
async fn settle_unanswered_leases(
    records: Arc<Records>,
    unanswered: Unanswered,
    written: Arc<std::sync::atomic::AtomicU64>,
) {
    loop {
        tokio::time::sleep(UNANSWERED_LEASE_CHECK).await;
        let pending: Vec<(EntryId, UnansweredLease)> = unanswered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(id, l)| (*id, l.clone()))
            .collect();
        if pending.is_empty() || !records.connected() {
            continue;
        }
        for (id, lease) in pending {
            match settle_unanswered_lease(&records, &lease).await {
                Ok(Some(rev)) => {
                    written.fetch_max(rev, std::sync::atomic::Ordering::Relaxed);
                    unanswered
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&id);
                }
                Ok(None) => {
                    unanswered
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&id);
                }
                // Raced with another writer of the entry: the next round reads it again.
                Err(RecordsError::Conflict) => {}
                Err(e) => {
                    tracing::debug!(entry = %id, error = %e, "an unanswered lease could not be settled yet");
                    break;
                }
            }
        }
    }
}

/// One round of `settle_unanswered_leases` for `lease`: `Ok` once it is settled (with the
/// revision this node wrote, if it wrote one), `Err(Conflict)` to try again.
async fn settle_unanswered_lease(
    records: &Records,
    lease: &UnansweredLease,
) -> Result<Option<u64>, RecordsError> {
    let Some(read) = records.get_leader(&lease.key).await? else {
        return match lease.absent_until {
            Some(until) if std::time::Instant::now() < until => Err(RecordsError::Conflict),
            _ => Ok(None),
        };
    };
    let write = if read.value.as_ref() == Some(&lease.written) {
        // Applied: the lease is this node's, and the worker that asked for it is gone.
        let Some(mut record) = read
            .value
            .as_ref()
            .and_then(|b| serde_json::from_slice::<EntryRecord>(b).ok())
        else {
            // This node wrote it, so it decodes; if not, it is not this code's to repair.
            return Ok(None);
        };
        record.entry.lease = None;
        record.entry.attempts.pop();
        record.node = None;
        tracing::warn!(
            entry = %record.entry.id,
            target_id = %record.entry.target_id,
            "a lease whose commit went unanswered was applied after all; given back, its attempt (never sent) not counted"
        );
        Write::put(
            lease.key.clone(),
            enc(&record),
            Expect::Revision(read.revision),
        )
    } else if read.revision == lease.expected {
        // Not applied (yet): the same record again, so the lease can no longer be.
        Write {
            key: lease.key.clone(),
            value: read.value.clone(),
            expect: Expect::Revision(read.revision),
        }
    } else {
        // Changed by someone else: the lease's expectation can never hold again.
        return Ok(None);
    };
    let revs = records.commit(vec![write]).await?;
    Ok(revs.first().copied())
}

fn enc<T: Serialize>(v: &T) -> Vec<u8> {
    // The records are plain data (strings, numbers, maps with string keys): encoding cannot
    // fail, and a failure would be a bug in a record type, not bad input.
    serde_json::to_vec(v).unwrap_or_default()
}

fn dec<T: for<'de> Deserialize<'de>>(table: &'static str, bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt {
        table,
        message: e.to_string(),
    })
}

/// The record key of (source, id)'s dedup entry: a fingerprint, since subjects cannot hold
/// arbitrary text.
fn dedup_record_key(source: &str, id: &str) -> String {
    use sha2::{Digest, Sha256};
    let h = Sha256::digest(crate::event::dedup_key(source, id).as_bytes());
    format!("dd.{}", hex::encode(&h[..16]))
}

fn event_key(seq: u64) -> String {
    format!("ev.{seq}")
}

fn entry_key(id: EntryId) -> String {
    format!("en.{}.{}", id.event, id.idx)
}

fn dlq_key(id: u64) -> String {
    format!("dl.{id}")
}

/// The write that holds `key` of `target` for dead letter `dlq_id`, its holder.
fn hold_write(target: &str, key: &str, dlq_id: u64) -> Write {
    let record = HeldRecord {
        target: target.to_string(),
        key: key.to_string(),
        holder: Some(dlq_id),
    };
    Write::put(held_key(target, key), enc(&record), Expect::Any)
}

fn held_key(target: &str, key: &str) -> String {
    format!("hk.{}", ops::fp(&[target, key]))
}

fn lock_key(target: &str, key: &str) -> String {
    format!("kl.{}", ops::fp(&[target, key]))
}

/// Longest error text an attempt keeps once its entry's record had to be shortened to fit in
/// one record (`JetStreamStore::fit_records`).
const SHORT_ERROR_CHARS: usize = 256;

/// `text` cut to `max` characters, with an ellipsis when cut.
fn cut_text(text: &mut String, max: usize) {
    if let Some((at, _)) = text.char_indices().nth(max) {
        text.truncate(at);
        text.push('…');
    }
}

/// Shortens an entry (and its new DLQ entry) at `step` of `JetStreamStore::fit_records`:
/// 0 cuts every error text, 1 drops the attempts from before redrives, 2 every error text
/// but the last attempt's and the DLQ entry's copy of the attempts. The attempts themselves
/// stay: `max_attempts` counts them.
fn shorten(step: u8, entry: &mut QueueEntry, dlq: Option<&mut DlqEntry>) {
    let cut = |a: &mut super::AttemptRecord| {
        if let Some(e) = a.error.as_mut() {
            cut_text(e, SHORT_ERROR_CHARS);
        }
    };
    match step {
        0 => {
            entry.attempts.iter_mut().for_each(cut);
            entry.history.iter_mut().for_each(cut);
            if let Some(d) = dlq {
                d.attempts.iter_mut().for_each(cut);
                for e in &mut d.errors {
                    cut_text(&mut e.message, SHORT_ERROR_CHARS);
                }
            }
        }
        1 => {
            entry.history.clear();
            if let Some(d) = dlq {
                d.attempts.clone_from(&entry.attempts);
            }
        }
        _ => {
            let last = entry.attempts.len().saturating_sub(1);
            for (i, a) in entry.attempts.iter_mut().enumerate() {
                if i != last {
                    a.error = None;
                }
            }
            if let Some(d) = dlq {
                d.attempts.clear();
            }
        }
    }
}

/// One event's writes, prepared for a commit.
struct Prepared {
    /// Index in the caller's list.
    index: usize,
    seq: u64,
    writes: Vec<Write>,
    /// Entries leased at acceptance: (position of their write, the entry as written).
    leased: Vec<(usize, QueueEntry)>,
    /// The stored event, when some entry is leased at acceptance.
    event: Option<Arc<StoredEvent>>,
    /// Targets whose copy the depth cap sent to the DLQ.
    overflowed: Vec<String>,
}

impl JetStreamStore {
    /// Connects, prepares the records stream, and loads the view of the live queue entries
    /// (waiting for it while it reads, and giving up after a request timeout without progress).
    pub async fn open(options: JetStreamOptions) -> Result<Self, StoreError> {
        let records = Records::open(options.records).await?;
        let view = view::View::new();
        let follower = tokio::spawn(view::follow(
            view.clone(),
            records.stream(),
            records.prefix().to_string(),
        ));
        let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let unanswered = Unanswered::default();
        let settler = tokio::spawn(settle_unanswered_leases(
            records.clone(),
            unanswered.clone(),
            written.clone(),
        ));
        let store = Self {
            blocks: Mutex::new(HashMap::new()),
            refill: tokio::sync::Mutex::new(()),
            view,
            follower,
            written,
            unanswered,
            settler,
            runtime: tokio::runtime::Handle::current(),
            node: options.node,
            counts: Mutex::new(None),
            announced: Mutex::default(),
            sweep_from: std::sync::atomic::AtomicU64::new(0),
            completed_from: std::sync::atomic::AtomicU64::new(0),
            kv_from: std::sync::atomic::AtomicU64::new(0),
            records,
        };
        if !store.view.wait_loaded(store.records.timeout()).await {
            return Err(StoreError::Backend(format!(
                "the queue entries could not be read: nothing read for {:?}",
                store.records.timeout()
            )));
        }
        for (target, n) in store.reclaim_own_leases().await? {
            tracing::warn!(
                target_id = %target,
                entries = n,
                node = %store.node,
                "leases this node held when it stopped were reclaimed; their attempts count as interrupted"
            );
        }
        Ok(store)
    }

    /// Takes a number from this node's block of counter `name`, if one is left.
    fn take_number(&self, name: &'static str) -> Option<u64> {
        let mut blocks = self.blocks.lock().unwrap_or_else(|p| p.into_inner());
        let (next, end) = blocks.get_mut(name)?;
        (*next < *end).then(|| {
            *next += 1;
            *next - 1
        })
    }

    /// The next number of counter `name`, reserving a new block when this node's is used up.
    /// One task of the node reserves while the others wait for its block, so a node never
    /// races with itself; a race with another node costs a re-read.
    async fn next_number(&self, name: &'static str) -> Result<u64, StoreError> {
        if let Some(n) = self.take_number(name) {
            return Ok(n);
        }
        let _refill = self.refill.lock().await;
        if let Some(n) = self.take_number(name) {
            return Ok(n);
        }
        let key = format!("ctr.{name}");
        for attempt in 0..MAX_RETRIES {
            // After a lost race, from the leader: a lagging replica would lose it again.
            let read = self.records.get_from(&key, attempt > 0).await?;
            let start = match read.as_ref().and_then(|v| v.value.as_ref()) {
                Some(bytes) => dec::<CounterRecord>("counters", bytes)?.next,
                None => 1,
            };
            let end = start + SEQ_BLOCK;
            let write = Write::put(
                key.clone(),
                enc(&CounterRecord { next: end }),
                Expect::unchanged(read.as_ref()),
            );
            match self.commit(vec![write]).await {
                Ok(_) => {
                    self.blocks
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(name, (start + 1, end));
                    return Ok(start);
                }
                Err(RecordsError::Conflict) => {
                    // Another node reserved at the same moment: let it finish.
                    let ms = rand::random_range(1..=(2u64 << attempt.min(5)));
                    tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(StoreError::Backend(format!(
            "could not reserve numbers from counter {name}: other nodes kept changing it"
        )))
    }

    /// Stores events, each with its dedup key and its queue entries (or its DLQ entry when
    /// quarantined), each event atomically, and resolves once the server has them on disk.
    /// A (source, id) already held inside its dedup window, by this node or any other, is a
    /// `Duplicate` of the stored copy. A target at its depth cap (live entries, as this node's
    /// view counts them) gets a `target_overflow` DLQ entry instead of a queue entry.
    pub async fn accept(&self, events: Vec<NewEvent>) -> Result<Vec<AcceptOutcome>, StoreError> {
        Ok(self.accept_impl(events, false).await?.0)
    }

    /// `accept`, and the entries whose `lease_ms` is set are written leased to the caller
    /// with their first attempt started, in the same batch, and returned with their events.
    pub async fn accept_leased(
        &self,
        events: Vec<NewEvent>,
    ) -> Result<(Vec<AcceptOutcome>, Vec<LeasedAtAccept>), StoreError> {
        self.accept_impl(events, true).await
    }

    async fn accept_impl(
        &self,
        events: Vec<NewEvent>,
        leasing: bool,
    ) -> Result<(Vec<AcceptOutcome>, Vec<LeasedAtAccept>), StoreError> {
        for ne in &events {
            if let Some(t) = ne
                .targets
                .iter()
                .find(|t| t.lease_ms.is_some() && t.ordering_key.is_some())
            {
                // Delivery never hands off ordered targets' entries (it cannot know the key
                // is free); a lease here would skip the key's order.
                return Err(StoreError::Backend(format!(
                    "target {}: an entry with an ordering key cannot be leased at acceptance",
                    t.target_id
                )));
            }
        }
        let mut outcomes: Vec<Option<AcceptOutcome>> = vec![None; events.len()];
        let mut handed = Vec::new();
        for round in 0..MAX_RETRIES {
            let pending: Vec<usize> = (0..events.len())
                .filter(|&i| outcomes[i].is_none())
                .collect();
            if pending.is_empty() {
                break;
            }
            // After a lost race, from the leader: a lagging replica would lose it again.
            let leader = round > 0;
            let reads = try_join_all(pending.iter().map(|&i| {
                let ev = &events[i].event;
                let key = dedup_record_key(&ev.source, &ev.id);
                async move { self.records.get_from(&key, leader).await }
            }))
            .await?;
            // Events of this call that repeat an earlier one of it are duplicates of that one
            // once it is stored.
            let mut first_of: HashMap<String, usize> = HashMap::new();
            let mut prepared = Vec::new();
            let mut depth: HashMap<String, u64> = HashMap::new();
            for (&i, read) in pending.iter().zip(reads) {
                let ne = &events[i];
                let key = dedup_record_key(&ne.event.source, &ne.event.id);
                if let Some(dup) = self.live_duplicate(ne, read.as_ref())? {
                    outcomes[i] = Some(AcceptOutcome::Duplicate { seq: dup });
                    continue;
                }
                if first_of.contains_key(&key) {
                    continue;
                }
                first_of.insert(key.clone(), i);
                let p = self
                    .prepare(i, ne, key, read.as_ref(), leasing, &mut depth)
                    .await?;
                prepared.push(p);
            }
            // Every event is checked before anything is committed: one too large for the
            // server is refused on its own (413 at ingest), where its commit failed and
            // failed the transactions grouped with it.
            for p in &prepared {
                // An event and its fan-out are one atomic batch: past the server's limit it
                // could never commit, and a 503 had its producer retry it for ever (an event
                // matching more than about 997 targets).
                if p.writes.len() > records::MAX_BATCH {
                    return Err(StoreError::FanOutTooLarge {
                        index: p.index,
                        writes: p.writes.len(),
                        max: records::MAX_BATCH,
                    });
                }
                if let Some((_, bytes)) = self.records.oversized(&p.writes) {
                    return Err(StoreError::EventTooLarge {
                        index: p.index,
                        bytes,
                        max: self.records.record_limit(),
                    });
                }
            }
            for chunk in chunks(prepared) {
                let writes: Vec<Write> = chunk.iter().flat_map(|p| p.writes.clone()).collect();
                match self.commit(writes).await {
                    Ok(revs) => {
                        let mut offset = 0;
                        for p in chunk {
                            outcomes[p.index] = Some(AcceptOutcome::Accepted {
                                seq: p.seq,
                                overflowed: p.overflowed.clone(),
                            });
                            for (pos, mut entry) in p.leased {
                                let token = revs[offset + pos];
                                let lease = entry.lease.map(|l| Lease { token, ..l });
                                entry.lease = lease;
                                if let (Some(lease), Some(event)) = (lease, p.event.clone()) {
                                    handed.push(LeasedAtAccept {
                                        event: p.index,
                                        leased: Leased {
                                            entry,
                                            event,
                                            lease,
                                        },
                                    });
                                }
                            }
                            offset += p.writes.len();
                        }
                    }
                    // Another node changed one of the dedup keys: read again.
                    Err(RecordsError::Conflict) => {}
                    Err(e @ RecordsError::Unanswered(_)) => {
                        // The caller is told it failed, and its leases are never finished;
                        // if the batch lands after all, they are given back.
                        self.remember_unanswered_accept(&chunk);
                        return Err(e.into());
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            // Repeats inside this call: duplicates of the copy just stored.
            for (i, ne) in events.iter().enumerate() {
                if outcomes[i].is_none() {
                    let key = dedup_record_key(&ne.event.source, &ne.event.id);
                    // (A passing copy of a quarantined one waits for the next round, which
                    // accepts it in its place.)
                    if let Some(&first) = first_of.get(&key)
                        && first != i
                        && (ne.quarantine.is_some() || events[first].quarantine.is_none())
                        && let Some(AcceptOutcome::Accepted { seq, .. }) = outcomes[first]
                    {
                        outcomes[i] = Some(AcceptOutcome::Duplicate { seq });
                    }
                }
            }
        }
        let outcomes = outcomes
            .into_iter()
            .map(|o| {
                o.ok_or_else(|| {
                    StoreError::Backend(
                        "accept kept losing races with other nodes; nothing of the rest stored"
                            .into(),
                    )
                })
            })
            .collect::<Result<_, _>>()?;
        Ok((outcomes, handed))
    }

    /// Remembers the entries an unanswered accept of `chunk` wrote leased, for
    /// `settle_unanswered_leases`: applied later (the client held the batch while it
    /// reconnected), each stayed leased to a worker that was told the accept failed, for a
    /// whole lease period, and its take-over counted the attempt never made as interrupted.
    fn remember_unanswered_accept(&self, chunk: &[Prepared]) {
        let mut unanswered = self.unanswered.lock().unwrap_or_else(|p| p.into_inner());
        for p in chunk {
            for (pos, entry) in &p.leased {
                let (Some(write), Some(lease)) = (p.writes.get(*pos), entry.lease) else {
                    continue;
                };
                let Some(written) = write.value.clone() else {
                    continue;
                };
                let lasts = u64::try_from(lease.until.saturating_sub(entry.accepted_at))
                    .unwrap_or_default();
                unanswered.insert(
                    entry.id,
                    UnansweredLease {
                        key: write.key.clone(),
                        expected: 0,
                        written,
                        absent_until: Some(
                            std::time::Instant::now() + std::time::Duration::from_millis(lasts),
                        ),
                    },
                );
            }
        }
    }

    /// The stored copy's sequence when `read` is a live dedup key of `ne`'s (source, id).
    fn live_duplicate(
        &self,
        ne: &NewEvent,
        read: Option<&Versioned>,
    ) -> Result<Option<u64>, StoreError> {
        let Some(bytes) = read.and_then(|v| v.value.as_ref()) else {
            return Ok(None);
        };
        let d: DedupRecord = dec("dedup", bytes)?;
        if d.source != ne.event.source || d.id != ne.event.id {
            return Err(StoreError::Backend(format!(
                "dedup fingerprint collision between ({}, {}) and ({}, {})",
                d.source, d.id, ne.event.source, ne.event.id
            )));
        }
        // A fixed copy of a quarantined event is accepted in its place, as on redb.
        if d.quarantined && ne.quarantine.is_none() {
            return Ok(None);
        }
        // Inside the window up to its last millisecond, as on redb (`key_at >= accepted_at - window`).
        Ok((ne.accepted_at <= d.accepted_at.saturating_add(ne.dedup_window_ms)).then_some(d.seq))
    }

    /// `ne`'s writes: the event, its dedup key (expecting it where `read` found it), and its
    /// entries or its DLQ entries (quarantined; targets at their depth cap). With `leasing`,
    /// entries with `lease_ms` are written leased. `depth` counts the entries this call adds
    /// per capped target.
    async fn prepare(
        &self,
        index: usize,
        ne: &NewEvent,
        dedup_key: String,
        read: Option<&Versioned>,
        leasing: bool,
        depth: &mut HashMap<String, u64>,
    ) -> Result<Prepared, StoreError> {
        let seq = self.next_number("events").await?;
        let ev = &ne.event;
        let at = ne.accepted_at;
        let mut writes = Vec::with_capacity(ne.targets.len() + 3);
        let mut dlq = Vec::new();
        let mut leased = Vec::new();
        let names = || (ev.id.clone(), ev.source.clone(), ev.ty.clone());
        let blank = |reason, errors, target: Option<&NewEntry>| {
            DlqEntry::at_acceptance(seq, names(), target, reason, errors, at)
        };
        let mut entries = 0;
        let mut overflowed = Vec::new();
        if let Some(q) = &ne.quarantine {
            let id = self.next_number("dlq").await?;
            let d = DlqEntry {
                id,
                emitted_by: q.emitted_by.clone(),
                ..blank(q.reason, q.errors.clone(), None)
            };
            writes.push(Write::put(dlq_key(id), enc(&d), Expect::Revision(0)));
            dlq.push(id);
        } else {
            entries = u32::try_from(ne.targets.len()).unwrap_or(u32::MAX);
            for (i, t) in ne.targets.iter().enumerate() {
                if let Some(cap) = t.max_depth {
                    let added = depth.entry(t.target_id.clone()).or_default();
                    if self.view.depth(&t.target_id) + *added >= cap {
                        let id = self.next_number("dlq").await?;
                        let d = DlqEntry {
                            id,
                            ..blank(DlqReason::TargetOverflow, Vec::new(), Some(t))
                        };
                        writes.push(Write::put(dlq_key(id), enc(&d), Expect::Revision(0)));
                        writes.extend(Self::overflow_hold(t, id));
                        dlq.push(id);
                        overflowed.push(t.target_id.clone());
                        continue;
                    }
                    *added += 1;
                }
                let id = EntryId {
                    event: seq,
                    idx: u32::try_from(i).unwrap_or(u32::MAX),
                };
                let mut entry = QueueEntry::queued(
                    id,
                    t.clone(),
                    idempotency_key(&ev.source, &ev.id, &t.target_id),
                    at,
                    at,
                    ev.hops(),
                );
                let lease = t.lease_ms.filter(|_| leasing).map(|ms| Lease {
                    token: 0,
                    until: at.saturating_add(ms),
                });
                if let Some(lease) = lease {
                    entry.start_attempt(lease, at);
                    leased.push((writes.len(), entry.clone()));
                }
                let node = lease.map(|_| self.node.clone());
                let record = EntryRecord {
                    entry,
                    dlq: None,
                    node,
                    key_at: None,
                };
                writes.push(Write::put(entry_key(id), enc(&record), Expect::Revision(0)));
            }
        }
        let stored = StoredEvent {
            seq,
            event: ev.clone(),
            accepted_at: at,
            ruleset_version: ne.ruleset_version.clone(),
            matched_rules: ne.matched_rules.clone(),
            quarantined: ne.quarantine.is_some(),
        };
        let record = EventRecord {
            stored,
            entries,
            dlq,
        };
        writes.push(Write::put(
            event_key(seq),
            enc(&record),
            Expect::Revision(0),
        ));
        // The record this copy replaces (a quarantined copy, or one past the dedup window)
        // hands on the older copies it names, and its own when it was quarantined.
        let mut previous = Vec::new();
        if let Some(bytes) = read.and_then(|v| v.value.as_ref()) {
            let old: DedupRecord = dec("dedup", bytes)?;
            if old.source == ev.source && old.id == ev.id {
                if old.quarantined {
                    previous.push(old.seq);
                }
                previous.extend(old.previous);
                previous.truncate(MAX_PREVIOUS_COPIES);
            }
        }
        let dedup = DedupRecord {
            seq,
            accepted_at: at,
            source: ev.source.clone(),
            id: ev.id.clone(),
            quarantined: ne.quarantine.is_some(),
            previous,
        };
        writes.push(Write::put(dedup_key, enc(&dedup), Expect::unchanged(read)));
        let event = (!leased.is_empty()).then(|| Arc::new(record.stored));
        Ok(Prepared {
            index,
            seq,
            writes,
            leased,
            event,
            overflowed,
        })
    }

    /// Returns the entries this node held leased when it stopped to their queues, their
    /// attempt recorded as interrupted (the embedded store's reclaim at start).
    async fn reclaim_own_leases(
        &self,
    ) -> Result<std::collections::BTreeMap<String, u64>, StoreError> {
        let now = chrono::Utc::now().timestamp_millis();
        let mut n: std::collections::BTreeMap<String, u64> = Default::default();
        for live in self.view.leased_by(&self.node) {
            let mut e = live.entry;
            let target = e.target_id.clone();
            e.lease = None;
            if let Some(a) = e.attempts.last_mut().filter(|a| a.result.is_none()) {
                a.finished_at = Some(now);
                a.result = Some(AttemptResult::Interrupted);
                a.error =
                    Some("the router stopped during this attempt; lease reclaimed at start".into());
            }
            let mut record = EntryRecord {
                entry: e,
                dlq: None,
                node: None,
                key_at: live.key_at,
            };
            let write = Write::put(
                entry_key(record.entry.id),
                self.fit_records(&mut record, None)?.0,
                Expect::Revision(live.revision),
            );
            match self.commit(vec![write]).await {
                Ok(_) => *n.entry(target).or_default() += 1,
                // Taken over by another node meanwhile (its lease had expired).
                Err(RecordsError::Conflict) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(n)
    }

    /// Waits until this node's view has every write this node made: what reads answered from
    /// the view (leases, DLQ listings) wait for, so a node always sees its own writes.
    async fn caught_up(&self) -> Result<(), StoreError> {
        // The view cannot follow a server it is not connected to: waiting for it would only
        // turn the outage into a slow failure.
        if !self.records.connected() {
            return Err(StoreError::Unavailable(
                "the queue view cannot follow the store: not connected".into(),
            ));
        }
        let written = self.written.load(std::sync::atomic::Ordering::Relaxed);
        // A view still behind after a few seconds is more likely following a consumer that
        // went silent (its server died) than slow: it follows again with a new one.
        let first = self.records.timeout().min(VIEW_PATIENCE);
        if self.view.wait_applied(written, first).await {
            return Ok(());
        }
        self.view.resubscribe();
        if self
            .view
            .wait_applied(written, self.records.timeout())
            .await
        {
            Ok(())
        } else {
            Err(StoreError::Backend(format!(
                "the queue view did not catch up with this node's writes within {:?}",
                self.records.timeout()
            )))
        }
    }

    /// Leases up to `max` entries of `target` that may be leased at `now`, recording the start
    /// of an attempt on each before returning it. An entry whose lease expired (its worker or
    /// its node is gone) is taken over, its attempt recorded as interrupted. The lease's token
    /// is the entry record's new revision: only a finish that still finds that revision
    /// applies (fencing). Entries another node leases first are skipped.
    pub async fn lease(
        &self,
        target: &str,
        now: Millis,
        max: usize,
        lease_ms: i64,
    ) -> Result<Vec<Leased>, StoreError> {
        Ok(self.lease_batch(target, now, max, lease_ms).await?.leased)
    }

    /// See [`Store::lease_batch`]. An event whose record does not decode comes back as
    /// unreadable, for the worker to set aside; one that could not be read now (the server
    /// out of reach) is given back to its queue as before.
    pub async fn lease_batch(
        &self,
        target: &str,
        now: Millis,
        max: usize,
        lease_ms: i64,
    ) -> Result<LeaseBatch, StoreError> {
        self.caught_up().await?;
        let candidates = self.view.candidates(target, now, max);
        let attempts = futures::future::join_all(candidates.into_iter().map(|live| async move {
            let id = live.entry.id;
            let r = self
                .lease_one(live.revision, live.entry, live.key_at, now, lease_ms)
                .await;
            // Won: the claim ends when the view has the lease. Lost or failed: now.
            if !matches!(r, Ok(Some(_))) {
                self.view.unclaim(id);
            }
            r
        }))
        .await;
        // The leases won are delivered even when others failed: returning only the error
        // left them leased to nobody until they expired, each then taken over with an
        // interrupted attempt that counted against its `max_attempts`.
        let mut won: Vec<(QueueEntry, Lease)> = Vec::new();
        let mut failed = None;
        for r in attempts {
            match r {
                Ok(Some(w)) => won.push(w),
                Ok(None) => {}
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failed {
            if won.is_empty() {
                return Err(e);
            }
            tracing::warn!(target_id = target, error = %e, won = won.len(), "some leases failed; delivering the ones won");
        }
        // The events, each read once and all at once (one after another they were a third of
        // a lease's time: a round trip each).
        let mut seqs: Vec<u64> = won.iter().map(|(e, _)| e.id.event).collect();
        seqs.sort_unstable();
        seqs.dedup();
        let reads = futures::future::join_all(
            seqs.into_iter()
                .map(|seq| async move { (seq, self.event_record(seq).await) }),
        )
        .await;
        let mut events: HashMap<u64, Arc<StoredEvent>> = HashMap::new();
        // Records that do not decode: given back, they were leased again at once, for ever
        // (first in their queue by due time), and a lease of one slot failed every time.
        let mut corrupt: HashMap<u64, String> = HashMap::new();
        let mut unread = None;
        for (seq, r) in reads {
            match r {
                Ok(Some(e)) => {
                    events.insert(seq, Arc::new(e.stored));
                }
                Err(e @ StoreError::Corrupt { .. }) => {
                    corrupt.insert(seq, e.to_string());
                }
                Ok(None) => {
                    unread.get_or_insert(StoreError::Corrupt {
                        table: "entries",
                        message: format!("an entry of event {seq} refers to a missing event"),
                    });
                }
                Err(e) => {
                    unread.get_or_insert(e);
                }
            }
        }
        let mut out = Vec::with_capacity(won.len());
        let mut unreadable = Vec::new();
        let mut release = Vec::new();
        for (entry, lease) in won {
            match (events.get(&entry.id.event), corrupt.get(&entry.id.event)) {
                (Some(event), _) => out.push(Leased {
                    entry,
                    event: event.clone(),
                    lease,
                }),
                (None, Some(error)) => unreadable.push(Unreadable {
                    entry,
                    lease,
                    error: error.clone(),
                }),
                (None, None) => release.push((entry.id, lease)),
            }
        }
        if let Some(e) = unread {
            // Those leased without their event go back at once, their attempt not counted
            // (best effort: one that cannot be released expires).
            for (id, lease) in release {
                let end = AttemptEnd {
                    finished_at: now,
                    result: AttemptResult::Interrupted,
                    status: None,
                    error: Some(format!("its event could not be read: {e}")),
                    outbox: None,
                };
                let put_back = Disposition::Release { due_at: now };
                if let Err(err) = self.finish(id, lease, end, put_back, now).await {
                    tracing::warn!(target_id = target, entry = %id, error = %err, "a lease without its event could not be released; it expires");
                }
            }
            if out.is_empty() && unreadable.is_empty() {
                return Err(e);
            }
            tracing::warn!(target_id = target, error = %e, "some leased entries' events could not be read; released");
        }
        Ok(LeaseBatch {
            leased: out,
            unreadable,
        })
    }

    /// Leases one entry seen at `revision`; `None` when another worker changed it first.
    async fn lease_one(
        &self,
        revision: u64,
        mut entry: QueueEntry,
        key_at: Option<Millis>,
        now: Millis,
        lease_ms: i64,
    ) -> Result<Option<(QueueEntry, Lease)>, StoreError> {
        if let Some(old) = entry.lease.take()
            && let Some(a) = entry.attempts.last_mut().filter(|a| a.result.is_none())
        {
            a.finished_at = Some(old.until.min(now));
            a.result = Some(AttemptResult::Interrupted);
            a.error = Some("the lease expired during this attempt; taken over".into());
        }
        let until = now.saturating_add(lease_ms);
        // The record carries the expiry; the token is its revision, known once written.
        entry.start_attempt(Lease { token: 0, until }, now);
        // A target whose live policy has no ordering delivers its keyed entries (accepted
        // under an earlier policy) without the key's lock, as if they had no key.
        if let Some(key) = entry
            .ordering_key
            .as_ref()
            .filter(|_| self.view.ordered(&entry.target_id))
        {
            // The key's lock first, as a write of its own (an atomic batch costs the server
            // ~5 ms, a single write ~0.5; only a lock taken from a waiting holder is a batch):
            // if the entry's lease then loses its race, the lock names an entry that is first
            // of its key anyway, whoever delivers it.
            let order = (key_at.unwrap_or(entry.accepted_at), entry.id);
            let Some(lock) = self.key_lock_for(&entry.target_id, key, order).await? else {
                return Ok(None);
            };
            match self.commit(lock).await {
                Ok(_) => {}
                Err(RecordsError::Conflict) => return Ok(None),
                Err(e) => return Err(e.into()),
            }
        }
        let mut record = EntryRecord {
            entry,
            dlq: None,
            node: Some(self.node.clone()),
            key_at,
        };
        // The attempt started here (and a taken-over one's error) may take a record that
        // had just fit over the server's limit.
        let bytes = bytes::Bytes::from(self.fit_records(&mut record, None)?.0);
        let key = entry_key(record.entry.id);
        let write = Write::put(key.clone(), bytes.clone(), Expect::Revision(revision));
        match self.commit(vec![write]).await {
            Ok(revs) => {
                let lease = Lease {
                    token: revs[0],
                    until,
                };
                let mut entry = record.entry;
                entry.lease = Some(lease);
                Ok(Some((entry, lease)))
            }
            Err(RecordsError::Conflict) => Ok(None),
            Err(e @ RecordsError::Unanswered(_)) => {
                // The caller is told it failed; if it was applied, it is given back.
                self.unanswered
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(
                        record.entry.id,
                        UnansweredLease {
                            key,
                            expected: revision,
                            written: bytes,
                            absent_until: None,
                        },
                    );
                Err(e.into())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The write that gives ordering key `key` of `target` to the entry whose place in the
    /// key is `order` (`(key_at or accepted_at, id)`), or `None` when another entry of the key
    /// has it: one leased (in flight, or its node gone and not yet taken over), or one waiting
    /// for its retry that comes before it. A waiting holder that comes after it (a redriven
    /// dead letter goes back to its place at the head of its key) gives the lock up: refusing
    /// it left the key's first entry, which views propose, locked out for good.
    async fn key_lock_for(
        &self,
        target: &str,
        key: &str,
        order: (Millis, EntryId),
    ) -> Result<Option<Vec<Write>>, StoreError> {
        // A refusal read from a replica is read again from the leader: a replica that had
        // not applied the holder's finish yet showed it still in flight, and the key's next
        // entry waited for the next lease round. (A lock given on a stale read costs nothing:
        // its compare-and-set fails.)
        match self.key_lock_from(target, key, order, false).await? {
            Some(writes) => Ok(Some(writes)),
            None => self.key_lock_from(target, key, order, true).await,
        }
    }

    /// `key_lock_for`, reading from the leader or the fast way (`Records::get_from`).
    async fn key_lock_from(
        &self,
        target: &str,
        key: &str,
        order: (Millis, EntryId),
        leader: bool,
    ) -> Result<Option<Vec<Write>>, StoreError> {
        let id = order.1;
        let lock = lock_key(target, key);
        let read = self.records.get_from(&lock, leader).await?;
        let mut writes = Vec::with_capacity(2);
        if let Some(bytes) = read.as_ref().and_then(|v| v.value.as_ref()) {
            let holder: KeyLock = dec("key locks", bytes)?;
            if holder.entry != id
                && let Some(Versioned {
                    value: Some(b),
                    revision,
                }) = self
                    .records
                    .get_from(&entry_key(holder.entry), leader)
                    .await?
            {
                let r = dec::<EntryRecord>("entries", &b)?;
                if r.entry.state == EntryState::Queued {
                    let holder_order = (r.key_at.unwrap_or(r.entry.accepted_at), holder.entry);
                    if r.entry.lease.is_some() || holder_order < order {
                        return Ok(None);
                    }
                    // Taken from a waiting holder: its record is written again, unchanged,
                    // in the same batch, so a lease of it racing this one (its node's view
                    // did not have this entry yet) fails on its revision instead of both
                    // going out.
                    writes.push(Write::put(
                        entry_key(holder.entry),
                        b.to_vec(),
                        Expect::Revision(revision),
                    ));
                }
            }
        }
        writes.insert(
            0,
            Write::put(
                lock,
                enc(&KeyLock { entry: id }),
                Expect::unchanged(read.as_ref()),
            ),
        );
        Ok(Some(writes))
    }

    /// With `hold`, the write that holds `e`'s ordering key until an operator releases it (a
    /// dead letter under `on_dead_letter: hold`). The key's lock record is left as it is: it
    /// names an entry that is no longer queued, which the next lease of the key takes over.
    fn key_hold(e: &QueueEntry, hold: bool, dlq_id: u64) -> Option<Write> {
        let key = e.ordering_key.as_ref().filter(|_| hold)?;
        Some(hold_write(&e.target_id, key, dlq_id))
    }

    /// Under `on_dead_letter: hold`, the write that holds the ordering key of `t`, a copy the
    /// depth cap refused (`target_overflow`): a dead letter like any other, which later events
    /// of the key must not overtake (as on redb).
    pub(super) fn overflow_hold(t: &NewEntry, dlq_id: u64) -> Option<Write> {
        let key = t.ordering_key.as_ref().filter(|_| t.hold_key)?;
        Some(hold_write(&t.target_id, key, dlq_id))
    }

    /// The write that releases `key` of `target` for a redrive of dead letter `dlq_id`, if
    /// the key is held and the dead letter may release it: it is the key's holder, or the
    /// holder has left the DLQ, or the hold predates holders. Redriving another dead letter
    /// of a held key leaves the hold, so the key's later entries still wait for its holder.
    /// `released` keeps a step from releasing one key twice (the second delete's expected
    /// revision would fail the whole batch).
    pub(super) async fn redrive_release(
        &self,
        target: &str,
        key: &str,
        dlq_id: u64,
        released: &mut HashSet<String>,
    ) -> Result<Option<Write>, StoreError> {
        let hk = held_key(target, key);
        if released.contains(&hk) {
            return Ok(None);
        }
        let Some(read) = self.records.get(&hk).await? else {
            return Ok(None);
        };
        let Some(bytes) = read.value.as_ref() else {
            return Ok(None);
        };
        let holder = serde_json::from_slice::<HeldRecord>(bytes)
            .ok()
            .and_then(|h| h.holder);
        if let Some(h) = holder
            && h != dlq_id
            && self
                .records
                .get_at_least(&dlq_key(h), 1)
                .await?
                .is_some_and(|v| v.value.is_some())
        {
            return Ok(None);
        }
        released.insert(hk.clone());
        Ok(Some(Write::delete(hk, Expect::Revision(read.revision))))
    }

    /// Releases an ordering key held after a dead letter; `false` if it was not held.
    pub async fn release_key(&self, target: &str, key: &str) -> Result<bool, StoreError> {
        let k = held_key(target, key);
        for _ in 0..MAX_RETRIES {
            // From the leader: a replica that had not applied the hold yet answered "not
            // held" to the operator, and the key stayed held.
            let Some(read) = self.records.get_leader(&k).await? else {
                return Ok(false);
            };
            if read.value.is_none() {
                return Ok(false);
            }
            match self
                .commit(vec![Write::delete(
                    k.clone(),
                    Expect::Revision(read.revision),
                )])
                .await
            {
                Ok(_) => {
                    // The operator reads the key's state next (`/v1/targets/{id}`
                    // `held_keys`, from this node's view): it must not still say "held".
                    if let Err(e) = self.caught_up().await {
                        tracing::warn!(target, key, error = %e, "ordering key released; this node's view has not caught up yet");
                    }
                    return Ok(true);
                }
                Err(RecordsError::Conflict) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(StoreError::Backend(format!(
            "could not release key {key:?} of {target}: it kept changing"
        )))
    }

    /// Ordering keys of `target` held after a dead letter (as this node's view has them).
    pub fn held_keys(&self, target: &str) -> Vec<String> {
        self.view.held_keys(target)
    }

    /// Per-target queue numbers (as this node's view has them).
    pub fn queue_stats(
        &self,
        now: Millis,
    ) -> std::collections::BTreeMap<String, super::QueueStats> {
        self.view.stats(now)
    }

    /// Moves every waiting (not leased) entry of `target` to the DLQ with `reason`, without
    /// an attempt. Returns how many. An entry leased meanwhile (by any node) stays.
    pub async fn dead_letter_queued(
        &self,
        target: &str,
        reason: DlqReason,
        message: &str,
        now: Millis,
    ) -> Result<usize, StoreError> {
        self.dead_letter_waiting(self.view.waiting(target, now), reason, message, now)
            .await
    }

    /// Moves the waiting entries of `target` with ordering key `key` accepted before
    /// `accepted_before` (past their max_age) to the DLQ as `max_age_exceeded`, without an
    /// attempt and without holding the key. Returns how many.
    pub async fn dead_letter_expired_of_key(
        &self,
        target: &str,
        key: &str,
        accepted_before: Millis,
        message: &str,
        now: Millis,
    ) -> Result<usize, StoreError> {
        let expired = self
            .view
            .waiting_of_key(target, key, now)
            .into_iter()
            .filter(|l| l.entry.accepted_at < accepted_before)
            .collect();
        self.dead_letter_waiting(expired, DlqReason::MaxAgeExceeded, message, now)
            .await
    }

    /// Moves `waiting` (as the view had them) to the DLQ with `reason`, without an attempt;
    /// one leased or finished by any node meanwhile stays theirs.
    async fn dead_letter_waiting(
        &self,
        waiting: Vec<view::Live>,
        reason: DlqReason,
        message: &str,
        now: Millis,
    ) -> Result<usize, StoreError> {
        let mut n = 0;
        let mut names: HashMap<u64, (String, String, String)> = HashMap::new();
        for live in waiting {
            let mut e = live.entry;
            let names = match names.get(&e.id.event) {
                Some(n) => n.clone(),
                None => {
                    let v = self.dlq_names(e.id.event).await?;
                    names.insert(e.id.event, v.clone());
                    v
                }
            };
            let end = AttemptEnd {
                finished_at: now,
                result: AttemptResult::Permanent,
                status: None,
                error: Some(message.to_string()),
                outbox: None,
            };
            let dlq_id = self.next_number("dlq").await?;
            let mut d = DlqEntry {
                id: dlq_id,
                first_failure_at: now,
                ..DlqEntry::of_given_up(&e, names, reason, &end, now)
            };
            let mut writes = Vec::with_capacity(2);
            e.lease = None;
            e.state = EntryState::Dead;
            e.finished_at = Some(now);
            let mut record = EntryRecord {
                entry: e,
                dlq: Some(dlq_id),
                node: None,
                key_at: live.key_at,
            };
            let (entry_bytes, dlq_bytes) = self.fit_records(&mut record, Some(&mut d))?;
            writes.push(Write::put(
                entry_key(record.entry.id),
                entry_bytes,
                Expect::Revision(live.revision),
            ));
            writes.push(Write::put(
                dlq_key(dlq_id),
                dlq_bytes.unwrap_or_else(|| enc(&d)),
                Expect::Revision(0),
            ));
            match self.commit(writes).await {
                Ok(_) => n += 1,
                // Leased or finished by someone meanwhile: it is theirs.
                Err(RecordsError::Conflict) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(n)
    }

    /// The encoded entry record and DLQ entry, shortened until each fits in one record of the
    /// server's (`shorten`, step by step; the DLQ entry then says so in its errors). An entry
    /// retried and redriven many times with long errors could outgrow the server's message
    /// size, and then every finish of it was refused and it went back to its queue each
    /// time. The number of attempts, which `max_attempts` counts, is never cut.
    fn fit_records(
        &self,
        record: &mut EntryRecord,
        mut dlq: Option<&mut DlqEntry>,
    ) -> Result<(Vec<u8>, Option<Vec<u8>>), StoreError> {
        let fits = |r: &[u8], d: Option<&[u8]>| {
            self.records.fits(r.len()) && d.is_none_or(|d| self.records.fits(d.len()))
        };
        let (r, d) = (enc(record), dlq.as_deref().map(enc));
        if fits(&r, d.as_deref()) {
            return Ok((r, d));
        }
        let size = r.len().max(d.as_ref().map_or(0, Vec::len));
        let limit = self.records.record_limit();
        if let Some(d) = dlq.as_deref_mut() {
            d.errors.push(crate::event::FieldError::new(
                "",
                format!(
                    "the attempts' history was shortened: with it this record took {size} \
                     bytes, over the {limit} the NATS server takes in one record"
                ),
            ));
        }
        for step in 0..3 {
            shorten(step, &mut record.entry, dlq.as_deref_mut());
            let (r, d) = (enc(record), dlq.as_deref().map(enc));
            if fits(&r, d.as_deref()) {
                tracing::warn!(
                    entry = %record.entry.id,
                    target_id = %record.entry.target_id,
                    bytes = size,
                    limit,
                    "an entry's attempt history was shortened to fit in one record"
                );
                return Ok((r, d));
            }
        }
        Err(StoreError::Backend(format!(
            "entry {} of {} does not fit in a record of {limit} bytes even without its \
             attempts' errors",
            record.entry.id, record.entry.target_id
        )))
    }

    /// Records the end of an attempt and moves the entry on (delivered, retry, DLQ), in one
    /// transaction, if the lease is still held: the entry record must still be at the
    /// lease's revision and the lease not expired, or the result is refused as `Fenced`.
    pub async fn finish(
        &self,
        id: EntryId,
        lease: Lease,
        end: AttemptEnd,
        disposition: Disposition,
        now: Millis,
    ) -> Result<Finished, FinishError> {
        // A conflict is either the lease taken over (fenced) or a key-value record of the
        // outbox changed by another delivery: the second is read again and retried, from
        // the stream's leader (a lagging replica would lose the same race again).
        //
        // A store out of reach, or a commit left unanswered, is tried again for as long as
        // the lease lasts (on this process's clock, from `now`): the attempt has happened, and
        // given up on, it counted as interrupted and was made again once the lease expired.
        // Trying again is safe under the lease's fencing token: the entry must still be at
        // that revision, so at most one of the tries is applied, and a try whose answer was
        // lost is recognised by the entry it wrote (`sent`).
        let lease_left = u64::try_from(lease.until.saturating_sub(now)).unwrap_or(0);
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(lease_left);
        let mut sent = Vec::new();
        let mut contended = 0;
        let mut wait = FINISH_RETRY_START;
        let mut fresh = false;
        loop {
            match self
                .finish_once(id, lease, &end, &disposition, now, fresh, &mut sent)
                .await
            {
                Err(FinishError::Contended) if contended + 1 < MAX_RETRIES => contended += 1,
                Err(FinishError::Store(e))
                    if e.is_outage() && tokio::time::Instant::now() + wait < deadline =>
                {
                    tracing::debug!(entry = %id, error = %e, "finish not recorded yet; trying again");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(FINISH_RETRY_MAX);
                }
                other => return other,
            }
            fresh = true;
        }
    }

    /// One try of `finish`; with `fresh`, every record is read from the stream's leader.
    /// `sent` holds the entry records (and what each try answers) of earlier tries whose
    /// commit went unanswered: finding one of them stored means that try was applied.
    #[allow(clippy::too_many_arguments)]
    async fn finish_once(
        &self,
        id: EntryId,
        lease: Lease,
        end: &AttemptEnd,
        disposition: &Disposition,
        now: Millis,
        fresh: bool,
        sent: &mut Vec<(bytes::Bytes, Finished)>,
    ) -> Result<Finished, FinishError> {
        // The lease's token is the revision this node's lease wrote, so an older answer is a
        // replica's that has not applied the lease yet: read from the leader instead. Taken
        // as it came, it fenced a delivery that had succeeded, and the entry went out again
        // once its lease expired, its attempt counted as interrupted.
        let read = if fresh {
            self.records.get_leader(&entry_key(id)).await
        } else {
            self.records.get_at_least(&entry_key(id), lease.token).await
        };
        let Some(Versioned {
            value: Some(bytes),
            revision,
        }) = read.map_err(StoreError::from)?
        else {
            return Err(FinishError::NotFound);
        };
        if revision != lease.token {
            return match sent.iter().find(|(b, _)| *b == bytes) {
                Some((_, finished)) => Ok(finished.clone()),
                None => Err(FinishError::Fenced),
            };
        }
        let mut record: EntryRecord = dec("entries", &bytes)?;
        record.entry.id = id;
        record.node = None;
        let e = &mut record.entry;
        match e.lease {
            Some(l) if l.until >= now && e.state == EntryState::Queued => {}
            _ => return Err(FinishError::Fenced),
        }
        e.close_attempt(end);
        let mut hold_write = None;
        let (mut writes, overflowed) = match end.outbox.as_deref() {
            Some(outbox) => {
                let (writes, overflowed) = self.outbox_writes(outbox, now, fresh).await?;
                // Nothing of an outbox the server cannot hold is written: the caller
                // dead-letters the delivery without it (sent again, it would write the same).
                if let Some((key, bytes)) = self.records.oversized(&writes) {
                    return Err(FinishError::TooLarge {
                        record: key.to_string(),
                        bytes,
                        max: self.records.record_limit(),
                    });
                }
                (writes, overflowed)
            }
            None => (Vec::new(), Vec::new()),
        };
        let mut dlq = None;
        match *disposition {
            Disposition::Delivered => {
                e.state = EntryState::Delivered;
                e.finished_at = Some(now);
            }
            Disposition::Retry { due_at } => e.due_at = due_at,
            Disposition::Release { due_at } => {
                e.attempts.pop();
                e.due_at = due_at;
            }
            Disposition::DeadLetter { reason, hold } => {
                e.state = EntryState::Dead;
                e.finished_at = Some(now);
                let names = self.dlq_names(id.event).await?;
                let dlq_id = self.next_number("dlq").await?;
                hold_write = Self::key_hold(e, hold, dlq_id);
                dlq = Some(DlqEntry {
                    id: dlq_id,
                    ..DlqEntry::of_given_up(e, names, reason, end, now)
                });
                record.dlq = Some(dlq_id);
            }
        }
        let (entry_bytes, dlq_bytes) = self.fit_records(&mut record, dlq.as_mut())?;
        let entry_bytes = bytes::Bytes::from(entry_bytes);
        if let (Some(d), Some(bytes)) = (&dlq, dlq_bytes) {
            writes.push(Write::put(dlq_key(d.id), bytes, Expect::Revision(0)));
        }
        writes.insert(
            0,
            Write::put(
                entry_key(id),
                entry_bytes.clone(),
                Expect::Revision(revision),
            ),
        );
        // A held key's record goes before the entry's: views apply a batch in order, and one
        // that saw the entry gone before the key held proposed the key's next entry, which
        // the key lock (naming an entry no longer queued) let through.
        if let Some(h) = hold_write {
            writes.insert(0, h);
        }
        if writes.len() > records::MAX_BATCH {
            return Err(StoreError::Backend(format!(
                "the outbox needs {} writes, over the {} of one atomic batch",
                writes.len(),
                records::MAX_BATCH
            ))
            .into());
        }
        match self.commit(writes).await {
            Ok(_) => Ok(Finished {
                overflowed,
                dlq_id: dlq.as_ref().map(|d| d.id),
            }),
            Err(RecordsError::Conflict) => {
                // Taken over between the read and the write, or an outbox record changed:
                // the leader tells which (a replica could still show the lease's revision
                // after a take-over).
                match self
                    .records
                    .get_leader(&entry_key(id))
                    .await
                    .map_err(StoreError::from)?
                {
                    // Still ours: an outbox record changed; `finish` tries again.
                    Some(v) if v.revision == revision => Err(FinishError::Contended),
                    // An earlier try, unanswered, may have been applied in the meantime.
                    Some(v) => sent
                        .iter()
                        .find(|(b, _)| v.value.as_ref() == Some(b))
                        .map_or(Err(FinishError::Fenced), |(_, f)| Ok(f.clone())),
                    None => Err(FinishError::Fenced),
                }
            }
            Err(e @ RecordsError::Unanswered(_)) => {
                sent.push((
                    entry_bytes,
                    Finished {
                        overflowed,
                        dlq_id: dlq.as_ref().map(|d| d.id),
                    },
                ));
                Err(StoreError::from(e).into())
            }
            Err(e) => Err(StoreError::from(e).into()),
        }
    }

    /// The writes of a handler's outbox: emitted events (accepted with dedup: a re-run's
    /// events with the same ids are not stored twice), key-value writes expecting what was
    /// read (and the compare-and-set preconditions checked now and again at commit), the
    /// namespaces' usage, and the COMPLETED record. Also returns the emitted events' copies
    /// that overflow their target's queue (`Finished::overflowed`).
    async fn outbox_writes(
        &self,
        outbox: &Outbox,
        now: Millis,
        fresh: bool,
    ) -> Result<(Vec<Write>, Vec<(usize, String)>), FinishError> {
        let mut writes = Vec::new();
        let mut overflowed = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut depth = HashMap::new();
        for (i, ne) in outbox.emitted.iter().enumerate() {
            let key = dedup_record_key(&ne.event.source, &ne.event.id);
            if !seen.insert(key.clone()) {
                continue;
            }
            let read = self
                .records
                .get_from(&key, fresh)
                .await
                .map_err(StoreError::from)?;
            if self.live_duplicate(ne, read.as_ref())?.is_some() {
                continue;
            }
            let p = self
                .prepare(i, ne, key, read.as_ref(), false, &mut depth)
                .await?;
            overflowed.extend(p.overflowed.into_iter().map(|t| (i, t)));
            writes.extend(p.writes);
        }
        // Every key the outbox reads or writes, as it is now.
        let mut touched: Vec<(String, String)> = outbox
            .cas
            .iter()
            .map(|(ns, k, _)| (ns.clone(), k.clone()))
            .chain(
                outbox
                    .kv
                    .iter()
                    .map(|op| (op.namespace.clone(), op.key.clone())),
            )
            .collect();
        touched.sort();
        touched.dedup();
        let mut current: HashMap<(String, String), Option<Versioned>> = HashMap::new();
        for (ns, k) in touched {
            let read = self
                .records
                .get_from(&ops::kv_key(&ns, &k), fresh)
                .await
                .map_err(StoreError::from)?;
            current.insert((ns, k), read);
        }
        let live_value = |read: &Option<Versioned>| -> Result<Option<Vec<u8>>, StoreError> {
            match read.as_ref().and_then(|v| v.value.as_ref()) {
                Some(bytes) => {
                    let r: ops::KvRecord = dec("kv", bytes)?;
                    if r.expires_at.is_some_and(|e| e <= now) {
                        return Ok(None);
                    }
                    r.decoded().map(Some)
                }
                None => Ok(None),
            }
        };
        let written: std::collections::HashSet<(String, String)> = outbox
            .kv
            .iter()
            .map(|op| (op.namespace.clone(), op.key.clone()))
            .collect();
        for (ns, k, expected) in &outbox.cas {
            let slot = (ns.clone(), k.clone());
            let read = current.get(&slot).cloned().flatten();
            if live_value(&read)? != *expected {
                return Err(FinishError::Conflict(k.clone()));
            }
            if !written.contains(&slot) {
                // Re-asserted at commit: the record must still be at the revision read.
                let key = ops::kv_key(ns, k);
                writes.push(match read.as_ref().and_then(|v| v.value.clone()) {
                    Some(bytes) => Write::put(key, bytes, Expect::unchanged(read.as_ref())),
                    None => Write::delete(key, Expect::unchanged(read.as_ref())),
                });
            }
        }
        // Usage per namespace: stored entries (expired ones count until swept).
        // Per (namespace, usage shard): (bytes, keys) added.
        let mut usage: HashMap<(String, u8), (i64, i64)> = HashMap::new();
        let mut last_op: HashMap<(String, String), &KvOp> = HashMap::new();
        for op in &outbox.kv {
            last_op.insert((op.namespace.clone(), op.key.clone()), op);
        }
        for ((ns, k), op) in &last_op {
            let read = current.get(&(ns.clone(), k.clone())).cloned().flatten();
            let old = match read.as_ref().and_then(|v| v.value.as_ref()) {
                Some(bytes) => {
                    let r: ops::KvRecord = dec("kv", bytes)?;
                    Some(r.usage_bytes()? as i64)
                }
                None => None,
            };
            let new = op.value.as_ref().map(|v| KvUsage::data_bytes(k, v) as i64);
            let u = usage
                .entry((ns.clone(), ops::usage_shard(ns, k)))
                .or_default();
            u.0 += new.unwrap_or(0) - old.unwrap_or(0);
            u.1 += i64::from(new.is_some()) - i64::from(old.is_some());
            let key = ops::kv_key(ns, k);
            writes.push(match &op.value {
                Some(v) => Write::put(
                    key,
                    enc(&ops::KvRecord {
                        namespace: ns.clone(),
                        key: k.clone(),
                        value: ops::b64(v),
                        expires_at: op.expires_at,
                    }),
                    Expect::unchanged(read.as_ref()),
                ),
                None => Write::delete(key, Expect::unchanged(read.as_ref())),
            });
        }
        // The bound is checked against the namespace's total (all shards), and each shard is
        // written expecting what was read. Two nodes growing different shards of a namespace
        // at once can pass the bound by what they add together (the embedded store's check
        // is exact).
        let mut growth: HashMap<String, i64> = HashMap::new();
        for ((ns, _), (bytes, keys)) in &usage {
            // What the bound counts: each key added or removed also counts its overhead.
            *growth.entry(ns.clone()).or_default() += bytes + keys * KvUsage::ENTRY_OVERHEAD as i64;
        }
        if let Some(max) = outbox.kv_max_bytes {
            for (ns, grows) in &growth {
                if *grows <= 0 {
                    continue;
                }
                let total = self.kv_usage_of(ns).await?.bytes;
                let would_hold = (total as i64 + grows).max(0) as u64;
                if would_hold > max {
                    return Err(FinishError::KvQuota {
                        namespace: ns.clone(),
                        would_hold,
                        max,
                    });
                }
            }
        }
        for ((ns, shard), (bytes, keys)) in usage {
            let ukey = ops::usage_key(&ns, shard);
            let read = self
                .records
                .get_from(&ukey, fresh)
                .await
                .map_err(StoreError::from)?;
            let old: ops::UsageRecord = match read.as_ref().and_then(|v| v.value.as_ref()) {
                Some(b) => dec("kv usage", b)?,
                None => ops::UsageRecord::default(),
            };
            let record = ops::UsageRecord {
                namespace: ns,
                bytes: (old.bytes as i64 + bytes).max(0) as u64,
                keys: (old.keys as i64 + keys).max(0) as u64,
            };
            writes.push(ops::usage_write(
                &ukey,
                &record,
                Expect::unchanged(read.as_ref()),
            ));
        }
        if let Some(c) = &outbox.completed {
            writes.push(Write::put(
                ops::completed_key(&c.handler, &c.key),
                enc(&ops::CompletedRecord {
                    result: ops::b64(&c.result),
                    expires_at: c.expires_at,
                    handler: Some(c.handler.clone()),
                }),
                Expect::Any,
            ));
        }
        Ok((writes, overflowed))
    }

    /// How many of `target`'s entries could be leased at `now`, up to `max` (as this node's
    /// view has them).
    pub fn due_count(&self, target: &str, now: Millis, max: usize) -> usize {
        self.view.due_count(target, now, max)
    }

    /// When `target`'s next entry may be leased (as this node's view has it).
    pub fn next_due(&self, target: &str) -> Option<Millis> {
        self.view.next_due(target)
    }

    /// Woken whenever `target` gets new or re-queued entries, from any node.
    pub fn notifier(&self, target: &str) -> Arc<Notify> {
        self.view.notifier(target)
    }

    /// Targets with live entries.
    pub fn targets_with_entries(&self) -> Vec<String> {
        self.view.targets()
    }

    /// Commits `writes`, noting the newest record written that the view follows, so this
    /// node's leases wait until its view has it (a node sees its own writes).
    async fn commit(&self, writes: Vec<Write>) -> Result<Vec<u64>, RecordsError> {
        let entries: Vec<bool> = writes.iter().map(|w| view::follows(&w.key)).collect();
        let revs = self.records.commit(writes).await?;
        if let Some(newest) = revs
            .iter()
            .zip(entries)
            .filter(|(_, e)| *e)
            .map(|(r, _)| *r)
            .max()
        {
            self.written
                .fetch_max(newest, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(revs)
    }

    /// The stored event `seq` with the number of its entries and its quarantine DLQ entry.
    ///
    /// Whoever asks holds a reference to it (an entry, a DLQ entry, a dedup key), so it
    /// exists: a replica that does not have it yet is not believed, and the leader is asked.
    async fn event_record(&self, seq: u64) -> Result<Option<EventRecord>, StoreError> {
        self.event_record_from(seq, false).await
    }

    /// The id, source and type a DLQ entry copies from event `seq`: empty when the event is
    /// gone or its record does not decode (the entry is written all the same, an unreadable
    /// event being what sends one there as `corrupt_record`).
    async fn dlq_names(&self, seq: u64) -> Result<(String, String, String), StoreError> {
        match self.event_record(seq).await {
            Ok(Some(r)) => Ok((r.stored.event.id, r.stored.event.source, r.stored.event.ty)),
            Ok(None) | Err(StoreError::Corrupt { .. }) => Ok(Default::default()),
            Err(e) => Err(e),
        }
    }

    /// `event_record`, from the leader with `leader`.
    async fn event_record_from(
        &self,
        seq: u64,
        leader: bool,
    ) -> Result<Option<EventRecord>, StoreError> {
        let read = if leader {
            self.records.get_leader(&event_key(seq)).await?
        } else {
            self.records.get_at_least(&event_key(seq), 1).await?
        };
        match read {
            Some(Versioned {
                value: Some(bytes), ..
            }) => {
                let mut r: EventRecord = dec("events", &bytes)?;
                r.stored.seq = seq;
                Ok(Some(r))
            }
            _ => Ok(None),
        }
    }

    /// Everything known about (`source`, `id`), read from the stream's leader: a producer
    /// asks right after its 202, maybe of another node, and a replica that had not applied
    /// the accept yet answered that the event was unknown.
    pub async fn fate(&self, source: &str, id: &str) -> Result<Option<Fate>, StoreError> {
        let Some(Versioned {
            value: Some(bytes), ..
        }) = self
            .records
            .get_leader(&dedup_record_key(source, id))
            .await?
        else {
            return Ok(None);
        };
        let d: DedupRecord = dec("dedup", &bytes)?;
        if d.source != source || d.id != id {
            return Ok(None);
        }
        let Some(ev) = self.event_record_from(d.seq, true).await? else {
            return Ok(None);
        };
        let reads = try_join_all((0..ev.entries).map(|idx| {
            let key = entry_key(EntryId { event: d.seq, idx });
            async move { self.records.get_leader(&key).await }
        }))
        .await?;
        let mut entries = Vec::new();
        let mut dlq_ids: Vec<u64> = ev.dlq.clone();
        for (idx, read) in (0..ev.entries).zip(reads) {
            if let Some(bytes) = read.and_then(|v| v.value) {
                let mut r: EntryRecord = dec("entries", &bytes)?;
                r.entry.id = EntryId { event: d.seq, idx };
                dlq_ids.extend(r.dlq);
                entries.push(r.entry);
            }
        }
        let mut dlq = Vec::new();
        for id in dlq_ids {
            if let Some(e) = self.dlq_entry_from(id, true).await? {
                dlq.push(e);
            }
        }
        let mut previous = Vec::new();
        for seq in d.previous {
            // Swept since (its DLQ entries purged): nothing left to show.
            // (A copy routed by a redrive all the same, by a build before the check that
            // keeps it, is no longer quarantined and not shown, as on redb.)
            let Some(copy) = self
                .event_record_from(seq, true)
                .await?
                .filter(|c| c.stored.quarantined)
            else {
                continue;
            };
            let mut dlq = Vec::new();
            for id in copy.dlq {
                if let Some(e) = self.dlq_entry_from(id, true).await? {
                    dlq.push(e);
                }
            }
            previous.push(PreviousCopy {
                event: copy.stored,
                dlq,
            });
        }
        Ok(Some(Fate {
            event: ev.stored,
            entries,
            dlq,
            previous,
        }))
    }

    /// DLQ entry `id`. The ids asked for come from the view, which follows the stream
    /// from its leader, so one a replica does not have yet is read from the leader (a
    /// listing skipped it as purged).
    async fn dlq_entry(&self, id: u64) -> Result<Option<DlqEntry>, StoreError> {
        self.dlq_entry_from(id, false).await
    }

    /// `dlq_entry`, from the leader with `leader`.
    async fn dlq_entry_from(&self, id: u64, leader: bool) -> Result<Option<DlqEntry>, StoreError> {
        let read = if leader {
            self.records.get_leader(&dlq_key(id)).await?
        } else {
            self.records.get_at_least(&dlq_key(id), 1).await?
        };
        match read {
            Some(Versioned {
                value: Some(bytes),
                revision,
            }) => {
                let mut d: DlqEntry = dec("dlq", &bytes)?;
                // A record never rewritten was made at its own revision.
                d.made.get_or_insert(revision);
                Ok(Some(d))
            }
            _ => Ok(None),
        }
    }

    /// One DLQ entry with its event.
    pub async fn dlq_get(&self, id: u64) -> Result<Option<(DlqEntry, StoredEvent)>, StoreError> {
        let Some(entry) = self.dlq_entry(id).await? else {
            return Ok(None);
        };
        let event =
            self.event_record(entry.event_seq)
                .await?
                .ok_or_else(|| StoreError::Corrupt {
                    table: "dlq",
                    message: format!("DLQ entry {id} refers to missing event {}", entry.event_seq),
                })?;
        Ok(Some((entry, event.stored)))
    }

    /// Waits until this node's view has every write of this node (what `lease` does first).
    #[cfg(test)]
    async fn settled(&self) {
        self.has_seen(self).await;
    }

    /// Waits until this node's view has every write node `other` made so far.
    #[cfg(test)]
    async fn has_seen(&self, other: &JetStreamStore) {
        let written = other.written.load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            self.view
                .wait_applied(written, std::time::Duration::from_secs(10))
                .await,
            "the view never caught up"
        );
    }

    /// Whether a DLQ entry with this reason exists for the event (for tests and checks).
    #[cfg(test)]
    async fn dlq_reasons(&self, source: &str, id: &str) -> Vec<DlqReason> {
        self.fate(source, id)
            .await
            .ok()
            .flatten()
            .map(|f| f.dlq.iter().map(|d| d.reason).collect())
            .unwrap_or_default()
    }
}

/// Groups prepared events into commits of at most `MAX_BATCH` writes, never splitting one
/// event's writes (each event stays all or nothing).
fn chunks(prepared: Vec<Prepared>) -> Vec<Vec<Prepared>> {
    let mut out: Vec<Vec<Prepared>> = Vec::new();
    let mut size = 0;
    for p in prepared {
        if out.is_empty() || size + p.writes.len() > records::MAX_BATCH {
            out.push(Vec::new());
            size = 0;
        }
        size += p.writes.len();
        if let Some(last) = out.last_mut() {
            last.push(p);
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod test_server;

#[cfg(test)]
mod tests;
