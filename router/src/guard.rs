//! Requests a web browser makes on a page's behalf, refused before authentication: the API
//! serves programs (the CLI, producers, curl), never web pages, and answers no CORS
//! preflight. Without this a page open in an operator's browser could have the browser send
//! the router cross-site form posts and `fetch`es (CSRF), or rebind a name of its own to
//! 127.0.0.1 (DNS rebinding) and read the answers too. With no `[[auth.tokens]]` every caller
//! is an administrator, so either is one request away from purging the DLQ.
//!
//! - A request whose `Origin` is not its own (`http://` or `https://` and its `Host`) is
//!   refused (403), and so is one a browser marks as coming from another page
//!   (`Sec-Fetch-Site` other than `same-origin` or `none`). Programs send neither header.
//! - With auth off (and `auth.insecure` not set) the `Host` must name a loopback address
//!   (`localhost`, 127.0.0.0/8, `[::1]`, any port) or the listen address (403): a page that
//!   rebinds its own name sends that name.
//! - A change's body is JSON (`Content-Type: application/json` or `application/…+json`), or
//!   there is no body and no content type (415, `check_body_type`): the content types a page
//!   can send without a preflight (`text/plain`, forms) are never JSON.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;

use crate::event::FieldError;
use crate::ingest::error_response;

/// What the guard checks on every request, fixed at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestGuard {
    /// With auth off and `auth.insecure` not set: the listen address, whose `Host` (besides a
    /// loopback name) requests must carry. `None`: any `Host`.
    loopback_only: Option<IpAddr>,
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// `Origin` names another site than the request's own.
    #[error(
        "Origin {origin:?} is not this router ({host:?}): the API serves no web pages and takes no cross-origin requests"
    )]
    CrossOrigin {
        /// The `Origin` sent.
        origin: String,
        /// The request's `Host` ("" when it had none).
        host: String,
    },
    /// The browser says another page made the request.
    #[error(
        "Sec-Fetch-Site {0:?}: a web page made this request; the API serves programs (the CLI, producers, curl), not pages"
    )]
    CrossSite(String),
    /// With auth off, a `Host` that is not this router's loopback address.
    #[error(
        "Host {0:?} is not a loopback name (localhost, 127.0.0.0/8, [::1]) or the listen address: with auth off (no [[auth.tokens]]) the router answers only requests addressed to it on loopback, so that a web page cannot rebind its own name to it (DNS rebinding); configure [[auth.tokens]] (or set auth.insecure) to be reached by other names"
    )]
    NotLoopbackHost(String),
}

impl Refusal {
    /// The request header it is about, as the error's pointer.
    fn pointer(&self) -> &'static str {
        match self {
            Self::CrossOrigin { .. } => "/origin",
            Self::CrossSite(_) => "/sec-fetch-site",
            Self::NotLoopbackHost(_) => "/host",
        }
    }
}

impl RequestGuard {
    /// The guard of a router listening on `listen`: the `Host` check only with auth off
    /// (`auth_on` false) and `insecure` not set.
    pub fn new(auth_on: bool, insecure: bool, listen: SocketAddr) -> Self {
        Self {
            loopback_only: (!auth_on && !insecure).then_some(listen.ip()),
        }
    }

    /// `Ok` or why a request with `headers` is refused.
    pub fn check(&self, headers: &HeaderMap) -> Result<(), Refusal> {
        let text = |name: header::HeaderName| {
            headers
                .get(name)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        };
        let host = text(header::HOST);
        if let Some(site) = text(header::HeaderName::from_static("sec-fetch-site"))
            && !matches!(site.trim(), "same-origin" | "none")
        {
            return Err(Refusal::CrossSite(site));
        }
        if let Some(origin) = text(header::ORIGIN)
            && !host.as_deref().is_some_and(|h| same_origin(&origin, h))
        {
            return Err(Refusal::CrossOrigin {
                origin,
                host: host.unwrap_or_default(),
            });
        }
        // A browser always sends `Host`: a request without one is not a page's.
        if let (Some(listen), Some(host)) = (self.loopback_only, host)
            && !is_local_host(&host, listen)
        {
            return Err(Refusal::NotLoopbackHost(host));
        }
        Ok(())
    }
}

/// Whether `origin` (`scheme://host[:port]`) is the origin of a request to `host` (the `Host`
/// header) over `http` or, behind a TLS-terminating proxy, `https`; a default port may be
/// written or left out on either side.
fn same_origin(origin: &str, host: &str) -> bool {
    let Some((scheme, authority)) = origin.trim().split_once("://") else {
        return false;
    };
    let default_port = if scheme.eq_ignore_ascii_case("http") {
        ":80"
    } else if scheme.eq_ignore_ascii_case("https") {
        ":443"
    } else {
        return false;
    };
    let bare = |a: &str| {
        let a = a.trim().to_ascii_lowercase();
        a.strip_suffix(default_port).map(str::to_owned).unwrap_or(a)
    };
    !authority.is_empty() && bare(authority) == bare(host)
}

