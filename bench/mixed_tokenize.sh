#!/usr/bin/env bash
# Short chats beside long agent turns, with a real BPE tokenizer: does a short request's
# latency move when 60k-character conversations arrive? kvroute kv_aware with the tiny
# tokenizer in front of two fast mocks; short chats from wrk at concurrency 1, and
# bench/agent_turns.py growing AGENTS conversations to ~57k characters at the same time, each
# at RATE requests a second (open loop: the same long work in every phase).
# Phases, for the prefix cache on and off: short chats alone, then short chats with agents.
#
#   ../shared/peers/setup_peers.sh sgl wrk     # once: the mocks' venv, wrk
#   bench/mixed_tokenize.sh                    # DUR=10 AGENTS=2 RATE=5
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
PEERS_DIR=${PEERS_DIR:-/tmp/kvroute-peers}
SHARED=${SHARED:-$ROOT/../shared/peers}
DUR=${DUR:-10}
AGENTS=${AGENTS:-2}
RATE=${RATE:-5}
M1=19011; M2=19012; RP=30023
PY="$PEERS_DIR/venv-sgl/bin/python"
command -v wrk >/dev/null || { echo "wrk missing: $SHARED/setup_peers.sh wrk"; exit 1; }
[ -x "$PY" ] || { echo "mocks' venv missing: $SHARED/setup_peers.sh sgl"; exit 1; }
build -p kvroute-gateway
KVROUTE=${KVROUTE:-$BIN/kvroute}

for p in $M1 $M2; do "$PY" "$SHARED/fast_mock.py" $p f$p > "$LOGS/mock-$p.log" 2>&1 & pids+=($!); done
short() { # label
  wrk -t1 -c1 -d"${DUR}s" --latency -s "$SHARED/post_chat.lua" "http://127.0.0.1:$RP" > "$LOGS/wrk.txt" 2>&1
  printf "%-28s short: rps=%-9s p50=%-9s p99=%-9s" "$1" \
    "$(awk '/Requests\/sec/{print $2}' "$LOGS/wrk.txt")" \
    "$(awk '$1=="50%"{print $2}' "$LOGS/wrk.txt")" "$(awk '$1=="99%"{print $2}' "$LOGS/wrk.txt")"
}
echo "=== $(date -u +%FT%TZ) DUR=${DUR}s AGENTS=$AGENTS RATE=$RATE nproc=$(nproc)"
for cache in on off; do
  flags=(); [ "$cache" = off ] && flags=(--tokenizer-cache-l1-max-memory 0)
  "$KVROUTE" --host 127.0.0.1 --port $RP --worker-urls http://127.0.0.1:$M1 http://127.0.0.1:$M2 \
    --policy kv_aware --tokenizer "$ROOT/testdata/tiny-llama" --prometheus-port 29023 \
    --log-level warn "${flags[@]}" > "$LOGS/kvroute-$cache.log" 2>&1 &
  pid=$!; pids+=("$pid")
  wait_ready "http://127.0.0.1:$RP/v1/chat/completions" -XPOST -H 'content-type: application/json' \
    -d '{"model":"mock-model","messages":[{"role":"user","content":"warm"}]}' || { tail "$LOGS/kvroute-$cache.log"; exit 1; }
  short "cache $cache, alone"; echo
  python3 "$ROOT/bench/agent_turns.py" "http://127.0.0.1:$RP" "$DUR" "$AGENTS" "$RATE" > "$LOGS/agents.txt" 2>&1 &
  agents=$!
  short "cache $cache, with agents"
  wait $agents; echo "  $(cat "$LOGS/agents.txt")  cpu_s=$(awk '{printf "%.1f", ($14+$15)/'"$(getconf CLK_TCK)"'}' /proc/$pid/stat)"
  echo "  tokenizer cache: hits=$(metric_sum http://127.0.0.1:29023 kvroute_tokenizer_cache_hits_total) misses=$(metric_sum http://127.0.0.1:29023 kvroute_tokenizer_cache_misses_total)"
  stop $pid; sleep 1
done
