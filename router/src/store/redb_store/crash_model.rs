//! Model-based power-cut tests of the store.
//!
//! Random rounds of the store's write operations (accepts with and without leases taken at
//! acceptance, duplicates, leases, every kind of finish, releases of held ordering keys) run
//! concurrently, so they share group commits; power cuts come between rounds and in the middle
//! of one. After every reopen the store is compared with a model of what was acknowledged:
//! - nothing acknowledged is lost (events, entries, attempt counts, due times, DLQ entries,
//!   held keys, dedup keys);
//! - nothing in flight is half-applied: an accept's events are all there with their entries and
//!   dedup keys or none of it is, a lease took all its entries or none, a finish is before or
//!   after, never between;
//! - leases of the dead process are reclaimed with their attempt counted, and its workers can no
//!   longer finish their entries (fencing across a restart);
//! - leases follow due times and ordering keys exactly as the model predicts, and a queue at
//!   its depth cap sends new entries to the DLQ (`target_overflow`) exactly as it predicts;
//! - a handler's outbox (emitted events, key-value writes, its COMPLETED record) is there
//!   exactly when its ack is, reads as absent once past its expiry, and is swept then;
//! - a redrive step's moves and its job's progress are there together, and so are a replay
//!   step's new deliveries and its job's; a purge, and a removed target's move of its waiting
//!   entries to the DLQ, are all there or not at all;
//! - the sweep removes exactly the events past retention that nothing refers to, and nothing
//!   that a queue or the DLQ still needs;
//! - each target's runtime state (breaker, pause) and the saved target configurations are the
//!   last ones acknowledged.
//!
//! The same holds when the disk fails under a round (a full or broken disk) and heals: an
//! operation answered with an error may or may not have been applied (the answer says only
//! that it is not acknowledged), but never half; the store reopens on what it has and goes on.
//!
//! With and without the group log, and with a dedup memtable small enough to be written as
//! runs between cuts. A failure prints the shrunk list of steps that reproduces it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::json;

use super::tests::delivered;
use super::{RedbStore, StoreOptions};
use crate::store::fault::{LogDisks, SimulatedDisk};
use crate::store::*;

/// The targets: `c` is ordered (its entries carry the event's ordering key), `a` and `b` are
/// not (their entries may be leased at acceptance, as delivery's handoff does).
const TARGETS: [&str; 3] = ["a", "b", "c"];
const ORDERED: &str = "c";
/// Target `b` has a queue-depth cap this small, so accepts overflow it now and then.
const CAPPED: &str = "b";
const CAP: u64 = 4;
const SOURCE: &str = "/model";
/// Leases outlive every case (a case spans seconds of model time), so none expires in it.
const LEASE_MS: i64 = 3_600_000;
/// The handler whose outbox some acks carry (its key-value namespace and COMPLETED records).
const HANDLER: &str = "h";
/// Retention and dedup window of the sweeps (model time advances 10-500 ms a round).
const RETENTION_MS: i64 = 600;
/// The redrive job every redrive step reports its progress to.
const JOB: &str = "redrive-1";
/// The replay job every replay step reports its progress to.
const REPLAY_JOB: &str = "replay-1";
/// The (unordered) target replays deliver to.
const REPLAY_TARGET: &str = "a";

// ---------------------------------------------------------------------------------------------
// The steps a case is made of

/// One `accept` call: `n` new events fanned out to the targets in `mask` (or, `poison`,
/// quarantined by their contract: stored straight into the DLQ), plus (when `dup` picks one)
/// an event acknowledged earlier, sent again.
#[derive(Debug, Clone)]
struct AcceptSpec {
    n: usize,
    poison: bool,
    mask: u8,
    key: Option<u8>,
    handoff: bool,
    dup: Option<Index>,
}

/// How a finish ends its attempt.
#[derive(Debug, Clone, Copy)]
enum How {
    /// Delivered; with `Some(n)`, as a handler does: `n` emitted events, a key-value write
    /// and the COMPLETED record in the ack's commit (the outbox).
    Delivered(Option<u8>),
    Retry(i64),
    DeadLetter {
        hold: bool,
    },
    Release(i64),
}

/// Operations issued together, after model time moves on by `advance` ms.
#[derive(Debug, Clone)]
struct Round {
    advance: i64,
    accepts: Vec<AcceptSpec>,
    finishes: Vec<(Index, How)>,
    /// Leases of up to this many entries of a target (one lease per target).
    leases: Vec<(usize, usize)>,
    release: Option<Index>,
    /// DLQ entries moved back to their queues in one redrive step.
    redrive: Vec<Index>,
    /// A DLQ entry purged.
    purge: Option<Index>,
    /// Events replayed to `REPLAY_TARGET` in one replay step.
    replay: Vec<Index>,
    /// Runtime states put (target, value); one per target is kept.
    states: Vec<(usize, u8)>,
    /// The targets' configurations saved, all three with this value.
    save: Option<u8>,
}

#[derive(Debug, Clone)]
enum Step {
    Round(Round),
    /// Power cut between rounds (everything issued has been answered).
    Cut,
    /// A round issued, and the power cut `wait_us` µs later, whatever is still in flight.
    CutDuring(Round, u64),
    /// Sweep calls until one says there is no more to do, alone (what it may remove depends
    /// on every other write), `advance` ms later; with `Some(wait_us)`, cut that long after
    /// the sweep started.
    Sweep(i64, Option<u64>),
    /// A round issued, both disks failing every write `wait_us` µs later until the round is
    /// answered, then healed.
    DiskFail(Round, u64),
    /// A target removed from the rules with `on_removed: dlq`: its waiting entries go to the
    /// DLQ as `target_removed`. Alone (which entries wait depends on every other write); with
    /// `Some(wait_us)`, cut that long after it started.
    Remove(usize, Option<u64>),
}

/// How the store makes groups durable.
#[derive(Debug, Clone, Copy)]
enum Mode {
    /// A synced redb commit per group.
    Synced,
    /// The group log, checkpointed every this many ms.
    Logged(u64),
    /// Synced commits, and the entry floor moved at every group (over the previous group's
    /// events), so that entries cross it between any two operations.
    SyncedFloorEveryGroup,
}

fn how() -> impl Strategy<Value = How> {
    prop_oneof![
        6 => prop::option::of(0u8..3).prop_map(How::Delivered),
        1 => (1i64..2_000).prop_map(How::Retry),
        1 => any::<bool>().prop_map(|hold| How::DeadLetter { hold }),
        1 => (1i64..2_000).prop_map(How::Release),
    ]
}

fn round() -> impl Strategy<Value = Round> {
    let accept = (
        1usize..3,
        prop::bool::weighted(0.15),
        1u8..8,
        prop::option::of(0u8..3),
        any::<bool>(),
        prop::option::weighted(0.2, any::<Index>()),
    )
        .prop_map(|(n, poison, mask, key, handoff, dup)| AcceptSpec {
            n,
            poison,
            mask,
            key,
            handoff,
            dup,
        });
    (
        10i64..500,
        prop::collection::vec(accept, 0..2),
        prop::collection::vec((any::<Index>(), how()), 0..6),
        prop::collection::vec((0usize..TARGETS.len(), 1usize..8), 0..3),
        prop::option::weighted(0.2, any::<Index>()),
        prop::collection::vec(any::<Index>(), 0..3),
        prop::option::weighted(0.2, any::<Index>()),
        prop::collection::vec(any::<Index>(), 0..2),
        (
            prop::collection::vec((0usize..TARGETS.len(), any::<u8>()), 0..2),
            prop::option::weighted(0.2, any::<u8>()),
        ),
    )
        .prop_map(
            |(
                advance,
                accepts,
                finishes,
                leases,
                release,
                redrive,
                purge,
                replay,
                (states, save),
            )| Round {
                advance,
                accepts,
                finishes,
                leases,
                release,
                redrive,
                purge,
                replay,
                states,
                save,
            },
        )
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => round().prop_map(Step::Round),
        1 => Just(Step::Cut),
        2 => (round(), 0u64..400).prop_map(|(r, us)| Step::CutDuring(r, us)),
        2 => (10i64..2_000, prop::option::of(0u64..400)).prop_map(|(a, w)| Step::Sweep(a, w)),
        1 => (round(), 0u64..400).prop_map(|(r, us)| Step::DiskFail(r, us)),
        1 => (0usize..TARGETS.len(), prop::option::of(0u64..400))
            .prop_map(|(t, w)| Step::Remove(t, w)),
    ]
}

