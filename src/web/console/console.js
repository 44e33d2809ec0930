// The hcp-sense operator console: each page calls the JSON routes with the signed-in token.
// Everything the server returns is third parties' data and is written as text (textContent),
// never as markup.
"use strict";

const TOKEN_KEY = "hcp-sense-token";
const PAGES = ["signin", "packs", "principal", "inbox", "drops", "explain", "quotas"];

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

function headers(json) {
  const h = {};
  const t = token();
  if (t) h["Authorization"] = "Bearer " + t;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

// A refusal as one line: the status's message and each field violation.
function refusal(status, body) {
  if (!body || typeof body !== "object") return "HTTP " + status;
  let text = (body.message || "HTTP " + status) + " (HTTP " + status + ")";
  for (const d of body.details || []) {
    for (const v of d.fieldViolations || []) text += "; " + v.field + ": " + v.description;
    if (d.retryDelay) text += "; retry after " + d.retryDelay;
  }
  return text;
}

async function api(method, path, body) {
  const init = { method, headers: headers(body !== undefined), cache: "no-store" };
  if (body !== undefined) init.body = JSON.stringify(body);
  const r = await fetch(path, init);
  let data = null;
  try { data = await r.json(); } catch (e) { data = null; }
  if (!r.ok) {
    const err = new Error(refusal(r.status, data));
    err.status = r.status;
    throw err;
  }
  return data || {};
}

function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== "") q.set(k, v);
  const s = q.toString();
  return s ? "?" + s : "";
}

function say(text, isError) {
  const m = document.getElementById("message");
  m.textContent = text || "";
  m.className = isError ? "error" : "ok";
}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const c of cells) {
    const td = document.createElement("td");
    if (c instanceof Node) td.appendChild(c); else td.textContent = c === undefined ? "" : String(c);
    tr.appendChild(td);
  }
  return tr;
}

function fill(tableId, rows, empty) {
  const body = document.querySelector("#" + tableId + " tbody");
  body.replaceChildren();
  for (const r of rows) body.appendChild(row(r));
  if (!rows.length) {
    const tr = row([empty || "None."]);
    tr.firstChild.colSpan = document.querySelectorAll("#" + tableId + " thead th").length;
    body.appendChild(tr);
  }
}

function short(name, prefix) {
  return name && name.startsWith(prefix) ? name.slice(prefix.length).toLowerCase() : (name || "");
}

function json(v) {
  return el("pre", JSON.stringify(v === undefined ? null : v, null, 2));
}

async function guarded(work) {
  say("");
  try {
    await work();
  } catch (e) {
    say(e.message, true);
  }
}

// --- Sign in ---

async function whoami() {
  const who = document.getElementById("who");
  if (!token()) {
    who.textContent = "Not signed in.";
    return;
  }
  try {
    const c = await api("GET", "/v1/caller");
    if (!c.authenticated) {
      who.textContent = "Authentication is off on this server: every call is allowed.";
      return;
    }
    let text = "Signed in as " + c.subject + " with role " + short(c.role, "CALLER_ROLE_");
    if (c.principal) text += ", reading as " + c.principal;
    if (c.expireTime) text += "; the credential expires at " + c.expireTime;
    who.textContent = text + ".";
  } catch (e) {
    who.textContent = "Not signed in: " + e.message;
  }
}

function signIn(ev) {
  ev.preventDefault();
  const t = document.getElementById("token").value.trim();
  sessionStorage.setItem(TOKEN_KEY, t);
  document.getElementById("token").value = "";
  guarded(whoami);
}

function signOut() {
  sessionStorage.removeItem(TOKEN_KEY);
  stopInbox();
  guarded(whoami);
}

// --- Packs ---

async function loadPacks() {
  const r = await api("GET", "/v1/packs" + query({ page_size: 100 }));
  fill("packs-table", (r.packs || []).map((p) => {
    const b = el("button", "Show catalog");
    b.type = "button";
    b.addEventListener("click", () => guarded(() => loadCatalog(p.packId)));
    return [p.packId, short(p.kind, "PACK_KIND_"), p.generation, p.updateTime, b];
  }), "No pack is registered.");
}

