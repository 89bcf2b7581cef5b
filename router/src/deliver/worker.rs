//! One target's delivery worker and the attempt state machine.
//!
//! Each turn of the loop applies the policy checks in the SPEC's order — breaker → budget →
//! throttle → concurrency — before any attempt is spent (a receiver's `Retry-After` pause
//! first, like an open breaker): an open breaker leases nothing (due
//! messages wait, attempt counts do not grow), half-open lets a few probes through, an
//! over-budget retry is put back unattempted, and the rate limiter decides how many entries are
//! leased at all.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::DeliveryContext;
use super::runtime::TargetRuntime;
use crate::event::CloudEvent;
use crate::policy::backoff;
use crate::policy::breaker::{Admission, BreakerState, Transition};
use crate::policy::config::RetryPolicy;
use crate::rules::{TargetKind, WebhookBatch};
use crate::store::{
    AttemptEnd, AttemptResult, Disposition, DlqReason, FinishError, Leased, Millis, Unreadable,
};
use crate::target::{AttemptOutcome, DeliveryRequest, Target};

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Longest error text kept per attempt (a trap's backtrace can be long; the handler's logs
/// keep the full message).
const MAX_ERROR_CHARS: usize = 2048;

fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(max).collect();
        t.push('…');
        t
    }
}

/// How long a target's worker waits after a failed lease (the store is failing).
const LEASE_RETRY_MS: i64 = 1000;
/// Longest idle sleep; the worker also wakes on new entries.
const IDLE_MS: i64 = 1000;

async fn sleep_or_stop(
    stop: &CancellationToken,
    wait: Duration,
    notify: Option<&tokio::sync::Notify>,
) -> bool {
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = async { match notify { Some(n) => n.notified().await, None => std::future::pending().await } } => true,
        _ = tokio::time::sleep(wait) => true,
    }
}

fn wait_ms(ms_: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms_.clamp(1, IDLE_MS)).unwrap_or(1))
}

/// What a batching webhook's `window` lets go of its due entries.
#[derive(Debug, PartialEq, Eq)]
enum WindowGate {
    /// Everything due (no window, or the oldest due entry has waited it out).
    All,
    /// This many full batches; the rest waits for more.
    Full(usize),
    /// Less than a batch is due: wait this long (or until more is queued).
    Wait(Duration),
}

/// The `window` gate for `due` entries in batches of `per_slot`, the oldest due since
/// `oldest_due` (`None`: not known, so nothing to wait for).
fn window_gate(
    window: Duration,
    due: usize,
    per_slot: usize,
    oldest_due: Option<Millis>,
    now: Millis,
) -> WindowGate {
    let window_ms = i64::try_from(window.as_millis()).unwrap_or(i64::MAX);
    let left = match oldest_due {
        Some(d) if window_ms > 0 => d.saturating_add(window_ms).saturating_sub(now),
        _ => 0,
    };
    match due / per_slot.max(1) {
        _ if left <= 0 => WindowGate::All,
        0 => WindowGate::Wait(wait_ms(left)),
        full => WindowGate::Full(full),
    }
}

/// Attempts a target may have in flight: its policy's `throttle.max_concurrency`, else the
/// default of its kind (handlers get more: their CPU is bounded by the invocation gate).
pub fn slot_count(spec: &crate::rules::TargetSpec, cfg: &crate::config::DeliveryConfig) -> usize {
    let default = if matches!(spec.kind, TargetKind::Handler { .. }) {
        cfg.handler_concurrency
    } else {
        cfg.concurrency
    };
    spec.policy
        .throttle
        .as_ref()
        .and_then(|t| t.max_concurrency)
        .map_or(default, |c| c as usize)
        .max(1)
}

/// How long a lease on an entry of `spec` lasts: its timeout plus the lease margin, so a
/// worker silent for longer than an attempt may take loses it.
pub(super) fn lease_ms(
    spec: &crate::rules::TargetSpec,
    cfg: &crate::config::DeliveryConfig,
) -> i64 {
    ms(spec.policy.timeout.saturating_add(cfg.lease_margin))
}

/// The worker loop.
pub(super) async fn run(
    ctx: Arc<DeliveryContext>,
    rt: Arc<TargetRuntime>,
    target: Arc<dyn Target>,
    slots: Arc<Semaphore>,
    stop: CancellationToken,
) {
    let spec = &rt.spec;
    let notify = ctx.store.notifier(&spec.id);
    let lease_ms = lease_ms(spec, &ctx.cfg);
    // Set by a failed lease: no lease is tried before this time (clock ms). Leases run as their
    // own tasks, so without it a store outage would be a failed lease — and an error line —
    // per free slot.
    let lease_pause = Arc::new(AtomicI64::new(0));
    // Handler deliveries take no global permit (`in_flight`: no sockets, their CPU has its
    // own bound).
    let capped = !matches!(spec.kind, TargetKind::Handler { .. });
    loop {
        if rt.paused.load(Ordering::SeqCst) {
            if !sleep_or_stop(&stop, wait_ms(IDLE_MS), Some(&notify)).await {
                break;
            }
            continue;
        }
        let paused_for = lease_pause.load(Ordering::SeqCst) - ctx.clock.now_ms();
        if paused_for > 0 {
            if !sleep_or_stop(&stop, wait_ms(paused_for), None).await {
                break;
            }
            continue;
        }
        let first = tokio::select! {
            _ = stop.cancelled() => break,
            p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
        };
        // The global pool (`delivery.max_in_flight`, see `in_flight`): one permit taken before
        // anything is leased, so entries wait in the queue (no attempt spent, no lease running
        // out) while the router has as many attempts in flight as it allows.
        let mut first_global = None;
        if capped {
            match ctx.in_flight.try_acquire(&rt.share) {
                Some(g) => first_global = Some(g),
                None => {
                    // Only a worker with something to send queues for a permit: an idle target
                    // in the queue would hold a permit back from one that has work.
                    let now = ctx.clock.now_ms();
                    if ctx.store.due_count(&spec.id, now, 1) == 0 {
                        drop(first);
                        let wait = ctx.store.next_due(&spec.id).map_or(IDLE_MS, |d| d - now);
                        if !sleep_or_stop(&stop, wait_ms(wait), Some(&notify)).await {
                            break;
                        }
                        continue;
                    }
                    first_global = tokio::select! {
                        _ = stop.cancelled() => break,
                        g = ctx.in_flight.acquire(&rt.share) => g,
                    };
                    if first_global.is_none() {
                        break;
                    }
                    // Paused while it waited: the permit goes to others.
                    if rt.paused.load(Ordering::SeqCst) {
                        continue;
                    }
                }
            }
        }
        let now = ctx.clock.now_ms();

        // 0. The receiver's Retry-After pause: like an open breaker, nothing is leased. Asked
        // once a slot is held: with a backlog the loop waits for a slot, and the attempt that
        // got the 429 sets the pause before it frees its slot.
        if let Some(until) = rt.retry_after_until(now) {
            drop((first, first_global));
            if !sleep_or_stop(&stop, wait_ms(until - now), None).await {
                break;
            }
            continue;
        }

        // 1. Breaker.
        let (admission, transition) = match rt.breaker() {
            Some(mut b) => b.admit(now),
            None => (Admission::Open, None),
        };
        if let Some(t) = transition {
            on_transition(&ctx, &rt, t, now).await;
        }
        let max = match admission {
            Admission::Open => usize::MAX,
            Admission::Probes(0) => {
                drop((first, first_global));
                if !sleep_or_stop(&stop, wait_ms(100), None).await {
                    break;
                }
                continue;
            }
            Admission::Probes(n) => n as usize,
            Admission::WaitUntil(until) => {
                drop((first, first_global));
                if !sleep_or_stop(&stop, wait_ms(until - now), None).await {
                    break;
                }
                continue;
            }
        };
        let probing = matches!(admission, Admission::Probes(_));
        let mut permits = vec![first];
        while permits.len() < max {
            match slots.clone().try_acquire_owned() {
                Ok(p) => permits.push(p),
                Err(_) => break,
            }
        }
        // A batching webhook takes up to a batch per slot (probes go one event at a time).
        let per_slot = match rt.batch() {
            Some(b) if !probing => usize::try_from(b.max_events).unwrap_or(1).max(1),
            _ => 1,
        };
        let due = ctx
            .store
            .due_count(&spec.id, now, permits.len().saturating_mul(per_slot));
        if due == 0 {
            drop((permits, first_global));
            let wait = ctx.store.next_due(&spec.id).map_or(IDLE_MS, |d| d - now);
            if !sleep_or_stop(&stop, wait_ms(wait), Some(&notify)).await {
                break;
            }
            continue;
        }

        // A batching webhook's window: until the oldest due entry has waited it out, only
        // full batches go and less than a batch waits for more. Each commit that queues more
        // for this target wakes the loop to count again. (Without a window the index is not
        // asked for the oldest due time.)
        let mut await_lease = probing;
        if !probing && let Some(b) = rt.batch().filter(|b| !b.window.is_zero()) {
            match window_gate(b.window, due, per_slot, ctx.store.next_due(&spec.id), now) {
                WindowGate::All => {}
                WindowGate::Full(n) => {
                    permits.truncate(n);
                    await_lease = true;
                }
                WindowGate::Wait(wait) => {
                    drop((permits, first_global));
                    if !sleep_or_stop(&stop, wait, Some(&notify)).await {
                        break;
                    }
                    continue;
                }
            }
        }

        // Each slot taken needs its place in the global pool too: the first was taken above,
        // the rest only if free now (and the target is under its fair share of a contended
        // pool). Slots without one are given back: a target never holds more than its own
        // slots, nor waits here holding them.
        let mut permits = pair_with_global(&ctx, &rt, capped, permits, first_global);

        // 3. Throttle: take as many tokens as there are requests of due work (the budget
        // check comes per entry, after the lease; the tokens of requests it stops are given
        // back as credit, spent here first). A batch is one request.
        let requests = due.div_ceil(per_slot).min(permits.len());
        let mut allowed = requests;
        if let Some(limiter) = rt.limiter() {
            allowed = rt.take_credit(requests);
            let mut retry_in = None;
            while allowed < requests {
                match limiter.check() {
                    Ok(()) => allowed += 1,
                    Err(not_until) => {
                        use governor::clock::Clock as _;
                        retry_in = Some(
                            not_until
                                .wait_time_from(governor::clock::DefaultClock::default().now()),
                        );
                        break;
                    }
                }
            }
            if allowed == 0 {
                drop(permits);
                rt.counters.throttled.fetch_add(1, Ordering::Relaxed);

                ctx.metrics
                    .throttled
                    .get_or_create(&vec![("target", spec.id.clone())])
                    .inc();
                let wait = retry_in
                    .unwrap_or(Duration::from_millis(10))
                    .max(Duration::from_millis(1));
                rt.counters
                    .throttled_until
                    .store(now.saturating_add(ms(wait)), Ordering::Relaxed);
                if !sleep_or_stop(&stop, wait, None).await {
                    break;
                }
                continue;
            }
        }
        permits.truncate(allowed);

        // The bytes of what is leased (`delivery.max_in_flight_bytes`, see `bytes`): the
        // first slot waits for its reservation, further slots take theirs only if free now
        // (both within the target's fair share of a contended pool), and slots without are
        // given back. Before the lease, as the count permits: an entry never waits for room
        // while its lease runs out.
        let per_request = rt
            .bytes_estimate
            .load(Ordering::Relaxed)
            .saturating_mul(u64::try_from(per_slot).unwrap_or(u64::MAX));
        let mut reserved = match ctx.bytes.try_take(&rt.byte_share, per_request) {
            Some(g) => g,
            None => {
                let more = permits.len().saturating_sub(1);
                permits.truncate(1);
                rt.refund_tokens(more);
                // Over its fair share of a contended pool, the target waits for its own bytes
                // to come back (see `bytes`): counted once per wait.
                let held_back = || {
                    rt.counters.byte_share_waits.fetch_add(1, Ordering::Relaxed);
                    ctx.metrics
                        .delivery_byte_share_waits
                        .get_or_create(&vec![("target", spec.id.clone())])
                        .inc();
                };
                let got = tokio::select! {
                    _ = stop.cancelled() => break,
                    g = ctx.bytes.take(&rt.byte_share, per_request, held_back) => g,
                };
                match got {
                    Some(g) => g,
                    None => break,
                }
            }
        };
        let mut covered = 1;
        while covered < permits.len() {
            match ctx.bytes.try_take(&rt.byte_share, per_request) {
                Some(g) => reserved.merge(g),
                None => break,
            }
            covered += 1;
        }
        if covered < permits.len() {
            rt.refund_tokens(permits.len() - covered);
            permits.truncate(covered);
        }

        let step = lease_and_start(
            ctx.clone(),
            rt.clone(),
            target.clone(),
            (permits, per_slot, reserved),
            now,
            lease_ms,
            probing,
            lease_pause.clone(),
        );
        if await_lease {
            // Half-open: the probe count is settled before the breaker is asked again. Full
            // batches under a window: leased before the loop counts again, or a lease task not
            // yet run would leave its entries counted as due, and a second lease would send
            // what is left of them as a partial batch.
            step.await;
        } else {
            // The lease waits for a commit (one or two group-commit cycles). Waiting for it here
            // meant every lease took only the slots freed by then — often one, since the first
            // attempt to finish wakes the loop — and throughput was capped at a few entries per
            // commit. Leases overlap instead: slots freed while one commits go into the next,
            // which joins the following commit. Each lease holds its slots, so at most
            // `concurrency` are in flight. (Limiting them to two or four in flight, for larger
            // leases, measured slower for a webhook at concurrency 32: freed slots sat idle.)
            // The store reserves entries when the task first runs, so until then the loop may
            // see the same entries as due and start another lease for them: that one finds
            // nothing left, costs no store write and gives its slots back.
            ctx.tracker.spawn(step.instrument(tracing::Span::current()));
        }
    }
    tracing::info!(target_id = %spec.id, "delivery worker stopped");
}

