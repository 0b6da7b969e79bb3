// DACP dashboard: talks only to the controller that served it, with the admin key the
// operator typed (kept in sessionStorage, never in the page). Plain ES2020, no build step.
// The cluster tab is here; the other tabs are modules of their own (dashboard_*.js).

import { createAddNode } from "./dashboard_add_node.js";
import { createCharts } from "./dashboard_charts.js";
import { createKeys } from "./dashboard_keys.js";
import { createModels } from "./dashboard_models.js";
import { createPlayground } from "./dashboard_playground.js";
import { createUsage } from "./dashboard_usage.js";

const KEY_STORAGE = "dacp.adminKey";
const TERMINAL = new Set(["COMPLETED", "FAILED", "CANCELLED"]);
const ACTIVE_STATES = ["SUBMITTED", "QUEUED", "PLANNED", "DISPATCHED", "SETUP_VALIDATED", "RUNNING"];
const RECENT_LIMIT = 25;
const LIVE_LIMIT = 100;
const NODE_POLL_MS = 5000; // heartbeat ages are live state, not events: poll them
const JOB_POLL_MS = 15000; // a safety net; events keep the job tables current
const FEED_RETRY_MS = 3000;
// A feed opened with a ticket ends when the ticket's session ends (the server says in how
// long: `ready.ends_in`). The dashboard opens the next one this long before, with a new
// ticket, and lets the old one go once the new one is ready: no event is lost between them.
const FEED_RENEW_LEAD_MS = 30000;
// How long the old feed stays open after the new one is ready (events in flight on it land).
const FEED_OVERLAP_MS = 1000;
const FEED_SEEN_LIMIT = 2000;

const $ = (id) => document.getElementById(id);

const state = {
  key: null,
  nodes: new Map(), // node_id -> node view
  jobs: new Map(), // job_id -> job view
  selected: null, // {kind: "node"|"job", id}
  source: null, // the live feed's EventSource
  renewing: null, // the next one, while it opens
  renewTimer: null,
  seen: new Set(), // event positions shown: what both feeds carry while renewing, once
  timers: [],
  pending: new Map(), // debounce key -> timeout id
  liveCount: 0,
};

// ------------------------------------------------------------------ helpers

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const short = (id) => (id ? String(id).slice(0, 8) : "");
const gib = (bytes) => `${(Number(bytes) / 2 ** 30).toFixed(1)} GiB`;
const UUID_RE = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

// A byte count as people read it: 512 B, 1.5 KiB, 100.0 MiB, 4.2 GiB.
function size(bytes) {
  const n = Number(bytes) || 0;
  for (const [unit, scale] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]]) {
    if (n >= scale) return `${(n / scale).toFixed(1)} ${unit}`;
  }
  return `${n} B`;
}

function clock(iso) {
  if (!iso) return "";
  const when = new Date(iso);
  return Number.isNaN(when.getTime()) ? String(iso) : when.toLocaleTimeString();
}

function badge(value) {
  return el("span", { class: `badge state state-${value || "UNKNOWN"}`, text: value || "?" });
}

function debounce(key, ms, fn) {
  if (state.pending.has(key)) return;
  state.pending.set(
    key,
    setTimeout(() => {
      state.pending.delete(key);
      fn();
    }, ms),
  );
}

let toastTimer = null;
function toast(message, bad = false) {
  const box = $("toast");
  box.textContent = message;
  box.className = bad ? "toast bad" : "toast";
  box.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => (box.hidden = true), 5000);
}

class AuthError extends Error {}

async function api(path, options = {}) {
  const response = await fetch(path, {
    ...options,
    headers: {
      Authorization: `Bearer ${state.key}`,
      Accept: "application/json",
      ...(options.body ? { "Content-Type": "application/json" } : {}),
    },
    cache: "no-store",
  });
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  if (response.status === 401 || response.status === 403) {
    throw new AuthError(body?.error?.message || `HTTP ${response.status}`);
  }
  if (!response.ok) {
    const error = body?.error || {};
    const message = error.message || `HTTP ${response.status}`;
    throw new Error(error.param && !message.includes(error.param) ? `${error.param}: ${message}` : message);
  }
  return body;
}

function failed(error) {
  if (error instanceof AuthError) {
    signOut(`The admin key was refused: ${error.message}`);
  } else {
    toast(error.message || String(error), true);
  }
}

// -------------------------------------------------------------------- nodes

