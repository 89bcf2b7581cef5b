//! The wasmtime host for WASM handlers: one shared engine ([`engine`]), per-invocation limits
//! ([`limits`]), the `router:handler` world's host side ([`bindings`]), uploaded handlers and
//! their versions ([`registry`]), running one delivery through a handler ([`invoke`]), and the
//! handlers' own logs, kept on disk for their teams ([`logs`]).

pub mod bindings;
pub mod engine;
pub mod invoke;
pub mod limits;
pub mod logs;
pub mod registry;

#[cfg(test)]
mod tests;

pub use bindings::{EmptyKv, KvReader, KvWrite, LogLevel, LogLine};
pub use engine::{EngineConfig, EngineError, WasmEngine};
pub use invoke::{DeliveryInfo, Invocation, InvocationOutcome, invoke};
pub use limits::{HandlerLimits, LimitsError};
pub use logs::{HandlerLogs, LogQuery, LogRecord};
pub use registry::{
    AcceptedType, HandlerDescriptor, HandlerInfo, HandlerRegistry, LoadedHandler, RegistryError,
    UploadError, VersionInfo, valid_handler_name,
};
