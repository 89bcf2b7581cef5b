//! Producer-facing HTTP API: `POST /v1/events` in the three CloudEvents modes.
//!
//! envelope check (400) → contract (422 enforce / quarantine) → rule match → durable accept
//! with fan-out (202 only after the group commit that holds it is on disk).

pub mod admission;
pub mod parse;
#[cfg(test)]
mod schema_tests;

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::json;

use crate::app::App;
use crate::contract::{ContractMode, ContractOutcome, ViolationReason};
use crate::event::{CloudEvent, FieldError};
use crate::store::{AcceptOutcome, DlqReason, NewEntry, NewEvent, Quarantine};

/// A body up to this many times the limit is read (and discarded) before the 413 is sent, so
/// the client, still writing, reads the answer instead of a connection reset.
const DRAIN_FACTOR: usize = 8;

/// Why a body was not read whole.
enum BodyError {
    /// Past the limit (413), or the connection failed.
    TooLarge,
    /// No room under ingest's admission for the next piece (503).
    Saturated(admission::Saturated),
}

/// Reads the body up to `limit` bytes. Past it, keeps reading and discarding up to
/// `DRAIN_FACTOR × limit` (then gives up) and returns `Err` for a 413. With `admitted`, each
/// piece is accounted under ingest's admission before it is kept (a discarded one is not).
async fn read_body(
    body: Body,
    limit: usize,
    mut admitted: Option<&mut admission::Admitted<'_>>,
) -> Result<bytes::Bytes, BodyError> {
    use futures::StreamExt;
    let mut stream = body.into_data_stream();
    let mut buf = bytes::BytesMut::new();
    let mut seen = 0usize;
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else {
            return Err(BodyError::TooLarge);
        };
        seen = seen.saturating_add(chunk.len());
        if seen > limit.saturating_mul(DRAIN_FACTOR) {
            return Err(BodyError::TooLarge);
        }
        if seen <= limit {
            if let Some(admitted) = admitted.as_deref_mut() {
                admitted
                    .take_bytes(chunk.len())
                    .await
                    .map_err(BodyError::Saturated)?;
            }
            buf.extend_from_slice(&chunk);
        }
    }
    if seen > limit {
        Err(BodyError::TooLarge)
    } else {
        Ok(buf.freeze())
    }
}

/// The 413 for a body past `limit` bytes.
pub(crate) fn body_too_large(limit: usize) -> Response {
    error_response(
        StatusCode::PAYLOAD_TOO_LARGE,
        "request body too large",
        vec![FieldError::new(
            "",
            format!("body exceeds the limit of {limit} bytes"),
        )],
    )
}

/// Reads a request body of at most `limit` bytes within `timeout` (ingest's, and every other
/// API body through `app::bounded_body`): the bytes, or the 413 or 408 to answer.
pub(crate) async fn read_bounded(
    body: Body,
    limit: usize,
    timeout: std::time::Duration,
) -> Result<bytes::Bytes, Box<Response>> {
    read_timed(body, limit, timeout, None).await
}

/// [`read_bounded`], accounting each piece kept under `admitted` (a 503 when no room came).
async fn read_timed(
    body: Body,
    limit: usize,
    timeout: std::time::Duration,
    admitted: Option<&mut admission::Admitted<'_>>,
) -> Result<bytes::Bytes, Box<Response>> {
    match tokio::time::timeout(timeout, read_body(body, limit, admitted)).await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(BodyError::TooLarge)) => Err(Box::new(body_too_large(limit))),
        Ok(Err(BodyError::Saturated(s))) => Err(Box::new(saturated(&s))),
        Err(_) => Err(Box::new(error_response(
            StatusCode::REQUEST_TIMEOUT,
            "the request body did not arrive in time",
            vec![FieldError::new(
                "",
                format!("body not complete within {timeout:?}"),
            )],
        ))),
    }
}

/// One event's answer in a 202.
#[derive(Debug, Serialize)]
pub struct EventResult {
    /// The event's `id`.
    pub id: String,
    /// The event's `source`.
    pub source: String,
    /// `accepted`, `duplicate` or `quarantined`.
    pub status: &'static str,
    /// Why it was quarantined.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<&'static str>,
    /// Validation errors of a quarantined event.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<FieldError>,
}

/// The 202 body: `{"results": [...]}`.
#[derive(Debug, Serialize)]
struct Answer {
    results: Vec<EventResult>,
}

/// A JSON error answer: `{"error": summary, "errors": [{pointer, message}]}`.
/// The answer to a request with an event the store can never take (sent again it would fail
/// again: a 4xx naming the event, not a 503 its producer retries for ever). Nothing of the
/// request is stored; its events count as rejected, and the event is logged with `message`.
fn refused_by_the_store(
    app: &App,
    answered: &[Answered],
    batch: bool,
    index: usize,
    status: StatusCode,
    summary: &str,
    message: String,
) -> Response {
    app.metrics
        .ingest_events
        .get_or_create(&vec![("status", "rejected".to_string())])
        .inc_by(answered.len() as u64);
    let ev = answered.get(index);
    tracing::warn!(
        event_id = ev.map_or("", |a| a.id.as_str()),
        source = ev.map_or("", |a| a.source.as_str()),
        "event refused: {summary}: {message}"
    );
    let pointer = if batch {
        format!("/{index}")
    } else {
        String::new()
    };
    error_response(status, summary, vec![FieldError::new(pointer, message)])
}

pub fn error_response(status: StatusCode, summary: &str, errors: Vec<FieldError>) -> Response {
    (
        status,
        axum::Json(json!({ "error": summary, "errors": errors })),
    )
        .into_response()
}