/// What one attempt (or batch request) holds while it runs: a slot of its target and, for
/// webhook and NATS targets, a permit of the global pool (`delivery.max_in_flight`). Both are
/// given back on drop. Once its entries are known, also their bytes
/// (`delivery.max_in_flight_bytes`), which the attempt takes out to hold until its result is
/// recorded ([`Slot::take_bytes`]).
pub(super) struct Slot {
    _target: OwnedSemaphorePermit,
    _global: Option<super::in_flight::GlobalPermit>,
    bytes: Option<super::bytes::ByteGrant>,
}

impl Slot {
    /// A slot of `target` with its global permit (`None` for a handler target).
    pub(super) fn new(
        target: OwnedSemaphorePermit,
        global: Option<super::in_flight::GlobalPermit>,
    ) -> Self {
        Self {
            _target: target,
            _global: global,
            bytes: None,
        }
    }

    /// This slot, holding `bytes` of the byte pool for its entries.
    pub(super) fn with_bytes(mut self, bytes: super::bytes::ByteGrant) -> Self {
        self.bytes = Some(bytes);
        self
    }

    /// The bytes this slot's entries hold: kept past the slot, until the attempt's result is
    /// recorded (the events are held until then).
    fn take_bytes(&mut self) -> Option<super::bytes::ByteGrant> {
        self.bytes.take()
    }
}

/// The KiB of the byte pool a leased entry is charged.
fn charge(leased: &Leased) -> u64 {
    super::bytes::charge_kib(leased.event.event.payload_len())
}

/// Pairs the target slots a worker took with global permits: `first` for the first, a free
/// one (under the target's fair share) for each further one; slots left without one are
/// freed. Uncapped (handler) targets take none.
fn pair_with_global(
    ctx: &DeliveryContext,
    rt: &TargetRuntime,
    capped: bool,
    permits: Vec<OwnedSemaphorePermit>,
    mut first: Option<super::in_flight::GlobalPermit>,
) -> Vec<Slot> {
    let mut slots = Vec::with_capacity(permits.len());
    for p in permits {
        let global = if !capped {
            None
        } else if let Some(g) = first.take() {
            Some(g)
        } else if let Some(g) = ctx.in_flight.try_acquire(&rt.share) {
            Some(g)
        } else {
            break;
        };
        slots.push(Slot::new(p, global));
    }
    slots
}

/// Leases up to `permits.len() × per_slot` due entries of the target and starts an attempt
/// for each (each taking one slot), or for a batching webhook one request per batch of them
/// (each batch taking one slot); slots left over are given back. Budget checks happen here,
/// per entry, since only the lease says which entries are retries.
#[allow(clippy::too_many_arguments)]
async fn lease_and_start(
    ctx: Arc<DeliveryContext>,
    rt: Arc<TargetRuntime>,
    target: Arc<dyn Target>,
    (mut permits, per_slot, mut bytes): (Vec<Slot>, usize, super::bytes::ByteGrant),
    now: Millis,
    lease_ms: i64,
    probing: bool,
    lease_pause: Arc<AtomicI64>,
) {
    let spec = &rt.spec;
    match ctx
        .store
        .lease_batch(
            &spec.id,
            now,
            permits.len().saturating_mul(per_slot),
            lease_ms,
        )
        .await
    {
        Ok(batch) => {
            ctx.store_faults.lease_ok(&spec.id);
            // Set aside first, taking no slot: they are never sent.
            for u in batch.unreadable {
                set_aside_unreadable(&ctx, &rt, u, now).await;
            }
            // The next lease reserves per entry what the largest event of this one weighed.
            if let Some(largest) = batch.leased.iter().map(charge).max() {
                rt.bytes_estimate.store(largest, Ordering::Relaxed);
            }
            let batching = rt.batch().filter(|_| per_slot > 1);
            let mut to_batch = Vec::new();
            for leased in batch.leased {
                if batching.is_none() && permits.is_empty() {
                    break;
                }
                // Out of attempts or past max_age: a dead letter now, taking no slot and no
                // budget token. Checked only at the attempt, such a retry was deferred by the
                // budget like any other, again and again: with the receiver down, a queue
                // filled with entries many times older than max_age, drained at the budget's
                // floor rate.
                if let Some(settled) = not_sendable(&rt, &leased, now) {
                    let span = tracing::info_span!("attempt", event_id = %leased.event.event.id, source = %leased.event.event.source, target_id = %spec.id, attempt = leased.entry.attempts.len());
                    let (c, r) = (ctx.clone(), rt.clone());
                    ctx.tracker.spawn_on(
                        async move { record(&c, &r, &leased, settled).await }.instrument(span),
                        &ctx.spawner,
                    );
                    continue;
                }
                // 2. Budget: retries beyond it wait, unattempted, each until its own slot at
                // the rate the budget grants them. Probes bypass it.
                let is_retry = leased.entry.attempts.len() > 1;
                let deferred = {
                    let mut budget = rt.budget();
                    if !is_retry {
                        budget.first_attempt(now);
                        None
                    } else if probing || budget.try_retry(now) {
                        None
                    } else {
                        Some(budget.defer_until(now))
                    }
                };
                if let Some(until) = deferred {
                    rt.counters.budget_deferred.fetch_add(1, Ordering::Relaxed);
                    rt.counters
                        .last_budget_deferred_at
                        .store(now, Ordering::Relaxed);
                    ctx.metrics
                        .budget_deferred
                        .get_or_create(&vec![("target", spec.id.clone())])
                        .inc();
                    // Not past the entry's max_age: a deferral far behind a long backlog of
                    // retries would keep it queued long after; back at its deadline it is
                    // dead-lettered above.
                    let deadline = leased
                        .entry
                        .accepted_at
                        .saturating_add(ms(spec.policy.retry.max_age))
                        .saturating_add(1);
                    defer(&ctx, &leased, now, until.min(deadline)).await;
                    continue;
                }
                if batching.is_some() {
                    to_batch.push(leased);
                    continue;
                }
                if permits.is_empty() {
                    break;
                }
                // Its bytes: out of the reservation, or what the pool has free; with neither
                // (the events are larger than the last lease's), back to the queue unattempted.
                let Some(held) = bytes.split_or_take(charge(&leased)) else {
                    defer(&ctx, &leased, now, now).await;
                    continue;
                };
                let Some(permit) = permits.pop() else { break };
                if probing && let Some(mut b) = rt.breaker() {
                    b.probes_started(1);
                }
                spawn_attempt(&ctx, &rt, &target, leased, permit.with_bytes(held), probing);
            }
            let unused = match batching {
                Some(b) => send_batches(&ctx, &rt, &target, to_batch, &b, permits, bytes).await,
                None => permits.len(),
            };
            // Each slot taken stood for a throttle token: those not used by a request
            // (retries the budget deferred, entries another lease took) are given back.
            rt.refund_tokens(unused);
        }
        Err(e) => {
            drop(permits);
            let failed_at = ctx.clock.now_ms();
            let before = lease_pause.fetch_max(failed_at + LEASE_RETRY_MS, Ordering::SeqCst);
            // A compaction's refusal is planned maintenance: not counted where a failing
            // disk is (an alert on the counter paged for every compaction).
            if !matches!(e, crate::store::StoreError::Compacting) {
                ctx.metrics
                    .lease_failures
                    .get_or_create(&vec![("target", spec.id.clone())])
                    .inc();
                ctx.store_faults
                    .lease_failed(&spec.id, &e.to_string(), failed_at);
            }
            // Leases in flight together fail together: one line per pause. A compaction is
            // planned maintenance, not a failure.
            if before <= failed_at {
                if matches!(e, crate::store::StoreError::Compacting) {
                    tracing::info!(target_id = %spec.id, "store compacting; leases resume in 1s");
                } else {
                    tracing::error!(target_id = %spec.id, error = %e, "lease failed; retrying in 1s");
                }
            }
        }
    }
}

/// Sets aside a leased entry whose event's stored record cannot be read: to the DLQ as
/// `corrupt_record`, nothing sent (its attempt is not counted), under the target's
/// `on_dead_letter` like any dead letter. Failing the whole lease for it, as the store did,
/// stopped the target's queue for good behind the one record. Logged with the entry and the
/// event's sequence number, counted (`router_store_corrupt_records_total`, and as a dead
/// letter), announced (`router.dlq.added`) and listed in `/v1/status`.
async fn set_aside_unreadable(
    ctx: &DeliveryContext,
    rt: &TargetRuntime,
    u: Unreadable,
    now: Millis,
) {
    let spec = &rt.spec;
    let seq = u.entry.id.event;
    let error = format!(
        "the stored record of event {seq} cannot be read: {}",
        u.error
    );
    tracing::error!(
        target_id = %spec.id,
        entry = %u.entry.id,
        event_seq = seq,
        error = %u.error,
        "an event's stored record cannot be read; its delivery is set aside in the DLQ as corrupt_record"
    );
    ctx.metrics
        .corrupt_records
        .get_or_create(&vec![("target", spec.id.clone())])
        .inc();
    ctx.store_faults
        .corrupt_record(&spec.id, u.entry.id, &u.error, now);
    let end = AttemptEnd {
        finished_at: now,
        result: AttemptResult::NotSent,
        status: None,
        error: Some(error.clone()),
        outbox: None,
    };
    let reason = DlqReason::CorruptRecord;
    let disposition = Disposition::DeadLetter {
        reason,
        hold: spec.policy.holds_keys(),
    };
    let held = matches!(disposition, Disposition::DeadLetter { hold: true, .. });
    match ctx
        .store
        .finish(u.entry.id, u.lease, end, disposition, now)
        .await
    {
        Ok(finished) => {
            ctx.metrics
                .deliveries
                .get_or_create(&vec![
                    ("target", spec.id.clone()),
                    ("result", "dead_lettered".to_string()),
                ])
                .inc();
            rt.counters.dead_lettered.fetch_add(1, Ordering::Relaxed);
            // The event's id, source and type are in the record that cannot be read.
            let unknown = DeadEvent {
                id: "",
                source: "",
                ty: "",
                hops: u.entry.hops,
                emitted_by: None,
                ordering_key: None,
                key_held: false,
                dlq_id: None,
            }
            .of_entry(&u.entry, held, finished.dlq_id);
            dead_lettered(ctx, Some(&spec.id), unknown, reason, Some(&error), now);
        }
        Err(e) => {
            tracing::error!(target_id = %spec.id, entry = %u.entry.id, error = %e, "could not set the entry aside; it is leased again when its lease expires");
        }
    }
}

/// Starts an attempt on a leased entry, on the delivery runtime, holding its slot (for a
/// batching webhook, a request carrying only this entry).
pub(super) fn spawn_attempt(
    ctx: &Arc<DeliveryContext>,
    rt: &Arc<TargetRuntime>,
    target: &Arc<dyn Target>,
    leased: Leased,
    permit: Slot,
    probing: bool,
) {
    if let Some(b) = rt.batch() {
        if let Some(items) = split_batches(vec![leased], &b).into_iter().next() {
            spawn_batch(ctx, rt, target, items, permit, probing);
        }
        return;
    }
    let span = tracing::info_span!("attempt", event_id = %leased.event.event.id, source = %leased.event.event.source, target_id = %rt.spec.id, attempt = leased.entry.attempts.len());
    ctx.tracker.spawn_on(
        attempt(
            ctx.clone(),
            rt.clone(),
            target.clone(),
            leased,
            permit,
            probing,
        )
        .instrument(span),
        &ctx.spawner,
    );
}

