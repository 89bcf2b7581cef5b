//! The router's configuration: embedded defaults → TOML file → `ROUTER_*` environment →
//! command-line flags, validated once so the rest of the code reads typed values.
//!
//! Every key has a default; unknown keys are an error that names the key. Environment
//! variables map onto keys by lower-casing and splitting on `__`:
//! `ROUTER_INGEST__MAX_BATCH=500` sets `[ingest] max_batch`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A configuration problem, with the key or file it concerns.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The TOML (after env overrides) does not fit the schema: unknown key, wrong type.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address of the HTTP API (default `127.0.0.1:8080`).
    pub listen: SocketAddr,
    /// Directory of the embedded store (default `./data`).
    pub data_dir: PathBuf,
    /// Directory of rule files (default `./rules`). A configured one that does not exist
    /// stops the start; the default may be absent (no rules, with a warning).
    pub rules_dir: PathBuf,
    /// Directory of contracts (default `./contracts`). A configured one that does not exist
    /// stops the start; the default may be absent (no contracts).
    pub contracts_dir: PathBuf,
    /// How long SIGTERM waits for in-flight attempts before exiting (default 10s).
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// Log output: `text` or `json`.
    pub log_format: LogFormat,
    /// Producer-facing limits and dedup.
    pub ingest: IngestConfig,
    /// Delivery workers.
    pub delivery: DeliveryConfig,
    /// Storage.
    pub store: StoreConfig,
    /// Archive (for replay).
    pub archive: ArchiveConfig,
    /// Authentication.
    pub auth: AuthConfig,
    /// WASM handlers.
    pub handlers: HandlersConfig,
    /// HTTP server limits.
    pub server: ServerConfig,
    /// The NATS connection of `nats:` targets.
    pub nats: NatsConfig,
    /// Optional TOML file of secrets (`NAME = "value"`) that `secret_env` names resolve in,
    /// after the environment. Never the rule files.
    pub secrets_file: Option<PathBuf>,
    /// A rule file's `secret_env` and `headers_env` names are read from the environment only
    /// if they start with it (names outside it resolve in `secrets_file` only), so that
    /// whoever edits rule files cannot have the router send the rest of its environment
    /// (cloud credentials) as a header to a URL they name. (The loader adds two fences: no
    /// secret the configuration names, see [`Config::operator_secrets`], and one URL origin
    /// per secret name, so another target's secret cannot be copied to another URL.) Default [`DEFAULT_SECRETS_ENV_PREFIX`]; empty: any name (the rule
    /// files' authors are trusted with the router's whole environment).
    pub secrets_env_prefix: String,
    /// Where this configuration was read from, so that a reload can read it again (`router
    /// serve` sets it; a configuration built in code has none). Not a key.
    #[serde(skip)]
    pub origin: Option<ConfigOrigin>,
}

/// Where `router serve` read its configuration: the file, and the command-line flags that
/// override it (the environment is read again as it is).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ConfigOrigin {
    /// `--config`.
    pub file: Option<PathBuf>,
    /// `--listen`.
    pub listen: Option<SocketAddr>,
    /// `--data-dir`.
    pub data_dir: Option<PathBuf>,
    /// `--rules`.
    pub rules_dir: Option<PathBuf>,
    /// `--contracts`.
    pub contracts_dir: Option<PathBuf>,
}

impl ConfigOrigin {
    /// Reads the configuration: the file (or the defaults), the `ROUTER_*` environment, then
    /// the flags. Returns it with its warnings.
    pub fn load(&self) -> Result<(Config, Vec<String>), ConfigError> {
        let (mut cfg, warnings) =
            Config::load_with_warnings(self.file.as_deref(), Config::env_vars())?;
        if let Some(l) = self.listen {
            cfg.listen = l;
        }
        if let Some(d) = &self.data_dir {
            cfg.data_dir.clone_from(d);
        }
        if let Some(r) = &self.rules_dir {
            cfg.rules_dir.clone_from(r);
        }
        if let Some(c) = &self.contracts_dir {
            cfg.contracts_dir.clone_from(c);
        }
        cfg.origin = Some(self.clone());
        Ok((cfg, warnings))
    }
}

/// The keys whose values differ between two configurations (`delivery.max_in_flight`,
/// `auth.tokens`): arrays and values compared whole, never printed (a key's value may be a
/// credential's hash).
pub fn changed_keys(a: &Config, b: &Config) -> Vec<String> {
    fn walk(a: &serde_json::Value, b: &serde_json::Value, path: &str, out: &mut Vec<String>) {
        match (a, b) {
            (serde_json::Value::Object(x), serde_json::Value::Object(y)) => {
                let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
                for k in keys {
                    let p = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}.{k}")
                    };
                    let null = serde_json::Value::Null;
                    walk(
                        x.get(k).unwrap_or(&null),
                        y.get(k).unwrap_or(&null),
                        &p,
                        out,
                    );
                }
            }
            (x, y) if x != y => out.push(path.to_string()),
            _ => {}
        }
    }
    let mut out = Vec::new();
    match (serde_json::to_value(a), serde_json::to_value(b)) {
        (Ok(x), Ok(y)) => walk(&x, &y, "", &mut out),
        // Not expected (a configuration always serializes): said rather than hidden.
        _ => out.push("(the configuration could not be compared)".to_string()),
    }
    out
}

/// The default `secrets_env_prefix`. Not `ROUTER_…`: those variables are configuration keys.
pub const DEFAULT_SECRETS_ENV_PREFIX: &str = "WEBHOOK_SECRET_";

/// `[handlers]`: limits of every handler invocation and where handlers are kept.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HandlersConfig {
    /// Directory of uploaded handlers and the compiled-code cache (default `<data_dir>/handlers`).
    pub dir: Option<PathBuf>,
    /// Linear memory cap per invocation.
    pub memory_bytes: usize,
    /// Wall-clock timeout per invocation (epoch interruption), for every handler; a handler
    /// target's policy `timeout` bounds its attempts further (an invocation gets whichever is
    /// shorter, less the time its attempt waited for a free instance).
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Optional fuel per invocation.
    pub fuel: Option<u64>,
    /// Most events one invocation may emit.
    pub max_emitted: usize,
    /// Most bytes of emitted events per invocation (type, subject, datacontenttype, data,
    /// extension names and values).
    pub max_output_bytes: usize,
    /// Most log bytes captured per invocation.
    pub max_log_bytes: usize,
    /// Most key-value operations per invocation (default 1,000): keys written or deleted,
    /// each counted once however often it is rewritten, plus compare-and-set checks. Each is
    /// one operation of the commit that acks the delivery, on the store's single writer that
    /// ingest shares: past it the invocation fails as `handler_limit` (not retried).
    pub max_kv_ops: usize,
    /// Emitted events past this many handler hops go to the DLQ as `loop_detected`.
    pub hop_limit: u32,
    /// Invocations alive at once, at least 1 (the pooling allocator holds two more instances, for the
    /// `describe` checks of uploads and rollbacks).
    pub max_instances: u32,
    /// At start, upload every `<name>.wasm` of this directory as handler `<name>`, unless
    /// those bytes are already a stored version (then it is left as it is, so a restart does
    /// not undo a rollback). For demos and tests; teams use the API.
    pub preload_dir: Option<PathBuf>,
    /// Largest component accepted by `PUT /v1/handlers/{name}` (413 past it).
    pub max_upload_bytes: usize,
    /// How long a handler's COMPLETED record (delivery key → stored result) is kept: a
    /// delivery with the same idempotency key inside it gets the stored result and the handler
    /// is not run again. The age bound of the idempotency records.
    #[serde(with = "humantime_serde")]
    pub completed_ttl: Duration,
    /// Bound on each handler's key-value namespace, in bytes of keys plus values plus 64 per
    /// key for what an entry costs the store beyond them (default 64 MiB). A write that would pass it fails the invocation (retried; deleting keys or
    /// letting TTLs expire makes room). Usage: `router_handler_kv_bytes`, `/v1/status`.
    pub kv_max_bytes: u64,
    /// Bytes of captured log lines kept on disk per handler (`GET /v1/handlers/{name}/logs`);
    /// the oldest half is dropped when it fills. Default 2 MiB.
    pub log_retain_bytes: u64,
    /// Invocations of one handler running at once; 0 (default) means the number of CPUs.
    /// Deliveries to the handler still overlap their store work (`delivery.handler_concurrency`);
    /// only the CPU-bound invocation waits here, so a handler that loops until its timeout
    /// cannot take every core from the others. A delivery that waits longer than its policy
    /// timeout is put back for a second (`handler_busy`) without spending an attempt.
    pub running_per_handler: usize,
    /// Versions kept per handler (default 10, at least 1). An upload past it forgets the oldest
    /// version and removes its component; the active version is always kept. Rollback reaches
    /// the versions kept.
    pub keep_versions: usize,
}

impl Default for HandlersConfig {
    fn default() -> Self {
        Self {
            dir: None,
            memory_bytes: 64 << 20,
            timeout: Duration::from_secs(5),
            fuel: None,
            max_emitted: 100,
            max_output_bytes: 1 << 20,
            max_log_bytes: 64 << 10,
            max_kv_ops: 1_000,
            hop_limit: 8,
            max_instances: 64,
            preload_dir: None,
            max_upload_bytes: 64 << 20,
            completed_ttl: Duration::from_secs(7 * 24 * 3600),
            kv_max_bytes: 64 << 20,
            log_retain_bytes: 2 << 20,
            running_per_handler: 0,
            keep_versions: crate::wasm::registry::DEFAULT_KEEP_VERSIONS,
        }
    }
}

/// `[nats]`: the one connection every `nats:` target publishes through. The router opens it
/// only when the rules have a `nats:` target, and keeps retrying it in the background while
/// the server is down (those targets' attempts then fail as retryable and their entries wait
/// in their queues).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsConfig {
    /// Server URL (`nats://host:port`, or `tls://` for TLS); several, comma-separated, for a
    /// cluster. Default `nats://127.0.0.1:4222`.
    pub url: String,
    /// What a delivered attempt means: `auto` (default), `jetstream` or `core`; see [`NatsAck`].
    pub ack: NatsAck,
    /// How long one connection attempt (TCP, TLS and the NATS handshake) may take, and how
    /// long a delivery attempt waits for a connection being (re)made before it fails as
    /// retryable. Default 2s.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// A NATS `.creds` file (user JWT and NKey seed) to authenticate with. Unset = none.
    /// Must exist at start, as the `tls_*` files must.
    pub credentials_file: Option<PathBuf>,
    /// Name of the environment variable (or `secrets_file` entry) holding a token to
    /// authenticate with; the token itself is never in a config or rule file. Unset = none.
    /// A variable not set keeps every `nats:` target from starting, as a webhook's missing
    /// secret does: their entries wait in their queues (no attempt spent) until a reload
    /// after it is set.
    pub token_env: Option<String>,
    /// User name to authenticate with, together with `password_env`. Unset = none. (A user
    /// and password in `url` are refused: the client would not send them, and the URL is
    /// shown in `/v1/status`, metric labels and logs.)
    pub user: Option<String>,
    /// Name of the environment variable (or `secrets_file` entry) holding `user`'s password.
    /// Not set: as for `token_env`, the `nats:` targets do not start and their entries wait.
    pub password_env: Option<String>,
    /// PEM file of the CA(s) the server's certificate must chain to, instead of the system's
    /// roots. Any `tls_*` key makes TLS required (as a `tls://` URL does). Unset = the system's.
    pub tls_ca_file: Option<PathBuf>,
    /// PEM client certificate for servers that verify clients (mTLS), with `tls_key_file`.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            url: "nats://127.0.0.1:4222".into(),
            ack: NatsAck::Auto,
            connect_timeout: Duration::from_secs(2),
            credentials_file: None,
            token_env: None,
            user: None,
            password_env: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
        }
    }
}

impl NatsConfig {
    /// The server addresses of `url`.
    pub fn server_addrs(&self) -> Result<Vec<async_nats::ServerAddr>, String> {
        server_addrs("nats.url", &self.url)
    }

    /// The authentication and TLS keys, validated and applied as `[store.jetstream]`'s are.
    pub fn auth(&self) -> crate::nats_auth::NatsAuth {
        crate::nats_auth::NatsAuth {
            section: "nats",
            credentials_file: self.credentials_file.clone(),
            token_env: self.token_env.clone(),
            user: self.user.clone(),
            password_env: self.password_env.clone(),
            tls_ca_file: self.tls_ca_file.clone(),
            tls_cert_file: self.tls_cert_file.clone(),
            tls_key_file: self.tls_key_file.clone(),
        }
    }
}

