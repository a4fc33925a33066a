#!/usr/bin/env bash
# Router overhead, side by side in one run: wrk against two fast mock engines directly, then
# through nginx (a plain round-robin proxy, the yardstick), kvroute, sglang-router, vllm-router
# and smg (round_robin each, same mocks, same flags). Prints req/s, p50, p99 at concurrency 1
# and 64 and the router's CPU time per request (its process and children, from /proc).
#
#   ../shared/peers/setup_peers.sh sgl vllmr smg wrk # once: the peers, the mocks' venv, wrk
#   apt-get install nginx-light                      # once: the yardstick
#   bench/overhead.sh                                # DUR=10 POLICY=round_robin ROUTERS="nginx kvroute sglang vllm smg"
#   ROUTERS="kvroute kvroute-nomig" bench/overhead.sh  # kvroute with and without --migration-limit 0
#   KVROUTE_BASE=/tmp/old/kvroute ROUTERS="nginx kvroute-base kvroute" bench/overhead.sh
#                                                    # another build beside this one, same run
#   ROUTERS="nginx kvroute-kv" bench/overhead.sh     # kvroute kv_aware (fallback tokenizer), any POLICY
#   ROUTERS="nginx kvroute kvroute-1t" bench/overhead.sh  # and with one runtime thread, like nginx's one worker
#   ROUTERS="kvroute kvroute-overload kvroute-kv kvroute-kv-overload" bench/overhead.sh
#                                                    # smg's overload protection off and on
#   ROUTERS="kvroute kvroute-trace kvroute-trace-10 kvroute-trace-away" bench/overhead.sh
#                                                    # tracing off, on (every request, then one in
#                                                    # ten, to a sink collector, bench/otlp_sink.py),
#                                                    # and on with the collector away (all dropped)
#
#   ../shared/peers/setup_peers.sh envoy            # once: Envoy 1.40 (or ENVOY=path/to/envoy)
#   ROUTERS="envoy envoy-epp envoy-epp-kv kvroute" bench/overhead.sh
#                                                    # kvroute as the endpoint picker behind Envoy
#                                                    # (issue 28): Envoy round robin alone (a STATIC
#                                                    # cluster of the mocks, no ext_proc), Envoy with
#                                                    # `kvroute --epp` (deploy/envoy/envoy.yaml, h2c)
#                                                    # under POLICY and under kv_aware, and kvroute as
#                                                    # the proxy. cpu_us/req is then kvroute's (the
#                                                    # picker's), envoy_us/req Envoy's; for `envoy`,
#                                                    # cpu_us/req is Envoy's. ENVOY_CONCURRENCY (2) is
#                                                    # Envoy's worker threads. With an envoy-epp row
#                                                    # the mocks are bench/fast_mock_chunked.py (Envoy
#                                                    # sends the picked request's body chunked), for
#                                                    # every row of that run.
#
# REPEAT=N runs the router list N times in a row (the mocks stay up), for the spread.
#
# All traffic stays on 127.0.0.1. Results are appended to $OUT (default bench/overhead-results.txt).
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
PEERS_DIR=${PEERS_DIR:-/tmp/kvroute-peers}
SHARED=${SHARED:-$ROOT/../shared/peers}
DUR=${DUR:-10}
POLICY=${POLICY:-round_robin}
ROUTERS=${ROUTERS:-nginx kvroute sglang vllm smg}
REPEAT=${REPEAT:-1}
OUT=${OUT:-$ROOT/bench/overhead-results.txt}
M1=19001; M2=19002; RP=30013
# The endpoint picker's rows: Envoy listens on RP (admin on EADMIN); kvroute --epp serves
# ext_proc on GRPC (gRPC health on GRPC+1) and its HTTP API on GRPC+2.
GRPC=30014; EADMIN=30017
ENVOY_CONCURRENCY=${ENVOY_CONCURRENCY:-2}
PY="$PEERS_DIR/venv-sgl/bin/python"
MOCK=$SHARED/fast_mock.py
case " $ROUTERS " in *" envoy-epp"*) MOCK=$ROOT/bench/fast_mock_chunked.py ;; esac

command -v wrk >/dev/null || { echo "wrk missing: $SHARED/setup_peers.sh wrk"; exit 1; }
[ -x "$PY" ] || { echo "peers missing: $SHARED/setup_peers.sh sgl vllmr wrk"; exit 1; }
# KVROUTE=path/to/kvroute measures another build (an older commit's, say) in the same way;
# without it this checkout is built.
[ -n "${KVROUTE:-}" ] || build -p kvroute-gateway
KVROUTE=${KVROUTE:-$BIN/kvroute}
KVROUTE_BASE=${KVROUTE_BASE:-}
# Envoy: ENVOY, else setup_peers.sh's, else CI's (target/ci-tools), else on PATH.
if [ -z "${ENVOY:-}" ]; then
  for e in "$PEERS_DIR/venv-envoy/bin/envoy" "$ROOT/target/ci-tools/bin/envoy" "$(command -v envoy)"; do
    [ -x "$e" ] && { ENVOY=$e; break; }
  done