function resources(node) {
  const res = node.resources || {};
  const main = [];
  if (res.cpu_threads) main.push(`${res.cpu_threads} threads`);
  if (res.ram_total_bytes) {
    const free = node.telemetry?.ram_free_bytes ?? res.ram_free_bytes;
    const total = gib(res.ram_total_bytes);
    main.push(free != null ? `RAM ${gib(free)} free / ${total}` : `RAM ${total}`);
  }
  const listed = node.devices || [];
  const gpus = listed.length ? listed.filter((d) => d.kind === "gpu") : res.gpus || [];
  main.push(gpus.length ? `${gpus.length} GPU${gpus.length > 1 ? "s" : ""}` : "no GPU");
  const extra = [];
  if (res.memory_limit_bytes) extra.push(`offers ${gib(res.memory_limit_bytes)}`);
  if (node.telemetry?.cpu_percent != null) extra.push(`CPU ${node.telemetry.cpu_percent}%`);
  return el(
    "td",
    { class: "resources" },
    main.join(" · "),
    extra.length ? el("span", { class: "sub", text: extra.join(" · ") }) : null,
    devices(node),
    links(node),
    llamaBuild(node),
    heldModels(node),
    fetching(node),
  );
}

// The devices its llama.cpp build computes on, the host CPU last, with free memory now.
function devices(node) {
  const listed = node.devices || [];
  if (!listed.length) return null;
  return el(
    "span",
    { class: "sub devices" },
    ...listed.map((d) =>
      el(
        "span",
        {
          class: `device ${d.kind === "gpu" ? "gpu" : "cpu"}`,
          dataset: { device: d.name },
          title: d.uuid ? `${d.name}: ${d.uuid}` : d.name,
        },
        el("span", { class: "device-name", text: d.name }),
        ` ${d.description || ""} · ${gib(d.memory_free_bytes)} free / ${gib(d.memory_total_bytes)}`,
      ),
    ),
  );
}

// Its links to its peers as it last measured them (NODE_LINKS_MEASURED): the bandwidth and
// round trip to each, the fastest first; a link it could not measure says why.
function links(node) {
  const measured = Object.entries(node.links || {});
  if (!measured.length) return null;
  measured.sort(([, a], [, b]) => (b.mbps || 0) - (a.mbps || 0));
  return el(
    "span",
    { class: "sub links" },
    "links: ",
    ...measured.map(([peer, link], i) =>
      el(
        "span",
        {
          class: `link${link.error ? " failed" : ""}`,
          dataset: { peer },
          title: `measured ${link.measured_at || ""}${link.error ? `: ${link.error}` : ""}`,
        },
        `${i ? " · " : ""}${sourceName(peer)} `,
        link.error
          ? "unmeasured"
          : `${Math.round(link.mbps).toLocaleString()} Mbit/s, ${Number(link.rtt_ms).toFixed(1)} ms`,
      ),
    ),
  );
}

// Which llama.cpp build the node runs: its version, backend and RPC protocol.
function llamaBuild(node) {
  const llama = node.llama || {};
  if (!llama.version && !llama.backend && !llama.rpc_protocol) return null;
  const parts = [`llama.cpp ${llama.version || "(version unknown)"}`];
  if (llama.backend) parts.push(llama.backend);
  if (llama.rpc_protocol) parts.push(`RPC ${llama.rpc_protocol}`);
  return el("span", { class: "sub llama", text: parts.join(" · ") });
}

// The model files a node holds (its last resource report), by file name.
function heldModels(node) {
  const models = (node.local_models || [])
    .slice()
    .sort((a, b) => String(a.file_name).localeCompare(String(b.file_name)));
  if (!models.length) return el("span", { class: "sub models muted", text: "holds no model file" });
  return el(
    "span",
    {
      class: "sub models",
      title: models.map((m) => `${m.file_name}: sha256 ${m.sha256}`).join("\n"),
    },
    "holds ",
    ...models.flatMap((m, i) => [
      i ? ", " : null,
      el("span", { class: "model-file", dataset: { sha256: m.sha256 || "" }, text: m.file_name }),
      ` (${size(m.size_bytes)})`,
    ]),
  );
}

// What the node is fetching now, in short (the transfers panel has the details).
function fetching(node) {
  const transfers = Object.values(node.transfers || {});
  if (!transfers.length) return null;
  const parts = transfers.map((t) => {
    const pct = percentOf(t);
    return pct === null ? `${t.file_name} (${size(t.bytes_done)})` : `${t.file_name} ${pct}%`;
  });
  return el("span", { class: "sub fetching", text: `fetching ${parts.join(", ")}` });
}

