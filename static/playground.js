// The playground's stream (issue 18 §4): the result card the POST answers names a one-time stream; this opens it,
// appends each decode chunk's text as it comes, shows elapsed time and tokens per second, and Cancel closes the
// stream, which stops the generation on the server (the sample is kept, marked cancelled).
(function () {
  "use strict";
  let current = null; // the open stream: a new sample closes the one before

  function start(box) {
    if (current) current.close();
    const outputs = [...box.querySelectorAll(".output")];
    const status = box.querySelector("[data-play-status]");
    const elapsedEl = box.querySelector("[data-play-elapsed]");
    const rateEl = box.querySelector("[data-play-rate]");
    const cancel = box.querySelector("[data-play-cancel]");
    const tokens = outputs.map(() => 0);
    const began = performance.now();
    let progress = 0;
    const source = new EventSource(box.dataset.stream);
    current = source;
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
      source.close();
      if (current === source) current = null;
      clearInterval(timer);
      tick();
      box.dataset.state = state;
      status.textContent = text;
      cancel.disabled = true;
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
    source.addEventListener("error", () => { // a stream that breaks (or a 404): EventSource would retry; we stop
      if (box.dataset.state === "streaming") end("failed", "The stream was interrupted.");
    });
    cancel.addEventListener("click", () => {
      end("cancelled", "Cancelled: kept in the run's history, marked cancelled");
      outputs.forEach((_, i) => meta(i, "cancelled"));
    });
  }

  htmx.onLoad((elt) => {
    const boxes = elt.matches && elt.matches(".play-stream") ? [elt] : [...elt.querySelectorAll(".play-stream")];
    boxes.forEach(start);
  });
})();
