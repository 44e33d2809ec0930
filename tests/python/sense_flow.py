"""A Python grpcio client of hcp-sense: stubs generated from proto/ at run time, then
register -> grant -> bind -> activate -> deliver -> list, as a runtime operator's script would.

Usage: python3 sense_flow.py HOST:PORT PROTO_DIR
"""
import json
import os
import sys
import tempfile


def generate_stubs(proto_dir):
    import grpc_tools
    from grpc_tools import protoc

    out = tempfile.mkdtemp(prefix="hcp-sense-stubs-")
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    files = [
        os.path.join(root, f)
        for root, _, names in os.walk(proto_dir)
        for f in names
        if f.endswith(".proto")
    ]
    rc = protoc.main(
        ["grpc_tools.protoc", f"-I{proto_dir}", f"-I{well_known}", f"--python_out={out}", f"--grpc_python_out={out}"]
        + files
    )
    if rc != 0:
        raise SystemExit(f"protoc failed: {rc}")
    sys.path.insert(0, out)


def main():
    addr, proto_dir = sys.argv[1], sys.argv[2]
    generate_stubs(proto_dir)
    import grpc
    from google.protobuf import struct_pb2
    from hcp.sense.v1 import (
        ingest_pb2,
        ingest_pb2_grpc,
        pack_pb2,
        pack_pb2_grpc,
        policy_pb2,
        policy_pb2_grpc,
        records_pb2,
        records_pb2_grpc,
        types_pb2,
    )

    channel = grpc.insecure_channel(addr)
    packs = pack_pb2_grpc.PackServiceStub(channel)
    policy = policy_pb2_grpc.PolicyServiceStub(channel)
    ingest = ingest_pb2_grpc.IngestServiceStub(channel)
    records = records_pb2_grpc.RecordServiceStub(channel)

    with open(os.path.join(proto_dir, "..", "examples", "github.pack.json")) as f:
        manifest = struct_pb2.Struct()
        manifest.update(json.load(f))
    reg = packs.RegisterPack(pack_pb2.RegisterPackRequest(manifest=manifest))
    assert reg.pack.pack_id == "github", reg

    policy.GrantSenseEnable(policy_pb2.GrantSenseEnableRequest(principal="py-alice", pack_id="github"))
    policy.PutBinding(
        policy_pb2.PutBindingRequest(
            principal="py-alice", pack_id="github", binding_id="gh-py-alice", state=types_pb2.BINDING_STATE_LINKED
        )
    )
    policy.ActivateSense(
        policy_pb2.ActivateSenseRequest(principal="py-alice", pack_id="github", route=types_pb2.ROUTE_INBOX)
    )

    payload = struct_pb2.Struct()
    payload.update({"issue": 7, "title": "from python"})
    out = ingest.DeliverTrigger(
        ingest_pb2.DeliverTriggerRequest(
            pack_id="github", ref="issue.opened", principal="py-alice", land="user", payload=payload
        )
    )
    assert out.disposition == types_pb2.DISPOSITION_RECORDED_INBOX, out
    assert out.record_id

    dropped = ingest.DeliverTrigger(
        ingest_pb2.DeliverTriggerRequest(pack_id="github", ref="issue.deleted", principal="py-alice", land="user")
    )
    assert dropped.disposition == types_pb2.DISPOSITION_DROPPED, dropped
    assert dropped.drop_reason == types_pb2.DROP_REASON_UNDECLARED_REF, dropped

    try:
        ingest.DeliverTrigger(ingest_pb2.DeliverTriggerRequest(pack_id="github", ref="Bad..Ref", principal="py-alice", land="user"))
        raise AssertionError("a malformed ref was accepted")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
        assert "ref" in e.details(), e.details()

    listed = records.ListRecords(records_pb2.ListRecordsRequest(viewer="py-alice", principal="py-alice"))
    assert len(listed.records) == 1, listed
    rec = listed.records[0]
    assert rec.record_id == out.record_id
    assert (rec.principal, rec.binding_id, rec.land, rec.pack_id, rec.ref) == (
        "py-alice", "gh-py-alice", "user", "github", "issue.opened"
    ), rec
    assert rec.payload["title"] == "from python"

    # A live inbox: watch from where the listing ended while triggers arrive, as a consumer
    # would, then resume from the last message's token after cancelling.
    watch = records.WatchRecords(
        records_pb2.WatchRecordsRequest(
            viewer="py-alice", principal="py-alice", resume_token=listed.resume_page_token
        )
    )
    sent = []

    def deliver_more():
        for i in range(3):
            r = ingest.DeliverTrigger(
                ingest_pb2.DeliverTriggerRequest(
                    pack_id="github", ref="issue.opened", principal="py-alice", land="user",
                    trigger_id=f"py-watch-{i}",
                )
            )
            sent.append(r.record_id)

    import threading

    writer = threading.Thread(target=deliver_more)
    writer.start()
    seen, token = [], None
    for message in watch:
        seen.extend(r.record_id for r in message.records)
        token = message.resume_token
        if len(seen) >= 3:
            break
    watch.cancel()
    writer.join()
    assert seen == sent, (seen, sent)
    later = ingest.DeliverTrigger(
        ingest_pb2.DeliverTriggerRequest(
            pack_id="github", ref="issue.opened", principal="py-alice", land="user", trigger_id="py-watch-later"
        )
    )
    resumed = records.WatchRecords(
        records_pb2.WatchRecordsRequest(viewer="py-alice", principal="py-alice", resume_token=token),
        timeout=10,
    )
    for message in resumed:
        if message.records:
            assert [r.record_id for r in message.records] == [later.record_id], message
            break
    resumed.cancel()

    # A quota of one on py-alice: the next trigger is recorded, the one after refused with
    # RESOURCE_EXHAUSTED and a google.rpc.RetryInfo that grpcio-status reads; a retried
    # recorded trigger id is its first record whatever the quota.
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    policy.PutQuota(policy_pb2.PutQuotaRequest(pack_id="github", principal="py-alice", rate_per_second=0.01, burst=1))
    first = ingest.DeliverTrigger(
        ingest_pb2.DeliverTriggerRequest(
            pack_id="github", ref="issue.opened", principal="py-alice", land="user", trigger_id="py-quota-1"
        )
    )
    assert first.record_id and not first.duplicate, first
    try:
        ingest.DeliverTrigger(
            ingest_pb2.DeliverTriggerRequest(
                pack_id="github", ref="issue.opened", principal="py-alice", land="user", trigger_id="py-quota-2"
            )
        )
        raise AssertionError("a trigger over quota was accepted")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
        status = rpc_status.from_call(e)
        delays = []
        for detail in status.details:
            if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                info = error_details_pb2.RetryInfo()
                detail.Unpack(info)
                delays.append(info.retry_delay.ToTimedelta().total_seconds())
        assert len(delays) == 1 and 0 < delays[0] <= 100, delays
    again = ingest.DeliverTrigger(
        ingest_pb2.DeliverTriggerRequest(
            pack_id="github", ref="issue.opened", principal="py-alice", land="user", trigger_id="py-quota-1"
        )
    )
    assert again.duplicate and again.record_id == first.record_id, again
    print("python flow ok", rec.record_id)


if __name__ == "__main__":
    main()
