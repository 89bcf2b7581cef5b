//! Circuit breaker, one per target: closed → open when the failure rate over a sliding window
//! passes the threshold (with a minimum of requests) or after N consecutive failures →
//! half-open after `open_for`, letting a few probes through → closed on a probe's success,
//! open again on its failure.
//!
//! Pure state machine: time comes in as `now` (ms), so tests drive it without sleeping. Only
//! outcomes that say something about the target count (`AttemptOutcome::counts_for_breaker`
//! for failures, deliveries for successes); permanent failures are about the event and are not
//! recorded at all. The open state (and its end) is persisted by the caller on transitions.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::config::BreakerPolicy;

/// Where the breaker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum BreakerState {
    /// Attempts flow.
    Closed,
    /// No attempts until `until` (ms).
    Open {
        /// When probing may start.
        until: i64,
    },
    /// Up to the policy's probes may be in flight.
    HalfOpen,
}

impl BreakerState {
    /// The state's name: `closed`, `open`, `half_open`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open { .. } => "open",
            Self::HalfOpen => "half_open",
        }
    }

    /// The state as `router_breaker_state` shows it: 0 closed, 1 open, 2 half-open.
    pub fn gauge(&self) -> i64 {
        match self {
            Self::Closed => 0,
            Self::Open { .. } => 1,
            Self::HalfOpen => 2,
        }
    }
}

/// What the breaker allows right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Normal operation: as many attempts as other limits allow.
    Open,
    /// Half-open: at most this many more probes.
    Probes(u32),
    /// Nothing until this time (ms).
    WaitUntil(i64),
}

/// A state change, for metrics, logs and system events.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Transition {
    /// Previous state.
    pub from: BreakerState,
    /// New state.
    pub to: BreakerState,
    /// Failure rate in the window when it happened.
    pub failure_rate: f64,
    /// Attempts in the window when it happened.
    pub requests: u32,
    /// Part of a cycle this node's breaker began by following another node's open breaker
    /// ([`Breaker::follow_open`]): its opening, and the half-open and close after it. That
    /// node persisted and announced its own cycle; this one only counts and logs.
    pub followed: bool,
}

/// The breaker.
#[derive(Debug, Clone)]
pub struct Breaker {
    policy: BreakerPolicy,
    state: BreakerState,
    since: i64,
    /// (second, successes, failures), oldest first, covering the window.
    buckets: VecDeque<(i64, u32, u32)>,
    consecutive_failures: u32,
    probes_in_flight: u32,
    /// The current open or half-open cycle began by following another node.
    followed: bool,
    /// When the current open or half-open cycle began (the breaker opened): a close made on
    /// another node after it is followed ([`Self::follow_close`]).
    opened_at: i64,
}

impl Breaker {
    /// A closed breaker (or the persisted state, via `restore`).
    pub fn new(policy: BreakerPolicy, now: i64) -> Self {
        Self {
            policy,
            state: BreakerState::Closed,
            since: now,
            buckets: VecDeque::new(),
            consecutive_failures: 0,
            probes_in_flight: 0,
            followed: false,
            opened_at: now,
        }
    }

    /// Restores a persisted state (the window's counts are not persisted: a restarted router
    /// starts counting afresh, but an open breaker stays open until its time).
    pub fn restore(&mut self, state: BreakerState, since: i64) {
        self.state = state;
        self.since = since;
        self.opened_at = since;
    }

    /// Goes on under `policy`, a target's policy edited by a reload, keeping what it has
    /// seen. The window's counts are per second, so they read under a new `window` as they
    /// are: a shorter one leaves out the older seconds at the next look, a longer one has no
    /// counts from before the old window (they were already dropped) and fills up as attempts
    /// come. A new `failure_rate`, `min_requests` or `consecutive_failures` is asked at the
    /// next counted failure, and a new `half_open_probes` at the next admission. An open
    /// breaker keeps the end it was given: the new `open_for` applies from the next opening
    /// (an edit does not cut an outage's wait short, nor make it longer, halfway through).
    pub fn set_policy(&mut self, policy: BreakerPolicy) {
        self.policy = policy;
    }