/// Sends leased entries of a batching webhook as batch requests (split by `max_events` and
/// `max_bytes`), each holding one of `permits`. Entries of batches past the permits (a
/// `max_bytes` split made more requests than there were slots) go back to the queue at once,
/// their attempt not counted: the next lease takes them, under the throttle and the breaker
/// like any request. Waiting here for a slot instead let their leases run out while they
/// waited (the entries were leased again and sent twice, and the late request's answer was
/// discarded as fenced), and sent those requests past the throttle. Returns how many permits
/// no request used.
pub(super) async fn send_batches(
    ctx: &Arc<DeliveryContext>,
    rt: &Arc<TargetRuntime>,
    target: &Arc<dyn Target>,
    leased: Vec<Leased>,
    batch: &WebhookBatch,
    mut permits: Vec<Slot>,
    mut bytes: super::bytes::ByteGrant,
) -> usize {
    // Each request takes its events' bytes out of what the lease reserved (and the slots
    // hold), or what the pool has free; a request finding no room goes back like one
    // finding no slot.
    for p in &mut permits {
        if let Some(b) = p.take_bytes() {
            bytes.merge(b);
        }
    }
    let mut put_back = Vec::new();
    for items in split_batches(leased, batch) {
        let weight = items
            .iter()
            .map(|i| charge(&i.leased))
            .fold(0u64, u64::saturating_add);
        let held = if permits.is_empty() {
            None
        } else {
            bytes.split_or_take(weight)
        };
        match (held, permits.pop()) {
            (Some(held), Some(permit)) => {
                spawn_batch(ctx, rt, target, items, permit.with_bytes(held), false);
            }
            (_, permit) => {
                permits.extend(permit);
                put_back.extend(items.into_iter().map(|i| i.leased));
            }
        }
    }
    drop(bytes);
    if !put_back.is_empty() {
        let now = ctx.clock.now_ms();
        tracing::debug!(target_id = %rt.spec.id, entries = put_back.len(), "more batches than slots; the rest go back to the queue");
        for leased in &put_back {
            defer(ctx, leased, now, now).await;
        }
    }
    permits.len()
}

/// Starts one batch request on the delivery runtime, holding its slot.
fn spawn_batch(
    ctx: &Arc<DeliveryContext>,
    rt: &Arc<TargetRuntime>,
    target: &Arc<dyn Target>,
    items: Vec<BatchItem>,
    permit: Slot,
    probing: bool,
) {
    let first = items.first().map(|i| i.leased.event.event.id.clone());
    let span = tracing::info_span!("batch_attempt", target_id = %rt.spec.id, events = items.len(), first_event_id = first.as_deref().unwrap_or(""));
    ctx.tracker.spawn_on(
        attempt_batch(
            ctx.clone(),
            rt.clone(),
            target.clone(),
            items,
            permit,
            probing,
        )
        .instrument(span),
        &ctx.spawner,
    );
}

/// Puts a leased entry back without counting an attempt.
async fn defer(ctx: &DeliveryContext, leased: &Leased, now: i64, until: i64) {
    let end = AttemptEnd {
        finished_at: now,
        result: AttemptResult::Interrupted,
        status: None,
        error: None,
        outbox: None,
    };
    let r = ctx
        .store
        .finish(
            leased.entry.id,
            leased.lease,
            end,
            Disposition::Release { due_at: until },
            now,
        )
        .await;
    if let Err(e) = r {
        tracing::warn!(
            error = %e,
            event_id = %leased.event.event.id,
            target_id = %leased.entry.target_id,
            "could not defer an entry; it returns when its lease expires"
        );
    }
}

/// What to do after an attempt, from the outcome, the entry's history and the retry policy.
/// Pure, so the whole decision table is unit-tested. `jitter` is a number in [0, 1).
pub fn decide(
    outcome: &AttemptOutcome,
    attempts: u32,
    accepted_at: Millis,
    now: Millis,
    retry: &RetryPolicy,
    jitter: f64,
    hold: bool,
) -> Disposition {
    let dead = |reason| Disposition::DeadLetter { reason, hold };
    match outcome {
        AttemptOutcome::Delivered { .. } => Disposition::Delivered,
        AttemptOutcome::Permanent { .. } => dead(DlqReason::PermanentError),
        AttemptOutcome::Deferred { retry_after, .. } => Disposition::Release {
            due_at: now.saturating_add(ms(*retry_after)),
        },
        AttemptOutcome::Retryable { retry_after, .. } => {
            if attempts >= retry.max_attempts {
                return dead(DlqReason::RetriesExhausted);
            }
            // Retry-After (up to its cap) is a "not before": never sooner than the backoff, so
            // `Retry-After: 0`, or a date the receiver's slow clock puts in the past, cannot
            // turn a policy's backoff into back-to-back attempts.
            let backoff = backoff::delay(retry, attempts, jitter);
            let wait = match retry_after {
                Some(ra) => (*ra).min(retry.retry_after_max).max(backoff),
                None => backoff,
            };
            let due_at = now.saturating_add(ms(wait));
            if due_at > accepted_at.saturating_add(ms(retry.max_age)) {
                return dead(DlqReason::MaxAgeExceeded);
            }
            Disposition::Retry { due_at }
        }
    }
}

/// How an attempt on one entry ended and what follows from it, ready to be recorded.
struct Settled {
    end: AttemptEnd,
    disposition: Disposition,
    /// The `result` label of `router_deliveries_total`.
    label: &'static str,
}

/// An entry that must not be sent at all (its attempts or its age are used up: a crash loop or
/// a long outage must not retry forever), settled as a dead letter.
fn not_sendable(rt: &TargetRuntime, leased: &Leased, now: Millis) -> Option<Settled> {
    let retry = &rt.spec.policy.retry;
    let n = u32::try_from(leased.entry.attempts.len()).unwrap_or(u32::MAX);
    let (reason, error) = if n > retry.max_attempts {
        (
            DlqReason::RetriesExhausted,
            format!(
                "not sent: {} attempts already made (max {})",
                n - 1,
                retry.max_attempts
            ),
        )
    } else if now > leased.entry.accepted_at.saturating_add(ms(retry.max_age)) {
        (
            DlqReason::MaxAgeExceeded,
            format!(
                "not sent: event older than max_age {}",
                humantime::format_duration(retry.max_age)
            ),
        )
    } else {
        return None;
    };
    Some(Settled {
        end: AttemptEnd {
            finished_at: now,
            // Nothing was sent: the lease's attempt record goes, the dead letter's attempts
            // are the ones made.
            result: AttemptResult::NotSent,
            status: None,
            error: Some(error),
            outbox: None,
        },
        disposition: Disposition::DeadLetter {
            reason,
            hold: rt.spec.policy.holds_keys(),
        },
        label: "dead_lettered",
    })
}

/// Tells the breaker how a request ended, and acts on the transition it makes.
async fn breaker_record(
    ctx: &DeliveryContext,
    rt: &TargetRuntime,
    outcome: &AttemptOutcome,
    probe: bool,
    finished: Millis,
) {
    let success = match outcome {
        AttemptOutcome::Delivered { .. } => Some(true),
        o if o.counts_for_breaker() => Some(false),
        // A probe answered with a permanent failure (a 4xx, a handler's `fail`): the target
        // is up and answering, which is what the probe asks. Counted as nothing, it left the
        // breaker half-open, letting one entry through per probe, until a transient failure
        // or a success came.
        AttemptOutcome::Permanent { .. } if probe => Some(true),
        _ => None,
    };
    let transition = rt
        .breaker()
        .and_then(|mut b| b.record(success, probe, finished));
    if let Some(t) = transition {
        on_transition(ctx, rt, t, finished).await;
    }
}

/// The target-level pause a 429 or 503 with `Retry-After` asks for: `finished` plus the
/// delay, capped by the policy's `retry_after_max`. `None` for any other outcome (a handler's
/// `retry` with a delay is about its event, not the target).
fn retry_after_pause(
    outcome: &AttemptOutcome,
    retry: &RetryPolicy,
    finished: Millis,
) -> Option<Millis> {
    match outcome {
        AttemptOutcome::Retryable {
            status: Some(429 | 503),
            retry_after: Some(ra),
            ..
        } if !ra.is_zero() => Some(finished.saturating_add(ms((*ra).min(retry.retry_after_max)))),
        _ => None,
    }
}

/// Holds the whole target off after a 429 or 503 with `Retry-After` ([`retry_after_pause`]):
/// the worker leases nothing until then, so the rest of the queue waits instead of spending
/// attempts on answers the receiver announced. Persisted with the breaker's record, so a
/// restart keeps the pause.
///
/// True when the outcome asked for a pause and the target's hold (kept on disk, or lifted by
/// an operator meanwhile) stands for it: then the entries that got the answer need not wait
/// for the `Retry-After` themselves ([`conclude`]), so a resume that lifts the hold, or a
/// reload that shortens it, lets them go with the rest of the queue. Never on a store several
/// nodes share: the others follow the hold within seconds, and meanwhile one of them would
/// lease the answered entry at its backoff and send it at once.
async fn hold_off(
    ctx: &DeliveryContext,
    rt: &TargetRuntime,
    outcome: &AttemptOutcome,
    finished: Millis,
) -> bool {
    let Some(until) = retry_after_pause(outcome, &rt.spec.policy.retry, finished) else {
        return false;
    };
    let covers = !ctx.store.shared();
    if !rt.hold_off_until(until, finished) {
        // A later hold (persisted when it was set), one extended by under a second (within
        // a second of the stored one), or lifted by an operator since the attempt started.
        return covers;
    }
    let id = &rt.spec.id;
    tracing::warn!(target_id = %id, until = %crate::clock::rfc3339(until), "the receiver asked to hold off (Retry-After); nothing is sent to it until then");
    let state = if ctx.store.shared() {
        // The record is every node's: only the pause is this node's to write. Its whole
        // state would put its breaker over the record's, a half-open over another node's
        // close among them (see `persists`).
        match ctx.store.target_states().await {
            Ok(states) => with_retry_after(&states, id, until, finished),
            Err(e) => {
                tracing::warn!(target_id = %id, error = %e, "could not read the target's stored state to add the Retry-After pause; this node holds off until a restart, the others do not follow it");
                return false;
            }
        }
    } else {
        rt.persisted()
    };
    let state = serde_json::to_value(state).unwrap_or_default();
    match ctx.store.put_target_state(id, state).await {
        Ok(()) => covers,
        Err(e) => {
            tracing::warn!(target_id = %id, error = %e, "could not persist the Retry-After pause; it holds until a restart (the entries that got it wait for it themselves)");
            false
        }
    }
}

/// Target `id`'s stored state (among `states`), or a default one.
fn stored_state(
    states: &[(String, serde_json::Value)],
    id: &str,
) -> crate::deliver::PersistedState {
    states
        .iter()
        .find(|(k, _)| k == id)
        .and_then(|(_, v)| serde_json::from_value(v.clone()).ok())
        .unwrap_or_default()
}

/// Target `id`'s stored state (among `states`) with the receiver's pause until `until`, set at
/// `since`, added: what a node sharing its store writes for a Retry-After, the rest left as
/// stored.
fn with_retry_after(
    states: &[(String, serde_json::Value)],
    id: &str,
    until: Millis,
    since: Millis,
) -> crate::deliver::PersistedState {
    let mut state = stored_state(states, id);
    if state.retry_after_until.is_none_or(|u| until > u) {
        state.retry_after_until = Some(until);
        state.retry_after_since = Some(since);
    }
    state
}

/// Target `id`'s stored state (among `states`) without the receiver's pause an operator lifted
/// at `lifted_at` (one set later stays): what a node sharing its store writes for a lift, the
/// rest left as stored.
pub(super) fn without_retry_after(
    states: &[(String, serde_json::Value)],
    id: &str,
    lifted_at: Millis,
) -> crate::deliver::PersistedState {
    let mut state = stored_state(states, id);
    if state.retry_after_since.is_none_or(|s| s <= lifted_at) {
        state.retry_after_until = None;
        state.retry_after_since = None;
    }
    state
}

/// What follows for `leased` from the outcome of the request that carried it.
fn conclude(
    rt: &TargetRuntime,
    leased: &Leased,
    outcome: &AttemptOutcome,
    effects: Option<Box<crate::target::handler::Effects>>,
    finished: Millis,
    target_held: bool,
) -> Settled {
    let retry = &rt.spec.policy.retry;
    let hold = rt.spec.policy.holds_keys();
    let n = u32::try_from(leased.entry.attempts.len()).unwrap_or(u32::MAX);
    let jitter = rand::random::<f64>();
    let mut disposition = decide(
        outcome,
        n,
        leased.entry.accepted_at,
        finished,
        retry,
        jitter,
        hold,
    );
    // The target's hold keeps the receiver's Retry-After for the whole queue ([`hold_off`]):
    // this entry is due after its backoff, as any retry, and goes when the hold ends, is
    // lifted by a resume or is shortened by a reload. Due at the Retry-After itself, it stayed
    // behind after a resume (up to `retry_after_max`), alone and out of its queue's order.
    // (Whether the wait would pass `max_age` was decided with the Retry-After.)
    if target_held && let Disposition::Retry { due_at } = &mut disposition {
        *due_at = finished.saturating_add(ms(backoff::delay(retry, n, jitter)));
    }
    // A handler can name a more specific DLQ reason (unknown_version).
    if let (Disposition::DeadLetter { reason, .. }, Some(r)) = (
        &mut disposition,
        effects.as_ref().and_then(|e| e.dlq_reason),
    ) {
        *reason = r;
    }
    let outbox = effects.map(|e| Box::new(e.outbox));
    let result = match outcome {
        AttemptOutcome::Delivered { .. } => AttemptResult::Delivered,
        AttemptOutcome::Retryable { .. } => AttemptResult::Retryable,
        AttemptOutcome::Permanent { .. } => AttemptResult::Permanent,
        AttemptOutcome::Deferred { .. } => AttemptResult::Interrupted,
    };
    let label = match &disposition {
        Disposition::Delivered => "delivered",
        Disposition::Retry { .. } => "retried",
        // Put back without an attempt (a handler not uploaded or busy): not a retry.
        Disposition::Release { .. } => "deferred",
        Disposition::DeadLetter { .. } => "dead_lettered",
    };
    let mut error = outcome.error().map(|e| truncate(e, MAX_ERROR_CHARS));
    if let Disposition::DeadLetter {
        reason: DlqReason::MaxAgeExceeded,
        ..
    } = disposition
        && let Some(why) = not_retried_past_max_age(outcome, retry)
    {
        error = Some(match error {
            Some(e) => format!("{e}; {why}"),
            None => why,
        });
    }
    Settled {
        end: AttemptEnd {
            finished_at: finished,
            result,
            status: outcome.status(),
            error,
            outbox,
        },
        disposition,
        label,
    }
}

