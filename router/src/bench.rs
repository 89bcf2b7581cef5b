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
    /// Events to send in total (at least 1).
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub events: u64,
    /// Concurrent connections (1 to 10000).
    #[arg(long, default_value_t = 64, value_parser = concurrency_parser())]
    pub concurrency: usize,
    /// Events per request (1 = structured mode, more = batch mode; at most 1000000).
    #[arg(long, default_value_t = 1, value_parser = batch_parser())]
    pub batch: usize,
    /// Approximate bytes per event: the data is padded up to it. Below the smallest envelope
    /// (about 200 bytes) events are sent unpadded, and a note says so.
    #[arg(long, default_value_t = 1024)]
    pub size: usize,
    /// Fixed rate in events/s (open loop: requests go out on schedule, and latency counts from
    /// when each was due, so a stall is not hidden); default: as fast as possible. A finite
    /// number from 0.001 to 1000000000 (fractions allowed: 0.5 is one event every 2 s).
    #[arg(long, value_parser = parse_rate, allow_negative_numbers = true)]
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
    /// Exit 0 even when requests failed (a run that measures how a saturated router refuses
    /// with 429/503, say), as long as one succeeded. Without it any failed request makes the
    /// exit status 1.
    #[arg(long)]
    pub allow_failures: bool,
    /// How long a request may take, from sending it to the end of its answer (e.g. `500ms`,
    /// `60s`, `2m`); one that takes longer is abandoned and counted as a failed request
    /// (`timed out`).
    #[arg(long, default_value = "60s", value_parser = parse_timeout)]
    pub timeout: Duration,
}

/// Parses `--timeout`: a duration such as `500ms` or `2m`, more than zero.
fn parse_timeout(s: &str) -> Result<Duration, String> {
    match humantime::parse_duration(s) {
        Ok(d) if !d.is_zero() => Ok(d),
        Ok(_) => Err("the timeout must be more than zero".to_string()),
        Err(e) => Err(format!(
            "`{s}` is not a duration (e.g. 500ms, 60s, 2m): {e}"
        )),
    }
}

/// What the 2xx answers said about their events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EventCounts {
    /// Answered `accepted`: stored and routed.
    pub accepted: u64,
    /// Answered `duplicate`: accepted before inside the dedup window, not routed again.
    pub duplicate: u64,
    /// Answered `quarantined`: put in the DLQ by their contract, never routed.
    pub quarantined: u64,
    /// Acknowledged by an answer without per-event results (an endpoint other than the
    /// router's, such as `bench sink`), or with a status this tool does not know: counted as
    /// accepted, since the endpoint took them and said nothing more.
    pub unreported: u64,
}

impl EventCounts {
    /// Events the endpoint took: accepted, or acknowledged without a per-event result. What
    /// the throughput counts: a duplicate or a quarantined event costs the router less than
    /// an accepted one (no routing, no queue entries), so counting them would flatter it.
    pub fn taken(&self) -> u64 {
        self.accepted + self.unreported
    }

    /// Reads the router's 202 (`{"results": [{"status": "accepted" | "duplicate" |
    /// "quarantined", …}, …]}`) to a request of `events` events. Events the body gives no
    /// known result for are `unreported`.
    fn from_answer(body: &[u8], events: u64) -> Self {
        /// The part of the router's 202 this reads.
        #[derive(serde::Deserialize)]
        struct Answer<'a> {
            #[serde(borrow)]
            results: Vec<EventResult<'a>>,
        }
        #[derive(serde::Deserialize)]
        struct EventResult<'a> {
            #[serde(borrow)]
            status: std::borrow::Cow<'a, str>,
        }
        let mut c = Self::default();
        if let Ok(a) = serde_json::from_slice::<Answer<'_>>(body) {
            for r in a
                .results
                .iter()
                .take(usize::try_from(events).unwrap_or(usize::MAX))
            {
                match r.status.as_ref() {
                    "accepted" => c.accepted += 1,
                    "duplicate" => c.duplicate += 1,
                    "quarantined" => c.quarantined += 1,
                    _ => c.unreported += 1,
                }
            }
        }
        c.unreported +=
            events.saturating_sub(c.accepted + c.duplicate + c.quarantined + c.unreported);
        c
    }
}

impl std::fmt::Display for EventCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.accepted + self.duplicate + self.quarantined == 0 && self.unreported > 0 {
            return write!(
                f,
                "{} acknowledged (the answers had no per-event results)",
                self.unreported
            );
        }
        write!(
            f,
            "{} accepted, {} duplicate, {} quarantined",
            self.accepted, self.duplicate, self.quarantined
        )?;
        if self.unreported > 0 {
            write!(
                f,
                ", {} acknowledged without a result (counted as accepted)",
                self.unreported
            )?;
        }
        Ok(())
    }
}

/// Why a request failed: what the report groups failures by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FailureKind {
    /// Answered with this status, not 2xx.
    Status(u16),
    /// No connection could be made (refused, unreachable, …), with the system's reason when
    /// it gave one.
    Connect(Option<std::io::ErrorKind>),
    /// The connection broke, or the answer was not HTTP or was cut off, with the system's
    /// reason when it gave one.
    Transport(Option<std::io::ErrorKind>),
    /// No complete answer within `--timeout`.
    Timeout,
    /// (`bench store`) The store failed the accept.
    Store,
}

impl std::fmt::Display for FailureKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Status(code) => {
                match hyper::StatusCode::from_u16(*code)
                    .ok()
                    .and_then(|s| s.canonical_reason())
                {
                    Some(reason) => write!(f, "{code} {reason}"),
                    None => write!(f, "{code}"),
                }
            }
            Self::Connect(Some(k)) => write!(f, "connect: {k}"),
            Self::Connect(None) => f.write_str("connect failed"),
            Self::Transport(Some(k)) => write!(f, "{k}"),
            Self::Transport(None) => f.write_str("connection failed"),
            Self::Timeout => f.write_str("timed out"),
            Self::Store => f.write_str("store error"),
        }
    }
}

/// One failed request, as its task saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Failure {
    kind: FailureKind,
    /// The answer's `Retry-After`, when it had one.
    retry_after: Option<String>,
    /// What went wrong, in the endpoint's or the system's words.
    message: String,
}

/// The longest sample message a report prints: enough for the router's `error` or a system
/// error's chain, short enough for one line.
const SAMPLE_CHARS: usize = 200;

impl Failure {
    /// A request that got no answer: the client's error, its causes joined.
    fn transport(e: &hyper_util::client::legacy::Error) -> Self {
        let io = io_error_kind(e);
        Self {
            kind: if e.is_connect() {
                FailureKind::Connect(io)
            } else {
                FailureKind::Transport(io)
            },
            retry_after: None,
            message: error_chain(e),
        }
    }

