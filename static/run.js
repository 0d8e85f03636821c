// The run page's live view: metric rows, samples and checkpoints arrive over the page's one server-sent event stream
// (htmx-ext-sse) and are drawn with uPlot. The loss chart plots loss against the forward_backward call, the step (the
// token-weighted mean of that step's calls) or wall time, with smoothing, a log scale, a CSV export and markers where
// checkpoints were saved and samples made; four smaller charts show grad norm, learning rate, tokens per call and
// throughput. Every chart zooms (drag across it) with a visible reset, and has a table view of its points.
(function () {
  "use strict";
  const live = document.getElementById("live");
  const lossEl = document.getElementById("loss-chart");
  if (!live || !lossEl) return;
  const $ = (id) => document.getElementById(id);
  const INK = "#4b5563", GRID = { stroke: "#f1f5f9" };
  const MARK_COLOURS = { checkpoint: "#b45309", sample: "#0f766e" };
  const TABLE_ROWS = 1000;  // the table view lists the latest this many points; the CSV export has every row
  const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000];

  // One entry per forward_backward call: its step, wall time (s), loss, tokens (its loss's weight in its step) and
  // throughput; one per optim_step: its step, grad norm and learning rate.
  const calls = [], byKey = new Map(), optim = [], optimByKey = new Map();
  const checkpoints = new Map();  // id → {step, t, name, mode}
  const sampleSteps = new Map();  // step → time of its first sample
  for (const mark of JSON.parse(lossEl.dataset.sampleMarks || "[]")) sampleSteps.set(mark.step, mark.t);
  let lastId = 0, lastCheckpointId = 0, tableView = false;
  const control = (id) => $(id);
  const samplesList = $("samples-list");
  let lastSampleId = Number((samplesList && samplesList.querySelector("li[data-sample-id]") || {dataset: {}}).dataset.sampleId) || 0;

  // A fresh EventSource (after the old one closed) carries no Last-Event-ID: send our cursors instead,
  // so the server resumes after the last row we drew, sample we listed and checkpoint we marked, and never repeats one.
  htmx.createEventSource = (url) => {
    const target = new URL(url, location.href);
    if (lastId) target.searchParams.set("after", lastId);
    target.searchParams.set("samples_after", lastSampleId);
    if (lastCheckpointId) target.searchParams.set("checkpoints_after", lastCheckpointId);
    return new EventSource(target.pathname + target.search, { withCredentials: true });
  };

  function setState(state, label) {
    const el = $("live-state");
    el.dataset.state = state;
    el.querySelector(".label").textContent = label;
  }

  // A number in `digits` significant digits, in exponent form when very small or large (a learning rate: 1e-4).
  function format(value, digits = 6) {
    if (value == null) return "—";
    const size = Math.abs(value), rounded = Number(value.toPrecision(digits));
    return size !== 0 && (size < 1e-3 || size >= 1e6) ? rounded.toExponential() : String(rounded);
  }
  const ticks = (u, splits) => splits.map((split) => format(split, 4));

  // One chart: a uPlot in #NAME-chart, its table view in #NAME-table and its #NAME-reset button. `show(spec, data)`
  // draws data ([xs, ys, …]); a new spec (another axis, log scale, series) builds the plot again.
  function makeChart(name, height) {
    const host = $(name + "-chart"), tableHost = $(name + "-table"), reset = $(name + "-reset");
    let plot = null, key = "", spec = null, data = null, zoomed = false;

    // The x range that shows every point and every marker; a lone value gets a unit either side.
    function extent() {
      const xs = data[0], extra = spec.marks ? spec.marks().map((m) => m.x) : [];
      let lo = Math.min(xs[0], ...extra), hi = Math.max(xs[xs.length - 1], ...extra);
      if (lo === hi) { lo -= 1; hi += 1; }
      return [lo, hi];
    }

    function scaled(u) {
      const [lo, hi] = extent(), { min, max } = u.scales.x, slack = (hi - lo) * 1e-9;
      zoomed = min > lo + slack || max < hi - slack;  // dragged, or double-clicked back
      reset.hidden = !zoomed;
      host.dataset.xMin = String(min);
      host.dataset.xMax = String(max);
    }

    function drawMarks(u) {
      if (!spec.marks) return;
      const { left, top, width, height: tall } = u.bbox, ctx = u.ctx, ratio = uPlot.pxRatio || 1, drawn = [];
      ctx.save();
      for (const mark of spec.marks()) {
        const x = Math.round(u.valToPos(mark.x, "x", true));
        if (x < left - 1 || x > left + width + 1) continue;  // zoomed out of view
        drawn.push(`${mark.kind}:${mark.step}`);
        ctx.strokeStyle = ctx.fillStyle = MARK_COLOURS[mark.kind];
        ctx.lineWidth = (mark.kind === "checkpoint" ? 2 : 1) * ratio;
        ctx.setLineDash(mark.kind === "checkpoint" ? [] : [4 * ratio, 3 * ratio]);
        ctx.beginPath();
        ctx.moveTo(x, top);
        ctx.lineTo(x, top + tall);
        ctx.stroke();
        if (mark.kind === "checkpoint") ctx.fillRect(x - 4 * ratio, top, 8 * ratio, 6 * ratio);  // a flag at the top
      }
      ctx.restore();
      host.dataset.marks = drawn.join(" ");
    }

    function build() {
      if (plot) plot.destroy();
      const empty = host.querySelector(".chart-empty");
      if (empty) empty.remove();
      plot = new uPlot({
        width: host.clientWidth || 600, height,
        // uPlot asks for the x range with the data's own (autoscaling) or a dragged selection's (zoom): widen only
        // the first to take the markers in.
        scales: { x: { time: false, range: (u, min, max) => (min === data[0][0] && max === data[0][data[0].length - 1] ? extent() : [min, max]) },
                  y: { distr: spec.log ? 3 : 1 } },
        axes: [{ label: spec.xLabel, stroke: INK, grid: GRID, incrs: spec.xIncrs },
               { label: spec.yLabel, stroke: INK, grid: GRID, size: 60, values: ticks }],
        series: [{ label: spec.xLabel }, ...spec.series], legend: { show: true },
        hooks: { setScale: [(u, scale) => { if (scale === "x") scaled(u); }], draw: [drawMarks] },
      }, data, host);
      reset.hidden = true;
      zoomed = false;
    }

    function table() {
      if (!tableView || !data) return;
      const rows = data[0].length, first = Math.max(0, rows - TABLE_ROWS);
      const element = document.createElement("table");
      element.className = "table compact";
      const caption = element.createCaption();
      caption.textContent = `${spec.title}: ${rows > TABLE_ROWS ? `the latest ${TABLE_ROWS} of ${rows}` : rows} points, newest first`;
      const head = element.createTHead().insertRow();
      for (const label of [spec.xLabel, ...spec.series.map((s) => s.label)]) {
        const th = document.createElement("th");
        th.scope = "col";
        th.textContent = label;
        head.append(th);
      }
      const body = element.createTBody();
      for (let i = rows - 1; i >= first; i--) {
        const row = body.insertRow();
        data.forEach((column, c) => { row.insertCell().textContent = c === 0 && spec.xFormat ? spec.xFormat(column[i]) : format(column[i]); });
      }
      tableHost.replaceChildren(element);
    }

    new ResizeObserver(() => { if (plot && host.clientWidth) plot.setSize({ width: host.clientWidth, height }); }).observe(host);
    reset.addEventListener("click", () => { if (plot) plot.setData(data, true); });  // back to the whole range

    return {
      show(nextSpec, nextData) {
        const nextKey = nextSpec.key || "";
        spec = nextSpec;
        data = nextData;
        host.dataset.shown = String(data[0].length);
        const [xs, ys] = [data[0], data[data.length - 1]];
        host.setAttribute("aria-label", `${spec.title}: ${xs.length} points; the latest ${format(ys[xs.length - 1])} ` +
                          `at ${spec.xLabel} ${spec.xFormat ? spec.xFormat(xs[xs.length - 1]) : format(xs[xs.length - 1])}`);
        if (!plot || nextKey !== key) { key = nextKey; build(); } else plot.setData(data, !zoomed);
        table();
      },
      toggle() {
        host.hidden = tableView && !!data;
        tableHost.hidden = !(tableView && data);
        if (!tableView && plot && host.clientWidth) plot.setSize({ width: host.clientWidth, height });
        table();
      },
      redraw() { if (plot) plot.setData(data, !zoomed); },  // a new marker may widen the whole range
    };
  }

  const AXES = {
    call: { label: "forward_backward call", note: "Loss of each forward_backward call, in order (several calls may share one optimizer step)." },
    step: { label: "step", note: "Loss at each step: the token-weighted mean of that step's forward_backward losses." },
    time: { label: "seconds since the first call", note: "Loss of each forward_backward call against wall time." },
  };

  // The loss points for the chosen axis: [xs, ys].
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

  // Where a marker at `step` (made at time `t`) sits on the axis: on the call axis, after the last call before that
  // step (a checkpoint holds the weights those calls trained).
  function markX(axis, step, t) {
    if (axis === "step") return step;
    if (axis === "time") return t - calls[0].t;
    return calls.filter((c) => c.step < step).length + 0.5;
  }

  function marks(axis) {
    const found = [];
    for (const c of checkpoints.values()) found.push({ kind: "checkpoint", step: c.step, x: markX(axis, c.step, c.t) });
    for (const [step, t] of sampleSteps) found.push({ kind: "sample", step, x: markX(axis, step, t) });
    return found;
  }

  function describeMarks() {
    const saved = [...checkpoints.values()].map((c) => `${c.name} (${c.mode}) at step ${c.step}`);
    const steps = [...sampleSteps.keys()].sort((a, b) => a - b);
    const sampled = steps.length > 10 ? `${steps.length} steps, the latest ${steps[steps.length - 1]}` : steps.join(", ");
    const parts = [saved.length ? `Checkpoints: ${saved.join("; ")}.` : "No checkpoints yet.",
                   steps.length ? `Samples at step ${sampled}.` : "No samples yet."];
    $("chart-marks").textContent = parts.join(" ");
  }

  // An exponential moving average, debiased as TensorBoard's is, so the first points are not pulled towards 0.
  function smoothed(ys, factor) {
    let average = 0;
    return ys.map((y, i) => { average = factor * average + (1 - factor) * y; return average / (1 - factor ** (i + 1)); });
  }

  const lossChart = makeChart("loss", 300);
  const metricCharts = {
    grad_norm: { chart: makeChart("grad_norm", 200), title: "Grad norm", xLabel: "step", rows: () => optim, field: "grad_norm" },
    learning_rate: { chart: makeChart("learning_rate", 200), title: "Learning rate", xLabel: "step", rows: () => optim, field: "learning_rate" },
    num_tokens: { chart: makeChart("num_tokens", 200), title: "Tokens per call", xLabel: "forward_backward call", rows: () => calls, field: "tokens" },
    throughput: { chart: makeChart("throughput", 200), title: "Throughput", xLabel: "forward_backward call", rows: () => calls, field: "throughput" },
  };

  function drawLoss() {
    if (!calls.length) return;
    const axis = control("chart-x").value, factor = Number(control("chart-smooth").value), log = control("chart-log").checked;
    let [xs, ys] = points(axis);
    if (log) ys = ys.map((y) => (y > 0 ? y : null));  // a log scale has no place for 0 or below
    const data = factor > 0 ? [xs, ys, smoothed(ys.map((y) => y ?? 0), factor)] : [xs, ys];
    const series = [{ label: "loss", stroke: factor > 0 ? "rgba(79,70,229,.3)" : "#4f46e5", width: factor > 0 ? 1 : 2,
                      fill: factor > 0 ? undefined : "rgba(79,70,229,.08)", points: { show: xs.length < 60 } }];
    if (factor > 0) series.push({ label: "smoothed", stroke: "#4f46e5", width: 2, points: { show: false } });
    lossChart.show({
      key: [axis, log, factor > 0].join("|"), title: "Loss", xLabel: AXES[axis].label, yLabel: "loss", log, series,
      xIncrs: axis === "time" ? undefined : STEP_INCRS, xFormat: axis === "time" ? (x) => x.toFixed(1) : String,
      marks: () => marks(axis),
    }, data);
    control("chart-note").textContent = AXES[axis].note;
    const last = data[data.length - 1][xs.length - 1];
    lossEl.dataset.last = last == null ? "" : String(last);
  }

  function drawMetric(name) {
    const { chart, title, xLabel, rows, field } = metricCharts[name];
    const xs = [], ys = [];
    rows().forEach((row, i) => {
      if (row[field] == null) return;
      xs.push(rows() === optim ? row.step : i + 1);
      ys.push(row[field]);
    });
    if (!xs.length) return;
    chart.show({ title, xLabel, yLabel: title.toLowerCase(), xIncrs: STEP_INCRS, xFormat: String,
                 series: [{ label: title.toLowerCase(), stroke: "#0e7490", width: 2, points: { show: xs.length < 60 } }] },
               [xs, ys]);
  }

  for (const id of ["chart-x", "chart-smooth", "chart-log"]) control(id).addEventListener("input", drawLoss);
  control("chart-table-toggle").addEventListener("click", (event) => {
    tableView = !tableView;
    event.currentTarget.setAttribute("aria-pressed", String(tableView));
    event.currentTarget.textContent = tableView ? "Chart view" : "Table view";
    for (const chart of [lossChart, ...Object.values(metricCharts).map((m) => m.chart)]) chart.toggle();
  });

  function text(id, value) { $(id).textContent = value; }

  function onMetrics(rows) {
    let newest = {};
    for (const row of rows) {
      if (row.id <= lastId) continue;  // belt and braces: the server already resumes after lastId
      lastId = row.id;
      // One call's rows share its step and time: its loss (loss:mean or loss:sum; older runs: loss), num_tokens and
      // throughput; one optim_step's, its grad_norm and learning_rate.
      const key = row.step + "|" + row.t;
      const isLoss = row.name === "loss" || row.name.startsWith("loss:");
      if (isLoss) {
        const call = { tokens: 0, ...(byKey.get(key) || {}), step: row.step, t: row.t, loss: row.value };
        calls.push(call);
        byKey.set(key, call);
      } else if (row.name === "num_tokens" || row.name === "throughput") {
        const call = byKey.get(key) || {};
        call[row.name === "num_tokens" ? "tokens" : "throughput"] = row.value;
        byKey.set(key, call);
      } else if (row.name === "grad_norm" || row.name === "learning_rate") {
        let step = optimByKey.get(key);
        if (!step) { step = { step: row.step, t: row.t }; optim.push(step); optimByKey.set(key, step); }
        step[row.name] = row.value;
      }
      newest[isLoss ? "loss" : row.name] = row;
    }
    if (newest.loss) text("stat-loss", newest.loss.value.toFixed(4));
    if (newest.grad_norm) text("stat-grad", format(newest.grad_norm.value, 4));
    if (newest.learning_rate) text("stat-lr", format(newest.learning_rate.value, 4));
    if (newest.num_tokens) text("stat-tokens", format(newest.num_tokens.value, 4));
    if (newest.throughput) text("stat-throughput", format(newest.throughput.value, 4));
    const steps = rows.map((row) => row.step);
    if (steps.length) text("stat-step", Math.max(Number($("stat-step").textContent) || 0, ...steps));
    text("stat-calls", calls.length);
    drawLoss();
    for (const name of Object.keys(metricCharts)) drawMetric(name);
    lossEl.dataset.points = String(calls.length);
  }

  // Checkpoints saved anywhere (the SDK, the page, Tinker) are marked on the loss chart; one the checkpoints card does
  // not list yet brings the card again.
  function onCheckpoints(rows) {
    let unlisted = false;
    for (const row of rows) {
      lastCheckpointId = Math.max(lastCheckpointId, row.id);
      if (row.mode !== "sampler") checkpoints.set(row.id, row);  // sampler snapshots are for sampling, not markers
      unlisted = unlisted || !document.querySelector(`#checkpoints [data-checkpoint-id="${row.id}"]`);
    }
    describeMarks();
    lossChart.redraw();
    if (unlisted) htmx.ajax("GET", `/runs/${live.dataset.runId}/checkpoints`, { target: "#checkpoints", swap: "outerHTML" });
  }

  // A checkpoint deleted from the card (or gone when it is fetched again) loses its marker.
  document.body.addEventListener("htmx:afterSettle", (event) => {
    if (event.target.id !== "checkpoints") return;
    let pruned = false;
    for (const id of [...checkpoints.keys()]) {
      if (!document.querySelector(`#checkpoints [data-checkpoint-id="${id}"]`)) pruned = checkpoints.delete(id);
    }
    if (pruned) { describeMarks(); lossChart.redraw(); }
  });

  lossEl.addEventListener("htmx:sseMessage", (event) => {
    const message = event.detail;
    if (message.type === "metrics") onMetrics(JSON.parse(message.data));
    else if (message.type === "checkpoints") onCheckpoints(JSON.parse(message.data));
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

  const samplesCard = $("samples");
  if (samplesCard && samplesList) samplesCard.addEventListener("htmx:sseMessage", (event) => {
    if (event.detail.type !== "samples") return;
    for (const sample of JSON.parse(event.detail.data)) {
      if (sample.id <= lastSampleId) continue;
      lastSampleId = sample.id;
      samplesList.prepend(sampleItem(sample));
      if (!sampleSteps.has(sample.step)) sampleSteps.set(sample.step, sample.t);
    }
    while (samplesList.children.length > 20) samplesList.lastElementChild.remove();  // as many as the page shows
    samplesList.hidden = !samplesList.children.length;
    const empty = $("samples-empty");
    if (empty && samplesList.children.length) empty.remove();
    describeMarks();
    lossChart.redraw();
  });

  describeMarks();
  live.addEventListener("htmx:sseOpen", () => setState("live", "Live"));
  live.addEventListener("htmx:sseError", () => setState("reconnecting", "Reconnecting…"));
})();
