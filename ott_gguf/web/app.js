// ott-gguf chat page: streams answers from llama-server's OpenAI API (/v1/chat/completions, SSE) and keeps a
// line on the K/V cache. Where the numbers come from:
//   context used: the last answer's usage (prompt + completion tokens) as the server reports it;
//   context total: the tokens of one slot, /props default_generation_settings.n_ctx;
//   bytes: /props ui_settings.ott_gguf, which `ott-gguf serve` measures at start (each cache type's allocation by
//   llama.cpp at two context sizes, a line fixed + per_token x tokens) and passes with --ui-config.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { messages: [], controller: null, nCtx: null, slots: null, cache: null, used: 0, usedStale: false,
  tps: null };

function formatBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return i === 0 ? `${Math.round(n)} B` : `${n.toFixed(2)} ${units[i]}`;
}

function renderCache() {
  const c = state.cache;
  // a stopped answer reports no usage: the count is the last finished answer's, the context holds more
  const used = `${state.usedStale ? "≥" : ""}${state.used}`;
  const parts = [`kv ${c ? c.kv_type : "type unknown (no ott_gguf in /props ui_settings)"}`];
  parts.push(`context ${used}/${state.nCtx ?? "?"} tokens`);
  if (c) {
    const at = (t, n) => (c.bytes[t] ? formatBytes(c.bytes[t].fixed + c.bytes[t].per_token * n) : null);
    const all = (n) => [c.kv_type, ...Object.keys(c.bytes).filter((t) => t !== c.kv_type)]
      .map((t) => `${t} ${at(t, n) ?? `not measured (${c.note || "unknown"})`}`).join(", ");
    if (state.used > 0) parts.push(`cache for ${used}: ${all(state.used)}`);
    if (state.nCtx) parts.push(`for ${state.nCtx}: ${all(state.nCtx)}`);
  }
  if (state.tps) parts.push(`${state.tps.toFixed(1)} tokens/s`);
  $("cache").textContent = parts.join(" · ");
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.append(document.createTextNode(text));
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function setBusy(controller) {
  state.controller = controller;
  document.body.dataset.state = controller ? "busy" : "idle";
  $("send").disabled = !!controller;
  $("stop").disabled = !controller;
}

// the server-sent events of a streamed response: each `data:` payload parsed, up to `[DONE]`
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, end);
      buf = buf.slice(end + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("error:")) throw new Error(errorMessage(line.slice(6)));
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function errorMessage(text) {
  try {
    const e = JSON.parse(text);
    return (e.error && e.error.message) || e.message || text;
  } catch {
    return text;
  }
}

async function send(text) {
  state.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const bubble = addMessage("assistant", "");
  const answerNode = bubble.firstChild;
  bubble.dataset.done = "false";
  bubble.dataset.pieces = "0"; // SSE deltas received: the test's evidence of streaming
  const controller = new AbortController();
  setBusy(controller);
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...state.messages] : state.messages;
  const body = {
    messages,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: Number($("max-tokens").value) || 512,
  };
  let answer = "";
  let finish = null;
  let marker = "";
  let failed = false;
  let gotUsage = false;
  try {
    const res = await fetch("v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!res.ok) throw new Error(`HTTP ${res.status}: ${errorMessage(await res.text())}`);
    for await (const ev of sseEvents(res)) {
      const choice = ev.choices && ev.choices[0];
      const piece = choice && choice.delta && choice.delta.content;
      if (piece) {
        answer += piece;
        answerNode.data = answer;
        bubble.dataset.pieces = String(Number(bubble.dataset.pieces) + 1);
        bubble.scrollIntoView({ block: "end" });
      }
      if (choice && choice.finish_reason) finish = choice.finish_reason;
      if (ev.usage) {
        state.used = ev.usage.prompt_tokens + ev.usage.completion_tokens;
        gotUsage = true;
      }
      if (ev.timings && ev.timings.predicted_per_second) state.tps = ev.timings.predicted_per_second;
    }
    if (finish === "length") marker = state.nCtx && state.used >= state.nCtx - 1 ? "[context full]" : "[max tokens]";
  } catch (e) {
    if (e.name === "AbortError") {
      marker = "[stopped]";
    } else {
      failed = true;
      marker = `[error: ${e.message}]`;
      bubble.classList.add("error");
    }
  }
  if (failed && !answer) {
    state.messages.pop(); // nothing was answered: the question leaves the history, as in `ott-gguf chat`
  } else {
    state.messages.push({ role: "assistant", content: answer }); // a stopped answer stays as far as it got
  }
  if (marker) {
    const span = document.createElement("span");
    span.className = "marker";
    span.textContent = (answer ? " " : "") + marker;
    bubble.append(span);
  }
  if (gotUsage) state.usedStale = false;
  else if (!(failed && !answer)) state.usedStale = true; // stopped: the conversation grew by an unknown count
  bubble.dataset.done = "true";
  if (state.controller === controller) setBusy(null);
  renderCache();
}

function newChat() {
  if (state.controller) state.controller.abort();
  state.messages = [];
  state.used = 0;
  state.usedStale = false;
  state.tps = null;
  $("messages").replaceChildren();
  renderCache();
  $("input").focus();
}

async function init() {
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("input").value.trim();
    if (!text || state.controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", newChat);
  try {
    const res = await fetch("props");
    if (!res.ok) throw new Error(`HTTP ${res.status}`);
    const props = await res.json();
    state.nCtx = props.default_generation_settings && props.default_generation_settings.n_ctx;
    state.slots = props.total_slots;
    state.cache = (props.ui_settings && props.ui_settings.ott_gguf) || null;
    const model = String(props.model_alias || props.model_path || "?").split("/").pop();
    $("model").textContent = `${model} · ${state.slots} slots of ${state.nCtx} tokens`;
    if (state.cache) $("cache").title = state.cache.source;
    renderCache();
    setBusy(null);
  } catch (e) {
    $("cache").textContent = `cannot read the server's /props: ${e.message}`;
    document.body.dataset.state = "error";
  }
}

init();
