//! The process-wide bound on delivery attempts in flight (`delivery.max_in_flight`), taken by
//! a target's worker before it leases, on top of the target's own slots.
//!
//! Each webhook or NATS target has its own `delivery.concurrency` slots, and without a bound
//! across them in-flight attempts (and outbound connections) grew as targets × concurrency:
//! with 1,000 targets the router held 12,000 sockets, ran out of descriptors, refused its own
//! producers and charged its EMFILE to healthy receivers. A worker now holds one global permit
//! per attempt (or batch request) besides its target slot. It takes them before it leases,
//! so an entry never waits for a permit while its lease runs out, and waiting spends no
//! attempt: the entries stay queued.
//!
//! Handler targets do not take permits: their deliveries open no sockets, and their CPU is
//! bounded by `handlers.running_per_handler`. Counting them would let a webhook backlog hold
//! back handlers (and the other way round) for a resource neither uses.
//!
//! Fairness. The semaphore is FIFO, so waiting workers get freed permits in turn, one each:
//! allocation is round-robin across targets. But a slow target holds each permit for its
//! whole timeout while a fast one gives it back in milliseconds, so with equal allocation the
//! slow targets would end up holding nearly the whole pool and the fast ones would drain at
//! the slow ones' pace. The attempt timeout and the breaker do not prevent that: a receiver
//! that answers slowly but within its timeout never trips either. So while the pool is
//! contended (no free permit) a target already holding its fair share — the cap divided by the
//! targets that hold or want permits, at least one — does not queue for another until one of
//! its own comes back (or the pool has a free permit again). Uncontended, any target may use
//! the whole pool (up to its own slots): the share only applies when someone else waits.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::telemetry::Metrics;

/// How long a worker held back by its fair share sleeps at most before it looks again (it is
/// woken sooner when one of its target's permits comes back, or when the pool has a free
/// permit while someone is held back): a backstop for a missed wake-up.
const HELD_BACK_RECHECK: Duration = Duration::from_millis(100);

/// The global pool of delivery permits (`delivery.max_in_flight`).
pub struct InFlightCap {
    sem: Arc<Semaphore>,
    max: usize,
    /// Permits out now (the `router_delivery_in_flight` gauge follows it).
    in_flight: AtomicUsize,
    /// Targets holding at least one permit or waiting for one: the fair share's divisor.
    active: AtomicUsize,
    /// Workers waiting because their target holds its fair share of a contended pool.
    held_back: AtomicUsize,
    /// Woken when a permit is given back to a pool that then has a free one, while workers are
    /// held back: the contention that held them ended.
    freed: Notify,
    metrics: Option<Arc<Metrics>>,
    /// When (clock ms) the last WARN about the router's own exhaustion was written, and the
    /// ones not written since ([`Self::admit_exhaustion_log`]).
    exhaustion_logged: AtomicI64,
    exhaustion_suppressed: AtomicU64,
}

/// At most one WARN per this many ms about attempts the router's own exhaustion stopped: they
/// come by thousands at once, for every target, and the log is one of the things that needs
/// descriptors.
pub const EXHAUSTION_LOG_EVERY: i64 = 10_000;

/// A target's account with the pool: how many permits it holds, and a wake-up for when one
/// comes back. One per target runtime.
#[derive(Default)]
pub struct Share {
    /// Permits held, plus one while a worker waits for one: a target counts as active
    /// while it is above 0.
    claims: AtomicUsize,
    /// Permits held.
    held: AtomicUsize,
    released: Notify,
}

impl std::fmt::Debug for Share {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Share")
            .field("held", &self.held.load(Ordering::Relaxed))
            .finish()
    }
}

/// One attempt's (or batch request's) place in the global pool; given back on drop.
pub struct GlobalPermit {
    _permit: OwnedSemaphorePermit,
    cap: Arc<InFlightCap>,
    share: Arc<Share>,
}

impl std::fmt::Debug for GlobalPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GlobalPermit")
    }
}