/// `POST /v1/events`.
pub async fn post_events(
    State(app): State<Arc<App>>,
    axum::Extension(principal): axum::Extension<crate::auth::Principal>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let resp = handle(&app, &principal, &headers, body).await;
    app.metrics
        .ingest_requests
        .get_or_create(&vec![("code", resp.status().as_u16().to_string())])
        .inc();
    resp
}

/// `Retry-After` past the disk high-water mark: the queues need time to drain.
pub(crate) const DISK_FULL_RETRY_AFTER_S: u64 = 30;
/// `Retry-After` of a request the store failed (not compacting): a failing disk or a lost
/// connection to a shared store, which may pass.
pub(crate) const STORE_RETRY_AFTER_S: u64 = 1;

/// The log gate (`LogGates`) of ingest's refusals for a failing store: one for the process,
/// in parentheses so that no target id (the other gates' subjects) can take it.
const STORE_REFUSAL_GATE: &str = "(ingest: store unavailable)";

pub(crate) fn with_retry_after(mut r: Response, secs: u64) -> Response {
    if let Ok(v) = axum::http::HeaderValue::from_str(&secs.max(1).to_string()) {
        r.headers_mut().insert("retry-after", v);
    }
    r
}

/// The body length a request's `Content-Length` declares (`None`: absent, chunked, or not a
/// number, which hyper answers itself).
pub(crate) fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
}

/// Whether the request asked for `100 Continue` before sending its body.
fn expects_continue(headers: &HeaderMap) -> bool {
    headers
        .get(axum::http::header::EXPECT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("100-continue"))
}

/// `Retry-After` of a request refused because ingest stayed full (`admission`): the
/// requests ahead of it are committed within about a second.
pub(crate) const SATURATED_RETRY_AFTER_S: u64 = 1;

/// The 503 of a request that found no room under `ingest.max_in_flight_bytes` or
/// `ingest.max_in_flight_events`.
fn saturated(s: &admission::Saturated) -> Response {
    tracing::debug!(
        bound = s.bound.as_str(),
        asked = s.asked,
        in_flight = s.in_flight,
        capacity = s.capacity,
        "ingest saturated: request refused with 503"
    );
    let message = match s.bound {
        admission::Bound::Bytes => format!(
            "ingest holds {} of its {} bytes of requests in flight ({}) and found no room for {} more bytes of this request within {:?}",
            s.in_flight,
            s.capacity,
            s.bound.key(),
            s.asked,
            s.waited
        ),
        admission::Bound::Events => format!(
            "ingest holds {} of its {} events in flight ({}) and found no room for this request's {} within {:?}",
            s.in_flight,
            s.capacity,
            s.bound.key(),
            s.asked,
            s.waited
        ),
    };
    with_retry_after(
        error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "the router is saturated; retry after the indicated time",
            vec![FieldError::new("", message)],
        ),
        SATURATED_RETRY_AFTER_S,
    )
}

/// Request bodies from this size up have their contract checks run on the blocking pool: a
/// large event against a demanding schema is milliseconds to seconds of CPU (a debug build
/// took seconds for 1 MB) that would otherwise stall the reactor, `/healthz` included. Below
/// it a check is microseconds, less than the hand-off to another thread would cost. Rule
/// matching is weighed the same way, with the body's size multiplied by the rules' matching
/// cost per byte ([`crate::rules::RuleSet::match_cost`]): with wildcards that may keep many
/// matcher states active, a 10 KB event is as much work as a 1 MB one without.
pub(crate) const BLOCKING_CHECK_BYTES: usize = 64 * 1024;

/// An event with its contract outcome and, when it passed, what it matched: the rules and a
/// queue entry per target.
type Checked = (CloudEvent, ContractOutcome, Option<Routed>);

/// Matched rules and their queue entries.
type Routed = (Vec<String>, Vec<NewEntry>, Unrouted);

/// Why an accepted event went to no target, counted in `router_ingest_unrouted_total{cause}`
/// and logged: from a target's side such events are lost (only the archive and a replay have
/// them), and nothing said so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unrouted {
    /// It was routed (to at least one target), or quarantined.
    No,
    /// It matched no rule of the live set.
    NoMatch,
    /// The only rules it matched are disabled by an operator.
    RuleDisabled,
}

impl Unrouted {
    /// The `cause` label.
    fn cause(self) -> Option<&'static str> {
        match self {
            Unrouted::No => None,
            Unrouted::NoMatch => Some("no_match"),
            Unrouted::RuleDisabled => Some("rule_disabled"),
        }
    }
}

/// Each event's contract check and, for those that pass, its rule matching, run where
/// [`BLOCKING_CHECK_BYTES`] says. Matching is timed and counted per event
/// (`router_rule_match_seconds`, `router_rule_match_steps`).
async fn check_and_route(
    app: &App,
    rules: Arc<crate::rules::RuleSet>,
    events: Vec<CloudEvent>,
    body_len: usize,
) -> Result<Vec<Checked>, tokio::task::JoinError> {
    let contracts = app.contracts.load_full();
    let disabled = app.disabled_rules();
    let metrics = app.metrics.clone();
    let weight = rules.match_cost(body_len);
    off_reactor_if_large(weight, move || {
        events
            .into_iter()
            .map(|ev| {
                let outcome = contracts.check(&ev);
                let routed = matches!(outcome, ContractOutcome::Pass).then(|| {
                    let started = std::time::Instant::now();
                    let mut steps = 0;
                    let mut disabled_hit = false;
                    let (matched, targets) = match_targets_counting(
                        &rules,
                        &disabled,
                        &ev,
                        &mut steps,
                        &mut disabled_hit,
                    );
                    metrics.observe_rule_match(started.elapsed(), steps);
                    let unrouted = match (targets.is_empty(), disabled_hit) {
                        (false, _) => Unrouted::No,
                        (true, true) => Unrouted::RuleDisabled,
                        (true, false) => Unrouted::NoMatch,
                    };
                    (matched, targets, unrouted)
                });
                (ev, outcome, routed)
            })
            .collect()
    })
    .await
}

