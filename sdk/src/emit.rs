//! Events a handler asks the router to emit ([`Emit`]).

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::DataError;

/// An event to emit. The router sets its `id` (derived from the delivery, so a re-run emits the
/// same ids), `source` (the handler) and `hops`, copies the delivery's `traceparent` and
/// `tracestate` (when it has them) over any the handler set, and routes it like any ingested
/// event.
///
/// # Limits and validity
///
/// One invocation may emit at most `handlers.max_emitted` events (default 100), of at most
/// `handlers.max_output_bytes` (default 1 MiB) in all, counting every field: type, subject,
/// datacontenttype, data, and extension names and values. Going over either is a
/// `handler_limit` failure, permanent: the delivery is dead-lettered at once, since the same
/// event would go over it again.
///
/// The router also refuses an emission that is not a valid event: an empty type, data that is
/// not JSON, an extension that breaks the rules of [`Emit::with_extension`]. That is a
/// permanent failure too. Neither kind commits anything: no event is emitted and the
/// invocation's key-value writes are dropped (see [`kv`](crate::kv)).
///
/// ```
/// use router_sdk::Emit;
///
/// let e = Emit::json("invoice.created", &serde_json::json!({"amount": 12}))
///     .unwrap()
///     .with_subject("order/A-17");
/// assert_eq!(e.event_type(), "invoice.created");
/// assert_eq!(e.data_json(), Some(r#"{"amount":12}"#));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Emit {
    pub(crate) event_type: String,
    pub(crate) subject: Option<String>,
    pub(crate) datacontenttype: Option<String>,
    pub(crate) data: Option<String>,
    pub(crate) extensions: Vec<(String, String)>,
}

impl Emit {
    /// An event of type `event_type` without data.
    ///
    /// ```
    /// let e = router_sdk::Emit::new("heartbeat");
    /// assert_eq!(e.data_json(), None);
    /// ```
    pub fn new(event_type: impl Into<String>) -> Self {
        Self {
            event_type: event_type.into(),
            subject: None,
            datacontenttype: None,
            data: None,
            extensions: Vec::new(),
        }
    }

    /// An event of type `event_type` whose data is `data` serialized as JSON.
    ///
    /// ```
    /// #[derive(serde::Serialize)]
    /// struct Shipped { parcel: u32 }
    /// let e = router_sdk::Emit::json("order.shipped", &Shipped { parcel: 3 }).unwrap();
    /// assert_eq!(e.data_json(), Some(r#"{"parcel":3}"#));
    /// ```
    pub fn json<T: Serialize + ?Sized>(
        event_type: impl Into<String>,
        data: &T,
    ) -> Result<Self, DataError> {
        Ok(Self::new(event_type).with_data_json(Some(serde_json::to_string(data)?)))
    }

    /// Sets the data to JSON text that is already encoded (`None` removes it). The text must be
    /// valid JSON; the router rejects the emission otherwise.
    ///
    /// ```
    /// let e = router_sdk::Emit::new("t").with_data_json(Some("[1]".to_owned()));
    /// assert_eq!(e.data_json(), Some("[1]"));
    /// ```
    pub fn with_data_json(mut self, json: Option<String>) -> Self {
        self.data = json;
        self
    }

    /// Sets the CloudEvents `subject`.
    ///
    /// ```
    /// let e = router_sdk::Emit::new("t").with_subject("order/1");
    /// assert_eq!(e.subject(), Some("order/1"));
    /// ```
    pub fn with_subject(mut self, subject: impl Into<String>) -> Self {
        self.subject = Some(subject.into());
        self
    }

    /// Sets `datacontenttype` (the router assumes `application/json` when unset).
    ///
    /// ```
    /// let e = router_sdk::Emit::new("t").with_datacontenttype("application/vnd.acme+json");
    /// assert_eq!(e.datacontenttype(), Some("application/vnd.acme+json"));
    /// ```
    pub fn with_datacontenttype(mut self, content_type: impl Into<String>) -> Self {
        self.datacontenttype = Some(content_type.into());
        self
    }

    /// Adds the extension attribute `name` with `value` (JSON-encoded), e.g. `partitionkey`.
    /// Setting a name again replaces its value (an event has one value per attribute).
    ///
    /// # Errors
    ///
    /// [`DataError::Extension`] for what the router would refuse (it would fail every delivery
    /// of the event permanently, so the SDK refuses it here, on every target, and a unit test
    /// finds it): a `name` other than 1 to 64 lower-case letters `a`-`z` and digits `0`-`9`
    /// (the CloudEvents rule), a core attribute (`specversion`, `id`, `source`, `type`,
    /// `subject`, `time`, `datacontenttype`, `dataschema`, `data`, `data_base64`) or `hops`;
    /// a `value` other than a string without control characters, an integer from −2³¹ to
    /// 2³¹−1 (CloudEvents has no other number type: send `1.5` or a larger number as a
    /// string), or a boolean; for `dataversion`, anything but a positive integer (or a string
    /// of its digits). `null` leaves the attribute out. [`DataError::Json`] when `value` does
    /// not serialize. `traceparent` and `tracestate` are replaced by the delivery's when it has
    /// them.
    ///
    /// ```
    /// let e = router_sdk::Emit::new("t").with_extension("partitionkey", "A-17").unwrap();
    /// assert_eq!(e.extensions(), &[("partitionkey".to_owned(), "\"A-17\"".to_owned())]);
    /// // Set again: replaced.
    /// let e = e.with_extension("partitionkey", "B-2").unwrap();
    /// assert_eq!(e.extensions(), &[("partitionkey".to_owned(), "\"B-2\"".to_owned())]);
    /// ```
    ///
    /// ```
    /// use router_sdk::{DataError, Emit};
    /// // `Tenant` has an upper-case letter, and 1.5 is not a CloudEvents integer.
    /// assert!(matches!(Emit::new("t").with_extension("Tenant", "acme"), Err(DataError::Extension { .. })));
    /// let err = Emit::new("t").with_extension("ratio", &1.5).unwrap_err();
    /// assert!(err.to_string().contains("send other numbers as strings"), "{err}");
    /// ```
    pub fn with_extension<T: Serialize + ?Sized>(
        mut self,
        name: impl Into<String>,
        value: &T,
    ) -> Result<Self, DataError> {
        let name = name.into();
        let value = serde_json::to_value(value)?;
        if let Some(reason) = extension_problem(&name, &value) {
            return Err(DataError::Extension { name, reason });
        }
        let json = value.to_string();
        match self.extensions.iter_mut().find(|(n, _)| *n == name) {
            Some(existing) => existing.1 = json,
            None => self.extensions.push((name, json)),
        }
        Ok(self)
    }

