//! Assembly: loads rules and contracts, opens the store, starts delivery workers and the HTTP
//! API, and shuts everything down in order.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use axum::Router;
use axum::routing::{get, post};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::clock::{Clock, SystemClock};
use crate::config::Config;
use crate::contract::ContractSet;
use crate::deliver::{DeliveryContext, DeliveryThreads, Dispatcher};
use crate::rules::{RuleSet, TargetSpec};
use crate::store::{RedbStore, Store, StoreError, StoreOptions};
use crate::telemetry::Metrics;

/// Shared state of the running router.
pub struct App {
    /// Validated configuration.
    pub cfg: Config,
    /// The store.
    pub store: Arc<dyn Store>,
    /// Live rule set (swapped atomically on reload).
    pub rules: ArcSwap<RuleSet>,
    /// Live contracts.
    pub contracts: ArcSwap<ContractSet>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Time source.
    pub clock: Arc<dyn Clock>,
    /// Delivery workers.
    pub dispatcher: Arc<Dispatcher>,
    /// Start time.
    pub started_at: i64,
    /// False until workers run, and again once shutdown starts.
    pub ready: AtomicBool,
    /// Problems worth an operator's attention that did not stop the router (its start-up).
    pub warnings: Mutex<Vec<String>>,
    /// Those of the live rule set (a 15-attempt policy, a target that cannot start yet),
    /// replaced at each reload; `/v1/status` shows both lists.
    pub rule_warnings: Mutex<Vec<String>>,
    /// What the last reload did.
    pub reload_status: Mutex<ReloadStatus>,
    /// One reload at a time.
    reload_lock: tokio::sync::Mutex<()>,
    /// Running redrive and replay jobs.
    pub jobs: crate::dlq::Jobs,
    /// Rules disabled by an operator (persisted; override the files until enabled).
    pub disabled: ArcSwap<DisabledRules>,
    /// Configured bearer tokens (`auth.tokens`; a reload reads them again from the
    /// configuration file, [`reload_tokens`]).
    pub tokens: ArcSwap<crate::auth::Tokens>,
    /// Per-token ingest rate limiters, by token name.
    pub ingest_limiters: ArcSwap<IngestLimiters>,
    /// Set while the store is past its disk high-water mark (ingest answers 503).
    pub disk_full: AtomicBool,
    /// The request bytes and events ingest holds at once (`ingest.max_in_flight_bytes`,
    /// `ingest.max_in_flight_events`).
    pub ingest_admission: crate::ingest::admission::Admission,
    /// The client connections the HTTP server holds (`server.max_connections`).
    pub connections: Arc<ConnectionSlots>,
    /// The probes-and-scrapes address (`server.ops_listen`) and its connections, when set.
    pub ops: Option<OpsEndpoint>,
    /// Handler uploads whose body is being read or compiled at once: each may hold
    /// `handlers.max_upload_bytes` in memory. A slot is held until the compilation ends, even
    /// when the client gave up before ([`UploadSlot`]).
    pub upload_slots: Arc<tokio::sync::Semaphore>,
    /// The WASM handler runtime.
    pub handlers: Option<Arc<crate::target::handler::HandlerRuntime>>,
    /// Why the WASM handler runtime did not start (`handlers` is `None`): `/readyz` and
    /// `/v1/status` say so. A start whose rules have handler targets stops instead.
    pub handlers_error: Option<String>,
    /// Contracts put over the API, shared with the other nodes (on a store they share).
    pub shared_contracts: Option<Arc<crate::admin::contracts::SharedContracts>>,
    /// The delivery runtime's threads and priority, as started.
    pub delivery_threads: crate::deliver::DeliveryThreadsStatus,
}

/// Store key prefix of persisted rule overrides (kept beside target states).
pub const RULE_STATE_PREFIX: &str = "rule:";

impl App {
    /// Held by reloads, the retirer of drained removed targets, and each redrive or replay
    /// step: what a step routes to stays served until its commit.
    pub(crate) async fn routing_guard(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.reload_lock.lock().await
    }

    /// Rules currently disabled by an operator.
    pub fn disabled_rules(&self) -> Arc<DisabledRules> {
        self.disabled.load_full()
    }

    /// Whether `id` is neither in the live rules nor run by a worker here: a target removed
    /// from the rules whose worker was stopped once its queue drained (or never ran). With
    /// nothing queued or in flight for it, `/metrics` and `/v1/targets` leave it out (the
    /// store goes on listing it); its dead letters stay in `/v1/dlq` and `router_dlq_depth`.
    pub fn retired(&self, id: &str) -> bool {
        !self.rules.load().targets.contains_key(id) && self.dispatcher.runtime(id).is_none()
    }

    /// Disables or enables a rule (persisted, with when and by whom: `by` is the token's
    /// name, `None` with auth off). Returns false for a rule not in the live set, except when
    /// enabling clears an operator's switch left on a name no live rule has (the rule renamed
    /// or removed since): that one is cleared.
    pub async fn set_rule_enabled(
        &self,
        name: &str,
        enabled: bool,
        by: Option<String>,
    ) -> Result<bool, StoreError> {
        let stale_switch = enabled && self.disabled.load().contains(name);
        if !stale_switch && !self.rules.load().rules.iter().any(|r| r.name == name) {
            return Ok(false);
        }
        let switch = RuleSwitch {
            disabled: !enabled,
            disabled_at: (!enabled).then(|| crate::clock::rfc3339(self.clock.now_ms())),
            disabled_by: if enabled { None } else { by },
        };
        self.store
            .put_target_state(
                &format!("{RULE_STATE_PREFIX}{name}"),
                serde_json::to_value(&switch).unwrap_or_default(),
            )
            .await?;
        self.dispatcher.operator_change(|| {
            let mut set = (*self.disabled.load_full()).clone();
            if enabled {
                set.0.remove(name);
            } else {
                set.0.insert(name.to_string(), switch);
            }
            self.disabled.store(Arc::new(set));
        });
        tracing::warn!(rule = %name, enabled, "rule state changed by an operator");
        Ok(true)
    }
}

/// An operator's rule switch as stored (`rule:<name>` among the target states, on both
/// backends): a containment left on was a boolean, with neither when nor who.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RuleSwitch {
    /// Whether the operator disabled the rule.
    pub disabled: bool,
    /// When it was disabled (RFC 3339); `None` for a switch stored before this was kept.
    #[serde(default)]
    pub disabled_at: Option<String>,
    /// The token that disabled it; `None` with auth off or in a switch stored before.
    #[serde(default)]
    pub disabled_by: Option<String>,
}

/// The rules an operator disabled, each with its switch (when, by whom), as this node knows
/// them: read from the store at start, changed by the API, and followed from the store on a
/// store several nodes share. Kept in memory so that routing and `GET /v1/rules` read no
/// store.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DisabledRules(std::collections::HashMap<String, RuleSwitch>);

impl DisabledRules {
    /// The switches of the stored target states (`rule:<name>` records that say disabled).
    pub fn from_states(states: &[(String, serde_json::Value)]) -> Self {
        Self(
            states
                .iter()
                .filter_map(|(k, v)| {
                    let name = k.strip_prefix(RULE_STATE_PREFIX)?;
                    let switch = serde_json::from_value::<RuleSwitch>(v.clone()).ok()?;
                    switch.disabled.then(|| (name.to_string(), switch))
                })
                .collect(),
        )
    }

    /// Whether an operator disabled the rule.
    pub fn contains(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    /// Whether no rule is disabled.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The switch that disabled the rule, if one did.
    pub fn get(&self, name: &str) -> Option<&RuleSwitch> {
        self.0.get(name)
    }

    /// The names of the disabled rules (in no order).
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.0.keys()
    }
}

/// The state of rules and contracts as loaded, for `/v1/status`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ReloadStatus {
    /// Content hash of the live rule files.
    pub rules_version: String,
    /// Git commit of the rules directory, when it is a checkout.
    pub rules_git_commit: Option<String>,
    /// Content hash of the live contracts.
    pub contracts_version: String,
    /// When the live set was loaded (RFC 3339).
    pub loaded_at: String,
    /// When the last reload was attempted, and why.
    pub last_attempt_at: String,
    /// What triggered the last attempt.
    pub last_trigger: String,
    /// Error of the last attempt, if it was refused (the previous set stays live).
    pub last_error: Option<String>,
    /// Successful reloads since start.
    pub reloads: u64,
    /// Refused reloads since start.
    pub failed_reloads: u64,
    /// When `rules_git_commit` was last read from the checkout (`/v1/status` reads it again
    /// at most every few seconds).
    #[serde(skip)]
    pub git_checked_at: Option<std::time::Instant>,
}

/// Why a reload was refused: the previous rules and contracts stay live.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The new rules or contracts do not load: one problem per entry (a file's
    /// `path:line:col: message`, or a sentence about the directory).
    #[error("{}", .0.join("\n"))]
    Invalid(Vec<String>),
    /// The new rules do not load (or cannot go live), one problem per entry; the contracts
    /// loaded, and went live if they changed.
    #[error("{}", .0.join("\n"))]
    RulesRefused(Vec<String>),
    /// The new contracts do not load (or their directory is gone or emptied), one problem per
    /// entry; the previous contracts stay live. The rules loaded, and went live if they
    /// changed: a broken contract file does not hold back a rule fix.
    #[error("{}", .0.join("\n"))]
    ContractsRefused(Vec<String>),
    /// Saving target configurations failed: the store, not the files, is at fault.
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

/// What a successful reload changed.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReloadReport {
    /// New rules version.
    pub rules_version: String,
    /// New contracts version.
    pub contracts_version: String,
    /// Targets added or whose configuration changed.
    pub targets_started: Vec<String>,
    /// Targets no longer in the rules (draining or dead-lettered).
    pub targets_removed: Vec<String>,
    /// Warnings of the new rule set.
    pub warnings: Vec<String>,
}

/// The error of a removed target's entries moved to the DLQ.
const TARGET_REMOVED: &str = "the target was removed from the rules";

/// Moves the queued entries of `id`, a target no longer in the rules, to the DLQ as
/// `target_removed` with the error `why`. Entries in flight at this moment come back to the
/// queue when their attempt ends (or their lease expires): they are moved too, for `grace`
/// (one lease and a little more), unless a reload brings the target back first — then its
/// queue is live again and what is left of it delivers (a quick revert, or a rule moved
/// between two files in two saves, used to dead-letter new events of a live target).
async fn dead_letter_removed(app: &Arc<App>, id: &str, why: String, grace: Duration) -> usize {
    let ctx = app.dispatcher.context().clone();
    let moved = match move_queue_to_dlq(&ctx, id, crate::store::DlqReason::TargetRemoved, &why)
        .await
    {
        Ok(n) => {
            tracing::warn!(target_id = %id, entries = n, reason = %why, "target not in the rules; its queued entries moved to the DLQ");
            n
        }
        // The new set is live already: a store failure here is not a refused reload
        // (callers take a refusal to mean nothing changed). The loop below keeps moving them.
        Err(e) => {
            tracing::warn!(target_id = %id, error = %e, "target not in the rules; moving its queued entries to the DLQ failed, tried again");
            0
        }
    };
    let app = Arc::downgrade(app);
    let id = id.to_owned();
    let back = move |id: &str| {
        app.upgrade()
            .is_none_or(|app| app.rules.load().targets.contains_key(id))
    };
    ctx.tracker.clone().spawn(async move {
        let deadline = tokio::time::Instant::now() + grace;
        loop {
            if back(&id) {
                tracing::info!(target_id = %id, "target back in the rules; its queue is no longer moved to the DLQ");
                break;
            }
            let left = ctx
                .store
                .queue_stats()
                .get(&id)
                .map_or(0, |s| s.live());
            if left == 0 || tokio::time::Instant::now() >= deadline {
                if left > 0 {
                    tracing::warn!(target_id = %id, left, "removed target still has entries after its grace period; they drain under its last configuration");
                }
                break;
            }
            tokio::select! {
                _ = ctx.cancel.cancelled() => break,
                _ = tokio::time::sleep(Duration::from_millis(250)) => {}
            }
            if back(&id) {
                continue;
            }
            if let Err(e) = move_queue_to_dlq(&ctx, &id, crate::store::DlqReason::TargetRemoved, &why).await {
                tracing::warn!(target_id = %id, error = %e, "moving a removed target's entries to the DLQ failed");
            }
        }
    });
    moved
}

/// The reload answer's word on `n` entries of removed target `id` sent to the DLQ
/// (`on_target_removed = "dead_letter"`): without it a rule rename emptied a queue into the
/// DLQ with `warnings: []`. When the target's destination is live under exactly one id (the
/// rule renamed, the receiver kept), a redrive of `id`'s dead letters delivers them there.
fn dead_lettered_removed_warning(
    rules: &RuleSet,
    id: &str,
    n: usize,
    last: Option<&TargetSpec>,
) -> String {
    let head = format!(
        "target {id} is no longer in the rules and delivery.on_target_removed = \"dead_letter\": its {n} queued entries went to the DLQ as target_removed"
    );
    let Some(dest) = last.map(|t| t.kind.destination()) else {
        return head;
    };
    match targets_sending_to(rules, &dest)[..] {
        [live] => format!(
            "{head}. Its destination {dest} is live as target {live} (a renamed rule?): redrive them (router dlq redrive --target {id}, or POST /v1/dlq/redrive with {{\"filter\": {{\"target\": \"{id}\"}}}}) and they are delivered there"
        ),
        [] => format!(
            "{head}. No target sends to its destination {dest} now: put the target back and redrive them, or purge them"
        ),
        ref several => format!(
            "{head}. Its destination {dest} is live as several targets ({}): a redrive cannot tell which should take them; replay the events restricted to one (POST /v1/replay with \"targets\"), or give that target `id: {id}` and redrive",
            several.join(", ")
        ),
    }
}

/// The targets of `rules` that send to `destination` (`TargetKind::destination`): where a
/// removed target's queue and dead letters belong when its id changed but its receiver did
/// not (a rule renamed).
pub fn targets_sending_to<'a>(rules: &'a RuleSet, destination: &str) -> Vec<&'a str> {
    rules
        .targets
        .values()
        .filter(|t| t.kind.destination() == destination)
        .map(|t| t.id.as_str())
        .collect()
}

/// What a handler's release does to its queued deliveries ([`crate::wasm::ReleasedQueues`]):
/// every target that runs the handler (in the rules now, or draining under an earlier rule
/// set's configuration) has its waiting entries moved to the DLQ as `handler_released`,
/// counted and announced like a removed target's. (Weak: the dispatcher's context holds the
/// handler runtime, which holds this.)
struct ReleasedHandlerQueues {
    dispatcher: std::sync::Weak<Dispatcher>,
}

/// The error of a delivery dead-lettered because its handler's name was released.
fn handler_released_error(name: &str) -> String {
    format!(
        "handler {name:?} was released, so its queued deliveries never run on the code of whichever team claims the name next; redrive them to deliver them to the handler of that name now"
    )
}

impl crate::wasm::ReleasedQueues for ReleasedHandlerQueues {
    fn dead_letter(
        &self,
        name: &str,
        wait: Duration,
    ) -> futures::future::BoxFuture<'_, Result<u64, String>> {
        use futures::FutureExt as _;
        let name = name.to_owned();
        async move {
            let Some(dispatcher) = self.dispatcher.upgrade() else {
                return Err("the router is shutting down".to_owned());
            };
            let ctx = dispatcher.context().clone();
            let runs_it = |spec: &TargetSpec| {
                matches!(&spec.kind, crate::rules::TargetKind::Handler { name: n } if *n == name)
            };
            let mut ids: std::collections::BTreeSet<String> = dispatcher
                .running()
                .into_iter()
                .filter(|s| runs_it(s))
                .map(|s| s.id)
                .collect();
            // Every configuration the store remembers: a target removed from the rules
            // whose worker is not running here (another node's, or not restarted) still
            // has a queue.
            for (id, spec) in ctx.store.saved_targets().await.map_err(|e| e.to_string())? {
                if serde_json::from_value::<TargetSpec>(spec).is_ok_and(|s| runs_it(&s)) {
                    ids.insert(id);
                }
            }
            let why = handler_released_error(&name);
            let reason = crate::store::DlqReason::HandlerReleased;
            let deadline = tokio::time::Instant::now() + wait;
            let sweep = || async {
                let mut moved = 0u64;
                for id in &ids {
                    moved += move_queue_to_dlq(&ctx, id, reason, &why)
                        .await
                        .map_err(|e| e.to_string())? as u64;
                }
                Ok::<u64, String>(moved)
            };
            let leased = || {
                let stats = ctx.store.queue_stats();
                ids.iter()
                    .filter_map(|id| stats.get(id))
                    .map(|s| s.in_flight)
                    .sum::<u64>()
            };
            let mut moved = sweep().await?;
            // A delivery leased during a sweep is not moved by it: its worker, finding the
            // handler deleted, puts it back (not due again for seconds), and a later sweep
            // moves it. Once nothing is leased, one more sweep takes those put back since
            // the last one. Entries routed to the name meanwhile are for whoever claims it
            // next, as after the release.
            loop {
                if leased() == 0 {
                    return Ok(moved + sweep().await?);
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(format!(
                        "{} of its deliveries were still leased by a worker after {wait:?}",
                        leased()
                    ));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                moved += sweep().await?;
            }
        }
        .boxed()
    }
}

/// Moves what is queued for `id` to the DLQ as `reason` with the error `why`, counted and
/// announced (`router.dlq.added`): a target no longer in the rules (`target_removed`), or one
/// that runs a released handler (`handler_released`).
async fn move_queue_to_dlq(
    ctx: &crate::deliver::DeliveryContext,
    id: &str,
    reason: crate::store::DlqReason,
    why: &str,
) -> Result<usize, StoreError> {
    let n = ctx
        .store
        .dead_letter_queued(id, reason, why, ctx.clock.now_ms())
        .await?;
    crate::deliver::dead_lettered_in_bulk(ctx, id, reason, n as u64, why, ctx.clock.now_ms());
    Ok(n)
}

/// The configuration each target id last had as far as this router knows: the store's saved
/// configurations (every target a rule set had, removed ones included: a removed target's
/// queue drains, and its dead letters are redriven, under it), with the live set's over them.
/// A saved configuration this build cannot read is left out.
fn known_targets(
    live: &RuleSet,
    saved: Vec<(String, serde_json::Value)>,
) -> std::collections::BTreeMap<String, TargetSpec> {
    let mut known: std::collections::BTreeMap<String, TargetSpec> = saved
        .into_iter()
        .filter_map(|(id, v)| serde_json::from_value(v).ok().map(|s| (id, s)))
        .collect();
    known.extend(live.targets.iter().map(|(id, t)| (id.clone(), t.clone())));
    known
}

