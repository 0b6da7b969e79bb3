// DACP dashboard, charts panel: the controller's recent history (GET /api/admin/metrics/history,
// one sample every METRICS_HISTORY_INTERVAL seconds) drawn with the vendored uPlot (a global,
// from vendor/uplot/uPlot.iife.min.js). Plain ES2020, no build step.

const MIN_POLL_MS = 1000;
export const HEIGHT = 190;
export const PALETTE = ["#2a5bd7", "#1e8a4c", "#d2691e", "#8e44ad", "#c53030", "#0f8b8d", "#b7791f", "#5a6b8c"];

// Each chart: its id, title, unit, and how its series come from the samples.
const CHARTS = [
  {
    id: "tokens",
    title: "Tokens per second",
    unit: "tok/s",
    series: () => [{ label: "tokens/s", value: (s) => s.tokens_per_second }],
  },
  {
    id: "ttft",
    title: "Time to first token",
    unit: "ms",
    points: true, // a quiet interval has none: single samples must show
    series: () => [
      { label: "p50", value: (s) => s.ttft_p50_ms },
      { label: "p95", value: (s) => s.ttft_p95_ms },
    ],
  },
  {
    id: "queue",
    title: "Queue depth",
    unit: "requests",
    series: () => [{ label: "waiting", value: (s) => s.queue_depth }],
  },
  {
    id: "utilisation",
    title: "Node utilisation (busy slots / slots)",
    unit: "%",
    max: 100,
    series: (samples) =>
      nodeKeys(samples, (n) => [[n.node_id, n.name]]).map(([id, name]) => ({
        label: name,
        value: (s) => {
          const node = s.nodes.find((n) => n.node_id === id);
          return node && node.slots ? (100 * node.busy_slots) / node.slots : null;
        },
      })),
  },
  {
    id: "cpu",
    title: "Node CPU use (what each node reports)",
    unit: "%",
    max: 100,
    series: (samples) =>
      nodeKeys(samples, (n) => (n.cpu_percent == null ? [] : [[n.node_id, n.name]])).map(([id, name]) => ({
        label: name,
        value: (s) => s.nodes.find((n) => n.node_id === id)?.cpu_percent ?? null,
      })),
  },
  {
    id: "memory",
    title: "Device memory in use",
    unit: "GiB",
    series: (samples) =>
      nodeKeys(samples, (n) => n.devices.map((d) => [`${n.node_id}/${d.name}`, `${n.name} ${d.name}`])).map(
        ([key, label]) => ({
          label,
          value: (s) => {
            const [id, name] = splitKey(key);
            const device = s.nodes.find((n) => n.node_id === id)?.devices.find((d) => d.name === name);
            return device ? (device.memory_total_bytes - device.memory_free_bytes) / 2 ** 30 : null;
          },
        }),
      ),
  },
];

// A duration as people say it: 1 hour, 90 minutes, 72 seconds.
function span(seconds) {
  if (seconds >= 3600 && seconds % 3600 === 0) return seconds === 3600 ? "hour" : `${seconds / 3600} hours`;
  if (seconds >= 120) return `${Math.round(seconds / 60)} minutes`;
  return `${Math.round(seconds)} seconds`;
}

function splitKey(key) {
  const at = key.indexOf("/");
  return [key.slice(0, at), key.slice(at + 1)];
}

// The distinct [key, label] pairs of the nodes' series over the samples, in order of label.
function nodeKeys(samples, pairs) {
  const seen = new Map();
  for (const sample of samples) for (const node of sample.nodes) for (const [key, label] of pairs(node)) seen.set(key, label);
  return [...seen.entries()].sort((a, b) => a[1].localeCompare(b[1]) || a[0].localeCompare(b[0]));
}

