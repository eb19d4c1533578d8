// fleetwarden dashboard: plain JavaScript and SVG, no library, no build step.
//
// Everything shown comes from one EventSource on /admin/events (see admin/dashboard.py):
// `hello` (the whole view and the last hour of history), then `snapshot` after each controller
// tick, `transition` for each state change, `refit`, and `bye` when the fleet stops. Nothing is
// polled; a one-second local timer only ages what was received. Text from the server is only
// ever set as textContent (an engine's error message is data, never markup).
"use strict";

const STATES = ["HEALTHY", "SUSPECT", "STALE", "SLEEPING", "DEAD", "RESTARTING", "RETIRED"];
// Keep in sync with the --healthy ... --retired colours in dashboard.css.
const STATE_COLOURS = {
  HEALTHY: "#2e9e44", SUSPECT: "#d4a000", STALE: "#7c5cd6", SLEEPING: "#3b82c4",
  DEAD: "#d93025", RESTARTING: "#ef7d00", RETIRED: "#6b7280",
};
const ABSENT = new Set(["DEAD", "RESTARTING", "RETIRED"]);
const SVG = "http://www.w3.org/2000/svg";
const RECOVER_MS = 3000;  // after a refused stream (e.g. a 401), look again this much later
// Cards (and timeline rows) on one page: a fleet of hundreds of shards is shown a page at a
// time, so the page stays as quick with a thousand shards as with a handful; the pager says
// how many are in each state across every page.
const PAGE_SIZE = 48;

const model = {
  view: null,          // the last snapshot: fleet, shards, refits, traffic, at, seq
  transitions: [],     // {seq, shard, from, to, event, cause, at}, oldest first
  traffic: [],         // the router's cumulative counters, one point per few seconds
  lastSeq: 0,
  startedAt: 0,
  windowS: 3600,
  offset: 0,           // server clock minus this browser's clock, in seconds
  stopped: false,
  page: 0,             // which PAGE_SIZE shards the cards and the timeline show
};

const $ = (id) => document.getElementById(id);

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

const now = () => Date.now() / 1000 + model.offset;

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}

