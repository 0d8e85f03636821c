// The runs table, live (issue 18 §3): one `runs` event (#runs-new's hx-trigger="sse:runs") lists the page's runs'
// cells; each cell whose text differs gets the new text, and nothing else is touched. The row and its link stay the same nodes, so keyboard focus and a
// selection in another cell survive. Runs not on the page are not inserted (rows would move under the reader):
// a link says how many there are and reloads. Only the first page's stream sends such runs (web/runs.py runs_events):
// on later pages every run it sends is one the page shows.
(function () {
  "use strict";
  const table = document.getElementById("runs-table");
  if (!table) return;

  table.addEventListener("htmx:sseMessage", (event) => {
    if (event.detail.type !== "runs") return;
    let unseen = 0;
    for (const run of JSON.parse(event.detail.data)) {
      const row = table.querySelector(`tr[data-run-id="${CSS.escape(run.id)}"]`);
      if (!row) { unseen += 1; continue; }
      for (const cell of row.querySelectorAll("[data-cell]")) {
        const value = run[cell.dataset.cell];
        if (value === undefined || cell.textContent === value) continue;
        cell.textContent = value;
        if (cell.dataset.cell === "status") cell.className = "pill " + (value === "active" ? "ok" : "muted");
      }
    }
    const notice = document.getElementById("runs-new");
    notice.hidden = unseen === 0;
    notice.querySelector("a").textContent = unseen === 1 ? "1 new run: show it" : `${unseen} new runs: show them`;
  });

  // A click anywhere on a row opens its run (issue 18 §1), except on the row's controls (the compare box and its
  // cell, links) and when the click ended a text selection. Keyboard users have the row's link.
  table.addEventListener("click", (event) => {
    if (event.button !== 0 || event.target.closest("a, button, input, select, textarea, label, td.pick")) return;
    const row = event.target.closest("tbody tr[data-run-id]");
    const link = row && row.querySelector("a[href]");
    if (!link || getSelection().toString() !== "") return;
    if (event.ctrlKey || event.metaKey || event.shiftKey) window.open(link.href, "_blank", "noopener");
    else window.location.assign(link.href);
  });
})();