fn mode() -> impl Strategy<Value = Mode> {
    prop_oneof![
        Just(Mode::Synced),
        Just(Mode::SyncedFloorEveryGroup),
        Just(Mode::Logged(2)),
        Just(Mode::Logged(3_600_000)),
    ]
}

// ---------------------------------------------------------------------------------------------
// The model

#[derive(Debug, Clone, Copy, PartialEq)]
enum MState {
    Queued,
    Leased(Lease),
    Delivered,
    Dead,
}

#[derive(Debug, Clone)]
struct MEntry {
    /// Position in the event's fan-out (`EntryId::idx`); an entry refused by its queue's cap
    /// leaves a gap.
    idx: u32,
    target: &'static str,
    key: Option<String>,
    state: MState,
    attempts: usize,
    due: Millis,
    /// Dead and its DLQ entry not purged (nor redriven).
    in_dlq: bool,
    redrives: u32,
    /// A delivery added by a replay job.
    replay: bool,
}

impl MEntry {
    fn live(&self) -> bool {
        matches!(self.state, MState::Queued | MState::Leased(_))
    }
}

#[derive(Debug, Clone)]
struct MEvent {
    id: String,
    accepted_at: Millis,
    entries: Vec<MEntry>,
    /// Entries refused by their queue's depth cap: each a DLQ entry (`target_overflow`).
    overflowed: usize,
    /// Quarantined at acceptance: no entries, one DLQ entry of its own.
    quarantined: bool,
}

impl MEvent {
    fn new(id: String, ne: &NewEvent) -> Self {
        Self {
            id,
            accepted_at: ne.accepted_at,
            entries: model_entries(ne),
            overflowed: 0,
            quarantined: ne.quarantine.is_some(),
        }
    }

    /// What the sweep may remove at `now`: past retention, no live entry, no DLQ entry.
    fn sweepable(&self, now: Millis) -> bool {
        self.accepted_at < now - RETENTION_MS
            && !self.quarantined
            && self.overflowed == 0
            && !self.entries.iter().any(|e| e.live() || e.in_dlq)
    }
}

/// What the store must hold: every acknowledged event by sequence number, and the ordered
/// target's held keys.
#[derive(Debug, Default)]
struct Model {
    events: BTreeMap<u64, MEvent>,
    /// Held keys of the ordered target, each with its holder: the entry whose dead letter put
    /// the hold last (a redrive releases the key only with it, or once it has left the DLQ).
    held: BTreeMap<String, EntryId>,
    next_id: u64,
    /// Entries whose ack carried an outbox: when its key-value write and COMPLETED record
    /// expire.
    outboxes: BTreeMap<EntryId, (Option<Millis>, Millis)>,
    /// Outbox key-value writes still stored (not yet swept after their expiry).
    kv_stored: BTreeSet<EntryId>,
    /// Model time of the latest step.
    now: Millis,
    /// Events accepted before this may have been passed by a sweep that kept them (a live
    /// or DLQ entry): their dedup key then lives only for their fate (`dedup_kept`), past
    /// its window, and no longer makes a copy sent again a duplicate.
    swept_before: Millis,
    /// The redrive job's `moved` (`None`: no step yet).
    job_moved: Option<u64>,
    /// The replay job's `moved` (`None`: no step yet).
    replayed: Option<u64>,
    /// Events the sweep removed: gone for good.
    swept: Vec<String>,
    /// Each target's runtime state as last acknowledged.
    states: BTreeMap<&'static str, serde_json::Value>,
    /// The saved target configurations as last acknowledged.
    saved: BTreeMap<&'static str, serde_json::Value>,
}

impl Model {
    fn fresh_id(&mut self) -> String {
        self.next_id += 1;
        format!("e{}", self.next_id)
    }

    fn entry(&mut self, id: EntryId) -> &mut MEntry {
        let ev = self.events.get_mut(&id.event).expect("event in model");
        ev.entries
            .iter_mut()
            .find(|e| e.idx == id.idx)
            .expect("entry in model")
    }

    /// Live (queued or leased) entries of `target`: what its depth cap counts.
    fn live(&self, target: &str) -> u64 {
        let live = self.events.values().flat_map(|ev| &ev.entries);
        live.filter(|e| e.target == target && e.live()).count() as u64
    }

    fn leased(&self) -> Vec<(EntryId, Lease)> {
        let mut out = Vec::new();
        for (&seq, ev) in &self.events {
            for e in &ev.entries {
                if let MState::Leased(l) = e.state {
                    out.push((entry_id(seq, e.idx), l));
                }
            }
        }
        out
    }

    /// Entries with a DLQ entry.
    fn in_dlq(&self) -> Vec<EntryId> {
        let mut out = Vec::new();
        for (&seq, ev) in &self.events {
            for e in &ev.entries {
                if e.in_dlq {
                    out.push(entry_id(seq, e.idx));
                }
            }
        }
        out
    }

    /// What `lease(target, now, max)` must return, in order: queued entries due at `now`, by
    /// due time then id, each unkeyed or the first live entry of a key that is not held and
    /// has no entry in flight (a redriven dead letter, first of its key, waits for it).
    fn leasable(&self, target: &str, now: Millis, max: usize) -> Vec<EntryId> {
        let mut first_of_key: BTreeMap<&str, EntryId> = BTreeMap::new();
        let mut flying: BTreeSet<&str> = BTreeSet::new();
        let mut due = Vec::new();
        for (&seq, ev) in &self.events {
            for e in &ev.entries {
                if e.target != target || !e.live() {
                    continue;
                }
                let id = entry_id(seq, e.idx);
                if let Some(k) = &e.key {
                    first_of_key.entry(k.as_str()).or_insert(id);
                    if matches!(e.state, MState::Leased(_)) {
                        flying.insert(k.as_str());
                    }
                }
                if e.state == MState::Queued && e.due <= now {
                    due.push((e.due, id, e.key.clone()));
                }
            }
        }
        due.sort_by_key(|&(d, id, _)| (d, id));
        due.into_iter()
            .filter(|(_, id, key)| match key {
                None => true,
                Some(k) => {
                    !self.held.contains_key(k)
                        && !flying.contains(k.as_str())
                        && first_of_key.get(k.as_str()) == Some(id)
                }
            })
            .map(|(_, id, _)| id)
            .take(max)
            .collect()
    }

    /// A power cut: every lease is reclaimed at the next start, its attempt counted.
    fn reclaim(&mut self) {
        for ev in self.events.values_mut() {
            for e in &mut ev.entries {
                if matches!(e.state, MState::Leased(_)) {
                    e.state = MState::Queued;
                }
            }
        }
    }
}

fn entry_id(seq: u64, idx: u32) -> EntryId {
    EntryId { event: seq, idx }
}

/// Ids of the events an ack of `id` emits, and its key in the handler's namespace (and its
/// COMPLETED key): derived from the entry, as the router derives them from the delivery, so a
/// re-run emits the same ones.
fn emitted_id(id: EntryId, k: u8) -> String {
    format!("out-{id}-{k}")
}

fn outbox_key(id: EntryId) -> String {
    format!("done-{id}")
}

/// When the key-value write and the COMPLETED record of an outbox of `n` events, committed at
/// `now`, expire (the write only for odd `n`).
fn outbox_expiry(n: u8, now: Millis) -> (Option<Millis>, Millis) {
    (
        (n % 2 == 1).then_some(now + 500),
        now + 800 + 200 * i64::from(n),
    )
}

/// What a handler's invocation for entry `id` buffered: `n` events for target `a`, one
/// key-value write guarded by "the key is still absent", and the COMPLETED record.
fn outbox(id: EntryId, n: u8, now: Millis) -> Outbox {
    let (kv_expires, completed_expires) = outbox_expiry(n, now);
    Outbox {
        emitted: (0..n)
            .map(|k| new_event(&emitted_id(id, k), 1, None, false, now))
            .collect(),
        kv: vec![KvOp {
            namespace: HANDLER.into(),
            key: outbox_key(id),
            value: Some(id.to_string().into_bytes()),
            expires_at: kv_expires,
        }],
        cas: vec![(HANDLER.into(), outbox_key(id), None)],
        completed: Some(CompletedRecord {
            handler: HANDLER.into(),
            key: outbox_key(id),
            result: b"{}".to_vec(),
            expires_at: completed_expires,
        }),
        kv_max_bytes: None,
    }
}

