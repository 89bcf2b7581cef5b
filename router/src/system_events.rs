//! System events (`router.*`): raised by delivery (a new dead letter, a breaker transition),
//! then routed here through the live rules like any event, with three differences: they are
//! rate-limited, so an alert path that fails cannot become a storm; one about a target is
//! never delivered to that target; and what is dropped is counted by type and target, a
//! dropped `router.dlq.added` being announced later in one summary per target.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::{DefaultDirectRateLimiter, DefaultKeyedRateLimiter, Quota, RateLimiter};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::app::App;
use crate::deliver::{DeadEvent, DeliveryContext};
use crate::event::CloudEvent;
use crate::store::{AcceptOutcome, DlqReason};

/// The type of the event that announces new DLQ entries.
pub const DLQ_ADDED: &str = "router.dlq.added";

/// How often dead letters whose announcement was dropped are summarised (when their target's
/// rate limit allows).
const SUMMARY_EVERY: Duration = Duration::from_secs(1);

/// The kinds of system event: the `type` label of `router_system_events_dropped_total`, a
/// fixed set whatever a type says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `router.dlq.added`.
    DlqAdded,
    /// `router.breaker.opened`.
    BreakerOpened,
    /// `router.breaker.half_opened`.
    BreakerHalfOpened,
    /// `router.breaker.closed`.
    BreakerClosed,
    /// Any other type.
    Other,
}

impl Kind {
    /// The kind of an event of type `ty`.
    pub fn of(ty: &str) -> Self {
        match ty {
            DLQ_ADDED => Self::DlqAdded,
            "router.breaker.opened" => Self::BreakerOpened,
            "router.breaker.half_opened" => Self::BreakerHalfOpened,
            "router.breaker.closed" => Self::BreakerClosed,
            _ => Self::Other,
        }
    }

    /// The label: the type, or `other`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::DlqAdded => DLQ_ADDED,
            Self::BreakerOpened => "router.breaker.opened",
            Self::BreakerHalfOpened => "router.breaker.half_opened",
            Self::BreakerClosed => "router.breaker.closed",
            Self::Other => "other",
        }
    }

    fn is_breaker(self) -> bool {
        matches!(
            self,
            Self::BreakerOpened | Self::BreakerHalfOpened | Self::BreakerClosed
        )
    }
}

/// A token bucket per target the events are about (events about no target share one), and
/// one over all of them.
struct Bucket {
    per_target: DefaultKeyedRateLimiter<String>,
    total: DefaultDirectRateLimiter,
}

impl Bucket {
    fn new((per_second, burst): (u32, u32), (total_per_second, total_burst): (u32, u32)) -> Self {
        let quota = |per_second: u32, burst: u32| {
            Quota::per_second(
                std::num::NonZeroU32::new(per_second).unwrap_or(std::num::NonZeroU32::MIN),
            )
            .allow_burst(std::num::NonZeroU32::new(burst).unwrap_or(std::num::NonZeroU32::MIN))
        };
        Self {
            per_target: RateLimiter::keyed(quota(per_second, burst)),
            total: RateLimiter::direct(quota(total_per_second, total_burst)),
        }
    }

    fn admit(&self, about: Option<&str>) -> bool {
        // The keys are the router's target ids: as many as the rules have ever named.
        self.per_target
            .check_key(&about.unwrap_or("").to_string())
            .is_ok()
            && self.total.check().is_ok()
    }
}

/// The rate limits on system events. Breaker transitions have buckets of their own: sharing
/// one with `router.dlq.added`, a burst of dead letters used it up and the breaker's
/// `opened` that followed was dropped for good (an alert route saw `closed` with no
/// `opened`). Transitions are few by nature (one cycle per `open_for`); theirs only bounds a
/// breaker that flaps. Dead-letter announcements (and any other type): 20/s per target,
/// bursts of 100, so one failing target cannot use up the alerts of the others, and 100/s,
/// bursts of 500, in total, so many together still cannot make a storm.
pub(crate) struct Limits {
    announcements: Bucket,
    transitions: Bucket,
}

