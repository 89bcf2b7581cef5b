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

/// Parameters of `router bench ingest`.
#[derive(Debug, Clone)]
pub struct IngestBench {
    /// Full URL of the ingest endpoint.
    pub url: String,
    /// Events to send in total.
    pub events: u64,
    /// Concurrent connections.
    pub concurrency: usize,
    /// Events per request (1 = structured mode, more = batch mode).
    pub batch: usize,
    /// Approximate size of each event in bytes.
    pub size: usize,
    /// Target rate in events/s (open loop); `None` = as fast as possible.
    pub rate: Option<f64>,
    /// Event type to send.
    pub event_type: String,
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
        )
    }
}

fn make_event(run: &str, n: u64, size: usize, ty: &str) -> serde_json::Value {
    let base = json!({
        "specversion": "1.0",
        "id": format!("{run}-{n}"),
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

/// Runs the ingest load and returns the report.
pub async fn run_ingest(b: IngestBench) -> Result<BenchReport, String> {
    let uri: hyper::Uri = b.url.parse().map_err(|e| format!("bad url: {e}"))?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(b.concurrency)
        .build(connector);
    let run = format!("{:x}", rand::random::<u64>());
    let next = Arc::new(AtomicU64::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let hist = Arc::new(std::sync::Mutex::new(
        hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)
            .map_err(|e| e.to_string())?,
    ));
    let started = Instant::now();
    let mut tasks = Vec::new();
    let batch = b.batch.max(1) as u64;
    // Open loop: each connection sends at its share of the rate.
    let per_conn_interval = b
        .rate
        .map(|r| Duration::from_secs_f64(batch as f64 * b.concurrency as f64 / r));
    for _ in 0..b.concurrency {
        let (client, uri, run, next, ok, failed, hist, ty) = (
            client.clone(),
            uri.clone(),
            run.clone(),
            next.clone(),
            ok.clone(),
            failed.clone(),
            hist.clone(),
            b.event_type.clone(),
        );
        let (total, size) = (b.events, b.size);
        tasks.push(tokio::spawn(async move {
            let mut local = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).ok();
            let mut tick = per_conn_interval.map(|i| {
                let mut t = tokio::time::interval(i);
                t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                t
            });
            loop {
                let start = next.fetch_add(batch, Ordering::Relaxed);
                if start >= total {
                    break;
                }
                let end = (start + batch).min(total);
                if let Some(t) = tick.as_mut() {
                    t.tick().await;
                }
                let (body, ct) = if batch == 1 {
                    (
                        make_event(&run, start, size, &ty).to_string(),
                        "application/cloudevents+json",
                    )
                } else {
                    let evs: Vec<_> = (start..end)
                        .map(|n| make_event(&run, n, size, &ty))
                        .collect();
                    (
                        serde_json::Value::from(evs).to_string(),
                        "application/cloudevents-batch+json",
                    )
                };
                let req = match Request::post(uri.clone())
                    .header("content-type", ct)
                    .body(Full::new(Bytes::from(body)))
                {
                    Ok(r) => r,
                    Err(_) => break,
                };
                let t0 = Instant::now();
                let res = client.request(req).await;
                let good = match res {
                    Ok(resp) => {
                        let s = resp.status();
                        let _ = resp.into_body().collect().await;
                        s.is_success()
                    }
                    Err(_) => false,
                };
                let us = u64::try_from(t0.elapsed().as_micros())
                    .unwrap_or(u64::MAX)
                    .max(1);
                if let Some(h) = local.as_mut() {
                    let _ = h.record(us);
                }
                if good {
                    ok.fetch_add(end - start, Ordering::Relaxed);
                } else {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
            if let (Some(l), Ok(mut h)) = (local, hist.lock()) {
                let _ = h.add(l);
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let elapsed = started.elapsed();
    let h = hist.lock().map_err(|_| "histogram poisoned".to_string())?;
    Ok(BenchReport {
        ok_events: ok.load(Ordering::Relaxed),
        failed_requests: failed.load(Ordering::Relaxed),
        elapsed,
        latency_us: [
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.99),
            h.value_at_quantile(0.999),
            h.max(),
        ],
    })
}

/// Parameters of `router bench store`.
#[derive(Debug, Clone)]
pub struct StoreBench {
    /// Data directory of the store (created; should be empty).
    pub dir: std::path::PathBuf,
    /// Events to accept in total.
    pub events: u64,
    /// Concurrent writers.
    pub concurrency: usize,
    /// Events per accept call.
    pub batch: usize,
    /// Approximate size of each event in bytes.
    pub size: usize,
    /// Targets each event fans out to (a queue entry each).
    pub targets: usize,
    /// Durable groups through the group log (`store.group_log`), or a synced commit each.
    pub group_log: bool,
}

/// The store alone, without HTTP: `concurrency` writers accept events (each with `targets`
/// queue entries) as fast as the committer makes them durable, which is what an ingest
/// request waits for. Isolates the store's group commit from the HTTP and delivery work.
pub async fn run_store(b: StoreBench) -> Result<BenchReport, String> {
    use crate::store::{NewEntry, NewEvent, RedbStore, Store, StoreOptions};
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
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let hist = Arc::new(std::sync::Mutex::new(
        hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)
            .map_err(|e| e.to_string())?,
    ));
    let batch = b.batch.max(1) as u64;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..b.concurrency {
        let (store, run, next, ok, failed, hist) = (
            store.clone(),
            run.clone(),
            next.clone(),
            ok.clone(),
            failed.clone(),
            hist.clone(),
        );
        let (total, size, targets) = (b.events, b.size, b.targets);
        tasks.push(tokio::spawn(async move {
            let mut local = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).ok();
            loop {
                let start = next.fetch_add(batch, Ordering::Relaxed);
                if start >= total {
                    break;
                }
                let end = (start + batch).min(total);
                let now = chrono::Utc::now().timestamp_millis();
                let events = (start..end)
                    .filter_map(|n| {
                        let event =
                            serde_json::from_value(make_event(&run, n, size, "bench.event"))
                                .ok()?;
                        Some(NewEvent {
                            event,
                            accepted_at: now,
                            ruleset_version: "bench".into(),
                            matched_rules: vec!["bench".into()],
                            targets: (0..targets)
                                .map(|t| NewEntry {
                                    target_id: format!("bench-{t}"),
                                    rule: "bench".into(),
                                    ordering_key: None,
                                    max_depth: None,
                                })
                                .collect(),
                            quarantine: None,
                            dedup_window_ms: 86_400_000,
                        })
                    })
                    .collect::<Vec<_>>();
                let n = events.len() as u64;
                let t0 = Instant::now();
                let res = store.accept(events).await;
                let us = u64::try_from(t0.elapsed().as_micros())
                    .unwrap_or(u64::MAX)
                    .max(1);
                if let Some(h) = local.as_mut() {
                    let _ = h.record(us);
                }
                match res {
                    Ok(_) => ok.fetch_add(n, Ordering::Relaxed),
                    Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
            if let (Some(l), Ok(mut h)) = (local, hist.lock()) {
                let _ = h.add(l);
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let elapsed = started.elapsed();
    let h = hist.lock().map_err(|_| "histogram poisoned".to_string())?;
    Ok(BenchReport {
        ok_events: ok.load(Ordering::Relaxed),
        failed_requests: failed.load(Ordering::Relaxed),
        elapsed,
        latency_us: [
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.99),
            h.value_at_quantile(0.999),
            h.max(),
        ],
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
    eprintln!("sink listening on {}", listener.local_addr()?);
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
