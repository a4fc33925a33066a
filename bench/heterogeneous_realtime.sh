#!/usr/bin/env bash
# kv_aware's cost models on a cluster of mixed speeds in real time: kvroute before kvroute-sim
# engines whose speeds differ (engine i at `--speedup` SPEEDUP x its factor), fed by
# `kvroute-bench replay` (streaming completions), each row on fresh engines. The router learns
# the engines' speeds from the streams it serves (never told them) and reads each one's KV size
# from its metrics. The virtual-time counterpart is bench/heterogeneous_ratios.py's cluster a.
#
#   bench/heterogeneous_realtime.sh          # SPEEDS, BLOCKS, SPEEDUP=10, WORKLOADS, POLICIES
#
# Rows, per workload: kvroute with each of POLICIES (a policy name, or kv_aware:MODEL for
# `--router-cost-model MODEL`); one markdown table a workload, TTFT and E2E p50/p90/p99, req/s,
# cached share of the prompt tokens, errors and the requests each engine answered, then
# kv_aware's (the default model's) TTFT p90 and E2E p90 over the best other row's.
#
# env: SPEEDS (engine speed factors, 2,2,1,1,1,0.5,0.5,0.5), BLOCKS (each engine's KV blocks,
# 16384,8192,16384,16384,8192,16384,8192,8192), SPEEDUP (the reference engine's speedup and the
# workload's rate scale, 10), WORKLOADS ("trace agentic": the Mooncake trace's first N requests;
# kvroute-bench's agentic sessions, SESSIONS of them), N (1000), SESSIONS (100), SEED (0),
# POLICIES ("kv_aware kv_aware:weighted llm_d least_load cache_aware"), TRACE; lib.sh's BIN and
# LOGS (each row's logs and JSON stay there).
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
SPEEDS=${SPEEDS:-2,2,1,1,1,0.5,0.5,0.5}
BLOCKS=${BLOCKS:-16384,8192,16384,16384,8192,16384,8192,8192}
SPEEDUP=${SPEEDUP:-10}; N=${N:-1000}; SESSIONS=${SESSIONS:-100}; SEED=${SEED:-0}
WORKLOADS=${WORKLOADS:-trace agentic}
POLICIES=${POLICIES:-kv_aware kv_aware:weighted llm_d least_load cache_aware}
TRACE=${TRACE:-$ROOT/../shared/data/mooncake_synthetic_trace.jsonl}
build -p kvroute-sim -p kvroute-gateway -p kvroute-bench

IFS=, read -r -a speed <<< "$SPEEDS"
IFS=, read -r -a blocks <<< "$BLOCKS"
WORKERS=${#speed[@]}
[ "${#blocks[@]}" -eq "$WORKERS" ] || { echo "SPEEDS and BLOCKS differ in length" >&2; exit 2; }
PORT=19390          # the router's HTTP port; metrics on PORT+1
SIM_PORT=19400      # engine i on SIM_PORT+i, its KV events on EVENTS+i
EVENTS=19500
URL=http://127.0.0.1:$PORT
workers_yaml "$WORKERS" $SIM_PORT $EVENTS > "$LOGS/kvroute.yaml"

source_of() { # workload -> kvroute-bench replay's workload flags
  case $1 in
    trace) echo "--trace $TRACE --max-requests $N" ;;
    agentic) echo "--synthetic agentic --sessions $SESSIONS --seed $SEED" ;;
    *) echo "unknown workload $1 (trace, agentic)" >&2; exit 2 ;;
  esac
}

k=0
row() { # workload policy: one row on fresh engines; its JSON in $LOGS/row$k.json
  local workload=$1 policy=$2 flags=() i
  case $policy in
    *:*) flags=(--policy "${policy%%:*}" --router-cost-model "${policy#*:}") ;;
    *) flags=(--policy "$policy") ;;
  esac
  k=$((k + 1))
  for ((i = 0; i < WORKERS; i++)); do
    start_sim "$i" $((SIM_PORT + i)) $((EVENTS + i)) --seed "$i" --num-gpu-blocks "${blocks[i]}" \
      --speedup "$(awk -v a="$SPEEDUP" -v b="${speed[i]}" 'BEGIN {print a * b}')"
  done
  wait_sims "$WORKERS" $SIM_PORT || { echo "$policy: the engines did not start"; stop_sims; return; }
  "$BIN/kvroute" --port $PORT --prometheus-port $((PORT + 1)) --config "$LOGS/kvroute.yaml" \
    --log-level warn "${flags[@]}" > "$LOGS/row$k.log" 2>&1 &
  local pid=$!; pids+=("$pid")
  if wait_ready "$URL/v1/models"; then
    sleep 1
    read -r -a src <<< "$(source_of "$workload")"
    "$BIN/kvroute-bench" replay "${src[@]}" --url "$URL" --rate-scale "$SPEEDUP" \
      --max-concurrency 512 --json "$LOGS/row$k.json" 2> "$LOGS/row$k.client.log" >/dev/null
    [ -s "$LOGS/row$k.json" ] && rows+=("$workload|$policy|$k")
  else
    echo "$policy: the router did not start"; tail -5 "$LOGS/row$k.log"
  fi
  stop "$pid"; stop_sims; sleep 1
}

rows=()
echo "=== $(date -u +%FT%TZ) SPEEDS=$SPEEDS BLOCKS=$BLOCKS SPEEDUP=$SPEEDUP N=$N SESSIONS=$SESSIONS SEED=$SEED nproc=$(nproc) logs $LOGS"
for w in $WORKLOADS; do
  for p in $POLICIES; do row "$w" "$p"; done
done

for w in $WORKLOADS; do
  echo
  echo "--- $w"
  echo "| policy | TTFT ms p50 / p90 / p99 | E2E ms p50 / p90 / p99 | req/s | cached % | errors | requests per engine |"
  echo "|---|---|---|---|---|---|---|"
  files=()
  for r in "${rows[@]}"; do
    IFS='|' read -r workload policy i <<< "$r"
    [ "$workload" = "$w" ] || continue
    files+=("$policy=$LOGS/row$i.json")
  done
  WORKERS=$WORKERS SIM_PORT=$SIM_PORT python3 - "${files[@]}" <<'EOF'
import json, os, sys
engines = [f"http://127.0.0.1:{int(os.environ['SIM_PORT']) + i}" for i in range(int(os.environ["WORKERS"]))]
rows = []
for arg in sys.argv[1:]:
    policy, path = arg.split("=", 1)
    p = json.load(open(path))["policies"][0]
    rows.append((policy, p))
    ms = lambda d: " / ".join(str(round(d[q])) for q in ("p50", "p90", "p99"))
    served = p.get("requests_per_worker", {})
    print(f"| {policy} | {ms(p['ttft_ms'])} | {ms(p['e2e_ms'])} | {p['throughput_rps']:.2f} | "
          f"{100 * p['hit_share']:.1f} | {p.get('errors', 0)} | {', '.join(str(served.get(e, 0)) for e in engines)} |")
ours = [p for name, p in rows if name == "kv_aware"]
others = [p for name, p in rows if name != "kv_aware"]
if ours and others:
    for fig in ("ttft_ms", "e2e_ms"):
        best = min(o[fig]["p90"] for o in others)
        print(f"kv_aware {fig[:-3].upper()} p90 over the best other row's: {ours[0][fig]['p90'] / best:.3f}")
EOF
done
