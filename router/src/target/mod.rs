//! Targets: where a queue entry is delivered. Each kind implements `Target`; the delivery
//! worker only sees `AttemptOutcome`, which says whether a failure is permanent, retryable, and
//! whether it counts for the circuit breaker.

pub mod handler;
pub mod nats;
pub mod webhook;

use std::time::Duration;

use futures::future::BoxFuture;

/// What one attempt needs to know besides the target's own configuration.
#[derive(Debug, Clone)]
pub struct DeliveryRequest {
    /// The structured-mode CloudEvent, serialised.
    pub body: bytes::Bytes,
    /// Stable across retries of this (event, target).
    pub idempotency_key: String,
    /// The event's id (for logs and signatures).
    pub event_id: String,
    /// 1-based attempt number.
    pub attempt: u32,
    /// W3C trace context to propagate.
    pub traceparent: Option<String>,
    /// The W3C `tracestate` that goes with `traceparent`.
    pub tracestate: Option<String>,
    /// Deadline for this attempt.
    pub timeout: Duration,
    /// The event as stored (handlers receive its structured form, [`DeliveryRequest::event_json`]).
    pub event: std::sync::Arc<crate::store::StoredEvent>,
    /// The replay job, for a replayed delivery (the `replay` member of the structured event).
    pub replay: Option<String>,
    /// Rule that matched.
    pub rule: String,
    /// Target id.
    pub target: String,
    /// Handler hops of the event.
    pub hops: u32,
    /// For a batching webhook: `body` is a CloudEvents batch (a JSON array) of this many
    /// events, and the fields above about one event (`event`, `event_id`, `traceparent`,
    /// `replay`) describe its first.
    pub batch: Option<u32>,
}

impl DeliveryRequest {
    /// The structured event as JSON (with the `replay` marker of a replayed delivery): built
    /// on demand, since only handlers need it as a tree; webhooks send `body`.
    pub fn event_json(&self) -> serde_json::Value {
        self.event.event.structured_json(self.replay.as_deref())
    }
}

/// How an attempt ended, as the target saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptOutcome {
    /// The target took the event.
    Delivered {
        /// HTTP status, for webhooks.
        status: Option<u16>,
    },
    /// A transient failure (5xx, 408, 429, timeout, connection error): retry later.
    Retryable {
        /// What went wrong.
        error: String,
        /// HTTP status, if a response arrived.
        status: Option<u16>,
        /// The target asked for this wait (Retry-After).
        retry_after: Option<Duration>,
    },
    /// A permanent failure (4xx other than 408/429, 3xx): retrying cannot help.
    Permanent {
        /// What went wrong.
        error: String,
        /// HTTP status, if a response arrived.
        status: Option<u16>,
    },
    /// The target could not start the attempt now (e.g. a handler already running as many
    /// invocations as it may): the entry waits `retry_after` without spending an attempt, and
    /// nothing counts for the circuit breaker — like a message waiting out an open breaker.
    Deferred {
        /// Why.
        reason: String,
        /// When to try again.
        retry_after: Duration,
        /// Set when the router itself ran out of a resource (descriptors, memory) starting
        /// the attempt: nothing about the target, counted and logged as the router's own.
        local: Option<LocalExhaustion>,
    },
}

/// A resource of the router's own process or host that ran out under an attempt (an
/// `EMFILE` on connect): the receiver was never reached, so the attempt is not spent and its
/// breaker learns nothing. Charged to the receiver, such failures spent the attempts of
/// healthy receivers, opened their breakers and dead-lettered their events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalExhaustion {
    /// This process's open-file limit (`EMFILE`).
    OpenFiles,
    /// The host's open-file table (`ENFILE`).
    SystemFiles,
    /// Memory or socket buffers (`ENOMEM`, `ENOBUFS`, [`std::io::ErrorKind::OutOfMemory`]).
    Memory,
}

impl LocalExhaustion {
    /// The `cause` label of `router_delivery_local_exhaustion_total`.
    pub fn label(self) -> &'static str {
        match self {
            Self::OpenFiles => "open_files",
            Self::SystemFiles => "system_files",
            Self::Memory => "memory",
        }
    }

    /// Which local resource ran out, if `e` or an error in its source chain is an I/O error
    /// that says so (by its OS error number or kind, never its message).
    pub fn of_error(e: &(dyn std::error::Error + 'static)) -> Option<Self> {
        let mut cur = Some(e);
        while let Some(err) = cur {
            if let Some(io) = err.downcast_ref::<std::io::Error>()
                && let Some(x) = Self::of_io(io)
            {
                return Some(x);
            }
            cur = err.source();
        }
        None
    }

    /// Which local resource `e` says ran out, if any.
    pub fn of_io(e: &std::io::Error) -> Option<Self> {
        if e.kind() == std::io::ErrorKind::OutOfMemory {
            return Some(Self::Memory);
        }
        #[cfg(unix)]
        {
            use rustix::io::Errno;
            let code = e.raw_os_error()?;
            if code == Errno::MFILE.raw_os_error() {
                return Some(Self::OpenFiles);
            }
            if code == Errno::NFILE.raw_os_error() {
                return Some(Self::SystemFiles);
            }
            if code == Errno::NOMEM.raw_os_error() || code == Errno::NOBUFS.raw_os_error() {
                return Some(Self::Memory);
            }
        }
        None
    }
}

impl AttemptOutcome {
    /// Whether the failure says something about the target's health. Permanent failures are
    /// about the event, not the target, and never count against the circuit breaker.
    pub fn counts_for_breaker(&self) -> bool {
        matches!(self, Self::Retryable { .. })
    }

    /// HTTP status, if any.
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Delivered { status }
            | Self::Retryable { status, .. }
            | Self::Permanent { status, .. } => *status,
            Self::Deferred { .. } => None,
        }
    }

    /// Error text, if the attempt failed.
    pub fn error(&self) -> Option<&str> {
        match self {
            Self::Delivered { .. } => None,
            Self::Retryable { error, .. } | Self::Permanent { error, .. } => Some(error),
            Self::Deferred { reason, .. } => Some(reason),
        }
    }
}

/// A delivery destination.
pub trait Target: Send + Sync + 'static {
    /// Makes one attempt. Never panics on target behaviour; every failure is an outcome.
    fn deliver<'a>(&'a self, req: &'a DeliveryRequest) -> BoxFuture<'a, AttemptOutcome>;

    /// Makes one attempt and returns what must be committed with its result (handlers'
    /// emitted events and key-value writes). Targets without effects use the default.
    fn deliver_with_effects<'a>(
        &'a self,
        req: &'a DeliveryRequest,
    ) -> BoxFuture<'a, (AttemptOutcome, Option<Box<handler::Effects>>)> {
        Box::pin(async move { (self.deliver(req).await, None) })
    }
}
