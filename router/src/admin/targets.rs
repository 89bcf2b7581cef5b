//! `GET /v1/targets`: every target, by id, one page at a time; and the one test of whether a
//! target needs an operator, which the `problems` filter applies here and `router targets ls`
//! and `router status` read the same way.

use std::collections::BTreeSet;
use std::ops::Bound;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::page::{page_limit, take_page};
use super::{ApiQuery, target_json};
use crate::app::App;
use crate::event::FieldError;
use crate::ingest::error_response;

/// Held keys a note names before it says how many more there are.
const NOTE_KEYS: usize = 3;

/// A view's value as text: a string as it is, null as `-`, anything else as JSON.
fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Why a target's queue may not move, read off its view (an element of `GET /v1/targets`), as
/// `router targets ls` prints it under the table: the causes a QUEUED number that does not
/// move hides (a worker that could not start, the receiver's Retry-After, an open breaker,
/// held ordering keys), each with what lifts it. Without them three different incidents
/// looked the same in the table.
pub fn target_notes(t: &Value) -> Vec<String> {
    let id = text(&t["id"]);
    let mut notes = Vec::new();
    if let Some(w) = t["worker"].as_str() {
        notes.push(w.to_string());
    }
    // A handler that is not uploaded (a typo, a delete) or failed to load holds every
    // delivery until their max_age sends them to the DLQ; one being compiled is on its way.
    let handler = &t["handler"];
    if matches!(handler["state"].as_str(), Some("not_uploaded" | "failed")) {
        notes.push(format!(
            "{}: its deliveries wait for it, up to their max_age, then go to the DLQ (`router handlers push {} FILE`, or fix the handler name in the rule)",
            handler["reason"].as_str().map_or_else(
                || format!("handler {:?} is {}", text(&handler["name"]), text(&handler["state"])),
                str::to_string
            ),
            text(&handler["name"])
        ));
    }
    if let Some(until) = t["retry_after_until"].as_str() {
        notes.push(format!(
            "held off until {until}: the receiver answered 429/503 with Retry-After (`router targets resume {id}` lifts it)"
        ));
    }
    if t["breaker"]["state"] == "open" {
        notes.push(format!(
            "breaker open since {} until {}",
            text(&t["breaker"]["since"]),
            text(&t["breaker"]["open_until"])
        ));
    }
    // At the cap new entries are dead-lettered as they arrive (ingest still answers
    // accepted): said first at 90 %, while there is time to act.
    if let Some(cap) = t["max_queue_depth"].as_u64().filter(|&c| c > 0) {
        let live = t["queued"].as_u64().unwrap_or(0) + t["in_flight"].as_u64().unwrap_or(0);
        if live >= cap {
            notes.push(format!(
                "queue at its depth cap ({cap}): new entries go to the DLQ as target_overflow"
            ));
        } else if live.saturating_mul(10) >= cap.saturating_mul(9) {
            notes.push(format!(
                "queue near its depth cap ({live} of {cap}): at it, new entries go to the DLQ as target_overflow"
            ));
        }
    }
    let held: Vec<String> = t["held_keys"]
        .as_array()
        .into_iter()
        .flatten()
        .map(text)
        .collect();
    if !held.is_empty() {
        let mut shown = held
            .iter()
            .take(NOTE_KEYS)
            .map(|k| format!("{k:?}"))
            .collect::<Vec<_>>()
            .join(", ");
        if held.len() > NOTE_KEYS {
            shown.push_str(&format!(" and {} more", held.len() - NOTE_KEYS));
        }
        notes.push(format!(
            "{} ordering key(s) held after a dead letter ({shown}), {} entries queued behind them (`router targets release-key {id} <key>`, or redrive the dead letter)",
            held.len(),
            text(&t["queued_behind_keys"])
        ));
    }
    notes
}

/// Whether target view `t` (an element of `GET /v1/targets`) needs an operator: paused, or
/// one of [`target_notes`] holds (not running, held off by its receiver, breaker open, keys
/// held), or its breaker is half-open and probing ([`breaker_probing`]). `GET
/// /v1/targets?problems=true` lists these alone (`router targets ls --problems`).
pub fn target_has_problems(t: &Value) -> bool {
    t["paused"] == json!(true) || breaker_probing(t) || !target_notes(t).is_empty()
}

