//! Retry budget (Finagle's model): over a sliding window, retries may be at most `ratio` of
//! the target's first attempts, plus a guaranteed minimum per second so that a backlog made
//! only of retries still drains. Past it, due retries are deferred (not dropped, not counted
//! as attempts). Half-open probes bypass the budget (the caller does not ask).

use std::collections::VecDeque;

/// Window over which the budget is computed (Finagle's default TTL).
pub const WINDOW_MS: i64 = 10_000;
/// Retries always allowed per second, whatever the ratio.
pub const MIN_RETRIES_PER_SEC: u32 = 10;

/// The ratio of a target whose policy sets no `retry_budget` (the SPEC's default).
pub const DEFAULT_RATIO: f64 = 0.1;

/// Soonest a deferred retry is considered again.
const MIN_DEFER_MS: i64 = 250;

/// The budget of one target.
#[derive(Debug, Clone)]
pub struct RetryBudget {
    ratio: f64,
    /// (second, first attempts, retries on the per-second minimum, retries on the ratio),
    /// oldest first.
    buckets: VecDeque<(i64, u32, u32, u32)>,
    /// The next free slot for a deferred retry (`defer_until`).
    next_slot: i64,
}

impl RetryBudget {
    /// A budget allowing retries up to `ratio` of first attempts (plus the minimum).
    pub fn new(ratio: f64) -> Self {
        Self {
            ratio: ratio.clamp(0.0, 1.0),
            buckets: VecDeque::new(),
            next_slot: 0,
        }
    }

    /// When a retry refused now should be considered again: each refused retry gets its own
    /// slot, spaced at the rate the budget grants retries (the per-second minimum plus the
    /// ratio of the window's first attempts), from the next second on. Every refused retry
    /// coming back every 250 ms instead cost a lease and a release each time: measured, 2,000
    /// failing entries under a 10% budget made ~5,000 deferrals/s, a whole core and 34 MB/s
    /// of writes, for 10-35 retries/s sent.
    pub fn defer_until(&mut self, now: i64) -> i64 {
        let (attempts, _) = self.usage(now);
        let window_secs = (WINDOW_MS / 1000) as f64;
        let rate = f64::from(MIN_RETRIES_PER_SEC) + self.ratio * f64::from(attempts) / window_secs;
        // At least 1 ms apart; the rate is at least the minimum, so at most 100 ms.
        let step = ((1000.0 / rate).ceil() as i64).max(1);
        let next_second = (now / 1000 + 1) * 1000;
        let slot = self.next_slot.max(next_second).max(now + MIN_DEFER_MS);
        self.next_slot = slot + step;
        slot
    }

    /// The ratio in force.
    pub fn ratio(&self) -> f64 {
        self.ratio
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
    fn refused_retries_come_back_spread_at_the_budgets_rate() {
        let mut b = RetryBudget::new(0.1);
        let now = 5_500;
        let slots: Vec<i64> = (0..30).map(|_| b.defer_until(now)).collect();
        // From the next second, 10 a second (the minimum: no first attempts in the window).
        assert_eq!(slots[0], 6_000);
        assert_eq!(slots[10], 7_000);
        assert_eq!(slots[29], 8_900);
        assert!(slots.windows(2).all(|w| w[1] - w[0] == 100));
        // With first attempts flowing the budget grants more, so the slots come closer.
        let mut b = RetryBudget::new(0.1);
        for _ in 0..1_000 {
            b.first_attempt(now);
        }
        let (a, c) = (b.defer_until(now), b.defer_until(now));
        assert_eq!(c - a, 50, "10/s minimum + 10% of 1,000 over 10 s = 20/s");
    }

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
