//! Webhook target: HTTP POST of the structured CloudEvent.
//!
//! Sends `Idempotency-Key` (stable across retries) and `traceparent`; does not follow
//! redirects (a 3xx is permanent: the URL in the rule file is wrong); reads at most
//! `max_response_bytes` of the answer, for the attempt's error text.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use futures::FutureExt;
use futures::future::BoxFuture;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};

use super::{AttemptOutcome, DeliveryRequest, Target};

/// Error building a webhook target from its configuration.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// A header name or value from the rule file is not valid HTTP.
    #[error("invalid header {0:?}")]
    Header(String),
    /// The HTTP client could not be built.
    #[error("http client: {0}")]
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

/// One webhook destination.
pub struct Webhook {
    url: String,
    headers: HeaderMap,
    client: reqwest::Client,
    max_response_bytes: usize,
    /// Standard Webhooks signing keys (two during a rotation); empty = unsigned.
    signing_keys: Vec<Vec<u8>>,
}

/// Parses a secret value: one or more whitespace-separated secrets (two during a rotation),
/// each `whsec_<base64>` (the Standard Webhooks form) or raw text.
pub fn parse_secrets(value: &str) -> Result<Vec<Vec<u8>>, String> {
    use base64::Engine as _;
    value
        .split_whitespace()
        .map(|s| match s.strip_prefix("whsec_") {
            Some(b64) => base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map_err(|e| format!("whsec_ secret is not valid base64: {e}")),
            None => Ok(s.as_bytes().to_vec()),
        })
        .collect()
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

/// Builds the HTTP client shared by all webhooks (one connection pool). HTTPS uses rustls
/// (ring) with the system's roots, plus the certificates of `ca_file` when set.
pub fn shared_client(ca_file: Option<&std::path::Path>) -> Result<reqwest::Client, WebhookError> {
    install_crypto_provider();
    let mut builder = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .pool_max_idle_per_host(64)
        .tcp_nodelay(true)
        .https_only(false)
        .user_agent(concat!("router/", env!("CARGO_PKG_VERSION")));
    if let Some(path) = ca_file {
        let ca_err = |message: String| WebhookError::CaFile {
            path: path.display().to_string(),
            message,
        };
        let pem = std::fs::read(path).map_err(|e| ca_err(e.to_string()))?;
        let certs =
            reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| ca_err(e.to_string()))?;
        if certs.is_empty() {
            return Err(ca_err("no PEM certificate in the file".into()));
        }
        builder = builder.tls_certs_merge(certs);
    }
    Ok(builder.build()?)
}

impl Webhook {
    /// A webhook posting to `url` with extra `headers`.
    pub fn new(
        client: reqwest::Client,
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
        Ok(Self {
            url,
            headers: h,
            client,
            max_response_bytes,
            signing_keys,
        })
    }

    async fn attempt(&self, req: &DeliveryRequest) -> AttemptOutcome {
        let mut rb = self
            .client
            .post(&self.url)
            .headers(self.headers.clone())
            .header("content-type", "application/cloudevents+json")
            .header("idempotency-key", &req.idempotency_key)
            .timeout(req.timeout)
            .body(req.body.clone());
        if let Some(tp) = &req.traceparent {
            rb = rb.header("traceparent", tp);
        }
        if !self.signing_keys.is_empty() {
            let ts = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            rb = rb
                .header("webhook-id", &req.idempotency_key)
                .header("webhook-timestamp", ts.to_string())
                .header(
                    "webhook-signature",
                    sign(&self.signing_keys, &req.idempotency_key, ts, &req.body),
                );
        }
        let mut resp = match rb.send().await {
            Ok(r) => r,
            Err(e) => {
                let kind = if e.is_timeout() {
                    "timeout"
                } else if e.is_connect() {
                    "connection failed"
                } else {
                    "request failed"
                };
                return AttemptOutcome::Retryable {
                    error: format!("{kind}: {}", error_chain(&e)),
                    status: None,
                    retry_after: None,
                };
            }
        };
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, SystemTime::now()));
        // Read a bounded prefix of the body; the rest is dropped with the connection.
        let mut body = Vec::new();
        let mut truncated = false;
        loop {
            match resp.chunk().await {
                Ok(Some(chunk)) => {
                    let room = self.max_response_bytes.saturating_sub(body.len());
                    body.extend_from_slice(&chunk[..chunk.len().min(room)]);
                    if chunk.len() > room {
                        truncated = true;
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) if (200..300).contains(&status) => {
                    // The status was already sent: the receiver took the event.
                    tracing::debug!(error = %e, "webhook body read failed after a 2xx");
                    break;
                }
                Err(e) => {
                    return AttemptOutcome::Retryable {
                        error: format!("HTTP {status}, then reading the body failed: {e}"),
                        status: Some(status),
                        retry_after,
                    };
                }
            }
        }
        classify(status, &body, truncated, retry_after)
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
        408 | 429 => AttemptOutcome::Retryable {
            error: text(),
            status: Some(status),
            retry_after,
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
    if let Ok(secs) = v.parse::<u64>() {
        return Some(Duration::from_secs(secs));
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
    use super::*;

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
        let two =
            parse_secrets("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw rawsecret").expect("secrets");
        assert_eq!(sign(&two, "a", 1, b"x").split(' ').count(), 2);
        assert!(parse_secrets("whsec_!!!").is_err());
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
}