function duration(s) {
  if (s === null || s === undefined || !isFinite(s)) return "—";
  s = Math.max(0, s);
  if (s < 60) return `${Math.floor(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} m ${String(Math.floor(s % 60)).padStart(2, "0")} s`;
  return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} m`;
}

function num(x, digits) {
  if (x === null || x === undefined) return "—";
  return Number(x).toFixed(digits || 0);
}

// ------------------------------------------------------------------ the stream

let source = null;

function connect() {
  if (source) source.close();
  source = new EventSource("/admin/events");
  source.addEventListener("hello", (e) => { applyHello(JSON.parse(e.data)); setLink("live"); });
  source.addEventListener("snapshot", (e) => applySnapshot(JSON.parse(e.data)));
  source.addEventListener("transition", (e) => applyTransition(JSON.parse(e.data)));
  source.addEventListener("refit", (e) => {
    const r = JSON.parse(e.data);
    notice(`refit v${r.version}: ${r.phase}`);
  });
  source.addEventListener("bye", () => { model.stopped = true; setLink("stopped"); });
  source.onerror = () => {
    if (source.readyState === EventSource.CLOSED) {
      // Refused outright (not a dropped connection, which EventSource retries by itself).
      setLink("reconnecting");
      setTimeout(recover, RECOVER_MS);
    } else {
      setLink(model.stopped ? "stopped" : "reconnecting");
    }
  };
}

async function recover() {
  try {
    const resp = await fetch("/admin/status", { credentials: "same-origin", cache: "no-store" });
    if (resp.status === 401) { location.assign("/"); return; }  // signed out: the sign-in form
  } catch (err) { /* the fleet is not back yet: try the stream again anyway */ }
  connect();
}

function setLink(state) {
  const link = $("link");
  link.dataset.link = state;
  link.textContent = { live: "live", reconnecting: "reconnecting…",
                       stopped: "fleet stopped; reconnecting…" }[state] || state;
}

function applyHello(d) {
  model.stopped = false;
  model.windowS = d.window_s;
  model.startedAt = d.started_at;
  model.traffic = d.traffic;
  model.transitions = d.transitions;
  model.lastSeq = d.seq;
  applySnapshot(d, true);
}

function applySnapshot(d, fromHello) {
  model.offset = d.at - Date.now() / 1000;
  model.view = d;
  if (!fromHello && d.traffic) {
    const last = model.traffic[model.traffic.length - 1];
    if (!last || d.traffic.at > last.at) model.traffic.push(d.traffic);
  }
  prune();
  renderHeader();
  renderCards();
  renderRefits();
  renderKeys();
  scheduleCharts();
}

function applyTransition(t) {
  if (t.seq <= model.lastSeq) return;  // already in the hello this stream began with
  model.lastSeq = t.seq;
  model.transitions.push({ seq: t.seq, shard: t.shard, from: t.from, to: t.to,
                           event: t.event, cause: t.cause, at: t.at });
  const shard = model.view && model.view.shards[t.shard];
  if (shard) {
    // The new record at once; in-flight and the watchdog's sample come with the next snapshot.
    Object.assign(shard, t.record);
    shard.restart_budget_left = Math.max(
      0, model.view.max_restart_attempts - t.record.restart_attempts);
    renderCard(shard);
  }
  scheduleCharts();
}

function prune() {
  const since = now() - model.windowS;
  while (model.transitions.length && model.transitions[0].at < since) model.transitions.shift();
  while (model.traffic.length > 2 && model.traffic[1].at < since) model.traffic.shift();
}

// ------------------------------------------------------------------ header

function renderHeader() {
  const f = model.view.fleet;
  const status = $("status");
  status.dataset.status = f.status;
  status.textContent = f.status;
  $("detail").textContent = f.detail;
  const rs = f.restarts;
  $("facts").textContent = [
    `tick ${f.tick}`, `up ${duration(f.uptime_s)}`, `weights ${f.weights}`,
    `restarts ${rs.completed} done, ${rs.failed} failed, ${rs.in_progress} in progress`,
    `router ${f.router_url}`,
  ].join(" · ");
  document.title = `fleetwarden · ${f.status}`;
  renderWork(model.view.work);
}

function ms(s) {
  return s === null || s === undefined ? "—" : `${num(s * 1000, s < 0.01 ? 2 : 0)} ms`;
}

function renderWork(w) {  // the fleet's own work (workmeter.py): what nears its limit
  if (!w) return;
  $("work").textContent = [
    `tick p50 ${ms(w.tick_s.p50)} p99 ${ms(w.tick_s.p99)}`,
    `read round p99 ${ms(w.read_round_s.p99)}`,
    `reads/s ${w.reads_per_s === null ? "—" : num(w.reads_per_s, 0)}`,
    `evidence→decision p99 ${ms(w.evidence_to_decision_s.p99)}`,
    `push p99 ${ms(w.push_s.p99)} of ${w.push_size.max === null ? "—" : w.push_size.max}`,
  ].join(" · ");
}

// ------------------------------------------------------------------ pages of shards

function pages() {
  return Math.max(1, Math.ceil(model.view.shards.length / PAGE_SIZE));
}

function pageShards() {
  model.page = Math.min(model.page, pages() - 1);
  const from = model.page * PAGE_SIZE;
  return model.view.shards.slice(from, from + PAGE_SIZE);
}

function renderPager() {
  const shards = model.view.shards;
  const pager = $("pager");
  pager.hidden = shards.length <= PAGE_SIZE;
  if (pager.hidden) return;
  const from = model.page * PAGE_SIZE;
  $("page-of").textContent =
    `shards ${from}–${Math.min(shards.length, from + PAGE_SIZE) - 1} of ${shards.length}`;
  $("page-prev").disabled = model.page === 0;
  $("page-next").disabled = model.page >= pages() - 1;
  const counts = {};
  for (const s of shards) counts[s.state] = (counts[s.state] || 0) + 1;
  $("page-counts").textContent = STATES.filter((st) => counts[st])
    .map((st) => `${counts[st]} ${st}`).join(" · ");
}

function turnPage(by) {
  model.page = Math.max(0, Math.min(pages() - 1, model.page + by));
  renderCards();
  scheduleCharts();
}

// ------------------------------------------------------------------ cards

const FIELDS = [
  ["age", "incarnation"], ["in_flight", "in flight"], ["batch", "running / waiting"],
  ["tokens", "tokens/s"], ["cache", "prefix-cache hits"], ["verdict", "watchdog"],
  ["streaks", "streaks"],
  ["budget", "restarts left"], ["weights", "weight version"], ["error", "last error"],
  ["config", "config fault"],
];

function renderCards() {
  const shards = pageShards();
  const box = $("shards");
  const key = shards.map((s) => s.index).join(",");
  if (box.dataset.shown !== key) {
    box.replaceChildren(...shards.map(makeCard));
    box.dataset.shown = key;
  }
  shards.forEach(renderCard);
  renderPager();
}

function makeCard(s) {
  const card = el("article", { class: "card", "data-shard": s.index });
  const head = el("header");
  head.append(el("h2", {}, `shard ${s.index}`), el("span", { class: "state" }));
  const dl = el("dl");
  for (const [key, label] of FIELDS) {
    dl.append(el("dt", {}, label), el("dd", { "data-field": key }));
  }
  const actions = el("div", { class: "actions" });
  for (const action of ["restart", "retire"]) {
    actions.append(el("button", { type: "button", "data-action": action }, action));
  }
  actions.append(el("span", { class: "sep" }, "chaos"));
  for (const action of ["wedge", "unwedge", "crash"]) {
    actions.append(el("button", { type: "button", "data-action": action }, action));
  }
  card.append(head, el("div", { class: "url mono" }), dl, el("div", { class: "trail" }), actions);
  return card;
}

function field(card, key, text, cls) {
  const dd = card.querySelector(`dd[data-field="${key}"]`);
  dd.textContent = text;
  dd.className = cls || "";
}

function renderCard(s) {
  const card = document.querySelector(`#shards .card[data-shard="${s.index}"]`);
  if (!card) return;
  card.dataset.state = s.state;
  card.querySelector(".state").textContent = s.state;
  card.querySelector(".url").textContent = s.base_url;
  const absent = ABSENT.has(s.state);
  // The watchdog's last report, if it is about this shard's current process.
  const w = s.watchdog && s.watchdog.url === s.base_url && !absent ? s.watchdog : null;
  const started = s.incarnation_started_at
    || (w && w.sample && w.sample.start_time) || null;
  card.dataset.startedAt = started || "";
  field(card, "age", started && !absent ? duration(now() - started) : "—");
  field(card, "in_flight", num(s.in_flight));
  field(card, "batch", w && w.sample ? `${num(w.sample.running)} / ${num(w.sample.waiting)}` : "—");
  field(card, "tokens", w ? num(w.tokens_per_s, 1) : "—");
  // The engine's own prefix-cache hit rate since it started (vLLM's counters): the actual
  // beside the cache-aware router's prediction (its /metrics, fleetwarden_router_cache_*).
  const hits = w ? w.prefix_cache_hit_rate : null;
  const guess = s.cache_predicted_hit_rate;
  const pct = (x) => (x === null || x === undefined ? "—" : `${(100 * x).toFixed(1)} %`);
  field(card, "cache", guess === null || guess === undefined
    ? pct(hits) : `${pct(hits)} (predicted ${pct(guess)})`);
  field(card, "verdict", w ? String(w.verdict) : "—");
  field(card, "streaks",
        `probes ✗${s.consecutive_probe_failures} ✓${s.consecutive_probe_successes}` +
        ` · requests ✗${s.consecutive_reported_failures}`);
  field(card, "budget", `${s.restart_budget_left} of ${model.view.max_restart_attempts}`);
  field(card, "weights", `v${s.weight_version}`);
  field(card, "error", s.last_error || "—", s.last_error ? "error" : "");
  // A fault of fleetwarden's own configuration (a key the engine wants): never held against
  // the engine, so no state shows it; shown here instead.
  const faults = s.config_faults || [];
  field(card, "config", faults.length ? faults.join("\n") : "—", faults.length ? "error" : "");
  const trail = card.querySelector(".trail");
  trail.replaceChildren(...model.transitions.filter((t) => t.shard === s.index).slice(-8)
    .map((t) => el("span", { "data-state": t.to, "data-tip": tipFor(t) }, t.to)));
  for (const button of card.querySelectorAll("button[data-action]")) {
    const a = button.dataset.action;
    button.disabled = s.state === "RETIRED"
      || (["wedge", "unwedge", "crash"].includes(a) && absent);
  }
}