    /// A request answered `status` (not 2xx) with `body`: the router's `error`, or the body's
    /// first characters.
    fn answered(status: hyper::StatusCode, retry_after: Option<String>, body: &[u8]) -> Self {
        let message = serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_string());
        Self {
            kind: FailureKind::Status(status.as_u16()),
            retry_after,
            message: if message.is_empty() {
                "(empty body)".to_string()
            } else {
                message
            },
        }
    }
}

/// The first [`std::io::ErrorKind`] among `e` and its causes: why a connection failed, in
/// the system's words ("connection refused"), when it was the system that said so.
fn io_error_kind(e: &(dyn std::error::Error + 'static)) -> Option<std::io::ErrorKind> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return Some(io.kind());
        }
        cur = err.source();
    }
    None
}

/// `e` and its causes, joined by ": " (hyper's own message is only "client error (Connect)").
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = Vec::new();
    let mut cur = Some(e);
    while let Some(err) = cur {
        parts.push(err.to_string());
        cur = err.source();
    }
    parts.join(": ")
}

/// The failed requests of one kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failures {
    /// Why they failed.
    pub kind: FailureKind,
    /// How many requests.
    pub requests: u64,
    /// How many events those requests carried.
    pub events: u64,
    /// How many of them were answered with `Retry-After` (the load is open or closed loop
    /// regardless: the tool measures, it does not back off).
    pub with_retry_after: u64,
    /// The first `Retry-After` value seen.
    pub retry_after: Option<String>,
    /// The first one's message.
    pub sample: String,
}

impl Failures {
    fn new(f: Failure, events: u64) -> Self {
        Self {
            kind: f.kind,
            requests: 1,
            events,
            with_retry_after: u64::from(f.retry_after.is_some()),
            retry_after: f.retry_after,
            sample: f.message,
        }
    }

    fn add(&mut self, other: Self) {
        self.requests += other.requests;
        self.events += other.events;
        self.with_retry_after += other.with_retry_after;
        if self.retry_after.is_none() {
            self.retry_after = other.retry_after;
        }
    }
}

impl std::fmt::Display for Failures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} × {} ({} events)",
            self.requests, self.kind, self.events
        )?;
        if let Some(ra) = &self.retry_after {
            write!(
                f,
                ", {} with Retry-After (first: {ra:?})",
                self.with_retry_after
            )?;
        }
        let mut sample: String = self.sample.chars().take(SAMPLE_CHARS).collect();
        if sample.len() < self.sample.len() {
            sample.push('…');
        }
        // Debug-quoted: a body's newlines and quotes stay on the line.
        write!(f, ": {sample:?}")
    }
}

/// Latency percentiles in microseconds: p50, p99, p99.9 and the exact maximum.
pub type Percentiles = [u64; 4];

/// Result of a run.
#[derive(Debug, Clone)]
pub struct BenchReport {
    /// The run's id: every event id is `<run>-<number>`, or with `random_ids`
    /// `<32 hex digits>-<run>-<number>`, so the run's events can be found in the router's log.
    pub run: String,
    /// Whether the event ids had a random prefix (`--random-ids`).
    pub random_ids: bool,
    /// Whether the run was stopped (Ctrl-C) before it sent every event: the report covers the
    /// requests finished until then.
    pub interrupted: bool,
    /// Requests in flight when the run was stopped, abandoned unanswered, and their events.
    pub abandoned: (u64, u64),
    /// Events of the requests answered 2xx, by what the answer said of each.
    pub events: EventCounts,
    /// Requests finished (answered, or failed without an answer).
    pub requests: u64,
    /// Requests that failed (not 2xx, or no answer).
    pub failed_requests: u64,
    /// Events those requests carried.
    pub failed_events: u64,
    /// The failed requests by kind, the most frequent first.
    pub failures: Vec<Failures>,
    /// Wall time.
    pub elapsed: Duration,
    /// Latency of the requests that succeeded (2xx); `None` when none did. A failure's
    /// latency says little about the endpoint (a refused connection takes microseconds), so
    /// it is kept apart.
    pub latency_us: Option<Percentiles>,
    /// Latency of the failed requests; `None` when none failed.
    pub failed_latency_us: Option<Percentiles>,
    /// The slowest request, failed or not: when it was sent and what it carried, so an
    /// outlier can be found in the router's log and metrics.
    pub slowest: Option<Slowest>,
}

impl BenchReport {
    /// Why the run should end with a non-zero exit status, if it should: any failed request,
    /// or with `allow_failures` only a run where none succeeded (it measured nothing: a
    /// wrong URL or token).
    pub fn problem(&self, allow_failures: bool) -> Option<String> {
        if self.failed_requests == 0 {
            None
        } else if self.failed_requests == self.requests {
            Some("every request failed: nothing was measured".to_string())
        } else if allow_failures {
            None
        } else {
            Some(format!(
                "{} of {} requests failed (--allow-failures to exit 0 all the same)",
                self.failed_requests, self.requests
            ))
        }
    }
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

/// Events per second as a report prints it: whole numbers from 100 on, one decimal below,
/// three below 1/s (a slow fixed-rate run is not "0 events/s").
fn events_per_sec(n: u64, secs: f64) -> String {
    let r = if secs > 0.0 { n as f64 / secs } else { 0.0 };
    if r == 0.0 || r >= 100.0 {
        format!("{r:.0}")
    } else if r >= 1.0 {
        format!("{r:.1}")
    } else {
        format!("{r:.3}")
    }
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secs = self.elapsed.as_secs_f64();
        let ids = if self.random_ids {
            format!("<hex>-{}-<n>", self.run)
        } else {
            format!("{}-<n>", self.run)
        };
        writeln!(f, "run id:         {} (event ids {ids})", self.run)?;
        if self.interrupted {
            writeln!(
                f,
                "interrupted:    stopped before the end; {} requests in flight abandoned ({} events)",
                self.abandoned.0, self.abandoned.1
            )?;
        }
        writeln!(f, "events ok:      {}", self.events)?;
        if self.failed_requests == 0 {
            writeln!(f, "failed reqs:    0")?;
        } else {
            writeln!(
                f,
                "failed reqs:    {} of {} requests, {} events",
                self.failed_requests, self.requests, self.failed_events
            )?;
            for kind in &self.failures {
                writeln!(f, "  {kind}")?;
            }
        }
        writeln!(f, "elapsed:        {secs:.2} s")?;
        writeln!(
            f,
            "throughput:     {} events/s",
            events_per_sec(self.events.taken(), secs)
        )?;
        let ms = |us: u64| us as f64 / 1000.0;
        let line = |p: &Percentiles| {
            format!(
                "p50 {:.2} ms  p99 {:.2} ms  p99.9 {:.2} ms  max {:.2} ms",
                ms(p[0]),
                ms(p[1]),
                ms(p[2]),
                ms(p[3])
            )
        };
        match &self.latency_us {
            Some(p) => write!(f, "latency (req):  {}", line(p))?,
            None => write!(f, "latency (req):  no request succeeded")?,
        }
        if let Some(p) = &self.failed_latency_us {
            write!(f, "\nlatency (fail): {}", line(p))?;
        }
        if let Some(w) = &self.slowest {
            write!(
                f,
                "\nslowest req:    {:.2} ms, sent at +{:.3} s, first event #{} (id {}){}",
                ms(w.latency_us),
                w.sent_at.as_secs_f64(),
                w.first_event,
                event_id(&self.run, w.first_event, self.random_ids),
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

/// The most concurrent connections or writers: past this one machine runs out of ephemeral
/// ports or file descriptors, and each connection keeps a latency histogram.
pub const MAX_CONCURRENCY: u64 = 10_000;
/// The most events per request or accept call: far past any router's `ingest.max_batch`
/// (1000 by default), and small enough that event numbers cannot overflow.
pub const MAX_BATCH: u64 = 1_000_000;

/// `--concurrency`: 1 to [`MAX_CONCURRENCY`]. Zero sent nothing and printed a report of
/// zeros that exited 0.
fn concurrency_parser() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_CONCURRENCY)
}

/// `--batch`: 1 to [`MAX_BATCH`]. Zero was sent as 1 without a word.
fn batch_parser() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_BATCH)
}

