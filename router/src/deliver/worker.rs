//! One target's delivery worker and the attempt state machine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::DeliveryContext;
use crate::policy::backoff;
use crate::policy::config::RetryPolicy;
use crate::rules::TargetSpec;
use crate::store::{
    AttemptEnd, AttemptResult, Disposition, DlqReason, FinishError, Leased, Millis,
};
use crate::target::{AttemptOutcome, DeliveryRequest, Target};

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The worker loop: lease as many due entries as there are free slots, attempt each in its own
/// task, sleep until the next due time or a wake-up when idle.
pub(super) async fn run(
    ctx: Arc<DeliveryContext>,
    spec: TargetSpec,
    target: Arc<dyn Target>,
    stop: CancellationToken,
) {
    let concurrency = spec
        .policy
        .throttle
        .as_ref()
        .and_then(|t| t.max_concurrency)
        .map_or(ctx.cfg.concurrency, |c| c as usize)
        .max(1);
    let slots = Arc::new(Semaphore::new(concurrency));
    let notify = ctx.store.notifier(&spec.id);
    let lease_ms = ms(spec.policy.timeout + ctx.cfg.lease_margin);
    let spec = Arc::new(spec);
    loop {
        let first = tokio::select! {
            _ = stop.cancelled() => break,
            p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
        };
        let mut permits = vec![first];
        while let Ok(p) = slots.clone().try_acquire_owned() {
            permits.push(p);
        }
        let now = ctx.clock.now_ms();
        match ctx
            .store
            .lease(&spec.id, now, permits.len(), lease_ms)
            .await
        {
            Ok(batch) if !batch.is_empty() => {
                for leased in batch {
                    let Some(permit) = permits.pop() else { break };
                    let ctx2 = ctx.clone();
                    let spec2 = spec.clone();
                    let target2 = target.clone();
                    let span = tracing::info_span!("attempt", event_id = %leased.event.event.id, source = %leased.event.event.source, target = %spec.id, attempt = leased.entry.attempts.len());
                    ctx.tracker
                        .spawn(attempt(ctx2, spec2, target2, leased, permit).instrument(span));
                }
            }
            Ok(_) => {
                drop(permits);
                let wait = ctx
                    .store
                    .next_due(&spec.id)
                    .map_or(1000, |due| (due - now).clamp(1, 1000));
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = notify.notified() => {}
                    _ = tokio::time::sleep(Duration::from_millis(u64::try_from(wait).unwrap_or(1000))) => {}
                }
            }
            Err(e) => {
                drop(permits);
                tracing::error!(target_id = %spec.id, error = %e, "lease failed; retrying in 1s");
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        }
    }
    tracing::info!(target_id = %spec.id, "delivery worker stopped");
}

/// What to do after an attempt, from the outcome, the entry's history and the retry policy.
/// Pure, so the whole decision table is unit-tested. `jitter` is a number in [0, 1).
pub fn decide(
    outcome: &AttemptOutcome,
    attempts: u32,
    accepted_at: Millis,
    now: Millis,
    retry: &RetryPolicy,
    jitter: f64,
) -> Disposition {
    match outcome {
        AttemptOutcome::Delivered { .. } => Disposition::Delivered,
        AttemptOutcome::Permanent { .. } => Disposition::DeadLetter {
            reason: DlqReason::PermanentError,
        },
        AttemptOutcome::Retryable { retry_after, .. } => {
            if attempts >= retry.max_attempts {
                return Disposition::DeadLetter {
                    reason: DlqReason::RetriesExhausted,
                };
            }
            let wait = match retry_after {
                Some(ra) => (*ra).min(retry.retry_after_max),
                None => backoff::delay(retry, attempts, jitter),
            };
            let due_at = now.saturating_add(ms(wait));
            if due_at > accepted_at.saturating_add(ms(retry.max_age)) {
                return Disposition::DeadLetter {
                    reason: DlqReason::MaxAgeExceeded,
                };
            }
            Disposition::Retry { due_at }
        }
    }
}

