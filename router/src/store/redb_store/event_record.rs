//! The layout of the embedded store's `events` records: the event as JSON, and since format 5
//! the event's fan-out in front of it.
//!
//! The fan-out is the queue entry record (`entry_codec`) of each target the event was queued
//! for at acceptance, with its index. An entry that has not changed since (never leased) has
//! no row of its own in `entries`: the event's record stands for it. Accepting an event then
//! writes one row (the event) instead of three per target (the event, the entry and its row
//! in `live`), and a delivered entry is one insert and one update, not an insert, two updates
//! and a removal. The committer's B-tree work per event is most of its CPU at the peak
//! (docs/BENCHMARKS.md, twenty-sixth and twenty-eighth sessions).
//!
//! Layout: the tag byte `0xF5`, the number of entries (`u32` little-endian), then per entry
//! its index and its record's length (`u32` each) and the record; the rest is the event's
//! JSON. A record of format 4 or older is the JSON alone, which starts with `{`: both are read
//! without a migration.

use crate::store::StoreError;

/// First byte of a record with a fan-out. Never `{`.
const TAG: u8 = 0xF5;

/// An `events` record, split into its parts (borrowed from the stored bytes).
pub(super) struct EventRecord<'a> {
    /// The fan-out's encoded entries (empty for a record of format 4 or older).
    fanout: &'a [u8],
    /// Number of entries in `fanout`.
    count: u32,
    /// The event's JSON.
    pub(super) json: &'a [u8],
}

/// Encodes a record: `fanout` is each queued entry's index and `entry_codec` record.
pub(super) fn encode(fanout: &[(u32, &[u8])], json: &[u8]) -> Vec<u8> {
    encode_with(fanout, json.len(), |out| out.extend_from_slice(json))
}

/// Encodes a record whose JSON `write_json` appends (so the event is serialised straight into
/// the record, not copied into it); `json_hint` is its expected length.
pub(super) fn encode_with(
    fanout: &[(u32, &[u8])],
    json_hint: usize,
    write_json: impl FnOnce(&mut Vec<u8>),
) -> Vec<u8> {
    let items: usize = fanout.iter().map(|(_, r)| 8 + r.len()).sum();
    let mut out = Vec::with_capacity(5 + items + json_hint);
    out.push(TAG);
    out.extend_from_slice(
        &u32::try_from(fanout.len())
            .unwrap_or(u32::MAX)
            .to_le_bytes(),
    );
    for &(idx, record) in fanout {
        out.extend_from_slice(&idx.to_le_bytes());
        out.extend_from_slice(
            &u32::try_from(record.len())
                .unwrap_or(u32::MAX)
                .to_le_bytes(),
        );
        out.extend_from_slice(record);
    }
    write_json(&mut out);
    out
}

fn corrupt(seq: u64, what: &str) -> StoreError {
    StoreError::Corrupt {
        table: "events",
        message: format!("event {seq}: {what}"),
    }
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    let bytes = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(bytes.try_into().ok()?))
}

impl<'a> EventRecord<'a> {
    /// Splits the record of event `seq`.
    pub(super) fn split(seq: u64, b: &'a [u8]) -> Result<Self, StoreError> {
        if b.first() != Some(&TAG) {
            return Ok(Self {
                fanout: &[],
                count: 0,
                json: b,
            });
        }
        let count = u32_at(b, 1).ok_or_else(|| corrupt(seq, "truncated fan-out header"))?;
        let mut at = 5usize;
        for _ in 0..count {
            let len = u32_at(b, at + 4).ok_or_else(|| corrupt(seq, "truncated fan-out entry"))?;
            at = at
                .checked_add(8 + len as usize)
                .filter(|end| *end <= b.len())
                .ok_or_else(|| corrupt(seq, "truncated fan-out entry"))?;
        }
        Ok(Self {
            fanout: &b[5..at],
            count,
            json: &b[at..],
        })
    }