/// Whether target view `t`'s breaker is half-open with entries to probe with (queued or in
/// flight). One with none stays half-open until the next event, which is the probe (an
/// event is needed to probe a receiver with): nothing is failing then, and counting it as a
/// problem kept `router status` at exit 1, "probing", for as long as the target had no
/// traffic (the policies audit).
pub fn breaker_probing(t: &Value) -> bool {
    t["breaker"]["state"] == "half_open"
        && t["queued"].as_u64().unwrap_or(0) + t["in_flight"].as_u64().unwrap_or(0) > 0
}

/// Query of `GET /v1/targets`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetsQuery {
    /// Cursor: the targets whose id sorts after it (the `next` of the previous page).
    after: Option<String>,
    /// Page size (default and maximum [`super::page::MAX_PAGE`]).
    limit: Option<usize>,
    /// Only the targets that need an operator ([`target_has_problems`]).
    problems: Option<bool>,
}

/// Every target id `GET /v1/targets` lists, sorted: the targets of the live rules (also those
/// that could not start: with no entries queued yet they were nowhere to be seen), the running
/// ones, and those the store still has entries of, except a target removed from the rules once
/// it is drained and its worker stopped (the store lists every target it ever had; its dead
/// letters stay in `/v1/dlq`).
fn listed_ids(
    app: &App,
    stats: &std::collections::BTreeMap<String, crate::store::QueueStats>,
) -> BTreeSet<String> {
    let mut ids: BTreeSet<String> = stats
        .iter()
        .filter(|(id, s)| s.live() > 0 || !app.retired(id))
        .map(|(id, _)| id.clone())
        .collect();
    ids.extend(app.dispatcher.runtimes().iter().map(|r| r.spec.id.clone()));
    ids.extend(app.rules.load().targets.keys().cloned());
    ids
}

/// `GET /v1/targets`: the targets by id with their queue numbers, breaker, throttle and
/// budget, a page at a time. Only the page's targets are read in full (a view reads the
/// target's runtime, its held keys and warnings); with `problems=true`, the targets after the
/// cursor are read until the page is full of those that need an operator.
pub async fn targets(State(app): State<Arc<App>>, ApiQuery(q): ApiQuery<TargetsQuery>) -> Response {
    let mut errors = Vec::new();
    let limit = page_limit(q.limit).unwrap_or_else(|e| {
        errors.push(e);
        0
    });
    if q.after.as_deref() == Some("") {
        errors.push(FieldError::new(
            "/after",
            "cursor must be a target id (the `next` of the previous page)",
        ));
    }
    if !errors.is_empty() {
        return error_response(StatusCode::BAD_REQUEST, "invalid query", errors);
    }
    let now = app.clock.now_ms();
    let stats = app.store.queue_stats();
    let ids = listed_ids(&app, &stats);
    // A position, not a target: the list goes on after it when that target has gone since.
    let from = q
        .after
        .as_ref()
        .map_or(Bound::Unbounded, |a| Bound::Excluded(a.clone()));
    let rest = ids.range((from, Bound::Unbounded));
    let view = |id: &String| target_json(&app, id, stats.get(id), now);
    let by_id = |t: &Value| text(&t["id"]);
    let page = if q.problems == Some(true) {
        take_page(rest.map(view).filter(target_has_problems), limit, by_id)
    } else {
        let page = take_page(rest, limit, |id| (*id).clone());
        super::page::Page {
            items: page.items.into_iter().map(view).collect(),
            next: page.next,
        }
    };
    axum::Json(json!({ "targets": page.items, "next": page.next })).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test `--problems` and the server's filter share: paused, half-open with work to
    /// probe with, or any note.
    #[test]
    fn a_target_needs_an_operator_when_paused_half_open_or_noted() {
        let fine =
            json!({"id": "a", "paused": false, "breaker": {"state": "closed"}, "held_keys": []});
        assert!(!target_has_problems(&fine));
        // Half-open with nothing to probe with: the next event is the probe.
        let mut idle = fine.clone();
        idle["breaker"] = json!({"state": "half_open"});
        assert!(!target_has_problems(&idle));
        let mut probing = idle.clone();
        probing["in_flight"] = json!(1);
        assert!(target_has_problems(&probing));
        probing["in_flight"] = json!(0);
        probing["queued"] = json!(2);
        assert!(target_has_problems(&probing));
        for (k, v) in [
            ("paused", json!(true)),
            (
                "breaker",
                json!({"state": "open", "since": "x", "open_until": "y"}),
            ),
            ("held_keys", json!(["k"])),
            ("retry_after_until", json!("2026-01-01T00:00:00Z")),
            ("worker", json!("not running: secret S not set")),
        ] {
            let mut t = fine.clone();
            t[k] = v;
            assert!(target_has_problems(&t), "{t}");
        }
    }
}
