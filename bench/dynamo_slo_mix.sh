# Sourced by bench/dynamo_differential.sh with SLO_MIX set: the goodput of a mix of TTFT targets,
# kvroute's routers against Dynamo's kv_router, in Dynamo's engine model (see that script).
# shellcheck shell=bash disable=SC2154
ATTAINMENT=${SLO_ATTAINMENT:-0.9}
mix_tag=$(printf '%s-%s' "$SLO_MIX" "$ATTAINMENT" | tr -c 'A-Za-z0-9.\n' '_')
mix_kvroute() { # file args...
  local file=$1; shift
  [ -s "$file" ] && return 0
  "$BIN/kvroute-bench" goodput --trace "$trace" --workers "$WORKERS" --num-gpu-blocks "$BLOCKS" \
    --timing-model dynamo --slo-mix "$SLO_MIX" --slo-attainment "$ATTAINMENT" --json "$file" "$@" \
    > "$file.log" 2>&1 || echo "kvroute-bench goodput $file failed (see $file.log)" >&2
}
mix_kvroute "$OUT/mix-$mix_tag-kvroute-send.json" --policies kv_aware,llm_d,round_robin --slo-headers send
mix_kvroute "$OUT/mix-$mix_tag-kvroute-drop.json" --policies kv_aware --slo-headers drop
for cfg in defaults c2s4; do
  extra=(); [ "$cfg" = c2s4 ] && extra=(--credit 2 --scale 4)
  [ -s "$OUT/mix-$mix_tag-dynamo-$cfg.json" ] || "$PY" "$ROOT/bench/dynamo_goodput.py" \
    "$OUT/mix-$mix_tag-dynamo-$cfg.json" "$trace" "$WORKERS" "$BLOCKS" "$cfg" "${extra[@]}" \
    --slo-mix "$SLO_MIX" --slo-attainment "$ATTAINMENT"
done
python3 - "$OUT" "$mix_tag" "$SLO_MIX" "$ATTAINMENT" <<'PY'
import json, os, sys
out, tag, mix, attainment = sys.argv[1:5]
rows = []
for routing in ("send", "drop"):
    p = os.path.join(out, f"mix-{tag}-kvroute-{routing}.json")
    if os.path.exists(p):
        for g in json.load(open(p)).get("policies", []):
            name = f"kvroute {g['policy']}" + (f", targets {routing}" if g["policy"] == "kv_aware" else "")
            rows.append((name, (g.get("pass") or {}).get("rate_scale"), (g.get("fail") or {}).get("rate_scale")))
for cfg in ("defaults", "c2s4"):
    p = os.path.join(out, f"mix-{tag}-dynamo-{cfg}.json")
    if os.path.exists(p):
        d = json.load(open(p))
        rows.append((f"Dynamo kv_router, {cfg.replace('c2s4', 'credit 2 / scale 4')}", d["pass_rate"], d["fail_rate"]))
best = max((r[1] or 0 for r in rows if r[0].startswith("Dynamo")), default=0)
print(f"\nGoodput of the mix {mix}, every class at {attainment} or more:")
print("| router | highest passing rate | lowest failing rate | vs Dynamo's best |")
print("|---|---|---|---|")
for name, lo, hi in rows:
    ratio = f"{lo / best:.2f}x" if lo and best else "-"
    f = lambda v: f"x{v:.3f}" if v else "-"
    print(f"| {name} | {f(lo)} | {f(hi)} | {ratio} |")
PY
