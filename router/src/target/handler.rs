//! Handler target: runs an uploaded WebAssembly component on the event, in the sandbox, and
//! turns what it produced into an outbox (emitted events + key-value writes) that the worker
//! commits atomically with the delivery's ack.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::Value;
use tokio::sync::Semaphore;

use super::{AttemptOutcome, DeliveryRequest, Target};
use crate::clock::Clock;
use crate::event::CloudEvent;
use crate::store::{CompletedRecord, DlqReason, KvOp, NewEvent, Outbox, Store};
use crate::wasm::{
    DeliveryInfo, HandlerLimits, HandlerLogs, HandlerRegistry, InvocationOutcome, KvReader,
    LogRecord,
};

/// Turns emitted events into what the store accepts (contracts, rules, loop detection);
/// `None` once the router is gone (shutting down): the emissions cannot be routed.
pub type Prepare =
    Arc<dyn Fn(&EmitterOf, Vec<CloudEvent>, i64) -> Option<Vec<NewEvent>> + Send + Sync>;

/// How long a delivery waits at start for the router to wire up emission routing (workers
/// start, and resume reclaimed deliveries, before the router is fully assembled).
const WIRING_WAIT: Duration = Duration::from_secs(10);

/// Who emitted a batch of events: the handler and the owner of its active version (the
/// principal that uploaded it), whose ingest scope the emissions must fall within.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmitterOf {
    /// Handler name.
    pub handler: String,
    /// Token name of the uploader of the running version.
    pub owner: String,
    /// That uploader's team, whose tokens stand in for it once it is gone.
    pub team: Option<String>,
    /// The handler target whose delivery emitted them.
    pub target: String,
    /// The id of the event that delivery handled.
    pub event_id: String,
}

impl EmitterOf {
    /// What a dead letter of one of these emissions records of its emitter.
    pub fn emitted_by(&self) -> crate::store::EmittedBy {
        crate::store::EmittedBy {
            handler: self.handler.clone(),
            target: self.target.clone(),
            event_id: self.event_id.clone(),
        }
    }
}

/// Shared by every handler target.
pub struct HandlerRuntime {
    /// Uploaded handlers.
    pub registry: Arc<HandlerRegistry>,
    /// Where uploads, rollbacks and deletes go (through the store's shared catalog when the
    /// nodes share a store).
    pub changes: Arc<crate::wasm::HandlerChanges>,
    /// Per-invocation limits.
    pub limits: HandlerLimits,
    /// Bounds concurrent instances to the pooling allocator's size.
    pub slots: Arc<Semaphore>,
    /// Invocations of one handler running at once (CPU-bound work: more than the machine's
    /// cores only lets one busy or hostile handler crowd the others out of the CPU).
    pub running_per_handler: usize,
    /// One gate per handler, `running_per_handler` wide.
    pub gates: std::sync::Mutex<std::collections::HashMap<String, Arc<Semaphore>>>,
    /// Captured logs, kept on disk per handler.
    pub logs: Arc<HandlerLogs>,
    /// Emitted events past this many hops go to the DLQ as `loop_detected`.
    pub hop_limit: u32,
    /// How long COMPLETED records are kept, ms.
    pub completed_ttl_ms: i64,
    /// Bound on each handler's key-value namespace (keys plus values), bytes.
    pub kv_max_bytes: Option<u64>,
    /// Deliveries answered from COMPLETED, per handler.
    pub completed_hits: prometheus_client::metrics::family::Family<
        crate::telemetry::Labels,
        prometheus_client::metrics::counter::Counter,
    >,
    /// Invocations per handler and outcome.
    pub invocations: prometheus_client::metrics::family::Family<
        crate::telemetry::Labels,
        prometheus_client::metrics::counter::Counter,
    >,
    /// Log lines the per-invocation cap dropped, per handler.
    pub log_lines_dropped: prometheus_client::metrics::family::Family<
        crate::telemetry::Labels,
        prometheus_client::metrics::counter::Counter,
    >,
    /// The store (key-value and COMPLETED reads).
    pub store: Arc<dyn Store>,
    /// Time source.
    pub clock: Arc<dyn Clock>,
    /// Set once the app exists: routes emitted events.
    pub prepare: OnceLock<Prepare>,
}

