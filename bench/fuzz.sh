#!/usr/bin/env bash
# Fuzzing, outside the CI test run: builds the cargo-fuzz targets of fuzz/ (kv_events, request,
# config; see fuzz/README.md), runs each for SECONDS (default 60) from its corpus, then folds
# what the run found back into fuzz/corpus/<target>/ minimised (libFuzzer -merge=1; seed-* and
# regression-* files are always kept). Exits 1 if a target crashed (panic, failed check,
# timeout, out of memory): the input is in fuzz/artifacts/<target>/, and the log says how to
# rerun it. Prints executions and executions per second per target.
#
#   cargo install cargo-fuzz           # once; needs a nightly toolchain (rustup toolchain add nightly)
#   bench/fuzz.sh [SECONDS]            # TARGETS="kv_events request config" UPDATE_CORPUS=1
#
# One target at a time, one process each (the machine may be shared). Builds go to
# $CARGO_TARGET_DIR (default fuzz/target). UPDATE_CORPUS=0 leaves fuzz/corpus untouched.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FUZZ="$ROOT/fuzz"
SECS=${1:-60}
TARGETS=${TARGETS:-kv_events request config}
UPDATE_CORPUS=${UPDATE_CORPUS:-1}
TARGET_DIR=${CARGO_TARGET_DIR:-$FUZZ/target}
TOOLCHAIN=${FUZZ_TOOLCHAIN:-nightly}
BIN="$TARGET_DIR/x86_64-unknown-linux-gnu/release"

case "$SECS" in '' | *[!0-9]*) echo "usage: $0 [SECONDS]"; exit 2 ;; esac
cargo "+$TOOLCHAIN" fuzz --version >/dev/null 2>&1 || {
  echo "cargo-fuzz or the $TOOLCHAIN toolchain is missing: rustup toolchain add $TOOLCHAIN; cargo install cargo-fuzz"
  exit 2
}

# No sanitizer: kvroute forbids unsafe code, so AddressSanitizer would mostly slow the search
# down; overflow checks and debug assertions stay on (cargo fuzz's default).
echo "== build: cargo +$TOOLCHAIN fuzz build -s none --target-dir $TARGET_DIR"
(cd "$FUZZ" && cargo "+$TOOLCHAIN" fuzz build -s none --target-dir "$TARGET_DIR") || exit 1

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
failed=()
summary=()
for t in $TARGETS; do
  corpus="$FUZZ/corpus/$t"
  found="$WORK/$t-found"
  log="$WORK/$t.log"
  mkdir -p "$corpus" "$found" "$FUZZ/artifacts/$t"
  before=$(ls "$corpus" | wc -l)
  cmd=("$BIN/$t" "$found" "$corpus" -max_total_time="$SECS" -timeout=10 -rss_limit_mb=2048
    -dict="$FUZZ/dict/$t.dict" -artifact_prefix="$FUZZ/artifacts/$t/" -print_final_stats=1)
  echo "== $t: ${cmd[*]}"
  "${cmd[@]}" >"$log" 2>&1
  rc=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  cov=$(grep -o 'cov: [0-9]* ft: [0-9]*' "$log" | tail -1)
  if [ "$rc" -ne 0 ]; then
    failed+=("$t")
    grep -m1 -A4 "panicked at\|ERROR: libFuzzer" "$log"
    grep "Test unit written to" "$log"
    echo "   rerun: $BIN/$t <that file>   (full log: fuzz/artifacts/$t/last.log)"
    cp "$log" "$FUZZ/artifacts/$t/last.log"
  fi
  after=$before
  if [ "$UPDATE_CORPUS" = 1 ]; then
    # Minimise: the named inputs first, then whatever else reaches an edge they do not (edges
    # only, not hit counts, which keeps a few hundred small files instead of thousands).
    merged="$WORK/$t-merged"
    mkdir -p "$merged"
    cp "$corpus"/seed-* "$corpus"/regression-* "$merged"/ 2>/dev/null
    # Bounded: a target that hangs on every input would otherwise retry the merge forever.
    if timeout 600 "$BIN/$t" -merge=1 -use_counters=0 -timeout=10 -rss_limit_mb=2048 "$merged" "$corpus" "$found" >"$WORK/$t.merge.log" 2>&1; then
      find "$corpus" -maxdepth 1 -type f ! -name 'seed-*' ! -name 'regression-*' -delete
      find "$merged" -maxdepth 1 -type f ! -name 'seed-*' ! -name 'regression-*' -exec cp {} "$corpus"/ \;
      after=$(ls "$corpus" | wc -l)
    else
      cp "$WORK/$t.merge.log" "$FUZZ/artifacts/$t/merge.log"
      echo "   corpus not updated: the merge failed (log: fuzz/artifacts/$t/merge.log)"
    fi
  fi
  status=$([ "$rc" -eq 0 ] && echo ok || echo "CRASH (exit $rc)")
  line=$(printf '%-10s %-16s runs %-10s exec/s %-7s %-20s corpus %s -> %s files, %s bytes' \
    "$t" "$status" "${runs:-?}" "${rate:-?}" "${cov:-}" "$before" "$after" "$(cat "$corpus"/* | wc -c)")
  echo "   $line"
  summary+=("$line")
done

echo "== summary (${SECS}s per target)"
printf '   %s\n' "${summary[@]}"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "== FAILED: ${failed[*]}"
  exit 1
fi
echo "== no crash"
