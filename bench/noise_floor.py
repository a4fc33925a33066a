"""How far apart two runs of one routing algorithm land, in Dynamo's engine model: the noise
floor under which a figure against Dynamo's says nothing.

    noise_floor.py seeds BIN TRACE RATES [SEEDS] [-- ARGS...]
    noise_floor.py parity OUT...
    noise_floor.py medians BIN OUT TRACE RATES [SEEDS] [-- ARGS...]
    noise_floor.py dynamo PYTHON BIN TRACE RATES [REPEATS]
    noise_floor.py builds BEFORE AFTER [RATES] [SEEDS]

TRACE is a Mooncake JSONL file or a generated workload's name (agentic, multi-turn,
shared-prefix: kvroute-bench's `--synthetic`, whose seed is then the router seed too).

`seeds`: kvroute-bench simulate (BIN) replays TRACE at each rate of RATES ("1 2 3") on 8 engines
of 16,384 blocks in Dynamo's engine model, kv_aware (with ARGS), under SEEDS router seeds (5 by
default: the seed draws the ties), and prints each figure's spread over the seeds (largest over
smallest) and, for each other seed, whether every figure is within 2% of seed 0's.

`parity`: the same algorithm in two implementations, from bench/dynamo_differential.sh's OUT
directories: kvroute's kv_aware with Dynamo's cost model (`kvroute-xR-dynmodel*.json`) over
Dynamo 1.6.1's kv_router with the same parameters (`dynamo-xR-{defaults,c2s4}.jsonl`), per
figure: smallest, median and largest ratio, and how many cells are more than 2% apart.

`medians`: kv_aware's median over SEEDS router seeds of each figure (as `seeds` runs it) over
the better of Dynamo's two runs in OUT (`dynamo-xR-{defaults,c2s4}.jsonl`) at each rate: one
line a rate, with the worst ratio of the p50s and p90s and of the p99s.

`dynamo`: Dynamo 1.6.1's replay (bench/dynamo_replay_requests.py under PYTHON, the Dynamo venv's)
of TRACE at each rate, kv_router with its defaults and with credit 2 / scale 4, REPEATS times
each (3 by default): it takes no seed, yet its runs differ (its ties fall as they may). Prints
each configuration's spread over the repeats and its median, then kvroute's kv_aware (BIN,
defaults) median over as many router seeds, over the better of Dynamo's two medians: the
comparison with the run-to-run noise of both sides taken down alike.

`builds`: two builds of kvroute-bench (BEFORE, AFTER) on the three generated workloads at each
rate of RATES ("1 2 3 4 5") under seeds 0 to SEEDS - 1 (3), in the same engine model: one line
a cell, AFTER's six figures over BEFORE's, marked WORSE where a p50 or p90 is more than 2%
higher: a change for mixed clusters checked against identical engines, cell by cell.
"""
import json
import os
import statistics
import subprocess
import sys

NAMES = ["TTFT p50", "TTFT p90", "TTFT p99", "E2E p50", "E2E p90", "E2E p99"]


GENERATED = ("agentic", "multi-turn", "shared-prefix")


def figures(binary, trace, rate, seed, args):
    workload = ["--synthetic", trace] if trace in GENERATED else ["--trace", trace]
    out = subprocess.run(
        [binary, "simulate"] + workload + ["--workers", "8", "--num-gpu-blocks", "16384",
         "--timing-model", "dynamo", "--rate-scale", str(rate), "--policies", "kv_aware",
         "--seed", str(seed)] + args,
        capture_output=True, text=True, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("kv_aware")).split()
    return [int(x) for x in line[1].split("/")] + [int(x) for x in line[2].split("/")]


def seeds(binary, trace, rates, n=5, *args):
    n = int(n)
    for rate in rates.split():
        runs = [figures(binary, trace, rate, s, list(args)) for s in range(n)]
        spread = [max(r[i] for r in runs) / max(1, min(r[i] for r in runs)) for i in range(6)]
        close = sum(all(r[i] <= 1.02 * runs[0][i] for i in range(6)) for r in runs[1:])
        print(f"x{rate}: " + ", ".join(f"{name} {s:.3f}" for name, s in zip(NAMES, spread))
              + f"; seeds with every figure within 2% above seed 0's: {close}/{n - 1}")


def dynamo_best(out, rate):
    best = None
    for cfg in ("defaults", "c2s4"):
        for line in open(os.path.join(out, f"dynamo-x{rate}-{cfg}.jsonl")):
            d = json.loads(line)
            if d["mode"] == "kv_router":
                v = d["ttft_ms"] + d["e2e_ms"]
                best = v if best is None else [min(a, b) for a, b in zip(best, v)]
    return best


