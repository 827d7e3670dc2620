// The dflash-pipeline dashboard: polls the JSON API and redraws, no page reloads, no build step.
// ?refresh=SECONDS sets the polling interval (default 5).
"use strict";

const REFRESH_MS = Math.max(0.5, Number(new URLSearchParams(location.search).get("refresh"))
                            || 5) * 1000;
const COLORS = ["#2563eb", "#16a34a", "#d97706", "#9333ea", "#dc2626", "#0891b2", "#65a30d",
                "#db2777", "#4b5563"];

const $ = (id) => document.getElementById(id);

function setText(id, value) {
  const el = $(id);
  if (el) el.textContent = value;
}

async function getJSON(url) {
  const response = await fetch(url, { cache: "no-store", credentials: "same-origin" });
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status} ${await response.text()}`);
  return response.json();
}

function known(value, digits) {
  if (value === null || value === undefined) return "?";
  return digits === undefined ? String(value) : Number(value).toFixed(digits);
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "?";
  const s = Math.round(seconds);
  const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600);
  const m = Math.floor((s % 3600) / 60), sec = s % 60;
  if (d) return `${d}d ${h}h${String(m).padStart(2, "0")}m`;
  if (h) return `${h}h${String(m).padStart(2, "0")}m`;
  return m ? `${m}m${String(sec).padStart(2, "0")}s` : `${sec}s`;
}

function pct(value) {
  return value === null || value === undefined ? "?" : `${(100 * value).toFixed(1)}%`;
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key === "style") node.style.cssText = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function showError(error) {
  const banner = $("error");
  banner.hidden = !error;
  banner.textContent = error ? `refresh failed: ${error.message || error}` : "";
}

function stamp() {
  setText("updated", `updated ${new Date().toLocaleTimeString()}`);
}

// A uPlot chart that keeps its series and is rebuilt only when their names change.
class Chart {
  constructor(container, { time = true, yLabel = "", height = 220 } = {}) {
    this.container = container;
    this.time = time;
    this.yLabel = yLabel;
    this.height = height;
    this.plot = null;
    this.names = "";
    window.addEventListener("resize", () => this.plot && this.plot.setSize(this.size()));
  }

  size() {
    return { width: Math.max(this.container.clientWidth, 200), height: this.height };
  }

  update(xs, named) {
    const names = named.map(([name]) => name);
    const data = [xs, ...named.map(([, ys]) => ys)];
    if (!this.plot || this.names !== names.join("\n")) {
      if (this.plot) this.plot.destroy();
      this.container.textContent = "";
      const series = [{}, ...names.map((name, i) => ({
        label: name, stroke: COLORS[i % COLORS.length], width: i === 0 ? 2 : 1.5,
        spanGaps: true, points: { show: xs.length < 3 },
      }))];
      this.plot = new uPlot({
        ...this.size(), series,
        // One point (a young run) still gets a readable axis around it.
        scales: { x: { time: this.time, range: (u, lo, hi) => (lo === hi ? [lo - 60, hi + 60]
                                                                      : [lo, hi]) } },
        axes: [{}, { label: this.yLabel, size: 60 }], legend: { live: true },
      }, data, this.container);
      this.names = names.join("\n");
    } else {
      this.plot.setData(data);
    }
  }
}

function bars(container, rows, highlight) {
  // rows: [label, value, className]; a plain HTML bar list (the six-token bin stays readable).
  container.textContent = "";
  const top = Math.max(1, ...rows.map(([, value]) => value));
  for (const [label, value, cls] of rows) {
    const fill = el("div", { class: `fill ${cls || ""}`, style: `width:${(100 * value) / top}%` });
    container.append(el("div", { class: `hbar ${highlight && highlight(label) ? "mode" : ""}` },
      el("span", { class: "hlabel" }, label), el("span", { class: "track" }, fill),
      el("span", { class: "hvalue" }, String(value))));
  }
}

// ---- the runs page ------------------------------------------------------------------------

async function refreshIndex() {
  const { runs } = await getJSON("/api/runs");
  const body = document.querySelector("#runs tbody");
  body.textContent = "";
  $("no-runs").hidden = runs.length > 0;
  for (const r of runs) {
    if (r.error) {   // a run the dashboard cannot read: one row with why, the others as usual
      body.append(el("tr", { "data-run": r.run },
        el("td", {}, r.run),
        el("td", {}, el("span", { class: "state unreadable" }, r.state)),
        el("td", { colspan: "7", class: "error" }, r.error)));
      continue;
    }
    const total = r.samples_total || 0;
    const share = total ? Math.min(1, (r.samples_done + r.in_progress) / total) : 0;
    const bar = el("div", { class: "bar mini" },
      el("div", { style: `width:${100 * Math.min(1, total ? r.samples_done / total : 0)}%` }));
    body.append(el("tr", { "data-run": r.run },
      el("td", {}, el("a", { href: `/runs/${encodeURIComponent(r.run)}` }, r.run)),
      el("td", {}, el("span", { class: `state ${r.state}` }, r.state)),
      el("td", {}, bar, ` ${(100 * share).toFixed(1)}%`),
      el("td", { class: "samples" }, `${r.samples_done} / ${known(r.samples_total)}`),
      el("td", {}, `${r.shards_committed} / ${r.shards_total}`),
      el("td", {}, known(r.tokens_per_s, 0)),
      el("td", {}, r.state === "done" ? "-" : duration(r.eta_s)),
      el("td", {}, duration(r.age_s)),
      el("td", { class: "muted" }, r.model)));
  }
}

// ---- one run's page -----------------------------------------------------------------------

const RUN = decodeURIComponent(location.pathname.split("/").filter(Boolean).pop() || "");
const charts = {};

function renderStatus(s) {
  document.title = `${s.run}: ${s.state} - dflash-pipeline`;
  setText("run-name", s.run);
  const state = $("state");
  state.textContent = s.state;
  state.className = `state ${s.state}`;
  setText("storage", s.storage);
  $("redis-down").hidden = s.redis.reachable;
  const sm = s.samples, total = sm.total || 0;
  setText("samples-done", sm.done);
  setText("samples-total", known(sm.total));
  setText("samples-partial", sm.in_progress);
  setText("samples-rejected", sm.rejected);
  $("bar-done").style.width = `${total ? (100 * sm.done) / total : 0}%`;
  $("bar-partial").style.width = `${total ? (100 * sm.in_progress) / total : 0}%`;
  const sh = s.shards;
  setText("shard-counts", `${sh.committed}/${sh.total} committed, ${known(sh.running)} running, `
    + `${known(sh.pending)} pending, ${known(sh.parked)} parked, ${known(sh.healing)} healing, `
    + `${known(sh.retrying)} retrying`);
  setText("tokens-per-s", known(s.tokens.per_s, 1));
  setText("samples-per-s", known(s.samples_per_s, 2));
  setText("eta", s.state === "done" ? "done" : duration(s.eta_s));
  setText("tokens-generated", `${s.tokens.generated} generated in committed shards`);
  const g = s.gates;
  setText("gate-rejected", g.rejected);
  setText("gate-checked", g.checked);
  setText("gate-rate", pct(g.rate));
  const reasons = document.querySelector("#reasons tbody");
  reasons.textContent = "";
  for (const [reason, n] of Object.entries(g.reasons)) {
    reasons.append(el("tr", {}, el("td", {}, reason), el("td", {}, String(n)),
      el("td", {}, pct(g.checked ? n / g.checked : 0))));
  }
  renderPause(s);
  renderDownstream(s);
}

function renderPause(s) {
  const banner = $("paused");
  banner.hidden = !s.pause;
  if (!s.pause) return;
  setText("pause-reason", s.pause.reason);
  const w = s.pause.window;
  setText("pause-window", w ? `window that tripped: ${w.rejected}/${w.size} rejected `
    + `(${pct(w.rate)}; limit ${pct(w.max_reject_rate)} over ${w.limit}); whole run so far `
    + `${pct(s.gates.rate)}` : "");
  setText("report-cmd", `dflash-pipeline report --run ${s.run}`);
  const list = $("pause-examples");
  list.textContent = "";
  for (const e of s.pause.examples || []) {
    list.append(el("li", {}, `${e.id}: ${(e.reasons || []).join(", ")}: `,
      el("code", {}, JSON.stringify((e.answer || "").slice(0, 80)))));
  }
}

function renderDownstream(s) {
  const d = s.downstream || {};
  setText("downstream-mode", d.mode ? `${d.mode}: queue ${d.stage}` : "");
  const figures = $("downstream-figures");
  figures.textContent = "";
  figures.append(el("div", {}, el("span", { class: "label" }, d.stage || "stage"),
    `${known(d.committed)} / ${s.shards.committed} committed shards done, `
    + `${known(d.parked)} parked`));
  if (s.drafter) {
    figures.append(el("div", { id: "drafter-source" }, el("span", { class: "label" }, "shape"),
      `${s.drafter.source}, target layers ${JSON.stringify(s.drafter.target_layer_ids)}`));
  }
  const t = d.train || {};
  if (t.step != null) {
    figures.append(el("div", { id: "train-progress" }, el("span", { class: "label" }, "training"),
      `epoch ${t.epoch} / ${t.epochs}, step ${t.step} / ${known(t.total_steps)}, learning rate `
      + `${t.lr != null ? Number(t.lr).toExponential(2) : "?"}, `
      + (d.finished ? `finished (${d.finished})` : `ETA ${duration(t.eta_s)}`)
      + (t.tau_by_epoch && t.tau_by_epoch.length
        ? `; held-out tau by epoch ${t.tau_by_epoch.map((v) => (v == null ? "-" : Number(v)
          .toFixed(3))).join(", ")}` : "")));
    figures.append(el("div", {}, el("span", { class: "label" }, "drafter"),
      `step ${t.step}: loss ${t.loss}, slot-1 accuracy ${t.slot1_accuracy}, acceptance length `
      + `${t.acceptance_length}${t.tau !== undefined ? `, tau ${t.tau}` : ""}, `
      + `${t.tokens_per_s} tok/s`));
    if (t.epoch_hours_measured != null) {
      const h = (v) => `${Number(Number(v).toPrecision(3))} h`;
      const planned = t.epoch_hours_planned;
      figures.append(el("div", { id: "train-epoch-hours" }, el("span", { class: "label" }, "epoch"),
        `${h(t.epoch_hours_measured)} at the measured steps' pace (`
        + (planned == null ? "no plan on the CPU" : `the plan ${h(planned)}, measured/plan `
          + `${(t.epoch_hours_measured / planned).toFixed(2)}`) + ")"));
    }
    if (Number(t.oom_retries) > 0) {
      figures.append(el("div", { id: "train-oom" }, el("span", { class: "label" }, "memory"),
        `${t.oom_retries} out-of-memory retries (each at half the budget, checkpointing on)`));
    }
    const slots = Array.isArray(t.slot_accuracy) ? t.slot_accuracy : [];
    bars($("slot-accuracy"), slots.map((a, i) => [`slot ${i + 1}`, Number(a)]));
  }
}

