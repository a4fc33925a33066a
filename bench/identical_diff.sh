#!/bin/bash
# Two builds of kvroute-bench on 8 identical engines of 16,384 blocks in Dynamo's engine model:
# agentic, multi-turn and shared-prefix at x1-x5, seeds 0-2 (part 3 of issue 31's workloads),
# kv_aware with its defaults. One line a cell: the second build's TTFT p50 / p90 / p99 and E2E
# p50 / p90 / p99 over the first's, and WORSE where a p50 or p90 is more than 2% higher.
#
#     bench/identical_diff.sh BEFORE/kvroute-bench AFTER/kvroute-bench
set -euo pipefail
[ $# -eq 2 ] || { sed -n 2,7p "$0"; exit 2; }
figures() {
    "$1" simulate --synthetic "$2" --seed "$3" --workers 8 --num-gpu-blocks 16384 \
        --timing-model dynamo --rate-scale "$4" --policies kv_aware 2>&1 |
        awk '/^kv_aware/ { print $2 "/" $3 }'
}
for w in agentic multi-turn shared-prefix; do
    for r in 1 2 3 4 5; do
        for s in 0 1 2; do
            paste -d' ' <(figures "$1" $w $s $r) <(figures "$2" $w $s $r) |
                awk -v cell="$w x$r seed $s" '{
                    split($1, a, "/"); split($2, b, "/"); worst = 0; out = ""
                    for (i = 1; i <= 6; i++) {
                        q = b[i] / a[i]; out = out sprintf(" %.3f", q)
                        if (i != 3 && i != 6 && q > worst) worst = q
                    }
                    print cell out (worst > 1.02 ? "  WORSE" : "")
                }'
        done
    done
done