    /// Current state as recorded: an open state stays open past its `until` until the next
    /// admission moves it to half-open ([`Self::state_at`] reads it with the clock applied).
    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// The state in effect at `now`: an open state whose `until` has passed reads as
    /// half-open, what the next admission makes it. A paused target's worker asks for no
    /// admission, so its breaker stayed "open" with an `open_until` in the past (and
    /// `router_breaker_state` 1, alerting) for as long as the pause lasted, though nothing
    /// waited on it any more.
    pub fn state_at(&self, now: i64) -> BreakerState {
        match self.state {
            BreakerState::Open { until } if now >= until => BreakerState::HalfOpen,
            s => s,
        }
    }

    /// When the state in effect at `now` ([`Self::state_at`]) began: an expired open state's
    /// half-open began when its open period ended.
    pub fn since_at(&self, now: i64) -> i64 {
        match self.state {
            BreakerState::Open { until } if now >= until => until,
            _ => self.since,
        }
    }

    /// When the current state began.
    pub fn since(&self) -> i64 {
        self.since
    }

    fn window_ms(&self) -> i64 {
        i64::try_from(self.policy.window.as_millis()).unwrap_or(i64::MAX)
    }

    fn prune(&mut self, now: i64) {
        let oldest = now.saturating_sub(self.window_ms()) / 1000;
        while self.buckets.front().is_some_and(|b| b.0 <= oldest) {
            self.buckets.pop_front();
        }
    }

    /// (requests, failure rate) over the window.
    pub fn window_stats(&mut self, now: i64) -> (u32, f64) {
        self.prune(now);
        let (s, f) = self
            .buckets
            .iter()
            .fold((0u32, 0u32), |(s, f), b| (s + b.1, f + b.2));
        let n = s + f;
        (
            n,
            if n == 0 {
                0.0
            } else {
                f64::from(f) / f64::from(n)
            },
        )
    }

    fn transition(&mut self, to: BreakerState, now: i64) -> Transition {
        let (requests, failure_rate) = self.window_stats(now);
        if matches!(to, BreakerState::Open { .. }) {
            // Opened on this node's own evidence (follow_open marks its own opening after).
            self.followed = false;
            self.opened_at = now;
        }
        let t = Transition {
            from: self.state,
            to,
            failure_rate,
            requests,
            followed: self.followed,
        };
        self.state = to;
        self.since = now;
        self.probes_in_flight = 0;
        if to == BreakerState::Closed {
            self.buckets.clear();
            self.consecutive_failures = 0;
            self.followed = false;
        }
        t
    }

    /// What may be attempted now; moves open → half-open when `open_for` has passed.
    pub fn admit(&mut self, now: i64) -> (Admission, Option<Transition>) {
        match self.state {
            BreakerState::Closed => (Admission::Open, None),
            BreakerState::Open { until } if now < until => (Admission::WaitUntil(until), None),
            BreakerState::Open { .. } => {
                let t = self.transition(BreakerState::HalfOpen, now);
                (
                    Admission::Probes(self.policy.half_open_probes.max(1)),
                    Some(t),
                )
            }
            BreakerState::HalfOpen => (
                Admission::Probes(
                    self.policy
                        .half_open_probes
                        .max(1)
                        .saturating_sub(self.probes_in_flight),
                ),
                None,
            ),
        }
    }

    /// Opens a closed breaker until `until` because another router node's breaker for the same
    /// target opened (on a store several nodes share), but only when this node has itself seen
    /// a counted failure of the target in its window: a failure only one node sees (its own
    /// network path) then stays that node's. Returns the transition, if the breaker opened.
    pub fn follow_open(&mut self, until: i64, now: i64) -> Option<Transition> {
        if self.state != BreakerState::Closed || until <= now {
            return None;
        }
        let (requests, failure_rate) = self.window_stats(now);
        if requests == 0 || failure_rate == 0.0 {
            return None;
        }
        let mut t = self.transition(BreakerState::Open { until }, now);
        self.followed = true;
        t.followed = true;
        Some(t)
    }

    /// Closes a half-open breaker because another router node's breaker for the same target
    /// closed at `closed_at` (its probe succeeded), after this one opened: the target answered
    /// there since this node's own evidence against it. Without it a node with no traffic of
    /// its own stayed half-open for good on a healthy target (and `router_breaker_state` 2
    /// went on alerting). A close from before this breaker opened says nothing about what it
    /// opened on, and an open breaker waits out its period: each node still opens on its own
    /// evidence, and probes on its own when it has traffic. Returns the transition, if any.
    pub fn follow_close(&mut self, closed_at: i64, now: i64) -> Option<Transition> {
        if self.state_at(now) != BreakerState::HalfOpen || closed_at <= self.opened_at {
            return None;
        }
        let mut t = self.transition(BreakerState::Closed, now);
        t.followed = true;
        Some(t)
    }