impl Limits {
    pub(crate) fn new() -> Self {
        Self {
            announcements: Bucket::new((20, 100), (100, 500)),
            transitions: Bucket::new((5, 20), (50, 200)),
        }
    }

    /// Whether an event of `kind` about `about` (a target id) may go now.
    pub(crate) fn admit(&self, kind: Kind, about: Option<&str>) -> bool {
        if kind.is_breaker() {
            self.transitions.admit(about)
        } else {
            self.announcements.admit(about)
        }
    }
}

/// Dead letters not announced one by one, for one target.
#[derive(Debug, Clone, Default, PartialEq)]
struct Pending {
    entries: u64,
    reasons: BTreeMap<String, u64>,
    /// The most hops among the dropped announcements: the summary carries them on, so an
    /// alert loop still climbs to the hop limit through summaries.
    hops: u32,
}

/// New DLQ entries whose `router.dlq.added` was dropped (past the rate limit, the routing
/// channel full, the store refusing it), by the target they were about, until a summary
/// announces them.
#[derive(Default)]
pub struct Unannounced {
    pending: Mutex<HashMap<Option<String>, Pending>>,
}

impl Unannounced {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Option<String>, Pending>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Notes `ev`, a dropped system event, if it announced dead letters: one, or the `count`
    /// of a bulk announcement or a summary.
    fn add(&self, ev: &CloudEvent) {
        if ev.ty != DLQ_ADDED {
            return;
        }
        let data = ev.data.as_ref().map(|d| d.value());
        let field = |name: &str| data.and_then(|d| d.get(name));
        let n = field("count").and_then(Value::as_u64).unwrap_or(1);
        let mut pending = self.lock();
        let p = pending.entry(ev.subject.clone()).or_default();
        p.entries += n;
        p.hops = p.hops.max(ev.hops());
        match field("reasons").and_then(Value::as_object) {
            Some(reasons) => {
                for (reason, k) in reasons {
                    *p.reasons.entry(reason.clone()).or_default() += k.as_u64().unwrap_or(0);
                }
            }
            None => {
                let reason = field("reason").and_then(Value::as_str).unwrap_or("unknown");
                *p.reasons.entry(reason.to_owned()).or_default() += n;
            }
        }
    }

    /// The targets with dead letters not yet announced.
    fn targets(&self) -> Vec<Option<String>> {
        self.lock().keys().cloned().collect()
    }

    /// The summary of what is pending for `about`, which is no longer pending.
    fn take(&self, about: &Option<String>, now: i64) -> Option<CloudEvent> {
        let p = self.lock().remove(about)?;
        Some(summary(about.as_deref(), &p, now))
    }
}

/// The `router.dlq.added` that announces the `p.entries` dead letters of `about` whose own
/// announcements were dropped: `count` of them, by reason (`reason` too when they share
/// one), marked `unannounced`. Routed like the others, so an alert route on
/// `router.dlq.added` sees every new entry, one by one or in a summary.
fn summary(about: Option<&str>, p: &Pending, now: i64) -> CloudEvent {
    let mut ev = crate::deliver::system_event(DLQ_ADDED, about.unwrap_or("none"), now);
    if about.is_none() {
        ev.subject = None;
        ev.source = "router://ingest".into();
    }
    ev.extensions.insert("hops".into(), Value::from(p.hops));
    let single = (p.reasons.len() == 1)
        .then(|| p.reasons.keys().next().cloned())
        .flatten();
    ev.data = Some(crate::event::Data::from(json!({
        "target": about,
        "count": p.entries,
        "reason": single,
        "reasons": p.reasons,
        "unannounced": true,
    })));
    ev
}

