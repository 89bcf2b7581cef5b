//! Pipeline stage 1 (HTTP ingest → envelope check): turns a `POST /v1/events` request into
//! validated [`CloudEvent`]s, per the CloudEvents 1.0 HTTP binding (structured, batch and binary
//! modes). Contract checks on `data` come next, in `contract`.

use std::fmt;

use base64::Engine as _;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use http::header::CONTENT_TYPE;
use http::{HeaderMap, StatusCode};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::event::{
    CloudEvent, Data, FieldError, content_type_is_json, is_w3c_traceparent, is_w3c_tracestate,
};

/// Structured-mode media type.
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";
/// Batch-mode media type.
pub const BATCH_CONTENT_TYPE: &str = "application/cloudevents-batch+json";

/// Longest extension attribute name accepted. CloudEvents says names SHOULD NOT exceed 20
/// characters (a MUST only for the character set), so longer ones are accepted up to this
/// bound, which only keeps a name from being unreasonably large.
const MAX_ATTRIBUTE_NAME_LEN: usize = 64;

/// Base64 (standard alphabet) that accepts input with or without `=` padding.
const BASE64_LENIENT: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// Size limits applied to every ingest request before and while parsing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest accepted request body, in bytes (default 1 MiB). Larger → 413.
    pub max_body_bytes: usize,
    /// Deepest accepted nesting of JSON arrays/objects (default 64). Deeper → 400.
    pub max_json_depth: usize,
    /// Most events accepted in one batch (default 1000). More → 413.
    pub max_batch: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: 1 << 20,
            max_json_depth: 64,
            max_batch: 1000,
        }
    }
}

/// Which CloudEvents HTTP binding mode a request used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// One event as a JSON object (`application/cloudevents+json`, or lenient `application/json`).
    Structured,
    /// A JSON array of events (`application/cloudevents-batch+json`, or lenient `application/json`).
    Batch,
    /// Attributes in `ce-*` headers, body = `data`.
    Binary,
}

/// A rejected request: the HTTP status to answer with and every problem found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    /// 400, 413 or 415.
    pub status: StatusCode,
    /// The answer's summary (its `error`).
    pub summary: &'static str,
    /// The problems, each located by a JSON pointer (or a `/ce-<name>` or `/content-type`
    /// header pointer).
    pub errors: Vec<FieldError>,
    /// The events the request carried, all refused with it: a batch's elements, else 1 (one
    /// event, or a body that could not be read as events at all).
    pub events: usize,
}

impl ParseError {
    fn one(status: StatusCode, pointer: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status,
            summary: match status {
                StatusCode::PAYLOAD_TOO_LARGE => "request too large",
                StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported content type",
                _ => "invalid CloudEvent",
            },
            errors: vec![FieldError::new(pointer, message)],
            events: 1,
        }
    }

    fn bad_request(errors: Vec<FieldError>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            summary: "invalid CloudEvent",
            errors,
            events: 1,
        }
    }

    /// The same refusal, of a batch of `n` events.
    fn of_batch(self, n: usize) -> Self {
        Self { events: n, ..self }
    }
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.status)?;
        for (i, e) in self.errors.iter().enumerate() {
            let sep = if i == 0 { ": " } else { "; " };
            if e.pointer.is_empty() {
                write!(f, "{sep}{}", e.message)?;
            } else {
                write!(f, "{sep}{}: {}", e.pointer, e.message)?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for ParseError {}

/// Parses one ingest request in any of the three CloudEvents HTTP modes.
///
/// Mode selection: `application/cloudevents+json` → structured; `application/cloudevents-batch+json`
/// → batch; otherwise any `ce-*` header → binary; otherwise `application/json` (or no
/// content type) → structured for an object body, batch for an array body; anything else → 415.
///
/// # Errors
/// 413 when the body or the batch is too large, 415 for an unsupported content type, 400 for
/// malformed or too deep JSON and for envelope violations (all of them, for every event).
///
/// A single event (structured or binary mode) without a `traceparent` of its own takes the
/// request's W3C trace context headers (`traceparent`, and `tracestate` with it) as its
/// Distributed Tracing extension, as the CloudEvents extension allows middleware to: an
/// OpenTelemetry-instrumented client puts its context there. A batch's events do not, since
/// one request's context does not describe each of them.
pub fn parse_request(
    headers: &HeaderMap,
    body: &[u8],
    limits: &Limits,
) -> Result<(Mode, Vec<CloudEvent>), ParseError> {
    let (mode, mut events) = parse_body(headers, body, limits)?;
    if let (Mode::Structured | Mode::Binary, [ev]) = (mode, events.as_mut_slice()) {
        adopt_trace_context(headers, ev);
    }
    Ok((mode, events))
}

/// Sets the event's `traceparent` (and `tracestate`) from the request's headers when it has
/// none and the header is a valid W3C `traceparent`.
fn adopt_trace_context(headers: &HeaderMap, ev: &mut CloudEvent) {
    if ev.extensions.contains_key("traceparent") {
        return;
    }
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let Some(tp) = header("traceparent").filter(|tp| is_w3c_traceparent(tp)) else {
        return;
    };
    ev.extensions
        .insert("traceparent".into(), Value::from(tp.to_owned()));
    if !ev.extensions.contains_key("tracestate")
        && let Some(ts) = header("tracestate").filter(|ts| is_w3c_tracestate(ts))
    {
        ev.extensions
            .insert("tracestate".into(), Value::from(ts.to_owned()));
    }
}

fn parse_body(
    headers: &HeaderMap,
    body: &[u8],
    limits: &Limits,
) -> Result<(Mode, Vec<CloudEvent>), ParseError> {
    // Nothing decodes a body: a compressed one would be stored as its compressed bytes
    // (binary mode) or refused as malformed JSON, neither what the producer sent.
    if let Some(refused) = coding_refused(headers) {
        return Err(ParseError {
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            summary: UNSUPPORTED_CODING,
            errors: vec![refused],
            events: 1,
        });
    }
    if body.len() > limits.max_body_bytes {
        return Err(ParseError::one(
            StatusCode::PAYLOAD_TOO_LARGE,
            "",
            format!(
                "request body is {} bytes, larger than the limit of {} bytes",
                body.len(),
                limits.max_body_bytes
            ),
        ));
    }

    let content_type = match headers.get(CONTENT_TYPE) {
        None => None,
        Some(v) => match v.to_str() {
            Ok(s) => Some(s.to_owned()),
            Err(_) => {
                return Err(ParseError::one(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "",
                    format!("Content-Type is not valid ASCII; {}", accepted_types()),
                ));
            }
        },
    };
    // JSON is UTF-8 (RFC 8259 §8.1), and it is read as such: a body declared in another
    // charset would be refused as malformed or, when its bytes happen to read as UTF-8, stored
    // as other text than was sent.
    if let Some(ct) = content_type.as_deref()
        && content_type_is_json(ct)
        && !charset_is_utf8(ct)
    {
        return Err(ParseError::one(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "/content-type",
            format!(
                "only UTF-8 is accepted: Content-Type {ct:?} names another charset; send the JSON as UTF-8 (charset=utf-8, or no charset)"
            ),
        ));
    }
    let essence = content_type.as_deref().map(media_essence);
    let has_ce_headers = headers.keys().any(|k| k.as_str().starts_with("ce-"));

    match essence.as_deref() {
        Some(STRUCTURED_CONTENT_TYPE) if starts_with(body, b'{') => {
            check_depth(body, limits)?;
            structured_object(from_json(body)?)
        }
        Some(STRUCTURED_CONTENT_TYPE) => {
            let v = parse_json_body(body, limits)?;
            if !v.is_object() {
                return Err(ParseError::one(
                    StatusCode::BAD_REQUEST,
                    "",
                    format!(
                        "{STRUCTURED_CONTENT_TYPE} expects one JSON object; send an array as {BATCH_CONTENT_TYPE}"
                    ),
                ));
            }
            structured(v)
        }
        Some(BATCH_CONTENT_TYPE) if starts_with(body, b'[') => {
            check_depth(body, limits)?;
            batch_elements(from_json(body)?, limits)
        }
        Some(BATCH_CONTENT_TYPE) => {
            let v = parse_json_body(body, limits)?;
            let Value::Array(items) = v else {
                return Err(ParseError::one(
                    StatusCode::BAD_REQUEST,
                    "",
                    format!("{BATCH_CONTENT_TYPE} expects a JSON array of events"),
                ));
            };
            batch(items, limits)
        }
        _ if has_ce_headers => binary(headers, content_type.as_deref(), body, limits),
        None | Some("application/json") if starts_with(body, b'{') => {
            check_depth(body, limits)?;
            structured_object(from_json(body)?)
        }
        None | Some("application/json") if starts_with(body, b'[') => {
            check_depth(body, limits)?;
            batch_elements(from_json(body)?, limits)
        }
        None | Some("application/json") => match parse_json_body(body, limits)? {
            v @ Value::Object(_) => structured(v),
            Value::Array(items) => batch(items, limits),
            _ => Err(ParseError::one(
                StatusCode::BAD_REQUEST,
                "",
                "expected a JSON object (one event) or a JSON array (a batch of events)",
            )),
        },
        Some(other) => Err(ParseError::one(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "",
            format!("unsupported Content-Type '{other}'; {}", accepted_types()),
        )),
    }
}

fn accepted_types() -> String {
    format!(
        "accepted: {STRUCTURED_CONTENT_TYPE}, {BATCH_CONTENT_TYPE}, application/json, \
         or binary mode (ce-specversion and other ce-* headers, any Content-Type)"
    )
}

/// Lower-cased media type without parameters.
fn media_essence(ct: &str) -> String {
    ct.split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

/// The summary of a 415 for a body sent with a content coding ([`coding_refused`]).
pub(crate) const UNSUPPORTED_CODING: &str = "unsupported content encoding";

/// The error of a request whose body has a content coding other than `identity`, or `None`:
/// the router decodes no body, at ingest or anywhere else in the API.
pub(crate) fn coding_refused(headers: &HeaderMap) -> Option<FieldError> {
    content_coding(headers).map(|coding| {
        FieldError::new(
            "/content-encoding",
            format!(
                "Content-Encoding {coding:?} is not supported: send the body uncompressed (no Content-Encoding, or identity)"
            ),
        )
    })
}

/// The request's content coding when it is not `identity` (every `Content-Encoding` value,
/// as sent), or `None`.
fn content_coding(headers: &HeaderMap) -> Option<String> {
    let values = headers.get_all(http::header::CONTENT_ENCODING);
    let identity = values.iter().all(|v| {
        v.to_str().is_ok_and(|v| {
            v.split(',').all(|coding| {
                let coding = coding.trim();
                coding.is_empty() || coding.eq_ignore_ascii_case("identity")
            })
        })
    });
    (!identity).then(|| {
        values
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .collect::<Vec<_>>()
            .join(", ")
    })
}

/// Whether a body of this Content-Type reads as UTF-8: no `charset` parameter (the HTTP
/// binding's data is then taken as sent; JSON is UTF-8), or `utf-8` / `us-ascii`. A body in
/// another charset kept as a string would be decoded wrongly (Latin-1 bytes read as UTF-8).
fn charset_is_utf8(ct: &str) -> bool {
    ct.split(';').skip(1).all(|param| {
        let Some((name, value)) = param.split_once('=') else {
            return true;
        };
        if !name.trim().eq_ignore_ascii_case("charset") {
            return true;
        }
        let value = value.trim().trim_matches('"');
        ["utf-8", "utf8", "us-ascii"]
            .iter()
            .any(|c| value.eq_ignore_ascii_case(c))
    })
}

/// Whether the body's first byte after JSON whitespace is `b`.
fn starts_with(body: &[u8], b: u8) -> bool {
    body.iter()
        .find(|c| !matches!(c, b' ' | b'\t' | b'\n' | b'\r'))
        .is_some_and(|c| *c == b)
}

/// One element of a structured or batch body: an object, parsed member by member except
/// `data`, which is kept as the text sent (checked for syntax, not built into a `Value`: most
/// events are stored and delivered without anyone reading it, see [`Data`]); or anything
/// else, which is not an event and is reported as such.
enum EventObject<'a> {
    Object {
        members: Map<String, Value>,
        data: Option<&'a RawValue>,
    },
    Other(Value),
}

impl<'de> serde::Deserialize<'de> for EventObject<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(EventObjectVisitor)
    }
}

