//! The layout of the embedded store's `entries` records: how a queue entry is written to and
//! read from redb.
//!
//! Since format 4 a record is one tag byte followed by the entry in postcard (a compact,
//! non-self-describing serde format). The committer decodes and re-encodes an entry at every
//! lease and every finish; as JSON that was about an eighth of its CPU in a batched run
//! (docs/BENCHMARKS.md, twenty-fifth session). Records of formats 1–3 are JSON, which always
//! starts with `{`, so both are read without a migration: a JSON record is rewritten in the
//! new layout the next time its entry changes.
//!
//! postcard cannot skip a field, so the model's `skip_serializing_if` attributes (which keep
//! the API's JSON short) cannot apply here: the record is a mirror of the entry with every
//! field present, in a fixed order. Adding a field is a format change.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::store::{
    AttemptRecord, AttemptResult, EntryId, EntryState, Lease, Millis, QueueEntry, StoreError,
};

/// First byte of a binary record. Never `{`, the first byte of every JSON record.
const TAG: u8 = 0xB4;

#[derive(Serialize, Deserialize)]
struct Attempt<'a> {
    n: u32,
    started_at: Millis,
    finished_at: Option<Millis>,
    result: Option<AttemptResult>,
    status: Option<u16>,
    #[serde(borrow)]
    error: Option<Cow<'a, str>>,
}

impl<'a> Attempt<'a> {
    fn of(a: &'a AttemptRecord) -> Self {
        Self {
            n: a.n,
            started_at: a.started_at,
            finished_at: a.finished_at,
            result: a.result,
            status: a.status,
            error: a.error.as_deref().map(Cow::Borrowed),
        }
    }

    fn into_record(self) -> AttemptRecord {
        AttemptRecord {
            n: self.n,
            started_at: self.started_at,
            finished_at: self.finished_at,
            result: self.result,
            status: self.status,
            error: self.error.map(Cow::into_owned),
        }
    }
}

/// The record: every field of `QueueEntry` but its id (the record's key).
#[derive(Serialize, Deserialize)]
struct Entry<'a> {
    #[serde(borrow)]
    target_id: Cow<'a, str>,
    #[serde(borrow)]
    rule: Cow<'a, str>,
    state: EntryState,
    accepted_at: Millis,
    due_at: Millis,
    #[serde(borrow)]
    attempts: Vec<Attempt<'a>>,
    #[serde(borrow)]
    ordering_key: Option<Cow<'a, str>>,
    lease: Option<Lease>,
    redrive_count: u32,
    hops: u32,
    #[serde(borrow)]
    replay: Option<Cow<'a, str>>,
    #[serde(borrow)]
    idempotency_key: Cow<'a, str>,
    finished_at: Option<Millis>,
    #[serde(borrow)]
    history: Vec<Attempt<'a>>,
}

/// Encodes `e` as an `entries` record (its id is the key, not part of the record).
pub(super) fn encode(e: &QueueEntry) -> Vec<u8> {
    let record = Entry {
        target_id: Cow::Borrowed(&e.target_id),
        rule: Cow::Borrowed(&e.rule),
        state: e.state,
        accepted_at: e.accepted_at,
        due_at: e.due_at,
        attempts: e.attempts.iter().map(Attempt::of).collect(),
        ordering_key: e.ordering_key.as_deref().map(Cow::Borrowed),
        lease: e.lease,
        redrive_count: e.redrive_count,
        hops: e.hops,
        replay: e.replay.as_deref().map(Cow::Borrowed),
        idempotency_key: Cow::Borrowed(&e.idempotency_key),
        finished_at: e.finished_at,
        history: e.history.iter().map(Attempt::of).collect(),
    };
    let mut out = Vec::with_capacity(128);
    out.push(TAG);
    // Writing plain structs to a Vec cannot fail (postcard's only errors are a full
    // buffer, which a Vec is not, and types it cannot express, which these are not).
    postcard::to_extend(&record, out).unwrap_or_default()
}

