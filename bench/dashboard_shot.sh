#!/usr/bin/env bash
# docs/dashboard.png: the live dashboard as headless chromium renders it, after traffic from
# three tenants (a trusted tenant header, 6:3:1) through kvroute's embedded simulated engines.
#
#   bench/dashboard_shot.sh            # OUT=docs/dashboard.png PORT=18080 METRICS=18081
#
# Needs chromium and curl; builds the release kvroute unless BIN has it.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
PORT=${PORT:-18080}
METRICS=${METRICS:-18081}
OUT=${OUT:-$ROOT/docs/dashboard.png}
[ -x "$BIN/kvroute" ] || build -p kvroute-gateway --bin kvroute

"$BIN/kvroute" --port "$PORT" --metrics-port "$METRICS" --trust-tenant-header \
  >"$LOGS/kvroute.log" 2>&1 &
pids+=($!)
wait_ready "http://127.0.0.1:$PORT/readiness"

system=$(printf 'a shared system prompt, long enough to span several KV blocks. %.0s' 1 2 3 4)
for i in $(seq 0 59); do
  case $((i % 10)) in
    [0-5]) team=search ;;
    [6-8]) team=support ;;
    *) team=batch-eval ;;
  esac
  stream=$([ $((i % 2)) -eq 0 ] && echo true || echo false)
  curl -sf -o /dev/null "http://127.0.0.1:$PORT/v1/chat/completions" \
    -H 'content-type: application/json' -H "x-smg-tenant-id: $team" \
    -d "{\"model\":\"kvroute-sim\",\"max_tokens\":16,\"stream\":$stream,\"messages\":[{\"role\":\"system\",\"content\":\"$system ($team)\"},{\"role\":\"user\",\"content\":\"question $i\"}]}"
done
sleep 2
chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --hide-scrollbars \
  --virtual-time-budget=3000 --window-size=1400,1500 --screenshot="$OUT" \
  "http://127.0.0.1:$METRICS/dashboard" 2>/dev/null
echo "wrote $OUT"
