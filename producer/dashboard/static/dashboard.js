// tokenmill dashboard: polls the JSON API and redraws; charts are uPlot (vendored, no CDN).
//
// Every number read from the status document is shown in an element whose data-path is its
// path in that document (a JSON array) and whose data-value is the raw value, so the page can be
// checked against `tokenmill status --json`. Text that comes from a run (prompts, outputs, error
// messages) is only ever set as textContent.
"use strict";

(() => {
  const REFRESH_MS = 2000;
  const RUNS_MS = 15000;
  const PREVIEW_CHARS = 3000;
  const PROMPT_CHARS = 600;
  const COLORS = ["#1c7ed6", "#2f9e44", "#e03131", "#f08c00", "#7048e8", "#0c8599", "#d6336c",
    "#5c940d", "#862e9c", "#495057"];
  // status --json's quality rates, and the per-job flag each is the share of (a history point
  // counts judged jobs and q:<flag>; api/flagged lists the latest jobs of each flag)
  const RATES = ["length_share", "empty_share", "repetition", "invalid_structured", "tool_call_errors", "length_drift"];
  const FLAGS = ["length", "empty", "repetition", "invalid_structured", "tool_call_errors", "length_drift"];
  const RATE_JOBS = 50;  // a flagged share over time is over at least this many judged jobs
  const STATE_COLOR = { done: "#2f9e44", running: "#1c7ed6", queued: "#868e96", failed: "#e03131",
    cancelled: "#f08c00", sealed: "#7048e8" };

  const tm = window.tm = { run: null, runs: [], status: null, hist: null, charts: {}, bins: {}, ticks: 0,
    updated: null, samples: null, flagged: null };
  const $ = (id) => document.getElementById(id);

  // -- small helpers ------------------------------------------------------------------------

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null) continue;
      if (k === "text") node.textContent = v;
      else if (k === "class") node.className = v;
      else if (k === "data") for (const [dk, dv] of Object.entries(v)) node.dataset[dk] = dv;
      else node.setAttribute(k, v);
    }
    for (const child of children) if (child !== null && child !== undefined) node.append(child);
    return node;
  }

  const int = (v) => (v === null || v === undefined ? "–" : Math.round(v).toLocaleString("en-US"));
  const dec = (v, d = 1) => (v === null || v === undefined || !isFinite(v) ? "–" : v.toFixed(d));
  const pct = (v) => (v === null || v === undefined || !isFinite(v) ? "–" : `${(100 * v).toFixed(1)}%`);

  function duration(s) {
    if (s === null || s === undefined) return "unknown";
    s = Math.round(s);
    if (s < 60) return `${s}s`;
    const m = Math.floor(s / 60);
    if (m < 60) return `${m}m ${String(s % 60).padStart(2, "0")}s`;
    const h = Math.floor(m / 60);
    if (h < 48) return `${h}h ${String(m % 60).padStart(2, "0")}m`;
    return `${Math.floor(h / 24)}d ${h % 24}h`;
  }

  // A number from the status document, tagged with its path there.
  function field(path, value, format = int) {
    return el("span", { text: format(value), data: { path: JSON.stringify(path), value: JSON.stringify(value ?? null) } });
  }

  function card(label, value) {
    return el("div", { class: "card" }, el("div", { class: "label", text: label }), el("div", { class: "value" }, value));
  }

  function table(node, head, rows) {
    node.textContent = "";
    node.append(el("tr", {}, ...head.map((h) => el("th", { text: h }))));
    for (const row of rows) node.append(el("tr", {}, ...row.map((c) => (c instanceof Node && c.tagName === "TD" ? c : el("td", {}, c)))));
  }

  async function api(path) {
    const res = await fetch(path, { cache: "no-store", credentials: "same-origin" });
    let body = null;
    try { body = await res.json(); } catch (e) { body = null; }
    if (!res.ok) throw new Error((body && body.error) || `${res.status} ${res.statusText}`);
    return body;
  }

  function showError(message) {
    const box = $("error");
    box.textContent = message;
    box.hidden = false;
  }

  function clearError() { $("error").hidden = true; }

  // -- charts ---------------------------------------------------------------------------------

  function chart(key, container, opts, data) {
    const sig = JSON.stringify([opts.series.map((s) => s.label), opts.height]);
    let u = tm.charts[key];
    if (u && u.sig === sig && container.contains(u.root)) {
      u.setData(data);
      return u;
    }
    if (u) u.destroy();
    container.textContent = "";
    const width = Math.max(280, container.clientWidth - 14);
    u = new uPlot({ width, height: 220, ...opts }, data, container);
    u.sig = sig;
    tm.charts[key] = u;
    return u;
  }

  function dropCharts(prefix) {
    for (const key of Object.keys(tm.charts)) {
      if (key.startsWith(prefix)) { tm.charts[key].destroy(); delete tm.charts[key]; }
    }
  }

  const line = (label, color, extra) => ({ label, stroke: color, width: 2, points: { show: false }, spanGaps: false, ...extra });

  function timeOpts(series, left, right) {
    const axes = [{}, { label: left, size: 64 }];
    if (right) axes.push({ label: right, side: 1, scale: "r", size: 64, grid: { show: false } });
    return { series: [{}, ...series], axes, scales: { x: { time: true } }, cursor: { drag: { x: true, y: false } } };
  }

  // rate of a cumulative column per second (times `per`); null where unknown
  function rate(t, y, per) {
    const out = [null];
    for (let i = 1; i < t.length; i++) {
      const dt = t[i] - t[i - 1];
      out.push(dt > 0 && y[i] !== null && y[i - 1] !== null ? Math.max(0, y[i] - y[i - 1]) / dt * per : null);
    }
    return out;
  }

  const col = (cols, name) => cols[name] || cols.t.map(() => null);

  // -- history: merge new points into what the page holds -----------------------------------

  function mergeCols(old, add) {
    if (!old) return add;
    const n0 = old.t.length;
    const last = n0 ? old.t[n0 - 1] : -Infinity;
    const keep = [];
    add.t.forEach((t, i) => { if (t > last) keep.push(i); });
    if (!keep.length) return old;
    const out = {};
    for (const name of new Set([...Object.keys(old), ...Object.keys(add)])) {
      const a = old[name] || new Array(n0).fill(null);
      const b = add[name] ? keep.map((i) => add[name][i]) : keep.map(() => null);
      out[name] = a.concat(b);
    }
    return out;
  }

  function mergeMap(old, add) {
    const out = { ...old };
    for (const [name, cols] of Object.entries(add)) out[name] = mergeCols(old[name], cols);
    return out;
  }

  function mergeHistory(h) {
    if (!tm.hist || h.since === null) { tm.hist = h; return; }
    tm.hist = {
      ...h,
      series: mergeCols(tm.hist.series, h.series),
      servers: mergeMap(tm.hist.servers, h.servers),
      states: mergeMap(tm.hist.states, h.states),
    };
  }

  // -- the status document -------------------------------------------------------------------

  function renderSummary(st) {
    const t = st.totals;
    const stats = st.stats || {};
    const first = stats.first_enqueue_ms, last = stats.last_activity_ms;
    const moving = t.queued + t.running > 0;
    const span = first ? ((moving ? st.at * 1000 : last || st.at * 1000) - first) / 1000 : null;
    const node = $("summary");
    node.textContent = "";
    node.append(
      card("done", el("span", {}, field(["totals", "done"], t.done), ` of `, field(["totals", "total"], t.total))),
      card("running", field(["totals", "running"], t.running)),
      card("queued", field(["totals", "queued"], t.queued)),
      card("failed", field(["totals", "failed"], t.failed)),
    );
    if ("cancelled" in t) node.append(card("cancelled", field(["totals", "cancelled"], t.cancelled)));
    if (st.dead_letters) node.append(card("dead letters (all runs)", field(["dead_letters"], st.dead_letters)));
    node.append(
      card("tokens/s (last minute)", field(["tokens_per_s"], st.tokens_per_s, (v) => dec(v))),
      card("ETA", field(["eta_s"], st.eta_s, duration)),
      card("tokens/s (whole run)", el("span", { text: span > 0 ? dec((stats.completion_tokens || 0) / span) : "–" })),
      card("jobs/min (whole run)", el("span", { text: span > 0 ? dec(t.done / span * 60) : "–" })),
      card("completion tokens", field(["stats", "completion_tokens"], stats.completion_tokens || 0)),
      card("running for", el("span", { text: span !== null ? duration(span) : "–" })),
    );
  }

  function progressBar(c) {
    const total = Object.values(c).reduce((a, b) => a + b, 0) || 1;
    const bar = el("div", { class: "bar", title: `${c.done} done of ${total}` });
    for (const state of ["done", "failed", "cancelled", "running"]) {
      if (c[state]) bar.append(el("span", { class: state, style: `width:${(100 * c[state]) / total}%` }));
    }
    return bar;
  }

  function renderPartitions(st) {
    const states = ["done", "running", "queued", "failed"];
    if ("cancelled" in st.totals) states.push("cancelled");
    const sealed = (st.results && st.results.sealed) || {};
    const rows = Object.keys(st.partitions).sort().map((p) => {  // (its numbers: jobs by state)
      const c = Object.fromEntries(Object.entries(st.partitions[p]).filter(([, v]) => typeof v === "number"));
      const total = Object.values(c).reduce((a, b) => a + b, 0);
      return [p, progressBar(c), el("span", { text: total ? pct(c.done / total) : "–" }),
        ...states.map((s) => field(["partitions", p, s], c[s])),
        p in sealed ? field(["results", "sealed", p], sealed[p]) : el("span", { text: "0" })];
    });
    table($("partitions"), ["partition", "progress", "done %", ...states, "sealed"], rows);
  }

  function serverNames(st) {
    const names = st.servers.map((s) => s.name);
    for (const name of Object.keys(st.admission || {})) if (!names.includes(name)) names.push(name);
    return names;
  }

  function renderServerTable(st) {
    const records = Object.fromEntries(st.servers.map((s, i) => [s.name, [s, i]]));
    const rows = serverNames(st).map((name) => {
      const [rec, i] = records[name] || [null, -1];
      const a = (st.admission || {})[name] || {};
      const kv = a.srv_cap ? a.srv_used / a.srv_cap : null;
      const state = rec
        ? el("span", { class: `state state-${rec.state}` }, field(["servers", i, "state"], rec.state, String))
        : el("span", { class: "muted", text: "not managed" });
      const adm = (key) => (key in a ? field(["admission", name, key], a[key]) : el("span", { text: "–" }));
      const retractions = a.srv_retractions !== undefined && a.srv_retractions >= 0
        ? field(["admission", name, "srv_retractions"], a.srv_retractions) : el("span", { text: "–" });
      return [name, state, rec ? field(["servers", i, "restarts"], rec.restarts) : "–",
        el("span", { text: pct(kv) }), adm("srv_running"), adm("srv_waiting"), retractions,
        adm("window"), adm("n")];
    });
    table($("servers"), ["server", "state", "restarts", "KV use", "running", "queued", "retractions",
      "window", "in flight"], rows);
  }

  function renderFailureTable(st) {
    const rows = Object.entries(st.failures).sort((a, b) => b[1] - a[1]).map(([cls, n]) =>
      [cls, field(["failures", cls], n), el("td", { class: "text", text: (st.failure_messages || {})[cls] || "" })]);
    if (!rows.length) rows.push(["none", "0", el("td", { class: "text muted", text: "no job has failed" })]);
    table($("failures"), ["class", "failed now", "latest message"], rows);
  }

  function renderOutputs(st) {
    const o = st.outputs || {};
    const node = $("outputs-summary");
    node.textContent = "";
    node.append(
      card("outputs counted", field(["outputs", "jobs"], o.jobs || 0)),
      card("truncated (finish: length)", field(["outputs", "truncated_share"], o.truncated_share, pct)),
      card("with reasoning counted", field(["outputs", "reasoning_counted"], o.reasoning_counted || 0)),
    );
    const reasons = o.finish_reasons || {};
    const rows = Object.entries(reasons).map(([r, n]) =>
      [r, field(["outputs", "finish_reasons", r], n), el("span", { text: o.jobs ? pct(n / o.jobs) : "–" })]);
    table($("finish"), ["finish reason", "jobs", "share"], rows);
    histogram("completion", $("chart-completion"), o.completion_tokens || [], COLORS[0]);
    histogram("reasoning", $("chart-reasoning"), o.reasoning_tokens || [], COLORS[4]);
  }

  // a length histogram: one bar per bin (bins widen with length, so bars are drawn by index);
  // the chart outlives this call, so its labels read the latest bins from tm.bins, not a closure
  function histogram(key, container, rows, color) {
    tm.bins[key] = rows;
    const bins = () => tm.bins[key] || [];
    const data = [rows.map((_, i) => i), rows.map((r) => r[2])];
    chart(`hist-${key}`, container, {
      height: 200,
      scales: { x: { time: false, range: (u, lo, hi) => [(lo ?? 0) - 0.6, (hi ?? 0) + 0.6] } },
      series: [
        { label: "tokens", value: (u, v) => (bins()[v] ? `${bins()[v][0]}–${bins()[v][1] - 1}` : "–") },
        { label: "jobs", stroke: color, fill: `${color}88`, paths: uPlot.paths.bars({ size: [0.85, 40] }), points: { show: false } },
      ],
      axes: [
        {
          label: "tokens (lower edge of each bin)",
          splits: () => {
            const every = Math.max(1, Math.ceil(bins().length / 10));
            return bins().map((_, i) => i).filter((i) => i % every === 0);
          },
          values: (u, splits) => splits.map((i) => (bins()[i] ? String(bins()[i][0]) : "")),
        },
        { label: "jobs", size: 56 },
      ],
      legend: { live: true },
    }, data);
  }

  function renderSealing(st) {
    const r = st.results || {};
    const sealed = Object.values(r.sealed || {}).reduce((a, b) => a + b, 0);
    const done = st.totals.done;
    const node = $("sealing");
    node.textContent = "";
    node.append(
      card("sealed of done", el("span", { text: `${int(sealed)} of ${int(done)} (${done ? pct(sealed / done) : "–"})` })),
      card("shards written", field(["results", "shards"], r.shards || 0)),
      card("shards being sealed", field(["results", "sealing"], r.sealing || 0)),
      card("result store", el("span", { class: "muted", text: r.store || "none yet" })),
    );
  }

  // -- quality --------------------------------------------------------------------------------

  function renderPaused(st) {
    const box = $("paused"), p = st.paused;
    box.hidden = !p;
    box.textContent = "";
    if (!p) return;
    box.append(el("b", { text: "PAUSED" }), " since ", field(["paused", "at"], p.at, (v) => new Date(v * 1000).toLocaleString()),
      ` (${duration(st.at - p.at)} ago): `, field(["paused", "reason"], p.reason, String),
      el("span", { class: "muted", text: ` · nothing more is claimed; tokenmill resume --run ${st.run} lifts it` }));
  }

  // the rates over each partition's window of latest judged jobs, and over the run's (every
  // partition's window); drift against the reference (a log-probability gap) with its 95% CI
  function renderQuality(st) {
    const parts = Object.keys(st.partitions).sort().filter((p) => st.partitions[p].quality);
    const docs = [[["quality"], st.quality || {}], ...parts.map((p) => [["partitions", p, "quality"], st.partitions[p].quality])];
    const names = [...RATES, "drift"].filter((n) => docs.some(([, q]) => n in q));
    const rows = docs.filter(([, q]) => Object.keys(q).length).map(([path, q]) => [
      path.length === 1 ? "all partitions" : path[1],
      ...["judged", "window"].map((n) => (n in q ? field([...path, n], q[n]) : "–")),
      ...names.map((n) => (n === "drift" ? driftCell(path, q) : n in q ? field([...path, n], q[n], pct) : "–"))]);
    if (!rows.length) rows.push(["no job judged yet", "0", "0", ...names.map(() => "–")]);
    table($("quality"), ["partition", "judged", "window", ...names], rows);
  }

  function driftCell(path, q) {
    if (!("drift" in q)) return "–";
    const ci = q.drift_ci95;  // the 95% interval's half-width
    return el("span", {}, field([...path, "drift"], q.drift, (v) => dec(v, 3)),
      ci !== null && ci !== undefined ? el("span", { class: "muted" }, " ± ", field([...path, "drift_ci95"], ci, (v) => dec(v, 3))) : null);
  }

  // each flag's share of the judged jobs between a point and the latest earlier point at least
  // RATE_JOBS judged jobs before it (or the first), from the cumulative counts of the history (a
  // point without a flag's count has none of it)
  function flaggedShares(cols) {
    const judged = col(cols, "judged");
    const flags = FLAGS.map((f) => col(cols, `q:${f}`));
    const out = FLAGS.map(() => []);
    let j = 0;
    for (let i = 0; i < judged.length; i++) {
      if (judged[j] === null) j = i;
      while (j + 1 < i && judged[i] - judged[j + 1] >= RATE_JOBS) j++;
      const dj = judged[i] === null ? 0 : judged[i] - judged[j];
      flags.forEach((q, k) => out[k].push(dj > 0 ? (100 * Math.max(0, (q[i] ?? 0) - (q[j] ?? 0))) / dj : null));
    }
    return out;
  }

  function renderQualityChart(cols) {
    const box = $("chart-quality");
    if (!cols.judged) {
      box.textContent = "";
      box.append(el("p", { class: "muted", text: "no job judged yet" }));
      return;
    }
    chart("quality", box, timeOpts(RATES.map((n, i) => line(n, COLORS[i])), "% of judged jobs"), [cols.t, ...flaggedShares(cols)]);
  }

  const shortId = (id) => (/^[0-9a-f]{32}$/.test(id) ? id.slice(0, 10) : clip(id, 40));

  function renderFlagged(flagged) {
    const box = $("flagged");
    const sig = JSON.stringify(flagged);
    if (box.dataset.sig === sig) return;  // unchanged: the buttons stay as they are
    box.dataset.sig = sig;
    box.textContent = "";
    for (const flag of FLAGS) {
      const jobs = flagged[flag] || [];
      if (!jobs.length) continue;
      box.append(el("div", { class: "flagged-row", data: { flag } }, el("span", { class: "flag", text: flag }),
        ...jobs.map((j) => el("button", { type: "button", class: "job", title: `${j.partition} · ${j.job_id}`,
          data: { flag, partition: j.partition, jobId: j.job_id }, text: `${j.partition} · ${shortId(j.job_id)}` }))));
    }
    if (!box.childElementCount) box.append(el("p", { class: "muted", text: "no job flagged yet" }));
  }

  // -- the time series ------------------------------------------------------------------------

  function renderRunCharts(cols) {
    const t = cols.t;
    chart("throughput", $("chart-throughput"),
      timeOpts([line("tokens/s", COLORS[0]), line("jobs/min", COLORS[1], { scale: "r" })], "tokens/s", "jobs/min"),
      [t, rate(t, col(cols, "completion_tokens"), 1), rate(t, col(cols, "done"), 60)]);
    const states = ["done", "running", "queued", "failed", "sealed"];
    chart("jobs", $("chart-jobs"), timeOpts(states.map((s) => line(s, STATE_COLOR[s])), "jobs"),
      [t, ...states.map((s) => col(cols, s))]);
    const classes = Object.keys(cols).filter((k) => k.startsWith("failures:")).sort();
    const all = t.map((_, i) => classes.reduce((a, k) => a + (cols[k][i] || 0), 0));
    chart("failures", $("chart-failures"),
      timeOpts([line("all classes", "#495057", { dash: [4, 4] }),
        ...classes.map((k, i) => line(k.slice(9), COLORS[(i + 2) % COLORS.length]))], "jobs"),
      [t, all, ...classes.map((k) => cols[k])]);
  }

  function renderServerCharts(st, hist) {
    const names = [...new Set([...serverNames(st), ...Object.keys(hist.servers), ...Object.keys(hist.states)])];
    const box = $("server-charts");
    const sig = JSON.stringify(names);
    if (box.dataset.sig !== sig) {
      dropCharts("server:");
      box.textContent = "";
      names.forEach((name, i) => {
        box.append(el("div", { class: "server-block", data: { server: name } },
          el("h3", { text: name }),
          el("div", { class: "server-charts" },
            el("div", { class: "chart", id: `srv-${i}-requests` }),
            el("div", { class: "chart", id: `srv-${i}-kv` }),
            el("div", { class: "chart", id: `srv-${i}-state` }))));
      });
      box.dataset.sig = sig;
    }
    names.forEach((name, i) => {
      const cols = hist.servers[name] || { t: [] };
      const t = cols.t;
      // an asinh scale: a window far above what runs (admission not limiting) leaves both readable
      const requests = timeOpts([line("running", COLORS[0]), line("queued", COLORS[3]),
        line("window", COLORS[1], { dash: [6, 3] }), line("in flight", COLORS[4])], "requests");
      requests.scales.y = { distr: 4, asinh: 1 };
      chart(`server:${name}:requests`, $(`srv-${i}-requests`), requests,
        [t, col(cols, "running"), col(cols, "queued"), col(cols, "window"), col(cols, "in_flight")]);
      const used = col(cols, "kv_used"), cap = col(cols, "kv_capacity");
      chart(`server:${name}:kv`, $(`srv-${i}-kv`),
        timeOpts([line("KV use %", COLORS[5]), line("retractions", COLORS[2], { scale: "r" })], "KV use %", "retractions"),
        [t, used.map((u, j) => (u !== null && cap[j] ? (100 * u) / cap[j] : null)), col(cols, "retractions")]);
      stateChart(name, $(`srv-${i}-state`), hist.states[name], hist.state_names, st);
    });
  }

  // a server's state over time: a step line from its manager's state changes, held until now
  function stateChart(name, container, cols, stateNames, st) {
    if (!cols || !cols.t.length) {
      if (tm.charts[`server:${name}:state`]) { tm.charts[`server:${name}:state`].destroy(); delete tm.charts[`server:${name}:state`]; }
      container.textContent = "";
      container.append(el("p", { class: "muted", text: "no state history: this server is not run by `tokenmill server up`" }));
      return;
    }
    const t = [...cols.t, st.at];
    const state = [...cols.state, cols.state[cols.state.length - 1]];
    const restarts = [...cols.restarts, cols.restarts[cols.restarts.length - 1]];
    const label = (v) => (v === null || stateNames[v] === undefined ? "–" : stateNames[v]);
    chart(`server:${name}:state`, container, {
      series: [{}, { label: "state", stroke: COLORS[1], width: 2, paths: uPlot.paths.stepped({ align: 1 }), points: { show: false }, value: (u, v) => label(v) },
        { label: "restarts", stroke: COLORS[2], scale: "r", paths: uPlot.paths.stepped({ align: 1 }), points: { show: false } }],
      scales: { x: { time: true }, y: { range: [-0.5, stateNames.length - 0.5] } },
      axes: [{}, { size: 70, splits: () => stateNames.map((_, i) => i), values: (u, splits) => splits.map(label) },
        { side: 1, scale: "r", size: 50, grid: { show: false }, label: "restarts" }],
    }, [t, state, restarts]);
  }

  // -- samples --------------------------------------------------------------------------------

  function clip(text, n) {
    if (!text) return "";
    return text.length > n ? `${text.slice(0, n)}… (${text.length - n} more characters)` : text;
  }

  function textOf(content) {
    if (typeof content === "string") return content;
    if (Array.isArray(content)) return content.map((p) => (p && p.text) || "").join("");
    return content === null || content === undefined ? "" : JSON.stringify(content);
  }

  function sampleCard(s) {
    const box = el("div", { class: "sample", data: { jobId: s.job_id, partition: s.partition } });
    if (s.error || !s.row) {
      box.append(el("div", { class: "meta" }, el("b", { text: s.partition }), ` · ${s.job_id}`),
        el("div", { class: "sample-error", text: s.error || "no row" }));
      return box;
    }
    const row = s.row;
    const msgs = row.messages || [];
    const answer = msgs[msgs.length - 1] || {};
    const prompt = msgs.slice(0, -1);
    const lastUser = [...prompt].reverse().find((m) => m.role === "user") || prompt[prompt.length - 1] || {};
    const usage = row.usage || {};
    box.append(el("div", { class: "meta" },
      el("b", { text: s.partition }), ` · id ${row.id} · finish ${row.finish_reason}`,
      ` · ${usage.prompt_tokens ?? "?"} prompt + ${usage.completion_tokens ?? "?"} completion tokens`,
      s.truncated ? " · truncated" : "", ` · from ${s.source === "shard" ? "its shard" : "Redis"}`));
    const earlier = prompt.length > 1 ? ` (last of ${prompt.length} messages)` : "";
    box.append(el("div", { class: "part", text: `prompt${earlier}` }),
      el("pre", { class: "prompt", text: clip(textOf(lastUser.content), PROMPT_CHARS) }));
    if (answer.reasoning_content) {
      box.append(el("details", {}, el("summary", { class: "part", text: `reasoning (${answer.reasoning_content.length} characters)` }),
        el("pre", { class: "reasoning", text: clip(answer.reasoning_content, PREVIEW_CHARS) })));
    }
    box.append(el("div", { class: "part", text: "answer" }), el("pre", { class: "answer", text: clip(textOf(answer.content), PREVIEW_CHARS) }));
    if (answer.tool_calls) {
      box.append(el("div", { class: "part", text: "tool calls" }), el("pre", { class: "tools", text: clip(JSON.stringify(answer.tool_calls, null, 1), PREVIEW_CHARS) }));
    }
    return box;
  }

  function refreshSamples() {
    if (!tm.run) return Promise.resolve();
    const partition = $("sample-partition").value;
    const query = `&n=${$("sample-n").value}${partition ? `&partition=${encodeURIComponent(partition)}` : ""}`;
    return loadSamples(query, (samples) => `${samples.length} shown, read at ${new Date().toLocaleTimeString()}`);
  }

  // a worst example: the flagged job's sample in the viewer
  function showFlagged(button) {
    const { flag, partition, jobId } = button.dataset;
    $("samples-section").scrollIntoView();
    return loadSamples(`&partition=${encodeURIComponent(partition)}&job=${encodeURIComponent(jobId)}`, () => `flagged ${flag}: job ${jobId} of partition ${partition}`);
  }

  async function loadSamples(query, describe) {
    const run = tm.run;
    const note = $("samples-note");
    note.textContent = "loading…";
    try {
      const samples = await api(`api/samples?run=${encodeURIComponent(run)}${query}`);
      if (run !== tm.run) return;
      tm.samples = samples;
      const list = $("samples");
      list.textContent = "";
      for (const s of samples) list.append(sampleCard(s));
      if (!samples.length) list.append(el("p", { class: "muted", text: "no completion yet" }));
      note.textContent = describe(samples);
    } catch (e) {
      note.textContent = `could not read samples: ${e.message}`;
    }
  }

  function syncSamplePartitions(st) {
    const sel = $("sample-partition");
    const names = Object.keys(st.partitions).sort();
    const sig = JSON.stringify(names);
    if (sel.dataset.sig === sig) return;
    const keep = sel.value;
    sel.textContent = "";
    sel.append(el("option", { value: "", text: "all" }), ...names.map((p) => el("option", { value: p, text: p })));
    sel.value = names.includes(keep) ? keep : "";
    sel.dataset.sig = sig;
  }

  // -- the loop -------------------------------------------------------------------------------

  function render() {
    const st = tm.status, h = tm.hist;
    const option = [...$("run").options].find((o) => o.value === st.run);
    if (option) option.textContent = `${st.run} (${st.totals.done}/${st.totals.total} done)`;
    renderPaused(st);
    renderSummary(st);
    renderPartitions(st);
    renderQuality(st);
    renderFlagged(tm.flagged);
    renderServerTable(st);
    renderFailureTable(st);
    renderOutputs(st);
    renderSealing(st);
    syncSamplePartitions(st);
    renderRunCharts(h.series);
    renderQualityChart(h.series);
    renderServerCharts(st, h);
  }

  let busy = false;
  async function tick() {
    if (!tm.run || busy) return;
    busy = true;
    const run = tm.run;
    try {
      const since = tm.hist ? `&since=${tm.hist.cursor}` : "";
      const enc = encodeURIComponent(run);
      const [status, hist, flagged] = await Promise.all([api(`api/status?run=${enc}`),
        api(`api/history?run=${enc}${since}`), api(`api/flagged?run=${enc}`)]);
      if (run !== tm.run) return;
      tm.status = status;
      tm.flagged = flagged;
      mergeHistory(hist);
      render();
      tm.ticks += 1;
      tm.updated = new Date();
      clearError();
      $("live").textContent = `live · updated ${tm.updated.toLocaleTimeString()}`;
    } catch (e) {
      showError(`${run}: ${e.message}`);
      $("live").textContent = "not updating: retrying";
    } finally {
      busy = false;
    }
  }

  function selectRun(run) {
    tm.run = run;
    tm.status = null;
    tm.hist = null;
    tm.samples = null;
    dropCharts("");
    $("server-charts").dataset.sig = "";
    $("flagged").dataset.sig = "";
    $("samples").textContent = "";
    const url = new URL(location.href);
    url.searchParams.set("run", run);
    history.replaceState(null, "", url);
    $("run").value = run;
    tick().then(refreshSamples);
  }

  async function loadRuns() {
    try {
      const { runs } = await api("api/runs");
      tm.runs = runs;
      const sel = $("run");
      const names = runs.map((r) => r.run);
      const wanted = tm.run || new URLSearchParams(location.search).get("run") || names[0];
      if (wanted && !names.includes(wanted)) names.push(wanted);
      if (sel.dataset.sig !== JSON.stringify(names)) {
        sel.textContent = "";
        for (const name of names) sel.append(el("option", { value: name, text: name }));
        sel.dataset.sig = JSON.stringify(names);
        sel.value = tm.run || wanted || "";
      }
      for (const r of runs) {  // each run's progress, as of this listing
        const option = [...sel.options].find((o) => o.value === r.run);
        if (option) option.textContent = `${r.run} (${r.totals.done}/${r.totals.total} done)`;
      }
      $("run-note").textContent = `${runs.length} run${runs.length === 1 ? "" : "s"} in this Redis`;
      if (!wanted) showError("no runs in this Redis yet: enqueue one (tokenmill enqueue ... --run NAME)");
      else if (wanted !== tm.run) selectRun(wanted);
    } catch (e) {
      showError(`could not list the runs: ${e.message}`);
    }
  }

  function resize() {
    for (const u of Object.values(tm.charts)) {
      const box = u.root.parentNode;
      if (box) u.setSize({ width: Math.max(280, box.clientWidth - 14), height: u.height });
    }
  }

  $("run").addEventListener("change", (e) => selectRun(e.target.value));
  $("refresh-samples").addEventListener("click", refreshSamples);
  $("flagged").addEventListener("click", (e) => { const b = e.target.closest("button.job"); if (b) showFlagged(b); });
  $("sample-partition").addEventListener("change", refreshSamples);
  $("sample-n").addEventListener("change", refreshSamples);
  window.addEventListener("resize", resize);
  loadRuns();
  setInterval(tick, REFRESH_MS);
  setInterval(loadRuns, RUNS_MS);
})();