struct StoreKv {
    store: Arc<dyn Store>,
    namespace: String,
    now: i64,
    max_bytes: Option<u64>,
}

impl KvReader for StoreKv {
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, String> {
        self.store
            .kv_get(&self.namespace, key, self.now)
            .map_err(|e| e.to_string())
    }

    fn room(&self) -> Result<Option<u64>, String> {
        let Some(max) = self.max_bytes else {
            return Ok(None);
        };
        let used = self
            .store
            .kv_usage_of(&self.namespace)
            .map_err(|e| e.to_string())?;
        Ok(Some(max.saturating_sub(used.bytes)))
    }
}

/// A `handler: NAME` target.
pub struct HandlerTarget {
    rt: Arc<HandlerRuntime>,
    name: String,
}

impl HandlerTarget {
    /// A target running handler `name`.
    pub fn new(rt: Arc<HandlerRuntime>, name: String) -> Self {
        Self { rt, name }
    }

    /// Writes the lines `(at_ms, level, message)` of one delivery to the handler's log, each
    /// stamped with its own time.
    fn log_all(
        &self,
        req: &DeliveryRequest,
        version: &str,
        lines: impl IntoIterator<Item = (i64, String, String)>,
    ) {
        let records: Vec<LogRecord> = lines
            .into_iter()
            .map(|(at_ms, level, message)| LogRecord {
                seq: 0,
                at: crate::clock::rfc3339(at_ms),
                level,
                message,
                event_id: req.event_id.clone(),
                source: Some(req.event.event.source.clone()),
                attempt: req.attempt,
                version: version.to_string(),
            })
            .collect();
        if !records.is_empty() {
            self.rt.logs.push_all(&self.name, &records);
        }
    }

    /// Writes one line of the router's own about a delivery to the handler's log, stamped now.
    fn log(&self, req: &DeliveryRequest, version: &str, level: &str, message: String) {
        let now = self.rt.clock.now_ms();
        self.log_all(req, version, [(now, level.to_string(), message)]);
    }

    /// Says in the handler's log which of its emissions go to the DLQ before any target (past
    /// the hop limit, outside its owner's ingest scope, failing a contract), and why: the
    /// delivery itself reads `delivered`, and such a dead letter has no target whose `dlq:`
    /// scope would show it, so without this line the team saw a clean log while its output
    /// piled up where only an administrator looked.
    fn log_dead_emissions(&self, req: &DeliveryRequest, version: &str, prepared: &[NewEvent]) {
        let now = self.rt.clock.now_ms();
        // `prepare` keeps the handler's order: the index is the emission's.
        let lines = prepared.iter().enumerate().filter_map(|(i, ne)| {
            let q = ne.quarantine.as_ref()?;
            let errors = q
                .errors
                .iter()
                .map(|e| format!("{} {}", e.pointer, e.message).trim().to_string())
                .collect::<Vec<_>>()
                .join("; ");
            Some((
                now,
                "warn".to_string(),
                format!(
                    "emitted event #{i} (id {:?}, type {:?}) dead-lettered as {} before reaching any target: {errors} (the handler's team lists these with `router dlq ls --emitted-by {}`)",
                    ne.event.id,
                    ne.event.ty,
                    q.reason.as_str(),
                    self.name
                ),
            ))
        });
        self.log_all(req, version, lines);
    }

