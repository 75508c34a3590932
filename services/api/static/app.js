// The Greyhound dashboard: plain JS over the REST API (the same routes and tokens as any client).
"use strict";

const TOKEN_KEY = "greyhound.token";
const view = document.getElementById("view");
const flash = document.getElementById("flash");
let me = null;

function esc(v) {
  return String(v ?? "").replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;",
    '"': "&quot;", "'": "&#39;"}[c]));
}

function say(text, isError) {
  flash.textContent = text;
  flash.className = isError ? "error" : "";
  flash.hidden = !text;
}

async function api(path, options) {
  const token = localStorage.getItem(TOKEN_KEY);
  const headers = Object.assign({"Accept": "application/json"}, (options || {}).headers || {});
  if (token) headers["Authorization"] = "Bearer " + token;
  if (options && options.body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(path, Object.assign({}, options || {}, {headers,
    body: options && options.body !== undefined ? JSON.stringify(options.body) : undefined}));
  let body = null;
  try { body = await resp.json(); } catch (e) { body = null; }
  return {ok: resp.ok, status: resp.status, body};
}

function canOperate() { return me && (me.role === "operator" || me.role === "admin"); }
function ago(iso) {
  if (!iso) return "";
  const s = (Date.now() - new Date(iso).getTime()) / 1000;
  if (s < 90) return Math.round(s) + " s ago";
  if (s < 5400) return Math.round(s / 60) + " min ago";
  if (s < 172800) return (s / 3600).toFixed(1) + " h ago";
  return Math.round(s / 86400) + " d ago";
}
// A proposal's time left to decide: the server says how many seconds were left when it answered
// (expires_in_s), so a browser whose clock is off still counts down right.
function deadline(p) {
  if (p.status !== "proposed" || p.expires_in_s == null) return "";
  const at = Date.now() + p.expires_in_s * 1000;
  return `<span class="deadline" data-deadline="${at}" title="expires ${esc(new Date(p.expires_at).toLocaleString())}">${esc(left(at))}</span>`;
}
function left(at) {
  const s = Math.round((at - Date.now()) / 1000);
  if (s <= 0) return "expired: the planner proposes again if the loss still pays for it";
  const m = Math.floor(s / 60), sec = String(s % 60).padStart(2, "0");
  return `${m}:${sec} left to decide (until ${new Date(at).toLocaleTimeString()})`;
}
setInterval(() => document.querySelectorAll("[data-deadline]").forEach(e => {
  e.textContent = left(Number(e.dataset.deadline));
  e.classList.toggle("urgent", Number(e.dataset.deadline) - Date.now() < 120000);
}), 1000);
function hours(cost) {
  if (!cost || cost.gpu_hours_lost == null) return "n/a";
  const h = cost.gpu_hours_lost;
  return h.toFixed(h < 10 ? 2 : 1);
}
function kindClass(kind) { return kind.startsWith("hang") ? "hang" : "slow"; }
function culprit(c, status) {
  if (!c) return "";
  const named = (c.gpus && c.gpus.length) || (c.links && c.links.length) || c.compute_ranks || c.diagnosis;
  if (status === "detected" && !named)
    return "not localised yet" + (c.ranks && c.ranks.length ? ` (detectors fired on ${c.ranks.length} rank${c.ranks.length > 1 ? "s" : ""})` : "");
  if (c.gpus && c.gpus.length)
    return "GPU " + c.gpus.slice(0, 3).map(g => `${g.host}:${g.device} (rank ${g.rank})`).join(", ");
  if (c.links && c.links.length) return "link " + c.links.slice(0, 3).map(p => p.join("–")).join(", ");
  if (c.ranks && c.ranks.length) return "rank " + c.ranks.slice(0, 8).join(", ");
  if (c.comm_id != null) return "communicator " + c.comm_id;
  return "not localised yet";
}

async function signIn() {
  const r = await api("/v1/me");
  me = r.ok ? r.body : null;
  document.getElementById("who").textContent = me ? `${me.name} · ${me.role}` : "not signed in";
  return r;
}

// ---- overview --------------------------------------------------------------------------------

async function overview() {
  const [inc, fleet, jobs, waiting] = await Promise.all([
    api("/v1/incidents?status=open&limit=200"), api("/v1/fleet"), api("/v1/jobs?limit=50"),
    api("/v1/plans?status=proposed&limit=50")]);
  if (!inc.ok) return denied(inc);
  const waitingRows = (waiting.ok ? waiting.body : []).map(p => `<tr class="click" data-href="#/incidents/${esc(p.incident_id)}" data-waiting="${esc(p.id)}">
      <td>${esc(p.strategy)}</td><td>${esc(p.job_id)}</td><td>${deadline(p)}</td></tr>`).join("");
  const rows = inc.body.map(i => `
    <tr class="click" data-href="#/incidents/${esc(i.id)}" data-incident="${esc(i.id)}">
      <td><span class="pill ${kindClass(i.kind)}">${esc(i.kind)}</span></td>
      <td><a href="#/jobs/${esc(i.job_id)}">${esc(i.job_id)}</a></td>
      <td>${esc(culprit(i.culprit, i.status))}</td>
      <td class="num">${esc(hours(i.cost))}</td>
      <td>${esc(i.status)}${i.acknowledged_by ? ` · ack ${esc(i.acknowledged_by)}` : ""}</td>
      <td class="muted">${esc(ago(i.opened_at))}</td>
    </tr>`).join("");
  const comps = fleet.ok ? fleet.body.components.filter(c => c.advice !== "ok") : [];
  const fleetRows = comps.map(c => `<tr title="${esc(c.reason)}"><td>${esc(c.kind)}</td>
      <td class="nowrap">${esc(c.id)}</td><td><span class="pill ${esc(c.advice)}">${esc(c.advice)}</span></td>
      <td class="muted">${c.confirmed} confirmed of ${c.incidents}, ${c.jobs.length} job${c.jobs.length === 1 ? "" : "s"}</td></tr>`).join("");
  const jobRows = (jobs.ok ? jobs.body : []).map(j => `<tr class="click" data-href="#/jobs/${esc(j.id)}">
      <td>${esc(j.id)}</td><td><span class="pill ${esc(j.state)}">${esc(j.state)}</span></td>
      <td class="num">${esc(j.world_size ?? j.ranks_known)}</td><td class="muted">${esc(ago(j.last_seen_at))}</td></tr>`).join("");
  view.innerHTML = `
    <div class="grid">
      <section class="card" id="open-incidents"><h2>Open incidents (${inc.body.length})</h2>
        <table><thead><tr><th>Kind</th><th>Job</th><th>Culprit</th><th class="num">GPU-h lost</th>
        <th>Status</th><th>Opened</th></tr></thead><tbody>${rows ||
        '<tr><td colspan="6" class="muted">Nothing open.</td></tr>'}</tbody></table></section>
      <div>${waitingRows ? `
        <section class="card" id="awaiting"><h2>Plans awaiting a decision</h2>
          <table><tbody>${waitingRows}</tbody></table></section>` : ""}
        <section class="card" id="fleet"><h2>Fleet: drain and watch</h2>
          <table><tbody>${fleetRows || '<tr><td class="muted">No repeat offenders.</td></tr>'}</tbody></table>
          <p class="legend">${esc(fleet.ok ? "Drain rule: " + fleet.body.drain_rule : "")}</p></section>
        <section class="card"><h2>Jobs</h2><table><thead><tr><th>Job</th><th>State</th>
          <th class="num">GPUs</th><th>Seen</th></tr></thead><tbody>${jobRows}</tbody></table></section>
      </div>
    </div>`;
}

// ---- charts ----------------------------------------------------------------------------------

function timelineSvg(tl) {
  const W = 760, H = 190, L = 46, R = 10, T = 12, B = 24;
  // Start the axis where the data starts (a job seen for 3 minutes of a 15-minute window).
  const first = tl.median_s.findIndex(v => v != null);
  const lead = first > 2 ? first - 2 : 0;
  const t0 = tl.times[lead], t1 = tl.times[tl.times.length - 1] + tl.bucket_s;
  const vals = tl.median_s.filter(v => v != null);
  const ymax = vals.length ? Math.max(...vals) * 1.25 : 1;
  const x = t => L + (W - L - R) * (Math.min(Math.max(t, t0), t1) - t0) / Math.max(t1 - t0, 1e-9);
  const y = v => H - B - (H - T - B) * v / ymax;
  let path = "", last = -99;
  tl.median_s.forEach((v, i) => {
    if (v == null || i < lead) return;
    // Bridge a bucket or two without an iteration (iterations longer than a bucket).
    path += (i - last <= 3 ? "L" : "M") + x(tl.times[i] + tl.bucket_s / 2).toFixed(1) + "," + y(v).toFixed(1);
    last = i;
  });
  const marks = tl.markers.map(m => {
    const t = new Date(m.at).getTime() / 1000;
    if (t > t1) return "";
    if (m.kind === "plan")
      return `<g class="marker plan"><title>${esc(m.label)} (${esc(m.status)})</title>
        <line x1="${x(t)}" x2="${x(t)}" y1="${T}" y2="${H - B}" stroke="#2b5fd9" stroke-dasharray="4 3"/>
        <text x="${x(t) - 26}" y="${T + 22}" fill="#2b5fd9">plan</text></g>`;
    const end = m.until ? new Date(m.until).getTime() / 1000 : t1;
    return `<g class="marker incident"><title>${esc(m.label)} (${esc(m.status)})</title>
      <rect x="${x(t)}" y="${T}" width="${Math.max(x(end) - x(t), 2)}" height="${H - T - B}" fill="#c62f2f" opacity="0.08"/>
      <line x1="${x(t)}" x2="${x(t)}" y1="${T}" y2="${H - B}" stroke="#c62f2f" stroke-dasharray="4 3"/>
      <text x="${x(t) > W - 90 ? x(t) - 50 : x(t) + 3}" y="${T + 10}" fill="#c62f2f">incident</text></g>`;
  }).join("");
  const ticks = [0, 0.5, 1].map(f => `<text x="4" y="${y(ymax * f / 1.25) + 4}">${(ymax * f / 1.25).toFixed(2)}s</text>`).join("");
  return `<svg width="100%" viewBox="0 0 ${W} ${H}" role="img" aria-label="iteration time">
    <rect x="${L}" y="${T}" width="${W - L - R}" height="${H - T - B}" fill="#fafbfc" stroke="#e2e5ea"/>
    ${ticks}<path d="${path}" fill="none" stroke="#1d2430" stroke-width="1.6"/>${marks}
    <text x="${L}" y="${H - 6}">${esc(new Date(t0 * 1000).toLocaleTimeString())}</text>
    <text x="${W - R - 60}" y="${H - 6}">${esc(new Date(t1 * 1000).toLocaleTimeString())}</text></svg>`;
}

function heatSvg(tl) {
  const ranks = tl.ranks.slice(0, 64);
  if (!ranks.length) return '<p class="muted">No telemetry in the window.</p>';
  const first = tl.median_s.findIndex(v => v != null);
  const lead = first > 2 ? first - 2 : 0;
  const W = 760, L = 46, cell = Math.max(6, Math.min(18, 260 / ranks.length));
  const cw = (W - L - 10) / (tl.times.length - lead), H = ranks.length * cell + 6;
  const lateness = tl.heat_basis === "lateness";
  const flat = tl.heat.flat().filter(v => v != null);
  const top = lateness ? Math.max(1, ...flat) : 2.0;
  const color = v => {
    if (v == null) return "#f3f4f6";
    const f = Math.max(0, Math.min(1, lateness ? v / top : (v - 1) / (top - 1)));
    return `rgb(${255},${Math.round(245 - 190 * f)},${Math.round(235 - 200 * f)})`;
  };
  let cells = "";
  ranks.forEach((r, i) => {
    cells += `<text x="4" y="${i * cell + cell - 2}">r${r}</text>`;
    tl.heat[i].forEach((v, k) => {
      const j = k - lead;
      if (j < 0) return;
      cells += `<rect x="${(L + j * cw).toFixed(1)}" y="${i * cell}" width="${(cw + 0.4).toFixed(1)}"
        height="${cell - 1}" fill="${color(v)}"><title>rank ${r}: ${v == null ? "no data" : v.toFixed(2)} ${esc(tl.heat_unit)}</title></rect>`;
    });
  });
  return `<svg width="100%" viewBox="0 0 ${W} ${H}" role="img" aria-label="per-rank heat map">${cells}</svg>
    <p class="legend">Per-rank ${esc(tl.heat_basis)} (${esc(tl.heat_unit)}); darker is worse.
    ${tl.ranks.length > 64 ? "First 64 ranks shown." : ""}</p>`;
}

async function jobCharts(jobId, el) {
  // At most the last 15 minutes, and no more than the job has been seen.
  const job = await api(`/v1/jobs/${encodeURIComponent(jobId)}`);
  const seen = job.ok ? (Date.now() - new Date(job.body.first_seen_at).getTime()) / 1000 : 900;
  const window_s = Math.round(Math.min(900, Math.max(60, seen * 1.1 + 10)));
  const r = await api(`/v1/jobs/${encodeURIComponent(jobId)}/timeline?window_s=${window_s}&buckets=120`);
  if (!r.ok) { el.innerHTML = `<p class="muted">Timeline unavailable (${r.status}).</p>`; return; }
  const tl = r.body;
  el.innerHTML = `<section class="card" id="timeline"><h2>Iteration time, job ${esc(jobId)}
      <span class="muted">(median per bucket; dashed: incidents red, plans blue)</span></h2>
      ${timelineSvg(tl)}${tl.telemetry_error ? `<p class="muted">${esc(tl.telemetry_error)}</p>` : ""}</section>
    <section class="card" id="heatmap"><h2>Ranks</h2>${heatSvg(tl)}</section>`;
}

// ---- an incident -----------------------------------------------------------------------------

async function decide(planId, action) {
  const r = await api(`/v1/plans/${encodeURIComponent(planId)}/${action}`, {method: "POST", body: {note: ""}});
  if (r.ok) { say(`Plan ${r.body.strategy} ${r.body.status}.`); return true; }
  if (r.status === 404 && r.body && r.body.title === "Not Found" && !String(r.body.detail).startsWith("plan "))
    say("This server has no plan approval routes yet (the mitigation service adds them).", true);
  else say((r.body && r.body.detail) || `The ${action} failed (${r.status}).`, true);
  return false;
}

async function incidentAction(id, action) {
  const note = action === "close" ? prompt("Why is it closed?") : "";
  if (action === "close" && !note) return;
  const r = await api(`/v1/incidents/${encodeURIComponent(id)}/${action}`, {method: "POST", body: {note}});
  say(r.ok ? `Incident ${action === "ack" ? "acknowledged" : "closed"}.` : (r.body && r.body.detail) || `Failed (${r.status}).`, !r.ok);
}

async function incidentView(id) {
  const r = await api(`/v1/incidents/${encodeURIComponent(id)}`);
  if (!r.ok) return denied(r);
  const i = r.body, c = i.cost || {};
  const op = canOperate();
  const plans = i.plans.map(p => `<tr data-plan="${esc(p.id)}"><td>${esc(p.strategy)}</td>
      <td><span class="pill ${esc(p.status)} plan-status">${esc(p.status)}</span></td>
      <td class="num">${p.expected_gain == null ? "n/a" : p.expected_gain.toFixed(2) + "x"}</td>
      <td>${deadline(p)}</td>
      <td>${p.status === "proposed" ? `<button class="approve" data-action="approve" ${op ? "" : "disabled title='needs operator'"}>Approve</button>
        <button class="reject" data-action="reject" ${op ? "" : "disabled title='needs operator'"}>Reject</button>`
        : esc(p.approvals.map(a => `${a.decision} by ${a.approver}`).join(", "))}</td></tr>`).join("");
  const timeline = i.timeline.map(e => `<tr><td>${esc(e.stage)}</td><td class="muted">${esc(new Date(e.at).toLocaleString())}</td>
      <td class="muted">${esc(e.detail.note || e.detail.by || e.detail.kind || "")}</td></tr>`).join("");
  view.innerHTML = `
    <p><a href="#/">← all incidents</a></p>
    <section class="card" id="incident"><h2><span class="pill ${kindClass(i.kind)}">${esc(i.kind)}</span> ${esc(i.summary)}</h2>
      <dl class="kv"><dt>Status</dt><dd>${esc(i.status)}${i.acknowledged_by ? " · acknowledged by " + esc(i.acknowledged_by) : ""}</dd>
      <dt>Culprit</dt><dd>${esc(culprit(i.culprit, i.status))}</dd>${i.explanation ? `
      <dt>Why</dt><dd>${esc(i.explanation)}</dd>` : ""}
      <dt>Cost</dt><dd><b>${esc(hours(c))} GPU-hours</b> <span class="muted">= ${c.lost_fraction == null ? "?" : (c.lost_fraction * 100).toFixed(0) + "%"}
        × ${esc(c.gpus ?? "?")} GPUs × ${((c.duration_s || 0) / 60).toFixed(1)} min${c.ongoing ? " (ongoing)" : ""}</span></dd>${c.gpu_hours_saved == null ? "" : `
      <dt>Saved by plans</dt><dd id="saved">${esc(c.gpu_hours_saved.toFixed(Math.abs(c.gpu_hours_saved) < 10 ? 2 : 1))} GPU-hours <span class="muted">(against the level the plan found; now ${c.slowdown == null ? "?" : c.slowdown.toFixed(2) + "x"}, worst ${c.peak_slowdown == null ? "?" : c.peak_slowdown.toFixed(2) + "x"})</span></dd>`}
      <dt>Detected after</dt><dd>${c.detection_latency_s == null ? "n/a" : c.detection_latency_s.toFixed(1) + " s"}</dd></dl>
      <p>${i.status !== "resolved" ? `<button id="ack" ${op && !i.acknowledged_at ? "" : "disabled"}>Acknowledge</button>
        <button id="close" ${op ? "" : "disabled"}>Close…</button>` : ""}</p></section>
    <section class="card" id="plans"><h2>Mitigation plans</h2><table><thead><tr><th>Strategy</th><th>Status</th>
      <th class="num">Expected gain</th><th>Decide by</th><th></th></tr></thead><tbody>${plans ||
      '<tr><td colspan="5" class="muted">No plan proposed.</td></tr>'}</tbody></table></section>
    <div id="charts"></div>
    <section class="card"><h2>Timeline</h2><table><tbody>${timeline}</tbody></table></section>
    <section class="card"><h2>Evidence</h2><pre>${esc(JSON.stringify(i.evidence, null, 2))}</pre></section>`;
  view.querySelectorAll("button[data-action]").forEach(b => b.addEventListener("click", async () => {
    b.disabled = true;
    await decide(b.closest("tr").dataset.plan, b.dataset.action);
    await incidentView(id);
  }));
  const ack = document.getElementById("ack"), close = document.getElementById("close");
  if (ack) ack.addEventListener("click", async () => { await incidentAction(id, "ack"); await incidentView(id); });
  if (close) close.addEventListener("click", async () => { await incidentAction(id, "close"); await incidentView(id); });
  await jobCharts(i.job_id, document.getElementById("charts"));
}

async function jobView(jobId) {
  const [job, ranks] = await Promise.all([api(`/v1/jobs/${encodeURIComponent(jobId)}`),
    api(`/v1/jobs/${encodeURIComponent(jobId)}/ranks`)]);
  if (!job.ok) return denied(job);
  const rows = (ranks.ok ? ranks.body : []).map(r => `<tr><td>${r.rank}</td><td>${esc(r.host)}:${r.device}</td>
    <td class="num">${r.last_iteration_s == null ? "" : r.last_iteration_s.toFixed(3) + " s"}</td>
    <td><span class="pill ${r.state === "ok" ? "ok" : r.state === "unknown" ? "" : "slow"}">${esc(r.state)}</span></td></tr>`).join("");
  view.innerHTML = `<p><a href="#/">← overview</a></p><div id="charts"></div>
    <section class="card"><h2>Ranks of ${esc(jobId)} <span class="pill ${esc(job.body.state)}">${esc(job.body.state)}</span></h2>
    <table><thead><tr><th>Rank</th><th>GPU</th><th class="num">Last iteration</th><th>State</th></tr></thead>
    <tbody>${rows}</tbody></table></section>`;
  await jobCharts(jobId, document.getElementById("charts"));
}

function denied(r) {
  view.innerHTML = r.status === 401
    ? '<section class="card"><h2>Sign in</h2><p>Paste an API token above (make one on the server with <code>greyhound token create --role viewer</code>).</p></section>'
    : `<section class="card"><h2>${esc((r.body && r.body.title) || "Error")}</h2><p>${esc((r.body && r.body.detail) || r.status)}</p></section>`;
}

async function route() {
  const hash = location.hash || "#/";
  let m;
  if ((m = hash.match(/^#\/incidents\/([^/]+)$/))) return incidentView(decodeURIComponent(m[1]));
  if ((m = hash.match(/^#\/jobs\/([^/]+)$/))) return jobView(decodeURIComponent(m[1]));
  return overview();
}

view.addEventListener("click", e => {
  const row = e.target.closest("tr.click");
  if (row && !e.target.closest("a,button")) location.hash = row.dataset.href;
});
document.getElementById("login").addEventListener("submit", async e => {
  e.preventDefault();
  const value = document.getElementById("token").value.trim();
  if (value) localStorage.setItem(TOKEN_KEY, value);
  document.getElementById("token").value = "";
  const r = await signIn();
  say(r.ok ? "" : "That token was not accepted.", !r.ok);
  await route();
});
window.addEventListener("hashchange", route);
signIn().then(route);