/// A note when `size` is below the smallest event this run sends (event 0 of `run`, unpadded):
/// the events go out bigger than asked, which a reader of the throughput should know.
fn size_note(size: usize, run: &str, ty: &str, random_ids: bool) -> Option<String> {
    let smallest = make_event(run, 0, 0, ty, random_ids).to_string().len();
    (size < smallest).then(|| {
        format!(
            "note: --size {size} is below the smallest event this run sends ({smallest} bytes \
             unpadded): events are sent unpadded, at least {smallest} bytes each"
        )
    })
}

/// The slowest `--rate` accepted, in events/s: one event every 1,000 s. Slower would make a
/// connection's period (`batch × concurrency / rate`) too long to schedule sensibly.
pub const MIN_RATE: f64 = 0.001;
/// The fastest `--rate` accepted, in events/s: far above what one machine sends, so a bound
/// that only keeps the arithmetic finite.
pub const MAX_RATE: f64 = 1e9;
/// The shortest period between a connection's requests: a faster rate would round it to
/// zero, which a timer cannot tick at (and no connection sends a request per microsecond).
const MIN_PERIOD: Duration = Duration::from_micros(1);
/// The longest period between a connection's requests (only reached with `--rate` near
/// [`MIN_RATE`] and a huge batch × concurrency); keeps the timer's deadline representable.
const MAX_PERIOD: Duration = Duration::from_secs(365 * 86_400);

/// Parses `--rate`: a finite number of events/s from [`MIN_RATE`] to [`MAX_RATE`]. Zero,
/// negative, NaN and infinite rates have no schedule to send at.
fn parse_rate(s: &str) -> Result<f64, String> {
    let r: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number of events/s"))?;
    if r.is_finite() && (MIN_RATE..=MAX_RATE).contains(&r) {
        Ok(r)
    } else {
        Err(format!(
            "the rate must be a finite number of events/s from {MIN_RATE} to {MAX_RATE:e}, not {s}"
        ))
    }
}

/// How often one connection sends, for `rate` events/s shared by `concurrency` connections
/// sending `batch` events a request; clamped to [`MIN_PERIOD`]..=[`MAX_PERIOD`] so any
/// rate, even one `parse_rate` would refuse, gives a period a timer can tick at.
fn per_connection_period(rate: f64, batch: u64, concurrency: usize) -> Duration {
    let secs = batch as f64 * concurrency as f64 / rate;
    Duration::try_from_secs_f64(secs)
        .unwrap_or(MAX_PERIOD)
        .clamp(MIN_PERIOD, MAX_PERIOD)
}

/// Waits for every load task. One that panicked fails the run: its requests and latencies
/// are missing from the tally, so a report would be wrong (and with all of them panicking,
/// a run that sent nothing would look like one that measured something).
async fn join_tasks(tasks: Vec<tokio::task::JoinHandle<()>>) -> Result<(), String> {
    let total = tasks.len();
    let mut failed = Vec::new();
    for t in tasks {
        if let Err(e) = t.await {
            failed.push(match e.try_into_panic() {
                Ok(p) => p
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(no message)".to_string()),
                Err(e) => e.to_string(),
            });
        }
    }
    match failed.first() {
        None => Ok(()),
        Some(first) => Err(format!(
            "{} of {total} load tasks failed, so the report would be wrong; the first: {first}",
            failed.len()
        )),
    }
}

/// A histogram of latencies in microseconds (3 significant digits) that grows to hold any
/// value. It was bounded at a minute with the record's error ignored, so a slower request was
/// missing from every percentile and the maximum, and a run against a stalled router is the
/// one whose slow requests matter. Starting small, it costs only what its values need: each
/// load task keeps two (successful and failed requests), the second mostly empty.
fn latency_histogram() -> Result<hdrhistogram::Histogram<u64>, String> {
    hdrhistogram::Histogram::<u64>::new(3).map_err(|e| e.to_string())
}

/// Records `us` in `h`: it grows to hold any value, and should growing fail (only when its
/// counts no longer fit in memory's address space) the value is counted at the highest one it
/// holds rather than not at all.
fn record_latency(h: &mut hdrhistogram::Histogram<u64>, us: u64) {
    if h.record(us).is_err() {
        h.saturating_record(us);
    }
}

/// How one request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// Answered 2xx, with what the answer said of its events.
    Acked(EventCounts),
    /// Not answered 2xx.
    Failed(Failure),
}

/// The latencies of one class of requests: a histogram for the percentiles, and the exact
/// maximum.
struct Latencies {
    hist: hdrhistogram::Histogram<u64>,
    max_us: u64,
}

impl Latencies {
    fn new() -> Result<Self, String> {
        Ok(Self {
            hist: latency_histogram()?,
            max_us: 0,
        })
    }

    fn record(&mut self, us: u64) {
        record_latency(&mut self.hist, us);
        self.max_us = self.max_us.max(us);
    }

    fn add(&mut self, other: &Self) {
        // Both grow to any value recorded, so adding cannot fail for want of range.
        if self.hist.add(&other.hist).is_err() {
            for v in other.hist.iter_recorded() {
                self.hist
                    .saturating_record_n(v.value_iterated_to(), v.count_at_value());
            }
        }
        self.max_us = self.max_us.max(other.max_us);
    }

