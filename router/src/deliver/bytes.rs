//! The process-wide bound on the bytes of events that deliveries hold
//! (`delivery.max_in_flight_bytes`), with each target's fair share of it.
//!
//! Every leased entry holds its decoded event (and an attempt builds its body from it) until
//! its attempt is recorded. The count bounds (a target's slots, `delivery.max_in_flight`) say
//! nothing about size: with 1 MiB events, 20 webhook targets whose receiver never answered
//! held 1.95 GB. This pool counts the bytes of the events leased by every target — webhook,
//! NATS and handler alike, since all of them hold their events in memory the same way (two
//! handler targets at `handler_concurrency` 128 held ~900 MB of 1 MiB events).
//!
//! An event's size is only known once it is leased, so the store is asked nothing new. A
//! worker reserves, before its lease, what it expects the entries to weigh (its target's
//! last lease's largest event, per entry); the first slot waits for its share, further slots
//! take theirs only if free now. After the lease each entry takes its real size out of that
//! reservation — or, short of it, from what the pool has free; an entry finding neither goes
//! back to the queue unattempted — and the rest of the reservation goes back. Each attempt
//! gives its bytes back once its result is recorded, not when its slot is freed: the event is
//! held until then.
//!
//! One entry is charged at most the whole cap, so the largest event is always deliverable
//! (alone). Sizes are counted in KiB: the pool is a semaphore, and its permits must cover
//! caps of terabytes.
//!
//! Fairness (the count pool's, `in_flight`, in bytes). A slow target holds its bytes for its
//! whole attempt timeout while a fast one gives them back in milliseconds: with the
//! semaphore's FIFO queue, 4 webhook targets whose receivers never answered, with 512 KiB
//! events, held an 8 MiB pool, every freed KiB went to the next of them in the queue, and a
//! healthy target's small events waited for their 30 s timeouts (none of 20 delivered in
//! 10 s; with the share, all in ~30 ms: the e2e test
//! `targets_stuck_on_large_events_do_not_hold_the_byte_pool_against_a_healthy_one`). Each
//! target now has an account
//! ([`ByteShare`]: the bytes it holds), and its fair share is the cap divided by the targets
//! holding or waiting for bytes, but never less than one event of the largest size ingest
//! accepts (`ingest.max_body_bytes`), so that a target may always have one such event in
//! flight. A target whose ask would take it past its share (and which holds something:
//! a target holding nothing may always ask, so any event is deliverable) is *over* it:
//! - while another target under its share waits for bytes (the pool is contended), it takes
//!   nothing more, and waits until its own bytes come back or the pool has room again;
//! - otherwise it takes only what leaves one largest event's room free, so that a target
//!   that starts needing bytes finds some even when others hold more than their shares.
//!
//! Uncontended, a target within its share (alone, the whole pool is its share) takes what is
//! free. Waiting is first-fit, not FIFO: a waiting ask that fits is not kept behind one that
//! does not (in the semaphore's queue a target waiting for a large event took every KiB that
//! came back, small events of others queued behind it). A large ask is not starved by
//! small ones for long: while it waits, targets over their share take nothing, and those
//! within it end at most at their share, so once the bytes over the shares come back its
//! room is free (given that the shares fit in the pool: no more targets active than largest
//! events fit in it).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::telemetry::Metrics;

/// What an event weighs besides its payload (id, source, type, other attributes, the
/// structures that hold them): a rough constant, per entry.
pub const ATTRIBUTE_BYTES: u64 = 1024;

/// The smallest `delivery.max_in_flight_bytes` accepted (it must also be at least
/// `ingest.max_body_bytes`).
pub const MIN_BYTES: u64 = 1 << 20;

/// A target's estimate before it has leased anything: per entry.
pub const INITIAL_ESTIMATE: u64 = 64 << 10;

const KIB: u64 = 1024;

/// How long a worker waiting for bytes sleeps at most before it looks again (it is woken
/// sooner when bytes come back): a backstop for a missed wake-up.
const WAIT_RECHECK: Duration = Duration::from_millis(100);

