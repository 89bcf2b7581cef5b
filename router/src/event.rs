//! The CloudEvents 1.0 envelope: the one type that flows between ingest, contracts, rules, the
//! store and the targets.
//!
//! An event is kept in its structured JSON form (`to_json`), which is what webhooks receive and
//! what rules match against. Parsing from the three HTTP modes lives in `ingest::parse`.

use std::sync::OnceLock;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// An event's `data`: the JSON text as the producer sent it (or as the router wrote it), and
/// the parsed value, built on first use.
///
/// Most events are stored and delivered without anyone reading their data: a rule that
/// matches on `type` alone and a type without a contract never look inside. Keeping the text
/// means such an event's data is checked for syntax once at ingest, copied into the stored
/// record and into each delivery as is, and never built into a `Value` tree or written back
/// out of one. Whoever does read it (contracts, patterns on `data`, ordering keys) parses it
/// once, on first use.
///
/// A JSON object may repeat a key. Whoever reads the data sees the last occurrence (serde_json's
/// rule); the text, once read, is then written out as that value, so what a contract checked
/// or a pattern matched is what targets receive, not a first occurrence some receivers' parsers
/// would pick. Data nobody read is passed on as sent.
pub struct Data {
    raw: Box<RawValue>,
    /// The value, and whether the text repeated a key somewhere.
    parsed: OnceLock<(Value, bool)>,
}

impl Data {
    /// Data from JSON text already checked to be one valid JSON value.
    pub fn from_raw(raw: Box<RawValue>) -> Self {
        Self {
            raw,
            parsed: OnceLock::new(),
        }
    }

    /// The parsed value.
    pub fn value(&self) -> &Value {
        &self.parsed().0
    }

    fn parsed(&self) -> &(Value, bool) {
        self.parsed.get_or_init(|| {
            let repeated = std::cell::Cell::new(false);
            let mut de = serde_json::Deserializer::from_str(self.raw.get());
            // The text is valid JSON (checked when it was made), within the depth limit.
            let v = serde::de::DeserializeSeed::deserialize(Tracking(&repeated), &mut de)
                .unwrap_or(Value::Null);
            (v, repeated.get())
        })
    }

    /// The JSON text.
    pub fn text(&self) -> &str {
        self.raw.get()
    }
}

impl From<Value> for Data {
    fn from(v: Value) -> Self {
        // Writing a `Value` to text cannot fail: its map keys are strings.
        let raw = serde_json::value::to_raw_value(&v).expect("a Value always serialises");
        let parsed = OnceLock::new();
        let _ = parsed.set((v, false));
        Self { raw, parsed }
    }
}

impl Clone for Data {
    fn clone(&self) -> Self {
        Self {
            raw: self.raw.clone(),
            parsed: self.parsed.clone(),
        }
    }
}

impl PartialEq for Data {
    fn eq(&self, other: &Self) -> bool {
        self.raw.get() == other.raw.get() || self.value() == other.value()
    }
}

impl std::fmt::Debug for Data {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.raw.get())
    }
}

impl Serialize for Data {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.parsed.get() {
            Some((v, true)) => v.serialize(s),
            _ => self.raw.serialize(s),
        }
    }
}

/// Builds a `Value` as serde_json does (last occurrence of a repeated key wins), noting in
/// the cell whether any object repeated a key.
struct Tracking<'a>(&'a std::cell::Cell<bool>);

impl<'de> serde::de::DeserializeSeed<'de> for Tracking<'_> {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Tracking<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(Tracking(self.0))? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            let v = map.next_value_seed(Tracking(self.0))?;
            if out.insert(k, v).is_some() {
                self.0.set(true);
            }
        }
        Ok(Value::Object(out))
    }
}

impl<'de> Deserialize<'de> for Data {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Box::<RawValue>::deserialize(d).map(Data::from_raw)
    }
}

/// One validation problem, located by a JSON pointer into the request (or into `data`).
///
/// The same shape is used for envelope errors (400), contract errors (422 / quarantine) and
/// config/rule errors surfaced over the API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldError {
    /// JSON pointer (RFC 6901) to the offending value, e.g. `/3/time` or `/data/total`.
    pub pointer: String,
    /// Human-readable explanation.
    pub message: String,
}

/// Escapes one RFC 6901 reference token (`~` as `~0`, `/` as `~1`), for a name that becomes
/// a step of a JSON pointer.
pub fn pointer_token(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

impl FieldError {
    /// Builds an error at `pointer`.
    pub fn new(pointer: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            pointer: pointer.into(),
            message: message.into(),
        }
    }
}

