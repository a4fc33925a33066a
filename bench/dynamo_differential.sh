#!/usr/bin/env bash
# kvroute-bench simulate --timing-model dynamo against Dynamo 1.6.1's own offline replay (its
# mocker engines and its KV router, virtual time; bench/dynamo_replay_requests.py runs it as
# ../shared/peers/dynamo_replay.py does, keeping every request's figures) on the same trace and
# cluster: round robin and the two KV routers (Dynamo's kv_router with its defaults, credit 1 /
# scale 1, and with credit 2 / scale 4; kvroute's kv_aware with its defaults, and with Dynamo's
# cost model at both of Dynamo's settings), plus kvroute's llm_d and cache_aware and the pooled-LRU
# reference, at each rate scale. Prints one table, percentiles by nearest rank on both sides (as
# kvroute-bench takes them), then kv_aware's standing against issue 17's targets (its worst figure
# over Dynamo's better configuration, x4 E2E p90 over llm_d's, x5 TTFT p90 over Dynamo's best, x1
# p50 and hit share over the reference). The round-robin rows are the parity check (same engine
# model, same routing), against Dynamo's figures taken both ways (nearest rank, and its summary's
# own estimator, the value at rank round((n-1)p)).
#   ../shared/peers/setup_peers.sh dyn        # once (~1 min)
#   bench/dynamo_differential.sh              # RATES="1 2 3 4 5" WORKERS=8 BLOCKS=16384
# Environment: TRACE (default ../shared/data/mooncake_synthetic_trace.jsonl), RATES, WORKERS,
# BLOCKS (of 16 tokens), MAX_REQUESTS (the first N requests only), OUT (where each run's JSON
# is kept; a run whose file is there is not run again), TIMEOUT (seconds per Dynamo run, 3600),
# SEEDS (N > 1 also runs kv_aware under router seeds 1..N-1 and shows the median of the N runs
# of each figure with its worst ratio: one run's figures move by a few percent with the seed,
# see bench/noise_floor.py).
# 10-20 s a run on 2 cores; the whole table (20 runs) in about 10 minutes.
# SLO_MIX=0.3:1000,0.7:10000 [SLO_ATTAINMENT=0.9] then finds the goodput of a mix of TTFT
# targets (every class meets its own target for that share of its requests) in this engine model:
# kvroute-bench goodput --timing-model dynamo --slo-mix for kv_aware with its requests' targets
# (--slo-headers send) and without (drop), llm_d and round robin, and the same search over
# Dynamo's replay for its kv_router (both configurations; it routes on no target), each
# request's class taken as kvroute-bench takes it (mix64 of its index); one table of brackets.
# SLO_TTFT_P90_MS=2000 [SLO_E2E_P90_MS=N] then also finds each router's SLO goodput in this
# engine model: kvroute-bench goodput --timing-model dynamo for round robin, llm_d and kv_aware
# (its defaults, and Dynamo's model at both settings), and the same search (from x1, doubling or halving, then bisecting to 2% or 8
# steps) over Dynamo's replay for its kv_router (both configurations); one table of brackets.
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
  timeout "$TIMEOUT" "$PY" "$ROOT/bench/dynamo_replay_requests.py" "$trace" "$WORKERS" "$@" \
    --blocks "$BLOCKS" > "$file.tmp" 2> "$file.log" && mv "$file.tmp" "$file" \
    || echo "Dynamo run $file failed or timed out (see $file.log)" >&2
}
kvroute() { # file args...
  local file=$1; shift
  [ -s "$file" ] && return 0
  "$BIN/kvroute-bench" simulate --trace "$trace" --workers "$WORKERS" --num-gpu-blocks "$BLOCKS" \
    --timing-model dynamo --json "$file" "$@" > "$file.log" 2>&1 \
    || echo "kvroute-bench run $file failed (see $file.log)" >&2
}

# kv_aware with Dynamo's cost model (linear memory, no interference term), at Dynamo's defaults
# and at credit 2 / scale 4: the same routing as Dynamo's kv_router, in kvroute's core.
DYN_MODEL=(--router-cost-model weighted --router-kv-memory-cost linear --router-prefill-interference-weight 0 --router-kv-overflow-weight 0)
for r in $RATES; do
  kvroute "$OUT/kvroute-x$r-defaults.json" --rate-scale "$r" \
    --policies round_robin,kv_aware,llm_d,cache_aware
  kvroute "$OUT/kvroute-x$r-dynmodel.json" --rate-scale "$r" --policies kv_aware "${DYN_MODEL[@]}" \
    --router-kv-overlap-score-credit 1 --router-prefill-load-scale 1
  kvroute "$OUT/kvroute-x$r-dynmodel-c2s4.json" --rate-scale "$r" --policies kv_aware "${DYN_MODEL[@]}" \
    --router-kv-overlap-score-credit 2 --router-prefill-load-scale 4
  for ((s = 1; s < ${SEEDS:-1}; s++)); do
    kvroute "$OUT/kvroute-x$r-seed$s.json" --rate-scale "$r" --policies kv_aware --seed "$s"
  done
  dynamo "$OUT/dynamo-x$r-defaults.jsonl" round_robin kv_router --speed "$r"
  dynamo "$OUT/dynamo-x$r-c2s4.jsonl" kv_router --speed "$r" --credit 2 --scale 4