async function loadCatalog(pack) {
  const r = await api("GET", "/v1/triggerTypes" + query({ pack_id: pack, page_size: 100 }));
  const box = document.getElementById("catalog");
  box.replaceChildren(el("h3", "Catalog of " + pack));
  for (const t of r.triggerTypes || []) {
    const d = el("details");
    d.appendChild(el("summary", t.ref + " (land " + t.land + ")"));
    d.appendChild(el("p", t.description || ""));
    let schema = t.payloadSchema || "";
    try { schema = JSON.stringify(JSON.parse(schema), null, 2); } catch (e) { /* shown as sent */ }
    d.appendChild(el("pre", schema));
    box.appendChild(d);
  }
  if (!(r.triggerTypes || []).length) box.appendChild(el("p", "This pack declares no trigger type."));
}

// --- Principal ---

async function showPrincipal(ev) {
  if (ev) ev.preventDefault();
  const principal = document.getElementById("principal-id").value.trim();
  const pack = document.getElementById("principal-pack").value.trim();
  const box = document.getElementById("principal-view");
  box.replaceChildren();
  const grants = await api("GET", "/v1/grants" + query({ principal, pack_id: pack, page_size: 100 }));
  const acts = await api("GET", "/v1/activations" + query({ principal, pack_id: pack, page_size: 100 }));
  const binds = await api("GET", "/v1/bindings" + query({ principal, pack_id: pack, page_size: 100 }));
  const packs = new Set();
  for (const g of grants.grants || []) packs.add(g.packId);
  for (const a of acts.activations || []) packs.add(a.packId);
  for (const b of binds.bindings || []) packs.add(b.packId);
  if (pack) packs.add(pack);
  box.appendChild(el("h3", "Packs of " + principal));
  const table = el("table");
  table.id = "state-table";
  table.appendChild(el("caption", "Sense and Execute state, side by side"));
  const head = el("thead");
  const hr = el("tr");
  for (const h of ["Pack", "Granted", "Sense enabled", "Route", "Filter", "Binding", "Deliverable", "Installed", "Activated", "Connected"]) {
    const th = el("th", h);
    th.scope = "col";
    hr.appendChild(th);
  }
  head.appendChild(hr);
  table.appendChild(head);
  const body = el("tbody");
  table.appendChild(body);
  box.appendChild(table);
  for (const p of [...packs].sort()) {
    const s = await api("GET", "/v1/packs/" + encodeURIComponent(p) + "/states/" + encodeURIComponent(principal));
    const sense = s.sense || {};
    const ex = s.execute || {};
    const binding = sense.binding ? sense.binding.bindingId + " (" + short(sense.binding.state, "BINDING_STATE_") + ")" : "none";
    body.appendChild(row([p, yes(sense.granted), yes(sense.enabled), short(sense.route, "ROUTE_"), sense.filter || "", binding,
      yes(sense.deliverable), yes(ex.installed), yes(ex.activated), yes(ex.connected)]));
  }
  if (!packs.size) body.appendChild(row(["No grant, activation or Binding."]));
  // Could receive now, per ref.
  box.appendChild(el("h3", "Could receive now"));
  const recv = el("table");
  recv.id = "receive-table";
  recv.appendChild(el("caption", "Per trigger ref: would a trigger reach " + principal + " now"));
  const rh = el("thead");
  const rhr = el("tr");
  for (const h of ["Pack", "Ref", "Land", "Receivable", "Why not"]) {
    const th = el("th", h);
    th.scope = "col";
    rhr.appendChild(th);
  }
  rh.appendChild(rhr);
  recv.appendChild(rh);
  const rb = el("tbody");
  recv.appendChild(rb);
  box.appendChild(recv);
  for (const p of [...packs].sort()) {
    const t = await api("GET", "/v1/triggerTypes" + query({ pack_id: p, principal, page_size: 100 }));
    for (const tt of t.triggerTypes || []) {
      const r = tt.receivability || {};
      rb.appendChild(row([p, tt.ref, tt.land, yes(r.receivable), (r.dropReasons || []).map((x) => short(x, "DROP_REASON_")).join(", ")]));
    }
  }
}

function yes(b) {
  return b ? "yes" : "no";
}

async function grantForm(ev) {
  ev.preventDefault();
  const op = ev.submitter ? ev.submitter.value : "grant";
  const principal = document.getElementById("grant-principal").value.trim();
  const pack = document.getElementById("grant-pack").value.trim();
  if (op === "grant") {
    await api("POST", "/v1/packs/" + encodeURIComponent(pack) + "/grants", { principal });
    say("Granted sense.enable on " + pack + " to " + principal + ".");
  } else {
    await api("DELETE", "/v1/packs/" + encodeURIComponent(pack) + "/grants/" + encodeURIComponent(principal));
    say("Revoked sense.enable on " + pack + " from " + principal + ".");
  }
}

