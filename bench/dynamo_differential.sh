#!/usr/bin/env bash
# kvroute-bench simulate --timing-model dynamo against Dynamo 1.6.1's own offline replay (its
# mocker engines and its KV router, virtual time) on the same trace and cluster: round robin and
# the two KV routers (Dynamo's kv_router, kvroute's kv_aware), each with the defaults (credit 1 /
# scale 1) and with credit 2 / scale 4, at each rate scale. Prints one table; the round-robin rows
# are the parity check (same engine model, same routing: they should agree).
#   ../shared/peers/setup_peers.sh dyn        # once (~1 min)
#   bench/dynamo_differential.sh              # RATES="1 2 3 4 5" WORKERS=8 BLOCKS=16384
# Environment: TRACE (default ../shared/data/mooncake_synthetic_trace.jsonl), RATES, WORKERS,
# BLOCKS (of 16 tokens), MAX_REQUESTS (the first N requests only), OUT (where each run's JSON
# is kept; a run whose file is there is not run again), TIMEOUT (seconds per Dynamo run, 3600).
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
  timeout "$TIMEOUT" "$PY" "$ROOT/../shared/peers/dynamo_replay.py" "$trace" "$WORKERS" \
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
rows = {}  # (rate, router) -> (ttft, e2e, hit, rps)
def fmt(v): return "/".join(f"{x:.0f}" for x in v)
for r in rates:
    for cfg in ("defaults", "c2s4"):
        p = os.path.join(out, f"kvroute-x{r}-{cfg}.json")
        if os.path.exists(p):
            for pol in json.load(open(p))["policies"]:
                name = pol["policy"] if pol["policy"] == "round_robin" else f"kvroute kv_aware, {cfg}"
                name = "kvroute round_robin" if name == "round_robin" else name
                t, e = pol["ttft_ms"], pol["e2e_ms"]
                rows[(r, name)] = ([t["p50"], t["p90"], t["p99"]], [e["p50"], e["p90"], e["p99"]],
                                   pol["hit_share"], pol["throughput_rps"])
        p = os.path.join(out, f"dynamo-x{r}-{cfg}.jsonl")
        if os.path.exists(p):
            for line in open(p):
                d = json.loads(line)
                name = "Dynamo round_robin" if d["mode"] == "round_robin" else f"Dynamo kv_router, {cfg}"
                rows[(r, name)] = (d["ttft_ms"], d["e2e_ms"], d["hit"], d["rps"])
order = ["Dynamo round_robin", "kvroute round_robin", "Dynamo kv_router, defaults",
         "kvroute kv_aware, defaults", "Dynamo kv_router, c2s4", "kvroute kv_aware, c2s4"]
print("| rate | router (engines: Dynamo's mocker / kvroute-sim --timing-model dynamo) | TTFT ms p50 / p90 / p99 | E2E ms p50 / p90 / p99 | hit % | req/s |")
print("|---|---|---|---|---|---|")
for r in rates:
    for name in order:
        if (r, name) in rows:
            t, e, hit, rps = rows[(r, name)]
            label = name.replace("c2s4", "credit 2 / scale 4")
            print(f"| x{r} | {label} | {fmt(t)} | {fmt(e)} | {hit * 100:.1f} | {rps:.2f} |")
    d, k = rows.get((r, "Dynamo round_robin")), rows.get((r, "kvroute round_robin"))
    if d and k:
        gaps = [100.0 * (kv - dv) / dv for kv, dv in zip(k[0], d[0])]
        ok = abs(gaps[0]) <= 3 and abs(gaps[1]) <= 3 and abs(gaps[2]) <= 5
        print(f"| x{r} | round-robin parity (kvroute vs Dynamo) | "
              + " / ".join(f"{g:+.1f}%" for g in gaps) + f" | | | {'within' if ok else 'OUTSIDE'} 3/3/5% |")
PY