/// Why a retryable failure went to the DLQ as `max_age_exceeded` although the event may be
/// young ([`decide`]): its next attempt would come after `max_age`. Said with the wait and the
/// bound, and who set the wait when one did: an entry dead-lettered a few milliseconds after
/// acceptance with only "HTTP 503" as its error read as a bug. A wait with an HTTP status is
/// the receiver's `Retry-After`; one without is a handler's own `retry` delay (the handler
/// team reading "the receiver's Retry-After" went looking for a webhook).
fn not_retried_past_max_age(outcome: &AttemptOutcome, retry: &RetryPolicy) -> Option<String> {
    let AttemptOutcome::Retryable {
        retry_after,
        status,
        ..
    } = outcome
    else {
        return None;
    };
    let asked = if status.is_some() {
        "the receiver's Retry-After"
    } else {
        "the retry delay the handler asked for"
    };
    let fmt = |d: std::time::Duration| humantime::format_duration(d).to_string();
    let max_age = fmt(retry.max_age);
    Some(match retry_after {
        Some(ra) if !ra.is_zero() => {
            let capped = if *ra > retry.retry_after_max {
                format!(", capped at retry_after_max {}", fmt(retry.retry_after_max))
            } else {
                String::new()
            };
            format!(
                "not retried: {asked} ({}{capped}) would pass max_age {max_age}",
                fmt(*ra)
            )
        }
        _ => format!("not retried: the next attempt's backoff would pass max_age {max_age}"),
    })
}

/// The log line of one entry's settled attempt.
/// Logs how an attempt ended (in its span: event id, target, attempt), at most
/// `LogGates::PER_WINDOW` lines per target per window; the DLQ line is written by
/// [`dead_lettered`] once the entry is there. Errors go on one line (a trap's wasm backtrace
/// stays in the handler's own logs).
fn log_settled(ctx: &DeliveryContext, target: &str, outcome: &AttemptOutcome, s: &Settled) {
    let first_line = |e: &str| e.lines().next().unwrap_or("").to_string();
    match &s.disposition {
        Disposition::Delivered => tracing::debug!(status = ?outcome.status(), "delivered"),
        Disposition::Retry { due_at } => {
            if let Some(suppressed) = ctx.log_gates.admit(target) {
                tracing::info!(
                    error = first_line(outcome.error().unwrap_or("")),
                    retry_in_ms = due_at - s.end.finished_at,
                    suppressed,
                    "attempt failed; retry scheduled"
                )
            }
        }
        Disposition::DeadLetter { .. } => {}
        Disposition::Release { due_at } => {
            if let Some(suppressed) = ctx.log_gates.admit(target) {
                tracing::info!(
                    reason = first_line(outcome.error().unwrap_or("")),
                    retry_in_ms = due_at - s.end.finished_at,
                    suppressed,
                    "delivery put back without spending an attempt"
                )
            }
        }
    }
}

/// Counts and logs (at most one WARN per `in_flight::EXHAUSTION_LOG_EVERY` for the whole
/// router) an attempt the router's own resources stopped: the entry goes back unattempted.
fn local_exhaustion(ctx: &DeliveryContext, rt: &TargetRuntime, outcome: &AttemptOutcome) {
    if let AttemptOutcome::Deferred {
        local: Some(local),
        reason,
        ..
    } = outcome
    {
        ctx.metrics
            .delivery_local_exhaustion
            .get_or_create(&vec![("cause", local.label().to_string())])
            .inc();
        if let Some(suppressed) = ctx.in_flight.admit_exhaustion_log(ctx.clock.now_ms()) {
            tracing::warn!(
                target_id = %rt.spec.id,
                cause = local.label(),
                error = %reason,
                suppressed,
                "the router ran out of its own resources starting an attempt; the entry waits without spending an attempt (raise the open-file limit or lower delivery.max_in_flight)"
            );
        }
    }
}

/// The request of one attempt on one entry. A webhook or NATS target sends only `body`, so
/// once it is built the leased event's payload is dropped (when the lease alone holds the
/// event): the attempt then holds one copy of a large payload, not two. A handler target
/// reads the event itself and gets no `body`.
fn request_for(rt: &TargetRuntime, leased: &mut Leased) -> DeliveryRequest {
    if matches!(rt.spec.kind, TargetKind::Handler { .. }) {
        return request_with_body(rt, leased, bytes::Bytes::new());
    }
    let replay = leased.entry.replay.as_deref();
    let body = bytes::Bytes::from(leased.event.event.structured_bytes(replay));
    // What is used of the event after this is its attributes (logs, dead letters, fate).
    if let Some(ev) = Arc::get_mut(&mut leased.event) {
        ev.event.data = None;
        ev.event.data_base64 = None;
    }
    request_with_body(rt, leased, body)
}

/// The request of one attempt on one entry, sending `body`.
fn request_with_body(rt: &TargetRuntime, leased: &Leased, body: bytes::Bytes) -> DeliveryRequest {
    // Replayed deliveries say so, so receivers can tell them from live traffic.
    let replay = leased.entry.replay.clone();
    DeliveryRequest {
        body,
        idempotency_key: leased.entry.idempotency_key.clone(),
        event_id: leased.event.event.id.clone(),
        attempt: u32::try_from(leased.entry.attempts.len()).unwrap_or(u32::MAX),
        traceparent: leased.event.event.trace_context().map(str::to_string),
        tracestate: leased.event.event.trace_state().map(str::to_string),
        timeout: rt.spec.policy.timeout,
        event: leased.event.clone(),
        replay,
        rule: leased.entry.rule.clone(),
        target: rt.spec.id.clone(),
        hops: leased.entry.hops,
        batch: None,
    }
}

async fn attempt(
    ctx: Arc<DeliveryContext>,
    rt: Arc<TargetRuntime>,
    target: Arc<dyn Target>,
    mut leased: Leased,
    mut permit: Slot,
    probe: bool,
) {
    let now = ctx.clock.now_ms();
    let settled = match not_sendable(&rt, &leased, now) {
        Some(s) => {
            if probe {
                // The probe was not sent: give the slot back.
                if let Some(mut b) = rt.breaker() {
                    b.record(None, true, now);
                }
            }
            s
        }
        None => {
            let req = request_for(&rt, &mut leased);
            let started = Instant::now();
            let (outcome, effects) = target.deliver_with_effects(&req).await;
            local_exhaustion(&ctx, &rt, &outcome);
            // A delivery put back unattempted is no attempt's latency.
            if !matches!(outcome, AttemptOutcome::Deferred { .. }) {
                ctx.metrics
                    .attempt_seconds
                    .get_or_create(&vec![("target", rt.spec.id.clone())])
                    .observe(started.elapsed().as_secs_f64());
            }
            let finished = ctx.clock.now_ms();
            breaker_record(&ctx, &rt, &outcome, probe, finished).await;
            let held = hold_off(&ctx, &rt, &outcome, finished).await;
            let s = conclude(&rt, &leased, &outcome, effects, finished, held);
            log_settled(&ctx, &rt.spec.id, &outcome, &s);
            s
        }
    };
    // The concurrency slot bounds attempts in flight at the target, which this one no longer
    // is: recording it waits for a commit (one or two group-commit cycles), and holding the slot
    // through that wait capped a target's throughput at `concurrency` per commit cycle. The
    // entry stays leased in the index until the commit lands, so it cannot be leased twice, and
    // its ordering key stays held. Its bytes stay held too: the event is, until recorded.
    let bytes = permit.take_bytes();
    drop(permit);
    crate::failpoint::crash_point("before_ack", &rt.spec.id);
    if let Some(stall) = crate::failpoint::delay_once("before_ack", &rt.spec.id) {
        tokio::time::sleep(stall).await;
    }
    record(&ctx, &rt, &leased, settled).await;
    drop(bytes);
}

/// One entry of a batch request, with its structured event as sent.
pub(super) struct BatchItem {
    leased: Leased,
    json: Vec<u8>,
}

/// Splits leased entries of a batching webhook into requests of at most `max_events` events
/// and `max_bytes` bytes of body (an event larger than that goes alone), in accept order
/// (entry id). Lease order is due-time order, which jitter and retries reshuffle: the same
/// events sent again came in another order, so the batch's `Idempotency-Key` (a digest of
/// its entries in order) changed and the array's events were reordered.
pub(super) fn split_batches(mut leased: Vec<Leased>, batch: &WebhookBatch) -> Vec<Vec<BatchItem>> {
    leased.sort_by_key(|l| l.entry.id);
    let max_events = usize::try_from(batch.max_events)
        .unwrap_or(usize::MAX)
        .max(1);
    // The array's brackets.
    let max_bytes = usize::try_from(batch.max_bytes)
        .unwrap_or(usize::MAX)
        .saturating_sub(2);
    let mut out: Vec<Vec<BatchItem>> = Vec::new();
    let mut bytes = 0usize;
    for leased in leased {
        // Replayed deliveries say so, so receivers can tell them from live traffic.
        let json = leased
            .event
            .event
            .structured_bytes(leased.entry.replay.as_deref());
        // The separating comma.
        let size = json.len() + 1;
        let item = BatchItem { leased, json };
        match out.last_mut() {
            Some(cur) if cur.len() < max_events && bytes.saturating_add(size) <= max_bytes => {
                bytes += size;
                cur.push(item);
            }
            _ => {
                bytes = size;
                out.push(vec![item]);
            }
        }
    }
    out
}

/// The `Idempotency-Key` (and Standard Webhooks `webhook-id`) of a batch request: a digest of
/// its entries' keys, so the same batch sent again carries the same key. Retries of its
/// entries may be batched differently; receivers deduplicate per event by `source` and `id`.
fn batch_key(entries: &[BatchItem]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for item in entries {
        h.update(item.leased.entry.idempotency_key.as_bytes());
        h.update([0]);
    }
    let d = h.finalize();
    let mut key = String::with_capacity(6 + 32);
    key.push_str("batch-");
    for b in &d[..16] {
        use std::fmt::Write as _;
        let _ = write!(key, "{b:02x}");
    }
    key
}