/// The server addresses of a comma-separated list of NATS URLs (config key `key`, named in
/// errors).
pub fn server_addrs(key: &str, urls: &str) -> Result<Vec<async_nats::ServerAddr>, String> {
    urls.split(',')
        .map(str::trim)
        .map(|u| {
            let shown = without_userinfo(u);
            let addr: async_nats::ServerAddr =
                u.parse().map_err(|e| format!("{key} `{shown}`: {e}"))?;
            // async-nats parses a URL's user and password but never sends them, and the URL
            // is shown in /v1/status, metric labels, logs and attempt errors (which teams read
            // in the DLQ): refused rather than redacted everywhere.
            if addr.has_user_pass() || u.contains('@') {
                let s = key.strip_suffix(".url").unwrap_or(key);
                return Err(format!(
                    "{key} `{shown}`: credentials in the URL are refused (they would be shown in \
                     status, metrics and logs, and are not sent); set {s}.user and \
                     {s}.password_env (or {s}.token_env, {s}.credentials_file)"
                ));
            }
            // The client is built without websocket support.
            if !matches!(addr.scheme(), "nats" | "tls") {
                return Err(format!(
                    "{key} `{shown}`: only nats:// and tls:// servers are supported"
                ));
            }
            Ok(addr)
        })
        .collect()
}

/// `url` with any user information (`user:password@`) replaced by `***@`, for error texts.
fn without_userinfo(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => {
            let sep = if scheme.is_empty() { "" } else { "://" };
            format!("{scheme}{sep}***{}", &rest[at..])
        }
        None => url.to_string(),
    }
}

/// `nats.ack`: when a `nats:` attempt counts as delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum NatsAck {
    /// Publish through JetStream and wait for the stream's acknowledgement; where no stream
    /// captures the subject, publish as core NATS instead (delivered once the server has it,
    /// whether or not anyone subscribes).
    #[default]
    #[serde(rename = "auto")]
    Auto,
    /// Publish through JetStream only: where no stream captures the subject the attempt fails
    /// (retryable), so entries wait until an operator creates the stream.
    #[serde(rename = "jetstream")]
    JetStream,
    /// Core NATS only: delivered once the server has the message (publish and flush).
    #[serde(rename = "core")]
    Core,
}

/// `[auth]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Bearer tokens (`[[auth.tokens]]` with name, sha256, scopes, rate_per_sec).
    pub tokens: Vec<crate::auth::TokenConfig>,
    /// Allow serving on a non-loopback address without tokens. Off by default.
    pub insecure: bool,
}

/// `[server]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// A connection must send its request headers within this time (slow-loris).
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// A whole request (body included) must arrive within this time.
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// Largest request head (request line + headers) accepted.
    pub max_header_bytes: usize,
    /// Open client connections at most; past it a new connection is answered 503 with
    /// `Retry-After` and closed, so that the router keeps file descriptors for its store and
    /// deliveries. 0 (default): half the process's open-file limit, at least 64.
    pub max_connections: usize,
    /// A second address (default none) that answers only `/healthz`, `/readyz` and `/metrics`,
    /// with its own connection cap (`ops_max_connections`), so that liveness probes and
    /// scrapes are never refused because producers hold every one of `max_connections`, and
    /// an orchestrator does not restart a router that is only busy. The main address answers
    /// them as well. Auth applies as on the main address (`/metrics` needs `read` when tokens
    /// are set), and a non-loopback address without tokens needs `auth.insecure`, as `listen`.
    pub ops_listen: Option<SocketAddr>,
    /// Open connections at most on `ops_listen` (default 64); past it a new connection gets
    /// 503 and is closed, as on the main address.
    pub ops_max_connections: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            max_header_bytes: 64 * 1024,
            max_connections: 0,
            ops_listen: None,
            ops_max_connections: 64,
        }
    }
}

impl ServerConfig {
    /// `max_connections` as applied: the configured value, or half the process's soft
    /// open-file limit (at least 64) when it is 0.
    pub fn connection_limit(&self) -> usize {
        if self.max_connections > 0 {
            return self.max_connections;
        }
        // No limit (or none known): a bound all the same, as a soft limit of 2^17 gives.
        let files = open_file_limit().unwrap_or(1 << 17);
        usize::try_from(files / 2).unwrap_or(usize::MAX).max(64)
    }
}

/// `[archive]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ArchiveConfig {
    /// How long accepted events are kept for replay. Default 7 days.
    #[serde(with = "humantime_serde")]
    pub retention: Duration,
}

impl Default for ArchiveConfig {
    fn default() -> Self {
        Self {
            retention: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// `[ingest]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IngestConfig {
    /// Largest request body accepted (413 past it). Default 1 MiB.
    pub max_body_bytes: usize,
    /// Deepest JSON nesting accepted (400 past it). Default 64.
    pub max_json_depth: usize,
    /// Most events in one batch request (413 past it). Default 1000.
    pub max_batch: usize,
    /// How long (`source`, `id`) is remembered for dedup. Default 24h.
    #[serde(with = "humantime_serde")]
    pub dedup_window: Duration,
    /// Request bytes ingest holds at once: bodies being read, checked or waiting for their
    /// commit, each counted as its bytes arrive (a slow upload holds only what it sent). A
    /// piece that finds no room waits up to `admission_wait`, then the request is answered
    /// 503 with `Retry-After`: back-pressure instead of latency that grows with the
    /// producers. One request at a time may read past it, by at most `max_body_bytes`, so
    /// that partly read bodies cannot block each other; one request larger than this passes
    /// alone. Default 16 MiB.
    pub max_in_flight_bytes: usize,
    /// Events ingest holds at once: parsed, checked or waiting for their commit, counted
    /// once a request's body is parsed. A request that finds no room waits up to
    /// `admission_wait`, then is answered 503 with `Retry-After`: many small events cost
    /// time that a byte bound does not see. One request of more events than this passes
    /// alone. Default 8192 (about 0.4 s of work at the measured single-event rate).
    pub max_in_flight_events: usize,
    /// How long a request waits for room under `max_in_flight_bytes` or
    /// `max_in_flight_events` before its 503. Default 1s.
    #[serde(with = "humantime_serde")]
    pub admission_wait: Duration,
}

/// `[delivery]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeliveryConfig {
    /// Attempts in flight per webhook or NATS target unless its policy sets
    /// `throttle.max_concurrency`: how hard the router may press on a receiver.
    pub concurrency: usize,
    /// Deliveries in flight per handler target unless its policy sets
    /// `throttle.max_concurrency`. Higher than `concurrency` because the handler's CPU is
    /// bounded separately (`handlers.running_per_handler`): a delivery in flight is mostly
    /// waiting for its lease and ack to commit, and a target's throughput is about this many
    /// deliveries per commit cycle. Each holds its leased event in memory (twice: stored
    /// form and the JSON handed to the handler), so the worst case per handler target is
    /// about this many times twice the largest event. Default 128.
    pub handler_concurrency: usize,
    /// Delivery attempts in flight at most across all webhook and NATS targets together (each
    /// target still at most its own `concurrency`): each holds an outbound connection, so
    /// without a bound a router with many targets takes targets × `concurrency` descriptors
    /// and starves its own listener. Handler deliveries are not counted (no sockets; their CPU
    /// is bounded by `handlers.running_per_handler`). A target waiting for a permit leases
    /// nothing, so no attempt is spent waiting. Unset (default): a quarter of the process's
    /// open-file limit, at least 64 and at most 4096 ([`Self::in_flight_limit`]).
    pub max_in_flight: Option<usize>,
    /// Bytes of events that deliveries hold at once across all targets (webhook, NATS and
    /// handler): each leased entry holds its event until its attempt is recorded. A target
    /// whose next lease would pass it waits, leasing nothing (no attempt is spent waiting).
    /// One event is charged at most all of it, so the largest event is always deliverable.
    /// At least 1 MiB and at least `ingest.max_body_bytes`. Default 256 MiB.
    pub max_in_flight_bytes: usize,
    /// Added to a target's timeout to make its lease: a worker silent for longer loses it.
    #[serde(with = "humantime_serde")]
    pub lease_margin: Duration,
    /// Bytes of a webhook response body read (for the attempt's error text); rest discarded.
    pub max_response_bytes: usize,
    /// Extra root certificates (a PEM file) trusted for HTTPS webhooks, in addition to the
    /// system's roots: for receivers behind a private CA. Unset = system roots only.
    pub tls_ca_file: Option<std::path::PathBuf>,
    /// How often expired dedup keys and finished events are swept.
    #[serde(with = "humantime_serde")]
    pub sweep_interval: Duration,
    /// How long finished deliveries stay visible in an event's fate (at least the dedup window).
    #[serde(with = "humantime_serde")]
    pub retention: Duration,
    /// How long a redrive or replay job that ended (done or cancelled) stays listed; the
    /// newest job of each kind is always kept. Default 30 days.
    #[serde(with = "humantime_serde")]
    pub job_retention: Duration,
    /// What happens to the queued entries of a target that a reload removes: `drain` them
    /// under its last configuration (default), or `dead_letter` them as `target_removed`.
    pub on_target_removed: OnTargetRemoved,
    /// Threads of the delivery runtime, which runs every target's worker, its attempts and the
    /// handler invocations apart from ingest's threads. 0 (default) = one per CPU.
    pub threads: usize,
    /// Nice value (0–19) added to the delivery threads' priority, above ingest's (Linux;
    /// elsewhere ignored with a warning). Only matters when the CPUs are saturated: then the
    /// kernel gives ingest and the store committer the larger share, so producers keep getting
    /// quick 202s and delivery drains the queues behind them. Default 0 (off): nice values
    /// rank the router's delivery below every other process of its CPU scheduling group too,
    /// so on a host shared with busy processes delivery falls behind them; set 10 where the
    /// router has its CPUs to itself (its own container or systemd cgroup). See
    /// docs/operations.md.
    pub nice: u8,
    /// Hand new entries to delivery at acceptance (default on): when a target has a free slot,
    /// nothing due in its queue, a closed breaker, a token in its rate limit and no ordering,
    /// a new entry is written leased (its first attempt recorded as started) in the accept's
    /// own commit and sent at once, instead of waiting for its worker to lease it in a commit
    /// of its own. Saves one commit round trip and one read of the event per delivery. A
    /// batching webhook takes a request's entries this way only when they fill at least half
    /// a batch, as one batch. Off: every entry goes through its queue.
    pub handoff: bool,
}

/// See `DeliveryConfig::on_target_removed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnTargetRemoved {
    /// Keep delivering under the last configuration.
    #[default]
    Drain,
    /// Move the waiting entries to the DLQ.
    DeadLetter,
}

/// Which backend holds the router's durable state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoreBackend {
    /// The embedded redb file in `data_dir` (default).
    Redb,
    /// NATS JetStream (`[store.jetstream]`): several router nodes can share it. Needs
    /// nats-server 2.12+ with `sync_interval: always` or replicated streams
    /// (docs/jetstream-backend.md).
    Jetstream,
}

/// `[store.jetstream]`: where the JetStream backend keeps its records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JetStreamStoreConfig {
    /// Server URL; several, comma-separated, for a cluster (the client also learns the
    /// cluster's other servers from the one it reaches, and reconnects to them). Default
    /// `nats://127.0.0.1:4222`.
    pub url: String,
    /// Stream that holds the records (created when missing). Default `ROUTER_STORE`.
    pub stream: String,
    /// Subject prefix of the records. Default `router.store`.
    pub prefix: String,
    /// Stream replicas: 1 needs a server with `sync_interval: always` for "202 means on
    /// disk"; 3 keeps it through a quorum. Default 1.
    pub replicas: usize,
    /// Bound on each request to the server. Default 5s.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// A NATS `.creds` file (user JWT and NKey seed) to authenticate with. Unset = none.
    /// Must exist at start. The authentication and TLS keys mean what `[nats]`'s do.
    pub credentials_file: Option<PathBuf>,
    /// Name of the environment variable (or `secrets_file` entry) holding a token to
    /// authenticate with. Unset = none. Not set at start: the router does not start (the
    /// store is not optional), naming this key and the variable.
    pub token_env: Option<String>,
    /// User name to authenticate with, together with `password_env`. Unset = none. (A user
    /// and password in `url` are refused, as in `nats.url`.)
    pub user: Option<String>,
    /// Name of the environment variable (or `secrets_file` entry) holding `user`'s password.
    /// Not set at start: the router does not start, as for `token_env`.
    pub password_env: Option<String>,
    /// PEM file of the CA(s) the server's certificate must chain to, instead of the system's
    /// roots. Any `tls_*` key makes TLS required (as a `tls://` URL does).
    pub tls_ca_file: Option<PathBuf>,
    /// PEM client certificate for servers that verify clients (mTLS), with `tls_key_file`.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
}

