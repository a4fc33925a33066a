# shellcheck shell=bash
# What the bench/*.sh scripts share; sourced (`. "$(dirname "$0")/lib.sh"`), never run.
#
# Sets ROOT (the repository), BIN (the release binaries: $BIN if set, else
# $CARGO_TARGET_DIR/release, else $ROOT/target/release) and LOGS (a new temporary folder unless
# LOGS is set), and on exit kills what is in `sims` and `pids`.
#
#   build ARGS...                      cargo build --release -q ARGS in ROOT; exits on failure
#   wait_ready URL [CURL ARGS...]      polls URL (curl -sf) for up to 30 s
#   metric_sum URL PREFIX              sums the samples of URL/metrics whose line starts with PREFIX
#   workers_yaml N PORT EVENTS [ROLE...]
#                                      a kvroute config: N workers, worker i at PORT+i, its KV
#                                      events at EVENTS+i, with role ROLE i where given
#   start_sim I PORT EVENTS [FLAGS...] starts kvroute-sim on PORT (KV events on EVENTS unless
#                                      empty) with FLAGS, log $LOGS/simI.log; its pid joins sims
#   wait_sims N PORT                   waits until the N replicas from PORT answer /health
#   start_sims N PORT EVENTS [FLAGS...]
#                                      N replicas, replica i on PORT+i (KV events on EVENTS+i,
#                                      --seed i); then wait_sims
#   stop PID...                        kills and reaps each
#   stop_sims                          stop the replicas in `sims`

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# cargo reads a relative CARGO_TARGET_DIR from where it runs: ROOT (see build).
case ${CARGO_TARGET_DIR:-} in
  '') BIN=${BIN:-$ROOT/target/release} ;;
  /*) BIN=${BIN:-$CARGO_TARGET_DIR/release} ;;
  *) BIN=${BIN:-$ROOT/$CARGO_TARGET_DIR/release} ;;
esac
LOGS=${LOGS:-$(mktemp -d)}
mkdir -p "$LOGS"

build() { (cd "$ROOT" && cargo build --release -q "$@") || exit 1; }

sims=()
pids=()
stop() { for p in "$@"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done; }
stop_sims() { stop "${sims[@]}"; sims=(); }
cleanup() { for p in "${sims[@]}" "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT

wait_ready() {
  local url=$1; shift
  for _ in $(seq 1 600); do curl -sf "$@" "$url" >/dev/null && return 0; sleep 0.05; done
  echo "NOT READY $url" >&2; return 1
}

# A process's CPU so far (user and system), in clock ticks (getconf CLK_TCK a second).
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

metric_sum() { curl -s "$1/metrics" | grep "^$2" | awk '{s += $NF} END {print s + 0}'; }

workers_yaml() {
  local n=$1 port=$2 events=$3 i; shift 3
  local roles=("$@")
  echo "workers:"
  for ((i = 0; i < n; i++)); do
    printf '  - {url: "http://127.0.0.1:%d", kv_events: "tcp://127.0.0.1:%d"' $((port + i)) $((events + i))
    if [ -n "${roles[i]:-}" ]; then printf ', role: %s' "${roles[i]}"; fi
    printf '}\n'
  done
}

start_sim() {
  local i=$1 port=$2 events=$3; shift 3
  local flags=("$@")
  [ -n "$events" ] && flags+=(--kv-events-endpoint "tcp://127.0.0.1:$events")
  "$BIN/kvroute-sim" --port "$port" "${flags[@]}" > "$LOGS/sim$i.log" 2>&1 &
  sims+=($!)
}

wait_sims() {
  local i
  for ((i = 0; i < $1; i++)); do wait_ready "http://127.0.0.1:$(($2 + i))/health" || return 1; done
}

start_sims() {
  local n=$1 port=$2 events=$3 i; shift 3
  for ((i = 0; i < n; i++)); do
    start_sim "$i" $((port + i)) "${events:+$((events + i))}" --seed "$i" "$@"
  done
  wait_sims "$n" "$port"
}
