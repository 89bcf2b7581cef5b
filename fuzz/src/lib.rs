//! Invariants shared by the fuzz targets (see docs/fuzzing.md). Each check panics with a
//! message naming the broken invariant, which libFuzzer reports as a crash.

use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue, StatusCode};
use router::event::{CORE_ATTRIBUTES, CloudEvent, content_type_is_json};
use router::ingest::parse::{self, Limits, Mode, ParseError};
use serde_json::{Map, Value, json};

/// Small limits so that the 413 paths are reachable with short inputs.
pub const LIMITS: Limits = Limits {
    max_body_bytes: 1 << 20,
    max_json_depth: 64,
    max_batch: 100,
};

/// Headers with only a `Content-Type` (none when `content_type` is `None`).
pub fn content_type_headers(content_type: Option<&str>) -> HeaderMap {
    let mut h = HeaderMap::new();
    if let Some(ct) = content_type {
        let v = HeaderValue::from_str(ct).expect("the targets pass valid content types");
        h.insert(CONTENT_TYPE, v);
    }
    h
}

/// The envelope invariants every parsed event must hold (the `CloudEvent` doc lists them).
pub fn check_event(ev: &CloudEvent) {
    assert!(!ev.id.is_empty(), "accepted an event with an empty id");
    assert!(
        !ev.source.is_empty(),
        "accepted an event with an empty source"
    );
    assert!(!ev.ty.is_empty(), "accepted an event with an empty type");
    if let Some(t) = &ev.time {
        assert!(
            chrono::DateTime::parse_from_rfc3339(t).is_ok(),
            "accepted time {t:?} that is not RFC 3339"
        );
    }
    assert!(
        ev.data.is_none() || ev.data_base64.is_none(),
        "accepted an event with both data and data_base64"
    );
    assert!(
        ev.data.as_ref().map(router::event::Data::value) != Some(&Value::Null),
        "a null data must read as absent"
    );
    for (name, value) in &ev.extensions {
        assert!(
            !name.is_empty()
                && name.len() <= 64
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()),
            "accepted invalid extension name {name:?}"
        );
        assert!(
            !CORE_ATTRIBUTES.contains(&name.as_str()),
            "core attribute {name:?} ended up among the extensions"
        );
        assert!(
            matches!(value, Value::String(_) | Value::Number(_) | Value::Bool(_)),
            "extension {name:?} has a non-scalar value {value}"
        );
    }
    if let Some(v) = ev.extensions.get("hops") {
        let n = v.as_u64().expect("hops is stored as an integer");
        assert!(
            n <= u64::from(i32::MAX.unsigned_abs()),
            "hops {n} out of range"
        );
    }
    if let Some(v) = ev.extensions.get("dataversion") {
        let n = v.as_u64().expect("dataversion is stored as an integer");
        assert!(
            (1..=u64::from(i32::MAX.unsigned_abs())).contains(&n),
            "dataversion {n} out of range"
        );
        assert_eq!(u64::from(ev.dataversion()), n);
    }
}

/// A rejected request: a documented status, at least one error, pointers that are empty or
/// JSON pointers, and a `Display` that mentions the status.
pub fn check_error(e: &ParseError) {
    assert!(
        matches!(
            e.status,
            StatusCode::BAD_REQUEST
                | StatusCode::PAYLOAD_TOO_LARGE
                | StatusCode::UNSUPPORTED_MEDIA_TYPE
        ),
        "unexpected status {}",
        e.status
    );
    assert!(!e.errors.is_empty(), "an error without any FieldError");
    for fe in &e.errors {
        assert!(
            fe.pointer.is_empty() || fe.pointer.starts_with('/'),
            "pointer {:?} is not a JSON pointer",
            fe.pointer
        );
        assert!(!fe.message.is_empty(), "an empty error message");
    }
    let shown = e.to_string();
    assert!(shown.starts_with(e.status.as_str()), "Display: {shown}");
}

