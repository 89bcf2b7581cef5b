//! Ingest admission: bounds what ingest holds at once — the request bytes (bodies being read,
//! checked, or waiting for their commit) and the events (parsed, checked, or waiting for their
//! commit) — so that a saturated router answers producers `503` with `Retry-After` instead of
//! queueing them until their own timeouts fire.
//!
//! Past the committer's pace every request waits for the commit of all those ahead of it:
//! without a bound, four times the producers meant four times the latency and the memory
//! (audited: 64 producers of 1 MB batches waited 5–7 s each, no refusal ever). Bytes alone
//! were not enough: 64 producers of batches of 1,000 small events fit in 16 MiB and waited
//! 14–18 s, so events are bounded too, once a request's body is parsed and its count known.
//!
//! Bytes are counted as they arrive, not at the declared `Content-Length`: reserving the
//! declared length before the body was read let 16 connections that declared 1 MiB and sent
//! 2 bytes a second hold all 16 MiB for `server.request_timeout` while using no memory
//! (audited: 72 % of other producers' events got 503). Each piece the connection hands over
//! is accounted before it is kept; a piece that finds no room waits up to
//! `ingest.admission_wait`, then the request is refused.
//!
//! A request holding part of its body while it waits for room for the next piece could
//! deadlock with others doing the same (64 producers of 1 MiB fill 16 MiB with quarter
//! bodies). So one request at a time (the overdraft) may go past the bound, by at most one
//! body (`ingest.max_body_bytes`): a waiting request that already holds bytes takes it, reads
//! its body to the end, and gives it back with its answer. The bound on the bytes held is
//! therefore `max_in_flight_bytes + max_body_bytes`, plus, for each request waiting for room,
//! the one piece it received and has not yet accounted (one read of its connection: at most
//! hyper's read buffer, `server.max_header_bytes` + 8 KiB).
//!
//! Neither bound is FIFO: a request whose share fits in the free room takes it at once, even
//! while a larger one waits (tokio's semaphore made a 150-byte event wait behind 1 MiB ones).
//! A large share can be overtaken and refused after its wait; it is the heavy producer that
//! gets the 503, not whoever arrives next.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Which bound refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// `ingest.max_in_flight_bytes`.
    Bytes,
    /// `ingest.max_in_flight_events`.
    Events,
}

impl Bound {
    /// The `bound` label of `router_ingest_saturated_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Bound::Bytes => "bytes",
            Bound::Events => "events",
        }
    }

    /// The configuration key of the bound.
    pub fn key(self) -> &'static str {
        match self {
            Bound::Bytes => "ingest.max_in_flight_bytes",
            Bound::Events => "ingest.max_in_flight_events",
        }
    }
}

/// Sizes of the bounds, as configured.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// `ingest.max_in_flight_bytes`.
    pub bytes: usize,
    /// `ingest.max_in_flight_events`.
    pub events: usize,
    /// `ingest.max_body_bytes`: the most one request reads past the byte bound (overdraft).
    pub max_body: usize,
    /// `ingest.admission_wait`: how long a share waits for room.
    pub wait: Duration,
}

/// Refusal counters, one per bound (`router_ingest_saturated_total{bound}`).
#[derive(Debug, Clone, Default)]
pub struct Refusals {
    /// Requests refused for want of room under the byte bound.
    pub bytes: Counter,
    /// Requests refused for want of room under the event bound.
    pub events: Counter,
}

/// Units held against a capacity, taken without queueing: room goes to whichever share fits.
#[derive(Debug)]
struct Pool {
    held: AtomicUsize,
    capacity: usize,
    /// Tasks waiting for room: a release wakes them only when there are some, so the
    /// uncontended path is two atomic operations and no lock.
    waiters: AtomicUsize,
    freed: Notify,
}

/// Counts a waiter for as long as it waits.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Pool {
    fn new(capacity: usize) -> Self {
        Self {
            held: AtomicUsize::new(0),
            capacity: capacity.max(1),
            waiters: AtomicUsize::new(0),
            freed: Notify::new(),
        }
    }

    /// Takes `n` if the total stays within `limit`.
    fn try_take(&self, n: usize, limit: usize) -> bool {
        self.held
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |h| {
                h.checked_add(n).filter(|&t| t <= limit)
            })
            .is_ok()
    }

    fn give(&self, n: usize) {
        if n == 0 {
            return;
        }
        self.held.fetch_sub(n, Ordering::SeqCst);
        self.wake();
    }

    fn wake(&self) {
        // SeqCst on both sides: either the waiter's check after registering sees this
        // release, or this load sees the waiter (which `enable`d its wake-up before checking).
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.freed.notify_waiters();
        }
    }

    /// Retries `attempt` each time room is given back, until it succeeds or `deadline`.
    async fn wait_for(&self, deadline: Instant, mut attempt: impl FnMut() -> bool) -> bool {
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let _waiting = Waiting(&self.waiters);
        loop {
            let notified = self.freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if attempt() {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return attempt();
            }
        }
    }

    fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }
}