    fn percentiles(&self) -> Option<Percentiles> {
        // A percentile is the top of its bucket (3 significant digits), which can lie past
        // the exact maximum: capped there, p99 never reads above max.
        let at = |q| self.hist.value_at_quantile(q).min(self.max_us);
        (!self.hist.is_empty()).then(|| [at(0.5), at(0.99), at(0.999), self.max_us])
    }
}

/// One load task's share of the tally, kept without locks while it runs and merged into the
/// run's when it ends.
struct Local {
    ok: Latencies,
    failed: Latencies,
    failures: std::collections::HashMap<FailureKind, Failures>,
}

impl Local {
    fn new() -> Result<Self, String> {
        Ok(Self {
            ok: Latencies::new()?,
            failed: Latencies::new()?,
            failures: std::collections::HashMap::new(),
        })
    }

    fn add(&mut self, other: Self) {
        self.ok.add(&other.ok);
        self.failed.add(&other.failed);
        for (kind, f) in other.failures {
            match self.failures.entry(kind) {
                std::collections::hash_map::Entry::Occupied(mut e) => e.get_mut().add(f),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(f);
                }
            }
        }
    }
}

/// A request as it was sent: when (from the start of the run), its first event's number and
/// how many events it carried.
#[derive(Debug, Clone, Copy)]
struct Sent {
    at: Duration,
    first_event: u64,
    events: u64,
}

/// What a run's tasks count: events by what their answers said, failures by kind, and the
/// latencies of successful and failed requests (per task, merged into this when it ends).
struct Tally {
    accepted: AtomicU64,
    duplicate: AtomicU64,
    quarantined: AtomicU64,
    unreported: AtomicU64,
    merged: std::sync::Mutex<Local>,
    started: Instant,
    max_us: AtomicU64,
    slowest: std::sync::Mutex<Option<Slowest>>,
    /// Latencies of the current reporting interval's successful requests (`--report-every`).
    window: Option<std::sync::Mutex<hdrhistogram::Histogram<u64>>>,
    /// Failed requests of the current reporting interval.
    window_failed: AtomicU64,
    /// Requests abandoned in flight when the run was stopped, and their events.
    abandoned: (AtomicU64, AtomicU64),
    /// Whether a task stopped before the run's events ran out.
    cut_short: std::sync::atomic::AtomicBool,
}

impl Tally {
    fn new() -> Result<Arc<Self>, String> {
        Ok(Arc::new(Self::build()?))
    }

