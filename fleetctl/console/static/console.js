// The operator console: three live lanes of runs, a page per run, the fleet's agents, MCP
// servers, policy and memory audit, and charts of the fleet over time. Every datum goes into the page as text (never as HTML).
"use strict";

const HUMAN_WAITS = new Set(["approval", "input", "budget", "needs_human"]);
const ENDED = new Set(["completed", "failed", "canceled", "rejected"]);
const LANE_POLL_MS = 2000;
let leaveView = () => {};

// ---- small helpers ------------------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (value !== undefined && value !== null && value !== false) node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

class ApiError extends Error {
  constructor(status, error) {
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.code = error.code || "error";
  }
}

async function api(path, options = {}) {
  const init = { credentials: "same-origin", headers: { "x-fleet-console": "1" }, ...options };
  if (options.body !== undefined) {
    init.method = "POST";
    init.body = JSON.stringify(options.body);
    init.headers = { ...init.headers, "content-type": "application/json" };
  }
  const answer = await fetch(path, init);
  const body = await answer.json().catch(() => ({}));
  if (answer.status === 401) signedOut(body.error || {});
  if (!answer.ok) throw new ApiError(answer.status, body.error || {});
  return body;
}

function banner(text, kind = "error") {
  const node = document.getElementById("banner");
  node.hidden = !text;
  node.className = `banner ${kind}`;
  node.textContent = text || "";
}

function signedOut(error) {
  banner(`Not signed in (${error.message || "session ended"}). Run \`fleet console\` for a sign-in link.`);
}

function when(value) {
  if (!value) return "";
  const date = typeof value === "number" ? new Date(value * 1000) : new Date(value);
  return date.toLocaleString();
}

function since(value) {
  if (!value) return "";
  const seconds = Math.max(0, (Date.now() - new Date(value).getTime()) / 1000);
  if (seconds < 90) return `${Math.round(seconds)} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function waitsForPerson(run) {
  if (run.state === "input-required") return true;
  if (run.state !== "waiting" || !run.wait) return false;
  const requests = Array.isArray(run.wait.requests) ? run.wait.requests : [run.wait];
  return requests.some((r) => HUMAN_WAITS.has(r.type));
}

function lane(run) {
  if (waitsForPerson(run)) return "input";
  if (run.state === "failed") return "errors";
  if (ENDED.has(run.state)) return "completed";
  return "flight";
}

function stateBadge(state) {
  return el("span", { class: `state state-${state}`, "data-testid": "run-state" }, state);
}

function table(headers, rows) {
  return el(
    "table",
    {},
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows.map((cells) => el("tr", {}, cells.map((c) => el("td", {}, c))))),
  );
}

function json(value) {
  return el("pre", { class: "json" }, JSON.stringify(value, null, 2));
}

// ---- the lanes ----------------------------------------------------------------------------------

function runCard(run) {
  const wait = run.wait || {};
  const skill = (wait.detail || {}).skill || wait.skill;
  const detail = lane(run) === "input"
    ? `${wait.type || run.state}${skill ? ` · ${skill}` : ""} · waiting ${since(wait.since || run.updated_at)}`
    : `${run.reason || run.state} · ${when(run.updated_at)}`;
  return el(
    "a",
    { class: "card", href: `#/runs/${encodeURIComponent(run.run_id)}`, "data-run-id": run.run_id },
    el("div", { class: "card-head" }, el("code", {}, run.run_id.slice(0, 12)), stateBadge(run.state)),
    el("div", { class: "card-detail" }, detail),
    wait.deadline ? el("div", { class: "card-deadline" }, `deadline ${when(wait.deadline)}`) : null,
  );
}

