// The cluster view of the status page: /api/cluster every second,
// rendered as text (textContent only).
"use strict";
const states = ["ready", "running", "completed", "failed", "dead", "cancelled"];
const $ = (id) => document.getElementById(id);

// A colour per runner: its hue comes from a hash of its id, so it stays the
// same across refreshes and joins; a hue too close to one already given
// (in id order) moves on by the golden angle, so that runners on the page
// never share a colour.
const hues = new Map();
function assignColours(ids) {
  hues.clear();
  const taken = [];
  for (const id of [...new Set(ids)].sort()) {
    let h = 2166136261;
    for (let i = 0; i < id.length; i++) { h ^= id.charCodeAt(i); h = Math.imul(h, 16777619); }
    h ^= h >>> 16; h = Math.imul(h, 0x85ebca6b); h ^= h >>> 13;
    let hue = (h >>> 0) % 360;
    for (let tries = 0; tries < 24 && taken.some((t) => Math.min(Math.abs(t - hue), 360 - Math.abs(t - hue)) < 30); tries++) {
      hue = (hue + 137.508) % 360;
    }
    taken.push(hue);
    hues.set(id, hue);
  }
}
function colour(id) { return `hsl(${(hues.get(id) ?? 0).toFixed(0)} 62% 56%)`; }

function text(el, s) { el.textContent = s; return el; }
function node(tag, cls) { const e = document.createElement(tag); if (cls) e.className = cls; return e; }

// One grid of shards per capability group (the runners that serve the same
// queues and handle the same kinds own the group's shards), each cell
// coloured by its owner.
let grids = new Map();
function ensureGrids(groups, n) {
  const box = $("groups");
  const names = groups.map((g) => g.group).join(",");
  if (box.dataset.groups === names && [...grids.values()].every((cs) => cs.length === n)) return;
  box.replaceChildren();
  box.dataset.groups = names;
  grids = new Map();
  // A square-ish grid that fills the card's width whatever the shard count.
  const cols = Math.ceil(Math.sqrt(n));
  for (const g of groups) {
    const wrap = node("div", "group");
    wrap.dataset.group = g.group;
    wrap.append(text(node("h3"), `${g.group} · queues ${g.queues.join(", ")} · kinds ${g.kinds.join(", ")} · ${g.members.length} attached`));
    const grid = node("div", "grid");
    grid.setAttribute("role", "img");
    grid.setAttribute("aria-label", `shards of group ${g.group} coloured by owner`);
    grid.style.gridTemplateColumns = `repeat(${cols}, minmax(0, 1fr))`;
    const cs = [];
    for (let s = 0; s < n; s++) {
      const c = node("div", "shard");
      c.dataset.shard = s;
      grid.appendChild(c);
      cs.push(c);
    }
    wrap.append(grid);
    box.append(wrap);
    grids.set(g.group, cs);
  }
}