struct EventObjectVisitor;

impl<'de> serde::de::Visitor<'de> for EventObjectVisitor {
    type Value = EventObject<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut members = Map::new();
        let mut data = None;
        while let Some(key) = map.next_key::<String>()? {
            // A repeated member: the last one counts, as when the object is read as a `Value`.
            if key == "data" {
                data = Some(map.next_value::<&'de RawValue>()?);
            } else {
                let value = map.next_value::<Value>()?;
                members.insert(key, value);
            }
        }
        Ok(EventObject::Object { members, data })
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        serde::Deserialize::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))
            .map(EventObject::Other)
    }

    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(EventObject::Other(Value::Bool(v)))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(EventObject::Other(Value::from(v)))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(EventObject::Other(Value::from(v)))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(EventObject::Other(Value::from(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(EventObject::Other(Value::String(v.to_owned())))
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(EventObject::Other(Value::Null))
    }
}

impl EventObject<'_> {
    /// The event, or every envelope rule it breaks (pointers under `pointer_prefix`).
    fn into_event(self, pointer_prefix: &str) -> Result<CloudEvent, Vec<FieldError>> {
        match self {
            EventObject::Object { members, data } => {
                event_from_map(members, data, Locator::Json(pointer_prefix))
            }
            EventObject::Other(v) => event_from_json(v, pointer_prefix),
        }
    }
}

/// serde parsing of a body whose depth was checked; a failure is 400 at pointer "".
fn from_json<'a, T: serde::Deserialize<'a>>(body: &'a [u8]) -> Result<T, ParseError> {
    serde_json::from_slice(body)
        .map_err(|e| ParseError::one(StatusCode::BAD_REQUEST, "", format!("malformed JSON: {e}")))
}

fn structured_object(ev: EventObject<'_>) -> Result<(Mode, Vec<CloudEvent>), ParseError> {
    let ev = ev.into_event("").map_err(ParseError::bad_request)?;
    Ok((Mode::Structured, vec![ev]))
}

fn structured(v: Value) -> Result<(Mode, Vec<CloudEvent>), ParseError> {
    let ev = event_from_json(v, "").map_err(ParseError::bad_request)?;
    Ok((Mode::Structured, vec![ev]))
}

fn batch(items: Vec<Value>, limits: &Limits) -> Result<(Mode, Vec<CloudEvent>), ParseError> {
    batch_of(items, limits, event_from_json)
}

fn batch_elements(
    items: Vec<EventObject<'_>>,
    limits: &Limits,
) -> Result<(Mode, Vec<CloudEvent>), ParseError> {
    batch_of(items, limits, EventObject::into_event)
}

/// A batch's envelope checks: within `max_batch`, every element an event (all elements'
/// problems reported, under `/<index>`). An empty batch is valid (HTTP binding §3.3.2: "the
/// batch MAY be empty") and accepts nothing.
fn batch_of<T>(
    items: Vec<T>,
    limits: &Limits,
    event: impl Fn(T, &str) -> Result<CloudEvent, Vec<FieldError>>,
) -> Result<(Mode, Vec<CloudEvent>), ParseError> {
    if items.len() > limits.max_batch {
        return Err(ParseError::one(
            StatusCode::PAYLOAD_TOO_LARGE,
            "",
            format!(
                "batch has {} events, more than the limit of {} (max_batch)",
                items.len(),
                limits.max_batch
            ),
        )
        .of_batch(items.len()));
    }
    let n = items.len();
    let mut events = Vec::with_capacity(items.len());
    let mut errors = Vec::new();
    for (i, item) in items.into_iter().enumerate() {
        match event(item, &format!("/{i}")) {
            Ok(ev) => events.push(ev),
            Err(mut errs) => errors.append(&mut errs),
        }
    }
    if errors.is_empty() {
        Ok((Mode::Batch, events))
    } else {
        // One bad element refuses the whole batch: every element is a refused event.
        Err(ParseError::bad_request(errors).of_batch(n))
    }
}

/// Depth check, then serde parsing; both failures are 400 at pointer "".
fn parse_json_body(body: &[u8], limits: &Limits) -> Result<Value, ParseError> {
    check_depth(body, limits)?;
    from_json(body)
}

fn check_depth(body: &[u8], limits: &Limits) -> Result<(), ParseError> {
    if json_depth_exceeds(body, limits.max_json_depth) {
        return Err(depth_error(limits.max_json_depth));
    }
    Ok(())
}

fn depth_error(max: usize) -> ParseError {
    ParseError::one(
        StatusCode::BAD_REQUEST,
        "",
        format!("JSON nesting is deeper than the limit of {max} levels (max_json_depth)"),
    )
}

