// The openk3 chat page: talks to this server's /v1/chat/completions with stream=true and renders the SSE
// chunks of docs/serving.md (reasoning deltas, content deltas, whole tool calls, finish, usage, [DONE]).
// Model output only ever reaches the page through textContent, never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model-name"), effort: $("effort"), thinking: $("thinking"), newChat: $("new-chat"),
  apiKey: $("api-key"), system: $("system"), maxTokens: $("max-tokens"),
  log: $("log"), error: $("error"), form: $("composer"), input: $("input"), send: $("send"), stop: $("stop"),
};

// Settings kept across visits (localStorage key -> element). The conversation itself is not stored.
const STORED = {
  "openk3.apiKey": ui.apiKey, "openk3.system": ui.system, "openk3.maxTokens": ui.maxTokens,
  "openk3.effort": ui.effort, "openk3.thinking": ui.thinking,
};

const chat = {
  model: null,       // the id /v1/models lists (every request must name it)
  history: [],       // the messages sent so far and the assistant's replies, as the API takes them
  controller: null,  // the AbortController of the request in flight, null when idle
};

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = ui.apiKey.value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function showError(message) {
  ui.error.textContent = message;
  ui.error.hidden = !message;
}

// The readable form of an error answer: the server's {"error": {...}} envelope, else the status line.
async function describeError(response) {
  let body = null;
  try { body = await response.json(); } catch (_) { /* not JSON: fall back to the status */ }
  const err = body && body.error;
  if (err && err.message) {
    return `${response.status} ${err.type || "error"}: ${err.message}` + (err.param ? ` (field ${err.param})` : "");
  }
  return `${response.status} ${response.statusText || "error"}`;
}

let modelQuery = 0;  // numbers the /v1/models requests: only the latest one's answer is shown

async function loadModel() {
  const query = ++modelQuery;
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (query !== modelQuery) return false;  // a newer key is being checked
    if (!r.ok) {
      ui.model.textContent = "(unavailable)";
      showError("Could not list the model: " + await describeError(r));
      return false;
    }
    const body = await r.json();
    chat.model = body.data[0].id;
    ui.model.textContent = chat.model;
    showError("");
    return true;
  } catch (e) {
    if (query !== modelQuery) return false;
    ui.model.textContent = "(unreachable)";
    showError("The server did not answer: " + e.message);
    return false;
  }
}

// ---- rendering one message ---------------------------------------------------------------------------

function addMessage(role) {
  const node = el("article", "msg " + role);
  node.setAttribute("aria-label", role === "user" ? "You" : "Assistant");
  node.append(el("div", "role", role === "user" ? "You" : "Assistant"));
  ui.log.append(node);
  return node;
}

function addUserMessage(text) {
  const node = addMessage("user");
  node.append(el("div", "content", text));
  scrollDown();
  return node;
}

// An assistant reply being streamed: its thinking block (made on the first reasoning delta), its text,
// its tool calls, and the message that goes back into the history.
class Reply {
  constructor() {
    this.node = addMessage("assistant");
    this.thinking = null;
    this.content = el("div", "content");
    this.node.append(this.content);
    this.status = el("div", "status");
    this.node.append(this.status);
    this.message = { role: "assistant", content: "" };
    this.reasoning = "";
    this.finish = null;
  }

  addReasoning(text) {
    if (!this.thinking) {
      // Open while the model thinks; folded once the answer starts (the summary opens it again).
      this.thinking = el("details", "thinking");
      this.thinking.open = true;
      this.thinking.append(el("summary", "", "Thinking"), el("div", "text"));
      this.node.insertBefore(this.thinking, this.content);
    }
    this.reasoning += text;
    this.thinking.lastChild.textContent = this.reasoning;
  }

  foldThinking() {
    if (this.thinking && this.thinking.open && !this.folded) this.thinking.open = false;
    this.folded = true;
  }

  addContent(text) {
    this.foldThinking();
    this.message.content += text;
    this.content.textContent = this.message.content;
  }

  addToolCall(call) {
    this.foldThinking();
    const fn = call.function || {};
    let args = fn.arguments || "";
    try { args = JSON.stringify(JSON.parse(args), null, 2); } catch (_) { /* shown as sent */ }
    const block = el("div", "tool-call");
    block.setAttribute("role", "group");
    block.setAttribute("aria-label", "Tool call " + (fn.name || ""));
    const head = el("div");
    head.append(el("span", "label", "Tool call "), el("span", "name", fn.name || "?"));
    block.append(head, el("pre", "arguments", args));
    this.node.insertBefore(block, this.status);
    (this.message.tool_calls = this.message.tool_calls || []).push(
      { id: call.id, type: call.type || "function", function: { name: fn.name, arguments: fn.arguments } });
  }

  setStatus(text, failed) {
    this.status.textContent = text;
    this.status.classList.toggle("failed", !!failed);
  }

