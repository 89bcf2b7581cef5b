//! Backoff: computes how long a retry waits. It only computes the delay; whether to retry at
//! all is the delivery state machine's decision (`deliver::decide`).

use std::time::Duration;

use super::config::{Jitter, RetryPolicy};

/// The upper bound of the wait after failed attempt `attempt` (1-based):
/// `min(max_delay, base_delay · 2^(attempt-1))`.
pub fn cap(retry: &RetryPolicy, attempt: u32) -> Duration {
    let exp = attempt.saturating_sub(1).min(62);
    let factor = 1u64 << exp;
    let base = u64::try_from(retry.base_delay.as_millis()).unwrap_or(u64::MAX);
    let max = u64::try_from(retry.max_delay.as_millis()).unwrap_or(u64::MAX);
    Duration::from_millis(base.saturating_mul(factor).min(max))
}

/// The wait after failed attempt `attempt`, with `r` a uniform random number in [0, 1):
/// full jitter `r · cap`, equal jitter `cap/2 + r · cap/2`, or exactly `cap`.
pub fn delay(retry: &RetryPolicy, attempt: u32, r: f64) -> Duration {
    let c = cap(retry, attempt);
    let r = r.clamp(0.0, 1.0);
    match retry.jitter {
        Jitter::Full => c.mul_f64(r),
        Jitter::Equal => c / 2 + (c / 2).mul_f64(r),
        Jitter::None => c,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn policy(jitter: Jitter) -> RetryPolicy {
        RetryPolicy {
            base_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(30),
            jitter,
            ..RetryPolicy::default()
        }
    }

    #[test]
    fn cap_doubles_until_max_delay() {
        let p = policy(Jitter::None);
        assert_eq!(cap(&p, 1), Duration::from_millis(200));
        assert_eq!(cap(&p, 2), Duration::from_millis(400));
        assert_eq!(cap(&p, 8), Duration::from_millis(25_600));
        assert_eq!(cap(&p, 9), Duration::from_secs(30));
        assert_eq!(cap(&p, 500), Duration::from_secs(30));
    }

    proptest! {
        #[test]
        fn full_jitter_stays_within_zero_and_cap(attempt in 1u32..100, r in 0.0f64..1.0) {
            let p = policy(Jitter::Full);
            let d = delay(&p, attempt, r);
            prop_assert!(d <= cap(&p, attempt));
        }

        #[test]
        fn equal_jitter_stays_within_half_cap_and_cap(attempt in 1u32..100, r in 0.0f64..1.0) {
            let p = policy(Jitter::Equal);
            let d = delay(&p, attempt, r);
            let c = cap(&p, attempt);
            prop_assert!(d >= c / 2 && d <= c);
        }

        #[test]
        fn cap_never_decreases(attempt in 1u32..100) {
            let p = policy(Jitter::None);
            prop_assert!(cap(&p, attempt + 1) >= cap(&p, attempt));
        }
    }
}
