"""The indexer against Dynamo's, two ways (bench/indexer_vs_dynamo.sh runs both):

  criterion DIR         the side-by-side table of bench/indexer-vs-dynamo's criterion run
                        (DIR = its target/criterion), each figure with its ratio to KvIndex's
  python FILE KVROUTE   Dynamo 1.6.1's Python RadixTree on a kvroute-bench replay file (JSON
                        lines {"worker", "dp_rank", "events"}), its fixed cost per call
                        measured and taken out; KVROUTE is `kvroute-bench index FILE`'s output,
                        whose 1-thread figures it prints beside Dynamo's, with their ratios

The Python check needs Dynamo's venv ($PEERS_DIR/venv-dyn/bin/python). Each stored block's
tokens_hash is Python's hash of its tokens (the tree treats it as opaque); its block_hash is the
engine's hash from the file. Queries are drawn as kvroute-bench draws them: every k-th stored
event's whole prefix (gathered back along parents), padded with new tokens to 512 blocks.
"""

import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

QUERY_BLOCKS = 512
MASK = (1 << 64) - 1


def criterion(root):
    rows = {}
    for est in Path(root).glob("*/*/new/estimates.json"):
        group, bench = est.parts[-4], est.parts[-3]
        mean = json.loads(est.read_text())["mean"]["point_estimate"]  # ns per iteration
        info = json.loads((est.parent / "benchmark.json").read_text())
        elements = (info.get("throughput") or {}).get("Elements", 1)
        rows.setdefault(group, {})[bench] = (mean, elements)
    base = rows.get("KvIndex", {})
    print(f"{'indexer':<20} {'build Mev/s':>16} {'churn Mev/s':>16} {'hit µs':>14} {'system µs':>14} {'miss µs':>14}")
    order = sorted(rows, key=lambda g: (g != "KvIndex", g))
    for group in order:
        cells = []
        for bench in ["build", "churn"]:
            if bench in rows[group]:
                mean, el = rows[group][bench]
                rate = el / mean * 1e3  # M events/s
                b = base.get(bench)
                ratio = f" ({(b[1] / b[0] * 1e3) / rate:.2f}x)" if b and group != "KvIndex" else ""
                cells.append(f"{rate:>7.2f}{ratio:>9}")
            else:
                cells.append(f"{'-':>16}")
        for bench in ["hit", "system", "miss"]:
            if bench in rows[group]:
                mean, _ = rows[group][bench]
                b = base.get(bench)
                ratio = f" ({b[0] / mean:.2f}x)" if b and group != "KvIndex" else ""
                cells.append(f"{mean / 1e3:>6.2f}{ratio:>8}")
            else:
                cells.append(f"{'-':>14}")
        print(f"{group:<20} " + " ".join(cells))
    print("(x) = KvIndex's figure / the row's: for events/s below 1 means KvIndex is slower;"
          " for latency (mean µs per query) above 1 means KvIndex is slower")


def read(path):
    """The file's events in Dynamo's JSON, its stored events and its block-event count."""
    calls, stored, blocks = [], [], 0
    event_id = 0
    for line in open(path):
        if not line.strip():
            continue
        rec = json.loads(line)
        worker, rank = rec["worker"], rec.get("dp_rank") or 0
        for ev in rec["events"]:
            kind = ev["type"] if isinstance(ev, dict) else ev[0]
            get = (lambda k, i: ev.get(k)) if isinstance(ev, dict) else (
                lambda k, i: ev[i] if len(ev) > i else None)
            event_id += 1
            if kind == "BlockStored":
                hashes, parent = get("block_hashes", 1), get("parent_block_hash", 2)
                tokens, bs = get("token_ids", 3), get("block_size", 4)
                stored.append((worker, rank, parent, hashes, tokens, bs))
                data = {"stored": {"parent_hash": parent, "blocks": [
                    {"block_hash": h, "tokens_hash": hash(tuple(tokens[i * bs:(i + 1) * bs])) & MASK}
                    for i, h in enumerate(hashes)]}}
                blocks += len(hashes)
            elif kind == "BlockRemoved":
                data = {"removed": {"block_hashes": get("block_hashes", 1)}}
                blocks += len(data["removed"]["block_hashes"])
            else:
                data = "cleared"
                blocks += 1
            body = json.dumps({"event_id": event_id, "dp_rank": rank, "data": data}).encode()
            calls.append((worker, body))
    return calls, stored, blocks