function render(v) {
  const groups = v.groups || [];
  ensureGrids(groups, v.shard_count);
  const owners = groups.flatMap((g) => g.owners.filter((o) => o));
  assignColours(v.runners.map((r) => r.id).concat(v.gone.map((r) => r.id), owners));
  const byId = new Map(v.runners.map((r) => [r.id, r]));
  let free = 0;
  for (const g of groups) {
    const cs = grids.get(g.group);
    g.owners.forEach((owner, s) => {
      const c = cs[s];
      c.dataset.owner = owner;
      c.dataset.epoch = g.epochs[s];
      const r = byId.get(owner);
      c.className = "shard";
      if (!owner) { c.classList.add("free"); c.style.backgroundColor = ""; free++; return; }
      c.style.backgroundColor = colour(owner);
      if (!r || r.state !== "attached") c.classList.add("detached");
    });
  }
  const units = v.shard_count * groups.length;
  text($("shardsummary"), `· ${v.shard_count} shards · ${groups.length} group${groups.length === 1 ? "" : "s"} · ${units - free} of ${units} owned`);
  text($("meta"), `${v.prefix} · leader ${v.leader || "none"} · served by ${v.coordinator} · revision ${v.revision}`);

  const counts = $("counts");
  const estimated = new Set(v.tasks_estimated || []);
  counts.replaceChildren(...states.map((st) => {
    const n = v.tasks[st] || 0;
    const box = node("div", "count " + st + ((st === "failed" || st === "dead") && n > 0 ? " bad" : ""));
    box.dataset.state = st;
    // An estimated count is the last full count (states with very many tasks
    // are counted exactly about once a minute).
    box.append(text(node("div", "n"), (estimated.has(st) ? "≈" : "") + n.toLocaleString()), text(node("div", "l"), st));
    if (estimated.has(st)) box.title = "from the last full count, about a minute old at most";
    return box;
  }));

  const ago = (t) => { const s = Math.max(0, (Date.now() - Date.parse(t)) / 1000); return s < 90 ? `${s.toFixed(0)}s` : s < 5400 ? `${(s / 60).toFixed(0)}m` : `${(s / 3600).toFixed(1)}h`; };
  const attn = (id, list, what) => {
    const rows = (list || []).map((t) => {
      const tr = node("tr");
      tr.dataset.task = t.id;
      const link = text(node("a"), "#" + t.id);
      link.href = "#task/" + t.id;
      const idCell = node("td");
      idCell.append(link);
      tr.append(idCell, text(node("td"), t.kind), text(node("td", "num"), `attempt ${t.attempt}/${t.max_attempts}`),
        text(node("td", "num"), t.since ? `${what} ${ago(t.since)} ago` : ""), text(node("td"), t.claimed_by || ""));
      return tr;
    });
    if (rows.length === 0) { const tr = node("tr"); const td = text(node("td", "none"), "none"); tr.append(td); rows.push(tr); }
    $(id).replaceChildren(...rows);
  };
  const a = v.attention || {};
  attn("attn-dead", a.dead, "died");
  attn("attn-failed", a.failed, "failed");
  attn("attn-running", a.long_running, "started");
  const blocked = (a.blocked_sequences || []).map((b) => {
    const tr = node("tr");
    tr.dataset.sequence = b.sequence_key;
    const link = text(node("a"), "#" + b.blocked_by.id);
    link.href = "#task/" + b.blocked_by.id;
    const idCell = node("td");
    idCell.append(link);
    tr.append(text(node("td"), b.sequence_key), idCell, text(node("td"), b.blocked_by.state),
      text(node("td", "num"), `${b.waiting.toLocaleString()} waiting`));
    return tr;
  });
  if (blocked.length === 0) { const tr = node("tr"); tr.append(text(node("td", "none"), "none")); blocked.push(tr); }
  $("attn-blocked").replaceChildren(...blocked);

  const queues = v.queues || [];
  $("queues").replaceChildren(...queues.map((q) => {
    const tr = node("tr");
    tr.dataset.queue = q.name;
    tr.dataset.paused = q.paused_at ? "true" : "false";
    tr.dataset.idle = q.idle ? "true" : "false";
    // Idle: no unfinished task; an operator may remove it (DELETE /api/queues/{name}).
    const st = node("td");
    st.append(text(node("span", "badge " + (q.paused_at ? "detached" : q.idle ? "left" : "attached")),
      q.paused_at ? "paused" : q.idle ? "idle" : "active"));
    tr.append(text(node("td"), q.name), text(node("td", "num"), (q.ready_at_least ? "≥" : "") + q.ready.toLocaleString()),
      text(node("td", "num"), q.running.toLocaleString()), text(node("td", "num"), q.completed_per_second.toFixed(1)), st);
    return tr;
  }));

  // The tasks view's queue filter offers the queues that exist.
  $("queue-names").replaceChildren(...queues.map((q) => { const o = node("option"); o.value = q.name; return o; }));

  const legend = $("legendowned");
  legend.replaceChildren(...v.runners.map((r) => { const i = node("i"); i.style.background = colour(r.id); return i; }));

  const rate = $("rate");
  const done = v.rates.completed || 0, bad = (v.rates.failed || 0) + (v.rates.dead || 0) + (v.rates.cancelled || 0);
  rate.replaceChildren(text(node("b"), done.toFixed(1)), document.createTextNode(` tasks/s completed`),
    document.createTextNode(` · ${bad.toFixed(1)}/s failed, dead or cancelled · over the last ${v.rate_window_seconds}s`));
  rate.dataset.completedPerSecond = done;

  const since = (t) => { const s = Math.max(0, (Date.now() - Date.parse(t)) / 1000); return s < 90 ? `${s.toFixed(0)}s ago` : `${(s / 60).toFixed(0)}m ago`; };
  const row = (r, gone) => {
    const tr = node("tr", gone ? "gone" : "");
    tr.dataset.runner = r.id;
    tr.dataset.health = r.health;
    const name = node("td");
    const sw = node("span", "swatch");
    sw.style.backgroundColor = colour(r.id);
    name.append(sw, document.createTextNode(r.id));
    const st = node("td");
    st.append(text(node("span", "badge " + r.state), r.state));
    const health = node("td");
    health.append(text(node("span", "badge " + (r.health === "ok" ? "attached" : r.health)), r.health));
    if (gone) health.append(document.createTextNode(" " + since(r.last_seen)));
    else if (r.health === "unresponsive" && r.lease_left_seconds !== undefined) health.append(document.createTextNode(` lease ${r.lease_left_seconds}s left`));
    const owned = text(node("td", "num"), gone ? "–" : r.owned);
    if (!gone && r.state === "attached" && r.owned !== r.assigned) owned.classList.add("mismatch");
    tr.append(name, st, health, text(node("td", "num"), gone ? "–" : r.assigned), owned);
    return tr;
  };
  const rows = v.runners.map((r) => row(r, false)).concat(v.gone.map((r) => row(r, true)));
  $("runners").replaceChildren(...rows);
  if (rows.length === 0) {
    const tr = node("tr"); const td = text(node("td"), "no runners"); td.colSpan = 5; tr.append(td); $("runners").append(tr);
  }

  // Each database with the shards the map places in it: one that is
  // unavailable pauses only its shards, and a move names its phase.
  const dbs = v.databases || [];
  const moveText = (m) => `shard ${m.shard} ${m.from} → ${m.to} (${m.phase})`;
  $("databases").replaceChildren(...dbs.map((d) => {
    const tr = node("tr");
    tr.dataset.database = d.name;
    tr.dataset.health = d.health;
    const health = node("td");
    health.append(text(node("span", "badge " + (d.health === "ok" ? "attached" : d.health === "unavailable" ? "detached" : d.health)), d.health));
    tr.append(text(node("td"), d.name), text(node("td"), d.shards || "–"), health,
      text(node("td", "num"), ((d.tasks || {}).ready || 0).toLocaleString()), text(node("td", "num"), ((d.tasks || {}).running || 0).toLocaleString()),
      text(node("td"), (d.moves || []).map(moveText).join("; ") || "–"));
    return tr;
  }));

  const unrunnable = v.unrunnable || [];
  $("unrunnablecard").style.display = unrunnable.length ? "block" : "none";
  $("unrunnable").replaceChildren(...unrunnable.map((u) => {
    const tr = node("tr");
    tr.dataset.queue = u.queue;
    tr.dataset.kind = u.kind;
    tr.dataset.ready = u.ready;
    tr.append(text(node("td"), u.queue), text(node("td"), u.kind), text(node("td", "num mismatch"), u.ready.toLocaleString()),
      text(node("td"), since(u.oldest_run_after)));
    return tr;
  }));

  const when = (t) => {
    const s = (Date.parse(t) - Date.now()) / 1000;
    const abs = Math.abs(s), span = abs < 90 ? `${abs.toFixed(0)}s` : abs < 5400 ? `${(abs / 60).toFixed(0)}m` : abs < 172800 ? `${(abs / 3600).toFixed(1)}h` : `${(abs / 86400).toFixed(1)}d`;
    return s >= 0 ? `in ${span}` : `${span} overdue`;
  };
  const scheds = v.schedules || [];
  $("schedules").replaceChildren(...scheds.map((sc) => {
    const tr = node("tr");
    tr.dataset.schedule = sc.name;
    tr.dataset.nextRun = sc.next_run;
    const next = node("td");
    next.title = new Date(sc.next_run).toString();
    next.append(text(node("b"), when(sc.next_run)), document.createTextNode(" · " + new Date(sc.next_run).toLocaleString()));
    const spec = sc.every ? `every ${sc.every}` : `${sc.cron} (${sc.timezone})`;
    tr.append(text(node("td"), sc.name), text(node("td"), sc.kind), text(node("td"), spec), next,
      text(node("td"), sc.last_run ? since(sc.last_run) : "never"));
    return tr;
  }));
  if (scheds.length === 0) {
    const tr = node("tr"); const td = text(node("td"), "no schedules"); td.colSpan = 5; tr.append(td); $("schedules").append(tr);
  }

  // Faults a user must not miss: a paused or cut-off runner keeps its shards
  // until its lease runs out, and a lost one took its running tasks with it.
  const faults = [];
  v.runners.filter((r) => r.health === "unresponsive").forEach((r) => faults.push(`${r.id} is unresponsive: etcd has had no keep-alive from it for over half its lease; its shards move when the lease runs out`));
  v.gone.filter((r) => r.health === "lost").forEach((r) => faults.push(`${r.id} was lost ${since(r.last_seen)} (its lease expired without a drain); its shards moved to the others`));
  unrunnable.forEach((u) => faults.push(`${u.ready.toLocaleString()} ready ${u.kind} tasks of queue ${u.queue} wait: no attached runner serves queue ${u.queue} with a handler of kind ${u.kind}`));
  queues.filter((q) => q.paused_at).forEach((q) => faults.push(`queue ${q.name} is paused (since ${since(q.paused_at)}): ${q.ready.toLocaleString()} ready tasks wait`));
  dbs.filter((d) => d.health === "unavailable").forEach((d) => faults.push(`database ${d.name} is unavailable${d.health_since ? " (since " + since(d.health_since) + ")" : ""}: the tasks of its shards (${d.shards}) wait; the other databases' work goes on`));
  (a.blocked_sequences || []).forEach((b) => faults.push(`sequence ${b.sequence_key} is blocked by ${b.blocked_by.state} task #${b.blocked_by.id}: retry or cancel it`));
  const fb = $("faults");
  fb.replaceChildren(...faults.map((f) => text(node("div"), f)));
  fb.style.display = faults.length ? "block" : "none";
  document.body.dataset.rendered = "true";
}