function renderShards(grid) {
  const container = $("shard-grid");
  container.textContent = "";
  for (const cell of grid.shards) {
    container.append(el("span", {
      class: `cell ${cell.state}`,
      title: `shard ${cell.shard}: ${cell.state}${cell.reason ? ` (${cell.reason})` : ""}`,
    }));
  }
}

function renderSeries(series) {
  charts.throughput ||= new Chart($("chart-throughput"), { yLabel: "tok/s" });
  charts.samples ||= new Chart($("chart-samples"), { yLabel: "samples" });
  charts.rejections ||= new Chart($("chart-rejections"), { yLabel: "rate", height: 160 });
  const workers = Object.entries(series.workers);
  charts.throughput.update(series.t, [["all workers", series.tokens_per_s], ...workers]);
  charts.samples.update(series.t, [["samples generated", series.samples_done]]);
  charts.rejections.update(series.t, [["rejected share", series.rejection_rate]]);
  const train = series.train || { step: [] };
  $("train-charts").hidden = train.step.length === 0;
  if (train.step.length) {
    charts.loss ||= new Chart($("chart-loss"), { time: false, yLabel: "loss", height: 160 });
    charts.accept ||= new Chart($("chart-accept"), { time: false, height: 160 });
    charts.loss.update(train.step, [["loss", train.loss || []]]);
    const shown = ["slot1_accuracy", "acceptance_length", "tau"].filter((k) => train[k]);
    charts.accept.update(train.step, shown.map((k) => [k, train[k]]));
  }
}

