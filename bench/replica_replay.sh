#!/usr/bin/env bash
# The Mooncake trace (first N requests) replayed in real time through one kvroute, two
# replicas synced over NATS, and two unsynced ones (requests spread over the replicas), in
# front of the same 4 kvroute-sim replicas (fresh for each run); for the synced pair, the sync
# cost per request (messages and bytes published).
#   bench/replica_replay.sh          # N=1000 SPEEDUP=10 POLICY=kv_aware
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
N=${N:-1000}; SPEEDUP=${SPEEDUP:-10}; POLICY=${POLICY:-kv_aware}
TRACE=${TRACE:-$ROOT/../shared/data/mooncake_synthetic_trace.jsonl}
LOGS=$(mktemp -d)
command -v nats-server >/dev/null || { echo "needs nats-server (apt-get install nats-server)"; exit 1; }
(cd "$ROOT" && cargo build --release -q -p kvroute-sim -p kvroute-gateway -p kvroute-bench) || exit 1
BIN=$ROOT/target/release
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
wait_ready() { for _ in $(seq 1 150); do curl -sf "$1" >/dev/null && return 0; sleep 0.2; done; echo "NOT READY $1"; return 1; }
metric_sum() { curl -s "$1/metrics" | grep "^$2" | awk '{s += $NF} END {print s + 0}'; }
nats-server -a 127.0.0.1 -p 19850 > "$LOGS/nats.log" 2>&1 & pids+=($!)
cat > "$LOGS/kvroute.yaml" <<YAML
workers:
$(for i in 0 1 2 3; do printf '  - {url: "http://127.0.0.1:%d", kv_events: "tcp://127.0.0.1:%d"}\n' $((19800 + i)) $((19900 + i)); done)
YAML
run() { # label, then one "extra args" string per router
  local label=$1; shift
  local sims=() routers=() urls=() metrics=()
  for i in 0 1 2 3; do
    "$BIN/kvroute-sim" --port $((19800 + i)) --speedup "$SPEEDUP" --seed $i \
      --kv-events-endpoint "tcp://127.0.0.1:$((19900 + i))" > "$LOGS/sim$i.log" 2>&1 & sims+=($!); pids+=($!)
  done
  for i in 0 1 2 3; do wait_ready http://127.0.0.1:$((19800 + i))/health || return 1; done
  local n=0
  for extra in "$@"; do
    # shellcheck disable=SC2086
    "$BIN/kvroute" --port $((19880 + n)) --prometheus-port $((19890 + n)) --config "$LOGS/kvroute.yaml" \
      --policy "$POLICY" --log-level warn $extra > "$LOGS/$label-$n.log" 2>&1 & routers+=($!); pids+=($!)
    urls+=("http://127.0.0.1:$((19880 + n))"); metrics+=("http://127.0.0.1:$((19890 + n))"); n=$((n + 1))
  done
  for u in "${urls[@]}"; do wait_ready "$u/readiness" || return 1; done
  sleep 1
  printf "%-14s " "$label"
  "$BIN/kvroute-bench" replay --trace "$TRACE" --url "$(IFS=,; echo "${urls[*]}")" --max-requests "$N" \
    --rate-scale "$SPEEDUP" --max-concurrency 256 --model kvroute-sim 2>/dev/null | cut -c1-230
  local msgs=0 bytes=0
  for m in "${metrics[@]}"; do
    msgs=$((msgs + $(metric_sum "$m" 'kvroute_replica_sync_messages_total{direction="out"')))
    bytes=$((bytes + $(metric_sum "$m" 'kvroute_replica_sync_bytes_total{direction="out"')))
  done
  [ "$msgs" -gt 0 ] && echo "               sync: $msgs messages, $bytes bytes published for $N requests: $((msgs / N)) messages, $((bytes / N)) bytes per request"
  for p in "${routers[@]}" "${sims[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  sleep 1
}
echo "=== $(date -u +%FT%TZ) N=$N SPEEDUP=$SPEEDUP POLICY=$POLICY nproc=$(nproc)"
SYNC="--replica-sync nats://127.0.0.1:19850 --replica-timeout-secs 5"
run one-router ""
run two-synced "$SYNC" "$SYNC"
run two-unsynced "" ""
