// nanoserve engine view (chapter 12): reads /engine/events (server-sent events) and draws each snapshot.
// Hand-written, no libraries. A snapshot's fields are documented in nanoserve/engine/snapshot.py.
"use strict";

const $ = (id) => document.getElementById(id);
const HISTORY = 240;        // step records kept for the timeline and the KV chart
const state = { lastStep: 0, steps: [], preemptions: 0, finished: 0, aborted: 0, prefixHits: 0,
                colours: new Map(), connects: 0 };

// ---- helpers ---------------------------------------------------------------------------------------
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const ms = (s) => (s == null ? "–" : (s * 1000).toFixed(s < 0.1 ? 1 : 0) + " ms");
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text != null) e.textContent = text;
  return e;
}
function headers() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}
function setStatus(kind, text) {
  const s = $("status");
  s.className = "status " + kind;
  s.textContent = text;
  s.dataset.connects = state.connects;
}
// A colour per request, in order of appearance (golden-angle hues stay apart); free / cached / shared fixed.
function colour(owner) {
  if (owner === "free") return "var(--free)";
  if (owner === "cached") return "var(--cached)";
  if (owner.startsWith("shared:")) return "#4b3f72";
  if (!state.colours.has(owner)) state.colours.set(owner, `hsl(${(state.colours.size * 137.5) % 360} 65% 52%)`);
  return state.colours.get(owner);
}
function describe(owner) {
  if (owner === "free") return "free";
  if (owner === "cached") return "cached: free, but a prefix hit can revive it until the allocator hands it out again, least recently freed first";
  if (owner.startsWith("shared:")) return `shared by ${owner.slice(7)} block tables (a prefix hit, or the completions of one n > 1 request)`;
  return "held by " + owner;
}

// ---- server-sent events over fetch (fetch can send the API key; EventSource cannot) -----------------
async function readEvents(resp, onData, signal) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done || (signal && signal.aborted)) return;
    buf += decoder.decode(value, { stream: true });
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, end);
      buf = buf.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (onData(data || null) === false) return;  // null: a comment (the server's ping)
    }
  }
}

async function connect() {
  for (let delay = 500; ; delay = Math.min(delay * 2, 4000)) {
    const abort = new AbortController();
    let watchdog = null;
    const pet = () => { clearTimeout(watchdog); watchdog = setTimeout(() => abort.abort(), 5000); };  // pings come every second
    try {
      const resp = await fetch("/engine/events", { headers: headers(), cache: "no-store", signal: abort.signal });
      if (resp.status === 401) {
        setStatus("down", "this server needs an API key: type it above");
      } else if (resp.ok) {
        state.connects += 1;
        setStatus("live", "live");
        delay = 250;
        pet();
        await readEvents(resp, (data) => { pet(); if (data) draw(JSON.parse(data)); }, abort.signal);
      }
    } catch (e) {
      // the server is down or restarting: say so on the page, and try again
    }
    clearTimeout(watchdog);
    abort.abort();
    setStatus("down", "disconnected: reconnecting…");
    await sleep(delay);
  }
}

// ---- drawing ---------------------------------------------------------------------------------------
function draw(snap) {
  if (snap.step < state.lastStep) {  // a new server (or engine): start the history over
    state.steps = [];
    state.colours.clear();
  }
  state.lastStep = snap.step;
  // a (re)connect's first snapshot carries the recent history: keep only the steps not drawn yet
  const held = state.steps.length ? state.steps[state.steps.length - 1][0] : -1;
  state.steps.push(...snap.steps.filter((s) => s[0] > held));
  state.steps.splice(0, Math.max(0, state.steps.length - HISTORY));
  state.preemptions += snap.preempted.length;
  state.finished += snap.finished.length;
  state.aborted += snap.aborted.length;
  state.prefixHits += snap.prefix.hit_tokens;

  $("step").textContent = snap.step;
  const last = snap.steps[snap.steps.length - 1];
  if (last) $("step-summary").textContent = `${last[4]} seqs · ${last[2]} prefill + ${last[3]} decode tokens · ${last[5].toFixed(1)} ms`;
  drawPool(snap);
  drawSeqs($("running"), snap.running, true);
  drawSeqs($("waiting"), snap.waiting, false);
  $("running-count").textContent = `${snap.running.length} / ${snap.config.max_num_seqs} seats`;
  $("waiting-count").textContent = `${snap.waiting.length}`;
  drawFigures(snap);
  drawTimeline();
  drawKv();
  logEvents(snap);
}

