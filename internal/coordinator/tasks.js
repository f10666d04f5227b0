// The tasks view of the status page: a filtered, keyset-paged listing with
// a capped count, one task with its attempts, errors, payload and result,
// and cancel and retry of one task or by filter, each after a confirmation
// that says how many tasks it touches.
//
// The API token (--api-token) is typed into the sign-in form and kept in
// sessionStorage: it lives as long as the tab, is never written into a URL,
// and travels only as "Authorization: Bearer" to this page's own origin.
// A 401 clears what was shown and brings the sign-in back.
//
// Task data is hostile input (kinds, keys, payloads, errors come from
// producers and handlers): it is only ever put into the page as text
// (textContent, title, value), never as markup.
"use strict";
(() => {
  const tokenKey = "shardrun.apiToken";
  const opStates = { cancel: ["ready", "running"], retry: ["failed", "dead", "cancelled"] };
  const filterNames = ["state", "kind", "queue", "key", "sequence_key", "shard", "priority", "created_since", "created_before"];
  const countCap = 10000;

  // AuthError is a 401: the sign-in is shown instead of data.
  class AuthError extends Error {}

  function token() { return sessionStorage.getItem(tokenKey) || ""; }

  // api calls the coordinator's API with the token; it returns the status
  // and the decoded body, and throws AuthError on 401.
  async function api(method, path) {
    const headers = { "Accept": "application/json" };
    const sent = token();
    if (sent) headers["Authorization"] = "Bearer " + sent;
    const resp = await fetch(path, { method, headers, cache: "no-store", credentials: "omit" });
    let body = {};
    try { body = await resp.json(); } catch { body = { error: resp.statusText }; }
    if (resp.status === 401) {
      // Concurrent calls all end here: each says what its own token got.
      showSignIn(sent ? "The coordinator refused this token." : "");
      throw new AuthError("unauthorized");
    }
    return { status: resp.status, body };
  }

  // apiError turns an error answer into one line naming what was refused.
  function apiError(what, r) {
    const e = r.body && r.body.error ? r.body.error : "HTTP " + r.status;
    return `${what}: ${e}` + (r.body && r.body.field ? ` (parameter ${r.body.field})` : "");
  }

  function message(s, bad) {
    const m = $("tasks-msg");
    m.hidden = !s;
    m.classList.toggle("bad", !!bad);
    m.textContent = s || "";
  }

  // clearData removes every piece of task data from the page.
  function clearData() {
    for (const id of ["task-rows", "d-fields", "d-errors"]) $(id).replaceChildren();
    for (const id of ["match-count", "d-payload", "d-result", "d-id", "pageno"]) $(id).textContent = "";
    $("d-state").textContent = "";
  }

  function showSignIn(err) {
    clearData();
    message("");
    generation++;
    sessionStorage.removeItem(tokenKey);
    $("signout").hidden = true;
    $("tasks-list").hidden = true;
    $("task-detail").hidden = true;
    $("signin").hidden = false;
    const e = $("signin-error");
    e.hidden = !err;
    e.textContent = err || "";
    document.body.dataset.tasksView = "signin";
    $("token").focus();
  }

  $("signin-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const t = $("token").value.trim();
    if (!t) return;
    sessionStorage.setItem(tokenKey, t);
    $("token").value = "";
    route();
  });
  $("signout").addEventListener("click", () => { showSignIn(""); $("signin-error").hidden = true; });

  // --- formatting ---
  const fmtN = (n) => Number(n).toLocaleString("en-US");
  function fmtCount(mc) {
    if (!mc.at_least) return fmtN(mc.count);
    return mc.count >= countCap ? fmtN(countCap) + "+" : "at least " + fmtN(mc.count);
  }
  function countNote(mc) {
    if (mc.at_least && mc.count < countCap) return ` (the count stopped after examining the newest ${fmtN(mc.examined || 0)} candidate tasks)`;
    return "";
  }
  function ago(t) {
    const s = (Date.now() - Date.parse(t)) / 1000;
    const a = Math.abs(s);
    const span = a < 90 ? `${a.toFixed(0)}s` : a < 5400 ? `${(a / 60).toFixed(0)}m` : a < 172800 ? `${(a / 3600).toFixed(1)}h` : `${(a / 86400).toFixed(1)}d`;
    return s >= 0 ? span + " ago" : "in " + span;
  }
  function when(t) { return t ? `${new Date(t).toISOString()} (${ago(t)})` : ""; }
  function badge(state) {
    const b = node("span", "badge");
    if (states.includes(state)) b.classList.add(state);
    b.textContent = state;
    return b;
  }
  function cell(s, cls, title) {
    const td = text(node("td", cls), s);
    if (title) td.title = title;
    return td;
  }
  function plural(n, one, many) { return `${fmtN(n)} ${n === 1 ? one : many}`; }

  // --- filters: the hash holds them (#tasks?kind=…), never the token ---
  function hashParams() {
    const h = location.hash;
    const i = h.indexOf("?");
    return new URLSearchParams(i < 0 ? "" : h.slice(i + 1));
  }
  // filterOf keeps the filter parameters of p that are set.
  function filterOf(p) {
    const f = new URLSearchParams();
    for (const n of filterNames) if (p.get(n)) f.set(n, p.get(n));
    return f;
  }
  const pad = (n) => String(n).padStart(2, "0");
  function toLocalInput(iso) {
    const d = new Date(iso);
    if (isNaN(d)) return "";
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}T${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }
  function fillForm(p) {
    const form = $("filters");
    const st = (p.get("state") || "").split(",");
    for (const cb of form.querySelectorAll('input[name="state"]')) cb.checked = st.includes(cb.value);
    for (const n of ["kind", "queue", "key", "sequence_key", "shard", "priority"]) form.elements[n].value = p.get(n) || "";
    for (const n of ["created_since", "created_before"]) form.elements[n].value = p.get(n) ? toLocalInput(p.get(n)) : "";
    form.elements.order.value = p.get("order") || "desc";
    form.elements.limit.value = p.get("limit") || "50";
  }
  function readForm() {
    const form = $("filters");
    const p = new URLSearchParams();
    const st = [...form.querySelectorAll('input[name="state"]:checked')].map((cb) => cb.value);
    if (st.length) p.set("state", st.join(","));
    for (const n of ["kind", "queue", "key", "sequence_key", "shard", "priority"]) {
      const v = form.elements[n].value;
      if (v !== "") p.set(n, v);
    }
    for (const n of ["created_since", "created_before"]) {
      const v = form.elements[n].value;
      // The input is in local time; the API takes RFC 3339.
      if (v) p.set(n, new Date(v).toISOString());
    }
    p.set("order", form.elements.order.value);
    p.set("limit", form.elements.limit.value);
    return p;
  }
  $("filters").addEventListener("submit", (ev) => {
    ev.preventDefault();
    listKey = ""; // Apply starts again from the first page
    const h = "#tasks?" + readForm().toString();
    if (location.hash === h) route(); else location.hash = h;
  });
  $("clear").addEventListener("click", () => { if (location.hash === "#tasks") route(); else location.hash = "#tasks"; });

  // --- the listing ---
  let generation = 0; // answers of an older route or page are dropped
  let cursors = [0]; // the after of each page seen, for Previous
  let pageIndex = 0;
  let nextCursor = 0;
  let listKey = "";

  async function loadList(resetCount) {
    const gen = ++generation;
    const p = hashParams();
    const q = filterOf(p);
    q.set("order", p.get("order") || "desc");
    q.set("limit", p.get("limit") || "50");
    if (cursors[pageIndex]) q.set("after", String(cursors[pageIndex]));
    const list = api("GET", "/api/tasks?" + q.toString());
    // A failed count is reported where it is awaited, or dropped with an
    // answer that is no longer wanted.
    const count = resetCount ? api("GET", "/api/tasks/count?" + filterOf(p).toString()).catch((e) => e) : null;
    const r = await list;
    if (gen !== generation) return;
    if (r.status !== 200) {
      message(apiError("Listing tasks", r), true);
      $("task-rows").replaceChildren();
      return;
    }
    renderRows(r.body.tasks);
    nextCursor = r.body.next || 0;
    $("next").disabled = !nextCursor;
    $("prev").disabled = pageIndex === 0;
    $("pageno").textContent = `page ${pageIndex + 1}`;
    $("task-rows").dataset.loaded = String(gen);
    if (count) {
      const c = await count;
      if (c instanceof Error) throw c;
      if (gen !== generation) return;
      const el = $("match-count");
      if (c.status === 200) {
        el.textContent = `· ${fmtCount(c.body)} ${c.body.count === 1 && !c.body.at_least ? "matches" : "match"}`;
        el.title = countNote(c.body).trim();
        el.dataset.count = String(c.body.count);
        el.dataset.atLeast = String(!!c.body.at_least);
      } else {
        el.textContent = "";
        message(apiError("Counting tasks", c), true);
      }
    }
  }

  function renderRows(list) {
    const rows = list.map((t) => {
      const tr = node("tr", "row");
      tr.dataset.task = String(t.id);
      tr.dataset.state = t.state;
      const a = text(node("a"), "#" + t.id);
      a.href = "#task/" + t.id;
      const id = node("td", "num");
      id.append(a);
      const st = node("td");
      st.append(badge(t.state));
      tr.append(id, st, cell(t.kind, "clip", t.kind), cell(t.queue, "clip", t.queue), cell(String(t.priority), "num"),
        cell(t.key, "clip", t.key), cell(String(t.shard), "num"), cell(`${t.attempt}/${t.max_attempts}`, "num"),
        cell(ago(t.created_at), "", new Date(t.created_at).toISOString()), cell(t.last_error || "", "err", t.last_error || ""));
      return tr;
    });
    if (rows.length === 0) {
      const tr = node("tr");
      const td = text(node("td", "none"), "no tasks match on this page");
      td.colSpan = 10;
      tr.append(td);
      rows.push(tr);
    }
    $("task-rows").replaceChildren(...rows);
  }
  $("task-rows").addEventListener("click", (ev) => {
    const tr = ev.target.closest("tr.row");
    if (tr && !ev.target.closest("a")) location.hash = "#task/" + tr.dataset.task;
  });
  $("next").addEventListener("click", () => {
    if (!nextCursor) return;
    cursors = cursors.slice(0, pageIndex + 1);
    cursors.push(nextCursor);
    pageIndex++;
    loadList(false).catch(failed);
  });
  $("prev").addEventListener("click", () => {
    if (pageIndex === 0) return;
    pageIndex--;
    loadList(false).catch(failed);
  });
  $("refresh").addEventListener("click", () => { message(""); loadList(true).catch(failed); });

  // --- confirmations ---
  function confirmAction({ title, count, what, filter, yes, danger }) {
    const d = $("confirm");
    $("confirm-yes").classList.toggle("danger", !!danger);
    text($("confirm-title"), title);
    text($("confirm-count"), count);
    text($("confirm-what"), what);
    $("confirm-filter").replaceChildren(...filter.map((s) => text(node("li"), s)));
    text($("confirm-yes"), yes);
    d.returnValue = "";
    d.showModal();
    $("confirm-no").focus();
    return new Promise((resolve) => d.addEventListener("close", () => resolve(d.returnValue === "yes"), { once: true }));
  }
  function describe(f) {
    const label = { sequence_key: "sequence key", created_since: "created since", created_before: "created before" };
    return [...f.entries()].map(([k, v]) => `${label[k] || k}: ${k === "state" ? v.split(",").join(", ") : v}`);
  }

  // bulk runs POST /api/tasks/{op}?filter after a confirmation showing the
  // filter's capped count, continuing from "next" until the answer is done.
  async function bulk(op) {
    message("");
    const f = filterOf(hashParams());
    if ([...f.keys()].length === 0) {
      message(`Choose a filter first: a bulk ${op} of every task is refused.`, true);
      return;
    }
    const chosen = f.get("state") ? f.get("state").split(",") : [];
    const wrong = chosen.filter((s) => !opStates[op].includes(s));
    if (wrong.length) {
      message(`${op === "cancel" ? "Cancel" : "Retry"} applies to ${opStates[op].join(", ")} tasks: remove ${wrong.join(", ")} from the state filter first.`, true);
      return;
    }
    if (!chosen.length) f.set("state", opStates[op].join(","));
    const c = await api("GET", "/api/tasks/count?" + f.toString());
    if (c.status !== 200) { message(apiError("Counting tasks", c), true); return; }
    if (c.body.count === 0) { message(`No ${opStates[op].join(", ")} task matches the filter: nothing to ${op}.`); return; }
    const n = fmtCount(c.body);
    const ok = await confirmAction({
      title: op === "cancel" ? "Cancel the tasks that match?" : "Retry the tasks that match?",
      count: `${n} ${c.body.count === 1 && !c.body.at_least ? "task" : "tasks"}`,
      what: (op === "cancel"
        ? "Ready tasks are cancelled at once; running ones are asked to stop, and their runners cancel them within a heartbeat interval."
        : "Dead, failed and cancelled tasks go back to ready with a fresh budget of attempts; one whose unique key another unfinished task holds is skipped.") + countNote(c.body),
      filter: describe(f),
      yes: `${op === "cancel" ? "Cancel" : "Retry"} ${n} ${c.body.count === 1 && !c.body.at_least ? "task" : "tasks"}`,
      danger: op === "cancel",
    });
    if (!ok) return;
    const total = { cancelled: 0, cancel_requested: 0, retried: 0, skipped: 0 };
    let after = 0, requests = 0;
    for (;;) {
      const q = new URLSearchParams(f);
      if (after) q.set("after", String(after));
      const r = await api("POST", `/api/tasks/${op}?` + q.toString());
      requests++;
      if (r.status !== 200) {
        message(apiError(`Bulk ${op} stopped after ${bulkSummary(op, total)}`, r), true);
        break;
      }
      for (const k of Object.keys(total)) total[k] += r.body[k] || 0;
      if (r.body.done) {
        message(`Done: ${bulkSummary(op, total)}.`);
        $("tasks-msg").dataset.requests = String(requests);
        break;
      }
      if (!r.body.next) {
        message(`Bulk ${op} stopped after ${bulkSummary(op, total)}: the coordinator said it was not done but gave no cursor to continue from.`, true);
        break;
      }
      after = r.body.next;
      message(`Working: ${bulkSummary(op, total)} so far…`);
    }
    await loadList(true);
  }
  function bulkSummary(op, t) {
    if (op === "cancel") return `cancelled ${plural(t.cancelled, "ready task", "ready tasks")}, asked ${plural(t.cancel_requested, "running task", "running tasks")} to stop`;
    return `retried ${plural(t.retried, "task", "tasks")}` + (t.skipped ? `, skipped ${fmtN(t.skipped)} (their unique key is held by another unfinished task)` : "");
  }
  $("bulk-cancel").addEventListener("click", () => bulk("cancel").catch(failed));
  $("bulk-retry").addEventListener("click", () => bulk("retry").catch(failed));

  // --- one task ---
  let shown = null; // the task in the detail view
  let detailTimer = 0;

  async function loadTask(id) {
    const gen = ++generation;
    clearTimeout(detailTimer);
    const r = await api("GET", "/api/tasks/" + id);
    if (gen !== generation) return;
    if (r.status !== 200) {
      shown = null;
      clearData();
      message(apiError("Reading task " + id, r), true);
      return;
    }
    renderTask(r.body);
    // A task that may still change is read again while it is shown.
    if (r.body.state === "ready" || r.body.state === "running") {
      detailTimer = setTimeout(() => { if (gen === generation) loadTask(id).catch(failed); }, 2000);
    }
  }

  function renderTask(t) {
    shown = t;
    text($("d-id"), "#" + t.id);
    const st = $("d-state");
    st.className = "badge";
    if (states.includes(t.state)) st.classList.add(t.state);
    st.textContent = t.state;
    $("task-detail").dataset.state = t.state;
    $("task-detail").dataset.task = String(t.id);
    const fields = [
      ["kind", t.kind], ["queue", t.queue], ["priority", String(t.priority)], ["key", t.key], ["shard", String(t.shard)],
      ["sequence key", t.sequence_key ? t.sequence_key + (t.sequence_blocks ? " (blocks its sequence)" : "") : ""],
      ["unique key", t.unique_key || ""],
      ["attempt", `${t.attempt} of ${t.max_attempts}` + (t.attempt_budget ? ` (retried; ${t.attempt_budget} per retry)` : "")],
      ["created", when(t.created_at)], ["run after", when(t.run_after)], ["deadline", when(t.deadline)],
      ["claimed by", t.claimed_by ? `${t.claimed_by} (epoch ${t.claim_epoch})` : ""], ["claimed", when(t.claimed_at)],
      ["heartbeat", when(t.heartbeat_at)], ["cancel requested", when(t.cancel_requested_at)], ["finished", when(t.finished_at)],
    ].filter(([, v]) => v !== "");
    $("d-fields").replaceChildren(...fields.map(([k, v]) => {
      const tr = node("tr");
      tr.dataset.field = k;
      tr.append(text(node("th"), k), text(node("td"), v));
      return tr;
    }));
    const errs = (t.errors || []).map((e) => {
      const tr = node("tr", e.interrupted ? "interrupted" : "");
      tr.append(cell(String(e.attempt) + (e.interrupted ? " (interrupted, not counted)" : ""), "num"),
        cell(when(e.at)), cell(e.runner || ""), cell(e.error, "text"));
      return tr;
    });
    if (errs.length === 0) { const tr = node("tr"); const td = text(node("td", "none"), "no errors"); td.colSpan = 4; tr.append(td); errs.push(tr); }
    $("d-errors").replaceChildren(...errs);
    text($("d-payload"), t.payload === undefined || t.payload === null ? "none" : JSON.stringify(t.payload, null, 2));
    text($("d-result"), t.result === undefined || t.result === null ? "none" : JSON.stringify(t.result, null, 2));
    $("d-cancel").disabled = !(t.state === "ready" || t.state === "running");
    $("d-retry").disabled = !(t.state === "failed" || t.state === "dead" || t.state === "cancelled");
    $("task-detail").dataset.loaded = String(generation);
  }

  async function single(op) {
    if (!shown) return;
    message("");
    const t = shown;
    const what = op === "cancel"
      ? (t.state === "running"
        ? `It is running on ${t.claimed_by}: its runner is asked to stop it and cancels it within a heartbeat interval (a handler that still finishes its work completes it).`
        : "It is ready: it is cancelled at once.")
      : `It goes back to ready with a fresh budget of ${t.attempt_budget || t.max_attempts} attempts.`;
    const ok = await confirmAction({
      title: `${op === "cancel" ? "Cancel" : "Retry"} task #${t.id}?`,
      count: "1 task",
      what,
      filter: [`kind: ${t.kind}`, `key: ${t.key}`, `state: ${t.state}`],
      yes: `${op === "cancel" ? "Cancel" : "Retry"} task #${t.id}`,
      danger: op === "cancel",
    });
    if (!ok) return;
    const r = await api("POST", `/api/tasks/${t.id}/${op}`);
    if (r.status === 200 || r.status === 202) {
      renderTask(r.body);
      message(op === "retry" ? `Task #${t.id} is ready again (attempt ${r.body.attempt} of ${r.body.max_attempts}).`
        : r.status === 202 ? `Task #${t.id} is running: its runner was asked to cancel it.` : `Task #${t.id} is cancelled.`);
    } else {
      message(apiError(`Could not ${op} task #${t.id}`, r), true);
    }
    await loadTask(t.id);
  }
  $("d-cancel").addEventListener("click", () => single("cancel").catch(failed));
  $("d-retry").addEventListener("click", () => single("retry").catch(failed));
  $("d-refresh").addEventListener("click", () => { if (shown) loadTask(shown.id).catch(failed); });

  function failed(e) {
    if (e instanceof AuthError) return;
    message("Cannot reach the coordinator: " + e.message, true);
  }

  // --- routing: "#" the cluster, "#tasks?filter" the listing, "#task/ID" one task ---
  function route() {
    const h = location.hash;
    const tasksView = h.startsWith("#tasks") || h.startsWith("#task/");
    $("clusterview").hidden = tasksView;
    $("tasksview").hidden = !tasksView;
    $("nav-cluster").classList.toggle("on", !tasksView);
    $("nav-tasks").classList.toggle("on", tasksView);
    $("signout").hidden = !token();
    clearTimeout(detailTimer);
    if (!tasksView) { generation++; return; }
    $("signin").hidden = true;
    message("");
    if (h.startsWith("#task/")) {
      const id = h.slice("#task/".length);
      $("tasks-list").hidden = true;
      $("task-detail").hidden = false;
      document.body.dataset.tasksView = "detail";
      clearData();
      if (!/^[1-9][0-9]{0,18}$/.test(id)) { message(`“${id}” is not a task id`, true); return; }
      loadTask(id).catch(failed);
      return;
    }
    $("task-detail").hidden = true;
    $("tasks-list").hidden = false;
    document.body.dataset.tasksView = "list";
    const p = hashParams();
    fillForm(p);
    const key = p.toString();
    if (key !== listKey) { cursors = [0]; pageIndex = 0; listKey = key; }
    loadList(true).catch(failed);
  }
  window.addEventListener("hashchange", route);
  route();
})();
