// The streamrl dashboard: long-polls /dashboard/data and draws small canvas charts (no libraries, no CDN).
// Each chart's canvas carries data-points (points drawn) so that tests can read progress from the DOM.
// With several policies a tab per policy (and the policies table) picks whose charts are drawn: ?policy=NAME
// in the page's address, passed on to /dashboard/data; one policy looks as it always did.
"use strict";

const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];
const state = { seq: null, since: 0, points: [], versions: new Map(), data: null,
                key: sessionStorage.getItem("streamrl-key"),
                policy: new URLSearchParams(location.search).get("policy"),  // null: the gateway's default
                generation: 0, fetching: null };

function fmt(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "-";
  if (typeof v !== "number") return String(v);  // e.g. the spool's flags (records_spooling: true)
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
  if (a >= 10 || Number.isInteger(v)) return v.toFixed(0);
  return v.toFixed(a >= 1 ? 2 : 3);
}

function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }

// series: [{name, points: [[x, y]], band: [[x, lo, hi]] | undefined, color, line: false for dots only}];
// opts.time: x is unix seconds
function draw(id, series, opts = {}) {
  const canvas = document.getElementById(id);
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = w * dpr; canvas.height = h * dpr;
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  g.clearRect(0, 0, w, h);
  const all = series.flatMap(s => s.points.concat((s.band || []).flatMap(b => [[b[0], b[1]], [b[0], b[2]]])))
    .filter(p => Number.isFinite(p[1]));
  canvas.dataset.points = String(series.reduce((n, s) => n + s.points.filter(p => Number.isFinite(p[1])).length, 0));
  canvas.dataset.series = series.map(s => s.name + ":" + s.points.length).join(",");
  const left = 48, right = 10, top = 18, bottom = 22;
  g.font = "11px system-ui, sans-serif";
  if (!all.length) {
    g.fillStyle = "#6b7280"; g.fillText("no data yet", left, top + 20); return;
  }
  let [x0, x1] = [Math.min(...all.map(p => p[0])), Math.max(...all.map(p => p[0]))];
  let [y0, y1] = [Math.min(...all.map(p => p[1])), Math.max(...all.map(p => p[1]))];
  if (opts.zero !== false) y0 = Math.min(0, y0);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y1 = y0 + 1; }
  const X = x => left + (x - x0) / (x1 - x0) * (w - left - right);
  const Y = y => h - bottom - (y - y0) / (y1 - y0) * (h - top - bottom);
  g.strokeStyle = "#e5e7eb"; g.fillStyle = "#6b7280"; g.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4;
    g.beginPath(); g.moveTo(left, Y(y)); g.lineTo(w - right, Y(y)); g.stroke();
    g.fillText(fmt(y), 4, Y(y) + 4);
  }
  const whole = !opts.time && all.every(p => Number.isInteger(p[0]));
  const step = whole ? Math.max(1, Math.ceil((x1 - x0) / 3)) : (x1 - x0) / 3;
  for (let x = x0; x <= x1 + 1e-9; x += step) {
    const label = opts.time ? clock(x) : fmt(x);
    g.fillText(label, Math.min(X(x) - 10, w - right - g.measureText(label).width), h - 6);
  }
  series.forEach((s, i) => {
    const color = s.color || COLORS[i % COLORS.length];
    if (s.band && s.band.length) {
      g.fillStyle = color + "22"; g.beginPath();
      s.band.forEach((b, j) => j ? g.lineTo(X(b[0]), Y(b[2])) : g.moveTo(X(b[0]), Y(b[2])));
      [...s.band].reverse().forEach(b => g.lineTo(X(b[0]), Y(b[1])));
      g.closePath(); g.fill();
    }
    const pts = s.points.filter(p => Number.isFinite(p[1]));
    g.strokeStyle = color; g.fillStyle = color; g.lineWidth = 1.5; g.beginPath();
    pts.forEach((p, j) => j ? g.lineTo(X(p[0]), Y(p[1])) : g.moveTo(X(p[0]), Y(p[1])));
    if (s.line !== false) g.stroke();
    const r = s.line === false ? 4 : 2.2;  // dots only: bigger, they carry the series
    if (s.line === false || pts.length < 120) pts.forEach(p => { g.beginPath(); g.arc(X(p[0]), Y(p[1]), r, 0, 7); g.fill(); });
    g.fillText(s.name, left + 8 + i * 150, 11);
  });
}

// per-second rates of a counter between consecutive samples
function rate(points, key) {
  const out = [];
  for (let i = 1; i < points.length; i++) {
    const a = points[i - 1], b = points[i];
    if (b[key] === undefined || a[key] === undefined || b.time <= a.time) continue;
    out.push([b.time, Math.max(0, b[key] - a[key]) / (b.time - a.time)]);
  }
  return out;
}