async function activateForm(ev) {
  ev.preventDefault();
  const op = ev.submitter ? ev.submitter.value : "activate";
  const principal = document.getElementById("act-principal").value.trim();
  const pack = document.getElementById("act-pack").value.trim();
  if (op === "activate") {
    const body = { principal, route: document.getElementById("act-route").value };
    const filter = document.getElementById("act-filter").value.trim();
    if (filter) body.filter = filter;
    await api("POST", "/v1/packs/" + encodeURIComponent(pack) + "/activations", body);
    say("Activated " + pack + " for " + principal + ".");
  } else {
    await api("DELETE", "/v1/packs/" + encodeURIComponent(pack) + "/activations/" + encodeURIComponent(principal));
    say("Deactivated " + pack + " for " + principal + ".");
  }
}

// --- Inbox (Server-Sent Events read with fetch, so the token travels in a header) ---

let inbox = null;

function stopInbox() {
  if (inbox) inbox.abort();
  inbox = null;
  document.getElementById("inbox-state").textContent = "Not watching.";
}

const shown = new Set();

// Newest first; a record listed and then told by the watch is shown once.
function addRecord(r, atEnd) {
  if (shown.has(r.recordId)) return;
  shown.add(r.recordId);
  const body = document.querySelector("#inbox-table tbody");
  const tr = row([r.receiveTime, r.principal, r.packId, r.ref, r.land, short(r.route, "ROUTE_"), json(r.payload)]);
  tr.className = "record";
  if (atEnd) body.appendChild(tr); else body.insertBefore(tr, body.firstChild);
}

// The latest records matching the filters, below the live ones.
async function recentRecords(params) {
  const r = await api("GET", "/v1/records" + query({
    principal: params.principal, pack_id: params.pack_id, land: params.land,
    order_by: "receive_time desc", page_size: 20,
  }));
  for (const rec of r.records || []) addRecord(rec, true);
}

async function watchInbox(ev) {
  if (ev) ev.preventDefault();
  stopInbox();
  document.querySelector("#inbox-table tbody").replaceChildren();
  shown.clear();
  const params = {
    principal: document.getElementById("inbox-principal").value.trim(),
    pack_id: document.getElementById("inbox-pack").value.trim(),
    land: document.getElementById("inbox-land").value.trim(),
    from_now: "true",
  };
  const controller = new AbortController();
  inbox = controller;
  let last = "";
  const state = document.getElementById("inbox-state");
  while (inbox === controller) {
    const h = headers(false);
    h["Accept"] = "text/event-stream";
    if (last) {
      h["Last-Event-ID"] = last;
      delete params.from_now;
    }
    let r;
    try {
      r = await fetch("/v1/records:watch" + query(params), { headers: h, signal: controller.signal, cache: "no-store" });
    } catch (e) {
      if (controller.signal.aborted) return;
      state.textContent = "Disconnected; reconnecting.";
      await new Promise((ok) => setTimeout(ok, 2000));
      continue;
    }
    if (!r.ok) {
      let data = null;
      try { data = await r.json(); } catch (e) { data = null; }
      state.textContent = "Not watching.";
      say(refusal(r.status, data), true);
      if (inbox === controller) inbox = null;
      return;
    }
    state.textContent = "Watching: records appear as they commit.";
    if (!last) guarded(() => recentRecords(params));
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    let ended = null;
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          let id = null, data = "", kind = "message";
          for (const line of block.split("\n")) {
            if (line.startsWith("id: ")) id = line.slice(4);
            else if (line.startsWith("data: ")) data += line.slice(6);
            else if (line.startsWith("event: ")) kind = line.slice(7);
          }
          if (!data) continue;
          const msg = JSON.parse(data);
          if (kind === "error") { ended = msg; continue; }
          if (id) last = id;
          for (const rec of msg.records || []) addRecord(rec);
        }
      }
    } catch (e) {
      if (controller.signal.aborted) return;
    }
    if (ended && ended.code !== 14) {
      state.textContent = "Not watching.";
      say("The watch ended: " + refusal(ended.code, ended), true);
      if (inbox === controller) inbox = null;
      return;
    }
    state.textContent = "Disconnected; resuming after the last record.";
    await new Promise((ok) => setTimeout(ok, 1000));
  }
}