// ---------------------------------------------------------------------------------------------
// Operations: planned from the model, run against the store, their answers applied to the model

fn new_event(id: &str, mask: u8, key: Option<u8>, handoff: bool, at: Millis) -> NewEvent {
    let event = serde_json::from_value(json!({
        "specversion": "1.0", "id": id, "source": SOURCE, "type": "t", "data": {"n": 1}
    }))
    .expect("valid event");
    NewEvent {
        event,
        accepted_at: at,
        ruleset_version: "v1".into(),
        matched_rules: vec!["r".into()],
        targets: TARGETS
            .iter()
            .enumerate()
            .filter(|(i, _)| mask & (1 << i) != 0)
            .map(|(_, &t)| NewEntry {
                target_id: t.into(),
                rule: "r".into(),
                ordering_key: (t == ORDERED)
                    .then(|| key.map(|k| format!("k{k}")))
                    .flatten(),
                max_depth: (t == CAPPED).then_some(CAP),
                lease_ms: (handoff && t != ORDERED).then_some(LEASE_MS),
                hold_key: false,
            })
            .collect(),
        quarantine: None,
        dedup_window_ms: 86_400_000,
    }
}

/// An event whose data failed its contract (quarantine mode): stored with its DLQ entry,
/// never routed.
fn poison_event(id: &str, at: Millis) -> NewEvent {
    NewEvent {
        targets: Vec::new(),
        matched_rules: Vec::new(),
        quarantine: Some(Quarantine {
            reason: DlqReason::ContractViolation,
            errors: vec![crate::event::FieldError::new("/n", "must be a string")],
            emitted_by: None,
        }),
        ..new_event(id, 1, None, false, at)
    }
}

/// The model's entries of a new event.
fn model_entries(ne: &NewEvent) -> Vec<MEntry> {
    ne.targets
        .iter()
        .zip(0u32..)
        .map(|(t, idx)| MEntry {
            idx,
            target: TARGETS
                .iter()
                .find(|&&x| x == t.target_id)
                .copied()
                .expect("known target"),
            key: t.ordering_key.clone(),
            state: MState::Queued,
            attempts: 0,
            due: ne.accepted_at,
            in_dlq: false,
            redrives: 0,
            replay: false,
        })
        .collect()
}

