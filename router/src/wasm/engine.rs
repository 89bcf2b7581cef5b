//! The one wasmtime engine all handlers share: pooling allocator, epoch interruption driven by a
//! background ticker thread, and the linker handlers are checked and instantiated against.
//! (Compiled code is kept on disk by the handler registry, checked before each load: see
//! [`artifact`](super::artifact).)

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thiserror::Error;
use wasmtime::component::Linker;
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use super::bindings::{self, HostState};
use super::limits::{HandlerLimits, LimitsError};

/// Instances the pool keeps for `describe` beyond [`EngineConfig::max_instances`]: uploads,
/// rollbacks and preloads call it, and their requests do not hold one of the invocations'
/// slots (`handlers.max_instances`). Without its own share of the pool, a `describe` (which
/// goes on after its upload's client has gone) could take the instance an invocation holds a
/// slot for, and that healthy invocation would fail.
pub const DESCRIBE_INSTANCES: u32 = 2;

/// How long a `describe` waits for one of the [`DESCRIBE_INSTANCES`] before it gives up as
/// busy: about two describes' default timeout, so a queue of a few uploads gets through.
const DESCRIBE_SLOT_WAIT: Duration = Duration::from_secs(10);

/// Sizing of the shared engine. The defaults suit a small machine (2 cores): at most 64 handler
/// instances alive at once, each memory capped at 64 MiB.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Most component instances of invocations alive at once (one per running invocation;
    /// the handler target holds as many slots). The pool holds [`DESCRIBE_INSTANCES`] more,
    /// which only `describe` uses. Default 64.
    pub max_instances: u32,
    /// Pool slot size per linear memory: the upper bound for [`HandlerLimits::memory_bytes`].
    /// Default 64 MiB.
    pub max_memory_bytes: usize,
    /// Most core instances one component may contain (a Python component links ~10). Default 32.
    pub max_core_instances_per_component: u32,
    /// Most elements of one table (function tables of interpreters are large). Default 100,000.
    pub table_elements: usize,
    /// Guest call-stack budget (a deep recursion traps as a stack overflow past it). Default
    /// 512 KiB. Invocations run on the calling thread's stack, which must be larger.
    pub max_wasm_stack: usize,
    /// How often the epoch advances: the granularity of timeouts. Default 10 ms.
    pub epoch_tick: Duration,
    /// Turn on fuel metering so [`HandlerLimits::fuel`] can be used (costs some speed).
    pub fuel: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_instances: 64,
            max_memory_bytes: 64 << 20,
            max_core_instances_per_component: 32,
            table_elements: 100_000,
            max_wasm_stack: 512 << 10,
            epoch_tick: Duration::from_millis(10),
            fuel: false,
        }
    }
}

/// Failure to build the engine.
#[derive(Debug, Error)]
pub enum EngineError {
    /// Wasmtime refused the configuration.
    #[error("cannot configure the wasm engine: {0}")]
    Config(String),
    /// The epoch ticker thread could not start.
    #[error("cannot start the epoch ticker thread: {0}")]
    Ticker(#[source] std::io::Error),
}

/// The shared engine, its linker and its epoch ticker. The ticker stops when this is dropped.
pub struct WasmEngine {
    engine: Engine,
    linker: Linker<HostState>,
    config: EngineConfig,
    describe_slots: DescribeSlots,
    ticker: Option<Ticker>,
}

impl std::fmt::Debug for WasmEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmEngine")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl WasmEngine {
    /// Builds the engine and starts its epoch ticker.
    pub fn new(config: EngineConfig) -> Result<Arc<Self>, EngineError> {
        let cfg_err = |e: wasmtime::Error| EngineError::Config(format!("{e:#}"));
        let instances = config
            .max_instances
            .max(1)
            .saturating_add(DESCRIBE_INSTANCES);
        let mut pool = PoolingAllocationConfig::new();
        pool.total_component_instances(instances)
            .total_core_instances(instances.saturating_mul(config.max_core_instances_per_component))
            .max_core_instances_per_component(config.max_core_instances_per_component)
            .total_memories(instances.saturating_mul(2))
            .max_memories_per_component(2)
            .total_tables(instances.saturating_mul(4))
            .max_tables_per_component(4)
            .table_elements(config.table_elements)
            .max_memory_size(config.max_memory_bytes)
            .total_stacks(0)
            // Keep the first pages of a reused memory slot mapped: re-instantiation then costs
            // a memset instead of page faults.
            .linear_memory_keep_resident(256 << 10)
            .table_keep_resident(64 << 10);

        let mut wasm = Config::new();
        wasm.allocation_strategy(InstanceAllocationStrategy::Pooling(pool))
            .epoch_interruption(true)
            .consume_fuel(config.fuel)
            .max_wasm_stack(config.max_wasm_stack);
        let engine = Engine::new(&wasm).map_err(cfg_err)?;
        let linker = bindings::linker(&engine).map_err(cfg_err)?;
        let ticker =
            Ticker::start(engine.clone(), config.epoch_tick).map_err(EngineError::Ticker)?;
        Ok(Arc::new(Self {
            engine,
            linker,
            config,
            describe_slots: DescribeSlots::new(DESCRIBE_INSTANCES),
            ticker: Some(ticker),
        }))
    }

