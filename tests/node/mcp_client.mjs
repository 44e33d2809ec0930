// An MCP client session against hcp-sense's MCP door with the official TypeScript SDK, on the
// revision before 2026-07-28 (the initialize handshake, a session). Reads a plan as JSON on
// standard input ({"url", "token", "read": [uri...], "calls": [[tool, args]...]}) and prints
// one JSON report: the negotiated version, the tools, every listed resource (all pages), and
// each read and call's result or error. With "subscribe": {"uri", "deliver": [command...],
// "timeout": s, "after": [command...], "quietMs": ms} it subscribes (resources/subscribe), runs `deliver`,
// waits for a resources/updated notification, then unsubscribes, runs `after` and reports any
// notification heard within a second; with "resume": true it then subscribes again from the
// first notification's resume token (`_meta.resumeToken`) and reports what it is told.
import { execFileSync } from "node:child_process";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { ResourceUpdatedNotificationSchema } from "@modelcontextprotocol/sdk/types.js";

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

const chunks = [];
for await (const c of process.stdin) chunks.push(c);
const plan = JSON.parse(Buffer.concat(chunks).toString());

const report = {};
try {
  const headers = plan.token ? { Authorization: `Bearer ${plan.token}` } : {};
  const transport = new StreamableHTTPClientTransport(new URL(plan.url), { requestInit: { headers } });
  const client = new Client({ name: "hcp-sense-tests", version: "1.0.0" });
  await client.connect(transport);
  report.protocol = transport.protocolVersion ?? null;
  report.server = client.getServerVersion()?.name ?? null;
  report.tools = (await client.listTools()).tools.map((t) => ({ name: t.name, readOnly: t.annotations?.readOnlyHint === true }));
  const resources = [];
  let cursor;
  let pages = 0;
  do {
    const page = await client.listResources(cursor ? { cursor } : {});
    pages += 1;
    resources.push(...page.resources.map((r) => ({ uri: r.uri, mimeType: r.mimeType })));
    cursor = page.nextCursor;
  } while (cursor && pages < 100);
  report.resources = resources;
  report.pages = pages;
  report.reads = {};
  for (const uri of plan.read ?? []) {
    try {
      const got = await client.readResource({ uri });
      report.reads[uri] = { mimeType: got.contents[0].mimeType, json: JSON.parse(got.contents[0].text) };
    } catch (e) {
      report.reads[uri] = { error: { code: e.code ?? null, message: String(e.message ?? e) } };
    }
  }
  report.calls = [];
  for (const [name, args] of plan.calls ?? []) {
    try {
      const r = await client.callTool({ name, arguments: args });
      report.calls.push({ tool: name, isError: r.isError === true, structured: r.structuredContent ?? null });
    } catch (e) {
      report.calls.push({ tool: name, error: { code: e.code ?? null, message: String(e.message ?? e) } });
    }
  }
  if (plan.subscribe) {
    const sub = plan.subscribe;
    const heard = [];
    let wake = () => {};
    client.setNotificationHandler(ResourceUpdatedNotificationSchema, (n) => {
      heard.push({ uri: n.params.uri, meta: n.params._meta ?? null, at: Date.now() });
      wake();
    });
    const out = {};
    try {
      await client.subscribeResource({ uri: sub.uri });
      out.subscribed = true;
    } catch (e) {
      out.subscribed = false;
      out.error = { code: e.code ?? null, message: String(e.message ?? e) };
    }
    if (out.subscribed) {
      // The session's stream (GET) carries the notifications: give it a moment to open (and
      // "quietMs" more, the session idle meanwhile but for the server's pings).
      await sleep(300 + (sub.quietMs ?? 0));
      const started = Date.now();
      out.deliverOutput = execFileSync(sub.deliver[0], sub.deliver.slice(1)).toString();
      const delivered = Date.now();
      const deadline = started + (sub.timeout ?? 10) * 1000;
      while (heard.length === 0 && Date.now() < deadline) {
        await Promise.race([new Promise((r) => { wake = r; }), sleep(100)]);
      }
      out.heard = heard.map((h) => ({ ...h, msAfterDeliver: h.at - delivered }));
      await client.unsubscribeResource({ uri: sub.uri });
      const before = heard.length;
      if (sub.after) {
        out.afterOutput = execFileSync(sub.after[0], sub.after.slice(1)).toString();
        await sleep(1000);
      }
      out.heardAfterUnsubscribe = heard.slice(before);
      if (sub.resume && heard.length > 0) {
        const from = heard.length;
        await client.subscribeResource({ uri: sub.uri, _meta: { resumeToken: heard[0].meta?.resumeToken } });
        const until = Date.now() + 10000;
        while (heard.length === from && Date.now() < until) {
          await Promise.race([new Promise((r) => { wake = r; }), sleep(100)]);
        }
        out.heardOnResume = heard.slice(from);
        await client.unsubscribeResource({ uri: sub.uri });
      }
    }
    report.subscribe = out;
  }
  await client.close();
} catch (e) {
  report.failed = String(e?.message ?? e);
}
process.stdout.write(JSON.stringify(report));
