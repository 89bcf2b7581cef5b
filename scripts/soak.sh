#!/usr/bin/env bash
# Soak: a steady ingest rate with delivery to a local webhook keeping up, for MINUTES minutes,
# sampling the store's size; then a backlog (receiver stopped for BACKLOG_S seconds) that is
# drained, to show the file shrinking back (compaction) instead of staying at its peak.
# Retention is shortened (1 min) so the plateau is reached within the run; the plateau level
# is rate × retention. Usage: scripts/soak.sh [MINUTES=10] [RATE=1000]
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES=${1:-10}
RATE=${2:-1000}
BACKLOG_S=${BACKLOG_S:-60}
# BIN=path/to/router runs another build (e.g. to compare two); KEEP=1 keeps the work directory
# (data, router.log) for a look afterwards.
if [ -z "${BIN:-}" ]; then
  cargo build --release --locked -q -p router
  BIN=$PWD/target/release/router
fi
WORK=$(mktemp -d)
mkdir -p "$WORK/none"   # an empty contracts directory (a missing one stops the start)
if [ -n "${KEEP:-}" ]; then
  trap 'kill $(jobs -p) 2>/dev/null; echo "work directory kept: $WORK"' EXIT
else
  trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$WORK"' EXIT
fi
mkdir -p "$WORK/rules"
# Retries outlast the backlog phase (the default policy gives up after about 53 s, and a
# backlog in the DLQ keeps its events, so nothing would drain or shrink).
cat > "$WORK/rules/soak.yaml" <<YAML
policies:
  patient:
    retry: { max_attempts: 100, base_delay: 200ms, max_delay: 5s, max_age: 1h }
rules:
  - name: soak
    pattern: { type: [bench.event] }
    targets:
      - webhook: http://127.0.0.1:19996/hook
        id: sink
        policy: patient
YAML
cat > "$WORK/router.toml" <<TOML
[ingest]
dedup_window = "1m"
[delivery]
retention = "1m"
sweep_interval = "10s"
[archive]
retention = "1m"
[store]
compact_min_bytes = 16777216
# The dedup index cuts a run of keys at each hour or at this many keys, and drops a run once
# the sweep has removed all of its events. Retention here is a minute instead of days, so the
# run is cut at about a minute's worth of keys too; with the default (a million keys or an
# hour) the index would reach its plateau only after an hour.
dedup_memtable_keys = ${DEDUP_KEYS:-$((RATE * 60))}
TOML
$BIN bench sink --listen 127.0.0.1:19996 2>/dev/null & SINK=$!
RUST_LOG=warn,router::store=info $BIN serve --config "$WORK/router.toml" --listen 127.0.0.1:18090 --data-dir "$WORK/data" --rules "$WORK/rules" --contracts "$WORK/none" 2>"$WORK/router.log" &
sleep 1
sample() { printf '%s %6ss  file=%s bytes  queued=%s  dedup=%s\n' "$(date +%T)" "$1" "$(stat -c %s "$WORK/data/router.redb")" \
  "$(curl -s 127.0.0.1:18090/v1/targets/sink | sed -E 's/.*"queued":([0-9]+).*/\1/')" \
  "$(curl -s 127.0.0.1:18090/v1/status | python3 -c 'import json, sys
d = json.load(sys.stdin)["records"]["dedup_keys"]
print("%d keys in %d runs" % (d["count"], d["runs"]))' 2>/dev/null)"; }
SECS=$((MINUTES * 60))
$BIN bench ingest --url http://127.0.0.1:18090/v1/events --events $((SECS * RATE)) --concurrency 32 --size 1024 --rate "$RATE" > "$WORK/load.txt" &
LOAD=$!
for ((t = 0; t <= SECS; t += 30)); do sample "$t"; sleep 30; done
wait $LOAD || true
echo "== steady phase load result"; cat "$WORK/load.txt"
echo "== backlog: receiver stopped for ${BACKLOG_S}s under the same rate"
kill $SINK
$BIN bench ingest --url http://127.0.0.1:18090/v1/events --events $((BACKLOG_S * RATE)) --concurrency 32 --size 1024 --rate "$RATE" > /dev/null &
LOAD2=$!
for ((t = 0; t < BACKLOG_S; t += 15)); do sample "backlog+$t"; sleep 15; done
wait $LOAD2 || true
echo "== receiver back: drain, sweep, compaction"
$BIN bench sink --listen 127.0.0.1:19996 2>/dev/null &
for ((t = 0; t <= 240; t += 20)); do sample "drain+$t"; sleep 20; done
grep -E "compacted|compaction" "$WORK/router.log" || echo "(no compaction logged)"