    /// The wasmtime engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The configuration this engine was built with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub(crate) fn linker(&self) -> &Linker<HostState> {
        &self.linker
    }

    /// One of the pool's [`DESCRIBE_INSTANCES`], held until the guard drops; `None` when none
    /// came free within a few seconds (other uploads are describing).
    pub(crate) fn describe_slot(&self) -> Option<DescribeSlot<'_>> {
        self.describe_slots.acquire(DESCRIBE_SLOT_WAIT)
    }

    /// Checks that `limits` can be enforced by this engine.
    pub fn check_limits(&self, limits: &HandlerLimits) -> Result<(), LimitsError> {
        limits.validate(self.config.max_memory_bytes, self.config.fuel)
    }

    /// Epoch ticks that make up `timeout` (at least one).
    pub(crate) fn deadline_ticks(&self, timeout: Duration) -> u64 {
        let tick = self.config.epoch_tick.as_nanos().max(1);
        u64::try_from(timeout.as_nanos().div_ceil(tick))
            .unwrap_or(u64::MAX)
            .max(1)
    }
}

impl Drop for WasmEngine {
    fn drop(&mut self) {
        if let Some(ticker) = self.ticker.take() {
            ticker.stop();
        }
    }
}

/// The pool's instances kept for `describe`: a counting semaphore that blocking code (where
/// `describe` runs) can wait on with a bound.
struct DescribeSlots {
    free: Mutex<u32>,
    freed: Condvar,
}

impl DescribeSlots {
    fn new(n: u32) -> Self {
        Self {
            free: Mutex::new(n),
            freed: Condvar::new(),
        }
    }

    fn acquire(&self, wait: Duration) -> Option<DescribeSlot<'_>> {
        let until = Instant::now() + wait;
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        while *free == 0 {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            free = self
                .freed
                .wait_timeout(free, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        *free -= 1;
        Some(DescribeSlot { slots: self })
    }
}

/// A held describe instance; given back on drop.
pub(crate) struct DescribeSlot<'a> {
    slots: &'a DescribeSlots,
}

impl Drop for DescribeSlot<'_> {
    fn drop(&mut self) {
        *self
            .slots
            .free
            .lock()
            .unwrap_or_else(PoisonError::into_inner) += 1;
        self.slots.freed.notify_one();
    }
}

/// Background thread advancing the engine's epoch every tick; stopping it is dropping the sender.
struct Ticker {
    stop: mpsc::Sender<()>,
    handle: JoinHandle<()>,
}

impl Ticker {
    fn start(engine: Engine, tick: Duration) -> std::io::Result<Self> {
        let (stop, stopped) = mpsc::channel::<()>();
        let tick = tick.max(Duration::from_millis(1));
        let handle = std::thread::Builder::new()
            .name("wasm-epoch-ticker".into())
            .spawn(move || {
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(tick) {
                    engine.increment_epoch();
                }
            })?;
        Ok(Self { stop, handle })
    }

    fn stop(self) {
        drop(self.stop);
        // The thread only sleeps and increments a counter: it cannot panic in a way worth
        // reporting, and a failed join must not turn a drop into a panic.
        let _ = self.handle.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticker_advances_and_stops_on_drop() {
        let engine = WasmEngine::new(EngineConfig::default()).unwrap();
        assert_eq!(engine.deadline_ticks(Duration::from_secs(5)), 500);
        assert_eq!(engine.deadline_ticks(Duration::from_millis(1)), 1);
        let weak = Arc::downgrade(&engine);
        drop(engine);
        assert!(weak.upgrade().is_none());
    }

    #[test]
    fn describe_slots_are_bounded_and_given_back() {
        let slots = DescribeSlots::new(2);
        let a = slots.acquire(Duration::ZERO).unwrap();
        let _b = slots.acquire(Duration::ZERO).unwrap();
        assert!(slots.acquire(Duration::from_millis(20)).is_none());
        std::thread::scope(|s| {
            let waiter = s.spawn(|| slots.acquire(Duration::from_secs(30)).is_some());
            std::thread::sleep(Duration::from_millis(20));
            drop(a);
            assert!(waiter.join().unwrap());
        });
    }

    /// The configuration's bound on `handlers.max_instances` is one the pool can reserve,
    /// with the largest memory cap (20,000 instances failed: the mmap of their memories did
    /// not fit in the address space).
    #[test]
    fn the_largest_configurable_pool_can_be_reserved() {
        let engine = WasmEngine::new(EngineConfig {
            max_instances: crate::config::MAX_HANDLER_INSTANCES,
            max_memory_bytes: usize::try_from(super::super::limits::MAX_MEMORY_BYTES)
                .expect("64-bit host"),
            ..EngineConfig::default()
        });
        assert!(engine.is_ok(), "{:?}", engine.err());
    }

    #[test]
    fn limits_are_checked_against_the_pool() {
        let engine = WasmEngine::new(EngineConfig {
            max_memory_bytes: 16 << 20,
            ..EngineConfig::default()
        })
        .unwrap();
        assert!(engine.check_limits(&HandlerLimits::default()).is_err());
        let small = HandlerLimits {
            memory_bytes: 16 << 20,
            ..HandlerLimits::default()
        };
        assert!(engine.check_limits(&small).is_ok());
    }
}
