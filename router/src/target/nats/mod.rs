//! NATS target: the last stage of delivery for `nats:` rule targets, which publishes the
//! structured CloudEvent to a subject over the router's one shared NATS connection.
//!
//! The message is what a webhook receives: payload = the structured event (`req.body`), with
//! `Content-Type: application/cloudevents+json`, `Nats-Msg-Id` and `Idempotency-Key` (both the
//! entry's idempotency key, stable across retries, so a JetStream stream drops a retry that
//! reaches it inside its duplicate window) and `traceparent` when the event has one.
//!
//! When an attempt counts as delivered is `nats.ack`:
//! - `auto`: where a stream captures the subject (JetStream's API says which, asked at most
//!   every few seconds per target), a JetStream publish: a request answered by the stream's
//!   PubAck, delivered once stored (a stream with `no_ack: true` acknowledges nothing: its
//!   subjects are published as core NATS, which it stores all the same). Where none does (or the server has no JetStream), the
//!   message is published as core NATS instead: delivered then means the server took it (a
//!   round trip after the publish shows that it did not refuse it), with no promise that
//!   anyone received it. Only a definite answer selects core:
//!   the API's "no such stream" or "JetStream not enabled", or no responders on a server whose
//!   INFO says it runs no JetStream. JetStream not answering on a server that runs it (it
//!   stops before client connections close at shutdown) and a publish to a found stream that
//!   nobody answers are retryable failures, so no event is recorded delivered that a stream
//!   should have stored but did not.
//! - `jetstream`: the same, but no stream is a retryable failure, so entries wait in their
//!   queue until an operator creates the stream.
//! - `core`: core publish and the round trip only.
//!
//! Failures are classified by the client's error kinds: not connected, timeouts, a failed
//! flush and every JetStream error answer (stream full, storage limits, ...) are retryable and
//! count for the breaker; a message larger than the server's `max_payload` is permanent. So is
//! a publish the server refuses (its user may not publish to the subject, `refusals`): it is
//! not answered at all, and only the refusal the server sends instead tells.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::context::PublishErrorKind as JetStreamErrorKind;
use async_nats::jetstream::message::PublishMessage as JetStreamMessage;
use async_nats::{HeaderMap, HeaderValue, Subject};
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio_util::task::TaskTracker;

use super::{AttemptOutcome, DeliveryRequest, Target};
use crate::config::{NatsAck, NatsConfig};
use crate::deliver::SecretResolver;
use crate::nats_auth::{NatsAuth, NatsAuthError};

mod refusals;

use refusals::{INBOX_PREFIX, Refusal, Refusals, Watch};

/// How long the JetStream context waits for a PubAck on its own. Longer than any attempt:
/// the attempt's deadline (`req.timeout`, the policy's timeout) is what ends the wait, and
/// the context's timeout is one per connection, not per target.
const JETSTREAM_TIMEOUT: Duration = Duration::from_secs(3600);

