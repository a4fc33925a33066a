#!/usr/bin/env bash
# cache_aware, kvroute against sglang-router, on the same request sequence and the same two
# kvroute-sim replicas: which replica each router picks, request by request.
#   ../shared/peers/setup_peers.sh sgl      # once
#   bench/differential_cache_aware.sh       # NGROUPS=4 PER_GROUP=10
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
PEERS_DIR=${PEERS_DIR:-/tmp/kvroute-peers}
NGROUPS=${NGROUPS:-4}; PER_GROUP=${PER_GROUP:-10}
build -p kvroute-sim -p kvroute-gateway
for i in 0 1; do start_sim "$i" $((19100 + i)) "" --instance-id "sim$i" --speedup 100; done
wait_sims 2 19100
run() { # name cmd...
  local name=$1; shift
  "$@" > "$LOGS/$name.log" 2>&1 & local pid=$!; pids+=("$pid")
  wait_ready http://127.0.0.1:19110/v1/models || { tail -5 "$LOGS/$name.log"; stop $pid; return 1; }
  python3 "$ROOT/bench/differential_cache_aware.py" http://127.0.0.1:19110 "$NGROUPS" "$PER_GROUP" > "$LOGS/$name.choices"
  stop $pid; sleep 1
}
W="http://127.0.0.1:19100 http://127.0.0.1:19101"
run kvroute "$BIN/kvroute" --port 19110 --prometheus-port 19111 --worker-urls $W --policy cache_aware --log-level warn
run sglang "$PEERS_DIR/venv-sgl/bin/python" -m sglang_router.launch_router --host 127.0.0.1 --port 19110 \
    --prometheus-port 19111 --worker-urls $W --policy cache_aware --log-level warn
python3 - "$LOGS/kvroute.choices" "$LOGS/sglang.choices" "$NGROUPS" <<'PY'
import sys, collections
k = [l.split() for l in open(sys.argv[1])]
s = [l.split() for l in open(sys.argv[2])]
groups = int(sys.argv[3])
print(f"{'group':>5} {'kvroute cache_aware':>24} {'sglang-router cache_aware':>28}")
for g in range(groups):
    kc = collections.Counter(x[2] for x in k if int(x[1]) == g)
    sc = collections.Counter(x[2] for x in s if int(x[1]) == g)
    print(f"{g:>5} {dict(kc)!s:>24} {dict(sc)!s:>28}")
tot_k = collections.Counter(x[2] for x in k); tot_s = collections.Counter(x[2] for x in s)
print(f"{'all':>5} {dict(tot_k)!s:>24} {dict(tot_s)!s:>28}")
agree = sum(1 for a, b in zip(k, s) if a[2] == b[2])
print(f"same replica chosen for {agree} of {len(k)} requests")
PY
