//! Operator CLI commands that are clients of the HTTP API: `router dlq …`, `router replay`,
//! `router targets …`, `router rules enable|disable`. Readable tables by default, `--json` for
//! scripts.

use std::time::Duration;

use serde_json::{Value, json};

use crate::admin::targets::target_notes;

/// Exit status when stdout's reader went away: 128 + SIGPIPE, what a shell shows for a command
/// a closed pipe ended (`yes | head` under `set -o pipefail`).
pub const BROKEN_PIPE_EXIT: i32 = 141;

/// Writes one line of the command's output to stdout. Rust ignores SIGPIPE, so a reader that
/// closed the pipe (`router dlq jobs | head -1`) makes the write fail: the reader has what it
/// wanted and the process ends quietly with [`BROKEN_PIPE_EXIT`], where `println!` panicked
/// with a backtrace (status 101). Any other write error (a full disk under a redirect) is
/// reported, status 1.
pub fn write_stdout(line: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let written = out
        .write_fmt(line)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
    match written {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            std::process::exit(BROKEN_PIPE_EXIT)
        }
        Err(e) => {
            crate::errln!("error: cannot write the output: {e}");
            std::process::exit(1)
        }
    }
}

/// Writes diagnostics to stderr (`eprint!` without its panic): a reader of stderr that went
/// away (`router rules check DIR 2>&1 | head -1`) must not turn a finding into a panic with
/// status 101; the exit status still says what the command found. Write errors are ignored:
/// there is nowhere left to report them.
pub fn write_stderr(text: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let mut err = std::io::stderr().lock();
    let _ = err.write_fmt(text).and_then(|()| err.flush());
}

/// `eprintln!` through [`write_stderr`].
#[macro_export]
macro_rules! errln {
    () => {
        $crate::cli::write_stderr(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::cli::write_stderr(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// How long a request waits for its answer unless the command says otherwise (an upload,
/// which the router compiles before it answers, waits longer: `router handlers push
/// --timeout`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a connection to the router may take to open: a router that is there answers its
/// connections at once, so past this it is not (or not reachable).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// `error` and its causes on one line, `: `-separated, each said once: a cause whose text
/// is already on the line (an error that quotes its source, as `CliError::Http` and
/// `ConfigError::Read` do) is left out. Printing every cause of the chain said the same
/// clause twice ("No such file or directory (os error 2): No such file or directory (os
/// error 2)").
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut line = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !text.is_empty() && !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = c.source();
    }
    line
}

/// Error talking to the router API.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The API's base URL (`--api`, `ROUTER_API`) is not one.
    #[error(
        "the router API URL {base:?} (--api or ROUTER_API) is not usable: {reason}; give one like http://127.0.0.1:8080"
    )]
    BadApiUrl {
        /// The URL as given.
        base: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No connection could be made: nothing listens there, or it is not reachable.
    #[error("could not connect to the router at {url}: {source}")]
    Connect {
        /// URL.
        url: String,
        /// Why.
        source: reqwest::Error,
    },
    /// The request was sent but no answer came within the client's timeout: the router may
    /// still be working on it (`hint` says what to check).
    #[error("no answer from the router at {url} within {}{}", humantime::format_duration(*.after), .hint.as_deref().map(|h| format!(" ({h})")).unwrap_or_default())]
    NoAnswer {
        /// URL.
        url: String,
        /// The timeout that passed.
        after: Duration,
        /// What may have happened meanwhile, and how to find out.
        hint: Option<String>,
    },
    /// Any other transport failure (the connection dropped before the answer).
    #[error("the request to the router at {url} failed: {source}")]
    Http {
        /// URL.
        url: String,
        /// Why.
        source: reqwest::Error,
    },
    /// A success status with an answer that is not the router API's JSON: something else
    /// answers at that URL (a proxy's default page, another service, a stale `ROUTER_API`),
    /// and nothing was done.
    #[error(
        "the answer from {url} is not the router API (got {status} {got}): check --api / ROUTER_API; nothing was done by a router there"
    )]
    NotTheRouter {
        /// URL.
        url: String,
        /// HTTP status.
        status: u16,
        /// What came instead (its content type, and why it is not the API's answer).
        got: String,
    },
    /// A paged list changed between its pages every time it was read (rules reloaded while
    /// `router rules ls` read them).
    #[error(
        "the list at {url} changed while it was read page by page ({reads} times in a row); try again"
    )]
    ListChanging {
        /// URL of the list.
        url: String,
        /// How many times it was read.
        reads: u32,
    },
    /// The API answered with an error.
    #[error("{status}: {body}")]
    Api {
        /// HTTP status.
        status: u16,
        /// Error summary and the errors, one per line.
        body: String,
    },
}

/// How many times [`Client::all_pages`] reads a list that changes between its pages before it
/// gives up.
pub const PAGED_READS: u32 = 3;

/// A small client of the router API.
pub struct Client {
    base: String,
    /// Why `base` is not an API URL (checked once, reported by every call).
    base_error: Option<String>,
    http: reqwest::Client,
    /// Sent as `Authorization: Bearer …` when set.
    token: Option<String>,
    /// How long each request waits for its answer.
    timeout: Duration,
    /// Told with a [`CliError::NoAnswer`]: what may have happened anyway.
    timeout_hint: Option<String>,
}

fn describe_error(v: &Value) -> String {
    let mut s = v["error"].as_str().unwrap_or("error").to_string();
    for e in v["errors"].as_array().into_iter().flatten() {
        s.push_str(&format!(
            "\n  {} {}",
            e["pointer"].as_str().unwrap_or(""),
            e["message"].as_str().unwrap_or("")
        ));
    }
    s
}

impl Client {
    /// A client of the API at `base` (e.g. `http://127.0.0.1:8080`), authenticating with
    /// `token` when given.
    pub fn new(base: &str, token: Option<&str>) -> Self {
        crate::target::webhook::install_crypto_provider();
        let base = base.trim_end_matches('/').to_string();
        // Checked here: reqwest only says "builder error: relative URL without a base".
        let base_error = match reqwest::Url::parse(&base) {
            _ if base.is_empty() => Some("it is empty".to_string()),
            // `localhost:8080` parses, as scheme `localhost`.
            Ok(u) if !matches!(u.scheme(), "http" | "https") => Some(format!(
                "it must start with http:// or https://, not {}:",
                u.scheme()
            )),
            Ok(u) if u.host_str().is_none_or(str::is_empty) => Some("it names no host".to_string()),
            Ok(_) => None,
            Err(_) if !base.contains("://") => {
                Some("it must start with http:// or https://".to_string())
            }
            Err(e) => Some(e.to_string()),
        };
        Self {
            base,
            base_error,
            http: reqwest::Client::builder()
                .connect_timeout(CONNECT_TIMEOUT)
                .build()
                .unwrap_or_default(),
            token: token.filter(|t| !t.is_empty()).map(str::to_string),
            timeout: DEFAULT_TIMEOUT,
            timeout_hint: None,
        }
    }

    /// Waits `timeout` for each answer (instead of [`DEFAULT_TIMEOUT`]); past it the error
    /// says `hint`: what may still happen, and how to find out.
    pub fn with_timeout(mut self, timeout: Duration, hint: &str) -> Self {
        self.timeout = timeout;
        self.timeout_hint = Some(hint.to_string());
        self
    }

    fn api_error(&self, status: u16, v: &Value) -> CliError {
        let mut body = describe_error(v);
        if status == 401 {
            body.push_str(if self.token.is_some() {
                "\n  (the token in ROUTER_TOKEN / --token was not accepted)"
            } else {
                "\n  (this router wants a bearer token: set ROUTER_TOKEN or pass --token)"
            });
        }
        CliError::Api { status, body }
    }

    fn request(&self, method: reqwest::Method, url: &str) -> reqwest::RequestBuilder {
        let rb = self.http.request(method, url);
        match &self.token {
            Some(t) => rb.bearer_auth(t),
            None => rb,
        }
    }

    /// Sends a request and returns the JSON answer, or the API's error.
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, CliError> {
        let url = format!("{}{path}", self.base);
        let mut rb = self.request(method, &url);
        if let Some(b) = body {
            rb = rb.json(&b);
        }
        self.send(rb, url).await
    }

