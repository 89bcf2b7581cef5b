//! Dead letters and what operators do with them: filters, redrive jobs (after the fix, at a set
//! rate, resumable), purge, and replay jobs over the archive. Jobs persist their progress and
//! cursor in the same commit as the items they move, so a restart resumes them where they were
//! and never moves an item twice.

use std::collections::HashMap;
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
}

/// How often a job's runner renews its claim when no step wrote it, ms.
const HEARTBEAT_MS: i64 = 5_000;

/// A running job whose runner has not written it for this long is taken over by another node
/// (generous: the nodes' clocks are compared).
const JOB_STALE_MS: i64 = 30_000;

/// How often each node of a shared store looks for running jobs to take over.
const TAKEOVER_INTERVAL: Duration = Duration::from_secs(10);

impl Jobs {
    /// The controls of a node that shares its store with others, as `node`.
    pub fn shared(node: String) -> Self {
        Self {
            handles: Mutex::default(),
            runs: Mutex::default(),
            node: Some(node),
        }
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
    /// Storage failure.
    #[error(transparent)]
    Store(#[from] StoreError),
}

async fn next_job_id(app: &App, kind: JobKind) -> Result<String, StoreError> {
    let prefix = match kind {
        JobKind::Redrive => "redrive",
        JobKind::Replay => "replay",
    };
    let n = app
        .store
        .jobs()
        .await?
        .iter()
        .filter(|j| j.kind == kind)
        .count()
        + 1;
    if app.jobs.node.is_some() {
        // Two nodes creating a job at once would count the same jobs: a random part keeps
        // their ids apart.
        return Ok(format!("{prefix}-{n}-{:04x}", rand::random::<u16>()));
    }
    Ok(format!("{prefix}-{n}"))
}

/// Creates and starts a redrive job.
pub async fn create_redrive(app: &Arc<App>, req: RedriveRequest) -> Result<Job, JobError> {
    let filter = req.filter.to_filter("/filter").map_err(JobError::Invalid)?;
    if !(req.rate_per_sec > 0.0 && req.rate_per_sec <= 100_000.0) {
        return Err(JobError::Invalid(vec![FieldError::new(
            "/rate_per_sec",
            "must be in (0, 100000]",
        )]));
    }
    let total = count_matching(app, &filter).await?;
    // Entries that fail again come back with new ids: the job stops at the highest id that
    // existed when it was created, so it never chases its own failures.
    let max_id = app.store.dlq_max_id().await?;
    let now = app.clock.now_ms();
    let mut job = Job {
        id: next_job_id(app, JobKind::Redrive).await?,
        kind: JobKind::Redrive,
        state: JobState::Running,
        spec: serde_json::json!({ "filter": req.filter, "rate_per_sec": req.rate_per_sec, "max_id": max_id }),
        total,
        moved: 0,
        failed: 0,
        skipped: 0,
        cursor: 0,
        created_at: now,
        updated_at: now,
        last_error: None,
        runner: None,
        heartbeat_at: 0,
    };
    claim(app, &mut job);
    app.store.put_job(job.clone()).await?;
    spawn(app, job.clone());
    tracing::warn!(job = %job.id, total, rate = req.rate_per_sec, "redrive job created");
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
    if !(req.rate_per_sec > 0.0 && req.rate_per_sec <= 100_000.0) {
        errors.push(FieldError::new("/rate_per_sec", "must be in (0, 100000]"));
    }
    if let (Some(f), Some(t)) = (from, to)
        && f >= t
    {
        errors.push(FieldError::new("/to", "must be after from"));
    }
    if !errors.is_empty() {
        return Err(JobError::Invalid(errors));
    }
    let now = app.clock.now_ms();
    let mut job = Job {
        id: next_job_id(app, JobKind::Replay).await?,
        kind: JobKind::Replay,
        state: JobState::Running,
        spec: serde_json::json!({ "from": req.from, "to": req.to, "filter": req.filter, "rate_per_sec": req.rate_per_sec, "from_ms": from, "to_ms": to }),
        total: 0,
        moved: 0,
        failed: 0,
        skipped: 0,
        cursor: 0,
        created_at: now,
        updated_at: now,
        last_error: None,
        runner: None,
        heartbeat_at: 0,
    };
    claim(app, &mut job);
    app.store.put_job(job.clone()).await?;
    spawn(app, job.clone());
    tracing::warn!(job = %job.id, from = %req.from, to = %req.to, "replay job created");
    Ok(job)
}

async fn count_matching(app: &App, filter: &DlqFilter) -> Result<u64, StoreError> {
    let mut n = 0;
    let mut after = None;
    loop {
        let page = app.store.dlq_list(filter, after, 1000).await?;
        n += page.len() as u64;
        match page.last() {
            Some(d) if page.len() == 1000 => after = Some(d.id),
            _ => return Ok(n),
        }
    }
}

/// Resumes every job that was running when the router stopped. On a store several nodes
/// share: the jobs this node ran and those no node has renewed lately; the others run
/// elsewhere, and a background task takes them over if their node stops renewing them.
pub async fn resume_all(
    app: &Arc<App>,
    tracker: &tokio_util::task::TaskTracker,
    cancel: tokio_util::sync::CancellationToken,
) -> Result<(), StoreError> {
    let now = app.clock.now_ms();
    for job in app.store.jobs().await? {
        if job.state == JobState::Running && claimable(app, &job, now) {
            tracing::info!(job = %job.id, moved = job.moved, runner = ?job.runner, "resuming job after restart");
            spawn(app, job);
        }
    }
    if app.jobs.node.is_some() {
        let app = app.clone();
        tracker.spawn(async move {
            loop {
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = tokio::time::sleep(TAKEOVER_INTERVAL) => {}
                }
                if let Err(e) = take_over_stale(&app).await {
                    tracing::warn!(error = %e, "cannot look for jobs to take over");
                }
            }
        });
    }
    Ok(())
}

/// Whether this node may run `job` (running, not already here): always on a store of its own;
/// on a shared one when this node ran it, or its runner has not renewed it for `JOB_STALE_MS`.
fn claimable(app: &App, job: &Job, now: crate::store::Millis) -> bool {
    let Some(node) = &app.jobs.node else {
        return true;
    };
    job.runner.as_ref() == Some(node)
        || job.runner.is_none()
        || now.saturating_sub(job.heartbeat_at) > JOB_STALE_MS
}

/// Starts the running jobs whose node stopped renewing them.
async fn take_over_stale(app: &Arc<App>) -> Result<(), StoreError> {
    let now = app.clock.now_ms();
    for job in app.store.jobs().await? {
        // Judged by the run lock, not the handle's state: a runner that stopped on an error
        // or on another node's change leaves its handle paused, and must be startable again;
        // an operator's pause here holds the lock until the stored job says so.
        let here = app.jobs.running_here(&job.id);
        if job.state == JobState::Running && !here && claimable(app, &job, now) {
            tracing::warn!(job = %job.id, runner = ?job.runner, moved = job.moved, "taking over a job its node stopped running");
            spawn(app, job);
        }
    }
    Ok(())
}

/// One job by id.
pub async fn get(app: &App, id: &str) -> Result<Job, JobError> {
    app.store
        .jobs()
        .await?
        .into_iter()
        .find(|j| j.id == id)
        .ok_or(JobError::NotFound)
}

/// Pause, resume or cancel.
pub async fn control(app: &Arc<App>, id: &str, to: JobState) -> Result<Job, JobError> {
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
    let local = app.jobs.handle(id);
    // Held until the pause or cancel is written: meanwhile this node's take-over round sees a
    // runner here and does not start the job again from its stored (still running) state.
    let mut _runner_stopped = None;
    if let Some(h) = &local {
        // The runner persists its own progress; it reads this before each step.
        *h.lock().unwrap_or_else(|p| p.into_inner()) = to;
        if to == JobState::Running {
            // Let a runner finish its current step before we write the state (spawn below
            // stops and waits for one still going).
            tokio::time::sleep(Duration::from_millis(150)).await;
        } else {
            // The runner stops at its next tick, after the step it is in.
            _runner_stopped = Some(app.jobs.run_lock(id).lock_owned().await);
        }
        job = get(app, id).await?;
    }
    job.state = to;
    job.updated_at = app.clock.now_ms();
    if to == JobState::Running {
        // Resumed here, it runs here: the node that ran it before must not take it back.
        claim(app, &mut job);
    }
    app.store.put_job(job.clone()).await?;
    if app.jobs.node.is_some() && to != JobState::Running {
        // Run by another node, whose runner reads the state before each step: a step it was
        // finishing may have written the job back as running. Once it has read this, it
        // stops; write again if it did that.
        tokio::time::sleep(TICK * 5).await;
        let now = get(app, id).await?;
        if now.state == JobState::Running {
            job = Job {
                state: to,
                updated_at: app.clock.now_ms(),
                ..now
            };
            app.store.put_job(job.clone()).await?;
        }
    }
    if to == JobState::Running {
        spawn(app, job.clone());
    }
    tracing::warn!(job = %id, state = ?to, "job state changed by an operator");
    Ok(job)
}

/// On a shared store: marks `job` as run by this node, from now.
fn claim(app: &App, job: &mut Job) {
    if let Some(node) = &app.jobs.node {
        job.runner = Some(node.clone());
        job.heartbeat_at = app.clock.now_ms();
    }
}

fn spawn(app: &Arc<App>, mut job: Job) {
    claim(app, &mut job);
    let handle = Arc::new(Mutex::new(JobState::Running));
    let replaced = app
        .jobs
        .handles
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(job.id.clone(), handle.clone());
    let after_a_runner = replaced.is_some();
    if let Some(old) = replaced {
        // A runner still going here (paused on another node and resumed on this one before
        // it read the pause) stops at its next tick; the new one waits for it below.
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
        // After an earlier runner here, the job as stored now: it may have moved the cursor
        // since `job` was read.
        let stored = if after_a_runner {
            app.store.job(&id).await
        } else {
            Ok(None)
        };
        let job = match stored {
            Ok(Some(stored)) if stored.cursor >= job.cursor => Job {
                state: job.state,
                runner: job.runner,
                heartbeat_at: job.heartbeat_at,
                updated_at: job.updated_at,
                ..stored
            },
            _ => job,
        };
        if let Err(e) = run(&app, job, handle.clone()).await {
            // Not running here any more: on a shared store this node's take-over round starts
            // it again (it is still this node's); on its own store the next start does.
            *handle.lock().unwrap_or_else(|p| p.into_inner()) = JobState::Paused;
            if app.jobs.node.is_some() {
                tracing::error!(job = %id, error = %e, "job stopped with an error; it is started again within a take-over round");
            } else {
                tracing::error!(job = %id, error = %e, "job stopped with an error; it resumes at the next start");
            }
        }
    });
}

