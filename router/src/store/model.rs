//! The records the store keeps: events (stored once), queue entries that refer to them, DLQ
//! entries, and the requests and answers of the store's write operations.
//!
//! Every record is serialised as JSON inside the store; the on-disk format carries a version
//! (`FORMAT_VERSION`) checked at open.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::event::{CloudEvent, FieldError};

/// Version of the on-disk record layout. Bumped on any incompatible change; a store written
/// with a version this build cannot read is refused at open with a clear message instead of
/// being misread.
///
/// - 1: first layout.
/// - 2: queue entry records no longer repeat their id, which is the record's key (a build
///   that expects it could not read them). Version 1 stores are read as they are (an id in
///   the record agrees with its key) and marked 2 at open.
/// - 3: the dedup index is run-based (`dedup_log`, `dedup_run_keys`, `dedup_runs`) instead of
///   one `dedup` table; older stores have that table moved into `dedup_log` at open. A build
///   of format 2 refuses a store of format 3 instead of deduplicating against an empty table.
/// - 4: queue entry records are binary (a tag byte and postcard, `redb_store::entry_codec`)
///   instead of JSON. Older records are read as they are and rewritten in the new layout when
///   their entry next changes; a build of format 3 refuses a store of format 4 instead of
///   failing on its first binary record.
/// - 5: an `events` record carries the event's fan-out (`redb_store::event_record`): an entry
///   queued at acceptance has no row in `entries` or `live` until it changes or the entry
///   floor (`meta`'s `entry_floor`) passes its event. A store of format 4 or older gets its
///   floor past its last event at open (all its entries have rows); a build of format 4
///   refuses a store of format 5 instead of missing its queued entries.
/// - 6: the DLQ has an index by target (`dlq_by_target`), kept in the same commits as the DLQ;
///   a store of format 5 or older gets it built at open (as does one whose index does not
///   count as many rows as its DLQ). A build of format 5 refuses a store of format 6 instead
///   of adding dead letters that index would miss.
/// - 7: the dedup keys of events the sweep keeps (`pending_gc`) are in `dedup_kept`, and
///   their runs are dropped without waiting for them; a store of format 6 or older gets them
///   copied out at open. A build of format 6 refuses a store of format 7 instead of keeping
///   events whose fate it could no longer find.
pub const FORMAT_VERSION: u32 = 7;

/// The oldest on-disk layout this build reads (and upgrades in place at open).
pub const OLDEST_READABLE_FORMAT: u32 = 1;

/// Milliseconds since the Unix epoch (UTC). All store times use it.
pub type Millis = i64;

/// Identity of one queue entry: the event's sequence number and the index of the target in the
/// event's fan-out. Shown to users as `"<event>.<idx>"`.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct EntryId {
    /// Sequence number of the stored event.
    pub event: u64,
    /// Position of the target in the event's fan-out.
    pub idx: u32,
}

impl fmt::Display for EntryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.event, self.idx)
    }
}

impl FromStr for EntryId {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        let (a, b) = s.split_once('.').ok_or(())?;
        Ok(Self {
            event: a.parse().map_err(|_| ())?,
            idx: b.parse().map_err(|_| ())?,
        })
    }
}

/// An accepted event as stored: the envelope plus what the router decided at acceptance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredEvent {
    /// Store sequence number (monotonic with acceptance order). It is the record's key, so it
    /// is not repeated in the record (records are encoded before the committer assigns it).
    #[serde(skip)]
    pub seq: u64,
    /// The CloudEvent as accepted.
    pub event: CloudEvent,
    /// When the router accepted it (durably).
    pub accepted_at: Millis,
    /// Version of the rule set that routed it.
    pub ruleset_version: String,
    /// Names of the rules that matched.
    pub matched_rules: Vec<String>,
    /// True when the event went straight to the DLQ (contract violation).
    #[serde(default)]
    pub quarantined: bool,
}

/// The stored form of an event without its sequence number, borrowed from what ingest already
/// holds: encoded by the caller, off the single committer thread. Field names and order match
/// `StoredEvent`, which decodes it.
#[derive(Serialize)]
pub struct StoredEventRef<'a> {
    /// See `StoredEvent::event`.
    pub event: &'a CloudEvent,
    /// See `StoredEvent::accepted_at`.
    pub accepted_at: Millis,
    /// See `StoredEvent::ruleset_version`.
    pub ruleset_version: &'a str,
    /// See `StoredEvent::matched_rules`.
    pub matched_rules: &'a [String],
    /// See `StoredEvent::quarantined`.
    pub quarantined: bool,
}

/// Where a queue entry stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryState {
    /// Waiting in its target's queue (first attempt or a retry), possibly leased.
    Queued,
    /// Delivered successfully; kept for the event's fate until swept.
    Delivered,
    /// Moved to the DLQ; kept for the event's fate until swept.
    Dead,
}

/// How one attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptResult {
    /// The target took it.
    Delivered,
    /// A transient failure: worth retrying.
    Retryable,
    /// A permanent failure: retrying cannot help.
    Permanent,
    /// The process died (or the lease expired) while the attempt was in flight.
    Interrupted,
    /// Given up before it was sent (its attempts or its age used up when leased): no
    /// attempt. Closing an attempt so drops the record its lease wrote, so a dead letter shows
    /// only the attempts really made; never stored.
    NotSent,
}

/// One delivery attempt, recorded durably when it starts and completed when it ends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptRecord {
    /// 1-based attempt number for this entry (since the last redrive).
    pub n: u32,
    /// When the attempt started.
    pub started_at: Millis,
    /// When it ended; `None` while in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Millis>,
    /// How it ended; `None` while in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<AttemptResult>,
    /// HTTP status (webhooks) if a response arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Error text for failed attempts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A lease on a queue entry: the worker holding `token` may finish the entry until `until`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// Fencing token; unique across restarts (boot epoch in the high bits).
    pub token: u64,
    /// Expiry; an ack after it is refused.
    pub until: Millis,
}

/// One target's copy of an event: the unit of delivery.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueueEntry {
    /// Identity. It is the record's key in a store, so it is not repeated inside the record:
    /// whoever decodes a record sets it from the key (records of format 1 still carry it).
    #[serde(default, skip_serializing)]
    pub id: EntryId,
    /// Stable target id (from the rule file).
    pub target_id: String,
    /// Name of the rule that matched.
    pub rule: String,
    /// Current state.
    pub state: EntryState,
    /// Acceptance time of the event (for `max_age` and oldest-age metrics).
    pub accepted_at: Millis,
    /// Earliest time of the next attempt.
    pub due_at: Millis,
    /// Attempts since the last redrive, oldest first.
    #[serde(default)]
    pub attempts: Vec<AttemptRecord>,
    /// Ordering key (per-key in-order delivery when the policy asks for it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ordering_key: Option<String>,
    /// Present while a worker holds the entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<Lease>,
    /// How many times an operator moved it back from the DLQ.
    #[serde(default)]
    pub redrive_count: u32,
    /// Handler hops of the event.
    #[serde(default)]
    pub hops: u32,
    /// Replay job id, when this delivery comes from a replay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<String>,
    /// Stable across retries: what receivers dedupe on.
    pub idempotency_key: String,
    /// When the entry reached a final state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Millis>,
    /// Attempts made before the last redrive (a DLQ entry shows them with the new ones).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<AttemptRecord>,
}