let failures = 0;
async function tick() {
  try {
    const resp = await fetch("/api/cluster", { cache: "no-store" });
    if (!resp.ok) throw new Error((await resp.json()).error || resp.statusText);
    render(await resp.json());
    failures = 0;
    $("banner").style.display = "none";
    $("dot").classList.remove("stale");
    text($("updated"), "updated " + new Date().toLocaleTimeString());
  } catch (e) {
    failures++;
    $("dot").classList.add("stale");
    if (failures > 1) { const b = $("banner"); b.style.display = "block"; text(b, "Cannot reach the coordinator: " + e.message); }
  } finally {
    setTimeout(tick, 1000);
  }
}

$("groups").addEventListener("mousemove", (e) => {
  const c = e.target.closest(".shard"), tip = $("tip");
  if (!c) { tip.style.display = "none"; return; }
  const g = c.closest(".group");
  tip.textContent = `${g ? g.dataset.group + " · " : ""}shard ${c.dataset.shard} · ${c.dataset.owner || "no owner"}` +
    (c.dataset.owner ? ` · epoch ${c.dataset.epoch}` : "");
  tip.style.left = (e.clientX + 12) + "px"; tip.style.top = (e.clientY + 12) + "px"; tip.style.display = "block";
});
$("groups").addEventListener("mouseleave", () => { $("tip").style.display = "none"; });
tick();