async function showLanes(view) {
  const lanes = {
    input: el("section", { class: "lane", "data-lane": "input" }),
    errors: el("section", { class: "lane", "data-lane": "errors" }),
    completed: el("section", { class: "lane", "data-lane": "completed" }),
  };
  const titles = { input: "Needs your input", errors: "Errors", completed: "Completed" };
  const flight = el("p", { class: "flight" });
  view.replaceChildren(flight, el("div", { class: "lanes" }, Object.values(lanes)));
  let timer = null;
  let stopped = false;
  function render(runs) {
    const sorted = [...runs].sort((a, b) => b.updated_at.localeCompare(a.updated_at));
    for (const [name, node] of Object.entries(lanes)) {
      const here = sorted.filter((r) => lane(r) === name);
      node.replaceChildren(
        el("h2", {}, titles[name], " ", el("span", { class: "count" }, String(here.length))),
        ...(here.length ? here.map(runCard) : [el("p", { class: "empty" }, "Nothing here.")]),
      );
    }
    const inFlight = sorted.filter((r) => lane(r) === "flight").length;
    flight.textContent = `${inFlight} run${inFlight === 1 ? "" : "s"} in flight (working, or waiting on a timer, a batch or an event).`;
    banner("");
  }
  // Polled only when the pushed feed cannot be had (refused, e.g. every stream slot taken).
  async function poll() {
    try {
      render((await api("/api/runs")).runs);
    } catch (error) {
      if (error.status !== 401) banner(`Could not load runs: ${error.message} [${error.code}]`);
    }
    if (!stopped) timer = setTimeout(poll, LANE_POLL_MS);
  }
  // The lanes are pushed: the coordinator sends the tenant's runs at once and whenever they change.
  let source = new EventSource("/api/runs/changes");
  source.addEventListener("message", (message) => render(JSON.parse(message.data).runs));
  source.onerror = () => {
    if (source && source.readyState === EventSource.CLOSED && !stopped) {
      source = null;
      poll();
    }
  };
  leaveView = () => { stopped = true; clearTimeout(timer); if (source) source.close(); };
}

// ---- one run ------------------------------------------------------------------------------------

function artifactsOf(events) {
  const found = [];
  for (const event of events) {
    if (event.type === "artifact") {
      found.push({ name: event.payload.name, text: event.payload.text, seq: event.seq });
      continue;
    }
    const text = JSON.stringify(event.payload || {});
    for (const ref of text.match(/artifact:sha256:[0-9a-f]{64}/g) || []) {
      found.push({ ref, seq: event.seq, type: event.type });
    }
  }
  return found;
}

function signalForm(run, onDone, status) {
  const wait = run.wait || {};
  const requests = Array.isArray(wait.requests) ? wait.requests : [wait];
  const signalId = crypto.randomUUID(); // one per form: a click sent twice is applied once
  const note = el("textarea", { name: "note", rows: "2", placeholder: "A note for the record (optional)" });
  const input = el("textarea", { name: "input", rows: "3", placeholder: '{"field": "value"}' });
  async function send(action, extra = {}) {
    status.textContent = `${action}…`;
    try {
      const body = { action, id: `${signalId}-${action}`, note: note.value, ...extra };
      const outcome = await api(`/api/runs/${encodeURIComponent(run.run_id)}/signals`, { body });
      status.textContent = `${action}: ${outcome.outcome}${outcome.reasons && outcome.reasons.length ? ` (${outcome.reasons.join("; ")})` : ""}`;
      onDone();
    } catch (error) {
      status.textContent = `${action} refused: ${error.message} [${error.code}]`;
    }
  }
  const buttons = [];
  const human = waitsForPerson(run);
  const asksInput = requests.some((r) => r.type === "input") || run.state === "input-required";
  if (human && requests.some((r) => r.type === "approval")) {
    buttons.push(el("button", { type: "button", class: "approve", onclick: () => send("approve") }, "Approve"));
    buttons.push(el("button", { type: "button", class: "reject", onclick: () => send("reject") }, "Reject"));
  }
  if (asksInput) {
    buttons.push(el("button", {
      type: "button",
      class: "input",
      onclick: () => {
        let given;
        try { given = JSON.parse(input.value || "{}"); } catch { status.textContent = "The input is not JSON."; return; }
        send("input", { input: given });
      },
    }, "Provide input"));
  }
  if (!ENDED.has(run.state)) {
    buttons.push(el("button", { type: "button", class: "cancel", onclick: () => send("cancel") }, "Cancel run"));
  }
  if (!buttons.length) return null;
  return el("section", { class: "actions" }, el("h3", {}, "Act on this run"), note, asksInput ? input : null,
    el("div", { class: "buttons" }, buttons));
}

function waitPanel(run) {
  if (!run.wait || ENDED.has(run.state)) return null;
  const wait = run.wait;
  const detail = wait.detail || {};
  const rows = [
    ["Waits for", `${wait.type || "?"}${wait.awaited ? ` (${wait.awaited})` : ""}`],
    ["Step / skill", [detail.step || wait.step, detail.skill || wait.skill].filter(Boolean).join(" · ")],
    ["Since", `${when(wait.since)} (${since(wait.since)} ago)`],
    ["Deadline", wait.deadline ? when(wait.deadline) : "none"],
  ];
  if (wait.why) rows.push(["Why", wait.why]);
  if (wait.escalated) rows.push(["Escalated", "yes"]);
  return el("section", { class: "wait", "data-testid": "wait" }, el("h3", {}, "Waiting"),
    table(["", ""], rows));
}

