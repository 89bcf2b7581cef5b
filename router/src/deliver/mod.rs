//! Delivery: one worker per target leases due entries from the store, makes attempts under the
//! target's policy, and records each outcome (delivered, retry at a due time, DLQ) durably.
//!
//! Isolation: every target has its own worker, concurrency limit and queue, so a slow or dead
//! target only ever holds its own leases.

mod worker;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::clock::Clock;
use crate::config::DeliveryConfig;
use crate::rules::{TargetKind, TargetSpec};
use crate::store::Store;
use crate::target::Target;
use crate::target::webhook::{Webhook, WebhookError};
use crate::telemetry::Metrics;

pub use worker::decide;

/// What every worker shares.
pub struct DeliveryContext {
    /// The store.
    pub store: Arc<dyn Store>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Time source.
    pub clock: Arc<dyn Clock>,
    /// `[delivery]` settings.
    pub cfg: DeliveryConfig,
    /// Shared HTTP client for webhooks.
    pub http: reqwest::Client,
    /// Cancelled at shutdown: workers stop leasing.
    pub cancel: CancellationToken,
    /// Tracks workers and in-flight attempts, so shutdown can wait for them.
    pub tracker: TaskTracker,
}

struct Running {
    spec: TargetSpec,
    stop: CancellationToken,
}

/// Starts, updates and stops target workers.
pub struct Dispatcher {
    ctx: Arc<DeliveryContext>,
    running: Mutex<HashMap<String, Running>>,
}

/// A target that could not be started.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Webhook configuration problem.
    #[error("target {id}: {source}")]
    Webhook {
        /// Target id.
        id: String,
        /// Why.
        source: WebhookError,
    },
    /// The target kind is not available in this build yet.
    #[error("target {id}: {kind} targets are not supported yet; its entries stay queued")]
    Unsupported {
        /// Target id.
        id: String,
        /// Kind name.
        kind: &'static str,
    },
}

impl Dispatcher {
    /// A dispatcher with no workers yet.
    pub fn new(ctx: DeliveryContext) -> Arc<Self> {
        Arc::new(Self {
            ctx: Arc::new(ctx),
            running: Mutex::new(HashMap::new()),
        })
    }

    /// The shared context.
    pub fn context(&self) -> &Arc<DeliveryContext> {
        &self.ctx
    }

    fn build_target(&self, spec: &TargetSpec) -> Result<Arc<dyn Target>, StartError> {
        match &spec.kind {
            TargetKind::Webhook { url, headers, .. } => Ok(Arc::new(
                Webhook::new(
                    self.ctx.http.clone(),
                    url.clone(),
                    headers,
                    self.ctx.cfg.max_response_bytes,
                )
                .map_err(|source| StartError::Webhook {
                    id: spec.id.clone(),
                    source,
                })?,
            )),
            TargetKind::Handler { .. } => Err(StartError::Unsupported {
                id: spec.id.clone(),
                kind: "handler",
            }),
            TargetKind::Nats { .. } => Err(StartError::Unsupported {
                id: spec.id.clone(),
                kind: "nats",
            }),
        }
    }

    /// Runs a worker for `spec`, replacing one with an older configuration.
    pub fn ensure(&self, spec: TargetSpec) -> Result<(), StartError> {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if running.get(&spec.id).is_some_and(|r| r.spec == spec) {
            return Ok(());
        }
        let target = self.build_target(&spec)?;
        if let Some(old) = running.remove(&spec.id) {
            old.stop.cancel();
        }
        let stop = self.ctx.cancel.child_token();
        let ctx = self.ctx.clone();
        let s = spec.clone();
        let st = stop.clone();
        self.ctx
            .tracker
            .spawn(async move { worker::run(ctx, s, target, st).await });
        tracing::info!(target_id = %spec.id, "delivery worker started");
        running.insert(spec.id.clone(), Running { spec, stop });
        Ok(())
    }

    /// Ids and configurations of running workers.
    pub fn running(&self) -> Vec<TargetSpec> {
        let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        running.values().map(|r| r.spec.clone()).collect()
    }

    /// Starts the lease reaper: expired in-memory leases go back to their queues.
    pub fn start_reaper(&self) {
        let ctx = self.ctx.clone();
        self.ctx.tracker.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tokio::select! {
                    _ = ctx.cancel.cancelled() => break,
                    _ = tick.tick() => {
                        let n = ctx.store.reclaim_expired(ctx.clock.now_ms());
                        if n > 0 {
                            tracing::warn!(entries = n, "leases expired; entries returned to their queues");
                        }
                    }
                }
            }
        });
    }
}
