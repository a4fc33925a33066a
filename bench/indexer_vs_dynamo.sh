#!/usr/bin/env bash
# kvroute's KvIndex against Dynamo 1.6.1's indexers, two ways, on query_latency's workload:
#   1. Rust, one criterion run (bench/indexer-vs-dynamo, its own workspace, so that the root's
#      `cargo test --workspace` never compiles Dynamo): KvIndex, RadixTree, PositionalIndexer,
#      ConcurrentRadixTreeCompressed in ThreadPoolIndexer (1 and 2 threads), PositionalIndexer in
#      ThreadPoolIndexer (2), KvIndex sharded over 2 threads; build, churn at full size, hit,
#      system-prompt and miss queries; a table with each figure's ratio to KvIndex's.
#   2. The cross-check: `kvroute-bench index --write` writes the workload as a replay file;
#      `kvroute-bench index FILE` replays it on KvIndex, and Dynamo's Python RadixTree replays the
#      same file ($PEERS_DIR/venv-dyn, ../shared/peers/setup_peers.sh dyn) with its fixed cost
#      per call measured and taken out; both printed with their ratios.
#
#   bench/indexer_vs_dynamo.sh                 # BLOCKS=1000000
#   BLOCKS=200000 SKIP_CRITERION=1 bench/indexer_vs_dynamo.sh
# Knobs: BLOCKS (distinct blocks built), THREADS (kvroute-bench's, "1,2"), SKIP_CRITERION=1,
# SKIP_PYTHON=1, OUT (a folder for the file and the outputs; a temporary one by default).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BLOCKS=${BLOCKS:-1000000}; THREADS=${THREADS:-1,2}
PEERS_DIR=${PEERS_DIR:-/tmp/kvroute-peers}
OUT=${OUT:-$(mktemp -d)}
export CARGO_INCREMENTAL=0
echo "== $(date -u +%F) BLOCKS=$BLOCKS; outputs in $OUT"
if [ -z "${SKIP_CRITERION:-}" ]; then
  (cd "$ROOT/bench/indexer-vs-dynamo" && BLOCKS=$BLOCKS cargo bench --bench compare 2>&1) \
    | tee "$OUT/criterion.txt" | grep -E "^[A-Za-z+0-9 ]+\/|time:|thrpt:|workload|best match|alongside" || true
  echo "== criterion, mean per iteration (bench/indexer-vs-dynamo/target/criterion)"
  python3 "$ROOT/bench/indexer_vs_dynamo.py" criterion "$ROOT/bench/indexer-vs-dynamo/target/criterion"
fi
if [ -z "${SKIP_PYTHON:-}" ]; then
  (cd "$ROOT" && cargo build --release -q -p kvroute-bench)
  BENCH=$ROOT/target/release/kvroute-bench
  "$BENCH" index --write "$OUT/events.jsonl" --blocks "$BLOCKS"
  "$BENCH" index "$OUT/events.jsonl" --threads "$THREADS" | tee "$OUT/kvroute.txt"
  echo "== cross-check: Dynamo's Python RadixTree on the same file"
  "$PEERS_DIR/venv-dyn/bin/python" "$ROOT/bench/indexer_vs_dynamo.py" python \
    "$OUT/events.jsonl" "$OUT/kvroute.txt" | tee "$OUT/python.txt"
fi
