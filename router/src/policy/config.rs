//! Delivery-policy configuration (the `policies:` section of rule files), read by the rules
//! loader and handed, resolved per target, to the dispatcher that delivers queue entries.
//!
//! Every field has a default, so `{}` is a complete policy; unknown keys are rejected.
//! Durations are written as humantime strings (`200ms`, `30s`, `24h`) and serialized back in
//! the same compact form.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Worst-case attempts per event above which the loader warns ("more than 15 is a smell").
pub const WORST_CASE_ATTEMPTS_SMELL: u32 = 15;

/// Most `retry.max_attempts` a policy may set (as SQS's `maxReceiveCount`). Far past any
/// sane schedule (more than 15 is already a smell); unbounded, `4294967295` passed `rules
/// check`, and every worst-case computation that walked the attempts took minutes.
pub const MAX_ATTEMPTS: u32 = 1000;

/// From this retry on, [`RetryPolicy::max_backoff`] no longer changes: its factor `2^n`
/// saturates at `u32::MAX` (and the wait at `max_delay` sooner), so sums over the waits
/// past it are a multiplication.
const BACKOFF_STEPS: u32 = 32;

/// Longest duration a policy may set (ten years). Policy durations are added to timestamps
/// (an open breaker's end, a retry's due time, an event's `max_age` limit) in milliseconds: far
/// past any real need, a typo such as `open_for: 99999999999999d` overflowed that sum and
/// panicked the delivery task, leaving its entry in flight. Ten years keeps every such sum
/// within `i64` milliseconds by a wide margin.
pub const MAX_POLICY_DURATION: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// Serde adapter for `Duration` fields: parses humantime strings, writes compact ones
/// (`200ms`, `24h`, `1h 30m`) that humantime parses back to the same value.
pub(crate) mod duration_str {
    use std::time::Duration;

    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format_duration(*d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        humantime_serde::deserialize(d)
    }
}

/// Formats a duration compactly with the units h, m, s, ms, us, ns (`0s` for zero), e.g.
/// `24h`, `200ms`, `1h 30m`. `humantime::parse_duration` reads every output back exactly.
pub fn format_duration(d: Duration) -> String {
    const UNITS: [(u128, &str); 6] = [
        (3_600_000_000_000, "h"),
        (60_000_000_000, "m"),
        (1_000_000_000, "s"),
        (1_000_000, "ms"),
        (1_000, "us"),
        (1, "ns"),
    ];
    if d.is_zero() {
        return "0s".to_string();
    }
    let mut rest = d.as_nanos();
    let mut parts = Vec::new();
    for (size, unit) in UNITS {
        let q = rest / size;
        if q > 0 {
            parts.push(format!("{q}{unit}"));
            rest -= q * size;
        }
    }
    parts.join(" ")
}

/// Whether a humantime duration has a term in months (`5M`, `1 M 2d`): the unit `M` alone.
/// humantime reads `M` as a month and `m` as a minute, so `5M` is valid and almost certainly
/// not what was meant; rule files and the configuration warn about it.
pub fn uses_month_unit(duration: &str) -> bool {
    duration
        .split(|c: char| c.is_ascii_digit() || c == '.' || c.is_whitespace())
        .any(|unit| unit == "M")
}

/// One named delivery policy: everything that governs how a target's queue entries are
/// delivered. `PolicyConfig::default()` is the policy of targets that name none.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// Time limit for one delivery attempt (default 10s).
    #[serde(with = "duration_str")]
    pub timeout: Duration,
    /// Retry schedule for transient failures.
    pub retry: RetryPolicy,
    /// Circuit breaker; `None` (the default) means no breaker.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub breaker: Option<BreakerPolicy>,
    /// Rate limit and concurrency cap; `None` (the default) means unthrottled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub throttle: Option<ThrottlePolicy>,
    /// Retries may be at most this fraction (0..=1) of recent first attempts, plus 10 a
    /// second; `None` means the default, 0.1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_budget: Option<f64>,
    /// Ordering key: entries with the same key are delivered one at a time, in order.
    /// `None` (the default) means unordered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ordering: Option<OrderingKey>,
    /// What an ordered key does when one of its entries goes to the DLQ.
    pub on_dead_letter: OnDeadLetter,
    /// Queue-depth cap of the target; beyond it new entries go to the DLQ as
    /// `target_overflow` (default 100000).
    pub max_queue_depth: u64,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(10),
            retry: RetryPolicy::default(),
            breaker: None,
            throttle: None,
            retry_budget: None,
            ordering: None,
            on_dead_letter: OnDeadLetter::default(),
            max_queue_depth: 100_000,
        }
    }
}

/// Exponential backoff: the wait before retry `n` (0-based) is drawn per `jitter` from
/// `min(max_delay, base_delay * 2^n)`, bounded by `max_attempts` and `max_age`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryPolicy {
    /// Total attempts including the first one (default 5). 1 means no retries.
    pub max_attempts: u32,
    /// Backoff base (default 200ms).
    #[serde(with = "duration_str")]
    pub base_delay: Duration,
    /// Backoff ceiling (default 30s).
    #[serde(with = "duration_str")]
    pub max_delay: Duration,
    /// How the wait is randomized (default `full`).
    pub jitter: Jitter,
    /// Give up (DLQ) once this much time has passed since the router accepted the event
    /// (default 24h).
    #[serde(with = "duration_str")]
    pub max_age: Duration,
    /// Longest `Retry-After` (from 429/503) honoured (default 1h).
    #[serde(with = "duration_str")]
    pub retry_after_max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            base_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(30),
            jitter: Jitter::Full,
            max_age: Duration::from_secs(24 * 3600),
            retry_after_max: Duration::from_secs(3600),
        }
    }
}

impl RetryPolicy {
    /// The longest wait before retry `n` (0-based: `n = 0` is the wait after the first
    /// attempt): `min(max_delay, base_delay * 2^n)`, without jitter.
    pub fn max_backoff(&self, n: u32) -> Duration {
        let factor = 1u32.checked_shl(n).unwrap_or(u32::MAX);
        self.base_delay.saturating_mul(factor).min(self.max_delay)
    }
}

