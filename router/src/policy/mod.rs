//! Delivery policies: how the dispatcher (after rule match and durable fan-out) delivers one
//! queue entry to one target — timeout, retry, breaker, throttle, budget, ordering.
//!
//! `config` holds the configuration types that rule files name and share (`policies:` in a
//! rule file); `backoff` computes retry waits; `breaker` and `budget` are the per-target state
//! machines the delivery workers (`deliver::worker`) consult before each lease.

pub mod backoff;
pub mod breaker;
pub mod budget;
pub mod config;

pub use config::{
    BreakerPolicy, Jitter, OnDeadLetter, OrderingKey, PolicyConfig, RetryPolicy, ThrottlePolicy,
    WORST_CASE_ATTEMPTS_SMELL,
};
