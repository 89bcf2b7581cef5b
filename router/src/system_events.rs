//! System events (`router.*`): raised by delivery (a new dead letter, a breaker transition),
//! then routed here through the live rules like any event, with three differences: they are
//! rate-limited, so an alert path that fails cannot become a storm; one about a target is
//! never delivered to that target; and what is dropped is counted by type and target, a
//! dropped `router.dlq.added` being announced later in one summary per target, a dropped
//! `router.breaker.opened` or `closed` in a summary naming the targets it was about.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::middleware::NoOpMiddleware;
use governor::state::keyed::HashMapStateStore;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
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
/// rate limit allows), and dropped breaker transitions.
const SUMMARY_EVERY: Duration = Duration::from_secs(1);

/// The most targets one summary of dropped breaker transitions names; the others wait for
/// the next summary (`data.pending` says how many), so each is named in time and no event
/// grows with the number of targets.
const TRANSITION_SUMMARY_TARGETS: usize = 100;

/// The kinds of system event: the `type` label of `router_system_events_dropped_total`, a
/// fixed set whatever a type says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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

    /// Whether a dropped event of this kind is announced later in a summary naming its
    /// target: the transitions an alert route acts on (page at `opened`, resolve at
    /// `closed`). A dropped `half_opened` is churn (a failing breaker has one every
    /// `open_for`) and is counted only.
    fn is_summarised_transition(self) -> bool {
        matches!(self, Self::BreakerOpened | Self::BreakerClosed)
    }
}

/// A governor limiter over `C`, one state per key.
type KeyedLimiter<C> =
    RateLimiter<String, HashMapStateStore<String>, C, NoOpMiddleware<<C as Clock>::Instant>>;
/// A governor limiter over `C`, one state.
type DirectLimiter<C> =
    RateLimiter<NotKeyed, InMemoryState, C, NoOpMiddleware<<C as Clock>::Instant>>;

/// A token bucket per target the events are about (events about no target share one), and
/// one over all of them.
struct Bucket<C: Clock> {
    per_target: KeyedLimiter<C>,
    total: DirectLimiter<C>,
}