/// Targets whose id now names another destination while entries wait for the old one, in a
/// way that sends them to another target's receiver: a target without an explicit `id` is
/// `<rule>-<index>`, so removing, inserting or reordering one of a rule's targets (or
/// renaming a rule and giving its old name to a new one) moves the ids, and a queue would be
/// delivered to a receiver it was never meant for (an event of `/a` posted to `/b`). Two
/// shapes of the move are caught:
/// - the id now names a destination another id had (target `r-0` now sends to what `r-1`
///   did: a target removed before it);
/// - the id's old destination is still in the new set, under another id that did not send
///   there before (a target inserted before it: `r-0` now sends to the new `/audit` while
///   `/erp`, its receiver, is now `r-1`'s). Only a new destination was looked at before, so
///   this passed as an in-place edit and the waiting entries went to `/audit`.
///
/// Such a set is refused, naming the targets; a destination edited in place (its old one no
/// longer in the set, the new one no other target's) is not a move, and its queue goes to the
/// new destination, as an edited URL should. Nor is a target whose old destination another
/// target of the set already shared. Dead letters count as entries here: an id that moved
/// with only dead letters was let through, and redriving them then delivered them to the
/// neighbour.
///
/// `known` is what the store knows ([`known_targets`]), not only the live set: compared
/// with the live set alone, the move went through in two reloads (the file removed, then put
/// back with a target fewer), and at a start (no live set) it was never checked at all.
fn moved_ids(
    known: &std::collections::BTreeMap<String, TargetSpec>,
    new: &RuleSet,
    store: &dyn Store,
) -> Option<String> {
    let stats = store.queue_stats();
    let mut by_dest: std::collections::HashMap<String, Vec<&str>> =
        std::collections::HashMap::new();
    for t in known.values() {
        by_dest
            .entry(t.kind.destination())
            .or_default()
            .push(t.id.as_str());
    }
    let mut suggested = Vec::new();
    let moved: Vec<String> = new
        .targets
        .values()
        .filter_map(|t| {
            let before = known.get(&t.id)?;
            let (was, now) = (before.kind.destination(), t.kind.destination());
            if was == now {
                return None;
            }
            // Another id whose destination this one takes over.
            let from = by_dest
                .get(&now)
                .and_then(|ids| ids.iter().find(|id| **id != t.id))
                .copied();
            // Another target of the new set that now has this one's old destination and did
            // not before: the receiver's queue should have gone with it.
            let kept_by = new
                .targets
                .values()
                .find(|o| {
                    o.id != t.id
                        && o.kind.destination() == was
                        && known.get(&o.id).is_none_or(|k| k.kind.destination() != was)
                })
                .map(|o| o.id.as_str());
            if from.is_none() && kept_by.is_none() {
                return None;
            }
            let s = stats.get(&t.id);
            let live = s.map_or(0, |s| s.live());
            // Dead letters move with the id too: a redrive would deliver them to `now`.
            let dead = s.map_or(0, |s| s.dlq);
            if live + dead == 0 {
                return None;
            }
            let mut held = Vec::new();
            if live > 0 {
                held.push(format!("{live} entries wait for {was}"));
            }
            if dead > 0 {
                held.push(format!(
                    "{dead} dead letters of {was} would be redriven there"
                ));
            }
            let at = new
                .rules
                .iter()
                .find(|r| r.name == t.rule)
                .map(|r| format!(" ({}:{}, rule {})", r.file, r.line, r.name))
                .unwrap_or_default();
            let whose = match (from, kept_by) {
                (Some(from), Some(kept)) => {
                    format!(" (target {from}'s before), and its own {was} is now target {kept}'s,")
                }
                (Some(from), None) => format!(" (target {from}'s before)"),
                (None, Some(kept)) => format!(", and its own {was} is now target {kept}'s,"),
                (None, None) => String::new(),
            };
            if let Some(kept) = kept_by {
                suggested.push(format!(
                    "`id: {}` on the target now numbered {kept} keeps that queue with its receiver",
                    t.id
                ));
            }
            Some(format!(
                "target {}{at} now names {now}{whose} while {}",
                t.id,
                held.join(" and ")
            ))
        })
        .collect();
    (!moved.is_empty()).then(|| {
        let hint = if suggested.is_empty() {
            String::new()
        } else {
            format!(" ({})", suggested.join("; "))
        };
        format!(
            "{}: targets without an explicit `id` are numbered by position in their rule, and removing, inserting or reordering one (or giving a renamed rule's name to another rule) moved them; give the rule's targets explicit ids{hint} (keeping a target's current id keeps its queue and its dead letters), or let the queues drain and redrive or purge the dead letters first",
            moved.join("; ")
        )
    })
}

/// At most this many keys are named in one target's notice of keys released
/// ([`release_keys_no_longer_held`]); the log line and `held_keys` before it have them all.
const RELEASED_KEYS_NAMED: usize = 10;

/// Releases the ordering keys still held on targets whose live policy holds none: `ordering`
/// removed (its entries are delivered unordered, `Store::set_ordered`), or `on_dead_letter`
/// changed from `hold` to `proceed`. Left held, they kept the key's entries waiting for an
/// operator's release, without bound, behind a policy that says nothing waits. Each release
/// is the store's, as `POST /v1/targets/{id}/keys/{key}/release` makes it (durable; a key
/// another node released first is skipped), and is logged. Called after a start or a reload
/// has started the targets' workers; returns one notice per target, for the reload's answer
/// and the warnings of `/v1/status`. Targets no longer in the rules are left alone: they
/// drain under their last configuration.
pub(crate) async fn release_keys_no_longer_held<'a>(
    store: &dyn Store,
    targets: impl IntoIterator<Item = &'a TargetSpec>,
) -> Vec<String> {
    let mut notices = Vec::new();
    for spec in targets {
        if spec.policy.holds_keys() {
            continue;
        }
        let held = store.held_keys(&spec.id);
        if held.is_empty() {
            continue;
        }
        let why = if spec.policy.ordering.is_none() {
            "its policy no longer has `ordering`: its entries are delivered unordered"
        } else {
            "its policy's on_dead_letter is no longer `hold`: a dead letter no longer holds its key"
        };
        let (mut released, mut failed) = (Vec::new(), Vec::new());
        for key in held {
            match store.release_key(&spec.id, &key).await {
                Ok(true) => released.push(key),
                // Released meanwhile (by an operator, or by another node's start or reload).
                Ok(false) => {}
                Err(e) => failed.push((key, e)),
            }
        }
        let named = |keys: &[String]| {
            let mut s = keys
                .iter()
                .take(RELEASED_KEYS_NAMED)
                .map(|k| format!("{k:?}"))
                .collect::<Vec<_>>()
                .join(", ");
            if keys.len() > RELEASED_KEYS_NAMED {
                s.push_str(&format!(" and {} more", keys.len() - RELEASED_KEYS_NAMED));
            }
            s
        };
        if !released.is_empty() {
            tracing::warn!(target_id = %spec.id, keys = ?released, "ordering keys held after a dead letter released: {why}");
            notices.push(format!(
                "ordering keys of target {} held after a dead letter were released ({}): {why}; their dead letters stay in the DLQ",
                spec.id,
                named(&released)
            ));
        }
        if let Some((_, e)) = failed.first() {
            let keys: Vec<String> = failed.iter().map(|(k, _)| k.clone()).collect();
            tracing::error!(target_id = %spec.id, keys = ?keys, error = %e, "ordering keys held after a dead letter could not be released: {why}");
            notices.push(format!(
                "ordering keys of target {} held after a dead letter could not be released ({}): {e}. {why}, but until they are released their entries may wait: reload again, or release each (POST /v1/targets/{}/keys/{{key}}/release)",
                spec.id,
                named(&keys),
                crate::cli::seg(&spec.id)
            ));
        }
    }
    notices
}

/// Keeps an operator's pause when a reload changes the paused target's id (its rule
/// renamed, an explicit `id` edited): a target this reload adds whose destination is that of
/// a paused target it removes starts paused (persisted as an operator's pause, so a restart
/// and other nodes keep it), saying so in `warnings`. Without it the new id started unpaused
/// and new events went at once to the receiver the operator had paused, ahead of the old
/// id's entries still waiting behind the pause. Written before the workers start, which
/// read it as their saved state.
async fn pause_renamed(
    app: &App,
    old: &RuleSet,
    new: &RuleSet,
    prepared: &[crate::deliver::PreparedTarget],
    warnings: &mut Vec<String>,
) {
    let paused_removed: std::collections::HashMap<String, &str> = old
        .targets
        .values()
        .filter(|t| !new.targets.contains_key(&t.id))
        .filter(|t| {
            app.dispatcher
                .runtime(&t.id)
                .is_some_and(|rt| rt.paused.load(Ordering::SeqCst))
        })
        .map(|t| (t.kind.destination(), t.id.as_str()))
        .collect();
    if paused_removed.is_empty() {
        return;
    }
    for p in prepared {
        let id = p.id();
        if old.targets.contains_key(id) {
            continue;
        }
        let Some(dest) = new.targets.get(id).map(|t| t.kind.destination()) else {
            continue;
        };
        let Some(from) = paused_removed.get(&dest) else {
            continue;
        };
        let record = serde_json::json!({ "paused": true });
        let key = format!("{}{id}", crate::deliver::PAUSE_STATE_PREFIX);
        let w = match app.store.put_target_state(&key, record).await {
            Ok(()) => format!(
                "target {id} starts paused: it sends to {dest}, the destination of paused target {from}, which this reload removes (a rule renamed or an id edited); the pause follows the receiver. Resume both when the receiver may get events again (POST /v1/targets/{id}/resume, and /v1/targets/{from}/resume for {from}'s waiting entries)"
            ),
            Err(e) => format!(
                "target {id} sends to {dest}, the destination of paused target {from}, which this reload removes, but its pause could not be stored ({e}): it is NOT paused; pause it now (POST /v1/targets/{id}/pause)"
            ),
        };
        warnings.push(w);
    }
}

/// Whether `id` has entries queued or in flight.
fn has_live_entries(app: &App, id: &str) -> bool {
    app.store
        .queue_stats()
        .get(id)
        .is_some_and(|s| s.live() > 0)
}

