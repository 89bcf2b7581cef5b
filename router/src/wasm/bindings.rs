//! The host side of the `router:handler` world: generated bindings, the per-invocation store
//! state, and the imports a handler gets (log, kv, and WASI p2 with nothing granted).

use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Instant;

use crate::store::KvUsage;
use wasmtime::component::{HasSelf, Linker, Resource, ResourceTable};
use wasmtime::{ResourceLimiter, Result as WasmResult};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::limits::HandlerLimits;

wasmtime::component::bindgen!({
    world: "handler",
    path: "../sdk/wit",
    imports: { default: trappable },
});

pub use self::router::handler::types as wit;
use self::router::handler::{kv, log, types};

/// Read access to a handler's key-value namespace, implemented by the router over its store.
/// Keys are the handler's own (un-namespaced) keys.
pub trait KvReader: Send + Sync {
    /// The committed value under `key`, if any. An error (the store cannot be read) fails the
    /// invocation, to be retried: acting on a wrong "absent" would break idempotent handlers.
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, String>;

    /// How many more bytes (keys plus values) the namespace may grow by, when it is bounded.
    fn room(&self) -> Result<Option<u64>, String> {
        Ok(None)
    }
}

/// A [`KvReader`] over an empty namespace (used for `describe` and in tests).
#[derive(Debug, Default, Clone, Copy)]
pub struct EmptyKv;

impl KvReader for EmptyKv {
    fn get(&self, _key: &str) -> Result<Option<Vec<u8>>, String> {
        Ok(None)
    }
}

/// One buffered key-value write. `value: None` deletes the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvWrite {
    /// The handler's key (the router adds the namespace).
    pub key: String,
    /// The new value, or `None` for a delete.
    pub value: Option<Vec<u8>>,
    /// Expiry in milliseconds from commit, if any.
    pub ttl_ms: Option<u64>,
}

/// Severity of a captured log line.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    /// `trace`
    Trace,
    /// `debug`
    Debug,
    /// `info`
    Info,
    /// `warn`
    Warn,
    /// `error`
    Error,
}

/// One captured log line; `at_ms` counts from the start of the invocation.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LogLine {
    /// Severity.
    pub level: LogLevel,
    /// The message (possibly truncated at the log limit).
    pub message: String,
    /// Milliseconds since the invocation started.
    pub at_ms: u64,
}

/// Most bytes of one key; longer keys trap the invocation.
pub(crate) const MAX_KEY_BYTES: usize = 1024;

/// Why a host call stopped the guest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum HostLimitBreach {
    /// A limit of one invocation that the handler's own calls went over (a key too long, too
    /// many bytes written): the same event goes over it again at every attempt.
    #[error("{0}")]
    Invocation(String),
    /// The router could not serve the call (a key-value read failed) or the namespace is full
    /// for now: another attempt may get through.
    #[error("{0}")]
    Transient(String),
}

/// Memory-growth refused because it would pass the invocation's cap.
#[derive(Debug, thiserror::Error)]
#[error("memory limit of {limit} bytes reached (asked to grow to {desired} bytes)")]
pub(crate) struct MemoryCapExceeded {
    pub(crate) desired: usize,
    pub(crate) limit: usize,
}

/// Caps linear-memory and table growth, and remembers whether the memory cap was hit so an
/// out-of-memory trap can be told apart from any other.
pub(crate) struct MemoryLimiter {
    memory_bytes: usize,
    table_elements: usize,
    pub(crate) memory_exhausted: bool,
}