/// What ingest may hold at once, and how long a request waits for its share.
#[derive(Debug)]
pub struct Admission {
    bytes: Pool,
    events: Pool,
    max_body: usize,
    /// Taken by the one request allowed past the byte bound (see the module's doc).
    overdraft: AtomicBool,
    wait: Duration,
    refused: Refusals,
}

/// Room held by one request; given back when dropped (its answer is built).
#[derive(Debug)]
pub struct Admitted<'a> {
    admission: &'a Admission,
    bytes: usize,
    events: usize,
    overdraft: bool,
}

/// A request refused because ingest stayed full for the whole wait.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saturated {
    /// The bound that had no room.
    pub bound: Bound,
    /// Bytes or events the request asked for (events clamped to the capacity).
    pub asked: usize,
    /// Bytes or events held by the requests in flight when it gave up.
    pub in_flight: usize,
    /// The bound's capacity.
    pub capacity: usize,
    /// How long it waited.
    pub waited: Duration,
}

impl Bounds {
    /// The bounds `[ingest]` sets: `max_in_flight_bytes`, `max_in_flight_events`,
    /// `max_body_bytes` and `admission_wait`.
    pub fn of(cfg: &crate::config::IngestConfig) -> Self {
        Self {
            bytes: cfg.max_in_flight_bytes,
            events: cfg.max_in_flight_events,
            max_body: cfg.max_body_bytes,
            wait: cfg.admission_wait,
        }
    }
}

impl Admission {
    /// Room for `bounds.bytes` bytes and `bounds.events` events (each at least 1); a share
    /// waits up to `bounds.wait` for room, and a refusal counts in `refused`.
    pub fn new(bounds: Bounds, refused: Refusals) -> Self {
        Self {
            bytes: Pool::new(bounds.bytes),
            events: Pool::new(bounds.events),
            max_body: bounds.max_body,
            overdraft: AtomicBool::new(false),
            wait: bounds.wait,
            refused,
        }
    }

    /// Starts a request's admission. It holds nothing until bytes arrive.
    pub fn begin(&self) -> Admitted<'_> {
        Admitted {
            admission: self,
            bytes: 0,
            events: 0,
            overdraft: false,
        }
    }

    /// Bytes held by the requests in flight now.
    pub fn in_flight_bytes(&self) -> usize {
        self.bytes.held()
    }

    /// `ingest.max_in_flight_bytes`, as applied.
    pub fn capacity(&self) -> usize {
        self.bytes.capacity
    }

    /// Events held by the requests in flight now.
    pub fn in_flight_events(&self) -> usize {
        self.events.held()
    }

    /// `ingest.max_in_flight_events`, as applied.
    pub fn events_capacity(&self) -> usize {
        self.events.capacity
    }

    /// Requests refused as saturated since the start, by either bound.
    pub fn refused(&self) -> u64 {
        self.refused.bytes.get() + self.refused.events.get()
    }

    /// Requests refused since the start by `bound`.
    pub fn refused_by(&self, bound: Bound) -> u64 {
        match bound {
            Bound::Bytes => self.refused.bytes.get(),
            Bound::Events => self.refused.events.get(),
        }
    }

    fn refuse(&self, bound: Bound, asked: usize) -> Saturated {
        let pool = match bound {
            Bound::Bytes => {
                self.refused.bytes.inc();
                &self.bytes
            }
            Bound::Events => {
                self.refused.events.inc();
                &self.events
            }
        };
        Saturated {
            bound,
            asked,
            in_flight: pool.held(),
            capacity: pool.capacity,
            waited: self.wait,
        }
    }
}

