#!/usr/bin/env bash
# What a large fleet's /metrics scrapes cost an idle router: ENGINES kvroute-sim engines (one
# process) behind a router with its defaults (kv_aware, the scrapes kept under
# --metrics-scrapes-per-sec) and behind one for each of ARGS (`;`-separated router flags),
# each fresh, alternating, RUNS times; no requests and no KV events. For each: the scrape
# interval the router chose (`kvroute_engine_metrics_interval_seconds`), and its CPU over
# SECS seconds once every worker has been scraped for SETTLE seconds.
#   bench/scrape_cost.sh                       # ENGINES=1024, ARGS="--metrics-scrapes-per-sec 0"
#   ENGINES=256 ARGS="--metrics-refresh-ms 500;--metrics-scrapes-per-sec 500" bench/scrape_cost.sh
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
ENGINES=${ENGINES:-1024}; SECS=${SECS:-10}; SETTLE=${SETTLE:-5}; RUNS=${RUNS:-2}
ARGS=${ARGS:---metrics-scrapes-per-sec 0}
PORT=22000; API=21980; PROM=21990
[ -n "${NO_BUILD:-}" ] || build -p kvroute-sim -p kvroute-gateway
KVROUTE=${KVROUTE:-$BIN/kvroute}
HZ=$(getconf CLK_TCK)

echo "=== $(date -u +%FT%TZ) ENGINES=$ENGINES SECS=$SECS nproc=$(nproc)"
"$BIN/kvroute-sim" --engines "$ENGINES" --port $PORT --log-level warn > "$LOGS/sims.log" 2>&1 & sims+=($!)
wait_sims "$ENGINES" $PORT || exit 1
workers_yaml "$ENGINES" $PORT 0 | sed 's/, kv_events: [^,}]*//; s/}$/, model: kvroute-sim}/' \
  > "$LOGS/kvroute.yaml"
IFS=';' read -r -a variants <<< ";$ARGS"
for run in $(seq 1 "$RUNS"); do
  for flags in "${variants[@]}"; do
    # shellcheck disable=SC2086
    "$KVROUTE" --port $API --prometheus-port $PROM --config "$LOGS/kvroute.yaml" \
      --policy kv_aware --no-router-kv-events --log-level warn $flags \
      > "$LOGS/kvroute-scrapes.log" 2>&1 & router=$!; pids+=($router)
    wait_ready "http://127.0.0.1:$API/readiness" || exit 1
    sleep "$SETTLE"
    t0=$(cpu_ticks $router); sleep "$SECS"; t1=$(cpu_ticks $router)
    interval=$(metric_sum "http://127.0.0.1:$PROM" kvroute_engine_metrics_interval_seconds)
    printf 'run %s, %-32s scrape interval %5.3f s (%6.0f scrapes/s): router CPU %.3f cores\n' \
      "$run" "${flags:-defaults}" "$interval" "$(echo "$ENGINES / $interval" | bc -l)" \
      "$(echo "($t1 - $t0) / $HZ / $SECS" | bc -l)"
    stop $router
  done
done
