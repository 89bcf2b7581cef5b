#!/usr/bin/env bash
# API fuzzing: schemathesis generates requests (valid and invalid) from schemas/openapi.yaml and
# checks that the router never answers 5xx (not_a_server_error) and that every answer matches the
# document (response_schema_conformance). The release router runs on a temp dir with the example
# rules and contracts, an admin token, and a few seeded events so that the DLQ, fates and jobs
# have something in them. Exits non-zero when schemathesis finds a failure or the router panics.
#
# Usage: scripts/api-fuzz.sh [MAX_EXAMPLES=100]   (about a minute)
#   SEED=n                reproduce a run (schemathesis prints the seed it used)
#   CHECKS=list           schemathesis checks (default: not_a_server_error,response_schema_conformance;
#                         `all` adds status, content-type and header conformance, auth and more)
#   SCHEMATHESIS=version  schemathesis from PyPI (default below), installed once into
#                         target/api-fuzz/venv
#   API_FUZZ_BIN=path     fuzz this router binary instead of building the release one (the test
#                         suite passes its debug build, already compiled by `cargo test`)
# Reports (JUnit, and the router's log) land in target/api-fuzz/.
set -euo pipefail
cd "$(dirname "$0")/.."
MAX_EXAMPLES=${1:-100}
SCHEMATHESIS=${SCHEMATHESIS:-4.32.5}
OUT=$PWD/target/api-fuzz
VENV=$OUT/venv

# Python: under CPython 3.11.7 `ast.parse`, which hypothesis calls to describe schemathesis's
# filter lambdas, now and then failed with "SystemError: AST constructor recursion depth
# mismatch" (a CPython bug in its recursion-depth bookkeeping, fixed in later releases): the run
# then ends in a schemathesis "Runtime Error" that says nothing about the router (once in three
# fresh-clone runs here). So the newest Python 3.13+ on the machine is preferred (four runs
# under 3.13.0, no error); API_FUZZ_PYTHON overrides.
pick_python() {
  local p pyenv_root
  pyenv_root=$(pyenv root 2>/dev/null || true)
  # A pyenv shim runs only the versions pyenv has selected, so pyenv's own copies are tried too.
  for p in ${API_FUZZ_PYTHON:-} python3.14 python3.13 \
    ${pyenv_root:+$(ls -d "$pyenv_root"/versions/3.1[34]*/bin/python3 2>/dev/null | sort -rV)}; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import sys' >/dev/null 2>&1; then echo "$p"; return; fi
  done
  echo python3
}
PYTHON=$(pick_python)
PY_VERSION=$("$PYTHON" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
if [ "$("$VENV/bin/schemathesis" --version 2>/dev/null | awk '{print $NF}')" != "$SCHEMATHESIS" ] ||
   [ "$("$VENV/bin/python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null)" != "$PY_VERSION" ]; then
  echo "== installing schemathesis $SCHEMATHESIS into $VENV (Python $PY_VERSION)"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "schemathesis==$SCHEMATHESIS"
fi

if [ -n "${API_FUZZ_BIN:-}" ]; then
  BIN=$(realpath "$API_FUZZ_BIN")
else
  echo "== building the release router"
  cargo build --release --locked -q -p router
  BIN=$PWD/target/release/router
fi

WORK=$(mktemp -d)
ROUTER_PID=
cleanup() {
  if [ -n "$ROUTER_PID" ]; then kill "$ROUTER_PID" 2>/dev/null || true; wait "$ROUTER_PID" 2>/dev/null || true; fi
  ROUTER_PID=
  [ -f "$WORK/router.log" ] && cp "$WORK/router.log" "$OUT/router.log"
  rm -rf "$WORK"
}
trap cleanup EXIT
mkdir -p "$OUT"

TOKEN="rtr_fuzz_$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
cat > "$WORK/router.toml" <<TOML
[[auth.tokens]]
name = "fuzz"
sha256 = "$(printf %s "$TOKEN" | sha256sum | cut -d' ' -f1)"
scopes = ["admin"]
TOML

# A copy of the example contracts: the fuzzer uploads contracts (PUT /v1/contracts/…), which the
# router writes into its contracts directory.
cp -r schemas/contracts "$WORK/contracts"
: > "$WORK/router.log"
RUST_LOG=info NO_COLOR=1 "$BIN" serve --config "$WORK/router.toml" --listen 127.0.0.1:0 \
  --data-dir "$WORK/data" --rules examples/rules --contracts "$WORK/contracts" \
  2>"$WORK/router.log" &
ROUTER_PID=$!
ADDR=
for _ in $(seq 1 300); do
  ADDR=$(sed -n 's/.*router listening.*listen=\([0-9.:]*\).*/\1/p' "$WORK/router.log" | head -n1 || true)
  [ -n "$ADDR" ] && break
  kill -0 "$ROUTER_PID" 2>/dev/null || { cat "$WORK/router.log"; echo "router exited" >&2; exit 1; }
  sleep 0.1
done
[ -n "$ADDR" ] || { cat "$WORK/router.log"; echo "router did not start" >&2; exit 1; }
URL="http://$ADDR"
echo "== router on $URL"

# Seed: accepted, quarantined (contract_violation, unknown_version) and delivered-to-nowhere
# events (the example webhooks have no receiver: their entries retry, then dead-letter).
post() { curl -s -o /dev/null -w '%{http_code} ' -H "Authorization: Bearer $TOKEN" -H "content-type: $1" --data-binary "$2" "$URL/v1/events"; }
post application/cloudevents+json '{"specversion":"1.0","id":"seed-1","source":"/fuzz","type":"order.created","data":{"order_id":"1","total":5,"currency":"EUR"}}'
post application/cloudevents-batch+json '[{"specversion":"1.0","id":"seed-2","source":"/fuzz","type":"order.created","data":{"order_id":2}},{"specversion":"1.0","id":"seed-3","source":"/fuzz","type":"order.created","dataversion":9,"data":{}},{"specversion":"1.0","id":"seed-4","source":"/fuzz","type":"order.paid","data":{"order_id":"4","total":10}}]'
post application/json '{"specversion":"1.0","id":"seed-5","source":"/fuzz","type":"order.shipped","partitionkey":"k1","data":{}}'
echo
sleep 5

set +e
# Run from target/api-fuzz: schemathesis keeps a .schemathesis/ cache in its working directory.
SPEC=$PWD/schemas/openapi.yaml
(cd "$OUT" && "$VENV/bin/schemathesis" run "$SPEC" \
  --url "$URL" \
  --header "Authorization: Bearer $TOKEN" \
  --checks "${CHECKS:-not_a_server_error,response_schema_conformance}" \
  --phases examples,coverage,fuzzing,stateful \
  --max-examples "$MAX_EXAMPLES" \
  ${SEED:+--seed "$SEED"} \
  --workers 2 \
  --request-timeout 10 \
  --generation-database none \
  --suppress-health-check all \
  --report junit --report-junit-path "$OUT/junit.xml" \
  --no-color)
RC=$?
set -e

if ! kill -0 "$ROUTER_PID" 2>/dev/null; then
  echo "FAIL: the router died during the run (log: $OUT/router.log)" >&2
  RC=1
fi
if grep -q "panicked" "$WORK/router.log"; then
  echo "FAIL: the router panicked:" >&2
  grep -A3 "panicked" "$WORK/router.log" | head -20 >&2
  RC=1
fi
exit "$RC"
