// gpuctl dashboard: renders /api/view and /api/run/ID. Everything the instances wrote is set as
// text (textContent, SVG text nodes), never as markup; the server's CSP allows this file only.
"use strict";

// The token is in the URL's fragment (#token=...): never sent to a server; sent by this script as
// a header (and as ?token= on the event stream, which takes no header).
const token = new URLSearchParams(location.hash.slice(1)).get("token") || "";
let csrf = ""; // from the view (an answer only the token gets)
let view = null;
let asked = 0; // refresh answers older than the newest asked are dropped
let shownRows = ""; // what the tables were last built from: rebuilt only when it changes
let selected = null; // the run whose detail is shown
let detail = null;
let allRuns = false; // the newest SHOWN runs, or all of them
const SHOWN = 100;

const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function usd(x) {
  if (x === null || x === undefined) return "-";
  return "$" + (Math.abs(x) < 10 ? x.toFixed(4) : x.toFixed(2));
}

function duration(s) {
  if (s === null || s === undefined) return "-";
  s = Math.max(0, Math.round(s));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  return h ? `${h}h${String(m).padStart(2, "0")}m` : m ? `${m}m${String(sec).padStart(2, "0")}s` : `${sec}s`;
}

function metrics(m) {
  return Object.entries(m || {}).map(([k, v]) => `${k}=${typeof v === "number" ? +v.toPrecision(4) : v}`).join(" ");
}

function table(node, head, rows) {
  node.replaceChildren();
  const tr = el("tr");
  head.forEach((h) => tr.appendChild(el("th", h)));
  node.appendChild(tr);
  rows.forEach((cells) => {
    const row = el("tr");
    cells.forEach((c) => row.appendChild(c instanceof Node ? wrap(c) : el("td", c)));
    node.appendChild(row);
  });
  return node;
}

function wrap(child) {
  const td = el("td");
  td.appendChild(child);
  return td;
}

function api(path, options) {
  const opts = Object.assign({credentials: "omit"}, options || {});
  opts.headers = Object.assign({"Authorization": "Bearer " + token}, opts.headers || {});
  return fetch(path, opts);
}

let bannerFromLook = false; // a look's error goes when a look succeeds; an act's answer stays

function banner(ok, message, hint, fromLook) {
  const b = $("banner");
  bannerFromLook = !!fromLook;
  b.replaceChildren();
  b.className = ok ? "ok" : "error";
  b.appendChild(el("div", ok ? message : "Error: " + message));
  if (hint) b.appendChild(el("div", "Hint: " + hint));
  b.hidden = false;
}

async function act(name, target) {
  let res;
  try {
    const q = await api(`/api/question?act=${encodeURIComponent(name)}&target=${encodeURIComponent(target)}`);
    const question = q.ok ? (await q.json()).question : `${name} ${target}?`;
    if (!window.confirm(question)) return;
    const resp = await api("/api/" + name, {
      method: "POST", headers: {"Content-Type": "application/json", "X-CSRF-Token": csrf},
      body: JSON.stringify({target: target}),
    });
    try { res = await resp.json(); } catch (e) { res = {ok: false, message: `the server answered ${resp.status}`}; }
  } catch (e) {
    res = {ok: false, message: "the dashboard does not answer", hint: "Is `gpuctl dashboard` still running?"};
  }
  banner(res.ok, res.message, res.hint);
  refresh();
}

function button(label, onclick, cls) {
  const b = el("button", label, cls);
  b.addEventListener("click", (ev) => { ev.stopPropagation(); onclick(); });
  return b;
}

function countdowns(guard) {
  if (!guard) return "-";
  if (guard.error) return "watchdog not reachable";
  if (guard.fired) return `FIRED: ${guard.fired.reason} -> ${guard.fired.action}`;
  if (guard.watchdog_alive === false) return "NO WATCHDOG";
  const now = Date.now() / 1000;
  const parts = Object.entries(guard.fires_at || {}).filter(([, t]) => t).sort((a, b) => a[1] - b[1])
    .map(([k, t]) => `${k} in ${duration(t - now)}`);
  if (guard.budget_usd > 0) parts.push(`budget left ${usd(guard.budget_usd - (guard.spent_usd || 0))}`);
  return parts.join(", ") || "none counting";
}

function tickCountdowns() {
  document.querySelectorAll("td[data-guard]").forEach((td) => {
    const c = view.clusters.find((x) => String(x.id) === td.dataset.guard);
    if (c) td.textContent = countdowns(c.guard);
  });
}