/// Runs `work` here when its `weight` (bytes, or matching cost in bytes) is small, on the
/// blocking pool from [`BLOCKING_CHECK_BYTES`].
pub(crate) async fn off_reactor_if_large<T: Send + 'static>(
    weight: usize,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, tokio::task::JoinError> {
    if weight < BLOCKING_CHECK_BYTES {
        Ok(work())
    } else {
        tokio::task::spawn_blocking(work).await
    }
}

async fn handle(
    app: &App,
    principal: &crate::auth::Principal,
    headers: &HeaderMap,
    body: Body,
) -> Response {
    if app.disk_full.load(std::sync::atomic::Ordering::Relaxed) {
        return with_retry_after(
            error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "the store is past its disk high-water mark; delivery continues, retry later",
                Vec::new(),
            ),
            DISK_FULL_RETRY_AFTER_S,
        );
    }
    let limits = parse::Limits {
        max_body_bytes: app.cfg.ingest.max_body_bytes,
        max_json_depth: app.cfg.ingest.max_json_depth,
        max_batch: app.cfg.ingest.max_batch,
    };
    let declared = declared_length(headers).and_then(|n| usize::try_from(n).ok());
    if declared.is_some_and(|n| n > limits.max_body_bytes.saturating_mul(DRAIN_FACTOR)) {
        // Far too large to be worth reading: answer now (the connection is closed after it).
        return body_too_large(limits.max_body_bytes);
    }
    if declared.is_some_and(|n| n > limits.max_body_bytes) && expects_continue(headers) {
        // The client waits for a 100 Continue before it sends the body: nothing of it is on
        // the wire, so the answer cannot be lost to a reset over unread bytes.
        return body_too_large(limits.max_body_bytes);
    }
    // Held until the answer is built: the body, the parsed events and the wait for their
    // commit are what a saturated router has too many of. Bytes are taken as they arrive
    // (a slow body holds what it sent), events once they are parsed.
    let mut admitted = app.ingest_admission.begin();
    let bytes = match read_timed(
        body,
        limits.max_body_bytes,
        app.cfg.server.request_timeout,
        Some(&mut admitted),
    )
    .await
    {
        Ok(b) => b,
        Err(resp) => return *resp,
    };
    let (mode, events) = match parse::parse_request(headers, &bytes, &limits) {
        Ok(x) => x,
        Err(e) => {
            // Every event of the request is refused with it (a batch's elements all count).
            app.metrics
                .ingest_events
                .get_or_create(&vec![("status", "rejected".to_string())])
                .inc_by(e.events as u64);
            return error_response(e.status, e.summary, e.errors);
        }
    };
    if events.is_empty() {
        // An empty batch (the HTTP binding allows one): nothing to check, limit or store.
        return (
            StatusCode::ACCEPTED,
            axum::Json(Answer {
                results: Vec::new(),
            }),
        )
            .into_response();
    }
    // Scope: every event's type and source must be within the token's ingest scopes (nothing
    // is stored otherwise).
    // A source of the router's own is refused as such first: that is what the producer must
    // fix, whatever else its scopes lack.
    for (i, ev) in events.iter().enumerate() {
        if let Some(needed) = principal.reserved_source_denial(&ev.source) {
            return reserved_refused(principal, mode, i, Reserved::Source, &ev.source, &needed);
        }
        if let Some(needed) = principal.reserved_type_denial(&ev.ty) {
            return reserved_refused(principal, mode, i, Reserved::Type, &ev.ty, &needed);
        }
        if let Some(needed) = principal.ingest_denial(&ev.ty, Some(&ev.source)) {
            return scope_refused(principal, mode, i, &needed);
        }
    }
    if let Some(limiter) = app.ingest_limiters.load().get(&principal.name) {
        let n = std::num::NonZeroU32::new(u32::try_from(events.len()).unwrap_or(u32::MAX))
            .unwrap_or(std::num::NonZeroU32::MIN);
        let refused = match limiter.check_n(n) {
            Ok(Ok(())) => None,
            Ok(Err(not_until)) => {
                use governor::clock::Clock as _;
                Some(not_until.wait_time_from(governor::clock::DefaultClock::default().now()))
            }
            // More events in one request than the token's burst: it can never pass, however
            // long the client waits (a 429 would have it retry for ever). Nothing is stored.
            Err(governor::InsufficientCapacity(burst)) => {
                app.metrics
                    .ingest_events
                    .get_or_create(&vec![("status", "rejected".to_string())])
                    .inc_by(events.len() as u64);
                return error_response(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "batch larger than this token's ingest burst",
                    vec![FieldError::new(
                        "",
                        format!(
                            "{} events in one request; token {:?} admits at most {burst} at once (its rate_per_sec): send smaller batches",
                            events.len(),
                            principal.name
                        ),
                    )],
                );
            }
        };
        if let Some(wait) = refused {
            app.metrics
                .ingest_events
                .get_or_create(&vec![("status", "throttled".to_string())])
                .inc_by(events.len() as u64);
            return with_retry_after(
                error_response(
                    StatusCode::TOO_MANY_REQUESTS,
                    "ingest rate limit of this token reached",
                    vec![FieldError::new(
                        "",
                        format!(
                            "token {:?} is over its rate; retry after the indicated time",
                            principal.name
                        ),
                    )],
                ),
                wait.as_secs_f64().ceil() as u64,
            );
        }
    }
    if let Err(s) = admitted.take_events(events.len()).await {
        return saturated(&s);
    }
    let batch = matches!(mode, parse::Mode::Batch);
    // One snapshot of the rules for matching and for what is stored with the events.
    let rules = app.rules.load_full();
    let checked = match check_and_route(app, rules.clone(), events, bytes.len()).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "contract checks and rule matching of an ingest request failed");
            return error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal error while checking contracts and matching rules; nothing was stored",
                Vec::new(),
            );
        }
    };
    let now = app.clock.now_ms();
    let dedup_window_ms =
        i64::try_from(app.cfg.ingest.dedup_window.as_millis()).unwrap_or(i64::MAX);

    let mut enforce_errors = Vec::new();
    let mut new_events = Vec::with_capacity(checked.len());
    let mut quarantined: Vec<Option<(&'static str, Vec<FieldError>)>> =
        Vec::with_capacity(checked.len());
    // The events move into what the store accepts (a 1 KB event copied per request was
    // measurable); the answer and a quarantined one's `dlq.added` need only their names.
    let mut answered: Vec<Answered> = Vec::with_capacity(checked.len());
    let received = checked.len();
    for (i, (ev, outcome, routed)) in checked.into_iter().enumerate() {
        let _span = tracing::debug_span!("ingest_event", event_id = %ev.id, source = %ev.source, ty = %ev.ty).entered();
        match outcome {
            ContractOutcome::Violation {
                mode: ContractMode::Enforce,
                errors,
                ..
            } => {
                let prefix = if batch {
                    format!("/{i}")
                } else {
                    String::new()
                };
                enforce_errors.extend(
                    errors
                        .into_iter()
                        .map(|e| FieldError::new(format!("{prefix}{}", e.pointer), e.message)),
                );
            }
            ContractOutcome::Violation { reason, errors, .. } => {
                let reason = match reason {
                    ViolationReason::ContractViolation => DlqReason::ContractViolation,
                    ViolationReason::UnknownVersion => DlqReason::UnknownVersion,
                };
                quarantined.push(Some((reason.as_str(), errors.clone())));
                answered.push(Answered::of(&ev));
                new_events.push(NewEvent {
                    event: ev,
                    accepted_at: now,
                    ruleset_version: rules.version.clone(),
                    matched_rules: Vec::new(),
                    targets: Vec::new(),
                    quarantine: Some(Quarantine {
                        reason,
                        errors,
                        emitted_by: None,
                    }),
                    dedup_window_ms,
                });
            }
            ContractOutcome::Pass => {
                quarantined.push(None);
                let mut answer = Answered::of(&ev);
                let (matched_rules, targets, unrouted) =
                    routed.unwrap_or((Vec::new(), Vec::new(), Unrouted::NoMatch));
                answer.unrouted = unrouted;
                answer.rules.clone_from(&matched_rules);
                let ne = routed_event(&rules, ev, now, dedup_window_ms, (matched_rules, targets));
                answered.push(answer.with_keys(&ne));
                new_events.push(ne);
            }
        }
    }
    if !enforce_errors.is_empty() {
        // The 422 refuses the whole request: each event in it, those `enforce` refused (which
        // `answered` does not hold) and the others, is a rejected event.
        app.metrics
            .ingest_events
            .get_or_create(&vec![("status", "rejected".to_string())])
            .inc_by(received as u64);
        return error_response(
            StatusCode::UNPROCESSABLE_ENTITY,
            "data violates its contract",
            enforce_errors,
        );
    }

    // Targets that could send an entry at once get it leased in this commit (handoff). A
    // batching webhook gets the request's entries for it together, as one batch, when they
    // fill at least half of one (`delivery.handoff`): single events stay with its
    // queue, whose lease gathers what several commits made due into one request.
    let mut reservations: Vec<(Vec<(usize, usize)>, crate::deliver::Reservation)> = Vec::new();
    let mut batching: Vec<(String, Vec<(usize, usize)>)> = Vec::new();
    for (i, ne) in new_events.iter_mut().enumerate() {
        for (j, t) in ne.targets.iter_mut().enumerate() {
            let batches = rules
                .targets
                .get(&t.target_id)
                .is_some_and(|spec| spec.kind.batch().is_some());
            if batches {
                match batching.iter_mut().find(|(id, _)| *id == t.target_id) {
                    Some((_, keys)) => keys.push((i, j)),
                    None => batching.push((t.target_id.clone(), vec![(i, j)])),
                }
            } else if let Some(r) = app.dispatcher.reserve(
                &t.target_id,
                now,
                1,
                crate::deliver::bytes::charge_kib(ne.event.payload_len()),
            ) {
                t.lease_ms = Some(r.lease_ms());
                reservations.push((vec![(i, j)], r));
            }
        }
    }
    for (id, keys) in batching {
        let kib = keys
            .iter()
            .map(|&(i, _)| crate::deliver::bytes::charge_kib(new_events[i].event.payload_len()))
            .fold(0u64, u64::saturating_add);
        if let Some(r) = app.dispatcher.reserve(&id, now, keys.len(), kib) {
            let lease_ms = r.lease_ms();
            for &(i, j) in &keys {
                new_events[i].targets[j].lease_ms = Some(lease_ms);
            }
            reservations.push((keys, r));
        }
    }
    let accepted = if reservations.is_empty() {
        app.store.accept(new_events).await.map(|o| (o, Vec::new()))
    } else {
        app.store.accept_leased(new_events).await
    };
    let outcomes = match accepted {
        Ok((o, leased)) => {
            // Each leased entry goes to the reservation it was leased under; a reservation
            // none of whose entries were written (duplicates, a queue at its cap) frees its
            // slot when dropped.
            // (A map, not a search per entry: a batch of up to `ingest.max_batch` events may
            // all be one batching webhook's.)
            let owner: std::collections::HashMap<(usize, usize), usize> = reservations
                .iter()
                .enumerate()
                .flat_map(|(k, (keys, _))| keys.iter().map(move |&key| (key, k)))
                .collect();
            let mut started: Vec<Vec<crate::store::Leased>> =
                reservations.iter().map(|_| Vec::new()).collect();
            for l in leased {
                let key = (l.event, l.leased.entry.id.idx as usize);
                if let Some(&k) = owner.get(&key) {
                    started[k].push(l.leased);
                }
            }
            for ((_, r), leased) in reservations.into_iter().zip(started) {
                if !leased.is_empty() {
                    r.start(leased);
                }
            }
            o
        }
        Err(crate::store::StoreError::EventTooLarge { index, bytes, max }) => {
            // The event's stored form is over what one record of the store holds (a text
            // body is stored JSON-escaped, binary data as base64, so it can be several times
            // the body).
            return refused_by_the_store(
                app,
                &answered,
                batch,
                index,
                StatusCode::PAYLOAD_TOO_LARGE,
                "event too large for the store",
                format!(
                    "stored with its envelope the event takes {bytes} bytes (text is stored JSON-escaped, so control characters take six bytes each; binary data as base64), over the {max} bytes the store takes in one record: nothing was stored"
                ),
            );
        }
        Err(crate::store::StoreError::FanOutTooLarge { index, writes, max }) => {
            // Matched by more targets than the store writes in one atomic commit.
            return refused_by_the_store(
                app,
                &answered,
                batch,
                index,
                StatusCode::UNPROCESSABLE_ENTITY,
                "fan-out too large for the store",
                format!(
                    "the event matches so many targets that storing it with one queue entry each takes {writes} writes, over the {max} the store commits atomically (the JetStream store: an event and its fan-out are one atomic batch, so an event may match at most about {} targets): nothing was stored; narrow the rules that match it or split its targets",
                    max.saturating_sub(3)
                ),
            );
        }
        Err(crate::store::StoreError::Compacting) => {
            // Planned and short-lived: back-pressure, not an error.
            tracing::info!(
                events = answered.len(),
                "accept refused: the store is compacting"
            );
            return compacting_response(
                "the store is compacting its file; nothing was stored, retry later",
            );
        }
        Err(e) => {
            // A warning: the producer is told to retry, and nothing is lost. Limited: while
            // the store is out of reach every request is refused, and a line each (224 in
            // 32 s at 7 requests a second, an audit counted) buried everything else.
            if let Some(suppressed) = app.dispatcher.context().log_gates.admit(STORE_REFUSAL_GATE) {
                tracing::warn!(error = %e, events = answered.len(), suppressed, "accept failed: store unavailable; the producer is told to retry");
            }
            // A redb commit that fails is not applied. A JetStream publish whose answer was
            // lost (a timeout) may have been: its events may be stored, and delivered. The
            // producer must send the same ids again (a stored one answers `duplicate`), never
            // new ones, or it makes a second business event.
            let message = if app.store.shared() {
                "storage unavailable; these events may or may not have been stored: retry later with the same ids (one already stored answers duplicate)"
            } else {
                "storage unavailable; nothing was stored, retry later"
            };
            return with_retry_after(
                error_response(StatusCode::SERVICE_UNAVAILABLE, message, Vec::new()),
                STORE_RETRY_AFTER_S,
            );
        }
    };
    app.metrics.count_rule_matches(
        answered
            .iter()
            .zip(&outcomes)
            .filter(|(_, o)| matches!(o, AcceptOutcome::Accepted { .. }))
            .flat_map(|(a, _)| a.rules.iter().map(String::as_str)),
        now,
    );
    let mut results = Vec::with_capacity(answered.len());
    for ((ev, outcome), q) in answered.into_iter().zip(outcomes).zip(quarantined) {
        if let AcceptOutcome::Accepted { overflowed, .. } = &outcome {
            // A target's queue at its depth cap: that copy is a dead letter like any other
            // (the event itself is accepted for its other targets).
            for target in overflowed {
                crate::deliver::dead_lettered(
                    app.dispatcher.context(),
                    Some(target),
                    ev.dead_for(target),
                    DlqReason::TargetOverflow,
                    Some("the target's queue is at its depth cap"),
                    now,
                );
            }
        }
        let (status, reason, errors) = match (outcome, q) {
            (AcceptOutcome::Duplicate { .. }, _) => ("duplicate", None, Vec::new()),
            (AcceptOutcome::Accepted { .. }, Some((reason, errors))) => {
                ("quarantined", Some(reason), errors)
            }
            (AcceptOutcome::Accepted { .. }, None) => ("accepted", None, Vec::new()),
        };
        app.metrics
            .ingest_events
            .get_or_create(&vec![("status", status.to_string())])
            .inc();
        if let ("accepted", Some(cause)) = (status, ev.unrouted.cause()) {
            app.metrics
                .ingest_unrouted
                .get_or_create(&vec![("cause", cause.to_string())])
                .inc();
            if let Some(suppressed) = app.dispatcher.context().log_gates.admit("(unrouted)") {
                // Info, not warn: in an event bus, events no rule wants are often normal (a
                // producer ahead of its consumers); the counter is what to alert on.
                tracing::info!(event_id = %ev.id, source = %ev.source, ty = %ev.ty, cause, suppressed, "event accepted and routed to no target: it matched no enabled rule (only the archive keeps it; `router replay` routes it again)");
            }
        }
        if let Some(reason) = reason.and_then(|r| r.parse::<DlqReason>().ok()) {
            // The first validation error, with how many more: the log line says why.
            let detail = errors.first().map(|e| {
                let more = match errors.len() - 1 {
                    0 => String::new(),
                    n => format!(" (and {n} more)"),
                };
                format!("{}: {}{more}", e.pointer, e.message)
            });
            crate::deliver::dead_lettered(
                app.dispatcher.context(),
                None,
                ev.dead(),
                reason,
                detail.as_deref(),
                now,
            );
        }
        tracing::debug!(event_id = %ev.id, source = %ev.source, status, "ingested");
        results.push(EventResult {
            id: ev.id,
            source: ev.source,
            status,
            reason,
            errors,
        });
    }
    (
        StatusCode::ACCEPTED,
        // Serialised straight from the structs, without an intermediate `Value` tree (pinned,
        // alternating: no measurable difference in CPU per event; it is the typed form).
        axum::Json(Answer { results }),
    )
        .into_response()
}