function timelineItem(event) {
  const payload = event.payload || {};
  const summary = payload.error ? `${payload.error.code || ""} ${payload.error.message || ""}` :
    payload.skill || payload.step || payload.reason || "";
  return el("li", { class: `event event-${event.type.split(".")[0]}`, "data-seq": event.seq },
    el("details", {},
      el("summary", {}, el("span", { class: "seq" }, `#${event.seq}`), " ",
        el("span", { class: "etype" }, event.type), " ", el("span", { class: "summary" }, String(summary)),
        el("span", { class: "ts" }, `${when(event.ts)} · ${event.actor || ""}`)),
      json(payload)));
}

// ---- a run's plan as a graph -------------------------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";
const STEP_STATE = {
  "step.started": "working", "step.completed": "completed", "step.failed": "failed", "step.blocked": "blocked",
};
const NODE_W = 190;
const NODE_H = 58;

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// A plan step's id as the events name it: a gated step's later calls are `<step>~<n>`, a batch's `<step>@<i>`.
const stepOf = (name) => String(name || "").split(/[~@]/)[0];

// The plan (its shape: the latest event that carries `steps`) and what became of each step, from the events.
function planState(events, run) {
  let steps = [];
  const seen = new Map();
  for (const event of events) {
    const payload = event.payload || {};
    if (Array.isArray(payload.steps)) steps = payload.steps;
    const state = STEP_STATE[event.type];
    if (!state || !payload.step) continue;
    const id = stepOf(payload.step);
    const known = seen.get(id) || {};
    seen.set(id, {
      ...known, state, agent: payload.agent || known.agent,
      started: known.started || (state === "working" ? event.ts : undefined),
      ended: ENDED.has(state) ? event.ts : undefined,
    });
  }
  const waitingAt = run && run.state === "waiting" && run.wait ? stepOf((run.wait.detail || {}).step || run.wait.step) : null;
  if (waitingAt && seen.has(waitingAt)) seen.get(waitingAt).state = "waiting";
  if (run && (run.state === "canceled" || run.state === "failed")) {
    for (const step of seen.values()) if (step.state === "working") step.state = run.state;
  }
  return { steps, seen };
}

function duration(from, to) {
  if (!from) return "";
  const ms = (to ? new Date(to) : new Date()) - new Date(from);
  return ms < 1000 ? `${Math.max(ms, 0)} ms` : `${(ms / 1000).toFixed(1)} s`;
}

// Steps in columns by depth (the longest chain of `after` before them), edges from each step it waits for.
function planGraph(events, run) {
  const { steps, seen } = planState(events, run);
  if (!steps.length) return el("p", { class: "empty" }, "No plan yet.");
  const byId = new Map(steps.map((step) => [step.id, step]));
  const depth = new Map();
  const depthOf = (id, trail = new Set()) => {
    if (depth.has(id)) return depth.get(id);
    if (trail.has(id)) return 0; // a cycle is refused before a run starts; never loop here
    trail.add(id);
    const after = (byId.get(id) || {}).after || [];
    const found = after.length ? 1 + Math.max(...after.map((a) => depthOf(a, trail))) : 0;
    depth.set(id, found);
    return found;
  };
  const columns = [];
  for (const step of steps) (columns[depthOf(step.id)] ||= []).push(step);
  const at = new Map();
  columns.forEach((column, x) => (column || []).forEach((step, y) => at.set(step.id, { x: 16 + x * (NODE_W + 48), y: 16 + y * (NODE_H + 22) })));
  const width = 32 + columns.length * (NODE_W + 48) - 48;
  const height = 32 + Math.max(...columns.map((c) => (c || []).length)) * (NODE_H + 22) - 22;
  const edges = steps.flatMap((step) => (step.after || []).filter((a) => at.has(a)).map((a) => {
    const from = at.get(a);
    const to = at.get(step.id);
    return svg("path", {
      class: "edge", "marker-end": "url(#arrow)",
      d: `M${from.x + NODE_W},${from.y + NODE_H / 2} C${from.x + NODE_W + 24},${from.y + NODE_H / 2} ${to.x - 24},${to.y + NODE_H / 2} ${to.x},${to.y + NODE_H / 2}`,
    });
  }));
  const nodes = steps.map((step) => {
    const { x, y } = at.get(step.id);
    const found = seen.get(step.id) || { state: "pending" };
    const time = duration(found.started, found.ended);
    return svg("g", { class: `node node-${found.state}`, "data-step": step.id, "data-state": found.state, transform: `translate(${x},${y})` },
      svg("title", {}, `${step.id}: ${step.skill || ""} (${found.state})`),
      svg("rect", { width: NODE_W, height: NODE_H, rx: 8 }),
      svg("text", { x: 10, y: 18, class: "node-id" }, step.id),
      svg("text", { x: 10, y: 35 }, [step.skill, found.agent].filter(Boolean).join(" · ")),
      svg("text", { x: 10, y: 51, class: "node-state" }, [found.state, time].filter(Boolean).join(" · ")));
  });
  return svg("svg", { class: "plan-graph", "data-testid": "plan-graph", width, height, viewBox: `0 0 ${width} ${height}` },
    svg("defs", {}, svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto" },
      svg("path", { d: "M0,0 L10,5 L0,10 z" }))),
    edges, nodes);
}