function renderClusters() {
  const up = view.clusters.filter((c) => c.state === "up");
  const down = view.clusters.filter((c) => c.state !== "up");
  const machine = (c) => {
    const m = view.machines[String(c.id)] || {};
    return (m.instance_type ? `${m.instance_type} ${m.market || ""}` : "-") + (m.nodes > 1 ? ` x${m.nodes}` : "");
  };
  const node = table($("clusters"), ["cluster", "provider", "machine", "state", "$/h", "uptime", "$ so far", "guards", ""],
    up.map((c) => [c.name + (c.is_default ? " *" : ""), c.provider, machine(c), c.state, usd(c.usd_per_hour), duration(c.uptime_s),
                   usd(c.usd), countdowns(c.guard), button("Release", () => act("release", c.name), "danger")]));
  Array.from(node.querySelectorAll("tr")).slice(1).forEach((tr, i) => { tr.children[7].dataset.guard = String(up[i].id); });
  table($("released"), ["cluster", "provider", "machine", "uptime", "$", "note"],
    down.map((c) => [c.name, c.provider, machine(c), duration(c.uptime_s), usd(c.usd), c.note || ""]));
  const hidden = view.hidden_clusters ? ` (and ${view.hidden_clusters} older: gpuctl status --all)` : "";
  $("released-summary").textContent = `Released: ${down.length}${hidden}`;
}

function renderRuns() {
  const newest = view.runs.slice().reverse();
  const shown = allRuns ? newest : newest.slice(0, SHOWN);
  const node = table($("runs"), ["run", "cluster", "state", "epoch", "last metrics", "ex/s", "$ spent", "$ projected", ""],
    shown.map((r) => {
      const s = r.status;
      const live = s.state === "running" || s.state === "queued" || s.state === "starting";
      return [s.run_id, s.cluster, s.state + (s.exit_code !== null && s.state === "failed" ? ` (${s.exit_code})` : ""),
              `${s.epoch}/${s.epochs_planned || "?"}`, metrics(s.metrics),
              r.examples_per_s ? r.examples_per_s.toFixed(1) : "-", usd(r.spent_usd), usd(r.projected_total_usd),
              live ? button("Stop", () => act("stop", s.run_id), "danger") : ""];
    }));
  Array.from(node.querySelectorAll("tr")).slice(1).forEach((tr, i) => {
    const id = shown[i].status.run_id;
    tr.className = id === selected ? "selected clickable" : "clickable";
    tr.dataset.run = id;
    tr.addEventListener("click", () => select(id));
  });
  const more = $("more-runs");
  more.hidden = newest.length <= SHOWN;
  more.textContent = allRuns ? `Show the newest ${SHOWN} runs` : `Show all ${newest.length} runs`;
}

function renderSpend() {
  const s = view.spend;
  const box = $("spend");
  box.replaceChildren();
  [["today", s.today_usd], ["this week", s.week_usd], ["this month", s.month_usd], ["all runs and clusters", view.total_usd]]
    .forEach(([label, v]) => {
      const card = el("div", null, "card");
      card.appendChild(el("div", usd(v), "figure"));
      card.appendChild(el("div", label, "muted"));
      box.appendChild(card);
    });
}

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  Object.entries(attrs).forEach(([k, v]) => e.setAttribute(k, String(v)));
  if (text !== undefined) e.textContent = String(text);
  return e;
}

// A line chart: series of {points: [[x, y]...], cls, label}; axes from 0.
function chart(node, series, xlabel, ylabel) {
  node.replaceChildren();
  const W = 640, H = 240, L = 60, B = 30, T = 24, R = 10;
  const xs = series.flatMap((s) => s.points.map((p) => p[0])), ys = series.flatMap((s) => s.points.map((p) => p[1]));
  const xmax = Math.max(1e-9, ...xs), ymax = Math.max(1e-9, ...ys);
  const X = (x) => L + (W - L - R) * x / xmax, Y = (y) => H - B - (H - B - T) * y / ymax;
  node.appendChild(svg("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"}));
  node.appendChild(svg("line", {x1: L, y1: T, x2: L, y2: H - B, class: "axis"}));
  node.appendChild(svg("text", {x: L - 4, y: T + 10, "text-anchor": "end", class: "tick"}, usd(ymax)));
  node.appendChild(svg("text", {x: W - R, y: H - 8, "text-anchor": "end", class: "tick"}, `${+xmax.toPrecision(3)} ${xlabel}`));
  node.appendChild(svg("text", {x: L - 4, y: H - B, "text-anchor": "end", class: "tick"}, ylabel));
  series.forEach((s) => {
    if (!s.points.length) return;
    node.appendChild(svg("polyline", {points: s.points.map((p) => `${X(p[0])},${Y(p[1])}`).join(" "), class: s.cls}));
    s.points.forEach((p) => node.appendChild(svg("circle", {cx: X(p[0]), cy: Y(p[1]), r: 2.5, class: s.cls})));
    const last = s.points[s.points.length - 1];
    if (s.label) node.appendChild(svg("text", {x: X(last[0]) - 4, y: Y(last[1]) - 6, "text-anchor": "end", class: "label"}, s.label));
  });
}

