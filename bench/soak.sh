#!/usr/bin/env bash
# Soak: CLIENTS concurrent streaming clients (closed loop) and REQUESTS requests through kvroute
# in front of 4 kvroute-sim replicas (KV events on), for each policy in POLICIES; prints the
# router's resident memory every 5 s, then lost requests and what is left in flight.
#   bench/soak.sh                                  # CLIENTS=1000 REQUESTS=200000 POLICIES="kv_aware cache_aware"
#   EXTRA="--max-tree-size 2000000 --eviction-interval-secs 5" POLICIES=cache_aware bench/soak.sh   # flags for kvroute
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
CLIENTS=${CLIENTS:-1000}; REQUESTS=${REQUESTS:-200000}; MAX_SECONDS=${MAX_SECONDS:-1800}
POLICIES=${POLICIES:-"kv_aware cache_aware"}; SPEEDUP=${SPEEDUP:-1000}
ulimit -n "$(ulimit -Hn)" 2>/dev/null
build -p kvroute-sim -p kvroute-gateway --bin kvroute --bin kvroute-sim --example soak
workers_yaml 4 19400 19500 > "$LOGS/kvroute.yaml"
echo "=== $(date -u +%FT%TZ) CLIENTS=$CLIENTS REQUESTS=$REQUESTS SPEEDUP=$SPEEDUP nproc=$(nproc)"
for policy in $POLICIES; do
  start_sims 4 19400 19500 --speedup "$SPEEDUP" --max-num-seqs 512 || exit 1
  "$BIN/kvroute" --port 19410 --prometheus-port 19411 --config "$LOGS/kvroute.yaml" --policy "$policy" \
    --log-level warn ${EXTRA:-} > "$LOGS/kvroute-$policy.log" 2>&1 & router=$!; pids+=("$router")
  wait_ready http://127.0.0.1:19410/readiness || { tail -5 "$LOGS/kvroute-$policy.log"; exit 1; }
  echo "--- $policy"
  "$BIN/examples/soak" http://127.0.0.1:19410 http://127.0.0.1:19411 "$router" "$CLIENTS" "$REQUESTS" "$MAX_SECONDS"
  stop "$router"; stop_sims
  grep -c -i "panic" "$LOGS/kvroute-$policy.log" | sed 's/^/router log panics: /'
done