impl QueueEntry {
    /// A new, never attempted entry of `target` for the event stored as `id.event`: accepted
    /// at `accepted_at`, due at `due_at`, keyed for receivers by `idempotency_key`.
    pub fn queued(
        id: EntryId,
        target: NewEntry,
        idempotency_key: String,
        accepted_at: Millis,
        due_at: Millis,
        hops: u32,
    ) -> Self {
        Self {
            id,
            target_id: target.target_id,
            rule: target.rule,
            state: EntryState::Queued,
            accepted_at,
            due_at,
            attempts: Vec::new(),
            ordering_key: target.ordering_key,
            lease: None,
            redrive_count: 0,
            hops,
            replay: None,
            idempotency_key,
            finished_at: None,
            history: Vec::new(),
        }
    }

    /// Moves a dead-lettered entry back to its queue for an operator's redrive at `now`: its
    /// attempts become history (a fresh budget of attempts), it is due at once, and its
    /// `max_age` counts from now (a fix that took longer than `max_age` must still be able to
    /// redrive it; the event keeps its own acceptance time).
    pub fn requeue_for_redrive(&mut self, now: Millis) {
        self.accepted_at = now;
        self.history.append(&mut self.attempts);
        self.state = EntryState::Queued;
        self.lease = None;
        self.finished_at = None;
        self.due_at = now;
        self.redrive_count += 1;
    }

    /// Ends the lease and closes the current attempt with `end` (what a finish records,
    /// whatever comes next for the entry).
    pub fn close_attempt(&mut self, end: &AttemptEnd) {
        self.lease = None;
        if end.result == AttemptResult::NotSent {
            // The record is the lease's, written before anything was sent: kept, it showed as
            // an "interrupted" attempt that never happened (a whole paused queue dead-lettered
            // past max_age had one each).
            self.attempts.pop();
            return;
        }
        if let Some(a) = self.attempts.last_mut() {
            a.finished_at = Some(end.finished_at);
            a.result = Some(end.result);
            a.status = end.status;
            a.error = end.error.clone();
        }
    }

    /// Starts an attempt at `now` under `lease`: what a lease records durably before the
    /// attempt is sent.
    pub fn start_attempt(&mut self, lease: Lease, now: Millis) {
        self.attempts.push(AttemptRecord {
            n: u32::try_from(self.attempts.len() + 1).unwrap_or(u32::MAX),
            started_at: now,
            finished_at: None,
            result: None,
            status: None,
            error: None,
        });
        self.lease = Some(lease);
    }
}

/// Why an event (or one target's copy of it) is in the DLQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DlqReason {
    /// `data` failed its contract.
    ContractViolation,
    /// The type has contracts, but not the event's `dataversion`.
    UnknownVersion,
    /// The target said the failure is permanent (4xx other than 408/429, 3xx).
    PermanentError,
    /// `max_attempts` reached.
    RetriesExhausted,
    /// `max_age` passed before a successful attempt.
    MaxAgeExceeded,
    /// Handler emissions went past the hop limit.
    LoopDetected,
    /// A reload removed the target and the operator chose to dead-letter its queue.
    TargetRemoved,
    /// The target's queue was at its depth cap.
    TargetOverflow,
    /// A handler emitted an event outside its owner's ingest scope.
    ScopeViolation,
    /// Queued for a handler whose name its team (or an administrator) released: another
    /// team may claim the name, and a delivery queued for the old handler must not run on its
    /// code. A redrive sends it to whatever handler has the name then, deliberately.
    HandlerReleased,
    /// The event's stored record could not be read (it does not decode, or it is missing):
    /// set aside when a lease found it, so the rest of the target's queue goes on. Its
    /// `errors` carry the decoder's message and the event's sequence number; the entry's
    /// event id, source and type are empty (they are in the unreadable record).
    CorruptRecord,
    /// Delivered to a handler whose descriptor does not accept the event's type (or that
    /// type's `dataversion`): a routing mistake or a handler behind its inputs, not a
    /// contract-versioning problem (it used to be filed as `unknown_version`). A redrive sends
    /// it back to that handler, for once it accepts it.
    NotAccepted,
}

impl DlqReason {
    /// The wire name (`snake_case`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ContractViolation => "contract_violation",
            Self::UnknownVersion => "unknown_version",
            Self::PermanentError => "permanent_error",
            Self::RetriesExhausted => "retries_exhausted",
            Self::MaxAgeExceeded => "max_age_exceeded",
            Self::LoopDetected => "loop_detected",
            Self::TargetRemoved => "target_removed",
            Self::TargetOverflow => "target_overflow",
            Self::ScopeViolation => "scope_violation",
            Self::HandlerReleased => "handler_released",
            Self::CorruptRecord => "corrupt_record",
            Self::NotAccepted => "not_accepted",
        }
    }

    /// Every reason, for metrics and parsing.
    pub const ALL: [DlqReason; 12] = [
        Self::ContractViolation,
        Self::UnknownVersion,
        Self::PermanentError,
        Self::RetriesExhausted,
        Self::MaxAgeExceeded,
        Self::LoopDetected,
        Self::TargetRemoved,
        Self::TargetOverflow,
        Self::ScopeViolation,
        Self::HandlerReleased,
        Self::CorruptRecord,
        Self::NotAccepted,
    ];
}

impl FromStr for DlqReason {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        Self::ALL.into_iter().find(|r| r.as_str() == s).ok_or(())
    }
}