impl<C: Clock + Clone> Bucket<C> {
    fn new(
        (per_second, burst): (u32, u32),
        (total_per_second, total_burst): (u32, u32),
        clock: &C,
    ) -> Self {
        let quota = |per_second: u32, burst: u32| {
            Quota::per_second(
                std::num::NonZeroU32::new(per_second).unwrap_or(std::num::NonZeroU32::MIN),
            )
            .allow_burst(std::num::NonZeroU32::new(burst).unwrap_or(std::num::NonZeroU32::MIN))
        };
        Self {
            per_target: RateLimiter::hashmap_with_clock(quota(per_second, burst), clock.clone()),
            total: RateLimiter::direct_with_clock(
                quota(total_per_second, total_burst),
                clock.clone(),
            ),
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
/// `opened`). And `opened` has its own apart from `half_opened` and `closed`: in a mass
/// outage every failing breaker half-opens again each `open_for`, and that churn used up the
/// budget they shared, so the `opened` of a target failing later was dropped (3,803 of them
/// with 1,000 targets down, in an audit). Transitions are few per target (one cycle per
/// `open_for`); the per-target bound only holds a breaker that flaps. Dead-letter
/// announcements (and any other type): 20/s per target, bursts of 100, so one failing target
/// cannot use up the alerts of the others, and 100/s, bursts of 500, in total, so many
/// together still cannot make a storm.
pub(crate) struct Limits<C: Clock = DefaultClock> {
    announcements: Bucket<C>,
    opened: Bucket<C>,
    churn: Bucket<C>,
}

impl Limits {
    pub(crate) fn new() -> Self {
        Self::with_clock(&DefaultClock::default())
    }
}

impl<C: Clock + Clone> Limits<C> {
    /// The limits, timed by `clock` (a fake one in tests).
    fn with_clock(clock: &C) -> Self {
        Self {
            announcements: Bucket::new((20, 100), (100, 500), clock),
            opened: Bucket::new((5, 20), (50, 200), clock),
            churn: Bucket::new((5, 20), (50, 200), clock),
        }
    }

    /// Whether an event of `kind` about `about` (a target id) may go now.
    pub(crate) fn admit(&self, kind: Kind, about: Option<&str>) -> bool {
        match kind {
            Kind::BreakerOpened => self.opened.admit(about),
            Kind::BreakerHalfOpened | Kind::BreakerClosed => self.churn.admit(about),
            Kind::DlqAdded | Kind::Other => self.announcements.admit(about),
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

/// The targets whose breaker transitions of one kind were dropped, until a summary names
/// them: by target id, the order it was first dropped in (the longest waiting are named
/// first) and how many of its transitions were dropped.
#[derive(Debug, Default)]
struct PendingTransitions {
    targets: HashMap<String, (u64, u64)>,
    next: u64,
}

/// New DLQ entries whose `router.dlq.added` was dropped (past the rate limit, the routing
/// channel full, the store refusing it), by the target they were about, until a summary
/// announces them; and the targets whose `router.breaker.opened` or `closed` was dropped,
/// until a summary names them.
#[derive(Default)]
pub struct Unannounced {
    pending: Mutex<HashMap<Option<String>, Pending>>,
    transitions: Mutex<HashMap<Kind, PendingTransitions>>,
}

impl Unannounced {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Option<String>, Pending>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_transitions(&self) -> std::sync::MutexGuard<'_, HashMap<Kind, PendingTransitions>> {
        self.transitions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Notes `ev`, a dropped system event, if it announced dead letters (one, or the `count`
    /// of a bulk announcement or a summary) or a breaker's `opened` or `closed` (of its
    /// target, or a summary's targets).
    fn add(&self, ev: &CloudEvent) {
        let kind = Kind::of(&ev.ty);
        if kind.is_summarised_transition() {
            self.add_transition(kind, ev);
            return;
        }
        if kind != Kind::DlqAdded {
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

    /// Notes a dropped breaker transition of `kind`: its target's, or, for a summary dropped
    /// in its turn, its targets again with its count (spread over them: only the total is
    /// ever told).
    fn add_transition(&self, kind: Kind, ev: &CloudEvent) {
        let named = summarised_targets(ev);
        let dropped: Vec<(String, u64)> = if named.is_empty() {
            match &ev.subject {
                Some(id) => vec![(id.clone(), 1)],
                None => return,
            }
        } else {
            let k = named.len() as u64;
            let count = ev
                .data
                .as_ref()
                .and_then(|d| d.value().get("count").and_then(Value::as_u64))
                .unwrap_or(k)
                .max(k);
            named
                .into_iter()
                .zip(0..)
                .map(|(id, i)| (id, count / k + u64::from(i < count % k)))
                .collect()
        };
        let mut transitions = self.lock_transitions();
        let pending = transitions.entry(kind).or_default();
        for (id, n) in dropped {
            let seq = pending.next;
            pending.next += 1;
            pending.targets.entry(id).or_insert((seq, 0)).1 += n;
        }
    }

    /// The summary of the dropped transitions of `kind` of the targets that waited longest (at
    /// most `TRANSITION_SUMMARY_TARGETS`), which are no longer pending; `None` when none is.
    fn take_transitions(&self, kind: Kind, now: i64) -> Option<CloudEvent> {
        let mut transitions = self.lock_transitions();
        let pending = transitions.get_mut(&kind)?;
        if pending.targets.is_empty() {
            return None;
        }
        let mut oldest: Vec<(u64, String)> = pending
            .targets
            .iter()
            .map(|(id, (seq, _))| (*seq, id.clone()))
            .collect();
        oldest.sort_unstable();
        oldest.truncate(TRANSITION_SUMMARY_TARGETS);
        let mut count = 0;
        let mut named = Vec::with_capacity(oldest.len());
        for (_, id) in oldest {
            if let Some((_, n)) = pending.targets.remove(&id) {
                count += n;
                named.push(id);
            }
        }
        Some(transition_summary(
            kind,
            &named,
            count,
            pending.targets.len(),
            now,
        ))
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

/// The `router.breaker.opened` (or `closed`, per `kind`) that names the targets whose own
/// event of that type was dropped: `count` transitions of `targets` (at most
/// `TRANSITION_SUMMARY_TARGETS`), `pending` more targets to be named by the next summary,
/// marked `unannounced`. It is about no single target (no `subject`), and is never delivered
/// to a target it names. So an alert route on the type knows it saw a fraction, and which
/// targets it missed.
fn transition_summary(
    kind: Kind,
    targets: &[String],
    count: u64,
    pending: usize,
    now: i64,
) -> CloudEvent {
    let mut ev = crate::deliver::system_event(kind.as_str(), "unannounced", now);
    ev.subject = None;
    ev.source = "router://breakers".into();
    let to = match kind {
        Kind::BreakerClosed => "closed",
        _ => "open",
    };
    ev.data = Some(crate::event::Data::from(json!({
        "unannounced": true,
        "to": to,
        "targets": targets,
        "count": count,
        "pending": pending,
    })));
    ev
}

/// The targets a summary of dropped breaker transitions names (none for any other event).
fn summarised_targets(ev: &CloudEvent) -> Vec<String> {
    if !Kind::of(&ev.ty).is_summarised_transition() {
        return Vec::new();
    }
    let Some(data) = ev.data.as_ref().map(|d| d.value()) else {
        return Vec::new();
    };
    if data.get("unannounced") != Some(&Value::Bool(true)) {
        return Vec::new();
    }
    data.get("targets")
        .and_then(Value::as_array)
        .map(|ids| {
            ids.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
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
        for kind in [Kind::BreakerOpened, Kind::BreakerClosed] {
            while let Some(ev) = unannounced.take_transitions(kind, app.clock.now_ms()) {
                route(&app, ev, &cancel).await;
            }
        }
    });
}

/// Routes a summary for each target with unannounced dead letters whose rate limit allows
/// one now (the others wait for a later turn, their counts growing), and one summary of
/// dropped `opened`, one of dropped `closed`. Those two take no token: they are at most two
/// a turn by construction, and drawing from the buckets whose exhaustion dropped what they
/// announce would hold them back for as long as the storm lasts.
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
    for kind in [Kind::BreakerOpened, Kind::BreakerClosed] {
        if let Some(ev) = unannounced.take_transitions(kind, app.clock.now_ms()) {
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
    let named = summarised_targets(&ev);
    let mut ne = crate::ingest::route(
        &rules,
        &app.disabled_rules(),
        ev,
        app.clock.now_ms(),
        window,
    );
    ne.targets.retain(|t| {
        deliverable(&rules, about.as_deref(), &t.target_id)
            && named
                .iter()
                .all(|id| deliverable(&rules, Some(id), &t.target_id))
    });
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

    /// A mass outage: 1,000 targets already down half-open again and again (1,000 a second)
    /// while 1,000 others open, 100 a second for 10 s, past even `opened`'s own budget. The
    /// churn does not use up that budget (before, they shared one and nearly every `opened`
    /// was dropped), and every `opened` is either routed or named, once, by a summary of at
    /// most `TRANSITION_SUMMARY_TARGETS` targets, one a second as the router makes them.
    #[test]
    fn in_a_mass_outage_every_opened_is_routed_or_named_in_a_summary() {
        let clock = governor::clock::FakeRelativeClock::default();
        let limits = Limits::with_clock(&clock);
        let u = Unannounced::default();
        let opened = |id: &str| {
            let mut ev = crate::deliver::system_event("router.breaker.opened", id, 0);
            ev.data = Some(crate::event::Data::from(
                json!({"target": id, "to": "open"}),
            ));
            ev
        };
        let mut routed = std::collections::BTreeSet::new();
        let mut named: Vec<String> = Vec::new();
        let mut summaries = 0;
        let mut summarise = |u: &Unannounced, named: &mut Vec<String>| {
            let Some(s) = u.take_transitions(Kind::BreakerOpened, 0) else {
                return false;
            };
            let data = s.data.as_ref().expect("data").value().clone();
            let ids = summarised_targets(&s);
            assert!(
                (1..=TRANSITION_SUMMARY_TARGETS).contains(&ids.len()),
                "{data}"
            );
            assert_eq!(data["count"], ids.len(), "one drop each: {data}");
            assert_eq!(s.subject, None, "about no single target");
            named.extend(ids);
            summaries += 1;
            true
        };
        let mut churn_admitted = 0;
        for step in 0..100 {
            // 100 ms a step: 100 half-opens of the targets down, then 10 targets open.
            for h in 0..100 {
                let id = format!("h{}", (step * 100 + h) % 1_000);
                churn_admitted += usize::from(limits.admit(Kind::BreakerHalfOpened, Some(&id)));
            }
            for o in 0..10 {
                let id = format!("o{}", step * 10 + o);
                if limits.admit(Kind::BreakerOpened, Some(&id)) {
                    routed.insert(id);
                } else {
                    u.add(&opened(&id));
                }
            }
            clock.advance(Duration::from_millis(100));
            if step % 10 == 9 {
                summarise(&u, &mut named);
            }
        }
        // The half-opens stay bounded: their burst, then 50 a second.
        assert!((600..=750).contains(&churn_admitted), "{churn_admitted}");
        // `opened` had its own: its burst of 200 and 50 a second.
        assert!((600..=750).contains(&routed.len()), "{}", routed.len());
        // After the outage the rest comes out, the summaries going on a second apart.
        while summarise(&u, &mut named) {}
        assert!(summaries >= 4, "{summaries}");
        let named_set: std::collections::BTreeSet<String> = named.iter().cloned().collect();
        assert_eq!(named_set.len(), named.len(), "each named once");
        assert!(routed.is_disjoint(&named_set));
        let all: std::collections::BTreeSet<String> = routed.union(&named_set).cloned().collect();
        assert_eq!(all.len(), 1_000, "every opened routed or named");
    }

    /// Dropped `opened` come back, oldest first, at most `TRANSITION_SUMMARY_TARGETS` a
    /// summary, with how many more wait; a summary dropped in turn is pending again whole;
    /// `closed` has its own summaries and `half_opened` none.
    #[test]
    fn dropped_transitions_are_named_oldest_first_and_kept_if_the_summary_is_dropped() {
        let u = Unannounced::default();
        let transition = |ty: &str, id: &str| crate::deliver::system_event(ty, id, 0);
        for i in 0..150 {
            u.add(&transition("router.breaker.opened", &format!("t{i:03}")));
        }
        // t000 opened again before it was named: counted, not named twice.
        u.add(&transition("router.breaker.opened", "t000"));
        u.add(&transition("router.breaker.half_opened", "t001"));
        u.add(&transition("router.breaker.closed", "t002"));
        let first = u.take_transitions(Kind::BreakerOpened, 0).expect("pending");
        let data = first.data.as_ref().expect("data").value().clone();
        let expected: Vec<String> = (0..100).map(|i| format!("t{i:03}")).collect();
        assert_eq!(summarised_targets(&first), expected);
        assert_eq!(
            (&data["count"], &data["pending"], &data["to"]),
            (&json!(101), &json!(50), &json!("open"))
        );
        assert_eq!(first.ty, "router.breaker.opened");
        // Dropped in its turn: its targets wait again, its count whole.
        u.add(&first);
        let mut count = 0;
        let mut seen = Vec::new();
        while let Some(s) = u.take_transitions(Kind::BreakerOpened, 0) {
            count += s.data.as_ref().expect("data").value()["count"]
                .as_u64()
                .expect("count");
            seen.extend(summarised_targets(&s));
        }
        seen.sort();
        assert_eq!(count, 151);
        assert_eq!(seen.len(), 150);
        let closed = u.take_transitions(Kind::BreakerClosed, 0).expect("pending");
        assert_eq!(summarised_targets(&closed), ["t002"]);
        assert_eq!(closed.data.as_ref().expect("data").value()["to"], "closed");
        assert!(u.take_transitions(Kind::BreakerHalfOpened, 0).is_none());
        assert!(u.targets().is_empty(), "no dead letters among them");
    }

    /// Rules: `router.breaker.opened` to `pager` and to `o1`, a target the summary names.
    const BREAKER_RULES: &str = "rules:\n  - name: alerts\n    pattern:\n      type: [router.breaker.opened]\n    targets:\n      - webhook: http://127.0.0.1:9/pager\n        id: pager\n      - webhook: http://127.0.0.1:9/o1\n        id: o1\n";

    /// Dropped `router.breaker.opened` of 150 targets reach the alert route as summaries
    /// (100 named, then 50, a second later), never delivered to a target they name: `o1`,
    /// named by the first, gets the second only.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropped_opened_reach_the_alert_route_in_summaries() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = crate::app::test_config(dir.path());
        std::fs::write(cfg.rules_dir.join("r.yaml"), BREAKER_RULES).expect("rules");
        let store = crate::store::RedbStore::in_memory().expect("store");
        let (app, rx) = crate::app::test_app_raising(cfg, store);
        for i in 0..150 {
            let ev = crate::deliver::system_event("router.breaker.opened", &format!("o{i}"), 0);
            dropped(app.dispatcher.context(), &ev, "past its rate limit");
        }
        let (tracker, cancel) = (TaskTracker::new(), CancellationToken::new());
        spawn_router(&app, &tracker, cancel.clone(), rx);
        // Two summaries a second apart; generous for a loaded machine.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let summaries = loop {
            let stored = app
                .store
                .events_between(0, i64::MAX, 0, 100, usize::MAX)
                .await
                .expect("archive");
            let summaries: Vec<Value> = stored
                .iter()
                .filter(|e| e.event.ty == "router.breaker.opened")
                .map(|e| e.event.data.as_ref().expect("data").value().clone())
                .collect();
            if summaries.len() >= 2 || std::time::Instant::now() > deadline {
                break summaries;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        cancel.cancel();
        assert_eq!(summaries.len(), 2, "{summaries:?}");
        let mut named: Vec<String> = summaries
            .iter()
            .flat_map(|d| d["targets"].as_array().cloned().unwrap_or_default())
            .filter_map(|id| id.as_str().map(str::to_owned))
            .collect();
        named.sort();
        named.dedup();
        assert_eq!(named.len(), 150);
        assert!(summaries.iter().all(|d| d["unannounced"] == true));
        let stats = app.store.queue_stats();
        assert_eq!(stats["pager"].queued, 2);
        assert_eq!(
            stats.get("o1").map_or(0, |s| s.queued),
            1,
            "only the summary that does not name it"
        );
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
