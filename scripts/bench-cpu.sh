#!/usr/bin/env bash
# Per-process CPU (router, load generator, webhook sink) over a 5 s window of an ingest run,
# from /proc/<pid>/stat: where the two cores go. Usage: [N=60000] [BATCH=1] scripts/bench-cpu.sh
# (needs a release build: cargo build --release -p router)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=target/release/router
WORK=$(mktemp -d)
mkdir -p "$WORK/none"   # an empty contracts directory (a missing one stops the start)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$WORK"' EXIT
mkdir -p "$WORK/rules"
cat > "$WORK/rules/bench.yaml" <<YAML
rules:
  - name: bench
    pattern: { type: [bench.event] }
    targets:
      - webhook: http://127.0.0.1:19998/hook
        id: sink
YAML
$BIN bench sink --listen 127.0.0.1:19998 2>/dev/null &
SPID=$!
RUST_LOG=warn $BIN serve --listen 127.0.0.1:18080 --data-dir "$WORK/data" --rules "$WORK/rules" --contracts "$WORK/none" 2>"$WORK/router.log" &
RPID=$!
sleep 1
N=${N:-60000}
BATCH=${BATCH:-1}
cpu() { awk '{print $14+$15}' /proc/$1/stat; }
s0=$(cpu $SPID); r0=$(cpu $RPID); t0=$(date +%s.%N)
$BIN bench ingest --url http://127.0.0.1:18080/v1/events --events "$N" --concurrency 64 --batch $BATCH --size 1024 > $WORK/out &
BPID=$!
b0=$(cpu $BPID)
sleep 5
b1=$(cpu $BPID); s1=$(cpu $SPID); r1=$(cpu $RPID); t1=$(date +%s.%N)
wait $BPID
cat $WORK/out | grep -E "throughput|latency"
echo "cpu over 5s window (cores): bench=$(echo "($b1-$b0)/100/($t1-$t0)" | bc -l | cut -c1-4) sink=$(echo "($s1-$s0)/100/($t1-$t0)" | bc -l| cut -c1-4) router=$(echo "($r1-$r0)/100/($t1-$t0)" | bc -l| cut -c1-4)"
curl -s http://127.0.0.1:18080/v1/targets | grep -o '"delivered":[0-9]*'
