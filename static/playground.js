// The playground (issue 18 §4). The result card the POST answers holds one pane per model compared, each naming a
// one-time stream; this opens them at once, appends each decode chunk's text as it comes, shows each pane's elapsed
// time and tokens per second, and Cancel closes every stream, which stops the generations on the server (the samples
// are kept, marked cancelled). The form's max tokens and n are bound together: n x max tokens is at most the
// server's per-call bound (data-sample-tokens), so the page stops what the server would refuse.
(function () {
  "use strict";
  let open = []; // the panes of the last sample: a new sample closes their streams

  function startPane(box, ended) {
    const outputs = [...box.querySelectorAll(".output")];
    const status = box.querySelector("[data-play-status]");
    const elapsedEl = box.querySelector("[data-play-elapsed]");
    const rateEl = box.querySelector("[data-play-rate]");
    const tokens = outputs.map(() => 0);
    const began = performance.now();
    let progress = 0;
    const source = new EventSource(box.dataset.stream);
    box.dataset.state = "streaming";
    status.textContent = "Generating…";

    function tick() {
      const seconds = (performance.now() - began) / 1000;
      const total = tokens.reduce((a, b) => a + b, 0);
      elapsedEl.textContent = seconds.toFixed(1);
      rateEl.textContent = seconds > 0 ? (total / seconds).toFixed(1) : "0.0";
    }
    const timer = setInterval(tick, 200);

    function end(state, text) {
      if (box.dataset.state !== "streaming") return;
      source.close();
      clearInterval(timer);
      tick();
      box.dataset.state = state;
      status.textContent = text;
      ended();
    }

    function meta(i, stop) {
      outputs[i].querySelector("[data-play-meta]").textContent =
        tokens[i] + " tokens" + (stop ? " · stopped: " + stop : "");
    }

    source.addEventListener("progress", (event) => {
      JSON.parse(event.data).forEach((piece, i) => {
        if (!outputs[i]) return;
        outputs[i].querySelector(".output-text").textContent += piece.text;
        tokens[i] += piece.tokens;
        meta(i, null);
      });
      progress += 1;
      box.dataset.progress = String(progress);
      tick();
    });
    source.addEventListener("done", (event) => {
      JSON.parse(event.data).forEach((seq, i) => {
        if (!outputs[i]) return;
        outputs[i].querySelector(".output-text").textContent = seq.text; // the whole answer: any end held back
        tokens[i] = seq.tokens;
        meta(i, seq.stop_reason);
      });
      end("done", "Done");
    });
    source.addEventListener("failed", (event) => end("failed", event.data));
    source.addEventListener("signed-out", (event) => end("failed", event.data)); // the session ended: sign in again
    source.addEventListener("error", () => end("failed", "The stream was interrupted.")); // no retry: we stop

    return {
      cancel() {
        if (box.dataset.state !== "streaming") return;
        end("cancelled", "Cancelled: kept in the history, marked cancelled");
        outputs.forEach((_, i) => meta(i, "cancelled"));
      },
      close() { end("closed", "Closed"); },
    };
  }

  function startAll(panes) {
    open.forEach((pane) => pane.close());
    const scope = panes.parentElement;
    const all = scope.querySelector("[data-play-all]");
    const cancel = scope.querySelector("[data-play-cancel]");
    const boxes = [...panes.querySelectorAll(".play-stream")];
    let left = boxes.length;
    all.textContent = boxes.length > 1 ? "Generating in " + boxes.length + " panes…" : "Generating…";
    open = boxes.map((box) => startPane(box, () => {
      left -= 1;
      if (left > 0) return;
      cancel.disabled = true;
      const states = boxes.map((b) => b.dataset.state);
      all.textContent = states.every((s) => s === "done") ? "Done" : "Ended: " + states.join(", ");
    }));
    const mine = open;
    cancel.addEventListener("click", () => mine.forEach((pane) => pane.cancel()));
  }

  htmx.onLoad((elt) => {
    const found = elt.matches && elt.matches(".play-panes") ? [elt] : [...elt.querySelectorAll(".play-panes")];
    found.forEach(startAll);
  });

  const maxTokens = document.getElementById("max_tokens");
  const count = document.getElementById("num_samples");
  if (maxTokens && count) {
    const bound = () => {
      const budget = Number(maxTokens.dataset.sampleTokens);
      const tokens = Math.max(1, Number(maxTokens.value) || 1);
      const n = Math.max(1, Number(count.value) || 1);
      maxTokens.max = String(Math.min(Number(maxTokens.dataset.limit), Math.floor(budget / n)));
      count.max = String(Math.max(1, Math.min(Number(count.dataset.limit), Math.floor(budget / tokens))));
    };
    maxTokens.addEventListener("input", bound);
    count.addEventListener("input", bound);
    bound();
  }
})();
