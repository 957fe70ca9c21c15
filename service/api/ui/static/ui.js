// The gradtape page (/ui): lists, a job followed live, a result drawn with uPlot.
//
// Every call goes through fetch() with the API key in the Authorization header, as the
// API expects (service/api/auth.py); the key never goes into a URL (URLs end up in access
// logs and the browser's history). A job's event stream is read with fetch() too:
// EventSource cannot send headers. Text from the server is only ever set as textContent.
"use strict";

(() => {
  const REFRESH_MS = 2000; // how often the lists are read again
  const MAX_SERIES = 6; // Ritz values drawn live (the first ones reported)
  const ACTIVE = new Set(["queued", "running"]);
  const KEY_ITEM = "gradtape-api-key"; // sessionStorage: this tab only, gone when it closes

  const ui = {
    key: sessionStorage.getItem(KEY_ITEM) || "",
    watching: null, // {id, abort, history: [[done, estimate, error]], doc}
    charts: { progress: null, result: null },
    result: null, // the watched job's answer once it succeeded
  };
  window.gradtapeUI = ui; // for the browser test and the curious: what is drawn

  const $ = (id) => document.getElementById(id);

  // ------------------------------------------------------------------------ the API

  function headers(extra) {
    const h = { Accept: "application/json", ...extra };
    if (ui.key) h.Authorization = "Bearer " + ui.key;
    return h;
  }

  class ApiError extends Error {
    constructor(status, problem) {
      super(problem && problem.detail ? problem.detail : "HTTP " + status);
      this.status = status;
      this.problem = problem;
    }
  }

  async function api(method, path, { allow = [] } = {}) {
    const response = await fetch(path, { method, headers: headers(), cache: "no-store" });
    const type = response.headers.get("content-type") || "";
    const body = type.includes("json") ? await response.json() : null;
    if (!response.ok && !allow.includes(response.status)) {
      throw new ApiError(response.status, body);
    }
    return body;
  }

  const jobPath = (id) => "/v1/jobs/" + encodeURIComponent(id);

  // ------------------------------------------------------------------------ tables

  function cell(text, className) {
    const td = document.createElement("td");
    td.textContent = text;
    if (className) td.className = className;
    return td;
  }

  function badge(state) {
    const td = document.createElement("td");
    const span = document.createElement("span");
    span.className = "state " + state;
    span.textContent = state;
    td.append(span);
    return td;
  }

  function fill(tableId, items, row, empty) {
    const body = $(tableId).tBodies[0];
    const rows = items.map(row);
    if (!rows.length) {
      const tr = document.createElement("tr");
      const td = cell(empty, "empty");
      td.colSpan = $(tableId).tHead.rows[0].cells.length;
      tr.append(td);
      rows.push(tr);
    }
    body.replaceChildren(...rows);
  }

  function tr(...cells) {
    const row = document.createElement("tr");
    row.append(...cells);
    return row;
  }

  function when(iso) {
    if (!iso) return "";
    const seconds = (Date.parse(iso) - Date.now()) / 1000;
    const size = Math.abs(seconds);
    const text =
      size < 90 ? Math.round(size) + " s" : size < 5400 ? Math.round(size / 60) + " min"
        : Math.round(size / 3600) + " h";
    return seconds >= 0 ? "in " + text : text + " ago";
  }

  function progressText(p) {
    if (!p) return "";
    const total = p.total == null ? "" : " / " + p.total;
    return p.done + total + " " + p.unit;
  }

  function button(label, action, data) {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = label;
    b.dataset.action = action;
    b.dataset.job = data;
    return b;
  }

  function showJobs(jobs) {
    fill("jobs", jobs.slice().reverse(), (job) => {
      const actions = document.createElement("td");
      actions.append(button("Watch", "watch", job.job_id));
      if (ACTIVE.has(job.state)) actions.append(" ", button("Cancel", "cancel", job.job_id));
      const id = cell(job.job_id.slice(0, 10));
      id.title = job.job_id;
      const row = tr(
        id, cell(job.operation), badge(job.state), cell(progressText(job.progress)),
        cell(job.elapsed.toFixed(1) + " s"), actions,
      );
      row.dataset.job = job.job_id;
      return row;
    }, "no jobs: start one with \"async\": true (or progress=True in the SDK)");
  }

  // Each list is read and shown on its own: a slow or refused one holds up no other.
  const LISTS = [
    ["/readyz", (ready) => fill("workers", ready.workers || [], (w) => tr(
      cell(String(w.index)), badge(w.state), cell(w.device),
      cell(w.pid == null ? "hidden" : String(w.pid)), cell(String(w.restarts)),
    ), "no workers")],
    ["/v1/jobs", (jobs) => showJobs(jobs.jobs)],
    ["/v1/tapes", (tapes) => fill("tapes", tapes.tapes, (t) => tr(
      cell(t.tape_id.slice(0, 10)), cell(t.target),
      cell(Array.isArray(t.sources) ? t.sources.join(", ") : Object.keys(t.sources).join(", ")),
      cell(t.model || ""), cell(String(t.hits)), cell(when(t.expires_at)),
    ), "no tapes")],
    ["/v1/models", (models) => fill("models", models.models, (m) => tr(
      cell(m.name), cell(m.trainable.join(", ")), cell(when(m.updated_at)),
    ), "no models")],
    ["/v1/datasets", (datasets) => fill("datasets", datasets.datasets, (d) => tr(
      cell(d.name), cell(Object.keys(d.arrays).join(", ")),
      cell(d.bytes.toLocaleString("en")), cell(when(d.updated_at)),
    ), "no datasets")],
  ];

  async function refresh() {
    const outcomes = await Promise.allSettled(LISTS.map(async ([path, show]) => {
      show(await api("GET", path, { allow: path === "/readyz" ? [503] : [] }));
    }));
    const failed = outcomes.find((o) => o.status === "rejected");
    if (!failed) say(ui.key ? "key in use" : "no key");
    else if (failed.reason.status === 401) say("this server requires an API key: enter it above");
    else say("cannot read the server: " + failed.reason.message);
  }

  function say(text) {
    $("status").textContent = text;
  }

  // ------------------------------------------------------------------------ a job

  async function watch(id) {
    if (ui.watching) ui.watching.abort.abort();
    const watching = { id, abort: new AbortController(), history: [], doc: null };
    ui.watching = watching;
    ui.result = null;
    for (const name of ["progress", "result"]) {
      if (ui.charts[name]) ui.charts[name].destroy();
      ui.charts[name] = null;
    }
    $("job-view").hidden = false;
    $("job-id").textContent = id;
    // Nothing of the job watched before stays: its estimate beside this job's state
    // read as this job's (a solve showed the spectral density's "estimate: 3.0000").
    $("job-estimate").textContent = "";
    $("job-progress-text").textContent = "";
    $("job-progress").value = 0;
    delete $("job-progress").dataset.done;
    $("result-title").hidden = true;
    $("result-note").textContent = "";
    showCurvature(null);
    $("job-error").textContent = "";
    $("result-chart").dataset.kind = "";
    try {
      show(watching, await api("GET", jobPath(id)));
      if (ACTIVE.has(watching.doc.state)) await follow(watching);
      if (ui.watching === watching) await finish(watching);
    } catch (error) {
      if (error.name !== "AbortError") $("job-error").textContent = error.message;
    }
  }

  // The job's server-sent events, read from a fetch() body: `event:` names the state,
  // `data:` is the job document; comments (keep-alives) start with ':'. The stream ends
  // with the job.
  async function follow(watching) {
    const response = await fetch(jobPath(watching.id) + "/events", {
      headers: headers({ Accept: "text/event-stream" }),
      cache: "no-store",
      signal: watching.abort.signal,
    });
    if (!response.ok) throw new ApiError(response.status, await response.json());
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) show(watching, JSON.parse(data));
      }
    }
  }

  function show(watching, doc) {
    if (ui.watching !== watching) return;
    watching.doc = doc;
    const state = $("job-state");
    state.textContent = doc.state;
    state.className = "state " + doc.state;
    $("job-operation").textContent = doc.operation + (doc.tape_id ? " on tape " + doc.tape_id : "");
    $("job-cancel").hidden = !ACTIVE.has(doc.state);
    const p = doc.progress;
    const bar = $("job-progress");
    if (p) {
      bar.max = p.total || Math.max(p.done, 1);
      bar.value = p.done;
      const eta = p.eta == null ? "" : ", about " + p.eta.toFixed(1) + " s left";
      $("job-progress-text").textContent =
        progressText(p) + " in " + p.seconds.toFixed(1) + " s" + eta;
      bar.dataset.done = String(p.done);
      if (p.estimate != null) record(watching, [p.done, p.estimate, p.error]);
    }
    if (doc.error) $("job-error").textContent = doc.error.detail || doc.error.title;
  }

  const short = (x) => (x == null ? "nan" : Number(x).toPrecision(5));
  // A log axis's tick: uPlot's default writes at most a few decimals, so 1e-5 read "0".
  const logTick = (v) =>
    v == null ? "" : v >= 1e-3 && v < 1e4 ? String(Number(v.toPrecision(3))) : v.toExponential(0);

  function record(watching, point) {
    const last = watching.history[watching.history.length - 1];
    if (last && last[0] === point[0]) watching.history[watching.history.length - 1] = point;
    else watching.history.push(point);
    const [, estimate, error] = point;
    $("job-estimate").textContent = Array.isArray(estimate)
      ? "estimate: [" + estimate.slice(0, MAX_SERIES).map(short).join(", ") + "]"
      : "estimate: " + short(estimate) + (error == null ? "" : " \u00b1 " + short(error));
    drawProgress(watching);
  }

  function drawProgress(watching) {
    const h = watching.history;
    const x = h.map((p) => p[0]);
    const list = Array.isArray(h[h.length - 1][1]);
    const width = list ? Math.min(MAX_SERIES, Math.max(...h.map((p) => p[1].length))) : 1;
    const columns = [];
    for (let i = 0; i < width; i++) {
      columns.push(h.map((p) => (list ? p[1][i] ?? null : p[1])));
    }
    // A scalar estimate with a standard error (a trace): its band of +-2 errors.
    const band = !list && h.some((p) => typeof p[2] === "number");
    if (band) {
      for (const sign of [1, -1]) {
        columns.push(h.map((p) => (typeof p[2] === "number" ? p[1] + sign * 2 * p[2] : null)));
      }
    }
    const data = [x, ...columns];
    const chart = ui.charts.progress;
    if (chart && chart.series.length === data.length) {
      chart.setData(data);
    } else {
      if (chart) chart.destroy();
      const operation = watching.doc.operation || "";
      // What a job reports as its estimate (JobProgress.estimate in the API).
      const what = operation.endsWith("/spectral-density") ? "probes finished"
        : operation.endsWith("/diagonal") ? "fraction done" : "estimate";
      const series = columns.slice(0, width).map((_, i) => ({
        label: list ? what + " " + (i + 1) : what,
        stroke: COLOURS[i % COLOURS.length],
        spanGaps: true,
      }));
      const bands = [];
      if (band) {
        series.push({ label: "+2 s.e.", stroke: "#9ecae1", spanGaps: true },
          { label: "\u22122 s.e.", stroke: "#9ecae1", spanGaps: true });
        bands.push({ series: [2, 3], fill: "rgba(31,119,180,0.2)" });
      }
      ui.charts.progress = plot("progress-chart", "progress", data, series, {
        x: (watching.doc.progress && watching.doc.progress.unit) || "done",
        y: what,
      }, { bands });
    }
    $("job-view").dataset.progressPoints = String(h.length);
  }

  async function finish(watching) {
    const doc = (watching.doc = await api("GET", jobPath(watching.id)));
    show(watching, doc);
    refresh(); // the job list shows the end too
    if (doc.state !== "succeeded") return;
    ui.result = doc.result;
    $("result-title").hidden = false;
    drawResult(doc.result);
    showCurvature(doc.result.curvature_used || null);
  }

  // A Cancel button is drawn for a job that was queued or running when the list was
  // read (every two seconds): the job may have ended since, and a DELETE of a job that
  // succeeded or failed forgets it, its answer with it. Cancel only what still runs.
  async function cancel(id) {
    try {
      const doc = await api("GET", jobPath(id), { allow: [404] });
      if (doc && doc.job_id && !ACTIVE.has(doc.state)) {
        say("job " + id.slice(0, 10) + " had " + doc.state + " already: nothing to cancel");
      } else {
        await api("DELETE", jobPath(id), { allow: [404] });
        say("cancelled " + id.slice(0, 10));
      }
    } catch (error) {
      say("cancel failed: " + error.message);
    }
    refresh();
  }

  // ------------------------------------------------------------------------ results

  const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf"];

  // A tensor as the API sends it: {dtype, shape, data} (data nested or flat) or
  // {dtype, shape, base64} (little-endian bytes); a bare number or list. -> flat numbers
  function flat(tensor) {
    if (typeof tensor === "number") return [tensor];
    if (Array.isArray(tensor)) return tensor.flat(Infinity);
    if (tensor.base64 != null) {
      const bytes = Uint8Array.from(atob(tensor.base64), (c) => c.charCodeAt(0));
      const view = new DataView(bytes.buffer);
      const read = {
        float64: [8, (o) => view.getFloat64(o, true)],
        float32: [4, (o) => view.getFloat32(o, true)],
        float16: [2, (o) => view.getFloat16 ? view.getFloat16(o, true) : NaN],
        int64: [8, (o) => Number(view.getBigInt64(o, true))],
        int32: [4, (o) => view.getInt32(o, true)],
      }[tensor.dtype];
      if (!read) return [];
      const out = [];
      for (let o = 0; o + read[0] <= bytes.length; o += read[0]) out.push(read[1](o));
      return out;
    }
    return [tensor.data].flat(Infinity);
  }

  const range = (n, from = 0) => Array.from({ length: n }, (_, i) => i + from);

  function note(text) {
    $("result-note").textContent = text;
  }

  function unconverged(result) {
    return result.converged === false ? " (not converged: stopped by " + result.stopped + ")" : "";
  }

  function drawResult(result) {
    const el = $("result-chart");
    let chart = null;
    if (result.grid && result.density) {
      const band = result.stderr || null;
      const series = [{ label: "density", stroke: COLOURS[0], width: 2 }];
      const data = [result.grid, result.density];
      const bands = [];
      if (band) {
        data.push(result.density.map((d, i) => d + 2 * band[i]));
        data.push(result.density.map((d, i) => d - 2 * band[i]));
        series.push({ label: "+2 s.e.", stroke: "#9ecae1" }, { label: "\u22122 s.e.", stroke: "#9ecae1" });
        bands.push({ series: [2, 3], fill: "rgba(31,119,180,0.2)" });
      }
      chart = plot("result-chart", "density", data, series, { x: "eigenvalue", y: "density" }, { bands });
      note("Spectral density: " + result.probes + " probes, " + result.steps + " steps, sigma " +
        short(result.sigma) + unconverged(result));
    } else if (result.eigenvalues) {
      chart = plot("result-chart", "eigenvalues",
        [range(result.eigenvalues.length, 1), result.eigenvalues],
        [{ label: "eigenvalue", stroke: COLOURS[0], paths: () => null,
           points: { show: true, size: 9, fill: COLOURS[0] } }],
        { x: "index", y: "eigenvalue" });
      note("Eigenvalues (" + result.method + ", " + result.hvps + " HVPs)" + unconverged(result));
    } else if (result.scores && result.removal) {
      chart = bars("influence", result.scores, { x: "training example", y: "influence score" });
      note("Influence on the test loss " + short(result.test_loss) + ": positive harmful, negative " +
        "helpful; most harmful " + result.harmful.join(", ") + unconverged(result));
    } else if ("diagonal" in result && result.method) {
      const parts = result.diagonal || { "entries reached": result.partial };
      const values = [];
      const spans = [];
      for (const [name, tensor] of Object.entries(parts)) {
        const v = flat(tensor);
        spans.push(name + " " + values.length + "\u2013" + (values.length + v.length - 1));
        values.push(...v);
      }
      chart = bars("diagonal", values, { x: "entry (" + spans.join("; ") + ")", y: "diagonal" });
      const of = result.curvature_used ? result.curvature_used.kind : "hessian";
      note("Diagonal of the " + of + " (" + result.method + ")" + unconverged(result));
    } else if (result.residuals && result.solution) {
      chart = plot("result-chart", "solve", [range(result.residuals.length), result.residuals],
        [{ label: "relative residual", stroke: COLOURS[0] }],
        { x: "CG iteration", y: "relative residual" },
        { scales: { y: { distr: 3 } }, yValues: (u, splits) => splits.map(logTick) });
      note("Solve (" + result.rhs + ")" + unconverged(result));
    } else if (result.trace != null) {
      note("trace = " + short(result.trace) + (result.stderr ? " \u00b1 " + short(result.stderr) : "") +
        " (" + result.method + ", " + result.hvps + " HVPs)" + unconverged(result));
      el.dataset.kind = "trace";
    } else {
      note("The answer has no picture here: GET " + jobPath(ui.watching.id) + "/result for it.");
    }
    ui.charts.result = chart;
  }

  // The matrix a curvature answer is of, as the answer states it (`curvature_used`): its
  // kind, structure, a Monte-Carlo Fisher's samples and seed, and whether it is exact or
  // an approximation, with why. Every curvature answer has one; others hide the box.
  function showCurvature(used) {
    const box = $("result-curvature");
    box.replaceChildren();
    box.hidden = !used;
    box.className = "curvature" + (used && used.approximate ? " approximate" : "");
    box.dataset.approximate = used ? String(used.approximate) : "";
    if (!used) return;
    const head = document.createElement("div");
    const flag = document.createElement("span");
    flag.className = "flag";
    flag.textContent = used.approximate ? "approximate" : "exact";
    head.append("Curvature used ", flag);
    const facts = [
      ["kind", used.kind],
      ["structure", used.structure || "the matrix itself"],
    ];
    if (used.samples != null) {
      facts.push(["Monte-Carlo samples", used.samples + " per example"], ["seed", String(used.seed)]);
    }
    const list = document.createElement("dl");
    for (const [name, value] of facts) {
      const item = document.createElement("div");
      const dt = document.createElement("dt");
      const dd = document.createElement("dd");
      dt.textContent = name;
      dd.textContent = value;
      dd.dataset.fact = name;
      item.append(dt, dd);
      list.append(item);
    }
    box.append(head, list);
    if (used.approximate && used.reason) {
      const why = document.createElement("p");
      why.className = "reason";
      why.textContent = "Why approximate: " + used.reason;
      box.append(why);
    }
  }

  function bars(kind, values, labels) {
    return plot("result-chart", kind, [range(values.length), values], [{
      label: labels.y,
      stroke: COLOURS[0],
      fill: "rgba(31,119,180,0.5)",
      paths: uPlot.paths.bars({ size: [0.8, 40] }),
      points: { show: false },
    }], labels);
  }

  function plot(elementId, kind, data, series, labels, extra = {}) {
    const el = $(elementId);
    el.replaceChildren();
    el.dataset.kind = kind;
    const opts = {
      width: Math.max(320, el.clientWidth || 640),
      height: 260,
      scales: { x: { time: false }, ...(extra.scales || {}) },
      axes: [
        { label: labels.x },
        { label: labels.y, size: 70, ...(extra.yValues ? { values: extra.yValues } : {}) },
      ],
      series: [{ label: labels.x }, ...series],
      bands: extra.bands || [],
    };
    return new uPlot(opts, data, el);
  }

  // ------------------------------------------------------------------------ wiring

  document.addEventListener("DOMContentLoaded", () => {
    $("api-key").value = ui.key;
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      ui.key = $("api-key").value.trim();
      if (ui.key) sessionStorage.setItem(KEY_ITEM, ui.key);
      else sessionStorage.removeItem(KEY_ITEM);
      refresh();
    });
    $("forget-key").addEventListener("click", () => {
      ui.key = "";
      $("api-key").value = "";
      sessionStorage.removeItem(KEY_ITEM);
      refresh();
    });
    $("jobs").addEventListener("click", (event) => {
      const b = event.target.closest("button[data-action]");
      if (!b) return;
      if (b.dataset.action === "watch") watch(b.dataset.job);
      else if (b.dataset.action === "cancel") cancel(b.dataset.job);
    });
    $("job-cancel").addEventListener("click", () => {
      if (ui.watching) cancel(ui.watching.id);
    });
    ui.refresh = refresh;
    ui.watch = watch;
    ui.cancel = cancel; // what a Cancel button does
    refresh();
    setInterval(refresh, REFRESH_MS);
  });
})();
