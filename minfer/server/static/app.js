// minfer demo page: chat panes that stream side by side (one engine batch serves them all),
// sampling controls, per-pane TTFT and tok/s, and a live panel of engine state from GET /stats.
"use strict";

const $ = (sel, root = document) => root.querySelector(sel);
const panes = [];
let modelName = null;

function controlValue(id) {
  const el = $("#c-" + id);
  return el.value === "" ? null : Number(el.value);
}

function samplingBody() {
  const body = { temperature: controlValue("temperature"), top_p: controlValue("top_p"),
                 max_tokens: controlValue("max_tokens"), stream: true, stream_options: { include_usage: true } };
  const topK = controlValue("top_k"), seed = controlValue("seed");
  if (topK) body.top_k = topK;
  if (seed !== null) body.seed = seed;
  if ($("#c-ignore_eos").checked) body.ignore_eos = true;
  if (modelName) body.model = modelName;
  return body;
}

// Yield the parsed JSON of each `data:` event of an SSE response, until [DONE].
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

class Pane {
  constructor(index) {
    this.index = index;
    this.el = $("#pane-template").content.firstElementChild.cloneNode(true);
    this.el.id = "pane-" + index;
    this.el.dataset.state = "idle";
    $(".title", this.el).textContent = "Pane " + (index + 1);
    this.log = $(".log", this.el);
    this.input = $("textarea", this.el);
    this.history = [];
    this.controller = null;
    $("form", this.el).addEventListener("submit", (e) => { e.preventDefault(); this.send(); });
    this.input.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); this.send(); }
    });
    $(".stop", this.el).addEventListener("click", () => this.controller && this.controller.abort());
    $(".clear", this.el).addEventListener("click", () => { this.history = []; this.log.replaceChildren(); });
  }

  bubble(cls, text) {
    const div = document.createElement("div");
    div.className = "msg " + cls;
    div.textContent = text;
    this.log.append(div);
    this.log.scrollTop = this.log.scrollHeight;
    return div;
  }

  setState(state) {
    this.el.dataset.state = state;
    this.el.classList.toggle("streaming", state === "streaming");
    const badge = $(".state", this.el);
    badge.textContent = state;
    badge.className = "badge state" + (state === "streaming" ? " live" : state === "error" ? " error" : "");
    $(".send", this.el).disabled = state === "streaming";
    $(".stop", this.el).disabled = state !== "streaming";
  }

  showStats(ttftMs, ntok, tps) {
    $(".ttft", this.el).textContent = ttftMs === null ? "–" : ttftMs.toFixed(0) + " ms";
    $(".ntok", this.el).textContent = String(ntok);
    $(".tps", this.el).textContent = tps === null ? "–" : tps.toFixed(1);
  }

  async send(text) {
    text = (text ?? this.input.value).trim();
    if (!text || this.el.dataset.state === "streaming") return;
    this.input.value = "";
    const chat = $("#c-mode").value === "chat";
    this.bubble("user", text);
    const out = this.bubble("assistant live", "");
    const body = samplingBody();
    let url;
    if (chat) {
      this.history.push({ role: "user", content: text });
      body.messages = this.history;
      url = "/v1/chat/completions";
    } else {
      body.prompt = text;
      url = "/v1/completions";
    }
    this.controller = new AbortController();
    this.setState("streaming");
    this.showStats(null, 0, null);
    const t0 = performance.now();
    let tFirst = null, ntok = 0, reply = "";
    try {
      const resp = await fetch(url, { method: "POST", headers: { "Content-Type": "application/json" },
                                      body: JSON.stringify(body), signal: this.controller.signal });
      if (!resp.ok) {
        const err = await resp.json().catch(() => ({}));
        throw new Error((err.error && err.error.message) || "HTTP " + resp.status);
      }
      for await (const msg of sseEvents(resp)) {
        if (msg.error) throw new Error(msg.error.message);
        if (msg.usage) ntok = msg.usage.completion_tokens;
        const choice = msg.choices && msg.choices[0];
        if (!choice) continue;
        const piece = chat ? (choice.delta.content || "") : (choice.text || "");
        const now = performance.now();
        if (tFirst === null) { tFirst = now; this.el.dataset.firstTokenAt = String(now); }
        ntok += 1;
        reply += piece;
        out.textContent = reply;
        this.log.scrollTop = this.log.scrollHeight;
        const tps = ntok > 1 ? (ntok - 1) / ((now - tFirst) / 1000) : null;
        this.showStats(tFirst - t0, ntok, tps);
      }
      const end = performance.now();
      this.el.dataset.doneAt = String(end);
      this.showStats(tFirst === null ? null : tFirst - t0, ntok,
                     ntok > 1 && tFirst !== null ? (ntok - 1) / ((end - tFirst) / 1000) : null);
      if (chat) this.history.push({ role: "assistant", content: reply });
      this.setState("done");
    } catch (err) {
      if (err.name === "AbortError") { this.setState("stopped"); }
      else { out.className = "msg error"; out.textContent = String(err.message || err); this.setState("error"); }
      if (chat) this.history.pop();
    } finally {
      out.classList.remove("live");
      this.controller = null;
    }
  }
}