// --- Drops and decisions ---

async function loadDrops(ev) {
  if (ev) ev.preventDefault();
  const pack = document.getElementById("drops-pack").value.trim();
  const r = await api("GET", "/v1/dropReports" + query({ pack_id: pack, page_size: 200 }));
  fill("drops-table", (r.dropReports || []).map((d) =>
    [d.packId, d.ref, short(d.reason, "DROP_REASON_"), d.count, d.firstSeenTime, d.lastSeenTime]), "No drop recorded.");
  await dropsOverTime(pack);
}

// Drops per hour and reason over the last day, from the decision log (at most 2,000).
async function dropsOverTime(pack) {
  const since = new Date(Date.now() - 24 * 3600 * 1000);
  const counts = new Map();
  const reasons = new Set();
  let token = "";
  let seen = 0;
  do {
    const r = await api("GET", "/v1/decisions" + query({
      pack_id: pack, outcome: "DECISION_OUTCOME_DROPPED", start_time: since.toISOString(),
      page_size: 500, page_token: token,
    }));
    for (const d of r.decisions || []) {
      const hour = (d.decideTime || "").slice(0, 13) + ":00Z";
      const reason = short(d.dropReason, "DROP_REASON_");
      reasons.add(reason);
      const key = hour + "|" + reason;
      counts.set(key, (counts.get(key) || 0) + 1);
      seen += 1;
    }
    token = r.nextPageToken || "";
  } while (token && seen < 2000);
  const hours = [...new Set([...counts.keys()].map((k) => k.split("|")[0]))].sort().reverse();
  const cols = [...reasons].sort();
  const table = document.getElementById("drops-time-table");
  const head = table.querySelector("thead tr");
  head.replaceChildren();
  for (const h of ["Hour (UTC)", ...cols]) {
    const th = el("th", h);
    th.scope = "col";
    head.appendChild(th);
  }
  fill("drops-time-table", hours.map((h) => [h, ...cols.map((c) => counts.get(h + "|" + c) || 0)]),
    "No drop decided in the last 24 hours (or the decision log is off).");
}

async function findDecisions(ev) {
  if (ev) ev.preventDefault();
  const pack = document.getElementById("dec-pack").value.trim();
  const trigger = document.getElementById("dec-trigger").value.trim();
  let decisions;
  if (pack && trigger) {
    const r = await api("GET", "/v1/packs/" + encodeURIComponent(pack) + "/decisions/" + encodeURIComponent(trigger));
    decisions = r.decision ? [r.decision] : [];
  } else {
    const r = await api("GET", "/v1/decisions" + query({
      pack_id: pack,
      principal: document.getElementById("dec-principal").value.trim(),
      trigger_id: trigger,
      outcome: document.getElementById("dec-outcome").value,
      page_size: 100,
    }));
    decisions = r.decisions || [];
  }
  fill("decisions-table", decisions.map((d) => [d.decideTime, d.packId, d.ref, d.principal, d.triggerId,
    short(d.outcome, "DECISION_OUTCOME_"), short(d.dropReason, "DROP_REASON_"), d.check, d.detail]), "No decision found.");
}

// --- Explain ---

async function explain(ev) {
  ev.preventDefault();
  let payload;
  try {
    payload = JSON.parse(document.getElementById("ex-payload").value || "{}");
  } catch (e) {
    throw new Error("Payload: not JSON: " + e.message);
  }
  const trigger = {
    packId: document.getElementById("ex-pack").value.trim(),
    ref: document.getElementById("ex-ref").value.trim(),
    principal: document.getElementById("ex-principal").value.trim(),
    land: document.getElementById("ex-land").value.trim(),
    payload,
  };
  const r = await api("POST", "/v1/triggers:explain", { trigger });
  const box = document.getElementById("explain-result");
  box.replaceChildren(el("h3", "Would be: " + short(r.disposition, "DISPOSITION_") +
    (r.dropReason ? " (" + short(r.dropReason, "DROP_REASON_") + ")" : "")));
  const t = el("table");
  t.id = "explain-table";
  t.appendChild(el("caption", "Checks, in the spec's order"));
  const b = el("tbody");
  for (const c of r.checks || []) b.appendChild(row([c.name, short(c.verdict, "CHECK_VERDICT_"), short(c.dropReason, "DROP_REASON_"), c.detail || ""]));
  t.appendChild(b);
  box.appendChild(t);
  if (r.quota) {
    box.appendChild(el("p", "Quota admits now: " + yes(r.quota.admits) + (r.quota.retryDelay ? "; retry after " + r.quota.retryDelay : "")));
  }
}

