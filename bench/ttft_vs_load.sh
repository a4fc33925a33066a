#!/usr/bin/env bash
# TTFT against load, a line per policy and for Dynamo: the synthetic Mooncake trace at several
# multiples of its arrival rate through kvroute-bench simulate --timing-model dynamo (every
# policy that chooses a worker itself; manual and passthrough follow the client) and through
# Dynamo 1.6.1's own offline replay (round robin, its kv_router at its defaults and at credit 2 /
# scale 4), then `kvroute-bench plot-load` draws one SVG per percentile. Virtual time, CPU only,
# deterministic for kvroute (Dynamo's kv_router moves a few percent between runs).
#   ../shared/peers/setup_peers.sh dyn     # once (~1 min)
#   bench/ttft_vs_load.sh                  # RATES="1 2 3 4 5" WORKERS=8 BLOCKS=16384 PERCENTILES="p90 p50"
# Environment: TRACE, RATES, WORKERS, BLOCKS (of 16 tokens), POLICIES, DYNAMO_RATES (default
# RATES; empty: no Dynamo), OUT (each run's JSON; a run whose file is there is not run again),
# PLOT (the SVG's path; `-p50` etc. added for each percentile after the first). The runs behind
# docs/ttft-vs-load.svg are in bench/results/ttft-vs-load: OUT=bench/results/ttft-vs-load redraws
# it without running anything.
# About 2 minutes a rate for kvroute's ten policies and 10-60 s a Dynamo run on 2 cores.
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
PEERS_DIR=${PEERS_DIR:-/tmp/kvroute-peers}
TRACE=${TRACE:-$ROOT/../shared/data/mooncake_synthetic_trace.jsonl}
RATES=${RATES:-1 2 3 4 5}
DYNAMO_RATES=${DYNAMO_RATES-$RATES}
WORKERS=${WORKERS:-8}
BLOCKS=${BLOCKS:-16384}
POLICIES=${POLICIES:-kv_aware,llm_d,cache_aware,prefix_hash,least_load,power_of_two,round_robin,random,consistent_hash,rendezvous_hash}
PERCENTILES=${PERCENTILES:-p90 p50}
OUT=${OUT:-$LOGS}
PLOT=${PLOT:-$ROOT/docs/ttft-vs-load.svg}
mkdir -p "$OUT"
PY=$PEERS_DIR/venv-dyn/bin/python
build -p kvroute-bench

files=()
for r in $RATES; do
  f=$OUT/kvroute-x$r.json
  [ -s "$f" ] || "$BIN/kvroute-bench" simulate --trace "$TRACE" --workers "$WORKERS" \
    --num-gpu-blocks "$BLOCKS" --timing-model dynamo --policies "$POLICIES" --rate-scale "$r" \
    --json "$f" > "$f.log" 2>&1 || { echo "kvroute-bench run $f failed (see $f.log)" >&2; continue; }
  files+=("$f")
done
if [ -n "$DYNAMO_RATES" ] && [ ! -x "$PY" ]; then
  echo "no Dynamo (run ../shared/peers/setup_peers.sh dyn): kvroute's lines only" >&2
  DYNAMO_RATES=
fi
dynamo() { # file args...
  local f=$1; shift
  if [ ! -s "$f" ]; then
    if ! "$PY" "$ROOT/bench/dynamo_replay_requests.py" "$TRACE" "$WORKERS" "$@" --blocks "$BLOCKS" \
      > "$f.tmp" 2> "$f.log"; then
      echo "Dynamo run $f failed (see $f.log)" >&2
      return
    fi
    mv "$f.tmp" "$f"
  fi
  files+=("$f")
}
for r in $DYNAMO_RATES; do
  dynamo "$OUT/dynamo-x$r.jsonl" round_robin kv_router --speed "$r"
  dynamo "$OUT/dynamo-x$r-c2s4.jsonl" kv_router --speed "$r" --credit 2 --scale 4
done

first=1
for p in $PERCENTILES; do
  svg=$PLOT
  [ $first = 1 ] || svg=${PLOT%.svg}-$p.svg
  first=0
  "$BIN/kvroute-bench" plot-load --percentile "$p" --plot "$svg" "${files[@]}"
done
