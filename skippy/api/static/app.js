// skippy's page: the chain live (GET chain, every POLL_MS), two plots, and a chat that streams
// from POST v1/chat/completions.  Plain DOM, no library, no build step.  Everything the server
// sends is put on the page as text nodes or SVG attributes, never parsed as markup.  With an API
// key configured, GET chain answers 401 until the key is entered: nothing of the chain is drawn
// before that, and the key lives in this tab's sessionStorage only.
"use strict";

const POLL_MS = 700;  // a stage that goes down is marked within about a second
const KEY_STORAGE = "skippy-api-key";
const SVG_NS = "http://www.w3.org/2000/svg";

const state = {
  key: sessionStorage.getItem(KEY_STORAGE) || "",
  model: "",
  timer: 0,
  polling: false,
  messages: [],
  busy: null,   // the AbortController of the answer being streamed
};

const $ = (id) => document.getElementById(id);

// -- small DOM helpers -------------------------------------------------------------------------
function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function svg(tag, attributes) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attributes || {})) node.setAttribute(name, String(value));
  return node;
}

function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
}

function headers(extra) {
  const out = Object.assign({}, extra || {});
  if (state.key) out["Authorization"] = "Bearer " + state.key;
  return out;
}

function mib(bytes) {
  return bytes === null || bytes === undefined ? "?" : (bytes / 1048576).toFixed(1) + " MiB";
}

function number(value, digits) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  return Number(value).toFixed(digits === undefined ? 0 : digits);
}

// A horizontal bar of parts [{value, className}] over total (SVG, so no inline style is needed).
function bar(parts, total) {
  const node = svg("svg", {class: "bar", viewBox: "0 0 100 10", preserveAspectRatio: "none"});
  node.appendChild(svg("rect", {class: "track", x: 0, y: 0, width: 100, height: 10}));
  let x = 0;
  for (const part of parts) {
    const width = total > 0 ? Math.max(0, Math.min(100 - x, 100 * part.value / total)) : 0;
    if (width > 0) node.appendChild(svg("rect", {class: part.className, x: x, y: 0, width: width, height: 10}));
    x += width;
  }
  return node;
}

// -- key -----------------------------------------------------------------------------------------
function showKeyPanel(message) {
  $("dashboard").hidden = true;
  clear($("stages"));
  clear($("messages"));
  state.messages = [];
  $("model").textContent = "";
  $("chain-status").textContent = "locked";
  $("chain-status").dataset.status = "unknown";
  $("key-panel").hidden = false;
  $("forget-key").hidden = true;
  const error = $("key-error");
  error.hidden = !message;
  error.textContent = message || "";
  $("key-input").focus();
}

function setKey(key) {
  state.key = key;
  if (key) sessionStorage.setItem(KEY_STORAGE, key); else sessionStorage.removeItem(KEY_STORAGE);
}

// -- chain ---------------------------------------------------------------------------------------
function schedule() {
  clearTimeout(state.timer);
  state.timer = setTimeout(poll, POLL_MS);
}

async function poll() {
  if (state.polling) return;
  state.polling = true;
  let response;
  try {
    response = await fetch("chain", {headers: headers(), cache: "no-store"});
  } catch (error) {
    state.polling = false;
    $("offline").hidden = false;
    $("chain-status").textContent = "API unreachable";
    $("chain-status").dataset.status = "offline";
    for (const card of document.querySelectorAll(".stage")) card.dataset.status = "unknown";
    schedule();
    return;
  }
  state.polling = false;
  $("offline").hidden = true;
  if (response.status === 401) {
    const hadKey = Boolean(state.key);
    setKey("");
    showKeyPanel(hadKey ? "That key was refused." : "");
    return;  // polling resumes once a key is entered
  }
  if (!response.ok) {
    $("chain-status").textContent = "error " + response.status;
    $("chain-status").dataset.status = "unavailable";
    schedule();
    return;
  }
  const snapshot = await response.json();
  $("key-panel").hidden = true;
  $("dashboard").hidden = false;
  $("forget-key").hidden = !state.key;
  render(snapshot);
  schedule();
}

