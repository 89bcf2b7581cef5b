//! End-to-end tests: the real `router` binary, real HTTP receivers, temp data dirs.

mod batch;
mod bench;
mod chaos;
mod cli;
mod cluster;
mod delivery;
mod dlq_ops;
mod durability;
mod handlers;
mod harness;
mod ingest;
mod nats;
mod openapi;
mod paging;
mod policies;
mod reload;
mod security;
mod store_auth;
