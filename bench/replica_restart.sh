#!/usr/bin/env bash
# A router replica that starts while another has been routing: with the start-up snapshot
# (replica sync) it routes as the other would; without it, it starts blind.
# A synthetic shared-prefix workload: its first N requests go through router A; then router B
# starts and the next M go through B. Three runs, 4 fresh kvroute-sim replicas each:
#   one-router     B is A (the reference: nothing forgotten)
#   synced         B syncs with A over NATS (it takes A's snapshot before it is ready)
#   blind          B has no sync (a restarted router today)
# Prints the second phase's TTFT and cached share, and B's start: time to ready and the
# snapshot's size.
#   bench/replica_restart.sh          # N=200 M=200 POLICY=cache_aware
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
N=${N:-200}; M=${M:-200}; POLICY=${POLICY:-cache_aware}; SPEEDUP=${SPEEDUP:-10}
WORKLOAD=${WORKLOAD:---synthetic shared-prefix --groups 40 --prompts-per-group 10 --output-len 100 --request-rate 4}
command -v nats-server >/dev/null || { echo "needs nats-server (apt-get install nats-server)"; exit 1; }
build -p kvroute-sim -p kvroute-gateway -p kvroute-bench
nats-server -a 127.0.0.1 -p 19851 > "$LOGS/nats.log" 2>&1 & pids+=($!)
workers_yaml 4 19810 19910 > "$LOGS/kvroute.yaml"
router() { # port, prometheus port, log, extra args
  # shellcheck disable=SC2086
  "$BIN/kvroute" --port "$1" --prometheus-port "$2" --config "$LOGS/kvroute.yaml" \
    --policy "$POLICY" --log-level info $4 > "$3" 2>&1 & pids+=($!)
}
replay() { # url, then workload flags
  local url=$1; shift
  # shellcheck disable=SC2086
  "$BIN/kvroute-bench" replay --url "$url" --max-concurrency 256 --model kvroute-sim $WORKLOAD "$@" 2>/dev/null | cut -c1-200
}
run() { # label, B's extra args ("same" for B = A)
  local label=$1 b_args=$2
  start_sims 4 19810 19910 --speedup "$SPEEDUP" || return 1
  local sync="--replica-sync nats://127.0.0.1:19851 --replica-sync-subject-prefix $label"
  router 19886 19896 "$LOGS/$label-a.log" "$sync"; local a=$!
  wait_ready http://127.0.0.1:19886/readiness || return 1
  replay http://127.0.0.1:19886 --max-requests "$N" > "$LOGS/$label-warm.txt"
  local b_url=http://127.0.0.1:19886 b="" ready_ms=0 snap=0
  if [ "$b_args" != same ]; then
    [ "$b_args" = synced ] && b_args=$sync
    local t0; t0=$(date +%s%N)
    router 19887 19897 "$LOGS/$label-b.log" "$b_args"; b=$!
    wait_ready http://127.0.0.1:19887/readiness || return 1
    ready_ms=$((($(date +%s%N) - t0) / 1000000))
    snap=$(metric_sum http://127.0.0.1:19897 'kvroute_replica_sync_bytes_total{direction="in"')
    b_url=http://127.0.0.1:19887
  fi
  printf "%-11s " "$label"
  replay "$b_url" --skip "$N" --max-requests "$M"
  [ -n "$b" ] && echo "            B ready in $ready_ms ms; sync bytes in at ready: $snap ($(sed 's/\x1b\[[0-9;]*m//g' "$LOGS/$label-b.log" | grep -o 'snapshot taken.*' | head -1))"
  stop $b $a; stop_sims
  sleep 1
}
echo "=== $(date -u +%FT%TZ) N=$N M=$M POLICY=$POLICY SPEEDUP=$SPEEDUP nproc=$(nproc) workload: $WORKLOAD"
run one-router same
run synced synced
run blind ""
