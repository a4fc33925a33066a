#!/usr/bin/env bash
# A burst of REQUESTS streaming requests sharing a long prefix through one kvroute, two
# kvroute replicas synced over NATS, and two unsynced ones, in front of the same 4 kvroute-sim
# replicas (fresh for each run); prints the most requests each engine held at once.
#   bench/replica_burst.sh          # REQUESTS=64 PREFIX=8000 POLICY=kv_aware
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
REQUESTS=${REQUESTS:-64}; PREFIX=${PREFIX:-8000}; POLICY=${POLICY:-kv_aware}
command -v nats-server >/dev/null || { echo "needs nats-server (apt-get install nats-server)"; exit 1; }
build -p kvroute-sim -p kvroute-gateway --bin kvroute --bin kvroute-sim --example replica_burst
nats-server -a 127.0.0.1 -p 19650 > "$LOGS/nats.log" 2>&1 & pids+=($!)
workers_yaml 4 19600 19700 > "$LOGS/kvroute.yaml"
ENGINES=$(for i in 0 1 2 3; do printf 'http://127.0.0.1:%d,' $((19600 + i)); done); ENGINES=${ENGINES%,}
run() { # label, then one "extra args" string per router
  local label=$1; shift
  local routers=() urls=()
  start_sims 4 19600 19700 || return 1
  local n=0
  for extra in "$@"; do
    # shellcheck disable=SC2086
    "$BIN/kvroute" --port $((19680 + n)) --prometheus-port $((19690 + n)) --config "$LOGS/kvroute.yaml" \
      --policy "$POLICY" --log-level warn $extra > "$LOGS/$label-$n.log" 2>&1 & routers+=($!); pids+=($!)
    urls+=("http://127.0.0.1:$((19680 + n))"); n=$((n + 1))
  done
  for u in "${urls[@]}"; do wait_ready "$u/readiness" || return 1; done
  sleep 1
  printf "%-22s " "$label"
  "$BIN/examples/replica_burst" "$(IFS=,; echo "${urls[*]}")" "$ENGINES" "$REQUESTS" "$PREFIX"
  stop "${routers[@]}"; stop_sims
  sleep 1
}
echo "=== $(date -u +%FT%TZ) REQUESTS=$REQUESTS PREFIX=$PREFIX POLICY=$POLICY nproc=$(nproc)"
SYNC="--replica-sync nats://127.0.0.1:19650 --replica-timeout-secs 5"
run one-router ""
run two-synced "$SYNC" "$SYNC"
run two-unsynced "" ""
