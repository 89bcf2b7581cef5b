//! One handler invocation: a fresh store from the pre-instantiated component, the event in, and
//! a classified outcome out (emissions, retry, fail, or which limit stopped it), with the logs and
//! the buffered key-value writes the router commits together with the delivery's ack.
//!
//! [`invoke`] is synchronous and CPU-bound (up to the timeout): async callers run it under
//! `tokio::task::spawn_blocking`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{Map, Value};
use wasmtime::{Store, Trap, WasmBacktrace};

use super::bindings::{
    HostLimitBreach, HostState, KvReader, KvWrite, LogLevel, LogLine, MAX_KEY_BYTES,
    MemoryCapExceeded, wit,
};
use super::engine::WasmEngine;
use super::limits::HandlerLimits;
use super::registry::{HandlerDescriptor, LoadedHandler};

/// The delivery facts handed to the handler.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeliveryInfo {
    /// 1 for the first attempt.
    pub attempt: u32,
    /// Stable across the attempts of one delivery.
    pub idempotency_key: String,
    /// The rule that matched.
    pub rule: String,
    /// The target id.
    pub target: String,
}

/// How an invocation ended.
#[derive(Debug, Clone, PartialEq)]
pub enum InvocationOutcome {
    /// The handler succeeded; partial CloudEvents (`type`, optional `subject`,
    /// `datacontenttype`, `data`, and extension attributes) for the router to complete with `id`,
    /// `source` and `hops`.
    Emitted(Vec<Value>),
    /// The handler asked to be retried, no sooner than `delay` if given.
    Retry {
        /// The handler's minimum delay.
        delay: Option<Duration>,
        /// The handler's reason.
        message: String,
    },
    /// The handler failed permanently (or the event could not be presented to it).
    Fail(String),
    /// The handler returned an emission that is not a valid event: a permanent failure whose
    /// key-value writes are dropped with its emissions (committed alone, they would tell an
    /// idempotent handler, after a fix and a redrive, that its work was done).
    InvalidEmission(String),
    /// The wall-clock timeout passed.
    Timeout,
    /// The memory cap was reached.
    Oom,
    /// The guest trapped: a panic, a stack overflow, `unreachable`…; the message includes the
    /// trap and what the guest wrote to stderr (a panic's message).
    Trap(String),
    /// Too many emissions, output too big, key-value writes too big, a key too long, or fuel
    /// exhausted: the same event goes over the limit again, so it is not retried.
    LimitExceeded(String),
    /// A host call could not be served for now (a key-value read failed, the namespace is
    /// full): retried, and not the handler's fault.
    HostUnavailable(String),
    /// No instance could be allocated for the invocation (the engine's instance pool was
    /// full): the handler did not run, so this is neither an attempt nor its failure.
    Busy(String),
}

impl InvocationOutcome {
    /// Whether the invocation ran to a result the handler chose (`Emitted`, `Retry`, `Fail`)
    /// rather than being stopped by the sandbox. Only then are writes returned.
    pub fn is_handler_result(&self) -> bool {
        matches!(self, Self::Emitted(_) | Self::Retry { .. } | Self::Fail(_))
    }
}

/// Everything one invocation produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Invocation {
    /// How it ended.
    pub outcome: InvocationOutcome,
    /// Captured log lines (capped), plus the guest's console output when it wrote any.
    pub logs: Vec<LogLine>,
    /// Log lines the per-invocation cap dropped.
    pub log_lines_dropped: u64,
    /// Key-value writes to commit with the ack (last write per key, in first-write order).
    /// Empty unless [`InvocationOutcome::is_handler_result`].
    pub kv_writes: Vec<KvWrite>,
    /// Compare-and-set preconditions: at commit, each key must still hold this value (`None`:
    /// absent), or the writes are stale and the delivery must be retried.
    pub cas_checks: Vec<(String, Option<Vec<u8>>)>,
    /// Wall-clock time of the invocation, instantiation included.
    pub duration: Duration,
}

