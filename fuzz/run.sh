#!/usr/bin/env bash
# Runs every fuzz target for a fixed budget and reports executions and coverage.
#
#   fuzz/run.sh [SECONDS] [TARGET...]     (default: 180 seconds per target, all targets)
#
# Each target starts from a copy of its committed seeds (fuzz/seeds/TARGET, copied into the
# gitignored working corpus fuzz/corpus/TARGET, which keeps what earlier runs found). Crashes
# land in fuzz/artifacts/TARGET; logs in fuzz/logs/TARGET.log. Exits non-zero if any target
# crashes (or fails to build or run).
set -uo pipefail

SECONDS_PER_TARGET="${1:-180}"
shift || true
ALL_TARGETS=(pool manager encoders index)
if [ "$#" -gt 0 ]; then TARGETS=("$@"); else TARGETS=("${ALL_TARGETS[@]}"); fi

case "$SECONDS_PER_TARGET" in
  '' | *[!0-9]*) echo "usage: fuzz/run.sh [SECONDS] [TARGET...]" >&2; exit 2 ;;
esac

FUZZ_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$FUZZ_DIR")"
cd "$ROOT" || exit 1

if ! rustup toolchain list | grep -q nightly; then
  echo "no nightly toolchain: installing one (cargo-fuzz needs nightly for -Zsanitizer)"
  if ! rustup toolchain install nightly --profile minimal; then
    echo "error: a nightly Rust toolchain is required and could not be installed" >&2
    echo "       (try: rustup toolchain install nightly --profile minimal)" >&2
    exit 1
  fi
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "cargo-fuzz not found: installing it"
  if ! cargo install cargo-fuzz --locked; then
    echo "error: could not install cargo-fuzz (cargo install cargo-fuzz --locked)" >&2
    exit 1
  fi
fi

mkdir -p "$FUZZ_DIR/logs"
cargo +nightly fuzz build || { echo "error: the fuzz targets do not build" >&2; exit 1; }

status=0
summary=()
for t in "${TARGETS[@]}"; do
  corpus="$FUZZ_DIR/corpus/$t"
  mkdir -p "$corpus"
  cp -n "$FUZZ_DIR/seeds/$t/"* "$corpus/" 2>/dev/null || true
  log="$FUZZ_DIR/logs/$t.log"
  echo "=== $t: ${SECONDS_PER_TARGET}s (log: $log)"
  # One worker: cargo-fuzz's --jobs 1 keeps libFuzzer in-process (libFuzzer's own -jobs and
  # -workers switch it to a multi-process mode that logs to ./fuzz-N.log instead).
  cargo +nightly fuzz run --jobs 1 "$t" "$corpus" -- \
    -max_total_time="$SECONDS_PER_TARGET" -rss_limit_mb=2048 -print_final_stats=1 \
    >"$log" 2>&1
  rc=$?
  # libFuzzer's final status lines: "#N DONE cov: C ft: F ..." and the final stats.
  last="$(grep -E '^#[0-9]+' "$log" | tail -n 1)"
  execs="$(grep -E '^stat::number_of_executed_units:' "$log" | tail -n 1 | awk '{print $2}')"
  [ -n "$execs" ] || execs="$(printf '%s' "$last" | sed -nE 's/^#([0-9]+).*/\1/p')"
  cov="$(printf '%s' "$last" | sed -nE 's/.* cov: ([0-9]+).*/\1/p')"
  ft="$(printf '%s' "$last" | sed -nE 's/.* ft: ([0-9]+).*/\1/p')"
  corp="$(printf '%s' "$last" | sed -nE 's/.* corp: ([0-9]+\/[0-9a-zA-Z]+).*/\1/p')"
  if [ "$rc" -ne 0 ]; then
    status=1
    verdict="FAILED (exit $rc)"
    grep -E 'SUMMARY|panicked at|ERROR: libFuzzer|Test unit written to' "$log" | head -n 5
  else
    verdict="ok"
  fi
  line="$t: execs=${execs:-?} cov=${cov:-?} ft=${ft:-?} corpus=${corp:-?} $verdict"
  echo "$line"
  summary+=("$line")
done

echo "=== summary (${SECONDS_PER_TARGET}s per target)"
printf '%s\n' "${summary[@]}"
exit "$status"
