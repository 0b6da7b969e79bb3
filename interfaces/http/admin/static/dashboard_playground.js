// DACP dashboard, playground: a chat with any chat model through /v1/chat/completions, streamed
// (fetch + ReadableStream, each delta shown as it arrives). /v1 takes the AI API key, not the
// admin key: the operator pastes it (kept in this tab's sessionStorage, like the admin key).
// Plain ES2020, no build step.

const AI_KEY_STORAGE = "dacp.aiKey";

export function createPlayground({ api, failed, el, root }) {
  const state = { messages: [], controller: null };
  const form = root.querySelector("#playground-form");
  const keyInput = root.querySelector("#ai-key");
  const modelSelect = root.querySelector("#playground-model");
  const log = root.querySelector("#chat-log");
  const status = root.querySelector("#playground-status");
  const stop = root.querySelector("#playground-stop");

  keyInput.value = sessionStorage.getItem(AI_KEY_STORAGE) || "";
  keyInput.addEventListener("change", () => sessionStorage.setItem(AI_KEY_STORAGE, keyInput.value.trim()));

  async function loadModels() {
    try {
      const body = await api("/api/admin/models");
      const chosen = modelSelect.value;
      const chat = body.data.filter((m) => m.kind === "chat").sort((a, b) => a.name.localeCompare(b.name));
      modelSelect.replaceChildren(
        ...chat.map((m) =>
          el("option", {
            value: m.name,
            text: m.held_by.length ? m.name : `${m.name} (no node holds it yet)`,
          }),
        ),
      );
      if (chat.some((m) => m.name === chosen)) modelSelect.value = chosen;
      root.querySelector("#playground-empty").hidden = chat.length > 0;
    } catch (error) {
      failed(error);
    }
  }

  function bubble(role, text = "") {
    const body = el("div", { class: "text", text });
    const item = el("li", { class: `msg ${role}`, dataset: { role } }, el("span", { class: "role", text: role }), body);
    log.append(item);
    log.scrollTop = log.scrollHeight;
    return body;
  }

  // The data lines of a server-sent event stream, as they complete.
  async function* events(response) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, end).replace(/\r$/, "");
        buffer = buffer.slice(end + 1);
        if (line.startsWith("data:")) yield line.slice(5).trim();
      }
    }
  }

  async function send(event) {
    event.preventDefault();
    const prompt = form.elements.namedItem("prompt").value.trim();
    const model = modelSelect.value;
    if (!prompt || !model || state.controller) return;
    form.elements.namedItem("prompt").value = "";
    state.messages.push({ role: "user", content: prompt });
    bubble("user", prompt);
    const out = bubble("assistant");
    out.parentElement.classList.add("streaming");
    const key = keyInput.value.trim();
    state.controller = new AbortController();
    stop.hidden = false;
    status.textContent = `asking ${model}...`;
    const started = performance.now();
    let firstAt = null;
    let deltas = 0;
    let reply = "";
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: {
          "Content-Type": "application/json",
          Accept: "text/event-stream",
          ...(key ? { Authorization: `Bearer ${key}` } : {}),
        },
        body: JSON.stringify({ model, messages: state.messages, stream: true }),
        signal: state.controller.signal,
        cache: "no-store",
      });
      if (!response.ok) {
        let message = `HTTP ${response.status}`;
        try {
          message = (await response.json())?.error?.message || message;
        } catch {
          // not JSON: the status says it
        }
        if (response.status === 401) message = `${message} (paste the controller's AI API key above)`;
        throw new Error(message);
      }
      for await (const data of events(response)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "the stream failed");
        const text = chunk.choices?.[0]?.delta?.content;
        if (text) {
          firstAt ??= performance.now();
          deltas += 1;
          reply += text;
          out.textContent = reply;
          log.scrollTop = log.scrollHeight;
        }
      }
      state.messages.push({ role: "assistant", content: reply });
      const ttft = firstAt === null ? "no token" : `first token after ${Math.round(firstAt - started)} ms`;
      status.textContent = `${model}: ${deltas} deltas, ${ttft}, ${Math.round(performance.now() - started)} ms in all`;
    } catch (error) {
      state.messages.pop(); // not answered: not part of the conversation
      out.parentElement.classList.add("failed");
      out.textContent = reply;
      const aborted = error.name === "AbortError";
      status.textContent = aborted ? "stopped" : `failed: ${error.message}`;
      if (!aborted) out.append(el("span", { class: "error", text: ` (${error.message})` }));
    } finally {
      out.parentElement.classList.remove("streaming");
      state.controller = null;
      stop.hidden = true;
    }
  }

  form.addEventListener("submit", send);
  stop.addEventListener("click", () => state.controller?.abort());
  root.querySelector("#playground-clear").addEventListener("click", () => {
    state.messages = [];
    log.replaceChildren();
    status.textContent = "";
  });
  return {
    show() {
      loadModels();
    },
    hide() {},
    changed() {
      loadModels();
    },
    reset() {
      state.controller?.abort();
      state.messages = [];
      log.replaceChildren();
      status.textContent = "";
    },
  };
}
