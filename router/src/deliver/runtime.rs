//! Per-target runtime state: breaker, retry budget, rate limiter, pause flag and counters.
//! The worker consults it in the order breaker → budget → throttle → concurrency; the API
//! reads a snapshot of it.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use arc_swap::ArcSwapOption;

use governor::clock::DefaultClock;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::policy::breaker::{Breaker, BreakerState};
use crate::policy::budget::RetryBudget;
use crate::rules::TargetSpec;

/// Rate limiter type used per target.
pub type Limiter = RateLimiter<NotKeyed, InMemoryState, DefaultClock>;

/// What is persisted per target (survives restart).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PersistedState {
    /// Breaker state and since when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub breaker: Option<(BreakerState, i64)>,
    /// Paused by an operator.
    #[serde(default)]
    pub paused: bool,
    /// The receiver's `Retry-After` pause: no entry is sent before this time (clock ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_until: Option<i64>,
    /// When that pause was set (clock ms): an operator's lift ends every pause set before it
    /// (other nodes' included), and a lowered `retry_after_max` caps it from this time.
    /// Absent in records written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_since: Option<i64>,
}

impl PersistedState {
    /// The state without what belongs to the receiver (its `Retry-After` pause and the
    /// breaker its failures opened): what a target whose destination changed keeps, at a
    /// reload (`Dispatcher::start_with`) and at a start on rules changed while the router
    /// was down. The operator's pause is about the target and stays.
    pub fn without_receiver(&self) -> Self {
        Self {
            paused: self.paused,
            ..Self::default()
        }
    }
}

/// The receiver's `Retry-After` pause of a target, shared by the runtimes a reload makes for
/// it ([`TargetRuntime::carry_over`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Hold {
    /// No request before this (clock ms); 0: none.
    until: i64,
    /// When `until` was last set.
    since: i64,
    /// When an operator last lifted the pause (clock ms); 0: never. A pause set at or before
    /// it, read back from another node's record, is not taken up again.
    lifted_at: i64,
}

/// Counters since start (of the process: a reload that replaces the target's worker carries
/// them over, [`TargetRuntime::carry_over`]).
#[derive(Debug, Default)]
pub struct Counters {
    /// Attempts that delivered.
    pub delivered: AtomicU64,
    /// Attempts that failed and were scheduled again.
    pub retried: AtomicU64,
    /// Entries moved to the DLQ.
    pub dead_lettered: AtomicU64,
    /// Deliveries put back without an attempt (a handler not uploaded, or busy).
    pub deferred: AtomicU64,
    /// Due retries deferred by the retry budget.
    pub budget_deferred: AtomicU64,
    /// Times the worker waited for the rate limiter.
    pub throttled: AtomicU64,
    /// When (ms) the retry budget last deferred a due retry; 0: never. An event's fate says
    /// its due retry waits for the budget when this is recent.
    pub last_budget_deferred_at: AtomicI64,
    /// Until when (ms) the worker waits for the rate limiter's next token; 0: never.
    pub throttled_until: AtomicI64,
    /// Times the worker waited for bytes because its target held its fair share of a
    /// contended byte pool (`delivery.max_in_flight_bytes`).
    pub byte_share_waits: AtomicU64,
}

/// `until`, a hold set by an answer at `since`, capped by `spec`'s `retry_after_max` after
/// that answer (a lowered maximum caps a hold already set, at a reload or a restart too).
fn capped_until(spec: &TargetSpec, until: i64, since: i64) -> i64 {
    let cap = i64::try_from(spec.policy.retry.retry_after_max.as_millis()).unwrap_or(i64::MAX);
    until.min(since.saturating_add(cap))
}

/// The token bucket for `nodes`' share of `spec`'s throttle rate and burst (the burst rounded
/// up, at least one).
/// This node's part of the policy's burst, when the policy sets a rate, shared among `nodes`
/// (rounded up, at least one token).
fn burst_share(spec: &TargetSpec, nodes: usize) -> Option<NonZeroU32> {
    let t = spec.policy.throttle.as_ref()?;
    t.rate_per_sec?;
    let burst = t.effective_burst().unwrap_or(1).max(1);
    NonZeroU32::new(
        burst
            .div_ceil(u32::try_from(nodes).unwrap_or(u32::MAX))
            .max(1),
    )
}