impl Default for JetStreamStoreConfig {
    fn default() -> Self {
        Self {
            url: "nats://127.0.0.1:4222".into(),
            stream: "ROUTER_STORE".into(),
            prefix: "router.store".into(),
            replicas: 1,
            timeout: Duration::from_secs(5),
            credentials_file: None,
            token_env: None,
            user: None,
            password_env: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
        }
    }
}

impl JetStreamStoreConfig {
    /// The authentication and TLS keys, validated and applied as `[nats]`'s are.
    pub fn auth(&self) -> crate::nats_auth::NatsAuth {
        crate::nats_auth::NatsAuth {
            section: "store.jetstream",
            credentials_file: self.credentials_file.clone(),
            token_env: self.token_env.clone(),
            user: self.user.clone(),
            password_env: self.password_env.clone(),
            tls_ca_file: self.tls_ca_file.clone(),
            tls_cert_file: self.tls_cert_file.clone(),
            tls_key_file: self.tls_key_file.clone(),
        }
    }
}

/// `[store]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// `redb` (default) or `jetstream`.
    pub backend: StoreBackend,
    /// The JetStream backend's server and stream (used when `backend = "jetstream"`).
    pub jetstream: JetStreamStoreConfig,
    /// redb page cache, bytes. Default 256 MiB.
    pub cache_bytes: usize,
    /// The store file is compacted after a sweep when it is larger than this and more than
    /// half of it is free pages (e.g. after a backlog drained). Default 64 MiB.
    pub compact_min_bytes: u64,
    /// High-water mark of the store file: past it ingest answers 503 with Retry-After (until
    /// it is below `low_water_fraction` of this) while delivery goes on. 0 = no limit.
    pub max_disk_bytes: u64,
    /// Ingest resumes below this fraction of `max_disk_bytes`.
    pub low_water_fraction: f64,
    /// Make each commit group durable with one sequential write and sync of the group log
    /// (`router.log` and `router.log2` in the data dir, used in turn), checkpointed into the
    /// store file every `checkpoint_interval` or 16 MiB, instead of a synced store-file commit
    /// per group. Same guarantee (202 after the sync), and less work for the committer;
    /// the whole end-to-end suite passes with it on. Default false: on the machines measured
    /// so far it did not raise the issue benchmark's peak beyond the noise, and it lengthened
    /// the latency of large batches (docs/BENCHMARKS.md, thirtieth and thirty-first sessions).
    /// A log left by an earlier run is always applied at start, whatever this says.
    pub group_log: bool,
    /// With `group_log`: longest time between two checkpoints (a durable store-file commit,
    /// after which the log goes on in its other file). Each one writes the pages that the
    /// unsynced commits since the last left dirty, and the groups behind it wait (its sync
    /// runs behind them): a long interval is a long pause (measured: 50 ms doubled the p99 at
    /// half of the peak; 10 ms did not).
    /// 1 ms to 1 s.
    #[serde(with = "humantime_serde")]
    pub checkpoint_interval: Duration,
    /// Shortest time from the start of one store commit to the start of the next (like
    /// PostgreSQL's `commit_delay`). Under a moderate steady load the committer runs commits
    /// back to back that carry a few events each, and every commit costs a fixed amount of CPU
    /// and a sync; spacing them makes each carry more, at up to this much added latency. A
    /// commit after a quiet spell starts at once. Default 0 (commit as soon as anything waits).
    #[serde(with = "humantime_serde")]
    pub commit_delay: Duration,
    /// Keys in the dedup index's memtable past which it is written to disk as a sorted run
    /// before its hour is over (docs/dedup-index.md). Bounds its memory: about 60 bytes a key,
    /// ~60 MiB at the default 1,048,576. Smaller makes more runs, each a Bloom-filter probe
    /// per accept.
    pub dedup_memtable_keys: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            data_dir: PathBuf::from("./data"),
            rules_dir: PathBuf::from("./rules"),
            contracts_dir: PathBuf::from("./contracts"),
            shutdown_grace: Duration::from_secs(10),
            log_format: LogFormat::Text,
            ingest: IngestConfig::default(),
            delivery: DeliveryConfig::default(),
            store: StoreConfig::default(),
            archive: ArchiveConfig::default(),
            auth: AuthConfig::default(),
            handlers: HandlersConfig::default(),
            server: ServerConfig::default(),
            nats: NatsConfig::default(),
            secrets_file: None,
            secrets_env_prefix: DEFAULT_SECRETS_ENV_PREFIX.to_string(),
            origin: None,
        }
    }
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 1 << 20,
            max_json_depth: 64,
            max_batch: 1000,
            dedup_window: Duration::from_secs(24 * 3600),
            max_in_flight_bytes: 16 << 20,
            max_in_flight_events: 8192,
            admission_wait: Duration::from_secs(1),
        }
    }
}

/// The fewest and the most attempts in flight `delivery.max_in_flight` derives when unset.
pub const DERIVED_IN_FLIGHT: (usize, usize) = (64, 4096);

impl DeliveryConfig {
    /// `max_in_flight` as applied: the configured value, or [`derived_in_flight`] of the
    /// process's soft open-file limit.
    pub fn in_flight_limit(&self) -> usize {
        self.max_in_flight
            .unwrap_or_else(|| derived_in_flight(open_file_limit()))
    }
}

/// The process's soft open-file limit (`None`: unlimited or not known).
pub fn open_file_limit() -> Option<u64> {
    #[cfg(unix)]
    let files = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
    #[cfg(not(unix))]
    let files: Option<u64> = None;
    files
}

/// What [`raise_open_file_limit`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenFileLimit {
    /// The soft limit was raised from the first value to the second (the hard limit).
    Raised(u64, u64),
    /// The soft limit already was the hard limit (or unlimited).
    Unchanged(u64),
}

/// Raises the process's soft open-file limit to its hard limit, as Go's runtime and nginx do:
/// the soft default (1024 under systemd) is a compatibility setting for `select(2)`, which the
/// router never uses, and at it the router ran out of descriptors with a few hundred webhook
/// targets while the hard limit allowed twenty times more. Called at start, before
/// `server.max_connections` and `delivery.max_in_flight` are derived from the limit. An
/// unlimited hard limit is left alone (the kernel caps `RLIMIT_NOFILE` at `nr_open`, and
/// raising to infinity fails).
#[cfg(unix)]
pub fn raise_open_file_limit() -> Result<OpenFileLimit, std::io::Error> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let now = getrlimit(Resource::Nofile);
    let Some(current) = now.current else {
        return Ok(OpenFileLimit::Unchanged(u64::MAX));
    };
    match now.maximum {
        Some(max) if max > current => {
            setrlimit(
                Resource::Nofile,
                Rlimit {
                    current: Some(max),
                    maximum: Some(max),
                },
            )
            .map_err(std::io::Error::from)?;
            Ok(OpenFileLimit::Raised(current, max))
        }
        _ => Ok(OpenFileLimit::Unchanged(current)),
    }
}

/// The default `delivery.max_in_flight` for a soft open-file limit of `files`. The
/// descriptors are shared out so that outbound sockets can never take the listener's:
/// `server.max_connections` defaults to half the limit, in-flight attempts (one connection
/// each, at most) get a quarter, and the last quarter is left for the store's files, idle
/// pooled connections, the NATS connection, DNS and logs. At least 64 (a small limit would
/// otherwise leave a handful of targets one attempt at a time), at most 4096 (past a few thousand
/// requests in flight the router's CPU runs out before its descriptors do, and more
/// concurrency only turns into attempt timeouts charged to healthy receivers). Unknown or unlimited counts as 2^17, as
/// `server.max_connections` does.
pub fn derived_in_flight(files: Option<u64>) -> usize {
    let files = files.unwrap_or(1 << 17);
    usize::try_from(files / 4)
        .unwrap_or(usize::MAX)
        .clamp(DERIVED_IN_FLIGHT.0, DERIVED_IN_FLIGHT.1)
}

impl Default for DeliveryConfig {
    fn default() -> Self {
        Self {
            concurrency: 32,
            handler_concurrency: 128,
            max_in_flight: None,
            max_in_flight_bytes: 256 << 20,
            lease_margin: Duration::from_secs(30),
            max_response_bytes: 64 * 1024,
            tls_ca_file: None,
            sweep_interval: Duration::from_secs(60),
            retention: Duration::from_secs(24 * 3600),
            job_retention: Duration::from_secs(30 * 24 * 3600),
            on_target_removed: OnTargetRemoved::Drain,
            threads: 0,
            nice: 0,
            handoff: true,
        }
    }
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            backend: StoreBackend::Redb,
            jetstream: JetStreamStoreConfig::default(),
            cache_bytes: 256 << 20,
            compact_min_bytes: 64 << 20,
            max_disk_bytes: 50 << 30,
            low_water_fraction: 0.9,
            group_log: false,
            checkpoint_interval: Duration::from_millis(10),
            commit_delay: Duration::ZERO,
            dedup_memtable_keys: 1 << 20,
        }
    }
}

impl Config {
    /// The prefix a rule file's secret names need to be read from the environment; `None`:
    /// any name (`secrets_env_prefix = ""`).
    pub fn rule_secrets_prefix(&self) -> Option<String> {
        Some(self.secrets_env_prefix.clone()).filter(|p| !p.is_empty())
    }

    /// The secret variables this configuration names (config key, variable name): rule files
    /// may not name them, since a rule file's author chooses the URL a webhook's secrets go
    /// to. Every config key that names a secret variable belongs here.
    pub fn operator_secrets(&self) -> Vec<(&'static str, String)> {
        [
            ("nats.token_env", &self.nats.token_env),
            ("nats.password_env", &self.nats.password_env),
            ("store.jetstream.token_env", &self.store.jetstream.token_env),
            (
                "store.jetstream.password_env",
                &self.store.jetstream.password_env,
            ),
        ]
        .into_iter()
        .filter_map(|(key, var)| var.clone().map(|var| (key, var)))
        .collect()
    }