function heartbeat(node) {
  const age = node.heartbeat_age_seconds;
  if (age === null || age === undefined) return el("td", { class: "heartbeat muted", text: "never" });
  const text = age < 60 ? `${age.toFixed(1)} s ago` : `${Math.round(age / 60)} min ago`;
  return el("td", { class: age > 10 ? "heartbeat late" : "heartbeat", text });
}

function nodeRow(node) {
  const id = node.node_id;
  const draining = Boolean(node.drain_requested);
  const row = el(
    "tr",
    {
      dataset: { nodeId: id },
      class: state.selected?.id === id ? "selected" : "",
      onclick: () => openTimeline("node", id),
    },
    el(
      "td",
      {},
      el("span", { class: "name", text: node.name || short(id) }),
      el("span", { class: "sub mono", text: `${short(id)} · ${node.address || ""}` }),
    ),
    el(
      "td",
      { class: "state-cell" },
      badge(node.state),
      node.error ? el("span", { class: "sub error", text: node.error }) : null,
    ),
    resources(node),
    el("td", { class: "jobs", text: `${(node.current_jobs || []).length} / ${node.slots ?? "?"}` }),
    heartbeat(node),
    el("td", {
      class: node.connected ? "connected yes" : "connected no",
      text: node.connected ? "yes" : "no",
    }),
    el(
      "td",
      {},
      el(
        "div",
        { class: "actions" },
        el("button", {
          type: "button",
          class: "danger small drain",
          text: "Drain",
          disabled: draining,
          title: "Stop assigning work to this node",
          onclick: (e) => steer(e, id, "drain"),
        }),
        el("button", {
          type: "button",
          class: "secondary small resume",
          text: "Resume",
          disabled: !draining,
          title: "Accept work again",
          onclick: (e) => steer(e, id, "resume"),
        }),
      ),
    ),
  );
  return row;
}

function renderNodes() {
  const body = $("nodes-table").tBodies[0];
  const rows = [...state.nodes.values()].sort(
    (a, b) => (a.name || "").localeCompare(b.name || "") || a.node_id.localeCompare(b.node_id),
  );
  body.replaceChildren(...rows.map(nodeRow));
  $("nodes-empty").hidden = rows.length > 0;
  renderNodesSummary();
  renderTransfers();
}

function renderNode(node) {
  const body = $("nodes-table").tBodies[0];
  const old = body.querySelector(`tr[data-node-id="${CSS.escape(node.node_id)}"]`);
  if (!old) return renderNodes();
  const fresh = nodeRow(node);
  if (old.querySelector(".badge")?.textContent !== node.state) fresh.classList.add("flash");
  old.replaceWith(fresh);
  renderNodesSummary();
  renderTransfers();
}

function renderNodesSummary() {
  const counts = {};
  for (const node of state.nodes.values()) counts[node.state] = (counts[node.state] || 0) + 1;
  $("nodes-summary").textContent = Object.entries(counts)
    .map(([s, n]) => `${n} ${s.toLowerCase()}`)
    .join(" · ");
}

async function refreshNodes() {
  try {
    const body = await api("/api/admin/nodes");
    state.nodes = new Map(body.data.map((n) => [n.node_id, n]));
    renderNodes();
  } catch (error) {
    failed(error);
  }
}

async function refreshNode(id) {
  try {
    const node = await api(`/api/admin/nodes/${encodeURIComponent(id)}`);
    const known = state.nodes.has(id);
    state.nodes.set(id, node);
    known ? renderNode(node) : renderNodes();
  } catch (error) {
    failed(error);
  }
}

async function steer(event, id, command) {
  event.stopPropagation();
  const button = event.currentTarget;
  button.disabled = true;
  try {
    const node = await api(`/api/admin/nodes/${encodeURIComponent(id)}/${command}`, { method: "POST" });
    state.nodes.set(id, node);
    renderNode(node);
    toast(`${node.name || short(id)}: ${command === "drain" ? "drain requested" : "resumed"}`);
  } catch (error) {
    button.disabled = false;
    failed(error);
  }
}

