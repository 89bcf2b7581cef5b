#!/usr/bin/env bash
# Ingest benchmark: the router (durable, with delivery to a local webhook running at the same
# time) against a baseline endpoint that only parses and discards, in the same run, so the
# figures are a ratio to the HTTP ceiling of this machine.
# Usage: [BIN=path/to/router] [RATE=events/s for a fixed-rate latency run] [RANDOM_IDS=1]
#        [DELIVERY_BATCH=N: the webhook takes batches of up to N events]
#        [DELIVERY_WINDOW=D: and a partial batch waits up to D (e.g. 20ms) for more]
#        scripts/bench-ingest.sh [N]
# RANDOM_IDS=1 sends the router UUID-like event ids (as most producers do) instead of sequential
# ones, which cost its dedup index more (docs/BENCHMARKS.md, fifteenth session).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-200000}
# shellcheck source=scripts/bench-rules.sh
source scripts/bench-rules.sh
bench_setup
bench_rules "$WORK/rules"
$BIN bench sink --listen 127.0.0.1:19999 2>/dev/null &   # baseline endpoint
$BIN bench sink --listen 127.0.0.1:19998 2>/dev/null &   # webhook receiver for delivery
serve() { RUST_LOG=warn $BIN serve --listen 127.0.0.1:18080 --data-dir "$WORK/$1" --rules "$WORK/rules" --contracts "$WORK/none" 2>>"$WORK/router.log" & ROUTER=$!; sleep 1; }
serve data
# A run with failed requests (429/503 from a saturated router, say) prints its report and the
# script goes on to the next run; it exits 1 at the end so the failures are not missed.
FAILED=0
run() { echo "== $1"; shift; $BIN bench ingest "$@" || { echo "(this run had failures: exit $?)"; FAILED=1; }; echo; }
# Both baselines first, while the router is idle: after its single-event run the router drains
# a delivery backlog for a while, which took CPU from a baseline run made then.
run "baseline, single events"   --url http://127.0.0.1:19999/ --events "$N" --concurrency 64 --size 1024
run "baseline, batches of 100"  --url http://127.0.0.1:19999/ --events $((N * 5)) --concurrency 64 --batch 100 --size 1024
run "router, single events"     --url http://127.0.0.1:18080/v1/events --events "$N" --concurrency 64 --size 1024 ${RANDOM_IDS:+--random-ids}
run "router, batches of 100"    --url http://127.0.0.1:18080/v1/events --events $((N * 5)) --concurrency 64 --batch 100 --size 1024 ${RANDOM_IDS:+--random-ids}
echo "== router queue after the run"
curl -s http://127.0.0.1:18080/v1/targets
echo
du -sh "$WORK/data"
if [ -n "${RATE:-}" ]; then
  # The latency at a fixed rate, in the steady state the target describes: delivery running and
  # keeping up. A fresh router, since the one above is still draining the batched run's backlog
  # (hundreds of thousands of deliveries at full speed, which is another measurement).
  kill "$ROUTER"; wait "$ROUTER" 2>/dev/null || true
  serve data-fixed
  run "router, single events at ${RATE}/s, delivery keeping up" --url http://127.0.0.1:18080/v1/events --events $((N / 2)) --concurrency 64 --size 1024 --rate "$RATE" ${RANDOM_IDS:+--random-ids}
  echo "== router queue right after the fixed-rate run (delivery kept up if little is queued)"
  curl -s http://127.0.0.1:18080/v1/targets | python3 -c "import json, sys
for t in json.load(sys.stdin)['targets']:
    print('%s: delivered %d, queued %d, in flight %d' % (t['id'], t['delivered'], t['queued'], t['in_flight']))"
fi
exit "$FAILED"