/// The attribute of an event that names it as one of the router's own.
#[derive(Clone, Copy)]
enum Reserved {
    /// `handler://` or `router://` (`auth::RESERVED_SOURCE_PREFIXES`).
    Source,
    /// `router.` (`auth::RESERVED_TYPE_PREFIX`).
    Type,
}

/// Where attribute `attr` of event `i` of a request in `mode` was sent: `/source`,
/// `/<i>/source` in a batch, the `ce-source` header in binary mode (`type` likewise).
fn attribute_pointer(mode: parse::Mode, i: usize, attr: &str) -> String {
    match mode {
        parse::Mode::Structured => format!("/{attr}"),
        parse::Mode::Batch => format!("/{i}/{attr}"),
        parse::Mode::Binary => format!("/ce-{attr}"),
    }
}

/// The 403 for event `i` of a request in `mode` whose type or source is outside the token's
/// ingest scopes (`needed`), pointing at that attribute, so that a producer sending a batch
/// learns which element to fix.
fn scope_refused(
    principal: &crate::auth::Principal,
    mode: parse::Mode,
    i: usize,
    needed: &crate::auth::Scope,
) -> Response {
    let attr = match needed {
        crate::auth::Scope::IngestSource(_) => "source",
        _ => "type",
    };
    error_response(
        StatusCode::FORBIDDEN,
        "out of scope",
        vec![FieldError::new(
            attribute_pointer(mode, i, attr),
            format!("token {:?} lacks scope {needed}", principal.name),
        )],
    )
}