/// Why the shared connection could not be set up (each is retried at the next attempt).
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    /// `nats.url` does not parse (the config's validation normally catches it first).
    #[error("{0}")]
    Address(String),
    /// A credential the `nats.*` keys name could not be used: the credentials file, or the
    /// variable `nats.token_env` or `nats.password_env` names is not set.
    #[error(transparent)]
    Auth(#[from] NatsAuthError),
    /// The client refused its options.
    #[error("connect: {0}")]
    Connect(#[from] async_nats::ConnectError),
    /// The delivery runtime went away while the client was being built (shutdown).
    #[error("the delivery runtime stopped: {0}")]
    Runtime(#[from] tokio::task::JoinError),
}

/// The client and its JetStream context, created together on the delivery runtime.
#[derive(Clone)]
struct Connected {
    client: async_nats::Client,
    jetstream: jetstream::Context,
}

/// The router's one NATS connection, shared by every `nats:` target. Nothing connects until
/// the first `nats:` target starts (`warm`) or attempts (`connected`), so a router without
/// such targets never talks to NATS. The client retries its initial connect and reconnects in
/// the background for as long as the router runs.
pub struct NatsConnection {
    cfg: NatsConfig,
    /// `cfg`'s authentication and TLS keys.
    auth: NatsAuth,
    secrets: SecretResolver,
    /// The delivery runtime: the client's connection task and the JetStream acker are spawned
    /// where the client is built, so it is built there.
    spawner: tokio::runtime::Handle,
    client: tokio::sync::OnceCell<Connected>,
    /// The client's last connection event (e.g. why the last connect failed), for error texts.
    last_event: Arc<Mutex<Option<String>>>,
    /// What the server refused (permission violations), reported by the event callback.
    refusals: Arc<Refusals>,
    warmed: AtomicBool,
    /// Subjects no target may publish to: the JetStream store's records (`reserve`).
    reserved: std::sync::OnceLock<String>,
}

impl NatsConnection {
    /// A connection to `cfg.url`, opened lazily on `spawner`.
    pub fn new(
        cfg: NatsConfig,
        secrets: SecretResolver,
        spawner: tokio::runtime::Handle,
    ) -> Arc<Self> {
        Arc::new(Self {
            auth: cfg.auth(),
            cfg,
            secrets,
            spawner,
            client: tokio::sync::OnceCell::new(),
            last_event: Arc::default(),
            refusals: Arc::default(),
            warmed: AtomicBool::new(false),
            reserved: std::sync::OnceLock::new(),
        })
    }

    /// Reserves the subjects under `prefix` (the JetStream store's records): a stream
    /// captures them, and an event published there would overwrite one of the store's
    /// records. Set once, at start.
    pub fn reserve(&self, prefix: &str) {
        let _ = self.reserved.set(prefix.to_string());
    }

    /// The secret `nats.token_env` or `nats.password_env` names, as it resolves now: `None`
    /// when neither is configured, `Some(None)` when the one configured is not set.
    pub fn credential_secret(&self) -> Option<Option<String>> {
        let name = self.auth.secret_var()?;
        Some((self.secrets)(name))
    }

    /// Why no `nats:` target can start: the variable `nats.token_env` or `nats.password_env`
    /// names is not set (in the environment or the secrets file). Without it every connect
    /// would fail and every attempt be spent on that; like a webhook's missing secret, the
    /// targets wait instead, and a reload after the secret is set starts them.
    pub fn missing_secret(&self) -> Option<String> {
        self.auth
            .missing_secret(&*self.secrets)
            .map(|e| e.to_string())
    }

    /// Why `subject` may not be published to, if it is under the reserved prefix.
    pub fn refuses(&self, subject: &str) -> Option<String> {
        let prefix = self.reserved.get()?;
        let inside = subject == prefix
            || subject
                .strip_prefix(prefix.as_str())
                .is_some_and(|rest| rest.starts_with('.'));
        inside.then(|| {
            format!(
                "subject {subject} is under store.jetstream.prefix {prefix:?}: the store's stream captures it, and an event published there would overwrite one of the store's records"
            )
        })
    }

    /// The configured `nats.ack`.
    pub fn ack(&self) -> NatsAck {
        self.cfg.ack
    }

    /// Starts connecting in the background (once), so the first event does not wait for the
    /// handshake. Called when a `nats:` target starts.
    pub fn warm(self: &Arc<Self>, tracker: &TaskTracker) {
        if self.warmed.swap(true, Ordering::SeqCst) {
            return;
        }
        let this = self.clone();
        // Short-lived: with retry on initial connect the client is built without waiting for
        // the server; the connecting goes on in the client's own task.
        tracker.spawn_on(
            async move {
                match this.connected().await {
                    Ok(_) => tracing::info!(url = %this.cfg.url, ack = ?this.cfg.ack, "NATS client started"),
                    Err(e) => tracing::warn!(url = %this.cfg.url, error = %e, "NATS client could not start; nats targets retry it at each attempt"),
                }
            },
            &self.spawner,
        );
    }

    fn options(&self) -> Result<async_nats::ConnectOptions, NatsError> {
        let last = self.last_event.clone();
        let refusals = self.refusals.clone();
        let url = self.cfg.url.clone();
        // The login is read now (a secret not set fails this attempt, as before) and again at
        // each reconnect: a rotated password, token or credentials file is used from then on.
        let opts = self
            .auth
            .resolve(self.secrets.clone())?
            .options()
            .name(concat!("router/", env!("CARGO_PKG_VERSION")))
            .connection_timeout(self.cfg.connect_timeout)
            // The router must start and ingest while NATS is down: the client is returned at
            // once and keeps connecting (reconnecting, later) without a limit.
            .retry_on_initial_connect()
            .max_reconnects(None)
            .event_callback(move |event| {
                let (last, refusals, url) = (last.clone(), refusals.clone(), url.clone());
                async move {
                    let text = event.to_string();
                    let previous = last
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .replace(text.clone());
                    match event {
                        async_nats::Event::Connected => {
                            refusals.connected();
                            tracing::info!(url = %url, "NATS connected")
                        }
                        // A refused publish fails its attempt (which logs it with the event
                        // id); the refusal is recorded for that attempt to find.
                        async_nats::Event::ServerError(async_nats::ServerError::Other(e)) => {
                            tracing::debug!(url = %url, event = %text, "NATS connection");
                            if let Some(refusal) = Refusal::parse(&e) {
                                refusals.record(refusal);
                            }
                        }
                        // While the server is down the client fails a connect every few
                        // seconds: one warning when that starts, not one per try (the client
                        // logs each try itself, at info).
                        async_nats::Event::Disconnected | async_nats::Event::ClientError(_)
                            if previous.as_deref() != Some(text.as_str()) =>
                        {
                            tracing::warn!(url = %url, event = %text, "NATS connection")
                        }
                        _ => tracing::debug!(url = %url, event = %text, "NATS connection"),
                    }
                }
            });
        Ok(opts)
    }

    /// The shared client, built on the first call.
    async fn connected(&self) -> Result<&Connected, NatsError> {
        self.client
            .get_or_try_init(|| async {
                let addrs = self.cfg.server_addrs().map_err(NatsError::Address)?;
                let opts = self.options()?;
                let built = self
                    .spawner
                    .spawn(async move {
                        let client = opts.connect(addrs).await?;
                        let jetstream = jetstream::ContextBuilder::new()
                            .timeout(JETSTREAM_TIMEOUT)
                            .build(client.clone());
                        Ok::<_, async_nats::ConnectError>(Connected { client, jetstream })
                    })
                    .await??;
                Ok(built)
            })
            .await
    }

    /// The connection as `/v1/status` and `router_nats_connected` show it; `None` until a
    /// `nats:` target has started the client (a router without such targets never connects).
    pub fn status(&self) -> Option<NatsStatus> {
        let conn = self.client.get()?;
        let state = conn.client.connection_state();
        let info =
            (state == async_nats::connection::State::Connected).then(|| conn.client.server_info());
        Some(NatsStatus {
            url: self.cfg.url.clone(),
            connected: info.is_some(),
            state: state.to_string(),
            server: info.as_ref().map(|i| i.server_name.clone()),
            jetstream: info.map(|i| i.jetstream),
            last_event: self
                .last_event
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        })
    }

    /// The error text of an attempt made while the client is not connected.
    fn not_connected(&self, state: &async_nats::connection::State) -> String {
        let last = self
            .last_event
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        match last {
            Some(event) => format!(
                "connection failed: not connected to NATS at {} ({state}; last: {event})",
                self.cfg.url
            ),
            None => format!(
                "connection failed: not connected to NATS at {} ({state})",
                self.cfg.url
            ),
        }
    }

    /// Waits for `op` (a publish waiting for its answer) unless the server refuses, after
    /// `watch.since`, a publish to one of `subjects` or the client's inbox subscription (no
    /// answer can come then).
    async fn unless_refused<F: std::future::Future>(
        &self,
        watch: &mut Watch,
        subjects: &[&str],
        op: F,
    ) -> Result<F::Output, Refused> {
        tokio::pin!(op);
        loop {
            if let Some(s) = subjects
                .iter()
                .find(|s| self.refusals.refused_publish(watch.since, s))
            {
                return Err(Refused::Publish((*s).to_string()));
            }
            if let Some(sub) = self.refusals.inbox_refused() {
                return Err(Refused::Inbox(sub));
            }
            tokio::select! {
                out = &mut op => return Ok(out),
                changed = watch.changed.changed() => {
                    // The sender lives as long as the connection: only `op` is left to wait for.
                    if changed.is_err() {
                        return Ok(op.await);
                    }
                }
            }
        }
    }

    /// A round trip to the server after a core publish to `subject`, so that a refusal of
    /// that publish (which the server sends before it handles anything later on the
    /// connection) has arrived when it returns: `Err` only when the round trip itself fails.
    ///
    /// async-nats' `flush` only writes the buffer out (no PING), and the client offers no
    /// PING of its own, so the round trip is a request to an inbox subject nobody subscribes
    /// to, which the server answers "no responders" (or refuses, when the user may not publish
    /// there: that refusal then follows the one of `subject`, in order, through the callback).
    async fn round_trip(
        &self,
        client: &async_nats::Client,
        watch: &mut Watch,
        subject: &str,
    ) -> Result<(), AttemptOutcome> {
        let ping = client.new_inbox();
        let request = client.send_request(ping.clone(), async_nats::Request::new().timeout(None));
        match self.unless_refused(watch, &[subject, &ping], request).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => {}
            Ok(Err(e)) => {
                return Err(retryable(format!(
                    "connection failed: confirming the publish to {subject} with the server: {e}"
                )));
            }
            // The ping refused: the callback has recorded every refusal before it.
            Err(Refused::Publish(_)) => return Ok(()),
            Err(refused) => return Err(refused.outcome()),
        }
        // The answer came through a subscription, not through the callback: a refusal the
        // server sent before it may still be on its way to the callback's task (woken
        // earlier, but not necessarily run yet). It is given a moment.
        tokio::task::yield_now().await;
        let _ = tokio::time::timeout(CALLBACK_GRACE, async {
            while !self.refusals.refused_publish(watch.since, subject) {
                if watch.changed.changed().await.is_err() {
                    return;
                }
            }
        })
        .await;
        Ok(())
    }
}

/// How long a core publish confirmed by a round trip waits, after the answer, for the event
/// callback to record a refusal the server sent before that answer. The callback's task was
/// woken before the attempt's, so this is a bound on scheduling, not on the network.
const CALLBACK_GRACE: Duration = Duration::from_millis(2);

/// Why a publish or the wait for its answer ended without an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Refused {
    /// The server refused a publish to this subject.
    Publish(String),
    /// The server refused the client's inbox subscription (this subject).
    Inbox(String),
}

impl Refused {
    /// The attempt's outcome. Permanent: retrying changes nothing until an operator changes
    /// the NATS user's permissions, and then the DLQ entry is redriven (a retryable failure
    /// would wait out the whole retry policy, count for the breaker and end in the DLQ all
    /// the same).
    fn outcome(&self) -> AttemptOutcome {
        match self {
            Self::Publish(subject) => permanent(format!(
                "permission denied: the NATS server refused the publish to {subject} \
                 (Permissions Violation: the router's NATS user may not publish there); \
                 redrive from the DLQ once it may"
            )),
            Self::Inbox(sub) => permanent(format!(
                "permission denied: the NATS server refused the router's subscription to \
                 {sub}: its NATS user needs subscribe permission on {INBOX_PREFIX}> to get \
                 JetStream's answers and confirm core publishes (the message may have been \
                 published); redrive from the DLQ once it may"
            )),
        }
    }
}

/// The shared connection's state, for `/v1/status` (`nats`) and `router_nats_connected`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NatsStatus {
    /// `nats.url`, as configured.
    pub url: String,
    /// Whether the client is connected now.
    pub connected: bool,
    /// The client's own word for its state (`connected`, `disconnected`, `pending`).
    pub state: String,
    /// The name of the server it is connected to.
    pub server: Option<String>,
    /// Whether that server runs JetStream (its INFO).
    pub jetstream: Option<bool>,
    /// The client's last connection event (why the last connect failed, ...).
    pub last_event: Option<String>,
}

/// How long an attempt waits for a connection being made before it reports "not connected":
/// `connect_timeout`, but at most half the attempt's own timeout. Waiting the whole timeout
/// made every attempt while NATS was down cost the policy's timeout and report a timeout, not
/// the unreachable server.
fn connect_wait(connect_timeout: Duration, attempt_timeout: Duration) -> Duration {
    connect_timeout.min(attempt_timeout / 2)
}