    /// The fan-out: each queued entry's index and `entry_codec` record, by index.
    pub(super) fn entries(&self) -> impl Iterator<Item = (u32, &'a [u8])> + 'a {
        let b = self.fanout;
        let mut at = 0usize;
        (0..self.count).map_while(move |_| {
            // `split` checked every length.
            let idx = u32_at(b, at)?;
            let len = u32_at(b, at + 4)? as usize;
            let record = b.get(at + 8..at + 8 + len)?;
            at += 8 + len;
            Some((idx, record))
        })
    }

    /// The record of the queued entry `idx`, if the fan-out has it.
    pub(super) fn entry(&self, idx: u32) -> Option<&'a [u8]> {
        self.entries().find(|(i, _)| *i == idx).map(|(_, r)| r)
    }

    /// One past the highest index in the fan-out (0 when empty).
    pub(super) fn next_idx(&self) -> u32 {
        self.entries()
            .map(|(i, _)| i.saturating_add(1))
            .max()
            .unwrap_or(0)
    }

    /// A record with this one's fan-out and `json` (an event rewritten in place keeps the
    /// entries its record stands for).
    pub(super) fn with_json(&self, json: &[u8]) -> Vec<u8> {
        self.without(&[], json)
    }

    /// A record with this one's fan-out less the entries `drop`, and `json`.
    pub(super) fn without(&self, drop: &[u32], json: &[u8]) -> Vec<u8> {
        let kept: Vec<(u32, &[u8])> = self.entries().filter(|(i, _)| !drop.contains(i)).collect();
        encode(&kept, json)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_with_its_fan_out() {
        let b = encode(
            &[(0u32, &b"first"[..]), (2, &b""[..]), (3, &b"third!"[..])],
            br#"{"event":1}"#,
        );
        let r = EventRecord::split(7, &b).expect("split");
        assert_eq!(r.json, br#"{"event":1}"#);
        let got: Vec<(u32, &[u8])> = r.entries().collect();
        assert_eq!(
            got,
            [(0, &b"first"[..]), (2, &b""[..]), (3, &b"third!"[..])]
        );
        assert_eq!(r.entry(3), Some(&b"third!"[..]));
        assert_eq!(r.entry(1), None);
        assert_eq!(r.next_idx(), 4);
        let again = r.with_json(br#"{"event":2}"#);
        let r2 = EventRecord::split(7, &again).expect("split");
        assert_eq!(r2.json, br#"{"event":2}"#);
        assert_eq!(r2.entries().count(), 3);
        let less = r.without(&[0, 3], b"{}");
        let r3 = EventRecord::split(7, &less).expect("split");
        assert_eq!(r3.entries().collect::<Vec<_>>(), [(2, &b""[..])]);
        assert_eq!(r3.json, b"{}");
    }

    #[test]
    fn an_empty_fan_out_and_an_older_record_read_as_json() {
        let b = encode(&[], br#"{"a":1}"#);
        let r = EventRecord::split(1, &b).expect("split");
        assert_eq!(
            (r.json, r.entries().count(), r.next_idx()),
            (&br#"{"a":1}"#[..], 0, 0)
        );
        let old = br#"{"event":{}}"#;
        let r = EventRecord::split(1, old).expect("split");
        assert_eq!(r.json, old);
        assert_eq!(r.entries().count(), 0);
    }

    #[test]
    fn a_truncated_record_is_corrupt_not_misread() {
        let b = encode(&[(0u32, &b"record"[..])], b"{}");
        for cut in 1..b.len() - 2 {
            let err = EventRecord::split(9, &b[..cut]);
            assert!(
                matches!(
                    err,
                    Err(StoreError::Corrupt {
                        table: "events",
                        ..
                    })
                ),
                "cut at {cut}"
            );
        }
        // A count larger than the entries present.
        let mut b = encode(&[(0u32, &b"r"[..])], b"");
        b[1] = 2;
        assert!(EventRecord::split(9, &b).is_err());
    }
}