function addPane() {
  const pane = new Pane(panes.length);
  panes.push(pane);
  $("#panes").append(pane.el);
}

function removePane() {
  if (panes.length <= 1) return;
  const pane = panes.pop();
  if (pane.controller) pane.controller.abort();
  pane.el.remove();
}

// ---- live engine state -------------------------------------------------------------------
const rates = [];

function drawSpark() {
  const canvas = $("#st-spark"), g = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, max = Math.max(1, ...rates);
  g.clearRect(0, 0, w, h);
  g.beginPath();
  rates.forEach((r, i) => {
    const x = (i / Math.max(1, 79)) * w, y = h - 2 - (r / max) * (h - 4);
    i ? g.lineTo(x, y) : g.moveTo(x, y);
  });
  g.strokeStyle = "#4fa3ff";
  g.lineWidth = 1.5;
  g.stroke();
}

function setHealth(ok, label) {
  const el = $("#health");
  el.className = "health " + (ok ? "ok" : "bad");
  $(".label", el).textContent = label;
}

async function pollStats() {
  try {
    const resp = await fetch("/stats", { cache: "no-store" });
    const s = await resp.json();
    $("#st-running").textContent = s.num_running;
    $("#st-waiting").textContent = s.num_waiting;
    $("#st-kv-text").textContent = `${s.kv_blocks_used} / ${s.num_kv_blocks}`;
    $("#st-kv-bar").style.width = (100 * s.kv_cache_usage).toFixed(1) + "%";
    $("#st-prefix").textContent = (100 * s.prefix_cache_hit_rate).toFixed(1) + "%";
    $("#st-preempt").textContent = s.num_preemptions;
    $("#st-rate").textContent = s.generation_tokens_per_s.toFixed(0);
    const engine = $("#engine");
    engine.dataset.maxRunning = String(Math.max(Number(engine.dataset.maxRunning || 0), s.num_running));
    rates.push(s.generation_tokens_per_s);
    if (rates.length > 80) rates.shift();
    drawSpark();
    setHealth(s.healthy, s.healthy ? "healthy" : "engine stopped");
  } catch (err) {
    setHealth(false, "unreachable");
  }
}

async function init() {
  try {
    const models = await (await fetch("/v1/models")).json();
    modelName = models.data[0].id;
    $("#model-name").textContent = modelName + "  ·  context " + models.data[0].max_model_len;
  } catch (err) { $("#model-name").textContent = "(no model info)"; }
  try {
    const s = await (await fetch("/stats")).json();
    if (!s.has_chat_template) $("#c-mode").value = "completion";
  } catch (err) { /* pollStats reports it */ }
  for (const id of ["temperature", "top_p"]) {
    const input = $("#c-" + id), out = $("#o-" + id);
    input.addEventListener("input", () => { out.textContent = input.value; });
  }
  $("#add-pane").addEventListener("click", addPane);
  $("#remove-pane").addEventListener("click", removePane);
  const broadcast = () => {
    const text = $("#broadcast-input").value.trim();
    if (!text) return;
    $("#broadcast-input").value = "";
    panes.forEach((p) => p.send(text));
  };
  $("#broadcast-send").addEventListener("click", broadcast);
  $("#broadcast-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); broadcast(); }
  });
  for (let i = 0; i < 3; i++) addPane();
  pollStats();
  setInterval(pollStats, 250);
  document.body.dataset.ready = "1";
}

window.minfer = { panes };
init();