async function showRun(view, runId) {
  const header = el("section", { class: "run-head" });
  const waitSlot = el("div");
  const actionSlot = el("div");
  const status = el("p", { class: "signal-status", "data-testid": "signal-status" });
  const timeline = el("ol", { class: "timeline", "data-testid": "timeline" });
  const graph = el("section", { class: "plan" });
  let lastRun = null;
  const drawPlan = () => graph.replaceChildren(el("h3", {}, "Plan"), planGraph(events, lastRun));
  const operations = el("section", { class: "operations" });
  const artifacts = el("section", { class: "artifacts" });
  const bundle = el("button", { type: "button", onclick: () => downloadBundle(runId) }, "Download debug bundle");
  view.replaceChildren(
    el("p", {}, el("a", { href: "#/" }, "← all runs")), header, waitSlot, actionSlot, status, graph,
    el("div", { class: "run-body" },
      el("section", {}, el("h3", {}, "Timeline"), timeline),
      el("div", {}, artifacts, operations, el("section", {}, el("h3", {}, "Debug"), bundle))),
  );
  const events = [];
  let stopped = false;
  let ended = false;
  let timer = null;
  let refreshing = null;

  // One refresh at a time, and one timer: events and the timer both ask for one.
  function refresh() {
    clearTimeout(timer);
    refreshing = refreshing || load().finally(() => {
      refreshing = null;
      if (!ended && !stopped) timer = setTimeout(refresh, LANE_POLL_MS);
    });
    return refreshing;
  }

  async function load() {
    try {
      const run = await api(`/api/runs/${encodeURIComponent(runId)}`);
      lastRun = run;
      drawPlan();
      header.replaceChildren(
        el("h2", {}, "Run ", el("code", {}, run.run_id), " ", stateBadge(run.state)),
        el("p", {}, `tenant ${run.tenant} · started by ${run.owner} · ${when(run.created_at)}`,
          run.reason ? ` · reason: ${run.reason}` : ""),
      );
      waitSlot.replaceChildren(...[waitPanel(run)].filter(Boolean));
      const form = actionSlot.dataset.state === run.state && actionSlot.dataset.seq === String(run.last_seq)
        ? null : signalForm(run, refresh, status);
      if (form !== null || ENDED.has(run.state)) actionSlot.replaceChildren(...[form].filter(Boolean));
      actionSlot.dataset.state = run.state;
      actionSlot.dataset.seq = String(run.last_seq);
      const { operations: ops } = await api(`/api/runs/${encodeURIComponent(runId)}/operations`);
      operations.replaceChildren(el("h3", {}, "Operations"), ops.length
        ? table(["operation", "step", "what", "status", "attempts"], ops.map((o) => [
          el("code", {}, (o.op_id || "").slice(0, 16)), o.step_id || "", `${o.kind || ""} ${o.target || ""}`.trim(),
          `${o.status || ""}${o.error ? ` (${o.error.code || ""} ${o.error.message || ""})` : ""}`, String(o.attempts ?? "")]))
        : el("p", { class: "empty" }, "No external effects."));
      ended = ENDED.has(run.state);
    } catch (error) {
      if (error.status !== 401) banner(`Could not load run: ${error.message} [${error.code}]`);
    }
  }

  // The event log, replayed then live; EventSource reconnects with Last-Event-ID by itself.
  // (the console relays every event untyped: the type is in each event's data)
  const source = new EventSource(`/api/runs/${encodeURIComponent(runId)}/events`);
  const onEvent = (message) => {
    const event = JSON.parse(message.data);
    if (events.some((e) => e.seq === event.seq)) return;
    events.push(event);
    timeline.append(timelineItem(event));
    drawPlan();
    const found = artifactsOf(events);
    artifacts.replaceChildren(el("h3", {}, "Artifacts"), found.length
      ? el("ul", { "data-testid": "artifacts" }, found.map((a) => el("li", {}, a.ref
        ? [el("code", {}, a.ref), ` (event #${a.seq})`]
        : [el("strong", {}, a.name || "artifact"), ` (event #${a.seq})`, el("pre", { class: "json" }, a.text || "")])))
      : el("p", { class: "empty" }, "None yet."));
    if (event.type.startsWith("run.")) refresh();
    if (event.type.startsWith("run.") && ENDED.has(event.type.slice(4))) source.close(); // the last event
  };
  source.addEventListener("message", onEvent);
  // The coordinator ends the stream when the run ends; EventSource would reconnect for ever.
  source.onerror = () => { if (ended) source.close(); };
  leaveView = () => { stopped = true; clearTimeout(timer); source.close(); };
  await refresh();
}

