//! Parsing the API's request bodies and query strings into typed requests, with a 400 whose
//! error points at the field or parameter that did not parse (`/filter/since`, `/limit`)
//! rather than at the request as a whole.

use axum::extract::FromRequestParts;
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::Response;
use serde::de::DeserializeOwned;

use crate::event::FieldError;
use crate::ingest::error_response;

/// The JSON pointer of a deserialisation error: where it happened (`""` for the whole input)
/// and, for a missing field, that field. Serde reports a missing field at the object that
/// should hold it and names it only in its message (`missing field `version``), so the name is
/// taken from there. (An unknown field is already the path's last step.)
pub(crate) fn error_pointer<E: std::fmt::Display>(e: &serde_path_to_error::Error<E>) -> String {
    let mut out = pointer(e.path());
    let message = e.inner().to_string();
    // serde names a missing or repeated field only in its message (the path stops at the
    // object holding it); a query parameter given twice is a repeated field.
    let missing = ["missing field `", "duplicate field `"]
        .iter()
        .find_map(|p| message.strip_prefix(p))
        .and_then(|rest| rest.split_once('`'))
        .map(|(name, _)| crate::event::pointer_token(name));
    if let Some(name) = missing {
        out.push('/');
        out.push_str(&name);
    }
    out
}

/// The JSON pointer of a path (`""` for the whole input).
fn pointer(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for segment in path.iter() {
        match segment {
            Segment::Seq { index } => out.push_str(&format!("/{index}")),
            Segment::Map { key } => {
                out.push('/');
                out.push_str(&crate::event::pointer_token(key));
            }
            Segment::Enum { .. } | Segment::Unknown => {}
        }
    }
    out
}

/// A JSON request body as `T` (a struct: every admin body is a JSON object), or the 400
/// naming the field that does not fit.
pub(crate) fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, Box<Response>> {
    // serde's derived structs also take a JSON array, its elements read as the fields in
    // declaration order (`deny_unknown_fields` does not stop it): `["2026-…", "2026-…", null,
    // 100, false]` made a replay. Anything but an object is refused here, before serde. (An
    // empty body is left to serde, whose "EOF" error points at "" too.)
    if let Some(&first) = body.trim_ascii_start().first()
        && first != b'{'
    {
        return Err(Box::new(error_response(
            StatusCode::BAD_REQUEST,
            "invalid request body",
            vec![FieldError::new(
                "",
                "the body must be a JSON object ({…}), not an array, string, number, boolean or null",
            )],
        )));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        Box::new(error_response(
            StatusCode::BAD_REQUEST,
            "invalid request body",
            vec![FieldError::new(error_pointer(&e), e.inner().to_string())],
        ))
    })
}

/// A query string as `T` (like axum's `Query`), refused with a 400 in the API's error shape
/// whose pointer names the parameter (`/limit`).
#[derive(Debug, Clone, Default)]
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned> ApiQuery<T> {
    /// Parses a raw query string (without the `?`).
    pub(crate) fn parse(query: &str) -> Result<Self, Box<Response>> {
        let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(query.as_bytes()));
        serde_path_to_error::deserialize(de)
            .map(ApiQuery)
            .map_err(|e| {
                Box::new(error_response(
                    StatusCode::BAD_REQUEST,
                    "invalid query",
                    vec![FieldError::new(error_pointer(&e), e.inner().to_string())],
                ))
            })
    }
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Response> {
        Self::parse(parts.uri.query().unwrap_or_default()).map_err(|r| *r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Filter {
        since: Option<String>,
        tags: Option<Vec<u32>>,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Body {
        #[serde(default)]
        filter: Option<Filter>,
        rate_per_sec: Option<f64>,
    }

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Q {
        target: Option<String>,
        limit: Option<usize>,
    }

    async fn error_of(r: Box<Response>) -> (u16, serde_json::Value) {
        let status = r.status().as_u16();
        let body = axum::body::to_bytes(r.into_body(), 1 << 16)
            .await
            .expect("body");
        (status, serde_json::from_slice(&body).expect("json"))
    }

    #[tokio::test]
    async fn a_body_error_points_at_its_field() {
        let cases = [
            (
                r#"{"rate_per_sec": "fast"}"#,
                "/rate_per_sec",
                "invalid type",
            ),
            (
                r#"{"filter": {"since": 5}}"#,
                "/filter/since",
                "invalid type",
            ),
            (
                r#"{"filter": {"tags": [1, "x"]}}"#,
                "/filter/tags/1",
                "invalid type",
            ),
            (
                r#"{"filter": {"sinse": "1h"}}"#,
                "/filter/sinse",
                "unknown field `sinse`",
            ),
            (
                r#"{"filter": {}, "extra": 1}"#,
                "/extra",
                "unknown field `extra`",
            ),
            (r#"{"rate_per_sec": 1"#, "", "EOF"),
        ];
        for (body, want_pointer, want_message) in cases {
            let err = parse_body::<Body>(body.as_bytes()).expect_err(body);
            let (status, json) = error_of(err).await;
            assert_eq!(status, 400);
            assert_eq!(json["errors"][0]["pointer"], want_pointer, "{body}: {json}");
            let message = json["errors"][0]["message"].as_str().unwrap_or_default();
            assert!(message.contains(want_message), "{body}: {json}");
        }
        assert!(parse_body::<Body>(br#"{"filter": {"since": "1h"}}"#).is_ok());
    }

    #[tokio::test]
    async fn a_body_that_is_not_an_object_is_refused_as_a_whole() {
        // A derived struct takes an array in field order: this one parsed as a `Body`.
        assert!(serde_json::from_str::<Body>(r#"[null, 5]"#).is_ok());
        for body in [
            r#"[null, 5]"#,
            "[]",
            " \n[{}]",
            "null",
            "5",
            r#""{}""#,
            "true",
        ] {
            let err = parse_body::<Body>(body.as_bytes()).expect_err(body);
            let (status, json) = error_of(err).await;
            assert_eq!(status, 400, "{body}");
            assert_eq!(json["errors"][0]["pointer"], "", "{body}: {json}");
            let message = json["errors"][0]["message"].as_str().unwrap_or_default();
            assert!(message.contains("must be a JSON object"), "{body}: {json}");
        }
        assert!(parse_body::<Body>(b" \n {\"rate_per_sec\": 1}").is_ok());
    }

    #[tokio::test]
    async fn a_query_error_points_at_its_parameter() {
        let q = ApiQuery::<Q>::parse("target=erp&limit=10").expect("valid");
        assert_eq!((q.0.target.as_deref(), q.0.limit), (Some("erp"), Some(10)));
        let err = ApiQuery::<Q>::parse("target=erp&limit=ten").expect_err("limit");
        let (status, json) = error_of(err).await;
        assert_eq!(status, 400);
        assert_eq!(json["error"], "invalid query");
        assert_eq!(json["errors"][0]["pointer"], "/limit", "{json}");
    }

    #[tokio::test]
    async fn a_missing_field_is_pointed_at() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Rollback {
            version: String,
        }
        let err = parse_body::<Rollback>(b"{}").expect_err("missing");
        let (_, json) = error_of(err).await;
        assert_eq!(json["errors"][0]["pointer"], "/version", "{json}");
    }
}