/// Attribute names defined by the CloudEvents 1.0 core spec (and the JSON format's
/// `data_base64`). Everything else in the envelope is an extension.
pub const CORE_ATTRIBUTES: &[&str] = &[
    "specversion",
    "id",
    "source",
    "type",
    "subject",
    "time",
    "datacontenttype",
    "dataschema",
    "data",
    "data_base64",
];

/// A validated CloudEvent.
///
/// Invariants (established by the parser): `specversion == "1.0"`, `id`, `source`, `type` are
/// non-empty, `time` (if any) is RFC 3339, `data` and `data_base64` are not both set, and every
/// extension name is a valid CloudEvents attribute name (lower-case letters and digits).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CloudEvent {
    /// `id` attribute.
    pub id: String,
    /// `source` attribute (a URI-reference).
    pub source: String,
    /// `type` attribute.
    #[serde(rename = "type")]
    pub ty: String,
    /// `subject` attribute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// `time` attribute, as sent (already checked to be RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<String>,
    /// `datacontenttype` attribute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub datacontenttype: Option<String>,
    /// `dataschema` attribute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dataschema: Option<String>,
    /// `data`, when it is JSON (or a string for textual non-JSON payloads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Data>,
    /// `data_base64`, for binary payloads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_base64: Option<String>,
    /// Extension attributes, including the ones the router understands (`dataversion`,
    /// `partitionkey`, `traceparent`, `hops`, `replay`). Unknown ones are kept and passed on.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub extensions: Map<String, Value>,
}

/// One member of an event's structured form, borrowed: a string attribute, or a JSON value
/// (`data`, an extension).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Member<'a> {
    /// A string attribute (`id`, `source`, `type`, `time`, …).
    Str(&'a str),
    /// `data` or an extension.
    Json(&'a Value),
}

impl CloudEvent {
    /// The structured-mode JSON object (`application/cloudevents+json`).
    pub fn to_json(&self) -> Value {
        self.structured_json(None)
    }

    /// [`CloudEvent::to_json`] with the `replay` member of a replayed delivery, as
    /// [`CloudEvent::structured_bytes`] writes it.
    pub fn structured_json(&self, replay: Option<&str>) -> Value {
        // A map with string keys of strings and `Value`s always converts.
        serde_json::to_value(Structured { ev: self, replay }).unwrap_or_default()
    }

    /// The member `name` of the structured form (`to_json()[name]`), borrowed from the fields
    /// instead of built: what rule matching and ordering keys read.
    pub fn member(&self, name: &str) -> Option<Member<'_>> {
        fn s(v: &Option<String>) -> Option<Member<'_>> {
            v.as_deref().map(Member::Str)
        }
        match name {
            "specversion" => Some(Member::Str("1.0")),
            "id" => Some(Member::Str(&self.id)),
            "source" => Some(Member::Str(&self.source)),
            "type" => Some(Member::Str(&self.ty)),
            "subject" => s(&self.subject),
            "time" => s(&self.time),
            "datacontenttype" => s(&self.datacontenttype),
            "dataschema" => s(&self.dataschema),
            "data_base64" => s(&self.data_base64),
            "data" => self.data.as_ref().map(|d| Member::Json(d.value())),
            // The parser keeps core attribute names out of the extensions.
            _ => self.extensions.get(name).map(Member::Json),
        }
    }

    /// The structured-mode JSON bytes, as `serde_json::to_vec(&self.to_json())` would give
    /// them (same members, same order), written straight from the fields: a delivery does
    /// not build a `Value` tree to send it. `replay`, when set, is the `replay` member (a
    /// replay job's marker), replacing an extension of that name in place or else coming
    /// last, as `json["replay"] = …` does on `to_json()`.
    pub fn structured_bytes(&self, replay: Option<&str>) -> Vec<u8> {
        // Serialising strings and `Value`s into a Vec cannot fail.
        serde_json::to_vec(&Structured { ev: self, replay }).unwrap_or_default()
    }

    /// Contract version of `data`: the `dataversion` extension (integer, or a string of
    /// digits as binary mode delivers it), default 1. The parser rejects other forms.
    pub fn dataversion(&self) -> u32 {
        match self.extensions.get("dataversion") {
            Some(Value::Number(n)) => n.as_u64().and_then(|v| u32::try_from(v).ok()).unwrap_or(1),
            Some(Value::String(s)) => s.parse().unwrap_or(1),
            _ => 1,
        }
    }

    /// The `partitionkey` extension (ordering key), if present.
    pub fn partitionkey(&self) -> Option<String> {
        match self.extensions.get("partitionkey")? {
            Value::String(s) => Some(s.clone()),
            other => Some(other.to_string()),
        }
    }

    /// The W3C `traceparent` extension, if present.
    pub fn traceparent(&self) -> Option<&str> {
        self.extensions.get("traceparent").and_then(Value::as_str)
    }

    /// The `traceparent` to propagate to targets: only one in the W3C Trace Context format.
    /// Another value is left out, as the W3C recommendation says of a `traceparent` that does
    /// not parse; sent on, it could not even be a header (a line break) and would fail every
    /// attempt of an event a target would take.
    pub fn trace_context(&self) -> Option<&str> {
        self.traceparent().filter(|tp| is_w3c_traceparent(tp))
    }

    /// The W3C `tracestate` that goes with [`CloudEvent::trace_context`]: only beside a valid
    /// `traceparent`, and only one that can be sent as a header (printable ASCII, at most 512
    /// characters, as the W3C recommendation bounds it).
    pub fn trace_state(&self) -> Option<&str> {
        self.trace_context()?;
        self.extensions
            .get("tracestate")
            .and_then(Value::as_str)
            .filter(|ts| is_w3c_tracestate(ts))
    }

    /// Number of handler hops that produced this event (0 for producer events).
    pub fn hops(&self) -> u32 {
        self.extensions
            .get("hops")
            .and_then(Value::as_u64)
            .and_then(|v| u32::try_from(v).ok())
            .unwrap_or(0)
    }

    /// The bytes of `data` (its JSON text) and `data_base64`: what makes an event large, and
    /// what checking it against a contract or matching it costs in proportion to.
    pub fn payload_len(&self) -> usize {
        self.data.as_ref().map_or(0, |d| d.text().len())
            + self.data_base64.as_ref().map_or(0, String::len)
    }

    /// Whether `data` is JSON: no `datacontenttype`, `application/json`, or any `+json` type.
    pub fn data_is_json(&self) -> bool {
        match &self.datacontenttype {
            None => self.data_base64.is_none(),
            Some(ct) => content_type_is_json(ct),
        }
    }

    /// The ingest dedup key (`source`, `id`) encoded as one string.
    pub fn dedup_key(&self) -> String {
        dedup_key(&self.source, &self.id)
    }
}