const TICK: Duration = Duration::from_millis(100);

async fn run(app: &Arc<App>, mut job: Job, handle: Arc<Mutex<JobState>>) -> Result<(), StoreError> {
    let rate = job.spec["rate_per_sec"].as_f64().unwrap_or(10.0).max(0.001);
    let mut tokens = 0.0f64;
    let mut last = std::time::Instant::now();
    let pattern = job
        .spec
        .get("filter")
        .filter(|f| !f.is_null())
        .and_then(|f| Pattern::compile(f).ok());
    let filter = serde_json::from_value::<FilterSpec>(job.spec["filter"].clone())
        .ok()
        .and_then(|f| f.to_filter("").ok())
        .unwrap_or_default();
    if app.jobs.node.is_some() {
        // The claim, before the first step (which may be a while at a low rate).
        job.heartbeat_at = app.clock.now_ms();
        app.store.put_job(job.clone()).await?;
    }
    loop {
        tokio::time::sleep(TICK).await;
        if *handle.lock().unwrap_or_else(|p| p.into_inner()) != JobState::Running {
            return Ok(());
        }
        let now_i = std::time::Instant::now();
        tokens = (tokens + rate * now_i.duration_since(last).as_secs_f64()).min(rate.max(1.0));
        last = now_i;
        let take = tokens.floor() as usize;
        // On a shared store, the stored job is read before each step (its step would write
        // over a pause or cancel made on another node since) and, while no step writes it,
        // when the claim is due for renewal.
        if app.jobs.node.is_some()
            && (take > 0 || app.clock.now_ms().saturating_sub(job.heartbeat_at) >= HEARTBEAT_MS)
            && !still_ours(app, &mut job).await?
        {
            *handle.lock().unwrap_or_else(|p| p.into_inner()) = JobState::Paused;
            return Ok(());
        }
        if take == 0 {
            continue;
        }
        let now = app.clock.now_ms();
        let n = match job.kind {
            JobKind::Redrive => redrive_step(app, &mut job, &filter, take, now).await?,
            JobKind::Replay => replay_step(app, &mut job, pattern.as_ref(), take, now).await?,
        };
        tokens -= n as f64;
        if job.state == JobState::Done {
            tracing::info!(job = %job.id, moved = job.moved, failed = job.failed, "job finished");
            return Ok(());
        }
    }
}

