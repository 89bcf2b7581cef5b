#!/usr/bin/env bash
# The JetStream store as it is meant to be deployed: a three-server NATS cluster (private
# nats-server 2.15, scripts/nats-server.sh) with the records stream replicated three times
# (`store.jetstream.replicas = 3`; each write is acknowledged once a quorum has it, with no
# per-message fsync), and the same load against one router node and then against two router
# nodes sharing the stream, each node taking half of it from its own load generator. Every
# process runs on this one machine, so the figures show how the pieces behave together, not
# what separate machines would do. Prints events/s per node and the time until every event is
# delivered. Figures go to docs/BENCHMARKS.md.
# Usage: [BIN=path/to/router] scripts/bench-jetstream-cluster.sh [N=20000]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-20000}
# shellcheck source=scripts/bench-rules.sh
source scripts/bench-rules.sh
bench_setup
bench_rules "$WORK/rules"
mkdir -p "$WORK/none"
NATS=$(bash scripts/nats-server.sh)
ROUTES="nats-route://127.0.0.1:16001, nats-route://127.0.0.1:16002, nats-route://127.0.0.1:16003"
for i in 1 2 3; do
  cat > "$WORK/nats$i.conf" <<EOF
server_name: n$i
listen: 127.0.0.1:1455$i
max_payload: 8MB
jetstream { store_dir: "$WORK/js$i" }
cluster { name: bench, listen: 127.0.0.1:1600$i, routes: [ $ROUTES ] }
EOF
  "$NATS" -c "$WORK/nats$i.conf" >"$WORK/nats$i.log" 2>&1 &
done
# The cluster is ready for a replicated stream once JetStream has a meta leader.
for _ in $(seq 120); do
  if grep -q "JetStream cluster new metadata leader\|Self is new JetStream cluster metadata leader" "$WORK"/nats*.log; then break; fi
  sleep 0.5
done
$BIN bench sink --listen 127.0.0.1:19998 2>/dev/null &   # webhook receiver for delivery
node() { # node PORT NATS_PORT NAME: a router node on the shared stream
  RUST_LOG=warn ROUTER_STORE__BACKEND=jetstream \
    ROUTER_STORE__JETSTREAM__URL="nats://127.0.0.1:$2" \
    ROUTER_STORE__JETSTREAM__STREAM="BENCH_$STREAM" \
    ROUTER_STORE__JETSTREAM__PREFIX="bench.$STREAM" \
    ROUTER_STORE__JETSTREAM__REPLICAS=3 \
    $BIN serve --listen "127.0.0.1:$1" --data-dir "$WORK/data-$3" \
    --rules "$WORK/rules" --contracts "$WORK/none" 2>>"$WORK/router-$3.log" &
  NODES+=($!)
}
NODES=()
ingest() { # ingest PORT EVENTS [extra bench args]: a load generator, prefixed output
  local port=$1 events=$2
  shift 2
  $BIN bench ingest --url "http://127.0.0.1:$port/v1/events" --events "$events" \
    --concurrency 64 --size 1024 "$@" | sed "s/^/[node :$port] /"
}

echo "== one router node, stream R3"
STREAM=one
node 18080 14551 one
sleep 3
echo "-- single events"
ingest 18080 "$N"
drain "$N" 18080
echo "-- batches of 100"
ingest 18080 "$N" --batch 100
drain $((2 * N)) 18080
kill "${NODES[@]}"; wait "${NODES[@]}" 2>/dev/null || true
NODES=()

echo
echo "== two router nodes on one stream R3 (each connected to a different server)"
STREAM=two
node 18080 14551 a
node 18081 14552 b
sleep 3
echo "-- single events, half to each node"
ingest 18080 $((N / 2)) & A=$!
ingest 18081 $((N / 2)) & B=$!
wait $A $B
drain "$N" 18080 18081
echo "-- batches of 100, half to each node"
ingest 18080 $((N / 2)) --batch 100 & A=$!
ingest 18081 $((N / 2)) --batch 100 & B=$!
wait $A $B
drain $((2 * N)) 18080 18081
grep -h -i "error\|panic" "$WORK"/router-*.log | sort | uniq -c | sort -rn | head -5 || true