/// One request to a batching webhook carrying every entry of `batch` (one slot, one breaker
/// sample, one rate-limit token). Entries whose attempts or age are used up are not sent but
/// dead-lettered, as in a single attempt; the rest all share the request's outcome, each with
/// its own attempt count, backoff and DLQ fate.
async fn attempt_batch(
    ctx: Arc<DeliveryContext>,
    rt: Arc<TargetRuntime>,
    target: Arc<dyn Target>,
    batch: Vec<BatchItem>,
    mut permit: Slot,
    probe: bool,
) {
    let now = ctx.clock.now_ms();
    let mut settled = Vec::with_capacity(batch.len());
    let mut send = Vec::with_capacity(batch.len());
    for item in batch {
        match not_sendable(&rt, &item.leased, now) {
            Some(s) => settled.push((item.leased, s)),
            None => send.push(item),
        }
    }
    let sent = !send.is_empty();
    if let Some(first) = send.first() {
        let mut body = Vec::with_capacity(send.iter().map(|i| i.json.len() + 1).sum::<usize>() + 2);
        body.push(b'[');
        for (i, item) in send.iter().enumerate() {
            if i > 0 {
                body.push(b',');
            }
            body.extend_from_slice(&item.json);
        }
        body.push(b']');
        let n = u32::try_from(send.len()).unwrap_or(u32::MAX);
        let req = DeliveryRequest {
            body: bytes::Bytes::from(body),
            idempotency_key: batch_key(&send),
            batch: Some(n),
            // Each event of the body carries its own `traceparent`.
            traceparent: None,
            tracestate: None,
            ..request_with_body(&rt, &first.leased, bytes::Bytes::new())
        };
        let started = Instant::now();
        let (outcome, _) = target.deliver_with_effects(&req).await;
        local_exhaustion(&ctx, &rt, &outcome);
        let spec_id = &rt.spec.id;
        ctx.metrics
            .attempt_seconds
            .get_or_create(&vec![("target", spec_id.clone())])
            .observe(started.elapsed().as_secs_f64());
        ctx.metrics
            .delivery_batches
            .get_or_create(&vec![("target", spec_id.clone())])
            .inc();
        ctx.metrics
            .delivery_batch_events
            .get_or_create(&vec![("target", spec_id.clone())])
            .inc_by(u64::from(n));
        let finished = ctx.clock.now_ms();
        // 413 for several events is about the request, not them: each would fit alone, and
        // the whole batch used to go to the DLQ as a permanent error. They go back to the
        // queue unattempted, and this target's batches hold half as many from now on.
        let too_large = matches!(
            outcome,
            AttemptOutcome::Permanent {
                status: Some(413),
                ..
            }
        );
        if too_large && n > 1 {
            let cap = rt.batch_too_large(n);
            tracing::warn!(target_id = %spec_id, events = n, max_events = cap, "the receiver refused a batch as too large (413); its events go back to the queue and batches hold at most {cap} from now on");
            for BatchItem { leased, .. } in &send {
                defer(&ctx, leased, finished, finished).await;
            }
            send.clear();
        }
        if matches!(outcome, AttemptOutcome::Delivered { .. })
            && let Some(cap) = rt.batch_delivered(n)
        {
            tracing::info!(target_id = %spec_id, max_events = cap, "batches were delivered under a lowered size for a while; trying larger batches ({cap} events)");
        }
        breaker_record(&ctx, &rt, &outcome, probe, finished).await;
        let held = hold_off(&ctx, &rt, &outcome, finished).await;
        let mut retried = 0usize;
        for BatchItem { leased, .. } in send {
            let s = conclude(&rt, &leased, &outcome, None, finished, held);
            match s.disposition {
                Disposition::Retry { .. } => retried += 1,
                Disposition::DeadLetter { .. } => {
                    let _g = tracing::info_span!("attempt", event_id = %leased.event.event.id, source = %leased.event.event.source).entered();
                    log_settled(&ctx, &rt.spec.id, &outcome, &s);
                }
                _ => {}
            }
            settled.push((leased, s));
        }
        match &outcome {
            AttemptOutcome::Delivered { status } => {
                tracing::debug!(events = n, status = ?status, "batch delivered")
            }
            o if retried > 0 => tracing::info!(
                events = n,
                retried,
                error = o.error().unwrap_or(""),
                "batch attempt failed; retries scheduled"
            ),
            _ => {}
        }
    }
    if probe && !sent {
        // The probe was not sent: give the slot back.
        if let Some(mut b) = rt.breaker() {
            b.record(None, true, now);
        }
    }
    // The events' bytes are held until their results are recorded.
    let bytes = permit.take_bytes();
    drop(permit);
    crate::failpoint::crash_point("before_ack", &rt.spec.id);
    // Recorded together, so the finishes share a commit.
    futures::future::join_all(settled.into_iter().map(|(leased, s)| {
        let span = tracing::info_span!("record", event_id = %leased.event.event.id, source = %leased.event.event.source);
        let (ctx, rt) = (&ctx, &rt);
        async move { record(ctx, rt, &leased, s).await }.instrument(span)
    }))
    .await;
    drop(bytes);
}

