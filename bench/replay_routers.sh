#!/usr/bin/env bash
# The Mooncake trace replayed in real time through kvroute and the peer routers, in front of
# the same 4 kvroute-sim replicas (each run starts them fresh, so every router meets cold caches).
#   ../shared/peers/setup_peers.sh sgl vllmr    # once
#   bench/replay_routers.sh                     # N=400 SPEEDUP=10 (the trace's rate scaled by SPEEDUP too)
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS_DIR=${PEERS_DIR:-/tmp/kvroute-peers}
N=${N:-400}; SPEEDUP=${SPEEDUP:-10}
TRACE=${TRACE:-$ROOT/../shared/data/mooncake_synthetic_trace.jsonl}
LOGS=$(mktemp -d)
(cd "$ROOT" && cargo build --release -q -p kvroute-sim -p kvroute-gateway -p kvroute-bench) || exit 1
BIN=$ROOT/target/release
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
wait_ready() { for _ in $(seq 1 150); do curl -sf "$1" >/dev/null && return 0; sleep 0.2; done; echo "NOT READY $1"; return 1; }
start_sims() {
  sims=()
  for i in 0 1 2 3; do
    "$BIN/kvroute-sim" --port $((19200 + i)) --speedup "$SPEEDUP" --seed $i \
       --kv-events-endpoint "tcp://127.0.0.1:$((19300 + i))" > "$LOGS/sim$i.log" 2>&1 & sims+=($!)
  done
  for i in 0 1 2 3; do wait_ready http://127.0.0.1:$((19200 + i))/health || return 1; done
}
stop_sims() { for p in "${sims[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done; }
cat > "$LOGS/kvroute.yaml" <<YAML
workers:
$(for i in 0 1 2 3; do printf '  - {url: "http://127.0.0.1:%d", kv_events: "tcp://127.0.0.1:%d"}\n' $((19200 + i)) $((19300 + i)); done)
YAML
W="http://127.0.0.1:19200 http://127.0.0.1:19201 http://127.0.0.1:19202 http://127.0.0.1:19203"
run() { # label cmd...
  local label=$1; shift
  start_sims || return 1
  "$@" > "$LOGS/$label.log" 2>&1 & local pid=$!
  wait_ready http://127.0.0.1:19210/v1/models || { tail -5 "$LOGS/$label.log"; kill $pid; stop_sims; return 1; }
  sleep 1
  printf "%-26s " "$label"
  "$BIN/kvroute-bench" replay --trace "$TRACE" --url http://127.0.0.1:19210 --max-requests "$N" \
     --rate-scale "$SPEEDUP" --max-concurrency 256 --model kvroute-sim 2>/dev/null
  kill $pid; wait $pid 2>/dev/null; stop_sims; sleep 1
}
echo "=== $(date -u +%FT%TZ) N=$N SPEEDUP=$SPEEDUP nproc=$(nproc)"
run kvroute-kv_aware "$BIN/kvroute" --port 19210 --prometheus-port 19211 --config "$LOGS/kvroute.yaml" --log-level warn
run kvroute-round_robin "$BIN/kvroute" --port 19210 --prometheus-port 19211 --config "$LOGS/kvroute.yaml" --policy round_robin --log-level warn
run kvroute-cache_aware "$BIN/kvroute" --port 19210 --prometheus-port 19211 --config "$LOGS/kvroute.yaml" --policy cache_aware --log-level warn
run sglang-cache_aware "$PEERS_DIR/venv-sgl/bin/python" -m sglang_router.launch_router --host 127.0.0.1 --port 19210 \
   --prometheus-port 19211 --worker-urls $W --policy cache_aware --log-level warn
run vllm-router-cache_aware "$PEERS_DIR/venv-vllmr/bin/vllm-router" --host 127.0.0.1 --port 19210 \
   --prometheus-port 19211 --worker-urls $W --policy cache_aware --log-level warning
