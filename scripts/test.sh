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
cargo clippy --locked --workspace --all-targets -- -D warnings
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
