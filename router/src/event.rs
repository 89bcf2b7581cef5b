//! The CloudEvents 1.0 envelope: the one type that flows between ingest, contracts, rules, the
//! store and the targets.
//!
//! An event is kept in its structured JSON form (`to_json`), which is what webhooks receive and
//! what rules match against. Parsing from the three HTTP modes lives in `ingest::parse`.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

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
    pub data: Option<Value>,
    /// `data_base64`, for binary payloads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_base64: Option<String>,
    /// Extension attributes, including the ones the router understands (`dataversion`,
    /// `partitionkey`, `traceparent`, `hops`, `replay`). Unknown ones are kept and passed on.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub extensions: Map<String, Value>,
}

impl CloudEvent {
    /// The structured-mode JSON object (`application/cloudevents+json`).
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("specversion".into(), Value::from("1.0"));
        m.insert("id".into(), Value::from(self.id.clone()));
        m.insert("source".into(), Value::from(self.source.clone()));
        m.insert("type".into(), Value::from(self.ty.clone()));
        let opt = |m: &mut Map<String, Value>, k: &str, v: &Option<String>| {
            if let Some(v) = v {
                m.insert(k.into(), Value::from(v.clone()));
            }
        };
        opt(&mut m, "subject", &self.subject);
        opt(&mut m, "time", &self.time);
        opt(&mut m, "datacontenttype", &self.datacontenttype);
        opt(&mut m, "dataschema", &self.dataschema);
        for (k, v) in &self.extensions {
            m.insert(k.clone(), v.clone());
        }
        if let Some(d) = &self.data {
            m.insert("data".into(), d.clone());
        }
        if let Some(d) = &self.data_base64 {
            m.insert("data_base64".into(), Value::from(d.clone()));
        }
        Value::Object(m)
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

    /// Number of handler hops that produced this event (0 for producer events).
    pub fn hops(&self) -> u32 {
        self.extensions
            .get("hops")
            .and_then(Value::as_u64)
            .and_then(|v| u32::try_from(v).ok())
            .unwrap_or(0)
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

#[cfg(test)]
mod tests {
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
            data: Some(json!({"a": 1})),
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
}
