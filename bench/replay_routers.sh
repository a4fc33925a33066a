#!/usr/bin/env bash
# The Mooncake trace replayed in real time (`kvroute-bench replay`: streaming completions, one
# client for every row) through kvroute and the peer routers, each run in front of fresh
# engines (so every router meets cold caches), all on the same trace slice and speedup.
#
#   ../shared/peers/setup_peers.sh sgl vllmr smg dyn    # once; a peer whose venv is absent is skipped
#   bench/replay_routers.sh                             # N=400 SPEEDUP=10 WORKERS=4
#   ../shared/peers/setup_peers.sh envoy; GROUP=3 bench/replay_routers.sh
#                                                       # through Envoy with kvroute as its picker
#
# Two groups of rows, each printed as a table (TTFT and E2E p50/p90/p99, req/s, cached share
# of prompt tokens, errors):
#   1. kvroute-sim replicas in kvroute's own timing model, the fallback tokenizer (a letter a
#      token): kvroute kv_aware, round_robin, cache_aware; sglang-router 0.3.2, vllm-router
#      0.1.17 and smg 1.13, each cache_aware.
#   2. Dynamo's engine model, the tiny-llama BPE tokenizer (context raised to 262,144): NVIDIA
#      Dynamo 1.6.1's frontend with its mocker engines (`../shared/peers/run_dynamo.sh`, the
#      mockers in one process) under its KV router (defaults; overlap credit 2, prefill load
#      scale 4) and round robin; then kvroute-sim replicas with `--timing-model dynamo` and the
#      same tokenizer, block size, block count, batch limits and speedup, behind kvroute
#      (kv_aware defaults; kv_aware with Dynamo's model and defaults; round_robin; cache_aware;
#      llm_d) and
#      smg cache_aware.
#   3. Envoy in front (issue 28): kvroute-sim replicas as in group 1; kvroute kv_aware as the
#      proxy, then Envoy 1.40 with kvroute as its endpoint picker (`kvroute --epp`, ext_proc
#      over h2c, deploy/envoy/envoy.yaml with its ports moved), kv_aware and round_robin. The
#      picker reads the same KV events; both kv_aware rows should route alike.
# Dynamo's frontend sends no chunk for a token whose text decodes empty (most of its mocker's,
# with this tokenizer), so its rows ask for `nvext.worker_id` (`--extra-body`): then it sends a
# chunk per token, each naming its worker.
#
# env: N (requests from the trace's start, 400), SPEEDUP (engines' speedup and the trace's rate
# scale, 10), WORKERS (engines per row, 4), TRACE, PEERS_DIR (/tmp/kvroute-peers), GROUP (the
# groups to run, "1 2"), the engines' BLOCK_SIZE (16), NUM_BLOCKS (16384), MAX_BATCHED_TOKENS (8192),
# MAX_SEQS (256), RUN_DYNAMO (../shared/peers/run_dynamo.sh), DYN_LOG (Dynamo's log level, warn);
# ENVOY (group 3: setup_peers.sh's venv-envoy, else target/ci-tools/bin/envoy, else PATH's),
# ENVOY_CONCURRENCY (2); and lib.sh's BIN, LOGS (each row's logs and JSON stay there, as rowK.*).
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
PEERS_DIR=${PEERS_DIR:-/tmp/kvroute-peers}
export PEERS_DIR
N=${N:-400}; SPEEDUP=${SPEEDUP:-10}; WORKERS=${WORKERS:-4}; GROUP=${GROUP:-1 2}
BLOCK_SIZE=${BLOCK_SIZE:-16}; NUM_BLOCKS=${NUM_BLOCKS:-16384}
MAX_BATCHED_TOKENS=${MAX_BATCHED_TOKENS:-8192}; MAX_SEQS=${MAX_SEQS:-256}
TRACE=${TRACE:-$ROOT/../shared/data/mooncake_synthetic_trace.jsonl}
RUN_DYNAMO=${RUN_DYNAMO:-$ROOT/../shared/peers/run_dynamo.sh}
build -p kvroute-sim -p kvroute-gateway -p kvroute-bench

