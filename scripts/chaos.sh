#!/usr/bin/env bash
# Repeated kill -9 under mixed load, for longer than the suite runs it: the e2e test
# `chaos::repeated_kill_9_under_mixed_load_loses_and_reorders_nothing` with many cycles, on
# the debug build the suite uses (a release build of the tests would compile everything once
# more). Prints each run's seed; CHAOS_SEED=<seed> replays a run's kill times.
# Usage: scripts/chaos.sh [CYCLES=40] [RUNS=1]
#   env ROUTER_STORE__GROUP_LOG=true: the same on the group log.
set -euo pipefail
cd "$(dirname "$0")/.."
cycles=${1:-40}
runs=${2:-1}
bash plugins/build.sh >/dev/null
for run in $(seq 1 "$runs"); do
  echo "chaos run $run of $runs: $cycles cycles"
  CHAOS_CYCLES=$cycles cargo test --locked -p router --test e2e -- \
    chaos:: --nocapture 2>&1 | grep -E "^chaos|^cycle|panicked|test result|FAILED|missing|half-routed"
done