/// Randomization of the backoff wait `cap = min(max_delay, base * 2^n)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Jitter {
    /// `random(0, cap)` (AWS "full jitter"; the default).
    #[default]
    Full,
    /// `cap/2 + random(0, cap/2)`.
    Equal,
    /// Exactly `cap`.
    None,
}

/// Circuit breaker per target: closed → open when the failure rate over `window` reaches
/// `failure_rate` (with at least `min_requests`), or after `consecutive_failures` in a row;
/// half-open after `open_for` with `half_open_probes` probes; closed again on success.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BreakerPolicy {
    /// Failure fraction in (0, 1] that opens the breaker (default 0.5).
    pub failure_rate: f64,
    /// Minimum attempts in the window before the rate is considered (default 20).
    pub min_requests: u32,
    /// Sliding window over which the rate is computed (default 30s).
    #[serde(with = "duration_str")]
    pub window: Duration,
    /// How long the breaker stays open before probing (default 30s).
    #[serde(with = "duration_str")]
    pub open_for: Duration,
    /// Probes allowed while half-open (default 1).
    pub half_open_probes: u32,
    /// Also open after this many consecutive failures; `None` (default) disables the rule.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consecutive_failures: Option<u32>,
}

impl Default for BreakerPolicy {
    fn default() -> Self {
        Self {
            failure_rate: 0.5,
            min_requests: 20,
            window: Duration::from_secs(30),
            open_for: Duration::from_secs(30),
            half_open_probes: 1,
            consecutive_failures: None,
        }
    }
}

/// Throttle per target: a token bucket (`rate_per_sec`, `burst`) and a concurrency cap.
/// Each part is optional; at least one must be set.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ThrottlePolicy {
    /// Sustained attempts per second; `None` means no rate limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate_per_sec: Option<f64>,
    /// Bucket size; `None` means `max(1, ceil(rate_per_sec))`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    /// Attempts in flight at once; `None` means unlimited.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<u32>,
}

impl ThrottlePolicy {
    /// The bucket size in force: `burst`, or `max(1, ceil(rate_per_sec))` when unset.
    pub fn effective_burst(&self) -> Option<u32> {
        match (self.burst, self.rate_per_sec) {
            (Some(b), _) => Some(b),
            // Saturating float-to-int cast is the intent here (rates are validated finite).
            (None, Some(r)) => Some((r.ceil() as u32).max(1)),
            (None, None) => None,
        }
    }
}

/// What an ordered key does when its head entry is dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnDeadLetter {
    /// The key moves on to its next entry (default).
    #[default]
    Proceed,
    /// The key stays blocked until an operator redrives or purges the dead letter.
    Hold,
}

/// Where the ordering key of an event comes from. Written as `partitionkey` (the
/// CloudEvents Partitioning extension) or as a dotted JSON path into the structured event,
/// such as `$.data.order_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum OrderingKey {
    /// The `partitionkey` extension attribute.
    PartitionKey,
    /// A path of object keys from the event root (`$.data.order_id` → `["data", "order_id"]`).
    Path(Vec<String>),
}

impl OrderingKey {
    /// The key of `event` (structured CloudEvent JSON): strings as they are, other scalars
    /// as JSON text; `None` when the path is missing or null (the event is then unordered).
    pub fn extract(&self, event: &Value) -> Option<String> {
        let v = match self {
            OrderingKey::PartitionKey => event.get("partitionkey")?,
            OrderingKey::Path(path) => {
                let mut cur = event;
                for seg in path {
                    cur = cur.get(seg.as_str())?;
                }
                cur
            }
        };
        key_text(v).map(bounded_key)
    }

    /// [`OrderingKey::extract`] on `event.to_json()`, read from the fields without building it.
    pub fn extract_event(&self, event: &crate::event::CloudEvent) -> Option<String> {
        use crate::event::Member;
        let (first, rest) = match self {
            OrderingKey::PartitionKey => ("partitionkey", &[][..]),
            OrderingKey::Path(path) => match path.split_first() {
                Some((first, rest)) => (first.as_str(), rest),
                // An empty path names the whole event, which is an object.
                None => return self.extract(&event.to_json()),
            },
        };
        let mut cur = match event.member(first)? {
            Member::Str(s) if rest.is_empty() => return Some(bounded_key(s.to_string())),
            Member::Str(_) => return None,
            Member::Json(v) => v,
        };
        for seg in rest {
            cur = cur.get(seg.as_str())?;
        }
        key_text(cur).map(bounded_key)
    }
}

/// The longest ordering key kept as its text, in bytes; a longer one is replaced by
/// [`bounded_key`]'s digest. Every queued entry of an ordered target keeps its key in memory
/// (the store's index) and on disk, and an operator releases a held key by naming it in a
/// URL: 1,000 queued entries with 400 KB keys took over 1 GB, and a key past ~64 KB could not
/// be released (431). 256 bytes fits any identifier (AWS caps MessageGroupId at 128).
pub const MAX_ORDERING_KEY_BYTES: usize = 256;

/// `key` itself up to [`MAX_ORDERING_KEY_BYTES`]; past it `sha256:<64 hex digits>` of it.
/// A digest rather than a refusal: equal keys still give equal digests, so ordering holds,
/// and no event is refused at ingest for one target's policy (a producer does not know
/// which targets order by which field, and the same event may be fine for the others).
pub fn bounded_key(key: String) -> String {
    if key.len() <= MAX_ORDERING_KEY_BYTES {
        return key;
    }
    use sha2::Digest;
    format!(
        "sha256:{}",
        hex::encode(sha2::Sha256::digest(key.as_bytes()))
    )
}