/// A system event dropped because `why`: counted by type and target, noted for the summary
/// if it announced dead letters, and logged (at most `LogGates::PER_WINDOW` lines per target
/// per window, the next one saying how many were left out: a storm of quarantined events
/// wrote one line per dropped announcement, 92k lines for 100k events).
pub fn dropped(ctx: &DeliveryContext, ev: &CloudEvent, why: &str) {
    let kind = Kind::of(&ev.ty);
    let about = ev.subject.as_deref().unwrap_or("none");
    ctx.metrics
        .system_events_dropped
        .get_or_create(&vec![
            ("type", kind.as_str().to_owned()),
            ("target", about.to_owned()),
        ])
        .inc();
    ctx.unannounced.add(ev);
    if let Some(suppressed) = ctx.log_gates.admit(&format!("system:{about}")) {
        tracing::warn!(ty = %ev.ty, about, why, suppressed, "system event dropped");
    }
}

/// Starts the task that routes system events from `rx` through the live rules until
/// `cancel`, and summarises dropped announcements every `SUMMARY_EVERY`. At `cancel` it
/// routes what is left: the events still in `rx`, then one summary per target of the dead
/// letters not yet announced, past the rate limit (the limit bounds a storm; one last
/// summary a target is not one). Before, a shutdown lost both, and the dead letters of the
/// attempts that ended during the shutdown's grace period were never announced. The caller
/// cancels it once delivery has stopped, so those are in.
pub(crate) fn spawn_router(
    app: &Arc<App>,
    tracker: &TaskTracker,
    cancel: CancellationToken,
    mut rx: tokio::sync::mpsc::Receiver<CloudEvent>,
) {
    let app = app.clone();
    tracker.spawn(async move {
        let limits = Limits::new();
        let mut summaries = tokio::time::interval(SUMMARY_EVERY);
        summaries.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => break,
                _ = summaries.tick() => announce_unannounced(&app, &limits, &cancel).await,
                ev = rx.recv() => {
                    let Some(ev) = ev else { break };
                    if limits.admit(Kind::of(&ev.ty), ev.subject.as_deref()) {
                        route(&app, ev, &cancel).await;
                    } else {
                        dropped(app.dispatcher.context(), &ev, "past its rate limit");
                    }
                }
            }
        }
        // The store is still open (it closes after this task ends). `cancel` is cancelled,
        // so a store that refuses an event is tried again at once, not for seconds.
        while let Ok(ev) = rx.try_recv() {
            if limits.admit(Kind::of(&ev.ty), ev.subject.as_deref()) {
                route(&app, ev, &cancel).await;
            } else {
                dropped(app.dispatcher.context(), &ev, "past its rate limit");
            }
        }
        let unannounced = &app.dispatcher.context().unannounced;
        for about in unannounced.targets() {
            if let Some(ev) = unannounced.take(&about, app.clock.now_ms()) {
                route(&app, ev, &cancel).await;
            }
        }
    });
}

/// Routes a summary for each target with unannounced dead letters whose rate limit allows
/// one now (the others wait for a later turn, their counts growing).
async fn announce_unannounced(app: &App, limits: &Limits, cancel: &CancellationToken) {
    let unannounced = &app.dispatcher.context().unannounced;
    for about in unannounced.targets() {
        if !limits.admit(Kind::DlqAdded, about.as_deref()) {
            continue;
        }
        if let Some(ev) = unannounced.take(&about, app.clock.now_ms()) {
            route(app, ev, cancel).await;
        }
    }
}

/// Whether a system event about `about` may go to `target`: never to the target it is about,
/// nor to another target that delivers to the same place (a handler or a URL named by two
/// rules).
pub(crate) fn deliverable(
    rules: &crate::rules::RuleSet,
    about: Option<&str>,
    target: &str,
) -> bool {
    let Some(about) = about else { return true };
    if target == about {
        return false;
    }
    match (rules.targets.get(about), rules.targets.get(target)) {
        (Some(a), Some(t)) => a.kind.destination() != t.kind.destination(),
        _ => true,
    }
}

