"""Publishes to a NATS JetStream stream with the nats-py client, as a pack's upstream would.

usage: nats_publish.py URL STREAM SUBJECT COUNT [create|delete|info]

`create` makes the stream (subjects STREAM's SUBJECT.>) and publishes COUNT messages with
Nats-Msg-Id m-<i> and hcp-* headers, then one CloudEvent in the NATS binding (ce- headers
made by the CloudEvents SDK) and one malformed message (no hcp-ref); `info` prints the
route's consumer's pending and redelivered counts as JSON; `delete` removes the stream.
"""
import asyncio
import json
import sys

import nats
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.v1.event import CloudEvent


async def main():
    url, stream, subject, count, action = sys.argv[1:6]
    nc = await nats.connect(url)
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
    elif action == "delete":
        await js.delete_stream(stream)
        print(json.dumps({"deleted": stream}))
    await nc.close()


asyncio.run(main())