/// A dead letter: an event (and, for delivery failures, the target) that needs an operator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DlqEntry {
    /// DLQ entry id (monotonic).
    pub id: u64,
    /// The event's store sequence number (the event itself is stored once).
    pub event_seq: u64,
    /// The event's `id`, `source`, `type` (copied so listings need not read the event).
    pub event_id: String,
    /// See `event_id`.
    pub event_source: String,
    /// See `event_id`.
    pub event_type: String,
    /// The queue entry that failed; `None` for quarantined events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry: Option<EntryId>,
    /// Target id; `None` for quarantined events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_id: Option<String>,
    /// Rule name; `None` for quarantined events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// Reason class.
    pub reason: DlqReason,
    /// Validation errors (quarantine) or a single description of the final error.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<FieldError>,
    /// Every attempt, with its error.
    #[serde(default)]
    pub attempts: Vec<AttemptRecord>,
    /// Number of attempts made.
    pub attempt_count: u32,
    /// Time of the first failure.
    pub first_failure_at: Millis,
    /// Time of the last failure.
    pub last_failure_at: Millis,
    /// Redrives of the entry so far.
    #[serde(default)]
    pub redrive_count: u32,
    /// The replay job whose copy this is (a replayed delivery that failed, or one refused by
    /// its queue's cap): a redrive keeps it a replay, with the replay's idempotency key, not
    /// the original's (receivers that deduplicate on it dropped the redriven copy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<String>,
    /// The entry's ordering key (an ordered target's): under `on_dead_letter: hold` the
    /// newest dead letter of a key holds it, and purging that one releases the key. `None`
    /// also for entries stored before the field existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ordering_key: Option<String>,
    /// Why the last redrive that reached the entry left it here. Kept apart from `errors`: a
    /// refusal written over them lost the failure the operator needs to fix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_redriven: Option<NotRedriven>,
    /// Where the dead letter stands in the order the store made dead letters in (see
    /// [`DlqEntry::made`]), when its id does not say it: on JetStream the stream sequence of
    /// its first record, which a store fills in when it reads the entry and writes into the
    /// record when it rewrites it (the rewrite's own sequence is later). Ids there come from
    /// each node's block of numbers, so across nodes a newer dead letter can have a lower
    /// id. `None` on redb, whose ids follow that order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub made: Option<u64>,
    /// The handler delivery that emitted the event, when the event is a handler's emission
    /// dead-lettered before it reached any target (`loop_detected`, `scope_violation`, a
    /// contract's quarantine): such an entry has no target, so without this only `read`
    /// could list it, and the handler's own team never saw its output pile up here.
    /// `None` for every other entry, and for entries stored before the field existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub emitted_by: Option<EmittedBy>,
}

/// Which handler delivery emitted a dead-lettered event ([`DlqEntry::emitted_by`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmittedBy {
    /// The handler's name: its owning team lists these entries (`GET /v1/dlq?emitted_by=`).
    pub handler: String,
    /// The target whose delivery ran the handler.
    pub target: String,
    /// The id of the event that delivery handled (the handler's log lines carry it).
    pub event_id: String,
}

/// The DLQ as it stood at one moment ([`Store::dlq_mark`](crate::store::Store::dlq_mark)):
/// what a redrive job takes, and nothing made after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DlqMark {
    /// The highest DLQ entry id then (0 when empty): no entry of the mark has a higher one.
    pub max_id: u64,
    /// Every dead letter made by then has [`DlqEntry::made`] at or below this, every one made
    /// after above it.
    pub made: u64,
}

/// A redrive's refusal to move a DLQ entry ([`DlqEntry::not_redriven`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NotRedriven {
    /// The redrive job.
    pub job: String,
    /// When.
    pub at: Millis,
    /// Why (`not redriven: target X is no longer in the rules`, ...).
    pub message: String,
}

impl DlqEntry {
    /// Where the dead letter stands in the order the store made dead letters in, to compare
    /// with a [`DlqMark::made`]: its `made` where the store keeps one, else its id.
    pub fn made(&self) -> u64 {
        self.made.unwrap_or(self.id)
    }

    /// What redrive job `job`'s `Keep` at `at` does to the entry: records why it stays, and
    /// takes a re-check's `errors` in place of its own. The redrive count and the time of the
    /// last failure stay: neither a redrive nor a new failure happened.
    pub fn kept_by_redrive(
        &mut self,
        job: &str,
        at: Millis,
        note: &str,
        errors: Option<&Vec<FieldError>>,
    ) {
        if let Some(errors) = errors {
            self.errors.clone_from(errors);
        }
        self.not_redriven = Some(NotRedriven {
            job: job.to_owned(),
            at,
            message: note.to_owned(),
        });
    }

    /// The DLQ entry of an event stored as `seq` and dead-lettered at its acceptance `at`,
    /// before any attempt: quarantined (no `target`), or one target's copy refused by its
    /// queue's depth cap. `names` are the event's `id`, `source` and `type`. Its `id` is left 0
    /// for the store to assign.
    pub fn at_acceptance(
        seq: u64,
        names: (String, String, String),
        target: Option<&NewEntry>,
        reason: DlqReason,
        errors: Vec<FieldError>,
        at: Millis,
    ) -> Self {
        let (event_id, event_source, event_type) = names;
        Self {
            id: 0,
            event_seq: seq,
            event_id,
            event_source,
            event_type,
            entry: None,
            target_id: target.map(|t| t.target_id.clone()),
            rule: target.map(|t| t.rule.clone()),
            reason,
            errors,
            attempts: Vec::new(),
            attempt_count: 0,
            first_failure_at: at,
            last_failure_at: at,
            redrive_count: 0,
            replay: None,
            ordering_key: target.and_then(|t| t.ordering_key.clone()),
            not_redriven: None,
            made: None,
            emitted_by: None,
        }
    }

    /// The DLQ entry of replay job `job`'s copy of event `seq` for `target`, refused because
    /// the target's queue is at its depth cap `cap`: a `target_overflow` that keeps its job
    /// (a redrive sends it as the replay's copy). Its `id` is left 0 for the store to assign.
    pub fn replay_overflow(
        seq: u64,
        names: (String, String, String),
        target: &NewEntry,
        job: &str,
        cap: u64,
        at: Millis,
    ) -> Self {
        let error = FieldError::new(
            "",
            format!(
                "queue of {} is at its depth cap ({cap}); replayed by {job}",
                target.target_id
            ),
        );
        Self {
            replay: Some(job.to_string()),
            ..Self::at_acceptance(
                seq,
                names,
                Some(target),
                DlqReason::TargetOverflow,
                vec![error],
                at,
            )
        }
    }