    async fn run(&self, req: &DeliveryRequest) -> (AttemptOutcome, Option<Box<Effects>>) {
        // The attempt's policy timeout bounds everything below, the invocation included (which
        // `handlers.timeout` caps for every handler): the lease (policy timeout + margin) then
        // always outlasts a live attempt, and a target's `timeout: 2s` means what it says.
        let deadline = tokio::time::Instant::now() + req.timeout;
        if !self.wait_for_wiring().await {
            return (not_wired(), None);
        }
        // Not uploaded (yet, or again after a delete), being compiled after the start, or
        // failed to load: the delivery waits for it without spending attempts or counting for
        // the breaker, up to its max_age; the reason says which.
        let h = match self.rt.registry.lookup(&self.name) {
            Ok(h) => h,
            Err(why) => {
                return (
                    AttemptOutcome::Deferred {
                        reason: format!("{why}; waiting for it"),
                        retry_after: Duration::from_secs(5),
                        local: None,
                    },
                    None,
                );
            }
        };
        let version = h.version().sha256.chars().take(12).collect::<String>();
        // COMPLETED: this delivery was handled before (e.g. the same event accepted again after
        // its dedup window): the stored result stands and the handler is not run again. Looked
        // up before `accepts`: a newer version that narrowed it did not handle this delivery,
        // and must not dead-letter as `not_accepted` one an older version completed.
        match self
            .rt
            .store
            .completed_get(&self.name, &req.idempotency_key, self.rt.clock.now_ms())
            .await
        {
            Ok(Some(result)) => {
                self.log(
                    req,
                    &version,
                    "info",
                    format!(
                        "delivery completed earlier ({}): stored result returned, handler not run",
                        String::from_utf8_lossy(&result)
                    ),
                );
                self.rt
                    .completed_hits
                    .get_or_create(&vec![("handler", self.name.clone())])
                    .inc();
                return (AttemptOutcome::Delivered { status: None }, None);
            }
            Ok(None) => {}
            // Not knowing costs at most a second run, which emitted-id dedup absorbs.
            Err(e) => {
                tracing::warn!(error = %e, handler = %self.name, "COMPLETED lookup failed; running the handler")
            }
        }
        let ty = req.event.event.ty.clone();
        let dataversion = req.event.event.dataversion();
        if !h.descriptor().accepts(&ty, dataversion) {
            let error = format!(
                "handler {:?} does not accept {ty} v{dataversion}",
                self.name
            );
            // Every other way a delivery ends is in the team's log; this one too, or a team
            // that narrowed `accepts` in `describe()` only saw deliveries stop arriving.
            self.log(
                req,
                &version,
                "error",
                format!(
                    "not accepted (dead-lettered as not_accepted, handler not run): {error}; its describe() accepts {}",
                    h.descriptor().accepts_text()
                ),
            );
            return (
                AttemptOutcome::Permanent {
                    error,
                    status: None,
                },
                Some(Box::new(Effects {
                    outbox: Outbox::default(),
                    // Its own reason: `unknown_version` is the contracts' (a type with
                    // contracts, but not for this dataversion), and a wrong type routed here
                    // is no versioning problem.
                    dlq_reason: Some(DlqReason::NotAccepted),
                })),
            );
        }
        // The delivery (lease, store commits) may be in flight many times over; the CPU-bound
        // invocation passes this per-handler gate, then takes an instance slot. Both waits
        // count against the attempt's deadline, but only up to the point where the invocation
        // would still get its run time (`least_run_time`): past it the delivery is put back
        // as busy, unattempted, rather than run on what is left and blamed for timing out.
        let least = least_run_time(self.rt.limits.timeout, req.timeout);
        let run_by = deadline.checked_sub(least).unwrap_or(deadline);
        let gate = {
            let mut gates = self.rt.gates.lock().unwrap_or_else(|p| p.into_inner());
            gates
                .entry(self.name.clone())
                .or_insert_with(|| Arc::new(Semaphore::new(self.rt.running_per_handler.max(1))))
                .clone()
        };
        let waiting = tokio::time::Instant::now();
        let _running = match tokio::time::timeout_at(run_by, gate.acquire_owned()).await {
            Ok(Ok(permit)) => permit,
            _ => {
                return busy(format!(
                    "{} invocations of {:?} already running (handlers.running_per_handler) for so long that this one would not get {least:?} of the policy timeout of {:?}",
                    self.rt.running_per_handler, self.name, req.timeout
                ));
            }
        };
        let slot = match tokio::time::timeout_at(run_by, self.rt.slots.clone().acquire_owned())
            .await
        {
            Ok(Ok(slot)) => slot,
            Ok(Err(_)) => {
                return (
                    AttemptOutcome::Retryable {
                        error: "handler runtime is shutting down".into(),
                        status: None,
                        retry_after: None,
                    },
                    None,
                );
            }
            Err(_) => {
                return busy(format!(
                    "every instance slot (handlers.max_instances) was taken for so long that this invocation would not get {least:?} of the policy timeout of {:?}",
                    req.timeout
                ));
            }
        };
        let now_instant = tokio::time::Instant::now();
        let waited = now_instant.saturating_duration_since(waiting);
        let left = deadline.saturating_duration_since(now_instant);
        if left < least || left.is_zero() {
            return busy(format!(
                "waited {waited:?} for a free instance; the {left:?} left of the policy timeout of {:?} is less than the {least:?} an invocation gets",
                req.timeout
            ));
        }
        let mut limits = self.rt.limits.clone();
        limits.timeout = limits.timeout.min(left);
        let now = self.rt.clock.now_ms();
        let kv = Arc::new(StoreKv {
            store: self.rt.store.clone(),
            namespace: self.name.clone(),
            now,
            max_bytes: self.rt.kv_max_bytes,
        });
        let info = DeliveryInfo {
            attempt: req.attempt,
            idempotency_key: req.idempotency_key.clone(),
            rule: req.rule.clone(),
            target: req.target.clone(),
        };
        let event = req.event_json();
        let (hh, timeout) = (h.clone(), limits.timeout);
        // The slot goes with the invocation: were this attempt's future dropped (shutdown),
        // the invocation still running would keep its instance of the pool, and the slot must
        // account for it until it ends.
        let inv = match tokio::task::spawn_blocking(move || {
            let _slot = slot;
            crate::wasm::invoke(&hh, &event, &info, kv, &limits)
        })
        .await
        {
            Ok(inv) => inv,
            Err(e) => {
                return (
                    AttemptOutcome::Retryable {
                        error: format!("handler_trap: invocation task failed: {e}"),
                        status: None,
                        retry_after: None,
                    },
                    None,
                );
            }
        };
        if inv.log_lines_dropped > 0 {
            self.rt
                .log_lines_dropped
                .get_or_create(&vec![("handler", self.name.clone())])
                .inc_by(inv.log_lines_dropped);
        }
        // Each line at the time the handler logged it (`at_ms` counts from the invocation's
        // start, which is `now` give or take the thread hand-over), not when the invocation
        // ended: a line before a slow step must read as before it.
        self.log_all(
            req,
            &version,
            inv.logs.iter().map(|line| {
                (
                    now.saturating_add(i64::try_from(line.at_ms).unwrap_or(i64::MAX)),
                    format!("{:?}", line.level).to_lowercase(),
                    line.message.clone(),
                )
            }),
        );
        let outbox_of = |inv: &crate::wasm::Invocation, emitted: Vec<NewEvent>| Outbox {
            emitted,
            kv: inv
                .kv_writes
                .iter()
                .map(|w| KvOp {
                    namespace: self.name.clone(),
                    key: w.key.clone(),
                    value: w.value.clone(),
                    expires_at: w
                        .ttl_ms
                        .map(|t| now.saturating_add(i64::try_from(t).unwrap_or(i64::MAX))),
                })
                .collect(),
            cas: inv
                .cas_checks
                .iter()
                .map(|(k, v)| (self.name.clone(), k.clone(), v.clone()))
                .collect(),
            completed: None,
            kv_max_bytes: self.rt.kv_max_bytes,
        };
        let effects = |outbox| {
            Some(Box::new(Effects {
                outbox,
                dlq_reason: None,
            }))
        };
        if let InvocationOutcome::Busy(why) = &inv.outcome {
            // The handler did not run (the pool had no instance for it despite the slot):
            // not this delivery's failure, nor the handler's.
            tracing::warn!(handler = %self.name, reason = %why, "no wasm instance for a handler invocation; the delivery is put back");
            self.rt
                .invocations
                .get_or_create(&vec![
                    ("handler", self.name.clone()),
                    ("outcome", "busy".to_string()),
                ])
                .inc();
            return busy(why.clone());
        }
        let outcome = match &inv.outcome {
            InvocationOutcome::Emitted(_) => "ok",
            InvocationOutcome::Retry { .. } => "retry",
            InvocationOutcome::Fail(_) => "fail",
            InvocationOutcome::InvalidEmission(_) => "invalid_emission",
            InvocationOutcome::Timeout => "timeout",
            InvocationOutcome::Oom => "oom",
            InvocationOutcome::LimitExceeded(_) => "limit",
            InvocationOutcome::HostUnavailable(_) => "host_unavailable",
            _ => "trap",
        };
        self.rt
            .invocations
            .get_or_create(&vec![
                ("handler", self.name.clone()),
                ("outcome", outcome.to_string()),
            ])
            .inc();
        match &inv.outcome {
            InvocationOutcome::Emitted(partials) => {
                let events = match self.complete(req, partials) {
                    Ok(evs) => evs,
                    Err(e) => {
                        // The handler's team reads why in its logs (the DLQ is the
                        // target owner's, which a `handlers:` scope does not open).
                        self.log(req, &version, "error", format!("failed: {e}"));
                        return (
                            AttemptOutcome::Permanent {
                                error: e,
                                status: None,
                            },
                            None,
                        );
                    }
                };
                let emitter = EmitterOf {
                    handler: self.name.clone(),
                    owner: h.version().uploader.clone(),
                    team: h.version().team.clone(),
                    target: req.target.clone(),
                    event_id: req.event_id.clone(),
                };
                let ids: Vec<&str> = events.iter().map(|e| e.id.as_str()).collect();
                let result = serde_json::json!({ "version": version, "emitted": ids });
                let completed = CompletedRecord {
                    handler: self.name.clone(),
                    key: req.idempotency_key.clone(),
                    result: serde_json::to_vec(&result).unwrap_or_default(),
                    expires_at: now.saturating_add(self.rt.completed_ttl_ms),
                };
                // Contract checks and rule matching of large emissions, away from the
                // runtime's other tasks, as ingest does for large requests.
                let weight = events.iter().map(CloudEvent::payload_len).sum();
                let Some(prepared) = self.rt.prepare.get().and_then(|p| {
                    crate::blocking::off_reactor_if_large(weight, || p(&emitter, events, now))
                }) else {
                    // Never ack a delivery whose emissions were not routed: that would lose
                    // them. Nothing is committed; the delivery runs again.
                    return (not_wired(), None);
                };
                self.log_dead_emissions(req, &version, &prepared);
                let mut outbox = outbox_of(&inv, prepared);
                outbox.completed = Some(completed);
                (AttemptOutcome::Delivered { status: None }, effects(outbox))
            }
            // The handler's own `retry` and `fail` answers are logged like traps, so its team
            // sees why a delivery is retried or dead-lettered with a `handlers:` scope alone.
            InvocationOutcome::Retry { delay, message } => {
                let after = delay.map(|d| format!(" (after {d:?})")).unwrap_or_default();
                self.log(
                    req,
                    &version,
                    "warn",
                    format!("retry requested{after}: {message}"),
                );
                (
                    AttemptOutcome::Retryable {
                        error: format!("handler asked to retry: {message}"),
                        status: None,
                        retry_after: *delay,
                    },
                    effects(outbox_of(&inv, Vec::new())),
                )
            }
            InvocationOutcome::Fail(msg) => {
                self.log(req, &version, "error", format!("failed: {msg}"));
                (
                    AttemptOutcome::Permanent {
                        error: format!("handler failed: {msg}"),
                        status: None,
                    },
                    effects(outbox_of(&inv, Vec::new())),
                )
            }
            // Nothing is committed, as when the router cannot complete the emissions.
            InvocationOutcome::InvalidEmission(msg) => {
                self.log(req, &version, "error", format!("failed: {msg}"));
                (
                    AttemptOutcome::Permanent {
                        error: format!("handler failed: {msg}"),
                        status: None,
                    },
                    None,
                )
            }
            other => {
                let error = match other {
                    InvocationOutcome::Timeout => {
                        // Whole milliseconds: what is left of a deadline is rarely round.
                        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
                        let mut error = format!(
                            "handler_timeout: no answer within {:?}",
                            Duration::from_millis(ms)
                        );
                        if timeout >= self.rt.limits.timeout {
                            // Which key gives it more time (the shorter policy case below
                            // names both).
                            error.push_str(" (handlers.timeout)");
                        } else {
                            error.push_str(&format!(
                                " (handlers.timeout is {:?}; the target's policy timeout of {:?} bounds the whole attempt, and {:?} of it had passed before the handler ran)",
                                self.rt.limits.timeout,
                                req.timeout,
                                req.timeout.saturating_sub(timeout)
                            ));
                        }
                        error
                    }
                    InvocationOutcome::Oom => format!(
                        "handler_oom: memory cap of {} bytes reached (handlers.memory_bytes)",
                        self.rt.limits.memory_bytes
                    ),
                    InvocationOutcome::Trap(m) => format!("handler_trap: {m}"),
                    InvocationOutcome::HostUnavailable(m) => format!("handler_host: {m}"),
                    InvocationOutcome::LimitExceeded(m) => format!("handler_limit: {m}"),
                    _ => "handler_trap".into(),
                };
                self.log(req, &version, "error", error.clone());
                // The first line: a trap's wasm backtrace (dozens of lines) stays in the
                // handler's own logs and the attempt record, out of the router's log.
                tracing::warn!(handler = %self.name, error = error.lines().next().unwrap_or(""), "handler invocation failed");
                // A breached output, KV-write or fuel limit is deterministic: the same event
                // breaches it again at every attempt, so it is not retried (a fixed handler
                // gets it by a DLQ redrive). Nothing is committed either way.
                let outcome = if matches!(other, InvocationOutcome::LimitExceeded(_)) {
                    AttemptOutcome::Permanent {
                        error,
                        status: None,
                    }
                } else {
                    AttemptOutcome::Retryable {
                        error,
                        status: None,
                        retry_after: None,
                    }
                };
                (outcome, None)
            }
        }
    }

