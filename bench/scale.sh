#!/usr/bin/env bash
# One kvroute in front of 16, then 256 (then 1,024 with ENGINES="16 256 1024") simulated engines,
# each fleet one `kvroute-sim --engines N` process, in one session: the same 2,000 requests
# over 600 shared prefixes, 32 at a time, through kv_aware. For each fleet size: the decision
# time (p50/p99 from `kvroute_routing_seconds`, powers of two from 1 us), the router's RSS and
# CPU per request, and how many engines served and how many of those the router heard KV
# events from (`kvroute_processed_requests_total{worker}` beside `kvroute_kv_events_total`).
# With nats-server installed, two router replicas synced over NATS in front of the largest
# fleet: the sync messages a second.
#   bench/scale.sh                 # ENGINES="16 256" N=2000 PREFIXES=600 CONCURRENCY=32 SPEEDUP=20
#   PERF=1 SYNC=0 bench/scale.sh   # and each fleet's router profile (perf record)
#   ROUTER_ARGS="--router-cost-model weighted" bench/scale.sh   # more flags for every router
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
ENGINES=${ENGINES:-16 256}; N=${N:-2000}; PREFIXES=${PREFIXES:-600}; CONCURRENCY=${CONCURRENCY:-32}
SPEEDUP=${SPEEDUP:-20}; SYNC=${SYNC:-1}
PORT=21000; EVENTS=24000; API=20980; PROM=20990; NATS=20970
[ -n "${NO_BUILD:-}" ] || build -p kvroute-sim -p kvroute-gateway -p kvroute-bench

# The workload: PREFIXES system prompts of 512 tokens, 4 questions of 64 each (the first N
# arrivals, shuffled), 16 tokens out; arrivals fast enough that CONCURRENCY is the bound.
WORKLOAD=(--synthetic shared-prefix --groups "$PREFIXES" --prompts-per-group 4 --system-prompt-len 512
  --question-len 64 --output-len 16 --request-rate 5000 --hash-block-size 16 --max-requests "$N")

# Decision time, RSS, CPU per request and KV events per engine, from the router's metrics.
report() { # label, metrics URL, pid, CPU ticks used, requests
  curl -s "$2/metrics" > "$LOGS/$1.metrics"
  PYTHONPATH="$ROOT/bench" python3 - "$LOGS/$1.metrics" "$1" "$3" "$4" "$5" "$(getconf CLK_TCK)" <<'EOF'
import re, sys
from prom import decisions, status
path, label, pid, ticks, n, hz = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
served, events = {}, {}
for line in open(path):
    m = re.match(r'kvroute_processed_requests_total\{worker="([^"]+)"\} (\S+)', line)
    if m:
        served[m.group(1)] = float(m.group(2))
    m = re.match(r'kvroute_kv_events_total\{worker="([^"]+)"[^}]*\} (\S+)', line)
    if m:
        events[m.group(1)] = events.get(m.group(1), 0) + float(m.group(2))
total, quantile = decisions(path)
proc = status(pid)
rss = int(proc["VmRSS"].split()[0]) / 1024
hwm = int(proc["VmHWM"].split()[0]) / 1024
threads = int(proc["Threads"])
did = [w for w, c in served.items() if c > 0]
heard = [w for w in did if events.get(w, 0) > 0]
print(f"{label:>12}: decisions {total:.0f}, p50 {quantile(0.5)}, p99 {quantile(0.99)}; "
      f"RSS {rss:.0f} MiB (peak {hwm:.0f}), {threads} threads; CPU {ticks / hz * 1000 / max(n, 1):.2f} ms/request; "
      f"engines that served {len(did)}, with KV events {len(heard)}; "
      f"KV events {sum(events.values()):.0f}, requests {sum(served.values()):.0f}")
EOF
}

run() { # engines, then "extra args" per router (one or two)
  local engines=$1; shift
  "$BIN/kvroute-sim" --engines "$engines" --port $PORT --kv-events-endpoint "tcp://127.0.0.1:$EVENTS" \
    --speedup "$SPEEDUP" --log-level warn > "$LOGS/sims-$engines.log" 2>&1 & sims+=($!)
  wait_sims "$engines" $PORT || return 1
  workers_yaml "$engines" $PORT $EVENTS | sed 's/}$/, model: kvroute-sim}/' > "$LOGS/kvroute-$engines.yaml"
  local routers=() urls=() metrics=() n=0
  for extra in "$@"; do
    # shellcheck disable=SC2086
    "$BIN/kvroute" --port $((API + n)) --prometheus-port $((PROM + n)) --config "$LOGS/kvroute-$engines.yaml" \
      --policy kv_aware --log-level warn $extra > "$LOGS/kvroute-$engines-$n.log" 2>&1 & routers+=($!); pids+=($!)
    urls+=("http://127.0.0.1:$((API + n))"); metrics+=("http://127.0.0.1:$((PROM + n))"); n=$((n + 1))
  done
  for u in "${urls[@]}"; do wait_ready "$u/readiness" || return 1; done
  sleep 3 # the KV-event subscribers join (ZMQ drops what is published before)
  local before=() r
  for r in "${routers[@]}"; do before+=("$(cpu_ticks "$r")"); done
  local started=$SECONDS perf=
  if [ -n "${PERF:-}" ]; then # PERF=1: the routers' profile, for `perf report -i`
    perf record -g -F 999 -o "$LOGS/router-$engines.perf" -p "${routers[0]}" > /dev/null 2>&1 & perf=$!
  fi
  "$BIN/kvroute-bench" replay "${WORKLOAD[@]}" --url "$(IFS=,; echo "${urls[*]}")" \
    --max-concurrency "$CONCURRENCY" --model kvroute-sim 2>/dev/null | cut -c1-200
  local took=$((SECONDS - started)) i
  [ -n "$perf" ] && { kill -INT "$perf"; wait "$perf"; echo "              profile: $LOGS/router-$engines.perf"; }
  for i in "${!routers[@]}"; do
    local label="$engines engines"
    [ ${#routers[@]} -gt 1 ] && label="$engines r$i"
    report "$label" "${metrics[$i]}" "${routers[$i]}" $(($(cpu_ticks "${routers[$i]}") - before[i])) \
      $((N / ${#routers[@]}))
    local out
    out=$(metric_sum "${metrics[$i]}" 'kvroute_replica_sync_messages_total{direction="out"')
    [ "$out" -gt 0 ] && echo "              sync: $out messages out in ~${took}s: $((out / (took > 0 ? took : 1))) a second, $((out / (N / ${#routers[@]}))) per request"
  done
  stop "${routers[@]}"; stop_sims
  sleep 1
}

echo "=== $(date -u +%FT%TZ) ENGINES=\"$ENGINES\" N=$N PREFIXES=$PREFIXES CONCURRENCY=$CONCURRENCY SPEEDUP=$SPEEDUP nproc=$(nproc)"
largest=16
for e in $ENGINES; do run "$e" "${ROUTER_ARGS:-}" || echo "$e engines: FAILED (logs in $LOGS)"; largest=$e; done
if [ "$SYNC" = 1 ] && command -v nats-server >/dev/null; then
  nats-server -a 127.0.0.1 -p $NATS > "$LOGS/nats.log" 2>&1 & pids+=($!)
  sleep 0.5
  FLAGS="--replica-sync nats://127.0.0.1:$NATS --replica-timeout-secs 5 ${ROUTER_ARGS:-}"
  run "$largest" "$FLAGS" "$FLAGS" || echo "two replicas: FAILED (logs in $LOGS)"
fi
