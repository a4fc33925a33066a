#!/usr/bin/env python3
"""Long, growing agent conversations against a router, for bench/mixed_tokenize.sh.

Each conversation starts with a 2k-character system prompt and gains a turn of ~1.4k
characters (prose and a code block) per request, up to TURNS (default 40, about 57k
characters); then a new conversation starts. CONCURRENCY conversations run at once, each
sending RATE requests a second (open loop: the same work arrives however fast the router is;
0 for back to back). Runs for DURATION seconds, then prints: requests, and their latency
p50/p99 in ms.

  python3 bench/agent_turns.py URL [DURATION] [CONCURRENCY] [RATE]
"""
import json
import random
import sys
import threading
import time
import urllib.request

URL = sys.argv[1].rstrip("/") + "/v1/chat/completions"
DURATION = float(sys.argv[2]) if len(sys.argv) > 2 else 10
CONCURRENCY = int(sys.argv[3]) if len(sys.argv) > 3 else 1
RATE = float(sys.argv[4]) if len(sys.argv) > 4 else 5
TURNS = 40


def words(rng, n):
    return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
                    for _ in range(n))


def turn(rng, i):
    if i % 2 == 0:
        return {"role": "user", "content": words(rng, 120) + "\n"}
    code = "".join(f"    let v{k} = f{rng.randint(0, 99)}(x, {k});\n" for k in range(12))
    return {"role": "assistant", "content": words(rng, 80) + "\n```rust\n" + code + "```\n"}


latencies = []
lock = threading.Lock()
stop_at = time.monotonic() + DURATION


def run(seed):
    rng = random.Random(seed)
    due = time.monotonic()
    while time.monotonic() < stop_at:
        messages = [{"role": "system", "content": words(rng, 300)}]
        for i in range(TURNS):
            if time.monotonic() >= stop_at:
                return
            messages.append(turn(rng, i))
            if i % 2 == 1:
                continue  # the user's turn is what is sent
            if RATE > 0:
                due += 1 / RATE
                time.sleep(max(0.0, due - time.monotonic()))
            body = json.dumps({"model": "mock-model", "max_tokens": 4, "messages": messages}).encode()
            req = urllib.request.Request(URL, body, {"content-type": "application/json"})
            t = time.monotonic()
            with urllib.request.urlopen(req) as r:
                r.read()
            with lock:
                latencies.append(time.monotonic() - t)


threads = [threading.Thread(target=run, args=(s,)) for s in range(CONCURRENCY)]
for t in threads:
    t.start()
for t in threads:
    t.join()
latencies.sort()
n = len(latencies)
pick = lambda p: latencies[min(n - 1, int(n * p))] * 1e3 if n else float("nan")
print(f"agent_requests={n} p50_ms={pick(0.5):.1f} p99_ms={pick(0.99):.1f}")
