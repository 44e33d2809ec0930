"""Sends webhooks to hcp-sense's ingress listener as real senders sign them.

Standard Webhooks requests are signed by the reference implementation (PyPI's
`standardwebhooks`); GitHub-style ones with the standard library's HMAC, as
GitHub documents; CloudEvents are made by the CloudEvents SDK (PyPI's
`cloudevents`) in binary or structured mode, then signed as Standard Webhooks. Reads a plan (a JSON list of requests) on stdin and prints a
JSON list of {"status", "body", "retry_after"} answers, one per request.

A request: {"url": ..., "sign": "standard" | "github" | "none", "secret": ...,
"msg_id": ..., "ts": the signed time in Unix seconds (default now; the same
request with the same "ts" is signed byte for byte alike, even by another run),
"ts_offset": seconds added to it, "body": text,
"headers": {...}, "tamper": true to change the body after signing}; for
"sign": "cloudevents" also "mode" ("binary" or "structured"), "event" (its
attributes) and "data" (its data), which replace "body". {"replay": i,
"set_headers": {...}} sends the i-th request of the plan again, byte for byte
as it was signed, with those headers changed (a null value removes one): what
an attacker who captured it can do; with "url", to another address. Any request
with "copies": n goes out n times at once, from n threads (a sender's retries
racing, or an attacker's burst), each answer in the list.
"""
import concurrent.futures
import datetime
import hashlib
import hmac
import json
import sys
import urllib.error
import urllib.request

from cloudevents.core.bindings import http as ce_http
from cloudevents.core.v1.event import CloudEvent
from standardwebhooks.webhooks import Webhook


def standard_sign(req, headers, body):
    if "ts" in req:
        at = datetime.datetime.fromtimestamp(req["ts"], tz=datetime.timezone.utc)
    else:
        at = datetime.datetime.now(tz=datetime.timezone.utc)
    at += datetime.timedelta(seconds=req.get("ts_offset", 0))
    headers["webhook-id"] = req["msg_id"]
    headers["webhook-timestamp"] = str(int(at.timestamp()))
    headers["webhook-signature"] = Webhook(req["secret"]).sign(req["msg_id"], at, body)


def prepare(req, sent):
    """The request as it goes out: its URL, headers and body, signed."""
    if "replay" in req:
        url, headers, body = sent[req["replay"]]
        url = req.get("url", url)
        headers = dict(headers)
        for k, v in req.get("set_headers", {}).items():
            headers = {h: x for h, x in headers.items() if h.lower() != k.lower()}
            if v is not None:
                headers[k] = v
        return url, headers, body
    body = req.get("body", "{}")
    headers = {"content-type": "application/json"}
    headers.update(req.get("headers", {}))
    sign = req.get("sign", "none")
    if sign == "standard":
        standard_sign(req, headers, body)
    elif sign == "cloudevents":
        event = CloudEvent(dict(req["event"]), req.get("data"))
        if req["mode"] == "binary":
            message = ce_http.to_binary_event(event)
        else:
            message = ce_http.to_structured_event(event)
        headers = dict(message.headers)
        body = message.body.decode()
        standard_sign(req, headers, body)
    elif sign == "github":
        digest = hmac.new(req["secret"].encode(), body.encode(), hashlib.sha256).hexdigest()
        headers["x-hub-signature-256"] = "sha256=" + digest
    if req.get("tamper"):
        body = body + " "
    return req["url"], headers, body


def post(url, headers, body):
    r = urllib.request.Request(url, data=body.encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(r, timeout=30) as resp:
            status, text, retry_after = resp.status, resp.read().decode(), resp.headers.get("retry-after")
    except urllib.error.HTTPError as e:
        status, text, retry_after = e.code, e.read().decode(), e.headers.get("retry-after")
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = text
    return {"status": status, "body": parsed, "retry_after": retry_after}


def main():
    plan = json.load(sys.stdin)
    sent = []
    answers = []
    for req in plan:
        url, headers, body = prepare(req, sent)
        sent.append((url, headers, body))
        copies = req.get("copies")
        if copies is None:
            answers.append(post(url, headers, body))
            continue
        with concurrent.futures.ThreadPoolExecutor(max_workers=copies) as pool:
            futures = [pool.submit(post, url, dict(headers), body) for _ in range(copies)]
            answers.extend(f.result() for f in futures)
    print(json.dumps(answers))


if __name__ == "__main__":
    main()
