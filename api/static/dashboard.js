// The Offpeak dashboard: polls /v1/dashboard with the tenant's key (or the admin key: every
// tenant's figures) and redraws. No framework;
// Chart.js (vendored, see README.md here) draws the load/throughput chart.
"use strict";

const params = new URLSearchParams(location.hash.slice(1));
const HOURS = Number(params.get("hours")) || 3;
const REFRESH_SECONDS = Number(params.get("refresh")) || 2;
const PALETTE = ["#2563eb", "#16a34a", "#9333ea", "#0891b2", "#ca8a04", "#db2777"];
const LOAD_PALETTE = ["#dc2626", "#ea580c", "#9f1239", "#78350f"];
const ENDED = new Set(["completed", "failed", "expired", "cancelled"]);
let chart = null;
let timer = null;

// The key comes from the URL fragment (never sent to the server) or the form, and is kept in
// this tab's sessionStorage; it is then dropped from the address bar.
if (params.get("key")) {
  sessionStorage.setItem("offpeak-key", params.get("key"));
  params.delete("key");
  history.replaceState(null, "", location.pathname + (params.toString() ? "#" + params : ""));
}

const $ = (id) => document.getElementById(id);

// Amounts come formatted by the server (offpeak.billing.format_usd, the CLI's function), so the
// page and the CLI print the same figure, never in scientific notation.
function money(shown) {
  return shown === null || shown === undefined || shown === "-" ? "–" : shown;
}

function num(x, digits = 0) {
  if (x === null || x === undefined) return "–";
  return Number(x).toLocaleString("en-US", { maximumFractionDigits: digits });
}

function clock(seconds, withSeconds) {
  const options = { hour: "2-digit", minute: "2-digit", hour12: false };
  if (withSeconds) options.second = "2-digit";
  return new Date(seconds * 1000).toLocaleTimeString("en-GB", options);
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const child of children) node.append(child);
  return node;
}

function showKeyForm(message) {
  clearTimeout(timer);
  $("content").hidden = true;
  $("alerts").hidden = true;
  $("key-form").hidden = false;
  $("state").textContent = "no key";
  $("error").hidden = !message;
  $("error").textContent = message || "";
}

function renderModels(models, windowSeconds) {
  const box = $("models");
  box.replaceChildren();
  if (!models.length) box.append(el("p", { class: "muted", textContent: "No model has work." }));
  for (const m of models) {
    const rows = [
      ["queued requests", num(m.queued_requests)],
      ["running requests", num(m.running_requests)],
      ["prompt tokens/s", num(m.prompt_tokens_per_second, 1)],
      ["completion tokens/s", num(m.completion_tokens_per_second, 1)],
      // A tenant's own engine time; the fleet's busy fraction only for the operator.
      m.busy_ratio === undefined
        ? ["engine time", num(m.engine_seconds, 1) + " s"]
        : ["engine busy", num(100 * m.busy_ratio, 0) + " %"],
      ["cost / 1M tokens", money(m.display.cost_per_million_tokens)],
    ];
    const dl = el("dl");
    for (const [k, v] of rows) dl.append(el("dt", { textContent: k }), el("dd", { textContent: v }));
    box.append(el("div", { class: "card", "data-model": m.model },
      el("h3", { textContent: m.model }), dl,
      el("p", { class: "muted", textContent: `last ${windowSeconds} s` })));
  }
}

function pct(fraction) {
  return fraction === null || fraction === undefined ? "–" : num(100 * fraction, 0) + " %";
}

function used(figure) {
  return `${num(figure.used)} / ${figure.limit === null ? "∞" : num(figure.limit)}`;
}

// The tenant's own figures: one card per model it has lines queued on, one for its share.
function renderMine(mine) {
  const box = $("mine");
  box.replaceChildren();
  const card = (title, rows, attrs = {}) => {
    const dl = el("dl");
    for (const [k, v] of rows) dl.append(el("dt", { textContent: k }), el("dd", { textContent: v }));
    box.append(el("div", { class: "card", ...attrs }, el("h3", { textContent: title }), dl));
  };
  for (const q of mine.queue) {
    card(q.model, [
      ["queued lines", num(q.queued_lines)],
      ["lines ahead", num(q.lines_ahead)],
      ["of them urgent", num(q.urgent_lines_ahead)],
    ], { "data-queue": q.model });
  }
  const s = mine.share;
  const limits = mine.limits;
  const tokens = Object.entries(limits.enqueued_tokens.by_model);
  card("share and limits", [
    ["engine share, last hour", pct(s.engine_share)],
    ["entitled (weight " + num(s.weight, 2) + ")", pct(s.entitled_share)],
    ["lines finished", num(s.lines_finished)],
    ...tokens.map(([m, n]) => ["enqueued tokens, " + m, used({
      used: n, limit: limits.enqueued_tokens.limit_by_model[m] ?? limits.enqueued_tokens.limit_per_model })]),
    ["batches in progress", used(limits.batches_in_progress)],
    ["stored bytes", used(limits.stored_bytes)],
  ], { "data-share": "" });
}