async function downloadBundle(runId) {
  try {
    const body = await api(`/api/runs/${encodeURIComponent(runId)}/debug-bundle`);
    const blob = new Blob([JSON.stringify(body, null, 2)], { type: "application/json" });
    const link = el("a", { href: URL.createObjectURL(blob), download: `run-${runId}-bundle.json` });
    link.click();
    URL.revokeObjectURL(link.href);
  } catch (error) {
    banner(`Could not fetch the debug bundle: ${error.message} [${error.code}]`);
  }
}

// ---- the fleet ----------------------------------------------------------------------------------

// The fleet as a picture: the coordinator, the agents it delegates to (coloured by the registry's
// word on their health) and the MCP servers registered with their tools.
function fleetGraph(agents, servers) {
  const coordinators = agents.filter((a) => a.kind === "coordinator");
  const others = agents.filter((a) => a.kind !== "coordinator");
  const columns = [
    // The coordinator is no agent of the registry's: drawn as where runs enter, with no health claimed.
    coordinators.length ? coordinators : [{ id: "coordinator", kind: "coordinator", status: "entry", skills: [] }],
    others, servers.map((m) => ({ ...m, kind: "mcp_server" })),
  ];
  const rowH = NODE_H + 14;
  const height = 32 + Math.max(...columns.map((c) => c.length), 1) * rowH;
  const x = [16, 16 + NODE_W + 120, 16 + 2 * (NODE_W + 120)];
  const y = (column, i) => 16 + i * rowH + (height - 32 - columns[column].length * rowH) / 2;
  const from = { x: x[0] + NODE_W, y: y(0, 0) + NODE_H / 2 };
  const edges = others.map((a, i) => svg("path", {
    class: "edge", "marker-end": "url(#arrow)",
    d: `M${from.x},${from.y} C${from.x + 60},${from.y} ${x[1] - 60},${y(1, i) + NODE_H / 2} ${x[1]},${y(1, i) + NODE_H / 2}`,
  }));
  const node = (column, i, item) => {
    const health = item.kind === "mcp_server" ? "registered" : (item.status || "unknown");
    const what = item.kind === "mcp_server"
      ? `${(item.tools || []).length} tools: ${(item.tools || []).map((t) => t.name).join(", ")}`
      : item.kind === "coordinator" ? "plans and delegates"
        : `${item.kind}${item.external ? " · outside" : ""} · ${(item.skills || []).length} skills`;
    return svg("g", {
      class: `node node-${health === "healthy" || health === "registered" ? "completed" : health === "entry" ? "pending" : "failed"}`,
      [item.kind === "mcp_server" ? "data-mcp" : "data-agent"]: item.id, "data-status": health,
      transform: `translate(${x[column]},${y(column, i)})`,
    },
    svg("title", {}, `${item.id}: ${health}`),
    svg("rect", { width: NODE_W, height: NODE_H, rx: 8 }),
    svg("text", { x: 10, y: 18, class: "node-id" }, item.id),
    svg("text", { x: 10, y: 35 }, what.length > 27 ? `${what.slice(0, 26)}…` : what),
    svg("text", { x: 10, y: 51, class: "node-state" }, health));
  };
  const width = x[2] + NODE_W + 16;
  return svg("svg", { class: "plan-graph", "data-testid": "fleet-graph", width, height, viewBox: `0 0 ${width} ${height}` },
    svg("defs", {}, svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto" },
      svg("path", { d: "M0,0 L10,5 L0,10 z" }))),
    edges, columns.map((column, c) => column.map((item, i) => node(c, i, item))));
}

