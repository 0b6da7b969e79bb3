// DACP dashboard, models panel: the registered models (GET /api/admin/models), the nodes that
// hold each one, and the admin API's model actions: pull onto nodes, evict from a node,
// register a model, add a source URL. Plain ES2020, no build step.

const POLL_MS = 5000;

export function createModels({ api, failed, toast, el, short, size, nodes, root }) {
  // picked: the nodes the operator ticked to pull each model onto, kept across the re-renders
  // that polls and events cause, so a refresh never unticks a box.
  const state = { models: [], timer: null, visible: false, busy: false, picked: new Map() };

  function picked(model) {
    if (!state.picked.has(model)) state.picked.set(model, new Set());
    return state.picked.get(model);
  }

  const post = (path, body) =>
    api(path, { method: "POST", body: JSON.stringify(body) });

  function availability(model) {
    if (model.held_by.length) return el("span", { class: "yes", text: "available" });
    if (model.stored) return el("span", { class: "late", text: "in the store: fetched on demand" });
    if (model.sources.length) return el("span", { class: "late", text: "fetched from its source on demand" });
    return el("span", { class: "no", text: "not available: no node holds it" });
  }

  function holders(model) {
    if (!model.held_by.length) return el("span", { class: "muted", text: "none" });
    return el(
      "span",
      { class: "holders" },
      ...model.held_by.map((name) =>
        el(
          "span",
          { class: "holder", dataset: { node: name } },
          el("span", { class: "holder-name", text: name }),
          el("button", {
            type: "button",
            class: "danger small evict",
            text: "Evict",
            title: `Delete ${model.file_name} from ${name}'s disk`,
            onclick: () => act(`evict ${model.name} from ${name}`, "/api/admin/models/evict", { model: model.name, node: name }),
          }),
        ),
      ),
    );
  }

  // Pull onto the chosen nodes: those connected that do not hold it yet.
  function pullCell(model) {
    const candidates = nodes()
      .filter((n) => n.connected && !n.revoked && !model.held_by.includes(n.name))
      .sort((a, b) => String(a.name).localeCompare(String(b.name)));
    if (!candidates.length) return el("span", { class: "muted", text: "every connected node holds it" });
    const boxes = candidates.map((n) =>
      el(
        "label",
        { class: "pick" },
        el("input", {
          type: "checkbox",
          value: n.name,
          dataset: { node: n.name },
          checked: picked(model.name).has(n.name),
          onchange: (event) => {
            if (event.currentTarget.checked) picked(model.name).add(n.name);
            else picked(model.name).delete(n.name);
          },
        }),
        ` ${n.name || short(n.node_id)}`,
      ),
    );
    const form = el(
      "form",
      {
        class: "pull",
        onsubmit: (event) => {
          event.preventDefault();
          const chosen = boxes.map((b) => b.querySelector("input")).filter((i) => i.checked).map((i) => i.value);
          if (!chosen.length) return toast("Choose the nodes to pull onto.", true);
          act(`pull ${model.name} onto ${chosen.join(", ")}`, "/api/admin/models/pull", { model: model.name, nodes: chosen })
            .then((answer) => answer && state.picked.delete(model.name));
        },
      },
      ...boxes,
      el("button", { type: "submit", class: "small", text: "Pull" }),
    );
    return form;
  }

  function row(model) {
    return el(
      "tr",
      { dataset: { model: model.name } },
      el(
        "td",
        {},
        el("span", { class: "name", text: model.name }),
        el("span", { class: "sub", text: `${model.kind} · context ${model.context_size}` }),
      ),
      el(
        "td",
        {},
        el("span", { class: "file-name", text: model.file_name }),
        el("span", { class: "sub mono", title: model.sha256, text: `sha256 ${model.sha256.slice(0, 12)}…` }),
        model.shape?.size_bytes ? el("span", { class: "sub", text: size(model.shape.size_bytes) }) : null,
      ),
      el("td", { class: "availability" }, availability(model)),
      el("td", { class: "held-by" }, holders(model)),
      el(
        "td",
        { class: "sources" },
        model.sources.length
          ? el("ul", { class: "plain" }, ...model.sources.map((url) => el("li", { class: "source-url", text: url })))
          : el("span", { class: "muted", text: model.stored ? "controller store" : "none" }),
      ),
      el("td", { class: "pull-cell" }, pullCell(model)),
    );
  }

  function render() {
    const body = root.querySelector("#models-table").tBodies[0];
    body.replaceChildren(...state.models.map(row));
    root.querySelector("#models-empty").hidden = state.models.length > 0;
    root.querySelector("#models-count").textContent = state.models.length
      ? `${state.models.length} registered`
      : "";
    const select = root.querySelector("#source-model");
    const chosen = select.value;
    select.replaceChildren(...state.models.map((m) => el("option", { value: m.name, text: m.name })));
    if (state.models.some((m) => m.name === chosen)) select.value = chosen;
  }

  async function refresh() {
    try {
      const body = await api("/api/admin/models");
      state.models = body.data.slice().sort((a, b) => a.name.localeCompare(b.name));
      render();
    } catch (error) {
      failed(error);
    }
  }

  // One action at a time: busy only while its request is in flight (not while the table
  // refreshes after it), and a click meanwhile says so instead of doing nothing.
  async function act(what, path, body) {
    if (state.busy) {
      toast(`${what}: wait for the action in progress`, true);
      return null;
    }
    state.busy = true;
    let answer;
    try {
      answer = await post(path, body);
    } catch (error) {
      failed(error);
      return null;
    } finally {
      state.busy = false;
    }
    const pulls = answer?.transfers;
    toast(pulls ? `${what}: ${pulls.length} transfer${pulls.length === 1 ? "" : "s"} started` : `${what}: done`);
    await refresh();
    return answer;
  }

  function field(form, name) {
    return form.elements.namedItem(name).value.trim();
  }

  root.querySelector("#register-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const form = event.currentTarget;
    const body = {
      name: field(form, "name"),
      sha256: field(form, "sha256").toLowerCase(),
      file_name: field(form, "file_name"),
      kind: field(form, "kind"),
    };
    const context = field(form, "context_size");
    if (context) body.context_size = Number(context);
    if (await act(`register ${body.name}`, "/api/admin/models", body)) form.reset();
  });
  root.querySelector("#source-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const form = event.currentTarget;
    const body = { model: field(form, "model"), url: field(form, "url") };
    if (await act(`add a source to ${body.model}`, "/api/admin/models/sources", body)) {
      form.elements.namedItem("url").value = "";
    }
  });

  function schedule() {
    clearInterval(state.timer);
    state.timer = state.visible ? setInterval(refresh, POLL_MS) : null;
  }

  return {
    show() {
      state.visible = true;
      schedule();
      refresh();
    },
    hide() {
      state.visible = false;
      schedule();
    },
    // A model or node event: holders and sources may have changed.
    changed() {
      if (state.visible) refresh();
    },
    reset() {
      state.visible = false;
      schedule();
      state.models = [];
    },
  };
}
