"""kv_aware against the best other policy on heterogeneous simulated clusters, in virtual time:
TTFT p90 and E2E p90 as ratios to the best of round_robin, least_load, cache_aware, llm_d and
kv_aware with the weighted cost model, per workload and seed, with their geometric means.

    heterogeneous_ratios.py BIN OUT [CLUSTERS] [-- ARGS...]
    heterogeneous_ratios.py --diff OUT TAG_A TAG_B [CLUSTERS]

BIN is the release folder (kvroute-bench in it); OUT keeps the other policies' runs (one
simulate per cell, reused on the next call with the same kvroute-bench binary) and
kv_aware's; CLUSTERS picks among (default "a b c"):
- a: 8 engines at speeds 2,2,1,1,1,0.5,0.5,0.5 with 16,384 or 8,192 KV blocks (bench/heterogeneous.sh's);
- b: 8 engines at 1.5,1.5,1,1,1,1,0.7,0.7 with 8,192-16,384 blocks;
- c: 12 engines, one at 3x, nine at 1x, two at 0.5x, 16,384 blocks each;
- same (never by default): 8 identical engines of 16,384 blocks in Dynamo's engine model, to
  check with `--diff` that a change for mixed clusters leaves identical ones as they were.
ARGS go to kv_aware's runs only (`--router-own-decode-weight 0` for the model without its
own-decode term). The workloads: the Mooncake trace at x1 and x2, multi-turn chats (100 x 5 at 20
and 40 requests/s), shared-prefix groups and agentic sessions, seeds 0-2 (the trace at x1 one
seed). The router is told each engine's KV blocks, never its speed.

Environment: ORACLE=1 also runs the TTFT oracle (`--ttft-oracle`: each request where a copy
of every engine, run ahead, says it costs the least first-token time) beside kv_aware, and
prints its ratios too; SCALE multiplies every workload's request rate (SCALE=0.02: the same requests on a
nearly idle cluster); TAG names kv_aware's runs in OUT (default: ARGS joined, or "default"), so
that two builds' runs share OUT's other policies. `--diff OUT TAG_A TAG_B` prints, per cell and
as geometric means per workload, kv_aware's TAG_B percentiles over its TAG_A ones.
"""
import hashlib
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
    "same": ["--workers", "8", "--num-gpu-blocks", "16384", "--timing-model", "dynamo"],
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


def with_scale(args, scale):
    """`args` at `scale` times their request rate."""
    if scale == 1.0:
        return args
    if "--rate-scale" in args:
        i = args.index("--rate-scale") + 1
        return args[:i] + [f"{float(args[i]) * scale:g}"] + args[i + 1:]
    return args + ["--rate-scale", f"{scale:g}"]


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def diff(out, a, b, clusters):
    """kv_aware's percentiles in the runs tagged `b` over those tagged `a`."""
    metrics = [("ttft_ms", "p50"), ("ttft_ms", "p90"), ("ttft_ms", "p99"), ("e2e_ms", "p50"),
               ("e2e_ms", "p90")]
    names = " ".join(f"{m.split('_')[0].upper()} {q}" for m, q in metrics)
    print(f"kv_aware {b} over {a}: {names}")
    by_workload = {}
    for c in clusters:
        for w in WORKLOADS:
            for s in (0, 1, 2):
                paths = [f"{out}/{c}-{w}-{s}.{t}.json" for t in (a, b)]
                if not all(os.path.exists(p) for p in paths):
                    continue
                pa, pb = (json.load(open(p))["policies"][0] for p in paths)
                r = [pb[m][q] / pa[m][q] for m, q in metrics]
                by_workload.setdefault(w, []).append(r)
                print(f"{c} {w:9s} seed {s}  " + " ".join(f"{x:.3f}" for x in r))
    for w, rs in by_workload.items():
        print(f"{w:9s} geometric mean over {len(rs)} cells: "
              + " ".join(f"{geomean([r[i] for r in rs]):.3f}" for i in range(len(metrics))))


def main():
    argv = sys.argv[1:]
    if argv[:1] == ["--diff"] and len(argv) >= 4:
        return diff(argv[1], argv[2], argv[3], (argv[4] if len(argv) > 4 else "a b c").split())
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    if len(argv) < 2:
        sys.exit(__doc__)
    bench, out = os.path.join(argv[0], "kvroute-bench"), argv[1]
    clusters = (argv[2] if len(argv) > 2 else "a b c").split()
    oracle = os.environ.get("ORACLE") == "1"
    tag = os.environ.get("TAG") or "-".join(a.lstrip("-") for a in extra) or "default"
    if oracle:
        extra, tag = extra + ["--ttft-oracle"], tag + "-oracle"
    scale = float(os.environ.get("SCALE", "1"))
    os.makedirs(out, exist_ok=True)
    # The other policies' runs are kept per build: a change to kv_aware can move its weighted
    # model too (the surplus credit did), and eligibility moves every policy.
    with open(bench, "rb") as f:
        build = hashlib.sha256(f.read()).hexdigest()[:12]
    cells = [(c, w, s) for c in clusters for w in WORKLOADS for s in (0, 1, 2)
             if not (w == "trace-x1" and s > 0)]

    def cell(job):
        c, w, s = job
        common = with_scale(WORKLOADS[w], scale) + CLUSTERS[c] + ["--seed", str(s)]
        others = simulate(bench, common + ["--policies", OTHERS, "--router-cost-model", "weighted"],
                          f"{out}/{c}-{w}-{s}.others-{build}.json")
        runs = simulate(bench, common + ["--policies", "kv_aware"] + extra,
                        f"{out}/{c}-{w}-{s}.{tag}.json")
        best = {m: min(p[m]["p90"] for p in others) for m in ("ttft_ms", "e2e_ms")}
        return job, runs, best

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(cell, cells))
    print(f"kv_aware {' '.join(extra) or '(defaults)'}: TTFT p90 and E2E p90 over the best other policy's")
    ratios = {}
    for (c, w, s), runs, best in results:
        for p in runs:
            t, e = p["ttft_ms"]["p90"] / best["ttft_ms"], p["e2e_ms"]["p90"] / best["e2e_ms"]
            ratios.setdefault((p["policy"], c), []).append((t, e))
            print(f"{c} {w:9s} seed {s} {p['policy']:11s} TTFT {p['ttft_ms']['p50']:.0f}/"
                  f"{p['ttft_ms']['p90']:.0f}/{p['ttft_ms']['p99']:.0f}  E2E {p['e2e_ms']['p50']:.0f}/"
                  f"{p['e2e_ms']['p90']:.0f}/{p['e2e_ms']['p99']:.0f}  hit {100 * p['hit_share']:.1f}%  "
                  f"TTFT p90 {t:.2f}x  E2E p90 {e:.2f}x")
    for (policy, c), rs in ratios.items():
        geo = [geomean([r[i] for r in rs]) for i in (0, 1)]
        print(f"{policy}, cluster {c}: geometric mean TTFT p90 {geo[0]:.3f}x, E2E p90 {geo[1]:.3f}x; "
              f"worst {max(r[0] for r in rs):.2f}x, {max(r[1] for r in rs):.2f}x; "
              f"TTFT p90 at most 0.85x in {sum(r[0] <= 0.85 for r in rs)} of {len(rs)} cells")


if __name__ == "__main__":
    main()
