//! Operator API: event fate, DLQ inspection, targets, rules, status, health and metrics.
//! Every read here is side-effect free.

pub mod contracts;
pub mod handlers;
pub mod page;
pub(crate) mod request;
pub mod targets;

pub use request::ApiQuery;
use request::parse_body;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::app::App;
use crate::clock::rfc3339;
use crate::event::FieldError;
use crate::ingest::error_response;
use crate::store::{AttemptRecord, DlqEntry, DlqFilter, EntryState, QueueEntry};

fn store_error(e: &crate::store::StoreError) -> Response {
    if matches!(e, crate::store::StoreError::Compacting) {
        // Planned, and over in seconds: say so, and when to come back.
        return crate::ingest::compacting_response("the store is compacting its file; retry later");
    }
    if matches!(e, crate::store::StoreError::Corrupt { .. }) {
        // A record that does not decode stays so: a 503 with a Retry-After sent the caller
        // back for ever, and said nothing of what is wrong.
        tracing::error!(error = %e, "a stored record cannot be read");
        return error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "a stored record cannot be read (the store file is damaged; see docs/operations.md, \"A damaged store file\")",
            vec![FieldError::new("", e.to_string())],
        );
    }
    tracing::error!(error = %e, "store read failed");
    crate::ingest::with_retry_after(
        error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "storage unavailable",
            Vec::new(),
        ),
        crate::ingest::STORE_RETRY_AFTER_S,
    )
}

/// `store_error` for an operator's change (a pause, a rule switch). A write whose answer never
/// came may still be applied, on every node: the answer says so and where to look (ingest's
/// 503 says the same of events), instead of a 503 the change then contradicts.
fn change_store_error(e: &crate::store::StoreError, check: &str) -> Response {
    if !matches!(e, crate::store::StoreError::Unanswered(_)) {
        return store_error(e);
    }
    tracing::error!(error = %e, "an operator's change went unanswered by the store");
    crate::ingest::with_retry_after(
        error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!(
                "storage did not answer: the change may or may not have been applied; check {check} before trying again"
            ),
            Vec::new(),
        ),
        crate::ingest::STORE_RETRY_AFTER_S,
    )
}

fn attempt_json(a: &AttemptRecord) -> Value {
    json!({
        "n": a.n,
        "started_at": rfc3339(a.started_at),
        "finished_at": a.finished_at.map(rfc3339),
        "latency_ms": a.finished_at.map(|f| f - a.started_at),
        "result": a.result,
        "status": a.status,
        "error": a.error,
    })
}

/// The state an event's fate shows for one of its queue entries. A dead entry whose DLQ
/// entry an operator purged is `purged`: "dlq" with no DLQ entry had the reader look for one
/// that is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FateState {
    Queued,
    InFlight,
    Retrying,
    Delivered,
    Dlq,
    Purged,
}

impl FateState {
    /// Every state: each is a key of the fate's `targets_by_state`, 0 or not.
    const ALL: [Self; 6] = [
        Self::Queued,
        Self::InFlight,
        Self::Retrying,
        Self::Delivered,
        Self::Dlq,
        Self::Purged,
    ];

    /// Its name in the API.
    fn name(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::InFlight => "in_flight",
            Self::Retrying => "retrying",
            Self::Delivered => "delivered",
            Self::Dlq => "dlq",
            Self::Purged => "purged",
        }
    }

    /// The state of `e`; `dead` are the queue entries the event's DLQ entries refer to.
    fn of(e: &QueueEntry, dead: &EntryRefs<'_>, now: i64) -> Self {
        match e.state {
            EntryState::Delivered => Self::Delivered,
            EntryState::Dead if dead.holds(e) => Self::Dlq,
            EntryState::Dead => Self::Purged,
            EntryState::Queued if e.lease.is_some_and(|l| l.until >= now) => Self::InFlight,
            EntryState::Queued if e.attempts.is_empty() => Self::Queued,
            EntryState::Queued => Self::Retrying,
        }
    }
}

/// Queue entries as DLQ entries refer to them, looked up at once (an event fanned out to
/// thousands of targets compared each entry with each DLQ entry): a DLQ entry refers to its
/// queue entry by the entry's id or, refused at acceptance by the queue's depth cap before the
/// entry had an attempt, by its event and target.
struct EntryRefs<'a> {
    ids: std::collections::HashSet<crate::store::EntryId>,
    targets: std::collections::HashSet<(u64, &'a str)>,
}

impl<'a> EntryRefs<'a> {
    /// The entries `dlq` refer to.
    fn of_dlq(dlq: &'a [DlqEntry]) -> Self {
        let mut refs = Self {
            ids: Default::default(),
            targets: Default::default(),
        };
        for d in dlq {
            match (d.entry, d.target_id.as_deref()) {
                (Some(id), _) => {
                    refs.ids.insert(id);
                }
                (None, Some(t)) => {
                    refs.targets.insert((d.event_seq, t));
                }
                (None, None) => {}
            }
        }
        refs
    }

    /// `entries` themselves, for the DLQ entries that refer to one of them.
    fn of_entries(entries: impl IntoIterator<Item = &'a QueueEntry>) -> Self {
        let mut refs = Self {
            ids: Default::default(),
            targets: Default::default(),
        };
        for e in entries {
            refs.ids.insert(e.id);
            refs.targets.insert((e.id.event, e.target_id.as_str()));
        }
        refs
    }

    /// Whether entry `e` is one referred to (built with [`Self::of_dlq`]).
    fn holds(&self, e: &QueueEntry) -> bool {
        self.ids.contains(&e.id) || self.targets.contains(&(e.id.event, e.target_id.as_str()))
    }

    /// Whether DLQ entry `d` refers to one of the entries (built with [`Self::of_entries`]).
    fn referred_by(&self, d: &DlqEntry) -> bool {
        match d.entry {
            Some(id) => self.ids.contains(&id),
            None => d
                .target_id
                .as_deref()
                .is_some_and(|t| self.targets.contains(&(d.event_seq, t))),
        }
    }
}

/// Whether DLQ entry `d` is the dead letter of queue entry `e`, one pair at a time: what
/// [`EntryRefs`] answers for many.
#[cfg(test)]
fn refers_to(d: &DlqEntry, e: &QueueEntry) -> bool {
    match d.entry {
        Some(id) => id == e.id,
        None => d.event_seq == e.id.event && d.target_id.as_deref() == Some(e.target_id.as_str()),
    }
}

fn dlq_json(d: &DlqEntry) -> Value {
    let mut v = json!({
        "id": d.id.to_string(),
        "event": { "id": d.event_id, "source": d.event_source, "type": d.event_type },
        "target": d.target_id,
        "rule": d.rule,
        "reason": d.reason,
        "errors": d.errors,
        "attempt_count": d.attempt_count,
        "attempts": d.attempts.iter().map(attempt_json).collect::<Vec<_>>(),
        "first_failure_at": rfc3339(d.first_failure_at),
        "last_failure_at": rfc3339(d.last_failure_at),
        "redrive_count": d.redrive_count,
    });
    if let Some(job) = &d.replay {
        v["replay"] = json!(job);
    }
    if let Some(key) = &d.ordering_key {
        v["ordering_key"] = json!(key);
    }
    if let Some(n) = &d.not_redriven {
        v["not_redriven"] = json!({ "job": n.job, "at": rfc3339(n.at), "message": n.message });
    }
    if let Some(by) = &d.emitted_by {
        v["emitted_by"] =
            json!({ "handler": by.handler, "target": by.target, "event_id": by.event_id });
    }
    v
}

/// Query of `GET /v1/events/{id}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FateQuery {
    source: Option<String>,
    /// Cursor: the event's targets after this queue entry (the `targets_next` of the previous
    /// page).
    after: Option<String>,
    /// Page size of the event's targets (default and maximum [`page::MAX_PAGE`]).
    limit: Option<usize>,
}

/// `GET /v1/events/{id}?source=`: where the event stands at every target, its targets a page
/// at a time in fan-out order, with how many there are in each state across all pages (an
/// event fanned out to thousands of targets answered megabytes at once). Only the page's
/// targets are read in full: what each waits on, and a handler's emissions from the store.
pub async fn event_fate(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<FateQuery>,
) -> Response {
    let mut errors = Vec::new();
    let Some(source) = q.source.filter(|s| !s.is_empty()) else {
        return error_response(
            StatusCode::BAD_REQUEST,
            "missing query parameter",
            vec![FieldError::new(
                "/source",
                "the event's source is required: events are identified by (source, id)",
            )],
        );
    };
    let limit = page::page_limit(q.limit).unwrap_or_else(|e| {
        errors.push(e);
        0
    });
    let not_a_cursor = || {
        FieldError::new(
            "/after",
            "cursor must be the `entry` of one of this event's targets (the `targets_next` of the previous page)",
        )
    };
    let after = match q.after.as_deref().map(str::parse::<crate::store::EntryId>) {
        None => None,
        Some(Ok(a)) => Some(a),
        Some(Err(())) => {
            errors.push(not_a_cursor());
            None
        }
    };
    if !errors.is_empty() {
        return error_response(StatusCode::BAD_REQUEST, "invalid query", errors);
    }
    let mut fate = match app.store.fate(&source, &id).await {
        Ok(Some(f)) => f,
        Ok(None) => {
            return error_response(
                StatusCode::NOT_FOUND,
                "unknown event",
                vec![FieldError::new(
                    "",
                    format!("no event with id {id:?} and source {source:?} (or it expired)"),
                )],
            );
        }
        Err(e) => return store_error(&e),
    };
    if after.is_some_and(|a| a.event != fate.event.seq) {
        return error_response(
            StatusCode::BAD_REQUEST,
            "invalid query",
            vec![not_a_cursor()],
        );
    }
    let now = app.clock.now_ms();
    // Fan-out order (the stores read entries so; sorted here all the same, as the cursor
    // counts on it). A position: the page goes on after an entry that is gone since.
    fate.entries.sort_by_key(|e| e.id.idx);
    let dead = EntryRefs::of_dlq(&fate.dlq);
    let mut by_state: BTreeMap<&'static str, usize> =
        FateState::ALL.iter().map(|s| (s.name(), 0)).collect();
    for e in &fate.entries {
        *by_state
            .entry(FateState::of(e, &dead, now).name())
            .or_default() += 1;
    }
    let rest = fate
        .entries
        .iter()
        .filter(|e| after.is_none_or(|a| e.id.idx > a.idx));
    let page = page::take_page(rest, limit, |e| e.id.to_string());
    let stats = app.store.queue_stats();
    let in_flight = |target: &str| stats.get(target).map_or(0, |s| s.in_flight);
    let emitted = emitted_by(&app, &page.items, now).await;
    let targets: Vec<Value> = page
        .items
        .iter()
        .map(|e| {
            // A redriven entry's failures before its redrive count too: waiting again (its
            // target paused, say), it showed no error at all, and no reason why it had failed.
            let last_error = e
                .history
                .iter()
                .chain(&e.attempts)
                .rev()
                .find_map(|a| a.error.clone());
            let mut t = json!({
                "target": e.target_id,
                "rule": e.rule,
                "entry": e.id.to_string(),
                "state": FateState::of(e, &dead, now).name(),
                "attempt_count": e.attempts.len(),
                "attempts": e.attempts.iter().map(attempt_json).collect::<Vec<_>>(),
                // The attempts of the rounds before its redrives ("attempts reset, history
                // kept"): its DLQ entry, which showed them, is gone once it is redriven.
                "history": e.history.iter().map(attempt_json).collect::<Vec<_>>(),
                "next_attempt_at": (e.state == EntryState::Queued).then(|| rfc3339(e.due_at)),
                "waiting_on": (e.state == EntryState::Queued && e.lease.is_none())
                    .then(|| waiting_on(&app, e, in_flight(&e.target_id), now))
                    .flatten(),
                "last_error": last_error,
                "idempotency_key": e.idempotency_key,
                "ordering_key": e.ordering_key,
                "redrive_count": e.redrive_count,
            });
            // A replayed copy says which replay made it: its idempotency key differs from
            // the original's, and without this the fate showed no reason why.
            if let Some(job) = &e.replay {
                t["replay"] = json!(job);
            }
            if let Some(events) = emitted.get(&e.id) {
                t["emitted"] = json!(events);
            }
            t
        })
        .collect();
    // The page's DLQ entries: those of its targets, and on the first page those of no target
    // of the event (a quarantine; a dead letter whose queue entry was swept).
    let on_page = EntryRefs::of_entries(page.items.iter().copied());
    let of_any = EntryRefs::of_entries(fate.entries.iter());
    let dlq: Vec<Value> = fate
        .dlq
        .iter()
        .filter(|d| on_page.referred_by(d) || (after.is_none() && !of_any.referred_by(d)))
        .map(dlq_json)
        .collect();
    let ev = &fate.event;
    // An accepted event that went to no target: which live rules match it now, and whether
    // an operator disabled them. Its fate said `matched_rules: []` and nothing else, whether
    // no rule matched or a rule disabled at its acceptance did (then nothing is queued for
    // its targets: `router replay` over the window routes it again).
    let matches_now = (!ev.quarantined && fate.entries.is_empty()).then(|| {
        let rules = app.rules.load();
        let disabled = app.disabled_rules();
        rules
            .matches_event_counting(&ev.event, &mut 0)
            .into_iter()
            .map(|m| {
                json!({
                    "rule": m.rule,
                    "disabled_by_operator": disabled.contains(&m.rule),
                })
            })
            .collect::<Vec<_>>()
    });
    let fields = json!({
        "id": ev.event.id,
        "source": ev.event.source,
        "type": ev.event.ty,
        "accepted_at": rfc3339(ev.accepted_at),
        "ruleset_version": ev.ruleset_version,
        "matched_rules": ev.matched_rules,
        "unrouted_matches_now": matches_now,
        "quarantined": ev.quarantined,
        "targets_total": fate.entries.len(),
        "targets_by_state": by_state,
        "targets": targets,
        "targets_next": page.next,
        "dlq": dlq,
        "previous_copies": fate.previous.iter().map(|p| json!({
            "accepted_at": rfc3339(p.event.accepted_at),
            "dlq": p.dlq.iter().map(dlq_json).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    });
    with_event(fields, &ev.event)
}

/// The events each delivered handler entry of `entries` emitted, as `{source, id}` (what
/// their own fates are read by), from the delivery's COMPLETED record: an operator following
/// an event through a handler had no way from the parent to its emissions (a dead-lettered
/// emission's own fate and DLQ entry name the parent's handler, not the parent). Absent for
/// entries whose record has expired (`handlers.completed_ttl`) or whose target is no longer a
/// handler in the rules.
async fn emitted_by(
    app: &App,
    entries: &[&crate::store::QueueEntry],
    now: i64,
) -> HashMap<crate::store::EntryId, Vec<Value>> {
    let rules = app.rules.load();
    let mut out = HashMap::new();
    for e in entries {
        if e.state != EntryState::Delivered {
            continue;
        }
        let Some(crate::rules::TargetKind::Handler { name }) =
            rules.targets.get(&e.target_id).map(|t| &t.kind)
        else {
            continue;
        };
        let result = match app.store.completed_get(name, &e.idempotency_key, now).await {
            Ok(Some(r)) => r,
            Ok(None) => continue,
            Err(err) => {
                tracing::warn!(target = %e.target_id, error = %err, "cannot read a handler delivery's stored result for its fate");
                continue;
            }
        };
        let ids = serde_json::from_slice::<Value>(&result)
            .ok()
            .and_then(|v| v.get("emitted").cloned())
            .and_then(|v| serde_json::from_value::<Vec<String>>(v).ok())
            .unwrap_or_default();
        let source = format!("handler://{name}");
        out.insert(
            e.id,
            ids.into_iter()
                .map(|id| json!({ "source": source, "id": id }))
                .collect(),
        );
    }
    out
}

/// An answer whose `event` member is the stored event as it is delivered: its `data` is the
/// text the producer sent. Built as a `Value` (`to_json`), a number past what `f64` holds
/// exactly (18446744073709551616) showed as 1.8446744073709552e+19, though every target
/// received it as sent.
struct WithEvent<'a> {
    fields: Value,
    event: &'a crate::event::CloudEvent,
}

impl serde::Serialize for WithEvent<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let fields = self.fields.as_object();
        let mut m = s.serialize_map(Some(fields.map_or(0, |f| f.len()) + 1))?;
        for (k, v) in fields.into_iter().flatten() {
            m.serialize_entry(k, v)?;
        }
        let raw = serde_json::value::RawValue::from_string(
            String::from_utf8(self.event.structured_bytes(None))
                .map_err(serde::ser::Error::custom)?,
        )
        .map_err(serde::ser::Error::custom)?;
        m.serialize_entry("event", &raw)?;
        m.end()
    }
}

