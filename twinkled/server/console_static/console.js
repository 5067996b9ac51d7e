// The Twinkle console: reads the daemon's /console/api/ JSON and draws it. Every URL here
// is relative to this page, so the console works behind a proxy under a path prefix.
"use strict";

const KEY = "twinkle-console-key";
const $ = (id) => document.getElementById(id);

function esc(v) {
  return String(v ?? "").replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;",
    ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}
const when = (t) => (t ? new Date(t * 1000).toLocaleString() : "");
const num = (v, digits = 4) => (v == null ? "" : Number(v).toPrecision(digits));
function bytes(n) {
  if (n == null) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

async function api(path) {
  const r = await fetch("api/" + path, {headers: {"X-API-Key": sessionStorage.getItem(KEY)}});
  if (r.status === 401) { signOut("That key was refused (401)."); throw new Error("401"); }
  const body = await r.json();
  if (!r.ok) throw new Error(body.detail || r.statusText);
  return body;
}

function table(columns, rows, id = "") {
  const head = columns.map((c) => `<th>${esc(c[0])}</th>`).join("");
  const body = rows.map((row) => "<tr>" + columns.map(([, f, cls]) =>
    `<td${cls ? ` class="${cls}"` : ""}>${f(row)}</td>`).join("") + "</tr>").join("");
  return `<table${id ? ` id="${id}"` : ""}><thead><tr>${head}</tr></thead><tbody>${body}</tbody></table>`;
}

// One curve as SVG: y against x (the step number unless xs says), axes labelled with
// the extremes.
function curve(title, ys, xs = ys.map((_, i) => i + 1)) {
  const W = 420, H = 200, L = 52, R = 10, T = 10, B = 24;
  let lo = Math.min(...ys), hi = Math.max(...ys);
  if (hi === lo) { const pad = Math.abs(hi) / 2 || 1; lo -= pad; hi += pad; }  // flat: centred
  const span = hi - lo, x0 = xs[0], xspan = xs[xs.length - 1] - x0;
  const x = (i) => L + (xspan > 0 ? ((xs[i] - x0) * (W - L - R)) / xspan : (W - L - R) / 2);
  const y = (v) => T + (H - T - B) * (1 - (v - lo) / span);
  const pts = ys.map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
  const dots = ys.length <= 200 ? ys.map((v, i) =>
    `<circle cx="${x(i).toFixed(1)}" cy="${y(v).toFixed(1)}" r="2"><title>step ${xs[i]}: ${
      esc(v)}</title></circle>`).join("") : "";
  return `<figure><figcaption>${esc(title)}: last ${num(ys[ys.length - 1])}, ${
    ys.length} point(s)</figcaption>
    <svg class="curve" data-metric="${esc(title)}" data-points="${ys.length}" width="${W}"
         height="${H}" viewBox="0 0 ${W} ${H}">
      <line x1="${L}" y1="${T}" x2="${L}" y2="${H - B}"/>
      <line x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}"/>
      <text x="${L - 4}" y="${T + 8}" text-anchor="end">${num(hi, 3)}</text>
      <text x="${L - 4}" y="${H - B}" text-anchor="end">${num(lo, 3)}</text>
      <text x="${L}" y="${H - 8}">${esc(x0)}</text>
      <text x="${W - R}" y="${H - 8}" text-anchor="end">step ${esc(xs[xs.length - 1])}</text>
      <polyline points="${pts}"/>${dots}
    </svg></figure>`;
}

// What the client reported (a reward mean, ...): one curve per name, against its steps.
function clientCurves(points) {
  const series = new Map();
  for (const p of points) {
    for (const [k, v] of Object.entries(p.metrics)) {
      if (!series.has(k)) series.set(k, {xs: [], ys: []});
      series.get(k).xs.push(p.step);
      series.get(k).ys.push(v);
    }
  }
  return [...series].map(([name, {xs, ys}]) => curve(`client ${name}`, ys, xs)).join("");
}

// Each kind of step's metrics, one curve per metric, in the order the steps ran.
function curves(steps) {
  const series = new Map();
  for (const s of steps) {
    for (const [k, v] of Object.entries(s.metrics)) {
      const name = `${s.kind} ${k}`;
      if (!series.has(name)) series.set(name, []);
      series.get(name).push(v);
    }
  }
  const train = steps.filter((s) => s.kind === "forward_backward");
  if (train.length) series.set("forward_backward tokens", train.map((s) => s.tokens));
  return [...series].map(([name, ys]) => curve(name, ys)).join("");
}

// A run's last sampling calls (newest first): the prompt's end, each completion.
function sampleTable(samples) {
  if (!samples.length) return "<p>None since the daemon started.</p>";
  const text = (t, ids, n, shown) => `<pre class="sample">${esc(t ?? ids.join(" "))}</pre>` +
    (n > shown ? `<small>(${shown} of ${n} tokens shown)</small>` : "");
  return table([
    ["time", (c) => when(c.time)], ["sampler", (c) => esc(c.sampler)],
    ["prompt", (c) => text(c.prompt_text, c.prompt, c.prompt_tokens, c.prompt.length)],
    ["completions", (c) => c.sequences.map((s) => text(s.text, s.tokens, s.tokens_n,
      s.tokens.length) +
      `<small>logprob sum ${num(s.logprob_sum)} · ${s.tokens_n} token(s) · ${
        esc(s.stop_reason)}</small>`).join("<hr>") + (c.num_samples > c.sequences.length ?
      `<small>(${c.sequences.length} of ${c.num_samples} shown)</small>` : "")],
  ], samples, "samples");
}

const pct = (f) => `${(100 * (f || 0)).toFixed(1)}%`;
// A fraction as a bar on a 100 px track, with a mark at `mark` (what the weight entitles to).
const bar = (f, mark) => `<span class="track"><span class="bar" style="width:${
  Math.min(100, Math.round(100 * (f || 0)))}px"></span>${mark == null ? "" :
  `<span class="mark" style="left:${Math.min(100, Math.round(100 * mark))}px" title="weight's share ${
    pct(mark)}"></span>`}</span> ${pct(f)}`;

