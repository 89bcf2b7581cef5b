//! `router bench`: a load generator for `POST /v1/events` and a sink that only parses and
//! discards (the baseline ceiling, and a fast webhook receiver for delivery benchmarks).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::json;

/// Parameters of `router bench ingest` (its command-line arguments).
#[derive(Debug, Clone, clap::Args)]
pub struct IngestBench {
    /// Full URL of the ingest endpoint.
    #[arg(long, default_value = "http://127.0.0.1:8080/v1/events")]
    pub url: String,
    /// Events to send in total.
    #[arg(long, default_value_t = 100_000)]
    pub events: u64,
    /// Concurrent connections.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Events per request (1 = structured mode, more = batch mode).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Approximate bytes per event.
    #[arg(long, default_value_t = 1024)]
    pub size: usize,
    /// Fixed rate in events/s (open loop: requests go out on schedule, and latency counts from
    /// when each was due, so a stall is not hidden); default: as fast as possible.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Event type to send.
    #[arg(long = "type", default_value = "bench.event")]
    pub event_type: String,
    /// Event ids that start with 32 pseudo-random hex digits (`<hex>-<run>-<number>`), as
    /// producers using UUIDv4 ids send, instead of `<run>-<number>`: sequential ids land next
    /// to each other in the store's dedup index, random ones anywhere in it.
    #[arg(long)]
    pub random_ids: bool,
    /// Bearer token, for a router with `[[auth.tokens]]`.
    #[arg(long, env = "ROUTER_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Also print, every this many seconds, the requests finished in that interval with their
    /// latency percentiles (to stderr), to see when a stall happened.
    #[arg(long)]
    pub report_every: Option<u64>,
}

/// Result of a run.
#[derive(Debug, Clone)]
pub struct BenchReport {
    /// Events acknowledged with 2xx.
    pub ok_events: u64,
    /// Requests that failed (non-2xx or transport error).
    pub failed_requests: u64,
    /// Wall time.
    pub elapsed: Duration,
    /// Request latency percentiles in microseconds: p50, p99, p99.9, max.
    pub latency_us: [u64; 4],
    /// The slowest request: when it was sent and what it carried, so an outlier can be found
    /// in the router's log and metrics.
    pub slowest: Option<Slowest>,
}

/// The slowest request of a run.
#[derive(Debug, Clone, Copy)]
pub struct Slowest {
    /// Its latency in microseconds.
    pub latency_us: u64,
    /// When it was sent, from the start of the run.
    pub sent_at: Duration,
    /// The number of its first event (the event id is `<run>-<number>`, or ends with it).
    pub first_event: u64,
    /// Whether it failed.
    pub failed: bool,
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secs = self.elapsed.as_secs_f64();
        writeln!(f, "events ok:      {}", self.ok_events)?;
        writeln!(f, "failed reqs:    {}", self.failed_requests)?;
        writeln!(f, "elapsed:        {secs:.2} s")?;
        writeln!(
            f,
            "throughput:     {:.0} events/s",
            self.ok_events as f64 / secs
        )?;
        let ms = |us: u64| us as f64 / 1000.0;
        write!(
            f,
            "latency (req):  p50 {:.2} ms  p99 {:.2} ms  p99.9 {:.2} ms  max {:.2} ms",
            ms(self.latency_us[0]),
            ms(self.latency_us[1]),
            ms(self.latency_us[2]),
            ms(self.latency_us[3])
        )?;
        if let Some(w) = &self.slowest {
            write!(
                f,
                "\nslowest req:    {:.2} ms, sent at +{:.3} s, first event #{}{}",
                ms(w.latency_us),
                w.sent_at.as_secs_f64(),
                w.first_event,
                if w.failed { " (failed)" } else { "" }
            )?;
        }
        Ok(())
    }
}