/// One warning per target no longer in the live rules that still has entries, from the live
/// state (for `/v1/status`): it appears when a reload (or a start) removes such a target and
/// goes once its queue is empty. A start-up list missed the targets a reload removed, and
/// kept those long drained.
pub fn removed_target_warnings(app: &App) -> Vec<String> {
    let rules = app.rules.load();
    app.store
        .queue_stats()
        .into_iter()
        .filter(|(id, s)| s.live() > 0 && !rules.targets.contains_key(id))
        .map(|(id, s)| {
            let n = s.live();
            let runtime = app.dispatcher.runtime(&id);
            // Its last configuration delivers to a handler that does not run here (a
            // compilation under way aside): nothing drains, the entries wait out their max_age
            // and then go to the DLQ, while "drain" had the operator wait for it.
            let stuck = runtime
                .as_ref()
                .and_then(|rt| handler_not_loaded(app, &rt.spec.kind))
                .filter(|why| !matches!(why, crate::wasm::NotLoaded::Loading { .. }));
            match runtime {
                // Paused, nothing drains: saying "drain" had the operator wait for it.
                Some(rt) if rt.paused.load(Ordering::SeqCst) => format!(
                    "target {id} is no longer in the rules and is paused: its {n} queued entries wait until it is resumed (POST /v1/targets/{id}/resume), then drain under its last configuration"
                ),
                Some(_) if let Some(why) = &stuck => format!(
                    "target {id} is no longer in the rules and its {n} queued entries cannot drain under its last configuration ({why}): they wait up to their max_age, then go to the DLQ. Restore the target or upload its handler to deliver them, or set delivery.on_target_removed = \"dead_letter\" and restart to dead-letter them now"
                ),
                // A held key's entries wait for a release, whatever the removal: "drain"
                // alone had the operator wait for them (the day-2 audit).
                Some(_) if let held = app.store.held_keys(&id)
                    && !held.is_empty() =>
                {
                    format!(
                        "target {id} is no longer in the rules; its {n} queued entries drain under its last configuration, except the {} behind its held ordering key(s) {}: they wait for `router targets release-key {id} <key>` (or a redrive of the key's dead letter)",
                        s.queued_behind_keys,
                        held.iter()
                            .take(5)
                            .map(|k| format!("{k:?}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                }
                Some(_) => format!(
                    "target {id} is no longer in the rules; its {n} queued entries drain under its last configuration"
                ),
                None => format!(
                    "target {id} is no longer in the rules and no worker runs for it; its {n} entries go to the DLQ as target_removed"
                ),
            }
        })
        .collect()
}

/// Why the handler a target of `kind` delivers to cannot run here now (not uploaded or
/// deleted, being compiled, failed to load); `None` for a loaded handler, another kind of
/// target, or no WASM runtime (then no handler target runs at all, which its worker says).
pub fn handler_not_loaded(
    app: &App,
    kind: &crate::rules::TargetKind,
) -> Option<crate::wasm::NotLoaded> {
    let crate::rules::TargetKind::Handler { name } = kind else {
        return None;
    };
    app.handlers.as_ref()?.registry.lookup(name).err()
}

/// How often the workers of removed targets are looked at, to stop those drained.
const RETIRE_INTERVAL: Duration = Duration::from_secs(1);

/// The running workers of targets no longer in the live rules with nothing queued or in
/// flight.
fn drained_removed(app: &App) -> std::collections::BTreeSet<String> {
    let rules = app.rules.load();
    let stats = app.store.queue_stats();
    app.dispatcher
        .running()
        .into_iter()
        .map(|s| s.id)
        .filter(|id| !rules.targets.contains_key(id) && stats.get(id).is_none_or(|s| s.live() == 0))
        .collect()
}

/// Stops the worker of a target removed from the rules once its queue has drained: before,
/// it ran until a restart, and with it its `/v1/targets` row and its paused, breaker and
/// queue series (an open-breaker alert for a target long gone never cleared; a file of 1000
/// targets added and removed left 1000 idle workers). A target must be seen drained at two
/// looks in a row: an entry a redrive put back into its queue meanwhile (it checks that the
/// worker runs, then commits) shows at the second look. Under the reload lock, so a reload
/// bringing the target back does not race the stop; a reload in progress skips the turn.
fn spawn_retirer(app: &Arc<App>, tracker: &TaskTracker, cancel: CancellationToken) {
    let app = app.clone();
    tracker.spawn(async move {
        let mut seen = std::collections::BTreeSet::new();
        loop {
            tokio::select! {
                () = cancel.cancelled() => break,
                () = tokio::time::sleep(RETIRE_INTERVAL) => {}
            }
            let Ok(_one) = app.reload_lock.try_lock() else {
                continue;
            };
            let drained = drained_removed(&app);
            for id in drained.intersection(&seen) {
                if app.dispatcher.stop(id) {
                    app.metrics.forget_target(id);
                    tracing::info!(target_id = %id, "target removed from the rules has drained; its worker stopped, it is no longer listed and its metrics series are removed");
                }
            }
            seen = drained.difference(&seen).cloned().collect();
        }
    });
}

/// How long a removed target's entries in flight may take to come back to its queue: one
/// attempt's timeout, the lease margin, and a little more.
fn removal_grace(cfg: &Config, spec: Option<&TargetSpec>) -> Duration {
    spec.map_or(Duration::from_secs(60), |s| s.policy.timeout)
        + cfg.delivery.lease_margin
        + Duration::from_secs(5)
}

/// Per-token ingest rate limiters, by token name.
pub type IngestLimiters = std::collections::HashMap<String, Arc<crate::deliver::Limiter>>;

/// The ingest limiters of `tokens` (those with a `rate_per_sec`). A token whose rate is the
/// same in `before` (its tokens and limiters) keeps its limiter, and with it what it spent.
fn ingest_limiters(
    tokens: &[crate::auth::TokenConfig],
    before: Option<(&crate::auth::Tokens, &IngestLimiters)>,
) -> IngestLimiters {
    tokens
        .iter()
        .filter_map(|t| {
            let rate = t.rate_per_sec?;
            if let Some((old_tokens, old)) = before
                && old_tokens.config(&t.name).map(|c| c.rate_per_sec) == Some(t.rate_per_sec)
                && let Some(limiter) = old.get(&t.name)
            {
                return Some((t.name.clone(), limiter.clone()));
            }
            let period = std::time::Duration::from_secs_f64(1.0 / rate.max(1e-6));
            let burst = std::num::NonZeroU32::new((rate.ceil() as u32).max(1))?;
            let q = governor::Quota::with_period(period)?.allow_burst(burst);
            Some((t.name.clone(), Arc::new(governor::RateLimiter::direct(q))))
        })
        .collect()
}

/// A reload's look at the configuration file (`router serve`'s, read again as at the start:
/// the file, the environment, the flags). `auth.tokens` is applied: a token revoked or
/// rotated in the file (a leaked one) stops working at the reload, not at the next restart,
/// which it silently waited for. Every other key is read at the start only: one changed
/// since is listed in the returned warnings, with the next restart as when it applies. Auth
/// cannot be turned on or off here (the start chooses how the listener guards requests).
fn reload_tokens(app: &App) -> Vec<String> {
    let Some(origin) = &app.cfg.origin else {
        return Vec::new();
    };
    let mut warnings = Vec::new();
    let new = match origin.load() {
        Ok((new, _)) => new,
        Err(e) => {
            let w = format!(
                "the configuration file was not read again ({e}): auth.tokens are as before, the rules and contracts reload"
            );
            tracing::warn!("{w}");
            return vec![w];
        }
    };
    let live = app.tokens.load_full();
    if new.auth.tokens != live.configs() {
        let auth_on = !new.auth.tokens.is_empty();
        if auth_on != live.enabled() {
            warnings.push(format!(
                "auth.tokens: a reload cannot turn auth {} (the start decides how requests are guarded): restart to apply; the tokens are as before",
                if live.enabled() { "off" } else { "on" }
            ));
        } else {
            match crate::auth::Tokens::new(&new.auth.tokens) {
                Ok(tokens) => {
                    let names = |t: &crate::auth::Tokens| -> std::collections::BTreeSet<String> {
                        t.configs().into_iter().map(|c| c.name).collect()
                    };
                    let (was, now) = (names(&live), names(&tokens));
                    let limiters = ingest_limiters(
                        &new.auth.tokens,
                        Some((&live, &app.ingest_limiters.load())),
                    );
                    app.ingest_limiters.store(Arc::new(limiters));
                    app.tokens.store(Arc::new(tokens));
                    tracing::warn!(
                        added = ?now.difference(&was).collect::<Vec<_>>(),
                        removed = ?was.difference(&now).collect::<Vec<_>>(),
                        "auth.tokens reloaded from the configuration file: a removed token is refused from now on"
                    );
                }
                Err(e) => warnings.push(format!(
                    "auth.tokens not applied ({e}): the tokens are as before"
                )),
            }
        }
    }
    let mut start = app.cfg.clone();
    start.auth.tokens.clone_from(&new.auth.tokens);
    let later = crate::config::changed_keys(&start, &new);
    if !later.is_empty() {
        warnings.push(format!(
            "the configuration file changed since the start: {} apply at the next restart (a reload applies auth.tokens only)",
            later.join(", ")
        ));
    }
    for w in &warnings {
        tracing::warn!("{w}");
    }
    warnings
}

/// Loads the rules and contracts directories again and swaps them in atomically. An invalid
/// set is refused and the old one stays live. Compilation happens off the request path.
pub async fn reload(app: &Arc<App>, trigger: &str) -> Result<ReloadReport, ReloadError> {
    let _one = app.reload_lock.lock().await;
    let now = app.clock.now_ms();
    // Before the rules: a revoked token must not wait for a rule file to be fixed.
    let config_warnings = {
        let app = app.clone();
        tokio::task::spawn_blocking(move || reload_tokens(&app))
            .await
            .unwrap_or_else(|e| vec![format!("the configuration file was not read again: {e}")])
    };
    let cfg = app.cfg.clone();
    let loaded = tokio::task::spawn_blocking(move || {
        let rules = load_rules(&cfg);
        let contracts = load_contracts(&cfg);
        let git = crate::rules::watch::git_commit(&cfg.rules_dir);
        (rules, contracts, git)
    })
    .await
    .map_err(|e| ReloadError::Invalid(vec![format!("reload task failed: {e}")]))?;
    let old = app.rules.load_full();
    let (rules_loaded, contracts_loaded, git) = loaded;
    // What the store knows of every target id (removed ones too), for the moved-id check.
    let known = app
        .store
        .saved_targets()
        .await
        .map(|saved| known_targets(&old, saved));
    // The contracts side. Refused alone, it does not hold back a rules change (the docs say
    // the two reload apart, and an urgent rule fix must not wait for someone else's broken
    // contract): the previous contracts stay live beside the new rules. That is safe because
    // nothing in a rule set reads the contracts: a rule matches the event as accepted, and
    // the contracts decide only whether an event is accepted, before any rule sees it. A rule
    // written for data a new contract would guarantee sees, meanwhile, what the live contract
    // lets through: the same as when the rule and the contract change in separate reloads.
    let contracts_side: Result<ContractSet, Vec<String>> = match contracts_loaded {
        Err(e) => Err(e.problems()),
        // Not "no contracts": an empty set would let every event through unchecked.
        Ok(_) if !app.cfg.contracts_dir.exists() && !app.contracts.load().is_empty() => {
            Err(vec![format!(
                "contracts directory {} does not exist (moved, deleted or unmounted?); the previous contracts stay live",
                app.cfg.contracts_dir.display()
            )])
        }
        // Nor is a directory emptied of contracts (a checkout or sync caught half-way): an
        // enforced type would go from 422 to accepted unchecked. Removing every contract
        // is rare enough to take a restart.
        Ok(c) if c.is_empty() && !app.contracts.load().is_empty() => Err(vec![format!(
            "contracts directory {} holds no contract (emptied, or a sync caught half-way?); the previous contracts stay live. To remove every contract on purpose, restart the router on the empty directory",
            app.cfg.contracts_dir.display()
        )]),
        Ok(c) => Ok(c),
    };
    // The rules side. Refused alone, it does not hold back a contracts change: a broken rule
    // file used to block every contract upload and fix until it was repaired.
    let rules_side: Result<_, Vec<String>> = match rules_loaded {
        Err(e) => Err(e.problems()),
        // A rules directory that was there and is gone (moved away by a deploy, a volume
        // unmounted) is not "no rules": going live with an empty set would strand or
        // dead-letter every target's queue.
        Ok(_) if !app.cfg.rules_dir.exists() && !old.rules.is_empty() => Err(vec![format!(
            "rules directory {} does not exist (moved, deleted or unmounted?); the previous rules stay live",
            app.cfg.rules_dir.display()
        )]),
        // Nor is a directory emptied of rule files (a checkout or sync caught half-way): to
        // remove every rule on purpose, a file says so (`rules: []`).
        Ok(r) if r.0.files.is_empty() && !old.rules.is_empty() => Err(vec![format!(
            "rules directory {} holds no rule file (emptied, or a sync caught half-way?); the previous rules stay live. To remove every rule, leave a file that says `rules: []`",
            app.cfg.rules_dir.display()
        )]),
        Ok(_) if let Err(e) = &known => Err(vec![format!(
            "cannot read the saved target configurations to check the new set against: {e}"
        )]),
        Ok(r)
            if let Some(e) = known
                .as_ref()
                .ok()
                .and_then(|k| moved_ids(k, &r.0, app.store.as_ref())) =>
        {
            Err(vec![e])
        }
        Ok(mut r) => {
            // A target added or changed must be able to start (its signing secret set, its
            // URL valid, the WASM runtime up for a handler) before the set goes live: else
            // its entries would queue with no worker, or its old worker would go on under the
            // old configuration while the API showed the new one. One unchanged since the
            // live set that still cannot start and has no worker (it could not at start-up
            // either) stays a warning: it must not hold back every other change.
            let mut prepared = Vec::new();
            let mut cannot_start = Vec::new();
            for spec in r.0.targets.values() {
                if !app.dispatcher.is_current(spec) {
                    match app.dispatcher.prepare(spec.clone()) {
                        Ok(p) => prepared.push(p),
                        // The error does not say what becomes of the entries: that depends
                        // on where it arises (a removed target's go to the DLQ).
                        Err(e) if old.targets.get(&spec.id) == Some(spec) => {
                            if app.dispatcher.runtime(&spec.id).is_none() {
                                r.1.push(format!(
                                    "{e}; the target is unchanged by this reload and still has no worker: its entries wait in its queue"
                                ));
                            } else {
                                // Its rule is unchanged and a worker runs, so what changed is
                                // a secret it reads (revoked, emptied, a placeholder): refused
                                // like any target that cannot start. Going live would leave
                                // that worker sending with the old secret while the reload
                                // reported success, and a restart on the same files would
                                // not start the target at all.
                                cannot_start.push(format!(
                                    "{e}; its worker goes on with the secrets it started with until this is fixed"
                                ));
                            }
                        }
                        Err(e) => cannot_start.push(e.to_string()),
                    }
                }
            }
            if cannot_start.is_empty() {
                Ok((r, prepared))
            } else {
                Err(cannot_start)
            }
        }
    };
    let refused = |e: ReloadError| {
        let mut st = app.reload_status.lock().unwrap_or_else(|p| p.into_inner());
        st.last_attempt_at = crate::clock::rfc3339(now);
        st.last_trigger = trigger.to_string();
        st.last_error = Some(e.to_string());
        st.failed_reloads += 1;
        app.metrics
            .reloads
            .get_or_create(&vec![("result", "error".to_string())])
            .inc();
        // One line per record: a log shipper splits at line breaks, and an ERROR whose
        // continuation lines carry no level is missed by a search for it.
        match &e {
            ReloadError::RulesRefused(_) => {
                tracing::error!(trigger, error = %e.to_string().replace('\n', "; "), "rules refused; the previous rules stay live (contracts reload apart: the directory's are live)")
            }
            ReloadError::ContractsRefused(_) => {
                tracing::error!(trigger, error = %e.to_string().replace('\n', "; "), "contracts refused; the previous contracts stay live (rules reload apart: the directory's are live)")
            }
            _ => {
                tracing::error!(trigger, error = %e.to_string().replace('\n', "; "), "reload refused; the previous rules and contracts stay live")
            }
        }
        e
    };
    let result = match (rules_side, contracts_side) {
        // Both refused: every problem is said, the rules' first.
        (Err(mut rules), Err(contracts)) => {
            rules.extend(contracts);
            Err(ReloadError::Invalid(rules))
        }
        // The rules go live with the contracts that are live; the refusal is reported once
        // they are (below).
        (Ok((r, prepared)), Err(e)) => Ok((r, Err(e), git, prepared)),
        (Err(e), Ok(contracts)) => {
            let version = contracts.version();
            if version != app.contracts.load().version() {
                for w in contracts.warnings_against(&app.contracts.load()) {
                    tracing::warn!(trigger, "{w}");
                }
                app.contracts.store(Arc::new(contracts));
                app.reload_status
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .contracts_version = version.clone();
                tracing::info!(trigger, contracts_version = %version, "contracts reloaded");
            }
            Err(ReloadError::RulesRefused(e))
        }
        (Ok((r, prepared)), Ok(c)) => Ok((r, Ok(c), git, prepared)),
    };
    let ((rules, mut warnings), contracts, git, prepared) = result.map_err(refused)?;
    let (contracts, contracts_refused) = match contracts {
        Ok(c) => (Arc::new(c), None),
        Err(e) => (app.contracts.load_full(), Some(e)),
    };
    warnings.extend(contracts.warnings_against(&app.contracts.load()));
    warnings.extend(config_warnings);
    app.store
        .save_targets(
            rules
                .targets
                .values()
                .map(|t| (t.id.clone(), serde_json::to_value(t).unwrap_or_default()))
                .collect(),
        )
        .await
        .map_err(|e| refused(e.into()))?;
    pause_renamed(app, &old, &rules, &prepared, &mut warnings).await;
    let mut started = Vec::new();
    // The saved states are read once for the targets started here, not once each.
    let states = crate::deliver::StoredStates::default();
    for target in prepared {
        started.push(target.id().to_string());
        app.dispatcher.start_with(target, &states).await;
    }
    let removed: Vec<String> = old
        .targets
        .keys()
        .filter(|id| !rules.targets.contains_key(*id))
        .cloned()
        .collect();
    let (rules_version, contracts_version) = (rules.version.clone(), contracts.version());
    app.metrics
        .forget_rules(|name| rules.rules.iter().any(|rule| rule.name == name));
    app.rules.store(Arc::new(rules));
    app.contracts.store(contracts);
    for id in &removed {
        let grace = removal_grace(&app.cfg, old.targets.get(id));
        match app.cfg.delivery.on_target_removed {
            // Draining takes a worker. One that never started (its secret unset since the
            // router started, say) drained nothing: its entries stayed queued until a restart
            // dead-lettered them. As at a start: its last configuration is tried, and if it
            // cannot start, the entries go to the DLQ saying why.
            crate::config::OnTargetRemoved::Drain
                if app.dispatcher.runtime(id).is_none() && has_live_entries(app, id) =>
            {
                let started = match old.targets.get(id) {
                    Some(spec) => app
                        .dispatcher
                        .ensure_with(spec.clone(), &states)
                        .await
                        .map_err(|e| {
                            format!(
                                "{TARGET_REMOVED}, and its last configuration cannot start: {e}"
                            )
                        }),
                    None => Err(format!(
                        "{TARGET_REMOVED}, and no configuration of it is known to drain its queue under"
                    )),
                };
                match started {
                    Ok(()) => {
                        tracing::warn!(target_id = %id, "target removed from the rules; its worker started under its last configuration to drain its queued entries");
                    }
                    Err(why) => {
                        dead_letter_removed(app, id, why, grace).await;
                    }
                }
            }
            crate::config::OnTargetRemoved::Drain => {
                tracing::warn!(target_id = %id, "target removed from the rules; its queued entries drain under its last configuration");
            }
            crate::config::OnTargetRemoved::DeadLetter => {
                let n = dead_letter_removed(app, id, TARGET_REMOVED.to_string(), grace).await;
                if n > 0 {
                    warnings.push(dead_lettered_removed_warning(
                        &app.rules.load(),
                        id,
                        n,
                        old.targets.get(id),
                    ));
                }
            }
        }
    }
    {
        let mut st = app.reload_status.lock().unwrap_or_else(|p| p.into_inner());
        st.rules_version = rules_version.clone();
        st.rules_git_commit = git;
        st.git_checked_at = Some(std::time::Instant::now());
        st.contracts_version = contracts_version.clone();
        st.loaded_at = crate::clock::rfc3339(now);
        // A refused contracts side is recorded as a failed reload below, as a refused rules
        // side is: `last_error` and `router_reload_failing` stay up until it is fixed.
        if contracts_refused.is_none() {
            st.last_attempt_at = crate::clock::rfc3339(now);
            st.last_trigger = trigger.to_string();
            st.last_error = None;
            st.reloads += 1;
        }
    }
    if contracts_refused.is_none() {
        app.metrics
            .reloads
            .get_or_create(&vec![("result", "ok".to_string())])
            .inc();
    }
    for w in &warnings {
        tracing::warn!(trigger, "{w}");
    }
    // After the workers started (their ordering set): logged by the call.
    let live = app.rules.load_full();
    warnings.extend(release_keys_no_longer_held(app.store.as_ref(), live.targets.values()).await);
    *app.rule_warnings.lock().unwrap_or_else(|p| p.into_inner()) = warnings.clone();
    if let Some(problems) = contracts_refused {
        tracing::info!(trigger, version = %rules_version, started = started.len(), removed = removed.len(), "rules reloaded; the contracts were refused and the previous ones stay live");
        return Err(refused(ReloadError::ContractsRefused(problems)));
    }
    tracing::info!(trigger, version = %rules_version, contracts = %contracts_version, started = started.len(), removed = removed.len(), "rules and contracts reloaded");
    Ok(ReloadReport {
        rules_version,
        contracts_version,
        targets_started: started,
        targets_removed: removed,
        warnings,
    })
}

/// How often a node sharing its store with others reads the operators' containment state
/// (paused targets, disabled rules) set on any node.
const OPERATOR_STATE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(2);

/// On a store several nodes share: applies the pauses and rule switches made on other nodes
/// (each node's API persists them; without this, pausing a target at 3 a.m. through a load
/// balancer would stop one node's deliveries and leave the others hammering the dependency).
fn spawn_operator_state_follower(app: &Arc<App>, tracker: &TaskTracker, cancel: CancellationToken) {
    if !app.store.shared() {
        return;
    }
    let app = app.clone();
    tracker.spawn(async move {
        loop {
            tokio::select! {
                () = cancel.cancelled() => break,
                () = tokio::time::sleep(OPERATOR_STATE_INTERVAL) => {}
            }
            let since = app.dispatcher.operator_changes();
            let states = app.store.target_states().await;
            app.dispatcher
                .record_containment_sync(&states, crate::clock::rfc3339(app.clock.now_ms()));
            let Ok(states) = states else {
                continue;
            };
            // Breakers opened and Retry-After pauses taken on other nodes (the target's record
            // holds the last writer's).
            for (id, v) in &states {
                let Ok(state) = serde_json::from_value::<crate::deliver::PersistedState>(v.clone())
                else {
                    continue;
                };
                match state.breaker {
                    Some((crate::policy::breaker::BreakerState::Open { until }, _)) => {
                        app.dispatcher.follow_breaker_open(id, until);
                    }
                    // Another node's probe succeeded: a node of ours left half-open (no
                    // traffic to probe with) closes too.
                    Some((crate::policy::breaker::BreakerState::Closed, since)) => {
                        app.dispatcher.follow_breaker_close(id, since);
                    }
                    _ => {}
                }
                if let Some(until) = state.retry_after_until {
                    app.dispatcher
                        .follow_retry_after(id, until, state.retry_after_since);
                }
            }
            // Retry-After pauses lifted by an operator's resume on another node. Not subject
            // to the check below: a lift only ever moves forward in time.
            for (k, v) in &states {
                if let (Some(id), Some(at)) = (
                    k.strip_prefix(crate::deliver::PAUSE_STATE_PREFIX),
                    v[crate::deliver::HOLD_LIFTED_AT].as_i64(),
                ) {
                    app.dispatcher.follow_lift(id, at);
                }
            }
            let disabled = DisabledRules::from_states(&states);
            // Skipped when this node changed something meanwhile: what was read may predate
            // it, and the next round reads it.
            app.dispatcher.if_no_operator_change(since, || {
                for (k, v) in &states {
                    if let (Some(id), Some(paused)) = (
                        k.strip_prefix(crate::deliver::PAUSE_STATE_PREFIX),
                        v["paused"].as_bool(),
                    ) {
                        app.dispatcher.follow_pause(id, paused);
                    }
                }
                if *app.disabled.load_full() != disabled {
                    tracing::warn!(disabled = ?disabled.names().collect::<Vec<_>>(), "rules enabled or disabled by an operator on another node");
                    app.disabled.store(Arc::new(disabled));
                }
            });
        }
    });
}

/// How often a node sharing its store announces itself and counts the live nodes.
const ANNOUNCE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// Announces this node to the others sharing the store and counts the live ones, splitting
/// every target's throttle rate among them (`Dispatcher::set_nodes`).
async fn count_nodes(store: &dyn Store, dispatcher: &Dispatcher, now: i64) {
    match store.announce_node(now).await {
        Ok(n) => {
            let before = dispatcher.nodes();
            if n != before {
                tracing::warn!(
                    nodes = n,
                    before,
                    "live router nodes on the shared store changed; each takes 1/{n} of every target's throttle rate"
                );
                dispatcher.set_nodes(n);
            }
        }
        Err(e) => {
            // Kept as it was: a node that cannot reach the store cannot deliver either.
            tracing::warn!(error = %e, "cannot announce this node to the shared store");
        }
    }
}

fn spawn_node_announcer(app: &Arc<App>, tracker: &TaskTracker, cancel: CancellationToken) {
    if !app.store.shared() {
        return;
    }
    let app = app.clone();
    tracker.spawn(async move {
        loop {
            tokio::select! {
                () = cancel.cancelled() => break,
                () = tokio::time::sleep(ANNOUNCE_INTERVAL) => {}
            }
            count_nodes(app.store.as_ref(), &app.dispatcher, app.clock.now_ms()).await;
        }
    });
}

fn spawn_reload_triggers(app: &Arc<App>, tracker: &TaskTracker, cancel: CancellationToken) {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(4);
    let watcher = match crate::rules::watch::watch(
        &[app.cfg.rules_dir.clone(), app.cfg.contracts_dir.clone()],
        tx,
    ) {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch the rules/contracts directories; reload with SIGHUP or POST /v1/admin/reload");
            None
        }
    };
    let app2 = app.clone();
    let c2 = cancel.clone();
    tracker.spawn(async move {
        let _keep = watcher;
        loop {
            tokio::select! {
                _ = c2.cancelled() => break,
                r = rx.recv() => match r {
                    Some(()) => { let _ = reload(&app2, "file change").await; }
                    None => break,
                }
            }
        }
    });
    #[cfg(unix)]
    {
        let app = app.clone();
        tracker.spawn(async move {
            use tokio::signal::unix::{SignalKind, signal};
            let Ok(mut hup) = signal(SignalKind::hangup()) else {
                return;
            };
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = hup.recv() => { let _ = reload(&app, "SIGHUP").await; }
                }
            }
        });
    }
}

/// Why the router could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The store could not be opened. (Each variant's `Display` says what it adds and leaves
    /// its source to the chain: `main` prints the whole chain, so a message that repeated its
    /// source's was printed twice.)
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Rule files are invalid.
    #[error("rules in {dir}:\n{}", errors.join("\n"))]
    Rules {
        /// Rules directory.
        dir: String,
        /// One problem per entry.
        errors: Vec<String>,
    },
    /// Contracts are invalid.
    #[error("contracts in {dir}:\n{}", errors.join("\n"))]
    Contracts {
        /// Contracts directory.
        dir: String,
        /// One problem per entry.
        errors: Vec<String>,
    },
    /// A configured rules or contracts directory does not exist: not "no rules" (every
    /// queue would be treated as removed) nor "no contracts" (every event let through).
    #[error(
        "{what} directory {dir} does not exist (a typo, or a volume not mounted?): point {flag} at the right one, or create it"
    )]
    MissingDir {
        /// `rules` or `contracts`.
        what: &'static str,
        /// The directory.
        dir: String,
        /// The flag and key that set it.
        flag: &'static str,
    },
    /// The rules directory holds no rule file while the store has queued entries: starting
    /// would treat every one of those targets as removed.
    #[error(
        "rules directory {dir} holds no rule file, but the store has queued entries for {targets}: starting would treat them all as removed (drained to their old destinations or dead-lettered as target_removed). Point --rules at the right directory; to remove every rule on purpose, leave a file that says `rules: []`"
    )]
    NoRuleFiles {
        /// The directory.
        dir: String,
        /// The targets with entries (a few named, and how many).
        targets: String,
    },
    /// The rules give a target id with queued entries or dead letters another target's
    /// destination ([`moved_ids`]): starting would deliver them there.
    #[error(
        "the rules move queued entries or dead letters to another target's destination, so the router does not start (a reload would refuse this set and keep the previous one live; a start has none to keep): {0}. To start now, deploy the previous rule files (their queues drain; then deploy this set), or give the targets explicit ids"
    )]
    MovedTargets(String),
    /// Another router runs on this data dir (a shared store's node identity).
    #[error(
        "data dir {0} is in use by another router on this host (its node.lock is held); give each node its own --data-dir"
    )]
    DataDirInUse(String),
    /// An I/O error while starting (the listener's address, the delivery threads).
    #[error("starting the router")]
    Serve(#[from] std::io::Error),
    /// The data dir's node lock or node id could not be read or written (a shared store).
    #[error("data dir {dir}")]
    DataDir {
        /// The data dir.
        dir: String,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// The webhook HTTP client could not be built.
    #[error(transparent)]
    Client(#[from] crate::target::webhook::WebhookError),
    /// Invalid `[auth]` configuration (the message names the token).
    #[error(transparent)]
    Auth(#[from] crate::auth::TokenConfigError),
    /// The secrets file is unreadable or not a TOML table of strings.
    #[error("secrets file {0}")]
    Secrets(String),
    /// The WASM handler runtime did not start, and the configuration needs it.
    #[error(
        "the WASM handler runtime cannot start ({error}), and {needed_by}: their events would be accepted and wait until a restart. Fix the [handlers] configuration"
    )]
    HandlerRuntime {
        /// Why it did not start.
        error: String,
        /// What needs it.
        needed_by: String,
    },
    /// A credential of `[store.jetstream]` cannot be used: the variable `token_env` or
    /// `password_env` names is not set, or the credentials file is unreadable or does not
    /// parse. The store is not optional, so the router does not start (a `nats:` target
    /// waits instead).
    #[error(transparent)]
    StoreCredentials(crate::nats_auth::NatsAuthError),
    /// `server.ops_listen` could not be bound.
    #[error("cannot listen on {addr} (server.ops_listen)")]
    OpsListen {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// Refusing to serve without tokens on a non-loopback address.
    #[error(
        "refusing to listen on {0} without auth tokens: configure [[auth.tokens]] or set auth.insecure = true"
    )]
    Insecure(std::net::SocketAddr),
}

