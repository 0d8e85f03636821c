// The run page's live view: metric rows arrive over the page's one server-sent event stream (htmx-ext-sse) and are
// drawn with uPlot; samples arrive on the same stream. The chart plots loss against the forward_backward call, the
// step (the token-weighted mean of that step's calls) or wall time, with smoothing, a log scale and a CSV export.
(function () {
  "use strict";
  const chartEl = document.getElementById("loss-chart");
  const live = document.getElementById("live");
  if (!chartEl || !live) return;

  // One entry per forward_backward call: its step, wall time (s), loss, and tokens (its loss's weight in its step).
  const calls = [], byKey = new Map();
  let lastId = 0, plot = null, plotKey = "";
  const control = (id) => document.getElementById(id);
  const samplesList = document.getElementById("samples-list");
  let lastSampleId = Number((samplesList && samplesList.querySelector("li[data-sample-id]") || {dataset: {}}).dataset.sampleId) || 0;

  // A fresh EventSource (after the old one closed) carries no Last-Event-ID: send our cursors instead,
  // so the server resumes after the last row we drew and the last sample we listed, and never repeats one.
  htmx.createEventSource = (url) => {
    const target = new URL(url, location.href);
    if (lastId) target.searchParams.set("after", lastId);
    target.searchParams.set("samples_after", lastSampleId);
    return new EventSource(target.pathname + target.search, { withCredentials: true });
  };

  function setState(state, label) {
    const el = document.getElementById("live-state");
    el.dataset.state = state;
    el.querySelector(".label").textContent = label;
  }

  const AXES = {
    call: { label: "forward_backward call", note: "Loss of each forward_backward call, in order (several calls may share one optimizer step)." },
    step: { label: "step", note: "Loss at each step: the token-weighted mean of that step's forward_backward losses." },
    time: { label: "seconds since the first call", note: "Loss of each forward_backward call against wall time." },
  };

  // The points for the chosen axis: [xs, ys].
  function points(axis) {
    if (axis === "call") return [calls.map((_, i) => i + 1), calls.map((c) => c.loss)];
    if (axis === "time") return [calls.map((c) => c.t - calls[0].t), calls.map((c) => c.loss)];
    const steps = new Map();
    for (const c of calls) {
      const s = steps.get(c.step) || { sum: 0, weight: 0 };
      const weight = c.tokens || 1;
      s.sum += c.loss * weight;
      s.weight += weight;
      steps.set(c.step, s);
    }
    const xs = [...steps.keys()].sort((a, b) => a - b);
    return [xs, xs.map((x) => steps.get(x).sum / steps.get(x).weight)];
  }

  // An exponential moving average, debiased as TensorBoard's is, so the first points are not pulled towards 0.
  function smoothed(ys, factor) {
    let average = 0;
    return ys.map((y, i) => { average = factor * average + (1 - factor) * y; return average / (1 - factor ** (i + 1)); });
  }

  function draw() {
    const axis = control("chart-x").value, factor = Number(control("chart-smooth").value), log = control("chart-log").checked;
    let [xs, ys] = points(axis);
    if (log) ys = ys.map((y) => (y > 0 ? y : null));  // a log scale has no place for 0 or below
    const data = factor > 0 ? [xs, ys, smoothed(ys.map((y) => y ?? 0), factor)] : [xs, ys];
    const key = [axis, log, factor > 0].join("|");
    const width = chartEl.clientWidth || 800;
    if (!plot || key !== plotKey) {
      if (plot) plot.destroy();
      const empty = document.getElementById("chart-empty");
      if (empty) empty.remove();
      const series = [{ label: AXES[axis].label },
                      { label: "loss", stroke: factor > 0 ? "rgba(79,70,229,.3)" : "#4f46e5", width: factor > 0 ? 1 : 2,
                        fill: factor > 0 ? undefined : "rgba(79,70,229,.08)", points: { show: xs.length < 60 } }];
      if (factor > 0) series.push({ label: "smoothed", stroke: "#4f46e5", width: 2, points: { show: false } });
      plot = new uPlot({
        width, height: 300,
        scales: { x: { time: false }, y: { distr: log ? 3 : 1 } },
        axes: [{ label: AXES[axis].label, stroke: "#4b5563", grid: { stroke: "#f1f5f9" },
                 incrs: axis === "time" ? undefined : [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000] },
               { label: "loss", stroke: "#4b5563", grid: { stroke: "#f1f5f9" } }],
        series, legend: { show: true },
      }, data, chartEl);
      plotKey = key;
    } else {
      plot.setData(data);
    }
    control("chart-note").textContent = AXES[axis].note;
    chartEl.dataset.shown = String(xs.length);
    const last = data[data.length - 1][xs.length - 1];
    chartEl.dataset.last = last == null ? "" : String(last);
  }
  new ResizeObserver(() => plot && plot.setSize({ width: chartEl.clientWidth, height: 300 })).observe(chartEl);
  for (const id of ["chart-x", "chart-smooth", "chart-log"]) {
    control(id).addEventListener("input", () => { if (calls.length) draw(); });
  }

  function text(id, value) { document.getElementById(id).textContent = value; }

  chartEl.addEventListener("htmx:sseMessage", (event) => {
    const message = event.detail;
    if (message.type !== "metrics") return;
    const rows = JSON.parse(message.data);
    let newest = {};
    for (const row of rows) {
      if (row.id <= lastId) continue;  // belt and braces: the server already resumes after lastId
      lastId = row.id;
      // One call's rows share its step and time: its loss (loss:mean or loss:sum; older runs: loss) and num_tokens.
      const key = row.step + "|" + row.t;
      const isLoss = row.name === "loss" || row.name.startsWith("loss:");
      if (isLoss) {
        const call = { step: row.step, t: row.t, loss: row.value, tokens: byKey.has(key) ? byKey.get(key).tokens : 0 };
        calls.push(call);
        byKey.set(key, call);
      } else if (row.name === "num_tokens") {
        const call = byKey.get(key) || { tokens: 0 };
        call.tokens = row.value;
        byKey.set(key, call);
      }
      newest[isLoss ? "loss" : row.name] = row;
    }
    if (newest.loss) text("stat-loss", newest.loss.value.toFixed(4));
    if (newest.grad_norm) text("stat-grad", newest.grad_norm.value.toFixed(3));
    const steps = rows.map((row) => row.step);
    if (steps.length) text("stat-step", Math.max(Number(document.getElementById("stat-step").textContent) || 0, ...steps));
    text("stat-calls", calls.length);
    if (calls.length) draw();
    chartEl.dataset.points = String(calls.length);
  });

  // Samples made anywhere (the SDK, the playground, /v1) go to the top of the list as they are stored (bug 6).
  function sampleItem(sample) {
    const item = document.createElement("li");
    item.dataset.sampleId = sample.id;
    const parts = [["sample-meta", `step ${sample.step} · just now · temperature ${sample.temperature}`],
                   ["sample-prompt", sample.prompt], ["sample-output", sample.output]];
    for (const [className, value] of parts) {
      const div = document.createElement("div");
      div.className = className;
      div.textContent = value;
      item.append(div);
    }
    return item;
  }

  const samplesCard = document.getElementById("samples");
  if (samplesCard && samplesList) samplesCard.addEventListener("htmx:sseMessage", (event) => {
    if (event.detail.type !== "samples") return;
    for (const sample of JSON.parse(event.detail.data)) {
      if (sample.id <= lastSampleId) continue;
      lastSampleId = sample.id;
      samplesList.prepend(sampleItem(sample));
    }
    while (samplesList.children.length > 20) samplesList.lastElementChild.remove();  // as many as the page shows
    samplesList.hidden = !samplesList.children.length;
    const empty = document.getElementById("samples-empty");
    if (empty && samplesList.children.length) empty.remove();
  });

  live.addEventListener("htmx:sseOpen", () => setState("live", "Live"));
  live.addEventListener("htmx:sseError", () => setState("reconnecting", "Reconnecting…"));
})();
