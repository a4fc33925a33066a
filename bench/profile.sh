#!/usr/bin/env bash
# Where kvroute's CPU goes under load: wrk at c=64 (small non-streaming chats, two fast mock
# engines, as bench/overhead.sh) while `perf record -e cpu-clock` samples the router, then a
# flamegraph (inferno) and the top frames, by self time and by inclusive time.
#
#   apt-get install linux-perf; cargo install inferno    # once
#   bench/profile.sh                                     # POLICY=round_robin DUR=10 FREQ=999
#   KVROUTE=/tmp/other/kvroute bench/profile.sh          # another build, not rebuilt
#   CALLGRAPH=fp bench/profile.sh                        # frame pointers (a build with
#                                                        # -C force-frame-pointers=yes)
#
# cpu-clock is a software event: the hardware counters are not available on these machines.
# Stacks are unwound from DWARF by default (the release profile keeps line tables). Writes
# $PROFILE_DIR (default /tmp/kvroute-profile-<policy>): perf.data, stacks.folded, flame.svg,
# top.txt; prints top.txt.
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
PEERS_DIR=${PEERS_DIR:-/tmp/kvroute-peers}
SHARED=${SHARED:-$ROOT/../shared/peers}
DUR=${DUR:-10}
FREQ=${FREQ:-999}
POLICY=${POLICY:-round_robin}
CALLGRAPH=${CALLGRAPH:-dwarf}
PROFILE_DIR=${PROFILE_DIR:-/tmp/kvroute-profile-$POLICY}
M1=19001; M2=19002; RP=30013
PY="$PEERS_DIR/venv-sgl/bin/python"

for tool in wrk perf inferno-collapse-perf inferno-flamegraph; do
  command -v $tool >/dev/null || { echo "$tool missing (see the header)"; exit 1; }
done
[ -x "$PY" ] || { echo "mocks' venv missing: $SHARED/setup_peers.sh sgl"; exit 1; }
[ -n "${KVROUTE:-}" ] || build -p kvroute-gateway
KVROUTE=${KVROUTE:-$BIN/kvroute}
case $CALLGRAPH in
  dwarf) cg=(--call-graph dwarf,16384) ;;
  fp) cg=(-g) ;;
  *) echo "CALLGRAPH is dwarf or fp"; exit 1 ;;
esac
mkdir -p "$PROFILE_DIR"

for p in $M1 $M2; do "$PY" "$SHARED/fast_mock.py" $p f$p > "$LOGS/mock-$p.log" 2>&1 & pids+=($!); done
"$KVROUTE" --host 127.0.0.1 --port $RP --worker-urls http://127.0.0.1:$M1 http://127.0.0.1:$M2 \
  --policy "$POLICY" --prometheus-port 29013 --log-level warn > "$LOGS/kvroute.log" 2>&1 &
router=$!; pids+=("$router")
body='{"model":"mock-model","messages":[{"role":"user","content":"warm"}]}'
wait_ready http://127.0.0.1:$RP/v1/chat/completions -XPOST -H 'content-type: application/json' -d "$body" || exit 1
# Warm the pool, then sample only the steady state.
wrk -t2 -c64 -d2s -s "$SHARED/post_chat.lua" http://127.0.0.1:$RP > /dev/null 2>&1
perf record -e cpu-clock -F "$FREQ" "${cg[@]}" -p "$router" -o "$PROFILE_DIR/perf.data" \
  -- sleep "$DUR" > "$LOGS/perf.log" 2>&1 &
rec=$!
wrk -t2 -c64 -d"${DUR}s" --latency -s "$SHARED/post_chat.lua" http://127.0.0.1:$RP > "$LOGS/wrk.txt" 2>&1
wait $rec
stop "$router"

perf script -i "$PROFILE_DIR/perf.data" 2> /dev/null | inferno-collapse-perf > "$PROFILE_DIR/stacks.folded"
inferno-flamegraph --title "kvroute $POLICY, wrk c=64" < "$PROFILE_DIR/stacks.folded" > "$PROFILE_DIR/flame.svg"

# Self time: a stack's last frame; inclusive: every distinct frame of a stack.
python3 - "$PROFILE_DIR/stacks.folded" > "$PROFILE_DIR/top.txt" <<'EOF'
import collections, re, sys
self_, incl, total = collections.Counter(), collections.Counter(), 0
def short(f):
    f = re.sub(r"::h[0-9a-f]{16}$", "", f)
    return f if len(f) < 110 else f[:107] + "..."
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n); total += n
    frames = [short(f) for f in stack.split(";")]
    self_[frames[-1]] += n
    for f in set(frames):
        incl[f] += n
print(f"samples: {total}")
for name, c in (("self", self_), ("inclusive", incl)):
    print(f"\n-- top frames by {name} time")
    for f, n in c.most_common(40):
        print(f"{100 * n / total:6.2f}%  {f}")
EOF
grep -E "Requests/sec|requests in" "$LOGS/wrk.txt"
cat "$PROFILE_DIR/top.txt"
echo "flamegraph: $PROFILE_DIR/flame.svg"