function delta(points, key) {
  const out = [];
  for (let i = 1; i < points.length; i++)
    if (points[i][key] !== undefined) out.push([points[i].time, points[i][key] - (points[i - 1][key] || 0)]);
  return out;
}

function trainer(versions, key) {
  return versions.filter(v => v.trainer && v.trainer[key] !== undefined).map(v => [v.version, v.trainer[key]]);
}

function el(tag, props = {}, text = "") {
  const e = document.createElement(tag);
  Object.assign(e, props);
  if (text) e.textContent = text;
  return e;
}

// the policy tabs and the policies table: shown with several policies only
function renderPolicies(d) {
  const several = (d.policies || []).length > 1;
  const tabs = document.getElementById("policy-tabs");
  tabs.hidden = !several;
  document.getElementById("policies-section").hidden = !several;
  document.getElementById("requests-section").hidden = !several;
  if (!several) return;
  tabs.replaceChildren(...d.policies.map(p => {
    const b = el("button", { type: "button", className: p.warnings.length ? "warned" : "" }, `${p.name} v${p.version}`);
    b.dataset.policy = p.name;
    b.setAttribute("aria-pressed", String(p.name === d.policy.name));
    if (p.warnings.length) b.title = "warnings: " + p.warnings.join(", ");
    b.addEventListener("click", () => select(p.name));
    return b;
  }));
  document.querySelector("#policies tbody").replaceChildren(...d.policies.map(p => {
    const tr = el("tr", { className: p.name === d.policy.name ? "selected" : "" });
    tr.dataset.policy = p.name;
    const cells = [p.name + (p.default ? " (default)" : ""), `v${p.version}` + (p.served_name ? "" : " (base model)"),
                   fmt(p.swaps), fmt(p.requests), fmt(p.requests_failed), fmt(p.calls), fmt(p.rewards),
                   p.warnings.join(", ")];
    cells.forEach((c, i) => tr.append(el("td", { className: i >= 2 && i <= 6 ? "num" : i === 7 && c ? "bad" : "" }, c)));
    tr.addEventListener("click", () => select(p.name));
    return tr;
  }));
}

function loraText(l) {
  if (!l || l.status === "unknown") return "unknown";
  if (l.status === "off") return "LoRA off";
  const has = `${l.max_loras} GPU / ${l.max_cpu_loras} CPU`;
  return l.status === "ok" ? has : `${has}: too few (needs ${l.needs.max_loras} / ${l.needs.max_cpu_loras})`;
}

function render() {
  const d = state.data, points = state.points;
  const vs = [...state.versions.values()].sort((a, b) => a.version - b.version);
  document.getElementById("policy").textContent =
    `policy ${d.policy.name}: v${d.policy.version}` + (d.policy.served_name ? ` (${d.policy.served_name})` : " (base model)");
  renderPolicies(d);
  const several = d.policies.length > 1;
  const rewarded = vs.filter(v => v.rewards > 0);
  draw("reward-version", [
    { name: "served", points: rewarded.map(v => [v.version, v.reward_mean]),
      band: rewarded.map(v => [v.version, v.reward_mean - v.reward_std, v.reward_mean + v.reward_std]) },
    { name: "trained groups", points: trainer(vs, "reward_mean") },
  ]);
  const timed = rewarded.filter(v => v.first_reward);
  draw("reward-time", [{ name: "served", points: timed.map(v => [v.first_reward, v.reward_mean]),
                         band: timed.map(v => [v.first_reward, v.reward_mean - v.reward_std, v.reward_mean + v.reward_std]) }],
       { time: true });
  const evaluated = vs.filter(v => v.eval), base = evaluated.find(v => v.version === 0);
  const evalSeries = [{ name: "held-out score", points: evaluated.map(v => [v.version, v.eval.score]) }];
  if (base && evaluated.length > 1)  // the base model's score across the chart, and the versions below it
    evalSeries.push({ name: "base model (v0)", color: "#9ca3af",
                      points: [[0, base.eval.score], [evaluated[evaluated.length - 1].version, base.eval.score]] },
                    { name: "below base", color: "#dc2626", line: false,
                      points: evaluated.filter(v => v.eval.below_base).map(v => [v.version, v.eval.score]) });
  draw("eval", evalSeries);
  const warnings = document.getElementById("warnings");
  warnings.replaceChildren(...(d.warnings || []).map(w => {
    const p = document.createElement("p");
    p.className = "warning"; p.dataset.kind = w.kind; p.textContent = w.text;
    return p;
  }));
  draw("throughput", [{ name: "rollout tok/s", points: rate(points, "completion_tokens") },
                      { name: "trainer tok/s", points: vs.filter(v => v.published && v.trainer.tokens_per_s !== undefined)
                          .map(v => [v.published, v.trainer.tokens_per_s]) }], { time: true });
  draw("staleness", [{ name: "mean", points: trainer(vs, "staleness_mean") },
                     { name: "max", points: trainer(vs, "staleness_max") }]);
  draw("lag", [{ name: "records behind", points: trainer(vs, "kafka_lag") }]);
  draw("swap", [{ name: "seconds", points: vs.filter(v => v.publish_to_route_s !== null)
                   .map(v => [v.version, v.publish_to_route_s]) }]);
  const failures = [{ name: "failed requests", points: delta(points, "requests_failed") },
                    { name: "records failed", points: delta(points, "records_failed") },
                    { name: "records dropped", points: delta(points, "records_dropped") },
                    { name: "buffered", points: points.filter(p => p.records_buffered !== undefined)
                        .map(p => [p.time, p.records_buffered]) }];
  if (several) failures.push({ name: `failed (${d.policy.name})`, points: delta(points, "policy_requests_failed") });
  draw("failures", failures, { time: true });
  if (several)
    draw("requests", [{ name: d.policy.name, points: rate(points, "policy_requests") },
                      { name: "gateway (all routes)", color: "#9ca3af", points: rate(points, "requests") }], { time: true });
  document.querySelector("#upstreams tbody").replaceChildren(...d.upstreams.map(u => {
    const tr = el("tr");
    tr.append(el("td", {}, u.url), el("td", { className: u.healthy ? "" : "bad" }, u.healthy ? "yes" : "no"),
              el("td", { className: "num" }, String(u.in_flight)),
              el("td", { className: u.lora && (u.lora.status === "too_few" || u.lora.status === "off") ? "bad" : "" },
                 loraText(u.lora)),
              el("td", {}, u.last_error || ""));
    return tr;
  }));
  const last = points[points.length - 1] || {};
  const rows = Object.keys(last).filter(k => k.startsWith("records_") || k === "rewards" || k === "requests")
    .map(k => `<tr><td>${k.replace("records_", "records ")}</td><td class="num">${fmt(last[k])}</td></tr>`);
  rows.push(`<tr><td>rewards not matched to a served call</td><td class="num">${d.rewards_unattributed}</td></tr>`);
  document.querySelector("#records tbody").innerHTML = rows.join("");
}

