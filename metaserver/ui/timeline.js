// pdgate transfers: recent bindings from GET ../v1/bindings, one timeline per transfer,
// polled every POLL_MS while "live" is on. Hand-written, no framework, nothing fetched from
// elsewhere: the page works with no internet. Every string from the store goes in through
// textContent, never as HTML. Each refresh fires "pdgate:refresh" on the document, and
// window.pdgate shares getJSON, el and ms with breakdown.js.
"use strict";

(() => {
  const POLL_MS = 2000;
  const TOKEN_KEY = "pdgate.metaserver.token";
  const TERMINAL = new Set(["done", "failed", "aborted"]);
  const $ = (id) => document.getElementById(id);
  const expanded = new Set();
  let timer = null;
  let busy = false;

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function ms(seconds) {
    if (seconds === null || seconds === undefined || !isFinite(seconds)) return "–";
    return seconds < 1 ? `${(seconds * 1000).toFixed(1)} ms` : `${seconds.toFixed(2)} s`;
  }

  function bytes(n) {
    if (!n) return "0 B";
    const units = ["B", "KiB", "MiB", "GiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
  }

  // "push_s=0.01 exposed_s=0.002 ..." (the done event's message) -> {push_s: 0.01, ...}
  function summary(message) {
    const out = {};
    for (const part of (message || "").split(/\s+/)) {
      const [k, v] = part.split("=");
      if (v !== undefined && isFinite(Number(v))) out[k] = Number(v);
    }
    return out;
  }

  function headers() {
    const token = sessionStorage.getItem(TOKEN_KEY);
    return token ? { authorization: `Bearer ${token}` } : {};
  }

  async function getJSON(path) {
    const r = await fetch(path, { headers: headers(), cache: "no-store" });
    if (r.status === 401) {
      const e = new Error("401: this metaserver needs its token for reads");
      e.unauthorized = true;
      throw e;
    }
    if (!r.ok) throw new Error(`${r.status}: ${(await r.text()).slice(0, 300)}`);
    return r.json();
  }

  window.pdgate = Object.freeze({ getJSON, el, ms });

  function filters() {
    return {
      state: $("f-state").value,
      instance: $("f-instance").value,
      limit: $("f-limit").value,
    };
  }

  function applyQuery() {
    const q = new URLSearchParams(location.search);
    for (const key of ["state", "instance", "limit"]) {
      const v = q.get(key);
      if (v === null) continue;
      const select = $(`f-${key}`);
      if (![...select.options].some((o) => o.value === v)) select.add(new Option(v, v));
      select.value = v;
    }
    if (q.get("live") === "0") $("f-live").checked = false;
  }

  function saveQuery() {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(filters())) if (v) q.set(k, v);
    if (!$("f-live").checked) q.set("live", "0");
    history.replaceState(null, "", `${location.pathname}?${q}`);
  }

  // One ordered list of everything that happened: state events and marks, by server time.
  function steps(b) {
    const out = b.events.map((e) => ({ kind: e.state, mark: false, actor: e.actor, at: e.at, detail: e.detail }));
    for (const m of b.marks || []) {
      out.push({ kind: m.mark, mark: true, actor: m.actor, at: m.at, detail: m.detail });
    }
    return out.sort((a, c) => a.at - c.at || Number(a.mark) - Number(c.mark));
  }

  function facts(b, list) {
    const parts = [`${b.num_prompt_tokens} tok`];
    if (b.num_cached_tokens) parts.push(`${b.num_cached_tokens} cached`);
    const pushed = Math.max(0, ...b.events.map((e) => (e.detail && e.detail.bytes_pushed) || 0));
    if (pushed) parts.push(bytes(pushed));
    const done = b.events.find((e) => e.state === "done");
    const s = summary(done && done.detail && done.detail.message);
    if ("push_s" in s) parts.push(`push ${ms(s.push_s)}`);
    if ("exposed_s" in s) parts.push(`exposed ${ms(s.exposed_s)}`);
    if ("hidden" in s) parts.push(`${Math.round(s.hidden * 100)}% hidden`);
    const first = list.find((x) => x.kind === "first_token");
    if (first && first.detail && first.detail.since_request_s !== undefined) {
      parts.push(`TTFT ${ms(first.detail.since_request_s)}`);
    }
    const corrupt = list.find((x) => x.kind === "corrupt");
    if (corrupt) {
      parts.push((corrupt.detail && corrupt.detail.outcome) || "first tokens differ");
    }
    return parts.join(" · ");
  }

  function timeline(b, list, now) {
    const bar = el("div", "bar");
    const first = list.find((x) => x.kind === "first_token");
    const since = first && first.detail ? first.detail.since_request_s : undefined;
    const requestAt = since !== undefined ? first.at - since : null;
    const start = Math.min(b.created_at, requestAt === null ? Infinity : requestAt);
    const last = list.length ? list[list.length - 1].at : b.created_at;
    const live = !TERMINAL.has(b.state); // still moving: its bar grows up to now
    const end = live ? Math.max(last, now) : last;
    const span = Math.max(end - start, 1e-6);
    const pct = (t) => `${(((t - start) / span) * 100).toFixed(3)}%`;
    const seg = (cls, a, z, title) => {
      if (z <= a) return;
      const s = el("span", `seg ${cls}`);
      s.style.left = pct(a);
      s.style.width = `${(((z - a) / span) * 100).toFixed(3)}%`;
      s.title = `${title}: ${ms(z - a)}`;
      bar.append(s);
    };
    if (requestAt !== null && requestAt < b.created_at) {
      seg("request", requestAt, b.created_at, "proxy got the request → D bound its blocks");
    }
    const names = {
      bound: "waiting for P", prefill_started: "prefill", pushing: "pushing",
      done: "KV landed → first token", first_token: "streaming",
      failed: "after the failure", aborted: "after the abort",
      abandoned: "after the proxy gave up on the KV (D computes the prompt itself)",
    };
    list.forEach((x, i) => {
      const next = i + 1 < list.length ? list[i + 1].at : end;
      if (names[x.kind]) seg(x.kind, x.at, next, names[x.kind]);
    });
    const done = list.find((x) => x.kind === "done");
    const s = summary(done && done.detail && done.detail.message);
    if (done && s.exposed_s > 0) {
      const computeEnd = done.at - (s.tail_s || 0); // P's compute end, on this server's clock
      seg("exposed", computeEnd, computeEnd + s.exposed_s, "exposed push (after P's compute)");
    }
    for (const x of list) {
      const t = el("span", x.mark ? "tick mark" : "tick");
      t.style.left = pct(x.at);
      t.title = `${x.kind} +${ms(x.at - start)}`;
      bar.append(t);
    }
    return { bar, total: end - start, start };
  }

  function describe(x) {
    const d = x.detail || {};
    const parts = [];
    if (d.bytes_pushed !== undefined) parts.push(bytes(d.bytes_pushed));
    if (d.blocks_pushed !== undefined) parts.push(`${d.blocks_pushed} blocks`);
    if (d.since_request_s !== undefined) parts.push(`${ms(d.since_request_s)} after the request`);
    if (d.outcome) parts.push(d.outcome);
    if (d.message) parts.push(d.message);
    if (d.error) parts.push(`error: ${d.error}`);
    return parts.join(" · ");
  }

  function errorOf(b) {
    const gaveUp = (b.marks || []).find((m) => m.mark === "abandoned");
    if (gaveUp) {
      const d = gaveUp.detail || {};
      return `proxy gave up on the KV (${d.outcome || "?"}): ${d.message || "no reason given"}`;
    }
    const bad = [...b.events].reverse().find((e) => e.detail && e.detail.error);
    if (bad) return `${bad.state}: ${bad.detail.error}`;
    if (b.state === "failed" || b.state === "aborted") return `${b.state} (no reason given)`;
    return null;
  }

  function render(bindings, now) {
    const main = $("transfers");
    const nodes = bindings.map((b) => {
      const list = steps(b);
      const box = el("section", `transfer ${b.state}`);
      box.dataset.tid = b.transfer_id;
      box.dataset.state = b.state;
      box.dataset.instance = b.decode_instance_id;
      const row = el("div", "row");
      row.append(el("span", "tid", b.transfer_id));
      row.append(el("span", `badge ${b.state}`, b.state));
      const who = el("span", "facts", `${b.decode_instance_id} · ${facts(b, list)}`);
      row.append(who);
      const tl = timeline(b, list, now);
      const wrap = el("div");
      wrap.append(tl.bar, el("div", "total", ms(tl.total)));
      row.append(wrap);
      row.title = "show every step";
      box.append(row);
      const err = errorOf(b);
      if (err) box.append(el("p", "error", err));
      const ol = el("ol", "steps");
      ol.hidden = !expanded.has(b.transfer_id);
      for (const x of list) {
        const li = el("li", x.mark ? "mark" : "state");
        li.dataset.kind = x.kind;
        li.append(el("span", "at", `+${ms(x.at - tl.start)}`), el("span", "kind", x.kind));
        li.append(el("span", "who", x.actor));
        const what = describe(x);
        if (what) li.append(el("span", "what", what));
        ol.append(li);
      }
      box.append(ol);
      row.addEventListener("click", () => {
        ol.hidden = !ol.hidden;
        if (ol.hidden) expanded.delete(b.transfer_id); else expanded.add(b.transfer_id);
      });
      return box;
    });
    main.replaceChildren(...nodes);
    $("empty").hidden = bindings.length > 0;
  }

  function addInstances(ids) {
    const select = $("f-instance");
    const known = new Set([...select.options].map((o) => o.value));
    for (const id of [...ids].sort()) if (id && !known.has(id)) select.add(new Option(id, id));
  }

  function setStatus(text, error) {
    $("status").textContent = text;
    $("status").classList.toggle("error", Boolean(error));
  }

  async function refresh() {
    if (busy) return;
    busy = true;
    document.dispatchEvent(new Event("pdgate:refresh"));
    try {
      const f = filters();
      const q = new URLSearchParams({ limit: f.limit });
      if (f.state) q.set("state", f.state);
      if (f.instance) q.set("instance", f.instance);
      const data = await getJSON(`../v1/bindings?${q}`);
      $("auth").hidden = true;
      render(data.bindings, Date.now() / 1000);
      addInstances(data.bindings.map((b) => b.decode_instance_id));
      setStatus(`${data.count} transfer${data.count === 1 ? "" : "s"} · updated ${new Date().toLocaleTimeString()}`);
      document.body.dataset.loaded = String(Number(document.body.dataset.loaded || 0) + 1);
    } catch (e) {
      if (e.unauthorized) $("auth").hidden = false;
      setStatus(e.message, true);
    } finally {
      busy = false;
    }
  }

  async function loadInstances() {
    try {
      const data = await getJSON("../v1/instances");
      addInstances(data.instances.filter((i) => i.role !== "prefill").map((i) => i.instance_id));
    } catch (e) {
      // the list of transfers reports the error; the dropdown still fills from transfers
    }
  }

  function schedule() {
    clearInterval(timer);
    timer = $("f-live").checked ? setInterval(refresh, POLL_MS) : null;
  }

  document.addEventListener("DOMContentLoaded", () => {
    applyQuery();
    $("filters").addEventListener("change", () => { saveQuery(); schedule(); refresh(); });
    $("filters").addEventListener("submit", (e) => e.preventDefault());
    $("auth-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const token = $("token").value.trim();
      if (token) sessionStorage.setItem(TOKEN_KEY, token); else sessionStorage.removeItem(TOKEN_KEY);
      $("token").value = "";
      loadInstances();
      refresh();
    });
    loadInstances();
    refresh();
    schedule();
  });
})();
