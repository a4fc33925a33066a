#!/usr/bin/env bash
# The Mooncake trace (first N requests) replayed in real time through one kvroute, two
# replicas synced over NATS, and two unsynced ones (requests spread over the replicas), in
# front of the same 4 kvroute-sim replicas (fresh for each run); for the synced pair, the sync
# cost per request (messages and bytes published).
#   bench/replica_replay.sh          # N=1000 SPEEDUP=10 POLICY=kv_aware
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
N=${N:-1000}; SPEEDUP=${SPEEDUP:-10}; POLICY=${POLICY:-kv_aware}
TRACE=${TRACE:-$ROOT/../shared/data/mooncake_synthetic_trace.jsonl}
command -v nats-server >/dev/null || { echo "needs nats-server (apt-get install nats-server)"; exit 1; }
build -p kvroute-sim -p kvroute-gateway -p kvroute-bench
nats-server -a 127.0.0.1 -p 19850 > "$LOGS/nats.log" 2>&1 & pids+=($!)
workers_yaml 4 19800 19900 > "$LOGS/kvroute.yaml"
run() { # label, then one "extra args" string per router
  local label=$1; shift
  local routers=() urls=() metrics=()
  start_sims 4 19800 19900 --speedup "$SPEEDUP" || return 1
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
  stop "${routers[@]}"; stop_sims
  sleep 1
}
echo "=== $(date -u +%FT%TZ) N=$N SPEEDUP=$SPEEDUP POLICY=$POLICY nproc=$(nproc)"
SYNC="--replica-sync nats://127.0.0.1:19850 --replica-timeout-secs 5"
run one-router ""
run two-synced "$SYNC" "$SYNC"
run two-unsynced "" ""