/// The 403 for event `i` of a request in `mode` whose source or type (`value`) is one of the
/// router's own, pointing at that attribute (see [`attribute_pointer`]).
fn reserved_refused(
    principal: &crate::auth::Principal,
    mode: parse::Mode,
    i: usize,
    what: Reserved,
    value: &str,
    needed: &crate::auth::Scope,
) -> Response {
    let attr = match what {
        Reserved::Source => "source",
        Reserved::Type => "type",
    };
    let pointer = attribute_pointer(mode, i, attr);
    let why = match what {
        Reserved::Source => {
            let prefix = crate::auth::reserved_source_prefix(value).unwrap_or_default();
            format!(
                "sources starting with {prefix} are the router's own (handlers' emitted events, system events); only admin or an ingest-source: pattern that itself starts with {prefix} may send them (ingest-source:* does not)"
            )
        }
        Reserved::Type => {
            let prefix = crate::auth::RESERVED_TYPE_PREFIX;
            format!(
                "types starting with {prefix} are the router's system events (alert rules route them); only admin or an ingest: pattern that itself starts with {prefix} may send them (ingest:* does not)"
            )
        }
    };
    tracing::warn!(token = %principal.name, attr, value, "ingest refused: an attribute reserved for the router's own events");
    error_response(
        StatusCode::FORBIDDEN,
        "out of scope",
        vec![FieldError::new(
            pointer,
            format!("token {:?} lacks scope {needed}: {why}", principal.name),
        )],
    )
}

