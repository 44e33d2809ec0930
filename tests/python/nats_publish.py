"""Publishes to a NATS JetStream stream with the nats-py client, as a pack's upstream would.

usage: nats_publish.py URL STREAM SUBJECT COUNT ACTION [ARG...]

`create` makes the stream (subjects STREAM's SUBJECT.>) and publishes COUNT messages with
Nats-Msg-Id m-<i> and hcp-* headers, then one CloudEvent in the NATS binding (ce- headers
made by the CloudEvents SDK) and one malformed message (no hcp-ref); `info CONSUMER` prints
that consumer's pending and redelivered counts as JSON; `delete` removes the stream.

`tickets` makes the stream and publishes COUNT tickets of the tracker pack that keep its payload
schema, then one (Nats-Msg-Id t-bad) that breaks it.

`cluster-stream` makes the stream replicated on three nodes (URL names the cluster's nodes,
comma-separated) and publishes COUNT messages as `create` does, without the last two;
`leader` prints the name of the node leading the stream.

`add-stream` makes the stream with SUBJECT's comma-separated subjects; `publish PREFIX` sends
COUNT messages to the subject SUBJECT with Nats-Msg-Id PREFIX-<i> and hcp-* headers;
`consumers` prints every consumer of the stream (name, description, filter, start sequence,
delivered and pending counts); `legacy NAME` makes a durable pull consumer NAME on SUBJECT with
no description (as hcp-sense named them before their names carried a hash) and acknowledges
COUNT messages from it.
"""
import asyncio
import json
import sys

import nats
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.v1.event import CloudEvent


async def main():
    url, stream, subject, count, action = sys.argv[1:6]
    # A cluster's nodes, comma-separated, as hcp-sense's --nats-url takes them.
    nc = await nats.connect(servers=url.split(","))
    js = nc.jetstream()
    if action == "create":
        await js.add_stream(name=stream, subjects=[subject + ".>"])
        acks = []
        for i in range(int(count)):
            acks.append(
                js.publish(
                    f"{subject}.storm",
                    json.dumps({"i": i}).encode(),
                    headers={"Nats-Msg-Id": f"m-{i}", "hcp-ref": "storm.warning", "hcp-principal": "alice"},
                )
            )
            if len(acks) == 500:
                await asyncio.gather(*acks)
                acks = []
        await asyncio.gather(*acks)
        event = CloudEvent(
            {"type": "storm.warning", "source": "/sensors/9", "subject": "alice", "id": "ce-1", "specversion": "1.0"},
            {"area": "bay"},
        )
        message = ce_http.to_binary_event(event)
        await js.publish(f"{subject}.event", message.body, headers=dict(message.headers))
        await js.publish(f"{subject}.bad", b'{"i": -1}', headers={"Nats-Msg-Id": "bad-1"})
        print(json.dumps({"published": int(count) + 2}))
    elif action == "info":
        info = await js.consumer_info(stream, sys.argv[6])
        print(json.dumps({"pending": info.num_pending, "ack_pending": info.num_ack_pending,
                          "redelivered": info.num_redelivered, "delivered": info.delivered.stream_seq}))
    elif action == "tickets":
        # COUNT tickets of the tracker pack that keep its payload schema, then one that breaks it.
        await js.add_stream(name=stream, subjects=[subject + ".>"])
        for i in range(int(count)):
            ticket = {"key": f"OPS-{i + 1}", "title": "t", "priority": "high", "reporter": "ann"}
            await js.publish(f"{subject}.ticket", json.dumps(ticket).encode(),
                             headers={"Nats-Msg-Id": f"t-{i}", "hcp-ref": "ticket.created", "hcp-principal": "alice"})
        # Its id carries a space and `=`, as a hostile publisher's would: the server logs it
        # without letting it forge a field of the log line.
        bad = {"key": "OPS-0", "title": "t", "priority": "urgent", "reporter": "ann"}
        await js.publish(f"{subject}.ticket", json.dumps(bad).encode(),
                         headers={"Nats-Msg-Id": "t-bad route_id=forged", "hcp-ref": "ticket.created",
                                  "hcp-principal": "alice"})
        print(json.dumps({"published": int(count) + 1}))
    elif action == "add-stream":
        await js.add_stream(name=stream, subjects=subject.split(","))
        print(json.dumps({"stream": stream}))
    elif action == "publish":
        prefix = sys.argv[6]
        for i in range(int(count)):
            await js.publish(
                subject,
                json.dumps({"i": i, "prefix": prefix}).encode(),
                headers={"Nats-Msg-Id": f"{prefix}-{i}", "hcp-ref": "storm.warning", "hcp-principal": "alice"},
            )
        print(json.dumps({"published": int(count)}))
    elif action == "consumers":
        out = []
        for c in await js.consumers_info(stream):
            out.append({
                "name": c.name,
                "description": c.config.description,
                "filter": c.config.filter_subject,
                "deliver_policy": str(getattr(c.config.deliver_policy, "value", c.config.deliver_policy)),
                "start_seq": c.config.opt_start_seq,
                "delivered": c.delivered.consumer_seq,
                "pending": c.num_pending,
                "ack_pending": c.num_ack_pending,
            })
        print(json.dumps(out))
    elif action == "legacy":
        from nats.js.api import AckPolicy, ConsumerConfig
        name = sys.argv[6]
        await js.add_consumer(stream, ConsumerConfig(durable_name=name, filter_subject=subject, ack_policy=AckPolicy.EXPLICIT))
        sub = await js.pull_subscribe_bind(name, stream)
        acknowledged = 0
        while acknowledged < int(count):
            for m in await sub.fetch(int(count) - acknowledged, timeout=5):
                await m.ack_sync()
                acknowledged += 1
        print(json.dumps({"acknowledged": int(count)}))
    elif action == "cluster-stream":
        # A stream replicated on three nodes; a new cluster elects its leaders first.
        for attempt in range(100):
            try:
                await js.add_stream(name=stream, subjects=[subject + ".>"], num_replicas=3)
                break
            except Exception:
                if attempt == 99:
                    raise
                await asyncio.sleep(0.2)
        acks = []
        for i in range(int(count)):
            acks.append(js.publish(f"{subject}.storm", json.dumps({"i": i}).encode(),
                                   headers={"Nats-Msg-Id": f"m-{i}", "hcp-ref": "storm.warning",
                                            "hcp-principal": "alice"}))
            if len(acks) == 500:
                await asyncio.gather(*acks)
                acks = []
        await asyncio.gather(*acks)
        print(json.dumps({"published": int(count)}))
    elif action == "leader":
        # Right after a node is lost the stream may still be electing: asked again meanwhile.
        for attempt in range(50):
            try:
                info = await js.stream_info(stream)
                if info.cluster and info.cluster.leader:
                    break
            except Exception:
                if attempt == 49:
                    raise
            await asyncio.sleep(0.2)
        print(json.dumps({"leader": info.cluster.leader if info.cluster else None,
                          "replicas": len(info.cluster.replicas or []) if info.cluster else 0}))
    elif action == "delete":
        await js.delete_stream(stream)
        print(json.dumps({"deleted": stream}))
    await nc.close()


asyncio.run(main())
