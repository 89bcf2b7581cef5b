//! Delivery: one worker per target leases due entries from the store, makes attempts under the
//! target's policy, and records each outcome (delivered, retry at a due time, DLQ) durably.
//!
//! Isolation: every target has its own worker, concurrency limit and queue, so a slow or dead
//! target only ever holds its own leases.

pub mod bytes;
mod handoff;
pub mod in_flight;
mod runtime;
mod store_faults;
mod threads;
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

pub use handoff::Reservation;
pub use runtime::{Limiter, PersistedState, TargetRuntime};
pub use store_faults::StoreFaults;
pub use threads::{DeliveryThreads, DeliveryThreadsStatus};
pub use worker::{
    DeadEvent, count_dead_letters, dead_lettered, dead_lettered_in_bulk, decide, slot_count,
    system_event,
};

/// Resolves a secret by name (environment, then the secrets file).
pub type SecretResolver = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

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
    /// The HTTP clients webhooks share.
    pub http: crate::target::webhook::WebhookClients,
    /// The NATS connection `nats:` targets share (opened when the first one starts).
    pub nats: Arc<crate::target::nats::NatsConnection>,
    /// Cancelled at shutdown: workers stop leasing.
    pub cancel: CancellationToken,
    /// Tracks workers and in-flight attempts, so shutdown can wait for them.
    pub tracker: TaskTracker,
    /// Where workers run: the delivery runtime (`DeliveryThreads`), apart from ingest's.
    /// Everything a worker spawns (attempts, connections, handler invocations) runs there too.
    pub spawner: tokio::runtime::Handle,
    /// Where workers send system events (breaker transitions) to be routed.
    pub system_events: Option<tokio::sync::mpsc::Sender<crate::event::CloudEvent>>,
    /// Resolves a secret name (`secret_env`): the environment, then the secrets file.
    pub secrets: SecretResolver,
    /// `secrets_env_prefix` (`None`: any name), to say why a name outside it was not found.
    pub secrets_env_prefix: Option<String>,
    /// The WASM handler runtime (`handler:` targets).
    pub handlers: Option<Arc<crate::target::handler::HandlerRuntime>>,
    /// Limits on the log lines about each target's failures and dead letters.
    pub log_gates: crate::telemetry::LogGates,
    /// New dead letters whose `router.dlq.added` was dropped, to be announced in a summary.
    pub unannounced: crate::system_events::Unannounced,
    /// What the workers met in the store (unreadable records, failing leases), for
    /// `/v1/status`.
    pub store_faults: StoreFaults,
    /// The process-wide bound on webhook and NATS attempts in flight
    /// (`delivery.max_in_flight`).
    pub in_flight: Arc<in_flight::InFlightCap>,
    /// The process-wide bound on the bytes of events leased by all targets
    /// (`delivery.max_in_flight_bytes`).
    pub bytes: Arc<bytes::BytePool>,
}

/// Takes a worker's semaphore of `from` slots to `to`: more are added at once; fewer are taken
/// out as they come free (those free now at once, the rest by a task that waits for them, ahead
/// of any new attempt, since the semaphore is fair).
fn resize_slots(
    slots: &Arc<tokio::sync::Semaphore>,
    from: usize,
    to: usize,
    tracker: &tokio_util::task::TaskTracker,
) {
    if to >= from {
        slots.add_permits(to - from);
        return;
    }
    let rest = (from - to) - slots.forget_permits(from - to);
    if let Ok(rest) = u32::try_from(rest)
        && rest > 0
    {
        let slots = slots.clone();
        tracker.spawn(async move {
            if let Ok(p) = slots.acquire_many(rest).await {
                p.forget();
            }
        });
    }
}

struct Running {
    runtime: Arc<TargetRuntime>,
    /// A fingerprint of the signing secret the target was built with (see [`fingerprint`]).
    secret: Option<u64>,
    stop: CancellationToken,
    target: Arc<dyn Target>,
    /// The worker's attempt slots, shared with handoffs at acceptance.
    slots: Arc<tokio::sync::Semaphore>,
}

