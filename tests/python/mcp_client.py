"""An MCP client session against hcp-sense's MCP door, with the official Python SDK (`mcp`).

Reads a plan as JSON on standard input:
  {"url": "http://127.0.0.1:PORT/mcp", "token": "..."}                      Streamable HTTP, or
  {"command": ["hcp-sense", "mcp", "--server", "..."], "env": {...}}          stdio,
  with "read": [uri, ...] resources to read and "calls": [[tool, {args}], ...] tools to call,
  and "listen": {"uri": ..., "deliver": [command...], "events": N, "timeout": S}: subscribe
  (subscriptions/listen), run the command once the subscription is acknowledged, and report
  the events heard (kind, uri, milliseconds after the command ended) and the resources after.
A plan {"url", "holds": [{"token", "count"}, ...]} instead opens, one after another and all held
open together, `count` subscriptions to hcp-sense://records with each token, and reports for
each whether it stayed open (no event, no error within a second) or the error that ended it.
Prints one JSON report: the negotiated protocol version, the tools, every listed resource
(all pages), and each read and call's result or error (code and message).
"""
import asyncio
import json
import sys
import time

from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client


def error_of(e: BaseException) -> dict:
    err = getattr(e, "error", None)
    if err is not None:
        return {"error": {"code": getattr(err, "code", None), "message": getattr(err, "message", str(e))}}
    return {"error": {"code": None, "message": f"{type(e).__name__}: {e}"}}


async def session(plan: dict) -> dict:
    if "url" in plan:
        headers = {"Authorization": f"Bearer {plan['token']}"} if plan.get("token") else {}
        server = streamable_http_client(plan["url"], http_client=create_mcp_http_client(headers=headers))
    else:
        cmd = plan["command"]
        server = StdioServerParameters(command=cmd[0], args=cmd[1:], env=plan.get("env"))
    report: dict = {}
    async with Client(server, cache=None) as client:
        report["protocol"] = client.protocol_version
        report["server"] = client.server_info.name if client.server_info else None
        report["instructions"] = client.instructions
        tools = await client.list_tools()
        report["tools"] = {t.name: {"description": t.description, "readOnly": bool(t.annotations and t.annotations.read_only_hint)} for t in tools.tools}
        resources, cursor, pages = [], None, 0
        while True:
            page = await client.list_resources(cursor=cursor) if cursor else await client.list_resources()
            pages += 1
            resources.extend({"uri": str(r.uri), "name": r.name, "description": r.description, "mimeType": r.mime_type} for r in page.resources)
            cursor = page.next_cursor
            if not cursor or pages > 100:
                break
        report["resources"] = resources
        report["pages"] = pages
        reads = {}
        for uri in plan.get("read", []):
            try:
                got = await client.read_resource(uri)
                c = got.contents[0]
                reads[uri] = {"mimeType": c.mime_type, "json": json.loads(c.text)}
            except Exception as e:  # the server's refusal, reported
                reads[uri] = error_of(e)
        report["reads"] = reads
        calls = []
        for name, args in plan.get("calls", []):
            try:
                r = await client.call_tool(name, args)
                calls.append({"tool": name, "isError": bool(r.is_error), "structured": r.structured_content})
            except Exception as e:
                calls.append({"tool": name, **error_of(e)})
        report["calls"] = calls
        if "listen" in plan:
            report["listen"] = await listen(client, plan["listen"])
    return report


async def listen(client: Client, lp: dict) -> dict:
    out: dict = {"events": []}
    async with client.listen(resource_subscriptions=[lp["uri"]]) as sub:
        out["honored"] = sub.honored.model_dump(by_alias=True, exclude_none=True)
        proc = await asyncio.create_subprocess_exec(
            *lp["deliver"], stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        stdout, stderr = await proc.communicate()
        out["delivered"] = proc.returncode == 0
        out["deliver_output"] = (stdout + stderr).decode()[-500:]
        done = time.monotonic()

        async def take() -> None:
            async for event in sub:
                out["events"].append(
                    {"kind": type(event).__name__, "uri": getattr(event, "uri", None), "ms": (time.monotonic() - done) * 1000}
                )
                if len(out["events"]) >= lp.get("events", 1):
                    return

        try:
            await asyncio.wait_for(take(), lp.get("timeout", 10))
        except asyncio.TimeoutError:
            out["timed_out"] = True
    listed = await client.list_resources()
    out["after"] = [str(r.uri) for r in listed.resources]
    return out


def leaves(e: BaseException) -> list[BaseException]:
    """The exceptions an exception group holds, however deep; the exception itself otherwise."""
    inner = getattr(e, "exceptions", None)
    if not inner:
        return [e]
    return [leaf for x in inner for leaf in leaves(x)]


async def holds(plan: dict) -> dict:
    from contextlib import AsyncExitStack

    outcomes = []
    async with AsyncExitStack() as stack:
        for hold in plan["holds"]:
            http = create_mcp_http_client(headers={"Authorization": f"Bearer {hold['token']}"})
            client = await stack.enter_async_context(
                Client(streamable_http_client(plan["url"], http_client=http), cache=None)
            )
            for _ in range(hold["count"]):
                try:
                    sub = await stack.enter_async_context(client.listen(resource_subscriptions=["hcp-sense://records"]))
                    try:
                        event = await asyncio.wait_for(sub.__anext__(), 1.0)
                        outcomes.append({"token": hold["token"], "outcome": f"event {type(event).__name__}"})
                    except asyncio.TimeoutError:
                        outcomes.append({"token": hold["token"], "outcome": "open"})
                except Exception as e:  # the server's refusal
                    cause = e.__cause__ or e
                    outcomes.append({"token": hold["token"], "outcome": "ended", "error": f"{e} / {cause}"})
    return {"holds": outcomes}


def main() -> None:
    plan = json.load(sys.stdin)
    try:
        report = asyncio.run(holds(plan) if "holds" in plan else session(plan))
    except BaseException as e:  # connection refused, 401: reported, not raised
        report = {"failed": "; ".join(f"{type(x).__name__}: {x}" for x in leaves(e))}
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
