#!/usr/bin/env bash
# Delivered throughput to the no-op WASM handler, alone and next to a hostile handler stuck in
# infinite loops (each invocation runs until its wall-clock timeout, is classified
# handler_timeout and retried, so the hostile load lasts the whole measurement), in the same
# run: the healthy handler's throughput with and without the hostile load, and with the hostile
# target throttled by its policy (max_concurrency) as an operator would.
# N no-op events are queued on a paused target, then it is resumed and the time to deliver
# them all is measured.
# Usage: [BIN=path/to/router] [ALONE=1] scripts/bench-handlers.sh [N=20000] [HOSTILE_EVENTS=64]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-20000}
H=${2:-64}
bash plugins/build.sh >/dev/null
# shellcheck source=scripts/bench-rules.sh
source scripts/bench-rules.sh
bench_setup
PORT=18096
API=http://127.0.0.1:$PORT
mkdir -p "$WORK/preload"
cp target/plugins/noop.wasm target/plugins/hostile.wasm "$WORK/preload/"

delivered() { curl -s "$API/v1/targets/$1" | sed -E 's/.*"delivered":([0-9]+).*/\1/'; }
attempts() { curl -s "$API/metrics" | awk -v t="target=\"$1\"" 'index($0, "router_deliveries_total{") == 1 && index($0, t) { s += $NF } END { print s + 0 }'; }

run() {
  local name=$1 hostile=$2 throttle=$3
  rm -rf "$WORK/data" "$WORK/rules"; mkdir -p "$WORK/rules"
  cat > "$WORK/rules/r.yaml" <<YAML
policies:
  hostile:
    timeout: 30s
    retry: { max_attempts: 1000000, base_delay: 10ms, max_delay: 10ms, max_age: 1h }
    $throttle
rules:
  - name: b
    pattern: { type: [bench.event] }
    targets:
      - handler: noop
        id: noop
  - name: h
    pattern: { type: [hostile] }
    targets:
      - handler: hostile
        id: hostile
        policy: hostile
YAML
  RUST_LOG=error ROUTER_HANDLERS__PRELOAD_DIR="$WORK/preload" ROUTER_HANDLERS__TIMEOUT=500ms \
    $BIN serve --listen 127.0.0.1:$PORT --data-dir "$WORK/data" --rules "$WORK/rules" --contracts "$WORK/none" 2>>"$WORK/log" &
  local pid=$!
  for _ in $(seq 100); do curl -sf "$API/readyz" >/dev/null && break; sleep 0.1; done
  curl -s -XPOST "$API/v1/targets/noop/pause" > /dev/null
  $BIN bench ingest --url "$API/v1/events" --events "$N" --concurrency 32 --batch 100 --size 1024 > /dev/null
  if [ "$hostile" = yes ]; then
    local batch="["
    for i in $(seq "$H"); do
      batch+="{\"specversion\":\"1.0\",\"id\":\"h$i\",\"source\":\"/bench\",\"type\":\"hostile\",\"data\":{\"mode\":\"loop\"}},"
    done
    batch="${batch%,}]"
    curl -s -XPOST -H 'content-type: application/cloudevents-batch+json' --data "$batch" "$API/v1/events" > /dev/null
    sleep 2  # let the loops occupy their instances
  fi
  local h0; h0=$(attempts hostile)
  local start; start=$(date +%s.%N)
  curl -s -XPOST "$API/v1/targets/noop/resume" > /dev/null
  while :; do
    local d; d=$(delivered noop)
    [ "${d:-0}" -ge "$N" ] && break
    sleep 0.1
  done
  local end; end=$(date +%s.%N)
  local h1; h1=$(attempts hostile)
  awk -v n="$N" -v s="$start" -v e="$end" -v name="$name" -v h=$((h1 - h0)) \
    'BEGIN { printf "%-40s %7d events in %6.2f s = %7.0f delivered/s   (hostile attempts meanwhile: %d)\n", name, n, e - s, n / (e - s), h }'
  kill $pid; wait $pid 2>/dev/null || true
}
run "noop alone" no ""
# ALONE=1: only the first run (comparing two builds of the store path).
[ -n "${ALONE:-}" ] && exit 0
run "noop + $H hostile loops" yes ""
run "noop + $H hostile loops, max_concurrency 2" yes "throttle: { max_concurrency: 2 }"
