# Sourced by the benchmark scripts. bench_rules DIR writes DIR/bench.yaml: `bench.event`
# events go to the webhook sink at 127.0.0.1:19998 (target `sink`), whose queue may hold a
# whole run (the default depth cap, 100,000, would send most of a batched run to the DLQ as
# target_overflow, a cheaper path than a real fan-out). With DELIVERY_BATCH=N the sink is a
# batching webhook (`batch: { max_events: N }`: one request per N due events); with
# DELIVERY_WINDOW=D as well (a duration, e.g. 20ms) a partial batch waits up to D for more.
bench_rules() {
  mkdir -p "$1"
  local batch=""
  if [ -n "${DELIVERY_BATCH:-}" ]; then
    batch="
        batch: { max_events: $DELIVERY_BATCH${DELIVERY_WINDOW:+, window: $DELIVERY_WINDOW} }"
  fi
  cat > "$1/bench.yaml" <<YAML
policies:
  bench:
    max_queue_depth: 10000000
rules:
  - name: bench
    pattern: { type: [bench.event] }
    targets:
      - webhook: http://127.0.0.1:19998/hook
        id: sink
        policy: bench$batch
YAML
}

# bench_setup sets BIN (the release router, built first unless BIN is already set) and WORK (a
# temporary directory, removed on exit together with every background job of the script).
bench_setup() {
  if [ -z "${BIN:-}" ]; then
    cargo build --release --locked -q -p router
    BIN=$PWD/target/release/router
  fi
  WORK=$(mktemp -d)
  # An empty contracts directory: the router refuses to start on one that does not exist.
  mkdir -p "$WORK/none"
  trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$WORK"' EXIT
}

# cpu_ticks STAT prints the user + system CPU ticks of a process or thread from its /proc stat
# file (/proc/PID/stat, /proc/PID/task/TID/stat); getconf CLK_TCK ticks make a second.
cpu_ticks() { awk '{print $14+$15}' "$1"; }

# delivered PORT... prints how many events the routers on those ports have delivered in all
# (0 for one not answering yet); drain N PORT... waits until that reaches N (at most 600 s) and
# prints how long after the load it took.
delivered() { # the sum over the given router ports of events delivered
  local n=0 port
  for port in "$@"; do
    n=$((n + $(curl -s "http://127.0.0.1:$port/v1/targets" | python3 -c "import json, sys
try:
    print(sum(t['delivered'] for t in json.load(sys.stdin)['targets']))
except ValueError:
    print(0)  # not answering (yet)")))
  done
  echo "$n"
}
drain() { # waits until $1 events are delivered by the routers on ports $2...
  local want=$1 start=$SECONDS
  shift
  while [ "$(delivered "$@")" -lt "$want" ]; do
    if [ $((SECONDS - start)) -gt 600 ]; then echo "not drained after 600 s"; return; fi
    sleep 0.5
  done
  echo "drained $want deliveries $((SECONDS - start)) s after the load ended"
}
