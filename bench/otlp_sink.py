#!/usr/bin/env python3
"""A fast OTLP/HTTP sink for the tracing benchmark: accepts `POST /v1/traces`, reads the body and
answers an empty `ExportTraceServiceResponse` (200, no bytes), without decoding (the tests
decode with opentelemetry-proto; here the collector must not be the bottleneck). On SIGTERM it
prints the exports and bytes it took.

    python3 bench/otlp_sink.py PORT
"""
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

seen = {"exports": 0, "bytes": 0}


class Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        n = int(self.headers.get("content-length", "0"))
        self.rfile.read(n)
        seen["exports"] += 1
        seen["bytes"] += n
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def done(*_):
    print(f"otlp-sink exports={seen['exports']} bytes={seen['bytes']}", flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, done)
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink).serve_forever()
