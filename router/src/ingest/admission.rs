//! Ingest admission: bounds the request bytes that ingest holds at once (bodies being read,
//! checked, or waiting for their commit), so that a saturated router answers producers
//! `503` with `Retry-After` instead of queueing them until their own timeouts fire.
//!
//! Past the committer's pace every request waits for the commit of all those ahead of it:
//! without a bound, four times the producers meant four times the latency and the memory
//! (audited: 64 producers of 1 MB batches waited 5–7 s each, no refusal ever). A request
//! reserves its declared `Content-Length` (the largest body allowed when it has none)
//! before its body is read, and waits at most `ingest.admission_wait` for room.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The bytes ingest may hold at once, and how long a request waits for its share.
#[derive(Debug)]
pub struct Admission {
    permits: Arc<Semaphore>,
    capacity: usize,
    wait: Duration,
    /// Requests refused as saturated (`router_ingest_saturated_total`).
    refused: Counter,
}

/// Room held by one admitted request; given back when dropped (its answer is sent).
#[derive(Debug)]
pub struct Admitted {
    _permit: OwnedSemaphorePermit,
}

/// A request refused because ingest stayed full for the whole wait.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saturated {
    /// Bytes the request asked for (clamped to the capacity).
    pub asked: usize,
    /// Bytes held by the requests in flight when it gave up.
    pub in_flight: usize,
    /// `ingest.max_in_flight_bytes`.
    pub capacity: usize,
    /// How long it waited.
    pub waited: Duration,
}

impl Admission {
    /// Room for `capacity` bytes (at least 1); a request waits up to `wait` for its share,
    /// and a refusal counts in `refused`.
    pub fn new(capacity: usize, wait: Duration, refused: Counter) -> Self {
        let capacity = capacity.clamp(1, Semaphore::MAX_PERMITS);
        Self {
            permits: Arc::new(Semaphore::new(capacity)),
            capacity,
            wait,
            refused,
        }
    }

    /// Admits a request whose body declares `declared` bytes (`None`: chunked, so the
    /// largest body allowed, `max_body`, is reserved), waiting for room in arrival order.
    /// A request larger than the whole capacity waits for it to be free, so one request of
    /// any allowed size always passes on its own.
    pub async fn admit(
        &self,
        declared: Option<usize>,
        max_body: usize,
    ) -> Result<Admitted, Saturated> {
        let asked = declared
            .unwrap_or(max_body)
            .min(max_body)
            .clamp(1, self.capacity);
        // `asked` ≤ capacity ≤ MAX_PERMITS; a capacity past u32 still admits up to u32::MAX.
        let n = u32::try_from(asked).unwrap_or(u32::MAX);
        let acquire = self.permits.clone().acquire_many_owned(n);
        match tokio::time::timeout(self.wait, acquire).await {
            Ok(Ok(permit)) => Ok(Admitted { _permit: permit }),
            // Timed out (or, never, closed): full for the whole wait.
            _ => {
                self.refused.inc();
                Err(Saturated {
                    asked,
                    in_flight: self.in_flight_bytes(),
                    capacity: self.capacity,
                    waited: self.wait,
                })
            }
        }
    }

    /// Bytes held by the requests admitted now.
    pub fn in_flight_bytes(&self) -> usize {
        self.capacity
            .saturating_sub(self.permits.available_permits())
    }

    /// `ingest.max_in_flight_bytes`, as applied.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Requests refused as saturated since the start.
    pub fn refused(&self) -> u64 {
        self.refused.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_request_waits_for_room_then_is_refused_with_what_held_it() {
        let a = Admission::new(1_000, Duration::from_millis(500), Counter::default());
        let first = a
            .admit(Some(600), 10_000)
            .await
            .expect("room for the first");
        assert_eq!(a.in_flight_bytes(), 600);
        let refused = a.admit(Some(600), 10_000).await.expect_err("no room");
        assert_eq!(
            refused,
            Saturated {
                asked: 600,
                in_flight: 600,
                capacity: 1_000,
                waited: Duration::from_millis(500),
            }
        );
        assert_eq!(a.refused(), 1);
        // Room given back while it waits: admitted.
        let a = Arc::new(a);
        let waiting = tokio::spawn({
            let a = a.clone();
            async move { a.admit(Some(600), 10_000).await.map(|_| ()) }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(first);
        assert_eq!(waiting.await.expect("joined"), Ok(()));
        assert_eq!(a.in_flight_bytes(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn sizes_are_declared_or_the_largest_body_and_never_past_the_capacity() {
        let a = Admission::new(1_000, Duration::from_millis(10), Counter::default());
        // Chunked: the largest body allowed is reserved.
        let chunked = a.admit(None, 300).await.expect("admitted");
        assert_eq!(a.in_flight_bytes(), 300);
        drop(chunked);
        // A declared length past the body limit reserves only the limit (it is refused 413
        // once read past it).
        let over = a.admit(Some(5_000), 400).await.expect("admitted");
        assert_eq!(a.in_flight_bytes(), 400);
        drop(over);
        // A body allowed but larger than the whole capacity passes alone.
        let huge = a.admit(Some(5_000), 10_000).await.expect("admitted alone");
        assert_eq!(a.in_flight_bytes(), 1_000);
        assert!(a.admit(Some(1), 10_000).await.is_err());
        drop(huge);
        // An empty body still counts as a request.
        let empty = a.admit(Some(0), 10_000).await.expect("admitted");
        assert_eq!(a.in_flight_bytes(), 1);
        drop(empty);
    }
}