// ---------------------------------------------------------------- transfers
// Model files nodes fetch from each other (or from URLs): each node row's `transfers`, by
// transfer id, holds those under way (MODEL_TRANSFER_STARTED, then _PROGRESS at each quarter;
// _COMPLETED and _FAILED take them out). Its `transfer_failures` keeps the last failed ones
// (at most 3, newest first) until the node fetches that model (sha256) after all.

// Percent fetched, or null when the size is not known (0).
function percentOf(transfer) {
  const total = Number(transfer.size_bytes) || 0;
  if (total <= 0) return null;
  return Math.min(100, Math.floor(((Number(transfer.bytes_done) || 0) * 100) / total));
}

// A source: a node's name, a URL without its query (which may hold a token), or its name.
function sourceName(source) {
  const text = String(source || "");
  if (text.includes("://")) return text.split("#")[0].split("?")[0];
  return state.nodes.get(text)?.name || (UUID_RE.test(text) ? short(text) : text);
}


// The file a transfer is about: its name, and the start of its sha256 (all of it on hover).
function fileCell(item) {
  return el(
    "td",
    { class: "file" },
    el("span", { class: "file-name", text: item.file_name || "?" }),
    el("span", {
      class: "sub mono",
      text: `sha256 ${String(item.sha256 || "").slice(0, 12)}…`,
      title: item.sha256,
    }),
  );
}

// How far a transfer got: a bar, its percentage and bytes. A failed one is marked, its bar
// frozen where it stopped, with the error; one under way of unknown size has no bar value
// (an indeterminate bar).
function progressCell(item, label, failed) {
  const pct = percentOf(item);
  const done = size(item.bytes_done);
  const amount =
    pct === null
      ? `${done} ${failed ? "fetched" : "so far"} (size unknown)`
      : `${done} of ${size(item.size_bytes)}`;
  const bar = el("progress", { class: "bar", max: 100, "aria-label": label });
  if (pct !== null || failed) bar.value = pct ?? 0;
  return el(
    "td",
    { class: "progress-cell" },
    el(
      "div",
      { class: "bar-line" },
      failed ? badge("FAILED") : null,
      bar,
      el("span", { class: "percent", text: pct === null ? "" : `${pct}%` }),
    ),
    el("span", { class: "sub bytes", text: amount }),
    failed ? el("span", { class: "sub error", text: item.error || "failed" }) : null,
  );
}

function transferRow(node, id, transfer) {
  const nodeName = node.name || short(node.node_id);
  const sources = (transfer.sources || []).map(sourceName);
  return el(
    "tr",
    {
      dataset: { transferId: id, nodeId: node.node_id },
      onclick: () => openTimeline("node", node.node_id),
    },
    el(
      "td",
      {},
      el("span", { class: "name", text: nodeName }),
      node.connected
        ? el("span", { class: "sub mono", text: `transfer ${short(id)}`, title: id })
        : el("span", { class: "sub late", text: "node not connected: stalled" }),
    ),
    fileCell(transfer),
    progressCell(transfer, `${transfer.file_name} onto ${nodeName}`, false),
    sourceCell(sources),
    el("td", { class: "when", text: `started ${clock(transfer.started_at)}` }),
  );
}

function sourceCell(sources) {
  return el(
    "td",
    { class: "source", title: sources.join(", then ") },
    el("span", { class: "source-name", text: sources[0] || "?" }),
    sources.length > 1
      ? el("span", { class: "sub", text: `then ${sources.slice(1).join(", ")}` })
      : null,
  );
}

// A transfer that failed: how far it got, why, and when (it stays until the node has the file).
function failedTransferRow(node, failure) {
  const nodeName = node.name || short(node.node_id);
  const sources = (failure.sources || []).map(sourceName);
  const label = `${failure.file_name || "model file"} onto ${nodeName} (failed)`;
  return el(
    "tr",
    {
      class: "failed",
      dataset: { transferId: failure.transfer_id, nodeId: node.node_id, outcome: "failed" },
      onclick: () => openTimeline("node", node.node_id),
    },
    el(
      "td",
      {},
      el("span", { class: "name", text: nodeName }),
      el("span", {
        class: "sub mono",
        text: `transfer ${short(failure.transfer_id)}`,
        title: failure.transfer_id,
      }),
    ),
    fileCell(failure),
    progressCell(failure, label, true),
    sourceCell(sources),
    el("td", {
      class: "when failed-at",
      title: failure.started_at ? `started ${clock(failure.started_at)}` : null,
      text: `failed ${clock(failure.failed_at)}`,
    }),
  );
}