def queries(stored, count, seed=7):
    at = {}
    for i, (worker, rank, parent, hashes, tokens, bs) in enumerate(stored):
        for j, h in enumerate(hashes):
            at[(worker, rank, h)] = (i, j)
    rng = random.Random(seed)
    picks = [i for i, s in enumerate(stored) if s[3]]
    step = max(1, len(picks) // max(1, count))
    bs = stored[0][5] if stored else 16
    hit = []
    for i in picks[::step][:count]:
        worker, rank = stored[i][0], stored[i][1]
        cursor, chunks = (i, len(stored[i][3]) - 1), []
        while len(chunks) < 1_000_000:
            _, _, parent, hashes, tokens, b = stored[cursor[0]]
            chunks.append(tokens[cursor[1] * b:(cursor[1] + 1) * b])
            p = parent if cursor[1] == 0 else hashes[cursor[1] - 1]
            if p is None or (worker, rank, p) not in at:
                break
            cursor = at[(worker, rank, p)]
        tokens = [t for c in reversed(chunks) for t in c][:QUERY_BLOCKS * bs]
        tokens += [rng.randrange(128_000) for _ in range(QUERY_BLOCKS * bs - len(tokens))]
        hit.append([hash(tuple(tokens[k * bs:(k + 1) * bs])) & MASK for k in range(QUERY_BLOCKS)])
    miss = [[rng.getrandbits(64) for _ in range(QUERY_BLOCKS)] for _ in range(count)]
    return hit, miss


def per_call(fn, n=20000):
    times = []
    for _ in range(n):
        t = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t)
    return statistics.median(times)


def pct(times, q):
    s = sorted(times)
    return s[round((len(s) - 1) * q)]


UNITS = {"ns": 1e-3, "µs": 1.0, "us": 1.0, "ms": 1e3, "s": 1e6}


def kvroute_figures(text):
    rate = float(re.search(r"^1 thread: ([\d.]+) M block events/s", text, re.M).group(1))
    out = {"rate": rate}
    for kind in ["hit", "miss"]:
        m = re.search(rf"^1 thread:.*?\n(?:.*\n)*?  {kind}\s+p50\s+([\d.]+)(\S+)\s+p90\s+([\d.]+)(\S+)\s+p99\s+([\d.]+)(\S+)", text, re.M)
        out[kind] = [float(m.group(i)) * UNITS[m.group(i + 1)] for i in (1, 3, 5)]
    return out


def python(path, kvroute_out):
    from dynamo.llm import RadixTree
    calls, stored, blocks = read(path)
    hit, miss = queries(stored, 1024)
    tree = RadixTree()
    start = time.perf_counter_ns()
    for worker, body in calls:
        tree.apply_event(worker, body)
    raw = (time.perf_counter_ns() - start) / 1e9
    empty = json.dumps({"event_id": 0, "dp_rank": 0, "data": {"removed": {"block_hashes": []}}}).encode()
    apply_cost = per_call(lambda: tree.apply_event(10_000_000, empty)) / 1e9
    net = max(raw - apply_cost * len(calls), 1e-9)
    one = [miss[0][0]]
    query_cost = per_call(lambda: tree.find_matches(one)) / 1e3  # µs
    print(f"Dynamo RadixTree (Python): {len(calls)} events, {blocks} block events: raw {blocks / raw / 1e6:.2f} M block events/s;"
          f" per call {apply_cost * 1e6:.2f} µs x {len(calls)} taken out: {blocks / net / 1e6:.2f} M block events/s")
    print(f"  per-query cost (a 1-block miss) {query_cost:.2f} µs, taken out of the latencies below")
    kv = kvroute_figures(open(kvroute_out).read())
    print(f"kvroute KvIndex (kvroute-bench index, 1 thread): {kv['rate']:.2f} M block events/s"
          f" = {kv['rate'] / (blocks / net / 1e6):.2f}x Dynamo's")
    for kind, qs in [("hit", hit), ("miss", miss)]:
        times = []
        for _ in range(5):
            for q in qs:
                t = time.perf_counter_ns()
                tree.find_matches(q)
                times.append((time.perf_counter_ns() - t) / 1e3 - query_cost)
        dyn = [pct(times, q) for q in (0.5, 0.9, 0.99)]
        mine = kv[kind]
        print(f"  {kind:<4} p50/p90/p99 Dynamo {dyn[0]:.2f}/{dyn[1]:.2f}/{dyn[2]:.2f} µs,"
              f" KvIndex {mine[0]:.2f}/{mine[1]:.2f}/{mine[2]:.2f} µs:"
              f" KvIndex/Dynamo {mine[0] / max(dyn[0], 1e-3):.2f}/{mine[1] / max(dyn[1], 1e-3):.2f}/{mine[2] / max(dyn[2], 1e-3):.2f}")


if __name__ == "__main__":
    if sys.argv[1] == "criterion":
        criterion(sys.argv[2])
    else:
        python(sys.argv[2], sys.argv[3])