/// `fields` answered with the event as [`WithEvent`] writes it, in place of any summary of it
/// (a dead letter's id, source and type).
fn with_event(mut fields: Value, event: &crate::event::CloudEvent) -> Response {
    if let Value::Object(m) = &mut fields {
        m.remove("event");
    }
    axum::Json(WithEvent { fields, event }).into_response()
}

/// Query of `GET /v1/dlq`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DlqQuery {
    target: Option<String>,
    reason: Option<String>,
    rule: Option<String>,
    #[serde(rename = "type")]
    ty: Option<String>,
    source: Option<String>,
    since: Option<String>,
    until: Option<String>,
    after: Option<String>,
    limit: Option<usize>,
    /// Only what this handler emitted that went to the DLQ before any target.
    emitted_by: Option<String>,
}

/// `GET /v1/dlq`: filtered, cursor-paged listing.
pub async fn dlq_list(
    State(app): State<Arc<App>>,
    axum::Extension(who): axum::Extension<crate::auth::Principal>,
    ApiQuery(q): ApiQuery<DlqQuery>,
) -> Response {
    if let Err(r) = dlq_list_scope(&app, &who, q.target.as_deref(), q.emitted_by.as_deref()) {
        return *r;
    }
    if let Some(r) = refuse_unknown_dlq_target(&app, q.target.as_deref(), "/target", |id| {
        dlq_read_scope(&who, Some(id)).is_ok()
    })
    .await
    {
        return r;
    }
    let spec = crate::dlq::FilterSpec {
        target: q.target,
        reason: q.reason,
        rule: q.rule,
        ty: q.ty,
        source: q.source,
        since: q.since,
        until: q.until,
    };
    let (mut filter, mut errors) = match spec.to_filter("") {
        Ok(f) => (f, Vec::new()),
        Err(errors) => (DlqFilter::default(), errors),
    };
    if q.emitted_by.as_deref() == Some("") {
        // Read as "emitted by no handler" it matched nothing, which looks like a clean DLQ.
        errors.push(FieldError::new(
            "/emitted_by",
            "must not be empty: name the handler whose emissions to list",
        ));
    }
    filter.emitted_by = q.emitted_by;
    let after = match q.after.as_deref().map(str::parse::<u64>) {
        Some(Ok(a)) => Some(a),
        Some(Err(_)) => {
            errors.push(FieldError::new("/after", "cursor must be a DLQ entry id"));
            None
        }
        None => None,
    };
    let limit = q.limit.unwrap_or(100);
    if limit == 0 || limit > 1000 {
        errors.push(FieldError::new("/limit", "limit must be in 1..=1000"));
    }
    if !errors.is_empty() {
        return error_response(StatusCode::BAD_REQUEST, "invalid query", errors);
    }
    // One more than the page: `next` only when there is more (null on the last page).
    match app.store.dlq_list(&filter, after, limit + 1).await {
        Ok(mut list) => {
            let more = list.len() > limit;
            list.truncate(limit);
            let next = more
                .then(|| list.last().map(|d| d.id.to_string()))
                .flatten();
            axum::Json(json!({
                "entries": list.iter().map(dlq_json).collect::<Vec<_>>(),
                "next": next,
            }))
            .into_response()
        }
        Err(e) => store_error(&e),
    }
}

/// `GET /v1/dlq/{id}`: one entry with its full event.
pub async fn dlq_show(
    State(app): State<Arc<App>>,
    axum::Extension(who): axum::Extension<crate::auth::Principal>,
    Path(id): Path<String>,
) -> Response {
    let Ok(n) = id.parse::<u64>() else {
        return error_response(
            StatusCode::BAD_REQUEST,
            "invalid id",
            vec![FieldError::new("/id", "DLQ entry ids are integers")],
        );
    };
    let reads_all = who.allows(&crate::auth::Scope::Read);
    // Only a caller who may read every entry learns that an id does not exist or whose it
    // is: for a team token a missing id and another team's entry get the same 403, which
    // names no target, so ids cannot be probed.
    let not_yours = || crate::auth::forbidden(&who, "read (or dlq:<target> of the entry's target)");
    match app.store.dlq_get(n).await {
        Ok(Some((d, ev))) => {
            // An entry without a target (a quarantined event) is no team's: the same 403 as
            // another team's entry, as `GET /v1/dlq?target=none` answers; except a
            // handler's emission, which is the handler's team's (as `?emitted_by=` lists).
            let emitter_team = d
                .emitted_by
                .as_ref()
                .is_some_and(|by| owns_handler(&app, &who, &by.handler));
            if !(reads_all || team_covers_target(&who, d.target_id.as_deref()) || emitter_team) {
                return not_yours();
            }
            let mut v = dlq_json(&d);
            v["accepted_at"] = json!(rfc3339(ev.accepted_at));
            with_event(v, &ev.event)
        }
        Ok(None) if reads_all => error_response(
            StatusCode::NOT_FOUND,
            "unknown DLQ entry",
            vec![FieldError::new("/id", format!("no DLQ entry {n}"))],
        ),
        Ok(None) => not_yours(),
        Err(e) => store_error(&e),
    }
}

/// How recent a budget deferral (or the end of a throttle wait) must be for an entry's fate
/// to name it: while they hold a backlog the worker meets them every second or so.
const LIVE_HOLD_MS: i64 = 3_000;

/// What a queued entry waits for besides its due time, if anything an operator can act on:
/// its target paused (and whether its max_age runs out meanwhile), the target's breaker open,
/// its handler not uploaded, its ordering key held after a dead letter, an earlier entry of
/// its ordering key (which may be retrying for hours: a due entry that said nothing there read
/// as a stuck router), its target not running; and, once it is due, the target's retry
/// budget, throttle or concurrency, which hold a backlog that drains slower than it came.
fn waiting_on(app: &App, e: &crate::store::QueueEntry, in_flight: u64, now: i64) -> Option<String> {
    let Some(rt) = app.dispatcher.runtime(&e.target_id) else {
        return Some("the target is not running (see /v1/targets)".into());
    };
    let max_age = rt.spec.policy.retry.max_age;
    let expires = e
        .accepted_at
        .saturating_add(i64::try_from(max_age.as_millis()).unwrap_or(i64::MAX));
    // A pause or an open breaker does not stop max_age (it counts from acceptance): say so
    // once it has run out, since the entry then goes to the DLQ unsent at the resume.
    let past_max_age_until = |when: &str| {
        (now > expires).then(|| {
            format!(
                "; it is past its max_age ({}) and goes to the DLQ as max_age_exceeded, unsent, {when}",
                humantime::format_duration(max_age)
            )
        })
    };
    let past_max_age = || past_max_age_until("once the target resumes");
    if rt.paused.load(Ordering::SeqCst) {
        return Some(format!(
            "the target is paused by an operator{}",
            past_max_age().unwrap_or_default()
        ));
    }
    if let Some(b) = rt.breaker()
        && let crate::policy::breaker::BreakerState::Open { until } = b.state_at(now)
    {
        return Some(format!(
            "the target's breaker is open until {}{}",
            rfc3339(until),
            past_max_age().unwrap_or_default()
        ));
    }
    if let Some(until) = rt.retry_after_until(now) {
        return Some(format!(
            "the target's receiver asked to wait (429/503 with Retry-After): nothing is sent to it until {}{}",
            rfc3339(until),
            past_max_age().unwrap_or_default()
        ));
    }
    if let crate::rules::TargetKind::Handler { name } = &rt.spec.kind
        && let Some(Err(why)) = app.handlers.as_ref().map(|h| h.registry.lookup(name))
    {
        return Some(format!(
            "{why}: the delivery waits for it, without spending attempts, up to its max_age"
        ));
    }
    if let Some(key) = &e.ordering_key
        && app.store.held_keys(&e.target_id).contains(key)
    {
        return Some(format!(
            "its ordering key {key:?} is held after a dead letter (release it: `router targets release-key {} {key:?}`, POST /v1/targets/{}/keys/{}/release){}",
            e.target_id,
            crate::cli::seg(&e.target_id),
            crate::cli::seg(key),
            past_max_age_until(
                "when the key is released (with the key's other entries past max_age, without holding the key again)"
            )
            .unwrap_or_default()
        ));
    }
    // Read from the store's memory (no record is read), so a fate stays cheap.
    if let Some(key) = &e.ordering_key
        && let Some(head) = app.store.key_head(&e.target_id, key)
        && head.entry != e.id
    {
        return Some(format!(
            "waiting behind entry {} of its ordering key {key:?} ({}): a key's entries go one at a time, in order",
            head.entry,
            if head.in_flight {
                "being delivered now"
            } else {
                "not delivered yet: its own fate says what it waits for"
            }
        ));
    }
    // A retry the budget deferred is put back due at its turn: it may show a next attempt
    // in the future or, in a long backlog, one already past. Which retry was deferred is not
    // kept per entry, so this says what holds for every retry of the target now, not that
    // this one was deferred (one waiting out its backoff reads the same).
    let deferred_at = rt.counters.last_budget_deferred_at.load(Ordering::Relaxed);
    if !e.attempts.is_empty() && deferred_at > 0 && now.saturating_sub(deferred_at) <= LIVE_HOLD_MS
    {
        return Some(format!(
            "a retry, while the target's retry budget (ratio {}, plus {}/s) is deferring retries: past its next attempt time it waits its turn (budget_deferred in /v1/targets)",
            rt.budget().ratio(),
            crate::policy::budget::MIN_RETRIES_PER_SEC
        ));
    }
    if e.due_at > now {
        // A retry scheduled before a reload shortened max_age keeps its time (a reload's
        // policy applies from an entry's next attempt), and is then found past max_age: said
        // here, or the entry read as an ordinary retry until it went to the DLQ unsent.
        return past_max_age_until(&format!("at its next attempt time, {}", rfc3339(e.due_at)));
    }
    if now <= rt.counters.throttled_until.load(Ordering::Relaxed) + LIVE_HOLD_MS {
        let rate = rt
            .spec
            .policy
            .throttle
            .as_ref()
            .and_then(|t| t.rate_per_sec)
            .map_or_else(String::new, |r| format!(" ({r}/s)"));
        return Some(format!(
            "due, waiting for the target's throttle{rate}: entries go at its rate"
        ));
    }
    let slots = crate::deliver::slot_count(&rt.spec, &app.cfg.delivery) as u64;
    (in_flight >= slots).then(|| {
        format!("due, waiting for a free slot: {in_flight} attempts in flight, the target's concurrency is {slots}")
    })
}

