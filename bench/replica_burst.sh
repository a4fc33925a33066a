#!/usr/bin/env bash
# A burst of REQUESTS streaming requests sharing a long prefix through one kvroute, two
# kvroute replicas synced over NATS, and two unsynced ones, in front of the same 4 kvroute-sim
# replicas (fresh for each run); prints the most requests each engine held at once.
#   bench/replica_burst.sh          # REQUESTS=64 PREFIX=8000 POLICY=kv_aware
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REQUESTS=${REQUESTS:-64}; PREFIX=${PREFIX:-8000}; POLICY=${POLICY:-kv_aware}
LOGS=$(mktemp -d)
command -v nats-server >/dev/null || { echo "needs nats-server (apt-get install nats-server)"; exit 1; }
(cd "$ROOT" && cargo build --release -q -p kvroute-sim -p kvroute-gateway --bin kvroute --bin kvroute-sim --example replica_burst) || exit 1
BIN=$ROOT/target/release
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
wait_ready() { for _ in $(seq 1 150); do curl -sf "$1" >/dev/null && return 0; sleep 0.2; done; echo "NOT READY $1"; return 1; }
nats-server -a 127.0.0.1 -p 19650 > "$LOGS/nats.log" 2>&1 & pids+=($!)
cat > "$LOGS/kvroute.yaml" <<YAML
workers:
$(for i in 0 1 2 3; do printf '  - {url: "http://127.0.0.1:%d", kv_events: "tcp://127.0.0.1:%d"}\n' $((19600 + i)) $((19700 + i)); done)
YAML
ENGINES=$(for i in 0 1 2 3; do printf 'http://127.0.0.1:%d,' $((19600 + i)); done); ENGINES=${ENGINES%,}
run() { # label, then one "extra args" string per router
  local label=$1; shift
  local sims=() routers=() urls=()
  for i in 0 1 2 3; do
    "$BIN/kvroute-sim" --port $((19600 + i)) --seed $i --kv-events-endpoint "tcp://127.0.0.1:$((19700 + i))" \
      > "$LOGS/sim$i.log" 2>&1 & sims+=($!); pids+=($!)
  done
  for i in 0 1 2 3; do wait_ready http://127.0.0.1:$((19600 + i))/health || return 1; done
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
  for p in "${routers[@]}" "${sims[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  sleep 1
}
echo "=== $(date -u +%FT%TZ) REQUESTS=$REQUESTS PREFIX=$PREFIX POLICY=$POLICY nproc=$(nproc)"
SYNC="--replica-sync nats://127.0.0.1:19650 --replica-timeout-secs 5"
run one-router ""
run two-synced "$SYNC" "$SYNC"
run two-unsynced "" ""