const runLink = (id) => `<a href="#/run/${encodeURIComponent(id)}">${esc(id)}</a>`;

const pages = {
  async runs() {
    const {runs} = await api("runs");
    return `<h1>Training runs</h1>` + (runs.length ? table([
      ["run", (r) => runLink(r.id)], ["tenant", (r) => esc(r.tenant)],
      ["base model", (r) => esc(r.base_model)], ["rank", (r) => r.lora_rank, "num"],
      ["steps", (r) => r.steps, "num"], ["loaded", (r) => (r.live ? "yes" : "no")],
      ["created", (r) => when(r.created)], ["last request", (r) => when(r.last_request_time)],
    ], runs) : "<p>No runs yet.</p>");
  },

  async run(id) {
    const base = "runs/" + encodeURIComponent(id);
    const [{run, steps, client_metrics: reported, checkpoints}, {samples}] = await Promise.all([
      api(base), api(base + "/samples")]);
    const lora = run.lora_config || {};
    return `<h1 id="run-title">Run ${esc(run.id)}</h1>
      <p>tenant ${esc(run.tenant)} · ${esc(run.base_model)} · rank ${esc(run.lora_rank)}
         (alpha ${esc(lora.alpha)}, ${esc(lora.optimizer || "adam")}) · created
         ${when(run.created)} · ${steps.length} step(s) recorded</p>
      <h2>Curves</h2><div class="charts">${curves(steps) || "<p>No steps yet.</p>"}</div>
      <h2>Reported by the client</h2><div class="charts" id="client-curves">${
        clientCurves(reported) || `<p>Nothing yet: a client reports its own numbers (a
        reward mean, ...) with <code>report_to=["twinkle"]</code> (twinkle_sdk) or
        <code>TwinkleMetricsLogger</code> (tinker-cookbook).</p>`}</div>
      <h2>Checkpoints</h2>` + (checkpoints.length ? table([
        ["path", (c) => esc(c.tinker_path)], ["status", (c) => esc(c.status)],
        ["size", (c) => bytes(c.size_bytes), "num"], ["saved", (c) => when(c.created)],
        ["", (c) => (c.download ? `<a href="${esc(c.download)}">download (.tar)</a>` : "")],
      ], checkpoints) : "<p>None.</p>") + `<h2>Last sampling calls</h2>` + sampleTable(samples);
  },

  async sessions() {
    const {sessions} = await api("sessions");
    return `<h1>Sessions</h1>` + (sessions.length ? table([
      ["session", (s) => esc(s.id)], ["tenant", (s) => esc(s.tenant)],
      ["SDK", (s) => esc(s.sdk_version)], ["created", (s) => when(s.created)],
      ["finished", (s) => (s.finished_at ? `${when(s.finished_at)} (${
        esc(s.finish_reason)})` : "open")],
      ["runs", (s) => s.runs.map(runLink).join("<br>")],
      ["samplers", (s) => s.samplers.length, "num"],
      ["trace", (s) => `<a href="${esc(s.trace)}">trace.json</a>`],
    ], sessions) : "<p>No sessions yet.</p>");
  },

  async operator() {
    const st = await api("operator");
    const tenants = Object.entries(st.tenants || {}).map(([name, t]) => ({name, ...t}));
    const sum = (key) => tenants.reduce((a, t) => a + (t[key] || 0), 0);
    const weights = sum("weight") || 1;
    let html = `<h1>Operator</h1><p>model ${esc(st.model)} · ${esc(st.state)}` +
      (st.steps != null ? ` · ${st.steps} step(s) · ${st.adapters} adapter(s) · ${
        st.restarts} restart(s) · step target ${st.step_target_ms ?? "none"} ms` : "") +
      `</p><p id="queue">queue depth: ${sum("queued_requests")} request(s), ${
        sum("queued_tokens")} token(s), ${sum("paused")} paused` + (st.samples_running != null ?
        ` · ${st.samples_running} sample(s) decoding` : "") + `</p>` +
      // Each tenant's share of the training time against what its weight entitles it to
      // (the weight's part of all listed tenants' weights); "while contended": only the
      // time other tenants also had work queued, where the weights decide.
      `<h2>Tenants</h2>` + table([
      ["tenant", (t) => esc(t.name)], ["weight", (t) => num(t.weight, 3), "num"],
      ["weight's share", (t) => pct(t.weight / weights), "num"],
      ["share", (t) => bar(t.share, t.weight / weights)],
      ["share while contended", (t) => (t.contended_share == null ? "" :
        pct(t.contended_share)), "num"],
      ["queued requests", (t) => t.queued_requests, "num"],
      ["queued tokens", (t) => t.queued_tokens, "num"], ["paused", (t) => t.paused, "num"],
      ["served tokens", (t) => t.served_tokens, "num"],
    ], tenants, "tenants");
    if (st.workers) {
      // Utilisation: the part of its time up that the worker spent running steps.
      html += `<h2>Workers (GPU memory and utilisation)</h2>` + table([
        ["lane", (w) => w.lane, "num"], ["rank", (w) => w.rank, "num"],
        ["device", (w) => esc(w.device)], ["host", (w) => esc(w.host)],
        ["alive", (w) => (w.alive ? "yes" : "no")],
        ["memory", (w) => bytes(w.memory_bytes), "num"],
        ["peak memory", (w) => bytes(w.peak_memory_bytes), "num"],
        ["busy s", (w) => num(w.busy_s, 3), "num"], ["up s", (w) => num(w.up_s, 3), "num"],
        ["utilisation", (w) => (w.up_s ? bar(w.busy_s / w.up_s) : ""), "num"],
      ], st.workers, "workers");
      // One lane unless the config says more: its row from the daemon-wide figures.
      const lanes = st.lanes || [{lane: 0, devices: st.devices, steps: st.steps,
        adapters: st.adapters, step_target_ms: st.step_target_ms, restarts: st.restarts,
        tiers: st.tiers}];
      html += `<h2>Lanes</h2>` + table([
        ["lane", (l) => l.lane, "num"], ["devices", (l) => esc(l.devices.join(", "))],
        ["host", (l) => esc(l.host ?? "")], ["state", (l) => esc(l.down ? `down: ${l.down}` : l.long ? "up, long lane" : "up")],
        ["steps", (l) => l.steps, "num"], ["adapters", (l) => l.adapters, "num"],
        ["step target ms", (l) => l.step_target_ms ?? "none", "num"],
        ["on GPU", (l) => l.tiers?.gpu, "num"], ["on host", (l) => l.tiers?.host, "num"],
        ["restarts", (l) => l.restarts, "num"],
      ], lanes, "lanes");
    }
    if (st.tiers) {
      html += `<h2>Adapter residency</h2>` + table([
        ["on GPU", (t) => t.gpu, "num"], ["on host", (t) => t.host, "num"],
        ["moves", (t) => esc(JSON.stringify(t.moves))],
        ["moved", (t) => bytes(t.moved_bytes), "num"],
      ], [st.tiers]);
    }
    if (st.logprob_gap?.checked) {
      const g = st.logprob_gap;
      html += `<p>logprob gap (sampler against trainer, nats per token): mean ${num(g.mean, 3)
        }, max ${num(g.max, 3)} over ${g.checked} checked sample(s)</p>`;
    }
    if (st.workers) {
      html += `<p>Sessions and their traces: <a href="#/sessions">Sessions</a>.</p>`;
    }
    return html;
  },
};