function drawPool(snap) {
  const pool = $("pool");
  const { owners, blocks } = snap.pool;
  while (pool.children.length < blocks.length) pool.appendChild(el("div", { class: "block" }));
  while (pool.children.length > blocks.length) pool.lastChild.remove();
  const counts = new Map();
  blocks.forEach((o, i) => {
    const owner = owners[o];
    const cell = pool.children[i];
    counts.set(owner, (counts.get(owner) || 0) + 1);
    if (cell.dataset.owner === owner) return;
    cell.dataset.owner = owner;
    cell.className = "block" + (owner === "cached" ? " cached" : owner.startsWith("shared:") ? " shared" : "");
    cell.style.background = colour(owner);
    cell.title = `block ${i}: ${describe(owner)}`;
  });
  const held = blocks.length - snap.pool.num_free;
  $("pool-summary").textContent = `${held} of ${blocks.length} blocks held · ${snap.config.block_size} tokens each`;
  const legend = $("legend");
  legend.replaceChildren();
  const order = [...counts.keys()].sort((a, b) => (a === "free") - (b === "free") || (a === "cached") - (b === "cached"));
  for (const owner of order) {
    const li = el("li", { title: describe(owner) });
    const sw = el("span", { class: "sw" });
    sw.style.background = colour(owner);
    li.append(sw, `${owner.startsWith("shared:") ? "shared ×" + owner.slice(7) : owner === "free" || owner === "cached" ? owner : owner} (${counts.get(owner)})`);
    legend.appendChild(li);
  }
}

function bar(kind, done, total, label) {
  const b = el("div", { class: "bar " + kind, title: label, role: "progressbar", "aria-valuenow": done,
                        "aria-valuemax": total, "aria-label": label });
  const fill = el("span");
  fill.style.width = `${total ? Math.min(100, (100 * done) / total) : 0}%`;
  b.appendChild(fill);
  return b;
}

function drawSeqs(list, seqs, running) {
  list.replaceChildren();
  for (const s of seqs) {
    const li = el("li", { "data-id": s.id, "data-state": s.state });
    const who = el("span", { class: "who", title: s.id });
    const sw = el("span", { class: "sw" });
    if (running) sw.style.background = colour(s.id);
    who.append(sw, s.id);  // the whole id, as the client got it in its response
    const tags = el("span");
    tags.append(el("span", { class: "tag" }, `prio ${s.priority}`), " ", el("span", { class: "tag" }, s.state));
    if (s.preemptions) {
      li.classList.add("preempted");
      tags.append(" ", el("span", { class: "tag preempted",
                                    title: "preempted: its blocks were freed and recomputed, or swapped out to the KV tier" },
                          `preempted ×${s.preemptions}`));
    }
    if (running && s.scheduled) tags.append(" ", el("span", { class: "tag" }, `+${s.scheduled} ${s.kind}`));
    const prompt = Math.min(s.computed, s.prompt);
    const bars = el("div", { class: "bars" });
    bars.append(bar("prompt", prompt, s.prompt, `prompt computed: ${prompt} / ${s.prompt} tokens`),
                bar("gen", s.output, s.max_tokens, `generated: ${s.output} / ${s.max_tokens} tokens`));
    li.append(who, tags, bars);
    list.appendChild(li);
  }
}

function drawFigures(snap) {
  // p50s computed by the server with chapter 09's percentile (nanoserve/metrics.py) over its last 20 requests
  const lat = snap.latency;
  $("last-n").textContent = lat.requests;
  $("ttft").textContent = lat.ttft_p50 != null ? ms(lat.ttft_p50) : "–";
  $("tpot").textContent = lat.tpot_p50 != null ? ms(lat.tpot_p50) : "–";
  // output tokens (every completion's, accepted proposals included) in the last 5 s of steps, per second
  const steps = state.steps;
  if (steps.length) {
    const end = steps[steps.length - 1][1];
    const window = steps.filter((s) => s[1] > end - 5);
    const span = Math.max(end - window[0][1] + window[0][5] / 1000, 0.05);
    $("tput").textContent = `${(window.reduce((a, s) => a + s[6], 0) / span).toFixed(0)} tok/s`;
  }
  $("kv-usage").textContent = `${(100 * snap.pool.usage).toFixed(0)} %`;
  $("preemptions").textContent = state.preemptions;
  $("finished").textContent = `${state.finished} / ${state.aborted}`;
  $("prefix").textContent = `${state.prefixHits} tokens`;
}

function canvas(id) {
  const c = $(id);
  const ctx = c.getContext("2d");
  ctx.clearRect(0, 0, c.width, c.height);
  return [ctx, c.width, c.height];
}