fn limiter_for(spec: &TargetSpec, nodes: usize) -> Option<Limiter> {
    let rate = spec.policy.throttle.as_ref()?.rate_per_sec? / nodes as f64;
    let burst = burst_share(spec, nodes)?;
    // Quota::with_period takes the time per token; rates below 1/s are allowed.
    let period = std::time::Duration::from_secs_f64(1.0 / rate.max(1e-6));
    Quota::with_period(period).map(|q| RateLimiter::direct(q.allow_burst(burst)))
}

/// One target's runtime.
pub struct TargetRuntime {
    /// Configuration in force.
    pub spec: TargetSpec,
    /// Shared with the runtime this one replaced, if any ([`Self::carry_over`]).
    breaker: Option<Arc<Mutex<Breaker>>>,
    /// Every target has one (the policy's ratio, or the default).
    budget: Mutex<RetryBudget>,
    /// Token bucket, when the policy sets a rate: this node's share of it
    /// ([`Self::share_among`]).
    limiter: ArcSwapOption<Limiter>,
    /// Router nodes the throttle rate is shared among (1 on a store of its own).
    nodes: AtomicUsize,
    /// Operator pause: no attempts while set.
    pub paused: AtomicBool,
    /// Until when (clock ms) the receiver asked the router to hold off, with `Retry-After` on
    /// a 429 or 503 (capped by `retry_after_max`); 0: never. Like an open breaker it gates
    /// the whole target: entries wait in the queue, no attempt is spent. Setting only the
    /// answered entry's due time let every other queued entry go at once, get the same 429
    /// and spend an attempt, and a backlog went to the DLQ while the receiver asked for a
    /// pause. An operator's resume lifts it ([`Self::lift_hold`]); a lowered
    /// `retry_after_max` caps it ([`Self::carry_over`]).
    hold: Arc<Mutex<Hold>>,
    /// A batching webhook's lowered `max_events` after its receiver refused a batch as too
    /// large (413); 0: none. In memory: after a restart one more refusal finds it again.
    batch_cap: AtomicU32,
    /// This target's permits of the global pool (`delivery.max_in_flight`), for its fair
    /// share. A reload's new runtime starts a new account: attempts still running under the
    /// old one count there until they end.
    pub share: Arc<super::in_flight::Share>,
    /// This target's bytes of the byte pool (`delivery.max_in_flight_bytes`), for its fair
    /// share. Like `share`, a reload's new runtime starts a new account.
    pub byte_share: Arc<super::bytes::ByteShare>,
    /// What one of this target's entries is expected to weigh, in KiB of the byte pool
    /// (`delivery.max_in_flight_bytes`): the largest event of its last lease. A lease
    /// reserves this much per entry before it knows the real sizes.
    pub bytes_estimate: std::sync::atomic::AtomicU64,
    /// Throttle tokens taken for requests that were never sent (a retry the budget deferred
    /// after the lease, entries another lease took first), and when they were given back
    /// ([`Self::refund_tokens`]).
    throttle_credit: Mutex<(usize, Option<std::time::Instant>)>,
    /// Full batches delivered under `batch_cap` since it last changed: at
    /// `BATCH_RAISE_AFTER` the cap doubles (a 413 may have been about a few large events,
    /// not the receiver's usual limit, and a halved cap would halve throughput for good).
    batch_ok: AtomicU32,
    /// Counters, shared with the runtime this one replaced, if any ([`Self::carry_over`]).
    pub counters: Arc<Counters>,
}

/// How long throttle tokens given back stay usable ([`TargetRuntime::refund_tokens`]).
pub const THROTTLE_CREDIT_TTL: std::time::Duration = std::time::Duration::from_secs(1);

/// Full batches a lowered batch cap delivers before it is doubled ([`TargetRuntime::batch_delivered`]).
pub const BATCH_RAISE_AFTER: u32 = 100;