/// An accepted event survives the trip through its structured form unchanged: what the router
/// stores and delivers (`to_json`) parses back to the same event.
pub fn check_round_trip(ev: &CloudEvent) {
    let body = serde_json::to_vec(&ev.to_json()).expect("a Value always serialises");
    let headers = content_type_headers(Some(parse::STRUCTURED_CONTENT_TYPE));
    // The re-serialised form may be larger than the input (escapes), so no body limit here.
    let limits = Limits {
        max_body_bytes: usize::MAX,
        // `to_json` adds no nesting: `data` sits one level below the envelope, as it did.
        ..LIMITS
    };
    match parse::parse_request(&headers, &body, &limits) {
        Ok((Mode::Structured, evs)) => {
            assert_eq!(evs.len(), 1);
            assert_eq!(&evs[0], ev, "round trip through to_json changed the event");
        }
        Ok((mode, _)) => panic!("round trip parsed as {mode:?}"),
        Err(e) => panic!("round trip of an accepted event was rejected: {e}"),
    }
}

/// `parse_request` on `body` with one `Content-Type` (or none), with every invariant checked.
pub fn parse_and_check(
    content_type: Option<&str>,
    body: &[u8],
) -> Result<(Mode, Vec<CloudEvent>), ParseError> {
    let headers = content_type_headers(content_type);
    let out = parse::parse_request(&headers, body, &LIMITS);
    match &out {
        Ok((_, evs)) => {
            // An empty batch is valid (HTTP binding 3.3.2); any other answer has events.
            assert!(
                !evs.is_empty() || matches!(out, Ok((Mode::Batch, _))),
                "accepted a request without events"
            );
            assert!(
                evs.len() <= LIMITS.max_batch,
                "accepted more than max_batch events"
            );
            for ev in evs {
                check_event(ev);
                check_round_trip(ev);
            }
        }
        Err(e) => check_error(e),
    }
    out
}

/// The JSON body as the parser reads it, when it is within the depth limit.
pub fn json_body(body: &[u8]) -> Option<Value> {
    if parse::json_depth_exceeds(body, LIMITS.max_json_depth) {
        return None;
    }
    serde_json::from_slice(body).ok()
}

/// Whether a structured-mode object carries `"specversion": "1.0"` (last occurrence wins).
pub fn has_specversion_1_0(obj: &Value) -> bool {
    obj.get("specversion").and_then(Value::as_str) == Some("1.0")
}

/// Whether `ct` counts as JSON for binary-mode bodies (re-exported for the binary target).
pub fn is_json_content_type(ct: Option<&str>) -> bool {
    ct.is_none_or(content_type_is_json)
}

/// A few CloudEvents of the shapes rules usually look at.
pub fn fixed_events() -> Vec<Value> {
    vec![
        json!({"specversion": "1.0", "id": "1", "source": "shop", "type": "order.created",
               "data": {"total": 12.5, "currency": "EUR", "items": [{"sku": "a", "qty": 2}],
                        "ip": "10.0.0.7", "tags": ["new", "vip"], "note": null}}),
        json!({"specversion": "1.0", "id": "2", "source": "/billing", "type": "order.paid",
               "subject": "o-9", "data": {"total": 0, "ip": "2001:db8::1", "paid": true}}),
        json!({"id": "3", "source": "x", "type": "ping", "data": "text", "detail": {"a": 1}}),
        json!({}),
    ]
}

/// An event built from the pattern's own operands, so that patterns have a fair chance of
/// matching something: matcher lists become arrays of their operands, matcher objects their
/// string or number operand, nested patterns nested objects (`detail` as `data`).
pub fn witness(pattern: &Value) -> Value {
    match pattern {
        Value::Object(m) => {
            let mut out = Map::new();
            for (k, v) in m {
                let k = match k.as_str() {
                    "detail" => "data",
                    "detail-type" => "type",
                    other => other,
                };
                out.insert(k.to_owned(), witness(v));
            }
            if m.len() == 1
                && let Some((_, operand)) = m.iter().next()
                && (operand.is_string() || operand.is_number())
            {
                return operand.clone();
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(witness).collect()),
        scalar => scalar.clone(),
    }
}