function renderTransfers() {
  const rows = [];
  const failures = [];
  for (const node of state.nodes.values()) {
    for (const [id, transfer] of Object.entries(node.transfers || {})) {
      rows.push({ node, id, transfer });
    }
    for (const failure of node.transfer_failures || []) failures.push({ node, failure });
  }
  rows.sort(
    (a, b) =>
      String(a.transfer.started_at).localeCompare(String(b.transfer.started_at)) ||
      a.id.localeCompare(b.id),
  );
  failures.sort(
    (a, b) =>
      String(b.failure.failed_at).localeCompare(String(a.failure.failed_at)) ||
      String(a.failure.transfer_id).localeCompare(String(b.failure.transfer_id)),
  );
  $("transfers-table").tBodies[0].replaceChildren(
    ...rows.map((r) => transferRow(r.node, r.id, r.transfer)),
    ...failures.map((f) => failedTransferRow(f.node, f.failure)),
  );
  $("transfers-empty").hidden = rows.length + failures.length > 0;
  const counts = [];
  if (rows.length) counts.push(`${rows.length} under way`);
  if (failures.length) counts.push(`${failures.length} failed`);
  $("transfers-count").textContent = counts.join(" · ");
}

// --------------------------------------------------------------------- jobs

function nodeNames(ids) {
  return (ids || []).map((id) => state.nodes.get(id)?.name || short(id)).join(", ");
}

function timing(job) {
  const t = job.timings || {};
  const parts = [];
  if (t.time_to_first_token_ms != null) {
    parts.push(`TTFT ${Math.round(t.time_to_first_token_ms)} ms`);
  } else if (t.first_token_after_submit_ms != null) {
    parts.push(`first token ${Math.round(t.first_token_after_submit_ms)} ms`);
  }
  if (t.total_ms != null) parts.push(`total ${Math.round(t.total_ms)} ms`);
  if (t.tokens_per_second) parts.push(`${Number(t.tokens_per_second).toFixed(1)} tok/s`);
  return parts.join(" · ");
}

// How the job's server was chosen and what llama-server's cache saved it, e.g.
// "hit · 6.1k chars · 1,536 cached" (empty for jobs without a route or a count).
function cacheUse(job) {
  const parts = [];
  const route = job.route;
  if (route?.prefix) {
    parts.push(route.prefix);
    const chars = Number(route.matched_chars) || 0;
    if (chars > 0) {
      parts.push(chars < 1000 ? `${chars} chars` : `${(chars / 1000).toFixed(1)}k chars`);
    }
  }
  if (job.cached_prompt_tokens != null) {
    parts.push(`${Number(job.cached_prompt_tokens).toLocaleString("en-US")} cached`);
  }
  return parts.join(" · ");
}

function jobRow(job) {
  const id = job.job_id;
  const tokens = job.completion_tokens ?? job.tokens_streamed ?? 0;
  return el(
    "tr",
    {
      dataset: { jobId: id },
      class: state.selected?.id === id ? "selected" : "",
      onclick: () => openTimeline("job", id),
    },
    el("td", { class: "mono", text: short(id), title: id }),
    el("td", { text: job.model }),
    el(
      "td",
      { class: "state-cell" },
      badge(job.state),
      job.failure
        ? el("span", { class: "sub error", text: `${job.failure.phase}: ${job.failure.reason}` })
        : null,
    ),
    el("td", {
      text:
        job.state === "QUEUED" ? `queued at #${job.queue_position ?? "?"}` : nodeNames(job.nodes),
    }),
    el("td", { text: clock(job.submitted_at) }),
    el("td", { text: String(tokens) }),
    el("td", { class: "cache muted", text: cacheUse(job) }),
    el("td", { class: "muted", text: timing(job) }),
  );
}

function renderJobs() {
  const all = [...state.jobs.values()].sort((a, b) =>
    String(b.submitted_at).localeCompare(String(a.submitted_at)),
  );
  const active = all.filter((j) => !TERMINAL.has(j.state));
  const recent = all.filter((j) => TERMINAL.has(j.state)).slice(0, RECENT_LIMIT);
  $("active-jobs").tBodies[0].replaceChildren(...active.map(jobRow));
  $("recent-jobs").tBodies[0].replaceChildren(...recent.map(jobRow));
  $("active-empty").hidden = active.length > 0;
  $("recent-empty").hidden = recent.length > 0;
  $("active-count").textContent = active.length ? `${active.length} running` : "";
  // Keep the map bounded: what no table shows is dropped (it comes back on refresh).
  const keep = new Set([...active, ...recent].map((j) => j.job_id));
  for (const id of state.jobs.keys()) if (!keep.has(id)) state.jobs.delete(id);
}

