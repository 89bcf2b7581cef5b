#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set-up, unit tests, end-to-end tests against the
# real binary. CI (.ci/run) calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
# The example WASM handlers (adds the wasm32-wasip2 target and componentize-py when missing).
bash plugins/build.sh
# A nats-server 2.12+ for the JetStream store backend's tests (the machine's 2.9 is too old);
# the tests start private servers from it (scripts/nats-server.sh, unpacked into target/).
# Not a ROUTER_* variable: the router reads every one of those as a config key.
JETSTREAM_TEST_SERVER=$(bash scripts/nats-server.sh)
export JETSTREAM_TEST_SERVER
# Formatting and lints are part of the suite.
cargo fmt --all -- --check
# Clippy's lints (`cargo clippy --workspace --all-targets -- -D warnings`) applied while the
# test build compiles the workspace's crates: clippy-driver is rustc with the lints added, and
# as the workspace wrapper it leaves the dependencies to plain rustc. `cargo clippy` would
# check every dependency a second time in its own mode (wasmtime and cranelift: 4.5 minutes of
# a cold CI run); this way they are built once. Exported for the whole run: every cargo test
# below then reuses the same build (plugins/build.sh builds its own workspace without it).
export RUSTC_WORKSPACE_WRAPPER=clippy-driver
export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
cargo test --locked --workspace --all-targets --no-run
# The end-to-end tests mostly wait on routers, receivers and timers (about 45 % of two cores
# busy with libtest's default of one thread per core): six at a time finish the suite in
# about 40 % of the time. Every test's timing bound allows for it (checked by repeated runs).
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-6}"
log=$(mktemp)
cargo test --locked --workspace 2>&1 | tee "$log"
# The router binary `cargo test` built for the end-to-end tests. Not `cargo run -p router`:
# without the dev-dependencies, cargo resolves other features for wasmtime, cranelift, reqwest
# and serde and builds them all a second time (4 minutes here, more on a cold CI machine).
BIN="${CARGO_TARGET_DIR:-target}/debug/router"
# Example configuration in the repo must always pass its own checks.
# The example rules name only handlers of plugins/ (built into target/plugins above).
"$BIN" rules check examples/rules --handlers target/plugins
"$BIN" contracts check schemas/contracts
# The durability scenarios (kill -9 under load, retries and leases across a restart, repeated
# kills under mixed load) once more with the opt-in group log (`store.group_log`), the store's
# other durable write path.
ROUTER_STORE__GROUP_LOG=true cargo test --locked -p router --test e2e -- durability:: chaos:: \
  2>&1 | tee -a "$log"
# The whole end-to-end suite once more with every router on the NATS JetStream store backend
# (SPEC: same tests, both backends), against a private nats-server 2.15. Skipped there: the
# embedded store's file compaction, and a NATS-target test that asserts the router never opens
# a NATS connection (the store is one).
bash scripts/jetstream-e2e.sh -- --skip a_compaction_under_ingest_answers_503 \
  --skip a_router_without_nats_targets_never_connects \
  2>&1 | tee -a "$log"
# Property-based API fuzz against the OpenAPI document (schemathesis from PyPI, installed into
# target/ on first use): no 5xx, every answer conforms. The debug binary `cargo test` built.
API_FUZZ_BIN="$BIN" bash scripts/api-fuzz.sh "${API_FUZZ_EXAMPLES:-25}"
# One closing line for the whole run (cargo prints one "test result" line per test binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i) ~ /^passed;?$/) p += $(i-1); if ($(i) ~ /^failed;?$/) f += $(i-1) } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