fn target_json(app: &App, id: &str, stats: Option<&crate::store::QueueStats>, now: i64) -> Value {
    let rules = app.rules.load();
    let mut v = json!({ "id": id, "in_rule_set": rules.targets.contains_key(id) });
    if let Some(rt) = app.dispatcher.runtime(id) {
        let spec = &rt.spec;
        v["rule"] = json!(spec.rule);
        v["kind"] = json!(spec.kind);
        v["policy"] = json!(spec.policy_name);
        v["ordering"] = json!(spec.policy.ordering.as_ref().map(ToString::to_string));
        let worst = spec.worst_case();
        v["worst_case"] = json!({
            "attempts": worst.attempts,
            "seconds": worst.time.as_secs_f64(),
            "seconds_with_retry_after": worst.with_retry_after.as_secs_f64(),
            "seconds_if_blocked": worst.if_blocked.map(|d| d.as_secs_f64()),
        });
        if let Value::Object(m) = rt.snapshot(now) {
            for (k, x) in m {
                v[k] = x;
            }
        }
    } else {
        // Why, when the target is in the rules but could not start (a secret not set, the
        // WASM runtime down): the start error kept with the rule set's warnings.
        let prefix = format!("target {id}: ");
        let why = app
            .rule_warnings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|w| w.starts_with(&prefix))
            .cloned();
        v["worker"] = json!(match why {
            Some(w) => format!("not running: {}", &w[prefix.len()..]),
            None => "not running: the target is unknown or could not start (see the warnings in /v1/status)".to_string(),
        });
    }
    // A handler target's handler, as the registry has it now: one not uploaded (a typo, a
    // delete) or failed to load held every delivery with only a /v1/status warning to say so.
    let spec = rules
        .targets
        .get(id)
        .cloned()
        .or_else(|| app.dispatcher.runtime(id).map(|rt| rt.spec.clone()));
    if let Some(spec) = &spec
        && let crate::rules::TargetKind::Handler { name } = &spec.kind
        && app.handlers.is_some()
    {
        let why = crate::app::handler_not_loaded(app, &spec.kind);
        let state = match &why {
            None => "active",
            Some(crate::wasm::NotLoaded::NotUploaded(_)) => "not_uploaded",
            Some(crate::wasm::NotLoaded::Loading { .. }) => "compiling",
            Some(crate::wasm::NotLoaded::Failed { .. }) => "failed",
        };
        v["handler"] = json!({
            "name": name,
            "state": state,
            "reason": why.map(|w| w.to_string()),
        });
    }
    // Past it new entries for the target go to the DLQ as target_overflow: seen only once
    // they did.
    v["max_queue_depth"] = json!(spec.as_ref().map(|s| s.policy.max_queue_depth));
    let s = stats.cloned().unwrap_or_default();
    v["queued"] = json!(s.queued);
    v["in_flight"] = json!(s.in_flight);
    v["oldest_age_seconds"] = json!(
        s.oldest_accepted_at
            .map(|a| (now - a).max(0) as f64 / 1000.0)
    );
    v["dlq"] = json!(s.dlq);
    v["queued_behind_keys"] = json!(s.queued_behind_keys);
    v["held_keys"] = json!(app.store.held_keys(id));
    v
}

/// `GET /v1/targets/{id}`.
pub async fn target(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    let now = app.clock.now_ms();
    let stats = app.store.queue_stats();
    // A retired target (removed, drained, its worker stopped) is still answered while it
    // has dead letters: their count is what is left to see of it.
    if app.retired(&id) && stats.get(&id).is_none_or(|s| s.live() + s.dlq == 0) {
        return error_response(
            StatusCode::NOT_FOUND,
            "unknown target",
            vec![FieldError::new("/id", format!("no target {id:?}"))],
        );
    }
    axum::Json(target_json(&app, &id, stats.get(&id), now)).into_response()
}

async fn set_paused(app: &App, id: &str, paused: bool) -> Response {
    match app.dispatcher.set_paused(id, paused).await {
        Ok(true) => {
            let now = app.clock.now_ms();
            axum::Json(target_json(app, id, app.store.queue_stats().get(id), now)).into_response()
        }
        Ok(false) => error_response(
            StatusCode::NOT_FOUND,
            "unknown target",
            vec![FieldError::new("/id", format!("no running target {id:?}"))],
        ),
        Err(e) => change_store_error(&e, &format!("GET /v1/targets/{id}")),
    }
}

/// `POST /v1/targets/{id}/pause`: no more attempts; the queue fills. Persisted.
pub async fn pause_target(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    set_paused(&app, &id, true).await
}

/// `POST /v1/targets/{id}/resume`.
pub async fn resume_target(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    set_paused(&app, &id, false).await
}

/// `POST /v1/targets/{id}/keys/{key}/release`: lets an ordering key held after a dead letter
/// (`on_dead_letter: hold`) proceed. The key's waiting entries already past their max_age go
/// to the DLQ first, together (`max_age_exceeded`, unsent): each would be dead-lettered unsent
/// at its turn anyway, and under `hold` each such dead letter held the key again, so a
/// backlog of N expired entries took N releases. The answer counts them.
pub async fn release_key(
    State(app): State<Arc<App>>,
    Path((id, key)): Path<(String, String)>,
) -> Response {
    let mut expired = 0;
    if let Some(rt) = app.dispatcher.runtime(&id)
        && app.store.held_keys(&id).contains(&key)
    {
        let max_age = rt.spec.policy.retry.max_age;
        let now = app.clock.now_ms();
        let before = now.saturating_sub(i64::try_from(max_age.as_millis()).unwrap_or(i64::MAX));
        let why = format!(
            "not sent: event older than max_age {}; moved to the DLQ with its key's other expired entries when the key was released",
            humantime::format_duration(max_age)
        );
        match app
            .store
            .dead_letter_expired_of_key(&id, &key, before, &why, now)
            .await
        {
            Ok(n) => {
                crate::deliver::dead_lettered_in_bulk(
                    app.dispatcher.context(),
                    &id,
                    crate::store::DlqReason::MaxAgeExceeded,
                    n as u64,
                    &why,
                    now,
                );
                expired = n;
            }
            Err(e) => return store_error(&e),
        }
    }
    match app.store.release_key(&id, &key).await {
        Ok(true) => axum::Json(json!({
            "target": id,
            "key": key,
            "released": true,
            "dead_lettered_past_max_age": expired,
        }))
        .into_response(),
        Ok(false) => error_response(
            StatusCode::NOT_FOUND,
            "key not held",
            vec![FieldError::new(
                "/key",
                format!("{key:?} is not held on {id:?}"),
            )],
        ),
        Err(e) => store_error(&e),
    }
}

/// The git commit of the live rule set. Read again from the checkout while its rule files
/// are still the live set's (same version): the one noted at the last reload went stale when
/// the edit it called `-dirty` was committed, since a commit changes only `.git/`, which the
/// watcher ignores. Once the files differ (an edit not loaded yet, or refused), the commit
/// noted at the reload is the one that describes the live set. Read at most once per
/// `max_age` (two `git` runs and a hash of the rule files): within it, the commit noted last.
async fn live_git_commit(
    app: &Arc<App>,
    version: &str,
    max_age: std::time::Duration,
) -> Option<String> {
    let noted = || {
        app.reload_status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .rules_git_commit
            .clone()
    };
    {
        let mut st = app.reload_status.lock().unwrap_or_else(|p| p.into_inner());
        if st.git_checked_at.is_some_and(|at| at.elapsed() < max_age) {
            return st.rules_git_commit.clone();
        }
        // Noted before the read: concurrent callers within `max_age` take the noted commit
        // instead of each starting `git`.
        st.git_checked_at = Some(std::time::Instant::now());
    }
    let dir = app.cfg.rules_dir.clone();
    let version = version.to_owned();
    let fresh = tokio::task::spawn_blocking(move || {
        let on_disk = crate::rules::RuleSet::disk_version(&dir).ok()?;
        (on_disk == version).then(|| crate::rules::watch::git_commit(&dir))
    });
    match tokio::time::timeout(std::time::Duration::from_secs(5), fresh).await {
        Ok(Ok(Some(commit))) => {
            app.reload_status
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .rules_git_commit
                .clone_from(&commit);
            commit
        }
        _ => noted(),
    }
}

/// How old the git commit `/v1/status` shows may be.
const STATUS_GIT_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(2);

/// Query of `GET /v1/rules`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RulesQuery {
    /// Cursor: the rules after the one of this name, in file order (the `next` of the
    /// previous page).
    after: Option<String>,
    /// Page size (default and maximum [`page::MAX_PAGE`]).
    limit: Option<usize>,
}

/// `GET /v1/rules`: the live rule set, its rules a page at a time in file order (matching
/// costs the same at thousands of rules as at a few, so a set may hold thousands, each with
/// its pattern and targets). Each page carries the set's `version`: pages of two versions (a
/// reload between them) do not make one list.
pub async fn rules(State(app): State<Arc<App>>, ApiQuery(q): ApiQuery<RulesQuery>) -> Response {
    let r = app.rules.load();
    let limit = match page::page_limit(q.limit) {
        Ok(l) => l,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, "invalid query", vec![e]),
    };
    // Names are unique in a rule set; the page goes on after the named rule's position.
    let start = match q.after.as_deref() {
        None => 0,
        Some(name) => match r.rules.iter().position(|rule| rule.name == name) {
            Some(i) => i + 1,
            None => {
                return error_response(
                    StatusCode::BAD_REQUEST,
                    "invalid query",
                    vec![FieldError::new(
                        "/after",
                        format!(
                            "no rule {name:?} in the live rule set (version {}): give the `next` of the previous page; when the rules were reloaded since, read them again from the first page",
                            r.version
                        ),
                    )],
                );
            }
        },
    };
    let page = page::take_page(&r.rules[start..], limit, |rule| rule.name.clone());
    let disabled = app.disabled_rules();
    let git_commit = live_git_commit(&app, &r.version, std::time::Duration::ZERO).await;
    let switch = |name: &str| disabled.get(name).cloned().unwrap_or_default();
    let unrouted = app
        .metrics
        .ingest_unrouted
        .get_or_create(&vec![("cause", "rule_disabled".to_string())])
        .get();
    axum::Json(json!({
        "version": r.version,
        "files": r.files,
        "git_commit": git_commit,
        "next": page.next,
        "rules": page.items.iter().map(|rule| {
            let (matched, last) = app.metrics.rule_matches(&rule.name);
            json!({
                "name": rule.name,
                "file": rule.file,
                "line": rule.line,
                "enabled": rule.enabled && !disabled.contains(&rule.name),
                "disabled_by_operator": disabled.contains(&rule.name),
                // When and by whom (null: not disabled by an operator, a switch stored before
                // these were kept, or auth off for `disabled_by`).
                "disabled_at": switch(&rule.name).disabled_at,
                "disabled_by": switch(&rule.name).disabled_by,
                "pattern": rule.pattern_json,
                "targets": rule.target_ids,
                // This node's count since it started (router_rule_matched_events_total).
                "matched_events": matched,
                "last_matched_at": last.map(rfc3339),
            })
        }).collect::<Vec<_>>(),
        // Events accepted since start whose only matching rules an operator disabled
        // (router_ingest_unrouted_total{cause="rule_disabled"}): routed nowhere.
        "unrouted_rule_disabled_events": unrouted,
        // Operator switches naming no live rule (renamed or removed since): each would stop a
        // rule of that name the moment one came back. `rules enable NAME` clears one.
        "disabled_absent": disabled
            .names()
            .filter(|n| !r.rules.iter().any(|rule| &rule.name == *n))
            .collect::<std::collections::BTreeSet<_>>(),
    }))
    .into_response()
}

