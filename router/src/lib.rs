//! The router library. `app::run(config, listener, shutdown)` runs the whole router, so tests
//! can hand in their own listener (and `app::run_with_store` their own store).
//!
//! The pipeline, readable from the modules: `ingest` (HTTP, envelope) → `contract` (JSON
//! Schema) → `rules` (match) → `store` (durable accept + fan-out) → `deliver` (workers under
//! `policy`) → `target` (webhook, ...), with `admin` for operators.

pub mod admin;
pub mod app;
pub mod auth;
pub mod bench;
mod blocking;
pub mod cli;
pub mod clock;
pub mod config;
pub mod contract;
pub mod deliver;
pub mod dlq;
pub mod event;
pub mod failpoint;
pub mod guard;
pub mod ingest;
pub mod nats_auth;
pub mod policy;
pub mod rules;
pub mod store;
pub mod system_events;
pub mod target;
pub mod telemetry;
mod text_pos;
pub mod wasm;
