"""A stock grpcio client (default channel options: 8 KiB soft, 16 KiB hard metadata limits)
delivers a tracker ticket whose payload breaks its schema in many places with long values in
one script, and reports what it was told: the code, the violations of the status details,
and the size of the trailers as grpcio counts them (name + value + 32 bytes each).

Usage: python3 long_refusal.py HOST:PORT PROTO_DIR SCRIPT
SCRIPT: ascii, cyrillic, cjk or emoji. Prints one JSON object.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sense_flow import generate_stubs  # noqa: E402

TEXT = {
    "ascii": "a value quoted whole ",
    "cyrillic": "значение ",
    "cjk": "値を引用する",
    "emoji": "🦀🚀",
}


def main():
    addr, proto_dir, script = sys.argv[1], sys.argv[2], sys.argv[3]
    generate_stubs(proto_dir)
    import grpc
    from google.protobuf import struct_pb2
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status
    from hcp.sense.v1 import ingest_pb2, ingest_pb2_grpc

    # About 2,400 bytes of UTF-8 each: far past what a violation may quote, and the payload
    # within its 64 KiB.
    long = TEXT[script] * (2400 // len(TEXT[script].encode()))
    payload = struct_pb2.Struct()
    # Every field wrong, each quoting a long value: more violations than are reported.
    payload.update(
        {
            "key": long,
            "title": long,
            "priority": long,
            "status": long,
            "reporter": long,
            "assignee": long,
            "labels": [long] * 6,
            "url": long,
            "project": long,
            "component": long,
            long[:64]: long,
        }
    )
    channel = grpc.insecure_channel(addr)
    ingest = ingest_pb2_grpc.IngestServiceStub(channel)
    try:
        ingest.DeliverTrigger(
            ingest_pb2.DeliverTriggerRequest(
                pack_id="tracker", ref="ticket.created", principal="alice", land="user", payload=payload
            ),
            timeout=30,
        )
        print(json.dumps({"code": "OK"}))
        return
    except grpc.RpcError as e:
        trailers = e.trailing_metadata() or ()
        size = sum(len(k) + len(v if isinstance(v, bytes) else v.encode()) + 32 for k, v in trailers)
        # grpcio takes grpc-status and grpc-message off the trailers it hands over.
        size += len("grpc-status") + 1 + 32
        # grpc-message as it was sent: percent-encoded (tonic's set), three bytes an escape.
        escaped = set(b' "#%<>`?{}')
        wire = sum(1 if 0x20 <= b < 0x7F and b not in escaped else 3 for b in (e.details() or "").encode())
        size += len("grpc-message") + wire + 32
        violations = []
        status = rpc_status.from_call(e)
        if status is not None:
            for d in status.details:
                if d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                    bad = error_details_pb2.BadRequest()
                    d.Unpack(bad)
                    violations = [[v.field, v.description] for v in bad.field_violations]
        print(
            json.dumps(
                {
                    "code": e.code().name,
                    "message": e.details(),
                    "violations": violations,
                    "trailer_bytes": size,
                },
                ensure_ascii=False,
            )
        )


if __name__ == "__main__":
    main()