/// True when the JSON text nests arrays/objects more than `max` levels deep.
///
/// Depth counts containers: a scalar is depth 0, `[]` and `{}` are depth 1, `{"a":[1]}` is 2.
/// This is a byte scan (brackets inside strings, including escaped quotes, are ignored) that
/// allocates nothing, so it can run before serde on hostile input. Malformed input is scanned
/// as far as it goes; serde reports the syntax error afterwards. Strings are skipped with a
/// vectorised search for the next quote or backslash: a byte-at-a-time loop over them was
/// 8 % of the router's CPU with batches of 1 KB events.
pub fn json_depth_exceeds(body: &[u8], max: usize) -> bool {
    let mut depth = 0usize;
    let mut i = 0;
    while let Some(&b) = body.get(i) {
        match b {
            b'"' => {
                i += 1;
                loop {
                    let Some(off) = memchr::memchr2(b'"', b'\\', body.get(i..).unwrap_or(&[]))
                    else {
                        // An unterminated string: nothing after it can nest.
                        return false;
                    };
                    i += off;
                    if body[i] == b'"' {
                        break;
                    }
                    // A backslash escapes the byte after it (which may be a quote).
                    i += 2;
                }
            }
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    false
}

/// How attribute errors are located: structured/batch use `<prefix>/<name>`, binary mode
/// names the header (`/ce-<name>`).
#[derive(Clone, Copy)]
enum Locator<'a> {
    Json(&'a str),
    Headers,
}

impl Locator<'_> {
    fn attr(self, name: &str) -> String {
        match self {
            Locator::Json(prefix) => format!("{prefix}/{}", crate::event::pointer_token(name)),
            Locator::Headers => match name {
                "data" | "data_base64" => "/data".to_owned(),
                "datacontenttype" => "/content-type".to_owned(),
                _ => format!("/ce-{}", crate::event::pointer_token(name)),
            },
        }
    }

    fn describe(self, name: &str) -> String {
        match self {
            Locator::Json(_) => format!("attribute '{name}'"),
            Locator::Headers if name == "datacontenttype" => "Content-Type".to_owned(),
            Locator::Headers => format!("header ce-{name}"),
        }
    }
}

/// Builds a [`CloudEvent`] from one structured-mode JSON object, checking the whole envelope.
///
/// `pointer_prefix` is prepended to every error pointer (`""` for a single event, `"/3"` for
/// element 3 of a batch). All problems of the event are returned, not only the first.
///
/// # Errors
/// Every envelope rule the object breaks, each as a [`FieldError`].
pub fn event_from_json(v: Value, pointer_prefix: &str) -> Result<CloudEvent, Vec<FieldError>> {
    match v {
        Value::Object(m) => event_from_map(m, None, Locator::Json(pointer_prefix)),
        other => Err(vec![FieldError::new(
            pointer_prefix,
            format!(
                "an event must be a JSON object, got {}",
                json_type_name(&other)
            ),
        )]),
    }
}

fn json_type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// CloudEvents attribute naming rule: `[a-z0-9]`, at least one (and at most
/// [`MAX_ATTRIBUTE_NAME_LEN`]).
fn valid_attribute_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_ATTRIBUTE_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// `raw_data`: the `data` member as sent, when the caller kept it out of `m` (the structured and
/// batch parsers do; see [`EventObject`]).
fn event_from_map(
    m: Map<String, Value>,
    raw_data: Option<&RawValue>,
    loc: Locator<'_>,
) -> Result<CloudEvent, Vec<FieldError>> {
    let mut errors = Vec::new();
    let mut err =
        |name: &str, message: String| errors.push(FieldError::new(loc.attr(name), message));

    let mut specversion_seen = false;
    let mut id = None;
    let mut source = None;
    let mut ty = None;
    let mut subject = None;
    let mut time = None;
    let mut datacontenttype = None;
    let mut dataschema = None;
    let mut data = None;
    let mut data_base64 = None;
    let mut extensions = Map::new();

    for (name, value) in m {
        match name.as_str() {
            "specversion" => {
                specversion_seen = true;
                match &value {
                    Value::String(s) if s == "1.0" => {}
                    other => err(
                        &name,
                        format!("specversion must be \"1.0\", got {}", short(other)),
                    ),
                }
            }
            "id" | "source" | "type" | "subject" | "datacontenttype" | "dataschema" | "time"
                if value.as_str().is_some_and(has_control_chars) =>
            {
                err(
                    &name,
                    format!(
                        "{} must not contain control characters (U+0000-U+001F, U+007F-U+009F)",
                        loc.describe(&name)
                    ),
                );
            }
            "id" | "source" | "type" => match value {
                Value::String(s) if !s.is_empty() => {
                    let slot = match name.as_str() {
                        "id" => &mut id,
                        "source" => &mut source,
                        _ => &mut ty,
                    };
                    *slot = Some(s);
                }
                Value::String(_) => {
                    err(&name, format!("{} must not be empty", loc.describe(&name)))
                }
                other => err(
                    &name,
                    format!(
                        "{} must be a non-empty string, got {}",
                        loc.describe(&name),
                        json_type_name(&other)
                    ),
                ),
            },
            "subject" | "datacontenttype" | "dataschema" | "time" => match value {
                Value::Null => {}
                Value::String(s) => {
                    if let Some(problem) = attribute_value_problem(&name, &s) {
                        err(
                            &name,
                            format!(
                                "{} {problem}, got {}",
                                loc.describe(&name),
                                short(&Value::String(s))
                            ),
                        );
                        continue;
                    }
                    let slot = match name.as_str() {
                        "subject" => &mut subject,
                        "datacontenttype" => &mut datacontenttype,
                        "dataschema" => &mut dataschema,
                        _ => &mut time,
                    };
                    *slot = Some(s);
                }
                other => err(
                    &name,
                    format!(
                        "{} must be a string, got {}",
                        loc.describe(&name),
                        json_type_name(&other)
                    ),
                ),
            },
            "data" => match value {
                Value::Null => {}
                v => data = Some(Data::from(v)),
            },
            "data_base64" => match value {
                Value::Null => {}
                Value::String(s) => {
                    if let Err(e) = BASE64_LENIENT.decode(s.as_bytes()) {
                        err(&name, format!("data_base64 is not valid base64: {e}"));
                    } else {
                        data_base64 = Some(s);
                    }
                }
                other => err(
                    &name,
                    format!(
                        "data_base64 must be a base64 string, got {}",
                        json_type_name(&other)
                    ),
                ),
            },
            _ => {
                if value.is_null() {
                    // The JSON format: a null attribute is the same as an absent one.
                    continue;
                }
                if !valid_attribute_name(&name) {
                    err(
                        &name,
                        format!(
                            "invalid extension attribute name '{name}': names are 1-{MAX_ATTRIBUTE_NAME_LEN} characters of lower-case letters a-z and digits 0-9"
                        ),
                    );
                    continue;
                }
                // `hops` counts the handlers an event has passed through, and a producer may
                // be another router (a webhook target of one) passing on an emitted event: it
                // is kept, so handlers here continue the count and loops across routers end at
                // the hop limit. Only its form is checked, as for dataversion.
                if name == "hops" {
                    match hops_value(&value) {
                        Ok(n) => {
                            extensions.insert(name, Value::from(n));
                        }
                        Err(msg) => err(&name, msg),
                    }
                    continue;
                }
                if name == "dataversion" {
                    match dataversion_value(&value) {
                        Ok(n) => {
                            extensions.insert(name, Value::from(n));
                        }
                        Err(msg) => err(&name, msg),
                    }
                    continue;
                }
                match value {
                    Value::String(s) if has_control_chars(&s) => err(
                        &name,
                        format!(
                            "extension attribute '{name}' must not contain control characters (U+0000-U+001F, U+007F-U+009F)"
                        ),
                    ),
                    // The CloudEvents type system's Integer is 32-bit and it has no other
                    // number type: a fraction or a larger number would not survive another
                    // CloudEvents hop.
                    Value::Number(n) if n.as_i64().is_none_or(|i| i32::try_from(i).is_err()) => {
                        err(
                            &name,
                            format!(
                                "extension attribute '{name}' must be an integer from {} to {} (CloudEvents has no other number type; send other numbers as strings), got {n}",
                                i32::MIN,
                                i32::MAX
                            ),
                        )
                    }
                    Value::String(_) | Value::Number(_) | Value::Bool(_) => {
                        extensions.insert(name, value);
                    }
                    other => err(
                        &name,
                        format!(
                            "extension attribute '{name}' must be a string, integer or boolean, got {}",
                            json_type_name(&other)
                        ),
                    ),
                }
            }
        }
    }

    if !specversion_seen {
        err(
            "specversion",
            format!("{} is required", loc.describe("specversion")),
        );
    }
    for (name, slot) in [("id", &id), ("source", &source), ("type", &ty)] {
        if slot.is_some() {
            continue;
        }
        // Only report "missing" when the attribute was absent (not when it was present but bad).
        let pointer = loc.attr(name);
        if !errors.iter().any(|e| e.pointer == pointer) {
            errors.push(FieldError::new(
                pointer,
                format!("{} is required", loc.describe(name)),
            ));
        }
    }
    if let Some(raw) = raw_data
        && raw.get() != "null"
    {
        match reads_as_value(raw.get()) {
            Ok(()) => data = Some(Data::from_raw(raw.to_owned())),
            Err(e) => errors.push(FieldError::new(
                loc.attr("data"),
                format!("data is not a JSON value the router can read: {e}"),
            )),
        }
    }
    if data.is_some() && data_base64.is_some() {
        errors.push(FieldError::new(
            loc.attr("data_base64"),
            "data and data_base64 are mutually exclusive: send only one",
        ));
    }

    match (id, source, ty) {
        (Some(id), Some(source), Some(ty)) if errors.is_empty() => Ok(CloudEvent {
            id,
            source,
            ty,
            subject,
            time,
            datacontenttype,
            dataschema,
            data,
            data_base64,
            extensions,
        }),
        _ => Err(errors),
    }
}

/// A non-negative CloudEvents Integer (at most `i32::MAX`) as a number or in its canonical
/// string form (digits), which binary headers always use and which a relay turning binary
/// mode into structured mode may keep.
fn cloudevents_count(v: &Value) -> Option<u32> {
    let parsed = match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => {
            // All digits: the only failure left is overflow.
            Some(s.parse::<u64>().unwrap_or(u64::MAX))
        }
        _ => None,
    };
    parsed
        .and_then(|n| i32::try_from(n).ok())
        .map(i32::unsigned_abs)
}

/// `dataversion`: a positive CloudEvents Integer ([`cloudevents_count`] from 1).
fn dataversion_value(v: &Value) -> Result<u32, String> {
    cloudevents_count(v).filter(|&n| n >= 1).ok_or_else(|| {
        format!(
            "dataversion must be a positive integer (1 to {}), got {}",
            i32::MAX,
            short(v)
        )
    })
}

/// The `hops` extension as a number ([`cloudevents_count`], from 0).
fn hops_value(v: &Value) -> Result<u32, String> {
    cloudevents_count(v).ok_or_else(|| {
        format!(
            "hops (the handlers an event has passed through) must be an integer from 0 to {}, got {}",
            i32::MAX,
            short(v)
        )
    })
}

/// Whether `s` holds a character the CloudEvents String type excludes (the C0 and C1 controls).
fn has_control_chars(s: &str) -> bool {
    s.chars().any(char::is_control)
}

/// What is wrong with the value of the string attribute `name`, if anything: `subject` is
/// non-empty, `time` is RFC 3339 (with its `T`), `dataschema` an absolute URI and
/// `datacontenttype` a media type (RFC 2046 `type/subtype`, parameters allowed).
fn attribute_value_problem(name: &str, s: &str) -> Option<&'static str> {
    match name {
        "subject" if s.is_empty() => Some("must not be empty when present"),
        "time"
            if chrono::DateTime::parse_from_rfc3339(s).is_err()
                || !matches!(s.as_bytes().get(10), Some(b'T' | b't')) =>
        {
            Some("must be an RFC 3339 timestamp (e.g. 2024-05-01T12:00:00Z)")
        }
        "dataschema" if !is_absolute_uri(s) => {
            Some("must be an absolute URI (a scheme such as https: and no spaces)")
        }
        "datacontenttype" if !is_media_type(s) => {
            Some("must be a media type such as application/json (RFC 2046 type/subtype)")
        }
        _ => None,
    }
}