/// `POST /v1/rules/test`: which live rules and targets an event (structured CloudEvent JSON,
/// checked as ingest checks it) matches. Changes nothing.
pub async fn rules_test(State(app): State<Arc<App>>, body: axum::body::Bytes) -> Response {
    let ev: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid JSON",
                vec![FieldError::new("", e.to_string())],
            );
        }
    };
    let rules = app.rules.load_full();
    // Matched where ingest would match it: off the reactor when the rules make it costly.
    let weight = rules.match_cost(body.len());
    let set = rules.clone();
    let matched =
        match crate::ingest::off_reactor_if_large(weight, move || set.test_event(ev)).await {
            Ok(Ok(m)) => m,
            Ok(Err(errors)) => {
                return error_response(StatusCode::BAD_REQUEST, "not a valid CloudEvent", errors);
            }
            Err(e) => {
                tracing::error!(error = %e, "matching a test event failed");
                return error_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal error while matching the event",
                    Vec::new(),
                );
            }
        };
    let disabled = app.disabled_rules();
    // Rules an operator disabled are listed, marked: "it matches, but is switched off" is
    // what someone asking why an event went nowhere needs to read.
    let matches: Vec<Value> = matched
        .into_iter()
        .map(|m| {
            let targets: Vec<Value> = m
                .target_ids
                .iter()
                .filter_map(|t| rules.targets.get(t))
                .map(|t| json!({ "id": t.id, "kind": t.kind, "policy": t.policy_name }))
                .collect();
            json!({
                "rule": m.rule,
                "disabled_by_operator": disabled.contains(&m.rule),
                "targets": targets,
            })
        })
        .collect();
    axum::Json(json!({ "rules_version": rules.version, "matches": matches })).into_response()
}

/// `POST /v1/admin/reload`: reload rules and contracts now.
pub async fn reload(State(app): State<Arc<App>>) -> Response {
    match crate::app::reload(&app, "api").await {
        Ok(report) => axum::Json(json!(report)).into_response(),
        Err(crate::app::ReloadError::Invalid(msg)) => error_response(
            StatusCode::UNPROCESSABLE_ENTITY,
            "reload refused; the previous rules and contracts stay live",
            problems_as_errors(&msg),
        ),
        Err(crate::app::ReloadError::RulesRefused(msg)) => error_response(
            StatusCode::UNPROCESSABLE_ENTITY,
            "rules refused; the previous rules stay live (contracts reload apart: the directory's are live)",
            problems_as_errors(&msg),
        ),
        Err(crate::app::ReloadError::ContractsRefused(msg)) => error_response(
            StatusCode::UNPROCESSABLE_ENTITY,
            "contracts refused; the previous contracts stay live (rules reload apart: the directory's are live)",
            problems_as_errors(&msg),
        ),
        Err(crate::app::ReloadError::Store(e)) => store_error(&e),
    }
}

/// A refused reload's problems as the errors of its answer, one each (a problem that spans
/// lines, such as a schema error with its context, stays one).
pub(crate) fn problems_as_errors(problems: &[String]) -> Vec<FieldError> {
    problems.iter().map(|p| FieldError::new("", p)).collect()
}

/// `GET /v1/status`.
pub async fn status(State(app): State<Arc<App>>) -> Response {
    // The commit as `/v1/rules` says it (an edit committed since the last reload changes
    // only `.git/`, which no reload follows); read again at most every few seconds, since
    // dashboards poll this.
    let version = app.rules.load().version.clone();
    live_git_commit(&app, &version, STATUS_GIT_MAX_AGE).await;
    let rules = app.rules.load();
    let contracts = app.contracts.load();
    let now = app.clock.now_ms();
    // Store reads first: none of them may wait while the status locks below are held. At
    // once and within one bound (as /metrics): a store that does not answer shows as such
    // instead of holding the answer for a request timeout per read.
    let deadline = tokio::time::Instant::now() + crate::telemetry::STORE_READS_BOUND;
    let (store_bytes, records, handler_kv, jobs) = tokio::join!(
        tokio::time::timeout_at(deadline, app.store.disk_bytes()),
        tokio::time::timeout_at(deadline, records_status(&app)),
        tokio::time::timeout_at(deadline, handler_kv_status(&app)),
        tokio::time::timeout_at(deadline, jobs_status(&app)),
    );
    let unanswered = format!(
        "the store did not answer within {:?}",
        crate::telemetry::STORE_READS_BOUND
    );
    // Unknown (null) while the store cannot say, not 0.
    let store_bytes = store_bytes.ok().flatten();
    let records = records.unwrap_or_else(|_| json!({ "error": unanswered }));
    let handler_kv = handler_kv.unwrap_or_else(
        |_| json!({ "max_bytes": app.cfg.handlers.kv_max_bytes, "error": unanswered }),
    );
    let jobs = jobs.unwrap_or_else(|_| json!({ "active": [], "error": unanswered }));
    let removed_targets = crate::app::removed_target_warnings(&app);
    axum::Json(json!({
        "version": env!("CARGO_PKG_VERSION"),
        // Which node answers, on a shared store (`<data_dir>/node-id`, a job's `runner`):
        // most figures here are this node's own. Null on the embedded store.
        "node": app.store.node_id(),
        "started_at": rfc3339(app.started_at),
        "uptime_seconds": (now - app.started_at) / 1000,
        "ready": app.ready.load(Ordering::SeqCst),
        "rules": { "version": rules.version, "files": rules.files, "rules": rules.rules.len(), "dir": app.cfg.rules_dir },
        "reload": *app.reload_status.lock().unwrap_or_else(|p| p.into_inner()),
        "contracts": { "version": contracts.version(), "count": contracts.contracts().len(), "dir": app.cfg.contracts_dir },
        // Back-pressure: past `max_in_flight_bytes` or `max_in_flight_events` producers
        // wait, then get 503; past `connections.max` a new connection gets 503 and is closed.
        "ingest": {
            "in_flight_bytes": app.ingest_admission.in_flight_bytes(),
            "max_in_flight_bytes": app.ingest_admission.capacity(),
            "in_flight_events": app.ingest_admission.in_flight_events(),
            "max_in_flight_events": app.ingest_admission.events_capacity(),
            "saturated_total": app.ingest_admission.refused(),
            "saturated": {
                "bytes": app.ingest_admission.refused_by(crate::ingest::admission::Bound::Bytes),
                "events": app.ingest_admission.refused_by(crate::ingest::admission::Bound::Events),
            },
        },
        "connections": {
            "open": app.connections.open(),
            "max": app.connections.limit(),
            "refused_total": app.connections.refused(),
            // `server.ops_listen`: probes and scrapes, apart from producers. Null when unset.
            "ops": app.ops.as_ref().map(|ops| json!({
                "listen": ops.addr.to_string(),
                "open": ops.connections.open(),
                "max": ops.connections.limit(),
                "refused_total": ops.connections.refused(),
            })),
        },
        "store": {
            "backend": app.cfg.store.backend,
            // On JetStream: what the server holds for this store's stream (null while the
            // server cannot be asked).
            "bytes": store_bytes,
            "dir": app.cfg.data_dir,
            "max_bytes": app.cfg.store.max_disk_bytes,
            "ingest_refused": app.disk_full.load(Ordering::Relaxed),
            // False while the store is being reopened after a write error (full or failing
            // disk), or on JetStream while the server is out of reach or its last commit
            // failed: every write answers 503 meanwhile.
            "writable": app.store.writable(),
            // Which durable write path commits take: synced redb commits, or the group log
            // (`router.log`) with periodic checkpoints.
            "group_log": app.cfg.store.group_log,
            // With the group log: the longest time between two checkpoints.
            "checkpoint_interval_ms": app.cfg.store.checkpoint_interval.as_secs_f64() * 1000.0,
            // Added to a 202's wait under a steady load (docs/operations.md).
            "commit_delay_ms": app.cfg.store.commit_delay.as_secs_f64() * 1000.0,
            "compacting": app.store.compacting(),
            "last_compaction": app.store.last_compaction().map(|c| json!({
                "finished_at": rfc3339(c.finished_at),
                "took_ms": c.took_ms,
                "before_bytes": c.before_bytes,
                "after_bytes": c.after_bytes,
                "error": c.error,
            })),
            // What delivery met in the store since start: deliveries set aside because their
            // event's record cannot be read, and targets whose leases fail now.
            "faults": app.dispatcher.store_faults().status(),
        },
        // The delivery runtime's threads, and the attempts in flight across webhook and NATS
        // targets against `delivery.max_in_flight`.
        "delivery": {
            "threads": app.delivery_threads.threads,
            "nice": app.delivery_threads.nice,
            "error": app.delivery_threads.error,
            "in_flight": app.dispatcher.context().in_flight.in_flight(),
            "max_in_flight": app.dispatcher.context().in_flight.max(),
            // Bytes of events leased deliveries hold, against `delivery.max_in_flight_bytes`.
            "in_flight_bytes": app.dispatcher.context().bytes.in_flight_bytes(),
            "max_in_flight_bytes": app.dispatcher.context().bytes.max_bytes(),
            // The most bytes one target holds while others wait for room (each target's
            // `in_flight_bytes` is in /v1/targets).
            "byte_fair_share": app.dispatcher.context().bytes.fair_share_bytes(),
        },
        // The connection nats: targets share; null until one starts it.
        "nats": app.dispatcher.nats().status(),
        // Live router nodes on the store (1 on the embedded one): each target's throttle rate
        // is split among them.
        "nodes": app.dispatcher.nodes(),
        "records": records,
        "handler_kv": handler_kv,
        "jobs": jobs,
        // On a shared store: how this node follows the handlers the nodes share.
        "handler_catalog": app.handlers.as_ref().map(|rt| rt.changes.status()),
        // On a shared store: how this node follows the contracts put over the API elsewhere.
        "contract_catalog": app.shared_contracts.as_ref().map(|c| c.status()),
        // On a shared store: how this node follows the pauses, rule switches and open
        // breakers of the other nodes.
        "containment_sync": app.store.shared().then(|| app.dispatcher.containment_sync()),
        "warnings": app
            .warnings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .chain(app.rule_warnings.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned())
            .chain(missing_handler_warnings(&app, &rules))
            .chain(held_off_warnings(&app, now))
            .chain(removed_targets)
            .chain(app.disk_full.load(Ordering::Relaxed).then(|| format!(
                "ingest answers 503: the store is past its disk high-water mark (store.max_disk_bytes = {}); delivery continues, ingest resumes below the low-water mark (docs/operations.md has the runbook)",
                app.cfg.store.max_disk_bytes
            )))
            .chain(app.dispatcher.store_faults().warnings())
            .collect::<Vec<_>>(),
    }))
    .into_response()
}

/// One warning per target its receiver holds off with `Retry-After`: the whole queue waits
/// for it, and it said so only in an event's fate and `GET /v1/targets/{id}`.
fn held_off_warnings(app: &App, now: i64) -> Vec<String> {
    let mut held: Vec<(String, i64)> = app
        .dispatcher
        .runtimes()
        .iter()
        .filter_map(|rt| Some((rt.spec.id.clone(), rt.retry_after_until(now)?)))
        .collect();
    held.sort();
    held.into_iter()
        .map(|(id, until)| format!(
            "target {id}: its receiver asked to be left alone (429/503 with Retry-After): nothing is sent to it until {}; `router targets resume {id}` (POST /v1/targets/{id}/resume) lifts it once the receiver is back",
            rfc3339(until)
        ))
        .collect()
}

