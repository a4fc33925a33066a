"""kv_aware against the best other policy on heterogeneous simulated clusters, in virtual time:
TTFT p90 and E2E p90 as ratios to the best of round_robin, least_load, cache_aware, llm_d and
kv_aware with the weighted cost model, per workload and seed, with their geometric means.

    heterogeneous_ratios.py BIN OUT [CLUSTERS] [-- ARGS...]

BIN is the release folder (kvroute-bench in it); OUT keeps the other policies' runs (one
simulate per cell, reused on the next call) and kv_aware's; CLUSTERS picks among (default "a b
c"):
- a: 8 engines at speeds 2,2,1,1,1,0.5,0.5,0.5 with 16,384 or 8,192 KV blocks (bench/heterogeneous.sh's);
- b: 8 engines at 1.5,1.5,1,1,1,1,0.7,0.7 with 8,192-16,384 blocks;
- c: 12 engines, one at 3x, nine at 1x, two at 0.5x, 16,384 blocks each.
ARGS go to kv_aware's runs only (`--router-own-decode-weight 0` for the model without its
own-decode term). The workloads: the Mooncake trace at x1 and x2, multi-turn chats (100 x 5 at 20
and 40 requests/s), shared-prefix groups and agentic sessions, seeds 0-2 (the trace at x1 one
seed). The router is told each engine's KV blocks, never its speed.
"""
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.environ.get("TRACE", os.path.join(ROOT, "..", "shared", "data", "mooncake_synthetic_trace.jsonl"))
CLUSTERS = {
    "a": ["--workers", "8", "--worker-speed", "2,2,1,1,1,0.5,0.5,0.5",
          "--num-gpu-blocks", "16384,8192,16384,16384,8192,16384,8192,8192"],
    "b": ["--workers", "8", "--worker-speed", "1.5,1.5,1,1,1,1,0.7,0.7",
          "--num-gpu-blocks", "12288,12288,16384,8192,16384,8192,12288,12288"],
    "c": ["--workers", "12", "--worker-speed", "3,1,1,1,1,1,1,1,1,1,0.5,0.5",
          "--num-gpu-blocks", "16384"],
}
MULTI = ["--synthetic", "multi-turn", "--conversations", "100", "--turns", "5", "--request-rate"]
WORKLOADS = {
    "trace-x1": ["--trace", TRACE, "--rate-scale", "1"],
    "trace-x2": ["--trace", TRACE, "--rate-scale", "2"],
    "multi": MULTI + ["20"],
    "multi-x2": MULTI + ["40"],
    "shared": ["--synthetic", "shared-prefix"],
    "agentic": ["--synthetic", "agentic"],
}
OTHERS = "round_robin,least_load,cache_aware,llm_d,kv_aware"


def simulate(bench, args, out):
    if not (os.path.exists(out) and os.path.getsize(out) > 0):
        subprocess.run([bench, "simulate"] + args + ["--json", out], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["policies"]


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    if len(argv) < 2:
        sys.exit(__doc__)
    bench, out = os.path.join(argv[0], "kvroute-bench"), argv[1]
    clusters = (argv[2] if len(argv) > 2 else "a b c").split()
    tag = "-".join(a.lstrip("-") for a in extra) or "default"
    os.makedirs(out, exist_ok=True)
    cells = [(c, w, s) for c in clusters for w in WORKLOADS for s in (0, 1, 2)
             if not (w == "trace-x1" and s > 0)]

    def cell(job):
        c, w, s = job
        common = WORKLOADS[w] + CLUSTERS[c] + ["--seed", str(s)]
        others = simulate(bench, common + ["--policies", OTHERS, "--router-cost-model", "weighted"],
                          f"{out}/{c}-{w}-{s}.others.json")
        ours = simulate(bench, common + ["--policies", "kv_aware"] + extra,
                        f"{out}/{c}-{w}-{s}.{tag}.json")[0]
        best = {m: min(p[m]["p90"] for p in others) for m in ("ttft_ms", "e2e_ms")}
        return job, ours, best

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(cell, cells))
    print(f"kv_aware {' '.join(extra) or '(defaults)'}: TTFT p90 and E2E p90 over the best other policy's")
    ratios = {}
    for (c, w, s), p, best in results:
        t, e = p["ttft_ms"]["p90"] / best["ttft_ms"], p["e2e_ms"]["p90"] / best["e2e_ms"]
        ratios.setdefault(c, []).append((t, e))
        print(f"{c} {w:9s} seed {s}  TTFT {p['ttft_ms']['p50']:.0f}/{p['ttft_ms']['p90']:.0f}/"
              f"{p['ttft_ms']['p99']:.0f}  E2E {p['e2e_ms']['p50']:.0f}/{p['e2e_ms']['p90']:.0f}/"
              f"{p['e2e_ms']['p99']:.0f}  hit {100 * p['hit_share']:.1f}%  TTFT p90 {t:.2f}x  E2E p90 {e:.2f}x")
    for c, rs in ratios.items():
        geo = [math.exp(sum(math.log(r[i]) for r in rs) / len(rs)) for i in (0, 1)]
        print(f"cluster {c}: geometric mean TTFT p90 {geo[0]:.3f}x, E2E p90 {geo[1]:.3f}x; "
              f"worst {max(r[0] for r in rs):.2f}x, {max(r[1] for r in rs):.2f}x; "
              f"TTFT p90 at most 0.85x in {sum(r[0] <= 0.85 for r in rs)} of {len(rs)} cells")


if __name__ == "__main__":
    main()
