// An MCP client session against hcp-sense's MCP door with the official TypeScript SDK, on the
// revision before 2026-07-28 (the initialize handshake, a session). Reads a plan as JSON on
// standard input ({"url", "token", "read": [uri...], "calls": [[tool, args]...]}) and prints
// one JSON report: the negotiated version, the tools, every listed resource (all pages), and
// each read and call's result or error.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

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
  await client.close();
} catch (e) {
  report.failed = String(e?.message ?? e);
}
process.stdout.write(JSON.stringify(report));
