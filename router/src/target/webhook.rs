//! Webhook target: HTTP POST of the structured CloudEvent.
//!
//! Sends `Idempotency-Key` (stable across retries) and `traceparent`; does not follow
//! redirects (a 3xx is permanent: the URL in the rule file is wrong); reads at most
//! `max_response_bytes` of the answer, for the attempt's error text.
//!
//! Two transports, one behaviour: plain `http://` URLs go through hyper's pooled client
//! directly, everything else (HTTPS, URLs with credentials, or any URL while a proxy is set in
//! the environment, which reqwest honours) through reqwest. Measured on the bench machine,
//! reqwest spent 15.8–18.0 µs of client CPU per 1 KB POST against 10.9–11.6 µs for hyper's
//! client (docs/BENCHMARKS.md, fifteenth session): a delivery's largest fixed cost after the
//! store.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};

use super::{AttemptOutcome, DeliveryRequest, LocalExhaustion, Target};

/// Error building a webhook target from its configuration.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// A header name or value from the rule file is not valid HTTP.
    #[error("invalid header {0:?}")]
    Header(String),
    /// The HTTP client could not be built (why is reqwest's error, the source: repeated in
    /// this message it was printed twice).
    #[error("http client")]
    Client(#[from] reqwest::Error),
    /// `delivery.tls_ca_file` could not be read or holds no certificate.
    #[error("delivery.tls_ca_file {path}: {message}")]
    CaFile {
        /// The configured path.
        path: String,
        /// What is wrong with it.
        message: String,
    },
}

/// hyper's pooled client for plain-HTTP webhooks.
pub type PlainClient = hyper_util::client::legacy::Client<HttpConnector, Full<Bytes>>;

/// The HTTP clients all webhooks share (one connection pool each).
#[derive(Clone)]
pub struct WebhookClients {
    /// HTTPS, and every URL the plain client does not take.
    pub tls: reqwest::Client,
    /// Plain `http://` without a proxy; `None` when the environment sets one (`HTTP_PROXY`,
    /// `ALL_PROXY`, lower case too), so those requests keep going through reqwest's proxy
    /// support.
    pub plain: Option<PlainClient>,
}

/// How one webhook sends.
enum Transport {
    Plain {
        client: PlainClient,
        uri: hyper::Uri,
    },
    Reqwest {
        client: reqwest::Client,
        url: String,
    },
}

/// One webhook destination.
pub struct Webhook {
    transport: Transport,
    headers: HeaderMap,
    max_response_bytes: usize,
    /// Standard Webhooks signing keys (two during a rotation); empty = unsigned.
    signing_keys: Vec<Vec<u8>>,
}

/// The fewest bytes of key a signing secret may have. Standard Webhooks' secrets are 24 to 64
/// bytes; 16 (128 bits) is the floor below which an HMAC key is guessable, and what catches a
/// `whsec_` with nothing after it, or a placeholder such as `changeme`.
pub const MIN_SIGNING_KEY_BYTES: usize = 16;

/// Why a signing secret's value cannot sign.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SecretError {
    /// Nothing but whitespace: such a target sent its webhooks unsigned, with no word of it.
    #[error(
        "the value is empty; set the secret (or remove secret_env from the target to send unsigned)"
    )]
    Empty,
    /// A key too short to be a secret (`whsec_` alone signed with an empty HMAC key).
    #[error(
        "secret {position} has {bytes} bytes of key, fewer than {MIN_SIGNING_KEY_BYTES} (Standard Webhooks secrets are `whsec_` and 24 to 64 bytes in base64)"
    )]
    TooShort {
        /// Which secret of the value (1-based; two during a rotation).
        position: usize,
        /// Its key's length.
        bytes: usize,
    },
    /// `whsec_` followed by something that is not base64.
    #[error("secret {position}: whsec_ secret is not valid base64: {source}")]
    Base64 {
        /// Which secret of the value (1-based).
        position: usize,
        /// The decoder's error.
        source: base64::DecodeError,
    },
}

/// Parses a secret value: one or more whitespace-separated secrets (two during a rotation),
/// each `whsec_<base64>` (the Standard Webhooks form) or raw text. An empty value or a key
/// shorter than [`MIN_SIGNING_KEY_BYTES`] is an error, so the target does not start: a
/// configured secret that cannot sign must not turn into unsigned or weakly signed requests.
pub fn parse_secrets(value: &str) -> Result<Vec<Vec<u8>>, SecretError> {
    use base64::Engine as _;
    let keys = value
        .split_whitespace()
        .enumerate()
        .map(|(i, s)| {
            let position = i + 1;
            let key = match s.strip_prefix("whsec_") {
                Some(b64) => base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .map_err(|source| SecretError::Base64 { position, source })?,
                None => s.as_bytes().to_vec(),
            };
            if key.len() < MIN_SIGNING_KEY_BYTES {
                return Err(SecretError::TooShort {
                    position,
                    bytes: key.len(),
                });
            }
            Ok(key)
        })
        .collect::<Result<Vec<_>, _>>()?;
    if keys.is_empty() {
        return Err(SecretError::Empty);
    }
    Ok(keys)
}

