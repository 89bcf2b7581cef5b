//! The CloudEvent a handler receives ([`Event`]) and facts about the attempt ([`Delivery`]).

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::DataError;

/// A CloudEvent delivered to a handler.
///
/// JSON data (no `datacontenttype`, or `application/json`, `text/json`, `*+json`) arrives as
/// text in [`Event::data`]; [`Event::data_as`] parses it into any `serde` type. Other data
/// arrives base64-encoded in [`Event::data_base64`]: binary data as the producer sent it, and
/// text of another type (e.g. `text/plain`) as the base64 of its UTF-8 bytes.
///
/// ```
/// use router_sdk::Event;
///
/// #[derive(serde::Deserialize)]
/// struct Paid {
///     order_id: String,
/// }
///
/// let event = Event::new("e-1", "/shop", "order.paid")
///     .with_data(&serde_json::json!({"order_id": "A-17"}))
///     .unwrap();
/// let paid: Paid = event.data_as().unwrap();
/// assert_eq!(paid.order_id, "A-17");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The producer's event id (unique per `source`).
    pub id: String,
    /// The producer (a URI reference).
    pub source: String,
    /// The CloudEvents `type`, e.g. `order.paid`.
    pub event_type: String,
    /// The CloudEvents `subject`, if any.
    pub subject: Option<String>,
    /// RFC 3339 time set by the producer, if any.
    pub time: Option<String>,
    /// Media type of the data, if given.
    pub datacontenttype: Option<String>,
    /// Contract version of the data (the `dataversion` extension; 1 when absent).
    pub dataversion: u32,
    /// The data as JSON text, when it is JSON.
    pub data: Option<String>,
    /// The data base64-encoded, when it is not JSON (binary, or text such as `text/plain`).
    pub data_base64: Option<String>,
    /// Every other attribute, name and JSON-encoded value: the extensions (e.g.
    /// `partitionkey`, `traceparent`) and `dataschema`, the one core attribute without a field
    /// of its own.
    pub extensions: Vec<(String, String)>,
    /// How many handlers this event already went through.
    pub hops: u32,
}

impl Event {
    /// An event with the required attributes and nothing else (`dataversion` 1). Mostly for tests.
    ///
    /// ```
    /// let e = router_sdk::Event::new("1", "/s", "t");
    /// assert_eq!((e.dataversion, e.data), (1, None));
    /// ```
    pub fn new(
        id: impl Into<String>,
        source: impl Into<String>,
        event_type: impl Into<String>,
    ) -> Self {
        Self {
            id: id.into(),
            source: source.into(),
            event_type: event_type.into(),
            subject: None,
            time: None,
            datacontenttype: None,
            dataversion: 1,
            data: None,
            data_base64: None,
            extensions: Vec::new(),
            hops: 0,
        }
    }

    /// Sets the JSON data (serializing `data`) and `datacontenttype: application/json`.
    ///
    /// ```
    /// let e = router_sdk::Event::new("1", "/s", "t").with_data(&[1, 2]).unwrap();
    /// assert_eq!(e.data.as_deref(), Some("[1,2]"));
    /// ```
    pub fn with_data<T: Serialize + ?Sized>(mut self, data: &T) -> Result<Self, DataError> {
        self.data = Some(serde_json::to_string(data)?);
        self.datacontenttype = Some("application/json".to_owned());
        Ok(self)
    }

    /// Parses the JSON data as `T`.
    ///
    /// ```
    /// let e = router_sdk::Event::new("1", "/s", "t").with_data(&7).unwrap();
    /// assert_eq!(e.data_as::<u64>().unwrap(), 7);
    /// assert!(e.data_as::<String>().is_err());
    /// ```
    pub fn data_as<T: DeserializeOwned>(&self) -> Result<T, DataError> {
        let text = self.data.as_deref().ok_or(DataError::Missing)?;
        Ok(serde_json::from_str(text)?)
    }

    /// The JSON data as a `serde_json::Value` (`Value::Null` when there is none).
    ///
    /// ```
    /// let e = router_sdk::Event::new("1", "/s", "t");
    /// assert!(e.data_value().unwrap().is_null());
    /// ```
    pub fn data_value(&self) -> Result<serde_json::Value, DataError> {
        match self.data.as_deref() {
            Some(text) => Ok(serde_json::from_str(text)?),
            None => Ok(serde_json::Value::Null),
        }
    }

    /// The extension attribute `name`, decoded from its JSON encoding.
    ///
    /// ```
    /// let mut e = router_sdk::Event::new("1", "/s", "t");
    /// e.extensions.push(("partitionkey".into(), "\"k1\"".into()));
    /// assert_eq!(e.extension("partitionkey"), Some(serde_json::json!("k1")));
    /// assert_eq!(e.extension("missing"), None);
    /// ```
    pub fn extension(&self, name: &str) -> Option<serde_json::Value> {
        self.extensions
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| serde_json::from_str(v).ok())
    }
}

/// Facts about one delivery attempt.
///
/// ```
/// let d = router_sdk::Delivery { attempt: 2, ..Default::default() };
/// assert!(d.is_retry());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Delivery {
    /// 1 for the first attempt, 2 for the first retry, and so on.
    pub attempt: u32,
    /// Stable across every attempt of this delivery: a good key for idempotency records.
    pub idempotency_key: String,
    /// The rule that routed the event here.
    pub rule: String,
    /// The id of the target this delivery belongs to.
    pub target: String,
}

impl Delivery {
    /// Whether an earlier attempt of this delivery already ran (and failed or timed out).
    ///
    /// ```
    /// assert!(!router_sdk::Delivery { attempt: 1, ..Default::default() }.is_retry());
    /// ```
    pub fn is_retry(&self) -> bool {
        self.attempt > 1
    }
}