async function refreshJobs() {
  try {
    const queries = [
      `/api/admin/jobs?limit=${RECENT_LIMIT * 2}`,
      ...ACTIVE_STATES.map((s) => `/api/admin/jobs?state=${s}&limit=100`),
    ];
    const results = await Promise.all(queries.map((q) => api(q)));
    state.jobs = new Map();
    for (const result of results) for (const job of result.data) state.jobs.set(job.job_id, job);
    renderJobs();
  } catch (error) {
    failed(error);
  }
}

async function refreshJob(id) {
  try {
    const job = await api(`/api/admin/jobs/${encodeURIComponent(id)}`);
    delete job.text; // the dashboard never shows prompts or generated text
    state.jobs.set(id, job);
    renderJobs();
  } catch (error) {
    failed(error);
  }
}

// ----------------------------------------------------------------- timeline

function markSelected() {
  for (const row of document.querySelectorAll("tr[data-node-id], tr[data-job-id]")) {
    const id = row.dataset.nodeId || row.dataset.jobId;
    row.classList.toggle("selected", state.selected?.id === id);
  }
}

function openTimeline(kind, id) {
  state.selected = { kind, id };
  const label = kind === "node" ? state.nodes.get(id)?.name || short(id) : short(id);
  $("timeline-title").textContent = `Timeline: ${kind} ${label}`;
  $("timeline-hint").textContent = "Loading...";
  $("timeline-hint").hidden = false;
  $("timeline-close").hidden = false;
  $("timeline-list").replaceChildren();
  markSelected();
  loadTimeline();
}

function closeTimeline() {
  state.selected = null;
  $("timeline-title").textContent = "Timeline";
  $("timeline-hint").textContent = "Click a node or a job to see its events.";
  $("timeline-hint").hidden = false;
  $("timeline-close").hidden = true;
  $("timeline-list").replaceChildren();
  markSelected();
}

function eventItem(entry) {
  return el(
    "li",
    { dataset: { code: entry.code } },
    el("span", { class: "when", text: clock(entry.time) }),
    el("span", { class: "code", text: entry.code }),
    entry.state ? " " : null,
    entry.state ? badge(entry.state) : null,
    el("span", { class: "summary", text: entry.summary }),
  );
}

async function loadTimeline() {
  const selected = state.selected;
  if (!selected) return;
  try {
    const body = await api(`/api/admin/${selected.kind}s/${encodeURIComponent(selected.id)}/events`);
    if (state.selected !== selected) return; // another one was opened meanwhile
    const entries = body.data.slice().reverse(); // newest first
    $("timeline-list").replaceChildren(...entries.map(eventItem));
    $("timeline-hint").textContent = `${body.data.length} event${body.data.length === 1 ? "" : "s"}, newest first`;
  } catch (error) {
    if (state.selected === selected) $("timeline-hint").textContent = error.message;
    failed(error);
  }
}

// -------------------------------------------------------------- live feed

function setFeed(status) {
  const pill = $("feed-status");
  pill.textContent = status;
  pill.className = `pill ${status === "live" ? "pill-live" : status === "offline" ? "pill-off" : "pill-wait"}`;
}

function logEvent(message) {
  const target = el("span", {
    class: "target mono",
    text: `${message.kind} ${short(message.aggregate_id)}`,
    onclick: () => (message.kind === "model" ? null : openTimeline(message.kind, message.aggregate_id)),
  });
  const item = el(
    "li",
    { dataset: { code: message.code } },
    el("span", { class: "when", text: clock(message.time) }),
    el("span", { class: "code", text: message.code }),
    " ",
    target,
    el("span", { class: "summary", text: message.summary }),
  );
  const list = $("live-events");
  list.prepend(item);
  while (list.children.length > LIVE_LIMIT) list.lastElementChild.remove();
  state.liveCount += 1;
  $("live-count").textContent = `${state.liveCount} since opened`;
}

