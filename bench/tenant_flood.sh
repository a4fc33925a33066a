#!/usr/bin/env bash
# A light tenant beside a 10x heavier one, in real time: N kvroute-sim engines (fresh for each
# run) behind one kvroute with the router queue on (--router-queue-threshold 1) and the tenant
# header trusted; kvroute-bench replay sends the workload with two tenants (tenant 1 the light
# one, tenant 0 the flood, x$SCALE) three times:
#   alone  tenant 1 only (--heavy-tenant-scale 0)
#   fcfs   beside the flood, the router queue first come, first served
#   vtc    beside the flood, the router queue by virtual token counters
#   vtc-ep the same, the engines scheduling by priority (--scheduling-policy priority) and the
#          router writing each request's (--engine-priority vllm; docs/tenants.md)
# and prints the light tenant's TTFT p50/p90 in each, their ratios to alone, and the cluster's
# throughput (requests and output tokens per second) of vtc and vtc-ep over fcfs.
#
# The router is $KVROUTE ($BIN/kvroute by default), so another build can be measured: a router
# without --router-queue-fairness (before the priority scheduler) runs fcfs without the flag
# (its queue has no tenants) and skips vtc, saying so.
#
#   bench/tenant_flood.sh     # N=2 SPEEDUP=4 WORKLOAD=mooncake MAX_REQUESTS=400 RATE=2 SCALE=10
#   KVROUTE=/work/wt-prio/target/release/kvroute bench/tenant_flood.sh
#   WORKLOAD=shared-prefix RATE=1 bench/tenant_flood.sh
# Knobs: N engines, SPEEDUP (each engine's), POLICY (kv_aware), WORKLOAD (mooncake: the trace
# in TRACE; shared-prefix: kvroute-bench's generator, PREFIX_GROUPS x PROMPTS prompts), MAX_REQUESTS
# (of the trace, before the flood is added), RATE (--rate-scale), SCALE (the flood's),
# QUEUE_TIMEOUT (s), RUNS ("alone fcfs vtc vtc-ep"), CONCURRENCY (the replay's most in flight),
# NO_BUILD=1 to use the binaries as they are. Each run's replay JSON is left in $LOGS.
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
N=${N:-2}; SPEEDUP=${SPEEDUP:-4}; POLICY=${POLICY:-kv_aware}; WORKLOAD=${WORKLOAD:-mooncake}
TRACE=${TRACE:-$ROOT/../shared/data/mooncake_synthetic_trace.jsonl}
MAX_REQUESTS=${MAX_REQUESTS:-400}; RATE=${RATE:-2}; SCALE=${SCALE:-10}
PREFIX_GROUPS=${PREFIX_GROUPS:-40}; PROMPTS=${PROMPTS:-5}
QUEUE_TIMEOUT=${QUEUE_TIMEOUT:-3600}; RUNS=${RUNS:-alone fcfs vtc vtc-ep}; CONCURRENCY=${CONCURRENCY:-4096}
[ -n "${NO_BUILD:-}" ] || build -p kvroute-sim -p kvroute-gateway -p kvroute-bench --bins
KVROUTE=${KVROUTE:-$BIN/kvroute}
PORT=19800; EVENTS=19900; ROUTER=19880; METRICS=19890

case $WORKLOAD in
  mooncake) SOURCE=(--trace "$TRACE") ;;
  shared-prefix) SOURCE=(--synthetic shared-prefix --groups "$PREFIX_GROUPS" --prompts-per-group "$PROMPTS") ;;
  *) echo "WORKLOAD is mooncake or shared-prefix, not $WORKLOAD" >&2; exit 2 ;;
esac

HAS_FAIRNESS=
"$KVROUTE" --help 2>/dev/null | grep -q -- --router-queue-fairness && HAS_FAIRNESS=1

workers_yaml "$N" "$PORT" "$EVENTS" > "$LOGS/kvroute.yaml"