function render(snapshot) {
  state.model = snapshot.model;
  $("model").textContent = snapshot.model;
  const status = $("chain-status");
  status.dataset.status = snapshot.status;
  status.textContent = snapshot.status === "ok" ? "chain healthy" : "chain unavailable";
  status.title = snapshot.error || "";
  const notes = [];
  if (!snapshot.stages_known) {
    notes.push("This API knows its first stage only (skippy serve): the stages behind it are not listed.");
  }
  if (!snapshot.one_model) notes.push("The stages report different model files.");
  if (snapshot.error) notes.push(snapshot.error);
  $("chain-note").hidden = notes.length === 0;
  $("chain-note").textContent = notes.join(" ");
  renderStages(snapshot.stages);
  renderHistory(snapshot.history);
  renderApi(snapshot.api, snapshot.history);
}

function renderStages(stages) {
  const box = $("stages");
  clear(box);
  stages.forEach((stage, position) => {
    if (position > 0) box.appendChild(el("div", "hop", "→"));
    box.appendChild(stageCard(stage));
  });
}

function stageCard(stage) {
  const card = el("article", "stage");
  card.dataset.index = stage.index;
  card.dataset.status = stage.status;
  const head = el("div", "stage-head");
  head.appendChild(el("span", "stage-name", "stage " + stage.index));
  head.appendChild(el("span", "status", stage.status));
  card.appendChild(head);
  const layers = el("div", "layers", "layers ");
  layers.appendChild(el("span", "range", stage.layers || "?"));
  if (stage.identity) layers.appendChild(document.createTextNode(" of " + stage.identity.layer_count));
  card.appendChild(layers);
  card.appendChild(el("div", "address", stage.address));
  if (stage.identity) {
    const identity = el("div", "identity", stage.identity.model + " · " + stage.identity.digest.slice(0, 12));
    identity.title = "GGUF header sha256 " + stage.identity.digest + ", ctx " + stage.identity.ctx_size +
      ", batch " + stage.identity.batch_size;
    card.appendChild(identity);
  }
  const facts = el("dl");
  const fact = (name, value) => {
    facts.appendChild(el("dt", null, name));
    const dd = el("dd");
    if (value instanceof Node) dd.appendChild(value); else dd.textContent = value;
    facts.appendChild(dd);
    return dd;
  };
  const metrics = stage.metrics;
  if (metrics) {
    fact("memory", mib(metrics.resident_bytes));
    const kv = fact("KV cells", number(metrics.kv_cells_used) + " / " + number(metrics.kv_cells_capacity));
    kv.appendChild(bar([{value: metrics.kv_cells_used || 0, className: "used"}], metrics.kv_cells_capacity || 0));
    fact("sessions", number(metrics.sessions_in_use));
    fact("lanes open", number(metrics.lanes_open));
    const lookups = (metrics.prefix_cache_hits || 0) + (metrics.prefix_cache_misses || 0);
    if (lookups > 0) fact("cache hits", number(metrics.prefix_cache_hits) + " / " + number(lookups));
  } else if (stage.status === "up") {
    fact("metrics", stage.metrics_error ? "unreadable" : "not served");
  }
  const share = stage.time_per_token;
  if (share) {
    const total = share.compute_ms + share.wire_ms + share.queue_ms;
    const shareBox = el("div", "share");
    shareBox.appendChild(bar([{value: share.compute_ms, className: "compute"}, {value: share.wire_ms, className: "wire"},
      {value: share.queue_ms, className: "queue"}], total));
    shareBox.appendChild(el("div", "share-text", number(share.compute_ms, 2) + " / " + number(share.wire_ms, 2) +
      " / " + number(share.queue_ms, 2) + " ms per token"));
    fact("time", shareBox);
  }
  card.appendChild(facts);
  if (stage.error) card.appendChild(el("p", "error", stage.error));
  else if (stage.metrics_error && stage.status === "up") card.appendChild(el("p", "error", stage.metrics_error));
  return card;
}

