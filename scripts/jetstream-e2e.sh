#!/usr/bin/env bash
# The end-to-end tests with every router on the NATS JetStream store backend
# (`store.backend = "jetstream"`, SPEC: "same tests, both backends"). Starts a private
# nats-server 2.15 (scripts/nats-server.sh) on a free port with a temp store and
# `sync_interval: always`, runs the e2e binary against it (the harness gives each router its own
# stream), and stops the server.
#
# Usage: scripts/jetstream-e2e.sh [cargo test filter args...]
#   e.g. scripts/jetstream-e2e.sh -- durability::
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$(bash scripts/nats-server.sh)
DIR=$(mktemp -d)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat > "$DIR/server.conf" <<EOF
listen: 127.0.0.1:$PORT
max_payload: 8MB
jetstream { store_dir: "$DIR/js", sync_interval: always }
EOF
"$BIN" -c "$DIR/server.conf" >"$DIR/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -rf "$DIR"' EXIT
for _ in $(seq 200); do
  if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then break; fi
  sleep 0.05
done
# Not ROUTER_*: the routers read every such variable as a config key; the harness maps this
# one onto theirs.
export E2E_JETSTREAM_URL="nats://127.0.0.1:$PORT"
# For tests that stop and restart a server of their own (a store outage).
export E2E_NATS_SERVER="$BIN"
cargo test --locked -p router --test e2e "$@"
