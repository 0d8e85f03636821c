// The usage page's chart (issue 18 §6): compute seconds per day as bars, cost in credits as a line on its own axis.
// The points come from the page (data-days: [[YYYY-MM-DD, seconds, credits], ...], oldest first); days without calls
// are absent, so the bars stand on the days that had some.
(function () {
  "use strict";
  const chartEl = document.getElementById("usage-chart");
  if (!chartEl) return;
  const days = JSON.parse(chartEl.dataset.days);
  const noon = (day) => Date.parse(day + "T12:00:00Z") / 1000;
  // The whole window, half a day either side of its first and last day, whether or not they had calls.
  const window_ = [noon(chartEl.dataset.since) - 43200, noon(chartEl.dataset.until) + 43200];
  const xs = days.map((d) => noon(d[0])); // noon UTC: the bar sits on its day
  const data = [xs, days.map((d) => d[1]), days.map((d) => d[2])];
  const bars = uPlot.paths.bars({ size: [0.6, 48] });
  const plot = new uPlot({
    width: chartEl.clientWidth || 800, height: 220, tzDate: (ts) => uPlot.tzDate(new Date(ts * 1000), "Etc/UTC"),
    scales: { x: { time: true, range: () => window_ }, credits: { auto: true } },
    axes: [{ stroke: "#4b5563", grid: { show: false } },
           { label: "compute s", stroke: "#4b5563", grid: { stroke: "#f1f5f9" } },
           { scale: "credits", label: "credits", side: 1, stroke: "#4b5563", grid: { show: false } }],
    series: [{ label: "day" },
             { label: "compute seconds", fill: "rgba(79,70,229,.35)", stroke: "#4f46e5", paths: bars, points: { show: false } },
             { label: "credits", scale: "credits", stroke: "#dc2626", width: 2 }],
    legend: { show: true },
  }, data, chartEl);
  new ResizeObserver(() => plot.setSize({ width: chartEl.clientWidth, height: 220 })).observe(chartEl);
  chartEl.dataset.points = String(xs.length);
})();
