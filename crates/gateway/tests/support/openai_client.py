"""A real OpenAI client for the tests: the `openai` SDK (PyPI) against a kvroute.

    python openai_client.py BASE_URL MODEL

Prints one JSON object with what it saw: the models listed, a chat completion whole and
streamed, a text completion, and the error of a request for a model no worker serves.
"""

import json
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
hello = [{"role": "user", "content": "Say hello to the router."}]

out = {"models": [m.id for m in client.models.list().data]}
raw = client.chat.completions.with_raw_response.create(model=model, messages=hello, max_tokens=4)
chat = raw.parse()
out["chat"] = {
    "text": chat.choices[0].message.content,
    "finish_reason": chat.choices[0].finish_reason,
    "completion_tokens": chat.usage.completion_tokens,
    "worker": raw.headers.get("x-kvroute-worker"),
}
pieces = []
finish = None
for chunk in client.chat.completions.create(model=model, messages=hello, max_tokens=5, stream=True):
    for choice in chunk.choices:
        pieces.append(choice.delta.content or "")
        finish = choice.finish_reason or finish
out["stream"] = {"text": "".join(pieces), "finish_reason": finish}
c = client.completions.create(model=model, prompt="Once upon a time", max_tokens=3)
out["completion"] = {"text": c.choices[0].text, "completion_tokens": c.usage.completion_tokens}
try:
    client.chat.completions.create(model="no-such-model", messages=hello, max_tokens=2)
    out["unknown_model"] = None
except openai.APIStatusError as e:
    out["unknown_model"] = {"status": e.status_code, "class": type(e).__name__, "code": e.code}
print(json.dumps(out))