function onFeedMessage(message) {
  logEvent(message);
  const id = message.aggregate_id;
  if (message.kind === "node") {
    if (message.code.startsWith("MODEL_")) debounce("models", 250, () => panels.models.changed());
    const known = state.nodes.get(id);
    if (known && message.state && known.state !== message.state) {
      // Show the new state at once; the full row follows from the API.
      known.state = message.state;
      renderNode(known);
    }
    debounce(`node:${id}`, 150, () => refreshNode(id));
  } else if (message.kind === "model") {
    debounce("models", 250, () => panels.models.changed());
  } else if (message.kind === "job") {
    const wait = message.code === "TOKEN_STREAM_CHUNK" ? 1000 : 150;
    debounce(`job:${id}`, wait, () => refreshJob(id));
  }
  if (state.selected?.id === id) debounce("timeline", 250, loadTimeline);
}

function feedRetry() {
  setTimeout(() => state.key && !state.source && !state.renewing && openFeed(), FEED_RETRY_MS);
}

function scheduleRenewal(source, endsIn) {
  clearTimeout(state.renewTimer);
  state.renewTimer = null;
  if (endsIn === null || endsIn === undefined) return; // opened with the key: no end
  const endsMs = endsIn * 1000;
  const lead = Math.min(FEED_RENEW_LEAD_MS, endsMs / 4);
  state.renewTimer = setTimeout(() => {
    if (state.source === source) openFeed({ renew: true });
  }, Math.max(0, endsMs - lead));
}

// Opens the live feed. `renew`: the current one is about to end with its ticket's session;
// it stays open until the new one is ready, so nothing is missed. `quiet`: a planned reopen,
// the pill stays as it is.
async function openFeed({ renew = false, quiet = false } = {}) {
  if (renew) {
    if (state.renewing || !state.source) return;
  } else {
    closeFeed();
    if (!quiet) setFeed("connecting");
  }
  // EventSource cannot send an Authorization header, and the key never goes in a URL: a
  // ticket minted with the key in the header opens the feed (for 60 s), for one session.
  let ticket;
  try {
    ticket = (await api("/api/admin/feed-tickets", { method: "POST" })).ticket;
  } catch (error) {
    if (error instanceof AuthError) failed(error);
    else if (!renew) {
      setFeed("offline");
      feedRetry();
    } // a renewal: the current feed goes on until its session ends, then is reopened
    return;
  }
  if (!state.key) return; // signed out meanwhile
  if (renew ? state.renewing || !state.source : state.source || state.renewing) return;
  const source = new EventSource(`/api/admin/events/stream?ticket=${encodeURIComponent(ticket)}`);
  if (renew) state.renewing = source;
  else state.source = source;

  source.addEventListener("ready", (event) => {
    const ready = JSON.parse(event.data);
    if (state.renewing === source) {
      // The new feed is up; the old one goes. Both were open in between, so every event
      // reached one of them, and the overlap is skipped by position.
      state.renewing = null;
      const previous = state.source;
      state.source = source;
      if (previous) setTimeout(() => previous.close(), FEED_OVERLAP_MS);
      else refreshAll(); // the old one had ended already: re-read what may be missed
    } else if (state.source === source) {
      state.seen.clear(); // a fresh start: the tables are re-read
      refreshAll(); // anything missed while (re)connecting
    } else {
      source.close(); // signed out, or superseded meanwhile
      return;
    }
    setFeed("live");
    scheduleRenewal(source, ready.ends_in);
  });
  source.addEventListener("session-end", () => {
    // The server ended this feed (its ticket's session is over, or the admin key changed):
    // no automatic reconnect with the spent ticket.
    source.close();
    if (state.renewing === source) {
      state.renewing = null;
      if (!state.source) openFeed({ quiet: true });
    } else if (state.source === source) {
      state.source = null;
      // A renewal under way takes over when it is ready; else a new ticket, at once. The
      // new feed's `ready` re-reads the tables: nothing the admin API holds is lost.
      if (!state.renewing) openFeed({ quiet: true });
    }
  });
  source.addEventListener("gap", () => {
    toast("The live feed skipped events; refreshed.");
    refreshAll();
  });
  source.onmessage = (event) => {
    try {
      const message = JSON.parse(event.data);
      if (state.seen.has(message.position)) return; // shown from the feed it replaces
      state.seen.add(message.position);
      if (state.seen.size > FEED_SEEN_LIMIT) state.seen.delete(state.seen.values().next().value);
      onFeedMessage(message);
    } catch (error) {
      console.error("bad feed message", error);
    }
  };
  source.onerror = () => {
    if (state.renewing === source) {
      // The renewal failed: the current feed goes on, and is reopened when it ends.
      source.close();
      state.renewing = null;
      if (!state.source) openFeed({ quiet: true });
      return;
    }
    if (state.source !== source) return;
    if (source.readyState === EventSource.CLOSED) {
      // Refused or the controller went away: check the key, then try again.
      setFeed("offline");
      state.source = null;
      clearTimeout(state.renewTimer);
      api("/api/admin/nodes")
        .then(feedRetry)
        .catch((error) => {
          if (error instanceof AuthError) failed(error);
          else feedRetry();
        });
    } else {
      setFeed("reconnecting");
    }
  };
}

