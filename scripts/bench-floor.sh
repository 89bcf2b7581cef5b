#!/usr/bin/env bash
# The HTTP floor of "ingest with delivery running at the same time" on this machine, with no
# router at all: two load generators (`router bench ingest`) against two parse-and-discard
# endpoints (`router bench sink`) at once. One stands for producers posting to the router, the
# other for the router's webhook deliveries (one POST per event, as webhooks are delivered).
# No storage, no rules, no bookkeeping: whatever a router does on top only costs more.
#
# Prints, each alone and then both at once:
#   - single events: the baseline, and each stream's rate when both run;
#   - batches of 100 for producers with single-event deliveries beside them;
# and the rate at which a router could ingest *and* deliver every event on these two cores if
# it cost nothing beyond that HTTP (the CPU per event of both streams, from their solo rates).
# Usage: [BIN=path/to/router] scripts/bench-floor.sh [N]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-150000}
# shellcheck source=scripts/bench-rules.sh
source scripts/bench-rules.sh
bench_setup
$BIN bench sink --listen 127.0.0.1:19991 2>/dev/null &
$BIN bench sink --listen 127.0.0.1:19992 2>/dev/null &
sleep 0.5
rate() { $BIN bench ingest --url "http://127.0.0.1:$1/" --concurrency 64 --size 1024 "${@:2}" | awk '/^throughput:/ {print $2}'; }
single=$(rate 19991 --events "$N")
batched=$(rate 19991 --events $((N * 10)) --batch 100)
echo "alone: single events ${single}/s, batches of 100 ${batched}/s"
# Both at once, the two runs about as long as each other.
rate 19991 --events "$N" > "$WORK/a" & A=$!
rate 19992 --events "$N" > "$WORK/b"
wait $A
echo "both single at once: producers $(cat "$WORK/a")/s while deliveries $(cat "$WORK/b")/s"
rate 19991 --events $((N * 5)) --batch 100 > "$WORK/a" & A=$!
rate 19992 --events "$N" > "$WORK/b"
wait $A
echo "batches of 100 with deliveries beside: producers $(cat "$WORK/a")/s while deliveries $(cat "$WORK/b")/s"
python3 - "$single" "$batched" <<'PY'
import sys
single, batched = (float(x) for x in sys.argv[1:3])
# Two cores' worth of CPU per event in each solo run (load generator and endpoint together).
post = 2e6 / single          # µs of CPU for one single-event request, both ends
batch_event = 2e6 / batched  # µs for one event of a batched request, both ends
keep_up_single = 2e6 / (post + post)
keep_up_batched = 2e6 / (batch_event + post)
print("ceiling with every event also delivered (delivery keeping up), HTTP alone:")
print("  single events   %6.0f/s = %.2f of the single baseline" % (keep_up_single, keep_up_single / single))
print("  batches of 100  %6.0f/s = %.2f of the batched baseline" % (keep_up_batched, keep_up_batched / batched))
PY