impl ResourceLimiter for MemoryLimiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> WasmResult<bool> {
        if desired > self.memory_bytes {
            self.memory_exhausted = true;
            // An error (rather than `Ok(false)`) traps at the grow instruction itself, so a
            // guest allocator cannot turn the failure into a generic abort.
            return Err(MemoryCapExceeded {
                desired,
                limit: self.memory_bytes,
            }
            .into());
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> WasmResult<bool> {
        Ok(desired <= self.table_elements)
    }
}

/// A guest stdout/stderr that keeps the first `cap` bytes and drops the rest, never failing the
/// guest's writes (a chatty guest must not trap because of its console).
#[derive(Clone)]
pub(crate) struct CappedPipe {
    inner: Arc<Mutex<CappedBuf>>,
}

struct CappedBuf {
    bytes: Vec<u8>,
    cap: usize,
    dropped: usize,
}

impl CappedPipe {
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(CappedBuf {
                bytes: Vec::new(),
                cap,
                dropped: 0,
            })),
        }
    }

    fn push(&self, data: &[u8]) {
        let mut buf = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let room = buf.cap.saturating_sub(buf.bytes.len());
        let take = room.min(data.len());
        buf.bytes.extend_from_slice(&data[..take]);
        buf.dropped += data.len() - take;
    }

    /// What the guest wrote, lossily decoded, with a note when output was dropped.
    pub(crate) fn text(&self) -> String {
        let buf = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let mut text = String::from_utf8_lossy(&buf.bytes).trim_end().to_owned();
        if buf.dropped > 0 {
            text.push_str(&format!(
                "\n[{} more bytes of guest output dropped]",
                buf.dropped
            ));
        }
        text
    }
}

