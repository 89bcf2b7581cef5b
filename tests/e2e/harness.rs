//! Test harness: spawns the real `router` binary on a free port with a temp data dir, and
//! scripted webhook receivers, so each test reads as a scenario.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use serde_json::{Value, json};

/// A running router process and its directories.
pub struct RouterProc {
    pub dir: tempfile::TempDir,
    pub addr: SocketAddr,
    child: Option<Child>,
    log: Arc<Mutex<Vec<String>>>,
    /// Set: the log reader stops reading at the next line and closes its end of the pipe.
    hang_up: Arc<std::sync::atomic::AtomicBool>,
    extra_env: Vec<(String, String)>,
}

impl RouterProc {
    /// Writes `rules` (file name → text) and `contracts` (relative path → text) into a fresh
    /// temp dir and starts the router on it.
    pub fn start(rules: &[(&str, &str)], contracts: &[(&str, &str)]) -> Self {
        Self::start_with_env(rules, contracts, &[])
    }

    pub fn start_with_env(
        rules: &[(&str, &str)],
        contracts: &[(&str, &str)],
        env: &[(&str, &str)],
    ) -> Self {
        Self::start_full(rules, contracts, env, None)
    }

    /// Starts with a config file (TOML text) as well.
    pub fn start_full(
        rules: &[(&str, &str)],
        contracts: &[(&str, &str)],
        env: &[(&str, &str)],
        config: Option<&str>,
    ) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        for (name, text) in rules {
            write(&dir.path().join("rules").join(name), text);
        }
        std::fs::create_dir_all(dir.path().join("rules")).expect("rules dir");
        for (name, text) in contracts {
            write(&dir.path().join("contracts").join(name), text);
        }
        // Passed with --contracts: a configured directory that does not exist stops the router.
        std::fs::create_dir_all(dir.path().join("contracts")).expect("contracts dir");
        if let Some(c) = config {
            write(&dir.path().join("router.toml"), c);
        }
        let mut p = Self {
            dir,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            child: None,
            log: Arc::new(Mutex::new(Vec::new())),
            hang_up: Arc::default(),
            extra_env: env
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
        };
        p.spawn();
        p
    }

    /// Whether this run puts the routers on the JetStream store (scripts/test.sh's second
    /// pass); tests of the embedded store's own mechanics (its file, its compaction) skip then.
    pub fn on_jetstream() -> bool {
        std::env::var_os("E2E_JETSTREAM_URL").is_some()
    }

    /// The running router's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("router is running").id()
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn spawn(&mut self) {
        let mut cmd = self.command(
            &self.dir.path().join("rules"),
            &self.dir.path().join("contracts"),
        );
        let mut child = cmd.spawn().expect("spawn router");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        let log = self.log.clone();
        let hang_up = self.hang_up.clone();
        hang_up.store(false, std::sync::atomic::Ordering::SeqCst);
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if hang_up.load(std::sync::atomic::Ordering::SeqCst) {
                    log.lock().expect("log").push(line);
                    break;
                }
                if let Some(addr) = line
                    .find("router listening")
                    .and_then(|i| line[i..].split("listen=").nth(1))
                {
                    let addr = addr.split_whitespace().next().unwrap_or("").to_string();
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(addr);
                    }
                }
                log.lock().expect("log").push(line);
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!("router did not start; log:\n{}", self.log_text());
            }
        };
        self.addr = addr.parse().expect("listen address in log");
        self.child = Some(child);
    }

    /// Runs `router serve` on this router's data dir and config with `rules` and `contracts` as
    /// its directories, while this one is stopped, expecting it to refuse to start: its exit
    /// code and stderr. Panics if it is still running after 60 s.
    pub fn serve_refused(&self, rules: &Path, contracts: &Path) -> (Option<i32>, String) {
        assert!(self.child.is_none(), "stop the router first");
        let mut child = self
            .command(rules, contracts)
            .spawn()
            .expect("spawn router");
        let deadline = Instant::now() + Duration::from_secs(60);
        while child.try_wait().expect("wait").is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                let out = child.wait_with_output().expect("output");
                panic!(
                    "the router started; log:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output().expect("output");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// `router serve` on this router's data dir, config and environment, with `rules` and
    /// `contracts` as its directories.
    fn command(&self, rules: &Path, contracts: &Path) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_router"));
        cmd.arg("serve")
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--data-dir")
            .arg(self.data_dir())
            .arg("--rules")
            .arg(rules)
            .arg("--contracts")
            .arg(contracts);
        let config = self.dir.path().join("router.toml");
        if config.exists() {
            cmd.arg("--config").arg(config);
        }
        cmd.env(
            "RUST_LOG",
            std::env::var("E2E_RUST_LOG").unwrap_or_else(|_| "info".into()),
        )
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
        // The suite's second run puts every router on the JetStream store (scripts/test.sh
        // starts the server): each router process gets a stream of its own, the same across
        // its restarts.
        if let Ok(url) = std::env::var("E2E_JETSTREAM_URL") {
            let id: String = self
                .dir
                .path()
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
                .chars()
                .filter(char::is_ascii_alphanumeric)
                .collect();
            cmd.env("ROUTER_STORE__BACKEND", "jetstream")
                .env("ROUTER_STORE__JETSTREAM__URL", url)
                .env("ROUTER_STORE__JETSTREAM__STREAM", format!("E2E_{id}"))
                .env("ROUTER_STORE__JETSTREAM__PREFIX", format!("e2e.{id}"));
        }
        for (k, v) in &self.extra_env {
            cmd.env(k, v);
        }
        cmd
    }

    pub fn log_text(&self) -> String {
        self.log.lock().expect("log").join("\n")
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// kill -9: no chance to flush or clean up.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Closes the reading end of the router's stderr at its next log line, as a log shipper
    /// that goes away does: the router's later log lines meet a broken pipe.
    pub fn hang_up_log(&self) {
        self.hang_up
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Sends `signal` (`HUP`, `TERM`, …) to the router.
    pub fn signal(&self, signal: &str) {
        let pid = self.pid().to_string();
        let _ = Command::new("kill")
            .args([format!("-{signal}").as_str(), &pid])
            .status();
    }

    /// SIGTERM and wait for the exit status.
    pub fn sigterm(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("running");
        let pid = c.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(s) = c.try_wait().expect("wait") {
                return s;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                panic!("router did not exit within 30s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sets (or with `None` removes) an environment variable for the next (re)start.
    pub fn set_env(&mut self, key: &str, value: Option<&str>) {
        self.extra_env.retain(|(k, _)| k != key);
        if let Some(v) = value {
            self.extra_env.push((key.to_string(), v.to_string()));
        }
    }

    /// Waits for the process to exit on its own (a crash point); `None` if it is still
    /// running after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            let c = self.child.as_mut()?;
            if let Some(s) = c.try_wait().expect("wait") {
                self.child = None;
                return Some(s);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts again on the same directories (a new port).
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }
}

impl Drop for RouterProc {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            eprintln!(
                "---- router log ----\n{}\n--------------------",
                self.log_text()
            );
        }
    }
}

fn write(path: &Path, text: &str) {
    if let Some(p) = path.parent() {
        std::fs::create_dir_all(p).expect("mkdir");
    }
    std::fs::write(path, text).expect("write");
}

/// One request a receiver saw.
#[derive(Debug, Clone)]
pub struct Received {
    pub at: Instant,
    pub headers: HeaderMap,
    pub body: Value,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    }
    pub fn event_id(&self) -> String {
        self.body["id"].as_str().unwrap_or_default().to_string()
    }
}

/// The `Idempotency-Key`s each event id arrived with in `received` (one per event when
/// redeliveries kept their key).
pub fn keys_by_event(
    received: &[Received],
) -> std::collections::HashMap<String, std::collections::HashSet<String>> {
    let mut keys: std::collections::HashMap<_, std::collections::HashSet<_>> =
        std::collections::HashMap::new();
    for g in received {
        keys.entry(g.event_id())
            .or_default()
            .insert(g.header("idempotency-key").unwrap_or_default());
    }
    keys
}

/// What a receiver answers: status, delay, extra headers.
pub type Script =
    Arc<dyn Fn(&Value, usize) -> (u16, Duration, Vec<(&'static str, String)>) + Send + Sync>;

/// A webhook receiver: a small HTTP server whose answers the test scripts. The script gets the
/// event and how many times this event id was seen before (0 on the first delivery).
#[derive(Clone)]
pub struct Receiver {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Received>>>,
    counts: Arc<Mutex<HashMap<String, usize>>>,
    shutdown: tokio_util::sync::CancellationToken,
}

impl Receiver {
    /// A receiver that always answers 200.
    pub async fn ok() -> Self {
        Self::scripted(Arc::new(|_, _| (200, Duration::ZERO, vec![]))).await
    }

    /// A receiver that always answers `status`.
    pub async fn status(status: u16) -> Self {
        Self::scripted(Arc::new(move |_, _| (status, Duration::ZERO, vec![]))).await
    }

    /// A receiver that answers its first request ever 429 with `Retry-After: seconds`, after
    /// `delay`, and every other request 200.
    pub async fn retry_after_first(delay: Duration, seconds: u32) -> Self {
        let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        Self::scripted(Arc::new(move |_, _| {
            if answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                (429, delay, vec![("retry-after", seconds.to_string())])
            } else {
                (200, Duration::ZERO, vec![])
            }
        }))
        .await
    }

    pub async fn scripted(script: Script) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        Self::on_listener(listener, script)
    }

    pub fn on_listener(listener: tokio::net::TcpListener, script: Script) -> Self {
        let addr = listener.local_addr().expect("addr");
        let (app, seen, counts) = Self::app(script);
        let shutdown = tokio_util::sync::CancellationToken::new();
        let sd = shutdown.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move { sd.cancelled().await })
                .await;
        });
        Self {
            addr,
            seen,
            counts,
            shutdown,
        }
    }

    /// A receiver answering 200 over HTTPS with a fresh self-signed certificate for
    /// `localhost` and 127.0.0.1; returns it with the certificate's PEM (the CA to trust).
    pub async fn tls() -> (Self, String) {
        let _ = tokio_rustls::rustls::crypto::ring::default_provider().install_default();
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()])
            .expect("self-signed certificate");
        let pem = cert.cert.pem();
        let key = tokio_rustls::rustls::pki_types::PrivateKeyDer::Pkcs8(
            cert.signing_key.serialize_der().into(),
        );
        let config = tokio_rustls::rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(vec![cert.cert.der().clone()], key)
            .expect("server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (app, seen, counts) = Self::app(Arc::new(|_, _| (200, Duration::ZERO, vec![])));
        let shutdown = tokio_util::sync::CancellationToken::new();
        let sd = shutdown.clone();
        tokio::spawn(async move {
            loop {
                let (tcp, _) = tokio::select! {
                    _ = sd.cancelled() => return,
                    r = listener.accept() => match r { Ok(x) => x, Err(_) => continue },
                };
                let (acceptor, app) = (acceptor.clone(), app.clone());
                tokio::spawn(async move {
                    // A client that refuses the certificate ends the handshake: nothing to serve.
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = hyper_util::service::TowerToHyperService::new(app);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        (
            Self {
                addr,
                seen,
                counts,
                shutdown,
            },
            pem,
        )
    }

    /// An HTTPS URL of a `tls()` receiver (by name, so the certificate's name is checked).
    pub fn https_url(&self) -> String {
        format!("https://localhost:{}/hook", self.addr.port())
    }

    #[allow(clippy::type_complexity)]
    fn app(
        script: Script,
    ) -> (
        axum::Router,
        Arc<Mutex<Vec<Received>>>,
        Arc<Mutex<HashMap<String, usize>>>,
    ) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let counts = Arc::new(Mutex::new(HashMap::new()));
        let (s2, c2) = (seen.clone(), counts.clone());
        let app = axum::Router::new().fallback(move |headers: HeaderMap, body: Bytes| {
            let (seen, counts, script) = (s2.clone(), c2.clone(), script.clone());
            async move {
                let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                let id = v["id"].as_str().unwrap_or_default().to_string();
                let n = {
                    let mut c = counts.lock().expect("counts");
                    let e = c.entry(id).or_insert(0);
                    *e += 1;
                    *e - 1
                };
                seen.lock().expect("seen").push(Received {
                    at: Instant::now(),
                    headers,
                    body: v.clone(),
                });
                let (status, delay, extra) = script(&v, n);
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                let mut resp = axum::http::Response::builder()
                    .status(StatusCode::from_u16(status).expect("status"));
                for (k, val) in extra {
                    resp = resp.header(k, val);
                }
                resp.body(axum::body::Body::from("{}")).expect("response")
            }
        });
        (app, seen, counts)
    }

    pub fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    pub fn stop(&self) {
        self.shutdown.cancel();
    }

    pub fn received(&self) -> Vec<Received> {
        self.seen.lock().expect("seen").clone()
    }

    pub fn count(&self) -> usize {
        self.seen.lock().expect("seen").len()
    }

    /// Distinct event ids received.
    pub fn distinct_ids(&self) -> std::collections::HashSet<String> {
        self.received().iter().map(Received::event_id).collect()
    }

    /// Waits until `pred` holds, up to `timeout`.
    /// The count once no request has arrived for `quiet` (at most `max`): requests a killed
    /// router had already sent may still be in this process's socket buffers, and a loaded
    /// machine can take a while to read them.
    pub async fn settled_count(&self, quiet: Duration, max: Duration) -> usize {
        let deadline = Instant::now() + max;
        let mut last = self.count();
        loop {
            tokio::time::sleep(quiet).await;
            let now = self.count();
            if now == last || Instant::now() > deadline {
                return now;
            }
            last = now;
        }
    }

    pub async fn wait_for(&self, timeout: Duration, pred: impl Fn(&[Received]) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if pred(&self.received()) {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The SHA-256 (hex) of a bearer token, as `[[auth.tokens]]` stores it.
pub fn token_sha256(token: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(token.as_bytes()))
}

/// `[[auth.tokens]]` entries for `(name, team, scope)`: the token is its name, the team the
/// token's own when `None`.
pub fn tokens_config(tokens: &[(&str, Option<&str>, &str)]) -> String {
    tokens
        .iter()
        .map(|(name, team, scope)| {
            let team = team.map(|t| format!("team = \"{t}\"\n")).unwrap_or_default();
            format!(
                "[[auth.tokens]]\nname = \"{name}\"\n{team}sha256 = \"{}\"\nscopes = [\"{scope}\"]\n\n",
                token_sha256(name)
            )
        })
        .collect()
}

/// Sends `method path` with bearer `token` and an optional `(content type, body)`; returns
/// (status, JSON body or null).
pub async fn send_as(
    r: &RouterProc,
    method: &str,
    path: &str,
    token: &str,
    body: Option<(&str, Vec<u8>)>,
) -> (u16, Value) {
    let mut rb = client()
        .request(method.parse().expect("method"), r.url(path))
        .bearer_auth(token);
    if let Some((ct, b)) = body {
        rb = rb.header("content-type", ct).body(b);
    }
    let resp = rb.send().await.expect("send");
    let s = resp.status().as_u16();
    (s, resp.json::<Value>().await.unwrap_or(Value::Null))
}

/// A structured CloudEvent.
pub fn event(id: &str, ty: &str, data: Value) -> Value {
    json!({"specversion": "1.0", "id": id, "source": "/test", "type": ty, "data": data})
}

/// An HTTP client with sane timeouts.
pub fn client() -> reqwest::Client {
    router::target::webhook::install_crypto_provider();
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

/// POSTs one structured event; returns (status, body).
pub async fn post_event(r: &RouterProc, ev: &Value) -> (u16, Value) {
    post_raw(
        r,
        "application/cloudevents+json",
        ev.to_string().into_bytes(),
    )
    .await
}

/// POSTs one structured event as a producer that honours back-pressure would: a 503 with
/// `Retry-After` (the store compacting its file, which a drained backlog can start at any
/// time) is sent again after that wait, for at most a minute. Returns the last answer.
pub async fn post_event_honouring_retry_after(r: &RouterProc, ev: &Value) -> (u16, Value) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let resp = send_raw(r, "application/cloudevents+json", ev.to_string()).await;
        let status = resp.status().as_u16();
        let wait = retry_after_header(&resp).and_then(|v| v.parse::<u64>().ok());
        let body = resp.json::<Value>().await.unwrap_or(Value::Null);
        match wait {
            Some(secs) if status == 503 && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_secs(secs.min(5))).await;
            }
            _ => return (status, body),
        }
    }
}

/// POSTs a structured event to a router armed to crash right after it accepts it: the status,
/// or `None` when the process died before the answer left (delivery starts the moment the
/// accept is durable, so the crash can win that race; the event is on disk either way, which
/// the caller checks after the restart).
pub async fn post_event_before_a_crash(r: &RouterProc, ev: &Value) -> Option<u16> {
    client()
        .post(r.url("/v1/events"))
        .header("content-type", "application/cloudevents+json")
        .body(ev.to_string())
        .send()
        .await
        .ok()
        .map(|resp| resp.status().as_u16())
}

/// A response's `Retry-After` header, as text.
pub fn retry_after_header(resp: &reqwest::Response) -> Option<String> {
    resp.headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// POSTs raw bytes with a content type to the ingest endpoint; the whole response.
pub async fn send_raw(
    r: &RouterProc,
    content_type: &str,
    body: impl Into<reqwest::Body>,
) -> reqwest::Response {
    client()
        .post(r.url("/v1/events"))
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .expect("post")
}

/// POSTs raw bytes with a content type.
pub async fn post_raw(r: &RouterProc, content_type: &str, body: Vec<u8>) -> (u16, Value) {
    let resp = send_raw(r, content_type, body).await;
    let status = resp.status().as_u16();
    let v = resp.json::<Value>().await.unwrap_or(Value::Null);
    (status, v)
}

/// Config under which the sweeper removes events a second after they were accepted (once
/// delivered), checking every 200 ms.
pub const SWEEP_SOON: [(&str, &str); 4] = [
    ("ROUTER_DELIVERY__SWEEP_INTERVAL", "200ms"),
    ("ROUTER_DELIVERY__RETENTION", "1s"),
    ("ROUTER_INGEST__DEDUP_WINDOW", "1s"),
    ("ROUTER_ARCHIVE__RETENTION", "1s"),
];

/// POSTs `events` as one CloudEvents batch and asserts the 202.
pub async fn post_batch(r: &RouterProc, events: &[Value]) {
    let (status, body) = post_raw(
        r,
        "application/cloudevents-batch+json",
        serde_json::to_vec(events).expect("json"),
    )
    .await;
    assert_eq!(status, 202, "{body}");
}

/// POSTs a JSON body to an API path; returns (status, body).
/// Waits (up to `timeout`) until the job at `path` (a redrive or replay) is `done`; returns it.
pub async fn job_done(r: &RouterProc, path: &str, timeout: Duration) -> Value {
    eventually(timeout, || async {
        let (_, j) = get_json(r, path).await;
        (j["state"] == "done").then_some(j)
    })
    .await
    .unwrap_or_else(|| panic!("job {path} did not finish"))
}

pub async fn post_json(r: &RouterProc, path: &str, body: Value) -> (u16, Value) {
    let resp = client()
        .post(r.url(path))
        .json(&body)
        .send()
        .await
        .expect("post");
    let s = resp.status().as_u16();
    (s, resp.json().await.unwrap_or(Value::Null))
}

/// PUTs a JSON body to an API path; returns (status, body).
pub async fn put_json(r: &RouterProc, path: &str, body: Value) -> (u16, Value) {
    let resp = client()
        .put(r.url(path))
        .json(&body)
        .send()
        .await
        .expect("put");
    let s = resp.status().as_u16();
    (s, resp.json().await.unwrap_or(Value::Null))
}

/// GET returning JSON.
pub async fn get_json(r: &RouterProc, path: &str) -> (u16, Value) {
    let resp = client().get(r.url(path)).send().await.expect("get");
    let status = resp.status().as_u16();
    (status, resp.json::<Value>().await.unwrap_or(Value::Null))
}

/// The `/metrics` text ("" when it cannot be read).
pub async fn metrics_text(r: &RouterProc) -> String {
    match client().get(r.url("/metrics")).send().await {
        Ok(resp) => resp.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// The value of the counter line `series` (name and labels) in a `/metrics` text, 0 if absent.
pub fn counter(metrics: &str, series: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0)
}

/// The lines of `metrics` that mention `needle` (for assertion messages).
pub fn metric_lines(metrics: &str, needle: &str) -> String {
    metrics
        .lines()
        .filter(|l| l.contains(needle))
        .collect::<Vec<_>>()
        .join("\n")
}

pub async fn fate(r: &RouterProc, id: &str) -> Value {
    get_json(r, &format!("/v1/events/{id}?source=/test"))
        .await
        .1
}

/// Every item of the cursor-paged list `key` at `path` (which may carry a query), following
/// each page's `next` as `after`; `None` when a page is not a 200 with that list.
pub async fn all_pages(r: &RouterProc, path: &str, key: &str) -> Option<Vec<Value>> {
    let mut items = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let sep = if path.contains('?') { '&' } else { '?' };
        let url = match &after {
            Some(a) => format!("{path}{sep}after={}", urlencoding(a)),
            None => path.to_string(),
        };
        let (status, page) = get_json(r, &url).await;
        if status != 200 {
            return None;
        }
        items.extend(page[key].as_array()?.iter().cloned());
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_string()),
            None => return Some(items),
        }
    }
}

/// `s` percent-encoded for a query value: the CLI's own encoder (every byte outside the
/// unreserved set).
pub fn urlencoding(s: &str) -> String {
    router::cli::seg(s)
}

/// Waits until no target has an entry queued or in flight, up to `timeout`; whether it did.
pub async fn queues_drained(r: &RouterProc, timeout: Duration) -> bool {
    eventually(timeout, || async {
        let targets = all_pages(r, "/v1/targets", "targets").await?;
        let busy = targets
            .iter()
            .any(|x| x["queued"] != 0 || x["in_flight"] != 0);
        (!busy).then_some(())
    })
    .await
    .is_some()
}

/// Polls `f` until it returns Some, up to `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A rule file with one rule, `name`, sending events of type `ty` to one webhook at `url`
/// whose target id is `id` (no policies).
pub fn webhook_rule(name: &str, ty: &str, url: &str, id: &str) -> String {
    rules_yaml(
        "",
        &[(name, ty, &[format!("webhook: {url}\n        id: {id}")])],
    )
}

/// A rule file with one rule per (name, type, webhook url, policy yaml).
pub fn rules_yaml(policies: &str, rules: &[(&str, &str, &[String])]) -> String {
    let mut s = String::new();
    if !policies.is_empty() {
        s.push_str("policies:\n");
        s.push_str(policies);
        s.push('\n');
    }
    s.push_str("rules:\n");
    for (name, ty, targets) in rules {
        s.push_str(&format!(
            "  - name: {name}\n    pattern:\n      type: [{ty}]\n    targets:\n"
        ));
        for t in targets.iter() {
            s.push_str(&format!("      - {t}\n"));
        }
    }
    s
}
