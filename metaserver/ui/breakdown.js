// The TTFT breakdown panel: GET ../v1/breakdown (the stages of the window's finished transfers
// and the P:D advice), fetched on each "pdgate:refresh" of timeline.js: at once while the last
// try failed or found nothing, else at most every EVERY_MS (the window is minutes long, and
// each answer reads up to --stats-scan-limit bindings). Uses timeline.js's helpers
// (window.pdgate); every string goes in through textContent.
"use strict";

(() => {
  const EVERY_MS = 10000;
  const POOLS = ["prefill", "decode"];
  // stage -> [pool it is charged to, what it is] (metaserver/breakdown.py)
  const STAGES = {
    binding: ["decode", "proxy → D bound its blocks"],
    prefill_queue: ["prefill", "waiting for P"],
    prefill_compute: ["prefill", "P's compute"],
    push_exposed: ["prefill", "exposed push"],
    decode_first_token: ["decode", "KV landed → first token"],
  };
  const $ = (id) => document.getElementById(id);
  let last = -Infinity; // when the last answer with transfers came
  let busy = false;

  const pct = (share) => `${Math.round(share * 100)}%`;
  const poolOf = (stage) => (STAGES[stage] || ["other"])[0];

  function cell(tag, cls, text, data) {
    const c = window.pdgate.el(tag, cls, text);
    Object.assign(c.dataset, data || {});
    return c;
  }

  function bar(stages) {
    const b = window.pdgate.el("div", "bd-bar");
    for (const [name, s] of Object.entries(stages)) {
      const seg = cell("span", `bd-seg ${name}`, undefined, { stage: name });
      seg.style.width = `${(s.share * 100).toFixed(3)}%`;
      seg.title = `${name}: ${pct(s.share)}`;
      b.append(seg);
    }
    return b;
  }

  function table(data, advice) {
    const { el, ms } = window.pdgate;
    const t = el("table", "bd-table");
    const head = el("tr");
    for (const h of ["pool / stage", "", "share", "p50", "p90"]) head.append(el("th", "", h));
    t.append(el("thead"), el("tbody"));
    t.tHead.append(head);
    const now = advice ? advice.now : {};
    const rec = advice && advice.recommended ? advice.recommended : {};
    for (const pool of POOLS) {
      const names = Object.keys(data.stages).filter((n) => poolOf(n) === pool);
      const share = names.reduce((sum, n) => sum + data.stages[n].share, 0);
      const counts = `${now[pool] ?? "–"} now · ${rec[pool] ?? "–"} recommended`;
      const row = cell("tr", "bd-pool", undefined, { pool, now: now[pool] ?? "", recommended: rec[pool] ?? "" });
      row.append(el("th", "", pool), el("td", "bd-counts", counts), el("td", "bd-share", pct(share)), el("td"), el("td"));
      t.tBodies[0].append(row);
      for (const name of names) {
        const s = data.stages[name];
        const r = cell("tr", "bd-stage", undefined, { stage: name, pool });
        const label = el("td", "bd-name");
        label.append(el("span", `bd-swatch ${name}`), el("code", "", name));
        r.append(label, el("td", "bd-what", STAGES[name] ? STAGES[name][1] : ""));
        r.append(cell("td", "bd-share", pct(s.share), { value: s.share }));
        r.append(cell("td", "bd-p50", ms(s.p50_s), { value: s.p50_s }));
        r.append(cell("td", "bd-p90", ms(s.p90_s), { value: s.p90_s }));
        t.tBodies[0].append(r);
      }
    }
    return t;
  }

  function verdict(d) {
    if (d.suggested_min_tokens === null) return "disaggregation does not pay for the prompts seen";
    if (d.suggested_min_tokens === 0) return "disaggregation pays at every prompt length seen";
    return `disaggregation pays from ${d.suggested_min_tokens} uncached tokens (--disagg-min-tokens)`;
  }

  function render(data) {
    const { el, ms } = window.pdgate;
    const panel = $("breakdown");
    panel.dataset.state = data.transfers ? "ok" : "empty";
    if (!data.transfers) {
      $("breakdown-body").replaceChildren(el("p", "bd-empty", "no finished transfers in the window"));
      return;
    }
    const out = [];
    const facts = [`${data.transfers} finished transfer${data.transfers === 1 ? "" : "s"} in the last ${data.window_s} s`];
    if (data.ttft) facts.push(`TTFT p50 ${ms(data.ttft.p50_s)}, p90 ${ms(data.ttft.p90_s)}`);
    if (data.bottleneck) facts.push(`bottleneck ${data.bottleneck}`);
    out.push(el("p", "bd-facts", facts.join(" · ")), bar(data.stages), table(data, data.advice));
    if (data.missing_stages.length) {
      const why = "not known without the proxy's first_token marks (--binding-marks)";
      out.push(el("p", "bd-missing", `${data.missing_stages.join(", ")}: ${why}`));
    }
    const a = data.advice;
    if (!a) {
      out.push(el("p", "bd-reasoning", "no P:D advice: each pool needs a registered instance"));
    } else {
      out.push(el("p", "bd-reasoning", a.reasoning));
      if (a.target_p90_s === null) {
        out.push(el("p", "hint", "no p90 TTFT target (--ttft-target): no recommended counts"));
      }
      const d = a.disaggregation;
      const p = cell("p", "bd-disagg", undefined, { pays: d.suggested_min_tokens === null ? "no" : "yes" });
      p.append(el("strong", "", verdict(d)), el("span", "hint", ` (${d.text})`));
      out.push(p);
    }
    $("breakdown-body").replaceChildren(...out);
  }

  async function load() {
    if (busy) return;
    busy = true;
    try {
      const data = await window.pdgate.getJSON("../v1/breakdown");
      render(data);
      last = data.transfers ? Date.now() : -Infinity;
    } catch (e) {
      $("breakdown").dataset.state = "error";
      $("breakdown-body").replaceChildren(window.pdgate.el("p", "error", `breakdown unavailable: ${e.message}`));
    } finally {
      busy = false;
      const panel = $("breakdown");
      panel.dataset.loaded = String(Number(panel.dataset.loaded || 0) + 1);
    }
  }

  document.addEventListener("pdgate:refresh", () => {
    if (Date.now() - last >= EVERY_MS) load();
  });
})();