/// Records a settled attempt: the store's finish, then its metrics and, for a new dead
/// letter, `router.dlq.added`. A refused finish ends in a retry or the lease's expiry, never
/// only in a log line.
async fn record(ctx: &Arc<DeliveryContext>, rt: &TargetRuntime, leased: &Leased, s: Settled) {
    let spec = &rt.spec;
    let labels = |result: &str| vec![("target", spec.id.clone()), ("result", result.to_string())];
    let Settled {
        end,
        disposition,
        label: outcome_label,
    } = s;
    let (dlq_reason, held) = match &disposition {
        Disposition::DeadLetter { reason, hold } => (Some(*reason), *hold),
        _ => (None, false),
    };
    let finished_at = end.finished_at;
    let end_error = end.error.clone();
    // The events the handler emitted, by position in the outbox: those that go straight to
    // the DLQ (past the hop limit, out of its scope, failing their contract) and the copies
    // the store sends there (their target's queue at its cap) are dead letters of their own
    // once the finish commits.
    let emitted: Vec<Emitted> = end
        .outbox
        .as_ref()
        .map(|o| {
            o.emitted
                .iter()
                .map(|ne| {
                    let ev = &ne.event;
                    Emitted {
                        id: ev.id.clone(),
                        source: ev.source.clone(),
                        ty: ev.ty.clone(),
                        hops: ev.hops(),
                        quarantine: ne.quarantine.as_ref().map(|q| q.reason),
                        rules: ne.matched_rules.clone(),
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    let finished = if crate::failpoint::fail_once("finish_contended", &spec.id) {
        Err(FinishError::Contended)
    } else {
        ctx.store
            .finish(leased.entry.id, leased.lease, end, disposition, finished_at)
            .await
    };
    match finished {
        Ok(finished) => {
            ctx.metrics
                .deliveries
                .get_or_create(&labels(outcome_label))
                .inc();
            let c = &rt.counters;
            match outcome_label {
                "delivered" => c.delivered.fetch_add(1, Ordering::Relaxed),
                "retried" => c.retried.fetch_add(1, Ordering::Relaxed),
                "deferred" => c.deferred.fetch_add(1, Ordering::Relaxed),
                _ => c.dead_lettered.fetch_add(1, Ordering::Relaxed),
            };
            if let Some(r) = dlq_reason {
                dead_lettered(
                    ctx,
                    Some(&spec.id),
                    DeadEvent::of(&leased.event.event).of_entry(
                        &leased.entry,
                        held,
                        finished.dlq_id,
                    ),
                    r,
                    end_error.as_deref(),
                    finished_at,
                );
            }
            // A re-run's emissions (same ids) are dropped by ingest dedup in the store but
            // counted here again: rare (a crash between handling and acking), and the count
            // is of routing decisions committed.
            ctx.metrics.count_rule_matches(
                emitted
                    .iter()
                    .flat_map(|e| e.rules.iter().map(String::as_str)),
                finished_at,
            );
            let why = format!("emitted by handler target {}", spec.id);
            for e in &emitted {
                if let Some(reason) = e.quarantine {
                    // In the DLQ with no target; announced as about the handler target that
                    // emitted it, so the announcement never goes back to that handler.
                    dead_lettered(
                        ctx,
                        None,
                        DeadEvent {
                            emitted_by: Some(&spec.id),
                            ..e.dead()
                        },
                        reason,
                        Some(&why),
                        finished_at,
                    );
                }
            }
            for (i, target) in &finished.overflowed {
                let Some(e) = emitted.get(*i) else {
                    continue;
                };
                let why = format!("{why}; the queue of {target} is at its depth cap");
                dead_lettered(
                    ctx,
                    Some(target),
                    e.dead(),
                    DlqReason::TargetOverflow,
                    Some(&why),
                    finished_at,
                );
            }
        }
        Err(FinishError::Conflict(key)) => {
            // A concurrent delivery changed a key this invocation's compare-and-set relied on:
            // nothing was written. The handler runs again on fresh data, without spending an
            // attempt: losing a race is contention, not a failure of this delivery (counted,
            // the last attempt's conflict dead-lettered an event the handler had handled).
            ctx.metrics
                .deliveries
                .get_or_create(&labels("conflict"))
                .inc();
            tracing::warn!(key = %key, "handler key-value precondition failed; the delivery runs again");
            finish_without_effects(ctx, leased, finished_at, None, 100).await;
        }
        Err(e @ FinishError::KvQuota { .. }) => {
            // Concurrent deliveries of the handler grew its namespace after this invocation
            // checked the bound: nothing was written. The next run sees the full namespace and
            // fails through the normal retry policy (or fits, if keys expired meanwhile).
            ctx.metrics
                .deliveries
                .get_or_create(&labels("kv_quota"))
                .inc();
            tracing::warn!(error = %e, "handler key-value namespace full at commit; the delivery runs again");
            finish_without_effects(
                ctx,
                leased,
                finished_at,
                Some(format!("{e}; retried")),
                1000,
            )
            .await;
        }
        Err(FinishError::Contended) => {
            // Other deliveries' finishes kept winning the race for shared records (a
            // namespace's usage): the handler did nothing wrong, so the attempt does not
            // count. It runs again shortly, spread out so the racers do not meet again.
            ctx.metrics
                .deliveries
                .get_or_create(&labels("contended"))
                .inc();
            tracing::warn!(
                "the attempt's records kept changing under concurrent finishes; it runs again without counting"
            );
            let delay = 50 + rand::random::<u64>() % 200;
            finish_without_effects(ctx, leased, finished_at, None, delay as i64).await;
        }
        Err(e @ FinishError::TooLarge { .. }) => {
            // The handler's output holds a record the store cannot take in one message: run
            // again, it would write the same, so the delivery is dead-lettered without its
            // output (the attempt's own records fit: the store shortens their error texts).
            let error = format!("{e}; nothing of its output was stored");
            tracing::error!(error = %error, "the attempt's output is too large for the store; dead-lettered without it");
            let end = AttemptEnd {
                finished_at,
                result: AttemptResult::Permanent,
                status: None,
                error: Some(error.clone()),
                outbox: None,
            };
            let reason = DlqReason::PermanentError;
            let held = spec.policy.holds_keys();
            let disposition = Disposition::DeadLetter { reason, hold: held };
            match ctx
                .store
                .finish(leased.entry.id, leased.lease, end, disposition, finished_at)
                .await
            {
                Ok(finished) => {
                    ctx.metrics
                        .deliveries
                        .get_or_create(&labels("dead_lettered"))
                        .inc();
                    rt.counters.dead_lettered.fetch_add(1, Ordering::Relaxed);
                    dead_lettered(
                        ctx,
                        Some(&spec.id),
                        DeadEvent::of(&leased.event.event).of_entry(
                            &leased.entry,
                            held,
                            finished.dlq_id,
                        ),
                        reason,
                        Some(&error),
                        finished_at,
                    );
                }
                Err(e) => {
                    tracing::error!(error = %e, "could not dead-letter the attempt; the entry will be retried when its lease expires");
                }
            }
        }
        Err(FinishError::Fenced) => {
            ctx.metrics
                .deliveries
                .get_or_create(&labels("fenced"))
                .inc();
            tracing::warn!(
                "lease expired before the attempt finished; its result is discarded (another worker owns the entry)"
            );
        }
        Err(e) => {
            // The lease stays recorded; it expires and the entry is attempted again.
            tracing::error!(error = %e, "could not record the attempt; the entry will be retried when its lease expires");
        }
    }
}

/// Records an attempt whose effects the store refused, without its outbox, due again after
/// `delay_ms`: as a retryable attempt with `error` (a compare-and-set conflict, a full
/// key-value namespace), or, with no error, put back without counting it (a finish that lost
/// a race for shared records: the attempt's record is removed).
async fn finish_without_effects(
    ctx: &DeliveryContext,
    leased: &Leased,
    finished_at: i64,
    error: Option<String>,
    delay_ms: i64,
) {
    let due_at = finished_at + delay_ms;
    let (result, disposition) = match error {
        Some(_) => (AttemptResult::Retryable, Disposition::Retry { due_at }),
        None => (AttemptResult::Interrupted, Disposition::Release { due_at }),
    };
    let end = AttemptEnd {
        finished_at,
        result,
        status: None,
        error,
        outbox: None,
    };
    if let Err(e) = ctx
        .store
        .finish(leased.entry.id, leased.lease, end, disposition, finished_at)
        .await
    {
        tracing::error!(error = %e, "could not record the refused commit; the entry returns when its lease expires");
    }
}

/// A breaker transition in the metrics: counted by the state it went to.
pub(super) fn count_transition(ctx: &DeliveryContext, id: &str, t: &Transition) {
    ctx.metrics
        .breaker_transitions
        .get_or_create(&vec![
            ("target", id.to_string()),
            ("to", t.to.name().to_string()),
        ])
        .inc();
    // `router_breaker_state` is set at each scrape from the breakers of the running workers
    // (`admin::metrics`), which also removes the series of a breaker or target a reload took
    // away: a series created here could outlive its breaker at its last value.
}

/// A breaker transition: persisted (so an open breaker stays open across a restart), logged,
/// counted, and raised as a system event that rules can route.
async fn on_transition(ctx: &DeliveryContext, rt: &TargetRuntime, t: Transition, now: i64) {
    let id = &rt.spec.id;
    let to = t.to.name();
    // Under the log gates like attempt lines: one target's transitions are a few a minute,
    // but a thousand failing targets cycling open → half-open made most of the log in a mass
    // outage, past the process-wide ceiling. The metric and the system event count every one.
    if let Some(suppressed) = ctx.log_gates.admit(&format!("breaker:{id}")) {
        match t.to {
            BreakerState::Open { until } => {
                tracing::warn!(target_id = %id, failure_rate = t.failure_rate, requests = t.requests, open_until = %crate::clock::rfc3339(until), suppressed, "circuit breaker opened")
            }
            _ => {
                tracing::info!(target_id = %id, from = t.from.name(), to, suppressed, "circuit breaker state changed")
            }
        }
    }
    count_transition(ctx, id, &t);
    if t.followed {
        // The node whose breaker this one followed persisted and announced its own cycle;
        // writing this one's half-open or close over its record, or raising the same
        // transition once per node, would only mislead the other nodes and the alert routes.
        return;
    }
    if persists(&t, ctx.store.shared()) {
        let state = serde_json::to_value(rt.persisted()).unwrap_or_default();
        if let Err(e) = ctx.store.put_target_state(id, state).await {
            tracing::error!(target_id = %id, error = %e, "could not persist the breaker state");
        }
    }
    let ty = match t.to {
        BreakerState::Open { .. } => "router.breaker.opened",
        BreakerState::HalfOpen => "router.breaker.half_opened",
        BreakerState::Closed => "router.breaker.closed",
    };
    let mut ev = system_event(ty, id, now);
    ev.data = Some(crate::event::Data::from(serde_json::json!({
        "target": id,
        "from": t.from.name(),
        "to": to,
        "failure_rate": t.failure_rate,
        "window_requests": t.requests,
        "open_until": match t.to { BreakerState::Open { until } => Some(crate::clock::rfc3339(until)), _ => None },
    })));
    raise(ctx, ev);
}

/// Whether breaker transition `t` (not followed) is written into the target's record. On a
/// store several nodes share, a half-open is not: the record is every node's, and a node with
/// no traffic half-opening after another node's probe had closed the breaker wrote half-open
/// over that close, so it never saw the close to follow, and nodes restarted later restored
/// half-open. The open before it, kept in the record, reads as half-open once its time is
/// past, for a node that restores it.
fn persists(t: &Transition, shared: bool) -> bool {
    !(shared && t.to == BreakerState::HalfOpen)
}

/// Hands a system event to the router that routes them. Bounded and best-effort: a full
/// channel means an alert storm is already under way, and the event is counted as dropped
/// (a `router.dlq.added` is announced later in its target's summary).
fn raise(ctx: &DeliveryContext, ev: CloudEvent) {
    if let Some(tx) = &ctx.system_events
        && let Err(e) = tx.try_send(ev)
    {
        crate::system_events::dropped(ctx, &e.into_inner(), "the routing channel is full");
    }
}

/// An emitted event of a handler's outbox, as its dead letters name it.
struct Emitted {
    id: String,
    source: String,
    ty: String,
    hops: u32,
    quarantine: Option<DlqReason>,
    /// The rules that routed it (counted once the finish commits).
    rules: Vec<String>,
}

impl Emitted {
    fn dead(&self) -> DeadEvent<'_> {
        DeadEvent {
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
}

/// The event a new DLQ entry holds, as its `router.dlq.added` names it.
#[derive(Debug, Clone, Copy)]
pub struct DeadEvent<'a> {
    /// Its `id`.
    pub id: &'a str,
    /// Its `source`.
    pub source: &'a str,
    /// Its `type`.
    pub ty: &'a str,
    /// Its handler hops: the announcement carries one more (see [`dead_lettered`]).
    pub hops: u32,
    /// The handler target that emitted it, for an emission that went to the DLQ before any
    /// target of its own (past the hop limit, out of scope, failing its contract): the
    /// announcement is about that target.
    pub emitted_by: Option<&'a str>,
    /// The dead copy's ordering key, on an ordered target.
    pub ordering_key: Option<&'a str>,
    /// Whether this dead letter holds its ordering key (`on_dead_letter: hold`): the key's
    /// later events wait until an operator releases it or redrives this dead letter.
    pub key_held: bool,
    /// The id of its DLQ entry, where the store answered it (not for copies refused at
    /// acceptance).
    pub dlq_id: Option<u64>,
}

impl<'a> DeadEvent<'a> {
    /// `ev` as its dead letter names it.
    pub fn of(ev: &'a CloudEvent) -> Self {
        Self {
            id: &ev.id,
            source: &ev.source,
            ty: &ev.ty,
            hops: ev.hops(),
            emitted_by: None,
            ordering_key: None,
            key_held: false,
            dlq_id: None,
        }
    }

    /// With the leased entry's ordering key, whether `disposition` holds it, and the DLQ
    /// entry the finish made.
    pub fn of_entry(
        self,
        entry: &'a crate::store::QueueEntry,
        disposition_held: bool,
        dlq_id: Option<u64>,
    ) -> Self {
        Self {
            ordering_key: entry.ordering_key.as_deref(),
            key_held: disposition_held && entry.ordering_key.is_some(),
            dlq_id,
            ..self
        }
    }
}

/// A new DLQ entry of `event`, for `target` (`None`: an event quarantined before any target):
/// counted in `router_dlq_entries_total` and raised as `router.dlq.added` (rate-limited where
/// it is routed). Events that are themselves system events raise none, so an alert path that
/// fails cannot feed itself.
///
/// The announcement is about `target`, or else the handler target that emitted the event
/// (it is never routed to the target it is about), and its `hops` are the event's plus one:
/// an alert that a handler turns into an event which fails again (webhook A fails →
/// `router.dlq.added` → handler B emits `ops.page` → A fails → …) climbs a hop per turn, so
/// the hop limit ends it (`loop_detected`) where it used to start again at 0 every time.
pub fn dead_lettered(
    ctx: &DeliveryContext,
    target: Option<&str>,
    event: DeadEvent<'_>,
    reason: DlqReason,
    error: Option<&str>,
    now: i64,
) {
    let DeadEvent {
        id,
        source,
        ty,
        hops,
        emitted_by,
        ordering_key,
        key_held,
        dlq_id,
    } = event;
    count_dead_letters(&ctx.metrics, target, reason, 1);
    // Every path into the DLQ (an attempt, max_age before one, the depth cap at acceptance,
    // a quarantine, a handler's emission) says so once it is there, with the event.
    let gate = target.unwrap_or("none");
    if let Some(suppressed) = ctx.log_gates.admit(&format!("dlq:{gate}")) {
        tracing::warn!(
            event_id = id,
            source,
            target_id = gate,
            emitted_by,
            reason = reason.as_str(),
            error = error.and_then(|e| e.lines().next()).unwrap_or(""),
            suppressed,
            "moved to the DLQ"
        );
    }
    if ty.starts_with("router.") {
        return;
    }
    let about = target.or(emitted_by);
    let mut sys = system_event(
        crate::system_events::DLQ_ADDED,
        about.unwrap_or("none"),
        now,
    );
    if about.is_none() {
        sys.subject = None;
        sys.source = "router://ingest".into();
    }
    sys.extensions.insert(
        "hops".into(),
        serde_json::Value::from(hops.saturating_add(1)),
    );
    let mut data = serde_json::json!({
        "target": target,
        "reason": reason.as_str(),
        "event": { "id": id, "source": source, "type": ty },
        "error": error,
        "ordering_key": ordering_key,
        "key_held": key_held,
        // A string, as the DLQ API writes entry ids (`GET /v1/dlq/{id}`).
        "dlq_id": dlq_id.map(|i| i.to_string()),
    });
    if let Some(by) = emitted_by {
        data["emitted_by"] = serde_json::Value::from(by);
    }
    sys.data = Some(crate::event::Data::from(data));
    raise(ctx, sys);
}

/// Counts `n` entries of `target` dead-lettered at once with `reason` (a removed target's
/// queue, moved whole) and raises one `router.dlq.added` for them all, its data saying how
/// many (`count`) rather than naming one event.
pub fn dead_lettered_in_bulk(
    ctx: &DeliveryContext,
    target: &str,
    reason: DlqReason,
    n: u64,
    error: &str,
    now: i64,
) {
    if n == 0 {
        return;
    }
    count_dead_letters(&ctx.metrics, Some(target), reason, n);
    tracing::warn!(
        target_id = target,
        reason = reason.as_str(),
        entries = n,
        error,
        "moved to the DLQ"
    );
    let mut sys = system_event(crate::system_events::DLQ_ADDED, target, now);
    sys.data = Some(crate::event::Data::from(serde_json::json!({
        "target": target,
        "reason": reason.as_str(),
        "count": n,
        "error": error,
    })));
    raise(ctx, sys);
}

/// Counts `n` new DLQ entries of `target` (`None`: no target) with `reason`.
pub fn count_dead_letters(
    metrics: &crate::telemetry::Metrics,
    target: Option<&str>,
    reason: DlqReason,
    n: u64,
) {
    metrics
        .dlq_entries
        .get_or_create(&vec![
            ("target", target.unwrap_or("none").to_owned()),
            ("reason", reason.as_str().to_owned()),
        ])
        .inc_by(n);
}

/// A router-generated CloudEvent about `target`.
pub fn system_event(ty: &str, target: &str, now: i64) -> CloudEvent {
    CloudEvent {
        id: format!("{ty}:{target}:{now}:{:08x}", rand::random::<u32>()),
        source: format!("router://targets/{target}"),
        ty: ty.to_string(),
        subject: Some(target.to_string()),
        time: Some(crate::clock::rfc3339(now)),
        datacontenttype: Some("application/json".into()),
        dataschema: None,
        data: None,
        data_base64: None,
        extensions: serde_json::Map::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a shared store a Retry-After pause is written into the target's stored state and
    /// nothing else of this node's: another node's open breaker in the record stays, and a
    /// longer pause already there is kept.
    #[test]
    fn a_retry_after_on_a_shared_store_keeps_the_rest_of_the_record() {
        let open = BreakerState::Open { until: 50_000 };
        let stored = crate::deliver::PersistedState {
            breaker: Some((open, 1_000)),
            paused: false,
            retry_after_until: Some(9_000),
            retry_after_since: Some(500),
        };
        let states = vec![
            ("other".to_string(), serde_json::json!({})),
            (
                "t".to_string(),
                serde_json::to_value(&stored).expect("json"),
            ),
        ];
        let s = with_retry_after(&states, "t", 20_000, 2_000);
        assert_eq!(s.breaker, Some((open, 1_000)));
        assert_eq!(
            (s.retry_after_until, s.retry_after_since),
            (Some(20_000), Some(2_000))
        );
        let shorter = with_retry_after(&states, "t", 5_000, 2_000);
        assert_eq!(
            (shorter.retry_after_until, shorter.retry_after_since),
            (Some(9_000), Some(500))
        );
        let fresh = with_retry_after(&states, "new", 7_000, 2_000);
        assert_eq!(
            (fresh.breaker, fresh.retry_after_until),
            (None, Some(7_000))
        );
        // An operator's lift removes a pause set before it, and keeps the rest.
        let lifted = without_retry_after(&states, "t", 600);
        assert_eq!(
            (lifted.breaker, lifted.retry_after_until),
            (Some((open, 1_000)), None)
        );
        let kept = without_retry_after(&states, "t", 400);
        assert_eq!(kept.retry_after_until, Some(9_000), "set after the lift");
    }

    /// On a shared store a half-open is not written into the target's record (it wrote over
    /// another node's close); opens and closes are, and everything on a store of one node.
    #[test]
    fn a_half_open_is_not_stored_over_the_other_nodes_record() {
        let t = |from, to| Transition {
            from,
            to,
            failure_rate: 0.0,
            requests: 0,
            followed: false,
        };
        let open = BreakerState::Open { until: 10 };
        let half = t(open, BreakerState::HalfOpen);
        assert!(!persists(&half, true));
        assert!(persists(&half, false));
        assert!(persists(&t(BreakerState::Closed, open), true));
        assert!(persists(
            &t(BreakerState::HalfOpen, BreakerState::Closed),
            true
        ));
    }

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 3,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(1),
            max_age: Duration::from_secs(60),
            ..RetryPolicy::default()
        }
    }

    fn transient(retry_after: Option<Duration>) -> AttemptOutcome {
        AttemptOutcome::Retryable {
            error: "HTTP 500".into(),
            status: Some(500),
            retry_after,
        }
    }

    fn dead(reason: DlqReason) -> Disposition {
        Disposition::DeadLetter {
            reason,
            hold: false,
        }
    }

    /// Runs the state machine against a target that always times out, on a virtual clock, with
    /// the largest jitter draw: the time to the DLQ and the attempt count must equal what
    /// `router config explain` prints (`PolicyConfig::worst_case`).
    fn simulate(p: &crate::policy::PolicyConfig) -> (u32, i64) {
        let mut now = 0i64;
        let mut n = 1;
        loop {
            now += ms(p.timeout);
            let timeout = AttemptOutcome::Retryable {
                error: "timeout".into(),
                status: None,
                retry_after: None,
            };
            match decide(&timeout, n, 0, now, &p.retry, 1.0, false) {
                Disposition::Retry { due_at } => {
                    now = due_at;
                    n += 1;
                }
                Disposition::DeadLetter { .. } => return (n, now),
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    #[test]
    fn handler_targets_get_more_slots_unless_their_policy_says() {
        use crate::policy::config::{PolicyConfig, ThrottlePolicy};
        use crate::rules::TargetSpec;
        let cfg = crate::config::DeliveryConfig::default();
        let spec = |kind, max_concurrency: Option<u32>| TargetSpec {
            id: "t".into(),
            rule: "r".into(),
            kind,
            policy_name: None,
            policy: PolicyConfig {
                throttle: max_concurrency.map(|c| ThrottlePolicy {
                    max_concurrency: Some(c),
                    ..ThrottlePolicy::default()
                }),
                ..PolicyConfig::default()
            },
        };
        let webhook = || TargetKind::Webhook {
            url: "http://127.0.0.1:1/".into(),
            headers: Default::default(),
            secret_env: None,
            headers_env: Default::default(),
            batch: None,
        };
        let handler = || TargetKind::Handler { name: "h".into() };
        assert_eq!(slot_count(&spec(webhook(), None), &cfg), cfg.concurrency);
        assert_eq!(
            slot_count(&spec(handler(), None), &cfg),
            cfg.handler_concurrency
        );
        assert!(cfg.handler_concurrency > cfg.concurrency);
        assert_eq!(slot_count(&spec(handler(), Some(3)), &cfg), 3);
        assert_eq!(slot_count(&spec(webhook(), Some(0)), &cfg), 1);
    }

    #[test]
    fn config_explain_matches_a_simulated_run() {
        use crate::policy::PolicyConfig;
        let mut p = PolicyConfig {
            timeout: Duration::from_secs(2),
            ..PolicyConfig::default()
        };
        p.retry.max_attempts = 6;
        p.retry.base_delay = Duration::from_millis(200);
        p.retry.max_delay = Duration::from_secs(30);
        p.retry.max_age = Duration::from_secs(24 * 3600);
        let (attempts, time) = p.worst_case();
        assert_eq!(simulate(&p), (attempts, ms(time)));
        // With max_age binding, the simulated run ends no later than the bound.
        p.retry.max_attempts = 50;
        p.retry.max_age = Duration::from_secs(120);
        let (_, bound) = p.worst_case();
        let (_, t) = simulate(&p);
        assert!(t <= ms(bound), "{t} > {bound:?}");
    }

    /// `max_age` is checked when a retry is scheduled, not when an attempt ends: the last
    /// attempt can start just inside it and run its whole timeout. `config explain` printed
    /// `max_age` (5 s) for an event that reached the DLQ at 7 s.
    #[test]
    fn config_explain_counts_the_last_attempts_timeout_past_max_age() {
        use crate::policy::{Jitter, PolicyConfig};
        let mut p = PolicyConfig {
            timeout: Duration::from_secs(3),
            ..PolicyConfig::default()
        };
        p.retry.max_attempts = 5;
        p.retry.base_delay = Duration::from_secs(1);
        p.retry.max_delay = Duration::from_secs(2);
        p.retry.max_age = Duration::from_secs(5);
        p.retry.jitter = Jitter::None;
        let (attempts, bound) = p.worst_case();
        let (n, t) = simulate(&p);
        // Attempts at 0-3 s and 4-7 s; the next would be due at 9 s, past max_age.
        assert_eq!((n, t), (2, 7_000));
        assert!(n <= attempts && t <= ms(bound), "{t} ms > {bound:?}");
        assert_eq!(bound, Duration::from_secs(8), "max_age + timeout");
        // A retry due at max_age exactly is still sent: 0-3 s, then 4-7 s (due at 4 s ≤ 5 s)…
        // with max_age 4 s, the second attempt is due at max_age itself and runs to 7 s.
        p.retry.max_age = Duration::from_secs(4);
        let (n, t) = simulate(&p);
        assert_eq!((n, t), (2, 7_000));
        let (attempts, bound) = p.worst_case();
        assert!(
            n <= attempts && t <= ms(bound),
            "{n}/{attempts}, {t} ms > {bound:?}"
        );
    }

    #[test]
    fn delivered_and_permanent_are_final() {
        let p = policy();
        assert_eq!(
            decide(
                &AttemptOutcome::Delivered { status: Some(200) },
                1,
                0,
                0,
                &p,
                0.5,
                false
            ),
            Disposition::Delivered
        );
        let perm = AttemptOutcome::Permanent {
            error: "HTTP 400".into(),
            status: Some(400),
        };
        assert_eq!(
            decide(&perm, 1, 0, 0, &p, 0.5, false),
            dead(DlqReason::PermanentError)
        );
        assert_eq!(
            decide(&perm, 1, 0, 0, &p, 0.5, true),
            Disposition::DeadLetter {
                reason: DlqReason::PermanentError,
                hold: true
            }
        );
    }

    #[test]
    fn a_deferred_attempt_waits_without_spending_one_even_at_the_last() {
        let p = policy();
        let busy = AttemptOutcome::Deferred {
            reason: "handler_busy".into(),
            retry_after: Duration::from_secs(1),
            local: None,
        };
        assert!(!busy.counts_for_breaker());
        // Past max_attempts a failure would dead-letter; a deferral only waits.
        assert_eq!(
            decide(&busy, p.max_attempts + 5, 0, 1000, &p, 0.5, false),
            Disposition::Release { due_at: 2000 }
        );
    }

    #[test]
    fn transient_failures_retry_until_max_attempts() {
        let p = policy();
        assert!(matches!(
            decide(&transient(None), 1, 0, 0, &p, 0.5, false),
            Disposition::Retry { .. }
        ));
        assert!(matches!(
            decide(&transient(None), 2, 0, 0, &p, 0.5, false),
            Disposition::Retry { .. }
        ));
        assert_eq!(
            decide(&transient(None), 3, 0, 0, &p, 0.5, false),
            dead(DlqReason::RetriesExhausted)
        );
    }

    #[test]
    fn retry_after_is_honoured_up_to_its_cap_and_max_age_wins() {
        let mut p = policy();
        p.retry_after_max = Duration::from_secs(10);
        assert_eq!(
            decide(
                &transient(Some(Duration::from_secs(5))),
                1,
                0,
                0,
                &p,
                0.5,
                false
            ),
            Disposition::Retry { due_at: 5000 }
        );
        assert_eq!(
            decide(
                &transient(Some(Duration::from_secs(50))),
                1,
                0,
                0,
                &p,
                0.5,
                false
            ),
            Disposition::Retry { due_at: 10_000 }
        );
        // Retry-After: 0 does not undo the backoff.
        assert_eq!(
            decide(&transient(Some(Duration::ZERO)), 1, 0, 0, &p, 0.5, false),
            decide(&transient(None), 1, 0, 0, &p, 0.5, false),
        );
        assert!(matches!(
            decide(&transient(Some(Duration::ZERO)), 1, 0, 0, &p, 0.5, false),
            Disposition::Retry { due_at } if due_at > 0
        ));
        // accepted at 0, max_age 60s: a retry due after 60s is a max_age_exceeded.
        assert_eq!(
            decide(
                &transient(Some(Duration::from_secs(5))),
                1,
                0,
                58_000,
                &p,
                0.5,
                false
            ),
            dead(DlqReason::MaxAgeExceeded)
        );
    }

    /// A leased entry of event `n` whose data is `pad` bytes of text.
    fn leased(n: u64, pad: usize) -> Leased {
        let event: CloudEvent = serde_json::from_value(serde_json::json!({
            "specversion": "1.0", "id": format!("e-{n}"), "source": "/t", "type": "t",
            "data": {"pad": "x".repeat(pad)}
        }))
        .expect("event");
        let target = crate::store::NewEntry {
            target_id: "bulk".into(),
            rule: "r".into(),
            ordering_key: None,
            max_depth: None,
            lease_ms: None,
            hold_key: false,
        };
        let id = crate::store::EntryId { event: n, idx: 0 };
        Leased {
            entry: crate::store::QueueEntry::queued(id, target, format!("key-{n}"), 0, 0, 0),
            event: Arc::new(crate::store::StoredEvent {
                seq: n,
                event,
                accepted_at: 0,
                ruleset_version: String::new(),
                matched_rules: Vec::new(),
                quarantined: false,
            }),
            lease: crate::store::Lease { token: n, until: 0 },
        }
    }

    fn ids(batches: &[Vec<BatchItem>]) -> Vec<Vec<u64>> {
        batches
            .iter()
            .map(|b| b.iter().map(|i| i.leased.entry.id.event).collect())
            .collect()
    }

    #[test]
    fn a_batch_window_sends_full_batches_and_holds_the_rest_until_it_passes() {
        let w = Duration::from_millis(20);
        let gate = |due, oldest, now| window_gate(w, due, 100, oldest, now);
        // Less than a batch, the oldest due 5 ms ago: 15 ms more.
        assert_eq!(
            gate(3, Some(1_000), 1_005),
            WindowGate::Wait(Duration::from_millis(15))
        );
        // Full batches go at once; the rest waits for more.
        assert_eq!(gate(100, Some(1_000), 1_005), WindowGate::Full(1));
        assert_eq!(gate(250, Some(1_000), 1_005), WindowGate::Full(2));
        // The window has passed (exactly, or long ago: a retry due since yesterday).
        assert_eq!(gate(3, Some(1_000), 1_020), WindowGate::All);
        assert_eq!(gate(250, Some(0), 86_400_000), WindowGate::All);
        // Nothing known to be due (the index changed meanwhile): no reason to wait.
        assert_eq!(gate(3, None, 1_005), WindowGate::All);
        // No window: the behaviour before windows existed.
        assert_eq!(
            window_gate(Duration::ZERO, 1, 100, Some(1_000), 1_000),
            WindowGate::All
        );
        // A window longer than the loop's idle wait waits at most that long per turn.
        assert_eq!(
            window_gate(Duration::from_secs(60), 1, 100, Some(1_000), 1_000),
            WindowGate::Wait(wait_ms(IDLE_MS))
        );
    }

    /// The runtime of webhook target `id` (to a closed port) under the default policy.
    pub(super) fn webhook_runtime(id: &str) -> TargetRuntime {
        let spec = crate::rules::TargetSpec {
            id: id.into(),
            rule: "r".into(),
            kind: crate::rules::TargetKind::Webhook {
                url: "http://127.0.0.1:9/".into(),
                headers: Default::default(),
                secret_env: None,
                headers_env: Default::default(),
                batch: None,
            },
            policy_name: None,
            policy: crate::policy::config::PolicyConfig::default(),
        };
        TargetRuntime::new(spec, None, 0)
    }

    /// A handler target's runtime under `retry`.
    fn handler_runtime(retry: RetryPolicy) -> TargetRuntime {
        let spec = crate::rules::TargetSpec {
            id: "t".into(),
            rule: "r".into(),
            kind: crate::rules::TargetKind::Handler { name: "h".into() },
            policy_name: None,
            policy: crate::policy::config::PolicyConfig {
                retry,
                ..crate::policy::config::PolicyConfig::default()
            },
        };
        TargetRuntime::new(spec, None, 0)
    }

    /// A webhook attempt holds its payload once: in the body it sends, the leased event
    /// keeping only its attributes (when the lease alone holds it). A handler attempt reads the
    /// event and gets no body. Both used to hold the payload twice.
    #[test]
    fn an_attempt_holds_one_copy_of_its_payload() {
        let webhook = webhook_runtime("t");
        let mut one = leased(1, 10_000);
        let sent = one.event.event.structured_bytes(None);
        let req = request_for(&webhook, &mut one);
        assert_eq!(
            req.body.as_ref(),
            sent.as_slice(),
            "the body is the whole event"
        );
        assert!(
            one.event.event.data.is_none(),
            "the payload is in the body only"
        );
        assert_eq!(req.event.event.id, "e-1", "the attributes stay");
        assert_eq!(one.event.event.payload_len(), 0);
        // Shared (a handoff's event is ingest's too): left as it is.
        let mut shared = leased(2, 10_000);
        let other = shared.event.clone();
        let req = request_for(&webhook, &mut shared);
        assert!(req.event.event.data.is_some() && other.event.data.is_some());
        // A handler reads the event; no body is built for it.
        let mut h = leased(3, 10_000);
        let req = request_for(&handler_runtime(policy()), &mut h);
        assert!(req.body.is_empty());
        assert!(req.event.event.payload_len() > 10_000);
    }

    /// A Retry-After past max_age dead-letters at once: the entry's error names the wait and
    /// the bound, not only the receiver's answer.
    #[test]
    fn a_retry_after_past_max_age_says_so_in_the_dead_letters_error() {
        let rt = handler_runtime(RetryPolicy {
            max_age: Duration::from_secs(60),
            ..RetryPolicy::default()
        });
        let answer = AttemptOutcome::Retryable {
            error: "HTTP 503: busy".into(),
            status: Some(503),
            retry_after: Some(Duration::from_secs(900)),
        };
        let one = leased(1, 0);
        let s = conclude(&rt, &one, &answer, None, 5, true);
        assert!(matches!(
            s.disposition,
            Disposition::DeadLetter {
                reason: DlqReason::MaxAgeExceeded,
                ..
            }
        ));
        assert_eq!(
            s.end.error.as_deref(),
            Some(
                "HTTP 503: busy; not retried: the receiver's Retry-After (15m) would pass max_age 1m"
            )
        );
        // Past retry_after_max (default 1h), the cap is named too.
        let long = AttemptOutcome::Retryable {
            error: "HTTP 429".into(),
            status: Some(429),
            retry_after: Some(Duration::from_secs(7200)),
        };
        assert_eq!(
            not_retried_past_max_age(&long, &rt.spec.policy.retry).as_deref(),
            Some(
                "not retried: the receiver's Retry-After (2h, capped at retry_after_max 1h) would pass max_age 1m"
            )
        );
        // A handler's own retry delay is no receiver's Retry-After: said as what it is.
        let handler = AttemptOutcome::Retryable {
            error: "handler asked to retry: later".into(),
            status: None,
            retry_after: Some(Duration::from_secs(7200)),
        };
        assert_eq!(
            not_retried_past_max_age(&handler, &rt.spec.policy.retry).as_deref(),
            Some(
                "not retried: the retry delay the handler asked for (2h, capped at retry_after_max 1h) would pass max_age 1m"
            )
        );
        // A retry that stays within max_age keeps the answer as its error.
        let short = AttemptOutcome::Retryable {
            error: "HTTP 503: busy".into(),
            status: Some(503),
            retry_after: Some(Duration::from_secs(5)),
        };
        let s = conclude(&rt, &one, &short, None, 5, false);
        assert!(matches!(s.disposition, Disposition::Retry { .. }));
        assert_eq!(s.end.error.as_deref(), Some("HTTP 503: busy"));
    }

    /// The entry that got a 429 or 503 with Retry-After waits for it itself only when the
    /// target's hold could not be kept; held, it is due after its backoff (the hold keeps it
    /// back until then, and a resume that lifts the hold lets it go with the rest).
    #[test]
    fn an_entry_the_target_s_hold_covers_is_due_after_its_backoff_not_the_retry_after() {
        let rt = handler_runtime(RetryPolicy {
            max_age: Duration::from_secs(86_400),
            max_delay: Duration::from_secs(10),
            ..RetryPolicy::default()
        });
        let answer = AttemptOutcome::Retryable {
            error: "HTTP 429".into(),
            status: Some(429),
            retry_after: Some(Duration::from_secs(600)),
        };
        let one = leased(1, 0);
        let due = |held| match conclude(&rt, &one, &answer, None, 1_000, held).disposition {
            Disposition::Retry { due_at } => due_at,
            other => panic!("{other:?}"),
        };
        for _ in 0..20 {
            assert!(due(true) <= 11_000, "backoff is at most max_delay");
            assert_eq!(
                due(false),
                601_000,
                "the entry waits the Retry-After itself"
            );
        }
    }

    #[test]
    fn only_a_429_or_503_with_retry_after_holds_off_the_target() {
        let mut retry = policy();
        retry.retry_after_max = Duration::from_secs(60);
        let answer = |status, ra: Option<u64>| AttemptOutcome::Retryable {
            error: "x".into(),
            status,
            retry_after: ra.map(Duration::from_secs),
        };
        assert_eq!(
            retry_after_pause(&answer(Some(429), Some(30)), &retry, 1_000),
            Some(31_000)
        );
        assert_eq!(
            retry_after_pause(&answer(Some(503), Some(3600)), &retry, 1_000),
            Some(61_000),
            "capped by retry_after_max"
        );
        for o in [
            answer(Some(429), None),
            answer(Some(429), Some(0)),
            answer(Some(500), Some(30)),
            // A handler's retry with a delay is about its event.
            answer(None, Some(30)),
            AttemptOutcome::Delivered { status: Some(200) },
        ] {
            assert_eq!(retry_after_pause(&o, &retry, 1_000), None, "{o:?}");
        }
    }

    #[test]
    fn batches_split_by_count_and_by_bytes_in_accept_order() {
        let by_count = WebhookBatch {
            max_events: 3,
            max_bytes: WebhookBatch::DEFAULT_MAX_BYTES,
            window: Duration::ZERO,
        };
        let b = split_batches((0..7).map(|n| leased(n, 10)).collect(), &by_count);
        assert_eq!(ids(&b), vec![vec![0, 1, 2], vec![3, 4, 5], vec![6]]);

        // Each event is ~1.1 KB: two fit in 3 KiB with the brackets and commas, three do not;
        // an event larger than the limit goes alone, and does not share the next request.
        let by_bytes = WebhookBatch {
            max_events: 100,
            max_bytes: 3072,
            window: Duration::ZERO,
        };
        let entries: Vec<Leased> = (0..6)
            .map(|n| leased(n, if n == 2 { 5000 } else { 1000 }))
            .collect();
        let b = split_batches(entries, &by_bytes);
        assert_eq!(ids(&b), vec![vec![0, 1], vec![2], vec![3, 4], vec![5]]);
        for batch in &b {
            let body: usize = batch.iter().map(|i| i.json.len() + 1).sum::<usize>() + 1;
            assert!(batch.len() == 1 || body <= 3072, "{body} bytes");
        }
        // What is sent is each event's structured JSON.
        let first = &b[0][0];
        assert_eq!(first.json, first.leased.event.event.structured_bytes(None),);
    }

    #[test]
    fn a_batch_key_follows_its_entries_not_their_lease_order() {
        let batch = |ns: &[u64]| -> Vec<BatchItem> {
            split_batches(
                ns.iter().map(|&n| leased(n, 1)).collect(),
                &WebhookBatch {
                    max_events: 100,
                    max_bytes: WebhookBatch::DEFAULT_MAX_BYTES,
                    window: Duration::ZERO,
                },
            )
            .remove(0)
        };
        let k = batch_key(&batch(&[1, 2, 3]));
        assert!(k.starts_with("batch-") && k.len() == 6 + 32, "{k}");
        assert_eq!(k, batch_key(&batch(&[1, 2, 3])), "stable when sent again");
        assert_ne!(k, batch_key(&batch(&[1, 2])));
        // Leased in another order (retries due at jittered times): the same request, the same
        // key, the events in the same order in the array.
        let again = batch(&[3, 1, 2]);
        assert_eq!(k, batch_key(&again));
        assert_eq!(
            again
                .iter()
                .map(|i| i.leased.entry.id.event)
                .collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
    }
}

#[cfg(test)]
mod unreadable_tests {
    use super::*;
    use crate::store::{AcceptOutcome, DlqFilter, RedbStore, Store as _};

    /// A target that takes every event.
    struct Takes;

    impl Target for Takes {
        fn deliver<'a>(
            &'a self,
            _req: &'a DeliveryRequest,
        ) -> futures::future::BoxFuture<'a, AttemptOutcome> {
            Box::pin(async { AttemptOutcome::Delivered { status: Some(200) } })
        }
    }

    /// Breaker transition lines pass the log gates: a mass outage's thousand targets opening
    /// at once log at most the process-wide ceiling's burst, not a line each (the metric
    /// counts every transition).
    #[tokio::test(flavor = "current_thread")]
    async fn breaker_transition_lines_are_under_the_log_ceiling() {
        let dir = tempfile::tempdir().expect("tempdir");
        let app = crate::app::test_app(
            crate::app::test_config(dir.path()),
            RedbStore::in_memory().expect("store"),
            None,
        );
        let ctx = app.dispatcher.context().clone();
        let (log, _logging) = crate::telemetry::test_log::capture();
        let targets = 1000;
        for i in 0..targets {
            let rt = super::tests::webhook_runtime(&format!("c{i}"));
            // Followed from another node: counted and logged only (nothing persisted or
            // raised), which is all this test looks at.
            let t = Transition {
                from: BreakerState::Closed,
                to: BreakerState::Open { until: 60_000 },
                failure_rate: 1.0,
                requests: 20,
                followed: true,
            };
            on_transition(&ctx, &rt, t, 0).await;
        }
        let text = log.text();
        let logged = text.matches("circuit breaker opened").count();
        assert!(logged > 0, "{text}");
        // The ceiling's burst, and what it refills while the loop runs (a slow machine: at
        // most a few seconds at its rate).
        assert!(
            logged < targets / 2,
            "{logged} of {targets} transitions logged"
        );
        let counted: f64 = (0..targets)
            .map(|i| {
                ctx.metrics
                    .breaker_transitions
                    .get_or_create(&vec![
                        ("target", format!("c{i}")),
                        ("to", "open".to_string()),
                    ])
                    .get() as f64
            })
            .sum();
        assert_eq!(
            counted, targets as f64,
            "the metric counts every transition"
        );
    }

    /// A worker whose target has due entries leases nothing while the global pool
    /// (`delivery.max_in_flight`) has no free permit: the entry stays queued, unleased, with
    /// no attempt recorded, and the wait is counted. Once a permit comes back it is leased
    /// and attempted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_entry_is_leased_without_a_global_permit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = crate::app::test_config(dir.path());
        cfg.delivery.max_in_flight = Some(1);
        let store = RedbStore::in_memory().expect("store");
        let app = crate::app::test_app(cfg, store.clone(), None);
        let ctx = app.dispatcher.context().clone();
        assert_eq!(ctx.in_flight.max(), 1);
        // Another target's attempt holds the only permit.
        let other = Arc::new(super::super::in_flight::Share::default());
        let held = ctx.in_flight.try_acquire(&other).expect("the one permit");
        let now = ctx.clock.now_ms();
        store
            .accept(vec![crate::store::test_events::new_event(
                "/s",
                "1",
                &["hook"],
                now,
            )])
            .await
            .expect("accept");
        let spec = app.rules.load().targets["hook"].clone();
        app.dispatcher.ensure(spec).await.expect("worker");
        tokio::time::sleep(Duration::from_millis(500)).await;
        let stats = store.queue_stats();
        assert_eq!(
            (stats["hook"].queued, stats["hook"].in_flight),
            (1, 0),
            "waits unleased: {stats:?}"
        );
        assert!(ctx.metrics.delivery_permit_waits.get() >= 1);
        assert_eq!(ctx.in_flight.in_flight(), 1);
        let attempted = || {
            ["retried", "delivered", "dead_lettered"].iter().any(|r| {
                ctx.metrics
                    .deliveries
                    .get_or_create(&vec![
                        ("target", "hook".to_string()),
                        ("result", r.to_string()),
                    ])
                    .get()
                    > 0
            })
        };
        assert!(!attempted(), "no attempt while waiting");
        drop(held);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !attempted() {
            assert!(Instant::now() < deadline, "attempted once a permit is free");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(ctx.in_flight.in_flight() <= 1);
    }

    /// One event whose stored record does not decode: its delivery goes to the DLQ as
    /// `corrupt_record` (nothing sent, the reason naming the event's sequence number), is
    /// counted and shown in `/v1/status`, and the rest of the lease is delivered. The lease
    /// used to fail whole, every second, for ever: nothing of the target was delivered again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreadable_event_is_set_aside_and_the_rest_of_its_lease_delivered() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = crate::app::test_config(dir.path());
        std::fs::write(
            cfg.rules_dir.join("r.yaml"),
            "rules:\n  - name: r\n    pattern:\n      type: [t]\n    targets:\n      - webhook: http://127.0.0.1:9/a\n        id: a\n",
        )
        .expect("rules");
        let store = RedbStore::in_memory().expect("store");
        let app = crate::app::test_app(cfg, store.clone(), None);
        let ctx = app.dispatcher.context().clone();
        let now = ctx.clock.now_ms();
        let outcomes = store
            .accept(
                (1..=3)
                    .map(|i| {
                        crate::store::test_events::new_event("/s", &i.to_string(), &["a"], now)
                    })
                    .collect(),
            )
            .await
            .expect("accept");
        let AcceptOutcome::Accepted { seq: bad, .. } = outcomes[1] else {
            panic!("{outcomes:?}")
        };
        store.damage_event(bad, b"garbage");
        let spec = app.rules.load().targets["a"].clone();
        let rt = Arc::new(TargetRuntime::new(spec, None, now));
        let slots = Arc::new(Semaphore::new(4));
        let mut permits = Vec::new();
        for _ in 0..4 {
            permits.push(Slot::new(
                slots.clone().acquire_owned().await.expect("permit"),
                None,
            ));
        }
        lease_and_start(
            ctx.clone(),
            rt.clone(),
            Arc::new(Takes),
            (permits, 1, ctx.bytes.empty(&rt.byte_share)),
            now,
            60_000,
            false,
            Arc::new(AtomicI64::new(0)),
        )
        .await;
        ctx.tracker.close();
        ctx.tracker.wait().await;
        let dlq = store
            .dlq_list(&DlqFilter::default(), None, 10)
            .expect("dlq");
        assert_eq!(dlq.len(), 1, "{dlq:?}");
        assert_eq!(dlq[0].reason, DlqReason::CorruptRecord);
        assert_eq!(dlq[0].event_seq, bad);
        assert!(
            dlq[0].errors[0]
                .message
                .contains(&format!("stored record of event {bad} cannot be read")),
            "{:?}",
            dlq[0].errors
        );
        assert_eq!(rt.counters.delivered.load(Ordering::Relaxed), 2);
        let stats = store.queue_stats();
        assert_eq!(
            (stats["a"].queued, stats["a"].in_flight),
            (0, 0),
            "{stats:?}"
        );
        assert_eq!(
            ctx.metrics
                .corrupt_records
                .get_or_create(&vec![("target", "a".to_string())])
                .get(),
            1
        );
        let warnings = app.dispatcher.store_faults().warnings();
        assert!(
            warnings.len() == 1 && warnings[0].contains(&format!("event {bad} cannot be read")),
            "{warnings:?}"
        );
    }
}