/// The structured form, member by member: what [`CloudEvent::to_json`] builds and
/// [`CloudEvent::structured_bytes`] writes without a `Value` tree.
struct Structured<'a> {
    ev: &'a CloudEvent,
    replay: Option<&'a str>,
}

impl Serialize for Structured<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let ev = self.ev;
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("specversion", "1.0")?;
        m.serialize_entry("id", &ev.id)?;
        m.serialize_entry("source", &ev.source)?;
        m.serialize_entry("type", &ev.ty)?;
        for (k, v) in [
            ("subject", &ev.subject),
            ("time", &ev.time),
            ("datacontenttype", &ev.datacontenttype),
            ("dataschema", &ev.dataschema),
        ] {
            if let Some(v) = v {
                m.serialize_entry(k, v)?;
            }
        }
        let mut replay = self.replay;
        for (k, v) in &ev.extensions {
            match replay {
                Some(r) if k == "replay" => {
                    m.serialize_entry(k, r)?;
                    replay = None;
                }
                _ => m.serialize_entry(k, v)?,
            }
        }
        if let Some(d) = &ev.data {
            m.serialize_entry("data", d)?;
        }
        if let Some(d) = &ev.data_base64 {
            m.serialize_entry("data_base64", d)?;
        }
        if let Some(r) = replay {
            m.serialize_entry("replay", r)?;
        }
        m.end()
    }
}

/// Encodes a (`source`, `id`) pair as one store key. NUL cannot occur in a valid attribute
/// value sent as JSON text by a sane producer, and even if it did the length prefix keeps the
/// encoding injective.
pub fn dedup_key(source: &str, id: &str) -> String {
    format!("{}:{source}\u{0}{id}", source.len())
}

/// True for `application/json`, `text/json` and any `*/*+json` media type (parameters ignored).
pub fn content_type_is_json(ct: &str) -> bool {
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json" || essence == "text/json" || essence.ends_with("+json")
}