/// The client's connection state once it is connected, or after `within`.
async fn wait_connected(
    client: &async_nats::Client,
    within: Duration,
) -> async_nats::connection::State {
    use async_nats::connection::State;
    // The client offers its state, not a way to wait for it; polling only runs while it is
    // not connected, a few dozen times per attempt at most.
    const POLL: Duration = Duration::from_millis(25);
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let state = client.connection_state();
        if state == State::Connected || tokio::time::Instant::now() >= deadline {
            return state;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// How long a target trusts its last answer to "does a stream capture my subject". Bounds how
/// soon `auto` starts publishing through a stream an operator has just created; a stream that
/// goes away shows at once (the publish fails, and a failed attempt forgets the answer).
const CAPTURE_TTL: Duration = Duration::from_secs(5);

/// The subject of JetStream's API that says which stream captures a subject.
const STREAM_NAMES_API: &str = "$JS.API.STREAM.NAMES";

/// How long the stream lookup may take: a few seconds at most (JetStream answers in
/// milliseconds when it answers at all), and at most half the attempt's timeout, which leaves
/// the publish the rest.
fn lookup_wait(attempt_timeout: Duration) -> Duration {
    const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
    LOOKUP_TIMEOUT.min(attempt_timeout / 2)
}

/// The error of a stream lookup the server refused. Permanent, as any refusal (`Refused`).
/// Not core NATS instead: a stream may capture the subject, and a core publish would be
/// recorded delivered without the stream's acknowledgement, which `auto` promises.
fn lookup_refused() -> AttemptOutcome {
    permanent(format!(
        "permission denied: the NATS server refused the router's JetStream stream lookup \
         (a publish to {STREAM_NAMES_API}): nats.ack = \"auto\" and \"jetstream\" need that \
         permission, or set nats.ack = \"core\" if no stream must acknowledge; redrive from \
         the DLQ once it may"
    ))
}

/// Whether a JetStream stream captures a target's subject, as the server last said.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Capture {
    /// This stream does.
    Stream(String),
    /// This stream does, but it acknowledges nothing (`no_ack: true`): the message is
    /// published as core NATS, which the stream stores all the same.
    NoAckStream(String),
    /// No stream does.
    NoStream,
    /// The server (or the account) has no JetStream at all.
    NoJetStream,
}

/// One `nats:` target: a subject on the shared connection.
pub struct NatsTarget {
    conn: Arc<NatsConnection>,
    subject: Subject,
    ack: NatsAck,
    /// The last stream lookup and when it was made (`auto` and `jetstream`).
    capture: Mutex<Option<(tokio::time::Instant, Capture)>>,
}

fn retryable(error: String) -> AttemptOutcome {
    AttemptOutcome::Retryable {
        error,
        status: None,
        retry_after: None,
    }
}

fn permanent(error: String) -> AttemptOutcome {
    AttemptOutcome::Permanent {
        error,
        status: None,
    }
}

/// The headers of one message. A `traceparent` that is not a valid header value (a CR or LF
/// in it) is left out: tracing context is not worth failing a delivery that can never change.
fn message_headers(req: &DeliveryRequest) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("Content-Type", "application/cloudevents+json");
    // The key is hex, always a valid value; checked all the same rather than panicking.
    if let Ok(key) = req.idempotency_key.parse::<HeaderValue>() {
        h.insert(async_nats::header::NATS_MESSAGE_ID, key.clone());
        h.insert("Idempotency-Key", key);
    }
    for (name, value) in [
        ("traceparent", &req.traceparent),
        ("tracestate", &req.tracestate),
    ] {
        if let Some(v) = value {
            match v.parse::<HeaderValue>() {
                Ok(v) => h.insert(name, v),
                Err(_) => tracing::debug!("{name} is not a valid NATS header value; left out"),
            }
        }
    }
    h
}

/// The outcome of a core publish that failed before its flush.
pub fn classify_core_publish(
    kind: async_nats::client::PublishErrorKind,
    error: &str,
) -> AttemptOutcome {
    use async_nats::client::PublishErrorKind as K;
    match kind {
        // The server's limit, learned from its INFO: this event can never fit.
        K::MaxPayloadExceeded => permanent(format!("message too large for NATS: {error}")),
        // The rule loader refuses such subjects; the client is stricter still: no retry helps.
        K::InvalidSubject => permanent(format!("invalid NATS subject: {error}")),
        K::Send => retryable(format!("connection failed: {error}")),
    }
}

/// The outcome of a failed flush (the connection could not write the message out).
pub fn classify_flush(error: &str) -> AttemptOutcome {
    retryable(format!("connection failed: flush: {error}"))
}

/// The outcome of a JetStream publish that failed, for any error but "no stream" (which
/// depends on `nats.ack`).
pub fn classify_jetstream(e: &async_nats::jetstream::context::PublishError) -> AttemptOutcome {
    let error = e.to_string();
    // The stream's answer, when the server gave one.
    let code = std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>())
        .map(async_nats::jetstream::Error::error_code);
    match e.kind() {
        JetStreamErrorKind::MaxPayloadExceeded => {
            permanent(format!("message too large for NATS: {error}"))
        }
        // Over the stream's own `max_msg_size`: this event can never be stored there, and
        // retrying it burned its attempts and opened the breaker on the subject's valid events.
        JetStreamErrorKind::Other
            if code == Some(async_nats::jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM) =>
        {
            permanent(format!(
                "message too large for the stream: JetStream: {error}"
            ))
        }
        JetStreamErrorKind::TimedOut => retryable(format!("timeout: JetStream: {error}")),
        JetStreamErrorKind::BrokenPipe => {
            retryable(format!("connection failed: JetStream: {error}"))
        }
        // Error answers of the stream (stream full, storage or account limits, a cluster
        // without quorum...; not a message over its max_msg_size, above) are the operator's
        // to fix, and entries wait for that; MaxAckPending is this client's own backpressure.
        JetStreamErrorKind::StreamNotFound
        | JetStreamErrorKind::MaxAckPending
        | JetStreamErrorKind::WrongLastMessageId
        | JetStreamErrorKind::WrongLastSequence
        | JetStreamErrorKind::Other => retryable(format!("JetStream: {error}")),
    }
}

/// The error of `nats.ack = "jetstream"` when no stream takes the subject.
fn no_stream(subject: &str, capture: &Capture) -> AttemptOutcome {
    let why = match capture {
        Capture::NoJetStream => ": JetStream is not enabled on the NATS server or account",
        _ => "",
    };
    retryable(format!(
        "no JetStream stream captures subject {subject}{why} (nats.ack = \"jetstream\"); entries wait until one does"
    ))
}

