//! What a handler says about itself at upload ([`Descriptor`], [`Accept`]).

/// A handler's name, version and the event types it accepts.
///
/// ```
/// use router_sdk::Descriptor;
///
/// let d = Descriptor::new("invoicing", "1.4.0")
///     .accepts("order.paid", &[1, 2])
///     .accepts("order.refunded", &[]);
/// assert_eq!(d.accepts.len(), 2);
/// assert!(d.accepts[1].versions.is_empty()); // every version
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    /// Must equal the name the handler is uploaded under, or the upload is refused. A handler
    /// name is 1 to 64 characters of `a`-`z`, `0`-`9`, `_` and `-`, starting with a letter or
    /// digit: no capitals, dots or spaces (`billing-v2`, not `Billing` or `billing.v2`). The
    /// router refuses any other name at upload, and `router handlers push` before sending.
    pub name: String,
    /// The handler's own version (free text, semver recommended).
    pub version: String,
    /// Accepted event types and contract versions. Empty: every type and version is accepted.
    /// Otherwise a delivery of a type or `dataversion` not listed is dead-lettered as
    /// `not_accepted` without running the handler.
    pub accepts: Vec<Accept>,
}

impl Descriptor {
    /// A descriptor with no accepted types listed, which the router takes as accepting every
    /// event type and version; narrow it with [`Descriptor::accepts`].
    ///
    /// ```
    /// let d = router_sdk::Descriptor::new("noop", "0.1.0");
    /// assert!(d.accepts.is_empty()); // accepts everything
    /// ```
    pub fn new(name: impl Into<String>, version: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            version: version.into(),
            accepts: Vec::new(),
        }
    }

    /// Adds an accepted event type with its `dataversion`s (empty: every version). From the
    /// first call on, only the types listed are accepted.
    ///
    /// ```
    /// let d = router_sdk::Descriptor::new("n", "1").accepts("order.created", &[2]);
    /// assert_eq!(d.accepts[0].event_type, "order.created");
    /// ```
    pub fn accepts(mut self, event_type: impl Into<String>, versions: &[u32]) -> Self {
        self.accepts.push(Accept {
            event_type: event_type.into(),
            versions: versions.to_vec(),
        });
        self
    }
}

/// One accepted event type.
///
/// ```
/// let a = router_sdk::Accept { event_type: "order.paid".into(), versions: vec![] };
/// assert!(a.versions.is_empty());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accept {
    /// The CloudEvents `type`.
    pub event_type: String,
    /// Accepted `dataversion`s; empty means every version.
    pub versions: Vec<u32>,
}
