#!/usr/bin/env bash
# Does one router keep up with the KV events of a thousand engines? ENGINES kvroute-sim engines
# (one process) serve its health checks, and `kvroute-bench firehose` publishes their KV events
# (ZMQ, vLLM's wire format, one PUB socket an engine, each engine's cache churning at full
# size) at each RATE of block events a second, the fleet together, for DURATION seconds; a
# fresh router with its defaults (one index, bounded at 2^22 blocks) subscribes to all of
# them. For each rate: what the firehose sent, what the router applied
# (`kvroute_kv_events_total`) and lost (sequence gaps: a PUB socket drops what its subscriber
# does not take), the router's CPU while it ran, and the index's size.
# With QUERIES=1, kv_aware requests (kvroute-bench replay, CONCURRENCY at a time) run through
# the router meanwhile, and the line adds the decision time's p50 / p99.
#   bench/firehose.sh          # ENGINES=1024 RATES="1000000 2000000 4000000" DURATION=10
#   ENGINES=256 RATES=500000 QUERIES=1 bench/firehose.sh
#   KVROUTE=/path/to/an/older/kvroute bench/firehose.sh   # another router build, for A/B
#   ROUTER_ARGS="--metrics-refresh-ms 500" bench/firehose.sh   # more flags for the router
#   ROUTER_CPUS=0 OTHER_CPUS=1 bench/firehose.sh   # the router on a core of its own (taskset)
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
ENGINES=${ENGINES:-1024}; RATES=${RATES:-1000000 2000000 4000000}; DURATION=${DURATION:-10}
QUERIES=${QUERIES:-0}; CONCURRENCY=${CONCURRENCY:-8}; WARMUP=${WARMUP:-10}
PORT=21000; EVENTS=24000; API=20980; PROM=20990
[ -n "${NO_BUILD:-}" ] || build -p kvroute-sim -p kvroute-gateway -p kvroute-bench
KVROUTE=${KVROUTE:-$BIN/kvroute}
# With ROUTER_CPUS, the router runs on those CPUs and everything else on OTHER_CPUS. Called in
# the background only: it execs, so that $! is the program's own pid.
pin() {
  local cpus=$1; shift
  if [ -n "$cpus" ]; then exec taskset -c "$cpus" "$@"; else exec "$@"; fi
}
ROUTER_CPUS=${ROUTER_CPUS:-}; OTHER_CPUS=${OTHER_CPUS:-}


report() { # metrics file, firehose output, router pid, CPU ticks, seconds, idle ticks in 3 s
  PYTHONPATH="$ROOT/bench" python3 - "$@" "$(getconf CLK_TCK)" <<'EOF'
import re, sys
from prom import decisions, status
path, fire, pid, ticks, secs, idle, hz = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
count, blocks = {}, 0
for line in open(path):
    m = re.match(r'kvroute_kv_events_total\{([^}]*)\} (\S+)', line)
    if m:
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        key = (labels.get("event"), labels.get("status"))
        count[key] = count.get(key, 0) + float(m.group(2))
    m = re.match(r'kvroute_kv_index_blocks (\S+)', line)
    if m:
        blocks = float(m.group(1))
f = re.search(r'(\d+) messages, (\d+) events, (\d+) block events in ([\d.]+) s: ([\d.]+) M block events/s', open(fire).read())
messages, events, block_events, took, rate = int(f[1]), int(f[2]), int(f[3]), float(f[4]), float(f[5])
applied = sum(v for (e, s), v in count.items() if e in ("stored", "removed") and s == "ok")
failed = sum(v for (e, s), v in count.items() if e in ("stored", "removed") and s != "ok")
gaps = count.get(("batch", "gap"), 0) + count.get(("batch", "restart"), 0)
rss = int(status(pid)["VmRSS"].split()[0]) / 1024
cores, idle = ticks / hz / secs, idle / hz / 3
events_cpu = max(ticks / hz - idle * secs, 0)
total, quantile = decisions(path)
decided = f"; {total:.0f} decisions, p50 {quantile(0.5)} p99 {quantile(0.99)}" if total else ""
# A message lost at the end of an engine's stream shows no gap (no later seq): counted apart.
verdict = ("keeps up" if applied >= events else "keeps up but for streams' last messages") \
    if gaps == 0 and failed == 0 else "FALLS BEHIND"
print(f"{verdict}: sent {rate:.3f} M block events/s ({messages} messages, {events} events in {took:.1f} s); "
      f"router applied {applied / max(events, 1):.4f} of the events ({failed:.0f} refused), "
      f"{gaps:.0f} gaps; "
      f"CPU {cores:.2f} cores (idle {idle:.2f}: probes, scrapes), "
      f"{events_cpu * 1e9 / max(block_events, 1):.0f} ns a block event above idle; "
      f"index {blocks / 1e6:.2f} M blocks, RSS {rss:.0f} MiB{decided}")
EOF
}