/// Attributes of an incoming event that have their own field in the handler's `event` record.
const EVENT_FIELDS: &[&str] = &[
    "specversion",
    "id",
    "source",
    "type",
    "subject",
    "time",
    "datacontenttype",
    "data",
    "data_base64",
    "dataversion",
    "hops",
];

/// Runs `handler` on `event` (a structured-mode CloudEvent) under `limits`.
///
/// Key-value reads go to `kv` through an overlay of this invocation's writes; nothing is ever
/// written to the store here. The store, its instance and its memory are dropped before this
/// returns, whatever the guest did.
pub fn invoke(
    handler: &LoadedHandler,
    event: &Value,
    delivery: &DeliveryInfo,
    kv: Arc<dyn KvReader>,
    limits: &HandlerLimits,
) -> Invocation {
    let started = Instant::now();
    let early = |outcome| Invocation {
        outcome,
        logs: Vec::new(),
        log_lines_dropped: 0,
        kv_writes: Vec::new(),
        cas_checks: Vec::new(),
        duration: started.elapsed(),
    };
    if let Err(e) = handler.engine().check_limits(limits) {
        return early(InvocationOutcome::Trap(format!(
            "router configuration: {e}"
        )));
    }
    let wit_event = match event_to_wit(event) {
        Ok(e) => e,
        Err(message) => {
            return early(InvocationOutcome::Fail(format!(
                "event cannot be given to the handler: {message}"
            )));
        }
    };
    let wit_delivery = wit::Delivery {
        attempt: delivery.attempt,
        idempotency_key: delivery.idempotency_key.clone(),
        rule: delivery.rule.clone(),
        target: delivery.target.clone(),
    };

    let mut store = new_store(handler.engine(), limits, kv, hostcall_fuel(limits));
    let result = handler
        .pre()
        .instantiate(&mut store)
        .and_then(|instance| instance.call_handle(&mut store, &wit_event, &wit_delivery));
    let state = store.into_data();

    let outcome = match result {
        Ok(Ok(emitted)) => emitted_outcome(emitted, limits),
        Ok(Err(wit::HandlerError::Retry(info))) => InvocationOutcome::Retry {
            delay: info.delay_ms.map(Duration::from_millis),
            message: info.message,
        },
        Ok(Err(wit::HandlerError::Fail(message))) => InvocationOutcome::Fail(message),
        Err(err) => classify_error(&err, &state, limits),
    };
    finish(outcome, state, started)
}

/// Why `describe` gave no descriptor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum DescribeError {
    /// The router had no instance to spare for it (other uploads were describing, or the pool
    /// was full): nothing is wrong with the component, and the same call may pass later.
    #[error("{0}")]
    Busy(String),
    /// `describe` trapped, timed out, ran out of memory or returned too much.
    #[error("{0}")]
    Failed(String),
}

/// Hostcall fuel of a `describe` call: its result is a name, a version and a list of types.
const DESCRIBE_HOSTCALL_FUEL: usize = 256 << 10;

