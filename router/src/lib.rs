//! The router library: `run(config, listener, shutdown)` and the pipeline's modules.

pub mod event;
pub mod store;