fi
ENVOY=${ENVOY:-}

# Ready: answers a chat completion.
chat_ready() {
  wait_ready "$1/v1/chat/completions" -XPOST -H 'content-type: application/json' \
    -d '{"model":"mock-model","messages":[{"role":"user","content":"warm"}]}'
}
# utime+stime of a process and its children (nginx's worker, a launcher's server).
cpu_ticks() {
  [ -n "${1:-}" ] || { echo 0; return; }
  local t=0 p
  for p in "$1" $(pgrep -P "$1"); do
    [ -r "/proc/$p/stat" ] && t=$((t + $(awk '{print $14+$15}' "/proc/$p/stat")))
  done
  echo $t
}

per_req() { # ticks requests: CPU µs per request
  python3 -c "print(round($1*1e6/$(getconf CLK_TCK)/max(1,${2:-1}),1))"
}
run_wrk() { # label url [pid] [envoy's pid, when pid is its endpoint picker]
  local label=$1 url=$2 pid=${3:-} epid=${4:-}
  for c in 1 64; do
    local t=1; [ "$c" -gt 1 ] && t=2
    local c0 e0; c0=$(cpu_ticks "$pid"); e0=$(cpu_ticks "$epid")
    wrk -t$t -c$c -d"${DUR}s" --latency -s "$SHARED/post_chat.lua" "$url" > "$LOGS/wrk.txt" 2>&1
    local c1 e1; c1=$(cpu_ticks "$pid"); e1=$(cpu_ticks "$epid")
    local n; n=$(awk '/requests in/{print $1}' "$LOGS/wrk.txt")
    local cpu="-" ecpu=""
    [ -n "$pid" ] && cpu=$(per_req $((c1 - c0)) "$n")
    [ -n "$epid" ] && ecpu="envoy_us/req=$(per_req $((e1 - e0)) "$n") "
    local rps p50 p99 errs
    rps=$(awk '/Requests\/sec/{print $2}' "$LOGS/wrk.txt")
    p50=$(awk '$1=="50%"{print $2}' "$LOGS/wrk.txt")
    p99=$(awk '$1=="99%"{print $2}' "$LOGS/wrk.txt")
    errs=$(grep -E 'Non-2xx|Socket errors' "$LOGS/wrk.txt" | tr '\n' ' ')
    printf "%-26s c=%-3s rps=%-10s p50=%-9s p99=%-9s cpu_us/req=%-6s %s%s\n" "$label" "$c" "$rps" "$p50" "$p99" "$cpu" "$ecpu" "$errs" | tee -a "$OUT"
  done
}

# The tracing runs' collector: bench/otlp_sink.py on 4318, listening before kvroute starts.
start_sink() {
  python3 "$ROOT/bench/otlp_sink.py" 4318 > "$LOGS/otlp-sink.log" 2>&1 & pids+=($!)
  sink=$!
  for _ in $(seq 100); do (echo > /dev/tcp/127.0.0.1/4318) 2>/dev/null && return; sleep 0.05; done
  echo "the OTLP sink did not start"; exit 1
}

# Envoy round robin alone: the listener of deploy/envoy/envoy.yaml, no ext_proc filter, a
# STATIC cluster of the two mocks.
envoy_rr_yaml() {
  cat <<YAML
admin:
  address:
    socket_address: { address: 127.0.0.1, port_value: $EADMIN }
static_resources:
  listeners:
    - name: inference
      address:
        socket_address: { address: 127.0.0.1, port_value: $RP }
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: inference
                route_config:
                  name: inference
                  virtual_hosts:
                    - name: all
                      domains: ["*"]
                      routes:
                        - match: { prefix: "/" }
                          route: { cluster: model_servers, timeout: 0s, idle_timeout: 0s }
                http_filters:
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: model_servers
      type: STATIC
      lb_policy: ROUND_ROBIN
      connect_timeout: 10s
      load_assignment:
        cluster_name: model_servers
        endpoints:
          - lb_endpoints:
              - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $M1 } } }
              - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $M2 } } }