def medians(binary, out, trace, rates, n=5, *args):
    for rate in rates.split():
        runs = [figures(binary, trace, rate, s, list(args)) for s in range(int(n))]
        median = [statistics.median(r[i] for r in runs) for i in range(6)]
        ratio = [a / b for a, b in zip(median, dynamo_best(out, rate))]
        body, tail = max(ratio[i] for i in (0, 1, 3, 4)), max(ratio[2], ratio[5])
        print(f"x{rate}: median {median}; over Dynamo's best: p50/p90 worst {body:.3f}, "
              f"p99 worst {tail:.3f}")


def dynamo(python, binary, trace, rates, repeats=3):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dynamo_replay_requests.py")
    n = int(repeats)
    for rate in rates.split():
        medians = []
        for cfg, extra in (("defaults", []), ("c2s4", ["--credit", "2", "--scale", "4"])):
            runs = []
            for _ in range(n):
                line = subprocess.run([python, script, trace, "8", "kv_router", "--speed", rate] + extra,
                                      capture_output=True, text=True, check=True).stdout
                d = json.loads(line)
                runs.append(d["ttft_ms"] + d["e2e_ms"])
            spread = [max(r[i] for r in runs) / max(1e-9, min(r[i] for r in runs)) for i in range(6)]
            medians.append([statistics.median(r[i] for r in runs) for i in range(6)])
            print(f"x{rate} Dynamo {cfg}: median {[round(v, 1) for v in medians[-1]]}; spread over "
                  f"{n} runs: " + ", ".join(f"{k} {v:.3f}" for k, v in zip(NAMES, spread)), flush=True)
        runs = [figures(binary, trace, rate, seed, []) for seed in range(n)]
        kv = [statistics.median(r[i] for r in runs) for i in range(6)]
        best = [min(a, b) for a, b in zip(*medians)]
        ratio = [a / b for a, b in zip(kv, best)]
        print(f"x{rate} kvroute kv_aware median {kv} over Dynamo's better median: "
              + ", ".join(f"{k} {r:.3f}" for k, r in zip(NAMES, ratio))
              + f"; worst {max(ratio):.3f}", flush=True)


def builds(before, after, rates="1 2 3 4 5", n=3):
    """Two builds' kv_aware on the generated workloads, seed by seed (the seed draws the
    workload too): the second's figures over the first's."""
    for trace in GENERATED:
        for rate in rates.split():
            for seed in range(int(n)):
                a, b = (figures(binary, trace, rate, seed, []) for binary in (before, after))
                ratio = [y / x for x, y in zip(a, b)]
                worse = max(ratio[i] for i in (0, 1, 3, 4)) > 1.02
                print(f"{trace} x{rate} seed {seed} " + " ".join(f"{r:.3f}" for r in ratio)
                      + ("  WORSE" if worse else ""), flush=True)


def parity(*outs):
    ratios = []
    for out in outs:
        for rate in range(1, 6):
            for ours, theirs in (("dynmodel", "defaults"), ("dynmodel-c2s4", "c2s4")):
                kp = os.path.join(out, f"kvroute-x{rate}-{ours}.json")
                dp = os.path.join(out, f"dynamo-x{rate}-{theirs}.jsonl")
                if not (os.path.exists(kp) and os.path.exists(dp)):
                    continue
                k = next(p for p in json.load(open(kp))["policies"] if p["policy"] == "kv_aware")
                kv = [k["ttft_ms"][q] for q in ("p50", "p90", "p99")] + \
                     [k["e2e_ms"][q] for q in ("p50", "p90", "p99")]
                dyn = [json.loads(l) for l in open(dp)]
                d = next(x for x in dyn if x["mode"] == "kv_router")
                ratios.append([a / b for a, b in zip(kv, d["ttft_ms"] + d["e2e_ms"])])
    print(f"{len(ratios)} cells (trace, rate, configuration)")
    for i, name in enumerate(NAMES):
        r = sorted(x[i] for x in ratios)
        apart = sum(abs(v - 1) > 0.02 for v in r)
        print(f"{name}: kvroute / Dynamo min {r[0]:.3f} median {statistics.median(r):.3f} "
              f"max {r[-1]:.3f}; more than 2% apart in {apart}/{len(r)}")
    print("cells with every kvroute figure within 2% above Dynamo's:",
          sum(all(v <= 1.02 for v in x) for x in ratios), "/", len(ratios))


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    if "--" in rest:
        i = rest.index("--")
        rest = rest[:i] + rest[i + 1:]
    modes = {"seeds": seeds, "parity": parity, "medians": medians, "dynamo": dynamo,
             "builds": builds}
    modes[mode](*rest)