#[derive(Debug, Clone)]
enum Op {
    Accept {
        events: Vec<NewEvent>,
        /// An acknowledged event sent again, with its sequence number.
        dup: Option<(String, u64)>,
    },
    Finish {
        id: EntryId,
        lease: Lease,
        how: How,
        now: Millis,
    },
    Lease {
        target: &'static str,
        now: Millis,
        max: usize,
        expect: Vec<EntryId>,
    },
    Release {
        key: String,
    },
    /// One redrive step: these DLQ entries back to their queues, the job's progress with them.
    Redrive {
        moves: Vec<(u64, EntryId)>,
        job: Job,
        now: Millis,
    },
    Purge {
        dlq_id: u64,
        entry: EntryId,
    },
    /// Sweep calls until one says there is no more.
    Sweep {
        now: Millis,
    },
    /// One replay step: a new delivery to `REPLAY_TARGET` for each of these events.
    Replay {
        seqs: Vec<u64>,
        job: Job,
        now: Millis,
    },
    PutState {
        target: &'static str,
        state: serde_json::Value,
    },
    Save {
        configs: Vec<(&'static str, serde_json::Value)>,
    },
    /// The waiting entries of `target` to the DLQ; `expect` of them.
    Remove {
        target: &'static str,
        now: Millis,
        expect: usize,
    },
}

#[derive(Debug)]
enum Answer {
    Accepted(Result<AcceptedLeased, StoreError>),
    Finished(Result<(), FinishError>),
    Leased(Result<Vec<Leased>, StoreError>),
    Released(Result<bool, StoreError>),
    Redriven(Result<(u64, RedriveGone), StoreError>),
    Purged(Result<u64, StoreError>),
    Swept(Result<(), StoreError>),
    Replayed(Result<u64, StoreError>),
    Removed(Result<usize, StoreError>),
    Put(Result<(), StoreError>),
}

/// New entries `ops` ask of the capped queue.
fn capped_requests(ops: &[Op]) -> u64 {
    let mut n = 0;
    for op in ops {
        if let Op::Accept { events, dup } = op {
            let fresh = events.len() - usize::from(dup.is_some());
            let entries = events[..fresh].iter().flat_map(|e| &e.targets);
            n += entries.filter(|t| t.target_id == CAPPED).count() as u64;
        }
    }
    n
}

/// The operations of `round` at `now`, chosen so that none depends on another's commit order:
/// leases look at `now - 1`, before this round's accepts and every retry it schedules, and a
/// target whose entries this round finishes (or whose key it releases) is not leased in it.
fn plan(model: &mut Model, store: &RedbStore, round: &Round, now: Millis) -> Vec<Op> {
    let mut ops = Vec::new();
    for a in &round.accepts {
        let mut events: Vec<NewEvent> = (0..a.n)
            .map(|_| {
                let id = model.fresh_id();
                if a.poison {
                    poison_event(&id, now)
                } else {
                    new_event(&id, a.mask, a.key, a.handoff, now)
                }
            })
            .collect();
        // Only events no sweep has passed are sure to be duplicates (`Model::swept_before`).
        let unswept: Vec<(&u64, &MEvent)> = model
            .events
            .iter()
            .filter(|(_, e)| e.accepted_at >= model.swept_before)
            .collect();
        let dup = match (a.dup, unswept.is_empty()) {
            (Some(pick), false) => {
                let (&seq, ev) = unswept[pick.index(unswept.len())];
                // A quarantined event's copy is a duplicate only while it fails too (a passing
                // copy is accepted in its place: `a_fixed_copy_of_a_quarantined_event_…`).
                events.push(if ev.quarantined {
                    poison_event(&ev.id, now)
                } else {
                    new_event(&ev.id, a.mask, a.key, false, now)
                });
                Some((ev.id.clone(), seq))
            }
            _ => None,
        };
        ops.push(Op::Accept { events, dup });
    }
    // A round that adds entries to the capped queue does not take any out or put any back
    // (finishes, redrives): how many its accepts may add is then known from the start.
    let capped_accepts = capped_requests(&ops) > 0;
    let frozen =
        |model: &mut Model, id: EntryId| capped_accepts && model.entry(id).target == CAPPED;
    let leased = model.leased();
    let mut finished = BTreeSet::new();
    let mut busy: BTreeSet<&str> = BTreeSet::new();
    if !leased.is_empty() {
        for &(pick, how) in &round.finishes {
            let (id, lease) = leased[pick.index(leased.len())];
            if !frozen(model, id) && finished.insert(id) {
                busy.insert(model.entry(id).target);
                ops.push(Op::Finish {
                    id,
                    lease,
                    how,
                    now,
                });
            }
        }
    }
    let mut releasing = false;
    if let (Some(pick), false) = (round.release, model.held.is_empty()) {
        let key = model
            .held
            .keys()
            .nth(pick.index(model.held.len()))
            .expect("picked")
            .clone();
        busy.insert(ORDERED);
        ops.push(Op::Release { key });
        releasing = true;
    }
    let dead = model.in_dlq();
    let mut moved = BTreeSet::new();
    if !dead.is_empty() {
        let mut moves = Vec::new();
        for pick in &round.redrive {
            let id = dead[pick.index(dead.len())];
            // A redrive releases the key its entry held: not in the round of a release,
            // which would find the key released already (or not yet).
            if releasing && model.entry(id).target == ORDERED {
                continue;
            }
            if !frozen(model, id) && moved.insert(id) {
                busy.insert(model.entry(id).target);
                moves.push((dlq_id(model, store, id), id));
            }
        }
        if !moves.is_empty() {
            let done = model.job_moved.unwrap_or(0) + moves.len() as u64;
            let job = Job {
                cursor: moves.iter().map(|m| m.0).max().unwrap_or(0),
                ..job(store, JOB, done, now)
            };
            ops.push(Op::Redrive { moves, job, now });
        }
        if let Some(pick) = round.purge {
            let entry = dead[pick.index(dead.len())];
            if !moved.contains(&entry) {
                let dlq_id = dlq_id(model, store, entry);
                ops.push(Op::Purge { dlq_id, entry });
            }
        }
    }
    let replayable: Vec<u64> = model
        .events
        .iter()
        .filter(|(_, ev)| !ev.quarantined)
        .map(|(&seq, _)| seq)
        .collect();
    if !replayable.is_empty() && !round.replay.is_empty() {
        let seqs: BTreeSet<u64> = round
            .replay
            .iter()
            .map(|pick| replayable[pick.index(replayable.len())])
            .collect();
        let done = model.replayed.unwrap_or(0) + seqs.len() as u64;
        let job = Job {
            kind: JobKind::Replay,
            cursor: seqs.last().copied().unwrap_or(0),
            ..job(store, REPLAY_JOB, done, now)
        };
        ops.push(Op::Replay {
            seqs: seqs.into_iter().collect(),
            job,
            now,
        });
    }
    let mut put = BTreeSet::new();
    for &(t, v) in &round.states {
        if put.insert(t) {
            let state = json!({ "breaker": "open", "v": v, "at": now });
            ops.push(Op::PutState {
                target: TARGETS[t],
                state,
            });
        }
    }
    if let Some(v) = round.save {
        let configs = TARGETS
            .iter()
            .map(|&t| {
                (
                    t,
                    json!({ "webhook": format!("http://127.0.0.1:9/{t}"), "v": v }),
                )
            })
            .collect();
        ops.push(Op::Save { configs });
    }
    for &(t, max) in &round.leases {
        if !busy.insert(TARGETS[t]) {
            continue;
        }
        let expect = model.leasable(TARGETS[t], now - 1, max);
        ops.push(Op::Lease {
            target: TARGETS[t],
            now: now - 1,
            max,
            expect,
        });
    }
    ops
}

async fn run(store: Arc<RedbStore>, op: Op) -> Answer {
    match op {
        Op::Accept { events, .. } => {
            let leasing = events
                .iter()
                .any(|e| e.targets.iter().any(|t| t.lease_ms.is_some()));
            Answer::Accepted(if leasing {
                store.accept_leased(events).await
            } else {
                store.accept(events).await.map(|o| (o, Vec::new()))
            })
        }
        Op::Finish {
            id,
            lease,
            how,
            now,
        } => {
            let (result, status, disposition) = match how {
                How::Delivered(_) => (AttemptResult::Delivered, 200, Disposition::Delivered),
                How::Retry(d) => (
                    AttemptResult::Retryable,
                    503,
                    Disposition::Retry { due_at: now + d },
                ),
                How::DeadLetter { hold } => (
                    AttemptResult::Permanent,
                    400,
                    Disposition::DeadLetter {
                        reason: DlqReason::PermanentError,
                        hold,
                    },
                ),
                How::Release(d) => (
                    AttemptResult::Retryable,
                    503,
                    Disposition::Release { due_at: now + d },
                ),
            };
            let end = AttemptEnd {
                finished_at: now,
                result,
                status: Some(status),
                error: (status != 200).then(|| format!("status {status}")),
                outbox: match how {
                    How::Delivered(Some(n)) => Some(Box::new(outbox(id, n, now))),
                    _ => None,
                },
            };
            Answer::Finished(
                store
                    .finish(id, lease, end, disposition, now)
                    .await
                    .map(|_| ()),
            )
        }
        Op::Lease {
            target, now, max, ..
        } => Answer::Leased(store.lease(target, now, max, LEASE_MS).await),
        Op::Release { key } => Answer::Released(store.release_key(ORDERED, &key).await),
        Op::Redrive { moves, job, now } => {
            let actions = moves
                .iter()
                .map(|&(dlq_id, _)| RedriveAction::Requeue { dlq_id })
                .collect();
            Answer::Redriven(store.redrive_step(job, actions, now).await)
        }
        Op::Purge { dlq_id, .. } => Answer::Purged(store.purge_dlq(vec![dlq_id]).await),
        Op::Sweep { now } => Answer::Swept(
            async {
                for _ in 0..100 {
                    let stats = store.sweep(now, RETENTION_MS, RETENTION_MS).await?;
                    if !stats.more {
                        return Ok(());
                    }
                }
                panic!("the sweep does not finish");
            }
            .await,
        ),
        Op::Replay { seqs, job, now } => {
            let items = seqs
                .iter()
                .map(|&seq| ReplayItem {
                    seq,
                    targets: vec![NewEntry {
                        target_id: REPLAY_TARGET.into(),
                        rule: "r".into(),
                        ordering_key: None,
                        max_depth: None,
                        lease_ms: None,
                        hold_key: false,
                    }],
                })
                .collect();
            Answer::Replayed(store.replay_step(job, items, now).await.map(|s| s.rev))
        }
        Op::PutState { target, state } => Answer::Put(store.put_target_state(target, state).await),
        Op::Save { configs } => Answer::Put(
            store
                .save_targets(
                    configs
                        .into_iter()
                        .map(|(t, c)| (t.to_string(), c))
                        .collect(),
                )
                .await,
        ),
        Op::Remove { target, now, .. } => Answer::Removed(
            store
                .dead_letter_queued(target, DlqReason::TargetRemoved, "target removed", now)
                .await,
        ),
    }
}

/// Applies an operation the store answered (so it is durable) to the model, checking the
/// answer against what the model predicts.
fn apply(model: &mut Model, store: &RedbStore, op: &Op, answer: Answer) {
    match (op, answer) {
        (Op::Accept { events, dup }, Answer::Accepted(r)) => {
            let (outcomes, leased) = r.expect("accept");
            assert_eq!(outcomes.len(), events.len(), "one outcome per event");
            let fresh = events.len() - usize::from(dup.is_some());
            let mut handed: BTreeMap<(usize, u32), Lease> = leased
                .iter()
                .map(|l| ((l.event, l.leased.entry.id.idx), l.leased.lease))
                .collect();
            for (i, (ne, outcome)) in events.iter().zip(&outcomes).enumerate().take(fresh) {
                let AcceptOutcome::Accepted { seq, .. } = *outcome else {
                    panic!("a new event was answered {outcome:?}");
                };
                let mut ev = MEvent::new(ne.event.id.clone(), ne);
                overflow_model(&mut ev, store);
                for e in &mut ev.entries {
                    let asked = ne.targets[e.idx as usize].lease_ms;
                    match (asked, handed.remove(&(i, e.idx))) {
                        (Some(_), Some(l)) => {
                            e.state = MState::Leased(l);
                            e.attempts = 1;
                        }
                        (None, None) => {}
                        (asked, got) => panic!("lease at acceptance: asked {asked:?}, got {got:?}"),
                    }
                }
                let fresh_seq = model.events.insert(seq, ev);
                assert!(fresh_seq.is_none(), "sequence number {seq} given twice");
            }
            assert!(
                handed.is_empty(),
                "leases handed out for no entry: {handed:?}"
            );
            if let Some((_, seq)) = dup {
                assert_eq!(
                    outcomes.last(),
                    Some(&AcceptOutcome::Duplicate { seq: *seq }),
                    "an acknowledged event sent again"
                );
            }
        }
        (Op::Finish { id, how, now, .. }, Answer::Finished(r)) => {
            r.expect("finish under a held lease");
            finish_model(model, store, *id, *how, *now);
        }
        (Op::Lease { expect, .. }, Answer::Leased(r)) => {
            let got = r.expect("lease");
            let ids: Vec<EntryId> = got.iter().map(|l| l.entry.id).collect();
            assert_eq!(&ids, expect, "leased entries");
            for l in got {
                let e = model.entry(l.entry.id);
                e.attempts += 1;
                assert_eq!(
                    l.entry.attempts.len(),
                    e.attempts,
                    "attempt recorded at lease"
                );
                e.state = MState::Leased(l.lease);
            }
        }
        (Op::Release { key }, Answer::Released(r)) => {
            assert!(r.expect("release"), "held key {key} was not held");
            model.held.remove(key);
        }
        (Op::Redrive { moves, job, now }, Answer::Redriven(r)) => {
            let (_, gone) = r.expect("redrive step");
            assert_eq!(
                gone,
                RedriveGone::default(),
                "every redriven entry was in the DLQ"
            );
            redrive_model(model, moves, job, *now);
        }
        (Op::Purge { entry, .. }, Answer::Purged(r)) => {
            assert_eq!(r.expect("purge"), 1, "DLQ entries purged");
            model.entry(*entry).in_dlq = false;
        }
        (Op::Sweep { now }, Answer::Swept(r)) => {
            r.expect("sweep");
            sweep_model(model, *now);
        }
        (Op::Replay { seqs, job, now }, Answer::Replayed(r)) => {
            r.expect("replay step");
            replay_model(model, seqs, job, *now);
        }
        (Op::PutState { target, state }, Answer::Put(r)) => {
            r.expect("put target state");
            model.states.insert(target, state.clone());
        }
        (Op::Save { configs }, Answer::Put(r)) => {
            r.expect("save targets");
            model.saved.extend(configs.iter().cloned());
        }
        (Op::Remove { target, expect, .. }, Answer::Removed(r)) => {
            assert_eq!(
                r.expect("remove"),
                *expect,
                "waiting entries of {target} moved"
            );
            remove_model(model, target);
        }
        (op, answer) => panic!("answer {answer:?} to {op:?}"),
    }
}

fn redrive_model(model: &mut Model, moves: &[(u64, EntryId)], job: &Job, now: Millis) {
    for &(_, id) in moves {
        let e = model.entry(id);
        let key = e.key.clone().filter(|_| e.target == ORDERED);
        e.state = MState::Queued;
        e.in_dlq = false;
        e.attempts = 0;
        e.due = now;
        e.redrives += 1;
        // A redrive releases its key if this dead letter holds it, or if the holder has
        // left the DLQ (redriven earlier, in this step too, or purged); a redrive of an older
        // dead letter of the key leaves the hold of a later one.
        if let Some(k) = key
            && let Some(&holder) = model.held.get(&k)
            && (holder == id || !model.entry(holder).in_dlq)
        {
            model.held.remove(&k);
        }
    }
    model.job_moved = Some(job.moved);
}

/// Which of a new event's entries its queue's cap refused: the store says (which of several
/// accepts in one round got the last places depends on their commit order). Each refused one
/// is a DLQ entry `target_overflow` instead, in the same commit.
fn overflow_model(ev: &mut MEvent, store: &RedbStore) {
    if !ev.entries.iter().any(|e| e.target == CAPPED) {
        return;
    }
    let fate = store.fate(SOURCE, &ev.id).expect("fate").expect("accepted");
    let refused =
        |e: &MEntry| e.target == CAPPED && !fate.entries.iter().any(|s| s.id.idx == e.idx);
    let n = ev.entries.iter().filter(|e| refused(e)).count();
    ev.entries.retain(|e| !refused(e));
    let overflow = fate
        .dlq
        .iter()
        .filter(|d| d.reason == DlqReason::TargetOverflow);
    assert_eq!(
        overflow.count(),
        n,
        "entries refused by the cap of {CAPPED} and their DLQ entries"
    );
    ev.overflowed = n;
}

fn replay_model(model: &mut Model, seqs: &[u64], job: &Job, now: Millis) {
    for seq in seqs {
        let ev = model.events.get_mut(seq).expect("replayed event");
        // After the highest entry there is (as the store numbers them).
        let idx = ev.entries.iter().map(|e| e.idx + 1).max().unwrap_or(0);
        ev.entries.push(MEntry {
            idx,
            target: REPLAY_TARGET,
            key: None,
            state: MState::Queued,
            attempts: 0,
            due: now,
            in_dlq: false,
            redrives: 0,
            replay: true,
        });
    }
    model.replayed = Some(job.moved);
}

/// The waiting (queued, not leased) entries of `target`.
fn waiting(model: &Model, target: &str) -> Vec<EntryId> {
    let mut out = Vec::new();
    for (&seq, ev) in &model.events {
        for e in &ev.entries {
            if e.target == target && e.state == MState::Queued {
                out.push(entry_id(seq, e.idx));
            }
        }
    }
    out
}

fn remove_model(model: &mut Model, target: &str) {
    for id in waiting(model, target) {
        let e = model.entry(id);
        e.state = MState::Dead;
        e.in_dlq = true;
    }
}

/// Outbox key-value writes a sweep at `now` removes: those expired before it.
fn kv_expired(model: &Model, now: Millis) -> Vec<EntryId> {
    let expired = |id: &&EntryId| model.outboxes[*id].0.is_some_and(|e| e < now);
    model.kv_stored.iter().filter(expired).copied().collect()
}

fn sweep_model(model: &mut Model, now: Millis) {
    model.swept_before = model.swept_before.max(now - RETENTION_MS);
    for id in kv_expired(model, now) {
        model.kv_stored.remove(&id);
    }
    let gone: Vec<u64> = model
        .events
        .iter()
        .filter(|(_, ev)| ev.sweepable(now))
        .map(|(&seq, _)| seq)
        .collect();
    for seq in gone {
        let ev = model.events.remove(&seq).expect("listed");
        model.swept.push(ev.id);
    }
}

fn finish_model(model: &mut Model, store: &RedbStore, id: EntryId, how: How, now: Millis) {
    if let How::Delivered(Some(n)) = how {
        model.outboxes.insert(id, outbox_expiry(n, now));
        model.kv_stored.insert(id);
        // The emitted events were accepted in the ack's commit; their sequence numbers are
        // the store's to give.
        for k in 0..n {
            let eid = emitted_id(id, k);
            let fate = store
                .fate(SOURCE, &eid)
                .expect("fate")
                .unwrap_or_else(|| panic!("event {eid} emitted by the ack of {id} is missing"));
            let ne = new_event(&eid, 1, None, false, now);
            assert!(
                model
                    .events
                    .insert(fate.event.seq, MEvent::new(eid, &ne))
                    .is_none()
            );
        }
    }
    let e = model.entry(id);
    match how {
        How::Delivered(_) => e.state = MState::Delivered,
        How::Retry(d) => {
            e.state = MState::Queued;
            e.due = now + d;
        }
        How::Release(d) => {
            e.state = MState::Queued;
            e.due = now + d;
            e.attempts -= 1;
        }
        How::DeadLetter { hold } => {
            e.state = MState::Dead;
            e.in_dlq = true;
            let key = e.key.clone();
            if hold && let Some(k) = key {
                model.held.insert(k, id);
            }
        }
    }
}

/// After a power cut with `op` in flight and its answer unknown: the reopened store shows
/// whether it was applied; either way all of it or none of it. The model follows.
async fn resolve(model: &mut Model, store: &Arc<RedbStore>, op: &Op) {
    match op {
        Op::Accept { events, .. } => {
            let fresh: Vec<&NewEvent> = events
                .iter()
                .filter(|ne| !model.events.values().any(|e| e.id == ne.event.id))
                .collect();
            let fates: Vec<Option<Fate>> = fresh
                .iter()
                .map(|ne| store.fate(SOURCE, &ne.event.id).expect("fate"))
                .collect();
            let stored: Vec<bool> = fates.iter().map(Option::is_some).collect();
            if all_or_none(&stored, "an accept") {
                for (ne, fate) in fresh.iter().zip(fates) {
                    let fate = fate.expect("checked");
                    let mut ev = MEvent::new(ne.event.id.clone(), ne);
                    overflow_model(&mut ev, store);
                    for e in &mut ev.entries {
                        // A lease taken at acceptance was reclaimed, its attempt counted.
                        e.attempts = usize::from(ne.targets[e.idx as usize].lease_ms.is_some());
                    }
                    model.events.insert(fate.event.seq, ev);
                }
            } else {
                // Not stored, and neither are its dedup keys: sent again, it is accepted.
                let again: Vec<NewEvent> = fresh
                    .iter()
                    .map(|ne| {
                        let mut ne = (*ne).clone();
                        for t in &mut ne.targets {
                            t.lease_ms = None;
                        }
                        ne
                    })
                    .collect();
                let op = Op::Accept {
                    events: again,
                    dup: None,
                };
                let answer = run(store.clone(), op.clone()).await;
                apply(model, store, &op, answer);
            }
        }
        Op::Finish { id, how, now, .. } => {
            let e = model.entry(*id).clone();
            let seen = observe(model, store, *id);
            let applied = match how {
                How::Delivered(_) => seen.state == EntryState::Delivered,
                How::DeadLetter { .. } => seen.state == EntryState::Dead,
                How::Retry(d) | How::Release(d) => seen.due_at == now + d,
            };
            if applied {
                finish_model(model, store, *id, *how, *now);
            } else {
                assert_eq!(seen.state, EntryState::Queued, "finish half applied");
                assert_eq!(seen.due_at, e.due, "finish half applied");
                if let How::Delivered(Some(n)) = how {
                    for k in 0..*n {
                        let eid = emitted_id(*id, k);
                        let fate = store.fate(SOURCE, &eid).expect("fate");
                        assert!(fate.is_none(), "{eid} emitted by an ack that is not there");
                    }
                }
            }
        }
        Op::Lease { expect, .. } => {
            let counts: Vec<(usize, usize)> = expect
                .iter()
                .map(|&id| {
                    let seen = observe(model, store, id).attempts.len();
                    (model.entry(id).attempts, seen)
                })
                .collect();
            let taken = counts.iter().all(|&(m, s)| s == m + 1);
            let not_taken = counts.iter().all(|&(m, s)| s == m);
            assert!(
                taken || not_taken,
                "a lease cut in flight took some of its entries: (model, seen) {counts:?}"
            );
            if taken {
                for &id in expect {
                    model.entry(id).attempts += 1;
                }
            }
        }
        Op::Release { key } => {
            if !store.held_keys(ORDERED).contains(key) {
                model.held.remove(key);
            }
        }
        Op::Redrive { moves, job, now } => {
            let back: Vec<bool> = moves
                .iter()
                .map(|&(_, id)| observe(model, store, id).state == EntryState::Queued)
                .collect();
            let progress = job_progress(store, JOB);
            if all_or_none(&back, "a redrive step") {
                assert_eq!(
                    progress,
                    Some(job.moved),
                    "redrive moved entries, job progress not"
                );
                redrive_model(model, moves, job, *now);
            } else {
                assert_eq!(progress, model.job_moved, "job progress without its moves");
            }
        }
        Op::Purge { dlq_id, entry } => {
            let ev = &model.events[&entry.event];
            let fate = store.fate(SOURCE, &ev.id).expect("fate").expect("known");
            if !fate.dlq.iter().any(|d| d.id == *dlq_id) {
                model.entry(*entry).in_dlq = false;
            }
        }
        Op::Replay { seqs, job, now } => {
            let added: Vec<bool> = seqs
                .iter()
                .map(|seq| {
                    let ev = &model.events[seq];
                    let fate = store.fate(SOURCE, &ev.id).expect("fate").expect("known");
                    fate.entries.len() > ev.entries.len()
                })
                .collect();
            let progress = job_progress(store, REPLAY_JOB);
            if all_or_none(&added, "a replay step") {
                assert_eq!(progress, Some(job.moved), "replayed, job progress not");
                replay_model(model, seqs, job, *now);
            } else {
                assert_eq!(
                    progress, model.replayed,
                    "job progress without its deliveries"
                );
            }
        }
        Op::PutState { target, state } => {
            let seen = stored_map(store.target_states())[*target].clone();
            if seen == *state {
                model.states.insert(target, state.clone());
            } else {
                let old = model.states.get(target).cloned().unwrap_or_default();
                assert_eq!(
                    seen, old,
                    "state of {target}: neither the old one nor the new one"
                );
            }
        }
        Op::Save { configs } => {
            let seen = stored_map(store.saved_targets());
            let new: Vec<bool> = configs.iter().map(|(t, c)| seen[*t] == *c).collect();
            if all_or_none(&new, "a save") {
                model.saved.extend(configs.iter().cloned());
            }
        }
        Op::Remove { target, .. } => {
            let ids = waiting(model, target);
            let dead: Vec<bool> = ids
                .iter()
                .map(|&id| observe(model, store, id).state == EntryState::Dead)
                .collect();
            if all_or_none(&dead, "a target removal") {
                remove_model(model, target);
            }
        }
        Op::Sweep { now } => {
            model.swept_before = model.swept_before.max(*now - RETENTION_MS);
            let gone: Vec<u64> = model
                .events
                .iter()
                .filter(|(_, ev)| {
                    ev.sweepable(*now) && store.fate(SOURCE, &ev.id).expect("fate").is_none()
                })
                .map(|(&seq, _)| seq)
                .collect();
            for seq in gone {
                let ev = model.events.remove(&seq).expect("listed");
                model.swept.push(ev.id);
            }
            // Expired key-value writes go in one of the sweep's commits: all or none.
            let expired = kv_expired(model, *now);
            let keys = store.kv_usage_of(HANDLER).expect("usage").keys;
            let before = model.kv_stored.len() as u64;
            if keys + expired.len() as u64 == before {
                for id in expired {
                    model.kv_stored.remove(&id);
                }
            } else {
                assert_eq!(
                    keys, before,
                    "a sweep cut in flight removed some expired keys"
                );
            }
        }
    }
}

/// Each target's value by `get`, null where it has none.
fn by_target(
    get: impl Fn(&str) -> Option<serde_json::Value>,
) -> BTreeMap<&'static str, serde_json::Value> {
    TARGETS
        .iter()
        .map(|&t| (t, get(t).unwrap_or(serde_json::Value::Null)))
        .collect()
}