export function createCharts({ api, failed, el, root }) {
  const state = {
    samples: [],
    interval: 10,
    points: 360,
    timer: null,
    plots: new Map(), // chart id -> { plot, labels }
    visible: false,
    loading: false,
  };
  window.dacpCharts = {}; // chart id -> uPlot, for whoever inspects the page (the browser test)

  function columns(chart, series) {
    const xs = state.samples.map((s) => s.time);
    return [xs, ...series.map((line) => state.samples.map((s) => line.value(s) ?? null))];
  }

  function options(chart, series, width) {
    return {
      width,
      height: HEIGHT,
      legend: { live: true },
      cursor: { drag: { x: false, y: false } },
      scales: {
        x: { time: true },
        y: { range: (_u, _min, max) => [0, chart.max ?? Math.max(1, max ?? 0) * 1.1] },
      },
      axes: [{}, { label: chart.unit, size: 56 }],
      series: [
        {},
        ...series.map((line, i) => ({
          label: line.label,
          stroke: PALETTE[i % PALETTE.length],
          width: 2,
          spanGaps: false,
          points: { show: Boolean(chart.points) || state.samples.length < 3 },
        })),
      ],
    };
  }

  function draw() {
    if (!state.visible) return;
    for (const chart of CHARTS) {
      const box = root.querySelector(`[data-chart="${chart.id}"] .plot`);
      const series = chart.series(state.samples);
      const labels = series.map((s) => s.label).join("\n");
      const data = columns(chart, series);
      const width = Math.max(280, box.clientWidth - 8);
      const current = state.plots.get(chart.id);
      if (current && current.labels === labels && current.width === width) {
        current.plot.setData(data);
      } else {
        current?.plot.destroy();
        // eslint-disable-next-line no-undef
        const plot = new uPlot(options(chart, series, width), data, box);
        state.plots.set(chart.id, { plot, labels, width });
        window.dacpCharts[chart.id] = plot;
      }
      const empty = root.querySelector(`[data-chart="${chart.id}"] .empty`);
      empty.hidden = series.length > 0 && state.samples.length > 0;
    }
    const last = state.samples.at(-1);
    root.querySelector("#charts-title").textContent = `The cluster over the last ${span(state.interval * state.points)}`;
    root.querySelector("#charts-summary").textContent = last
      ? `${state.samples.length} samples, one every ${state.interval} s (up to ${state.points}); latest ${new Date(last.time * 1000).toLocaleTimeString()}`
      : `no sample yet: the first comes ${state.interval} s after the controller started`;
  }

  async function load() {
    if (state.loading) return; // one request at a time: a second show() waits for the poll
    state.loading = true;
    try {
      const last = state.samples.at(-1);
      const query = last ? `?since=${encodeURIComponent(last.time)}` : "";
      const body = await api(`/api/admin/metrics/history${query}`);
      const newest = state.samples.at(-1)?.time ?? -Infinity; // reset meanwhile: all are new
      state.interval = body.interval_seconds;
      state.points = body.points;
      state.samples = state.samples.concat(body.data.filter((s) => s.time > newest)).slice(-state.points);
      draw();
    } catch (error) {
      failed(error);
    } finally {
      state.loading = false;
    }
    schedule();
  }

  function schedule() {
    clearTimeout(state.timer);
    state.timer = state.visible ? setTimeout(load, Math.max(MIN_POLL_MS, state.interval * 1000)) : null;
  }

  function build() {
    root.querySelector("#charts-grid").replaceChildren(
      ...CHARTS.map((chart) =>
        el(
          "figure",
          { class: "chart", dataset: { chart: chart.id } },
          el("figcaption", { text: chart.title }),
          el("div", { class: "plot" }),
          el("p", { class: "empty", text: "No data yet." }),
        ),
      ),
    );
  }

  build();
  window.addEventListener("resize", () => state.visible && draw());
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
      state.samples = [];
      for (const { plot } of state.plots.values()) plot.destroy();
      state.plots.clear();
      window.dacpCharts = {};
    },
  };
}