// The operator's table: every tenant's queue, share and quota use.
function renderTenants(tenants) {
  const body = $("tenants").querySelector("tbody");
  body.replaceChildren();
  for (const t of tenants) {
    const queued = t.queue.reduce((n, q) => n + q.queued_lines, 0);
    const ahead = t.queue.reduce((n, q) => n + q.lines_ahead, 0);
    body.append(el("tr", { "data-tenant": t.name },
      el("td", { title: t.id, textContent: t.name }),
      el("td", { class: "num", textContent: num(t.weight, 2) }),
      el("td", { class: "num", textContent: num(queued) }),
      el("td", { class: "num", textContent: num(ahead) }),
      el("td", { class: "num", textContent: pct(t.share.engine_share) }),
      el("td", { class: "num", textContent: pct(t.share.entitled_share) }),
      el("td", { class: "num", textContent: used(t.batches_in_progress) }),
      el("td", { class: "num", textContent: used(t.stored_bytes) })));
  }
}

// The tenant's billed usage per model and LoRA adapter (/v1/usage?group_by=adapter); shown
// once any line named an adapter.
function renderAdapters(adapters) {
  const body = $("adapters").querySelector("tbody");
  body.replaceChildren();
  $("adapters-section").hidden = !adapters.some((a) => a.adapter);
  for (const a of adapters) {
    body.append(el("tr", { "data-adapter": a.adapter || "" },
      el("td", { textContent: a.model }),
      el("td", { textContent: a.adapter || "(base model)" }),
      el("td", { class: "num", textContent: num(a.batches) }),
      el("td", { class: "num", textContent: num(a.requests) }),
      el("td", { class: "num", textContent: `${num(a.input_tokens)} / ${num(a.output_tokens)}` }),
      el("td", { class: "num", textContent: num(a.gpu_seconds, 1) }),
      el("td", { class: "num", textContent: money(a.display.cost) }),
      el("td", { class: "num", textContent: money(a.display.price) })));
  }
}

function renderAlerts(alerts) {
  const box = $("alerts");
  box.replaceChildren();
  box.hidden = !alerts.length;
  for (const a of alerts) {
    box.append(el("li", { class: "alert " + a.kind, "data-kind": a.kind,
      "data-model": a.model || "", textContent: a.message }));
  }
}

// What the prefix cache saved: prompt tokens computed against the least possible.
function prefixCacheTitle(usage) {
  const least = usage.min_prompt_tokens == null ? "known when the batch ends"
    : num(usage.min_prompt_tokens);
  return `prompt tokens computed ${num(usage.prompt_tokens_computed)} of `
    + `${num(usage.input_tokens)}; the least possible ${least}`;
}

function renderBatches(batches) {
  const body = $("batches").querySelector("tbody");
  body.replaceChildren();
  $("no-batches").hidden = batches.length > 0;
  for (const b of batches) {
    const counts = b.request_counts;
    const done = counts.completed + counts.failed;
    const pct = counts.total ? (100 * done) / counts.total : (ENDED.has(b.status) ? 100 : 0);
    const bar = el("div", { class: "bar " + b.status }, el("div"));
    bar.firstChild.style.width = pct.toFixed(1) + "%";
    const usage = b.usage;
    body.append(el("tr", { "data-batch": b.id, "data-done": done, "data-total": counts.total },
      el("td", { class: "id", title: b.id }, el("code", { textContent: b.id })),
      el("td", { class: "model", title: b.model || "", textContent: b.model || "–" }),
      // A paused batch keeps OpenAI's status; its paused_at (an extension) says it is paused.
      el("td", {}, b.paused_at != null && !ENDED.has(b.status)
        ? el("span", { class: "badge paused", title: "paused at " + clock(b.paused_at, true),
          textContent: b.status + " · paused" })
        : el("span", { class: "badge " + b.status, textContent: b.status })),
      el("td", {}, bar, el("span", { class: "pct", textContent: pct.toFixed(0) + "%" })),
      el("td", { class: "num",
        textContent: `${num(counts.completed)} ✓ ${num(counts.failed)} ✗ / ${num(counts.total)}` }),
      el("td", { class: "num",
        textContent: `${num(usage.input_tokens)} / ${num(usage.output_tokens)}` }),
      el("td", { class: "num prefix-cache", title: prefixCacheTitle(usage),
        textContent: usage.input_tokens
          ? (100 * usage.prefix_cache_hit_rate).toFixed(0) + "%" : "–" }),
      el("td", { class: "num", textContent: num(b.gpu_seconds, 2) }),
      el("td", { class: "num", textContent: money(b.display.cost) }),
      el("td", { class: "num", textContent: money(b.display.price) }),
      el("td", { class: "num", textContent: money(b.display.saving) }),
      el("td", { textContent: clock(b.created_at, true) }),
      // The estimate of the last line's finish while the batch runs; marked when it falls
      // past the window (completion_warning, an extension).
      el("td", ENDED.has(b.status) || !b.estimated_completion_at ? { textContent: "–" }
        : b.completion_warning
          ? { class: "late", title: b.completion_warning.message,
              textContent: clock(b.estimated_completion_at, true) + " ⚠" }
          : { textContent: clock(b.estimated_completion_at, true) })));
    const reason = whyItEnded(b);
    if (reason) {
      body.append(el("tr", { class: "reason", "data-reason-for": b.id },
        el("td", { colSpan: 13, textContent: reason })));
    }
  }
}

