//! Handoff at acceptance: ingest gives a new entry straight to its target's delivery when the
//! target could send it at once, instead of queueing it for the worker.
//!
//! The worker's way costs a delivery a commit of its own (the lease, which records the attempt
//! before it is sent) and a read and decode of the event back from the store. When a target is
//! idle — a free slot, nothing due in its queue, breaker closed, a token in its rate limit, no
//! ordering — ingest reserves the slot, the entry is written already leased (first attempt
//! started) in the accept's own commit, and the attempt starts from the event ingest still
//! holds. Everything after the lease is the worker's path: same attempt, same ack, same
//! fencing; a crash before the ack is a lease the next start reclaims.
//!
//! A batching webhook takes a request's entries together, as one batch request, when they fill
//! at least half a batch (`min_batch_handoff`): a producer's batch then costs its delivery no
//! lease commit and no event decode. A request with fewer (single events) leaves them to the
//! queue, whose lease gathers what several commits made due into one request.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::Semaphore;

use super::DeliveryContext;
use super::runtime::TargetRuntime;
use super::worker;
use crate::policy::breaker::BreakerState;
use crate::store::{Leased, Millis};
use crate::target::Target;

/// A target's attempt slot held for an entry being accepted (`Dispatcher::reserve`). Dropped
/// unused (the event was a duplicate, the queue at its cap, the commit failed), it frees the
/// slot; a rate-limit token it took is not given back.
pub struct Reservation {
    ctx: Arc<DeliveryContext>,
    rt: Arc<TargetRuntime>,
    target: Arc<dyn Target>,
    permit: worker::Slot,
}

/// The fewest entries of one request that a batching webhook with `max_events` takes as a
/// handoff: half a batch, and at least two.
fn min_batch_handoff(max_events: u32) -> usize {
    usize::try_from((max_events / 2).max(2)).unwrap_or(usize::MAX)
}

/// The checks of the worker's loop for an entry that would be due at once (breaker, then a
/// slot, then the rate limit; the budget is told of the first attempt when it starts); any
/// doubt leaves the entry to the queue, where the worker applies them in full. Cheap checks
/// first: ingest asks once per target of every event, and in a batch most of them find the
/// slots taken. (Stopping is checked by the caller, on the worker's own token.) `entries` is
/// how many entries of the request the reservation is for: one, except for a batching webhook;
/// `kib` what their events weigh in the byte pool ([`super::bytes::charge_kib`]).
pub(super) fn reserve(
    ctx: &Arc<DeliveryContext>,
    rt: Arc<TargetRuntime>,
    target: Arc<dyn Target>,
    slots: &Arc<Semaphore>,
    now: Millis,
    (entries, kib): (usize, u64),
) -> Option<Reservation> {
    if rt.paused.load(Ordering::SeqCst) || rt.retry_after_until(now).is_some() {
        return None;
    }
    // Ordered targets: the entry may have an earlier one of its key in the queue.
    if rt.spec.policy.ordering.is_some() {
        return None;
    }
    match rt.batch() {
        // Fewer than half a batch (a single event): the worker's lease gathers what several
        // commits made due into one request, where a handoff would send them alone.
        Some(b) if entries < min_batch_handoff(b.max_events) => return None,
        // More than one request's worth: the reservation holds one slot, and what a request
        // cannot carry would only go back to the queue (`worker::send_batches`).
        Some(b) if u32::try_from(entries).map_or(true, |n| n > b.max_events) => return None,
        Some(_) => {}
        // One slot is one entry's attempt.
        None if entries != 1 => return None,
        None => {}
    }
    // Half-open probes are counted by the worker; open means wait.
    if rt
        .breaker()
        .is_some_and(|b| !matches!(b.state(), BreakerState::Closed))
    {
        return None;
    }
    // Dropped (freed) below if another check refuses.
    let permit = slots.clone().try_acquire_owned().ok()?;
    // A new entry does not overtake the target's due backlog (or its due retries).
    if ctx.store.due_count(&rt.spec.id, now, 1) > 0 {
        return None;
    }
    // A place in the global pool (`delivery.max_in_flight`), if one is free now: with none, the
    // entry waits in the queue like any other (handlers take none).
    let global = match rt.spec.kind {
        crate::rules::TargetKind::Handler { .. } => None,
        _ => Some(ctx.in_flight.try_acquire(&rt.share)?),
    };
    // Room for the events' bytes (`delivery.max_in_flight_bytes`), if there is some now and
    // the target may take it (its fair share).
    let bytes = ctx.bytes.try_take(&rt.byte_share, kib)?;
    let permit = worker::Slot::new(permit, global).with_bytes(bytes);
    if let Some(limiter) = rt.limiter()
        && limiter.check().is_err()
    {
        return None;
    }
    Some(Reservation {
        ctx: ctx.clone(),
        rt,
        target,
        permit,
    })
}

impl Reservation {
    /// How long the entry is leased for: as long as a worker's lease.
    pub fn lease_ms(&self) -> i64 {
        worker::lease_ms(&self.rt.spec, &self.ctx.cfg)
    }

    /// Starts the attempt on `leased`, the entries accepted under this reservation (one, or a
    /// batching webhook's several, sent as one request, or as several when `max_bytes` splits
    /// them; each further request waits for a slot of its own).
    pub fn start(self, leased: Vec<Leased>) {
        let now = self.ctx.clock.now_ms();
        // First attempts: they count toward the retry budget's base, as a worker's do.
        let mut budget = self.rt.budget();
        for _ in &leased {
            budget.first_attempt(now);
        }
        drop(budget);
        self.ctx
            .metrics
            .handoffs
            .get_or_create(&vec![("target", self.rt.spec.id.clone())])
            .inc_by(leased.len() as u64);
        let Some(b) = self.rt.batch() else {
            // `reserve` gives a target that does not batch one entry per reservation.
            if let Some(leased) = leased.into_iter().next() {
                worker::spawn_attempt(
                    &self.ctx,
                    &self.rt,
                    &self.target,
                    leased,
                    self.permit,
                    false,
                );
            }
            return;
        };
        // Encoding the batch's events is the delivery runtime's work, not the producer's
        // request's (it was measured on the ingest threads, and in the producers' p99).
        let batch = b;
        let Self {
            ctx,
            rt,
            target,
            permit,
        } = self;
        let (tracker, spawner) = (ctx.tracker.clone(), ctx.spawner.clone());
        tracker.spawn_on(
            async move {
                let bytes = ctx.bytes.empty(&rt.byte_share);
                worker::send_batches(&ctx, &rt, &target, leased, &batch, vec![permit], bytes).await;
            },
            &spawner,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::min_batch_handoff;

    #[test]
    fn a_batch_handoff_needs_half_a_batch_and_at_least_two_entries() {
        assert_eq!(min_batch_handoff(100), 50);
        assert_eq!(min_batch_handoff(41), 20);
        assert_eq!(min_batch_handoff(3), 2);
        // A batch of one is never worth a handoff of one entry: single events batch in the
        // queue.
        assert_eq!(min_batch_handoff(1), 2);
        assert_eq!(min_batch_handoff(1000), 500);
    }
}
