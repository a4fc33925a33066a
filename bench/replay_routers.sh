#!/usr/bin/env bash
# The Mooncake trace replayed in real time through kvroute and the peer routers, in front of
# the same 4 kvroute-sim replicas (each run starts them fresh, so every router meets cold caches).
#   ../shared/peers/setup_peers.sh sgl vllmr    # once
#   bench/replay_routers.sh                     # N=400 SPEEDUP=10 (the trace's rate scaled by SPEEDUP too)
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
PEERS_DIR=${PEERS_DIR:-/tmp/kvroute-peers}
N=${N:-400}; SPEEDUP=${SPEEDUP:-10}
TRACE=${TRACE:-$ROOT/../shared/data/mooncake_synthetic_trace.jsonl}
build -p kvroute-sim -p kvroute-gateway -p kvroute-bench
workers_yaml 4 19200 19300 > "$LOGS/kvroute.yaml"
W="http://127.0.0.1:19200 http://127.0.0.1:19201 http://127.0.0.1:19202 http://127.0.0.1:19203"
run() { # label cmd...
  local label=$1; shift
  start_sims 4 19200 19300 --speedup "$SPEEDUP" || return 1
  "$@" > "$LOGS/$label.log" 2>&1 & local pid=$!; pids+=("$pid")
  wait_ready http://127.0.0.1:19210/v1/models || { tail -5 "$LOGS/$label.log"; stop $pid; stop_sims; return 1; }
  sleep 1
  printf "%-26s " "$label"
  "$BIN/kvroute-bench" replay --trace "$TRACE" --url http://127.0.0.1:19210 --max-requests "$N" \
     --rate-scale "$SPEEDUP" --max-concurrency 256 --model kvroute-sim 2>/dev/null
  stop $pid; stop_sims; sleep 1
}
echo "=== $(date -u +%FT%TZ) N=$N SPEEDUP=$SPEEDUP nproc=$(nproc)"
run kvroute-kv_aware "$BIN/kvroute" --port 19210 --prometheus-port 19211 --config "$LOGS/kvroute.yaml" --log-level warn
run kvroute-round_robin "$BIN/kvroute" --port 19210 --prometheus-port 19211 --config "$LOGS/kvroute.yaml" --policy round_robin --log-level warn
run kvroute-cache_aware "$BIN/kvroute" --port 19210 --prometheus-port 19211 --config "$LOGS/kvroute.yaml" --policy cache_aware --log-level warn
run sglang-cache_aware "$PEERS_DIR/venv-sgl/bin/python" -m sglang_router.launch_router --host 127.0.0.1 --port 19210 \
   --prometheus-port 19211 --worker-urls $W --policy cache_aware --log-level warn
run vllm-router-cache_aware "$PEERS_DIR/venv-vllmr/bin/vllm-router" --host 127.0.0.1 --port 19210 \
   --prometheus-port 19211 --worker-urls $W --policy cache_aware --log-level warning
