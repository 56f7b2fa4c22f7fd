// Live parts of the console's pages, over server-sent events; no library, no build step.
// A page says what it follows on <body>: data-live (patches and feed items) and data-logs
// (a machine's log lines). Patches replace elements by id with HTML rendered by the server.
"use strict";
(() => {
  const status = document.getElementById("live-status");
  const say = (state, text) => {
    if (status) { status.dataset.state = state; status.textContent = text; }
  };

  function follow(url, handlers) {
    const source = new EventSource(url);
    source.onopen = () => say("live", "live");
    source.onerror = () => say("reconnecting", "reconnecting");
    for (const [name, handle] of Object.entries(handlers)) {
      source.addEventListener(name, (e) => handle(JSON.parse(e.data)));
    }
    window.addEventListener("pagehide", () => source.close());
    return source;
  }

  function patch(fragments) {
    for (const [id, html] of Object.entries(fragments)) {
      const el = document.getElementById(id);
      if (el) el.outerHTML = html;
    }
  }

  function feed(html) {
    const list = document.getElementById("feed");
    if (!list) return;
    list.insertAdjacentHTML("afterbegin", html);
    const max = Number(list.dataset.max || 50);
    while (list.children.length > max) list.lastElementChild.remove();
  }

  function append({ target, html }) {
    const el = document.getElementById(target);
    if (el) el.insertAdjacentHTML("beforeend", html);
  }

  const body = document.body;
  if (body.dataset.live) {
    const list = document.getElementById("feed");
    const after = list ? list.dataset.seq || "0" : "0";
    const url = new URL(body.dataset.live, location.href);
    url.searchParams.set("after", after);
    follow(url, { patch, feed, append });
  }

  if (body.dataset.logs) {
    const pre = document.getElementById("logs");
    const max = Number(pre.dataset.max || 500);
    const write = (lines, reset) => {
      const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
      const kept = reset ? [] : pre.textContent.split("\n").filter((l, i, a) => i < a.length - 1 || l);
      const all = kept.concat(lines).slice(-max);
      pre.textContent = all.length ? all.join("\n") + "\n" : "";
      if (atEnd) pre.scrollTop = pre.scrollHeight;
    };
    follow(body.dataset.logs, {
      tail: (lines) => write(lines, true),
      line: (line) => write([line], false),
    });
  }
})();