// -- plots ---------------------------------------------------------------------------------------
// A line (or dots) over [[seconds ago, value], ...], x from -window to now, drawn in the SVG's own
// pixels (its view box follows its width, so the labels keep their size).
function plot(target, points, windowS, options) {
  clear(target);
  const width = Math.max(200, Math.round(target.clientWidth || 320)), height = 120;
  target.setAttribute("viewBox", "0 0 " + width + " " + height);
  const left = 34, right = width - 6, top = 8, bottom = height - 18;
  const max = Math.max(options.minimum, ...points.map((p) => p[1]));
  const x = (ago) => right - (right - left) * Math.min(ago, windowS) / windowS;
  const y = (value) => bottom - (bottom - top) * value / max;
  target.appendChild(svg("line", {class: "axis", x1: left, y1: bottom, x2: right, y2: bottom}));
  target.appendChild(svg("line", {class: "axis", x1: left, y1: top, x2: left, y2: bottom}));
  const label = (text, lx, ly, anchor) => {
    const node = svg("text", {class: "label", x: lx, y: ly, "text-anchor": anchor});
    node.textContent = text;
    target.appendChild(node);
  };
  label(number(max, max < 10 ? 1 : 0), left - 4, top + 6, "end");
  label("0", left - 4, bottom, "end");
  label("-" + Math.round(windowS / 60) + " min", left, bottom + 14, "start");
  label("now", right, bottom + 14, "end");
  if (points.length === 0) return;
  const coordinates = points.map((p) => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1));
  if (options.dots) {
    for (const p of points) target.appendChild(svg("circle", {class: "dot", cx: x(p[0]), cy: y(p[1]), r: 2}));
    return;
  }
  const first = x(points[0][0]).toFixed(1), last = x(points[points.length - 1][0]).toFixed(1);
  target.appendChild(svg("polygon", {class: "area",
    points: first + "," + bottom + " " + coordinates.join(" ") + " " + last + "," + bottom}));
  target.appendChild(svg("polyline", {class: "line", points: coordinates.join(" ")}));
}

function renderHistory(history) {
  plot($("plot-throughput"), history.throughput, history.window_s, {minimum: 1, dots: false});
  plot($("plot-ttft"), history.ttft_ms, history.window_s, {minimum: 10, dots: true});
  const recent = history.throughput.slice(-2).map((p) => p[1]);
  $("throughput-now").textContent = recent.length ? number(Math.max(...recent), 1) : "";
  const lastTtft = history.ttft_ms[history.ttft_ms.length - 1];
  $("ttft-now").textContent = lastTtft ? "last " + number(lastTtft[1], 1) : "";
}

function renderApi(api, history) {
  const box = $("api-figures");
  clear(box);
  const add = (name, value) => {
    box.appendChild(el("dt", null, name));
    box.appendChild(el("dd", null, value));
  };
  add("requests in flight", number(api.requests_in_flight) + " (waiting " + number(api.queue_waiting) + ")");
  add("lanes open", number(api.lanes_open) + " of " + number(api.max_lanes));
  add("served", number(history.requests) + " requests, " + number(history.completion_tokens) + " tokens");
  if (api.prefix_cache_lookups) {
    add("prefix cache", number(api.prefix_cache_hits) + " hits of " + number(api.prefix_cache_lookups) +
      " lookups, " + number(api.prefix_cache_cached_tokens) + " tokens restored");
  }
  if (api.speculation_proposed) {
    add("speculation", number(api.speculation_accepted) + " of " + number(api.speculation_proposed) +
      " drafts accepted (" + number(100 * api.speculation_accepted / api.speculation_proposed, 1) + "%)");
  }
}

// -- chat ----------------------------------------------------------------------------------------
function addMessage(role, text) {
  const box = el("div", "message " + role);
  const body = el("div", "text", text);
  box.appendChild(body);
  $("messages").appendChild(box);
  box.scrollIntoView({block: "end"});
  return box;
}