    /// Marks `n` probes as started (half-open only).
    pub fn probes_started(&mut self, n: u32) {
        if self.state == BreakerState::HalfOpen {
            self.probes_in_flight += n;
        }
    }

    /// Records a finished attempt: `Some(true)` success, `Some(false)` a failure that counts,
    /// `None` an outcome that does not count (permanent failure). Returns a transition if any.
    pub fn record(
        &mut self,
        success: Option<bool>,
        was_probe: bool,
        now: i64,
    ) -> Option<Transition> {
        // A probe's slot comes back however it ended: one that was not sent, or whose answer
        // does not count (a permanent failure, a busy handler), would otherwise hold it for
        // good and leave the breaker half-open with no probe ever allowed again.
        if was_probe && self.state == BreakerState::HalfOpen {
            self.probes_in_flight = self.probes_in_flight.saturating_sub(1);
        }
        let success = success?;
        let sec = now / 1000;
        match self.buckets.back_mut() {
            Some(b) if b.0 == sec => {
                if success {
                    b.1 += 1
                } else {
                    b.2 += 1
                }
            }
            _ => self
                .buckets
                .push_back((sec, u32::from(success), u32::from(!success))),
        }
        self.consecutive_failures = if success {
            0
        } else {
            self.consecutive_failures + 1
        };
        // Saturating: policies bound `open_for` (`MAX_POLICY_DURATION`), but a breaker built
        // from any other policy must not panic the delivery task over a sum.
        let open_until =
            now.saturating_add(i64::try_from(self.policy.open_for.as_millis()).unwrap_or(i64::MAX));
        match self.state {
            // Only a probe decides a half-open breaker: a late answer to an attempt sent
            // before it opened says nothing about the target now.
            BreakerState::HalfOpen if !was_probe => None,
            BreakerState::HalfOpen if success => Some(self.transition(BreakerState::Closed, now)),
            BreakerState::HalfOpen => {
                Some(self.transition(BreakerState::Open { until: open_until }, now))
            }
            BreakerState::Closed if !success => {
                let (n, rate) = self.window_stats(now);
                let by_rate = n >= self.policy.min_requests && rate >= self.policy.failure_rate;
                let by_streak = self
                    .policy
                    .consecutive_failures
                    .is_some_and(|c| self.consecutive_failures >= c);
                (by_rate || by_streak)
                    .then(|| self.transition(BreakerState::Open { until: open_until }, now))
            }
            // Late results of attempts that started before the breaker opened change nothing.
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// An open breaker whose `open_for` has passed reads as half-open at once, though only
    /// the next admission (none while the target is paused) records the transition.
    #[test]
    fn an_expired_open_state_reads_as_half_open() {
        let mut b = Breaker::new(BreakerPolicy::default(), 0);
        b.restore(BreakerState::Open { until: 5_000 }, 1_000);
        assert_eq!(b.state_at(4_999), BreakerState::Open { until: 5_000 });
        assert_eq!(b.since_at(4_999), 1_000);
        assert_eq!(b.state_at(60_000), BreakerState::HalfOpen);
        assert_eq!(b.since_at(60_000), 5_000);
        assert_eq!(
            b.state(),
            BreakerState::Open { until: 5_000 },
            "nothing recorded"
        );
        assert_eq!(b.admit(60_000).0, Admission::Probes(1));
        assert_eq!(b.state(), BreakerState::HalfOpen);
    }

    fn policy() -> BreakerPolicy {
        BreakerPolicy {
            failure_rate: 0.5,
            min_requests: 4,
            window: Duration::from_secs(10),
            open_for: Duration::from_secs(5),
            half_open_probes: 1,
            consecutive_failures: None,
        }
    }

    #[test]
    fn a_probe_that_does_not_count_gives_its_slot_back() {
        let mut b = Breaker::new(policy(), 0);
        for t in 0..4 {
            b.record(Some(false), false, t);
        }
        assert_eq!(
            b.admit(6000).0,
            Admission::Probes(1),
            "half-open after open_for"
        );
        b.probes_started(1);
        assert_eq!(
            b.admit(6000).0,
            Admission::Probes(0),
            "the probe is in flight"
        );
        // Not sent (attempts or max_age ran out), or a permanent failure or a busy handler:
        // no verdict on the target, but the next probe may go.
        assert_eq!(b.record(None, true, 6100), None);
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert_eq!(b.admit(6100).0, Admission::Probes(1));
        b.probes_started(1);
        let t = b
            .record(Some(true), true, 6200)
            .expect("the probe's success closes it");
        assert_eq!(t.to, BreakerState::Closed);
    }

    /// An `open_for` no policy allows any more (validation bounds it) does not overflow the
    /// breaker's end: it used to panic the delivery task with the entry in flight.
    #[test]
    fn an_absurd_open_for_saturates_instead_of_panicking() {
        let mut b = Breaker::new(
            BreakerPolicy {
                open_for: Duration::from_secs(99_999_999_999_999 * 86_400),
                window: Duration::MAX,
                consecutive_failures: Some(1),
                ..policy()
            },
            0,
        );
        let t = b
            .record(Some(false), false, 1_700_000_000_000)
            .expect("opens at the first failure");
        assert_eq!(t.to, BreakerState::Open { until: i64::MAX });
    }

    #[test]
    fn opens_on_failure_rate_with_a_minimum_of_requests() {
        let mut b = Breaker::new(policy(), 0);
        assert_eq!(b.record(Some(false), false, 0), None);
        assert_eq!(b.record(Some(false), false, 10), None, "below min_requests");
        assert_eq!(b.record(Some(true), false, 20), None);
        let t = b
            .record(Some(false), false, 30)
            .expect("opens: 3 of 4 failed");
        assert_eq!(t.to, BreakerState::Open { until: 5030 });
        assert_eq!(b.admit(1000).0, Admission::WaitUntil(5030));
    }

    #[test]
    fn a_half_open_breaker_follows_a_close_made_elsewhere_after_it_opened() {
        let mut b = Breaker::new(policy(), 0);
        let opened = (0..4).find_map(|_| b.record(Some(false), false, 1_000));
        let until = match opened.map(|t| t.to) {
            Some(BreakerState::Open { until }) => until,
            s => panic!("{s:?}"),
        };
        // Still open: it waits out its period whatever the others did.
        assert!(b.follow_close(until - 1, until - 1).is_none());
        // Half-open (by the clock, before any admission): a close from before it opened says
        // nothing; one after does.
        assert!(b.follow_close(900, until + 10).is_none());
        let t = b.follow_close(5_000, until + 10).expect("follows");
        assert!(t.followed && t.to == BreakerState::Closed, "{t:?}");
        assert_eq!(b.state(), BreakerState::Closed);
        assert!(
            b.follow_close(6_000, until + 20).is_none(),
            "already closed"
        );

        // Half-open after an admission, then a close elsewhere: followed too.
        assert!(
            (0..4)
                .find_map(|_| b.record(Some(false), false, 20_000))
                .is_some()
        );
        let (_, half) = b.admit(40_000);
        assert_eq!(half.map(|t| t.to), Some(BreakerState::HalfOpen));
        assert!(b.follow_close(40_500, 41_000).is_some());

        // Restored half-open (written by a node before half-open stopped being stored on a
        // shared store) since 50 000: a later close is followed, an earlier one not.
        let mut r = Breaker::new(policy(), 60_000);
        r.restore(BreakerState::HalfOpen, 50_000);
        assert!(r.follow_close(49_000, 60_000).is_none());
        assert!(r.follow_close(55_000, 60_000).is_some());
    }

    #[test]
    fn another_nodes_open_breaker_is_followed_only_after_a_failure_seen_here() {
        let mut b = Breaker::new(policy(), 0);
        assert_eq!(b.follow_open(9_000, 100), None, "no failure seen here");
        b.record(Some(true), false, 200);
        assert_eq!(b.follow_open(9_000, 300), None, "only successes here");
        b.record(Some(false), false, 400);
        assert_eq!(b.follow_open(300, 500), None, "already over");
        let t = b.follow_open(9_000, 500).expect("follows");
        assert_eq!(t.to, BreakerState::Open { until: 9_000 });
        assert_eq!(b.admit(600).0, Admission::WaitUntil(9_000));
        assert_eq!(b.follow_open(12_000, 700), None, "already open");
        // After its time, half-open as if it had opened here; the cycle is marked as
        // followed up to its close, and the next opening on its own evidence is not.
        let (admission, half) = b.admit(9_001);
        assert_eq!(admission, Admission::Probes(1));
        assert!(t.followed && half.expect("half-opens").followed);
        b.probes_started(1);
        let closed = b
            .record(Some(true), true, 9_100)
            .expect("the probe closes it");
        assert!(closed.followed && closed.to == BreakerState::Closed);
        for at in 9_200..9_230 {
            if let Some(t) = b.record(Some(false), false, at) {
                assert!(!t.followed, "opened here: {t:?}");
                return;
            }
        }
        panic!("the breaker did not open on its own failures");
    }

    #[test]
    fn permanent_failures_do_not_count() {
        let mut b = Breaker::new(policy(), 0);
        for i in 0..100 {
            assert_eq!(b.record(None, false, i), None);
        }
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn half_open_after_open_for_then_closed_on_probe_success() {
        let mut b = Breaker::new(policy(), 0);
        for i in 0..4 {
            b.record(Some(false), false, i);
        }
        assert!(matches!(b.state(), BreakerState::Open { .. }));
        let (adm, t) = b.admit(5003);
        assert_eq!(adm, Admission::Probes(1));
        assert_eq!(t.map(|t| t.to), Some(BreakerState::HalfOpen));
        b.probes_started(1);
        assert_eq!(b.admit(5004).0, Admission::Probes(0), "one probe at a time");
        let t = b.record(Some(true), true, 5100).expect("closes");
        assert_eq!(t.to, BreakerState::Closed);
        assert_eq!(b.admit(5101).0, Admission::Open);
    }

    #[test]
    fn a_failed_probe_opens_again() {
        let mut b = Breaker::new(policy(), 0);
        for i in 0..4 {
            b.record(Some(false), false, i);
        }
        b.admit(6000);
        b.probes_started(1);
        let t = b.record(Some(false), true, 6100).expect("reopens");
        assert_eq!(t.to, BreakerState::Open { until: 11_100 });
    }

    #[test]
    fn a_late_answer_to_an_attempt_sent_before_opening_decides_nothing() {
        let mut b = Breaker::new(policy(), 0);
        for i in 0..4 {
            b.record(Some(false), false, i);
        }
        b.admit(6000);
        b.probes_started(1);
        assert_eq!(b.record(Some(true), false, 6050), None, "not a probe");
        assert_eq!(b.record(Some(false), false, 6060), None, "not a probe");
        assert_eq!(b.state(), BreakerState::HalfOpen);
        let t = b
            .record(Some(true), true, 6100)
            .expect("the probe closes it");
        assert_eq!(t.to, BreakerState::Closed);
    }

    #[test]
    fn old_failures_leave_the_window() {
        let mut b = Breaker::new(policy(), 0);
        for i in 0..3 {
            b.record(Some(false), false, i);
        }
        // 20 s later the window (10 s) holds only the new failure: 1 < min_requests.
        assert_eq!(b.record(Some(false), false, 20_000), None);
        assert_eq!(b.window_stats(20_000).0, 1);
    }

    #[test]
    fn a_new_policy_keeps_the_window_and_the_state() {
        let mut b = Breaker::new(policy(), 0);
        for t in [0, 1000, 2000] {
            assert_eq!(b.record(Some(false), false, t), None, "below min_requests");
        }
        // A reload edits the policy: the failures seen count towards the new minimum.
        b.set_policy(BreakerPolicy {
            min_requests: 3,
            window: Duration::from_secs(20),
            ..policy()
        });
        assert_eq!(b.window_stats(3000).0, 3);
        let t = b
            .record(Some(false), false, 3000)
            .expect("4 failures of 4 pass the new minimum");
        assert_eq!(t.to, BreakerState::Open { until: 8000 });
        // An open breaker keeps its end under a new open_for; the next opening uses it.
        b.set_policy(BreakerPolicy {
            open_for: Duration::from_secs(60),
            ..policy()
        });
        assert_eq!(b.admit(7000).0, Admission::WaitUntil(8000));
        // A shorter window leaves out the older seconds.
        b.set_policy(BreakerPolicy {
            window: Duration::from_secs(2),
            ..policy()
        });
        assert_eq!(b.window_stats(3500).0, 2, "the seconds 2 and 3 only");
    }

    #[test]
    fn consecutive_failures_open_without_a_rate() {
        let mut p = policy();
        p.min_requests = 1000;
        p.consecutive_failures = Some(3);
        let mut b = Breaker::new(p, 0);
        b.record(Some(false), false, 0);
        b.record(Some(false), false, 1);
        assert!(b.record(Some(false), false, 2).is_some());
    }
}