/// An in-process hash of a signing secret, to notice that it changed without keeping it.
fn fingerprint(secrets: &TargetSecrets) -> Option<u64> {
    use std::hash::{Hash as _, Hasher as _};
    if secrets.signing.is_none() && secrets.headers.is_empty() {
        return None;
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    secrets.signing.hash(&mut h);
    secrets.headers.hash(&mut h);
    Some(h.finish())
}

/// The secrets a target is built with, as the environment or the secrets file hold them when
/// read: the signing secret (`secret_env`) and the secret headers (`headers_env`: header name,
/// variable name, value if set).
#[derive(Debug, Default)]
struct TargetSecrets {
    signing: Option<String>,
    headers: Vec<(String, String, Option<String>)>,
}

/// Store key prefix of an operator's pause of a target (kept beside target states, apart from
/// the target's own record, which breakers on every node also write).
pub const PAUSE_STATE_PREFIX: &str = "pause:";

/// Field of an operator's pause record: when the operator last lifted the receiver's
/// Retry-After pause (clock ms), which every node follows.
pub const HOLD_LIFTED_AT: &str = "hold_lifted_at";

/// Starts, updates and stops target workers.
pub struct Dispatcher {
    ctx: Arc<DeliveryContext>,
    running: Mutex<HashMap<String, Running>>,
    /// Counts operators' changes made through this node (pauses, rule switches), each made
    /// under this lock once persisted: a follower of other nodes' changes applies what it read
    /// only if none came in meanwhile, so it never puts back a state it read before one.
    operator_changes: Mutex<u64>,
    /// Held by an operator's pause or resume from its write to its in-memory change.
    pausing: tokio::sync::Mutex<()>,
    /// On a shared store: how this node's reads of the other nodes' pauses, rule switches
    /// and open breakers go (`/v1/status` `containment_sync`).
    containment_sync: Mutex<crate::store::SyncHealth>,
    /// Live router nodes sharing the store (each target's throttle rate is split among them).
    nodes: std::sync::atomic::AtomicUsize,
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
    /// The webhook's signing secret is missing or malformed: nothing is sent unsigned. (What
    /// happens to its entries depends on where the error arises, so the caller says it.)
    #[error("target {id}: signing secret {name}: {why}")]
    Secret {
        /// Target id.
        id: String,
        /// The `secret_env` name.
        name: String,
        /// What is wrong.
        why: String,
    },
    /// A `headers_env` credential is missing or cannot be sent: nothing is sent without the
    /// credential the receiver expects. (Not "signing secret": it is a header's value.)
    #[error("target {id}: header {header} from {name} (headers_env): {why}")]
    HeaderSecret {
        /// Target id.
        id: String,
        /// The header it is sent as.
        header: String,
        /// The `headers_env` variable (or secrets-file entry) name.
        name: String,
        /// What is wrong.
        why: String,
    },
    /// The target kind is not available in this process (handler targets while the WASM
    /// runtime could not start).
    #[error(
        "target {id}: {kind} targets cannot run: the WASM handler runtime did not start (see the warnings in /v1/status; fix it and restart)"
    )]
    Unsupported {
        /// Target id.
        id: String,
        /// Kind name.
        kind: &'static str,
    },
    /// The NATS token or password variable the configuration names is not set: every
    /// connect would fail, so the target waits instead of spending its entries' attempts.
    #[error("target {id}: {why}")]
    NatsSecret {
        /// Target id.
        id: String,
        /// What is missing.
        why: String,
    },
    /// A `nats:` target's subject is one the router must not publish to (the JetStream
    /// store's records).
    #[error("target {id}: {why}")]
    Reserved {
        /// Target id.
        id: String,
        /// What is wrong.
        why: String,
    },
}

/// The store's target-state records (breakers, pauses), read at most once for a batch of
/// worker starts ([`Dispatcher::start_with`]): on the first start that needs them, not at all
/// when every start replaces a running worker (which hands its state over itself).
#[derive(Default)]
pub struct StoredStates {
    read: tokio::sync::OnceCell<Result<HashMap<String, serde_json::Value>, ()>>,
}

impl StoredStates {
    /// The records by key, read from `store` on the first call. A read that fails is logged
    /// once here: the batch's new workers start without their saved state, as one would
    /// have alone.
    async fn get(&self, store: &dyn Store) -> Option<&HashMap<String, serde_json::Value>> {
        self.read
            .get_or_init(|| async {
                match store.target_states().await {
                    Ok(states) => Ok(states.into_iter().collect()),
                    Err(e) => {
                        tracing::error!(error = %e, "cannot read the persisted target states: the workers starting now begin without their saved breaker and pause");
                        Err(())
                    }
                }
            })
            .await
            .as_ref()
            .ok()
    }
}

/// A target built and ready to run ([`Dispatcher::prepare`]).
pub struct PreparedTarget {
    spec: TargetSpec,
    target: Arc<dyn Target>,
    secret: Option<u64>,
}

impl PreparedTarget {
    /// Its target id.
    pub fn id(&self) -> &str {
        &self.spec.id
    }
}

impl Dispatcher {
    /// A dispatcher with no workers yet.
    pub fn new(ctx: DeliveryContext) -> Arc<Self> {
        Arc::new(Self {
            ctx: Arc::new(ctx),
            running: Mutex::new(HashMap::new()),
            operator_changes: Mutex::new(0),
            pausing: tokio::sync::Mutex::new(()),
            containment_sync: Mutex::default(),
            nodes: std::sync::atomic::AtomicUsize::new(1),
        })
    }