    fn build() -> Result<Self, String> {
        Ok(Self {
            accepted: AtomicU64::new(0),
            duplicate: AtomicU64::new(0),
            quarantined: AtomicU64::new(0),
            unreported: AtomicU64::new(0),
            merged: std::sync::Mutex::new(Local::new()?),
            started: Instant::now(),
            max_us: AtomicU64::new(0),
            slowest: std::sync::Mutex::new(None),
            window: None,
            window_failed: AtomicU64::new(0),
            abandoned: (AtomicU64::new(0), AtomicU64::new(0)),
            cut_short: std::sync::atomic::AtomicBool::new(false),
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
                let failed = match t.window_failed.swap(0, Ordering::Relaxed) {
                    0 => String::new(),
                    n => format!("  {n} failed"),
                };
                crate::errln!(
                    "+{:>5.0}s  {:>7} req  p50 {:>8.2} ms  p99 {:>8.2} ms  max {:>8.2} ms{failed}",
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

    /// One request sent at `t0` carrying `events` events from `first_event` on, and how it
    /// ended.
    fn record(
        &self,
        local: &mut Local,
        t0: Instant,
        first_event: u64,
        events: u64,
        outcome: Outcome,
    ) {
        let us = u64::try_from(t0.elapsed().as_micros())
            .unwrap_or(u64::MAX)
            .max(1);
        let sent = Sent {
            at: t0.saturating_duration_since(self.started),
            first_event,
            events,
        };
        self.record_us(local, us, sent, outcome);
    }

    /// [`Tally::record`] of a request that took `us` microseconds.
    fn record_us(&self, local: &mut Local, us: u64, sent: Sent, outcome: Outcome) {
        // The lock is taken only by a new maximum: rare after the first requests.
        if us > self.max_us.fetch_max(us, Ordering::Relaxed)
            && let Ok(mut w) = self.slowest.lock()
            && w.is_none_or(|w| us > w.latency_us)
        {
            *w = Some(Slowest {
                latency_us: us,
                sent_at: sent.at,
                first_event: sent.first_event,
                failed: matches!(outcome, Outcome::Failed(_)),
            });
        }
        match outcome {
            Outcome::Acked(c) => {
                local.ok.record(us);
                if let Some(Ok(mut w)) = self.window.as_ref().map(|w| w.lock()) {
                    record_latency(&mut w, us);
                }
                for (n, counter) in [
                    (c.accepted, &self.accepted),
                    (c.duplicate, &self.duplicate),
                    (c.quarantined, &self.quarantined),
                    (c.unreported, &self.unreported),
                ] {
                    if n > 0 {
                        counter.fetch_add(n, Ordering::Relaxed);
                    }
                }
            }
            Outcome::Failed(f) => {
                local.failed.record(us);
                if self.window.is_some() {
                    self.window_failed.fetch_add(1, Ordering::Relaxed);
                }
                match local.failures.get_mut(&f.kind) {
                    Some(k) => k.add(Failures::new(f, sent.events)),
                    None => {
                        local.failures.insert(f.kind, Failures::new(f, sent.events));
                    }
                }
            }
        }
    }

    /// A task stopped by Ctrl-C, abandoning a request of `events` events in flight (or none).
    fn stopped(&self, in_flight: Option<u64>) {
        self.cut_short.store(true, Ordering::Relaxed);
        if let Some(events) = in_flight {
            self.abandoned.0.fetch_add(1, Ordering::Relaxed);
            self.abandoned.1.fetch_add(events, Ordering::Relaxed);
        }
    }

    fn merge(&self, local: Local) {
        if let Ok(mut m) = self.merged.lock() {
            m.add(local);
        }
    }

    fn report(
        &self,
        elapsed: Duration,
        run: &str,
        random_ids: bool,
    ) -> Result<BenchReport, String> {
        let m = self
            .merged
            .lock()
            .map_err(|_| "tally poisoned".to_string())?;
        let mut failures: Vec<Failures> = m.failures.values().cloned().collect();
        failures.sort_by(|a, b| b.requests.cmp(&a.requests).then(a.kind.cmp(&b.kind)));
        let failed_requests = failures.iter().map(|f| f.requests).sum();
        Ok(BenchReport {
            run: run.to_string(),
            random_ids,
            interrupted: self.cut_short.load(Ordering::Relaxed),
            abandoned: (
                self.abandoned.0.load(Ordering::Relaxed),
                self.abandoned.1.load(Ordering::Relaxed),
            ),
            events: EventCounts {
                accepted: self.accepted.load(Ordering::Relaxed),
                duplicate: self.duplicate.load(Ordering::Relaxed),
                quarantined: self.quarantined.load(Ordering::Relaxed),
                unreported: self.unreported.load(Ordering::Relaxed),
            },
            requests: m.ok.hist.len() + m.failed.hist.len(),
            failed_requests,
            failed_events: failures.iter().map(|f| f.events).sum(),
            failures,
            elapsed,
            latency_us: m.ok.percentiles(),
            failed_latency_us: m.failed.percentiles(),
            slowest: self.slowest.lock().ok().and_then(|w| *w),
        })
    }
}

/// How a request answered with `resp` ended: the answer read whole, and for a 2xx its
/// `events` events counted by what it said of each.
async fn answer_outcome(resp: Response<Incoming>, events: u64) -> Outcome {
    let status = resp.status();
    let retry_after = resp
        .headers()
        .get(hyper::header::RETRY_AFTER)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    match (status.is_success(), resp.into_body().collect().await) {
        (true, Ok(b)) => Outcome::Acked(EventCounts::from_answer(&b.to_bytes(), events)),
        (false, Ok(b)) => Outcome::Failed(Failure::answered(status, retry_after, &b.to_bytes())),
        (true, Err(e)) => Outcome::Failed(Failure {
            kind: FailureKind::Transport(io_error_kind(&e)),
            retry_after: None,
            message: format!("the {status} answer was cut off: {}", error_chain(&e)),
        }),
        (false, Err(e)) => Outcome::Failed(Failure {
            kind: FailureKind::Status(status.as_u16()),
            retry_after,
            message: format!("(its body was cut off: {})", error_chain(&e)),
        }),
    }
}

/// Runs the ingest load and returns the report. Cancelling `stop` (Ctrl-C) ends the run
/// early: no new request goes out, those in flight are abandoned, and the report covers the
/// requests finished until then.
pub async fn run_ingest(
    b: IngestBench,
    stop: tokio_util::sync::CancellationToken,
) -> Result<BenchReport, String> {
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
    if let Some(note) = size_note(b.size, &run, &b.event_type, b.random_ids) {
        crate::errln!("{note}");
    }
    let next = Arc::new(AtomicU64::new(0));
    let tally = match b.report_every {
        Some(secs) => Tally::with_intervals(Duration::from_secs(secs.max(1)))?,
        None => Tally::new()?,
    };
    let started = Instant::now();
    let mut tasks = Vec::new();
    let batch = b.batch as u64;
    // Open loop: each connection sends at its share of the rate.
    let per_conn_interval = b
        .rate
        .map(|r| per_connection_period(r, batch, b.concurrency));
    for conn in 0..b.concurrency {
        let mut local = Local::new()?;
        let (client, uri, run, next, tally, ty, authorization) = (
            client.clone(),
            uri.clone(),
            run.clone(),
            next.clone(),
            tally.clone(),
            b.event_type.clone(),
            authorization.clone(),
        );
        let (total, size, concurrency, random_ids, timeout) =
            (b.events, b.size, b.concurrency, b.random_ids, b.timeout);
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
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
                let end = start.saturating_add(batch).min(total);
                let due = match tick.as_mut() {
                    Some(t) => tokio::select! {
                        () = stop.cancelled() => {
                            tally.stopped(None);
                            break;
                        }
                        due = t.tick() => Some(due.into_std()),
                    },
                    None if stop.is_cancelled() => {
                        tally.stopped(None);
                        break;
                    }
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
                let exchange = async {
                    match client.request(req).await {
                        Ok(resp) => answer_outcome(resp, end - start).await,
                        Err(e) => Outcome::Failed(Failure::transport(&e)),
                    }
                };
                let outcome = tokio::select! {
                    () = stop.cancelled() => {
                        tally.stopped(Some(end - start));
                        break;
                    }
                    o = tokio::time::timeout(timeout, exchange) => o.unwrap_or_else(|_| {
                        Outcome::Failed(Failure {
                            kind: FailureKind::Timeout,
                            retry_after: None,
                            message: format!(
                                "no complete answer within {}",
                                humantime::format_duration(timeout)
                            ),
                        })
                    }),
                };
                tally.record(&mut local, t0, start, end - start, outcome);
            }
            tally.merge(local);
        }));
    }
    join_tasks(tasks).await?;
    tally.report(started.elapsed(), &run, b.random_ids)
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
    /// Events to accept in total (at least 1).
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub events: u64,
    /// Concurrent writers (1 to 10000).
    #[arg(long, default_value_t = 64, value_parser = concurrency_parser())]
    pub concurrency: usize,
    /// Events per accept call (1 to 1000000).
    #[arg(long, default_value_t = 1, value_parser = batch_parser())]
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
                hold_key: false,
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
    let batch = b.batch as u64;
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
        let mut local = Local::new()?;
        tasks.push(tokio::spawn(async move {
            loop {
                let start = next.fetch_add(batch, Ordering::Relaxed);
                if start >= total {
                    break;
                }
                let end = start.saturating_add(batch).min(total);
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
                // The store's own accept: every event is taken, none reported apart.
                let outcome = match res {
                    Ok(_) => Outcome::Acked(EventCounts {
                        accepted: n,
                        ..EventCounts::default()
                    }),
                    Err(e) => Outcome::Failed(Failure {
                        kind: FailureKind::Store,
                        retry_after: None,
                        message: e.to_string(),
                    }),
                };
                tally.record(&mut local, t0, start, n, outcome);
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
    join_tasks(tasks).await?;
    tally.report(started.elapsed(), &run, b.random_ids)
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
        record_latency(&mut hist, t0.elapsed().as_micros().max(1) as u64);
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

/// Parameters of `router bench sink` (its command-line arguments).
#[derive(Debug, Clone, clap::Args)]
pub struct SinkBench {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:9999")]
    pub listen: SocketAddr,
    /// Status to answer every request with: 200 to 599, a final answer (a 1xx is an interim
    /// one a client keeps waiting past, and hyper would send 600 to 999, which no HTTP class
    /// defines).
    #[arg(long, default_value_t = 202, value_parser = clap::value_parser!(u16).range(200..=599))]
    pub status: u16,
}

/// Runs a sink on `addr`: every request's body is read and parsed as JSON, then answered
/// with `status` (checked by [`SinkBench`]; anything outside 200..=599 is refused here too).
/// Counts events received (array elements count one each) in `counter`.
pub async fn run_sink(
    addr: SocketAddr,
    status: u16,
    counter: Arc<AtomicU64>,
) -> std::io::Result<()> {
    let code = sink_status(status)?;
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

/// The sink's answer for `status`: a final status, 200 to 599. It was answered 202 without a
/// word for anything `hyper` refused (42, 1000), and an interim 1xx for 100 to 199.
fn sink_status(status: u16) -> std::io::Result<hyper::StatusCode> {
    hyper::StatusCode::from_u16(status)
        .ok()
        .filter(|_| (200..=599).contains(&status))
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("the sink's status must be 200 to 599, not {status}"),
            )
        })
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

    /// `router bench ingest`'s arguments as the command line gives them.
    #[derive(Debug, clap::Parser)]
    struct IngestCli {
        #[command(flatten)]
        b: IngestBench,
    }

    fn ingest_args(args: &[&str]) -> Result<IngestBench, clap::Error> {
        use clap::Parser;
        IngestCli::try_parse_from(std::iter::once("ingest").chain(args.iter().copied()))
            .map(|c| c.b)
    }

    #[test]
    fn events_concurrency_and_batch_must_be_at_least_one() {
        for (opt, bad) in [
            ("--events", "0"),
            ("--concurrency", "0"),
            ("--concurrency", "10001"),
            ("--batch", "0"),
            ("--batch", "1000001"),
        ] {
            let e = ingest_args(&[opt, bad]).expect_err(opt);
            assert_eq!(
                e.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{opt} {bad}"
            );
        }
        let b = ingest_args(&["--events", "1", "--concurrency", "1", "--batch", "1"])
            .expect("the smallest run");
        assert_eq!((b.events, b.concurrency, b.batch), (1, 1, 1));
        let d = ingest_args(&[]).expect("defaults");
        assert_eq!((d.events, d.concurrency, d.batch), (100_000, 64, 1));
    }

    #[test]
    fn a_size_below_the_envelope_is_noted() {
        let smallest = make_event("ab12", 0, 0, "bench.event", false)
            .to_string()
            .len();
        let note = size_note(10, "ab12", "bench.event", false).expect("below the envelope");
        assert!(
            note.contains("--size 10") && note.contains(&format!("{smallest} bytes")),
            "{note}"
        );
        assert_eq!(size_note(smallest, "ab12", "bench.event", false), None);
        assert_eq!(size_note(1024, "ab12", "bench.event", true), None);
        // Random ids are longer: the smallest event too.
        assert!(size_note(smallest, "ab12", "bench.event", true).is_some());
    }

    #[test]
    fn the_sinks_status_must_be_a_final_answer() {
        #[derive(Debug, clap::Parser)]
        struct SinkCli {
            #[command(flatten)]
            b: SinkBench,
        }
        use clap::Parser;
        let parse = |status: &str| SinkCli::try_parse_from(["sink", "--status", status]);
        for bad in ["42", "99", "100", "199", "600", "1000", "x"] {
            let e = parse(bad).expect_err(bad);
            assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{bad}");
            assert!(bad == "x" || sink_status(bad.parse().expect("a number")).is_err());
        }
        for good in ["200", "202", "429", "503", "599"] {
            let b = parse(good).expect(good).b;
            assert_eq!(b.status.to_string(), good);
            assert_eq!(sink_status(b.status).expect(good).as_str(), good);
        }
        let d = SinkCli::try_parse_from(["sink"]).expect("defaults").b;
        assert_eq!(
            (d.status, d.listen.to_string().as_str()),
            (202, "127.0.0.1:9999")
        );
    }

    #[test]
    fn a_rate_must_be_finite_positive_and_bounded() {
        for bad in ["0", "-5", "NaN", "inf", "-inf", "1e300", "0.0001", "fast"] {
            let e = ingest_args(&[&format!("--rate={bad}")]).expect_err(bad);
            assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{bad}");
        }
        // As a person types it: a value of its own after the option.
        let e = ingest_args(&["--rate", "-5"]).expect_err("negative");
        assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation);
        for good in ["0.5", "3000", "1e9"] {
            let b = ingest_args(&["--rate", good]).expect(good);
            assert_eq!(b.rate, good.parse().ok());
        }
    }

    #[tokio::test]
    async fn a_connections_period_is_never_zero_nor_unrepresentable() {
        assert_eq!(per_connection_period(MAX_RATE, 1, 1), MIN_PERIOD);
        assert_eq!(per_connection_period(f64::INFINITY, 1, 64), MIN_PERIOD);
        assert_eq!(per_connection_period(1e-300, 100, 64), MAX_PERIOD);
        assert_eq!(per_connection_period(0.0, 1, 1), MAX_PERIOD);
        assert_eq!(
            per_connection_period(4000.0, 1, 64),
            Duration::from_millis(16)
        );
        // The timer takes it (a zero period panics there).
        let _ = tokio::time::interval_at(
            tokio::time::Instant::now(),
            per_connection_period(MAX_RATE, 1, 1),
        );
    }

    fn sent(first_event: u64, events: u64) -> Sent {
        Sent {
            at: Duration::ZERO,
            first_event,
            events,
        }
    }

    fn failed(kind: FailureKind, retry_after: Option<&str>, message: &str) -> Outcome {
        Outcome::Failed(Failure {
            kind,
            retry_after: retry_after.map(str::to_string),
            message: message.to_string(),
        })
    }

    #[test]
    fn failed_requests_are_counted_by_kind_with_their_events_and_a_sample() {
        let tally = Tally::build().expect("tally");
        let (mut a, mut b) = (Local::new().expect("local"), Local::new().expect("local"));
        let busy = FailureKind::Status(429);
        let refused = FailureKind::Connect(Some(std::io::ErrorKind::ConnectionRefused));
        tally.record_us(
            &mut a,
            900,
            sent(0, 10),
            failed(busy, Some("1"), "ingest is saturated"),
        );
        tally.record_us(
            &mut b,
            800,
            sent(10, 10),
            failed(busy, Some("2"), "saturated again"),
        );
        tally.record_us(&mut b, 700, sent(20, 10), failed(busy, None, "no header"));
        tally.record_us(
            &mut a,
            5,
            sent(30, 10),
            failed(refused, None, "tcp connect error"),
        );
        tally.record_us(&mut a, 1_000, sent(40, 10), one_accepted());
        tally.merge(a);
        tally.merge(b);
        let r = tally
            .report(Duration::from_secs(1), "ab12", false)
            .expect("report");
        assert_eq!((r.requests, r.failed_requests, r.failed_events), (5, 4, 40));
        assert_eq!(r.failures.len(), 2, "{r}");
        let f = &r.failures[0];
        assert_eq!((f.kind, f.requests, f.events), (busy, 3, 30));
        assert_eq!(f.with_retry_after, 2);
        assert!(f.retry_after.is_some() && !f.sample.is_empty(), "{f:?}");
        let text = r.to_string();
        assert!(
            text.contains("failed reqs:    4 of 5 requests, 40 events"),
            "{text}"
        );
        assert!(
            text.contains("  3 × 429 Too Many Requests (30 events), 2 with Retry-After"),
            "{text}"
        );
        assert!(
            text.contains("  1 × connect: connection refused (10 events): \"tcp connect error\""),
            "{text}"
        );
    }

    /// A refused connection is answered in microseconds: counted with the successful
    /// requests, it pulled their percentiles down.
    #[test]
    fn failed_requests_are_left_out_of_the_latency_of_successful_ones() {
        let tally = Tally::build().expect("tally");
        let mut local = Local::new().expect("local");
        let refused = FailureKind::Connect(Some(std::io::ErrorKind::ConnectionRefused));
        for n in 0..90 {
            tally.record_us(&mut local, 3, sent(n, 1), failed(refused, None, "refused"));
        }
        for n in 90..100 {
            tally.record_us(&mut local, 10_000, sent(n, 1), one_accepted());
        }
        tally.merge(local);
        let r = tally
            .report(Duration::from_secs(1), "ab12", false)
            .expect("report");
        let ok = r.latency_us.expect("some succeeded");
        assert_eq!((ok[0], ok[3]), (10_000, 10_000), "{r}");
        let fail = r.failed_latency_us.expect("some failed");
        assert_eq!((fail[0], fail[3]), (3, 3), "{r}");
        let text = r.to_string();
        assert!(text.contains("latency (req):  p50 10.00 ms"), "{text}");
        assert!(text.contains("latency (fail): p50 0.00 ms"), "{text}");
    }

    #[test]
    fn any_failed_request_fails_the_run_unless_allowed() {
        let tally = Tally::build().expect("tally");
        let mut local = Local::new().expect("local");
        tally.record_us(&mut local, 10, sent(0, 1), one_accepted());
        tally.merge(local);
        let clean = tally
            .report(Duration::from_secs(1), "ab12", false)
            .expect("report");
        assert_eq!(clean.problem(false), None);

        let mut local = Local::new().expect("local");
        let unavailable = FailureKind::Status(503);
        tally.record_us(
            &mut local,
            10,
            sent(1, 1),
            failed(unavailable, Some("1"), "compacting"),
        );
        tally.merge(local);
        let some = tally
            .report(Duration::from_secs(1), "ab12", false)
            .expect("report");
        let p = some.problem(false).expect("a request failed");
        assert!(p.contains("1 of 2 requests failed"), "{p}");
        assert_eq!(some.problem(true), None);

        let none = Tally::build().expect("tally");
        let mut local = Local::new().expect("local");
        none.record_us(
            &mut local,
            10,
            sent(0, 1),
            failed(unavailable, None, "down"),
        );
        none.merge(local);
        let all = none
            .report(Duration::from_secs(1), "ab12", false)
            .expect("report");
        assert!(all.latency_us.is_none());
        assert!(
            all.to_string()
                .contains("latency (req):  no request succeeded")
        );
        // Allowing failures is for a run that measured something.
        assert!(
            all.problem(true)
                .expect("all failed")
                .contains("every request failed")
        );
    }

    #[tokio::test]
    async fn a_refused_connection_is_named_as_such() {
        // A port held by a socket that is bound but never listens: connecting is refused,
        // and no other test can take the port meanwhile (a port merely found free was taken
        // by a parallel test's server once, which reset the connection instead).
        let held = tokio::net::TcpSocket::new_v4().expect("socket");
        held.bind("127.0.0.1:0".parse().expect("addr"))
            .expect("bind");
        let port = held.local_addr().expect("a bound port").port();
        let client: Client<HttpConnector, Full<Bytes>> =
            Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let req = Request::post(format!("http://127.0.0.1:{port}/v1/events"))
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request");
        let e = client.request(req).await.expect_err("nothing listens");
        let f = Failure::transport(&e);
        assert_eq!(
            f.kind,
            FailureKind::Connect(Some(std::io::ErrorKind::ConnectionRefused))
        );
        assert_eq!(f.kind.to_string(), "connect: connection refused");
        assert!(f.message.contains("refused"), "{}", f.message);
    }

    #[test]
    fn an_error_answer_is_sampled_by_the_routers_error_or_its_body() {
        let json = Failure::answered(
            hyper::StatusCode::PAYLOAD_TOO_LARGE,
            None,
            br#"{"error": "the body is larger than 1048576 bytes", "errors": []}"#,
        );
        assert_eq!(json.kind.to_string(), "413 Payload Too Large");
        assert_eq!(json.message, "the body is larger than 1048576 bytes");
        let text = Failure::answered(hyper::StatusCode::NOT_FOUND, None, b"no route\n");
        assert_eq!(text.message, "no route");
        let empty = Failure::answered(
            hyper::StatusCode::SERVICE_UNAVAILABLE,
            Some("5".into()),
            b"",
        );
        assert_eq!(
            (empty.message.as_str(), empty.retry_after.as_deref()),
            ("(empty body)", Some("5"))
        );
    }

    /// A server that takes connections and requests and never answers: a hung router.
    async fn hung_server() -> (String, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}/v1/events", listener.local_addr().expect("addr"));
        let server = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((conn, _)) = listener.accept().await {
                held.push(conn);
            }
        });
        (url, server)
    }