/// `Retry-After` (seconds) while the store compacts its file: compaction takes seconds on a
/// file of a few GB.
const COMPACTING_RETRY_AFTER_S: u64 = 5;

/// How long a client waits before trying a change again that a shared store's catalog could
/// not take (an unreachable NATS server usually comes back within seconds).
const CATALOG_RETRY_AFTER_S: u64 = 5;

/// 503 with `Retry-After` for a change (a handler or contract upload) refused because the
/// catalog the nodes share could not be reached: nothing was changed anywhere.
pub(crate) fn catalog_unavailable_response(summary: &str, error: String) -> Response {
    with_retry_after(
        error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            summary,
            vec![FieldError::new("", error)],
        ),
        CATALOG_RETRY_AFTER_S,
    )
}

/// The answer to any request the store refused because it is compacting its file (ingest
/// and API reads alike): 503 with `Retry-After`.
pub(crate) fn compacting_response(summary: &str) -> Response {
    with_retry_after(
        error_response(StatusCode::SERVICE_UNAVAILABLE, summary, Vec::new()),
        COMPACTING_RETRY_AFTER_S,
    )
}

/// What the answer to a producer needs of one event once the event itself has gone to the
/// store.
struct Answered {
    id: String,
    source: String,
    ty: String,
    hops: u32,
    /// (target, ordering key, held on a dead letter) of its ordered copies: a copy the depth
    /// cap refuses is announced with its key, and whether that holds the key.
    keys: Vec<(String, String, bool)>,
    /// Why it went to no target, if it did not.
    unrouted: Unrouted,
    /// The rules it matched (counted per rule once it is accepted).
    rules: Vec<String>,
}