/// One warning per live rule target whose handler does not run here (not uploaded or
/// deleted, being compiled after the start, or failed to load, each said as such), read from
/// the registry at each request: the one the loader gave at start went stale after an upload,
/// and a handler deleted later had none at all, while its deliveries waited without a word.
fn missing_handler_warnings(app: &App, rules: &crate::rules::RuleSet) -> Vec<String> {
    let Some(h) = app.handlers.as_ref() else {
        return Vec::new();
    };
    rules
        .targets
        .values()
        .filter_map(|t| match &t.kind {
            crate::rules::TargetKind::Handler { name } => {
                h.registry.lookup(name).err().map(|why| {
                    format!(
                        "target {}: {why}: its deliveries wait for it, up to their max_age",
                        t.id
                    )
                })
            }
            _ => None,
        })
        .collect()
}

/// The jobs still to finish (running and paused), oldest first, with their progress and when
/// each last went through an item: a job that stands still shows here, without knowing its
/// id.
async fn jobs_status(app: &App) -> serde_json::Value {
    match app.store.jobs().await {
        Ok(mut jobs) => {
            jobs.retain(|j| !j.state.finished());
            jobs.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
            let active: Vec<Value> = jobs
                .into_iter()
                .map(|j| {
                    let j = app.jobs.shown(j);
                    json!({
                        "id": j.id,
                        "kind": j.kind,
                        "state": j.state,
                        "total": j.total,
                        "moved": j.moved,
                        "failed": j.failed,
                        "skipped": j.skipped,
                        "expired": j.expired,
                        "created_at": rfc3339(j.created_at),
                        "last_item_at": j.last_item_at.map(rfc3339),
                        "last_error": j.last_error,
                    })
                })
                .collect();
            json!({ "active": active })
        }
        Err(e) => json!({ "active": [], "error": e.to_string() }),
    }
}

/// What each age-bounded kind of record holds, with its bound.
async fn records_status(app: &App) -> serde_json::Value {
    let secs = |d: std::time::Duration| d.as_secs();
    let c = &app.cfg;
    match app.store.record_counts().await {
        Ok(n) => json!({
            "events": {
                "count": n.events,
                "retention_seconds": secs(c.event_retention()),
                "above_floor": n.events_above_floor,
            },
            "dedup_keys": {
                // Every key held: for as long as its event is kept, and on the embedded store
                // until its whole run goes (docs/operations.md), so well past the window.
                "count": n.dedup_keys,
                "in_window": n.dedup_keys_in_window,
                "window_seconds": secs(c.ingest.dedup_window),
                "runs": n.dedup_runs,
                "filter_bytes": n.dedup_filter_bytes,
                "cold_runs": n.dedup_cold_runs,
            },
            "completed": { "count": n.completed, "ttl_seconds": secs(c.handlers.completed_ttl) },
        }),
        Err(e) => json!({ "error": e.to_string() }),
    }
}

/// Each handler's key-value namespace against its bound (`handlers.kv_max_bytes`).
async fn handler_kv_status(app: &App) -> serde_json::Value {
    let max = app.cfg.handlers.kv_max_bytes;
    match app.store.kv_usage().await {
        Ok(usage) => json!({
            "max_bytes": max,
            "namespaces": usage
                .into_iter()
                .map(|(h, u)| (h, json!({ "bytes": u.bytes, "keys": u.keys, "used_fraction": u.bytes as f64 / max.max(1) as f64 })))
                .collect::<serde_json::Map<_, _>>(),
        }),
        Err(e) => json!({ "max_bytes": max, "error": e.to_string() }),
    }
}

/// `GET /metrics`.
pub async fn metrics(State(app): State<Arc<App>>) -> Response {
    // Read from the workers at each scrape: a pause restored at start or followed from another
    // node shows as well as one made through this node's API. Every breaker, not only those
    // that changed state since start: one restored open from the store had no series, and an
    // alert on it stayed silent. Targets a reload removed (once drained) or whose breaker it
    // removed lose their series.
    let mut paused = Vec::new();
    let mut breakers = Vec::new();
    let mut held = Vec::new();
    let mut caps = Vec::new();
    for rt in app.dispatcher.runtimes() {
        paused.push((rt.spec.id.clone(), rt.paused.load(Ordering::SeqCst)));
        caps.push((rt.spec.id.clone(), rt.spec.policy.max_queue_depth));
        held.push((
            rt.spec.id.clone(),
            rt.retry_after_until(app.clock.now_ms())
                .map_or(0, |until| until.div_euclid(1000)),
        ));
        // In effect now: an open period that ended during a pause is over (half-open), and
        // an alert on 1 must not go on firing for a contained target.
        if let Some(b) = rt.breaker() {
            breakers.push((rt.spec.id.clone(), b.state_at(app.clock.now_ms()).gauge()));
        }
    }
    app.metrics.set_worker_gauges(&paused, &breakers);
    app.metrics.set_held_off(&held);
    app.metrics.set_queue_max_depth(&caps);
    if let Some(nats) = app.dispatcher.nats().status() {
        app.metrics
            .nats_connected
            .get_or_create(&vec![("url", nats.url)])
            .set(i64::from(nats.connected));
    }
    app.metrics
        .store_max_bytes
        .set(i64::try_from(app.cfg.store.max_disk_bytes).unwrap_or(i64::MAX));
    app.metrics
        .ingest_refused
        .set(i64::from(app.disk_full.load(Ordering::Relaxed)));
    let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
    app.metrics
        .ingest_in_flight_bytes
        .set(gauge(app.ingest_admission.in_flight_bytes()));
    app.metrics
        .ingest_max_in_flight_bytes
        .set(gauge(app.ingest_admission.capacity()));
    app.metrics
        .ingest_in_flight_events
        .set(gauge(app.ingest_admission.in_flight_events()));
    app.metrics
        .ingest_max_in_flight_events
        .set(gauge(app.ingest_admission.events_capacity()));
    app.metrics
        .http_connections
        .set(gauge(app.connections.open()));
    app.metrics
        .http_max_connections
        .set(gauge(app.connections.limit()));
    app.metrics.http_ops_connections.set(gauge(
        app.ops.as_ref().map_or(0, |ops| ops.connections.open()),
    ));
    app.metrics.store_up.set(i64::from(app.store.writable()));
    let failing = app
        .reload_status
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .last_error
        .is_some();
    app.metrics.reload_failing.set(i64::from(failing));
    if let Some(h) = &app.handlers {
        let mut loaded: std::collections::BTreeMap<String, bool> = h
            .registry
            .list()
            .into_iter()
            .map(|i| (i.name, i.state == crate::wasm::HandlerState::Loaded))
            .collect();
        // A handler the live rules route to but that has no version here (never uploaded,
        // or deleted) is 0 too: its deliveries wait as they do for one that failed to load,
        // and an alert on `router_handler_loaded == 0` must see a mistaken delete, which
        // used to remove the series instead.
        for t in app.rules.load().targets.values() {
            if let crate::rules::TargetKind::Handler { name } = &t.kind {
                loaded.entry(name.clone()).or_insert(false);
            }
        }
        let loaded: Vec<(String, bool)> = loaded.into_iter().collect();
        app.metrics.set_handler_loaded(&loaded);
    }
    let body = app
        .metrics
        .render_without(app.store.as_ref(), app.clock.now_ms(), &|t| app.retired(t))
        .await;
    (
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

/// `GET /healthz`: the process is up.
pub async fn healthz() -> Response {
    axum::Json(json!({ "status": "ok" })).into_response()
}

/// `GET /readyz`: ready to accept events (store open, workers started, not shutting down).
pub async fn readyz(State(app): State<Arc<App>>) -> Response {
    // Not ready while the store takes no writes: a balancer then sends producers elsewhere.
    if app.ready.load(Ordering::SeqCst) && app.store.writable() {
        match &app.handlers_error {
            // Ready for what its rules deliver to (a start with handler targets stops
            // instead), but not for handlers: said here, where a deploy looks.
            Some(why) => {
                axum::Json(json!({ "status": "ready", "degraded": [why] })).into_response()
            }
            None => axum::Json(json!({ "status": "ready" })).into_response(),
        }
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({ "status": "not ready" })),
        )
            .into_response()
    }
}

/// Reading the DLQ: `read`, or `dlq:<target>` for entries of that target (the request must
/// name the target).
fn dlq_read_scope(who: &crate::auth::Principal, target: Option<&str>) -> Result<(), Box<Response>> {
    if who.allows(&crate::auth::Scope::Read) {
        return Ok(());
    }
    match target {
        // Dead letters without a target are every producer's quarantined events: no team's.
        Some(crate::store::NO_TARGET) => Err(Box::new(crate::auth::forbidden(who, "read"))),
        Some(t) => crate::auth::require(who, &crate::auth::Scope::Dlq(t.to_string())),
        None => Err(Box::new(crate::auth::forbidden(
            who,
            "read (or dlq:<target> with a target filter)",
        ))),
    }
}

/// Listing the DLQ: as [`dlq_read_scope`]; and with an `emitted_by` filter (and no target
/// other than `none`), the team of that handler, as it reads the handler's logs: what its
/// handler emitted that went to the DLQ before any target (out of its owner's ingest scope,
/// past the hop limit, failing a contract) is its team's output, with no target whose
/// `dlq:` scope would open it.
fn dlq_list_scope(
    app: &App,
    who: &crate::auth::Principal,
    target: Option<&str>,
    emitted_by: Option<&str>,
) -> Result<(), Box<Response>> {
    let Some(handler) = emitted_by else {
        return dlq_read_scope(who, target).map_err(|r| {
            // The team of a handler that looks for its handler's dead emissions under
            // `target=none` is told where they are.
            if target == Some(crate::store::NO_TARGET) && who.has_handler_scopes() {
                Box::new(crate::auth::forbidden(
                    who,
                    "read (a handler's team lists what its handler emitted that went to the DLQ before any target with emitted_by=<handler>)",
                ))
            } else {
                r
            }
        });
    };
    if target.is_none_or(|t| t == crate::store::NO_TARGET) && owns_handler(app, who, handler) {
        return Ok(());
    }
    if who.allows(&crate::auth::Scope::Read) {
        return Ok(());
    }
    match target {
        Some(t) if t != crate::store::NO_TARGET => dlq_read_scope(who, target),
        _ => Err(Box::new(crate::auth::forbidden(
            who,
            &format!(
                "read, or handlers:{handler} as a member of the team that owns handler {handler:?} (the team whose token can read its logs)"
            ),
        ))),
    }
}

/// Whether `who` is of the team of handler `name` and holds `handlers:<name>`: what reading
/// the handler's logs takes (`GET /v1/handlers/{name}/logs`), and so its emissions'
/// dead letters.
fn owns_handler(app: &App, who: &crate::auth::Principal, name: &str) -> bool {
    if !who.allows(&crate::auth::Scope::Handlers(name.to_string())) {
        return false;
    }
    let Some(rt) = app.handlers.as_ref() else {
        return false;
    };
    match rt.registry.index(name) {
        Some(index) => index.check_owner(&who.uploader()).is_ok(),
        // Loaded without a readable index: its logs are open to the scope, as here.
        None => rt.registry.get(name).is_some(),
    }
}

/// Changing the DLQ (redrive, purge): `admin`, or `dlq:<target>` with that target in the
/// filter — a team can never redrive another team's dead letters.
fn dlq_write_scope(
    who: &crate::auth::Principal,
    target: Option<&str>,
) -> Result<(), Box<Response>> {
    if who.allows(&crate::auth::Scope::Admin) {
        return Ok(());
    }
    match target {
        Some(crate::store::NO_TARGET) => Err(Box::new(crate::auth::forbidden(who, "admin"))),
        Some(t) => crate::auth::require(who, &crate::auth::Scope::Dlq(t.to_string())),
        None => Err(Box::new(crate::auth::forbidden(
            who,
            "admin (or dlq:<target> with a target filter)",
        ))),
    }
}

fn job_error(e: crate::dlq::JobError) -> Response {
    use crate::dlq::JobError;
    match e {
        JobError::Invalid(errors) => {
            error_response(StatusCode::BAD_REQUEST, "invalid request", errors)
        }
        JobError::NotFound => error_response(
            StatusCode::NOT_FOUND,
            "unknown job",
            vec![FieldError::new("/job", "no job of this kind has this id")],
        ),
        JobError::Conflict(state) => error_response(
            StatusCode::CONFLICT,
            "the job cannot change to that state",
            vec![FieldError::new(
                "/state",
                format!(
                    "the job is {}",
                    serde_json::to_value(state).unwrap_or_default()
                ),
            )],
        ),
        JobError::UnknownTarget { target, .. } => unknown_redrive_target(&target, None),
        JobError::DiskFull => crate::ingest::with_retry_after(
            error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "the store is past its disk high-water mark; replays can be started again below its low-water mark",
                Vec::new(),
            ),
            crate::ingest::DISK_FULL_RETRY_AFTER_S,
        ),
        // Not the store's fault (it refused each number another job had just taken): a
        // warning, and a 503 that says to send the request again.
        JobError::CreationRace => {
            tracing::warn!("a job creation lost the race for a number too many times");
            crate::ingest::with_retry_after(
                error_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "too many jobs were created at once; nothing was created, send the request again",
                    Vec::new(),
                ),
                1,
            )
        }
        JobError::Store(e) => store_error(&e),
    }
}

