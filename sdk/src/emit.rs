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
    ///
    /// The router refuses the emission (see [`Emit`]) unless `name` follows the CloudEvents
    /// rule, 1 to 64 lower-case letters `a`-`z` and digits `0`-`9`, and is neither a core
    /// attribute (`specversion`, `id`, `source`, `type`, `subject`, `time`, `datacontenttype`,
    /// `dataschema`, `data`, `data_base64`) nor `hops`; and unless `value` is a string without
    /// control characters, an integer that fits in 32 bits, or a boolean (`null` leaves the
    /// attribute out). `traceparent` and `tracestate` are replaced by the delivery's when it
    /// has them.
    ///
    /// # Panics
    ///
    /// On the host target (unit tests) only, when `name` breaks the rule above: the test fails
    /// where the router would refuse the emission. Inside a component it never panics.
    ///
    /// ```
    /// let e = router_sdk::Emit::new("t").with_extension("partitionkey", "A-17").unwrap();
    /// assert_eq!(e.extensions(), &[("partitionkey".to_owned(), "\"A-17\"".to_owned())]);
    /// ```
    ///
    /// ```should_panic
    /// // `Tenant` has an upper-case letter: the router would refuse this emission.
    /// let _ = router_sdk::Emit::new("t").with_extension("Tenant", "acme");
    /// ```
    pub fn with_extension<T: Serialize + ?Sized>(
        mut self,
        name: impl Into<String>,
        value: &T,
    ) -> Result<Self, DataError> {
        let name = name.into();
        #[cfg(not(target_arch = "wasm32"))]
        crate::native::check_extension_name(&name);
        self.extensions.push((name, serde_json::to_string(value)?));
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