done

python3 - "$OUT" "$RATES" "${SEEDS:-1}" <<'PY'
import json, os, statistics, sys
out, rates, seeds = sys.argv[1], sys.argv[2].split(), int(sys.argv[3])
rows = {}  # (rate, router) -> figures
def fmt(v): return " / ".join(f"{x:.0f}" for x in v)
def figures(t, e, **kw): return dict(ttft=[t["p50"], t["p90"], t["p99"]], e2e=[e["p50"], e["p90"], e["p99"]], **kw)
kv_label = {"defaults": "kvroute kv_aware", "dynmodel": "kvroute kv_aware, Dynamo's model, defaults",
            "dynmodel-c2s4": "kvroute kv_aware, Dynamo's model, credit 2 / scale 4"}
for r in rates:
    for cfg, label in kv_label.items():
        p = os.path.join(out, f"kvroute-x{r}-{cfg}.json")
        if not os.path.exists(p):
            continue
        d = json.load(open(p))
        for pol in d["policies"]:
            name = label if pol["policy"] == "kv_aware" else f"kvroute {pol['policy']}"
            rows[(r, name)] = figures(pol["ttft_ms"], pol["e2e_ms"], hit=pol["hit_share"],
                                      rps=pol["throughput_rps"], pre=pol["preemptions"])
        ref = d.get("reference")
        if ref and cfg == "defaults":
            rows[(r, "pooled-LRU reference")] = figures(ref["ttft_ms"], ref["e2e_ms"], hit=ref["hit_share"],
                                                        rps=float("nan"), pre="-")
    runs = [rows.get((r, "kvroute kv_aware"))]
    for seed in range(1, seeds):
        p = os.path.join(out, f"kvroute-x{r}-seed{seed}.json")
        if os.path.exists(p):
            pol = json.load(open(p))["policies"][0]
            runs.append(figures(pol["ttft_ms"], pol["e2e_ms"], hit=pol["hit_share"],
                                rps=pol["throughput_rps"], pre=pol["preemptions"]))
    if seeds > 1 and all(runs) and len(runs) == seeds:
        med = lambda key: [statistics.median(x[key][i] for x in runs) for i in range(3)]
        rows[(r, "kvroute kv_aware, median of seeds")] = dict(
            ttft=med("ttft"), e2e=med("e2e"), hit=statistics.median(x["hit"] for x in runs),
            rps=statistics.median(x["rps"] for x in runs), pre="-")
    for cfg in ("defaults", "c2s4"):
        p = os.path.join(out, f"dynamo-x{r}-{cfg}.jsonl")
        if os.path.exists(p):
            for line in open(p):
                d = json.loads(line)
                name = "Dynamo round_robin" if d["mode"] == "round_robin" else f"Dynamo kv_router, {cfg}"
                rows[(r, name)] = dict(ttft=d["ttft_ms"], e2e=d["e2e_ms"], hit=d["hit"], rps=d["rps"],
                                       pre=d["preemptions"], ttft_dynamo=d["ttft_ms_dynamo"])
order = ["Dynamo round_robin", "kvroute round_robin", "Dynamo kv_router, defaults",
         "Dynamo kv_router, c2s4", kv_label["dynmodel"], kv_label["dynmodel-c2s4"], "kvroute kv_aware",
         "kvroute kv_aware, median of seeds", "kvroute llm_d", "kvroute cache_aware", "pooled-LRU reference"]