/// Decodes the `entries` record of `key`, in either layout.
pub(super) fn decode(key: (u64, u32), b: &[u8]) -> Result<QueueEntry, StoreError> {
    let id = EntryId {
        event: key.0,
        idx: key.1,
    };
    let corrupt = |message: String| StoreError::Corrupt {
        table: "entries",
        message: format!("entry {id}: {message}"),
    };
    let Some((&TAG, body)) = b.split_first() else {
        // Formats 1–3.
        let mut e: QueueEntry =
            serde_json::from_slice(b).map_err(|e| corrupt(format!("JSON record: {e}")))?;
        e.id = id;
        return Ok(e);
    };
    let r: Entry<'_> = postcard::from_bytes(body).map_err(|e| corrupt(e.to_string()))?;
    Ok(QueueEntry {
        id,
        target_id: r.target_id.into_owned(),
        rule: r.rule.into_owned(),
        state: r.state,
        accepted_at: r.accepted_at,
        due_at: r.due_at,
        attempts: r.attempts.into_iter().map(Attempt::into_record).collect(),
        ordering_key: r.ordering_key.map(Cow::into_owned),
        lease: r.lease,
        redrive_count: r.redrive_count,
        hops: r.hops,
        replay: r.replay.map(Cow::into_owned),
        idempotency_key: r.idempotency_key.into_owned(),
        finished_at: r.finished_at,
        history: r.history.into_iter().map(Attempt::into_record).collect(),
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn attempt() -> impl Strategy<Value = AttemptRecord> {
        (
            1u32..20,
            any::<i64>(),
            proptest::option::of(any::<i64>()),
            proptest::option::of(prop_oneof![
                Just(AttemptResult::Delivered),
                Just(AttemptResult::Retryable),
                Just(AttemptResult::Permanent),
                Just(AttemptResult::Interrupted),
            ]),
            proptest::option::of(any::<u16>()),
            proptest::option::of(".{0,40}"),
        )
            .prop_map(|(n, started_at, finished_at, result, status, error)| {
                AttemptRecord {
                    n,
                    started_at,
                    finished_at,
                    result,
                    status,
                    error,
                }
            })
    }

    fn entry() -> impl Strategy<Value = QueueEntry> {
        (
            (
                "[a-z0-9-]{1,20}",
                ".{0,30}",
                0u8..3,
                any::<i64>(),
                any::<i64>(),
            ),
            proptest::collection::vec(attempt(), 0..4),
            proptest::option::of(".{0,20}"),
            proptest::option::of((any::<u64>(), any::<i64>())),
            (any::<u32>(), any::<u32>(), proptest::option::of(".{0,10}")),
            ("[0-9a-f]{32}", proptest::option::of(any::<i64>())),
            proptest::collection::vec(attempt(), 0..3),
        )
            .prop_map(
                |(
                    (target_id, rule, state, accepted_at, due_at),
                    attempts,
                    ordering_key,
                    lease,
                    (redrive_count, hops, replay),
                    (idempotency_key, finished_at),
                    history,
                )| QueueEntry {
                    id: EntryId::default(),
                    target_id,
                    rule,
                    state: match state {
                        0 => EntryState::Queued,
                        1 => EntryState::Delivered,
                        _ => EntryState::Dead,
                    },
                    accepted_at,
                    due_at,
                    attempts,
                    ordering_key,
                    lease: lease.map(|(token, until)| Lease { token, until }),
                    redrive_count,
                    hops,
                    replay,
                    idempotency_key,
                    finished_at,
                    history,
                },
            )
    }

    proptest! {
        /// Every entry reads back as written, with its id from the key; the JSON layout of
        /// formats 1–3 still reads the same.
        #[test]
        fn an_entry_round_trips_in_both_layouts(e in entry(), event in any::<u64>(), idx in any::<u32>()) {
            let want = QueueEntry { id: EntryId { event, idx }, ..e.clone() };
            let binary = encode(&e);
            prop_assert_eq!(binary[0], TAG);
            prop_assert_eq!(decode((event, idx), &binary)?, want.clone());
            let json = serde_json::to_vec(&e).expect("json");
            prop_assert_eq!(json[0], b'{');
            prop_assert_eq!(decode((event, idx), &json)?, want);
        }

        /// A cut-off record is an error naming the entry, never a panic or a wrong entry.
        #[test]
        fn a_truncated_record_is_refused(e in entry(), cut in 1usize..40) {
            let b = encode(&e);
            let cut = cut.min(b.len() - 1);
            let err = decode((1, 2), &b[..b.len() - cut]).expect_err("truncated");
            prop_assert!(err.to_string().contains("entry 1.2"), "{}", err);
        }
    }

    #[test]
    fn the_binary_record_is_smaller_than_the_json_one() {
        let mut e = QueueEntry::queued(
            EntryId { event: 7, idx: 0 },
            crate::store::NewEntry {
                target_id: "invoicing".into(),
                rule: "paid-orders-to-invoicing".into(),
                ordering_key: None,
                max_depth: None,
                lease_ms: None,
                hold_key: false,
            },
            "0123456789abcdef0123456789abcdef".into(),
            1_764_000_000_000,
            1_764_000_000_000,
            0,
        );
        e.start_attempt(
            Lease {
                token: 1 << 40,
                until: 1_764_000_030_000,
            },
            1_764_000_000_001,
        );
        let (binary, json) = (encode(&e), serde_json::to_vec(&e).expect("json"));
        assert!(
            binary.len() * 2 < json.len(),
            "{} vs {}",
            binary.len(),
            json.len()
        );
        assert_eq!(decode((7, 0), &binary).expect("decode"), e);
    }
}