function tipFor(t) {
  return `${clock(t.at)}  shard ${t.shard}: ${t.from} → ${t.to}\n${t.cause || t.event}`;
}

function tick() {  // ages only; nothing is fetched
  for (const card of document.querySelectorAll("#shards .card")) {
    const started = Number(card.dataset.startedAt);
    if (started && !ABSENT.has(card.dataset.state)) {
      field(card, "age", duration(now() - started));
    }
  }
}

// ------------------------------------------------------------------ charts

let chartsPending = false;

function scheduleCharts() {
  if (chartsPending) return;
  chartsPending = true;
  requestAnimationFrame(() => {
    chartsPending = false;
    if (!model.view) return;
    renderTimeline();
    renderTraffic();
    renderChanges();
  });
}

function span() {
  const end = now();
  const start = Math.max(end - model.windowS, model.startedAt);
  return { start, end: Math.max(end, start + 1) };
}

const LABEL_W = 74;

function xScale(width, s) {
  return (t) => LABEL_W + ((t - s.start) / (s.end - s.start)) * (width - LABEL_W - 8);
}

function timeAxis(g, width, height, s, x) {
  const total = s.end - s.start;
  const steps = [5, 15, 30, 60, 120, 300, 600, 900, 1800];
  const step = steps.find((st) => total / st <= 8) || 1800;
  for (let t = Math.ceil(s.start / step) * step; t <= s.end; t += step) {
    const px = x(t);
    g.append(svg("line", { x1: px, x2: px, y1: 14, y2: height, class: "grid" }));
    const label = svg("text", { x: px, y: 10, "text-anchor": "middle" });
    label.textContent = clock(t).slice(0, step < 60 ? 8 : 5);
    g.append(label);
  }
}

