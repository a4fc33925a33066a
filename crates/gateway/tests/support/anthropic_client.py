"""A real Anthropic client for the tests: the `anthropic` SDK (PyPI) against a kvroute.

    python anthropic_client.py BASE_URL MODEL SCENARIO [API_KEY]

Prints one JSON object with what the scenario saw:
- `basic`: a message, then the same streamed (events and final message), then count_tokens;
- `conversation`: four turns of one conversation, each turn's worker and usage;
- `malformed`: a body whose messages are not a list (the SDK does not check), and its error;
- `auth`: one call with API_KEY (sent as `x-api-key`), its status or error.
"""

import json
import sys

import anthropic

base, model, scenario = sys.argv[1], sys.argv[2], sys.argv[3]
key = sys.argv[4] if len(sys.argv) > 4 else "unused"
client = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=60)


def usage(u):
    return {
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "cache_read_input_tokens": u.cache_read_input_tokens,
        "cache_creation_input_tokens": u.cache_creation_input_tokens,
    }


def error(e):
    return {"status": e.status_code, "class": type(e).__name__, "body": e.body}


out = {}
if scenario == "basic":
    hello = [{"role": "user", "content": "Say hello to the router."}]
    m = client.messages.create(model=model, max_tokens=6, messages=hello, system="Be brief.")
    out["message"] = {
        "id": m.id,
        "type": m.type,
        "role": m.role,
        "text": "".join(b.text for b in m.content if b.type == "text"),
        "stop_reason": m.stop_reason,
        "usage": usage(m.usage),
    }
    events = []
    with client.messages.stream(model=model, max_tokens=5, messages=hello) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    # The SDK dispatched each frame on its `event:` line; the raw events again, for their types.
    raw = client.messages.create(model=model, max_tokens=5, messages=hello, stream=True)
    for event in raw:
        events.append(event.type)
    out["stream"] = {
        "text": text,
        "final_text": "".join(b.text for b in final.content if b.type == "text"),
        "stop_reason": final.stop_reason,
        "usage": usage(final.usage),
        "events": events,
    }
    out["count"] = client.messages.count_tokens(model=model, messages=hello).input_tokens
elif scenario == "conversation":
    system = "You are a coding agent. " * 40
    messages = []
    turns = []
    for i in range(4):
        messages.append({"role": "user", "content": f"Step {i}: " + "explain the code again. " * 20})
        raw = client.messages.with_raw_response.create(
            model=model, max_tokens=4, system=system, messages=messages
        )
        m = raw.parse()
        turns.append({"worker": raw.headers.get("x-kvroute-worker"), "usage": usage(m.usage)})
        messages.append({"role": "assistant", "content": m.content[0].text})
    out["turns"] = turns
elif scenario == "malformed":
    try:
        client.messages.create(model=model, max_tokens=5, messages="not a list")
        out["error"] = None
    except anthropic.APIStatusError as e:
        out["error"] = error(e)
elif scenario == "auth":
    try:
        m = client.messages.create(
            model=model, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        out["ok"] = m.type
    except anthropic.APIStatusError as e:
        out["error"] = error(e)
print(json.dumps(out))
