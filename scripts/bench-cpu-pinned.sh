#!/usr/bin/env bash
# Router CPU per event with the router (and the webhook sink) on core 0 and the load generator
# on core 1, so the generator does not steal the router's core. Far steadier than events/s on
# this noisy 2-core VM (repeated runs of one build agree within a few per cent): the figure to
# compare two builds with, alternating them. Prints events/s, router CPU µs/event, and the
# store committer thread's share.
# Usage: [BIN=target/release/router] [N=60000] [BATCH=1] [MODE=deliver|alone] [ENVS="K=V …"] [RANDOM_IDS=1]
#        scripts/bench-cpu-pinned.sh
# MODE=alone sends events no rule matches (ingest and the durable accept only).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/router}
N=${N:-60000}; BATCH=${BATCH:-1}; MODE=${MODE:-deliver}
WORK=$(mktemp -d)
mkdir -p "$WORK/none"   # an empty contracts directory (a missing one stops the start)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$WORK"' EXIT
# shellcheck source=scripts/bench-rules.sh
source scripts/bench-rules.sh
bench_rules "$WORK/rules"
taskset -c 0 "$BIN" bench sink --listen 127.0.0.1:19998 2>/dev/null &
# shellcheck disable=SC2086 # ENVS is a list of assignments
env ${ENVS:-} RUST_LOG=warn taskset -c 0 "$BIN" serve --listen 127.0.0.1:18080 --data-dir "$WORK/data" \
  --rules "$WORK/rules" --contracts "$WORK/none" 2>"$WORK/router.log" &
R=$!
sleep 1
TYPE=bench.event; [ "$MODE" = alone ] && TYPE=other
COMMITTER=$(dirname "$(grep -l store-committer /proc/$R/task/*/comm | head -1)")
r0=$(cpu_ticks /proc/$R/stat); c0=$(cpu_ticks "$COMMITTER/stat")
taskset -c 1 "$BIN" bench ingest --url http://127.0.0.1:18080/v1/events --events "$N" --concurrency 64 \
  --batch "$BATCH" --size 1024 --type "$TYPE" ${RANDOM_IDS:+--random-ids} | grep -E "throughput|latency"
r1=$(cpu_ticks /proc/$R/stat); c1=$(cpu_ticks "$COMMITTER/stat")
hz=$(getconf CLK_TCK)
echo "router cpu: $(( (r1 - r0) * 1000000 / hz / N )) us/event, of which store committer $(( (c1 - c0) * 1000000 / hz / N )) us/event"
curl -s http://127.0.0.1:18080/v1/targets | python3 -c "import json, sys
for t in json.load(sys.stdin)['targets']:
    print('%s: delivered %d, queued %d' % (t['id'], t['delivered'], t['queued']))"