/// On a shared store: whether `job` is still this node's to run (an operator on another node
/// may have paused or cancelled it, or a node that thought this one dead took it over), and its
/// claim renewed when no step has written it for `HEARTBEAT`. Always true on a store of its
/// own, where the local controls are the only ones.
async fn still_ours(app: &App, job: &mut Job) -> Result<bool, StoreError> {
    let Some(node) = &app.jobs.node else {
        return Ok(true);
    };
    let Some(stored) = app.store.job(&job.id).await? else {
        return Ok(false);
    };
    if stored.state != JobState::Running || stored.runner.as_ref() != Some(node) {
        tracing::warn!(job = %job.id, state = ?stored.state, runner = ?stored.runner, "job stopped here: changed on another node");
        if stored.runner.as_ref() == Some(node) && stored.cursor < job.cursor {
            // Paused or cancelled on another node from a copy read before this node's last
            // step: that write took the cursor back, and a resume would move those items
            // again. This runner's progress goes back on top of the operator's state.
            app.store
                .put_job(Job {
                    state: stored.state,
                    updated_at: stored.updated_at,
                    ..job.clone()
                })
                .await?;
        }
        return Ok(false);
    }
    let now = app.clock.now_ms();
    if now.saturating_sub(job.heartbeat_at) >= HEARTBEAT_MS {
        job.heartbeat_at = now;
        app.store.put_job(job.clone()).await?;
    }
    Ok(true)
}