async function showAgents(view) {
  const [{ agents }, mcp] = await Promise.all([api("/api/agents"), api("/api/mcp-servers")]);
  view.replaceChildren(el("h2", {}, "The fleet"),
    el("section", { class: "plan" }, fleetGraph(agents, mcp.mcp_servers || [])),
    el("h2", {}, "Agents"), table(
    ["agent", "kind", "version", "status", "skills", "endpoint"],
    agents.map((a) => [a.id, a.kind, a.version, `${a.status}${a.status_reason ? ` (${a.status_reason})` : ""}`,
      a.skills.map((s) => s.id).join(", "), el("code", {}, a.url)]),
  ));
}

async function showMcp(view) {
  const body = await api("/api/mcp-servers");
  const servers = body.mcp_servers || [];
  view.replaceChildren(el("h2", {}, "MCP servers"), table(
    ["server", "endpoint", "tools"],
    servers.map((m) => [m.id, el("code", {}, m.url || ""), (m.tools || []).map((t) => t.name).join(", ")]),
  ));
}

async function showPolicy(view) {
  const { processes, decisions } = await api("/api/policy");
  const revisions = new Set(processes.map((p) => p.revision));
  view.replaceChildren(
    el("h2", {}, "Policy"),
    el("p", { "data-testid": "policy-revision" }, revisions.size === 1
      ? `Every process enforces revision ${[...revisions][0]}.`
      : `Processes enforce ${revisions.size} revisions: a push is under way or was refused somewhere.`),
    table(["service", "engine", "revision", "refused"], processes.map((p) => [
      p.service, p.engine || "", p.revision, p.refused ? `${p.refused.revision || ""}: ${p.refused.error || ""}` : ""])),
    el("h3", {}, "Decision log (newest first)"),
    table(["time", "policy", "asked by", "allow", "revision", "decision"], [...decisions].reverse().map((d) => [
      when(d.timestamp), d.path, d.service, d.allow === null ? "" : String(d.allow), d.revision || "",
      el("code", {}, d.decision_id || "")])),
  );
}

async function showMemory(view) {
  const { events } = await api("/api/memory/audit");
  view.replaceChildren(el("h2", {}, "Memory audit"), events.length ? table(
    ["time", "operation", "agent", "tier", "outcome", "entry", "reasons"],
    [...events].reverse().map((e) => [when(e.time), e.op, e.agent || "", e.tier || "", e.outcome || "",
      el("code", {}, e.entry_id || (e.count !== undefined ? `${e.count} ids` : "")), (e.reasons || []).join("; ")]),
  ) : el("p", { class: "empty" }, "No memory operations yet."));
}

// ---- the fleet over time ------------------------------------------------------------------------

// Charts of what every process of the fleet published as its metrics (the console keeps the last
// hours): runs by state, the work queue, tool calls and policy decisions, per interval of the window.
const CHART_WINDOWS = ["15m", "1h", "6h"];
const CHART_REFRESH_MS = 10000;
const CHART = { w: 560, h: 170, left: 48, right: 10, top: 10, bottom: 22 };
const COLORS = {
  submitted: "#98a2b3", working: "#2e5bff", waiting: "#b54708", input_required: "#dc6803",
  completed: "#067647", failed: "#b42318", canceled: "#667085", rejected: "#7a271a",
  pending: "#2e5bff", started: "#98a2b3", p50_s: "#2e5bff", p95_s: "#b54708", calls: "#98a2b3",
  errors: "#b42318", allow: "#067647", deny: "#b42318", unavailable: "#b54708",
};

function niceMax(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 2.5, 5, 10].map((m) => m * power).find((m) => m >= value);
}