    /// Waits (bounded) until emission routing is wired up; false if it never was.
    async fn wait_for_wiring(&self) -> bool {
        let deadline = tokio::time::Instant::now() + WIRING_WAIT;
        while self.rt.prepare.get().is_none() {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    /// Completes partial emitted events: `id` derived from the delivery (a re-run produces the
    /// same ids, so ingest dedup drops its duplicates), `source` the handler's URI, `hops`, and
    /// a replayed delivery's `replay` marker.
    fn complete(
        &self,
        req: &DeliveryRequest,
        partials: &[Value],
    ) -> Result<Vec<CloudEvent>, String> {
        let hops = req.hops + 1;
        partials
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let mut v = p.clone();
                v["specversion"] = Value::from("1.0");
                v["id"] = Value::from(format!("{}-{i}", req.idempotency_key));
                v["source"] = Value::from(format!("handler://{}", self.name));
                let mut ev = crate::ingest::parse::event_from_json(v, "").map_err(|errs| {
                    format!(
                        "emitted event {i} is invalid: {}",
                        errs.iter()
                            .map(|e| format!("{} {}", e.pointer, e.message))
                            .collect::<Vec<_>>()
                            .join("; ")
                    )
                })?;
                ev.extensions.insert("hops".into(), Value::from(hops));
                // What a handler emits while handling a replayed delivery exists because of
                // the replay: it carries the job's marker as the replayed copy did, so a
                // receiver downstream can tell it from new business (its id, derived from the
                // replay's own idempotency key, is new).
                if let Some(job) = &req.replay {
                    ev.extensions
                        .insert("replay".into(), Value::from(job.clone()));
                }
                for (name, value) in [
                    ("traceparent", &req.traceparent),
                    ("tracestate", &req.tracestate),
                ] {
                    if let Some(v) = value {
                        ev.extensions.insert(name.into(), Value::from(v.clone()));
                    }
                }
                Ok(ev)
            })
            .collect()
    }
}

