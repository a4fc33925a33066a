"""An OTLP trace receiver for the tests, decoding with the official `opentelemetry-proto`.

    python otlp_receiver.py http|grpc

Listens on a free loopback port and prints `PORT <n>`, then one JSON line per span received:
its ids in hex, kind, name, attributes, status, flags, and the resource and scope it came
with. OTLP/HTTP takes `POST /v1/traces` (protobuf); OTLP/gRPC serves
`TraceService/Export` with grpcio. Anything else is answered 404 and printed as
`BAD <path>`. It exits when its stdin closes, so a test that dies takes it along.
"""

import json
import os
import sys
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2


def value(v: common_pb2.AnyValue):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def emit(request: trace_service_pb2.ExportTraceServiceRequest) -> None:
    for rs in request.resource_spans:
        resource = {kv.key: value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for span in ss.spans:
                line = {
                    "trace_id": span.trace_id.hex(),
                    "span_id": span.span_id.hex(),
                    "parent_span_id": span.parent_span_id.hex(),
                    "trace_state": span.trace_state,
                    "name": span.name,
                    "kind": span.kind,
                    "start": span.start_time_unix_nano,
                    "end": span.end_time_unix_nano,
                    "attributes": {kv.key: value(kv.value) for kv in span.attributes},
                    "status": {"code": span.status.code, "message": span.status.message},
                    "flags": span.flags,
                    "resource": resource,
                    "scope": ss.scope.name,
                }
                print(json.dumps(line), flush=True)


class Http(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
            print(f"BAD {self.path} {self.headers.get('content-type')}", flush=True)
            self.send_response(404)
            self.end_headers()
            return
        request = trace_service_pb2.ExportTraceServiceRequest()
        request.ParseFromString(body)
        emit(request)
        answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


def serve_grpc():
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            emit(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"PORT {port}", flush=True)
    server.wait_for_termination()


def exit_with_parent():
    sys.stdin.read()
    os._exit(0)


if __name__ == "__main__":
    threading.Thread(target=exit_with_parent, daemon=True).start()
    if sys.argv[1] == "grpc":
        serve_grpc()
    else:
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Http)
        print(f"PORT {httpd.server_address[1]}", flush=True)
        httpd.serve_forever()