/// 404 for a redrive naming a target the router does not know, with the closest known id the
/// caller may redrive (`suggestion`) when there is one.
fn unknown_redrive_target(target: &str, suggestion: Option<&str>) -> Response {
    unknown_dlq_target("/filter/target", target, suggestion)
}

/// A DLQ read or purge whose `target` filter names a target the router does not know answers
/// 404 as a redrive does, with the closest id `allowed` lets the caller see (a team token
/// must not learn other teams' target ids from its typos). A typo used to answer "no dead
/// letters", exit 0, while the redrive of the same typo was refused. `None`: known, or an
/// error response to give as is.
async fn refuse_unknown_dlq_target(
    app: &App,
    target: Option<&str>,
    pointer: &str,
    allowed: impl Fn(&str) -> bool,
) -> Option<Response> {
    match crate::dlq::check_target(app, target?).await {
        Ok(()) => None,
        Err(crate::dlq::JobError::UnknownTarget { target, known }) => {
            let suggestion = known.iter().find(|id| allowed(id));
            Some(unknown_dlq_target(
                pointer,
                &target,
                suggestion.map(String::as_str),
            ))
        }
        Err(e) => Some(job_error(e)),
    }
}

/// 404 for a DLQ request whose target (at `pointer`) the router does not know.
fn unknown_dlq_target(pointer: &str, target: &str, suggestion: Option<&str>) -> Response {
    let hint = crate::dlq::did_you_mean(suggestion);
    error_response(
        StatusCode::NOT_FOUND,
        "unknown target",
        vec![FieldError::new(
            pointer,
            format!(
                "no target {target:?} in the live rules, running, or with dead letters{hint} (`none` selects the dead letters without a target; GET /v1/targets lists them)"
            ),
        )],
    )
}

fn job_json(j: &crate::store::Job) -> Value {
    json!({
        "id": j.id,
        "kind": j.kind,
        "state": j.state,
        "spec": j.spec,
        "total": j.total,
        "moved": j.moved,
        "failed": j.failed,
        "skipped": j.skipped,
        "skipped_emitted": j.skipped_emitted,
        "skipped_contract": j.skipped_contract,
        "skipped_restricted": j.skipped_restricted,
        "expired": j.expired,
        "warnings": j.warnings,
        "last_item_at": j.last_item_at.map(rfc3339),
        "cursor": j.cursor,
        "created_at": rfc3339(j.created_at),
        "updated_at": rfc3339(j.updated_at),
        "last_error": j.last_error,
        // On a store several nodes share: which node runs it, and when it last said so.
        "runner": j.runner,
        "heartbeat_at": (j.runner.is_some() && j.heartbeat_at > 0).then(|| rfc3339(j.heartbeat_at)),
    })
}

/// Most histogram buckets of one summary group: a finer bucket over a long DLQ would answer
/// with one bucket per entry.
const MAX_SUMMARY_BUCKETS: usize = 10_000;

/// Query of `GET /v1/dlq/summary`: the filter of `GET /v1/dlq` and the histogram's bucket.
/// A struct rather than a map, so that a parameter given twice is refused (`duplicate
/// field`) as `GET /v1/dlq` refuses it, not silently read as its last value.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SummaryQuery {
    target: Option<String>,
    reason: Option<String>,
    rule: Option<String>,
    #[serde(rename = "type")]
    ty: Option<String>,
    source: Option<String>,
    since: Option<String>,
    until: Option<String>,
    bucket: Option<String>,
}

/// The summary's bucket width in milliseconds: `bucket` (default 1h), a whole number of
/// seconds, at least one. A width with a fraction of a second (`1500ms`) is refused: the
/// answer gives the width as `bucket_seconds`, which then said 1 while the buckets were 1.5 s
/// apart, and the CLI counted spans and gaps from it.
fn summary_bucket_ms(bucket: Option<&str>) -> Result<i64, FieldError> {
    match bucket.map(humantime::parse_duration) {
        None => Ok(3_600_000),
        Some(Ok(d)) if d.as_secs() >= 1 && d.subsec_nanos() == 0 => {
            Ok(i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        }
        Some(_) => Err(FieldError::new(
            "/bucket",
            "a duration of whole seconds, at least 1s, e.g. 90s, 5m or 1h",
        )),
    }
}

/// `GET /v1/dlq/summary`: counts by target × reason with first/last time and a histogram.
pub async fn dlq_summary(
    State(app): State<Arc<App>>,
    axum::Extension(who): axum::Extension<crate::auth::Principal>,
    ApiQuery(q): ApiQuery<SummaryQuery>,
) -> Response {
    if let Err(r) = dlq_read_scope(&who, q.target.as_deref()) {
        return *r;
    }
    if let Some(r) = refuse_unknown_dlq_target(&app, q.target.as_deref(), "/target", |id| {
        dlq_read_scope(&who, Some(id)).is_ok()
    })
    .await
    {
        return r;
    }
    let spec = crate::dlq::FilterSpec {
        target: q.target,
        reason: q.reason,
        rule: q.rule,
        ty: q.ty,
        source: q.source,
        since: q.since,
        until: q.until,
    };
    let bucket_ms = match summary_bucket_ms(q.bucket.as_deref()) {
        Ok(ms) => ms,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, "invalid query", vec![e]),
    };
    let filter = match spec.to_filter("") {
        Ok(f) => f,
        Err(errors) => return error_response(StatusCode::BAD_REQUEST, "invalid query", errors),
    };
    match app.store.dlq_summary(&filter, bucket_ms).await {
        Ok(rows) if rows.iter().any(|r| r.histogram.len() > MAX_SUMMARY_BUCKETS) => error_response(
            StatusCode::BAD_REQUEST,
            "invalid query",
            vec![FieldError::new(
                "/bucket",
                format!(
                    "more than {MAX_SUMMARY_BUCKETS} buckets of {}s: use a larger bucket or a narrower since/until",
                    bucket_ms / 1000
                ),
            )],
        ),
        Ok(rows) => {
            let groups: Vec<Value> = rows
                .iter()
                .map(|r| {
                    json!({
                        "target": r.target,
                        "reason": r.reason,
                        "count": r.count,
                        "first_failure_at": rfc3339(r.first_failure_at),
                        "last_failure_at": rfc3339(r.last_failure_at),
                        "histogram": r.histogram.iter().map(|(t, n)| json!({ "bucket": rfc3339(*t), "count": n })).collect::<Vec<_>>(),
                    })
                })
                .collect();
            let total: u64 = rows.iter().map(|r| r.count).sum();
            axum::Json(
                json!({ "total": total, "bucket_seconds": bucket_ms / 1000, "groups": groups }),
            )
            .into_response()
        }
        Err(e) => store_error(&e),
    }
}

/// Body of `POST /v1/dlq/purge`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PurgeRequest {
    #[serde(default)]
    filter: crate::dlq::FilterSpec,
    /// Only count what would be purged.
    #[serde(default)]
    dry_run: bool,
    /// Required to purge with an empty filter: the whole DLQ, on purpose.
    #[serde(default)]
    all: bool,
}

/// The ordering keys a purge may free: under `on_dead_letter: hold` the newest dead letter of
/// a key holds it, and once that dead letter is purged nothing would ever release the key
/// (a redrive releases it; a purge only removed the entry), so everything queued behind it
/// waited for good.
#[derive(Default)]
struct PurgedHolders {
    /// (target, key) → the highest DLQ id purged with that key while it was held.
    purged: BTreeMap<(String, String), u64>,
}

impl PurgedHolders {
    /// Notes the dead letters of `page` (about to be purged) whose key is held.
    fn note(&mut self, store: &dyn crate::store::Store, page: &[DlqEntry]) {
        let mut held: HashMap<&str, Vec<String>> = HashMap::new();
        for d in page {
            let (Some(target), Some(key)) = (&d.target_id, &d.ordering_key) else {
                continue;
            };
            let keys = held
                .entry(target.as_str())
                .or_insert_with(|| store.held_keys(target));
            if keys.contains(key) {
                let id = self
                    .purged
                    .entry((target.clone(), key.clone()))
                    .or_default();
                *id = (*id).max(d.id);
            }
        }
    }

    /// Releases each noted key no later dead letter of its target and key is left to hold
    /// (those entries were dead-lettered after the purged one; the newest holds the key).
    /// Returns the keys released.
    async fn release(
        self,
        store: &dyn crate::store::Store,
    ) -> Result<Vec<(String, String)>, crate::store::StoreError> {
        let mut released = Vec::new();
        for (target, key) in self.unheld(store, None).await? {
            if store.release_key(&target, &key).await? {
                tracing::info!(target = %target, key = %key, "ordering key released: the dead letter that held it was purged");
                released.push((target, key));
            }
        }
        Ok(released)
    }

    /// The noted keys no later dead letter of their target and key would hold once the
    /// purge is done. A dry run names `purged_too`, its filter: the later dead letters it
    /// matches are still there but the purge would take them as well.
    async fn unheld(
        self,
        store: &dyn crate::store::Store,
        purged_too: Option<&crate::store::DlqFilter>,
    ) -> Result<Vec<(String, String)>, crate::store::StoreError> {
        let mut by_target: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
        for ((target, key), id) in self.purged {
            by_target.entry(target).or_default().insert(key, id);
        }
        let mut released = Vec::new();
        for (target, mut keys) in by_target {
            let filter = crate::store::DlqFilter {
                target: Some(target.clone()),
                ..Default::default()
            };
            let mut after = keys.values().min().copied();
            loop {
                let page = store.dlq_list(&filter, after, 1000).await?;
                for d in &page {
                    if let Some(key) = &d.ordering_key
                        && keys.get(key).is_some_and(|purged| d.id > *purged)
                        && !purged_too.is_some_and(|f| f.matches(d))
                    {
                        keys.remove(key);
                    }
                }
                match page.last() {
                    Some(l) if page.len() == 1000 && !keys.is_empty() => after = Some(l.id),
                    _ => break,
                }
            }
            released.extend(keys.into_keys().map(|key| (target.clone(), key)));
        }
        Ok(released)
    }
}

/// `POST /v1/dlq/purge`: deletes matching entries (or counts them with `dry_run`).
pub async fn dlq_purge(
    State(app): State<Arc<App>>,
    axum::Extension(who): axum::Extension<crate::auth::Principal>,
    body: axum::body::Bytes,
) -> Response {
    let req: PurgeRequest = match parse_body(&body) {
        Ok(r) => r,
        Err(resp) => return *resp,
    };
    if let Err(r) = dlq_write_scope(&who, req.filter.target.as_deref()) {
        return *r;
    }
    if let Some(r) =
        refuse_unknown_dlq_target(&app, req.filter.target.as_deref(), "/filter/target", |id| {
            dlq_write_scope(&who, Some(id)).is_ok()
        })
        .await
    {
        return r;
    }
    let filter = match req.filter.to_filter("/filter") {
        Ok(f) => f,
        Err(errors) => return error_response(StatusCode::BAD_REQUEST, "invalid request", errors),
    };
    if filter == crate::store::DlqFilter::default() && !req.dry_run && !req.all {
        // Purging is the one DLQ operation that cannot be undone: an empty filter (a
        // forgotten flag) must not delete every target's dead letters.
        return error_response(
            StatusCode::BAD_REQUEST,
            "an empty filter would purge the whole DLQ",
            vec![FieldError::new(
                "/filter",
                "name at least one of target, reason, rule, type, source, since, until; or set \"all\": true to purge every entry",
            )],
        );
    }
    // Its own task: a client that goes away mid-purge (a large DLQ takes a while) does not stop
    // it half done without a word; every page is logged as it goes.
    let dry_run = req.dry_run;
    let by = who.name.clone();
    let spec = req.filter;
    let purge = tokio::spawn(async move {
        let mut matched = 0u64;
        let mut purged = 0u64;
        let mut after = None;
        let mut holders = PurgedHolders::default();
        loop {
            let page = app.store.dlq_list(&filter, after, 1000).await?;
            matched += page.len() as u64;
            let last = page.last().map(|d| d.id);
            // A dry run notes them too: the keys it would release are what an operator
            // must know before purging (what waits behind them goes out at once).
            holders.note(app.store.as_ref(), &page);
            if !dry_run && !page.is_empty() {
                purged += app
                    .store
                    .purge_dlq(page.iter().map(|d| d.id).collect())
                    .await?;
                tracing::warn!(purged, by = %by, filter = ?spec, "DLQ entries purged by an operator (so far)");
            }
            match last {
                Some(l) if page.len() == 1000 => after = Some(l),
                _ => break,
            }
        }
        let (released, would_release) = if dry_run {
            (
                Vec::new(),
                holders.unheld(app.store.as_ref(), Some(&filter)).await?,
            )
        } else {
            let released = holders.release(app.store.as_ref()).await?;
            tracing::warn!(purged, released_keys = released.len(), by = %by, filter = ?spec, "DLQ purge done");
            (released, Vec::new())
        };
        Ok::<_, crate::store::StoreError>((matched, purged, released, would_release))
    });
    let keys = |keys: Vec<(String, String)>| -> Vec<Value> {
        keys.into_iter()
            .map(|(target, key)| json!({ "target": target, "key": key }))
            .collect()
    };
    match purge.await {
        Ok(Ok((matched, purged, released, would_release))) => {
            let mut body = json!({
                "dry_run": dry_run,
                "matched": matched,
                "purged": purged,
                "released_keys": keys(released),
            });
            if dry_run {
                body["would_release_keys"] = json!(keys(would_release));
            }
            axum::Json(body).into_response()
        }
        Ok(Err(e)) => store_error(&e),
        Err(e) => {
            tracing::error!(error = %e, "the purge task failed");
            store_error(&crate::store::StoreError::Backend(e.to_string()))
        }
    }
}