    /// Live router nodes sharing the store, as last counted (1 on a store of its own).
    pub fn nodes(&self) -> usize {
        self.nodes.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Splits every target's throttle rate among `nodes` live nodes from now on.
    pub fn set_nodes(&self, nodes: usize) {
        let nodes = nodes.max(1);
        if self.nodes.swap(nodes, std::sync::atomic::Ordering::SeqCst) == nodes {
            return;
        }
        for rt in self.runtimes() {
            rt.share_among(nodes);
        }
    }

    /// Makes an operator's change here (already persisted) with `apply`.
    pub fn operator_change<R>(&self, apply: impl FnOnce() -> R) -> R {
        let mut n = self
            .operator_changes
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        *n += 1;
        apply()
    }

    /// Records a read of the operators' state that other nodes wrote, ended at `now`
    /// (RFC 3339), logging its first failure and the recovery after failures.
    pub fn record_containment_sync<T>(
        &self,
        result: &Result<T, crate::store::StoreError>,
        now: String,
    ) {
        let mut health = self
            .containment_sync
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let since = health.failing_since.clone();
        if health.record(result, now) {
            if let Err(e) = result {
                tracing::warn!(error = %e, "cannot read the operators' target and rule states; pauses, rule switches and breakers of other nodes are not applied here until it can");
            }
        } else if let (Ok(_), Some(since)) = (result, since) {
            tracing::info!(failing_since = %since, "reading the operators' target and rule states again");
        }
    }

    /// What the workers met in the store (`/v1/status`).
    pub fn store_faults(&self) -> &StoreFaults {
        &self.ctx.store_faults
    }

    /// See [`Self::record_containment_sync`].
    pub fn containment_sync(&self) -> crate::store::SyncHealth {
        self.containment_sync
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How many operator changes this node has made (see [`Self::if_no_operator_change`]).
    pub fn operator_changes(&self) -> u64 {
        *self
            .operator_changes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `apply` (other nodes' changes, read after [`Self::operator_changes`] answered
    /// `since`) unless this node made a change since. Returns whether it ran.
    pub fn if_no_operator_change(&self, since: u64, apply: impl FnOnce()) -> bool {
        let n = self
            .operator_changes
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if *n != since {
            return false;
        }
        apply();
        true
    }

    /// The shared context.
    pub fn context(&self) -> &Arc<DeliveryContext> {
        &self.ctx
    }

    /// Why the secret `name` a rule file gives was not found.
    fn not_set(&self, name: &str) -> String {
        match &self.ctx.secrets_env_prefix {
            Some(p) if !name.starts_with(p.as_str()) => format!(
                "not in the secrets file (rule files read only environment variables named {p}…, secrets_env_prefix)"
            ),
            _ => "not set in the environment or the secrets file".to_string(),
        }
    }

    /// Builds the target of `spec` with the secrets its `secret_env` and `headers_env` name, as
    /// [`Self::secrets_of`] read it.
    fn build_target(
        &self,
        spec: &TargetSpec,
        secrets: &TargetSecrets,
    ) -> Result<Arc<dyn Target>, StartError> {
        let secret = secrets.signing.as_deref();
        match &spec.kind {
            TargetKind::Webhook {
                url,
                headers,
                secret_env,
                ..
            } => {
                // Secret headers join the plain ones; one not set keeps the target from
                // starting (nothing is sent without the credential the receiver expects).
                let mut headers = headers.clone();
                for (header, var, value) in &secrets.headers {
                    let value = value.as_ref().ok_or_else(|| StartError::HeaderSecret {
                        id: spec.id.clone(),
                        header: header.clone(),
                        name: var.clone(),
                        why: self.not_set(var),
                    })?;
                    if value.contains(['\r', '\n']) {
                        return Err(StartError::HeaderSecret {
                            id: spec.id.clone(),
                            header: header.clone(),
                            name: var.clone(),
                            why: "the value contains a line break".to_string(),
                        });
                    }
                    headers.insert(header.clone(), value.clone());
                }
                let keys = match secret_env {
                    None => Vec::new(),
                    Some(name) => {
                        let value = secret.ok_or_else(|| StartError::Secret {
                            id: spec.id.clone(),
                            name: name.clone(),
                            why: self.not_set(name),
                        })?;
                        crate::target::webhook::parse_secrets(value).map_err(|e| {
                            StartError::Secret {
                                id: spec.id.clone(),
                                name: name.clone(),
                                why: e.to_string(),
                            }
                        })?
                    }
                };
                let hook = Webhook::new(
                    &self.ctx.http,
                    url.clone(),
                    &headers,
                    self.ctx.cfg.max_response_bytes,
                    keys,
                )
                .map_err(|source| StartError::Webhook {
                    id: spec.id.clone(),
                    source,
                })?;
                Ok(Arc::new(hook))
            }
            TargetKind::Handler { name } => match &self.ctx.handlers {
                Some(rt) => Ok(Arc::new(crate::target::handler::HandlerTarget::new(
                    rt.clone(),
                    name.clone(),
                ))),
                None => Err(StartError::Unsupported {
                    id: spec.id.clone(),
                    kind: "handler",
                }),
            },
            TargetKind::Nats { subject } => {
                if let Some(why) = self.ctx.nats.refuses(subject) {
                    return Err(StartError::Reserved {
                        id: spec.id.clone(),
                        why,
                    });
                }
                if let Some(why) = self.ctx.nats.missing_secret() {
                    return Err(StartError::NatsSecret {
                        id: spec.id.clone(),
                        why,
                    });
                }
                // The first nats target opens the shared connection; without one the router
                // never connects to NATS.
                self.ctx.nats.warm(&self.ctx.tracker);
                Ok(Arc::new(crate::target::nats::NatsTarget::new(
                    self.ctx.nats.clone(),
                    subject,
                )))
            }
        }
    }

    /// Builds the target of `spec` (what [`Self::ensure`] would refuse: a signing secret not
    /// set, the WASM runtime down for a handler) without starting a worker:
    /// [`Self::start`] runs it.
    pub fn prepare(&self, spec: TargetSpec) -> Result<PreparedTarget, StartError> {
        // Read once: the fingerprint kept is that of the secrets the target is built with.
        let secrets = self.secrets_of(&spec);
        let target = self.build_target(&spec, &secrets)?;
        Ok(PreparedTarget {
            spec,
            target,
            secret: fingerprint(&secrets),
        })
    }

    /// The secrets `spec` names (`secret_env`, `headers_env`), as the environment or the
    /// secrets file hold them now.
    fn secrets_of(&self, spec: &TargetSpec) -> TargetSecrets {
        match &spec.kind {
            TargetKind::Webhook {
                secret_env,
                headers_env,
                ..
            } => TargetSecrets {
                signing: secret_env
                    .as_ref()
                    .and_then(|name| (self.ctx.secrets)(name)),
                headers: headers_env
                    .iter()
                    .map(|(header, var)| (header.clone(), var.clone(), (self.ctx.secrets)(var)))
                    .collect(),
            },
            // The connection's token or password: a reload notices it set since (the target
            // could not start without it) or changed.
            TargetKind::Nats { .. } => TargetSecrets {
                signing: self.ctx.nats.credential_secret().flatten(),
                headers: Vec::new(),
            },
            _ => TargetSecrets::default(),
        }
    }

    /// Whether a worker runs `spec` as it is now: the same configuration and, for a signed
    /// webhook, the same secret (a reload notices a secret changed in the environment or the
    /// secrets file, a key rotation, although the rule files did not change). A reload
    /// prepares the targets for which this is false.
    pub fn is_current(&self, spec: &TargetSpec) -> bool {
        let secret = fingerprint(&self.secrets_of(spec));
        let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        running
            .get(&spec.id)
            .is_some_and(|r| r.runtime.spec == *spec && r.secret == secret)
    }

    /// Runs a worker for `spec`, replacing one with an older configuration.
    pub async fn ensure(&self, spec: TargetSpec) -> Result<(), StartError> {
        self.ensure_with(spec, &StoredStates::default()).await
    }

    /// [`Self::ensure`], a new worker reading its saved state from `states` (see
    /// [`Self::start_with`]).
    pub async fn ensure_with(
        &self,
        spec: TargetSpec,
        states: &StoredStates,
    ) -> Result<(), StartError> {
        let prepared = self.prepare(spec)?;
        self.start_with(prepared, states).await;
        Ok(())
    }

    /// Runs a worker for a prepared target, replacing one with an older configuration (a
    /// worker with the same configuration stays as it is).
    pub async fn start(&self, prepared: PreparedTarget) {
        self.start_with(prepared, &StoredStates::default()).await;
    }

    /// [`Self::start`] as one of a batch (the start-up's targets, a reload's): a new worker's
    /// saved state comes from `states`, which reads the store's target-state records once for
    /// the whole batch. Each read returns every record (the table, or the JetStream view), so
    /// reading it per target made starting N targets after an outage cost N × records.
    pub async fn start_with(&self, prepared: PreparedTarget, states: &StoredStates) {
        let PreparedTarget {
            spec,
            target,
            secret,
        } = prepared;
        // The live policy decides whether the queue's keyed entries wait for one another, not
        // the key each was accepted with: ordering removed lets them all go at once. Set
        // before the worker (re)starts, so its first lease already sees it.
        self.ctx
            .store
            .set_ordered(&spec.id, spec.policy.ordering.is_some());
        let mut fresh = false;
        // A new worker's saved state is read before the lock is taken: on the JetStream store
        // the read is a round trip, and ingest takes this lock on every accept (`reserve`). A
        // runtime thread blocked on the lock behind that read can starve the very task that
        // would answer it (seen as a reload hanging until the client gave up).
        // In a block of its own: the lock is not held across the write below.
        let (runtime, receiver_changed) = {
            let (mut running, stored) = loop {
                let was_running = {
                    let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
                    match running.get(&spec.id) {
                        Some(r) if r.runtime.spec == spec && r.secret == secret => return,
                        r => r.is_some(),
                    }
                };
                let stored = if was_running {
                    None
                } else if fresh {
                    // Stopped since the batch's records were read: its worker may have saved a
                    // newer state since.
                    Some(self.persisted(&spec.id, &StoredStates::default()).await)
                } else {
                    Some(self.persisted(&spec.id, states).await)
                };
                let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
                match (running.get(&spec.id), stored) {
                    (Some(r), _) if r.runtime.spec == spec && r.secret == secret => return,
                    (Some(_), _) => break (running, None),
                    (None, Some(stored)) => break (running, Some(stored)),
                    // Stopped between the two looks (rare): look again, reading its saved state
                    // outside the lock.
                    (None, None) => fresh = true,
                }
            };
            let count = worker::slot_count(&spec, &self.ctx.cfg);
            let old = running.remove(&spec.id);
            // The receiver the old worker sent to, when this configuration sends elsewhere (a
            // URL switched to a backup): what that receiver asked for (a Retry-After pause) and
            // what its failures opened (the breaker) are not the new receiver's. Carried over,
            // a failover to a healthy backup waited out the old receiver's pause, up to
            // `retry_after_max` (1 h by default), under a fate saying the receiver asked to wait.
            let receiver_changed = old
                .as_ref()
                .map(|old| old.runtime.spec.kind.destination())
                .filter(|was| *was != spec.kind.destination());
            let persisted = match &old {
                Some(old) => {
                    old.stop.cancel();
                    let state = old.runtime.persisted();
                    Some(if receiver_changed.is_some() {
                        state.without_receiver()
                    } else {
                        state
                    })
                }
                None => stored.flatten(),
            };
            // A replaced worker's attempts in flight keep holding their slots: the new worker
            // takes the same semaphore, resized, so a concurrency lowered to protect a struggling
            // dependency holds at once (fresh slots let old and new attempts add up until the old
            // ones ended, up to a timeout later).
            let slots = match &old {
                Some(old) => {
                    // The configuration is fixed for the process: the old worker's count is its
                    // spec's.
                    let was = worker::slot_count(&old.runtime.spec, &self.ctx.cfg);
                    resize_slots(&old.slots, was, count, &self.ctx.tracker);
                    old.slots.clone()
                }
                None => Arc::new(tokio::sync::Semaphore::new(count)),
            };
            let mut runtime = TargetRuntime::new(spec, persisted, self.ctx.clock.now_ms());
            // The same target id goes on with its counters and its breaker (like its slots above
            // and its token bucket below): a reload is not a reason to forget them.
            if let Some(old) = &old {
                if receiver_changed.is_some() {
                    runtime.carry_over_counters(&old.runtime);
                } else {
                    runtime.carry_over(&old.runtime);
                }
            }
            let runtime = Arc::new(runtime);
            runtime.share_among(self.nodes());
            // The same rate keeps its bucket: a fresh one would hand out a whole burst at once.
            if let Some(old) = &old
                && old.runtime.spec.policy.throttle == runtime.spec.policy.throttle
            {
                runtime.adopt_limiter(&old.runtime);
            }
            let stop = self.ctx.cancel.child_token();
            let (ctx, rt, st, t, sl) = (
                self.ctx.clone(),
                runtime.clone(),
                stop.clone(),
                target.clone(),
                slots.clone(),
            );
            self.ctx.tracker.spawn_on(
                async move { worker::run(ctx, rt, t, sl, st).await },
                &self.ctx.spawner,
            );
            tracing::info!(target_id = %runtime.spec.id, "delivery worker started");
            running.insert(
                runtime.spec.id.clone(),
                Running {
                    runtime: runtime.clone(),
                    secret,
                    stop,
                    target,
                    slots,
                },
            );
            (runtime, receiver_changed)
        };
        if let Some(was) = receiver_changed {
            self.forget_receiver_state(&runtime, &was).await;
        }
    }

    /// Writes the target's record without the old receiver's Retry-After pause and breaker
    /// state (its destination changed from `was`): a restart, or another node's follower,
    /// reading the old record would put them back on the new receiver.
    async fn forget_receiver_state(&self, runtime: &TargetRuntime, was: &str) {
        let id = &runtime.spec.id;
        tracing::warn!(target_id = %id, from = %was, to = %runtime.spec.kind.destination(), "target's destination changed: the old receiver's Retry-After pause and circuit breaker state are cleared, the new receiver starts with none");
        let state = serde_json::to_value(runtime.persisted()).unwrap_or_default();
        if let Err(e) = self.ctx.store.put_target_state(id, state).await {
            tracing::warn!(target_id = %id, error = %e, "could not persist the cleared Retry-After pause and breaker of a target whose destination changed; a restart may restore the old receiver's (resume the target to lift the pause)");
        }
    }

    /// The saved state a new worker of `id` starts from: its record and its operator's pause
    /// record, as `states` holds them (read now if not yet).
    async fn persisted(&self, id: &str, states: &StoredStates) -> Option<PersistedState> {
        match states.get(self.ctx.store.as_ref()).await {
            Some(states) => {
                let pause_key = format!("{PAUSE_STATE_PREFIX}{id}");
                let mut state: Option<PersistedState> = states
                    .get(id)
                    .and_then(|v| serde_json::from_value(v.clone()).ok());
                let pause = states.get(&pause_key);
                let paused = pause.and_then(|v| v["paused"].as_bool());
                let lifted_at = pause.and_then(|v| v[HOLD_LIFTED_AT].as_i64());
                // A Retry-After pause an operator lifted stays lifted across a restart, even
                // if the target's record could not be written without it at the lift.
                if let (Some(s), Some(at)) = (state.as_mut(), lifted_at)
                    && s.retry_after_since.is_none_or(|since| since <= at)
                {
                    s.retry_after_until = None;
                    s.retry_after_since = None;
                }
                // The operator's own record wins: on a shared store the target's record is
                // also written by other nodes' breakers, with their view of the pause.
                match (state, paused) {
                    (Some(mut s), Some(p)) => {
                        s.paused = p;
                        Some(s)
                    }
                    (None, Some(p)) => Some(PersistedState {
                        paused: p,
                        ..PersistedState::default()
                    }),
                    (s, None) => {
                        if s.as_ref().is_some_and(|s| s.paused) {
                            // Paused before operators' pauses had records of their own: given
                            // one, so that other nodes on a shared store follow it and their
                            // breakers' writes of the target's record cannot undo it.
                            if let Err(e) = self
                                .ctx
                                .store
                                .put_target_state(&pause_key, serde_json::json!({ "paused": true }))
                                .await
                            {
                                tracing::warn!(target_id = %id, error = %e, "cannot give an older pause a record of its own; tried again at the next start");
                            }
                        }
                        s
                    }
                }
            }
            // Said once, by the read.
            None => None,
        }
    }

    /// A free attempt slot of target `id` for `entries` entries of one request being accepted
    /// at `now` (one, or a batching webhook's several), when the target could send them at
    /// once (see `delivery.handoff`); `None` leaves them to its queue. The slot is held until
    /// the reservation is started or dropped. `kib` is what the entries' events weigh in the
    /// byte pool (`delivery.max_in_flight_bytes`): with no room for them now, `None`.
    pub fn reserve(
        &self,
        id: &str,
        now: crate::store::Millis,
        entries: usize,
        kib: u64,
    ) -> Option<Reservation> {
        if !self.ctx.cfg.handoff {
            return None;
        }
        let (rt, target, slots) = {
            let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
            let r = running.get(id)?;
            if r.stop.is_cancelled() {
                return None;
            }
            (r.runtime.clone(), r.target.clone(), r.slots.clone())
        };
        handoff::reserve(&self.ctx, rt, target, &slots, now, (entries, kib))
    }

    /// The NATS connection `nats:` targets share (its state, for status and metrics).
    pub fn nats(&self) -> &Arc<crate::target::nats::NatsConnection> {
        &self.ctx.nats
    }

    /// Stops the worker of `id`, if one runs: a target removed from the rules whose queue has
    /// drained (the caller checks that nothing is queued or in flight for it). Its runtime
    /// goes with it, and with it its `router_target_paused` and `router_breaker_state` series
    /// and its `/v1/targets` row; its saved configuration and states stay in the store, for a
    /// reload that brings it back. Returns whether one ran.
    pub fn stop(&self, id: &str) -> bool {
        let stopped = self
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        match stopped {
            Some(r) => {
                r.stop.cancel();
                true
            }
            None => false,
        }
    }

    /// Every running target's runtime.
    pub fn runtimes(&self) -> Vec<Arc<TargetRuntime>> {
        let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        running.values().map(|r| r.runtime.clone()).collect()
    }

    /// Ids and configurations of running workers.
    pub fn running(&self) -> Vec<TargetSpec> {
        self.runtimes().iter().map(|r| r.spec.clone()).collect()
    }

    /// The runtime of one target.
    pub fn runtime(&self, id: &str) -> Option<Arc<TargetRuntime>> {
        let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        running.get(id).map(|r| r.runtime.clone())
    }

    /// Pauses or resumes a target (persisted). A resume also lifts the receiver's
    /// Retry-After pause (persisted, and followed by every node): an operator whose receiver
    /// is back had no way to end a pause of up to `retry_after_max` (1 h by default), through
    /// which the whole queue waited, or aged past `max_age` into the DLQ. Returns false for
    /// an unknown target.
    pub async fn set_paused(
        &self,
        id: &str,
        paused: bool,
    ) -> Result<bool, crate::store::StoreError> {
        let Some(rt) = self.runtime(id) else {
            return Ok(false);
        };
        // One operator's pause or resume at a time: two at once could store theirs and set
        // the worker's flag in opposite orders, leaving the worker unlike the store.
        let _one_at_a_time = self.pausing.lock().await;
        let now = self.ctx.clock.now_ms();
        let lifted_at = if paused {
            rt.hold_lifted_at()
        } else {
            Some(now)
        };
        if !paused {
            // The target's record first: a restart reads the lift from the pause record too,
            // but other nodes' followers take up the record's pause until it is gone.
            self.store_lift(&rt, id, now).await?;
        }
        // Only the operator's own record: the target's record holds the breaker, which
        // other nodes also write, and the pause record wins over it wherever it is read.
        let mut record = serde_json::json!({ "paused": paused });
        if let Some(at) = lifted_at {
            record[HOLD_LIFTED_AT] = serde_json::json!(at);
        }
        self.ctx
            .store
            .put_target_state(&format!("{PAUSE_STATE_PREFIX}{id}"), record)
            .await?;
        let lifted = self.operator_change(|| {
            self.set_pause_flag(id, paused);
            if paused {
                None
            } else {
                self.runtime(id).and_then(|rt| rt.lift_hold(now))
            }
        });
        self.ctx.store.notifier(id).notify_one();
        tracing::warn!(target_id = %id, paused, "target pause state changed by an operator");
        if let Some(until) = lifted {
            tracing::warn!(target_id = %id, was_until = %crate::clock::rfc3339(until), "the receiver's Retry-After pause lifted by an operator's resume; entries are sent again");
        }
        Ok(true)
    }

    /// Writes target `id`'s record without the receiver's pause an operator lifts at `now`.
    async fn store_lift(
        &self,
        rt: &TargetRuntime,
        id: &str,
        now: i64,
    ) -> Result<(), crate::store::StoreError> {
        let state = if self.ctx.store.shared() {
            // The record is every node's: only the pause is this one's to change.
            let states = self.ctx.store.target_states().await?;
            worker::without_retry_after(&states, id, now)
        } else {
            let mut s = rt.persisted();
            s.retry_after_until = None;
            s.retry_after_since = None;
            s
        };
        self.ctx
            .store
            .put_target_state(id, serde_json::to_value(state).unwrap_or_default())
            .await
    }

    /// Lifts target `id`'s Retry-After pause because an operator lifted it at `lifted_at` on
    /// another node sharing the store (a resume there). Returns whether one was in effect here.
    pub fn follow_lift(&self, id: &str, lifted_at: i64) -> bool {
        let Some(rt) = self.runtime(id) else {
            return false;
        };
        if !rt.follow_lift(lifted_at, self.ctx.clock.now_ms()) {
            return false;
        }
        self.ctx.store.notifier(id).notify_one();
        tracing::warn!(target_id = %id, "the receiver's Retry-After pause lifted by an operator on another node; entries are sent again");
        true
    }

    /// Sets the pause flag of the worker running `id` now, under the lock a reload replaces
    /// workers under (a replacement copies the flag of the worker it replaces: set on one
    /// already replaced, the pause would be lost). Returns the flag before, if `id` runs.
    fn set_pause_flag(&self, id: &str, paused: bool) -> Option<bool> {
        let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        running.get(id).map(|r| {
            r.runtime
                .paused
                .swap(paused, std::sync::atomic::Ordering::SeqCst)
        })
    }

    /// Opens target `id`'s breaker until `until` because another node's breaker for it opened
    /// (see [`Breaker::follow_open`](crate::policy::breaker::Breaker::follow_open)): counted
    /// and logged here, not persisted or raised as a system event again (that node did both).
    /// Returns whether it opened.
    pub fn follow_breaker_open(&self, id: &str, until: i64) -> bool {
        let Some(t) = self.follow_breaker(id, |b, now| b.follow_open(until, now)) else {
            return false;
        };
        tracing::warn!(target_id = %id, failure_rate = t.failure_rate, requests = t.requests, open_until = %crate::clock::rfc3339(until), "circuit breaker opened: another node's breaker for this target opened, and this node has seen it fail too");
        true
    }

    /// Closes target `id`'s half-open breaker because another node's breaker for it closed at
    /// `closed_at`, after this one opened (see
    /// [`Breaker::follow_close`](crate::policy::breaker::Breaker::follow_close)): counted and
    /// logged here as a followed transition, not persisted or raised again (that node did
    /// both). Returns whether it closed.
    pub fn follow_breaker_close(&self, id: &str, closed_at: i64) -> bool {
        if self
            .follow_breaker(id, |b, now| b.follow_close(closed_at, now))
            .is_none()
        {
            return false;
        }
        tracing::warn!(target_id = %id, closed_at = %crate::clock::rfc3339(closed_at), "circuit breaker closed: another node's breaker for this target closed (its probe succeeded) after this one opened");
        true
    }

    /// What following another node's breaker transition shares: `change` applied to target
    /// `id`'s breaker at the clock's now, and a transition it made counted (not persisted or
    /// raised as a system event: the other node did both) with the worker woken.
    fn follow_breaker(
        &self,
        id: &str,
        change: impl FnOnce(
            &mut crate::policy::breaker::Breaker,
            i64,
        ) -> Option<crate::policy::breaker::Transition>,
    ) -> Option<crate::policy::breaker::Transition> {
        let rt = self.runtime(id)?;
        let now = self.ctx.clock.now_ms();
        let t = rt.breaker().and_then(|mut b| change(&mut b, now))?;
        worker::count_transition(&self.ctx, id, &t);
        self.ctx.store.notifier(id).notify_one();
        Some(t)
    }

    /// Holds target `id` off until `until` because another node's request was answered 429
    /// or 503 with `Retry-After` (that node persisted the pause with its breaker's record): the
    /// receiver asked the service, not one node, to wait. Not persisted again. Returns whether
    /// it started a pause here or extended this node's by a second or more.
    pub fn follow_retry_after(&self, id: &str, until: i64, since: Option<i64>) -> bool {
        let Some(rt) = self.runtime(id) else {
            return false;
        };
        let now = self.ctx.clock.now_ms();
        if until <= now || !rt.hold_off_until(until, since.unwrap_or(now)) {
            return false;
        }
        tracing::warn!(target_id = %id, until = %crate::clock::rfc3339(until), "the receiver asked another node to hold off (Retry-After); nothing is sent to it from this node either until then");
        true
    }

    /// Applies a pause or resume made on another node sharing the store (already persisted
    /// there). Returns whether this node's worker changed.
    pub fn follow_pause(&self, id: &str, paused: bool) -> bool {
        if self.set_pause_flag(id, paused) != Some(!paused) {
            return false;
        }
        self.ctx.store.notifier(id).notify_one();
        tracing::warn!(target_id = %id, paused, "target pause state changed by an operator on another node");
        true
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::store::{RedbStore, Store, StoreOptions};

    /// Lowered while all four slots are in flight, a worker's semaphore lets no new attempt
    /// start until only one is left, then holds one; raised, it grows at once.
    #[tokio::test]
    async fn slots_resized_under_attempts_in_flight_hold_the_new_bound() {
        let tracker = tokio_util::task::TaskTracker::new();
        let slots = Arc::new(tokio::sync::Semaphore::new(4));
        let held: Vec<_> = (0..4)
            .map(|_| slots.clone().try_acquire_owned().expect("a slot"))
            .collect();
        super::resize_slots(&slots, 4, 1, &tracker);
        let mut held = held.into_iter();
        for _ in 0..3 {
            drop(held.next());
            tokio::task::yield_now().await;
            assert_eq!(slots.available_permits(), 0, "still above the new bound");
        }
        drop(held.next());
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert_eq!(slots.available_permits(), 1);
        super::resize_slots(&slots, 1, 3, &tracker);
        assert_eq!(slots.available_permits(), 3);
        // Free slots are taken out at once.
        super::resize_slots(&slots, 3, 2, &tracker);
        assert_eq!(slots.available_permits(), 2);
    }

    /// A reload that edits a target's policy replaces its worker: the new one goes on with the
    /// old one's counters and breaker (its window and state), under the new breaker policy,
    /// and what the old worker's attempts in flight record after the swap lands there too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replaced_worker_keeps_the_targets_counters_and_breaker() {
        use std::sync::atomic::Ordering;
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = crate::app::test_config(dir.path());
        let store =
            RedbStore::open_dir(&dir.path().join("store"), StoreOptions::default()).expect("store");
        let app = crate::app::test_app(cfg, store, None);
        let mut spec = app.rules.load().targets["hook"].clone();
        spec.policy.breaker = Some(crate::policy::config::BreakerPolicy {
            min_requests: 4,
            ..Default::default()
        });
        app.dispatcher.ensure(spec.clone()).await.expect("worker");
        let old = app.dispatcher.runtime("hook").expect("running");
        let now = app.clock.now_ms();
        old.counters.dead_lettered.fetch_add(310, Ordering::Relaxed);
        for _ in 0..2 {
            old.breaker()
                .expect("a breaker")
                .record(Some(false), false, now);
        }
        // Only the timeout edited, then the breaker's window too.
        spec.policy.timeout = std::time::Duration::from_secs(3);
        app.dispatcher.ensure(spec.clone()).await.expect("replaced");
        spec.policy.breaker = Some(crate::policy::config::BreakerPolicy {
            min_requests: 3,
            window: std::time::Duration::from_secs(60),
            ..Default::default()
        });
        app.dispatcher.ensure(spec.clone()).await.expect("replaced");
        let new = app.dispatcher.runtime("hook").expect("running");
        assert!(!Arc::ptr_eq(&old, &new), "the worker was replaced");
        let snap = new.snapshot(now);
        assert_eq!(snap["dead_lettered"], 310, "{snap}");
        assert_eq!(snap["breaker"]["window_requests"], 2, "{snap}");
        // A late failure of the old worker's attempt counts for the target, and opens it
        // under the new minimum.
        let t = old
            .breaker()
            .expect("a breaker")
            .record(Some(false), false, now);
        assert!(t.is_some(), "3 failures pass the new min_requests");
        assert_eq!(new.snapshot(now)["breaker"]["state"], "open");
    }

    /// A breaker left half-open on this node (no traffic of its own to probe with) closes when
    /// another node's breaker for the target closed after it opened, counted as a followed
    /// transition; a close from before it opened is not followed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_half_open_breaker_follows_another_nodes_close() {
        use crate::policy::breaker::BreakerState;
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = crate::app::test_config(dir.path());
        let store =
            RedbStore::open_dir(&dir.path().join("store"), StoreOptions::default()).expect("store");
        let app = crate::app::test_app(cfg, store, None);
        let mut spec = app.rules.load().targets["hook"].clone();
        spec.policy.breaker = Some(crate::policy::config::BreakerPolicy::default());
        app.dispatcher.ensure(spec).await.expect("worker");
        let rt = app.dispatcher.runtime("hook").expect("running");
        let now = app.clock.now_ms();
        rt.breaker()
            .expect("a breaker")
            .restore(BreakerState::HalfOpen, now - 10_000);
        assert!(!app.dispatcher.follow_breaker_close("hook", now - 20_000));
        assert_eq!(rt.snapshot(now)["breaker"]["state"], "half_open");
        assert!(app.dispatcher.follow_breaker_close("hook", now - 5_000));
        assert_eq!(
            rt.snapshot(app.clock.now_ms())["breaker"]["state"],
            "closed"
        );
        let text = app.metrics.render(app.store.as_ref(), now).await;
        assert!(
            text.contains("router_breaker_transitions_total{target=\"hook\",to=\"closed\"} 1"),
            "{text}"
        );
    }

    /// A pause stored in the target's own record only (before pauses had records of their
    /// own) holds when its worker starts, and is given its own record.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_older_pause_holds_and_gets_a_record_of_its_own() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = crate::app::test_config(dir.path());
        let store =
            RedbStore::open_dir(&dir.path().join("store"), StoreOptions::default()).expect("store");
        store
            .put_target_state(
                "hook",
                serde_json::json!({ "paused": true, "breaker": null }),
            )
            .await
            .expect("older pause");
        let store: std::sync::Arc<dyn Store> = store;
        let app = crate::app::test_app(cfg, store.clone(), None);
        let spec = app.rules.load().targets["hook"].clone();
        app.dispatcher.ensure(spec).await.expect("worker");
        let rt = app.dispatcher.runtime("hook").expect("running");
        assert!(rt.paused.load(std::sync::atomic::Ordering::SeqCst));
        let states = store.target_states().await.expect("states");
        let own = states
            .iter()
            .find(|(k, _)| k == "pause:hook")
            .map(|(_, v)| v.clone());
        assert_eq!(own, Some(serde_json::json!({ "paused": true })));
    }
}