    /// The DLQ entry of queue entry `e`, given up with `reason` after the attempt that ended
    /// as `end` (`now`: when, for an entry never attempted). `names` are the event's `id`,
    /// `source` and `type`. Its `id` is left 0 for the store to assign.
    pub fn of_given_up(
        e: &QueueEntry,
        names: (String, String, String),
        reason: DlqReason,
        end: &AttemptEnd,
        now: Millis,
    ) -> Self {
        let (event_id, event_source, event_type) = names;
        // Over the history too: a redriven entry that fails again is the same failure seen
        // since its first attempt, not a new one starting at the redrive.
        let first = e
            .history
            .iter()
            .chain(&e.attempts)
            .find(|a| a.result != Some(AttemptResult::Delivered))
            .map_or(now, |a| a.finished_at.unwrap_or(a.started_at));
        Self {
            id: 0,
            event_seq: e.id.event,
            event_id,
            event_source,
            event_type,
            entry: Some(e.id),
            target_id: Some(e.target_id.clone()),
            rule: Some(e.rule.clone()),
            reason,
            errors: end
                .error
                .iter()
                .map(|m| FieldError::new("", m.clone()))
                .collect(),
            attempts: e.history.iter().chain(&e.attempts).cloned().collect(),
            attempt_count: u32::try_from(e.attempts.len()).unwrap_or(u32::MAX),
            first_failure_at: first,
            last_failure_at: end.finished_at,
            redrive_count: e.redrive_count,
            replay: e.replay.clone(),
            ordering_key: e.ordering_key.clone(),
            not_redriven: None,
            made: None,
            emitted_by: None,
        }
    }
}

/// One target of an event about to be accepted.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEntry {
    /// Target id.
    pub target_id: String,
    /// Rule that matched.
    pub rule: String,
    /// Ordering key, if the target's policy orders.
    pub ordering_key: Option<String>,
    /// Queue-depth cap of the target: at or past it, this entry goes to the DLQ as
    /// `target_overflow` instead (one dead target never makes ingest refuse others' events).
    pub max_depth: Option<u64>,
    /// Lease the entry to the caller at acceptance, for this many ms (`Store::accept_leased`):
    /// its first attempt is recorded as started in the accept's own commit, and the caller,
    /// which holds a free delivery slot of the target, sends it at once — no lease commit, no
    /// read of the event back from the store. `None`: the entry waits in its queue.
    pub lease_ms: Option<i64>,
    /// The target's policy is `on_dead_letter: hold`: when this copy goes to the DLQ at
    /// acceptance (`target_overflow`), its ordering key is held as after any dead letter, so
    /// that later events of the key do not overtake it.
    pub hold_key: bool,
}

/// Contract quarantine of an event about to be accepted.
#[derive(Debug, Clone, PartialEq)]
pub struct Quarantine {
    /// `ContractViolation` or `UnknownVersion`.
    pub reason: DlqReason,
    /// Pointer-level validation errors.
    pub errors: Vec<FieldError>,
    /// Set when the event is a handler's emission: kept on the DLQ entry so that the
    /// handler's team finds it ([`DlqEntry::emitted_by`]).
    pub emitted_by: Option<EmittedBy>,
}

/// An event to accept: stored once with its dedup key and fan-out, atomically.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    /// The envelope.
    pub event: CloudEvent,
    /// Acceptance time.
    pub accepted_at: Millis,
    /// Rule-set version that matched.
    pub ruleset_version: String,
    /// Matched rule names.
    pub matched_rules: Vec<String>,
    /// One entry per target (empty when quarantined or unmatched).
    pub targets: Vec<NewEntry>,
    /// Set when the event goes to the DLQ instead of being routed.
    pub quarantine: Option<Quarantine>,
    /// Dedup window; a key older than this is treated as absent.
    pub dedup_window_ms: i64,
}

/// An entry leased to the caller at acceptance (`NewEntry::lease_ms`), with the index of
/// its event among those accepted together.
#[derive(Debug, Clone)]
pub struct LeasedAtAccept {
    /// Index of the event in the `accept_leased` call.
    pub event: usize,
    /// The lease, as `Store::lease` would have returned it (its `entry.id.idx` is the
    /// target's index in `NewEvent::targets`).
    pub leased: Leased,
}

/// What a committed finish wrote besides moving its own entry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Finished {
    /// Copies of the outbox's emitted events that went to the DLQ as `target_overflow`
    /// because their target's queue was at its depth cap: (index in `Outbox::emitted`,
    /// target id). The caller counts and announces them like any other new dead letter.
    pub overflowed: Vec<(usize, String)>,
    /// The id of the DLQ entry a dead-letter disposition made (its `router.dlq.added` names
    /// it).
    pub dlq_id: Option<u64>,
}

/// Answer to accepting one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AcceptOutcome {
    /// Stored (and fanned out, or quarantined) durably.
    Accepted {
        /// The new sequence number.
        seq: u64,
        /// The targets whose queue was at its depth cap: their copy went to the DLQ as
        /// `target_overflow` instead of their queue.
        overflowed: Vec<String>,
    },
    /// (`source`, `id`) was seen inside the dedup window; nothing stored.
    Duplicate {
        /// Sequence number of the first copy.
        seq: u64,
    },
}

impl AcceptOutcome {
    /// Accepted as `seq`, every target's copy queued.
    pub fn accepted(seq: u64) -> Self {
        Self::Accepted {
            seq,
            overflowed: Vec::new(),
        }
    }
}

/// What to do with a leased entry after an attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Disposition {
    /// Delivered: final.
    Delivered,
    /// Try again no earlier than `due_at`.
    Retry {
        /// Next attempt time.
        due_at: Millis,
    },
    /// Give up: move to the DLQ.
    DeadLetter {
        /// Why.
        reason: DlqReason,
        /// Hold the entry's ordering key until an operator releases it
        /// (`on_dead_letter: hold`); ignored for unkeyed entries.
        hold: bool,
    },
    /// Put back without counting the attempt (e.g. breaker open when checked); the attempt
    /// record is removed.
    Release {
        /// Next attempt time.
        due_at: Millis,
    },
}

/// One handler key-value write, namespaced by handler.
#[derive(Debug, Clone, PartialEq)]
pub struct KvOp {
    /// Handler name.
    pub namespace: String,
    /// Key.
    pub key: String,
    /// New value; `None` deletes.
    pub value: Option<Vec<u8>>,
    /// Absolute expiry.
    pub expires_at: Option<Millis>,
}

/// What a handler invocation produced, committed atomically with the delivery's ack (the
/// outbox): emitted events (accepted with dedup, so a re-run's same ids are not routed twice)
/// and key-value writes, guarded by compare-and-set preconditions.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outbox {
    /// Events to accept (already routed or quarantined).
    pub emitted: Vec<NewEvent>,
    /// Key-value writes.
    pub kv: Vec<KvOp>,
    /// (namespace, key, expected value): each must still hold at commit, or nothing commits.
    pub cas: Vec<(String, String, Option<Vec<u8>>)>,
    /// The handler's COMPLETED record, written with the ack of a successful invocation.
    pub completed: Option<CompletedRecord>,
    /// Bound on the bytes of each namespace these writes touch (keys plus values plus
    /// [`KvUsage::ENTRY_OVERHEAD`] per key, [`KvUsage::entry_bytes`]): a commit
    /// that would grow a namespace past it is refused (`FinishError::KvQuota`) and writes
    /// nothing. Shrinking writes always pass.
    pub kv_max_bytes: Option<u64>,
}