/// Calls `describe` in a fresh store under default limits, on one of the instances the
/// engine's pool keeps for it ([`super::engine::DESCRIBE_INSTANCES`]), held until the store is
/// gone: an upload whose client went away still holds it until `describe` ends, and never
/// takes an instance an invocation holds a slot for.
pub(crate) fn describe(
    engine: &Arc<WasmEngine>,
    pre: &super::bindings::HandlerPre<HostState>,
) -> Result<HandlerDescriptor, DescribeError> {
    let Some(_slot) = engine.describe_slot() else {
        return Err(DescribeError::Busy(format!(
            "the router is busy: the {} instances kept for describe() are all in use by other uploads; try again shortly",
            super::engine::DESCRIBE_INSTANCES
        )));
    };
    let limits = HandlerLimits {
        memory_bytes: HandlerLimits::default()
            .memory_bytes
            .min(engine.config().max_memory_bytes),
        ..HandlerLimits::default()
    };
    let mut store = new_store(
        engine,
        &limits,
        Arc::new(super::bindings::EmptyKv),
        DESCRIBE_HOSTCALL_FUEL,
    );
    let result = pre
        .instantiate(&mut store)
        .and_then(|i| i.call_describe(&mut store));
    let state = store.into_data();
    match result {
        Ok(d) => Ok(HandlerDescriptor::from(d)),
        Err(err) => Err(match classify_error(&err, &state, &limits) {
            InvocationOutcome::Busy(m) => DescribeError::Busy(format!("the router is busy: {m}")),
            InvocationOutcome::Timeout => DescribeError::Failed(format!(
                "describe did not return within {:?}",
                limits.timeout
            )),
            InvocationOutcome::Oom => DescribeError::Failed(format!(
                "describe exceeded the memory limit of {} bytes",
                limits.memory_bytes
            )),
            InvocationOutcome::Trap(m) | InvocationOutcome::LimitExceeded(m) => {
                DescribeError::Failed(m)
            }
            other => DescribeError::Failed(format!("{other:?}")),
        }),
    }
}

/// What may be copied out of the guest in one call on top of the largest output an
/// invocation may legitimately hand over: list bookkeeping (each element of a list counts its
/// size in host memory: an emission about 120 bytes, an extension 48) and a log line longer
/// than the log cap, which is truncated after it is copied.
const HOSTCALL_SLACK: usize = 256 << 10;

/// Wasmtime's hostcall fuel for one invocation: the most bytes one call may copy out of the
/// guest into the host (the `handle` result, a log line, a key-value write). Wasmtime counts
/// the bytes of each string and, for each list, its length times its element's size in host
/// memory, and stops the call past it. Its default (128 MiB per call) let a handler capped at
/// a few MiB of memory make the router allocate a hundred times that, by returning many
/// emissions that all point at the same string: the limits checked after the copy came too
/// late. This is the largest thing a call may carry within the other limits, and some slack.
pub(crate) fn hostcall_fuel(limits: &HandlerLimits) -> usize {
    let result = limits.max_output_bytes.saturating_add(
        limits
            .max_emitted
            .saturating_mul(std::mem::size_of::<wit::Emitted>()),
    );
    // A compare-and-set carries the expected value and the new one, each at most what one
    // invocation may write.
    let kv = limits
        .max_kv_write_bytes
        .saturating_mul(2)
        .saturating_add(2 * MAX_KEY_BYTES);
    result
        .max(kv)
        .max(limits.max_log_bytes)
        .max(limits.max_stderr_bytes)
        .saturating_add(HOSTCALL_SLACK)
}

pub(super) fn new_store(
    engine: &Arc<WasmEngine>,
    limits: &HandlerLimits,
    kv: Arc<dyn KvReader>,
    hostcall_fuel: usize,
) -> Store<HostState> {
    let mut state = HostState::new(limits, engine.config().table_elements, kv);
    state.hostcall_fuel = hostcall_fuel;
    let mut store = Store::new(engine.engine(), state);
    store.limiter(|s| &mut s.limiter);
    store.set_hostcall_fuel(hostcall_fuel);
    store.set_epoch_deadline(engine.deadline_ticks(limits.timeout));
    if engine.config().fuel {
        // With metering on, a store starts with no fuel at all: "no fuel limit" means plenty.
        // `set_fuel` only fails on engines without metering.
        let _ = store.set_fuel(limits.fuel.unwrap_or(u64::MAX));
    }
    store
}

