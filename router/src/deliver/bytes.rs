//! The process-wide bound on the bytes of events that deliveries hold
//! (`delivery.max_in_flight_bytes`).
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

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

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

/// The pool of bytes (`delivery.max_in_flight_bytes`).
pub struct BytePool {
    sem: Arc<Semaphore>,
    /// The cap, in KiB.
    max_kib: u64,
    /// KiB held now (the `router_delivery_in_flight_bytes` gauge follows it).
    held_kib: AtomicU64,
    metrics: Option<Arc<Metrics>>,
}

/// Bytes of the pool held (a reservation, or an attempt's share of one); given back on drop.
pub struct ByteGrant {
    permit: Option<OwnedSemaphorePermit>,
    pool: Arc<BytePool>,
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

impl BytePool {
    /// The pool `[delivery]` sets (`max_in_flight_bytes`), reporting to `metrics`.
    pub fn of(cfg: &crate::config::DeliveryConfig, metrics: &Arc<Metrics>) -> Arc<Self> {
        Self::new(
            u64::try_from(cfg.max_in_flight_bytes).unwrap_or(u64::MAX),
            Some(metrics.clone()),
        )
    }

    /// A pool of `max_bytes` (at least 1 KiB), reporting to `metrics` when given.
    pub fn new(max_bytes: u64, metrics: Option<Arc<Metrics>>) -> Arc<Self> {
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
            held_kib: AtomicU64::new(0),
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

    fn grant(self: &Arc<Self>, permit: OwnedSemaphorePermit) -> ByteGrant {
        self.add(i64::try_from(permit.num_permits()).unwrap_or(i64::MAX));
        ByteGrant {
            permit: Some(permit),
            pool: self.clone(),
        }
    }

    /// An empty grant, to merge others into.
    pub fn empty(self: &Arc<Self>) -> ByteGrant {
        ByteGrant {
            permit: None,
            pool: self.clone(),
        }
    }

    /// `kib` (clamped to the cap) if free now.
    pub fn try_take(self: &Arc<Self>, kib: u64) -> Option<ByteGrant> {
        let n = u32::try_from(self.clamp(kib)).unwrap_or(u32::MAX);
        let p = self.sem.clone().try_acquire_many_owned(n).ok()?;
        Some(self.grant(p))
    }

    /// `kib` (clamped to the cap), waiting in turn with the other targets while they are not
    /// free. `None` if the pool is closed (never, in practice).
    pub async fn take(self: &Arc<Self>, kib: u64) -> Option<ByteGrant> {
        let n = u32::try_from(self.clamp(kib)).unwrap_or(u32::MAX);
        let p = self.sem.clone().acquire_many_owned(n).await.ok()?;
        Some(self.grant(p))
    }
}

impl ByteGrant {
    /// KiB held.
    pub fn kib(&self) -> u64 {
        self.permit
            .as_ref()
            .map_or(0, |p| u64::try_from(p.num_permits()).unwrap_or(u64::MAX))
    }

    /// Adds `other`'s bytes to this grant.
    pub fn merge(&mut self, mut other: ByteGrant) {
        match (&mut self.permit, other.permit.take()) {
            (_, None) => {}
            (None, Some(p)) => self.permit = Some(p),
            (Some(mine), Some(p)) => mine.merge(p),
        }
    }

    /// An entry's charge of `kib` (clamped to the cap), out of this grant, or short of it from
    /// what the pool has free now. `None` (this grant unchanged) if neither has it.
    pub fn split_or_take(&mut self, kib: u64) -> Option<ByteGrant> {
        let kib = self.pool.clamp(kib);
        let have = self.kib();
        if have < kib {
            let more = self.pool.try_take(kib - have)?;
            self.merge(more);
        }
        let n = usize::try_from(kib).unwrap_or(usize::MAX);
        let part = self.permit.as_mut()?.split(n)?;
        Some(ByteGrant {
            permit: Some(part),
            pool: self.pool.clone(),
        })
    }
}

impl Drop for ByteGrant {
    fn drop(&mut self) {
        let kib = self.kib();
        if kib > 0 {
            self.pool.add(-i64::try_from(kib).unwrap_or(i64::MAX));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn an_event_is_charged_its_payload_and_attributes_in_kib() {
        assert_eq!(charge_kib(0), 1);
        assert_eq!(charge_kib(1024), 2);
        assert_eq!(charge_kib(512 << 10), 513);
    }

    #[test]
    fn grants_never_exceed_the_cap_and_one_entry_is_charged_at_most_all_of_it() {
        let pool = BytePool::new(8 << 10, None);
        assert_eq!(pool.max_bytes(), 8 << 10);
        let a = pool.try_take(5).expect("free");
        assert!(pool.try_take(4).is_none(), "5 + 4 > 8");
        let b = pool.try_take(3).expect("fits");
        assert_eq!(pool.in_flight_bytes(), 8 << 10);
        drop((a, b));
        assert_eq!(pool.in_flight_bytes(), 0);
        // An event larger than the cap is charged the cap: deliverable, alone.
        let big = pool.try_take(100).expect("the whole pool");
        assert_eq!(big.kib(), 8);
        assert!(pool.try_take(1).is_none());
    }

    /// A reservation is corrected to the entries' real sizes: split into each entry's charge,
    /// topped up from the pool when short (if free), the rest given back.
    #[test]
    fn a_reservation_is_corrected_to_the_real_sizes() {
        let pool = BytePool::new(10 << 10, None);
        let mut r = pool.try_take(4).expect("free");
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
        drop(e3);
        assert_eq!(pool.in_flight_bytes(), 0);
    }

    /// A waiting taker gets its bytes once enough are given back, and the bytes held never
    /// pass the cap however many take at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn takers_wait_for_room_and_never_pass_the_cap() {
        let pool = BytePool::new(16 << 10, None);
        let peak = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for i in 0..10u64 {
            let (pool, peak) = (pool.clone(), peak.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..10 {
                    let g = pool.take(1 + i % 7).await.expect("bytes");
                    peak.fetch_max(pool.in_flight_bytes(), Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    drop(g);
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
        assert_eq!(pool.in_flight_bytes(), 0);
    }
}
