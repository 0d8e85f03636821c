// The admin page's tick charts (issue 18 §7): per pool, the rows and passes of each recent tick against its number,
// and the tick's seconds on a second axis. The numbers come from the page (data-ticks); the table below says the same.
(function () {
  "use strict";
  for (const chartEl of document.querySelectorAll(".ticks-chart[data-ticks]")) {
    const ticks = JSON.parse(chartEl.dataset.ticks);
    const data = [ticks.number, ticks.rows, ticks.passes, ticks.seconds];
    const many = ticks.number.length > 40;
    const plot = new uPlot({
      width: chartEl.clientWidth || 800, height: 240,
      scales: { x: { time: false }, s: {} },
      axes: [
        { label: "tick", stroke: "#4b5563", grid: { stroke: "#f1f5f9" },
          incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 100000, 1000000] },  // whole ticks
        { label: "rows, passes", stroke: "#4b5563", grid: { stroke: "#f1f5f9" } },
        { label: "seconds", scale: "s", side: 1, stroke: "#4b5563", grid: { show: false } },
      ],
      series: [
        { label: "tick" },
        { label: "rows", stroke: "#4f46e5", width: 2, points: { show: !many } },
        { label: "passes", stroke: "#059669", width: 2, points: { show: !many } },
        { label: "seconds", stroke: "#d97706", width: 2, scale: "s", points: { show: !many } },
      ],
      legend: { show: true },
    }, data, chartEl);
    new ResizeObserver(() => plot.setSize({ width: chartEl.clientWidth, height: 240 })).observe(chartEl);
    chartEl.dataset.points = String(ticks.number.length);
  }
})();