function setStatus(s, text) {
  const el = document.getElementById("status");
  el.dataset.state = s; el.textContent = text;
}

// show another policy: its data from the start (the long poll in flight is dropped), its name in the address
function select(policy) {
  if (state.data && policy === state.data.policy.name) return;
  state.policy = policy;
  Object.assign(state, { seq: null, since: 0, points: [], versions: new Map(), generation: state.generation + 1 });
  const url = new URL(location.href);
  url.searchParams.set("policy", policy);
  history.replaceState(null, "", url);
  if (state.fetching) state.fetching.abort();
}

async function poll() {
  for (;;) {
    const generation = state.generation;
    const q = new URLSearchParams({ since: state.since });
    if (state.seq !== null) q.set("seq", state.seq);
    if (state.policy) q.set("policy", state.policy);
    const headers = state.key ? { Authorization: "Bearer " + state.key } : {};
    let r, d;
    state.fetching = new AbortController();
    try {
      r = await fetch("/dashboard/data?" + q, { headers, cache: "no-store", signal: state.fetching.signal });
      d = r.ok ? await r.json() : null;
    } catch (e) {
      if (generation !== state.generation) continue;  // another policy was selected
      setStatus("error", "gateway unreachable, retrying");
      await new Promise(res => setTimeout(res, 2000));
      continue;
    }
    if (generation !== state.generation) continue;
    if (r.status === 401 || r.status === 403) {
      setStatus("key", "needs an API key with the admin scope");
      document.getElementById("key-form").hidden = false;
      return;
    }
    if (r.status === 404 && state.policy) {  // a policy this gateway does not serve (an old link): the default one
      setStatus("error", `no policy ${state.policy} here: showing the default one`);
      state.policy = null;
      history.replaceState(null, "", location.pathname);
      continue;
    }
    if (!r.ok) { setStatus("error", `HTTP ${r.status}`); await new Promise(res => setTimeout(res, 2000)); continue; }
    state.points = state.points.concat(d.points).slice(-3600);
    if (d.points.length) state.since = d.points[d.points.length - 1].time;
    for (const v of d.versions) state.versions.set(v.version, v);  // only the changed ones come
    state.seq = d.seq; state.data = d;
    setStatus("live", "live · " + clock(d.now));
    render();
  }
}

document.getElementById("key-form").addEventListener("submit", e => {
  e.preventDefault();
  state.key = document.getElementById("key").value.trim();
  sessionStorage.setItem("streamrl-key", state.key);
  document.getElementById("key-form").hidden = true;
  poll();
});
window.addEventListener("resize", () => state.data && render());
poll();
