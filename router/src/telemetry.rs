//! Metrics (Prometheus text format at `/metrics`) and the tracing subscriber.
//!
//! Counters are updated where things happen; queue gauges are read from the store when
//! `/metrics` is scraped, so they are never stale.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock, Reference};
use governor::middleware::NoOpMiddleware;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::store::Store;

/// Label pairs of a metric family.
pub type Labels = Vec<(&'static str, String)>;

fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_1, 2.0, 18))
}

/// A metric family with a `target` label that remembers the label sets made for each
/// target, so that a target removed from the rules loses all its series once it has drained
/// ([`Metrics::forget_target`]): counters and histograms of every target id ever used stayed
/// for the life of the process (an endurance run with target churn grew `/metrics` by about
/// 2,000 series an hour). A label set is noted once, when it is first made.
pub struct TargetFamily<M, C = fn() -> M> {
    family: Family<Labels, M, C>,
    made: std::sync::Mutex<std::collections::HashMap<String, Vec<Labels>>>,
}

impl<M: Default + prometheus_client::metrics::TypedMetric + Clone> Default for TargetFamily<M> {
    fn default() -> Self {
        Self::new(Family::default())
    }
}

impl<M, C> TargetFamily<M, C>
where
    M: prometheus_client::metrics::TypedMetric + Clone,
    C: prometheus_client::metrics::family::MetricConstructor<M> + Clone,
{
    /// Wraps `family`.
    pub fn new(family: Family<Labels, M, C>) -> Self {
        Self {
            family,
            made: Default::default(),
        }
    }

    /// The family, to register.
    pub fn family(&self) -> Family<Labels, M, C> {
        self.family.clone()
    }

    /// The metric of `labels`, made (and noted under its target) if it is new.
    pub fn get_or_create(&self, labels: &Labels) -> impl std::ops::Deref<Target = M> + '_ {
        if let Some(metric) = self.family.get(labels) {
            return metric;
        }
        if let Some((_, target)) = labels.iter().find(|(k, _)| *k == "target") {
            let mut made = self.made.lock().unwrap_or_else(|p| p.into_inner());
            let sets = made.entry(target.clone()).or_default();
            if !sets.contains(labels) {
                sets.push(labels.clone());
            }
        }
        self.family.get_or_create(labels)
    }

    /// Removes every series of `target`.
    fn forget(&self, target: &str) {
        let sets = self
            .made
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(target);
        for labels in sets.into_iter().flatten() {
            self.family.remove(&labels);
        }
    }
}

/// Per-subject limits on repetitive log lines (a target's failed attempts, its dead letters):
/// at most [`LogGates::PER_WINDOW`] lines per [`LogGates::WINDOW`] for one subject, the rest
/// counted and reported on the next line that goes through (`suppressed = N`). A target
/// failing every attempt wrote one line per attempt (630 lines in 8 s for 500 events, a
/// helper measured), burying everything else in the log; the metrics keep the full counts.
///
/// On top of them, a process-wide ceiling ([`LogGates::CEILING_PER_SECOND`], bursts of
/// [`LogGates::CEILING_BURST`]): the per-subject limits alone let the total grow with the
/// number of failing subjects (1,000 targets down wrote ~1,000 lines/s, 77 MB in 10 min in
/// an audit), just when the log must stay readable. A line the ceiling drops counts as
/// suppressed for its subject like any other (its next line says so, and it does not use up
/// the subject's own lines), and once per window one line says how many lines of how many
/// subjects the ceiling dropped, for subjects that log nothing more.
pub struct LogGates<C: Clock = DefaultClock> {
    clock: C,
    ceiling: RateLimiter<NotKeyed, InMemoryState, C, NoOpMiddleware<<C as Clock>::Instant>>,
    state: std::sync::Mutex<GatesState<C::Instant>>,
}

struct GatesState<I> {
    subjects: std::collections::HashMap<String, LogGate<I>>,
    /// The ceiling's drops in the current window, for its summary line.
    ceiling_window: Option<I>,
    ceiling_lines: u64,
    ceiling_subjects: std::collections::HashSet<String>,
}

impl<I> Default for GatesState<I> {
    fn default() -> Self {
        Self {
            subjects: Default::default(),
            ceiling_window: None,
            ceiling_lines: 0,
            ceiling_subjects: Default::default(),
        }
    }
}

struct LogGate<I> {
    window_start: Option<I>,
    used: u32,
    suppressed: u64,
}

impl<I> Default for LogGate<I> {
    fn default() -> Self {
        Self {
            window_start: None,
            used: 0,
            suppressed: 0,
        }
    }
}

/// What the process-wide ceiling dropped in one window: `lines` lines of `subjects`
/// subjects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CeilingSummary {
    lines: u64,
    subjects: usize,
}

impl Default for LogGates {
    fn default() -> Self {
        Self::with_clock(DefaultClock::default())
    }
}

impl LogGates {
    /// Lines per subject per window.
    pub const PER_WINDOW: u32 = 10;
    /// The window.
    pub const WINDOW: Duration = Duration::from_secs(10);
    /// Lines per second for the whole process, whatever their subjects.
    pub const CEILING_PER_SECOND: u32 = 50;
    /// The process-wide ceiling's burst.
    pub const CEILING_BURST: u32 = 200;
}

impl<C: Clock + Clone> LogGates<C> {
    /// Gates timed by `clock` (a fake one in tests).
    fn with_clock(clock: C) -> Self {
        let quota = Quota::per_second(
            NonZeroU32::new(LogGates::CEILING_PER_SECOND).unwrap_or(NonZeroU32::MIN),
        )
        .allow_burst(NonZeroU32::new(LogGates::CEILING_BURST).unwrap_or(NonZeroU32::MIN));
        Self {
            ceiling: RateLimiter::direct_with_clock(quota, clock.clone()),
            clock,
            state: Default::default(),
        }
    }

    /// Whether a line about `subject` may be written now: `Some(n)` with the number of its
    /// lines suppressed since the last one written, or `None` to suppress this one.
    pub fn admit(&self, subject: &str) -> Option<u64> {
        let (admitted, summary) = self.admit_now(subject);
        if let Some(CeilingSummary { lines, subjects }) = summary {
            tracing::warn!(
                lines,
                subjects,
                window_secs = LogGates::WINDOW.as_secs(),
                per_second = LogGates::CEILING_PER_SECOND,
                "log lines suppressed by the process-wide ceiling in the last window; each subject's next line counts its own in suppressed=N, the metrics count every one"
            );
        }
        admitted
    }

    /// [`Self::admit`]'s decision, and the ceiling's summary of the window that ended, if
    /// one did with lines dropped (the caller logs it, outside the lock).
    fn admit_now(&self, subject: &str) -> (Option<u64>, Option<CeilingSummary>) {
        let now = self.clock.now();
        let window_over = |start: Option<C::Instant>| {
            start.is_none_or(|s| Duration::from(now.duration_since(s)) >= LogGates::WINDOW)
        };
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let mut summary = None;
        if window_over(state.ceiling_window) {
            if state.ceiling_lines > 0 {
                summary = Some(CeilingSummary {
                    lines: state.ceiling_lines,
                    subjects: state.ceiling_subjects.len(),
                });
            }
            state.ceiling_window = Some(now);
            state.ceiling_lines = 0;
            state.ceiling_subjects.clear();
        }
        if !state.subjects.contains_key(subject) {
            state
                .subjects
                .insert(subject.to_string(), LogGate::default());
        }
        let GatesState {
            subjects,
            ceiling_lines,
            ceiling_subjects,
            ..
        } = &mut *state;
        let Some(g) = subjects.get_mut(subject) else {
            return (None, summary);
        };
        if window_over(g.window_start) {
            g.window_start = Some(now);
            g.used = 0;
        }
        if g.used >= LogGates::PER_WINDOW {
            g.suppressed += 1;
            return (None, summary);
        }
        if self.ceiling.check().is_err() {
            g.suppressed += 1;
            *ceiling_lines += 1;
            if !ceiling_subjects.contains(subject) {
                ceiling_subjects.insert(subject.to_string());
            }
            return (None, summary);
        }
        g.used += 1;
        (Some(std::mem::take(&mut g.suppressed)), summary)
    }

