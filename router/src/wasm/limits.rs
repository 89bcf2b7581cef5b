//! Per-invocation sandbox limits for WASM handlers: memory, wall-clock time, fuel and the size of
//! what a handler may hand back (emissions, logs, key-value writes, console output).

use std::time::Duration;

use thiserror::Error;

/// The largest memory cap a handler may have (`handlers.memory_bytes`), 4 GiB: what the
/// engine's pooling allocator reserves per linear memory on a 64-bit host (wasmtime's
/// `memory_reservation`), and the most a 32-bit wasm memory can address anyway. A larger cap
/// makes the engine refuse to start, and with it every handler target waits.
pub const MAX_MEMORY_BYTES: u64 = 1 << 32;

/// What one handler invocation may use. Every breach costs that invocation only: the store is
/// dropped and the outcome says which limit was hit.
///
/// What one call copies out of the guest (the `handle` result, a log line, a key-value write)
/// is bounded too, before the copy: by about the largest of what the output, key-value and log
/// limits allow, plus 256 KiB (`invoke::hostcall_fuel`). A call over it is a breach, as the
/// output limits are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerLimits {
    /// Cap on the guest's linear memory (each memory of the component). Default 64 MiB; must not
    /// exceed the engine's per-memory pool size.
    pub memory_bytes: usize,
    /// Wall-clock budget, enforced by epoch interruption (granularity: the engine's tick).
    /// Default 5 s.
    pub timeout: Duration,
    /// Optional instruction budget (needs an engine built with fuel metering). Default none.
    pub fuel: Option<u64>,
    /// Most events one invocation may emit. Default 100.
    pub max_emitted: usize,
    /// Most bytes of emitted events (type, subject, datacontenttype, data, extension names and
    /// values, summed over the emissions). Default 1 MiB.
    pub max_output_bytes: usize,
    /// Log bytes kept per invocation; later lines are dropped and counted. Default 64 KiB.
    pub max_log_bytes: usize,
    /// Bytes of key-value writes (keys and values) per invocation, and of the key and
    /// committed value each compare-and-set depended on (kept until the commit re-checks
    /// them). Default 1 MiB.
    pub max_kv_write_bytes: usize,
    /// Key-value operations per invocation: keys written or deleted (each key once, however
    /// often it is rewritten) plus compare-and-set checks, each one operation of the commit
    /// that acks the delivery (on the store's single writer, which every producer's ingest
    /// shares). Default 1,000.
    pub max_kv_ops: usize,
    /// Bytes of the guest's stdout/stderr kept per invocation (panic messages land there).
    /// Default 16 KiB.
    pub max_stderr_bytes: usize,
}

impl Default for HandlerLimits {
    fn default() -> Self {
        Self {
            memory_bytes: 64 << 20,
            timeout: Duration::from_secs(5),
            fuel: None,
            max_emitted: 100,
            max_output_bytes: 1 << 20,
            max_log_bytes: 64 << 10,
            max_kv_write_bytes: 1 << 20,
            max_kv_ops: 1_000,
            max_stderr_bytes: 16 << 10,
        }
    }
}

/// A [`HandlerLimits`] that the engine cannot enforce.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum LimitsError {
    /// The memory cap is larger than what the engine's instance pool reserves per memory.
    #[error(
        "memory limit {requested} bytes exceeds the engine's per-instance maximum of {max} bytes"
    )]
    MemoryAboveEngineMax {
        /// The limit asked for.
        requested: usize,
        /// The engine's pool size per memory.
        max: usize,
    },
    /// The memory cap is too small to start any component.
    #[error("memory limit {0} bytes is below the minimum of one 64 KiB page")]
    MemoryTooSmall(usize),
    /// A zero timeout would fail every invocation.
    #[error("timeout must be greater than zero")]
    ZeroTimeout,
    /// Fuel was asked for but the engine was built without fuel metering.
    #[error("a fuel limit needs an engine with fuel metering enabled")]
    FuelNotEnabled,
}

impl HandlerLimits {
    /// Checks these limits against an engine's fixed capacities (`max_memory_bytes` per memory,
    /// whether fuel metering is on).
    pub fn validate(&self, max_memory_bytes: usize, fuel_enabled: bool) -> Result<(), LimitsError> {
        if self.memory_bytes > max_memory_bytes {
            return Err(LimitsError::MemoryAboveEngineMax {
                requested: self.memory_bytes,
                max: max_memory_bytes,
            });
        }
        if self.memory_bytes < 64 << 10 {
            return Err(LimitsError::MemoryTooSmall(self.memory_bytes));
        }
        if self.timeout.is_zero() {
            return Err(LimitsError::ZeroTimeout);
        }
        if self.fuel.is_some() && !fuel_enabled {
            return Err(LimitsError::FuelNotEnabled);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_documented_values() {
        let l = HandlerLimits::default();
        assert_eq!(l.memory_bytes, 64 << 20);
        assert_eq!(l.timeout, Duration::from_secs(5));
        assert_eq!(
            (l.max_emitted, l.max_output_bytes, l.max_log_bytes),
            (100, 1 << 20, 64 << 10)
        );
        assert_eq!(l.validate(64 << 20, false), Ok(()));
    }

    #[test]
    fn validation_rejects_what_the_engine_cannot_enforce() {
        let l = HandlerLimits::default();
        assert!(matches!(
            l.validate(1 << 20, false),
            Err(LimitsError::MemoryAboveEngineMax { .. })
        ));
        let fuel = HandlerLimits {
            fuel: Some(1),
            ..HandlerLimits::default()
        };
        assert_eq!(
            fuel.validate(64 << 20, false),
            Err(LimitsError::FuelNotEnabled)
        );
        assert_eq!(fuel.validate(64 << 20, true), Ok(()));
        let zero = HandlerLimits {
            timeout: Duration::ZERO,
            ..HandlerLimits::default()
        };
        assert_eq!(
            zero.validate(64 << 20, false),
            Err(LimitsError::ZeroTimeout)
        );
    }
}