PORT=19190          # every router's HTTP port (and Dynamo's frontend's); metrics on PORT+1
SIM_PORT=19200      # engine i on SIM_PORT+i, its KV events on EVENTS+i
EVENTS=19300
URL=http://127.0.0.1:$PORT
workers_yaml "$WORKERS" $SIM_PORT $EVENTS > "$LOGS/kvroute.yaml"
W=()
for ((i = 0; i < WORKERS; i++)); do W+=("http://127.0.0.1:$((SIM_PORT + i))"); done
KVROUTE=("$BIN/kvroute" --port "$PORT" --prometheus-port "$((PORT + 1))" --config "$LOGS/kvroute.yaml"
         --log-level warn)
ENGINE=(--block-size "$BLOCK_SIZE" --num-gpu-blocks "$NUM_BLOCKS"
        --max-num-batched-tokens "$MAX_BATCHED_TOKENS" --max-num-seqs "$MAX_SEQS" --speedup "$SPEEDUP")

# The tiny-llama tokenizer with a context long enough for the trace's prompts (Dynamo's
# frontend refuses a prompt beyond the model's context).
TOK=$LOGS/tiny-llama-long
cp -r "$ROOT/testdata/tiny-llama" "$TOK"
sed -i 's/"max_position_embeddings": *[0-9]*/"max_position_embeddings": 262144/' "$TOK/config.json"
sed -i 's/"model_max_length": *[0-9]*/"model_max_length": 262144/' "$TOK/tokenizer_config.json"
DYN_MODEL=tiny

# Group 3: Envoy listens on PORT (admin PORT+5); kvroute --epp serves its HTTP API on PORT+2,
# ext_proc on PORT+3, gRPC health on PORT+4, metrics on PORT+1.
if [ -z "${ENVOY:-}" ]; then
  for e in "$PEERS_DIR/venv-envoy/bin/envoy" "$ROOT/target/ci-tools/bin/envoy" "$(command -v envoy)"; do
    [ -x "$e" ] && { ENVOY=$e; break; }
  done
fi
ENVOY=${ENVOY:-$PEERS_DIR/venv-envoy/bin/envoy}
ENVOY_CONCURRENCY=${ENVOY_CONCURRENCY:-2}
sed "s/port_value: 8081/port_value: $PORT/; s/port_value: 9901/port_value: $((PORT + 5))/; s/port_value: 9002/port_value: $((PORT + 3))/" \
  "$ROOT/deploy/envoy/envoy.yaml" > "$LOGS/envoy.yaml"
PICKER=("$BIN/kvroute" --epp --secure-serving=false --host 127.0.0.1 --port "$((PORT + 2))"
        --metrics-port "$((PORT + 1))" --grpc-port "$((PORT + 3))" --grpc-health-port "$((PORT + 4))"
        --config "$LOGS/kvroute.yaml" --log-level warn)

dyn_stop() { "$RUN_DYNAMO" stop -p $PORT >/dev/null 2>&1; }
trap 'cleanup; dyn_stop' EXIT

