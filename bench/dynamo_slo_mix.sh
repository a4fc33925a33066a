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
python3 "$ROOT/bench/goodput_table.py" "$OUT" "mix-$mix_tag-dynamo" \
  "Goodput of the mix $SLO_MIX, every class at $ATTAINMENT or more:" \
  "mix-$mix_tag-kvroute-send=kvroute kv_aware, targets send" \
  "mix-$mix_tag-kvroute-drop=kvroute kv_aware, targets drop"
