// Signal dashboard behaviour that htmx does not cover: error toasts and copy buttons.
(function () {
  "use strict";

  function toast(message, kind) {
    const box = document.getElementById("toasts");
    if (!box) return;
    const item = document.createElement("div");
    item.className = "toast " + (kind || "");
    const text = document.createElement("span");
    text.textContent = message;
    const close = document.createElement("button");
    close.type = "button";
    close.setAttribute("aria-label", "Dismiss");
    close.textContent = "×";
    close.onclick = () => item.remove();
    item.append(text, close);
    box.append(item);
    setTimeout(() => item.remove(), kind === "error" ? 12000 : 4000);
  }
  window.signalToast = toast;

  // htmx 2 swaps nothing on 4xx/5xx: show the server's message instead of silently doing nothing.
  document.addEventListener("htmx:responseError", (event) => {
    const xhr = event.detail.xhr;
    const text = (xhr.responseText || "").trim();
    const plain = text && !text.startsWith("<") ? text : "Request failed (HTTP " + xhr.status + ").";
    toast(plain, "error");
  });
  document.addEventListener("htmx:sendError", () => {
    toast("Could not reach the server. Check your connection and try again.", "error");
  });

  // A form marked data-reset-on-success empties after its request succeeds (the key form: Enter again would make a
  // duplicate).
  document.addEventListener("htmx:afterRequest", (event) => {
    const elt = event.detail.elt;
    if (event.detail.successful && elt instanceof HTMLFormElement && elt.matches("[data-reset-on-success]")) elt.reset();
  });
  // A revoke (data-revokes="key id") takes that key's secret box away: the secret is dead. Before the swap, since the
  // swap replaces the button; detail.elt is the target here, the button is requestConfig.elt.
  document.addEventListener("htmx:beforeSwap", (event) => {
    const elt = event.detail.requestConfig && event.detail.requestConfig.elt;
    if (event.detail.isError || !(elt instanceof HTMLElement) || !elt.dataset.revokes) return;
    for (const box of document.querySelectorAll(".secret-box[data-key-id]")) {
      if (box.dataset.keyId === elt.dataset.revokes) box.remove();
    }
  });

  // Copy buttons: data-copy="#selector" copies that element's text.
  document.addEventListener("click", (event) => {
    const button = event.target.closest("[data-copy]");
    if (!button) return;
    const source = document.querySelector(button.dataset.copy);
    if (!source) return;
    const text = source.textContent.trim();
    const done = () => {
      const label = button.textContent;
      button.textContent = "Copied";
      setTimeout(() => (button.textContent = label), 1500);
    };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, () => toast("Copy failed; select the text instead.", "error"));
    } else {
      // Plain-http servers have no clipboard API: select the text for the user to copy.
      const range = document.createRange();
      range.selectNodeContents(source);
      const selection = window.getSelection();
      selection.removeAllRanges();
      selection.addRange(range);
      toast("Selected: press Ctrl-C (⌘-C) to copy.");
    }
  });
})();

// Session streams (issue 18 §5): a stream whose session ended sends `signed-out`, and its element's
// sse-close="signed-out" closes it (the SSE extension would reconnect forever otherwise). Say so, with a way back.
(function () {
  "use strict";
  document.addEventListener("htmx:sseClose", (event) => {
    if (!event.detail || event.detail.type !== "message") return;
    for (const state of document.querySelectorAll(".live-state")) {
      state.dataset.state = "signed-out";
      const label = state.querySelector(".label");
      if (label) label.textContent = "Signed out";
    }
    if (document.getElementById("signed-out")) return;
    const banner = document.createElement("div");
    banner.id = "signed-out";
    banner.className = "alert error signed-out";
    banner.setAttribute("role", "alert");
    const text = document.createElement("strong");
    text.textContent = "Signed out.";
    const link = document.createElement("a");
    link.href = "/login?next=" + encodeURIComponent(location.pathname + location.search);
    link.textContent = "Sign in again";
    banner.append(text, document.createTextNode("This page stopped updating."), link);
    (document.querySelector("main") || document.body).prepend(banner);
  });
})();

// The phone menu (issue 18 §9): below 900 px the sidebar folds behind a Menu button; app.css shows the menu while
// the button says aria-expanded="true".
(function () {
  "use strict";
  const toggle = document.querySelector(".menu-toggle");
  if (!toggle) return;
  toggle.addEventListener("click", () => {
    toggle.setAttribute("aria-expanded", toggle.getAttribute("aria-expanded") === "true" ? "false" : "true");
  });
})();