function renderUsage(box, usage) {
  const timing = usage.skippy_timing || {};
  const parts = [
    usage.completion_tokens + " tokens",
    number(timing.decode_tokens_per_second, 1) + " tok/s",
    "TTFT " + number(timing.time_to_first_token_ms, 1) + " ms",
    "prompt " + usage.prompt_tokens + " (cached " +
      ((usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0) + ")",
  ];
  const speculation = usage.skippy_speculation;
  if (speculation) {
    parts.push("speculation " + speculation.accepted + "/" + speculation.proposed + " accepted (" +
      number(100 * speculation.acceptance_rate, 1) + "%)");
  } else {
    parts.push("no speculation");
  }
  const usageBox = el("div", "usage");
  usageBox.appendChild(el("div", "usage-line", parts.join(" · ")));
  const stages = timing.stages || [];
  if (stages.length) {
    const table = el("table", "stage-times");
    const head = el("tr");
    for (const title of ["stage", "layers", "compute ms", "write ms", "downstream ms", "queue ms"]) {
      head.appendChild(el("th", null, title));
    }
    table.appendChild(head);
    for (const stage of stages) {
      const row = el("tr");
      for (const value of [stage.stage, stage.layers, number(stage.compute_ms, 2), number(stage.forward_write_ms, 2),
        number(stage.downstream_wait_ms, 2), number(stage.queue_wait_ms, 2)]) {
        row.appendChild(el("td", null, value));
      }
      table.appendChild(row);
    }
    usageBox.appendChild(table);
  }
  box.appendChild(usageBox);
}

function chatFailed(box, message) {
  box.appendChild(el("p", "error", message));
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (ignored) {
    // not JSON: the status says enough
  }
  return "HTTP " + response.status;
}

async function send(text) {
  state.messages.push({role: "user", content: text});
  addMessage("user", text);
  const box = addMessage("assistant", "");
  box.dataset.state = "streaming";
  const textNode = box.querySelector(".text");
  const controller = new AbortController();
  state.busy = controller;
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  let answer = "";
  let failed = false;
  const body = {
    model: state.model, messages: state.messages, stream: true, stream_options: {include_usage: true},
    max_tokens: Math.max(1, parseInt($("max-tokens").value, 10) || 128),
    temperature: Math.min(2, Math.max(0, parseFloat($("temperature").value) || 0)),
  };
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers({"Content-Type": "application/json"}), body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (response.status === 401) {
      setKey("");
      showKeyPanel("The key was refused.");
      return;
    }
    if (!response.ok) {
      failed = true;
      chatFailed(box, await errorText(response));
      return;
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) {
            failed = true;
            chatFailed(box, chunk.error.message);
            continue;
          }
          const choice = chunk.choices && chunk.choices[0];
          const piece = choice && choice.delta && choice.delta.content;
          if (piece) {
            answer += piece;
            textNode.textContent = answer;
            box.scrollIntoView({block: "end"});
          }
          if (chunk.usage) renderUsage(box, chunk.usage);
        }
      }
    }
  } catch (error) {
    failed = true;
    chatFailed(box, controller.signal.aborted ? "stopped" : "the stream failed: " + error);
  } finally {
    state.busy = null;
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
    box.dataset.state = failed ? "failed" : "done";
    if (answer) state.messages.push({role: "assistant", content: answer});
    else state.messages.pop();  // an unanswered question is not part of the conversation
  }
}

// -- wiring --------------------------------------------------------------------------------------
function start() {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    $("key-input").value = "";
    setKey(key);
    $("key-error").hidden = true;
    poll();
  });
  $("forget-key").addEventListener("click", () => {
    setKey("");
    clearTimeout(state.timer);
    showKeyPanel("");
  });
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("chat-input").value.trim();
    if (!text || state.busy) return;
    $("chat-input").value = "";
    send(text);
  });
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("chat-stop").addEventListener("click", () => {
    if (state.busy) state.busy.abort();
  });
  $("chat-clear").addEventListener("click", () => {
    if (state.busy) state.busy.abort();
    state.messages = [];
    clear($("messages"));
  });
  poll();
}

start();
