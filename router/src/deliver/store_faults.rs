//! What delivery met in the store that an operator must see in `/v1/status`: events whose
//! stored record cannot be read (set aside in the DLQ as `corrupt_record`), and targets whose
//! leases keep failing (a failing store, or a damaged file that makes redb panic). The log
//! says each once; this keeps them in view until they stop.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

use crate::clock::rfc3339;
use crate::store::{EntryId, Millis};

/// How many set-aside records `/v1/status` lists, newest last (the count goes on).
const RECENT: usize = 10;

/// Shared by the workers and the status route.
#[derive(Debug, Clone, Default)]
pub struct StoreFaults {
    inner: Arc<Mutex<Faults>>,
    /// Whether any target's leases are failing now: a lease that succeeds then looks at the
    /// list, every other one does not take the lock.
    any_failing: Arc<AtomicBool>,
}

#[derive(Debug, Default)]
struct Faults {
    corrupt_records: u64,
    recent: VecDeque<CorruptRecordSeen>,
    failing: BTreeMap<String, LeaseFailing>,
}

/// One entry set aside because its event's record could not be read.
#[derive(Debug, Clone)]
struct CorruptRecordSeen {
    target: String,
    entry: EntryId,
    error: String,
    at: Millis,
}

/// A target whose leases fail, since its last one that did not.
#[derive(Debug, Clone)]
struct LeaseFailing {
    since: Millis,
    failures: u64,
    error: String,
}

impl StoreFaults {
    fn faults(&self) -> std::sync::MutexGuard<'_, Faults> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that `entry` of `target` was set aside: its event's record cannot be read.
    pub fn corrupt_record(&self, target: &str, entry: EntryId, error: &str, at: Millis) {
        let mut f = self.faults();
        f.corrupt_records += 1;
        if f.recent.len() == RECENT {
            f.recent.pop_front();
        }
        f.recent.push_back(CorruptRecordSeen {
            target: target.to_string(),
            entry,
            error: error.to_string(),
            at,
        });
    }

    /// Records a failed lease of `target`.
    pub fn lease_failed(&self, target: &str, error: &str, at: Millis) {
        let mut f = self.faults();
        let e = f
            .failing
            .entry(target.to_string())
            .or_insert_with(|| LeaseFailing {
                since: at,
                failures: 0,
                error: String::new(),
            });
        e.failures += 1;
        e.error = error.to_string();
        self.any_failing.store(true, Ordering::Release);
    }

    /// Records a lease of `target` that did not fail.
    pub fn lease_ok(&self, target: &str) {
        if !self.any_failing.load(Ordering::Acquire) {
            return;
        }
        let mut f = self.faults();
        f.failing.remove(target);
        self.any_failing
            .store(!f.failing.is_empty(), Ordering::Release);
    }

    /// `/v1/status` `store.faults`.
    pub fn status(&self) -> Value {
        let f = self.faults();
        json!({
            "corrupt_records": f.corrupt_records,
            "recent_corrupt_records": f.recent.iter().map(|c| json!({
                "target": c.target,
                "entry": c.entry.to_string(),
                "event_seq": c.entry.event,
                "error": c.error,
                "at": rfc3339(c.at),
            })).collect::<Vec<_>>(),
            "failing_leases": f.failing.iter().map(|(t, l)| (t.clone(), json!({
                "since": rfc3339(l.since),
                "failures": l.failures,
                "error": l.error,
            }))).collect::<serde_json::Map<_, _>>(),
        })
    }

    /// `/v1/status` warnings: each recent set-aside record, and each target whose leases fail.
    pub fn warnings(&self) -> Vec<String> {
        let f = self.faults();
        let mut out: Vec<String> = f
            .recent
            .iter()
            .map(|c| {
                format!(
                    "target {}: the stored record of event {} cannot be read ({}); its delivery (entry {}) was set aside in the DLQ as corrupt_record at {}: restore the event from a backup or its producer, then purge the entry (docs/operations.md, \"A damaged store file\")",
                    c.target,
                    c.entry.event,
                    c.error,
                    c.entry,
                    rfc3339(c.at)
                )
            })
            .collect();
        if f.corrupt_records > f.recent.len() as u64 {
            out.push(format!(
                "{} deliveries in all were set aside as corrupt_record since start (GET /v1/dlq?reason=corrupt_record)",
                f.corrupt_records
            ));
        }
        out.extend(f.failing.iter().map(|(t, l)| {
            format!(
                "target {t}: leases failing since {} ({} failures; its deliveries wait): {}",
                rfc3339(l.since),
                l.failures,
                l.error
            )
        }));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failing_leases_show_until_one_succeeds_and_set_aside_records_stay_counted() {
        let f = StoreFaults::default();
        f.lease_failed("a", "corrupt record in file: redb panicked", 1_000);
        f.lease_failed("a", "corrupt record in file: redb panicked", 2_000);
        let s = f.status();
        assert_eq!(s["failing_leases"]["a"]["failures"], 2);
        assert!(f.warnings()[0].contains("target a: leases failing since"));
        f.lease_ok("a");
        assert!(f.warnings().is_empty());
        for i in 0..12 {
            f.corrupt_record("b", EntryId { event: i, idx: 0 }, "bad", 3_000);
        }
        let s = f.status();
        assert_eq!(s["corrupt_records"], 12);
        assert_eq!(
            s["recent_corrupt_records"].as_array().map(Vec::len),
            Some(RECENT)
        );
        let w = f.warnings();
        assert_eq!(w.len(), RECENT + 1, "{w:?}");
        assert!(w[RECENT].contains("12 deliveries"), "{w:?}");
    }
}