    /// Every page of the cursor-paged list `list` of `GET path` (with the query `pairs`,
    /// passing each page's `next` as `after`): the first page's answer with `list` holding
    /// the items of every page and `next` null, so a command shows everything. An answer that
    /// carries a `version` (`/v1/rules`) is read again from the start when a later page comes
    /// from another version, or refuses its cursor (the rule it named went in a reload), up to
    /// [`PAGED_READS`] times: pages of two rule sets joined showed a set that never was.
    pub async fn all_pages(
        &self,
        path: &str,
        pairs: &[(&str, &Option<String>)],
        list: &str,
    ) -> Result<Value, CliError> {
        let mut reads = 0;
        'read: loop {
            reads += 1;
            let again = reads < PAGED_READS;
            let mut whole: Option<Value> = None;
            let mut after: Option<String> = None;
            loop {
                let mut q = pairs.to_vec();
                q.push(("after", &after));
                let url = format!("{path}{}", query(&q));
                let page = match self.call(reqwest::Method::GET, &url, None).await {
                    Ok(page) => page,
                    Err(CliError::Api { status: 400, .. })
                        if again && whole.as_ref().is_some_and(|w| w.get("version").is_some()) =>
                    {
                        continue 'read;
                    }
                    Err(e) => return Err(e),
                };
                let next = page["next"].as_str().map(str::to_string);
                match &mut whole {
                    None => whole = Some(page),
                    Some(w) if w.get("version") != page.get("version") => {
                        if again {
                            continue 'read;
                        }
                        return Err(CliError::ListChanging {
                            url: format!("{}{path}", self.base),
                            reads,
                        });
                    }
                    Some(w) => {
                        let items = page[list].as_array().cloned().unwrap_or_default();
                        if let Some(all) = w[list].as_array_mut() {
                            all.extend(items);
                        }
                    }
                }
                if next.is_none() {
                    let mut w = whole.unwrap_or_default();
                    w["next"] = Value::Null;
                    return Ok(w);
                }
                after = next;
            }
        }
    }

    /// Sends raw bytes of `content_type` as they are (a component, or a file the server keeps
    /// as sent).
    pub async fn call_bytes(
        &self,
        method: reqwest::Method,
        path: &str,
        content_type: &str,
        body: Vec<u8>,
    ) -> Result<Value, CliError> {
        let url = format!("{}{path}", self.base);
        let rb = self
            .request(method, &url)
            .header("content-type", content_type)
            .body(body);
        self.send(rb, url).await
    }

    /// What a failed request's transport error means to the operator: the router was not
    /// there, or it did not answer in time (and may still be working on the request). One
    /// "cannot reach the router" for both sent an operator whose upload was compiling and
    /// about to activate looking for a router that was up.
    fn transport_error(&self, url: String, source: reqwest::Error) -> CliError {
        if source.is_connect() {
            CliError::Connect { url, source }
        } else if source.is_timeout() {
            CliError::NoAnswer {
                url,
                after: self.timeout,
                hint: self.timeout_hint.clone(),
            }
        } else {
            CliError::Http { url, source }
        }
    }

    /// Sends `rb` (a request to `url`) and returns the JSON answer, or the API's error.
    async fn send(&self, rb: reqwest::RequestBuilder, url: String) -> Result<Value, CliError> {
        if let Some(reason) = &self.base_error {
            return Err(CliError::BadApiUrl {
                base: self.base.clone(),
                reason: reason.clone(),
            });
        }
        let resp = rb
            .timeout(self.timeout)
            .send()
            .await
            .map_err(|source| self.transport_error(url.clone(), source))?;
        let status = resp.status().as_u16();
        let content_type = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        if status >= 400 {
            let v: Value = resp.json().await.unwrap_or(Value::Null);
            return Err(self.api_error(status, &v));
        }
        // Every success the router sends these commands is a JSON object or array. Anything
        // else (a 200 HTML page from an ingress's default backend) was taken for success, and
        // `targets pause` printed a table and exited 0 with nothing paused.
        let not_router = |got: String| CliError::NotTheRouter {
            url: url.clone(),
            status,
            got,
        };
        let json_type = content_type.as_deref().is_some_and(is_json_media_type);
        if !json_type {
            return Err(not_router(
                content_type.unwrap_or_else(|| "no content type".to_string()),
            ));
        }
        let bytes = resp
            .bytes()
            .await
            .map_err(|source| self.transport_error(url.clone(), source))?;
        match serde_json::from_slice::<Value>(&bytes) {
            Ok(v @ (Value::Object(_) | Value::Array(_))) => Ok(v),
            Ok(_) => Err(not_router(format!(
                "{}, but not a JSON object",
                content_type.unwrap_or_default()
            ))),
            Err(e) => Err(not_router(format!(
                "{}, but not JSON: {e}",
                content_type.unwrap_or_default()
            ))),
        }
    }
}

/// Whether a `Content-Type` value is JSON (`application/json`, or a `+json` type), whatever
/// its parameters.
fn is_json_media_type(value: &str) -> bool {
    let essence = value
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// The handlers of a `GET /v1/handlers` answer that have an active version (what a handler
/// target can be delivered to).
pub fn active_handlers(v: &Value) -> std::collections::BTreeSet<String> {
    v["handlers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|h| !h["active"].is_null())
        .filter_map(|h| h["name"].as_str().map(str::to_string))
        .collect()
}

/// `router handlers list` as a table: STATE says whether the active version runs here
/// (`loaded`, `loading`, `failed`), and why each failed one did follows the table.
pub fn handlers_table(v: &Value) -> String {
    let handlers = v["handlers"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    let rows: Vec<Vec<String>> = handlers
        .iter()
        .map(|h| {
            vec![
                s(&h["name"]),
                s(&h["state"]),
                s(&h["active"]["version"]),
                h["active"]["sha256"]
                    .as_str()
                    .map(|x| x.chars().take(12).collect())
                    .unwrap_or_else(|| "-".into()),
                s(&h["active"]["uploader"]),
                s(&h["active"]["uploaded_at"]),
                s(&h["versions"]
                    .as_array()
                    .map(Vec::len)
                    .map(Value::from)
                    .unwrap_or(Value::Null)),
            ]
        })
        .collect();
    let mut out = table(
        &[
            "HANDLER", "STATE", "ACTIVE", "SHA256", "UPLOADER", "UPLOADED", "VERSIONS",
        ],
        &rows,
    );
    for h in handlers {
        if let Some(e) = h["load_error"].as_str() {
            out.push_str(&format!("\n{}: {e}", s(&h["name"])));
        }
    }
    out
}

/// Builds a query string from (name, value) pairs, skipping empty ones.
pub fn query(pairs: &[(&str, &Option<String>)]) -> String {
    let parts: Vec<String> = pairs
        .iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}={}", urlencode(v))))
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("?{}", parts.join("&"))
    }
}

/// `s` as one path segment of an API URL: a rule name or target id may hold `#`, `?`, `%`
/// or `/`-free text that a URL would otherwise cut or misread.
pub fn seg(s: &str) -> String {
    urlencode(s)
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// What a table cell shows of `c`: its first line (a handler trap's error goes on with the
/// guest's stderr and a wasm backtrace, and a line break would split the row), at most 60
/// characters. `router dlq show` prints the whole text.
fn cell(c: &str) -> String {
    c.lines().next().unwrap_or("").chars().take(60).collect()
}

/// Renders a table with a header and left-aligned columns.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell(c).chars().count());
            }
        }
    }
    let line = |cells: Vec<String>| {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let c = cell(c);
                format!("{c:<w$}", w = widths.get(i).copied().unwrap_or(0))
            })
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let mut out = vec![line(header.iter().map(|h| h.to_string()).collect())];
    out.extend(rows.iter().map(|r| line(r.clone())));
    out.join("\n")
}

/// A dead letter's target as its filter names it: `none` for the events quarantined at ingest
/// (no target), which `--target none` selects and the metrics label `target="none"`. Shown as
/// `-`, it sent an operator to `--target -`, which matched nothing.
fn dlq_target(v: &Value) -> String {
    match v {
        Value::Null => crate::store::NO_TARGET.to_string(),
        other => s(other),
    }
}

/// `router dlq ls` as a table.
pub fn dlq_table(v: &Value) -> String {
    let rows: Vec<Vec<String>> = v["entries"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            // The error that decided the entry's fate (a max_age_exceeded entry's "not sent:
            // event older than max_age", not the HTTP 500 of the attempt before it); the last
            // attempt's error for entries that keep none of their own.
            let last_error = e["errors"]
                .as_array()
                .and_then(|x| x.first())
                .map(|x| s(&x["message"]))
                .unwrap_or_else(|| {
                    e["attempts"]
                        .as_array()
                        .and_then(|a| a.last())
                        .map(|a| s(&a["error"]))
                        .unwrap_or_default()
                });
            vec![
                s(&e["id"]),
                dlq_target(&e["target"]),
                s(&e["reason"]),
                s(&e["event"]["type"]),
                s(&e["event"]["id"]),
                s(&e["attempt_count"]),
                s(&e["last_failure_at"]),
                last_error,
            ]
        })
        .collect();
    let mut t = table(
        &[
            "ID",
            "TARGET",
            "REASON",
            "TYPE",
            "EVENT",
            "ATTEMPTS",
            "LAST FAILURE",
            "LAST ERROR",
        ],
        &rows,
    );
    if let Some(next) = v["next"].as_str() {
        t.push_str(&format!("\n(more: --after {next})"));
    }
    t
}

/// Most bucket lines `router dlq summary` prints per group; past it, a line says how many
/// more there are and how to see them.
const MAX_BUCKET_LINES: usize = 48;

