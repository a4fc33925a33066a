#!/usr/bin/env bash
# kv_aware's cost models (calibrated, the default; weighted; predicted) against every other
# policy on a heterogeneous simulated cluster, in virtual time: 8 engines in three speed tiers
# and two memory tiers (the router is told the memory, never the speeds), on the Mooncake trace
# and on kvroute-bench's generated workloads. One `simulate` per workload and rate with the
# other policies (kv_aware calibrated among them), one with kv_aware weighted and one with
# kv_aware predicted; each prints its table, with the requests each engine answered.
#   bench/heterogeneous.sh            # SPEEDS, BLOCKS, RATES="1 2", SEEDS="0", OUT
# Environment: TRACE (default ../shared/data/mooncake_synthetic_trace.jsonl), TIMING (kvroute or
# dynamo, default kvroute), WORKLOADS (default "trace multi-turn shared-prefix agentic").
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
TRACE=${TRACE:-$ROOT/../shared/data/mooncake_synthetic_trace.jsonl}
SPEEDS=${SPEEDS:-2,2,1,1,1,0.5,0.5,0.5}
BLOCKS=${BLOCKS:-16384,8192,16384,16384,8192,16384,8192,8192}
RATES=${RATES:-1 2}
SEEDS=${SEEDS:-0}
TIMING=${TIMING:-kvroute}
WORKLOADS=${WORKLOADS:-trace multi-turn shared-prefix agentic}
OUT=${OUT:-$LOGS}
OTHERS=round_robin,least_load,cache_aware,llm_d,kv_aware
mkdir -p "$OUT"
build -p kvroute-bench

source_of() { # workload -> kvroute-bench source flags
  case $1 in
    trace) echo "--trace $TRACE" ;;
    multi-turn) echo "--synthetic multi-turn --conversations 100 --turns 5 --request-rate 20" ;;
    shared-prefix) echo "--synthetic shared-prefix" ;;
    agentic) echo "--synthetic agentic" ;;
  esac
}

for w in $WORKLOADS; do
  for r in $RATES; do
    for s in $SEEDS; do
      base="$OUT/$w-x$r-seed$s"
      read -r -a src <<< "$(source_of "$w")"
      common=("${src[@]}" --workers 8 --worker-speed "$SPEEDS" --num-gpu-blocks "$BLOCKS"
        --timing-model "$TIMING" --rate-scale "$r" --seed "$s")
      echo "== $w x$r seed $s"
      [ -s "$base.others.json" ] || "$BIN/kvroute-bench" simulate "${common[@]}" \
        --policies "$OTHERS" --json "$base.others.json" > "$base.others.txt" 2>&1
      for model in weighted predicted; do
        [ -s "$base.$model.json" ] || "$BIN/kvroute-bench" simulate "${common[@]}" \
          --policies kv_aware --router-cost-model "$model" --json "$base.$model.json" \
          > "$base.$model.txt" 2>&1
      done
      cat "$base.others.txt"
      for model in weighted predicted; do
        tail -n +3 "$base.$model.txt" | sed "s/^kv_aware /kv_aware($model)/"
      done
    done
  done
done