/// SplitMix64's finaliser: a bijective mix of `x`, for ids that look random but are
/// reproducible from their number.
fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The id of event `n` of `run`: `<run>-<n>`, or with `random` a UUID-like random prefix.
fn event_id(run: &str, n: u64, random: bool) -> String {
    if random {
        format!("{:016x}{:016x}-{run}-{n}", mix64(n), mix64(!n))
    } else {
        format!("{run}-{n}")
    }
}

fn make_event(run: &str, n: u64, size: usize, ty: &str, random_id: bool) -> serde_json::Value {
    let base = json!({
        "specversion": "1.0",
        "id": event_id(run, n, random_id),
        "source": "/bench/ingest",
        "type": ty,
        "datacontenttype": "application/json",
        "data": { "order_id": n, "total": (n % 1000) as f64 + 0.5, "country": "NL", "pad": "" },
    });
    let len = base.to_string().len();
    let mut ev = base;
    if size > len {
        ev["data"]["pad"] = json!("x".repeat(size - len));
    }
    ev
}

fn latency_histogram() -> Result<hdrhistogram::Histogram<u64>, String> {
    hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).map_err(|e| e.to_string())
}

/// What a run's tasks count: events acknowledged, requests failed, and each request's latency
/// (in a histogram per task, merged into this one when the task ends).
struct Tally {
    ok: AtomicU64,
    failed: AtomicU64,
    hist: std::sync::Mutex<hdrhistogram::Histogram<u64>>,
    started: Instant,
    max_us: AtomicU64,
    slowest: std::sync::Mutex<Option<Slowest>>,
    /// Latencies of the current reporting interval (`--report-every`).
    window: Option<std::sync::Mutex<hdrhistogram::Histogram<u64>>>,
}

impl Tally {
    fn new() -> Result<Arc<Self>, String> {
        Ok(Arc::new(Self::build()?))
    }

    fn build() -> Result<Self, String> {
        Ok(Self {
            ok: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            hist: std::sync::Mutex::new(latency_histogram()?),
            started: Instant::now(),
            max_us: AtomicU64::new(0),
            slowest: std::sync::Mutex::new(None),
            window: None,
        })
    }

    /// A tally that also keeps each interval's latencies, printed every `every` by a task
    /// this spawns (it ends with the tally's last other owner).
    fn with_intervals(every: Duration) -> Result<Arc<Self>, String> {
        let mut t = Self::build()?;
        t.window = Some(std::sync::Mutex::new(latency_histogram()?));
        let t = Arc::new(t);
        let weak = Arc::downgrade(&t);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(t) = weak.upgrade() else { break };
                let Some(Ok(mut w)) = t.window.as_ref().map(|w| w.lock()) else {
                    break;
                };
                crate::errln!(
                    "+{:>5.0}s  {:>7} req  p50 {:>8.2} ms  p99 {:>8.2} ms  max {:>8.2} ms",
                    t.started.elapsed().as_secs_f64(),
                    w.len(),
                    w.value_at_quantile(0.5) as f64 / 1e3,
                    w.value_at_quantile(0.99) as f64 / 1e3,
                    w.max() as f64 / 1e3
                );
                w.reset();
            }
        });
        Ok(t)
    }

    /// One request sent at `t0` carrying events from `first_event` on: `ok_events`
    /// acknowledged, or `None` when it failed.
    fn record(
        &self,
        local: &mut Option<hdrhistogram::Histogram<u64>>,
        t0: Instant,
        first_event: u64,
        ok_events: Option<u64>,
    ) {
        let us = u64::try_from(t0.elapsed().as_micros())
            .unwrap_or(u64::MAX)
            .max(1);
        if let Some(h) = local.as_mut() {
            let _ = h.record(us);
        }
        if let Some(Ok(mut w)) = self.window.as_ref().map(|w| w.lock()) {
            let _ = w.record(us);
        }
        // The lock is taken only by a new maximum: rare after the first requests.
        if us > self.max_us.fetch_max(us, Ordering::Relaxed)
            && let Ok(mut w) = self.slowest.lock()
            && w.is_none_or(|w| us > w.latency_us)
        {
            *w = Some(Slowest {
                latency_us: us,
                sent_at: t0.saturating_duration_since(self.started),
                first_event,
                failed: ok_events.is_none(),
            });
        }
        match ok_events {
            Some(n) => self.ok.fetch_add(n, Ordering::Relaxed),
            None => self.failed.fetch_add(1, Ordering::Relaxed),
        };
    }

    fn merge(&self, local: Option<hdrhistogram::Histogram<u64>>) {
        if let (Some(l), Ok(mut h)) = (local, self.hist.lock()) {
            let _ = h.add(l);
        }
    }

    fn report(&self, elapsed: Duration) -> Result<BenchReport, String> {
        let h = self
            .hist
            .lock()
            .map_err(|_| "histogram poisoned".to_string())?;
        Ok(BenchReport {
            ok_events: self.ok.load(Ordering::Relaxed),
            failed_requests: self.failed.load(Ordering::Relaxed),
            elapsed,
            latency_us: [
                h.value_at_quantile(0.5),
                h.value_at_quantile(0.99),
                h.value_at_quantile(0.999),
                h.max(),
            ],
            slowest: self.slowest.lock().ok().and_then(|w| *w),
        })
    }
}

