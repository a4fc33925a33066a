"""One table of goodput brackets, kvroute-bench goodput's JSON files against Dynamo's replay
searches (bench/dynamo_goodput.py), for bench/dynamo_differential.sh and bench/dynamo_slo_mix.sh.

    goodput_table.py OUT DYNAMO_PREFIX TITLE FILE=LABEL...

Each FILE (OUT/FILE.json, kvroute-bench goodput --json) gives a row per policy, kv_aware's
named LABEL, every other `kvroute POLICY`; OUT/DYNAMO_PREFIX-{defaults,c2s4}.json give Dynamo's
kv_router rows; each passing rate is also shown over Dynamo's best. TITLE (may be empty) is
printed above the table.
"""
import json
import os
import sys


def main(out, dynamo_prefix, title, *kvroute):
    rows = []
    for spec in kvroute:
        file, label = spec.split("=", 1)
        p = os.path.join(out, f"{file}.json")
        if os.path.exists(p):
            for g in json.load(open(p)).get("policies", []):
                name = label if g["policy"] == "kv_aware" else f"kvroute {g['policy']}"
                rows.append((name, (g.get("pass") or {}).get("rate_scale"), (g.get("fail") or {}).get("rate_scale")))
    for cfg in ("defaults", "c2s4"):
        p = os.path.join(out, f"{dynamo_prefix}-{cfg}.json")
        if os.path.exists(p):
            d = json.load(open(p))
            rows.append((f"Dynamo kv_router, {cfg.replace('c2s4', 'credit 2 / scale 4')}", d["pass_rate"], d["fail_rate"]))
    best = max((r[1] or 0 for r in rows if r[0].startswith("Dynamo")), default=0)
    print()
    if title:
        print(title)
    print("| router | highest passing rate | lowest failing rate | vs Dynamo's best |")
    print("|---|---|---|---|")
    for name, lo, hi in rows:
        ratio = f"{lo / best:.2f}x" if lo and best else "-"
        f = lambda v: f"x{v:.3f}" if v else "-"
        print(f"| {name} | {f(lo)} | {f(hi)} | {ratio} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