/// `router dlq summary`: a table of the groups, then each group's histogram with the time of
/// every bucket and the empty stretches between them, so a reader tells a burst (one bucket)
/// from a trickle (buckets spread over hours or days) at a glance. Printing only the non-empty
/// counts ("2 bucket(s): 3 2") hid whether they were a minute or a week apart.
pub fn summary_table(v: &Value) -> String {
    let bucket_ms = v["bucket_seconds"].as_i64().unwrap_or(3600).max(1) * 1000;
    let groups: Vec<&Value> = v["groups"].as_array().into_iter().flatten().collect();
    let histogram = |g: &Value| -> Vec<(i64, String, u64)> {
        g["histogram"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|b| {
                let at = b["bucket"].as_str()?;
                let ms = chrono::DateTime::parse_from_rfc3339(at)
                    .ok()?
                    .timestamp_millis();
                Some((ms, at.to_string(), b["count"].as_u64()?))
            })
            .collect()
    };
    let rows: Vec<Vec<String>> = groups
        .iter()
        .map(|g| {
            let hist = histogram(g);
            let span = match (hist.first(), hist.last()) {
                (Some(a), Some(b)) => (b.0 - a.0) / bucket_ms + 1,
                _ => 0,
            };
            vec![
                dlq_target(&g["target"]),
                s(&g["reason"]),
                s(&g["count"]),
                s(&g["first_failure_at"]),
                s(&g["last_failure_at"]),
                format!("{} of {span} bucket(s)", hist.len()),
            ]
        })
        .collect();
    let mut out = format!(
        "{}\ntotal {} (bucket {}s) — one burst in one bucket points to an outage; a trickle over many to poison",
        table(
            &["TARGET", "REASON", "COUNT", "FIRST", "LAST", "NON-EMPTY"],
            &rows
        ),
        s(&v["total"]),
        s(&v["bucket_seconds"])
    );
    for g in groups {
        let hist = histogram(g);
        let most = hist.iter().map(|b| b.2).max().unwrap_or(1).max(1);
        let width = hist.iter().map(|b| b.1.len()).max().unwrap_or(0);
        out.push_str(&format!(
            "\n\n{} {}:",
            dlq_target(&g["target"]),
            s(&g["reason"])
        ));
        let mut prev: Option<i64> = None;
        for (i, (ms, at, n)) in hist.iter().enumerate() {
            if i == MAX_BUCKET_LINES {
                out.push_str(&format!(
                    "\n  … {} more non-empty bucket(s): narrow --since/--until or use a larger --bucket",
                    hist.len() - i
                ));
                break;
            }
            if let Some(p) = prev {
                let empty = (ms - p) / bucket_ms - 1;
                if empty > 0 {
                    out.push_str(&format!("\n  {:width$}  ({empty} empty bucket(s))", ""));
                }
            }
            prev = Some(*ms);
            let bar = (*n * 30).div_ceil(most);
            out.push_str(&format!(
                "\n  {at:width$}  {n:>6}  {}",
                "#".repeat(usize::try_from(bar).unwrap_or(30))
            ));
        }
    }
    out
}

/// What a job works on, as its spec says: a redrive's filter (`target=erp reason=…`, or
/// `whole DLQ`), a replay's range and pattern.
pub fn job_scope(j: &Value) -> String {
    let spec = &j["spec"];
    if j["kind"] == "replay" {
        let mut out = format!("{} to {}", s(&spec["from"]), s(&spec["to"]));
        if !spec["filter"].is_null() {
            out.push_str(&format!(" matching {}", spec["filter"]));
        }
        // The restriction: which copies the replay makes (without it, every target's).
        for (key, word) in [("rules", "rules"), ("targets", "targets")] {
            let names: Vec<&str> = spec[key]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            if !names.is_empty() {
                out.push_str(&format!(" only {word} {}", names.join(",")));
            }
        }
        return out;
    }
    let parts: Vec<String> = spec["filter"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| format!("{k}={}", s(v)))
        .collect();
    if parts.is_empty() {
        "whole DLQ".into()
    } else {
        parts.join(" ")
    }
}

/// The API route of job `id`'s kind: `router dlq jobs` lists redrives and replays, and each
/// kind is shown and controlled on its own route (a replay's id on the redrive route was a
/// 404).
pub fn job_route(id: &str) -> &'static str {
    if id.starts_with("replay-") {
        "/v1/replay"
    } else {
        "/v1/dlq/redrive"
    }
}

/// One line of job progress.
pub fn job_line(j: &Value) -> String {
    let n = |k: &str| j[k].as_u64().unwrap_or(0);
    let (total, moved) = (n("total"), n("moved"));
    // Items done: each item is moved, failed, skipped or (a replay's, gone from the archive
    // before the job reached it) expired, never two of them.
    let done = moved + n("failed") + n("skipped") + n("expired");
    let pct = (done.min(total) * 100).checked_div(total).unwrap_or(100);
    let width = 30usize;
    let filled = (pct as usize * width / 100).min(width);
    // Only a replay's events can expire: a redrive's line would always say 0.
    let expired = if j["kind"] == "replay" || n("expired") > 0 {
        format!(", {} expired", n("expired"))
    } else {
        String::new()
    };
    format!(
        "{} ({}) [{}{}] {moved}/{total} moved, {} failed, {} skipped{expired} — {}",
        s(&j["id"]),
        job_scope(j),
        "#".repeat(filled),
        ".".repeat(width - filled),
        n("failed"),
        n("skipped"),
        s(&j["state"])
    )
}

/// Writes a new job's `warnings` to stderr (a replay of a range the archive no longer holds
/// in full): said once, when the operator starts it.
pub fn job_warnings(job: &Value) {
    for w in job["warnings"].as_array().into_iter().flatten() {
        crate::errln!("warning: {}", w.as_str().unwrap_or_default());
    }
}

/// A job's line in `router dlq jobs` and `router dlq jobs ID`: its progress (`job_line`) and,
/// while it runs on a shared store, which node runs it and when that node last renewed it (a
/// heartbeat older than 30 s means another node takes the job over).
pub fn job_row(j: &Value) -> String {
    let line = job_line(j);
    match (j["state"].as_str(), j["runner"].as_str()) {
        (Some("running"), Some(runner)) => format!(
            "{line} — runner {runner}, heartbeat {}",
            j["heartbeat_at"].as_str().unwrap_or("-")
        ),
        _ => line,
    }
}

/// Polls a job until it is no longer running, printing its progress: on one line rewritten in
/// place on a terminal, else (a runbook's log) a line each time the progress changes.
pub async fn follow(client: &Client, path: &str) -> Result<Value, CliError> {
    use std::io::IsTerminal as _;
    let tty = std::io::stderr().is_terminal();
    let mut last = String::new();
    loop {
        let j = client.call(reqwest::Method::GET, path, None).await?;
        let line = job_line(&j);
        if tty {
            write_stderr(format_args!("\r{line}"));
        } else if line != last {
            crate::errln!("{line}");
        }
        if j["state"] != "running" {
            if tty {
                crate::errln!();
            }
            return Ok(j);
        }
        last = line;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The exit status of a command that waited for its job (`--wait`): success only when the
/// job ran to `done` with nothing failed or expired, so a script or CI step can tell (a
/// cancelled, paused or partly failed job is 1, and so is a replay that missed events the
/// archive sweep removed before it reached them).
pub fn job_exit(job: &Value) -> std::process::ExitCode {
    let n = |k: &str| job[k].as_u64().unwrap_or(0);
    let ok = job["state"] == "done" && n("failed") == 0 && n("expired") == 0;
    if ok {
        return std::process::ExitCode::SUCCESS;
    }
    let expired = if n("expired") > 0 {
        format!(", {} expired", n("expired"))
    } else {
        String::new()
    };
    crate::errln!(
        "the job ended {} with {} failed{expired}",
        job["state"].as_str().unwrap_or("?"),
        n("failed")
    );
    if let Some(e) = job["last_error"].as_str() {
        crate::errln!("  {e}");
    }
    std::process::ExitCode::from(1)
}

/// `router rules ls`: the live rules (`GET /v1/rules`), one row each, with the operator
/// switches that name no live rule below.
pub fn rules_table(v: &Value) -> String {
    let rows: Vec<Vec<String>> = v["rules"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            let state = if r["disabled_by_operator"] == json!(true) {
                // By whom and since when, where the switch says (one stored before did not).
                let who = [r["disabled_by"].as_str(), r["disabled_at"].as_str()]
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>();
                if who.is_empty() {
                    "disabled (operator)".to_string()
                } else {
                    format!("disabled (operator: {})", who.join(", "))
                }
            } else if r["enabled"] == json!(true) {
                "enabled".to_string()
            } else {
                "disabled (file)".to_string()
            };
            vec![
                s(&r["name"]),
                format!("{}:{}", s(&r["file"]), s(&r["line"])),
                state,
                s(&r["matched_events"]),
                s(&r["last_matched_at"]),
                r["targets"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(s)
                    .collect::<Vec<_>>()
                    .join(","),
            ]
        })
        .collect();
    let mut out = table(
        &["RULE", "FILE", "STATE", "MATCHED", "LAST MATCH", "TARGETS"],
        &rows,
    );
    let absent: Vec<String> = v["disabled_absent"]
        .as_array()
        .into_iter()
        .flatten()
        .map(s)
        .collect();
    if !absent.is_empty() {
        out.push_str(&format!(
            "\ndisabled by an operator, no live rule of that name (it would stay off if it came back; `router rules enable NAME` clears it): {}",
            absent.join(", ")
        ));
    }
    out
}

/// `router targets ls` as a table, with a note per target whose queue waits for something an
/// operator can act on ([`target_notes`]).
pub fn targets_table(v: &Value) -> String {
    let rows: Vec<Vec<String>> = v["targets"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            vec![
                s(&t["id"]),
                s(&t["queued"]),
                s(&t["max_queue_depth"]),
                s(&t["in_flight"]),
                s(&t["oldest_age_seconds"]),
                t["breaker"]["state"].as_str().unwrap_or("-").to_string(),
                if t["paused"] == json!(true) {
                    "paused".into()
                } else {
                    "-".into()
                },
                s(&t["delivered"]),
                s(&t["retried"]),
                s(&t["dlq"]),
            ]
        })
        .collect();
    let table = table(
        &[
            "TARGET",
            "QUEUED",
            "CAP",
            "IN FLIGHT",
            "OLDEST (s)",
            "BREAKER",
            "PAUSED",
            "DELIVERED",
            "RETRIED",
            "DLQ",
        ],
        &rows,
    );
    let notes: Vec<String> = v["targets"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|t| {
            let id = s(&t["id"]);
            target_notes(t)
                .into_iter()
                .map(move |n| format!("  {id}: {n}"))
        })
        .collect();
    if notes.is_empty() {
        table
    } else {
        format!("{table}\n\nwhy queues wait:\n{}", notes.join("\n"))
    }
}

/// What `router status` read from the router: `/v1/status`, and the targets and the DLQ
/// (all of it, and the part since `recent` before the router's clock), or why one of those
/// could not be read (a token without the scope: the report says so and goes on).
pub struct StatusInputs<'a> {
    /// `GET /v1/status`.
    pub status: &'a Value,
    /// `GET /v1/targets`.
    pub targets: Result<&'a Value, String>,
    /// `GET /v1/rules`: the rules an operator disabled are attention items.
    pub rules: Result<&'a Value, String>,
    /// `GET /v1/dlq/summary`.
    pub dlq: Result<&'a Value, String>,
    /// `GET /v1/dlq/summary?since=…`: the dead letters of the last `recent`.
    pub dlq_recent: Result<&'a Value, String>,
    /// How far back "recent" dead letters go.
    pub recent: Duration,
    /// The RFC 3339 time `recent` goes back to (`dlq_recent`'s `since`), which the hint to
    /// the dead letters names so that it can be run as printed.
    pub since: &'a str,
}

