#!/usr/bin/env bash
# Runs the router on its embedded default: redb in ./data, 127.0.0.1:8080, the example rules
# and contracts of this repository. Extra arguments are passed to `router serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo run --release --locked -p router -- serve \
  --data-dir ./data --rules examples/rules --contracts schemas/contracts "$@"