/// What one handler's key-value namespace holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct KvUsage {
    /// Bytes the namespace counts against its bound: keys plus values plus
    /// [`KvUsage::ENTRY_OVERHEAD`] per key.
    pub bytes: u64,
    /// Number of keys.
    pub keys: u64,
}

impl KvUsage {
    /// What each entry counts against its namespace's bound beyond its key and value. An entry
    /// costs the store more than its bytes: its key is stored with the namespace, with the
    /// expiry and length prefixes of the record, in a B-tree leaf that also keeps an offset per
    /// entry and is rarely full (an expiring entry has a second, index, row too). On the
    /// embedded store, 170,000 keys of 6 bytes with empty values (1 MB of keys) grew the file
    /// by 9.5 MB, about 50 bytes per entry beyond its key; 64 rounds that up. Without it a
    /// handler writing tiny keys grew the store by ten times what its bound counted.
    pub const ENTRY_OVERHEAD: u64 = 64;

    /// The bytes of one entry's key and value alone: what the stores keep in their
    /// per-namespace counters (kept as they were before the overhead was counted, so stores
    /// written then need no migration; [`KvUsage::from_counters`] adds it).
    pub fn data_bytes(key: &str, value: &[u8]) -> u64 {
        (key.len() + value.len()) as u64
    }

    /// What one entry counts against its namespace's bound: its key, its value and
    /// [`KvUsage::ENTRY_OVERHEAD`]. The host (checking a write) and the store (checking a
    /// commit) must agree on it.
    pub fn entry_bytes(key: &str, value: &[u8]) -> u64 {
        Self::data_bytes(key, value) + Self::ENTRY_OVERHEAD
    }

    /// A namespace's usage from a store's counters: the bytes of its keys and values
    /// ([`KvUsage::data_bytes`] summed) and its number of keys.
    pub fn from_counters(data_bytes: u64, keys: u64) -> Self {
        Self {
            bytes: data_bytes.saturating_add(keys.saturating_mul(Self::ENTRY_OVERHEAD)),
            keys,
        }
    }
}

/// A handler's COMPLETED mark: its delivery (idempotency key) was handled, with this result.
/// Kept until `expires_at`; a delivery with the same key gets the stored result instead of a
/// second run (the IN_PROGRESS mark is the queue lease itself).
#[derive(Debug, Clone, PartialEq)]
pub struct CompletedRecord {
    /// Handler name.
    pub handler: String,
    /// The delivery's idempotency key.
    pub key: String,
    /// The stored result (JSON: version, emitted event ids).
    pub result: Vec<u8>,
    /// When the record may be swept.
    pub expires_at: Millis,
}

/// The end of one attempt, written together with the disposition.
#[derive(Debug, Clone, PartialEq)]
pub struct AttemptEnd {
    /// When it ended.
    pub finished_at: Millis,
    /// How.
    pub result: AttemptResult,
    /// HTTP status, if any.
    pub status: Option<u16>,
    /// Error text, if any.
    pub error: Option<String>,
    /// Handler effects to commit with this result.
    pub outbox: Option<Box<Outbox>>,
}

/// A leased entry handed to a delivery worker, with its event.
#[derive(Debug, Clone)]
pub struct Leased {
    /// The entry as written at lease time (its last attempt is the one now starting).
    pub entry: QueueEntry,
    /// The stored event.
    pub event: std::sync::Arc<StoredEvent>,
    /// The lease (token + expiry) to present when finishing.
    pub lease: Lease,
}

/// What one lease took: the entries to attempt with their events, and those whose event's
/// record could not be read.
#[derive(Debug, Default)]
pub struct LeaseBatch {
    /// Entries to attempt.
    pub leased: Vec<Leased>,
    /// Entries leased (their attempt started) whose event cannot be read: the caller sets
    /// them aside (`DlqReason::CorruptRecord`) under their lease, so that one bad record does
    /// not stop its target's queue.
    pub unreadable: Vec<Unreadable>,
}

/// A leased entry whose event's record cannot be read ([`LeaseBatch::unreadable`]).
#[derive(Debug, Clone)]
pub struct Unreadable {
    /// The entry as written at lease time.
    pub entry: QueueEntry,
    /// Its lease, to present when finishing it.
    pub lease: Lease,
    /// Why the event could not be read (the entry's id names the event).
    pub error: String,
}

/// Per-target numbers for `/v1/targets` and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct QueueStats {
    /// Entries waiting (due or not), excluding in-flight ones.
    pub queued: u64,
    /// Entries leased by a worker right now.
    pub in_flight: u64,
    /// Acceptance time of the oldest live entry.
    pub oldest_accepted_at: Option<Millis>,
    /// Entries in the DLQ for this target.
    pub dlq: u64,
    /// Waiting entries (of `queued`) that ordering holds back: behind the entry of their key
    /// that goes first, or of a held key.
    pub queued_behind_keys: u64,
}

impl QueueStats {
    /// Entries still to be delivered: queued plus in flight (a target with none has drained).
    pub fn live(&self) -> u64 {
        self.queued + self.in_flight
    }
}

/// The entry of an ordering key that goes first (the one its other entries wait behind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyHead {
    /// The entry.
    pub entry: EntryId,
    /// Whether it is being delivered (leased) now.
    pub in_flight: bool,
}

/// The target filter that selects dead letters without a target (events quarantined at
/// ingest, a handler's emissions refused before any target): the name metrics give them
/// (`target="none"`), so the DLQ an alert names is the one a filter lists. No target may take
/// this id (the rule loader refuses it).
pub const NO_TARGET: &str = "none";

/// Filter for DLQ listings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DlqFilter {
    /// Only this target ([`NO_TARGET`]: only dead letters without one).
    pub target: Option<String>,
    /// Only this reason.
    pub reason: Option<DlqReason>,
    /// Only this rule.
    pub rule: Option<String>,
    /// Only this event type.
    pub event_type: Option<String>,
    /// Only this event source.
    pub source: Option<String>,
    /// Only entries whose last failure is at or after this time.
    pub since: Option<Millis>,
    /// Only entries whose last failure is before this time.
    pub until: Option<Millis>,
    /// Only the emissions of this handler dead-lettered before any target
    /// ([`DlqEntry::emitted_by`]).
    pub emitted_by: Option<String>,
}

impl DlqFilter {
    /// Whether `e` passes the filter.
    pub fn matches(&self, e: &DlqEntry) -> bool {
        self.matches_head(&DlqHead::of(e))
    }

