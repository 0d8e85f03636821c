// The run page's live view: metric rows, samples and checkpoints arrive over the page's one server-sent event stream
// (htmx-ext-sse) and are drawn with uPlot: loss, grad norm, learning rate, tokens per call and throughput. One set of
// controls applies to all five: the x axis (the forward_backward call, the step, or wall time), smoothing and a log
// scale; the loss chart also marks where checkpoints were saved and samples made. Every chart zooms (drag across it)
// with a visible reset, and has a table view of its raw points; the CSV export has every metric row.
// Metrics the user reports (logMetrics: a DPO loss, a reward) get a chart each, made as their first row comes.
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

  // One chart: a uPlot in #NAME-chart, its table view in #NAME-table and its #NAME-reset button. `show(spec, data,
  // raw)` draws data ([xs, ys, …]) and lists raw ([xs, ys]) in the table view; a new spec (another axis, log scale,
  // series) builds the plot again. The host's data attributes say what is drawn (the tests read them).
  function makeChart(name, height) {
    const host = $(name + "-chart"), tableHost = $(name + "-table"), reset = $(name + "-reset");
    let plot = null, key = "", spec = null, data = null, raw = null, zoomed = false;

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
      host.dataset.distr = String(plot.scales.y.distr);  // 3: logarithmic
      host.dataset.series = String(spec.series.length);
    }

    function table() {
      if (!tableView || !raw) return;
      const rows = raw[0].length, first = Math.max(0, rows - TABLE_ROWS);
      const element = document.createElement("table");
      element.className = "table compact";
      const caption = element.createCaption();
      caption.textContent = `${spec.title}: ${rows > TABLE_ROWS ? `the latest ${TABLE_ROWS} of ${rows}` : rows} points, newest first`;
      const head = element.createTHead().insertRow();
      for (const label of [spec.xLabel, spec.series[0].label]) {
        const th = document.createElement("th");
        th.scope = "col";
        th.textContent = label;
        head.append(th);
      }
      const body = element.createTBody();
      for (let i = rows - 1; i >= first; i--) {
        const row = body.insertRow();
        raw.forEach((column, c) => { row.insertCell().textContent = c === 0 && spec.xFormat ? spec.xFormat(column[i]) : format(column[i]); });
      }
      tableHost.replaceChildren(element);
    }

    new ResizeObserver(() => { if (plot && host.clientWidth) plot.setSize({ width: host.clientWidth, height }); }).observe(host);
    reset.addEventListener("click", () => { if (plot) plot.setData(data, true); });  // back to the whole range

    return {
      show(nextSpec, nextData, nextRaw) {
        const nextKey = nextSpec.key || "";
        spec = nextSpec;
        data = nextData;
        raw = nextRaw;
        host.dataset.shown = String(data[0].length);
        const top = data[data.length - 1][data[0].length - 1];  // the last point of the series drawn on top
        host.dataset.last = top == null ? "" : String(top);
        const [xs, ys] = raw;
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
    call: { label: "forward_backward call", note: "Each forward_backward call in order (several calls may share one optimizer step); grad norm and learning rate sit at the number of calls their optim_step applied." },
    step: { label: "step", note: "By step: loss is the token-weighted mean of the step's forward_backward losses, tokens per call their mean, throughput the step's tokens ÷ its compute seconds." },
    time: { label: "seconds since the first call", note: "Against wall time: seconds since the run's first recorded call." },
  };

  // The five charts. Per-call values (rows: calls) on the step axis become one value per step (`byStep`, from that
  // step's calls); the optimizer's (rows: optim) are one per step already.
  const sum = (list, f) => list.reduce((total, item) => total + f(item), 0);
  const CHARTS = {
    loss: { title: "Loss", rows: "calls", field: "loss", colour: "79,70,229", fill: true,
            byStep: (cs) => sum(cs, (c) => c.loss * (c.tokens || 1)) / sum(cs, (c) => c.tokens || 1) },
    grad_norm: { title: "Grad norm", rows: "optim", field: "grad_norm", colour: "14,116,144" },
    learning_rate: { title: "Learning rate", rows: "optim", field: "learning_rate", colour: "14,116,144" },
    num_tokens: { title: "Tokens per call", rows: "calls", field: "tokens", colour: "14,116,144",
                  byStep: (cs) => sum(cs, (c) => c.tokens) / cs.length },
    throughput: { title: "Throughput", rows: "calls", field: "throughput", colour: "14,116,144",
                  byStep: (cs) => sum(cs, (c) => c.tokens) / sum(cs, (c) => c.tokens / c.throughput) },  // tokens ÷ seconds
  };

  // A user-reported metric (stored as "user:<name>") gets its own chart, drawn like the optimizer's: one value a step.
  const USER = "user:", userRows = new Map();  // name → [{step, t, value}]
  function addUserChart(name) {
    const id = "user-" + userRows.size;
    const card = document.createElement("section");
    card.className = "card chart-card";
    card.dataset.metric = USER + name;
    const head = document.createElement("div");
    head.className = "card-head";
    const title = document.createElement("h2");
    title.textContent = name;
    const reset = document.createElement("button");
    Object.assign(reset, { className: "btn small", type: "button", id: id + "-reset", hidden: true, textContent: "Reset zoom" });
    head.append(title, reset);
    const host = document.createElement("div");
    Object.assign(host, { className: "chart small-chart", id: id + "-chart" });
    host.setAttribute("role", "img");
    const table = document.createElement("div");
    Object.assign(table, { className: "table-scroll chart-table", id: id + "-table", tabIndex: 0, hidden: true });
    card.append(head, host, table);
    $("user-metric-charts").append(card);
    userRows.set(name, []);
    CHARTS[id] = { title: name, rows: "user", name, colour: "190,24,93" };
    CHARTS[id].view = makeChart(id, 200);
    if (tableView) CHARTS[id].view.toggle();
  }

  const origin = () => Math.min(calls.length ? calls[0].t : Infinity, optim.length ? optim[0].t : Infinity);

  // How many forward_backward calls came before `step` (those its optim_step applied), for each of `steps` (ascending).
  function callsBefore(steps) {
    const perStep = new Map();
    for (const c of calls) perStep.set(c.step, (perStep.get(c.step) || 0) + 1);
    const keys = [...perStep.keys()].sort((a, b) => a - b);
    let k = 0, count = 0;
    return steps.map((step) => {
      while (k < keys.length && keys[k] < step) count += perStep.get(keys[k++]);
      return count;
    });
  }

  // A chart's raw points against the axis: [xs, ys], xs ascending.
  function points(chart, axis) {
    const t0 = origin();
    if (chart.rows === "optim" || chart.rows === "user") {
      const rows = chart.rows === "user" ? userRows.get(chart.name) : optim.filter((o) => o[chart.field] != null);
      const xs = axis === "step" ? rows.map((o) => o.step) : axis === "time" ? rows.map((o) => o.t - t0)
        : callsBefore(rows.map((o) => o.step));
      return [xs, rows.map((o) => (chart.rows === "user" ? o.value : o[chart.field]))];
    }
    const numbered = calls.map((c, i) => [i + 1, c]).filter(([, c]) => c[chart.field] != null);
    if (axis === "call") return [numbered.map(([n]) => n), numbered.map(([, c]) => c[chart.field])];
    if (axis === "time") return [numbered.map(([, c]) => c.t - t0), numbered.map(([, c]) => c[chart.field])];
    const steps = new Map();
    for (const [, c] of numbered) steps.set(c.step, [...(steps.get(c.step) || []), c]);
    const xs = [...steps.keys()].sort((a, b) => a - b);
    return [xs, xs.map((x) => chart.byStep(steps.get(x)))];
  }

  // Where a marker at `step` (made at time `t`) sits on the axis: on the call axis, after the last call before that
  // step (a checkpoint holds the weights those calls trained).
  function markX(axis, step, t) {
    if (axis === "step") return step;
    if (axis === "time") return t - origin();
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

  for (const [name, chart] of Object.entries(CHARTS)) chart.view = makeChart(name, name === "loss" ? 300 : 200);
  const lossChart = CHARTS.loss.view;

  // Every chart drawn with the shared controls: the axis, smoothing (a second, smoothed series) and a log scale (which
  // has no place for 0 or below). Its table view lists the raw points.
  function draw(name) {
    const chart = CHARTS[name], axis = axisNow(), [xs, ys] = points(chart, axis);
    if (!xs.length) return;
    const factor = Number(control("chart-smooth").value), log = control("chart-log").checked;
    const drawn = (values) => (log ? values.map((y) => (y > 0 ? y : null)) : values);
    const data = factor > 0 ? [xs, drawn(ys), drawn(smoothed(ys, factor))] : [xs, drawn(ys)];
    const label = chart.title.toLowerCase();
    const series = [{ label, stroke: factor > 0 ? `rgba(${chart.colour},.3)` : `rgb(${chart.colour})`, width: factor > 0 ? 1 : 2,
                      fill: chart.fill && !(factor > 0) ? `rgba(${chart.colour},.08)` : undefined, points: { show: xs.length < 60 } }];
    if (factor > 0) series.push({ label: "smoothed", stroke: `rgb(${chart.colour})`, width: 2, points: { show: false } });
    chart.view.show({
      key: [axis, log, factor > 0].join("|"), title: chart.title, xLabel: AXES[axis].label, yLabel: label, log, series,
      xIncrs: axis === "time" ? undefined : STEP_INCRS, xFormat: axis === "time" ? (x) => x.toFixed(1) : String,
      marks: name === "loss" ? () => marks(axis) : undefined,
    }, data, [xs, ys]);
  }
  const axisNow = () => control("chart-x").value;

  function drawAll() {
    for (const name of Object.keys(CHARTS)) draw(name);
    control("chart-note").textContent = AXES[axisNow()].note;
  }

  for (const id of ["chart-x", "chart-smooth", "chart-log"]) control(id).addEventListener("input", drawAll);
  control("chart-table-toggle").addEventListener("click", (event) => {
    tableView = !tableView;
    event.currentTarget.setAttribute("aria-pressed", String(tableView));
    event.currentTarget.textContent = tableView ? "Chart view" : "Table view";
    for (const chart of Object.values(CHARTS)) chart.view.toggle();
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
      } else if (row.name.startsWith(USER)) {
        const name = row.name.slice(USER.length);
        if (!userRows.has(name)) addUserChart(name);
        userRows.get(name).push({ step: row.step, t: row.t, value: row.value });
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
    drawAll();
    lossEl.dataset.points = String(calls.length);
  }

  // Checkpoints saved anywhere (the SDK, the page, Tinker) are marked on the loss chart; one the checkpoints card does
  // not list yet brings the card's list again (only the list: the push form keeps what is being typed in it).
  function onCheckpoints(rows) {
    let unlisted = false;
    for (const row of rows) {
      lastCheckpointId = Math.max(lastCheckpointId, row.id);
      if (row.mode !== "sampler") checkpoints.set(row.id, row);  // sampler snapshots are for sampling, not markers
      unlisted = unlisted || !document.querySelector(`#checkpoints [data-checkpoint-id="${row.id}"]`);
    }
    describeMarks();
    lossChart.redraw();
    if (unlisted) htmx.ajax("GET", `/runs/${live.dataset.runId}/checkpoints`,
                            { target: "#checkpoint-list", select: "#checkpoint-list", swap: "outerHTML" });
  }

  // A checkpoint deleted from the card (or gone when its list is fetched again) loses its marker.
  document.body.addEventListener("htmx:afterSettle", (event) => {
    if (event.target.id !== "checkpoints" && event.target.id !== "checkpoint-list") return;
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