fn finish(outcome: InvocationOutcome, state: HostState, started: Instant) -> Invocation {
    let console = state.console.text();
    let at_ms = state.logs.at_ms();
    let log_lines_dropped = state.logs.dropped_lines();
    let mut logs = state.logs.finish();
    if !console.is_empty() {
        logs.push(LogLine {
            level: LogLevel::Warn,
            message: format!("[guest console] {console}"),
            at_ms,
        });
    }
    let (kv_writes, cas_checks) = if outcome.is_handler_result() {
        (state.kv.writes, state.kv.cas_checks)
    } else {
        (Vec::new(), Vec::new())
    };
    Invocation {
        outcome,
        logs,
        log_lines_dropped,
        kv_writes,
        cas_checks,
        duration: started.elapsed(),
    }
}

/// Wasmtime's message when a call copied more out of the guest than its hostcall fuel
/// allows. Its error type (`HostcallFuelExhausted` in wasmtime 48's
/// `runtime/component/func/options.rs`) is private, so its message, compared whole, is the
/// only way to tell it; `tests::a_result_over_the_hostcall_fuel_is_a_limit` runs a real guest
/// into it, so a wasmtime upgrade that rewords it fails there instead of turning a permanent
/// limit into a retried trap.
const HOSTCALL_FUEL_EXHAUSTED: &str = "too much data is being copied between the host and the guest: fuel allocated for hostcalls has been exhausted";

/// Whether `err` is wasmtime's refusal to copy more than the store's hostcall fuel.
fn is_hostcall_fuel_exhausted(err: &wasmtime::Error) -> bool {
    err.downcast_ref::<Trap>().is_none()
        && err
            .chain()
            .any(|e| e.to_string() == HOSTCALL_FUEL_EXHAUSTED)
}

/// Tells which limit (or which trap) stopped the guest. Flags set by the host (memory cap,
/// host-call limits) win over the trap code, which for them is only a consequence.
fn classify_error(
    err: &wasmtime::Error,
    state: &HostState,
    limits: &HandlerLimits,
) -> InvocationOutcome {
    // Instantiation found the pool full: the guest never ran. Wasmtime reports this with a
    // public error type (`PoolConcurrencyLimitError`: component or core instances, memories,
    // tables), found anywhere in the context chain by `is`.
    if err.is::<wasmtime::PoolConcurrencyLimitError>() {
        return InvocationOutcome::Busy(format!("no wasm instance free: {err:#}"));
    }
    if state.limiter.memory_exhausted || err.is::<MemoryCapExceeded>() {
        return InvocationOutcome::Oom;
    }
    match &state.breach {
        Some(HostLimitBreach::Invocation(m)) => return InvocationOutcome::LimitExceeded(m.clone()),
        Some(HostLimitBreach::Transient(m)) => {
            return InvocationOutcome::HostUnavailable(m.clone());
        }
        None => {}
    }
    if is_hostcall_fuel_exhausted(err) {
        return InvocationOutcome::LimitExceeded(format!(
            "the handler handed the router more than {} bytes in one call (its result, a log line or a key-value write), past what its limits allow",
            state.hostcall_fuel
        ));
    }
    // The first line says what happened (the trap's kind, the guest's panic, or the router's
    // own explanation), as the DLQ table and the router's log show only it; the guest's
    // stderr and the wasm backtrace follow, once each. (Wasmtime's `Trap` displays with its
    // own "wasm trap: " prefix, and the backtrace is the error's outermost context, so
    // `{err:#}` would open with the backtrace and repeat it.)
    let backtrace = err.downcast_ref::<WasmBacktrace>().map(ToString::to_string);
    let what = match err.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) => return InvocationOutcome::Timeout,
        // The budget and its key: a permanent failure on the first attempt must say what to
        // raise (or which loop to fix).
        Some(Trap::OutOfFuel) => {
            let budget = limits
                .fuel
                .map_or_else(|| "its".to_owned(), |f| format!("its budget of {f}"));
            return InvocationOutcome::LimitExceeded(format!(
                "fuel exhausted: the handler used up {budget} instructions (handlers.fuel)"
            ));
        }
        Some(Trap::StackOverflow) => "wasm trap: stack overflow (call stack exhausted)".to_owned(),
        Some(trap) => trap.to_string(),
        None => {
            let causes: Vec<String> = err
                .chain()
                .map(ToString::to_string)
                .filter(|m| Some(m) != backtrace.as_ref())
                .collect();
            if causes.is_empty() {
                "the handler failed".to_owned()
            } else {
                causes.join(": ")
            }
        }
    };
    let console = state.console.text();
    let mut message = match guest_panic(&console) {
        Some(panic) => format!("guest panicked: {panic} ({what})"),
        None => what,
    };
    if !console.is_empty() {
        message.push_str("\nguest stderr:\n");
        message.push_str(&console);
    }
    if let Some(bt) = backtrace {
        let cut = bt.char_indices().nth(2048).map_or(bt.len(), |(i, _)| i);
        message.push('\n');
        message.push_str(&bt[..cut]);
    }
    InvocationOutcome::Trap(message)
}

