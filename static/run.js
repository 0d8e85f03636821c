// The run page's loss curve: metric rows arrive over server-sent events (htmx-ext-sse) and are drawn
// with uPlot. Losses are plotted against call index, since several forward_backward calls can share a step.
(function () {
  "use strict";
  const chartEl = document.getElementById("loss-chart");
  const live = document.getElementById("live");
  if (!chartEl || !live) return;

  const xs = [], ys = [];
  let lastId = 0, plot = null;

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

  function draw() {
    const width = chartEl.clientWidth || 800;
    if (!plot) {
      document.getElementById("chart-empty").remove();
      plot = new uPlot({
        width, height: 300,
        scales: { x: { time: false } },
        // Whole-number ticks: the x axis counts calls.
        axes: [{ label: "forward_backward call", stroke: "#6b7280", grid: { stroke: "#f1f5f9" },
                 incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000] },
               { label: "loss", stroke: "#6b7280", grid: { stroke: "#f1f5f9" } }],
        series: [{ label: "call" }, { label: "loss", stroke: "#4f46e5", width: 2, fill: "rgba(79,70,229,.08)",
                                      points: { show: xs.length < 60 } }],
        legend: { show: true },
      }, [xs, ys], chartEl);
      new ResizeObserver(() => plot.setSize({ width: chartEl.clientWidth, height: 300 })).observe(chartEl);
    } else {
      plot.setData([xs, ys]);
    }
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
      // A loss is recorded as loss:mean or loss:sum (older runs: loss), one row per forward_backward.
      const isLoss = row.name === "loss" || row.name.startsWith("loss:");
      if (isLoss) { xs.push(xs.length + 1); ys.push(row.value); }
      newest[isLoss ? "loss" : row.name] = row;
    }
    if (newest.loss) text("stat-loss", newest.loss.value.toFixed(4));
    if (newest.grad_norm) text("stat-grad", newest.grad_norm.value.toFixed(3));
    const steps = rows.map((row) => row.step);
    if (steps.length) text("stat-step", Math.max(Number(document.getElementById("stat-step").textContent) || 0, ...steps));
    text("stat-calls", xs.length);
    if (xs.length) draw();
    chartEl.dataset.points = String(xs.length);
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
