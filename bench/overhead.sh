#!/usr/bin/env bash
# Router overhead, side by side in one run: wrk against two fast mock engines directly, then
# through kvroute, sglang-router and vllm-router (round_robin each, same mocks, same flags).
# Prints req/s, p50, p99 at concurrency 1 and 64 and the router's CPU time per request.
#
#   ../shared/peers/setup_peers.sh sgl vllmr wrk     # once: the peers, the mocks' venv, wrk
#   bench/overhead.sh                                # DUR=10 POLICY=round_robin ROUTERS="kvroute sglang vllm"
#   ROUTERS="kvroute kvroute-nomig" bench/overhead.sh  # kvroute with and without --migration-limit 0
#
# All traffic stays on 127.0.0.1. Results are appended to $OUT (default bench/overhead-results.txt).
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
PEERS_DIR=${PEERS_DIR:-/tmp/kvroute-peers}
SHARED=${SHARED:-$ROOT/../shared/peers}
DUR=${DUR:-10}
POLICY=${POLICY:-round_robin}
ROUTERS=${ROUTERS:-kvroute sglang vllm}
OUT=${OUT:-$ROOT/bench/overhead-results.txt}
M1=19001; M2=19002; RP=30013
PY="$PEERS_DIR/venv-sgl/bin/python"

command -v wrk >/dev/null || { echo "wrk missing: $SHARED/setup_peers.sh wrk"; exit 1; }
[ -x "$PY" ] || { echo "peers missing: $SHARED/setup_peers.sh sgl vllmr wrk"; exit 1; }
build -p kvroute-gateway
# KVROUTE=path/to/kvroute measures another build (an older commit's, say) in the same way.
KVROUTE=${KVROUTE:-$BIN/kvroute}

# Ready: answers a chat completion.
chat_ready() {
  wait_ready "$1/v1/chat/completions" -XPOST -H 'content-type: application/json' \
    -d '{"model":"mock-model","messages":[{"role":"user","content":"warm"}]}'
}
cpu_ticks() { [ -n "${1:-}" ] && [ -r "/proc/$1/stat" ] && awk '{print $14+$15}' "/proc/$1/stat" || echo 0; }

run_wrk() { # label url [pid]
  local label=$1 url=$2 pid=${3:-}
  for c in 1 64; do
    local t=1; [ "$c" -gt 1 ] && t=2
    local c0; c0=$(cpu_ticks "$pid")
    wrk -t$t -c$c -d"${DUR}s" --latency -s "$SHARED/post_chat.lua" "$url" > "$LOGS/wrk.txt" 2>&1
    local c1; c1=$(cpu_ticks "$pid")
    local n; n=$(awk '/requests in/{print $1}' "$LOGS/wrk.txt")
    local cpu="-"
    [ -n "$pid" ] && cpu=$(python3 -c "print(round(($c1-$c0)*1e6/$(getconf CLK_TCK)/max(1,${n:-1}),1))")
    local rps p50 p99 errs
    rps=$(awk '/Requests\/sec/{print $2}' "$LOGS/wrk.txt")
    p50=$(awk '$1=="50%"{print $2}' "$LOGS/wrk.txt")
    p99=$(awk '$1=="99%"{print $2}' "$LOGS/wrk.txt")
    errs=$(grep -E 'Non-2xx|Socket errors' "$LOGS/wrk.txt" | tr '\n' ' ')
    printf "%-26s c=%-3s rps=%-10s p50=%-9s p99=%-9s cpu_us/req=%-6s %s\n" "$label" "$c" "$rps" "$p50" "$p99" "$cpu" "$errs" | tee -a "$OUT"
  done
}

echo "=== $(date -u +%FT%TZ) DUR=${DUR}s nproc=$(nproc) policy=$POLICY" | tee -a "$OUT"
for p in $M1 $M2; do "$PY" "$SHARED/fast_mock.py" $p f$p > "$LOGS/mock-$p.log" 2>&1 & pids+=($!); done
chat_ready http://127.0.0.1:$M1 && run_wrk direct-mock http://127.0.0.1:$M1

for r in $ROUTERS; do
  case $r in
    kvroute) "$KVROUTE" --host 127.0.0.1 --port $RP --worker-urls http://127.0.0.1:$M1 http://127.0.0.1:$M2 \
               --policy "$POLICY" --prometheus-port 29013 --log-level warn > "$LOGS/$r.log" 2>&1 & ;;
    # The same with migration off: what reading non-streaming answers whole costs.
    kvroute-nomig) "$KVROUTE" --host 127.0.0.1 --port $RP --worker-urls http://127.0.0.1:$M1 http://127.0.0.1:$M2 \
               --policy "$POLICY" --prometheus-port 29013 --log-level warn --migration-limit 0 > "$LOGS/$r.log" 2>&1 & ;;
    sglang)  "$PEERS_DIR/venv-sgl/bin/python" -m sglang_router.launch_router --host 127.0.0.1 --port $RP \
               --worker-urls http://127.0.0.1:$M1 http://127.0.0.1:$M2 --policy "$POLICY" \
               --prometheus-host 127.0.0.1 --prometheus-port 29013 --log-level warn > "$LOGS/$r.log" 2>&1 & ;;
    vllm)    "$PEERS_DIR/venv-vllmr/bin/vllm-router" --host 127.0.0.1 --port $RP \
               --worker-urls http://127.0.0.1:$M1 http://127.0.0.1:$M2 --policy "$POLICY" \
               --prometheus-host 127.0.0.1 --prometheus-port 29013 --log-level warning > "$LOGS/$r.log" 2>&1 & ;;
  esac
  pid=$!; pids+=("$pid")
  if chat_ready http://127.0.0.1:$RP; then run_wrk "$r-$POLICY" http://127.0.0.1:$RP $pid; else tail -5 "$LOGS/$r.log"; fi
  stop $pid; sleep 1
done