rows=()             # "group|label|engines|k" of each row measured, in order
k=0                 # row k's logs: $LOGS/rowk.*
replay() { # group label engines model [client flags...]
  local group=$1 label=$2 engines=$3 model=$4; shift 4
  printf "%-40s " "$label"
  "$BIN/kvroute-bench" replay --trace "$TRACE" --url "$URL" --max-requests "$N" \
     --rate-scale "$SPEEDUP" --max-concurrency 256 --model "$model" --json "$LOGS/row$k.json" \
     "$@" 2> "$LOGS/row$k.client.log"
  grep -h '^warning' "$LOGS/row$k.client.log"
  if [ -s "$LOGS/row$k.json" ]; then rows+=("$group|$label|$engines|$k"); fi
}
have() { # label path: whether path is there, else says why the row is skipped
  [ -e "$2" ] && return 0
  printf "%-40s skipped: %s absent (../shared/peers/setup_peers.sh)\n" "$1" "$2"
  return 1
}
run() { # group label engines model [sim flags...] -- router cmd...
  local group=$1 label=$2 engines=$3 model=$4 sim_flags=(); shift 4
  while [ "$1" != -- ]; do sim_flags+=("$1"); shift; done; shift
  have "$label" "$1" || return 0
  k=$((k + 1))
  start_sims "$WORKERS" $SIM_PORT $EVENTS "${ENGINE[@]}" "${sim_flags[@]}" \
    || { echo "$label: the engines did not start (see $LOGS/sim*.log)"; stop_sims; return 0; }
  "$@" > "$LOGS/row$k.log" 2>&1 & local pid=$!; pids+=("$pid")
  if wait_ready "$URL/v1/models"; then
    sleep 1
    replay "$group" "$label" "$engines" "$model"
  else
    echo "$label: did not start"; tail -5 "$LOGS/row$k.log"
  fi
  stop "$pid"; stop_sims; sleep 1
}
run_epp() { # label [picker flags...]: Envoy, kvroute --epp its endpoint picker
  local label=$1; shift
  have "$label" "$ENVOY" || return 0
  k=$((k + 1))
  start_sims "$WORKERS" $SIM_PORT $EVENTS "${ENGINE[@]}" \
    || { echo "$label: the engines did not start (see $LOGS/sim*.log)"; stop_sims; return 0; }
  "${PICKER[@]}" "$@" > "$LOGS/row$k.picker.log" 2>&1 & local picker=$!; pids+=("$picker")
  wait_ready "http://127.0.0.1:$((PORT + 2))/readiness"
  "$ENVOY" -c "$LOGS/envoy.yaml" --disable-hot-restart --concurrency "$ENVOY_CONCURRENCY" \
    --log-level warn > "$LOGS/row$k.log" 2>&1 & local pid=$!; pids+=("$pid")
  if wait_ready "$URL/v1/models"; then
    sleep 1
    replay 3 "$label" "kvroute-sim" kvroute-sim
  else
    echo "$label: did not start"; tail -5 "$LOGS/row$k.log" "$LOGS/row$k.picker.log"
  fi
  stop "$pid" "$picker"; stop_sims; sleep 1
}
run_dyn() { # label [run_dynamo.sh flags...] [-- frontend flags...]
  local label=$1; shift
  have "$label" "$PEERS_DIR/venv-dyn/bin/python" || return 0
  k=$((k + 1))
  if MOCKER_ARGS="--num-gpu-blocks-override $NUM_BLOCKS --max-num-batched-tokens $MAX_BATCHED_TOKENS --max-num-seqs $MAX_SEQS" \
     DYN_LOG=${DYN_LOG:-warn} "$RUN_DYNAMO" start -p $PORT -n "$WORKERS" -s "$SPEEDUP" -b "$BLOCK_SIZE" \
       -m "$TOK" -N "$DYN_MODEL" -1 "$@" > "$LOGS/row$k.log" 2>&1; then
    sleep 1
    replay 2 "$label" "Dynamo mocker" "$DYN_MODEL" --extra-body '{"nvext":{"extra_fields":["worker_id"]}}'
  else
    echo "$label: did not start"; tail -5 "$LOGS/row$k.log"
  fi
  dyn_stop; sleep 1
}

# One markdown table per group, from each row's JSON.
table() { # group
  local row group label engines i
  echo "| router | engines | TTFT ms p50 / p90 / p99 | E2E ms p50 / p90 / p99 | req/s | cached % | errors |"
  echo "|---|---|---|---|---|---|---|"
  for row in "${rows[@]}"; do
    IFS='|' read -r group label engines i <<< "$row"
    [ "$group" = "$1" ] || continue
    jq -r --arg l "$label" --arg e "$engines" '
      def ms: "\(.p50 | round) / \(.p90 | round) / \(.p99 | round)";
      def fixed($d): (. * pow(10; $d) | round | tostring) as $s      # $d decimals, $d >= 1
        | ("0" * ($d + 1 - ($s | length)) + $s) as $z | $z[:-$d] + "." + $z[-$d:];
      .policies[0]
      | "| \($l) | \($e) | \(.ttft_ms | ms) | \(.e2e_ms | ms) | \(.throughput_rps | fixed(2)) | \(.hit_share * 100 | fixed(1)) | \(.errors) |"' \
      "$LOGS/row$i.json"
  done
}