/// An ordering key's text: strings as they are, other values as canonical JSON text
/// ([`canonical_json`]); none for null.
fn key_text(v: &Value) -> Option<String> {
    match v {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        other => {
            let mut out = String::new();
            canonical_json(other, &mut out);
            Some(out)
        }
    }
}

/// `v` as compact JSON in which equal values read the same: object members sorted by name
/// (at every depth) and numbers of equal value written alike (`1.0` and `1e0` as `1`). Written
/// as received, `{"a":1,"b":2}` and `{"b":2,"a":1}`, or `1.0` and `1`, were two keys, and
/// their events were not kept in order. Integers and fractional numbers are written as
/// before, so the keys of those (and of strings, the common case) did not change.
fn canonical_json(v: &Value, out: &mut String) {
    match v {
        Value::Number(n) => out.push_str(&canonical_number(n)),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical_json(item, out);
            }
            out.push(']');
        }
        Value::Object(members) => {
            let mut sorted: Vec<(&String, &Value)> = members.iter().collect();
            sorted.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (name, item)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(name.clone()).to_string());
                out.push(':');
                canonical_json(item, out);
            }
            out.push('}');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// A number's canonical text: an integer as its digits; a float with no fractional part
/// that an `f64` holds exactly as an integer (`1.0`, `1e2`) as that integer; any other float
/// as its shortest round-trip form (what `serde_json` writes).
fn canonical_number(n: &serde_json::Number) -> String {
    /// 2^53: past it an `f64` no longer holds every integer.
    const EXACT: f64 = 9_007_199_254_740_992.0;
    if n.is_i64() || n.is_u64() {
        return n.to_string();
    }
    match n.as_f64() {
        #[allow(clippy::cast_possible_truncation)] // checked: integral and below 2^53
        Some(f) if f.fract() == 0.0 && f.abs() < EXACT => format!("{}", f as i64),
        Some(f) => serde_json::Number::from_f64(f).map_or_else(|| n.to_string(), |x| x.to_string()),
        None => n.to_string(),
    }
}

impl TryFrom<String> for OrderingKey {
    type Error = String;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        if s == "partitionkey" {
            return Ok(OrderingKey::PartitionKey);
        }
        let Some(rest) = s.strip_prefix("$.") else {
            return Err(format!(
                "ordering must be `partitionkey` or a JSON path like `$.data.order_id`, not `{s}`"
            ));
        };
        let segs: Vec<String> = rest.split('.').map(str::to_string).collect();
        if segs
            .iter()
            .any(|p| p.is_empty() || p.contains(['[', ']', '*']))
        {
            return Err(format!(
                "ordering path `{s}` must be dotted field names like `$.data.order_id`"
            ));
        }
        Ok(OrderingKey::Path(segs))
    }
}

impl From<OrderingKey> for String {
    fn from(k: OrderingKey) -> Self {
        k.to_string()
    }
}

impl fmt::Display for OrderingKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OrderingKey::PartitionKey => f.write_str("partitionkey"),
            OrderingKey::Path(p) => write!(f, "$.{}", p.join(".")),
        }
    }
}

impl PolicyConfig {
    /// Whether a dead letter holds its ordering key (`on_dead_letter: hold`). Only with
    /// `ordering`: a target whose policy lost it delivers the keyed entries accepted before
    /// unordered, and a dead letter among them must not hold their key (nothing would wait
    /// for the hold, and it would come back when ordering is turned on again).
    pub fn holds_keys(&self) -> bool {
        self.ordering.is_some() && self.on_dead_letter == OnDeadLetter::Hold
    }

