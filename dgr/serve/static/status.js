// The status page of a dgr route: polls ./status once a second, and streams the chat box's
// replies from ./v1/chat/completions (server-sent events). No dependencies, no CDN.
"use strict";

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;

// An API key, when the server asks for one (401): kept in sessionStorage (this tab only),
// sent as OpenAI clients send it.
function authHeaders(extra) {
  const key = sessionStorage.getItem("dgr-api-key");
  return Object.assign({}, extra || {}, key ? {"Authorization": "Bearer " + key} : {});
}

function fmt(x, digits, unit) {
  if (x === null || x === undefined || Number.isNaN(x)) return "\u2013";
  return x.toFixed(digits) + (unit ? " " + unit : "");
}

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function stageItem(s, seam) {
  const li = el("li", {class: "stage " + s.health, "data-endpoint": s.endpoint,
                       "data-health": s.health});
  const h = el("h3", {}, "stage " + s.index + ": layers [" + s.layers[0] + ", " + s.layers[1] + ")");
  h.appendChild(el("span", {class: "health"}, s.health));
  li.appendChild(h);
  const dl = el("dl");
  const rows = [["endpoint", s.endpoint]];
  if (s.health !== "down") {
    rows.push(["slots in use", s.slots_used + " / " + s.n_slots],
              ["context / session", s.n_ctx + " tokens"],
              ["sessions", String(s.sessions)],
              ["queued steps", String(s.queue_depth)],
              ["compute / token", fmt(s.compute_ms, 2, "ms")],
              ["seam", fmt(seam, 2, "ms")],
              ["steps", String(s.steps_total)]);
  }
  for (const [k, v] of rows) { dl.appendChild(el("dt", {}, k)); dl.appendChild(el("dd", {}, v)); }
  li.appendChild(dl);
  if (s.error) li.appendChild(el("p", {class: "error"}, s.error));
  return li;
}

// -- trends: small SVG line charts of the server's samples (st.history), no library ---------

const COLOURS = ["#0b62c4", "#1a7f37", "#9a6700", "#8250df", "#cf222e", "#57606a"];

function esc(t) {
  return String(t).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;",
                                                '"': "&quot;"}[c]));
}

// lines: [{name, values}] over the samples' ages (seconds before now, oldest first); the
// SVG is parsed from markup (the HTML parser puts it in the SVG namespace)
function chart(id, ages, lines, span) {
  const fig = $(id);
  const W = 300, H = 70;
  const all = lines.flatMap((l) => l.values).filter((v) => v !== null && v !== undefined);
  const hi = all.length ? Math.max(...all) : 0;
  const top = hi > 0 ? hi * 1.1 : 1;
  let svg = '<svg viewBox="0 0 ' + W + " " + H + '" preserveAspectRatio="none" role="img" ' +
    'aria-label="' + esc(fig.querySelector("figcaption").textContent) + '">';
  lines.forEach((l, i) => {
    const pts = [];
    l.values.forEach((v, j) => {
      if (v === null || v === undefined) return;
      const x = W * (1 - ages[j] / span), y = H - 12 - (H - 16) * (v / top);
      pts.push(x.toFixed(1) + "," + y.toFixed(1));
    });
    svg += '<polyline points="' + pts.join(" ") + '" stroke="' + COLOURS[i % COLOURS.length] +
      '" data-series="' + esc(l.name) + '" data-points="' + pts.length + '"></polyline>';
  });
  svg += '<text x="2" y="9" class="axis">max ' + esc(fmt(hi, hi >= 10 ? 0 : 2)) + "</text></svg>";
  const old = fig.querySelector("svg");
  if (old) old.remove();
  fig.querySelector("figcaption").insertAdjacentHTML("afterend", svg);
  let legend = fig.querySelector(".legend");
  if (lines.length > 1) {
    if (!legend) { legend = el("div", {class: "legend"}); fig.appendChild(legend); }
    legend.replaceChildren(...lines.map((l, i) => {
      const s = el("span", {}, "\u25a0 " + l.name + "  ");
      s.style.color = COLOURS[i % COLOURS.length];
      return s;
    }));
  }
}

function renderTrends(h, stages) {
  $("trend-span").textContent = "(last " + Math.round(h.span_s / 60) + " min, " +
    h.age_s.length + " sample(s))";
  chart("chart-tps", h.age_s, [{name: "tokens/s", values: h.tokens_per_s}], h.span_s);
  chart("chart-ttft", h.age_s, [{name: "TTFT", values: h.ttft_ms}], h.span_s);
  chart("chart-waiting", h.age_s, [{name: "waiting", values: h.waiting}], h.span_s);
  chart("chart-acceptance", h.age_s, [{name: "accepted", values: h.acceptance}], h.span_s);
  const per = stages.map((s, i) => ({name: "stage " + i + " compute",
                                     values: h.compute_ms.map((c) => c[i] ?? null)}));
  per.push({name: "seam per link", values: h.seam_ms});
  chart("chart-seam", h.age_s, per, h.span_s);
}

