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
}

impl Jobs {
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
    let job = Job {
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
    };
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
    let job = Job {
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
    };
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

/// Resumes every job that was running when the router stopped.
pub async fn resume_all(app: &Arc<App>) -> Result<(), StoreError> {
    for job in app.store.jobs().await? {
        if job.state == JobState::Running {
            tracing::info!(job = %job.id, moved = job.moved, "resuming job after restart");
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
    if let Some(h) = app.jobs.handle(id) {
        // The runner persists its own progress; it reads this before each step.
        *h.lock().unwrap_or_else(|p| p.into_inner()) = to;
        // Let the runner finish its current step before we write the state.
        tokio::time::sleep(Duration::from_millis(150)).await;
        job = get(app, id).await?;
    }
    job.state = to;
    job.updated_at = app.clock.now_ms();
    app.store.put_job(job.clone()).await?;
    if to == JobState::Running {
        spawn(app, job.clone());
    }
    tracing::warn!(job = %id, state = ?to, "job state changed by an operator");
    Ok(job)
}

fn spawn(app: &Arc<App>, job: Job) {
    let handle = Arc::new(Mutex::new(JobState::Running));
    app.jobs
        .handles
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(job.id.clone(), handle.clone());
    let app = app.clone();
    tokio::spawn(async move {
        let id = job.id.clone();
        if let Err(e) = run(&app, job, handle).await {
            tracing::error!(job = %id, error = %e, "job stopped with an error; it resumes at the next start");
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
    loop {
        tokio::time::sleep(TICK).await;
        if *handle.lock().unwrap_or_else(|p| p.into_inner()) != JobState::Running {
            return Ok(());
        }
        let now_i = std::time::Instant::now();
        tokens = (tokens + rate * now_i.duration_since(last).as_secs_f64()).min(rate.max(1.0));
        last = now_i;
        let take = tokens.floor() as usize;
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
    let n = events.len();
    app.store.replay_step(job.clone(), items, now).await?;
    Ok(n)
}