impl Drop for GlobalPermit {
    fn drop(&mut self) {
        self.share.held.fetch_sub(1, Ordering::SeqCst);
        self.cap.unclaim(&self.share);
        let n = self.cap.in_flight.fetch_sub(1, Ordering::SeqCst) - 1;
        if let Some(m) = &self.cap.metrics {
            m.delivery_in_flight
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        self.share.released.notify_waiters();
        // The semaphore permit goes back after this body: whether the pool then has a free one
        // is only known then, so held-back workers are told a permit is coming back and look.
        if self.cap.held_back.load(Ordering::SeqCst) > 0 {
            self.cap.freed.notify_waiters();
        }
    }
}

impl InFlightCap {
    /// The cap `[delivery]` sets (`max_in_flight`, or its default from the open-file limit),
    /// reporting to `metrics`.
    pub fn of(cfg: &crate::config::DeliveryConfig, metrics: &Arc<Metrics>) -> Arc<Self> {
        Self::new(cfg.in_flight_limit(), Some(metrics.clone()))
    }

    /// A pool of `max` permits (at least 1), reporting to `metrics` when given.
    pub fn new(max: usize, metrics: Option<Arc<Metrics>>) -> Arc<Self> {
        let max = max.clamp(1, Semaphore::MAX_PERMITS);
        if let Some(m) = &metrics {
            m.delivery_max_in_flight
                .set(i64::try_from(max).unwrap_or(i64::MAX));
            m.delivery_in_flight.set(0);
        }
        Arc::new(Self {
            sem: Arc::new(Semaphore::new(max)),
            max,
            in_flight: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            held_back: AtomicUsize::new(0),
            freed: Notify::new(),
            metrics,
            exhaustion_logged: AtomicI64::new(i64::MIN),
            exhaustion_suppressed: AtomicU64::new(0),
        })
    }

    /// `delivery.max_in_flight` as applied.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Permits out now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Whether a WARN about the router's own exhaustion may be written at `now` (clock ms):
    /// `Some(lines suppressed since the last one)`, at most once per
    /// [`EXHAUSTION_LOG_EVERY`] across the router.
    pub fn admit_exhaustion_log(&self, now: i64) -> Option<u64> {
        let last = self.exhaustion_logged.load(Ordering::SeqCst);
        if now.saturating_sub(last) >= EXHAUSTION_LOG_EVERY
            && self
                .exhaustion_logged
                .compare_exchange(last, now, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            return Some(self.exhaustion_suppressed.swap(0, Ordering::SeqCst));
        }
        self.exhaustion_suppressed.fetch_add(1, Ordering::SeqCst);
        None
    }

