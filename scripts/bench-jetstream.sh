#!/usr/bin/env bash
# The two store backends side by side, in one run: the release router on the embedded redb
# store, then on NATS JetStream (a private nats-server 2.15 with `sync_interval: always`,
# scripts/nats-server.sh), each taking N single events and N batched events (batches of 100)
# from 64 connections with delivery to a local webhook running, and the time until every event
# is delivered. Figures go to docs/BENCHMARKS.md as JetStream / redb ratios.
# Usage: [BIN=path/to/router] [SYNC=always|default] scripts/bench-jetstream.sh [N=20000]
#   SYNC=default runs the server with its own sync schedule (every 2 minutes): not durable on
#   one server, but what a replicated (R3) stream's writes cost without a per-message fsync.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-20000}
# shellcheck source=scripts/bench-rules.sh
source scripts/bench-rules.sh
bench_setup
bench_rules "$WORK/rules"
NATS=$(bash scripts/nats-server.sh)
SYNC=${SYNC:-always}
SYNC_LINE=""
if [ "$SYNC" = always ]; then SYNC_LINE=", sync_interval: always"; fi
cat > "$WORK/nats.conf" <<EOF
listen: 127.0.0.1:14555
max_payload: 8MB
jetstream { store_dir: "$WORK/js"${SYNC_LINE} }
EOF
"$NATS" -c "$WORK/nats.conf" >"$WORK/nats.log" 2>&1 &
$BIN bench sink --listen 127.0.0.1:19998 2>/dev/null &   # webhook receiver for delivery
sleep 1
for backend in redb jetstream; do
  mkdir -p "$WORK/none"
  RUST_LOG=warn ROUTER_STORE__BACKEND=$backend \
    ROUTER_STORE__JETSTREAM__URL=nats://127.0.0.1:14555 \
    ROUTER_STORE__JETSTREAM__STREAM="BENCH_$backend" \
    $BIN serve --listen 127.0.0.1:18080 --data-dir "$WORK/data-$backend" \
    --rules "$WORK/rules" --contracts "$WORK/none" 2>>"$WORK/router-$backend.log" &
  ROUTER=$!
  sleep 2
  echo "== $backend, single events"
  $BIN bench ingest --url http://127.0.0.1:18080/v1/events --events "$N" --concurrency 64 --size 1024
  drain "$N" 18080
  echo "== $backend, batches of 100"
  $BIN bench ingest --url http://127.0.0.1:18080/v1/events --events "$N" --concurrency 64 --batch 100 --size 1024
  drain $((2 * N)) 18080
  kill "$ROUTER"; wait "$ROUTER" 2>/dev/null || true
  echo
done