    /// Whether the dead letter whose head is `e` passes the filter (everything the filter
    /// reads is in the head).
    pub fn matches_head(&self, e: &DlqHead<'_>) -> bool {
        self.target.as_ref().is_none_or(|t| match t.as_str() {
            NO_TARGET => e.target_id.is_none(),
            t => e.target_id.as_deref() == Some(t),
        }) && self.reason.is_none_or(|r| e.reason == r)
            && self
                .rule
                .as_ref()
                .is_none_or(|r| e.rule.as_deref() == Some(r.as_str()))
            && self.event_type.as_ref().is_none_or(|t| e.event_type == *t)
            && self.source.as_ref().is_none_or(|s| e.event_source == *s)
            && self.since.is_none_or(|s| e.last_failure_at >= s)
            && self.until.is_none_or(|u| e.last_failure_at < u)
            && self.emitted_by.as_ref().is_none_or(|h| {
                e.emitted_by
                    .as_ref()
                    .is_some_and(|by| by.handler == h.as_str())
            })
    }
}

/// What DLQ filters and the summary read of a dead letter: its [`DlqEntry`] without the
/// event id, the errors and the attempts. A store decodes only this from each record it
/// scans (a `retries_exhausted` entry's attempts are most of its record, and the strings
/// here are borrowed from the record where they need no unescaping), and the whole entry
/// only for the records a filter selects.
#[derive(Debug, Deserialize)]
pub struct DlqHead<'a> {
    /// See [`DlqEntry::event_source`].
    #[serde(borrow)]
    pub event_source: std::borrow::Cow<'a, str>,
    /// See [`DlqEntry::event_type`].
    #[serde(borrow)]
    pub event_type: std::borrow::Cow<'a, str>,
    /// See [`DlqEntry::target_id`].
    #[serde(default, borrow)]
    pub target_id: Option<std::borrow::Cow<'a, str>>,
    /// See [`DlqEntry::rule`].
    #[serde(default, borrow)]
    pub rule: Option<std::borrow::Cow<'a, str>>,
    /// See [`DlqEntry::reason`].
    pub reason: DlqReason,
    /// See [`DlqEntry::first_failure_at`].
    pub first_failure_at: Millis,
    /// See [`DlqEntry::last_failure_at`].
    pub last_failure_at: Millis,
    /// See [`DlqEntry::emitted_by`] (only what a filter reads of it).
    #[serde(default, borrow)]
    pub emitted_by: Option<EmittedByHead<'a>>,
}

/// The part of an [`EmittedBy`] that a [`DlqFilter`] reads, borrowed.
#[derive(Debug, Clone, Deserialize)]
pub struct EmittedByHead<'a> {
    /// See [`EmittedBy::handler`].
    #[serde(borrow)]
    pub handler: std::borrow::Cow<'a, str>,
}

impl<'a> DlqHead<'a> {
    /// The head of `e`, borrowed from it.
    pub fn of(e: &'a DlqEntry) -> Self {
        use std::borrow::Cow::Borrowed;
        Self {
            event_source: Borrowed(&e.event_source),
            event_type: Borrowed(&e.event_type),
            target_id: e.target_id.as_deref().map(Borrowed),
            rule: e.rule.as_deref().map(Borrowed),
            reason: e.reason,
            first_failure_at: e.first_failure_at,
            last_failure_at: e.last_failure_at,
            emitted_by: e.emitted_by.as_ref().map(|by| EmittedByHead {
                handler: Borrowed(&by.handler),
            }),
        }
    }
}

/// Kind of a background job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobKind {
    /// Moves DLQ entries back to their queues.
    Redrive,
    /// Re-routes archived events through the current rules.
    Replay,
}

impl JobKind {
    /// The wire name (`redrive`, `replay`): the prefix of the job's id and its metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Redrive => "redrive",
            Self::Replay => "replay",
        }
    }
}

impl JobState {
    /// Whether the job has ended for good (done or cancelled): nothing will change it again.
    pub fn finished(self) -> bool {
        matches!(self, Self::Done | Self::Cancelled)
    }

    /// The wire name (`running`, ...): its metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Paused => "paused",
            Self::Cancelled => "cancelled",
            Self::Done => "done",
        }
    }
}

/// State of a background job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Making progress.
    Running,
    /// Stopped by an operator; resumable.
    Paused,
    /// Stopped for good by an operator.
    Cancelled,
    /// Finished.
    Done,
}

/// A redrive or replay job: its spec, progress and cursor, persisted with every step so it
/// resumes where it was after a restart and never processes an item twice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Job {
    /// Job id (`redrive-N`, `replay-N`).
    pub id: String,
    /// Kind.
    pub kind: JobKind,
    /// State.
    pub state: JobState,
    /// The request that created it (filter, rate, time range...), as given.
    pub spec: serde_json::Value,
    /// Items at creation time: matching DLQ entries (redrive), archived events in the range
    /// (replay; events accepted in the range while the job was created raise it).
    pub total: u64,
    /// Items moved / replayed.
    pub moved: u64,
    /// Items that could not be moved: a redrive's entries kept in the DLQ (e.g. still invalid
    /// against the current contract); a replay's events one of whose copies a queue's depth
    /// cap sent to the DLQ.
    pub failed: u64,
    /// Items skipped: a replay's events that did not match its filter or any rule (or were
    /// the router's own system events, or failed their type's current contract); a
    /// redrive's entries another job moved, or a purge removed, before this one reached them.
    #[serde(default)]
    pub skipped: u64,
    /// Of `skipped`, a replay's events that were handlers' emissions (source `handler://…`),
    /// left out because the replay runs the handlers again, which emit them anew (the
    /// request's `include_emitted` replays them too).
    #[serde(default)]
    pub skipped_emitted: u64,
    /// Of `skipped`, a replay's events that fail their type's current contract (the request's
    /// `ignore_contracts` replays them too).
    #[serde(default)]
    pub skipped_contract: u64,
    /// Of `skipped`, a replay's events that its `rules`/`targets` restriction left without a
    /// copy: they match the current rules, but only through other rules or to other targets.
    #[serde(default)]
    pub skipped_restricted: u64,
    /// A replay's events that the archive sweep removed (past the archive's retention) before
    /// the job reached them: counted when the job ends, as the part of `total` it never saw.
    /// `moved`, `failed`, `skipped` and `expired` count distinct items.
    #[serde(default)]
    pub expired: u64,
    /// What the operator should know about the job from its creation on (a replay whose range
    /// starts before what the archive still holds).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// When a step last went through an item (moved, failed or skipped it): a running job
    /// whose time stands still is stuck. `None` before its first item.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_item_at: Option<Millis>,
    /// Last DLQ id or event sequence processed.
    pub cursor: u64,
    /// Creation time.
    pub created_at: Millis,
    /// Last change.
    pub updated_at: Millis,
    /// Last error, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// On a store several nodes share: the node running it (it renews `heartbeat_at`; another
    /// node takes a running job over once that is stale).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner: Option<String>,
    /// When its runner last wrote it.
    #[serde(default)]
    pub heartbeat_at: Millis,
    /// How many times the job was written. Every write names the revision it was read at and
    /// is refused ([`StoreError::JobChanged`](super::StoreError::JobChanged)) when the job was
    /// written since, by an operator or another node's runner: a step never lands over a pause
    /// or cancel it did not read, and an operator's change never takes back a step's cursor.
    #[serde(default)]
    pub rev: u64,
}