    /// Loads defaults, then `file` (if any), then `ROUTER_*` variables from `env`.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        Self::load_with_warnings(file, env).map(|(cfg, _)| cfg)
    }

    /// [`Config::load`], with what looks wrong but is valid, one line each (a duration in
    /// months: humantime's `M`, where minutes are `m`), for the caller to log or print.
    pub fn load_with_warnings(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<(Self, Vec<String>), ConfigError> {
        let mut table = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.to_path_buf(),
                    source,
                })?;
                toml::from_str::<toml::Table>(&text)
                    .map_err(|e| ConfigError::Invalid(format!("{}: {e}", path.display())))?
            }
            None => toml::Table::new(),
        };
        // Which variable set which key, to name it when the key's value is refused.
        let mut from_env: Vec<EnvKey> = Vec::new();
        for (k, v) in env {
            let Some(rest) = k.strip_prefix("ROUTER_") else {
                continue;
            };
            // The CLI clients' variables (`ROUTER_TOKEN`, `ROUTER_API`, …), which operators
            // export in the same shell: not configuration keys.
            if RESERVED_ENV.contains(&k.as_str()) {
                continue;
            }
            // What Kubernetes injects into every pod of a namespace with a Service named
            // `router`: not configuration, and read as keys it stopped the router.
            if is_kubernetes_service_link(&k, &v) {
                continue;
            }
            let path: Vec<String> = rest
                .to_ascii_lowercase()
                .split("__")
                .map(str::to_string)
                .collect();
            let value = parse_env_value(&v);
            let typed = !value.is_str();
            set_path(&mut table, &path, value)
                .map_err(|m| ConfigError::Invalid(format!("{k}: {m}")))?;
            from_env.push(EnvKey {
                key: path.join("."),
                path,
                var: k,
                raw: v,
                typed,
            });
        }
        let set_by = |key: &str| {
            from_env
                .iter()
                .find(|e| e.key == key)
                .map(|e| format!(" (set by {})", e.var))
                .unwrap_or_default()
        };
        let warnings: Vec<String> = DURATION_KEYS
            .iter()
            .filter_map(|key| {
                let text = lookup(&table, key)?.as_str()?;
                crate::policy::config::uses_month_unit(text).then(|| {
                    format!(
                        "{key} = \"{text}\" counts in months (`M`); minutes are `m` or `min`{}",
                        set_by(key)
                    )
                })
            })
            .collect();
        // Through serde_path_to_error, so a refused value names its key (`ingest.max_batch:
        // invalid type …`), and the variable when one set it.
        let cfg: Config = loop {
            let e = match serde_path_to_error::deserialize(toml::Value::Table(table.clone())) {
                Ok(cfg) => break cfg,
                Err(e) => e,
            };
            let key = e.path().to_string();
            let message = e.inner().message().to_string();
            // A variable's value that looks like a number or a boolean is read as one, but
            // the key may want text (`ROUTER_DATA_DIR=2024`): read it as the text it was.
            if message.starts_with("invalid type")
                && let Some(env) = from_env.iter_mut().find(|e| e.key == key && e.typed)
            {
                env.typed = false;
                set_path(&mut table, &env.path, toml::Value::String(env.raw.clone()))
                    .map_err(|m| ConfigError::Invalid(format!("{}: {m}", env.var)))?;
                continue;
            }
            // The variable that set the key, a table above it (`ROUTER_INGEST=1`) or a key
            // below it (`ROUTER_INGEST__MAX_BATCH__X=5` makes `max_batch` a table), or the
            // unknown key itself.
            let unknown = message
                .strip_prefix("unknown field `")
                .and_then(|m| m.split('`').next())
                .map(|field| match key.as_str() {
                    "." => field.to_string(),
                    parent => format!("{parent}.{field}"),
                });
            let var = from_env
                .iter()
                .find(|e| {
                    Some(&e.key) == unknown.as_ref()
                        || (key != "."
                            && (e.key == key
                                || key.starts_with(&format!("{}.", e.key))
                                // An element of an array the variable set
                                // (`auth.tokens[0].rate` of `ROUTER_AUTH__TOKENS`).
                                || key.starts_with(&format!("{}[", e.key))
                                || e.key.starts_with(&format!("{key}."))))
                })
                .map(|e| format!(" (set by {})", e.var))
                .unwrap_or_default();
            let key = if key == "." {
                String::new()
            } else {
                format!("{key}: ")
            };
            return Err(ConfigError::Invalid(format!("{key}{message}{var}")));
        };
        // A refused value names the variables that set the keys it is about.
        cfg.validate().map_err(|e| match e {
            ConfigError::Invalid(message) => {
                let vars: Vec<&str> = from_env
                    .iter()
                    .filter(|e| mentions(&message, &e.key))
                    .map(|e| e.var.as_str())
                    .collect();
                if vars.is_empty() {
                    ConfigError::Invalid(message)
                } else {
                    ConfigError::Invalid(format!("{message} (set by {})", vars.join(", ")))
                }
            }
            other => other,
        })?;
        Ok((cfg, warnings))
    }

    /// The process's `ROUTER_*` variables for [`Config::load`]. Variables whose name or value
    /// is not UTF-8 are left out (`std::env::vars` would panic on any, even one that has
    /// nothing to do with the router); a `ROUTER_*` one is reported on stderr.
    pub fn env_vars() -> Vec<(String, String)> {
        std::env::vars_os()
            .filter_map(|(k, v)| match (k.into_string(), v.into_string()) {
                (Ok(k), Ok(v)) => Some((k, v)),
                (Ok(k), Err(_)) if k.starts_with("ROUTER_") => {
                    crate::errln!("warning: {k} is not UTF-8; ignored");
                    None
                }
                _ => None,
            })
            .collect()
    }

    /// How long a stored event is kept. Events are the archive: the longest of the fate
    /// retention and the archive retention (replay reads them), and at least the dedup window.
    pub fn event_retention(&self) -> Duration {
        self.delivery
            .retention
            .max(self.archive.retention)
            .max(self.ingest.dedup_window)
    }

    /// Every duration key with its value, named as [`DURATION_KEYS`] names them.
    fn durations(&self) -> [(&'static str, Duration); DURATION_KEYS.len()] {
        let d = &self.delivery;
        let values = [
            self.shutdown_grace,
            self.ingest.dedup_window,
            self.ingest.admission_wait,
            d.lease_margin,
            d.sweep_interval,
            d.retention,
            d.job_retention,
            self.archive.retention,
            self.store.checkpoint_interval,
            self.store.commit_delay,
            self.store.jetstream.timeout,
            self.handlers.timeout,
            self.handlers.completed_ttl,
            self.server.header_read_timeout,
            self.server.request_timeout,
            self.nats.connect_timeout,
        ];
        std::array::from_fn(|i| (DURATION_KEYS[i], values[i]))
    }

    /// Checks values that the types alone do not rule out.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(m.to_string()));
        // Durations are added to timestamps in milliseconds (a dedup key's expiry, a lease's
        // end): far past any need, a typo such as `dedup_window = "99999999999d"` would
        // overflow them. The same ten years as a policy's durations.
        for (key, d) in self.durations() {
            if d > crate::policy::config::MAX_POLICY_DURATION {
                return bad(&format!(
                    "{key} must be at most 10 years (3650d), not {}",
                    crate::policy::config::format_duration(d)
                ));
            }
        }
        if self.ingest.max_body_bytes == 0 {
            return bad("ingest.max_body_bytes must be > 0");
        }
        if self.ingest.max_batch == 0 {
            return bad("ingest.max_batch must be > 0");
        }
        if self.ingest.max_in_flight_bytes == 0 {
            return bad("ingest.max_in_flight_bytes must be > 0");
        }
        if self.ingest.max_in_flight_events == 0 {
            return bad("ingest.max_in_flight_events must be > 0");
        }
        if self.ingest.max_json_depth == 0 || self.ingest.max_json_depth > MAX_JSON_DEPTH {
            return bad(&format!(
                "ingest.max_json_depth must be in 1..={MAX_JSON_DEPTH} (the JSON parser refuses deeper documents itself)"
            ));
        }
        // A bound on top: each is the width of a semaphore, and past tokio's MAX_PERMITS (2^61)
        // building it panicked (at start for the first two, in every handler delivery for
        // `running_per_handler`). Far below that, no receiver or host is served better.
        for (key, value, max) in [
            (
                "delivery.concurrency",
                self.delivery.concurrency,
                MAX_CONCURRENCY,
            ),
            (
                "delivery.handler_concurrency",
                self.delivery.handler_concurrency,
                MAX_CONCURRENCY,
            ),
        ] {
            if value == 0 || value > max {
                return bad(&format!("{key} must be in 1..={max}, not {value}"));
            }
        }
        if let Some(n) = self.delivery.max_in_flight
            && (n == 0 || n > MAX_CONCURRENCY)
        {
            return bad(&format!(
                "delivery.max_in_flight must be in 1..={MAX_CONCURRENCY}, not {n} (leave it out for a quarter of the open-file limit)"
            ));
        }
        // Smaller than the largest event ingest accepts, it would not bound that event's
        // delivery (one entry is charged at most the cap) but say something false.
        let min_bytes = (crate::deliver::bytes::MIN_BYTES as usize).max(self.ingest.max_body_bytes);
        if self.delivery.max_in_flight_bytes < min_bytes {
            return bad(&format!(
                "delivery.max_in_flight_bytes must be at least {min_bytes} (1 MiB and ingest.max_body_bytes: the largest event must be deliverable), not {}",
                self.delivery.max_in_flight_bytes
            ));
        }
        if self.handlers.running_per_handler > MAX_HANDLER_INSTANCES as usize {
            return bad(&format!(
                "handlers.running_per_handler must be in 0..={MAX_HANDLER_INSTANCES} (0 = the number of CPUs; no more invocations than handlers.max_instances can run), not {}",
                self.handlers.running_per_handler
            ));
        }
        if self.handlers.keep_versions == 0 {
            return bad("handlers.keep_versions must be at least 1");
        }
        // Each sweep reads the expiry indexes whether or not anything expired: "1ns" kept a
        // core 28 % busy on an idle router. Tests and demos sweep every 200ms.
        if self.delivery.sweep_interval < MIN_INTERVAL {
            return bad("delivery.sweep_interval must be at least 100ms");
        }
        // The lease must outlive the attempt's timeout by the time its ack takes to commit,
        // or a worker loses every lease it holds to a slow commit.
        if self.delivery.lease_margin < MIN_INTERVAL {
            return bad("delivery.lease_margin must be at least 100ms");
        }
        // Below these every request fails: 0 bytes of head answered each one 431, and a
        // zero timeout gives no client the time to send anything.
        if self.server.max_header_bytes < MIN_HEADER_BYTES {
            return bad(&format!(
                "server.max_header_bytes must be at least {MIN_HEADER_BYTES}"
            ));
        }
        if self.server.header_read_timeout < MIN_INTERVAL {
            return bad("server.header_read_timeout must be at least 100ms");
        }
        if self.server.request_timeout < MIN_INTERVAL {
            return bad("server.request_timeout must be at least 100ms");
        }
        if self.server.ops_max_connections == 0 {
            return bad("server.ops_max_connections must be at least 1");
        }
        // The same fixed address twice could never bind; say which keys collide.
        if let Some(ops) = self.server.ops_listen
            && ops == self.listen
            && ops.port() != 0
        {
            return bad(&format!(
                "server.ops_listen must differ from listen (both {ops})"
            ));
        }
        // 0 would refuse every upload (413) and every invocation (out of fuel at once).
        if self.handlers.max_upload_bytes == 0 {
            return bad("handlers.max_upload_bytes must be > 0");
        }
        if self.handlers.fuel == Some(0) {
            return bad("handlers.fuel must be > 0 (leave it out for no fuel limit)");
        }
        if self.delivery.nice > 19 {
            return bad("delivery.nice must be in 0..=19");
        }
        if self.delivery.threads > 1024 {
            return bad("delivery.threads must be in 0..=1024 (0 = one per CPU)");
        }
        if let Err(e) = self.nats.server_addrs() {
            return Err(ConfigError::Invalid(e));
        }
        if self.nats.connect_timeout.is_zero() {
            return bad("nats.connect_timeout must be > 0");
        }
        // Checked at start: the client would read the files only when it connects, and fail
        // every connect from then on.
        self.nats.auth().validate().map_err(ConfigError::Invalid)?;
        self.store
            .jetstream
            .auth()
            .validate()
            .map_err(ConfigError::Invalid)?;
        for (key, var) in self.operator_secrets() {
            if var.starts_with("ROUTER_") {
                return Err(ConfigError::Invalid(format!(
                    "{key} must not name a ROUTER_ variable: those are read as configuration keys"
                )));
            }
            if var.is_empty() {
                return Err(ConfigError::Invalid(format!("{key} must name a variable")));
            }
        }
        if self.secrets_env_prefix.starts_with("ROUTER_") {
            return bad(
                "secrets_env_prefix must not start with ROUTER_ (those variables are configuration keys)",
            );
        }
        let js = &self.store.jetstream;
        let token_ok = |t: &str| {
            !t.is_empty()
                && !t
                    .chars()
                    .any(|c| c.is_whitespace() || matches!(c, '.' | '*' | '>'))
        };
        if !token_ok(&js.stream) {
            return bad(
                "store.jetstream.stream must be a stream name (no spaces, '.', '*' or '>')",
            );
        }
        if !js.prefix.split('.').all(token_ok) {
            return bad(
                "store.jetstream.prefix must be subject tokens separated by '.' (no wildcards)",
            );
        }
        if let Err(e) = server_addrs("store.jetstream.url", &js.url) {
            return bad(&e);
        }
        if js.replicas == 0 || js.replicas > 5 {
            return bad("store.jetstream.replicas must be 1 to 5");
        }
        if js.timeout.is_zero() {
            return bad("store.jetstream.timeout must be > 0");
        }
        if self.store.dedup_memtable_keys < 1_000 {
            return bad("store.dedup_memtable_keys must be at least 1000");
        }
        if !(Duration::from_millis(1)..=Duration::from_secs(1))
            .contains(&self.store.checkpoint_interval)
        {
            return bad("store.checkpoint_interval must be from 1ms to 1s");
        }
        // Every 202 may wait this long: more than a few milliseconds is a mistake, not tuning.
        if self.store.commit_delay > Duration::from_millis(100) {
            return bad("store.commit_delay must be at most 100ms");
        }
        // At 0 (or below) ingest, once refused at the high-water mark, would wait for an
        // empty store.
        if !(self.store.low_water_fraction > 0.0 && self.store.low_water_fraction <= 1.0) {
            return bad("store.low_water_fraction must be in (0, 1], e.g. 0.9");
        }
        // One wasm page is 64 KiB: below it no handler can even start.
        if self.handlers.memory_bytes < 64 << 10 {
            return bad("handlers.memory_bytes must be at least 65536 (one wasm page)");
        }
        // Above it the engine refuses its pool, and the router would serve with no handler
        // runtime at all (every handler target waiting): refused here, at start, instead.
        if self.handlers.memory_bytes as u64 > crate::wasm::limits::MAX_MEMORY_BYTES {
            return bad(&format!(
                "handlers.memory_bytes must be at most {} (4 GiB: what the engine reserves per handler memory, and all a 32-bit wasm memory can address)",
                crate::wasm::limits::MAX_MEMORY_BYTES
            ));
        }
        if self.handlers.timeout.is_zero() {
            return bad("handlers.timeout must be > 0");
        }
        if self.handlers.max_kv_ops == 0 {
            return bad("handlers.max_kv_ops must be at least 1");
        }
        // No invocation slot: every handler delivery would wait for one until its max_age,
        // with nothing in the API to say why.
        if self.handlers.max_instances == 0 {
            return bad("handlers.max_instances must be at least 1");
        }
        // The pooling allocator reserves address space for every instance at start (two
        // linear memories of 4 GiB plus guards, about 8 GiB): about 16,000 instances fill a
        // 64-bit host's 128 TiB and the engine refused to start, leaving the router with no
        // handler runtime at all.
        if self.handlers.max_instances > MAX_HANDLER_INSTANCES {
            return bad(&format!(
                "handlers.max_instances must be at most {MAX_HANDLER_INSTANCES} (the engine reserves about 8 GiB of address space per instance at start), not {}",
                self.handlers.max_instances
            ));
        }
        self.check_handler_dirs()?;
        // Checked here rather than when the router uses them, so that a refusal names the
        // key and the variable that set it, and `config explain` refuses what serve would.
        crate::auth::Tokens::new(&self.auth.tokens)
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        if let Some(path) = &self.secrets_file {
            read_secrets(path).map_err(|e| ConfigError::Invalid(format!("secrets_file {e}")))?;
        }
        if let Some(path) = &self.delivery.tls_ca_file {
            crate::target::webhook::read_ca_file(path)
                .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        Ok(())
    }

    /// The handler runtime's directories, which the runtime would otherwise find wrong only
    /// after the start: a `preload_dir` that is not a directory (a typo), a `dir` that is a
    /// file or under one. Permissions are left to the start, which names the key too.
    fn check_handler_dirs(&self) -> Result<(), ConfigError> {
        let h = &self.handlers;
        if let Some(pre) = &h.preload_dir {
            match std::fs::metadata(pre) {
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    return Err(ConfigError::Invalid(format!(
                        "handlers.preload_dir {} is not a directory",
                        pre.display()
                    )));
                }
                Err(e) => {
                    return Err(ConfigError::Invalid(format!(
                        "handlers.preload_dir {}: {e}",
                        pre.display()
                    )));
                }
            }
        }
        if let Some(dir) = &h.dir {
            // The directory, or the nearest ancestor that exists, must be a directory: the
            // runtime creates what is missing below it.
            let existing = dir
                .ancestors()
                .find(|a| !a.as_os_str().is_empty() && std::fs::symlink_metadata(a).is_ok());
            if let Some(found) = existing
                && !found.is_dir()
            {
                let what = if found == dir.as_path() {
                    "exists and is not a directory".to_string()
                } else {
                    format!("cannot be created: {} is not a directory", found.display())
                };
                return Err(ConfigError::Invalid(format!(
                    "handlers.dir {} {what}",
                    dir.display()
                )));
            }
        }
        Ok(())
    }
}