/// The targets' rows of a name → JSON table as read (other rows, such as the disk-failure
/// step's probe, are left out).
fn stored_map(
    rows: Result<Vec<(String, serde_json::Value)>, StoreError>,
) -> BTreeMap<&'static str, serde_json::Value> {
    let rows: BTreeMap<String, serde_json::Value> = rows.expect("read").into_iter().collect();
    by_target(|t| rows.get(t).cloned())
}

/// A running redrive job `id` that has moved `moved` items, at the revision `store` holds it.
fn job(store: &RedbStore, id: &str, moved: u64, now: Millis) -> Job {
    let rev = store
        .jobs()
        .expect("jobs")
        .into_iter()
        .find(|j| j.id == id)
        .map_or(0, |j| j.rev);
    Job {
        id: id.into(),
        kind: JobKind::Redrive,
        state: JobState::Running,
        spec: json!({}),
        total: moved,
        moved,
        failed: 0,
        skipped: 0,
        skipped_emitted: 0,
        skipped_contract: 0,
        skipped_restricted: 0,
        expired: 0,
        warnings: Vec::new(),
        last_item_at: None,
        cursor: 0,
        created_at: now,
        updated_at: now,
        last_error: None,
        runner: None,
        heartbeat_at: 0,
        rev,
    }
}

