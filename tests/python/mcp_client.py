"""An MCP client session against hcp-sense's MCP door, with the official Python SDK (`mcp`).

Reads a plan as JSON on standard input:
  {"url": "http://127.0.0.1:PORT/mcp", "token": "..."}                      Streamable HTTP
  (with "ca": a CA file, https checked against it), or
  {"command": ["hcp-sense", "mcp", "--server", "..."], "env": {...}}          stdio,
  with "read": [uri, ...] resources to read and "calls": [[tool, {args}], ...] tools to call,
  and "listen": {"uri": ..., "deliver": [command...], "events": N, "timeout": S}: subscribe
  (subscriptions/listen), run the command once the subscription is acknowledged, and report
  the events heard (kind, uri, milliseconds after the command ended) and the resources after.
The listen plan may give "steps": [[command...], ...] instead of "deliver": each is run in turn
(its output reported), a pause of "pause" seconds after each; and "until_end": true waits for the
subscription itself to end (reported: how, and the epoch second it did).
A plan {"url", "raw": [{"method", "headers", "body", "sleep"}, ...]} sends each HTTP request as
given (after sleeping "sleep" seconds; a body that is an object is sent as JSON, a string as is)
and reports each answer's status, session and Retry-After headers and body; "$session" in a
header value is the session id of the latest answer that named one.
A plan {"url", "holds": [{"token", "count"}, ...]} instead opens, one after another and all held
open together, `count` subscriptions to hcp-sense://records with each token (to tool list changes
alone with "tools": true; to "uri" when given), and reports for
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
        if "ca" in plan:  # https: the server's certificate checked against this CA file
            import httpx2

            http = httpx2.AsyncClient(headers=headers, verify=plan["ca"], timeout=httpx2.Timeout(30, read=300))
        else:
            http = create_mcp_http_client(headers=headers)
        server = streamable_http_client(plan["url"], http_client=http)
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


async def run_command(cmd: list) -> tuple[bool, str]:
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await proc.communicate()
    return proc.returncode == 0, (stdout + stderr).decode()[-2000:]


def meta_of(event) -> dict:
    meta = getattr(event, "meta", None)
    if meta is None:
        return {}
    return meta if isinstance(meta, dict) else getattr(meta, "model_dump", lambda **_: {})(by_alias=True)


async def listen(client: Client, lp: dict) -> dict:
    out: dict = {"events": []}
    try:
        async with client.listen(resource_subscriptions=[lp["uri"]]) as sub:
            out["honored"] = sub.honored.model_dump(by_alias=True, exclude_none=True)
            done = time.monotonic()

            async def take() -> None:
                async for event in sub:
                    out["events"].append(
                        {"kind": type(event).__name__, "uri": getattr(event, "uri", None), "meta": meta_of(event), "ms": (time.monotonic() - done) * 1000}
                    )
                    if not lp.get("until_end") and len(out["events"]) >= lp.get("events", 1):
                        return
                out["ended"] = {"how": "closed", "at": time.time()}

            taking = asyncio.create_task(take())
            if "steps" in lp:
                out["steps"] = []
                for step in lp["steps"]:
                    began = (time.monotonic() - done) * 1000
                    ok, output = await run_command(step)
                    out["steps"].append({"ok": ok, "output": output, "ms": began})
                    await asyncio.sleep(lp.get("pause", 0.5))
            elif "deliver" in lp:
                ok, output = await run_command(lp["deliver"])
                out["delivered"] = ok
                out["deliver_output"] = output[-500:]
            done = time.monotonic()
            try:
                await asyncio.wait_for(taking, lp.get("timeout", 10))
            except asyncio.TimeoutError:
                out["timed_out"] = True
    except Exception as e:  # the subscription ended by the server
        out["ended"] = {"how": "error", "at": time.time(), **error_of(e)}
    if lp.get("until_end"):
        return out
    listed = await client.list_resources()
    out["after"] = [str(r.uri) for r in listed.resources]
    return out


async def raw(plan: dict) -> dict:
    import httpx2 as httpx  # the HTTP client the SDK itself is built on

    answers = []
    session_id = None
    async with httpx.AsyncClient(timeout=10) as http:
        for r in plan["raw"]:
            await asyncio.sleep(r.get("sleep", 0))
            headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
            for k, v in r.get("headers", {}).items():
                headers[k] = v.replace("$session", session_id or "")
            body = r.get("body")
            content = json.dumps(body).encode() if isinstance(body, (dict, list)) else (body or "").encode()
            try:
                got = await http.request(r.get("method", "POST"), plan["url"], headers=headers, content=content)
            except Exception as e:  # the server closed the connection: reported
                answers.append({"status": None, "error": f"{type(e).__name__}: {e}"})
                continue
            sid = got.headers.get("mcp-session-id")
            if sid:
                session_id = sid
            text = got.text
            answers.append({
                "status": got.status_code,
                "session": sid,
                "retryAfter": got.headers.get("retry-after"),
                "body": text[-2000:],
            })
    return {"raw": answers}


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
                    # "tools": true asks for tool list changes only, which the door never sends.
                    listening = (
                        client.listen(tools_list_changed=True)
                        if hold.get("tools")
                        else client.listen(resource_subscriptions=[hold.get("uri", "hcp-sense://records")])
                    )
                    sub = await stack.enter_async_context(listening)
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
        if "raw" in plan:
            report = asyncio.run(raw(plan))
        else:
            report = asyncio.run(holds(plan) if "holds" in plan else session(plan))
    except BaseException as e:  # connection refused, 401: reported, not raised
        report = {"failed": "; ".join(f"{type(x).__name__}: {x}" for x in leaves(e))}
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