/// Stores `ev` with its fan-out under the live rules. A store that refuses it is usually
/// brief (a compaction, a reconnect): tried again for about 7 s, then dropped. Copies that
/// meet a full queue are dead letters like any other: counted, but not announced (that
/// would feed the alert path its own failures).
async fn route(app: &App, ev: CloudEvent, cancel: &CancellationToken) {
    let rules = app.rules.load();
    let window = i64::try_from(app.cfg.ingest.dedup_window.as_millis()).unwrap_or(i64::MAX);
    let about = ev.subject.clone();
    let mut ne = crate::ingest::route(
        &rules,
        &app.disabled_rules(),
        ev,
        app.clock.now_ms(),
        window,
    );
    ne.targets
        .retain(|t| deliverable(&rules, about.as_deref(), &t.target_id));
    let ctx = app.dispatcher.context();
    let mut retry_in = Duration::from_secs(1);
    loop {
        match app.store.accept(vec![ne.clone()]).await {
            Ok(outcomes) => {
                for outcome in &outcomes {
                    if let AcceptOutcome::Accepted { overflowed, .. } = outcome {
                        // The rules that still route it here (a target it is about was
                        // taken out above).
                        app.metrics.count_rule_matches(
                            ne.matched_rules
                                .iter()
                                .filter(|r| ne.targets.iter().any(|t| &t.rule == *r))
                                .map(String::as_str),
                            app.clock.now_ms(),
                        );
                        for target in overflowed {
                            crate::deliver::dead_lettered(
                                ctx,
                                Some(target),
                                DeadEvent::of(&ne.event),
                                DlqReason::TargetOverflow,
                                Some("the target's queue is at its depth cap"),
                                app.clock.now_ms(),
                            );
                        }
                    }
                }
                return;
            }
            Err(e) if retry_in <= Duration::from_secs(4) => {
                tracing::warn!(error = %e, ty = %ne.event.ty, ?retry_in, "could not store a system event; trying again");
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    _ = tokio::time::sleep(retry_in) => {}
                }
                retry_in *= 2;
            }
            Err(e) => {
                dropped(
                    ctx,
                    &ne.event,
                    &format!("the store refused it for several seconds: {e}"),
                );
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_noisy_target_does_not_use_up_the_system_events_of_others() {
        let limits = Limits::new();
        let admitted = (0..1_000)
            .filter(|_| limits.admit(Kind::DlqAdded, Some("flapping")))
            .count();
        // Its burst, plus what refills while the loop runs.
        assert!((100..150).contains(&admitted), "{admitted}");
        assert!(limits.admit(Kind::DlqAdded, Some("payments")));
        assert!(limits.admit(Kind::DlqAdded, None));
        // Many targets at once still meet the total bound.
        let total = (0..2_000)
            .filter(|i| limits.admit(Kind::DlqAdded, Some(&format!("t{}", i % 40))))
            .count();
        assert!(total < 600, "{total}");
    }

    /// A burst of dead letters used up the bucket the breaker's transitions shared, and the
    /// `opened` that followed was dropped for good.
    #[test]
    fn dead_letter_announcements_do_not_use_up_the_breakers_transitions() {
        let limits = Limits::new();
        let announced = (0..1_000)
            .filter(|_| limits.admit(Kind::DlqAdded, Some("api")))
            .count();
        assert!(announced < 150, "{announced}");
        // Every target's announcements at once, past the total bound too.
        for i in 0..2_000 {
            limits.admit(Kind::DlqAdded, Some(&format!("t{}", i % 40)));
        }
        assert!(limits.admit(Kind::BreakerOpened, Some("api")));
        assert!(limits.admit(Kind::BreakerClosed, Some("t1")));
        // A flapping breaker is still bounded.
        let flaps = (0..1_000)
            .filter(|_| limits.admit(Kind::BreakerHalfOpened, Some("flapping")))
            .count();
        assert!((20..40).contains(&flaps), "{flaps}");
    }

    /// Rules: `t` to the webhook `hook`; `router.dlq.added` to `pager` (its queue capped at
    /// 2) and to `hook-alias`, another target delivering where `hook` does.
    const RULES: &str = "policies:\n  capped:\n    max_queue_depth: 2\nrules:\n  - name: r\n    pattern:\n      type: [t]\n    targets:\n      - webhook: http://127.0.0.1:9/\n        id: hook\n  - name: alerts\n    pattern:\n      type: [router.dlq.added]\n    targets:\n      - webhook: http://127.0.0.1:9/pager\n        id: pager\n        policy: capped\n      - webhook: http://127.0.0.1:9/\n        id: hook-alias\n";

    fn app_on_rules(dir: &std::path::Path) -> (Arc<App>, tokio::sync::mpsc::Receiver<CloudEvent>) {
        let cfg = crate::app::test_config(dir);
        std::fs::write(cfg.rules_dir.join("r.yaml"), RULES).expect("rules");
        let store = crate::store::RedbStore::in_memory().expect("store");
        crate::app::test_app_raising(cfg, store)
    }

    #[tokio::test]
    async fn a_system_event_goes_neither_to_its_target_nor_to_the_same_destination() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (app, _rx) = app_on_rules(dir.path());
        let rules = app.rules.load();
        assert!(!deliverable(&rules, Some("hook"), "hook"));
        assert!(!deliverable(&rules, Some("hook"), "hook-alias"), "same URL");
        assert!(deliverable(&rules, Some("hook"), "pager"));
        assert!(deliverable(&rules, None, "hook-alias"));
        assert!(
            deliverable(&rules, Some("gone"), "pager"),
            "no longer in the rules"
        );
    }

    /// A system event's copy that meets a full queue is a dead letter like any other: counted
    /// in `router_dlq_entries_total` (the accept's answer was discarded, 123 entries went
    /// uncounted in an audit), but not announced, which would feed the alert path its own
    /// failures.
    /// `n` events dead-lettered for `hook` (`retries_exhausted`), each raising its
    /// `router.dlq.added`.
    fn dead_letter_for_hook(app: &App, n: usize) {
        let now = app.clock.now_ms();
        for i in 0..n {
            let ev = crate::store::test_events::ev("/s", &format!("e{i}"));
            crate::deliver::dead_lettered(
                app.dispatcher.context(),
                Some("hook"),
                DeadEvent::of(&ev),
                DlqReason::RetriesExhausted,
                None,
                now,
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn system_events_past_a_full_queue_are_counted_and_not_announced() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (app, rx) = app_on_rules(dir.path());
        let (tracker, cancel) = (TaskTracker::new(), CancellationToken::new());
        spawn_router(&app, &tracker, cancel.clone(), rx);
        dead_letter_for_hook(&app, 5);
        // No worker runs here: `pager` keeps two, and three overflow.
        let overflowed = || {
            app.metrics
                .dlq_entries
                .get_or_create(&vec![
                    ("target", "pager".to_owned()),
                    ("reason", "target_overflow".to_owned()),
                ])
                .get()
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while overflowed() < 3 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(overflowed(), 3);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let stored = app
            .store
            .events_between(0, i64::MAX, 0, 100, usize::MAX)
            .await
            .expect("archive");
        let announced = stored.iter().filter(|e| e.event.ty == DLQ_ADDED).count();
        assert_eq!(announced, 5, "none about the overflowed copies");
        assert_eq!(app.store.queue_stats()["pager"].queued, 2);
        assert_eq!(
            app.store
                .queue_stats()
                .get("hook-alias")
                .map_or(0, |s| s.queued),
            0,
            "never to where `hook` delivers"
        );
        cancel.cancel();
    }

    /// A shutdown routes what is left: the announcements still in the channel, and one
    /// summary per target of those dropped before (the rate limit notwithstanding). Before,
    /// both were lost, with the dead letters of every attempt that ended during the grace
    /// period.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn at_shutdown_what_is_left_is_announced() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (app, rx) = app_on_rules(dir.path());
        let ctx = app.dispatcher.context();
        dead_letter_for_hook(&app, 2);
        ctx.unannounced.add(&announcement(
            Some("hook"),
            json!({"target": "hook", "reason": "retries_exhausted", "count": 7}),
            1,
        ));
        // Cancelled before it starts: all it does is the shutdown's part.
        let (tracker, cancel) = (TaskTracker::new(), CancellationToken::new());
        cancel.cancel();
        spawn_router(&app, &tracker, cancel, rx);
        tracker.close();
        tokio::time::timeout(Duration::from_secs(20), tracker.wait())
            .await
            .expect("the task ends");
        let stored = app
            .store
            .events_between(0, i64::MAX, 0, 100, usize::MAX)
            .await
            .expect("archive");
        let announced: Vec<Value> = stored
            .iter()
            .filter(|e| e.event.ty == DLQ_ADDED)
            .map(|e| e.event.data.as_ref().expect("data").value().clone())
            .collect();
        assert_eq!(announced.len(), 3, "{announced:?}");
        assert_eq!(
            announced
                .iter()
                .filter(|d| d["unannounced"] == true && d["count"] == 7)
                .count(),
            1,
            "{announced:?}"
        );
        assert!(ctx.unannounced.targets().is_empty());
    }

    #[test]
    fn kinds_are_a_fixed_set() {
        for ty in [
            DLQ_ADDED,
            "router.breaker.opened",
            "router.breaker.half_opened",
            "router.breaker.closed",
        ] {
            assert_eq!(Kind::of(ty).as_str(), ty);
        }
        assert_eq!(Kind::of("router.anything.else").as_str(), "other");
        assert_eq!(Kind::of("order.created").as_str(), "other");
    }

    fn announcement(about: Option<&str>, data: Value, hops: u32) -> CloudEvent {
        let mut ev = crate::deliver::system_event(DLQ_ADDED, about.unwrap_or("none"), 0);
        ev.subject = about.map(str::to_owned);
        ev.extensions.insert("hops".into(), Value::from(hops));
        ev.data = Some(crate::event::Data::from(data));
        ev
    }

    /// Dropped announcements add up per target, one by one or in bulk, and come back as one
    /// summary each, carrying the count, the reasons and the most hops; a summary dropped in
    /// turn is counted again whole.
    #[test]
    fn dropped_announcements_come_back_as_one_summary_per_target() {
        let u = Unannounced::default();
        for _ in 0..3 {
            u.add(&announcement(
                Some("api"),
                json!({"target": "api", "reason": "retries_exhausted"}),
                1,
            ));
        }
        u.add(&announcement(
            Some("api"),
            json!({"target": "api", "reason": "target_removed", "count": 5}),
            4,
        ));
        u.add(&announcement(
            None,
            json!({"reason": "contract_violation"}),
            1,
        ));
        let mut breaker = announcement(Some("api"), json!({}), 0);
        breaker.ty = "router.breaker.opened".into();
        u.add(&breaker);
        let mut targets = u.targets();
        targets.sort();
        assert_eq!(targets, [None, Some("api".to_owned())]);
        let s = u.take(&Some("api".to_owned()), 0).expect("pending");
        assert_eq!(
            (s.ty.as_str(), s.subject.as_deref()),
            (DLQ_ADDED, Some("api"))
        );
        assert_eq!(s.hops(), 4);
        let data = s.data.as_ref().expect("data").value().clone();
        assert_eq!(
            data,
            json!({"target": "api", "count": 8, "reason": null, "unannounced": true,
                   "reasons": {"retries_exhausted": 3, "target_removed": 5}})
        );
        assert!(u.take(&Some("api".to_owned()), 0).is_none(), "announced");
        // Dropped again, the summary is pending again, whole.
        u.add(&s);
        let again = u.take(&Some("api".to_owned()), 0).expect("pending");
        assert_eq!(again.data.as_ref().expect("data").value(), &data);
        let ingest = u.take(&None, 0).expect("pending");
        assert_eq!(
            (ingest.subject, ingest.source.as_str()),
            (None, "router://ingest")
        );
        assert_eq!(
            ingest.data.as_ref().expect("data").value()["reason"],
            "contract_violation"
        );
    }
}