impl RunError {
    /// The problems one per entry: a rules or contracts directory's per-file findings without
    /// the heading that names the directory (a reload's answer lists them as its errors), any
    /// other error as its one line with its sources.
    pub fn problems(&self) -> Vec<String> {
        match self {
            Self::Rules { errors, .. } | Self::Contracts { errors, .. } => errors.clone(),
            other => vec![error_chain(other)],
        }
    }
}

/// `e` and its sources, `: `-separated (as `main` prints an error).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

pub(crate) async fn start_handlers(
    cfg: &Config,
    store: &Arc<dyn Store>,
    clock: &Arc<dyn Clock>,
    metrics: &crate::telemetry::Metrics,
) -> Result<Arc<crate::target::handler::HandlerRuntime>, String> {
    let h = &cfg.handlers;
    let dir = h
        .dir
        .clone()
        .unwrap_or_else(|| cfg.data_dir.join("handlers"));
    std::fs::create_dir_all(&dir).map_err(|e| {
        let key = if h.dir.is_some() {
            "handlers.dir"
        } else {
            "handlers.dir (default: <data_dir>/handlers)"
        };
        format!("{key} {}: {e}", dir.display())
    })?;
    // Routers before this one let wasmtime cache compiled code here, and loaded its files
    // unchecked (a damaged one crashed the router); the registry now keeps checked compiled
    // code beside each component.
    let legacy = dir.join("compiled");
    match crate::wasm::artifact::remove_legacy_cache(&legacy) {
        Ok(Some(bytes)) => tracing::info!(
            dir = %legacy.display(),
            bytes,
            "removed wasmtime's unchecked compilation cache of an earlier router version; each handler is compiled once more (in the background, after the start), and its compiled code then kept, checked, beside its component"
        ),
        Ok(None) => {}
        Err(e) => tracing::warn!(
            dir = %legacy.display(),
            error = %e,
            "cannot remove the compilation cache of an earlier router version (no longer used); remove it by hand"
        ),
    }
    let engine = crate::wasm::WasmEngine::new(crate::wasm::EngineConfig {
        max_instances: h.max_instances,
        max_memory_bytes: h.memory_bytes,
        fuel: h.fuel.is_some(),
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    let limits = crate::wasm::HandlerLimits {
        memory_bytes: h.memory_bytes,
        timeout: h.timeout,
        fuel: h.fuel,
        max_emitted: h.max_emitted,
        max_output_bytes: h.max_output_bytes,
        max_log_bytes: h.max_log_bytes,
        max_kv_ops: h.max_kv_ops,
        ..Default::default()
    };
    engine.check_limits(&limits).map_err(|e| e.to_string())?;
    // Versions whose stored compiled code is of no use (a router upgrade, `handlers.fuel`
    // switched) are compiled after the start, in the background (`compile_deferred`): the API
    // and ingest do not wait for them, and their deliveries wait as for a handler not loaded.
    let registry_dir = dir.join("registry");
    let registry = tokio::task::spawn_blocking(move || {
        crate::wasm::HandlerRegistry::open_deferred(registry_dir, engine)
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| e.to_string())?
    .with_keep_versions(h.keep_versions);
    let registry = Arc::new(registry);
    let logs = Arc::new(
        crate::wasm::HandlerLogs::open(&dir.join("logs"), h.log_retain_bytes)
            .map_err(|e| format!("{}: {e}", dir.join("logs").display()))?,
    );
    let changes = Arc::new(
        crate::wasm::HandlerChanges::new(
            registry.clone(),
            store.handler_catalog(),
            metrics.handler_catalog.clone(),
        )
        .with_data(crate::wasm::HandlerData {
            store: store.clone(),
            logs: logs.clone(),
            drain: h.timeout + std::time::Duration::from_secs(1),
        }),
    );
    // On a shared store, take in what the other nodes uploaded before any delivery starts
    // (a failure leaves this node on its own copy, retried in the background and shown in
    // /v1/status).
    if let Ok(report) = changes.sync().await
        && report != crate::wasm::SyncReport::default()
    {
        tracing::info!(installed = ?report.applied, removed = ?report.removed, published = ?report.published, "handlers synced from the shared catalog");
    }
    if let Some(pre) = &h.preload_dir {
        let components = crate::wasm::component_files(pre)
            .map_err(|e| format!("handlers.preload_dir {}: {e}", pre.display()))?;
        for (name, path) in components {
            let name = name.as_str();
            let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            // Already stored, or preloaded before (by an earlier start, or another node): left
            // as it is, so a restart neither undoes a rollback or an upload made since nor
            // brings back bytes no longer kept as a version.
            if let Some(v) = registry.stored_version(name, &bytes) {
                tracing::info!(
                    handler = name,
                    version = v.version,
                    "preloaded handler already stored"
                );
                continue;
            }
            if registry.was_preloaded(name, &bytes) {
                tracing::info!(handler = name, "preloaded before; left as it is");
                continue;
            }
            let preload = crate::wasm::Uploader::preload(crate::auth::PRELOAD_OWNER);
            match changes.upload(name, bytes.into(), preload).await {
                Ok(v) => tracing::info!(handler = name, version = v.version, "handler preloaded"),
                // A team owns the name: its handler stays (shown in /v1/status warnings' log).
                Err(e) => tracing::warn!(handler = name, error = %e, "preloading a handler failed"),
            }
        }
    }
    tracing::info!(
        handlers = registry.list().len(),
        compilations = registry.compilations(),
        compiling_in_background = registry
            .list()
            .iter()
            .filter(|i| i.state == crate::wasm::HandlerState::Loading)
            .count(),
        "WASM handler runtime started"
    );
    Ok(Arc::new(crate::target::handler::HandlerRuntime {
        registry,
        changes,
        limits,
        slots: Arc::new(tokio::sync::Semaphore::new(h.max_instances as usize)),
        running_per_handler: match h.running_per_handler {
            0 => std::thread::available_parallelism().map_or(2, std::num::NonZero::get),
            n => n,
        },
        gates: Default::default(),
        logs,
        hop_limit: h.hop_limit,
        completed_ttl_ms: i64::try_from(h.completed_ttl.as_millis()).unwrap_or(i64::MAX),
        kv_max_bytes: Some(h.kv_max_bytes),
        completed_hits: metrics.completed_hits.clone(),
        invocations: metrics.handler_invocations.clone(),
        log_lines_dropped: metrics.handler_log_lines_dropped.clone(),
        store: store.clone(),
        clock: clock.clone(),
        prepare: std::sync::OnceLock::new(),
    }))
}

/// Compiles the handler versions the registry's open left for later
/// (`HandlerRegistry::load_deferred`), one at a time on a blocking thread, until done or
/// `cancel`. On cancel it returns at once: a compilation cannot be interrupted, so the one
/// running finishes on its thread (it activates nothing once the shutdown has closed the
/// registry, and `main` does not wait for it).
async fn compile_deferred(registry: Arc<crate::wasm::HandlerRegistry>, cancel: CancellationToken) {
    if !registry.loading() {
        return;
    }
    let stop = cancel.clone();
    let work = tokio::task::spawn_blocking(move || registry.load_deferred(&|| stop.is_cancelled()));
    tokio::select! {
        () = cancel.cancelled() => {}
        done = work => {
            if let Err(e) = done {
                tracing::error!(error = %e, "compiling handler versions in the background failed; those not loaded stay `loading` until the next start");
            }
        }
    }
}

/// Why an emitted event is outside its handler owner's ingest scope, if it is. With auth off
/// (no tokens) there are no scopes to enforce, and handlers preloaded from the operator's
/// `handlers.preload_dir` are the operator's own (the token name `preload` is reserved).
fn emit_scope_error(
    tokens: &crate::auth::Tokens,
    emitter: &crate::target::handler::EmitterOf,
    ty: &str,
) -> Option<String> {
    if !tokens.enabled() || emitter.owner == crate::auth::PRELOAD_OWNER {
        return None;
    }
    let Some(principal) = tokens.uploader_principal(&emitter.owner, emitter.team.as_deref()) else {
        return Some(format!(
            "handler {:?} was uploaded by {:?}, which is no longer a configured token and has no team mate configured: it has no ingest scope",
            emitter.handler, emitter.owner
        ));
    };
    // A system event's type (`router.dlq.added` …) is reserved as at ingest: alert rules route
    // them, so a team whose token may not send one may not have its handler emit one either
    // (`ingest:*` does not cover them).
    if let Some(need) = principal.reserved_type_denial(ty) {
        return Some(format!(
            "handler {:?} (owner {:?}) may not emit type {ty:?}: types starting with {} are the router's system events, and its owner's token lacks {need} (only admin or an ingest: pattern that itself starts with {} covers them)",
            emitter.handler,
            emitter.owner,
            crate::auth::RESERVED_TYPE_PREFIX,
            crate::auth::RESERVED_TYPE_PREFIX
        ));
    }
    // The router sets an emitted event's source (the handler's URI): only its type is the
    // owner's to be checked.
    principal.ingest_denial(ty, None).map(|need| {
        format!(
            "handler {:?} (owner {:?}) may not emit type {ty:?}: its owner's token lacks {need}",
            emitter.handler, emitter.owner
        )
    })
}

/// Emitted events re-enter the pipeline: past the hop limit they go to the DLQ as
/// `loop_detected`, outside the owner's scope as `scope_violation`; otherwise contracts (enforce
/// behaves as quarantine: there is no producer to answer) and the live rules apply, and ingest
/// dedup (same ids on a re-run) drops copies.
fn prepare_emitted(
    app: &App,
    emitter: &crate::target::handler::EmitterOf,
    events: Vec<crate::event::CloudEvent>,
    now: i64,
) -> Vec<crate::store::NewEvent> {
    use crate::contract::{ContractOutcome, ViolationReason};
    use crate::store::{DlqReason, Quarantine};
    let rules = app.rules.load();
    let contracts = app.contracts.load();
    let window = i64::try_from(app.cfg.ingest.dedup_window.as_millis()).unwrap_or(i64::MAX);
    let hop_limit = app.handlers.as_ref().map_or(8, |h| h.hop_limit);
    events
        .into_iter()
        .map(|ev| {
            let quarantine = if ev.hops() > hop_limit {
                Some(Quarantine {
                    reason: DlqReason::LoopDetected,
                    errors: vec![crate::event::FieldError::new(
                        "/hops",
                        format!("{} hops is past the limit of {hop_limit}", ev.hops()),
                    )],
                    emitted_by: Some(emitter.emitted_by()),
                })
            } else if let Some(why) = emit_scope_error(&app.tokens.load(), emitter, &ev.ty) {
                Some(Quarantine {
                    reason: DlqReason::ScopeViolation,
                    errors: vec![crate::event::FieldError::new("/type", why)],
                    emitted_by: Some(emitter.emitted_by()),
                })
            } else {
                match contracts.check(&ev) {
                    ContractOutcome::Pass => None,
                    ContractOutcome::Violation { reason, errors, .. } => Some(Quarantine {
                        reason: match reason {
                            ViolationReason::ContractViolation => DlqReason::ContractViolation,
                            ViolationReason::UnknownVersion => DlqReason::UnknownVersion,
                        },
                        errors,
                        emitted_by: Some(emitter.emitted_by()),
                    }),
                }
            };
            match quarantine {
                Some(q) => crate::store::NewEvent {
                    event: ev,
                    accepted_at: now,
                    ruleset_version: rules.version.clone(),
                    matched_rules: Vec::new(),
                    targets: Vec::new(),
                    quarantine: Some(q),
                    dedup_window_ms: window,
                },
                None => crate::ingest::route(&rules, &app.disabled_rules(), ev, now, window),
            }
        })
        .collect()
}

/// Secrets come from the environment first, then the optional secrets file (a TOML table of
/// name = "value"); never from the rule files.
/// Resolves secrets by name: the environment, then `cfg.secrets_file`. With `env_prefix` (the
/// names rule files give, under `secrets_env_prefix`), the environment is read only for names
/// that start with it; others resolve in the secrets file alone.
fn secret_resolver(
    cfg: &Config,
    env_prefix: Option<String>,
) -> Result<crate::deliver::SecretResolver, RunError> {
    let file = match &cfg.secrets_file {
        None => Default::default(),
        Some(p) => crate::config::read_secrets(p).map_err(RunError::Secrets)?,
    };
    // Read again at each use (a target's start, at a start or a reload): a secret added to
    // the file for a new signed webhook takes effect with the reload that adds the webhook.
    // Checked above, so a file that cannot be read at start stops the start; one broken later
    // keeps the values it last had.
    let path = cfg.secrets_file.clone();
    let last = Mutex::new(file);
    Ok(Arc::new(move |name: &str| {
        match &env_prefix {
            Some(p) if !name.starts_with(p.as_str()) => {
                if std::env::var_os(name).is_some() {
                    tracing::warn!(name, prefix = %p, "a rule file names an environment variable outside secrets_env_prefix: it is not read (the secrets file is)");
                }
            }
            _ => {
                if let Ok(v) = std::env::var(name) {
                    return Some(v);
                }
            }
        }
        let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = &path {
            match crate::config::read_secrets(p) {
                Ok(now) => *last = now,
                Err(e) => {
                    tracing::warn!(error = %e, "secrets file unreadable; using the values last read from it");
                }
            }
        }
        last.get(name).cloned()
    }))
}

/// Refuses to start on a rules or contracts directory that is not there, and on a rules
/// directory without a rule file while the store holds queued entries: the reload refuses
/// both (the previous set stays live), and a start has no previous set to keep, so it stops
/// instead of going live with none. `router serve` with no configuration at all still runs:
/// the built-in default directories (`./rules`, `./contracts`) may be absent, as long as the
/// store has nothing queued.
fn check_dirs_at_start(cfg: &Config, rules: &RuleSet, store: &dyn Store) -> Result<(), RunError> {
    let defaults = Config::default();
    if !cfg.rules_dir.exists() && cfg.rules_dir != defaults.rules_dir {
        return Err(RunError::MissingDir {
            what: "rules",
            dir: cfg.rules_dir.display().to_string(),
            flag: "--rules (rules_dir)",
        });
    }
    if !cfg.contracts_dir.exists() && cfg.contracts_dir != defaults.contracts_dir {
        return Err(RunError::MissingDir {
            what: "contracts",
            dir: cfg.contracts_dir.display().to_string(),
            flag: "--contracts (contracts_dir)",
        });
    }
    if rules.files.is_empty() {
        let mut queued = store.targets_with_entries();
        if !queued.is_empty() {
            queued.sort();
            let n = queued.len();
            let mut targets = queued.into_iter().take(5).collect::<Vec<_>>().join(", ");
            if n > 5 {
                targets.push_str(&format!(" and {} more", n - 5));
            }
            return Err(RunError::NoRuleFiles {
                dir: cfg.rules_dir.display().to_string(),
                targets,
            });
        }
    }
    Ok(())
}

/// Loads the rule set from `cfg.rules_dir` (a missing directory means no rules: a reload
/// refuses that on its own terms, a start in [`check_dirs_at_start`]).
pub fn load_rules(cfg: &Config) -> Result<(RuleSet, Vec<String>), RunError> {
    if !cfg.rules_dir.exists() {
        return Ok((
            RuleSet::empty(),
            vec![format!(
                "rules directory {} does not exist: no rules loaded",
                cfg.rules_dir.display()
            )],
        ));
    }
    match RuleSet::load_dir_for_config(&cfg.rules_dir, &cfg.operator_secrets()) {
        Ok((set, warnings)) => Ok((set, warnings.iter().map(ToString::to_string).collect())),
        Err(errors) => Err(RunError::Rules {
            dir: cfg.rules_dir.display().to_string(),
            errors: errors.iter().map(ToString::to_string).collect(),
        }),
    }
}

/// Loads contracts from `cfg.contracts_dir` (a missing directory means none).
pub fn load_contracts(cfg: &Config) -> Result<ContractSet, RunError> {
    load_contracts_with(cfg, &[])
}

/// Loads contracts as `cfg.contracts_dir` would be with `files` (`(relative path, text)`)
/// written into it, writing nothing.
pub fn load_contracts_with(cfg: &Config, files: &[(&str, &str)]) -> Result<ContractSet, RunError> {
    ContractSet::load_dir_with(&cfg.contracts_dir, files).map_err(|errors| RunError::Contracts {
        dir: cfg.contracts_dir.display().to_string(),
        errors: errors.iter().map(ToString::to_string).collect(),
    })
}

/// Runs the router on its configured store (the embedded one in `cfg.data_dir` by default)
/// until `shutdown` is cancelled.
pub async fn run(
    cfg: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    let metrics = Metrics::new();
    metrics
        .handler_kv_max_bytes
        .set(i64::try_from(cfg.handlers.kv_max_bytes).unwrap_or(i64::MAX));
    if cfg.store.backend == crate::config::StoreBackend::Jetstream {
        // Held until the router stops (the kernel lets go of a dead process's lock).
        let _node_lock = lock_node(&cfg.data_dir)?;
        let js = &cfg.store.jetstream;
        // The operator's configuration names any variable (rule files only those within
        // secrets_env_prefix).
        let secrets = secret_resolver(&cfg, None)?;
        let auth = js
            .auth()
            .resolve(secrets)
            .map_err(RunError::StoreCredentials)?;
        let store = crate::store::jetstream::JetStreamStore::open(
            crate::store::jetstream::JetStreamOptions {
                records: crate::store::jetstream::records::RecordsConfig {
                    url: js.url.clone(),
                    stream: js.stream.clone(),
                    prefix: js.prefix.clone(),
                    replicas: js.replicas,
                    timeout: js.timeout,
                    // The body limit plus room for the envelope and the stored record's
                    // fields.
                    max_record_bytes: cfg.ingest.max_body_bytes.saturating_add(64 << 10),
                    auth,
                },
                node: node_id(&cfg.data_dir)?,
            },
        )
        .await?;
        tracing::info!(url = %js.url, stream = %js.stream, "store: NATS JetStream");
        return run_with_store(cfg, listener, Arc::new(store), metrics, shutdown).await;
    }
    let m = metrics.clone();
    let mc = metrics.clone();
    let store = RedbStore::open_dir(
        &cfg.data_dir,
        StoreOptions {
            on_commit: Some(Arc::new(move |took, ops| m.observe_commit(took, ops))),
            on_compact: Some(Arc::new(move |report| mc.observe_compaction(report))),
            cache_bytes: Some(cfg.store.cache_bytes),
            // A file past the disk's low-water mark is always worth a look: with the mark
            // below compact_min_bytes (64 MiB by default), a store refused past its
            // high-water mark never compacted, and ingest stayed refused until a restart.
            compact_min_bytes: Some(match cfg.store.max_disk_bytes {
                0 => cfg.store.compact_min_bytes,
                high => cfg
                    .store
                    .compact_min_bytes
                    .min((high as f64 * cfg.store.low_water_fraction) as u64),
            }),
            group_log: cfg.store.group_log,
            checkpoint_every: Some(cfg.store.checkpoint_interval),
            floor_every: None,
            sweep_batch: None,
            commit_delay: cfg.store.commit_delay,
            dedup_memtable_keys: Some(cfg.store.dedup_memtable_keys),
            dedup_freeze_inline_keys: None,
            dedup_window: Some(cfg.ingest.dedup_window),
        },
    )?;
    run_with_store(cfg, listener, store, metrics, shutdown).await
}

/// Locks `<data_dir>/node.lock` for this process. On a shared store the data dir is the node's
/// identity (`node_id`), and a node starting reclaims every lease recorded under it: a second
/// router started on the data dir of one still running took over that one's deliveries in
/// flight and sent them again (reproduced). The lock is advisory and per host: copies of a
/// data dir on several machines (a cloned image) are not caught.
fn lock_node(data_dir: &std::path::Path) -> Result<std::fs::File, RunError> {
    let failed = data_dir_error(data_dir);
    std::fs::create_dir_all(data_dir).map_err(failed)?;
    let path = data_dir.join("node.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(failed)?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => {
            Err(RunError::DataDirInUse(data_dir.display().to_string()))
        }
        Err(std::fs::TryLockError::Error(e)) => Err(failed(e)),
    }
}

/// Wraps an I/O error on `data_dir` (the node lock or id) into the error naming the dir.
fn data_dir_error(data_dir: &std::path::Path) -> impl Fn(std::io::Error) -> RunError + Copy + '_ {
    move |source| RunError::DataDir {
        dir: data_dir.display().to_string(),
        source,
    }
}

/// This node's identity for a shared store: kept in `<data_dir>/node-id`, made at first start.
/// A restarted node reclaims the leases it held by it.
fn node_id(data_dir: &std::path::Path) -> Result<String, RunError> {
    let failed = data_dir_error(data_dir);
    let path = data_dir.join("node-id");
    match std::fs::read_to_string(&path) {
        Ok(id) if !id.trim().is_empty() => return Ok(id.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(failed(e)),
    }
    std::fs::create_dir_all(data_dir).map_err(failed)?;
    let id = format!("{:016x}", rand::random::<u64>());
    let tmp = data_dir.join("node-id.tmp");
    std::fs::write(&tmp, &id).map_err(failed)?;
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(failed)?;
    std::fs::rename(&tmp, &path).map_err(failed)?;
    Ok(id)
}

/// The start-up warning of a router without `[[auth.tokens]]` listening on `local`.
fn auth_off_warning(local: std::net::SocketAddr, insecure: bool) -> String {
    if insecure {
        format!(
            "auth is off (no [[auth.tokens]]) and auth.insecure is set: every caller that reaches {local}, whatever host it names, is an administrator"
        )
    } else {
        format!(
            "auth is off (no [[auth.tokens]]): every caller on this machine is an administrator; {local} answers only requests addressed to a loopback name and not made by a web page. Configure [[auth.tokens]] before sharing the machine or the port"
        )
    }
}

/// What a start checks before anything runs on the store.
struct StartChecked {
    tokens: crate::auth::Tokens,
    local: std::net::SocketAddr,
    rules: RuleSet,
    rule_warnings: Vec<String>,
    contracts: ContractSet,
}

/// The checks that can refuse a start before anything runs on the open store: tokens, the
/// listen address without them, the rules and contracts directories and what they hold.
fn start_checks(
    cfg: &Config,
    listener: &TcpListener,
    store: &dyn Store,
) -> Result<StartChecked, RunError> {
    let tokens = crate::auth::Tokens::new(&cfg.auth.tokens)?;
    let local = listener.local_addr()?;
    if !tokens.enabled() && !local.ip().is_loopback() && !cfg.auth.insecure {
        return Err(RunError::Insecure(local));
    }
    let (rules, rule_warnings) = load_rules(cfg)?;
    check_dirs_at_start(cfg, &rules, store)?;
    let contracts = load_contracts(cfg)?;
    Ok(StartChecked {
        tokens,
        local,
        rules,
        rule_warnings,
        contracts,
    })
}

/// Refuses a start whose rules move a target id with entries or dead letters to another
/// target's destination ([`moved_ids`]), as a reload refuses it. A start has no previous set
/// to keep live, and going on would overwrite the id's saved configuration: its queue would
/// be delivered to the neighbour (a data leak when they belong to different consumers) and
/// its old destination forgotten, past any drain. A router that does not start is loud and
/// loses nothing (producers are refused, not answered 202); one that starts here is silent.
async fn check_moved_at_start(rules: &RuleSet, store: &dyn Store) -> Result<(), RunError> {
    let known = known_targets(&RuleSet::empty(), store.saved_targets().await?);
    match moved_ids(&known, rules, store) {
        Some(moved) => Err(RunError::MovedTargets(moved)),
        None => Ok(()),
    }
}

/// Clears the stored Retry-After pause and breaker state of every target whose destination
/// the rules changed while the router was down (a URL switched to a backup): they were the
/// old receiver's, and restored they held the new one back (a reload clears them the same
/// way, `Dispatcher::start_with`). The operator's pause stays.
async fn forget_changed_receivers(rules: &RuleSet, store: &dyn Store) -> Result<(), StoreError> {
    let saved = known_targets(&RuleSet::empty(), store.saved_targets().await?);
    let changed: Vec<(&TargetSpec, String)> = rules
        .targets
        .values()
        .filter_map(|t| {
            let was = saved.get(&t.id)?.kind.destination();
            (was != t.kind.destination()).then_some((t, was))
        })
        .collect();
    if changed.is_empty() {
        return Ok(());
    }
    let states = store.target_states().await?;
    for (t, was) in changed {
        let Some(state) = states.iter().find(|(k, _)| *k == t.id).and_then(|(_, v)| {
            serde_json::from_value::<crate::deliver::PersistedState>(v.clone()).ok()
        }) else {
            continue;
        };
        let state = match state.without_receiver() {
            kept if kept == state => continue,
            kept => kept,
        };
        store
            .put_target_state(&t.id, serde_json::to_value(state).unwrap_or_default())
            .await?;
        tracing::warn!(target_id = %t.id, from = %was, to = %t.kind.destination(), "target's destination changed while the router was down: the old receiver's Retry-After pause and circuit breaker state are cleared, the new receiver starts with none");
    }
    Ok(())
}

/// Runs the router on a given store (tests hand in fault-injecting ones).
pub async fn run_with_store(
    cfg: Config,
    listener: TcpListener,
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    let StartChecked {
        tokens,
        local,
        rules,
        mut rule_warnings,
        contracts,
    } = match start_checks(&cfg, &listener, store.as_ref()) {
        Ok(checked) => match check_moved_at_start(&checked.rules, store.as_ref()).await {
            Ok(()) => checked,
            Err(e) => {
                if let Err(close) = store.close().await {
                    tracing::warn!(error = %close, "the store did not close cleanly; it is checked at the next start");
                }
                return Err(e);
            }
        },
        Err(e) => {
            // Nothing runs on the store yet: closing it spares the next start a check of
            // every page (a refused start on a missing rules directory, or invalid rules, left
            // the file marked as not closed cleanly).
            if let Err(close) = store.close().await {
                tracing::warn!(error = %close, "the store did not close cleanly; it is checked at the next start");
            }
            return Err(e);
        }
    };
    let guard = crate::guard::RequestGuard::new(tokens.enabled(), cfg.auth.insecure, local);
    // Bound before anything else starts: an address that is taken stops the start, loud.
    let ops = match bind_ops(&cfg, tokens.enabled(), &metrics).await {
        Ok(ops) => ops.map(|(listener, endpoint)| {
            let guard =
                crate::guard::RequestGuard::new(tokens.enabled(), cfg.auth.insecure, endpoint.addr);
            (listener, endpoint, guard)
        }),
        Err(e) => {
            if let Err(close) = store.close().await {
                tracing::warn!(error = %close, "the store did not close cleanly; it is checked at the next start");
            }
            return Err(e);
        }
    };
    let ingest_limiters = ingest_limiters(&cfg.auth.tokens, None);
    let mut warnings = Vec::new();
    if !tokens.enabled() {
        let w = auth_off_warning(local, cfg.auth.insecure);
        tracing::warn!("{w}");
        warnings.push(w);
    }
    rule_warnings.extend(contracts.warnings_against(&ContractSet::empty()));
    for w in &rule_warnings {
        tracing::warn!("{w}");
    }
    tracing::info!(version = %rules.version, rules = rules.rules.len(), contracts = contracts.contracts().len(), "configuration loaded");

    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let tracker = TaskTracker::new();
    let workers_cancel = CancellationToken::new();
    let (handlers, handlers_error) = match start_handlers(&cfg, &store, &clock, &metrics).await {
        Ok(rt) => {
            tracker.spawn(rt.changes.clone().follow(workers_cancel.clone()));
            tracker.spawn(compile_deferred(
                rt.registry.clone(),
                workers_cancel.clone(),
            ));
            (Some(rt), None)
        }
        Err(e) => {
            // With handler targets in the rules (or handlers to preload), serving would
            // answer 202 to events that then wait, with no worker to apply their max_age,
            // until a restart: a start that stops is loud and loses nothing. Without any, the
            // router serves its other targets and says what is missing in /readyz and
            // /v1/status (a reload that adds a handler target is refused: it cannot start).
            let handler_targets: Vec<&str> = rules
                .targets
                .values()
                .filter(|t| matches!(t.kind, crate::rules::TargetKind::Handler { .. }))
                .map(|t| t.id.as_str())
                .collect();
            if !handler_targets.is_empty() || cfg.handlers.preload_dir.is_some() {
                if let Err(close) = store.close().await {
                    tracing::warn!(error = %close, "the store did not close cleanly; it is checked at the next start");
                }
                let needed_by = if handler_targets.is_empty() {
                    "handlers.preload_dir is set".to_string()
                } else {
                    let mut shown = handler_targets
                        .iter()
                        .take(5)
                        .copied()
                        .collect::<Vec<_>>()
                        .join(", ");
                    if handler_targets.len() > 5 {
                        shown.push_str(&format!(" and {} more", handler_targets.len() - 5));
                    }
                    format!("the rules have handler targets ({shown})")
                };
                return Err(RunError::HandlerRuntime {
                    error: e,
                    needed_by,
                });
            }
            tracing::error!(error = %e, "the WASM handler runtime could not start; the rules have no handler target, so the router serves without it (handler uploads are refused, and so is a reload that adds a handler target, until it is fixed and the router restarted)");
            let why = format!(
                "WASM handler runtime unavailable (uploads refused, and reloads that add a handler target, until it is fixed and the router restarted): {e}"
            );
            warnings.push(why.clone());
            (None, Some(why))
        }
    };
    let (sys_tx, sys_rx) = tokio::sync::mpsc::channel(1024);
    // Dropped when `run` returns, after the grace period for in-flight attempts.
    let delivery_threads = DeliveryThreads::start(cfg.delivery.threads, cfg.delivery.nice)?;
    let delivery_status = delivery_threads.status().await;
    match &delivery_status.error {
        None => {
            tracing::info!(threads = delivery_status.threads, nice = ?delivery_status.nice, "delivery runtime started")
        }
        Some(e) => {
            tracing::warn!(threads = delivery_status.threads, error = %e, "delivery runtime started at ingest's priority");
            warnings.push(format!("delivery threads run at ingest's priority: {e}"));
        }
    }
    // The operator's configuration (nats.token_env) names any variable; rule files only those
    // within secrets_env_prefix.
    let secrets = secret_resolver(&cfg, cfg.rule_secrets_prefix())?;
    let nats = crate::target::nats::NatsConnection::new(
        cfg.nats.clone(),
        secret_resolver(&cfg, None)?,
        delivery_threads.handle(),
    );
    if cfg.store.backend == crate::config::StoreBackend::Jetstream {
        nats.reserve(&cfg.store.jetstream.prefix);
    }
    let dispatcher = Dispatcher::new(DeliveryContext {
        store: store.clone(),
        metrics: metrics.clone(),
        clock: clock.clone(),
        cfg: cfg.delivery.clone(),
        http: crate::target::webhook::shared_clients(cfg.delivery.tls_ca_file.as_deref())?,
        nats,
        cancel: workers_cancel.clone(),
        tracker: tracker.clone(),
        spawner: delivery_threads.handle(),
        system_events: Some(sys_tx),
        secrets,
        secrets_env_prefix: cfg.rule_secrets_prefix(),
        handlers: handlers.clone(),
        log_gates: Default::default(),
        unannounced: Default::default(),
        store_faults: Default::default(),
        in_flight: crate::deliver::in_flight::InFlightCap::of(&cfg.delivery, &metrics),
        bytes: crate::deliver::bytes::BytePool::of(&cfg, &metrics),
    });
    if let Some(h) = &handlers {
        h.changes
            .set_released_queues(Arc::new(ReleasedHandlerQueues {
                dispatcher: Arc::downgrade(&dispatcher),
            }));
    }
    // On a shared store: count the live nodes before any worker takes its throttle share.
    if store.shared() {
        count_nodes(store.as_ref(), &dispatcher, clock.now_ms()).await;
    }

    // Remember every target's configuration, then start workers for the current targets and
    // for targets a previous rule set had that still hold entries (they drain under their last
    // configuration instead of being stranded).
    let current: Vec<(String, serde_json::Value)> = rules
        .targets
        .values()
        .map(|t| (t.id.clone(), serde_json::to_value(t).unwrap_or_default()))
        .collect();
    // Before the saved configurations are overwritten: they say which targets' destination
    // changed while the router was down.
    forget_changed_receivers(&rules, store.as_ref()).await?;
    store.save_targets(current).await?;
    let saved: std::collections::HashMap<String, TargetSpec> = store
        .saved_targets()
        .await?
        .into_iter()
        .filter_map(|(id, v)| serde_json::from_value(v).ok().map(|s| (id, s)))
        .collect();
    // Targets removed while the router was down follow `on_target_removed` as at a reload;
    // entries that cannot drain (no configuration known, or one that cannot start: its secret
    // gone too, say) go to the DLQ as `target_removed` with why, instead of staying queued
    // with no worker and no way out.
    let mut to_start: Vec<TargetSpec> = rules.targets.values().cloned().collect();
    let mut removed: Vec<(String, Option<TargetSpec>, String)> = Vec::new();
    let dead_letter = matches!(
        cfg.delivery.on_target_removed,
        crate::config::OnTargetRemoved::DeadLetter
    );
    for id in store.targets_with_entries() {
        if !rules.targets.contains_key(&id) {
            match saved.get(&id) {
                Some(spec) if dead_letter => {
                    removed.push((id, Some(spec.clone()), TARGET_REMOVED.to_string()))
                }
                // Listed in /v1/status while it drains (`removed_target_warnings`).
                Some(spec) => to_start.push(spec.clone()),
                None => removed.push((
                    id,
                    None,
                    format!("{TARGET_REMOVED}, and no configuration of it is known to drain its queue under"),
                )),
            }
        }
    }
    // The saved states are read once for every target started here, not once each.
    let states = crate::deliver::StoredStates::default();
    for spec in to_start {
        let id = spec.id.clone();
        let last = (!rules.targets.contains_key(&id)).then(|| spec.clone());
        if let Err(e) = dispatcher.ensure_with(spec, &states).await {
            match last {
                Some(spec) => {
                    removed.push((
                        id,
                        Some(spec),
                        format!("{TARGET_REMOVED}, and its last configuration cannot start: {e}"),
                    ));
                }
                None => {
                    let e = format!("{e}; no worker runs: its entries wait in its queue");
                    tracing::warn!("{e}");
                    rule_warnings.push(e);
                }
            }
        }
    }
    // A policy changed while the router was down applies as at a reload: the workers are
    // started (their ordering set), the keys the live policies no longer hold are released.
    rule_warnings.extend(release_keys_no_longer_held(store.as_ref(), rules.targets.values()).await);
    dispatcher.start_reaper();

    let disabled = DisabledRules::from_states(&store.target_states().await?);
    let initial_status = ReloadStatus {
        rules_version: rules.version.clone(),
        rules_git_commit: crate::rules::watch::git_commit(&cfg.rules_dir),
        contracts_version: contracts.version(),
        loaded_at: crate::clock::rfc3339(clock.now_ms()),
        last_attempt_at: crate::clock::rfc3339(clock.now_ms()),
        last_trigger: "start".into(),
        ..Default::default()
    };
    let data_dir = cfg.data_dir.clone();
    let ingest_admission = crate::ingest::admission::Admission::new(
        crate::ingest::admission::Bounds::of(&cfg.ingest),
        metrics.ingest_refusals(),
    );
    let connections = Arc::new(ConnectionSlots::new(
        cfg.server.connection_limit(),
        "server.max_connections",
        metrics.http_connections_refused.clone(),
    ));
    let app = Arc::new(App {
        started_at: clock.now_ms(),
        cfg,
        store: store.clone(),
        rules: ArcSwap::from_pointee(rules),
        contracts: ArcSwap::from_pointee(contracts),
        metrics,
        clock,
        dispatcher,
        ready: AtomicBool::new(false),
        warnings: Mutex::new(warnings),
        rule_warnings: Mutex::new(rule_warnings),
        reload_status: Mutex::new(initial_status),
        reload_lock: tokio::sync::Mutex::new(()),
        jobs: if store.shared() {
            crate::dlq::Jobs::shared(node_id(&data_dir)?)
        } else {
            crate::dlq::Jobs::default()
        },
        disabled: ArcSwap::from_pointee(disabled),
        tokens: ArcSwap::from_pointee(tokens),
        ingest_limiters: ArcSwap::from_pointee(ingest_limiters),
        disk_full: AtomicBool::new(false),
        ingest_admission,
        connections,
        ops: ops.as_ref().map(|(_, endpoint, _)| endpoint.clone()),
        upload_slots: Arc::new(tokio::sync::Semaphore::new(UPLOAD_SLOTS)),
        handlers: handlers.clone(),
        handlers_error,
        shared_contracts: store
            .contract_catalog()
            .map(|c| Arc::new(crate::admin::contracts::SharedContracts::open(c, &data_dir))),
        delivery_threads: delivery_status,
    });
    // On a shared store, take in the contracts uploaded while this node was down before
    // anything checks events against them: before ingest is served and before handlers'
    // emitted events are routed (their deliveries wait for `prepare`), else events of a new
    // version would be quarantined here as `unknown_version`, for good.
    let (first_sync, synced) = tokio::sync::oneshot::channel();
    tracker.spawn(crate::admin::contracts::follow(
        app.clone(),
        workers_cancel.clone(),
        first_sync,
    ));
    if app.shared_contracts.is_some()
        && tokio::time::timeout(crate::admin::contracts::FIRST_SYNC_WAIT, synced)
            .await
            .is_err()
    {
        tracing::warn!(wait = ?crate::admin::contracts::FIRST_SYNC_WAIT, "the shared contracts were not synced in time; serving with this node's directory, and syncing them in the background");
    }
    if let Some(rt) = &handlers {
        let weak = Arc::downgrade(&app);
        let prepare: crate::target::handler::Prepare = Arc::new(move |emitter, events, now| {
            weak.upgrade()
                .map(|app| prepare_emitted(&app, emitter, events, now))
        });
        let _ = rt.prepare.set(prepare);
    }
    for (id, spec, why) in removed {
        app.warnings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(format!("target {id} is no longer in the rules; its queued entries went to the DLQ as target_removed ({why})"));
        let grace = removal_grace(&app.cfg, spec.as_ref());
        dead_letter_removed(&app, &id, why, grace).await;
    }
    crate::dlq::resume_all(&app, &tracker, workers_cancel.clone()).await?;
    spawn_reload_triggers(&app, &tracker, workers_cancel.clone());
    spawn_operator_state_follower(&app, &tracker, workers_cancel.clone());
    spawn_node_announcer(&app, &tracker, workers_cancel.clone());
    spawn_sweeper(&app, &tracker, workers_cancel.clone());
    spawn_retirer(&app, &tracker, workers_cancel.clone());
    spawn_disk_monitor(&app, &tracker, workers_cancel.clone());
    // System events outlive delivery: the attempts that end during the shutdown's grace
    // period still raise theirs, and the task announces what is left when it is cancelled,
    // after delivery has stopped (or when `run` returns any other way: the guard).
    let sys_tracker = TaskTracker::new();
    let sys_cancel = CancellationToken::new();
    let _sys_guard = sys_cancel.clone().drop_guard();
    crate::system_events::spawn_router(&app, &sys_tracker, sys_cancel.clone(), sys_rx);

    let router = Router::new()
        .route("/v1/events", post(crate::ingest::post_events))
        .route("/v1/events/{id}", get(crate::admin::event_fate))
        .route("/v1/dlq", get(crate::admin::dlq_list))
        .route("/v1/dlq/summary", get(crate::admin::dlq_summary))
        .route("/v1/dlq/purge", post(crate::admin::dlq_purge))
        .route(
            "/v1/dlq/redrive",
            post(crate::admin::redrive_create).get(crate::admin::jobs_list),
        )
        .route("/v1/dlq/redrive/{job}", get(crate::admin::job_show))
        .route(
            "/v1/dlq/redrive/{job}/{action}",
            post(crate::admin::job_control),
        )
        .route(
            "/v1/replay",
            post(crate::admin::replay_create).get(crate::admin::jobs_list),
        )
        .route("/v1/replay/{job}", get(crate::admin::job_show))
        .route("/v1/replay/{job}/{action}", post(crate::admin::job_control))
        .route(
            "/v1/rules/{name}/{action}",
            post(crate::admin::rule_control),
        )
        .route("/v1/dlq/{id}", get(crate::admin::dlq_show))
        .route("/v1/targets", get(crate::admin::targets::targets))
        .route("/v1/targets/{id}", get(crate::admin::target))
        .route("/v1/targets/{id}/pause", post(crate::admin::pause_target))
        .route("/v1/targets/{id}/resume", post(crate::admin::resume_target))
        .route(
            "/v1/targets/{id}/keys/{key}/release",
            post(crate::admin::release_key),
        )
        .route("/v1/rules", get(crate::admin::rules))
        .route("/v1/contracts", get(crate::admin::contracts::list))
        .route(
            "/v1/contracts/{type}/{version}",
            get(crate::admin::contracts::show).put(crate::admin::contracts::upload),
        )
        .route("/v1/rules/test", post(crate::admin::rules_test))
        .route("/v1/admin/reload", post(crate::admin::reload))
        .route("/v1/status", get(crate::admin::status))
        .route("/metrics", get(crate::admin::metrics))
        .route("/v1/handlers", get(crate::admin::handlers::list))
        .route(
            "/v1/handlers/{name}",
            get(crate::admin::handlers::show)
                .put(crate::admin::handlers::upload)
                .delete(crate::admin::handlers::delete)
                .layer(axum::extract::DefaultBodyLimit::max(
                    app.cfg.handlers.max_upload_bytes,
                )),
        )
        .route(
            "/v1/handlers/{name}/rollback",
            post(crate::admin::handlers::rollback),
        )
        .route(
            "/v1/handlers/{name}/logs",
            get(crate::admin::handlers::logs),
        )
        .route("/healthz", get(crate::admin::healthz))
        .route("/readyz", get(crate::admin::readyz));
    let router = with_api_layers(router, &app, guard);
    // `server.ops_listen`: the probes and the scrape on their own connections, served until
    // `run` returns (through the shutdown's grace period, where /readyz answers 503).
    let _ops_stop = ops.map(|(listener, endpoint, guard)| {
        let routes = Router::new()
            .route("/healthz", get(crate::admin::healthz))
            .route("/readyz", get(crate::admin::readyz))
            .route("/metrics", get(crate::admin::metrics));
        let router = with_api_layers(routes, &app, guard);
        let stop = CancellationToken::new();
        let (app, cancel) = (app.clone(), stop.clone());
        // Before the main address's line, which tells a supervisor (and the tests) the router
        // is up.
        tracing::info!(listen = %endpoint.addr, "ops address listening (/healthz, /readyz, /metrics)");
        tokio::spawn(async move {
            serve(listener, router, &app.cfg.server, endpoint.connections, cancel).await;
        });
        stop.drop_guard()
    });

    app.ready.store(true, Ordering::SeqCst);
    tracing::info!(listen = %listener.local_addr()?, "router listening");
    serve(
        listener,
        router,
        &app.cfg.server,
        app.connections.clone(),
        shutdown.clone(),
    )
    .await;

    // Ingest has stopped. Let in-flight attempts finish within the grace period, then stop.
    app.ready.store(false, Ordering::SeqCst);
    tracing::info!(grace = ?app.cfg.shutdown_grace, "shutting down: finishing in-flight attempts");
    workers_cancel.cancel();
    tracker.close();
    if tokio::time::timeout(app.cfg.shutdown_grace, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!("grace period over; unfinished attempts will be retried after restart");
    }
    // No handler change after this: an upload whose client gave up may still be compiling on
    // a blocking thread, and activated itself after `stopped` (`main` does not wait for it).
    // `close` waits only for a change being written (file writes, or a catalog version being
    // loaded), bounded all the same.
    if let Some(h) = &app.handlers {
        let registry = h.registry.clone();
        let close = tokio::task::spawn_blocking(move || registry.close());
        if tokio::time::timeout(Duration::from_secs(5), close)
            .await
            .is_err()
        {
            tracing::warn!("a handler change still being written did not finish within 5 s");
        }
    }
    sys_cancel.cancel();
    sys_tracker.close();
    if tokio::time::timeout(Duration::from_secs(10), sys_tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            "the last system events were not all stored within 10 s; the DLQ and its metrics have every dead letter"
        );
    }
    // The last write is done: the embedded store closes its file, so the next start opens it
    // without a repair.
    if let Err(e) = app.store.close().await {
        tracing::warn!(error = %e, "the store did not close cleanly; it is checked at the next start");
    }
    if app.store.shared() {
        // The others take back this node's share of every throttle rate at once.
        match tokio::time::timeout(Duration::from_secs(2), app.store.retire_node()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot withdraw this node's announcement; the others stop counting it within 15 s")
            }
            Err(_) => tracing::warn!(
                "withdrawing this node's announcement timed out; the others stop counting it within 15 s"
            ),
        }
    }
    tracing::info!("stopped");
    Ok(())
}

