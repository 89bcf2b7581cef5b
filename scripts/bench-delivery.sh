#!/usr/bin/env bash
# Delivery throughput to a fast local webhook, with no policy versus with every policy
# configured (breaker, throttle at a rate it never reaches, retry budget, concurrency limit,
# per-key ordering over many keys), in the same run. N events are queued on a paused target,
# then it is resumed and the time to deliver them all is measured. Last, the webhook as a
# batching one (`batch: { max_events: 100 }`).
# Usage: [BIN=path/to/router] [N_BATCH=N] [ONLY=batch] scripts/bench-delivery.sh [N=20000]
# N_BATCH sets the batching run's event count (it drains in well under a second at 60,000,
# where the 0.2 s poll is a coarse clock); ONLY=batch runs only that one.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-20000}
# shellcheck source=scripts/bench-rules.sh
source scripts/bench-rules.sh
bench_setup
$BIN bench sink --listen 127.0.0.1:19995 2>/dev/null &
run() {
  local name=$1 policy=$2 N=${4:-$N}
  rm -rf "$WORK/data" "$WORK/rules"; mkdir -p "$WORK/rules"
  printf '%s\nrules:\n  - name: b\n    pattern: { type: [bench.event] }\n    targets:\n      - webhook: http://127.0.0.1:19995/hook\n        id: t\n        %s\n' \
    "$3" "$policy" > "$WORK/rules/r.yaml"
  RUST_LOG=warn $BIN serve --listen 127.0.0.1:18095 --data-dir "$WORK/data" --rules "$WORK/rules" --contracts "$WORK/none" 2>>"$WORK/log" &
  local pid=$!
  sleep 1
  curl -s -XPOST 127.0.0.1:18095/v1/targets/t/pause > /dev/null
  $BIN bench ingest --url http://127.0.0.1:18095/v1/events --events "$N" --concurrency 32 --batch 100 --size 1024 > /dev/null
  local start; start=$(date +%s.%N)
  curl -s -XPOST 127.0.0.1:18095/v1/targets/t/resume > /dev/null
  while :; do
    local d; d=$(curl -s 127.0.0.1:18095/v1/targets/t | sed -E 's/.*"delivered":([0-9]+).*/\1/')
    [ "$d" -ge "$N" ] && break
    sleep 0.2
  done
  local end; end=$(date +%s.%N)
  awk -v n="$N" -v s="$start" -v e="$end" -v name="$name" 'BEGIN { printf "%-14s %8d events in %6.2f s = %8.0f delivered/s\n", name, n, e - s, n / (e - s) }'
  kill $pid; wait $pid 2>/dev/null || true
}
ALL='policies:
  all:
    timeout: 5s
    retry: { max_attempts: 5, base_delay: 100ms, max_delay: 5s }
    breaker: { failure_rate: 0.5, min_requests: 20, window: 30s, open_for: 30s }
    throttle: { rate_per_sec: 1000000, burst: 100000, max_concurrency: 32 }
    retry_budget: 0.1
    ordering: $.data.order_id'
if [ "${ONLY:-}" != batch ]; then
  run "no policy" "" ""
  run "all policies" "policy: all" "$ALL"
fi
# The same webhook taking CloudEvents batches (one request per up to 100 due events), with a
# queue deep enough for N_BATCH.
run "batches of 100" "policy: deep
        batch: { max_events: 100 }" 'policies:
  deep:
    max_queue_depth: 10000000' "${N_BATCH:-$N}"