echo "=== $(date -u +%FT%TZ) ENGINES=$ENGINES RATES=\"$RATES\" DURATION=$DURATION QUERIES=$QUERIES ROUTER_ARGS=\"${ROUTER_ARGS:-}\" ROUTER_CPUS=$ROUTER_CPUS OTHER_CPUS=$OTHER_CPUS nproc=$(nproc)"
pin "$OTHER_CPUS" "$BIN/kvroute-sim" --engines "$ENGINES" --port $PORT --log-level warn \
  > "$LOGS/sims.log" 2>&1 & sims+=($!)
wait_sims "$ENGINES" $PORT || exit 1
workers_yaml "$ENGINES" $PORT $EVENTS | sed 's/}$/, model: kvroute-sim}/' > "$LOGS/kvroute.yaml"
for rate in $RATES; do
  # The firehose binds first and sends primers for WARMUP seconds, while the router starts.
  pin "$OTHER_CPUS" "$BIN/kvroute-bench" firehose --engines "$ENGINES" --endpoint "tcp://127.0.0.1:$EVENTS" \
    --rate "$rate" --duration-secs "$DURATION" --warmup-secs "$WARMUP" > "$LOGS/firehose-$rate.txt" 2>&1 &
  fire=$!; pids+=($fire); started=$SECONDS
  # shellcheck disable=SC2086
  pin "$ROUTER_CPUS" "$KVROUTE" --port $API --prometheus-port $PROM --config "$LOGS/kvroute.yaml" --policy kv_aware \
    --log-level warn ${ROUTER_ARGS:-} > "$LOGS/kvroute-$rate.log" 2>&1 & router=$!; pids+=($router)
  wait_ready "http://127.0.0.1:$API/readiness" || exit 1
  # The router's CPU before the events: its health probes and metric scrapes, over 3 s.
  sleep $((WARMUP - 3 - (SECONDS - started)))
  idle=$(cpu_ticks $router); sleep 3; idle=$(($(cpu_ticks $router) - idle))
  before=$(cpu_ticks $router); t0=$(date +%s.%N)
  if [ "$QUERIES" = 1 ]; then
    pin "$OTHER_CPUS" "$BIN/kvroute-bench" replay --synthetic shared-prefix --groups 600 --prompts-per-group 4 \
      --system-prompt-len 512 --question-len 64 --output-len 16 --request-rate 5000 \
      --hash-block-size 16 --max-requests 1000000 --url "http://127.0.0.1:$API" \
      --max-concurrency "$CONCURRENCY" --model kvroute-sim > "$LOGS/replay-$rate.txt" 2>&1 & replay=$!
  fi
  wait $fire
  [ "$QUERIES" = 1 ] && stop $replay
  # The router may still be applying what it received: until its count stands still.
  applied=-1
  for _ in $(seq 1 40); do
    now=$(metric_sum "http://127.0.0.1:$PROM" kvroute_kv_events_total)
    [ "$now" = "$applied" ] && break
    applied=$now; sleep 0.5
  done
  t1=$(date +%s.%N)
  curl -s "http://127.0.0.1:$PROM/metrics" > "$LOGS/metrics-$rate.txt"
  printf '%9s/s: ' "$rate"
  report "$LOGS/metrics-$rate.txt" "$LOGS/firehose-$rate.txt" $router \
    $(($(cpu_ticks $router) - before)) "$(echo "$t1 - $t0" | bc)" "$idle" || cat "$LOGS/firehose-$rate.txt"
  stop $router
done
