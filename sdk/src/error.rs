//! Errors a handler returns ([`HandlerError`]) and meets while reading data ([`DataError`]).

use std::fmt;
use std::time::Duration;

/// Why [`Handler::handle`](crate::Handler::handle) did not succeed: retry later, or fail for good.
///
/// `?` turns a [`DataError`] or a `serde_json::Error` into [`HandlerError::Fail`]: data that does
/// not parse will not parse on the next attempt either.
///
/// Returning either variant is a result the handler chose, so the router commits the
/// invocation's [`kv`](crate::kv) writes with it, as it does with `Ok`. A mark of work done
/// written before a `Fail` therefore survives the dead letter: after a redrive the handler
/// finds the work marked done. Only when the sandbox stops the invocation (a trap or panic,
/// the timeout, the memory cap, a breached limit) or its emissions are refused are the writes
/// dropped.
///
/// ```
/// use router_sdk::HandlerError;
/// use std::time::Duration;
///
/// let busy = HandlerError::retry_after(Duration::from_millis(500), "ledger busy");
/// assert!(busy.is_retry());
/// let bad = HandlerError::fail("unknown currency");
/// assert_eq!(bad.to_string(), "unknown currency");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandlerError {
    /// A transient failure: the router retries under the target's policy, no sooner than
    /// `delay` when one is given. Each retry is an attempt: once the policy's `max_attempts`
    /// are spent the delivery is dead-lettered as `retries_exhausted`.
    Retry {
        /// Earliest time before the next attempt. The router waits at least the policy's
        /// backoff and at most the target policy's `retry_after_max` (default 1 h): a longer
        /// delay is cut to it. When the next attempt would fall past the policy's `max_age`
        /// (counted from when the router accepted the event), the delivery is dead-lettered at
        /// once as `max_age_exceeded` instead.
        delay: Option<Duration>,
        /// What went wrong, for the attempt log.
        message: String,
    },
    /// A permanent failure: the delivery goes to the dead-letter queue without further attempts
    /// (the invocation's key-value writes are committed all the same).
    Fail(String),
}

impl HandlerError {
    /// A transient failure; the router picks the delay.
    ///
    /// ```
    /// let e = router_sdk::HandlerError::retry("upstream timed out");
    /// assert!(e.is_retry());
    /// ```
    pub fn retry(message: impl Into<String>) -> Self {
        Self::Retry {
            delay: None,
            message: message.into(),
        }
    }

    /// A transient failure that should not be retried before `delay`.
    ///
    /// `delay` is capped at the target policy's `retry_after_max` (default 1 h), and a retry
    /// that would come after the policy's `max_age` dead-letters the delivery at once as
    /// `max_age_exceeded` (see [`HandlerError::Retry`]). A handler that must wait longer asks
    /// again at the next attempt (spending one of the policy's `max_attempts` each time), or
    /// its target's policy raises `retry_after_max`.
    ///
    /// ```
    /// use std::time::Duration;
    /// let e = router_sdk::HandlerError::retry_after(Duration::from_secs(1), "rate limited");
    /// assert!(matches!(e, router_sdk::HandlerError::Retry { delay: Some(_), .. }));
    /// ```
    pub fn retry_after(delay: Duration, message: impl Into<String>) -> Self {
        Self::Retry {
            delay: Some(delay),
            message: message.into(),
        }
    }

    /// A permanent failure.
    ///
    /// ```
    /// let e = router_sdk::HandlerError::fail("invalid order");
    /// assert!(!e.is_retry());
    /// ```
    pub fn fail(message: impl Into<String>) -> Self {
        Self::Fail(message.into())
    }

    /// Whether this asks for another attempt.
    ///
    /// ```
    /// assert!(router_sdk::HandlerError::retry("later").is_retry());
    /// ```
    pub fn is_retry(&self) -> bool {
        matches!(self, Self::Retry { .. })
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Retry { message, .. } | Self::Fail(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for HandlerError {}

impl From<DataError> for HandlerError {
    fn from(e: DataError) -> Self {
        Self::Fail(e.to_string())
    }
}

impl From<serde_json::Error> for HandlerError {
    fn from(e: serde_json::Error) -> Self {
        Self::Fail(format!("JSON error: {e}"))
    }
}

/// Event data (or a stored value) could not be read or written as the requested type.
///
/// ```
/// use router_sdk::{DataError, Event};
/// let event = Event::new("1", "/s", "t");
/// assert!(matches!(event.data_as::<u32>(), Err(DataError::Missing)));
/// ```
#[derive(Debug)]
pub enum DataError {
    /// The event has no JSON data (absent, or not JSON: see [`Event`](crate::Event)).
    Missing,
    /// The JSON did not match the requested type, or a value could not be serialized.
    Json(serde_json::Error),
    /// An extension attribute the router refuses on an emitted event (see
    /// [`Emit::with_extension`](crate::Emit::with_extension)).
    Extension {
        /// The attribute's name.
        name: String,
        /// Why the router refuses it.
        reason: String,
    },
}

impl fmt::Display for DataError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing => f.write_str("the event has no JSON data"),
            Self::Json(e) => write!(f, "invalid JSON data: {e}"),
            Self::Extension { name, reason } => {
                write!(f, "extension attribute {name:?} is not allowed: {reason}")
            }
        }
    }
}

impl std::error::Error for DataError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Missing | Self::Extension { .. } => None,
            Self::Json(e) => Some(e),
        }
    }
}

impl From<serde_json::Error> for DataError {
    fn from(e: serde_json::Error) -> Self {
        Self::Json(e)
    }
}