/// Job `id`'s `moved` as stored (`None`: no such job).
fn job_progress(store: &RedbStore, id: &str) -> Option<u64> {
    let jobs = store.jobs().expect("jobs");
    jobs.into_iter().find(|j| j.id == id).map(|j| j.moved)
}

/// Whether an operation whose answer is unknown was applied, from one flag per part of it
/// (each part seen applied or not): all of them, or none; never some (`what` names it).
fn all_or_none(parts: &[bool], what: &str) -> bool {
    let all = parts.iter().all(|&p| p);
    assert!(
        all || parts.iter().all(|&p| !p),
        "{what} cut in flight is half there: {parts:?}"
    );
    all
}

/// The id of entry `id`'s DLQ entry.
fn dlq_id(model: &Model, store: &RedbStore, id: EntryId) -> u64 {
    let ev = &model.events[&id.event];
    let fate = store.fate(SOURCE, &ev.id).expect("fate").expect("known");
    fate.dlq
        .iter()
        .find(|d| d.entry == Some(id))
        .unwrap_or_else(|| panic!("DLQ entry of {id} missing"))
        .id
}

/// The stored entry `id`.
fn observe(model: &Model, store: &RedbStore, id: EntryId) -> QueueEntry {
    let ev = &model.events[&id.event];
    let fate = store
        .fate(SOURCE, &ev.id)
        .expect("fate")
        .unwrap_or_else(|| panic!("event {} lost", ev.id));
    fate.entries
        .into_iter()
        .find(|e| e.id == id)
        .unwrap_or_else(|| panic!("entry {id} lost"))
}