/// Handler uploads read or compiled at once (`App::upload_slots`).
const UPLOAD_SLOTS: usize = 2;

/// One of `App::upload_slots`, in an upload request's extensions: the request holds it while
/// its body is read (a client that goes away then frees it), and the upload route takes it
/// ([`Self::take`]) into the compilation, which holds it to its end whether or not the client
/// still waits (`HandlerChanges::upload_holding`).
#[derive(Clone)]
pub struct UploadSlot(Arc<Mutex<Option<tokio::sync::OwnedSemaphorePermit>>>);

impl UploadSlot {
    fn new(permit: tokio::sync::OwnedSemaphorePermit) -> Self {
        Self(Arc::new(Mutex::new(Some(permit))))
    }

    /// The permit, once (`None` after).
    pub fn take(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// `Retry-After` of an upload that found every slot taken for a whole request timeout.
const UPLOAD_BUSY_RETRY_AFTER_S: u64 = 5;

/// Largest request body of the API's routes other than ingest (which has its own limit) and
/// handler uploads (`handlers.max_upload_bytes`).
const API_BODY_LIMIT: usize = 2 << 20;

/// Reads the body of every API request but ingest's before its handler runs, after the auth
/// layer let it through: at most the route's limit (413), within `server.request_timeout`
/// (408), so that a slow or huge body holds neither a task nor memory for long. Handler
/// uploads also wait for one of `UPLOAD_SLOTS`, held until the upload is compiled, once what
/// their path, token and headers decide has let them through
/// (`admin::handlers::refuse_upload_early`).
async fn bounded_body(
    axum::extract::State(app): axum::extract::State<Arc<App>>,
    matched: Option<axum::extract::MatchedPath>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let route = matched.as_ref().map_or("", |m| m.as_str());
    // HEAD is answered by the GET route: no body, and the GET's query parameters.
    if matches!(
        *req.method(),
        axum::http::Method::GET | axum::http::Method::HEAD
    ) {
        return next.run(req).await;
    }
    // The API's changes take no query parameters but `release` on a handler's delete and
    // `team` on its upload (whose body is the component; each handler checks its own): one
    // sent anyway (`?dry_run=true` on a purge) would be ignored and the change made as if it
    // were not there, so it is refused and nothing changes. Ingest takes none either (the
    // CloudEvents binding carries everything in headers and body): a producer's
    // `?dry_run=true` or `?validate=true` stored real events.
    let takes_query = route == "/v1/handlers/{name}"
        && matches!(
            *req.method(),
            axum::http::Method::DELETE | axum::http::Method::PUT
        );
    if !takes_query && let Some(query) = req.uri().query().filter(|q| !q.is_empty()) {
        let name = form_urlencoded::parse(query.as_bytes())
            .next()
            .map_or_else(String::new, |(k, _)| crate::event::pointer_token(&k));
        return crate::ingest::error_response(
            axum::http::StatusCode::BAD_REQUEST,
            "invalid query",
            vec![crate::event::FieldError::new(
                format!("/{name}"),
                if route == "/v1/events" {
                    "POST /v1/events takes no query parameters: an event's attributes go in its JSON (or its ce-* headers)".to_string()
                } else {
                    format!(
                        "{} {route} takes no query parameters; put options in the JSON body",
                        req.method()
                    )
                },
            )],
        );
    }
    // Ingest reads its own body, under its own limit and admission.
    if route == "/v1/events" {
        return next.run(req).await;
    }
    // No body is decoded, here as at ingest: a compressed component or contract would be
    // refused as invalid, saying nothing of the real cause.
    if let Some(refused) = crate::ingest::parse::coding_refused(req.headers()) {
        return crate::ingest::error_response(
            axum::http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
            crate::ingest::parse::UNSUPPORTED_CODING,
            vec![refused],
        );
    }
    let upload = req.method() == axum::http::Method::PUT && route == "/v1/handlers/{name}";
    // A change's body is JSON, or there is none (a handler upload's is the component): what a
    // web page can send without a CORS preflight is never JSON (`guard`).
    if !upload && let Err(r) = crate::guard::check_body_type(req.headers(), None) {
        return *r;
    }
    // What an upload is refused for from its path, token and headers is answered before it
    // takes a slot or its body is read: a token the owner check refuses, or a body declared
    // too large, must not hold a slot (or the connection) for a request timeout.
    if upload && let Some(refused) = crate::admin::handlers::refuse_upload_early(&app, &req) {
        return refused;
    }
    // An upload waits for a slot at most as long as its body may take to arrive: past that,
    // the slots are held by other uploads (slow bodies, long compilations), and the uploader
    // is told to come back rather than left hanging. The semaphore is never closed.
    let mut req = req;
    if upload {
        match tokio::time::timeout(
            app.cfg.server.request_timeout,
            app.upload_slots.clone().acquire_owned(),
        )
        .await
        {
            // Held by the request while its body is read, then handed to the compilation.
            Ok(Ok(slot)) => {
                req.extensions_mut().insert(UploadSlot::new(slot));
            }
            _ => {
                return crate::ingest::with_retry_after(
                    crate::ingest::error_response(
                        axum::http::StatusCode::SERVICE_UNAVAILABLE,
                        "every handler upload slot is taken by other uploads; try again shortly",
                        vec![crate::event::FieldError::new(
                            "",
                            format!(
                                "{UPLOAD_SLOTS} uploads are read or compiled at once, and none finished within {:?}",
                                app.cfg.server.request_timeout
                            ),
                        )],
                    ),
                    UPLOAD_BUSY_RETRY_AFTER_S,
                );
            }
        }
    }
    let limit = if upload {
        app.cfg.handlers.max_upload_bytes
    } else {
        API_BODY_LIMIT
    };
    let (parts, body) = req.into_parts();
    let bytes = match crate::ingest::read_bounded(body, limit, app.cfg.server.request_timeout).await
    {
        Ok(b) => b,
        // A component past the upload limit is told the key that sets it, not ingest's text.
        Err(resp) if upload && resp.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE => {
            return crate::admin::handlers::upload_too_large(limit);
        }
        Err(resp) => return *resp,
    };
    if !upload && let Err(r) = crate::guard::check_body_type(&parts.headers, Some(bytes.len())) {
        return *r;
    }
    next.run(axum::extract::Request::from_parts(
        parts,
        axum::body::Body::from(bytes),
    ))
    .await
}

/// A request answered before its body was read to the end (a 401 or 403, a handler name
/// that is not valid, a body past its limit) leaves the rest of that body on the connection:
/// hyper then closes the connection after the answer rather than read an unbounded body, and
/// a client that kept it for its next request, told nothing, sees that request fail with the
/// connection closed under it. Such an answer says `Connection: close`, so the client opens a
/// new connection instead.
async fn close_if_body_unread(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::body::HttpBody as _;
    if req.body().is_end_stream() {
        return next.run(req).await;
    }
    let read = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (parts, body) = req.into_parts();
    let body = axum::body::Body::new(WatchedBody {
        inner: body,
        read: read.clone(),
    });
    let mut resp = next
        .run(axum::extract::Request::from_parts(parts, body))
        .await;
    if !read.load(Ordering::SeqCst) {
        resp.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
    }
    resp
}

/// A request body that records whether it was read to its end ([`close_if_body_unread`]).
struct WatchedBody {
    inner: axum::body::Body,
    read: Arc<std::sync::atomic::AtomicBool>,
}

impl http_body::Body for WatchedBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        let ended = match &polled {
            std::task::Poll::Ready(None) => true,
            std::task::Poll::Ready(Some(Ok(_))) => self.inner.is_end_stream(),
            _ => false,
        };
        if ended {
            self.read.store(true, Ordering::SeqCst);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Extractor rejections (a query string that does not parse, a missing body) come from axum as
/// plain text; every error of the API is the JSON error shape, so they are converted.
/// So are axum's own answers without a body: an unknown path (404) and a method the route
/// does not have (405, whose `Allow` header is kept).
async fn json_rejections(
    method: axum::http::Method,
    resp: axum::response::Response,
) -> axum::response::Response {
    let content_type = resp
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let plain = content_type.is_some_and(|c| c.starts_with("text/plain"));
    if !(resp.status().is_client_error() && (plain || content_type.is_none())) {
        return resp;
    }
    let status = resp.status();
    let allow = resp.headers().get(axum::http::header::ALLOW).cloned();
    let body = axum::body::to_bytes(resp.into_body(), 64 * 1024)
        .await
        .unwrap_or_default();
    let (summary, message) = match status {
        axum::http::StatusCode::NOT_FOUND if body.is_empty() => (
            "no such route",
            "see schemas/openapi.yaml for the API".to_string(),
        ),
        // The route's `Allow` header is added by axum around this layer, after it: the
        // message names the method refused and points at that header.
        axum::http::StatusCode::METHOD_NOT_ALLOWED if body.is_empty() => (
            "method not allowed",
            match allow.as_ref().and_then(|a| a.to_str().ok()) {
                Some(allowed) => format!("this route takes {allowed}, not {method}"),
                None => format!(
                    "this route does not take {method}; its Allow header lists the methods it takes"
                ),
            },
        ),
        _ => (
            "invalid request",
            String::from_utf8_lossy(&body).into_owned(),
        ),
    };
    let mut r = crate::ingest::error_response(
        status,
        summary,
        vec![crate::event::FieldError::new("", message)],
    );
    if let Some(a) = allow {
        r.headers_mut().insert(axum::http::header::ALLOW, a);
    }
    r
}

/// The API's middleware around `routes`, outermost first: JSON rejections and unread bodies;
/// the web-page guard; authentication; the bounded body (after auth, so a body is only read
/// for a caller allowed to send it).
fn with_api_layers(
    routes: Router<Arc<App>>,
    app: &Arc<App>,
    guard: crate::guard::RequestGuard,
) -> Router {
    routes
        .route_layer(axum::middleware::from_fn_with_state(
            app.clone(),
            bounded_body,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            app.clone(),
            crate::auth::layer,
        ))
        // Outer: a web page's request is refused before anything else looks at it.
        .route_layer(axum::middleware::from_fn_with_state(
            Arc::new(guard),
            crate::guard::layer,
        ))
        .layer(axum::middleware::map_response(json_rejections))
        .layer(axum::middleware::from_fn(close_if_body_unread))
        .with_state(app.clone())
}

/// The probes-and-scrapes address (`server.ops_listen`) as bound, and its connections.
#[derive(Debug, Clone)]
pub struct OpsEndpoint {
    /// The address as bound (its port when the configured one was 0).
    pub addr: std::net::SocketAddr,
    /// Its connections, against `server.ops_max_connections`.
    pub connections: Arc<ConnectionSlots>,
}

/// Binds `server.ops_listen` when set. Like the main address, a non-loopback one needs tokens
/// or `auth.insecure`: `/metrics` names every target.
async fn bind_ops(
    cfg: &Config,
    auth_on: bool,
    metrics: &Metrics,
) -> Result<Option<(TcpListener, OpsEndpoint)>, RunError> {
    let Some(addr) = cfg.server.ops_listen else {
        return Ok(None);
    };
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| RunError::OpsListen { addr, source })?;
    let local = listener.local_addr()?;
    if !auth_on && !local.ip().is_loopback() && !cfg.auth.insecure {
        return Err(RunError::Insecure(local));
    }
    let connections = Arc::new(ConnectionSlots::new(
        cfg.server.ops_max_connections,
        "server.ops_max_connections",
        metrics.http_ops_connections_refused.clone(),
    ));
    Ok(Some((
        listener,
        OpsEndpoint {
            addr: local,
            connections,
        },
    )))
}

/// The client connections the HTTP server holds, against `server.max_connections`: one
/// client could otherwise open connections until the process ran out of file descriptors
/// (audited: 20,000 slow-body connections, then `accept failed: Too many open files`), and
/// the store and the deliveries with it.
#[derive(Debug)]
pub struct ConnectionSlots {
    permits: Arc<tokio::sync::Semaphore>,
    limit: usize,
    /// The configuration key of `limit`, which a refusal names.
    key: &'static str,
    /// Connections answered 503 and closed for want of a slot (`router_http_connections_refused`).
    refused: prometheus_client::metrics::counter::Counter,
    /// Refusals being written: bounded too, or a flood of refused connections would hold
    /// the descriptors the limit keeps.
    refusing: Arc<tokio::sync::Semaphore>,
}

/// Refused connections answered at once; past it a refused connection is closed unanswered.
const REFUSALS_AT_ONCE: usize = 256;

impl ConnectionSlots {
    /// Room for `limit` connections (at least 1), set by the configuration key `key`;
    /// refusals count in `refused`.
    pub fn new(
        limit: usize,
        key: &'static str,
        refused: prometheus_client::metrics::counter::Counter,
    ) -> Self {
        let limit = limit.clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
        Self {
            permits: Arc::new(tokio::sync::Semaphore::new(limit)),
            limit,
            key,
            refused,
            refusing: Arc::new(tokio::sync::Semaphore::new(REFUSALS_AT_ONCE)),
        }
    }

    /// `server.max_connections` as applied.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.limit.saturating_sub(self.permits.available_permits())
    }

    /// Connections refused since the start.
    pub fn refused(&self) -> u64 {
        self.refused.get()
    }
}

/// Answers a connection past `server.max_connections`: 503 with `Retry-After` and a JSON body,
/// then closes it. What the client sent is read (and discarded) briefly after the answer, so
/// that closing over unread bytes does not reset the connection before the client reads it.
async fn refuse_connection(mut stream: tokio::net::TcpStream, limit: usize, key: &'static str) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let body = serde_json::json!({
        "error": "too many open connections",
        "errors": [{
            "pointer": "",
            "message": format!("the router holds its limit of {limit} connections ({key}); retry after the indicated time, or reuse a keep-alive connection"),
        }],
    })
    .to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let answer = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 8192];
        let mut read = 0usize;
        while read < 64 * 1024 {
            match stream.read(&mut sink).await? {
                0 => break,
                n => read += n,
            }
        }
        Ok::<_, std::io::Error>(())
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), answer).await;
}