YAML
}
# Envoy with kvroute as its endpoint picker: deploy/envoy/envoy.yaml, its ports moved.
envoy_epp_yaml() {
  sed "s/port_value: 8081/port_value: $RP/; s/port_value: 9901/port_value: $EADMIN/; s/port_value: 9002/port_value: $GRPC/" \
    "$ROOT/deploy/envoy/envoy.yaml"
}
start_envoy() { # config
  "$ENVOY" -c "$1" --disable-hot-restart --concurrency "$ENVOY_CONCURRENCY" --log-level warn \
    > "$LOGS/$r.log" 2>&1 &
}
# kvroute as the endpoint picker (h2c ext_proc), the mocks its static endpoints; pid in `picker`.
start_picker() { # policy
  "$KVROUTE" --epp --secure-serving=false --grpc-port $GRPC --grpc-health-port $((GRPC + 1)) \
    --host 127.0.0.1 --port $((GRPC + 2)) --metrics-port 29013 --log-level warn \
    --worker-urls http://127.0.0.1:$M1 http://127.0.0.1:$M2 --policy "$1" > "$LOGS/$r-picker.log" 2>&1 &
  picker=$!; pids+=("$picker")
  wait_ready "http://127.0.0.1:$((GRPC + 2))/readiness" || tail -5 "$LOGS/$r-picker.log"
}

echo "=== $(date -u +%FT%TZ) DUR=${DUR}s nproc=$(nproc) policy=$POLICY mock=$(basename "$MOCK")" | tee -a "$OUT"
for p in $M1 $M2; do "$PY" "$MOCK" "$p" "f$p" > "$LOGS/mock-$p.log" 2>&1 & pids+=($!); done
chat_ready http://127.0.0.1:$M1 && run_wrk direct-mock http://127.0.0.1:$M1

kvroute_flags=(--host 127.0.0.1 --port "$RP" --worker-urls "http://127.0.0.1:$M1" "http://127.0.0.1:$M2"
  --prometheus-port 29013 --log-level warn)