function bandsFor(index, state, s) {
  // The shard's states over the window: from each transition to the next, the last one to now.
  const ts = model.transitions.filter((t) => t.shard === index && t.at >= s.start);
  const bands = [];
  let from = s.start;
  let current = ts.length ? ts[0].from : state;
  let cause = "since before this window";
  for (const t of ts) {
    bands.push({ state: current, from, to: t.at, cause });
    from = t.at;
    current = t.to;
    cause = t.cause || t.event;
  }
  bands.push({ state: current, from, to: s.end, cause });
  return { bands, marks: ts };
}

function renderTimeline() {
  const box = $("timeline");
  const shards = pageShards();
  const width = Math.max(600, box.clientWidth);
  const rowH = 20;
  const gap = 8;
  const top = 22;
  const height = top + shards.length * (rowH + gap);
  const s = span();
  const x = xScale(width, s);
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, height, role: "img",
                            "aria-label": "shard states over time" });
  timeAxis(root, width, height, s, x);
  shards.forEach((shard, row) => {
    const y = top + row * (rowH + gap);
    const label = svg("text", { x: 0, y: y + 14, class: "row-label" });
    label.textContent = `shard ${shard.index}`;
    root.append(label);
    const { bands, marks } = bandsFor(shard.index, shard.state, s);
    // Wide bands first, so a state that lasted a moment is drawn on top and stays visible.
    const drawn = bands.map((b) => ({ b, x0: x(b.from), w: Math.max(4, x(b.to) - x(b.from)) }))
      .sort((p, q) => q.w - p.w);
    for (const { b, x0, w } of drawn) {
      root.append(svg("rect", {
        x: x0, y, width: w, height: rowH, fill: STATE_COLOURS[b.state] || "#999", class: "band",
        "data-shard": shard.index, "data-state": b.state,
        "data-tip": `shard ${shard.index}: ${b.state}\n${clock(b.from)} – ${clock(b.to)}` +
                    ` (${duration(b.to - b.from)})\n${b.cause}`,
      }));
    }
    for (const t of marks) {  // a tick above the row where it changed: never over a band
      const px = x(t.at);
      root.append(svg("line", {
        x1: px, x2: px, y1: y - 5, y2: y - 1, class: "mark", stroke: STATE_COLOURS[t.to],
        "data-shard": shard.index, "data-to": t.to, "data-tip": tipFor(t),
      }));
    }
  });
  box.replaceChildren(root);
  $("window").textContent = `${clock(s.start)} – ${clock(s.end)}` +
    (s.end - s.start < model.windowS ? " (since the fleet started)" : " (the last hour)");
  const legend = $("legend");
  if (!legend.children.length) {
    legend.replaceChildren(...STATES.map((st) => el("span", { "data-state": st }, st)));
  }
}

function rates() {
  const out = [];
  for (let i = 1; i < model.traffic.length; i++) {
    const a = model.traffic[i - 1];
    const b = model.traffic[i];
    const dt = b.at - a.at;
    if (dt <= 0) continue;
    out.push({ at: b.at, requests: Math.max(0, b.requests - a.requests) / dt,
               errors: Math.max(0, b.errors - a.errors) / dt });
  }
  return out;
}

