"use strict";
// The sweep page: polls /api/version every second and redraws when the data moved.
const sweep = decodeURIComponent((location.pathname.match(/^\/sweep\/([^/]+)/) || [])[1] || "");
const suffix = sweep ? "/" + encodeURIComponent(sweep) : "";
const MAX_ROWS = 2000;  // rows put in the table at once; the rest on demand
let data = null, version = -1, sortKey = "rank", sortUp = true, showAll = false;

const fmt = (v, digits = 3) => v === null || v === undefined ? "" :
  typeof v === "number" ? (Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-2) ? v.toExponential(2) : +v.toFixed(digits)) : String(v);
const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
const palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
const symbols = ["circle", "square", "diamond", "triangle-up", "x", "star", "cross", "triangle-down"];

function traces(d, apart) {
  const out = [];
  d.configs.forEach((c, i) => {
    const color = palette[i % palette.length], name = c.label || c.seeds[0].run;
    if (c.band) out.push({x: c.band.x.concat(c.band.x.slice().reverse()), y: c.band.hi.concat(c.band.lo.slice().reverse()),
      fill: "toself", fillcolor: color + "22", line: {width: 0}, hoverinfo: "skip", showlegend: false, legendgroup: name, type: "scatter"});
    if (apart) c.seeds.forEach((s, j) => out.push({x: s.x, y: s.y, mode: "markers", type: "scattergl", name: `${name} seed ${s.seed ?? j}`,
      marker: {color, symbol: symbols[j % symbols.length], size: 6}, legendgroup: name, showlegend: false, customdata: s.x.map(() => s.run)}));
    else out.push({x: c.seeds.flatMap((s) => s.x), y: c.seeds.flatMap((s) => s.y), mode: "markers", type: "scattergl", name,
      marker: {color, size: 6}, legendgroup: name, showlegend: false, customdata: c.seeds.flatMap((s) => s.x.map(() => s.run))});
    if (c.curve) out.push({x: c.curve.x, y: c.curve.y, mode: "lines", type: "scatter", line: {color, width: 2}, legendgroup: name,
      name: `${name}: A=${fmt(c.fit.A)} B=${fmt(c.fit.B, 2)}` + (c.p_best !== null ? ` p_best=${fmt(c.p_best, 2)}` : ""), meta: "fit"});
    if (c.extrapolation) out.push({x: c.extrapolation.x, y: c.extrapolation.y, mode: "lines", type: "scatter", legendgroup: name,
      line: {color, width: 2, dash: "dot"}, showlegend: false, name: `${name} to ${fmt(c.extrapolation.predict_at)}`, meta: "extrapolation"});
  });
  if (d.cloud) out.push({x: d.cloud.x, y: d.cloud.y, mode: "markers", type: "scattergl", marker: {color: "#bbb", size: 3},
    name: `${d.n_configs - d.configs.length} other configurations`});
  return out;
}

function drawCurves() {
  const d = data, apart = document.getElementById("apart").checked;
  const layout = {uirevision: "keep", margin: {t: 30, r: 10}, hovermode: "closest", legend: {font: {size: 11}},
    xaxis: {type: "log", title: d.compute}, yaxis: {title: "pass rate"},
    shapes: d.predict_at ? [{type: "line", x0: d.predict_at, x1: d.predict_at, yref: "paper", y0: 0, y1: 1, line: {dash: "dash", color: "#999"}}] : []};
  Plotly.react("curves", traces(d, apart), layout, {displaylogo: false, responsive: true});
}

const columns = [
  ["id", "run"], ["config", "configuration"], ["state", "state"], ["step", "step / budget"],
  ["pass_rate", "last pass rate"], ["compute", "compute"], ["p_best", "p_best"], ["attempts", "attempts"], ["links", "trackers"],
];
function drawTable() {
  const d = data, head = document.querySelector("#runs thead"), body = document.querySelector("#runs tbody");
  head.innerHTML = "<tr>" + columns.map(([k, t]) => `<th data-key="${k}" class="${k === sortKey ? "sorted" : ""}">${t}</th>`).join("") + "</tr>";
  const rank = Object.fromEntries(d.configs.map((c) => [c.label, c.rank ?? 1e9]));
  const value = (r) => sortKey === "rank" ? (rank[r.config] ?? 1e9) : r[sortKey];
  const rows = d.runs.slice().sort((a, b) => {
    const x = value(a), y = value(b);
    if (x === y) return 0; if (x === null || x === undefined) return 1; if (y === null || y === undefined) return -1;
    return (x < y ? -1 : 1) * (sortUp ? 1 : -1);
  });
  const shown = showAll ? rows : rows.slice(0, MAX_ROWS);
  body.innerHTML = shown.map((r) => {
    const links = (d.links[r.id] || []).map((l) => `<a href="${esc(l.href)}">${esc(l.tracker)}</a>`).join(" ");
    const state = `<span class="${r.state}" title="${esc(r.reason || "")}">${r.state}</span>` + (r.reason && r.state !== "completed" ? ` <span class="muted">${esc(r.reason.slice(0, 80))}</span>` : "");
    return `<tr data-run="${r.id}"><td><a href="/run/${r.id}">${r.id}</a></td><td>${esc(r.config || "")}</td><td>${state}</td>` +
      `<td class="num">${r.step} / ${r.budget_steps ?? "-"}</td><td class="num">${fmt(r.pass_rate)}</td><td class="num">${fmt(r.compute)}</td>` +
      `<td class="num">${fmt(r.p_best, 2)}</td><td class="num">${r.attempts}</td><td>${links}</td></tr>`;
  }).join("");
  document.getElementById("more").innerHTML = rows.length > shown.length ?
    `${rows.length - shown.length} more runs: <a href="#" id="showall">show all</a>` : "";
  const all = document.getElementById("showall");
  if (all) all.onclick = (e) => { e.preventDefault(); showAll = true; drawTable(); };
}