impl TargetRuntime {
    /// A batching webhook's batch as its requests are cut: its configuration, with
    /// `max_events` lowered after its receiver refused a batch as too large.
    pub fn batch(&self) -> Option<crate::rules::WebhookBatch> {
        self.spec.kind.batch().map(|b| {
            let mut b = *b;
            let cap = self.batch_cap.load(Ordering::Relaxed);
            if cap > 0 {
                b.max_events = b.max_events.min(cap);
            }
            b
        })
    }

    /// The receiver refused a batch of `n` events as too large: later batches hold at most
    /// half as many. Returns the new bound.
    pub fn batch_too_large(&self, n: u32) -> u32 {
        let half = (n / 2).max(1);
        let prev = self
            .batch_cap
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |cur| {
                Some(if cur == 0 { half } else { cur.min(half) })
            })
            .unwrap_or(0);
        self.batch_ok.store(0, Ordering::Relaxed);
        if prev == 0 { half } else { prev.min(half) }
    }

    /// A batch of `n` events was delivered: after `BATCH_RAISE_AFTER` full batches under a
    /// lowered cap, the cap doubles (back to the configuration's `max_events` once it
    /// reaches it). Returns the new bound when it was raised. A receiver whose limit is real
    /// refuses the larger batch and halves the cap again: one request in
    /// `BATCH_RAISE_AFTER` is the price of finding a higher limit.
    pub fn batch_delivered(&self, n: u32) -> Option<u32> {
        let cap = self.batch_cap.load(Ordering::Relaxed);
        if cap == 0 || n < cap {
            return None;
        }
        if self.batch_ok.fetch_add(1, Ordering::Relaxed) + 1 < BATCH_RAISE_AFTER {
            return None;
        }
        self.batch_ok.store(0, Ordering::Relaxed);
        let configured = self.spec.kind.batch().map_or(u32::MAX, |b| b.max_events);
        let raised = cap.saturating_mul(2);
        let next = if raised >= configured { 0 } else { raised };
        self.batch_cap
            .compare_exchange(cap, next, Ordering::Relaxed, Ordering::Relaxed)
            .ok()
            .map(|_| raised.min(configured))
    }

    /// Builds the runtime for `spec`, restoring persisted state.
    pub fn new(spec: TargetSpec, persisted: Option<PersistedState>, now: i64) -> Self {
        let breaker = spec.policy.breaker.clone().map(|p| {
            let mut b = Breaker::new(p, now);
            if let Some((state, since)) = persisted.as_ref().and_then(|s| s.breaker) {
                b.restore(state, since);
            }
            Arc::new(Mutex::new(b))
        });
        // Every target has a budget: the policy's ratio, or the default (10%).
        let ratio = spec
            .policy
            .retry_budget
            .unwrap_or(crate::policy::budget::DEFAULT_RATIO);
        let budget = Mutex::new(RetryBudget::new(ratio));
        let limiter = ArcSwapOption::from(limiter_for(&spec, 1).map(Arc::new));
        // Restored under the policy in force: a `retry_after_max` lowered while the router was
        // down caps the pause as a reload does. A record older than `retry_after_since`
        // counts the cap from now.
        let hold = match persisted.as_ref() {
            Some(PersistedState {
                retry_after_until: Some(until),
                retry_after_since: since,
                ..
            }) if *until > now => {
                let since = since.unwrap_or(now);
                Hold {
                    until: capped_until(&spec, *until, since),
                    since,
                    lifted_at: 0,
                }
            }
            _ => Hold::default(),
        };
        Self {
            paused: AtomicBool::new(persisted.as_ref().is_some_and(|s| s.paused)),
            hold: Arc::new(Mutex::new(hold)),
            spec,
            breaker,
            budget,
            limiter,
            nodes: AtomicUsize::new(1),
            batch_cap: AtomicU32::new(0),
            share: Arc::default(),
            byte_share: Arc::default(),
            bytes_estimate: std::sync::atomic::AtomicU64::new(
                super::bytes::INITIAL_ESTIMATE.div_ceil(1024),
            ),
            batch_ok: AtomicU32::new(0),
            throttle_credit: Mutex::new((0, None)),
            counters: Arc::default(),
        }
    }

    /// Goes on from `old`, the runtime this one replaces for the same target id (a reload
    /// changed its configuration): the same counters and the same breaker, its window and
    /// state, under this runtime's breaker policy. A reload used to start both afresh, so
    /// `/v1/targets` read 0 dead-lettered after a timeout edit, and a reload every few
    /// seconds kept a failing target's breaker from ever seeing `min_requests`. Shared rather
    /// than copied: the old worker's attempts still in flight record their outcomes after the
    /// swap, and they belong to the same target. A breaker the new policy adds starts closed
    /// and empty; one it removes is gone.
    pub fn carry_over(&mut self, old: &TargetRuntime) {
        self.counters = old.counters.clone();
        // The receiver's pause is about the receiver, not the configuration; shared so that
        // the old worker's attempts still in flight extend the new worker's pause. A lowered
        // `retry_after_max` caps it, counted from when it was set: a limit an operator
        // lowers to get a stuck target going applies to the pause already taken, not only
        // to the next one.
        self.hold = old.hold.clone();
        {
            let mut h = self.hold();
            if h.until > 0 {
                h.until = capped_until(&self.spec, h.until, h.since);
            }
        }
        if let (Some(policy), Some(shared)) = (&self.spec.policy.breaker, &old.breaker) {
            shared
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .set_policy(policy.clone());
            self.breaker = Some(shared.clone());
        }
    }

    /// Goes on from `old` with its counters only: the target's destination changed, so the
    /// old receiver's Retry-After pause and breaker (its window and state) stay behind, and
    /// this runtime's (empty, closed) apply to the new receiver.
    pub fn carry_over_counters(&mut self, old: &TargetRuntime) {
        self.counters = old.counters.clone();
    }

    fn hold(&self) -> MutexGuard<'_, Hold> {
        self.hold.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Until when the receiver asked to be left alone (`Retry-After`), if that is after `now`.
    pub fn retry_after_until(&self, now: i64) -> Option<i64> {
        Some(self.hold().until).filter(|&until| until > now)
    }

    /// The receiver asked, at `since`, for no request before `until` (clock ms), capped by
    /// the policy's `retry_after_max` from `since`. Returns whether this started a pause or
    /// extended it by a second or more (worth persisting and logging). A pause set before an
    /// operator lifted the target's (another node's record read late) is not taken up.
    pub fn hold_off_until(&self, until: i64, since: i64) -> bool {
        let mut h = self.hold();
        if h.lifted_at > 0 && since <= h.lifted_at {
            return false;
        }
        let until = capped_until(&self.spec, until, since);
        if until <= h.until {
            return false;
        }
        let before = h.until;
        h.until = until;
        h.since = since;
        until >= before.saturating_add(1000)
    }

    /// An operator lifts the receiver's pause at `now` (a resume): entries go again at once.
    /// Returns the end of the pause lifted, if one was in effect.
    pub fn lift_hold(&self, now: i64) -> Option<i64> {
        let mut h = self.hold();
        let was = Some(h.until).filter(|&until| until > now);
        *h = Hold {
            until: 0,
            since: 0,
            lifted_at: h.lifted_at.max(now),
        };
        was
    }

    /// When an operator last lifted the receiver's pause here, if ever.
    pub fn hold_lifted_at(&self) -> Option<i64> {
        Some(self.hold().lifted_at).filter(|&at| at > 0)
    }

    /// Another node's operator lifted the receiver's pause at `lifted_at`: a pause set before
    /// it ends here too. Returns whether one was in effect here.
    pub fn follow_lift(&self, lifted_at: i64, now: i64) -> bool {
        let mut h = self.hold();
        if lifted_at <= h.lifted_at {
            return false;
        }
        h.lifted_at = lifted_at;
        if h.since > lifted_at {
            return false;
        }
        let was = h.until > now;
        h.until = 0;
        h.since = 0;
        was
    }

    /// This node's token bucket, if the policy sets a rate.
    pub fn limiter(&self) -> Option<Arc<Limiter>> {
        self.limiter.load_full()
    }

    /// Takes over `old`'s token bucket (and its node share): a replacement worker under the
    /// same rate goes on where the old one was instead of starting with a full burst.
    pub fn adopt_limiter(&self, old: &TargetRuntime) {
        self.nodes
            .store(old.nodes.load(Ordering::SeqCst), Ordering::SeqCst);
        self.limiter.store(old.limiter.load_full());
    }

    /// Gives back `n` throttle tokens taken for requests that were not sent. The budget is
    /// asked after the lease (only the lease says which entries are retries), the throttle
    /// before it: without this, each retry the budget defers spent a token, and a backlog of
    /// retries went out at a fraction of the target's rate while the budget spread them.
    /// Credit is held at most the bucket's burst, and for `THROTTLE_CREDIT_TTL`: it stands
    /// for tokens the bucket had moments ago, not for a saving.
    pub fn refund_tokens(&self, n: usize) {
        let Some(share) = burst_share(&self.spec, self.nodes.load(Ordering::SeqCst).max(1)) else {
            return;
        };
        if n == 0 {
            return;
        }
        let mut c = self
            .throttle_credit
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let live = c.1.is_some_and(|at| at.elapsed() <= THROTTLE_CREDIT_TTL);
        let held = if live { c.0 } else { 0 };
        *c = (
            (held + n).min(share.get() as usize),
            Some(std::time::Instant::now()),
        );
    }

    /// Takes up to `want` tokens of credit ([`Self::refund_tokens`]) before the bucket is
    /// asked.
    pub fn take_credit(&self, want: usize) -> usize {
        let mut c = self
            .throttle_credit
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if c.1.is_none_or(|at| at.elapsed() > THROTTLE_CREDIT_TTL) {
            *c = (0, None);
            return 0;
        }
        let n = c.0.min(want);
        c.0 -= n;
        n
    }

    /// Shares the policy's rate (and burst) among `nodes` router nodes delivering to this
    /// target from one shared store, so that together they keep to the rate the policy
    /// names. A change starts this node's bucket afresh.
    pub fn share_among(&self, nodes: usize) {
        let nodes = nodes.max(1);
        if self.nodes.swap(nodes, Ordering::SeqCst) != nodes {
            self.limiter
                .store(limiter_for(&self.spec, nodes).map(Arc::new));
        }
    }

    /// The breaker, if the policy has one.
    pub fn breaker(&self) -> Option<MutexGuard<'_, Breaker>> {
        self.breaker
            .as_ref()
            .map(|b| b.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The retry budget.
    pub fn budget(&self) -> MutexGuard<'_, RetryBudget> {
        self.budget.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What to persist now.
    pub fn persisted(&self) -> PersistedState {
        let hold = *self.hold();
        PersistedState {
            breaker: self.breaker().map(|b| (b.state(), b.since())),
            paused: self.paused.load(Ordering::SeqCst),
            retry_after_until: Some(hold.until).filter(|&until| until > 0),
            retry_after_since: Some(hold.since).filter(|&s| s > 0),
        }
    }

    /// A JSON snapshot for `/v1/targets`.
    pub fn snapshot(&self, now: i64) -> Value {
        let c = &self.counters;
        let breaker = self.breaker().map(|mut b| {
            let (requests, rate) = b.window_stats(now);
            // In effect now: an open period that ended while the target was paused (whose
            // worker asks the breaker nothing) reads as half-open, not as open until a past
            // time.
            let state = b.state_at(now);
            json!({
                "state": state.name(),
                "since": crate::clock::rfc3339(b.since_at(now)),
                "open_until": match state { BreakerState::Open { until } => Some(crate::clock::rfc3339(until)), _ => None },
                "window_requests": requests,
                "window_failure_rate": rate,
            })
        });
        let budget = {
            let mut b = self.budget();
            let (attempts, retries) = b.usage(now);
            json!({ "ratio": b.ratio(), "window_first_attempts": attempts, "window_retries": retries })
        };
        json!({
            "paused": self.paused.load(Ordering::SeqCst),
            // The receiver's Retry-After pause (429/503): nothing is sent before it.
            "retry_after_until": self.retry_after_until(now).map(crate::clock::rfc3339),
            "breaker": breaker,
            "retry_budget": budget,
            "throttle": self.spec.policy.throttle,
            // On a store several nodes share: how many share the throttle's rate, and this
            // node's part of it.
            "throttle_share": self.spec.policy.throttle.as_ref().and_then(|t| t.rate_per_sec).map(|rate| {
                let nodes = self.nodes.load(Ordering::SeqCst).max(1);
                json!({ "nodes": nodes, "rate_per_sec": rate / nodes as f64 })
            }),
            "delivered": c.delivered.load(Ordering::Relaxed),
            "retried": c.retried.load(Ordering::Relaxed),
            "dead_lettered": c.dead_lettered.load(Ordering::Relaxed),
            "deferred": c.deferred.load(Ordering::Relaxed),
            "budget_deferred": c.budget_deferred.load(Ordering::Relaxed),
            "throttled": c.throttled.load(Ordering::Relaxed),
            // Bytes of the byte pool this target's deliveries hold now (under this runtime:
            // after a reload, attempts still running under the replaced one are not counted
            // here), and how often it waited for bytes at its fair share.
            "in_flight_bytes": self.byte_share.held_bytes(),
            "byte_share_waits": c.byte_share_waits.load(Ordering::Relaxed),
            // A batching webhook's batches after a 413 lowered them (null: as configured).
            "batch_max_events": match self.batch_cap.load(Ordering::Relaxed) {
                0 => None,
                cap => Some(cap),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::config::{PolicyConfig, ThrottlePolicy};
    use crate::rules::TargetKind;
    use std::time::Duration;

    fn throttled(rate: f64, burst: u32) -> TargetRuntime {
        let spec = TargetSpec {
            id: "t".into(),
            rule: "r".into(),
            kind: TargetKind::Handler { name: "h".into() },
            policy_name: None,
            policy: PolicyConfig {
                throttle: Some(ThrottlePolicy {
                    rate_per_sec: Some(rate),
                    burst: Some(burst),
                    max_concurrency: None,
                }),
                ..PolicyConfig::default()
            },
        };
        TargetRuntime::new(spec, None, 0)
    }

    #[test]
    fn tokens_given_back_are_spent_first_up_to_the_burst_and_not_for_long() {
        let rt = throttled(0.001, 4);
        assert_eq!(rt.take_credit(3), 0, "no credit yet");
        rt.refund_tokens(3);
        rt.refund_tokens(3);
        assert_eq!(rt.take_credit(10), 4, "held at most the burst");
        assert_eq!(rt.take_credit(10), 0);
        rt.refund_tokens(2);
        assert_eq!(rt.take_credit(1), 1);
        rt.share_among(2);
        rt.refund_tokens(5);
        assert_eq!(
            rt.take_credit(10),
            2,
            "at most this node's share of the burst"
        );
        rt.refund_tokens(1);
        std::thread::sleep(THROTTLE_CREDIT_TTL + Duration::from_millis(50));
        assert_eq!(
            rt.take_credit(10),
            0,
            "credit is for tokens had moments ago"
        );
        // No rate: nothing to give back.
        let mut spec = rt.spec.clone();
        spec.policy.throttle = None;
        let free = TargetRuntime::new(spec, None, 0);
        free.refund_tokens(3);
        assert_eq!(free.take_credit(3), 0);
    }

    #[test]
    fn a_batch_cap_a_413_lowered_doubles_back_after_full_batches_go_through() {
        let spec = TargetSpec {
            id: "w".into(),
            rule: "r".into(),
            kind: TargetKind::Webhook {
                url: "http://127.0.0.1:9/".into(),
                headers: Default::default(),
                secret_env: None,
                headers_env: Default::default(),
                batch: Some(crate::rules::WebhookBatch {
                    max_events: 100,
                    max_bytes: 1 << 20,
                    window: Duration::ZERO,
                }),
            },
            policy_name: None,
            policy: PolicyConfig::default(),
        };
        let rt = TargetRuntime::new(spec, None, 0);
        let max = |rt: &TargetRuntime| rt.batch().expect("batching").max_events;
        assert_eq!(rt.batch_delivered(100), None, "nothing to raise");
        assert_eq!(rt.batch_too_large(100), 50);
        assert_eq!(rt.batch_too_large(50), 25);
        assert_eq!(
            (max(&rt), rt.snapshot(0)["batch_max_events"].clone()),
            (25, json!(25))
        );
        // Partial batches say nothing about the limit; full ones count.
        for _ in 0..(2 * BATCH_RAISE_AFTER) {
            assert_eq!(rt.batch_delivered(10), None);
        }
        for _ in 1..BATCH_RAISE_AFTER {
            assert_eq!(rt.batch_delivered(25), None);
        }
        assert_eq!(rt.batch_delivered(25), Some(50));
        assert_eq!(max(&rt), 50);
        // A 413 on the way up restarts the count.
        for _ in 1..BATCH_RAISE_AFTER {
            rt.batch_delivered(50);
        }
        assert_eq!(rt.batch_too_large(50), 25);
        for _ in 1..BATCH_RAISE_AFTER {
            assert_eq!(rt.batch_delivered(25), None);
        }
        assert_eq!(rt.batch_delivered(25), Some(50));
        for _ in 1..BATCH_RAISE_AFTER {
            rt.batch_delivered(50);
        }
        assert_eq!(
            rt.batch_delivered(50),
            Some(100),
            "back to the configuration"
        );
        assert_eq!(
            (max(&rt), rt.snapshot(0)["batch_max_events"].clone()),
            (100, Value::Null)
        );
    }

    /// A paused target's breaker whose open period has ended shows as half-open (what the
    /// next attempt after the resume finds), not open until a time in the past.
    #[test]
    fn an_expired_open_breaker_shows_as_half_open() {
        use crate::policy::config::BreakerPolicy;
        let mut spec = throttled(1.0, 1).spec;
        spec.policy.breaker = Some(BreakerPolicy::default());
        let persisted = PersistedState {
            breaker: Some((BreakerState::Open { until: 30_000 }, 0)),
            paused: true,
            retry_after_until: None,
            retry_after_since: None,
        };
        let rt = TargetRuntime::new(spec, Some(persisted), 0);
        let open = rt.snapshot(10_000);
        assert_eq!(open["breaker"]["state"], "open", "{open}");
        let later = rt.snapshot(120_000);
        assert_eq!(later["breaker"]["state"], "half_open", "{later}");
        assert_eq!(later["breaker"]["open_until"], Value::Null, "{later}");
        assert_eq!(later["breaker"]["since"], crate::clock::rfc3339(30_000));
    }

    #[test]
    fn a_replacing_runtime_shares_the_counters_and_the_breaker() {
        use crate::policy::config::BreakerPolicy;
        let mut spec = throttled(1.0, 1).spec;
        spec.policy.breaker = Some(BreakerPolicy::default());
        let old = TargetRuntime::new(spec.clone(), None, 0);
        old.counters.delivered.fetch_add(7, Ordering::Relaxed);
        old.breaker()
            .expect("a breaker")
            .record(Some(false), false, 0);
        let mut new = TargetRuntime::new(spec.clone(), None, 0);
        new.carry_over(&old);
        assert_eq!(new.snapshot(0)["delivered"], 7);
        assert_eq!(new.snapshot(0)["breaker"]["window_requests"], 1);
        old.counters.retried.fetch_add(1, Ordering::Relaxed);
        assert_eq!(new.snapshot(0)["retried"], 1, "shared, not copied");
        // A policy without a breaker drops it; one that adds a breaker starts it empty.
        spec.policy.breaker = None;
        let mut none = TargetRuntime::new(spec.clone(), None, 0);
        none.carry_over(&new);
        assert!(none.breaker().is_none());
        spec.policy.breaker = Some(BreakerPolicy::default());
        let mut again = TargetRuntime::new(spec, None, 0);
        again.carry_over(&none);
        assert_eq!(again.snapshot(0)["breaker"]["window_requests"], 0);
        assert_eq!(again.snapshot(0)["delivered"], 7);
    }

    /// The receiver's pause: an operator's lift ends it (and one set before the lift, read
    /// late from another node, is not taken up again), a lowered `retry_after_max` caps it
    /// from when it was set, at a reload and at a restart, and it persists with its time.
    #[test]
    fn a_retry_after_hold_is_lifted_by_an_operator_and_capped_by_a_lowered_maximum() {
        let mut spec = throttled(1.0, 1).spec;
        spec.policy.retry.retry_after_max = Duration::from_secs(3600);
        let rt = TargetRuntime::new(spec.clone(), None, 0);
        assert!(rt.hold_off_until(900_000, 1_000), "a 15 min pause");
        assert_eq!(rt.retry_after_until(2_000), Some(900_000));
        assert_eq!(
            (
                rt.persisted().retry_after_until,
                rt.persisted().retry_after_since
            ),
            (Some(900_000), Some(1_000))
        );
        assert_eq!(
            rt.snapshot(2_000)["retry_after_until"],
            crate::clock::rfc3339(900_000)
        );
        // A reload that lowers retry_after_max to 1 s caps it at 1 s after it was set.
        let long = spec.clone();
        spec.policy.retry.retry_after_max = Duration::from_secs(1);
        let before = TargetRuntime::new(long, Some(rt.persisted()), 1_000);
        let mut lowered = TargetRuntime::new(spec.clone(), None, 0);
        lowered.carry_over(&before);
        assert_eq!(lowered.retry_after_until(1_500), Some(2_000));
        assert_eq!(lowered.retry_after_until(2_000), None);
        // So does a restart under the lowered policy (a record without its time: from now).
        let restored = TargetRuntime::new(spec.clone(), Some(rt.persisted()), 1_200);
        assert_eq!(restored.retry_after_until(1_200), Some(2_000));
        let legacy = PersistedState {
            retry_after_until: Some(900_000),
            ..PersistedState::default()
        };
        let restored = TargetRuntime::new(spec, Some(legacy), 5_000);
        assert_eq!(restored.retry_after_until(5_000), Some(6_000));
        // An operator's resume lifts it at once.
        assert_eq!(rt.lift_hold(3_000), Some(900_000));
        assert_eq!(rt.retry_after_until(3_000), None);
        assert_eq!(rt.persisted().retry_after_until, None);
        // Another node's record of the pause lifted, read late, is not taken up again; a new
        // 503 after the lift is.
        assert!(!rt.hold_off_until(900_000, 1_000));
        assert_eq!(rt.retry_after_until(3_000), None);
        assert!(rt.hold_off_until(40_000, 10_000));
        assert_eq!(rt.retry_after_until(10_000), Some(40_000));
        // A lift made on another node ends a pause set before it, not one set after.
        assert!(!rt.follow_lift(5_000, 11_000), "set after that lift");
        assert_eq!(rt.retry_after_until(11_000), Some(40_000));
        assert!(rt.follow_lift(20_000, 21_000));
        assert_eq!(rt.retry_after_until(21_000), None);
        assert!(!rt.follow_lift(20_000, 21_000), "once");
    }

    /// Tokens the bucket hands out at once (its burst; at these rates no token is added
    /// while counting).
    fn burst_now(rt: &TargetRuntime) -> usize {
        let limiter = rt.limiter().expect("a rate is set");
        (0..100).take_while(|_| limiter.check().is_ok()).count()
    }

    #[test]
    fn the_throttle_rate_and_burst_are_shared_among_the_live_nodes() {
        let rt = throttled(0.001, 12);
        assert_eq!(burst_now(&rt), 12);
        rt.share_among(2);
        assert_eq!(burst_now(&rt), 6, "half the burst on each of two nodes");
        rt.share_among(5);
        assert_eq!(burst_now(&rt), 3, "a share's burst rounds up");
        let share = &rt.snapshot(0)["throttle_share"];
        assert_eq!(share["nodes"], 5);
        assert!((share["rate_per_sec"].as_f64().expect("rate") - 0.0002).abs() < 1e-9);
        rt.share_among(50);
        assert_eq!(burst_now(&rt), 1, "never below one");
        // The same count again keeps the bucket as it is (drained here).
        rt.share_among(50);
        assert_eq!(burst_now(&rt), 0);
    }
}