/// Runs the ingest load and returns the report.
pub async fn run_ingest(b: IngestBench) -> Result<BenchReport, String> {
    let uri: hyper::Uri = b.url.parse().map_err(|e| format!("bad url: {e}"))?;
    let authorization = match b.token.as_deref().filter(|t| !t.is_empty()) {
        Some(t) => Some(
            hyper::header::HeaderValue::from_str(&format!("Bearer {t}"))
                .map_err(|_| "the token is not a valid header value".to_string())?,
        ),
        None => None,
    };
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(b.concurrency)
        .build(connector);
    let run = format!("{:x}", rand::random::<u64>());
    let next = Arc::new(AtomicU64::new(0));
    let tally = match b.report_every {
        Some(secs) => Tally::with_intervals(Duration::from_secs(secs.max(1)))?,
        None => Tally::new()?,
    };
    let started = Instant::now();
    let mut tasks = Vec::new();
    let batch = b.batch.max(1) as u64;
    // Open loop: each connection sends at its share of the rate.
    let per_conn_interval = b
        .rate
        .map(|r| Duration::from_secs_f64(batch as f64 * b.concurrency as f64 / r));
    for conn in 0..b.concurrency {
        let (client, uri, run, next, tally, ty, authorization) = (
            client.clone(),
            uri.clone(),
            run.clone(),
            next.clone(),
            tally.clone(),
            b.event_type.clone(),
            authorization.clone(),
        );
        let (total, size, concurrency, random_ids) =
            (b.events, b.size, b.concurrency, b.random_ids);
        tasks.push(tokio::spawn(async move {
            let mut local = latency_histogram().ok();
            // Connections start a share of the interval apart, so requests arrive evenly
            // spaced at the rate. All starting at once sent them in bursts of `concurrency`
            // every interval, and the last of a burst waited for the whole burst: at 4,000/s
            // over 64 connections, 64 requests at once every 16 ms, which measured the
            // router's latency for bursts instead of for the rate.
            let mut tick = per_conn_interval.map(|i| {
                let phase = i.mul_f64(conn as f64 / concurrency as f64);
                let mut t = tokio::time::interval_at(tokio::time::Instant::now() + phase, i);
                // A late request does not move the schedule: the ones after it go out at once,
                // and their latency counts from when they were due (below), so a stall of the
                // router shows in the percentiles instead of slowing the generator down
                // (coordinated omission).
                t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                t
            });
            loop {
                let start = next.fetch_add(batch, Ordering::Relaxed);
                if start >= total {
                    break;
                }
                let end = (start + batch).min(total);
                let due = match tick.as_mut() {
                    Some(t) => Some(t.tick().await.into_std()),
                    None => None,
                };
                let (body, ct) = if batch == 1 {
                    (
                        make_event(&run, start, size, &ty, random_ids).to_string(),
                        "application/cloudevents+json",
                    )
                } else {
                    let evs: Vec<_> = (start..end)
                        .map(|n| make_event(&run, n, size, &ty, random_ids))
                        .collect();
                    (
                        serde_json::Value::from(evs).to_string(),
                        "application/cloudevents-batch+json",
                    )
                };
                let mut rb = Request::post(uri.clone()).header("content-type", ct);
                if let Some(a) = &authorization {
                    rb = rb.header(hyper::header::AUTHORIZATION, a.clone());
                }
                let req = match rb.body(Full::new(Bytes::from(body))) {
                    Ok(r) => r,
                    Err(_) => break,
                };
                let t0 = due.unwrap_or_else(Instant::now);
                let res = client.request(req).await;
                let good = match res {
                    Ok(resp) => {
                        let s = resp.status();
                        let _ = resp.into_body().collect().await;
                        s.is_success()
                    }
                    Err(_) => false,
                };
                tally.record(&mut local, t0, start, good.then_some(end - start));
            }
            tally.merge(local);
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    tally.report(started.elapsed())
}

/// Parameters of `router bench store` (its command-line arguments).
#[derive(Debug, Clone, clap::Args)]
pub struct StoreBench {
    /// Data directory of the store (created; must be empty or new: see `allow_existing`).
    #[arg(long)]
    pub dir: std::path::PathBuf,
    /// Write into a directory that already holds files (a store from an earlier run). Never
    /// a production data directory: its router would find the bench's events and queues.
    #[arg(long)]
    pub allow_existing: bool,
    /// Events to accept in total.
    #[arg(long, default_value_t = 100_000)]
    pub events: u64,
    /// Concurrent writers.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Events per accept call.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Approximate bytes per event.
    #[arg(long, default_value_t = 1024)]
    pub size: usize,
    /// Queue entries per event (targets it fans out to).
    #[arg(long, default_value_t = 2)]
    pub targets: usize,
    /// Durable groups through the group log (`store.group_log`), or a synced commit each.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub group_log: bool,
    /// UUID-like random event ids (see `bench ingest --random-ids`).
    #[arg(long)]
    pub random_ids: bool,
    /// Also print, every this many events, the throughput of the last stretch (to stderr), to
    /// see how it changes as the store grows.
    #[arg(long)]
    pub report_every: Option<u64>,
}

/// Bench event `n` of `run` as the store accepts it: `targets` queue entries (`bench-0`, …),
/// accepted at `accepted_at`.
fn store_event(
    run: &str,
    n: u64,
    size: usize,
    targets: usize,
    accepted_at: i64,
    dedup_window_ms: i64,
    random_id: bool,
) -> Result<crate::store::NewEvent, String> {
    use crate::store::{NewEntry, NewEvent};
    let event = serde_json::from_value(make_event(run, n, size, "bench.event", random_id))
        .map_err(|e| e.to_string())?;
    Ok(NewEvent {
        event,
        accepted_at,
        ruleset_version: "bench".into(),
        matched_rules: vec!["bench".into()],
        targets: (0..targets)
            .map(|t| NewEntry {
                target_id: format!("bench-{t}"),
                rule: "bench".into(),
                ordering_key: None,
                max_depth: None,
                lease_ms: None,
            })
            .collect(),
        quarantine: None,
        dedup_window_ms,
    })
}

/// The store alone, without HTTP: `concurrency` writers accept events (each with `targets`
/// queue entries) as fast as the committer makes them durable, which is what an ingest
/// request waits for. Isolates the store's group commit from the HTTP and delivery work.
/// Refuses a `--dir` that holds anything (unless `allow`): the store benches write their
/// events, queue entries and dead letters into the store there, and pointed at a production
/// data directory they left hundreds of fake dead letters for its router's next start.
fn bench_dir(dir: &std::path::Path, allow: bool) -> Result<(), String> {
    let first = match std::fs::read_dir(dir) {
        Ok(mut entries) => entries.next().and_then(Result::ok),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("{}: {e}", dir.display())),
    };
    match first {
        Some(entry) if !allow => Err(format!(
            "{} is not empty (it holds {}): the bench writes its own events, queues and dead \
             letters into the store there. Give it a new directory, or pass --allow-existing \
             to write into this one (never a router's data directory)",
            dir.display(),
            entry.file_name().to_string_lossy()
        )),
        _ => Ok(()),
    }
}

pub async fn run_store(b: StoreBench) -> Result<BenchReport, String> {
    use crate::store::{RedbStore, Store, StoreOptions};
    bench_dir(&b.dir, b.allow_existing)?;
    let store = RedbStore::open_dir(
        &b.dir,
        StoreOptions {
            group_log: b.group_log,
            ..StoreOptions::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let run = format!("{:x}", rand::random::<u64>());
    let next = Arc::new(AtomicU64::new(0));
    let tally = Tally::new()?;
    let batch = b.batch.max(1) as u64;
    let started = Instant::now();
    let mut tasks = Vec::new();
    let stretch = b.report_every.filter(|&n| n > 0);
    let stretch_start = Arc::new(std::sync::Mutex::new(Instant::now()));
    // The slowest accept of the current stretch, in microseconds: a stall shows where it was.
    let stretch_max = Arc::new(AtomicU64::new(0));
    for _ in 0..b.concurrency {
        let (store, run, next, tally) = (store.clone(), run.clone(), next.clone(), tally.clone());
        let stretch_max = stretch_max.clone();
        let (total, size, targets, random_ids) = (b.events, b.size, b.targets, b.random_ids);
        let stretch_start = stretch_start.clone();
        tasks.push(tokio::spawn(async move {
            let mut local = latency_histogram().ok();
            loop {
                let start = next.fetch_add(batch, Ordering::Relaxed);
                if start >= total {
                    break;
                }
                let end = (start + batch).min(total);
                let now = chrono::Utc::now().timestamp_millis();
                let events = (start..end)
                    .filter_map(|n| {
                        store_event(&run, n, size, targets, now, 86_400_000, random_ids).ok()
                    })
                    .collect::<Vec<_>>();
                let n = events.len() as u64;
                let t0 = Instant::now();
                let res = store.accept(events).await;
                let took = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX);
                stretch_max.fetch_max(took, Ordering::Relaxed);
                tally.record(&mut local, t0, start, res.is_ok().then_some(n));
                if let Some(every) = stretch
                    && start / every != end / every
                {
                    let mut since = stretch_start.lock().unwrap_or_else(|p| p.into_inner());
                    crate::errln!(
                        "{end} events: {:.0} events/s over the last {every}, slowest accept {:.1} ms",
                        every as f64 / since.elapsed().as_secs_f64(),
                        stretch_max.swap(0, Ordering::Relaxed) as f64 / 1000.0
                    );
                    *since = Instant::now();
                }
            }
            tally.merge(local);
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    tally.report(started.elapsed())
}

/// Parameters of `router bench sweep` (its command-line arguments).
#[derive(Debug, Clone, clap::Args)]
pub struct SweepBench {
    /// Data directory of the store (created; must be empty or new: see `allow_existing`).
    #[arg(long)]
    pub dir: std::path::PathBuf,
    /// Write into a directory that already holds files (see `StoreBench::allow_existing`).
    #[arg(long)]
    pub allow_existing: bool,
    /// Events to accept, deliver and then sweep.
    #[arg(long, default_value_t = 50_000)]
    pub events: u64,
    /// Approximate bytes per event.
    #[arg(long, default_value_t = 1024)]
    pub size: usize,
    /// Queue entries per event (each leased and delivered before the sweep).
    #[arg(long, default_value_t = 1)]
    pub targets: usize,
    /// Events examined per sweep call (default: the store's).
    #[arg(long)]
    pub batch: Option<usize>,
}

/// What `router bench sweep` measured.
#[derive(Debug)]
pub struct SweepReport {
    /// Events removed.
    pub removed: u64,
    /// Sweep calls made.
    pub calls: u64,
    /// Wall time of all sweep calls.
    pub elapsed: Duration,
    /// Per-call latency percentiles in microseconds: p50, p99, max.
    pub call_us: (u64, u64, u64),
}

impl std::fmt::Display for SweepReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        writeln!(
            f,
            "swept {} events in {} calls, {:.2} s: {:.0} events/s, {:.1} us/event",
            self.removed,
            self.calls,
            secs,
            self.removed as f64 / secs,
            secs * 1e6 / (self.removed.max(1) as f64)
        )?;
        write!(
            f,
            "per call (one commit each): p50 {:.2} ms  p99 {:.2} ms  max {:.2} ms",
            self.call_us.0 as f64 / 1e3,
            self.call_us.1 as f64 / 1e3,
            self.call_us.2 as f64 / 1e3
        )
    }
}

/// The sweeper's cost alone: `events` events are accepted two hours in the past (dedup window
/// and retention one minute), each queue entry is leased and delivered, then the store is
/// swept until nothing is left, timing every sweep call. A sweep call is one commit, which
/// every ingest request that joins its group waits for.
pub async fn run_sweep(b: SweepBench) -> Result<SweepReport, String> {
    use crate::store::{AttemptEnd, AttemptResult, Disposition, RedbStore, Store, StoreOptions};
    let opts = StoreOptions {
        sweep_batch: b.batch,
        ..StoreOptions::default()
    };
    bench_dir(&b.dir, b.allow_existing)?;
    let store = RedbStore::open_dir(&b.dir, opts).map_err(|e| e.to_string())?;
    let run = format!("{:x}", rand::random::<u64>());
    let now = chrono::Utc::now().timestamp_millis();
    let past = now - 2 * 3_600_000;
    let mut n = 0;
    while n < b.events {
        let end = (n + 100).min(b.events);
        let events = (n..end)
            .map(|i| store_event(&run, i, b.size, b.targets, past, 60_000, false))
            .collect::<Result<Vec<_>, String>>()?;
        store.accept(events).await.map_err(|e| e.to_string())?;
        n = end;
    }
    for t in 0..b.targets {
        let target = format!("bench-{t}");
        loop {
            let leased = store
                .lease(&target, now, 512, 600_000)
                .await
                .map_err(|e| e.to_string())?;
            if leased.is_empty() {
                break;
            }
            let finishes = leased.into_iter().map(|l| {
                store.finish(
                    l.entry.id,
                    l.lease,
                    AttemptEnd {
                        finished_at: now,
                        result: AttemptResult::Delivered,
                        status: Some(200),
                        error: None,
                        outbox: None,
                    },
                    Disposition::Delivered,
                    now,
                )
            });
            for r in futures::future::join_all(finishes).await {
                r.map_err(|e| format!("{e:?}"))?;
            }
        }
    }
    let mut hist = latency_histogram()?;
    let (mut removed, mut calls) = (0, 0);
    let started = Instant::now();
    loop {
        let t0 = Instant::now();
        let s = store
            .sweep(now, 60_000, 60_000)
            .await
            .map_err(|e| e.to_string())?;
        let _ = hist.record(t0.elapsed().as_micros().max(1) as u64);
        if std::env::var_os("SWEEP_TRACE").is_some() {
            crate::errln!(
                "call {calls}: {:?} removed {}",
                t0.elapsed(),
                s.events_removed
            );
        }
        calls += 1;
        removed += s.events_removed;
        if !s.more {
            break;
        }
    }
    Ok(SweepReport {
        removed,
        calls,
        elapsed: started.elapsed(),
        call_us: (
            hist.value_at_quantile(0.5),
            hist.value_at_quantile(0.99),
            hist.max(),
        ),
    })
}

/// Runs a sink on `addr`: every request's body is read and parsed as JSON, then answered
/// with `status`. Counts events received (array elements count one each) in `counter`.
pub async fn run_sink(
    addr: SocketAddr,
    status: u16,
    counter: Arc<AtomicU64>,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    crate::errln!("sink listening on {}", listener.local_addr()?);
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let counter = counter.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let counter = counter.clone();
                async move {
                    let body = req
                        .into_body()
                        .collect()
                        .await
                        .map(|b| b.to_bytes())
                        .unwrap_or_default();
                    let n = match serde_json::from_slice::<serde_json::Value>(&body) {
                        Ok(serde_json::Value::Array(a)) => a.len() as u64,
                        Ok(_) => 1,
                        Err(_) => 0,
                    };
                    counter.fetch_add(n, Ordering::Relaxed);
                    let code =
                        hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::ACCEPTED);
                    Response::builder()
                        .status(code)
                        .body(Full::new(Bytes::from_static(b"{}")))
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory holding a store (a router's data directory) is refused unless the flag
    /// says otherwise; a new or empty one is used. The bench wrote into a production store:
    /// 400 fake dead letters on its next start.
    #[tokio::test]
    async fn the_store_bench_refuses_a_directory_that_holds_a_store() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dir.path().join("data");
        let bench = |allow_existing| StoreBench {
            dir: data.clone(),
            allow_existing,
            events: 10,
            concurrency: 2,
            batch: 1,
            size: 64,
            targets: 1,
            group_log: false,
            random_ids: false,
            report_every: None,
        };
        run_store(bench(false)).await.expect("a new directory");
        let e = run_store(bench(false)).await.expect_err("refused");
        assert!(e.contains("is not empty (it holds router.redb)"), "{e}");
        assert!(e.contains("--allow-existing"), "{e}");
        // Once the first run's committer has let go of the file.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match run_store(bench(true)).await {
                Ok(_) => break,
                Err(e) if e.contains("already open") && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("allowed: {e}"),
            }
        }
    }

    #[test]
    fn sequential_ids_name_the_run_and_the_number() {
        assert_eq!(event_id("ab12", 7, false), "ab12-7");
    }

    #[test]
    fn random_ids_are_unique_uuid_like_and_scattered() {
        let ids: Vec<String> = (0..10_000).map(|n| event_id("ab12", n, true)).collect();
        for (n, id) in ids.iter().enumerate() {
            let (hex, rest) = id.split_at(32);
            assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
            assert_eq!(rest, format!("-ab12-{n}"), "{id}");
        }
        let unique: std::collections::HashSet<&String> = ids.iter().collect();
        assert_eq!(unique.len(), ids.len());
        // What the option is for: consecutive events are not neighbours in key order. Sorted,
        // sequential numbers would be in order; random ones keep about half their successors
        // in order.
        let mut sorted = ids.clone();
        sorted.sort();
        let in_order = sorted
            .windows(2)
            .filter(|w| {
                let num = |s: &str| s.rsplit('-').next().and_then(|n| n.parse::<u64>().ok());
                num(&w[0]) < num(&w[1])
            })
            .count();
        assert!((4_000..6_000).contains(&in_order), "{in_order}");
    }

    #[test]
    fn bench_events_carry_the_id_kind_asked_for() {
        let seq = make_event("r", 3, 512, "bench.event", false);
        assert_eq!(seq["id"], "r-3");
        let random = make_event("r", 3, 512, "bench.event", true);
        assert_eq!(random["id"], event_id("r", 3, true));
        assert!(random.to_string().len() >= 512);
    }
}
