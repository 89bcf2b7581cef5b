#!/usr/bin/env bash
# Closed-loop peak with delivery on: a fresh router (bench rules, delivery to a local sink), N
# single events (or batches of BATCH) over 64 connections; prints events/s, latency, what was
# delivered meanwhile, and the router's CPU per event during the load (from /proc).
# Usage: [BIN=target/release/router] [BATCH=1] [RANDOM_IDS=1] scripts/bench-peak.sh [N=100000]
# ROUTER_* settings in the environment reach the router (e.g. ROUTER_STORE__COMMIT_DELAY=2ms).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-100000}
# shellcheck source=scripts/bench-rules.sh
source scripts/bench-rules.sh
bench_setup
bench_rules "$WORK/rules"
$BIN bench sink --listen 127.0.0.1:19998 2>/dev/null &
RUST_LOG=warn $BIN serve --listen 127.0.0.1:18080 --data-dir "$WORK/data" --rules "$WORK/rules" \
  --contracts "$WORK/none" 2>"$WORK/router.log" &
R=$!
sleep 1
t0=$(cpu_ticks "/proc/$R/stat")
$BIN bench ingest --url http://127.0.0.1:18080/v1/events --events "$N" --concurrency 64 --size 1024 \
  --batch "${BATCH:-1}" ${RANDOM_IDS:+--random-ids} | grep -E "throughput|latency"
t1=$(cpu_ticks "/proc/$R/stat")
curl -s http://127.0.0.1:18080/v1/targets | python3 -c "import json, sys
for t in json.load(sys.stdin)['targets']:
    print('%s: delivered %d, queued %d' % (t['id'], t['delivered'], t['queued']))"
echo "router cpu during the load: $(( (t1 - t0) * 1000000 / $(getconf CLK_TCK) / N )) us/event"