/// The host of a `Host` header value, without its port (`[::1]:8080` → `::1`).
fn host_part(host: &str) -> &str {
    let host = host.trim();
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or_default();
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

/// Whether the `Host` header value `host` names this machine's loopback interface, or `listen`.
fn is_local_host(host: &str, listen: IpAddr) -> bool {
    let name = host_part(host);
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.eq_ignore_ascii_case("localhost") {
        return true;
    }
    name.parse::<IpAddr>()
        .is_ok_and(|ip| ip.to_canonical().is_loopback() || ip == listen)
}

/// The middleware: refuses what [`RequestGuard::check`] refuses, before authentication (a
/// browser would not attach the bearer token anyway).
pub async fn layer(
    axum::extract::State(guard): axum::extract::State<Arc<RequestGuard>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match guard.check(req.headers()) {
        Ok(()) => next.run(req).await,
        Err(refusal) => {
            tracing::warn!(
                method = %req.method(),
                path = req.uri().path(),
                reason = %refusal,
                "request refused: it comes from a web page, or names another host"
            );
            error_response(
                StatusCode::FORBIDDEN,
                "refused: a request from a web page or for another host",
                vec![FieldError::new(refusal.pointer(), refusal.to_string())],
            )
        }
    }
}

/// What a request says its body is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyType {
    /// `application/json` or `application/…+json`.
    Json,
    /// No `Content-Type`.
    Absent,
    /// Anything else (as sent).
    Other(String),
}

/// The body type `headers` declare.
pub fn body_type(headers: &HeaderMap) -> BodyType {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return BodyType::Absent;
    };
    let text = String::from_utf8_lossy(value.as_bytes()).into_owned();
    let essence = text
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let json = essence == "application/json"
        || essence
            .strip_prefix("application/")
            .and_then(|sub| sub.strip_suffix("+json"))
            .is_some_and(|x| !x.is_empty() && !x.contains(['/', ' ', ',']));
    if json {
        BodyType::Json
    } else {
        BodyType::Other(text)
    }
}

