//! The wasmtime host for WASM handlers: one shared engine ([`engine`]), per-invocation limits
//! ([`limits`]), the `router:handler` world's host side ([`bindings`]), uploaded handlers and
//! their versions ([`registry`]) with their checked compiled code ([`artifact`]) and how the nodes sharing a store share them ([`catalog`]), running one delivery through a handler ([`invoke`]), and the
//! handlers' own logs, kept on disk for their teams ([`logs`]).

pub(crate) mod artifact;
pub mod bindings;
pub mod catalog;
pub mod engine;
pub mod invoke;
pub mod limits;
pub mod logs;
pub mod registry;

#[cfg(test)]
pub(crate) mod tests;

pub use bindings::{EmptyKv, KvReader, KvWrite, LogLevel, LogLine};
pub use catalog::{CatalogStatus, HandlerChanges, HandlerData, ReleasedQueues, SyncReport};
pub use engine::{EngineConfig, EngineError, WasmEngine};
pub use invoke::{DeliveryInfo, Invocation, InvocationOutcome, invoke};
pub use limits::{HandlerLimits, LimitsError};
pub use logs::{HandlerLogs, LogQuery, LogRecord};
pub use registry::{
    AcceptedType, Deletion, HandlerDescriptor, HandlerInfo, HandlerRegistry, HandlerState,
    LoadedHandler, NotLoaded, OwnedByAnotherTeam, RegistryError, UploadError, Uploader, Validated,
    VersionInfo, valid_handler_name,
};

/// The components in a directory of handlers (`handlers.preload_dir`, or what `router rules
/// check --handlers` is given): every `*.wasm` file, named by its file stem, which is the
/// handler name it is preloaded as. Unreadable entries are skipped.
pub fn component_files(
    dir: &std::path::Path,
) -> std::io::Result<Vec<(String, std::path::PathBuf)>> {
    Ok(std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter_map(|path| {
            let name = path
                .extension()
                .filter(|x| *x == "wasm")
                .and(path.file_stem())
                .and_then(|s| s.to_str())?
                .to_string();
            Some((name, path))
        })
        .collect())
}