    #[tokio::test]
    async fn a_request_without_an_answer_times_out_as_a_failure() {
        let (url, server) = hung_server().await;
        let b = ingest_args(&[
            "--url",
            &url,
            "--events",
            "3",
            "--concurrency",
            "1",
            "--timeout",
            "200ms",
        ])
        .expect("args");
        let stop = tokio_util::sync::CancellationToken::new();
        let r = tokio::time::timeout(Duration::from_secs(30), run_ingest(b, stop))
            .await
            .expect("the timeout ends every request")
            .expect("report");
        server.abort();
        assert_eq!((r.requests, r.failed_requests), (3, 3), "{r}");
        assert_eq!(r.failures[0].kind, FailureKind::Timeout, "{r}");
        assert!(
            r.to_string()
                .contains("3 × timed out (3 events): \"no complete answer within 200ms\""),
            "{r}"
        );
        assert!(!r.interrupted);
    }

    #[tokio::test]
    async fn a_stopped_run_reports_what_it_did_and_what_it_abandoned() {
        let (url, server) = hung_server().await;
        let b = ingest_args(&[
            "--url",
            &url,
            "--events",
            "100",
            "--concurrency",
            "4",
            "--batch",
            "2",
        ])
        .expect("args");
        let stop = tokio_util::sync::CancellationToken::new();
        let run = tokio::spawn(run_ingest(b, stop.clone()));
        tokio::time::sleep(Duration::from_millis(300)).await;
        stop.cancel();
        let r = tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .expect("stopping is prompt")
            .expect("joined")
            .expect("report");
        server.abort();
        assert!(r.interrupted, "{r}");
        assert_eq!(r.abandoned, (4, 8), "{r}");
        assert_eq!(r.requests, 0, "{r}");
        assert!(
            r.to_string().contains(
                "interrupted:    stopped before the end; 4 requests in flight abandoned (8 events)"
            ),
            "{r}"
        );
    }