    /// The lines of `subject` suppressed and not yet reported.
    #[cfg(test)]
    fn pending(&self, subject: &str) -> u64 {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.subjects.get(subject).map_or(0, |g| g.suppressed)
    }
}

/// Sets `family`'s series to `current` (target id → value) and removes those of the targets
/// `shown` had and `current` has not; `shown` becomes `current`'s targets.
fn retain_series<'a>(
    family: &Family<Labels, Gauge>,
    shown: &mut std::collections::BTreeSet<String>,
    current: impl Iterator<Item = (&'a String, i64)>,
) {
    retain_series_by(family, "target", shown, current);
}

/// [`retain_series`] with the series keyed by `label` instead of `target`.
fn retain_series_by<'a>(
    family: &Family<Labels, Gauge>,
    label: &'static str,
    shown: &mut std::collections::BTreeSet<String>,
    current: impl Iterator<Item = (&'a String, i64)>,
) {
    let mut now_shown = std::collections::BTreeSet::new();
    for (key, value) in current {
        family.get_or_create(&vec![(label, key.clone())]).set(value);
        now_shown.insert(key.clone());
    }
    for gone in shown.difference(&now_shown) {
        family.remove(&vec![(label, gone.clone())]);
    }
    *shown = now_shown;
}

/// Every metric the router exports.
pub struct Metrics {
    registry: Registry,
    /// Events by ingest result: accepted, duplicate, quarantined, rejected.
    pub ingest_events: Family<Labels, Counter>,
    /// Accepted events routed to no target, by cause (`no_match`, `rule_disabled`).
    pub ingest_unrouted: Family<Labels, Counter>,
    /// Events each rule matched and routed, by `rule`: see [`Metrics::count_rule_matches`].
    pub rule_matched: Family<Labels, Counter>,
    /// When each rule last matched a routed event (Unix ms), for `GET /v1/rules`.
    rule_last_matched: std::sync::Mutex<std::collections::HashMap<String, i64>>,
    /// Until when (Unix seconds) each running target is held off by its receiver's
    /// `Retry-After`; 0 when it is not.
    pub target_held_off_until: Family<Labels, Gauge>,
    /// Targets whose `router_target_held_off_until_seconds` the last scrape showed.
    held_off_shown: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// Each running target's queue-depth cap (`max_queue_depth`): past it new entries go to
    /// the DLQ as `target_overflow`.
    pub queue_max_depth: Family<Labels, Gauge>,
    /// Targets whose `router_queue_max_depth` the last scrape showed.
    queue_max_depth_shown: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// Ingest HTTP requests by status code.
    pub ingest_requests: Family<Labels, Counter>,
    /// Delivery attempts by target and result (delivered, retried, dead_lettered, fenced).
    pub deliveries: TargetFamily<Counter>,
    /// Attempt latency by target.
    pub attempt_seconds: TargetFamily<Histogram, fn() -> Histogram>,
    /// New DLQ entries by target and reason.
    pub dlq_entries: TargetFamily<Counter>,
    /// Store group-commit latency (includes the fsync).
    pub commit_seconds: Histogram,
    /// Ops per group commit.
    pub commit_ops: Histogram,
    /// Time to match one ingested event against the rules.
    pub rule_match_seconds: Histogram,
    /// Matcher steps (states, entries, index probes, wildcard states per byte) per ingested
    /// event: the work, independent of how loaded the machine is.
    pub rule_match_steps: Histogram,
    /// Compactions of the store file by result (`ok`, `failed`).
    pub compactions: Family<Labels, Counter>,
    /// How long each compaction refused new work.
    pub compaction_seconds: Histogram,
    /// 1 while the store compacts its file (ingest answers 503 meanwhile).
    pub compacting: Gauge,
    /// Memory held by the dedup index's Bloom filters (runs inside the dedup window).
    pub dedup_filter_bytes: Gauge,
    /// Waiting entries per target.
    pub queue_depth: Family<Labels, Gauge>,
    /// Leased entries per target.
    pub queue_in_flight: Family<Labels, Gauge>,
    /// Age of the oldest live entry per target.
    pub queue_oldest_age_seconds: Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// DLQ entries per target.
    pub dlq_depth: Family<Labels, Gauge>,
    /// Rule/contract reloads by result.
    pub reloads: Family<Labels, Counter>,
    /// Store file size (on JetStream: the stream's size on the server). Absent while the
    /// store cannot say (a shared store out of reach): unknown is not 0.
    pub store_bytes: Family<Labels, Gauge>,
    /// `store.max_disk_bytes` (0: no mark), beside `store_bytes` for a "near the mark" alert.
    pub store_max_bytes: Gauge,
    /// 1 while ingest is refused past the disk high-water mark.
    pub ingest_refused: Gauge,
    /// Ingest requests answered 503 because ingest stayed full, by `bound` (`bytes`:
    /// `ingest.max_in_flight_bytes`, `events`: `ingest.max_in_flight_events`).
    pub ingest_saturated: Family<Labels, Counter>,
    /// Request bytes ingest holds now (bodies read, checked or waiting for their commit).
    pub ingest_in_flight_bytes: Gauge,
    /// `ingest.max_in_flight_bytes`.
    pub ingest_max_in_flight_bytes: Gauge,
    /// Events ingest holds now (parsed, checked or waiting for their commit).
    pub ingest_in_flight_events: Gauge,
    /// `ingest.max_in_flight_events`.
    pub ingest_max_in_flight_events: Gauge,
    /// Open client connections.
    pub http_connections: Gauge,
    /// `server.max_connections` as applied.
    pub http_max_connections: Gauge,
    /// Connections answered 503 and closed past `server.max_connections`.
    pub http_connections_refused: Counter,
    /// Open connections on `server.ops_listen`.
    pub http_ops_connections: Gauge,
    /// Connections answered 503 and closed past `server.ops_max_connections`.
    pub http_ops_connections_refused: Counter,
    /// Delivery attempts in flight across all webhook and NATS targets.
    pub delivery_in_flight: Gauge,
    /// `delivery.max_in_flight` as applied.
    pub delivery_max_in_flight: Gauge,
    /// Times a worker with due entries found no free global permit and waited for one.
    pub delivery_permit_waits: Counter,
    /// Bytes of events held by leased entries across all targets.
    pub delivery_in_flight_bytes: Gauge,
    /// `delivery.max_in_flight_bytes` as applied.
    pub delivery_max_in_flight_bytes: Gauge,
    /// Times a target's worker waited for bytes because it held its fair share of a
    /// contended byte pool.
    pub delivery_byte_share_waits: TargetFamily<Counter>,
    /// Attempts put back unsent because the router itself ran out of a resource (open files,
    /// memory), by cause.
    pub delivery_local_exhaustion: Family<Labels, Counter>,
    /// 1 while the store takes writes (0: reopening after a write error).
    pub store_up: Gauge,
    /// 1 when the last reload (file change, SIGHUP, API) was refused: the live rules are
    /// older than the files.
    pub reload_failing: Gauge,
    /// Breaker transitions by target and new state.
    pub breaker_transitions: TargetFamily<Counter>,
    /// Breaker state per target: 0 closed, 1 open, 2 half-open.
    pub breaker_state: Family<Labels, Gauge>,
    /// Due retries deferred by the retry budget.
    pub budget_deferred: TargetFamily<Counter>,
    /// Times a target's worker waited for its rate limit.
    pub throttled: TargetFamily<Counter>,
    /// Leases that failed (the store refused the write) by target; the worker pauses a second.
    pub lease_failures: TargetFamily<Counter>,
    /// Leased entries whose event's stored record could not be read, set aside in the DLQ as
    /// `corrupt_record`, by target.
    pub corrupt_records: TargetFamily<Counter>,
    /// Entries leased at acceptance and sent at once (`delivery.handoff`), by target.
    pub handoffs: TargetFamily<Counter>,
    /// Requests made to a batching webhook, by target.
    pub delivery_batches: TargetFamily<Counter>,
    /// Events those requests carried, by target (over `delivery_batches`: the mean batch).
    pub delivery_batch_events: TargetFamily<Counter>,
    /// System events dropped (the routing channel full, past the rate limit, or refused by
    /// the store for several seconds), by `type` (one of
    /// [`crate::system_events::Kind`]'s, a fixed set) and the `target` they were about
    /// (`none`: about no target).
    pub system_events_dropped: TargetFamily<Counter>,
    /// Redrive and replay job steps the store failed (the job waits and tries again), by kind.
    pub job_step_failures: Family<Labels, Counter>,
    /// Items redrive and replay jobs went through, by kind and outcome (`moved`, `failed`,
    /// `skipped`, `expired`): a job's progress as a rate.
    pub job_items: Family<Labels, Counter>,
    /// Jobs still to finish, by kind and state (`running`, `paused`), as the store holds them
    /// at the scrape: a job nobody watches is still seen.
    pub jobs: Family<Labels, Gauge>,
    /// Paused targets (1 = paused).
    pub target_paused: Family<Labels, Gauge>,
    /// Records removed by the sweeper at their age bound, by kind (`dedup_key`, `event`,
    /// `completed`, `kv`): the bounds of dedup keys, archive, idempotency records and KV.
    pub swept: Family<Labels, Counter>,
    /// Handler deliveries answered from the COMPLETED table (the handler was not run again).
    pub completed_hits: Family<Labels, Counter>,
    /// Handler invocations by handler and outcome.
    pub handler_invocations: Family<Labels, Counter>,
    /// Handler log lines the per-invocation cap (`handlers.max_log_bytes`) dropped, by handler.
    pub handler_log_lines_dropped: Family<Labels, Counter>,
    /// Bytes (keys plus values) in each handler's key-value namespace.
    pub handler_kv_bytes: Family<Labels, Gauge>,
    /// Keys in each handler's key-value namespace.
    pub handler_kv_keys: Family<Labels, Gauge>,
    /// Handlers whose KV gauges the last scrape set (so an emptied namespace can be removed
    /// without clearing the families under a concurrent scrape).
    kv_handlers_shown: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// Targets whose queue gauges the last scrape showed.
    queue_targets_shown: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// Targets whose `router_target_paused` and `router_breaker_state` the last scrape showed.
    worker_gauges_shown: std::sync::Mutex<(
        std::collections::BTreeSet<String>,
        std::collections::BTreeSet<String>,
    )>,
    /// The bound on each namespace (`handlers.kv_max_bytes`).
    pub handler_kv_max_bytes: Gauge,
    /// 1 when a handler's active version runs here, 0 while it is compiled after a start,
    /// when it failed to load, or when a live rule routes to it and it has no version (its
    /// deliveries wait), by handler.
    pub handler_loaded: Family<Labels, Gauge>,
    /// Handlers whose `router_handler_loaded` the last scrape showed.
    handler_loaded_shown: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// Reads of the shared handler catalog (result ok, error) and the handler changes they
    /// brought (installed, removed, published), on stores several nodes share.
    pub handler_catalog: Family<Labels, Counter>,
    /// Records held per bounded kind (events, dedup keys, COMPLETED records, handler KV keys).
    pub store_records: Family<Labels, Gauge>,
    /// 1 while the shared NATS connection is up, by `url` (no series until a `nats:` target
    /// starts the client).
    pub nats_connected: Family<Labels, Gauge>,
}

