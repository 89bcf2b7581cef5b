#!/usr/bin/env bash
# Where a run's time goes, per router thread: a fresh router (bench rules, delivery to a local
# sink), N single events (or batches of BATCH) over 64 connections, closed loop or at RATE;
# prints events/s and latency, how busy the machine was (from /proc/stat: busy, idle, iowait,
# steal), router CPU per event, then per thread name user and system CPU µs per event and
# context switches per event, the store committer's schedstat (time on CPU, time runnable but
# waiting for a CPU, and its voluntary / involuntary switches), and the commit count and time.
# Usage: [BIN=target/release/router] [N=60000] [BATCH=1] [RATE=events/s] [RANDOM_IDS=1]
#        [PIN=1] [ENVS="ROUTER_K=V …"] [COMMITTER_NICE=-10] [COMMITTER_RT=1] [BATCH_THREADS=regex]
#        [DELIVERY_BATCH=N [DELIVERY_WINDOW=D]] scripts/bench-threads.sh
# PIN=1 puts router and sink on core 0 and the load generator on core 1 (as bench-cpu-pinned.sh).
# COMMITTER_NICE renices the store committer thread (negative values need CAP_SYS_NICE);
# COMMITTER_RT=P makes it SCHED_FIFO at priority P (needs CAP_SYS_NICE as well);
# BATCH_THREADS sets SCHED_BATCH on the router threads whose names match (e.g.
# 'router-ingest|router-delivery'): experiments on how the kernel schedules the committer.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-60000}
# shellcheck source=scripts/bench-rules.sh
source scripts/bench-rules.sh
bench_setup
bench_rules "$WORK/rules"
PIN0=(); PIN1=()
if [ -n "${PIN:-}" ]; then PIN0=(taskset -c 0); PIN1=(taskset -c 1); fi
"${PIN0[@]}" "$BIN" bench sink --listen 127.0.0.1:19998 2>/dev/null &
# shellcheck disable=SC2086 # ENVS is a list of assignments
env ${ENVS:-} RUST_LOG=warn "${PIN0[@]}" "$BIN" serve --listen 127.0.0.1:18080 --data-dir "$WORK/data" \
  --rules "$WORK/rules" --contracts "$WORK/none" 2>"$WORK/router.log" &
R=$!
sleep 1.5
COMMITTER=$(dirname "$(grep -l store-committer /proc/$R/task/*/comm | head -1)")
if [ -n "${COMMITTER_NICE:-}" ]; then renice -n "$COMMITTER_NICE" -p "$(basename "$COMMITTER")" >/dev/null; fi
if [ -n "${COMMITTER_RT:-}" ]; then chrt -f -p "$COMMITTER_RT" "$(basename "$COMMITTER")"; fi
if [ -n "${BATCH_THREADS:-}" ]; then
  for t in /proc/$R/task/*; do
    if grep -qE "$BATCH_THREADS" "$t/comm"; then chrt -b -p 0 "$(basename "$t")"; fi
  done
fi
# name user-ticks system-ticks switches, summed per thread name
snap() {
  for t in /proc/$R/task/*; do
    printf "%s %s %s\n" "$(tr ' ' '_' < "$t/comm")" "$(awk '{print $14, $15}' "$t/stat")" \
      "$(awk '/ctxt_switches/ {s += $2} END {print s}' "$t/status")"
  done | awk '{u[$1] += $2; y[$1] += $3; s[$1] += $4} END {for (k in u) print k, u[k], y[k], s[k]}' | sort
}
switches() { awk '/^(non)?voluntary_ctxt_switches/ {printf "%s ", $2}' "$COMMITTER/status"; }
snap > "$WORK/a"
q0=$(cat "$COMMITTER/schedstat"); v0=$(switches)
s0=$(head -1 /proc/stat); r0=$(cpu_ticks "/proc/$R/stat")
"${PIN1[@]}" "$BIN" bench ingest --url http://127.0.0.1:18080/v1/events --events "$N" --concurrency 64 \
  --batch "${BATCH:-1}" --size 1024 ${RATE:+--rate "$RATE"} ${RANDOM_IDS:+--random-ids} |
  grep -E "throughput|latency"
s1=$(head -1 /proc/stat); r1=$(cpu_ticks "/proc/$R/stat")
q1=$(cat "$COMMITTER/schedstat"); v1=$(switches)
snap > "$WORK/b"
hz=$(getconf CLK_TCK)
python3 - "$s0" "$s1" <<'PY'
import sys
a, b = ([int(x) for x in s.split()[1:9]] for s in sys.argv[1:3])
d = [y - x for x, y in zip(a, b)]
t = sum(d)
print("machine: busy %.2f of 2 cores, idle %.2f, iowait %.2f, steal %.2f"
      % (2 * (t - d[3] - d[4]) / t, 2 * d[3] / t, 2 * d[4] / t, 2 * d[7] / t))
PY
echo "router cpu: $(( (r1 - r0) * 1000000 / hz / N )) us/event"
join "$WORK/a" "$WORK/b" | awk -v n="$N" -v hz="$hz" '($5 - $2) + ($6 - $3) > 0 {
  printf "  %-22s user %6.1f sys %6.1f us/event  %5.2f switches/event\n", $1,
    ($5 - $2) * 1e6 / hz / n, ($6 - $3) * 1e6 / hz / n, ($7 - $4) / n }'
read -r run0 wait0 _ <<< "$q0"; read -r run1 wait1 _ <<< "$q1"
read -r vol0 inv0 <<< "$v0"; read -r vol1 inv1 <<< "$v1"
echo "store committer: on CPU $(( (run1 - run0) / 1000000 )) ms, runnable but waiting for a CPU" \
  "$(( (wait1 - wait0) / 1000000 )) ms; switches voluntary $(( vol1 - vol0 )), involuntary $(( inv1 - inv0 ))"
curl -s http://127.0.0.1:18080/v1/targets | python3 -c "import json, sys
for t in json.load(sys.stdin)['targets']:
    print('%s: delivered %d, queued %d' % (t['id'], t['delivered'], t['queued']))"
curl -s http://127.0.0.1:18080/metrics |
  grep -E "^router_delivery_(handoffs_total|batches_total|batch_events_total)|^router_store_commit_seconds_(count|sum)" || true
