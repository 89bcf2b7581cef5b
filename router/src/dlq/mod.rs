//! Dead letters and what operators do with them: filters, redrive jobs (after the fix, at a set
//! rate, resumable), purge, and replay jobs over the archive. Jobs persist their progress and
//! cursor in the same commit as the items they move, so a restart resumes them where they were
//! and never moves an item twice.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use crate::app::App;
use crate::contract::{ContractOutcome, ViolationReason};
use crate::event::FieldError;
use crate::rules::pattern::Pattern;
use crate::store::{
    DlqFilter, DlqReason, Job, JobKind, JobState, RedriveAction, ReplayItem, StoreError,
};

/// A DLQ filter as users write it (query string or JSON body).
#[derive(Debug, Clone, Default, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct FilterSpec {
    /// Target id.
    pub target: Option<String>,
    /// Reason (`permanent_error`, ...).
    pub reason: Option<String>,
    /// Rule name.
    pub rule: Option<String>,
    /// Event type.
    #[serde(rename = "type")]
    pub ty: Option<String>,
    /// Event source.
    pub source: Option<String>,
    /// RFC 3339: last failure at or after.
    pub since: Option<String>,
    /// RFC 3339: last failure before.
    pub until: Option<String>,
}

/// Parses an optional RFC 3339 query/body field into ms; the error points at `/name`.
pub(crate) fn parse_time(name: &str, v: Option<&String>) -> Result<Option<i64>, FieldError> {
    v.map(|s| {
        chrono::DateTime::parse_from_rfc3339(s)
            .map(|t| t.timestamp_millis())
            .map_err(|e| FieldError::new(format!("/{name}"), format!("not an RFC 3339 time: {e}")))
    })
    .transpose()
}

impl FilterSpec {
    /// Validates into a store filter; errors point at the field (`prefix` + `/field`).
    pub fn to_filter(&self, prefix: &str) -> Result<DlqFilter, Vec<FieldError>> {
        let mut errors = Vec::new();
        let reason = match self.reason.as_deref().map(str::parse::<DlqReason>) {
            Some(Ok(r)) => Some(r),
            Some(Err(())) => {
                errors.push(FieldError::new(
                    format!("{prefix}/reason"),
                    format!(
                        "unknown reason; one of {}",
                        DlqReason::ALL
                            .iter()
                            .map(|r| r.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
                None
            }
            None => None,
        };
        let mut time = |n: &str, v: Option<&String>| match parse_time(n, v) {
            Ok(t) => t,
            Err(mut e) => {
                e.pointer = format!("{prefix}{}", e.pointer);
                errors.push(e);
                None
            }
        };
        let since = time("since", self.since.as_ref());
        let until = time("until", self.until.as_ref());
        if let (Some(s), Some(u)) = (since, until)
            && s >= u
        {
            errors.push(FieldError::new(
                format!("{prefix}/until"),
                "must be later than since (the range is since ≤ last failure < until)",
            ));
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        Ok(DlqFilter {
            target: self.target.clone(),
            reason,
            rule: self.rule.clone(),
            event_type: self.ty.clone(),
            source: self.source.clone(),
            since,
            until,
            // Not a field of a written filter (redrive, purge, jobs): only `GET /v1/dlq`
            // takes it, from its own query parameter.
            emitted_by: None,
        })
    }
}

/// Body of `POST /v1/dlq/redrive`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedriveRequest {
    /// Which entries.
    #[serde(default)]
    pub filter: FilterSpec,
    /// Entries moved per second at most (default 10).
    #[serde(default = "default_rate")]
    pub rate_per_sec: f64,
    /// Required with an empty filter: the whole DLQ (every target's dead letters and the
    /// quarantined events), on purpose.
    #[serde(default)]
    pub all: bool,
}

/// Body of `POST /v1/replay`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplayRequest {
    /// RFC 3339 start (inclusive) of the acceptance-time range.
    pub from: String,
    /// RFC 3339 end (exclusive).
    pub to: String,
    /// An event pattern (EventBridge syntax) the replayed events must also match.
    #[serde(default)]
    pub filter: Option<Value>,
    /// Events replayed per second at most (default 10).
    #[serde(default = "default_rate")]
    pub rate_per_sec: f64,
    /// Replay the handlers' archived emissions (source `handler://…`) too. Off by default:
    /// the replay runs the handlers again on their parents, which emit them anew, so each
    /// derived event would reach its receivers twice. On for a replay whose rules no longer
    /// send the parents to the handler that made them.
    #[serde(default)]
    pub include_emitted: bool,
    /// Replay the events that fail their type's current contract too. Off by default: the
    /// replay goes through the pipeline as ingest does today (contract, then rules), and an
    /// event the current contract refuses is skipped (`skipped_contract`) rather than sent
    /// to receivers that ingest would now keep it from. On for an operator who wants the
    /// raw archive back.
    #[serde(default)]
    pub ignore_contracts: bool,
    /// Only these rules' targets get copies (with `targets` too, only those of its targets
    /// that are named there). Absent: every rule the event matches now. A replay through
    /// every rule sends each event again to the targets that already had it (under new
    /// idempotency keys): after a rule was disabled for a while, name that rule.
    #[serde(default)]
    pub rules: Option<Vec<String>>,
    /// Only these targets get copies (of those the event matches now). Absent: every target.
    #[serde(default)]
    pub targets: Option<Vec<String>>,
}

/// A replay's restriction to some rules and/or targets (its request's `rules` and `targets`,
/// kept in the job's spec): a replayed event is queued only for the targets it matches now
/// through one of the rules and among the targets named. `None` on either side: no
/// restriction on that side.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct ReplayRestriction {
    rules: Option<HashSet<String>>,
    targets: Option<HashSet<String>>,
}

impl ReplayRestriction {
    /// The restriction a job's stored spec holds. A `rules` or `targets` there that is not a
    /// list of names is an error, never "no restriction": that would widen the job to every
    /// target, the duplicates the restriction is there to avoid.
    fn of_spec(spec: &Value) -> Result<Self, String> {
        let names = |key: &str| -> Result<Option<HashSet<String>>, String> {
            match spec.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => serde_json::from_value::<Vec<String>>(v.clone())
                    .map(|names| Some(names.into_iter().collect()))
                    .map_err(|e| format!("the replay's {key} no longer read: {e}")),
            }
        };
        Ok(Self {
            rules: names("rules")?,
            targets: names("targets")?,
        })
    }

    /// Whether it restricts anything.
    fn is_some(&self) -> bool {
        self.rules.is_some() || self.targets.is_some()
    }

    /// What it names that the live rules no longer have (a reload removed or renamed it
    /// since the job was created, when every name was checked), if anything.
    fn gone(&self, live: &crate::rules::RuleSet) -> Option<String> {
        let mut gone: Vec<String> = Vec::new();
        let mut names = |what: &str,
                         set: &Option<HashSet<String>>,
                         known: &dyn Fn(&str) -> bool| {
            let mut missing: Vec<&String> = set.iter().flatten().filter(|n| !known(n)).collect();
            missing.sort();
            gone.extend(missing.into_iter().map(|n| format!("{what} {n:?}")));
        };
        names("rule", &self.rules, &|n| {
            live.rules.iter().any(|r| r.name == n)
        });
        names("target", &self.targets, &|n| live.targets.contains_key(n));
        (!gone.is_empty()).then(|| gone.join(", "))
    }

    /// Whether a copy for `entry` (a target matched through a rule) is the job's to queue.
    fn allows(&self, entry: &crate::store::NewEntry) -> bool {
        self.rules.as_ref().is_none_or(|r| r.contains(&entry.rule))
            && self
                .targets
                .as_ref()
                .is_none_or(|t| t.contains(&entry.target_id))
    }
}

/// The "did you mean" part of an error naming an unknown id: empty without a suggestion.
pub(crate) fn did_you_mean(suggestion: Option<&str>) -> String {
    match suggestion {
        Some(id) => format!("; did you mean {id:?}?"),
        None => String::new(),
    }
}

/// Checks a replay's `rules` and `targets` against the live rules: an empty list, or a name
/// the live rules do not have (a typo would make a job that skips every event and ends
/// `done`), is refused at its element (`/rules/0`) with the closest name. Returns the
/// warnings the job carries (a named rule that is disabled now queues nothing until enabled).
fn check_restriction(app: &App, req: &ReplayRequest, errors: &mut Vec<FieldError>) -> Vec<String> {
    let rules = app.rules.load();
    let disabled = app.disabled_rules();
    let mut warnings = Vec::new();
    if let Some(names) = &req.rules {
        if names.is_empty() {
            errors.push(FieldError::new(
                "/rules",
                "names no rule: name at least one, or leave it out to replay through every rule",
            ));
        }
        for (i, name) in names.iter().enumerate() {
            match rules.rules.iter().find(|r| &r.name == name) {
                Some(rule) if !rule.enabled => warnings.push(format!(
                    "rule {name:?} has `enabled: false` in {}:{}: the replay queues nothing through it (its events are skipped) unless it is enabled there before the job reaches them",
                    rule.file, rule.line
                )),
                Some(_) if disabled.contains(name) => warnings.push(format!(
                    "rule {name:?} is disabled (router rules enable {name}): the replay queues nothing through it (its events are skipped) unless it is enabled before the job reaches them"
                )),
                Some(_) => {}
                None => {
                    let known = closest(name, rules.rules.iter().map(|r| r.name.clone()));
                    errors.push(FieldError::new(
                        format!("/rules/{i}"),
                        format!(
                            "no live rule {name:?}{} (GET /v1/rules lists them)",
                            did_you_mean(known.first().map(String::as_str))
                        ),
                    ));
                }
            }
        }
    }
    if let Some(ids) = &req.targets {
        if ids.is_empty() {
            errors.push(FieldError::new(
                "/targets",
                "names no target: name at least one, or leave it out to replay to every target",
            ));
        }
        for (i, id) in ids.iter().enumerate() {
            if rules.targets.contains_key(id) {
                continue;
            }
            // Only the live rules' targets: a replay routes through them, so a target removed
            // from the rules (even one still draining) can get no copy.
            let known = closest(id, rules.targets.keys().cloned());
            errors.push(FieldError::new(
                format!("/targets/{i}"),
                format!(
                    "no target {id:?} in the live rules{}; a replay queues only for targets the live rules name (GET /v1/targets lists them)",
                    did_you_mean(known.first().map(String::as_str))
                ),
            ));
        }
    }
    // Both known, but no named rule sends to a named target: the job would queue nothing.
    if let (Some(names), Some(ids)) = (&req.rules, &req.targets)
        && errors.is_empty()
        && !rules
            .rules
            .iter()
            .filter(|r| names.contains(&r.name))
            .any(|r| r.target_ids.iter().any(|t| ids.contains(t)))
    {
        errors.push(FieldError::new(
            "/targets",
            "none of these targets is a target of the rules named in `rules`: the replay would queue nothing",
        ));
    }
    warnings
}

fn default_rate() -> f64 {
    10.0
}

/// Controls of running jobs (pause/cancel act through them).
#[derive(Default)]
pub struct Jobs {
    handles: Mutex<HashMap<String, Arc<Mutex<JobState>>>>,
    /// One lock per job, held by its runner task for the task's life: a runner started while
    /// an earlier one of the same job is still finishing its step here waits for it, so a job
    /// never has two runners on one node, and "a runner is alive here" is a try-lock.
    runs: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// On a store several nodes share: this node's identity, which it writes into the jobs it
    /// runs (`Job::runner`), so that each job runs on one node and a dead node's jobs are
    /// taken over.
    node: Option<String>,
    /// On a shared store: each running job of another node as this node's take-over rounds
    /// last saw it, its revision and when this node first saw that revision. A job whose
    /// revision has not moved for `JOB_STALE` of this node's own clock is taken over: the
    /// nodes' wall clocks are never compared (one running ahead would take live jobs over).
    seen: Mutex<HashMap<String, (u64, tokio::time::Instant)>>,
    /// The error of the last step of each job running here, while its runner waits to try the
    /// step again. Shown by the job API even when the store could not take it into the job.
    failing: Mutex<HashMap<String, String>>,
}

/// How often a job's runner renews its claim when no step wrote it, ms.
const HEARTBEAT_MS: i64 = 5_000;

/// A running job whose revision has not moved for this long (its runner renews it every
/// `HEARTBEAT_MS`) is taken over by another node.
const JOB_STALE: Duration = Duration::from_secs(30);

/// A step the store failed (a compaction, an unreachable server) is tried again after this
/// long, doubling up to `STEP_RETRY_MAX`: the job waits, shown as failing, instead of stopping.
const STEP_RETRY_MIN: Duration = Duration::from_secs(1);
const STEP_RETRY_MAX: Duration = Duration::from_secs(30);

/// How many times an operator's change is tried against a job that its runner keeps writing.
const CONTROL_ATTEMPTS: usize = 8;

/// How often each node of a shared store looks for running jobs to take over.
const TAKEOVER_INTERVAL: Duration = Duration::from_secs(10);

impl Jobs {
    /// The controls of a node that shares its store with others, as `node`.
    pub fn shared(node: String) -> Self {
        Self {
            handles: Mutex::default(),
            runs: Mutex::default(),
            node: Some(node),
            seen: Mutex::default(),
            failing: Mutex::default(),
        }
    }

    /// Records (or, with `None`, clears) the error of `id`'s last step here.
    fn set_failing(&self, id: &str, error: Option<String>) {
        let mut failing = self.failing.lock().unwrap_or_else(|p| p.into_inner());
        match error {
            Some(e) => failing.insert(id.to_owned(), e),
            None => failing.remove(id),
        };
    }

    /// `job` as this node knows it: a step failing here shows as its `last_error`.
    pub fn shown(&self, mut job: Job) -> Job {
        if let Some(e) = self
            .failing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&job.id)
        {
            job.last_error = Some(e.clone());
        }
        job
    }

    fn run_lock(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.runs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(id.to_owned())
            .or_default()
            .clone()
    }

    /// Whether a runner task of `id` is alive on this node (it may be finishing a step after
    /// being told to stop).
    fn running_here(&self, id: &str) -> bool {
        self.runs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .is_some_and(|l| l.try_lock().is_err())
    }

    /// Drops what this node keeps in memory for `ids`, jobs whose records were removed
    /// (ended past their retention): each job ever run left its control and run lock here
    /// for the life of the process. A run lock still held (a runner finishing) stays.
    fn forget(&self, ids: &[String]) {
        let mut handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
        let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let mut failing = self.failing.lock().unwrap_or_else(|p| p.into_inner());
        for id in ids {
            if runs.get(id).is_some_and(|l| l.try_lock().is_err()) {
                continue;
            }
            runs.remove(id);
            handles.remove(id);
            seen.remove(id);
            failing.remove(id);
        }
    }

