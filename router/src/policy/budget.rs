//! Retry budget (Finagle's model): over a sliding window, retries may be at most `ratio` of
//! the target's first attempts, plus a guaranteed minimum per second so that a backlog made
//! only of retries still drains. Past it, due retries are deferred (not dropped, not counted
//! as attempts). Half-open probes bypass the budget (the caller does not ask).

use std::collections::VecDeque;

/// Window over which the budget is computed (Finagle's default TTL).
pub const WINDOW_MS: i64 = 10_000;
/// Retries always allowed per second, whatever the ratio.
pub const MIN_RETRIES_PER_SEC: u32 = 10;

/// The budget of one target.
#[derive(Debug, Clone)]
pub struct RetryBudget {
    ratio: f64,
    /// (second, first attempts, retries on the per-second minimum, retries on the ratio),
    /// oldest first.
    buckets: VecDeque<(i64, u32, u32, u32)>,
}

impl RetryBudget {
    /// A budget allowing retries up to `ratio` of first attempts (plus the minimum).
    pub fn new(ratio: f64) -> Self {
        Self {
            ratio: ratio.clamp(0.0, 1.0),
            buckets: VecDeque::new(),
        }
    }

    fn current(&mut self, now: i64) -> usize {
        let sec = now / 1000;
        let oldest = (now - WINDOW_MS) / 1000;
        while self.buckets.front().is_some_and(|b| b.0 <= oldest) {
            self.buckets.pop_front();
        }
        if self.buckets.back().is_none_or(|b| b.0 != sec) {
            self.buckets.push_back((sec, 0, 0, 0));
        }
        self.buckets.len() - 1
    }

    /// Records a first attempt (a deposit).
    pub fn first_attempt(&mut self, now: i64) {
        let i = self.current(now);
        self.buckets[i].1 += 1;
    }

    /// (first attempts, retries) in the window.
    pub fn usage(&mut self, now: i64) -> (u32, u32) {
        self.current(now);
        self.buckets
            .iter()
            .fold((0, 0), |(a, r), b| (a + b.1, r + b.2 + b.3))
    }

    /// Takes one retry from the budget if there is room; `false` means defer it. Each second
    /// grants `MIN_RETRIES_PER_SEC` retries; beyond those, retries draw on `ratio` of the
    /// window's first attempts.
    pub fn try_retry(&mut self, now: i64) -> bool {
        let i = self.current(now);
        if self.buckets[i].2 < MIN_RETRIES_PER_SEC {
            self.buckets[i].2 += 1;
            return true;
        }
        let (attempts, on_ratio) = self
            .buckets
            .iter()
            .fold((0u32, 0u32), |(a, r), b| (a + b.1, r + b.3));
        // Truncation is the intent: a fraction of a retry is not a retry.
        let share = (f64::from(attempts) * self.ratio).floor() as u32;
        if on_ratio < share {
            self.buckets[i].3 += 1;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_are_bounded_by_the_ratio_plus_the_minimum() {
        let mut b = RetryBudget::new(0.1);
        for _ in 0..1000 {
            b.first_attempt(0);
        }
        // 10% of 1000 = 100 in this second, plus the per-second minimum (10).
        let granted = (0..1000).filter(|_| b.try_retry(0)).count();
        assert_eq!(granted, 110);
    }

    #[test]
    fn a_backlog_of_only_retries_still_drains_at_the_minimum_rate() {
        let mut b = RetryBudget::new(0.1);
        let mut granted = 0;
        for sec in 0..30 {
            granted += (0..100).filter(|_| b.try_retry(sec * 1000)).count();
        }
        assert_eq!(granted, 30 * MIN_RETRIES_PER_SEC as usize);
    }

    #[test]
    fn the_window_forgets_old_attempts() {
        let mut b = RetryBudget::new(0.5);
        for _ in 0..100 {
            b.first_attempt(0);
        }
        assert_eq!(b.usage(5_000), (100, 0));
        assert_eq!(b.usage(11_000), (0, 0));
    }
}