# run NAME SCALE [FAIRNESS [ep]]: fresh engines and router, one replay; its JSON in
# $LOGS/NAME.json. With ep, the engines schedule by priority and the router writes it.
run() {
  local name=$1 scale=$2 fairness=${3:-} flags=() sim_flags=()
  [ -n "$fairness" ] && flags=(--router-queue-fairness "$fairness")
  if [ "${4:-}" = ep ]; then
    flags+=(--engine-priority vllm); sim_flags=(--scheduling-policy priority)
  fi
  start_sims "$N" "$PORT" "$EVENTS" --speedup "$SPEEDUP" "${sim_flags[@]}" || return 1
  "$KVROUTE" --port "$ROUTER" --prometheus-port "$METRICS" --config "$LOGS/kvroute.yaml" \
    --policy "$POLICY" --log-level warn --trust-tenant-header \
    --router-queue-threshold 1 --router-queue-timeout-secs "$QUEUE_TIMEOUT" "${flags[@]}" \
    > "$LOGS/kvroute-$name.log" 2>&1 &
  local router=$!; pids+=("$router")
  wait_ready "http://127.0.0.1:$ROUTER/readiness" || { stop "$router"; stop_sims; return 1; }
  sleep 1 # the KV-event subscribers join
  local started=$SECONDS
  "$BIN/kvroute-bench" replay --url "http://127.0.0.1:$ROUTER" "${SOURCE[@]}" \
    --max-requests "$MAX_REQUESTS" --rate-scale "$RATE" --max-concurrency "$CONCURRENCY" \
    --tenants 2 --heavy-tenant-scale "$scale" --json "$LOGS/$name.json" \
    > "$LOGS/replay-$name.txt" 2> "$LOGS/replay-$name.err"
  local status=$?
  local queued; queued=$(metric_sum "http://127.0.0.1:$METRICS" kvroute_queue_wait_seconds_count)
  echo "$name: $((SECONDS - started)) s; $(head -1 "$LOGS/replay-$name.txt"); router queue: $queued queued" >&2
  stop "$router"; stop_sims
  return $status
}

echo "=== $(date -u +%FT%TZ) N=$N SPEEDUP=$SPEEDUP POLICY=$POLICY WORKLOAD=$WORKLOAD MAX_REQUESTS=$MAX_REQUESTS RATE=$RATE SCALE=$SCALE KVROUTE=$KVROUTE nproc=$(nproc) logs $LOGS"
for r in $RUNS; do
  case $r in
    alone) run alone 0 "${HAS_FAIRNESS:+fcfs}" ;;
    fcfs) run fcfs "$SCALE" "${HAS_FAIRNESS:+fcfs}" ;;
    vtc)
      if [ -z "$HAS_FAIRNESS" ]; then
        echo "vtc: skipped, $KVROUTE takes no --router-queue-fairness (a build with the priority scheduler does)" >&2
      else
        run vtc "$SCALE" vtc
      fi ;;
    vtc-ep)
      if ! "$KVROUTE" --help 2>/dev/null | grep -q -- --engine-priority; then
        echo "vtc-ep: skipped, $KVROUTE takes no --engine-priority" >&2
      else
        run vtc-ep "$SCALE" vtc ep
      fi ;;
    *) echo "unknown run $r (alone, fcfs, vtc, vtc-ep)" >&2; exit 2 ;;
  esac || echo "$r: FAILED (logs in $LOGS)" >&2
done

python3 - "$LOGS" "$SCALE" <<'EOF'
import json, os, sys
logs, scale = sys.argv[1], sys.argv[2]
runs = {}
for name in ("alone", "fcfs", "vtc", "vtc-ep"):
    path = os.path.join(logs, f"{name}.json")
    if os.path.exists(path):
        runs[name] = json.load(open(path))["policies"][0]
def light(r):
    return next((t for t in r.get("tenants", []) if t["tenant"] == "tenant-1"), None)
base = light(runs["alone"]) if "alone" in runs else None
print(f"| run | light requests (answered) | light TTFT p50 / p90 ms | vs alone p50, p90 | all requests (errors) | req/s | out tok/s |")
print("|---|---|---|---|---|---|---|")
for name, label in (("alone", "light alone"), ("fcfs", f"beside x{scale}, FCFS"), ("vtc", f"beside x{scale}, VTC"),
                    ("vtc-ep", f"beside x{scale}, VTC + engine priority")):
    r = runs.get(name)
    if r is None:
        print(f"| {label} | - | - | - | - | - | - |")
        continue
    t = light(r)
    ttft = t["ttft_ms"]
    ratio = "-"
    if base and base["ttft_ms"]["p50"] > 0 and base["ttft_ms"]["p90"] > 0:
        ratio = f'{ttft["p50"] / base["ttft_ms"]["p50"]:.1f}x, {ttft["p90"] / base["ttft_ms"]["p90"]:.1f}x'
    print(f'| {label} | {t["requests"]} ({t["answered"]}) | {ttft["p50"]:.0f} / {ttft["p90"]:.0f} | {ratio} '
          f'| {r["requests"]} ({r["errors"]}) | {r["throughput_rps"]:.2f} | {r["output_tokens_per_s"]:.0f} |')
for name in ("vtc", "vtc-ep"):
    if "fcfs" in runs and name in runs:
        f, v = runs["fcfs"], runs[name]
        print(f'cluster throughput {name}/fcfs: requests/s {v["throughput_rps"] / f["throughput_rps"]:.3f}, '
              f'output tokens/s {v["output_tokens_per_s"] / f["output_tokens_per_s"]:.3f}')
    else:
        print(f"cluster throughput {name}/fcfs: - (no {name} run)")
EOF
