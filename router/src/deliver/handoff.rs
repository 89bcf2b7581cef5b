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

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

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
    permit: OwnedSemaphorePermit,
}

/// The checks of the worker's loop for an entry that would be due at once (breaker, then a
/// slot, then the rate limit; the budget is told of the first attempt when it starts); any
/// doubt leaves the entry to the queue, where the worker applies them in full. Cheap checks
/// first: ingest asks once per target of every event, and in a batch most of them find the
/// slots taken. (Stopping is checked by the caller, on the worker's own token.)
pub(super) fn reserve(
    ctx: &Arc<DeliveryContext>,
    rt: Arc<TargetRuntime>,
    target: Arc<dyn Target>,
    slots: &Arc<Semaphore>,
    now: Millis,
) -> Option<Reservation> {
    if rt.paused.load(Ordering::SeqCst) {
        return None;
    }
    // Ordered targets: the entry may have an earlier one of its key in the queue. Batching
    // webhooks: the worker's lease gathers what a commit made due into one request, where a
    // handoff would send each event alone.
    if rt.spec.policy.ordering.is_some() || rt.spec.kind.batch().is_some() {
        return None;
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
    if let Some(limiter) = &rt.limiter
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

    /// Starts the attempt on `leased`, the entry accepted under this reservation.
    pub fn start(self, leased: Leased) {
        let now = self.ctx.clock.now_ms();
        // A first attempt: it counts toward the retry budget's base, as a worker's does.
        if let Some(mut budget) = self.rt.budget() {
            budget.first_attempt(now);
        }
        self.ctx
            .metrics
            .handoffs
            .get_or_create(&vec![("target", self.rt.spec.id.clone())])
            .inc();
        worker::spawn_attempt(
            &self.ctx,
            &self.rt,
            &self.target,
            leased,
            self.permit,
            false,
        );
    }
}