/// The pool of bytes (`delivery.max_in_flight_bytes`).
pub struct BytePool {
    sem: Arc<Semaphore>,
    /// The cap, in KiB.
    max_kib: u64,
    /// One event of the largest size ingest accepts, in KiB (at most the cap): the least fair
    /// share, and the room a target over its share leaves free.
    floor_kib: u64,
    /// KiB held now (the `router_delivery_in_flight_bytes` gauge follows it).
    held_kib: AtomicU64,
    /// Targets holding bytes or waiting for them: the fair share's divisor.
    active: AtomicUsize,
    /// Workers waiting for bytes while under their target's share: the pool is contended
    /// while there are any.
    waiting: AtomicUsize,
    /// Workers waiting because their target is over its share.
    held_back: AtomicUsize,
    /// Woken when bytes come back while workers wait.
    freed: Notify,
    metrics: Option<Arc<Metrics>>,
}

/// A target's account with the pool: the bytes it holds, and a wake-up for when some come
/// back. One per target runtime.
#[derive(Default)]
pub struct ByteShare {
    /// KiB held, plus one per worker waiting for bytes: the target counts as active while it
    /// is above 0.
    claims: AtomicU64,
    /// KiB held.
    held_kib: AtomicU64,
    released: Notify,
}

impl std::fmt::Debug for ByteShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteShare")
            .field("held_kib", &self.held_kib.load(Ordering::Relaxed))
            .finish()
    }
}

impl ByteShare {
    /// Bytes its target holds now.
    pub fn held_bytes(&self) -> u64 {
        self.held_kib.load(Ordering::SeqCst) * KIB
    }
}

/// Bytes of the pool held by one target (a reservation, or an attempt's share of one); given
/// back on drop.
pub struct ByteGrant {
    permit: Option<OwnedSemaphorePermit>,
    pool: Arc<BytePool>,
    share: Arc<ByteShare>,
}

impl std::fmt::Debug for ByteGrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ByteGrant({} KiB)", self.kib())
    }
}

/// The KiB an event of `payload` bytes is charged: its payload and [`ATTRIBUTE_BYTES`],
/// rounded up, and never 0.
pub fn charge_kib(payload: usize) -> u64 {
    (u64::try_from(payload).unwrap_or(u64::MAX))
        .saturating_add(ATTRIBUTE_BYTES)
        .div_ceil(KIB)
        .max(1)
}

/// A worker waiting in [`BytePool::take`]: counted as its target's claim, and as waiting or
/// held back, until it has its bytes or stops waiting (dropped: a worker told to stop while
/// it waits leaves the counts as they were).
struct Waiter<'a> {
    pool: &'a BytePool,
    share: &'a ByteShare,
    /// Counted in `held_back` (over its share) rather than `waiting`; `None`: in neither yet.
    over: Option<bool>,
}

impl<'a> Waiter<'a> {
    fn new(pool: &'a BytePool, share: &'a ByteShare) -> Self {
        // Waiting makes the target active, so the share others get already counts it.
        pool.claim(share, 1);
        Self {
            pool,
            share,
            over: None,
        }
    }

    fn counter(&self, over: bool) -> &AtomicUsize {
        if over {
            &self.pool.held_back
        } else {
            &self.pool.waiting
        }
    }

    /// Counts the worker as held back (`over`) or as waiting within its share.
    fn set(&mut self, over: bool) {
        if self.over == Some(over) {
            return;
        }
        self.counter(over).fetch_add(1, Ordering::SeqCst);
        if let Some(was) = self.over.replace(over) {
            self.counter(was).fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        if let Some(was) = self.over {
            self.counter(was).fetch_sub(1, Ordering::SeqCst);
        }
        self.pool.unclaim(self.share, 1);
    }
}

impl BytePool {
    /// The pool `[delivery]` sets (`max_in_flight_bytes`), with a fair share of at least one
    /// event of `ingest.max_body_bytes`, reporting to `metrics`.
    pub fn of(cfg: &crate::config::Config, metrics: &Arc<Metrics>) -> Arc<Self> {
        Self::new(
            u64::try_from(cfg.delivery.max_in_flight_bytes).unwrap_or(u64::MAX),
            cfg.ingest.max_body_bytes,
            Some(metrics.clone()),
        )
    }