/// The HTTP accept loop: HTTP/1.1 with a header read timeout (slow-loris), a bounded
/// request head and a bounded number of connections; on shutdown, stops accepting and lets
/// open requests finish.
async fn serve(
    listener: TcpListener,
    router: Router,
    cfg: &crate::config::ServerConfig,
    slots: Arc<ConnectionSlots>,
    shutdown: CancellationToken,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let (stream, _) = tokio::select! {
            _ = shutdown.cancelled() => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = slots.permits.clone().try_acquire_owned() else {
            let refused = slots.refused.inc();
            if refused.is_multiple_of(1000) {
                tracing::warn!(
                    limit = slots.limit,
                    key = slots.key,
                    refused = refused + 1,
                    "connection refused: limit of open connections reached (503); logged once per 1000"
                );
            }
            if let Ok(refusing) = slots.refusing.clone().try_acquire_owned() {
                let (limit, key) = (slots.limit, slots.key);
                tokio::spawn(async move {
                    refuse_connection(stream, limit, key).await;
                    drop(refusing);
                });
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let svc = hyper_util::service::TowerToHyperService::new(router.clone());
        // `max_header_size` is the limit on the request head; `max_buf_size` only bounds the
        // read buffer, which a read can overshoot (alone it let heads of 110,000 bytes through
        // a limit of 65536, reproduced). The buffer keeps room past the limit so that a head a
        // little over it can be read whole and answered 431, rather than the connection
        // closed on unread bytes (a reset the client may see instead of the answer). hyper
        // answers that 431 itself, without a body.
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(cfg.header_read_timeout)
            .max_header_size(cfg.max_header_bytes)
            .max_buf_size(cfg.max_header_bytes.saturating_add(8192).max(8192))
            .serve_connection(TokioIo::new(stream), svc);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(slot);
        });
    }
    if tokio::time::timeout(Duration::from_secs(10), graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("open HTTP connections did not finish within 10s");
    }
}