function renderEngines(data) {
  const body = document.querySelector("#engines tbody");
  body.textContent = "";
  $("no-engines").hidden = data.engines.length > 0 || !data.redis;
  for (const e of data.engines) {
    body.append(el("tr", {},
      el("td", {}, e.name), el("td", {}, el("code", {}, e.url)),
      el("td", { class: e.healthy ? "ok" : "bad" }, e.healthy ? "healthy" : "unhealthy"),
      el("td", {}, `${known(e.running)} running, ${known(e.queued)} queued`),
      el("td", {}, e.algorithm ? `${e.algorithm}, accept length ${known(e.accept_length)}`
        : "no speculative decoding")));
  }
}

function renderGates(gates) {
  const h = gates.supervised_tokens, floor = gates.min_supervised_tokens;
  setText("gate-threshold", `pause above ${pct(gates.max_reject_rate)} of the last `
    + `${gates.pause_after} samples; min supervised tokens ${floor}`);
  setText("resume-cmd", gates.resume_command);
  const w = gates.window;
  setText("gate-window", w ? `${w.rejected}/${w.size} rejected (${pct(w.rate)}) in the rolling `
    + "window" : "no window yet");
  // live: the run monitor in Redis; storage: rebuilt from the stored parts (Redis gone or wiped)
  const source = gates.source === "live" ? "live (run monitor in Redis)"
    : `from storage (${gates.redis ? "no live run monitor in Redis" : "Redis unreachable"})`;
  for (const id of ["gate-source", "histogram-source", "examples-source"]) setText(id, source);
  bars($("histogram"), h.histogram.map((b) => [
    b.hi === b.lo + 1 ? String(b.lo) : `${b.lo}-${b.hi - 1}`, b.count,
    b.hi <= floor ? "below" : ""]),
  (label) => h.mode !== null && label === String(h.mode));
  setText("histogram-note", h.mode === null ? "no samples judged yet"
    : `mode ${h.mode} (${h.mode_count} turns), mean ${h.mean}, p50 ${h.p50}; red bins are `
      + `below min_supervised_tokens (${floor})`);
  const container = $("examples");
  container.textContent = "";
  for (const [reason, shown] of Object.entries(gates.examples)) {
    const list = el("ul", {});
    for (const e of shown) {
      list.append(el("li", {}, el("b", {}, e.id), `: ${(e.details || []).join("; ")} `,
        el("code", {}, JSON.stringify((e.answer || "").slice(0, 120)))));
    }
    container.append(el("h3", {}, reason), list);
  }
  if (!container.childElementCount) container.append(el("p", { class: "muted" }, "no rejections"));
}