    #[test]
    fn the_report_names_the_run_and_the_slowest_events_id() {
        let tally = Tally::build().expect("tally");
        let mut local = Local::new().expect("local");
        tally.record_us(&mut local, 1_000, sent(7, 1), one_accepted());
        tally.merge(local);
        let r = tally
            .report(Duration::from_secs(2), "ab12", false)
            .expect("report");
        let text = r.to_string();
        assert!(
            text.starts_with("run id:         ab12 (event ids ab12-<n>)\n"),
            "{text}"
        );
        assert!(text.contains("first event #7 (id ab12-7)"), "{text}");
        // Below 1/s, with decimals.
        assert!(text.contains("throughput:     0.500 events/s"), "{text}");
        let random = tally
            .report(Duration::from_secs(2), "ab12", true)
            .expect("report");
        let text = random.to_string();
        assert!(text.contains("(event ids <hex>-ab12-<n>)"), "{text}");
        assert!(
            text.contains(&format!("(id {})", event_id("ab12", 7, true))),
            "{text}"
        );
    }

    #[test]
    fn throughput_keeps_decimals_below_one_hundred_per_second() {
        assert_eq!(events_per_sec(0, 1.0), "0");
        assert_eq!(events_per_sec(1, 4.0), "0.250");
        assert_eq!(events_per_sec(15, 2.0), "7.5");
        assert_eq!(events_per_sec(16_071, 1.0), "16071");
        assert_eq!(events_per_sec(5, 0.0), "0");
        let t = ingest_args(&["--timeout", "1500ms"]).expect("a timeout");
        assert_eq!(t.timeout, Duration::from_millis(1500));
        assert_eq!(
            ingest_args(&[]).expect("defaults").timeout,
            Duration::from_secs(60)
        );
        for bad in ["0s", "soon"] {
            let e = ingest_args(&["--timeout", bad]).expect_err(bad);
            assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{bad}");
        }
    }