/// `POST /v1/dlq/redrive`: creates a redrive job.
pub async fn redrive_create(
    State(app): State<Arc<App>>,
    axum::Extension(who): axum::Extension<crate::auth::Principal>,
    body: axum::body::Bytes,
) -> Response {
    let req: crate::dlq::RedriveRequest = match parse_body(&body) {
        Ok(r) => r,
        Err(resp) => return *resp,
    };
    if let Err(r) = dlq_write_scope(&who, req.filter.target.as_deref()) {
        return *r;
    }
    match crate::dlq::create_redrive(&app, req).await {
        Ok(job) => (StatusCode::CREATED, axum::Json(job_json(&job))).into_response(),
        // Only an id the caller may redrive is suggested: a team token must not learn other
        // teams' target ids from its typos.
        Err(crate::dlq::JobError::UnknownTarget { target, known }) => {
            let suggestion = known
                .iter()
                .find(|id| dlq_write_scope(&who, Some(id.as_str())).is_ok());
            unknown_redrive_target(&target, suggestion.map(String::as_str))
        }
        Err(e) => job_error(e),
    }
}

/// `POST /v1/replay`: creates a replay job.
pub async fn replay_create(State(app): State<Arc<App>>, body: axum::body::Bytes) -> Response {
    let req = match parse_body(&body) {
        Ok(r) => r,
        Err(resp) => return *resp,
    };
    match crate::dlq::create_replay(&app, req).await {
        Ok(job) => (StatusCode::CREATED, axum::Json(job_json(&job))).into_response(),
        Err(e) => job_error(e),
    }
}

/// Whether `who` may read job `j`: `read` sees every job; a team's `dlq:<target>` scope sees
/// the redrive jobs over that target (the ones it may start and control).
fn job_visible(who: &crate::auth::Principal, j: &crate::store::Job) -> bool {
    who.allows(&crate::auth::Scope::Read) || team_owns_job(who, j)
}

/// Whether job `j` is a redrive over a target `who`'s `dlq:` scope covers: the jobs a team
/// may start, read and control without `read` or `admin`. A redrive without a target filter,
/// or over the dead letters without a target, is no team's (see [`team_covers_target`]).
fn team_owns_job(who: &crate::auth::Principal, j: &crate::store::Job) -> bool {
    j.kind == crate::store::JobKind::Redrive
        && team_covers_target(who, j.spec["filter"]["target"].as_str())
}

/// Whether `who`'s `dlq:` scopes cover the dead letters of `target`. `None` (no target filter,
/// or a dead letter without a target) and [`crate::store::NO_TARGET`] never are: those are
/// every producer's quarantined events, `read`/`admin` only, and a `dlq:*` glob would
/// otherwise match the name "none" or the empty string.
fn team_covers_target(who: &crate::auth::Principal, target: Option<&str>) -> bool {
    target.is_some_and(|t| {
        t != crate::store::NO_TARGET && who.allows(&crate::auth::Scope::Dlq(t.to_string()))
    })
}

/// The 403 for a job read by a token with neither `read` nor any `dlq:` scope.
fn job_read_scope(who: &crate::auth::Principal) -> Result<(), Box<Response>> {
    if who.allows(&crate::auth::Scope::Read) || who.has_dlq_scopes() {
        Ok(())
    } else {
        Err(Box::new(crate::auth::forbidden(
            who,
            "read (or dlq:<target> for that target's redrive jobs)",
        )))
    }
}

/// Query of the job lists.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobsQuery {
    /// Only jobs in this state.
    state: Option<crate::store::JobState>,
    /// Only jobs of this kind.
    kind: Option<crate::store::JobKind>,
    /// The previous page's `next` (`<created_at ms>:<id>` of its last job; a job id also
    /// works while that job exists).
    after: Option<String>,
    /// Page size (default 100, at most 1000).
    limit: Option<usize>,
}

/// `GET /v1/dlq/redrive`, `GET /v1/replay`: the jobs the caller may see, newest first, paged.
pub async fn jobs_list(
    State(app): State<Arc<App>>,
    axum::Extension(who): axum::Extension<crate::auth::Principal>,
    ApiQuery(q): ApiQuery<JobsQuery>,
) -> Response {
    if let Err(r) = job_read_scope(&who) {
        return *r;
    }
    let limit = q.limit.unwrap_or(100);
    if limit == 0 || limit > 1000 {
        return error_response(
            StatusCode::BAD_REQUEST,
            "invalid query",
            vec![FieldError::new("/limit", "limit must be in 1..=1000")],
        );
    }
    let mut jobs = match app.store.jobs().await {
        Ok(jobs) => jobs,
        Err(e) => return store_error(&e),
    };
    let cursor: Option<(i64, String)> = match &q.after {
        None => None,
        Some(after) => match job_cursor(after, &jobs, |j| job_visible(&who, j)) {
            Some(p) => Some(p),
            None => {
                return error_response(
                    StatusCode::BAD_REQUEST,
                    "invalid query",
                    vec![FieldError::new(
                        "/after",
                        "not a cursor: give the `next` of the previous page",
                    )],
                );
            }
        },
    };
    jobs.retain(|j| {
        job_visible(&who, j)
            && q.state.is_none_or(|s| j.state == s)
            && q.kind.is_none_or(|k| j.kind == k)
            && cursor
                .as_ref()
                .is_none_or(|(at, id)| (j.created_at, &j.id) < (*at, id))
    });
    // Newest first; the id breaks ties (two jobs created in the same millisecond).
    jobs.sort_by(|a, b| (b.created_at, &b.id).cmp(&(a.created_at, &a.id)));
    jobs.truncate(limit);
    let page = jobs;
    let next = (page.len() == limit)
        .then(|| page.last().map(|j| format!("{}:{}", j.created_at, j.id)))
        .flatten();
    let jobs: Vec<Value> = page
        .into_iter()
        .map(|j| job_json(&app.jobs.shown(j)))
        .collect();
    axum::Json(json!({ "jobs": jobs, "next": next })).into_response()
}

/// The position a job list's `after` names: `<created_at ms>:<id>` (the previous page's
/// `next`), or the id of a job `visible` to the caller. The cursor is a position, not a job:
/// the page goes on after it even when that job has changed state or been swept since. A job
/// the caller may not see is no cursor, exactly as one that does not exist, so a team token
/// cannot learn by paging whether another team's job exists.
fn job_cursor(
    after: &str,
    jobs: &[crate::store::Job],
    visible: impl Fn(&crate::store::Job) -> bool,
) -> Option<(i64, String)> {
    after
        .split_once(':')
        .and_then(|(at, id)| Some((at.parse::<i64>().ok()?, id.to_string())))
        .or_else(|| {
            let j = jobs.iter().find(|j| j.id == after && visible(j))?;
            Some((j.created_at, j.id.clone()))
        })
}

/// The kind of job a job route is about: `/v1/replay/...` replays, `/v1/dlq/redrive/...`
/// redrives. A job of the other kind is not found there.
fn route_job_kind(matched: Option<&axum::extract::MatchedPath>) -> crate::store::JobKind {
    if matched.is_some_and(|m| m.as_str().starts_with("/v1/replay")) {
        crate::store::JobKind::Replay
    } else {
        crate::store::JobKind::Redrive
    }
}

/// Job `job` as the route sees it: of the route's kind, or not found.
async fn route_job(
    app: &App,
    matched: Option<&axum::extract::MatchedPath>,
    job: &str,
) -> Result<crate::store::Job, Response> {
    match crate::dlq::get(app, job).await {
        Ok(j) if j.kind == route_job_kind(matched) => Ok(j),
        Ok(_) => Err(job_error(crate::dlq::JobError::NotFound)),
        Err(e) => Err(job_error(e)),
    }
}

/// `GET /v1/dlq/redrive/{job}`, `GET /v1/replay/{job}`: progress.
pub async fn job_show(
    State(app): State<Arc<App>>,
    axum::Extension(who): axum::Extension<crate::auth::Principal>,
    matched: Option<axum::extract::MatchedPath>,
    Path(job): Path<String>,
) -> Response {
    if let Err(r) = job_read_scope(&who) {
        return *r;
    }
    let hidden = || crate::auth::forbidden(&who, "read (or dlq:<target> of the job's target)");
    match route_job(&app, matched.as_ref(), &job).await {
        Ok(j) if job_visible(&who, &j) => axum::Json(job_json(&j)).into_response(),
        // Without naming the job's target: it is another team's.
        Ok(_) => hidden(),
        // A team token learns nothing of other teams' jobs, not even that one exists: a
        // missing job gets the same 403 (as a missing DLQ entry does).
        Err(r) if r.status() == StatusCode::NOT_FOUND && !who.allows(&crate::auth::Scope::Read) => {
            hidden()
        }
        Err(r) => r,
    }
}

/// `POST .../{job}/pause|resume|cancel`.
pub async fn job_control(
    State(app): State<Arc<App>>,
    axum::Extension(who): axum::Extension<crate::auth::Principal>,
    matched: Option<axum::extract::MatchedPath>,
    Path((job, action)): Path<(String, String)>,
) -> Response {
    // The scope is checked on the job as read, and nothing changes without that check: a
    // job not found (yet) is 404, never a change that skipped it. Replays are admin-only
    // (the router checked); a redrive is its filter's target's team's. The 403 does not name
    // another team's target.
    let hidden = || crate::auth::forbidden(&who, "admin (or dlq:<target> of the job's target)");
    let j = match route_job(&app, matched.as_ref(), &job).await {
        Ok(j) => j,
        // The same 403 for a missing job as for another team's (see `job_show`).
        Err(r) if r.status() == StatusCode::NOT_FOUND && !who.allows(&crate::auth::Scope::Read) => {
            return hidden();
        }
        Err(r) => return r,
    };
    if !(who.allows(&crate::auth::Scope::Admin) || team_owns_job(&who, &j)) {
        return hidden();
    }
    use crate::store::JobState;
    let to = match action.as_str() {
        "pause" => JobState::Paused,
        "resume" => JobState::Running,
        "cancel" => JobState::Cancelled,
        _ => {
            return error_response(
                StatusCode::NOT_FOUND,
                "unknown action",
                vec![FieldError::new("/action", "pause, resume or cancel")],
            );
        }
    };
    match crate::dlq::control(&app, &job, to).await {
        Ok(j) => axum::Json(job_json(&j)).into_response(),
        Err(e) => job_error(e),
    }
}

