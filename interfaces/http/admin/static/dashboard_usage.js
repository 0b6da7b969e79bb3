// DACP dashboard, usage panel: tokens per API key and model over the last days
// (GET /api/admin/usage?group_by=key,model,day, read from the store's jobs view), as a uPlot
// chart (one series per key and model) and a table with the totals. Plain ES2020, no build step.

import { HEIGHT, PALETTE } from "./dashboard_charts.js";

const POLL_MS = 30000;
const DAY_MS = 86400000;
const COUNTS = ["requests", "prompt_tokens", "completion_tokens", "total_tokens"];

// "2026-03-02" for a Date, in UTC (the report's days are UTC days).
const isoDay = (date) => date.toISOString().slice(0, 10);

export function createUsage({ api, failed, el, root }) {
  const state = { report: null, days: 14, timer: null, visible: false, plot: null };
  window.dacpUsage = {}; // the page's chart and report, for whoever inspects it (the browser test)

  // The report's days, oldest first: every day of the range, so a quiet day shows as zero.
  function days() {
    const today = Date.parse(`${isoDay(new Date())}T00:00:00Z`);
    return Array.from({ length: state.days }, (_, i) =>
      isoDay(new Date(today - (state.days - 1 - i) * DAY_MS)),
    );
  }

  const label = (row) => `${row.key_name || row.key_id || "(no key)"} · ${row.model}`;

  function series(rows) {
    const lines = new Map(); // "key\nmodel" -> { label, tokens by day }
    for (const row of rows) {
      const id = `${row.key_id}\n${row.model}`;
      if (!lines.has(id)) lines.set(id, { label: label(row), byDay: new Map() });
      lines.get(id).byDay.set(row.day, row.total_tokens);
    }
    return [...lines.values()].sort((a, b) => a.label.localeCompare(b.label));
  }

  function drawChart(rows) {
    const box = root.querySelector("#usage-plot");
    const xs = days();
    const lines = series(rows);
    const data = [
      xs.map((d) => Date.parse(`${d}T00:00:00Z`) / 1000),
      ...lines.map((l) => xs.map((d) => l.byDay.get(d) ?? 0)),
    ];
    state.plot?.destroy();
    state.plot = null;
    root.querySelector("#usage-empty").hidden = lines.length > 0;
    if (!lines.length) return;
    // eslint-disable-next-line no-undef
    state.plot = new uPlot(
      {
        width: Math.max(280, box.clientWidth - 8),
        height: HEIGHT,
        legend: { live: true },
        cursor: { drag: { x: false, y: false } },
        scales: { x: { time: true }, y: { range: (_u, _min, max) => [0, Math.max(1, max ?? 0) * 1.1] } },
        axes: [{}, { label: "tokens", size: 64 }],
        series: [
          {},
          ...lines.map((l, i) => ({ label: l.label, stroke: PALETTE[i % PALETTE.length], width: 2, points: { show: true } })),
        ],
      },
      data,
      box,
    );
    window.dacpUsage.plot = state.plot;
  }

  function drawTable(report) {
    const sums = new Map(); // "key\nmodel" -> the row summed over the days
    for (const row of report.data) {
      const id = `${row.key_id}\n${row.model}`;
      const sum = sums.get(id) ?? { ...row, ...Object.fromEntries(COUNTS.map((field) => [field, 0])) };
      for (const field of COUNTS) sum[field] += row[field];
      sums.set(id, sum);
    }
    const cells = (first, second, row) =>
      [first, second, ...COUNTS.map((field) => row[field])].map((v) => el("td", { text: String(v) }));
    const key = (row) => (row.key_name ? `${row.key_name} (${row.key_id})` : row.key_id || "(no key)");
    const rows = [...sums.values()].sort((a, b) => b.total_tokens - a.total_tokens);
    root.querySelector("#usage-table tbody").replaceChildren(
      ...rows.map((row) => el("tr", { dataset: { key: row.key_id, model: row.model } }, ...cells(key(row), row.model, row))),
      el("tr", { class: "total" }, ...cells("Total", "", report.totals)),
    );
  }

  async function load() {
    try {
      const from = days()[0];
      const report = await api(`/api/admin/usage?group_by=key,model,day&from=${from}`);
      state.report = report;
      window.dacpUsage.report = report;
      const { requests, total_tokens: tokens } = report.totals;
      root.querySelector("#usage-summary").textContent = `since ${from} (UTC): ${requests} requests, ${tokens} tokens`;
      drawTable(report);
      drawChart(report.data);
    } catch (error) {
      failed(error);
    }
    schedule();
  }

  function schedule() {
    clearTimeout(state.timer);
    state.timer = state.visible ? setTimeout(load, POLL_MS) : null;
  }

  root.querySelector("#usage-days").addEventListener("change", (event) => {
    state.days = Number(event.target.value) || 14;
    load();
  });
  window.addEventListener("resize", () => state.visible && state.report && drawChart(state.report.data));
  return {
    show() {
      state.visible = true;
      load();
    },
    hide() {
      state.visible = false;
      schedule();
    },
    reset() {
      state.visible = false;
      schedule();
      state.report = null;
      state.plot?.destroy();
      state.plot = null;
      window.dacpUsage = {};
    },
  };
}