    fn claim(&self, share: &Share) {
        if share.claims.fetch_add(1, Ordering::SeqCst) == 0 {
            self.active.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn unclaim(&self, share: &Share) {
        if share.claims.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.active.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// The most permits one target holds while others wait: the pool split evenly among the
    /// targets holding or waiting for permits, at least one.
    pub fn fair_share(&self) -> usize {
        let active = self.active.load(Ordering::SeqCst).max(1);
        (self.max / active).max(1)
    }

    /// Whether `share`'s target holds its fair share of a pool with no free permit.
    fn over_share(&self, share: &Share) -> bool {
        self.sem.available_permits() == 0 && share.held.load(Ordering::SeqCst) >= self.fair_share()
    }

    fn permit(self: &Arc<Self>, p: OwnedSemaphorePermit, share: &Arc<Share>) -> GlobalPermit {
        share.held.fetch_add(1, Ordering::SeqCst);
        self.claim(share);
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some(m) = &self.metrics {
            m.delivery_in_flight
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        GlobalPermit {
            _permit: p,
            cap: self.clone(),
            share: share.clone(),
        }
    }

    /// A permit for `share`'s target if one is free now, and the target is not over its fair
    /// share of a contended pool. Never waits: for the worker's further slots of a lease, and
    /// for a handoff at acceptance.
    pub fn try_acquire(self: &Arc<Self>, share: &Arc<Share>) -> Option<GlobalPermit> {
        if self.over_share(share) {
            return None;
        }
        let p = self.sem.clone().try_acquire_owned().ok()?;
        Some(self.permit(p, share))
    }

    /// A permit for `share`'s target, waiting (in turn with the other targets) while none is
    /// free, and while its target holds its fair share of a contended pool. Counts one wait
    /// when it had to. `None` if the pool is closed (never, in practice).
    pub async fn acquire(self: &Arc<Self>, share: &Arc<Share>) -> Option<GlobalPermit> {
        if let Some(p) = self.try_acquire(share) {
            return Some(p);
        }
        if let Some(m) = &self.metrics {
            m.delivery_permit_waits.inc();
        }
        // Waiting makes the target active, so the share others get already counts it. Undone
        // on drop: a worker told to stop while it waits (a reload, a shutdown) drops this
        // future, and a claim left behind shrank every target's share for good.
        let _claim = Claimed::new(self, share);
        self.wait(share).await
    }

    async fn wait(self: &Arc<Self>, share: &Arc<Share>) -> Option<GlobalPermit> {
        loop {
            if self.over_share(share) {
                let own = share.released.notified();
                let freed = self.freed.notified();
                let _held_back = HeldBack::new(&self.held_back);
                // Looked at again once registered: a permit given back in between is seen.
                if self.over_share(share) {
                    tokio::select! {
                        _ = own => {}
                        _ = freed => {}
                        _ = tokio::time::sleep(HELD_BACK_RECHECK) => {}
                    }
                }
                continue;
            }
            // In the semaphore's queue: FIFO among the targets waiting, one permit each.
            let p = self.sem.clone().acquire_owned().await.ok()?;
            return Some(self.permit(p, share));
        }
    }
}

/// A waiting worker's claim on the pool ([`InFlightCap::claim`]), given up on drop.
struct Claimed<'a> {
    cap: &'a InFlightCap,
    share: &'a Share,
}

impl<'a> Claimed<'a> {
    fn new(cap: &'a InFlightCap, share: &'a Share) -> Self {
        cap.claim(share);
        Self { cap, share }
    }
}

impl Drop for Claimed<'_> {
    fn drop(&mut self) {
        self.cap.unclaim(self.share);
    }
}

/// One worker counted in `held_back` while it exists.
struct HeldBack<'a>(&'a AtomicUsize);

impl<'a> HeldBack<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(count)
    }
}