/// `POST /v1/rules/{name}/disable|enable`: persisted, overrides the files until enabled.
pub async fn rule_control(
    State(app): State<Arc<App>>,
    axum::Extension(who): axum::Extension<crate::auth::Principal>,
    Path((name, action)): Path<(String, String)>,
) -> Response {
    let enabled = match action.as_str() {
        "enable" => true,
        "disable" => false,
        _ => {
            return error_response(
                StatusCode::NOT_FOUND,
                "unknown action",
                vec![FieldError::new("/action", "enable or disable")],
            );
        }
    };
    // An operator's switch stops a rule, or undoes its own stop: it cannot start a rule that
    // its file turns off, and saying "enabled" to that would send the operator away wrong.
    if enabled
        && let Some(rule) = app
            .rules
            .load()
            .rules
            .iter()
            .find(|r| r.name == name && !r.enabled)
    {
        return error_response(
            StatusCode::CONFLICT,
            "the rule is turned off in its rule file",
            vec![FieldError::new(
                "/name",
                format!(
                    "{name:?} has `enabled: false` in {}:{}; enable it there (and reload)",
                    rule.file, rule.line
                ),
            )],
        );
    }
    let by = app.tokens.load().enabled().then(|| who.name.clone());
    match app.set_rule_enabled(&name, enabled, by).await {
        Ok(true) => axum::Json(json!({ "rule": name, "enabled": enabled })).into_response(),
        Ok(false) => error_response(
            StatusCode::NOT_FOUND,
            "unknown rule",
            vec![FieldError::new("/name", format!("no live rule {name:?}"))],
        ),
        Err(e) => change_store_error(&e, "GET /v1/rules"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Principal;
    use crate::store::JobKind;

    /// `POST /v1/rules/test` matched inline on the reactor whatever the rules cost (the
    /// audit's 2,000 wildcards took 8.6 s for one 10 KB event): against costly rules it now
    /// matches on the blocking pool, and on a current-thread runtime other tasks run meanwhile.
    #[tokio::test(flavor = "current_thread")]
    async fn a_costly_rules_test_leaves_the_reactor() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (app, ev) = crate::ingest::costly(dir.path(), 100, 10_000);
        let body = axum::body::Bytes::from(serde_json::to_vec(&ev.to_json()).expect("json"));
        let (r, during) = crate::ingest::reactor_turns_during(rules_test(State(app), body)).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert!(
            during > 0,
            "the reactor ran nothing while the event was matched"
        );
        let b = axum::body::to_bytes(r.into_body(), 1 << 16)
            .await
            .expect("body");
        let v: Value = serde_json::from_slice(&b).expect("json");
        assert_eq!(v["matches"], json!([]));
    }

    /// A redrive job over `target`, created at `at`.
    fn redrive(id: &str, target: &str, at: i64) -> crate::store::Job {
        let mut j = crate::store::test_events::job(id, JobKind::Redrive);
        j.spec = json!({ "filter": { "target": target } });
        j.created_at = at;
        j
    }

    /// A replay refused past the disk's high-water mark: 503 with a Retry-After and a JSON
    /// error saying why, as ingest's.
    #[tokio::test]
    async fn a_replay_refused_past_the_disk_mark_is_a_503_with_retry_after() {
        let r = job_error(crate::dlq::JobError::DiskFull);
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(r.headers().get("retry-after").is_some());
        let b = axum::body::to_bytes(r.into_body(), 1 << 16)
            .await
            .expect("body");
        let v: Value = serde_json::from_slice(&b).expect("json");
        assert!(v.to_string().contains("disk high-water mark"), "{v}");
    }

    /// An operator's change whose write went unanswered may still apply: its 503 says so and
    /// where to look, where it said only "storage unavailable" and the change then took
    /// effect. A change refused before anything was sent keeps the plain 503.
    #[tokio::test]
    async fn an_unanswered_change_says_it_may_have_been_applied() {
        use crate::store::StoreError;
        let body = |r: Response| async move {
            let status = r.status();
            let b = axum::body::to_bytes(r.into_body(), 1 << 16)
                .await
                .expect("body");
            (status, serde_json::from_slice::<Value>(&b).expect("json"))
        };
        let (status, v) = body(change_store_error(
            &StoreError::Unanswered("commit: timed out".into()),
            "GET /v1/targets/erp",
        ))
        .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        let summary = v["error"].as_str().unwrap_or_default();
        assert!(
            summary.contains("may or may not have been applied")
                && summary.contains("GET /v1/targets/erp"),
            "{v}"
        );
        let (status, v) = body(change_store_error(
            &StoreError::Unavailable("not connected".into()),
            "GET /v1/targets/erp",
        ))
        .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(v["error"], "storage unavailable", "{v}");
    }

    /// Dead letters without a target (`target=none`) are every producer's quarantined events:
    /// no `dlq:` glob covers them, not even `dlq:*`; `read` lists them and `admin` changes them.
    #[test]
    fn the_dead_letters_without_a_target_are_no_teams() {
        let who = Principal::with_scopes;
        let none = Some(crate::store::NO_TARGET);
        assert!(dlq_read_scope(&who(&["dlq:*"]), none).is_err());
        assert!(dlq_write_scope(&who(&["dlq:*"]), none).is_err());
        assert!(dlq_read_scope(&who(&["dlq:*"]), Some("erp")).is_ok());
        assert!(dlq_read_scope(&who(&["read"]), none).is_ok());
        assert!(dlq_write_scope(&who(&["read"]), none).is_err());
        assert!(dlq_write_scope(&who(&["admin"]), none).is_ok());
    }

    /// A redrive over the dead letters without a target, or with no target filter, is no
    /// team's: a `dlq:*` token neither sees nor controls it (its glob matches "none").
    #[test]
    fn a_redrive_over_no_target_is_no_teams_job() {
        let any_team = Principal::with_scopes(&["dlq:*"]);
        assert!(team_owns_job(&any_team, &redrive("redrive-1", "erp", 10)));
        let none = redrive("redrive-2", crate::store::NO_TARGET, 20);
        assert!(!team_owns_job(&any_team, &none));
        assert!(!job_visible(&any_team, &none));
        let mut unfiltered = crate::store::test_events::job("redrive-3", JobKind::Redrive);
        unfiltered.spec = json!({ "filter": { "reason": "contract_violation" } });
        assert!(!team_owns_job(&any_team, &unfiltered));
        assert!(job_visible(&Principal::with_scopes(&["read"]), &none));
        assert!(!team_owns_job(&Principal::with_scopes(&["dlq:no*"]), &none));
    }

    /// A filter parameter given twice is refused by the summary as by the list: before, the
    /// summary counted only the last value's dead letters.
    #[tokio::test]
    async fn a_parameter_given_twice_is_refused_by_the_dlq_list_and_summary() {
        use http_body_util::BodyExt as _;
        async fn refusal(r: Box<Response>) -> Value {
            assert_eq!(r.status(), StatusCode::BAD_REQUEST);
            let body = r.into_body().collect().await.expect("body").to_bytes();
            serde_json::from_slice(&body).expect("JSON")
        }
        for (query, pointer) in [
            ("target=a&target=b", "/target"),
            ("reason=x&since=2026-01-01T00:00:00Z&reason=y", "/reason"),
        ] {
            let list = refusal(ApiQuery::<DlqQuery>::parse(query).unwrap_err()).await;
            let summary = refusal(ApiQuery::<SummaryQuery>::parse(query).unwrap_err()).await;
            assert_eq!(summary, list, "{query}");
            let message = summary["errors"][0]["message"].as_str().unwrap_or_default();
            assert!(message.contains("duplicate field"), "{summary}");
            assert_eq!(summary["errors"][0]["pointer"], pointer, "{summary}");
        }
        assert!(ApiQuery::<SummaryQuery>::parse("bucket=1h&bucket=2h").is_err());
        assert!(
            ApiQuery::<SummaryQuery>::parse("target=a&bucket=5m&since=2026-01-01T00:00:00Z")
                .is_ok()
        );
        assert!(
            ApiQuery::<SummaryQuery>::parse("limit=5").is_err(),
            "no limit"
        );
    }

    /// A bucket width with a fraction of a second is refused: the answer's `bucket_seconds`
    /// said 1 for `1500ms` buckets, and the CLI's spans and gaps were wrong.
    #[test]
    fn a_summary_bucket_is_whole_seconds() {
        for (bucket, ms) in [
            (None, 3_600_000),
            (Some("1s"), 1_000),
            (Some("90s"), 90_000),
            (Some("1h 30m"), 5_400_000),
            (Some("2000ms"), 2_000),
        ] {
            assert_eq!(summary_bucket_ms(bucket), Ok(ms), "{bucket:?}");
        }
        for bucket in ["1500ms", "1s 1ns", "999ms", "0s", "abc"] {
            let e = summary_bucket_ms(Some(bucket)).expect_err(bucket);
            assert_eq!(e.pointer, "/bucket");
            assert!(
                e.message.contains("whole seconds"),
                "{bucket}: {}",
                e.message
            );
        }
    }

    /// A job id is a cursor only for a caller who may see that job: another team's answers as a
    /// job that does not exist, so paging tells a team token nothing of other teams' jobs.
    #[test]
    fn a_job_cursor_resolves_only_among_the_callers_jobs() {
        let jobs = [
            redrive("redrive-1", "erp", 10),
            redrive("redrive-2", "crm", 20),
        ];
        let who = |scope: &str| Principal::with_scopes(&[scope]);
        let cursor = |p: &Principal, after: &str| job_cursor(after, &jobs, |j| job_visible(p, j));
        let erp = who("dlq:erp");
        assert_eq!(
            cursor(&erp, "redrive-1"),
            Some((10, "redrive-1".to_string()))
        );
        assert_eq!(cursor(&erp, "redrive-2"), None, "crm's job");
        assert_eq!(cursor(&erp, "redrive-3"), None, "no such job");
        // A position names no job: it resolves whoever asks.
        assert_eq!(
            cursor(&erp, "20:redrive-2"),
            Some((20, "redrive-2".to_string()))
        );
        // `read` sees every job.
        assert_eq!(
            cursor(&who("read"), "redrive-2"),
            Some((20, "redrive-2".to_string()))
        );
    }

    fn entry(idx: u32, target: &str, state: EntryState) -> QueueEntry {
        let mut e = QueueEntry::queued(
            crate::store::EntryId { event: 7, idx },
            crate::store::NewEntry {
                target_id: target.into(),
                rule: "r".into(),
                ordering_key: None,
                max_depth: None,
                lease_ms: None,
                hold_key: false,
            },
            format!("k{idx}"),
            0,
            0,
            0,
        );
        e.state = state;
        e
    }

    fn dead_letter(entry: Option<u32>, target: Option<&str>) -> DlqEntry {
        let mut d = DlqEntry::at_acceptance(
            7,
            ("e".into(), "/s".into(), "t".into()),
            None,
            crate::store::DlqReason::PermanentError,
            Vec::new(),
            0,
        );
        d.entry = entry.map(|idx| crate::store::EntryId { event: 7, idx });
        d.target_id = target.map(str::to_string);
        d
    }

    /// Each entry's state in the fate, and which DLQ entries belong to which entries, looked
    /// up at once as the pairwise test (by entry id, or by event and target for a copy refused
    /// at acceptance) answers them.
    #[test]
    fn the_fates_states_and_dead_letters_match_the_pairwise_test() {
        let now = 1_000;
        let attempt = AttemptRecord {
            n: 1,
            started_at: 0,
            finished_at: Some(1),
            result: None,
            status: Some(500),
            error: Some("boom".into()),
        };
        let mut retrying = entry(5, "f", EntryState::Queued);
        retrying.attempts.push(attempt.clone());
        let mut leased = entry(6, "g", EntryState::Queued);
        leased.attempts.push(attempt);
        leased.lease = Some(crate::store::Lease {
            token: 1,
            until: now + 10,
        });
        let entries = vec![
            entry(0, "a", EntryState::Delivered),
            entry(1, "b", EntryState::Dead),
            entry(2, "c", EntryState::Dead),
            entry(3, "d", EntryState::Dead),
            entry(4, "e", EntryState::Queued),
            retrying,
            leased,
        ];
        let dlq = vec![
            dead_letter(Some(1), Some("b")),
            // Refused by c's depth cap at acceptance: no entry id.
            dead_letter(None, Some("c")),
            // Quarantined: no target.
            dead_letter(None, None),
            // Of an entry swept since.
            dead_letter(Some(9), Some("z")),
        ];
        let dead = EntryRefs::of_dlq(&dlq);
        let states: Vec<&str> = entries
            .iter()
            .map(|e| FateState::of(e, &dead, now).name())
            .collect();
        assert_eq!(
            states,
            [
                "delivered",
                "dlq",
                "dlq",
                "purged",
                "queued",
                "retrying",
                "in_flight"
            ]
        );
        for e in &entries {
            assert_eq!(
                dead.holds(e),
                dlq.iter().any(|d| refers_to(d, e)),
                "{}",
                e.id
            );
        }
        for page in [&entries[..], &entries[..2], &entries[2..3], &entries[..0]] {
            let on_page = EntryRefs::of_entries(page);
            for d in &dlq {
                assert_eq!(
                    on_page.referred_by(d),
                    page.iter().any(|e| refers_to(d, e)),
                    "{d:?}"
                );
            }
        }
    }
}