    fn one_accepted() -> Outcome {
        Outcome::Acked(EventCounts {
            accepted: 1,
            ..EventCounts::default()
        })
    }

    #[test]
    fn the_routers_answer_is_counted_per_event() {
        let body = br#"{"results": [
            {"id": "r-0", "source": "/s", "status": "accepted"},
            {"id": "r-1", "source": "/s", "status": "duplicate"},
            {"id": "r-2", "source": "/s", "status": "quarantined", "reason": "contract_violation",
             "errors": [{"pointer": "/data", "message": "no"}]},
            {"id": "r-3", "source": "/s", "status": "accepted"}
        ]}"#;
        let c = EventCounts::from_answer(body, 4);
        assert_eq!(
            c,
            EventCounts {
                accepted: 2,
                duplicate: 1,
                quarantined: 1,
                unreported: 0
            }
        );
        assert_eq!(c.taken(), 2);
        assert_eq!(c.to_string(), "2 accepted, 1 duplicate, 1 quarantined");
        // `bench sink` answers `{}`: its events are taken, with no more said.
        let sink = EventCounts::from_answer(b"{}", 3);
        assert_eq!((sink.unreported, sink.taken()), (3, 3));
        assert_eq!(
            sink.to_string(),
            "3 acknowledged (the answers had no per-event results)"
        );
        // A status this tool does not know, and results missing: not called accepted.
        let odd = EventCounts::from_answer(br#"{"results": [{"status": "deferred"}]}"#, 2);
        assert_eq!((odd.accepted, odd.unreported), (0, 2));
    }

    #[test]
    fn a_report_counts_only_accepted_events_as_ok_and_in_the_throughput() {
        let tally = Tally::build().expect("tally");
        let mut local = Local::new().expect("local");
        let answer = Outcome::Acked(EventCounts {
            accepted: 10,
            duplicate: 5,
            quarantined: 5,
            unreported: 0,
        });
        tally.record_us(&mut local, 1_000, sent(0, 20), answer);
        tally.merge(local);
        let text = tally
            .report(Duration::from_secs(1), "ab12", false)
            .expect("report")
            .to_string();
        assert!(
            text.contains("events ok:      10 accepted, 5 duplicate, 5 quarantined"),
            "{text}"
        );
        assert!(text.contains("throughput:     10.0 events/s"), "{text}");
    }

    #[test]
    fn requests_slower_than_a_minute_count_in_every_percentile_and_the_maximum() {
        let tally = Tally::build().expect("tally");
        let mut local = Local::new().expect("local");
        for n in 0..99 {
            tally.record_us(&mut local, 1_000, sent(n, 1), one_accepted());
        }
        // A request that waited on a router stalled for two minutes (past the bound the
        // histogram had, a minute rounded up to 67 s).
        let stalled = 125_000_321;
        tally.record_us(&mut local, stalled, sent(99, 1), one_accepted());
        tally.merge(local);
        let r = tally
            .report(Duration::from_secs(130), "ab12", false)
            .expect("report");
        let latency = r.latency_us.expect("requests succeeded");
        assert_eq!(latency[3], stalled, "{r}");
        // 1 of 100 requests: past the 99th percentile, at the 99.9th (within the histogram's
        // 3 significant digits).
        assert_eq!(latency[1], 1_000, "{r}");
        assert!(latency[2].abs_diff(stalled) < stalled / 1000, "{r}");
        assert_eq!(r.events.accepted, 100);
    }

    #[tokio::test]
    async fn a_load_task_that_panics_fails_the_run() {
        let ok = tokio::spawn(async {});
        let broken = tokio::spawn(async { panic!("the period was zero") });
        let e = join_tasks(vec![ok, broken])
            .await
            .expect_err("a task panicked");
        assert!(
            e.contains("1 of 2") && e.contains("the period was zero"),
            "{e}"
        );
        assert!(join_tasks(vec![tokio::spawn(async {})]).await.is_ok());
    }
}