function clock(seconds) {
  return new Date(seconds * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
}

function amount(value, unit) {
  if (value === null || value === undefined) return "–";
  if (unit === "s") return value < 1 ? `${Math.round(value * 1000)} ms` : `${value.toFixed(2)} s`;
  return String(Math.round(value * 100) / 100);
}

// rows: [{ name, values, bars }]; a line breaks where a value is missing (null).
// A row's legend shows its latest value, or with `total` its sum over the window.
function chart(testid, title, times, rows, { unit = "" } = {}) {
  const plotted = rows.filter((r) => r.values.some((v) => v !== null && v !== undefined));
  const top = niceMax(Math.max(0, ...plotted.flatMap((r) => r.values.filter((v) => v !== null))));
  const { w, h, left, right, top: pad, bottom } = CHART;
  const slot = (w - left - right) / Math.max(times.length, 1);
  const x = (i) => left + (i + 0.5) * slot;
  const y = (v) => h - bottom - (v / top) * (h - pad - bottom);
  const barRows = plotted.filter((r) => r.bars);
  const drawn = plotted.map((row) => {
    if (row.bars) {
      const k = barRows.indexOf(row);
      const width = Math.max(1, (slot * 0.8) / barRows.length);
      return row.values.map((v, i) => (v ? svg("rect", {
        class: "bar", fill: COLORS[row.name] || "#667085", x: x(i) - slot * 0.4 + k * width, y: y(v),
        width, height: h - bottom - y(v),
      }, svg("title", {}, `${clock(times[i])} ${row.name}: ${amount(v, unit)}`)) : null));
    }
    const known = (i) => row.values[i] !== null && row.values[i] !== undefined;
    let d = "";
    const dots = [];
    row.values.forEach((v, i) => {
      if (!known(i)) return;
      d += `${known(i - 1) ? "L" : "M"}${x(i).toFixed(1)},${y(v).toFixed(1)}`;
      if (!known(i - 1) && !known(i + 1)) dots.push(svg("circle", { cx: x(i), cy: y(v), r: 2.5, fill: COLORS[row.name] || "#667085" }));
    });
    return [svg("path", { class: "series", d, stroke: COLORS[row.name] || "#667085" }), dots];
  });
  const grid = [0, top / 2, top].map((v) => [
    svg("line", { class: "grid", x1: left, x2: w - right, y1: y(v), y2: y(v) }),
    svg("text", { class: "tick", x: left - 6, y: y(v) + 4, "text-anchor": "end" }, amount(v, unit)),
  ]);
  const axis = times.length ? [
    svg("text", { class: "tick", x: left, y: h - 6 }, clock(times[0] - (times[1] - times[0] || 0))),
    svg("text", { class: "tick", x: w - right, y: h - 6, "text-anchor": "end" }, clock(times[times.length - 1])),
  ] : [];
  const legend = rows.map((row) => {
    const seen = row.values.filter((v) => v !== null && v !== undefined);
    const value = row.total ? seen.reduce((a, b) => a + b, 0) : (seen.length ? seen[seen.length - 1] : null);
    return el("span", { class: "legend-item", "data-series": row.name, "data-value": value === null ? "" : String(value) },
      svg("svg", { class: "swatch", width: 10, height: 10, "aria-hidden": "true" }, svg("rect", { width: 10, height: 10, rx: 2, fill: COLORS[row.name] || "#667085" })), `${row.name.replace(/_s$/, "")} ${amount(value, row.unit || unit)}`);
  });
  return el("section", { class: "chart", "data-testid": testid },
    el("h3", {}, title),
    svg("svg", { class: "plot", width: w, height: h, viewBox: `0 0 ${w} ${h}`, role: "img", "aria-label": title }, grid, axis, drawn),
    el("div", { class: "legend" }, legend));
}

// What each agent's tasks spent on models over the window: a chart of tokens per interval, and a
// table of the totals (tokens in and out, dollars priced by policy, completion latency, slow tool
// calls, loop stops by reason).
const AGENT_PALETTE = ["#2e5bff", "#b54708", "#067647", "#7a271a", "#6941c6", "#0e7090", "#c11574", "#667085"];

function agentTokens(m) {
  const rows = Object.entries(m.agents || {}).map(([name, a], i) => {
    COLORS[name] = COLORS[name] || AGENT_PALETTE[i % AGENT_PALETTE.length];
    return { name, values: a.tokens_in.map((v, k) => v + a.tokens_out[k]), bars: true, total: true };
  });
  return chart("chart-agent-tokens", "LLM tokens by agent (in and out)", m.times, rows);
}

function agentUsage(m) {
  const agents = Object.entries(m.agents || {});
  const old = document.querySelector("[data-testid=agent-usage]");
  if (old) old.remove();
  if (!agents.length) return el("p", { class: "empty", "data-testid": "agent-usage" }, "No agent used a model in this window.");
  const head = ["Agent", "Tokens in", "Tokens out", "Cost", "Completions", "p50", "p95", "Tool calls > 30 s", "Loop stops"];
  return el("section", { "data-testid": "agent-usage" },
    el("h3", {}, "Agents and models, this window"),
    el("table", {},
      el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))),
      el("tbody", {}, agents.map(([name, a]) => {
        const t = a.total;
        const stops = Object.entries(t.stops || {}).filter(([, n]) => n > 0).map(([reason, n]) => `${reason} ${n}`).join(", ") || "none";
        return el("tr", { "data-agent": name },
          el("td", {}, name),
          el("td", { "data-col": "tokens_in" }, String(t.tokens_in)),
          el("td", { "data-col": "tokens_out" }, String(t.tokens_out)),
          el("td", { "data-col": "cost_usd", "data-value": String(t.cost_usd) }, `$${t.cost_usd.toFixed(4)}`),
          el("td", { "data-col": "llm_calls" }, String(t.llm_calls)),
          el("td", {}, amount(t.llm_p50_s, "s")),
          el("td", {}, amount(t.llm_p95_s, "s")),
          el("td", { "data-col": "slow_tool_calls" }, String(t.slow_tool_calls)),
          el("td", { "data-col": "stops" }, stops));
      }))));
}