/// The least run time an invocation must still have, when it gets its turn at the handler's
/// gate and an instance slot, to be run at all; with less, the delivery is put back as busy
/// without spending an attempt or counting for the breaker.
///
/// The policy timeout bounds the whole attempt (the lease is sized on it), waits included, so
/// a delivery that queued long would otherwise run on what little is left, time out, and be
/// charged for a timeout a healthy handler never had the time to avoid. Asking for the whole
/// of `handlers.timeout` makes a `handler_timeout` always mean "ran for handlers.timeout and
/// did not answer". That needs room to queue, though: when the policy timeout is shorter than
/// twice `handlers.timeout`, asking for all of it (or all of the policy timeout, when that is
/// the shorter) would leave little or no time to wait at all, and a handler with more
/// deliveries than its gate admits would see most of them bounce off it as busy, again and
/// again, while the gate idles between their retries. So the invocation is owed
/// `handlers.timeout`, but never more than half the policy timeout: the other half is the
/// most a delivery may queue. With the defaults (10 s policy, 5 s `handlers.timeout`) every
/// invocation that runs gets its full 5 s.
fn least_run_time(handler_timeout: Duration, policy_timeout: Duration) -> Duration {
    handler_timeout.min(policy_timeout / 2)
}

/// The router is starting or stopping and cannot route emitted events: retried, nothing kept.
fn not_wired() -> AttemptOutcome {
    AttemptOutcome::Retryable {
        error: "the router is starting or stopping and cannot route emitted events yet; retried"
            .into(),
        status: None,
        retry_after: Some(Duration::from_secs(1)),
    }
}

