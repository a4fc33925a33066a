#!/usr/bin/env bash
# Soak: CLIENTS concurrent streaming clients (closed loop) and REQUESTS requests through kvroute
# in front of 4 kvroute-sim replicas (KV events on), for each policy in POLICIES; prints the
# router's resident memory every 5 s, then lost requests and what is left in flight.
#   bench/soak.sh                                  # CLIENTS=1000 REQUESTS=200000 POLICIES="kv_aware cache_aware"
#   EXTRA="--max-tree-size 2000000 --eviction-interval-secs 5" POLICIES=cache_aware bench/soak.sh   # flags for kvroute
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CLIENTS=${CLIENTS:-1000}; REQUESTS=${REQUESTS:-200000}; MAX_SECONDS=${MAX_SECONDS:-1800}
POLICIES=${POLICIES:-"kv_aware cache_aware"}; SPEEDUP=${SPEEDUP:-1000}
LOGS=$(mktemp -d)
ulimit -n "$(ulimit -Hn)" 2>/dev/null
(cd "$ROOT" && cargo build --release -q -p kvroute-sim -p kvroute-gateway --bin kvroute --bin kvroute-sim --example soak) || exit 1
BIN=$ROOT/target/release
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
wait_ready() { for _ in $(seq 1 150); do curl -sf "$1" >/dev/null && return 0; sleep 0.2; done; echo "NOT READY $1"; return 1; }
cat > "$LOGS/kvroute.yaml" <<YAML
workers:
$(for i in 0 1 2 3; do printf '  - {url: "http://127.0.0.1:%d", kv_events: "tcp://127.0.0.1:%d"}\n' $((19400 + i)) $((19500 + i)); done)
YAML
echo "=== $(date -u +%FT%TZ) CLIENTS=$CLIENTS REQUESTS=$REQUESTS SPEEDUP=$SPEEDUP nproc=$(nproc)"
for policy in $POLICIES; do
  sims=()
  for i in 0 1 2 3; do
    "$BIN/kvroute-sim" --port $((19400 + i)) --speedup "$SPEEDUP" --seed $i --max-num-seqs 512 \
      --kv-events-endpoint "tcp://127.0.0.1:$((19500 + i))" > "$LOGS/sim$i.log" 2>&1 & sims+=($!); pids+=($!)
  done
  for i in 0 1 2 3; do wait_ready http://127.0.0.1:$((19400 + i))/health || exit 1; done
  "$BIN/kvroute" --port 19410 --prometheus-port 19411 --config "$LOGS/kvroute.yaml" --policy "$policy" \
    --log-level warn ${EXTRA:-} > "$LOGS/kvroute-$policy.log" 2>&1 & router=$!; pids+=($router)
  wait_ready http://127.0.0.1:19410/readiness || { tail -5 "$LOGS/kvroute-$policy.log"; exit 1; }
  echo "--- $policy"
  "$BIN/examples/soak" http://127.0.0.1:19410 http://127.0.0.1:19411 "$router" "$CLIENTS" "$REQUESTS" "$MAX_SECONDS"
  kill "$router"; wait "$router" 2>/dev/null
  for p in "${sims[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  grep -c -i "panic" "$LOGS/kvroute-$policy.log" | sed 's/^/router log panics: /'
done