    /// Sanity problems of this policy, one message per problem (empty when sane). The rules
    /// loader reports each one as an error.
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        let r = &self.retry;
        let durations = [
            ("timeout", Some(self.timeout)),
            ("retry.base_delay", Some(r.base_delay)),
            ("retry.max_delay", Some(r.max_delay)),
            ("retry.max_age", Some(r.max_age)),
            ("retry.retry_after_max", Some(r.retry_after_max)),
            ("breaker.window", self.breaker.as_ref().map(|b| b.window)),
            (
                "breaker.open_for",
                self.breaker.as_ref().map(|b| b.open_for),
            ),
        ];
        for (field, d) in durations {
            if let Some(d) = d
                && d > MAX_POLICY_DURATION
            {
                p.push(format!(
                    "{field} must be at most 10 years (3650d), not {}",
                    format_duration(d)
                ));
            }
        }
        if self.timeout.is_zero() {
            p.push("timeout must be greater than 0".to_string());
        }
        if r.max_attempts == 0 {
            p.push("retry.max_attempts must be at least 1".to_string());
        }
        if r.max_attempts > MAX_ATTEMPTS {
            p.push(format!(
                "retry.max_attempts must be at most {MAX_ATTEMPTS}, not {}",
                r.max_attempts
            ));
        }
        // The worker counts waits in whole milliseconds: below one, every retry went out at
        // once while `config explain` counted the nanoseconds.
        if r.base_delay < Duration::from_millis(1) {
            p.push(format!(
                "retry.base_delay must be at least 1ms, not {}",
                format_duration(r.base_delay)
            ));
        }
        if r.base_delay > r.max_delay {
            p.push(format!(
                "retry.base_delay ({}) is greater than retry.max_delay ({})",
                format_duration(r.base_delay),
                format_duration(r.max_delay)
            ));
        }
        if r.max_age.is_zero() {
            p.push("retry.max_age must be greater than 0".to_string());
        }
        if let Some(b) = &self.breaker {
            if !(b.failure_rate > 0.0 && b.failure_rate <= 1.0) {
                p.push(format!(
                    "breaker.failure_rate must be in (0, 1], not {}",
                    b.failure_rate
                ));
            }
            if b.min_requests == 0 {
                p.push("breaker.min_requests must be at least 1".to_string());
            }
            if b.window.is_zero() {
                p.push("breaker.window must be greater than 0".to_string());
            }
            if b.open_for.is_zero() {
                p.push("breaker.open_for must be greater than 0".to_string());
            }
            if b.half_open_probes == 0 {
                p.push("breaker.half_open_probes must be at least 1".to_string());
            }
            if b.consecutive_failures == Some(0) {
                p.push("breaker.consecutive_failures must be at least 1 (or null)".to_string());
            }
        }
        if let Some(t) = &self.throttle {
            if let Some(rate) = t.rate_per_sec
                && !(rate.is_finite() && rate > 0.0)
            {
                p.push(format!(
                    "throttle.rate_per_sec must be greater than 0, not {rate}"
                ));
            }
            if t.burst == Some(0) {
                p.push("throttle.burst must be at least 1".to_string());
            }
            if t.burst.is_some() && t.rate_per_sec.is_none() {
                p.push("throttle.burst needs throttle.rate_per_sec".to_string());
            }
            if t.max_concurrency == Some(0) {
                p.push("throttle.max_concurrency must be at least 1".to_string());
            }
            if t.rate_per_sec.is_none() && t.max_concurrency.is_none() {
                p.push("throttle sets neither rate_per_sec nor max_concurrency".to_string());
            }
        }
        if let Some(b) = self.retry_budget
            && !(0.0..=1.0).contains(&b)
        {
            p.push(format!("retry_budget must be in [0, 1], not {b}"));
        }
        if self.max_queue_depth == 0 {
            p.push("max_queue_depth must be at least 1".to_string());
        }
        p
    }

    /// Worst case for one event at one target: the number of attempts and the longest time
    /// before it reaches the DLQ — every attempt running into `timeout`, plus the longest
    /// backoff `min(max_delay, base_delay * 2^n)` between attempts `n` and `n + 1` — capped by
    /// `max_age + timeout`: the worker checks `max_age` when it schedules a retry (and again
    /// before sending one), so an attempt that starts just inside `max_age` still runs for up
    /// to its `timeout` past it. The attempts are `max_attempts`, or fewer when the shortest waits the jitter
    /// allows (`none`: the backoff, `equal`: half of it) use up `max_age` first. A target that
    /// answers with `Retry-After` can stretch every wait: see
    /// [`PolicyConfig::worst_case_with_retry_after`].
    pub fn worst_case(&self) -> (u32, Duration) {
        self.worst_case_lingering(Duration::ZERO)
    }

    /// [`PolicyConfig::worst_case`] when each attempt may first wait up to `linger` (a
    /// batching webhook's `window`, which a due entry may wait out for more to fill its
    /// batch): that much more per attempt, and the cap is `max_age` plus the longer of
    /// `timeout` and `linger` (an entry still waiting in the window at `max_age` goes to the
    /// DLQ unsent when the window ends).
    pub fn worst_case_lingering(&self, linger: Duration) -> (u32, Duration) {
        let attempts = self.attempts_within_max_age();
        (
            attempts,
            self.total_time(attempts, linger, |backoff| backoff),
        )
    }

    /// The worst case's time when every wait is stretched by a `Retry-After` (a webhook's
    /// 429/503, a handler's `retry` with a delay) of `retry_after_max` or more: the router
    /// waits the longer of that and the backoff. Capped by `max_age + timeout`. Waiting behind an open
    /// breaker or a pause spends no attempt and can last until `max_age` too.
    pub fn worst_case_with_retry_after(&self) -> Duration {
        self.worst_case_with_retry_after_lingering(Duration::ZERO)
    }

    /// [`PolicyConfig::worst_case_with_retry_after`] with `linger` before each attempt, as
    /// [`PolicyConfig::worst_case_lingering`].
    pub fn worst_case_with_retry_after_lingering(&self, linger: Duration) -> Duration {
        let attempts = self.attempts_within_max_age();
        self.total_time(attempts, linger, |backoff| {
            backoff.max(self.retry.retry_after_max)
        })
    }

    /// Attempts that can start by `max_age` (the worker sends a retry due at `max_age` itself,
    /// not one due after it), at most `max_attempts`. Walks the waits only until the backoff
    /// stops growing ([`BACKOFF_STEPS`]) and counts the rest by division, so a stored policy
    /// from before [`MAX_ATTEMPTS`] (or any `max_attempts`) costs the same.
    fn attempts_within_max_age(&self) -> u32 {
        let max = self.retry.max_attempts;
        let max_age = self.retry.max_age;
        let shortest_wait = |n: u32| match self.retry.jitter {
            Jitter::Full => Duration::ZERO,
            Jitter::Equal => self.retry.max_backoff(n) / 2,
            Jitter::None => self.retry.max_backoff(n),
        };
        // `start` is when attempt `n` may start at the earliest: the sum of the waits before it.
        let mut start = Duration::ZERO;
        let steady = BACKOFF_STEPS.min(max);
        for n in 0..steady {
            // The first attempt always runs; a later one only if it is due by max_age.
            if n > 0 && start > max_age {
                return n;
            }
            start = start.saturating_add(shortest_wait(n));
        }
        if steady == max {
            return max;
        }
        if start > max_age {
            return steady;
        }
        // Attempt `steady + j` starts at `start + j * wait`: it runs while that is by max_age.
        let wait = shortest_wait(steady).as_nanos();
        if wait == 0 {
            return max;
        }
        let more = (max_age - start).as_nanos() / wait;
        let runs = u128::from(steady) + more + 1;
        u32::try_from(runs.min(u128::from(max))).unwrap_or(max)
    }

    /// `attempts` attempts that each wait up to `linger` and then run their whole timeout,
    /// with `wait(max_backoff(n))` between attempts `n` and `n + 1`, capped by `max_age` plus
    /// the longer of `timeout` and `linger` (the last attempt starts by `max_age` at the
    /// latest and may run its whole timeout; one still lingering then is dead-lettered unsent
    /// when it stops). `wait` sees only the backoff, so it is constant once the backoff is,
    /// and the waits past [`BACKOFF_STEPS`] are summed by one multiplication.
    fn total_time(
        &self,
        attempts: u32,
        linger: Duration,
        wait: impl Fn(Duration) -> Duration,
    ) -> Duration {
        let cap = self.retry.max_age.saturating_add(self.timeout.max(linger));
        let Some(waits) = attempts.checked_sub(1) else {
            return Duration::ZERO;
        };
        let mut total = self.timeout.saturating_add(linger).saturating_mul(attempts);
        let steady = BACKOFF_STEPS.min(waits);
        for n in 0..steady {
            total = total.saturating_add(wait(self.retry.max_backoff(n)));
        }
        let rest = wait(self.retry.max_backoff(steady)).saturating_mul(waits - steady);
        total.saturating_add(rest).min(cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn ordering_keys_read_from_fields_agree_with_the_structured_form() {
        let ev: crate::event::CloudEvent = serde_json::from_value(serde_json::json!({
            "id": "1", "source": "/s", "type": "t", "subject": "sub",
            "extensions": { "partitionkey": "pk", "tenant": { "id": 7 }, "none": null },
            "data": { "order_id": 42, "customer": { "name": "ann" }, "tag": "x" }
        }))
        .expect("event");
        let json = ev.to_json();
        for key in [
            "partitionkey",
            "$.data.order_id",
            "$.data.customer.name",
            "$.data.customer",
            "$.data.missing",
            "$.subject",
            "$.subject.deeper",
            "$.id",
            "$.type",
            "$.specversion",
            "$.tenant.id",
            "$.none",
            "$.time",
        ] {
            let k = OrderingKey::try_from(key.to_string()).expect(key);
            assert_eq!(k.extract_event(&ev), k.extract(&json), "{key}");
        }
    }

    #[test]
    fn defaults_match_the_spec() {
        let p = PolicyConfig::default();
        assert_eq!(p.timeout, Duration::from_secs(10));
        assert_eq!(p.retry.max_attempts, 5);
        assert_eq!(p.retry.base_delay, ms(200));
        assert_eq!(p.retry.max_delay, Duration::from_secs(30));
        assert_eq!(p.retry.jitter, Jitter::Full);
        assert_eq!(p.retry.max_age, Duration::from_secs(86_400));
        assert_eq!(p.retry.retry_after_max, Duration::from_secs(3600));
        assert_eq!(p.breaker, None);
        assert_eq!(p.throttle, None);
        assert_eq!(p.retry_budget, None);
        assert_eq!(p.ordering, None);
        assert_eq!(p.on_dead_letter, OnDeadLetter::Proceed);
        assert_eq!(p.max_queue_depth, 100_000);
        assert!(p.validate().is_empty());
        let empty: PolicyConfig = serde_json::from_value(json!({})).expect("empty policy");
        assert_eq!(empty, p);
    }

    #[test]
    fn full_example_parses_and_round_trips() {
        let v = json!({
            "timeout": "2s",
            "retry": { "max_attempts": 6, "base_delay": "200ms", "max_delay": "30s",
                       "jitter": "full", "max_age": "24h", "retry_after_max": "1h" },
            "breaker": { "failure_rate": 0.5, "min_requests": 20, "window": "30s",
                         "open_for": "30s", "half_open_probes": 1, "consecutive_failures": null },
            "throttle": { "rate_per_sec": 50, "burst": 100, "max_concurrency": 8 },
            "retry_budget": 0.1,
            "ordering": "$.data.order_id",
            "on_dead_letter": "hold",
            "max_queue_depth": 1000
        });
        let p: PolicyConfig = serde_json::from_value(v).expect("parses");
        assert_eq!(p.timeout, Duration::from_secs(2));
        assert_eq!(p.retry.max_attempts, 6);
        assert_eq!(
            p.ordering,
            Some(OrderingKey::Path(vec!["data".into(), "order_id".into()]))
        );
        assert_eq!(p.throttle.as_ref().and_then(|t| t.rate_per_sec), Some(50.0));
        assert_eq!(p.on_dead_letter, OnDeadLetter::Hold);
        assert!(p.validate().is_empty());
        let back = serde_json::to_value(&p).expect("serializes");
        assert_eq!(back["timeout"], "2s");
        assert_eq!(back["retry"]["max_age"], "24h");
        assert_eq!(back["retry"]["base_delay"], "200ms");
        assert_eq!(back["ordering"], "$.data.order_id");
        let again: PolicyConfig = serde_json::from_value(back).expect("round trip");
        assert_eq!(again, p);
    }

    #[test]
    fn unknown_fields_and_bad_values_are_rejected() {
        assert!(serde_json::from_value::<PolicyConfig>(json!({"timeot": "1s"})).is_err());
        assert!(
            serde_json::from_value::<PolicyConfig>(json!({"retry": {"max_attempt": 1}})).is_err()
        );
        assert!(serde_json::from_value::<PolicyConfig>(json!({"timeout": "soon"})).is_err());
        assert!(serde_json::from_value::<PolicyConfig>(json!({"ordering": "data.x"})).is_err());
        assert!(serde_json::from_value::<PolicyConfig>(json!({"ordering": "$..x"})).is_err());
        assert!(serde_json::from_value::<PolicyConfig>(json!({"jitter": "full"})).is_err());
    }

    #[test]
    fn durations_format_compactly_and_parse_back() {
        for (d, s) in [
            (Duration::ZERO, "0s"),
            (ms(200), "200ms"),
            (Duration::from_secs(86_400), "24h"),
            (Duration::from_secs(5400), "1h 30m"),
            (ms(1500), "1s 500ms"),
            (Duration::from_nanos(1_001), "1us 1ns"),
        ] {
            assert_eq!(format_duration(d), s);
            assert_eq!(humantime::parse_duration(s).expect("parses"), d);
        }
    }

    #[test]
    fn validation_reports_each_problem() {
        let mut p = PolicyConfig::default();
        p.retry.max_attempts = 0;
        p.retry.base_delay = Duration::from_secs(60);
        p.breaker = Some(BreakerPolicy {
            failure_rate: 0.0,
            ..BreakerPolicy::default()
        });
        p.throttle = Some(ThrottlePolicy {
            rate_per_sec: Some(0.0),
            burst: Some(0),
            max_concurrency: Some(0),
        });
        p.retry_budget = Some(1.5);
        p.max_queue_depth = 0;
        let problems = p.validate();
        let has = |s: &str| problems.iter().any(|m| m.contains(s));
        assert!(has("retry.max_attempts"), "{problems:?}");
        assert!(has("greater than retry.max_delay"), "{problems:?}");
        assert!(has("breaker.failure_rate"), "{problems:?}");
        assert!(has("throttle.rate_per_sec"), "{problems:?}");
        assert!(has("throttle.burst must be"), "{problems:?}");
        assert!(has("throttle.max_concurrency"), "{problems:?}");
        assert!(has("retry_budget"), "{problems:?}");
        assert!(has("max_queue_depth"), "{problems:?}");
        assert_eq!(problems.len(), 8, "{problems:?}");
    }

    #[test]
    fn validation_edges() {
        let mut p = PolicyConfig {
            breaker: Some(BreakerPolicy {
                failure_rate: 1.0,
                ..BreakerPolicy::default()
            }),
            retry_budget: Some(0.0),
            throttle: Some(ThrottlePolicy {
                rate_per_sec: Some(0.5),
                burst: None,
                max_concurrency: None,
            }),
            ..PolicyConfig::default()
        };
        assert!(p.validate().is_empty(), "{:?}", p.validate());
        assert_eq!(
            p.throttle.as_ref().and_then(|t| t.effective_burst()),
            Some(1)
        );
        p.throttle = Some(ThrottlePolicy::default());
        assert_eq!(p.validate().len(), 1);
        p.throttle = None;
        p.retry_budget = Some(-0.1);
        assert_eq!(p.validate().len(), 1);
        p.retry_budget = Some(f64::NAN);
        assert_eq!(p.validate().len(), 1);
        p.retry_budget = None;
        p.breaker = Some(BreakerPolicy {
            failure_rate: 1.01,
            consecutive_failures: Some(0),
            ..BreakerPolicy::default()
        });
        assert_eq!(p.validate().len(), 2);
        p.breaker = None;
        p.timeout = Duration::ZERO;
        assert_eq!(
            p.validate(),
            vec!["timeout must be greater than 0".to_string()]
        );
    }

    /// The worker's backoff counts whole milliseconds: a `base_delay` of `500us` passed and
    /// every retry went out at once, while `config explain` counted the microseconds.
    #[test]
    fn a_base_delay_below_a_millisecond_is_refused() {
        let mut p = PolicyConfig::default();
        p.retry.base_delay = Duration::from_micros(500);
        assert_eq!(
            p.validate(),
            vec!["retry.base_delay must be at least 1ms, not 500us".to_string()]
        );
        p.retry.base_delay = Duration::ZERO;
        assert_eq!(
            p.validate(),
            vec!["retry.base_delay must be at least 1ms, not 0s".to_string()]
        );
        p.retry.base_delay = ms(1);
        assert!(p.validate().is_empty(), "{:?}", p.validate());
        assert_eq!(super::super::backoff::cap(&p.retry, 1), ms(1));
    }

    /// Every policy duration is bounded: `open_for: 99999999999999d` passed `rules check`
    /// and panicked the delivery task when the breaker opened (an overflowing sum).
    #[test]
    fn durations_past_ten_years_are_refused() {
        let huge = Duration::from_secs(99_999_999_999_999 * 86_400);
        let p = PolicyConfig {
            timeout: huge,
            retry: RetryPolicy {
                base_delay: huge,
                max_delay: huge,
                max_age: huge,
                retry_after_max: huge,
                ..RetryPolicy::default()
            },
            breaker: Some(BreakerPolicy {
                window: huge,
                open_for: huge,
                ..BreakerPolicy::default()
            }),
            ..PolicyConfig::default()
        };
        let problems = p.validate();
        for field in [
            "timeout",
            "retry.base_delay",
            "retry.max_delay",
            "retry.max_age",
            "retry.retry_after_max",
            "breaker.window",
            "breaker.open_for",
        ] {
            assert!(
                problems
                    .iter()
                    .any(|m| m.starts_with(&format!("{field} must be at most 10 years"))),
                "{field}: {problems:?}"
            );
        }
        assert_eq!(problems.len(), 7, "{problems:?}");
        let at_bound = PolicyConfig {
            retry: RetryPolicy {
                max_age: MAX_POLICY_DURATION,
                ..RetryPolicy::default()
            },
            ..PolicyConfig::default()
        };
        assert!(at_bound.validate().is_empty(), "{:?}", at_bound.validate());
    }

    #[test]
    fn worst_case_default_policy() {
        // 5 attempts of 10s + waits 200ms, 400ms, 800ms, 1.6s.
        let (n, t) = PolicyConfig::default().worst_case();
        assert_eq!(n, 5);
        assert_eq!(t, Duration::from_secs(50) + ms(3000));
    }

    #[test]
    fn worst_case_caps_backoff_at_max_delay() {
        let p = PolicyConfig {
            timeout: Duration::from_secs(1),
            retry: RetryPolicy {
                max_attempts: 10,
                base_delay: Duration::from_secs(1),
                max_delay: Duration::from_secs(10),
                ..RetryPolicy::default()
            },
            ..PolicyConfig::default()
        };
        // waits: 1,2,4,8,10,10,10,10,10 = 65s; attempts 10s.
        assert_eq!(p.worst_case(), (10, Duration::from_secs(75)));
    }

    #[test]
    fn worst_case_is_capped_by_max_age() {
        let mut p = PolicyConfig::default();
        p.retry.max_attempts = 1000;
        p.retry.max_age = Duration::from_secs(600);
        // The last attempt may start at 600 s and run its 10 s timeout.
        assert_eq!(p.worst_case(), (1000, Duration::from_secs(610)));
        p.retry.max_attempts = 1;
        assert_eq!(p.worst_case(), (1, Duration::from_secs(10)));
        p.retry.max_attempts = 0;
        assert_eq!(p.worst_case(), (0, Duration::ZERO));
    }

    #[test]
    fn worst_case_counts_retry_after_and_the_attempts_max_age_allows() {
        // The default policy: 53 s on backoff alone; with Retry-After (up to 1 h) before each
        // of the 4 retries, 4 h 50 s.
        let p = PolicyConfig::default();
        assert_eq!(
            p.worst_case_with_retry_after(),
            Duration::from_secs(4 * 3600 + 50)
        );
        // A helper's case: 5 attempts, backoff 100-200 ms, retry_after_max 3 s, timeout 10 s.
        let mut p = PolicyConfig::default();
        p.retry.max_attempts = 5;
        p.retry.base_delay = ms(100);
        p.retry.max_delay = ms(200);
        p.retry.retry_after_max = Duration::from_secs(3);
        assert_eq!(p.worst_case_with_retry_after(), Duration::from_secs(62));
        // 100 attempts a second apart (no jitter) in a max_age of 3 s: 4 attempts run (at 0,
        // 1, 2 and 3 s when each fails at once: one due at max_age itself is sent).
        let mut p = PolicyConfig::default();
        p.retry.max_attempts = 100;
        p.retry.base_delay = Duration::from_secs(1);
        p.retry.max_delay = Duration::from_secs(1);
        p.retry.jitter = Jitter::None;
        p.retry.max_age = Duration::from_secs(3);
        assert_eq!(p.worst_case().0, 4);
        // Full jitter can wait nothing: every attempt may run.
        p.retry.jitter = Jitter::Full;
        assert_eq!(p.worst_case().0, 100);
        // Equal jitter waits at least half: 0, 0.5, 1, 1.5, 2, 2.5, 3 s.
        p.retry.jitter = Jitter::Equal;
        assert_eq!(p.worst_case().0, 7);
    }

    /// The worst case by walking every attempt, as it was computed before: the reference the
    /// closed form must agree with.
    fn walked_worst_case(p: &PolicyConfig, retry_after: bool) -> (u32, Duration) {
        let r = &p.retry;
        let shortest_wait = |n: u32| match r.jitter {
            Jitter::Full => Duration::ZERO,
            Jitter::Equal => r.max_backoff(n) / 2,
            Jitter::None => r.max_backoff(n),
        };
        let mut attempts = r.max_attempts;
        let mut start = Duration::ZERO;
        for n in 0..r.max_attempts {
            if n > 0 && start > r.max_age {
                attempts = n;
                break;
            }
            start = start.saturating_add(shortest_wait(n));
        }
        let cap = r.max_age.saturating_add(p.timeout);
        let mut total = Duration::ZERO;
        for n in 0..attempts {
            total = total.saturating_add(p.timeout);
            if n + 1 < attempts {
                let wait = r.max_backoff(n);
                let wait = if retry_after {
                    wait.max(r.retry_after_max)
                } else {
                    wait
                };
                total = total.saturating_add(wait);
            }
        }
        (attempts, total.min(cap))
    }

    proptest::proptest! {
        #[test]
        fn the_worst_case_without_walking_every_attempt_agrees_with_the_walk(
            max_attempts in 0u32..3000,
            timeout_ms in 1u64..20_000,
            base_ns in 1u64..5_000_000_000,
            max_delay_factor in 1u64..100_000,
            max_age_ms in 1u64..100_000_000,
            retry_after_ms in 0u64..100_000,
            jitter in proptest::sample::select(vec![Jitter::Full, Jitter::Equal, Jitter::None]),
        ) {
            let p = PolicyConfig {
                timeout: ms(timeout_ms),
                retry: RetryPolicy {
                    max_attempts,
                    base_delay: Duration::from_nanos(base_ns),
                    max_delay: Duration::from_nanos(base_ns.saturating_mul(max_delay_factor)),
                    jitter,
                    max_age: ms(max_age_ms),
                    retry_after_max: ms(retry_after_ms),
                },
                ..PolicyConfig::default()
            };
            let walked = walked_worst_case(&p, false);
            proptest::prop_assert_eq!(p.worst_case(), walked);
            proptest::prop_assert_eq!(
                p.worst_case_with_retry_after(),
                walked_worst_case(&p, true).1
            );
        }
    }

    /// `max_attempts: 4294967295` made `config explain` walk every attempt (4 minutes), and
    /// `GET /v1/targets` took 11 s with 10^8; now such a policy is refused, and the worst case
    /// of one (a target's stored last configuration) is computed without the walk.
    #[test]
    fn max_attempts_is_capped_and_a_huge_one_costs_no_walk() {
        let mut p = PolicyConfig::default();
        p.retry.max_attempts = MAX_ATTEMPTS;
        assert!(p.validate().is_empty(), "{:?}", p.validate());
        p.retry.max_attempts = MAX_ATTEMPTS + 1;
        assert_eq!(
            p.validate(),
            vec![format!(
                "retry.max_attempts must be at most {MAX_ATTEMPTS}, not {}",
                MAX_ATTEMPTS + 1
            )]
        );
        p.retry.max_attempts = u32::MAX;
        p.retry.jitter = Jitter::Full;
        let started = std::time::Instant::now();
        // Full jitter may wait nothing: every attempt can run, each bounded by max_age.
        assert_eq!(
            p.worst_case(),
            (u32::MAX, Duration::from_secs(24 * 3600 + 10))
        );
        p.retry.jitter = Jitter::None;
        // 200ms doubling to 30 s (7.8 s of waits before the cap), then one every 30 s.
        assert_eq!(p.worst_case().0, 2887);
        assert_eq!(
            p.worst_case_with_retry_after(),
            Duration::from_secs(24 * 3600 + 10)
        );
        // The walk took minutes; generously bounded for a loaded machine.
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }

    /// A batching webhook's window may hold each attempt back for more events: `config
    /// explain` and `/v1/targets` left it out.
    #[test]
    fn a_batch_window_is_added_to_every_attempt() {
        // The default policy: 5 attempts of 10 s, waits of 3 s in all; with a 1 m window,
        // each of the 5 attempts may wait a minute first.
        let p = PolicyConfig::default();
        let window = Duration::from_secs(60);
        assert_eq!(
            p.worst_case_lingering(window),
            (5, Duration::from_secs(53 + 5 * 60))
        );
        assert_eq!(
            p.worst_case_with_retry_after_lingering(window),
            Duration::from_secs(4 * 3600 + 50 + 5 * 60)
        );
        assert_eq!(p.worst_case_lingering(Duration::ZERO), p.worst_case());
        // Capped by max_age plus the longer of the timeout and the window: an entry still in
        // the window at max_age is dead-lettered unsent when it ends.
        let mut p = PolicyConfig::default();
        p.retry.max_age = Duration::from_secs(100);
        assert_eq!(p.worst_case_lingering(window).1, Duration::from_secs(160));
    }

    #[test]
    fn max_backoff_saturates() {
        let r = RetryPolicy::default();
        assert_eq!(r.max_backoff(0), ms(200));
        assert_eq!(r.max_backoff(3), ms(1600));
        assert_eq!(r.max_backoff(40), Duration::from_secs(30));
        assert_eq!(r.max_backoff(u32::MAX), Duration::from_secs(30));
    }

    #[test]
    fn ordering_key_extracts() {
        let ev = json!({"partitionkey": "p1", "data": {"order_id": 42, "n": null}});
        assert_eq!(OrderingKey::PartitionKey.extract(&ev), Some("p1".into()));
        let k = OrderingKey::try_from("$.data.order_id".to_string()).expect("path");
        assert_eq!(k.extract(&ev), Some("42".into()));
        assert_eq!(k.to_string(), "$.data.order_id");
        let n = OrderingKey::try_from("$.data.n".to_string()).expect("path");
        assert_eq!(n.extract(&ev), None);
        let m = OrderingKey::try_from("$.data.missing".to_string()).expect("path");
        assert_eq!(m.extract(&ev), None);
        assert_eq!(OrderingKey::PartitionKey.extract(&json!({})), None);
    }

    /// Equal JSON values give equal keys: object members in any order, numbers in any
    /// spelling of one value. Strings, integers and fractional numbers keep the text they had
    /// (keys of entries queued across an upgrade stay the same).
    #[test]
    fn ordering_keys_of_equal_json_values_are_equal() {
        let k = OrderingKey::try_from("$.data.k".to_string()).expect("path");
        let key = |raw: &str| {
            let ev: crate::event::CloudEvent = serde_json::from_str(&format!(
                r#"{{"id":"1","source":"/s","type":"t","data":{{"k":{raw}}}}}"#
            ))
            .expect("event");
            let from_fields = k.extract_event(&ev);
            assert_eq!(from_fields, k.extract(&ev.to_json()), "{raw}");
            from_fields.expect("a key")
        };
        for (a, b) in [
            (r#"{"a":1,"b":2}"#, r#"{"b":2,"a":1}"#),
            (
                r#"{"x":{"b":[1,{"d":1,"c":2}],"a":null}}"#,
                r#"{"x":{"a":null,"b":[1.0,{"c":2,"d":1}]}}"#,
            ),
            ("1.0", "1"),
            ("1e2", "100"),
            ("-0.0", "0"),
            ("2.50", "2.5"),
        ] {
            assert_eq!(key(a), key(b), "{a} and {b}");
        }
        assert_eq!(key(r#"{"a":1,"b":2}"#), r#"{"a":1,"b":2}"#);
        assert_ne!(key("[1,2]"), key("[2,1]"), "an array's order is its value");
        // As before: strings exactly as sent, integers and fractions as JSON writes them.
        assert_eq!(key(r#""Ab 1.0 ""#), "Ab 1.0 ");
        assert_eq!(key("42"), "42");
        assert_eq!(key("-7"), "-7");
        assert_eq!(key("18446744073709551615"), "18446744073709551615");
        assert_eq!(key("1.5"), "1.5");
        assert_eq!(key("true"), "true");
    }

    /// A key past `MAX_ORDERING_KEY_BYTES` is its digest (fixed size, equal for equal keys,
    /// short enough for a release URL), read from fields or from the structured form; one
    /// at the limit stays as it is.
    #[test]
    fn a_long_ordering_key_is_replaced_by_its_digest() {
        let at_limit = "k".repeat(MAX_ORDERING_KEY_BYTES);
        let long = format!("{at_limit}+");
        let other = format!("{at_limit}-");
        assert_eq!(bounded_key(at_limit.clone()), at_limit);
        let digest = bounded_key(long.clone());
        assert_eq!(digest.len(), "sha256:".len() + 64, "{digest}");
        assert!(digest.starts_with("sha256:"), "{digest}");
        assert_eq!(
            bounded_key(long.clone()),
            digest,
            "the same key, the same digest"
        );
        assert_ne!(bounded_key(other), digest);
        let ev: crate::event::CloudEvent = serde_json::from_value(json!({
            "id": "1", "source": "/s", "type": "t", "extensions": {"partitionkey": long},
            "data": {"order_id": long, "customer": {"name": long}}
        }))
        .expect("event");
        for path in ["partitionkey", "$.data.order_id"] {
            let k = OrderingKey::try_from(path.to_string()).expect("key");
            assert_eq!(
                k.extract_event(&ev).as_deref(),
                Some(digest.as_str()),
                "{path}"
            );
            assert_eq!(
                k.extract(&ev.to_json()).as_deref(),
                Some(digest.as_str()),
                "{path}"
            );
        }
        let object = OrderingKey::try_from("$.data.customer".to_string()).expect("key");
        let key = object.extract_event(&ev).expect("a key");
        assert!(
            key.starts_with("sha256:"),
            "an object's long text too: {key}"
        );
    }
}
