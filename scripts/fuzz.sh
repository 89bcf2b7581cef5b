#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo-fuzz, libFuzzer) of the CloudEvents parsers (structured, batch,
# binary), the pattern compiler, the rule-file loader and the contract loader: builds every
# target in fuzz/ once, then runs each for DURATION seconds from its committed seeds
# (fuzz/seeds/<target>/) and past crashes (fuzz/regressions/<target>/). Exits non-zero when any
# target crashes (panic, broken invariant, stack overflow, OOM, timeout). See docs/fuzzing.md.
#
# Usage: scripts/fuzz.sh [DURATION=30] [TARGET...]
#   FUZZ_SANITIZER=none   build without AddressSanitizer (default: address)
#   CARGO_BUILD_JOBS=n    cargo build jobs, as for any cargo build
# The first build compiles wasmtime with instrumentation (15-25 minutes on 2 cores); later runs
# reuse fuzz/target. New inputs libFuzzer finds go to fuzz/target/corpus/<target>/ (untracked;
# kept between runs), crashes to fuzz/artifacts/<target>/, logs to fuzz/target/logs/.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${1:-30}
shift || true
SANITIZER=${FUZZ_SANITIZER:-address}
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
  TARGETS=(ingest_structured ingest_batch ingest_binary pattern_compile rules_load contract_load)
fi
export CARGO_TERM_COLOR=never

# libFuzzer instrumentation needs nightly rustc flags (-Z sanitizer, sancov passes).
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  echo "== installing the nightly toolchain"
  rustup toolchain install nightly --profile minimal
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

echo "== building the fuzz targets (sanitizer: $SANITIZER)"
cargo +nightly fuzz build -s "$SANITIZER"

mkdir -p fuzz/target/logs
failed=()
for t in "${TARGETS[@]}"; do
  corpus=fuzz/target/corpus/$t
  mkdir -p "$corpus"
  # libFuzzer writes new inputs into the first corpus dir only: the untracked one.
  dirs=("$corpus" "fuzz/seeds/$t")
  if [ -d "fuzz/regressions/$t" ]; then
    dirs+=("fuzz/regressions/$t")
  fi
  log=fuzz/target/logs/$t.log
  echo "== $t: ${DURATION}s"
  # -timeout: one input taking longer than 10 s is a hang; -rss_limit_mb: 2 GiB is an OOM.
  if cargo +nightly fuzz run -s "$SANITIZER" "$t" "${dirs[@]}" -- \
      -max_total_time="$DURATION" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      >"$log" 2>&1; then
    status=ok
  else
    status=CRASH
    failed+=("$t")
    tail -n 40 "$log"
  fi
  # libFuzzer's last status line ("#N DONE cov: C ft: F corp: ...") and its exec count.
  last=$(grep -E '^#[0-9]+' "$log" | tail -n 1 || true)
  execs=$(grep -E '^stat::number_of_executed_units:' "$log" | awk '{print $2}' || true)
  echo "   $status: ${execs:-?} executions; ${last:-no status line}"
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: crashes in ${failed[*]} (inputs under fuzz/artifacts/; logs under fuzz/target/logs/)"
  exit 1
fi
echo "fuzz: ${#TARGETS[@]} targets, ${DURATION}s each, no crash"
