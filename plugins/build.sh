#!/usr/bin/env bash
# Builds every example handler into a WebAssembly component and copies it to $OUT/<name>.wasm.
#
#   plugins/build.sh                 # -> target/plugins/*.wasm (relative to the repository root)
#   OUT=/tmp/p plugins/build.sh      # elsewhere
#
# Rust plugins: `cargo build --release --target wasm32-wasip2` in this workspace (the target is
# added with rustup when missing). Python plugins: componentize-py, installed into a venv under
# the build directory on first use. Re-running with nothing changed only re-checks (a second or
# two). Environment: OUT (output dir), PLUGINS_TARGET_DIR (cargo target dir and venv; default
# target/plugins-build).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
OUT="${OUT:-$ROOT/target/plugins}"
BUILD_DIR="${PLUGINS_TARGET_DIR:-$ROOT/target/plugins-build}"
WASM_TARGET=wasm32-wasip2
COMPONENTIZE_PY_VERSION=0.25.1
RUST_PLUGINS=(noop invoice enrich flaky strict hostile)
PY_PLUGINS=(enrich_py)
WIT_DIR="$ROOT/sdk/wit"

die() {
    echo "plugins/build.sh: error: $*" >&2
    exit 1
}

mkdir -p "$OUT" "$BUILD_DIR"

# --- Rust toolchain and the wasm32-wasip2 target -------------------------------------------------
command -v cargo >/dev/null 2>&1 || die "cargo not found; install Rust (rustup) first"
sysroot="$(rustc --print sysroot 2>/dev/null)" || die "rustc not found; install Rust (rustup) first"
if [ ! -d "$sysroot/lib/rustlib/$WASM_TARGET" ]; then
    command -v rustup >/dev/null 2>&1 ||
        die "the Rust target $WASM_TARGET is not installed and rustup is not available to add it"
    echo "plugins/build.sh: adding the Rust target $WASM_TARGET" >&2
    rustup target add "$WASM_TARGET" >&2 || die "'rustup target add $WASM_TARGET' failed"
fi

# --- Rust plugins ---------------------------------------------------------------------------------
(
    cd "$HERE"
    env -u CARGO_TARGET_DIR -u RUSTFLAGS -u CARGO_ENCODED_RUSTFLAGS \
        -u RUSTC_WORKSPACE_WRAPPER -u CLIPPY_ARGS CARGO_TARGET_DIR="$BUILD_DIR" \
        cargo build --release --target "$WASM_TARGET" --quiet \
        $(printf -- '-p %s ' "${RUST_PLUGINS[@]}")
) || die "building the Rust plugins failed (see above)"

copy_if_changed() { # src dst
    if ! cmp -s "$1" "$2"; then
        cp "$1" "$2.tmp" && mv "$2.tmp" "$2"
    fi
}

for name in "${RUST_PLUGINS[@]}"; do
    src="$BUILD_DIR/$WASM_TARGET/release/$name.wasm"
    [ -f "$src" ] || die "expected $src after the build"
    copy_if_changed "$src" "$OUT/$name.wasm"
done

# --- Python plugins (componentize-py) -------------------------------------------------------------
VENV="$BUILD_DIR/componentize-py-venv"
CPY="$VENV/bin/componentize-py"
if [ "$("$CPY" --version 2>/dev/null || true)" != "componentize-py $COMPONENTIZE_PY_VERSION" ]; then
    command -v python3 >/dev/null 2>&1 || die "python3 not found; it is needed to build the Python plugins"
    echo "plugins/build.sh: installing componentize-py $COMPONENTIZE_PY_VERSION into $VENV" >&2
    rm -rf "$VENV"
    python3 -m venv "$VENV" >&2 ||
        die "'python3 -m venv' failed (on Debian/Ubuntu: apt-get install python3-venv)"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "componentize-py==$COMPONENTIZE_PY_VERSION" >&2 ||
        die "'pip install componentize-py==$COMPONENTIZE_PY_VERSION' failed"
fi

mkdir -p "$BUILD_DIR/python"
for name in "${PY_PLUGINS[@]}"; do
    built="$BUILD_DIR/python/$name.wasm"
    stamp="$BUILD_DIR/python/$name.version"
    stale=1
    if [ -f "$built" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$COMPONENTIZE_PY_VERSION" ] &&
        [ -z "$(find "$HERE/$name" "$WIT_DIR" -name '*.py' -newer "$built" -o -name '*.wit' -newer "$built" | head -n 1)" ]; then
        stale=0
    fi
    if [ "$stale" = 1 ]; then
        echo "plugins/build.sh: componentize-py $name" >&2
        (
            cd "$HERE/$name"
            PYTHONDONTWRITEBYTECODE=1 "$CPY" -d "$WIT_DIR" -w handler componentize app -o "$built.tmp" >&2
        ) || die "componentize-py failed for $name"
        mv "$built.tmp" "$built"
        echo "$COMPONENTIZE_PY_VERSION" >"$stamp"
    fi
    copy_if_changed "$built" "$OUT/$name.wasm"
done

echo "plugins/build.sh: components in $OUT:" >&2
for name in "${RUST_PLUGINS[@]}" "${PY_PLUGINS[@]}"; do
    echo "  $name.wasm ($(wc -c <"$OUT/$name.wasm") bytes)" >&2
done