/// The duration keys of the configuration (dotted paths), in [`Config::durations`]'s order:
/// their bounds are checked together, and a value written in months (`M`) is warned about.
pub const DURATION_KEYS: [&str; 16] = [
    "shutdown_grace",
    "ingest.dedup_window",
    "ingest.admission_wait",
    "delivery.lease_margin",
    "delivery.sweep_interval",
    "delivery.retention",
    "delivery.job_retention",
    "archive.retention",
    "store.checkpoint_interval",
    "store.commit_delay",
    "store.jetstream.timeout",
    "handlers.timeout",
    "handlers.completed_ttl",
    "server.header_read_timeout",
    "server.request_timeout",
    "nats.connect_timeout",
];

/// The largest `delivery.concurrency` and `delivery.handler_concurrency`.
pub const MAX_CONCURRENCY: usize = 1_000_000;

/// The largest `handlers.max_instances` (and `handlers.running_per_handler`): the pooling
/// allocator reserves about 8 GiB of address space per instance at start, and 4096 of them
/// (32 TiB) leave most of a 64-bit host's 128 TiB to everything else.
pub const MAX_HANDLER_INSTANCES: u32 = 4096;

/// The secrets file's `NAME = "value"` pairs. A file that does not parse is reported by
/// position only: the TOML parser's own message quotes the offending line, which is a secret
/// (`HOOK_AUTH = "Bearer …` with its closing quote missing), and went to stderr at start and
/// to the log at every reload.
pub fn read_secrets(path: &Path) -> Result<std::collections::HashMap<String, String>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    toml::from_str(&text).map_err(|e| {
        let at = e.span().map_or_else(String::new, |span| {
            let (line, col) = crate::text_pos::Lines::new(&text).at(span.start);
            format!(":{line}:{col}")
        });
        format!(
            "{}{at}: not a TOML table of NAME = \"value\" strings ({}; the file's text is not shown, it holds secrets)",
            path.display(),
            without_quoted(e.message())
        )
    })
}

/// `message` with every fragment quoted in backticks or double quotes left out: parser and
/// serde messages quote the text they stumbled on (`invalid type: integer `1234``).
fn without_quoted(message: &str) -> String {
    let mut out = String::new();
    let mut quote = None;
    for c in message.chars() {
        match (quote, c) {
            (None, '`' | '"') => {
                quote = Some(c);
                out.push('…');
            }
            (None, '\n') => out.push(' '),
            (None, c) => out.push(c),
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
        }
    }
    out.trim().to_string()
}

/// The shortest `delivery.sweep_interval`, `delivery.lease_margin` and server timeouts.
pub const MIN_INTERVAL: Duration = Duration::from_millis(100);

/// The smallest `server.max_header_bytes`: a request line and a few ordinary headers.
pub const MIN_HEADER_BYTES: usize = 1024;

/// The value at dotted `key` of `table`.
fn lookup<'a>(table: &'a toml::Table, key: &str) -> Option<&'a toml::Value> {
    let mut parts = key.split('.');
    let mut cur = table.get(parts.next()?)?;
    for part in parts {
        cur = cur.as_table()?.get(part)?;
    }
    Some(cur)
}

/// The deepest `ingest.max_json_depth`: serde_json refuses a document's 128th level of nesting
/// itself (its recursion limit), with a less helpful error than the depth check's.
pub const MAX_JSON_DEPTH: usize = 127;

/// `ROUTER_*` variables that are not configuration keys.
pub const RESERVED_ENV: &[&str] = &[
    "ROUTER_API",
    "ROUTER_TOKEN",
    "ROUTER_PLUGINS_OUT",
    "ROUTER_PLUGINS_TARGET_DIR",
];

/// Whether `ROUTER_*` variable `name` (with `value`) is one of the service links Kubernetes
/// sets in every pod of a namespace that has a Service named `router` (docker links too):
/// `ROUTER_SERVICE_HOST`, `ROUTER_SERVICE_PORT[_<PORT NAME>]`, `ROUTER_PORT=tcp://…` and
/// `ROUTER_PORT_<port>_<TCP|UDP|SCTP>[_PROTO|_PORT|_ADDR]`. No configuration key is named
/// `service_*` or `port*`, so none is shadowed; a `ROUTER_PORT` whose value is not such an
/// address is still read as a key (and refused as unknown, which tells its author so).
pub fn is_kubernetes_service_link(name: &str, value: &str) -> bool {
    let Some(rest) = name.strip_prefix("ROUTER_") else {
        return false;
    };
    if rest == "SERVICE_HOST" || rest == "SERVICE_PORT" {
        return true;
    }
    if let Some(port_name) = rest.strip_prefix("SERVICE_PORT_") {
        return !port_name.is_empty();
    }
    if rest == "PORT" {
        return ["tcp://", "udp://", "sctp://"]
            .iter()
            .any(|scheme| value.starts_with(scheme));
    }
    let Some(link) = rest.strip_prefix("PORT_") else {
        return false;
    };
    let mut parts = link.splitn(3, '_');
    let (Some(port), Some(proto)) = (parts.next(), parts.next()) else {
        return false;
    };
    !port.is_empty()
        && port.bytes().all(|b| b.is_ascii_digit())
        && matches!(proto, "TCP" | "UDP" | "SCTP")
        && matches!(parts.next(), None | Some("PROTO" | "PORT" | "ADDR"))
}

/// The `ROUTER_*` variables of `env` that [`Config::load`] leaves alone as Kubernetes service
/// links, for a log line at start.
pub fn kubernetes_service_links(env: &[(String, String)]) -> Vec<String> {
    env.iter()
        .filter(|(k, v)| is_kubernetes_service_link(k, v))
        .map(|(k, _)| k.clone())
        .collect()
}

/// A configuration key a `ROUTER_*` variable set.
struct EnvKey {
    /// The key's path (`["ingest", "max_batch"]`) and its dotted form.
    path: Vec<String>,
    key: String,
    /// The variable's name and value as given.
    var: String,
    raw: String,
    /// Whether the value was read as a number or a boolean rather than text.
    typed: bool,
}

/// Whether `message` is about the dotted `key`: names it whole, not as part of a longer key
/// (`store.jetstream.url` does not mention `store.jetstream`, nor `url`).
fn mentions(message: &str, key: &str) -> bool {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    message.match_indices(key).any(|(i, _)| {
        let before = message[..i].chars().next_back();
        let mut after = message[i + key.len()..].chars();
        let continues = match after.next() {
            None => false,
            // A sentence's full stop, or a longer key.
            Some('.') => after.next().is_some_and(word),
            Some(c) => word(c),
        };
        before.is_none_or(|c| !(word(c) || c == '.')) && !continues
    })
}

fn parse_env_value(raw: &str) -> toml::Value {
    // Numbers and booleans keep their type; anything else (paths, durations, addresses) is a
    // string, so `ROUTER_LISTEN=127.0.0.1:9000` needs no quoting.
    match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.to_string())),
        Err(_) => toml::Value::String(raw.to_string()),
    }
}