function render(st) {
  $("model").textContent = st.model;
  document.title = "dgr: " + st.model;
  $("summary").textContent = st.stages.length + " stage(s), " + st.path + ", " +
    st.capacity + " slot(s) of " + st.n_ctx + " context tokens; " + (st.healthy ? "healthy" : "degraded");
  $("window").textContent = "(last " + st.traffic.window_s + " s)";
  $("fig-tps").textContent = fmt(st.traffic.tokens_per_s, 1);
  $("fig-ttft").textContent = fmt(st.traffic.ttft_ms, 0, "ms");
  $("fig-tpot").textContent = fmt(st.traffic.tpot_ms, 1, "ms");
  $("fig-seam").textContent = fmt(st.seam_ms, 2, "ms");
  $("fig-inflight").textContent = String(st.in_flight);
  $("fig-waiting").textContent = st.waiting + " (of " + st.queue.max + ")";
  $("fig-acceptance").textContent = st.traffic.acceptance === null ? "\u2013" :
    fmt(100 * st.traffic.acceptance, 0, "%") + " of " + st.traffic.drafted;
  $("fig-per-trip").textContent = fmt(st.traffic.tokens_per_trip, 2);
  const pc = st.prompt_cache;
  $("fig-prompt-cache").textContent = !pc || !pc.size ? "off" :
    pc.hits + " of " + (pc.hits + pc.misses) + ", " + pc.tokens_reused + " tokens; " +
    pc.kept + " / " + pc.size + " kept";
  $("seam-note").textContent = st.in_flight > 1 ?
    "With several requests in flight the seam figure includes their waits for each other." : "";
  const ol = $("stages");
  ol.replaceChildren(...st.stages.map((s) => stageItem(s, st.seam_ms)));
  const tb = document.querySelector("#requests tbody");
  tb.replaceChildren(...st.requests.map((r) => {
    const tr = el("tr", {"data-id": r.id});
    for (const v of [r.id.slice(0, 18), r.endpoint, String(r.prompt_tokens),
                     String(r.completion_tokens), fmt(r.age_s, 1, "s"), fmt(r.ttft_ms, 0, "ms")]) {
      tr.appendChild(el("td", {}, v));
    }
    return tr;
  }));
  $("no-requests").hidden = st.requests.length > 0;
  if (st.history) renderTrends(st.history, st.stages);
}

async function poll() {
  try {
    const r = await fetch("status", {cache: "no-store", headers: authHeaders()});
    if (r.status === 401) {
      $("key-form").hidden = false;
      throw new Error("this server needs an API key");
    }
    if (!r.ok) throw new Error("HTTP " + r.status);
    $("key-form").hidden = true;
    render(await r.json());
    document.body.dataset.loaded = "true";
  } catch (e) {
    $("summary").textContent = "status unavailable: " + e.message;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

// -- chat --------------------------------------------------------------------------------

const history = [];
let controller = null;

async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buf += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (data) yield data;
    }
  }
}

async function send(text) {
  const log = $("chat-log");
  log.appendChild(el("div", {class: "msg user"}, text));
  const out = el("div", {class: "msg assistant", "data-state": "streaming"}, "");
  log.appendChild(out);
  history.push({role: "user", content: text});
  controller = new AbortController();
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  let reply = "";
  try {
    const r = await fetch("v1/chat/completions", {
      method: "POST", headers: authHeaders({"Content-Type": "application/json"}),
      signal: controller.signal,
      body: JSON.stringify({messages: history, stream: true,
                            max_tokens: parseInt($("chat-max").value, 10) || 64,
                            temperature: parseFloat($("chat-temp").value) || 0})});
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || ("HTTP " + r.status));
    }
    for await (const data of sseEvents(r)) {
      if (data === "[DONE]") break;
      const ev = JSON.parse(data);
      if (ev.error) throw new Error(ev.error.message);
      const c = ev.choices && ev.choices[0];
      if (c && c.delta && c.delta.content) {
        reply += c.delta.content;
        out.textContent = reply;
        log.scrollTop = log.scrollHeight;
      }
      if (c && c.finish_reason) out.dataset.finish = c.finish_reason;
    }
    out.dataset.state = "done";
    history.push({role: "assistant", content: reply});
  } catch (e) {
    out.dataset.state = e.name === "AbortError" ? "stopped" : "error";
    out.textContent = reply + (e.name === "AbortError" ? " [stopped]" : "[error: " + e.message + "]");
    history.pop();
  } finally {
    controller = null;
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
  }
}

$("chat").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || controller) return;
  $("chat-input").value = "";
  send(text);
});
$("chat-input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("chat").requestSubmit(); }
});
$("chat-stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("dgr-api-key", $("api-key").value.trim());
  $("api-key").value = "";
});
$("chat-clear").addEventListener("click", () => {
  if (controller) return;
  history.length = 0;
  $("chat-log").replaceChildren();
});

poll();