/// The `webhook-signature` header value: `v1,<base64 HMAC-SHA256>` for each key, space
/// separated, over `{id}.{timestamp}.{body}` (Standard Webhooks).
pub fn sign(keys: &[Vec<u8>], id: &str, timestamp: u64, body: &[u8]) -> String {
    use base64::Engine as _;
    use hmac::{Hmac, Mac};
    keys.iter()
        .filter_map(|k| {
            let mut mac = Hmac::<sha2::Sha256>::new_from_slice(k).ok()?;
            mac.update(id.as_bytes());
            mac.update(b".");
            mac.update(timestamp.to_string().as_bytes());
            mac.update(b".");
            mac.update(body);
            Some(format!(
                "v1,{}",
                base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
            ))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Installs ring as the process's rustls crypto provider. reqwest is built without one (its
/// default would need a cmake-built C library), so every process that builds a reqwest client
/// calls this first; calling it again is harmless.
pub fn install_crypto_provider() {
    // An error means a provider is installed already, which is fine.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The value reqwest sends as `User-Agent`, sent by the plain client too.
const USER_AGENT: &str = concat!("router/", env!("CARGO_PKG_VERSION"));

/// Whether the environment names a proxy that reqwest would use for plain-HTTP URLs.
fn proxy_in_environment(var: impl Fn(&str) -> Option<String>) -> bool {
    ["HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"]
        .iter()
        .any(|k| var(k).is_some_and(|v| !v.trim().is_empty()))
}

/// Builds the clients shared by all webhooks: reqwest for HTTPS (rustls with ring, the
/// system's roots plus the certificates of `ca_file` when set) and hyper's client for plain
/// HTTP (unless the environment sets a proxy).
pub fn shared_clients(ca_file: Option<&std::path::Path>) -> Result<WebhookClients, WebhookError> {
    let tls = shared_client(ca_file)?;
    let plain = (!proxy_in_environment(|k| std::env::var(k).ok())).then(plain_client);
    Ok(WebhookClients { tls, plain })
}

/// hyper's client as the webhooks use it: no redirects (hyper never follows them), Nagle off,
/// up to 64 idle connections per host, idle ones closed after 90 s (reqwest's defaults).
fn plain_client() -> PlainClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_max_idle_per_host(64)
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_timer(hyper_util::rt::TokioTimer::new())
        .build(connector)
}

/// The certificates of `delivery.tls_ca_file` (a PEM bundle): at least one, or an error that
/// names the key.
pub fn read_ca_file(path: &std::path::Path) -> Result<Vec<reqwest::Certificate>, WebhookError> {
    let ca_err = |message: String| WebhookError::CaFile {
        path: path.display().to_string(),
        message,
    };
    let pem = std::fs::read(path).map_err(|e| ca_err(e.to_string()))?;
    let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| ca_err(e.to_string()))?;
    if certs.is_empty() {
        return Err(ca_err("no PEM certificate in the file".into()));
    }
    Ok(certs)
}

/// Builds the reqwest client (one connection pool). HTTPS uses rustls (ring) with the
/// system's roots, plus the certificates of `ca_file` when set.
pub fn shared_client(ca_file: Option<&std::path::Path>) -> Result<reqwest::Client, WebhookError> {
    install_crypto_provider();
    let mut builder = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .pool_max_idle_per_host(64)
        .tcp_nodelay(true)
        .https_only(false)
        .user_agent(USER_AGENT);
    if let Some(path) = ca_file {
        builder = builder.tls_certs_merge(read_ca_file(path)?);
    }
    Ok(builder.build()?)
}

/// The plain client's URI for `url`, when that client can send to it exactly as reqwest would:
/// `http://`, no credentials in the authority (reqwest turns those into basic auth).
fn plain_uri(url: &str) -> Option<hyper::Uri> {
    let uri: hyper::Uri = url.parse().ok()?;
    (uri.scheme_str() == Some("http") && uri.authority().is_some_and(|a| !a.as_str().contains('@')))
        .then_some(uri)
}

/// A response body read up to a cap.
struct CappedBody {
    bytes: Vec<u8>,
    max: usize,
    truncated: bool,
}

impl CappedBody {
    fn new(max: usize) -> Self {
        Self {
            bytes: Vec::new(),
            max,
            truncated: false,
        }
    }

    /// Keeps what fits of `chunk`; false once the cap is reached (stop reading).
    fn push(&mut self, chunk: &[u8]) -> bool {
        let room = self.max.saturating_sub(self.bytes.len());
        self.bytes
            .extend_from_slice(&chunk[..chunk.len().min(room)]);
        if chunk.len() > room {
            self.truncated = true;
        }
        !self.truncated
    }
}

/// What a transport reports of one exchange.
enum Exchange {
    /// A response (its body read up to the cap) ...
    Answered {
        status: u16,
        retry_after: Option<Duration>,
        body: CappedBody,
        /// Why the body could not be read to its end (or to the cap), if it could not: the
        /// status still decides the outcome.
        read_error: Option<String>,
    },
    /// ... or why there is none.
    Failed(AttemptOutcome),
}

fn retry_after_of(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| parse_retry_after(v, SystemTime::now()))
}

/// How long an attempt the router's own exhaustion stopped waits, unattempted.
const LOCAL_EXHAUSTION_WAIT: Duration = Duration::from_secs(1);

/// The outcome of a request that got no answer: retryable, unless the router itself ran out
/// of a resource ([`LocalExhaustion`]: an `EMFILE` opening the socket), which is no failure
/// of the receiver's: then the entry is put back without spending an attempt.
fn transport_error(kind: &str, e: &(dyn std::error::Error + 'static)) -> AttemptOutcome {
    if let Some(local) = LocalExhaustion::of_error(e) {
        return AttemptOutcome::Deferred {
            reason: format!(
                "the router ran out of {} ({kind}: {}); put back without spending an attempt",
                match local {
                    LocalExhaustion::OpenFiles => "open files",
                    LocalExhaustion::SystemFiles => "the host's open files",
                    LocalExhaustion::Memory => "memory",
                },
                error_chain(e)
            ),
            retry_after: LOCAL_EXHAUSTION_WAIT,
            local: Some(local),
        };
    }
    AttemptOutcome::Retryable {
        error: format!("{kind}: {}", error_chain(e)),
        status: None,
        retry_after: None,
    }
}

impl Webhook {
    /// A webhook posting to `url` with extra `headers`, through the plain client when it can
    /// take the URL.
    pub fn new(
        clients: &WebhookClients,
        url: String,
        headers: &BTreeMap<String, String>,
        max_response_bytes: usize,
        signing_keys: Vec<Vec<u8>>,
    ) -> Result<Self, WebhookError> {
        let mut h = HeaderMap::new();
        for (k, v) in headers {
            let name = HeaderName::from_bytes(k.as_bytes())
                .map_err(|_| WebhookError::Header(k.clone()))?;
            let value = HeaderValue::from_str(v).map_err(|_| WebhookError::Header(k.clone()))?;
            h.insert(name, value);
        }
        let transport = match (&clients.plain, plain_uri(&url)) {
            (Some(client), Some(uri)) => Transport::Plain {
                client: client.clone(),
                uri,
            },
            _ => Transport::Reqwest {
                client: clients.tls.clone(),
                url,
            },
        };
        Ok(Self {
            transport,
            headers: h,
            max_response_bytes,
            signing_keys,
        })
    }

    /// Whether this webhook sends through the plain client.
    pub fn is_plain(&self) -> bool {
        matches!(self.transport, Transport::Plain { .. })
    }

    /// Every header of one attempt: the rule file's, then the CloudEvent's, then the
    /// signature's. `Err` names a value that is not a valid header.
    fn request_headers(&self, req: &DeliveryRequest) -> Result<HeaderMap, String> {
        let value = |name: &str, v: &str| {
            HeaderValue::from_str(v).map_err(|_| format!("invalid {name} header value"))
        };
        let mut h = self.headers.clone();
        h.insert(
            reqwest::header::CONTENT_TYPE,
            HeaderValue::from_static(if req.batch.is_some() {
                "application/cloudevents-batch+json"
            } else {
                "application/cloudevents+json"
            }),
        );
        h.insert(
            "idempotency-key",
            value("idempotency-key", &req.idempotency_key)?,
        );
        // Trace context that cannot be a header is left out, as on NATS: it is not worth
        // failing (and retrying, and opening the breaker on) a delivery that cannot change.
        for (name, v) in [
            ("traceparent", &req.traceparent),
            ("tracestate", &req.tracestate),
        ] {
            if let Some(v) = v {
                match HeaderValue::from_str(v) {
                    Ok(v) => {
                        h.insert(name, v);
                    }
                    Err(_) => tracing::debug!("{name} is not a valid header value; left out"),
                }
            }
        }
        if !self.signing_keys.is_empty() {
            let ts = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            h.insert("webhook-id", value("webhook-id", &req.idempotency_key)?);
            h.insert("webhook-timestamp", HeaderValue::from(ts));
            h.insert(
                "webhook-signature",
                value(
                    "webhook-signature",
                    &sign(&self.signing_keys, &req.idempotency_key, ts, &req.body),
                )?,
            );
        }
        Ok(h)
    }

    async fn attempt(&self, req: &DeliveryRequest) -> AttemptOutcome {
        let headers = match self.request_headers(req) {
            Ok(h) => h,
            // The same event would fail the same way at every attempt.
            Err(e) => {
                return AttemptOutcome::Permanent {
                    error: format!("request failed: {e}"),
                    status: None,
                };
            }
        };
        let exchange = match &self.transport {
            Transport::Plain { client, uri } => {
                // reqwest's timeout covers the request and the whole body read; so does this
                // (the body read stops at the same deadline, keeping the status it has).
                let deadline = tokio::time::Instant::now() + req.timeout;
                self.send_plain(client, uri, headers, req, deadline).await
            }
            Transport::Reqwest { client, url } => {
                self.send_reqwest(client, url, headers, req).await
            }
        };
        match exchange {
            Exchange::Answered {
                status,
                retry_after,
                body,
                read_error,
            } => {
                let mut outcome = classify(status, &body.bytes, body.truncated, retry_after);
                if let Some(why) = read_error {
                    match &mut outcome {
                        AttemptOutcome::Retryable { error, .. }
                        | AttemptOutcome::Permanent { error, .. } => {
                            error.push_str(&format!(" (then reading the body failed: {why})"));
                        }
                        _ => tracing::debug!(error = %why, "webhook body read failed after a 2xx"),
                    }
                }
                outcome
            }
            Exchange::Failed(outcome) => outcome,
        }
    }

    async fn send_plain(
        &self,
        client: &PlainClient,
        uri: &hyper::Uri,
        mut headers: HeaderMap,
        req: &DeliveryRequest,
        deadline: tokio::time::Instant,
    ) -> Exchange {
        // What reqwest adds unless the request has its own.
        headers
            .entry(reqwest::header::USER_AGENT)
            .or_insert(HeaderValue::from_static(USER_AGENT));
        headers
            .entry(reqwest::header::ACCEPT)
            .or_insert(HeaderValue::from_static("*/*"));
        let mut request = hyper::Request::new(Full::new(req.body.clone()));
        *request.method_mut() = hyper::Method::POST;
        *request.uri_mut() = uri.clone();
        *request.headers_mut() = headers;
        let resp = match tokio::time::timeout_at(deadline, client.request(request)).await {
            Ok(Ok(r)) => r,
            Err(elapsed) => return Exchange::Failed(transport_error("timeout", &elapsed)),
            Ok(Err(e)) => {
                let kind = if e.is_connect() {
                    "connection failed"
                } else {
                    "request failed"
                };
                return Exchange::Failed(transport_error(kind, &e));
            }
        };
        read_answer(resp, self.max_response_bytes, Some(deadline)).await
    }

    async fn send_reqwest(
        &self,
        client: &reqwest::Client,
        url: &str,
        headers: HeaderMap,
        req: &DeliveryRequest,
    ) -> Exchange {
        let sent = client
            .post(url)
            .headers(headers)
            .timeout(req.timeout)
            .body(req.body.clone())
            .send()
            .await;
        let resp = match sent {
            Ok(r) => r,
            // The request could not even be built (a URL the client refuses): no retry helps.
            Err(e) if e.is_builder() => {
                return Exchange::Failed(AttemptOutcome::Permanent {
                    error: format!("invalid request: {}", error_chain(&e)),
                    status: None,
                });
            }
            Err(e) => {
                let kind = if e.is_timeout() {
                    "timeout"
                } else if e.is_connect() {
                    "connection failed"
                } else {
                    "request failed"
                };
                return Exchange::Failed(transport_error(kind, &e));
            }
        };
        // The conversion keeps reqwest's body, and with it the request's timeout.
        read_answer(http::Response::from(resp), self.max_response_bytes, None).await
    }
}

/// Reads the status, `Retry-After` and a bounded prefix of the body of `resp` (the rest is
/// dropped with the connection), from either transport. The body read stops at `deadline`
/// (reqwest's bodies carry their own), and a read that fails or times out keeps the status:
/// a 2xx is a delivery however its body ends, a 404 stays a 404.
async fn read_answer<B>(
    resp: http::Response<B>,
    max: usize,
    deadline: Option<tokio::time::Instant>,
) -> Exchange
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    let status = resp.status().as_u16();
    let retry_after = retry_after_of(resp.headers());
    let mut body = CappedBody::new(max);
    let mut incoming = resp.into_body();
    let mut read_error = None;
    loop {
        let frame = match deadline {
            Some(at) => match tokio::time::timeout_at(at, incoming.frame()).await {
                Ok(f) => f,
                Err(elapsed) => {
                    read_error = Some(format!("timeout: {elapsed}"));
                    break;
                }
            },
            None => incoming.frame().await,
        };
        match frame {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data()
                    && !body.push(&data)
                {
                    break;
                }
            }
            None => break,
            Some(Err(e)) => {
                read_error = Some(e.to_string());
                break;
            }
        }
    }
    Exchange::Answered {
        status,
        retry_after,
        body,
        read_error,
    }
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Classifies a webhook response.
pub fn classify(
    status: u16,
    body: &[u8],
    truncated: bool,
    retry_after: Option<Duration>,
) -> AttemptOutcome {
    let text = || {
        let mut t = String::from_utf8_lossy(body)
            .trim()
            .chars()
            .take(512)
            .collect::<String>();
        if truncated {
            t.push('…');
        }
        if t.is_empty() {
            format!("HTTP {status}")
        } else {
            format!("HTTP {status}: {t}")
        }
    };
    match status {
        200..=299 => AttemptOutcome::Delivered {
            status: Some(status),
        },
        300..=399 => AttemptOutcome::Permanent {
            error: format!("HTTP {status}: redirects are not followed; fix the target URL"),
            status: Some(status),
        },
        // Retry-After is honoured on 429 and 503, as the spec says (RFC 9110 defines it for
        // those, not for a 408).
        429 => AttemptOutcome::Retryable {
            error: text(),
            status: Some(status),
            retry_after,
        },
        408 => AttemptOutcome::Retryable {
            error: text(),
            status: Some(status),
            retry_after: None,
        },
        400..=499 => AttemptOutcome::Permanent {
            error: text(),
            status: Some(status),
        },
        _ => AttemptOutcome::Retryable {
            error: text(),
            status: Some(status),
            retry_after: if status == 503 { retry_after } else { None },
        },
    }
}

/// Parses `Retry-After`: delay-seconds or an HTTP-date (relative to `now`).
pub fn parse_retry_after(v: &str, now: SystemTime) -> Option<Duration> {
    let v = v.trim();
    // RFC 9110 delay-seconds is `1*DIGIT`, of any length: a number too large for u64 means
    // "as long as you may", so it is `Duration::MAX` (the caller caps it at
    // `retry_after_max`), not an unparsable header that falls back to the short backoff and
    // hammers the receiver. Only digits: `u64::from_str` would also take a leading `+`.
    if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
        return Some(v.parse::<u64>().map_or(Duration::MAX, Duration::from_secs));
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

impl Target for Webhook {
    fn deliver<'a>(&'a self, req: &'a DeliveryRequest) -> BoxFuture<'a, AttemptOutcome> {
        self.attempt(req).boxed()
    }
}

#[cfg(test)]
mod tests {
    /// An error whose source is an I/O error, as hyper's and reqwest's connect errors are.
    #[derive(Debug)]
    struct Wrapped(std::io::Error);

    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("client error (Connect)")
        }
    }

    impl std::error::Error for Wrapped {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    /// The router's own EMFILE (or ENFILE, ENOMEM) on connect is put back unattempted, not
    /// charged to the receiver: decided from the error chain's OS error number, whatever the
    /// message says. A refusal stays the receiver's retryable failure.
    #[cfg(unix)]
    #[test]
    fn the_routers_own_exhaustion_is_deferred_not_charged_to_the_receiver() {
        use super::super::LocalExhaustion;
        use super::{AttemptOutcome, transport_error};
        for (errno, local) in [
            (rustix::io::Errno::MFILE, LocalExhaustion::OpenFiles),
            (rustix::io::Errno::NFILE, LocalExhaustion::SystemFiles),
            (rustix::io::Errno::NOMEM, LocalExhaustion::Memory),
            (rustix::io::Errno::NOBUFS, LocalExhaustion::Memory),
        ] {
            let e = Wrapped(std::io::Error::from_raw_os_error(errno.raw_os_error()));
            assert_eq!(LocalExhaustion::of_error(&e), Some(local));
            let outcome = transport_error("connection failed", &e);
            assert!(
                matches!(&outcome, AttemptOutcome::Deferred { local: Some(l), reason, .. }
                    if *l == local && reason.contains("put back without spending an attempt")),
                "{outcome:?}"
            );
            assert!(!outcome.counts_for_breaker());
        }
        // Nested deeper (an I/O error wrapping another error that holds the OS error).
        let deep = Wrapped(std::io::Error::other(Wrapped(
            std::io::Error::from_raw_os_error(rustix::io::Errno::MFILE.raw_os_error()),
        )));
        assert_eq!(
            LocalExhaustion::of_error(&deep),
            Some(LocalExhaustion::OpenFiles)
        );
        // The message alone decides nothing.
        let lookalike = Wrapped(std::io::Error::other("Too many open files (os error 24)"));
        assert_eq!(LocalExhaustion::of_error(&lookalike), None);
        let refused = Wrapped(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        let outcome = transport_error("connection failed", &refused);
        assert!(
            matches!(outcome, AttemptOutcome::Retryable { .. }),
            "{outcome:?}"
        );
        assert!(outcome.counts_for_breaker());
        let oom = std::io::Error::from(std::io::ErrorKind::OutOfMemory);
        assert_eq!(LocalExhaustion::of_io(&oom), Some(LocalExhaustion::Memory));
    }
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A local receiver whose answer depends on the path; it records every request's headers.
    async fn receiver() -> (String, Arc<Mutex<Vec<HeaderMap>>>) {
        use hyper::body::Incoming;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let seen: Arc<Mutex<Vec<HeaderMap>>> = Arc::default();
        let log = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let log = log.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                        let log = log.clone();
                        async move {
                            log.lock().expect("log").push(req.headers().clone());
                            let path = req.uri().path().to_string();
                            let _ = req.into_body().collect().await;
                            let r = hyper::Response::builder();
                            // A body that sends one byte and then nothing, for ever.
                            let stalled = || {
                                let first =
                                    futures::stream::iter([Ok::<_, std::convert::Infallible>(
                                        hyper::body::Frame::data(Bytes::from_static(b"x")),
                                    )]);
                                http_body_util::StreamBody::new(futures::StreamExt::chain(
                                    first,
                                    futures::stream::pending(),
                                ))
                                .boxed()
                            };
                            let full = |b: Bytes| Full::new(b).map_err(|e| match e {}).boxed();
                            match path.as_str() {
                                "/stall-ok" => r.status(200).body(stalled()),
                                "/stall-404" => r.status(404).body(stalled()),
                                "/ok" => r.status(204).body(full(Bytes::new())),
                                "/moved" => r
                                    .status(302)
                                    .header("location", "/ok")
                                    .body(full(Bytes::new())),
                                "/busy" => r
                                    .status(429)
                                    .header("retry-after", "7")
                                    .body(full(Bytes::from_static(b"slow down"))),
                                "/bad" => r.status(422).body(full(Bytes::from_static(b"no"))),
                                "/big" => {
                                    r.status(500).body(full(Bytes::from(vec![b'e'; 100_000])))
                                }
                                _ => {
                                    tokio::time::sleep(Duration::from_secs(5)).await;
                                    r.status(200).body(full(Bytes::new()))
                                }
                            }
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        (base, seen)
    }

    fn request(timeout: Duration) -> DeliveryRequest {
        let event: crate::event::CloudEvent = serde_json::from_value(serde_json::json!({
            "specversion": "1.0", "id": "e-1", "source": "/t", "type": "t"
        }))
        .expect("event");
        DeliveryRequest {
            body: Bytes::from_static(b"{}"),
            idempotency_key: "key-1".into(),
            event_id: "e-1".into(),
            attempt: 1,
            traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
            tracestate: Some("congo=t61rcWkgMzE".into()),
            timeout,
            event: Arc::new(crate::store::StoredEvent {
                seq: 1,
                event,
                accepted_at: 0,
                ruleset_version: String::new(),
                matched_rules: Vec::new(),
                quarantined: false,
            }),
            replay: None,
            rule: "r".into(),
            target: "t".into(),
            hops: 0,
            batch: None,
        }
    }

    #[tokio::test]
    async fn both_transports_give_the_same_outcomes_and_send_the_same_headers() {
        install_crypto_provider();
        let (base, seen) = receiver().await;
        let clients = WebhookClients {
            tls: shared_client(None).expect("reqwest"),
            plain: Some(plain_client()),
        };
        let reqwest_only = WebhookClients {
            tls: clients.tls.clone(),
            plain: None,
        };
        let headers = BTreeMap::from([("x-team".to_string(), "payments".to_string())]);
        // Port 9 on loopback: nothing listens there.
        let paths = [
            "/ok",
            "/moved",
            "/busy",
            "/bad",
            "/big",
            "/slow",
            "/stall-ok",
            "/stall-404",
            "refused",
        ];
        for path in paths {
            let url = if path == "refused" {
                "http://127.0.0.1:9/".to_string()
            } else {
                format!("{base}{path}")
            };
            let mut outcomes = Vec::new();
            for c in [&clients, &reqwest_only] {
                let hook = Webhook::new(c, url.clone(), &headers, 1024, vec![b"k".to_vec()])
                    .expect("hook");
                assert_eq!(hook.is_plain(), c.plain.is_some(), "{path}");
                outcomes.push(hook.attempt(&request(Duration::from_millis(300))).await);
            }
            let (plain, via_reqwest) = (&outcomes[0], &outcomes[1]);
            // Same class, status, Retry-After and error text up to the transport's wording of
            // the cause.
            assert_eq!(
                std::mem::discriminant(plain),
                std::mem::discriminant(via_reqwest),
                "{path}: {plain:?} vs {via_reqwest:?}"
            );
            let head = |o: &AttemptOutcome| {
                o.error()
                    .map(|e| e.split(':').next().unwrap_or("").to_string())
            };
            assert_eq!(
                head(plain),
                head(via_reqwest),
                "{path}: {plain:?} vs {via_reqwest:?}"
            );
            match (plain, via_reqwest) {
                (
                    AttemptOutcome::Retryable {
                        status: a,
                        retry_after: ra,
                        error: ea,
                    },
                    AttemptOutcome::Retryable {
                        status: b,
                        retry_after: rb,
                        error: eb,
                    },
                ) => {
                    assert_eq!((a, ra), (b, rb), "{path}");
                    if a.is_some() {
                        // An answered request: the same text, cut at the same cap.
                        assert_eq!(ea, eb, "{path}");
                    }
                }
                // A body read cut short: the transports word the cause differently.
                (
                    AttemptOutcome::Permanent {
                        status: a,
                        error: ea,
                    },
                    AttemptOutcome::Permanent {
                        status: b,
                        error: eb,
                    },
                ) => {
                    let cause = |e: &str| e.split(" (then").next().unwrap_or("").to_string();
                    assert_eq!((a, cause(ea)), (b, cause(eb)), "{path}");
                }
                (a, b) => assert_eq!(a, b, "{path}"),
            }
            match path {
                "/ok" => assert!(matches!(
                    plain,
                    AttemptOutcome::Delivered { status: Some(204) }
                )),
                "/moved" => assert!(matches!(plain, AttemptOutcome::Permanent { .. })),
                "/busy" => assert!(matches!(
                    plain,
                    AttemptOutcome::Retryable { status: Some(429), retry_after: Some(d), .. }
                        if *d == Duration::from_secs(7)
                )),
                "/big" => assert!(plain.error().is_some_and(|e| e.ends_with('…'))),
                "/slow" => assert!(plain.error().is_some_and(|e| e.starts_with("timeout"))),
                // A status received counts, however the body ends: a 2xx is a delivery
                // (the receiver took the event), a 404 stays permanent.
                "/stall-ok" => assert!(matches!(
                    plain,
                    AttemptOutcome::Delivered { status: Some(200) }
                )),
                "/stall-404" => assert!(
                    matches!(plain, AttemptOutcome::Permanent { status: Some(404), error }
                        if error.contains("then reading the body failed")),
                    "{plain:?}"
                ),
                "refused" => {
                    assert!(
                        plain
                            .error()
                            .is_some_and(|e| e.starts_with("connection failed"))
                    )
                }
                _ => {}
            }
        }
        // The receiver saw the same headers from both (the signature's timestamp aside).
        let seen = seen.lock().expect("log");
        let (a, b) = (&seen[0], &seen[1]);
        for name in [
            "content-type",
            "idempotency-key",
            "traceparent",
            "tracestate",
            "x-team",
            "user-agent",
            "accept",
            "webhook-id",
            "content-length",
        ] {
            assert_eq!(a.get(name), b.get(name), "{name}");
            assert!(a.get(name).is_some(), "{name}");
        }
        assert!(a.get("webhook-signature").is_some() && b.get("webhook-signature").is_some());
        assert_eq!(a.get("host"), b.get("host"));
    }

    #[test]
    fn only_plain_http_without_credentials_takes_the_plain_client() {
        assert!(plain_uri("http://127.0.0.1:9000/erp").is_some());
        assert!(plain_uri("http://erp.internal/hook?x=1").is_some());
        assert!(plain_uri("https://erp.example/hook").is_none());
        assert!(plain_uri("http://user:pw@erp.internal/hook").is_none());
        assert!(plain_uri("not a url").is_none());
    }

    #[test]
    fn a_proxy_in_the_environment_keeps_plain_http_on_reqwest() {
        let env = |set: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                set.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(!proxy_in_environment(env(&[])));
        assert!(!proxy_in_environment(env(&[(
            "HTTPS_PROXY",
            "http://p:3128"
        )])));
        assert!(!proxy_in_environment(env(&[("http_proxy", " ")])));
        assert!(proxy_in_environment(env(&[(
            "HTTP_PROXY",
            "http://p:3128"
        )])));
        assert!(proxy_in_environment(env(&[(
            "all_proxy",
            "socks5://p:1080"
        )])));
    }

    #[test]
    fn classification_follows_the_spec() {
        assert!(matches!(
            classify(204, b"", false, None),
            AttemptOutcome::Delivered { .. }
        ));
        assert!(matches!(
            classify(302, b"", false, None),
            AttemptOutcome::Permanent { .. }
        ));
        assert!(matches!(
            classify(400, b"bad", false, None),
            AttemptOutcome::Permanent { .. }
        ));
        assert!(matches!(
            classify(404, b"", false, None),
            AttemptOutcome::Permanent { .. }
        ));
        for s in [408, 429, 500, 502, 503] {
            let o = classify(s, b"", false, None);
            assert!(matches!(o, AttemptOutcome::Retryable { .. }), "{s}");
            assert!(o.counts_for_breaker());
        }
        assert!(!classify(400, b"", false, None).counts_for_breaker());
        let o = classify(500, b"boom", true, None);
        assert_eq!(o.error(), Some("HTTP 500: boom…"));
        // Retry-After counts on 429 and 503 only.
        let ra = Some(Duration::from_secs(8));
        for (s, honoured) in [(429, true), (503, true), (408, false), (500, false)] {
            assert!(
                matches!(classify(s, b"", false, ra), AttemptOutcome::Retryable { retry_after, .. }
                    if retry_after.is_some() == honoured),
                "{s}"
            );
        }
    }

    #[test]
    fn signatures_follow_standard_webhooks() {
        // The example of the Standard Webhooks spec's reference implementation.
        let keys = parse_secrets("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").expect("secret");
        let sig = sign(
            &keys,
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            br#"{"test": 2432232314}"#,
        );
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        // Rotation: two secrets, two signatures.
        let two = parse_secrets("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw raw-secret-of-24-bytes!!")
            .expect("secrets");
        assert_eq!(sign(&two, "a", 1, b"x").split(' ').count(), 2);
        assert!(matches!(
            parse_secrets("whsec_!!!"),
            Err(SecretError::Base64 { position: 1, .. })
        ));
    }

    /// An empty secret sent webhooks unsigned; `whsec_` alone signed with an empty key. Both,
    /// and any key under 16 bytes, keep the target from starting.
    #[test]
    fn an_empty_or_short_secret_cannot_sign() {
        assert_eq!(parse_secrets(""), Err(SecretError::Empty));
        assert_eq!(parse_secrets(" \t\n"), Err(SecretError::Empty));
        assert_eq!(
            parse_secrets("whsec_"),
            Err(SecretError::TooShort {
                position: 1,
                bytes: 0
            })
        );
        assert_eq!(
            parse_secrets("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw changeme"),
            Err(SecretError::TooShort {
                position: 2,
                bytes: 8
            })
        );
        // 15 bytes of key, then 16.
        assert!(parse_secrets("whsec_MDEyMzQ1Njc4OWFiY2Rl").is_err());
        assert_eq!(
            parse_secrets("whsec_MDEyMzQ1Njc4OWFiY2RlZg==").map(|k| k[0].len()),
            Ok(16)
        );
        let e = parse_secrets("whsec_").expect_err("short").to_string();
        assert!(e.contains("0 bytes of key, fewer than 16"), "{e}");
    }

    #[test]
    fn retry_after_in_both_forms() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        assert_eq!(
            parse_retry_after("120", now),
            Some(Duration::from_secs(120))
        );
        let later = httpdate::fmt_http_date(now + Duration::from_secs(30));
        assert_eq!(
            parse_retry_after(&later, now),
            Some(Duration::from_secs(30))
        );
        assert_eq!(parse_retry_after("soon", now), None);
        let past = httpdate::fmt_http_date(now - Duration::from_secs(30));
        assert_eq!(parse_retry_after(&past, now), Some(Duration::ZERO));
    }

    #[test]
    fn retry_after_too_large_for_u64_is_the_longest_wait_and_a_sign_is_refused() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        // 2^64 and far beyond: the longest wait, which the worker caps at `retry_after_max`.
        assert_eq!(
            parse_retry_after("18446744073709551616", now),
            Some(Duration::MAX)
        );
        assert_eq!(
            parse_retry_after(&"9".repeat(100), now),
            Some(Duration::MAX)
        );
        assert_eq!(
            parse_retry_after("18446744073709551615", now),
            Some(Duration::from_secs(u64::MAX))
        );
        // Not delay-seconds (RFC 9110: `1*DIGIT`) nor an HTTP-date.
        assert_eq!(parse_retry_after("+5", now), None);
        assert_eq!(parse_retry_after("-5", now), None);
        assert_eq!(parse_retry_after("", now), None);
        assert_eq!(parse_retry_after(" 7 ", now), Some(Duration::from_secs(7)));
    }
}