/// The handler is busy (`why`): not a failure of this delivery, which waits a second
/// without spending an attempt.
fn busy(why: String) -> (AttemptOutcome, Option<Box<Effects>>) {
    (
        AttemptOutcome::Deferred {
            reason: format!("handler_busy: {why}"),
            retry_after: Duration::from_secs(1),
            local: None,
        },
        None,
    )
}

/// What the worker commits with the attempt's result.
#[derive(Debug, Clone, PartialEq)]
pub struct Effects {
    /// Emitted events and key-value writes.
    pub outbox: Outbox,
    /// A DLQ reason more specific than `permanent_error` (e.g. `unknown_version`).
    pub dlq_reason: Option<DlqReason>,
}

impl Target for HandlerTarget {
    fn deliver<'a>(&'a self, req: &'a DeliveryRequest) -> BoxFuture<'a, AttemptOutcome> {
        async move { self.run(req).await.0 }.boxed()
    }

    fn deliver_with_effects<'a>(
        &'a self,
        req: &'a DeliveryRequest,
    ) -> BoxFuture<'a, (AttemptOutcome, Option<Box<Effects>>)> {
        self.run(req).boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_invocation_is_owed_its_timeout_but_at_most_half_the_policy_timeout() {
        let s = Duration::from_secs;
        // The defaults: the full handlers.timeout, and as long again to queue.
        assert_eq!(least_run_time(s(5), s(10)), s(5));
        assert_eq!(least_run_time(s(5), s(60)), s(5));
        // A policy timeout under twice handlers.timeout: half of it, the other half to queue.
        assert_eq!(least_run_time(s(5), s(6)), s(3));
        assert_eq!(least_run_time(s(5), s(2)), s(1));
        // Never more than the policy timeout leaves room for.
        for (handler, policy) in [(1, 1), (5, 1), (1, 100), (30, 7)] {
            let least = least_run_time(s(handler), s(policy));
            assert!(least <= s(handler) && least <= s(policy) / 2 && !least.is_zero());
        }
    }

    /// A runtime with the example `invoice` handler (it accepts `order.paid` only), emissions
    /// routed to nowhere, on `store`.
    async fn invoice_runtime(dir: &std::path::Path, store: &Arc<dyn Store>) -> Arc<HandlerRuntime> {
        let cfg = crate::app::test_config(dir);
        let clock: Arc<dyn Clock> = Arc::new(crate::clock::SystemClock);
        let metrics = crate::telemetry::Metrics::new();
        let rt = crate::app::start_handlers(&cfg, store, &clock, &metrics)
            .await
            .expect("handler runtime");
        rt.registry
            .upload("invoice", &crate::wasm::tests::plugin("invoice"), "tests")
            .expect("upload");
        let prepare: Prepare = Arc::new(|_, _, _| Some(Vec::new()));
        assert!(rt.prepare.set(prepare).is_ok());
        rt
    }

    /// An attempt at the leased entry of event `id` (type `t`) for handler target `t-inv`.
    async fn attempt_of(
        store: &Arc<dyn Store>,
        id: &str,
    ) -> (crate::store::Leased, DeliveryRequest) {
        let now = crate::clock::SystemClock.now_ms();
        store
            .accept(vec![crate::store::test_events::new_event(
                "/s",
                id,
                &["t-inv"],
                now,
            )])
            .await
            .expect("accept");
        let leased = store
            .lease("t-inv", now, 1, 60_000)
            .await
            .expect("lease")
            .remove(0);
        let req = DeliveryRequest {
            body: bytes::Bytes::new(),
            idempotency_key: leased.entry.idempotency_key.clone(),
            event_id: id.into(),
            attempt: 1,
            traceparent: None,
            tracestate: None,
            timeout: Duration::from_secs(10),
            event: leased.event.clone(),
            replay: None,
            rule: "r".into(),
            target: "t-inv".into(),
            hops: 0,
            batch: None,
        };
        (leased, req)
    }

    /// A delivery completed earlier returns its stored result even when the active version
    /// no longer accepts its type (a newer version narrowed `accepts`): the result stands, as
    /// for any redelivery of a completed delivery. The `accepts` check came first and
    /// dead-lettered it as `not_accepted`. A delivery not completed is still refused, and
    /// that refusal is in the handler's log like every other way a delivery ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_completed_delivery_is_answered_before_accepts_is_checked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store: Arc<dyn Store> = crate::store::RedbStore::in_memory().expect("store");
        let rt = invoice_runtime(dir.path(), &store).await;
        let target = HandlerTarget::new(rt.clone(), "invoice".into());
        let now = crate::clock::SystemClock.now_ms();

        // Completed earlier (by a version that accepted `t`): its record is committed with the ack.
        let (leased, req) = attempt_of(&store, "done-1").await;
        let end = crate::store::AttemptEnd {
            finished_at: now,
            result: crate::store::AttemptResult::Delivered,
            status: None,
            error: None,
            outbox: Some(Box::new(Outbox {
                completed: Some(CompletedRecord {
                    handler: "invoice".into(),
                    key: req.idempotency_key.clone(),
                    result: br#"{"version":"old","emitted":[]}"#.to_vec(),
                    expires_at: now + 3_600_000,
                }),
                ..Outbox::default()
            })),
        };
        store
            .finish(
                leased.entry.id,
                leased.lease,
                end,
                crate::store::Disposition::Delivered,
                now,
            )
            .await
            .expect("finish");
        let (outcome, effects) = target.run(&req).await;
        assert_eq!(outcome, AttemptOutcome::Delivered { status: None });
        assert!(effects.is_none(), "nothing to commit: {effects:?}");

        // Never completed: not accepted, dead-lettered, and said in the handler's log.
        let (_, req) = attempt_of(&store, "new-1").await;
        let (outcome, effects) = target.run(&req).await;
        assert!(
            matches!(&outcome, AttemptOutcome::Permanent { error, .. } if error == "handler \"invoice\" does not accept t v1"),
            "{outcome:?}"
        );
        assert_eq!(
            effects.and_then(|e| e.dlq_reason),
            Some(DlqReason::NotAccepted)
        );
        let query = crate::wasm::LogQuery {
            limit: 10,
            event_id: Some("new-1".into()),
            source: None,
            min_level: None,
            before: None,
            attempt: None,
        };
        let lines = rt.logs.recent("invoice", &query).expect("logs");
        assert!(
            lines.iter().any(|l| l.level == "error"
                && l.attempt == 1
                && l.message.contains("not accepted")
                && l.message.contains("does not accept t v1")
                && l.message.contains("order.paid (every version)")),
            "{lines:?}"
        );
    }

    #[test]
    fn busy_defers_without_an_attempt() {
        let (outcome, effects) = busy("no instance".into());
        assert!(effects.is_none());
        assert!(
            matches!(&outcome, AttemptOutcome::Deferred { reason, .. } if reason == "handler_busy: no instance"),
            "{outcome:?}"
        );
    }
}