/// RFC 3986 `absolute-URI` in outline: a scheme (`ALPHA *( ALPHA / DIGIT / "+" / "-" / "." )`),
/// a colon, and no whitespace.
fn is_absolute_uri(s: &str) -> bool {
    let Some((scheme, _)) = s.split_once(':') else {
        return false;
    };
    let mut chars = scheme.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
        && !s.chars().any(char::is_whitespace)
}

/// `type/subtype` of RFC 2045 tokens, before any `;` parameters.
fn is_media_type(s: &str) -> bool {
    fn token(t: &str) -> bool {
        !t.is_empty()
            && t.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
    }
    let essence = s.split(';').next().unwrap_or("").trim();
    essence
        .split_once('/')
        .is_some_and(|(ty, sub)| token(ty) && token(sub))
}

/// A value rendered for an error message, truncated so a huge value cannot bloat the answer.
fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() <= 64 {
        return s;
    }
    let mut end = 61;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// Whether JSON text already known to be well formed also reads as a value: the syntax check
/// of `RawValue` lets numbers through that no `Value` can hold (`[1e400]`), which contracts and
/// patterns would then read as null. Walks the text without building anything (keys and
/// strings are borrowed where they have no escapes).
fn reads_as_value(text: &str) -> Result<(), serde_json::Error> {
    struct Walk;
    impl<'de> serde::de::Visitor<'de> for Walk {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            while seq.next_element::<Walked>()?.is_some() {}
            Ok(())
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            while map.next_entry::<serde::de::IgnoredAny, Walked>()?.is_some() {}
            Ok(())
        }
    }
    struct Walked;
    impl<'de> serde::Deserialize<'de> for Walked {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(Walk).map(|()| Walked)
        }
    }
    serde_json::from_str::<Walked>(text).map(|_| ())
}

/// A binary-mode body as JSON data: the text as sent, once it is known to read as a value
/// ([`reads_as_value`]).
fn json_data_of(body: &[u8]) -> Result<Box<RawValue>, serde_json::Error> {
    let raw = serde_json::from_slice::<Box<RawValue>>(body)?;
    reads_as_value(raw.get())?;
    Ok(raw)
}

/// Decodes a binary-mode header value (HTTP binding §3.1.3.2): a value sent as an HTTP
/// quoted-string (`"..."`, as older senders do) is unquoted first, then percent-decoded. A `%`
/// not followed by two hex digits is an error: senders must encode a literal `%` as `%25`.
fn decode_header_value(raw: &[u8]) -> Result<Vec<u8>, String> {
    fn hex(b: u8) -> Option<u8> {
        match b {
            b'0'..=b'9' => Some(b - b'0'),
            b'a'..=b'f' => Some(b - b'a' + 10),
            b'A'..=b'F' => Some(b - b'A' + 10),
            _ => None,
        }
    }
    let unquoted;
    let raw = match raw {
        [b'"', inner @ .., b'"'] => {
            let mut out = Vec::with_capacity(inner.len());
            let mut bytes = inner.iter();
            while let Some(&b) = bytes.next() {
                match b {
                    b'\\' => match bytes.next() {
                        Some(&escaped) => out.push(escaped),
                        None => return Err("ends inside a quoted-string escape".to_string()),
                    },
                    b'"' => return Err("has an unescaped '\"' inside its quotes".to_string()),
                    _ => out.push(b),
                }
            }
            unquoted = out;
            unquoted.as_slice()
        }
        _ => raw,
    };
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        if raw[i] == b'%' {
            match (
                raw.get(i + 1).copied().and_then(hex),
                raw.get(i + 2).copied().and_then(hex),
            ) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 3;
                    continue;
                }
                _ => {
                    return Err(format!(
                        "has a '%' at byte {i} that is not followed by two hex digits (percent-encode a literal '%' as %25)"
                    ));
                }
            }
        }
        out.push(raw[i]);
        i += 1;
    }
    Ok(out)
}