impl Answered {
    fn of(ev: &CloudEvent) -> Self {
        Self {
            id: ev.id.clone(),
            source: ev.source.clone(),
            ty: ev.ty.clone(),
            hops: ev.hops(),
            keys: Vec::new(),
            unrouted: Unrouted::No,
            rules: Vec::new(),
        }
    }

    /// Notes the ordered copies of `ne` (routed from this event).
    fn with_keys(mut self, ne: &NewEvent) -> Self {
        self.keys = ne
            .targets
            .iter()
            .filter_map(|t| {
                let key = t.ordering_key.clone()?;
                Some((t.target_id.clone(), key, t.hold_key))
            })
            .collect();
        self
    }

    /// The event as its dead letters name it.
    fn dead(&self) -> crate::deliver::DeadEvent<'_> {
        crate::deliver::DeadEvent {
            id: &self.id,
            source: &self.source,
            ty: &self.ty,
            hops: self.hops,
            emitted_by: None,
            ordering_key: None,
            key_held: false,
            dlq_id: None,
        }
    }

    /// The event as the dead letter of its copy for `target` names it.
    fn dead_for(&self, target: &str) -> crate::deliver::DeadEvent<'_> {
        match self.keys.iter().find(|(t, _, _)| t == target) {
            Some((_, key, held)) => crate::deliver::DeadEvent {
                ordering_key: Some(key),
                key_held: *held,
                ..self.dead()
            },
            None => self.dead(),
        }
    }
}

/// Matches `ev` against `rules` and builds what the store accepts.
pub fn route(
    rules: &crate::rules::RuleSet,
    disabled: &crate::app::DisabledRules,
    ev: CloudEvent,
    now: i64,
    dedup_window_ms: i64,
) -> NewEvent {
    let matched = match_targets(rules, disabled, &ev);
    routed_event(rules, ev, now, dedup_window_ms, matched)
}

/// What the store accepts for `ev`, routed under `rules` to the rules and entries `matched`.
fn routed_event(
    rules: &crate::rules::RuleSet,
    ev: CloudEvent,
    now: i64,
    dedup_window_ms: i64,
    (matched_rules, targets): (Vec<String>, Vec<NewEntry>),
) -> NewEvent {
    NewEvent {
        event: ev,
        accepted_at: now,
        ruleset_version: rules.version.clone(),
        matched_rules,
        targets,
        quarantine: None,
        dedup_window_ms,
    }
}

/// The rules (not disabled) that `ev` matches, and a queue entry for each of their targets.
pub fn match_targets(
    rules: &crate::rules::RuleSet,
    disabled: &crate::app::DisabledRules,
    ev: &CloudEvent,
) -> (Vec<String>, Vec<NewEntry>) {
    match_targets_counting(rules, disabled, ev, &mut 0, &mut false)
}

/// [`match_targets`], adding the matcher's work to `steps`, and setting `disabled_hit` when
/// a rule an operator disabled matched.
fn match_targets_counting(
    rules: &crate::rules::RuleSet,
    disabled: &crate::app::DisabledRules,
    ev: &CloudEvent,
    steps: &mut u64,
    disabled_hit: &mut bool,
) -> (Vec<String>, Vec<NewEntry>) {
    let mut matched_rules = Vec::new();
    let mut targets = Vec::new();
    for m in rules.matches_event_counting(ev, steps) {
        if !disabled.is_empty() && disabled.contains(&m.rule) {
            *disabled_hit = true;
            continue;
        }
        for tid in &m.target_ids {
            let spec = rules.targets.get(tid);
            let ordering_key = spec
                .and_then(|spec| spec.policy.ordering.as_ref())
                .and_then(|o| o.extract_event(ev));
            targets.push(NewEntry {
                target_id: tid.clone(),
                rule: m.rule.clone(),
                ordering_key,
                max_depth: spec.map(|s| s.policy.max_queue_depth),
                lease_ms: None,
                hold_key: spec.is_some_and(|s| s.policy.holds_keys()),
            });
        }
        matched_rules.push(m.rule);
    }
    (matched_rules, targets)
}

/// `work`'s output, and how many turns a task counting them got on this runtime while it ran:
/// on a current-thread runtime, another task runs only while `work` waits (matching inline
/// never waits, matching on the blocking pool does, for the whole match).
#[cfg(test)]
pub(crate) async fn reactor_turns_during<T>(
    work: impl std::future::Future<Output = T>,
) -> (T, u64) {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    let ran = Arc::new(AtomicU64::new(0));
    let counter = ran.clone();
    let ticker = tokio::spawn(async move {
        loop {
            counter.fetch_add(1, Relaxed);
            tokio::task::yield_now().await;
        }
    });
    tokio::task::yield_now().await;
    let before = ran.load(Relaxed);
    let out = work.await;
    let during = ran.load(Relaxed) - before;
    ticker.abort();
    (out, during)
}