async function show() {
  if (!sessionStorage.getItem(KEY)) return signOut("");
  $("login").hidden = true;
  $("nav").hidden = $("logout").hidden = false;
  const [page, arg] = (location.hash.replace(/^#\//, "") || "runs").split("/");
  for (const a of document.querySelectorAll("#nav a")) {
    a.classList.toggle("here", a.getAttribute("href") === `#/${page}`);
  }
  const view = $("view");
  try {
    const me = await api("me");
    $("who").textContent = me.admin ? "admin (every tenant)" : `tenant ${me.tenant}`;
    const render = pages[page] || pages.runs;
    view.innerHTML = await render(arg && decodeURIComponent(arg));
    view.dataset.page = page;
  } catch (e) {
    if (e.message !== "401") view.innerHTML = `<p class="error">${esc(e.message)}</p>`;
  }
}

function signOut(why) {
  sessionStorage.removeItem(KEY);
  $("view").innerHTML = "";
  $("nav").hidden = $("logout").hidden = true;
  $("who").textContent = "";
  $("login").hidden = false;
  $("login-error").textContent = why;
}

$("login").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(KEY, $("key").value.trim());
  $("key").value = "";
  show();
});
$("logout").addEventListener("click", () => signOut(""));
window.addEventListener("hashchange", show);
show();
