#!/usr/bin/env python3
"""Send one request sequence serially to a router; print which replica served each request.

usage: differential_cache_aware.py URL [GROUPS [PER_GROUP]]
Several prefix groups (a ~500-character system prompt each) interleaved, each request ending in
its own question; replicas are told apart by the `system_fingerprint` kvroute-sim puts in every
answer (its --instance-id). Prints one line per request: index, group, replica.
"""
import json
import random
import sys
import urllib.request

url = sys.argv[1]
groups = int(sys.argv[2]) if len(sys.argv) > 2 else 4
per_group = int(sys.argv[3]) if len(sys.argv) > 3 else 10
rng = random.Random(7)
letters = "abcdefghijklmnopqrstuvwxyz "
systems = ["".join(rng.choice(letters) for _ in range(500)) for _ in range(groups)]
for i in range(per_group):
    for g in range(groups):
        body = {"model": "kvroute-sim", "max_tokens": 2, "messages": [
            {"role": "system", "content": systems[g]},
            {"role": "user", "content": f"question {i} of group {g}: " + "".join(rng.choice(letters) for _ in range(40))},
        ]}
        req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            answer = json.load(r)
        print(i * groups + g, g, answer.get("system_fingerprint"), flush=True)