print("| rate | router | TTFT ms p50 / p90 / p99 | E2E ms p50 / p90 / p99 | hit % | req/s | preemptions |")
print("|---|---|---|---|---|---|---|")
checks = []
for r in rates:
    for name in order:
        if (r, name) in rows:
            x = rows[(r, name)]
            label = name.replace("c2s4", "credit 2 / scale 4").replace("of seeds", f"of {seeds} seeds")
            rps = "-" if x["rps"] != x["rps"] else f"{x['rps']:.2f}"
            print(f"| x{r} | {label} | {fmt(x['ttft'])} | {fmt(x['e2e'])} | {x['hit'] * 100:.1f} | {rps} | {x['pre']} |")
    d, k = rows.get((r, "Dynamo round_robin")), rows.get((r, "kvroute round_robin"))
    if d and k:
        for how, theirs in (("nearest rank", d["ttft"]), ("Dynamo's summary", d["ttft_dynamo"])):
            gaps = [100.0 * (kv - dv) / dv for kv, dv in zip(k["ttft"], theirs)]
            ok = abs(gaps[0]) <= 3 and abs(gaps[1]) <= 3 and abs(gaps[2]) <= 5
            print(f"| x{r} | round-robin TTFT gap, Dynamo by {how} ({fmt(theirs)}) | "
                  + " / ".join(f"{g:+.1f}%" for g in gaps) + f" | | | | {'within' if ok else 'OUTSIDE'} 3/3/5% |")
    # The issue's targets for kv_aware (defaults) against the better Dynamo configuration,
    # figure by figure, llm_d and the reference.
    kv = rows.get((r, "kvroute kv_aware"))
    dyn = [rows[(r, n)] for n in ("Dynamo kv_router, defaults", "Dynamo kv_router, c2s4") if (r, n) in rows]
    if kv and dyn:
        worst = max(kv[m][i] / min(x[m][i] for x in dyn) for m in ("ttft", "e2e") for i in range(3))
        checks.append(f"x{r}: kv_aware's worst figure / Dynamo's best: {worst:.3f}x (target <= 1.02x)")
        med = rows.get((r, "kvroute kv_aware, median of seeds"))
        if med:
            worst = max(med[m][i] / min(x[m][i] for x in dyn) for m in ("ttft", "e2e") for i in range(3))
            checks.append(f"x{r}: the same, the median of {seeds} router seeds: {worst:.3f}x")
        if r == "5":
            checks.append(f"x5: TTFT p90 / Dynamo's best: {kv['ttft'][1] / min(x['ttft'][1] for x in dyn):.2f}x (target <= 0.6x)")
    ll, ref = rows.get((r, "kvroute llm_d")), rows.get((r, "pooled-LRU reference"))
    if kv and ll and r == "4":
        checks.append(f"x4: E2E p90 / llm_d's: {kv['e2e'][1] / ll['e2e'][1]:.2f}x (target <= 1x)")
    if kv and ref and r == "1":
        checks.append(f"x1: TTFT p50 / reference: {kv['ttft'][0] / ref['ttft'][0]:.2f}x (target <= 1.2x); "
                      f"hit share / reference: {kv['hit'] / ref['hit']:.3f} (target >= 0.95)")
print()
for c in checks:
    print("- " + c)
PY

[ -n "${SLO_MIX:-}" ] && . "$ROOT/bench/dynamo_slo_mix.sh"
[ -n "${SLO_TTFT_P90_MS:-}" ] || exit 0
slo=(--slo-ttft-p90-ms "$SLO_TTFT_P90_MS")
[ -n "${SLO_E2E_P90_MS:-}" ] && slo+=(--slo-e2e-p90-ms "$SLO_E2E_P90_MS")
goodput_kvroute() { # file args...
  local file=$1; shift
  [ -s "$file" ] && return 0
  "$BIN/kvroute-bench" goodput --trace "$trace" --workers "$WORKERS" --num-gpu-blocks "$BLOCKS" \
    --timing-model dynamo "${slo[@]}" --json "$file" "$@" > "$file.log" 2>&1 \
    || echo "kvroute-bench goodput $file failed (see $file.log)" >&2
}
goodput_kvroute "$OUT/goodput-kvroute-defaults.json" --policies kv_aware,round_robin,llm_d
goodput_kvroute "$OUT/goodput-kvroute-dynmodel.json" --policies kv_aware "${DYN_MODEL[@]}" \
  --router-kv-overlap-score-credit 1 --router-prefill-load-scale 1
goodput_kvroute "$OUT/goodput-kvroute-dynmodel-c2s4.json" --policies kv_aware "${DYN_MODEL[@]}" \
  --router-kv-overlap-score-credit 2 --router-prefill-load-scale 4
# Dynamo's side: the same search, one replay per rate.
dyn_p90=(--ttft-p90-ms "$SLO_TTFT_P90_MS")
[ -n "${SLO_E2E_P90_MS:-}" ] && dyn_p90+=(--e2e-p90-ms "$SLO_E2E_P90_MS")
for cfg in defaults c2s4; do
  extra=(); [ "$cfg" = c2s4 ] && extra=(--credit 2 --scale 4)
  [ -s "$OUT/goodput-dynamo-$cfg.json" ] || "$PY" "$ROOT/bench/dynamo_goodput.py" \
    "$OUT/goodput-dynamo-$cfg.json" "$trace" "$WORKERS" "$BLOCKS" "$cfg" "${extra[@]}" "${dyn_p90[@]}"
done
python3 "$ROOT/bench/goodput_table.py" "$OUT" goodput-dynamo "" \
  "goodput-kvroute-defaults=kvroute kv_aware" \
  "goodput-kvroute-dynmodel=kvroute kv_aware, Dynamo's model, defaults" \
  "goodput-kvroute-dynmodel-c2s4=kvroute kv_aware, Dynamo's model, credit 2 / scale 4"