/// Watches the store's size against its high-water mark: past it, ingest answers 503 (delivery
/// goes on and drains); below the low-water mark, ingest resumes.
fn spawn_disk_monitor(app: &Arc<App>, tracker: &TaskTracker, cancel: CancellationToken) {
    let app = app.clone();
    tracker.spawn(async move {
        let high = app.cfg.store.max_disk_bytes;
        if high == 0 {
            return;
        }
        let low = (high as f64 * app.cfg.store.low_water_fraction) as u64;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            // Unknown (the store out of reach): the mark stays where it was.
            let Some(used) = app.store.disk_bytes().await else {
                continue;
            };
            let full = app.disk_full.load(Ordering::Relaxed);
            if !full && used > high {
                app.disk_full.store(true, Ordering::Relaxed);
                tracing::error!(used, high, "store past its disk high-water mark: ingest answers 503 until it is below the low-water mark");
            } else if full && used < low {
                app.disk_full.store(false, Ordering::Relaxed);
                tracing::warn!(used, low, "store below its low-water mark: ingest resumes");
            }
        }
    });
}

fn spawn_sweeper(app: &Arc<App>, tracker: &TaskTracker, cancel: CancellationToken) {
    let app = app.clone();
    tracker.spawn(async move {
        let every = app.cfg.delivery.sweep_interval;
        let window = i64::try_from(app.cfg.ingest.dedup_window.as_millis()).unwrap_or(i64::MAX);
        let retention = i64::try_from(app.cfg.event_retention().as_millis()).unwrap_or(i64::MAX);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(every) => {}
            }
            // Finished jobs past their retention: a few records, once per interval.
            match crate::dlq::sweep_jobs(&app, app.clock.now_ms(), app.cfg.delivery.job_retention)
                .await
            {
                Ok(0) => {}
                Ok(n) => {
                    app.metrics
                        .swept
                        .get_or_create(&vec![("kind", "job".to_string())])
                        .inc_by(n);
                }
                Err(e) => tracing::warn!(error = %e, "sweeping finished jobs failed; the next sweep tries again"),
            }
            // Sweep in bounded batches until caught up, resting between them as long as the
            // batch took: the committer that ingest waits on is then never more than half
            // busy with deleting (back to back, the batches after a busy interval held up
            // every ingest commit for seconds; docs/BENCHMARKS.md, eleventh session). Half of
            // the committer still deletes several times faster than events arrive.
            loop {
                let started = std::time::Instant::now();
                let swept = app.store.sweep(app.clock.now_ms(), window, retention).await;
                let took = started.elapsed();
                match swept {
                    Ok(s) => {
                        for (kind, n) in [
                            ("dedup_key", s.dedup_expired),
                            ("event", s.events_removed),
                            ("completed", s.completed_expired),
                            ("kv", s.kv_expired),
                        ] {
                            if n > 0 {
                                app.metrics
                                    .swept
                                    .get_or_create(&vec![("kind", kind.to_string())])
                                    .inc_by(n);
                            }
                        }
                        if s.dedup_expired + s.events_removed + s.completed_expired + s.kv_expired
                            > 0
                        {
                            tracing::debug!(
                                dedup_expired = s.dedup_expired,
                                events_removed = s.events_removed,
                                completed_expired = s.completed_expired,
                                kv_expired = s.kv_expired,
                                "swept"
                            );
                        }
                        if !s.more || cancel.is_cancelled() {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "sweep failed");
                        break;
                    }
                }
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(took) => {}
                }
            }
            tokio::time::sleep(Duration::ZERO).await;
        }
    });
}

/// A configuration for unit tests with its directories under `dir`: one rule `r` routing type
/// `t` to webhook target `hook` (so a reload saves a target configuration in the store), an
/// empty contracts directory and a data directory.
#[cfg(test)]
pub(crate) fn test_config(dir: &std::path::Path) -> Config {
    let rules = dir.join("rules");
    std::fs::create_dir_all(&rules).expect("rules dir");
    std::fs::write(
        rules.join("r.yaml"),
        "rules:\n  - name: r\n    pattern:\n      type: [t]\n    targets:\n      - webhook: http://127.0.0.1:9/\n        id: hook\n",
    )
    .expect("rules");
    let cfg = Config {
        rules_dir: rules,
        contracts_dir: dir.join("contracts"),
        data_dir: dir.join("data"),
        ..Default::default()
    };
    std::fs::create_dir_all(&cfg.contracts_dir).expect("contracts dir");
    std::fs::create_dir_all(&cfg.data_dir).expect("data dir");
    cfg
}

/// An [`App`] for unit tests of the API's handlers and followers, assembled as
/// [`run_with_store`] does it but without serving, resuming jobs or starting any target.
#[cfg(test)]
pub(crate) fn test_app(
    cfg: Config,
    store: Arc<dyn Store>,
    shared_contracts: Option<Arc<crate::admin::contracts::SharedContracts>>,
) -> Arc<App> {
    test_app_with(cfg, store, shared_contracts, None)
}

/// A [`test_app`] whose delivery raises its system events into a channel of 1024 (as
/// [`run_with_store`]'s does), returned beside it.
#[cfg(test)]
pub(crate) fn test_app_raising(
    cfg: Config,
    store: Arc<dyn Store>,
) -> (
    Arc<App>,
    tokio::sync::mpsc::Receiver<crate::event::CloudEvent>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(1024);
    (test_app_with(cfg, store, None, Some(tx)), rx)
}