async fn redrive_step(
    app: &App,
    job: &mut Job,
    filter: &DlqFilter,
    take: usize,
    now: i64,
) -> Result<usize, StoreError> {
    let max_id = job.spec["max_id"].as_u64().unwrap_or(u64::MAX);
    let mut page = app.store.dlq_list(filter, Some(job.cursor), take).await?;
    page.retain(|d| d.id <= max_id);
    if page.is_empty() {
        job.state = JobState::Done;
        job.updated_at = now;
        job.heartbeat_at = now;
        app.store.redrive_step(job.clone(), Vec::new(), now).await?;
        return Ok(0);
    }
    let contracts = app.contracts.load();
    let rules = app.rules.load();
    let mut actions = Vec::with_capacity(page.len());
    for d in &page {
        job.cursor = d.id;
        match d.reason {
            DlqReason::ContractViolation | DlqReason::UnknownVersion => {
                // Re-validated against the current contracts; routed by the current rules.
                let Some((_, ev)) = app.store.dlq_get(d.id).await? else {
                    continue;
                };
                match contracts.check(&ev.event) {
                    ContractOutcome::Pass => {
                        let (matched_rules, targets) =
                            crate::ingest::match_targets(&rules, &app.disabled_rules(), &ev.event);
                        actions.push(RedriveAction::Route {
                            dlq_id: d.id,
                            matched_rules,
                            targets,
                        });
                        job.moved += 1;
                    }
                    ContractOutcome::Violation { reason, errors, .. } => {
                        let _ = reason == ViolationReason::UnknownVersion;
                        actions.push(RedriveAction::Keep {
                            dlq_id: d.id,
                            errors,
                        });
                        job.failed += 1;
                    }
                }
            }
            DlqReason::TargetOverflow => {
                // It never got a queue entry: give it one now, for the same target.
                let (Some(target), Some(rule)) = (d.target_id.clone(), d.rule.clone()) else {
                    job.skipped += 1;
                    continue;
                };
                actions.push(RedriveAction::Route {
                    dlq_id: d.id,
                    matched_rules: vec![rule.clone()],
                    targets: vec![crate::store::NewEntry {
                        target_id: target,
                        rule,
                        ordering_key: None,
                        max_depth: None,
                        lease_ms: None,
                    }],
                });
                job.moved += 1;
            }
            _ if d.entry.is_some() => {
                actions.push(RedriveAction::Requeue { dlq_id: d.id });
                job.moved += 1;
            }
            _ => job.skipped += 1,
        }
    }
    job.updated_at = now;
    job.heartbeat_at = now;
    let n = page.len();
    app.store.redrive_step(job.clone(), actions, now).await?;
    Ok(n)
}

async fn replay_step(
    app: &App,
    job: &mut Job,
    pattern: Option<&Pattern>,
    take: usize,
    now: i64,
) -> Result<usize, StoreError> {
    let from = job.spec["from_ms"].as_i64().unwrap_or(0);
    let to = job.spec["to_ms"].as_i64().unwrap_or(0);
    let events = app.store.events_between(from, to, job.cursor, take).await?;
    if events.is_empty() {
        job.state = JobState::Done;
        job.updated_at = now;
        job.heartbeat_at = now;
        app.store.replay_step(job.clone(), Vec::new(), now).await?;
        return Ok(0);
    }
    let rules = app.rules.load();
    let mut items = Vec::new();
    for ev in &events {
        job.cursor = ev.seq;
        let json = ev.event.to_json();
        if pattern.is_some_and(|p| !p.matches(&json)) {
            job.skipped += 1;
            continue;
        }
        let (_, targets) = crate::ingest::match_targets(&rules, &app.disabled_rules(), &ev.event);
        if targets.is_empty() {
            job.skipped += 1;
            continue;
        }
        items.push(ReplayItem {
            seq: ev.seq,
            targets,
        });
        job.moved += 1;
    }
    job.total = job.moved + job.skipped;
    job.updated_at = now;
    job.heartbeat_at = now;
    let n = events.len();
    app.store.replay_step(job.clone(), items, now).await?;
    Ok(n)
}