function renderEvals(data) {
  // The newest stored eval-drafter --dataset table; records that did not read are named.
  const record = data.record, body = document.querySelector("#eval-table tbody");
  body.textContent = "";
  $("no-eval").hidden = Boolean(record);
  $("eval-table").hidden = !record;
  const skipped = data.skipped.map((s) => `${s.key}: ${s.why}`).join("; ");
  $("eval-skipped").hidden = !skipped;
  setText("eval-skipped", skipped ? `stored records skipped (they do not read): ${skipped}` : "");
  setText("eval-source", record ? `${record.stamp}, ${data.drafter}, engine ${record.engine}, `
    + `thinking ${record.thinking}` : "");
  if (!record) { $("eval-bars").textContent = ""; return; }
  const num = (v) => (v === null || v === undefined ? "-" : Number(v).toFixed(3));
  for (const [name, row] of Object.entries(record.datasets)) {
    const pos = ["0-1k", "1k-4k", "4k-16k", "16k+"]
      .map((b) => el("td", {}, num(row.by_position[b])));
    const lossless = row.lossless
      ? `${row.lossless.checked - row.lossless.mismatches.length}/${row.lossless.checked}` : "-";
    const levels = Object.entries(row.concurrency || {}).map(([c, f]) =>
      `${num(f.speedup)}x at ${c} (${num(f.tokens_per_s)} tok/s)`).join(", ") || "-";
    body.append(el("tr", {}, el("td", {}, name), el("td", {}, String(row.prompts)),
      el("td", {}, row.tokens === null ? "-" : String(row.tokens)), el("td", {}, num(row.tau)),
      el("td", {}, num(row.tau_pooled)), el("td", {}, num(row.spec_accept_length)), ...pos,
      el("td", {}, lossless), el("td", {}, levels)));
  }
  bars($("eval-bars"), data.bars.map((b) => [
    `${b.set} (${b.measure}${Object.keys(b.speedup).length ? "; speedup "
      + Object.entries(b.speedup).map(([c, v]) => `${v}x@${c}`).join(" ") : ""})`,
    b.tau === null ? 0 : Number(b.tau.toFixed(3)), ""]));
}

let lastRunState = null;   // the run's state at the last refresh

async function refreshRun() {
  // Each panel on its own: one that fails (its API answers its error) is named in the banner
  // and keeps its last figures, while every other panel renders.
  const base = `/api/runs/${encodeURIComponent(RUN)}`;
  // Until the run is done, the series shows its uncommitted parts too (read capped).
  const series = lastRunState === "done" ? "series" : "series?live=1";
  const panels = [["status", renderStatus], ["shards", renderShards],
    ["engines", renderEngines], ["gates", renderGates], [series, renderSeries],
    ["evals", renderEvals]];
  const answers = await Promise.allSettled(panels.map(([p]) => getJSON(`${base}/${p}`)));
  if (answers[0].status === "fulfilled") lastRunState = answers[0].value.state;
  const failed = [];
  panels.forEach(([name, render], i) => {
    try {
      if (answers[i].status === "rejected") throw answers[i].reason;
      render(answers[i].value);
    } catch (error) {
      failed.push(`${name.split("?")[0]}: ${error.message || error}`);
    }
  });
  if (failed.length) throw new Error(failed.join("; "));
}

async function loop(refresh) {
  try {
    await refresh();
    showError(null);
    stamp();
  } catch (error) {
    showError(error);
  }
  setTimeout(() => loop(refresh), REFRESH_MS);
}

loop(document.body.dataset.page === "run" ? refreshRun : refreshIndex);