#[cfg(test)]
fn test_app_with(
    cfg: Config,
    store: Arc<dyn Store>,
    shared_contracts: Option<Arc<crate::admin::contracts::SharedContracts>>,
    system_events: Option<tokio::sync::mpsc::Sender<crate::event::CloudEvent>>,
) -> Arc<App> {
    let (rules, warnings) = load_rules(&cfg).expect("the test's rules load");
    let contracts = load_contracts(&cfg).expect("the test's contracts load");
    let metrics = Metrics::new();
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let spawner = tokio::runtime::Handle::current();
    let secrets = secret_resolver(&cfg, None).expect("the test's secrets file reads");
    let dispatcher = Dispatcher::new(DeliveryContext {
        store: store.clone(),
        metrics: metrics.clone(),
        clock: clock.clone(),
        cfg: cfg.delivery.clone(),
        http: crate::target::webhook::shared_clients(None).expect("http clients"),
        nats: crate::target::nats::NatsConnection::new(
            cfg.nats.clone(),
            secrets.clone(),
            spawner.clone(),
        ),
        cancel: CancellationToken::new(),
        tracker: TaskTracker::new(),
        spawner,
        system_events,
        secrets,
        // The tests' resolver reads any name (above).
        secrets_env_prefix: None,
        handlers: None,
        log_gates: Default::default(),
        unannounced: Default::default(),
        store_faults: Default::default(),
        in_flight: crate::deliver::in_flight::InFlightCap::of(&cfg.delivery, &metrics),
        bytes: crate::deliver::bytes::BytePool::of(&cfg, &metrics),
    });
    let now = clock.now_ms();
    let ingest_admission = crate::ingest::admission::Admission::new(
        crate::ingest::admission::Bounds::of(&cfg.ingest),
        metrics.ingest_refusals(),
    );
    let connections = Arc::new(ConnectionSlots::new(
        cfg.server.connection_limit(),
        "server.max_connections",
        metrics.http_connections_refused.clone(),
    ));
    Arc::new(App {
        started_at: now,
        reload_status: Mutex::new(ReloadStatus {
            rules_version: rules.version.clone(),
            contracts_version: contracts.version(),
            loaded_at: crate::clock::rfc3339(now),
            ..Default::default()
        }),
        cfg,
        store,
        rules: ArcSwap::from_pointee(rules),
        contracts: ArcSwap::from_pointee(contracts),
        metrics,
        clock,
        dispatcher,
        ready: AtomicBool::new(true),
        warnings: Mutex::new(Vec::new()),
        rule_warnings: Mutex::new(warnings),
        reload_lock: tokio::sync::Mutex::new(()),
        jobs: crate::dlq::Jobs::default(),
        disabled: ArcSwap::from_pointee(DisabledRules::default()),
        tokens: ArcSwap::from_pointee(crate::auth::Tokens::new(&[]).expect("no tokens")),
        ingest_limiters: ArcSwap::from_pointee(IngestLimiters::new()),
        disk_full: AtomicBool::new(false),
        ingest_admission,
        connections,
        ops: None,
        upload_slots: Arc::new(tokio::sync::Semaphore::new(UPLOAD_SLOTS)),
        handlers: None,
        handlers_error: None,
        shared_contracts,
        delivery_threads: crate::deliver::DeliveryThreadsStatus {
            threads: 1,
            nice: None,
            error: None,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fault::SimulatedDisk;
    use crate::store::{DlqReason, RedbStore, StoreOptions};

    /// The operators' switches read back from the stored target states: a disabled rule with
    /// its when and who, an old boolean-only record, and neither an enabled switch nor a
    /// paused target's record nor an unreadable value.
    #[test]
    fn disabled_rules_are_read_from_the_stored_switches() {
        let states = vec![
            (
                "rule:orders".to_string(),
                serde_json::json!({"disabled": true, "disabled_at": "2026-12-07T09:00:00.000Z", "disabled_by": "ops"}),
            ),
            (
                "rule:old".to_string(),
                serde_json::json!({"disabled": true}),
            ),
            (
                "rule:back".to_string(),
                serde_json::json!({"disabled": false}),
            ),
            ("rule:junk".to_string(), serde_json::json!("disabled")),
            (
                "pause:orders".to_string(),
                serde_json::json!({"paused": true}),
            ),
        ];
        let d = DisabledRules::from_states(&states);
        let mut names: Vec<_> = d.names().cloned().collect();
        names.sort();
        assert_eq!(names, ["old", "orders"]);
        assert!(d.contains("orders") && !d.contains("back") && !d.contains("junk"));
        let orders = d.get("orders").expect("orders");
        assert_eq!(orders.disabled_by.as_deref(), Some("ops"));
        assert_eq!(
            orders.disabled_at.as_deref(),
            Some("2026-12-07T09:00:00.000Z")
        );
        assert_eq!(
            d.get("old"),
            Some(&RuleSwitch {
                disabled: true,
                ..Default::default()
            })
        );
        assert!(DisabledRules::from_states(&[]).is_empty());
    }

    /// `main` prints a start error with its sources (`{e:#}`): every variant that has a
    /// source says its message once. Before, `Auth`, `Store`, `Serve` and `Client` put their
    /// source's message in their own as well, and a config mistake was printed twice.
    #[test]
    fn a_start_error_says_each_thing_once() {
        let token = crate::auth::Tokens::new(&[crate::auth::TokenConfig {
            name: "shop".into(),
            sha256: "zz".into(),
            scopes: vec!["read".into()],
            rate_per_sec: None,
            team: None,
        }])
        .expect_err("not hex");
        let io = || std::io::Error::new(std::io::ErrorKind::PermissionDenied, "denied here");
        let client = reqwest::Client::builder()
            .user_agent("no\nnewlines")
            .build()
            .expect_err("an invalid header value");
        let cases = [
            (RunError::Auth(token), "auth.tokens[0] (shop)"),
            (
                RunError::Store(StoreError::Backend("disk gone".into())),
                "disk gone",
            ),
            (RunError::Serve(io()), "denied here"),
            (
                RunError::DataDir {
                    dir: "/data".into(),
                    source: io(),
                },
                "denied here",
            ),
            (
                RunError::Client(crate::target::webhook::WebhookError::Client(client)),
                "builder error",
            ),
        ];
        for (e, what) in cases {
            let problems = e.problems();
            let shown = format!("{:#}", anyhow::Error::from(e));
            assert_eq!(shown.matches(what).count(), 1, "{shown}");
            assert_eq!(problems, [shown]);
        }
    }

    /// A handler's emissions are held to its owner's ingest scope, system event types
    /// included: `ingest:*` lets a team send (and emit) any type but `router.*`, which alert
    /// rules route; only `admin` or an `ingest:router.…` pattern covers those, as at ingest.
    #[test]
    fn a_handler_may_not_emit_a_system_event_its_owner_may_not_send() {
        use sha2::Digest as _;
        let token = |name: &str, scopes: &[&str]| crate::auth::TokenConfig {
            name: name.into(),
            sha256: hex::encode(sha2::Sha256::digest(name.as_bytes())),
            scopes: scopes.iter().map(|s| s.to_string()).collect(),
            rate_per_sec: None,
            team: None,
        };
        let tokens = crate::auth::Tokens::new(&[
            token("team", &["ingest:*", "handlers:custom"]),
            token("relay", &["ingest:router.dlq.*", "handlers:custom"]),
            token("ops", &["admin"]),
        ])
        .expect("tokens");
        let by = |owner: &str| crate::target::handler::EmitterOf {
            handler: "custom".into(),
            owner: owner.into(),
            team: None,
            target: "t".into(),
            event_id: "parent".into(),
        };
        let why = emit_scope_error(&tokens, &by("team"), "router.dlq.added")
            .expect("ingest:* does not cover a system event type");
        assert!(
            why.contains("ingest:router.dlq.added") && why.contains("system events"),
            "{why}"
        );
        assert_eq!(
            emit_scope_error(&tokens, &by("team"), "order.created"),
            None
        );
        assert_eq!(
            emit_scope_error(&tokens, &by("relay"), "router.dlq.added"),
            None
        );
        assert!(emit_scope_error(&tokens, &by("relay"), "router.breaker.opened").is_some());
        assert_eq!(
            emit_scope_error(&tokens, &by("ops"), "router.dlq.added"),
            None
        );
        // Preloaded handlers are the operator's own.
        assert_eq!(
            emit_scope_error(&tokens, &by(crate::auth::PRELOAD_OWNER), "router.dlq.added"),
            None
        );
    }

    /// An alert loop through a handler: webhook `a` fails → `router.dlq.added` about `a` →
    /// handler `b` turns it into `ops.page` → routed to `a`, which fails again → … With
    /// system events starting at hop 0 every turn, nothing ended it. Each announcement now
    /// carries its dead letter's hops plus one, so the emissions climb to the hop limit and
    /// the last one goes to the DLQ as `loop_detected`; that dead letter is announced as
    /// about `b`, which therefore never receives it.
    #[tokio::test]
    async fn an_alert_loop_through_a_handler_ends_at_the_hop_limit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = test_config(dir.path());
        std::fs::write(
            cfg.rules_dir.join("r.yaml"),
            "rules:\n  - name: pages\n    pattern:\n      type: [ops.page]\n    targets:\n      - webhook: http://127.0.0.1:9/a\n        id: a\n  - name: alerts\n    pattern:\n      type: [router.dlq.added]\n    targets:\n      - webhook: http://127.0.0.1:9/b\n        id: b\n",
        )
        .expect("rules");
        let store = RedbStore::in_memory().expect("store");
        let (app, mut rx) = test_app_raising(cfg, store);
        let ctx = app.dispatcher.context().clone();
        let emitter = crate::target::handler::EmitterOf {
            handler: "b".into(),
            owner: crate::auth::PRELOAD_OWNER.into(),
            team: None,
            target: "t".into(),
            event_id: "parent".into(),
        };
        let now = app.clock.now_ms();
        let mut page = crate::store::test_events::ev("/producer", "page-0");
        page.ty = "ops.page".into();
        for turn in 0..50 {
            // `a` fails it for good.
            crate::deliver::dead_lettered(
                &ctx,
                Some("a"),
                crate::deliver::DeadEvent::of(&page),
                DlqReason::PermanentError,
                None,
                now,
            );
            let alert = rx.try_recv().expect("router.dlq.added about a");
            assert_eq!(alert.subject.as_deref(), Some("a"));
            assert_eq!(alert.hops(), page.hops() + 1);
            // `b` handles the alert: its emission has one hop more (as the handler target
            // completes it), then re-enters the pipeline.
            let mut emitted = page.clone();
            emitted.id = format!("page-{}", turn + 1);
            emitted
                .extensions
                .insert("hops".into(), serde_json::Value::from(alert.hops() + 1));
            let ne = prepare_emitted(&app, &emitter, vec![emitted.clone()], now)
                .pop()
                .expect("prepared");
            if let Some(q) = ne.quarantine {
                assert_eq!(q.reason, DlqReason::LoopDetected);
                assert!(turn <= 5, "ended after {turn} turns");
                // Its dead letter is about `b`, so it is never routed back to `b`.
                crate::deliver::dead_lettered(
                    &ctx,
                    None,
                    crate::deliver::DeadEvent {
                        emitted_by: Some("b"),
                        ..crate::deliver::DeadEvent::of(&emitted)
                    },
                    q.reason,
                    None,
                    now,
                );
                let last = rx.try_recv().expect("router.dlq.added about b");
                assert_eq!(last.subject.as_deref(), Some("b"));
                assert_eq!(last.data.as_ref().expect("data").value()["emitted_by"], "b");
                let rules = app.rules.load();
                assert!(!crate::system_events::deliverable(&rules, Some("b"), "b"));
                return;
            }
            assert_eq!(ne.targets.len(), 1, "routed to a again");
            page = emitted;
        }
        panic!("the alert loop never ended");
    }

    const SIGNED_RULE: &str = "rules:\n  - name: signed\n    pattern:\n      type: [t]\n    targets:\n      - webhook: http://127.0.0.1:9/signed\n        id: signed\n        secret_env: UNIT_TEST_SECRET_NEVER_SET\n";

    /// With `secrets_env_prefix`, a name a rule file gives is read from the environment only
    /// within the prefix; others come from the secrets file alone. Without it (and for the
    /// operator's own configuration), the environment first.
    #[test]
    fn rule_file_secrets_read_the_environment_only_within_the_prefix() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("secrets.toml");
        std::fs::write(&file, "IN_FILE = \"f\"\nPATH = \"from-file\"\n").expect("secrets");
        let mut cfg = test_config(dir.path());
        cfg.secrets_file = Some(file);
        let path = std::env::var("PATH").expect("PATH is set");
        let open = secret_resolver(&cfg, None).expect("resolver");
        assert_eq!((open.as_ref())("PATH"), Some(path.clone()));
        let fenced = secret_resolver(&cfg, Some("WEBHOOK_".into())).expect("resolver");
        assert_eq!(
            (fenced.as_ref())("PATH").as_deref(),
            Some("from-file"),
            "outside the prefix: the file, never the environment"
        );
        assert_eq!((fenced.as_ref())("IN_FILE").as_deref(), Some("f"));
        let home = secret_resolver(&cfg, Some("PA".into())).expect("resolver");
        assert_eq!((home.as_ref())("PATH"), Some(path), "within the prefix");
        cfg.secrets_env_prefix = "ROUTER_SECRET_".into();
        assert!(cfg.validate().is_err());
        // Empty: any name, the operator's explicit choice.
        cfg.secrets_env_prefix = String::new();
        assert!(cfg.validate().is_ok());
        assert_eq!(cfg.rule_secrets_prefix(), None);
    }

    /// By default a rule file reads only `WEBHOOK_SECRET_…` from the environment: without a
    /// prefix, `headers_env: { X-Copy: ANY_VAR }` sent any variable of the router (another
    /// target's signing secret, the NATS token, cloud credentials) to the URL the rule names.
    #[test]
    fn by_default_rule_files_read_only_prefixed_variables_from_the_environment() {
        let cfg = Config::default();
        assert_eq!(
            cfg.rule_secrets_prefix().as_deref(),
            Some("WEBHOOK_SECRET_")
        );
        let rules = secret_resolver(&cfg, cfg.rule_secrets_prefix()).expect("resolver");
        assert!(std::env::var_os("PATH").is_some());
        assert_eq!((rules.as_ref())("PATH"), None);
        // The operator's own configuration (nats.token_env) names any variable.
        let operator = secret_resolver(&cfg, None).expect("resolver");
        assert!((operator.as_ref())("PATH").is_some());
    }

    /// The start and every reload load the rules with the configuration's secret names: a
    /// rule file naming `nats.token_env`'s variable is refused, at its line.
    #[test]
    fn the_rules_of_a_start_or_reload_cannot_name_the_configurations_secrets() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = test_config(dir.path());
        std::fs::write(
            cfg.rules_dir.join("copy.yaml"),
            "rules:\n  - name: copy\n    pattern: { type: [c] }\n    targets:\n      - webhook: https://team.example/x\n        headers_env: { X-Copy: UNIT_TEST_NATS_TOKEN }\n",
        )
        .expect("rule");
        assert!(load_rules(&cfg).is_ok(), "no NATS token configured");
        cfg.nats.token_env = Some("UNIT_TEST_NATS_TOKEN".into());
        let Err(RunError::Rules { errors, .. }) = load_rules(&cfg) else {
            panic!("the NATS token's variable was accepted in a rule file");
        };
        assert_eq!(errors.len(), 1, "{errors:#?}");
        assert!(
            errors[0].ends_with(
                "copy.yaml:6:32: `headers_env.X-Copy` names `UNIT_TEST_NATS_TOKEN`, which the router's configuration uses (`nats.token_env`): a rule file cannot send the router's own credentials to a webhook"
            ),
            "{errors:#?}"
        );
    }

    /// `nats.token_env` naming a variable that is not set: every connect failed and every
    /// attempt was spent on that (the DLQ in seconds). The `nats:` target now cannot start, as
    /// a webhook without its secret: a reload adding it is refused naming the variable, and
    /// the one after the secret is set starts it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_nats_target_does_not_start_while_its_token_is_not_set() {
        let dir = tempfile::tempdir().expect("tempdir");
        let secrets = dir.path().join("secrets.toml");
        std::fs::write(&secrets, "").expect("secrets file");
        let mut cfg = test_config(dir.path());
        cfg.secrets_file = Some(secrets.clone());
        cfg.nats.token_env = Some("UNIT_TEST_NATS_TOKEN_NEVER_SET".into());
        // Nothing listens there: the started target's background connect fails quietly.
        cfg.nats.url = "nats://127.0.0.1:9".into();
        let disk = SimulatedDisk::new();
        let store =
            RedbStore::with_backend_factory(move || disk.backend(), StoreOptions::default())
                .expect("store");
        let app = test_app(cfg.clone(), store, None);
        std::fs::write(
            cfg.rules_dir.join("bus.yaml"),
            "rules:\n  - name: bus\n    pattern: { type: [t] }\n    targets:\n      - nats: orders.paid\n        id: bus\n",
        )
        .expect("rule");
        let message = reload(&app, "test")
            .await
            .expect_err("its token is not set")
            .to_string();
        assert!(
            message.contains("target bus")
                && message.contains("nats.token_env UNIT_TEST_NATS_TOKEN_NEVER_SET: not set"),
            "{message}"
        );
        assert!(!app.dispatcher.running().iter().any(|s| s.id == "bus"));
        std::fs::write(&secrets, "UNIT_TEST_NATS_TOKEN_NEVER_SET = \"t0ken\"\n")
            .expect("secrets file");
        let report = reload(&app, "test").await.expect("the token is there now");
        assert!(
            report.targets_started.contains(&"bus".to_owned()),
            "{report:?}"
        );
    }

    /// A reload starting many targets reads the stored target states once, not once per
    /// target: each read returns every record, so starting N targets after an outage (every
    /// target with a record) cost N × N. Each new worker still starts from its own record.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reload_reads_the_saved_target_states_once_for_all_its_starts() {
        const N: usize = 40;
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = test_config(dir.path());
        let store =
            RedbStore::open_dir(&dir.path().join("store"), StoreOptions::default()).expect("store");
        let mut rules = String::from("rules:\n");
        for i in 0..N {
            rules.push_str(&format!(
                "  - name: r{i}\n    pattern: {{ source: [/c{i}] }}\n    targets:\n      - webhook: http://127.0.0.1:9/{i}\n        id: c{i}\n"
            ));
            // Every other one paused by an operator, the rest with a breaker record only.
            let state = if i % 2 == 0 {
                (format!("pause:c{i}"), serde_json::json!({ "paused": true }))
            } else {
                (format!("c{i}"), serde_json::json!({ "paused": false }))
            };
            store
                .put_target_state(&state.0, state.1)
                .await
                .expect("state");
        }
        let app = test_app(cfg.clone(), store.clone(), None);
        std::fs::write(cfg.rules_dir.join("many.yaml"), rules).expect("rules");
        let before = store.target_state_reads();
        let report = reload(&app, "test").await.expect("reloaded");
        assert_eq!(report.targets_started.len(), N + 1, "{report:?}");
        assert_eq!(
            store.target_state_reads() - before,
            1,
            "one read for {N} starts"
        );
        for i in 0..N {
            let rt = app.dispatcher.runtime(&format!("c{i}")).expect("running");
            assert_eq!(
                rt.paused.load(std::sync::atomic::Ordering::SeqCst),
                i % 2 == 0,
                "c{i} starts from its own record"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reload_whose_new_target_cannot_start_is_refused_until_it_can() {
        let dir = tempfile::tempdir().expect("tempdir");
        let secrets = dir.path().join("secrets.toml");
        std::fs::write(&secrets, "").expect("secrets file");
        let mut cfg = test_config(dir.path());
        cfg.secrets_file = Some(secrets.clone());
        let disk = SimulatedDisk::new();
        let d = disk.clone();
        let store = RedbStore::with_backend_factory(move || d.backend(), StoreOptions::default())
            .expect("store");
        let app = test_app(cfg.clone(), store, None);
        let before = app.rules.load().version.clone();

        std::fs::write(cfg.rules_dir.join("signed.yaml"), SIGNED_RULE).expect("rule");
        let refused = reload(&app, "test")
            .await
            .expect_err("its secret is not set");
        let message = refused.to_string();
        assert!(
            message.contains("signed") && message.contains("UNIT_TEST_SECRET_NEVER_SET"),
            "names the target and the secret: {message}"
        );
        assert_eq!(app.rules.load().version, before, "the old set stays live");
        assert!(!app.rules.load().targets.contains_key("signed"));
        assert!(
            app.reload_status
                .lock()
                .expect("status")
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("signing secret")),
            "/v1/status shows why"
        );

        // Set but empty, or `whsec_` alone: refused the same way (an empty secret sent the
        // webhooks unsigned; `whsec_` alone signed them with an empty key).
        for (value, why) in [("", "the value is empty"), ("whsec_", "0 bytes of key")] {
            std::fs::write(
                &secrets,
                format!("UNIT_TEST_SECRET_NEVER_SET = \"{value}\"\n"),
            )
            .expect("secrets file");
            let message = reload(&app, "test")
                .await
                .expect_err("an empty secret cannot sign")
                .to_string();
            assert!(
                message.contains("UNIT_TEST_SECRET_NEVER_SET") && message.contains(why),
                "{value:?}: {message}"
            );
            assert!(!app.rules.load().targets.contains_key("signed"));
        }

        // The secret added to the secrets file: the next reload takes it.
        std::fs::write(
            &secrets,
            "UNIT_TEST_SECRET_NEVER_SET = \"whsec_dW5pdC10ZXN0LXNpZ25pbmcta2V5\"\n",
        )
        .expect("secrets file");
        let report = reload(&app, "test").await.expect("the secret is there now");
        assert!(report.targets_started.contains(&"signed".to_owned()));
        assert!(app.rules.load().targets.contains_key("signed"));
        assert!(app.dispatcher.running().iter().any(|s| s.id == "signed"));

        // A key rotation in the secrets file, with the rules unchanged: the reload builds the
        // target again with the new keys; a reload with nothing changed leaves it be.
        let report = reload(&app, "test").await.expect("nothing changed");
        assert!(report.targets_started.is_empty(), "{report:?}");
        std::fs::write(
            &secrets,
            "UNIT_TEST_SECRET_NEVER_SET = \"whsec_bmV3LXNpZ25pbmcta2V5LTAwMDE= whsec_dW5pdC10ZXN0LXNpZ25pbmcta2V5\"\n",
        )
        .expect("secrets file");
        let report = reload(&app, "test").await.expect("rotated");
        assert_eq!(report.targets_started, ["signed"], "{report:?}");
        let report = reload(&app, "test").await.expect("nothing changed");
        assert!(report.targets_started.is_empty(), "{report:?}");
    }

    /// A secrets file that does not parse is reported by path, line and column: the TOML
    /// parser's own message quotes the line, which is a secret.
    #[test]
    fn a_broken_secrets_file_is_reported_without_its_text() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("secrets.toml");
        for (text, at) in [
            // The closing quote missing.
            (
                "HOOK = \"whsec_c2VjcmV0\"\nHOOK_AUTH = \"Bearer SUPERSECRET-TOKEN-456\n",
                ":2:",
            ),
            // Not a string.
            ("HOOK_AUTH = 4561234\n", ":1:"),
            // A table where a value belongs.
            ("[HOOK_AUTH]\nvalue = \"SUPERSECRET-TOKEN-456\"\n", ":1:"),
            // A duplicate name.
            (
                "HOOK_AUTH = \"SUPERSECRET-TOKEN-456\"\nHOOK_AUTH = \"SUPERSECRET-TOKEN-456\"\n",
                ":2:",
            ),
        ] {
            std::fs::write(&path, text).expect("secrets file");
            let e = crate::config::read_secrets(&path).expect_err(text);
            assert!(
                !e.contains("SUPERSECRET") && !e.contains("4561234") && !e.contains("c2Vj"),
                "{e}"
            );
            assert!(
                e.contains(&format!("{}{at}", path.display())),
                "{text:?}: {e}"
            );
            let cfg = Config {
                secrets_file: Some(path.clone()),
                ..Default::default()
            };
            let Err(e) = secret_resolver(&cfg, None) else {
                panic!("a broken secrets file is refused at start");
            };
            assert!(!e.to_string().contains("SUPERSECRET"), "{e}");
        }
    }
}
