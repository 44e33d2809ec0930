"""A fast DeliverTriggers producer in Python grpcio: CHANNELS channels, each one stream of
COUNT small triggers sent as fast as grpcio writes them (one HTTP/2 DATA frame each), every
answer checked: one per trigger, in the order sent, each recorded.

Usage: python3 stream_producer.py HOST:PORT PROTO_DIR CHANNELS COUNT [TAG]
(TAG starts every trigger id, so runs against one server do not share ids.)
Prints one JSON line: {"channels", "count", "request_bytes", "answered", "seconds"}.
"""
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sense_flow import generate_stubs  # noqa: E402


def main():
    addr, proto_dir, channels, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    tag = sys.argv[5] if len(sys.argv) > 5 else ""
    generate_stubs(proto_dir)
    import grpc
    from hcp.sense.v1 import ingest_pb2, ingest_pb2_grpc, types_pb2

    def base36(i):
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"
        return digits[i // 1296 % 36] + digits[i // 36 % 36] + digits[i % 36]

    def request(c, i):
        # 43 bytes as a DeliverTriggersRequest: what a relay of small world changes sends.
        return ingest_pb2.DeliverTriggersRequest(
            trigger=ingest_pb2.DeliverTriggerRequest(
                pack_id="github", ref="issue.opened", principal="alice", land="user",
                trigger_id=f"{tag}{c}{base36(i)}",
            )
        )

    size = len(request(0, 0).SerializeToString())
    errors, answered = [], [0] * channels

    def produce(c):
        channel = grpc.insecure_channel(addr)
        stub = ingest_pb2_grpc.IngestServiceStub(channel)
        try:
            expected = 0
            for answer in stub.DeliverTriggers(request(c, i) for i in range(count)):
                if answer.index != expected:
                    raise AssertionError(f"channel {c}: answer {answer.index}, expected {expected}")
                which = answer.WhichOneof("result")
                if which != "outcome" or answer.outcome.disposition != types_pb2.DISPOSITION_RECORDED_INBOX:
                    raise AssertionError(f"channel {c}: trigger {expected} answered {answer}")
                expected += 1
                answered[c] = expected
            if expected != count:
                raise AssertionError(f"channel {c}: {expected} answers to {count} triggers")
        except grpc.RpcError as e:
            errors.append(f"channel {c} after {answered[c]}: {e.code()} {e.details()} {e.debug_error_string()}")
        except AssertionError as e:
            errors.append(str(e))
        finally:
            channel.close()

    started = time.monotonic()
    threads = [threading.Thread(target=produce, args=(c,)) for c in range(channels)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit("\n".join(errors))
    print(json.dumps({
        "channels": channels, "count": count, "request_bytes": size,
        "answered": sum(answered), "seconds": round(time.monotonic() - started, 2),
    }))


if __name__ == "__main__":
    main()