function draw() {
  const d = data;
  document.title = `sweep ${d.sweep}`;
  document.getElementById("title").textContent = `sweep ${d.sweep}`;
  const states = {};
  d.runs.forEach((r) => { states[r.state] = (states[r.state] || 0) + 1; });
  document.getElementById("summary").textContent = `${d.runs.length} runs (` + Object.entries(states).map(([s, n]) => `${n} ${s}`).join(", ") +
    `), ${d.n_configs} fitted configurations; compute: ${d.compute}` + (d.predict_at ? `; target ${fmt(d.predict_at)}` : "");
  drawCurves();
  drawTable();
}

const backtestBox = document.getElementById("backtestbox");
let backtestVersion = -1;
async function loadBacktest() {
  if (!backtestBox.open || backtestVersion === version) return;
  backtestVersion = version;
  const status = document.getElementById("backtest-status");
  status.textContent = "replaying the fits at every cut ...";
  const b = await (await fetch("/api/backtest" + suffix)).json();
  if (b.error) { status.textContent = b.error; document.body.dataset.backtest = "error"; return; }
  const x = b.cuts.map((c) => 100 * c.fraction), pct = (v) => v === null ? "-" : `${Math.round(100 * v)}%`;
  const line = (key, name, color, dash, yaxis) => ({x, y: b.cuts.map((c) => c[key]), name, mode: "lines+markers", type: "scatter",
    line: {color, dash}, yaxis, meta: key});
  Plotly.react("backtest", [
    line("share_within", `share within ${b.tol}`, "#2ca02c", "solid", "y"),
    line("tau", "Kendall tau", "#1f77b4", "solid", "y"),
    line("tau_separated", `tau, finals > ${b.tol} apart`, "#17becf", "dash", "y"),
    line("coverage", `${Math.round(100 * b.level)}% band coverage`, "#7f7f7f", "dot", "y"),
    line("median_abs_error", "median |error|", "#d62728", "dash", "y2"),
  ], {margin: {t: 20, r: 60}, xaxis: {title: "fit on the first x% of each configuration's compute"},
      yaxis: {title: "share / tau", range: [-0.05, 1.05]}, yaxis2: {title: "|predicted - final|", overlaying: "y", side: "right", rangemode: "tozero"},
      legend: {font: {size: 11}}}, {displaylogo: false, responsive: true});
  document.querySelector("#backtesttable tbody").innerHTML = b.cuts.map((c) => {
    const judged = c.configs.filter((k) => k.covered !== null), covered = judged.filter((k) => k.covered).length;
    return `<tr data-cut="${c.fraction}"><td class="num">${pct(c.fraction)}</td><td class="num">${c.n_predicted}/${c.n}</td>` +
      `<td class="num">${c.n_within}/${c.n} (${pct(c.share_within)})</td><td class="num">${fmt(c.median_abs_error)}</td>` +
      `<td class="num">${fmt(c.max_abs_error)}</td><td class="num">${judged.length ? `${covered}/${judged.length}` : "-"}</td>` +
      `<td class="num">${fmt(c.tau, 2)}</td><td class="num">${fmt(c.tau_separated, 2)}</td><td class="num">${fmt(c.p_best_winner, 2)}</td></tr>`;
  }).join("");
  status.textContent = b.earliest === null ? `no cut from which on >= 90% are within ${b.tol} and tau >= 0.8 (pairs apart)` :
    `from ${pct(b.earliest)} of compute on, every cut has >= 90% within ${b.tol} and tau >= 0.8 (pairs apart)`;
  document.body.dataset.backtest = String(version);
}
backtestBox.addEventListener("toggle", loadBacktest);

async function poll() {
  try {
    const v = await (await fetch("/api/version" + suffix)).json();
    if (v.version !== version) {
      const response = await fetch("/api/sweep" + suffix);
      data = await response.json();
      version = +response.headers.get("X-Version");
      if (data) draw();
      document.body.dataset.version = version;
      loadBacktest();
    }
    document.getElementById("live").textContent = v.error ? `store: ${v.error}` : `live (version ${version})`;
  } catch (e) {
    document.getElementById("live").textContent = "server unreachable; retrying";
  }
  setTimeout(poll, 1000);
}

document.addEventListener("click", (e) => {
  const th = e.target.closest("th[data-key]");
  if (!th || !data) return;
  const key = th.dataset.key;
  if (key === sortKey) sortUp = !sortUp; else { sortKey = key; sortUp = true; }
  drawTable();
});
document.getElementById("apart").addEventListener("change", () => data && drawCurves());
poll();