async function showActivity(view, windowName) {
  const chosen = CHART_WINDOWS.includes(windowName) ? windowName : "1h";
  const picker = el("p", { class: "windows" }, "Window: ", CHART_WINDOWS.map((name) => el("a", {
    href: `#/activity/${name}`, class: name === chosen ? "active" : "",
  }, name)));
  const board = el("div", { class: "charts" });
  const note = el("p", { class: "empty" });
  view.replaceChildren(el("h2", {}, "The fleet over time"), picker, board, note);
  let timer = null;
  let stopped = false;
  async function draw() {
    try {
      const m = await api(`/api/metrics?window=${chosen}`);
      const states = Object.entries(m.runs).map(([name, values]) => ({ name, values }));
      const policy = ["deny", "unavailable", "allow"].filter((r) => m.policy[r]).map((name) => ({ name, values: m.policy[name], bars: name !== "allow", total: true }));
      board.replaceChildren(
        chart("chart-runs", "Runs by state", m.times, states),
        chart("chart-queue", "Work queue: lag from submission to a worker", m.times, [
          { name: "p50_s", values: m.queue.p50_s, unit: "s" }, { name: "p95_s", values: m.queue.p95_s, unit: "s" },
        ], { unit: "s" }),
        chart("chart-starts", "Runs started by a worker, and waiting in the queue", m.times, [
          { name: "started", values: m.queue.started, bars: true, total: true }, { name: "pending", values: m.queue.pending },
        ]),
        chart("chart-tools", "Tool call latency", m.times, [
          { name: "p50_s", values: m.tools.p50_s, unit: "s" }, { name: "p95_s", values: m.tools.p95_s, unit: "s" },
        ], { unit: "s" }),
        chart("chart-tool-calls", "Tool calls and errors", m.times, [
          { name: "calls", values: m.tools.calls, bars: true, total: true },
          { name: "errors", values: m.tools.errors, bars: true, total: true },
        ]),
        chart("chart-policy", "Policy decisions refused", m.times, policy.filter((r) => r.bars)),
        agentTokens(m),
      );
      board.after(agentUsage(m));
      note.textContent = `${m.sources.length} processes reported; one interval is ${amount(m.step_s, "s")}. Legends: the latest value (runs, latency, waiting) or the window's total (started, calls, refusals).`;
      banner("");
    } catch (error) {
      if (error.status !== 401) banner(`Could not load the charts: ${error.message} [${error.code}]`);
    }
    if (!stopped) timer = setTimeout(draw, CHART_REFRESH_MS);
  }
  leaveView = () => { stopped = true; clearTimeout(timer); };
  await draw();
}

// ---- routing ------------------------------------------------------------------------------------

async function route() {
  leaveView();
  leaveView = () => {};
  const view = document.getElementById("view");
  const hash = location.hash.replace(/^#/, "") || "/";
  const parts = hash.split("/").filter(Boolean);
  for (const link of document.querySelectorAll("nav a")) {
    link.classList.toggle("active", link.dataset.nav === (parts[0] === "runs" || !parts[0] ? "runs" : parts[0]));
  }
  try {
    if (parts[0] === "runs" && parts[1]) await showRun(view, decodeURIComponent(parts[1]));
    else if (parts[0] === "agents") await showAgents(view);
    else if (parts[0] === "mcp") await showMcp(view);
    else if (parts[0] === "policy") await showPolicy(view);
    else if (parts[0] === "memory") await showMemory(view);
    else if (parts[0] === "activity") await showActivity(view, parts[1]);
    else await showLanes(view);
  } catch (error) {
    if (error.status !== 401) banner(`${error.message} [${error.code}]`);
  }
}

async function start() {
  document.getElementById("sign-out").addEventListener("click", async () => {
    await fetch("/session/end", { method: "POST", headers: { "x-fleet-console": "1" } });
    signedOut({ message: "signed out" });
  });
  try {
    const me = await api("/api/me");
    document.getElementById("who").textContent = `${me.sub} @ ${me.tenant}`;
    document.getElementById("sign-out").hidden = false;
  } catch {
    return; // the banner says how to sign in
  }
  window.addEventListener("hashchange", route);
  await route();
}

start();
