#!/usr/bin/env bash
# Chaos: N streaming chats (a synthetic multi-turn workload, CONCURRENCY at a time) through
# kvroute in front of 4 kvroute-sim processes, while a chaos monkey kills one engine with
# SIGKILL every KILL_MIN..KILL_MAX seconds (at random) and restarts it DOWN_MIN..DOWN_MAX
# seconds later. Two runs: migration off (--migration-limit 0) and on (the default limit).
# Each prints, from the clients' side (crates/gateway/examples/chaos.rs): completed normally,
# completed after a migration (the router's kvroute_request_migrations_total{outcome="migrated"},
# before and after), failed with an error event, failed otherwise, tokens delivered against
# max_tokens per request, and the router's in-flight gauges after the run.
#   bench/chaos.sh                  # N=2000 CONCURRENCY=32 SPEEDUP=1 KILL_MIN=1 KILL_MAX=4 DOWN_MIN=1 DOWN_MAX=3
#   N=200 bench/chaos.sh            # a quick run
#   RUNS=off bench/chaos.sh         # one run only (off or on); EXTRA="..." adds kvroute flags
# A kvroute without --migration-limit (before migration exists) gets the "off" run only, with
# no flag: that is its behaviour.
set -u
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib.sh"
N=${N:-2000}; CONCURRENCY=${CONCURRENCY:-32}; SPEEDUP=${SPEEDUP:-1}; SEED=${SEED:-1}
KILL_MIN=${KILL_MIN:-1}; KILL_MAX=${KILL_MAX:-4}; DOWN_MIN=${DOWN_MIN:-1}; DOWN_MAX=${DOWN_MAX:-3}
RUNS=${RUNS:-"off on"}
SIM_PORT=19600; EVENTS_PORT=19700; RPORT=19610; MPORT=19611
build -p kvroute-sim -p kvroute-gateway --bin kvroute --bin kvroute-sim --example chaos
workers_yaml 4 $SIM_PORT $EVENTS_PORT > "$LOGS/kvroute.yaml"
has_migration=0
"$BIN/kvroute" --help 2>/dev/null | grep -q -- '--migration-limit' && has_migration=1

# The chaos monkey, run in the background: starts the 4 engines, then kills one at random and
# restarts it, until TERM, when it stops its engines. Its log: one line per kill.
monkey() {
  local pid=() i
  RANDOM=$SEED
  start_one() {
    "$BIN/kvroute-sim" --port $((SIM_PORT + $1)) --kv-events-endpoint "tcp://127.0.0.1:$((EVENTS_PORT + $1))" \
      --seed "$1" --speedup "$SPEEDUP" --max-num-seqs 256 >> "$LOGS/sim$1.log" 2>&1 &
    pid[$1]=$!
  }
  pause() { sleep "$1" & wait $!; } # so that TERM is handled at once
  trap 'kill "${pid[@]}" 2>/dev/null; wait; exit 0' TERM
  for i in 0 1 2 3; do start_one $i; done
  wait_sims 4 $SIM_PORT || exit 1
  touch "$LOGS/sims.ready"
  while :; do
    pause $((KILL_MIN + RANDOM % (KILL_MAX - KILL_MIN + 1)))
    i=$((RANDOM % 4))
    kill -KILL "${pid[$i]}" 2>/dev/null; wait "${pid[$i]}" 2>/dev/null
    echo "$(date +%s.%N) killed $i" >> "$LOGS/kills.log"
    pause $((DOWN_MIN + RANDOM % (DOWN_MAX - DOWN_MIN + 1)))
    start_one "$i"
  done
}

run() { # label, kvroute flags
  local label=$1; shift
  rm -f "$LOGS/sims.ready" "$LOGS/kills.log"; touch "$LOGS/kills.log"
  monkey & local chaos=$!; pids+=("$chaos")
  for _ in $(seq 1 600); do [ -e "$LOGS/sims.ready" ] && break; sleep 0.05; done
  [ -e "$LOGS/sims.ready" ] || { echo "engines not ready"; tail -3 "$LOGS"/sim*.log; exit 1; }
  # shellcheck disable=SC2086
  "$BIN/kvroute" --port $RPORT --prometheus-port $MPORT --config "$LOGS/kvroute.yaml" \
    --log-level warn "$@" ${EXTRA:-} > "$LOGS/kvroute-$label.log" 2>&1 & local router=$!; pids+=("$router")
  wait_ready http://127.0.0.1:$RPORT/readiness || { tail -5 "$LOGS/kvroute-$label.log"; exit 1; }
  echo "--- migration $label${*:+ ($*)}: $(date -u +%T)"
  "$BIN/examples/chaos" http://127.0.0.1:$RPORT http://127.0.0.1:$MPORT "$N" "$CONCURRENCY" "$SEED"
  echo "engines killed: $(wc -l < "$LOGS/kills.log"); router log panics: $(grep -c -i panic "$LOGS/kvroute-$label.log")"
  stop "$chaos" "$router"
  sleep 1
}

echo "=== $(date -u +%FT%TZ) N=$N CONCURRENCY=$CONCURRENCY SPEEDUP=$SPEEDUP kill every ${KILL_MIN}-${KILL_MAX} s, down ${DOWN_MIN}-${DOWN_MAX} s, nproc=$(nproc), logs $LOGS"
for r in $RUNS; do
  case $r in
    off) if [ $has_migration = 1 ]; then run off --migration-limit 0; else run off; fi ;;
    on) if [ $has_migration = 1 ]; then run on; else echo "--- migration on: skipped, this kvroute has no --migration-limit"; fi ;;
  esac
done