/// A redrive step's actions that the store applied otherwise than the job counted them. Most
/// are those whose dead letter was gone when the step was applied (purged, or moved by another
/// job or node since the step read it): the job had counted them as moved or failed; they are
/// skipped instead, so two jobs over the same entries do not both report every entry moved.
/// The others are `superseded`: routes the store turned into keeps.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RedriveGone {
    /// Gone, counted as moved (`Requeue`, `Route`).
    pub moved: u64,
    /// Gone, counted as failed (`Keep`).
    pub failed: u64,
    /// `Route`s of a quarantined copy of (source, id) that a later copy of the same
    /// (source, id) had replaced by the time the step was applied: kept in the DLQ (with
    /// [`superseded_note`]) instead of routed, so failed rather than moved. Decided by the
    /// store, in the step's own commit, because the later copy may arrive between the job's
    /// read and that commit.
    pub superseded: u64,
}

impl RedriveGone {
    /// Counts `action` (whose dead letter was gone) as it should have been.
    pub fn add(&mut self, action: &RedriveAction) {
        match action {
            RedriveAction::Requeue { .. }
            | RedriveAction::RequeueTo { .. }
            | RedriveAction::Route { .. } => self.moved += 1,
            RedriveAction::Keep { .. } => self.failed += 1,
        }
    }

    /// `job`'s progress with the gone actions skipped rather than moved or failed, and the
    /// superseded ones failed rather than moved.
    pub fn apply(&self, job: &mut Job) {
        job.moved = job.moved.saturating_sub(self.moved + self.superseded);
        job.failed = job.failed.saturating_sub(self.failed) + self.superseded;
        job.skipped += self.moved + self.failed;
    }
}

/// Why a redrive keeps a quarantined copy of an event whose (source, id) a later copy, accepted
/// at `later_at`, holds now (see [`RedriveGone::superseded`]). The producer sent the event
/// again and that copy was routed (or, sent after the dedup window, quarantined in its turn):
/// routed now, this older copy would reach the targets after it, with its older data and
/// under the same idempotency key. Only the latest copy of an event is ever routed.
pub fn superseded_note(later_at: Millis, later_quarantined: bool) -> String {
    let later = if later_quarantined {
        "is quarantined too: only that latest copy can be redriven"
    } else {
        "was accepted and routed in its place"
    };
    format!(
        "not redriven: a later copy of this event (same source and id, accepted at {}) {later}; purge this one",
        crate::clock::rfc3339(later_at)
    )
}

/// What a redrive step does with one DLQ entry.
#[derive(Debug, Clone, PartialEq)]
pub enum RedriveAction {
    /// A delivery failure: back to its target queue, attempts reset, history kept.
    Requeue {
        /// DLQ entry id.
        dlq_id: u64,
    },
    /// A delivery failure of a target no longer in the rules whose destination is live under
    /// another id (a rule renamed): into that target's queue, attempts reset, history kept.
    /// Its dead letters were otherwise never redriven at all, the receiver live meanwhile.
    RequeueTo {
        /// DLQ entry id.
        dlq_id: u64,
        /// The live target that sends to the removed one's destination.
        target: String,
        /// The entry's ordering key under that target's ordering (read from the event as at
        /// acceptance); `None` when it has none.
        ordering_key: Option<String>,
    },
    /// A quarantined event that now passes its contract: routed with these entries.
    Route {
        /// DLQ entry id.
        dlq_id: u64,
        /// Rules that matched now.
        matched_rules: Vec<String>,
        /// Its fan-out under the current rules.
        targets: Vec<NewEntry>,
    },
    /// Not redriven: stays in the DLQ, saying why in its `not_redriven`. Its errors (the
    /// failure's own) stay, or are replaced by those a re-check found now; its redrive count
    /// stays: it was not redriven.
    Keep {
        /// DLQ entry id.
        dlq_id: u64,
        /// Why it was not redriven.
        note: String,
        /// The errors a re-check found now (a quarantined event against the current
        /// contracts), in place of the entry's; `None` keeps the entry's.
        errors: Option<Vec<FieldError>>,
    },
}

/// The most records a job step writes for one copy of an event: its queue entry (or, refused
/// by its queue's depth cap, its dead letter), and the record of its ordering key's hold
/// (released by a redrive, or taken by a dead letter that holds its key).
fn copy_writes(t: &NewEntry) -> usize {
    1 + usize::from(t.ordering_key.is_some())
}

impl RedriveAction {
    /// The most records a redrive step writes for this action (see
    /// [`crate::store::Store::max_step_writes`]): the dead letter's, and for a requeue its
    /// queue entry and its key's hold; for a route its event's, its dedup record and each
    /// copy's ([`copy_writes`]).
    pub fn max_writes(&self) -> usize {
        match self {
            Self::Requeue { .. } | Self::RequeueTo { .. } => 3,
            Self::Route { targets, .. } => 3 + targets.iter().map(copy_writes).sum::<usize>(),
            Self::Keep { .. } => 1,
        }
    }

    /// The DLQ entry the action is about.
    pub fn dlq_id(&self) -> u64 {
        match self {
            Self::Requeue { dlq_id }
            | Self::RequeueTo { dlq_id, .. }
            | Self::Route { dlq_id, .. }
            | Self::Keep { dlq_id, .. } => *dlq_id,
        }
    }
}

/// One replayed event: its new fan-out, carrying the replay job's marker.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayItem {
    /// The archived event.
    pub seq: u64,
    /// Targets under the current rules.
    pub targets: Vec<NewEntry>,
}

impl ReplayItem {
    /// The most records a replay step writes for this item (see
    /// [`crate::store::Store::max_step_writes`]): its event's, and each copy's.
    pub fn max_writes(&self) -> usize {
        1 + self.targets.iter().map(copy_writes).sum::<usize>()
    }
}