for round in $(seq 1 "$REPEAT"); do
for r in $ROUTERS; do
  [ "$REPEAT" -gt 1 ] && echo "--- round $round: $r" >> "$OUT"
  picker=""
  case $r in envoy*) [ -x "$ENVOY" ] || { echo "$r: Envoy missing: $SHARED/setup_peers.sh envoy, or ENVOY"; continue; } ;; esac
  case $r in
    kvroute) "$KVROUTE" "${kvroute_flags[@]}" --policy "$POLICY" > "$LOGS/$r.log" 2>&1 & ;;
    # A second build (KVROUTE_BASE), measured beside this one.
    kvroute-base)
      [ -x "$KVROUTE_BASE" ] || { echo "kvroute-base: set KVROUTE_BASE to a kvroute binary"; continue; }
      "$KVROUTE_BASE" "${kvroute_flags[@]}" --policy "$POLICY" > "$LOGS/$r.log" 2>&1 & ;;
    # One runtime thread (tokio reads TOKIO_WORKER_THREADS), as nginx runs one worker here.
    kvroute-1t) TOKIO_WORKER_THREADS=1 "$KVROUTE" "${kvroute_flags[@]}" --policy "$POLICY" > "$LOGS/$r.log" 2>&1 & ;;
    kvroute-1t-kv) TOKIO_WORKER_THREADS=1 "$KVROUTE" "${kvroute_flags[@]}" --policy kv_aware > "$LOGS/$r.log" 2>&1 & ;;
    # The same with migration off: what reading non-streaming answers whole costs.
    kvroute-nomig) "$KVROUTE" "${kvroute_flags[@]}" --policy "$POLICY" --migration-limit 0 > "$LOGS/$r.log" 2>&1 & ;;
    # Every request traced (ratio 1.0), exported over OTLP/HTTP to a sink that reads and drops.
    kvroute-trace)
      start_sink
      "$KVROUTE" "${kvroute_flags[@]}" --policy "$POLICY" --otlp-traces-endpoint http://127.0.0.1:4318 > "$LOGS/$r.log" 2>&1 & ;;
    # One request in ten traced (--otlp-sampling-ratio 0.1), to the same sink.
    kvroute-trace-10)
      start_sink
      "$KVROUTE" "${kvroute_flags[@]}" --policy "$POLICY" --otlp-traces-endpoint http://127.0.0.1:4318 \
        --otlp-sampling-ratio 0.1 > "$LOGS/$r.log" 2>&1 & ;;
    # Traced, the collector away: every export fails and its spans are dropped.
    kvroute-trace-away)
      "$KVROUTE" "${kvroute_flags[@]}" --policy "$POLICY" --otlp-traces-endpoint http://127.0.0.1:9 > "$LOGS/$r.log" 2>&1 & ;;
    # smg's worker overload protection on (its thresholds, 8 waiting and 0.8 KV usage): the
    # engines' /metrics scraped every 50 ms and each request's workers checked.
    kvroute-overload) "$KVROUTE" "${kvroute_flags[@]}" --policy "$POLICY" --worker-overload-protection > "$LOGS/$r.log" 2>&1 & ;;
    kvroute-kv-overload) "$KVROUTE" "${kvroute_flags[@]}" --policy kv_aware --worker-overload-protection > "$LOGS/$r.log" 2>&1 & ;;
    # kv_aware with the fallback tokenizer (no --tokenizer, no KV events: routed blocks are recorded).
    kvroute-kv) "$KVROUTE" "${kvroute_flags[@]}" --policy kv_aware > "$LOGS/$r.log" 2>&1 & ;;
    kvroute-base-kv)
      [ -x "$KVROUTE_BASE" ] || { echo "kvroute-base-kv: set KVROUTE_BASE to a kvroute binary"; continue; }
      "$KVROUTE_BASE" "${kvroute_flags[@]}" --policy kv_aware > "$LOGS/$r.log" 2>&1 & ;;
    # nginx round robin whatever POLICY: one worker process, keep-alive to the mocks.
    nginx)
      command -v nginx >/dev/null || { echo "nginx missing: apt-get install nginx-light"; continue; }
      sed "s#@DIR@#$LOGS#; s#@PORT@#$RP#; s#@B1@#127.0.0.1:$M1#; s#@B2@#127.0.0.1:$M2#" \
        "$SHARED/nginx_rr.conf" > "$LOGS/nginx.conf"
      nginx -c "$LOGS/nginx.conf" -g 'daemon off;' > "$LOGS/$r.log" 2>&1 & ;;
    sglang)  "$PEERS_DIR/venv-sgl/bin/python" -m sglang_router.launch_router --host 127.0.0.1 --port $RP \
               --worker-urls http://127.0.0.1:$M1 http://127.0.0.1:$M2 --policy "$POLICY" \
               --prometheus-host 127.0.0.1 --prometheus-port 29013 --log-level warn > "$LOGS/$r.log" 2>&1 & ;;
    vllm)    "$PEERS_DIR/venv-vllmr/bin/vllm-router" --host 127.0.0.1 --port $RP \
               --worker-urls http://127.0.0.1:$M1 http://127.0.0.1:$M2 --policy "$POLICY" \
               --prometheus-host 127.0.0.1 --prometheus-port 29013 --log-level warning > "$LOGS/$r.log" 2>&1 & ;;
    # smg 1.13 (SGLang's gateway now); venv-sgl's `smg` is sglang-router's, not this one.
    smg)     "$PEERS_DIR/venv-smg/bin/smg" launch --host 127.0.0.1 --port $RP \
               --worker-urls http://127.0.0.1:$M1 http://127.0.0.1:$M2 --policy "$POLICY" \
               --prometheus-host 127.0.0.1 --prometheus-port 29013 --log-level warn > "$LOGS/$r.log" 2>&1 & ;;
    # Envoy round robin alone (whatever POLICY), then Envoy asking kvroute --epp.
    envoy) envoy_rr_yaml > "$LOGS/$r.yaml"; start_envoy "$LOGS/$r.yaml" ;;
    envoy-epp) start_picker "$POLICY"; envoy_epp_yaml > "$LOGS/$r.yaml"; start_envoy "$LOGS/$r.yaml" ;;
    envoy-epp-kv) start_picker kv_aware; envoy_epp_yaml > "$LOGS/$r.yaml"; start_envoy "$LOGS/$r.yaml" ;;
    *) echo "unknown router $r"; continue ;;
  esac
  pid=$!; pids+=("$pid")
  label="$r-$POLICY"
  case $r in nginx|envoy) label=$r-round_robin ;; *-kv|*-kv-*) label=$r-kv_aware ;; esac
  if chat_ready http://127.0.0.1:$RP; then
    if [ -n "$picker" ]; then run_wrk "$label" http://127.0.0.1:$RP "$picker" "$pid"
    else run_wrk "$label" http://127.0.0.1:$RP $pid; fi
  else
    tail -5 "$LOGS/$r.log"; [ -n "$picker" ] && tail -5 "$LOGS/$r-picker.log"
  fi
  case $r in
    kvroute-trace*)
      curl -s "http://127.0.0.1:29013/metrics" | grep -E '^kvroute_otlp_spans' | tr '\n' ' ' | tee -a "$OUT"; echo | tee -a "$OUT" ;;
  esac
  stop $pid; [ -n "$picker" ] && stop "$picker"; sleep 1
  case $r in kvroute-trace|kvroute-trace-10) stop "$sink"; tee -a "$OUT" < "$LOGS/otlp-sink.log" ;; esac
done
done
