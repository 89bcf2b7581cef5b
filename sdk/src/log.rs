//! Logging into the handler's log, which the router captures per invocation (size-capped) and
//! keeps for the handler's team to read with the event id and attempt.
//!
//! ```
//! use router_sdk::log;
//!
//! log::info!("charging order {}", "A-17");
//! log::log(log::Level::Warn, "card expires soon");
//! ```

/// Severity of a log line.
///
/// ```
/// assert!(router_sdk::log::Level::Error > router_sdk::log::Level::Info);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Very detailed tracing.
    Trace,
    /// Debugging detail.
    Debug,
    /// Normal operation.
    Info,
    /// Something unexpected that the handler coped with.
    Warn,
    /// Something failed.
    Error,
}

/// Writes one log line at `level`.
///
/// ```
/// router_sdk::log::log(router_sdk::log::Level::Debug, "cache miss");
/// ```
pub fn log(level: Level, message: &str) {
    #[cfg(target_arch = "wasm32")]
    crate::guest::log(level, message);
    #[cfg(not(target_arch = "wasm32"))]
    crate::native::log(level, message);
}

/// Logs a `format!`-style message at trace level.
///
/// ```
/// router_sdk::log::trace!("step {}", 1);
/// ```
#[macro_export]
#[doc(hidden)]
macro_rules! __router_sdk_trace {
    ($($arg:tt)+) => { $crate::log::log($crate::log::Level::Trace, &::std::format!($($arg)+)) };
}

/// Logs a `format!`-style message at debug level.
#[macro_export]
#[doc(hidden)]
macro_rules! __router_sdk_debug {
    ($($arg:tt)+) => { $crate::log::log($crate::log::Level::Debug, &::std::format!($($arg)+)) };
}

/// Logs a `format!`-style message at info level.
#[macro_export]
#[doc(hidden)]
macro_rules! __router_sdk_info {
    ($($arg:tt)+) => { $crate::log::log($crate::log::Level::Info, &::std::format!($($arg)+)) };
}

/// Logs a `format!`-style message at warn level.
#[macro_export]
#[doc(hidden)]
macro_rules! __router_sdk_warn {
    ($($arg:tt)+) => { $crate::log::log($crate::log::Level::Warn, &::std::format!($($arg)+)) };
}

/// Logs a `format!`-style message at error level.
#[macro_export]
#[doc(hidden)]
macro_rules! __router_sdk_error {
    ($($arg:tt)+) => { $crate::log::log($crate::log::Level::Error, &::std::format!($($arg)+)) };
}

/// Logs a `format!`-style message at trace level.
///
/// ```
/// router_sdk::log::trace!("entering {}", "handle");
/// ```
#[doc(inline)]
pub use crate::__router_sdk_trace as trace;

/// Logs a `format!`-style message at debug level.
///
/// ```
/// router_sdk::log::debug!("payload has {} keys", 3);
/// ```
#[doc(inline)]
pub use crate::__router_sdk_debug as debug;

/// Logs a `format!`-style message at info level.
///
/// ```
/// router_sdk::log::info!("invoice {} created", 42);
/// ```
#[doc(inline)]
pub use crate::__router_sdk_info as info;

/// Logs a `format!`-style message at warn level.
///
/// ```
/// router_sdk::log::warn!("retrying after {} ms", 100);
/// ```
#[doc(inline)]
pub use crate::__router_sdk_warn as warn;

/// Logs a `format!`-style message at error level.
///
/// ```
/// router_sdk::log::error!("ledger refused: {}", "insufficient funds");
/// ```
#[doc(inline)]
pub use crate::__router_sdk_error as error;