impl Drop for HeldBack<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker stopped while it waits (its future dropped) leaves the pool as it found it.
    /// Before, its claim stayed: `active` one too high for good, and every target's fair
    /// share smaller, after each reload or stop that met a waiting worker.
    #[tokio::test(start_paused = true)]
    async fn a_wait_given_up_leaves_no_claim_behind() {
        let cap = InFlightCap::new(2, None);
        let (a, b) = (Arc::new(Share::default()), Arc::new(Share::default()));
        let held: Vec<_> = std::iter::from_fn(|| cap.try_acquire(&a)).take(2).collect();
        assert_eq!(cap.active.load(Ordering::SeqCst), 1);
        // `a` at its share of a full pool is held back; `b` queues in the semaphore.
        for share in [&a, &b] {
            let waiting = cap.acquire(share);
            tokio::pin!(waiting);
            assert!(
                tokio::time::timeout(Duration::from_millis(10), &mut waiting)
                    .await
                    .is_err()
            );
            assert_eq!(
                cap.active.load(Ordering::SeqCst),
                if Arc::ptr_eq(share, &a) { 1 } else { 2 }
            );
        }
        assert_eq!(cap.active.load(Ordering::SeqCst), 1, "b's claim given up");
        assert_eq!(cap.held_back.load(Ordering::SeqCst), 0);
        drop(held);
        assert_eq!(cap.active.load(Ordering::SeqCst), 0);
        assert_eq!(a.claims.load(Ordering::SeqCst), 0);
        assert_eq!(b.claims.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn the_exhaustion_warning_is_written_once_per_interval_with_the_count_suppressed() {
        let cap = InFlightCap::new(1, None);
        assert_eq!(cap.admit_exhaustion_log(1_000), Some(0));
        assert_eq!(cap.admit_exhaustion_log(1_001), None);
        assert_eq!(cap.admit_exhaustion_log(5_000), None);
        assert_eq!(
            cap.admit_exhaustion_log(1_000 + EXHAUSTION_LOG_EVERY),
            Some(2)
        );
    }

    #[test]
    fn permits_never_exceed_the_cap() {
        let cap = InFlightCap::new(3, None);
        let a = Arc::new(Share::default());
        let held: Vec<_> = std::iter::from_fn(|| cap.try_acquire(&a))
            .take(10)
            .collect();
        assert_eq!(held.len(), 3);
        assert_eq!(cap.in_flight(), 3);
        let b = Arc::new(Share::default());
        assert!(cap.try_acquire(&b).is_none());
        drop(held);
        assert_eq!(cap.in_flight(), 0);
        assert_eq!(cap.active.load(Ordering::SeqCst), 0);
        assert!(cap.try_acquire(&b).is_some());
    }

    /// Uncontended, one target may use the whole pool; the fair share is the pool split among
    /// the targets holding or wanting permits.
    #[test]
    fn the_fair_share_splits_the_pool_among_active_targets() {
        let cap = InFlightCap::new(8, None);
        assert_eq!(cap.fair_share(), 8);
        let a = Arc::new(Share::default());
        let b = Arc::new(Share::default());
        let pa: Vec<_> = (0..6).filter_map(|_| cap.try_acquire(&a)).collect();
        assert_eq!(pa.len(), 6, "a free pool is anyone's");
        assert_eq!(cap.fair_share(), 8);
        let pb: Vec<_> = (0..2).filter_map(|_| cap.try_acquire(&b)).collect();
        assert_eq!(pb.len(), 2);
        assert_eq!(cap.fair_share(), 4);
        // Full: a is over its share, b is not (but there is nothing free for it either).
        assert!(cap.over_share(&a));
        assert!(!cap.over_share(&b));
    }

    /// A slow target holding most of a contended pool does not queue for more: permits given
    /// back go to the target below its share, however often the slow one asks.
    #[tokio::test]
    async fn a_target_over_its_share_waits_while_others_below_it_get_the_permits() {
        let cap = InFlightCap::new(4, None);
        let slow = Arc::new(Share::default());
        let fast = Arc::new(Share::default());
        let mut slow_held: Vec<_> = (0..4).filter_map(|_| cap.try_acquire(&slow)).collect();
        assert_eq!(slow_held.len(), 4);
        // The slow target wants a fifth: it is over its share (4 of 4 with one target active),
        // and will be once the fast one shows up too.
        let slow_wait = {
            let (cap, slow) = (cap.clone(), slow.clone());
            tokio::spawn(async move { cap.acquire(&slow).await })
        };
        let fast_wait = {
            let (cap, fast) = (cap.clone(), fast.clone());
            tokio::spawn(async move { cap.acquire(&fast).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(cap.fair_share(), 2, "two targets active");
        // One slow attempt ends: the permit goes to the fast target (below its share), not
        // back to the slow one, which still holds 3 > 2.
        slow_held.pop();
        let fast_permit = tokio::time::timeout(Duration::from_secs(5), fast_wait)
            .await
            .expect("the fast target gets the freed permit")
            .expect("task")
            .expect("permit");
        assert!(!slow_wait.is_finished());
        assert_eq!(cap.in_flight(), 4);
        // Two more slow attempts end: the slow target is below its share and gets one.
        slow_held.pop();
        slow_held.pop();
        let slow_permit = tokio::time::timeout(Duration::from_secs(5), slow_wait)
            .await
            .expect("the slow target gets a permit once below its share")
            .expect("task")
            .expect("permit");
        assert!(cap.in_flight() <= cap.max());
        drop((fast_permit, slow_permit, slow_held));
        assert_eq!(cap.in_flight(), 0);
        assert_eq!(cap.active.load(Ordering::SeqCst), 0);
    }

    /// Waiting workers of several targets get freed permits in turn, and the count never
    /// passes the cap, however many targets ask at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_targets_never_hold_more_than_the_cap() {
        let cap = InFlightCap::new(5, None);
        let peak = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..20 {
            let (cap, peak) = (cap.clone(), peak.clone());
            let share = Arc::new(Share::default());
            tasks.push(tokio::spawn(async move {
                for _ in 0..20 {
                    let p = cap.acquire(&share).await.expect("permit");
                    peak.fetch_max(cap.in_flight(), Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    drop(p);
                }
            }));
        }
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(30), t)
                .await
                .expect("every target gets its permits")
                .expect("task");
        }
        assert!(peak.load(Ordering::SeqCst) <= 5, "{peak:?}");
        assert_eq!(cap.in_flight(), 0);
    }
}
