#!/usr/bin/env bash
# Runs the router on its embedded default: redb in ./data, 127.0.0.1:8080, the example rules
# and contracts of this repository. Extra arguments are passed to `router serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
# The example WASM handlers, preloaded at start (teams upload theirs with PUT /v1/handlers/NAME).
bash plugins/build.sh
export ROUTER_HANDLERS__PRELOAD_DIR="$PWD/target/plugins"
exec cargo run --release --locked -p router -- serve \
  --data-dir ./data --rules examples/rules --contracts schemas/contracts "$@"