function drawTimeline() {
  const [ctx, w, h] = canvas("timeline");
  const steps = state.steps.slice(-120);
  if (!steps.length) return;
  ctx.canvas.dataset.steps = `${steps[0][0]}-${steps[steps.length - 1][0]}`;  // the steps drawn, for a reader (and a test)
  const css = getComputedStyle(document.documentElement);
  const maxTokens = Math.max(1, ...steps.map((s) => s[2] + s[3]));
  const maxMs = Math.max(1, ...steps.map((s) => s[5]));
  const bw = w / 120;
  steps.forEach((s, i) => {
    const x = i * bw;
    const hp = (s[2] / maxTokens) * (h - 14), hd = (s[3] / maxTokens) * (h - 14);
    ctx.fillStyle = css.getPropertyValue("--decode");
    ctx.fillRect(x, h - hd, bw - 1, hd);
    ctx.fillStyle = css.getPropertyValue("--prefill");
    ctx.fillRect(x, h - hd - hp, bw - 1, hp);
  });
  ctx.strokeStyle = css.getPropertyValue("--steptime");
  ctx.beginPath();
  steps.forEach((s, i) => {
    const y = h - (s[5] / maxMs) * (h - 14);
    i ? ctx.lineTo(i * bw + bw / 2, y) : ctx.moveTo(bw / 2, y);
  });
  ctx.stroke();
  ctx.fillStyle = "#444";
  ctx.font = "11px sans-serif";
  ctx.fillText(`${maxTokens} tokens`, 2, 10);
  const label = `${maxMs.toFixed(0)} ms`;
  ctx.fillText(label, w - ctx.measureText(label).width - 2, 10);
}

function drawKv() {
  const [ctx, w, h] = canvas("kv-chart");
  const steps = state.steps;
  if (!steps.length) return;
  ctx.strokeStyle = "#137333";
  ctx.beginPath();
  steps.forEach((s, i) => {
    const x = (i / Math.max(1, HISTORY - 1)) * w, y = h - s[7] * (h - 12);
    i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
  });
  ctx.stroke();
  ctx.fillStyle = "#444";
  ctx.font = "11px sans-serif";
  ctx.fillText("KV usage over the last steps (top = 100 %)", 2, 10);
}

function logEvents(snap) {
  const log = $("events");
  const add = (cls, text) => {
    log.prepend(el("li", { class: cls }, `step ${snap.step}: ${text}`));
    while (log.children.length > 60) log.lastChild.remove();
  };
  for (const id of snap.preempted) add("preempted", `preempted ${id} (blocks freed and recomputed, or swapped out to the KV tier)`);
  for (const f of snap.finished) add("finished", `finished ${f.id} (${f.reason}, ${f.output} tokens, TTFT ${ms(f.ttft)})`);
  for (const id of snap.aborted) add("aborted", `aborted ${id}`);
  if (snap.prefix.hit_tokens) add("hit", `prefix cache hit: ${snap.prefix.hit_tokens} tokens not recomputed`);
}

// ---- the forms: one streamed chat, and a burst -----------------------------------------------------
function chatBody(content, stream) {
  return JSON.stringify({ messages: [{ role: "user", content }], max_tokens: Number($("max-tokens").value) || 32, stream });
}

$("chat-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const reply = $("reply");
  reply.textContent = "";
  reply.dataset.state = "streaming";
  try {
    const resp = await fetch("/v1/chat/completions", { method: "POST", body: chatBody($("chat-input").value, true),
                                                      headers: { "Content-Type": "application/json", ...headers() } });
    if (!resp.ok) { reply.textContent = `error ${resp.status}: ${(await resp.json()).error.message}`; return; }
    await readEvents(resp, (data) => {
      if (data === "[DONE]") return false;
      if (data) reply.textContent += JSON.parse(data).choices[0]?.delta?.content || "";
    });
  } catch (e) {
    reply.textContent += " [the connection broke]";
  }
  reply.dataset.state = "done";
});

$("burst-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const n = Math.max(1, Math.min(64, Number($("burst-n").value) || 1));
  const status = $("burst-status");
  let done = 0, failed = 0;
  status.textContent = `0 / ${n} done`;
  const one = async (i) => {
    try {
      const resp = await fetch("/v1/chat/completions", { method: "POST", body: chatBody(`Request ${i + 1}: tell me a story.`, false),
                                                        headers: { "Content-Type": "application/json", ...headers() } });
      if (!resp.ok) failed += 1;
      await resp.text();
    } catch (e) {
      failed += 1;
    }
    done += 1;
    status.textContent = `${done} / ${n} done` + (failed ? `, ${failed} failed` : "");
  };
  await Promise.all(Array.from({ length: n }, (_, i) => one(i)));
});

$("api-key").value = sessionStorage.getItem("nanoserve-key") || "";
$("api-key").addEventListener("change", () => sessionStorage.setItem("nanoserve-key", $("api-key").value));
connect();