/// What a replay step did ([`crate::store::Store::replay_step`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReplayStepped {
    /// The job's new revision.
    pub rev: u64,
    /// The copies that went to the DLQ as `target_overflow` instead of their queue (at its
    /// depth cap), as (archived event's sequence, target id): new dead letters to count and
    /// announce like any other. The stored job counts their events as `failed`
    /// ([`ReplayStepped::apply`]).
    pub overflowed: Vec<(u64, String)>,
    /// The items whose event the archive sweep removed between the step's read and its
    /// commit: nothing was replayed for them.
    pub gone: Vec<u64>,
}

impl ReplayStepped {
    /// `job`'s progress, counted by the caller with every item of the step as moved, with
    /// this step's outcome: an event one of whose copies a queue refused is `failed` instead
    /// (counted once, however many of its copies were refused: the counters count events,
    /// and add up to at most `total`); one whose event was gone is not counted, so that it
    /// is `expired` when the job ends.
    pub fn apply(&self, job: &mut Job) {
        let failed = self
            .overflowed
            .iter()
            .map(|(seq, _)| *seq)
            .collect::<std::collections::BTreeSet<_>>()
            .len() as u64;
        job.moved = job.moved.saturating_sub(failed + self.gone.len() as u64);
        job.failed += failed;
    }
}

/// One row of the DLQ summary: a (target, reason) group with a histogram over time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SummaryRow {
    /// Target (`null` for quarantined events).
    pub target: Option<String>,
    /// Reason.
    pub reason: DlqReason,
    /// Entries.
    pub count: u64,
    /// First failure.
    pub first_failure_at: Millis,
    /// Last failure.
    pub last_failure_at: Millis,
    /// (bucket start, entries whose last failure falls in it), oldest first, empty buckets
    /// omitted.
    pub histogram: Vec<(Millis, u64)>,
}

/// A summary row under construction and its histogram buckets.
type SummaryGroup = (SummaryRow, std::collections::BTreeMap<Millis, u64>);

/// Groups DLQ entries into `SummaryRow`s: the DLQ summary, the same on every backend.
#[derive(Debug)]
pub struct DlqSummary {
    bucket_ms: i64,
    /// By target (`""` for none: no target id is empty), then reason: looked up by the
    /// borrowed target id, so counting an entry allocates nothing once its group exists.
    groups: std::collections::BTreeMap<String, std::collections::BTreeMap<DlqReason, SummaryGroup>>,
}

impl DlqSummary {
    /// An empty summary with histogram buckets of `bucket_ms` (at least a second).
    pub fn new(bucket_ms: i64) -> Self {
        Self {
            bucket_ms: bucket_ms.max(1000),
            groups: Default::default(),
        }
    }

    /// Counts the dead letter whose head is `e` into its (target, reason) group.
    pub fn add(&mut self, e: &DlqHead<'_>) {
        let target = e.target_id.as_deref().unwrap_or("");
        if !self.groups.contains_key(target) {
            self.groups.insert(target.to_owned(), Default::default());
        }
        let by_reason = self.groups.get_mut(target).expect("inserted above");
        let g = by_reason.entry(e.reason).or_insert_with(|| {
            (
                SummaryRow {
                    target: e.target_id.as_deref().map(str::to_owned),
                    reason: e.reason,
                    count: 0,
                    first_failure_at: e.first_failure_at,
                    last_failure_at: e.last_failure_at,
                    histogram: Vec::new(),
                },
                Default::default(),
            )
        });
        g.0.count += 1;
        g.0.first_failure_at = g.0.first_failure_at.min(e.first_failure_at);
        g.0.last_failure_at = g.0.last_failure_at.max(e.last_failure_at);
        *g.1.entry(e.last_failure_at - e.last_failure_at.rem_euclid(self.bucket_ms))
            .or_default() += 1;
    }

    /// The rows, by target (dead letters without one first) and reason.
    pub fn rows(self) -> Vec<SummaryRow> {
        self.groups
            .into_values()
            .flat_map(|by_reason| by_reason.into_values())
            .map(|(mut row, hist)| {
                row.histogram = hist.into_iter().collect();
                row
            })
            .collect()
    }
}

/// Everything known about one event: for `GET /v1/events/{id}`.
#[derive(Debug, Clone, PartialEq)]
pub struct Fate {
    /// The stored event.
    pub event: StoredEvent,
    /// Its queue entries (live and finished, until swept).
    pub entries: Vec<QueueEntry>,
    /// Its DLQ entries.
    pub dlq: Vec<DlqEntry>,
    /// Older stored copies of the same (source, id) that were quarantined, newest first: a
    /// producer fixed the data and sent the event again, and the copy accepted then (`event`)
    /// took their place. They stay in the DLQ until purged, and without them the fate showed
    /// no trace of the quarantine.
    pub previous: Vec<PreviousCopy>,
}

/// An older, quarantined copy of an event ([`Fate::previous`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PreviousCopy {
    /// The copy as stored.
    pub event: StoredEvent,
    /// Its DLQ entries (none once purged).
    pub dlq: Vec<DlqEntry>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_id_round_trips_through_text() {
        let id = EntryId { event: 42, idx: 3 };
        assert_eq!(id.to_string().parse::<EntryId>(), Ok(id));
        assert!("42".parse::<EntryId>().is_err());
    }

    #[test]
    fn a_redriven_entry_that_fails_again_keeps_its_first_failure() {
        let failed = |n, at| AttemptRecord {
            n,
            started_at: at - 10,
            finished_at: Some(at),
            result: Some(AttemptResult::Retryable),
            status: Some(500),
            error: Some("HTTP 500".into()),
        };
        let target = NewEntry {
            target_id: "t".into(),
            rule: "r".into(),
            ordering_key: None,
            max_depth: None,
            lease_ms: None,
            hold_key: false,
        };
        let mut e = QueueEntry::queued(EntryId { event: 1, idx: 0 }, target, "k".into(), 0, 0, 0);
        e.attempts.push(failed(1, 1_000));
        e.requeue_for_redrive(5_000);
        e.attempts.push(failed(1, 6_000));
        let end = AttemptEnd {
            finished_at: 6_000,
            result: AttemptResult::Retryable,
            status: Some(500),
            error: Some("HTTP 500".into()),
            outbox: None,
        };
        let names = ("id".into(), "src".into(), "type".into());
        let d = DlqEntry::of_given_up(&e, names, DlqReason::RetriesExhausted, &end, 6_000);
        assert_eq!((d.first_failure_at, d.last_failure_at), (1_000, 6_000));
        assert_eq!(
            (d.attempt_count, d.attempts.len(), d.redrive_count),
            (1, 2, 1)
        );
    }

    #[test]
    fn reasons_round_trip() {
        for r in DlqReason::ALL {
            assert_eq!(r.as_str().parse::<DlqReason>(), Ok(r));
            assert_eq!(
                serde_json::to_value(r).ok(),
                Some(serde_json::Value::from(r.as_str()))
            );
        }
    }
}