/// The message of a Rust panic in the guest's stderr (`thread '…' panicked at FILE:LINE:COL:`
/// then the message), on one line, if there is one.
fn guest_panic(console: &str) -> Option<String> {
    let (_, after) = console.split_once(" panicked at ")?;
    let (_, rest) = after.split_once('\n')?;
    let message: Vec<&str> = rest
        .lines()
        .take_while(|l| !l.starts_with("note: "))
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    (!message.is_empty()).then(|| message.join(" "))
}

/// Checks the handler's emissions against the limits and turns them into partial CloudEvents.
fn emitted_outcome(emitted: Vec<wit::Emitted>, limits: &HandlerLimits) -> InvocationOutcome {
    if emitted.len() > limits.max_emitted {
        return InvocationOutcome::LimitExceeded(format!(
            "handler emitted {} events; the limit is {} (handlers.max_emitted)",
            emitted.len(),
            limits.max_emitted
        ));
    }
    // Every field a handler writes counts: a huge `subject` or `type` is output too.
    let bytes: usize = emitted
        .iter()
        .map(|e| {
            e.type_.len()
                + e.subject.as_ref().map_or(0, String::len)
                + e.datacontenttype.as_ref().map_or(0, String::len)
                + e.data.as_ref().map_or(0, String::len)
                + e.extensions
                    .iter()
                    .map(|(k, v)| k.len() + v.len())
                    .sum::<usize>()
        })
        .sum();
    if bytes > limits.max_output_bytes {
        return InvocationOutcome::LimitExceeded(format!(
            "handler emitted {bytes} bytes; the limit is {} (handlers.max_output_bytes)",
            limits.max_output_bytes
        ));
    }
    let mut events = Vec::with_capacity(emitted.len());
    for (i, e) in emitted.into_iter().enumerate() {
        match emitted_to_json(e) {
            Ok(v) => events.push(v),
            Err(message) => {
                return InvocationOutcome::InvalidEmission(format!(
                    "emitted event #{i} is invalid: {message}"
                ));
            }
        }
    }
    InvocationOutcome::Emitted(events)
}

fn emitted_to_json(e: wit::Emitted) -> Result<Value, String> {
    if e.type_.is_empty() {
        return Err("empty type".into());
    }
    let mut m = Map::new();
    m.insert("type".into(), Value::String(e.type_));
    if let Some(subject) = e.subject {
        m.insert("subject".into(), Value::String(subject));
    }
    if let Some(data) = e.data {
        let value: Value =
            serde_json::from_str(&data).map_err(|err| format!("data is not JSON: {err}"))?;
        let ct = e
            .datacontenttype
            .unwrap_or_else(|| "application/json".into());
        m.insert("datacontenttype".into(), Value::String(ct));
        m.insert("data".into(), value);
    } else if let Some(ct) = e.datacontenttype {
        m.insert("datacontenttype".into(), Value::String(ct));
    }
    for (name, json) in e.extensions {
        let valid_name = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
        // Core attributes and `hops` are the router's to set on an emitted event.
        let reserved = crate::event::CORE_ATTRIBUTES.contains(&name.as_str()) || name == "hops";
        if !valid_name || reserved {
            return Err(format!("extension name {name:?} is not allowed"));
        }
        let value: Value = serde_json::from_str(&json)
            .map_err(|err| format!("extension {name:?} is not JSON: {err}"))?;
        m.insert(name, value);
    }
    Ok(Value::Object(m))
}