impl IsTerminal for CappedPipe {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for CappedPipe {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

impl OutputStream for CappedPipe {
    fn write(&mut self, bytes: bytes::Bytes) -> StreamResult<()> {
        self.push(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(64 << 10)
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for CappedPipe {
    async fn ready(&mut self) {}
}

impl tokio::io::AsyncWrite for CappedPipe {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.push(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Captured log lines of one invocation, capped in bytes.
pub(crate) struct LogBuffer {
    started: Instant,
    cap: usize,
    bytes: usize,
    pub(crate) lines: Vec<LogLine>,
    dropped_lines: u64,
    dropped_bytes: u64,
}

/// What one captured log line counts against the per-invocation cap beyond its message.
const LINE_OVERHEAD: usize = 64;

impl LogBuffer {
    fn new(cap: usize, started: Instant) -> Self {
        Self {
            started,
            cap,
            bytes: 0,
            lines: Vec::new(),
            dropped_lines: 0,
            dropped_bytes: 0,
        }
    }

    pub(crate) fn at_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub(crate) fn push(&mut self, level: LogLevel, mut message: String) {
        // Each line costs its bookkeeping too (a record, its time, its level): counted, or a
        // guest logging empty lines in a loop would never reach the cap while every line
        // still took memory.
        self.bytes = self.bytes.saturating_add(LINE_OVERHEAD.min(self.cap));
        let room = self.cap.saturating_sub(self.bytes);
        if room == 0 {
            self.dropped_lines += 1;
            self.dropped_bytes += message.len() as u64;
            return;
        }
        if message.len() > room {
            let mut cut = room;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            self.dropped_bytes += (message.len() - cut) as u64;
            message.truncate(cut);
            message.push_str(" [truncated]");
        }
        self.bytes += message.len();
        let at_ms = self.at_ms();
        self.lines.push(LogLine {
            level,
            message,
            at_ms,
        });
    }

    /// Lines the cap dropped whole (a line cut short is kept, and not counted).
    pub(crate) fn dropped_lines(&self) -> u64 {
        self.dropped_lines
    }

    /// The captured lines, plus a closing note when the cap dropped some.
    pub(crate) fn finish(mut self) -> Vec<LogLine> {
        if self.dropped_lines > 0 || self.dropped_bytes > 0 {
            let message = format!(
                "[router] log limit of {} bytes per invocation reached: {} more lines ({} bytes) dropped",
                self.cap, self.dropped_lines, self.dropped_bytes
            );
            let at_ms = self.at_ms();
            self.lines.push(LogLine {
                level: LogLevel::Warn,
                message,
                at_ms,
            });
        }
        self.lines
    }
}

/// The key-value view of one invocation: reads go to the router's store through an overlay of
/// this invocation's own writes; writes and compare-and-set preconditions are only recorded.
pub(crate) struct KvSession {
    reader: Arc<dyn KvReader>,
    /// Latest buffered value per key (`None`: deleted), indexing into `writes`.
    overlay: HashMap<String, usize>,
    pub(crate) writes: Vec<KvWrite>,
    pub(crate) cas_checks: Vec<(String, Option<Vec<u8>>)>,
    /// The keys of `cas_checks`.
    cas_keys: HashSet<String>,
    /// Bytes of keys and values written, and of the keys and values compare-and-set checks
    /// keep (both held in memory until commit), against `cap`.
    written_bytes: usize,
    cap: usize,
    /// Most entries of `writes` plus `cas_checks`: what the commit applies one by one.
    max_ops: usize,
    /// Committed size (key plus value, 0 when absent) of each key this invocation wrote.
    committed_sizes: HashMap<String, u64>,
    /// How much the buffered writes grow the namespace (negative: they shrink it).
    growth: i64,
    /// The namespace's room, read at the first growing write (`Some(None)`: unbounded).
    room: Option<Option<u64>>,
}

impl KvSession {
    fn new(reader: Arc<dyn KvReader>, cap: usize, max_ops: usize) -> Self {
        Self {
            reader,
            overlay: HashMap::new(),
            writes: Vec::new(),
            cas_checks: Vec::new(),
            cas_keys: HashSet::new(),
            written_bytes: 0,
            cap,
            max_ops,
            committed_sizes: HashMap::new(),
            growth: 0,
            room: None,
        }
    }

    /// The value as this invocation sees it: its own buffered write, else the committed one.
    fn current(&self, key: &str) -> Result<Option<Vec<u8>>, HostLimitBreach> {
        match self.overlay.get(key) {
            Some(&i) => Ok(self.writes[i].value.clone()),
            None => self.committed(key),
        }
    }

    /// The committed value, from the store.
    fn committed(&self, key: &str) -> Result<Option<Vec<u8>>, HostLimitBreach> {
        self.reader
            .get(key)
            .map_err(|e| HostLimitBreach::Transient(format!("kv read failed: {e}")))
    }

    /// Accounts a write of `key` (to `value`) against the namespace's bound: a write that
    /// grows the namespace past it is refused.
    fn account(&mut self, key: &str, value: Option<&[u8]>) -> Result<(), HostLimitBreach> {
        let size = |v: Option<&[u8]>| v.map_or(0, |v| KvUsage::entry_bytes(key, v));
        let committed = match self.committed_sizes.get(key) {
            Some(&c) => c,
            None => {
                let c = size(self.committed(key)?.as_deref());
                self.committed_sizes.insert(key.to_string(), c);
                c
            }
        };
        let before = match self.overlay.get(key) {
            Some(&i) => size(self.writes[i].value.as_deref()),
            None => committed,
        };
        let after = size(value);
        let growth = self.growth + after as i64 - before as i64;
        if after > before {
            let room = match self.room {
                Some(r) => r,
                None => {
                    let r = self
                        .reader
                        .room()
                        .map_err(|e| HostLimitBreach::Transient(format!("kv read failed: {e}")))?;
                    self.room = Some(r);
                    r
                }
            };
            if let Some(room) = room
                && growth > 0
                && growth as u64 > room
            {
                return Err(HostLimitBreach::Transient(format!(
                    "kv namespace is full: this write needs {} more bytes than its limit allows (handlers.kv_max_bytes)",
                    growth as u64 - room
                )));
            }
        }
        self.growth = growth;
        Ok(())
    }

    fn check_key(key: &str) -> Result<(), HostLimitBreach> {
        if key.len() > MAX_KEY_BYTES {
            return Err(HostLimitBreach::Invocation(format!(
                "kv key of {} bytes is longer than the limit of {MAX_KEY_BYTES}",
                key.len()
            )));
        }
        Ok(())
    }

    /// Refuses one more operation for the commit (a key not written yet, or a compare-and-set
    /// check) past the invocation's cap. The bytes cap alone let tiny entries through by the
    /// hundred thousand, each an operation of the store's single writer: one invocation's
    /// commit then held up every producer's ingest for seconds.
    fn count_op(&self) -> Result<(), HostLimitBreach> {
        if self.writes.len() + self.cas_checks.len() >= self.max_ops {
            return Err(HostLimitBreach::Invocation(format!(
                "kv operations of this invocation exceed the limit of {} (handlers.max_kv_ops: keys written or deleted plus compare-and-set checks, each key counted once)",
                self.max_ops
            )));
        }
        Ok(())
    }

    /// Counts `bytes` more of writes or compare-and-set checks against the invocation's cap.
    fn count(&mut self, bytes: usize) -> Result<(), HostLimitBreach> {
        self.written_bytes = self.written_bytes.saturating_add(bytes);
        if self.written_bytes > self.cap {
            return Err(HostLimitBreach::Invocation(format!(
                "kv writes and compare-and-set checks of this invocation exceed the limit of {} bytes",
                self.cap
            )));
        }
        Ok(())
    }

    fn write(
        &mut self,
        key: String,
        value: Option<Vec<u8>>,
        ttl_ms: Option<u64>,
    ) -> Result<(), HostLimitBreach> {
        Self::check_key(&key)?;
        if !self.overlay.contains_key(&key) {
            self.count_op()?;
        }
        self.account(&key, value.as_deref())?;
        self.count(key.len() + value.as_ref().map_or(0, Vec::len))?;
        match self.overlay.get(&key) {
            Some(&i) => self.writes[i] = KvWrite { key, value, ttl_ms },
            None => {
                self.overlay.insert(key.clone(), self.writes.len());
                self.writes.push(KvWrite { key, value, ttl_ms });
            }
        }
        Ok(())
    }

    fn compare_and_set(
        &mut self,
        key: String,
        expected: Option<Vec<u8>>,
        new: Option<Vec<u8>>,
    ) -> Result<bool, HostLimitBreach> {
        Self::check_key(&key)?;
        let written_here = self.overlay.contains_key(&key);
        let current = self.current(&key)?;
        // The outcome depended on the committed value only when this invocation had not written
        // the key yet: that value is what the router must find unchanged at commit time. Kept
        // until the commit, it counts against the cap like a write (a failing compare-and-set
        // on ever new keys would otherwise grow the invocation's memory without bound).
        if !written_here && !self.cas_keys.contains(&key) {
            self.count_op()?;
            self.count(key.len() + current.as_ref().map_or(0, Vec::len))?;
            self.cas_keys.insert(key.clone());
            self.cas_checks.push((key.clone(), current.clone()));
        }
        if current != expected {
            return Ok(false);
        }
        self.write(key, new, None)?;
        Ok(true)
    }
}

/// Everything one store (one invocation) owns.
pub(crate) struct HostState {
    wasi: WasiCtx,
    table: ResourceTable,
    pub(crate) limiter: MemoryLimiter,
    pub(crate) logs: LogBuffer,
    pub(crate) kv: KvSession,
    pub(crate) console: CappedPipe,
    /// Set when a host call refused to go on (the guest then traps).
    pub(crate) breach: Option<HostLimitBreach>,
    /// The store's hostcall fuel (most bytes one call copies out of the guest), for messages.
    pub(crate) hostcall_fuel: usize,
}

impl HostState {
    /// A fresh state under `limits`; the guest sees an empty environment, no arguments, no
    /// files, no network, and a console that only the host reads.
    pub(crate) fn new(
        limits: &HandlerLimits,
        table_elements: usize,
        kv: Arc<dyn KvReader>,
    ) -> Self {
        let console = CappedPipe::new(limits.max_stderr_bytes);
        let wasi = WasiCtx::builder()
            .stdout(console.clone())
            .stderr(console.clone())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .build();
        Self {
            wasi,
            table: ResourceTable::new(),
            limiter: MemoryLimiter {
                memory_bytes: limits.memory_bytes,
                table_elements,
                memory_exhausted: false,
            },
            logs: LogBuffer::new(limits.max_log_bytes, Instant::now()),
            kv: KvSession::new(kv, limits.max_kv_write_bytes, limits.max_kv_ops),
            console,
            breach: None,
            hostcall_fuel: 0,
        }
    }

    fn breach<T>(&mut self, result: Result<T, HostLimitBreach>) -> WasmResult<T> {
        result.map_err(|e| {
            self.breach = Some(e.clone());
            wasmtime::Error::new(e)
        })
    }
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl types::Host for HostState {}

impl log::Host for HostState {
    fn log(&mut self, level: log::Level, message: String) -> WasmResult<()> {
        let level = match level {
            log::Level::Trace => LogLevel::Trace,
            log::Level::Debug => LogLevel::Debug,
            log::Level::Info => LogLevel::Info,
            log::Level::Warn => LogLevel::Warn,
            log::Level::Error => LogLevel::Error,
        };
        self.logs.push(level, message);
        Ok(())
    }
}

impl kv::Host for HostState {
    fn get(&mut self, key: String) -> WasmResult<Option<Vec<u8>>> {
        let checked = KvSession::check_key(&key);
        self.breach(checked)?;
        let current = self.kv.current(&key);
        self.breach(current)
    }

    fn set(&mut self, key: String, value: Vec<u8>, ttl_ms: Option<u64>) -> WasmResult<()> {
        let result = self.kv.write(key, Some(value), ttl_ms);
        self.breach(result)
    }

    fn delete(&mut self, key: String) -> WasmResult<()> {
        let result = self.kv.write(key, None, None);
        self.breach(result)
    }

    fn compare_and_set(
        &mut self,
        key: String,
        expected: Option<Vec<u8>>,
        new: Option<Vec<u8>>,
    ) -> WasmResult<bool> {
        let result = self.kv.compare_and_set(key, expected, new);
        self.breach(result)
    }
}

/// The linker every handler is instantiated with: our `log` and `kv`, plus WASI p2 (which Rust's
/// standard library imports) backed by the empty context of [`HostState::new`].
pub(crate) fn linker(engine: &wasmtime::Engine) -> WasmResult<Linker<HostState>> {
    let mut linker = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker)?;
    Handler::add_to_linker::<HostState, HasSelf<HostState>>(&mut linker, |s| s)?;
    // A guest waiting on a clock (`std::thread::sleep`, Python's `time.sleep`) would block in
    // the host, where epoch interruption cannot stop it: the invocation would outlive its
    // timeout and hold its slot for as long as it asked. Handlers have nothing to wait for
    // (no network, no files), so subscribing to the clock traps instead.
    linker.allow_shadowing(true);
    {
        let mut clock = linker.instance(MONOTONIC_CLOCK)?;
        for name in ["subscribe-duration", "subscribe-instant"] {
            clock.func_wrap(
                name,
                |_, (_,): (u64,)| -> WasmResult<(Resource<wasmtime_wasi::p2::DynPollable>,)> {
                    Err(wasmtime::Error::msg(NO_WAITING))
                },
            )?;
        }
    }
    linker.allow_shadowing(false);
    Ok(linker)
}

/// The WASI clock interface whose subscriptions [`linker`] replaces (the version
/// wasmtime-wasi implements; components built against older 0.2 versions link to it).
const MONOTONIC_CLOCK: &str = "wasi:clocks/monotonic-clock@0.2.12";

/// The trap of a handler that waits on a clock.
const NO_WAITING: &str = "handlers cannot sleep or wait on a clock (the invocation has a wall-clock budget); ask for a retry with a delay instead";

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed(Vec<(&'static str, &'static [u8])>, Option<u64>);

    impl KvReader for Fixed {
        fn get(&self, key: &str) -> Result<Option<Vec<u8>>, String> {
            Ok(self
                .0
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| v.to_vec()))
        }

        fn room(&self) -> Result<Option<u64>, String> {
            Ok(self.1)
        }
    }

    struct Broken;

    impl KvReader for Broken {
        fn get(&self, _key: &str) -> Result<Option<Vec<u8>>, String> {
            Err("disk on fire".into())
        }
    }

    /// Most operations a session of these tests may buffer (the byte caps are what they test).
    const OPS: usize = 100_000;

    fn session() -> KvSession {
        KvSession::new(Arc::new(Fixed(vec![("a", b"1")], None)), 1 << 10, OPS)
    }

    fn current(kv: &KvSession, key: &str) -> Option<Vec<u8>> {
        kv.current(key).unwrap()
    }

    #[test]
    fn a_bounded_namespace_refuses_growth_past_its_room_but_never_shrinking() {
        // Each entry counts its key, its value and the overhead.
        const O: u64 = KvUsage::ENTRY_OVERHEAD;
        const IO: i64 = O as i64;
        // "a" (key 1 + value 1 + O) is committed; O + 10 more bytes fit.
        let reader = Fixed(vec![("a", b"1")], Some(O + 10));
        let mut kv = KvSession::new(Arc::new(reader), 1 << 10, OPS);
        kv.write("b".into(), Some(vec![0; 8]), None).unwrap(); // +9 + O: 1 left
        let err = kv.write("c".into(), Some(vec![0; 1]), None).unwrap_err(); // +2 + O
        // A full namespace may have room again later: retried, not a breach of the handler's.
        assert!(
            matches!(&err, HostLimitBreach::Transient(m) if m.contains(&format!("needs {} more bytes", O + 1))),
            "{err:?}"
        );
        // Replacing a value counts only the difference; deleting gives room back.
        kv.write("a".into(), Some(vec![0; 2]), None).unwrap(); // +1: exactly full
        kv.write("a".into(), None, None).unwrap(); // -(3 + O)
        kv.write("c".into(), Some(vec![0; 1]), None).unwrap(); // +(2 + O)
        assert_eq!(kv.growth, 9 + IO);
        // A full namespace refuses growth but accepts deletes, whose room then serves.
        let reader = Fixed(vec![("a", b"123")], Some(0));
        let mut full = KvSession::new(Arc::new(reader), 1 << 10, OPS);
        assert!(full.write("b".into(), Some(vec![1]), None).is_err());
        full.write("a".into(), None, None).unwrap();
        full.write("b".into(), Some(vec![1]), None).unwrap();
    }

    /// Empty values on tiny keys cost the store far more than their bytes: each entry
    /// counts the overhead, so they fill a namespace's bound long before their bytes would.
    #[test]
    fn each_entry_counts_its_overhead_against_the_namespace_bound() {
        let room = 10 * (6 + KvUsage::ENTRY_OVERHEAD);
        let mut kv = KvSession::new(Arc::new(Fixed(Vec::new(), Some(room))), 1 << 20, OPS);
        let refused = (0..1_000)
            .map(|i| kv.write(format!("k{i:05}"), Some(Vec::new()), None))
            .position(|r| r.is_err());
        // Six bytes of key each: the eleventh is refused (by its bytes alone, 116 fit).
        assert_eq!(refused, Some(10));
    }

    /// Every key written and every compare-and-set check is one operation of the commit:
    /// past the cap the invocation is refused as a breach of its own (not retried), however
    /// small the entries; rewriting a key already written costs nothing more.
    #[test]
    fn kv_operations_are_capped_per_invocation() {
        let mut kv = KvSession::new(Arc::new(EmptyKv), 1 << 20, 3);
        for _ in 0..10 {
            kv.write("same".into(), Some(vec![1]), None).unwrap();
        }
        kv.write("b".into(), None, None).unwrap();
        assert!(!kv.compare_and_set("c".into(), Some(vec![1]), None).unwrap());
        let err = kv.write("d".into(), Some(Vec::new()), None).unwrap_err();
        assert!(
            matches!(&err, HostLimitBreach::Invocation(m) if m.contains("limit of 3 (handlers.max_kv_ops")),
            "{err:?}"
        );
        assert!(kv.compare_and_set("e".into(), None, None).is_err());
        // Keys already in the invocation's hands are still written.
        kv.write("b".into(), Some(vec![2]), None).unwrap();
        assert_eq!(kv.writes.len() + kv.cas_checks.len(), 3);
    }

    #[test]
    fn a_failed_kv_read_fails_the_call_instead_of_reading_as_absent() {
        let mut kv = KvSession::new(Arc::new(Broken), 1 << 10, OPS);
        assert!(matches!(
            kv.current("a").unwrap_err(),
            HostLimitBreach::Transient(m) if m.contains("disk on fire")
        ));
        assert!(kv.compare_and_set("a".into(), None, Some(vec![1])).is_err());
        assert!(kv.write("a".into(), Some(vec![1]), None).is_err());
    }

    #[test]
    fn reads_see_own_writes_and_writes_collapse_per_key() {
        let mut kv = session();
        assert_eq!(current(&kv, "a").as_deref(), Some(&b"1"[..]));
        kv.write("a".into(), Some(b"2".to_vec()), Some(5)).unwrap();
        kv.write("b".into(), Some(b"x".to_vec()), None).unwrap();
        kv.write("a".into(), None, None).unwrap();
        assert_eq!(current(&kv, "a"), None);
        assert_eq!(kv.writes.len(), 2);
        assert_eq!(
            kv.writes[0],
            KvWrite {
                key: "a".into(),
                value: None,
                ttl_ms: None
            }
        );
    }

    #[test]
    fn compare_and_set_records_the_committed_value_it_depended_on() {
        let mut kv = session();
        assert!(
            !kv.compare_and_set("a".into(), None, Some(b"x".to_vec()))
                .unwrap()
        );
        assert!(
            kv.compare_and_set("a".into(), Some(b"1".to_vec()), Some(b"2".to_vec()))
                .unwrap()
        );
        assert!(
            kv.compare_and_set("a".into(), Some(b"2".to_vec()), Some(b"3".to_vec()))
                .unwrap()
        );
        assert!(
            kv.compare_and_set("n".into(), None, Some(b"1".to_vec()))
                .unwrap()
        );
        assert_eq!(
            kv.cas_checks,
            vec![
                ("a".to_owned(), Some(b"1".to_vec())),
                ("n".to_owned(), None)
            ]
        );
        assert_eq!(current(&kv, "a").as_deref(), Some(&b"3"[..]));
    }

    /// Every compare-and-set that depended on a committed value keeps its key and that value
    /// until the commit: they count against the cap, so failing ones on ever new keys cannot
    /// grow the invocation without bound.
    #[test]
    fn compare_and_set_checks_count_against_the_write_cap() {
        let mut kv = KvSession::new(Arc::new(Fixed(vec![("a", b"0123456789")], None)), 40, OPS);
        // A failing check of "a" keeps 1 + 10 bytes; asking again keeps nothing more.
        assert!(!kv.compare_and_set("a".into(), None, None).unwrap());
        assert!(!kv.compare_and_set("a".into(), None, None).unwrap());
        assert_eq!(kv.written_bytes, 11);
        // Failing checks of new keys (the value expected is not there) keep their keys.
        for key in ["k1", "k2", "k3"] {
            assert!(!kv.compare_and_set(key.into(), Some(vec![1]), None).unwrap());
        }
        assert_eq!((kv.written_bytes, kv.cas_checks.len()), (17, 4));
        // A successful one keeps its check and its write: 2 + 2 + 20 more, over 40.
        let err = kv
            .compare_and_set("k4".into(), None, Some(vec![0; 20]))
            .unwrap_err();
        assert!(
            matches!(&err, HostLimitBreach::Invocation(m) if m.contains("exceed the limit of 40 bytes")),
            "{err:?}"
        );
        let mut flood = KvSession::new(Arc::new(EmptyKv), 1 << 10, OPS);
        let breached = (0..1_000)
            .map(|i| flood.compare_and_set(format!("key-{i:04}"), Some(vec![1]), None))
            .position(|r| r.is_err());
        // Each check keeps 8 bytes of key: the 129th goes over 1 KiB.
        assert_eq!(breached, Some(128));
    }

    #[test]
    fn write_limits_are_enforced() {
        let mut kv = KvSession::new(Arc::new(EmptyKv), 10, OPS);
        assert!(kv.write("k".into(), Some(vec![0; 9]), None).is_ok());
        assert!(kv.write("k".into(), Some(vec![0; 9]), None).is_err());
        assert!(KvSession::check_key(&"k".repeat(MAX_KEY_BYTES + 1)).is_err());
    }

    #[test]
    fn logs_are_capped_with_a_closing_note() {
        // Room for two lines' overhead and ten bytes of messages.
        let mut logs = LogBuffer::new(2 * LINE_OVERHEAD + 10, Instant::now());
        logs.push(LogLevel::Info, "12345".into());
        logs.push(LogLevel::Info, "1234567890".into());
        logs.push(LogLevel::Info, "dropped".into());
        let lines = logs.finish();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[1].message, "12345 [truncated]");
        assert!(
            lines[2].message.contains("1 more lines"),
            "{}",
            lines[2].message
        );
    }

    /// Empty lines cost their bookkeeping: a guest logging "" in a loop reaches the cap.
    #[test]
    fn empty_lines_count_against_the_cap() {
        let mut logs = LogBuffer::new(100 * LINE_OVERHEAD, Instant::now());
        for _ in 0..100_000 {
            logs.push(LogLevel::Info, String::new());
        }
        let lines = logs.finish();
        assert!(lines.len() <= 101, "{} lines kept", lines.len());
    }

    #[test]
    fn console_keeps_the_first_bytes() {
        let pipe = CappedPipe::new(4);
        pipe.push(b"abcdef");
        assert_eq!(pipe.text(), "abcd\n[2 more bytes of guest output dropped]");
    }
}