/// What a failed stream lookup says about the subject. Only a definite answer means "no
/// JetStream" (and, under `auto`, core publishing): the API answered that JetStream is not
/// enabled (for the account, or at all), or its subjects have no responders on a server whose
/// INFO says it runs no JetStream. "No responders" from a server that runs JetStream means
/// JetStream is not answering for now: a server shutting down stops JetStream before it
/// closes client connections, and one starting opens them before JetStream has recovered its
/// streams. Taking that as "no JetStream" published the events of the window as core NATS,
/// recorded delivered though no stream stored them; it is a retryable failure, never cached.
fn lookup_failed(
    e: &jetstream::context::GetStreamByNameError,
    server_runs_jetstream: bool,
    subject: &str,
) -> Result<Capture, AttemptOutcome> {
    use jetstream::context::GetStreamByNameErrorKind as K;
    use jetstream::context::{RequestError, RequestErrorKind};
    // The lookup wraps what happened a few levels down (a page request's error inside the
    // lookup's): the whole chain is searched.
    let chain = || {
        std::iter::successors(Some(e as &(dyn std::error::Error + 'static)), |s| {
            s.source()
        })
    };
    let disabled = chain().any(|s| {
        s.downcast_ref::<jetstream::Error>().is_some_and(|answer| {
            [
                jetstream::ErrorCode::JETSTREAM_NOT_ENABLED,
                jetstream::ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT,
            ]
            .contains(&answer.error_code())
        })
    });
    let no_responders = chain().any(|s| {
        s.downcast_ref::<RequestError>()
            .is_some_and(|r| r.kind() == RequestErrorKind::NoResponders)
    });
    match e.kind() {
        K::NotFound => Ok(Capture::NoStream),
        K::InvalidSubject => Err(permanent(format!("invalid NATS subject {subject}: {e}"))),
        _ if disabled => Ok(Capture::NoJetStream),
        K::Request if no_responders && !server_runs_jetstream => Ok(Capture::NoJetStream),
        K::Request if no_responders => Err(retryable(format!(
            "JetStream: looking up the stream of subject {subject}: JetStream is not answering \
             (no responders; the server is restarting or JetStream is recovering)"
        ))),
        K::Request | K::JetStream(_) => Err(retryable(format!(
            "JetStream: looking up the stream of subject {subject}: {e}"
        ))),
    }
}

/// The outcome of a JetStream publish to a subject that `stream` was found to capture.
/// async-nats reports a publish nobody answered ("no responders") as `StreamNotFound`. That
/// is JetStream not answering (stopping or starting with the server) at least as often as a
/// deleted stream, so it is a retryable failure, never a reason to publish as core NATS: the
/// next attempt looks the stream up again, and only the API's own "no such stream" (or "no
/// JetStream") answer selects core publishing under `auto`.
fn classify_stream_publish(
    e: &jetstream::context::PublishError,
    stream: &str,
    subject: &str,
) -> AttemptOutcome {
    match e.kind() {
        JetStreamErrorKind::StreamNotFound => retryable(format!(
            "JetStream: no answer from stream {stream} to the publish on subject {subject} (no \
             responders: JetStream is restarting or the stream was deleted); the stream is \
             looked up again at the next attempt"
        )),
        _ => classify_jetstream(e),
    }
}

impl NatsTarget {
    /// A target publishing to `subject` under the connection's `nats.ack`.
    pub fn new(conn: Arc<NatsConnection>, subject: &str) -> Self {
        Self {
            ack: conn.ack(),
            conn,
            subject: Subject::from(subject),
            capture: Mutex::new(None),
        }
    }

    fn remembered(&self) -> Option<Capture> {
        let cached = self.capture.lock().unwrap_or_else(|p| p.into_inner());
        let (at, capture) = cached.as_ref()?;
        // Under `jetstream` a missing stream fails the attempt anyway, so it is asked again
        // each time: the first retry after an operator creates the stream delivers.
        let trusted = matches!(capture, Capture::Stream(_) | Capture::NoAckStream(_))
            || self.ack == NatsAck::Auto;
        (trusted && at.elapsed() < CAPTURE_TTL).then(|| capture.clone())
    }

    fn remember(&self, capture: Option<Capture>) {
        *self.capture.lock().unwrap_or_else(|p| p.into_inner()) =
            capture.map(|c| (tokio::time::Instant::now(), c));
    }

    /// Which stream captures the subject. A JetStream publish to a subject no stream captures
    /// is answered "no responders" only while no core subscriber listens to it: otherwise the
    /// subscriber gets the request, nobody acknowledges, and every retry would hand it another
    /// copy. So the target asks JetStream's API first, and publishes as core NATS where no
    /// stream is.
    ///
    /// The lookup is a request to `$JS.API.STREAM.NAMES`, bounded by `within`: the JetStream
    /// context's own timeout is the PubAck's (an hour), and a lookup the server refuses (a
    /// user without that permission) is never answered, so every attempt waited out its whole
    /// timeout and failed as a bare "timeout".
    async fn capture(&self, conn: &Connected, within: Duration) -> Result<Capture, AttemptOutcome> {
        if let Some(c) = self.remembered() {
            return Ok(c);
        }
        let deadline = tokio::time::Instant::now() + within;
        let mut watch = self.conn.refusals.watch();
        let lookup = conn.jetstream.stream_by_subject(self.subject.to_string());
        let answer = tokio::time::timeout_at(
            deadline,
            self.conn
                .unless_refused(&mut watch, &[STREAM_NAMES_API], lookup),
        )
        .await;
        let found = match answer {
            Ok(Ok(Ok(name))) if self.acknowledges(conn, &name, deadline).await => {
                Capture::Stream(name)
            }
            Ok(Ok(Ok(name))) => Capture::NoAckStream(name),
            Ok(Ok(Err(e))) => {
                lookup_failed(&e, conn.client.server_info().jetstream, &self.subject)?
            }
            Ok(Err(Refused::Publish(_))) => return Err(lookup_refused()),
            Ok(Err(refused)) => return Err(refused.outcome()),
            Err(_) => {
                return Err(retryable(format!(
                    "timeout: JetStream: looking up the stream of subject {} ({STREAM_NAMES_API}): \
                     no answer within {}",
                    self.subject,
                    humantime::format_duration(within)
                )));
            }
        };
        self.remember(Some(found.clone()));
        Ok(found)
    }

    /// Whether stream `name` acknowledges what it stores: not with `no_ack: true`, where a
    /// JetStream publish waited for a PubAck that never came and every attempt failed as a
    /// timeout though the stream had stored the message. Asked of JetStream's API
    /// (`$JS.API.STREAM.INFO.<name>`, by `deadline`); without an answer (no permission, no
    /// time left) the stream is taken to acknowledge, as most do.
    async fn acknowledges(
        &self,
        conn: &Connected,
        name: &str,
        deadline: tokio::time::Instant,
    ) -> bool {
        let api = format!("$JS.API.STREAM.INFO.{name}");
        let mut watch = self.conn.refusals.watch();
        let info = conn.jetstream.get_stream(name);
        let answer = tokio::time::timeout_at(
            deadline,
            self.conn.unless_refused(&mut watch, &[&api], info),
        )
        .await;
        match answer {
            Ok(Ok(Ok(stream))) => !stream.cached_info().config.no_ack,
            Ok(Err(Refused::Publish(_))) => {
                tracing::warn!(stream = name, subject = %self.subject, "the NATS server refused {api}: the router cannot tell whether the stream acknowledges (no_ack) and takes it to");
                true
            }
            other => {
                tracing::debug!(stream = name, answer = ?other.map(|a| a.map(|s| s.map(|_| ()))), "stream info unknown: taken to acknowledge");
                true
            }
        }
    }

    async fn attempt(&self, req: &DeliveryRequest) -> AttemptOutcome {
        let outcome = match tokio::time::timeout(req.timeout, self.publish(req)).await {
            Ok(outcome) => outcome,
            Err(_) => retryable(format!(
                "timeout: no answer from NATS within {}",
                humantime::format_duration(req.timeout)
            )),
        };
        if let Some(error) = outcome.error() {
            // Whatever failed (a stream deleted, JetStream restarted), the next attempt asks
            // which stream captures the subject again.
            self.remember(None);
            tracing::info!(event_id = %req.event_id, subject = %self.subject, error, "NATS publish failed");
        }
        outcome
    }

    async fn publish(&self, req: &DeliveryRequest) -> AttemptOutcome {
        let conn = match self.conn.connected().await {
            Ok(c) => c,
            Err(e) => return retryable(format!("connection failed: {e}")),
        };
        // Nothing is handed to a client that is not connected: it would queue the message
        // and send it whenever it reconnects, long after this attempt was reported failed.
        // A connection being made (the router just started, the server restarted) gets up to
        // `connect_timeout` to come up, as a webhook's connect would (bounded by the attempt's
        // timeout: see `connect_wait`).
        let within = connect_wait(self.conn.cfg.connect_timeout, req.timeout);
        let state = wait_connected(&conn.client, within).await;
        if state != async_nats::connection::State::Connected {
            return retryable(self.conn.not_connected(&state));
        }
        let headers = message_headers(req);
        if self.ack == NatsAck::Core {
            return self.publish_core(&conn.client, headers, req).await;
        }
        let capture = match self.capture(conn, lookup_wait(req.timeout)).await {
            Ok(c) => c,
            Err(outcome) => return outcome,
        };
        let stream = match (&capture, self.ack) {
            (Capture::Stream(stream), _) => stream,
            (Capture::NoAckStream(stream), _) => {
                tracing::debug!(event_id = %req.event_id, stream, "no_ack stream: published as core NATS");
                return self.publish_core(&conn.client, headers, req).await;
            }
            (_, NatsAck::JetStream) => return no_stream(&self.subject, &capture),
            _ => return self.publish_core(&conn.client, headers, req).await,
        };
        let message = JetStreamMessage::build()
            .payload(req.body.clone())
            .headers(headers);
        let acked = async {
            conn.jetstream
                .send_publish(self.subject.clone(), message)
                .await?
                .await
        };
        // A refused publish is never answered: its refusal ends the wait.
        let mut watch = self.conn.refusals.watch();
        let acked = match self
            .conn
            .unless_refused(&mut watch, &[&self.subject], acked)
            .await
        {
            Ok(acked) => acked,
            Err(refused) => return refused.outcome(),
        };
        match acked {
            // A duplicate PubAck: the stream has this message id already (an earlier
            // attempt's message got there): delivered all the same.
            Ok(ack) => {
                if ack.duplicate {
                    tracing::debug!(event_id = %req.event_id, stream = %ack.stream, "JetStream: duplicate of a stored message");
                }
                AttemptOutcome::Delivered { status: None }
            }
            Err(e) => classify_stream_publish(&e, stream, &self.subject),
        }
    }

    /// Core NATS: publish, flush, and a round trip to the server, so the attempt counts as
    /// delivered only once the server has handled the message without refusing it. A core
    /// publish is otherwise unanswered: the server's one word on it is a permission refusal,
    /// which was missed, and the event was recorded delivered though the server dropped it.
    async fn publish_core(
        &self,
        client: &async_nats::Client,
        headers: HeaderMap,
        req: &DeliveryRequest,
    ) -> AttemptOutcome {
        let mut watch = self.conn.refusals.watch();
        if let Err(e) = client
            .publish_with_headers(self.subject.clone(), headers, req.body.clone())
            .await
        {
            return classify_core_publish(e.kind(), &e.to_string());
        }
        if let Err(e) = client.flush().await {
            return classify_flush(&e.to_string());
        }
        if let Err(outcome) = self
            .conn
            .round_trip(client, &mut watch, &self.subject)
            .await
        {
            return outcome;
        }
        let refusals = &self.conn.refusals;
        if refusals.refused_publish(watch.since, &self.subject) {
            return Refused::Publish(self.subject.to_string()).outcome();
        }
        if refusals.lost_since(watch.since) {
            return retryable(format!(
                "NATS: could not confirm the publish to {}: too many refusals of the server \
                 to tell whether it was among them",
                self.subject
            ));
        }
        AttemptOutcome::Delivered { status: None }
    }
}

impl Target for NatsTarget {
    fn deliver<'a>(&'a self, req: &'a DeliveryRequest) -> BoxFuture<'a, AttemptOutcome> {
        self.attempt(req).boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_nats::client::PublishErrorKind as CoreKind;

    fn request(timeout: Duration, traceparent: Option<&str>) -> DeliveryRequest {
        let event: crate::event::CloudEvent = serde_json::from_value(serde_json::json!({
            "specversion": "1.0", "id": "e-1", "source": "/t", "type": "t"
        }))
        .expect("event");
        DeliveryRequest {
            body: bytes::Bytes::from_static(b"{\"id\":\"e-1\"}"),
            idempotency_key: "0123456789abcdef0123456789abcdef".into(),
            event_id: "e-1".into(),
            attempt: 1,
            traceparent: traceparent.map(str::to_string),
            tracestate: traceparent.map(|_| "congo=t61rcWkgMzE".to_string()),
            timeout,
            event: Arc::new(crate::store::StoredEvent {
                seq: 1,
                event,
                accepted_at: 0,
                ruleset_version: String::new(),
                matched_rules: Vec::new(),
                quarantined: false,
            }),
            replay: None,
            rule: "r".into(),
            target: "t".into(),
            hops: 0,
            batch: None,
        }
    }

    fn no_secrets() -> SecretResolver {
        Arc::new(|_| None)
    }

    /// With the JetStream store, the subjects of its records are refused to targets (the
    /// store's stream captures them: an event published there overwrote a record); subjects
    /// that merely share the prefix's text are not.
    #[tokio::test]
    async fn the_stores_subjects_are_reserved() {
        let conn = NatsConnection::new(
            NatsConfig::default(),
            no_secrets(),
            tokio::runtime::Handle::current(),
        );
        assert_eq!(
            conn.refuses("router.store.ev.1"),
            None,
            "nothing reserved yet"
        );
        conn.reserve("router.store");
        for subject in ["router.store", "router.store.ev.1"] {
            let why = conn.refuses(subject).expect(subject);
            assert!(why.contains("store.jetstream.prefix"), "{why}");
        }
        for subject in ["router.storex", "router", "orders.router.store"] {
            assert_eq!(conn.refuses(subject), None, "{subject}");
        }
    }

    #[test]
    fn headers_carry_the_idempotency_key_twice_and_the_trace() {
        let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let h = message_headers(&request(Duration::from_secs(1), Some(tp)));
        let get = |n: &str| h.get(n).map(|v| v.as_str().to_string());
        assert_eq!(
            get("Content-Type").as_deref(),
            Some("application/cloudevents+json")
        );
        assert_eq!(
            get("Nats-Msg-Id").as_deref(),
            Some("0123456789abcdef0123456789abcdef")
        );
        assert_eq!(get("Idempotency-Key"), get("Nats-Msg-Id"));
        assert_eq!(get("traceparent").as_deref(), Some(tp));
        assert_eq!(get("tracestate").as_deref(), Some("congo=t61rcWkgMzE"));
        // A traceparent that cannot be a header is left out, not a failed delivery.
        let h = message_headers(&request(Duration::from_secs(1), Some("00-a\r\nX: y")));
        assert!(h.get("traceparent").is_none());
        assert!(h.get("Nats-Msg-Id").is_some());
        let h = message_headers(&request(Duration::from_secs(1), None));
        assert!(h.get("traceparent").is_none());
    }

    #[test]
    fn only_an_oversized_message_or_a_bad_subject_is_permanent() {
        for (kind, permanent) in [
            (CoreKind::MaxPayloadExceeded, true),
            (CoreKind::InvalidSubject, true),
            (CoreKind::Send, false),
        ] {
            let o = classify_core_publish(kind, "x");
            assert_eq!(
                matches!(o, AttemptOutcome::Permanent { .. }),
                permanent,
                "{kind:?}: {o:?}"
            );
            assert_eq!(o.counts_for_breaker(), !permanent, "{kind:?}");
        }
        for (kind, permanent) in [
            (JetStreamErrorKind::MaxPayloadExceeded, true),
            (JetStreamErrorKind::TimedOut, false),
            (JetStreamErrorKind::BrokenPipe, false),
            (JetStreamErrorKind::MaxAckPending, false),
            (JetStreamErrorKind::Other, false),
            (JetStreamErrorKind::StreamNotFound, false),
        ] {
            let o = classify_jetstream(&async_nats::jetstream::context::PublishError::new(kind));
            assert_eq!(
                matches!(o, AttemptOutcome::Permanent { .. }),
                permanent,
                "{kind:?}: {o:?}"
            );
            assert_eq!(o.counts_for_breaker(), !permanent, "{kind:?}");
            assert_eq!(o.status(), None);
        }
        let o = classify_flush("flush failed");
        assert!(o.counts_for_breaker());
        assert!(
            o.error()
                .is_some_and(|e| e.starts_with("connection failed"))
        );
        let o = no_stream("orders.paid", &Capture::NoStream);
        assert!(o.counts_for_breaker());
        assert!(
            o.error()
                .is_some_and(|e| e.contains("no JetStream stream captures subject orders.paid")),
            "{o:?}"
        );
    }

    #[test]
    fn only_a_definite_answer_of_the_lookup_means_no_stream_or_no_jetstream() {
        use jetstream::context::{
            GetStreamByNameError, GetStreamByNameErrorKind, RequestError, RequestErrorKind,
        };
        // As `stream_by_subject` reports a failed page request: the lookup's Request error,
        // over the page's, over the request's own.
        let lookup = |kind| {
            GetStreamByNameError::with_source(
                GetStreamByNameErrorKind::Request,
                RequestError::with_source(RequestErrorKind::Other, RequestError::new(kind)),
            )
        };
        let answered = |json: &str| {
            let answer: jetstream::response::Response<jetstream::publish::PublishAck> =
                serde_json::from_str(json).expect("error answer");
            let jetstream::response::Response::Err { error } = answer else {
                panic!("an error answer");
            };
            GetStreamByNameError::with_source(
                GetStreamByNameErrorKind::Request,
                RequestError::with_source(RequestErrorKind::Other, error),
            )
        };
        let no_responders = lookup(RequestErrorKind::NoResponders);
        // A server whose INFO says it runs no JetStream: nothing will ever answer.
        assert_eq!(
            lookup_failed(&no_responders, false, "a.b").ok(),
            Some(Capture::NoJetStream)
        );
        // A server that runs JetStream but whose JetStream does not answer (shutting down,
        // recovering): a retryable failure, not "no JetStream".
        let o = lookup_failed(&no_responders, true, "a.b").expect_err("retryable");
        assert!(matches!(o, AttemptOutcome::Retryable { .. }), "{o:?}");
        assert!(
            o.error()
                .is_some_and(|e| e.contains("JetStream is not answering")),
            "{o:?}"
        );
        for kind in [RequestErrorKind::TimedOut, RequestErrorKind::Other] {
            let o = lookup_failed(&lookup(kind), false, "a.b").expect_err("retryable");
            assert!(o.counts_for_breaker(), "{o:?}");
        }
        assert_eq!(
            lookup_failed(
                &GetStreamByNameError::new(GetStreamByNameErrorKind::NotFound),
                true,
                "a.b"
            )
            .ok(),
            Some(Capture::NoStream)
        );
        // The account has no JetStream: the API says so (10039).
        let disabled = answered(
            r#"{"error":{"code":503,"err_code":10039,"description":"jetstream not enabled for account"}}"#,
        );
        assert_eq!(
            lookup_failed(&disabled, true, "a.b").ok(),
            Some(Capture::NoJetStream)
        );
        // Any other error answer is retried.
        let other = answered(
            r#"{"error":{"code":500,"err_code":10008,"description":"jetstream cluster not available"}}"#,
        );
        assert!(lookup_failed(&other, true, "a.b").is_err());
        let o = no_stream("a.b", &Capture::NoJetStream);
        assert!(
            o.error().is_some_and(|e| e
                .starts_with("no JetStream stream captures subject a.b: JetStream is not enabled")),
            "{o:?}"
        );
    }

    #[test]
    fn a_publish_without_responders_to_a_found_stream_is_retried() {
        let e =
            async_nats::jetstream::context::PublishError::new(JetStreamErrorKind::StreamNotFound);
        let o = classify_stream_publish(&e, "ORDERS", "orders.paid");
        assert!(matches!(o, AttemptOutcome::Retryable { .. }), "{o:?}");
        assert!(
            o.error()
                .is_some_and(|t| t.contains("no answer from stream ORDERS")),
            "{o:?}"
        );
    }

    /// The loss of the audit: a stream was found for the subject, then JetStream stopped
    /// answering (the server shutting down) while core NATS still worked. A server without
    /// JetStream stands in for that window deterministically: its JetStream API has no
    /// responders, as a stopping JetStream's has. The publish must fail (retryable) rather
    /// than go out as core NATS and be recorded delivered; only once the lookup gets a
    /// definite answer (here: the server's INFO says it runs no JetStream) does `auto` publish
    /// as core.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_found_stream_that_stops_answering_is_retried_not_published_as_core() {
        use futures::StreamExt;
        let server = crate::store::jetstream::test_server::TestServer::start_core_only();
        let cfg = NatsConfig {
            url: server.url(),
            ..NatsConfig::default()
        };
        let conn = NatsConnection::new(cfg, no_secrets(), tokio::runtime::Handle::current());
        let watcher = async_nats::connect(server.url()).await.expect("connect");
        let mut seen = watcher.subscribe("orders.paid").await.expect("subscribe");
        watcher.flush().await.expect("flush");
        let target = NatsTarget::new(conn, "orders.paid");
        target.remember(Some(Capture::Stream("ORDERS".into())));
        let o = target.attempt(&request(Duration::from_secs(5), None)).await;
        assert!(matches!(o, AttemptOutcome::Retryable { .. }), "{o:?}");
        // The JetStream publish is itself a request on the subject (with a reply subject for
        // the PubAck), which a core subscriber sees; a core publish has no reply subject.
        while let Ok(Some(msg)) =
            tokio::time::timeout(Duration::from_millis(500), seen.next()).await
        {
            assert!(msg.reply.is_some(), "published as core NATS: {msg:?}");
        }
        // The failed attempt forgot the stream; the lookup now has a definite answer.
        let o = target.attempt(&request(Duration::from_secs(5), None)).await;
        assert!(matches!(o, AttemptOutcome::Delivered { .. }), "{o:?}");
        assert_eq!(target.remembered(), Some(Capture::NoJetStream));
        let msg = tokio::time::timeout(Duration::from_secs(10), seen.next())
            .await
            .expect("the core message within 10 s")
            .expect("a message");
        assert!(msg.reply.is_none(), "a core publish: {msg:?}");
        assert_eq!(&msg.payload[..], b"{\"id\":\"e-1\"}");
    }

    /// A private server whose one user (taken by every connection, `no_auth_user`) may
    /// publish to `publish` and subscribe to `subscribe` (lists of subjects, TOML-quoted).
    fn server_allowing(
        jetstream: bool,
        publish: &str,
        subscribe: &str,
    ) -> crate::store::jetstream::test_server::TestServer {
        crate::store::jetstream::test_server::TestServer::start_configured(
            jetstream,
            &format!(
                "authorization {{\n  users = [\n    {{ user: limited, password: limitedpw, \
                 permissions: {{ publish: {{ allow: [{publish}] }}, subscribe: {{ allow: \
                 [{subscribe}] }} }} }}\n  ]\n}}\nno_auth_user: limited\n"
            ),
        )
    }

    fn target_on(url: String, ack: NatsAck, subject: &str) -> NatsTarget {
        let cfg = NatsConfig {
            url,
            ack,
            ..NatsConfig::default()
        };
        let conn = NatsConnection::new(cfg, no_secrets(), tokio::runtime::Handle::current());
        NatsTarget::new(conn, subject)
    }

    fn is_refused(o: &AttemptOutcome, subject: &str) -> bool {
        matches!(o, AttemptOutcome::Permanent { .. })
            && o.error().is_some_and(|e| {
                e.starts_with("permission denied")
                    && e.contains(&format!("refused the publish to {subject} "))
            })
    }

    /// The loss of the audit: a core publish the server refuses (its user may not publish to
    /// the subject) was recorded delivered, as the flush succeeded. It is a permanent failure
    /// naming the refusal, under `core` and under `auto` where no stream captures the subject;
    /// an allowed subject is delivered, and the subscriber gets it once. Both with a user that
    /// may publish to the inbox (the round trip is answered "no responders") and with one that
    /// may not (the round trip's own publish is refused, after the message's).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_core_publish_the_server_refuses_is_a_permanent_failure_not_delivered() {
        use futures::StreamExt;
        for (jetstream, publish) in [
            (false, r#""orders.>", "_INBOX.>""#),
            (false, r#""orders.>""#),
            (false, r#""orders.>", "$JS.API.>""#),
            (true, r#""orders.>", "$JS.API.>""#),
        ] {
            let server = server_allowing(jetstream, publish, r#""_INBOX.>", "orders.>""#);
            let watcher = async_nats::connect(server.url()).await.expect("connect");
            let mut seen = watcher.subscribe("orders.paid").await.expect("subscribe");
            watcher.flush().await.expect("flush");
            // `auto` asks JetStream's API first, which takes a user that may.
            let acks: &[NatsAck] = if publish.contains("$JS.API") {
                &[NatsAck::Core, NatsAck::Auto]
            } else {
                &[NatsAck::Core]
            };
            for &ack in acks {
                let case = format!("{ack:?}, publish allowed to {publish}");
                let denied = target_on(server.url(), ack, "denied.x");
                for _ in 0..3 {
                    let o = denied.attempt(&request(Duration::from_secs(5), None)).await;
                    assert!(is_refused(&o, "denied.x"), "{case}: {o:?}");
                    assert!(!o.counts_for_breaker());
                }
                let allowed = target_on(server.url(), ack, "orders.paid");
                let o = allowed
                    .attempt(&request(Duration::from_secs(5), None))
                    .await;
                assert!(
                    matches!(o, AttemptOutcome::Delivered { .. }),
                    "{case}: {o:?}"
                );
                let msg = tokio::time::timeout(Duration::from_secs(10), seen.next())
                    .await
                    .expect("the message within 10 s")
                    .expect("a message");
                assert_eq!(&msg.payload[..], b"{\"id\":\"e-1\"}", "{case}");
                // The refused one again, after an allowed one on the same connection.
                let o = denied.attempt(&request(Duration::from_secs(5), None)).await;
                assert!(is_refused(&o, "denied.x"), "{case}: {o:?}");
            }
        }
    }

    /// A stream captures the subject but the user may not publish to it: the JetStream
    /// publish is refused and never answered; the refusal fails the attempt at once, not the
    /// attempt's timeout.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_jetstream_publish_the_server_refuses_fails_at_once() {
        let server = server_allowing(true, r#""orders.paid", "$JS.API.>""#, r#""_INBOX.>""#);
        let client = async_nats::connect(server.url()).await.expect("connect");
        jetstream::new(client)
            .create_stream(jetstream::stream::Config {
                name: "ORDERS".into(),
                subjects: vec!["orders.>".into()],
                ..Default::default()
            })
            .await
            .expect("stream");
        let denied = target_on(server.url(), NatsAck::JetStream, "orders.secret");
        let started = std::time::Instant::now();
        let o = denied
            .attempt(&request(Duration::from_secs(20), None))
            .await;
        assert!(is_refused(&o, "orders.secret"), "{o:?}");
        assert!(started.elapsed() < Duration::from_secs(10), "not a timeout");
        let allowed = target_on(server.url(), NatsAck::JetStream, "orders.paid");
        let o = allowed
            .attempt(&request(Duration::from_secs(20), None))
            .await;
        assert!(matches!(o, AttemptOutcome::Delivered { .. }), "{o:?}");
    }

    /// A user that may publish to the subject but not ask JetStream's API which stream
    /// captures it: under `auto` and `jetstream` every attempt waited out its timeout and
    /// failed as a bare "timeout". The refusal fails it at once, naming the permission.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_stream_lookup_names_the_missing_permission_at_once() {
        assert_eq!(lookup_wait(Duration::from_secs(30)), Duration::from_secs(5));
        assert_eq!(lookup_wait(Duration::from_secs(2)), Duration::from_secs(1));
        for jetstream in [true, false] {
            let server = server_allowing(jetstream, r#""orders.>""#, r#""_INBOX.>""#);
            for ack in [NatsAck::Auto, NatsAck::JetStream] {
                let target = target_on(server.url(), ack, "orders.paid");
                let started = std::time::Instant::now();
                let o = target
                    .attempt(&request(Duration::from_secs(20), None))
                    .await;
                assert!(
                    matches!(o, AttemptOutcome::Permanent { .. }),
                    "{ack:?}: {o:?}"
                );
                assert!(
                    o.error().is_some_and(|e| e.starts_with("permission denied")
                        && e.contains("$JS.API.STREAM.NAMES")),
                    "{ack:?}: {o:?}"
                );
                assert!(started.elapsed() < Duration::from_secs(10), "not a timeout");
            }
            // `core` does not ask.
            let target = target_on(server.url(), NatsAck::Core, "orders.paid");
            let o = target
                .attempt(&request(Duration::from_secs(20), None))
                .await;
            assert!(matches!(o, AttemptOutcome::Delivered { .. }), "{o:?}");
        }
    }

    /// A user that may not subscribe to the inbox gets no answer to anything: the attempt
    /// says so (permanent), not a timeout.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_inbox_subscription_is_named() {
        let server = server_allowing(false, r#"">""#, r#""orders.>""#);
        let target = target_on(server.url(), NatsAck::Core, "orders.paid");
        for _ in 0..2 {
            let started = std::time::Instant::now();
            let o = target
                .attempt(&request(Duration::from_secs(20), None))
                .await;
            assert!(matches!(o, AttemptOutcome::Permanent { .. }), "{o:?}");
            assert!(
                o.error()
                    .is_some_and(|e| e.contains("subscribe permission on _INBOX.>")),
                "{o:?}"
            );
            assert!(started.elapsed() < Duration::from_secs(10), "not a timeout");
        }
    }

    /// A stream with `no_ack: true` stores the message and acknowledges nothing: each attempt
    /// waited for a PubAck and failed as a timeout. The lookup sees `no_ack` and the message
    /// goes out as core NATS: delivered at the first attempt, stored once (the second
    /// publish, with the same `Nats-Msg-Id`, is the stream's duplicate).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_no_ack_stream_is_published_to_without_waiting_for_an_ack() {
        let server = crate::store::jetstream::test_server::TestServer::start();
        let client = async_nats::connect(server.url()).await.expect("connect");
        let js = jetstream::new(client);
        js.create_stream(jetstream::stream::Config {
            name: "NOACK".into(),
            subjects: vec!["noack.>".into()],
            no_ack: true,
            ..Default::default()
        })
        .await
        .expect("stream");
        for ack in [NatsAck::Auto, NatsAck::JetStream] {
            let target = target_on(server.url(), ack, "noack.x");
            let started = std::time::Instant::now();
            let o = target.attempt(&request(Duration::from_secs(3), None)).await;
            assert!(
                matches!(o, AttemptOutcome::Delivered { .. }),
                "{ack:?}: {o:?}"
            );
            assert!(started.elapsed() < Duration::from_secs(2), "not a timeout");
            assert_eq!(
                target.remembered(),
                Some(Capture::NoAckStream("NOACK".into()))
            );
            let mut stream = js.get_stream("NOACK").await.expect("stream");
            let stored = stream.info().await.expect("info").state.messages;
            assert_eq!(stored, 1, "{ack:?}");
        }
    }

    #[tokio::test]
    async fn a_remembered_missing_stream_is_trusted_only_under_auto() {
        let conn = NatsConnection::new(
            NatsConfig::default(),
            no_secrets(),
            tokio::runtime::Handle::current(),
        );
        let mut target = NatsTarget::new(conn, "a.b");
        target.remember(Some(Capture::NoStream));
        assert_eq!(target.remembered(), Some(Capture::NoStream));
        target.ack = NatsAck::JetStream;
        assert_eq!(target.remembered(), None, "asked again at each attempt");
        target.remember(Some(Capture::Stream("S".into())));
        assert_eq!(target.remembered(), Some(Capture::Stream("S".into())));
        target.remember(None);
        assert_eq!(target.remembered(), None);
    }

    #[tokio::test]
    async fn a_remembered_stream_expires() {
        let conn = NatsConnection::new(
            NatsConfig::default(),
            no_secrets(),
            tokio::runtime::Handle::current(),
        );
        let target = NatsTarget::new(conn, "a.b");
        let at = |age: Duration| {
            *target.capture.lock().expect("capture") = tokio::time::Instant::now()
                .checked_sub(age)
                .map(|t| (t, Capture::Stream("S".into())));
        };
        at(CAPTURE_TTL - Duration::from_millis(100));
        assert!(target.remembered().is_some());
        at(CAPTURE_TTL + Duration::from_millis(1));
        assert_eq!(target.remembered(), None);
    }

    /// The publish error of a JetStream error answer `json` (as the server sends it).
    fn answered(json: &str) -> async_nats::jetstream::context::PublishError {
        let answer: jetstream::response::Response<jetstream::publish::PublishAck> =
            serde_json::from_str(json).expect("error answer");
        let jetstream::response::Response::Err { error } = answer else {
            panic!("an error answer");
        };
        async_nats::jetstream::context::PublishError::with_source(JetStreamErrorKind::Other, error)
    }

    #[test]
    fn a_stream_error_answer_is_retryable_with_its_text() {
        // What the server answers when a stream with `discard: new` is full.
        let o = classify_jetstream(&answered(
            r#"{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"}}"#,
        ));
        assert!(matches!(o, AttemptOutcome::Retryable { .. }), "{o:?}");
        assert!(
            o.error()
                .is_some_and(|t| t.contains("maximum messages exceeded") && t.contains("10077")),
            "{o:?}"
        );
    }

    #[test]
    fn a_message_over_the_streams_own_limit_is_permanent() {
        let o = classify_jetstream(&answered(
            r#"{"error":{"code":400,"err_code":10054,"description":"message size exceeds maximum allowed"}}"#,
        ));
        assert!(matches!(o, AttemptOutcome::Permanent { .. }), "{o:?}");
        assert!(!o.counts_for_breaker());
        assert!(o.error().is_some_and(|t| t.contains("10054")), "{o:?}");
    }

    /// Nothing listens on the port: the router's client is built all the same (retry on
    /// initial connect) and each attempt fails at once as a retryable connection failure,
    /// without queueing the message in the client.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreachable_server_is_a_retryable_connection_failure() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").port()
        };
        let cfg = NatsConfig {
            url: format!("nats://127.0.0.1:{port}"),
            connect_timeout: Duration::from_millis(200),
            ..NatsConfig::default()
        };
        let conn = NatsConnection::new(cfg, no_secrets(), tokio::runtime::Handle::current());
        let tracker = TaskTracker::new();
        conn.warm(&tracker);
        conn.warm(&tracker);
        for ack in [NatsAck::Auto, NatsAck::JetStream, NatsAck::Core] {
            let target = NatsTarget {
                ack,
                ..NatsTarget::new(conn.clone(), "orders.paid")
            };
            let started = std::time::Instant::now();
            let o = target.attempt(&request(Duration::from_secs(5), None)).await;
            assert!(o.counts_for_breaker(), "{ack:?}: {o:?}");
            assert!(
                o.error().is_some_and(|e| e.starts_with(&format!(
                    "connection failed: not connected to NATS at nats://127.0.0.1:{port}"
                ))),
                "{ack:?}: {o:?}"
            );
            assert!(started.elapsed() < Duration::from_secs(2), "fails fast");
        }
        tracker.close();
        tracker.wait().await;
    }

    /// `connect_timeout` (2 s by default) longer than the attempt's timeout: the attempt
    /// reports the unreachable server after half its timeout, not a timeout after all of it;
    /// and the connection's state shows in its status.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreachable_server_is_reported_as_such_within_the_attempts_timeout() {
        assert_eq!(
            connect_wait(Duration::from_secs(2), Duration::from_secs(1)),
            Duration::from_millis(500)
        );
        assert_eq!(
            connect_wait(Duration::from_secs(2), Duration::from_secs(10)),
            Duration::from_secs(2)
        );
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").port()
        };
        let cfg = NatsConfig {
            url: format!("nats://127.0.0.1:{port}"),
            connect_timeout: Duration::from_secs(2),
            ..NatsConfig::default()
        };
        let conn = NatsConnection::new(cfg, no_secrets(), tokio::runtime::Handle::current());
        assert!(
            conn.status().is_none(),
            "no client before a target starts it"
        );
        let target = NatsTarget::new(conn.clone(), "orders.paid");
        let o = target.attempt(&request(Duration::from_secs(1), None)).await;
        assert!(
            o.error().is_some_and(|e| e.starts_with(&format!(
                "connection failed: not connected to NATS at nats://127.0.0.1:{port}"
            ))),
            "{o:?}"
        );
        let status = conn.status().expect("started");
        assert!(!status.connected, "{status:?}");
        assert_eq!(status.url, format!("nats://127.0.0.1:{port}"));
    }

    /// `nats.user` with the password from `nats.password_env` authenticates (a URL with them
    /// is refused by the config, and async-nats would not have sent them).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_user_and_password_from_the_environment_authenticate() {
        let server = crate::store::jetstream::test_server::TestServer::start_configured(
            false,
            "authorization {\n  users = [ { user: router, password: S3cretPassw0rd } ]\n}\n",
        );
        let secrets: SecretResolver =
            Arc::new(|name| (name == "NATS_PASSWORD").then(|| "S3cretPassw0rd".to_string()));
        for (password_env, delivered) in [("NATS_PASSWORD", true), ("NO_SUCH_VAR", false)] {
            let cfg = NatsConfig {
                url: server.url(),
                ack: NatsAck::Core,
                user: Some("router".into()),
                password_env: Some(password_env.into()),
                connect_timeout: Duration::from_millis(500),
                ..NatsConfig::default()
            };
            let conn = NatsConnection::new(cfg, secrets.clone(), tokio::runtime::Handle::current());
            let o = NatsTarget::new(conn, "a.b")
                .attempt(&request(Duration::from_secs(5), None))
                .await;
            if delivered {
                assert!(matches!(o, AttemptOutcome::Delivered { .. }), "{o:?}");
            } else {
                assert!(
                    o.error()
                        .is_some_and(|e| e.contains("nats.password_env NO_SUCH_VAR")),
                    "{o:?}"
                );
            }
        }
        // Without the password the server refuses the connection.
        let cfg = NatsConfig {
            url: server.url(),
            ack: NatsAck::Core,
            connect_timeout: Duration::from_millis(500),
            ..NatsConfig::default()
        };
        let conn = NatsConnection::new(cfg, secrets, tokio::runtime::Handle::current());
        let o = NatsTarget::new(conn, "a.b")
            .attempt(&request(Duration::from_secs(2), None))
            .await;
        assert!(
            o.error()
                .is_some_and(|e| e.starts_with("connection failed")),
            "{o:?}"
        );
    }

    /// A server that requires TLS and verifies clients (mTLS) against a private CA: the
    /// `nats.tls_*` files get the router in; without the client certificate the server
    /// refuses it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tls_files_reach_a_server_that_verifies_clients() {
        let dir = tempfile::tempdir().expect("tmp");
        let ca_key = rcgen::KeyPair::generate().expect("ca key");
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("ca");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).expect("ca");
        let write = |name: &str, text: String| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).expect("write");
            path
        };
        let issue = |name: &str, sans: &[&str]| {
            let key = rcgen::KeyPair::generate().expect("key");
            let cert = rcgen::CertificateParams::new(
                sans.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            )
            .expect("params")
            .signed_by(&key, &ca)
            .expect("sign");
            (
                write(&format!("{name}.pem"), cert.pem()),
                write(&format!("{name}-key.pem"), key.serialize_pem()),
            )
        };
        let (server_cert, server_key) = issue("server", &["127.0.0.1", "localhost"]);
        let (client_cert, client_key) = issue("client", &["router"]);
        let ca_file = write("ca.pem", ca.pem());
        let server = crate::store::jetstream::test_server::TestServer::start_configured(
            false,
            &format!(
                "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n  ca_file: {:?}\n  verify: true\n  timeout: 2\n}}\n",
                server_cert.display().to_string(),
                server_key.display().to_string(),
                ca_file.display().to_string()
            ),
        );
        for with_client_cert in [true, false] {
            let cfg = NatsConfig {
                url: server.url(),
                ack: NatsAck::Core,
                connect_timeout: Duration::from_secs(2),
                tls_ca_file: Some(ca_file.clone()),
                tls_cert_file: with_client_cert.then(|| client_cert.clone()),
                tls_key_file: with_client_cert.then(|| client_key.clone()),
                ..NatsConfig::default()
            };
            let conn = NatsConnection::new(cfg, no_secrets(), tokio::runtime::Handle::current());
            let o = NatsTarget::new(conn, "a.b")
                .attempt(&request(Duration::from_secs(8), None))
                .await;
            if with_client_cert {
                assert!(matches!(o, AttemptOutcome::Delivered { .. }), "{o:?}");
            } else {
                assert!(
                    o.error()
                        .is_some_and(|e| e.starts_with("connection failed")),
                    "{o:?}"
                );
            }
        }
    }

    #[tokio::test]
    async fn a_missing_token_or_credentials_file_fails_the_attempt_and_is_tried_again() {
        let cfg = NatsConfig {
            token_env: Some("ROUTER_TEST_NO_SUCH_TOKEN".into()),
            ..NatsConfig::default()
        };
        let conn = NatsConnection::new(cfg, no_secrets(), tokio::runtime::Handle::current());
        let target = NatsTarget::new(conn.clone(), "a.b");
        for _ in 0..2 {
            let o = target.attempt(&request(Duration::from_secs(1), None)).await;
            assert!(
                o.error()
                    .is_some_and(|e| e.contains("nats.token_env ROUTER_TEST_NO_SUCH_TOKEN")),
                "{o:?}"
            );
            assert!(o.counts_for_breaker());
        }
        let cfg = NatsConfig {
            credentials_file: Some("/nonexistent/router.creds".into()),
            ..NatsConfig::default()
        };
        let conn = NatsConnection::new(cfg, no_secrets(), tokio::runtime::Handle::current());
        let o = NatsTarget::new(conn, "a.b")
            .attempt(&request(Duration::from_secs(1), None))
            .await;
        assert!(
            o.error()
                .is_some_and(|e| e.contains("nats.credentials_file /nonexistent/router.creds")),
            "{o:?}"
        );
    }
}