/// Checks the body of an API change (not ingest's, not a handler upload's): JSON, or none at
/// all. `body_len` is the body's length once read (`None` before: then only a declared
/// content type that is not JSON is refused). `Ok` or the 415 to answer.
pub fn check_body_type(headers: &HeaderMap, body_len: Option<usize>) -> Result<(), Box<Response>> {
    let message = match (body_type(headers), body_len) {
        (BodyType::Json, _) | (BodyType::Absent, None | Some(0)) => return Ok(()),
        (BodyType::Other(ct), _) => format!(
            "Content-Type {ct:?}: this route takes a JSON body (Content-Type: application/json) or none"
        ),
        (BodyType::Absent, Some(_)) => {
            "a body without a Content-Type: send it as Content-Type: application/json".to_owned()
        }
    };
    Err(Box::new(error_response(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported content type",
        vec![FieldError::new("/content-type", message)],
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().expect("header value"));
        }
        h
    }

    const LOOPBACK: &str = "127.0.0.1:8080";

    fn auth_off() -> RequestGuard {
        RequestGuard::new(false, false, LOOPBACK.parse().expect("addr"))
    }

    #[test]
    fn programs_pass() {
        for guard in [
            auth_off(),
            RequestGuard::new(true, false, "0.0.0.0:8080".parse().expect("addr")),
        ] {
            // curl, the CLI, producers: a Host, no Origin, no Sec-Fetch-*.
            assert_eq!(guard.check(&headers(&[("host", "127.0.0.1:8080")])), Ok(()));
            assert_eq!(guard.check(&headers(&[])), Ok(()));
            // A browser on the router's own origin (typing the URL: `none`).
            let own = headers(&[
                ("host", "localhost:8080"),
                ("origin", "http://localhost:8080"),
                ("sec-fetch-site", "same-origin"),
            ]);
            assert_eq!(guard.check(&own), Ok(()));
            let typed = headers(&[("host", "127.0.0.1:8080"), ("sec-fetch-site", "none")]);
            assert_eq!(guard.check(&typed), Ok(()));
        }
    }

    #[test]
    fn another_pages_requests_are_refused_whatever_the_auth() {
        for guard in [
            auth_off(),
            RequestGuard::new(true, false, "0.0.0.0:8080".parse().expect("addr")),
            RequestGuard::new(false, true, "0.0.0.0:8080".parse().expect("addr")),
        ] {
            let check = |pairs: &[(&'static str, &str)]| guard.check(&headers(pairs));
            for origin in [
                "http://evil.example",
                "http://127.0.0.1:3000",
                "https://127.0.0.1:8081",
                "null",
                "",
                "file://",
            ] {
                let got = check(&[("host", "127.0.0.1:8080"), ("origin", origin)]);
                assert!(
                    matches!(got, Err(Refusal::CrossOrigin { .. })),
                    "{origin}: {got:?}"
                );
            }
            // An Origin and no Host to compare it with.
            assert!(check(&[("origin", "http://127.0.0.1:8080")]).is_err());
            for site in ["cross-site", "same-site", "bogus"] {
                let got = check(&[("host", "127.0.0.1:8080"), ("sec-fetch-site", site)]);
                assert_eq!(got, Err(Refusal::CrossSite(site.into())), "{site}");
            }
        }
    }

    #[test]
    fn an_origin_matches_its_host_up_to_case_and_default_port() {
        assert!(same_origin("http://Router.Example", "router.example"));
        assert!(same_origin("http://router.example", "router.example:80"));
        assert!(same_origin("https://router.example", "router.example:443"));
        assert!(same_origin(
            "https://router.example:8443",
            "router.example:8443"
        ));
        assert!(same_origin("http://[::1]:8080", "[::1]:8080"));
        assert!(!same_origin("http://router.example:8080", "router.example"));
        assert!(!same_origin("https://router.example", "router.example:80"));
        assert!(!same_origin("ftp://router.example", "router.example"));
        assert!(!same_origin("http://router.example.evil", "router.example"));
    }

    #[test]
    fn with_auth_off_only_loopback_hosts_pass() {
        let guard = auth_off();
        for host in [
            "localhost",
            "LOCALHOST:8080",
            "localhost.:8080",
            "127.0.0.1",
            "127.0.0.1:8080",
            "127.1.2.3:9",
            "[::1]",
            "[::1]:8080",
            "[::ffff:127.0.0.1]:8080",
        ] {
            assert_eq!(guard.check(&headers(&[("host", host)])), Ok(()), "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:8080",
            "localhost.evil.example",
            "evil.localhost",
            "10.0.0.5:8080",
            "0.0.0.0:8080",
            "[::2]:8080",
            "",
        ] {
            assert_eq!(
                guard.check(&headers(&[("host", host)])),
                Err(Refusal::NotLoopbackHost(host.into())),
                "{host}"
            );
        }
        // The listen address itself passes too (without tokens the router starts only on
        // loopback unless auth.insecure, which turns the check off: the rule, not a case).
        let on = RequestGuard::new(false, false, "10.0.0.5:80".parse().expect("addr"));
        assert_eq!(on.check(&headers(&[("host", "10.0.0.5:8080")])), Ok(()));
        assert!(on.check(&headers(&[("host", "10.0.0.6")])).is_err());
        // With tokens, or auth.insecure, any Host.
        for guard in [
            RequestGuard::new(true, false, LOOPBACK.parse().expect("addr")),
            RequestGuard::new(false, true, "0.0.0.0:8080".parse().expect("addr")),
        ] {
            let h = headers(&[("host", "router.internal:8080")]);
            assert_eq!(guard.check(&h), Ok(()));
        }
    }

    #[tokio::test]
    async fn a_changes_body_is_json_or_nothing() {
        let ok = |pairs: &[(&'static str, &str)], len: Option<usize>| {
            check_body_type(&headers(pairs), len).is_ok()
        };
        for ct in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/cloudevents+json",
            "application/merge-patch+json",
        ] {
            assert!(ok(&[("content-type", ct)], None), "{ct}");
            assert!(ok(&[("content-type", ct)], Some(10)), "{ct}");
        }
        // Nothing at all: a body-less change (pause, reload).
        assert!(ok(&[], None));
        assert!(ok(&[], Some(0)));
        // What a page can send without a preflight, and other non-JSON types.
        for ct in [
            "text/plain",
            "text/plain; charset=utf-8",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "text/json",
            "application/+json",
            "application/json, text/plain",
            "",
        ] {
            assert!(!ok(&[("content-type", ct)], None), "{ct}");
            assert!(!ok(&[("content-type", ct)], Some(0)), "{ct}");
        }
        // A body with no content type.
        let refused = check_body_type(&headers(&[]), Some(2)).expect_err("no type");
        assert_eq!(refused.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
        let body = axum::body::to_bytes(refused.into_body(), 1 << 16)
            .await
            .expect("body");
        let json: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(json["error"], "unsupported content type", "{json}");
        assert_eq!(json["errors"][0]["pointer"], "/content-type", "{json}");
    }
}