fn binary(
    headers: &HeaderMap,
    content_type: Option<&str>,
    body: &[u8],
    limits: &Limits,
) -> Result<(Mode, Vec<CloudEvent>), ParseError> {
    let mut errors = Vec::new();
    let mut attrs = Map::new();

    for name in headers.keys() {
        let Some(attr) = name.as_str().strip_prefix("ce-") else {
            continue;
        };
        let pointer = format!("/ce-{}", crate::event::pointer_token(attr));
        if matches!(attr, "data" | "data_base64" | "datacontenttype") {
            errors.push(FieldError::new(
                pointer,
                format!(
                    "ce-{attr} is not allowed in binary mode: data is the request body and its type is Content-Type"
                ),
            ));
            continue;
        }
        let mut values = headers.get_all(name).iter();
        let (Some(value), None) = (values.next(), values.next()) else {
            errors.push(FieldError::new(
                pointer,
                format!("header ce-{attr} must appear once"),
            ));
            continue;
        };
        match decode_header_value(value.as_bytes()).map(String::from_utf8) {
            Ok(Ok(s)) => {
                attrs.insert(attr.to_owned(), Value::String(s));
            }
            Ok(Err(_)) => errors.push(FieldError::new(
                pointer,
                format!("header ce-{attr} is not valid UTF-8 after percent-decoding"),
            )),
            Err(why) => errors.push(FieldError::new(pointer, format!("header ce-{attr} {why}"))),
        }
    }
    if let Some(ct) = content_type {
        attrs.insert("datacontenttype".into(), Value::String(ct.to_owned()));
    }

    // The body is `data`: JSON when Content-Type says so, kept as the bytes sent (numbers
    // and all), never rebuilt from a parsed value. Without a Content-Type, a body that is JSON
    // is JSON data (the CloudEvents default) and any other is carried as data_base64.
    let mut json_data = None;
    if !body.is_empty() {
        let declared_json = content_type.is_some_and(content_type_is_json);
        let as_json = if declared_json {
            if json_depth_exceeds(body, limits.max_json_depth) {
                return Err(depth_error(limits.max_json_depth));
            }
            match json_data_of(body) {
                Ok(raw) => Some(raw),
                Err(e) => {
                    errors.push(FieldError::new(
                        "/data",
                        format!("malformed JSON data: {e}"),
                    ));
                    return Err(ParseError::bad_request(errors));
                }
            }
        } else if content_type.is_none() {
            // serde_json bounds its own recursion (128 levels); what parses is JSON data and
            // held to the depth limit like any other.
            match json_data_of(body) {
                Ok(_) if json_depth_exceeds(body, limits.max_json_depth) => {
                    return Err(depth_error(limits.max_json_depth));
                }
                Ok(raw) => Some(raw),
                Err(_) => None,
            }
        } else {
            None
        };
        match as_json {
            Some(raw) => json_data = Some(raw),
            None => {
                let text = content_type.is_some_and(|ct| {
                    media_essence(ct).starts_with("text/") && charset_is_utf8(ct)
                });
                match std::str::from_utf8(body) {
                    Ok(s) if text => {
                        attrs.insert("data".into(), Value::String(s.to_owned()));
                    }
                    _ => {
                        let encoded = base64::engine::general_purpose::STANDARD.encode(body);
                        attrs.insert("data_base64".into(), Value::String(encoded));
                    }
                }
            }
        }
    }

    match event_from_map(attrs, json_data.as_deref(), Locator::Headers) {
        Ok(ev) if errors.is_empty() => Ok((Mode::Binary, vec![ev])),
        Ok(_) => Err(ParseError::bad_request(errors)),
        Err(more) => {
            // A header already refused (repeated, undecodable) is not also "required".
            let refused: Vec<String> = errors.iter().map(|e| e.pointer.clone()).collect();
            errors.extend(
                more.into_iter().filter(|e| {
                    !(refused.contains(&e.pointer) && e.message.ends_with("is required"))
                }),
            );
            Err(ParseError::bad_request(errors))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use http::header::HeaderName;
    use proptest::prelude::*;
    use serde_json::json;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    fn ct(ct: &str) -> HeaderMap {
        headers(&[("content-type", ct)])
    }

    fn minimal() -> Value {
        json!({"specversion": "1.0", "id": "1", "source": "/s", "type": "order.created"})
    }

    fn with(extra: Value) -> Value {
        let mut v = minimal();
        if let (Value::Object(m), Value::Object(x)) = (&mut v, extra) {
            for (k, val) in x {
                m.insert(k, val);
            }
        }
        v
    }

    fn parse(h: &HeaderMap, body: &[u8]) -> Result<(Mode, Vec<CloudEvent>), ParseError> {
        parse_request(h, body, &Limits::default())
    }

    fn structured_err(v: Value) -> ParseError {
        parse(&ct(STRUCTURED_CONTENT_TYPE), v.to_string().as_bytes()).unwrap_err()
    }

    fn pointers(e: &ParseError) -> Vec<&str> {
        e.errors.iter().map(|e| e.pointer.as_str()).collect()
    }

    fn binary_headers() -> Vec<(&'static str, &'static str)> {
        vec![
            ("ce-specversion", "1.0"),
            ("ce-id", "42"),
            ("ce-source", "/orders"),
            ("ce-type", "order.created"),
        ]
    }

    // ---- mode selection ----

    #[test]
    fn structured_mode() {
        let body = with(json!({"data": {"total": 3}})).to_string();
        let (mode, evs) = parse(&ct(STRUCTURED_CONTENT_TYPE), body.as_bytes()).unwrap();
        assert_eq!(mode, Mode::Structured);
        assert_eq!(evs.len(), 1);
        assert_eq!(evs[0].ty, "order.created");
        assert_eq!(evs[0].data, Some(Data::from(json!({"total": 3}))));
    }

    #[test]
    fn data_is_kept_as_sent_in_every_json_mode_and_null_data_is_none() {
        let one = r#"{"specversion":"1.0","id":"1","source":"/s","type":"t","data": {"a": 1.50, "a": 2}}"#;
        let (_, evs) = parse(&ct(STRUCTURED_CONTENT_TYPE), one.as_bytes()).unwrap();
        assert_eq!(
            evs[0].data.as_ref().map(Data::text),
            Some(r#"{"a": 1.50, "a": 2}"#)
        );
        assert_eq!(
            evs[0].data.as_ref().map(Data::value),
            Some(&json!({"a": 2}))
        );
        let batch = format!(
            r#" [ {one}, {{"specversion":"1.0","id":"2","source":"/s","type":"t","data":null}} ]"#
        );
        for h in [ct(BATCH_CONTENT_TYPE), ct("application/json")] {
            let (mode, evs) = parse(&h, batch.as_bytes()).unwrap();
            assert_eq!(mode, Mode::Batch);
            assert_eq!(
                evs[0].data.as_ref().map(Data::text),
                Some(r#"{"a": 1.50, "a": 2}"#)
            );
            assert_eq!(evs[1].data, None);
        }
        // A batch element that is not an object is named, as before.
        let bad = format!("[{one}, 7, [1]]");
        let e = parse(&ct(BATCH_CONTENT_TYPE), bad.as_bytes()).unwrap_err();
        let pointers: Vec<&str> = e.errors.iter().map(|e| e.pointer.as_str()).collect();
        assert_eq!(pointers, ["/1", "/2"], "{:?}", e.errors);
        assert!(
            e.errors[0].message.contains("got a number"),
            "{:?}",
            e.errors
        );
        // Malformed JSON inside data is malformed JSON.
        let broken = r#"{"specversion":"1.0","id":"1","source":"/s","type":"t","data":{"a":}}"#;
        let e = parse(&ct(STRUCTURED_CONTENT_TYPE), broken.as_bytes()).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(
            e.errors[0].message.starts_with("malformed JSON"),
            "{:?}",
            e.errors
        );
    }

    #[test]
    fn content_type_params_and_case_are_ignored() {
        let body = minimal().to_string();
        let h = ct("Application/CloudEvents+JSON; charset=UTF-8");
        assert_eq!(parse(&h, body.as_bytes()).unwrap().0, Mode::Structured);
        let batch = json!([minimal()]).to_string();
        let h = ct("APPLICATION/CLOUDEVENTS-BATCH+JSON ;charset=utf-8");
        assert_eq!(parse(&h, batch.as_bytes()).unwrap().0, Mode::Batch);
    }

    #[test]
    fn batch_mode() {
        let mut second = minimal();
        second["id"] = json!("2");
        let body = json!([minimal(), second]).to_string();
        let (mode, evs) = parse(&ct(BATCH_CONTENT_TYPE), body.as_bytes()).unwrap();
        assert_eq!(mode, Mode::Batch);
        assert_eq!(
            evs.iter().map(|e| e.id.as_str()).collect::<Vec<_>>(),
            ["1", "2"]
        );
    }

    #[test]
    fn structured_content_type_with_array_is_400() {
        let e = parse(&ct(STRUCTURED_CONTENT_TYPE), b"[]").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(pointers(&e), [""]);
    }

    #[test]
    fn batch_content_type_with_object_is_400() {
        let body = minimal().to_string();
        let e = parse(&ct(BATCH_CONTENT_TYPE), body.as_bytes()).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(pointers(&e), [""]);
    }

    #[test]
    fn an_empty_batch_accepts_nothing() {
        // HTTP binding §3.3.2: "The batch MAY be empty".
        for h in [
            ct(BATCH_CONTENT_TYPE),
            HeaderMap::new(),
            ct("application/json"),
        ] {
            let (mode, evs) = parse(&h, b" [ ] ").unwrap();
            assert_eq!((mode, evs.len()), (Mode::Batch, 0));
        }
    }

    #[test]
    fn oversized_batch_is_413_naming_the_limit() {
        let limits = Limits {
            max_batch: 2,
            ..Limits::default()
        };
        let body = json!([minimal(), minimal(), minimal()]).to_string();
        let e = parse_request(&ct(BATCH_CONTENT_TYPE), body.as_bytes(), &limits).unwrap_err();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert!(e.errors[0].message.contains("limit of 2"), "{e}");
    }

    #[test]
    fn lenient_application_json_object_and_array() {
        let body = minimal().to_string();
        assert_eq!(
            parse(&ct("application/json"), body.as_bytes()).unwrap().0,
            Mode::Structured
        );
        assert_eq!(
            parse(&HeaderMap::new(), body.as_bytes()).unwrap().0,
            Mode::Structured
        );
        let batch = json!([minimal()]).to_string();
        assert_eq!(
            parse(&ct("application/json; charset=utf-8"), batch.as_bytes())
                .unwrap()
                .0,
            Mode::Batch
        );
        assert_eq!(
            parse(&HeaderMap::new(), batch.as_bytes()).unwrap().0,
            Mode::Batch
        );
    }

    #[test]
    fn lenient_json_scalar_is_400() {
        let e = parse(&ct("application/json"), b"42").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(pointers(&e), [""]);
    }

    #[test]
    fn other_content_type_without_ce_headers_is_415() {
        let e = parse(&ct("text/plain"), b"hello").unwrap_err();
        assert_eq!(e.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        let msg = &e.errors[0].message;
        assert!(
            msg.contains(STRUCTURED_CONTENT_TYPE) && msg.contains(BATCH_CONTENT_TYPE),
            "{msg}"
        );
        assert!(
            msg.contains("application/json") && msg.contains("ce-"),
            "{msg}"
        );
    }

    #[test]
    fn non_ascii_content_type_is_415() {
        let mut h = HeaderMap::new();
        h.insert(
            CONTENT_TYPE,
            HeaderValue::from_bytes(b"application/\xffjson").unwrap(),
        );
        let e = parse(&h, b"{}").unwrap_err();
        assert_eq!(e.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    }

    /// A compressed body is refused in every mode, naming Content-Encoding: before, binary
    /// mode stored the gzip bytes as the event's data_base64 and structured mode answered
    /// "malformed JSON".
    #[test]
    fn a_content_encoding_other_than_identity_is_415() {
        let gzip_magic = b"\x1f\x8b\x08\x00\x00\x00\x00\x00".as_slice();
        let with_coding = |mut h: HeaderMap, coding: &str| {
            h.append(
                http::header::CONTENT_ENCODING,
                HeaderValue::from_str(coding).unwrap(),
            );
            h
        };
        let mut binary = binary_headers();
        binary.push(("content-type", "application/octet-stream"));
        for (h, body) in [
            (headers(&binary), gzip_magic.to_vec()),
            (ct(STRUCTURED_CONTENT_TYPE), gzip_magic.to_vec()),
            (ct(BATCH_CONTENT_TYPE), gzip_magic.to_vec()),
            (HeaderMap::new(), minimal().to_string().into_bytes()),
        ] {
            for coding in ["gzip", "br", "deflate, identity", "x-unknown"] {
                let e = parse(&with_coding(h.clone(), coding), &body).unwrap_err();
                assert_eq!(e.status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{coding}");
                assert_eq!(e.summary, "unsupported content encoding");
                assert_eq!(pointers(&e), ["/content-encoding"], "{coding}");
                assert!(
                    e.errors[0].message.contains(coding)
                        && e.errors[0].message.contains("send the body uncompressed"),
                    "{e}"
                );
            }
        }
        let body = minimal().to_string();
        for coding in ["identity", "Identity", " IDENTITY ", ""] {
            let h = with_coding(ct(STRUCTURED_CONTENT_TYPE), coding);
            assert_eq!(
                parse(&h, body.as_bytes()).unwrap().0,
                Mode::Structured,
                "{coding:?}"
            );
        }
        // A second header with another coding is a coding too.
        let h = with_coding(with_coding(ct(STRUCTURED_CONTENT_TYPE), "identity"), "gzip");
        assert_eq!(
            parse(&h, body.as_bytes()).unwrap_err().status,
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        );
    }

    /// JSON is read as UTF-8: a JSON content type naming another charset is 415 (before, a
    /// misleading 400, or a 202 storing other text than was sent). (A charset on a non-JSON
    /// binary body is the data's own: see the test of text in another charset.)
    #[test]
    fn a_json_content_type_naming_another_charset_is_415() {
        let body = minimal().to_string();
        let mut binary = binary_headers();
        binary.push(("content-type", "application/json; charset=latin1"));
        for h in [
            ct("application/cloudevents+json; charset=utf-16"),
            ct("application/cloudevents-batch+json;charset=ISO-8859-1"),
            ct("application/json; charset=\"windows-1252\""),
            headers(&binary),
        ] {
            let e = parse(&h, body.as_bytes()).unwrap_err();
            assert_eq!(e.status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{h:?}");
            assert_eq!(pointers(&e), ["/content-type"], "{h:?}");
            assert!(
                e.errors[0].message.contains("only UTF-8 is accepted"),
                "{e}"
            );
        }
        for charset in ["utf-8", "UTF-8", "utf8", "\"utf-8\""] {
            let h = ct(&format!("application/cloudevents+json; charset={charset}"));
            assert_eq!(
                parse(&h, body.as_bytes()).unwrap().0,
                Mode::Structured,
                "{charset}"
            );
        }
    }

    // ---- request-level limits ----

    #[test]
    fn body_over_limit_is_413() {
        let limits = Limits {
            max_body_bytes: 10,
            ..Limits::default()
        };
        let body = minimal().to_string();
        let e = parse_request(&ct(STRUCTURED_CONTENT_TYPE), body.as_bytes(), &limits).unwrap_err();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(pointers(&e), [""]);
    }

    #[test]
    fn body_at_limit_is_accepted() {
        let body = minimal().to_string();
        let limits = Limits {
            max_body_bytes: body.len(),
            ..Limits::default()
        };
        assert!(parse_request(&ct(STRUCTURED_CONTENT_TYPE), body.as_bytes(), &limits).is_ok());
    }

    #[test]
    fn too_deep_is_400_at_root_naming_the_limit() {
        let limits = Limits {
            max_json_depth: 3,
            ..Limits::default()
        };
        let body = with(json!({"data": {"a": {"b": 1}}})).to_string(); // depth 3: ok
        assert!(parse_request(&ct(STRUCTURED_CONTENT_TYPE), body.as_bytes(), &limits).is_ok());
        let body = with(json!({"data": {"a": {"b": [1]}}})).to_string(); // depth 4
        let e = parse_request(&ct(STRUCTURED_CONTENT_TYPE), body.as_bytes(), &limits).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(pointers(&e), [""]);
        assert!(e.errors[0].message.contains("limit of 3"), "{e}");
    }

    #[test]
    fn the_largest_depth_the_config_allows_parses_in_every_mode() {
        // serde_json refuses its 128th level itself: the config caps the limit below it, so a
        // body within the limit never meets the parser's own "recursion limit exceeded".
        let max = crate::config::MAX_JSON_DEPTH;
        let limits = Limits {
            max_json_depth: max,
            ..Limits::default()
        };
        let nested =
            |levels: usize| -> String { format!("{}1{}", "[".repeat(levels), "]".repeat(levels)) };
        let ev = |levels: usize| {
            format!(
                r#"{{"specversion":"1.0","id":"1","source":"/s","type":"t","data":{}}}"#,
                nested(levels)
            )
        };
        let body = ev(max - 1);
        assert!(parse_request(&ct(STRUCTURED_CONTENT_TYPE), body.as_bytes(), &limits).is_ok());
        let body = format!("[{}]", ev(max - 2));
        assert!(parse_request(&ct(BATCH_CONTENT_TYPE), body.as_bytes(), &limits).is_ok());
        let mut pairs = binary_headers();
        pairs.push(("content-type", "application/json"));
        let body = nested(max);
        assert!(parse_request(&headers(&pairs), body.as_bytes(), &limits).is_ok());
        let body = ev(max);
        let e = parse_request(&ct(STRUCTURED_CONTENT_TYPE), body.as_bytes(), &limits).unwrap_err();
        assert!(e.errors[0].message.contains("max_json_depth"), "{e}");
    }

    #[test]
    fn deep_nesting_bomb_is_rejected_by_default() {
        let body = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        let e = parse(&ct(BATCH_CONTENT_TYPE), body.as_bytes()).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.errors[0].message.contains("64"));
    }

    #[test]
    fn malformed_json_is_400_with_line_and_column() {
        let e = parse(&ct(STRUCTURED_CONTENT_TYPE), b"{\n  \"id\": ,\n}").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(pointers(&e), [""]);
        assert!(e.errors[0].message.contains("line 2 column"), "{e}");
    }

    #[test]
    fn depth_scan_ignores_brackets_in_strings_and_escapes() {
        assert!(!json_depth_exceeds(br#"{"a":"[[[[[[\"[[[["}"#, 1));
        assert!(json_depth_exceeds(br#"{"a":"\\",  "b":[1]}"#, 1));
        assert!(!json_depth_exceeds(b"12", 0));
        assert!(json_depth_exceeds(b"[]", 0));
        assert!(!json_depth_exceeds(b"[][][]", 1));
    }

    // ---- envelope rules (structured) ----

    #[test]
    fn specversion_must_be_1_0() {
        let e = structured_err(with(json!({"specversion": "0.3"})));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(pointers(&e), ["/specversion"]);
        let e = structured_err(with(json!({"specversion": 1.0})));
        assert_eq!(pointers(&e), ["/specversion"]);
    }

    #[test]
    fn missing_required_attributes_all_reported() {
        let e = structured_err(json!({"data": 1}));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let mut p = pointers(&e);
        p.sort_unstable();
        assert_eq!(p, ["/id", "/source", "/specversion", "/type"]);
    }

    #[test]
    fn required_attributes_must_be_non_empty_strings() {
        let e = structured_err(with(json!({"id": "", "source": 5, "type": null})));
        let mut p = pointers(&e);
        p.sort_unstable();
        assert_eq!(p, ["/id", "/source", "/type"]);
    }

    #[test]
    fn optional_string_attributes() {
        let e = structured_err(with(
            json!({"subject": 1, "datacontenttype": [], "dataschema": {}}),
        ));
        let mut p = pointers(&e);
        p.sort_unstable();
        assert_eq!(p, ["/datacontenttype", "/dataschema", "/subject"]);
        let ok = with(
            json!({"subject": "s", "datacontenttype": "application/json", "dataschema": "http://x", "time": null}),
        );
        let ev = event_from_json(ok, "").unwrap();
        assert_eq!(ev.subject.as_deref(), Some("s"));
        assert_eq!(ev.time, None);
    }

    #[test]
    fn time_must_be_rfc3339() {
        let e = structured_err(with(json!({"time": "yesterday"})));
        assert_eq!(pointers(&e), ["/time"]);
        let e = structured_err(with(json!({"time": "2024-05-01 12:00:00"})));
        assert_eq!(pointers(&e), ["/time"]);
        let e = structured_err(with(json!({"time": 1714560000})));
        assert_eq!(pointers(&e), ["/time"]);
        let ev =
            event_from_json(with(json!({"time": "2024-05-01T12:00:00.123+02:00"})), "").unwrap();
        assert_eq!(ev.time.as_deref(), Some("2024-05-01T12:00:00.123+02:00"));
    }

    #[test]
    fn data_and_data_base64_are_exclusive() {
        let e = structured_err(with(json!({"data": 1, "data_base64": "AA=="})));
        assert_eq!(pointers(&e), ["/data_base64"]);
    }

    #[test]
    fn data_base64_must_be_valid() {
        let e = structured_err(with(json!({"data_base64": "not base64!"})));
        assert_eq!(pointers(&e), ["/data_base64"]);
        let e = structured_err(with(json!({"data_base64": 7})));
        assert_eq!(pointers(&e), ["/data_base64"]);
        let ev = event_from_json(with(json!({"data_base64": "aGk="})), "").unwrap();
        assert_eq!(ev.data_base64.as_deref(), Some("aGk="));
        assert!(event_from_json(with(json!({"data_base64": "aGk"})), "").is_ok());
    }

    #[test]
    fn null_data_is_absent() {
        let ev = event_from_json(with(json!({"data": null, "data_base64": "AA=="})), "").unwrap();
        assert_eq!(ev.data, None);
    }

    #[test]
    fn extension_names_follow_the_naming_rule() {
        for bad in [
            "Upper",
            "with-dash",
            "under_score",
            "a23456789b123456789c123456789d123456789e123456789f123456789g12345",
            "",
        ] {
            let mut v = minimal();
            v[bad] = json!("x");
            let e = structured_err(v);
            assert_eq!(pointers(&e), [format!("/{bad}").as_str()], "{bad}");
        }
        // Longer than 20 is only a SHOULD NOT in CloudEvents: accepted up to 64.
        let ev = event_from_json(
            with(json!({"abcdefghijklmnopqrstu": "x", "x1": "y",
                "a23456789b123456789c123456789d123456789e123456789f123456789g1234": 1})),
            "",
        )
        .unwrap();
        assert_eq!(ev.extensions.len(), 3);
    }

    #[test]
    fn extension_name_pointer_is_escaped() {
        let mut v = minimal();
        v["a/b~c"] = json!(1);
        let e = structured_err(v);
        assert_eq!(pointers(&e), ["/a~1b~0c"]);
    }

    #[test]
    fn extension_values_must_be_scalars_null_is_absent() {
        let e = structured_err(with(json!({"obj": {"a": 1}, "arr": [1]})));
        let mut p = pointers(&e);
        p.sort_unstable();
        assert_eq!(p, ["/arr", "/obj"]);
        // The CloudEvents Integer is 32-bit, and there is no other number type.
        let e = structured_err(with(
            json!({"f": 1.5, "big": 3_000_000_000u64, "neg": -2_147_483_649i64}),
        ));
        let mut p = pointers(&e);
        p.sort_unstable();
        assert_eq!(p, ["/big", "/f", "/neg"]);
        let ev = event_from_json(
            with(json!({"s": "x", "n": -2_147_483_648i64, "b": true, "gone": null, "partitionkey": "k"})),
            "",
        )
        .unwrap();
        assert_eq!(ev.extensions.get("n"), Some(&json!(-2_147_483_648i64)));
        assert_eq!(ev.extensions.get("b"), Some(&json!(true)));
        assert!(!ev.extensions.contains_key("gone"));
        assert_eq!(ev.partitionkey().as_deref(), Some("k"));
    }

    #[test]
    fn dataversion_must_be_positive_integer() {
        for bad in [
            json!(0),
            json!(-1),
            json!(1.5),
            json!("2.0"),
            json!(""),
            json!(true),
            json!(2_147_483_648u64),
            json!("2147483648"),
        ] {
            let e = structured_err(with(json!({"dataversion": bad})));
            assert_eq!(pointers(&e), ["/dataversion"], "{bad}");
        }
        // A number, or its canonical string form (as a relay from binary mode may send it).
        for good in [json!(3), json!("3"), json!("003")] {
            let ev = event_from_json(with(json!({"dataversion": good})), "").unwrap();
            assert_eq!(ev.dataversion(), 3);
            assert_eq!(ev.extensions["dataversion"], json!(3));
        }
        let ev = event_from_json(with(json!({"dataversion": 2_147_483_647})), "").unwrap();
        assert_eq!(ev.dataversion(), 2_147_483_647);
    }

    #[test]
    fn attribute_values_follow_the_cloudevents_type_system() {
        let bad = with(json!({
            "subject": "",
            "source": "/s\u{1}",
            "type": "t\u{85}",
            "time": "2024-05-01 12:00:00Z",
            "dataschema": "schemas/order.json",
            "datacontenttype": "json",
            "region": "eu\n",
        }));
        let e = structured_err(bad);
        let mut p = pointers(&e);
        p.sort_unstable();
        assert_eq!(
            p,
            [
                "/datacontenttype",
                "/dataschema",
                "/region",
                "/source",
                "/subject",
                "/time",
                "/type"
            ],
            "{e}"
        );
        let ev = event_from_json(
            with(json!({
                "subject": "café ☕",
                "time": "2024-05-01t12:00:00.5+02:00",
                "dataschema": "urn:example:order:v2",
                "datacontenttype": "application/vnd.example+json; charset=utf-8",
            })),
            "",
        )
        .unwrap();
        assert_eq!(ev.subject.as_deref(), Some("café ☕"));
    }

    #[test]
    fn a_single_event_takes_the_requests_trace_context() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut h = ct(STRUCTURED_CONTENT_TYPE);
        h.insert("traceparent", HeaderValue::from_static(tp));
        h.insert(
            "tracestate",
            HeaderValue::from_static("rojo=00f067aa0ba902b7"),
        );
        let (_, evs) = parse(&h, minimal().to_string().as_bytes()).unwrap();
        assert_eq!(evs[0].trace_context(), Some(tp));
        assert_eq!(evs[0].trace_state(), Some("rojo=00f067aa0ba902b7"));
        // The event's own context wins; an invalid header is ignored.
        let own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let body = with(json!({"traceparent": own})).to_string();
        let (_, evs) = parse(&h, body.as_bytes()).unwrap();
        assert_eq!(evs[0].trace_context(), Some(own));
        assert_eq!(evs[0].trace_state(), None);
        let mut bad = ct(STRUCTURED_CONTENT_TYPE);
        bad.insert("traceparent", HeaderValue::from_static("not-a-trace"));
        let (_, evs) = parse(&bad, minimal().to_string().as_bytes()).unwrap();
        assert!(!evs[0].extensions.contains_key("traceparent"));
        // Binary mode too; a batch does not.
        let mut pairs = binary_headers();
        pairs.push(("traceparent", tp));
        let (_, evs) = parse(&headers(&pairs), b"").unwrap();
        assert_eq!(evs[0].trace_context(), Some(tp));
        let mut hb = ct(BATCH_CONTENT_TYPE);
        hb.insert("traceparent", HeaderValue::from_static(tp));
        let (_, evs) = parse(&hb, json!([minimal()]).to_string().as_bytes()).unwrap();
        assert_eq!(evs[0].trace_context(), None);
    }

    #[test]
    fn hops_and_replay_from_a_producer_are_kept() {
        // Another router's webhook delivery of an event one of its handlers emitted, or of a
        // replay: the count and the marker go on.
        let (_, evs) = parse(
            &headers(&[("content-type", "application/cloudevents+json")]),
            with(json!({"hops": 2, "replay": "job-7"}))
                .to_string()
                .as_bytes(),
        )
        .unwrap();
        assert_eq!(evs[0].hops(), 2);
        assert_eq!(evs[0].extensions["replay"], json!("job-7"));
        // Binary mode's header string is the number.
        let mut pairs = binary_headers();
        pairs.push(("ce-hops", "3"));
        let (_, evs) = parse(&headers(&pairs), b"").unwrap();
        assert_eq!(evs[0].extensions["hops"], json!(3));
        assert_eq!(evs[0].hops(), 3);
        for bad in [
            json!(-1),
            json!(1.5),
            json!("x"),
            json!(true),
            json!(2_147_483_648_u64),
        ] {
            let e = structured_err(with(json!({ "hops": bad })));
            assert_eq!(pointers(&e), ["/hops"], "{bad}");
            assert!(e.errors[0].message.contains("hops"), "{e}");
        }
    }

    #[test]
    fn non_object_event() {
        let e = event_from_json(json!("x"), "/2").unwrap_err();
        assert_eq!(
            e,
            [FieldError::new(
                "/2",
                "an event must be a JSON object, got a string"
            )]
        );
    }

    #[test]
    fn batch_errors_name_every_element_index() {
        let mut bad1 = minimal();
        bad1["id"] = json!("");
        let mut bad3 = minimal();
        bad3["time"] = json!("nope");
        bad3["hops"] = json!(-2);
        let body = json!([minimal(), bad1, minimal(), bad3, 5]).to_string();
        let e = parse(&ct(BATCH_CONTENT_TYPE), body.as_bytes()).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let mut p = pointers(&e);
        p.sort_unstable();
        assert_eq!(p, ["/1/id", "/3/hops", "/3/time", "/4"]);
    }

    #[test]
    fn unknown_extensions_are_kept() {
        let ev =
            event_from_json(with(json!({"traceparent": "00-ab-cd-01", "custom": 7})), "").unwrap();
        assert_eq!(ev.traceparent(), Some("00-ab-cd-01"));
        assert_eq!(ev.extensions["custom"], json!(7));
    }

    // ---- binary mode ----

    #[test]
    fn binary_json_body() {
        let mut pairs = binary_headers();
        pairs.push(("content-type", "application/json"));
        pairs.push(("ce-dataversion", "2"));
        pairs.push(("ce-subject", "caf%C3%A9%20au%20lait"));
        pairs.push(("ce-time", "2024-05-01T12:00:00Z"));
        pairs.push(("ce-Partitionkey", "k1"));
        let (mode, evs) = parse(&headers(&pairs), br#"{"total": 5}"#).unwrap();
        assert_eq!(mode, Mode::Binary);
        let ev = &evs[0];
        assert_eq!(ev.id, "42");
        assert_eq!(ev.data, Some(Data::from(json!({"total": 5}))));
        assert_eq!(ev.datacontenttype.as_deref(), Some("application/json"));
        assert_eq!(ev.subject.as_deref(), Some("café au lait"));
        assert_eq!(ev.extensions["dataversion"], json!(2));
        assert_eq!(ev.partitionkey().as_deref(), Some("k1"));
        assert_eq!(ev.data_base64, None);
    }

    #[test]
    fn binary_wins_for_any_content_type() {
        let mut pairs = binary_headers();
        pairs.push(("content-type", "application/xml"));
        let (mode, evs) = parse(&headers(&pairs), b"<a/>").unwrap();
        assert_eq!(mode, Mode::Binary);
        assert_eq!(evs[0].data_base64.as_deref(), Some("PGEvPg=="));
        assert_eq!(evs[0].data, None);
        assert!(!evs[0].data_is_json());
    }

    #[test]
    fn binary_text_body_is_a_string_and_invalid_utf8_is_base64() {
        let mut pairs = binary_headers();
        pairs.push(("content-type", "text/plain; charset=utf-8"));
        let h = headers(&pairs);
        let (_, evs) = parse(&h, "héllo".as_bytes()).unwrap();
        assert_eq!(evs[0].data, Some(Data::from(json!("héllo"))));
        let (_, evs) = parse(&h, b"\xff\xfe").unwrap();
        assert_eq!(evs[0].data, None);
        assert_eq!(evs[0].data_base64.as_deref(), Some("//4="));
    }

    #[test]
    fn binary_text_in_another_charset_is_kept_as_bytes_not_misread_as_utf8() {
        // "cafÃ©" in Latin-1 is valid UTF-8 for "café": read as UTF-8 it would change.
        let latin1 = b"caf\xc3\xa9";
        for ct in [
            "text/plain; charset=iso-8859-1",
            "text/csv;charset=\"windows-1252\"",
        ] {
            let mut pairs = binary_headers();
            pairs.push(("content-type", ct));
            let (_, evs) = parse(&headers(&pairs), latin1).unwrap();
            assert_eq!(evs[0].data, None, "{ct}");
            assert_eq!(evs[0].data_base64.as_deref(), Some("Y2Fmw6k="), "{ct}");
            assert_eq!(evs[0].datacontenttype.as_deref(), Some(ct));
        }
        for ct in [
            "text/plain",
            "text/plain; charset=UTF-8",
            "text/plain; format=flowed; charset=\"us-ascii\"",
        ] {
            let mut pairs = binary_headers();
            pairs.push(("content-type", ct));
            let (_, evs) = parse(&headers(&pairs), b"plain").unwrap();
            assert_eq!(evs[0].data, Some(Data::from(json!("plain"))), "{ct}");
        }
    }

    #[test]
    fn binary_empty_body_has_no_data() {
        let mut pairs = binary_headers();
        pairs.push(("content-type", "application/json"));
        let (_, evs) = parse(&headers(&pairs), b"").unwrap();
        assert_eq!(evs[0].data, None);
        assert_eq!(evs[0].data_base64, None);
    }

    #[test]
    fn binary_without_content_type_is_json_when_it_parses_and_bytes_otherwise() {
        let (_, evs) = parse(&headers(&binary_headers()), b"[1,2]").unwrap();
        assert_eq!(evs[0].data, Some(Data::from(json!([1, 2]))));
        assert_eq!(evs[0].datacontenttype, None);
        assert!(evs[0].data_is_json());
        // Content-Type is optional in binary mode: a body that is not JSON is carried as is.
        let (_, evs) = parse(&headers(&binary_headers()), b"raw {bytes").unwrap();
        assert_eq!(evs[0].data, None);
        assert_eq!(evs[0].data_base64.as_deref(), Some("cmF3IHtieXRlcw=="));
    }

    #[test]
    fn binary_json_data_is_kept_as_sent() {
        let mut pairs = binary_headers();
        pairs.push(("content-type", "application/json"));
        let body =
            r#" {"big": 12345678901234567890123, "amount": 0.30000000000000000001, "x": 1.50} "#;
        let (_, evs) = parse(&headers(&pairs), body.as_bytes()).unwrap();
        assert_eq!(
            evs[0].data.as_ref().map(Data::text),
            Some(body.trim()),
            "numbers are not rounded or rewritten"
        );
    }

    #[test]
    fn binary_json_data_must_read_as_a_value() {
        // Syntactically JSON, but no number type holds it (a fuzzer's find).
        let mut pairs = binary_headers();
        pairs.push(("content-type", "application/json"));
        let e = parse(&headers(&pairs), b"[1e386]").unwrap_err();
        assert_eq!(pointers(&e), ["/data"], "{e}");
        // Untyped, it is not JSON data: it is carried as bytes.
        let (_, evs) = parse(&headers(&binary_headers()), b"[1e386]").unwrap();
        assert_eq!(evs[0].data, None);
        assert!(evs[0].data_base64.is_some());
    }

    #[test]
    fn structured_and_batch_data_must_read_as_a_value() {
        let ev = r#"{"specversion":"1.0","id":"1","source":"/s","type":"t","data":{"a":[1,{"b":-1e386}]}}"#;
        for ct in ["application/cloudevents+json", "application/json"] {
            let e = parse(&headers(&[("content-type", ct)]), ev.as_bytes()).unwrap_err();
            assert_eq!(pointers(&e), ["/data"], "{ct}: {e}");
        }
        let batch = format!(
            r#"[{},{}]"#,
            ev.replace(r#""id":"1""#, r#""id":"0""#)
                .replace("-1e386", "1e308"),
            ev
        );
        let e = parse(
            &headers(&[("content-type", "application/cloudevents-batch+json")]),
            batch.as_bytes(),
        )
        .unwrap_err();
        assert_eq!(pointers(&e), ["/1/data"], "{e}");
        // Large but representable numbers, escapes and nesting read as they did.
        let fine = r#"{"specversion":"1.0","id":"1","source":"/s","type":"t","data":{"n":1e308,"s":"a\u00e9","k\n":[[],{}],"i":-9223372036854775808,"u":18446744073709551615}}"#;
        let (_, evs) = parse(
            &headers(&[("content-type", "application/cloudevents+json")]),
            fine.as_bytes(),
        )
        .unwrap();
        assert_eq!(evs[0].data.as_ref().unwrap().value()["u"], json!(u64::MAX));
    }

    #[test]
    fn binary_repeated_required_header_is_reported_once() {
        let mut pairs = binary_headers();
        pairs.push(("ce-id", "43"));
        let e = parse(&headers(&pairs), b"").unwrap_err();
        assert_eq!(pointers(&e), ["/ce-id"], "{e}");
        assert!(e.errors[0].message.contains("once"), "{e}");
    }

    #[test]
    fn binary_malformed_json_is_400_at_data() {
        let mut pairs = binary_headers();
        pairs.push(("content-type", "application/vnd.acme+json"));
        let e = parse(&headers(&pairs), b"{oops").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(pointers(&e), ["/data"]);
        assert!(e.errors[0].message.contains("line 1 column"));
    }

    #[test]
    fn binary_too_deep_json_is_400() {
        let mut pairs = binary_headers();
        pairs.push(("content-type", "application/json"));
        let limits = Limits {
            max_json_depth: 2,
            ..Limits::default()
        };
        let e = parse_request(&headers(&pairs), b"[[[1]]]", &limits).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(pointers(&e), [""]);
    }

    #[test]
    fn binary_missing_required_headers() {
        let h = headers(&[("ce-id", "1"), ("content-type", "application/json")]);
        let e = parse(&h, b"{}").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let mut p = pointers(&e);
        p.sort_unstable();
        assert_eq!(p, ["/ce-source", "/ce-specversion", "/ce-type"]);
        assert!(
            e.errors
                .iter()
                .any(|e| e.message == "header ce-source is required")
        );
    }

    #[test]
    fn binary_header_errors_name_the_header() {
        let h = headers(&[
            ("ce-specversion", "1.0"),
            ("ce-id", ""),
            ("ce-source", "/s"),
            ("ce-type", "t"),
            ("ce-time", "noon"),
            ("ce-dataversion", "v2"),
            ("ce-hops", "-1"),
            ("ce-bad_name", "x"),
        ]);
        let e = parse(&h, b"").unwrap_err();
        let mut p = pointers(&e);
        p.sort_unstable();
        assert_eq!(
            p,
            [
                "/ce-bad_name",
                "/ce-dataversion",
                "/ce-hops",
                "/ce-id",
                "/ce-time"
            ]
        );
    }

    #[test]
    fn binary_specversion_must_be_1_0() {
        let mut pairs = binary_headers();
        pairs[0] = ("ce-specversion", "0.3");
        let e = parse(&headers(&pairs), b"").unwrap_err();
        assert_eq!(pointers(&e), ["/ce-specversion"]);
    }

    #[test]
    fn binary_dataversion_zero_or_overflow_rejected() {
        for bad in ["0", "99999999999"] {
            let mut pairs = binary_headers();
            pairs.push(("ce-dataversion", bad));
            let e = parse(&headers(&pairs), b"").unwrap_err();
            assert_eq!(pointers(&e), ["/ce-dataversion"], "{bad}");
        }
    }

    #[test]
    fn binary_rejects_data_headers_and_duplicates() {
        let mut pairs = binary_headers();
        pairs.push(("ce-datacontenttype", "application/json"));
        pairs.push(("ce-subject", "a"));
        pairs.push(("ce-subject", "b"));
        let e = parse(&headers(&pairs), b"").unwrap_err();
        let mut p = pointers(&e);
        p.sort_unstable();
        assert_eq!(p, ["/ce-datacontenttype", "/ce-subject"]);
    }

    #[test]
    fn binary_percent_decoding_and_invalid_utf8() {
        assert_eq!(
            decode_header_value(b"caf%C3%a9").unwrap(),
            "café".as_bytes()
        );
        assert_eq!(decode_header_value(b"%2525").unwrap(), b"%25");
        assert!(decode_header_value(b"100%").unwrap_err().contains("byte 3"));
        assert!(decode_header_value(b"%zz%41").is_err());
        // A quoted-string is unquoted (escapes and all) before percent-decoding.
        assert_eq!(
            decode_header_value(br#""hello \"w\" %41""#).unwrap(),
            br#"hello "w" A"#
        );
        assert_eq!(
            decode_header_value(b"\"").unwrap(),
            b"\"",
            "one quote is not quoted"
        );
        assert!(decode_header_value(br#""a"b""#).is_err());
        let mut pairs = binary_headers();
        pairs.push(("ce-subject", "%FF"));
        let e = parse(&headers(&pairs), b"").unwrap_err();
        assert_eq!(pointers(&e), ["/ce-subject"]);
    }

    #[test]
    fn structured_content_type_ignores_ce_headers() {
        let mut pairs = binary_headers();
        pairs.push(("content-type", STRUCTURED_CONTENT_TYPE));
        let mut body = minimal();
        body["id"] = json!("from-body");
        let (mode, evs) = parse(&headers(&pairs), body.to_string().as_bytes()).unwrap();
        assert_eq!(mode, Mode::Structured);
        assert_eq!(evs[0].id, "from-body");
    }

    #[test]
    fn parse_error_display() {
        let e = structured_err(with(json!({"id": ""})));
        assert_eq!(
            e.to_string(),
            "400 Bad Request: /id: attribute 'id' must not be empty"
        );
    }

    // ---- properties ----

    /// The plain definition the vectorised scan must agree with, malformed input included.
    fn bytewise_depth_exceeds(body: &[u8], max: usize) -> bool {
        let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
        for &b in body {
            if in_string {
                if escaped {
                    escaped = false;
                } else if b == b'\\' {
                    escaped = true;
                } else if b == b'"' {
                    in_string = false;
                }
                continue;
            }
            match b {
                b'"' => in_string = true,
                b'[' | b'{' => {
                    depth += 1;
                    if depth > max {
                        return true;
                    }
                }
                b']' | b'}' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
        false
    }

    fn depth(v: &Value) -> usize {
        match v {
            Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
            Value::Object(m) => 1 + m.values().map(depth).max().unwrap_or(0),
            _ => 0,
        }
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[\\[\\]{}\"\\\\a-z ]{0,8}".prop_map(Value::from),
        ];
        leaf.prop_recursive(12, 64, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::vec(("[\\[\\]{}\"\\\\a-z]{0,6}", inner), 0..4)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn depth_scan_matches_value_depth(v in arb_json(), max in 0usize..14) {
            let text = serde_json::to_vec(&v).unwrap();
            prop_assert_eq!(json_depth_exceeds(&text, max), depth(&v) > max);
            let pretty = serde_json::to_vec_pretty(&v).unwrap();
            prop_assert_eq!(json_depth_exceeds(&pretty, max), depth(&v) > max);
        }

        #[test]
        fn depth_scan_matches_a_bytewise_scan_on_any_input(
            body in prop::collection::vec(
                prop_oneof![Just(b'"'), Just(b'\\'), Just(b'['), Just(b'{'), Just(b']'),
                            Just(b'}'), Just(b'a'), any::<u8>()],
                0..256,
            ),
            max in 0usize..8,
        ) {
            prop_assert_eq!(json_depth_exceeds(&body, max), bytewise_depth_exceeds(&body, max));
        }

        #[test]
        fn random_bodies_never_panic(
            body in prop::collection::vec(any::<u8>(), 0..512),
            which in 0usize..5,
        ) {
            let h = match which {
                0 => ct(STRUCTURED_CONTENT_TYPE),
                1 => ct(BATCH_CONTENT_TYPE),
                2 => HeaderMap::new(),
                3 => headers(&binary_headers()),
                _ => ct("text/plain"),
            };
            let limits = Limits { max_json_depth: 8, max_batch: 4, ..Limits::default() };
            let _ = parse_request(&h, &body, &limits);
        }

        #[test]
        fn random_json_bodies_never_panic(v in arb_json()) {
            let body = serde_json::to_vec(&v).unwrap();
            let _ = parse(&ct("application/json"), &body);
            let _ = parse(&ct(BATCH_CONTENT_TYPE), &body);
        }
    }
}