  // The message for the next turn's history: past thinking goes back as reasoning_content.
  historyMessage() {
    const m = { ...this.message };
    if (this.reasoning) m.reasoning_content = this.reasoning;
    return m;
  }

  get empty() {
    return !this.message.content && !this.reasoning && !this.message.tool_calls;
  }
}

function scrollDown() {
  ui.log.scrollTop = ui.log.scrollHeight;
}

// ---- one request -------------------------------------------------------------------------------------

function requestBody() {
  const messages = [];
  const system = ui.system.value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...chat.history);
  const body = { model: chat.model, messages, stream: true, stream_options: { include_usage: true } };
  if (ui.thinking.checked) body.reasoning_effort = ui.effort.value;
  else body.chat_template_kwargs = { thinking: false };
  const maxTokens = parseInt(ui.maxTokens.value, 10);
  if (maxTokens > 0) body.max_completion_tokens = maxTokens;
  return body;
}

// Calls onEvent with each `data:` payload of an SSE body (events end with a blank line).
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length && onEvent(data.join("\n")) === false) return;
    }
  }
}

function applyChunk(reply, chunk) {
  if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
  if (chunk.usage) reply.usage = chunk.usage;
  for (const choice of chunk.choices || []) {
    const d = choice.delta || {};
    const reasoning = d.reasoning_content ?? d.reasoning;
    if (reasoning) reply.addReasoning(reasoning);
    if (d.content) reply.addContent(d.content);
    for (const call of d.tool_calls || []) reply.addToolCall(call);
    if (choice.finish_reason) reply.finish = choice.finish_reason;
  }
  scrollDown();
}

function setBusy(busy) {
  ui.send.disabled = busy;
  ui.stop.disabled = !busy;
  ui.newChat.disabled = busy;
}

async function send() {
  const text = ui.input.value.trim();
  if (!text || chat.controller) return;
  showError("");
  if (!chat.model && !(await loadModel())) return;
  chat.history.push({ role: "user", content: text });
  const userNode = addUserMessage(text);
  ui.input.value = "";
  const reply = new Reply();
  chat.controller = new AbortController();
  setBusy(true);
  let failure = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()), signal: chat.controller.signal,
    });
    if (!response.ok) {
      failure = await describeError(response);
    } else {
      await readEvents(response, (data) => {
        if (data === "[DONE]") return false;
        applyChunk(reply, JSON.parse(data));
        return true;
      });
    }
  } catch (e) {
    failure = e.name === "AbortError" ? null : e.message;
    if (e.name === "AbortError") reply.finish = "stopped";
  } finally {
    chat.controller = null;
    setBusy(false);
  }
  if (failure !== null && reply.empty) {
    // Nothing came back: take the turn out again and give the text back to edit or resend.
    chat.history.pop();
    userNode.remove();
    reply.node.remove();
    ui.input.value = text;
    showError(failure);
  } else {
    if (failure !== null) showError(failure);
    chat.history.push(reply.historyMessage());
    const usage = reply.usage ? ` · ${reply.usage.completion_tokens} tokens` : "";
    reply.setStatus(failure !== null ? "failed: " + failure : (reply.finish || "") + usage, failure !== null);
  }
  ui.input.focus();
}

function newChat() {
  if (chat.controller) return;
  chat.history = [];
  ui.log.replaceChildren();
  showError("");
  ui.input.focus();
}

// ---- wiring -------------------------------------------------------------------------------------------

function restoreSettings() {
  for (const [key, field] of Object.entries(STORED)) {
    const value = localStorage.getItem(key);
    if (value === null) continue;
    if (field.type === "checkbox") field.checked = value === "true";
    else field.value = value;
  }
  ui.effort.disabled = !ui.thinking.checked;
}

function saveSetting(key, field) {
  localStorage.setItem(key, field.type === "checkbox" ? String(field.checked) : field.value);
}

function init() {
  restoreSettings();
  for (const [key, field] of Object.entries(STORED)) {
    field.addEventListener("change", () => saveSetting(key, field));
  }
  ui.thinking.addEventListener("change", () => { ui.effort.disabled = !ui.thinking.checked; });
  ui.apiKey.addEventListener("change", loadModel);  // a new key: check it at once
  ui.form.addEventListener("submit", (e) => { e.preventDefault(); send(); });
  ui.input.addEventListener("keydown", (e) => {
    // Enter sends, Shift+Enter is a new line; an IME composition's Enter only confirms the composition.
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    } else if (e.key === "Escape" && chat.controller) {
      chat.controller.abort();
    }
  });
  ui.stop.addEventListener("click", () => { if (chat.controller) chat.controller.abort(); });
  ui.newChat.addEventListener("click", newChat);
  loadModel();
  ui.input.focus();
}

init();