/// Whether `ts` can be a W3C `tracestate` header: 1 to 512 printable ASCII characters (the
/// list syntax is the tracing system's to judge; this only keeps the header sendable).
pub(crate) fn is_w3c_tracestate(ts: &str) -> bool {
    !ts.is_empty() && ts.len() <= 512 && ts.bytes().all(|b| (b' '..=b'~').contains(&b))
}

/// Whether `tp` is a W3C Trace Context `traceparent`: `version-traceid-parentid-flags` in
/// lower-case hex (2, 32, 16 and 2 digits), the ids not all zeros, version `ff` invalid, and
/// version `00` with nothing after the flags (later versions may append `-` fields).
pub(crate) fn is_w3c_traceparent(tp: &str) -> bool {
    fn hex(s: &str) -> bool {
        s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    }
    let b = tp.as_bytes();
    if b.len() < 55 || !tp.is_char_boundary(55) {
        return false;
    }
    let (head, rest) = tp.split_at(55);
    let mut parts = head.split('-');
    let (Some(version), Some(trace), Some(parent), Some(flags), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return false;
    };
    version.len() == 2
        && trace.len() == 32
        && parent.len() == 16
        && flags.len() == 2
        && [version, trace, parent, flags].iter().all(|p| hex(p))
        && version != "ff"
        && trace.bytes().any(|c| c != b'0')
        && parent.bytes().any(|c| c != b'0')
        && if version == "00" {
            rest.is_empty()
        } else {
            // Later versions may append fields; they must still fit in a header value.
            rest.is_empty()
                || (rest.starts_with('-') && rest.bytes().all(|b| (b' '..=b'~').contains(&b)))
        }
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_w3c_traceparents_are_propagated() {
        use super::is_w3c_traceparent as ok;
        assert!(ok(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        ));
        assert!(ok(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
        ));
        assert!(ok(
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-later"
        ));
        for bad in [
            "",
            "00-ab-cd-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\n",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0é",
            "00-0af7651916cd43dd8448eb211c80319c_b7ad6b7169203331-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-\u{1}",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-é",
        ] {
            assert!(!ok(bad), "{bad:?}");
        }
    }

    use super::*;
    use serde_json::json;

    fn ev() -> CloudEvent {
        CloudEvent {
            id: "1".into(),
            source: "/s".into(),
            ty: "t".into(),
            subject: None,
            time: None,
            datacontenttype: None,
            dataschema: None,
            data: Some(Data::from(json!({"a": 1}))),
            data_base64: None,
            extensions: Map::new(),
        }
    }

    #[test]
    fn structured_json_round_trip_keeps_extensions() {
        let mut e = ev();
        e.extensions.insert("custom".into(), json!("x"));
        e.extensions.insert("dataversion".into(), json!(2));
        let j = e.to_json();
        assert_eq!(j["specversion"], "1.0");
        assert_eq!(j["custom"], "x");
        assert_eq!(e.dataversion(), 2);
    }

    #[test]
    fn structured_bytes_are_the_bytes_of_to_json() {
        let with_replay = |e: &CloudEvent, r: &str| {
            let mut j = e.to_json();
            j["replay"] = json!(r);
            serde_json::to_vec(&j).expect("json")
        };
        let mut e = ev();
        assert_eq!(
            e.structured_bytes(None),
            serde_json::to_vec(&e.to_json()).expect("json")
        );
        assert_eq!(e.structured_bytes(Some("job-1")), with_replay(&e, "job-1"));
        e.subject = Some("sub \"quoted\"".into());
        e.time = Some("2026-01-01T00:00:00Z".into());
        e.datacontenttype = Some("application/json".into());
        e.dataschema = Some("https://x/s".into());
        e.extensions.insert("partitionkey".into(), json!("k"));
        e.extensions.insert("replay".into(), json!("old"));
        e.extensions.insert("hops".into(), json!(2));
        assert_eq!(
            e.structured_bytes(None),
            serde_json::to_vec(&e.to_json()).expect("json")
        );
        // An existing `replay` member is replaced where it stands.
        assert_eq!(e.structured_bytes(Some("job-2")), with_replay(&e, "job-2"));
        assert_eq!(
            String::from_utf8(e.structured_bytes(Some("job-2"))).expect("utf-8"),
            r#"{"specversion":"1.0","id":"1","source":"/s","type":"t","subject":"sub \"quoted\"","time":"2026-01-01T00:00:00Z","datacontenttype":"application/json","dataschema":"https://x/s","partitionkey":"k","replay":"job-2","hops":2,"data":{"a":1}}"#
        );
        e.data = None;
        e.data_base64 = Some("AAEC".into());
        assert_eq!(
            e.structured_bytes(None),
            serde_json::to_vec(&e.to_json()).expect("json")
        );
    }

    #[test]
    fn members_are_the_structured_forms_members() {
        let mut e = ev();
        e.time = Some("2026-01-01T00:00:00Z".into());
        e.extensions.insert("partitionkey".into(), json!("k"));
        let j = e.to_json();
        for &name in CORE_ATTRIBUTES.iter().chain(&["partitionkey", "missing"]) {
            let m = match e.member(name) {
                None => None,
                Some(Member::Str(s)) => Some(json!(s)),
                Some(Member::Json(v)) => Some(v.clone()),
            };
            assert_eq!(m.as_ref(), j.get(name), "{name}");
        }
    }

    #[test]
    fn dataversion_defaults_to_one_and_accepts_digit_strings() {
        let mut e = ev();
        assert_eq!(e.dataversion(), 1);
        e.extensions.insert("dataversion".into(), json!("3"));
        assert_eq!(e.dataversion(), 3);
    }

    #[test]
    fn json_content_types() {
        assert!(content_type_is_json("application/json; charset=utf-8"));
        assert!(content_type_is_json("application/cloudevents+json"));
        assert!(!content_type_is_json("text/plain"));
    }

    #[test]
    fn dedup_key_is_injective_on_separator() {
        assert_ne!(dedup_key("a\u{0}b", "c"), dedup_key("a", "b\u{0}c"));
    }

    fn raw(text: &str) -> Data {
        Data::from_raw(RawValue::from_string(text.to_owned()).expect("valid JSON"))
    }

    #[test]
    fn data_nobody_reads_is_stored_and_delivered_as_sent() {
        let text = r#"{"total": 1.50, "big": 12345678901234567890, "z": 1, "a": [ 1e2 ]}"#;
        let mut e = ev();
        e.data = Some(raw(text));
        let bytes = e.structured_bytes(None);
        let body = std::str::from_utf8(&bytes).expect("utf-8");
        assert!(body.ends_with(&format!(r#""data":{text}}}"#)), "{body}");
        // The stored record decodes back to the same text, without parsing it.
        let back: CloudEvent = serde_json::from_slice(&bytes).expect("decodes");
        assert_eq!(back.data.as_ref().map(Data::text), Some(text));
        assert!(back.data.as_ref().is_some_and(|d| d.parsed.get().is_none()));
        // Read, it is the value serde_json gives.
        assert_eq!(
            back.data.as_ref().map(Data::value),
            Some(&serde_json::from_str::<Value>(text).expect("json"))
        );
        assert_eq!(back, e);
    }

    #[test]
    fn data_that_repeats_a_key_is_written_as_read_once_read() {
        let text = r#"{"total": "x", "n": {"k": 1, "k": 2}, "total": 5}"#;
        let d = raw(text);
        assert_eq!(
            serde_json::to_string(&d).expect("ser"),
            text,
            "unread: as sent"
        );
        assert_eq!(d.value(), &json!({"total": 5, "n": {"k": 2}}));
        assert_eq!(
            serde_json::to_string(&d).expect("ser"),
            r#"{"total":5,"n":{"k":2}}"#,
            "read: what the reader saw"
        );
        // Without a repeated key the text stays as sent even once read.
        let plain = raw(r#"{"a": 1.50}"#);
        assert_eq!(plain.value(), &json!({"a": 1.5}));
        assert_eq!(
            serde_json::to_string(&plain).expect("ser"),
            r#"{"a": 1.50}"#
        );
    }

    #[test]
    fn data_from_a_value_reads_and_writes_that_value() {
        let d = Data::from(json!({"b": [1, "x"], "a": null}));
        assert_eq!(d.text(), r#"{"b":[1,"x"],"a":null}"#);
        assert_eq!(d.value(), &json!({"b": [1, "x"], "a": null}));
        assert_eq!(d, raw(r#"{ "b": [1, "x"], "a": null }"#));
        assert_ne!(d, raw(r#"{"b": [1, "y"], "a": null}"#));
        // Into a `Value` (what `to_json` builds) it is parsed, not nested as text.
        let mut e = ev();
        e.data = Some(raw(r#"{"n": 2}"#));
        assert_eq!(e.to_json()["data"], json!({"n": 2}));
    }
}