    /// A pool of `max_bytes` (at least 1 KiB) whose fair share is at least an event of
    /// `largest_event` bytes, reporting to `metrics` when given.
    pub fn new(max_bytes: u64, largest_event: usize, metrics: Option<Arc<Metrics>>) -> Arc<Self> {
        let cap = u64::try_from(Semaphore::MAX_PERMITS).unwrap_or(u64::MAX);
        let max_kib = (max_bytes / KIB).clamp(1, cap);
        if let Some(m) = &metrics {
            m.delivery_max_in_flight_bytes
                .set(i64::try_from(max_kib * KIB).unwrap_or(i64::MAX));
            m.delivery_in_flight_bytes.set(0);
        }
        Arc::new(Self {
            sem: Arc::new(Semaphore::new(
                usize::try_from(max_kib).unwrap_or(Semaphore::MAX_PERMITS),
            )),
            max_kib,
            floor_kib: charge_kib(largest_event).min(max_kib),
            held_kib: AtomicU64::new(0),
            active: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            held_back: AtomicUsize::new(0),
            freed: Notify::new(),
            metrics,
        })
    }

    /// `delivery.max_in_flight_bytes` as applied.
    pub fn max_bytes(&self) -> u64 {
        self.max_kib * KIB
    }

    /// Bytes held now.
    pub fn in_flight_bytes(&self) -> u64 {
        self.held_kib.load(Ordering::SeqCst) * KIB
    }

    /// The most bytes one target holds (or asks for) while others wait: the pool split
    /// evenly among the targets holding or waiting for bytes, and at least one event of the
    /// largest size ingest accepts.
    pub fn fair_share_bytes(&self) -> u64 {
        self.fair_share_kib() * KIB
    }

    fn fair_share_kib(&self) -> u64 {
        let active = u64::try_from(self.active.load(Ordering::SeqCst).max(1)).unwrap_or(u64::MAX);
        (self.max_kib / active).max(self.floor_kib)
    }

    /// `kib` clamped to the cap: what one grant may hold at most.
    fn clamp(&self, kib: u64) -> u64 {
        kib.clamp(1, self.max_kib)
    }

    fn add(&self, kib: i64) {
        let n = if kib >= 0 {
            self.held_kib
                .fetch_add(kib.unsigned_abs(), Ordering::SeqCst)
                + kib.unsigned_abs()
        } else {
            self.held_kib
                .fetch_sub(kib.unsigned_abs(), Ordering::SeqCst)
                - kib.unsigned_abs()
        };
        if let Some(m) = &self.metrics {
            m.delivery_in_flight_bytes
                .set(i64::try_from(n * KIB).unwrap_or(i64::MAX));
        }
    }