/// The store holds exactly what the model says.
fn check(model: &Model, store: &RedbStore) {
    let mut stats: BTreeMap<&str, QueueStats> = BTreeMap::new();
    let mut next_due: BTreeMap<&str, Millis> = BTreeMap::new();
    // The first live (queued or leased) entry of each ordering key: the only one of its key
    // that may go, so the only one whose due time counts for the next due time.
    let mut first_of_key: BTreeMap<(&str, &str), (u64, u32)> = BTreeMap::new();
    // Keys with an entry in flight: a redriven dead letter that comes first in its key waits
    // for it to land (two entries of a key are never in flight together).
    let mut flying: BTreeSet<(&str, &str)> = BTreeSet::new();
    for (&seq, ev) in &model.events {
        for m in &ev.entries {
            if let (Some(k), MState::Queued | MState::Leased(_)) = (&m.key, &m.state) {
                let first = first_of_key
                    .entry((m.target, k.as_str()))
                    .or_insert((seq, m.idx));
                *first = (*first).min((seq, m.idx));
                if matches!(m.state, MState::Leased(_)) {
                    flying.insert((m.target, k.as_str()));
                }
            }
        }
    }
    for (&seq, ev) in &model.events {
        let fate = store
            .fate(SOURCE, &ev.id)
            .expect("fate")
            .unwrap_or_else(|| panic!("acknowledged event {} (seq {seq}) lost", ev.id));
        assert_eq!(fate.event.seq, seq, "event {}", ev.id);
        assert_eq!(fate.entries.len(), ev.entries.len(), "entries of {}", ev.id);
        let dead = ev.entries.iter().filter(|e| e.in_dlq).count()
            + usize::from(ev.quarantined)
            + ev.overflowed;
        assert_eq!(fate.dlq.len(), dead, "DLQ entries of {}", ev.id);
        assert_eq!(
            fate.event.quarantined, ev.quarantined,
            "{} quarantined",
            ev.id
        );
        let overflow = fate
            .dlq
            .iter()
            .filter(|d| d.reason == DlqReason::TargetOverflow);
        assert_eq!(
            overflow.count(),
            ev.overflowed,
            "overflow DLQ entries of {}",
            ev.id
        );
        stats.entry(CAPPED).or_default().dlq += ev.overflowed as u64;
        for m in &ev.entries {
            let at = format!("entry {seq}.{} of {}", m.idx, ev.id);
            let s = fate
                .entries
                .iter()
                .find(|s| s.id.idx == m.idx)
                .unwrap_or_else(|| panic!("{at} lost"));
            assert_eq!(s.target_id, m.target, "{at}");
            assert_eq!(s.ordering_key, m.key, "{at}");
            assert_eq!(s.attempts.len(), m.attempts, "attempts of {at}");
            assert_eq!(s.redrive_count, m.redrives, "redrives of {at}");
            assert_eq!(s.replay.is_some(), m.replay, "replay marker of {at}");
            let st = stats.entry(m.target).or_default();
            st.dlq += u64::from(m.in_dlq);
            match m.state {
                MState::Queued => {
                    assert_eq!((s.state, s.lease), (EntryState::Queued, None), "{at}");
                    assert_eq!(s.due_at, m.due, "due time of {at}");
                    st.queued += 1;
                    let may_go = m.key.as_deref().is_none_or(|k| {
                        !model.held.contains_key(k)
                            && !flying.contains(&(m.target, k))
                            && first_of_key.get(&(m.target, k)) == Some(&(seq, m.idx))
                    });
                    if may_go {
                        let d = next_due.entry(m.target).or_insert(m.due);
                        *d = (*d).min(m.due);
                    }
                }
                MState::Leased(l) => {
                    assert_eq!((s.state, s.lease), (EntryState::Queued, Some(l)), "{at}");
                    st.in_flight += 1;
                }
                MState::Delivered => assert_eq!(s.state, EntryState::Delivered, "{at}"),
                MState::Dead => assert_eq!(s.state, EntryState::Dead, "{at}"),
            }
        }
    }
    let seen = store.queue_stats();
    for t in TARGETS {
        let want = stats.get(t).cloned().unwrap_or_default();
        let got = seen.get(t).cloned().unwrap_or_default();
        assert_eq!(
            (got.queued, got.in_flight, got.dlq),
            (want.queued, want.in_flight, want.dlq),
            "queue numbers of {t} (queued, in flight, DLQ)"
        );
        assert_eq!(
            store.next_due(t),
            next_due.get(t).copied(),
            "next due of {t}"
        );
    }
    let held: BTreeSet<String> = store.held_keys(ORDERED).into_iter().collect();
    let want: BTreeSet<String> = model.held.keys().cloned().collect();
    assert_eq!(held, want, "held keys");
    for id in &model.swept {
        assert!(
            store.fate(SOURCE, id).expect("fate").is_none(),
            "swept {id} is back"
        );
    }
    let counts = store.record_counts().expect("counts");
    assert_eq!(counts.events, model.events.len() as u64, "events stored");
    assert_eq!(
        job_progress(store, JOB),
        model.job_moved,
        "the redrive job's progress"
    );
    assert_eq!(
        stored_map(store.target_states()),
        by_target(|t| model.states.get(t).cloned()),
        "target states"
    );
    assert_eq!(
        stored_map(store.saved_targets()),
        by_target(|t| model.saved.get(t).cloned()),
        "saved targets"
    );
    assert_eq!(
        job_progress(store, REPLAY_JOB),
        model.replayed,
        "the replay job's progress"
    );
    // Every outbox is there with its ack, and none without one.
    for (&seq, ev) in &model.events {
        for e in &ev.entries {
            let id = entry_id(seq, e.idx);
            let key = outbox_key(id);
            let (now, written) = (model.now, model.outboxes.get(&id));
            let kv = store.kv_get(HANDLER, &key, now).expect("kv");
            let visible = written.is_some_and(|(kv, _)| kv.is_none_or(|e| e > now));
            let want = visible.then(|| id.to_string().into_bytes());
            assert_eq!(kv, want, "key-value write of the ack of {id}");
            let done = store.completed_get(HANDLER, &key, now).expect("completed");
            let visible = written.is_some_and(|&(_, c)| c > now);
            assert_eq!(
                done.is_some(),
                visible,
                "COMPLETED record of the ack of {id}"
            );
        }
    }
    let kv_keys = store.kv_usage_of(HANDLER).expect("usage").keys;
    assert_eq!(kv_keys, model.kv_stored.len() as u64, "key-value keys");
}

/// Every acknowledged event that no sweep has passed, sent again, is a duplicate of its
/// first copy.
async fn check_dedup(model: &Model, store: &RedbStore) {
    let unswept: Vec<(u64, &MEvent)> = model
        .events
        .iter()
        .filter(|(_, e)| e.accepted_at >= model.swept_before)
        .map(|(&seq, e)| (seq, e))
        .collect();
    if unswept.is_empty() {
        return;
    }
    let again = unswept
        .iter()
        .map(|(_, e)| {
            if e.quarantined {
                poison_event(&e.id, 0)
            } else {
                new_event(&e.id, 1, None, false, 0)
            }
        })
        .collect();
    let outcomes = store.accept(again).await.expect("accept duplicates");
    let want: Vec<AcceptOutcome> = unswept
        .iter()
        .map(|&(seq, _)| AcceptOutcome::Duplicate { seq })
        .collect();
    assert_eq!(outcomes, want, "acknowledged events sent again");
}

// ---------------------------------------------------------------------------------------------
// A case

struct Disks {
    db: SimulatedDisk,
    log: LogDisks,
}

fn options(mode: Mode) -> StoreOptions {
    StoreOptions {
        group_log: matches!(mode, Mode::Logged(_)),
        checkpoint_every: match mode {
            Mode::Logged(ms) => Some(Duration::from_millis(ms)),
            Mode::Synced | Mode::SyncedFloorEveryGroup => None,
        },
        floor_every: matches!(mode, Mode::SyncedFloorEveryGroup).then_some(Duration::ZERO),
        // Runs of dedup keys are written every few accepts, so cuts fall between them too.
        dedup_memtable_keys: Some(5),
        ..StoreOptions::default()
    }
}

fn open(disks: &Disks, mode: Mode) -> Arc<RedbStore> {
    let db = disks.db.clone();
    match mode {
        Mode::Synced | Mode::SyncedFloorEveryGroup => {
            RedbStore::with_backend_factory(move || db.backend(), options(mode))
        }
        Mode::Logged(_) => {
            RedbStore::with_backends(move || db.backend(), disks.log.backends(), options(mode))
        }
    }
    .expect("open")
}

