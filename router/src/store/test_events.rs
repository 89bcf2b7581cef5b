//! Events for the stores' unit tests (both backends build them the same way).

use serde_json::json;

use super::{Job, JobKind, JobState, Millis, NewEntry, NewEvent};
use crate::event::CloudEvent;

/// A minimal valid event.
pub fn ev(source: &str, id: &str) -> CloudEvent {
    serde_json::from_value(json!({"id": id, "source": source, "type": "t", "data": {"n": 1}}))
        .expect("valid event")
}

/// An event for `targets` (rule `r`, no ordering, no cap), accepted at `at`, 24 h dedup
/// window.
pub fn new_event(source: &str, id: &str, targets: &[&str], at: Millis) -> NewEvent {
    NewEvent {
        event: ev(source, id),
        accepted_at: at,
        ruleset_version: "v1".into(),
        matched_rules: vec!["r".into()],
        targets: targets
            .iter()
            .map(|t| NewEntry {
                target_id: (*t).into(),
                rule: "r".into(),
                ordering_key: None,
                max_depth: None,
                lease_ms: None,
                hold_key: false,
            })
            .collect(),
        quarantine: None,
        dedup_window_ms: 86_400_000,
    }
}

/// A running job `id` of `kind` with no progress yet.
pub fn job(id: &str, kind: JobKind) -> Job {
    Job {
        id: id.into(),
        kind,
        state: JobState::Running,
        spec: json!({}),
        total: 0,
        moved: 0,
        failed: 0,
        skipped: 0,
        skipped_emitted: 0,
        skipped_contract: 0,
        skipped_restricted: 0,
        expired: 0,
        warnings: Vec::new(),
        last_item_at: None,
        cursor: 0,
        created_at: 0,
        updated_at: 0,
        last_error: None,
        runner: None,
        heartbeat_at: 0,
        rev: 0,
    }
}