/// Builds the handler's `event` record from a structured-mode CloudEvent.
pub(crate) fn event_to_wit(event: &Value) -> Result<wit::Event, String> {
    let obj = event.as_object().ok_or("not a JSON object")?;
    let required = |name: &str| match obj.get(name) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        _ => Err(format!("missing or non-string attribute {name:?}")),
    };
    let optional = |name: &str| match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("attribute {name:?} must be a string")),
    };
    let datacontenttype = optional("datacontenttype")?;
    let dataversion = match obj.get("dataversion") {
        Some(Value::Number(n)) => n.as_u64().and_then(|v| u32::try_from(v).ok()).unwrap_or(1),
        Some(Value::String(s)) => s.parse().unwrap_or(1),
        _ => 1,
    };
    let hops = obj
        .get("hops")
        .and_then(Value::as_u64)
        .and_then(|v| u32::try_from(v).ok())
        .unwrap_or(0);
    let is_json = datacontenttype
        .as_deref()
        .is_none_or(crate::event::content_type_is_json);
    let (data, mut data_base64) = match obj.get("data") {
        None | Some(Value::Null) => (None, None),
        // Textual non-JSON data (e.g. `text/plain`) is handed over as bytes.
        Some(Value::String(s)) if !is_json => (
            None,
            Some(base64::engine::general_purpose::STANDARD.encode(s)),
        ),
        Some(v) => (Some(v.to_string()), None),
    };
    if let Some(b64) = optional("data_base64")? {
        data_base64 = Some(b64);
    }
    let extensions = obj
        .iter()
        .filter(|(k, _)| !EVENT_FIELDS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.to_string()))
        .collect();
    Ok(wit::Event {
        id: required("id")?,
        source: required("source")?,
        type_: required("type")?,
        subject: optional("subject")?,
        time: optional("time")?,
        datacontenttype,
        dataversion,
        data,
        data_base64,
        extensions,
        hops,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The SDK refuses, before the call ends, the extension names this host refuses on an
    /// emitted event; it keeps its own copy of the list (the guest crate cannot depend on the
    /// router), so the two are compared here as text: a core attribute added to one alone
    /// would make `with_extension` accept what the router then dead-letters, or the reverse.
    #[test]
    fn the_sdk_reserves_the_extension_names_this_host_refuses() {
        let sdk = include_str!("../../../sdk/src/emit.rs");
        let head = "const RESERVED_EXTENSION_NAMES: &[&str] = &[";
        let start = sdk.find(head).expect("the SDK's list") + head.len();
        let list = &sdk[start..];
        let list = &list[..list.find("];").expect("its end")];
        let mut in_sdk: Vec<&str> = list
            .split(',')
            .map(|n| n.trim().trim_matches('"'))
            .filter(|n| !n.is_empty())
            .collect();
        let mut here: Vec<&str> = crate::event::CORE_ATTRIBUTES.to_vec();
        here.push("hops");
        in_sdk.sort_unstable();
        here.sort_unstable();
        assert_eq!(in_sdk, here);
    }

    #[test]
    fn a_rust_panic_in_the_guest_stderr_is_found_on_one_line() {
        let console = "thread '<unnamed>' panicked at src/lib.rs:70:24:\nbad input:\n  order 7\nnote: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n";
        assert_eq!(guest_panic(console).as_deref(), Some("bad input: order 7"));
        assert_eq!(guest_panic("just a line\n"), None);
        assert_eq!(guest_panic(""), None);
    }

    #[test]
    fn structured_event_maps_to_the_record() {
        let e = event_to_wit(&json!({
            "specversion": "1.0", "id": "1", "source": "/s", "type": "t",
            "dataversion": "2", "hops": 3, "partitionkey": "k", "dataschema": "urn:x",
            "data": {"a": [1, 2]}
        }))
        .unwrap();
        assert_eq!((e.id.as_str(), e.dataversion, e.hops), ("1", 2, 3));
        assert_eq!(e.data.as_deref(), Some(r#"{"a":[1,2]}"#));
        assert_eq!(
            e.extensions,
            vec![
                ("partitionkey".into(), "\"k\"".into()),
                ("dataschema".into(), "\"urn:x\"".into())
            ]
        );
    }

    #[test]
    fn textual_non_json_data_becomes_base64() {
        let e = event_to_wit(&json!({
            "id": "1", "source": "/s", "type": "t", "datacontenttype": "text/plain", "data": "hi"
        }))
        .unwrap();
        assert_eq!((e.data, e.data_base64.as_deref()), (None, Some("aGk=")));
    }

    #[test]
    fn invalid_events_are_refused() {
        assert!(event_to_wit(&json!({"id": "1", "source": "/s"})).is_err());
        assert!(event_to_wit(&json!([1])).is_err());
        assert!(
            event_to_wit(&json!({"id": "1", "source": "/s", "type": "t", "subject": 5})).is_err()
        );
    }

    fn emitted(data: Option<&str>, extensions: Vec<(&str, &str)>) -> wit::Emitted {
        wit::Emitted {
            type_: "t.x".into(),
            subject: Some("s".into()),
            datacontenttype: None,
            data: data.map(str::to_owned),
            extensions: extensions
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        }
    }

    #[test]
    fn emissions_become_partial_cloudevents() {
        let out = emitted_outcome(
            vec![emitted(Some(r#"{"a":1}"#), vec![("partitionkey", "\"p\"")])],
            &HandlerLimits::default(),
        );
        assert_eq!(
            out,
            InvocationOutcome::Emitted(vec![json!({
                "type": "t.x", "subject": "s", "datacontenttype": "application/json",
                "data": {"a": 1}, "partitionkey": "p"
            })])
        );
    }

    #[test]
    fn invalid_or_oversized_emissions_are_refused() {
        let limits = HandlerLimits {
            max_emitted: 2,
            max_output_bytes: 10,
            ..HandlerLimits::default()
        };
        let many = vec![
            emitted(None, vec![]),
            emitted(None, vec![]),
            emitted(None, vec![]),
        ];
        assert!(matches!(
            emitted_outcome(many, &limits),
            InvocationOutcome::LimitExceeded(_)
        ));
        let big = vec![emitted(Some("\"0123456789\""), vec![])];
        assert!(matches!(
            emitted_outcome(big, &limits),
            InvocationOutcome::LimitExceeded(_)
        ));
        let bad_json = vec![emitted(Some("{"), vec![])];
        assert!(matches!(
            emitted_outcome(bad_json, &limits),
            InvocationOutcome::InvalidEmission(_)
        ));
        let reserved = vec![emitted(None, vec![("id", "\"x\"")])];
        assert!(matches!(
            emitted_outcome(reserved, &limits),
            InvocationOutcome::InvalidEmission(_)
        ));
        let upper = vec![emitted(None, vec![("Bad", "1")])];
        assert!(matches!(
            emitted_outcome(upper, &limits),
            InvocationOutcome::InvalidEmission(_)
        ));
        // Every field counts towards the output bound, not only data.
        let mut long_subject = emitted(None, vec![]);
        long_subject.subject = Some("s".repeat(limits.max_output_bytes + 1));
        assert!(matches!(
            emitted_outcome(vec![long_subject], &limits),
            InvocationOutcome::LimitExceeded(_)
        ));
    }
}