fn set_path(table: &mut toml::Table, path: &[String], value: toml::Value) -> Result<(), String> {
    match path {
        [] => Err("empty key".into()),
        [last] => {
            table.insert(last.clone(), value);
            Ok(())
        }
        [first, rest @ ..] => {
            let entry = table
                .entry(first.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            match entry {
                toml::Value::Table(t) => set_path(t, rest, value),
                _ => Err(format!("`{first}` is not a table")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a reload lists as applying at the next restart: the dotted keys that differ,
    /// never their values; none between equal configurations (the origin is not a key).
    #[test]
    fn changed_keys_name_the_keys_that_differ() {
        let a = Config::default();
        assert!(changed_keys(&a, &a.clone()).is_empty());
        let mut b = a.clone();
        b.delivery.max_in_flight = Some(77);
        b.listen = "127.0.0.1:9".parse().expect("addr");
        b.secrets_file = Some(PathBuf::from("/run/secrets"));
        b.origin = Some(ConfigOrigin::default());
        assert_eq!(
            changed_keys(&a, &b),
            ["delivery.max_in_flight", "listen", "secrets_file"]
        );
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn the_documented_configuration_parses_and_names_every_section() {
        // docs/configuration.md shows every key; its example must stay loadable, so a renamed
        // or removed key fails here rather than in an operator's deployment.
        let doc = include_str!("../../docs/configuration.md");
        let block = doc
            .split("```toml\n")
            .nth(1)
            .and_then(|rest| rest.split("```").next())
            .expect("a toml block in docs/configuration.md");
        let table: toml::Table = toml::from_str(block).expect("the documented TOML parses");
        let cfg: Config = toml::Value::Table(table.clone())
            .try_into()
            .expect("every documented key is a configuration key");
        for section in [
            "ingest", "delivery", "archive", "store", "handlers", "server", "auth", "nats",
        ] {
            assert!(
                table.contains_key(section),
                "docs/configuration.md lacks [{section}]"
            );
        }
        assert_eq!(cfg.handlers, HandlersConfig::default());
        assert_eq!(cfg.nats, NatsConfig::default());
    }

    #[test]
    fn no_config_means_embedded_defaults_on_loopback() {
        let c = Config::load(None, env(&[])).expect("defaults");
        assert_eq!(c, Config::default());
        assert!(c.listen.ip().is_loopback());
        assert_eq!(c.data_dir, PathBuf::from("./data"));
    }

    #[test]
    fn file_then_env_override() {
        let dir = tempfile::tempdir().expect("tmp");
        let f = dir.path().join("router.toml");
        std::fs::write(
            &f,
            "listen = \"127.0.0.1:9000\"\n[ingest]\nmax_batch = 10\ndedup_window = \"1h\"\n",
        )
        .expect("write");
        let c = Config::load(
            Some(&f),
            env(&[("ROUTER_INGEST__MAX_BATCH", "20"), ("OTHER", "x")]),
        )
        .expect("load");
        assert_eq!(c.listen.port(), 9000);
        assert_eq!(c.ingest.max_batch, 20);
        assert_eq!(c.ingest.dedup_window, Duration::from_secs(3600));
        let c = Config::load(None, env(&[("ROUTER_LISTEN", "127.0.0.1:7000")])).expect("load");
        assert_eq!(c.listen.port(), 7000);
    }

    #[test]
    fn unknown_keys_are_named() {
        let dir = tempfile::tempdir().expect("tmp");
        let f = dir.path().join("router.toml");
        std::fs::write(&f, "[ingest]\nmax_bath = 10\n").expect("write");
        let e = Config::load(Some(&f), env(&[])).expect_err("unknown key");
        assert!(e.to_string().contains("max_bath"), "{e}");
        let e = Config::load(None, env(&[("ROUTER_NOPE", "1")])).expect_err("unknown env key");
        assert!(e.to_string().contains("nope"), "{e}");
    }

    #[test]
    fn refused_values_name_their_key_and_the_variable_that_set_it() {
        let dir = tempfile::tempdir().expect("tmp");
        let f = dir.path().join("router.toml");
        std::fs::write(&f, "[ingest]\nmax_batch = \"x\"\n").expect("write");
        let e = Config::load(Some(&f), env(&[])).expect_err("string for a number");
        assert!(e.to_string().contains("ingest.max_batch: "), "{e}");
        let e = Config::load(None, env(&[("ROUTER_SHUTDOWN_GRACE", "xyz")])).expect_err("duration");
        assert!(
            e.to_string().contains("shutdown_grace: ")
                && e.to_string().contains("(set by ROUTER_SHUTDOWN_GRACE)"),
            "{e}"
        );
    }

    /// Every refusal of a value from the environment names the variable, and a value that
    /// looks like a number is text where the key wants text.
    #[test]
    fn environment_overrides_name_their_variable_and_keep_text_as_text() {
        let e = Config::load(None, env(&[("ROUTER_INGEST__MAX_BATCH", "0")])).expect_err("zero");
        assert_eq!(
            e.to_string(),
            "invalid configuration: ingest.max_batch must be > 0 (set by ROUTER_INGEST__MAX_BATCH)"
        );
        let e = Config::load(None, env(&[("ROUTER_INGEST__MAX_BATCH__X", "5")]))
            .expect_err("a key below a number");
        assert!(
            e.to_string().contains("ingest.max_batch: ")
                && e.to_string()
                    .contains("(set by ROUTER_INGEST__MAX_BATCH__X)"),
            "{e}"
        );
        let e = Config::load(None, env(&[("ROUTER_INGEST__NOPE", "5")])).expect_err("unknown");
        assert!(
            e.to_string().contains("nope")
                && e.to_string().contains("(set by ROUTER_INGEST__NOPE)"),
            "{e}"
        );
        let e = Config::load(None, env(&[("ROUTER_NOPE", "1")])).expect_err("unknown top key");
        assert!(e.to_string().contains("(set by ROUTER_NOPE)"), "{e}");
        // Two keys in one message: both variables.
        let e = Config::load(
            None,
            env(&[
                ("ROUTER_NATS__TOKEN_ENV", "T"),
                ("ROUTER_NATS__CREDENTIALS_FILE", "/x.creds"),
            ]),
        )
        .expect_err("both");
        assert!(
            e.to_string()
                .ends_with("(set by ROUTER_NATS__TOKEN_ENV, ROUTER_NATS__CREDENTIALS_FILE)"),
            "{e}"
        );
        // A longer key is not this one: store.jetstream.url is not store.jetstream.
        assert!(mentions(
            "store.jetstream.url `x`: bad",
            "store.jetstream.url"
        ));
        assert!(!mentions("store.jetstream.url `x`: bad", "store.jetstream"));
        assert!(mentions(
            "must be set: ingest.max_batch.",
            "ingest.max_batch"
        ));
        assert!(!mentions("ingest.max_batches", "ingest.max_batch"));
        // Text that looks like a number or a boolean, for keys that want text.
        let c = Config::load(
            None,
            env(&[
                ("ROUTER_DATA_DIR", "2024"),
                ("ROUTER_RULES_DIR", "true"),
                ("ROUTER_NATS__TOKEN_ENV", "42"),
                ("ROUTER_INGEST__MAX_BATCH", "7"),
            ]),
        )
        .expect("text keys take number-looking text");
        assert_eq!(c.data_dir, PathBuf::from("2024"));
        assert_eq!(c.rules_dir, PathBuf::from("true"));
        assert_eq!(c.nats.token_env.as_deref(), Some("42"));
        assert_eq!(c.ingest.max_batch, 7);
        // A number key still refuses text, naming the variable.
        let e = Config::load(None, env(&[("ROUTER_INGEST__MAX_BATCH", "many")])).expect_err("text");
        assert!(
            e.to_string().contains("(set by ROUTER_INGEST__MAX_BATCH)"),
            "{e}"
        );
    }

    #[test]
    fn the_cli_clients_variables_are_not_configuration_keys() {
        let c = Config::load(
            None,
            env(&[
                ("ROUTER_TOKEN", "rtr_x"),
                ("ROUTER_API", "http://127.0.0.1:8080"),
            ]),
        )
        .expect("the clients' variables are left alone");
        assert_eq!(c, Config::default());
    }

    #[test]
    fn kubernetes_service_links_are_not_configuration_keys() {
        // What a pod gets from a Service named `router` with a port 8080 named `http`.
        let links = env(&[
            ("ROUTER_SERVICE_HOST", "10.96.0.10"),
            ("ROUTER_SERVICE_PORT", "8080"),
            ("ROUTER_SERVICE_PORT_HTTP", "8080"),
            ("ROUTER_PORT", "tcp://10.96.0.10:8080"),
            ("ROUTER_PORT_8080_TCP", "tcp://10.96.0.10:8080"),
            ("ROUTER_PORT_8080_TCP_PROTO", "tcp"),
            ("ROUTER_PORT_8080_TCP_PORT", "8080"),
            ("ROUTER_PORT_8080_TCP_ADDR", "10.96.0.10"),
            ("ROUTER_PORT_53_UDP", "udp://10.96.0.10:53"),
            ("ROUTER_PORT_9_SCTP_ADDR", "10.96.0.10"),
        ]);
        let c = Config::load(None, links.clone()).expect("service links are left alone");
        assert_eq!(c, Config::default());
        assert_eq!(kubernetes_service_links(&links).len(), links.len());
        // Keys are still read beside them, and shapes that are not links are still keys.
        let mut with_key = links;
        with_key.push(("ROUTER_INGEST__MAX_BATCH".into(), "7".into()));
        let c = Config::load(None, with_key).expect("a key beside the links");
        assert_eq!(c.ingest.max_batch, 7);
        for (k, v) in [
            ("ROUTER_PORT", "8080"),
            ("ROUTER_PORT_8080_HTTP", "x"),
            ("ROUTER_PORT_X_TCP", "x"),
            ("ROUTER_PORT_8080_TCP_HOST", "x"),
            ("ROUTER_SERVICE_PORT_", "1"),
        ] {
            assert!(!is_kubernetes_service_link(k, v), "{k}={v}");
            let e = Config::load(None, env(&[(k, v)])).expect_err(k);
            assert!(e.to_string().contains(k), "{k}: {e}");
        }
    }

    #[test]
    fn invalid_values_are_refused() {
        let e = Config::load(None, env(&[("ROUTER_INGEST__MAX_BATCH", "0")])).expect_err("zero");
        assert!(e.to_string().contains("max_batch"));
        for (k, v) in [
            ("ROUTER_STORE__LOW_WATER_FRACTION", "-1"),
            ("ROUTER_STORE__LOW_WATER_FRACTION", "0"),
            ("ROUTER_STORE__LOW_WATER_FRACTION", "1.5"),
            ("ROUTER_HANDLERS__MEMORY_BYTES", "0"),
            ("ROUTER_HANDLERS__MEMORY_BYTES", "8589934592"),
            ("ROUTER_HANDLERS__MEMORY_BYTES", "4294967297"),
            ("ROUTER_HANDLERS__TIMEOUT", "0s"),
            ("ROUTER_HANDLERS__MAX_KV_OPS", "0"),
            ("ROUTER_HANDLERS__MAX_INSTANCES", "0"),
        ] {
            let e = Config::load(None, env(&[(k, v)])).expect_err(k);
            let key = k["ROUTER_".len()..].to_ascii_lowercase().replace("__", ".");
            assert!(e.to_string().contains(&key), "{k}={v}: {e}");
        }
        let e = Config::load(
            None,
            env(&[("ROUTER_HANDLERS__MEMORY_BYTES", "8589934592")]),
        )
        .expect_err("past the engine's reservation");
        assert!(e.to_string().contains("at most 4294967296"), "{e}");
        let ok = Config::load(
            None,
            env(&[("ROUTER_HANDLERS__MEMORY_BYTES", "4294967296")]),
        )
        .expect("4 GiB is the most");
        assert_eq!(ok.handlers.memory_bytes as u64, 1 << 32);
        let e = Config::load(None, env(&[("ROUTER_DELIVERY__NICE", "20")])).expect_err("nice");
        assert!(
            e.to_string().contains("delivery.nice must be in 0..=19"),
            "{e}"
        );
        let e =
            Config::load(None, env(&[("ROUTER_DELIVERY__THREADS", "5000")])).expect_err("threads");
        assert!(e.to_string().contains("delivery.threads"), "{e}");
        let ok = Config::load(None, env(&[("ROUTER_DELIVERY__NICE", "19")])).expect("19 is valid");
        assert_eq!((ok.delivery.nice, ok.delivery.threads), (19, 0));
        let e = Config::load(None, env(&[("ROUTER_STORE__COMMIT_DELAY", "1s")]))
            .expect_err("commit delay");
        assert!(e.to_string().contains("store.commit_delay"), "{e}");
        let ok = Config::load(None, env(&[("ROUTER_STORE__COMMIT_DELAY", "2ms")])).expect("2ms");
        assert_eq!(ok.store.commit_delay, Duration::from_millis(2));
        assert_eq!(ok.store.checkpoint_interval, Duration::from_millis(10));
        for bad in ["0s", "2s"] {
            let e = Config::load(None, env(&[("ROUTER_STORE__CHECKPOINT_INTERVAL", bad)]))
                .expect_err(bad);
            assert!(e.to_string().contains("store.checkpoint_interval"), "{e}");
        }
        let ok = Config::load(None, env(&[("ROUTER_STORE__CHECKPOINT_INTERVAL", "50ms")]))
            .expect("50ms");
        assert_eq!(ok.store.checkpoint_interval, Duration::from_millis(50));
    }

    /// Values that made every request or every sweep misbehave were accepted: 0 header bytes
    /// (every request 431), a sweep every nanosecond (28 % of a core idle), zero timeouts.
    #[test]
    fn limits_that_break_every_request_or_sweep_are_refused_at_their_bound() {
        for (k, v, message) in [
            (
                "ROUTER_SERVER__MAX_HEADER_BYTES",
                "0",
                "server.max_header_bytes must be at least 1024",
            ),
            (
                "ROUTER_SERVER__MAX_HEADER_BYTES",
                "1023",
                "server.max_header_bytes must be at least 1024",
            ),
            (
                "ROUTER_DELIVERY__SWEEP_INTERVAL",
                "1ns",
                "delivery.sweep_interval must be at least 100ms",
            ),
            (
                "ROUTER_DELIVERY__LEASE_MARGIN",
                "0s",
                "delivery.lease_margin must be at least 100ms",
            ),
            (
                "ROUTER_SERVER__REQUEST_TIMEOUT",
                "0s",
                "server.request_timeout must be at least 100ms",
            ),
            (
                "ROUTER_SERVER__HEADER_READ_TIMEOUT",
                "0s",
                "server.header_read_timeout must be at least 100ms",
            ),
            (
                "ROUTER_HANDLERS__MAX_UPLOAD_BYTES",
                "0",
                "handlers.max_upload_bytes must be > 0",
            ),
            ("ROUTER_HANDLERS__FUEL", "0", "handlers.fuel must be > 0"),
            (
                "ROUTER_INGEST__DEDUP_WINDOW",
                "99999999999d",
                "ingest.dedup_window must be at most 10 years",
            ),
            (
                "ROUTER_ARCHIVE__RETENTION",
                "3651d",
                "archive.retention must be at most 10 years",
            ),
        ] {
            let e = Config::load(None, env(&[(k, v)])).expect_err(k);
            assert!(e.to_string().contains(message), "{k}={v}: {e}");
        }
        for (k, v) in [
            ("ROUTER_SERVER__MAX_HEADER_BYTES", "1024"),
            ("ROUTER_DELIVERY__SWEEP_INTERVAL", "100ms"),
            ("ROUTER_DELIVERY__LEASE_MARGIN", "100ms"),
            ("ROUTER_SERVER__REQUEST_TIMEOUT", "100ms"),
            ("ROUTER_ARCHIVE__RETENTION", "3650d"),
        ] {
            Config::load(None, env(&[(k, v)])).unwrap_or_else(|e| panic!("{k}={v}: {e}"));
        }
        // The names checked together are the configuration's duration keys.
        let table = toml::Table::try_from(Config::default()).expect("serializes");
        for key in DURATION_KEYS {
            assert!(lookup(&table, key).is_some(), "{key}");
        }
    }

    #[test]
    fn a_duration_in_months_is_valid_and_warned_about() {
        let dir = tempfile::tempdir().expect("tmp");
        let f = dir.path().join("router.toml");
        std::fs::write(&f, "[ingest]\ndedup_window = \"1M\"\n").expect("write");
        let (c, warnings) =
            Config::load_with_warnings(Some(&f), env(&[("ROUTER_DELIVERY__RETENTION", "2M")]))
                .expect("valid");
        assert_eq!(c.ingest.dedup_window, Duration::from_secs(2_630_016));
        assert_eq!(
            warnings,
            vec![
                "ingest.dedup_window = \"1M\" counts in months (`M`); minutes are `m` or `min`"
                    .to_string(),
                "delivery.retention = \"2M\" counts in months (`M`); minutes are `m` or `min` (set by ROUTER_DELIVERY__RETENTION)"
                    .to_string(),
            ]
        );
        let (_, none) =
            Config::load_with_warnings(None, env(&[("ROUTER_INGEST__DEDUP_WINDOW", "10m")]))
                .expect("valid");
        assert!(none.is_empty(), "{none:?}");
    }

    #[test]
    fn nats_section_defaults_file_and_env_overrides() {
        let c = Config::load(None, env(&[])).expect("defaults");
        assert_eq!(c.nats.url, "nats://127.0.0.1:4222");
        assert_eq!(c.nats.ack, NatsAck::Auto);
        assert_eq!(c.nats.connect_timeout, Duration::from_secs(2));
        let dir = tempfile::tempdir().expect("tmp");
        let f = dir.path().join("router.toml");
        // The credentials file must exist at start.
        let creds = dir.path().join("nats.creds");
        std::fs::write(&creds, "x").expect("write");
        std::fs::write(
            &f,
            format!(
                "[nats]\nurl = \"nats://10.0.0.1:4222, tls://10.0.0.2:4222\"\nack = \"core\"\ncredentials_file = {:?}\n",
                creds.display().to_string()
            ),
        )
        .expect("write");
        let c = Config::load(Some(&f), env(&[])).expect("file");
        assert_eq!(c.nats.ack, NatsAck::Core);
        assert_eq!(c.nats.server_addrs().map(|a| a.len()), Ok(2));
        assert_eq!(c.nats.credentials_file.as_deref(), Some(creds.as_path()));
        let c = Config::load(
            None,
            env(&[
                ("ROUTER_NATS__ACK", "jetstream"),
                ("ROUTER_NATS__URL", "nats://127.0.0.1:14222"),
                ("ROUTER_NATS__CONNECT_TIMEOUT", "500ms"),
                ("ROUTER_NATS__TOKEN_ENV", "NATS_TOKEN"),
            ]),
        )
        .expect("env");
        assert_eq!(c.nats.ack, NatsAck::JetStream);
        assert_eq!(c.nats.url, "nats://127.0.0.1:14222");
        assert_eq!(c.nats.connect_timeout, Duration::from_millis(500));
        assert_eq!(c.nats.token_env.as_deref(), Some("NATS_TOKEN"));
    }

    #[test]
    fn the_jetstream_store_takes_a_list_of_servers_and_refuses_a_bad_one() {
        let c = Config::load(
            None,
            env(&[(
                "ROUTER_STORE__JETSTREAM__URL",
                "nats://10.0.0.1:4222, nats://10.0.0.2:4222,tls://10.0.0.3:4222",
            )]),
        )
        .expect("a list");
        assert_eq!(
            server_addrs("store.jetstream.url", &c.store.jetstream.url).map(|a| a.len()),
            Ok(3)
        );
        let e = Config::load(
            None,
            env(&[(
                "ROUTER_STORE__JETSTREAM__URL",
                "nats://10.0.0.1:4222, ws://x:80",
            )]),
        )
        .expect_err("websocket");
        assert!(
            e.to_string().contains("store.jetstream.url `ws://x:80`"),
            "{e}"
        );
    }

    #[test]
    fn invalid_nats_settings_are_refused() {
        let e = Config::load(None, env(&[("ROUTER_NATS__ACK", "sometimes")])).expect_err("ack");
        assert!(e.to_string().contains("sometimes"), "{e}");
        let e = Config::load(None, env(&[("ROUTER_NATS__URL", "http://127.0.0.1:4222")]))
            .expect_err("scheme");
        assert!(e.to_string().contains("nats.url"), "{e}");
        let e = Config::load(None, env(&[("ROUTER_NATS__URL", "ws://127.0.0.1:4222")]))
            .expect_err("websocket");
        assert!(e.to_string().contains("only nats:// and tls://"), "{e}");
        let e = Config::load(None, env(&[("ROUTER_NATS__CONNECT_TIMEOUT", "0s")]))
            .expect_err("timeout");
        assert!(e.to_string().contains("nats.connect_timeout"), "{e}");
        let e = Config::load(
            None,
            env(&[
                ("ROUTER_NATS__TOKEN_ENV", "T"),
                ("ROUTER_NATS__CREDENTIALS_FILE", "/x.creds"),
            ]),
        )
        .expect_err("both");
        assert!(e.to_string().contains("exclusive"), "{e}");
        let e = Config::load(None, env(&[("ROUTER_NATS__USER", "x")])).expect_err("no password");
        assert!(e.to_string().contains("go together"), "{e}");
        let e = Config::load(
            None,
            env(&[
                ("ROUTER_NATS__USER", "x"),
                ("ROUTER_NATS__PASSWORD_ENV", "P"),
                ("ROUTER_NATS__TOKEN_ENV", "T"),
            ]),
        )
        .expect_err("both");
        assert!(e.to_string().contains("exclusive"), "{e}");
        let e = Config::load(
            None,
            env(&[
                ("ROUTER_NATS__USER", "x"),
                ("ROUTER_NATS__PASSWORD_ENV", "ROUTER_P"),
            ]),
        )
        .expect_err("ROUTER_");
        assert!(e.to_string().contains("nats.password_env"), "{e}");
        let c = Config::load(
            None,
            env(&[
                ("ROUTER_NATS__USER", "router"),
                ("ROUTER_NATS__PASSWORD_ENV", "NATS_PASSWORD"),
            ]),
        )
        .expect("user and password_env");
        assert_eq!(c.nats.user.as_deref(), Some("router"));
        assert_eq!(c.nats.password_env.as_deref(), Some("NATS_PASSWORD"));
    }

    #[test]
    fn nats_tls_files_must_exist_and_cert_and_key_go_together() {
        let dir = tempfile::tempdir().expect("tmp");
        let pem = dir.path().join("ca.pem");
        std::fs::write(&pem, "x").expect("write");
        let pem = pem.display().to_string();
        let c = Config::load(
            None,
            env(&[
                ("ROUTER_NATS__TLS_CA_FILE", &pem),
                ("ROUTER_NATS__TLS_CERT_FILE", &pem),
                ("ROUTER_NATS__TLS_KEY_FILE", &pem),
            ]),
        )
        .expect("files exist");
        assert_eq!(c.nats.tls_ca_file.as_deref(), Some(Path::new(&pem)));
        let e = Config::load(
            None,
            env(&[("ROUTER_NATS__TLS_CA_FILE", "/nonexistent/ca.pem")]),
        )
        .expect_err("missing");
        assert!(
            e.to_string()
                .contains("nats.tls_ca_file /nonexistent/ca.pem"),
            "{e}"
        );
        let e =
            Config::load(None, env(&[("ROUTER_NATS__TLS_CERT_FILE", &pem)])).expect_err("no key");
        assert!(e.to_string().contains("go together"), "{e}");
    }

    /// `nats.credentials_file` is checked at start like the TLS files: a typo was accepted,
    /// and every attempt failed on it until the entries were dead-lettered.
    #[test]
    fn a_missing_nats_credentials_file_is_refused_at_start() {
        let e = Config::load(
            None,
            env(&[("ROUTER_NATS__CREDENTIALS_FILE", "/nonexistent/nats.cred")]),
        )
        .expect_err("missing");
        assert!(
            e.to_string()
                .contains("nats.credentials_file /nonexistent/nats.cred: No such file")
                && e.to_string()
                    .contains("(set by ROUTER_NATS__CREDENTIALS_FILE)"),
            "{e}"
        );
        let dir = tempfile::tempdir().expect("tmp");
        let creds = dir.path().join("router.creds");
        std::fs::write(&creds, "x").expect("write");
        let c = Config::load(
            None,
            env(&[(
                "ROUTER_NATS__CREDENTIALS_FILE",
                &creds.display().to_string(),
            )]),
        )
        .expect("exists");
        assert_eq!(c.nats.credentials_file.as_deref(), Some(creds.as_path()));
    }

    /// `[store.jetstream]` takes `[nats]`'s authentication and TLS keys with the same
    /// validation, each refusal naming the store's key and the variable that set it; its
    /// secret variables are the operator's (no `ROUTER_` name, none a rule file may use).
    #[test]
    fn the_store_takes_the_nats_auth_keys_with_the_same_validation() {
        let dir = tempfile::tempdir().expect("tmp");
        let pem = dir.path().join("ca.pem");
        std::fs::write(&pem, "x").expect("write");
        let pem = pem.display().to_string();
        let file = dir.path().join("router.toml");
        std::fs::write(
            &file,
            format!(
                "[store]\nbackend = \"jetstream\"\n[store.jetstream]\nuser = \"router\"\npassword_env = \"STORE_PASSWORD\"\ntls_ca_file = {pem:?}\ntls_cert_file = {pem:?}\ntls_key_file = {pem:?}\n"
            ),
        )
        .expect("write");
        let c = Config::load(Some(&file), env(&[])).expect("valid");
        let js = &c.store.jetstream;
        assert_eq!(js.user.as_deref(), Some("router"));
        assert_eq!(js.password_env.as_deref(), Some("STORE_PASSWORD"));
        assert_eq!(js.tls_key_file.as_deref(), Some(Path::new(&pem)));
        assert!(
            c.operator_secrets()
                .contains(&("store.jetstream.password_env", "STORE_PASSWORD".to_string()))
        );
        for (vars, want) in [
            (
                vec![
                    ("ROUTER_STORE__JETSTREAM__TOKEN_ENV", "T"),
                    ("ROUTER_STORE__JETSTREAM__CREDENTIALS_FILE", pem.as_str()),
                ],
                "store.jetstream.credentials_file, store.jetstream.token_env and store.jetstream.user (with store.jetstream.password_env) are exclusive: set one (set by ROUTER_STORE__JETSTREAM__TOKEN_ENV, ROUTER_STORE__JETSTREAM__CREDENTIALS_FILE)",
            ),
            (
                vec![("ROUTER_STORE__JETSTREAM__PASSWORD_ENV", "P")],
                "store.jetstream.user and store.jetstream.password_env go together: set both or neither (set by ROUTER_STORE__JETSTREAM__PASSWORD_ENV)",
            ),
            (
                vec![("ROUTER_STORE__JETSTREAM__TLS_CERT_FILE", pem.as_str())],
                "store.jetstream.tls_cert_file and store.jetstream.tls_key_file go together: set both or neither (set by ROUTER_STORE__JETSTREAM__TLS_CERT_FILE)",
            ),
            (
                vec![(
                    "ROUTER_STORE__JETSTREAM__CREDENTIALS_FILE",
                    "/nonexistent/s.creds",
                )],
                "store.jetstream.credentials_file /nonexistent/s.creds: No such file",
            ),
            (
                vec![(
                    "ROUTER_STORE__JETSTREAM__TLS_CA_FILE",
                    "/nonexistent/ca.pem",
                )],
                "store.jetstream.tls_ca_file /nonexistent/ca.pem: No such file",
            ),
            (
                vec![("ROUTER_STORE__JETSTREAM__TOKEN_ENV", "ROUTER_TOKEN_X")],
                "store.jetstream.token_env must not name a ROUTER_ variable",
            ),
            (
                vec![
                    ("ROUTER_STORE__JETSTREAM__USER", ""),
                    ("ROUTER_STORE__JETSTREAM__PASSWORD_ENV", "P"),
                ],
                "store.jetstream.user must not be empty",
            ),
        ] {
            let e = Config::load(None, env(&vars)).expect_err(want);
            let text = e.to_string();
            assert!(
                text.starts_with(&format!("invalid configuration: {want}")),
                "{text}"
            );
        }
        let e = Config::load(
            None,
            env(&[(
                "ROUTER_STORE__JETSTREAM__CREDENTIALS_FILE",
                "/nonexistent/s.creds",
            )]),
        )
        .expect_err("missing");
        assert!(
            e.to_string()
                .contains("(set by ROUTER_STORE__JETSTREAM__CREDENTIALS_FILE)"),
            "{e}"
        );
    }

    /// The handler runtime's settings that made it fail after the start (the router then
    /// served with no handler runtime, ready, every handler event waiting): a `preload_dir`
    /// typo, a `dir` that is a file, a `max_instances` the pool cannot reserve.
    #[test]
    fn handler_runtime_settings_it_cannot_start_with_are_refused_naming_the_key() {
        let dir = tempfile::tempdir().expect("tmp");
        let file = dir.path().join("afile");
        std::fs::write(&file, "x").expect("write");
        let file = file.display().to_string();
        let missing = dir.path().join("plugin").display().to_string();
        let under_file = format!("{file}/handlers");
        for (k, v, message) in [
            (
                "ROUTER_HANDLERS__PRELOAD_DIR",
                missing.as_str(),
                format!("handlers.preload_dir {missing}: No such file"),
            ),
            (
                "ROUTER_HANDLERS__PRELOAD_DIR",
                file.as_str(),
                format!("handlers.preload_dir {file} is not a directory"),
            ),
            (
                "ROUTER_HANDLERS__DIR",
                file.as_str(),
                format!("handlers.dir {file} exists and is not a directory"),
            ),
            (
                "ROUTER_HANDLERS__DIR",
                under_file.as_str(),
                format!("handlers.dir {under_file} cannot be created: {file} is not a directory"),
            ),
            (
                "ROUTER_HANDLERS__MAX_INSTANCES",
                "4097",
                "handlers.max_instances must be at most 4096".to_string(),
            ),
            (
                "ROUTER_HANDLERS__MAX_INSTANCES",
                "4294967295",
                "handlers.max_instances must be at most 4096".to_string(),
            ),
        ] {
            let e = Config::load(None, env(&[(k, v)])).expect_err(k);
            let text = e.to_string();
            assert!(
                text.contains(&message) && text.ends_with(&format!("(set by {k})")),
                "{k}={v}: {text}"
            );
        }
        let ok_dir = dir.path().join("new").join("handlers");
        let c = Config::load(
            None,
            env(&[
                ("ROUTER_HANDLERS__MAX_INSTANCES", "4096"),
                ("ROUTER_HANDLERS__DIR", &ok_dir.display().to_string()),
                (
                    "ROUTER_HANDLERS__PRELOAD_DIR",
                    &dir.path().display().to_string(),
                ),
            ]),
        )
        .expect("the bound, a creatable dir, an existing preload dir");
        assert_eq!(c.handlers.max_instances, MAX_HANDLER_INSTANCES);
        assert!(!ok_dir.exists(), "checking creates nothing");
    }

    /// Concurrency keys are semaphore widths: from tokio's MAX_PERMITS up the start panicked
    /// (exit 101) or, for `running_per_handler`, every handler delivery did.
    #[test]
    fn concurrency_keys_have_an_upper_bound() {
        let huge = "2305843009213693952";
        for (k, v, message) in [
            (
                "ROUTER_DELIVERY__CONCURRENCY",
                huge,
                "delivery.concurrency must be in 1..=1000000",
            ),
            (
                "ROUTER_DELIVERY__CONCURRENCY",
                "1000001",
                "delivery.concurrency must be in 1..=1000000",
            ),
            (
                "ROUTER_DELIVERY__CONCURRENCY",
                "0",
                "delivery.concurrency must be in 1..=1000000",
            ),
            (
                "ROUTER_DELIVERY__HANDLER_CONCURRENCY",
                huge,
                "delivery.handler_concurrency must be in 1..=1000000",
            ),
            (
                "ROUTER_HANDLERS__RUNNING_PER_HANDLER",
                huge,
                "handlers.running_per_handler must be in 0..=4096",
            ),
            (
                "ROUTER_HANDLERS__RUNNING_PER_HANDLER",
                "4097",
                "handlers.running_per_handler must be in 0..=4096",
            ),
        ] {
            let e = Config::load(None, env(&[(k, v)])).expect_err(k);
            let text = e.to_string();
            assert!(
                text.contains(message) && text.ends_with(&format!("(set by {k})")),
                "{k}={v}: {text}"
            );
        }
        let c = Config::load(
            None,
            env(&[
                ("ROUTER_DELIVERY__CONCURRENCY", "1000000"),
                ("ROUTER_DELIVERY__HANDLER_CONCURRENCY", "1000000"),
                ("ROUTER_HANDLERS__RUNNING_PER_HANDLER", "4096"),
            ]),
        )
        .expect("at the bounds");
        assert_eq!(c.delivery.concurrency, MAX_CONCURRENCY);
    }

    /// At start the soft open-file limit is raised to the hard one (lowered here first, as
    /// systemd's default 1024 is below its hard limit).
    #[cfg(unix)]
    #[test]
    fn the_soft_open_file_limit_is_raised_to_the_hard_limit() {
        use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
        let before = getrlimit(Resource::Nofile);
        let Some(hard) = before.maximum else {
            return; // unlimited: left alone
        };
        if hard <= 512 {
            return;
        }
        // Lowered only as far as the other tests of this process can bear for a moment.
        let low = (hard / 2).max(512).min(hard - 1);
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(low),
                maximum: Some(hard),
            },
        )
        .expect("lower the soft limit");
        assert_eq!(
            raise_open_file_limit().expect("raise"),
            OpenFileLimit::Raised(low, hard)
        );
        assert_eq!(getrlimit(Resource::Nofile).current, Some(hard));
        assert_eq!(
            raise_open_file_limit().expect("again"),
            OpenFileLimit::Unchanged(hard)
        );
    }

    /// `delivery.max_in_flight_bytes`: 256 MiB by default; at least 1 MiB and at least
    /// `ingest.max_body_bytes`, so that the largest event ingest accepts is deliverable.
    #[test]
    fn max_in_flight_bytes_is_at_least_a_mib_and_the_largest_body() {
        let k = "ROUTER_DELIVERY__MAX_IN_FLIGHT_BYTES";
        let c = Config::load(None, env(&[])).expect("defaults");
        assert_eq!(c.delivery.max_in_flight_bytes, 256 << 20);
        let e = Config::load(None, env(&[(k, "1048575")])).expect_err("under 1 MiB");
        assert!(
            e.to_string()
                .contains("delivery.max_in_flight_bytes must be at least 1048576"),
            "{e}"
        );
        let e = Config::load(
            None,
            env(&[(k, "2097152"), ("ROUTER_INGEST__MAX_BODY_BYTES", "4194304")]),
        )
        .expect_err("under the largest body");
        assert!(
            e.to_string()
                .contains("delivery.max_in_flight_bytes must be at least 4194304"),
            "{e}"
        );
        let c = Config::load(None, env(&[(k, "1048576")])).expect("1 MiB is fine");
        assert_eq!(c.delivery.max_in_flight_bytes, 1 << 20);
    }

    /// `delivery.max_in_flight`: at least 1 when set; unset, a quarter of the open-file limit
    /// within 64..=4096.
    #[test]
    fn max_in_flight_is_validated_and_derived_from_the_open_file_limit() {
        for v in ["0", "1000001"] {
            let k = "ROUTER_DELIVERY__MAX_IN_FLIGHT";
            let e = Config::load(None, env(&[(k, v)])).expect_err(v);
            assert!(
                e.to_string()
                    .contains("delivery.max_in_flight must be in 1..=1000000"),
                "{e}"
            );
        }
        let c = Config::load(None, env(&[("ROUTER_DELIVERY__MAX_IN_FLIGHT", "16")]))
            .expect("16 is fine");
        assert_eq!(c.delivery.max_in_flight, Some(16));
        assert_eq!(c.delivery.in_flight_limit(), 16);
        let c = Config::load(None, env(&[])).expect("defaults");
        assert_eq!(c.delivery.max_in_flight, None);
        assert_eq!(
            c.delivery.in_flight_limit(),
            derived_in_flight(open_file_limit())
        );
        // The systemd default soft limit: a quarter, next to the listener's half.
        assert_eq!(derived_in_flight(Some(1024)), 256);
        assert_eq!(derived_in_flight(Some(20_000)), 4096);
        assert_eq!(derived_in_flight(Some(100)), 64);
        assert_eq!(derived_in_flight(None), 4096);
    }

    /// Refusals of values that only the token check, the secrets file read or the CA file
    /// read found (after loading, knowing nothing of the environment), and errors inside an
    /// array a variable set, named no variable.
    #[test]
    fn refusals_found_past_the_schema_name_the_variable_too() {
        let hash = "a".repeat(64);
        for (k, v, message) in [
            (
                "ROUTER_AUTH__TOKENS",
                format!("[{{name=\"a\",sha256=\"{hash}\",scopes=[\"admin\"],rate=5}}]"),
                "auth.tokens[0].rate: unknown field `rate`",
            ),
            (
                "ROUTER_AUTH__TOKENS",
                format!("[{{name=\"a\",sha256=\"{hash}\",scopes=\"admin\"}}]"),
                "auth.tokens[0].scopes: invalid type",
            ),
            (
                "ROUTER_AUTH__TOKENS",
                "[{name=\"a\",sha256=\"zz\",scopes=[\"admin\"]}]".to_string(),
                "auth.tokens[0] (a): ",
            ),
            (
                "ROUTER_SECRETS_FILE",
                "/nonexistent/secrets.toml".to_string(),
                "secrets_file /nonexistent/secrets.toml: No such file",
            ),
            (
                "ROUTER_DELIVERY__TLS_CA_FILE",
                "/nonexistent/ca.pem".to_string(),
                "delivery.tls_ca_file /nonexistent/ca.pem: No such file",
            ),
        ] {
            let e = Config::load(None, env(&[(k, &v)])).expect_err(k);
            let text = e.to_string();
            assert!(
                text.contains(message) && text.ends_with(&format!("(set by {k})")),
                "{k}={v}: {text}"
            );
        }
        // The secrets file is still never quoted.
        let dir = tempfile::tempdir().expect("tmp");
        let secrets = dir.path().join("secrets.toml");
        std::fs::write(&secrets, "HOOK = \"Bearer s3cr3t\n").expect("write");
        let e = Config::load(
            None,
            env(&[("ROUTER_SECRETS_FILE", &secrets.display().to_string())]),
        )
        .expect_err("not TOML");
        assert!(
            !e.to_string().contains("s3cr3t") && e.to_string().contains("secrets_file "),
            "{e}"
        );
    }

    /// A URL with a user and password was accepted, never sent to the server, and shown in
    /// /v1/status, metric labels, logs and DLQ entries. It is refused, naming the key and the
    /// options to use, without repeating the password.
    #[test]
    fn credentials_in_a_nats_url_are_refused_without_being_repeated() {
        for (key, var) in [
            ("nats.url", "ROUTER_NATS__URL"),
            ("store.jetstream.url", "ROUTER_STORE__JETSTREAM__URL"),
        ] {
            for url in [
                "nats://routeruser:S3cretPassw0rd@127.0.0.1:4222",
                "nats://127.0.0.1:4223, tls://routeruser:S3cretPassw0rd@10.0.0.2:4222",
                "nats://S3cretPassw0rd@127.0.0.1:4222",
                "nats://routeruser:S3cretPassw0rd@127.0.0.1:notaport",
            ] {
                let e = Config::load(None, env(&[(var, url)])).expect_err(url);
                let text = e.to_string();
                assert!(text.contains(key), "{text}");
                assert!(!text.contains("S3cretPassw0rd"), "{text}");
                if !url.ends_with("notaport") {
                    assert!(
                        text.contains("credentials in the URL are refused"),
                        "{text}"
                    );
                }
                if !url.ends_with("notaport") {
                    let section = key.trim_end_matches(".url");
                    assert!(
                        text.contains(&format!("set {section}.user and {section}.password_env")),
                        "{text}"
                    );
                }
            }
        }
        assert_eq!(without_userinfo("nats://u:p@h:1/x@y"), "nats://***@h:1/x@y");
        assert_eq!(without_userinfo("h:1"), "h:1");
        assert_eq!(without_userinfo("u:p@h:1"), "***@h:1");
    }
}