echo "=== $(date -u +%FT%TZ) N=$N SPEEDUP=$SPEEDUP WORKERS=$WORKERS nproc=$(nproc) logs $LOGS"
for group in $GROUP; do
  case $group in
    1)
      echo "--- 1: kvroute-sim, kvroute's timing model, fallback tokenizer"
      SIM="kvroute-sim"
      run 1 "kvroute kv_aware" "$SIM" kvroute-sim -- "${KVROUTE[@]}"
      run 1 "kvroute round_robin" "$SIM" kvroute-sim -- "${KVROUTE[@]}" --policy round_robin
      run 1 "kvroute cache_aware" "$SIM" kvroute-sim -- "${KVROUTE[@]}" --policy cache_aware
      # The venv's python3 (what its scripts' #! names; its `python` may be another); the venv
      # counts as there when it installed its CLI.
      have "sglang-router 0.3.2 cache_aware" "$PEERS_DIR/venv-sgl/bin/sglang-router" &&
      run 1 "sglang-router 0.3.2 cache_aware" "$SIM" kvroute-sim -- "$PEERS_DIR/venv-sgl/bin/python3" \
        -m sglang_router.launch_router --host 127.0.0.1 --port $PORT --prometheus-port $((PORT + 1)) \
        --worker-urls "${W[@]}" --policy cache_aware --log-level warn
      run 1 "vllm-router 0.1.17 cache_aware" "$SIM" kvroute-sim -- "$PEERS_DIR/venv-vllmr/bin/vllm-router" \
        --host 127.0.0.1 --port $PORT --prometheus-port $((PORT + 1)) --worker-urls "${W[@]}" \
        --policy cache_aware --log-level warning
      run 1 "smg 1.13 cache_aware" "$SIM" kvroute-sim -- "$PEERS_DIR/venv-smg/bin/smg" launch \
        --host 127.0.0.1 --port $PORT --prometheus-port $((PORT + 1)) --worker-urls "${W[@]}" \
        --policy cache_aware --log-level warn
      ;;
    2)
      echo "--- 2: Dynamo's engine model (Dynamo's mocker; kvroute-sim --timing-model dynamo), tiny-llama tokenizer"
      run_dyn "Dynamo kv"
      run_dyn "Dynamo kv credit 2 / scale 4" -- --router-kv-overlap-score-credit 2 --router-prefill-load-scale 4
      run_dyn "Dynamo round-robin" -r round-robin
      SIM="kvroute-sim (dynamo)"; DSIM=(--timing-model dynamo --tokenizer "$TOK")
      KVT=("${KVROUTE[@]}" --tokenizer "$TOK")
      run 2 "kvroute kv_aware (dynamo engines)" "$SIM" kvroute-sim "${DSIM[@]}" -- "${KVT[@]}"
      run 2 "kvroute kv_aware, Dynamo's model" "$SIM" kvroute-sim "${DSIM[@]}" -- "${KVT[@]}" \
        --router-cost-model weighted --router-kv-overlap-score-credit 1 --router-prefill-load-scale 1 \
        --router-prefill-interference-weight 0 --router-kv-overflow-weight 0
      run 2 "kvroute round_robin (dynamo engines)" "$SIM" kvroute-sim "${DSIM[@]}" -- "${KVT[@]}" --policy round_robin
      run 2 "kvroute cache_aware (dynamo engines)" "$SIM" kvroute-sim "${DSIM[@]}" -- "${KVT[@]}" --policy cache_aware
      run 2 "kvroute llm_d (dynamo engines)" "$SIM" kvroute-sim "${DSIM[@]}" -- "${KVT[@]}" --policy llm_d
      run 2 "smg 1.13 cache_aware (dynamo engines)" "$SIM" kvroute-sim "${DSIM[@]}" -- "$PEERS_DIR/venv-smg/bin/smg" \
        launch --host 127.0.0.1 --port $PORT --prometheus-port $((PORT + 1)) --worker-urls "${W[@]}" \
        --policy cache_aware --log-level warn
      ;;
    3)
      echo "--- 3: Envoy with kvroute as its endpoint picker, against kvroute as the proxy (kvroute-sim, fallback tokenizer)"
      run 3 "kvroute kv_aware (the proxy)" "kvroute-sim" kvroute-sim -- "${KVROUTE[@]}"
      run_epp "Envoy + kvroute --epp kv_aware"
      run_epp "Envoy + kvroute --epp round_robin" --policy round_robin
      ;;
    *) echo "unknown group $group (1, 2 or 3)"; exit 2 ;;
  esac
done
for group in $GROUP; do echo; echo "group $group:"; table "$group"; done