    /// How many jobs this node keeps controls for (tests).
    #[cfg(test)]
    fn remembered(&self) -> usize {
        self.handles.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    fn handle(&self, id: &str) -> Option<Arc<Mutex<JobState>>> {
        self.handles
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }
}

/// Why a job operation was refused.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// Bad request.
    #[error("invalid request")]
    Invalid(Vec<FieldError>),
    /// No such job.
    #[error("unknown job")]
    NotFound,
    /// The job cannot go to that state.
    #[error("job is {0:?}")]
    Conflict(JobState),
    /// The filter names a target the router does not know: not in the live rules, not
    /// running, and with no dead letters (a typo would otherwise make a job that moves nothing
    /// and ends `done`).
    #[error("unknown target {target:?}")]
    UnknownTarget {
        /// The id as given.
        target: String,
        /// The ids the router knows (live rules, running workers, dead letters), closest
        /// first: the caller picks what it may show.
        known: Vec<String>,
    },
    /// The store is past its disk high-water mark (`store.max_disk_bytes`): a replay writes
    /// a copy of every event it goes through, which is refused as ingest is until the store
    /// is below its low-water mark.
    #[error("the store is past its disk high-water mark")]
    DiskFull,
    /// So many jobs of its kind were created at the same moment that this one found no free
    /// number (see `NEW_JOB_NUMBERS`): nothing was created; the same request may be sent again.
    #[error("too many jobs were created at once; nothing was created, try again")]
    CreationRace,
    /// Storage failure.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The number in a job's id (`redrive-7`, or `redrive-7-1a2b` on a shared store).
fn job_number(id: &str) -> Option<u64> {
    id.split('-').nth(1)?.parse().ok()
}

/// A new job's id: its kind and the next number after the highest of that kind. Numbers are
/// never reused: the retention sweep keeps the newest job of each kind, and a replay's id is
/// part of its deliveries' idempotency keys (a reused one would have receivers take a new
/// replay's deliveries for the old one's).
async fn next_job_id(app: &App, kind: JobKind) -> Result<String, StoreError> {
    let jobs = app.store.jobs().await?;
    let of_kind = jobs.iter().filter(|j| j.kind == kind);
    let highest = of_kind.clone().filter_map(|j| job_number(&j.id)).max();
    let n = highest.unwrap_or(0).max(of_kind.count() as u64) + 1;
    Ok(job_id(app, kind, n))
}

/// The id of job number `n` of `kind`.
fn job_id(app: &App, kind: JobKind, n: u64) -> String {
    let prefix = kind.as_str();
    if app.jobs.node.is_some() {
        // Two nodes creating a job at once would count the same jobs: a random part keeps
        // their ids apart.
        return format!("{prefix}-{n}-{:04x}", rand::random::<u16>());
    }
    format!("{prefix}-{n}")
}

/// How many numbers a new job tries before its creation is refused as
/// [`JobError::CreationRace`]. Each refusal means another job took that number, so N
/// creations at once need at most N − 1 tries each; past this many, the operator is told to
/// try again rather than the creations going on for ever.
const NEW_JOB_NUMBERS: u32 = 1024;

/// Stores a new job. Jobs of a kind created at once read the same highest number: each one
/// that loses the race for a number (its put is refused, nothing written) takes the next
/// number up. It does not read the jobs again: a read that raced the other creations' commits
/// took the same lost number again, and 8 such tries answered 5 of 16 creations at once with
/// a 503 "storage unavailable".
async fn put_new_job(app: &App, job: &mut Job) -> Result<(), JobError> {
    for _ in 0..NEW_JOB_NUMBERS {
        match app.store.put_job(job.clone()).await {
            Ok(rev) => {
                job.rev = rev;
                return Ok(());
            }
            Err(StoreError::JobChanged(_)) => {
                let n = job_number(&job.id).unwrap_or(0) + 1;
                job.id = job_id(app, job.kind, n);
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(JobError::CreationRace)
}

/// Removes the jobs that ended (done or cancelled) more than `retention` before `now`, except
/// the newest job of each kind (whose number the next job's id follows). Returns how many went.
pub async fn sweep_jobs(app: &App, now: i64, retention: Duration) -> Result<u64, StoreError> {
    let retention_ms = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
    let jobs = app.store.jobs().await?;
    let newest = |kind: JobKind| {
        jobs.iter()
            .filter(|j| j.kind == kind)
            .max_by_key(|j| (job_number(&j.id), j.created_at))
            .map(|j| j.id.clone())
    };
    let keep = [newest(JobKind::Redrive), newest(JobKind::Replay)];
    let expired: Vec<Job> = jobs
        .iter()
        .filter(|j| {
            j.state.finished()
                && now.saturating_sub(j.updated_at) > retention_ms
                && !keep.contains(&Some(j.id.clone()))
        })
        .cloned()
        .collect();
    if expired.is_empty() {
        return Ok(0);
    }
    let ids: Vec<String> = expired.iter().map(|j| j.id.clone()).collect();
    let removed = app.store.delete_jobs(expired).await?;
    app.jobs.forget(&ids);
    if removed > 0 {
        tracing::info!(removed, retention = ?retention, "finished jobs past their retention removed");
    }
    Ok(removed)
}

/// The target ids the router knows, most like `wanted` first (then by name); those too
/// unlike it to be a typo of it are left out.
fn closest_targets(app: &App, wanted: &str) -> Vec<String> {
    let mut ids: std::collections::BTreeSet<String> =
        app.rules.load().targets.keys().cloned().collect();
    ids.extend(app.dispatcher.running().into_iter().map(|s| s.id));
    ids.extend(
        app.store
            .queue_stats()
            .into_iter()
            .filter(|(_, s)| s.dlq > 0)
            .map(|(id, _)| id),
    );
    closest(wanted, ids)
}

/// Of `names`, those like `wanted`, most like it first (then by name); those too unlike it
/// to be a typo of it are left out.
fn closest(wanted: &str, names: impl IntoIterator<Item = String>) -> Vec<String> {
    let names: std::collections::BTreeSet<String> = names.into_iter().collect();
    let mut scored: Vec<(f64, String)> = names
        .into_iter()
        .map(|id| (strsim::normalized_damerau_levenshtein(wanted, &id), id))
        // Below half alike it is another name, not a typo: suggesting it would mislead.
        .filter(|(score, _)| *score >= 0.5)
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    scored.into_iter().map(|(_, id)| id).collect()
}

/// Refuses a filter naming a target the router does not know: one not in the live rules, not
/// running (a removed target still draining is) and with no dead letters. `none` (the
/// dead letters without a target) is always known.
pub(crate) async fn check_target(app: &App, target: &str) -> Result<(), JobError> {
    if target == crate::store::NO_TARGET
        || app.rules.load().targets.contains_key(target)
        || app.dispatcher.runtime(target).is_some()
    {
        return Ok(());
    }
    let only_target = DlqFilter {
        target: Some(target.to_owned()),
        ..DlqFilter::default()
    };
    if !app.store.dlq_list(&only_target, None, 1).await?.is_empty() {
        return Ok(());
    }
    Err(JobError::UnknownTarget {
        target: target.to_owned(),
        known: closest_targets(app, target),
    })
}

/// Refuses a rate the runner would not keep: below `MIN_RATE` it would run at that floor,
/// not at what the job says (and echoes), above `MAX_RATE` steps cannot keep up.
fn check_rate(rate: f64) -> Result<(), FieldError> {
    // NaN is in no range: refused too.
    if (MIN_RATE..=MAX_RATE).contains(&rate) {
        return Ok(());
    }
    Err(FieldError::new(
        "/rate_per_sec",
        format!(
            "must be in [{MIN_RATE}, {MAX_RATE}]: slower than {MIN_RATE} a second a job would hardly move, and it moves at most {MAX_STEP_ITEMS} items a step, ten steps a second"
        ),
    ))
}

/// Creates and starts a redrive job.
pub async fn create_redrive(app: &Arc<App>, req: RedriveRequest) -> Result<Job, JobError> {
    let job = new_redrive(app, &req).await?;
    spawn(app, job.clone());
    tracing::warn!(job = %job.id, total = job.total, rate = req.rate_per_sec, "redrive job created");
    Ok(job)
}

/// Checks `req` and stores its redrive job, claimed by this node, not yet started.
async fn new_redrive(app: &App, req: &RedriveRequest) -> Result<Job, JobError> {
    let filter = req.filter.to_filter("/filter").map_err(JobError::Invalid)?;
    check_rate(req.rate_per_sec).map_err(|e| JobError::Invalid(vec![e]))?;
    if filter == DlqFilter::default() && !req.all {
        // As for purge: a forgotten flag must not send every target's dead letters (the
        // quarantined events with them) back at once.
        return Err(JobError::Invalid(vec![FieldError::new(
            "/filter",
            "an empty filter would redrive the whole DLQ: name at least one of target, reason, rule, type, source, since, until; or set \"all\": true to redrive every entry",
        )]));
    }
    if let Some(target) = &filter.target {
        check_target(app, target).await?;
    }
    // The job takes the dead letters made by now, and only those: one made later (one of its
    // own entries failing again, at once or when a node that died holding it comes back) is
    // not its to move, or it would move an entry twice and count past its total. The mark is
    // read first, and the total counts only what it covers. `max_id` (its highest id) also
    // bounds the jobs of versions that read no mark.
    let mark = app.store.dlq_mark().await?;
    let total = count_matching(app, &filter, mark.made).await?;
    let now = app.clock.now_ms();
    let mut job = Job {
        id: next_job_id(app, JobKind::Redrive).await?,
        kind: JobKind::Redrive,
        state: JobState::Running,
        spec: serde_json::json!({
            "filter": req.filter,
            "rate_per_sec": req.rate_per_sec,
            "max_id": mark.max_id,
            "made_by": mark.made,
        }),
        total,
        moved: 0,
        failed: 0,
        skipped: 0,
        skipped_emitted: 0,
        skipped_contract: 0,
        skipped_restricted: 0,
        expired: 0,
        warnings: Vec::new(),
        last_item_at: None,
        cursor: 0,
        created_at: now,
        updated_at: now,
        last_error: None,
        runner: None,
        heartbeat_at: 0,
        rev: 0,
    };
    claim(app, &mut job);
    put_new_job(app, &mut job).await?;
    Ok(job)
}

/// Creates and starts a replay job.
pub async fn create_replay(app: &Arc<App>, req: ReplayRequest) -> Result<Job, JobError> {
    let mut errors = Vec::new();
    let from = parse_time("from", Some(&req.from)).unwrap_or_else(|e| {
        errors.push(e);
        None
    });
    let to = parse_time("to", Some(&req.to)).unwrap_or_else(|e| {
        errors.push(e);
        None
    });
    if let Some(f) = &req.filter
        && let Err(es) = Pattern::compile(f)
    {
        errors.extend(
            es.into_iter()
                .map(|e| FieldError::new(format!("/filter{}", e.pointer), e.message)),
        );
    }
    if let Err(e) = check_rate(req.rate_per_sec) {
        errors.push(e);
    }
    let restriction_warnings = check_restriction(app, &req, &mut errors);
    let now = app.clock.now_ms();
    // Events accepted after the job is created are not replayed: a `to` in the future would
    // have the job follow ingest for ever (and deliver each new event twice).
    let to = to.map(|t| t.min(now));
    if from.is_some_and(|f| f >= now) {
        errors.push(FieldError::new("/from", "must be in the past"));
    } else if let (Some(f), Some(t)) = (from, to)
        && f >= t
    {
        errors.push(FieldError::new("/to", "must be after from"));
    }
    if !errors.is_empty() {
        return Err(JobError::Invalid(errors));
    }
    // Past the mark a replay would write past it: 4 of them took a store from 17.8 MB to
    // 35.6 MB over a 10 MB mark while ingest was refused.
    if app.disk_full.load(std::sync::atomic::Ordering::Relaxed) {
        return Err(JobError::DiskFull);
    }
    // Counted now, so the job's progress reads against the whole range from its first step.
    let total = app
        .store
        .count_events_between(from.unwrap_or(0), to.unwrap_or(0))
        .await?;
    // Accepted as asked (what is left is replayed), but said: a range the archive no longer
    // holds read as an empty one, total 0 and `done`, even for a range in 1900.
    let horizon = archive_horizon(&app.cfg, now);
    let mut warnings = Vec::new();
    if from.is_some_and(|f| f < horizon) {
        warnings.push(format!(
            "events accepted before {} are no longer archived ({}): the range's events from before then are gone, except any a queue or DLQ entry still holds",
            crate::clock::rfc3339(horizon),
            retention_note(&app.cfg)
        ));
    }
    warnings.extend(restriction_warnings);
    let mut job = Job {
        id: next_job_id(app, JobKind::Replay).await?,
        kind: JobKind::Replay,
        state: JobState::Running,
        spec: serde_json::json!({ "from": req.from, "to": req.to, "filter": req.filter, "rate_per_sec": req.rate_per_sec, "include_emitted": req.include_emitted, "ignore_contracts": req.ignore_contracts, "rules": req.rules, "targets": req.targets, "from_ms": from, "to_ms": to }),
        total,
        moved: 0,
        failed: 0,
        skipped: 0,
        skipped_emitted: 0,
        skipped_contract: 0,
        skipped_restricted: 0,
        expired: 0,
        warnings,
        last_item_at: None,
        cursor: 0,
        created_at: now,
        updated_at: now,
        last_error: None,
        runner: None,
        heartbeat_at: 0,
        rev: 0,
    };
    claim(app, &mut job);
    put_new_job(app, &mut job).await?;
    spawn(app, job.clone());
    tracing::warn!(job = %job.id, from = %req.from, to = %req.to, rules = ?req.rules, targets = ?req.targets, total, warnings = ?job.warnings, "replay job created");
    Ok(job)
}

/// The archive's horizon at `now`: the sweep removes the events accepted before it (those no
/// queue or DLQ entry holds), as `Config::event_retention` and the sweep's cut say.
fn archive_horizon(cfg: &crate::config::Config, now: i64) -> i64 {
    let kept = i64::try_from(cfg.event_retention().as_millis()).unwrap_or(i64::MAX);
    now.saturating_sub(kept)
}

/// The setting(s) behind the archive's horizon, as an operator would change them.
fn retention_note(cfg: &crate::config::Config) -> String {
    let archive = cfg.archive.retention;
    let kept = cfg.event_retention();
    if kept == archive {
        format!(
            "archive.retention = {}",
            humantime::format_duration(archive)
        )
    } else {
        // delivery.retention or the dedup window keeps events longer than the archive asks.
        format!(
            "archive.retention = {}; events are kept for {}, the longest of archive.retention, delivery.retention and ingest.dedup_window",
            humantime::format_duration(archive),
            humantime::format_duration(kept)
        )
    }
}

/// How many dead letters match `filter` among those made by `made_by` (a [`DlqMark::made`](crate::store::DlqMark::made)).
async fn count_matching(app: &App, filter: &DlqFilter, made_by: u64) -> Result<u64, StoreError> {
    let mut n = 0;
    let mut after = None;
    loop {
        let page = app.store.dlq_list(filter, after, 1000).await?;
        n += page.iter().filter(|d| d.made() <= made_by).count() as u64;
        match page.last() {
            Some(d) if page.len() == 1000 => after = Some(d.id),
            _ => return Ok(n),
        }
    }
}

/// Resumes every job that was running when the router stopped. On a store several nodes
/// share: the jobs this node ran (or no node claimed); the others run elsewhere, and a
/// background task takes them over if their node stops renewing them.
pub async fn resume_all(
    app: &Arc<App>,
    tracker: &tokio_util::task::TaskTracker,
    cancel: tokio_util::sync::CancellationToken,
) -> Result<(), StoreError> {
    start_due(app).await?;
    if app.jobs.node.is_some() {
        let app = app.clone();
        tracker.spawn(async move {
            loop {
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = tokio::time::sleep(TAKEOVER_INTERVAL) => {}
                }
                if let Err(e) = start_due(&app).await {
                    tracing::warn!(error = %e, "cannot look for jobs to take over");
                }
            }
        });
    }
    Ok(())
}

/// Starts every running job that is this node's to run and has no runner here: its own (on
/// a store of its own, every one), and on a shared store those whose node stopped renewing
/// them (their revision unchanged for `JOB_STALE` of this node's clock).
async fn start_due(app: &Arc<App>) -> Result<(), StoreError> {
    let jobs = app.store.jobs().await?;
    let now = tokio::time::Instant::now();
    let due: Vec<Job> = {
        let mut seen = app.jobs.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.retain(|id, _| {
            jobs.iter()
                .any(|j| &j.id == id && j.state == JobState::Running)
        });
        jobs.into_iter()
            .filter(|job| {
                // Judged by the run lock, not the handle's state: a runner that stopped on
                // an error or on another node's change leaves its handle paused, and must be
                // startable again.
                if job.state != JobState::Running || app.jobs.running_here(&job.id) {
                    return false;
                }
                if ours(app, job) {
                    return true;
                }
                let at = seen.entry(job.id.clone()).or_insert((job.rev, now));
                if at.0 != job.rev {
                    *at = (job.rev, now);
                }
                now.duration_since(at.1) >= JOB_STALE
            })
            .collect()
    };
    for job in due {
        if ours(app, &job) {
            tracing::info!(job = %job.id, moved = job.moved, "resuming job");
        } else {
            tracing::warn!(job = %job.id, runner = ?job.runner, moved = job.moved, "taking over a job its node stopped running");
        }
        spawn(app, job);
    }
    Ok(())
}

/// Whether `job` is this node's own to run: every job on a store of its own; on a shared one,
/// a job this node ran or no node claimed.
fn ours(app: &App, job: &Job) -> bool {
    match &app.jobs.node {
        None => true,
        Some(node) => job.runner.as_ref().is_none_or(|r| r == node),
    }
}

/// One job by id.
pub async fn get(app: &App, id: &str) -> Result<Job, JobError> {
    let job = app.store.job(id).await?.ok_or(JobError::NotFound)?;
    Ok(app.jobs.shown(job))
}

/// Pause, resume or cancel. The change is written against the job's revision: a step its
/// runner (here or on another node) finishes meanwhile makes the write fail and the job is
/// read again, so the change carries the step's progress; a step that comes after it is
/// refused, and its runner stops.
pub async fn control(app: &Arc<App>, id: &str, to: JobState) -> Result<Job, JobError> {
    for _ in 0..CONTROL_ATTEMPTS {
        let mut job = get(app, id).await?;
        let allowed = matches!(
            (job.state, to),
            (JobState::Running, JobState::Paused)
                | (JobState::Paused, JobState::Running)
                | (JobState::Running | JobState::Paused, JobState::Cancelled)
        );
        if !allowed {
            return Err(JobError::Conflict(job.state));
        }
        job.state = to;
        job.updated_at = app.clock.now_ms();
        if to == JobState::Running {
            // Resumed here, it runs here: the node that ran it before must not take it back.
            claim(app, &mut job);
        }
        match app.store.put_job(job.clone()).await {
            Ok(rev) => job.rev = rev,
            Err(StoreError::JobChanged(_)) => continue,
            Err(e) => return Err(e.into()),
        }
        if to == JobState::Running {
            spawn(app, job.clone());
        } else if let Some(h) = app.jobs.handle(id) {
            // Its runner here stops at its next tick instead of at its next write.
            *h.lock().unwrap_or_else(|p| p.into_inner()) = to;
        }
        tracing::warn!(job = %id, state = ?to, "job state changed by an operator");
        return Ok(job);
    }
    Err(StoreError::JobChanged(id.to_string()).into())
}

/// On a shared store: marks `job` as run by this node, from now.
fn claim(app: &App, job: &mut Job) {
    if let Some(node) = &app.jobs.node {
        job.runner = Some(node.clone());
        job.heartbeat_at = app.clock.now_ms();
    }
}

/// Starts a runner of `job` (as read at `job.rev`). A runner still going here stops first; a
/// runner started from a copy that is no longer current finds out at its first write and
/// stops.
fn spawn(app: &Arc<App>, mut job: Job) {
    claim(app, &mut job);
    let handle = Arc::new(Mutex::new(JobState::Running));
    let replaced = app
        .jobs
        .handles
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(job.id.clone(), handle.clone());
    if let Some(old) = replaced {
        // A runner still going here (paused and resumed before it read the pause) stops at
        // its next tick; the new one waits for it below.
        *old.lock().unwrap_or_else(|p| p.into_inner()) = JobState::Paused;
    }
    let run_lock = app.jobs.run_lock(&job.id);
    let app = app.clone();
    tokio::spawn(async move {
        let id = job.id.clone();
        let _only_runner = run_lock.lock_owned().await;
        if *handle.lock().unwrap_or_else(|p| p.into_inner()) != JobState::Running {
            return;
        }
        let result = run(&app, job, handle.clone()).await;
        *handle.lock().unwrap_or_else(|p| p.into_inner()) = JobState::Paused;
        match result {
            Ok(()) => {}
            Err(StoreError::JobChanged(_)) => {
                // Paused, cancelled or resumed by an operator, or taken over by another node,
                // since this runner last wrote it: whoever wrote it owns what happens next.
                tracing::info!(job = %id, "job changed since its runner here read it; the runner stops");
            }
            // Not running here any more: on a shared store this node's take-over round starts
            // it again (it is still this node's); on its own store the next start does.
            Err(e) if app.jobs.node.is_some() => {
                tracing::error!(job = %id, error = %e, "job stopped with an error; it is started again within a take-over round");
            }
            Err(e) => {
                tracing::error!(job = %id, error = %e, "job stopped with an error; it resumes at the next start");
            }
        }
    });
}

const TICK: Duration = Duration::from_millis(100);

/// A replay's `last_error` while it waits for the disk (see `run`).
const DISK_FULL_WAIT: &str = "waiting: the store is past its disk high-water mark (store.max_disk_bytes); the replay goes on once it is below its low-water mark";

/// Most items one step moves or replays: a step is one store commit, shared with ingest's
/// writes, and a replay step holds its events in memory. With a step every `TICK`, a job goes
/// no faster than 10 × this per second whatever its rate.
const MAX_STEP_ITEMS: usize = 1000;

/// Most bytes of stored events one replay step reads (past the first event, which it always
/// takes): a step held up to `MAX_STEP_ITEMS` whole events, those its filter skips too
/// (200 events of 900 KB took 170 MB), and jobs are not limited in number.
const MAX_STEP_BYTES: usize = 8 << 20;

/// Most warnings a job keeps (events a replay could not take, past its creation warnings).
const MAX_JOB_WARNINGS: usize = 20;

/// The highest `rate_per_sec` a job takes: what `MAX_STEP_ITEMS` a `TICK` allows.
const MAX_RATE: f64 = 10_000.0;

/// The lowest `rate_per_sec` a job takes and runs at (an item about every 17 minutes). A job
/// stored with a lower rate (created before such rates were refused) runs at this.
const MIN_RATE: f64 = 0.001;

async fn run(app: &Arc<App>, mut job: Job, handle: Arc<Mutex<JobState>>) -> Result<(), StoreError> {
    let rate = job.spec["rate_per_sec"]
        .as_f64()
        .unwrap_or(10.0)
        .max(MIN_RATE);
    let mut tokens = 0.0f64;
    let mut last = std::time::Instant::now();
    // The stored filter was checked when the job was created; one that no longer reads (a
    // version that changed a reason's name or a pattern operator) must not widen the job to
    // every entry or event: the job is paused with the reason instead.
    let spec_filter = job.spec.get("filter").filter(|f| !f.is_null()).cloned();
    let (pattern, filter) = match read_filters(job.kind, spec_filter) {
        Ok(f) => f,
        Err(why) => {
            tracing::error!(job = %job.id, error = %why, "a job's stored filter does not read; the job is paused");
            let why = format!(
                "{why}; paused: cancel it and start a new job with a filter this version reads"
            );
            return pause_for(app, &mut job, &handle, why).await;
        }
    };
    let restriction = match job.kind {
        JobKind::Replay => ReplayRestriction::of_spec(&job.spec),
        JobKind::Redrive => Ok(ReplayRestriction::default()),
    };
    let (pattern, filter, restriction) = match (pattern, filter, restriction) {
        (p, f, Ok(r)) => (p, f, r),
        (_, _, Err(why)) => {
            tracing::error!(job = %job.id, error = %why, "a replay's stored restriction does not read; the job is paused");
            let why = format!(
                "{why}; paused: cancel it and start a new job with rules and targets this version reads"
            );
            return pause_for(app, &mut job, &handle, why).await;
        }
    };
    let running = || *handle.lock().unwrap_or_else(|p| p.into_inner()) == JobState::Running;
    // On a shared store: the claim, before the first step (which may be a while at a low rate).
    let mut claim_due = app.jobs.node.is_some();
    let mut retry_in = STEP_RETRY_MIN;
    let mut held_by_disk = false;
    let result = loop {
        tokio::time::sleep(TICK).await;
        if !running() {
            break Ok(());
        }
        // A replay writes a copy of each event it goes through: past the disk's high-water
        // mark its steps wait (its heartbeat goes on), as ingest does, and it says why. A
        // redrive moves dead letters back to their queues, about as much space freed as taken,
        // and goes on: draining the DLQ is one way back under the mark.
        if job.kind == JobKind::Replay {
            let full = app.disk_full.load(std::sync::atomic::Ordering::Relaxed);
            if full != held_by_disk {
                held_by_disk = full;
                if full {
                    tracing::warn!(job = %job.id, "the store is past its disk high-water mark: the replay waits until it is below its low-water mark");
                } else {
                    tracing::info!(job = %job.id, "the store is below its low-water mark: the replay goes on");
                    app.jobs.set_failing(&job.id, None);
                }
            }
            if full {
                // Shown as the job's `last_error` (a heartbeat's write clears it).
                app.jobs
                    .set_failing(&job.id, Some(DISK_FULL_WAIT.to_string()));
                tokens = 0.0;
                last = std::time::Instant::now();
                let heartbeat_due = app.jobs.node.is_some()
                    && app.clock.now_ms().saturating_sub(job.heartbeat_at) >= HEARTBEAT_MS;
                if !heartbeat_due {
                    continue;
                }
            }
        }
        let now_i = std::time::Instant::now();
        tokens = (tokens + rate * now_i.duration_since(last).as_secs_f64())
            .min(rate.max(1.0))
            .min(MAX_STEP_ITEMS as f64);
        last = now_i;
        let take = tokens.floor() as usize;
        let now = app.clock.now_ms();
        // On a shared store the claim is renewed while no step writes the job: other nodes
        // take over a job whose revision stops moving.
        let heartbeat_due = claim_due
            || (app.jobs.node.is_some() && now.saturating_sub(job.heartbeat_at) >= HEARTBEAT_MS);
        if take == 0 && !heartbeat_due {
            continue;
        }
        // What the store holds: a step that fails leaves the job as it was before it.
        let before = job.clone();
        job.last_error = None;
        let step = if take == 0 {
            job.heartbeat_at = now;
            app.store.put_job(job.clone()).await.map(|rev| {
                job.rev = rev;
                0
            })
        } else {
            // A step routes into the queues of live targets, or of removed ones still
            // draining: a reload must not remove (or dead-letter the queue of) a target, nor
            // the retirer stop a drained one's worker, between the step's look at them and
            // its commit, or its entries would wait in a queue no worker serves.
            let _routing = app.routing_guard().await;
            // A restriction naming what a reload removed since would skip the rest of the
            // range as `skipped_restricted` and end `done` (13 of 30 events in the audit's
            // case): the job stops for an operator instead, until the names are back.
            if job.kind == JobKind::Replay
                && let Some(gone) = restriction.gone(&app.rules.load())
            {
                tracing::warn!(job = %job.id, gone = %gone, "a restricted replay names what the live rules no longer have; the job is paused");
                break pause_for(
                    app,
                    &mut job,
                    &handle,
                    format!(
                        "{gone} is no longer in the live rules (a reload removed or renamed it): its events would be skipped; paused: resume it once the rules have it again, or cancel it and start a replay that names what they have now"
                    ),
                )
                .await;
            }
            match job.kind {
                JobKind::Redrive => redrive_step(app, &mut job, &filter, take, now).await,
                JobKind::Replay => {
                    replay_step(app, &mut job, pattern.as_ref(), &restriction, take, now).await
                }
            }
        };
        match step {
            Ok(n) => {
                claim_due = false;
                tokens -= n as f64;
                let kind = match job.kind {
                    JobKind::Redrive => "redrive",
                    JobKind::Replay => "replay",
                };
                for (outcome, now_n, was) in [
                    ("moved", job.moved, before.moved),
                    ("failed", job.failed, before.failed),
                    ("skipped", job.skipped, before.skipped),
                    ("expired", job.expired, before.expired),
                ] {
                    if now_n > was {
                        app.metrics
                            .job_items
                            .get_or_create(&vec![
                                ("kind", kind.to_string()),
                                ("outcome", outcome.to_string()),
                            ])
                            .inc_by(now_n - was);
                    }
                }
                if retry_in != STEP_RETRY_MIN {
                    tracing::info!(job = %job.id, "job steps succeed again");
                    retry_in = STEP_RETRY_MIN;
                }
                app.jobs.set_failing(&job.id, None);
                if job.state == JobState::Done {
                    if job.expired > before.expired {
                        tracing::warn!(job = %job.id, expired = job.expired, total = job.total, "a replay ended short of events of its range that the archive sweep removed before the job reached them");
                    }
                    tracing::info!(job = %job.id, moved = job.moved, failed = job.failed, skipped = job.skipped, expired = job.expired, "job finished");
                    break Ok(());
                }
            }
            // This job's own revision moved on (an operator, another node). Another job's
            // refusal is no concern of this one: a store error like any other, below.
            Err(StoreError::JobChanged(id)) if id == job.id => {
                break Err(StoreError::JobChanged(id));
            }
            Err(e) => {
                job = before;
                job = step_failed(app, job, &e, retry_in).await?;
                if !sleep_while(retry_in, &running).await {
                    break Ok(());
                }
                retry_in = (retry_in * 2).min(STEP_RETRY_MAX);
                tokens = 0.0;
                last = std::time::Instant::now();
            }
        }
    };
    app.jobs.set_failing(&job.id, None);
    result
}

/// Pauses a job for something an operator must act on, with the reason as its `last_error`
/// (stored; `Err` when the job changed in the store since).
async fn pause_for(
    app: &App,
    job: &mut Job,
    handle: &Mutex<JobState>,
    why: String,
) -> Result<(), StoreError> {
    job.state = JobState::Paused;
    job.last_error = Some(why);
    job.updated_at = app.clock.now_ms();
    *handle.lock().unwrap_or_else(|p| p.into_inner()) = JobState::Paused;
    app.store.put_job(job.clone()).await.map(|_| ())
}

/// A job's stored filter as it runs: a replay's event pattern, a redrive's DLQ filter. An
/// absent filter is everything; one present that does not read is an error.
fn read_filters(
    kind: JobKind,
    filter: Option<serde_json::Value>,
) -> Result<(Option<Pattern>, DlqFilter), String> {
    let Some(f) = filter else {
        return Ok((None, DlqFilter::default()));
    };
    match kind {
        JobKind::Replay => Pattern::compile(&f)
            .map(|p| (Some(p), DlqFilter::default()))
            .map_err(|errs| {
                let why: Vec<String> = errs.iter().map(ToString::to_string).collect();
                format!("the replay's filter no longer compiles: {}", why.join("; "))
            }),
        JobKind::Redrive => serde_json::from_value::<FilterSpec>(f)
            .map_err(|e| e.to_string())
            .and_then(|spec| {
                spec.to_filter("").map_err(|errs| {
                    errs.iter()
                        .map(|e| format!("{}: {}", e.pointer, e.message))
                        .collect::<Vec<_>>()
                        .join("; ")
                })
            })
            .map(|f| (None, f))
            .map_err(|e| format!("the redrive's filter no longer reads: {e}")),
    }
}

/// After a step the store refused for a reason of its own (not a change to the job): counts
/// it, logs it, and writes it into the job as its `last_error` if the store takes that
/// (shown here meanwhile in any case). Returns the job as stored; `Err` only when an
/// operator or another node changed the job since, which ends this runner.
async fn step_failed(
    app: &App,
    mut job: Job,
    error: &StoreError,
    retry_in: Duration,
) -> Result<Job, StoreError> {
    let kind = job.kind.as_str();
    let message = format!("{error} (tried again in {} s)", retry_in.as_secs());
    app.jobs.set_failing(&job.id, Some(message.clone()));
    app.metrics
        .job_step_failures
        .get_or_create(&vec![("kind", kind.to_owned())])
        .inc();
    tracing::warn!(job = %job.id, error = %error, retry_in = ?retry_in, "a job step failed in the store; it is tried again");
    if job.last_error.as_deref() != Some(message.as_str()) {
        job.last_error = Some(message);
        job.updated_at = app.clock.now_ms();
        match app.store.put_job(job.clone()).await {
            Ok(rev) => job.rev = rev,
            Err(e @ StoreError::JobChanged(_)) => return Err(e),
            // Shown from memory until the store takes writes again.
            Err(_) => {}
        }
    }
    Ok(job)
}

/// Sleeps `total` in ticks; false as soon as `running` says the job was paused or cancelled.
async fn sleep_while(total: Duration, running: &impl Fn() -> bool) -> bool {
    let mut slept = Duration::ZERO;
    while slept < total {
        tokio::time::sleep(TICK).await;
        slept += TICK;
        if !running() {
            return false;
        }
    }
    true
}

async fn redrive_step(
    app: &App,
    job: &mut Job,
    filter: &DlqFilter,
    take: usize,
    now: i64,
) -> Result<usize, StoreError> {
    let max_id = job.spec["max_id"].as_u64().unwrap_or(u64::MAX);
    // A job stored before jobs had a mark goes by its ids alone, as it did.
    let made_by = job.spec["made_by"].as_u64().unwrap_or(u64::MAX);
    let mut page = app.store.dlq_list(filter, Some(job.cursor), take).await?;
    page.retain(|d| d.id <= max_id);
    if page.is_empty() {
        job.state = JobState::Done;
        // The entries of its total it never reached: another job (or node) moved them, or a
        // purge removed them, before it read them (those it read and found gone at its
        // commit are skipped already). Without this, two jobs over the same entries both
        // ended `done` with items missing from their counts.
        job.skipped += job
            .total
            .saturating_sub(job.moved + job.failed + job.skipped);
        job.updated_at = now;
        job.heartbeat_at = now;
        job.rev = app
            .store
            .redrive_step(job.clone(), Vec::new(), now)
            .await?
            .0;
        return Ok(0);
    }
    let contracts = app.contracts.load();
    let rules = app.rules.load();
    // An entry goes back to its own target only while that target has a worker: one in the
    // rules, or one removed from them that still drains here. Into any other queue it would
    // wait for ever (a removed target's worker starts again only for entries it had).
    let draining: HashSet<String> = app.dispatcher.running().into_iter().map(|s| s.id).collect();
    let gone = |target: &str| !rules.targets.contains_key(target) && !draining.contains(target);
    // Where the dead letters of targets no longer in the rules go, looked up once per target.
    let mut successors = Successors::default();
    // The records the step writes, its job's first: it stops before the store's limit
    // (`Store::max_step_writes`) and the next step goes on from its cursor.
    let budget = app.store.max_step_writes();
    let mut writes = 1usize;
    let mut taken = 0;
    let mut actions = Vec::with_capacity(page.len());
    for d in &page {
        if d.made() > made_by {
            // Made after the job (on a shared store, under a lower id than some of the job's):
            // not the job's, not counted, and no part of its rate.
            job.cursor = d.id;
            continue;
        }
        let before = (job.cursor, job.moved, job.failed, job.skipped);
        let pushed = actions.len();
        job.cursor = d.id;
        'entry: {
            match d.reason {
                // Quarantined at ingest (no queue entry): re-validated against the current
                // contracts, routed by the current rules. A handler's "does not accept this
                // version" (`not_accepted`, `unknown_version` before) has an entry, and goes back
                // to that handler alone (below): routed again, the event would reach every other
                // target a second time.
                DlqReason::ContractViolation | DlqReason::UnknownVersion if d.entry.is_none() => {
                    let Some((_, ev)) = app.store.dlq_get(d.id).await? else {
                        break 'entry;
                    };
                    // The check and the matching of a large event, away from the runtime's
                    // other tasks (as at ingest).
                    let disabled = app.disabled_rules();
                    let weight = rules.match_cost(ev.event.payload_len());
                    let checked = crate::blocking::off_reactor_if_large(weight, || match contracts
                        .check(&ev.event)
                    {
                        ContractOutcome::Pass => {
                            Ok(crate::ingest::match_targets(&rules, &disabled, &ev.event))
                        }
                        ContractOutcome::Violation { reason, errors, .. } => Err((reason, errors)),
                    });
                    match checked {
                        Ok((matched_rules, targets)) => {
                            if targets.is_empty() {
                                // Taken out of the DLQ it would go nowhere, and its record with it
                                // (its rule may be disabled for containment): it stays.
                                actions.push(RedriveAction::Keep {
                                    dlq_id: d.id,
                                    note: "not redriven: its data passes the contract now, but no enabled rule matches it; enable or add a rule and redrive again (or purge it)".into(),
                                    errors: None,
                                });
                                job.failed += 1;
                                break 'entry;
                            }
                            actions.push(RedriveAction::Route {
                                dlq_id: d.id,
                                matched_rules,
                                targets,
                            });
                            job.moved += 1;
                        }
                        Err((reason, errors)) => {
                            let note = match reason {
                                ViolationReason::UnknownVersion => {
                                    "not redriven: its dataversion still has no contract"
                                }
                                ViolationReason::ContractViolation => {
                                    "not redriven: its data still fails the current contract"
                                }
                            };
                            // The errors are the current contract's verdict: they replace those
                            // of the contract it was quarantined under.
                            actions.push(RedriveAction::Keep {
                                dlq_id: d.id,
                                note: note.into(),
                                errors: Some(errors),
                            });
                            job.failed += 1;
                        }
                    }
                }
                DlqReason::TargetOverflow => {
                    // It never got a queue entry: give it one now, for the same target.
                    let (Some(target), Some(rule)) = (d.target_id.clone(), d.rule.clone()) else {
                        job.skipped += 1;
                        break 'entry;
                    };
                    let target = if gone(&target) {
                        match successors.of(app, &rules, &target).await? {
                            Ok(live) => {
                                successors.redriven(job, &target, &live);
                                live
                            }
                            Err(note) => {
                                actions.push(RedriveAction::Keep {
                                    dlq_id: d.id,
                                    note,
                                    errors: None,
                                });
                                job.failed += 1;
                                break 'entry;
                            }
                        }
                    } else {
                        target
                    };
                    // Queued under the target's ordering, its key read from the event as at
                    // acceptance. The depth cap is not applied: an operator's redrive, at the
                    // job's rate, may take the queue past it.
                    let spec = rules.targets.get(&target);
                    let ordering_key = match spec.and_then(|s| s.policy.ordering.as_ref()) {
                        Some(o) => app
                            .store
                            .dlq_get(d.id)
                            .await?
                            .and_then(|(_, ev)| o.extract_event(&ev.event)),
                        None => None,
                    };
                    actions.push(RedriveAction::Route {
                        dlq_id: d.id,
                        matched_rules: vec![rule.clone()],
                        targets: vec![crate::store::NewEntry {
                            target_id: target,
                            rule,
                            ordering_key,
                            max_depth: None,
                            lease_ms: None,
                            hold_key: false,
                        }],
                    });
                    job.moved += 1;
                }
                _ if d.entry.is_some() => {
                    // A removed target's entries dead-lettered for its removal go back only to a
                    // target in the rules: its worker may still run here (it is never stopped),
                    // which would deliver them under the configuration they were removed with,
                    // and only until a restart.
                    let gone_now = d.target_id.as_deref().filter(|t| {
                        if d.reason == DlqReason::TargetRemoved {
                            !rules.targets.contains_key(*t)
                        } else {
                            gone(t)
                        }
                    });
                    let Some(removed) = gone_now else {
                        actions.push(RedriveAction::Requeue { dlq_id: d.id });
                        job.moved += 1;
                        break 'entry;
                    };
                    // Its id is gone, its receiver may not be: a rule renamed keeps the
                    // destination under a new id, which takes the dead letters.
                    match successors.of(app, &rules, removed).await? {
                        Ok(live) => {
                            let ordering_key = match rules
                                .targets
                                .get(&live)
                                .and_then(|s| s.policy.ordering.as_ref())
                            {
                                Some(o) => app
                                    .store
                                    .dlq_get(d.id)
                                    .await?
                                    .and_then(|(_, ev)| o.extract_event(&ev.event)),
                                None => None,
                            };
                            successors.redriven(job, removed, &live);
                            actions.push(RedriveAction::RequeueTo {
                                dlq_id: d.id,
                                target: live,
                                ordering_key,
                            });
                            job.moved += 1;
                        }
                        Err(note) => {
                            actions.push(RedriveAction::Keep {
                                dlq_id: d.id,
                                note,
                                errors: None,
                            });
                            job.failed += 1;
                        }
                    }
                }
                // An emission past the hop limit or outside its handler's scope: routed again it
                // would loop, or break the scope, again. It stays, saying so, and counts as
                // failed (it used to be skipped without a word, the job reporting success).
                _ => {
                    actions.push(RedriveAction::Keep {
                        dlq_id: d.id,
                        note: format!(
                            "not redriven: a {} dead letter is not routed again; fix its handler, then purge it",
                            d.reason.as_str()
                        ),
                        errors: None,
                    });
                    job.failed += 1;
                }
            }
        }
        let cost: usize = actions[pushed..]
            .iter()
            .map(RedriveAction::max_writes)
            .sum();
        if writes + cost > budget {
            (job.cursor, job.moved, job.failed, job.skipped) = before;
            actions.truncate(pushed);
            if writes > 1 {
                break;
            }
            // Alone it is more than one step writes: routed, it would go to more targets
            // than the store takes in one transaction. It stays, saying so (the step would
            // otherwise be refused, and tried again as large, for ever).
            job.cursor = d.id;
            actions.push(RedriveAction::Keep {
                dlq_id: d.id,
                note: format!(
                    "not redriven: its event would go to more targets than one step of the store writes ({budget} records); narrow the rules that match it, then redrive it again"
                ),
                errors: None,
            });
            job.failed += 1;
            writes += 1;
        } else {
            writes += cost;
        }
        taken += 1;
    }
    job.updated_at = now;
    job.heartbeat_at = now;
    job.last_item_at = Some(now);
    let n = taken;
    let (rev, gone) = app.store.redrive_step(job.clone(), actions, now).await?;
    // Entries another job (or a purge) took first: this job did not move them.
    gone.apply(job);
    job.rev = rev;
    Ok(n)
}

/// Where a redrive sends the dead letters of targets no longer in the rules: the one live
/// target with the removed one's destination (its rule renamed, say), or nowhere, with the
/// note the dead letter keeps. A step looks each removed target up once.
#[derive(Default)]
struct Successors {
    /// Per removed target: the live id, or why there is none.
    found: HashMap<String, Result<String, String>>,
    /// The (removed, live) pairs the job has said it redrove.
    said: HashSet<(String, String)>,
}

impl Successors {
    /// The live target that takes `removed`'s dead letters, or the note why none does.
    async fn of(
        &mut self,
        app: &App,
        rules: &crate::rules::RuleSet,
        removed: &str,
    ) -> Result<Result<String, String>, StoreError> {
        if let Some(found) = self.found.get(removed) {
            return Ok(found.clone());
        }
        // Its last configuration: the worker's while it drains, else the store's.
        let last = match app.dispatcher.runtime(removed) {
            Some(rt) => Some(rt.spec.kind.destination()),
            None => app
                .store
                .saved_targets()
                .await?
                .into_iter()
                .find(|(id, _)| id == removed)
                .and_then(|(_, v)| serde_json::from_value::<crate::rules::TargetSpec>(v).ok())
                .map(|s| s.kind.destination()),
        };
        let found = match last {
            None => Err(format!(
                "not redriven: target {removed} is no longer in the rules and its last configuration is not known; put it back (or give the target that should take them `id: {removed}`) and redrive again, or replay the events (POST /v1/replay with \"targets\")"
            )),
            Some(dest) => match crate::app::targets_sending_to(rules, &dest)[..] {
                [live] => Ok(live.to_string()),
                [] => Err(format!(
                    "not redriven: target {removed} is no longer in the rules and no target sends to its destination {dest}; put it back (or give the target that should take them `id: {removed}`) and redrive again, or purge them"
                )),
                ref several => Err(format!(
                    "not redriven: target {removed} is no longer in the rules and several targets send to its destination {dest} ({}): a redrive cannot tell which should take them; give that one `id: {removed}` and redrive again, or replay the events restricted to it (POST /v1/replay with \"targets\")",
                    several.join(", ")
                )),
            },
        };
        self.found.insert(removed.to_string(), found.clone());
        Ok(found)
    }

    /// Says once in `job`'s warnings (and the log) that `removed`'s dead letters went to
    /// `live`: they leave the DLQ, and the job is where an operator looks for where.
    fn redriven(&mut self, job: &mut Job, removed: &str, live: &str) {
        if !self.said.insert((removed.to_string(), live.to_string())) {
            return;
        }
        let why = format!(
            "dead letters of target {removed}, no longer in the rules, were redriven to target {live}, which sends to the same destination"
        );
        if job.warnings.contains(&why) {
            return;
        }
        tracing::warn!(job = %job.id, from = %removed, to = %live, "{why}");
        if job.warnings.len() < MAX_JOB_WARNINGS {
            job.warnings.push(why);
        }
    }
}

/// Whether `ev` is a handler's emission (source `handler://<name>`): ingest refuses that
/// source from producers not granted it, so on one router it marks what its handlers emitted.
fn is_emission(ev: &crate::event::CloudEvent) -> bool {
    crate::auth::reserved_source_prefix(&ev.source) == Some("handler://")
}

async fn replay_step(
    app: &App,
    job: &mut Job,
    pattern: Option<&Pattern>,
    restriction: &ReplayRestriction,
    take: usize,
    now: i64,
) -> Result<usize, StoreError> {
    let from = job.spec["from_ms"].as_i64().unwrap_or(0);
    let to = job.spec["to_ms"].as_i64().unwrap_or(0);
    let events = app
        .store
        .events_between(from, to, job.cursor, take, MAX_STEP_BYTES)
        .await?;
    if events.is_empty() {
        job.state = JobState::Done;
        // The part of its total it never saw: events the archive sweep removed (past the
        // archive's retention) before the job reached them. The sweep does not wait for jobs
        // (a paused one would pin the archive, and the disk): the job says so instead of
        // ending as if it had replayed the range.
        let expired = job
            .total
            .saturating_sub(job.moved + job.failed + job.skipped + job.expired);
        if expired > 0 {
            job.expired += expired;
            job.last_error = Some(format!(
                "{expired} of the range's {} events were removed from the archive before the job reached them: they were past its retention ({}); replay a range closer to now, or at a higher rate",
                job.total,
                retention_note(&app.cfg)
            ));
        }
        job.updated_at = now;
        job.heartbeat_at = now;
        job.rev = app
            .store
            .replay_step(job.clone(), Vec::new(), now)
            .await?
            .rev;
        return Ok(0);
    }
    let rules = app.rules.load();
    let contracts = app.contracts.load();
    // A job created before the field existed has none: it skips emissions, like a new one.
    let include_emitted = job.spec["include_emitted"].as_bool().unwrap_or(false);
    let ignore_contracts = job.spec["ignore_contracts"].as_bool().unwrap_or(false);
    // The records the step writes, its job's first: it stops before the store's limit
    // (`Store::max_step_writes`) and the next step goes on from its cursor.
    let budget = app.store.max_step_writes();
    let mut writes = 1usize;
    let mut taken = 0;
    let mut items = Vec::new();
    // Matching, pattern and contract checks of a step's events (up to `MAX_STEP_BYTES`) away
    // from the runtime's other tasks when they are large, as at ingest.
    let weight = rules.match_cost(events.iter().map(|e| e.event.payload_len()).sum());
    crate::blocking::off_reactor_if_large(weight, || {
        for ev in &events {
            let cursor_before = job.cursor;
            job.cursor = ev.seq;
            taken += 1;
            // System events are the router's records of its past state: replayed, old alerts
            // would page again, and could reach the very target they are about.
            if ev.event.ty.starts_with("router.") {
                job.skipped += 1;
                continue;
            }
            // A handler's emission is derived too: the replay re-runs the handler on its parent,
            // which emits it again (under a new id, with the replay marker). Replaying the
            // archived copy as well sent each derived event downstream twice, under two ids a
            // receiver cannot match.
            if !include_emitted && is_emission(&ev.event) {
                job.skipped += 1;
                job.skipped_emitted += 1;
                continue;
            }
            let json = ev.event.to_json();
            if pattern.is_some_and(|p| !p.matches(&json)) {
                job.skipped += 1;
                continue;
            }
            // The current contracts, as at ingest (contract, then rules) and as a redrive of a
            // quarantined event checks them: an event archived before its type's contract was
            // added or tightened was replayed to receivers that ingest now keeps it from.
            if !ignore_contracts
                && matches!(
                    contracts.check(&ev.event),
                    ContractOutcome::Violation { .. }
                )
            {
                job.skipped += 1;
                job.skipped_contract += 1;
                continue;
            }
            let (_, mut targets) =
                crate::ingest::match_targets(&rules, &app.disabled_rules(), &ev.event);
            if targets.is_empty() {
                job.skipped += 1;
                continue;
            }
            // Only the named rules' / targets' copies: the others had the event already,
            // and a copy would reach them again under a new idempotency key.
            if restriction.is_some() {
                targets.retain(|t| restriction.allows(t));
                if targets.is_empty() {
                    job.skipped += 1;
                    job.skipped_restricted += 1;
                    continue;
                }
            }
            let item = ReplayItem {
                seq: ev.seq,
                targets,
            };
            let cost = item.max_writes();
            if writes + cost > budget {
                if writes > 1 {
                    // The next step takes it.
                    job.cursor = cursor_before;
                    taken -= 1;
                    break;
                }
                // Alone it is more than one step writes (its copies for more targets than the
                // store takes in one transaction): not replayed, and said, rather than the step
                // refused and tried again as large for ever.
                let why = format!(
                    "event {} from {} was not replayed: it goes to {} targets now, more copies than one step of the store writes ({budget} records)",
                    ev.event.id,
                    ev.event.source,
                    item.targets.len()
                );
                tracing::warn!(job = %job.id, seq = ev.seq, "{why}");
                if job.warnings.len() < MAX_JOB_WARNINGS {
                    job.warnings.push(why);
                }
                job.failed += 1;
                continue;
            }
            writes += cost;
            items.push(item);
            job.moved += 1;
        }
    });
    // An event accepted inside the range while the job was being created (it had its time
    // before `to`, and its commit after the count) is replayed too.
    job.total = job
        .total
        .max(job.moved + job.failed + job.skipped + job.expired);
    job.updated_at = now;
    job.heartbeat_at = now;
    job.last_item_at = Some(now);
    let n = taken;
    // Copies refused by their queue's depth cap went to the DLQ: their events count as
    // failed, not moved (the job said all was moved, and `--wait` exited 0; then it said
    // "60/60 moved, 55 failed"), and, as new dead letters, in router_dlq_entries_total and
    // router.dlq.added like any other (they were neither).
    let stepped = app.store.replay_step(job.clone(), items, now).await?;
    job.rev = stepped.rev;
    stepped.apply(job);
    for (seq, target) in &stepped.overflowed {
        let Some(ev) = events.iter().find(|e| e.seq == *seq) else {
            continue;
        };
        crate::deliver::dead_lettered(
            app.dispatcher.context(),
            Some(target),
            crate::deliver::DeadEvent::of(&ev.event),
            DlqReason::TargetOverflow,
            Some(&format!(
                "replayed by {}; the target's queue is at its depth cap",
                job.id
            )),
            now,
        );
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_stored_filter_that_no_longer_reads_is_an_error_never_everything() {
        use serde_json::json;
        assert!(read_filters(JobKind::Redrive, None).is_ok());
        let e = read_filters(
            JobKind::Redrive,
            Some(json!({"target": "erp", "reason": "no_such_reason"})),
        )
        .expect_err("an unknown reason");
        assert!(e.contains("redrive's filter no longer reads"), "{e}");
        let e = read_filters(
            JobKind::Replay,
            Some(json!({"type": [{"numbre": [">", 1]}]})),
        )
        .expect_err("an unknown operator");
        assert!(e.contains("replay's filter no longer compiles"), "{e}");
        let (p, _) = read_filters(JobKind::Replay, Some(json!({"type": ["t"]}))).expect("valid");
        assert!(p.is_some());
    }

    use std::time::Instant;

    use super::*;
    use crate::store::fault::SimulatedDisk;
    use crate::store::test_events::new_event;
    use crate::store::{Quarantine, RedbStore, StoreOptions};

    /// Polls `job` (through the API's read) until `done` holds, at most `within`. A read may
    /// fail while the store reopens after a failed write (the API answers 503 then).
    async fn wait_for(app: &App, id: &str, within: Duration, done: impl Fn(&Job) -> bool) -> Job {
        let deadline = Instant::now() + within;
        loop {
            let read = get(app, id).await;
            match read {
                Ok(job) if done(&job) || Instant::now() > deadline => return job,
                Err(e) if Instant::now() > deadline => panic!("the job does not read: {e}"),
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// An app on `test_config` (one target, `hook`) over a redb store on `disk`.
    /// Event `id` from `/s`, quarantined as a contract violation: a dead letter without a
    /// target once accepted, what a redrive of the whole DLQ moves.
    fn quarantined(id: &str) -> crate::store::NewEvent {
        let mut ne = new_event("/s", id, &[], 0);
        ne.quarantine = Some(Quarantine {
            reason: DlqReason::ContractViolation,
            errors: Vec::new(),
            emitted_by: None,
        });
        ne
    }

    fn app_on(disk: &SimulatedDisk) -> (tempfile::TempDir, Arc<App>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = disk.clone();
        let store = RedbStore::with_backend_factory(move || d.backend(), StoreOptions::default())
            .expect("store");
        let app = crate::app::test_app(crate::app::test_config(dir.path()), store, None);
        (dir, app)
    }

    /// The first ten DLQ entries, in id order.
    async fn dlq_entries(app: &App) -> Vec<crate::store::DlqEntry> {
        app.store
            .dlq_list(&DlqFilter::default(), None, 10)
            .await
            .expect("dlq")
    }

    /// A replay of the 5 s before `now`, once done.
    async fn replay_last_seconds(app: &Arc<App>, now: i64) -> Job {
        replay_last_seconds_with(app, now, false).await
    }

    /// As `replay_last_seconds`, with the request's `include_emitted`.
    async fn replay_last_seconds_with(app: &Arc<App>, now: i64, include_emitted: bool) -> Job {
        let job = create_replay(
            app,
            ReplayRequest {
                from: crate::clock::rfc3339(now - 5000),
                to: crate::clock::rfc3339(now),
                filter: None,
                rate_per_sec: 1000.0,
                include_emitted,
                ignore_contracts: false,
                rules: None,
                targets: None,
            },
        )
        .await
        .expect("created");
        wait_for(app, &job.id, Duration::from_secs(30), |j| {
            j.state == JobState::Done
        })
        .await
    }

    /// A redrive job of every DLQ entry at `rate_per_sec`.
    async fn redrive_all(app: &Arc<App>, rate_per_sec: f64) -> Job {
        create_redrive(
            app,
            RedriveRequest {
                filter: FilterSpec::default(),
                rate_per_sec,
                all: true,
            },
        )
        .await
        .expect("created")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ended_jobs_past_their_retention_go_but_the_newest_of_each_kind_and_live_ones_stay() {
        let (_dir, app) = app_on(&SimulatedDisk::new());
        let day = 24 * 3600 * 1000;
        let job = |id: &str, kind: JobKind, state: JobState, updated_at: i64| Job {
            state,
            created_at: updated_at,
            updated_at,
            ..crate::store::test_events::job(id, kind)
        };
        let now = 100 * day;
        for j in [
            job(
                "redrive-1",
                JobKind::Redrive,
                JobState::Done,
                now - 60 * day,
            ),
            job(
                "redrive-2",
                JobKind::Redrive,
                JobState::Cancelled,
                now - 40 * day,
            ),
            job(
                "redrive-3",
                JobKind::Redrive,
                JobState::Paused,
                now - 50 * day,
            ),
            job(
                "redrive-4",
                JobKind::Redrive,
                JobState::Done,
                now - 31 * day,
            ),
            job("redrive-5", JobKind::Redrive, JobState::Done, now - day),
            job("replay-1", JobKind::Replay, JobState::Done, now - 90 * day),
        ] {
            app.store.put_job(j).await.expect("put");
        }
        // What this node kept in memory for jobs it ran: dropped with their records.
        for id in ["redrive-1", "redrive-2", "redrive-5"] {
            app.jobs
                .handles
                .lock()
                .expect("handles")
                .insert(id.into(), Arc::new(Mutex::new(JobState::Done)));
            let _ = app.jobs.run_lock(id);
        }
        let removed = sweep_jobs(&app, now, Duration::from_secs(30 * 24 * 3600))
            .await
            .expect("swept");
        assert_eq!(removed, 3);
        assert_eq!(app.jobs.remembered(), 1, "only redrive-5's controls stay");
        assert_eq!(app.jobs.runs.lock().expect("runs").len(), 1);
        let mut left: Vec<String> = app
            .store
            .jobs()
            .await
            .expect("jobs")
            .into_iter()
            .map(|j| j.id)
            .collect();
        left.sort();
        // Paused never expires; redrive-5 is recent; replay-1 is the newest replay.
        assert_eq!(left, ["redrive-3", "redrive-5", "replay-1"]);
        // Numbers are never reused: the next jobs follow the highest.
        assert_eq!(
            next_job_id(&app, JobKind::Redrive).await.expect("id"),
            "redrive-6"
        );
        assert_eq!(
            next_job_id(&app, JobKind::Replay).await.expect("id"),
            "replay-2"
        );
        // Sweeping again removes nothing more.
        assert_eq!(
            sweep_jobs(&app, now, Duration::from_secs(30 * 24 * 3600))
                .await
                .expect("swept"),
            0
        );
    }

    /// An app on `test_config` with the rules `rules` (YAML) over an in-memory redb store.
    fn redb_app(rules: &str) -> (tempfile::TempDir, Arc<App>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = crate::app::test_config(dir.path());
        std::fs::write(cfg.rules_dir.join("r.yaml"), rules).expect("rules");
        let app = crate::app::test_app(cfg, RedbStore::in_memory().expect("store"), None);
        (dir, app)
    }

    /// An app on `test_config` with the rules `rules` (YAML) over the JetStream store on
    /// `server`.
    async fn jetstream_app(
        server: &crate::store::jetstream::test_server::TestServer,
        rules: &str,
    ) -> (tempfile::TempDir, Arc<App>) {
        use crate::store::jetstream::{JetStreamOptions, JetStreamStore};
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = crate::app::test_config(dir.path());
        std::fs::write(cfg.rules_dir.join("r.yaml"), rules).expect("rules");
        let store = JetStreamStore::open(JetStreamOptions {
            records: server.records("ROUTER"),
            node: format!("{:016x}", rand::random::<u64>()),
        })
        .await
        .expect("open the JetStream store");
        let app = crate::app::test_app(cfg, Arc::new(store), None);
        (dir, app)
    }

    /// `n` replays of the last 5 s created at the same moment (each in its own task): every one is created, each
    /// under its own number.
    async fn replays_created_at_once(app: &Arc<App>, n: usize) {
        let now = app.clock.now_ms();
        let creations = (0..n).map(|_| {
            let app = app.clone();
            tokio::spawn(async move {
                create_replay(
                    &app,
                    ReplayRequest {
                        from: crate::clock::rfc3339(now - 5000),
                        to: crate::clock::rfc3339(now),
                        filter: None,
                        rate_per_sec: 10.0,
                        include_emitted: false,
                        ignore_contracts: false,
                        rules: None,
                        targets: None,
                    },
                )
                .await
            })
        });
        let mut ids = HashSet::new();
        for created in futures::future::join_all(creations).await {
            let job = created.expect("joined").expect("every creation succeeds");
            assert!(ids.insert(job.id.clone()), "{} given twice", job.id);
        }
        let numbers: HashSet<u64> = ids.iter().filter_map(|id| job_number(id)).collect();
        assert_eq!(numbers.len(), n, "{ids:?}");
    }

    /// Jobs created at once all read the same highest number; the losers of each race took
    /// the next after reading again, 8 times at most, and 5 of 16 creations at once were
    /// answered 503 "storage unavailable".
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_jobs_created_at_once_are_all_created() {
        let (_dir, app) = app_on(&SimulatedDisk::new());
        replays_created_at_once(&app, 32).await;
    }

    /// As `many_jobs_created_at_once_are_all_created`, on the JetStream store.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_jobs_created_at_once_are_all_created_on_jetstream() {
        let server = crate::store::jetstream::test_server::TestServer::start();
        let (_dir, app) = jetstream_app(&server, RULE_T_TO_HOOK).await;
        replays_created_at_once(&app, 32).await;
    }

    /// Job steps on JetStream are one atomic batch each, capped at 1000 writes: a replay of
    /// 300 events to 10 targets each (an entry per copy and the event's record: 3301 writes)
    /// at the highest rate was refused at every step and never moved. Steps now stop before
    /// the cap and the job completes; an event whose copies alone would pass it (1000
    /// targets) is counted as failed, with a warning, instead of stalling the job.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replay_larger_than_the_jetstream_batch_limit_completes() {
        use std::fmt::Write as _;
        let mut rules =
            String::from("rules:\n  - name: r\n    pattern:\n      type: [t]\n    targets:\n");
        for i in 0..10 {
            let _ = write!(
                rules,
                "      - webhook: http://127.0.0.1:9/\n        id: h{i}\n"
            );
        }
        rules.push_str("  - name: wide\n    pattern:\n      type: [wide]\n    targets:\n");
        for i in 0..1000 {
            let _ = write!(
                rules,
                "      - webhook: http://127.0.0.1:9/\n        id: w{i}\n"
            );
        }
        let server = crate::store::jetstream::test_server::TestServer::start();
        let (_dir, app) = jetstream_app(&server, &rules).await;
        let now = app.clock.now_ms();
        // Accepted with no targets (no queue entries): the replay makes the copies.
        let mut events: Vec<_> = (0..300)
            .map(|i| new_event("/s", &format!("e{i}"), &[], now - 1000))
            .collect();
        let mut wide = new_event("/s", "wide", &[], now - 1000);
        wide.event.ty = "wide".into();
        events.push(wide);
        app.store.accept(events).await.expect("accepted");
        let job = create_replay(
            &app,
            ReplayRequest {
                from: crate::clock::rfc3339(now - 5000),
                to: crate::clock::rfc3339(now),
                filter: None,
                rate_per_sec: MAX_RATE,
                include_emitted: false,
                ignore_contracts: false,
                rules: None,
                targets: None,
            },
        )
        .await
        .expect("created");
        // About four steps of a few hundred writes each: seconds. A step refused by the
        // server is tried again only after 1 s, 2 s, 4 s...: a minute is far past done.
        let done = wait_for(&app, &job.id, Duration::from_secs(60), |j| {
            j.state == JobState::Done
        })
        .await;
        assert_eq!(done.state, JobState::Done, "{done:?}");
        assert_eq!((done.moved, done.failed), (300, 1), "{done:?}");
        assert!(
            done.warnings
                .iter()
                .any(|w| w.contains("event wide from /s was not replayed")),
            "{done:?}"
        );
        let failures = app
            .metrics
            .job_step_failures
            .get_or_create(&vec![("kind", "replay".to_owned())])
            .get();
        assert_eq!(failures, 0, "no step was refused");
    }

    /// As `a_replay_larger_than_the_jetstream_batch_limit_completes`, for a redrive: 700
    /// dead letters refused by a depth cap of 0 (each one a route: its DLQ record, a new
    /// entry and its event's record, 2101 writes at once) all go back to their queue.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_redrive_larger_than_the_jetstream_batch_limit_completes() {
        let server = crate::store::jetstream::test_server::TestServer::start();
        let (_dir, app) = jetstream_app(&server, RULE_T_TO_HOOK).await;
        let now = app.clock.now_ms();
        let events: Vec<_> = (0..700)
            .map(|i| {
                let mut ne = new_event("/s", &format!("e{i}"), &["hook"], now - 1000);
                ne.targets[0].max_depth = Some(0);
                ne
            })
            .collect();
        app.store.accept(events).await.expect("accepted");
        let job = redrive_all(&app, MAX_RATE).await;
        let done = wait_for(&app, &job.id, Duration::from_secs(60), |j| {
            j.state == JobState::Done
        })
        .await;
        assert_eq!(done.state, JobState::Done, "{done:?}");
        assert_eq!((done.moved, done.failed), (700, 0), "{done:?}");
        let failures = app
            .metrics
            .job_step_failures
            .get_or_create(&vec![("kind", "redrive".to_owned())])
            .get();
        assert_eq!(failures, 0, "no step was refused");
    }

    /// `test_config`'s rules: type `t` to webhook `hook`.
    const RULE_T_TO_HOOK: &str = "rules:\n  - name: r\n    pattern:\n      type: [t]\n    targets:\n      - webhook: http://127.0.0.1:9/\n        id: hook\n";

    /// Accepts event `id` for `hook` through `store` and dead-letters it there at once (HTTP
    /// 400): a DLQ entry numbered by that store's node.
    async fn dead_letter_on(store: &dyn crate::store::Store, id: &str, now: i64) {
        store
            .accept(vec![new_event("/s", id, &["hook"], now)])
            .await
            .expect("accepted");
        dead_letter_queued(store, id, now).await;
    }

    /// Leases `hook`'s queued entry of event `id` through `store` and dead-letters it (HTTP
    /// 400), as a worker whose receiver refuses it does. On a store shared with other nodes
    /// this node's view may take a moment to see the entry.
    async fn dead_letter_queued(store: &dyn crate::store::Store, id: &str, now: i64) {
        use crate::store::{AttemptEnd, AttemptResult, Disposition};
        let deadline = Instant::now() + Duration::from_secs(10);
        let leased = loop {
            let mut leased = store.lease("hook", now, 10, 60_000).await.expect("lease");
            assert!(leased.len() <= 1, "one entry queued at a time");
            if let Some(l) = leased.pop() {
                break l;
            }
            assert!(Instant::now() < deadline, "{id} was not queued");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(leased.event.event.id, id);
        let end = AttemptEnd {
            finished_at: now,
            result: AttemptResult::Permanent,
            status: Some(400),
            error: Some("HTTP 400".into()),
            outbox: None,
        };
        let dead = Disposition::DeadLetter {
            reason: DlqReason::PermanentError,
            hold: false,
        };
        store
            .finish(leased.entry.id, leased.lease, end, dead, now)
            .await
            .expect("dead-lettered");
    }

    /// A redrive takes the dead letters made before it, each once, whatever their ids: one of
    /// its own entries failing again after it moved it, and another event's failure, made
    /// after its creation, stay in the DLQ, and its counts end at its total. `app` runs the
    /// job; `other` is the store of a second node (or `app`'s own).
    async fn a_redrive_takes_only_what_was_dead_at_its_creation(
        app: &Arc<App>,
        other: &dyn crate::store::Store,
    ) {
        let now = app.clock.now_ms();
        dead_letter_on(&*app.store, "a", now).await;
        dead_letter_on(other, "b", now).await;
        let by_event = |list: &[crate::store::DlqEntry], id: &str| -> Vec<u64> {
            list.iter()
                .filter(|d| d.event_id == id)
                .map(|d| d.id)
                .collect()
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while dlq_entries(app).await.len() < 2 {
            assert!(
                Instant::now() < deadline,
                "the other node's dead letter never showed"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let req = RedriveRequest {
            filter: FilterSpec::default(),
            rate_per_sec: 1.0,
            all: true,
        };
        let mut job = new_redrive(app, &req).await.expect("created");
        assert_eq!(job.total, 2, "{job:?}");
        let filter = DlqFilter::default();
        // The first step moves `a` (the lowest id); its entry fails again at once.
        redrive_step(app, &mut job, &filter, 1, now)
            .await
            .expect("step");
        assert_eq!(job.moved, 1, "{job:?}");
        dead_letter_queued(&*app.store, "a", now).await;
        dead_letter_on(&*app.store, "c", now).await;
        let list = dlq_entries(app).await;
        let (a, b) = (by_event(&list, "a"), by_event(&list, "b"));
        assert_eq!((a.len(), b.len()), (1, 1), "{list:?}");
        for _ in 0..10 {
            if job.state == JobState::Done {
                break;
            }
            redrive_step(app, &mut job, &filter, 10, now)
                .await
                .expect("step");
        }
        assert_eq!(job.state, JobState::Done, "{job:?}");
        assert_eq!((job.moved, job.failed, job.skipped), (2, 0, 0), "{job:?}");
        let left = dlq_entries(app).await;
        let mut events: Vec<&str> = left.iter().map(|d| d.event_id.as_str()).collect();
        events.sort_unstable();
        assert_eq!(events, ["a", "c"], "{left:?}");
        // What the test is about on a shared store: the later dead letters were numbered
        // below the job's highest id (`b`'s), by the node with the older block.
        if !std::ptr::addr_eq(other, &*app.store) {
            assert!(left.iter().all(|d| d.id < b[0]), "a={a:?} b={b:?} {left:?}");
        }
    }

    /// On one redb file the ids follow the order dead letters were made in: the job stops at
    /// its highest id, under which nothing later is numbered (after a crash either: the
    /// number goes on from the file's).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_redrive_takes_only_what_was_dead_at_its_creation_on_redb() {
        let (_dir, app) = app_on(&SimulatedDisk::new());
        a_redrive_takes_only_what_was_dead_at_its_creation(&app, &*app.store).await;
    }

    /// Two JetStream nodes number dead letters from blocks of their own (A's first, B's
    /// after): A's dead letters made after the job (one of the job's own entries failing
    /// again, another event's) had ids below B's older ones, above the job's cursor, and the
    /// job moved them too: the same entry twice, past its total (an audit's "moved 207 of
    /// total 200" after a kill -9 and a takeover).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_redrive_takes_only_what_was_dead_at_its_creation_on_two_jetstream_nodes() {
        use crate::store::jetstream::{JetStreamOptions, JetStreamStore};
        let server = crate::store::jetstream::test_server::TestServer::start();
        let (_dir, app) = jetstream_app(&server, RULE_T_TO_HOOK).await;
        let other = JetStreamStore::open(JetStreamOptions {
            records: server.records("ROUTER"),
            node: format!("{:016x}", rand::random::<u64>()),
        })
        .await
        .expect("open the second node's store");
        a_redrive_takes_only_what_was_dead_at_its_creation(&app, &other).await;
    }

    #[test]
    fn job_numbers_are_read_from_ids_with_or_without_a_node_suffix() {
        assert_eq!(job_number("redrive-7"), Some(7));
        assert_eq!(job_number("replay-12-1a2b"), Some(12));
        assert_eq!(job_number("odd"), None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn entries_of_a_target_no_longer_in_the_rules_stay_in_the_dlq() {
        let (_dir, app) = app_on(&SimulatedDisk::new());
        // Both refused by a depth cap of 0: one for `hook`, one for `old`, a target no rule
        // has any more.
        let overflowing = |id: &str, target: &str| {
            let mut ne = new_event("/s", id, &[target], 0);
            ne.targets[0].max_depth = Some(0);
            ne
        };
        app.store
            .accept(vec![overflowing("a", "hook"), overflowing("b", "old")])
            .await
            .expect("accepted");
        let job = redrive_all(&app, 1000.0).await;
        let done = wait_for(&app, &job.id, Duration::from_secs(30), |j| {
            j.state == JobState::Done
        })
        .await;
        assert_eq!(done.state, JobState::Done, "{done:?}");
        assert_eq!((done.moved, done.failed), (1, 1), "{done:?}");
        assert_eq!(
            app.store.queue_stats().get("hook").map(|s| s.queued),
            Some(1)
        );
        assert_eq!(
            app.store.queue_stats().get("old").map_or(0, |s| s.queued),
            0,
            "nothing queued where no worker would take it"
        );
        let left = dlq_entries(&app).await;
        assert_eq!(left.len(), 1, "{left:?}");
        assert_eq!(left[0].target_id.as_deref(), Some("old"));
        let why = left[0].not_redriven.as_ref().expect("says why it stayed");
        assert!(why.message.contains("no longer in the rules"), "{why:?}");
        assert_eq!(why.job, job.id);
        // Not redriven: its own failure (the depth cap that refused it) and its redrive
        // count stay as they were. The refusal used to be written over the error, and the
        // count raised as if it had been redriven.
        assert!(
            left[0].errors[0].message.contains("depth cap"),
            "{:?}",
            left[0].errors
        );
        assert_eq!(left[0].redrive_count, 0);
        // Redriven again: still one refusal, the newest, and still the failure's error.
        let again = redrive_all(&app, 1000.0).await;
        wait_for(&app, &again.id, Duration::from_secs(30), |j| {
            j.state == JobState::Done
        })
        .await;
        let left = dlq_entries(&app).await;
        assert_eq!(
            left[0].not_redriven.as_ref().map(|n| n.job.as_str()),
            Some(again.id.as_str())
        );
        assert_eq!(left[0].errors.len(), 1, "{:?}", left[0].errors);
        assert_eq!(left[0].redrive_count, 0);
    }

    /// A redrive's filter must say what it means: a target id the router does not know (a
    /// typo) is refused with the closest known id, not run as an empty job that ends `done`;
    /// an empty filter needs `all`, as a purge does. Known are the live rules' targets, the
    /// targets with dead letters (one removed from the rules) and `none`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_redrive_of_an_unknown_target_or_of_everything_unasked_is_refused() {
        let (_dir, app) = app_on(&SimulatedDisk::new());
        let mut ne = new_event("/s", "b", &["old"], 0);
        ne.targets[0].max_depth = Some(0);
        app.store.accept(vec![ne]).await.expect("accepted");
        let redrive = |target: Option<&str>, all: bool| {
            create_redrive(
                &app,
                RedriveRequest {
                    filter: FilterSpec {
                        target: target.map(str::to_string),
                        ..FilterSpec::default()
                    },
                    rate_per_sec: 10.0,
                    all,
                },
            )
        };
        match redrive(Some("hoke"), false).await {
            Err(JobError::UnknownTarget { target, known }) => {
                assert_eq!(target, "hoke");
                assert_eq!(known.first().map(String::as_str), Some("hook"), "{known:?}");
            }
            other => panic!("an unknown target was not refused: {other:?}"),
        }
        match redrive(None, false).await {
            Err(JobError::Invalid(errors)) => assert_eq!(errors[0].pointer, "/filter"),
            other => panic!("an empty filter without all was not refused: {other:?}"),
        }
        assert!(app.store.jobs().await.expect("jobs").is_empty());
        for (target, all) in [
            (Some("hook"), false),
            (Some("old"), false),
            (Some("none"), false),
            (None, true),
        ] {
            let made = redrive(target, all).await;
            assert!(made.is_ok(), "{target:?} all={all}: {made:?}");
        }
    }

    /// A redrive takes an entry out of the DLQ only into a queue: a quarantined event that no
    /// enabled rule matches any more stays, saying why (it went nowhere, its DLQ record with
    /// it). One that is requeued gets its max_age afresh, counted from the redrive: a fix that
    /// took longer than max_age must still be able to redrive.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_redrive_keeps_what_would_go_nowhere_and_restarts_max_age() {
        let (_dir, app) = app_on(&SimulatedDisk::new());
        let mut orphan = new_event("/s", "orphan", &[], 0);
        orphan.event.ty = "no.rule.matches".into();
        orphan.quarantine = Some(Quarantine {
            reason: DlqReason::ContractViolation,
            errors: Vec::new(),
            emitted_by: None,
        });
        let mut old = new_event("/s", "old", &["hook"], 0);
        old.targets[0].max_depth = Some(0);
        app.store.accept(vec![orphan, old]).await.expect("accepted");
        let job = redrive_all(&app, 1000.0).await;
        let done = wait_for(&app, &job.id, Duration::from_secs(30), |j| {
            j.state == JobState::Done
        })
        .await;
        assert_eq!((done.moved, done.failed), (1, 1), "{done:?}");
        let left = dlq_entries(&app).await;
        assert_eq!(left.len(), 1, "{left:?}");
        assert_eq!(left[0].event_id, "orphan");
        assert!(
            left[0]
                .not_redriven
                .as_ref()
                .is_some_and(|n| n.message.contains("no enabled rule matches")),
            "{:?}",
            left[0]
        );
        let fate = app
            .store
            .fate("/s", "old")
            .await
            .expect("fate")
            .expect("known");
        assert_eq!(fate.event.accepted_at, 0, "the event keeps its acceptance");
        assert!(
            fate.entries[0].accepted_at >= job.created_at,
            "max_age counts from the redrive: {:?}",
            fate.entries[0]
        );
    }

    /// A replay re-routes business events; the router's own system events (old alerts) are
    /// skipped, even where a rule matches them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replay_skips_system_events() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = crate::app::test_config(dir.path());
        std::fs::write(
            cfg.rules_dir.join("r.yaml"),
            "rules:\n  - name: r\n    pattern:\n      type: [{ prefix: \"\" }]\n    targets:\n      - webhook: http://127.0.0.1:9/\n        id: hook\n",
        )
        .expect("rules");
        let store = RedbStore::in_memory().expect("store");
        let app = crate::app::test_app(cfg, store, None);
        let now = app.clock.now_ms();
        let mut alert = new_event("/s", "alert", &["hook"], now - 1000);
        alert.event.ty = "router.dlq.added".into();
        let business = new_event("/s", "business", &["hook"], now - 1000);
        app.store
            .accept(vec![alert, business])
            .await
            .expect("accepted");
        let done = replay_last_seconds(&app, now).await;
        assert_eq!((done.moved, done.skipped), (1, 1), "{done:?}");
    }

    /// Two rules for type `t`, to `erp` and to `audit` (which takes type `u` too): the
    /// runbook's case, a rule (`to-erp`) disabled for a while beside another that delivered.
    const TWO_RULES: &str = "rules:\n  - name: to-erp\n    pattern:\n      type: [t]\n    targets:\n      - webhook: http://127.0.0.1:9/\n        id: erp\n  - name: to-audit\n    pattern:\n      type: [t, u]\n    targets:\n      - webhook: http://127.0.0.1:9/\n        id: audit\n";

    /// A replay of the 5 s before `now` restricted to `rules` / `targets`.
    fn restricted(now: i64, rules: Option<&[&str]>, targets: Option<&[&str]>) -> ReplayRequest {
        let names = |n: Option<&[&str]>| n.map(|n| n.iter().map(|s| (*s).to_owned()).collect());
        ReplayRequest {
            from: crate::clock::rfc3339(now - 5000),
            to: crate::clock::rfc3339(now),
            filter: None,
            rate_per_sec: 1000.0,
            include_emitted: false,
            ignore_contracts: false,
            rules: names(rules),
            targets: names(targets),
        }
    }

    /// The targets of `id`'s copies made by replay `job`, sorted.
    async fn replayed_to(app: &App, id: &str, job: &str) -> Vec<String> {
        let fate = app
            .store
            .fate("/s", id)
            .await
            .expect("fate")
            .expect("known");
        let mut to: Vec<String> = fate
            .entries
            .into_iter()
            .filter(|e| e.replay.as_deref() == Some(job))
            .map(|e| e.target_id)
            .collect();
        to.sort();
        to
    }

    /// `rules` and `targets` narrow a replay to the copies they name, on `app` (rules
    /// `TWO_RULES`): without them every other target that had the events got each again
    /// under a new idempotency key. Events that go only elsewhere are `skipped_restricted`.
    async fn a_restricted_replay_queues_only_the_named_copies_on(app: &Arc<App>) {
        let now = app.clock.now_ms();
        let mut u = new_event("/s", "u1", &["audit"], now - 1000);
        u.event.ty = "u".into();
        app.store
            .accept(vec![
                new_event("/s", "t1", &["audit"], now - 1000),
                new_event("/s", "t2", &["audit"], now - 1000),
                u,
            ])
            .await
            .expect("accepted");
        let run = |req: ReplayRequest| async move {
            let job = create_replay(app, req).await.expect("created");
            wait_for(app, &job.id, Duration::from_secs(30), |j| {
                j.state == JobState::Done
            })
            .await
        };
        // Through every rule: erp and audit each get t1 and t2, audit u1 (the duplicates).
        let all = run(restricted(now, None, None)).await;
        assert_eq!((all.moved, all.skipped), (3, 0), "{all:?}");
        assert_eq!(replayed_to(app, "t1", &all.id).await, ["audit", "erp"]);

        let by_rule = run(restricted(now, Some(&["to-erp"]), None)).await;
        assert_eq!(
            (
                by_rule.moved,
                by_rule.skipped,
                by_rule.skipped_restricted,
                by_rule.total
            ),
            (2, 1, 1, 3),
            "{by_rule:?}"
        );
        assert_eq!(by_rule.spec["rules"], serde_json::json!(["to-erp"]));
        for id in ["t1", "t2"] {
            assert_eq!(replayed_to(app, id, &by_rule.id).await, ["erp"], "{id}");
        }
        assert!(replayed_to(app, "u1", &by_rule.id).await.is_empty());

        // By target: audit gets t1, t2 and u1.
        let by_target = run(restricted(now, None, Some(&["audit"]))).await;
        assert_eq!(
            (by_target.moved, by_target.skipped_restricted),
            (3, 0),
            "{by_target:?}"
        );
        for id in ["t1", "t2", "u1"] {
            assert_eq!(replayed_to(app, id, &by_target.id).await, ["audit"], "{id}");
        }

        // Both: a copy must pass both.
        let both = run(restricted(
            now,
            Some(&["to-erp", "to-audit"]),
            Some(&["erp"]),
        ))
        .await;
        assert_eq!((both.moved, both.skipped_restricted), (2, 1), "{both:?}");
        assert_eq!(replayed_to(app, "t1", &both.id).await, ["erp"]);
        assert!(replayed_to(app, "u1", &both.id).await.is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restricted_replay_queues_only_the_named_copies() {
        let (_dir, app) = redb_app(TWO_RULES);
        a_restricted_replay_queues_only_the_named_copies_on(&app).await;
    }

    /// As `a_restricted_replay_queues_only_the_named_copies`, on the JetStream store.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restricted_replay_queues_only_the_named_copies_on_jetstream() {
        let server = crate::store::jetstream::test_server::TestServer::start();
        let (_dir, app) = jetstream_app(&server, TWO_RULES).await;
        a_restricted_replay_queues_only_the_named_copies_on(&app).await;
    }

    /// Stores event t1 (matched by `audit`) and a replay job `id` over it, as running (what a
    /// restart finds), with the restriction `rules` and `targets`.
    async fn stored_running_replay(app: &Arc<App>, id: &str, rules: Value, targets: Value) {
        let now = app.clock.now_ms();
        app.store
            .accept(vec![new_event("/s", "t1", &["audit"], now - 1000)])
            .await
            .expect("accepted");
        let job = Job {
            state: JobState::Running,
            spec: serde_json::json!({
                "from": "", "to": "", "filter": null, "rate_per_sec": 1000.0,
                "rules": rules, "targets": targets,
                "from_ms": now - 5000, "to_ms": now,
            }),
            total: 1,
            created_at: now,
            updated_at: now,
            ..crate::store::test_events::job(id, JobKind::Replay)
        };
        app.store.put_job(job).await.expect("put");
    }

    /// A restricted replay stored as running (what a restart finds) resumes with its
    /// restriction: it is in the job's stored spec, which both stores keep whole.
    async fn a_restricted_replay_resumes_with_its_restriction_on(app: &Arc<App>) {
        stored_running_replay(app, "replay-7", serde_json::json!(["to-erp"]), Value::Null).await;
        let stored = app.store.jobs().await.expect("jobs");
        assert_eq!(stored[0].spec["rules"], serde_json::json!(["to-erp"]));
        start_due(app).await.expect("resumed");
        let done = wait_for(app, "replay-7", Duration::from_secs(30), |j| {
            j.state == JobState::Done
        })
        .await;
        assert_eq!(done.moved, 1, "{done:?}");
        assert_eq!(replayed_to(app, "t1", "replay-7").await, ["erp"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restricted_replay_resumes_with_its_restriction() {
        let (_dir, app) = redb_app(TWO_RULES);
        a_restricted_replay_resumes_with_its_restriction_on(&app).await;
    }

    /// As `a_restricted_replay_resumes_with_its_restriction`, on the JetStream store.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restricted_replay_resumes_with_its_restriction_on_jetstream() {
        let server = crate::store::jetstream::test_server::TestServer::start();
        let (_dir, app) = jetstream_app(&server, TWO_RULES).await;
        a_restricted_replay_resumes_with_its_restriction_on(&app).await;
    }

    /// A restricted replay whose named target or rule a reload removed since it was created
    /// (what a restart or a running job meets) pauses, saying which and what to do: it went on
    /// and skipped the rest of its range as `skipped_restricted`, ending `done` (the day-2
    /// audit: 13 of 30 events never replayed, nothing said).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restricted_replay_whose_names_were_removed_pauses_saying_so() {
        let (_dir, app) = redb_app(TWO_RULES);
        stored_running_replay(
            &app,
            "replay-8",
            serde_json::json!(["to-erp", "renamed-since"]),
            serde_json::json!(["gone"]),
        )
        .await;
        start_due(&app).await.expect("started");
        let paused = wait_for(&app, "replay-8", Duration::from_secs(30), |j| {
            j.state == JobState::Paused
        })
        .await;
        let why = paused.last_error.clone().unwrap_or_default();
        assert!(
            why.starts_with(
                r#"rule "renamed-since", target "gone" is no longer in the live rules"#
            ) && why.contains("resume it once the rules have it again"),
            "{why}"
        );
        assert_eq!(
            (paused.moved, paused.skipped, paused.skipped_restricted),
            (0, 0, 0),
            "{paused:?}"
        );
        assert!(replayed_to(&app, "t1", "replay-8").await.is_empty());
    }

    /// Unknown names are refused at their element with the closest name, empty lists and
    /// a restriction that can queue nothing too; nothing is created. A stored restriction
    /// that does not read is an error, never "every target".
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replay_restriction_names_live_rules_and_targets() {
        let (_dir, app) = redb_app(TWO_RULES);
        let now = app.clock.now_ms();
        let refused = |req: ReplayRequest| {
            let app = app.clone();
            async move {
                match create_replay(&app, req).await {
                    Err(JobError::Invalid(errors)) => errors
                        .into_iter()
                        .map(|e| (e.pointer, e.message))
                        .collect::<Vec<_>>(),
                    other => panic!("not refused: {other:?}"),
                }
            }
        };
        let e = refused(restricted(
            now,
            Some(&["to-erp", "to-erpp"]),
            Some(&["erp", "adit"]),
        ))
        .await;
        assert_eq!(e.len(), 2, "{e:?}");
        assert_eq!(e[0].0, "/rules/1");
        assert!(e[0].1.contains("did you mean \"to-erp\"?"), "{e:?}");
        assert_eq!(e[1].0, "/targets/1");
        assert!(e[1].1.contains("did you mean \"audit\"?"), "{e:?}");
        let e = refused(restricted(now, Some(&[]), Some(&[]))).await;
        let pointers: Vec<&str> = e.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(pointers, ["/rules", "/targets"]);
        let e = refused(restricted(now, Some(&["to-audit"]), Some(&["erp"]))).await;
        assert_eq!(e[0].0, "/targets", "{e:?}");
        assert!(app.store.jobs().await.expect("jobs").is_empty());

        // A disabled rule is accepted (it may be enabled before the job reaches its events),
        // with a warning.
        app.set_rule_enabled("to-erp", false, None)
            .await
            .expect("disabled");
        let job = create_replay(&app, restricted(now, Some(&["to-erp"]), None))
            .await
            .expect("created");
        assert!(
            job.warnings
                .iter()
                .any(|w| w.contains("rule \"to-erp\" is disabled")),
            "{:?}",
            job.warnings
        );

        assert!(ReplayRestriction::of_spec(&serde_json::json!({"rules": "to-erp"})).is_err());
        assert!(ReplayRestriction::of_spec(&serde_json::json!({"targets": [1]})).is_err());
        let none = ReplayRestriction::of_spec(&serde_json::json!({"rules": null})).expect("reads");
        assert!(!none.is_some());
    }

    /// A replay leaves the handlers' archived emissions out by default (re-running the
    /// handler on the parent emits them again: replaying them too delivered each twice), says
    /// how many in `skipped_emitted`, and replays them with `include_emitted`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replay_skips_handler_emissions_unless_asked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = crate::app::test_config(dir.path());
        std::fs::write(
            cfg.rules_dir.join("r.yaml"),
            "rules:\n  - name: r\n    pattern:\n      type: [{ prefix: \"\" }]\n    targets:\n      - webhook: http://127.0.0.1:9/\n        id: hook\n",
        )
        .expect("rules");
        let store = RedbStore::in_memory().expect("store");
        let app = crate::app::test_app(cfg, store, None);
        let now = app.clock.now_ms();
        let parent = new_event("/shop", "parent", &["hook"], now - 1000);
        let emitted = new_event("handler://enrich", "parent-key-0", &["hook"], now - 1000);
        app.store
            .accept(vec![parent, emitted])
            .await
            .expect("accepted");
        let done = replay_last_seconds(&app, now).await;
        assert_eq!(
            (done.moved, done.skipped, done.skipped_emitted),
            (1, 1, 1),
            "{done:?}"
        );
        let done = replay_last_seconds_with(&app, app.clock.now_ms(), true).await;
        assert_eq!(
            (done.moved, done.skipped, done.skipped_emitted),
            (2, 0, 0),
            "{done:?}"
        );
    }

    /// A replay checks the current contracts, as ingest does: an event archived before its
    /// type's contract refused it is skipped and counted in `skipped_contract` (it was
    /// replayed to receivers ingest now keeps it from), and replayed with `ignore_contracts`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replay_skips_events_the_current_contract_refuses_unless_asked() {
        let (dir, app) = app_on(&SimulatedDisk::new());
        let now = app.clock.now_ms();
        let mut passing = new_event("/s", "passing", &["hook"], now - 1000);
        passing.event = serde_json::from_value(
            serde_json::json!({"id": "passing", "source": "/s", "type": "t", "data": {"n": "one"}}),
        )
        .expect("valid event");
        // Accepted before the contract below existed: `n` is a number.
        let failing = new_event("/s", "failing", &["hook"], now - 1000);
        app.store
            .accept(vec![passing, failing])
            .await
            .expect("accepted");
        let contract = dir.path().join("contracts/t");
        std::fs::create_dir_all(&contract).expect("contract dir");
        std::fs::write(
            contract.join("v1.json"),
            r#"{"type": "object", "properties": {"n": {"type": "string"}}}"#,
        )
        .expect("contract");
        let cfg = crate::app::test_config(dir.path());
        app.contracts.store(Arc::new(
            crate::app::load_contracts(&cfg).expect("contracts"),
        ));
        let done = replay_last_seconds(&app, now).await;
        assert_eq!(
            (done.moved, done.skipped, done.skipped_contract),
            (1, 1, 1),
            "{done:?}"
        );
        let job = create_replay(
            &app,
            ReplayRequest {
                from: crate::clock::rfc3339(now - 5000),
                to: crate::clock::rfc3339(now),
                filter: None,
                rate_per_sec: 1000.0,
                include_emitted: false,
                ignore_contracts: true,
                rules: None,
                targets: None,
            },
        )
        .await
        .expect("created");
        let done = wait_for(&app, &job.id, Duration::from_secs(30), |j| {
            j.state == JobState::Done
        })
        .await;
        assert_eq!(
            (done.moved, done.skipped, done.skipped_contract),
            (2, 0, 0),
            "{done:?}"
        );
    }

    /// Replayed copies that meet their target's full queue go to the DLQ as
    /// `target_overflow`: new dead letters, counted in `router_dlq_entries_total` like those
    /// at acceptance (they used to count only as the job's `failed`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replayed_copies_past_the_depth_cap_are_counted_as_dead_letters() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = crate::app::test_config(dir.path());
        std::fs::write(
            cfg.rules_dir.join("r.yaml"),
            "policies:\n  capped:\n    max_queue_depth: 3\nrules:\n  - name: r\n    pattern:\n      type: [t]\n    targets:\n      - webhook: http://127.0.0.1:9/\n        id: hook\n        policy: capped\n",
        )
        .expect("rules");
        let store = RedbStore::in_memory().expect("store");
        let app = crate::app::test_app(cfg, store, None);
        let now = app.clock.now_ms();
        // No worker runs here: the three accepted entries stay queued, at the cap.
        let events = (0..3)
            .map(|i| new_event("/s", &format!("e{i}"), &["hook"], now - 1000))
            .collect();
        app.store.accept(events).await.expect("accepted");
        let done = replay_last_seconds(&app, now).await;
        // Each event once: failed, not also moved ("3/3 moved, 3 failed").
        assert_eq!((done.moved, done.failed), (0, 3), "{done:?}");
        let items = |outcome: &str| {
            app.metrics
                .job_items
                .get_or_create(&vec![
                    ("kind", "replay".to_owned()),
                    ("outcome", outcome.to_owned()),
                ])
                .get()
        };
        let counted = || {
            app.metrics
                .dlq_entries
                .get_or_create(&vec![
                    ("target", "hook".to_owned()),
                    ("reason", "target_overflow".to_owned()),
                ])
                .get()
        };
        // Counted after the step's commit, which `wait_for` may see first.
        settle(|| items("failed") >= 3 && counted() >= 3).await;
        assert_eq!((items("moved"), items("failed")), (0, 3));
        assert_eq!(counted(), 3, "every replayed copy in the DLQ is counted");
    }

    /// Waits (at most 10 s) until `done` holds: the job runner counts a step's items in the
    /// metrics after the step's commit, which a test reading the job may see first.
    async fn settle(done: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !done() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The archive sweep does not wait for jobs: events of a replay's range it removes before
    /// the job reaches them are counted as `expired` when the job ends, with a `last_error`
    /// saying how many and why. The job used to end `done` with them missing from its counts.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn events_the_archive_sweep_removed_before_a_replay_reached_them_are_expired() {
        let (_dir, app) = app_on(&SimulatedDisk::new());
        let now = app.clock.now_ms();
        // No targets: nothing refers to them, so the sweep takes them past its cut.
        let events = (0..3)
            .map(|i| new_event("/s", &format!("e{i}"), &[], now - 10_000))
            .collect();
        app.store.accept(events).await.expect("accepted");
        // Its first step comes two seconds after its creation; the sweep runs before.
        let job = create_replay(
            &app,
            ReplayRequest {
                from: crate::clock::rfc3339(now - 20_000),
                to: crate::clock::rfc3339(now),
                filter: None,
                rate_per_sec: 0.5,
                include_emitted: false,
                ignore_contracts: false,
                rules: None,
                targets: None,
            },
        )
        .await
        .expect("created");
        assert_eq!(job.total, 3, "{job:?}");
        assert!(job.warnings.is_empty(), "inside the retention: {job:?}");
        loop {
            let swept = app
                .store
                .sweep(app.clock.now_ms(), 5_000, 5_000)
                .await
                .expect("swept");
            if !swept.more {
                break;
            }
        }
        assert_eq!(
            app.store
                .count_events_between(now - 20_000, now)
                .await
                .expect("count"),
            0,
            "the sweep removed them"
        );
        let done = wait_for(&app, &job.id, Duration::from_secs(30), |j| {
            j.state == JobState::Done
        })
        .await;
        assert_eq!(done.state, JobState::Done, "{done:?}");
        assert_eq!(
            (done.moved, done.failed, done.skipped, done.expired),
            (0, 0, 0, 3),
            "{done:?}"
        );
        let why = done.last_error.as_deref().unwrap_or_default();
        assert!(
            why.starts_with("3 of the range's 3 events were removed from the archive")
                && why.contains("archive.retention = 7days"),
            "{why}"
        );
        let expired = || {
            app.metrics
                .job_items
                .get_or_create(&vec![
                    ("kind", "replay".to_owned()),
                    ("outcome", "expired".to_owned()),
                ])
                .get()
        };
        settle(|| expired() >= 3).await;
        assert_eq!(expired(), 3);
    }

    /// A replay of a range that starts before what the archive still holds is accepted, and
    /// says so from its creation on: a range in 1900 used to read as an empty one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replay_from_before_the_archive_horizon_says_where_the_horizon_is() {
        let (_dir, app) = app_on(&SimulatedDisk::new());
        let replay = |from: String| {
            create_replay(
                &app,
                ReplayRequest {
                    from,
                    to: crate::clock::rfc3339(app.clock.now_ms()),
                    filter: None,
                    rate_per_sec: 1000.0,
                    include_emitted: false,
                    ignore_contracts: false,
                    rules: None,
                    targets: None,
                },
            )
        };
        let job = replay("1900-01-01T00:00:00Z".into())
            .await
            .expect("accepted");
        assert_eq!(job.warnings.len(), 1, "{job:?}");
        let horizon = app.clock.now_ms() - 7 * 24 * 3600 * 1000;
        let w = &job.warnings[0];
        assert!(
            w.starts_with("events accepted before ")
                && w.contains("are no longer archived (archive.retention = 7days)"),
            "{w}"
        );
        let named = w
            .strip_prefix("events accepted before ")
            .and_then(|r| r.split(' ').next())
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            .map(|t| t.timestamp_millis())
            .expect("the horizon's time");
        assert!((named - horizon).abs() < 60_000, "{named} vs {horizon}");
        // Its later reads say so too.
        let read = get(&app, &job.id).await.expect("read");
        assert_eq!(read.warnings, job.warnings);
        // A range inside the archive has no warning.
        let recent = replay(crate::clock::rfc3339(app.clock.now_ms() - 60_000))
            .await
            .expect("accepted");
        assert!(recent.warnings.is_empty(), "{recent:?}");
    }

    /// Two redrives over the same entries: each entry is moved once, by one of them, and the
    /// other counts what it never reached as skipped. Both used to end `done` with items
    /// missing from their counts.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_redrive_counts_what_another_job_took_first_as_skipped() {
        let (_dir, app) = app_on(&SimulatedDisk::new());
        app.store
            .accept(vec![quarantined("a"), quarantined("b")])
            .await
            .expect("accepted");
        // The slow one's first step comes two seconds after its creation, the fast one's at
        // once.
        let slow = redrive_all(&app, 0.5).await;
        let fast = redrive_all(&app, 1000.0).await;
        let ended = |id: String| {
            let app = &app;
            async move {
                wait_for(app, &id, Duration::from_secs(30), |j| {
                    j.state == JobState::Done
                })
                .await
            }
        };
        let (fast, slow) = (ended(fast.id).await, ended(slow.id).await);
        for j in [&fast, &slow] {
            assert_eq!(j.state, JobState::Done, "{j:?}");
            assert_eq!(j.total, 2, "{j:?}");
            assert_eq!(j.moved + j.failed + j.skipped, j.total, "{j:?}");
        }
        // Each entry moved once, by one job or the other: on a slow machine the fast job may
        // not be done within the slow one's two seconds, and then they share the entries.
        assert_eq!(fast.moved + slow.moved, 2, "{fast:?} {slow:?}");
    }

    /// A rate below the runner's floor was accepted and echoed, and ran at the floor: it is
    /// refused, pointing at the rate.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rates_below_what_a_job_runs_at_are_refused() {
        let (_dir, app) = app_on(&SimulatedDisk::new());
        let now = app.clock.now_ms();
        for rate in [1e-300, 0.0001, 0.0, -1.0, 10_001.0] {
            let redrive = create_redrive(
                &app,
                RedriveRequest {
                    filter: FilterSpec::default(),
                    rate_per_sec: rate,
                    all: true,
                },
            )
            .await;
            let replay = create_replay(
                &app,
                ReplayRequest {
                    from: crate::clock::rfc3339(now - 60_000),
                    to: crate::clock::rfc3339(now),
                    filter: None,
                    rate_per_sec: rate,
                    include_emitted: false,
                    ignore_contracts: false,
                    rules: None,
                    targets: None,
                },
            )
            .await;
            for made in [redrive, replay] {
                match made {
                    Err(JobError::Invalid(e)) => {
                        assert_eq!(e[0].pointer, "/rate_per_sec", "{rate}");
                        assert!(e[0].message.contains("[0.001, 10000]"), "{}", e[0].message);
                    }
                    other => panic!("rate {rate} was not refused: {other:?}"),
                }
            }
        }
        assert!(app.store.jobs().await.expect("jobs").is_empty());
        let slowest = create_redrive(
            &app,
            RedriveRequest {
                filter: FilterSpec::default(),
                rate_per_sec: MIN_RATE,
                all: true,
            },
        )
        .await;
        assert!(slowest.is_ok(), "{slowest:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_step_the_store_fails_waits_shows_its_error_and_goes_on() {
        let disk = SimulatedDisk::new();
        let (_dir, app) = app_on(&disk);
        app.store
            .accept(vec![quarantined("a"), quarantined("b")])
            .await
            .expect("accepted");
        // One entry a second: the first step comes about a second after the job starts, with
        // the disk failing by then.
        let job = redrive_all(&app, 1.0).await;
        disk.set_failing(true);

        // Watched without reading the store: while its disk fails it may refuse reads too
        // (the job API answers 503 then).
        let counted = || {
            app.metrics
                .job_step_failures
                .get_or_create(&vec![("kind", "redrive".to_owned())])
                .get()
        };
        let deadline = Instant::now() + Duration::from_secs(15);
        while counted() == 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(counted() >= 1, "the failed step is counted");
        let shown = app.jobs.shown(job.clone());
        assert!(
            shown.last_error.is_some(),
            "a failed step shows in the job: {shown:?}"
        );
        assert!(
            app.jobs.running_here(&job.id),
            "the runner waits to try again"
        );

        disk.set_failing(false);
        // Retries come after 1, 2, 4, 8 s... of failures: generous for a loaded machine.
        let done = wait_for(&app, &job.id, Duration::from_secs(60), |j| {
            j.state == JobState::Done
        })
        .await;
        assert_eq!(done.state, JobState::Done, "{done:?}");
        assert_eq!(done.moved, 2, "each entry moved once: {done:?}");
        assert_eq!(done.last_error, None, "the error clears once steps succeed");
        let left = dlq_entries(&app).await;
        assert!(left.is_empty(), "both entries were redriven: {left:?}");
    }

    /// Past the disk's high-water mark a replay is refused (a copy of each event it goes
    /// through is a write), and a running one waits, saying why, then goes on once the store
    /// is below its low-water mark. Four replays took a store to 3.5 times its mark.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replay_waits_while_the_store_is_past_its_disk_mark() {
        use std::sync::atomic::Ordering::Relaxed;
        let (_dir, app) = app_on(&SimulatedDisk::new());
        let now = app.clock.now_ms();
        app.store
            .accept(vec![new_event("/s", "r1", &["hook"], now - 1000)])
            .await
            .expect("accept");
        let req = || ReplayRequest {
            from: crate::clock::rfc3339(now - 5000),
            to: crate::clock::rfc3339(now),
            filter: None,
            rate_per_sec: 1000.0,
            include_emitted: false,
            ignore_contracts: false,
            rules: None,
            targets: None,
        };
        app.disk_full.store(true, Relaxed);
        assert!(matches!(
            create_replay(&app, req()).await,
            Err(JobError::DiskFull)
        ));
        app.disk_full.store(false, Relaxed);
        let job = create_replay(&app, req()).await.expect("created");
        // Before its first step (a tick after it starts).
        app.disk_full.store(true, Relaxed);
        tokio::time::sleep(Duration::from_millis(800)).await;
        let held = get(&app, &job.id).await.expect("job");
        assert_eq!((held.state, held.moved), (JobState::Running, 0), "{held:?}");
        assert!(
            held.last_error
                .as_deref()
                .is_some_and(|e| e.contains("disk high-water mark")),
            "{held:?}"
        );
        app.disk_full.store(false, Relaxed);
        let done = wait_for(&app, &job.id, Duration::from_secs(30), |j| {
            j.state == JobState::Done
        })
        .await;
        assert_eq!((done.state, done.moved), (JobState::Done, 1), "{done:?}");
        assert_eq!(done.last_error, None);
    }
}
