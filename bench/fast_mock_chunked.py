#!/usr/bin/env python3
"""../shared/peers/fast_mock.py's answers, for request bodies sent chunked as well.

Envoy behind an ext_proc endpoint picker in GIE's processing mode (request bodies
FULL_DUPLEX_STREAMED) forwards each request body chunked, without content-length. The shared
fast mock reads only content-length bodies: it would answer, then read the chunks as the next
request and close the connection. This one reads both, answering each request once its body is
whole; a content-length request takes the same path as the shared mock's. Non-streaming only.

Usage: python fast_mock_chunked.py PORT [NAME]    (bench/overhead.sh starts it for envoy-epp rows)
"""
import asyncio
import json
import sys

try:
    import uvloop
    uvloop.install()
except ImportError:
    pass

PORT = int(sys.argv[1])
NAME = sys.argv[2] if len(sys.argv) > 2 else f"fast-{PORT}"


def resp(body: bytes, ctype=b"application/json") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype + b"\r\nx-mock-worker: " + NAME.encode() +
            b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


CHAT = resp(json.dumps({
    "id": "chatcmpl-" + NAME, "object": "chat.completion", "created": 0, "model": "mock-model",
    "system_fingerprint": NAME,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello from " + NAME}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}).encode())
MODELS = resp(json.dumps({"object": "list", "data": [{"id": "mock-model", "object": "model", "owned_by": "mock"}]}).encode())
INFO = resp(json.dumps({"model_path": "mock-model", "served_model_name": "mock-model", "tp_size": 1, "dp_size": 1,
                        "is_generation": True}).encode())
OK = resp(b'{"status":"ok"}')
NF = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"


def chunked_body(buf: bytes, start: int):
    """(body, end) of a chunked body that begins at start, or None while it is incomplete."""
    body = b""
    pos = start
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(buf[pos:eol].split(b";")[0], 16)
        pos = eol + 2
        if size == 0:
            # Trailers (none expected), then the blank line.
            end = buf.find(b"\r\n", pos)
            while end > pos:
                pos = end + 2
                end = buf.find(b"\r\n", pos)
            if end < 0:
                return None
            return body, end + 2
        if len(buf) < pos + size + 2:
            return None
        body += buf[pos:pos + size]
        pos += size + 2


class P(asyncio.Protocol):
    def connection_made(self, t):
        self.t = t
        self.buf = b""

    def data_received(self, data):
        self.buf += data
        while True:
            i = self.buf.find(b"\r\n\r\n")
            if i < 0:
                if len(self.buf) > 1 << 20 or (self.buf[:3] == b"PRI"):
                    self.t.close()
                return
            head = self.buf[:i]
            line, _, rest = head.partition(b"\r\n")
            parts = line.split(b" ")
            if len(parts) < 2:
                self.t.close()
                return
            method, path = parts[0], parts[1]
            clen = 0
            chunked = False
            for h in rest.split(b"\r\n"):
                low = h.lower()
                if low[:15] == b"content-length:":
                    clen = int(h[15:].strip())
                elif low[:18] == b"transfer-encoding:" and b"chunked" in low:
                    chunked = True
            if chunked:
                got = chunked_body(self.buf, i + 4)
                if got is None:
                    return
                body, end = got
                self.buf = self.buf[end:]
            else:
                if len(self.buf) < i + 4 + clen:
                    return
                body = self.buf[i + 4:i + 4 + clen]
                self.buf = self.buf[i + 4 + clen:]
            if method == b"GET":
                if path.startswith(b"/v1/models"):
                    out = MODELS
                elif b"info" in path:
                    out = INFO
                else:
                    out = OK
            elif path == b"/tokenize" or path.endswith(b"/render"):
                toks = list(body[:4096])
                if path == b"/tokenize":
                    out = resp(json.dumps({"count": len(toks), "max_model_len": 4096, "tokens": toks}).encode())
                elif path.startswith(b"/v1/completions"):
                    out = resp(json.dumps([{"token_ids": toks}]).encode())
                else:
                    out = resp(json.dumps({"token_ids": toks}).encode())
            elif method == b"POST":
                out = CHAT
            else:
                out = NF
            self.t.write(out)


async def main():
    loop = asyncio.get_running_loop()
    srv = await loop.create_server(P, "127.0.0.1", PORT, backlog=1024)
    print(f"fast mock (chunked bodies too) {NAME} on 127.0.0.1:{PORT}", flush=True)
    await srv.serve_forever()


asyncio.run(main())
