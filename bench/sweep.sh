#!/usr/bin/env bash
# A real-time load sweep: kvroute with each policy in front of REPLICAS kvroute-sim replicas
# (KV events on, every simulated time divided by SPEEDUP), the first N requests of the trace
# replayed at each rate in RATES (times the trace's own rate, on top of SPEEDUP). Each run
# starts fresh replicas, so every policy meets cold caches. Prints one markdown row per
# (rate, policy); OUT keeps each run's logs, JSON and TTFT plot.
#   bench/sweep.sh                                   # N=400 REPLICAS=4 SPEEDUP=10 RATES="1 2 4 8"
#   N=60 RATES="1 4" bench/sweep.sh                  # a short check
#   WORKLOAD="--synthetic shared-prefix --groups 40 --system-prompt-len 6144" bench/sweep.sh
# Times are real milliseconds: the replicas run SPEEDUP times faster than the engine they model.
set -u
LOGS=${OUT:-}   # lib.sh makes a temporary folder when empty
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
OUT=$LOGS
N=${N:-400}; REPLICAS=${REPLICAS:-4}; SPEEDUP=${SPEEDUP:-10}; RATES=${RATES:-1 2 4 8}
POLICIES=${POLICIES:-round_robin cache_aware kv_aware}
TRACE=${TRACE:-$ROOT/../shared/data/mooncake_synthetic_trace.jsonl}
WORKLOAD=${WORKLOAD:---trace $TRACE}   # or --synthetic ... (see kvroute-bench replay --help)
PORT=${PORT:-19500}   # replica i on PORT+i, its KV events on PORT+100+i; kvroute on PORT+90
command -v jq >/dev/null || { echo "sweep.sh needs jq"; exit 1; }
if [ "${BUILD:-1}" = 1 ]; then
  build -p kvroute-sim -p kvroute-gateway -p kvroute-bench
fi
router=""
stop_all() { stop $router; router=""; stop_sims; }
ROUTER=http://127.0.0.1:$((PORT + 90))
workers_yaml "$REPLICAS" "$PORT" $((PORT + 100)) > "$OUT/kvroute.yaml"
run() { # rate policy
  local rate=$1 policy=$2 label="x$1-$2" scale
  scale=$(awk -v s="$SPEEDUP" -v r="$rate" 'BEGIN { print s * r }')
  start_sims "$REPLICAS" "$PORT" $((PORT + 100)) --speedup "$SPEEDUP" || { stop_all; return 1; }
  "$BIN/kvroute" --port $((PORT + 90)) --prometheus-port $((PORT + 91)) --config "$OUT/kvroute.yaml" \
     --policy "$policy" --log-level warn > "$OUT/$label.kvroute.log" 2>&1 & router=$!; pids+=("$router")
  if ! wait_ready "$ROUTER/v1/models"; then
    tail -5 "$OUT/$label.kvroute.log" >&2; stop_all; return 1
  fi
  sleep 1   # the router's KV-event subscribers join before the first request
  # shellcheck disable=SC2086 # WORKLOAD is a list of flags
  if "$BIN/kvroute-bench" replay $WORKLOAD --url "$ROUTER" --max-requests "$N" --rate-scale "$scale" \
       --max-concurrency 256 --model kvroute-sim --json "$OUT/$label.json" --plot "$OUT/$label.svg" \
       --label "$policy" > "$OUT/$label.log" 2>&1; then
    jq -r --arg rate "x$rate" --arg policy "$policy" '.policies[0] |
      def r(d): . * d | round / d;
      "| \($rate) | \($policy) | \(.ttft_ms.p50|round) | \(.ttft_ms.p90|round) | \(.ttft_ms.p99|round) | \(.e2e_ms.p50|round) | \(.e2e_ms.p99|round) | \(.throughput_rps|r(100)) | \(.hit_share * 100|r(10)) | \(.errors) of \(.requests) |"' \
      "$OUT/$label.json"
  else
    echo "| x$rate | $policy | replay failed: $OUT/$label.log |||||||"
  fi
  stop_all; sleep 1
}
echo "=== $(date -u +%FT%TZ) N=$N REPLICAS=$REPLICAS SPEEDUP=$SPEEDUP RATES=\"$RATES\" nproc=$(nproc) workload: $WORKLOAD"
echo
echo "rate: the workload's own arrival rate x SPEEDUP ($SPEEDUP, the replicas' speed-up) x this"
echo
echo "| rate | policy | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | E2E p50 ms | E2E p99 ms | req/s | cached % | errors |"
echo "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|"
for rate in $RATES; do
  for policy in $POLICIES; do run "$rate" "$policy"; done
done
echo
echo "logs, JSON and TTFT plots: $OUT"