impl Metrics {
    /// Builds and registers every metric.
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::default();
        let m = Self {
            ingest_events: Family::default(),
            ingest_unrouted: Family::default(),
            rule_matched: Family::default(),
            rule_last_matched: Default::default(),
            target_held_off_until: Family::default(),
            held_off_shown: Default::default(),
            queue_max_depth: Family::default(),
            queue_max_depth_shown: Default::default(),
            ingest_requests: Family::default(),
            deliveries: TargetFamily::default(),
            attempt_seconds: TargetFamily::new(Family::new_with_constructor(latency_histogram)),
            dlq_entries: TargetFamily::default(),
            commit_seconds: latency_histogram(),
            commit_ops: Histogram::new(exponential_buckets(1.0, 2.0, 13)),
            // 1 µs to ~17 s: an ordinary event matches in microseconds; the tail is what an
            // operator looks for.
            rule_match_seconds: Histogram::new(exponential_buckets(0.000_001, 4.0, 13)),
            // 16 to ~1e9 steps.
            rule_match_steps: Histogram::new(exponential_buckets(16.0, 4.0, 14)),
            compactions: Family::default(),
            // 10 ms to ~80 s: small files compact in milliseconds, gigabytes in tens of seconds.
            compaction_seconds: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
            compacting: Gauge::default(),
            dedup_filter_bytes: Gauge::default(),
            queue_depth: Family::default(),
            queue_in_flight: Family::default(),
            queue_oldest_age_seconds: Family::default(),
            dlq_depth: Family::default(),
            reloads: Family::default(),
            store_bytes: Family::default(),
            store_max_bytes: Gauge::default(),
            ingest_refused: Gauge::default(),
            ingest_saturated: Family::default(),
            ingest_in_flight_bytes: Gauge::default(),
            ingest_max_in_flight_bytes: Gauge::default(),
            ingest_in_flight_events: Gauge::default(),
            ingest_max_in_flight_events: Gauge::default(),
            http_connections: Gauge::default(),
            http_max_connections: Gauge::default(),
            http_connections_refused: Counter::default(),
            http_ops_connections: Gauge::default(),
            http_ops_connections_refused: Counter::default(),
            delivery_in_flight: Gauge::default(),
            delivery_max_in_flight: Gauge::default(),
            delivery_in_flight_bytes: Gauge::default(),
            delivery_max_in_flight_bytes: Gauge::default(),
            delivery_permit_waits: Counter::default(),
            delivery_byte_share_waits: TargetFamily::default(),
            delivery_local_exhaustion: Family::default(),
            store_up: Gauge::default(),
            reload_failing: Gauge::default(),
            breaker_transitions: TargetFamily::default(),
            breaker_state: Family::default(),
            budget_deferred: TargetFamily::default(),
            throttled: TargetFamily::default(),
            lease_failures: TargetFamily::default(),
            corrupt_records: TargetFamily::default(),
            handoffs: TargetFamily::default(),
            delivery_batches: TargetFamily::default(),
            delivery_batch_events: TargetFamily::default(),
            system_events_dropped: TargetFamily::default(),
            job_step_failures: Family::default(),
            job_items: Family::default(),
            jobs: Family::default(),
            target_paused: Family::default(),
            swept: Family::default(),
            completed_hits: Family::default(),
            handler_invocations: Family::default(),
            handler_log_lines_dropped: Family::default(),
            handler_kv_bytes: Family::default(),
            handler_kv_keys: Family::default(),
            kv_handlers_shown: Default::default(),
            queue_targets_shown: Default::default(),
            worker_gauges_shown: Default::default(),
            handler_kv_max_bytes: Gauge::default(),
            handler_loaded: Family::default(),
            handler_loaded_shown: Default::default(),
            handler_catalog: Family::default(),
            store_records: Family::default(),
            nats_connected: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "router_ingest_events",
            "Events received, by result: accepted, quarantined, duplicate, throttled (429), rejected (every event of a request refused whole, since none is stored: each element of a refused batch, each event of an enforce 422 whether it failed its contract or not; a body that cannot be read as events counts 1)",
            m.ingest_events.clone(),
        );
        registry.register(
            "router_ingest_unrouted",
            "Events accepted and routed to no target, by cause: no_match (no rule of the live set matched) or rule_disabled (only rules an operator disabled matched); only the archive keeps them, and a replay routes them again",
            m.ingest_unrouted.clone(),
        );
        registry.register(
            "router_rule_matched_events",
            "Events the rule matched and routed to its targets: accepted at ingest (a duplicate does not count), emitted by a handler, or a router system event; replays and redrives do not count again. Counted since the router started; a rule removed by a reload loses its series",
            m.rule_matched.clone(),
        );
        registry.register(
            "router_target_held_off_until_seconds",
            "Until when (Unix time) the target's receiver asked to be left alone with Retry-After on a 429 or 503 (nothing is sent before it; an operator's resume lifts it); 0 when it did not",
            m.target_held_off_until.clone(),
        );
        registry.register(
            "router_ingest_requests",
            "Ingest requests, by HTTP status",
            m.ingest_requests.clone(),
        );
        registry.register(
            "router_deliveries",
            "Delivery outcomes by target and result: delivered, retried, dead_lettered, deferred (put back without an attempt), fenced, conflict",
            m.deliveries.family(),
        );
        registry.register(
            "router_attempt_seconds",
            "Delivery attempt latency, by target",
            m.attempt_seconds.family(),
        );
        registry.register(
            "router_dlq_entries",
            "New DLQ entries, by target and reason",
            m.dlq_entries.family(),
        );
        registry.register(
            "router_store_commit_seconds",
            "Group commit latency including fsync",
            m.commit_seconds.clone(),
        );
        registry.register(
            "router_store_compactions",
            "Compactions of the store file, by result",
            m.compactions.clone(),
        );
        registry.register(
            "router_store_compaction_seconds",
            "Duration of each store compaction (new work is refused meanwhile)",
            m.compaction_seconds.clone(),
        );
        registry.register(
            "router_store_compacting",
            "1 while the store compacts its file",
            m.compacting.clone(),
        );
        registry.register(
            "router_store_dedup_filter_bytes",
            "Memory held by the Bloom filters of the dedup index's runs inside the dedup window (older runs keep none)",
            m.dedup_filter_bytes.clone(),
        );
        registry.register(
            "router_store_commit_ops",
            "Operations per group commit",
            m.commit_ops.clone(),
        );
        registry.register(
            "router_rule_match_seconds",
            "Time to match one ingested event against the live rules",
            m.rule_match_seconds.clone(),
        );
        registry.register(
            "router_rule_match_steps",
            "Matcher steps per ingested event (states, entries, index probes, wildcard states per byte)",
            m.rule_match_steps.clone(),
        );
        registry.register(
            "router_queue_depth",
            "Entries waiting, by target",
            m.queue_depth.clone(),
        );
        registry.register(
            "router_queue_max_depth",
            "The queue-depth cap of each running target (its policy's max_queue_depth): at it, new entries for the target go to the DLQ as target_overflow; alert on router_queue_depth + router_queue_in_flight nearing it",
            m.queue_max_depth.clone(),
        );
        registry.register(
            "router_queue_in_flight",
            "Entries leased by a worker, by target",
            m.queue_in_flight.clone(),
        );
        registry.register(
            "router_queue_oldest_age_seconds",
            "Age of the oldest live entry, by target",
            m.queue_oldest_age_seconds.clone(),
        );
        registry.register(
            "router_dlq_depth",
            "DLQ entries, by target (target=\"none\": events quarantined at ingest)",
            m.dlq_depth.clone(),
        );
        registry.register(
            "router_reloads",
            "Rule and contract reloads, by result",
            m.reloads.clone(),
        );
        registry.register(
            "router_store_bytes",
            "Size of the store file (JetStream: the stream on the server); absent while unknown",
            m.store_bytes.clone(),
        );
        registry.register(
            "router_store_max_bytes",
            "The disk high-water mark (store.max_disk_bytes; 0: none)",
            m.store_max_bytes.clone(),
        );
        registry.register(
            "router_ingest_refused",
            "1 while ingest answers 503 past the disk high-water mark",
            m.ingest_refused.clone(),
        );
        registry.register(
            "router_ingest_saturated",
            "Ingest requests answered 503 because what ingest holds stayed at a bound for ingest.admission_wait (the router is saturated: producers back off), by bound: bytes (ingest.max_in_flight_bytes) or events (ingest.max_in_flight_events)",
            m.ingest_saturated.clone(),
        );
        registry.register(
            "router_ingest_in_flight_bytes",
            "Request bytes ingest holds now: bodies being read, checked or waiting for their commit",
            m.ingest_in_flight_bytes.clone(),
        );
        registry.register(
            "router_ingest_max_in_flight_bytes",
            "ingest.max_in_flight_bytes: past it requests wait, then get 503",
            m.ingest_max_in_flight_bytes.clone(),
        );
        registry.register(
            "router_ingest_in_flight_events",
            "Events ingest holds now: parsed, checked or waiting for their commit",
            m.ingest_in_flight_events.clone(),
        );
        registry.register(
            "router_ingest_max_in_flight_events",
            "ingest.max_in_flight_events: past it requests wait, then get 503",
            m.ingest_max_in_flight_events.clone(),
        );
        registry.register(
            "router_http_connections",
            "Open client connections",
            m.http_connections.clone(),
        );
        registry.register(
            "router_http_max_connections",
            "server.max_connections as applied (0 in the file: half the open-file limit)",
            m.http_max_connections.clone(),
        );
        registry.register(
            "router_http_connections_refused",
            "Connections answered 503 and closed because server.max_connections were open",
            m.http_connections_refused.clone(),
        );
        registry.register(
            "router_http_ops_connections",
            "Open connections on server.ops_listen (the /healthz, /readyz and /metrics address; 0 when it is not set)",
            m.http_ops_connections.clone(),
        );
        registry.register(
            "router_http_ops_connections_refused",
            "Connections answered 503 and closed because server.ops_max_connections were open on server.ops_listen",
            m.http_ops_connections_refused.clone(),
        );
        registry.register(
            "router_delivery_in_flight",
            "Delivery attempts in flight across all webhook and NATS targets (bounded by delivery.max_in_flight)",
            m.delivery_in_flight.clone(),
        );
        registry.register(
            "router_delivery_max_in_flight",
            "delivery.max_in_flight as applied (unset: a quarter of the open-file limit, 64 to 4096)",
            m.delivery_max_in_flight.clone(),
        );
        registry.register(
            "router_delivery_in_flight_bytes",
            "Bytes of events held by leased deliveries across all targets, counted from the lease until the attempt's result is recorded (bounded by delivery.max_in_flight_bytes)",
            m.delivery_in_flight_bytes.clone(),
        );
        registry.register(
            "router_delivery_max_in_flight_bytes",
            "delivery.max_in_flight_bytes as applied",
            m.delivery_max_in_flight_bytes.clone(),
        );
        registry.register(
            "router_delivery_byte_share_waits",
            "Times a target's worker waited for delivery.max_in_flight_bytes room because the target held its fair share of the contended pool (the pool split among the targets holding or waiting for bytes); no attempt is spent waiting",
            m.delivery_byte_share_waits.family(),
        );
        registry.register(
            "router_delivery_permit_waits",
            "Times a target's worker with due entries waited for a free delivery.max_in_flight permit (no attempt is spent waiting)",
            m.delivery_permit_waits.clone(),
        );
        registry.register(
            "router_delivery_local_exhaustion",
            "Attempts put back unsent, no attempt spent, because the router itself ran out of a resource (cause: open_files, system_files, memory)",
            m.delivery_local_exhaustion.clone(),
        );
        registry.register(
            "router_store_up",
            "1 while the store takes writes; 0 while it is reopened after a write error (a full or failing disk: ingest and API writes answer 503)",
            m.store_up.clone(),
        );
        registry.register(
            "router_reload_failing",
            "1 when the last reload was refused (the live rules are older than the files)",
            m.reload_failing.clone(),
        );
        registry.register(
            "router_breaker_transitions",
            "Circuit breaker transitions, by target and new state",
            m.breaker_transitions.family(),
        );
        registry.register(
            "router_breaker_state",
            "Breaker state: 0 closed, 1 open, 2 half-open",
            m.breaker_state.clone(),
        );
        registry.register(
            "router_retry_budget_deferred",
            "Due retries deferred by the retry budget",
            m.budget_deferred.family(),
        );
        registry.register(
            "router_throttled",
            "Times a target's worker waited for its rate limit (throttle.rate_per_sec)",
            m.throttled.family(),
        );
        registry.register(
            "router_lease_failures",
            "Leases the store failed to record, by target (the worker pauses 1 s after each)",
            m.lease_failures.family(),
        );
        registry.register(
            "router_store_corrupt_records",
            "Leased entries whose event's stored record could not be read, set aside in the DLQ as corrupt_record, by target",
            m.corrupt_records.family(),
        );
        registry.register(
            "router_delivery_handoffs",
            "Entries leased in their accept's commit and sent at once, without a lease of their own (delivery.handoff), by target",
            m.handoffs.family(),
        );
        registry.register(
            "router_delivery_batches",
            "Requests made to a batching webhook (each carrying a CloudEvents batch), by target",
            m.delivery_batches.family(),
        );
        registry.register(
            "router_delivery_batch_events",
            "Events carried by the requests of router_delivery_batches, by target",
            m.delivery_batch_events.family(),
        );
        registry.register(
            "router_swept_records",
            "Records removed at their age bound by the sweeper, by kind (dedup_key, event, completed, kv)",
            m.swept.clone(),
        );
        registry.register(
            "router_handler_completed_hits",
            "Handler deliveries answered from a stored COMPLETED result without running the handler",
            m.completed_hits.clone(),
        );
        registry.register(
            "router_handler_invocations",
            "Handler invocations by handler and outcome: ok (emitted), retry, fail (the handler's own answers), trap, timeout, oom, limit (an output, key-value write or fuel bound of the invocation: not retried), host_unavailable (a key-value read failed or the namespace is full: retried), invalid_emission",
            m.handler_invocations.clone(),
        );
        registry.register(
            "router_handler_log_lines_dropped",
            "Handler log lines dropped because an invocation logged past handlers.max_log_bytes (its last kept line says how many), by handler",
            m.handler_log_lines_dropped.clone(),
        );
        registry.register(
            "router_handler_kv_bytes",
            "Bytes a handler's key-value namespace counts against handlers.kv_max_bytes: keys plus values plus 64 per key",
            m.handler_kv_bytes.clone(),
        );
        registry.register(
            "router_handler_kv_keys",
            "Keys in a handler's key-value namespace",
            m.handler_kv_keys.clone(),
        );
        registry.register(
            "router_handler_catalog_syncs",
            "Reads of the shared handler catalog by result (ok, error) and the changes they applied here (installed, removed, published)",
            m.handler_catalog.clone(),
        );
        registry.register(
            "router_handler_loaded",
            "1 when the handler's active version runs on this node; 0 while it is being compiled after a start, when it failed to load (GET /v1/handlers/{name} says why), or when a live rule routes to it and it is not uploaded or was deleted: its deliveries wait, up to their max_age",
            m.handler_loaded.clone(),
        );
        registry.register(
            "router_handler_kv_max_bytes",
            "Bound on each handler's key-value namespace (handlers.kv_max_bytes)",
            m.handler_kv_max_bytes.clone(),
        );
        registry.register(
            "router_store_records",
            "Records held, by kind (event, dedup_key, dedup_run, completed, kv): what the age and size bounds act on",
            m.store_records.clone(),
        );
        registry.register(
            "router_system_events_dropped",
            "System events dropped, by type and the target they were about: the routing channel full, past the rate limit, or refused by the store for several seconds (dropped router.dlq.added are announced later by one summary per target)",
            m.system_events_dropped.family(),
        );
        registry.register(
            "router_job_step_failures",
            "Redrive and replay job steps the store failed, by kind (the job waits, shows the error as last_error and tries again)",
            m.job_step_failures.clone(),
        );
        registry.register(
            "router_job_items",
            "Items redrive and replay jobs went through, by kind and outcome: moved (requeued, routed or replayed), failed (kept in the DLQ with a reason, or a replayed event one of whose copies its queue's cap refused), skipped, expired (a replay's events the archive sweep removed before the job reached them)",
            m.job_items.clone(),
        );
        registry.register(
            "router_jobs",
            "Redrive and replay jobs still to finish, by kind and state (running, paused), as the store holds them (on a shared store every node reports them all)",
            m.jobs.clone(),
        );
        registry.register(
            "router_nats_connected",
            "1 while the NATS connection nats: targets share is up, 0 while it is down, by url (no series until a nats: target starts it)",
            m.nats_connected.clone(),
        );
        registry.register(
            "router_target_paused",
            "1 while an operator has paused the target",
            m.target_paused.clone(),
        );
        Arc::new(Self { registry, ..m })
    }

    /// The refusal counters of ingest admission, one per bound (both series exist from the
    /// start, at 0).
    pub fn ingest_refusals(&self) -> crate::ingest::admission::Refusals {
        use crate::ingest::admission::Bound;
        let of = |b: Bound| {
            self.ingest_saturated
                .get_or_create(&vec![("bound", b.as_str().to_string())])
                .clone()
        };
        crate::ingest::admission::Refusals {
            bytes: of(Bound::Bytes),
            events: of(Bound::Events),
        }
    }

    /// Records one group commit.
    pub fn observe_commit(&self, took: Duration, ops: usize) {
        self.commit_seconds.observe(took.as_secs_f64());
        self.commit_ops.observe(ops as f64);
    }

    /// Records the matching of one ingested event.
    pub fn observe_rule_match(&self, took: Duration, steps: u64) {
        self.rule_match_seconds.observe(took.as_secs_f64());
        self.rule_match_steps.observe(steps as f64);
    }

    /// Counts one routed event for each rule in `rules` (names may repeat: one per event),
    /// at `now` (Unix ms): `router_rule_matched_events_total` and the rule's last match.
    /// Called once per request or commit with all its events' rules, so the shared map is
    /// locked once, not per event.
    pub fn count_rule_matches<'a>(&self, rules: impl IntoIterator<Item = &'a str>, now: i64) {
        // A request's events mostly match the same few rules: a short list beats a map.
        let mut counts: Vec<(&str, u64)> = Vec::new();
        for rule in rules {
            match counts.iter_mut().find(|(r, _)| *r == rule) {
                Some((_, n)) => *n += 1,
                None => counts.push((rule, 1)),
            }
        }
        if counts.is_empty() {
            return;
        }
        for (rule, n) in &counts {
            self.rule_matched
                .get_or_create(&vec![("rule", (*rule).to_string())])
                .inc_by(*n);
        }
        let mut last = self
            .rule_last_matched
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for (rule, _) in counts {
            match last.get_mut(rule) {
                Some(at) => *at = (*at).max(now),
                None => {
                    last.insert(rule.to_string(), now);
                }
            }
        }
    }

    /// Events `rule` matched and routed since the router started, and when it last did
    /// (Unix ms).
    pub fn rule_matches(&self, rule: &str) -> (u64, Option<i64>) {
        let count = self
            .rule_matched
            .get(&vec![("rule", rule.to_string())])
            .map_or(0, |c| c.get());
        let last = self
            .rule_last_matched
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(rule)
            .copied();
        (count, last)
    }

    /// Drops the match counts of rules for which `live` is false (removed by a reload), so
    /// `/metrics` does not keep a series per rule that ever existed.
    pub fn forget_rules(&self, live: impl Fn(&str) -> bool) {
        let mut last = self
            .rule_last_matched
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        last.retain(|rule, _| {
            let keep = live(rule);
            if !keep {
                self.rule_matched.remove(&vec![("rule", rule.clone())]);
            }
            keep
        });
    }

    /// Records one compaction of the store file.
    pub fn observe_compaction(&self, report: &crate::store::CompactionReport) {
        let result = if report.error.is_none() {
            "ok"
        } else {
            "failed"
        };
        self.compactions
            .get_or_create(&vec![("result", result.to_string())])
            .inc();
        self.compaction_seconds
            .observe(report.took_ms as f64 / 1000.0);
    }

    /// Sets the per-target gauges read from the running workers: `paused` (every target with
    /// a worker: those of the live rules and removed ones still draining) and `breakers` (the
    /// state gauge of those with a breaker). The series of a target no longer in the list — a
    /// reload removed it, or its breaker — are removed: left at their last value, an alert on
    /// `router_breaker_state == 1` never cleared. (Removed one by one rather than by clearing
    /// the families first, which would show a concurrent scrape an empty family.)
    pub fn set_worker_gauges(&self, paused: &[(String, bool)], breakers: &[(String, i64)]) {
        let mut shown = self
            .worker_gauges_shown
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let (paused_shown, breakers_shown) = &mut *shown;
        retain_series(
            &self.target_paused,
            paused_shown,
            paused.iter().map(|(t, p)| (t, i64::from(*p))),
        );
        retain_series(
            &self.breaker_state,
            breakers_shown,
            breakers.iter().map(|(t, g)| (t, *g)),
        );
    }

    /// Sets `router_target_held_off_until_seconds` to `held` (target, Unix seconds or 0),
    /// removing the series of targets no longer running.
    pub fn set_held_off(&self, held: &[(String, i64)]) {
        let mut shown = self
            .held_off_shown
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        retain_series(
            &self.target_held_off_until,
            &mut shown,
            held.iter().map(|(t, s)| (t, *s)),
        );
    }

    /// Sets `router_queue_max_depth` to `caps` (target, max_queue_depth) of the running
    /// targets, removing the series of targets no longer running (removed and drained).
    pub fn set_queue_max_depth(&self, caps: &[(String, u64)]) {
        let mut shown = self
            .queue_max_depth_shown
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        retain_series(
            &self.queue_max_depth,
            &mut shown,
            caps.iter()
                .map(|(t, c)| (t, i64::try_from(*c).unwrap_or(i64::MAX))),
        );
    }

    /// Sets `router_handler_loaded` to `handlers` (name, loaded), removing the series of
    /// handlers no longer listed (deleted).
    pub fn set_handler_loaded(&self, handlers: &[(String, bool)]) {
        let mut shown = self
            .handler_loaded_shown
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        retain_series_by(
            &self.handler_loaded,
            "handler",
            &mut shown,
            handlers.iter().map(|(h, l)| (h, i64::from(*l))),
        );
    }

    /// Removes the counters and histograms of `target`, a target removed from the rules
    /// whose worker stopped once its queue drained (its gauges go with its queue's
    /// listing). Counted again from zero if a reload brings the id back.
    pub fn forget_target(&self, target: &str) {
        self.deliveries.forget(target);
        self.attempt_seconds.forget(target);
        self.dlq_entries.forget(target);
        self.breaker_transitions.forget(target);
        self.budget_deferred.forget(target);
        self.throttled.forget(target);
        self.delivery_byte_share_waits.forget(target);
        self.lease_failures.forget(target);
        self.corrupt_records.forget(target);
        self.handoffs.forget(target);
        self.delivery_batches.forget(target);
        self.delivery_batch_events.forget(target);
        self.system_events_dropped.forget(target);
    }

    /// Removes a target's queue series (depth, in flight, oldest age).
    fn remove_queue_series(&self, target: &str) {
        let l = vec![("target", target.to_string())];
        self.queue_depth.remove(&l);
        self.queue_in_flight.remove(&l);
        self.queue_oldest_age_seconds.remove(&l);
    }

    /// Refreshes gauges from the store and renders the text exposition.
    pub async fn render(&self, store: &dyn Store, now_ms: i64) -> String {
        self.render_without(store, now_ms, &|_| false).await
    }

    /// [`Self::render`], leaving out the queue series of the targets `forgotten` names (a
    /// target removed from the rules whose queue drained: the store goes on listing it).
    /// Their `router_dlq_depth` stays while they have dead letters: an alert on the DLQ must
    /// see them.
    pub async fn render_without(
        &self,
        store: &dyn Store,
        now_ms: i64,
        forgotten: &(dyn Fn(&str) -> bool + Sync),
    ) -> String {
        let mut stats = store.queue_stats();
        stats.retain(|t, s| s.dlq > 0 || !forgotten(t));
        {
            // A target whose queue the store no longer lists (removed, and drained) loses its
            // series instead of keeping its last depth.
            let mut shown = self
                .queue_targets_shown
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            for gone in shown.iter() {
                let Some(s) = stats.get(gone) else {
                    self.dlq_depth.remove(&vec![("target", gone.clone())]);
                    self.remove_queue_series(gone);
                    continue;
                };
                if s.live() == 0 && forgotten(gone) {
                    self.remove_queue_series(gone);
                }
            }
            *shown = stats.keys().cloned().collect();
        }
        for (target, s) in stats {
            let live = s.live() > 0 || !forgotten(&target);
            let l = vec![("target", target)];
            if live {
                self.queue_depth
                    .get_or_create(&l)
                    .set(i64::try_from(s.queued).unwrap_or(i64::MAX));
                self.queue_in_flight
                    .get_or_create(&l)
                    .set(i64::try_from(s.in_flight).unwrap_or(i64::MAX));
                let age = s
                    .oldest_accepted_at
                    .map_or(0.0, |a| (now_ms - a).max(0) as f64 / 1000.0);
                self.queue_oldest_age_seconds.get_or_create(&l).set(age);
            }
            self.dlq_depth
                .get_or_create(&l)
                .set(i64::try_from(s.dlq).unwrap_or(i64::MAX));
        }
        // Quarantined events have no target: `target="none"`, so that an alert on the DLQ's
        // depth sees poison too.
        self.dlq_depth
            .get_or_create(&vec![("target", "none".to_string())])
            .set(i64::try_from(store.dlq_without_target()).unwrap_or(i64::MAX));
        self.compacting.set(i64::from(store.compacting()));
        // The store's reads at once, and within one bound: a store that does not answer (a
        // shared store's server down) must not make the scrape outlast Prometheus' timeout
        // (10 s by default), which loses every metric just when they matter.
        let deadline = tokio::time::Instant::now() + STORE_READS_BOUND;
        let (bytes, counts, usage, jobs) = tokio::join!(
            tokio::time::timeout_at(deadline, store.disk_bytes()),
            tokio::time::timeout_at(deadline, store.record_counts()),
            tokio::time::timeout_at(deadline, store.kv_usage()),
            tokio::time::timeout_at(deadline, store.jobs()),
        );
        match bytes.ok().flatten() {
            Some(b) => {
                self.store_bytes
                    .get_or_create(&Labels::new())
                    .set(i64::try_from(b).unwrap_or(i64::MAX));
            }
            None => {
                self.store_bytes.remove(&Labels::new());
            }
        }
        let timed_out = || {
            crate::store::StoreError::Unavailable(format!("no answer within {STORE_READS_BOUND:?}"))
        };
        match counts.unwrap_or_else(|_| Err(timed_out())) {
            Ok(c) => {
                self.dedup_filter_bytes
                    .set(i64::try_from(c.dedup_filter_bytes).unwrap_or(i64::MAX));
                for (kind, n) in [
                    ("event", c.events),
                    ("event_above_floor", c.events_above_floor),
                    ("dedup_key", c.dedup_keys),
                    ("dedup_run", c.dedup_runs),
                    ("dedup_run_cold", c.dedup_cold_runs),
                    ("completed", c.completed),
                    ("kv", c.kv_keys),
                ] {
                    self.store_records
                        .get_or_create(&vec![("kind", kind.to_string())])
                        .set(i64::try_from(n).unwrap_or(i64::MAX));
                }
            }
            // During a compaction the gauges keep their last values: planned, not a failure.
            Err(crate::store::StoreError::Compacting) => {}
            Err(e) => tracing::warn!(error = %e, "could not read record counts for /metrics"),
        }
        match jobs.unwrap_or_else(|_| Err(timed_out())) {
            Ok(jobs) => {
                use crate::store::{JobKind, JobState};
                // Every series, zeros too: an alert on a paused job needs one to compare.
                for kind in [JobKind::Redrive, JobKind::Replay] {
                    for state in [JobState::Running, JobState::Paused] {
                        let n = jobs
                            .iter()
                            .filter(|j| j.kind == kind && j.state == state)
                            .count();
                        self.jobs
                            .get_or_create(&vec![
                                ("kind", kind.as_str().to_string()),
                                ("state", state.as_str().to_string()),
                            ])
                            .set(i64::try_from(n).unwrap_or(i64::MAX));
                    }
                }
            }
            // As for the record counts: the gauges keep their last values.
            Err(crate::store::StoreError::Compacting) => {}
            Err(e) => tracing::warn!(error = %e, "could not read the jobs for /metrics"),
        }
        match usage.unwrap_or_else(|_| Err(timed_out())) {
            Ok(usage) => {
                // A namespace emptied since the last scrape disappears instead of keeping its
                // last size. Only those are removed (clearing the families first would show a
                // concurrent scrape an empty family).
                let mut shown = self
                    .kv_handlers_shown
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                for gone in shown.iter().filter(|h| !usage.contains_key(*h)) {
                    let l = vec![("handler", gone.clone())];
                    self.handler_kv_bytes.remove(&l);
                    self.handler_kv_keys.remove(&l);
                }
                shown.clear();
                for (handler, u) in usage {
                    shown.insert(handler.clone());
                    let l = vec![("handler", handler)];
                    self.handler_kv_bytes
                        .get_or_create(&l)
                        .set(i64::try_from(u.bytes).unwrap_or(i64::MAX));
                    self.handler_kv_keys
                        .get_or_create(&l)
                        .set(i64::try_from(u.keys).unwrap_or(i64::MAX));
                }
            }
            Err(crate::store::StoreError::Compacting) => {}
            Err(e) => {
                tracing::warn!(error = %e, "could not read handler key-value sizes for /metrics")
            }
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// How long `/metrics` and `/v1/status` wait for the store's reads, all of them together.
pub const STORE_READS_BOUND: std::time::Duration = std::time::Duration::from_secs(2);

/// Installs the global tracing subscriber (`RUST_LOG` filters, default `info`).
pub fn init_tracing(json: bool) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none();
    // A log line that cannot be written (the reader of a piped stderr gone: a log shipper
    // restarted, a `| tee` killed) is dropped. By default the subscriber reported the write
    // error with `eprintln!`, which panics on that same broken pipe and killed whichever task
    // was logging: the signal handler among them, after which SIGTERM no longer stopped the
    // router (audited).
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .log_internal_errors(false)
        .with_writer(std::io::stderr);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

/// What a test's tracing subscriber writes, as the router's log would show it (INFO and up,
/// no colours), for tests that count or read log lines.
#[cfg(test)]
pub(crate) mod test_log {
    use std::sync::{Arc, Mutex};

    /// The captured lines.
    #[derive(Clone, Default)]
    pub(crate) struct LogBuf(Arc<Mutex<Vec<u8>>>);

    impl LogBuf {
        /// Everything written so far.
        pub(crate) fn text(&self) -> String {
            String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
        }
    }

    impl std::io::Write for LogBuf {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Captures this thread's log from now until the guard drops.
    pub(crate) fn capture() -> (LogBuf, tracing::subscriber::DefaultGuard) {
        let log = LogBuf::default();
        let writer = log.clone();
        let guard = tracing::subscriber::set_default(
            tracing_subscriber::fmt()
                .with_ansi(false)
                .with_max_level(tracing::Level::INFO)
                .with_writer(move || writer.clone())
                .finish(),
        );
        (log, guard)
    }
}

#[cfg(test)]
mod log_gate_tests {
    use super::*;

    use governor::clock::FakeRelativeClock;

    #[test]
    fn a_subject_gets_its_lines_per_window_then_a_count_of_the_rest() {
        let clock = FakeRelativeClock::default();
        let gates = LogGates::with_clock(clock.clone());
        let admitted = (0..25).filter(|_| gates.admit("erp").is_some()).count();
        assert_eq!(admitted, LogGates::PER_WINDOW as usize);
        // Another subject has its own lines.
        assert_eq!(gates.admit("crm"), Some(0));
        // The next window's first line says how many were left out.
        clock.advance(LogGates::WINDOW);
        assert_eq!(gates.admit("erp"), Some(15));
        assert_eq!(gates.admit("erp"), Some(0));
    }

    /// 1,000 subjects failing together: each alone is within its own limit, but the process
    /// writes at most the ceiling (its burst, then `CEILING_PER_SECOND`), where the
    /// per-subject limits alone let 10,000 lines through in the window. Every line is
    /// written, or counted for its subject (reported on its next line, or still pending),
    /// and the window's end brings one summary of what the ceiling dropped.
    #[test]
    fn the_ceiling_holds_over_many_subjects_and_every_line_is_counted() {
        let clock = FakeRelativeClock::default();
        let gates = LogGates::with_clock(clock.clone());
        let subjects: Vec<String> = (0..1_000).map(|i| format!("t{i}")).collect();
        let mut written = std::collections::HashMap::<&str, u64>::new();
        let mut reported = std::collections::HashMap::<&str, u64>::new();
        let mut tried = 0u64;
        let mut admitted_total = 0u64;
        let mut summaries = Vec::new();
        // 10 s, each subject trying a line every 100 ms (100 in its window).
        for _ in 0..100 {
            for s in &subjects {
                tried += 1;
                let (admitted, summary) = gates.admit_now(s);
                summaries.extend(summary);
                if let Some(n) = admitted {
                    admitted_total += 1;
                    *written.entry(s).or_default() += 1;
                    *reported.entry(s).or_default() += n;
                }
            }
            clock.advance(Duration::from_millis(100));
        }
        let ceiling =
            u64::from(LogGates::CEILING_BURST) + u64::from(LogGates::CEILING_PER_SECOND) * 10;
        assert!(
            admitted_total <= ceiling && admitted_total >= ceiling - 60,
            "{admitted_total} of {tried}"
        );
        for s in &subjects {
            let w = written.get(s.as_str()).copied().unwrap_or(0);
            let r = reported.get(s.as_str()).copied().unwrap_or(0);
            assert_eq!(w + r + gates.pending(s), 100, "{s}: every line counted");
            assert!(w <= u64::from(LogGates::PER_WINDOW), "{s}: {w}");
        }
        assert!(summaries.is_empty(), "the first window has not ended");
        // The next window's first admit brings the summary of the one that ended.
        clock.advance(Duration::from_secs(1));
        let (_, summary) = gates.admit_now("t0");
        let summary = summary.expect("a summary");
        // All but the few the refills always reached first (until their own limit).
        assert!((900..=1_000).contains(&summary.subjects), "{summary:?}");
        // The ceiling's drops: all lines but those written or held by the subjects' own
        // limits (each subject's 10 a window, and it only ever got fewer through).
        assert!(
            summary.lines > tried - ceiling - 10_000 && summary.lines <= tried - admitted_total,
            "{summary:?}"
        );
        let (_, again) = gates.admit_now("t1");
        assert_eq!(again, None, "once per window");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exposition(m: &Metrics) -> String {
        let mut out = String::new();
        encode(&mut out, &m.registry).expect("encode");
        out
    }

    #[test]
    fn a_forgotten_target_loses_its_counters_and_histograms_and_the_others_keep_theirs() {
        let m = Metrics::new();
        for t in ["gone", "kept"] {
            m.deliveries
                .get_or_create(&vec![("target", t.into()), ("result", "delivered".into())])
                .inc();
            m.deliveries
                .get_or_create(&vec![("target", t.into()), ("result", "retried".into())])
                .inc();
            m.attempt_seconds
                .get_or_create(&vec![("target", t.into())])
                .observe(0.01);
            m.system_events_dropped
                .get_or_create(&vec![("type", "dlq".into()), ("target", t.into())])
                .inc();
        }
        m.forget_target("gone");
        let text = exposition(&m);
        assert!(!text.contains("target=\"gone\""), "{text}");
        assert!(
            text.contains("router_deliveries_total{target=\"kept\",result=\"retried\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("router_attempt_seconds_count{target=\"kept\"} 1"),
            "{text}"
        );
        // Back under the same id, it counts from zero.
        m.deliveries
            .get_or_create(&vec![
                ("target", "gone".into()),
                ("result", "delivered".into()),
            ])
            .inc();
        let text = exposition(&m);
        assert!(
            text.contains("router_deliveries_total{target=\"gone\",result=\"delivered\"} 1"),
            "{text}"
        );
        m.forget_target("gone");
        assert!(!exposition(&m).contains("target=\"gone\""));
    }

    #[test]
    fn rule_matches_are_counted_per_rule_with_the_latest_time_and_forgotten_when_removed() {
        let m = Metrics::new();
        m.count_rule_matches(["a", "b", "a"], 2_000);
        m.count_rule_matches(["a"], 1_000);
        m.count_rule_matches(std::iter::empty(), 9_000);
        assert_eq!(m.rule_matches("a"), (3, Some(2_000)));
        assert_eq!(m.rule_matches("b"), (1, Some(2_000)));
        assert_eq!(m.rule_matches("c"), (0, None));
        let text = exposition(&m);
        assert!(
            text.contains("router_rule_matched_events_total{rule=\"a\"} 3"),
            "{text}"
        );
        m.forget_rules(|name| name == "a");
        assert_eq!(m.rule_matches("b"), (0, None));
        let text = exposition(&m);
        assert!(!text.contains("rule=\"b\""), "{text}");
        assert!(
            text.contains("router_rule_matched_events_total{rule=\"a\"} 3"),
            "{text}"
        );
    }

    /// Each running target's queue-depth cap is a series; a target no longer running
    /// (removed, drained) loses it, as its `router_queue_depth` does.
    #[test]
    fn the_queue_depth_cap_is_a_gauge_per_running_target() {
        let m = Metrics::new();
        m.set_queue_max_depth(&[("a".into(), 5), ("b".into(), 100_000)]);
        let t = exposition(&m);
        assert!(t.contains("router_queue_max_depth{target=\"a\"} 5"), "{t}");
        assert!(
            t.contains("router_queue_max_depth{target=\"b\"} 100000"),
            "{t}"
        );
        m.set_queue_max_depth(&[("a".into(), 5)]);
        let t = exposition(&m);
        assert!(!t.contains("router_queue_max_depth{target=\"b\"}"), "{t}");
    }

    /// A reload that removes a target's breaker, or the target, removes its series: an
    /// alert on `router_breaker_state == 1` left at its last value never cleared.
    #[test]
    fn worker_gauges_of_removed_breakers_and_targets_disappear() {
        let m = Metrics::new();
        m.set_worker_gauges(
            &[("a".into(), false), ("b".into(), true)],
            &[("a".into(), 1), ("b".into(), 0)],
        );
        let t = exposition(&m);
        assert!(t.contains("router_breaker_state{target=\"a\"} 1"), "{t}");
        assert!(t.contains("router_target_paused{target=\"b\"} 1"), "{t}");
        // The reload removed a's breaker and target b.
        m.set_worker_gauges(&[("a".into(), false)], &[]);
        let t = exposition(&m);
        assert!(!t.contains("router_breaker_state{"), "{t}");
        assert!(!t.contains("router_target_paused{target=\"b\"}"), "{t}");
        assert!(t.contains("router_target_paused{target=\"a\"} 0"), "{t}");
        // A breaker added back shows again.
        m.set_worker_gauges(&[("a".into(), false)], &[("a".into(), 2)]);
        assert!(exposition(&m).contains("router_breaker_state{target=\"a\"} 2"));
    }

    /// A handler that does not run shows 0; a deleted one loses its series.
    #[test]
    fn handler_loaded_follows_the_handlers() {
        let m = Metrics::new();
        m.set_handler_loaded(&[("noop".into(), true), ("broken".into(), false)]);
        let t = exposition(&m);
        assert!(
            t.contains("router_handler_loaded{handler=\"noop\"} 1"),
            "{t}"
        );
        assert!(
            t.contains("router_handler_loaded{handler=\"broken\"} 0"),
            "{t}"
        );
        m.set_handler_loaded(&[("noop".into(), true)]);
        assert!(!exposition(&m).contains("handler=\"broken\""));
    }
}
