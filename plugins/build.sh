#!/usr/bin/env bash
# Builds every example handler into a WebAssembly component and copies it to $OUT/<name>.wasm.
#
#   plugins/build.sh                 # -> target/plugins/*.wasm (relative to the repository root)
#   OUT=/tmp/p plugins/build.sh      # elsewhere
#   PLUGINS_SKIP_PY=1 plugins/build.sh   # the Rust plugins only
#
# Rust plugins: `cargo build --release --target wasm32-wasip2` in this workspace (the target is
# added with rustup when missing). Python plugins: componentize-py, installed into a venv under
# the build directory on first use. Re-running with nothing changed only re-checks (a second or
# two). Environment: OUT (output dir), PLUGINS_TARGET_DIR (cargo target dir and venv; default
# target/plugins-build), PLUGINS_SKIP_PY=1 (skip the Python plugins, e.g. where Python or the
# componentize-py download is not available; the end-to-end tests need them, so the default
# builds everything).
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

case "${PLUGINS_SKIP_PY:-0}" in
    0 | "") SKIP_PY=0 ;;
    1) SKIP_PY=1 ;;
    *) die "PLUGINS_SKIP_PY must be 1 (skip the Python plugins) or 0 (build them), not '$PLUGINS_SKIP_PY'" ;;
esac

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
# Not --quiet: a cold build compiles for minutes, and cargo's progress (on stderr) shows it is
# moving; a warm one prints a single "Finished" line.
(
    cd "$HERE"
    env -u CARGO_TARGET_DIR -u RUSTFLAGS -u CARGO_ENCODED_RUSTFLAGS \
        -u RUSTC_WORKSPACE_WRAPPER -u CLIPPY_ARGS CARGO_TARGET_DIR="$BUILD_DIR" \
        cargo build --release --target "$WASM_TARGET" \
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
build_python_plugins() {
    local venv="$BUILD_DIR/componentize-py-venv"
    local cpy="$venv/bin/componentize-py"
    if [ "$("$cpy" --version 2>/dev/null || true)" != "componentize-py $COMPONENTIZE_PY_VERSION" ]; then
        command -v python3 >/dev/null 2>&1 ||
            die "python3 not found; it is needed to build the Python plugins (PLUGINS_SKIP_PY=1 skips them)"
        echo "plugins/build.sh: installing componentize-py $COMPONENTIZE_PY_VERSION into $venv" >&2
        rm -rf "$venv"
        python3 -m venv "$venv" >&2 ||
            die "'python3 -m venv' failed (on Debian/Ubuntu: apt-get install python3-venv)"
        "$venv/bin/pip" install --quiet --disable-pip-version-check "componentize-py==$COMPONENTIZE_PY_VERSION" >&2 ||
            die "'pip install componentize-py==$COMPONENTIZE_PY_VERSION' failed"
    fi

    mkdir -p "$BUILD_DIR/python"
    local name built stamp stale
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
                PYTHONDONTWRITEBYTECODE=1 "$cpy" -d "$WIT_DIR" -w handler componentize app -o "$built.tmp" >&2
            ) || die "componentize-py failed for $name"
            mv "$built.tmp" "$built"
            echo "$COMPONENTIZE_PY_VERSION" >"$stamp"
        fi
        copy_if_changed "$built" "$OUT/$name.wasm"
    done
}

# The summary lists what this run built; an empty array is never expanded, since bash before
# 4.4 (macOS's 3.2) calls that an unbound variable under `set -u`.
BUILT=("${RUST_PLUGINS[@]}")
if [ "$SKIP_PY" = 1 ]; then
    echo "plugins/build.sh: PLUGINS_SKIP_PY=1: skipping the Python plugins (${PY_PLUGINS[*]}): not built into $OUT, where a copy from an earlier build, if any, is left as it is" >&2
else
    build_python_plugins
    BUILT+=("${PY_PLUGINS[@]}")
fi

echo "plugins/build.sh: components in $OUT:" >&2
for name in "${BUILT[@]}"; do
    echo "  $name.wasm ($(wc -c <"$OUT/$name.wasm") bytes)" >&2
done