/// What a power cut of both disks leaves. The log first: a checkpoint between the two images
/// then puts everything the log image holds into the store file's image as well (taken the
/// other way round, the log might already have been started over).
fn cut(disks: &Disks) -> Disks {
    let log = LogDisks::from_images(disks.log.power_cut());
    let db = SimulatedDisk::from_image(disks.db.power_cut());
    Disks { db, log }
}

/// Reopens on what a cut left; the model's leases are reclaimed. Workers of the dead process
/// are then fenced: finishing under their leases changes nothing.
async fn restart(
    model: &mut Model,
    disks: &Disks,
    mode: Mode,
    unknown: &[Op],
    now: Millis,
) -> Arc<RedbStore> {
    let store = open(disks, mode);
    for op in unknown {
        resolve(model, &store, op).await;
    }
    let stale = model.leased();
    model.reclaim();
    check(model, &store);
    fence_stale(model, &store, stale, now).await;
    check_dedup(model, &store).await;
    store
}

/// Finishing under leases the store no longer holds is refused and changes nothing.
async fn fence_stale(model: &Model, store: &RedbStore, stale: Vec<(EntryId, Lease)>, now: Millis) {
    for (id, lease) in stale {
        let r = store
            .finish(id, lease, delivered(now), Disposition::Delivered, now)
            .await;
        assert!(
            matches!(r, Err(FinishError::Fenced)),
            "a finish under a lease of the dead process: {r:?}"
        );
    }
    check(model, store);
}

/// Runs `ops` concurrently and cuts the power `wait_us` µs after they start, whatever is still
/// in flight; restarts on what the cut left.
async fn run_and_cut(
    model: &mut Model,
    store: Arc<RedbStore>,
    disks: &Disks,
    mode: Mode,
    ops: Vec<Op>,
    wait_us: u64,
    now: Millis,
) -> (Arc<RedbStore>, Disks) {
    let tasks: Vec<_> = ops
        .iter()
        .map(|op| tokio::spawn(run(store.clone(), op.clone())))
        .collect();
    // Blocking on purpose: the operations run on the runtime's workers meanwhile.
    std::thread::sleep(Duration::from_micros(wait_us));
    // Answered before the cut: durable. The others may or may not be.
    let answered: Vec<bool> = tasks.iter().map(|t| t.is_finished()).collect();
    let left = cut(disks);
    let mut unknown = Vec::new();
    for ((op, task), answered) in ops.into_iter().zip(tasks).zip(answered) {
        let answer = task.await.expect("operation task");
        if answered {
            apply(model, &store, &op, answer);
        } else {
            unknown.push(op);
        }
    }
    drop(store);
    let store = restart(model, &left, mode, &unknown, now).await;
    (store, left)
}

/// Runs `ops` concurrently; `wait_us` µs after they start both disks fail every write until
/// all are answered, then heal. Errors are not acknowledgements: those operations are resolved
/// by looking, once the store (which reopens itself after a write error) reads again. A
/// reopen rebuilds the queues from what is on disk, as a restart does: leases are reclaimed.
async fn run_with_disk_failure(
    model: &mut Model,
    store: &Arc<RedbStore>,
    disks: &Disks,
    ops: Vec<Op>,
    wait_us: u64,
    now: Millis,
) {
    let tasks: Vec<_> = ops
        .iter()
        .map(|op| tokio::spawn(run(store.clone(), op.clone())))
        .collect();
    std::thread::sleep(Duration::from_micros(wait_us));
    disks.db.set_failing(true);
    disks.log.set_failing(true);
    let (mut answered, mut unknown) = (Vec::new(), Vec::new());
    for (op, task) in ops.into_iter().zip(tasks) {
        let answer = task.await.expect("operation task");
        let failed = match &answer {
            Answer::Accepted(r) => r.is_err(),
            Answer::Finished(r) => r.is_err(),
            Answer::Leased(r) => r.is_err(),
            Answer::Released(r) => r.is_err(),
            Answer::Redriven(r) => r.is_err(),
            Answer::Purged(r) => r.is_err(),
            Answer::Swept(r) => r.is_err(),
            Answer::Replayed(r) => r.is_err(),
            Answer::Removed(r) => r.is_err(),
            Answer::Put(r) => r.is_err(),
        };
        if failed {
            unknown.push(op);
        } else {
            answered.push((op, answer));
        }
    }
    disks.db.set_failing(false);
    disks.log.set_failing(false);
    // A write goes through once the store has reopened (a group after a write error reopens
    // first); from then on what it shows is what is on disk.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while store.put_target_state("probe", json!({})).await.is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the store does not write again 20 s after the disk healed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Applied only now: applying a finish reads its emitted events, and reads are refused
    // while the failure is pending.
    for (op, answer) in answered {
        apply(model, store, &op, answer);
    }
    for op in &unknown {
        resolve(model, store, op).await;
    }
    // Leases are all gone (the store reopened) or all held (it did not: no write failed).
    let leased = model.leased();
    let kept: Vec<bool> = leased
        .iter()
        .map(|&(id, _)| observe(model, store, id).lease.is_some())
        .collect();
    if !kept.iter().all(|&k| k) {
        assert!(
            kept.iter().all(|&k| !k),
            "a reopen reclaimed some leases and not others: {kept:?}"
        );
        model.reclaim();
        check(model, store);
        fence_stale(model, store, leased, now).await;
    }
    check(model, store);
    check_dedup(model, store).await;
}

async fn run_case(mode: Mode, steps: Vec<Step>) {
    let mut disks = Disks {
        db: SimulatedDisk::new(),
        log: LogDisks::new(),
    };
    let mut store = open(&disks, mode);
    let mut model = Model::default();
    let mut now: Millis = 1_000_000;
    for step in steps {
        let (ops, wait_us) = match step {
            Step::Cut => {
                let left = cut(&disks);
                drop(store);
                disks = left;
                store = restart(&mut model, &disks, mode, &[], now).await;
                continue;
            }
            Step::Round(r) => {
                now += r.advance;
                model.now = now;
                (plan(&mut model, &store, &r, now), None)
            }
            Step::CutDuring(r, wait_us) => {
                now += r.advance;
                model.now = now;
                (plan(&mut model, &store, &r, now), Some(wait_us))
            }
            Step::Sweep(advance, wait_us) => {
                now += advance;
                model.now = now;
                (vec![Op::Sweep { now }], wait_us)
            }
            Step::Remove(t, wait_us) => {
                now += 10;
                model.now = now;
                let target = TARGETS[t];
                let expect = waiting(&model, target).len();
                (
                    vec![Op::Remove {
                        target,
                        now,
                        expect,
                    }],
                    wait_us,
                )
            }
            Step::DiskFail(r, wait_us) => {
                now += r.advance;
                model.now = now;
                // No leases in this round: one answered after the store reopened would hold
                // entries that a reopen before it reclaimed (the model plans from before).
                let mut ops = plan(&mut model, &store, &r, now);
                ops.retain(|op| !matches!(op, Op::Lease { .. }));
                for op in &mut ops {
                    if let Op::Accept { events, .. } = op {
                        for t in events.iter_mut().flat_map(|e| e.targets.iter_mut()) {
                            t.lease_ms = None;
                        }
                    }
                }
                run_with_disk_failure(&mut model, &store, &disks, ops, wait_us, now).await;
                continue;
            }
        };
        match wait_us {
            None => {
                let (live, asked) = (model.live(CAPPED), capped_requests(&ops));
                let answers =
                    futures::future::join_all(ops.iter().map(|op| run(store.clone(), op.clone())))
                        .await;
                for (op, answer) in ops.iter().zip(answers) {
                    apply(&mut model, &store, op, answer);
                }
                if asked > 0 {
                    let admitted = model.live(CAPPED) - live;
                    let room = CAP.saturating_sub(live);
                    assert_eq!(
                        admitted,
                        asked.min(room),
                        "entries the cap of {CAPPED} let in"
                    );
                }
                check(&model, &store);
            }
            Some(wait_us) => {
                (store, disks) =
                    run_and_cut(&mut model, store, &disks, mode, ops, wait_us, now).await;
            }
        }
    }
    check(&model, &store);
    check_dedup(&model, &store).await;
}

proptest! {
    // 48 cases take about 3 s here; `PROPTEST_CASES=5000` searches longer.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(48),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn power_cuts_lose_nothing_acknowledged_and_half_apply_nothing(
        mode in mode(),
        steps in prop::collection::vec(step(), 5..40),
    ) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(run_case(mode, steps));
    }
}
