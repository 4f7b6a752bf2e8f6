// The dashboard page: polls the JSON API with fetch(), draws the tables and charts,
// and sends the controls' POSTs with the access token (kept in sessionStorage).
// Every piece of data is inserted as text (textContent), never as HTML.
"use strict";

(function () {
  const TOKEN_KEY = "workpool-dashboard-token";
  const POOLS_EVERY_MS = 1000;
  const POOL_EVERY_MS = 3000;
  const CHART_MINUTES = 30;
  const COLORS = {
    succeeded: "#16a34a", retries: "#f59e0b", failed: "#dc2626", canceled: "#9ca3af",
    backlog: "#2563eb", running: "#16a34a", scheduled: "#a855f7",
    p50: "#16a34a", p95: "#f59e0b", p99: "#dc2626",
  };

  const $ = (selector) => document.querySelector(selector);
  let selected = null;
  let lastPool = null;
  const rows = new Map();

  // --- helpers --------------------------------------------------------------------------
  function h(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "class") node.className = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else if (key === "data") Object.assign(node.dataset, value);
      else node.setAttribute(key, value);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  function seconds(v) {
    if (!v) return "-";
    if (v < 1) return Math.round(v * 1000) + " ms";
    if (v < 60) return (Math.round(v * 10) / 10) + " s";
    return Math.round(v / 60) + " min";
  }

  function relative(t, now) {
    const d = Math.abs(now - t);
    const text = d < 1 ? Math.round(d * 1000) + " ms" : d < 90 ? Math.round(d) + " s"
      : d < 5400 ? Math.round(d / 60) + " min" : Math.round(d / 3600) + " h";
    return t > now ? "in " + text : text + " ago";
  }

  function when(t, now) {
    if (t === null || t === undefined) return null;
    return new Date(t * 1000).toLocaleString() + " (" + relative(t, now) + ")";
  }

  // --- token ----------------------------------------------------------------------------
  function takeTokenFromFragment() {
    const match = /(?:^#|&)token=([^&]+)/.exec(location.hash);
    if (match) {
      sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(match[1]));
      history.replaceState(null, "", location.pathname + location.search);
    }
  }

  function token() {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  }

  async function checkToken() {
    const state = $("#token-state");
    if (!token()) {
      state.textContent = "no token: read only";
      return;
    }
    try {
      const answer = await api("/api/auth");
      state.textContent = answer.token === "valid" ? "token accepted" : "token refused";
    } catch (err) {
      state.textContent = "";
    }
  }

  // --- API ------------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  async function api(path, method, body) {
    const headers = { Accept: "application/json" };
    if (token()) headers.Authorization = "Bearer " + token();
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let response;
    try {
      response = await fetch(path, {
        method: method || "GET",
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        cache: "no-store",
      });
    } catch (err) {
      throw new ApiError(0, "cannot reach the dashboard server");
    }
    let data = null;
    try {
      data = await response.json();
    } catch (err) {
      data = null;
    }
    if (!response.ok) {
      throw new ApiError(response.status, (data && data.error) || response.statusText);
    }
    return data;
  }

  function say(text, kind) {
    const box = $("#message");
    box.textContent = text;
    box.className = kind;
    box.hidden = false;
  }

  function failed(err) {
    if (err.status === 401) {
      say("Refused: " + err.message + ". Paste the access token that `workpool dashboard`"
        + " printed at start-up into the field at the top.", "error");
      $("#token-state").textContent = token() ? "token refused" : "no token: read only";
    } else {
      say(err.message, "error");
    }
  }

  // --- pools table ----------------------------------------------------------------------
  function stateOf(p) {
    if (p.paused) return "paused";
    if (p.running > 0 || p.completing > 0) return "running";
    if (p.backlog > 0) return "waiting";
    if (p.scheduled > 0) return "scheduled";
    return "idle";
  }

  function poolRow(name) {
    let row = rows.get(name);
    if (row) return row;
    const cells = {};
    const tr = h("tr", { data: { pool: name } });
    for (const field of ["name", "state", "running", "backlog", "scheduled", "completing",
      "finished", "failure", "lag", "controls"]) {
      const numeric = !["name", "state", "controls"].includes(field);
      cells[field] = h("td", { class: numeric ? "num" : "", data: { field } });
      tr.append(cells[field]);
    }
    cells.name.append(h("button", { class: "link", type: "button", onclick: () => select(name) }, name));
    const toggle = h("button", { type: "button", data: { action: "toggle" } }, "Pause");
    toggle.addEventListener("click", () => {
      const resume = toggle.dataset.paused === "true";
      act(name, resume ? "resume" : "pause", {}, (r) =>
        resume ? `Pool ${name} resumed: max_parallelism ${r.pool.max_parallelism}.`
          : `Pool ${name} paused: running work finishes, nothing new starts.`);
    });
    const limit = h("input", { class: "limit", type: "number", min: "0", step: "1",
      "aria-label": "max_parallelism", data: { action: "limit" } });
    const set = h("button", { type: "button", data: { action: "set" } }, "Set limit");
    set.addEventListener("click", () => {
      const value = Number(limit.value);
      if (limit.value === "" || !Number.isInteger(value) || value < 0) {
        say("max_parallelism must be a whole number, 0 or more (0 pauses).", "error");
        return;
      }
      act(name, "configure", { max_parallelism: value }, (r) => {
        limit.value = "";
        return `Pool ${name}: max_parallelism ${r.pool.max_parallelism}.`;
      });
    });
    const cancel = h("button", { type: "button", class: "danger", data: { action: "cancel-all" } }, "Cancel all");
    cancel.addEventListener("click", () => {
      if (!window.confirm(`Cancel every pending and running item of pool ${name}?`)) return;
      act(name, "cancel-all", {}, (r) => `Canceled ${r.canceled} work items of pool ${name}.`);
    });
    cells.controls.append(h("div", { class: "controls" }, toggle, limit, set, cancel));
    $("#pools tbody").append(tr);
    row = { tr, cells, toggle, limit };
    rows.set(name, row);
    return row;
  }

  function showPool(p) {
    const row = poolRow(p.pool);
    const c = row.cells;
    const state = stateOf(p);
    c.state.replaceChildren(h("span", { class: "badge " + state }, state));
    if (state !== "idle") c.state.append(h("div", { class: "muted note" }, p.note));
    c.state.title = p.note;
    c.running.textContent = `${p.running} / ${p.paused ? "paused" : p.max_parallelism}`;
    c.backlog.textContent = p.backlog;
    c.scheduled.textContent = p.scheduled;
    c.completing.textContent = p.completing;
    c.finished.textContent = p.finished;
    c.failure.textContent = p.completed
      ? `${(p.failure_rate * 100).toFixed(1)}% of ${p.completed}` : "-";
    c.lag.textContent = [p.start_lag_p50, p.start_lag_p95, p.start_lag_p99].map(seconds).join(" / ");
    row.toggle.textContent = p.paused ? "Resume" : "Pause";
    row.toggle.dataset.paused = String(p.paused);
    row.limit.placeholder = String(p.max_parallelism);
    row.tr.classList.toggle("selected", p.pool === selected);
  }

  async function refreshPools() {
    try {
      const data = await api("/api/pools");
      $("#store").textContent = data.store;
      $("#updated").textContent = "updated " + new Date(data.now * 1000).toLocaleTimeString();
      const names = new Set(data.pools.map((p) => p.pool));
      for (const [name, row] of rows) {
        if (!names.has(name)) { row.tr.remove(); rows.delete(name); }
      }
      data.pools.forEach(showPool);
      $("#no-pools").hidden = data.pools.length > 0;
      if (selected === null && data.pools.length > 0) select(data.pools[0].pool);
    } catch (err) {
      failed(err);
    }
  }

  async function act(name, path, body, done) {
    try {
      const answer = await api(`/api/pools/${encodeURIComponent(name)}/${path}`, "POST", body);
      say(done(answer), "info");
      if (answer.pool) showPool(answer.pool);
      refreshPools();
      if (selected === name) refreshSelected();
    } catch (err) {
      failed(err);
    }
  }

  // --- one pool: charts and failures ----------------------------------------------------
  function select(name) {
    selected = name;
    for (const [pool, row] of rows) row.tr.classList.toggle("selected", pool === name);
    refreshSelected();
  }

  async function refreshSelected() {
    if (selected === null) return;
    try {
      lastPool = await api(`/api/pools/${encodeURIComponent(selected)}?minutes=${CHART_MINUTES}`);
      drawPool();
    } catch (err) {
      failed(err);
    }
  }

  function drawPool() {
    const d = lastPool;
    if (!d) return;
    $("#pool-section").hidden = false;
    $("#pool-name").textContent = d.pool.pool;
    $("#chart-minutes").textContent = CHART_MINUTES;
    const to = d.now;
    const from = to - CHART_MINUTES * 60;
    const perMinute = (key) => d.history.map((m) => [m.t, m[key]]);
    window.drawChart($("#chart-throughput"), {
      bars: true, from, to: to + 60,
      series: [
        { name: "succeeded", color: COLORS.succeeded, points: perMinute("succeeded") },
        { name: "retried", color: COLORS.retries, points: perMinute("retries") },
        { name: "failed", color: COLORS.failed, points: perMinute("failed") },
        { name: "canceled", color: COLORS.canceled, points: perMinute("canceled") },
      ],
      integer: true,
      format: (v) => String(Math.round(v)),
      empty: "nothing completed in this span",
    });
    const sampled = (key) => d.samples.map((s) => [s.t, s[key]]);
    // The samples start when this server did: show at least 10 s, at most the span.
    const first = d.samples.length ? d.samples[0].t : to;
    window.drawChart($("#chart-backlog"), {
      from: Math.max(from, Math.min(first - 1, to - 10)), to,
      series: [
        { name: "due backlog", color: COLORS.backlog, points: sampled("backlog") },
        { name: "running", color: COLORS.running, points: sampled("running") },
        { name: "scheduled", color: COLORS.scheduled, points: sampled("scheduled") },
      ],
      integer: true,
      format: (v) => String(Math.round(v)),
      empty: "sampling… (kept while this server runs)",
    });
    const lag = (key) => d.history.map((m) => [m.t + 30, m.completed ? m[key] : null]);
    window.drawChart($("#chart-lag"), {
      log: true, dots: true, from, to: to + 60,
      series: [
        { name: "p50", color: COLORS.p50, points: lag("lag_p50") },
        { name: "p95", color: COLORS.p95, points: lag("lag_p95") },
        { name: "p99", color: COLORS.p99, points: lag("lag_p99") },
      ],
      format: seconds,
      empty: "no attempts started in this span",
    });
    const body = $("#failures tbody");
    body.replaceChildren(...d.failures.map((f) => h("tr", {},
      h("td", {}, when(f.finished_at, d.now)),
      h("td", { class: "mono" }, h("button", { class: "link", type: "button",
        onclick: () => showWork(f.work_id) }, f.work_id)),
      h("td", {}, f.fn_name),
      h("td", { class: "num" }, f.attempts),
      h("td", { class: "error" }, (f.result && f.result.error) || f.last_error || ""))));
    $("#no-failures").hidden = d.failures.length > 0;
  }

  // --- one work item --------------------------------------------------------------------
  async function showWork(id) {
    id = id.trim();
    if (!id) return;
    $("#search-input").value = id;
    const box = $("#work-detail");
    try {
      renderWork(await api(`/api/work/${encodeURIComponent(id)}`));
    } catch (err) {
      if (err.status === 404) box.replaceChildren(h("p", { class: "muted" }, err.message));
      else failed(err);
    }
  }

  function renderWork(d) {
    const info = d.info;
    const st = d.status;
    const now = Date.now() / 1000;
    const head = st.state + (st.reason ? " · " + st.reason.replaceAll("_", " ") : "");
    const items = [
      ["work id", info.work_id],
      ["pool", info.pool],
      ["function", `${info.fn_name} (${info.kind})`],
      ["attempts", info.max_attempts ? `${info.attempts} of at most ${info.max_attempts}` : info.attempts],
      ["args", h("pre", { class: "mono" }, JSON.stringify(info.args, null, 2))],
      ["enqueued", when(info.enqueued_at, now)],
      ["due", info.state === "pending" ? when(info.due_at, now) : null],
      ["started", when(info.started_at, now)],
      ["finished", when(info.finished_at, now)],
      ["worker", info.worker_id],
      ["last error", info.last_error],
      ["result", info.result ? h("pre", { class: "mono" }, JSON.stringify(info.result, null, 2)) : null],
      ["on_complete", info.on_complete ? info.on_complete + (info.on_complete_error
        ? " (given up: " + info.on_complete_error + ")" : "") : null],
      ["cancel", info.cancel_requested ? "requested: not retried" : null],
    ];
    const list = h("dl", {});
    for (const [name, value] of items) {
      if (value === null || value === undefined || value === "") continue;
      list.append(h("dt", {}, name), h("dd", {}, value));
    }
    const why = h("div", { class: "why", data: { state: st.state, reason: st.reason || "" } },
      h("strong", {}, head), " — ", d.explanation);
    const children = [why, list];
    if (st.state !== "finished") {
      children.push(h("button", { type: "button", class: "danger", data: { action: "cancel-work" },
        onclick: () => cancelWork(info.work_id) }, "Cancel this item"));
    }
    $("#work-detail").replaceChildren(...children);
  }

  async function cancelWork(id) {
    if (!window.confirm(`Cancel work item ${id}?`)) return;
    try {
      const answer = await api(`/api/work/${encodeURIComponent(id)}/cancel`, "POST", {});
      say(answer.canceled ? `Canceled ${id}.` : `${id} was not changed (finished, or already canceled).`, "info");
      renderWork(answer.detail);
      refreshPools();
    } catch (err) {
      failed(err);
    }
  }

  // --- start ----------------------------------------------------------------------------
  function start() {
    takeTokenFromFragment();
    $("#token-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const value = $("#token-input").value.trim();
      if (value) sessionStorage.setItem(TOKEN_KEY, value); else sessionStorage.removeItem(TOKEN_KEY);
      $("#token-input").value = "";
      $("#message").hidden = true;
      checkToken();
      refreshPools();
    });
    $("#search-form").addEventListener("submit", (event) => {
      event.preventDefault();
      showWork($("#search-input").value);
    });
    window.addEventListener("resize", drawPool);
    checkToken();
    every(POOLS_EVERY_MS, refreshPools);
    every(POOL_EVERY_MS, refreshSelected);
  }

  // Polls never overlap: the next one is scheduled once the previous answered.
  function every(ms, poll) {
    const tick = async () => {
      await poll();
      setTimeout(tick, ms);
    };
    tick();
  }

  start();
})();