    /// The event type.
    ///
    /// ```
    /// assert_eq!(router_sdk::Emit::new("a.b").event_type(), "a.b");
    /// ```
    pub fn event_type(&self) -> &str {
        &self.event_type
    }

    /// The subject, if set.
    ///
    /// ```
    /// assert_eq!(router_sdk::Emit::new("t").subject(), None);
    /// ```
    pub fn subject(&self) -> Option<&str> {
        self.subject.as_deref()
    }

    /// The data content type, if set.
    ///
    /// ```
    /// assert_eq!(router_sdk::Emit::new("t").datacontenttype(), None);
    /// ```
    pub fn datacontenttype(&self) -> Option<&str> {
        self.datacontenttype.as_deref()
    }

    /// The data as JSON text, if any.
    ///
    /// ```
    /// assert_eq!(router_sdk::Emit::json("t", &true).unwrap().data_json(), Some("true"));
    /// ```
    pub fn data_json(&self) -> Option<&str> {
        self.data.as_deref()
    }

    /// Parses the data back as `T` (handy in tests).
    ///
    /// ```
    /// let e = router_sdk::Emit::json("t", &[1, 2]).unwrap();
    /// assert_eq!(e.data_as::<Vec<u8>>().unwrap(), vec![1, 2]);
    /// ```
    pub fn data_as<T: DeserializeOwned>(&self) -> Result<T, DataError> {
        let text = self.data.as_deref().ok_or(DataError::Missing)?;
        Ok(serde_json::from_str(text)?)
    }

    /// The extension attributes: name and JSON-encoded value.
    ///
    /// ```
    /// assert!(router_sdk::Emit::new("t").extensions().is_empty());
    /// ```
    pub fn extensions(&self) -> &[(String, String)] {
        &self.extensions
    }
}

/// Longest extension name the router accepts on an emitted event (CloudEvents only says names
/// SHOULD NOT pass 20 characters; the router's ingest bound is 64).
const MAX_EXTENSION_NAME_LEN: usize = 64;

/// Attributes an emitted event cannot carry as extensions: the CloudEvents core attributes,
/// which have their own fields or are the router's to set, and the router's `hops`. The same
/// list as the router's `CORE_ATTRIBUTES` (router/src/event.rs) plus `hops`, copied because the
/// guest crate cannot depend on the router.
const RESERVED_EXTENSION_NAMES: &[&str] = &[
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
    "hops",
];

/// Why the router would refuse extension `name` = `value` on an emitted event, if it would:
/// the checks of its emission and ingest parsing (`router/src/wasm/invoke.rs`
/// `emitted_to_json`, `router/src/ingest/parse.rs`), in the same order.
fn extension_problem(name: &str, value: &serde_json::Value) -> Option<String> {
    use serde_json::Value;
    let valid_name = !name.is_empty()
        && name.len() <= MAX_EXTENSION_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if !valid_name {
        return Some(format!(
            "names are 1-{MAX_EXTENSION_NAME_LEN} lower-case letters a-z and digits 0-9"
        ));
    }
    if RESERVED_EXTENSION_NAMES.contains(&name) {
        return Some("it is a core attribute or the router's `hops`".to_owned());
    }
    match value {
        // The JSON format: a null attribute is an absent one.
        Value::Null => None,
        // The router reads `dataversion` as the contract version: a positive integer (or a
        // string of its digits) that fits a CloudEvents Integer.
        _ if name == "dataversion" => {
            let version = match value {
                Value::Number(n) => n.as_u64(),
                Value::String(s) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => {
                    Some(s.parse::<u64>().unwrap_or(u64::MAX))
                }
                _ => None,
            };
            let max = u64::from(i32::MAX.unsigned_abs());
            (!version.is_some_and(|v| (1..=max).contains(&v))).then(|| {
                format!("dataversion must be a positive integer (1 to {max}), got {value}")
            })
        }
        Value::Bool(_) => None,
        Value::String(s) if s.chars().any(char::is_control) => Some(
            "the value must not contain control characters (U+0000-U+001F, U+007F-U+009F)"
                .to_owned(),
        ),
        Value::String(_) => None,
        Value::Number(n) if n.as_i64().is_some_and(|i| i32::try_from(i).is_ok()) => None,
        Value::Number(n) => Some(format!(
            "the value must be an integer from {} to {} (CloudEvents has no other number type; send other numbers as strings), got {n}",
            i32::MIN,
            i32::MAX
        )),
        Value::Array(_) | Value::Object(_) => Some(
            "the value must be a string, integer or boolean (send structured values as data)"
                .to_owned(),
        ),
    }
}
