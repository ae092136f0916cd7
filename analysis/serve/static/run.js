"use strict";
// One run: its pass rate, its train metrics over steps (watched first: entropy, lengths,
// truncation and interruption, clip fraction, grad norm, lag, push time), attempts, provenance.
const runId = decodeURIComponent(location.pathname.split("/").pop());
const FIRST = ["entropy", "response_length", "truncat", "interrupt", "clip", "grad_norm", "lag", "push"];
const esc = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
let version = null;

function order(names) {
  const rank = (n) => { const i = FIRST.findIndex((p) => n.includes(p)); return i < 0 ? FIRST.length : i; };
  return names.slice().sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
}

function draw(d) {
  document.title = `run ${d.id}`;
  document.getElementById("title").textContent = `run ${d.id}`;
  document.getElementById("back").href = "/sweep/" + encodeURIComponent(d.sweep);
  document.getElementById("summary").textContent = `sweep ${d.sweep}; ${d.state}${d.reason ? " (" + d.reason + ")" : ""}; step ${d.step}; ` +
    Object.entries(d.axes).map(([k, v]) => `${k}=${v}`).join(", ") + `; ${d.run_dir}`;
  document.getElementById("links").innerHTML = d.links.map((l) => `<a href="${esc(l.href)}">${esc(l.label)}</a>`).join(" &middot; ");
  const config = {displaylogo: false, responsive: true};
  Plotly.react("evals", [{x: d.evals.step, y: d.evals.pass_rate, mode: "lines+markers", name: "pass rate"}],
    {margin: {t: 10, r: 10}, xaxis: {title: "step"}, yaxis: {title: "pass rate"}, uirevision: "keep"}, config);
  const box = document.getElementById("metrics");
  for (const name of order(Object.keys(d.metrics))) {
    let div = document.getElementById("m-" + name);
    if (!div) { div = document.createElement("div"); div.id = "m-" + name; div.className = "metric"; box.appendChild(div); }
    const s = d.metrics[name];
    Plotly.react(div, [{x: s.step, y: s.value, mode: "lines", name}], {title: {text: name, font: {size: 13}},
      margin: {t: 30, r: 10, b: 30, l: 50}, xaxis: {title: "step"}, uirevision: "keep"}, config);
  }
  document.getElementById("attempts").innerHTML = "<tr><th>#</th><th>state</th><th>executor</th><th>job</th><th>node</th><th>resumed from</th><th>started</th><th>ended</th><th>reason</th></tr>" +
    d.attempts.map((a) => `<tr><td>${a.number}</td><td>${esc(a.state)}</td><td>${esc(a.executor)}</td><td>${esc(a.job_id)}</td><td>${esc(a.node)}</td>` +
      `<td>${esc(a.resumed_from_step)}</td><td>${esc(a.started_at)}</td><td>${esc(a.ended_at)}</td><td>${esc(a.reason)}</td></tr>`).join("");
  document.getElementById("provenance").textContent = JSON.stringify(d.provenance, null, 2);
  document.getElementById("config").textContent = JSON.stringify(d.config, null, 2);
}

async function poll() {
  try {
    const response = await fetch("/api/run/" + encodeURIComponent(runId));
    const d = await response.json();
    const stamp = JSON.stringify([d.step, d.state, d.evals.step.length, d.attempts.length]);
    if (stamp !== version) { version = stamp; draw(d); }
  } catch (e) { /* the server is away: try again */ }
  setTimeout(poll, 2000);
}
poll();
