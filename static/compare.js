// The compare page's chart (issue 18 §2): each run's loss against step, overlaid, one legend entry per run. The
// points come from the page (data-curves); steps one run lacks are gaps in its line, bridged so each stays one curve.
(function () {
  "use strict";
  const chartEl = document.getElementById("compare-chart");
  if (!chartEl) return;
  const curves = JSON.parse(chartEl.dataset.curves);
  const COLORS = ["#4f46e5", "#dc2626", "#059669", "#d97706", "#0891b2", "#7c3aed", "#db2777", "#4b5563"];

  // uPlot wants one shared x: the union of every run's steps, each run's loss (or null) at each.
  const xs = [...new Set(curves.flatMap((c) => c.steps))].sort((a, b) => a - b);
  const data = [xs, ...curves.map((c) => {
    const at = new Map(c.steps.map((step, i) => [step, c.losses[i]]));
    return xs.map((x) => (at.has(x) ? at.get(x) : null));
  })];
  const series = [{ label: "step" }, ...curves.map((c, i) => ({
    label: c.name, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true, points: { show: xs.length < 60 },
  }))];
  const plot = new uPlot({
    width: chartEl.clientWidth || 800, height: 300,
    scales: { x: { time: false } },
    axes: [{ label: "step", stroke: "#4b5563", grid: { stroke: "#f1f5f9" },
             incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000] },
           { label: "loss", stroke: "#4b5563", grid: { stroke: "#f1f5f9" } }],
    series, legend: { show: true },
  }, data, chartEl);
  new ResizeObserver(() => plot.setSize({ width: chartEl.clientWidth, height: 300 })).observe(chartEl);
  chartEl.dataset.series = String(curves.length);
})();