/// Rules whose wildcards keep `n` matcher states active (`*x*y*q` for `n` letter pairs),
/// and an event of `len` letters that half-matches them all without matching.
#[cfg(test)]
pub(crate) fn costly(dir: &std::path::Path, pairs: usize, len: usize) -> (Arc<App>, CloudEvent) {
    let cfg = crate::app::test_config(dir);
    let mut text = String::from("rules:\n");
    let letters: Vec<char> = ('a'..='p').collect();
    for i in 0..pairs {
        let (x, y) = (letters[i / 16], letters[i % 16]);
        text.push_str(&format!(
            "  - name: w{i}\n    pattern: {{data: {{s: [{{wildcard: '*{x}*{y}*q'}}]}}}}\n    targets: [{{webhook: 'http://127.0.0.1:9/', id: 'h{i}'}}]\n"
        ));
    }
    std::fs::write(cfg.rules_dir.join("r.yaml"), text).expect("rules");
    let disk = crate::store::fault::SimulatedDisk::new();
    let store = crate::store::RedbStore::with_backend_factory(
        move || disk.backend(),
        crate::store::StoreOptions::default(),
    )
    .expect("store");
    let app = crate::app::test_app(cfg, store, None);
    let s: String = letters.iter().cycle().take(len).collect();
    let ev = parse::event_from_json(
        json!({"specversion": "1.0", "id": "1", "source": "/s", "type": "t", "data": {"s": s}}),
        "",
    )
    .expect("valid event");
    (app, ev)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A large request's contract checks leave the reactor thread; a small one's stay on it
    /// (a hand-off would cost more than the check).
    #[tokio::test(flavor = "current_thread")]
    async fn large_requests_are_checked_off_the_reactor() {
        let here = std::thread::current().id();
        let small = off_reactor_if_large(BLOCKING_CHECK_BYTES - 1, || std::thread::current().id());
        assert_eq!(small.await.expect("ran"), here);
        let large = off_reactor_if_large(BLOCKING_CHECK_BYTES, || std::thread::current().id());
        assert_ne!(large.await.expect("ran"), here);
    }

    use super::costly;

    /// The audit's stall: matching ran inline on the reactor whatever it cost, so events whose
    /// values half-matched many wildcards held it for seconds (`/healthz` included). A 10 KB
    /// request against such rules now leaves the reactor, and its matching is measured.
    #[tokio::test(flavor = "current_thread")]
    async fn costly_matching_leaves_the_reactor_and_is_measured() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (app, ev) = costly(dir.path(), 100, 10_000);
        let rules = app.rules.load_full();
        assert!(rules.match_cost(10_000) >= BLOCKING_CHECK_BYTES);
        let (checked, during) =
            reactor_turns_during(check_and_route(&app, rules, vec![ev], 10_000)).await;
        let checked = checked.expect("ran");
        assert!(
            during > 0,
            "the reactor ran nothing while the event was matched"
        );
        assert!(matches!(
            checked.as_slice(),
            [(_, ContractOutcome::Pass, Some((matched, _, Unrouted::NoMatch)))] if matched.is_empty()
        ));
        let text = app.metrics.render(app.store.as_ref(), 0).await;
        assert!(
            text.contains("router_rule_match_seconds_count 1")
                && text.contains("router_rule_match_steps_count 1"),
            "{text}"
        );
    }

    /// While the store fails, every request is refused: its log line is a warning (the
    /// producer is told to retry, nothing is lost) limited to `LogGates::PER_WINDOW` per
    /// window, where each refused request wrote an error line of its own (224 in 32 s at 7
    /// requests a second during an audit's NATS outage).
    #[tokio::test(flavor = "current_thread")]
    async fn refusals_while_the_store_fails_log_a_limited_warning() {
        let dir = tempfile::tempdir().expect("tempdir");
        let disk = crate::store::fault::SimulatedDisk::new();
        let d = disk.clone();
        let store = crate::store::RedbStore::with_backend_factory(
            move || d.backend(),
            crate::store::StoreOptions::default(),
        )
        .expect("store");
        let app = crate::app::test_app(crate::app::test_config(dir.path()), store, None);
        disk.set_failing(true);
        let (log, _logging) = crate::telemetry::test_log::capture();
        let principal = crate::auth::Principal::with_scopes(&["admin"]);
        let mut headers = HeaderMap::new();
        headers.insert(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/cloudevents+json"),
        );
        let gates = crate::telemetry::LogGates::PER_WINDOW as usize;
        let requests = 2 * gates;
        let started = std::time::Instant::now();
        for i in 0..requests {
            let body =
                json!({"specversion": "1.0", "id": i.to_string(), "source": "/s", "type": "t"});
            let r = handle(&app, &principal, &headers, Body::from(body.to_string())).await;
            assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        }
        // Each refusal takes the failing store about 0.2 s here, so the requests fit in one
        // 10 s window; on a machine slow enough to take longer, a new window lets another
        // `gates` lines through.
        let windows =
            1 + started.elapsed().as_secs() / crate::telemetry::LogGates::WINDOW.as_secs();
        let allowed = (gates * windows as usize).min(requests);
        let text = log.text();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("accept failed"))
            .collect();
        assert!(
            !lines.is_empty() && lines.len() <= allowed,
            "{} lines for {requests} refusals (at most {allowed}): {text}",
            lines.len()
        );
        assert!(
            lines
                .iter()
                .all(|l| l.contains(" WARN ") && l.contains("suppressed=")),
            "{text}"
        );
        assert!(!text.contains("ERROR"), "{text}");
    }

    /// Cheap rules keep small requests on the reactor (the hand-off would cost more).
    #[tokio::test(flavor = "current_thread")]
    async fn cheap_matching_stays_on_the_reactor() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (app, ev) = costly(dir.path(), 0, 10_000);
        let rules = app.rules.load_full();
        assert!(rules.match_cost(10_000) < BLOCKING_CHECK_BYTES);
        let checked = check_and_route(&app, rules, vec![ev], 10_000)
            .await
            .expect("ran");
        assert_eq!(checked.len(), 1);
    }
}