function closeFeed() {
  clearTimeout(state.renewTimer);
  state.renewTimer = null;
  for (const source of [state.source, state.renewing]) if (source) source.close();
  state.source = null;
  state.renewing = null;
}

// ------------------------------------------------------------ sign in / out

async function refreshAll() {
  await refreshNodes();
  await refreshJobs();
  if (state.selected) loadTimeline();
}

function start() {
  $("login").hidden = true;
  $("main").hidden = false;
  $("sign-out").hidden = false;
  refreshAll();
  openFeed();
  state.timers.push(setInterval(refreshNodes, NODE_POLL_MS));
  state.timers.push(setInterval(refreshJobs, JOB_POLL_MS));
}

function signOut(reason = "") {
  closeFeed();
  for (const panel of Object.values(panels)) panel.reset();
  showPanel("cluster");
  sessionStorage.removeItem("dacp.aiKey");
  $("ai-key").value = "";
  for (const timer of state.timers) clearInterval(timer);
  state.timers = [];
  for (const timer of state.pending.values()) clearTimeout(timer);
  state.pending.clear();
  sessionStorage.removeItem(KEY_STORAGE);
  state.key = null;
  state.nodes.clear();
  state.jobs.clear();
  state.selected = null;
  setFeed("offline");
  $("main").hidden = true;
  $("sign-out").hidden = true;
  $("login").hidden = false;
  $("admin-key").value = "";
  $("login-error").textContent = reason;
  $("login-error").hidden = !reason;
  $("admin-key").focus();
}

async function signIn(event) {
  event.preventDefault();
  const key = $("admin-key").value.trim();
  if (!key) return;
  $("login-button").disabled = true;
  $("login-error").hidden = true;
  state.key = key;
  try {
    await api("/api/admin/nodes");
    sessionStorage.setItem(KEY_STORAGE, key);
    $("admin-key").value = "";
    start();
  } catch (error) {
    state.key = null;
    $("login-error").textContent =
      error instanceof AuthError
        ? `The controller refused this key: ${error.message}`
        : `Cannot reach the controller: ${error.message}`;
    $("login-error").hidden = false;
  } finally {
    $("login-button").disabled = false;
  }
}

// ------------------------------------------------------------------- tabs

const ui = { api, failed, toast, el, short, size, nodes: () => [...state.nodes.values()] };
const panels = {
  charts: createCharts({ ...ui, root: $("panel-charts") }),
  models: createModels({ ...ui, root: $("panel-models") }),
  keys: createKeys({ ...ui, root: $("panel-keys") }),
  usage: createUsage({ ...ui, root: $("panel-usage") }),
  "add-node": createAddNode({ ...ui, root: $("panel-add-node") }),
  playground: createPlayground({ ...ui, root: $("panel-playground") }),
};

function showPanel(name) {
  for (const tab of document.querySelectorAll('[role="tab"]')) {
    const chosen = tab.dataset.panel === name;
    tab.setAttribute("aria-selected", String(chosen));
    $(`panel-${tab.dataset.panel}`).hidden = !chosen;
    const panel = panels[tab.dataset.panel];
    if (panel && !chosen) panel.hide();
  }
  panels[name]?.show();
}

function init() {
  $("login-form").addEventListener("submit", signIn);
  for (const tab of document.querySelectorAll('[role="tab"]')) {
    tab.addEventListener("click", () => showPanel(tab.dataset.panel));
  }
  $("sign-out").addEventListener("click", () => signOut());
  $("timeline-close").addEventListener("click", closeTimeline);
  const saved = sessionStorage.getItem(KEY_STORAGE);
  if (saved) {
    state.key = saved;
    start();
  } else {
    $("admin-key").focus();
  }
}

init();
