#!/usr/bin/env bash
# Ingest latency while the sweeper runs: the soak configuration (dedup window, retention and
# archive 1 min, sweep every 10 s), a fixed rate with delivery to a local sink keeping up, long
# enough that events age past the retention and every sweep has a minute's worth to remove.
# Prints the load tool's result, the router's CPU per event, what was swept, the store commits'
# latency histogram and the slow-commit lines of the router's log.
# Usage: scripts/bench-sweep.sh [RATE=3000] [SECS=150]   (BIN= to use another router binary;
# RETENTION=1h for the same run without sweeps; other ROUTER_* settings pass through)
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-3000}
RETENTION=${RETENTION:-1m}
SECS=${2:-150}
# shellcheck source=scripts/bench-rules.sh
source scripts/bench-rules.sh
bench_setup
mkdir -p "$WORK/rules"
cat > "$WORK/rules/sweep.yaml" <<YAML
rules:
  - name: sweep
    pattern: { type: [bench.event] }
    targets:
      - webhook: http://127.0.0.1:19995/hook
        id: sink
YAML
cat > "$WORK/router.toml" <<TOML
[ingest]
dedup_window = "$RETENTION"
[delivery]
retention = "$RETENTION"
sweep_interval = "10s"
[archive]
retention = "$RETENTION"
TOML
$BIN bench sink --listen 127.0.0.1:19995 2>/dev/null &
RUST_LOG=warn,router::store=info $BIN serve --config "$WORK/router.toml" --listen 127.0.0.1:18091 \
  --data-dir "$WORK/data" --rules "$WORK/rules" --contracts "$WORK/none" 2>"$WORK/router.log" &
R=$!
sleep 1
t0=$(cpu_ticks "/proc/$R/stat")
$BIN bench ingest --url http://127.0.0.1:18091/v1/events --events $((SECS * RATE)) \
  --concurrency 32 --size 1024 --rate "$RATE" ${REPORT_EVERY:+--report-every $REPORT_EVERY}
t1=$(cpu_ticks "/proc/$R/stat")
echo "== router cpu: $(( (t1 - t0) * 1000000 / $(getconf CLK_TCK) / (SECS * RATE) )) us/event (the load's events; includes their delivery and sweeping)"
echo "== queued at the end: $(curl -s 127.0.0.1:18091/v1/targets/sink | sed -E 's/.*"queued":([0-9]+).*/\1/')"
echo "== swept: $(curl -s 127.0.0.1:18091/metrics | grep -E '^router_swept' | tr '\n' ' ')"
echo "== store commits by duration (cumulative: le=seconds count):"
curl -s 127.0.0.1:18091/metrics | grep -E '^router_store_commit_seconds_(bucket|count)' \
  | sed -E 's/router_store_commit_seconds_//' | tr '\n' ' '
echo
echo "== slow commits logged: $(grep -c 'slow store commit' "$WORK/router.log" || true)"
grep 'slow store commit' "$WORK/router.log" | tail -5 || true
