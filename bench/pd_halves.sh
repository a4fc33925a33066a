#!/usr/bin/env bash
# Prefill/decode disaggregation in real time: kvroute in front of 2 `kvroute-sim --role prefill`
# and 2 `kvroute-sim --role decode` replicas (KV events on), for each policy pair
# (the same policy on both halves), N shared-prefix requests sent serially (one at a time) and
# 32 at a time; prints how each half spread its requests, from kvroute's metrics
# (kvroute_pd_prefill_requests_total{worker}, kvroute_pd_decode_requests_total{worker}).
# Each run starts the replicas fresh (cold caches).
#   bench/pd_halves.sh            # N=64 SPEEDUP=10 POLICIES="round_robin cache_aware kv_aware"
# kv_aware's decode half is the gateway's default (kv_aware scoring load only, overlap credit 0);
# the other pairs name both halves (--prefill-policy X --decode-policy X).
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
N=${N:-64}; SPEEDUP=${SPEEDUP:-10}
POLICIES=${POLICIES:-"round_robin cache_aware kv_aware"}
GROUPS_N=${GROUPS_N:-8}
build -p kvroute-sim -p kvroute-gateway -p kvroute-bench
# Replicas: p0 p1 (prefill) on 19400/19401, d0 d1 (decode) on 19402/19403; KV events on 19500+.
ROLES=(prefill prefill decode decode)
start_pd_sims() {
  for i in 0 1 2 3; do
    start_sim "$i" $((19400 + i)) $((19500 + i)) --speedup "$SPEEDUP" --seed "$i" --role "${ROLES[$i]}"
  done
  wait_sims 4 19400
}
workers_yaml 4 19400 19500 "${ROLES[@]}" > "$LOGS/kvroute.yaml"
# The count of `metric` for replica i (its worker label is its URL or names its port).
count() { # metrics-file metric port
  awk -v m="$1" -v p="$2" '$0 ~ "^"m"\\{" && $0 ~ ":"p"[\"/]" {s += $NF} END {printf "%d", s}' "$3"
}
decisions() { # metrics-file decision_type
  awk -v d="$1" '$0 ~ /^kvroute_disagg_decision_total\{/ && $0 ~ "\""d"\"" {s += $NF} END {printf "%d", s}' "$2"
}
ROWS=()
run() { # policy mode concurrency
  local policy=$1 mode=$2 conc=$3 flags=()
  [ "$policy" != kv_aware ] && flags=(--prefill-policy "$policy" --decode-policy "$policy")
  start_pd_sims || return 1
  "$BIN/kvroute" --port 19410 --prometheus-port 19411 --config "$LOGS/kvroute.yaml" "${flags[@]}" \
     --log-level warn > "$LOGS/kvroute-$policy-$mode.log" 2>&1 & local pid=$!; pids+=("$pid")
  wait_ready http://127.0.0.1:19410/v1/models || { tail -5 "$LOGS/kvroute-$policy-$mode.log"; stop $pid; stop_sims; return 1; }
  sleep 1  # the KV-event subscribers connect
  local out
  out=$("$BIN/kvroute-bench" replay --synthetic shared-prefix --groups "$GROUPS_N" \
     --prompts-per-group $((N / GROUPS_N)) --system-prompt-len 2048 --question-len 256 --output-len 32 \
     --hash-block-size 512 --request-rate 1000 --max-requests "$N" --seed 1 \
     --url http://127.0.0.1:19410 --model kvroute-sim --max-concurrency "$conc" 2>/dev/null)
  echo "$policy $mode: $out"
  curl -s http://127.0.0.1:19411/metrics > "$LOGS/metrics-$policy-$mode.txt"
  local m=$LOGS/metrics-$policy-$mode.txt
  local pre dec
  pre="$(count kvroute_pd_prefill_requests_total 19400 "$m") / $(count kvroute_pd_prefill_requests_total 19401 "$m")"
  dec="$(count kvroute_pd_decode_requests_total 19402 "$m") / $(count kvroute_pd_decode_requests_total 19403 "$m")"
  local ttft errors
  ttft=$(sed -n 's/.*TTFT ms p50\/p90\/p99 \([0-9/]*\);.*/\1/p' <<<"$out")
  errors=$(sed -n 's/^[0-9]* requests, \([0-9]*\) errors.*/\1/p' <<<"$out")
  ROWS+=("| $policy | $mode ($conc) | $pre | $dec | $(decisions prefill-decode "$m") | $(decisions decode-only "$m") | ${errors:-?} | ${ttft:-?} |")
  stop $pid; stop_sims; sleep 1
}
echo "=== $(date -u +%FT%TZ) N=$N SPEEDUP=$SPEEDUP groups=$GROUPS_N nproc=$(nproc) logs=$LOGS"
for policy in $POLICIES; do
  run "$policy" serial 1
  run "$policy" concurrent 32
done
echo
echo "| policy (prefill = decode) | mode (concurrency) | prefill p0 / p1 | decode d0 / d1 | prefill-decode | decode-only | errors | TTFT ms p50/p90/p99 |"
echo "|---|---|---|---|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
