# The tiny trace crates/bench/testdata/dynamo_tiny_trace.jsonl (python3 gen_dynamo_tiny_trace.py > FILE):
# 40 conversations of 6 turns, each turn's prompt the previous one's plus 1-3 new 512-token
# blocks, interleaved, one arrival every 0-2000 ms; seeded, so the same file each time.
import json, random
rng = random.Random(17)
sessions = []
next_id = 100000
for s in range(40):
    ids = [s * 1000 + j for j in range(rng.randint(1, 4))]
    turns = []
    for t in range(6):
        ids = ids + [s * 1000 + 100 + t * 10 + j for j in range(rng.randint(1, 3))]
        turns.append(list(ids))
    sessions.append(turns)
order = [s for s in range(40) for _ in range(6)]
rng.shuffle(order)
pos = [0] * 40
ts = 0
for s in order:
    ids = sessions[s][pos[s]]
    pos[s] += 1
    length = len(ids) * 512 - rng.randint(0, 400)
    out = rng.randint(10, 300)
    print(json.dumps({"timestamp": ts, "input_length": length, "output_length": out, "hash_ids": ids}))
    ts += rng.randint(0, 2000)