impl Admitted<'_> {
    /// Accounts `n` more bytes of the body, received and about to be kept, waiting up to
    /// `admission_wait` for room. A body that arrives in one piece costs one atomic update.
    pub async fn take_bytes(&mut self, n: usize) -> Result<(), Saturated> {
        let a = self.admission;
        let cap = a.bytes.capacity;
        if n == 0 || a.bytes.try_take(n, cap) {
            self.bytes += n;
            return Ok(());
        }
        let ceiling = cap.saturating_add(a.max_body);
        // Only a request that holds part of its body can be in a deadlock (or one whose piece
        // alone is past the bound, which could never pass otherwise): those may overdraw.
        let may_overdraw = self.bytes > 0 || n > cap;
        let mut overdraft = self.overdraft;
        let deadline = Instant::now() + a.wait;
        let got = a
            .bytes
            .wait_for(deadline, || {
                if a.bytes.try_take(n, cap) {
                    return true;
                }
                if !overdraft
                    && may_overdraw
                    && a.overdraft
                        .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
                        .is_ok()
                {
                    overdraft = true;
                }
                overdraft && a.bytes.try_take(n, ceiling)
            })
            .await;
        self.overdraft = overdraft;
        if got {
            self.bytes += n;
            Ok(())
        } else {
            Err(a.refuse(Bound::Bytes, n))
        }
    }

    /// Accounts the request's `n` parsed events, waiting up to `admission_wait` for room. A
    /// request of more events than the whole bound counts as the whole bound: it passes
    /// alone, as a body larger than the byte bound does.
    pub async fn take_events(&mut self, n: usize) -> Result<(), Saturated> {
        let a = self.admission;
        let cap = a.events.capacity;
        let n = n.min(cap);
        if n == 0 || a.events.try_take(n, cap) {
            self.events += n;
            return Ok(());
        }
        let deadline = Instant::now() + a.wait;
        if a.events
            .wait_for(deadline, || a.events.try_take(n, cap))
            .await
        {
            self.events += n;
            Ok(())
        } else {
            Err(a.refuse(Bound::Events, n))
        }
    }
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        let a = self.admission;
        a.events.give(self.events);
        // The bytes first, then the overdraft: whoever takes it next finds them free.
        a.bytes.give(self.bytes);
        if self.overdraft {
            a.overdraft.store(false, Ordering::SeqCst);
            a.bytes.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn admission(bytes: usize, events: usize, max_body: usize, wait_ms: u64) -> Arc<Admission> {
        Arc::new(Admission::new(
            Bounds {
                bytes,
                events,
                max_body,
                wait: Duration::from_millis(wait_ms),
            },
            Refusals::default(),
        ))
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_waits_for_room_then_is_refused_with_what_held_it() {
        let a = admission(1_000, 100, 10_000, 500);
        let mut first = a.begin();
        first.take_bytes(600).await.expect("room for the first");
        assert_eq!(a.in_flight_bytes(), 600);
        let refused = a.begin().take_bytes(600).await.expect_err("no room");
        assert_eq!(
            refused,
            Saturated {
                bound: Bound::Bytes,
                asked: 600,
                in_flight: 600,
                capacity: 1_000,
                waited: Duration::from_millis(500),
            }
        );
        assert_eq!(a.refused(), 1);
        assert_eq!(a.refused_by(Bound::Bytes), 1);
        // Room given back while it waits: admitted.
        let waiting = tokio::spawn({
            let a = a.clone();
            async move { a.begin().take_bytes(600).await.map(|_| ()) }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(first);
        assert_eq!(waiting.await.expect("joined"), Ok(()));
        assert_eq!(a.in_flight_bytes(), 0);
    }

    /// The audit's D1: a request declaring 1 MiB and trickling its body held 1 MiB of room
    /// from the start. Now it holds what arrived, and others pass beside it.
    #[tokio::test(start_paused = true)]
    async fn a_trickling_body_holds_only_what_arrived() {
        let a = admission(1_000, 100, 10_000, 500);
        let mut slow: Vec<Admitted<'_>> = (0..10).map(|_| a.begin()).collect();
        for _ in 0..5 {
            for s in &mut slow {
                s.take_bytes(2).await.expect("two bytes fit");
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        assert_eq!(a.in_flight_bytes(), 100, "10 requests × 10 bytes received");
        // The bytes held never pass the bound while the others fit.
        let mut other = a.begin();
        other
            .take_bytes(900)
            .await
            .expect("the rest of the room is free");
        assert_eq!(a.in_flight_bytes(), 1_000);
        assert!(a.in_flight_bytes() <= a.capacity());
        drop(other);
        drop(slow);
        assert_eq!(a.in_flight_bytes(), 0);
    }

    /// The audit's D4: a share that fits passes a larger one waiting for room.
    #[tokio::test(start_paused = true)]
    async fn a_small_request_is_admitted_while_a_large_one_waits() {
        let a = admission(1_000, 100, 10_000, 1_000);
        let mut held = a.begin();
        held.take_bytes(700).await.expect("room");
        let large = tokio::spawn({
            let a = a.clone();
            async move { a.begin().take_bytes(600).await.map(|_| ()) }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!large.is_finished(), "the large one waits");
        // 150 bytes fit in the 300 free: taken at once, no wait.
        let started = Instant::now();
        let mut small = a.begin();
        small
            .take_bytes(150)
            .await
            .expect("fits beside the waiting one");
        assert_eq!(started.elapsed(), Duration::ZERO);
        drop(small);
        drop(held);
        assert_eq!(large.await.expect("joined"), Ok(()));
    }

    /// Requests each holding part of their bodies cannot deadlock: one at a time reads past
    /// the bound (by at most one body) and finishes.
    #[tokio::test(start_paused = true)]
    async fn partly_read_bodies_do_not_deadlock_and_the_overdraft_is_bounded() {
        let a = admission(1_000, 100, 800, 1_000);
        let mut x = a.begin();
        let mut y = a.begin();
        x.take_bytes(500).await.expect("room");
        y.take_bytes(500).await.expect("room");
        // Both want 300 more: x overdraws (holds bytes, the overdraft is free)...
        x.take_bytes(300).await.expect("x overdraws");
        assert_eq!(a.in_flight_bytes(), 1_300);
        assert!(a.in_flight_bytes() <= a.capacity() + 800);
        // A request holding nothing does not overdraw: it waits, then is refused.
        assert!(a.begin().take_bytes(10).await.is_err());
        // y waits: the overdraft is x's until x's answer.
        {
            let y_more = y.take_bytes(300);
            tokio::pin!(y_more);
            assert!(
                tokio::time::timeout(Duration::from_millis(100), &mut y_more)
                    .await
                    .is_err(),
                "y waits"
            );
            drop(x);
            assert_eq!(y_more.await, Ok(()));
        }
        assert_eq!(y.bytes, 800);
        drop(y);
        assert_eq!(a.in_flight_bytes(), 0, "y's room given back with it");
        // A piece past the whole bound passes alone.
        let mut huge = a.begin();
        huge.take_bytes(1_500).await.expect("alone");
        assert_eq!(a.in_flight_bytes(), 1_500);
    }

    /// The benchmark's batched shape (64 connections × batches of 100) fits the default
    /// event bound without waiting, with room for single events beside it.
    #[tokio::test(start_paused = true)]
    async fn the_default_event_bound_admits_the_benchmark_batches_at_once() {
        let cfg = crate::config::IngestConfig::default();
        let a = admission(
            cfg.max_in_flight_bytes,
            cfg.max_in_flight_events,
            cfg.max_body_bytes,
            1_000,
        );
        let started = Instant::now();
        let mut held = Vec::new();
        for _ in 0..64 {
            let mut r = a.begin();
            r.take_events(100).await.expect("room");
            held.push(r);
        }
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert_eq!(a.in_flight_events(), 6_400);
        assert_eq!(a.refused(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_event_bound_waits_then_refuses_and_a_large_request_passes_alone() {
        let a = admission(1 << 20, 100, 1 << 20, 300);
        let mut first = a.begin();
        first.take_events(60).await.expect("room");
        assert_eq!(a.in_flight_events(), 60);
        let started = Instant::now();
        let refused = a.begin().take_events(60).await.expect_err("no room");
        assert_eq!(started.elapsed(), Duration::from_millis(300));
        assert_eq!(
            refused,
            Saturated {
                bound: Bound::Events,
                asked: 60,
                in_flight: 60,
                capacity: 100,
                waited: Duration::from_millis(300),
            }
        );
        assert_eq!(a.refused_by(Bound::Events), 1);
        assert_eq!(a.refused_by(Bound::Bytes), 0);
        // Small ones still fit.
        let mut small = a.begin();
        small.take_events(40).await.expect("fits");
        drop(small);
        // Given back while it waits: admitted.
        let waiting = tokio::spawn({
            let a = a.clone();
            async move { a.begin().take_events(60).await.map(|_| ()) }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(first);
        assert_eq!(waiting.await.expect("joined"), Ok(()));
        // More events than the bound: counted as the whole bound, admitted alone.
        let mut batch = a.begin();
        batch.take_events(250).await.expect("alone");
        assert_eq!(a.in_flight_events(), 100);
        assert!(a.begin().take_events(1).await.is_err());
        drop(batch);
        assert_eq!(a.in_flight_events(), 0);
    }
}