// A failed (or expired) batch's errors, under its row: the first one with its line, and how
// many more there are (`offpeak status ID` lists them).
function whyItEnded(b) {
  const errors = (b.errors && b.errors.data) || [];
  if (!errors.length || !["failed", "expired", "cancelled"].includes(b.status)) return "";
  const e = errors[0];
  const where = e.line === null || e.line === undefined ? "" : `line ${num(e.line)}: `;
  const more = errors.length > 1 ? ` (and ${num(errors.length - 1)} more)` : "";
  return `${b.status}: ${where}${e.message}${e.code ? ` (${e.code})` : ""}${more}`;
}

function renderChart(series) {
  const span = series.end - series.start;
  const datasets = [];
  let colour = 0;
  for (const [model, points] of Object.entries(series.completion_tokens_per_second)) {
    datasets.push({
      label: `${model}: batch output tokens/s`,
      yAxisID: "tokens",
      data: points.map(([x, y]) => ({ x, y })),
      borderColor: PALETTE[colour % PALETTE.length],
      backgroundColor: PALETTE[colour++ % PALETTE.length] + "33",
      fill: true,
      pointRadius: 0,
      borderWidth: 1.5,
      stepped: true,
    });
  }
  let loadColour = 0;
  for (const [source, points] of Object.entries(series.load)) {
    datasets.push({
      label: `real-time load (${source})`,
      yAxisID: "load",
      data: points.map(([x, y]) => ({ x, y })),
      borderColor: LOAD_PALETTE[loadColour++ % LOAD_PALETTE.length],
      borderDash: [6, 4],
      pointRadius: 0,
      borderWidth: 2,
    });
  }
  if (chart === null) {
    chart = new Chart($("chart"), {
      type: "line",
      data: { datasets },
      options: {
        animation: false,
        maintainAspectRatio: false,
        interaction: { mode: "nearest", axis: "x", intersect: false },
        scales: {
          x: { type: "linear", ticks: { maxTicksLimit: 12 } },
          tokens: { position: "left", beginAtZero: true,
                    title: { display: true, text: "batch output tokens/s" } },
          load: { position: "right", beginAtZero: true, suggestedMax: 1,
                  grid: { drawOnChartArea: false },
                  title: { display: true, text: "real-time load" } },
        },
        plugins: { legend: { position: "bottom" } },
      },
    });
  }
  chart.options.scales.x.min = series.start;
  chart.options.scales.x.max = series.end;
  chart.options.scales.x.ticks.callback = (v) => clock(v, span < 1800);
  chart.data.datasets = datasets;
  chart.update();
}

async function refresh() {
  const key = sessionStorage.getItem("offpeak-key");
  if (!key) return showKeyForm();
  let response;
  try {
    response = await fetch(`/v1/dashboard?hours=${HOURS}`, {
      headers: { Authorization: "Bearer " + key },
    });
  } catch (err) {
    $("error").hidden = false;
    $("error").textContent = "The API did not answer; retrying.";
    timer = setTimeout(refresh, REFRESH_SECONDS * 1000);
    return;
  }
  if (response.status === 401) {
    sessionStorage.removeItem("offpeak-key");
    return showKeyForm("That key was not accepted.");
  }
  const data = await response.json();
  if (!response.ok) {
    $("error").hidden = false;
    $("error").textContent = (data.error && data.error.message) || response.statusText;
  } else {
    $("error").hidden = true;
    $("key-form").hidden = true;
    $("content").hidden = false;
    $("hours").textContent = HOURS;
    const state = $("state");
    const paused = data.paused.length > 0;
    state.textContent = paused
      ? "batch work paused" + (data.paused.includes("*") ? "" : ": " + data.paused.join(", "))
      : "running";
    state.className = "badge " + (paused ? "paused" : "running");
    const loads = Object.entries(data.load).filter(([, v]) => v !== null);
    $("load-now").textContent = loads.length
      ? "load now: " + loads.map(([s, v]) => `${s} ${num(v, 2)}`).join(", ")
      : "";
    $("updated").textContent = "updated " + clock(data.generated_at, true);
    renderAlerts(data.alerts || []);
    const operator = data.operator === true;
    for (const id of ["chart-section", "batches-section", "mine-section"]) {
      $(id).hidden = operator;
    }
    if (operator) $("adapters-section").hidden = true;
    $("tenants-section").hidden = !operator;
    renderModels(data.models, data.window_seconds);
    if (operator) {
      renderTenants(data.tenants);
    } else {
      renderMine(data.tenant);
      renderBatches(data.batches);
      renderAdapters(data.adapters || []);
      renderChart(data.series);
    }
  }
  timer = setTimeout(refresh, REFRESH_SECONDS * 1000);
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("offpeak-key", $("key-input").value.trim());
  refresh();
});

refresh();