// --- Quotas ---

async function loadQuotas() {
  const r = await api("GET", "/v1/quotas" + query({ page_size: 200 }));
  fill("quotas-table", (r.quotas || []).map((q) => {
    const cell = el("span", "");
    const b = el("button", "Check admission");
    b.type = "button";
    b.addEventListener("click", () => guarded(() => admission(q, cell)));
    const box = el("span");
    box.append(b, " ", cell);
    return [q.packId, q.principal === undefined ? "(the pack's)" : q.principal, q.ratePerSecond, q.burst, q.updateTime, box];
  }), "No quota is set.");
}

// Whether the quota admits a trigger now: ExplainTrigger (nothing is recorded, nothing is
// spent) of the first of the pack's trigger types that an empty payload satisfies, as the
// quota is checked after the payload's schema.
async function admission(q, cell) {
  const types = await api("GET", "/v1/triggerTypes" + query({ pack_id: q.packId, page_size: 20 }));
  for (const t of types.triggerTypes || []) {
    let r;
    try {
      r = await api("POST", "/v1/triggers:explain", { trigger: {
        packId: q.packId, ref: t.ref, principal: q.principal || "quota-check", land: t.land, payload: {},
      } });
    } catch (e) {
      if (e.status === 400) continue;
      throw e;
    }
    const quota = r.quota || {};
    cell.textContent = quota.admits ? "admits now" : "refuses now" + (quota.retryDelay ? ", retry after " + quota.retryDelay : "");
    return;
  }
  cell.textContent = "not checked: every trigger type of the pack needs a payload";
}

async function quotaForm(ev) {
  ev.preventDefault();
  const op = ev.submitter ? ev.submitter.value : "put";
  const pack = document.getElementById("q-pack").value.trim();
  const principal = document.getElementById("q-principal").value.trim();
  if (op === "put") {
    const body = {
      ratePerSecond: Number(document.getElementById("q-rate").value),
      burst: Number(document.getElementById("q-burst").value),
    };
    if (principal) body.principal = principal;
    await api("PUT", "/v1/packs/" + encodeURIComponent(pack) + "/quota", body);
    say("Quota set on " + pack + (principal ? " for " + principal : "") + ".");
  } else {
    await api("DELETE", "/v1/packs/" + encodeURIComponent(pack) + "/quota" + query({ principal }));
    say("Quota deleted on " + pack + (principal ? " for " + principal : "") + ".");
  }
  await loadQuotas();
}

// --- Pages ---

function show() {
  const page = (location.hash || "#signin").slice(1);
  const current = PAGES.includes(page) ? page : "signin";
  for (const p of PAGES) document.getElementById(p).hidden = p !== current;
  for (const a of document.querySelectorAll("nav a")) {
    if (a.getAttribute("href") === "#" + current) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  const h = document.querySelector("#" + current + " h2");
  if (h) { h.tabIndex = -1; h.focus(); }
}

function on(id, event, work) {
  document.getElementById(id).addEventListener(event, (ev) => {
    if (event === "submit") ev.preventDefault();
    guarded(() => work(ev));
  });
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("signin-form").addEventListener("submit", signIn);
  // Enabled only now: a form submitted before this script runs would post the token nowhere
  // useful, and never in a URL.
  document.getElementById("signin-submit").disabled = false;
  document.getElementById("signout").addEventListener("click", signOut);
  on("packs-load", "click", loadPacks);
  on("principal-form", "submit", showPrincipal);
  on("grant-form", "submit", grantForm);
  on("activate-form", "submit", activateForm);
  document.getElementById("inbox-form").addEventListener("submit", (ev) => { ev.preventDefault(); watchInbox(); });
  document.getElementById("inbox-stop").addEventListener("click", stopInbox);
  on("drops-form", "submit", loadDrops);
  on("decisions-form", "submit", findDecisions);
  on("explain-form", "submit", explain);
  on("quotas-load", "click", loadQuotas);
  on("quota-form", "submit", quotaForm);
  window.addEventListener("hashchange", show);
  show();
  guarded(whoami);
});