    fn claim(&self, share: &ByteShare, n: u64) {
        if n > 0 && share.claims.fetch_add(n, Ordering::SeqCst) == 0 {
            self.active.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn unclaim(&self, share: &ByteShare, n: u64) {
        if n > 0 && share.claims.fetch_sub(n, Ordering::SeqCst) == n {
            self.active.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// `share`'s account gains `kib` held.
    fn hold(&self, share: &ByteShare, kib: u64) {
        share.held_kib.fetch_add(kib, Ordering::SeqCst);
        self.claim(share, kib);
    }

    /// `share`'s account gives back `kib`.
    fn unhold(&self, share: &ByteShare, kib: u64) {
        share.held_kib.fetch_sub(kib, Ordering::SeqCst);
        self.unclaim(share, kib);
    }

    /// Whether `share`'s target, asking for `kib` more, would pass its fair share. A target
    /// holding nothing never does: one event of any size is always deliverable.
    fn over_share(&self, share: &ByteShare, kib: u64) -> bool {
        let held = share.held_kib.load(Ordering::SeqCst);
        held > 0 && held.saturating_add(kib) > self.fair_share_kib()
    }

    /// Whether `share`'s target may take `kib` now (if free): within its share, yes; over it,
    /// only while no target within its share waits, and leaving one largest event's room.
    fn may_take(&self, share: &ByteShare, kib: u64) -> bool {
        if !self.over_share(share, kib) {
            return true;
        }
        let free = u64::try_from(self.sem.available_permits()).unwrap_or(u64::MAX);
        self.waiting.load(Ordering::SeqCst) == 0 && free >= kib.saturating_add(self.floor_kib)
    }

    fn grant(self: &Arc<Self>, permit: OwnedSemaphorePermit, share: &Arc<ByteShare>) -> ByteGrant {
        let kib = u64::try_from(permit.num_permits()).unwrap_or(u64::MAX);
        self.hold(share, kib);
        self.add(i64::try_from(kib).unwrap_or(i64::MAX));
        ByteGrant {
            permit: Some(permit),
            pool: self.clone(),
            share: share.clone(),
        }
    }

    /// An empty grant of `share`'s target, to merge others into.
    pub fn empty(self: &Arc<Self>, share: &Arc<ByteShare>) -> ByteGrant {
        ByteGrant {
            permit: None,
            pool: self.clone(),
            share: share.clone(),
        }
    }

    /// `kib` (clamped to the cap) for `share`'s target if free now, and the target may take
    /// them (within its share, or over it in an uncontended pool). Never waits: for the
    /// worker's further slots of a lease, an entry's top-up, and a handoff at acceptance.
    pub fn try_take(self: &Arc<Self>, share: &Arc<ByteShare>, kib: u64) -> Option<ByteGrant> {
        let kib = self.clamp(kib);
        if !self.may_take(share, kib) {
            return None;
        }
        let n = u32::try_from(kib).unwrap_or(u32::MAX);
        let p = self.sem.clone().try_acquire_many_owned(n).ok()?;
        Some(self.grant(p, share))
    }

    /// `kib` (clamped to the cap) for `share`'s target, waiting while they are not free, and
    /// while the target is over its fair share of a contended pool; `held_back` is called
    /// once if it was. Waiting is first-fit: whoever's ask fits when bytes come back takes
    /// them. `None` if the pool is closed (never, in practice).
    pub async fn take(
        self: &Arc<Self>,
        share: &Arc<ByteShare>,
        kib: u64,
        held_back: impl FnOnce(),
    ) -> Option<ByteGrant> {
        let kib = self.clamp(kib);
        if let Some(g) = self.try_take(share, kib) {
            return Some(g);
        }
        let mut held_back = Some(held_back);
        let mut waiter = Waiter::new(self, share);
        loop {
            // Registered before looking, so bytes given back in between wake it.
            let own = share.released.notified();
            let freed = self.freed.notified();
            let over = self.over_share(share, kib);
            waiter.set(over);
            if over && let Some(f) = held_back.take() {
                f();
            }
            if let Some(g) = self.try_take(share, kib) {
                return Some(g);
            }
            if self.sem.is_closed() {
                return None;
            }
            tokio::select! {
                _ = own => {}
                _ = freed => {}
                _ = tokio::time::sleep(WAIT_RECHECK) => {}
            }
        }
    }
}

impl ByteGrant {
    /// KiB held.
    pub fn kib(&self) -> u64 {
        self.permit
            .as_ref()
            .map_or(0, |p| u64::try_from(p.num_permits()).unwrap_or(u64::MAX))
    }

    /// Adds `other`'s bytes to this grant (and to this grant's target's account, should
    /// `other` be another target's: never, in practice).
    pub fn merge(&mut self, mut other: ByteGrant) {
        let kib = other.kib();
        let Some(p) = other.permit.take() else {
            return;
        };
        if !Arc::ptr_eq(&self.share, &other.share) {
            self.pool.unhold(&other.share, kib);
            self.pool.hold(&self.share, kib);
        }
        match &mut self.permit {
            None => self.permit = Some(p),
            Some(mine) => mine.merge(p),
        }
    }

    /// An entry's charge of `kib` (clamped to the cap), out of this grant, or short of it from
    /// what the pool has free now (if the target may take it: [`BytePool::try_take`]). `None`
    /// (this grant unchanged) if neither has it.
    pub fn split_or_take(&mut self, kib: u64) -> Option<ByteGrant> {
        let kib = self.pool.clamp(kib);
        let have = self.kib();
        if have < kib {
            let more = self.pool.try_take(&self.share, kib - have)?;
            self.merge(more);
        }
        let n = usize::try_from(kib).unwrap_or(usize::MAX);
        let part = self.permit.as_mut()?.split(n)?;
        Some(ByteGrant {
            permit: Some(part),
            pool: self.pool.clone(),
            share: self.share.clone(),
        })
    }
}

impl Drop for ByteGrant {
    fn drop(&mut self) {
        let kib = self.kib();
        let Some(p) = self.permit.take() else {
            return;
        };
        // Back in the semaphore before anyone is told, so that whoever looks finds it.
        drop(p);
        if kib == 0 {
            return;
        }
        self.pool.unhold(&self.share, kib);
        self.pool.add(-i64::try_from(kib).unwrap_or(i64::MAX));
        self.share.released.notify_waiters();
        if self.pool.waiting.load(Ordering::SeqCst) + self.pool.held_back.load(Ordering::SeqCst) > 0
        {
            self.pool.freed.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn share() -> Arc<ByteShare> {
        Arc::new(ByteShare::default())
    }

    fn never_held_back() {
        panic!("held back");
    }

    /// The pool's and the accounts' figures once everything is given back: nothing held,
    /// nobody active, waiting or held back.
    fn assert_idle(pool: &BytePool, shares: &[&Arc<ByteShare>]) {
        assert_eq!(pool.in_flight_bytes(), 0);
        assert_eq!(pool.active.load(Ordering::SeqCst), 0);
        assert_eq!(pool.waiting.load(Ordering::SeqCst), 0);
        assert_eq!(pool.held_back.load(Ordering::SeqCst), 0);
        assert_eq!(pool.sem.available_permits() as u64, pool.max_kib);
        for s in shares {
            assert_eq!(s.held_bytes(), 0);
            assert_eq!(s.claims.load(Ordering::SeqCst), 0);
        }
    }

    #[test]
    fn an_event_is_charged_its_payload_and_attributes_in_kib() {
        assert_eq!(charge_kib(0), 1);
        assert_eq!(charge_kib(1024), 2);
        assert_eq!(charge_kib(512 << 10), 513);
    }

    #[test]
    fn grants_never_exceed_the_cap_and_one_entry_is_charged_at_most_all_of_it() {
        let pool = BytePool::new(8 << 10, 0, None);
        let t = share();
        assert_eq!(pool.max_bytes(), 8 << 10);
        let a = pool.try_take(&t, 5).expect("free");
        assert!(pool.try_take(&t, 4).is_none(), "5 + 4 > 8");
        let b = pool.try_take(&t, 3).expect("fits");
        assert_eq!(pool.in_flight_bytes(), 8 << 10);
        drop((a, b));
        assert_eq!(pool.in_flight_bytes(), 0);
        // An event larger than the cap is charged the cap: deliverable, alone.
        let big = pool.try_take(&t, 100).expect("the whole pool");
        assert_eq!(big.kib(), 8);
        assert!(pool.try_take(&t, 1).is_none());
        drop(big);
        assert_idle(&pool, &[&t]);
    }

    /// A reservation is corrected to the entries' real sizes: split into each entry's charge,
    /// topped up from the pool when short (if free), the rest given back.
    #[test]
    fn a_reservation_is_corrected_to_the_real_sizes() {
        let pool = BytePool::new(10 << 10, 0, None);
        let t = share();
        let mut r = pool.try_take(&t, 4).expect("free");
        let e1 = r.split_or_take(1).expect("out of the reservation");
        assert_eq!((e1.kib(), r.kib()), (1, 3));
        // Larger than what is left: the pool tops it up.
        let e2 = r.split_or_take(5).expect("topped up");
        assert_eq!((e2.kib(), r.kib()), (5, 0));
        assert_eq!(pool.in_flight_bytes(), 6 << 10);
        // The pool has 4 KiB free: an entry of 6 KiB does not fit, and takes nothing.
        assert!(r.split_or_take(6).is_none());
        assert_eq!(pool.in_flight_bytes(), 6 << 10);
        let e3 = r.split_or_take(4).expect("fits");
        assert_eq!(pool.in_flight_bytes(), 10 << 10);
        drop(r);
        drop((e1, e2));
        assert_eq!(pool.in_flight_bytes(), 4 << 10, "e3 held until dropped");
        assert_eq!(t.held_bytes(), 4 << 10);
        drop(e3);
        assert_idle(&pool, &[&t]);
    }

    /// A target's account follows its bytes exactly however its grants are split, merged,
    /// topped up and dropped, and it stops counting as active once it holds nothing.
    #[test]
    fn a_target_s_account_is_exact_through_split_merge_and_drop() {
        let pool = BytePool::new(64 << 10, 0, None);
        let (a, b) = (share(), share());
        let mut r = pool.try_take(&a, 10).expect("free");
        let _other = pool.try_take(&b, 3).expect("free");
        assert_eq!(pool.active.load(Ordering::SeqCst), 2);
        let parts: Vec<_> = (0..3).map(|_| r.split_or_take(4).expect("part")).collect();
        // 10 reserved, 12 charged: 2 topped up from the pool.
        assert_eq!(r.kib(), 0);
        assert_eq!(a.held_bytes(), 12 << 10);
        let mut merged = pool.empty(&a);
        for p in parts {
            merged.merge(p);
        }
        merged.merge(r);
        assert_eq!(merged.kib(), 12);
        assert_eq!(a.held_bytes(), 12 << 10);
        // A grant of another target merged in moves to this account.
        let theirs = pool.try_take(&b, 2).expect("free");
        merged.merge(theirs);
        assert_eq!((a.held_bytes(), b.held_bytes()), (14 << 10, 3 << 10));
        assert_eq!(pool.in_flight_bytes(), 17 << 10);
        drop(merged);
        assert_eq!(a.held_bytes(), 0);
        assert_eq!(pool.active.load(Ordering::SeqCst), 1, "b still holds");
        drop(_other);
        assert_idle(&pool, &[&a, &b]);
    }

    /// The fair share is the pool split among the targets holding or waiting for bytes, and
    /// never less than one event of the largest size accepted.
    #[test]
    fn the_fair_share_splits_the_pool_among_active_targets_down_to_one_largest_event() {
        // Largest event: 7 KiB of payload, charged 8 KiB.
        let pool = BytePool::new(64 << 10, 7 << 10, None);
        assert_eq!(
            pool.fair_share_bytes(),
            64 << 10,
            "nobody active: all of it"
        );
        let shares: Vec<_> = (0..10).map(|_| share()).collect();
        let mut held = vec![pool.try_take(&shares[0], 1).expect("free")];
        assert_eq!(pool.fair_share_bytes(), 64 << 10, "one target: all of it");
        held.push(pool.try_take(&shares[1], 1).expect("free"));
        assert_eq!(pool.fair_share_bytes(), 32 << 10);
        for s in &shares[2..] {
            held.push(pool.try_take(s, 1).expect("free"));
        }
        // 64 / 10 is 6 KiB: less than one largest event.
        assert_eq!(pool.fair_share_bytes(), 8 << 10);
        drop(held);
        let refs: Vec<_> = shares.iter().collect();
        assert_idle(&pool, &refs);
    }

    /// Uncontended, a target alone may use the whole pool; with others holding bytes, a
    /// target past its share takes only what leaves one largest event's room for them, while
    /// a target within its share takes what is free.
    #[test]
    fn over_its_share_a_target_leaves_one_largest_event_s_room() {
        // Largest event: 3 KiB, charged 4 KiB.
        let pool = BytePool::new(16 << 10, 3 << 10, None);
        let (a, b) = (share(), share());
        let all = pool.try_take(&a, 10).expect("free");
        let more = pool
            .try_take(&a, 6)
            .expect("alone, the whole pool is its share");
        assert_eq!(pool.in_flight_bytes(), 16 << 10);
        drop((all, more));
        let b1 = pool.try_take(&b, 1).expect("free");
        // Two targets active: a share of 8 KiB each.
        let a1 = pool.try_take(&a, 7).expect("within its share");
        let a2 = pool
            .try_take(&a, 4)
            .expect("past it, but 8 KiB free: 4 are left");
        assert!(
            pool.try_take(&a, 1).is_none(),
            "past its share: the last 4 KiB stay free"
        );
        let b2 = pool
            .try_take(&b, 4)
            .expect("within its share: b takes them");
        assert_eq!(pool.in_flight_bytes(), 16 << 10);
        drop((b1, b2));
        // Alone again: its share is the whole pool.
        let a3 = pool.try_take(&a, 5).expect("alone");
        drop((a1, a2, a3));
        assert_idle(&pool, &[&a, &b]);
    }

    /// A slow target holding the whole contended pool does not take bytes given back while a
    /// target within its share waits: they go to the waiting one, however often the slow one
    /// asks; it gets its own once it is back within its share. Counted as held back once.
    #[tokio::test]
    async fn a_target_over_its_share_waits_while_others_within_it_get_the_bytes() {
        let pool = BytePool::new(16 << 10, 0, None);
        let (slow, fast) = (share(), share());
        let mut slow_held: Vec<_> = (0..4)
            .map(|_| {
                pool.try_take(&slow, 4)
                    .expect("uncontended: the whole pool")
            })
            .collect();
        let slow_waits = Arc::new(AtomicUsize::new(0));
        let slow_wait = {
            let (pool, slow, n) = (pool.clone(), slow.clone(), slow_waits.clone());
            tokio::spawn(async move {
                pool.take(&slow, 4, || {
                    n.fetch_add(1, Ordering::SeqCst);
                })
                .await
            })
        };
        let fast_wait = {
            let (pool, fast) = (pool.clone(), fast.clone());
            tokio::spawn(async move { pool.take(&fast, 2, never_held_back).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(pool.fair_share_bytes(), 8 << 10, "two targets active");
        assert_eq!(pool.waiting.load(Ordering::SeqCst), 1, "fast waits");
        assert_eq!(
            pool.held_back.load(Ordering::SeqCst),
            1,
            "slow is held back"
        );
        // One slow attempt ends: the bytes go to the fast target (within its share), not back
        // to the slow one, which holds 12 > 8.
        slow_held.pop();
        let fast_bytes = tokio::time::timeout(Duration::from_secs(5), fast_wait)
            .await
            .expect("the fast target gets the bytes given back")
            .expect("task")
            .expect("bytes");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!slow_wait.is_finished(), "slow waits for its own bytes");
        // Two more slow attempts end: 4 + 4 is within its share again.
        slow_held.pop();
        slow_held.pop();
        let slow_bytes = tokio::time::timeout(Duration::from_secs(5), slow_wait)
            .await
            .expect("the slow target gets bytes once within its share")
            .expect("task")
            .expect("bytes");
        assert_eq!(slow_waits.load(Ordering::SeqCst), 1, "held back once");
        drop((fast_bytes, slow_bytes, slow_held));
        assert_idle(&pool, &[&slow, &fast]);
    }

    /// A waiting ask that fits is not kept behind one that does not: a target waiting for a
    /// large event does not take the bytes a small one of another target could use now (in
    /// the semaphore's queue it did, and the small one waited behind it).
    #[tokio::test]
    async fn a_small_ask_that_fits_is_not_kept_behind_a_large_one_that_does_not() {
        let pool = BytePool::new(16 << 10, 12 << 10, None);
        let (stuck, large, small) = (share(), share(), share());
        let stuck_held: Vec<_> = (0..3)
            .map(|_| pool.try_take(&stuck, 4).expect("free"))
            .collect();
        let large_wait = {
            let (pool, large) = (pool.clone(), large.clone());
            tokio::spawn(async move { pool.take(&large, 8, never_held_back).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            pool.waiting.load(Ordering::SeqCst),
            1,
            "8 KiB do not fit in 4"
        );
        // The small target's 2 KiB fit, waiting or not.
        let now = pool.try_take(&small, 2).expect("fits beside the large ask");
        let waited = tokio::time::timeout(
            Duration::from_secs(5),
            pool.take(&small, 2, never_held_back),
        )
        .await
        .expect("fits at once")
        .expect("bytes");
        drop((now, waited));
        // The large ask gets its room once enough comes back.
        drop(stuck_held);
        let large_bytes = tokio::time::timeout(Duration::from_secs(5), large_wait)
            .await
            .expect("the large ask gets its room")
            .expect("task")
            .expect("bytes");
        drop(large_bytes);
        assert_idle(&pool, &[&stuck, &large, &small]);
    }

    /// A worker held back by its share is woken when one of its own grants comes back, not
    /// by the backstop (the clock is paused: it does not move unless the backstop fires).
    #[tokio::test(start_paused = true)]
    async fn a_held_back_worker_is_woken_when_its_own_bytes_come_back() {
        let pool = BytePool::new(16 << 10, 0, None);
        let (slow, other) = (share(), share());
        let _theirs = pool.try_take(&other, 1).expect("free");
        let mut mine: Vec<_> = (0..2)
            .map(|_| pool.try_take(&slow, 5).expect("free"))
            .collect();
        // 10 + 1 of 16 held, a share of 8 each: 5 more would leave less than the largest
        // event's room (1 KiB).
        let wait = {
            let (pool, slow) = (pool.clone(), slow.clone());
            tokio::spawn(async move { pool.take(&slow, 5, || {}).await })
        };
        for _ in 0..100 {
            if pool.held_back.load(Ordering::SeqCst) == 1 {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(pool.held_back.load(Ordering::SeqCst), 1);
        let start = tokio::time::Instant::now();
        mine.pop();
        let got = wait.await.expect("task").expect("bytes");
        assert!(start.elapsed() < WAIT_RECHECK, "{:?}", start.elapsed());
        drop((got, mine, _theirs));
        assert_idle(&pool, &[&slow, &other]);
    }

    /// A worker told to stop while it waits (its `take` dropped) leaves the counts as they
    /// were: its target no longer counts as active, nobody as waiting.
    #[tokio::test]
    async fn a_take_given_up_while_waiting_leaves_nothing_counted() {
        let pool = BytePool::new(8 << 10, 0, None);
        let (full, waiter) = (share(), share());
        let all = pool.try_take(&full, 8).expect("free");
        let gave_up = tokio::time::timeout(
            Duration::from_millis(50),
            pool.take(&waiter, 1, never_held_back),
        )
        .await;
        assert!(gave_up.is_err(), "no room: it waited");
        assert_eq!(pool.active.load(Ordering::SeqCst), 1);
        assert_eq!(pool.waiting.load(Ordering::SeqCst), 0);
        drop(all);
        assert_idle(&pool, &[&full, &waiter]);
    }

    /// Waiting takers of many targets get their bytes once enough are given back, and the
    /// bytes held never pass the cap however many take at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn takers_wait_for_room_and_never_pass_the_cap() {
        let pool = BytePool::new(16 << 10, 0, None);
        let peak = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        let shares: Vec<_> = (0..10).map(|_| share()).collect();
        for (i, s) in shares.iter().enumerate() {
            let (pool, peak, s) = (pool.clone(), peak.clone(), s.clone());
            tasks.push(tokio::spawn(async move {
                for n in 0..10u64 {
                    // A second grant beside the first if it may take it now (a worker never
                    // waits for bytes while holding some of its own lease's).
                    let a = pool.take(&s, 1 + (i as u64 + n) % 7, || {}).await;
                    let b = pool.try_take(&s, 1 + n % 3);
                    peak.fetch_max(pool.in_flight_bytes(), Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    drop((a, b));
                }
            }));
        }
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(30), t)
                .await
                .expect("every taker gets its bytes")
                .expect("task");
        }
        assert!(peak.load(Ordering::SeqCst) <= 16 << 10, "{peak:?}");
        let refs: Vec<_> = shares.iter().collect();
        assert_idle(&pool, &refs);
    }
}