function renderTraffic() {
  const box = $("traffic");
  const width = Math.max(600, box.clientWidth);
  const height = 120;
  const top = 18;
  const bottom = height - 4;
  const s = span();
  const x = xScale(width, s);
  const rs = rates().filter((r) => r.at >= s.start);
  const peak = Math.max(1, ...rs.map((r) => r.requests), ...rs.map((r) => r.errors));
  const y = (v) => bottom - (v / (peak * 1.1)) * (bottom - top);
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, height, role: "img",
                            "aria-label": "router request and error rates" });
  timeAxis(root, width, height, s, x);
  for (const v of [0, peak / 2, peak]) {
    root.append(svg("line", { x1: LABEL_W, x2: width - 8, y1: y(v), y2: y(v), class: "grid" }));
    const label = svg("text", { x: LABEL_W - 6, y: y(v) + 4, "text-anchor": "end" });
    label.textContent = `${num(v, v < 10 ? 1 : 0)}/s`;
    root.append(label);
  }
  for (const [key, colour] of [["requests", "#2563eb"], ["errors", "#d93025"]]) {
    if (!rs.length) break;
    root.append(svg("polyline", {
      points: rs.map((r) => `${x(r.at).toFixed(1)},${y(r[key]).toFixed(1)}`).join(" "),
      stroke: colour, class: "rate", "data-series": key,
    }));
  }
  box.replaceChildren(root);
  const last = rs[rs.length - 1];
  const p = model.traffic[model.traffic.length - 1];
  $("traffic-now").textContent = [
    `requests ${last ? num(last.requests, 1) : "—"}/s`,
    `errors ${last ? num(last.errors, 2) : "—"}/s`,
    p ? `${p.requests} requests, ${p.errors} errors, ${p.backend_failures} backend failures, ` +
        `${p.retries} retries, ${p.rescues} rescued, ${p.hedges} hedged` : "",
  ].filter(Boolean).join(" · ");
}

function renderChanges() {
  const list = $("changes");
  const latest = model.transitions.slice(-40).reverse();
  if (!latest.length) {
    list.replaceChildren(el("li", { class: "empty" }, "no state change in the window"));
    return;
  }
  list.replaceChildren(...latest.map((t) => {
    const li = el("li", { "data-shard": t.shard, "data-to": t.to });
    li.append(el("span", { class: "when" }, clock(t.at)), `shard ${t.shard}: ${t.from} → `,
              el("span", { class: "to", "data-state": t.to }, t.to), " ",
              el("span", { class: "cause" }, t.cause || t.event));
    return li;
  }));
}

// ------------------------------------------------------------------ refits

function renderRefits() {
  const r = model.view.refits;
  const lease = r.lease;
  $("lease").textContent = lease
    ? `v${lease.version} in progress: shards ${lease.participants.join(", ")}; ` +
      `lease ends in ${duration(lease.deadline - now())}`
    : `weights v${r.current_version}`;
  const body = $("refits").tBodies[0];
  const rows = r.history.slice(-20).reverse().map((h) => {
    const tr = el("tr", { "data-outcome": h.outcome });
    const shards = h.participants.join(", ") +
      (h.condemned.length ? ` (condemned ${h.condemned.join(", ")})` : "");
    for (const text of [`v${h.version}`, h.outcome, clock(h.started_at),
                        h.ended_at ? duration(h.ended_at - h.started_at) : "—", shards,
                        h.detail || ""]) {
      tr.append(el("td", {}, text));
    }
    return tr;
  });
  if (!rows.length) {
    const tr = el("tr");
    tr.append(el("td", { colspan: 6, class: "empty" }, "no refit yet"));
    rows.push(tr);
  }
  body.replaceChildren(...rows);
}

// ------------------------------------------------------------------ client keys

function renderKeys() {  // the data port's keys ([router] keys_file): shown only when checked
  const router = model.view.fleet.router;
  const keys = router.keys || [];
  const refusals = router.key_refusals || {};
  const table = $("keys");
  const refused = Object.entries(refusals).filter(([, n]) => n > 0);
  table.hidden = !keys.length && !refused.length;
  if (table.hidden) return;
  $("key-refusals").textContent = refused.length
    ? "refused 401: " + refused.map(([why, n]) => `${n} ${why}`).join(", ") : "";
  table.tBodies[0].replaceChildren(...keys.map((k) => {
    const tr = el("tr", { "data-key": k.name });
    for (const text of [k.name, String(k.requests), String(k.prompt_tokens),
                        String(k.completion_tokens)]) {
      tr.append(el("td", {}, text));
    }
    return tr;
  }));
}

