#!/usr/bin/env python3
"""Dynamo 1.6.1's offline replay (its mocker engines and its KV router, virtual time), as
../shared/peers/dynamo_replay.py runs it, with every request's figures captured, so that its
percentiles can be taken the way kvroute-bench takes them (nearest rank). Run it with the Dynamo
venv's python:

  $PEERS_DIR/venv-dyn/bin/python bench/dynamo_replay_requests.py TRACE WORKERS [MODE ...]
      [--speed X] [--credit C --scale S] [--blocks N] [--ttft-list]

MODE: round_robin | kv_router (default both). Engines: N blocks (16,384) of 16 tokens, 8,192
batched tokens, 256 sequences; the trace's hash ids are 512-token blocks. Prints one JSON line per
mode: ttft_ms and e2e_ms p50/p90/p99 by nearest rank (as kvroute-bench), the same as Dynamo's
summary reports them (ttft_ms_dynamo, e2e_ms_dynamo: the value at rank round((n-1)p)), hit share
as kvroute-bench counts it (prompt tokens cached at each request's first admission; hit_dynamo is
the summary's, which counts a preempted request's last admission), req/s and preemptions
(readmissions). --ttft-list adds every request's TTFT in trace order."""
import argparse
import collections
import json
import math
import os
import sys

os.environ.setdefault("RUST_LOG", "warn")
os.environ.setdefault("DYN_LOG", "warn")

from dynamo.replay import run_trace_replay  # noqa: E402
from dynamo._core import KvRouterConfig  # noqa: E402


def nearest_rank(values, p):
    v = sorted(values)
    return v[min(max(math.ceil(p * len(v)), 1), len(v)) - 1]


def in_trace_order(trace, per_request):
    """Dynamo's per-request list, reordered as the trace (ties in arrival time come in any order)."""
    by_key = collections.defaultdict(list)
    for r in per_request:
        by_key[(r["input_length"], r["requested_output_length"])].append(r)
    for rs in by_key.values():
        rs.sort(key=lambda r: r["arrival_time_ms"])
    out = []
    for line in open(trace):
        t = json.loads(line)
        out.append(by_key[(t["input_length"], t["output_length"])].pop(0))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("workers", type=int)
    ap.add_argument("modes", nargs="*", default=["round_robin", "kv_router"])
    ap.add_argument("--speed", type=float, default=1.0, help="arrival speedup ratio")
    ap.add_argument("--credit", type=float, default=1.0)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--blocks", type=int, default=16384)
    ap.add_argument("--ttft-list", action="store_true")
    a = ap.parse_args()
    engine = {"engine": {"block_size": 16, "num_gpu_blocks": a.blocks, "max_num_batched_tokens": 8192,
                         "max_num_seqs": 256, "backend": "vllm", "worker_type": "aggregated"}}
    for mode in a.modes:
        cfg = KvRouterConfig(overlap_score_credit=a.credit, prefill_load_scale=a.scale) if mode == "kv_router" else None
        r = run_trace_replay([a.trace], num_workers=a.workers, router_mode=mode, extra_engine_args=engine,
                             trace_block_size=512, arrival_speedup_ratio=a.speed, router_config=cfg,
                             capture_per_request=True)
        s, reqs = r.summary, in_trace_order(a.trace, r.per_request)
        ttft = [x["ttft_ms"] for x in reqs]
        e2e = [x["e2e_latency_ms"] for x in reqs]
        out = {"system": "dynamo-1.6.1", "mode": mode, "workers": a.workers, "speed": a.speed,
               "credit": a.credit, "scale": a.scale,
               "ttft_ms": [round(nearest_rank(ttft, p), 1) for p in (0.5, 0.9, 0.99)],
               "e2e_ms": [round(nearest_rank(e2e, p), 1) for p in (0.5, 0.9, 0.99)],
               "ttft_ms_dynamo": [round(s["median_ttft_ms"], 1), round(s["p90_ttft_ms"], 1), round(s["p99_ttft_ms"], 1)],
               "e2e_ms_dynamo": [round(s["median_e2e_latency_ms"], 1), round(s["p90_e2e_latency_ms"], 1),
                                 round(s["p99_e2e_latency_ms"], 1)],
               "hit": round(s["first_admission_prefix_cache_reused_ratio"], 4),
               "hit_dynamo": round(s["prefix_cache_reused_ratio"], 4), "rps": round(s["request_throughput_rps"], 3),
               "preemptions": sum(x["readmission_count"] for x in reqs),
               "completed": s["completed_requests"], "of": s["num_requests"]}
        if a.ttft_list:
            out["ttft_list_ms"] = [round(x, 3) for x in ttft]
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