/// `router status`: the router at a glance, and what needs an operator now.
pub struct StatusReport {
    /// The lines to print.
    pub text: String,
    /// What needs attention, one line each (empty: nothing does; `router status` exits 0).
    pub attention: Vec<String>,
}

/// `n` bytes the way an operator reads them (`1.5 GiB`).
fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// Whole seconds as `3d4h`, `2h5m`, `4m10s` or `12s`: the two largest units.
fn human_seconds(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m{s}s"),
        (0, _, _) => format!("{h}h{m}m"),
        _ => format!("{d}d{h}h"),
    }
}

/// The router's status (`router status`): one line per part (process, rules, ingest, store,
/// targets, DLQ, jobs), then what needs attention — a router not ready, a store that does
/// not write or refuses ingest, a failed reload, targets whose queues wait on something an
/// operator can act on (the notes of `router targets ls`) or that are paused, dead letters
/// of the last `recent`, jobs with an error, store faults, a NATS connection down — and the
/// router's own warnings, which are shown but do not count as attention (some hold for as
/// long as the configuration does, such as auth being off on a loopback address).
pub fn status_report(i: &StatusInputs<'_>) -> StatusReport {
    let st = i.status;
    let mut attention = Vec::new();
    let mut out = Vec::new();
    let node = st["node"]
        .as_str()
        .map(|n| format!(" · node {n} of {}", s(&st["nodes"])))
        .unwrap_or_default();
    let ready = st["ready"] == json!(true);
    out.push(format!(
        "router {} · up {} · {}{node}",
        s(&st["version"]),
        human_seconds(st["uptime_seconds"].as_u64().unwrap_or(0)),
        if ready { "ready" } else { "NOT READY" }
    ));
    if !ready {
        attention.push(
            "not ready: /readyz answers 503 (starting, shutting down, or the store is not open yet)"
                .to_string(),
        );
    }
    let reload = &st["reload"];
    let commit = reload["rules_git_commit"]
        .as_str()
        .map(|c| format!(", commit {}", c.chars().take(12).collect::<String>()))
        .unwrap_or_default();
    out.push(format!(
        "rules {} ({} rule(s) in {} file(s){commit}) · contracts {} ({}) · last reload {} by {}{}",
        s(&st["rules"]["version"]),
        s(&st["rules"]["rules"]),
        st["rules"]["files"].as_array().map_or(0, Vec::len),
        s(&st["contracts"]["version"]),
        s(&st["contracts"]["count"]),
        s(&reload["last_attempt_at"]),
        s(&reload["last_trigger"]),
        if reload["last_error"].is_null() {
            ", ok"
        } else {
            ", FAILED"
        }
    ));
    if let Some(e) = reload["last_error"].as_str() {
        attention.push(format!(
            "the last reload failed (the rules and contracts before it stay live): {e}"
        ));
    }
    let ingest = &st["ingest"];
    let events = ingest["max_in_flight_events"]
        .as_u64()
        .map(|max| format!(" and {} of {max} events", s(&ingest["in_flight_events"])))
        .unwrap_or_default();
    out.push(format!(
        "ingest {} of {}{events} in flight, refused {} time(s) for saturation · connections {} of {} (refused {})",
        human_bytes(ingest["in_flight_bytes"].as_u64().unwrap_or(0)),
        human_bytes(ingest["max_in_flight_bytes"].as_u64().unwrap_or(0)),
        s(&ingest["saturated_total"]),
        s(&st["connections"]["open"]),
        s(&st["connections"]["max"]),
        s(&st["connections"]["refused_total"]),
    ));
    if let Some(max) = st["delivery"]["max_in_flight"].as_u64() {
        let bytes = st["delivery"]["max_in_flight_bytes"]
            .as_u64()
            .map(|max| {
                format!(
                    ", {} of {} of events held",
                    human_bytes(st["delivery"]["in_flight_bytes"].as_u64().unwrap_or(0)),
                    human_bytes(max)
                )
            })
            .unwrap_or_default();
        out.push(format!(
            "delivery {} of {max} attempts in flight (webhook and NATS targets){bytes}",
            s(&st["delivery"]["in_flight"])
        ));
    }
    let store = &st["store"];
    let size = store["bytes"]
        .as_u64()
        .map_or_else(|| "size unknown".to_string(), human_bytes);
    let writable = store["writable"] == json!(true);
    out.push(format!(
        "store {} {size} (high-water mark {}){}{}",
        s(&store["backend"]),
        human_bytes(store["max_bytes"].as_u64().unwrap_or(0)),
        if writable {
            ", writable"
        } else {
            ", NOT WRITABLE"
        },
        if store["compacting"] == json!(true) {
            ", compacting"
        } else {
            ""
        }
    ));
    if !writable {
        attention.push("the store does not take writes: every write answers 503 meanwhile (a full or failing disk, or the JetStream server out of reach; docs/operations.md)".to_string());
    }
    if store["ingest_refused"] == json!(true) {
        attention.push(format!(
            "ingest answers 503: the store is past its disk high-water mark ({})",
            human_bytes(store["max_bytes"].as_u64().unwrap_or(0))
        ));
    }
    let faults = &store["faults"];
    if faults["corrupt_records"].as_u64().unwrap_or(0) > 0 {
        attention.push(format!(
            "{} deliveries set aside: their event's record cannot be read (`store.faults` in /v1/status)",
            s(&faults["corrupt_records"])
        ));
    }
    if let Some(failing) = faults["failing_leases"]
        .as_object()
        .filter(|f| !f.is_empty())
    {
        attention.push(format!(
            "leases fail for {} target(s): {} (a failing disk? /v1/status store.faults)",
            failing.len(),
            failing.keys().cloned().collect::<Vec<_>>().join(", ")
        ));
    }
    if st["nats"]["connected"] == json!(false) {
        attention.push(format!(
            "the NATS connection of the nats: targets is down: {}",
            s(&st["nats"]["last_event"])
        ));
    }
    match &i.targets {
        Ok(v) => {
            let targets: Vec<&Value> = v["targets"].as_array().into_iter().flatten().collect();
            let sum = |k: &str| targets.iter().filter_map(|t| t[k].as_u64()).sum::<u64>();
            // Seconds with a fraction, as the API sends them.
            let oldest = targets
                .iter()
                .filter_map(|t| t["oldest_age_seconds"].as_f64())
                .fold(None, |m: Option<f64>, a| Some(m.map_or(a, |m| m.max(a))))
                .map(|o| o as u64);
            out.push(format!(
                "targets {} · queued {} · in flight {}{}",
                targets.len(),
                sum("queued"),
                sum("in_flight"),
                oldest
                    .map(|o| format!(" · oldest queued {}", human_seconds(o)))
                    .unwrap_or_default()
            ));
            for t in &targets {
                let id = s(&t["id"]);
                if t["paused"] == json!(true) {
                    attention.push(format!(
                        "target {id} is paused ({} queued; `router targets resume {id}`)",
                        s(&t["queued"])
                    ));
                }
                for note in target_notes(t) {
                    attention.push(format!("target {id}: {note}"));
                }
                // As `targets ls --problems` counts it: a half-open breaker with entries waits
                // for a probe to succeed. One with none waits for the next event to probe with:
                // nothing to do there.
                if crate::admin::targets::breaker_probing(t) {
                    attention.push(format!(
                        "target {id}: breaker half-open, probing whether the receiver is back (`router targets ls` shows its failures)"
                    ));
                }
            }
        }
        Err(why) => out.push(format!("targets: not read ({why})")),
    }
    match &i.rules {
        // A containment left on routes the rule's events nowhere, unlike a pause nothing
        // queues them: it is forgotten easily and costs a replay.
        Ok(v) => {
            for r in v["rules"].as_array().into_iter().flatten() {
                if r["disabled_by_operator"] != json!(true) {
                    continue;
                }
                let name = s(&r["name"]);
                let by = r["disabled_by"]
                    .as_str()
                    .map(|b| format!(" ({b})"))
                    .unwrap_or_default();
                let since = r["disabled_at"]
                    .as_str()
                    .map(|t| format!(" since {t}"))
                    .unwrap_or_default();
                attention.push(format!(
                    "rule {name} disabled by an operator{by}{since}: the events only it matches are routed nowhere ({} such event(s) since the router started, all disabled rules together; `router rules enable {name}`)",
                    s(&v["unrouted_rule_disabled_events"])
                ));
            }
        }
        Err(why) => out.push(format!("rules: not read ({why})")),
    }
    match (&i.dlq, &i.dlq_recent) {
        (Ok(all), recent) => {
            let groups = all["groups"].as_array().map_or(0, Vec::len);
            out.push(format!(
                "dlq {} dead letter(s) in {groups} target × reason group(s)",
                s(&all["total"])
            ));
            if let Ok(recent) = recent {
                let n = recent["total"].as_u64().unwrap_or(0);
                if n > 0 {
                    let which: Vec<String> = recent["groups"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|g| {
                            format!(
                                "{} {} ×{}",
                                dlq_target(&g["target"]),
                                s(&g["reason"]),
                                s(&g["count"])
                            )
                        })
                        .collect();
                    attention.push(format!(
                        "{n} new dead letter(s) in the last {}: {} (`router dlq summary --since {}`)",
                        humantime::format_duration(i.recent),
                        which.join(", "),
                        i.since
                    ));
                }
            }
        }
        (Err(why), _) => out.push(format!("dlq: not read ({why})")),
    }
    let jobs: Vec<&Value> = st["jobs"]["active"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    if jobs.is_empty() {
        out.push("jobs none running".to_string());
    } else {
        out.push(format!("jobs {} running or paused:", jobs.len()));
        for j in &jobs {
            out.push(format!(
                "  {} {} {}: {}/{} moved, {} failed, {} skipped, last item at {}",
                s(&j["id"]),
                s(&j["kind"]),
                s(&j["state"]),
                s(&j["moved"]),
                s(&j["total"]),
                s(&j["failed"]),
                s(&j["skipped"]),
                s(&j["last_item_at"])
            ));
            if let Some(e) = j["last_error"].as_str() {
                attention.push(format!("job {}: {e}", s(&j["id"])));
            } else if j["state"] == "paused" {
                // Left paused, a redrive's dead letters stay where they are once they are
                // older than `--recent`, and nothing else would say so.
                attention.push(format!(
                    "job {} is paused (`router dlq jobs {} resume`, or `cancel`)",
                    s(&j["id"]),
                    s(&j["id"])
                ));
            }
        }
    }
    if let Some(e) = st["jobs"]["error"].as_str() {
        out.push(format!("  (jobs not read: {e})"));
    }
    let warnings: Vec<String> = st["warnings"]
        .as_array()
        .into_iter()
        .flatten()
        .map(s)
        .collect();
    if attention.is_empty() {
        out.push("\nnothing needs attention".to_string());
    } else {
        out.push(format!("\nneeds attention ({}):", attention.len()));
        out.extend(attention.iter().map(|a| format!("  - {a}")));
    }
    if !warnings.is_empty() {
        out.push(format!("\nwarnings ({}):", warnings.len()));
        out.extend(warnings.iter().map(|w| format!("  - {w}")));
    }
    StatusReport {
        text: out.join("\n"),
        attention,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A quiet router needs nothing; each kind of trouble is listed once under "needs
    /// attention", warnings are shown without counting, and a part the token may not read is
    /// said instead of failing the whole report.
    #[test]
    fn the_status_report_lists_what_needs_attention() {
        let quiet = json!({
            "version": "0.1.0", "uptime_seconds": 3725, "ready": true, "node": null,
            "rules": {"version": "abc", "rules": 4, "files": ["r.yaml"]},
            "reload": {"last_attempt_at": "2026-12-07T10:00:00Z", "last_trigger": "start",
                       "last_error": null, "rules_git_commit": null},
            "contracts": {"version": "def", "count": 3},
            "ingest": {"in_flight_bytes": 0, "max_in_flight_bytes": 16777216, "saturated_total": 0},
            "connections": {"open": 1, "max": 512, "refused_total": 0},
            "store": {"backend": "redb", "bytes": 73728, "max_bytes": 1073741824,
                      "writable": true, "ingest_refused": false, "compacting": false,
                      "faults": {"corrupt_records": 0, "failing_leases": {}}},
            "nats": null, "jobs": {"active": []},
            "warnings": ["auth is off"]
        });
        let targets = json!({"targets": [
            {"id": "erp", "queued": 3, "in_flight": 1, "oldest_age_seconds": 75.482,
             "paused": false, "breaker": null, "held_keys": []}
        ]});
        let empty_dlq = json!({"total": 0, "groups": []});
        let no_rules = json!({"rules": [], "unrouted_rule_disabled_events": 0});
        let inputs = |status, targets, recent| StatusInputs {
            status,
            targets,
            rules: Ok(&no_rules),
            dlq: Ok(recent),
            dlq_recent: Ok(recent),
            recent: Duration::from_secs(3600),
            since: "2026-12-07T10:00:00.000Z",
        };
        let r = status_report(&inputs(&quiet, Ok(&targets), &empty_dlq));
        assert!(r.attention.is_empty(), "{:?}", r.attention);
        assert!(
            r.text.starts_with("router 0.1.0 · up 1h2m · ready"),
            "{}",
            r.text
        );
        assert!(
            r.text
                .contains("queued 3 · in flight 1 · oldest queued 1m15s"),
            "{}",
            r.text
        );
        assert!(
            r.text
                .contains("store redb 72.0 KiB (high-water mark 1.0 GiB)"),
            "{}",
            r.text
        );
        assert!(r.text.contains("nothing needs attention"), "{}", r.text);
        assert!(
            r.text.contains("warnings (1):\n  - auth is off"),
            "{}",
            r.text
        );

        let mut troubled = quiet.clone();
        troubled["ready"] = json!(false);
        troubled["reload"]["last_error"] = json!("r.yaml:3: unknown operator");
        troubled["store"]["writable"] = json!(false);
        troubled["jobs"]["active"] = json!([{"id": "j1", "kind": "redrive", "state": "running",
            "moved": 1, "total": 9, "failed": 0, "skipped": 0, "last_item_at": null,
            "last_error": "the store is unavailable"},
            {"id": "j2", "kind": "redrive", "state": "paused", "moved": 0, "total": 3,
             "failed": 0, "skipped": 0, "last_item_at": null, "last_error": null}]);
        let troubled_targets = json!({"targets": [
            {"id": "erp", "queued": 3, "in_flight": 0, "paused": true,
             "breaker": {"state": "open", "since": "t0", "open_until": "t1"}, "held_keys": []},
            {"id": "crm", "queued": 1, "in_flight": 0, "paused": false,
             "breaker": {"state": "half_open"}, "held_keys": []},
            // Half-open with nothing to probe with: the next event is the probe.
            {"id": "quiet", "queued": 0, "in_flight": 0, "paused": false,
             "breaker": {"state": "half_open"}, "held_keys": []}
        ]});
        let recent = json!({"total": 2, "groups": [
            {"target": "erp", "reason": "retries_exhausted", "count": 2}
        ]});
        let r = status_report(&inputs(&troubled, Ok(&troubled_targets), &recent));
        let all = r.attention.join("\n");
        for expected in [
            "not ready",
            "the last reload failed (the rules and contracts before it stay live): r.yaml:3",
            "the store does not take writes",
            "target erp is paused (3 queued; `router targets resume erp`)",
            "target erp: breaker open since t0 until t1",
            "2 new dead letter(s) in the last 1h: erp retries_exhausted ×2 (`router dlq summary --since 2026-12-07T10:00:00.000Z`)",
            "job j1: the store is unavailable",
            "job j2 is paused (`router dlq jobs j2 resume`",
            "target crm: breaker half-open",
        ] {
            assert!(all.contains(expected), "{expected:?} missing from:\n{all}");
        }
        assert!(!all.contains("quiet"), "{all}");
        assert_eq!(r.attention.len(), 9, "{all}");
        assert!(r.text.contains("needs attention (9):"), "{}", r.text);

        let r = status_report(&inputs(&quiet, Err("403: out of scope".into()), &empty_dlq));
        assert!(
            r.text.contains("targets: not read (403: out of scope)"),
            "{}",
            r.text
        );
        assert!(r.attention.is_empty());
    }

    #[test]
    fn the_rules_table_shows_each_rule_s_state_and_matches_and_the_stray_switches() {
        let v = json!({
            "rules": [
                {"name": "a", "file": "r.yaml", "line": 3, "enabled": true,
                 "disabled_by_operator": false, "targets": ["a-0", "a-1"],
                 "matched_events": 12, "last_matched_at": "2026-12-07T10:00:00Z"},
                {"name": "b", "file": "r.yaml", "line": 9, "enabled": false,
                 "disabled_by_operator": true, "targets": ["b-0"],
                 "matched_events": 0, "last_matched_at": null},
                {"name": "c", "file": "s.yaml", "line": 1, "enabled": false,
                 "disabled_by_operator": false, "targets": [],
                 "matched_events": 0, "last_matched_at": null}
            ],
            "disabled_absent": ["old"]
        });
        let text = rules_table(&v);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("RULE"), "{text}");
        assert!(
            lines[1].contains("r.yaml:3")
                && lines[1].contains("enabled")
                && lines[1].contains("12")
                && lines[1].contains("a-0,a-1"),
            "{text}"
        );
        assert!(lines[2].contains("disabled (operator)"), "{text}");
        let mut by = v.clone();
        by["rules"][1]["disabled_by"] = json!("ops");
        by["rules"][1]["disabled_at"] = json!("2026-12-07T09:00:00.000Z");
        let text = rules_table(&by);
        assert!(
            text.lines()
                .nth(2)
                .is_some_and(|l| l.contains("disabled (operator: ops, 2026-12-07T09:00:00.000Z)")),
            "{text}"
        );
        assert!(lines[3].contains("disabled (file)"), "{text}");
        assert!(lines[4].contains("old"), "{text}");
    }

    /// A router that is not there and one that does not answer in time are told apart; the
    /// latter with what may still happen (an upload activating after the client gave up).
    #[tokio::test]
    async fn no_connection_and_no_answer_in_time_are_told_apart() {
        let gone = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let gone_url = format!("http://{}", gone.local_addr().expect("addr"));
        drop(gone);
        let err = Client::new(&gone_url, None)
            .call(reqwest::Method::GET, "/v1/handlers", None)
            .await
            .expect_err("nothing listens");
        assert!(matches!(err, CliError::Connect { .. }), "{err:?}");
        assert!(
            err.to_string()
                .starts_with("could not connect to the router at"),
            "{err}"
        );

        // Accepts, reads, never answers.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", silent.local_addr().expect("addr"));
        let held = tokio::spawn(async move {
            let mut conns = Vec::new();
            while let Ok((c, _)) = silent.accept().await {
                conns.push(c);
            }
        });
        let err = Client::new(&url, None)
            .with_timeout(
                Duration::from_millis(300),
                "the upload may still complete: check `router handlers list`",
            )
            .call_bytes(
                reqwest::Method::PUT,
                "/v1/handlers/h",
                "application/wasm",
                vec![0; 8],
            )
            .await
            .expect_err("no answer");
        held.abort();
        assert!(matches!(err, CliError::NoAnswer { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            format!(
                "no answer from the router at {url}/v1/handlers/h within 300ms (the upload may still complete: check `router handlers list`)"
            )
        );
    }

    #[test]
    fn path_segments_are_encoded() {
        assert_eq!(seg("orders#v2"), "orders%23v2");
        assert_eq!(seg("erp?eu"), "erp%3Feu");
        assert_eq!(seg("50%"), "50%25");
        assert_eq!(seg("plain-id_1.x"), "plain-id_1.x");
    }

    #[test]
    fn query_strings_encode_and_skip_empty() {
        assert_eq!(
            query(&[("a", &Some("x y/z".into())), ("b", &None)]),
            "?a=x%20y%2Fz"
        );
        assert_eq!(query(&[("b", &None)]), "");
    }

    #[test]
    fn a_jobs_route_follows_its_kind() {
        assert_eq!(job_route("replay-3"), "/v1/replay");
        assert_eq!(job_route("replay-12-1a2b"), "/v1/replay");
        assert_eq!(job_route("redrive-4"), "/v1/dlq/redrive");
    }

    /// A restricted replay's line says which copies it makes.
    #[test]
    fn a_restricted_replays_scope_names_its_rules_and_targets() {
        let replay = serde_json::json!({"kind": "replay", "spec": {"from": "a", "to": "b",
            "filter": null, "rules": ["to-erp"], "targets": ["erp", "erp2"]}});
        assert_eq!(
            job_scope(&replay),
            "a to b only rules to-erp only targets erp,erp2"
        );
        let all = serde_json::json!({"kind": "replay", "spec": {"from": "a", "to": "b",
            "filter": null, "rules": null}});
        assert_eq!(job_scope(&all), "a to b");
    }

    #[test]
    fn a_jobs_progress_counts_every_item_it_is_done_with() {
        let redrive = serde_json::json!({"id": "redrive-1", "kind": "redrive", "state": "done",
            "total": 10, "moved": 6, "failed": 3, "skipped": 1});
        assert!(job_line(&redrive).contains(&format!("[{}]", "#".repeat(30))));
        assert!(
            !job_line(&redrive).contains("expired"),
            "{}",
            job_line(&redrive)
        );
        // A replay's events are moved, failed (a copy refused by a queue's cap), skipped or
        // expired (gone from the archive), each once.
        let replay = serde_json::json!({"id": "replay-1", "kind": "replay", "state": "running",
            "total": 20, "moved": 4, "failed": 4, "skipped": 1, "expired": 1});
        let line = job_line(&replay);
        assert!(
            line.contains(&format!("[{}{}]", "#".repeat(15), ".".repeat(15))),
            "{line}"
        );
        assert!(
            line.contains("4/20 moved, 4 failed, 1 skipped, 1 expired — running"),
            "{line}"
        );
    }

    /// The summary shows when each bucket was and the empty stretch between them: two
    /// buckets 9 minutes apart read as such, not as "2 bucket(s): 3 2".
    #[test]
    fn the_summary_shows_each_buckets_time_and_the_gaps_between() {
        let v = serde_json::json!({"total": 5, "bucket_seconds": 60, "groups": [{
        "target": "t400", "reason": "permanent_error", "count": 5,
        "first_failure_at": "2025-01-01T10:00:10Z", "last_failure_at": "2025-01-01T10:09:20Z",
        "histogram": [
            {"bucket": "2025-01-01T10:00:00Z", "count": 3},
            {"bucket": "2025-01-01T10:09:00Z", "count": 2},
        ]}]});
        let t = summary_table(&v);
        assert!(t.contains("2 of 10 bucket(s)"), "{t}");
        let lines: Vec<&str> = t
            .lines()
            .skip_while(|l| !l.starts_with("t400 permanent_error:"))
            .collect();
        assert_eq!(
            lines[1..],
            [
                format!("  2025-01-01T10:00:00Z       3  {}", "#".repeat(30)),
                format!("  {:20}  (8 empty bucket(s))", ""),
                format!("  2025-01-01T10:09:00Z       2  {}", "#".repeat(20)),
            ],
            "{t}"
        );
    }

    /// A job's line says what it works on: which target (or the whole DLQ) a redrive moves,
    /// which range a replay covers.
    #[test]
    fn a_jobs_line_names_its_filter() {
        let redrive = serde_json::json!({"id": "redrive-2", "kind": "redrive", "state": "done",
            "spec": {"filter": {"target": "t400", "reason": "permanent_error"}, "rate_per_sec": 10.0},
            "total": 1, "moved": 1, "failed": 0, "skipped": 0});
        assert!(
            job_line(&redrive).starts_with("redrive-2 (target=t400 reason=permanent_error) ["),
            "{}",
            job_line(&redrive)
        );
        let all = serde_json::json!({"id": "redrive-3", "kind": "redrive", "spec": {"filter": {}}});
        assert!(job_line(&all).contains("(whole DLQ)"), "{}", job_line(&all));
        let replay = serde_json::json!({"id": "replay-1", "kind": "replay",
            "spec": {"from": "2025-01-01T00:00:00Z", "to": "2025-01-02T00:00:00Z", "filter": null}});
        assert!(
            job_line(&replay).contains("(2025-01-01T00:00:00Z to 2025-01-02T00:00:00Z)"),
            "{}",
            job_line(&replay)
        );
    }

    /// A running job's row names the node running it and its last heartbeat (on a shared
    /// store several nodes may run jobs); a finished job's or one without a runner does not.
    #[test]
    fn a_running_jobs_row_names_its_runner_and_heartbeat() {
        let running = serde_json::json!({"id": "redrive-2-9f2c", "kind": "redrive",
            "state": "running", "spec": {"filter": {}}, "total": 4, "moved": 1, "failed": 0,
            "skipped": 0, "runner": "3fa1c2d4e5b60718", "heartbeat_at": "2026-12-07T10:00:05Z"});
        assert!(
            job_row(&running)
                .ends_with("— running — runner 3fa1c2d4e5b60718, heartbeat 2026-12-07T10:00:05Z"),
            "{}",
            job_row(&running)
        );
        let done = serde_json::json!({"id": "redrive-1", "kind": "redrive", "state": "done",
            "runner": "3fa1c2d4e5b60718", "heartbeat_at": "2026-12-07T10:00:05Z"});
        assert_eq!(job_row(&done), job_line(&done));
        let embedded = serde_json::json!({"id": "redrive-3", "state": "running", "runner": null});
        assert_eq!(job_row(&embedded), job_line(&embedded));
    }

    /// A handler whose active version failed to load read as running: the table says so,
    /// and why.
    #[test]
    fn the_handlers_table_shows_which_handlers_run_and_why_not() {
        let v = serde_json::json!({"handlers": [
            {"name": "noop", "state": "failed", "active": {"version": 1, "sha256": "ca1097cb01a9ff", "uploader": "t", "uploaded_at": "x"}, "versions": [{}], "load_error": "cannot load \"noop\" version 1: damaged"},
            {"name": "ok", "state": "loaded", "active": {"version": 2, "sha256": "aa", "uploader": "t", "uploaded_at": "x"}, "versions": [{}], "load_error": null}
        ]});
        let t = handlers_table(&v);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("HANDLER  STATE"), "{t}");
        assert!(lines[1].starts_with("noop     failed  1"), "{t}");
        assert!(lines[2].starts_with("ok       loaded  2"), "{t}");
        assert_eq!(
            lines[3], "noop: cannot load \"noop\" version 1: damaged",
            "{t}"
        );
        assert_eq!(lines.len(), 4, "{t}");
    }

    #[test]
    fn tables_align_columns() {
        let t = table(&["A", "LONGER"], &[vec!["xxxx".into(), "1".into()]]);
        assert_eq!(t, "A     LONGER\nxxxx  1");
    }

    /// An entry dead-lettered unsent for its age shows why it went to the DLQ, not the
    /// error of the attempt before (an HTTP 500 said nothing about max_age).
    #[test]
    fn the_dlq_tables_last_error_is_the_one_that_decided_the_entrys_fate() {
        let v = serde_json::json!({"entries": [{
            "id": 8, "target": "w", "reason": "max_age_exceeded",
            "event": {"type": "t", "id": "e2"}, "attempt_count": 1,
            "last_failure_at": "2026-01-01T00:00:00Z",
            "attempts": [{"error": "HTTP 500"}],
            "errors": [{"pointer": "", "message": "not sent: event older than max_age 3s"}]
        }]});
        let t = dlq_table(&v);
        assert!(
            t.lines()
                .nth(1)
                .is_some_and(|l| l.ends_with("not sent: event older than max_age 3s")),
            "{t}"
        );
    }

    /// A client of a list at `/l` whose answer `answer` gives for (the request's `after`,
    /// how many requests came before it).
    async fn paged_list(
        answer: impl Fn(Option<String>, usize) -> (u16, Value) + Send + Sync + 'static,
    ) -> Client {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let seen = std::sync::Arc::new(AtomicUsize::new(0));
        let answer = std::sync::Arc::new(answer);
        let app = axum::Router::new().route(
            "/l",
            axum::routing::get(
                move |q: axum::extract::Query<std::collections::HashMap<String, String>>| {
                    let n = seen.fetch_add(1, Ordering::SeqCst);
                    let (status, v) = answer(q.get("after").cloned(), n);
                    async move {
                        (
                            axum::http::StatusCode::from_u16(status).expect("status"),
                            axum::Json(v),
                        )
                    }
                },
            ),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        Client::new(&format!("http://{addr}"), None)
    }

    /// The pages of a list join in order, with the first page's other members and no `next`.
    #[tokio::test]
    async fn all_pages_joins_every_page() {
        let c = paged_list(|after, _| {
            let v = match after.as_deref() {
                None => json!({"items": [1, 2], "next": "2", "other": "x"}),
                Some("2") => json!({"items": [3, 4], "next": "4", "other": "x"}),
                Some("4") => json!({"items": [5], "next": null, "other": "x"}),
                Some(_) => return (400, json!({"error": "bad cursor"})),
            };
            (200, v)
        })
        .await;
        let v = c.all_pages("/l", &[], "items").await.expect("pages");
        assert_eq!(
            v,
            json!({"items": [1, 2, 3, 4, 5], "next": null, "other": "x"})
        );
    }

    /// A versioned list (`/v1/rules`) that changes between its pages is read again from the
    /// start, whether a later page says another version or refuses the cursor; one that keeps
    /// changing is an error, not a list of two versions.
    #[tokio::test]
    async fn all_pages_reads_a_list_that_changed_again() {
        // Requests 0 and 1: version a, then b on the second page; 2 and 3: version b whole.
        let c = paged_list(|after, n| match (n, after.as_deref()) {
            (0, None) => (200, json!({"version": "a", "items": [1], "next": "1"})),
            (1, Some("1")) => (200, json!({"version": "b", "items": [9], "next": null})),
            (2, None) => (200, json!({"version": "b", "items": [7], "next": "7"})),
            (3, Some("7")) => (200, json!({"version": "b", "items": [9], "next": null})),
            _ => (500, json!({"error": "unexpected"})),
        })
        .await;
        let v = c.all_pages("/l", &[], "items").await.expect("pages");
        assert_eq!(v["items"], json!([7, 9]));
        // The cursor refused (its rule went), then the whole list.
        let c = paged_list(|after, n| match (n, after.as_deref()) {
            (0, None) => (200, json!({"version": "a", "items": [1], "next": "1"})),
            (1, Some("1")) => (400, json!({"error": "invalid query"})),
            (2, None) => (200, json!({"version": "b", "items": [2], "next": null})),
            _ => (500, json!({"error": "unexpected"})),
        })
        .await;
        let v = c.all_pages("/l", &[], "items").await.expect("pages");
        assert_eq!(v["items"], json!([2]));
        // A new version at every second page.
        let c = paged_list(|after, n| match after {
            None => (200, json!({"version": n, "items": [1], "next": "1"})),
            Some(_) => (200, json!({"version": n, "items": [2], "next": null})),
        })
        .await;
        let e = c.all_pages("/l", &[], "items").await.expect_err("changing");
        assert!(
            matches!(e, CliError::ListChanging { reads, .. } if reads == PAGED_READS),
            "{e}"
        );
        // An unversioned list's refusal is the error it is.
        let c = paged_list(|after, _| match after {
            None => (200, json!({"items": [1], "next": "1"})),
            Some(_) => (400, json!({"error": "invalid query"})),
        })
        .await;
        let e = c.all_pages("/l", &[], "items").await.expect_err("refused");
        assert!(matches!(e, CliError::Api { status: 400, .. }), "{e}");
    }

    /// Serves every request on `listener` with a 200 of `content_type` and `body`, as an
    /// ingress's default backend does.
    async fn answer_everything(
        listener: tokio::net::TcpListener,
        content_type: &'static str,
        body: &'static str,
    ) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        while let Ok((mut c, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 << 10];
                let mut head = Vec::new();
                // Read up to the end of the head, then the body by its length.
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match c.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let text = String::from_utf8_lossy(&head).to_ascii_lowercase();
                let end = text.find("\r\n\r\n").unwrap_or(0) + 4;
                let len: usize = text
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                let mut have = head.len() - end;
                while have < len {
                    match c.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => have += n,
                    }
                }
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = c.write_all(answer.as_bytes()).await;
            });
        }
    }

    /// A 200 that is not the router's JSON (an HTML welcome page of a proxy, JSON of another
    /// kind, no content type) is an error naming the URL, not a success: `targets pause`
    /// against it printed a table and exited 0 with nothing paused.
    #[tokio::test]
    async fn a_success_that_is_not_the_routers_json_is_an_error() {
        for (content_type, body, got) in [
            (
                "text/html",
                "<html><body>Welcome to nginx!</body></html>",
                "got 200 text/html",
            ),
            ("application/json", "null", "but not a JSON object"),
            ("application/json", "<html>", "but not JSON"),
            ("text/plain", "{}", "got 200 text/plain"),
        ] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let base = format!("http://{}", listener.local_addr().expect("addr"));
            let server = tokio::spawn(answer_everything(listener, content_type, body));
            let e = Client::new(&base, None)
                .call(
                    reqwest::Method::POST,
                    "/v1/targets/erp/pause",
                    Some(serde_json::json!({})),
                )
                .await
                .expect_err(body);
            server.abort();
            assert!(matches!(e, CliError::NotTheRouter { .. }), "{e:?}");
            let text = e.to_string();
            assert!(
                text.starts_with(&format!(
                    "the answer from {base}/v1/targets/erp/pause is not the router API"
                )) && text.contains(got)
                    && text.contains("ROUTER_API"),
                "{text}"
            );
        }
        // The router's own answers pass, parameters and all.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let server = tokio::spawn(answer_everything(
            listener,
            "application/json; charset=utf-8",
            r#"{"id":"erp","paused":true}"#,
        ));
        let v = Client::new(&base, None)
            .call(reqwest::Method::POST, "/v1/targets/erp/pause", None)
            .await
            .expect("the router's answer");
        server.abort();
        assert_eq!(v["paused"], true);
        assert!(is_json_media_type("application/problem+json"));
        assert!(!is_json_media_type("application/jsonx"));
    }

    /// An API URL without a scheme, or empty, is said to be one; reqwest said "builder error:
    /// builder error: relative URL without a base".
    #[tokio::test]
    async fn a_bad_api_url_is_named_before_any_request() {
        for (base, why) in [
            ("", "it is empty"),
            ("127.0.0.1:8080", "must start with http:// or https://"),
            (
                "localhost:8080",
                "must start with http:// or https://, not localhost:",
            ),
            ("ftp://x", "not ftp:"),
        ] {
            let e = Client::new(base, None)
                .call(reqwest::Method::GET, "/v1/status", None)
                .await
                .expect_err(base);
            let text = error_chain(&e);
            assert!(
                text.contains("(--api or ROUTER_API) is not usable") && text.contains(why),
                "{base}: {text}"
            );
            assert!(!text.contains("builder error"), "{text}");
        }
    }

    /// A router that is down: each cause once (the clause \"error sending request for url\"
    /// was said twice, once quoted by CliError::Http and once as the chain's next cause).
    #[tokio::test]
    async fn an_unreachable_router_is_said_once() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let e = Client::new(&format!("http://127.0.0.1:{port}"), None)
            .call(reqwest::Method::GET, "/v1/status", None)
            .await
            .expect_err("nothing listens");
        let text = error_chain(&e);
        assert_eq!(text.matches("error sending request").count(), 1, "{text}");
        assert!(
            text.starts_with("could not connect to the router at"),
            "{text}"
        );
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory");
        let read = crate::config::ConfigError::Read {
            path: "/nonexistent.toml".into(),
            source: io,
        };
        assert_eq!(
            error_chain(&read),
            "cannot read config file /nonexistent.toml: No such file or directory"
        );
    }

    /// Quarantined events (no target) show as `none`, the name `--target` selects them by
    /// and the metrics' label, in both DLQ tables.
    #[test]
    fn targetless_dead_letters_show_as_none() {
        let v = serde_json::json!({"entries": [{
            "id": 3, "target": null, "reason": "contract_violation",
            "event": {"type": "t", "id": "q1"}, "attempt_count": 0,
            "last_failure_at": "2026-01-01T00:00:00Z", "attempts": []
        }]});
        let t = dlq_table(&v);
        assert!(
            t.lines()
                .nth(1)
                .is_some_and(|l| l.starts_with("3   none  ")),
            "{t}"
        );
        let v = serde_json::json!({"total": 1, "bucket_seconds": 3600, "groups": [{
            "target": null, "reason": "contract_violation", "count": 1,
            "first_failure_at": "2026-01-01T00:00:00Z", "last_failure_at": "2026-01-01T00:00:00Z",
            "histogram": [{"bucket": "2026-01-01T00:00:00Z", "count": 1}]
        }]});
        let t = summary_table(&v);
        assert!(
            t.lines().nth(1).is_some_and(|l| l.starts_with("none  ")),
            "{t}"
        );
        assert!(t.contains("\n\nnone contract_violation:"), "{t}");
    }

    /// The table says why a queue does not move: a worker that could not start, the
    /// receiver's Retry-After, an open breaker, held keys; a target with none gets no note.
    #[test]
    fn the_targets_table_says_why_a_queue_waits() {
        let v = serde_json::json!({"targets": [
            {"id": "fine", "queued": 0, "held_keys": [], "breaker": {"state": "closed"}},
            {"id": "signed", "queued": 1, "held_keys": [],
             "worker": "not running: signing secret S: not set"},
            {"id": "ship", "queued": 4, "held_keys": [],
             "retry_after_until": "2026-01-01T00:15:00Z",
             "breaker": {"state": "open", "since": "2026-01-01T00:00:00Z",
                         "open_until": "2026-01-01T00:00:30Z"}},
            {"id": "ledger", "queued": 9, "held_keys": ["A", "B", "C", "D"],
             "queued_behind_keys": 7},
        ]});
        let t = targets_table(&v);
        let notes: Vec<&str> = t
            .split("\n\nwhy queues wait:\n")
            .nth(1)
            .expect("notes")
            .lines()
            .collect();
        assert_eq!(
            notes,
            [
                "  signed: not running: signing secret S: not set",
                "  ship: held off until 2026-01-01T00:15:00Z: the receiver answered 429/503 with Retry-After (`router targets resume ship` lifts it)",
                "  ship: breaker open since 2026-01-01T00:00:00Z until 2026-01-01T00:00:30Z",
                "  ledger: 4 ordering key(s) held after a dead letter (\"A\", \"B\", \"C\" and 1 more), 7 entries queued behind them (`router targets release-key ledger <key>`, or redrive the dead letter)",
            ],
            "{t}"
        );
        let quiet = targets_table(&serde_json::json!({"targets": [v["targets"][0].clone()]}));
        assert!(!quiet.contains("why"), "{quiet}");
    }

    /// A handler target whose handler is not uploaded or failed to load gets a note (so a
    /// `--problems` row and an attention item of `router status`); one active or being
    /// compiled gets none. The rows are as `GET /v1/targets` sends them.
    #[test]
    fn a_handler_target_without_its_handler_is_a_problem() {
        let row = |id: &str, state: &str, reason: Option<&str>| {
            serde_json::json!({"id": id, "kind": "handler", "queued": 3, "in_flight": 0,
                "paused": false, "breaker": null, "held_keys": [], "queued_behind_keys": 0,
                "handler": {"name": "enrich", "state": state, "reason": reason}})
        };
        let missing = row(
            "typo",
            "not_uploaded",
            Some("handler \"enrichh\" is not uploaded (or was deleted)"),
        );
        let failed = row(
            "broken",
            "failed",
            Some(
                "handler \"enrich\" could not be loaded (bad magic); upload it again or roll it back",
            ),
        );
        let fine = row("fine", "active", None);
        let compiling = row(
            "soon",
            "compiling",
            Some("handler \"enrich\" version 2 is being compiled"),
        );
        assert_eq!(
            target_notes(&missing),
            [
                "handler \"enrichh\" is not uploaded (or was deleted): its deliveries wait for it, up to their max_age, then go to the DLQ (`router handlers push enrich FILE`, or fix the handler name in the rule)"
            ]
        );
        assert!(crate::admin::targets::target_has_problems(&missing));
        assert!(
            target_notes(&failed)[0]
                .starts_with("handler \"enrich\" could not be loaded (bad magic)")
        );
        assert!(
            !crate::admin::targets::target_has_problems(&fine)
                && !crate::admin::targets::target_has_problems(&compiling)
        );

        let status = json!({"ready": true, "reload": {}, "store": {"writable": true},
            "jobs": {"active": []}, "warnings": []});
        let targets = json!({"targets": [missing, fine]});
        let dlq = json!({"total": 0, "groups": []});
        let no_rules = json!({"rules": [], "unrouted_rule_disabled_events": 0});
        let r = status_report(&StatusInputs {
            status: &status,
            targets: Ok(&targets),
            rules: Ok(&no_rules),
            dlq: Ok(&dlq),
            dlq_recent: Ok(&dlq),
            recent: Duration::from_secs(3600),
            since: "2026-12-07T10:00:00.000Z",
        });
        assert_eq!(r.attention.len(), 1, "{:?}", r.attention);
        assert!(
            r.attention[0].starts_with("target typo: handler \"enrichh\" is not uploaded"),
            "{:?}",
            r.attention
        );
    }

    /// A rule an operator disabled is an attention item of `router status`, naming who and
    /// since when where the switch says, and how to undo it; a rule its file turns off is
    /// not. The rules are as `GET /v1/rules` sends them.
    #[test]
    fn a_rule_disabled_by_an_operator_needs_attention() {
        let status = json!({"ready": true, "reload": {}, "store": {"writable": true},
            "jobs": {"active": []}, "warnings": []});
        let targets = json!({"targets": []});
        let dlq = json!({"total": 0, "groups": []});
        let rules = json!({"unrouted_rule_disabled_events": 3, "rules": [
            {"name": "orders-to-erp", "enabled": false, "disabled_by_operator": true,
             "disabled_at": "2026-12-07T09:00:00.000Z", "disabled_by": "ops"},
            {"name": "old", "enabled": false, "disabled_by_operator": true,
             "disabled_at": null, "disabled_by": null},
            {"name": "off-in-file", "enabled": false, "disabled_by_operator": false,
             "disabled_at": null, "disabled_by": null},
            {"name": "on", "enabled": true, "disabled_by_operator": false,
             "disabled_at": null, "disabled_by": null}
        ]});
        let r = status_report(&StatusInputs {
            status: &status,
            targets: Ok(&targets),
            rules: Ok(&rules),
            dlq: Ok(&dlq),
            dlq_recent: Ok(&dlq),
            recent: Duration::from_secs(3600),
            since: "2026-12-07T10:00:00.000Z",
        });
        assert_eq!(
            r.attention,
            [
                "rule orders-to-erp disabled by an operator (ops) since 2026-12-07T09:00:00.000Z: the events only it matches are routed nowhere (3 such event(s) since the router started, all disabled rules together; `router rules enable orders-to-erp`)",
                "rule old disabled by an operator: the events only it matches are routed nowhere (3 such event(s) since the router started, all disabled rules together; `router rules enable old`)",
            ]
        );
        let r = status_report(&StatusInputs {
            status: &status,
            targets: Ok(&targets),
            rules: Err("403: out of scope".into()),
            dlq: Ok(&dlq),
            dlq_recent: Ok(&dlq),
            recent: Duration::from_secs(3600),
            since: "2026-12-07T10:00:00.000Z",
        });
        assert!(r.attention.is_empty());
        assert!(
            r.text.contains("rules: not read (403: out of scope)"),
            "{}",
            r.text
        );
    }

    /// A queue at its depth cap gets a note (new entries are being dead-lettered), one at
    /// 90 % of it a warning note; below that, or with no cap known, none. QUEUED and IN
    /// FLIGHT count together, as the store's cap does.
    #[test]
    fn a_queue_at_or_near_its_depth_cap_is_noted() {
        let row = |queued: u64, in_flight: u64, cap: Value| {
            json!({"id": "crm", "queued": queued, "in_flight": in_flight, "paused": false,
                "breaker": null, "held_keys": [], "queued_behind_keys": 0,
                "max_queue_depth": cap})
        };
        assert_eq!(
            target_notes(&row(4, 1, json!(5))),
            ["queue at its depth cap (5): new entries go to the DLQ as target_overflow"]
        );
        assert_eq!(
            target_notes(&row(85, 5, json!(100))),
            [
                "queue near its depth cap (90 of 100): at it, new entries go to the DLQ as target_overflow"
            ]
        );
        assert!(target_notes(&row(89, 0, json!(100))).is_empty());
        assert!(target_notes(&row(7, 0, Value::Null)).is_empty());
        let table = targets_table(&json!({"targets": [row(4, 1, json!(5))]}));
        assert!(
            table.starts_with("TARGET  QUEUED  CAP  IN FLIGHT"),
            "{table}"
        );
        assert!(
            table
                .lines()
                .nth(1)
                .is_some_and(|l| l.starts_with("crm     4       5    1 ")),
            "{table}"
        );
    }

    /// A handler trap's error runs over many lines (guest stderr, wasm backtrace): the DLQ
    /// table shows its first line, so each entry stays one row.
    #[test]
    fn a_multi_line_error_is_one_row_of_the_dlq_table() {
        let v = serde_json::json!({"entries": [{
            "id": 7, "target": "h", "reason": "retries_exhausted",
            "event": {"type": "t", "id": "e1"}, "attempt_count": 3,
            "last_failure_at": "2026-01-01T00:00:00Z",
            "attempts": [{"error": "handler_trap: wasm trap: stack overflow (call stack exhausted)\nerror while executing at wasm backtrace:\n    0: 0x1 - f"}]
        }]});
        let t = dlq_table(&v);
        assert_eq!(t.lines().count(), 2, "{t}");
        assert!(
            t.lines()
                .nth(1)
                .unwrap()
                .ends_with("handler_trap: wasm trap: stack overflow (call stack exhauste"),
            "{t}"
        );
    }
}