// ------------------------------------------------------------------ actions

const ACTIONS = {
  restart: {
    title: (i) => `Restart shard ${i}?`,
    text: (s) => `Its engine is stopped and a new one started, which spends one of its ` +
                 `${s.restart_budget_left} restarts left. It serves again once the new ` +
                 `process proves itself.`,
    path: (i) => `/admin/shards/${i}/restart`,
    body: () => ({ reason: "restart requested from the dashboard" }),
  },
  retire: {
    title: (i) => `Retire shard ${i}?`,
    text: () => "It stops serving for good: RETIRED is final, and its engine is stopped.",
    path: (i) => `/admin/shards/${i}/retire`,
    body: () => ({ reason: "retired from the dashboard" }),
  },
  wedge: {
    title: (i) => `Wedge shard ${i}?`,
    text: () => "Chaos: its engine stops finishing generations while /health stays 200 " +
                "(a simulated engine through its fault endpoint; a local vLLM engine by " +
                "SIGSTOP of its engine core). The watchdog should condemn it.",
    path: (i) => `/admin/shards/${i}/chaos`,
    body: () => ({ fault: "wedge" }),
  },
  unwedge: {
    title: (i) => `Unwedge shard ${i}?`,
    text: () => "Chaos: clears the wedge (SIGCONT for a local vLLM engine).",
    path: (i) => `/admin/shards/${i}/chaos`,
    body: () => ({ fault: "unwedge" }),
  },
  crash: {
    title: (i) => `Crash shard ${i}?`,
    text: () => "Chaos: its engine process dies now; its requests are re-sent elsewhere and " +
                "the supervisor starts a replacement.",
    path: (i) => `/admin/shards/${i}/chaos`,
    body: () => ({ fault: "crash" }),
  },
};

function ask(action, index) {
  const spec = ACTIONS[action];
  const shard = model.view.shards[index];
  const dialog = $("confirm");
  $("confirm-title").textContent = spec.title(index);
  $("confirm-text").textContent = spec.text(shard);
  $("confirm-ok").textContent = `${action} shard ${index}`;
  dialog.dataset.action = action;
  dialog.dataset.shard = index;
  dialog.returnValue = "";
  dialog.showModal();
}

$("confirm").addEventListener("close", () => {
  const dialog = $("confirm");
  if (dialog.returnValue === "ok") act(dialog.dataset.action, Number(dialog.dataset.shard));
});

async function act(action, index) {
  const spec = ACTIONS[action];
  try {
    const resp = await fetch(spec.path(index), {
      method: "POST", credentials: "same-origin", cache: "no-store",
      headers: { "Content-Type": "application/json" }, body: JSON.stringify(spec.body()),
    });
    if (resp.status === 401) { location.assign("/"); return; }
    const data = await resp.json();
    if (!resp.ok) {
      const why = (data.error && data.error.message) || data.reason || `state ${data.state}`;
      notice(`${action} shard ${index}: refused (${resp.status}): ${why}`, true);
      return;
    }
    notice(`shard ${index}: ` + (data.how || `${action} done; now ${data.state}`));
  } catch (err) {
    notice(`${action} shard ${index}: ${err}`, true);
  }
}

function notice(text, isError) {
  const box = $("notice");
  box.textContent = text;
  box.className = isError ? "error" : "";
  box.hidden = false;
}

// ------------------------------------------------------------------ tooltips

function tooltips() {
  const tip = $("tip");
  document.addEventListener("mousemove", (e) => {
    const target = e.target.closest ? e.target.closest("[data-tip]") : null;
    if (!target) { tip.hidden = true; return; }
    tip.textContent = target.dataset.tip;
    tip.hidden = false;
    const x = Math.min(e.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
    tip.style.left = `${Math.max(4, x)}px`;
    tip.style.top = `${e.clientY + 16}px`;
  });
}

// ------------------------------------------------------------------ start

document.addEventListener("click", (e) => {
  const button = e.target.closest("#shards button[data-action]");
  if (!button) return;
  ask(button.dataset.action, Number(button.closest(".card").dataset.shard));
});
$("page-prev").addEventListener("click", () => turnPage(-1));
$("page-next").addEventListener("click", () => turnPage(1));
window.addEventListener("resize", scheduleCharts);
tooltips();
setInterval(tick, 1000);
connect();