function renderDetail() {
  const section = $("run-section");
  if (!detail) { section.hidden = true; return; }
  section.hidden = false;
  const s = detail.status, c = detail.cost;
  $("run-title").textContent = `Run ${s.run_id} on ${s.cluster}: ${s.state}, epoch ${s.epoch}/${s.epochs_planned || "?"}`;
  const facts = [`elapsed ${duration(s.elapsed_s)}`, `${usd(s.usd_per_hour)}/h`];
  if (c) facts.push(`spent ${usd(c.spent_usd)}`, `projected ${usd(c.projected_total_usd)}`);
  if (s.code) facts.push(`code ${s.code.hash || ""}`);
  $("run-facts").textContent = facts.join(" · ");
  const epochs = c ? c.epochs : [];
  const done = [[0, 0], ...epochs.map((e) => [e.epoch, e.cumulative_usd])];
  const series = [{points: done, cls: "spent", label: "spent"}];
  if (c && c.projected_total_usd !== null && c.epochs_planned && epochs.length) {
    const last = epochs[epochs.length - 1];
    series.push({points: [[last.epoch, last.cumulative_usd], [c.epochs_planned, c.projected_total_usd]], cls: "projected",
                 label: `projected ${usd(c.projected_total_usd)}`});
  }
  chart($("run-chart"), series, "epochs", "$0");
  table($("run-epochs"), ["epoch", "time", "ex/s", "GPU %", "$ epoch", "$ cumulative", "metrics"],
    epochs.map((e) => [e.epoch, duration(e.seconds), e.examples_per_s ? e.examples_per_s.toFixed(1) : "-",
                       e.gpu_util_percent === null ? "-" : e.gpu_util_percent.toFixed(0), usd(e.epoch_cost_usd),
                       usd(e.cumulative_usd), metrics(e.metrics)]));
  const segs = (c && c.segments.length > 1) ? c.segments : [];
  table($("run-segments"), segs.length ? ["segment", "instance", "market", "time", "$", "ended", "lost"] : [],
    segs.map((g, i) => [i + 1, g.instance_id, g.market, duration(g.seconds), usd(g.usd), g.end || "-",
                        g.lost_s ? `${duration(g.lost_s)} (${usd(g.lost_usd)})` : "-"]));
  $("run-log").textContent = detail.log_tail || "(no log lines yet)";
}

function renderPlan() {
  const p = view.plan;
  $("plan-section").hidden = !p;
  if (!p) return;
  $("plan-title").textContent = `Plan: ${p.project}, ${p.epochs} epochs (probes cost ${usd(p.plan_usd)})`;
  table($("plan"), ["#", "machine", "outcome", "$/h", "steady epoch", "projected time", "projected $"],
    p.rows.map((r) => [r.rank || "-", r.label, r.outcome + (r.problem ? `: ${r.problem}` : ""), usd(r.usd_per_hour),
                       duration(r.steady_epoch_s), duration(r.projected_s), usd(r.projected_usd)]));
  chart($("plan-chart"), p.rows.filter((r) => r.projected_s && r.projected_usd !== null)
    .map((r, i) => ({points: [[0, 0], [r.projected_s / 3600, r.projected_usd]], cls: `plan${i % 4}`, label: r.label})), "hours", "$0");
  const notes = $("plan-notes");
  notes.replaceChildren(...p.notes.map((n) => el("li", n)));
}

function render(data) {
  if (data.error) banner(false, data.error.message, data.error.hint, true);
  else if (bannerFromLook) $("banner").hidden = true;
  if (!data.view) return;
  view = data.view;
  csrf = data.csrf;
  // Tables are built again only when what they show changed (a Stop button under the cursor, or
  // a run id being selected, is not replaced by an identical one every second).
  const rows = JSON.stringify([view.clusters, view.machines, view.runs, view.spend, view.total_usd, view.plan, selected, allRuns]);
  if (rows !== shownRows) {
    shownRows = rows;
    renderSpend();
    renderClusters();
    renderRuns();
    renderPlan();
    $("notes").replaceChildren(...view.notes.map((n) => el("li", n)));
  }
  $("live").textContent = `looked at ${new Date(view.generated_at * 1000).toLocaleTimeString()} · v${data.version}`;
  document.body.dataset.version = data.version;
}

function select(id) {
  selected = id;
  shownRows = "";
  refresh();
}

async function refresh() {
  const mine = ++asked;
  const query = selected ? "?run=" + encodeURIComponent(selected) : "";
  let data;
  try {
    const resp = await api("/api/view" + query);
    if (!resp.ok) {
      banner(false, `the dashboard answered ${resp.status}`, "Open the URL `gpuctl dashboard` printed (its #token=... part too).", true);
      return;
    }
    data = await resp.json();
  } catch (e) {
    banner(false, "the dashboard does not answer", "Is `gpuctl dashboard` still running?", true);
    return;
  }
  if (mine !== asked) return; // a newer answer is on its way
  if (selected && data.view && !data.run) { selected = null; return refresh(); } // the run was removed
  if (!selected && data.run) selected = data.run.status.run_id; // the server's pick: the newest running run
  render(data);
  detail = data.run;
  renderDetail();
}

function live() {
  const events = new EventSource("/api/events?token=" + encodeURIComponent(token));
  events.addEventListener("changed", () => refresh());
  events.onerror = () => { $("live").textContent = "disconnected: is `gpuctl dashboard` still running?"; };
}

$("more-runs").addEventListener("click", () => { allRuns = !allRuns; shownRows = ""; if (view) renderRuns(); });
setInterval(() => { if (view) tickCountdowns(); }, 1000); // the guards' countdowns, in place
refresh().then(live);
