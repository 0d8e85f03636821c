// The playground (issue 18 §4). The result card the POST answers holds one pane per model compared and names one
// one-time stream for them all; this opens it, appends each decode chunk's text as it comes, shows each pane's elapsed
// time, its first token's and its tokens per second, counted from its first token (queue and prefill time are not
// decode speed). The result card is scrolled into view when it arrives. A pane's Cancel (htmx POSTs it) stops that pane's generation on the server, which ends
// it in the stream with stop reason "cancelled", the other panes going on; "Cancel all" closes the stream, which stops
// them all (the samples are kept, marked cancelled). The form's max tokens and n are bound together: n x max tokens is at most the
// server's per-call bound (data-sample-tokens), so the page stops what the server would refuse.
(function () {
  "use strict";
  let current = null; // the last sample's stream: a new sample closes it

  // One pane's view: its outputs, state, elapsed time and rate.
  function pane(box) {
    const outputs = [...box.querySelectorAll(".output")];
    const status = box.querySelector("[data-play-status]");
    const elapsedEl = box.querySelector("[data-play-elapsed]");
    const rateEl = box.querySelector("[data-play-rate]");
    const firstEl = box.querySelector("[data-play-first]");
    const cancelButton = box.querySelector("[data-pane-cancel]");
    if (cancelButton) {
      cancelButton.addEventListener("click", () => { if (streaming()) status.textContent = "Cancelling…"; });
      cancelButton.addEventListener("htmx:afterRequest", (event) => { // refused (it had ended meanwhile): say so
        if (!event.detail.successful && streaming()) status.textContent = "Generating… (Cancel was refused)";
      });
    }
    const tokens = outputs.map(() => 0);
    const began = performance.now();
    let firstAt = null; // when the first chunk with tokens came: the rate counts the tokens after it, from then
    let firstTokens = 0;
    let progress = 0;
    box.dataset.state = "streaming";
    status.textContent = "Generating…";

    const streaming = () => box.dataset.state === "streaming";
    function tick() {
      const now = performance.now();
      const total = tokens.reduce((a, b) => a + b, 0);
      elapsedEl.textContent = ((now - began) / 1000).toFixed(1);
      box.dataset.elapsedMs = String(Math.round(now - began));
      if (firstAt === null) return;
      const decoding = (now - firstAt) / 1000;
      if (decoding > 0 && total > firstTokens) rateEl.textContent = ((total - firstTokens) / decoding).toFixed(1);
    }
    function first(total) {
      if (firstAt !== null || total === 0) return;
      firstAt = performance.now();
      firstTokens = total;
      box.dataset.firstMs = String(Math.round(firstAt - began));
      box.dataset.firstTokens = String(total);
      firstEl.textContent = ((firstAt - began) / 1000).toFixed(1);
    }
    function meta(i, stop) {
      outputs[i].querySelector("[data-play-meta]").textContent =
        tokens[i] + " tokens" + (stop ? " · stopped: " + stop : "");
    }
    function end(state, text) {
      if (!streaming()) return;
      tick();
      box.dataset.state = state;
      status.textContent = text;
      if (cancelButton) cancelButton.disabled = true; // nothing left to stop
    }
    return {
      streaming,
      tick,
      end,
      progress(pieces) {
        pieces.forEach((piece, i) => {
          if (!outputs[i]) return;
          outputs[i].querySelector(".output-text").textContent += piece.text;
          tokens[i] += piece.tokens;
          meta(i, null);
        });
        first(tokens.reduce((a, b) => a + b, 0));
        progress += 1;
        box.dataset.progress = String(progress);
        tick();
      },
      done(sequences) {
        sequences.forEach((seq, i) => {
          if (!outputs[i]) return;
          outputs[i].querySelector(".output-text").textContent = seq.text; // the whole answer: any end held back
          tokens[i] = seq.tokens;
          meta(i, seq.stop_reason);
        });
        first(tokens.reduce((a, b) => a + b, 0)); // all in one answer: its first token came with it, no rate
        if (sequences.some((seq) => seq.stop_reason === "cancelled")) {
          end("cancelled", "Cancelled: kept in the history, marked cancelled");
        } else {
          end("done", "Done");
        }
      },
      cancel() {
        if (!streaming()) return;
        end("cancelled", "Cancelled: kept in the history, marked cancelled");
        outputs.forEach((_, i) => meta(i, "cancelled"));
      },
    };
  }

  // The result card: one stream for every pane, each event naming its pane.
  function start(panes) {
    if (current) current();
    const scope = panes.parentElement;
    const all = scope.querySelector("[data-play-all]");
    const cancel = scope.querySelector("[data-play-cancel]");
    const boxes = [...panes.querySelectorAll(".play-stream")];
    const views = boxes.map(pane);
    const still = window.matchMedia("(prefers-reduced-motion: reduce)").matches;
    scope.scrollIntoView({ block: "start", behavior: still ? "auto" : "smooth" }); // below the form: bring it up
    const source = new EventSource(panes.dataset.stream);
    const timer = setInterval(() => views.forEach((view) => view.streaming() && view.tick()), 200);
    all.textContent = boxes.length > 1 ? "Generating in " + boxes.length + " panes…" : "Generating…";

    function stop() {
      source.close();
      clearInterval(timer);
      cancel.disabled = true;
    }
    current = () => { views.forEach((view) => view.end("closed", "Closed")); stop(); };
    function settle() { // every pane ended: the stream is done with
      if (views.some((view) => view.streaming())) return;
      stop();
      const states = boxes.map((box) => box.dataset.state);
      all.textContent = states.every((state) => state === "done") ? "Done" : "Ended: " + states.join(", ");
    }
    const each = (handle) => (event) => {
      const data = JSON.parse(event.data);
      if (views[data.pane]) handle(views[data.pane], data);
      settle();
    };
    source.addEventListener("progress", each((view, data) => view.progress(data.pieces)));
    source.addEventListener("done", each((view, data) => view.done(data.sequences)));
    // CANCELLED: the pane's Cancel came before its generation began, so nothing was made.
    source.addEventListener("failed", each((view, data) => (data.code === "CANCELLED"
      ? view.end("cancelled", "Cancelled before it began") : view.end("failed", data.message))));
    const fail = (text) => { views.forEach((view) => view.end("failed", text)); settle(); };
    source.addEventListener("signed-out", (event) => fail(event.data)); // the session ended: sign in again
    source.addEventListener("error", () => fail("The stream was interrupted.")); // no retry: we stop
    cancel.addEventListener("click", () => { views.forEach((view) => view.cancel()); settle(); });
  }

  htmx.onLoad((elt) => {
    const found = elt.matches && elt.matches(".play-panes") ? [elt] : [...elt.querySelectorAll(".play-panes")];
    found.forEach(start);
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