async fn attempt(
    ctx: Arc<DeliveryContext>,
    spec: Arc<TargetSpec>,
    target: Arc<dyn Target>,
    leased: Leased,
    _permit: OwnedSemaphorePermit,
) {
    let retry = &spec.policy.retry;
    let n = u32::try_from(leased.entry.attempts.len()).unwrap_or(u32::MAX);
    let now = ctx.clock.now_ms();
    let labels = |result: &str| vec![("target", spec.id.clone()), ("result", result.to_string())];

    // Checks before spending the attempt: a crash loop or a long outage must not retry forever.
    let pre = if n > retry.max_attempts {
        Some((
            DlqReason::RetriesExhausted,
            format!(
                "not sent: {} attempts already made (max {})",
                n - 1,
                retry.max_attempts
            ),
        ))
    } else if now > leased.entry.accepted_at.saturating_add(ms(retry.max_age)) {
        Some((
            DlqReason::MaxAgeExceeded,
            format!(
                "not sent: event older than max_age {}",
                humantime::format_duration(retry.max_age)
            ),
        ))
    } else {
        None
    };
    let (end, disposition, outcome_label) = if let Some((reason, error)) = pre {
        (
            AttemptEnd {
                finished_at: now,
                result: AttemptResult::Interrupted,
                status: None,
                error: Some(error),
            },
            Disposition::DeadLetter { reason },
            "dead_lettered",
        )
    } else {
        let body = match serde_json::to_vec(&leased.event.event.to_json()) {
            Ok(b) => bytes::Bytes::from(b),
            Err(e) => {
                tracing::error!(error = %e, "cannot serialise event");
                return;
            }
        };
        let req = DeliveryRequest {
            body,
            idempotency_key: leased.entry.idempotency_key.clone(),
            event_id: leased.event.event.id.clone(),
            attempt: n,
            traceparent: leased.event.event.traceparent().map(str::to_string),
            timeout: spec.policy.timeout,
        };
        let started = Instant::now();
        let outcome = target.deliver(&req).await;
        ctx.metrics
            .attempt_seconds
            .get_or_create(&vec![("target", spec.id.clone())])
            .observe(started.elapsed().as_secs_f64());
        let finished = ctx.clock.now_ms();
        let disposition = decide(
            &outcome,
            n,
            leased.entry.accepted_at,
            finished,
            retry,
            rand::random::<f64>(),
        );
        let result = match &outcome {
            AttemptOutcome::Delivered { .. } => AttemptResult::Delivered,
            AttemptOutcome::Retryable { .. } => AttemptResult::Retryable,
            AttemptOutcome::Permanent { .. } => AttemptResult::Permanent,
        };
        let label = match &disposition {
            Disposition::Delivered => "delivered",
            Disposition::Retry { .. } | Disposition::Release { .. } => "retried",
            Disposition::DeadLetter { .. } => "dead_lettered",
        };
        match &disposition {
            Disposition::Delivered => tracing::debug!(status = ?outcome.status(), "delivered"),
            Disposition::Retry { due_at } => {
                tracing::info!(
                    error = outcome.error().unwrap_or(""),
                    retry_in_ms = due_at - finished,
                    "attempt failed; retry scheduled"
                )
            }
            Disposition::DeadLetter { reason } => {
                tracing::warn!(
                    error = outcome.error().unwrap_or(""),
                    reason = reason.as_str(),
                    "attempt failed; moved to the DLQ"
                )
            }
            Disposition::Release { .. } => {}
        }
        (
            AttemptEnd {
                finished_at: finished,
                result,
                status: outcome.status(),
                error: outcome.error().map(str::to_string),
            },
            disposition,
            label,
        )
    };
    let dlq_reason = match &disposition {
        Disposition::DeadLetter { reason } => Some(*reason),
        _ => None,
    };
    let finished_at = end.finished_at;
    match ctx
        .store
        .finish(leased.entry.id, leased.lease, end, disposition, finished_at)
        .await
    {
        Ok(()) => {
            ctx.metrics
                .deliveries
                .get_or_create(&labels(outcome_label))
                .inc();
            if let Some(r) = dlq_reason {
                ctx.metrics
                    .dlq_entries
                    .get_or_create(&vec![
                        ("target", spec.id.clone()),
                        ("reason", r.as_str().to_string()),
                    ])
                    .inc();
            }
        }
        Err(FinishError::Fenced) => {
            ctx.metrics
                .deliveries
                .get_or_create(&labels("fenced"))
                .inc();
            tracing::warn!(
                "lease expired before the attempt finished; its result is discarded (another worker owns the entry)"
            );
        }
        Err(e) => {
            // The lease stays recorded; it expires and the entry is attempted again.
            tracing::error!(error = %e, "could not record the attempt; the entry will be retried when its lease expires");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 3,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(1),
            max_age: Duration::from_secs(60),
            ..RetryPolicy::default()
        }
    }

    fn transient(retry_after: Option<Duration>) -> AttemptOutcome {
        AttemptOutcome::Retryable {
            error: "HTTP 500".into(),
            status: Some(500),
            retry_after,
        }
    }

    #[test]
    fn delivered_and_permanent_are_final() {
        let p = policy();
        assert_eq!(
            decide(
                &AttemptOutcome::Delivered { status: Some(200) },
                1,
                0,
                0,
                &p,
                0.5
            ),
            Disposition::Delivered
        );
        let perm = AttemptOutcome::Permanent {
            error: "HTTP 400".into(),
            status: Some(400),
        };
        assert_eq!(
            decide(&perm, 1, 0, 0, &p, 0.5),
            Disposition::DeadLetter {
                reason: DlqReason::PermanentError
            }
        );
    }

    #[test]
    fn transient_failures_retry_until_max_attempts() {
        let p = policy();
        assert!(matches!(
            decide(&transient(None), 1, 0, 0, &p, 0.5),
            Disposition::Retry { .. }
        ));
        assert!(matches!(
            decide(&transient(None), 2, 0, 0, &p, 0.5),
            Disposition::Retry { .. }
        ));
        assert_eq!(
            decide(&transient(None), 3, 0, 0, &p, 0.5),
            Disposition::DeadLetter {
                reason: DlqReason::RetriesExhausted
            }
        );
    }

    #[test]
    fn retry_after_is_honoured_up_to_its_cap_and_max_age_wins() {
        let mut p = policy();
        p.retry_after_max = Duration::from_secs(10);
        assert_eq!(
            decide(&transient(Some(Duration::from_secs(5))), 1, 0, 0, &p, 0.5),
            Disposition::Retry { due_at: 5000 }
        );
        assert_eq!(
            decide(&transient(Some(Duration::from_secs(50))), 1, 0, 0, &p, 0.5),
            Disposition::Retry { due_at: 10_000 }
        );
        // accepted at 0, max_age 60s: a retry due after 60s is a max_age_exceeded.
        assert_eq!(
            decide(
                &transient(Some(Duration::from_secs(5))),
                1,
                0,
                58_000,
                &p,
                0.5
            ),
            Disposition::DeadLetter {
                reason: DlqReason::MaxAgeExceeded
            }
        );
    }
}
