#!/usr/bin/env python3
"""Dynamo's kv_router goodput in its own replay: the highest arrival speedup at which an objective
holds, searched as kvroute-bench goodput searches (x1, doubling or halving at most 10 times, then
bisecting to 2% of the passing end or 8 steps). Run with the Dynamo venv's python, by
bench/dynamo_differential.sh (SLO_TTFT_P90_MS, SLO_MIX):

  dynamo_goodput.py OUT.json TRACE WORKERS BLOCKS NAME [--credit C --scale S]
      (--ttft-p90-ms MS [--e2e-p90-ms MS] | --slo-mix F:MS,... [--slo-attainment P])

The objective is TTFT p90 (and E2E p90) at most the given milliseconds, or, with a mix, every
class of requests meeting its own TTFT target for at least P of its requests, request i's class
taken as kvroute-bench takes it (SloMix::class_of: mix64 of i). Writes pass_rate, fail_rate and
every run to OUT.json."""
import argparse
import json
import os
import subprocess
import sys

REPLAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dynamo_replay_requests.py")
M = (1 << 64) - 1


def mix64(a, b):
    """kvroute_protocol::mix64."""
    z = a ^ ((((b << 29) | (b >> 35)) & M) * 0x9E3779B97F4A7C15 & M)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)


def class_of(classes, i):
    """kvroute-bench's SloMix::class_of."""
    u = (mix64(i, 0x5105EED) >> 11) / float(1 << 53)
    total = 0.0
    for c, (fraction, _) in enumerate(classes):
        total += fraction
        if u < total:
            return c
    return len(classes) - 1


def main():
    ap = argparse.ArgumentParser()
    for name in ("out", "trace", "workers", "blocks", "name"):
        ap.add_argument(name)
    ap.add_argument("--credit")
    ap.add_argument("--scale")
    ap.add_argument("--ttft-p90-ms", type=float)
    ap.add_argument("--e2e-p90-ms", type=float)
    ap.add_argument("--slo-mix")
    ap.add_argument("--slo-attainment", type=float, default=0.9)
    a = ap.parse_args()
    classes = [(float(f), float(t)) for f, t in (c.split(":") for c in a.slo_mix.split(","))] if a.slo_mix else None
    extra = ["--credit", a.credit, "--scale", a.scale] if a.credit else []
    runs = []

    def passes(x):
        cmd = [sys.executable, REPLAY, a.trace, a.workers, "kv_router", "--speed", repr(x), "--blocks", a.blocks]
        d = json.loads(subprocess.run(cmd + extra + (["--ttft-list"] if classes else []), check=True,
                                      capture_output=True, text=True).stdout.splitlines()[-1])
        run = dict(rate_scale=x, ttft_ms=d["ttft_ms"], e2e_ms=d["e2e_ms"], rps=d["rps"])
        if classes:
            met, n = [0] * len(classes), [0] * len(classes)
            for i, ttft in enumerate(d["ttft_list_ms"]):
                c = class_of(classes, i)
                n[c] += 1
                met[c] += ttft <= classes[c][1]
            shares = [m / max(k, 1) for m, k in zip(met, n)]
            ok = all(s >= a.slo_attainment for s in shares)
            run.update(requests=n, met=met)
            how = "classes " + ", ".join(f"{s * 100:.1f}%" for s in shares)
        else:
            ok = d["ttft_ms"][1] <= a.ttft_p90_ms and (a.e2e_p90_ms is None or d["e2e_ms"][1] <= a.e2e_p90_ms)
            how = f"TTFT p90 {d['ttft_ms'][1]:.0f} ms"
        runs.append(dict(run, passes=ok))
        print(f"Dynamo kv_router {a.name}: x{x:.4g} {'passes' if ok else 'fails'} ({how})", file=sys.stderr)
        return ok

    lo = hi = None
    x = 1.0
    for _ in range(11):
        if passes(x):
            lo = x
            if hi is not None:
                break
            x *= 2
        else:
            hi = x
            if lo is not None:
                break
            x /= 2
    steps = 0
    while lo is not None and hi is not None and steps < 8 and (hi - lo) / lo > 0.02:
        mid = (lo + hi) / 2
        if passes(mid):
            lo = mid
        else:
            hi = mid
        steps += 1
    json.dump(dict(pass_rate=lo, fail_rate=hi, runs=runs), open(a.out, "w"))


if __name__ == "__main__":
    main()
