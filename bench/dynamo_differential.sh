#!/usr/bin/env bash
# kvroute-bench simulate --timing-model dynamo against Dynamo 1.6.1's own offline replay (its
# mocker engines and its KV router, virtual time; bench/dynamo_replay_requests.py runs it as
# ../shared/peers/dynamo_replay.py does, keeping every request's figures) on the same trace and
# cluster: round robin and the two KV routers (Dynamo's kv_router, kvroute's kv_aware), each with
# the defaults (credit 1 / scale 1) and with credit 2 / scale 4, at each rate scale. Prints one
# table, percentiles by nearest rank on both sides (as kvroute-bench takes them); the round-robin
# rows are the parity check (same engine model, same routing), against Dynamo's figures taken both
# ways (nearest rank, and its summary's own estimator, the value at rank round((n-1)p)).
#   ../shared/peers/setup_peers.sh dyn        # once (~1 min)
#   bench/dynamo_differential.sh              # RATES="1 2 3 4 5" WORKERS=8 BLOCKS=16384
# Environment: TRACE (default ../shared/data/mooncake_synthetic_trace.jsonl), RATES, WORKERS,
# BLOCKS (of 16 tokens), MAX_REQUESTS (the first N requests only), OUT (where each run's JSON
# is kept; a run whose file is there is not run again), TIMEOUT (seconds per Dynamo run, 3600).
# About 20 s a run on 2 cores; the whole table (30 runs) in about 10 minutes.
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
PEERS_DIR=${PEERS_DIR:-/tmp/kvroute-peers}
TRACE=${TRACE:-$ROOT/../shared/data/mooncake_synthetic_trace.jsonl}
RATES=${RATES:-1 2 3 4 5}
WORKERS=${WORKERS:-8}
BLOCKS=${BLOCKS:-16384}
TIMEOUT=${TIMEOUT:-3600}
OUT=${OUT:-$LOGS}
mkdir -p "$OUT"
PY=$PEERS_DIR/venv-dyn/bin/python
[ -x "$PY" ] || { echo "no Dynamo: run ../shared/peers/setup_peers.sh dyn" >&2; exit 1; }
build -p kvroute-bench

trace=$TRACE
if [ -n "${MAX_REQUESTS:-}" ]; then
  trace=$OUT/trace-$MAX_REQUESTS.jsonl
  head -n "$MAX_REQUESTS" "$TRACE" > "$trace"
fi

dynamo() { # file args...
  local file=$1; shift
  [ -s "$file" ] && return 0
  timeout "$TIMEOUT" "$PY" "$ROOT/bench/dynamo_replay_requests.py" "$trace" "$WORKERS" \
    --blocks "$BLOCKS" "$@" > "$file.tmp" 2> "$file.log" && mv "$file.tmp" "$file" \
    || echo "Dynamo run $file failed or timed out (see $file.log)" >&2
}
kvroute() { # file args...
  local file=$1; shift
  [ -s "$file" ] && return 0
  "$BIN/kvroute-bench" simulate --trace "$trace" --workers "$WORKERS" --num-gpu-blocks "$BLOCKS" \
    --timing-model dynamo --json "$file" "$@" > "$file.log" 2>&1 \
    || echo "kvroute-bench run $file failed (see $file.log)" >&2
}

for r in $RATES; do
  kvroute "$OUT/kvroute-x$r-defaults.json" --rate-scale "$r" --policies round_robin,kv_aware
  kvroute "$OUT/kvroute-x$r-c2s4.json" --rate-scale "$r" --policies kv_aware \
    --router-kv-overlap-score-credit 2 --router-prefill-load-scale 4
  dynamo "$OUT/dynamo-x$r-defaults.jsonl" round_robin kv_router --speed "$r"
  dynamo "$OUT/dynamo-x$r-c2s4.jsonl" kv_router --speed "$r" --credit 2 --scale 4
done

python3 - "$OUT" "$RATES" <<'PY'
import json, os, sys
out, rates = sys.argv[1], sys.argv[2].split()
rows = {}  # (rate, router) -> figures
def fmt(v): return " / ".join(f"{x:.0f}" for x in v)
for r in rates:
    for cfg in ("defaults", "c2s4"):
        p = os.path.join(out, f"kvroute-x{r}-{cfg}.json")
        if os.path.exists(p):
            for pol in json.load(open(p))["policies"]:
                rr = pol["policy"] == "round_robin"
                name = "kvroute round_robin" if rr else f"kvroute kv_aware, {cfg}"
                t, e = pol["ttft_ms"], pol["e2e_ms"]
                rows[(r, name)] = dict(ttft=[t["p50"], t["p90"], t["p99"]], e2e=[e["p50"], e["p90"], e["p99"]],
                                       hit=pol["hit_share"], rps=pol["throughput_rps"], pre=pol["preemptions"])
        p = os.path.join(out, f"dynamo-x{r}-{cfg}.jsonl")
        if os.path.exists(p):
            for line in open(p):
                d = json.loads(line)
                name = "Dynamo round_robin" if d["mode"] == "round_robin" else f"Dynamo kv_router, {cfg}"
                rows[(r, name)] = dict(ttft=d["ttft_ms"], e2e=d["e2e_ms"], hit=d["hit"], rps=d["rps"],
                                       pre=d["preemptions"], ttft_dynamo=d["ttft_ms_dynamo"])
order = ["Dynamo round_robin", "kvroute round_robin", "Dynamo kv_router, defaults",
         "kvroute kv_aware, defaults", "Dynamo kv_router, c2s4", "kvroute kv_aware, c2s4"]
print("| rate | router | TTFT ms p50 / p90 / p99 | E2E ms p50 / p90 / p99 | hit % | req/s | preemptions |")
print("|---|---|---|---|---|---|---|")
for r in rates:
    for name in order:
        if (r, name) in rows:
            x = rows[(r, name)]
            label = name.replace("c2s4", "credit 2 / scale 4")
            print(f"| x{r} | {label} | {fmt(x['ttft'])} | {fmt(x['e2e'])} | {x['hit'] * 100:.1f} | {x['rps']:.2f} | {x['pre']} |")
    d, k = rows.get((r, "Dynamo round_robin")), rows.get((r, "kvroute round_robin"))
    if d and k:
        for how, theirs in (("nearest rank", d["ttft"]), ("Dynamo's summary", d["ttft_dynamo"])):
            gaps = [100.0 * (kv - dv) / dv for kv, dv in zip(k["ttft"], theirs)]
            ok = abs(gaps[0]) <= 3 and abs(gaps[1]) <= 3 and abs(gaps[2]) <= 5
            print(f"| x{r} | round-robin TTFT gap, Dynamo by {how} ({fmt(theirs)}) | "
                  + " / ".join(f"{g:+.1f}%" for g in gaps) + f" | | | | {'within' if ok else 'OUTSIDE'} 3/3/5% |")
PY
