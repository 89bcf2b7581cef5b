//! Per-target runtime state: breaker, retry budget, rate limiter, pause flag and counters.
//! The worker consults it in the order breaker → budget → throttle → concurrency; the API
//! reads a snapshot of it.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

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
}

/// Counters since start.
#[derive(Debug, Default)]
pub struct Counters {
    /// Attempts that delivered.
    pub delivered: AtomicU64,
    /// Attempts that failed and were scheduled again.
    pub retried: AtomicU64,
    /// Entries moved to the DLQ.
    pub dead_lettered: AtomicU64,
    /// Due retries deferred by the retry budget.
    pub budget_deferred: AtomicU64,
    /// Times the worker waited for the rate limiter.
    pub throttled: AtomicU64,
}

/// One target's runtime.
pub struct TargetRuntime {
    /// Configuration in force.
    pub spec: TargetSpec,
    breaker: Option<Mutex<Breaker>>,
    budget: Option<Mutex<RetryBudget>>,
    /// Token bucket, when the policy sets a rate.
    pub limiter: Option<Limiter>,
    /// Operator pause: no attempts while set.
    pub paused: AtomicBool,
    /// Counters.
    pub counters: Counters,
}

impl TargetRuntime {
    /// Builds the runtime for `spec`, restoring persisted state.
    pub fn new(spec: TargetSpec, persisted: Option<PersistedState>, now: i64) -> Self {
        let breaker = spec.policy.breaker.clone().map(|p| {
            let mut b = Breaker::new(p, now);
            if let Some((state, since)) = persisted.as_ref().and_then(|s| s.breaker) {
                b.restore(state, since);
            }
            Mutex::new(b)
        });
        let budget = spec
            .policy
            .retry_budget
            .map(|r| Mutex::new(RetryBudget::new(r)));
        let limiter = spec.policy.throttle.as_ref().and_then(|t| {
            let rate = t.rate_per_sec?;
            let burst = NonZeroU32::new(t.effective_burst().unwrap_or(1).max(1))?;
            // Quota::with_period takes the time per token; rates below 1/s are allowed.
            let period = std::time::Duration::from_secs_f64(1.0 / rate.max(1e-6));
            Quota::with_period(period).map(|q| RateLimiter::direct(q.allow_burst(burst)))
        });
        Self {
            paused: AtomicBool::new(persisted.as_ref().is_some_and(|s| s.paused)),
            spec,
            breaker,
            budget,
            limiter,
            counters: Counters::default(),
        }
    }

    /// The breaker, if the policy has one.
    pub fn breaker(&self) -> Option<MutexGuard<'_, Breaker>> {
        self.breaker
            .as_ref()
            .map(|b| b.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The retry budget, if the policy has one.
    pub fn budget(&self) -> Option<MutexGuard<'_, RetryBudget>> {
        self.budget
            .as_ref()
            .map(|b| b.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// What to persist now.
    pub fn persisted(&self) -> PersistedState {
        PersistedState {
            breaker: self.breaker().map(|b| (b.state(), b.since())),
            paused: self.paused.load(Ordering::SeqCst),
        }
    }

    /// A JSON snapshot for `/v1/targets`.
    pub fn snapshot(&self, now: i64) -> Value {
        let c = &self.counters;
        let breaker = self.breaker().map(|mut b| {
            let (requests, rate) = b.window_stats(now);
            json!({
                "state": b.state().name(),
                "since": crate::clock::rfc3339(b.since()),
                "open_until": match b.state() { BreakerState::Open { until } => Some(crate::clock::rfc3339(until)), _ => None },
                "window_requests": requests,
                "window_failure_rate": rate,
            })
        });
        let budget = self.budget().map(|mut b| {
            let (attempts, retries) = b.usage(now);
            json!({ "ratio": self.spec.policy.retry_budget, "window_first_attempts": attempts, "window_retries": retries })
        });
        json!({
            "paused": self.paused.load(Ordering::SeqCst),
            "breaker": breaker,
            "retry_budget": budget,
            "throttle": self.spec.policy.throttle,
            "delivered": c.delivered.load(Ordering::Relaxed),
            "retried": c.retried.load(Ordering::Relaxed),
            "dead_lettered": c.dead_lettered.load(Ordering::Relaxed),
            "budget_deferred": c.budget_deferred.load(Ordering::Relaxed),
            "throttled": c.throttled.load(Ordering::Relaxed),
        })
    }
}
